"""pytest plugin: run tests/test_cuda_ops.py on the CPU emulation of the kernels.

    LAPFORMER_GPU_TEST_DEVICE=cpu PYTHONPATH=.:tests/cuda_emu \\
        python -m pytest -p emulator_plugin tests/test_cuda_ops.py

Builds the g++ emulation (as tests/test_cuda_emulation.py does), sends
``cuda_runtime.launch`` to it and makes the public functions choose the CuPy
kernels for CPU tensors, so they run the kernels' logic end to end. For
development only: a few minutes on two cores, so not part of CI.
"""
import ctypes
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
_CTYPES = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float64): ctypes.c_double}
_SMEM_LIMIT = 227 * 1024  # an H100/H200's opt-in limit, so m = 128 takes the fused path
_TARGET_BLOCKS = 64


def build_library(folder):
    out = Path(folder) / 'emu.so'
    subprocess.run(['g++', '-std=c++20', '-O2', '-pthread', '-shared', '-fPIC', '-I', str(ROOT / 'ops'),
                    str(ROOT / 'tests' / 'cuda_emu' / 'driver.cpp'), '-o', str(out)], check=True)
    return ctypes.CDLL(str(out))


def pytest_configure(config):
    from lapformer_mm.ops import cuda_runtime as rt
    from lapformer_mm.ops import cupy_ops, dispatch

    folder = tempfile.mkdtemp(prefix='lapformer_emu_')
    lib = build_library(folder)

    def launch(source, name_expression, tensor, grid, block, args, shared_mem=0, shapes=''):
        values = [_CTYPES[np.asarray(a).dtype](a.item()) for a in args]
        argv = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        grid3 = (ctypes.c_uint * 3)(*(tuple(grid) + (1, 1))[:3])
        block3 = (ctypes.c_uint * 3)(*(tuple(block) + (1, 1))[:3])
        if lib.emu_launch_kernel(name_expression.encode(), argv, grid3, block3,
                                 ctypes.c_ulonglong(shared_mem)) != 0:
            raise rt.CudaOpsError(f'emulation has no kernel {name_expression}')

    rt.launch = launch
    rt.shared_memory_optin = lambda device_index: _SMEM_LIMIT
    cupy_ops.target_blocks = lambda device: _TARGET_BLOCKS
    dispatch._DECIDED[(None, 'cpu')] = 'cupy'
    dispatch._DECIDED[('cupy', 'cpu')] = 'cupy'
