"""Every CUDA source compiles with NVRTC for sm_70, sm_80 and sm_90, without a GPU.

NVRTC is the compiler CuPy uses at run time; here it is loaded from the
``nvidia-cuda-nvrtc-cu12`` wheel through ctypes (no CUDA driver, toolkit or
GPU needed). Each source is compiled to SASS (``--gpu-architecture=sm_XX``, so
ptxas runs too and resource overflows fail) with every template instantiation
the Python side can launch (``cuda_runtime.all_name_expressions``), using the
exact source text (headers inlined) and options of the run time. A failure
prints the compiler log.
"""
import re

import pytest

from devtools.nvrtc import CUPY_ADDED_OPTIONS, Nvrtc, find_nvrtc
from lapformer_mm.ops import cuda_runtime as rt

ARCHS = ('sm_70', 'sm_80', 'sm_90')
NVRTC_PACKAGE = 'nvidia-cuda-nvrtc-cu12'


@pytest.fixture(scope='module')
def nvrtc():
    path = find_nvrtc()
    if not path:
        pytest.fail(f'libnvrtc not found: pip install {NVRTC_PACKAGE} (or set LAPFORMER_NVRTC_LIB)')
    return Nvrtc(path)


def registers_by_function(log):
    """{mangled entry name: registers} from ptxas -v output."""
    regs, current = {}, None
    for line in log.splitlines():
        entry = re.search(r"Compiling entry function '([^']+)'", line)
        if entry:
            current = entry.group(1)
        used = re.search(r'Used (\d+) registers', line)
        if used and current:
            regs[current] = int(used.group(1))
    return regs


# The fused attention's source takes 30-40 s per architecture on 2 cores.
SLOW_SOURCES = ('nystrom_attention.cu',)


@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('source', [
    pytest.param(source, marks=pytest.mark.slow) if source in SLOW_SOURCES else source
    for source in rt.SOURCES])
def test_source_compiles(nvrtc, source, arch):
    if arch not in nvrtc.supported_archs():
        pytest.skip(f'NVRTC {nvrtc.version()} cannot target {arch}; pin {NVRTC_PACKAGE}')
    names = rt.all_name_expressions()[source]
    options = ((f'--gpu-architecture={arch}', '--ptxas-options=-v') + rt.NVRTC_OPTIONS
               + CUPY_ADDED_OPTIONS)
    status, log, lowered, cubin = nvrtc.compile(rt.load_source(source), source, options, names)
    assert status == 0, f'NVRTC {nvrtc.version()} failed on {source} for {arch}:\n{log}'
    assert set(lowered) == set(names) and all(lowered.values())
    assert cubin
    regs = registers_by_function(log)
    assert set(regs) == set(lowered.values()), log
    if source == rt.NEWTON_SCHULZ_SOURCE:
        # A block of 1024 threads (m = 128) must fit the 64K-register file.
        assert max(regs.values()) <= 64, log
        # The runtime's shared-memory budget reserves this much static memory.
        static = [int(v) for v in re.findall(r'(\d+) bytes smem', log)]
        assert static and max(static) <= rt.NS_STATIC_SMEM, log


def test_sources_are_found_and_inlined():
    for source in rt.SOURCES:
        text = rt.load_source(source)
        assert '#include "' not in text
        assert 'struct lap_half' in text


def test_every_launched_instantiation_is_compiled():
    """The names the runtime builds are exactly the ones compiled above."""
    names = rt.all_name_expressions()
    for dtype_name in rt.ELEMENT_TYPES.values():
        for kind in rt.KINDS.values():
            assert rt.pairwise_forward_name(dtype_name, kind) in names[rt.PAIRWISE_SOURCE]
            for transposed in (False, True):
                assert (rt.pairwise_backward_name(dtype_name, kind, transposed)
                        in names[rt.PAIRWISE_SOURCE])
    for p_in_shared in (True, False):
        assert rt.newton_schulz_name('float', p_in_shared) in names[rt.NEWTON_SCHULZ_SOURCE]


def test_compile_groups_partition_the_instantiations():
    """The runtime compiles one module per (source, element type) holding these names."""
    for source, names in rt.all_name_expressions().items():
        groups = {tuple(rt.compile_group(source, name)) for name in names}
        flat = [n for g in groups for n in g]
        assert sorted(flat) == sorted(names)
    assert len({tuple(rt.compile_group(rt.PAIRWISE_SOURCE, n))
                for n in rt.all_name_expressions()[rt.PAIRWISE_SOURCE]}) == len(rt.ELEMENT_TYPES)
