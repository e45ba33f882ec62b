"""Attention math for LaplacianFormer: pure-PyTorch reference ops and CuPy dispatch.

Shapes are (batch, heads, tokens, head width) = (B, h, N, d); kernels take
x (..., N, d), y (..., M, d) and return (..., N, M).
"""
from .dispatch import resolve_backend
from .kernels import gaussian_kernel, laplacian_kernel, newton_schulz_pinv
from .landmarks import pool_landmarks
from .normalize import injective_normalize
from .nystrom import nystrom_attention
from .solvers import DEFAULT_NS_ITERS, cg_solve, exact_inverse, exact_solve

__all__ = [
    'DEFAULT_NS_ITERS', 'cg_solve', 'exact_inverse', 'exact_solve', 'gaussian_kernel',
    'injective_normalize', 'laplacian_kernel', 'newton_schulz_pinv',
    'nystrom_attention', 'pool_landmarks', 'resolve_backend',
]
