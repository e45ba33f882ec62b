"""Write a small, deterministic ImageNet-format classification set of toy shapes.

Class folders as mmpretrain's ``CustomDataset`` reads them (``train/circle/000000.png``, ...),
each image one shape of :mod:`lapformer_mm.scenes`. The same ``--seed`` and sizes give
byte-identical files.
"""
import argparse
import os
import os.path as osp

import cv2
import numpy as np

from lapformer_mm.cli import int_at_least
from lapformer_mm.scenes import (
    BASE_COLOURS,
    CLASSES,
    rasterize,
    shape_polygon,
    textured_background,
)


def render_group(rng, img_size):
    """One (H, W, 3) uint8 image per class, in ``CLASSES`` order, sharing the background,
    placement, size (35-80 % of the side), angle and colour jitter: only the object (in its
    class's colour family) tells the classes apart."""
    background = textured_background(rng, img_size, img_size)
    size = float(rng.uniform(0.35, 0.8) * img_size)
    margin = size * 0.4
    centre = rng.uniform(margin, img_size - margin, 2)
    angle = float(rng.uniform(0, 2 * np.pi))
    jitter = rng.integers(-35, 36, 3)
    images = []
    for name in CLASSES:
        img = background.copy()
        colour = np.clip(np.array(BASE_COLOURS[name]) + jitter, 0, 255)
        mask = rasterize(shape_polygon(name, centre, size, angle), img_size, img_size).astype(bool)
        shade = rng.normal(0, 5, img.shape)
        img[mask] = np.clip(colour + shade, 0, 255).astype(np.uint8)[mask]
        images.append(img)
    return images


def make_split(out_dir, split, per_class, img_size, seed):
    rng = np.random.default_rng(seed)
    for name in CLASSES:
        os.makedirs(osp.join(out_dir, split, name), exist_ok=True)
    for index in range(per_class):
        for name, img in zip(CLASSES, render_group(rng, img_size)):
            cv2.imwrite(osp.join(out_dir, split, name, f'{index:06d}.png'), img)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', default='data/toy_imagenet', help='output folder')
    parser.add_argument('--per-class-train', type=int_at_least(1), default=500)
    parser.add_argument('--per-class-val', type=int_at_least(1), default=100)
    parser.add_argument('--img-size', type=int_at_least(32), default=64, help='square side (px)')
    parser.add_argument('--seed', type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # Different seeds per split so val images are never copies of train ones.
    for split, per_class, offset in (('train', args.per_class_train, 0),
                                     ('val', args.per_class_val, 1)):
        make_split(args.out, split, per_class, args.img_size, [args.seed, offset])
        print(f'{split}: {per_class * len(CLASSES)} images ({per_class} per class: '
              f'{", ".join(CLASSES)}) -> {osp.join(args.out, split)}')


if __name__ == '__main__':
    main()
