"""Nyström attention: exact limit, gradients, injectivity, batch independence, validation."""

import pytest
import torch
from _attention_helpers import (
    dense_attention,
    dense_average,
    dense_injective,
    dense_l1_kernel,
    finite,
    nearly_equal_columns_cases,
)
from _property_strategies import PROPERTY, attention_cases, run_attention
from hypothesis import given

from lapformer_mm.ops import (
    AttentionOptions,
    attention,
    injective_normalize,
    nystrom_attention,
    pool_landmarks,
    reference,
    resolve_impl,
)
from lapformer_mm.ops.backends import cpu, cuda


def qkv(shape, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3))


@pytest.mark.parametrize('normalize', ['injective', 'none'])
def test_exact_limit_equals_dense_attention(normalize):
    hw = (4, 5)
    q, k, v = qkv((2, 3, 20, 6))
    # A landmark grid as large as the input grid pools nothing: L = all keys.
    landmarks = pool_landmarks(k, hw, grid=5)
    torch.testing.assert_close(landmarks, k, rtol=0, atol=1e-15)
    out = nystrom_attention(q, k, v, landmarks, eps=0.0, solver='exact',
                            normalize=normalize, lam=4.0)
    dense = dense_l1_kernel(q, k, 4.0)
    if normalize == 'injective':
        dense = dense_injective(dense, 1e-5)
    expected = dense_average(dense, v)
    assert ((out - expected).norm() / expected.norm()) < 1e-6


def test_newton_solver_approaches_exact_solver():
    q, k, v = qkv((1, 2, 49, 8), seed=1)
    landmarks = pool_landmarks(k, (7, 7), grid=3)
    exact = nystrom_attention(q, k, v, landmarks, solver='exact')
    newton = nystrom_attention(q, k, v, landmarks, solver='newton', iters=40)
    cg = nystrom_attention(q, k, v, landmarks, solver='cg')
    torch.testing.assert_close(newton, exact, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(cg, exact, rtol=1e-7, atol=1e-7)


def test_pool_landmarks_averages_blocks_and_clips_grid():
    t = torch.arange(2 * 1 * 16 * 1, dtype=torch.float64).view(2, 1, 16, 1)
    pooled = pool_landmarks(t, (4, 4), grid=2)
    expected = t.view(2, 1, 2, 2, 2, 2).mean((3, 5)).reshape(2, 1, 4, 1)
    torch.testing.assert_close(pooled, expected)
    assert pool_landmarks(torch.zeros(1, 2, 15, 3), (3, 5), grid=7).shape == (1, 2, 15, 3)
    assert pool_landmarks(torch.zeros(1, 2, 99, 3), (9, 11), grid=7).shape == (1, 2, 49, 3)


def test_injective_normalize_matches_definition_and_gradcheck():
    C = torch.rand(2, 3, 9, 4, dtype=torch.float64)
    torch.testing.assert_close(injective_normalize(C, 1e-3), dense_injective(C, 1e-3))
    C = C[:1, :1].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda c: injective_normalize(c, 1e-3), (C,))


def test_fp32_whitening_of_nearly_equal_rows_is_within_1e6_of_fp64():
    """Rows 0.7 ± 1e-4 (every query nearly equally similar to every landmark): a one-pass fp32
    centring leaves its mean's rounding in each row, which s ≈ 316 scales to 2.7e-4; centred
    twice, 1.4e-7 (issue 34)."""
    gen = torch.Generator().manual_seed(0)
    C = (0.7 + 1e-4 * torch.randn(2, 3, 512, 49, generator=gen, dtype=torch.float64)).float()
    expected = dense_injective(C.double(), 1e-5)
    error = (injective_normalize(C).double() - expected).abs().max() / expected.abs().max()
    assert error < 1e-6


@pytest.mark.parametrize('impl', ['reference', 'cpu'])
def test_fp32_attention_of_nearly_equal_kernel_columns_stays_near_fp64(impl):
    """Smooth tokens and their pooled landmarks, values offset by 3: every key nearly equally
    similar to every landmark, so the output reads only k(k, L)ᵀ v's small landmark-to-landmark
    differences. A plain fp32 N-sum for it and an uncentred product left 2.4e-6–4.3e-6 here
    (mean 3.4e-6 over the seeds; the plain N-sum alone, 1.9e-6); the centred forms 0.7e-6–1.0e-6
    (mean 0.8e-6–0.9e-6; issue 34)."""
    if impl == 'cpu' and not cpu.available():
        pytest.skip('CPU kernels not built')
    errors = []
    for q, v, landmarks, expected in nearly_equal_columns_cases():
        out = nystrom_attention(q.float(), q.float(), v.float(), landmarks.float(), impl=impl)
        errors.append(float((out.double() - expected).abs().max() / expected.abs().max()))
    assert sum(errors) / len(errors) < 1.3e-6, errors


@pytest.mark.parametrize('kernel', ['laplacian', 'gaussian'])
@pytest.mark.parametrize('normalize,solver', [('injective', 'newton'), ('none', 'exact'),
                                              ('injective', 'cg')])
def test_attention_gradients_pass_gradcheck_in_fp64(kernel, normalize, solver):
    q, k, v = qkv((1, 1, 6, 2), seed=2)
    landmarks = k[..., ::2, :].clone()
    inputs = tuple(t.requires_grad_() for t in (q, k, v, landmarks))
    assert torch.autograd.gradcheck(
        lambda *a: nystrom_attention(*a, kernel=kernel, normalize=normalize, solver=solver,
                                     iters=40, eps=0.1, lam=2.0), inputs)


def test_distinct_queries_give_distinct_attention_rows():
    q, k, _ = qkv((1, 1, 64, 8), seed=3)
    landmarks = pool_landmarks(k, (8, 8), grid=4)
    # Attention rows A = Z · P⁻¹ · Ckᵀ (N×N), obtained by attending to v = I.
    eye = torch.eye(64, dtype=torch.float64).view(1, 1, 64, 64)
    rows = nystrom_attention(q, k, eye, landmarks, solver='exact')[0, 0]
    gaps = torch.cdist(rows, rows) + torch.eye(64, dtype=torch.float64)
    assert gaps.min() > 1e-4
    # Queries at equal distance from every landmark map to the same row only
    # when they are equal: a shifted copy of one query gets a different row.
    shifted = torch.cat([q, q[..., :1, :] + 0.3], dim=-2)
    rows = nystrom_attention(shifted, torch.cat([k, k[..., :1, :]], -2),
                             torch.eye(65, dtype=torch.float64).view(1, 1, 65, 65),
                             landmarks, solver='exact')[0, 0]
    assert (rows[0] - rows[-1]).norm() > 1e-4


def test_output_of_a_sample_does_not_depend_on_the_others():
    q, k, v = qkv((3, 2, 25, 4), seed=4)
    landmarks = pool_landmarks(k, (5, 5))
    together = nystrom_attention(q, k, v, landmarks)
    alone = nystrom_attention(q[:1], k[:1], v[:1], landmarks[:1])
    torch.testing.assert_close(together[:1], alone, rtol=1e-12, atol=1e-12)
    scaled = nystrom_attention(torch.cat([q[:1], 100 * q[1:]]), torch.cat([k[:1], -k[1:]]),
                               v, torch.cat([landmarks[:1], 7 * landmarks[1:]]))
    torch.testing.assert_close(scaled[:1], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('kwargs,exc,match', [
    (dict(lam=0.0), ValueError, r'lam=0\.0 must be finite and > 0'),
    (dict(lam=float('nan')), ValueError, 'lam=nan'),
    (dict(eps=-0.1), ValueError, r'eps=-0\.1 must be finite and >= 0'),
    (dict(eps=float('inf')), ValueError, 'eps=inf'),
    (dict(whiten_eps=-1.0), ValueError, 'whiten_eps=-1.0'),
    (dict(solver='lu'), ValueError, "solver='lu'.*'newton', 'exact', 'cg'"),
    (dict(kernel='cosine'), ValueError, "kernel='cosine'.*'laplacian', 'gaussian'"),
    (dict(normalize='l2'), ValueError, "normalize='l2'.*'injective', 'none'"),
    (dict(iters=-3), ValueError, 'iters=-3'),
    (dict(lamda=2), TypeError, 'lamda'),
])
def test_attention_rejects_bad_arguments_naming_them(kwargs, exc, match):
    q, k, v = qkv((1, 1, 4, 2))
    with pytest.raises(exc, match=match):
        nystrom_attention(q, k, v, k[..., :2, :], **kwargs)


def test_attention_rejects_operands_that_would_broadcast():
    q, k, v = qkv((1, 2, 4, 3))
    for args in ((q, k[..., :3, :], v, k), (q, k, v[..., :3, :], k), (q, k, v, k[..., :2]),
                 (q, k, v, k[:, :1])):
        with pytest.raises(ValueError, match='nystrom_attention'):
            nystrom_attention(*args)


@pytest.mark.parametrize('impl', ['reference', 'cpu'])
def test_empty_sizes_give_empty_outputs_and_zero_width_the_mean(impl):
    """No batch or no tokens: an empty output on every backend; keys of width 0 are all
    equally similar, so every query gets the mean value."""
    for shape in ((0, 2, 6, 3), (1, 2, 0, 3)):
        q, v = torch.randn(shape), torch.randn(*shape[:3], 5)
        assert nystrom_attention(q, q, v, torch.randn(*shape[:2], 4, 3), impl=impl).shape == \
            (*shape[:3], 5)
    q, v = torch.randn(1, 2, 6, 0), torch.randn(1, 2, 6, 5)
    out = nystrom_attention(q, q, v, q[..., :4, :], impl=impl)
    torch.testing.assert_close(out, v.mean(-2, keepdim=True).expand_as(out))


def test_resolve_impl_takes_the_first_backend_without_reasons(monkeypatch):
    monkeypatch.delenv('LAPFORMER_OPS', raising=False)
    q = torch.randn(1, 2, 12, 4)
    lm = pool_landmarks(q, (3, 4), 2)

    def impl(**options):
        return resolve_impl(q, q, q, lm, AttentionOptions(**options))
    monkeypatch.setattr(cpu, 'available', lambda: False)
    monkeypatch.setattr(cuda, 'available', lambda: False)
    assert impl() == 'reference' and impl(impl='reference') == 'reference'
    with pytest.raises(RuntimeError, match="impl='cupy' cannot run this call: it runs on cuda "
                                           'tensors, got tensors on cpu'):
        impl(impl='cupy')
    with pytest.raises(RuntimeError, match="impl='cpu' cannot run this call: it is not usable"):
        impl(impl='cpu')
    with pytest.raises(ValueError, match="impl='triton'"):
        AttentionOptions(impl='triton')
    monkeypatch.setenv('LAPFORMER_OPS', 'reference')
    assert AttentionOptions().impl == 'reference'
    monkeypatch.setenv('LAPFORMER_OPS', 'cupy')
    with pytest.raises(RuntimeError, match='LAPFORMER_OPS'):
        nystrom_attention(q, q, q, lm)
    monkeypatch.setenv('LAPFORMER_OPS', 'fast')
    with pytest.raises(ValueError, match="LAPFORMER_OPS='fast'"):
        AttentionOptions()
    monkeypatch.delenv('LAPFORMER_OPS')
    # An available backend that reports reasons: impl=None warns once and takes the
    # reference; the explicit impl raises the reasons.
    monkeypatch.setattr(cpu, 'available', lambda: True)
    assert impl() == 'cpu' and impl(impl='cpu') == 'cpu'
    monkeypatch.setattr(cpu, 'not_supported', lambda *args: ['a reason'])
    attention._warn_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"'cpu' attention backend does not support this "
                                            r'call \(a reason\)'):
        assert impl() == 'reference'
    with pytest.raises(RuntimeError, match="impl='cpu' cannot run this call: a reason"):
        impl(impl='cpu')


@pytest.mark.parametrize('dtype', [torch.float16, torch.float32])
def test_tied_keys_evaluate_the_query_kernel_once(monkeypatch, dtype):
    """k is q: k(q, L) serves as k(k, L), also when the inputs are cast to fp32 first."""
    calls = []
    original = reference.similarity

    def counting(x, y, *args):
        calls.append(x.shape[-2])
        return original(x, y, *args)
    monkeypatch.setattr(reference, 'similarity', counting)
    q = torch.randn(1, 2, 12, 4).to(dtype)
    nystrom_attention(q, q, torch.randn(1, 2, 12, 4).to(dtype), pool_landmarks(q, (3, 4), 2),
                      impl='reference')
    assert calls == [12, 4]  # k(q, L), then k(L, L)


@pytest.mark.parametrize('solver', ['newton', 'exact'])
def test_identical_landmarks_newton_stays_finite_and_exact_names_a_singular_matrix(solver):
    """eps = 0 makes P = J exactly singular: newton stays finite, exact names the problem."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 30, 16, requires_grad=True)
    v = torch.randn(2, 2, 30, 16, requires_grad=True)
    landmarks = q.mean(-2, keepdim=True).expand(2, 2, 25, 16)
    out = nystrom_attention(q, q, v, landmarks, solver=solver, eps=0.01)
    out.square().sum().backward()
    assert finite(out, q.grad, v.grad)
    if solver == 'exact':
        with pytest.raises(ValueError, match=r'singular .*use eps > 0'):
            nystrom_attention(q, q, v, landmarks, solver=solver, eps=0.0)
    else:
        assert finite(nystrom_attention(q, q, v, landmarks, solver=solver, eps=0.0))


@pytest.mark.parametrize('scale', [1e-4, 1e-2, 1.0, 1e2, 1e4])
@pytest.mark.parametrize('normalize', ['injective', 'none'])
def test_feature_scales_finite_forward_and_backward(scale, normalize):
    torch.manual_seed(0)
    q = (torch.randn(1, 2, 48, 16) * scale).requires_grad_()
    k = (torch.randn(1, 2, 48, 16) * scale).requires_grad_()
    v = torch.randn(1, 2, 48, 16).requires_grad_()
    out = nystrom_attention(q, k, v, pool_landmarks(k, (6, 8), 7), normalize=normalize)
    out.square().sum().backward()
    assert finite(out, q.grad, k.grad, v.grad)
    if scale >= 1e2:
        # Every kernel value underflows (||q - L||_1 / lam >> 100): every query's weights
        # are uniform, and the attention term is the mean value.
        torch.testing.assert_close(out, v.mean(-2, keepdim=True).expand_as(out))


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_low_precision_inputs_at_extreme_scales_compute_in_fp32(dtype):
    """fp16/bf16 q, k, v at 1e-4 and 1e3: computed in fp32, the result cast back is finite."""
    torch.manual_seed(0)
    for scale in (1e-4, 1e3):
        q = (torch.randn(1, 2, 36, 16) * scale).to(dtype).requires_grad_()
        v = torch.randn(1, 2, 36, 16).to(dtype).requires_grad_()
        out = nystrom_attention(q, q, v, pool_landmarks(q, (6, 6), 7))
        assert out.dtype == dtype
        out.float().square().sum().backward()
        assert finite(out, q.grad, v.grad)


def _near_identical_inputs(spread, seed=0, n=400, m=49, d=32):
    """q = k, v and landmarks all within ``spread`` of one point: cond(P) up to ~100 m."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 1, 1, d, generator=gen, dtype=torch.float64)
    q = base + spread * torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64)
    landmarks = base + spread * torch.randn(1, 1, m, d, generator=gen, dtype=torch.float64)
    return q, v, landmarks


@pytest.mark.parametrize('spread', [1e-4, 1e-3, 1e-2])
def test_fp32_default_newton_within_3x_of_an_fp32_direct_solve(spread):
    """Near-identical landmarks (cond(P) 1.3e3-4.8e3): with the refinement step (the default)
    fp32 Newton–Schulz is within 3x of an fp32 direct solve."""
    q, v, landmarks = _near_identical_inputs(spread)
    expected = dense_attention(q, q, v, landmarks)

    def error(**options):
        out = nystrom_attention(q.float(), q.float(), v.float(), landmarks.float(), **options)
        return ((out.double() - expected).norm() / expected.norm()).item()
    assert error() <= 3 * error(solver='exact')


def test_zero_whiten_eps_on_a_one_by_one_grid_is_finite():
    """One landmark: every query feature column is constant, its variance 0."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 16, 8, requires_grad=True)
    v = torch.randn(2, 2, 16, 8, requires_grad=True)
    landmarks = pool_landmarks(q, (4, 4), 1)
    out = nystrom_attention(q, q, v, landmarks, whiten_eps=0.0)
    out.square().sum().backward()
    assert finite(out, q.grad, v.grad)
    # Z = 0 + 1/m with m = 1: the output is the solved context, the same for every query.
    torch.testing.assert_close(out, out[..., :1, :].expand_as(out))


@PROPERTY
@given(attention_cases())
def test_nystrom_attention_finite_output_and_gradients(inputs):
    q, k, v, hw, options = inputs
    leaves = [t.requires_grad_() for t in {id(t): t for t in (q, k, v)}.values()]
    out = run_attention(q, k, v, hw, options)
    assert out.shape == v.shape and finite(out)
    (out * torch.randn_like(out)).sum().backward()
    assert finite(*(t.grad for t in leaves))


@PROPERTY
@given(attention_cases(solvers=('cg', )))
def test_nystrom_attention_cg_finite_output_and_gradients(inputs):
    q, k, v, hw, options = inputs
    leaves = [t.requires_grad_() for t in {id(t): t for t in (q, k, v)}.values()]
    out = run_attention(q, k, v, hw, options)
    assert finite(out)
    (out * torch.randn_like(out)).sum().backward()
    assert finite(*(t.grad for t in leaves))
