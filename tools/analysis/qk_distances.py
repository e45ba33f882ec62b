"""Query–key distance distributions per stage of LaplacianFormer, PVTv2 and Swin.

Writes histograms, a markdown table and a JSON of tail statistics to ``--out``
(:mod:`lapformer_mm.analysis.qk_distances`). Weights are random unless
``--checkpoint MODEL=PATH`` is given.

Example::

    python tools/analysis/qk_distances.py --models laplacianformer-t pvtv2-b1 swin-t \\
        --num-images 4 --size 224 224 --out docs/analysis
"""
import argparse

import torch

from lapformer_mm.analysis.images import load_images, to_tensor
from lapformer_mm.analysis.model_zoo import BACKBONE_CONFIGS
from lapformer_mm.analysis.qk_distances import (
    DEFAULT_MODELS,
    distance_collectors,
    parse_checkpoints,
    write_report,
)
from lapformer_mm.cli import int_at_least
from lapformer_mm.preflight import argument_problem

#: PVTv2's first spatial reduction is an 8x8 stride-8 conv over the stride-4 map of its
#: 7x7 stride-4 patch embedding (padding 3): that map is (H - 1) // 4 + 1 >= 8 rows.
PVT_MIN_SIZE = 29
#: Swin's stage grids are H/4 ... H/32: all multiples of its 7-token window from 7·32 on.
SWIN_SIZE_STEP = 224


def parse_args(argv=None):
    positive = int_at_least(1)
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=list(DEFAULT_MODELS),
                        choices=sorted(BACKBONE_CONFIGS))
    parser.add_argument('--checkpoint', action='append', metavar='MODEL=PATH',
                        help='weights for MODEL (weights_only load); repeatable')
    parser.add_argument('--images', help='folder of images (default: synthetic textures)')
    parser.add_argument('--num-images', type=int, default=4)
    parser.add_argument('--batch-size', type=int, default=2)
    parser.add_argument('--size', type=positive, nargs=2, default=(224, 224),
                        metavar=('H', 'W'))
    parser.add_argument('--max-queries', type=positive, default=256,
                        help='queries sampled per attention call')
    parser.add_argument('--max-keys', type=positive, default=256,
                        help='keys sampled per attention call')
    parser.add_argument('--max-windows', type=positive, default=64,
                        help='images (or Swin windows) sampled per attention call')
    # The tail statistics need two distances per stage and metric.
    parser.add_argument('--max-samples', type=int_at_least(2), default=200_000,
                        help='distances kept per stage and metric')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', default='docs/analysis')
    args = parser.parse_args(argv)
    if args.num_images < 1 or args.batch_size < 1:
        parser.error('--num-images and --batch-size must be >= 1')
    try:
        checkpoints = parse_checkpoints(args.checkpoint)
    except ValueError as err:
        parser.error(str(err))
    unused = sorted(set(checkpoints) - set(args.models))
    if unused:
        parser.error(f'--checkpoint for {", ".join(unused)}, which --models does not list '
                     f'({", ".join(args.models)})')
    for model, path in checkpoints.items():
        problem = argument_problem(path)
        if problem:
            parser.error(f'--checkpoint {model}={path}: {problem}')
    if args.images is not None:
        problem = argument_problem(args.images, is_dir=True)
        if problem:
            parser.error(f'--images {args.images}: {problem}')
    swin = [m for m in args.models if m.startswith('swin')]
    if swin and any(side % SWIN_SIZE_STEP for side in args.size):
        # A grid that is not a multiple of the window is padded, and the padded tokens'
        # distances would enter the statistics.
        parser.error(f'--size {args.size[0]} {args.size[1]}: H and W must be multiples of '
                     f'{SWIN_SIZE_STEP} for {", ".join(swin)} (every stage grid a multiple of '
                     "its 7x7 window)")
    pvt = [m for m in args.models if m.startswith('pvtv2')]
    if pvt and min(args.size) < PVT_MIN_SIZE:
        parser.error(f'--size {args.size[0]} {args.size[1]}: H and W must be >= '
                     f'{PVT_MIN_SIZE} for {", ".join(pvt)}')
    return args


def main(argv=None):
    args = parse_args(argv)
    checkpoints = parse_checkpoints(args.checkpoint)
    torch.manual_seed(args.seed)
    images = load_images(args.images, args.num_images, tuple(args.size), args.seed)
    batches = to_tensor(images).split(args.batch_size)
    collectors = distance_collectors(
        args.models, batches, checkpoints, args.seed, max_queries=args.max_queries,
        max_keys=args.max_keys, max_batches=args.max_windows, max_samples=args.max_samples)
    weights = {n: checkpoints.get(n, 'random init') for n in args.models}
    description = f'{args.images or "synthetic"} x{len(images)} at {args.size[0]}x{args.size[1]}'
    print(write_report(collectors, weights, description, args.out))


if __name__ == '__main__':
    main()
