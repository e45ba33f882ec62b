"""Draw a detector's predictions (boxes, masks, labels, scores) into PNG files.

Each output PNG shows the ground truth (left, when the config's test set has
annotations) next to the predictions above ``--score-thr`` (right), drawn by
mmdet's ``DetLocalVisualizer``.

Example::

    python tools/visualize_predictions.py configs/toy/maskrcnn_lapformer_t_toy.py \\
        work_dirs/main_job/epoch_12.pth --out-dir work_dirs/main_job/vis --num 6
"""
import argparse
import os
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import mmcv  # noqa: E402
from mmengine.config import Config, DictAction  # noqa: E402
from mmengine.registry import init_default_scope  # noqa: E402

import lapformer_mm  # noqa: E402,F401  (registers LaplacianFormer)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Write PNGs of predicted boxes and masks')
    parser.add_argument('config', help='detector config')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--out-dir', required=True, help='where PNGs go')
    parser.add_argument(
        '--num', type=int, default=6, help='first N test images (default 6)')
    parser.add_argument(
        '--score-thr', type=float, default=0.3,
        help='draw predictions scoring at least this (default 0.3)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override config settings, key=value')
    args = parser.parse_args(argv)
    if args.num < 1:
        parser.error(f'--num must be >= 1, got {args.num}')
    if not 0.0 <= args.score_thr <= 1.0:
        parser.error(f'--score-thr must be in [0, 1], got {args.score_thr}')
    return args


def build_test_dataset(cfg):
    """The config's test dataset with annotations loaded (for the GT panel)."""
    from mmdet.registry import DATASETS
    return DATASETS.build(cfg.test_dataloader.dataset)


def original_scale_gt(data_sample):
    """GT instances of a packed test sample in original-image pixels.

    The test pipeline resizes; boxes are scaled back, masks (kept only when
    the image was not resized) are drawn as they are.
    """
    gt = data_sample.gt_instances
    sx, sy = data_sample.metainfo.get('scale_factor', (1.0, 1.0))
    boxes = gt.bboxes.tensor if hasattr(gt.bboxes, 'tensor') else gt.bboxes
    gt.bboxes = boxes / boxes.new_tensor([sx, sy, sx, sy])
    if 'masks' in gt and (sx, sy) != (1.0, 1.0):
        del gt.masks
    return gt


def visualize(cfg, checkpoint, out_dir, num, score_thr, device='cpu'):
    """Write ``num`` PNGs into ``out_dir``; return their paths."""
    from mmdet.apis import inference_detector, init_detector
    from mmdet.registry import VISUALIZERS

    init_default_scope(cfg.get('default_scope', 'mmdet'))
    model = init_detector(cfg, checkpoint, device=device)
    dataset = build_test_dataset(cfg)
    visualizer = VISUALIZERS.build(
        dict(type='DetLocalVisualizer', name='lapformer_vis'))
    visualizer.dataset_meta = model.dataset_meta
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for idx in range(min(num, len(dataset))):
        info = dataset.get_data_info(idx)
        img_path = info['img_path']
        result = inference_detector(model, img_path)
        result.gt_instances = original_scale_gt(dataset[idx]['data_samples'])
        img = mmcv.imread(img_path, channel_order='rgb')
        out_file = osp.join(out_dir, osp.splitext(osp.basename(img_path))[0] +
                            '_pred.png')
        visualizer.add_datasample(
            osp.basename(img_path), img, data_sample=result, draw_gt=True,
            draw_pred=True, show=False, pred_score_thr=score_thr,
            out_file=out_file)
        paths.append(out_file)
    return paths


def main(argv=None):
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    paths = visualize(cfg, args.checkpoint, args.out_dir, args.num,
                      args.score_thr, args.device)
    print(f'wrote {len(paths)} PNGs to {args.out_dir}')


if __name__ == '__main__':
    main()
