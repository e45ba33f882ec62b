"""Property-based tests (hypothesis) of the attention ops over random shapes and scales.

For any shape (batch dims, N, M, d down to 1) and feature scale 1e-4 … 1e4: outputs and
gradients are finite, kernel values match a dense fp64 evaluation, and on a GPU the CuPy
path agrees with the reference. ``derandomize=True`` keeps CI runs reproducible.
"""
import pytest
import torch
from _attention_helpers import dense_kernel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lapformer_mm.ops import (
    gaussian_kernel,
    laplacian_kernel,
    newton_schulz_pinv,
    nystrom_attention,
    pool_landmarks,
)

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
KERNELS = {'laplacian': laplacian_kernel, 'gaussian': gaussian_kernel}


def finite(*tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@st.composite
def kernel_inputs(draw):
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    n, m, d = draw(st.integers(1, 40)), draw(st.integers(1, 20)), draw(st.integers(1, 40))
    scale = 10.0 ** draw(st.floats(-4, 4))
    seed = draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, n, d, generator=gen) * scale
    y = torch.randn(*batch, m, d, generator=gen) * scale
    lam = draw(st.sampled_from([0.5, 1.0, 4.0, 16.0]))
    kind = draw(st.sampled_from(sorted(KERNELS)))
    return x, y, lam, kind


@PROPERTY
@given(kernel_inputs())
def test_kernels_finite_bounded_and_exact(inputs):
    x, y, lam, kind = inputs
    x.requires_grad_()
    y.requires_grad_()
    k = KERNELS[kind](x, y, lam)
    assert k.shape == (*x.shape[:-1], y.shape[-2])
    assert finite(k) and bool((k >= 0).all()) and bool((k <= 1).all())
    torch.testing.assert_close(k.double(), dense_kernel(x.double(), y.double(), lam, kind),
                               rtol=1e-4,
                               atol=1e-6)
    (k * torch.randn_like(k)).sum().backward()
    assert finite(x.grad, y.grad)


@st.composite
def landmark_matrices(draw):
    m = draw(st.integers(1, 49))
    d = draw(st.integers(1, 32))
    scale = 10.0 ** draw(st.floats(-4, 4))
    eps = draw(st.sampled_from([1e-3, 1e-2, 1e-1]))
    seed = draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    landmarks = torch.randn(2, m, d, generator=gen, dtype=torch.float64) * scale
    p = laplacian_kernel(landmarks, landmarks) + eps * torch.eye(m, dtype=torch.float64)
    return p, draw(st.integers(1, 30))


@PROPERTY
@given(landmark_matrices())
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


@st.composite
def attention_inputs(draw, solvers=('newton', 'exact')):
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    hw = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    d = draw(st.integers(1, 16))
    scale = 10.0 ** draw(st.floats(-4, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    n = hw[0] * hw[1]
    q = torch.randn(b, h, n, d, generator=gen) * scale
    shared = draw(st.booleans())
    k = q if shared else torch.randn(b, h, n, d, generator=gen) * scale
    v = torch.randn(b, h, n, d, generator=gen)
    options = dict(kernel=draw(st.sampled_from(sorted(KERNELS))),
                   normalize=draw(st.sampled_from(['injective', 'none'])),
                   solver=draw(st.sampled_from(solvers)),
                   grid=draw(st.integers(1, 7)))
    return q, k, v, hw, options


def run_attention(q, k, v, hw, options, impl=None):
    options = dict(options)
    landmarks = pool_landmarks(k, hw, options.pop('grid'))
    return nystrom_attention(q, k, v, landmarks, impl=impl, **options)


@PROPERTY
@given(attention_inputs())
def test_nystrom_attention_finite_output_and_gradients(inputs):
    q, k, v, hw, options = inputs
    leaves = [t.requires_grad_() for t in {id(t): t for t in (q, k, v)}.values()]
    out = run_attention(q, k, v, hw, options)
    assert out.shape == v.shape and finite(out)
    (out * torch.randn_like(out)).sum().backward()
    assert finite(*(t.grad for t in leaves))


@PROPERTY
@given(attention_inputs(solvers=('cg', )))
def test_nystrom_attention_cg_finite_output_and_gradients(inputs):
    q, k, v, hw, options = inputs
    leaves = [t.requires_grad_() for t in {id(t): t for t in (q, k, v)}.values()]
    out = run_attention(q, k, v, hw, options)
    assert finite(out)
    (out * torch.randn_like(out)).sum().backward()
    assert finite(*(t.grad for t in leaves))


@pytest.mark.gpu
@settings(max_examples=25, deadline=None, derandomize=True)
@given(kernel_inputs())
def test_kernels_cupy_matches_reference(inputs):
    x, y, lam, kind = (t.cuda() if torch.is_tensor(t) else t for t in inputs)
    fn = KERNELS[kind]
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    xc, yc = x.clone().requires_grad_(), y.clone().requires_grad_()
    ref = fn(xr, yr, lam, impl='reference')
    got = fn(xc, yc, lam, impl='cupy')
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(xc.grad, xr.grad, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(yc.grad, yr.grad, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None, derandomize=True)
@given(attention_inputs(solvers=('newton', )))
def test_nystrom_attention_cupy_matches_reference(inputs):
    q, k, v, hw, options = inputs
    shared = k is q
    q, v = q.cuda(), v.cuda()
    k = q if shared else k.cuda()
    ref = run_attention(q, k, v, hw, options, impl='reference')
    got = run_attention(q, k, v, hw, options, impl='cupy')
    assert finite(got)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-4)
