"""COCO evaluation of results files with pycocotools: its table per type and, with
``--out-json``, the six headline numbers per type as fractions (``segm`` by mask areas).
"""
import argparse
import contextlib
import io
import json
import os.path as osp
import sys

from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

IOU_TYPES = ('bbox', 'segm')
STAT_NAMES = ('AP', 'AP50', 'AP75', 'APs', 'APm', 'APl')
REQUIRED_KEY = {'bbox': 'bbox', 'segm': 'segmentation'}


class EvalInputError(ValueError):
    """The annotation or results file cannot be evaluated; the message says why."""


def read_json(path, what):
    """Parsed JSON of ``path``; ``what`` names the file in error messages."""
    if not osp.isfile(path):
        raise EvalInputError(f'{what} file {path!r} does not exist')
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise EvalInputError(f'{what} file {path!r} is not valid JSON: {err}') from err


def check_results(results, path, gt, iou_type):
    """Raise EvalInputError unless ``results`` can be scored against ``gt``.

    Catches the usual mistakes before pycocotools turns them into an obscure
    assertion: an empty list, detections without the type's field, and
    detections for images or categories that the annotation file lacks
    (results made for another annotation file).
    """
    if not isinstance(results, list):
        raise EvalInputError(
            f'results file {path!r} must hold a JSON list of detections, '
            f'got {type(results).__name__}')
    if not results:
        raise EvalInputError(
            f'results file {path!r} is empty (no detections); nothing to evaluate')
    for key in ('image_id', 'category_id', 'score', REQUIRED_KEY[iou_type]):
        missing = [i for i, r in enumerate(results)
                   if not isinstance(r, dict) or key not in r]
        if missing:
            raise EvalInputError(
                f'results file {path!r}: detection #{missing[0]} (and '
                f'{len(missing) - 1} more) has no {key!r} field, needed for '
                f'--types {iou_type}')
    unknown_imgs = {r['image_id'] for r in results} - set(gt.getImgIds())
    if unknown_imgs:
        raise EvalInputError(
            f'results file {path!r} has detections for {len(unknown_imgs)} '
            f'image id(s) not in the annotation file (e.g. '
            f'{sorted(unknown_imgs)[:5]}); were the results made for another '
            'annotation file?')
    unknown_cats = {r['category_id'] for r in results} - set(gt.getCatIds())
    if unknown_cats:
        raise EvalInputError(
            f'results file {path!r} has category id(s) {sorted(unknown_cats)} '
            'that the annotation file does not define; were the results made '
            'for another annotation file?')


def polygon_to_rle(segmentation, height, width):
    """A results entry's segmentation as RLE (pycocotools' loadRes needs RLE)."""
    if isinstance(segmentation, dict):
        return segmentation
    rle = mask_utils.merge(mask_utils.frPyObjects(segmentation, height, width))
    rle['counts'] = rle['counts'].decode()
    return rle


def segm_results(results, gt):
    """Results ready for segm evaluation: RLE masks and no 'bbox' key.

    loadRes takes an instance's area from its box whenever 'bbox' is present;
    dropping it makes segm use mask areas, as mmdet's CocoMetric does.
    """
    out = []
    for r in results:
        img = gt.imgs[r['image_id']]
        r = {k: v for k, v in r.items() if k != 'bbox'}
        r['segmentation'] = polygon_to_rle(r['segmentation'], img['height'],
                                           img['width'])
        out.append(r)
    return out


def evaluate(ann_file, results_files, iou_types=IOU_TYPES, verbose=True):
    """{iou_type: {stat name: fraction}} of the detections in ``results_files`` (one for all
    ``iou_types``, a subset of ('bbox', 'segm'), or one per type) against ``ann_file``;
    ``verbose`` prints pycocotools' table."""
    if len(results_files) not in (1, len(iou_types)):
        raise EvalInputError(
            f'give one results file or one per type ({len(iou_types)}), '
            f'got {len(results_files)}')
    read_json(ann_file, 'annotation')  # clear error before COCO() asserts
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(ann_file)
    metrics = {}
    for i, iou_type in enumerate(iou_types):
        path = results_files[i if len(results_files) > 1 else 0]
        results = read_json(path, 'results')
        check_results(results, path, gt, iou_type)
        if iou_type == 'segm':
            results = segm_results(results, gt)
        with contextlib.redirect_stdout(io.StringIO()):
            dt = gt.loadRes(results)
        coco_eval = COCOeval(gt, dt, iou_type)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            coco_eval.evaluate()
            coco_eval.accumulate()
            coco_eval.summarize()
        if verbose:
            print(f'Evaluating {iou_type} ({path}):')
            print('\n'.join(line for line in out.getvalue().splitlines()
                            if line.lstrip().startswith('Average')))
        metrics[iou_type] = {
            name: float(v) for name, v in zip(STAT_NAMES, coco_eval.stats[:6])
        }
    return metrics


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='COCO bbox/segm evaluation of a results file (pycocotools)')
    parser.add_argument('ann_json', help='COCO annotation file')
    parser.add_argument(
        'results_json', nargs='+',
        help='results file(s): one for all types, or one per --types entry')
    parser.add_argument(
        '--types', nargs='+', default=['bbox'], choices=IOU_TYPES,
        help='what to evaluate (default: bbox)')
    parser.add_argument('--out-json', help='write the headline numbers here')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        metrics = evaluate(args.ann_json, args.results_json, args.types)
    except EvalInputError as err:
        print(f'coco_eval.py: error: {err}', file=sys.stderr)
        return 2
    if args.out_json:
        with open(args.out_json, 'w') as f:
            json.dump(metrics, f, indent=2)
        print(f'wrote {args.out_json}')
    return 0
