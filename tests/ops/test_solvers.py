"""Newton–Schulz inverse, conjugate gradient and exact solvers."""
import pytest
import torch
from _attention_helpers import finite, smooth_tokens
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


def landmark_matrices(eps=0.01):
    """P = k(L, L) + eps·I of smooth pooled features, condition numbers ~1..2000."""
    mats = []
    for seed, scale in enumerate((0.012, 0.03, 0.1, 0.5)):
        tokens = smooth_tokens(2, (28, 28), 32, scale, seed)
        landmarks = pool_landmarks(tokens, (28, 28), 7)
        mats.append(laplacian_kernel(landmarks, landmarks, 4.0)[:, 0])
    w = torch.cat(mats)
    return w + eps * torch.eye(49, dtype=w.dtype)


def spd(batch, m, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, m, m, generator=gen, dtype=dtype)
    return a @ a.mT / m + 0.5 * torch.eye(m, dtype=dtype)


def spectral_residual(P, X):
    eye = torch.eye(P.shape[-1], dtype=torch.float64)
    return torch.linalg.matrix_norm(eye - P.double() @ X.double(), ord=2)


def test_default_iterations_reach_tolerance_on_landmark_matrices():
    P = landmark_matrices()
    cond = torch.linalg.cond(P)
    assert cond.max() > 1000 and cond.max() < 2500, cond  # the range the default covers
    X = newton_schulz_pinv(P.float())
    assert X.dtype == torch.float32
    assert spectral_residual(P, X).max() < 1e-3


def test_authors_start_converges_with_more_iterations():
    P = landmark_matrices()
    X = newton_schulz_pinv(P.float(), iters=30, init='authors')
    assert spectral_residual(P, X).max() < 1e-3


def test_float64_stays_float64_and_converges_fully():
    P = spd(3, 10, seed=0)
    X = newton_schulz_pinv(P, iters=40)
    assert X.dtype == torch.float64
    torch.testing.assert_close(X, torch.linalg.inv(P), rtol=1e-10, atol=1e-12)


def test_half_input_computes_in_float32():
    P = landmark_matrices()[:2]
    X = newton_schulz_pinv(P.half())
    assert X.dtype == torch.float16
    ref = newton_schulz_pinv(P.half().float())
    torch.testing.assert_close(X.float(), ref.half().float())


def test_closed_form_gradient_matches_autograd_through_inverse():
    P = spd(2, 6, seed=1).requires_grad_()
    G = torch.randn(2, 6, 6, dtype=torch.float64)
    (got,) = torch.autograd.grad((newton_schulz_pinv(P, iters=50) * G).sum(), P)
    (want,) = torch.autograd.grad((torch.linalg.inv(P) * G).sum(), P)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_newton_schulz_gradients_pass_gradcheck():
    P = spd(1, 4, seed=2).requires_grad_()
    assert torch.autograd.gradcheck(lambda p: newton_schulz_pinv(p, iters=50), (P,))


@pytest.mark.parametrize('solver', ['newton', 'exact', 'cg'])
def test_attention_leaves_global_numeric_settings_alone(monkeypatch, solver):
    """No thread-count or matmul-precision switch, read or restored, anywhere in a step."""
    from lapformer_mm.ops import nystrom_attention, pool_landmarks

    def refuse(*args, **kwargs):
        raise AssertionError('the attention touched a global numeric setting')

    class Untouchable:
        __getattr__ = __setattr__ = refuse
    monkeypatch.setattr(torch, 'set_num_threads', refuse)
    monkeypatch.setattr(torch, 'set_float32_matmul_precision', refuse)
    monkeypatch.setattr(torch.backends.cuda, 'matmul', Untouchable())
    q = torch.randn(1, 2, 36, 8, requires_grad=True)
    out = nystrom_attention(q, q, torch.randn(1, 2, 36, 8), pool_landmarks(q, (6, 6), 3),
                            solver=solver)
    out.sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize('solver', [exact_solve, cg_solve])
def test_solvers_match_linalg_solve(solver):
    P = spd(3, 8, seed=4)
    B = torch.randn(3, 8, 5, dtype=torch.float64)
    torch.testing.assert_close(solver(P, B), torch.linalg.solve(P, B), rtol=1e-8,
                               atol=1e-10)


def test_exact_inverse_and_cg_gradient():
    P = spd(2, 5, seed=5).requires_grad_()
    B = torch.randn(2, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5),
                    requires_grad=True)
    torch.testing.assert_close(exact_inverse(P), torch.linalg.inv(P))
    # Four steps for m = 5: the m-th step divides round-off by round-off, a function whose
    # finite differences disagree with its exact derivative for some right-hand sides.
    assert torch.autograd.gradcheck(lambda p, b: cg_solve(p, b, iters=4), (P, B))


def test_cg_zero_rhs_stays_finite():
    P = spd(1, 4, seed=6)
    out = cg_solve(P, torch.zeros(1, 4, 2, dtype=torch.float64))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize('kwargs,exc,match', [
    (dict(init='random'), ValueError, "init='random'.*'identity', 'authors'"),
    (dict(iters=0), ValueError, 'iters=0'),
    (dict(iters=2.5), TypeError, 'iters'),
])
def test_newton_schulz_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        newton_schulz_pinv(spd(1, 3, seed=7), **kwargs)


def test_exact_inverse_names_a_singular_matrix_as_exact_solve_does():
    """It raised torch's _LinAlgError ("The diagonal element 1 is zero")."""
    singular = torch.ones(2, 3, 3, dtype=torch.float64)
    for solve in (exact_inverse, lambda P: exact_solve(P, P)):
        with pytest.raises(ValueError, match='eps'):
            solve(singular)


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


@PROPERTY
@given(landmark_matrix_cases())
def test_newton_schulz_squares_its_residual_every_step(inputs):
    """From X_0 = I/||P||_inf, ||I - P X_0||_2 = r0 = 1 - λ_min/||P||_inf and each step
    squares the residual: after t steps it is r0^(2^t), up to fp64 round-off."""
    p, iters = inputs
    p.requires_grad_()
    x = newton_schulz_pinv(p, iters)
    assert finite(x)
    p64 = p.detach()
    eye = torch.eye(p.shape[-1], dtype=torch.float64)
    residual = torch.linalg.matrix_norm(eye - p64 @ x.detach(), ord=2)
    r0 = 1 - torch.linalg.eigvalsh(p64)[..., 0] / p64.abs().sum(-1).amax(-1)
    bound = r0 ** (2 ** iters) + 1e-12 * torch.linalg.cond(p64)
    assert bool((residual <= bound).all()), (residual, bound)
    (x * torch.randn_like(x)).sum().backward()
    assert finite(p.grad)
