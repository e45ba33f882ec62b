"""COCO evaluation of results files with pycocotools: its table per type and, with
``--out-json``, the six headline numbers per type as fractions (``segm`` by mask areas).
"""
import argparse
import contextlib
import io
import json
import sys

from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

IOU_TYPES = ('bbox', 'segm')
STAT_NAMES = ('AP', 'AP50', 'AP75', 'APs', 'APm', 'APl')
REQUIRED_KEY = {'bbox': 'bbox', 'segm': 'segmentation'}


class EvalInputError(ValueError):
    pass


def read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise EvalInputError(f'{what} file {path!r}: {err}') from err


def check_results(results, path, gt, iou_type):
    """Raise EvalInputError unless ``results`` can be scored against ``gt``: pycocotools
    turns an empty list, a missing field, or ids the annotation file lacks (results made for
    another one) into an obscure assertion, or a score of 0."""
    if not isinstance(results, list) or not results:
        raise EvalInputError(f'results file {path!r} must hold a non-empty JSON list of '
                             'detections')
    for key in ('image_id', 'category_id', 'score', REQUIRED_KEY[iou_type]):
        missing = [i for i, r in enumerate(results) if not isinstance(r, dict) or key not in r]
        if missing:
            raise EvalInputError(f'results file {path!r}: detection #{missing[0]} (and '
                                 f'{len(missing) - 1} more) has no {key!r} field, needed for '
                                 f'--types {iou_type}')
    for key, known in (('image_id', gt.getImgIds()), ('category_id', gt.getCatIds())):
        unknown = {r[key] for r in results} - set(known)
        if unknown:
            raise EvalInputError(f'results file {path!r}: {key} {sorted(unknown)[:5]} not in '
                                 'the annotation file (results made for another one?)')


def segm_results(results, gt):
    """Results ready for segm evaluation: RLE masks (loadRes needs them) and no 'bbox' key
    (with one, loadRes takes an instance's area from its box; mmdet's CocoMetric uses the
    mask's)."""
    out = []
    for r in results:
        r = {k: v for k, v in r.items() if k != 'bbox'}
        if not isinstance(r['segmentation'], dict):
            img = gt.imgs[r['image_id']]
            rle = mask_utils.merge(mask_utils.frPyObjects(r['segmentation'], img['height'],
                                                          img['width']))
            r['segmentation'] = dict(rle, counts=rle['counts'].decode())
        out.append(r)
    return out


def evaluate(ann_file, results_files, iou_types=IOU_TYPES, verbose=True):
    """{iou_type: {stat name: fraction}} of the detections in ``results_files`` (one for all
    ``iou_types``, or one per type) against ``ann_file``; ``verbose`` prints pycocotools'
    table."""
    if len(results_files) not in (1, len(iou_types)):
        raise EvalInputError(f'give one results file or one per type ({len(iou_types)}), '
                             f'got {len(results_files)}')
    read_json(ann_file, 'annotation')  # a clear error before COCO() asserts
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(ann_file)
    metrics = {}
    for i, iou_type in enumerate(iou_types):
        path = results_files[i if len(results_files) > 1 else 0]
        results = read_json(path, 'results')
        check_results(results, path, gt, iou_type)
        if iou_type == 'segm':
            results = segm_results(results, gt)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            coco_eval = COCOeval(gt, gt.loadRes(results), iou_type)
            coco_eval.evaluate()
            coco_eval.accumulate()
            coco_eval.summarize()
        if verbose:
            print(f'Evaluating {iou_type} ({path}):')
            print('\n'.join(line for line in out.getvalue().splitlines()
                            if line.lstrip().startswith('Average')))
        metrics[iou_type] = {name: float(v) for name, v in zip(STAT_NAMES, coco_eval.stats)}
    return metrics


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='COCO bbox/segm evaluation of a results file (pycocotools)')
    parser.add_argument('ann_json', help='COCO annotation file')
    parser.add_argument('results_json', nargs='+',
                        help='results file(s): one for all types, or one per --types entry')
    parser.add_argument('--types', nargs='+', default=['bbox'], choices=IOU_TYPES,
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
