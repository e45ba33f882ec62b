"""Peak memory of Nyström attention forward+backward is linear in N (no N×m×d, no N×N)."""
import torch

from devtools.profiling import peak_memory_bytes
from lapformer_mm.ops import nystrom_attention, pool_landmarks

N, M, D = 65536, 49, 32


def _tensor_bytes(*shapes):
    return sum(4 * torch.Size(s).numel() for s in shapes)


def test_forward_backward_peak_within_3x_of_inputs_outputs_and_kernels():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, N, D, generator=gen).requires_grad_() for _ in range(3))
    landmarks = pool_landmarks(k.detach(), (256, 256)).requires_grad_()
    assert landmarks.shape[-2] == M

    def run():
        nystrom_attention(q, k, v, landmarks).sum().backward()

    extra, _ = peak_memory_bytes(run)
    inputs = _tensor_bytes(q.shape, k.shape, v.shape, landmarks.shape)
    # Outputs: the attention output and the four input gradients; kernel
    # tensors: k(q, L) and k(k, L), each N×m.
    budget = inputs + _tensor_bytes(q.shape) + inputs + _tensor_bytes((N, M), (N, M))
    peak = inputs + extra
    print(f'peak {peak / 2**20:.1f} MiB = {peak / budget:.2f} x budget {budget / 2**20:.1f} MiB')
    assert peak <= 3 * budget, f'peak {peak / 2**20:.1f} MiB > 3 x {budget / 2**20:.1f} MiB'
    assert q.grad is not None and landmarks.grad is not None
