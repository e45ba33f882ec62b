"""Which implementation runs the registered ops: one flag, ``impl``, decided in one place.

``impl`` is one of :data:`IMPLS`:

* ``'reference'``: the plain-PyTorch math next to each op, on every device (the ground
  truth of the tests);
* ``'cupy'``: the CUDA kernels of ``lapformer_mm/csrc/cuda``, compiled by NVRTC through
  CuPy (:mod:`lapformer_mm.ops.backends.cuda`), for CUDA tensors;
* ``'cpu'``: the C++ CPU extension (:mod:`lapformer_mm.ops.cpu_ext`, when it is
  installed and reports ``available()``), for CPU tensors.

A requested ``impl=None`` means: the environment variable ``LAPFORMER_OPS`` when set
(read once, where the options are built: :func:`requested_impl`), else the fast
implementation of the tensor's device when it is usable, else ``'reference'``
(:func:`resolve_impl`). CuPy and the CPU extension are imported only when chosen.
"""
import functools
import importlib
import os

import torch

IMPLS = ('reference', 'cupy', 'cpu')
ENV_VAR = 'LAPFORMER_OPS'

#: The device type each fast implementation runs on.
IMPL_DEVICE = {'cupy': 'cuda', 'cpu': 'cpu'}


@functools.lru_cache(maxsize=1)
def cupy_available():
    """True when ``import cupy`` succeeds (cached)."""
    try:
        importlib.import_module('cupy')
    except Exception:  # a broken CUDA install raises more than ImportError
        return False
    return True


@functools.lru_cache(maxsize=1)
def cpu_ext_available():
    """True when :mod:`lapformer_mm.ops.cpu_ext` imports and reports ``available()`` (cached)."""
    try:
        module = importlib.import_module('lapformer_mm.ops.cpu_ext')
    except ImportError:
        return False
    return bool(module.available())


_AVAILABLE = {'cupy': cupy_available, 'cpu': cpu_ext_available}
_INSTALL_HINT = {'cupy': 'pip install cupy-cuda12x or cupy-cuda13x (matching the driver)',
                 'cpu': 'build the C++ CPU extension (lapformer_mm.ops.cpu_ext)'}


def requested_impl(impl=None):
    """The validated ``impl`` argument, else the environment variable, else None."""
    if impl is None:
        impl = os.environ.get(ENV_VAR) or None
        name = f'environment variable {ENV_VAR}'
    else:
        name = 'impl'
    if impl is not None and impl not in IMPLS:
        raise ValueError(f'{name}={impl!r} is not supported; allowed: '
                         f'{", ".join(repr(i) for i in IMPLS)} or None')
    return impl


# (requested, device type) -> impl, or the RuntimeError to raise for it. A plain dict,
# filled by prepare() or on the first call of each pair, so a compiled graph reads it like
# a constant.
_DECIDED = {}


def resolve_impl(requested, device):
    """The implementation ops on ``device`` run, for a :func:`requested_impl` value.

    None picks the device's fast implementation when it is usable, else 'reference'.
    An explicit 'cupy' or 'cpu' for the wrong device, or one that is not usable, raises a
    ``RuntimeError`` rather than silently falling back.
    """
    key = (requested, device.type if hasattr(device, 'type') else str(device))
    impl = _DECIDED.get(key)
    if impl is None:
        impl = _DECIDED[key] = _decision(*key)
    if isinstance(impl, Exception):
        raise impl
    return impl


def prepare(requested):
    """Decide for the devices this process has, ahead of the first call.

    Called where options are built (module construction, in eager mode): the availability
    checks import modules, which torch.compile would not put in a graph, so a compiled
    forward then only reads the decided value.
    """
    device_types = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])
    for device_type in device_types:
        key = (requested, device_type)
        if key not in _DECIDED:
            _DECIDED[key] = _decision(requested, device_type)


def _decision(requested, device_type):
    """The implementation, or the error to raise when it is asked for."""
    try:
        return _decide(requested, device_type)
    except RuntimeError as exc:
        return exc


def _decide(requested, device_type):
    if requested is None:
        for impl, impl_device in IMPL_DEVICE.items():
            if impl_device == device_type and _AVAILABLE[impl]():
                return impl
        return 'reference'
    if requested == 'reference':
        return requested
    if IMPL_DEVICE[requested] != device_type:
        raise RuntimeError(f'impl={requested!r} runs on {IMPL_DEVICE[requested]} tensors, got '
                           f"tensors on {device_type}; use impl='reference' or None, or unset "
                           f'{ENV_VAR}')
    if not _AVAILABLE[requested]():
        raise RuntimeError(f'impl={requested!r} is not usable here ({_INSTALL_HINT[requested]}); '
                           f"use impl='reference' or None, or unset {ENV_VAR}")
    return requested


def clear_cache():
    """Forget the decisions and availability checks (tests that fake an environment)."""
    _DECIDED.clear()
    cupy_available.cache_clear()
    cpu_ext_available.cache_clear()


# TEMPORARY (issue #33, until #31's op module lands): the CUDA backend behind the old
# module interface.
_MODULES = {'cupy': 'lapformer_mm.ops._cuda_adapter', 'cpu': 'lapformer_mm.ops.cpu_ext'}
_IMPORTED = {}


def implementation(impl):
    """The module implementing the ops for ``impl`` ('cupy' or 'cpu'), imported lazily."""
    module = _IMPORTED.get(impl)
    if module is None:
        module = _IMPORTED[impl] = importlib.import_module(_MODULES[impl])
    return module
