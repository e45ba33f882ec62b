"""Test a checkpoint from an mmdet or mmseg config (mmdet's ``tools/test.py`` interface), the
checkpoint and the test data checked before anything is built (one message, exit status 2).
"""
import argparse
import copy
import json
import numbers
import os.path as osp

from mmengine.config import ConfigDict
from mmengine.dist import is_main_process

from lapformer_mm.cli.train import (
    build_runner,
    checked_cfg,
    close_distributed,
    load_cfg,
    parse_run_args,
    setup_cpu_distributed,
)
from lapformer_mm.models.validation import ConfigError


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Test (and evaluate) a model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--work-dir', help='the dir to save the evaluation metrics in')
    parser.add_argument('--out', help='detection: dump predictions to this .pkl file; '
                        'segmentation: write predicted label maps into this folder')
    parser.add_argument('--metrics-json', help='also write the metrics (a flat dict) here')
    parser.add_argument('--show', action='store_true', help='show predictions')
    parser.add_argument('--show-dir', help='save painted predictions (mmdet: under '
                        'work_dir/<timestamp>/SHOW_DIR; mmseg: SHOW_DIR/vis_data)')
    parser.add_argument('--wait-time', type=float, default=2, help='the interval of show (s)')
    parser.add_argument('--tta', action='store_true', help="test-time augmentation: the "
                        "config's tta_model and tta_pipeline (a box detector without them: "
                        "mmdet's horizontal flip and NMS)")
    args = parse_run_args(parser, argv)
    if args.out is not None and not osp.isdir(args.out) and \
            osp.splitext(args.out)[1] not in ('', '.pkl', '.pickle'):
        parser.error(f'--out must be a .pkl/.pickle file or a folder, got {args.out!r}')
    return args


def enable_visualization(cfg, args):
    hook = cfg.get('default_hooks', {}).get('visualization')
    if hook is None:
        raise ConfigError('--show/--show-dir need a `visualization` entry in default_hooks')
    hook['draw'] = True
    if args.show:
        hook['show'] = True
        hook['wait_time'] = args.wait_time
    if args.show_dir:
        if cfg.get('default_scope') == 'mmseg':
            cfg.visualizer['save_dir'] = args.show_dir
        else:
            hook['test_out_dir'] = args.show_dir


#: mmdet's tools/test.py defaults for --tta when a detector config defines none.
DET_TTA_MODEL = dict(type='DetTTAModel',
                     tta_cfg=dict(nms=dict(type='nms', iou_threshold=0.5), max_per_img=100))
DET_TTA_PACK = dict(type='PackDetInputs', meta_keys=(
    'img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor', 'flip', 'flip_direction'))


def apply_tta(cfg):
    """mmdet's and mmseg's ``--tta``: ``tta_model`` wraps the model, ``tta_pipeline`` replaces
    the test pipeline; a box detector without them gets mmdet's defaults (mmdet's DetTTAModel
    merges no masks)."""
    dataset = cfg.test_dataloader.dataset
    while 'dataset' in dataset:
        dataset = dataset['dataset']
    if cfg.get('default_scope') == 'mmseg':
        missing = [key for key in ('tta_model', 'tta_pipeline') if key not in cfg]
        if missing:
            raise ConfigError(f'--tta needs {" and ".join(missing)} in the config')
    else:
        if cfg.model.get('roi_head', {}).get('mask_head') is not None and (
                'tta_model' not in cfg):
            raise ConfigError("--tta: mmdet's DetTTAModel merges boxes, not masks, and this "
                              'config defines no tta_model of its own')
        if 'tta_model' not in cfg:
            cfg.tta_model = DET_TTA_MODEL
        if 'tta_pipeline' not in cfg:
            pipeline = copy.deepcopy(dataset.pipeline)
            pipeline[-1] = dict(type='TestTimeAug', transforms=[
                [dict(type='RandomFlip', prob=1.), dict(type='RandomFlip', prob=0.)],
                [DET_TTA_PACK]])
            cfg.tta_pipeline = pipeline
    cfg.model = ConfigDict(**cfg.tta_model, module=cfg.model)
    dataset.pipeline = cfg.tta_pipeline


def build_cfg(args):
    cfg = load_cfg(args)
    cfg.load_from = args.checkpoint  # checked with the other inputs (checked_cfg)
    cfg.resume = False
    if args.tta:
        apply_tta(cfg)
    if args.show or args.show_dir:
        enable_visualization(cfg, args)
    if args.out is not None and cfg.get('default_scope') == 'mmseg':
        if osp.splitext(args.out)[1] in ('.pkl', '.pickle'):
            raise ConfigError(f'--out of a segmentor names a folder, got {args.out!r}')
        cfg.test_evaluator['output_dir'] = args.out
        cfg.test_evaluator['keep_results'] = True
    return cfg


COCO_KEYS = (('AP', 'mAP'), ('AP50', 'mAP_50'), ('AP75', 'mAP_75'),
             ('APs', 'mAP_s'), ('APm', 'mAP_m'), ('APl', 'mAP_l'))


def coco_table(metrics):
    rows = []
    for iou_type, label in (('bbox', 'bbox (APb)'), ('segm', 'segm (APm)')):
        keys = [f'coco/{iou_type}_{k}' for _, k in COCO_KEYS]
        if all(k in metrics for k in keys):
            rows.append(f'| {label} | ' +
                        ' | '.join(f'{metrics[k]:.3f}' for k in keys) + ' |')
    if not rows:
        return ''
    header = '| | ' + ' | '.join(n for n, _ in COCO_KEYS) + ' |'
    return '\n'.join([header, '|---' * (len(COCO_KEYS) + 1) + '|'] + rows)


def main(argv=None):
    args = parse_args(argv)
    cfg = checked_cfg(build_cfg, args, 'test')
    setup_cpu_distributed(cfg)
    runner = build_runner(cfg)
    if args.out is not None and cfg.get('default_scope') != 'mmseg':
        from mmdet.evaluation import DumpDetResults
        runner.test_evaluator.metrics.append(DumpDetResults(out_file_path=args.out))
    metrics = runner.test()
    del runner  # its DDP model holds the process group (close_distributed)
    if is_main_process():
        table = coco_table(metrics)
        if table:
            print(table, flush=True)
        if args.metrics_json:
            # numbers.Real: mmseg's IoUMetric returns numpy float32, which json cannot write.
            with open(args.metrics_json, 'w') as f:
                json.dump({k: float(v) if isinstance(v, numbers.Real) else v
                           for k, v in metrics.items()}, f, indent=2)
    close_distributed()
    return metrics


if __name__ == '__main__':
    main()
