"""Laplacian / Gaussian kernel matrices: values, gradients, memory, validation."""

import pytest
import torch
from _attention_helpers import dense_gaussian_kernel, dense_kernel, dense_l1_kernel, finite, randn
from _property_strategies import KERNELS as KERNEL_BY_NAME
from _property_strategies import PROPERTY, kernel_inputs
from hypothesis import given

from devtools.profiling import peak_memory_bytes
from lapformer_mm.ops import (
    AttentionOptions,
    gaussian_kernel,
    kernel_matrix,
    landmark_matrix,
    laplacian_kernel,
)
from lapformer_mm.ops import reference as rk

KERNELS = [(laplacian_kernel, dense_l1_kernel), (gaussian_kernel, dense_gaussian_kernel)]


@pytest.mark.parametrize('fn,dense', KERNELS)
@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-12), (torch.float32, 1e-4)])
def test_values_match_dense_computation(fn, dense, dtype, tol):
    x, y = randn((2, 3, 50, 32), (2, 3, 49, 32))
    out = fn(x.to(dtype), y.to(dtype), lam=2.5)
    assert out.shape == (2, 3, 50, 49) and out.dtype == dtype
    torch.testing.assert_close(out.double(), dense(x, y, 2.5), rtol=tol, atol=tol / 100)
    expected = dense_l1_kernel(y, y, 4.0) + 0.01 * torch.eye(49, dtype=torch.float64)
    torch.testing.assert_close(landmark_matrix(y, AttentionOptions()), expected)


@pytest.mark.parametrize('norm', [570.0, 5700.0])
def test_gaussian_fp32_exact_at_large_norms(norm):
    """k(x, x) = 1 and fp64 agreement at |x| in the thousands (|x|² + |y|² - 2 x·y gave
    k(x, x) = 0.14 at |x| = 5700 in fp32)."""
    x, y = randn((2, 30, 32), (2, 9, 32), seed=4)
    x = (x * norm / x.norm(dim=-1, keepdim=True)).float()
    y = x[:, :9] + 3.0 * y.float()
    assert (gaussian_kernel(x, x, lam=64.0).diagonal(dim1=-2, dim2=-1) == 1).all()
    torch.testing.assert_close(gaussian_kernel(x, y, lam=64.0).double(),
                               dense_gaussian_kernel(x.double(), y.double(), 64.0),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('fn,dense', KERNELS)
def test_gradients_match_autograd_of_dense_and_gradcheck(fn, dense):
    x, y, g = randn((2, 6, 4), (2, 3, 4), (2, 6, 3), seed=2)
    grads = torch.autograd.grad((fn(x.requires_grad_(), y.requires_grad_(), 3.0) * g).sum(),
                                (x, y))
    expected = torch.autograd.grad((dense(x, y, 3.0) * g).sum(), (x, y))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    small = (x[:, :5, :3].detach().requires_grad_(), y[:, :, :3].detach().requires_grad_())
    assert torch.autograd.gradcheck(lambda a, b: fn(a, b, 1.5), small)


def test_l1_gradient_paths_match_dense_sum():
    """``aten._cdist_backward`` and the chunked loop (CUDA's): |t|'s gradient at t = 0 is 0."""
    a, b, g = randn((2, 37, 5), (2, 1100, 5), (2, 37, 1100), seed=3)
    b[:, 0] = a[:, 0]  # exact ties exercise sign(0) = 0
    dense = (g.unsqueeze(-1) * torch.sign(a.unsqueeze(-2) - b.unsqueeze(-3))).sum(-2)
    assert b.shape[1] > rk.NATIVE_BLOCK_ROWS
    for got in (rk._l1_grad_native(g, a, b), *(rk._l1_grad_chunked(g, a, b, chunk)
                                               for chunk in (1, 4 * 2 * 1100 * 5 * 8, 10 ** 9))):
        torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('fn', [laplacian_kernel, gaussian_kernel])
def test_no_n_m_d_tensor_in_forward_or_backward(fn):
    n, m, d = 8192, 49, 32
    x, y = (t.requires_grad_() for t in randn((1, n, d), (1, m, d), dtype=torch.float32))
    peak, _ = peak_memory_bytes(lambda: fn(x, y, 4.0).sum().backward())
    linear_size = 4 * (n * m + (n + m) * d)
    assert peak <= 6 * linear_size, (peak, linear_size)  # an (N, M, d) tensor is 19x


@pytest.mark.parametrize('args,exc,match', [
    (dict(lam=0.0), ValueError, 'lam'), (dict(lam=float('nan')), ValueError, 'lam'),
    (dict(lam='4'), TypeError, 'lam'), (dict(kernel='cosine'), ValueError, 'kernel'),
    (dict(x=torch.zeros(2, 4, 3)), ValueError, 'batch'),
])
def test_kernel_matrix_rejects_what_it_would_compute_wrongly(args, exc, match):
    with pytest.raises(exc, match=match):
        kernel_matrix(**dict(dict(kernel='laplacian', x=torch.zeros(4, 3), y=torch.zeros(2, 3)),
                             **args))


@PROPERTY
@given(kernel_inputs())
def test_kernels_finite_bounded_and_equal_to_dense_fp64_for_any_shape(inputs):
    x, y, lam, kind = inputs
    k = KERNEL_BY_NAME[kind](x.requires_grad_(), y.requires_grad_(), lam)
    assert k.shape == (*x.shape[:-1], y.shape[-2])
    assert finite(k) and bool((k >= 0).all()) and bool((k <= 1).all())
    torch.testing.assert_close(k.double(), dense_kernel(x.double(), y.double(), lam, kind),
                               rtol=1e-4, atol=1e-6)
    (k * torch.randn_like(k)).sum().backward()
    assert finite(x.grad, y.grad)
