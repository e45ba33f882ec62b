"""Attention rows of one query under the Laplacian kernel, the Gaussian kernel and softmax.

Writes ``attention_maps.png`` (the rows of one LaplacianFormer block's query over the
image) and ``kernel_gradients.png`` (|dk/dr| of both kernels) to ``--out``; see
:mod:`lapformer_mm.analysis.attention_maps`. Weights are random unless ``--checkpoint``
is given.

Example::

    python tools/analysis/attention_maps.py --size 224 224 --stage 1 --block 1 \\
        --query 0.5 0.5 --out docs/analysis
"""
import argparse
import os
import os.path as osp

from lapformer_mm.analysis.attention_maps import (
    attention_rows,
    capture_block,
    plot_attention_rows,
    plot_kernel_gradients,
    query_index,
)
from lapformer_mm.analysis.images import load_images, read_image, to_tensor
from lapformer_mm.analysis.model_zoo import BACKBONE_CONFIGS, build_backbone
from lapformer_mm.cli import int_at_least, positive_float
from lapformer_mm.models.backbone import NUM_STAGES
from lapformer_mm.preflight import argument_problem


def make_parser():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='laplacianformer-t',
                        choices=[n for n in BACKBONE_CONFIGS if n.startswith('laplacianformer')])
    parser.add_argument('--checkpoint', help='backbone weights (weights_only load)')
    parser.add_argument('--image', help='image file (default: a synthetic texture)')
    parser.add_argument('--seed', type=int, default=0, help='synthetic image seed')
    parser.add_argument('--size', type=int_at_least(1), nargs=2, default=(224, 224),
                        metavar=('H', 'W'))
    parser.add_argument('--stage', type=int, default=1, choices=range(1, NUM_STAGES + 1),
                        help='1-based stage')
    parser.add_argument('--block', type=int_at_least(1), default=1,
                        help='1-based block in the stage')
    parser.add_argument('--query', type=float, nargs=2, default=(0.5, 0.5),
                        metavar=('ROW', 'COL'), help='query position, fractions of the grid')
    parser.add_argument('--r-max', type=positive_float, default=12.0,
                        help='largest distance in the gradient plot')
    parser.add_argument('--out', default='docs/analysis')
    return parser


def parse_args(argv=None, parser=None):
    parser = parser or make_parser()
    args = parser.parse_args(argv)
    if not all(0.0 <= p <= 1.0 for p in args.query):
        parser.error(f'--query: ROW and COL must be fractions in [0, 1], got '
                     f'{args.query[0]:g} {args.query[1]:g}')
    for option, path in (('--checkpoint', args.checkpoint), ('--image', args.image)):
        problem = path and argument_problem(path)
        if problem:
            parser.error(f'{option} {path}: {problem}')
    return args


def main(argv=None):
    parser = make_parser()
    args = parse_args(argv, parser)
    size = tuple(args.size)
    image = read_image(args.image, size) if args.image else load_images(None, 1, size, args.seed)[0]
    model = build_backbone(args.model, args.checkpoint)
    try:
        q, k, hw, attn = capture_block(model, to_tensor([image]), args.stage, args.block)
    except ValueError as err:
        # The block count of a stage and the stage's attention type come with the model.
        parser.error(f'--stage {args.stage} --block {args.block}: {err}')
    index = query_index(hw, args.query)
    rows = attention_rows(q, k, hw, index, attn)
    os.makedirs(args.out, exist_ok=True)
    weights = args.checkpoint or 'random init'
    maps_path = osp.join(args.out, 'attention_maps.png')
    plot_attention_rows(image, rows, hw, index, maps_path,
                        f'{args.model} ({weights}), stage {args.stage} block {args.block}, '
                        f'grid {hw[0]}x{hw[1]}, λ = {attn.options.lam:g}, heads averaged')
    grad_path = osp.join(args.out, 'kernel_gradients.png')
    plot_kernel_gradients(attn.options.lam, args.r_max, grad_path)
    print(f'wrote {maps_path} and {grad_path}')


if __name__ == '__main__':
    main()
