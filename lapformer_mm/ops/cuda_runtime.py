"""Run-time compilation and launching of the CUDA kernels in ``ops/*.cu``.

The sources are compiled by NVRTC through CuPy's ``RawModule`` on first use,
once per (device, source, template instantiation), and cached for the life of
the process. Kernels are launched on PyTorch's current stream of the tensor's
device; tensors are handed over as raw device pointers (no copy, no
``__cuda_array_interface__`` synchronisation).

CuPy is imported only when a kernel is first compiled; everything else in this
module (source lookup, template names, launch geometry) is plain Python so that
the CPU tests can compile the exact same instantiations with NVRTC and run the
same launch geometry through the g++ emulation.
"""
import functools
import re
import threading
from pathlib import Path

import numpy as np
import torch

#: CUDA source files and the headers they include.
PAIRWISE_SOURCE = 'pairwise_kernel.cu'
NEWTON_SCHULZ_SOURCE = 'newton_schulz.cu'
NYSTROM_SOURCE = 'nystrom_attention.cu'
SOURCES = (PAIRWISE_SOURCE, NEWTON_SCHULZ_SOURCE, NYSTROM_SOURCE)

#: NVRTC options used at run time and by the CI compile test.
NVRTC_OPTIONS = ('-std=c++17',)

#: torch dtype -> C++ element type of the kernels.
ELEMENT_TYPES = {
    torch.float32: 'float',
    torch.float64: 'double',
    torch.float16: 'lap_half',
    torch.bfloat16: 'lap_bf16',
}

#: Kernel kinds of ``pairwise_kernel.cu``.
LAPLACIAN, GAUSSIAN = 0, 1
KINDS = {'laplacian': LAPLACIAN, 'gaussian': GAUSSIAN}

# Tile geometry; must match the #defines in pairwise_kernel.cu / newton_schulz.cu.
PW_TILE = 64
PW_BLOCK = (16, 16, 1)
PB_TR, PB_TD, PB_TJ = 64, 32, 32
PB_BLOCK = (16, 16, 1)
NS_MT = 4
NS_STATIC_SMEM = 16   # the norm scalar, as reported by ptxas (counts against the limit)
MAX_GRID_YZ = 65535
MAX_GRID_X = 2 ** 31 - 1

# Geometry of nystrom_attention.cu (its #defines).
NYS_MP, NYS_DV = 64, 64        # the most landmarks and value columns of the fused kernels
NYS_TN, NYS_TB, NYS_TK = 64, 32, 16
NYS_BLOCK = (16, 16, 1)
#: fp32/fp16/bf16 only: fp64 inputs take the reference math.
NYS_ELEMENT_TYPES = ('float', 'lap_half', 'lap_bf16')
#: Forward and backward stages of the fused attention, in launch order.
NYS_FORWARD = ('nys_forward_stats', 'nys_forward_solve', 'nys_forward_out')
NYS_BACKWARD = ('nys_backward_reduce', 'nys_backward_solve', 'nys_backward_grads',
                'nys_backward_landmarks')
#: Dynamic shared memory of nys_backward_grads (bytes; the layout at its top).
NYSTROM_GRADS_SMEM = 4 * (2 * NYS_MP * (NYS_DV + 1) + 4 * NYS_TB * (NYS_MP + 1)
                          + NYS_TK * (NYS_TB + NYS_MP + 2) + 3 * NYS_MP + 2 * NYS_TB)


def source_dirs():
    """Folders searched for the CUDA sources, in order.

    A regular install ships ``ops/*.cu*`` as ``lapformer_mm/_cuda_src``; a
    source or editable checkout has them in ``<repo>/ops``.
    """
    package_root = Path(__file__).resolve().parent.parent
    return [package_root / '_cuda_src', package_root.parent / 'ops']


def find_source(name):
    """Path of the CUDA source ``name``; FileNotFoundError lists where it looked."""
    dirs = source_dirs()
    for folder in dirs:
        path = folder / name
        if path.is_file():
            return path
    raise FileNotFoundError(f'CUDA source {name!r} not found in any of '
                            f'{[str(d) for d in dirs]}; reinstall lapformer_mm')


_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def load_source(name):
    """Text of ``name`` with its local ``#include "..."`` lines inlined.

    Inlining (rather than ``-I``) makes the text self-contained, so CuPy's
    on-disk cache, keyed by the source text, sees header changes too.
    """
    path = find_source(name)
    seen = set()

    def expand(text, folder):
        def replace(match):
            header = folder / match.group(1)
            if header in seen:
                return ''
            seen.add(header)
            return expand(header.read_text(), header.parent)
        return _INCLUDE.sub(replace, text)

    return expand(path.read_text(), path.parent)


def pairwise_forward_name(element_type, kind):
    """Template instantiation name of the fused kernel-matrix forward."""
    return f'pairwise_forward<{element_type}, {kind}>'


def pairwise_backward_name(element_type, kind, transposed):
    """Template instantiation name of the kernel-matrix gradient."""
    return f"pairwise_backward<{element_type}, {kind}, {'true' if transposed else 'false'}>"


def newton_schulz_name(scalar_type, p_in_shared):
    """Template instantiation name of the fused Newton–Schulz solve."""
    return f"newton_schulz<{scalar_type}, {'true' if p_in_shared else 'false'}>"


def nystrom_name(stage, element_type, kind):
    """Template instantiation name of a stage of the fused attention (``NYS_FORWARD`` /
    ``NYS_BACKWARD``); the landmark merge has no kernel kind."""
    if stage == 'nys_backward_landmarks':
        return f'{stage}<{element_type}>'
    return f'{stage}<{element_type}, {kind}>'


def all_name_expressions():
    """{source: [every template instantiation the Python side can launch]}."""
    pairwise = []
    for element_type in ELEMENT_TYPES.values():
        for kind in KINDS.values():
            pairwise.append(pairwise_forward_name(element_type, kind))
            for transposed in (False, True):
                pairwise.append(pairwise_backward_name(element_type, kind, transposed))
    return {
        PAIRWISE_SOURCE: pairwise,
        NEWTON_SCHULZ_SOURCE: [newton_schulz_name(s, shared) for s in ('float', 'double')
                               for shared in (True, False)],
        NYSTROM_SOURCE: list(dict.fromkeys(
            nystrom_name(stage, element_type, kind) for element_type in NYS_ELEMENT_TYPES
            for kind in KINDS.values() for stage in NYS_FORWARD + NYS_BACKWARD)),
    }


def _ceil_div(a, b):
    return -(-a // b)


def pairwise_forward_launch(batch, n, m):
    """(grid, block) of ``pairwise_forward`` for C (batch, n, m).

    Column tiles go on grid.x, row tiles on grid.y and the batch on grid.z;
    the kernel loops over row tiles and batch entries beyond the grid limits.
    """
    grid = (_ceil_div(m, PW_TILE), min(_ceil_div(n, PW_TILE), MAX_GRID_YZ), min(batch, MAX_GRID_YZ))
    if grid[0] > MAX_GRID_X:
        raise ValueError(f'pairwise kernel: m={m} columns exceed the grid limit')
    return grid, PW_BLOCK


def pairwise_backward_launch(batch, n_rows, n_red, d, target_blocks):
    """(grid, block, splits, red_chunk) of ``pairwise_backward``.

    The reduction over ``n_red`` is split into ``splits`` slices of
    ``red_chunk`` (a multiple of the staging width) until about
    ``target_blocks`` blocks exist; dy, which reduces over all N queries for
    only m landmarks, needs this to use more than a handful of SMs.
    The split count depends only on the shapes, so results are deterministic.
    """
    tiles_d = _ceil_div(d, PB_TD)
    tiles_r = _ceil_div(n_rows, PB_TR)
    base = tiles_d * tiles_r * batch
    max_splits = max(1, _ceil_div(n_red, PB_TJ))
    splits = min(max_splits, max(1, _ceil_div(target_blocks, base)))
    red_chunk = _ceil_div(_ceil_div(max(n_red, 1), splits), PB_TJ) * PB_TJ
    splits = max(1, _ceil_div(n_red, red_chunk))
    grid = (tiles_d * splits, min(tiles_r, MAX_GRID_YZ), min(batch, MAX_GRID_YZ))
    if grid[0] > MAX_GRID_X:
        raise ValueError(f'pairwise kernel gradient: d={d} needs {tiles_d} column tiles x '
                         f'{splits} reduction slices, over the grid limit {MAX_GRID_X}')
    return grid, PB_BLOCK, splits, red_chunk


def newton_schulz_stride(m):
    """(mp, ld): m padded to the micro-tile, and the shared-memory row stride.

    ld = 4 (mod 8) keeps the rows a warp reads together in different banks;
    must match ``ns_stride`` in newton_schulz.cu.
    """
    mp = _ceil_div(m, NS_MT) * NS_MT
    return mp, (mp if mp % 8 == 4 else mp + 4)


def newton_schulz_launch(batch, m, itemsize, smem_limit):
    """(grid, block, shared bytes, p_in_shared) of ``newton_schulz``, or None.

    None means the padded m x m iterate does not fit in ``smem_limit`` bytes
    of shared memory per block; the caller then uses batched matmuls.
    """
    mp, ld = newton_schulz_stride(m)
    tiles = (mp // NS_MT) ** 2
    threads = _ceil_div(tiles, 32) * 32
    if threads > 1024:
        return None
    scalar_bytes = itemsize * mp * ld
    if 3 * scalar_bytes + NS_STATIC_SMEM <= smem_limit:
        smem, p_in_shared = 3 * scalar_bytes, 1
    elif 2 * scalar_bytes + NS_STATIC_SMEM <= smem_limit:
        smem, p_in_shared = 2 * scalar_bytes, 0
    else:
        return None
    grid = (min(batch, MAX_GRID_X),)
    return grid, (threads, 1, 1), smem, p_in_shared


def nystrom_fused_supported(dtype, m, dv, d):
    """Whether the fused attention kernels take these operands (else the reference math)."""
    return (ELEMENT_TYPES.get(dtype) in NYS_ELEMENT_TYPES and 1 <= m <= NYS_MP
            and 1 <= dv <= NYS_DV and d >= 1)


@functools.lru_cache(maxsize=None)
def nystrom_splits(bh, n, target_blocks):
    """(splits, chunk): the N rows of each (batch, head) cut into ``splits`` slices of
    ``chunk`` rows (a multiple of both tile heights) so that about ``target_blocks``
    blocks exist. Depends only on the shapes and the device, so results are
    deterministic; every slice holds at least one row."""
    tiles = _ceil_div(max(n, 1), NYS_TN)
    splits = min(tiles, max(1, _ceil_div(target_blocks, bh)), MAX_GRID_X)
    chunk = _ceil_div(tiles, splits) * NYS_TN
    return _ceil_div(max(n, 1), chunk), chunk


@functools.lru_cache(maxsize=None)
def nystrom_solve_smem(m, dv):
    """Dynamic shared memory (bytes) of nys_forward_solve: P, X, scratch, R, context, scale."""
    mp, ld = newton_schulz_stride(m)
    return 4 * (3 * mp * ld + 2 * m * dv + NYS_MP)


@functools.lru_cache(maxsize=None)
def nystrom_backward_solve_smem(m, dv):
    """Dynamic shared memory (bytes) of nys_backward_solve."""
    return 4 * (2 * m * m + 3 * m * dv + 2 * NYS_MP + NYS_DV)


# ----------------------------------------------------------------------------
# CuPy side: compile, cache, launch.
# ----------------------------------------------------------------------------

class CudaOpsError(RuntimeError):
    """A CUDA kernel failed to compile or launch; the message names kernel and shapes."""


def import_cupy():
    """``import cupy`` with an actionable error."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError('the CUDA ops need CuPy: pip install cupy-cuda12x or cupy-cuda13x '
                          '(matching your CUDA driver)') from exc
    return cupy


_lock = threading.Lock()
_functions = {}
_launchers = {}


def compile_group(source, name_expression):
    """Instantiations compiled together with ``name_expression``: same source, same element type.

    One NVRTC run per (source, element type) keeps the first-use cost to a
    few compilations instead of one per kernel variant.
    """
    element_type = name_expression.split('<', 1)[-1].split(',')[0].rstrip('>').strip()
    group = [n for n in all_name_expressions().get(source, [])
             if n.split('<', 1)[-1].split(',')[0].rstrip('>').strip() == element_type]
    return group if name_expression in group else [name_expression]


def get_function(device_index, source, name_expression):
    """Compiled kernel, from a ``cupy.RawModule`` built once per (device, source, element type)."""
    key = (device_index, source, name_expression)
    function = _functions.get(key)
    if function is not None:
        return function
    with _lock:
        if key not in _functions:
            cupy = import_cupy()
            group = compile_group(source, name_expression)
            try:
                with cupy.cuda.Device(device_index):
                    module = cupy.RawModule(code=load_source(source), options=NVRTC_OPTIONS,
                                            name_expressions=group, backend='nvrtc')
                    functions = {name: module.get_function(name) for name in group}
            except Exception as exc:  # CuPy raises CompileException and CUDADriverError
                raise CudaOpsError(f'compiling {name_expression} from {source} for device '
                                   f'{device_index} failed: {exc}') from exc
            _functions.update({(device_index, source, name): f for name, f in functions.items()})
    return _functions[key]


@functools.lru_cache(maxsize=None)
def shared_memory_optin(device_index):
    """Largest shared memory (static + dynamic) a block may opt into on this device (bytes)."""
    props = torch.cuda.get_device_properties(device_index)
    optin = getattr(props, 'shared_memory_per_block_optin', None)
    if optin:
        return int(optin)
    try:
        attributes = import_cupy().cuda.Device(device_index).attributes
        return int(attributes['MaxSharedMemoryPerBlockOptin'])
    except Exception:  # no attribute on this CuPy/driver: the limit every GPU allows
        return 48 * 1024


def pointer(tensor):
    """Device pointer of a tensor as a kernel argument (no copy); None is a null pointer."""
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def raw_stream(device_index):
    """Handle of PyTorch's current stream on the device (the capture stream while a CUDA
    graph is being captured)."""
    get = getattr(torch._C, '_cuda_getCurrentRawStream', None)
    if get is not None:
        return get(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


_streams = {}
_MAX_STREAMS = 256


def cupy_stream(cupy, device_index):
    """PyTorch's current stream of the device as a CuPy stream, one wrapper per stream.

    The wrapper only names the handle, so it stays valid for whatever stream later has
    that handle. Kernels are always launched on it, never on CuPy's own current stream
    (the legacy default stream unless set), which would escape a CUDA graph capture on
    PyTorch's stream and replay stale results.
    """
    handle = raw_stream(device_index)
    key = (device_index, handle)
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= _MAX_STREAMS:
            _streams.clear()
        external = getattr(cupy.cuda, 'ExternalStream', None)
        if external is not None:
            stream = external(handle, device_index)
        else:  # CuPy without ExternalStream: wrap PyTorch's stream object
            stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream(device_index))
        _streams[key] = stream
    return stream


def _launcher(cupy, device_index, source, name_expression, shared_mem):
    """The low-level launch function of a kernel on the device (cached), opted into
    ``shared_mem`` bytes of dynamic shared memory."""
    key = (device_index, source, name_expression)
    entry = _launchers.get(key)
    if entry is None:
        function = get_function(device_index, source, name_expression)
        with cupy.cuda.Device(device_index):
            # RawKernel.kernel is the device's compiled Function: calling it directly skips
            # RawKernel's per-call device lookup.
            entry = [function, getattr(function, 'kernel', function), 0]
        _launchers[key] = entry
    if shared_mem > entry[2]:
        # Dynamic + static above 48 KiB needs the opt-in (m = 64 fp32 already does).
        with cupy.cuda.Device(device_index):
            entry[0].max_dynamic_shared_size_bytes = shared_mem
        entry[2] = shared_mem
    return entry[1]


def launch(source, name_expression, tensor, grid, block, args, shared_mem=0, shapes=''):
    """Launch a kernel on the current PyTorch stream of ``tensor``'s device.

    ``args`` must already have their exact C types (numpy scalars, pointers
    from :func:`pointer`). No host synchronisation; a device context is entered only when
    the tensor's device is not the current one. Failures raise :class:`CudaOpsError`
    naming the kernel, the launch geometry and ``shapes`` (a string, or a callable that
    makes it: the message is only formatted on failure).
    """
    cupy = import_cupy()
    device_index = tensor.device.index
    try:
        call = _launcher(cupy, device_index, source, name_expression, shared_mem)
        stream = cupy_stream(cupy, device_index)
        if cupy.cuda.runtime.getDevice() == device_index:
            call(grid, block, args, shared_mem=shared_mem, stream=stream)
        else:
            with cupy.cuda.Device(device_index):
                call(grid, block, args, shared_mem=shared_mem, stream=stream)
    except CudaOpsError:
        raise
    except Exception as exc:
        raise CudaOpsError(f'launching {name_expression} (grid={grid}, block={block}, '
                           f'shared_mem={shared_mem}) for '
                           f'{shapes() if callable(shapes) else shapes} '
                           f'failed: {exc}') from exc
