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
    randn,
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


def qkv(shape, seed=0):
    return randn(shape, shape, shape, seed=seed)


@pytest.mark.parametrize('normalize', ['injective', 'none'])
def test_exact_limit_equals_dense_attention(normalize):
    q, k, v = qkv((2, 3, 20, 6))
    # A landmark grid at least the input grid pools nothing (clipped to it): L = all keys.
    landmarks = pool_landmarks(k, (4, 5), grid=5)
    torch.testing.assert_close(landmarks, k, rtol=0, atol=1e-15)
    assert pool_landmarks(torch.zeros(1, 2, 99, 3), (9, 11), grid=7).shape == (1, 2, 49, 3)
    out = nystrom_attention(q, k, v, landmarks, eps=0.0, solver='exact', normalize=normalize)
    dense = dense_l1_kernel(q, k, 4.0)
    expected = dense_average(dense_injective(dense, 1e-5) if normalize == 'injective' else dense,
                             v)
    assert ((out - expected).norm() / expected.norm()) < 1e-6


def test_injective_normalize_matches_definition_and_gradcheck():
    C = torch.rand(2, 3, 9, 4, dtype=torch.float64)
    torch.testing.assert_close(injective_normalize(C, 1e-3), dense_injective(C, 1e-3))
    C = C[:1, :1].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda c: injective_normalize(c, 1e-3), (C,))
    # Rows 0.7 ± 1e-4 in fp32: centred once, the mean's rounding times s ≈ 316 left 2.7e-4.
    C = (0.7 + 1e-4 * randn((2, 3, 512, 49))[0]).float()
    expected = dense_injective(C.double(), 1e-5)
    assert (injective_normalize(C).double() - expected).abs().max() / expected.abs().max() < 1e-6


@pytest.mark.parametrize('impl', ['reference', 'cpu'])
def test_fp32_attention_of_nearly_equal_kernel_columns_stays_near_fp64(impl):
    """Every key nearly equally similar to every landmark: the output reads only k(k, L)ᵀ v's
    small differences. Plain fp32 sums left a mean 3.4e-6, the centred forms 0.8e-6."""
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
    inputs = tuple(t.requires_grad_() for t in (q, k, v, k[..., ::2, :].clone()))
    assert torch.autograd.gradcheck(
        lambda *a: nystrom_attention(*a, kernel=kernel, normalize=normalize, solver=solver,
                                     iters=40, eps=0.1, lam=2.0), inputs)


def test_distinct_queries_give_distinct_attention_rows():
    """Attention rows (v = I): no two alike, also for a query shifted off another."""
    q, k, _ = qkv((1, 1, 64, 8), seed=3)
    q, k = torch.cat([q, q[..., :1, :] + 0.3], -2), torch.cat([k, k[..., :1, :]], -2)
    eye = torch.eye(65, dtype=torch.float64).view(1, 1, 65, 65)
    rows = nystrom_attention(q, k, eye, pool_landmarks(k[..., :64, :], (8, 8), grid=4),
                             solver='exact')[0, 0]
    assert (torch.cdist(rows, rows) + torch.eye(65, dtype=torch.float64)).min() > 1e-4


def test_output_of_a_sample_does_not_depend_on_the_others():
    q, k, v = qkv((3, 2, 25, 4), seed=4)
    landmarks = pool_landmarks(k, (5, 5))
    alone = nystrom_attention(q[:1], k[:1], v[:1], landmarks[:1])
    torch.testing.assert_close(nystrom_attention(q, k, v, landmarks)[:1], alone, rtol=1e-12,
                               atol=1e-12)
    scaled = nystrom_attention(torch.cat([q[:1], 100 * q[1:]]), torch.cat([k[:1], -k[1:]]),
                               v, torch.cat([landmarks[:1], 7 * landmarks[1:]]))
    torch.testing.assert_close(scaled[:1], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('kwargs,exc,match', [
    (dict(lam=0.0), ValueError, 'lam'), (dict(lam=float('nan')), ValueError, 'lam'),
    (dict(eps=-0.1), ValueError, 'eps'), (dict(whiten_eps=-1.0), ValueError, 'whiten_eps'),
    (dict(solver='lu'), ValueError, 'solver'), (dict(kernel='cosine'), ValueError, 'kernel'),
    (dict(normalize='l2'), ValueError, 'normalize'), (dict(iters=-3), ValueError, 'iters'),
    (dict(ns_refine=1), TypeError, 'ns_refine'), (dict(lamda=2), TypeError, 'lamda'),
    (dict(options=AttentionOptions(), lam=2.0), TypeError, 'lam'),
])
def test_attention_rejects_bad_arguments_naming_them(kwargs, exc, match):
    q, k, v = qkv((1, 1, 4, 2))
    with pytest.raises(exc, match=match):
        nystrom_attention(q, k, v, k[..., :2, :], **kwargs)


def test_attention_rejects_operands_that_would_broadcast_and_ambiguous_landmarks():
    q, k, v = qkv((1, 2, 4, 3))
    for args in ((q, k[..., :3, :], v, k), (q, k, v[..., :3, :], k), (q, k, v, k[..., :2]),
                 (q, k, v, k[:, :1])):
        with pytest.raises(ValueError, match='landmarks'):
            nystrom_attention(*args)
    for kwargs in (dict(), dict(landmarks=k, hw=(2, 2))):
        with pytest.raises(TypeError, match='landmarks'):
            nystrom_attention(q, k, v, **kwargs)


@pytest.mark.parametrize('impl', ['reference', 'cpu'])
def test_degenerate_sizes(impl):
    """Empty outputs; keys of width 0 give the mean value; one landmark with whiten_eps = 0
    gives every query the solved context, finite with its gradients."""
    for shape in ((0, 2, 6, 3), (1, 2, 0, 3)):
        q, v = torch.randn(shape), torch.randn(*shape[:3], 5)
        out = nystrom_attention(q, q, v, torch.randn(*shape[:2], 4, 3), impl=impl)
        assert out.shape == (*shape[:3], 5)
    q, v = torch.randn(1, 2, 6, 0), torch.randn(1, 2, 6, 5)
    out = nystrom_attention(q, q, v, q[..., :4, :], impl=impl)
    torch.testing.assert_close(out, v.mean(-2, keepdim=True).expand_as(out))
    q, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    out = nystrom_attention(q, q, v, hw=(4, 4), landmark_grid=1, whiten_eps=0.0, impl=impl)
    out.square().sum().backward()
    assert finite(out, q.grad, v.grad)
    torch.testing.assert_close(out, out[..., :1, :].expand_as(out))


def test_resolve_impl_takes_the_first_backend_without_reasons(monkeypatch):
    monkeypatch.delenv('LAPFORMER_OPS', raising=False)
    q = torch.randn(1, 2, 12, 4)
    lm = pool_landmarks(q, (3, 4), 2)

    def impl(**options):
        return resolve_impl(q, q, q, lm, AttentionOptions(**options))
    monkeypatch.setattr(cpu, 'available', lambda: False)
    monkeypatch.setattr(cuda, 'available', lambda: False)
    assert impl() == 'reference' and impl(impl='reference') == 'reference'
    for name in ('cupy', 'cpu'):  # on the wrong device, not built
        with pytest.raises(RuntimeError, match='impl'):
            impl(impl=name)
    with pytest.raises(ValueError, match='impl'):
        AttentionOptions(impl='triton')
    monkeypatch.setenv('LAPFORMER_OPS', 'reference')
    assert AttentionOptions().impl == 'reference'
    monkeypatch.setenv('LAPFORMER_OPS', 'cupy')
    with pytest.raises(RuntimeError, match='LAPFORMER_OPS'):
        nystrom_attention(q, q, q, lm)
    monkeypatch.setenv('LAPFORMER_OPS', 'fast')
    with pytest.raises(ValueError, match='LAPFORMER_OPS'):
        AttentionOptions()
    monkeypatch.delenv('LAPFORMER_OPS')
    # A backend that reports reasons: impl=None warns once and takes the reference, the
    # explicit impl raises them.
    monkeypatch.setattr(cpu, 'available', lambda: True)
    assert impl() == 'cpu' and impl(impl='cpu') == 'cpu'
    monkeypatch.setattr(cpu, 'not_supported', lambda *args: ['a reason'])
    attention._warn_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match='a reason'):
        assert impl() == 'reference'
    with pytest.raises(RuntimeError, match='a reason'):
        impl(impl='cpu')


@pytest.mark.parametrize('dtype', [torch.float16, torch.float32])
def test_tied_keys_evaluate_the_query_kernel_once(monkeypatch, dtype):
    """k is q: k(q, L) serves as k(k, L), also when the inputs are cast to fp32 first."""
    calls = []
    original = reference.similarity
    monkeypatch.setattr(reference, 'similarity',
                        lambda x, y, *args: calls.append(x.shape[-2]) or original(x, y, *args))
    q = torch.randn(1, 2, 12, 4).to(dtype)
    nystrom_attention(q, q, torch.randn(1, 2, 12, 4).to(dtype), pool_landmarks(q, (3, 4), 2),
                      impl='reference')
    assert calls == [12, 4]  # k(q, L), then k(L, L)


@pytest.mark.parametrize('solver', ['newton', 'exact', 'cg'])
@pytest.mark.parametrize('eps', [0.01, 0.0])
def test_identical_landmarks_stay_finite_or_name_a_singular_matrix(solver, eps):
    """eps = 0, P = J singular: newton and CG stay finite; exact names the problem."""
    torch.manual_seed(0)
    q, v = (torch.randn(2, 2, 30, 16, requires_grad=True) for _ in range(2))
    landmarks = q.mean(-2, keepdim=True).expand(2, 2, 25, 16)
    if solver == 'exact' and eps == 0:
        with pytest.raises(ValueError, match='eps'):
            nystrom_attention(q, q, v, landmarks, solver=solver, eps=eps)
        return
    out = nystrom_attention(q, q, v, landmarks, solver=solver, eps=eps)
    if solver == 'cg' and eps > 0:
        exact = nystrom_attention(*(t.double() for t in (q, q, v, landmarks)), solver='exact',
                                  eps=eps)
        torch.testing.assert_close(out.double(), exact, rtol=1e-3, atol=1e-4)
    out.square().sum().backward()
    assert finite(out, q.grad, v.grad)


@pytest.mark.parametrize('dtype,scale,normalize', [
    *((torch.float32, s, n) for s in (1e-4, 1e-2, 1.0, 1e2, 1e4) for n in ('injective', 'none')),
    *((d, s, 'injective') for d in (torch.float16, torch.bfloat16) for s in (1e-4, 1e3))])
def test_feature_scales_finite_forward_and_backward(dtype, scale, normalize):
    """16-bit inputs compute in fp32; underflowing kernel values give the mean value."""
    torch.manual_seed(0)
    q, k = ((torch.randn(1, 2, 48, 16) * scale).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 48, 16).to(dtype).requires_grad_()
    out = nystrom_attention(q, k, v, hw=(6, 8), normalize=normalize)
    out.float().square().sum().backward()
    assert out.dtype == dtype and finite(out, q.grad, k.grad, v.grad)
    if scale >= 1e2 and dtype == torch.float32:
        torch.testing.assert_close(out, v.mean(-2, keepdim=True).expand_as(out))


@pytest.mark.parametrize('spread', [1e-4, 1e-3, 1e-2])
def test_fp32_default_newton_within_3x_of_an_fp32_direct_solve(spread):
    """Tokens within ``spread`` of one point: fp32 Newton–Schulz within 3x of a direct solve."""
    base, q, v, landmarks = randn((1, 1, 1, 32), (1, 1, 400, 32), (1, 1, 400, 32), (1, 1, 49, 32))
    q, landmarks = base + spread * q, base + spread * landmarks
    expected = dense_attention(q, q, v, landmarks)

    def error(**options):
        out = nystrom_attention(q.float(), q.float(), v.float(), landmarks.float(), **options)
        return ((out.double() - expected).norm() / expected.norm()).item()
    assert error() <= 3 * error(solver='exact')


@PROPERTY
@given(attention_cases(solvers=('newton', 'exact', 'cg')))
def test_nystrom_attention_finite_output_and_gradients(inputs):
    q, k, v, hw, options = inputs
    leaves = [t.requires_grad_() for t in {id(t): t for t in (q, k, v)}.values()]
    out = run_attention(q, k, v, hw, options)
    assert out.shape == v.shape and finite(out)
    (out * torch.randn_like(out)).sum().backward()
    assert finite(*(t.grad for t in leaves))
