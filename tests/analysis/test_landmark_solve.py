"""lapformer_mm.analysis.landmark_solve against a closed form (identical landmarks)."""
import math

import pytest
import torch
from _attention_helpers import finite

from lapformer_mm.analysis.landmark_solve import landmark_solve_residuals, solve_report
from lapformer_mm.models import LaplacianAttention, LaplacianFormer
from lapformer_mm.ops import DEFAULT_NS_ITERS


def identical_landmark_residual(m, eps, iters):
    """||I - P X_iters||_2 for P = J + eps·I (m×m), X_0 = I/||P||_inf: P X_0 has eigenvalues 1
    and eps/(m + eps), and Newton–Schulz squares each one's error 1 - λ every step."""
    return (1.0 - eps / (m + eps)) ** (2 ** iters)


@pytest.mark.parametrize('eps, iters', [(0.01, None), (0.01, 13), (0.1, None)])
def test_identical_landmarks_residual_matches_closed_form(eps, iters):
    """P = J + eps·I: the closed form in fp64; fp32 within 3x it or m·cond(P)·2^-24."""
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


@pytest.mark.parametrize('scale', [1e-4, 1.0, 1e4])
def test_backbone_residuals_small_and_maps_finite_at_image_scales(scale):
    """Whole-backbone forward on scaled images: finite maps and every solve reported."""
    torch.manual_seed(0)
    model = LaplacianFormer(arch='tiny').eval()
    img = torch.randn(1, 3, 64, 64) * scale
    reports = landmark_solve_residuals(model, img)
    assert len(reports) == sum(model.arch_settings['depths'])
    assert all(math.isfinite(r.residual) and r.residual < 1e-2 for r in reports.values())
    with torch.no_grad():
        assert finite(*model(img))


@pytest.mark.parametrize('solver', ['exact', 'cg', 'newton'])
def test_solve_report_measures_the_module_solvers_inverse(solver):
    """Each solver's own inverse is what the report measures (measured 0.5e-6 to 1.2e-6)."""
    bound = 1e-5
    torch.manual_seed(0)
    attn = LaplacianAttention(32, 2, solver=solver).eval()
    report = solve_report(attn, torch.randn(2, 48, 32), (6, 8))
    assert report.num_landmarks == 42 and report.residual < bound
