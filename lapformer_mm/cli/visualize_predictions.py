"""Draw a detector's predictions next to its ground truth (mmdet's
``DetLocalVisualizer``), or a segmentor's image, ground-truth and predicted label maps side by
side, into PNG files; the config, the checkpoint and the test data are checked first.
"""
import argparse
import os
import os.path as osp

import mmcv
import numpy as np
from mmengine.config import DictAction
from mmengine.registry import init_default_scope

import lapformer_mm  # noqa: F401  (registers LaplacianFormer)
from lapformer_mm.cli import int_at_least
from lapformer_mm.cli.train import checked_cfg, load_cfg


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Write PNGs of predicted boxes and masks')
    parser.add_argument('config', help='detector or segmentor config')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--out-dir', required=True, help='where PNGs go')
    parser.add_argument('--num', type=int_at_least(1), default=6,
                        help='first N test images (default 6)')
    parser.add_argument('--score-thr', type=float, default=0.3,
                        help='detection: draw predictions scoring at least this (default 0.3)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value')
    parser.set_defaults(launcher='none', work_dir=None)  # what load_cfg reads
    args = parser.parse_args(argv)
    if not 0.0 <= args.score_thr <= 1.0:
        parser.error(f'--score-thr must be in [0, 1], got {args.score_thr}')
    if osp.exists(args.out_dir) and not osp.isdir(args.out_dir):
        parser.error(f'--out-dir must be a folder, got the file {args.out_dir!r}')
    return args


def build_cfg(args):
    cfg = load_cfg(args)
    # Checked with the other inputs (checked_cfg): mmdet's and mmseg's init functions read
    # the checkpoint only after building the model, and name a missing one in a traceback.
    cfg.load_from = args.checkpoint
    return cfg


def original_scale_gt(data_sample):
    """GT instances of a packed test sample in original-image pixels: the boxes scaled back,
    the masks kept only where the test pipeline did not resize."""
    gt = data_sample.gt_instances
    sx, sy = data_sample.metainfo.get('scale_factor', (1.0, 1.0))
    boxes = gt.bboxes.tensor if hasattr(gt.bboxes, 'tensor') else gt.bboxes
    gt.bboxes = boxes / boxes.new_tensor([sx, sy, sx, sy])
    if 'masks' in gt and (sx, sy) != (1.0, 1.0):
        del gt.masks
    return gt


def visualize_detection(cfg, checkpoint, out_dir, num, score_thr, device='cpu'):
    from mmdet.apis import inference_detector, init_detector
    from mmdet.registry import DATASETS, VISUALIZERS

    init_default_scope(cfg.get('default_scope', 'mmdet'))
    model = init_detector(cfg, checkpoint, device=device)
    dataset = DATASETS.build(cfg.test_dataloader.dataset)
    visualizer = VISUALIZERS.build(dict(type='DetLocalVisualizer', name='lapformer_vis'))
    visualizer.dataset_meta = model.dataset_meta
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for idx in range(min(num, len(dataset))):
        info = dataset.get_data_info(idx)
        img_path = info['img_path']
        result = inference_detector(model, img_path)
        result.gt_instances = original_scale_gt(dataset[idx]['data_samples'])
        img = mmcv.imread(img_path, channel_order='rgb')
        out_file = osp.join(out_dir, osp.splitext(osp.basename(img_path))[0] + '_pred.png')
        visualizer.add_datasample(osp.basename(img_path), img, data_sample=result,
                                  draw_gt=True, draw_pred=True, show=False,
                                  pred_score_thr=score_thr, out_file=out_file)
        paths.append(out_file)
    return paths


def paint_labels(img, label_map, palette, alpha=0.6):
    """``img`` (H, W, 3) with each pixel of a class label > 0 blended with its palette colour;
    background (0) and the ignore index (255) stay unpainted."""
    palette = np.asarray(palette, np.float32)
    painted = img.astype(np.float32)
    shown = (label_map > 0) & (label_map < len(palette))
    colours = palette[label_map[shown]]
    painted[shown] = (1 - alpha) * painted[shown] + alpha * colours
    return painted.round().astype(np.uint8)


def visualize_segmentation(cfg, checkpoint, out_dir, num, device='cpu'):
    from mmseg.apis import inference_model, init_model
    from mmseg.registry import DATASETS

    init_default_scope('mmseg')
    model = init_model(cfg, checkpoint, device=device)
    dataset = DATASETS.build(cfg.test_dataloader.dataset)
    palette = dataset.metainfo['palette']
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for idx in range(min(num, len(dataset))):
        info = dataset.get_data_info(idx)
        img = mmcv.imread(info['img_path'], channel_order='rgb')
        gt = mmcv.imread(info['seg_map_path'], flag='unchanged')
        pred = inference_model(model, info['img_path']).pred_sem_seg.data[0]
        panels = [img, paint_labels(img, gt, palette),
                  paint_labels(img, pred.cpu().numpy(), palette)]
        out_file = osp.join(out_dir, osp.splitext(osp.basename(info['img_path']))[0]
                            + '_pred.png')
        mmcv.imwrite(mmcv.rgb2bgr(np.concatenate(panels, axis=1)), out_file)
        paths.append(out_file)
    return paths


def main(argv=None):
    args = parse_args(argv)
    cfg = checked_cfg(build_cfg, args, 'test')
    if cfg.get('default_scope') == 'mmseg':
        paths = visualize_segmentation(cfg, args.checkpoint, args.out_dir, args.num,
                                       args.device)
    else:
        paths = visualize_detection(cfg, args.checkpoint, args.out_dir, args.num,
                                    args.score_thr, args.device)
    print(f'wrote {len(paths)} PNGs to {args.out_dir}')


if __name__ == '__main__':
    main()
