"""Newton–Schulz inverse, conjugate gradient and exact solvers."""
import pytest
import torch
from _attention_helpers import dense_l1_kernel, finite, randn, smooth_tokens
from _property_strategies import PROPERTY, landmark_matrix_cases
from hypothesis import given

from lapformer_mm.ops import (
    DEFAULT_NS_ITERS,
    cg_solve,
    exact_inverse,
    exact_solve,
    laplacian_kernel,
    newton_schulz_pinv,
    nystrom_attention,
    pool_landmarks,
)
from lapformer_mm.ops.reference import newton_schulz


def landmark_matrices(eps=0.01):
    """P = k(L, L) + eps·I of smooth pooled features, condition numbers ~1..2000."""
    mats = []
    for seed, scale in enumerate((0.012, 0.03, 0.1, 0.5)):
        landmarks = pool_landmarks(smooth_tokens(2, (28, 28), 32, scale, seed), (28, 28), 7)
        mats.append(laplacian_kernel(landmarks, landmarks, 4.0)[:, 0])
    return torch.cat(mats) + eps * torch.eye(49, dtype=torch.float64)


def spd(batch, m, seed):
    a, = randn((batch, m, m), seed=seed)
    return a @ a.mT / m + 0.5 * torch.eye(m, dtype=torch.float64)


def spectral_residual(P, X):
    eye = torch.eye(P.shape[-1], dtype=torch.float64)
    return torch.linalg.matrix_norm(eye - P.double() @ X.double(), ord=2)


def test_newton_schulz_reaches_tolerance_on_landmark_matrices():
    """The default covers cond up to ~2500; the authors' start needs more steps."""
    P = landmark_matrices()
    assert 1000 < torch.linalg.cond(P).max() < 2500
    for init, iters in (('identity', None), ('authors', 30)):
        X = newton_schulz_pinv(P.float(), iters=iters, init=init)
        assert X.dtype == torch.float32 and spectral_residual(P, X).max() < 1e-3
    # 16-bit input: computed in fp32, returned in its dtype.
    torch.testing.assert_close(newton_schulz_pinv(P[:2].half()),
                               newton_schulz_pinv(P[:2].half().float()).half())


def test_newton_schulz_fp64_converges_fully_and_its_gradient_is_the_inverse_s():
    P = spd(2, 6, seed=1).requires_grad_()
    X = newton_schulz_pinv(P, iters=50)
    assert X.dtype == torch.float64
    torch.testing.assert_close(X, torch.linalg.inv(P), rtol=1e-10, atol=1e-12)
    G, = randn((2, 6, 6))
    (got,) = torch.autograd.grad((X * G).sum(), P)
    (want,) = torch.autograd.grad((torch.linalg.inv(P) * G).sum(), P)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    small = spd(1, 4, seed=2).requires_grad_()
    assert torch.autograd.gradcheck(lambda p: newton_schulz_pinv(p, iters=50), (small,))


def test_default_iterations_are_the_fewest_that_meet_the_worst_case():
    """Identical landmarks, eps = 0.01: the default leaves 1.6e-6 < 1e-3, one step fewer 1.25e-3."""
    P = torch.ones(1, 49, 49, dtype=torch.float64) + 0.01 * torch.eye(49, dtype=torch.float64)
    residual = [spectral_residual(P, newton_schulz(P, n, 'identity')).item()
                for n in (DEFAULT_NS_ITERS, DEFAULT_NS_ITERS - 1)]
    assert residual[0] < 1e-5 and residual[1] == pytest.approx(1.25e-3, rel=0.01)


@pytest.mark.parametrize('solver', ['newton', 'exact', 'cg'])
def test_attention_leaves_global_numeric_settings_alone(monkeypatch, solver):
    def refuse(*args, **kwargs):
        raise AssertionError('the attention touched a global numeric setting')

    class Untouchable:
        __getattr__ = __setattr__ = refuse
    monkeypatch.setattr(torch, 'set_num_threads', refuse)
    monkeypatch.setattr(torch, 'set_float32_matmul_precision', refuse)
    monkeypatch.setattr(torch.backends.cuda, 'matmul', Untouchable())
    q = torch.randn(1, 2, 36, 8, requires_grad=True)
    nystrom_attention(q, q, torch.randn(1, 2, 36, 8), hw=(6, 6), landmark_grid=3,
                      solver=solver).sum().backward()
    assert q.grad is not None


def test_exact_and_cg_solves_match_linalg_with_their_gradients():
    P, (B,) = spd(3, 8, seed=4), randn((3, 8, 5), seed=4)
    for solve in (exact_solve, cg_solve):
        torch.testing.assert_close(solve(P, B), torch.linalg.solve(P, B), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(exact_inverse(P), torch.linalg.inv(P))
    out = cg_solve(P[:1], torch.zeros(1, 8, 2, dtype=torch.float64))
    assert torch.equal(out, torch.zeros_like(out))
    P, B = spd(2, 5, seed=5).requires_grad_(), B[:2, :5, :3].clone().requires_grad_()
    # Four steps for m = 5: the m-th divides round-off by round-off.
    assert torch.autograd.gradcheck(lambda p, b: cg_solve(p, b, iters=4), (P, B))
    # CG runs to its tolerance, not to m steps: on 9 smooth landmarks m steps leave 5.7e-9.
    pts, B = randn((9, 32), (9, 8), seed=2)
    P = dense_l1_kernel(pts.cumsum(0) * 0.05, pts.cumsum(0) * 0.05, 4.0) + 0.01 * torch.eye(9)
    x = torch.linalg.solve(P, B)
    assert ((cg_solve(P, B) - x).norm() / x.norm()).item() <= 1e-13


@pytest.mark.parametrize('call,exc,match', [
    (lambda P: newton_schulz_pinv(P, init='random'), ValueError, 'init'),
    (lambda P: newton_schulz_pinv(P, iters=0), ValueError, 'iters'),
    (lambda P: newton_schulz_pinv(P, iters=2.5), TypeError, 'iters'),
    (lambda P: cg_solve(P, P, iters=-1), ValueError, 'iters'),
    (lambda P: exact_inverse(P * 0 + 1), ValueError, 'eps'),
    (lambda P: exact_solve(P * 0 + 1, P), ValueError, 'eps'),
])
def test_solvers_refuse_what_they_would_compute_wrongly(call, exc, match):
    with pytest.raises(exc, match=match):
        call(spd(2, 3, seed=7))


@PROPERTY
@given(landmark_matrix_cases())
def test_newton_schulz_squares_its_residual_every_step(inputs):
    """||I - P X_0||_2 = r0 = 1 - λ_min/||P||_inf, and each step squares it."""
    p, iters = inputs
    x = newton_schulz_pinv(p.requires_grad_(), iters)
    assert finite(x)
    p64 = p.detach()
    r0 = 1 - torch.linalg.eigvalsh(p64)[..., 0] / p64.abs().sum(-1).amax(-1)
    bound = r0 ** (2 ** iters) + 1e-12 * torch.linalg.cond(p64)
    assert bool((spectral_residual(p64, x.detach()) <= bound).all())
    (x * torch.randn_like(x)).sum().backward()
    assert finite(p.grad)
