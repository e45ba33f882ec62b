"""Public, backend-dispatched kernel matrices and Newton–Schulz inverse.

Each function validates its arguments, picks the backend with
:func:`~lapformer_mm.ops.dispatch.resolve_backend` and calls either the
pure-PyTorch reference or ``lapformer_mm.ops.cupy_ops``. All are differentiable.
"""
from ._checks import (NS_INITS, check_choice, check_kernel_pair,
                      check_optional_int, check_positive)
from .dispatch import cupy_ops, resolve_backend
from .reference_kernels import gaussian_kernel_reference, laplacian_kernel_reference
from .solvers import DEFAULT_NS_ITERS, check_square, newton_schulz_pinv_reference


def laplacian_kernel(x, y, lam=4.0, *, backend=None):
    """exp(-||x_i - y_j||_1 / lam) for x (..., N, d), y (..., M, d) -> (..., N, M).

    Neither forward nor backward builds an (..., N, M, d) tensor; the gradient
    of |t| at t = 0 is 0.
    """
    check_kernel_pair(x, y)
    lam = check_positive('lam', lam)
    if resolve_backend(backend, x) == 'cupy':
        return cupy_ops().laplacian_kernel(x, y, lam)
    return laplacian_kernel_reference(x, y, lam)


def gaussian_kernel(x, y, lam=4.0, *, backend=None):
    """exp(-||x_i - y_j||_2^2 / lam) for x (..., N, d), y (..., M, d) -> (..., N, M)."""
    check_kernel_pair(x, y)
    lam = check_positive('lam', lam)
    if resolve_backend(backend, x) == 'cupy':
        return cupy_ops().gaussian_kernel(x, y, lam)
    return gaussian_kernel_reference(x, y, lam)


KERNEL_FUNCTIONS = {'laplacian': laplacian_kernel, 'gaussian': gaussian_kernel}


def newton_schulz_pinv(P, iters=None, init='identity', *, backend=None):
    """Inverse of the symmetric positive definite P (..., m, m), as given.

    The caller adds ε·I. ``init='identity'`` starts from I / ||P||_inf,
    ``init='authors'`` from 1.8 / ||P||_inf² · P. ``iters=None`` uses
    :data:`~lapformer_mm.ops.solvers.DEFAULT_NS_ITERS`. Computes in fp32 (fp64
    stays fp64) with TF32 off; the backward is the closed form -Xᵀ G Xᵀ.
    """
    check_square('P', P)
    iters = check_optional_int('iters', iters)
    iters = DEFAULT_NS_ITERS if iters is None else iters
    check_choice('init', init, NS_INITS)
    if resolve_backend(backend, P) == 'cupy':
        return cupy_ops().newton_schulz_pinv(P, iters, init)
    return newton_schulz_pinv_reference(P, iters, init)
