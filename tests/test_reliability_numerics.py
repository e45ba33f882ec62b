"""Numerics at the edges: singular landmark matrices, extreme feature scales, tiny grids.

Each test asserts finite outputs (and gradients), and the landmark solve's residual is
reported through :func:`lapformer_mm.analysis.landmark_solve.landmark_solve_residuals` and
checked against a closed form where one exists.
"""
import math

import pytest
import torch
from _attention_helpers import dense_attention

from lapformer_mm.analysis.landmark_solve import landmark_solve_residuals, solve_report
from lapformer_mm.models import LaplacianAttention, LaplacianFormer
from lapformer_mm.ops import DEFAULT_NS_ITERS, nystrom_attention, pool_landmarks

TINY = dict(embed_dims=[32, 32, 32, 32], num_heads=[1, 1, 1, 1], depths=[1, 1, 1, 1])


def finite(*tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def identical_landmark_residual(m, eps, iters):
    """||I - P X_iters||_2 for P = J + eps·I (m×m), X_0 = I/||P||_inf.

    P X_0 has eigenvalues 1 (the ones vector) and eps/(m + eps); Newton–Schulz squares
    each eigenvalue's error 1 - λ every step.
    """
    return (1.0 - eps / (m + eps)) ** (2 ** iters)


@pytest.mark.parametrize('eps, iters', [(0.01, None), (0.01, 13), (0.1, None)])
def test_identical_landmarks_residual_matches_closed_form(eps, iters):
    """A constant input makes every landmark equal: k(L, L) = J, P = J + eps·I.

    In fp64 the reported residual is the closed form. In fp32 (what the attention runs)
    it is at least the closed form and at most 3x it or the round-off floor
    m·cond(P)·2^-24 (measured: 2.8e-3 against 1.25e-3 for eps=0.01 and the default 15
    iterations; 4.2e-4 against ~0 for eps=0.1). The output stays finite either way.
    """
    torch.manual_seed(0)
    attn = LaplacianAttention(32, 1, eps=eps, iters=iters).eval()
    x = torch.randn(1, 1, 32).expand(2, 64, 32).contiguous()
    m = 49
    expected = identical_landmark_residual(m, eps, iters or DEFAULT_NS_ITERS)
    report64 = solve_report(attn.double(), x.double(), (8, 8))
    assert report64.num_landmarks == m
    assert report64.condition == pytest.approx((m + eps) / eps, rel=1e-6)
    assert report64.residual == pytest.approx(expected, rel=1e-3, abs=1e-10)
    report32 = solve_report(attn.float(), x, (8, 8))
    fp32_floor = m * report32.condition * 2.0 ** -24
    assert expected * 0.9 <= report32.residual <= max(expected * 3, fp32_floor)
    with torch.no_grad():
        assert finite(attn(x, (8, 8)))


@pytest.mark.parametrize('solver', ['newton', 'exact'])
def test_identical_landmarks_with_and_without_ridge(solver):
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


@pytest.mark.parametrize('eps', [0.01, 0.0])
def test_identical_landmarks_cg_forward_and_gradients_finite(eps):
    """CG on the singular-direction system: converged columns must stop, not divide 0 by 0."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 30, 16, requires_grad=True)
    v = torch.randn(2, 2, 30, 16, requires_grad=True)
    landmarks = q.mean(-2, keepdim=True).expand(2, 2, 25, 16)
    out = nystrom_attention(q, q, v, landmarks, solver='cg', eps=eps)
    assert finite(out)
    if eps > 0:
        exact = nystrom_attention(q.double(), q.double(), v.double(), landmarks.double(),
                                  solver='exact', eps=eps)
        torch.testing.assert_close(out.double(), exact, rtol=1e-3, atol=1e-4)
    out.square().sum().backward()
    assert finite(q.grad, v.grad)


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
        # Every kernel value underflows (||q - L||_1 / lam >> 100): the attention
        # term is exactly 0 and passes no gradient; finite, but the block falls back
        # to its local (depth-wise conv) term.
        assert out.abs().max() == 0


@pytest.mark.parametrize('scale', [1e-4, 1.0, 1e4])
def test_backbone_image_scales_report_residuals(scale):
    """Whole-backbone forward on scaled images: finite maps and every solve reported."""
    torch.manual_seed(0)
    model = LaplacianFormer(arch='tiny').eval()
    img = torch.randn(1, 3, 64, 64) * scale
    reports = landmark_solve_residuals(model, img)
    assert len(reports) == sum(model.arch_settings['depths'])
    assert all(math.isfinite(r.residual) and r.residual < 1e-2 for r in reports.values())
    with torch.no_grad():
        assert finite(*model(img))


def test_constant_image_forward_backward_and_residuals():
    torch.manual_seed(0)
    model = LaplacianFormer(arch=TINY)
    img = torch.full((2, 3, 48, 40), 0.5, requires_grad=True)
    outs = model(img)
    sum(o.square().sum() for o in outs).backward()
    assert finite(*outs, img.grad)
    assert all(finite(p.grad) for p in model.parameters() if p.grad is not None)
    reports = landmark_solve_residuals(model.eval(), img.detach())
    assert all(r.residual < 1e-2 for r in reports.values()), reports


@pytest.mark.parametrize('hw', [(1, 1), (1, 5), (2, 3), (6, 6), (7, 1)])
def test_token_grid_smaller_than_landmark_grid(hw):
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


@pytest.mark.parametrize('size', [(1, 1), (3, 5), (17, 9)])
def test_backbone_tiny_images(size):
    """Images down to 1x1 px: every stage is 1x1 or more, one landmark at the end.

    Batch 2: in training mode BatchNorm (stem, downsampling) needs more than one value
    per channel, so a 1x1 map at batch 1 is torch's error, as for any CNN backbone.
    """
    model = LaplacianFormer(arch=TINY)
    img = torch.randn(2, 3, *size, requires_grad=True)
    outs = model(img)
    sum(o.sum() for o in outs).backward()
    assert tuple(outs[-1].shape[-2:]) == (1, 1)
    assert finite(*outs, img.grad)
    with torch.no_grad():
        assert finite(*model.eval()(img[:1]))


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_low_precision_inputs_at_extreme_scales(dtype):
    """fp16/bf16 q, k, v at 1e-4 and 1e3: computed in fp32, the result cast back is finite."""
    torch.manual_seed(0)
    for scale in (1e-4, 1e3):
        q = (torch.randn(1, 2, 36, 16) * scale).to(dtype).requires_grad_()
        v = torch.randn(1, 2, 36, 16).to(dtype).requires_grad_()
        out = nystrom_attention(q, q, v, pool_landmarks(q, (6, 6), 7))
        assert out.dtype == dtype
        out.float().square().sum().backward()
        assert finite(out, q.grad, v.grad)


@pytest.mark.parametrize('solver', ['exact', 'cg', 'newton'])
def test_solve_report_follows_the_module_solver(solver):
    """Each solver's own inverse is what the report measures (CG: solved on the identity).

    Well-conditioned random input (cond(P) ~ 22): measured 0.5e-6 to 1.2e-6 for all three.
    """
    bound = 1e-5
    torch.manual_seed(0)
    attn = LaplacianAttention(32, 2, solver=solver).eval()
    report = solve_report(attn, torch.randn(2, 48, 32), (6, 8))
    assert report.num_landmarks == 42 and report.residual < bound


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
    """Near-identical landmarks (cond(P) 1.3e3-4.8e3): fp32 Newton–Schulz alone is off by
    1e-3..5e-2; with the refinement step (the default) it is within 3x of an fp32 direct solve."""
    q, v, landmarks = _near_identical_inputs(spread)
    expected = dense_attention(q, q, v, landmarks)

    def error(**options):
        out = nystrom_attention(q.float(), q.float(), v.float(), landmarks.float(), **options)
        return ((out.double() - expected).norm() / expected.norm()).item()
    assert error() <= 3 * error(solver='exact')
    if spread < 1e-2:
        assert error(ns_refine=False) > 10 * error(solver='exact')  # what the step is for


def test_default_iterations_meet_the_residual_at_the_worst_case():
    """Identical landmarks with eps = 0.01: the default leaves 1.6e-6 < 1e-3; one step
    fewer would leave 1.25e-3, so the default is the fewest that meet the bound."""
    from lapformer_mm.ops.reference import newton_schulz as newton_schulz_iterate
    P = torch.ones(1, 49, 49, dtype=torch.float64) + 0.01 * torch.eye(49, dtype=torch.float64)

    def residual(iters):
        X = newton_schulz_iterate(P, iters, 'identity')
        return torch.linalg.matrix_norm(torch.eye(49, dtype=torch.float64) - P @ X, ord=2).item()
    assert residual(DEFAULT_NS_ITERS) < 1e-5
    assert residual(DEFAULT_NS_ITERS - 1) == pytest.approx(1.25e-3, rel=0.01)


def test_cg_runs_to_its_tolerance_not_to_m_steps():
    """m = 9 smooth landmarks in fp64: m steps leave 5.7e-9, the tolerance reaches 1e-15."""
    from _attention_helpers import dense_l1_kernel

    from lapformer_mm.ops import cg_solve
    gen = torch.Generator().manual_seed(2)
    pts = torch.randn(9, 32, generator=gen, dtype=torch.float64).cumsum(0) * 0.05
    P = dense_l1_kernel(pts, pts, 4.0) + 0.01 * torch.eye(9, dtype=torch.float64)
    B = torch.randn(9, 8, generator=gen, dtype=torch.float64)
    x = torch.linalg.solve(P, B)
    assert ((cg_solve(P, B) - x).norm() / x.norm()).item() <= 1e-13


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
