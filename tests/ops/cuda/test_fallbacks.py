"""Where the CUDA backend cannot run a call: impl=None warns once with the reason and runs
the reference, impl='cupy' raises it."""
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
from lapformer_mm.ops.backends import cuda, cuda_plan
from lapformer_mm.ops.reference import OpOptions


def attention_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 48, 32, generator=gen, dtype=dtype) for _ in range(3))
    return q, k, v, pool_landmarks(k, (6, 8), 7)


@pytest.fixture
def fresh(monkeypatch):
    """The backend's once-per-process checks undone; CPU tensors taken as CUDA ones."""
    monkeypatch.setattr(cuda, '_AVAILABILITY', [])
    monkeypatch.setattr(cuda, '_WARNED', [])
    monkeypatch.setattr(cuda, 'DEVICE', 'cpu')
    monkeypatch.delitem(attention.BACKENDS, 'cpu')
    monkeypatch.delitem(sys.modules, 'cupy', raising=False)


class CupyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import cupy`` absent (error None) or raising ``error``."""

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


def warns_once_and_runs_the_reference(match, q, k, v, landmarks):
    """(first output, the reference's): the first call warns (``match``), the second does not."""
    with pytest.warns(RuntimeWarning, match=match):
        out = nystrom_attention(q, k, v, landmarks)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        again = nystrom_attention(q, k, v, landmarks)
    expected = nystrom_attention(q, k, v, landmarks, impl='reference')
    assert torch.equal(out, expected) and torch.equal(again, expected)
    return out, expected


def insufficient_driver():
    raise RuntimeError('cudaErrorInsufficientDriver: CUDA driver version is insufficient')


@pytest.mark.parametrize('state, reason', [
    ('broken', 'libnvrtc'), ('no_init', 'cudaErrorInsufficientDriver'), ('absent', 'pip install')])
def test_a_cupy_that_cannot_serve_warns_once_or_raises_its_own_error(fresh, monkeypatch, state,
                                                                     reason):
    """impl=None warns once, impl='cupy' raises; only an absent CuPy advises installing it."""
    if state == 'no_init':
        monkeypatch.setitem(sys.modules, 'cupy', types.SimpleNamespace(
            __version__='14.0.0', cuda=types.SimpleNamespace(
                runtime=types.SimpleNamespace(getDeviceCount=insufficient_driver))))
    else:
        cupy_as(monkeypatch, CupyFinder(BROKEN if state == 'broken' else None))
    if state == 'absent':
        monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            nystrom_attention(*attention_inputs())  # no CUDA here: silent
        monkeypatch.setattr(cuda, '_WARNED', [])
        monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    warns_once_and_runs_the_reference(reason, *attention_inputs())
    assert ('pip install' in cuda.unavailable_reason()) == (state == 'absent')
    with pytest.raises(RuntimeError, match=reason), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        nystrom_attention(*attention_inputs(), impl='cupy')


OPTIONS = OpOptions('laplacian', 4.0, 0.01, 16, 'identity', True, 'injective', 1e-5)


@pytest.fixture
def failing_build(fresh, monkeypatch):
    """CuPy faked, its compiles failing as NVRTC's do; kernels checked at selection."""
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
    """A failure is remembered per (device, variant, element type): the reference runs, with
    its gradients; impl='cupy' raises the build's error; fp16 is tried once too."""
    q, k, v, landmarks = (t.requires_grad_() for t in attention_inputs())
    out, expected = warns_once_and_runs_the_reference(r'dv32_tb32, float\).*"oops"', q, k, v,
                                                      landmarks)
    assert not [e for e in failing_build.events if e[0] == 'launch']
    grads = torch.autograd.grad(out.sum(), (q, k, v, landmarks))
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v, landmarks))):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match='"oops"'):
        nystrom_attention(*attention_inputs(), impl='cupy')
    # The launch path raises the remembered error without compiling again.
    with pytest.raises(cuda.CudaOpsError, match='"oops"'):
        cuda.load_group(None, cuda_plan.VARIANT_BY_NAME['dv32_tb32'], 'float')
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


@pytest.mark.parametrize('dtype, grid, reason', [(torch.float64, 7, 'float64'),
                                                 (torch.float32, 9, 'm = 81')])
def test_the_registered_ops_called_with_impl_cupy_raise_the_reasons(routed, dtype, grid, reason):
    gen = torch.Generator().manual_seed(1)
    q, v = (torch.randn(1, 2, 81, 8, generator=gen, dtype=dtype) for _ in range(2))
    landmarks = pool_landmarks(q, (9, 9), grid)
    opts = tuple(OPTIONS)
    with pytest.raises(RuntimeError, match=reason):
        attention.nystrom_attention_op(q, None, v, landmarks, *opts, 'cupy')
    out, context, inverse, stats = attention.nystrom_attention_op(q, None, v, landmarks, *opts,
                                                                  'reference')
    grad = torch.ones_like(out)
    with pytest.raises(RuntimeError, match=reason):
        attention.nystrom_attention_backward_op(
            grad, q, None, v, landmarks, context, inverse, stats, 'laplacian', 4.0, 0.01, True,
            'injective', 1e-5, 'cupy')


def test_a_build_that_fails_after_a_trace_chose_the_kernels_says_so_and_what_to_do(
        failing_build):
    """Chosen unbuilt under torch.compile, the build fails at the first run: named, a way out."""
    torch._dynamo.reset()
    try:
        compiled = torch.compile(nystrom_attention, backend='eager')
        with pytest.raises(RuntimeError, match=r'"oops".*torch\.compile.*impl=\'reference\''):
            compiled(*attention_inputs())
    finally:
        torch._dynamo.reset()
    assert len(compiles(failing_build)) == 1
