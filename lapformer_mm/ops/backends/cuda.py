"""The CUDA backend of the attention op (``impl='cupy'``): 4 launches forward, 5 backward.

The kernels (``lapformer_mm/csrc/cuda/nystrom_attention.cu``, the math of
:mod:`lapformer_mm.ops.reference`) are compiled at run time by NVRTC through CuPy, imported
on first use, for the device's own architecture, and run on PyTorch's current stream. The
op asks :func:`not_supported` first and runs the reference where it returns reasons.
Plain Python up to :func:`launch`, which the g++ emulation replaces: the tile geometry
(:data:`VARIANTS`, NVRTC ``-D`` options, part of CuPy's cache key), :func:`plan` (what fits
a device's shared-memory opt-in limit) and the kernels' one by-value argument
``nys_params`` (:data:`PARAMS_DTYPE`: CuPy 13 and 14 pass a numpy array of size one by
value, ``CNumpyArray``). Operands follow the op's contract (q, v, landmarks (B, h, ., .)
with any strides, k None when tied; out (B, N, h, d_v)); ``opts`` has kernel, lam, eps,
iters, ns_init, ns_refine, normalize, whiten_eps. Compile, load and opt-in happen once per
(device, variant, element type), never inside a CUDA-graph capture (:class:`CaptureError`).
"""
import functools
import hashlib
import json
import os
import re
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..reference import KERNEL_CODES

NAME = 'cupy'
DEVICE = 'cuda'
#: What makes the backend usable where it is not.
INSTALL_HINT = 'pip install cupy-cuda12x or cupy-cuda13x (matching the CUDA driver)'
SOURCE = 'nystrom_attention.cu'
#: NVRTC options besides the variant's ``-D`` ones. CuPy adds the device's architecture.
NVRTC_OPTIONS = ('-std=c++17',)

#: torch dtype -> C++ element type of the kernels (fp64 runs the reference).
ELEMENT_TYPES = {torch.float32: 'float', torch.float16: 'lap_half', torch.bfloat16: 'lap_bf16'}

FORWARD = ('nys_forward_stats', 'nys_forward_solve', 'nys_forward_context', 'nys_forward_out')
BACKWARD = ('nys_backward_reduce', 'nys_backward_merge', 'nys_backward_solve',
            'nys_backward_grads', 'nys_backward_landmarks')
STAGES = FORWARD + BACKWARD
#: Stages that evaluate no kernel function: no KIND template argument.
NO_KIND = ('nys_forward_context', 'nys_backward_merge')

#: The oldest architecture the kernels are written for (no instruction needs more).
MIN_CAPABILITY = (6, 0)
#: NVRTC 13 dropped every architecture below this one.
NVRTC13_MIN_CAPABILITY = (7, 5)
MAX_GRID_YZ = 65535
MAX_GRID_X = 2 ** 31 - 1
# Sizes are 32-bit ints in the kernels; the margin keeps "size + tile - 1" from overflowing.
_MAX_SIZE = 2 ** 31 - 2 ** 16
#: lap_common.cuh's layout of ns_iterate: floats of one k-split partial, the row strides.
NS_PART_STRIDE, NS_LD_NARROW, NS_LD_WIDE = 20, 52, 68
#: ns_iterate's static norm scalar, as ptxas reports it (counts against the limit).
NS_STATIC_SMEM = 16
#: Shared memory every CUDA device gives a block without opting in.
DEFAULT_SMEM = 48 * 1024
_F32 = torch.float32


def kernel_name(stage, element_type, kind):
    """Template instantiation of a stage; the stages of :data:`NO_KIND` have no KIND."""
    return f'{stage}<{element_type}>' if stage in NO_KIND else f'{stage}<{element_type}, {kind}>'


def kernel_names(element_types=tuple(ELEMENT_TYPES.values())):
    """Every instantiation the host can launch for these element types (one compile)."""
    return list(dict.fromkeys(kernel_name(stage, element, kind) for element in element_types
                              for kind in KERNEL_CODES.values() for stage in STAGES))


class Variant(NamedTuple):
    """Tile geometry (the .cu's NYS_* macros): landmark and value columns of a tile (mp, dv),
    rows of a row-pass / gradient tile (tn, tb), the staged d-chunk (tk), threads (tx, ty),
    entries per block of the slice merges (lanes: one warp's coalesced row), value columns
    per block of the context kernel (cc) and thread rows of the forward solve (sy)."""
    name: str
    mp: int
    dv: int
    tn: int
    tb: int
    tk: int = 16
    tx: int = 16
    ty: int = 16
    lanes: int = 32
    cc: int = 8
    sy: int = 32

    @property
    def defines(self):
        return tuple(f'-DNYS_{key.upper()}={getattr(self, key)}' for key in self._fields[1:])

    @property
    def threads(self):
        return self.tx * self.ty

    @property
    def block(self):
        return (self.tx, self.ty, 1)


#: Value tiles fitted to d_v <= 32 (Tiny's heads) or <= 64; gradient tiles of 32 rows, or 16
#: where the device's shared memory is smaller (T4, RTX 20xx: 64 KiB).
VARIANTS = (
    Variant('dv32_tb32', 64, 32, 64, 32),
    Variant('dv32_tb16', 64, 32, 64, 16),
    Variant('dv64_tb32', 64, 64, 64, 32),
    Variant('dv64_tb16', 64, 64, 64, 16),
)
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}
MAX_M = max(v.mp for v in VARIANTS)
MAX_DV = max(v.dv for v in VARIANTS)


def _ceil_div(a, b):
    return -(-a // b)


def ns_layout(m):
    """(mp, ld): m padded to the 4 x 4 micro-tile and the row stride of ns_iterate's
    matrices (lap_common.cuh's ns_stride)."""
    mp = _ceil_div(m, 4) * 4
    return mp, (NS_LD_NARROW if mp <= NS_LD_NARROW else NS_LD_WIDE)


def grads_smem(v):
    """Dynamic shared memory (bytes) of nys_backward_grads: the layout at its top."""
    dw = max(v.mp, v.dv)
    return 4 * (2 * v.mp * (v.dv + 1) + 2 * v.tb * (v.mp + 1) + 2 * v.tb * (dw + 1)
                + v.tk * (v.tb + 1) + v.tk * (v.mp + 1) + 3 * v.mp + 2 * v.tb + 2 * v.dv)


def row_pass_static_smem(v):
    """Static shared memory (bytes) of the largest row-pass kernel (nys_forward_out or
    nys_forward_stats); it must stay within the 48 KiB every device has."""
    staging = v.tk * (v.tn + 1) + v.tk * (v.mp + 1) + v.tn * (v.mp + 1) + 2 * v.tn
    # The values, the statistics' group sums and the fp64 group sums of the common part
    # and of sum r.
    stats = (staging + v.tn * (v.dv + 1) + 2 * (v.threads // v.mp) * v.mp + 2 * v.threads
             + 2 * (v.threads // v.dv))
    out = staging + v.mp * (v.dv + 1) + v.dv
    return 4 * max(stats, out)


def context_static_smem(v):
    """Static shared memory (bytes) of nys_forward_context: X, P, R and the context columns."""
    return 4 * (2 * v.mp * (v.mp + 1) + 2 * v.mp * (v.cc + 1) + v.mp)


def landmark_tile_floats(v):
    """Floats of the kernel tile of the landmarks against themselves (NYS_LTILE)."""
    return (2 * v.tk + v.mp) * (v.mp + 1)


def ns_partials(v, m, smem_limit):
    """Floats of ns_iterate's k-split partials in nys_forward_solve on a device with this
    limit, for Newton's P X and X (P X) over all nt^2 4 x 4 tiles, the product steps' X R
    beside R R over the upper triangle's nt (nt + 1) twice and the last one's X R over
    nt (nt + 1) / 2. Splits per product as
    lap_common.cuh's ns_splits: tiles x splits threads fill the block as far as the room
    P, X and T leave holds the partials of the splits past the first."""
    mp, ld = ns_layout(m)
    nt, room = mp // 4, max(0, (smem_limit - NS_STATIC_SMEM) // 4 - 3 * mp * ld)
    return NS_PART_STRIDE * max(
        (max(1, min(v.tx * v.sy // t, nt, 1 + room // (NS_PART_STRIDE * t))) - 1) * t
        for t in (nt * nt, nt * (nt + 1) // 2, nt * (nt + 1)))


def solve_smem(v, m, partials):
    """Dynamic shared memory (bytes) of nys_forward_solve: P, X, T and the k-split partials,
    or P and the landmark tile, whichever is more (a merge job, 5 floats a thread, needs
    less than both: the .cu asserts it)."""
    mp, ld = ns_layout(m)
    return 4 * max(mp * ld + landmark_tile_floats(v), 3 * mp * ld + partials)


def backward_solve_smem(v, m, cols):
    """Dynamic shared memory (bytes) of nys_backward_solve with ``cols`` value columns a pass."""
    return 4 * (m * m + max(landmark_tile_floats(v),
                            m * (m + 1) + 3 * m * (cols + 1) + v.mp + cols))


class Plan(NamedTuple):
    variant: Variant
    backward_solve_cols: int  # value columns per pass of nys_backward_solve
    solve_smem: int
    backward_solve_smem: int
    grads_smem: int
    ns_partials: int          # floats of the forward solve's k-split partials


def variant_fits(v, smem_limit):
    """Whether the variant's kernels fit a device whose blocks may use ``smem_limit`` bytes
    of shared memory, whatever m (the solves' needs on m are :func:`plan`'s)."""
    return row_pass_static_smem(v) <= DEFAULT_SMEM and grads_smem(v) <= smem_limit


@functools.lru_cache(maxsize=None)
def plan(m, dv, smem_limit):
    """A :class:`Plan` for m landmarks and d_v value columns on a device whose blocks may
    use ``smem_limit`` bytes of shared memory, or a tuple of reasons none fits."""
    if not 1 <= m <= MAX_M:
        return (f'm = {m} landmarks; the CUDA kernels take 1 to {MAX_M}',)
    if not 1 <= dv <= MAX_DV:
        return (f'd_v = {dv} value columns; the CUDA kernels take 1 to {MAX_DV}',)
    reasons = []
    for v in sorted((v for v in VARIANTS if v.dv >= dv), key=lambda v: (v.dv, -v.tb)):
        if not variant_fits(v, smem_limit):
            reasons.append(f'variant {v.name}: the gradient kernel needs {grads_smem(v):,} bytes '
                           f'of shared memory, the device allows {smem_limit:,}')
            continue
        # The backward solve's widest column pass: all of d_v, else a halving down to 8.
        bcols = next((c for c in dict.fromkeys([dv] + [c for c in (32, 16, 8) if c < dv])
                      if backward_solve_smem(v, m, c) <= smem_limit), None)
        partials = ns_partials(v, m, smem_limit)
        if solve_smem(v, m, partials) + NS_STATIC_SMEM > smem_limit or bcols is None:
            mp, ld = ns_layout(m)
            need = max(solve_smem(v, m, 0) + NS_STATIC_SMEM, backward_solve_smem(v, m, 8))
            reasons.append(f'variant {v.name}: the solves of m = {m} need {need:,} bytes of '
                           f'shared memory (Newton-Schulz on {mp} x {ld}), the device allows '
                           f'{smem_limit:,}')
            continue
        return Plan(v, bcols, solve_smem(v, m, partials), backward_solve_smem(v, m, bcols),
                    grads_smem(v), partials)
    return tuple(reasons)


@functools.lru_cache(maxsize=None)
def splits(bh, n, target_blocks, tile_rows):
    """(splits, chunk): the N rows of each (batch, head) cut into ``splits`` slices of
    ``chunk`` rows (a multiple of the tile heights) so that about ``target_blocks`` blocks
    exist. Depends only on the shapes and the device: results are deterministic."""
    tiles = _ceil_div(max(n, 1), tile_rows)
    count = min(tiles, max(1, _ceil_div(target_blocks, bh)), MAX_GRID_X)
    chunk = _ceil_div(tiles, count) * tile_rows
    return _ceil_div(max(n, 1), chunk), chunk


# -- The device and what runs there --

# [(why the backend cannot run here or None, whether CuPy is installed)], filled at the first
# call that asks; a plain global, so a compiled graph reads it as a constant.
_AVAILABILITY = []
_WARNED = []


def _availability():
    if not _AVAILABILITY:
        try:
            cupy = import_cupy()
        except CupyNotInstalled as exc:
            _AVAILABILITY.append((str(exc), False))
        except ImportError as exc:
            _AVAILABILITY.append((str(exc), True))
        else:
            _AVAILABILITY.append((_initialise(cupy), True))
    return _AVAILABILITY[0]


def _initialise(cupy):
    try:
        # What every call needs: the CUDA runtime CuPy was built for (a driver older than it
        # fails here) and the NVRTC library it compiles with.
        cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.nvrtc.getVersion()
    except Exception as exc:  # CuPy raises its own CUDARuntimeError, or an OSError
        return (f'CuPy {getattr(cupy, "__version__", "?")} is installed but cannot initialise '
                f'CUDA and NVRTC: {type(exc).__name__}: {exc}')
    return None


def unavailable_reason():
    """Why the backend cannot run here, or None where it can: CuPy not installed, or installed
    but failing to import or to initialise CUDA and NVRTC (its own error). Checked once, at
    the first call that asks; never at module import."""
    return _availability()[0]


def available():
    """Whether CuPy imports and initialises. Where it does not, warns once with the reason (at
    the first attention on CUDA tensors, which then runs the reference); where CuPy is simply
    not installed, only on a machine that has CUDA."""
    reason, installed = _availability()
    if reason is not None and not _WARNED and (installed or torch.cuda.is_available()):
        _WARNED.append(True)
        warnings.warn(f'lapformer_mm: the CUDA kernels are not available ({reason}); the '
                      'attention runs the slower PyTorch reference on CUDA tensors',
                      RuntimeWarning, stacklevel=4)
    return reason is None


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
        cupy = import_cupy()
        if not optin:
            optin = int(cupy.cuda.Device(index).attributes['MaxSharedMemoryPerBlockOptin'])
        nvrtc = cupy.cuda.nvrtc.getVersion()[0]
    except Exception:  # no attribute on this CuPy/driver: the limit every GPU allows
        optin = optin or DEFAULT_SMEM
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


def not_supported(q, k, v, landmarks, opts):
    """Why this backend cannot run these operands (empty: it can). Never raises. Where the
    operands fit, the kernels they need are compiled and loaded here (once; see
    :func:`ensure_loaded`), so that a build that fails is a reason, not an error inside the op."""
    reasons, found, limits = _operand_reasons(q, k, v, landmarks, opts)
    if reasons:
        return reasons
    failure = ensure_loaded(q.device.index, found.variant, ELEMENT_TYPES[q.dtype],
                            limits.smem_optin)
    return () if failure is None else (failure,)


def _operand_reasons(q, k, v, landmarks, opts):
    """(why the operands or the device do not fit, the plan, the device's limits): the
    checks of :func:`not_supported` before its build."""
    try:
        reasons = []
        if q.dtype not in ELEMENT_TYPES:
            reasons.append(f'dtype {q.dtype}; the CUDA kernels take '
                           f'{", ".join(str(t) for t in ELEMENT_TYPES)}')
        if q.numel() == 0 or v.numel() == 0 or landmarks.numel() == 0:
            reasons.append('empty operands')
        sizes = dict(n=q.shape[2], d=q.shape[3], bh=q.shape[0] * q.shape[1],
                     elements=max(q.numel(), v.numel()))
        reasons += [f'{name} = {value:,} exceeds the kernels\' 32-bit index range'
                    for name, value in sizes.items() if value > _MAX_SIZE]
        if opts.kernel not in KERNEL_CODES:
            reasons.append(f'kernel {opts.kernel!r}; the CUDA kernels take '
                           f'{", ".join(KERNEL_CODES)}')
        limits = device_limits(q.device)
        reasons += _device_reasons(limits)
        found = plan(landmarks.shape[2], v.shape[3], limits.smem_optin)
        if reasons or not isinstance(found, Plan):
            return tuple(reasons) + (() if isinstance(found, Plan) else found), None, None
    except Exception as exc:  # a device that cannot even be queried
        return (f'the device could not be queried ({type(exc).__name__}: {exc})',), None, None
    return (), found, limits


# -- The parameter struct --

_OPERAND = np.dtype([('ptr', np.uint64), ('sb', np.int64), ('sh', np.int64), ('sn', np.int64),
                     ('sd', np.int64)], align=True)
OPERANDS = ('q', 'k', 'v', 'L', 'g', 'grad_q', 'grad_k', 'grad_v', 'grad_l')
POINTERS = ('out', 'part', 'fold', 'context', 'inverse', 'stats', 'work', 'lpart', 'common')
INTS = ('heads', 'n', 'm', 'd', 'dv', 'chunk', 'splits', 'iters', 'init_authors', 'refine',
        'injective', 'solve_cols', 'ns_partials')
FLOATS = ('neg_inv_lam', 'neg_coef', 'eps', 'whiten_eps')
#: ``struct nys_params`` of the .cu, field for field (C alignment: align=True).
PARAMS_DTYPE = np.dtype([(name, _OPERAND) for name in OPERANDS]
                        + [(name, np.uint64) for name in POINTERS] + [('bh_count', np.int64)]
                        + [(name, np.int32) for name in INTS]
                        + [(name, np.float32) for name in FLOATS], align=True)


def set_operand(params, name, tensor):
    """params[name] = (pointer, batch, head, row, column strides) of a (B, h, n, c) tensor."""
    if tensor is not None:
        params[name] = (tensor.data_ptr(),) + tuple(tensor.stride())


class _Call(NamedTuple):
    """What every launch of one op call shares."""
    plan: Plan
    names: dict           # stage -> kernel name
    n_splits: int
    params: np.ndarray    # the zero-initialised nys_params, operands and sizes filled
    launch: functools.partial


def _call(q, k, v, landmarks, opts, shapes):
    """The plan, kernel names, row slices and common parameters of one call; its launches
    go to :func:`launch` with the device's opt-in limit and the shapes for an error.
    Operands the kernels do not take raise their reasons (the registered op called with
    impl='cupy' directly has not asked :func:`not_supported`)."""
    reasons, found, limits = _operand_reasons(q, k, v, landmarks, opts)
    if reasons:
        raise RuntimeError(f"impl='cupy' cannot run this call: {'; '.join(reasons)}; use "
                           "impl='reference' or None")
    failure = ensure_loaded(q.device.index, found.variant, ELEMENT_TYPES[q.dtype],
                            limits.smem_optin)
    if failure is not None:
        # The op's own selection builds the kernels first and falls back where that fails,
        # so a build failing here means the kernels were chosen unbuilt: by a torch.compile
        # trace (which builds nothing, and reads impl=None as 'cupy'), or by a direct call of
        # the registered op. A trace reads no build state (ensure_loaded), so an earlier
        # failed build does not steer it to the reference either.
        raise RuntimeError(
            "impl='cupy' cannot run this call: its CUDA kernels were selected when a "
            "torch.compile graph was traced, before they were built (a trace builds nothing; "
            "with impl=None it chooses them unbuilt), or by calling the registered op with "
            f"impl='cupy'; the build then failed: {failure}. Compile with impl='reference' "
            "(eager calls with impl=None fall back to it, but a trace chooses the kernels "
            "whether or not their build failed earlier)")
    batch, heads, n, d = q.shape
    n_splits, chunk = splits(batch * heads, n, target_blocks(q.device), found.variant.tn)
    kind = KERNEL_CODES[opts.kernel]
    p = np.zeros(1, PARAMS_DTYPE)
    for name, t in (('q', q), ('k', k), ('v', v), ('L', landmarks)):
        set_operand(p, name, t)
    p['bh_count'] = batch * heads
    p['heads'], p['n'], p['m'], p['d'], p['dv'] = heads, n, landmarks.shape[2], d, v.shape[3]
    p['chunk'], p['splits'], p['ns_partials'] = chunk, n_splits, found.ns_partials
    p['iters'], p['init_authors'] = opts.iters, opts.ns_init == 'authors'
    p['refine'], p['injective'] = bool(opts.ns_refine), opts.normalize == 'injective'
    p['neg_inv_lam'] = -1.0 / opts.lam
    p['neg_coef'] = -(1.0 if kind == KERNEL_CODES['laplacian'] else 2.0) / opts.lam
    p['eps'], p['whiten_eps'] = opts.eps, opts.whiten_eps
    element = ELEMENT_TYPES[q.dtype]

    def describe():  # the operands for an error message, formatted only if one is raised
        return ', '.join(f'{key} {tuple(t.shape)} {t.dtype}' for key, t in shapes.items())

    go = functools.partial(launch, variant=found.variant, tensor=q, block=found.variant.block,
                           params=p, shapes=describe, smem_limit=limits.smem_optin)
    return _Call(found, {s: kernel_name(s, element, kind) for s in STAGES}, n_splits, p, go)


def forward(q, k, v, landmarks, opts):
    """(out, context, inverse, stats) of the op's contract, in 4 launches."""
    c = _call(q, k, v, landmarks, opts, dict(q=q, v=v, landmarks=landmarks))
    batch, heads, n, _ = q.shape
    m, dv, bh, device = landmarks.shape[2], v.shape[3], batch * heads, q.device
    out = torch.empty(batch, n, heads, dv, dtype=q.dtype, device=device)
    context = torch.empty(batch, heads, m + 1, dv, dtype=_F32, device=device)
    inverse = torch.empty(batch, heads, m, m, dtype=_F32, device=device)
    stats = torch.empty(batch, heads, 3 if opts.normalize == 'injective' else 1, m,
                        dtype=_F32, device=device)
    # First the slices' fp64 sums [r^T v, sum v, sum r] (2 d_v + 1 each; 8-byte aligned at
    # the allocation's start), then the float partials [mean, M2, centred R, its column
    # sums] per slice, the fold and the solve's [P, centred R, column sums, common part,
    # mean value] per (batch, head) (the .cu's nys_forward_work_stride).
    common_floats = 2 * bh * c.n_splits * (2 * dv + 1)
    part_floats = bh * c.n_splits * (3 * m + m * dv)
    fold_floats = bh * (m + 1) * dv
    work = torch.empty(common_floats + part_floats + fold_floats
                       + bh * (m * m + m * dv + m + 2 * dv), dtype=_F32, device=device)
    p, base, variant = c.params, work.data_ptr(), c.plan.variant
    p['out'], p['context'] = out.data_ptr(), context.data_ptr()
    p['inverse'], p['stats'] = inverse.data_ptr(), stats.data_ptr()
    p['common'], base = base, base + 4 * common_floats
    p['part'], p['fold'] = base, base + 4 * part_floats
    p['work'] = base + 4 * (part_floats + fold_floats)
    bh_grid = min(bh, MAX_GRID_YZ)
    # Job 0 of a (batch, head) is the Newton-Schulz block, the others merge the slices,
    # sy / ty pieces each.
    jobs = 1 + _ceil_div(_ceil_div(2 * m + m * dv + dv, variant.lanes), variant.sy // variant.ty)
    c.launch(c.names['nys_forward_stats'], grid=(c.n_splits, bh_grid))
    c.launch(c.names['nys_forward_solve'], grid=(min(jobs, MAX_GRID_X), bh_grid),
             block=(variant.tx, variant.sy, 1), shared_mem=c.plan.solve_smem)
    c.launch(c.names['nys_forward_context'],
             grid=(min(_ceil_div(dv, variant.cc), MAX_GRID_X), bh_grid))
    c.launch(c.names['nys_forward_out'], grid=(min(_ceil_div(n, variant.tn), MAX_GRID_X), bh_grid))
    return out, context, inverse, stats


def _token_layout(batch, heads, n, width, like):
    """An uninitialised (B, h, n, width) view of a contiguous (B, n, h, width) tensor."""
    return torch.empty(batch, n, heads, width, dtype=like.dtype,
                       device=like.device).transpose(1, 2)


def backward(grad, q, k, v, landmarks, context, inverse, stats, opts):
    """(dq, dk, dv, dlandmarks) of the op's contract, in 5 launches; dk is empty when k is None."""
    c = _call(q, k, v, landmarks, opts, dict(grad=grad, q=q, v=v, landmarks=landmarks))
    batch, heads, n, d = q.shape
    m, dv, bh = landmarks.shape[2], v.shape[3], batch * heads
    grad = grad if grad.dtype == q.dtype else grad.to(q.dtype)
    # The token layout (B, N, h, .), as the module's projections have it: their backward
    # then needs no copy. The landmarks' gradient takes their strides when dense.
    dq = _token_layout(batch, heads, n, d, q)
    dk = None if k is None else _token_layout(batch, heads, n, d, q)
    dv_out = _token_layout(batch, heads, n, dv, q)
    dl = torch.empty_like(landmarks)
    reduce_floats = bh * c.n_splits * (m * dv + dv)
    # Per (batch, head): dR / N, a, W = (dP + dP^T) * k(L, L), the merged T, colsum(G) and
    # w (the .cu's nys_backward_work_stride).
    work_floats = bh * (2 * m * dv + m + m * m + 2 * dv)
    work = torch.empty(reduce_floats + work_floats + bh * c.n_splits * m * d, dtype=_F32,
                       device=q.device)
    p, base, lanes = c.params, work.data_ptr(), c.plan.variant.lanes
    for name, t in (('g', grad.transpose(1, 2)), ('grad_q', dq), ('grad_k', dk),
                    ('grad_v', dv_out), ('grad_l', dl)):
        set_operand(p, name, t)
    p['context'], p['inverse'], p['stats'] = (context.data_ptr(), inverse.data_ptr(),
                                              stats.data_ptr())
    p['part'], p['work'] = base, base + 4 * reduce_floats
    p['lpart'] = base + 4 * (reduce_floats + work_floats)
    p['solve_cols'] = c.plan.backward_solve_cols
    bh_grid = min(bh, MAX_GRID_YZ)
    c.launch(c.names['nys_backward_reduce'], grid=(c.n_splits, bh_grid))
    c.launch(c.names['nys_backward_merge'],
             grid=(min(_ceil_div(m * dv + dv, lanes), MAX_GRID_X), bh_grid))
    c.launch(c.names['nys_backward_solve'], grid=(min(bh, MAX_GRID_X),),
             shared_mem=c.plan.backward_solve_smem)
    c.launch(c.names['nys_backward_grads'], grid=(c.n_splits, bh_grid),
             shared_mem=c.plan.grads_smem)
    c.launch(c.names['nys_backward_landmarks'],
             grid=(min(_ceil_div(m * d, lanes), MAX_GRID_X), bh_grid))
    return dq, q.new_empty(0) if dk is None else dk, dv_out, dl


def warmup(device=None, dtypes=(torch.float32,), value_dims=None, m=None):
    """Compile, load and opt in, on ``device`` (default: the current one), every variant the
    op can pick there for these dtypes, ahead of any CUDA-graph capture (a first use inside a
    capture raises :class:`CaptureError`): the variants that calls of ``m`` landmarks
    (default: any of 1 to MAX_M; on a small device the plan depends on m) and these value
    widths select (default: 32 and 64, those of the variants' tiles: a narrower width picks
    what its tile's width picks; widths without kernels on the device are left out).
    Returns the (variant name, dtype) pairs loaded; a dtype, or a width given, that the
    kernels do not take is a ValueError (the op would run the reference)."""
    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    for dtype in dtypes:
        if dtype not in ELEMENT_TYPES:
            raise ValueError(f'dtypes: the CUDA kernels take '
                             f'{", ".join(map(str, ELEMENT_TYPES))}, got {dtype}')
    limits = device_limits(torch.device('cuda', index))
    landmarks = range(1, MAX_M + 1) if m is None else (m,)
    variants = {}
    for dv in value_dims or (32, MAX_DV):
        plans = [plan(count, dv, limits.smem_optin) for count in landmarks]
        picked = [found.variant for found in plans if isinstance(found, Plan)]
        if not picked and value_dims is not None:
            raise ValueError(f'value_dims: no kernels for d_v = {dv} on device {index} '
                             f'({"; ".join(plans[-1])})')
        variants.update((v.name, v) for v in picked)
    loaded = []
    for variant in variants.values():
        for dtype in dtypes:
            load_group(index, variant, ELEMENT_TYPES[dtype], limits.smem_optin)
            loaded.append((variant.name, dtype))
    return loaded


# -- CuPy side: compile, cache, launch --

class CudaOpsError(RuntimeError):
    """A CUDA kernel failed to compile or launch; the message names kernel and shapes."""


class CaptureError(RuntimeError):
    """The kernels would be compiled, loaded or opted in while a CUDA graph is captured."""


def source_dir():
    """lapformer_mm/csrc/cuda, shipped with the package."""
    return Path(__file__).resolve().parents[2] / 'csrc' / 'cuda'


_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def load_source(name=SOURCE, _seen=None):
    """Text of ``name`` with its local ``#include "..."`` lines inlined (once each), so that
    CuPy's on-disk cache, keyed by the source text, sees header changes too."""
    path = source_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f'CUDA source {path} is missing; reinstall lapformer_mm')
    seen = set() if _seen is None else _seen

    def include(match):
        header = match.group(1)
        if header in seen:
            return ''
        seen.add(header)
        return load_source(header, seen)

    return _INCLUDE.sub(include, path.read_text())


class CupyNotInstalled(ImportError):
    """CuPy is not installed (as opposed to installed and failing to import)."""


def import_cupy():
    """``import cupy``; the ImportError says how to install it where it is not installed
    (:class:`CupyNotInstalled`), and carries the import's own error where it is installed but
    does not import."""
    try:
        import cupy
    except Exception as exc:  # a broken install raises ImportError, OSError or RuntimeError
        if isinstance(exc, ModuleNotFoundError) and exc.name == 'cupy':
            raise CupyNotInstalled(f'CuPy is not installed: {INSTALL_HINT}') from exc
        raise ImportError(f'CuPy is installed but does not import: {type(exc).__name__}: '
                          f'{exc}') from exc
    return cupy


def capturing(device_index):
    """Whether PyTorch's current stream on the device is capturing a CUDA graph."""
    with torch.cuda.device(device_index):
        return torch.cuda.is_current_stream_capturing()


_lock = threading.Lock()
# (device, variant name, element type) -> {kernel name: launch function}
_groups = {}
#: (device, variant name, element type) -> 'compiled' (by NVRTC) or 'cached' (CuPy's cache).
loaded_from = {}
# (device, variant name, element type) -> the error of its failed compile or load: a build
# that failed once (CuPy for another CUDA than the driver's, say) is not tried at every call.
_failed = {}
# Dynamic shared memory a kernel is opted into once, at load: all it may ever ask on the
# device (so nothing changes later, inside a capture); the limit less this.
_OPTIN_RESERVE = {'nys_forward_solve': NS_STATIC_SMEM, 'nys_backward_solve': 0,
                  'nys_backward_grads': 0}


def compile_options(variant, element_type):
    """NVRTC options of the module of a variant's kernels for one element type: the tile
    geometry, and a define naming the element type. CuPy's kernel cache keys a binary by
    source and options, not by the kernels asked for, so without it the modules of one
    variant's element types would overwrite each other there."""
    return NVRTC_OPTIONS + variant.defines + (f'-DNYS_ELEMENT={element_type}',)


def kernel_cache_dir():
    """CuPy's on-disk kernel cache (``CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``), where
    the kernels' lowered names are kept beside the binaries CuPy keeps; None where
    ``CUPY_CACHE_IN_MEMORY=1`` keeps no binary on disk."""
    if os.environ.get('CUPY_CACHE_IN_MEMORY', '0').strip() == '1':
        return None
    return Path(os.environ.get('CUPY_CACHE_DIR') or Path.home() / '.cupy' / 'kernel_cache')


def _names_file(cupy, code, options, names):
    """Where the lowered names of a compile of ``code`` with ``options`` are kept (None: not
    kept), keyed by everything the names and CuPy's binary depend on."""
    try:
        folder = kernel_cache_dir()
        versions = [str(getattr(cupy, '__version__', '')), list(cupy.cuda.nvrtc.getVersion())]
    except Exception:  # no home folder, no NVRTC version to key on: nothing kept
        return None
    if folder is None:
        return None
    key = hashlib.sha256(json.dumps([code, list(options), list(names), versions]).encode())
    return folder / f'lapformer_mm_{key.hexdigest()[:40]}.json'


def _load_compiled(cupy, code, options, names, names_file):
    """{name: kernel} from CuPy's kernel cache by the lowered names an earlier compile kept,
    or None. CuPy recompiles a module with name expressions every time (it needs NVRTC's
    lowered names; docs/cuda.md gives the cost); a module of the same source and options
    without them is the binary its cache holds, whose kernels the lowered names find."""
    try:
        lowered = json.loads(names_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(lowered, dict) or sorted(lowered) != sorted(names):
        return None
    module = cupy.RawModule(code=code, options=options, backend='nvrtc')
    try:
        return {name: module.get_function(lowered[name]) for name in names}
    except Exception:  # CuPy's cache no longer holds that binary: compile
        return None


def _keep_names(names_file, module, names):
    try:
        lowered = {name: module.module.mapping[name] for name in names}
        names_file.parent.mkdir(parents=True, exist_ok=True)
        partial = names_file.with_name(f'{names_file.name}.{os.getpid()}.tmp')
        partial.write_text(json.dumps(lowered))
        os.replace(partial, names_file)
    except Exception:  # a cache that cannot be written costs the next process a compile
        pass


def _compile(device_index, variant, element_type, smem_limit):
    """Every stage for an element type, loaded and opted in: from CuPy's kernel cache where
    an earlier process compiled the same source and options, else one NVRTC compile.
    Returns (group, 'cached' or 'compiled')."""
    cupy = import_cupy()
    names = kernel_names((element_type,))
    code, options = load_source(), compile_options(variant, element_type)
    with cupy.cuda.Device(device_index):
        names_file = _names_file(cupy, code, options, names)
        functions = None if names_file is None else _load_compiled(cupy, code, options, names,
                                                                   names_file)
        how = 'cached'
        if functions is None:
            module = cupy.RawModule(code=code, options=options, name_expressions=names,
                                    backend='nvrtc')
            functions = {name: module.get_function(name) for name in names}
            how = 'compiled'
            if names_file is not None:
                _keep_names(names_file, module, names)
        group = {}
        for name, function in functions.items():
            reserve = _OPTIN_RESERVE.get(name.split('<')[0])
            if reserve is not None and smem_limit - reserve > DEFAULT_SMEM:
                function.max_dynamic_shared_size_bytes = smem_limit - reserve
            # RawKernel.kernel, the compiled Function, skips RawKernel's per-call device lookup.
            group[name] = getattr(function, 'kernel', function)
    return group, how


def load_group(device_index, variant, element_type, smem_limit):
    """The launch functions of every stage for (device, variant, element type), cached."""
    key = (device_index, variant.name, element_type)
    if key in _groups:
        return _groups[key]
    with _lock:
        if key in _groups:
            return _groups[key]
        if key in _failed:
            raise CudaOpsError(_failed[key])
        if capturing(device_index):
            raise CaptureError(
                f'the CUDA kernels of the attention ({variant.name}, {element_type}) are not '
                f'loaded yet on cuda:{device_index}, and a CUDA graph is being captured: '
                'compiling and loading them would break the capture. Run the attention once '
                'eagerly before capturing, or call lapformer_mm.ops.backends.cuda.warmup() '
                '(torch.compile mode="reduce-overhead" warms up eagerly by itself).')
        try:
            _groups[key], loaded_from[key] = _compile(device_index, variant, element_type,
                                                      smem_limit)
        except Exception as exc:  # CuPy raises CompileException and CUDADriverError
            _failed[key] = (f'compiling {SOURCE} ({variant.name}, {element_type}) for '
                            f'cuda:{device_index} failed: {type(exc).__name__}: {exc}')
            raise CudaOpsError(_failed[key]) from exc
    return _groups[key]


def ensure_loaded(device_index, variant, element_type, smem_limit):
    """None where the kernels of (device, variant, element type) are loaded, or load now;
    else why they cannot be (the compile or load error, remembered: not retried). Inside a
    CUDA-graph capture or a torch.compile trace nothing is loaded here: the launch loads,
    and raises (:class:`CaptureError` in a capture)."""
    if torch.compiler.is_compiling():
        # First, so that a trace reads none of load_group's mutable state (no guard on it).
        return None
    try:
        load_group(device_index, variant, element_type, smem_limit)
    except CudaOpsError as exc:  # this build's failure, now or remembered from before
        return str(exc)
    except CaptureError:  # nothing is loaded inside a capture: the launch raises
        return None
    return None


def raw_stream(device_index):
    """Handle of PyTorch's current stream on the device (the capture stream while a CUDA
    graph is being captured), without making a Stream object (as inductor's code does)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


_streams = {}
_MAX_STREAMS = 256


def cupy_stream(cupy, device_index):
    """PyTorch's current stream as a CuPy ``ExternalStream``, one wrapper per handle; never
    CuPy's own current stream (the legacy default stream unless set), which would escape a
    CUDA graph capture and replay stale results."""
    handle = raw_stream(device_index)
    key = (device_index, handle)
    if key not in _streams:
        if len(_streams) >= _MAX_STREAMS:
            _streams.clear()
        _streams[key] = cupy.cuda.ExternalStream(handle, device_index)
    return _streams[key]


def launch(name, variant, tensor, grid, block, params, shared_mem=0, shapes='', smem_limit=0):
    """Launch kernel ``name`` of ``variant`` on PyTorch's current stream of ``tensor``'s
    device with the by-value ``params``; no host synchronisation, a device context only when
    that device is not the current one. Failures raise :class:`CudaOpsError` naming the
    kernel, the geometry and ``shapes`` (a string, or a callable made on failure only)."""
    cupy = import_cupy()
    device_index = tensor.device.index
    element_type = name.split('<', 1)[1].split(',')[0].rstrip('>').strip()
    call = load_group(device_index, variant, element_type, smem_limit)[name]
    try:
        stream = cupy_stream(cupy, device_index)
        if cupy.cuda.runtime.getDevice() == device_index:
            call(grid, block, (params,), shared_mem=shared_mem, stream=stream)
        else:
            with cupy.cuda.Device(device_index):
                call(grid, block, (params,), shared_mem=shared_mem, stream=stream)
    except Exception as exc:
        raise CudaOpsError(f'launching {name} ({variant.name}, grid={grid}, block={block}, '
                           f'shared_mem={shared_mem}) for '
                           f'{shapes() if callable(shapes) else shapes} failed: {exc}') from exc
