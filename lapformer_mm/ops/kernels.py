"""The attention's primitives as registered operators, and their public functions.

One ``torch.library.custom_op`` per primitive, each defined once:

* ``lapformer_mm::pairwise_kernel(x, y, lam, kind, impl)``: the kernel
  matrix exp(-dist(x_i, y_j) / lam) of x (batch, N, d) and y (batch, M, d),
  ``kind`` 'laplacian' (ℓ1) or 'gaussian' (squared ℓ2); its gradient is the op
  ``lapformer_mm::pairwise_kernel_backward``;
* ``lapformer_mm::newton_schulz(P, iters, init, impl)``: the
  Newton–Schulz inverse of SPD P (batch, m, m), gradient ``-Xᵀ G Xᵀ``.

These primitives serve the public kernel functions below and the attention's composite
path (dropout on Z, the 'exact' and 'cg' solvers); the default attention is one op,
``lapformer_mm::nystrom_attention`` (:mod:`.nystrom`). The implementation is the
plain-PyTorch reference (:mod:`.reference_kernels`, :mod:`.solvers`) on every device;
``impl='cupy'`` runs the CuPy kernels of :mod:`.cupy_ops` instead (CUDA tensors) and
``impl='cpu'`` the C++ kernels of :mod:`.cpu_ext` (CPU tensors; the Newton–Schulz op
keeps the reference there); the public functions decide ``impl`` by
:func:`~lapformer_mm.ops.dispatch.resolve_impl`. The ops are opaque nodes to
``torch.compile``, with a fake implementation for shape propagation.
"""
import math

import torch

from ._checks import (
    KERNELS,
    NS_INITS,
    check_choice,
    check_kernel_pair,
    check_optional_int,
    check_positive,
)
from ._precision import compute_dtype
from .dispatch import implementation, requested_impl, resolve_impl
from .reference_kernels import pairwise_grad_reference, pairwise_kernel_reference
from .solvers import DEFAULT_NS_ITERS, check_square, newton_schulz_iterate

#: The implementations with their own kernel-matrix kernels (pairwise_forward/backward);
#: the CUDA backend has the fused attention only, and the primitives run the reference.
FAST_KERNEL_IMPLS = ('cpu',)


@torch.library.custom_op('lapformer_mm::pairwise_kernel', mutates_args=())
def pairwise_kernel_op(x: torch.Tensor, y: torch.Tensor, lam: float, kind: str,
                       impl: str) -> torch.Tensor:
    """Kernel matrix (batch, N, M) of x (batch, N, d), y (batch, M, d), in x's dtype.

    Computes in fp32 for 16-bit inputs (fp64 stays fp64).
    """
    if impl in FAST_KERNEL_IMPLS:
        return implementation(impl).pairwise_forward(x, y, lam, kind)
    a = compute_dtype(x.dtype)
    return pairwise_kernel_reference(x.to(a), y.to(a), lam, kind).to(x.dtype)


@pairwise_kernel_op.register_fake
def _(x, y, lam, kind, impl):
    return x.new_empty(x.shape[0], x.shape[1], y.shape[1])


@torch.library.custom_op('lapformer_mm::pairwise_kernel_backward', mutates_args=())
def pairwise_kernel_backward_op(grad: torch.Tensor, kmat: torch.Tensor, x: torch.Tensor,
                                y: torch.Tensor, lam: float, kind: str, need_x: bool,
                                need_y: bool, impl: str
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dy) of the kernel matrix kmat = K(x, y) for the output gradient grad.

    An empty tensor stands for a gradient not needed.
    """
    if impl in FAST_KERNEL_IMPLS:
        return implementation(impl).pairwise_backward(grad, kmat, x, y, lam, kind, need_x,
                                                      need_y)
    a = compute_dtype(x.dtype)
    w = grad.to(a) * kmat.to(a)
    xa, ya = x.to(a), y.to(a)
    dx = pairwise_grad_reference(w, xa, ya, lam, kind).to(x.dtype) if need_x else x.new_empty(0)
    dy = pairwise_grad_reference(w.mT, ya, xa, lam, kind).to(y.dtype) if need_y else y.new_empty(0)
    return dx, dy


@pairwise_kernel_backward_op.register_fake
def _(grad, kmat, x, y, lam, kind, need_x, need_y, impl):
    return (torch.empty_like(x) if need_x else x.new_empty(0),
            torch.empty_like(y) if need_y else y.new_empty(0))


def _pairwise_setup(ctx, inputs, output):
    x, y, lam, kind, impl = inputs
    ctx.save_for_backward(x, y, output)
    ctx.options = (lam, kind, impl)


def _pairwise_backward(ctx, grad):
    x, y, kmat = ctx.saved_tensors
    lam, kind, impl = ctx.options
    need_x, need_y = ctx.needs_input_grad[:2]
    dx, dy = pairwise_kernel_backward_op(grad.to(kmat.dtype).contiguous(), kmat, x, y, lam,
                                         kind, need_x, need_y, impl)
    return dx if need_x else None, dy if need_y else None, None, None, None


pairwise_kernel_op.register_autograd(_pairwise_backward, setup_context=_pairwise_setup)


@torch.library.custom_op('lapformer_mm::newton_schulz', mutates_args=())
def newton_schulz_op(P: torch.Tensor, iters: int, init: str, impl: str) -> torch.Tensor:
    """Newton–Schulz inverse X of SPD P (batch, m, m), fp32 or fp64."""
    return newton_schulz_iterate(P, iters, init)


@newton_schulz_op.register_fake
def _(P, iters, init, impl):
    return torch.empty_like(P)


def _newton_schulz_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _newton_schulz_backward(ctx, grad):
    # X is the inverse of P, so dP = -Xᵀ G Xᵀ (the derivative of the inverse).
    (x,) = ctx.saved_tensors
    xt = x.mT
    return -torch.matmul(torch.matmul(xt, grad), xt), None, None, None


newton_schulz_op.register_autograd(_newton_schulz_backward, setup_context=_newton_schulz_setup)

# The design computes kernel matrices and the solve in fp32: under autocast the
# ops take fp32 inputs (and return fp32), as a matmul-like op would not.
for _op in ('pairwise_kernel', 'newton_schulz'):
    for _device in ('cpu', 'cuda'):
        torch.library.register_autocast(f'lapformer_mm::{_op}', _device, torch.float32)


def pairwise_kernel_flops(x_shape, y_shape):
    """Multiply-adds of K(x, y) for x (..., N, d), y (..., M, d): batch · N · M · (d + 1).

    Each (pair, channel) is one subtract-abs-accumulate (Gaussian: square-accumulate),
    counted like a multiply-add, plus one exp per pair.
    """
    return math.prod(x_shape[:-2]) * x_shape[-2] * y_shape[-2] * (x_shape[-1] + 1)


def newton_schulz_flops(p_shape, iters):
    """Multiply-adds of ``iters`` Newton–Schulz steps on P (..., m, m): batch · (2 m³ t + m²).

    Two m x m products per step, plus the start.
    """
    m = p_shape[-1]
    return math.prod(p_shape[:-2]) * (2 * m ** 3 * iters + m * m)


def _as_batch(t):
    """(..., n, d) -> (batch, n, d), a view where the strides allow."""
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def pairwise_kernel(x, y, lam, kind, impl):
    """K(x, y) (..., N, M) for x (..., N, d), y (..., M, d) with equal batch dims; unchecked."""
    kmat = pairwise_kernel_op(_as_batch(x), _as_batch(y), lam, kind, impl)
    return kmat.view(*x.shape[:-1], y.shape[-2])


def newton_schulz(P, iters, init, impl):
    """Newton–Schulz inverse of SPD P (..., m, m) in P's compute dtype; unchecked.

    ``iters=None`` uses :data:`~lapformer_mm.ops.solvers.DEFAULT_NS_ITERS`.
    """
    iters = DEFAULT_NS_ITERS if iters is None else iters
    p3 = _as_batch(P).to(compute_dtype(P.dtype))
    return newton_schulz_op(p3, iters, init, impl).view(P.shape).to(P.dtype)


def _resolve(impl, tensor):
    return resolve_impl(requested_impl(impl), tensor.device)


def _kernel_matrix(kind, x, y, lam, impl):
    check_kernel_pair(x, y)
    lam = check_positive('lam', lam)
    return pairwise_kernel(x, y, lam, kind, _resolve(impl, x))


def laplacian_kernel(x, y, lam=4.0, *, impl=None):
    """exp(-||x_i - y_j||_1 / lam) for x (..., N, d), y (..., M, d) -> (..., N, M).

    Neither forward nor backward builds an (..., N, M, d) tensor; the gradient
    of |t| at t = 0 is 0. ``impl``: see :class:`~lapformer_mm.ops.AttentionOptions`.
    """
    return _kernel_matrix('laplacian', x, y, lam, impl)


def gaussian_kernel(x, y, lam=4.0, *, impl=None):
    """exp(-||x_i - y_j||_2^2 / lam) for x (..., N, d), y (..., M, d) -> (..., N, M)."""
    return _kernel_matrix('gaussian', x, y, lam, impl)


def kernel_matrix(kernel, x, y, lam=4.0, *, impl=None):
    """The kernel named ``kernel`` ('laplacian' or 'gaussian') of x and y."""
    return _kernel_matrix(check_choice('kernel', kernel, KERNELS), x, y, lam, impl)


def newton_schulz_pinv(P, iters=None, init='identity', *, impl=None):
    """Inverse of the symmetric positive definite P (..., m, m), as given.

    The caller adds ε·I. ``init='identity'`` starts from I / ||P||_inf,
    ``init='authors'`` from 1.8 / ||P||_inf² · P. ``iters=None`` uses
    :data:`~lapformer_mm.ops.solvers.DEFAULT_NS_ITERS`. Computes in fp32 (fp64
    stays fp64) and returns P's dtype; the backward is the closed form -Xᵀ G Xᵀ.
    """
    check_square('P', P)
    iters = check_optional_int('iters', iters)
    check_choice('init', init, NS_INITS)
    return newton_schulz(P, iters, init, _resolve(impl, P))
