"""A stand-in for CuPy that records what ``lapformer_mm.ops.backends.cuda`` asks of it.

No GPU needed: compiles, cache loads, device contexts, opt-ins and launches become events,
so the CPU tests check the host path and ``benchmarks/cuda_host.py`` times it; the stub GPU
of tests/ops/cuda/test_gpu_check.py runs tools/gpu_check.sh's Python on it. :func:`install`
patches the backend to use it. What it models, from CuPy's source (tags v13.6.0, v14.0.0,
v14.1.1, v14.2.0):

* A module is built once per process and device for its (source, options, name expressions,
  log stream) (``cupy/_core/raw.pyx``, ``_get_raw_module``'s memo). The build reads the
  kernel cache (``disk``), keyed by source and options (``cupy/cuda/compiler.py``,
  ``_compile_with_cache_cuda``), else compiles and writes it there. With name expressions,
  CuPy up to 14.0 always compiles (it needs NVRTC's lowered names) and writes the binary under
  the key without them; from 14.1 they are part of the key and the cache keeps the lowered
  names (:data:`NAMES_IN_KEY_FROM`). ``CUPY_CACHE_IN_MEMORY=1``: nothing read or written.
* ``log_stream`` is written after an NVRTC compile, never when the cache served the module.
* A compiled module holds the ``extern "C"`` kernels of the source as the ``-D`` options
  select them (``#ifdef``, ``#ifndef``, ``#if defined(...)``, ``#error``), and the
  instantiations of its name expressions; a template no expression names is not there.
* A launch reads ``stream.ptr`` alone; a launch on CuPy's own current stream (no stream) is
  refused, as is dynamic shared memory over the function's opt-in (48 KiB without one).
* ``cupy.cuda.ExternalStream`` warns (DeprecationWarning) from 14.0.
"""
import os
import re
import types
import warnings

import torch

#: The first CuPy version whose kernel cache keys a module by its name expressions too.
NAMES_IN_KEY_FROM = (14, 1)
#: cudaDevAttrMaxSharedMemoryPerBlockOptin.
OPTIN_ATTRIBUTE = 97
DEFAULT_SMEM = 48 * 1024
_ENTRY = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(')


def version_tuple(version):
    return tuple(int(part) for part in re.findall(r'\d+', version)[:2])


def lowered(name_expression):
    """A stand-in for NVRTC's lowered (mangled) name of a kernel's name expression."""
    return '_Z' + re.sub(r'\W+', '_', name_expression)


def active_lines(code, options):
    """The lines of ``code`` the preprocessor keeps under these ``-D`` options (the
    conditionals the .cu uses; __CUDA_ARCH__ is defined); raises on an active ``#error``."""
    defined = {'__CUDA_ARCH__'} | {o[2:].split('=')[0] for o in options if o.startswith('-D')}
    stack, kept = [], []
    for line in code.replace('\\\n', ' ').splitlines():
        directive = re.match(r'\s*#\s*(\w+)\s*(.*)', line)
        word, rest = directive.groups() if directive else ('', '')
        active = all(stack)
        if word in ('ifdef', 'ifndef'):
            stack.append((rest.split()[0] in defined) == (word == 'ifdef'))
        elif word == 'if':
            expr = re.sub(r'defined\s*\(\s*(\w+)\s*\)', lambda m: str(m.group(1) in defined), rest)
            stack.append(eval(expr.replace('!', ' not ').replace('||', ' or ')
                              .replace('&&', ' and ')))
        elif word == 'else':
            stack[-1] = not stack[-1]
        elif word == 'endif':
            stack.pop()
        elif word == 'error' and active:
            raise RuntimeError(f'error: #error {rest}')
        elif active:
            kept.append(line)
    return kept


class FakeCupy:
    """``events``: ('compile', name expressions, options, backend), ('load', options) (a
    module from the kernel cache), ('device', index), ('optin', kernel, bytes),
    ('launch', kernel, grid, block, args, shared_mem, stream handle).

    ``disk`` stands for CuPy's on-disk kernel cache ({key: {'symbols', 'mapping'}}); share
    one between two fakes to stand for two processes. ``version``: CuPy's, which decides the
    cache's key (:data:`NAMES_IN_KEY_FROM`) and whether ExternalStream warns. ``smem_optin``:
    the device's shared-memory opt-in limit (an H100's and H200's)."""

    def __init__(self, fail_compile=False, fail_launch=False, current_device=0, record=True,
                 disk=None, version='14.2.0', smem_optin=227 * 1024):
        self.events = []
        self.current_device = current_device
        self.disk = {} if disk is None else disk
        self.__version__ = version
        self.names_in_key = version_tuple(version) >= NAMES_IN_KEY_FROM
        self.fail_compile, self.smem_optin = fail_compile, smem_optin
        self.modules = {}  # _get_raw_module's memo
        fake = self

        def log(event):
            if record:
                fake.events.append(event)
        self.log = log

        class Device:
            def __init__(self, index=None):
                self.id = fake.current_device if index is None else index

            def __enter__(self):
                log(('device', self.id))
                self.previous, fake.current_device = fake.current_device, self.id
                return self

            def __exit__(self, *exc):
                fake.current_device = self.previous
                return False

            @property
            def attributes(self):
                return {'MaxSharedMemoryPerBlockOptin': fake.smem_optin}

        class ExternalStream:
            def __init__(self, ptr, device_id=-1):
                if version_tuple(version) >= (14, 0):
                    warnings.warn('ExternalStream is deprecated. Use Stream.from_external() '
                                  'instead', DeprecationWarning, stacklevel=2)
                self.ptr = ptr

        class Function:
            def __init__(self, name):
                self.name = name
                self.max_dynamic_shared_size_bytes = 0

            def __call__(self, grid, block, args, shared_mem=0, stream=None):
                if fail_launch:
                    raise RuntimeError('too many resources requested for launch')
                if stream is None:
                    raise AssertionError("a kernel was launched on CuPy's current stream")
                if shared_mem > max(self.max_dynamic_shared_size_bytes, DEFAULT_SMEM):
                    raise RuntimeError('CUDA_ERROR_INVALID_VALUE: invalid argument (dynamic '
                                       f'shared memory {shared_mem} over the function\'s '
                                       f'{self.max_dynamic_shared_size_bytes})')
                log(('launch', self.name, grid, block, args, shared_mem, stream.ptr))

        class RawKernel:
            def __init__(self, code, name, options=(), backend='nvrtc', **kwargs):
                self.code, self.name, self.options = code, name, tuple(options)
                self.backend, self.name_expressions = backend, None
                self._functions = {}

            def _kernel(self, log_stream=None):
                function = self._functions.get(fake.current_device)
                if function is None:
                    module = fake.module(self.code, self.options, self.name_expressions,
                                         log_stream, self.backend)
                    if self.name not in module['symbols']:
                        raise RuntimeError('CUDA_ERROR_NOT_FOUND: named symbol not found')
                    function = self._functions[fake.current_device] = Function(self.name)
                return function

            @property
            def kernel(self):
                return self._kernel()

            def compile(self, log_stream=None):
                self._functions = {}
                self._kernel(log_stream)

            @property
            def max_dynamic_shared_size_bytes(self):
                return self.kernel.max_dynamic_shared_size_bytes

            @max_dynamic_shared_size_bytes.setter
            def max_dynamic_shared_size_bytes(self, value):
                log(('optin', self.name, value))
                self.kernel.max_dynamic_shared_size_bytes = value

        class RawModule:
            def __init__(self, code, options=(), name_expressions=None, backend='nvrtc'):
                self.code, self.options, self.backend = code, tuple(options), backend
                self.name_expressions = (None if name_expressions is None
                                         else tuple(name_expressions))

            @property
            def module(self):
                return fake.module(self.code, self.options, self.name_expressions, None,
                                   self.backend)

            def compile(self, log_stream=None):
                fake.module(self.code, self.options, self.name_expressions, log_stream,
                            self.backend)

            def get_function(self, name):
                if self.name_expressions:
                    name = (self.module['mapping'] or {}).get(name, name)
                kernel = RawKernel(self.code, name, self.options, self.backend)
                kernel.name_expressions = self.name_expressions
                _ = kernel.kernel  # loaded here, as CuPy does
                return kernel

        runtime = types.SimpleNamespace(
            getDevice=lambda: fake.current_device, getDeviceCount=lambda: 2,
            deviceGetAttribute=fake.device_attribute,
            cudaDevAttrMaxSharedMemoryPerBlockOptin=OPTIN_ATTRIBUTE)
        nvrtc = types.SimpleNamespace(getVersion=lambda: (12, 9))
        self.cuda = types.SimpleNamespace(Device=Device, ExternalStream=ExternalStream,
                                          runtime=runtime, nvrtc=nvrtc)
        self.RawKernel, self.RawModule = RawKernel, RawModule

    def device_attribute(self, attribute, device):
        if attribute != OPTIN_ATTRIBUTE:
            raise RuntimeError('cudaErrorInvalidValue: invalid argument')
        return self.smem_optin

    def module(self, code, options, names, log_stream, backend='nvrtc'):
        """{'symbols', 'mapping'} of a module as CuPy builds it (once per process, device,
        source, options, name expressions and log stream)."""
        memo = (self.current_device, code, options, names, log_stream)
        if memo in self.modules:
            return self.modules[memo]
        assert '#include "' not in code
        in_memory = os.environ.get('CUPY_CACHE_IN_MEMORY', '0').strip() == '1'
        key = (code, options) + ((tuple(sorted(names)),) if names and self.names_in_key else ())
        if not in_memory and (not names or self.names_in_key) and key in self.disk:
            self.log(('load', options))
            module = self.disk[key]
        else:
            self.log(('compile', names or (), options, backend))
            if self.fail_compile:
                raise RuntimeError('error: identifier "oops" is undefined')
            symbols = _ENTRY.findall('\n'.join(active_lines(code, options)))
            mapping = {n: lowered(n) for n in names} if names else None
            module = {'symbols': symbols + [lowered(n) for n in names or ()],
                      'mapping': mapping}
            if log_stream is not None:
                log_stream.write('')
            if not in_memory:
                self.disk[key] = dict(module, mapping=mapping if self.names_in_key else None)
        self.modules[memo] = module
        return module


class FakeStreams:
    """PyTorch's current stream handle per device, settable (``set(handle)``)."""

    def __init__(self, handle=12345):
        self.handle = handle

    def __call__(self, device_index):
        return self.handle


def install(cl, setattr_, **kwargs):
    """Make ``cl`` (``backends.cuda``) use a new :class:`FakeCupy` (``kwargs``), as in a new
    process: nothing checked or loaded, never capturing. ``setattr_`` is
    ``monkeypatch.setattr`` (or ``setattr`` for a script). Returns (fake, streams)."""
    fake = FakeCupy(**kwargs)
    streams = FakeStreams()
    setattr_(cl, 'import_cupy', lambda: fake)
    for name in ('_groups', '_launchers', '_failed', 'loaded_from', '_READY'):
        setattr_(cl, name, {})
    setattr_(cl, 'raw_stream', streams)
    setattr_(cl, 'capturing', lambda device_index: False)
    return fake, streams


class FakeCudaTensor:
    """Has what ``backends.cuda.launch`` reads of a tensor: its device."""
    device = torch.device('cuda', 1)
