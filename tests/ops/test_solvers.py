"""Newton–Schulz inverse, conjugate gradient and exact solvers."""
import pytest
import torch
from _attention_helpers import smooth_tokens

from lapformer_mm.ops import (
    DEFAULT_NS_ITERS,
    cg_solve,
    exact_inverse,
    exact_solve,
    laplacian_kernel,
    newton_schulz_pinv,
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


def test_gradcheck_newton_schulz():
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


def test_default_iteration_count_is_documented():
    assert isinstance(DEFAULT_NS_ITERS, int) and DEFAULT_NS_ITERS >= 14


@pytest.mark.parametrize('kwargs,exc,match', [
    (dict(init='random'), ValueError, "init='random'.*'identity', 'authors'"),
    (dict(iters=0), ValueError, 'iters=0'),
    (dict(iters=2.5), TypeError, 'iters'),
])
def test_newton_schulz_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        newton_schulz_pinv(spd(1, 3, seed=7), **kwargs)


def test_non_square_raises():
    with pytest.raises(ValueError, match='square'):
        newton_schulz_pinv(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match='B must be'):
        cg_solve(spd(1, 3, seed=8), torch.zeros(1, 4, 1, dtype=torch.float64))
