"""The Python wiring of the CUDA ops, tested on the CPU.

The custom ops of ``cupy_ops`` have CPU implementations (PyTorch twins of the
kernels), so autograd, broadcasting, fake tensors and ``torch.compile`` of the
wrappers run here; the kernels themselves are covered by
``test_cuda_emulation.py`` and, on a GPU, ``test_cuda_ops.py``.
"""
import pytest
import torch

from lapformer_mm.ops import cuda_runtime as rt
from lapformer_mm.ops import cupy_ops


def pairwise(x, y, lam, kind):
    return cupy_ops.apply_pairwise(x, y, lam, kind)


@pytest.mark.parametrize('kind', [rt.LAPLACIAN, rt.GAUSSIAN])
def test_pairwise_gradcheck_with_broadcast_batch(kind):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(1, 3, 4, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: pairwise(a, b, 3.0, kind), (x, y))
    dense = torch.exp(-(x.unsqueeze(-2) - y.unsqueeze(-3)).abs().sum(-1) / 3.0)
    if kind == rt.LAPLACIAN:
        torch.testing.assert_close(pairwise(x, y, 3.0, kind), dense)


def test_pairwise_only_requested_gradients():
    x = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(1, 2, 3, dtype=torch.float64)
    pairwise(x, y, 4.0, rt.LAPLACIAN).sum().backward()
    assert x.grad.shape == x.shape and y.grad is None


def spd(batch, m):
    gen = torch.Generator().manual_seed(m)
    a = torch.randn(batch, m, m, generator=gen, dtype=torch.float64)
    return a @ a.mT / m + torch.eye(m, dtype=torch.float64)


def test_newton_schulz_closed_form_gradient():
    P = spd(2, 6).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda p: cupy_ops.NewtonSchulzFunction.apply((p + p.mT) / 2, 60, 'identity'), (P,))


def test_newton_schulz_converges_and_keeps_dtype():
    P = spd(3, 9).float()
    x = cupy_ops.NewtonSchulzFunction.apply(P, 40, 'authors')
    assert x.dtype == torch.float32
    torch.testing.assert_close(x.double(), torch.linalg.inv(P.double()), rtol=1e-4, atol=1e-5)


def test_custom_ops_pass_opcheck():
    x, y = torch.randn(2, 5, 3), torch.randn(2, 4, 3)
    kmat = cupy_ops.pairwise_kernel_op(x, y, 4.0, rt.LAPLACIAN)
    torch.library.opcheck(cupy_ops.pairwise_kernel_op, (x, y, 4.0, rt.LAPLACIAN))
    torch.library.opcheck(cupy_ops.pairwise_kernel_backward_op,
                          (torch.randn_like(kmat), kmat, x, y, 4.0, rt.GAUSSIAN, True, False))
    torch.library.opcheck(cupy_ops.pairwise_kernel_backward_op,
                          (torch.randn_like(kmat), kmat, x, y, 4.0, rt.LAPLACIAN, False, True))
    torch.library.opcheck(cupy_ops.newton_schulz_op, (spd(2, 4).float(), 5, False))
    torch.library.opcheck(cupy_ops.newton_schulz_backward_op, (spd(2, 4), spd(2, 4)))


def test_torch_compile_full_graph_matches_eager():
    def attention_core(q, landmarks):
        c = pairwise(q, landmarks, 4.0, rt.LAPLACIAN)
        w = pairwise(landmarks, landmarks, 4.0, rt.LAPLACIAN)
        p = w + 0.01 * torch.eye(w.shape[-1])
        return (c @ cupy_ops.NewtonSchulzFunction.apply(p, 8, 'identity')).sum()

    torch._dynamo.reset()
    compiled = torch.compile(attention_core, fullgraph=True, backend='aot_eager')
    q = torch.randn(2, 9, 4, requires_grad=True)
    lm = torch.randn(2, 3, 4, requires_grad=True)
    out = compiled(q, lm)
    out.backward()
    grads = (q.grad.clone(), lm.grad.clone())
    q.grad = lm.grad = None
    expected = attention_core(q, lm)
    expected.backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads, (q.grad, lm.grad))


@pytest.mark.parametrize('call, error', [
    (lambda: cupy_ops.laplacian_kernel(torch.randn(3, 2), torch.randn(3, 2)), ValueError),
    (lambda: cupy_ops.gaussian_kernel([1.0], torch.randn(3, 2)), TypeError),
    (lambda: cupy_ops.newton_schulz_pinv(torch.eye(3)), ValueError),
])
def test_public_functions_reject_cpu_tensors(call, error):
    with pytest.raises(error, match='x|y|P'):
        call()


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
    assert rt.newton_schulz_launch(8, 128, 4, 227 * 1024) == ((8,), (1024, 1, 1), 3 * 4 * 128 * 132, 1)
    assert rt.newton_schulz_launch(8, 128, 4, 163 * 1024) == ((8,), (1024, 1, 1), 2 * 4 * 128 * 132, 0)
    assert rt.newton_schulz_launch(64, 49, 4, 48 * 1024) == ((64,), (192, 1, 1), 3 * 4 * 52 * 52, 1)
    assert rt.newton_schulz_launch(8, 129, 4, 10 ** 9) is None
    with pytest.raises(ValueError, match='d=.*grid limit'):
        rt.pairwise_backward_launch(1, 64, 64, 2 ** 40, target_blocks=1)


def test_public_functions_trace_in_one_graph(monkeypatch):
    """Argument checks and the k(L, L) alias handling do not break Dynamo's graph.

    The CUDA-only device check is lifted so that the public path runs on the CPU twins.
    """
    monkeypatch.setattr(cupy_ops, '_check_cuda_tensor', lambda *args: None)

    def core(q, landmarks):
        c = cupy_ops.laplacian_kernel(q, landmarks, 4.0)
        w = cupy_ops.gaussian_kernel(landmarks, landmarks, 16.0)
        p = w + 0.01 * torch.eye(w.shape[-1])
        return (c @ cupy_ops.newton_schulz_pinv(p, 8)).sum()

    torch._dynamo.reset()
    compiled = torch.compile(core, fullgraph=True, backend='aot_eager')
    q = torch.randn(2, 9, 4, requires_grad=True)
    lm = torch.randn(2, 3, 4, requires_grad=True)
    out = compiled(q, lm)
    grads = torch.autograd.grad(out, (q, lm))
    expected = core(q, lm)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads, torch.autograd.grad(expected, (q, lm)))


class FakeCupy:
    """Records what cuda_runtime asks of CuPy (no GPU needed)."""

    def __init__(self, fail_compile=False, fail_launch=False):
        self.events = []
        fake = self

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                fake.events.append(('device', self.index))

            def __exit__(self, *exc):
                return False

        class Stream:
            def __init__(self, obj):
                self.obj = obj

            @classmethod
            def from_external(cls, obj):
                return cls(obj)

            def __enter__(self):
                fake.events.append(('stream', self.obj.cuda_stream))

            def __exit__(self, *exc):
                return False

        class Kernel:
            def __init__(self, name):
                self.name = name
                self.max_dynamic_shared_size_bytes = 0

            def __setattr__(self, key, value):
                if key == 'max_dynamic_shared_size_bytes' and value:
                    fake.events.append(('optin', value))
                object.__setattr__(self, key, value)

            def __call__(self, grid, block, args, shared_mem=0):
                if fail_launch:
                    raise RuntimeError('too many resources requested for launch')
                fake.events.append(('launch', self.name, grid, block, len(args), shared_mem))

        class RawModule:
            def __init__(self, code, options, name_expressions, backend):
                fake.events.append(('compile', tuple(name_expressions), options, backend))
                assert '#include "' not in code
                if fail_compile:
                    raise RuntimeError('error: identifier "oops" is undefined')

            def get_function(self, name):
                return Kernel(name)

        self.cuda = type('cuda', (), {'Device': Device, 'Stream': Stream})
        self.RawModule = RawModule


class FakeTorchStream:
    cuda_stream = 12345

    def __cuda_stream__(self):
        return (0, self.cuda_stream)


class FakeTensor:
    device = torch.device('cuda', 1)


@pytest.fixture
def fake_cupy(monkeypatch):
    def install(**kwargs):
        fake = FakeCupy(**kwargs)
        monkeypatch.setattr(rt, 'import_cupy', lambda: fake)
        monkeypatch.setattr(rt, '_functions', {})
        monkeypatch.setattr(rt, '_dynamic_smem_opted', {})
        monkeypatch.setattr(torch.cuda, 'current_stream', lambda device=None: FakeTorchStream())
        return fake
    return install


def test_launch_compiles_once_per_dtype_on_the_tensors_device_and_stream(fake_cupy):
    fake = fake_cupy()
    name = rt.pairwise_forward_name('float', rt.LAPLACIAN)
    for _ in range(2):
        rt.launch(rt.PAIRWISE_SOURCE, name, FakeTensor(), (1, 2, 3), (16, 16, 1), (1, 2), shapes='x')
    rt.launch(rt.PAIRWISE_SOURCE, rt.pairwise_backward_name('float', rt.GAUSSIAN, True), FakeTensor(),
              (1, 1, 1), (16, 16, 1), ())
    compiles = [e for e in fake.events if e[0] == 'compile']
    assert len(compiles) == 1 and name in compiles[0][1] and len(compiles[0][1]) == 6
    assert compiles[0][2] == rt.NVRTC_OPTIONS and compiles[0][3] == 'nvrtc'
    launches = [e for e in fake.events if e[0] == 'launch']
    assert launches[0] == ('launch', name, (1, 2, 3), (16, 16, 1), 2, 0) and len(launches) == 3
    assert ('device', 1) in fake.events and ('stream', FakeTorchStream.cuda_stream) in fake.events


def test_launch_opts_into_large_dynamic_shared_memory_once(fake_cupy):
    fake = fake_cupy()
    name = rt.newton_schulz_name('float', True)
    for _ in range(2):
        rt.launch(rt.NEWTON_SCHULZ_SOURCE, name, FakeTensor(), (8,), (256, 1, 1), (), shared_mem=49152)
    assert [e for e in fake.events if e[0] == 'optin'] == [('optin', 49152)]


def test_compile_and_launch_failures_name_kernel_and_shapes(fake_cupy):
    fake_cupy(fail_compile=True)
    with pytest.raises(rt.CudaOpsError, match=r'pairwise_forward<float, 0>.*oops'):
        rt.launch(rt.PAIRWISE_SOURCE, rt.pairwise_forward_name('float', 0), FakeTensor(), (1,), (1,), ())
    fake_cupy(fail_launch=True)
    with pytest.raises(rt.CudaOpsError, match=r'newton_schulz<float, true>.*x \(2, 3\).*too many resources'):
        rt.launch(rt.NEWTON_SCHULZ_SOURCE, rt.newton_schulz_name('float', True), FakeTensor(), (1,), (1,), (),
                  shapes='x (2, 3)')


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
import lapformer_mm.ops.reference_kernels
print(sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED))
'''
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, '-c', code], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == '[]'


def test_registered_ops_enforce_their_contract_on_cpu():
    """Every implementation of the raw ops checks what the kernels assume: one dtype and
    one device for all operands, consistent shapes; strided inputs are made contiguous."""
    ops = torch.ops.lapformer_mm
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 30, 16, generator=gen)[..., ::2]
    y = torch.randn(2, 7, 8, generator=gen)
    assert not x.is_contiguous()
    expected = torch.exp(-(x[:, :, None] - y[:, None]).abs().sum(-1) / 4.0)
    torch.testing.assert_close(ops.cuda_pairwise_kernel(x, y, 4.0, rt.LAPLACIAN), expected)
    with pytest.raises(TypeError, match='cuda_pairwise_kernel: y has dtype torch.float16 but x has torch.float32'):
        ops.cuda_pairwise_kernel(x, y.half(), 4.0, rt.LAPLACIAN)
    with pytest.raises(ValueError, match='y is on meta but x is on cpu'):
        ops.cuda_pairwise_kernel(x, y.to('meta'), 4.0, rt.LAPLACIAN)
    with pytest.raises(ValueError, match=r'x must be \(batch, n, d\) and y \(batch, m, d\)'):
        ops.cuda_pairwise_kernel(x, y[..., :5], 4.0, rt.LAPLACIAN)
    with pytest.raises(TypeError, match=r"x has dtype torch.int64; allowed"):
        ops.cuda_pairwise_kernel(x.long(), y.long(), 4.0, rt.LAPLACIAN)
    g = torch.randn(2, 30, 7, generator=gen)
    with pytest.raises(ValueError, match=r'kmat must be \(batch, n, m\) = \(2, 30, 7\)'):
        ops.cuda_pairwise_kernel_backward(g, g[:, :5], x, y, 4.0, rt.LAPLACIAN, True, True)
    with pytest.raises(TypeError, match='grad has dtype torch.float64 but x has torch.float32'):
        ops.cuda_pairwise_kernel_backward(g.double(), g, x, y, 4.0, rt.LAPLACIAN, True, True)
    P = torch.eye(4).expand(3, 4, 4)
    with pytest.raises(TypeError, match=r"cuda_newton_schulz: P has dtype torch.float16; allowed: \['torch.float32', 'torch.float64'\]"):
        ops.cuda_newton_schulz(P.half(), 3, False)
    with pytest.raises(ValueError, match=r'P must be \(batch, m, m\)'):
        ops.cuda_newton_schulz(P[:, :3], 3, False)
    with pytest.raises(ValueError, match=r'grad must be \(batch, m, m\) like the other operands'):
        ops.cuda_newton_schulz_backward(P.contiguous(), P[:2].contiguous())
    torch.testing.assert_close(ops.cuda_newton_schulz(2.0 * P, 30, False), 0.5 * P)
