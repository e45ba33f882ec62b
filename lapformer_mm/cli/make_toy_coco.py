"""Write a small, deterministic COCO-format instance-segmentation set of toy scenes
(:mod:`lapformer_mm.scenes`; polygons of each object's visible part) and, with ``--seg-out``,
the same scenes as an mmseg set (label 0 background, 1-4 ``CLASSES``), in the 'toy' layout or
the 'official' one the full-size configs read (:data:`LAYOUTS`). The same ``--seed`` and
sizes give byte-identical files.
"""
import argparse
import json
import os
import os.path as osp
from typing import Callable, NamedTuple

import cv2
import numpy as np
from pycocotools import mask as mask_utils

from lapformer_mm.cli import int_at_least
from lapformer_mm.scenes import CLASSES, render_image


def coco_class_names():
    """COCO's 80 class names in mmdet's order (mmdet is needed for the official layout)."""
    from mmdet.datasets import CocoDataset
    return CocoDataset.METAINFO['classes']


class Layout(NamedTuple):
    """Folder and file names of one layout; ``{}`` in a folder takes the split's name (the
    images under --out/<split>, the annotations in --out/annotations/instances_<split>.json)."""
    det_split: dict       # 'train'/'val' -> the split's name under --out
    seg_split: dict       # 'train'/'val' -> the split's name under --seg-out
    seg_images: str
    seg_labels: str
    image_name: Callable  # image id (from 1) -> image file name
    category_names: Callable  # () -> the names of categories 1, 2, ...; CLASSES come first
    supercategory: str


LAYOUTS = {
    'toy': Layout(
        det_split=dict(train='train', val='val'), seg_split=dict(train='train', val='val'),
        seg_images='img_dir/{}', seg_labels='ann_dir/{}',
        image_name=lambda image_id: f'{image_id - 1:06d}.png',
        category_names=lambda: CLASSES, supercategory='shape'),
    # What configs/*.py read from data/coco and data/ade/ADEChallengeData2016 (mmdet's
    # coco_instance.py, mmseg's ade20k.py). mmdet's CocoDataset and CocoMetric find the
    # categories by COCO's 80 class names, so the file lists all 80 (ids 1-80 in mmdet's
    # order) and the shapes are COCO's first four (person, bicycle, car, motorcycle);
    # ADE20KDataset reads .jpg images and, with reduce_zero_label, ignores label 0 and
    # trains labels 1-4 as ADE classes 0-3.
    'official': Layout(
        det_split=dict(train='train2017', val='val2017'),
        seg_split=dict(train='training', val='validation'), seg_images='images/{}',
        seg_labels='annotations/{}', image_name=lambda image_id: f'{image_id:012d}.jpg',
        category_names=coco_class_names, supercategory='coco'),
}


def coco_annotation(ann_id, image_id, category_id, polys, width, height):
    rle = mask_utils.merge(mask_utils.frPyObjects(polys, height, width))
    return dict(id=ann_id, image_id=image_id, category_id=category_id, segmentation=polys,
                area=float(mask_utils.area(rle)),
                bbox=[float(v) for v in mask_utils.toBbox(rle)], iscrowd=0)


def make_split(out_dir, split, num_images, size, max_objects, seed, seg_dir=None,
               layout='toy'):
    """Write one split's images (``size``: (width, height)) and annotation file, with
    ``seg_dir`` the images and label maps there too; (the json path, the objects)."""
    names = LAYOUTS[layout]
    width, height = size
    rng = np.random.default_rng(seed)
    img_dir = osp.join(out_dir, names.det_split[split])
    os.makedirs(img_dir, exist_ok=True)
    if seg_dir is not None:
        seg_split = names.seg_split[split]
        seg_img_dir = osp.join(seg_dir, names.seg_images.format(seg_split))
        seg_ann_dir = osp.join(seg_dir, names.seg_labels.format(seg_split))
        for folder in (seg_img_dir, seg_ann_dir):
            os.makedirs(folder, exist_ok=True)
    images, annotations = [], []
    for image_id in range(1, num_images + 1):
        img, anns, label_map = render_image(rng, width, height, max_objects)
        file_name = names.image_name(image_id)
        cv2.imwrite(osp.join(img_dir, file_name), img)
        if seg_dir is not None:
            cv2.imwrite(osp.join(seg_img_dir, file_name), img)
            cv2.imwrite(osp.join(seg_ann_dir, osp.splitext(file_name)[0] + '.png'), label_map)
        images.append(dict(id=image_id, file_name=file_name, width=width, height=height))
        for label, polys in anns:
            annotations.append(coco_annotation(len(annotations) + 1, image_id, label + 1,
                                               polys, width, height))
    coco = dict(info=dict(description='lapformer_mm toy shapes', version='1.0'), licenses=[],
                images=images, annotations=annotations,
                categories=[dict(id=i + 1, name=n, supercategory=names.supercategory)
                            for i, n in enumerate(names.category_names())])
    ann_file = osp.join(out_dir, 'annotations', f'instances_{names.det_split[split]}.json')
    os.makedirs(osp.dirname(ann_file), exist_ok=True)
    with open(ann_file, 'w') as f:
        json.dump(coco, f)
    return ann_file, len(annotations)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', default='data/toy_coco', help='output folder')
    parser.add_argument('--num-train', type=int_at_least(1), default=320)
    parser.add_argument('--num-val', type=int_at_least(1), default=80)
    parser.add_argument('--img-size', type=int_at_least(32), nargs='+', default=[128],
                        metavar='PX', help='image size: one side (square) or WIDTH HEIGHT')
    parser.add_argument('--max-objects', type=int_at_least(2), default=4,
                        help='most objects painted per image (at least 2 are painted)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--seg-out', help='also write the scenes as an mmseg semantic '
                        'segmentation set into this folder')
    parser.add_argument('--layout', choices=sorted(LAYOUTS), default='toy',
                        help="folder and file names: 'toy' (the toy configs') or 'official' "
                        "(COCO 2017's under --out, ADEChallengeData2016's under --seg-out)")
    args = parser.parse_args(argv)
    if len(args.img_size) > 2:
        parser.error(f'--img-size takes one side or WIDTH HEIGHT, got {args.img_size}')
    args.img_size = tuple(args.img_size) * (3 - len(args.img_size))
    return args


def main(argv=None):
    args = parse_args(argv)
    # Different seeds per split so val images are never copies of train ones.
    for split, num, offset in (('train', args.num_train, 0), ('val', args.num_val, 1)):
        ann_file, n_ann = make_split(args.out, split, num, args.img_size, args.max_objects,
                                     [args.seed, offset], args.seg_out, args.layout)
        print(f'{split}: {num} images, {n_ann} objects -> {ann_file}')
    if args.seg_out is not None:
        print(f'label maps (0 = background, 1-{len(CLASSES)} = '
              f'{", ".join(CLASSES)}) -> {args.seg_out}')


if __name__ == '__main__':
    main()
