"""The fused CUDA kernels (CuPy/NVRTC) as the attention op's 'cupy' backend.

The kernels and their launches are in :mod:`lapformer_mm.ops.cupy_ops`; CuPy is imported only
when a call runs here.
"""
import importlib

NAME = 'cupy'
DEVICE = 'cuda'

_AVAILABLE = []


def available():
    """True when ``import cupy`` succeeds (checked once)."""
    if not _AVAILABLE:
        try:
            importlib.import_module('cupy')
            _AVAILABLE.append(True)
        except Exception:  # a broken CUDA install raises more than ImportError
            _AVAILABLE.append(False)
    return _AVAILABLE[0]


def clear_cache():
    """Forget the availability check (tests that fake an environment)."""
    _AVAILABLE.clear()


def not_supported(q, k, v, landmarks, opts):
    """Why the fused kernels cannot run this call (empty: they can)."""
    from .. import cuda_runtime as rt
    reasons = []
    if rt.ELEMENT_TYPES.get(q.dtype) not in rt.NYS_ELEMENT_TYPES:
        reasons.append(f'dtype {q.dtype} (supported: float32, bfloat16, float16)')
    if not 1 <= landmarks.shape[-2] <= rt.NYS_MP:
        reasons.append(f'm={landmarks.shape[-2]} landmarks (supported: 1..{rt.NYS_MP})')
    if not 1 <= v.shape[-1] <= rt.NYS_DV:
        reasons.append(f'd_v={v.shape[-1]} (supported: 1..{rt.NYS_DV})')
    if q.numel() == 0 or v.numel() == 0:
        reasons.append('empty operands')
    return reasons


def forward(q, k, v, landmarks, opts):
    """(out, context, inverse, stats) of the op's contract (3 launches)."""
    from .. import cupy_ops
    return cupy_ops.nystrom_attention_forward(q, k, v, landmarks, *opts)


def backward(grad, q, k, v, landmarks, context, inverse, stats, opts):
    """(dq, dk, dv, dlandmarks) of the op's contract (4 launches)."""
    from .. import cupy_ops
    return cupy_ops.nystrom_attention_backward(grad, q, k, v, landmarks, context, inverse, stats,
                                               opts.kernel, opts.lam, opts.eps, opts.ns_refine,
                                               opts.normalize, opts.whiten_eps)



