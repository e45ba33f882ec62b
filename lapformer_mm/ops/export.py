"""What the exporters need of the attention (docs/deploy.md): the form they write, the op
library's nodes, what can export, and the token-block placeholders."""
import dataclasses
import warnings

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from . import reference
from ._checks import KERNELS, check_bool, check_choice

#: The refinement residual's precision: 'fp64' as in eager, 'fp32' for runtimes without fp64.
RESIDUAL_PRECISIONS = {'fp64': torch.float64, 'fp32': torch.float32}
#: The ONNX domain of the op library, its operators and their version.
ORT_DOMAIN = 'lapformer_mm'
ORT_KERNEL_OP = 'PairwiseKernel'
ORT_ROWS_OP = 'AttentionRows'
ORT_APPLY_OP = 'AttentionApply'
ORT_OPS = (ORT_KERNEL_OP, ORT_ROWS_OP, ORT_APPLY_OP)
ORT_OPSET_VERSION = 1


def exporting():
    """True while ``torch.onnx.export`` or ``torch.export`` traces; not under the FLOP counter's
    ``torch.jit`` trace, which must see the op."""
    return torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


@dataclasses.dataclass(frozen=True)
class ExportForm:
    """How an exported attention is written: ort, the op library's nodes for fp32 operands (else
    standard operators); blocks, the tokens' kernel matrices as token-block placeholders."""
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
        return (pairwise_placeholder if self.blocks else reference.similarity_export)(
            x, y, lam, kernel)


class _Node(torch.autograd.Function):
    """A node of the op library (or a placeholder) for the TorchScript exporter; its forward
    (what the trace or an eager call runs) is the node's standard-operator form."""

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
        # The first input's dtype (later symbolics read it) and rank; sizes the runtime's.
        like = inputs[0].type()
        for out in (outs, ) if outputs == 1 else outs:
            out.setType(like.with_sizes([None] * like.dim()))
        return outs


_OUTPUTS = {ORT_KERNEL_OP: 1, ORT_ROWS_OP: 3, ORT_APPLY_OP: 1}


def _node(op, inputs, attrs, standard, shapes, domain=ORT_DOMAIN):
    """The outputs (a tuple) of ``domain::op``: a ``torch.onnx.ops`` node of ``shapes()`` under
    torch.export, else a :class:`_Node` computing ``standard``."""
    if torch.compiler.is_exporting():
        return tuple(torch.onnx.ops.symbolic_multi_out(
            f'{domain}::{op}', inputs, attrs, dtypes=[inputs[0].dtype] * _OUTPUTS[op],
            shapes=shapes(), version=ORT_OPSET_VERSION))
    outs = _Node.apply((domain, op, tuple(attrs.items())), standard, *inputs)
    return (outs, ) if _OUTPUTS[op] == 1 else outs


def _pairwise_node(x, y, lam, kind, blocks=0, m=0):
    """k(x, y) as one PairwiseKernel node: the op library's (blocks 0) or the placeholder. The
    placeholder carries fp32(-1/λ), not λ, as the unblocked form multiplies by it."""
    attrs, domain = ((dict(scale=-1.0 / lam, kind=kind, blocks=blocks, m=m), PLACEHOLDER_DOMAIN)
                     if blocks else (dict(lam=lam, kind=kind), ORT_DOMAIN))
    return _node(ORT_KERNEL_OP, (x, y), attrs,
                 lambda x, y: reference.similarity_export(x, y, lam, kind),
                 lambda: [(*x.shape[:-1], y.shape[-2])], domain)[0]


def rows_reference(x, landmarks, v, lam, kind, want_stats, want_rows):
    """AttentionRows in standard operators, for x, v in the token layout: (rhs [R; v̄], stats
    (μ and var if want_stats, then c̄ when d_v > 0), rows)."""
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
    """AttentionApply in standard operators: (B, N, h, d_v)."""
    c = rows - rows.mean(-1, keepdim=True) if centre else rows
    return (torch.matmul(c, a) + bias).transpose(1, 2)


class OrtNodes:
    """The op library's nodes with the CPU kernels' signatures (``backends.cpu.forward`` composes
    them), reading q, k, v in the token layout (B, N, h, d): the graph's transposes cancel."""

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
        return _node(ORT_ROWS_OP, (x, landmarks, v), attrs, lambda *a: rows_reference(
            *a, attrs['lam'], attrs['kind'], want_stats, want_rows), shapes)

    @staticmethod
    def attention_rows_apply(rows, a, bias, centre, dtype):
        (b, h, n, _), dv = rows.shape, a.shape[-1]
        out, = _node(ORT_APPLY_OP, (rows, a, bias), dict(centre=int(centre)),
                     lambda rows, a, bias: apply_reference(rows, a, bias, centre),
                     lambda: [(b, n, h, dv)])
        return out.to(dtype)



# The standard file's kernel matrices in token blocks --------------------------------------------
#: The domain of ``ExportForm(blocks=True)``'s placeholders; no file written keeps one.
PLACEHOLDER_DOMAIN = 'lapformer_mm.placeholder'
#: Bytes of one token block's difference tensor, for passes from the cache (docs/deploy.md).
BLOCK_BYTES = 4 << 20
#: At most this many blocks: each is 3 nodes per landmark chunk.
MAX_BLOCKS = 32


def _hint(size):
    """A traced size as an int without a guard (a symbolic size's hint, a size tensor's value:
    the tracer's warning that it is not recorded is not for us)."""
    if not isinstance(size, torch.Tensor):
        return optimization_hint(size)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', torch.jit.TracerWarning)
        return int(size)


def token_blocks(x, num_landmarks):
    """Token blocks of k(x, L) for x (B, h, N, d); at most ``num_landmarks`` (no N is below)."""
    _, heads, tokens, dim = (_hint(size) for size in x.shape)
    need = -(-heads * reference.LANDMARK_CHUNK * dim * tokens * x.element_size() // BLOCK_BYTES)
    return max(1, min(need, MAX_BLOCKS, num_landmarks))


def pairwise_placeholder(x, y, lam, kind):
    """The tokens' kernel matrix as a placeholder for fp32 (B, h, N, d) operands."""
    if x.dim() != 4 or x.dtype != torch.float32:
        return reference.similarity_export(x, y, lam, kind)
    num_landmarks = _hint(y.shape[-2])
    return _pairwise_node(x, y, float(lam), kind, token_blocks(x, num_landmarks),
                          num_landmarks)


def check_exportable(options):
    if options.solver != 'newton':
        raise ValueError(f"solver={options.solver!r} does not export: only solver='newton' does")
    if options.impl not in (None, 'reference'):
        raise ValueError(f"impl={options.impl!r} does not export: use impl='reference' or None "
                         '(and unset LAPFORMER_OPS)')

