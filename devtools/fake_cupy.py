"""A stand-in for CuPy that records what ``lapformer_mm.ops.backends.cuda`` asks of it.

No GPU needed: compiles, device contexts, stream wrappers and launches become events, so
the CPU tests check the host path (one compile per variant and element type, the stream a
kernel is launched on, the shared-memory opt-in, nothing loaded inside a capture) and
``benchmarks/cuda_host.py`` times it. :func:`install` patches the backend to use it.
"""
import re
import types

import torch


class FakeCupy:
    """``events``: ('compile', names, options, backend), ('load', options) (a binary from the
    kernel cache), ('device', index), ('stream', handle), ('optin', name, bytes),
    ('launch', name, grid, block, args, shared_mem, stream handle).

    ``disk`` stands for CuPy's on-disk kernel cache ({(code, options): {lowered name: name
    expression}}); share one between two fakes to stand for two processes. As CuPy does, a
    module compiles at its first use, always where it has name expressions (NVRTC's lowered
    names are needed) and writes its binary to the cache; without them it loads the binary
    the cache holds for its source and options, or compiles the source alone (which
    instantiates no template kernel)."""

    def __init__(self, fail_compile=False, fail_launch=False, current_device=0, record=True,
                 disk=None):
        self.events = []
        self.current_device = current_device
        self.disk = {} if disk is None else disk
        fake = self

        def log(event):
            if record:
                fake.events.append(event)

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                log(('device', self.index))
                self.previous, fake.current_device = fake.current_device, self.index

            def __exit__(self, *exc):
                fake.current_device = self.previous
                return False

        class ExternalStream:
            def __init__(self, ptr, device_id=-1):
                log(('stream', ptr))
                self.ptr = ptr

        class Kernel:
            def __init__(self, name):
                self.name = name
                self.max_dynamic_shared_size_bytes = 0

            def __setattr__(self, key, value):
                if key == 'max_dynamic_shared_size_bytes' and value:
                    log(('optin', self.name, value))
                object.__setattr__(self, key, value)

            def __call__(self, grid, block, args, shared_mem=0, stream=None):
                if fail_launch:
                    raise RuntimeError('too many resources requested for launch')
                if stream is None:
                    raise AssertionError('a kernel was launched on CuPy\'s current stream')
                log(('launch', self.name, grid, block, args, shared_mem, stream.ptr))

        class RawModule:
            def __init__(self, code, options=(), name_expressions=None, backend='nvrtc'):
                assert '#include "' not in code
                self.code, self.options, self.backend = code, tuple(options), backend
                self.name_expressions = (None if name_expressions is None
                                         else tuple(name_expressions))
                self._module = None

            @property
            def module(self):
                if self._module is None:
                    key = (self.code, self.options)
                    if self.name_expressions is None and key in fake.disk:
                        log(('load', self.options))
                    else:
                        log(('compile', self.name_expressions or (), self.options,
                             self.backend))
                        if fail_compile:
                            raise RuntimeError('error: identifier "oops" is undefined')
                        fake.disk[key] = {lowered(n): n for n in self.name_expressions or ()}
                    mapping = (None if self.name_expressions is None else
                               {n: lowered(n) for n in self.name_expressions})
                    self._module = types.SimpleNamespace(mapping=mapping, symbols=fake.disk[key])
                return self._module

            def get_function(self, name):
                module = self.module
                if self.name_expressions:
                    name = module.mapping.get(name, name)
                if name not in module.symbols:
                    raise RuntimeError('CUDA_ERROR_NOT_FOUND: named symbol not found')
                return Kernel(module.symbols[name])

        runtime = type('runtime', (), {'getDevice': staticmethod(lambda: fake.current_device),
                                       'getDeviceCount': staticmethod(lambda: 2)})
        nvrtc = type('nvrtc', (), {'getVersion': staticmethod(lambda: (12, 9))})
        self.cuda = type('cuda', (), {'Device': Device, 'ExternalStream': ExternalStream,
                                      'runtime': runtime, 'nvrtc': nvrtc})
        self.RawModule = RawModule


def lowered(name_expression):
    """A stand-in for NVRTC's lowered (mangled) name of a kernel's name expression."""
    return '_Z' + re.sub(r'\W+', '_', name_expression)


class FakeStreams:
    """PyTorch's current stream handle per device, settable (``set(handle)``)."""

    def __init__(self, handle=12345):
        self.handle = handle

    def __call__(self, device_index):
        return self.handle


def install(cl, setattr_, cache_dir=None, **kwargs):
    """Make ``cl`` (``backends.cuda``) use a new :class:`FakeCupy` (``kwargs``), as in a new
    process: nothing loaded, never capturing; the kernels' lowered names kept in
    ``cache_dir`` (None: not kept). ``setattr_`` is ``monkeypatch.setattr`` (or ``setattr``
    for a script). Returns (fake, streams)."""
    fake = FakeCupy(**kwargs)
    streams = FakeStreams()
    setattr_(cl, 'import_cupy', lambda: fake)
    setattr_(cl, 'kernel_cache_dir', lambda: cache_dir)
    setattr_(cl, '_groups', {})
    setattr_(cl, '_failed', {})
    setattr_(cl, 'loaded_from', {})
    setattr_(cl, '_streams', {})
    setattr_(cl, 'raw_stream', streams)
    setattr_(cl, 'capturing', lambda device_index: False)
    return fake, streams


class FakeCudaTensor:
    """Has what ``backends.cuda.launch`` reads of a tensor: its device."""
    device = torch.device('cuda', 1)
