"""Numerical precision helpers: full-fp32 matmuls and the fp32 compute dtype."""
import contextlib

import torch


def compute_dtype(dtype):
    """fp64 stays fp64; every other floating dtype computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def full_precision_matmul():
    """Disable TF32 (CUDA) and reduced-precision fp32 matmuls, then restore.

    Newton–Schulz squares its residual every step; TF32's 10-bit mantissa
    caps the reachable residual near 1e-3, so the solve must use full fp32.
    """
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    saved_precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision('highest')
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32


@contextlib.contextmanager
def single_thread_on_cpu(tensor):
    """Run small CPU matmuls on one thread; no-op for other devices.

    The landmark solve multiplies m×m matrices (m <= 49): too little work to
    share, and on the shared 2-core development VM a second thread sometimes
    arrives milliseconds late (``tools/bench_attention.py micro``,
    docs/attention.md), so the solve pins the intra-op pool to one thread.
    """
    if tensor.device.type != 'cpu':
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
