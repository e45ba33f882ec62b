"""The Python wiring of the registered ops and of the CUDA launches, tested on the CPU.

The ops' reference implementation runs here, so fake tensors, autograd
registration and ``torch.compile`` of the public path are covered. The CUDA backend's
host code is covered by ``test_cuda_host_path.py`` (a fake CuPy), its kernels by
``test_cuda_fused_emulation.py`` and, on a GPU, ``test_cuda_attention_gpu.py``.
"""
import torch

from lapformer_mm.ops import (
    AttentionOptions,
    gaussian_kernel,
    laplacian_kernel,
    newton_schulz_pinv,
    nystrom_forward,
    pool_landmarks,
)


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


def test_cuda_ops_import_without_openmmlab():
    """The GPU check machine has torch and CuPy but no OpenMMLab package."""
    import subprocess
    import sys

    from _shared import ROOT
    code = '''
import sys
BLOCKED = {'mmengine', 'mmcv', 'mmdet', 'mmseg', 'mmpretrain'}
class Absent:
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, Absent())
import lapformer_mm.ops.backends.cuda
import lapformer_mm.ops.kernels
print(sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED))
'''
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == '[]'


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
