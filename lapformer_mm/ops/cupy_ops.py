"""CUDA (CuPy/NVRTC) implementations of the registered ops, called when ``impl='cupy'``.

* the fused attention (:mod:`.nystrom`): :func:`nystrom_attention_forward` (3 launches)
  and :func:`nystrom_attention_backward` (4) of ``ops/nystrom_attention.cu``;
* the primitives (:mod:`.kernels`): :func:`pairwise_forward` and
  :func:`pairwise_backward` run ``ops/pairwise_kernel.cu``, :func:`newton_schulz` runs
  ``ops/newton_schulz.cu`` when the m x m iterate fits in shared memory.

The kernels read 16-bit inputs, accumulate in fp32 and write the input dtype. Each
launch goes through ``cuda_runtime.launch``, which the CPU emulation replaces.
"""
import functools

import numpy as np
import torch

from . import cuda_runtime as rt
from .reference import compute_dtype

_DTYPES = tuple(rt.ELEMENT_TYPES)
# Sizes are 32-bit ints in the kernels; the margin keeps "size + tile - 1" from overflowing.
_MAX_SIZE = 2 ** 31 - 2 ** 16


# ----------------------------------------------------------------------------
# Kernel launches on contiguous (batch, n, d) tensors.
# ----------------------------------------------------------------------------

def _check_int32(**sizes):
    for name, value in sizes.items():
        if value > _MAX_SIZE:
            raise ValueError(f'{name}={value} exceeds the CUDA kernels\' 32-bit index range')


def _shapes(extra='', **tensors):
    """The operands' shapes for an error message, formatted only if one is raised."""
    return lambda: ', '.join(f'{k} {tuple(v.shape)} {v.dtype}' for k, v in tensors.items()) + extra


@functools.lru_cache(maxsize=None)
def _target_blocks(device_index):
    return 4 * torch.cuda.get_device_properties(device_index).multi_processor_count


def target_blocks(device):
    """Blocks that keep every SM of ``device`` busy: 4 per SM."""
    return _target_blocks(device.index)


def fused_pairwise_forward(x3, y3, lam, kind):
    """Kernel matrix (batch, n, m) of x3 (batch, n, d) and y3 (batch, m, d), input dtype."""
    batch, n, d = x3.shape
    m = y3.shape[1]
    _check_int32(n=n, m=m, d=d)
    out = torch.empty(batch, n, m, dtype=x3.dtype, device=x3.device)
    if out.numel() == 0:
        return out
    grid, block = rt.pairwise_forward_launch(batch, n, m)
    name = rt.pairwise_forward_name(rt.ELEMENT_TYPES[x3.dtype], kind)
    args = (rt.pointer(x3), rt.pointer(y3), rt.pointer(out), np.int64(batch), np.int32(n),
            np.int32(m), np.int32(d), np.float64(-1.0 / lam))
    rt.launch(rt.PAIRWISE_SOURCE, name, x3, grid, block, args, shapes=_shapes(x=x3, y=y3))
    return out


def _pairwise_grad(grad, kmat, rows, red, lam, kind, transposed, blocks):
    """Gradient (batch, n_rows, d) for one operand; see ``pairwise_backward`` in the .cu."""
    batch, n_rows, d = rows.shape
    n_red = red.shape[1]
    acc_dtype = compute_dtype(rows.dtype)
    if batch * n_rows * d == 0:
        return torch.zeros_like(rows)
    grid, block, splits, red_chunk = rt.pairwise_backward_launch(batch, n_rows, n_red, d, blocks)
    # One slice writes the gradient itself; several write partial sums.
    out = torch.empty_like(rows) if splits == 1 else None
    partial = (None if splits == 1 else
               torch.empty(splits, batch, n_rows, d, dtype=acc_dtype, device=rows.device))
    coef = (1.0 if kind == rt.LAPLACIAN else 2.0) / lam
    name = rt.pairwise_backward_name(rt.ELEMENT_TYPES[rows.dtype], kind, transposed)
    args = (rt.pointer(grad), rt.pointer(kmat), rt.pointer(rows), rt.pointer(red),
            rt.pointer(out), rt.pointer(partial), np.int64(batch), np.int32(n_rows),
            np.int32(n_red), np.int32(d), np.int32(red_chunk), np.float64(-coef))
    rt.launch(rt.PAIRWISE_SOURCE, name, rows, grid, block, args,
              shapes=_shapes(grad=grad, rows=rows, red=red))
    if partial is None:
        return out
    # A fixed-order sum over the split slices keeps the result deterministic.
    return partial.sum(0).to(rows.dtype)


def fused_pairwise_backward(grad, kmat, x3, y3, lam, kind, need_x, need_y, blocks):
    """(dx, dy) of the kernel matrix; an empty tensor for a gradient not needed.

    grad and kmat are (batch, n, m) contiguous, in the dtype of x3 and y3.
    """
    dx = _pairwise_grad(grad, kmat, x3, y3, lam, kind, False, blocks) if need_x else x3.new_empty(0)
    dy = _pairwise_grad(grad, kmat, y3, x3, lam, kind, True, blocks) if need_y else y3.new_empty(0)
    return dx, dy


def fused_newton_schulz(P3, iters, authors, smem_limit):
    """Newton–Schulz inverse of P3 (batch, m, m) fp32/fp64 in one block per matrix.

    Returns None when the iterate does not fit in ``smem_limit`` bytes of
    shared memory (the caller falls back to batched matmuls).
    """
    batch, m, _ = P3.shape
    config = rt.newton_schulz_launch(batch, m, P3.element_size(), smem_limit)
    if config is None:
        return None
    out = torch.empty_like(P3)
    if P3.numel() == 0:
        return out
    grid, block, smem, p_in_shared = config
    name = rt.newton_schulz_name(rt.ELEMENT_TYPES[P3.dtype], p_in_shared)
    args = (rt.pointer(P3), rt.pointer(out), np.int64(batch), np.int32(m), np.int32(iters),
            np.int32(1 if authors else 0))
    rt.launch(rt.NEWTON_SCHULZ_SOURCE, name, P3, grid, block, args, shared_mem=smem,
              shapes=_shapes(f', iters={iters}', P=P3))
    return out


# ----------------------------------------------------------------------------
# The kernels' contract. They index raw pointers as contiguous tensors of one
# dtype on one device; ``torch.ops.lapformer_mm.*`` are callable directly, so
# the entry points enforce it themselves.
# ----------------------------------------------------------------------------

def _operands(op, allowed_dtypes, **tensors):
    """Check that ``tensors`` share x's dtype (one of ``allowed_dtypes``) and device.

    Returns them contiguous, in the given order. The first tensor is the one
    the others are compared with.
    """
    (first_name, first), *rest = tensors.items()
    if first.dtype not in allowed_dtypes:
        raise TypeError(f'{op}: {first_name} has dtype {first.dtype}; allowed: '
                        f'{[str(d) for d in allowed_dtypes]}')
    for name, t in rest:
        if t.dtype != first.dtype:
            raise TypeError(f'{op}: {name} has dtype {t.dtype} but {first_name} has '
                            f'{first.dtype}; all operands must share one dtype')
        if t.device != first.device:
            raise ValueError(f'{op}: {name} is on {t.device} but {first_name} is on '
                             f'{first.device}; all operands must be on one device')
    return tuple(t.contiguous() for t in tensors.values())


def _pairwise_operands(op, x, y, grad=None, kmat=None):
    """x (batch, n, d), y (batch, m, d) and optionally grad, kmat (batch, n, m)."""
    if x.dim() != 3 or y.dim() != 3 or x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
        raise ValueError(f'{op}: x must be (batch, n, d) and y (batch, m, d) with the same '
                         f'batch and d, got x {tuple(x.shape)} and y {tuple(y.shape)}')
    tensors = dict(x=x, y=y)
    expected = (x.shape[0], x.shape[1], y.shape[1])
    for name, t in (('grad', grad), ('kmat', kmat)):
        if t is None:
            continue
        if tuple(t.shape) != expected:
            raise ValueError(f'{op}: {name} must be (batch, n, m) = {expected}, got '
                             f'{tuple(t.shape)}')
        tensors[name] = t
    return _operands(op, _DTYPES, **tensors)


def _square_operands(op, **tensors):
    """fp32/fp64 (batch, m, m) tensors of one shape, dtype and device."""
    shape = next(iter(tensors.values())).shape
    for name, t in tensors.items():
        if t.dim() != 3 or t.shape[1] != t.shape[2] or t.shape != shape:
            raise ValueError(f'{op}: {name} must be (batch, m, m) like the other operands, '
                             f'got {tuple(t.shape)}')
    return _operands(op, (torch.float32, torch.float64), **tensors)


# ----------------------------------------------------------------------------
# Entry points of the registered ops (impl='cupy').
# ----------------------------------------------------------------------------

def pairwise_forward(x, y, lam, kind):
    """Kernel matrix (batch, n, m) of x (batch, n, d), y (batch, m, d); ``kind`` a name."""
    x, y = _pairwise_operands('pairwise_kernel', x, y)
    return fused_pairwise_forward(x, y, lam, rt.KINDS[kind])


def pairwise_backward(grad, kmat, x, y, lam, kind, need_x, need_y):
    """(dx, dy) of the kernel matrix; empty tensors for gradients not needed."""
    x, y, grad, kmat = _pairwise_operands('pairwise_kernel_backward', x, y, grad, kmat)
    return fused_pairwise_backward(grad, kmat, x, y, lam, rt.KINDS[kind], need_x, need_y,
                                   target_blocks(x.device))


def newton_schulz(P, iters, init):
    """Newton–Schulz inverse of fp32/fp64 P (batch, m, m), or None if it does not fit."""
    (P,) = _square_operands('newton_schulz', P=P)
    return fused_newton_schulz(P, iters, init == 'authors', rt.shared_memory_optin(P.device.index))


# ----------------------------------------------------------------------------
# The fused attention (lapformer_mm::nystrom_attention and its backward): 3 launches
# forward, 4 backward (ops/nystrom_attention.cu), no N x m matrix in memory.
# ----------------------------------------------------------------------------

_F32 = torch.float32


def _operand(t):
    """(pointer, 4 strides) of a (B, h, n, d) operand as kernel arguments; null for None.

    Strides are 64-bit kernel parameters, so plain Python ints do (CuPy passes an int as
    int64); the 32-bit ones below are numpy scalars of their exact type.
    """
    if t is None:
        return (rt.pointer(None), 0, 0, 0, 0)
    return (rt.pointer(t),) + t.stride()


def _grad_operand(grad):
    """(pointer, batch, head, row, column strides) of the (B, N, h, d_v) output gradient."""
    sb, sn, sh, sd = grad.stride()
    return rt.pointer(grad), sb, sh, sn, sd


def _token_layout(batch, heads, n, width, like):
    """An uninitialised (B, h, n, width) view of a contiguous (B, n, h, width) tensor."""
    return torch.empty(batch, n, heads, width, dtype=like.dtype,
                       device=like.device).transpose(1, 2)


def _offset(tensor, floats):
    """Pointer ``floats`` fp32 elements into ``tensor`` (no ATen op)."""
    return np.uint64(tensor.data_ptr() + 4 * floats)


@functools.lru_cache(maxsize=None)
def _stage_names(dtype, kind):
    """The 7 kernel instantiations (forward, then backward) for an element type and kind."""
    element = rt.ELEMENT_TYPES[dtype]
    return tuple(rt.nystrom_name(stage, element, kind)
                 for stage in rt.NYS_FORWARD + rt.NYS_BACKWARD)


def _kernel_scalars(kernel, lam):
    """(kind, -1/lam, -coef): the kernel code and the constants of its value and gradient."""
    kind = rt.KINDS[kernel]
    return kind, np.float32(-1.0 / lam), np.float32(-(1.0 if kind == rt.LAPLACIAN else 2.0) / lam)


def _fused(q, v, landmarks):
    """Whether the fused kernels take these operands (empty ones take the reference math:
    a grid of 0 blocks is no launch)."""
    _check_int32(n=q.shape[2], m=landmarks.shape[2], d=q.shape[3], dv=v.shape[3])
    return (q.numel() > 0 and v.numel() > 0
            and rt.nystrom_fused_supported(q.dtype, landmarks.shape[2], v.shape[3], q.shape[3]))


def nystrom_attention_forward(q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine,
                              normalize, whiten_eps):
    """(out, context, inverse, stats) of the contract in :mod:`.nystrom`, operands checked.

    fp64 operands, more than ``rt.NYS_MP`` landmarks or wider values than ``rt.NYS_DV``
    run the reference math (on the GPU) instead of the fused kernels.
    """
    if not _fused(q, v, landmarks):
        raise RuntimeError('the fused kernels do not take these operands (see not_supported)')
    batch, heads, n, d = q.shape
    m, dv = landmarks.shape[2], v.shape[3]
    bh = batch * heads
    device = q.device
    injective = normalize == 'injective'
    out = torch.empty(batch, n, heads, dv, dtype=q.dtype, device=device)
    context = torch.empty(batch, heads, m, dv, dtype=_F32, device=device)
    inverse = torch.empty(batch, heads, m, m, dtype=_F32, device=device)
    stats = torch.empty(batch, heads, 2 if injective else 0, m, dtype=_F32, device=device)
    splits, chunk = rt.nystrom_splits(bh, n, target_blocks(device))
    part_floats = bh * splits * (2 * m + m * dv)
    work = torch.empty(part_floats + bh * (m + 1) * dv, dtype=_F32, device=device)
    part, fold = rt.pointer(work), _offset(work, part_floats)
    kind, neg_inv_lam, _ = _kernel_scalars(kernel, lam)
    names = _stage_names(q.dtype, kind)
    sizes = (bh, np.int32(heads), np.int32(n), np.int32(m), np.int32(d), np.int32(dv))
    flag = np.int32(injective)
    shapes = _shapes(q=q, v=v, landmarks=landmarks)
    qs, lm = _operand(q), _operand(landmarks)
    pass_grid = (splits, min(bh, rt.MAX_GRID_YZ))

    rt.launch(rt.NYSTROM_SOURCE, names[0], q, pass_grid, rt.NYS_BLOCK,
              qs[:1] + _operand(k)[:1] + _operand(v)[:1] + lm[:1] + qs[1:] + _operand(k)[1:]
              + _operand(v)[1:] + lm[1:] + (part,) + sizes + (np.int32(chunk), neg_inv_lam, flag),
              shapes=shapes)
    rt.launch(rt.NYSTROM_SOURCE, names[1], q, (min(bh, rt.MAX_GRID_X),), rt.NYS_BLOCK,
              lm + (part, rt.pointer(context), rt.pointer(inverse), rt.pointer(stats), fold)
              + sizes + (np.int32(chunk), np.int32(splits), neg_inv_lam, np.float32(eps),
                         np.int32(iters), np.int32(ns_init == 'authors'), np.int32(ns_refine),
                         flag, np.float32(whiten_eps)),
              shared_mem=rt.nystrom_solve_smem(m, dv), shapes=shapes)
    rt.launch(rt.NYSTROM_SOURCE, names[2], q,
              (min(-(-n // rt.NYS_TN), rt.MAX_GRID_X), min(bh, rt.MAX_GRID_YZ)), rt.NYS_BLOCK,
              qs + lm + (fold, rt.pointer(out)) + sizes + (neg_inv_lam, flag), shapes=shapes)
    return out, context, inverse, stats


def nystrom_attention_backward(grad, q, k, v, landmarks, context, inverse, stats, kernel, lam,
                               eps, ns_refine, normalize, whiten_eps):
    """(dq, dk, dv, dlandmarks) of the contract in :mod:`.nystrom`."""
    if not _fused(q, v, landmarks):
        raise RuntimeError('the fused kernels do not take these operands (see not_supported)')
    batch, heads, n, d = q.shape
    m, dv = landmarks.shape[2], v.shape[3]
    bh = batch * heads
    device = q.device
    grad = grad if grad.dtype == q.dtype else grad.to(q.dtype)
    # The token layout (B, N, h, .), as the module's projections have it: their backward
    # then needs no copy. The landmarks' gradient takes their strides when dense.
    dq = _token_layout(batch, heads, n, d, q)
    dk = None if k is None else _token_layout(batch, heads, n, d, q)
    dv_out = _token_layout(batch, heads, n, dv, q)
    dl = torch.empty_like(landmarks)
    splits, chunk = rt.nystrom_splits(bh, n, target_blocks(device))
    reduce_floats = bh * splits * (m * dv + dv)
    work_floats = bh * (m * dv + m + m * d)
    lpart_floats = bh * splits * m * d
    work = torch.empty(reduce_floats + work_floats + lpart_floats, dtype=_F32, device=device)
    part, solved = rt.pointer(work), _offset(work, reduce_floats)
    lpart = _offset(work, reduce_floats + work_floats)
    kind, neg_inv_lam, neg_coef = _kernel_scalars(kernel, lam)
    names = _stage_names(q.dtype, kind)
    sizes = (bh, np.int32(heads), np.int32(n), np.int32(m), np.int32(d), np.int32(dv))
    flag = np.int32(normalize == 'injective')
    shapes = _shapes(grad=grad, q=q, v=v, landmarks=landmarks)
    lm, g, qs = _operand(landmarks), _grad_operand(grad), _operand(q)
    pass_grid = (splits, min(bh, rt.MAX_GRID_YZ))
    solve_grid = (min(bh, rt.MAX_GRID_X),)

    rt.launch(rt.NYSTROM_SOURCE, names[3], q, pass_grid, rt.NYS_BLOCK,
              g + qs + lm + (part,) + sizes + (np.int32(chunk), neg_inv_lam, flag), shapes=shapes)
    rt.launch(rt.NYSTROM_SOURCE, names[4], q, solve_grid, rt.NYS_BLOCK,
              lm + (part, rt.pointer(context), rt.pointer(inverse), rt.pointer(stats), solved)
              + sizes + (np.int32(splits), neg_inv_lam, neg_coef, np.float32(eps),
                         np.int32(ns_refine), flag),
              shared_mem=rt.nystrom_backward_solve_smem(m, dv), shapes=shapes)
    rt.launch(rt.NYSTROM_SOURCE, names[5], q, pass_grid, rt.NYS_BLOCK,
              g + qs + _operand(k) + _operand(v) + lm
              + (rt.pointer(context), rt.pointer(stats), solved, rt.pointer(dq), rt.pointer(dk))
              + dq.stride() + (rt.pointer(dv_out),) + dv_out.stride() + (lpart,)
              + sizes + (np.int32(chunk), neg_inv_lam, neg_coef, flag),
              shared_mem=rt.NYSTROM_GRADS_SMEM, shapes=shapes)
    rt.launch(rt.NYSTROM_SOURCE, names[6], q, solve_grid, rt.NYS_BLOCK,
              (lpart, solved) + _operand(dl)
              + (bh, np.int32(heads), np.int32(m), np.int32(d), np.int32(dv),
                 np.int32(splits)), shapes=shapes)
    return dq, q.new_empty(0) if dk is None else dk, dv_out, dl
