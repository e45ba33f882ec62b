"""The attention's primitives as checked public functions over :mod:`.reference`, for tests,
analysis and users who compose their own attention (the module calls the op instead)."""
import torch

from . import reference
from ._checks import (
    KERNELS,
    NS_INITS,
    check_choice,
    check_float_tensor,
    check_hw,
    check_int,
    check_kernel_pair,
    check_non_negative,
    check_positive,
    check_square,
)


def kernel_matrix(kernel, x, y, lam=4.0):
    """The kernel ``kernel`` ('laplacian' or 'gaussian') of x (..., N, d), y (..., M, d)
    -> (..., N, M) in x's dtype, computed in fp32 (fp64 stays fp64) without an (N, M, d)
    tensor either way; the gradient of |t| at t = 0 is 0."""
    check_choice('kernel', kernel, KERNELS)
    check_kernel_pair(x, y)
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
    check_square('P', P)
    iters = reference.DEFAULT_NS_ITERS if iters is None else check_int('iters', iters)
    check_choice('init', init, NS_INITS)
    p = P.to(reference.compute_dtype(P.dtype))
    return reference.newton_schulz(p, iters, init).to(P.dtype)


def pool_landmarks(t, hw, grid=7):
    """Adaptive average pooling of tokens t (B, h, N, d) on an H×W grid -> (B, h, m, d),
    m = min(grid, H) · min(grid, W), in row-major grid order."""
    check_float_tensor('t', t, min_dim=4)
    if t.dim() != 4:
        raise ValueError(f't must be (B, h, N, d), got shape {tuple(t.shape)}')
    return reference.pool_landmarks(t, check_hw(hw, t.shape[2]), check_int('grid', grid))


def injective_normalize(C, whiten_eps=1e-5):
    """Z = c̃ diag(s) + 1/m for C (..., N, m), per sample and per head, no running statistics:
    c̃ = C − rowmean(C), s_j = (var_i c̃_ij + δ)^-½ (biased var; 0 where var + δ = 0)."""
    check_float_tensor('C', C)
    return reference.whiten(C, check_non_negative('whiten_eps', whiten_eps))[0]


def landmark_matrix(landmarks, options):
    """P = k(L, L) + eps·I (..., m, m) for landmarks (..., m, d) and an ``AttentionOptions``."""
    check_float_tensor('landmarks', landmarks, min_dim=2)
    if not all(hasattr(options, field) for field in ('kernel', 'lam', 'eps')):
        raise TypeError(f'options must be a lapformer_mm.ops.AttentionOptions (its kernel, lam '
                        f'and eps), got {type(options).__name__} {options!r}')
    dtype = reference.compute_dtype(landmarks.dtype)
    return reference.landmark_system(landmarks.to(dtype), options.lam, options.eps,
                                     options.kernel)
