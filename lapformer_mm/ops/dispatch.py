"""Choice between the pure-PyTorch reference ops and the CuPy CUDA kernels.

``backend=None`` means: the environment variable ``LAPFORMER_OPS``
('reference' or 'cupy') when set, else 'cupy' for CUDA tensors when
``import cupy`` works, else 'reference'. ``lapformer_mm.ops.cupy_ops`` is
imported only when the CuPy path is chosen.
"""
import functools
import importlib
import os

BACKENDS = ('reference', 'cupy')
ENV_VAR = 'LAPFORMER_OPS'


@functools.lru_cache(maxsize=1)
def cupy_available():
    """True when ``import cupy`` succeeds (cached)."""
    try:
        importlib.import_module('cupy')
    except Exception:  # a broken CUDA install raises more than ImportError
        return False
    return True


def _requested_backend(backend):
    """The explicit argument, else the environment variable, else None."""
    if backend is None:
        backend = os.environ.get(ENV_VAR) or None
        name = f'environment variable {ENV_VAR}'
    else:
        name = 'backend'
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f'{name}={backend!r} is not supported; allowed: '
                         f'{", ".join(repr(b) for b in BACKENDS)} or None')
    return backend


def resolve_backend(backend=None, tensor=None):
    """Return 'reference' or 'cupy' for ops on ``tensor`` (or None: no tensor).

    An explicit 'cupy' (argument or environment) with a non-CUDA tensor or
    without CuPy raises a ``RuntimeError`` rather than silently falling back.
    """
    requested = _requested_backend(backend)
    on_cuda = tensor is not None and tensor.is_cuda
    if requested is None:
        return 'cupy' if on_cuda and cupy_available() else 'reference'
    if requested == 'cupy':
        if tensor is not None and not on_cuda:
            raise RuntimeError(
                f"backend 'cupy' needs CUDA tensors, got a tensor on "
                f'{tensor.device}; use backend=\'reference\' or unset {ENV_VAR}')
        if not cupy_available():
            raise RuntimeError(
                "backend 'cupy' needs CuPy (pip install cupy-cuda12x) and a "
                f"CUDA device; use backend='reference' or unset {ENV_VAR}")
    return requested


def cupy_ops():
    """The lazily imported ``lapformer_mm.ops.cupy_ops`` module."""
    return importlib.import_module('lapformer_mm.ops.cupy_ops')

