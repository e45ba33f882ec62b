"""glibc ``malloc`` settings that keep large CPU tensors from being page-faulted in afresh.

PyTorch's CPU allocator is the C library's ``malloc``. glibc serves every request above its
mmap threshold (at most 32 MiB unless set) with a fresh ``mmap`` and returns it to the
kernel on ``free``, so each such tensor is faulted in again page by page (one fault per
4 KiB) every time it is allocated. At 2048×2048 a stage-1 feature map of LaplacianFormer-T
or Swin-T is 64 MiB, and those faults made the forward time grow faster than the pixels
from 1024² to 2048² (measured: ``benchmarks/malloc_faults.py``, docs/analysis.md).
PyTorch's CPU performance guide addresses this by recommending jemalloc or tcmalloc; raising
glibc's mmap and trim thresholds is the in-process equivalent.
"""
import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30


def keep_large_blocks(threshold=KEEP_BYTES):
    """Have glibc serve and keep blocks up to ``threshold`` bytes from its heap.

    Sets ``M_MMAP_THRESHOLD`` (requests above it still get their own ``mmap``) and
    ``M_TRIM_THRESHOLD`` (free memory at the top of the heap is returned to the kernel only
    beyond it) to ``threshold``. The process keeps up to that much freed memory resident
    for reuse. Affects the whole process from the call on; already allocated blocks are
    unchanged.

    Args:
        threshold (int): bytes, in [1, 2**31 - 1]. Default 1 GiB.

    Returns:
        bool: True when both settings took effect, False where the C library is not glibc
        (nothing is changed then).
    """
    if not isinstance(threshold, int) or not 1 <= threshold <= 2**31 - 1:
        raise ValueError(f'threshold must be an int in [1, 2**31 - 1] bytes, got {threshold!r}')
    name = ctypes.util.find_library('c')
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018  (present only in glibc)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, threshold))
