"""The fused attention op on a GPU (tools/gpu_check.sh). Every value test asserts which
kernels ran (``ran``), so a silent fall-back to the reference cannot pass."""
import warnings

import pytest
import torch
from _attention_helpers import dense_attention, dense_attention_grads, finite
from _property_strategies import attention_cases
from hypothesis import given, settings

pytestmark = pytest.mark.gpu


@pytest.fixture
def ran(monkeypatch):
    """The kernels launched (names, variant names), in order."""
    from lapformer_mm.ops.backends import cuda
    record = []
    original = cuda.launch

    def launch(name, variant, *args, **kwargs):
        record.append((name, variant.name))
        return original(name, variant, *args, **kwargs)
    monkeypatch.setattr(cuda, 'launch', launch)
    return record


def stages(record, dtype=torch.float32, kind=0, backward=True):
    from lapformer_mm.ops.backends import cuda, cuda_plan
    names = cuda.STAGES if backward else cuda_plan.FORWARD
    return [cuda_plan.kernel_name(s, cuda_plan.ELEMENT_TYPES[dtype], kind) for s in names]


def assert_rounded(got, expected, dtype, fp32_tol):
    """|got - expected| <= u |expected| + fp32_tol max|expected|: the fp32 computation's
    error, then one rounding to ``dtype`` (unit roundoff u = eps / 2; 0 for fp32)."""
    got, expected = got.detach().double().cpu(), expected.double().cpu()
    u = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    scale = expected.abs().max().item() or 1.0
    bound = u * expected.abs() * 1.001 + fp32_tol * scale
    excess = ((got.double() - expected.double()).abs() - bound).max().item()
    assert excess <= 0, excess


def attention_inputs(batch, heads, hw, d, dv, tied, dtype, seed=0, strided=False, grid=7):
    from lapformer_mm.ops import pool_landmarks
    gen = torch.Generator(device='cuda').manual_seed(seed)
    n = hw[0] * hw[1]
    if strided:
        qkv = torch.randn(batch, n, 3 * heads * d, generator=gen, device='cuda')
        q, k, v = (t.view(batch, n, heads, d).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    else:
        q, k = (torch.randn(batch, heads, n, d, generator=gen, device='cuda') for _ in range(2))
        v = torch.randn(batch, heads, n, dv, generator=gen, device='cuda')
    if tied:
        k = q
    landmarks = pool_landmarks(k, hw, grid)
    return tuple(t.to(dtype) for t in (q, k, v, landmarks))


def grads_of(q, k, v, landmarks, tied, grad, **options):
    from lapformer_mm.ops import nystrom_attention
    leaves = [t.detach().clone().requires_grad_() for t in (q, v, landmarks)]
    qa, va, la = leaves
    ka = qa if tied else k.detach().clone().requires_grad_()
    out = nystrom_attention(qa, ka, va, la, **options)
    wrt = [qa, va, la] if tied else [qa, ka, va, la]
    return (out,) + torch.autograd.grad(out, wrt, grad.to(out.dtype))


def dense_grads(q, k, v, landmarks, tied, grad, **options):
    """The dense fp64 reference, on the CPU (its ridge is a CPU tensor)."""
    cpu = [None if t is None else t.cpu() for t in (q, k, v, landmarks, grad)]
    out, grads = dense_attention_grads(*cpu[:4], cpu[4], tied, **options)
    return (out,) + grads


def assert_close_scaled(got, expected, tol):
    got, expected = got.detach().double().cpu(), expected.double().cpu()
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('tied', [True, False])
def test_fused_matches_dense_fp64(ran, dtype, tied):
    """Stage 1 of Tiny at 224 (N = 3136, m = 49, d = 32), strided head views; the 16-bit
    outputs and gradients within one rounding of the fp32 result."""
    q, k, v, landmarks = attention_inputs(2, 2, (56, 56), 32, 32, tied, dtype, strided=True)
    grad = torch.randn(2, 2, 3136, 32, device='cuda', dtype=torch.float64).to(dtype)
    got = grads_of(q, k, v, landmarks, tied, grad, impl='cupy')
    assert [name for name, _ in ran] == stages(ran, dtype)
    assert all(t.dtype == dtype for t in got)
    for g, e in zip(got, dense_grads(q, k, v, landmarks, tied, grad)):
        assert_rounded(g, e, dtype, 5e-5 if g is got[0] else 5e-4)


@pytest.mark.parametrize('kernel, lam', [('laplacian', 4.0), ('gaussian', 12.0)])
@pytest.mark.parametrize('normalize', ['injective', 'none'])
@pytest.mark.parametrize('ns_refine', [True, False])
@pytest.mark.parametrize('ns_init', ['identity', 'authors'])
@pytest.mark.parametrize('tied', [True, False])
def test_gradients_of_every_option_the_fused_path_takes(ran, kernel, lam, normalize, ns_refine,
                                                        ns_init, tied):
    """Enough Newton-Schulz steps that the dense fp64 direct solve is the truth for every one."""
    q, k, v, landmarks = attention_inputs(1, 2, (14, 15), 32, 32, tied, torch.float32, seed=8)
    grad = torch.randn(1, 2, 210, 32, device='cuda', dtype=torch.float64)
    options = dict(kernel=kernel, lam=lam, normalize=normalize)
    got = grads_of(q, k, v, landmarks, tied, grad, impl='cupy', iters=40, ns_refine=ns_refine,
                   ns_init=ns_init, **options)
    assert [name for name, _ in ran] == stages(ran, kind=0 if kernel == 'laplacian' else 1)
    for g, e in zip(got, dense_grads(q, k, v, landmarks, tied, grad, **options)):
        assert_close_scaled(g, e, 5e-5 if g is got[0] else 5e-4)


@pytest.mark.parametrize('kib, m_grid, dv', [(48, 7, 32), (64, 7, 32), (64, 8, 64),
                                             (100, 8, 64)])
def test_each_shared_memory_variant_on_the_device(ran, monkeypatch, kib, m_grid, dv):
    """A smaller device's plan forced on this one, each variant against the dense reference."""
    from lapformer_mm.ops.backends import cuda
    real = cuda.device_limits(torch.device('cuda'))
    monkeypatch.setattr(cuda, 'device_limits',
                        lambda device: real._replace(smem_optin=kib * 1024))
    plan = cuda.plan(m_grid * m_grid, dv, kib * 1024)
    q, k, v, landmarks = attention_inputs(2, 2, (24, 24), 32, dv, False, torch.float32, seed=9,
                                          grid=m_grid)
    grad = torch.randn(2, 2, 576, dv, device='cuda', dtype=torch.float64)
    got = grads_of(q, k, v, landmarks, False, grad, impl='cupy')
    assert ran and {variant for _, variant in ran} == {plan.variant.name}
    for g, e in zip(got, dense_grads(q, k, v, landmarks, False, grad)):
        assert_close_scaled(g, e, 5e-5 if g is got[0] else 5e-4)


def test_reruns_are_bit_equal_and_grid_limits_loop(ran):
    """70000 (batch, head) pairs exceed gridDim.y: the heads past 65,535 against dense too."""
    q, k, v, landmarks = attention_inputs(1, 70_000, (3, 3), 8, 8, False, torch.float32, seed=1)
    grad = torch.randn(1, 70_000, 9, 8, device='cuda', dtype=torch.float64)
    first = grads_of(q, k, v, landmarks, False, grad, impl='cupy')
    assert [name for name, _ in ran] == stages(ran)
    again = grads_of(q, k, v, landmarks, False, grad, impl='cupy')
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for heads in (slice(0, 50), slice(65_530, 65_590), slice(69_950, 70_000)):
        expected = dense_grads(q[:, heads], k[:, heads], v[:, heads], landmarks[:, heads],
                               False, grad[:, heads])
        for g, e in zip(first, expected):
            assert_close_scaled(g[:, heads], e, 5e-4)


def test_inputs_written_late_on_a_side_stream_are_seen():
    """The kernels run on PyTorch's current stream, so they wait for the side stream's work."""
    from lapformer_mm.ops import nystrom_attention
    q, k, v, landmarks = attention_inputs(2, 2, (32, 32), 32, 32, False, torch.float32, seed=2)
    expected = nystrom_attention(q, k, v, landmarks, impl='cupy')
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        q2 = q * 1.0
        out = nystrom_attention(q2, k, v, landmarks, impl='cupy')
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, expected)


MMENGINE = 'needs mmengine: lapformer_mm.models imports it (tools/gpu_check.sh: bring it)'


def _module(qk_shared=True):
    pytest.importorskip('mmengine', reason=MMENGINE)
    from lapformer_mm.models.attention import LaplacianAttention
    torch.manual_seed(0)
    return LaplacianAttention(64, 2, qk_shared=qk_shared, impl='cupy').cuda()


def _warm_up(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)


@pytest.mark.parametrize('tied', [True, False])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_of_the_op_on_new_inputs_is_bit_equal_to_eager(tied, dtype):
    """Replaying the captured forward and backward on new inputs is bit-equal to eager (a
    launch on the legacy default stream would escape the capture)."""
    from lapformer_mm.ops import nystrom_attention
    static = [t.detach().clone().requires_grad_() for t in
              attention_inputs(2, 2, (20, 30), 32, 32, tied, dtype, seed=3)]
    if tied:
        static[1] = static[0]
    static_g = torch.randn(2, 2, 600, 32, device='cuda').to(dtype)
    leaves = [static[0], static[2], static[3]] if tied else static

    def step():
        out = nystrom_attention(*static, impl='cupy')
        return (out,) + torch.autograd.grad(out, leaves, static_g)
    _warm_up(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_results = step()
    for seed in (4, 5):
        fresh = attention_inputs(2, 2, (20, 30), 32, 32, tied, dtype, seed=seed)
        g = torch.randn(2, 2, 600, 32, device='cuda').to(dtype)
        with torch.no_grad():
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            static_g.copy_(g)
        graph.replay()
        replayed = [t.clone() for t in static_results]
        eager = grads_of(fresh[0], fresh[1], fresh[2], fresh[3], tied, g, impl='cupy')
        for a, b in zip(replayed, eager):
            assert torch.equal(a, b)


def test_cuda_graph_of_a_training_step_of_the_module():
    """Module forward + backward captured: replay matches eager to 1e-6 (GEMMs may differ)."""
    module = _module(qk_shared=False)
    hw = (24, 32)
    static_x = torch.randn(2, 768, 64, device='cuda', requires_grad=True)
    static_g = torch.randn(2, 768, 64, device='cuda')

    def step():
        module.zero_grad(set_to_none=True)
        static_x.grad = None
        module(static_x, hw).backward(static_g)
    _warm_up(step)
    graph = torch.cuda.CUDAGraph()
    module.zero_grad(set_to_none=True)
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_out = module(static_x, hw)
        static_out.backward(static_g)
    static_grads = (static_x.grad, module.qkv.weight.grad)
    gen = torch.Generator(device='cuda').manual_seed(6)
    x = torch.randn(2, 768, 64, device='cuda', generator=gen)
    g = torch.randn(2, 768, 64, device='cuda', generator=gen)
    with torch.no_grad():
        static_x.copy_(x)
        static_g.copy_(g)
    graph.replay()
    x_eager = x.clone().requires_grad_()
    out = module(x_eager, hw)
    eager = (out,) + torch.autograd.grad(out, (x_eager, module.qkv.weight), g)
    for a, b in zip((static_out,) + static_grads, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_gpu_kernels_per_attention_forward():
    """Our 4 kernels per forward, in order; the layer's ATen kernels only reported (how many
    cuBLAS or cuDNN launch is theirs)."""
    from torch.profiler import ProfilerActivity, profile

    from lapformer_mm.ops.backends import cuda_plan
    module = _module().eval()
    x = torch.randn(2, 768, 64, device='cuda')
    with torch.no_grad():
        module(x, (24, 32))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            module(x, (24, 32))
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and 'memcpy' not in e.name.lower() and 'memset' not in e.name.lower()]
    ours = [cuda_plan.stage_of(name) for name in kernels if name.startswith('nys_')]
    assert ours == list(cuda_plan.FORWARD), kernels
    others = [name for name in kernels if not name.startswith('nys_')]
    warnings.warn(f'kernels per LaplacianAttention forward: {len(ours)} ours + {len(others)} '
                  f'others: {others}')


def test_torch_compile_reduce_overhead_runs_the_kernels(ran):
    """torch.compile(mode='reduce-overhead'): the CUDA graph replays our kernels."""
    from lapformer_mm.ops.backends import cuda_plan
    module = _module().eval()
    x = torch.randn(2, 768, 64, device='cuda')
    with torch.no_grad():
        eager = module(x, (24, 32))
        compiled = torch.compile(module, mode='reduce-overhead')
        for _ in range(3):
            out = compiled(x, (24, 32))
    # The eager call's launches, then the compiled graph's warm-up (and capture) ones.
    forward = list(cuda_plan.FORWARD)
    assert [name.split('<')[0] for name, _ in ran[len(forward):]][:4] == forward
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None, derandomize=True)
@given(attention_cases(solvers=('newton', )))
def test_nystrom_attention_cupy_is_as_exact_as_the_reference(inputs):
    """Random shapes and feature scales: the fused error against dense fp64 at most 2x the
    reference path's plus 1e-6 of the largest value (emulation: 0.9-1.2x)."""
    from lapformer_mm.ops import nystrom_attention, pool_landmarks
    from lapformer_mm.ops.reference import DEFAULT_NS_ITERS
    q, k, v, hw, options = inputs
    options = dict(options)
    landmarks = pool_landmarks(k, hw, options.pop('grid'))
    expected = dense_attention(q, k, v, landmarks, kernel=options['kernel'],
                               normalize=options['normalize'], iters=DEFAULT_NS_ITERS)
    reference = nystrom_attention(q, k, v, landmarks, impl='reference', **options)
    qc, vc = q.cuda(), v.cuda()
    kc = qc if k is q else k.cuda()
    got = nystrom_attention(qc, kc, vc, landmarks.cuda(), impl='cupy', **options)
    assert finite(got)
    scale = expected.abs().max().item() or 1.0

    def error(out):
        return (out.detach().double().cpu() - expected).abs().max().item() / scale

    assert error(got) <= 2 * error(reference) + 1e-6, (error(got), error(reference))
