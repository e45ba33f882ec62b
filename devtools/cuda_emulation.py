"""The g++ emulation of the CUDA kernels (tests/cuda_emu): build it, and launch through it.

Used by the emulation tests and by scripts that run the CUDA path on the CPU
(benchmarks/numerics_stages.py); :func:`emulate` switches a process over.

``ops/*.cu`` compile unchanged under ``tests/cuda_emu/shim.h`` (threads of a block are
std::threads, ``__syncthreads`` a std::barrier, ``__shared__`` static storage, blocks one
at a time); :func:`make_launch` gives a stand-in for ``cuda_runtime.launch`` so that the
host code of ``cupy_ops`` (launch geometry, argument packing, partial sums) runs against
CPU tensors.
"""
import ctypes
import subprocess
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EMU_DIR = ROOT / 'tests' / 'cuda_emu'

_CTYPES = {
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.float32): ctypes.c_float,
    np.dtype(np.float64): ctypes.c_double,
}


def build_command(out, *extra):
    """The g++ command that builds the emulation library (or, with ``extra``, a program)."""
    return ['g++', '-std=c++20', '-O2', '-pthread', '-I', str(ROOT / 'ops'), '-I', str(EMU_DIR),
            *extra, '-o', str(out)]


def build_library(folder):
    """The kernels compiled for the CPU as a shared library in ``folder``; (lib, stderr)."""
    out = Path(folder) / 'emu.so'
    proc = subprocess.run(build_command(out, '-shared', '-fPIC', str(EMU_DIR / 'driver.cpp')),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None, proc.stderr
    lib = ctypes.CDLL(str(out))
    lib.emu_has_kernel.argtypes = [ctypes.c_char_p]
    lib.emu_launch_kernel.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_ulonglong]
    return lib, ''


class EmulationError(RuntimeError):
    """The emulation has no such kernel, or a kernel overran its dynamic shared memory."""


def make_launch(lib, record=None, hooks=()):
    """A ``cuda_runtime.launch`` that runs kernels in the emulation.

    Appends (name, grid, block, shared_mem) to ``record``; calls each hook with the same
    tuple (the op-counting test uses it).
    """
    def launch(source, name_expression, tensor, grid, block, args, shared_mem=0, shapes=''):
        values = [_CTYPES[np.asarray(a).dtype](np.asarray(a).item()) for a in args]
        argv = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        grid3 = (ctypes.c_uint * 3)(*(tuple(grid) + (1, 1))[:3])
        block3 = (ctypes.c_uint * 3)(*(tuple(block) + (1, 1))[:3])
        rc = lib.emu_launch_kernel(name_expression.encode(), argv, grid3, block3, shared_mem)
        if rc == 1:
            raise EmulationError(f'emulation has no kernel {name_expression}')
        if rc == 2:
            raise EmulationError(f'{name_expression} wrote past its {shared_mem} bytes of '
                                 'dynamic shared memory')
        entry = (name_expression, tuple(grid), tuple(block), shared_mem)
        if record is not None:
            record.append(entry)
        for hook in hooks:
            hook(entry)
    return launch


def route_cpu_tensors_to_cuda_backend(setattr_):
    """Make the CUDA backend take CPU tensors (impl=None and impl='cupy' alike), through
    ``setattr_`` (``monkeypatch.setattr`` in tests, ``setattr`` in scripts)."""
    from lapformer_mm.ops.backends import cuda
    setattr_(cuda, 'DEVICE', 'cpu')
    setattr_(cuda, '_AVAILABLE', [True])


def emulate(folder, target_blocks=8):
    """Route ``cuda_runtime.launch`` to the emulation built in ``folder`` and make impl=None
    choose the CUDA backend for CPU tensors, for the rest of the process (scripts only)."""
    from lapformer_mm.ops import cuda_runtime as rt
    from lapformer_mm.ops import cupy_ops
    lib, error = build_library(folder)
    if lib is None:
        raise RuntimeError(f'g++ failed to build the emulation:\n{error}')
    rt.launch = make_launch(lib)
    cupy_ops.target_blocks = lambda device: target_blocks
    route_cpu_tensors_to_cuda_backend(setattr)
    return lib
