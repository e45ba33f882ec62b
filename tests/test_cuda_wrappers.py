"""The Python wiring of the registered ops and of the CUDA launches, tested on the CPU.

The ops' reference implementation runs here, so fake tensors, autograd
registration and ``torch.compile`` of the public path are covered; the CuPy host
code is driven by a fake CuPy. The kernels themselves are covered by
``test_cuda_emulation.py`` and, on a GPU, ``test_cuda_ops.py``.
"""
import pytest
import torch

from devtools import fake_cupy as fake_cupy_module
from devtools.fake_cupy import FakeCudaTensor as FakeTensor
from lapformer_mm.ops import (
    AttentionOptions,
    gaussian_kernel,
    laplacian_kernel,
    newton_schulz_pinv,
    nystrom_forward,
    pool_landmarks,
)
from lapformer_mm.ops import cuda_runtime as rt


def spd(batch, m):
    gen = torch.Generator().manual_seed(m)
    a = torch.randn(batch, m, m, generator=gen, dtype=torch.float64)
    return a @ a.mT / m + torch.eye(m, dtype=torch.float64)


def test_registered_ops_pass_opcheck():
    """Schema, fake implementation and autograd registration agree with the real op."""
    ops = torch.ops.lapformer_mm
    x = torch.randn(2, 5, 3, requires_grad=True)
    y = torch.randn(2, 4, 3, requires_grad=True)
    kmat = ops.pairwise_kernel(x, y, 4.0, 'laplacian', 'reference')
    for kind in ('laplacian', 'gaussian'):
        torch.library.opcheck(ops.pairwise_kernel, (x, y, 4.0, kind, 'reference'))
    torch.library.opcheck(ops.pairwise_kernel_backward,
                          (torch.randn_like(kmat), kmat.detach(), x.detach(), y.detach(), 4.0,
                           'gaussian', True, False, 'reference'))
    torch.library.opcheck(ops.pairwise_kernel_backward,
                          (torch.randn_like(kmat), kmat.detach(), x.detach(), y.detach(), 4.0,
                           'laplacian', False, True, 'reference'))
    torch.library.opcheck(ops.newton_schulz, (spd(2, 4).float().requires_grad_(), 5, 'identity',
                                              'reference'))


def test_pairwise_only_requested_gradients():
    x = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(1, 2, 3, dtype=torch.float64)
    laplacian_kernel(x, y, 4.0).sum().backward()
    assert x.grad.shape == x.shape and y.grad is None


def test_public_functions_trace_in_one_graph():
    """Argument checks, the backend choice and the ops do not break Dynamo's graph."""
    options = AttentionOptions()

    def core(q, landmarks):
        c = laplacian_kernel(q, landmarks, 4.0)
        w = gaussian_kernel(landmarks, landmarks, 16.0)
        p = w + 0.01 * torch.eye(w.shape[-1])
        attn = nystrom_forward(q, q, q, pool_landmarks(q, (3, 3), 2), options)
        return (c @ newton_schulz_pinv(p, 8)).sum() + attn.sum()

    torch._dynamo.reset()
    compiled = torch.compile(core, fullgraph=True, backend='aot_eager')
    q = torch.randn(2, 1, 9, 4, requires_grad=True)
    lm = torch.randn(2, 1, 3, 4, requires_grad=True)
    out = compiled(q, lm)
    grads = torch.autograd.grad(out, (q, lm))
    expected = core(q, lm)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads, torch.autograd.grad(expected, (q, lm)))


def test_launch_geometry_covers_grid_limits():
    grid, _ = rt.pairwise_forward_launch(batch=100_000, n=5_000_000, m=70)
    assert grid == (2, rt.MAX_GRID_YZ, rt.MAX_GRID_YZ)
    grid, _, splits, chunk = rt.pairwise_backward_launch(4, 64, 67_200, 32, target_blocks=528)
    assert splits * chunk >= 67_200 and chunk % rt.PB_TJ == 0 and grid[0] == splits
    assert rt.newton_schulz_launch(8, 128, 4, 48 * 1024) is None
    # Padded layouts: m = 128 -> 128 x 132, m = 64 -> 64 x 68, m = 49 -> 52 x 52.
    assert rt.newton_schulz_stride(128) == (128, 132) and rt.newton_schulz_stride(64) == (64, 68)
    assert rt.newton_schulz_stride(49) == (52, 52) and rt.newton_schulz_stride(1) == (4, 4)
    # H100/H200 (227 KiB opt-in): P, X, T in shared memory; A100 (163 KiB): P stays global.
    assert (rt.newton_schulz_launch(8, 128, 4, 227 * 1024)
            == ((8,), (1024, 1, 1), 3 * 4 * 128 * 132, 1))
    assert (rt.newton_schulz_launch(8, 128, 4, 163 * 1024)
            == ((8,), (1024, 1, 1), 2 * 4 * 128 * 132, 0))
    assert rt.newton_schulz_launch(64, 49, 4, 48 * 1024) == ((64,), (192, 1, 1), 3 * 4 * 52 * 52, 1)
    assert rt.newton_schulz_launch(8, 129, 4, 10 ** 9) is None
    with pytest.raises(ValueError, match='d=.*grid limit'):
        rt.pairwise_backward_launch(1, 64, 64, 2 ** 40, target_blocks=1)


@pytest.fixture
def fake_cupy(monkeypatch):
    def install(**kwargs):
        return fake_cupy_module.install(rt, monkeypatch.setattr, current_device=1, **kwargs)[0]
    return install


def test_launch_compiles_once_per_dtype_on_the_tensors_device_and_stream(fake_cupy):
    fake = fake_cupy()
    name = rt.pairwise_forward_name('float', rt.LAPLACIAN)
    for _ in range(2):
        rt.launch(rt.PAIRWISE_SOURCE, name, FakeTensor(), (1, 2, 3), (16, 16, 1), (1, 2),
                  shapes='x')
    rt.launch(rt.PAIRWISE_SOURCE, rt.pairwise_backward_name('float', rt.GAUSSIAN, True),
              FakeTensor(), (1, 1, 1), (16, 16, 1), ())
    compiles = [e for e in fake.events if e[0] == 'compile']
    assert len(compiles) == 1 and name in compiles[0][1] and len(compiles[0][1]) == 6
    assert compiles[0][2] == rt.NVRTC_OPTIONS and compiles[0][3] == 'nvrtc'
    launches = [e for e in fake.events if e[0] == 'launch']
    assert launches[0] == ('launch', name, (1, 2, 3), (16, 16, 1), 2, 0, 12345)
    assert len(launches) == 3


def test_launch_opts_into_large_dynamic_shared_memory_once(fake_cupy):
    fake = fake_cupy()
    name = rt.newton_schulz_name('float', True)
    for _ in range(2):
        rt.launch(rt.NEWTON_SCHULZ_SOURCE, name, FakeTensor(), (8,), (256, 1, 1), (),
                  shared_mem=49152)
    assert [e for e in fake.events if e[0] == 'optin'] == [('optin', 49152)]


def test_compile_and_launch_failures_name_kernel_and_shapes(fake_cupy):
    fake_cupy(fail_compile=True)
    with pytest.raises(rt.CudaOpsError, match=r'pairwise_forward<float, 0>.*oops'):
        rt.launch(rt.PAIRWISE_SOURCE, rt.pairwise_forward_name('float', 0), FakeTensor(), (1,),
                  (1,), ())
    fake_cupy(fail_launch=True)
    with pytest.raises(rt.CudaOpsError,
                       match=r'newton_schulz<float, true>.*x \(2, 3\).*too many resources'):
        rt.launch(rt.NEWTON_SCHULZ_SOURCE, rt.newton_schulz_name('float', True), FakeTensor(),
                  (1,), (1,), (), shapes='x (2, 3)')


def test_cuda_ops_import_without_openmmlab():
    """The GPU check machine has torch and CuPy but no OpenMMLab package."""
    import subprocess
    import sys
    from pathlib import Path
    code = '''
import sys
BLOCKED = {'mmengine', 'mmcv', 'mmdet', 'mmseg', 'mmpretrain'}
class Absent:
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, Absent())
import lapformer_mm.ops.cupy_ops
import lapformer_mm.ops.kernels
print(sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED))
'''
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, '-c', code], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == '[]'


def test_cuda_entry_points_enforce_the_kernels_contract():
    """With impl='cupy' the ops check what the kernels assume before any launch: one
    dtype for all operands, consistent shapes (and one device: checked by the same code,
    run on a GPU in test_cuda_ops.py)."""
    ops = torch.ops.lapformer_mm
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 30, 16, generator=gen)[..., ::2]
    y = torch.randn(2, 7, 8, generator=gen)
    with pytest.raises(TypeError,
                       match='pairwise_kernel: y has dtype torch.float16 but x has torch.float32'):
        ops.pairwise_kernel(x, y.half(), 4.0, 'laplacian', 'cupy')
    with pytest.raises(ValueError, match=r'x must be \(batch, n, d\) and y \(batch, m, d\)'):
        ops.pairwise_kernel(x, y[..., :5], 4.0, 'laplacian', 'cupy')
    with pytest.raises(TypeError, match=r"x has dtype torch.int64; allowed"):
        ops.pairwise_kernel(x.long(), y.long(), 4.0, 'laplacian', 'cupy')
    g = torch.randn(2, 30, 7, generator=gen)
    with pytest.raises(ValueError, match=r'kmat must be \(batch, n, m\) = \(2, 30, 7\)'):
        ops.pairwise_kernel_backward(g, g[:, :5], x, y, 4.0, 'laplacian', True, True, 'cupy')
    with pytest.raises(TypeError, match='grad has dtype torch.float64 but x has torch.float32'):
        ops.pairwise_kernel_backward(g.double(), g, x, y, 4.0, 'laplacian', True, True, 'cupy')
    P = torch.eye(4).expand(3, 4, 4)
    allowed = r"\['torch.float32', 'torch.float64'\]"
    with pytest.raises(TypeError, match=r'newton_schulz: P has dtype torch.float16; allowed: '
                                        + allowed):
        ops.newton_schulz(P.half(), 3, 'identity', 'cupy')
    with pytest.raises(ValueError, match=r'P must be \(batch, m, m\)'):
        ops.newton_schulz(P[:, :3], 3, 'identity', 'cupy')


def test_reference_ops_take_strided_operands():
    ops = torch.ops.lapformer_mm
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 30, 16, generator=gen)[..., ::2]
    y = torch.randn(2, 7, 8, generator=gen)
    expected = torch.exp(-(x[:, :, None] - y[:, None]).abs().sum(-1) / 4.0)
    torch.testing.assert_close(ops.pairwise_kernel(x, y, 4.0, 'laplacian', 'reference'), expected)
    P = torch.eye(4).expand(3, 4, 4)
    torch.testing.assert_close(ops.newton_schulz(2.0 * P, 30, 'identity', 'reference'), 0.5 * P)


def test_ops_compute_in_fp32_under_autocast():
    x, y = torch.randn(2, 7, 4).bfloat16(), torch.randn(2, 3, 4).bfloat16()
    P = spd(2, 3).float()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = laplacian_kernel(x, y, 4.0)
        X = newton_schulz_pinv(P, 20)
    assert out.dtype == torch.float32 and X.dtype == torch.float32
    torch.testing.assert_close(out, laplacian_kernel(x.float(), y.float(), 4.0))
    torch.testing.assert_close(X, newton_schulz_pinv(P, 20))
