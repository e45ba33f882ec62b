"""Laplacian / Gaussian kernel matrices: values, gradients, memory, validation."""
import math

import pytest
import torch
from _attention_helpers import dense_gaussian_kernel, dense_kernel, dense_l1_kernel, finite
from _property_strategies import KERNELS as KERNEL_BY_NAME
from _property_strategies import PROPERTY, kernel_inputs
from hypothesis import given

from devtools.profiling import peak_memory_bytes
from lapformer_mm.ops import gaussian_kernel, laplacian_kernel

KERNELS = [(laplacian_kernel, dense_l1_kernel), (gaussian_kernel, dense_gaussian_kernel)]


def _pair(shape_x, shape_y, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape_x, generator=gen, dtype=dtype),
            torch.randn(shape_y, generator=gen, dtype=dtype))


@pytest.mark.parametrize('fn,dense', KERNELS)
def test_values_match_dense_computation(fn, dense):
    x, y = _pair((2, 3, 7, 5), (2, 3, 4, 5))
    out = fn(x, y, lam=2.5)
    assert out.shape == (2, 3, 7, 4)
    torch.testing.assert_close(out, dense(x, y, 2.5), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize('fn,dense', KERNELS)
def test_kernel_matrix_in_fp32_matches_fp64(fn, dense):
    x, y = _pair((3, 50, 32), (3, 49, 32))
    out = fn(x.float(), y.float(), lam=4.0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense(x, y, 4.0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('norm', [570.0, 5700.0])
def test_gaussian_fp32_exact_at_large_norms(norm):
    """k(x, x) = 1 and fp64 agreement at |x| in the thousands (found on the GPU: the
    |x|² + |y|² - 2 x·y expansion gave k(x, x) = 0.14 at |x| = 5700 in fp32)."""
    x, y = _pair((2, 30, 32), (2, 9, 32), seed=4)
    x = x * norm / x.norm(dim=-1, keepdim=True)
    y = x[:, :9] + 3.0 * y  # near x: distances of a few units at norm 570-5700
    out = gaussian_kernel(x.float(), y.float(), lam=64.0)
    assert (gaussian_kernel(x.float(), x.float(), lam=64.0).diagonal(dim1=-2, dim2=-1) == 1).all()
    expected = dense_gaussian_kernel(x.float().double(), y.float().double(), 64.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('fn,dense', KERNELS)
def test_kernel_matrix_gradients_pass_gradcheck(fn, dense):
    x, y = _pair((2, 5, 3), (2, 4, 3), seed=1)
    x.requires_grad_()
    y.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: fn(a, b, 1.5), (x, y))


@pytest.mark.parametrize('fn,dense', KERNELS)
def test_gradient_matches_autograd_of_dense(fn, dense):
    x, y = _pair((2, 6, 4), (2, 3, 4), seed=2)
    g = torch.randn(2, 6, 3, dtype=torch.float64)
    grads = torch.autograd.grad((fn(x.requires_grad_(), y.requires_grad_(), 3.0) * g).sum(),
                                (x, y))
    expected = torch.autograd.grad((dense(x, y, 3.0) * g).sum(), (x, y))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_laplacian_gradient_of_abs_at_zero_is_zero():
    # x0 coincides with y0 in every coordinate and x1 with y0 in coordinate 0:
    # those |t| terms have t = 0 and must contribute nothing.
    y = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    x = torch.tensor([[0.5, -1.0, 2.0], [0.5, 0.0, 0.0]], dtype=torch.float64,
                     requires_grad=True)
    laplacian_kernel(x, y, lam=2.0).sum().backward()
    k1 = math.exp(-(1.0 + 2.0) / 2.0)
    torch.testing.assert_close(x.grad, torch.tensor(
        [[0.0, 0.0, 0.0], [0.0, -k1 / 2.0, k1 / 2.0]], dtype=torch.float64))
    torch.testing.assert_close(y.grad, torch.tensor(
        [[0.0, k1 / 2.0, -k1 / 2.0]], dtype=torch.float64))


@pytest.mark.parametrize('fn', [laplacian_kernel, gaussian_kernel])
def test_no_n_m_d_tensor_in_forward_or_backward(fn):
    n, m, d = 8192, 49, 32
    x, y = _pair((1, n, d), (1, m, d), dtype=torch.float32)
    x.requires_grad_()
    y.requires_grad_()
    peak, _ = peak_memory_bytes(lambda: fn(x, y, 4.0).sum().backward())
    linear_size = 4 * (n * m + (n + m) * d)
    # An (N, M, d) tensor alone would be 4·N·M·d bytes = 19x the linear size.
    assert peak <= 6 * linear_size, (peak, linear_size)


@pytest.mark.parametrize('fn', [laplacian_kernel, gaussian_kernel])
@pytest.mark.parametrize('lam', [0.0, -1.0, float('nan'), float('inf')])
def test_kernel_matrix_rejects_a_non_positive_or_non_finite_lam(fn, lam):
    x, y = _pair((4, 3), (2, 3))
    with pytest.raises(ValueError, match='lam'):
        fn(x, y, lam)


@pytest.mark.parametrize('fn', [laplacian_kernel, gaussian_kernel])
def test_kernel_matrix_rejects_batch_dims_it_would_broadcast(fn):
    x, y = _pair((4, 3), (2, 3))
    with pytest.raises(ValueError, match='batch'):
        fn(x.expand(2, 4, 3), y)
    with pytest.raises(TypeError, match='lam'):
        fn(x, y, lam='4')


def test_l1_gradient_paths_match_dense_sum():
    """Pins ``aten._cdist_backward`` (its one use, blocked over b) and the chunked loop."""
    from lapformer_mm.ops import reference as rk
    a, b = _pair((2, 37, 5), (2, 1100, 5), seed=3)
    b[:, 0] = a[:, 0]  # exact ties exercise sign(0) = 0
    g = torch.randn(2, 37, 1100, dtype=torch.float64)
    dense = (g.unsqueeze(-1) * torch.sign(a.unsqueeze(-2) - b.unsqueeze(-3))).sum(-2)
    assert b.shape[1] > rk.NATIVE_BLOCK_ROWS  # more than one block of b rows
    torch.testing.assert_close(rk._l1_grad_native(g, a, b), dense, rtol=1e-12, atol=1e-12)
    row_bytes = 2 * 1100 * 5 * 8
    for chunk_bytes in (1, 4 * row_bytes, 10 ** 9):
        torch.testing.assert_close(rk._l1_grad_chunked(g, a, b, chunk_bytes), dense,
                                   rtol=1e-12, atol=1e-12)


@PROPERTY
@given(kernel_inputs())
def test_kernels_finite_bounded_and_equal_to_dense_fp64_for_any_shape(inputs):
    x, y, lam, kind = inputs
    x.requires_grad_()
    y.requires_grad_()
    k = KERNEL_BY_NAME[kind](x, y, lam)
    assert k.shape == (*x.shape[:-1], y.shape[-2])
    assert finite(k) and bool((k >= 0).all()) and bool((k <= 1).all())
    torch.testing.assert_close(k.double(), dense_kernel(x.double(), y.double(), lam, kind),
                               rtol=1e-4, atol=1e-6)
    (k * torch.randn_like(k)).sum().backward()
    assert finite(x.grad, y.grad)


def test_landmark_matrix_is_the_ridged_kernel_of_the_landmarks():
    from lapformer_mm.ops import AttentionOptions, landmark_matrix
    landmarks = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    expected = dense_l1_kernel(landmarks, landmarks, 4.0) + 0.01 * torch.eye(5,
                                                                           dtype=torch.float64)
    torch.testing.assert_close(landmark_matrix(landmarks, AttentionOptions()), expected)
