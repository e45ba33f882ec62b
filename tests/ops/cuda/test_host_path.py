"""The host path of the CUDA backend with a fake CuPy (devtools/fake_cupy.py), no GPU."""
import re
import warnings

import numpy as np
import pytest
import torch

from devtools import fake_cupy
from devtools.cuda_emulation import emulated_limits, route_cpu_tensors_to_cuda_backend
from devtools.op_counts import count_call
from lapformer_mm.ops import nystrom_attention, pool_landmarks
from lapformer_mm.ops.backends import cuda, cuda_plan
from lapformer_mm.ops.reference import OpOptions

H200 = emulated_limits(smem_optin=227 * 1024, sms=2)
OPTIONS = OpOptions('laplacian', 4.0, 0.01, 16, 'identity', True, 'injective', 1e-5)
# The backend's load at a call's check (the routing to CPU tensors takes it as done).
ENSURE_LOADED = cuda.ensure_loaded


@pytest.fixture
def fake(monkeypatch):
    """CuPy faked and chosen for CPU tensors (the kernels do not run: the host side only)."""
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


def test_one_compile_per_variant_and_element_type_one_struct_per_launch_current_stream(fake):
    """Launches follow PyTorch's current stream; the fake warns at CuPy 14's ExternalStream."""
    cupy, streams = fake
    q, k, v, landmarks = attention_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        for handle in (12345, 12345, 777):
            streams.handle = handle
            nystrom_attention(q, k, v, landmarks)
    n = len(cuda_plan.FORWARD)
    assert [e[-1] for e in launches(cupy)] == [12345] * (2 * n) + [777] * n
    nystrom_attention(q, k, v, landmarks, kernel='gaussian', lam=2.0, ns_init='authors')
    compiles = [e for e in cupy.events if e[0] in ('compile', 'load')]
    variant = cuda_plan.VARIANT_BY_NAME['dv32_tb32']
    assert compiles == [('compile', (), cuda.NVRTC_OPTIONS + variant.defines
                         + ('-DNYS_ELEMENT=float',), 'nvrtc')]
    entries = [[cuda_plan.entry_name(s, kind) for s in cuda_plan.FORWARD] for kind in (0, 1)]
    assert [e[1] for e in launches(cupy)] == entries[0] * 3 + entries[1]
    # One argument per launch: the parameter struct, a numpy array of size one.
    assert all(len(e[4]) == 1 and e[4][0].dtype == cuda_plan.PARAMS_DTYPE and e[4][0].size == 1
               for e in launches(cupy))
    # The Newton-Schulz solve on NYS_TX x NYS_SY threads, every other kernel on tx x ty.
    assert all(e[3] == ((variant.tx, variant.sy, 1) if 'solve' in e[1] else variant.block)
               for e in launches(cupy))
    assert variant.tx * variant.sy == 2 * variant.threads
    # Pointers, strides, sizes and options (of the last call).
    p = launches(cupy)[-1][4][0][0]
    assert p['q']['ptr'] == q.data_ptr()
    assert tuple(int(p['q'][s]) for s in ('sb', 'sh', 'sn', 'sd')) == q.stride()
    assert p['k']['ptr'] == k.data_ptr() and p['L']['ptr'] == landmarks.data_ptr()
    assert (int(p['bh_count']), int(p['heads']), int(p['n']), int(p['m']), int(p['d']),
            int(p['dv'])) == (4, 2, 48, landmarks.shape[2], 32, 32)
    assert p['neg_inv_lam'] == np.float32(-0.5) and p['neg_coef'] == np.float32(-1.0)
    assert p['init_authors'] == 1 and p['injective'] == 1 and p['refine'] == 1
    nystrom_attention(q, q, v, landmarks)
    assert launches(cupy)[-1][4][0][0]['k']['ptr'] == 0


def test_opt_in_happens_once_at_load_to_the_devices_limit(fake):
    """The solve and gradient kernels opted into all the device allows when the module loads."""
    cupy, _ = fake
    q, k, v, landmarks = (t.detach().requires_grad_() for t in attention_inputs())
    nystrom_attention(q, k, v, landmarks).sum().backward()
    nystrom_attention(q, k, v, landmarks).sum().backward()
    optins = {cuda_plan.stage_of(e[1]): e[2] for e in cupy.events if e[0] == 'optin'}
    assert optins == {'nys_forward_solve': cupy.smem_optin - cuda_plan.NS_STATIC_SMEM,
                      'nys_backward_solve': cupy.smem_optin,
                      'nys_backward_grads': cupy.smem_optin}
    assert len([e for e in cupy.events if e[0] == 'optin']) == 3 * 2  # both kinds, once


def test_a_variant_loaded_under_a_smaller_forced_limit_serves_a_full_size_launch(fake,
                                                                                  monkeypatch):
    """dv32_tb32 loaded under a 64 KiB plan, then launched with 73,984 bytes of the device's
    own limit (the fake refuses over the opt-in)."""
    cupy, _ = fake
    q = torch.randn(1, 2, 64, 32)
    landmarks = pool_landmarks(q, (8, 8), 8)
    for kib in (64, 227):
        monkeypatch.setattr(cuda, 'device_limits',
                            lambda device, kib=kib: emulated_limits(smem_optin=kib * 1024))
        nystrom_attention(q, q, q.clone(), landmarks)
    solves = [e[5] for e in launches(cupy) if cuda_plan.stage_of(e[1]) == 'nys_forward_solve']
    assert solves == [cuda.plan(64, 32, 64 * 1024).solve_smem, 73_984]
    assert len([e for e in cupy.events if e[0] == 'compile']) == 1


def test_a_first_call_inside_a_capture_raises_and_warmup_prevents_it(fake, monkeypatch):
    cupy, _ = fake
    q, k, v, landmarks = attention_inputs()
    monkeypatch.setattr(cuda, 'capturing', lambda device_index: True)
    with pytest.raises(cuda.CaptureError, match='warmup'):
        cuda.forward(q, k, v, landmarks, OPTIONS)
    monkeypatch.setattr(cuda, 'capturing', lambda device_index: False)
    loaded = cuda.warmup(torch.device('cuda', 0), dtypes=(torch.float32,), value_dims=(32,))
    assert loaded == [('dv32_tb32', torch.float32)]
    compiles = len([e for e in cupy.events if e[0] == 'compile'])
    monkeypatch.setattr(cuda, 'capturing', lambda device_index: True)
    group = cuda.load_group(0, cuda_plan.VARIANT_BY_NAME['dv32_tb32'], 'float')
    assert len(group) == len(cuda_plan.kernel_names(('float',)))
    assert len([e for e in cupy.events if e[0] == 'compile']) == compiles


def test_device_context_only_when_the_device_is_not_current(fake):
    cupy, _ = fake
    tensor = fake_cupy.FakeCudaTensor()
    name = cuda_plan.kernel_name('nys_forward_stats', 'float', 0)
    variant, params = cuda_plan.VARIANTS[0], np.zeros(1, cuda_plan.PARAMS_DTYPE)
    cupy.current_device = 1
    cuda.launch(name, variant, tensor, (1, 1), variant.block, params)
    first = len([e for e in cupy.events if e[0] == 'device'])
    cuda.launch(name, variant, tensor, (1, 1), variant.block, params)
    assert len([e for e in cupy.events if e[0] == 'device']) == first
    cupy.current_device = 0
    cuda.launch(name, variant, tensor, (1, 1), variant.block, params)
    assert [e for e in cupy.events if e[0] == 'device'][-1] == ('device', 1)


def test_compile_and_launch_failures_name_kernel_and_shapes(monkeypatch):
    name = cuda_plan.kernel_name('nys_forward_out', 'float', 1)
    for kwargs, pattern in ((dict(fail_compile=True), r'dv64_tb16, float.*oops'),
                            (dict(fail_launch=True),
                             r'nys_forward_out<float, 1> \(dv64_tb16.*q \(1, 2\).*too many')):
        fake_cupy.install(cuda, monkeypatch.setattr, current_device=1, **kwargs)
        with pytest.raises(cuda.CudaOpsError, match=pattern):
            cuda.launch(name, cuda_plan.VARIANT_BY_NAME['dv64_tb16'], fake_cupy.FakeCudaTensor(),
                      (1,), (16, 16, 1), np.zeros(1, cuda_plan.PARAMS_DTYPE), shapes='q (1, 2)')


def test_strided_operands_are_passed_as_they_are(fake):
    """No ATen op copies or computes; the forward allocates its outputs and one workspace."""
    q, k, v, landmarks = (t.detach().requires_grad_() for t in attention_inputs())
    assert not q.is_contiguous()
    out, counter = count_call(lambda: nystrom_attention(q, k, v, landmarks), cuda)
    assert not counter.compute, dict(counter.compute)
    assert counter.totals()['allocations'] == 5
    assert counter.totals()['launches'] == len(cuda_plan.FORWARD)
    grad = torch.ones_like(out)
    _, counter = count_call(lambda: torch.autograd.grad(out, (q, k, v, landmarks), grad), cuda)
    assert not counter.compute, dict(counter.compute)
    assert counter.totals()['launches'] == len(cuda_plan.BACKWARD)


def test_plans_are_cached_per_shape():
    cuda_plan.splits.cache_clear()
    for _ in range(3):
        cuda_plan.splits(8, 16650, 528, 64)
    info = cuda_plan.splits.cache_info()
    assert info.misses == 1 and info.hits == 2
    splits, chunk = cuda_plan.splits(8, 16650, 528, 64)
    assert splits * chunk >= 16650 > (splits - 1) * chunk and chunk % 64 == 0


def broken_device(device):
    raise RuntimeError('CUDA driver version is insufficient')


@pytest.mark.parametrize('limits, shapes, reason', [
    (H200, dict(dtype=torch.float64), 'float64'), (H200, dict(m=81), 'm = 81'),
    (H200, dict(dv=96), 'd_v = 96'), (H200, dict(n=0), 'empty'),
    (emulated_limits(capability=(5, 2)), {}, 'capability 5.2'),
    (emulated_limits(capability=(7, 0))._replace(nvrtc_major=13), {}, 'cupy-cuda12x'),
    (emulated_limits(smem_optin=48 * 1024), dict(m=64, dv=64), 'dv64_tb16.* 56,576 bytes'),
    (broken_device, {}, 'insufficient'), (H200, {}, None)])
def test_not_supported_names_the_reason_and_never_raises(monkeypatch, limits, shapes, reason):
    fake_cupy.install(cuda, monkeypatch.setattr)
    monkeypatch.setattr(cuda, 'device_limits', limits if callable(limits) else lambda d: limits)
    size = dict(dict(n=10, m=9, dv=8, dtype=torch.float32), **shapes)
    q = torch.zeros(1, 2, size['n'], 4, dtype=size['dtype'])
    v = torch.zeros(1, 2, size['n'], size['dv'], dtype=size['dtype'])
    landmarks = torch.zeros(1, 2, size['m'], 4, dtype=size['dtype'])
    reasons = cuda.not_supported(q, None, v, landmarks, OPTIONS)
    assert (reasons == ()) if reason is None else any(re.search(reason, r) for r in reasons)


@pytest.mark.parametrize('kib, kwargs, name', [(227, dict(dtypes=(torch.float64,)), 'dtypes'),
                                               (227, dict(value_dims=(96,)), 'value_dims'),
                                               (48, dict(value_dims=(64,)), 'value_dims')])
def test_warmup_names_what_the_kernels_do_not_take(fake, monkeypatch, kib, kwargs, name):
    """A dtype without kernels, a width beyond the tiles, a width no m fits on the device."""
    limits = emulated_limits(smem_optin=kib * 1024, sms=2)
    monkeypatch.setattr(cuda, 'device_limits', lambda device: limits)
    with pytest.raises(ValueError, match=name):
        cuda.warmup(torch.device('cuda', 0), **kwargs)


@pytest.mark.parametrize('kib', [48, 64, 100, 227])
def test_warmup_loads_every_variant_a_call_can_select_on_the_device(fake, monkeypatch, kib):
    """warmup() loads the variants of every m and d_v; 48 KiB: dv32_tb16, m <= 60, d_v <= 32."""
    limits = emulated_limits(smem_optin=kib * 1024, sms=2)
    monkeypatch.setattr(cuda, 'device_limits', lambda device: limits)
    selectable = {found.variant.name for m in range(1, cuda_plan.MAX_M + 1)
                  for dv in range(1, cuda_plan.MAX_DV + 1)
                  if isinstance(found := cuda.plan(m, dv, limits.smem_optin), cuda_plan.Plan)}
    dtypes = (torch.float32, torch.bfloat16)
    loaded = cuda.warmup(torch.device('cuda', 0), dtypes=dtypes)
    assert sorted(loaded, key=str) == sorted(((name, dtype) for name in selectable
                                              for dtype in dtypes), key=str)
    assert ('dv32_tb16' in selectable) == (kib == 48)
    if kib == 48:
        fits = {(m, dv) for m in range(1, cuda_plan.MAX_M + 1)
                for dv in range(1, cuda_plan.MAX_DV + 1)
                if isinstance(cuda.plan(m, dv, limits.smem_optin), cuda_plan.Plan)}
        assert fits == {(m, dv) for m in range(1, 61) for dv in range(1, 33)}


@pytest.mark.parametrize('version', ['13.6.0', '14.2.0'])
def test_a_later_process_loads_the_module_from_cupys_cache(monkeypatch, version):
    """A second fake over the same disk cache loads the binary; in-memory caching keeps none."""
    disk, q, k, v, landmarks = {}, *attention_inputs()

    def process(*operands):
        cupy, _ = fake_cupy.install(cuda, monkeypatch.setattr, disk=disk, version=version)
        route_cpu_tensors_to_cuda_backend(monkeypatch.setattr, H200)
        monkeypatch.setattr(cuda, 'ensure_loaded', ENSURE_LOADED)
        nystrom_attention(*operands)
        return cupy, [e[0] for e in cupy.events if e[0] in ('compile', 'load')]

    first, loads = process(q, k, v, landmarks)
    assert loads == ['compile'] and list(cuda.loaded_from.values()) == ['compiled']
    second, loads = process(q, k, v, landmarks)
    assert loads == ['load'] and list(cuda.loaded_from.values()) == ['cached']
    assert [e[1] for e in launches(second)] == [e[1] for e in launches(first)]
    assert process(*(t.half() for t in (q, k, v, landmarks)))[1] == ['compile']
    assert process(q, k, v, landmarks)[1] == ['load']
    monkeypatch.setenv('CUPY_CACHE_IN_MEMORY', '1')
    assert process(q, k, v, landmarks)[1] == ['compile']
    assert list(cuda.loaded_from.values()) == ['compiled']


@pytest.mark.parametrize('version, later', [('13.6.0', 'compile'), ('14.2.0', 'load')])
def test_the_fake_keys_modules_with_name_expressions_as_cupy_does(version, later):
    """Name expressions: compiled in every process up to CuPy 14.0, cached by them from 14.1."""
    disk, code = {}, 'template <int K> __global__ void f() {}\nextern "C" __global__ void g() {}'
    for expected in ('compile', later):
        cupy = fake_cupy.FakeCupy(disk=disk, version=version)
        module = cupy.RawModule(code=code, options=('-DX',), name_expressions=['f<1>'])
        assert module.get_function('f<1>').kernel.name == fake_cupy.lowered('f<1>')
        assert [e[0] for e in cupy.events] == [expected]
    plain = fake_cupy.FakeCupy(disk=disk, version=version).RawModule(code=code, options=('-DX',))
    assert plain.get_function('g').kernel.name == 'g'
    with pytest.raises(RuntimeError, match='CUDA_ERROR_NOT_FOUND'):
        plain.get_function(fake_cupy.lowered('f<1>') if later == 'load' else 'f<1>')


def test_a_module_exposes_the_entry_points_of_its_element_type_only():
    """One C entry point per stage and kernel function where the host defines NYS_ELEMENT."""
    variant, source = cuda_plan.VARIANT_BY_NAME['dv32_tb32'], cuda.load_source()
    lines = fake_cupy.active_lines(source, cuda.compile_options(variant, 'lap_bf16'))
    entries = fake_cupy._ENTRY.findall('\n'.join(lines))
    assert sorted(entries) == sorted({cuda_plan.entry_name(stage, kind) for stage in cuda.STAGES
                                      for kind in cuda.KERNEL_CODES.values()})
    assert not fake_cupy._ENTRY.findall('\n'.join(fake_cupy.active_lines(source, variant.defines)))
    with pytest.raises(RuntimeError, match='tile geometry'):
        fake_cupy.active_lines(source, cuda.NVRTC_OPTIONS)


def test_one_check_per_call(fake, monkeypatch):
    """not_supported checks and loads once; the op's body and backward reuse that check."""
    q, k, v, landmarks = (t.detach().requires_grad_() for t in attention_inputs())
    nystrom_attention(q, k, v, landmarks)
    fits, loads = [], []
    fit, ensure = cuda.fit, cuda.ensure_loaded
    monkeypatch.setattr(cuda, 'fit', lambda *args: fits.append(1) or fit(*args))
    monkeypatch.setattr(cuda, 'ensure_loaded', lambda *args: loads.append(1) or ensure(*args))
    nystrom_attention(q, k, v, landmarks).sum().backward()
    assert fits == [] and loads == []
    nystrom_attention(q[:, :, :40], k[:, :, :40], v[:, :, :40], landmarks).sum().backward()
    assert fits == [1] and loads == [1]
