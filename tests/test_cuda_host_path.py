"""The host path of the CUDA ops with a fake CuPy (devtools/fake_cupy.py): no GPU needed.

What makes the CuPy path thin and CUDA-graph safe, checked on the CPU: compiled kernels
and stream wrappers are cached, every launch names PyTorch's current stream (so a
capture stream is followed and CuPy's own current stream, the legacy default stream, is
never used), a device context is entered only when the device is not current, strided
operands reach the kernels without copies, and nothing allocates outside PyTorch.
"""
import pytest
import torch

from devtools import fake_cupy
from devtools.cuda_emulation import route_cpu_tensors_to_cuda_backend
from devtools.op_counts import count_call
from lapformer_mm.ops import cuda_runtime as rt
from lapformer_mm.ops import cupy_ops, nystrom_attention, pool_landmarks


@pytest.fixture
def fake(monkeypatch):
    """CuPy faked; the fused op's CuPy path chosen for CPU tensors (the kernels do not run:
    outputs are uninitialised, only the host side is exercised)."""
    cupy, streams = fake_cupy.install(rt, monkeypatch.setattr, current_device=None)
    route_cpu_tensors_to_cuda_backend(monkeypatch.setattr)
    monkeypatch.setattr(cupy_ops, 'target_blocks', lambda device: 8)
    return cupy, streams


def attention_inputs(seed=0, strided=True):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(2, 48, 3 * 64, generator=gen)
    q, k, v = (t.view(2, 48, 2, 32).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    if not strided:
        q, k, v = (t.contiguous() for t in (q, k, v))
    return q, k, v, pool_landmarks(k, (6, 8), 7)


def launches(cupy):
    return [e for e in cupy.events if e[0] == 'launch']


def test_one_compile_per_element_type_and_cached_launchers(fake):
    cupy, _ = fake
    q, k, v, landmarks = attention_inputs()
    for _ in range(3):
        nystrom_attention(q, k, v, landmarks)
    compiles = [e for e in cupy.events if e[0] == 'compile']
    assert len(compiles) == 1 and all('<float' in name for name in compiles[0][1])
    assert [e[1].split('<')[0] for e in launches(cupy)] == list(rt.NYS_FORWARD) * 3


def test_launches_follow_pytorchs_current_stream_one_wrapper_each(fake):
    """Two calls on one stream wrap it once; a new current stream (a capture stream, say)
    is used from the next launch on. The fake refuses a launch without a stream."""
    cupy, streams = fake
    q, k, v, landmarks = attention_inputs()
    nystrom_attention(q, k, v, landmarks)
    nystrom_attention(q, k, v, landmarks)
    streams.handle = 777
    nystrom_attention(q, k, v, landmarks)
    assert [e for e in cupy.events if e[0] == 'stream'] == [('stream', 12345), ('stream', 777)]
    assert [e[-1] for e in launches(cupy)] == [12345] * 6 + [777] * 3


def test_device_context_only_when_the_device_is_not_current(fake, monkeypatch):
    cupy, _ = fake
    tensor = fake_cupy.FakeCudaTensor()
    name = rt.nystrom_name('nys_forward_stats', 'float', 0)
    cupy.current_device = 1
    rt.launch(rt.NYSTROM_SOURCE, name, tensor, (1, 1), (16, 16, 1), ())
    first = len([e for e in cupy.events if e[0] == 'device'])
    rt.launch(rt.NYSTROM_SOURCE, name, tensor, (1, 1), (16, 16, 1), ())
    assert len([e for e in cupy.events if e[0] == 'device']) == first
    cupy.current_device = 0
    rt.launch(rt.NYSTROM_SOURCE, name, tensor, (1, 1), (16, 16, 1), ())
    assert [e for e in cupy.events if e[0] == 'device'][-1] == ('device', 1)


def test_strided_operands_are_passed_as_they_are(fake):
    """Head views of one projection go in as they are: no ATen op copies q, k, v or the
    landmarks; the forward allocates its outputs and one workspace, the backward its
    gradients and one workspace, and neither computes anything outside our launches."""
    q, k, v, landmarks = (t.detach().requires_grad_() for t in attention_inputs())
    assert not q.is_contiguous()
    out, counter = count_call(lambda: nystrom_attention(q, k, v, landmarks), rt)
    assert not counter.compute, dict(counter.compute)
    assert counter.totals()['allocations'] == 5 and counter.totals()['launches'] == 3
    grad = torch.ones_like(out)
    _, counter = count_call(lambda: torch.autograd.grad(out, (q, k, v, landmarks), grad), rt)
    assert not counter.compute, dict(counter.compute)
    assert counter.totals()['launches'] == 4


def test_plans_are_cached_per_shape():
    rt.nystrom_splits.cache_clear()
    for _ in range(3):
        rt.nystrom_splits(8, 16650, 528)
    info = rt.nystrom_splits.cache_info()
    assert info.misses == 1 and info.hits == 2
    splits, chunk = rt.nystrom_splits(8, 16650, 528)
    assert splits * chunk >= 16650 > (splits - 1) * chunk and chunk % rt.NYS_TN == 0
