"""How much zero padding around an image changes a backbone's features inside the image.

mmdet and mmseg pad every image of a batch to the batch's largest size (then to a multiple
of 32) with zeros after normalisation. Per backbone and stage: the features of an image
alone (padded to a multiple of 32 only, as at batch 1) against the same image inside a
larger zero-padded canvas (as beside a larger image in a batch), compared over the maps'
positions that lie inside the image, 2 positions away from its padded edges:
||a - b|| / ||a||. Random weights (seed 0; each backbone's own init), eval mode, fp32, one
thread.

LaplacianFormer-T pools its landmarks and takes its whitening statistics and key sums over
every token, padded ones included; PVTv2-b1 (mmdet's, its spatial-reduction attention
sees the padded keys) and Swin-T (mmdet's, padded tokens inside its windows) for scale.

    python benchmarks/padding.py --image 192x160 --canvas 256x256 256x512
"""
import argparse
import datetime
import sys
from pathlib import Path

if __package__ in (None, ''):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from devtools.timing import parse_size

#: The backbones' last stage stride: an image of a multiple of it gives every stage a map of
#: exactly H/stride x W/stride, as mmdet's padding to a multiple of 32 does.
STRIDE = 32
#: Rows and columns left out at a map's bottom and right (:func:`change`): the positions
#: compared are this far from the image's padded edges.
EDGE = 2
#: The least image side: the last stage's H/32 x W/32 map keeps a cell after the crop.
MIN_SIDE = STRIDE * (EDGE + 1)


def backbones():
    from mmdet.models.backbones import PyramidVisionTransformerV2, SwinTransformer

    from lapformer_mm.models import LaplacianFormer
    torch.manual_seed(0)
    models = {'LaplacianFormer-T': LaplacianFormer('tiny'),
              'PVTv2-b1 (mmdet)': PyramidVisionTransformerV2(embed_dims=64,
                                                             num_layers=[2, 2, 2, 2]),
              'Swin-T (mmdet)': SwinTransformer()}
    for model in models.values():
        model.init_weights()
        model.eval()
    return models


def change(model, image, canvas):
    """Per stage, the relative change of the features inside the image when it sits in the
    top-left corner of a zero canvas of size ``canvas``."""
    padded = image.new_zeros(1, 3, *canvas)
    padded[..., :image.shape[2], :image.shape[3]] = image
    with torch.no_grad():
        alone, inside = model(image), model(padded)
    result = []
    for a, b in zip(alone, inside):
        h, w = a.shape[2] - EDGE, a.shape[3] - EDGE
        a, b = a[..., :h, :w], b[..., :h, :w]
        result.append(((a - b).norm() / a.norm()).item())
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--image', type=parse_size, default=(192, 160),
                        help=f'image size HxW, multiples of {STRIDE}, at least {MIN_SIDE} '
                             '(default 192x160)')
    parser.add_argument('--canvas', type=parse_size, nargs='+', default=[(256, 256)],
                        help='padded batch sizes HxW, each at least the image '
                             '(default 256x256)')
    args = parser.parse_args(argv)
    height, width = args.image
    if height % STRIDE or width % STRIDE or min(height, width) < MIN_SIDE:
        parser.error(f'--image {height}x{width}: H and W must be multiples of {STRIDE} and at '
                     f'least {MIN_SIDE}, so that the last stage\'s map keeps a cell after the '
                     f'{EDGE} edge rows and columns are left out')
    for canvas in args.canvas:
        if canvas[0] < height or canvas[1] < width:
            parser.error(f'--canvas {canvas[0]}x{canvas[1]}: smaller than --image '
                         f'{height}x{width}')
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    image = torch.randn(1, 3, *args.image, generator=gen)
    print(f'# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch '
          f'{torch.__version__}, image {args.image[0]}x{args.image[1]} (random normal)')
    print('| backbone | padded to | stage 1 | stage 2 | stage 3 | stage 4 |')
    print('|---|---|---|---|---|---|')
    for name, model in backbones().items():
        for canvas in args.canvas:
            cells = ' | '.join(f'{v:.3f}' for v in change(model, image, canvas))
            print(f'| {name} | {canvas[0]}x{canvas[1]} | {cells} |')


if __name__ == '__main__':
    main()
