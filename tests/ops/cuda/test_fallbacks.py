"""Where the CUDA backend cannot run a call, and what the op does then (docs/cuda.md): with
impl=None it warns once with the real reason and runs the reference, with impl='cupy' it
raises that reason. No GPU: CuPy is made absent, broken or faked (devtools/fake_cupy.py), and
the backend takes CPU tensors as the emulation's routing makes it
(devtools/cuda_emulation.py).
"""
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

import pytest
import torch

from devtools import fake_cupy
from devtools.cuda_emulation import emulated_limits, route_cpu_tensors_to_cuda_backend
from lapformer_mm.ops import attention, nystrom_attention, pool_landmarks
from lapformer_mm.ops.backends import cuda
from lapformer_mm.ops.reference import OpOptions


def attention_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 48, 32, generator=gen, dtype=dtype) for _ in range(3))
    return q, k, v, pool_landmarks(k, (6, 8), 7)


@pytest.fixture
def fresh(monkeypatch):
    """The backend's once-per-process checks undone; CPU tensors taken as CUDA ones (the
    CPU backend left out, as it would be for them)."""
    monkeypatch.setattr(cuda, '_AVAILABILITY', [])
    monkeypatch.setattr(cuda, '_WARNED', [])
    monkeypatch.setattr(cuda, 'DEVICE', 'cpu')
    monkeypatch.delitem(attention.BACKENDS, 'cpu')
    monkeypatch.delitem(sys.modules, 'cupy', raising=False)


class CupyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import cupy`` as on a machine where it is absent (error None) or installed and
    raising ``error`` when imported."""

    def __init__(self, error=None):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name != 'cupy':
            return None
        if self.error is None:
            raise ModuleNotFoundError("No module named 'cupy'", name='cupy')
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


def cupy_as(monkeypatch, finder):
    monkeypatch.setattr(sys, 'meta_path', [finder] + sys.meta_path)


BROKEN = ImportError('CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12: cannot open '
                     'shared object file: No such file or directory')


def test_a_cupy_that_does_not_import_warns_once_with_its_error_and_runs_the_reference(
        fresh, monkeypatch):
    cupy_as(monkeypatch, CupyFinder(BROKEN))
    warns_once_and_runs_the_reference(
        r'CUDA kernels are not available \(CuPy is installed but does not import: '
        r'ImportError: CuPy failed to load libnvrtc\.so\.12', *attention_inputs())


def warns_once_and_runs_the_reference(match, q, k, v, landmarks):
    """The op's output on its first call (which warns, matching ``match``) and its second
    (which does not), each the reference's; returns (first output, the reference's)."""
    with pytest.warns(RuntimeWarning, match=match):
        out = nystrom_attention(q, k, v, landmarks)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        again = nystrom_attention(q, k, v, landmarks)
    expected = nystrom_attention(q, k, v, landmarks, impl='reference')
    assert torch.equal(out, expected) and torch.equal(again, expected)
    return out, expected


def test_impl_cupy_raises_the_import_error_and_does_not_advise_installing(fresh, monkeypatch):
    cupy_as(monkeypatch, CupyFinder(BROKEN))
    with pytest.raises(RuntimeError, match=r"impl='cupy' cannot run this call: it is not usable "
                                           r'here \(CuPy is installed but does not import: '
                                           r'ImportError: CuPy failed to load') as info, \
            warnings.catch_warnings():
        warnings.simplefilter('ignore')
        nystrom_attention(*attention_inputs(), impl='cupy')
    assert 'pip install' not in str(info.value)


def test_a_cupy_that_imports_but_cannot_initialise_cuda_names_the_error(fresh, monkeypatch):
    def insufficient():
        raise RuntimeError('cudaErrorInsufficientDriver: CUDA driver version is insufficient '
                           'for CUDA runtime version')
    fake = types.SimpleNamespace(__version__='14.0.0', cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=insufficient)))
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    with pytest.warns(RuntimeWarning, match=r'CuPy 14\.0\.0 is installed but cannot initialise '
                                            r'CUDA and NVRTC: RuntimeError: cudaErrorInsufficient'):
        assert not cuda.available()
    assert 'pip install' not in cuda.unavailable_reason()


@pytest.mark.parametrize('has_cuda', [False, True])
def test_an_absent_cupy_warns_only_where_there_is_cuda_and_impl_cupy_says_how_to_install(
        fresh, monkeypatch, has_cuda):
    cupy_as(monkeypatch, CupyFinder())
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: has_cuda)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        assert not cuda.available()
    assert [str(w.message) for w in caught] == ([
        'lapformer_mm: the CUDA kernels are not available (CuPy is not installed: '
        f'{cuda.INSTALL_HINT}); the attention runs the slower PyTorch reference on CUDA '
        'tensors'] if has_cuda else [])
    with pytest.raises(RuntimeError, match=r'it is not usable here \(CuPy is not installed: pip '
                                           r'install cupy-cuda12x'), \
            warnings.catch_warnings():
        warnings.simplefilter('ignore')
        nystrom_attention(*attention_inputs(), impl='cupy')


def cuda_options(**overrides):
    fields = dict(kernel='laplacian', lam=4.0, eps=0.01, iters=16, ns_init='identity',
                  ns_refine=True, normalize='injective', whiten_eps=1e-5)
    fields.update(overrides)
    return OpOptions(**fields)


@pytest.fixture
def failing_build(fresh, monkeypatch):
    """CuPy faked, its compiles failing as NVRTC's do; the backend checks its kernels at
    selection as on a GPU (the routing's stand-in for that check undone)."""
    check = cuda.ensure_loaded
    cupy, _ = fake_cupy.install(cuda, monkeypatch.setattr, fail_compile=True)
    route_cpu_tensors_to_cuda_backend(monkeypatch.setattr, emulated_limits())
    monkeypatch.setattr(cuda, 'ensure_loaded', check)
    attention._warn_fallback.cache_clear()  # it warns once per process and reasons
    yield cupy
    attention._warn_fallback.cache_clear()


def compiles(cupy):
    return [e for e in cupy.events if e[0] == 'compile']


def test_a_build_that_fails_warns_once_runs_the_reference_and_is_not_retried(failing_build):
    q, k, v, landmarks = (t.requires_grad_() for t in attention_inputs())
    out, expected = warns_once_and_runs_the_reference(
        r"the 'cupy' attention backend does not support this call \(compiling "
        r'nystrom_attention\.cu \(dv32_tb32, float\) for cuda:None failed: RuntimeError: '
        r'error: identifier "oops" is undefined\)', q, k, v, landmarks)
    assert len(compiles(failing_build)) == 1
    assert not [e for e in failing_build.events if e[0] == 'launch']
    grads = torch.autograd.grad(out.sum(), (q, k, v, landmarks))
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v, landmarks))):
        assert torch.equal(got, want)


def test_impl_cupy_raises_the_build_error(failing_build):
    with pytest.raises(RuntimeError, match=r"impl='cupy' cannot run this call: compiling "
                                           r'nystrom_attention\.cu \(dv32_tb32, float\).*'
                                           r'identifier "oops" is undefined'):
        nystrom_attention(*attention_inputs(), impl='cupy')
    # The launch path raises the remembered error without compiling again.
    with pytest.raises(cuda.CudaOpsError, match='identifier "oops"'):
        cuda.load_group(None, cuda.VARIANT_BY_NAME['dv32_tb32'], 'float')
    assert len(compiles(failing_build)) == 1


def test_each_variant_and_element_type_is_tried_once(failing_build):
    """A failure is remembered per (device, variant, element type): fp16 is tried too."""
    with pytest.warns(RuntimeWarning, match=r'dv32_tb32, float\)'):
        nystrom_attention(*attention_inputs())
    with pytest.warns(RuntimeWarning, match=r'dv32_tb32, lap_half\)'):
        nystrom_attention(*attention_inputs(torch.float16))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        nystrom_attention(*attention_inputs(torch.float16))
    assert [e[2][-1] for e in compiles(failing_build)] == ['-DNYS_ELEMENT=float',
                                                           '-DNYS_ELEMENT=lap_half']


@pytest.fixture
def routed(monkeypatch):
    """CuPy faked and CPU tensors taken by the CUDA backend, as in test_host_path.py."""
    fake_cupy.install(cuda, monkeypatch.setattr)
    route_cpu_tensors_to_cuda_backend(monkeypatch.setattr, emulated_limits())


@pytest.mark.parametrize('dtype, grid, reason', [
    (torch.float64, 7, r'dtype torch\.float64; the CUDA kernels take torch\.float32'),
    (torch.float32, 9, r'm = 81 landmarks; the CUDA kernels take 1 to 64'),
])
def test_the_registered_ops_called_with_impl_cupy_raise_the_reasons(routed, dtype, grid, reason):
    gen = torch.Generator().manual_seed(1)
    q, v = (torch.randn(1, 2, 81, 8, generator=gen, dtype=dtype) for _ in range(2))
    landmarks = pool_landmarks(q, (9, 9), grid)
    opts = tuple(cuda_options())
    with pytest.raises(RuntimeError, match=r"impl='cupy' cannot run this call: " + reason):
        attention.nystrom_attention_op(q, None, v, landmarks, *opts, 'cupy')
    out, context, inverse, stats = attention.nystrom_attention_op(q, None, v, landmarks, *opts,
                                                                  'reference')
    grad = torch.ones_like(out)
    with pytest.raises(RuntimeError, match=r"impl='cupy' cannot run this call: " + reason):
        attention.nystrom_attention_backward_op(
            grad, q, None, v, landmarks, context, inverse, stats, 'laplacian', 4.0, 0.01, True,
            'injective', 1e-5, 'cupy')


def test_a_build_that_fails_after_a_trace_chose_the_kernels_says_so_and_what_to_do(
        failing_build):
    """impl=None under torch.compile: the trace builds nothing, so it chooses the kernels
    unbuilt; the graph's first run builds them, and that build fails. The error says the
    user's None was resolved at the trace, and how to get the reference instead (an eager call
    first does not: the trace reads no build state)."""
    torch._dynamo.reset()
    try:
        compiled = torch.compile(nystrom_attention, backend='eager')
        with pytest.raises(RuntimeError) as err:
            compiled(*attention_inputs())
    finally:
        torch._dynamo.reset()
    message = str(err.value)
    assert 'selected when a torch.compile graph was traced, before they were built' in message
    assert ('the build then failed: compiling nystrom_attention.cu (dv32_tb32, float)'
            in message), message
    assert 'identifier "oops" is undefined' in message
    assert "Compile with impl='reference'" in message
    assert len(compiles(failing_build)) == 1
