"""The CUDA kernels' logic, run on the CPU.

``ops/*.cu`` are compiled unchanged by g++ under ``tests/cuda_emu/shim.h``
(threads of a block are std::threads, ``__syncthreads`` a std::barrier,
``__shared__`` static storage, blocks one at a time) and launched through
``cupy_ops``'s own host code, with ``cuda_runtime.launch`` replaced by the
emulator: launch geometry, split-K partial sums, dtype handling and argument
packing are the ones the GPU gets. Results are compared with dense float64
formulas and ``torch.linalg.inv``. Shapes are small and odd (N = 1, M = 1,
d = 17, sizes that are not multiples of the tiles).
"""
import shutil
import subprocess

import pytest
import torch
from _attention_helpers import dense_kernel as dense_kernel_named
from _emulation_fixtures import emu_lib  # noqa: F401 (a fixture)

from devtools.cuda_emulation import EMU_DIR, build_command, make_launch
from lapformer_mm.ops import cuda_runtime as rt
from lapformer_mm.ops import cupy_ops, dispatch
from lapformer_mm.ops.solvers import newton_schulz_iterate


@pytest.fixture
def emulated(emu_lib, monkeypatch):  # noqa: F811 (the imported fixture)
    """Route ``cuda_runtime.launch`` to the CPU emulation; records launches."""
    launches = []
    monkeypatch.setattr(rt, 'launch', make_launch(emu_lib, launches))
    return launches


def dense_kernel(x, y, lam, kind):
    """The kernel of the CUDA kind code ``kind`` (rt.LAPLACIAN / rt.GAUSSIAN), dense."""
    name = {code: name for name, code in rt.KINDS.items()}[kind]
    return dense_kernel_named(x, y, lam, name)


def make_inputs(batch, n, m, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n, d, generator=gen, dtype=torch.float64)
    y = torch.randn(batch, m, d, generator=gen, dtype=torch.float64)
    if n > 1 and m > 1:
        # Ties x_it == y_jt exercise sign(0) = 0 in the Laplacian gradient.
        y[:, 0] = x[:, 0]
        y[:, 1, : d // 2] = x[:, -1, : d // 2]
    return x.to(dtype), y.to(dtype)


def test_every_instantiation_is_emulated(emu_lib):  # noqa: F811 (the imported fixture)
    for names in rt.all_name_expressions().values():
        for name in names:
            assert emu_lib.emu_has_kernel(name.encode()) == 1, name


SHAPES = [(1, 1, 1, 1), (2, 1, 5, 17), (1, 7, 1, 17), (1, 70, 3, 17), (3, 65, 67, 33),
          (1, 5, 9, 128), (1, 3, 4, 130)]


@pytest.mark.parametrize('kind', [rt.LAPLACIAN, rt.GAUSSIAN])
@pytest.mark.parametrize('shape', SHAPES)
def test_forward_matches_dense_fp32(emulated, kind, shape):
    x, y = make_inputs(*shape, torch.float32, seed=sum(shape))
    lam = 4.0 if kind == rt.LAPLACIAN else 40.0
    out = cupy_ops.fused_pairwise_forward(x, y, lam, kind)
    expected = dense_kernel(x.double(), y.double(), lam, kind)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-7)
    assert emulated and emulated[0][0] == rt.pairwise_forward_name('float', kind)


@pytest.mark.parametrize('dtype, rtol, atol', [(torch.float64, 1e-12, 1e-14),
                                               (torch.float16, 1e-3, 1e-4),
                                               (torch.bfloat16, 8e-3, 1e-3)])
@pytest.mark.parametrize('kind', [rt.LAPLACIAN, rt.GAUSSIAN])
def test_forward_other_dtypes(emulated, kind, dtype, rtol, atol):
    """16-bit inputs are read exactly, accumulated in fp32 and rounded once on output."""
    x, y = make_inputs(2, 33, 17, 17, dtype, seed=3)
    lam = 4.0 if kind == rt.LAPLACIAN else 40.0
    out = cupy_ops.fused_pairwise_forward(x, y, lam, kind)
    assert out.dtype == dtype
    expected = dense_kernel(x.double(), y.double(), lam, kind)
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)


def dense_grads(x, y, g, lam, kind):
    xd = x.double().requires_grad_()
    yd = y.double().requires_grad_()
    k = dense_kernel(xd, yd, lam, kind)
    return torch.autograd.grad(k, (xd, yd), g.double())


@pytest.mark.parametrize('blocks', [1, 10_000])
@pytest.mark.parametrize('kind', [rt.LAPLACIAN, rt.GAUSSIAN])
@pytest.mark.parametrize('shape', [(1, 1, 1, 1), (2, 1, 5, 17), (1, 70, 3, 17), (2, 97, 66, 33),
                                   (1, 5, 9, 128)])
def test_backward_matches_autograd_of_dense(emulated, kind, shape, blocks):
    """blocks=10000 forces split-K slices on every reduction, blocks=1 none."""
    x, y = make_inputs(*shape, torch.float32, seed=7 + sum(shape))
    lam = 4.0 if kind == rt.LAPLACIAN else 40.0
    kmat = cupy_ops.fused_pairwise_forward(x, y, lam, kind)
    g = torch.randn(kmat.shape, generator=torch.Generator().manual_seed(1))
    dx, dy = cupy_ops.fused_pairwise_backward(g, kmat, x, y, lam, kind, True, True, blocks)
    ex, ey = dense_grads(x, y, g, lam, kind)
    torch.testing.assert_close(dx.double(), ex, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dy.double(), ey, rtol=1e-5, atol=1e-6)


def test_backward_splits_the_long_reduction(emulated):
    """dy of 1 landmark against many queries is spread over several blocks."""
    x, y = make_inputs(1, 300, 1, 17, torch.float32, seed=11)
    kmat = cupy_ops.fused_pairwise_forward(x, y, 4.0, rt.LAPLACIAN)
    g = torch.ones_like(kmat)
    _, dy = cupy_ops.fused_pairwise_backward(g, kmat, x, y, 4.0, rt.LAPLACIAN, False, True, 8)
    name, grid, _, _ = emulated[-1]
    assert name == rt.pairwise_backward_name('float', rt.LAPLACIAN, True)
    assert grid[0] > 1
    _, ey = dense_grads(x, y, g, 4.0, rt.LAPLACIAN)
    torch.testing.assert_close(dy.double(), ey, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('dtype, rtol', [(torch.float16, 2e-2), (torch.bfloat16, 5e-2),
                                         (torch.float64, 1e-10)])
def test_backward_other_dtypes(emulated, dtype, rtol):
    x, y = make_inputs(2, 33, 17, 17, dtype, seed=5)
    kmat = cupy_ops.fused_pairwise_forward(x, y, 4.0, rt.LAPLACIAN)
    g = torch.randn(kmat.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    dx, dy = cupy_ops.fused_pairwise_backward(g, kmat, x, y, 4.0, rt.LAPLACIAN, True, True, 64)
    assert dx.dtype == dtype and dy.dtype == dtype
    # The reference takes the same rounded kernel matrix: g * K is formed from it.
    w = g.double() * kmat.double()
    sign = torch.sign(x.double().unsqueeze(-2) - y.double().unsqueeze(-3))
    ex = -(w.unsqueeze(-1) * sign).sum(-2) / 4.0
    ey = (w.unsqueeze(-1) * sign).sum(-3) / 4.0
    scale = max(ex.abs().max().item(), ey.abs().max().item())
    torch.testing.assert_close(dx.double(), ex, rtol=rtol, atol=rtol * scale)
    torch.testing.assert_close(dy.double(), ey, rtol=rtol, atol=rtol * scale)


def spd_batch(batch, m, dtype, seed):
    """Landmark-like SPD matrices: Laplacian kernel of smooth points + 0.01 I."""
    gen = torch.Generator().manual_seed(seed)
    pts = torch.randn(batch, m, 8, generator=gen, dtype=torch.float64).cumsum(1) * 0.3
    P = dense_kernel(pts, pts, 4.0, rt.LAPLACIAN) + 0.01 * torch.eye(m, dtype=torch.float64)
    return P.to(dtype)


@pytest.mark.parametrize('p_in_shared', [True, False])
@pytest.mark.parametrize('authors', [False, True])
@pytest.mark.parametrize('m', [1, 5, 8, 33, 49])
def test_newton_schulz_matches_matmul_iterations(emulated, m, authors, p_in_shared):
    P = spd_batch(3, m, torch.float64, seed=m)
    # Room for exactly 2 or 3 padded m x m matrices (plus the static norm scalar).
    mp, ld = rt.newton_schulz_stride(m)
    matrices = 3 if p_in_shared else 2
    out = cupy_ops.fused_newton_schulz(P, 12, authors,
                                       smem_limit=matrices * 8 * mp * ld + rt.NS_STATIC_SMEM)
    assert emulated[-1][0] == rt.newton_schulz_name('double', p_in_shared)
    assert emulated[-1][3] == matrices * 8 * mp * ld
    expected = newton_schulz_iterate(P, 12, 'authors' if authors else 'identity')
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_newton_schulz_converges_to_inverse_fp32(emulated):
    P = spd_batch(2, 20, torch.float32, seed=4)
    out = cupy_ops.fused_newton_schulz(P, 40, False, smem_limit=48 * 1024)
    inv = torch.linalg.inv(P.double())
    residual = torch.linalg.matrix_norm(torch.eye(20) - P.double() @ out.double(), ord=2)
    assert residual.max() < 1e-3
    torch.testing.assert_close(out.double(), inv, rtol=1e-3, atol=1e-3 * inv.abs().max().item())


def test_newton_schulz_too_large_for_shared_memory_returns_none(emulated):
    P = spd_batch(1, 64, torch.float32, seed=0)
    assert cupy_ops.fused_newton_schulz(P, 3, False, smem_limit=2 * 4 * 64 * 64) is None
    assert not emulated


def test_blocks_loop_beyond_the_grid_limits(emulated, monkeypatch):
    """With grid.y = grid.z = 1 (and 1 block for Newton–Schulz) every block must loop
    over row tiles and batch entries, as it does past 65535 on a GPU."""
    monkeypatch.setattr(rt, 'MAX_GRID_YZ', 1)
    x, y = make_inputs(3, 130, 66, 17, torch.float32, seed=21)
    kmat = cupy_ops.fused_pairwise_forward(x, y, 4.0, rt.LAPLACIAN)
    assert emulated[-1][1] == (2, 1, 1)
    torch.testing.assert_close(kmat.double(),
                               dense_kernel(x.double(), y.double(), 4.0, rt.LAPLACIAN),
                               rtol=1e-5, atol=1e-7)
    g = torch.randn(kmat.shape, generator=torch.Generator().manual_seed(3))
    dx, dy = cupy_ops.fused_pairwise_backward(g, kmat, x, y, 4.0, rt.LAPLACIAN, True, True, 4)
    ex, ey = dense_grads(x, y, g, 4.0, rt.LAPLACIAN)
    torch.testing.assert_close(dx.double(), ex, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dy.double(), ey, rtol=1e-5, atol=1e-6)

    monkeypatch.setattr(rt, 'MAX_GRID_X', 1)
    P = spd_batch(4, 6, torch.float64, seed=2)
    out = cupy_ops.fused_newton_schulz(P, 10, False, smem_limit=48 * 1024)
    assert emulated[-1][1] == (1,)
    torch.testing.assert_close(out, newton_schulz_iterate(P, 10, 'identity'), rtol=1e-10,
                               atol=1e-12)


@pytest.fixture
def cupy_backend(emulated, monkeypatch):
    """The public functions choose the CuPy kernels for CPU tensors, run by the emulation."""
    monkeypatch.setattr(dispatch, '_DECIDED', {(None, 'cpu'): 'cupy'})
    monkeypatch.setattr(cupy_ops, 'target_blocks', lambda device: 16)
    monkeypatch.setattr(rt, 'shared_memory_optin', lambda device_index: 48 * 1024)
    return emulated


def test_public_functions_end_to_end_on_emulated_kernels(cupy_backend):
    """laplacian_kernel / gaussian_kernel / newton_schulz_pinv with autograd and strided
    inputs, through the registered ops' impl='cupy' path."""
    from lapformer_mm.ops import gaussian_kernel, laplacian_kernel, newton_schulz_pinv
    gen = torch.Generator().manual_seed(8)
    # (2, 3, 40, 17), strided
    x = torch.randn(2, 3, 34, 40, generator=gen).transpose(-1, -2)[..., ::2].requires_grad_()
    y = torch.randn(2, 3, 5, 17, generator=gen).requires_grad_()
    for fn, kind, lam in ((laplacian_kernel, rt.LAPLACIAN, 4.0),
                          (gaussian_kernel, rt.GAUSSIAN, 30.0)):
        out = fn(x, y, lam)
        xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
        ref = dense_kernel(xd, yd, lam, kind)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-7)
        g = torch.randn(out.shape, generator=gen)
        for got, expected in zip(torch.autograd.grad(out, (x, y), g),
                                 torch.autograd.grad(ref, (xd, yd), g.double())):
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    names = {launch[0] for launch in cupy_backend}
    assert rt.pairwise_backward_name('float', rt.GAUSSIAN, True) in names

    P = spd_batch(2, 9, torch.float64, seed=6).requires_grad_()
    X = newton_schulz_pinv(P, 40)
    torch.testing.assert_close(X, torch.linalg.inv(P.detach()), rtol=1e-10, atol=1e-10)
    assert cupy_backend[-1][0] == rt.newton_schulz_name('double', True)
    (grad,) = torch.autograd.grad(X.sum(), P)
    inv = torch.linalg.inv(P.detach())
    torch.testing.assert_close(grad, -(inv.mT @ torch.ones_like(inv) @ inv.mT), rtol=1e-9,
                               atol=1e-9)


def test_composite_attention_on_emulated_kernels_matches_dense_reference(cupy_backend):
    """The composite path (here the 'exact' solver) with every kernel matrix on the CUDA
    kernels."""
    from _attention_helpers import dense_attention

    from lapformer_mm.ops import nystrom_attention, pool_landmarks
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 48, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 48, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, 48, 8, generator=gen, dtype=torch.float64)
    landmarks = pool_landmarks(k, (6, 8), 4)
    out = nystrom_attention(q, k, v, landmarks, solver='exact')
    torch.testing.assert_close(out, dense_attention(q, k, v, landmarks), rtol=1e-8, atol=1e-10)
    names = {launch[0] for launch in cupy_backend}
    assert names == {rt.pairwise_forward_name('double', rt.LAPLACIAN)}


def test_registered_ops_hand_the_kernels_contiguous_operands(cupy_backend):
    """Called directly with strided inputs, the raw ops still give the dense result: the
    kernels index raw pointers as contiguous (a strided x read that way was off by 0.1)."""
    x, y = make_inputs(2, 33, 9, 34, torch.float32, seed=12)
    xs, ys = x[..., ::2], y.transpose(1, 2).contiguous().transpose(1, 2)[..., 1::2]
    assert not xs.is_contiguous() and not ys.is_contiguous()
    out = torch.ops.lapformer_mm.pairwise_kernel(xs, ys, 4.0, 'laplacian', 'cupy')
    torch.testing.assert_close(out.double(),
                               dense_kernel(xs.double(), ys.double(), 4.0, rt.LAPLACIAN),
                               rtol=1e-5, atol=1e-7)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    g = g.transpose(1, 2).contiguous().transpose(1, 2)
    dx, dy = torch.ops.lapformer_mm.pairwise_kernel_backward(g, out, xs, ys, 4.0, 'laplacian',
                                                             True, True, 'cupy')
    ex, ey = dense_grads(xs, ys, g, 4.0, rt.LAPLACIAN)
    torch.testing.assert_close(dx.double(), ex, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dy.double(), ey, rtol=1e-5, atol=1e-6)
    assert len(cupy_backend) == 3  # forward, then one backward launch per operand


def test_kernels_are_free_of_data_races_under_thread_sanitizer(tmp_path):
    """tests/cuda_emu/tsan_main.cpp launches every kernel family on the emulation built with
    -fsanitize=thread: a missing __syncthreads() between a shared-memory write and another
    thread's read is a reported race (removing the barrier before Newton–Schulz's update
    of X is reported, checked by hand)."""
    if shutil.which('g++') is None:
        pytest.skip('g++ (C++20) is needed to build the CPU emulation of the CUDA kernels')
    exe = tmp_path / 'tsan_main'
    command = build_command(exe, '-fsanitize=thread', '-g', str(EMU_DIR / 'tsan_main.cpp'))
    build = subprocess.run([c if c != '-O2' else '-O1' for c in command], capture_output=True,
                           text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={'TSAN_OPTIONS': 'halt_on_error=1 exitcode=66'})
    assert run.returncode == 0 and 'ThreadSanitizer' not in run.stderr, run.stderr[-4000:]
    assert 'launched, rc=0' in run.stdout
