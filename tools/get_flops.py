"""Parameters and FLOPs of a detector, segmentor or classifier config, custom ops included.

Traces the model's tensor forward (backbone -> neck -> heads, for two-stage
detectors including the RoI heads on the RPN's proposals) with mmengine's
``FlopAnalyzer`` and the handles of :mod:`lapformer_mm.analysis.flops` for the
attention's kernel matrix and Newton–Schulz inverse: one FLOP is one multiply-add;
``visible`` omits the kernel and solve, ``full`` includes them.

Example::

    python tools/get_flops.py configs/maskrcnn_lapformer_t.py --shape 800 1333
"""
import argparse
import sys

from mmengine.config import DictAction

from lapformer_mm.analysis.flops import detector_cost
from lapformer_mm.analysis.model_zoo import build_from_config
from lapformer_mm.preflight import argument_problem


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='FLOPs and params of a config')
    parser.add_argument('config')
    parser.add_argument(
        '--shape', type=int, nargs=2, metavar=('H', 'W'),
        help='input height and width (default: 800 1333 for detectors, '
        '512 512 for segmentors, 224 224 for classifiers)')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override config settings, key=value')
    args = parser.parse_args(argv)
    if args.shape and min(args.shape) < 32:
        parser.error(f'--shape must be at least 32 32, got {args.shape}')
    return args


def fail(message):
    """End the run on a user error: the message alone on stderr, exit status 2."""
    print(f'get_flops: {message}', file=sys.stderr)
    raise SystemExit(2)


def main(argv=None):
    args = parse_args(argv)
    problem = argument_problem(args.config)
    if problem:
        fail(f'config {args.config!r} {problem}')
    try:
        model, scope = build_from_config(args.config, args.cfg_options)
    except OSError as err:  # mmengine's refusal of a file type it does not read as a config
        fail(f'config {args.config!r}: {err}')
    height, width = args.shape or {'mmseg': (512, 512),
                                   'mmpretrain': (224, 224)}.get(scope, (800, 1333))
    res = detector_cost(model, scope, height, width)
    print(f'config:   {args.config}')
    print(f'input:    1x3x{height}x{width}')
    print(f'params:   {res["params"]:.2f} M (backbone {res["backbone_params"]:.2f} M)')
    print(f'FLOPs:    {res["full"]:.1f} G full, {res["visible"]:.1f} G visible '
          f'(without the kernel matrix and Newton-Schulz), backbone '
          f'{res["backbone"]:.1f} G')
    return res


if __name__ == '__main__':
    main()
