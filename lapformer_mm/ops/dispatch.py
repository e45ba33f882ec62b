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


def requested_backend(backend=None):
    """The validated ``backend`` argument, else the environment variable, else None.

    Read once where options are built (:class:`~lapformer_mm.ops.AttentionOptions`),
    not per kernel call.
    """
    if backend is None:
        backend = os.environ.get(ENV_VAR) or None
        name = f'environment variable {ENV_VAR}'
    else:
        name = 'backend'
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f'{name}={backend!r} is not supported; allowed: '
                         f'{", ".join(repr(b) for b in BACKENDS)} or None')
    return backend


def backend_uses_cupy(requested, tensor):
    """Whether ops on ``tensor`` run the CuPy kernels, given a :func:`requested_backend`.

    None picks CuPy for CUDA tensors when it imports. An explicit 'cupy' with a
    non-CUDA tensor or without CuPy raises a ``RuntimeError`` rather than
    silently falling back.
    """
    on_cuda = tensor is not None and tensor.is_cuda
    if requested is None:
        return on_cuda and cupy_available()
    if requested == 'cupy':
        if tensor is not None and not on_cuda:
            raise RuntimeError(
                f"backend 'cupy' needs CUDA tensors, got a tensor on "
                f'{tensor.device}; use backend=\'reference\' or unset {ENV_VAR}')
        if not cupy_available():
            raise RuntimeError(
                "backend 'cupy' needs CuPy (pip install cupy-cuda12x) and a "
                f"CUDA device; use backend='reference' or unset {ENV_VAR}")
        return True
    return False


def uses_cupy(backend, tensor):
    """:func:`backend_uses_cupy` for a ``backend`` argument not yet validated (one call)."""
    return backend_uses_cupy(requested_backend(backend), tensor)


def resolve_backend(backend=None, tensor=None):
    """'reference' or 'cupy': the backend ops on ``tensor`` use (None: no tensor)."""
    return 'cupy' if uses_cupy(backend, tensor) else 'reference'


def cupy_ops():
    """The lazily imported ``lapformer_mm.ops.cupy_ops`` module."""
    return importlib.import_module('lapformer_mm.ops.cupy_ops')
