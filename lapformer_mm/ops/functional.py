"""The attention's primitives over :mod:`.reference` for users: in fp32 (fp64 stays fp64), the
input's dtype out, refusing what the math would take without a word."""
import torch

from . import reference
from ._checks import KERNELS, NS_INITS, check_choice, check_int, check_non_negative, check_positive


def kernel_matrix(kernel, x, y, lam=4.0):
    """k(x, y) (..., N, M) for x (..., N, d), y (..., M, d), without an (N, M, d) tensor."""
    check_choice('kernel', kernel, KERNELS)
    if x.shape[:-2] != y.shape[:-2]:
        raise ValueError(f'x (..., N, d) and y (..., M, d) must share their batch dims, got '
                         f'{tuple(x.shape)} and {tuple(y.shape)}')
    lam = check_positive('lam', lam)
    dtype = reference.compute_dtype(x.dtype)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return reference.similarity(x.to(dtype), y.to(dtype), lam, kernel).to(x.dtype)


def laplacian_kernel(x, y, lam=4.0):
    """exp(-||x_i - y_j||_1 / lam)."""
    return kernel_matrix('laplacian', x, y, lam)


def gaussian_kernel(x, y, lam=4.0):
    """exp(-||x_i - y_j||_2^2 / lam)."""
    return kernel_matrix('gaussian', x, y, lam)


def newton_schulz_pinv(P, iters=None, init='identity'):
    """P⁻¹ of the SPD P (..., m, m) in ``iters`` Newton–Schulz steps (None: the default)."""
    iters = reference.DEFAULT_NS_ITERS if iters is None else check_int('iters', iters)
    check_choice('init', init, NS_INITS)
    return reference.newton_schulz(P.to(reference.compute_dtype(P.dtype)), iters,
                                   init).to(P.dtype)


def injective_normalize(C, whiten_eps=1e-5):
    """Z = c̃ diag(s) + 1/m for C (..., N, m) (:func:`~.reference.whiten`)."""
    return reference.whiten(C, check_non_negative('whiten_eps', whiten_eps))[0]


def landmark_matrix(landmarks, options):
    """P = k(L, L) + eps·I (..., m, m) for landmarks (..., m, d) and an ``AttentionOptions``."""
    return reference.landmark_system(landmarks.to(reference.compute_dtype(landmarks.dtype)),
                                     options.lam, options.eps, options.kernel)
