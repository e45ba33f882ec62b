"""Attention math for LaplacianFormer: registered ops with a PyTorch reference and CuPy kernels.

Shapes are (batch, heads, tokens, head width) = (B, h, N, d); kernels take
x (..., N, d), y (..., M, d) and return (..., N, M). The attention is one op per call
(:mod:`.nystrom`); :func:`resolve_impl` chooses its implementation.
"""
from .dispatch import resolve_impl
from .kernels import gaussian_kernel, kernel_matrix, laplacian_kernel, newton_schulz_pinv
from .landmarks import pool_landmarks
from .normalize import injective_normalize
from .nystrom import AttentionOptions, landmark_matrix, nystrom_attention, nystrom_forward
from .solvers import DEFAULT_NS_ITERS, cg_solve, exact_inverse, exact_solve

__all__ = [
    'AttentionOptions', 'DEFAULT_NS_ITERS', 'cg_solve', 'exact_inverse', 'exact_solve',
    'gaussian_kernel', 'injective_normalize', 'kernel_matrix', 'landmark_matrix',
    'laplacian_kernel', 'newton_schulz_pinv', 'nystrom_attention', 'nystrom_forward',
    'pool_landmarks', 'resolve_impl',
]
