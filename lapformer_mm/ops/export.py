"""What the exporters need of the attention: when they trace (:func:`exporting`; the entry then
runs ``reference.forward`` with ``export=True``, or within ``kernel_form('ort')``
:func:`ort_forward`), what can export, the residual's precision and the attention's form
(docs/deploy.md)."""
import contextlib
import contextvars

import torch

from . import reference
from .backends import cpu

#: Precisions of the refinement step's residual ``b - P x`` in an exported attention: 'fp64'
#: as in eager (ONNX Runtime CPU runs fp64 matmuls), 'fp32' for runtimes without fp64
#: (TensorRT, mobile delegates). docs/deploy.md gives each one's accuracy.
RESIDUAL_PRECISIONS = {'fp64': torch.float64, 'fp32': torch.float32}


def exporting():
    """True while ``torch.onnx.export`` (either exporter) or ``torch.export`` traces; not under
    the FLOP counter's ``torch.jit`` trace, which must see the op that carries its FLOP handle."""
    return torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


@contextlib.contextmanager
def _scoped(var, what, choice, values):
    """``var`` is ``values[choice]`` within the block (and the current thread or task)."""
    if not isinstance(choice, str) or choice not in values:
        raise ValueError(f'{what} {choice!r} is not supported; allowed: '
                         f'{", ".join(map(repr, values))}')
    token = var.set(values[choice])
    try:
        yield
    finally:
        var.reset(token)


def residual_precision(precision):
    """Within the block (and the current thread or task) the attention forms its refinement
    residual in ``precision``, one of :data:`RESIDUAL_PRECISIONS`."""
    return _scoped(reference.RESIDUAL_DTYPE, 'residual precision', precision,
                   RESIDUAL_PRECISIONS)


#: Forms of the attention in an exported ONNX graph: 'standard' (standard-domain operators
#: only, every runtime) or 'ort' (the ONNX Runtime op library's nodes, tools/build_ort_ops.py:
#: the eager CPU backend's two passes over the rows as AttentionRows and AttentionApply, the
#: landmarks' own kernel matrix as PairwiseKernel, the m × m steps in standard operators).
KERNEL_FORMS = ('standard', 'ort')
#: The ONNX domain of the op library, its operators and their version.
ORT_DOMAIN = 'lapformer_mm'
ORT_KERNEL_OP = 'PairwiseKernel'
ORT_ROWS_OP = 'AttentionRows'
ORT_APPLY_OP = 'AttentionApply'
ORT_OPS = (ORT_KERNEL_OP, ORT_ROWS_OP, ORT_APPLY_OP)
ORT_OPSET_VERSION = 1

_FORM = contextvars.ContextVar('lapformer_mm_kernel_form', default='standard')


def kernel_form(form):
    """Within the block (and the current thread or task) exported attentions take ``form``,
    one of :data:`KERNEL_FORMS`; nothing changes outside exporters."""
    return _scoped(_FORM, 'kernel form', form, {f: f for f in KERNEL_FORMS})


def _kind_name(kind):
    return next(name for name, code in cpu.KINDS.items() if code == kind)


def _symbolic(op, inputs, attrs, like, shapes):
    """The op library's node ``op`` under torch.export: outputs of ``like``'s dtype."""
    return torch.onnx.ops.symbolic_multi_out(
        f'{ORT_DOMAIN}::{op}', inputs, attrs, dtypes=[like.dtype] * len(shapes), shapes=shapes,
        version=ORT_OPSET_VERSION)


def _node(g, op, like, *inputs, outputs=1, **attrs):
    """The op library's node ``op`` for the TorchScript exporter, outputs of ``like``'s dtype
    and rank with unknown sizes: the exporter's later symbolics read the dtype (type
    promotion), and the sizes are the runtime's to compute."""
    outs = g.op(f'{ORT_DOMAIN}::{op}', *inputs, outputs=outputs, **attrs)
    for out in (outs,) if outputs == 1 else outs:
        out.setType(like.type().with_sizes([None] * like.type().dim()))
    return outs


class _PairwiseKernel(torch.autograd.Function):
    """PairwiseKernel for the TorchScript exporter; the forward (what the trace runs) is the
    standard form."""

    @staticmethod
    def forward(ctx, x, y, lam, kind):
        return reference.similarity_export(x, y, lam, kind)

    @staticmethod
    def symbolic(g, x, y, lam, kind):
        return _node(g, ORT_KERNEL_OP, x, x, y, lam_f=lam, kind_s=kind)


def rows_reference(x, landmarks, v, lam, kind, want_stats, want_rows):
    """What AttentionRows computes, in standard operators: for x (B, N, h, d) and v (B, N, h,
    d_v) in the token layout, (rhs, stats, rows) of ``attention_rows_forward``."""
    c = reference.similarity_export(x.transpose(1, 2), landmarks, lam, kind)
    rhs = reference.landmark_rhs(c, v.transpose(1, 2))
    centred = c - c.mean(-1, keepdim=True)
    mean = centred.mean(-2, keepdim=True)
    var = (centred - mean).square().mean(-2, keepdim=True)
    stats = torch.cat((mean, var), dim=-2) if want_stats else c[..., :0, :]
    return rhs, stats, c if want_rows else c[..., :0, :]


def apply_reference(rows, a, bias, centre):
    """What AttentionApply computes, in standard operators: (B, N, h, d_v)."""
    c = rows - rows.mean(-1, keepdim=True) if centre else rows
    return (torch.matmul(c, a) + bias).transpose(1, 2)


class _AttentionRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, landmarks, v, lam, kind, want_stats, want_rows):
        return rows_reference(x, landmarks, v, lam, kind, want_stats, want_rows)

    @staticmethod
    def symbolic(g, x, landmarks, v, lam, kind, want_stats, want_rows):
        return _node(g, ORT_ROWS_OP, x, x, landmarks, v, outputs=3, lam_f=lam, kind_s=kind,
                     want_stats_i=int(want_stats), want_rows_i=int(want_rows))


class _AttentionApply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, a, bias, centre):
        return apply_reference(rows, a, bias, centre)

    @staticmethod
    def symbolic(g, rows, a, bias, centre):
        return _node(g, ORT_APPLY_OP, rows, rows, a, bias, centre_i=int(centre))


class OrtNodes:
    """The op library's nodes with the signatures of the CPU backend's kernels
    (``lapformer_mm/csrc/cpu``), so :func:`lapformer_mm.ops.backends.cpu.forward` composes
    them as it composes those: a ``torch.onnx.ops`` node under torch.export, else a Function's
    ``symbolic``. q, k, v come (B, h, N, d) as the op takes them; the nodes read them in the
    token layout (B, N, h, d), which the projections write (the exported graph's transposes
    cancel)."""

    @staticmethod
    def pairwise_forward(x, y, lam, kind):
        lam, kind = float(lam), _kind_name(kind)
        if torch.compiler.is_exporting():
            shape = (*x.shape[:-1], y.shape[-2])
            return _symbolic(ORT_KERNEL_OP, (x, y), dict(lam=lam, kind=kind), x, [shape])[0]
        return _PairwiseKernel.apply(x, y, lam, kind)

    @staticmethod
    def attention_rows_forward(x, landmarks, v, lam, kind, want_stats, want_rows):
        lam, kind = float(lam), _kind_name(kind)
        x = x.transpose(1, 2)
        # No v (the query pass of separate keys): a zero-width one, and no rhs.
        v = x[..., :0] if v is None else v.transpose(1, 2)
        if torch.compiler.is_exporting():
            (b, n, h, _), m = x.shape, landmarks.shape[-2]
            shapes = [(b, h, m, v.shape[-1]), (b, h, 2 if want_stats else 0, m),
                      (b, h, n if want_rows else 0, m)]
            attrs = dict(lam=lam, kind=kind, want_stats=int(want_stats),
                         want_rows=int(want_rows))
            return tuple(_symbolic(ORT_ROWS_OP, (x, landmarks, v), attrs, x, shapes))
        return _AttentionRows.apply(x, landmarks, v, lam, kind, bool(want_stats),
                                    bool(want_rows))

    @staticmethod
    def attention_rows_apply(rows, a, bias, centre, dtype):
        if torch.compiler.is_exporting():
            (b, h, n, _), dv = rows.shape, a.shape[-1]
            out = _symbolic(ORT_APPLY_OP, (rows, a, bias), dict(centre=int(centre)), rows,
                            [(b, n, h, dv)])[0]
        else:
            out = _AttentionApply.apply(rows, a, bias, bool(centre))
        return out.to(dtype)


def ort_forward(q, k, v, landmarks, opts):
    """The attention's output (B, N, h, d_v) as the op library's nodes within
    ``kernel_form('ort')`` for fp32 operands (the library's type), else None."""
    if _FORM.get() != 'ort' or q.dtype != torch.float32:
        return None
    return cpu.forward(q, k, v, landmarks, opts, ops=OrtNodes)[0]


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

