"""The attention's primitives in standard operators, for ONNX and ``torch.export``.

The registered ops of :mod:`lapformer_mm.ops.kernels` are opaque to the exporters
(``lapformer_mm::pairwise_kernel`` has no ONNX translation and ``torch.cdist`` lowers to
``aten._cdist_forward``, which has none either), and ``adaptive_avg_pool2d`` exports only
when the input is a multiple of the output. While an exporter runs (:func:`exporting`)
the attention takes the forms here instead; eager calls, ``torch.compile`` and the
``torch.jit`` trace of the FLOP counter keep the registered ops.

* :func:`pairwise_kernel_export`: the kernel matrix a few landmarks at a time, so no
  (..., N, M, d) tensor of the whole input exists: the ℓ1 distance as ``ReduceSum`` of
  ``|x - y_j|``, the squared ℓ2 distance from the coordinate differences (the matmul
  expansion loses it to cancellation at large norms, docs/numerics.md); or, in the
  opt-in 'ort' :func:`kernel_form`, one node of the ONNX Runtime op library.
* :func:`newton_schulz_export`: the Newton–Schulz iterations unrolled into matmuls.
* :func:`adaptive_avg_pool2d_export`: two averaging matrices built from the integer bin
  edges of ``adaptive_avg_pool2d``, for any input size, symbolic sizes included.
* :func:`export_attention`: the Nyström attention from these, with the refinement step's
  residual in fp64 (default) or fp32 (:func:`residual_precision`).

Only ``solver='newton'`` with the plain-PyTorch reference implementation exports
(:func:`check_exportable`).
"""
import contextlib
import contextvars

import torch
import torch.nn.functional as F

from ._precision import compute_dtype
from .normalize import whiten
from .solvers import DEFAULT_NS_ITERS

#: Precisions of the refinement step's residual ``b - P x`` in the exported attention:
#: 'fp64' as in eager (ONNX Runtime CPU runs fp64 matmuls), 'fp32' for runtimes without
#: fp64 (TensorRT, mobile delegates). docs/deploy.md gives each one's accuracy.
RESIDUAL_PRECISIONS = ('fp64', 'fp32')
_RESIDUAL = contextvars.ContextVar('lapformer_mm_export_residual', default='fp64')


def exporting():
    """True while ``torch.onnx.export`` (either exporter) or ``torch.export`` traces.

    Not ``torch.jit.is_tracing()``: the FLOP counter's jit trace must see the
    registered ops, which carry its FLOP handles.
    """
    return torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


@contextlib.contextmanager
def residual_precision(precision):
    """Within the block, exported attention forms its refinement residual in ``precision``.

    ``precision``: one of :data:`RESIDUAL_PRECISIONS`. Scoped to the block (and the
    current thread or task); eager calls are not affected.
    """
    if precision not in RESIDUAL_PRECISIONS:
        raise ValueError(f'residual precision {precision!r} is not supported; allowed: '
                         f'{", ".join(map(repr, RESIDUAL_PRECISIONS))}')
    token = _RESIDUAL.set(precision)
    try:
        yield
    finally:
        _RESIDUAL.reset(token)


def check_exportable(options):
    """Raise a ValueError unless :class:`~lapformer_mm.ops.AttentionOptions` can export."""
    if options.solver != 'newton':
        raise ValueError(f"solver={options.solver!r} does not export: only solver='newton' "
                         '(Newton–Schulz, unrolled into matmuls) has an export form; '
                         "build the model with attn_cfg=dict(solver='newton') to export it")
    if options.impl not in (None, 'reference'):
        raise ValueError(f'impl={options.impl!r} does not export: the exporters trace the '
                         "plain-PyTorch reference; use impl='reference' (or None, and unset "
                         'LAPFORMER_OPS)')


#: Landmarks per step of :func:`pairwise_kernel_export` (one row of the default 7 × 7
#: grid): each step holds a (..., 7, d, N) difference, 7× the input. One landmark per
#: step was no faster in ONNX Runtime and made 7× the nodes, which the exporters trace
#: at several milliseconds each.
LANDMARK_CHUNK = 7


#: Forms of the kernel matrix in an exported ONNX graph: 'standard' (standard-domain
#: operators only, every runtime) or 'ort' (one ``lapformer_mm::PairwiseKernel`` node per
#: kernel matrix, for ONNX Runtime with the op library of tools/build_ort_ops.py).
KERNEL_FORMS = ('standard', 'ort')
_KERNEL_FORM = contextvars.ContextVar('lapformer_mm_export_kernel_form', default='standard')
#: The ONNX domain, operator and its version of the op library's kernel matrix node.
ORT_DOMAIN = 'lapformer_mm'
ORT_KERNEL_OP = 'PairwiseKernel'
ORT_OPSET_VERSION = 1


@contextlib.contextmanager
def kernel_form(form):
    """Within the block, exported kernel matrices take ``form`` (one of :data:`KERNEL_FORMS`).

    Scoped to the block (and the current thread or task), like :func:`residual_precision`;
    nothing changes on import or outside exporters.
    """
    if form not in KERNEL_FORMS:
        raise ValueError(f'kernel form {form!r} is not supported; allowed: '
                         f'{", ".join(map(repr, KERNEL_FORMS))}')
    token = _KERNEL_FORM.set(form)
    try:
        yield
    finally:
        _KERNEL_FORM.reset(token)


def pairwise_kernel_export(x, y, lam, kind, chunk=LANDMARK_CHUNK):
    """exp(-dist(x_i, y_j) / lam) (..., N, M) for x (..., N, d), y (..., M, d).

    In the 'ort' :func:`kernel_form` (fp32 inputs with equal leading dims), one
    :func:`ort_pairwise_kernel` node. Otherwise standard operators: ``chunk``
    landmarks y_j per step (None: all M at once, for the landmarks' own M × M matrix),
    so no (..., N, M, d) tensor of the whole input exists. M must be static (it is: the
    landmark grid). The differences are laid out (..., chunk, d, N): ONNX Runtime's
    broadcast then subtracts one scalar from a run of N values and reduces over d across
    whole rows, 1.3-1.5× faster than the (..., N, chunk, d) layout.
    """
    if _KERNEL_FORM.get() == 'ort' and x.dtype == torch.float32 and y.dtype == torch.float32:
        return ort_pairwise_kernel(x, y, lam, kind)
    num = y.shape[-2]
    step = num if chunk is None else chunk
    xt = x.transpose(-1, -2).unsqueeze(-3)
    yt = y.unsqueeze(-1)

    def distance(rows):
        diff = xt - rows
        # Abs/Mul then ReduceSum, not ReduceL1/ReduceL2: the same sums (exact for ℓ1; for
        # the Gaussian no sqrt-then-square round trip), and ONNX Runtime's ReduceSum is
        # vectorised where its ReduceL1 runs a scalar loop (docs/deploy.md).
        if kind == 'laplacian':
            return diff.abs().sum(dim=-2)
        return (diff * diff).sum(dim=-2)

    parts = [distance(yt[..., start:start + step, :, :]) for start in range(0, num, step)]
    dist = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
    return torch.exp(dist * (-1.0 / lam)).transpose(-1, -2)


class _OrtPairwiseKernel(torch.autograd.Function):
    """The op library's node for the TorchScript exporter (its ``symbolic``); the forward
    (what the trace runs) is the standard form."""

    @staticmethod
    def forward(ctx, x, y, lam, kind):
        with kernel_form('standard'):
            return pairwise_kernel_export(x, y, lam, kind)

    @staticmethod
    def symbolic(g, x, y, lam, kind):
        out = g.op(f'{ORT_DOMAIN}::{ORT_KERNEL_OP}', x, y, lam_f=float(lam), kind_s=kind)
        # x's dtype and rank with unknown sizes: the exporter's later symbolics read the
        # dtype (type promotion), and the sizes are the runtime's to compute.
        return out.setType(x.type().with_sizes([None] * x.type().dim()))


def ort_pairwise_kernel(x, y, lam, kind):
    """``lapformer_mm::PairwiseKernel(x, y)``, attributes lam and kind: (..., N, M).

    Under torch.export (and so the dynamo ONNX exporter) a ``torch.onnx.ops.symbolic``
    node, under the TorchScript exporter the ``symbolic`` of an autograd Function; x and y
    must have equal leading dims. Only ONNX Runtime with the op library runs the node.
    """
    if torch.compiler.is_exporting():
        return torch.onnx.ops.symbolic(
            f'{ORT_DOMAIN}::{ORT_KERNEL_OP}', (x, y), dict(lam=float(lam), kind=kind),
            dtype=x.dtype, shape=(*x.shape[:-1], y.shape[-2]), version=ORT_OPSET_VERSION)
    return _OrtPairwiseKernel.apply(x, y, float(lam), kind)


def newton_schulz_export(P, iters, init):
    """Newton–Schulz inverse of SPD P (..., m, m): ``iters`` steps X <- 2X - X (P X).

    The reference's iteration (:func:`~lapformer_mm.ops.solvers.newton_schulz_iterate`)
    unrolled, on (batch, m, m) with the same ``baddbmm`` (two traced ops per step).
    """
    m = P.shape[-1]
    p = P.reshape(-1, m, m)
    norm = p.abs().sum(-1).amax(-1, keepdim=True).unsqueeze(-1)
    if init == 'identity':
        x = torch.eye(m, dtype=P.dtype, device=P.device) / norm
    else:
        x = p * (1.8 / (norm * norm))
    for _ in range(iters):
        x = torch.baddbmm(x, x, torch.bmm(p, x), beta=2.0, alpha=-1.0)
    return x.reshape(P.shape)


def bin_average_matrix(size, bins, dtype, device):
    """(bins, size) averaging matrix of ``adaptive_avg_pool*``'s bins over ``size`` inputs.

    Bin i covers [floor(i·size / bins), ceil((i + 1)·size / bins)), the integer edges
    of ATen's adaptive pooling; ``size`` may be an int, a SymInt or a traced size.
    """
    index = torch.arange(bins, device=device)
    start = torch.div(index * size, bins, rounding_mode='floor')
    end = torch.div((index + 1) * size + (bins - 1), bins, rounding_mode='floor')
    cols = torch.arange(size, device=device)
    inside = (cols >= start.unsqueeze(-1)) & (cols < end.unsqueeze(-1))
    return inside.to(dtype) / (end - start).unsqueeze(-1).to(dtype)


def adaptive_avg_pool2d_export(maps, output_size):
    """``F.adaptive_avg_pool2d(maps, output_size)`` for maps (..., H, W), from matmuls."""
    out_h, out_w = output_size
    lead, (height, width) = maps.shape[:-2], maps.shape[-2:]
    rows = bin_average_matrix(height, out_h, maps.dtype, maps.device)
    cols = bin_average_matrix(width, out_w, maps.dtype, maps.device)
    # As batched products over one leading dimension, with the bin matrices expanded to
    # it: torch.matmul of a 4-D map by a matrix folds the map to (B·C·H, W), and with
    # symbolic H that fold makes torch.export guard on ``B·C % (B·C·ceil(H/4)) != 0``,
    # which it cannot prove over a user's Dim range ("Constraints violated (h)").
    # The leading count spelled out, not -1: inferring it divides the symbolic numel,
    # another guard torch.export cannot always prove.
    count = 1
    for size in lead:
        count = count * size
    flat = maps.reshape(count, height, width)
    pooled = torch.bmm(rows.expand(count, out_h, height),
                       torch.bmm(flat, cols.transpose(0, 1).expand(count, width, out_w)))
    return pooled.reshape(*lead, out_h, out_w)


class AdaptiveAvgPool2dExport(torch.nn.Module):
    """Module form of :func:`adaptive_avg_pool2d_export` for an int or pair output size.

    What the deploy tools put in place of ``nn.AdaptiveAvgPool2d`` (mmseg's pyramid
    pooling) in the copy of a model they export.
    """

    def __init__(self, output_size):
        super().__init__()
        if isinstance(output_size, int):
            output_size = (output_size, output_size)
        if (not isinstance(output_size, (tuple, list)) or len(output_size) != 2
                or not all(isinstance(s, int) and s >= 1 for s in output_size)):
            raise ValueError(f'output_size must be a positive int or a pair of them, got '
                             f'{output_size!r}')
        self.output_size = tuple(output_size)

    def forward(self, x):
        return adaptive_avg_pool2d_export(x, self.output_size)

    def extra_repr(self):
        return f'output_size={self.output_size}'


def pool_tokens_export(t, hw, grid):
    """Landmarks of tokens t (B, h, N, d) on hw = (H, W): the grid × grid bin averages.

    The export form of :func:`~lapformer_mm.ops.landmarks.pool_tokens`, which clips the
    grid to min(grid, H) × min(grid, W); here every stage is at least grid × grid (the
    export's size range, docs/deploy.md), so m = grid² is static.
    """
    batch, heads, _, width = t.shape
    height, cols = hw
    if torch.compiler.is_exporting():
        # Symbolic sizes: a runtime check in the exported program (and a clear error at
        # export time); the traced sizes of the TorchScript exporter have none.
        torch._check(height >= grid, lambda: f'every stage map must be at least {grid} '
                                              f'× {grid} to export (docs/deploy.md)')
        torch._check(cols >= grid, lambda: f'every stage map must be at least {grid} '
                                            f'× {grid} to export (docs/deploy.md)')
    maps = t.transpose(-1, -2).reshape(batch * heads, width, height, cols)
    pooled = adaptive_avg_pool2d_export(maps, (grid, grid))
    return pooled.reshape(batch, heads, width, grid * grid).transpose(-1, -2)


def export_attention(q, k, v, landmarks, options, dropout_p=0.0):
    """:func:`~lapformer_mm.ops.nystrom_forward` in standard operators (same arguments).

    Computes in fp32 (fp64 stays fp64) and returns q's dtype, as the eager op does; the
    refinement residual follows :func:`residual_precision` (fp32 inputs only: fp64
    inputs keep fp64 throughout).
    """
    check_exportable(options)
    out_dtype = q.dtype
    dtype = compute_dtype(q.dtype)
    shared = k is q
    q, v, landmarks = (_cast(t, dtype) for t in (q, v, landmarks))
    k = q if shared else _cast(k, dtype)
    c_q = pairwise_kernel_export(q, landmarks, options.lam, options.kernel)
    c_k = c_q if shared else pairwise_kernel_export(k, landmarks, options.lam, options.kernel)
    w = pairwise_kernel_export(landmarks, landmarks, options.lam, options.kernel, chunk=None)
    P = w + options.eps * torch.eye(w.shape[-1], dtype=dtype, device=w.device)
    rhs = torch.matmul(c_k.transpose(-1, -2), v)
    iters = DEFAULT_NS_ITERS if options.iters is None else options.iters
    inverse = newton_schulz_export(P, iters, options.ns_init)
    context = torch.matmul(inverse, rhs)
    if options.ns_refine:
        if _RESIDUAL.get() == 'fp64':
            residual = _cast(rhs.double() - torch.matmul(P.double(), context.double()), dtype)
        else:
            residual = rhs - torch.matmul(P, context)
        context = context + torch.matmul(inverse, residual)
    z = whiten(c_q, options.whiten_eps) if options.normalize == 'injective' else c_q
    if dropout_p > 0:
        z = F.dropout(z, dropout_p, training=True)
    return _cast(torch.matmul(z, context), out_dtype)


def _cast(t, dtype):
    # A cast to the tensor's own dtype is still a traced node (two, under torch.export).
    return t if t.dtype == dtype else t.to(dtype)
