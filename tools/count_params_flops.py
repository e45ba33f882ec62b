"""Parameters and FLOPs of the LaplacianFormer family as ImageNet classifiers.

Usage:
    python tools/count_params_flops.py [--arch tiny small ...] [--size 224]
        [--qk-shared | --no-qk-shared] [--stage4-attention softmax|laplacian]
        [--newton-iters N] [--markdown]
    python tools/count_params_flops.py --arch medium --ns-residual 7 16

``--ns-residual`` instead prints how far Newton–Schulz gets on the landmark
systems P = k(L, L) + eps·I of a freshly initialised model (random 224² input,
batch 2, 7×7-landmark blocks only): median and max of ||I - P X||_inf after
each given number of iterations.

The classifier is the backbone (``out_indices=(3,)``) + global average pooling
+ a 1000-class linear head, as in configs/cls/lapformer_*_in1k.py.

Counting convention (mmengine/fvcore): one FLOP is one multiply-add, counted
by tracing with :class:`mmengine.analysis.FlopAnalyzer`; element-wise ops
(activations, exp outside the kernels, the injective normalisation's
centring and scaling) are not counted. The attention's custom autograd
functions are invisible to the default handlers, so they get these:

- kernel matrix k(x, y), x (..., N, d), y (..., M, d): N·M·(d + 1) per batch
  element; each (pair, channel) is one subtract-abs-accumulate (for the
  Gaussian: one square-accumulate), counted like a multiply-add, plus one
  exp per pair. With ``qk_shared`` the query and key kernels coincide and
  are evaluated (and counted) once.
- Newton–Schulz inverse of P (..., m, m), t iterations of
  X <- X (2I - P X): 2·m³·t + m² (two m×m products per step, the start).
- softmax attention (stage 4 option): N·M·(d + d_v) per head.

Two totals are printed: ``visible`` counts only what mmengine's default
handlers see (linear, conv, matmul, norms, pooling); it is what a tracer
reports when the kernel and the solve are opaque custom ops, as in SOFT's
released model (``visible`` is therefore the number comparable with the
papers' tables). ``full`` adds the kernel and solve handlers above.
"""
import argparse
import math
from typing import Any, Dict, List

import torch
from mmengine.analysis import FlopAnalyzer
from mmengine.analysis.jit_handles import get_shape
from torch import nn

from lapformer_mm.models import ARCH_SETTINGS, LaplacianAttention, LaplacianFormer
from lapformer_mm.ops import newton_schulz_pinv
from lapformer_mm.ops.solvers import DEFAULT_NS_ITERS

NUM_CLASSES = 1000


class Classifier(nn.Module):
    """Backbone -> global average pooling -> linear head (mmpretrain layout)."""

    def __init__(self, backbone: LaplacianFormer, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.embed_dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x)[-1].mean((2, 3)))


def _batch(shape: List[int], core: int) -> int:
    return math.prod(shape[:-core])


def pairwise_kernel_flops(inputs: List[Any], outputs: List[Any]) -> int:
    """x (..., N, d), y (..., M, d) -> batch · N · M · (d + 1)."""
    x, y = get_shape(inputs[0]), get_shape(inputs[1])
    return _batch(x, 2) * x[-2] * y[-2] * (x[-1] + 1)


def newton_schulz_flops(inputs: List[Any], outputs: List[Any]) -> int:
    """P (..., m, m), t iterations -> batch · (2 m³ t + m²)."""
    p = get_shape(inputs[0])
    iters = outputs[0].node().scalar_args()[0]
    m = p[-1]
    return _batch(p, 2) * (2 * m**3 * iters + m * m)


def small_matmul_flops(inputs: List[Any], outputs: List[Any]) -> int:
    """a (..., m, k) @ b (..., k, n) -> batch · m · k · n, as mmengine counts matmul."""
    a, b = get_shape(inputs[0]), get_shape(inputs[1])
    return _batch(a, 2) * a[-2] * a[-1] * b[-1]


def softmax_attention_flops(inputs: List[Any], outputs: List[Any]) -> int:
    """q (..., N, d), k (..., M, d), v (..., M, d_v) -> batch · N · M · (d + d_v)."""
    q, k, v = (get_shape(t) for t in inputs[:3])
    return _batch(q, 2) * q[-2] * k[-2] * (q[-1] + v[-1])


# Reference (CPU) and CuPy (CUDA) autograd functions of lapformer_mm.ops.
KERNEL_HANDLES = {
    'prim::PythonOp.LaplacianKernel': pairwise_kernel_flops,
    'prim::PythonOp.GaussianKernel': pairwise_kernel_flops,
    'prim::PythonOp.PairwiseKernelFunction': pairwise_kernel_flops,
}
SOLVE_HANDLES = {
    'prim::PythonOp.NewtonSchulzInverse': newton_schulz_flops,
    'prim::PythonOp.NewtonSchulzFunction': newton_schulz_flops,
}
# SmallMatmul is the landmark-sized product X · (Ckᵀ v), an autograd function only to pin
# it to one CPU thread: a plain matmul, so it counts as visible.
VISIBLE_HANDLES = {
    'aten::scaled_dot_product_attention': softmax_attention_flops,
    'prim::PythonOp.SmallMatmul': small_matmul_flops,
}


def count_flops(model: nn.Module, size: int) -> FlopAnalyzer:
    """Analyzer of ``model`` on one size x size RGB image, all handles set."""
    analyzer = FlopAnalyzer(model.eval(), (torch.randn(1, 3, size, size), ))
    analyzer.set_op_handle(**VISIBLE_HANDLES, **KERNEL_HANDLES, **SOLVE_HANDLES)
    analyzer.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    analyzer.tracer_warnings('none')
    return analyzer


def measure(arch: str, size: int, backbone_kwargs: Dict) -> Dict[str, float]:
    """Params (M) and FLOPs (G) of the classifier for ``arch``."""
    torch.manual_seed(0)
    model = Classifier(LaplacianFormer(arch, out_indices=(3, ), **backbone_kwargs))
    with torch.no_grad():
        analyzer = count_flops(model, size)
        total = analyzer.total()
        by_op = analyzer.by_operator()
    kernel = sum(by_op.get(name.split('::')[1], 0) for name in KERNEL_HANDLES)
    solve = sum(by_op.get(name.split('::')[1], 0) for name in SOLVE_HANDLES)
    return dict(
        params=sum(p.numel() for p in model.parameters()) / 1e6,
        backbone_params=sum(p.numel() for p in model.backbone.parameters()) / 1e6,
        visible=(total - kernel - solve) / 1e9,
        full=total / 1e9,
        kernel=kernel / 1e9,
        solve=solve / 1e9)


def landmark_systems(arch: str, size: int, backbone_kwargs: Dict) -> torch.Tensor:
    """P = k(L, L) + eps·I of every Laplacian block with a full landmark grid, (K, m, m)."""
    torch.manual_seed(0)
    model = LaplacianFormer(arch, out_indices=(3, ), **backbone_kwargs)
    model.init_weights()
    systems = []

    def record(attn: LaplacianAttention, inputs: tuple, output: torch.Tensor) -> None:
        p = attn.landmark_system(*inputs)
        if p.shape[-1] == attn.landmark_grid**2:
            systems.append(p.flatten(0, 1))

    for module in model.modules():
        if isinstance(module, LaplacianAttention):
            module.register_forward_hook(record)
    with torch.no_grad():
        model.eval()(torch.randn(2, 3, size, size))
    return torch.cat(systems)


def print_ns_residuals(arch: str, size: int, backbone_kwargs: Dict, iters: List[int]) -> None:
    """Median and max of ||I - P X_t||_inf over the landmark systems of ``arch``."""
    p = landmark_systems(arch, size, backbone_kwargs)
    eye = torch.eye(p.shape[-1])
    print(f'{arch}: {p.shape[0]} landmark systems of size {p.shape[-1]}')
    for t in iters:
        residual = (eye - p @ newton_schulz_pinv(p, t)).abs().sum(-1).amax(-1)
        print(f'  {t:3d} iterations: median {residual.median().item():.2e}, '
              f'max {residual.max().item():.2e}')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--arch', nargs='+', default=list(ARCH_SETTINGS))
    parser.add_argument('--size', type=int, default=224)
    parser.add_argument('--qk-shared', action=argparse.BooleanOptionalAction, default=None,
                        help='default: the backbone default')
    parser.add_argument('--stage4-attention', choices=['softmax', 'laplacian'], default=None)
    parser.add_argument('--newton-iters', type=int, default=None,
                        help=f'default: the attention default ({DEFAULT_NS_ITERS})')
    parser.add_argument('--markdown', action='store_true', help='print a markdown table')
    parser.add_argument('--ns-residual', type=int, nargs='+', metavar='ITERS',
                        help='print Newton-Schulz residuals after these iteration counts')
    args = parser.parse_args()
    kwargs = {k: v for k, v in dict(qk_shared=args.qk_shared,
                                    stage4_attention=args.stage4_attention,
                                    newton_iters=args.newton_iters).items() if v is not None}
    if args.ns_residual:
        for arch in args.arch:
            print_ns_residuals(arch, args.size, kwargs, args.ns_residual)
        return
    columns = ['arch', 'params (M)', 'backbone params (M)', 'GFLOPs visible', 'GFLOPs full',
               'kernel GFLOPs', 'solve GFLOPs']
    if args.markdown:
        print('| ' + ' | '.join(columns) + ' |')
        print('|' + '---|' * len(columns))
    else:
        print(f'size {args.size}x{args.size}, options {kwargs or "defaults"}')
        print(' '.join(f'{c:>20}' for c in columns))
    for arch in args.arch:
        r = measure(arch, args.size, kwargs)
        cells = [arch, f"{r['params']:.2f}", f"{r['backbone_params']:.2f}",
                 f"{r['visible']:.2f}", f"{r['full']:.2f}", f"{r['kernel']:.3f}",
                 f"{r['solve']:.3f}"]
        if args.markdown:
            print('| ' + ' | '.join(cells) + ' |')
        else:
            print(' '.join(f'{c:>20}' for c in cells), flush=True)


if __name__ == '__main__':
    main()
