"""glibc ``malloc`` settings that keep large CPU tensors from being page-faulted in afresh:
glibc serves requests above its mmap threshold with a fresh ``mmap`` returned on ``free``, and
at 2048×2048 those faults made the forward grow faster than the pixels (docs/analysis.md). The
in-process equivalent of PyTorch's advice to use jemalloc or tcmalloc."""
import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30


def keep_large_blocks(threshold=KEEP_BYTES):
    """Have glibc serve and keep blocks up to ``threshold`` bytes (an int in [1, 2**31 - 1],
    default 1 GiB) from its heap, the whole process from the call on: ``M_MMAP_THRESHOLD`` and
    ``M_TRIM_THRESHOLD`` set to it. False where the C library is not glibc (nothing changed)."""
    if not isinstance(threshold, int) or not 1 <= threshold <= 2**31 - 1:  # mallopt's int
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
