"""FLOPs of LaplacianFormer models with mmengine's ``FlopAnalyzer``, the attention op included.

One FLOP is one multiply-add (mmengine/fvcore); element-wise ops are not counted. The tracer
does not see inside the registered op, so :data:`FLOP_HANDLES` counts it (:func:`attention_flops`:
its kernel, solve and visible parts under ``pairwise_kernel``, ``newton_schulz`` and
``matmul``), the reference path's kernel matrices (``aten::cdist``, N·M·(d + 1), once for
tied keys) and softmax attention (N·M·(d + d_v) per head). ``visible`` are the products a
tracer sees when the kernel and the solve are opaque (as in SOFT's released model):
:func:`flop_totals` reports them (the papers' convention) and ``full``.
"""
import math
from collections import Counter

import torch
from torch import nn

from lapformer_mm.ops import attention

from .model_zoo import count_parameters, data_samples

KERNEL, SOLVE, VISIBLE = 'kernel', 'solve', 'visible'


def _shape(value):
    return value.type().sizes()


def _batch(shape, core):
    return math.prod(shape[:-core])


# mmengine names an op's count by its name without namespace.
PART_KEYS = {KERNEL: 'pairwise_kernel', SOLVE: 'newton_schulz'}


def attention_flops(q_shape, v_shape, m, tied, iters, ns_refine):
    """{'kernel', 'solve', 'visible'} multiply-adds of one op call, q (B, h, N, d), v (..., d_v):
    kernel k(q, L), k(k, L) unless tied, k(L, L); solve 2·m³·iters + m²; visible C_kᵀ v and
    Z · context, and the solve's m × m by m × d_v products (three with ns_refine)."""
    batch = math.prod(q_shape[:-2])
    n, d = q_shape[-2], q_shape[-1]
    kernel = (n * m * (1 if tied else 2) + m * m) * (d + 1)
    solve = 2 * m ** 3 * iters + m * m
    visible = 2 * n * m * v_shape[-1] + (3 if ns_refine else 1) * m * m * v_shape[-1]
    return {KERNEL: batch * kernel, SOLVE: batch * solve, VISIBLE: batch * visible}


def nystrom_attention_flops(inputs, outputs):
    """Traced ``lapformer_mm::nystrom_attention(q, k, v, landmarks, kernel, lam, eps, iters,
    ns_init, ns_refine, ...)``; k is None when keys are tied."""
    tied = inputs[1].type().kind() == 'NoneType'
    parts = attention_flops(_shape(inputs[0]), _shape(inputs[2]), _shape(inputs[3])[-2], tied,
                            inputs[7].toIValue(), inputs[9].toIValue())
    return Counter({PART_KEYS[KERNEL]: parts[KERNEL], PART_KEYS[SOLVE]: parts[SOLVE],
                    'matmul': parts[VISIBLE]})


def cdist_flops(inputs, outputs):
    x, y = _shape(inputs[0]), _shape(inputs[1])
    return Counter({PART_KEYS[KERNEL]: _batch(x, 2) * x[-2] * y[-2] * (x[-1] + 1)})


def softmax_attention_flops(inputs, outputs):
    """q (..., N, d), k (..., M, d), v (..., M, d_v) -> batch · N · M · (d + d_v)."""
    q, k, v = (_shape(t) for t in inputs[:3])
    return _batch(q, 2) * q[-2] * k[-2] * (q[-1] + v[-1])


# mmengine has no handle for the softmax stage's aten op.
FLOP_HANDLES = {
    attention.nystrom_attention_op: nystrom_attention_flops,
    torch.ops.aten.cdist: cdist_flops,
    torch.ops.aten.scaled_dot_product_attention: softmax_attention_flops,
}


def traced_name(op):
    """The node kind under which a ``torch.jit`` trace records a call of ``op``."""
    return getattr(op, 'default', op)._schema.name


def flop_analyzer(model, inputs):
    from mmengine.analysis import FlopAnalyzer
    analyzer = FlopAnalyzer(model, inputs)
    analyzer.set_op_handle(**{traced_name(op): handle for op, handle in FLOP_HANDLES.items()})
    analyzer.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    analyzer.tracer_warnings('none')
    return analyzer


def flop_totals(analyzer):
    """{'full', 'visible', 'kernel', 'solve'} FLOPs of an analyzer from :func:`flop_analyzer`."""
    with torch.no_grad():
        total = analyzer.total()
        by_op = analyzer.by_operator()
    parts = {part: by_op.get(key, 0) for part, key in PART_KEYS.items()}
    return dict(full=total, visible=total - parts[KERNEL] - parts[SOLVE], **parts)


class Classifier(nn.Module):
    """mmpretrain's ImageNet layout: backbone, global average pooling, linear head."""

    def __init__(self, backbone, num_classes=1000):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.embed_dims[-1], num_classes)

    def forward(self, x):
        return self.head(self.backbone(x)[-1].mean((2, 3)))


def classifier_cost(arch, size, backbone_kwargs=None):
    """Params (M) and the :func:`flop_totals` parts (G) of the ImageNet classifier of ``arch``
    (configs/cls/lapformer_*_in1k.py's layout) on one size² image."""
    from lapformer_mm.models import LaplacianFormer
    torch.manual_seed(0)
    model = Classifier(LaplacianFormer(arch, out_indices=(3, ), **(backbone_kwargs or {})))
    totals = flop_totals(flop_analyzer(model.eval(), (torch.randn(1, 3, size, size), )))
    return dict(params=count_parameters(model) / 1e6,
                backbone_params=count_parameters(model.backbone) / 1e6,
                **{part: flops / 1e9 for part, flops in totals.items()})


class TensorForward(nn.Module):
    """A detector's, segmentor's or classifier's tensor forward as a one-input module."""

    def __init__(self, model, data_samples):
        super().__init__()
        self.model = model
        self.data_samples = data_samples

    def forward(self, x):
        if self.data_samples is None:
            return self.model(x, mode='tensor')
        return self.model._forward(x, self.data_samples)


def detector_cost(model, scope, height, width):
    """Params (M) and FLOPs (G: full, visible, the backbone's share) of a built detector,
    segmentor or classifier on one height×width image, from its traced tensor forward."""
    samples = None if scope == 'mmpretrain' else data_samples(scope, height, width)
    wrapped = TensorForward(model, samples)
    analyzer = flop_analyzer(wrapped, (torch.randn(1, 3, height, width), ))
    totals = flop_totals(analyzer)
    with torch.no_grad():
        backbone = analyzer.by_module().get('model.backbone', 0)
    return dict(full=totals['full'] / 1e9, visible=totals['visible'] / 1e9,
                backbone=backbone / 1e9, params=count_parameters(model) / 1e6,
                backbone_params=count_parameters(model.backbone) / 1e6)
