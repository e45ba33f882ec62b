"""Parameters and FLOPs of a detector or segmentor config, custom ops included.

Traces the model's tensor forward (backbone -> neck -> heads, for two-stage
detectors including the RoI heads on the RPN's proposals) with mmengine's
``FlopAnalyzer``. The attention's custom autograd functions (Laplacian/Gaussian
kernel matrix, Newton-Schulz inverse) are counted with the handlers that
``tools/count_params_flops.py`` defines for the backbone (imported, not copied),
so the convention is the same: one FLOP is one multiply-add; ``visible`` omits
the kernel and solve, ``full`` includes them.

Example::

    python tools/get_flops.py configs/maskrcnn_lapformer_t.py --shape 800 1333
"""
import argparse
import os.path as osp
import sys

TOOLS = osp.dirname(osp.abspath(__file__))
sys.path.insert(0, osp.dirname(TOOLS))
sys.path.insert(0, TOOLS)

import torch  # noqa: E402
from mmengine.analysis import FlopAnalyzer  # noqa: E402
from mmengine.config import Config, DictAction  # noqa: E402
from mmengine.registry import init_default_scope  # noqa: E402
from torch import nn  # noqa: E402

import lapformer_mm  # noqa: E402,F401  (registers LaplacianFormer)
from count_params_flops import (KERNEL_HANDLES, SOLVE_HANDLES,  # noqa: E402
                                VISIBLE_HANDLES)


class TensorForward(nn.Module):
    """``model._forward(x, samples)`` as a one-input module for tracing."""

    def __init__(self, model, data_samples):
        super().__init__()
        self.model = model
        self.data_samples = data_samples

    def forward(self, x):
        return self.model._forward(x, self.data_samples)


def build_model(cfg):
    """The config's model (pretrained weights off) and its scope."""
    scope = cfg.get('default_scope', 'mmdet')
    init_default_scope(scope)
    if scope == 'mmseg':
        from mmseg.registry import MODELS
    else:
        from mmdet.registry import MODELS
    cfg.model.backbone.init_cfg = None
    return MODELS.build(cfg.model).eval(), scope


def data_samples(scope, height, width):
    """One data sample carrying the meta information the heads read."""
    meta = dict(img_shape=(height, width), ori_shape=(height, width),
                pad_shape=(height, width), batch_input_shape=(height, width),
                scale_factor=(1.0, 1.0))
    if scope == 'mmseg':
        from mmseg.structures import SegDataSample
        return [SegDataSample(metainfo=meta)]
    from mmdet.structures import DetDataSample
    return [DetDataSample(metainfo=meta)]


def count(model, scope, height, width):
    """FlopAnalyzer totals: dict of G-FLOPs and M-params."""
    wrapped = TensorForward(model, data_samples(scope, height, width))
    x = torch.randn(1, 3, height, width)
    analyzer = FlopAnalyzer(wrapped, (x, ))
    analyzer.set_op_handle(**VISIBLE_HANDLES, **KERNEL_HANDLES, **SOLVE_HANDLES)
    analyzer.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    analyzer.tracer_warnings('none')
    with torch.no_grad():
        total = analyzer.total()
        by_op = analyzer.by_operator()
        by_module = analyzer.by_module()
    custom = sum(by_op.get(name.split('::')[1], 0)
                 for name in list(KERNEL_HANDLES) + list(SOLVE_HANDLES))
    params = sum(p.numel() for p in model.parameters())
    return dict(
        full=total / 1e9,
        visible=(total - custom) / 1e9,
        backbone=by_module.get('model.backbone', 0) / 1e9,
        params=params / 1e6,
        backbone_params=sum(p.numel()
                            for p in model.backbone.parameters()) / 1e6)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='FLOPs and params of a config')
    parser.add_argument('config')
    parser.add_argument(
        '--shape', type=int, nargs=2, metavar=('H', 'W'),
        help='input height and width (default: 800 1333 for detectors, '
        '512 512 for segmentors)')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override config settings, key=value')
    args = parser.parse_args(argv)
    if args.shape and min(args.shape) < 32:
        parser.error(f'--shape must be at least 32 32, got {args.shape}')
    return args


def main(argv=None):
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    model, scope = build_model(cfg)
    height, width = args.shape or ((512, 512) if scope == 'mmseg' else
                                   (800, 1333))
    res = count(model, scope, height, width)
    print(f'config:   {args.config}')
    print(f'input:    1x3x{height}x{width}')
    print(f'params:   {res["params"]:.2f} M (backbone {res["backbone_params"]:.2f} M)')
    print(f'FLOPs:    {res["full"]:.1f} G full, {res["visible"]:.1f} G visible '
          f'(without the kernel matrix and Newton-Schulz), backbone '
          f'{res["backbone"]:.1f} G')
    return res


if __name__ == '__main__':
    main()
