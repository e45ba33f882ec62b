"""LaplacianAttention module: wiring, shapes, AMP, validation."""
import copy as copy_module

import pytest
import torch
import torch.nn.functional as F
from _attention_helpers import dense_attention_module, dense_local_term, finite

from lapformer_mm.analysis.landmark_solve import solve_report
from lapformer_mm.models.attention import LaplacianAttention
from lapformer_mm.ops import nystrom_attention, pool_landmarks


@pytest.mark.parametrize('qk_shared', [True, False])
@pytest.mark.parametrize('hw', [(9, 11), (3, 5), (1, 1)])
def test_forward_matches_manual_composition(qk_shared, hw):
    torch.manual_seed(0)
    module = LaplacianAttention(32, 2, qk_shared=qk_shared).double().eval()
    x = torch.randn(2, hw[0] * hw[1], 32, dtype=torch.float64)
    out = module(x, hw)
    assert out.shape == x.shape
    torch.testing.assert_close(out, dense_attention_module(module, x, hw, qk_shared, 7))


@pytest.mark.parametrize('copy', ['built', 'deepcopy', 'double', 'contiguous', 'assign'])
def test_gradients_reach_every_parameter_with_its_strides(copy):
    """DistributedDataParallel warns when a gradient's strides differ from its parameter's."""
    module = LaplacianAttention(32, 4, qk_shared=False)
    dtype = torch.float32
    if copy == 'deepcopy':
        module = copy_module.deepcopy(module)
    elif copy == 'double':
        module, dtype = module.double(), torch.float64
    elif copy == 'contiguous':
        module = module.to(memory_format=torch.contiguous_format)
    elif copy == 'assign':  # e.g. a checkpoint saved with contiguous weights
        state = {k: v.clone(memory_format=torch.contiguous_format).contiguous()
                 for k, v in module.state_dict().items()}
        state['local.weight'] = torch.randn(32, 1, 3, 3)
        module.load_state_dict(state, assign=True)
        assert torch.equal(module.local.weight, state['local.weight'])
    module(torch.randn(2, 64, 32, dtype=dtype), (8, 8)).square().mean().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert p.grad.stride() == p.stride(), name


@pytest.mark.parametrize('kernel', ['laplacian', 'gaussian'])
@pytest.mark.parametrize('solver', ['newton', 'exact', 'cg'])
def test_kernels_and_solvers_match_the_dense_module(kernel, solver):
    """Kernel, solver and normalisation options give the dense fp64 attention they name."""
    torch.manual_seed(0)
    module = LaplacianAttention(16, 1, kernel=kernel, solver=solver, normalize='none', lam=6.0,
                                attn_drop=0.1, proj_drop=0.1).double().eval()
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    expected = dense_attention_module(module, x, (5, 6), qk_shared=True, landmark_grid=7,
                                      kernel=kernel, normalize='none', lam=6.0)
    torch.testing.assert_close(module(x, (5, 6)), expected, rtol=1e-6, atol=1e-8)


# Relative L2 tolerances of autocast against fp32, measured on this test's input
# (fp16: output 8e-4, grads 1.5e-2; bf16: output 6e-3, grads 4e-2) with ~2.5x margin.
AMP_TOL = {torch.float16: (5e-3, 5e-2), torch.bfloat16: (2e-2, 1e-1)}


def _rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('qk_shared', [True, False])
def test_autocast_matches_fp32(dtype, qk_shared):
    torch.manual_seed(0)
    module = LaplacianAttention(64, 2, qk_shared=qk_shared)
    x = torch.randn(2, 196, 64)
    x32 = x.clone().requires_grad_()
    ref = module(x32, (14, 14))
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    xa = x.clone().requires_grad_()
    with torch.autocast('cpu', dtype=dtype):
        out = module(xa, (14, 14))
    assert out.dtype == dtype
    out.float().square().sum().backward()
    out_tol, grad_tol = AMP_TOL[dtype]
    assert torch.isfinite(out).all() and torch.isfinite(xa.grad).all()
    assert _rel(out, ref) < out_tol
    assert _rel(xa.grad, x32.grad) < grad_tol
    for p, g in zip(module.parameters(), ref_grads):
        assert torch.isfinite(p.grad).all() and _rel(p.grad, g) < grad_tol


def test_attention_core_runs_in_fp32_under_autocast():
    q, k, v = (torch.randn(1, 2, 49, 8) for _ in range(3))
    landmarks = pool_landmarks(k, (7, 7), 3)
    half = [t.half() for t in (q, k, v, landmarks)]
    with torch.autocast('cpu', dtype=torch.float16):
        out = nystrom_attention(*half)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, nystrom_attention(*[t.float() for t in half]).half(),
                               rtol=0, atol=0)


def test_authors_start_is_selectable_end_to_end():
    """ns_init reaches the solver from LaplacianAttention: one iteration from each start differs."""
    torch.manual_seed(0)
    x = torch.randn(1, 64, 32)
    outs = {}
    for init in ('identity', 'authors'):
        torch.manual_seed(1)
        attn = LaplacianAttention(32, 1, iters=1, ns_init=init).eval()
        with torch.no_grad():
            outs[init] = attn(x, (8, 8))
    assert not torch.allclose(outs['identity'], outs['authors'], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize('kwargs, exc, name', [
    (dict(dim=30, num_heads=4), ValueError, 'num_heads'),
    # Truthy stand-ins: qkv_bias='no' turned the bias on.
    (dict(qkv_bias='no'), TypeError, 'qkv_bias'),
    (dict(qk_shared=1), TypeError, 'qk_shared'),
    (dict(global_term='no'), TypeError, 'global_term'),
    (dict(landmark_grid=0), ValueError, 'landmark_grid'),
    (dict(landmark_grid=2.5), TypeError, 'landmark_grid'),
    # A negative rate dropped nothing.
    (dict(attn_drop=-0.1), ValueError, 'attn_drop'),
    # The attention options' own rules (AttentionOptions) reach the module's callers.
    (dict(lam=0), ValueError, 'lam'),
    (dict(ns_init='random'), ValueError, 'ns_init'),
    (dict(newton_iters=3), TypeError, 'newton_iters'),
])
def test_attention_arguments_rejected_with_named_errors(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        LaplacianAttention(**dict(dict(dim=32, num_heads=2), **kwargs))


def test_forward_does_not_revalidate_the_options(monkeypatch):
    """The options are checked at construction, once."""
    import lapformer_mm.models.attention as attention

    module = LaplacianAttention(32, 2, qk_shared=False, solver='cg', iters=5).eval()

    def fail(*args, **kwargs):
        raise AssertionError('constructor argument checked again in forward')

    for name in ('AttentionOptions', 'check_bool', 'check_int', 'check_probability'):
        monkeypatch.setattr(attention, name, fail)
    with torch.no_grad():
        assert module(torch.randn(1, 20, 32), (4, 5)).shape == (1, 20, 32)


@pytest.mark.parametrize('qk_shared', [True, False])
def test_torch_compile_traces_one_graph_equal_to_eager(qk_shared):
    """fullgraph=True traces without a graph break; values and input gradient bit-equal."""
    torch.manual_seed(0)
    module = LaplacianAttention(64, 2, qk_shared=qk_shared).train()
    x = torch.randn(2, 63, 64, requires_grad=True)
    ref = module(x, (7, 9))
    ref_grad, = torch.autograd.grad(ref.square().sum(), x)
    compiled = torch.compile(module, backend='aot_eager', fullgraph=True)
    out = compiled(x, (7, 9))
    grad, = torch.autograd.grad(out.square().sum(), x)
    assert torch.equal(out, ref) and torch.equal(grad, ref_grad)


def test_torch_compile_before_any_eager_call_traces_one_graph(monkeypatch):
    """The backends load when the module is built, not inside the first trace."""
    from lapformer_mm.ops.backends import cpu
    monkeypatch.setattr(cpu, '_LOADED', [])
    torch.manual_seed(0)
    module = LaplacianAttention(32, 2).eval()
    compiled = torch.compile(module, backend='aot_eager', fullgraph=True)
    x = torch.randn(1, 20, 32)
    with torch.no_grad():
        assert torch.equal(compiled(x, (4, 5)), module(x, (4, 5)))


def test_global_term_false_leaves_the_local_term_alone():
    """The ablations' control: proj(dwconv3x3(v)), no Nyström term; the default keeps it."""
    torch.manual_seed(0)
    module = LaplacianAttention(32, 2).eval()
    control = LaplacianAttention(32, 2, global_term=False).eval()
    control.load_state_dict(module.state_dict())
    x = torch.randn(2, 6 * 5, 32)
    with torch.no_grad():
        qkv = F.linear(x, module.qkv.weight, module.qkv.bias)
        v = qkv.chunk(module.qkv.out_features // 32, dim=-1)[-1]  # [q, v] or [q, k, v]
        local_only = module.proj(dense_local_term(module, v, (6, 5)))
        torch.testing.assert_close(control(x, (6, 5)), local_only, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(module(x, (6, 5)), local_only)
        explicit = LaplacianAttention(32, 2, global_term=True).eval()
        explicit.load_state_dict(module.state_dict())
        assert torch.equal(explicit(x, (6, 5)), module(x, (6, 5)))
    assert 'global_term=False' in repr(control) and 'global_term' not in repr(module)


@pytest.mark.parametrize('hw', [(1, 1), (1, 5), (2, 3), (6, 6), (7, 1)])
def test_token_grid_smaller_than_landmark_grid_clips_landmarks_and_stays_finite(hw):
    """N <= 49 (N = 1 included): m clips to the grid, whitening over N = 1 stays finite."""
    torch.manual_seed(0)
    attn = LaplacianAttention(32, 2, landmark_grid=7)
    x = torch.randn(2, hw[0] * hw[1], 32, requires_grad=True)
    out = attn(x, hw)
    out.square().sum().backward()
    assert finite(out, x.grad, *(p.grad for p in attn.parameters()))
    report = solve_report(attn, x.detach(), hw)
    assert report.num_landmarks == min(7, hw[0]) * min(7, hw[1])
    assert report.residual < 1e-3
