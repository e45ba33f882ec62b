"""CUDA (CuPy/NVRTC) implementations of the kernel matrices and the Newton–Schulz inverse.

Public entry points, called by the dispatch for CUDA tensors (contract in the
design): :func:`laplacian_kernel`, :func:`gaussian_kernel` and
:func:`newton_schulz_pinv`. Each is a ``torch.autograd.Function`` whose forward
and backward call raw ops registered with ``torch.library.custom_op``:

* ``lapformer_mm::cuda_pairwise_kernel`` / ``cuda_pairwise_kernel_backward``:
  the fused kernels of ``ops/pairwise_kernel.cu``;
* ``lapformer_mm::cuda_newton_schulz``: ``ops/newton_schulz.cu`` for m x m
  iterates that fit in shared memory, batched matmuls otherwise;
  ``cuda_newton_schulz_backward``: the closed form with full-precision bmm.

The custom ops make ``torch.compile`` treat each launch as one opaque graph
node (with a fake implementation for shape propagation) instead of breaking the
graph at the CuPy call. Each op also has a CPU implementation in plain PyTorch
so that the op wiring (autograd, fake tensors, ``torch.compile``) is tested in
CI without a GPU; the public functions themselves accept CUDA tensors only.

AMP: under autocast the inputs are cast to fp32 (``custom_fwd(cast_inputs=
torch.float32)``), because the design runs kernel matrices and the solve in
fp32; called directly with fp16/bf16 tensors outside autocast, the kernels
read 16-bit inputs, accumulate in fp32 and write the input dtype.
"""
import functools
import math

import numpy as np
import torch

from . import cuda_runtime as rt
from ._checks import NS_INITS
from ._precision import compute_dtype, full_precision_matmul

_DTYPES = tuple(rt.ELEMENT_TYPES)
# Sizes are 32-bit ints in the kernels; the margin keeps "size + tile - 1" from overflowing.
_MAX_SIZE = 2 ** 31 - 2 ** 16


# ----------------------------------------------------------------------------
# Kernel launches on contiguous (batch, n, d) tensors. The launch itself goes
# through ``cuda_runtime.launch``, which the CPU emulation test replaces.
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
# PyTorch twins (CPU implementations of the custom ops and the large-m path).
# ----------------------------------------------------------------------------

def twin_pairwise_forward(x3, y3, lam, kind):
    """Plain-PyTorch kernel matrix, same contract as :func:`fused_pairwise_forward`."""
    a = compute_dtype(x3.dtype)
    xa, ya = x3.to(a), y3.to(a)
    if kind == rt.LAPLACIAN:
        dist = torch.cdist(xa, ya, p=1.0)
    else:
        dist = ((xa * xa).sum(-1, keepdim=True) + (ya * ya).sum(-1).unsqueeze(-2)
                - 2.0 * torch.bmm(xa, ya.mT)).clamp_min(0.0)
    return torch.exp(dist * (-1.0 / lam)).to(x3.dtype)


def _twin_grad(w, rows, red, lam, kind):
    """-coef * sum_j w[i, j] phi(rows_i - red_j) for w (batch, n_rows, n_red)."""
    if kind == rt.LAPLACIAN:
        w = w.contiguous()
        return torch.ops.aten._cdist_backward(w, rows, red, 1.0, w) * (-1.0 / lam)
    return (w.sum(-1, keepdim=True) * rows - torch.bmm(w, red)) * (-2.0 / lam)


def twin_pairwise_backward(grad, kmat, x3, y3, lam, kind, need_x, need_y):
    """Plain-PyTorch (dx, dy), same contract as :func:`fused_pairwise_backward`."""
    a = compute_dtype(x3.dtype)
    w = grad.to(a) * kmat.to(a)
    xa, ya = x3.to(a), y3.to(a)
    dx = _twin_grad(w, xa, ya, lam, kind).to(x3.dtype) if need_x else x3.new_empty(0)
    dy = _twin_grad(w.mT, ya, xa, lam, kind).to(y3.dtype) if need_y else y3.new_empty(0)
    return dx, dy


def twin_newton_schulz(P3, iters, authors):
    """Newton–Schulz with batched matmuls in full precision (TF32 off)."""
    from .solvers import newton_schulz_iterate
    with full_precision_matmul():
        return newton_schulz_iterate(P3, iters, 'authors' if authors else 'identity')


# ----------------------------------------------------------------------------
# The raw ops' contract. The kernels index raw pointers as contiguous tensors
# of one dtype on one device; ``torch.ops.lapformer_mm.*`` are callable
# directly, so every implementation (CUDA, CPU, fake) enforces it itself.
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
# Custom ops: opaque to torch.compile, CUDA kernels on CUDA, twins on CPU.
# ----------------------------------------------------------------------------

_FORWARD_OP = 'lapformer_mm::cuda_pairwise_kernel'
_BACKWARD_OP = 'lapformer_mm::cuda_pairwise_kernel_backward'
_NS_OP = 'lapformer_mm::cuda_newton_schulz'
_NS_BACKWARD_OP = 'lapformer_mm::cuda_newton_schulz_backward'


@torch.library.custom_op(_FORWARD_OP, mutates_args=(), device_types='cuda')
def pairwise_kernel_op(x: torch.Tensor, y: torch.Tensor, lam: float, kind: int) -> torch.Tensor:
    """Fused kernel matrix of x (batch, n, d), y (batch, m, d)."""
    return fused_pairwise_forward(*_pairwise_operands(_FORWARD_OP, x, y), lam, kind)


@pairwise_kernel_op.register_kernel('cpu')
def _pairwise_kernel_cpu(x, y, lam, kind):
    return twin_pairwise_forward(*_pairwise_operands(_FORWARD_OP, x, y), lam, kind)


@pairwise_kernel_op.register_fake
def _pairwise_kernel_fake(x, y, lam, kind):
    x, y = _pairwise_operands(_FORWARD_OP, x, y)
    return x.new_empty(x.shape[0], x.shape[1], y.shape[1])


@torch.library.custom_op(_BACKWARD_OP, mutates_args=(), device_types='cuda')
def pairwise_kernel_backward_op(grad: torch.Tensor, kmat: torch.Tensor, x: torch.Tensor,
                                y: torch.Tensor, lam: float, kind: int, need_x: bool,
                                need_y: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dy) of the fused kernel matrix; empty tensors for gradients not needed."""
    x, y, grad, kmat = _pairwise_operands(_BACKWARD_OP, x, y, grad, kmat)
    return fused_pairwise_backward(grad, kmat, x, y, lam, kind, need_x, need_y,
                                   target_blocks(x.device))


@pairwise_kernel_backward_op.register_kernel('cpu')
def _pairwise_kernel_backward_cpu(grad, kmat, x, y, lam, kind, need_x, need_y):
    x, y, grad, kmat = _pairwise_operands(_BACKWARD_OP, x, y, grad, kmat)
    return twin_pairwise_backward(grad, kmat, x, y, lam, kind, need_x, need_y)


@pairwise_kernel_backward_op.register_fake
def _pairwise_kernel_backward_fake(grad, kmat, x, y, lam, kind, need_x, need_y):
    x, y, _, _ = _pairwise_operands(_BACKWARD_OP, x, y, grad, kmat)
    return (torch.empty_like(x) if need_x else x.new_empty(0),
            torch.empty_like(y) if need_y else y.new_empty(0))


@torch.library.custom_op(_NS_OP, mutates_args=(), device_types='cuda')
def newton_schulz_op(P: torch.Tensor, iters: int, authors: bool) -> torch.Tensor:
    """Newton–Schulz inverse of fp32/fp64 P (batch, m, m)."""
    (P,) = _square_operands(_NS_OP, P=P)
    out = fused_newton_schulz(P, iters, authors, rt.shared_memory_optin(P.device.index))
    return twin_newton_schulz(P, iters, authors) if out is None else out


@newton_schulz_op.register_kernel('cpu')
def _newton_schulz_cpu(P, iters, authors):
    (P,) = _square_operands(_NS_OP, P=P)
    return twin_newton_schulz(P, iters, authors)


@newton_schulz_op.register_fake
def _newton_schulz_fake(P, iters, authors):
    (P,) = _square_operands(_NS_OP, P=P)
    return torch.empty_like(P)


@torch.library.custom_op(_NS_BACKWARD_OP, mutates_args=())
def newton_schulz_backward_op(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Closed-form gradient ``-Xᵀ G Xᵀ`` for X, G (batch, m, m), full-precision bmm.

    An op of its own so that the TF32 switch inside stays out of Dynamo's trace.
    """
    x, grad = _square_operands(_NS_BACKWARD_OP, x=x, grad=grad)
    xt = x.mT
    with full_precision_matmul():
        return -torch.bmm(torch.bmm(xt, grad), xt)


@newton_schulz_backward_op.register_fake
def _newton_schulz_backward_fake(x, grad):
    x, _ = _square_operands(_NS_BACKWARD_OP, x=x, grad=grad)
    return torch.empty_like(x)


# ----------------------------------------------------------------------------
# Differentiable wrappers.
# ----------------------------------------------------------------------------

def _flatten(t, batch_shape):
    """(..., n, d) broadcast to batch_shape -> contiguous (batch, n, d)."""
    t = t.expand(*batch_shape, *t.shape[-2:])
    return t.reshape(-1, t.shape[-2], t.shape[-1]).contiguous()


class PairwiseKernelFunction(torch.autograd.Function):
    """exp(-dist(x_i, y_j) / lam) for x (..., N, d), y (..., M, d) -> (..., N, M).

    Leading dimensions broadcast. The backward never builds (..., N, M, d).
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type='cuda', cast_inputs=torch.float32)
    def forward(ctx, x, y, lam, kind):
        batch_shape = torch.broadcast_shapes(x.shape[:-2], y.shape[:-2])
        x3, y3 = _flatten(x, batch_shape), _flatten(y, batch_shape)
        kmat = pairwise_kernel_op(x3, y3, lam, kind)
        ctx.save_for_backward(x3, y3, kmat)
        ctx.lam, ctx.kind = lam, kind
        ctx.shapes = (x.shape, y.shape, batch_shape)
        return kmat.view(*batch_shape, x.shape[-2], y.shape[-2])

    @staticmethod
    @torch.amp.custom_bwd(device_type='cuda')
    def backward(ctx, grad):
        x3, y3, kmat = ctx.saved_tensors
        x_shape, y_shape, batch_shape = ctx.shapes
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad3 = grad.reshape(kmat.shape).to(kmat.dtype).contiguous()
        dx, dy = pairwise_kernel_backward_op(grad3, kmat, x3, y3, ctx.lam, ctx.kind, need_x, need_y)
        grad_x = dx.view(*batch_shape, *x_shape[-2:]).sum_to_size(x_shape) if need_x else None
        grad_y = dy.view(*batch_shape, *y_shape[-2:]).sum_to_size(y_shape) if need_y else None
        return grad_x, grad_y, None, None


class NewtonSchulzFunction(torch.autograd.Function):
    """Inverse of SPD P (..., m, m) by Newton–Schulz; backward ``-Xᵀ G Xᵀ``."""

    @staticmethod
    @torch.amp.custom_fwd(device_type='cuda', cast_inputs=torch.float32)
    def forward(ctx, P, iters, init):
        m = P.shape[-1]
        P3 = P.reshape(-1, m, m).to(compute_dtype(P.dtype)).contiguous()
        x = newton_schulz_op(P3, iters, init == 'authors')
        ctx.save_for_backward(x)
        ctx.p_shape = P.shape
        return x.view(P.shape).to(P.dtype)

    @staticmethod
    @torch.amp.custom_bwd(device_type='cuda')
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        grad_p = newton_schulz_backward_op(x, grad.reshape(x.shape).to(x.dtype).contiguous())
        return grad_p.view(ctx.p_shape).to(grad.dtype), None, None


# ----------------------------------------------------------------------------
# Public API (CUDA tensors only).
# ----------------------------------------------------------------------------

def _check_cuda_tensor(func, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f'{func}: {name} must be a torch.Tensor, got {type(t).__name__}')
    if not t.is_cuda:
        raise ValueError(f'{func}: {name} is on {t.device}; the cupy backend needs CUDA '
                         f"tensors (use backend='reference' on CPU)")
    if t.dtype not in _DTYPES:
        raise TypeError(f'{func}: {name} has dtype {t.dtype}; allowed: {list(_DTYPES)}')


def _check_pair(func, x, y, lam):
    _check_cuda_tensor(func, 'x', x)
    _check_cuda_tensor(func, 'y', y)
    if x.dim() < 2 or y.dim() < 2 or x.shape[-1] != y.shape[-1]:
        raise ValueError(f'{func}: x (..., N, d) and y (..., M, d) need the same d, got '
                         f'x {tuple(x.shape)} and y {tuple(y.shape)}')
    if x.device != y.device:
        raise ValueError(f'{func}: x is on {x.device} but y is on {y.device}')
    if x.dtype != y.dtype:
        raise TypeError(f'{func}: x has dtype {x.dtype} but y has {y.dtype}')
    try:
        torch.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    except RuntimeError as exc:
        raise ValueError(f'{func}: batch dimensions of x {tuple(x.shape)} and y '
                         f'{tuple(y.shape)} do not broadcast') from exc
    lam = float(lam)
    if not (math.isfinite(lam) and lam > 0):
        raise ValueError(f'{func}: lam must be finite and > 0, got {lam}')
    return lam


def apply_pairwise(x, y, lam, kind):
    """:class:`PairwiseKernelFunction` on checked arguments.

    ``k(L, L)`` passes one tensor twice; Dynamo cannot trace an
    autograd.Function given the same tensor for two inputs, so y becomes a
    distinct view of it (same storage, no copy).
    """
    if y is x:
        y = x.view_as(x)
    return PairwiseKernelFunction.apply(x, y, lam, kind)


def laplacian_kernel(x, y, lam=4.0):
    """Fused ``exp(-||x_i - y_j||_1 / lam)``; x (..., N, d), y (..., M, d) CUDA -> (..., N, M)."""
    lam = _check_pair('laplacian_kernel', x, y, lam)
    return apply_pairwise(x, y, lam, rt.LAPLACIAN)


def gaussian_kernel(x, y, lam=4.0):
    """Fused ``exp(-||x_i - y_j||_2^2 / lam)``; x (..., N, d), y (..., M, d) CUDA -> (..., N, M)."""
    lam = _check_pair('gaussian_kernel', x, y, lam)
    return apply_pairwise(x, y, lam, rt.GAUSSIAN)


def newton_schulz_pinv(P, iters=None, init='identity'):
    """Newton–Schulz inverse of SPD P (..., m, m) on CUDA, as given (no ε added).

    ``iters=None`` uses the reference's measured default
    (:data:`lapformer_mm.ops.solvers.DEFAULT_NS_ITERS`). Computes in fp32
    (fp64 stays fp64) and returns P's dtype.
    """
    _check_cuda_tensor('newton_schulz_pinv', 'P', P)
    if P.dim() < 2 or P.shape[-1] != P.shape[-2]:
        raise ValueError(f'newton_schulz_pinv: P must be square (..., m, m), got {tuple(P.shape)}')
    if iters is None:
        from .solvers import DEFAULT_NS_ITERS
        iters = DEFAULT_NS_ITERS
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f'newton_schulz_pinv: iters must be an int >= 0, got {iters!r}')
    if init not in NS_INITS:
        raise ValueError(f'newton_schulz_pinv: init must be one of {NS_INITS}, got {init!r}')
    return NewtonSchulzFunction.apply(P, iters, init)
