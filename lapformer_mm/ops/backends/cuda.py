"""The CUDA backend of the attention op (``impl='cupy'``): 4 launches forward, 5 backward.

The kernels are ``lapformer_mm/csrc/cuda/nystrom_attention.cu``, compiled at run time by
NVRTC through CuPy for the device's own architecture (:mod:`._cuda_launch`). The math is
the reference's (:mod:`lapformer_mm.ops.reference`, the stage functions the kernels'
comments name); the op (:mod:`lapformer_mm.ops.attention`) asks :func:`not_supported`
first and runs the reference where this returns reasons, so nothing here falls back.

Operands and results are those of the op's contract: q (B, h, N, d), k None when keys are
tied, v (B, h, N, d_v), landmarks (B, h, m, d), any strides, one dtype; out (B, N, h, d_v)
contiguous; context, inverse and stats fp32. ``opts`` is any object with the attributes
kernel, lam, eps, iters, ns_init, ns_refine, normalize, whiten_eps.
"""
import functools
from typing import NamedTuple

import torch

from . import _cuda_launch as cl

NAME = 'cupy'
DEVICE = 'cuda'

#: The oldest architecture the kernels are written for (no instruction needs more).
MIN_CAPABILITY = (6, 0)
#: NVRTC 13 dropped every architecture below this one.
NVRTC13_MIN_CAPABILITY = (7, 5)
# Sizes are 32-bit ints in the kernels; the margin keeps "size + tile - 1" from overflowing.
_MAX_SIZE = 2 ** 31 - 2 ** 16
_F32 = torch.float32


_AVAILABLE = []


def available():
    """True when ``import cupy`` succeeds (checked once; CuPy is imported here, never at
    module import)."""
    if not _AVAILABLE:
        try:
            cl.import_cupy()
            _AVAILABLE.append(True)
        except Exception:  # a broken CUDA install raises more than ImportError
            _AVAILABLE.append(False)
    return _AVAILABLE[0]


class DeviceLimits(NamedTuple):
    capability: tuple
    sms: int
    smem_optin: int       # shared memory a block may opt into (static + dynamic), bytes
    nvrtc_major: int      # 0 when unknown


@functools.lru_cache(maxsize=None)
def _device_limits(index):
    props = torch.cuda.get_device_properties(index)
    optin = int(getattr(props, 'shared_memory_per_block_optin', 0) or 0)
    nvrtc = 0
    try:
        cupy = cl.import_cupy()
        if not optin:
            optin = int(cupy.cuda.Device(index).attributes['MaxSharedMemoryPerBlockOptin'])
        nvrtc = cupy.cuda.nvrtc.getVersion()[0]
    except Exception:  # no attribute on this CuPy/driver: the limit every GPU allows
        optin = optin or cl.DEFAULT_SMEM
    return DeviceLimits((props.major, props.minor), props.multi_processor_count, optin, nvrtc)


def device_limits(device):
    """:class:`DeviceLimits` of a CUDA device (cached per device)."""
    return _device_limits(device.index if device.index is not None else
                          torch.cuda.current_device())


def target_blocks(device):
    """Blocks that keep every SM busy: 4 per SM."""
    return 4 * device_limits(device).sms


@functools.lru_cache(maxsize=None)
def _device_reasons(limits):
    if limits.capability < MIN_CAPABILITY:
        return (f'compute capability {limits.capability[0]}.{limits.capability[1]}; the CUDA '
                f'kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later',)
    if limits.nvrtc_major >= 13 and limits.capability < NVRTC13_MIN_CAPABILITY:
        return (f'NVRTC {limits.nvrtc_major} cannot compile for sm_{limits.capability[0]}'
                f'{limits.capability[1]}; install cupy-cuda12x (NVRTC 12)',)
    return ()


def _plan(q, v, landmarks):
    return cl.plan(landmarks.shape[2], v.shape[3], device_limits(q.device).smem_optin)


def not_supported(q, k, v, landmarks, opts):
    """Why this backend cannot run these operands (empty: it can). Never raises."""
    try:
        reasons = []
        if q.dtype not in cl.ELEMENT_TYPES:
            reasons.append(f'dtype {q.dtype}; the CUDA kernels take '
                           f'{", ".join(str(t) for t in cl.ELEMENT_TYPES)}')
        if q.numel() == 0 or v.numel() == 0 or landmarks.numel() == 0:
            reasons.append('empty operands')
        sizes = dict(n=q.shape[2], d=q.shape[3], bh=q.shape[0] * q.shape[1],
                     elements=max(q.numel(), v.numel()))
        reasons += [f'{name} = {value:,} exceeds the kernels\' 32-bit index range'
                    for name, value in sizes.items() if value > _MAX_SIZE]
        if opts.kernel not in cl.KINDS:
            reasons.append(f'kernel {opts.kernel!r}; the CUDA kernels take {", ".join(cl.KINDS)}')
        reasons += _device_reasons(device_limits(q.device))
        plan = _plan(q, v, landmarks)
        if not isinstance(plan, cl.Plan):
            reasons += plan
        return tuple(reasons)
    except Exception as exc:  # a device that cannot even be queried
        return (f'the device could not be queried ({type(exc).__name__}: {exc})',)


def _shapes(**tensors):
    """The operands' shapes for an error message, formatted only if one is raised."""
    return lambda: ', '.join(f'{k} {tuple(v.shape)} {v.dtype}' for k, v in tensors.items())


def _common_params(q, k, v, landmarks, opts, plan, n_splits, chunk):
    batch, heads, n, d = q.shape
    kind = cl.KINDS[opts.kernel]
    p = cl.new_params()
    for name, t in (('q', q), ('k', k), ('v', v), ('L', landmarks)):
        cl.set_operand(p, name, t)
    p['bh_count'] = batch * heads
    p['heads'], p['n'], p['m'], p['d'], p['dv'] = heads, n, landmarks.shape[2], d, v.shape[3]
    p['chunk'], p['splits'] = chunk, n_splits
    p['iters'], p['init_authors'] = opts.iters, opts.ns_init == 'authors'
    p['refine'], p['injective'] = bool(opts.ns_refine), opts.normalize == 'injective'
    p['neg_inv_lam'] = -1.0 / opts.lam
    p['neg_coef'] = -(1.0 if kind == cl.KINDS['laplacian'] else 2.0) / opts.lam
    p['eps'], p['whiten_eps'] = opts.eps, opts.whiten_eps
    return p


class _Call(NamedTuple):
    """What every launch of one op call shares."""
    plan: cl.Plan
    names: tuple
    tensor: torch.Tensor
    smem_limit: int
    shapes: object

    def launch(self, stage, grid, params, shared_mem=0):
        cl.launch(self.names[cl.STAGES.index(stage)], self.plan.variant, self.tensor, grid,
                  self.plan.variant.block, params, shared_mem=shared_mem, shapes=self.shapes,
                  smem_limit=self.smem_limit)


@functools.lru_cache(maxsize=None)
def _names(dtype, kind):
    return tuple(cl.kernel_name(s, cl.ELEMENT_TYPES[dtype], kind) for s in cl.STAGES)


def _prepare(q, v, landmarks, opts, shapes):
    plan = _plan(q, v, landmarks)
    bh = q.shape[0] * q.shape[1]
    n_splits, chunk = cl.splits(bh, q.shape[2], target_blocks(q.device), plan.variant.tn)
    call = _Call(plan, _names(q.dtype, cl.KINDS[opts.kernel]), q,
                 device_limits(q.device).smem_optin, shapes)
    return call, bh, n_splits, chunk


def forward(q, k, v, landmarks, opts):
    """(out, context, inverse, stats) of the op's contract, in 4 launches."""
    call, bh, n_splits, chunk = _prepare(q, v, landmarks, opts,
                                         _shapes(q=q, v=v, landmarks=landmarks))
    batch, heads, n, _ = q.shape
    m, dv = landmarks.shape[2], v.shape[3]
    device = q.device
    injective = opts.normalize == 'injective'
    out = torch.empty(batch, n, heads, dv, dtype=q.dtype, device=device)
    context = torch.empty(batch, heads, m, dv, dtype=_F32, device=device)
    inverse = torch.empty(batch, heads, m, m, dtype=_F32, device=device)
    stats = torch.empty(batch, heads, 2 if injective else 0, m, dtype=_F32, device=device)
    part_floats = bh * n_splits * (2 * m + m * dv)
    fold_floats = bh * (m + 1) * dv
    work = torch.empty(part_floats + fold_floats + bh * (m * m + m * dv), dtype=_F32,
                       device=device)
    p = _common_params(q, k, v, landmarks, opts, call.plan, n_splits, chunk)
    p['out'], p['context'] = out.data_ptr(), context.data_ptr()
    p['inverse'], p['stats'] = inverse.data_ptr(), stats.data_ptr()
    base = work.data_ptr()
    p['part'], p['fold'] = base, base + 4 * part_floats
    p['work'] = base + 4 * (part_floats + fold_floats)
    variant = call.plan.variant
    bh_grid = min(bh, cl.MAX_GRID_YZ)
    pass_grid = (n_splits, bh_grid)
    # Job 0 of a (batch, head) is the Newton-Schulz block, the others merge the slices.
    jobs = 1 + -(-(m + m * dv) // variant.lanes)
    tiles = -(-n // variant.tn)
    call.launch('nys_forward_stats', pass_grid, p)
    call.launch('nys_forward_solve', (min(jobs, cl.MAX_GRID_X), bh_grid), p, call.plan.solve_smem)
    call.launch('nys_forward_context', (min(-(-dv // variant.cc), cl.MAX_GRID_X), bh_grid), p)
    call.launch('nys_forward_out', (min(tiles, cl.MAX_GRID_X), bh_grid), p)
    return out, context, inverse, stats


def _token_layout(batch, heads, n, width, like):
    """An uninitialised (B, h, n, width) view of a contiguous (B, n, h, width) tensor."""
    return torch.empty(batch, n, heads, width, dtype=like.dtype,
                       device=like.device).transpose(1, 2)


def backward(grad, q, k, v, landmarks, context, inverse, stats, opts):
    """(dq, dk, dv, dlandmarks) of the op's contract, in 5 launches; dk is empty when k is None."""
    call, bh, n_splits, chunk = _prepare(
        q, v, landmarks, opts, _shapes(grad=grad, q=q, v=v, landmarks=landmarks))
    batch, heads, n, d = q.shape
    m, dv = landmarks.shape[2], v.shape[3]
    grad = grad if grad.dtype == q.dtype else grad.to(q.dtype)
    # The token layout (B, N, h, .), as the module's projections have it: their backward
    # then needs no copy. The landmarks' gradient takes their strides when dense.
    dq = _token_layout(batch, heads, n, d, q)
    dk = None if k is None else _token_layout(batch, heads, n, d, q)
    dv_out = _token_layout(batch, heads, n, dv, q)
    dl = torch.empty_like(landmarks)
    reduce_floats = bh * n_splits * (m * dv + dv)
    # Per (batch, head): dR, a, W = (dP + dP^T) * k(L, L), the merged T and colsum(G)
    # (the .cu's nys_backward_work_stride).
    work_floats = bh * (2 * m * dv + m + m * m + dv)
    work = torch.empty(reduce_floats + work_floats + bh * n_splits * m * d, dtype=_F32,
                       device=q.device)
    p = _common_params(q, k, v, landmarks, opts, call.plan, n_splits, chunk)
    sb, sn, sh, sd = grad.stride()
    cl.set_operand(p, 'g', grad, (sb, sh, sn, sd))
    for name, t in (('grad_q', dq), ('grad_k', dk), ('grad_v', dv_out), ('grad_l', dl)):
        cl.set_operand(p, name, t)
    p['context'], p['inverse'], p['stats'] = (context.data_ptr(), inverse.data_ptr(),
                                              stats.data_ptr())
    base = work.data_ptr()
    p['part'], p['work'] = base, base + 4 * reduce_floats
    p['lpart'] = base + 4 * (reduce_floats + work_floats)
    p['solve_cols'] = call.plan.backward_solve_cols
    lanes = call.plan.variant.lanes
    bh_grid = min(bh, cl.MAX_GRID_YZ)
    pass_grid = (n_splits, bh_grid)
    call.launch('nys_backward_reduce', pass_grid, p)
    call.launch('nys_backward_merge', (min(-(-(m * dv + dv) // lanes), cl.MAX_GRID_X), bh_grid), p)
    call.launch('nys_backward_solve', (min(bh, cl.MAX_GRID_X),), p, call.plan.backward_solve_smem)
    call.launch('nys_backward_grads', pass_grid, p, call.plan.grads_smem)
    call.launch('nys_backward_landmarks', (min(-(-(m * d) // lanes), cl.MAX_GRID_X), bh_grid), p)
    return dq, q.new_empty(0) if dk is None else dk, dv_out, dl


def warmup(device=None, dtypes=(torch.float32,), value_dims=(32, 64), m=cl.MAX_M):
    """Compile, load and opt in the kernels the op will pick on ``device`` for these dtypes
    and value widths, ahead of any CUDA-graph capture (a first use inside a capture raises
    :class:`~._cuda_launch.CaptureError`). Returns the variants loaded."""
    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    device = torch.device('cuda', index)
    limits = device_limits(device)
    loaded = []
    for dv in value_dims:
        plan = cl.plan(m, dv, limits.smem_optin)
        if not isinstance(plan, cl.Plan):
            continue
        for dtype in dtypes:
            cl.load_group(device.index, plan.variant, cl.ELEMENT_TYPES[dtype], limits.smem_optin)
            loaded.append((plan.variant.name, dtype))
    return loaded
