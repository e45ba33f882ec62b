"""The emulation as a module-scoped pytest fixture (import it into a test module)."""
import shutil

import pytest

from devtools.cuda_emulation import Emulation


@pytest.fixture(scope='module')
def emu_lib(tmp_path_factory):
    """The CUDA kernels compiled for the CPU by g++ (devtools/cuda_emulation.py)."""
    if shutil.which('g++') is None:
        pytest.skip('g++ (C++20) is needed to build the CPU emulation of the CUDA kernels')
    return Emulation(tmp_path_factory.mktemp('cuda_emu'))
