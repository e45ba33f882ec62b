"""The host path of the CUDA backend with a fake CuPy (devtools/fake_cupy.py): no GPU needed.

What makes the CuPy path thin, per-device and CUDA-graph safe, checked on the CPU: one
compile per (variant, element type) with the variant's -D geometry, the opt-in done once
at load, nothing compiled or loaded inside a capture (a clear error, or warmup() first),
every launch on PyTorch's current stream (so a capture stream is followed and CuPy's own
current stream, the legacy default stream, is never used), a device context entered only
when the device is not current, strided operands passed without copies, one struct
argument per launch, and reasons instead of exceptions for what the kernels cannot take.
"""
import numpy as np
import pytest
import torch

from devtools import fake_cupy
from devtools.cuda_emulation import emulated_limits, route_cpu_tensors_to_cuda_backend
from devtools.op_counts import count_call
from lapformer_mm.ops import nystrom_attention, pool_landmarks
from lapformer_mm.ops.backends import cuda
from lapformer_mm.ops.reference import OpOptions

H200 = emulated_limits(smem_optin=227 * 1024, sms=2)


@pytest.fixture
def fake(monkeypatch):
    """CuPy faked; the fused op's CuPy path chosen for CPU tensors (the kernels do not run:
    outputs are uninitialised, only the host side is exercised)."""
    cupy, streams = fake_cupy.install(cuda, monkeypatch.setattr, current_device=None)
    route_cpu_tensors_to_cuda_backend(monkeypatch.setattr, H200)
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


def test_one_compile_per_variant_and_element_type_with_its_geometry(fake):
    cupy, _ = fake
    q, k, v, landmarks = attention_inputs()
    for _ in range(3):
        nystrom_attention(q, k, v, landmarks)
    compiles = [e for e in cupy.events if e[0] == 'compile']
    assert len(compiles) == 1 and all('<float' in name for name in compiles[0][1])
    variant = cuda.VARIANT_BY_NAME['dv32_tb32']
    assert compiles[0][2] == cuda.NVRTC_OPTIONS + variant.defines + ('-DNYS_ELEMENT=float',)
    assert compiles[0][3] == 'nvrtc'
    assert [e[1].split('<')[0] for e in launches(cupy)] == list(cuda.FORWARD) * 3
    # One argument per launch: the parameter struct, a numpy array of size one.
    assert all(len(e[4]) == 1 and e[4][0].dtype == cuda.PARAMS_DTYPE and e[4][0].size == 1
               for e in launches(cupy))
    # The Newton-Schulz solve on NYS_TX x NYS_SY threads, every other kernel on tx x ty.
    assert all(e[3] == ((variant.tx, variant.sy, 1) if 'solve' in e[1] else variant.block)
               for e in launches(cupy))
    assert variant.tx * variant.sy == 2 * variant.threads


def test_opt_in_happens_once_at_load_to_the_devices_limit(fake):
    """The solve and gradient kernels are opted into all the device allows when the module
    loads, so no later call (inside a capture, say) changes a function attribute."""
    cupy, _ = fake
    q, k, v, landmarks = (t.detach().requires_grad_() for t in attention_inputs())
    nystrom_attention(q, k, v, landmarks).sum().backward()
    nystrom_attention(q, k, v, landmarks).sum().backward()
    optins = {e[1].split('<')[0]: e[2] for e in cupy.events if e[0] == 'optin'}
    assert optins == {'nys_forward_solve': H200.smem_optin - cuda.NS_STATIC_SMEM,
                      'nys_backward_solve': H200.smem_optin,
                      'nys_backward_grads': H200.smem_optin}
    assert len([e for e in cupy.events if e[0] == 'optin']) == 3 * 2  # both kinds, once


def test_a_first_call_inside_a_capture_raises_and_warmup_prevents_it(fake, monkeypatch):
    cupy, _ = fake
    q, k, v, landmarks = attention_inputs()
    monkeypatch.setattr(cuda, 'capturing', lambda device_index: True)
    with pytest.raises(cuda.CaptureError, match=r'Run the attention once eagerly.*warmup\(\)'):
        cuda.forward(q, k, v, landmarks, cuda_options())
    monkeypatch.setattr(cuda, 'capturing', lambda device_index: False)
    loaded = cuda.warmup(torch.device('cuda', 0), dtypes=(torch.float32,), value_dims=(32,))
    assert loaded == [('dv32_tb32', torch.float32)]
    compiles = len([e for e in cupy.events if e[0] == 'compile'])
    monkeypatch.setattr(cuda, 'capturing', lambda device_index: True)
    group = cuda.load_group(0, cuda.VARIANT_BY_NAME['dv32_tb32'], 'float', H200.smem_optin)
    assert len(group) == len(cuda.kernel_names(('float',)))
    assert len([e for e in cupy.events if e[0] == 'compile']) == compiles


def cuda_options(**overrides):
    fields = dict(kernel='laplacian', lam=4.0, eps=0.01, iters=16, ns_init='identity',
                  ns_refine=True, normalize='injective', whiten_eps=1e-5)
    fields.update(overrides)
    return OpOptions(**fields)


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
    n = len(cuda.FORWARD)
    assert [e[-1] for e in launches(cupy)] == [12345] * (2 * n) + [777] * n


def test_device_context_only_when_the_device_is_not_current(fake):
    cupy, _ = fake
    tensor = fake_cupy.FakeCudaTensor()
    name = cuda.kernel_name('nys_forward_stats', 'float', 0)
    variant, params = cuda.VARIANTS[0], np.zeros(1, cuda.PARAMS_DTYPE)
    cupy.current_device = 1
    cuda.launch(name, variant, tensor, (1, 1), variant.block, params)
    first = len([e for e in cupy.events if e[0] == 'device'])
    cuda.launch(name, variant, tensor, (1, 1), variant.block, params)
    assert len([e for e in cupy.events if e[0] == 'device']) == first
    cupy.current_device = 0
    cuda.launch(name, variant, tensor, (1, 1), variant.block, params)
    assert [e for e in cupy.events if e[0] == 'device'][-1] == ('device', 1)


def test_compile_and_launch_failures_name_kernel_and_shapes(monkeypatch):
    name = cuda.kernel_name('nys_forward_out', 'float', 1)
    for kwargs, pattern in ((dict(fail_compile=True), r'dv64_tb16, float.*oops'),
                            (dict(fail_launch=True),
                             r'nys_forward_out<float, 1> \(dv64_tb16.*q \(1, 2\).*too many')):
        fake_cupy.install(cuda, monkeypatch.setattr, current_device=1, **kwargs)
        with pytest.raises(cuda.CudaOpsError, match=pattern):
            cuda.launch(name, cuda.VARIANT_BY_NAME['dv64_tb16'], fake_cupy.FakeCudaTensor(), (1,),
                      (16, 16, 1), np.zeros(1, cuda.PARAMS_DTYPE), shapes='q (1, 2)')


def test_strided_operands_are_passed_as_they_are(fake):
    """Head views of one projection go in as they are: no ATen op copies q, k, v or the
    landmarks; the forward allocates its outputs and one workspace, the backward its
    gradients and one workspace, and neither computes anything outside our launches."""
    q, k, v, landmarks = (t.detach().requires_grad_() for t in attention_inputs())
    assert not q.is_contiguous()
    out, counter = count_call(lambda: nystrom_attention(q, k, v, landmarks), cuda)
    assert not counter.compute, dict(counter.compute)
    assert counter.totals()['allocations'] == 5
    assert counter.totals()['launches'] == len(cuda.FORWARD)
    grad = torch.ones_like(out)
    _, counter = count_call(lambda: torch.autograd.grad(out, (q, k, v, landmarks), grad), cuda)
    assert not counter.compute, dict(counter.compute)
    assert counter.totals()['launches'] == len(cuda.BACKWARD)


def test_the_struct_carries_pointers_strides_and_options(fake):
    cupy, _ = fake
    q, k, v, landmarks = attention_inputs()
    nystrom_attention(q, k, v, landmarks, kernel='gaussian', lam=2.0, ns_init='authors')
    p = launches(cupy)[0][4][0][0]
    assert p['q']['ptr'] == q.data_ptr()
    assert tuple(int(p['q'][s]) for s in ('sb', 'sh', 'sn', 'sd')) == q.stride()
    assert p['k']['ptr'] == k.data_ptr() and p['L']['ptr'] == landmarks.data_ptr()
    assert (int(p['bh_count']), int(p['heads']), int(p['n']), int(p['m']), int(p['d']),
            int(p['dv'])) == (4, 2, 48, landmarks.shape[2], 32, 32)
    assert p['neg_inv_lam'] == np.float32(-0.5) and p['neg_coef'] == np.float32(-1.0)
    assert p['init_authors'] == 1 and p['injective'] == 1 and p['refine'] == 1
    tied = nystrom_attention(q, q, v, landmarks)
    assert tied is not None and launches(cupy)[-1][4][0][0]['k']['ptr'] == 0


def test_plans_are_cached_per_shape():
    cuda.splits.cache_clear()
    for _ in range(3):
        cuda.splits(8, 16650, 528, 64)
    info = cuda.splits.cache_info()
    assert info.misses == 1 and info.hits == 2
    splits, chunk = cuda.splits(8, 16650, 528, 64)
    assert splits * chunk >= 16650 > (splits - 1) * chunk and chunk % 64 == 0


@pytest.mark.parametrize('limits, shapes, reason', [
    (H200, dict(dtype=torch.float64), r'dtype torch.float64; the CUDA kernels take'),
    (H200, dict(m=81), r'm = 81 landmarks; the CUDA kernels take 1 to 64'),
    (H200, dict(dv=96), r'd_v = 96 value columns'),
    (H200, dict(n=0), r'empty operands'),
    (emulated_limits(capability=(5, 2)), {}, r'compute capability 5.2; .* 6.0 or later'),
    (emulated_limits(capability=(7, 0))._replace(nvrtc_major=13), {},
     r'NVRTC 13 cannot compile for sm_70; install cupy-cuda12x'),
    (emulated_limits(smem_optin=48 * 1024), dict(m=64, dv=64),
     r'variant dv64_tb16: the gradient kernel needs 56,576 bytes .* allows 49,152'),
])
def test_not_supported_names_the_reason(monkeypatch, limits, shapes, reason):
    monkeypatch.setattr(cuda, 'device_limits', lambda device: limits)
    size = dict(n=10, m=9, dv=8, dtype=torch.float32)
    size.update(shapes)
    q = torch.zeros(1, 2, size['n'], 4, dtype=size['dtype'])
    v = torch.zeros(1, 2, size['n'], size['dv'], dtype=size['dtype'])
    landmarks = torch.zeros(1, 2, size['m'], 4, dtype=size['dtype'])
    reasons = cuda.not_supported(q, None, v, landmarks, cuda_options())
    assert any(__import__('re').search(reason, r) for r in reasons), reasons


def test_not_supported_never_raises(monkeypatch):
    def broken(device):
        raise RuntimeError('CUDA driver version is insufficient')
    fake_cupy.install(cuda, monkeypatch.setattr)
    monkeypatch.setattr(cuda, 'device_limits', broken)
    q = torch.zeros(1, 1, 4, 4)
    reasons = cuda.not_supported(q, None, q, q, cuda_options())
    assert reasons and 'insufficient' in reasons[0]
    monkeypatch.setattr(cuda, 'device_limits', lambda device: H200)
    assert cuda.not_supported(q, None, q, q, cuda_options()) == ()


def test_warmup_names_what_the_kernels_do_not_take(fake, monkeypatch):
    with pytest.raises(ValueError, match=r'dtypes: the CUDA kernels take torch.float32, '
                                         r'torch.float16, torch.bfloat16, got torch.float64'):
        cuda.warmup(torch.device('cuda', 0), dtypes=(torch.float64,))
    with pytest.raises(ValueError, match=r'value_dims: no kernels for d_v = 96 on device 0 '
                                         r'\(d_v = 96 value columns; the CUDA kernels take 1 '
                                         r'to 64\)'):
        cuda.warmup(torch.device('cuda', 0), value_dims=(96,))
    # A width asked for that no m can use on the device is refused.
    pascal = emulated_limits(smem_optin=48 * 1024, sms=2)
    monkeypatch.setattr(cuda, 'device_limits', lambda device: pascal)
    with pytest.raises(ValueError, match=r'value_dims: no kernels for d_v = 64 on device 0 '
                                         r'\(variant dv64_tb32: .*; variant dv64_tb16: the '
                                         r'gradient kernel needs 56,576 bytes'):
        cuda.warmup(torch.device('cuda', 0), value_dims=(64, ))


@pytest.mark.parametrize('kib', [48, 64, 100, 227])
def test_warmup_loads_every_variant_a_call_can_select_on_the_device(fake, monkeypatch, kib):
    """What warmup() loads against the plans of every m and d_v the kernels take: on a
    48 KiB device (Pascal) dv32_tb16, the only variant there, takes m <= 60 at every
    d_v <= 32 and nothing wider."""
    limits = emulated_limits(smem_optin=kib * 1024, sms=2)
    monkeypatch.setattr(cuda, 'device_limits', lambda device: limits)
    selectable = {found.variant.name for m in range(1, cuda.MAX_M + 1)
                  for dv in range(1, cuda.MAX_DV + 1)
                  if isinstance(found := cuda.plan(m, dv, limits.smem_optin), cuda.Plan)}
    dtypes = (torch.float32, torch.bfloat16)
    loaded = cuda.warmup(torch.device('cuda', 0), dtypes=dtypes)
    assert sorted(loaded, key=str) == sorted(((name, dtype) for name in selectable
                                              for dtype in dtypes), key=str)
    assert ('dv32_tb16' in selectable) == (kib == 48)
    if kib == 48:
        fits = {(m, dv) for m in range(1, cuda.MAX_M + 1) for dv in range(1, cuda.MAX_DV + 1)
                if isinstance(cuda.plan(m, dv, limits.smem_optin), cuda.Plan)}
        assert fits == {(m, dv) for m in range(1, 61) for dv in range(1, 33)}


def test_a_later_process_loads_the_kernels_from_cupys_cache_by_the_names_kept(monkeypatch,
                                                                              tmp_path):
    """CuPy compiles a module with name expressions in every process; the backend keeps the
    lowered names beside CuPy's cache, so a second process (a second fake over the same
    disk cache) loads the binary and launches the same kernels without compiling."""
    disk, q, k, v, landmarks = {}, *attention_inputs()

    def process():
        cupy, _ = fake_cupy.install(cuda, monkeypatch.setattr, disk=disk, cache_dir=tmp_path)
        route_cpu_tensors_to_cuda_backend(monkeypatch.setattr, H200)
        nystrom_attention(q, k, v, landmarks)
        return cupy, [e[0] for e in cupy.events if e[0] in ('compile', 'load')]

    first, loads = process()
    assert loads == ['compile'] and list(cuda.loaded_from.values()) == ['compiled']
    second, loads = process()
    assert loads == ['load'] and list(cuda.loaded_from.values()) == ['cached']
    assert [e[1] for e in launches(second)] == [e[1] for e in launches(first)]
    assert [e[1].split('<')[0] for e in launches(second)] == list(cuda.FORWARD)
    # Another element type of the same variant is another binary in CuPy's cache: both stay.
    q, k, v, landmarks = (t.half() for t in (q, k, v, landmarks))
    assert process()[1] == ['compile']
    q, k, v, landmarks = (t.float() for t in (q, k, v, landmarks))
    assert process()[1] == ['load']


def test_a_stale_or_broken_names_file_means_a_compile(monkeypatch, tmp_path):
    """The binary gone from CuPy's cache, the names file unreadable, or the source changed:
    the backend compiles (and keeps the names again), never launches a wrong kernel; for a
    changed source it compiles once, with no attempt at the old names first."""
    q, k, v, landmarks = attention_inputs()

    def process(disk):
        cupy, _ = fake_cupy.install(cuda, monkeypatch.setattr, disk=disk, cache_dir=tmp_path)
        route_cpu_tensors_to_cuda_backend(monkeypatch.setattr, H200)
        nystrom_attention(q, k, v, landmarks)
        assert [e[1].split('<')[0] for e in launches(cupy)] == list(cuda.FORWARD)
        compiles = len([e for e in cupy.events if e[0] == 'compile'])
        return cuda.loaded_from.popitem()[1], compiles

    disk = {}
    assert process(disk) == ('compiled', 1) and process(disk) == ('cached', 0)
    assert process({}) == ('compiled', 2)  # CuPy's cache emptied, the names file left
    (names_file,) = tmp_path.glob('lapformer_mm_*.json')
    disk = {}
    process(disk)
    names_file.write_text('{"truncated')
    assert process(disk) == ('compiled', 1) and process(disk) == ('cached', 0)
    source = cuda.load_source() + '\n// changed\n'
    monkeypatch.setattr(cuda, 'load_source', lambda: source)
    assert process(disk) == ('compiled', 1)
