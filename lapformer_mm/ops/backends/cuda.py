"""The CUDA backend of the attention op (``impl='cupy'``): 4 launches forward, 5 backward.

The kernels (``ops/cuda/nystrom_attention.cu``, the math of
:mod:`lapformer_mm.ops.reference`) are compiled at run time by NVRTC through CuPy, for the
device's own architecture, and run on PyTorch's current stream. Three parts:

* **Plan** (:mod:`.cuda_plan`, plain Python shared with the g++ emulation; its names are
  this module's too): the stages, the tile variants, what fits a device, ``nys_params``.
* **Runtime** (CuPy): one module per (device, variant, element type), its kernels under
  fixed C names, so that CuPy's own kernel cache serves every later process; loaded and
  opted in to the device's own shared-memory limit once (:func:`load_group`), never inside
  a CUDA-graph capture (:class:`CaptureError`); :func:`launch`.
* **Backend** (what the op calls): :func:`not_supported` checks a call and loads its kernels
  once per shape and device; :func:`forward` and :func:`backward` find that check.

Operands follow the op's contract (q, v, landmarks (B, h, ., .) with any strides, k None
when tied; out (B, N, h, d_v)); ``opts`` is a ``reference.OpOptions``.
"""
import functools
import re
import threading
import warnings
from typing import NamedTuple

import numpy as np
import torch

from ..reference import KERNEL_CODES
from . import kernel_sources
from .cuda_plan import (  # noqa: F401 (the plan's names, read as this module's)
    BACKWARD,
    DEFAULT_SMEM,
    ELEMENT_TYPES,
    FORWARD,
    MAX_DV,
    MAX_GRID_X,
    MAX_GRID_YZ,
    MAX_M,
    NO_KIND,
    NS_LD_NARROW,
    NS_LD_WIDE,
    NS_PART_STRIDE,
    NS_STATIC_SMEM,
    PARAMS_DTYPE,
    STAGES,
    VARIANT_BY_NAME,
    VARIANTS,
    DeviceLimits,
    Plan,
    Variant,
    ceil_div,
    context_static_smem,
    entry_name,
    fit,
    grads_smem,
    kernel_name,
    kernel_names,
    plan,
    row_pass_static_smem,
    set_operand,
    splits,
    stage_of,
    variant_fits,
)

NAME = 'cupy'
DEVICE = 'cuda'
#: What makes the backend usable where it is not.
INSTALL_HINT = 'pip install cupy-cuda12x or cupy-cuda13x (matching the CUDA driver)'
SOURCE = 'nystrom_attention.cu'
#: NVRTC options besides the variant's ``-D`` ones. CuPy adds the device's architecture.
NVRTC_OPTIONS = ('-std=c++17',)
_F32 = torch.float32


# == Runtime: CuPy, the device, one module per (device, variant, element type) ==

# [(why the backend cannot run here or None, whether CuPy is installed)], filled at the first
# call that asks; a plain global, so a compiled graph reads it as a constant.
_AVAILABILITY = []
_WARNED = []


def _availability():
    if not _AVAILABILITY:
        try:
            cupy = import_cupy()
        except CupyNotInstalled as exc:
            _AVAILABILITY.append((str(exc), False))
        except ImportError as exc:
            _AVAILABILITY.append((str(exc), True))
        else:
            _AVAILABILITY.append((_initialise(cupy), True))
    return _AVAILABILITY[0]


def _initialise(cupy):
    try:
        # What every call needs: the CUDA runtime CuPy was built for (a driver older than it
        # fails here) and the NVRTC library it compiles with.
        cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.nvrtc.getVersion()
    except Exception as exc:  # CuPy raises its own CUDARuntimeError, or an OSError
        return (f'CuPy {getattr(cupy, "__version__", "?")} is installed but cannot initialise '
                f'CUDA and NVRTC: {type(exc).__name__}: {exc}')
    return None


def unavailable_reason():
    """Why the backend cannot run here, or None where it can: CuPy not installed, or installed
    but failing to import or to initialise CUDA and NVRTC (its own error). Checked once, at
    the first call that asks; never at module import."""
    return _availability()[0]


def available():
    """Whether CuPy imports and initialises. Where it does not, warns once with the reason (at
    the first attention on CUDA tensors, which then runs the reference); where CuPy is simply
    not installed, only on a machine that has CUDA."""
    reason, installed = _availability()
    if reason is not None and not _WARNED and (installed or torch.cuda.is_available()):
        _WARNED.append(True)
        warnings.warn(f'lapformer_mm: the CUDA kernels are not available ({reason}); the '
                      'attention runs the slower PyTorch reference on CUDA tensors',
                      RuntimeWarning, stacklevel=4)
    return reason is None


def smem_optin(cupy, index):
    """The device's own shared-memory opt-in limit per block, as CUDA reports it."""
    runtime = cupy.cuda.runtime
    # cudaDevAttrMaxSharedMemoryPerBlockOptin, 97 in every CUDA since 9.0.
    return int(runtime.deviceGetAttribute(
        getattr(runtime, 'cudaDevAttrMaxSharedMemoryPerBlockOptin', 97), index))


@functools.lru_cache(maxsize=None)
def _device_limits(index):
    props = torch.cuda.get_device_properties(index)
    optin = int(getattr(props, 'shared_memory_per_block_optin', 0) or 0)
    nvrtc = 0
    try:
        cupy = import_cupy()
        optin = optin or smem_optin(cupy, index)
        nvrtc = cupy.cuda.nvrtc.getVersion()[0]
    except Exception:  # no CuPy, or no attribute on this driver: the limit every GPU allows
        optin = optin or DEFAULT_SMEM
    return DeviceLimits((props.major, props.minor), props.multi_processor_count, optin, nvrtc)


def device_limits(device):
    """:class:`DeviceLimits` of a CUDA device (cached per device)."""
    return _device_limits(device.index if device.index is not None else
                          torch.cuda.current_device())


def target_blocks(device):
    """Blocks that keep every SM busy: 4 per SM."""
    return 4 * device_limits(device).sms


class CudaOpsError(RuntimeError):
    """A CUDA kernel failed to compile or launch; the message names kernel and shapes."""


class CaptureError(RuntimeError):
    """The kernels would be compiled, loaded or opted in while a CUDA graph is captured."""


class CupyNotInstalled(ImportError):
    """CuPy is not installed (as opposed to installed and failing to import)."""


def import_cupy():
    """``import cupy``; the ImportError says how to install it where it is not installed
    (:class:`CupyNotInstalled`), and carries the import's own error where it is installed but
    does not import."""
    try:
        import cupy
    except Exception as exc:  # a broken install raises ImportError, OSError or RuntimeError
        if isinstance(exc, ModuleNotFoundError) and exc.name == 'cupy':
            raise CupyNotInstalled(f'CuPy is not installed: {INSTALL_HINT}') from exc
        raise ImportError(f'CuPy is installed but does not import: {type(exc).__name__}: '
                          f'{exc}') from exc
    return cupy


def source_dir():
    """ops/cuda: the copy shipped with the package, else the checkout's."""
    return kernel_sources('cuda')


_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def load_source(name=SOURCE, _seen=None):
    """Text of ``name`` with its local ``#include "..."`` lines inlined (once each), so that
    CuPy's kernel cache, keyed by the source text, sees header changes too."""
    path = source_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f'CUDA source {path} is missing; reinstall lapformer_mm')
    seen = set() if _seen is None else _seen

    def include(match):
        header = match.group(1)
        if header in seen:
            return ''
        seen.add(header)
        return load_source(header, seen)

    return _INCLUDE.sub(include, path.read_text())


def compile_options(variant, element_type):
    """NVRTC options of the module of a variant's kernels for one element type: the tile
    geometry and the element type, which picks the module's entry points (the .cu's end)."""
    return NVRTC_OPTIONS + variant.defines + (f'-DNYS_ELEMENT={element_type}',)


def capturing(device_index):
    """Whether PyTorch's current stream on the device is capturing a CUDA graph."""
    with torch.cuda.device(device_index):
        return torch.cuda.is_current_stream_capturing()


_lock = threading.Lock()
# (device, variant name, element type) -> {kernel name: launch function}
_groups = {}
# (device, variant name, kernel name) -> launch function: what a launch looks up.
_launchers = {}
#: (device, variant name, element type) -> 'compiled' (NVRTC ran) or 'cached' (CuPy's kernel
#: cache served the module), as CuPy reported it.
loaded_from = {}
# (device, variant name, element type) -> the error of its failed compile or load: a build
# that failed once (CuPy for another CUDA than the driver's, say) is not tried at every call.
_failed = {}
# Dynamic shared memory a kernel is opted into at load: all the device allows (so that no
# later call changes it, inside a capture say), less its static shared memory.
_OPTIN_RESERVE = {'nys_forward_solve': NS_STATIC_SMEM, 'nys_backward_solve': 0,
                  'nys_backward_grads': 0}


class _CompileLog:
    """CuPy's ``log_stream``: NVRTC's log is written to it after a compile, never where
    CuPy's kernel cache served the module (cupy/cuda/compiler.py, CuPy 13 and 14)."""
    compiled = False

    def write(self, text):
        self.compiled = True


def _build(device_index, variant, element_type):
    """({kernel name: launch function}, 'compiled' or 'cached') of one module, loaded and
    opted in. CuPy compiles a module once per process (its memo of source, options and log)
    and keeps the binary in its kernel cache (source, options, architecture, NVRTC)."""
    cupy = import_cupy()
    code, options = load_source(), compile_options(variant, element_type)
    log, group = _CompileLog(), {}
    device = cupy.cuda.Device(device_index)
    with device:
        optin = smem_optin(cupy, device.id)
        for stage in STAGES:
            for kind in (0,) if stage in NO_KIND else KERNEL_CODES.values():
                kernel = cupy.RawKernel(code, entry_name(stage, kind), options=options,
                                        backend='nvrtc')
                kernel.compile(log_stream=log)
                reserve = _OPTIN_RESERVE.get(stage)
                if reserve is not None and optin - reserve > DEFAULT_SMEM:
                    kernel.max_dynamic_shared_size_bytes = optin - reserve
                # RawKernel.kernel, the loaded function, skips RawKernel's per-call lookups.
                group[kernel_name(stage, element_type, kind)] = kernel.kernel
    return group, 'compiled' if log.compiled else 'cached'


def load_group(device_index, variant, element_type):
    """The launch functions of every stage for (device, variant, element type), loaded once
    (:func:`_build`); a failure is remembered and raised again (:class:`CudaOpsError`)."""
    key = (device_index, variant.name, element_type)
    if key in _groups:
        return _groups[key]
    with _lock:
        if key in _groups:
            return _groups[key]
        if key in _failed:
            raise CudaOpsError(_failed[key])
        if capturing(device_index):
            raise CaptureError(
                f'the CUDA kernels of the attention ({variant.name}, {element_type}) are not '
                f'loaded yet on cuda:{device_index}, and a CUDA graph is being captured: '
                'compiling and loading them would break the capture. Run the attention once '
                'eagerly before capturing, or call lapformer_mm.ops.backends.cuda.warmup() '
                '(torch.compile mode="reduce-overhead" warms up eagerly by itself).')
        try:
            group, loaded_from[key] = _build(device_index, variant, element_type)
        except Exception as exc:  # CuPy raises CompileException and CUDADriverError
            _failed[key] = (f'compiling {SOURCE} ({variant.name}, {element_type}) for '
                            f'cuda:{device_index} failed: {type(exc).__name__}: {exc}')
            raise CudaOpsError(_failed[key]) from exc
        _launchers.update(((device_index, variant.name, name), fn) for name, fn in group.items())
        _groups[key] = group
    return group


def ensure_loaded(device_index, variant, element_type):
    """None where the kernels of (device, variant, element type) are loaded, or load now;
    else why they cannot be (the compile or load error, remembered: not retried). Inside a
    CUDA-graph capture nothing is loaded: the launch loads, and raises CaptureError."""
    try:
        load_group(device_index, variant, element_type)
    except CudaOpsError as exc:  # this build's failure, now or remembered from before
        return str(exc)
    except CaptureError:
        return None
    return None


def raw_stream(device_index):
    """Handle of PyTorch's current stream on the device (the capture stream while a CUDA
    graph is being captured), without making a Stream object (as inductor's code does)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


class _Stream(NamedTuple):
    """A stream as CuPy's launch reads it (its ``.ptr`` alone): PyTorch's current one, never
    CuPy's own current stream, which would escape a CUDA-graph capture."""
    ptr: int


def launch(name, variant, tensor, grid, block, params, shared_mem=0, shapes='', smem_limit=0):
    """Launch kernel ``name`` of ``variant`` on PyTorch's current stream of ``tensor``'s
    device with the by-value ``params``; no host synchronisation, a device context only when
    that device is not the current one. Failures raise :class:`CudaOpsError` naming the
    kernel, the geometry and ``shapes`` (a string, or a callable made on failure only).
    ``smem_limit``: the plan's, which the emulation checks (the device opted in to its own)."""
    cupy = import_cupy()
    device_index = tensor.device.index
    call = _launchers.get((device_index, variant.name, name))
    if call is None:  # a launch no checked call loaded for
        element_type = name.split('<', 1)[1].split(',')[0].rstrip('>').strip()
        call = load_group(device_index, variant, element_type)[name]
    try:
        stream = _Stream(raw_stream(device_index))
        if cupy.cuda.runtime.getDevice() == device_index:
            call(grid, block, (params,), shared_mem=shared_mem, stream=stream)
        else:
            with cupy.cuda.Device(device_index):
                call(grid, block, (params,), shared_mem=shared_mem, stream=stream)
    except Exception as exc:
        raise CudaOpsError(f'launching {name} ({variant.name}, grid={grid}, block={block}, '
                           f'shared_mem={shared_mem}) for '
                           f'{shapes() if callable(shapes) else shapes} failed: {exc}') from exc


def warmup(device=None, dtypes=(torch.float32,), value_dims=None, m=None):
    """Load, on ``device`` (default: the current one), every variant the op can pick there
    for these dtypes, ahead of any CUDA-graph capture (a first use inside one raises
    :class:`CaptureError`): those that calls of ``m`` landmarks (default: any of 1 to
    MAX_M) and these value widths (default: 32 and 64, the tiles' widths; widths without
    kernels on the device are left out) select. Returns the (variant name, dtype) pairs
    loaded; a dtype, or a width given, that the kernels do not take is a ValueError."""
    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    for dtype in dtypes:
        if dtype not in ELEMENT_TYPES:
            raise ValueError(f'dtypes: the CUDA kernels take '
                             f'{", ".join(map(str, ELEMENT_TYPES))}, got {dtype}')
    limits = device_limits(torch.device('cuda', index))
    landmarks = range(1, MAX_M + 1) if m is None else (m,)
    variants = {}
    for dv in value_dims or (32, MAX_DV):
        plans = [plan(count, dv, limits.smem_optin) for count in landmarks]
        picked = [found.variant for found in plans if isinstance(found, Plan)]
        if not picked and value_dims is not None:
            raise ValueError(f'value_dims: no kernels for d_v = {dv} on device {index} '
                             f'({"; ".join(plans[-1])})')
        variants.update((v.name, v) for v in picked)
    loaded = []
    for variant in variants.values():
        for dtype in dtypes:
            load_group(index, variant, ELEMENT_TYPES[dtype])
            loaded.append((variant.name, dtype))
    return loaded


# == Backend: the op's calls ==

class _Ready(NamedTuple):
    """A call's check passed: its plan, the device's limits, the element type."""
    plan: Plan
    limits: DeviceLimits
    element: str


# (device, dtype, q's shape, d_v, m, kernel, limits) -> _Ready: the check of a call, found
# again by the op's body after the selection's not_supported, and by the backward.
_READY = {}
_MAX_READY = 1024


def _checked(q, v, landmarks, opts, load=True):
    """(the :class:`_Ready` or None, why not, the build's failure or None) of a call: the
    operands and the device checked and the kernels loaded (``load``) once per shape and
    device, then found in ``_READY``. Never raises."""
    try:
        limits = device_limits(q.device)
        key = (q.device.index, q.dtype, q.shape, v.shape[3], landmarks.shape[2], opts.kernel,
               limits)
        if load and key in _READY:
            return _READY[key], (), None
        reasons, found = fit(q, v, landmarks, opts, limits)
    except Exception as exc:  # a device that cannot even be queried
        return None, (f'the device could not be queried ({type(exc).__name__}: {exc})',), None
    if reasons or not load:
        return None, reasons, None
    element = ELEMENT_TYPES[q.dtype]
    failure = ensure_loaded(q.device.index, found.variant, element)
    if failure is not None:
        return None, (failure,), failure
    if len(_READY) >= _MAX_READY:
        _READY.clear()
    ready = _READY[key] = _Ready(found, limits, element)
    return ready, (), None


def not_supported(q, k, v, landmarks, opts):
    """Why this backend cannot run these operands (empty: it can). Never raises. Where the
    operands fit, the kernels they need are loaded here (once), so that a build that fails
    is a reason, not an error inside the op. A ``torch.compile`` trace loads nothing and
    reads no load state: the graph's first run loads, and raises what fails."""
    return _checked(q, v, landmarks, opts, load=not torch.compiler.is_compiling())[1]


class _Call(NamedTuple):
    """What every launch of one op call shares."""
    plan: Plan
    names: dict           # stage -> kernel name
    n_splits: int
    params: np.ndarray    # the zero-initialised nys_params, operands and sizes filled
    launch: functools.partial


def _call(q, k, v, landmarks, opts, shapes):
    """The plan, kernel names, row slices and common parameters of one call, from its check
    (:func:`_checked`: done by the selection's not_supported, else here); its launches go to
    :func:`launch` with the shapes for an error."""
    ready, reasons, failure = _checked(q, v, landmarks, opts)
    if failure is not None:
        # The op's selection builds the kernels first and falls back where that fails, so a
        # build failing here means they were chosen unbuilt: by a torch.compile trace (which
        # builds nothing, and reads impl=None as 'cupy'), or by a direct call of the op.
        raise RuntimeError(
            "impl='cupy' cannot run this call: its CUDA kernels were selected when a "
            "torch.compile graph was traced, before they were built (a trace builds nothing; "
            "with impl=None it chooses them unbuilt), or by calling the registered op with "
            f"impl='cupy'; the build then failed: {failure}. Compile with impl='reference' "
            "(eager calls with impl=None fall back to it, but a trace chooses the kernels "
            "whether or not their build failed earlier)")
    if ready is None:  # the registered op called with impl='cupy' directly
        raise RuntimeError(f"impl='cupy' cannot run this call: {'; '.join(reasons)}; use "
                           "impl='reference' or None")
    batch, heads, n, d = q.shape
    n_splits, chunk = splits(batch * heads, n, target_blocks(q.device), ready.plan.variant.tn)
    kind = KERNEL_CODES[opts.kernel]
    p = np.zeros(1, PARAMS_DTYPE)
    for name, t in (('q', q), ('k', k), ('v', v), ('L', landmarks)):
        set_operand(p, name, t)
    p['bh_count'] = batch * heads
    p['heads'], p['n'], p['m'], p['d'], p['dv'] = heads, n, landmarks.shape[2], d, v.shape[3]
    p['chunk'], p['splits'], p['ns_partials'] = chunk, n_splits, ready.plan.ns_partials
    p['iters'], p['init_authors'] = opts.iters, opts.ns_init == 'authors'
    p['refine'], p['injective'] = bool(opts.ns_refine), opts.normalize == 'injective'
    p['neg_inv_lam'] = -1.0 / opts.lam
    p['neg_coef'] = -(1.0 if kind == KERNEL_CODES['laplacian'] else 2.0) / opts.lam
    p['eps'], p['whiten_eps'] = opts.eps, opts.whiten_eps

    def describe():  # the operands for an error message, formatted only if one is raised
        return ', '.join(f'{key} {tuple(t.shape)} {t.dtype}' for key, t in shapes.items())

    variant = ready.plan.variant
    go = functools.partial(launch, variant=variant, tensor=q, block=variant.block, params=p,
                           shapes=describe, smem_limit=ready.limits.smem_optin)
    return _Call(ready.plan, {s: kernel_name(s, ready.element, kind) for s in STAGES},
                 n_splits, p, go)


def forward(q, k, v, landmarks, opts):
    """(out, context, inverse, stats) of the op's contract, in 4 launches."""
    c = _call(q, k, v, landmarks, opts, dict(q=q, v=v, landmarks=landmarks))
    batch, heads, n, _ = q.shape
    m, dv, bh, device = landmarks.shape[2], v.shape[3], batch * heads, q.device
    out = torch.empty(batch, n, heads, dv, dtype=q.dtype, device=device)
    context = torch.empty(batch, heads, m + 1, dv, dtype=_F32, device=device)
    inverse = torch.empty(batch, heads, m, m, dtype=_F32, device=device)
    stats = torch.empty(batch, heads, 3 if opts.normalize == 'injective' else 1, m,
                        dtype=_F32, device=device)
    # First the slices' fp64 sums [r^T v, sum v, sum r] (2 d_v + 1 each; 8-byte aligned at
    # the allocation's start), then the float partials [mean, M2, centred R, its column
    # sums] per slice, the fold and the solve's [P, centred R, column sums, common part,
    # mean value] per (batch, head) (the .cu's nys_forward_work_stride).
    common_floats = 2 * bh * c.n_splits * (2 * dv + 1)
    part_floats = bh * c.n_splits * (3 * m + m * dv)
    fold_floats = bh * (m + 1) * dv
    work = torch.empty(common_floats + part_floats + fold_floats
                       + bh * (m * m + m * dv + m + 2 * dv), dtype=_F32, device=device)
    p, base, variant = c.params, work.data_ptr(), c.plan.variant
    p['out'], p['context'] = out.data_ptr(), context.data_ptr()
    p['inverse'], p['stats'] = inverse.data_ptr(), stats.data_ptr()
    p['common'], base = base, base + 4 * common_floats
    p['part'], p['fold'] = base, base + 4 * part_floats
    p['work'] = base + 4 * (part_floats + fold_floats)
    bh_grid = min(bh, MAX_GRID_YZ)
    # Job 0 of a (batch, head) is the Newton-Schulz block, the others merge the slices,
    # sy / ty pieces each.
    jobs = 1 + ceil_div(ceil_div(2 * m + m * dv + dv, variant.lanes), variant.sy // variant.ty)
    c.launch(c.names['nys_forward_stats'], grid=(c.n_splits, bh_grid))
    c.launch(c.names['nys_forward_solve'], grid=(min(jobs, MAX_GRID_X), bh_grid),
             block=(variant.tx, variant.sy, 1), shared_mem=c.plan.solve_smem)
    c.launch(c.names['nys_forward_context'],
             grid=(min(ceil_div(dv, variant.cc), MAX_GRID_X), bh_grid))
    c.launch(c.names['nys_forward_out'], grid=(min(ceil_div(n, variant.tn), MAX_GRID_X), bh_grid))
    return out, context, inverse, stats


def _token_layout(batch, heads, n, width, like):
    """An uninitialised (B, h, n, width) view of a contiguous (B, n, h, width) tensor."""
    return torch.empty(batch, n, heads, width, dtype=like.dtype,
                       device=like.device).transpose(1, 2)


def backward(grad, q, k, v, landmarks, context, inverse, stats, opts):
    """(dq, dk, dv, dlandmarks) of the op's contract, in 5 launches; dk is empty when k is None."""
    c = _call(q, k, v, landmarks, opts, dict(grad=grad, q=q, v=v, landmarks=landmarks))
    batch, heads, n, d = q.shape
    m, dv, bh = landmarks.shape[2], v.shape[3], batch * heads
    grad = grad if grad.dtype == q.dtype else grad.to(q.dtype)
    # The token layout (B, N, h, .), as the module's projections have it: their backward
    # then needs no copy. The landmarks' gradient takes their strides when dense.
    dq = _token_layout(batch, heads, n, d, q)
    dk = None if k is None else _token_layout(batch, heads, n, d, q)
    dv_out = _token_layout(batch, heads, n, dv, q)
    dl = torch.empty_like(landmarks)
    reduce_floats = bh * c.n_splits * (m * dv + dv)
    # Per (batch, head): dR / N, a, W = (dP + dP^T) * k(L, L), the merged T, colsum(G) and
    # w (the .cu's nys_backward_work_stride).
    work_floats = bh * (2 * m * dv + m + m * m + 2 * dv)
    work = torch.empty(reduce_floats + work_floats + bh * c.n_splits * m * d, dtype=_F32,
                       device=q.device)
    p, base, lanes = c.params, work.data_ptr(), c.plan.variant.lanes
    for name, t in (('g', grad.transpose(1, 2)), ('grad_q', dq), ('grad_k', dk),
                    ('grad_v', dv_out), ('grad_l', dl)):
        set_operand(p, name, t)
    p['context'], p['inverse'], p['stats'] = (context.data_ptr(), inverse.data_ptr(),
                                              stats.data_ptr())
    p['part'], p['work'] = base, base + 4 * reduce_floats
    p['lpart'] = base + 4 * (reduce_floats + work_floats)
    p['solve_cols'] = c.plan.backward_solve_cols
    bh_grid = min(bh, MAX_GRID_YZ)
    c.launch(c.names['nys_backward_reduce'], grid=(c.n_splits, bh_grid))
    c.launch(c.names['nys_backward_merge'],
             grid=(min(ceil_div(m * dv + dv, lanes), MAX_GRID_X), bh_grid))
    c.launch(c.names['nys_backward_solve'], grid=(min(bh, MAX_GRID_X),),
             shared_mem=c.plan.backward_solve_smem)
    c.launch(c.names['nys_backward_grads'], grid=(c.n_splits, bh_grid),
             shared_mem=c.plan.grads_smem)
    c.launch(c.names['nys_backward_landmarks'],
             grid=(min(ceil_div(m * d, lanes), MAX_GRID_X), bh_grid))
    return dq, q.new_empty(0) if dk is None else dk, dv_out, dl
