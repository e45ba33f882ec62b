"""Attention math for LaplacianFormer: one registered op with its backends, over a reference.
Shapes are (B, h, N, d). Reading order: :mod:`.reference` (the math, in the order it runs),
:mod:`.attention` (options, op, entry), :mod:`.backends` (CUDA and C++ CPU kernels),
:mod:`.functional` (checked primitives), :mod:`.export` (what the exporters need)."""
from .attention import AttentionOptions, nystrom_attention, resolve_impl, select_backend
from .functional import (
                         gaussian_kernel,
                         injective_normalize,
                         kernel_matrix,
                         landmark_matrix,
                         laplacian_kernel,
                         newton_schulz_pinv,
)
from .reference import DEFAULT_NS_ITERS, cg_solve, exact_inverse, exact_solve, pool_landmarks

__all__ = [
    'AttentionOptions', 'DEFAULT_NS_ITERS', 'cg_solve', 'exact_inverse', 'exact_solve',
    'gaussian_kernel', 'injective_normalize', 'kernel_matrix', 'landmark_matrix',
    'laplacian_kernel', 'newton_schulz_pinv', 'nystrom_attention', 'pool_landmarks',
    'resolve_impl', 'select_backend',
]
