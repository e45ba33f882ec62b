"""The CUDA backend (``impl='cupy'``): 4 launches forward, 5 backward, of ``ops/cuda``'s kernels
compiled by NVRTC through CuPy at run time. **Plan**: :mod:`.cuda_plan`. **Runtime**: one CuPy
module per (device, variant, element type), kernels under fixed C names (CuPy's own cache serves
later processes), loaded and opted in to the device's own limit once, never in a CUDA-graph
capture. **Backend**: :func:`not_supported` checks a call and loads its kernels once per shape
and device; the op's body finds that check."""
import functools
import re
import threading
import types
import warnings

import numpy as np
import torch

from ..reference import KERNEL_CODES
from . import cuda_plan, kernel_sources
from .cuda_plan import MAX_GRID_X, MAX_GRID_YZ, STAGES, ceil_div, fit, plan, set_operand

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
_AVAILABILITY, _WARNED = [], []


def _availability():
    if _AVAILABILITY:
        return _AVAILABILITY[0]
    try:
        cupy = import_cupy()
        # What every call needs: the CUDA runtime CuPy was built for (a driver older than it
        # fails here) and the NVRTC library it compiles with.
        cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.nvrtc.getVersion()
        result = None, True
    except ImportError as exc:
        result = str(exc), not isinstance(exc, ModuleNotFoundError)
    except Exception as exc:  # CuPy raises its own CUDARuntimeError, or an OSError
        result = (f'CuPy {getattr(cupy, "__version__", "?")} is installed but cannot '
                  f'initialise CUDA and NVRTC: {type(exc).__name__}: {exc}'), True
    _AVAILABILITY.append(result)
    return result


def unavailable_reason():
    """Why the backend cannot run here (CuPy absent, or failing to import or initialise)."""
    return _availability()[0]


def available():
    """Whether CuPy imports and initialises; warns once where not (absent: only if CUDA is)."""
    reason, installed = _availability()
    if reason is not None and not _WARNED and (installed or torch.cuda.is_available()):
        _WARNED.append(True)
        warnings.warn(f'lapformer_mm: the CUDA kernels are not available ({reason}); the '
                      'attention runs the slower PyTorch reference on CUDA tensors',
                      RuntimeWarning, stacklevel=4)
    return reason is None


@functools.lru_cache(maxsize=None)
def _device_limits(index):
    props = torch.cuda.get_device_properties(index)
    try:
        nvrtc = import_cupy().cuda.nvrtc.getVersion()[0]
    except Exception:  # no CuPy: the backend is not available anyway
        nvrtc = 0
    return cuda_plan.DeviceLimits((props.major, props.minor), props.multi_processor_count,
                                  props.shared_memory_per_block_optin, nvrtc)


def device_limits(device):
    """:class:`cuda_plan.DeviceLimits` of a CUDA device (cached per device)."""
    return _device_limits(device.index if device.index is not None else
                          torch.cuda.current_device())


def target_blocks(device):
    """Blocks that keep every SM busy: 4 per SM."""
    return 4 * device_limits(device).sms


class CudaOpsError(RuntimeError):
    """A CUDA kernel failed to compile or launch; the message names kernel and shapes."""


class CaptureError(RuntimeError):
    """The kernels would be compiled, loaded or opted in while a CUDA graph is captured."""


def import_cupy():
    """``import cupy``, or an ImportError: ModuleNotFoundError with the install hint where CuPy
    is absent, else carrying the import's own error."""
    try:
        import cupy
    except Exception as exc:  # a broken install raises ImportError, OSError or RuntimeError
        if isinstance(exc, ModuleNotFoundError) and exc.name == 'cupy':
            raise ModuleNotFoundError(f'CuPy is not installed: {INSTALL_HINT}',
                                      name='cupy') from exc
        raise ImportError(f'CuPy is installed but does not import: {type(exc).__name__}: '
                          f'{exc}') from exc
    return cupy


#: ops/cuda: the wheel's copy, else the checkout's.
source_dir = functools.partial(kernel_sources, 'cuda')


_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def load_source(name=SOURCE, _seen=None):
    """Text of ``name`` with its local ``#include "..."`` lines inlined (once each), so that
    CuPy's kernel cache, keyed by the source text, sees header changes too."""
    seen = set() if _seen is None else _seen

    def include(match):
        header = match.group(1)
        if header in seen:
            return ''
        seen.add(header)
        return load_source(header, seen)

    return _INCLUDE.sub(include, (source_dir() / name).read_text())


def compile_options(variant, element_type):
    """NVRTC options of a variant's module for one element type (which picks its entries)."""
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
#: (device, variant name, element type) -> 'compiled' (NVRTC ran) or 'cached' (CuPy's cache).
loaded_from = {}
# (device, variant name, element type) -> the error of its failed build, not retried.
_failed = {}
# Opted in at load: all the device allows less static memory (no later call changes it).
_OPTIN_RESERVE = {'nys_forward_solve': cuda_plan.NS_STATIC_SMEM, 'nys_backward_solve': 0,
                  'nys_backward_grads': 0}


class _CompileLog:
    """CuPy's ``log_stream``, one per module (CuPy's memo of a module includes it): NVRTC's log
    is written to it after a compile, never where CuPy's cache served the module."""
    compiled = False

    def write(self, text):
        self.compiled = True


def _build(device_index, variant, element_type):
    """({kernel name: launch function}, 'compiled' or 'cached') of one module, opted in."""
    cupy = import_cupy()
    code, options = load_source(), compile_options(variant, element_type)
    log, group = _CompileLog(), {}
    device = cupy.cuda.Device(device_index)
    with device:
        # The device's own limit, whatever limit the plan was made for.
        runtime = cupy.cuda.runtime
        optin = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                           device.id)
        for stage in STAGES:
            for kind in (0,) if stage in cuda_plan.NO_KIND else KERNEL_CODES.values():
                kernel = cupy.RawKernel(code, cuda_plan.entry_name(stage, kind), options=options,
                                        backend='nvrtc')
                kernel.compile(log_stream=log)
                reserve = _OPTIN_RESERVE.get(stage)
                if reserve is not None and optin - reserve > cuda_plan.DEFAULT_SMEM:
                    kernel.max_dynamic_shared_size_bytes = optin - reserve
                # RawKernel.kernel, the loaded function, skips RawKernel's per-call lookups.
                group[cuda_plan.kernel_name(stage, element_type, kind)] = kernel.kernel
    return group, 'compiled' if log.compiled else 'cached'


def load_group(device_index, variant, element_type):
    """{kernel name: launch function} of (device, variant, element type), loaded once."""
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
                f'the attention\'s CUDA kernels ({variant.name}, {element_type}) would be loaded '
                f'on cuda:{device_index} inside a CUDA-graph capture: run the attention once '
                'eagerly first, or call lapformer_mm.ops.backends.cuda.warmup()')
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
    """None where the kernels are (or now get) loaded or a capture defers it, else the error."""
    try:
        load_group(device_index, variant, element_type)
    except CudaOpsError as exc:
        return str(exc)
    except CaptureError:
        pass
    return None


def raw_stream(device_index):
    """Handle of PyTorch's current stream on the device (the capture stream while a CUDA
    graph is being captured), without making a Stream object (as inductor's code does)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def launch(name, variant, tensor, grid, block, params, shared_mem=0, shapes='', smem_limit=0):
    """Launch kernel ``name`` with the by-value ``params`` (no host sync); a failure names kernel,
    geometry and ``shapes`` (str or callable). ``smem_limit``: the plan's (emulation checks)."""
    cupy = import_cupy()
    device_index = tensor.device.index
    call = _launchers.get((device_index, variant.name, name))
    if call is None:  # a launch no checked call loaded for
        element_type = name.split('<', 1)[1].split(',')[0].rstrip('>').strip()
        call = load_group(device_index, variant, element_type)[name]
    try:
        # PyTorch's current stream as CuPy's launch reads it (.ptr alone); never CuPy's own
        # current stream, which would escape a CUDA-graph capture.
        stream = types.SimpleNamespace(ptr=raw_stream(device_index))
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
    """Load on ``device`` (default: current), before a CUDA-graph capture, every variant calls
    of ``m`` landmarks (default: any) and these value widths (default: 32 and 64 where the
    device has kernels) select; returns (variant name, dtype) pairs."""
    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    for dtype in dtypes:
        if dtype not in cuda_plan.ELEMENT_TYPES:
            raise ValueError(f'dtypes: the CUDA kernels take '
                             f'{", ".join(map(str, cuda_plan.ELEMENT_TYPES))}, got {dtype}')
    limits = device_limits(torch.device('cuda', index))
    landmarks = range(1, cuda_plan.MAX_M + 1) if m is None else (m,)
    variants = {}
    for dv in value_dims or (32, cuda_plan.MAX_DV):
        plans = [plan(count, dv, limits.smem_optin) for count in landmarks]
        picked = [found.variant for found in plans if isinstance(found, cuda_plan.Plan)]
        if not picked and value_dims is not None:
            raise ValueError(f'value_dims: no kernels for d_v = {dv} on device {index} '
                             f'({"; ".join(plans[-1])})')
        variants.update((v.name, v) for v in picked)
    loaded = [(variant, dtype) for variant in variants.values() for dtype in dtypes]
    for variant, dtype in loaded:
        load_group(index, variant, cuda_plan.ELEMENT_TYPES[dtype])
    return [(variant.name, dtype) for variant, dtype in loaded]


# == Backend: the op's calls ==

# (device, dtype, q's shape, d_v, m, kernel, limits) -> (plan, limits, element type): a passed
# check, found again by the op's body after the selection's not_supported, and the backward.
_READY = {}
_MAX_READY = 1024


def _checked(q, v, landmarks, opts, load=True):
    """((plan, limits, element type) or None, reasons): checked and loaded once per shape."""
    try:
        limits = device_limits(q.device)
        key = (q.device.index, q.dtype, q.shape, v.shape[3], landmarks.shape[2], opts.kernel,
               limits)
        if load and key in _READY:
            return _READY[key], ()
        reasons, found = fit(q, v, landmarks, opts, limits)
    except Exception as exc:  # a device that cannot even be queried
        return None, (f'the device could not be queried ({type(exc).__name__}: {exc})',)
    if reasons or not load:
        return None, reasons
    element = cuda_plan.ELEMENT_TYPES[q.dtype]
    failure = ensure_loaded(q.device.index, found.variant, element)
    if failure is not None:
        return None, (failure,)
    if len(_READY) >= _MAX_READY:
        _READY.clear()
    ready = _READY[key] = found, limits, element
    return ready, ()


def not_supported(q, k, v, landmarks, opts):
    """Why this backend cannot run these operands (empty: it can). The kernels load here (a
    failing build is a reason); a ``torch.compile`` trace loads nothing: its first run does."""
    return _checked(q, v, landmarks, opts, load=not torch.compiler.is_compiling())[1]


def _call(q, k, v, landmarks, opts, shapes):
    """(plan, {stage: kernel name}, row slices, nys_params with operands and sizes, launch)
    of one call, from its check (done by the selection's not_supported, else here)."""
    ready, reasons = _checked(q, v, landmarks, opts)
    if ready is None:
        # The selection falls back where a call does not fit or the build fails, so these
        # calls were chosen unchecked: by a torch.compile trace (which builds nothing, and
        # reads impl=None as 'cupy') or by calling the registered op with impl='cupy'.
        raise RuntimeError(
            f"impl='cupy' cannot run this call: {'; '.join(reasons)}. Chosen by a "
            "torch.compile trace (which builds no kernels) or a direct call of the registered "
            "op; use impl='reference' there")
    found, limits, element = ready
    batch, heads, n, d = q.shape
    n_splits, chunk = cuda_plan.splits(batch * heads, n, target_blocks(q.device), found.variant.tn)
    kind = KERNEL_CODES[opts.kernel]
    p = np.zeros(1, cuda_plan.PARAMS_DTYPE)
    for name, t in (('q', q), ('k', k), ('v', v), ('L', landmarks)):
        set_operand(p, name, t)
    p['bh_count'] = batch * heads
    p['heads'], p['n'], p['m'], p['d'], p['dv'] = heads, n, landmarks.shape[2], d, v.shape[3]
    p['chunk'], p['splits'], p['ns_partials'] = chunk, n_splits, found.ns_partials
    p['iters'], p['init_authors'] = opts.iters, opts.ns_init == 'authors'
    p['refine'], p['injective'] = bool(opts.ns_refine), opts.normalize == 'injective'
    p['neg_inv_lam'] = -1.0 / opts.lam
    p['neg_coef'] = -(1.0 if kind == KERNEL_CODES['laplacian'] else 2.0) / opts.lam
    p['eps'], p['whiten_eps'] = opts.eps, opts.whiten_eps

    def describe():  # the operands for an error message, formatted only if one is raised
        return ', '.join(f'{key} {tuple(t.shape)} {t.dtype}' for key, t in shapes.items())

    go = functools.partial(launch, variant=found.variant, tensor=q, block=found.variant.block,
                           params=p, shapes=describe, smem_limit=limits.smem_optin)
    return found, {s: cuda_plan.kernel_name(s, element, kind) for s in STAGES}, n_splits, p, go


def forward(q, k, v, landmarks, opts):
    """(out, context, inverse, stats) of the op's contract, in 4 launches."""
    found, names, n_splits, p, go = _call(q, k, v, landmarks, opts,
                                          dict(q=q, v=v, landmarks=landmarks))
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
    common_floats = 2 * bh * n_splits * (2 * dv + 1)
    part_floats = bh * n_splits * (3 * m + m * dv)
    fold_floats = bh * (m + 1) * dv
    work = torch.empty(common_floats + part_floats + fold_floats
                       + bh * (m * m + m * dv + m + 2 * dv), dtype=_F32, device=device)
    base, variant = work.data_ptr(), found.variant
    p['out'], p['context'] = out.data_ptr(), context.data_ptr()
    p['inverse'], p['stats'] = inverse.data_ptr(), stats.data_ptr()
    p['common'], base = base, base + 4 * common_floats
    p['part'], p['fold'] = base, base + 4 * part_floats
    p['work'] = base + 4 * (part_floats + fold_floats)
    bh_grid = min(bh, MAX_GRID_YZ)
    # Job 0 of a (batch, head) is the Newton-Schulz block, the others merge the slices,
    # sy / ty pieces each.
    jobs = 1 + ceil_div(ceil_div(2 * m + m * dv + dv, variant.lanes), variant.sy // variant.ty)
    go(names['nys_forward_stats'], grid=(n_splits, bh_grid))
    go(names['nys_forward_solve'], grid=(min(jobs, MAX_GRID_X), bh_grid),
       block=(variant.tx, variant.sy, 1), shared_mem=found.solve_smem)
    go(names['nys_forward_context'], grid=(min(ceil_div(dv, variant.cc), MAX_GRID_X), bh_grid))
    go(names['nys_forward_out'], grid=(min(ceil_div(n, variant.tn), MAX_GRID_X), bh_grid))
    return out, context, inverse, stats


def _token_layout(batch, heads, n, width, like):
    """An uninitialised (B, h, n, width) view of a contiguous (B, n, h, width) tensor."""
    return torch.empty(batch, n, heads, width, dtype=like.dtype,
                       device=like.device).transpose(1, 2)


def backward(grad, q, k, v, landmarks, context, inverse, stats, opts):
    """(dq, dk, dv, dlandmarks) of the op's contract, in 5 launches; dk is empty when k is None."""
    found, names, n_splits, p, go = _call(q, k, v, landmarks, opts,
                                          dict(grad=grad, q=q, v=v, landmarks=landmarks))
    batch, heads, n, d = q.shape
    m, dv, bh = landmarks.shape[2], v.shape[3], batch * heads
    grad = grad if grad.dtype == q.dtype else grad.to(q.dtype)
    # The token layout (B, N, h, .), as the module's projections have it: their backward
    # then needs no copy. The landmarks' gradient takes their strides when dense.
    dq = _token_layout(batch, heads, n, d, q)
    dk = None if k is None else _token_layout(batch, heads, n, d, q)
    dv_out = _token_layout(batch, heads, n, dv, q)
    dl = torch.empty_like(landmarks)
    reduce_floats = bh * n_splits * (m * dv + dv)
    # Per (batch, head): dR / N, a, W = (dP + dP^T) * k(L, L), the merged T, colsum(G) and
    # w (the .cu's nys_backward_work_stride).
    work_floats = bh * (2 * m * dv + m + m * m + 2 * dv)
    work = torch.empty(reduce_floats + work_floats + bh * n_splits * m * d, dtype=_F32,
                       device=q.device)
    base, lanes = work.data_ptr(), found.variant.lanes
    for name, t in (('g', grad.transpose(1, 2)), ('grad_q', dq), ('grad_k', dk),
                    ('grad_v', dv_out), ('grad_l', dl)):
        set_operand(p, name, t)
    p['context'], p['inverse'], p['stats'] = (context.data_ptr(), inverse.data_ptr(),
                                              stats.data_ptr())
    p['part'], p['work'] = base, base + 4 * reduce_floats
    p['lpart'] = base + 4 * (reduce_floats + work_floats)
    p['solve_cols'] = found.backward_solve_cols
    bh_grid = min(bh, MAX_GRID_YZ)
    go(names['nys_backward_reduce'], grid=(n_splits, bh_grid))
    go(names['nys_backward_merge'], grid=(min(ceil_div(m * dv + dv, lanes), MAX_GRID_X), bh_grid))
    go(names['nys_backward_solve'], grid=(min(bh, MAX_GRID_X),),
       shared_mem=found.backward_solve_smem)
    go(names['nys_backward_grads'], grid=(n_splits, bh_grid), shared_mem=found.grads_smem)
    go(names['nys_backward_landmarks'],
       grid=(min(ceil_div(m * d, lanes), MAX_GRID_X), bh_grid))
    return dq, q.new_empty(0) if dk is None else dk, dv_out, dl
