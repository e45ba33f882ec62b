"""What the exporters need of the attention: when they trace (:func:`exporting`), the form they
write (:class:`ExportForm`, which the entry passes down to ``reference.forward``, or for the op
library's nodes to the CPU backend's composition over :class:`OrtNodes`), what can export
(:func:`check_exportable`), and the standard file's kernel matrices in token blocks
(:func:`pairwise_placeholder`, expanded by ``deploy.expand_placeholders``; docs/deploy.md)."""
import dataclasses
import warnings

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from . import reference
from ._checks import KERNELS, check_bool, check_choice

#: Precisions of the refinement step's residual ``b - P x`` in an exported attention: 'fp64'
#: as in eager (ONNX Runtime CPU runs fp64 matmuls), 'fp32' for runtimes without fp64
#: (TensorRT, mobile delegates). docs/deploy.md gives each one's accuracy.
RESIDUAL_PRECISIONS = {'fp64': torch.float64, 'fp32': torch.float32}
#: The ONNX domain of the op library, its operators and their version.
ORT_DOMAIN = 'lapformer_mm'
ORT_KERNEL_OP = 'PairwiseKernel'
ORT_ROWS_OP = 'AttentionRows'
ORT_APPLY_OP = 'AttentionApply'
ORT_OPS = (ORT_KERNEL_OP, ORT_ROWS_OP, ORT_APPLY_OP)
ORT_OPSET_VERSION = 1


def exporting():
    """True while ``torch.onnx.export`` (either exporter) or ``torch.export`` traces; not under
    the FLOP counter's ``torch.jit`` trace, which must see the op that carries its FLOP handle."""
    return torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


@dataclasses.dataclass(frozen=True)
class ExportForm:
    """How an exported attention is written (docs/deploy.md). The entry takes the default one
    while an exporter traces; ``deploy.prepare_for_export`` gives its copy's attentions another.

    residual: the refinement residual's precision (:data:`RESIDUAL_PRECISIONS`); ort: the op
    library's nodes for fp32 operands (``tools/build_ort_ops.py``), else standard operators;
    blocks: the tokens' kernel matrices as placeholders that ``deploy.expand_placeholders``
    turns into token blocks after the export."""
    residual: str = 'fp64'
    ort: bool = False
    blocks: bool = False

    def __post_init__(self):
        check_choice('residual', self.residual, tuple(RESIDUAL_PRECISIONS))
        check_bool('ort', self.ort)
        check_bool('blocks', self.blocks)

    @property
    def residual_dtype(self):
        return RESIDUAL_PRECISIONS[self.residual]

    def similarity(self, x, y, lam, kernel):
        """The tokens' kernel matrix k(x, y) in this form's operators."""
        if self.blocks:
            return pairwise_placeholder(x, y, lam, kernel)
        return reference.similarity_export(x, y, lam, kernel)


class _Node(torch.autograd.Function):
    """A node of the op library (or a placeholder) for the TorchScript exporter: its forward,
    what the trace (or an eager call) runs, is the node's standard-operator form."""

    @staticmethod
    def forward(ctx, node, standard, *inputs):
        return standard(*inputs)

    @staticmethod
    def symbolic(g, node, standard, *inputs):
        domain, op, attrs = node
        kinds = {float: 'f', str: 's', int: 'i'}
        outputs = _OUTPUTS[op]
        outs = g.op(f'{domain}::{op}', *inputs, outputs=outputs,
                    **{f'{name}_{kinds[type(value)]}': value for name, value in attrs})
        # The first input's dtype and rank, sizes unknown: the exporter's later symbolics read
        # the dtype (type promotion); the sizes are the runtime's to compute.
        like = inputs[0].type()
        for out in (outs, ) if outputs == 1 else outs:
            out.setType(like.with_sizes([None] * like.dim()))
        return outs


_OUTPUTS = {ORT_KERNEL_OP: 1, ORT_ROWS_OP: 3, ORT_APPLY_OP: 1}


def _node(op, inputs, attrs, standard, shapes, domain=ORT_DOMAIN):
    """The outputs (a tuple) of ``domain::op`` of ``inputs`` in the first input's dtype: a
    ``torch.onnx.ops`` node of the shapes ``shapes()`` under torch.export, else a
    :class:`_Node` computing ``standard``."""
    if torch.compiler.is_exporting():
        return tuple(torch.onnx.ops.symbolic_multi_out(
            f'{domain}::{op}', inputs, attrs, dtypes=[inputs[0].dtype] * _OUTPUTS[op],
            shapes=shapes(), version=ORT_OPSET_VERSION))
    outs = _Node.apply((domain, op, tuple(attrs.items())), standard, *inputs)
    return (outs, ) if _OUTPUTS[op] == 1 else outs


def _pairwise_node(x, y, lam, kind, blocks=0, m=0):
    """k(x, y) (..., N, M) as one PairwiseKernel node: the op library's (blocks 0) or the
    placeholder of ``blocks`` token blocks and ``m`` landmarks. The placeholder carries the
    factor, not λ: ONNX attributes are fp32, and the unblocked form multiplies by fp32(-1/λ),
    not by -1/fp32(λ)."""
    attrs, domain = ((dict(scale=-1.0 / lam, kind=kind, blocks=blocks, m=m), PLACEHOLDER_DOMAIN)
                     if blocks else (dict(lam=lam, kind=kind), ORT_DOMAIN))
    return _node(ORT_KERNEL_OP, (x, y), attrs,
                 lambda x, y: reference.similarity_export(x, y, lam, kind),
                 lambda: [(*x.shape[:-1], y.shape[-2])], domain)[0]


def rows_reference(x, landmarks, v, lam, kind, want_stats, want_rows):
    """What AttentionRows computes, in standard operators: for x (B, N, h, d) and v (B, N, h,
    d_v) in the token layout, (rhs, stats, rows) of ``attention_rows_forward``: rhs
    [R; v̄] (B, h, m + 1, d_v), stats the whitening's mean and variance (want_stats), then
    c̄ when d_v > 0."""
    c = reference.similarity_export(x.transpose(1, 2), landmarks, lam, kind)
    rhs = torch.cat(reference.landmark_rhs(c, v.transpose(1, 2)), dim=-2)
    centred = c - c.mean(-1, keepdim=True)
    mean = centred.mean(-2, keepdim=True)
    var = (centred - mean).square().mean(-2, keepdim=True)
    stats = ([mean, var] if want_stats else []) + ([c.mean(-2, keepdim=True)]
                                                    if _hint(v.shape[-1]) else [])
    stats = torch.cat(stats, dim=-2) if stats else c[..., :0, :]
    return rhs, stats, c if want_rows else c[..., :0, :]


def apply_reference(rows, a, bias, centre):
    """What AttentionApply computes, in standard operators: (B, N, h, d_v)."""
    c = rows - rows.mean(-1, keepdim=True) if centre else rows
    return (torch.matmul(c, a) + bias).transpose(1, 2)


class OrtNodes:
    """The op library's nodes with the signatures of the CPU backend's kernels
    (``lapformer_mm/csrc/cpu``), so :func:`lapformer_mm.ops.backends.cpu.forward` composes
    them as it composes those. q, k, v come (B, h, N, d) as the op takes them; the nodes read
    them in the token layout (B, N, h, d), which the projections write (the exported graph's
    transposes cancel)."""

    @staticmethod
    def pairwise_forward(x, y, lam, kind):
        return _pairwise_node(x, y, float(lam), KERNELS[kind])

    @staticmethod
    def attention_rows_forward(x, landmarks, v, lam, kind, want_stats, want_rows):
        x = x.transpose(1, 2)
        # No v (the query pass of separate keys): a zero-width one, and no rhs.
        v = x[..., :0] if v is None else v.transpose(1, 2)
        attrs = dict(lam=float(lam), kind=KERNELS[kind], want_stats=int(want_stats),
                     want_rows=int(want_rows))

        def shapes():
            (b, n, h, _), m, dv = x.shape, landmarks.shape[-2], v.shape[-1]
            return [(b, h, m + 1, dv), (b, h, 2 * want_stats + bool(dv), m),
                    (b, h, n if want_rows else 0, m)]
        return _node(ORT_ROWS_OP, (x, landmarks, v), attrs,
                     lambda x, landmarks, v: rows_reference(x, landmarks, v, attrs['lam'],
                                                            attrs['kind'], want_stats,
                                                            want_rows), shapes)

    @staticmethod
    def attention_rows_apply(rows, a, bias, centre, dtype):
        (b, h, n, _), dv = rows.shape, a.shape[-1]
        out, = _node(ORT_APPLY_OP, (rows, a, bias), dict(centre=int(centre)),
                     lambda rows, a, bias: apply_reference(rows, a, bias, centre),
                     lambda: [(b, n, h, dv)])
        return out.to(dtype)


# The standard file's kernel matrices in token blocks --------------------------------------------

#: The domain of the placeholder nodes of ``ExportForm(blocks=True)``, which
#: ``deploy.expand_placeholders`` expands into standard operators: no file it writes keeps one.
PLACEHOLDER_DOMAIN = 'lapformer_mm.placeholder'
#: The expansion takes the tokens in blocks whose difference tensor (one image, h heads,
#: ``reference.LANDMARK_CHUNK`` landmarks, d, N / blocks) is at most this many bytes: the
#: step's passes then run from the cache, not from memory (docs/deploy.md).
BLOCK_BYTES = 4 << 20
#: At most this many blocks: each is 3 nodes per landmark chunk.
MAX_BLOCKS = 32


def _hint(size):
    """A traced size as an int without a guard: a hint of torch.export's symbolic sizes, the
    value of the TorchScript trace's size tensors (the value is all we want, so the tracer's
    warning that it is not recorded in the graph is not for us)."""
    if not isinstance(size, torch.Tensor):
        return optimization_hint(size)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', torch.jit.TracerWarning)
        return int(size)


def token_blocks(x, num_landmarks):
    """Token blocks of k(x, L) for x (B, h, N, d), from the traced sizes (their hints when
    symbolic: no guard). At most ``num_landmarks``, which no stage's N is below."""
    _, heads, tokens, dim = (_hint(size) for size in x.shape)
    need = -(-heads * reference.LANDMARK_CHUNK * dim * tokens * x.element_size() // BLOCK_BYTES)
    return max(1, min(need, MAX_BLOCKS, num_landmarks))


def pairwise_placeholder(x, y, lam, kind):
    """The tokens' kernel matrix as one placeholder node for fp32 (B, h, N, d) operands, else
    ``reference.similarity_export``."""
    if x.dim() != 4 or x.dtype != torch.float32:
        return reference.similarity_export(x, y, lam, kind)
    num_landmarks = _hint(y.shape[-2])
    return _pairwise_node(x, y, float(lam), kind, token_blocks(x, num_landmarks),
                          num_landmarks)


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

