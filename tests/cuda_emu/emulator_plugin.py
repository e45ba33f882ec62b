"""pytest plugin: run tests/test_cuda_ops.py on the CPU emulation of the kernels.

    LAPFORMER_GPU_TEST_DEVICE=cpu PYTHONPATH=.:tests/cuda_emu \\
        python -m pytest -p emulator_plugin tests/test_cuda_ops.py

Builds the g++ emulation (devtools/cuda_emulation.py), sends ``cuda_runtime.launch`` to it and
makes the public functions choose the CuPy kernels for CPU tensors, so they run the
kernels' logic end to end. For development only: a few minutes on two cores, so not
part of CI.
"""
import sys
import tempfile
from pathlib import Path

_SMEM_LIMIT = 227 * 1024  # an H100/H200's opt-in limit, so m = 128 takes the fused path
_TARGET_BLOCKS = 64


def pytest_configure(config):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from devtools.cuda_emulation import (
        build_library,
        make_launch,
        route_cpu_tensors_to_cuda_backend,
    )
    from lapformer_mm.ops import cuda_runtime as rt
    from lapformer_mm.ops import cupy_ops

    lib, error = build_library(tempfile.mkdtemp(prefix='lapformer_emu_'))
    if lib is None:
        raise RuntimeError(f'g++ failed to build the emulation:\n{error}')
    rt.launch = make_launch(lib)
    rt.shared_memory_optin = lambda device_index: _SMEM_LIMIT
    cupy_ops.target_blocks = lambda device: _TARGET_BLOCKS
    route_cpu_tensors_to_cuda_backend(setattr)
