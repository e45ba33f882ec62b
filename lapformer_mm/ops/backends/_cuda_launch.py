"""Compile, load and launch the fused attention's CUDA kernels (``csrc/cuda/nystrom_attention.cu``).

Plain Python up to :func:`launch`, so the CPU tests compile the same variants with NVRTC and
run the same geometry and parameter bytes through the g++ emulation:

* :data:`VARIANTS`: the tile geometry, one source for host and kernels (NVRTC ``-D``
  options, part of CuPy's compile cache key; the ``.cu`` refuses to compile without them);
* :func:`plan`: the variant and the solve kernels' column passes that fit a device's
  shared-memory opt-in limit, or the reasons none does;
* :data:`PARAMS_DTYPE`: the kernels' one by-value argument ``nys_params`` as a numpy
  structured dtype. CuPy (13, 14) passes a numpy array of size one by value, copying its
  bytes (``cupy/cuda/function.pyx``, ``CNumpyArray``); the emulation hands the same bytes
  to the kernels.

CuPy is imported on the first compile. Kernels are launched on PyTorch's current stream;
compile, module load and the shared-memory opt-in happen once per (device, variant,
element type) and never inside a CUDA-graph capture (:class:`CaptureError`).
"""
import functools
import re
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

SOURCE = 'nystrom_attention.cu'
#: NVRTC options besides the variant's ``-D`` ones. CuPy adds the device's architecture.
NVRTC_OPTIONS = ('-std=c++17',)

#: torch dtype -> C++ element type of the kernels (fp64 runs the reference).
ELEMENT_TYPES = {torch.float32: 'float', torch.float16: 'lap_half', torch.bfloat16: 'lap_bf16'}
#: The similarity of ``opts.kernel`` -> the kernels' KIND template argument.
KINDS = {'laplacian': 0, 'gaussian': 1}

FORWARD = ('nys_forward_stats', 'nys_forward_solve', 'nys_forward_context', 'nys_forward_out')
BACKWARD = ('nys_backward_reduce', 'nys_backward_merge', 'nys_backward_solve',
            'nys_backward_grads', 'nys_backward_landmarks')
STAGES = FORWARD + BACKWARD
#: Stages that evaluate no kernel function: no KIND template argument.
NO_KIND = ('nys_forward_context', 'nys_backward_merge')

MAX_GRID_YZ = 65535
MAX_GRID_X = 2 ** 31 - 1
#: ns_iterate's static norm scalar, as ptxas reports it (counts against the limit).
NS_STATIC_SMEM = 16
#: Shared memory every CUDA device gives a block without opting in.
DEFAULT_SMEM = 48 * 1024


def kernel_name(stage, element_type, kind):
    """Template instantiation of a stage; the stages of :data:`NO_KIND` have no KIND."""
    if stage in NO_KIND:
        return f'{stage}<{element_type}>'
    return f'{stage}<{element_type}, {kind}>'


def kernel_names(element_types=tuple(ELEMENT_TYPES.values())):
    """Every instantiation the host can launch for these element types (one compile)."""
    return list(dict.fromkeys(kernel_name(stage, element, kind) for element in element_types
                              for kind in KINDS.values() for stage in STAGES))


class Variant(NamedTuple):
    """Tile geometry (the .cu's NYS_* macros): landmark and value columns of a tile (mp, dv),
    rows of a row-pass / gradient tile (tn, tb), the staged d-chunk (tk), threads (tx, ty),
    entries per block of the slice merges (lanes: one warp's coalesced row) and value
    columns per block of the context kernel (cc)."""
    name: str
    mp: int
    dv: int
    tn: int
    tb: int
    tk: int = 16
    tx: int = 16
    ty: int = 16
    lanes: int = 32
    cc: int = 8

    @property
    def defines(self):
        return tuple(f'-DNYS_{key.upper()}={getattr(self, key)}'
                     for key in ('mp', 'dv', 'tn', 'tb', 'tk', 'tx', 'ty', 'lanes', 'cc'))

    @property
    def threads(self):
        return self.tx * self.ty

    @property
    def block(self):
        return (self.tx, self.ty, 1)


#: Value tiles fitted to d_v <= 32 (Tiny's heads) or <= 64; gradient tiles of 32 rows, or 16
#: where the device's shared memory is smaller (T4, RTX 20xx: 64 KiB).
VARIANTS = (
    Variant('dv32_tb32', 64, 32, 64, 32),
    Variant('dv32_tb16', 64, 32, 64, 16),
    Variant('dv64_tb32', 64, 64, 64, 32),
    Variant('dv64_tb16', 64, 64, 64, 16),
)
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}
MAX_M = max(v.mp for v in VARIANTS)
MAX_DV = max(v.dv for v in VARIANTS)


def _ceil_div(a, b):
    return -(-a // b)


def ns_layout(m):
    """(mp, ld): m padded to the 4 x 4 micro-tile and the row stride of ns_iterate's
    matrices (ns_stride: ld = 4 mod 8)."""
    mp = _ceil_div(m, 4) * 4
    return mp, (mp if mp % 8 == 4 else mp + 4)


def grads_smem(v):
    """Dynamic shared memory (bytes) of nys_backward_grads: the layout at its top."""
    dw = max(v.mp, v.dv)
    return 4 * (2 * v.mp * (v.dv + 1) + 2 * v.tb * (v.mp + 1) + 2 * v.tb * (dw + 1)
                + v.tk * (v.tb + 1) + v.tk * (v.mp + 1) + 3 * v.mp + 2 * v.tb)


def row_pass_static_smem(v):
    """Static shared memory (bytes) of the largest row-pass kernel (nys_forward_out or
    nys_forward_stats); it must stay within the 48 KiB every device has."""
    staging = v.tk * (v.tn + 1) + v.tk * (v.mp + 1) + v.tn * (v.mp + 1) + v.tn
    stats = staging + v.tn * (v.dv + 1) + 2 * (v.threads // v.mp) * v.mp
    out = staging + v.mp * (v.dv + 1) + v.dv
    return 4 * max(stats, out)


def context_static_smem(v):
    """Static shared memory (bytes) of nys_forward_context: X, P, R and the context columns."""
    return 4 * (2 * v.mp * (v.mp + 1) + 2 * v.mp * (v.cc + 1) + v.mp)


def landmark_tile_floats(v):
    """Floats of the kernel tile of the landmarks against themselves (NYS_LTILE)."""
    return (2 * v.tk + v.mp) * (v.mp + 1)


def ns_splits(tiles, nk, threads):
    """k-splits of a Newton-Schulz product over ``tiles`` 4 x 4 tiles (lap_common.cuh,
    ns_splits): tiles x splits threads fill the block."""
    return max(1, min(threads // tiles, nk))


def ns_scratch_floats(mp, threads):
    """Floats of ns_iterate's k-split partials: P X over all nt^2 tiles, X (P X) over the
    upper triangle's nt (nt + 1) / 2."""
    nt = mp // 4
    return 16 * max((ns_splits(tiles, nt, threads) - 1) * tiles
                    for tiles in (nt * nt, nt * (nt + 1) // 2))


def solve_smem(v, m):
    """Dynamic shared memory (bytes) of nys_forward_solve: P, X, T and the k-split partials,
    or P and the landmark tile, whichever is more (a merge job needs less than both)."""
    mp, ld = ns_layout(m)
    return 4 * max(mp * ld + landmark_tile_floats(v),
                   3 * mp * ld + ns_scratch_floats(mp, v.threads))


def backward_solve_smem(v, m, cols):
    """Dynamic shared memory (bytes) of nys_backward_solve with ``cols`` value columns a pass."""
    return 4 * (m * m + max(landmark_tile_floats(v),
                            m * (m + 1) + 3 * m * (cols + 1) + v.mp + cols))


class Plan(NamedTuple):
    variant: Variant
    backward_solve_cols: int  # value columns per pass of nys_backward_solve
    solve_smem: int
    backward_solve_smem: int
    grads_smem: int


def _columns(fits, dv):
    """The widest column pass (all of d_v, else a halving down to 8) for which fits(cols)."""
    for cols in dict.fromkeys([dv] + [c for c in (32, 16, 8) if c < dv]):
        if fits(cols):
            return cols
    return None


@functools.lru_cache(maxsize=None)
def plan(m, dv, smem_limit):
    """A :class:`Plan` for m landmarks and d_v value columns on a device whose blocks may
    use ``smem_limit`` bytes of shared memory, or a tuple of reasons none fits."""
    if not 1 <= m <= MAX_M:
        return (f'm = {m} landmarks; the CUDA kernels take 1 to {MAX_M}',)
    if not 1 <= dv <= MAX_DV:
        return (f'd_v = {dv} value columns; the CUDA kernels take 1 to {MAX_DV}',)
    reasons = []
    for v in sorted((v for v in VARIANTS if v.dv >= dv), key=lambda v: (v.dv, -v.tb)):
        if row_pass_static_smem(v) > DEFAULT_SMEM or grads_smem(v) > smem_limit:
            reasons.append(f'variant {v.name}: the gradient kernel needs {grads_smem(v):,} bytes '
                           f'of shared memory, the device allows {smem_limit:,}')
            continue
        bcols = _columns(lambda c: backward_solve_smem(v, m, c) <= smem_limit, dv)
        if solve_smem(v, m) + NS_STATIC_SMEM > smem_limit or bcols is None:
            mp, ld = ns_layout(m)
            need = max(solve_smem(v, m) + NS_STATIC_SMEM, backward_solve_smem(v, m, 8))
            reasons.append(f'variant {v.name}: the solves of m = {m} need {need:,} bytes of '
                           f'shared memory (Newton-Schulz on {mp} x {ld}), the device allows '
                           f'{smem_limit:,}')
            continue
        return Plan(v, bcols, solve_smem(v, m), backward_solve_smem(v, m, bcols), grads_smem(v))
    return tuple(reasons)


@functools.lru_cache(maxsize=None)
def splits(bh, n, target_blocks, tile_rows):
    """(splits, chunk): the N rows of each (batch, head) cut into ``splits`` slices of
    ``chunk`` rows (a multiple of the tile heights) so that about ``target_blocks`` blocks
    exist. Depends only on the shapes and the device: results are deterministic."""
    tiles = _ceil_div(max(n, 1), tile_rows)
    count = min(tiles, max(1, _ceil_div(target_blocks, bh)), MAX_GRID_X)
    chunk = _ceil_div(tiles, count) * tile_rows
    return _ceil_div(max(n, 1), chunk), chunk


# ----------------------------------------------------------------------------
# The parameter struct.
# ----------------------------------------------------------------------------

_OPERAND = np.dtype([('ptr', np.uint64), ('sb', np.int64), ('sh', np.int64), ('sn', np.int64),
                     ('sd', np.int64)], align=True)
OPERANDS = ('q', 'k', 'v', 'L', 'g', 'grad_q', 'grad_k', 'grad_v', 'grad_l')
POINTERS = ('out', 'part', 'fold', 'context', 'inverse', 'stats', 'work', 'lpart')
INTS = ('heads', 'n', 'm', 'd', 'dv', 'chunk', 'splits', 'iters', 'init_authors', 'refine',
        'injective', 'solve_cols')
FLOATS = ('neg_inv_lam', 'neg_coef', 'eps', 'whiten_eps')
#: ``struct nys_params`` of the .cu, field for field (C alignment: align=True).
PARAMS_DTYPE = np.dtype([(name, _OPERAND) for name in OPERANDS]
                        + [(name, np.uint64) for name in POINTERS] + [('bh_count', np.int64)]
                        + [(name, np.int32) for name in INTS]
                        + [(name, np.float32) for name in FLOATS], align=True)


def params_layout():
    """{field: byte offset} of PARAMS_DTYPE, operands as 'q.ptr' ..., plus 'sizeof'."""
    layout = {}
    for name, (dtype, offset) in PARAMS_DTYPE.fields.items():
        if dtype.fields:
            layout.update({f'{name}.{sub}': offset + o for sub, (_, o) in dtype.fields.items()})
        else:
            layout[name] = offset
    layout['sizeof'] = PARAMS_DTYPE.itemsize
    return layout


def new_params():
    """A zeroed ``nys_params`` (null pointers), the array of size one CuPy passes by value."""
    return np.zeros(1, PARAMS_DTYPE)


def set_operand(params, name, tensor, strides=None):
    """params[name] = (pointer, batch, head, row, column strides) of a (B, h, n, c) tensor
    (``strides`` in that order when the tensor's dims are ordered otherwise)."""
    if tensor is None:
        return
    params[name] = (tensor.data_ptr(),) + tuple(tensor.stride() if strides is None else strides)


# ----------------------------------------------------------------------------
# CuPy side: compile, cache, launch.
# ----------------------------------------------------------------------------

class CudaOpsError(RuntimeError):
    """A CUDA kernel failed to compile or launch; the message names kernel and shapes."""


class CaptureError(RuntimeError):
    """The kernels would be compiled, loaded or opted in while a CUDA graph is captured."""


def source_dir():
    """lapformer_mm/csrc/cuda, shipped with the package."""
    return Path(__file__).resolve().parents[2] / 'csrc' / 'cuda'


_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def load_source(name=SOURCE):
    """Text of ``name`` with its local ``#include "..."`` lines inlined, so that CuPy's
    on-disk cache, keyed by the source text, sees header changes too."""
    path = source_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f'CUDA source {path} is missing; reinstall lapformer_mm')
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


def import_cupy():
    """``import cupy`` with an actionable error."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError('the CUDA backend needs CuPy: pip install cupy-cuda12x or '
                          'cupy-cuda13x (matching your CUDA driver)') from exc
    return cupy


def capturing(device_index):
    """Whether PyTorch's current stream on the device is capturing a CUDA graph."""
    return torch.cuda.is_current_stream_capturing()


_lock = threading.Lock()
# (device, variant name, element type) -> {kernel name: launch function}
_groups = {}


def _dynamic_optin(stage, smem_limit):
    """Dynamic shared memory a kernel is opted into once, at load: all it may ever ask on
    the device (so nothing changes later, inside a capture)."""
    if stage == 'nys_forward_solve':
        return smem_limit - NS_STATIC_SMEM
    if stage in ('nys_backward_solve', 'nys_backward_grads'):
        return smem_limit
    return 0


def load_group(device_index, variant, element_type, smem_limit):
    """The launch functions of every stage for (device, variant, element type): one NVRTC
    compile, one module load, the opt-in; cached."""
    key = (device_index, variant.name, element_type)
    group = _groups.get(key)
    if group is not None:
        return group
    with _lock:
        if key in _groups:
            return _groups[key]
        if capturing(device_index):
            raise CaptureError(
                f'the CUDA kernels of the attention ({variant.name}, {element_type}) are not '
                f'loaded yet on cuda:{device_index}, and a CUDA graph is being captured: '
                'compiling and loading them would break the capture. Run the attention once '
                'eagerly before capturing, or call lapformer_mm.ops.backends.cuda.warmup() '
                '(torch.compile mode="reduce-overhead" warms up eagerly by itself).')
        cupy = import_cupy()
        names = kernel_names((element_type,))
        try:
            with cupy.cuda.Device(device_index):
                module = cupy.RawModule(code=load_source(), options=NVRTC_OPTIONS + variant.defines,
                                        name_expressions=names, backend='nvrtc')
                group = {}
                for name in names:
                    function = module.get_function(name)
                    optin = _dynamic_optin(name.split('<')[0], smem_limit)
                    if optin > DEFAULT_SMEM:
                        function.max_dynamic_shared_size_bytes = optin
                    # RawKernel.kernel is the compiled Function: calling it skips RawKernel's
                    # per-call device lookup.
                    group[name] = getattr(function, 'kernel', function)
        except Exception as exc:  # CuPy raises CompileException and CUDADriverError
            raise CudaOpsError(f'compiling {SOURCE} ({variant.name}, {element_type}) for '
                               f'cuda:{device_index} failed: {exc}') from exc
        _groups[key] = group
    return group


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
    """PyTorch's current stream as a CuPy stream, one wrapper per handle. Kernels are always
    launched on it, never on CuPy's own current stream (the legacy default stream unless
    set), which would escape a CUDA graph capture and replay stale results."""
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


def launch(name, variant, tensor, grid, block, params, shared_mem=0, shapes='', smem_limit=0):
    """Launch kernel ``name`` of ``variant`` on the current PyTorch stream of ``tensor``'s
    device with the one by-value argument ``params`` (:func:`new_params`).

    No host synchronisation; a device context is entered only when the tensor's device is
    not the current one. Failures raise :class:`CudaOpsError` naming the kernel, the
    geometry and ``shapes`` (a string, or a callable that makes it on failure only). The
    CPU emulation replaces this function.
    """
    cupy = import_cupy()
    device_index = tensor.device.index
    element_type = name.split('<', 1)[1].split(',')[0].rstrip('>').strip()
    call = load_group(device_index, variant, element_type, smem_limit)[name]
    try:
        stream = cupy_stream(cupy, device_index)
        if cupy.cuda.runtime.getDevice() == device_index:
            call(grid, block, (params,), shared_mem=shared_mem, stream=stream)
        else:
            with cupy.cuda.Device(device_index):
                call(grid, block, (params,), shared_mem=shared_mem, stream=stream)
    except Exception as exc:
        raise CudaOpsError(f'launching {name} ({variant.name}, grid={grid}, block={block}, '
                           f'shared_mem={shared_mem}) for '
                           f'{shapes() if callable(shapes) else shapes} failed: {exc}') from exc
