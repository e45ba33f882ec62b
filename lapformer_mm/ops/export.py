"""What the exporters need of the attention: when they trace (:func:`exporting`; the entry then
runs ``reference.forward`` with ``export=True``, or within ``kernel_form('ort')``
:func:`ort_forward`), what can export, the residual's precision, the attention's form and the
standard file's kernel matrices in token blocks (:func:`pairwise_placeholders`, then
:func:`expand_placeholders`; docs/deploy.md)."""
import contextlib
import contextvars

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from . import reference
from ._checks import KERNELS, trace_quiet
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
    return KERNELS[kind]


def _symbolic(op, inputs, attrs, like, shapes, domain=ORT_DOMAIN):
    """The node ``domain::op`` under torch.export: outputs of ``like``'s dtype."""
    return torch.onnx.ops.symbolic_multi_out(
        f'{domain}::{op}', inputs, attrs, dtypes=[like.dtype] * len(shapes), shapes=shapes,
        version=ORT_OPSET_VERSION)


def _node(g, op, like, *inputs, outputs=1, domain=ORT_DOMAIN, **attrs):
    """The node ``domain::op`` for the TorchScript exporter, outputs of ``like``'s dtype and
    rank with unknown sizes: the exporter's later symbolics read the dtype (type promotion),
    and the sizes are the runtime's to compute."""
    outs = g.op(f'{domain}::{op}', *inputs, outputs=outputs, **attrs)
    for out in (outs,) if outputs == 1 else outs:
        out.setType(like.type().with_sizes([None] * like.type().dim()))
    return outs


def _placeholder_attrs(lam, kind, blocks, m):
    # The factor, not λ: ONNX attributes are fp32, and the unblocked form multiplies by
    # fp32(-1/λ), not by -1/fp32(λ).
    return dict(scale=-1.0 / lam, kind=kind, blocks=blocks, m=m)


class _PairwiseKernel(torch.autograd.Function):
    """PairwiseKernel for the TorchScript exporter: the library's node (blocks 0) or the
    placeholder of :func:`expand_placeholders`; the forward (what the trace runs) is the
    standard form."""

    @staticmethod
    def forward(ctx, x, y, lam, kind, blocks, m):
        return reference.similarity_export(x, y, lam, kind)

    @staticmethod
    def symbolic(g, x, y, lam, kind, blocks, m):
        if not blocks:
            return _node(g, ORT_KERNEL_OP, x, x, y, lam_f=lam, kind_s=kind)
        attrs = _placeholder_attrs(lam, kind, blocks, m)
        return _node(g, ORT_KERNEL_OP, x, x, y, domain=PLACEHOLDER_DOMAIN,
                     scale_f=attrs['scale'], kind_s=kind, blocks_i=blocks, m_i=m)


def _pairwise_node(x, y, lam, kind, blocks=0, m=0):
    """k(x, y) (..., N, M) as one PairwiseKernel node: the op library's (blocks 0) or the
    placeholder of ``blocks`` token blocks and ``m`` landmarks."""
    if torch.compiler.is_exporting():
        shape = (*x.shape[:-1], y.shape[-2])
        attrs, domain = dict(lam=lam, kind=kind), ORT_DOMAIN
        if blocks:
            attrs, domain = _placeholder_attrs(lam, kind, blocks, m), PLACEHOLDER_DOMAIN
        return _symbolic(ORT_KERNEL_OP, (x, y), attrs, x, [shape], domain=domain)[0]
    return _PairwiseKernel.apply(x, y, lam, kind, blocks, m)


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
        return _pairwise_node(x, y, float(lam), _kind_name(kind))

    @staticmethod
    def attention_rows_forward(x, landmarks, v, lam, kind, want_stats, want_rows):
        lam, kind = float(lam), _kind_name(kind)
        x = x.transpose(1, 2)
        # No v (the query pass of separate keys): a zero-width one, and no rhs.
        v = x[..., :0] if v is None else v.transpose(1, 2)
        if torch.compiler.is_exporting():
            (b, n, h, _), m = x.shape, landmarks.shape[-2]
            shapes = [(b, h, m + 1, v.shape[-1]), (b, h, 2 * want_stats + bool(v.shape[-1]), m),
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


# The standard file's kernel matrices in token blocks --------------------------------------------

#: The domain of the placeholder nodes that ``deploy.export_onnx`` has the exporters write for
#: the tokens' kernel matrices, and then expands into standard operators
#: (:func:`expand_placeholders`): no file it writes keeps one.
PLACEHOLDER_DOMAIN = 'lapformer_mm.placeholder'
#: The expansion takes the tokens in blocks whose difference tensor (one image, h heads,
#: ``reference.LANDMARK_CHUNK`` landmarks, d, N / blocks) is at most this many bytes: the
#: step's passes then run from the cache, not from memory (docs/deploy.md).
BLOCK_BYTES = 4 << 20
#: At most this many blocks: each is 3 nodes per landmark chunk.
MAX_BLOCKS = 32
#: The lowest opset of the expansion (Split and ReduceSum take their sizes as inputs).
BLOCKS_MIN_OPSET = 13


@trace_quiet
def _hint(size):
    """A traced size as an int without a guard: a hint of torch.export's symbolic sizes, the
    value of the TorchScript trace's size tensors (the value is all we want)."""
    if not isinstance(size, torch.Tensor):
        return optimization_hint(size)
    return int(size)


def token_blocks(x, num_landmarks):
    """Token blocks of k(x, L) for x (B, h, N, d), from the traced sizes (their hints when
    symbolic: no guard). At most ``num_landmarks``, which no stage's N is below."""
    _, heads, tokens, dim = (_hint(size) for size in x.shape)
    need = -(-heads * reference.LANDMARK_CHUNK * dim * tokens * x.element_size() // BLOCK_BYTES)
    return max(1, min(need, MAX_BLOCKS, num_landmarks))


def pairwise_placeholder(x, y, lam, kind):
    """:func:`reference.similarity`'s export form within :func:`pairwise_placeholders`: one
    placeholder node for fp32 (B, h, N, d) operands, else ``reference.similarity_export``."""
    if x.dim() != 4 or x.dtype != torch.float32:
        return reference.similarity_export(x, y, lam, kind)
    num_landmarks = _hint(y.shape[-2])
    return _pairwise_node(x, y, float(lam), kind, token_blocks(x, num_landmarks),
                          num_landmarks)


def pairwise_placeholders():
    """Within the block (and the current thread or task) exported kernel matrices of the
    tokens are placeholder nodes, for :func:`expand_placeholders` to expand."""
    return _scoped(reference.SIMILARITY_EXPORT, 'similarity export', 'placeholders',
                   {'placeholders': pairwise_placeholder})


def expand_placeholders(proto):
    """Replace each placeholder node in ``proto`` (an ``onnx.ModelProto``, changed in place)
    with ``reference.similarity_export``'s standard operators, the tokens in blocks.

    Each block is its own ``Sub → Abs → ReduceSum`` steps (``Mul`` for the Gaussian) of
    ``reference.LANDMARK_CHUNK`` landmarks, the block bounds ⌊i·N / blocks⌋ computed from
    the input's shape: every sum is the unblocked form's, in the same order. The nodes of
    the i-th are named ``lapformer_mm_kernel<i>/...``."""
    from onnx import helper
    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if o.domain in ('', 'ai.onnx')), 0)
    if opset < BLOCKS_MIN_OPSET:
        raise ValueError(f'expand_placeholders: opset {opset}; the token blocks need '
                         f'{BLOCKS_MIN_OPSET} or later')
    if any(node.domain == PLACEHOLDER_DOMAIN for f in proto.functions for node in f.node):
        raise ValueError('expand_placeholders: a placeholder inside a local function')
    nodes, count = [], 0
    for node in graph.node:
        if node.domain == PLACEHOLDER_DOMAIN:
            nodes.extend(_blocked_kernel(node, f'lapformer_mm_kernel{count}', helper))
            count += 1
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    imports = [o for o in proto.opset_import if o.domain != PLACEHOLDER_DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(imports)
    return proto


def _blocked_kernel(node, prefix, helper):
    """The standard nodes of one placeholder (x (B, h, N, d), y (B, h, m, d)) -> k (B, h, N, m)."""
    from onnx import TensorProto
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    kind, blocks, m = attrs['kind'].decode(), attrs['blocks'], attrs['m']
    x, y = node.input
    nodes = []

    def const(values, dtype=TensorProto.INT64):
        out = f'{prefix}/c{len(nodes)}'
        nodes.append(helper.make_node('Constant', [], [out], value=helper.make_tensor(
            out, dtype, [len(values)], values)))
        return out

    def op(op_type, inputs, outputs=1, **kwargs):
        outs = [f'{prefix}/{op_type}{len(nodes)}_{i}' for i in range(outputs)]
        nodes.append(helper.make_node(op_type, inputs, outs, name=f'{prefix}/{len(nodes)}',
                                      **kwargs))
        return outs[0] if outputs == 1 else outs

    # x (B, h, 1, d, N) and the landmark chunks (B, h, c, d, 1): the layout of similarity_export.
    # A Reshape, not an Unsqueeze: ONNX Runtime moves a Transpose past an Unsqueeze (and then
    # before a Split), into a slower 5-D transpose (docs/deploy.md).
    shape = op('Shape', [x])
    xt = op('Reshape', [op('Transpose', [x], perm=[0, 1, 3, 2]), op('Concat', [
        op('Slice', [shape, const([0]), const([2])]), const([1]),
        op('Slice', [shape, const([3]), const([4])]), const([-1])], axis=0)])
    yt = op('Unsqueeze', [y, const([4])])
    step = reference.LANDMARK_CHUNK
    chunks = [op('Slice', [yt, const([j]), const([min(j + step, m)]), const([2])])
              for j in range(0, m, step)]
    if blocks == 1:
        parts = [xt]
    else:
        tokens = op('Slice', [shape, const([2]), const([3])])
        edges = op('Div', [op('Mul', [tokens, const(list(range(blocks + 1)))]),
                           const([blocks])])
        sizes = op('Sub', [op('Slice', [edges, const([1]), const([blocks + 1])]),
                           op('Slice', [edges, const([0]), const([blocks])])])
        parts = op('Split', [xt, sizes], outputs=blocks, axis=4)
    rows = []
    for part in parts:
        sums = []
        for chunk in chunks:
            diff = op('Sub', [part, chunk])
            size = op('Abs', [diff]) if kind == 'laplacian' else op('Mul', [diff, diff])
            sums.append(op('ReduceSum', [size, const([3])], keepdims=0))
        rows.append(sums[0] if len(sums) == 1 else op('Concat', sums, axis=2))
    dist = rows[0] if len(rows) == 1 else op('Concat', rows, axis=3)
    scaled = op('Mul', [dist, const([attrs['scale']], TensorProto.FLOAT)])
    nodes.append(helper.make_node('Transpose', [op('Exp', [scaled])], list(node.output),
                                  name=f'{prefix}/out', perm=[0, 1, 3, 2]))
    return nodes


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

