"""What the exporters need of the attention: when they trace (:func:`exporting`; the entry then
runs ``reference.forward`` with ``export=True``), what can export, the residual's precision and
the kernel matrices' form (docs/deploy.md)."""
import contextlib

import torch

from . import reference

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


#: Forms of the kernel matrix in an exported ONNX graph: 'standard' (standard-domain operators
#: only, every runtime) or 'ort' (one ``lapformer_mm::PairwiseKernel`` node per kernel matrix,
#: for ONNX Runtime with the op library of tools/build_ort_ops.py).
KERNEL_FORMS = ('standard', 'ort')
#: The ONNX domain, operator and its version of the op library's kernel matrix node.
ORT_DOMAIN = 'lapformer_mm'
ORT_KERNEL_OP = 'PairwiseKernel'
ORT_OPSET_VERSION = 1


def kernel_form(form):
    """Within the block (and the current thread or task) exported kernel matrices take
    ``form``, one of :data:`KERNEL_FORMS`; nothing changes outside exporters."""
    return _scoped(reference.SIMILARITY_NODE, 'kernel form', form,
                   {'standard': None, 'ort': ort_pairwise_kernel})


class _OrtPairwiseKernel(torch.autograd.Function):
    """The op library's node for the TorchScript exporter (its ``symbolic``); the forward
    (what the trace runs) is the standard form."""

    @staticmethod
    def forward(ctx, x, y, lam, kind):
        with kernel_form('standard'):
            return reference.similarity_export(x, y, lam, kind)

    @staticmethod
    def symbolic(g, x, y, lam, kind):
        out = g.op(f'{ORT_DOMAIN}::{ORT_KERNEL_OP}', x, y, lam_f=float(lam), kind_s=kind)
        # x's dtype and rank with unknown sizes: the exporter's later symbolics read the dtype
        # (type promotion), and the sizes are the runtime's to compute.
        return out.setType(x.type().with_sizes([None] * x.type().dim()))


def ort_pairwise_kernel(x, y, lam, kind):
    """``lapformer_mm::PairwiseKernel(x, y)`` (..., N, M), attributes lam and kind: a
    ``torch.onnx.ops.symbolic`` node under torch.export, else the ``symbolic`` of a Function."""
    if torch.compiler.is_exporting():
        return torch.onnx.ops.symbolic(
            f'{ORT_DOMAIN}::{ORT_KERNEL_OP}', (x, y), dict(lam=float(lam), kind=kind),
            dtype=x.dtype, shape=(*x.shape[:-1], y.shape[-2]), version=ORT_OPSET_VERSION)
    return _OrtPairwiseKernel.apply(x, y, float(lam), kind)


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

