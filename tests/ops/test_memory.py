"""Peak memory of Nyström attention forward+backward is linear in N (no N×m×d, no N×N)."""
import torch

from devtools.profiling import peak_memory_bytes
from lapformer_mm.ops import nystrom_attention, pool_landmarks

N, M, D = 65536, 49, 32


def test_forward_backward_peak_within_3x_of_inputs_outputs_and_kernels():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, N, D, generator=gen).requires_grad_() for _ in range(3))
    landmarks = pool_landmarks(k.detach(), (256, 256)).requires_grad_()
    assert landmarks.shape[-2] == M
    extra, _ = peak_memory_bytes(lambda: nystrom_attention(q, k, v, landmarks).sum().backward())
    # Inputs, the output and the four input gradients, k(q, L) and k(k, L) (fp32).
    inputs = 4 * (3 * N * D + M * D)
    budget = 2 * inputs + 4 * (N * D + 2 * N * M)
    peak = inputs + extra
    assert peak <= 3 * budget, f'peak {peak / 2**20:.1f} MiB > 3 x {budget / 2**20:.1f} MiB'
    assert q.grad is not None and landmarks.grad is not None
