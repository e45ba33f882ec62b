"""The attention: :mod:`.reference` (the math), :mod:`.attention` (options, op, entry),
:mod:`.backends` (kernels), :mod:`.functional` (checked primitives), :mod:`.export`."""
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
