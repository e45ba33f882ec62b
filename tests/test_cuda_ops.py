"""The CUDA kernels on a GPU against independent PyTorch computations.

Marked ``gpu``: skipped without CUDA and CuPy (tests/conftest.py). Imports only
``lapformer_mm.ops`` so that it runs on a machine without OpenMMLab packages.
Tolerances: fp32 inputs 1e-5 relative (forward) and 1e-5 relative to the
largest gradient entry (backward, whose long sums are reordered by the
tiling); fp16 inputs 1e-3 and bf16 8e-3 relative on the forward (one rounding
of the fp32 result), 2e-2 / 5e-2 of the largest entry on the backward.

``LAPFORMER_GPU_TEST_DEVICE=cpu`` with the plugin ``tests/cuda_emu/emulator_plugin.py``
runs the same tests on the CPU emulation of the kernels (see docs/cuda.md);
tests that need a real device or are too large to emulate are skipped there.
"""
import functools
import os
import types

import pytest
import torch
from _attention_helpers import dense_kernel

DEV = os.environ.get('LAPFORMER_GPU_TEST_DEVICE', 'cuda')
pytestmark = pytest.mark.gpu if DEV == 'cuda' else []
real_gpu_only = pytest.mark.skipif(DEV != 'cuda',
                                   reason='needs a real CUDA device or too large to emulate')


def _ops():
    """The public kernel functions pinned to the CuPy backend."""
    from lapformer_mm import ops
    return types.SimpleNamespace(**{
        name: functools.partial(getattr(ops, name), backend='cupy')
        for name in ('laplacian_kernel', 'gaussian_kernel', 'newton_schulz_pinv')})


def _iterate(P, iters, init):
    """The reference Newton–Schulz iterations (batched matmuls)."""
    from lapformer_mm.ops.solvers import newton_schulz_iterate
    return newton_schulz_iterate(P, iters, init)


def _rt():
    from lapformer_mm.ops import cuda_runtime
    return cuda_runtime


def kernel_fn(kind):
    return _ops().laplacian_kernel if kind == 'laplacian' else _ops().gaussian_kernel


def inputs(shape_x, shape_y, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape_x, generator=gen, device=DEV, dtype=torch.float64)
    y = torch.randn(shape_y, generator=gen, device=DEV, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def lam_for(kind, d):
    return 4.0 if kind == 'laplacian' else 2.0 * d


SHAPES = [((1, 1, 1), (1, 1, 1)), ((2, 1, 17), (2, 5, 17)), ((1, 70, 17), (1, 1, 17)),
          ((3, 65, 33), (3, 67, 33)), ((2, 2, 130, 32), (2, 2, 49, 32)),
          ((1, 5, 128), (1, 9, 128)), ((1, 3, 130), (1, 4, 130))]


def assert_grads_close(got, expected, rtol):
    scale = max(e.abs().max().item() for e in expected) or 1.0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e.double(), rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize('kind', ['laplacian', 'gaussian'])
@pytest.mark.parametrize('shapes', SHAPES)
def test_forward_backward_fp32_odd_shapes(kind, shapes):
    x, y = inputs(*shapes, seed=len(shapes[0]))
    lam = lam_for(kind, x.shape[-1])
    x.requires_grad_()
    y.requires_grad_()
    out = kernel_fn(kind)(x, y, lam)
    xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    ref = dense_kernel(xd, yd, lam, kind)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-7)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, y), g)
    expected = torch.autograd.grad(ref, (xd, yd), g.double())
    assert_grads_close(got, expected, 1e-5)


@pytest.mark.parametrize('dtype, rtol_fwd, rtol_bwd', [(torch.float16, 1e-3, 2e-2),
                                                       (torch.bfloat16, 8e-3, 5e-2)])
@pytest.mark.parametrize('kind', ['laplacian', 'gaussian'])
def test_half_precision_inputs(kind, dtype, rtol_fwd, rtol_bwd):
    x, y = inputs((4, 97, 32), (4, 49, 32), dtype=dtype, seed=3)
    lam = lam_for(kind, 32)
    x.requires_grad_()
    y.requires_grad_()
    out = kernel_fn(kind)(x, y, lam)
    assert out.dtype == dtype
    xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    ref = dense_kernel(xd, yd, lam, kind)
    torch.testing.assert_close(out.double(), ref, rtol=rtol_fwd, atol=rtol_fwd * 0.1)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, y), g)
    assert all(t.dtype == dtype for t in got)
    expected = torch.autograd.grad(ref, (xd, yd), g.double())
    assert_grads_close(got, expected, rtol_bwd)


def test_gradcheck_fp64():
    x, y = inputs((2, 6, 5), (2, 4, 5), dtype=torch.float64, seed=9)
    x.requires_grad_()
    y.requires_grad_()
    for fn in (_ops().laplacian_kernel, _ops().gaussian_kernel):
        assert torch.autograd.gradcheck(lambda a, b: fn(a, b, 3.0), (x, y))


def test_non_contiguous_inputs():
    base_x, base_y = inputs((2, 40, 3, 64), (2, 3, 64, 19))
    x = base_x.transpose(1, 2)[..., ::2]       # (2, 3, 40, 32), strided
    y = base_y.transpose(-1, -2)[..., 1::2]    # (2, 3, 19, 32), strided
    assert not x.is_contiguous() and not y.is_contiguous()
    x.requires_grad_()
    y.requires_grad_()
    out = _ops().laplacian_kernel(x, y, 4.0)
    xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    ref = dense_kernel(xd, yd, 4.0, 'laplacian')
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-7)
    g = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, (x, y), g),
                       torch.autograd.grad(ref, (xd, yd), g.double()), 1e-5)


@real_gpu_only
def test_runs_on_the_current_stream():
    """Inputs written late on a side stream must be seen by the kernel on that stream."""
    x0, y = inputs((8, 512, 32), (8, 64, 32))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy
        x = x0 * 2.0
        out = _ops().laplacian_kernel(x, y, 4.0)
        pinv = _ops().newton_schulz_pinv(
            _ops().laplacian_kernel(y, y, 4.0) + 0.01 * torch.eye(64, device=DEV), 20)
    side.synchronize()
    torch.testing.assert_close(out.double(),
                               dense_kernel(2.0 * x0.double(), y.double(), 4.0, 'laplacian'),
                               rtol=1e-5, atol=1e-7)
    w = dense_kernel(y.double(), y.double(), 4.0, 'laplacian') + 0.01 * torch.eye(64, device=DEV)
    assert (torch.eye(64, device=DEV) - w @ pinv.double()).abs().max() < 1e-2


@pytest.mark.parametrize('batch, n, m', [(1, 3136, 49),
                                         pytest.param(70_000, 3, 2, marks=real_gpu_only)])
def test_batch_heads_small_and_beyond_grid_limit(batch, n, m):
    """batch = 70000 exceeds gridDim.z (65535): blocks must loop over the batch."""
    x, y = inputs((batch, n, 8), (batch, m, 8), seed=5)
    x.requires_grad_()
    y.requires_grad_()
    out = _ops().laplacian_kernel(x, y, 4.0)
    xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    ref = dense_kernel(xd, yd, 4.0, 'laplacian')
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-7)
    g = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, (x, y), g),
                       torch.autograd.grad(ref, (xd, yd), g.double()), 1e-5)


@real_gpu_only
def test_matches_reference_path_at_attention_size():
    from lapformer_mm.ops import laplacian_kernel
    x, y = inputs((64, 3136, 32), (64, 49, 32), seed=2)
    x.requires_grad_()
    y.requires_grad_()
    out = _ops().laplacian_kernel(x, y, 4.0)
    ref = laplacian_kernel(x, y, 4.0, backend='reference')
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-7)
    g = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, (x, y), g), torch.autograd.grad(ref, (x, y), g),
                       1e-4)


def test_backward_is_deterministic():
    x, y = inputs((4, 5000, 32), (4, 64, 32), seed=4)
    x.requires_grad_()
    y.requires_grad_()
    g = torch.randn(4, 5000, 64, device=DEV)
    first = torch.autograd.grad(_ops().laplacian_kernel(x, y, 4.0), (x, y), g)
    second = torch.autograd.grad(_ops().laplacian_kernel(x, y, 4.0), (x, y), g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@real_gpu_only
def test_autocast_runs_in_fp32():
    x, y = inputs((2, 50, 32), (2, 49, 32))
    with torch.autocast('cuda', dtype=torch.float16):
        out = _ops().laplacian_kernel(x.half(), y.half(), 4.0)
        P = _ops().laplacian_kernel(y, y, 4.0) + 0.01 * torch.eye(49, device=DEV)
        X = _ops().newton_schulz_pinv(P, 20)
    assert out.dtype == torch.float32 and X.dtype == torch.float32
    torch.testing.assert_close(out.double(),
                               dense_kernel(x.half().double(), y.half().double(), 4.0, 'laplacian'),
                               rtol=1e-5, atol=1e-7)


def spd(batch, m, dtype, seed=0):
    """Landmark-like SPD matrices: Laplacian kernel of smooth points + 0.01 I.

    Condition numbers reach ~1000 at m = 128 (measured with the reference iterations).
    """
    gen = torch.Generator(device=DEV).manual_seed(seed)
    pts = torch.randn(batch, m, 32, generator=gen, device=DEV, dtype=torch.float64).cumsum(1) * 0.02
    eye = torch.eye(m, device=DEV, dtype=torch.float64)
    return (dense_kernel(pts, pts, 4.0, 'laplacian') + 0.01 * eye).to(dtype)


@pytest.mark.parametrize('init', ['identity', 'authors'])
@pytest.mark.parametrize('m', [1, 7, 49, 64, 100, 128, 150])
def test_newton_schulz_equals_inverse(m, init):
    """m = 150 exceeds the fused solver and takes the batched-matmul path."""
    P = spd(3, m, torch.float32, seed=m)
    X = _ops().newton_schulz_pinv(P, 60, init)
    inv = torch.linalg.inv(P.double())
    torch.testing.assert_close(X.double(), inv, rtol=1e-3, atol=1e-3 * inv.abs().max().item())
    twin = _iterate(P, 60, init)
    torch.testing.assert_close(X, twin, rtol=1e-4, atol=1e-4 * twin.abs().max().item())


@real_gpu_only
def test_newton_schulz_fp64_and_many_matrices():
    P = spd(70_000, 5, torch.float64, seed=1)
    X = _ops().newton_schulz_pinv(P, 40)
    torch.testing.assert_close(X, torch.linalg.inv(P), rtol=1e-9, atol=1e-9)


def test_newton_schulz_backward_closed_form():
    P = spd(2, 16, torch.float64, seed=3).requires_grad_()
    X = _ops().newton_schulz_pinv(P, 60)
    G = torch.randn_like(X)
    (got,) = torch.autograd.grad(X, P, G)
    Pd = P.detach().requires_grad_()
    (expected,) = torch.autograd.grad(torch.linalg.inv(Pd), Pd, G)
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-10)


@real_gpu_only
def test_compile_error_names_the_kernel():
    rt = _rt()
    with pytest.raises(rt.CudaOpsError, match='no_such_kernel'):
        rt.get_function(0, rt.PAIRWISE_SOURCE, 'no_such_kernel<float>')


def test_torch_compile_on_cuda():
    x, y = inputs((2, 300, 32), (2, 49, 32))
    x.requires_grad_()
    ops = _ops()

    def f(a, b):
        c = ops.laplacian_kernel(a, b, 4.0)
        w = ops.laplacian_kernel(b, b, 4.0) + 0.01 * torch.eye(49, device=DEV)
        return (c @ ops.newton_schulz_pinv(w, 16)).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend='aot_eager')
    out = compiled(x, y)
    (gx,) = torch.autograd.grad(out, x)
    expected = f(x, y)
    (ex,) = torch.autograd.grad(expected, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, ex, rtol=1e-5, atol=1e-6)


def test_sign_of_subnormal_differences_and_operands():
    """CuPy compiles with -ftz=true; the gradient's sign must still see x - y = 2^-149
    between normal floats, and subnormal operands, as PyTorch's CPU sign does."""
    tiny = torch.finfo(torch.float32).tiny  # 2^-126, the smallest normal float
    x = torch.tensor([[[tiny], [1e-40], [-1e-40], [0.0]]], device=DEV)
    x[0, 0, 0] = torch.nextafter(x[0, 0, 0], torch.tensor(1.0, device=DEV))
    y = torch.tensor([[[tiny], [0.0]]], device=DEV)
    x.requires_grad_()
    y.requires_grad_()
    out = _ops().laplacian_kernel(x, y, 4.0)
    gx, gy = torch.autograd.grad(out, (x, y), torch.ones_like(out))
    # dK/dx_i = -sum_j K_ij sign(x_i - y_j) / 4, with K = 1 to fp32 precision here.
    xs, ys = x.detach().cpu().double(), y.detach().cpu().double()
    sign = torch.sign(xs[0, :, None, 0] - ys[0, None, :, 0])
    torch.testing.assert_close(gx.cpu().double()[0, :, 0], -sign.sum(1) / 4.0)
    torch.testing.assert_close(gy.cpu().double()[0, :, 0], sign.sum(0) / 4.0)


def test_registered_ops_enforce_their_contract():
    """torch.ops.lapformer_mm.* with impl='cupy' are callable directly: strided inputs give the
    result, mixed dtypes or devices a clear error instead of reading past an allocation."""
    ops = torch.ops.lapformer_mm
    x, y = inputs((2, 40, 64), (2, 9, 32), seed=6)
    xs = x[..., ::2]
    assert not xs.is_contiguous()
    got = ops.pairwise_kernel(xs, y, 4.0, 'laplacian', 'cupy')
    torch.testing.assert_close(got.double(),
                               dense_kernel(xs.double(), y.double(), 4.0, 'laplacian'),
                               rtol=1e-5, atol=1e-7)
    with pytest.raises(TypeError, match='y has dtype torch.float16 but x has torch.float32'):
        ops.pairwise_kernel(xs, y.half(), 4.0, 'laplacian', 'cupy')
    if DEV == 'cuda':
        with pytest.raises(ValueError, match='y is on cpu but x is on cuda'):
            ops.pairwise_kernel(xs, y.cpu(), 4.0, 'laplacian', 'cupy')
    with pytest.raises(TypeError, match=r'P has dtype torch.float16'):
        ops.newton_schulz(torch.eye(4, device=DEV).half().expand(2, 4, 4), 3, 'identity', 'cupy')


def test_newton_schulz_with_p_in_global_memory():
    """The variant for devices whose shared memory holds only X and T (A100 at m = 128)."""
    rt = _rt()
    P = spd(3, 49, torch.float32, seed=11)
    mp, ld = rt.newton_schulz_stride(49)
    from lapformer_mm.ops import cupy_ops
    X = cupy_ops.fused_newton_schulz(P, 40, False, smem_limit=2 * 4 * mp * ld + rt.NS_STATIC_SMEM)
    torch.testing.assert_close(X, _iterate(P, 40, 'identity'), rtol=1e-4,
                               atol=1e-4 * X.abs().max().item())
