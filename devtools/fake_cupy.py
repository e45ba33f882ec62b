"""A stand-in for CuPy that records what ``lapformer_mm.ops.backends.cuda`` asks of it.

No GPU needed: compiles, device contexts, stream wrappers and launches become events, so
the CPU tests check the host path (one compile per variant and element type, the stream a
kernel is launched on, the shared-memory opt-in, nothing loaded inside a capture) and
``benchmarks/cuda_host.py`` times it. :func:`install` patches the backend to use it.
"""
import torch


class FakeCupy:
    """``events``: ('compile', names, options, backend), ('device', index), ('stream', handle),
    ('optin', name, bytes), ('launch', name, grid, block, args, shared_mem, stream handle)."""

    def __init__(self, fail_compile=False, fail_launch=False, current_device=0, record=True):
        self.events = []
        self.current_device = current_device
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
            def __init__(self, code, options, name_expressions, backend):
                log(('compile', tuple(name_expressions), options, backend))
                assert '#include "' not in code
                if fail_compile:
                    raise RuntimeError('error: identifier "oops" is undefined')

            def get_function(self, name):
                return Kernel(name)

        runtime = type('runtime', (), {'getDevice': staticmethod(lambda: fake.current_device),
                                       'getDeviceCount': staticmethod(lambda: 2)})
        nvrtc = type('nvrtc', (), {'getVersion': staticmethod(lambda: (12, 9))})
        self.cuda = type('cuda', (), {'Device': Device, 'ExternalStream': ExternalStream,
                                      'runtime': runtime, 'nvrtc': nvrtc})
        self.RawModule = RawModule


class FakeStreams:
    """PyTorch's current stream handle per device, settable (``set(handle)``)."""

    def __init__(self, handle=12345):
        self.handle = handle

    def __call__(self, device_index):
        return self.handle


def install(cl, setattr_, **kwargs):
    """Make ``cl`` (``backends.cuda``) use a new :class:`FakeCupy`, never capturing;
    ``setattr_`` is ``monkeypatch.setattr`` (or ``setattr`` for a script). Returns
    (fake, streams)."""
    fake = FakeCupy(**kwargs)
    streams = FakeStreams()
    setattr_(cl, 'import_cupy', lambda: fake)
    setattr_(cl, '_groups', {})
    setattr_(cl, '_failed', {})
    setattr_(cl, '_streams', {})
    setattr_(cl, 'raw_stream', streams)
    setattr_(cl, 'capturing', lambda device_index: False)
    return fake, streams


class FakeCudaTensor:
    """Has what ``backends.cuda.launch`` reads of a tensor: its device."""
    device = torch.device('cuda', 1)
