"""The attention's primitives as public functions over :mod:`.reference`, for tests, analysis
and users who compose their own attention (the module calls the op instead). Each checks what
the math would take without a word: a kernel or start it does not know, batch dims it would
broadcast, a bandwidth or ridge that is no positive number."""
import torch

from . import reference
from ._checks import (
    KERNELS,
    NS_INITS,
    check_choice,
    check_int,
    check_non_negative,
    check_positive,
)


def kernel_matrix(kernel, x, y, lam=4.0):
    """The kernel ``kernel`` ('laplacian' or 'gaussian') of x (..., N, d), y (..., M, d)
    -> (..., N, M) in x's dtype, computed in fp32 (fp64 stays fp64) without an (N, M, d)
    tensor either way; the gradient of |t| at t = 0 is 0."""
    check_choice('kernel', kernel, KERNELS)
    if x.shape[:-2] != y.shape[:-2]:
        raise ValueError(f'x (..., N, d) and y (..., M, d) must share their batch dims, got '
                         f'{tuple(x.shape)} and {tuple(y.shape)}')
    lam = check_positive('lam', lam)
    dtype = reference.compute_dtype(x.dtype)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return reference.similarity(x.to(dtype), y.to(dtype), lam, kernel).to(x.dtype)


def laplacian_kernel(x, y, lam=4.0):
    """exp(-||x_i - y_j||_1 / lam) for x (..., N, d), y (..., M, d) -> (..., N, M)."""
    return kernel_matrix('laplacian', x, y, lam)


def gaussian_kernel(x, y, lam=4.0):
    """exp(-||x_i - y_j||_2^2 / lam) for x (..., N, d), y (..., M, d) -> (..., N, M)."""
    return kernel_matrix('gaussian', x, y, lam)


def newton_schulz_pinv(P, iters=None, init='identity'):
    """Inverse of the symmetric positive definite P (..., m, m), as given (the caller adds εI),
    from the start ``init`` (:func:`~.reference.newton_schulz`) in ``iters`` steps
    (None: ``DEFAULT_NS_ITERS``); fp32 (fp64 stays fp64), differentiable, P's dtype."""
    iters = reference.DEFAULT_NS_ITERS if iters is None else check_int('iters', iters)
    check_choice('init', init, NS_INITS)
    p = P.to(reference.compute_dtype(P.dtype))
    return reference.newton_schulz(p, iters, init).to(P.dtype)


def injective_normalize(C, whiten_eps=1e-5):
    """Z = c̃ diag(s) + 1/m for C (..., N, m), per sample and per head, no running statistics:
    c̃ = C − rowmean(C), s_j = (var_i c̃_ij + δ)^-½ (biased var; 0 where var + δ = 0)."""
    return reference.whiten(C, check_non_negative('whiten_eps', whiten_eps))[0]


def landmark_matrix(landmarks, options):
    """P = k(L, L) + eps·I (..., m, m) for landmarks (..., m, d) and an ``AttentionOptions``."""
    dtype = reference.compute_dtype(landmarks.dtype)
    return reference.landmark_system(landmarks.to(dtype), options.lam, options.eps,
                                     options.kernel)
