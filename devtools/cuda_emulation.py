"""The g++ emulation of the CUDA kernels (tests/cuda_emu): build it, and launch through it.

Used by the emulation tests and by scripts that run the CUDA path on the CPU
(benchmarks/numerics_stages.py); :func:`emulate` switches a process over.

``ops/cuda/nystrom_attention.cu`` compiles unchanged under
``tests/cuda_emu/shim.h`` (threads of a block are fibers on one OS thread switched at
each ``__syncthreads``, ``__shared__`` static storage, blocks one at a time), one library per tile
variant with the same ``-D`` options NVRTC gets; :func:`make_launch` gives a stand-in for
``backends.cuda.launch`` that hands the kernels the same ``nys_params`` bytes, so the host
code of the CUDA backend (plans, geometry, the parameter struct) runs against CPU tensors.
"""
import ctypes
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EMU_DIR = ROOT / 'tests' / 'cuda_emu'
CUDA_DIR = ROOT / 'ops' / 'cuda'
#: The variant built with every element type; the others are built for fp32 only.
FULL_VARIANT = 'dv32_tb32'


def build_command(out, defines, *extra):
    """The g++ command that builds the emulation library (or, with ``extra``, a program)."""
    return ['g++', '-std=c++20', '-O2', '-pthread', '-I', str(CUDA_DIR), '-I', str(EMU_DIR),
            *defines, *extra, '-o', str(out)]


def build_library(folder, variant, float_only=None):
    """The kernels of ``variant`` compiled for the CPU as a shared library in ``folder``;
    (lib, stderr)."""
    if float_only is None:
        float_only = variant.name != FULL_VARIANT
    out = Path(folder) / f'emu_{variant.name}{"_f32" if float_only else ""}.so'
    defines = variant.defines + (('-DEMU_FLOAT_ONLY',) if float_only else ())
    # Hidden symbols: each variant's kernels keep their own static shared arrays.
    proc = subprocess.run(build_command(out, defines, '-shared', '-fPIC', '-fvisibility=hidden',
                                        str(EMU_DIR / 'driver.cpp')),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None, proc.stderr
    lib = ctypes.CDLL(str(out))
    lib.emu_has_kernel.argtypes = [ctypes.c_char_p]
    lib.emu_params_layout.restype = ctypes.c_char_p
    lib.emu_launch_kernel.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_ulonglong]
    return lib, ''


class EmulationError(RuntimeError):
    """The emulation has no such kernel, or a kernel overran its dynamic shared memory."""


class Emulation:
    """Emulation libraries built on demand, one per variant, in ``folder``."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.libs = {}

    def library(self, variant):
        lib = self.libs.get(variant.name)
        if lib is None:
            lib, error = build_library(self.folder, variant)
            if lib is None:
                raise RuntimeError(f'g++ failed to build the emulation of {variant.name}:\n{error}')
            self.libs[variant.name] = lib
        return lib


def params_layout(lib):
    """{field: offset} of ``nys_params`` as g++ laid it out, plus 'sizeof'."""
    pairs = (line.split() for line in lib.emu_params_layout().decode().splitlines())
    return {name: int(value) for name, value in pairs}


def make_launch(emulation, record=None, hooks=()):
    """A ``backends.cuda.launch`` that runs kernels in the emulation.

    Appends (name, grid, block, shared_mem, variant name) to ``record``; calls each hook
    with the same tuple (the op-counting test uses it).
    """
    def launch(name, variant, tensor, grid, block, params, shared_mem=0, shapes='',
               smem_limit=0):
        lib = emulation.library(variant)
        argv = (ctypes.c_void_p * 1)(params.ctypes.data)
        grid3 = (ctypes.c_uint * 3)(*(tuple(grid) + (1, 1))[:3])
        block3 = (ctypes.c_uint * 3)(*(tuple(block) + (1, 1))[:3])
        if smem_limit and shared_mem > smem_limit:
            raise EmulationError(f'{name} asks {shared_mem} bytes of shared memory, over the '
                                 f'device limit {smem_limit}')
        rc = lib.emu_launch_kernel(name.encode(), argv, grid3, block3, shared_mem)
        if rc == 1:
            raise EmulationError(f'emulation of {variant.name} has no kernel {name}')
        if rc == 2:
            raise EmulationError(f'{name} ({variant.name}) wrote past its {shared_mem} bytes of '
                                 'dynamic shared memory')
        entry = (name, tuple(grid), tuple(block), shared_mem, variant.name)
        if record is not None:
            record.append(entry)
        for hook in hooks:
            hook(entry)
    return launch


def emulated_limits(smem_optin=227 * 1024, sms=2, capability=(9, 0)):
    """The device limits the CUDA backend reads, for a device that is not there."""
    from lapformer_mm.ops.backends.cuda_plan import DeviceLimits
    return DeviceLimits(capability, sms, smem_optin, 12)


def route_cpu_tensors_to_cuda_backend(setattr_, limits=None):
    """Make the CUDA backend take CPU tensors (impl=None and impl='cupy' alike) on an
    emulated device (:func:`emulated_limits`), through ``setattr_``
    (``monkeypatch.setattr`` in tests, ``setattr`` in scripts). Its kernels are taken as
    loaded when a call is checked: the emulation builds its own, and with a fake CuPy
    (devtools/fake_cupy.py) the first launch compiles."""
    from lapformer_mm.ops.backends import cuda
    limits = emulated_limits() if limits is None else limits
    setattr_(cuda, 'DEVICE', 'cpu')
    setattr_(cuda, 'available', lambda: True)
    setattr_(cuda, 'device_limits', lambda device: limits)
    setattr_(cuda, 'ensure_loaded', lambda *args: None)


def emulate(folder, target_blocks=8):
    """Route the CUDA backend's launches to the emulation built in ``folder`` and make
    impl=None choose it for CPU tensors, for the rest of the process (scripts only)."""
    from lapformer_mm.ops.backends import cuda
    emulation = Emulation(folder)
    cuda.launch = make_launch(emulation)
    route_cpu_tensors_to_cuda_backend(setattr, emulated_limits(sms=max(1, target_blocks // 4)))
    return emulation
