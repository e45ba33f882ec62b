"""The toy semantic-segmentation path (CPU): data, train, test, visualize, mmseg's script."""
import contextlib
import filecmp
import glob
import io
import json
import os.path as osp
import re
import sys

import cv2
import mmseg
import numpy as np
import pytest
from _shared import CONFIG_DIR, TOOLS, run_tool, write_toy_coco
from pycocotools.coco import COCO

from lapformer_mm.cli import make_toy_coco

SEG_CONFIG = osp.join(CONFIG_DIR, 'toy', 'upernet_lapformer_t_toy.py')
MMSEG_TRAIN = osp.join(osp.dirname(mmseg.__file__), '.mim', 'tools', 'train.py')


def test_label_maps_match_the_coco_masks_and_leave_coco_unchanged(toy_seg, toy_coco, tmp_path):
    coco_root = toy_coco
    plain = write_toy_coco(tmp_path, 8)  # no --seg-out: the COCO set must be byte-identical
    cmp = filecmp.dircmp(coco_root, plain)
    assert not cmp.diff_files and not cmp.left_only and not cmp.right_only
    assert not filecmp.dircmp(osp.join(coco_root, 'annotations'),
                              osp.join(plain, 'annotations')).diff_files

    for split in ('train', 'val'):
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(osp.join(coco_root, 'annotations', f'instances_{split}.json'))
        for img in coco.loadImgs(coco.getImgIds()):
            name = img['file_name']
            assert filecmp.cmp(osp.join(coco_root, split, name),
                               osp.join(toy_seg, 'img_dir', split, name), shallow=False)
            label = cv2.imread(osp.join(toy_seg, 'ann_dir', split, name), cv2.IMREAD_UNCHANGED)
            assert label.shape == (64, 64) and label.dtype == np.uint8
            assert set(np.unique(label)) <= set(range(len(make_toy_coco.CLASSES) + 1))
            from_coco = np.zeros_like(label)
            for ann in coco.loadAnns(coco.getAnnIds(imgIds=img['id'])):
                from_coco[coco.annToMask(ann) > 0] = ann['category_id']
            # polygons and pixels differ only along the outlines
            assert (from_coco == label).mean() > 0.95
            assert set(np.unique(from_coco)) == set(np.unique(label))


def seg_options(data_root, max_iters=2):
    """--cfg-options of a few iterations on the tiny set (the warm-up is the first)."""
    opts = [f'{part}.dataset.data_root={data_root}/' for part in
            ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    return ['--cfg-options'] + opts + [
        f'train_cfg.max_iters={max_iters}',
        'train_cfg.val_begin=1000000',
        f'default_hooks.checkpoint.interval={max_iters}',
        'default_hooks.logger.interval=1',
        'param_scheduler.0.end=1',
        'param_scheduler.1.begin=1',
        f'param_scheduler.1.end={max(max_iters, 2)}',
    ]


@pytest.mark.slow(seconds=45)
def test_train_test_and_draw_the_toy_segmentor(toy_seg, tmp_path):
    work = str(tmp_path / 'work')
    log = run_tool([sys.executable, osp.join(TOOLS, 'train.py'), SEG_CONFIG, '--work-dir',
                    work] + seg_options(toy_seg))
    assert 'Iter(train) [2/2]' in log
    ckpt = osp.join(work, 'iter_2.pth')

    metrics_json = str(tmp_path / 'metrics.json')
    log = run_tool([sys.executable, osp.join(TOOLS, 'test.py'), SEG_CONFIG, ckpt, '--work-dir',
                    work, '--metrics-json', metrics_json] + seg_options(toy_seg))
    assert 'per class results:' in log
    for name in ('background', 'circle', 'square', 'triangle', 'star'):
        # nan: a class neither in the two images nor predicted after two iterations.
        assert re.search(rf'\|\s+{name}\s+\|\s+([\d.]+|nan)\s+\|', log), name
    with open(metrics_json) as f:
        metrics = json.load(f)
    assert set(metrics) == {'aAcc', 'mIoU', 'mAcc'}
    assert 0 <= metrics['mIoU'] <= metrics['aAcc'] <= 100

    vis = str(tmp_path / 'vis')
    run_tool([sys.executable, osp.join(TOOLS, 'visualize_predictions.py'), SEG_CONFIG, ckpt,
              '--out-dir', vis, '--num', '2'] + seg_options(toy_seg))
    pngs = sorted(glob.glob(osp.join(vis, '*.png')))
    assert [osp.basename(p) for p in pngs] == ['000000_pred.png', '000001_pred.png']
    panels = cv2.imread(pngs[0])
    image = cv2.imread(osp.join(toy_seg, 'img_dir', 'val', '000000.png'))
    assert panels.shape == (64, 3 * 64, 3)
    assert np.array_equal(panels[:, :64], image)
    gt = cv2.imread(osp.join(toy_seg, 'ann_dir', 'val', '000000.png'), cv2.IMREAD_UNCHANGED)
    # the ground-truth panel repaints exactly the shapes' pixels
    changed = (panels[:, 64:128] != image).any(axis=2)
    assert changed.sum() > 0 and not changed[gt == 0].any()


def test_paint_labels_blends_class_pixels_only():
    from lapformer_mm.cli import visualize_predictions
    img = np.full((2, 3, 3), 100, np.uint8)
    labels = np.array([[0, 1, 2], [255, 2, 0]], np.uint8)
    painted = visualize_predictions.paint_labels(img, labels,
                                                 [[0, 0, 0], [200, 100, 0], [0, 0, 200]], 0.5)
    assert painted[0, 1].tolist() == [150, 100, 50]
    assert painted[1, 1].tolist() == [50, 50, 150]
    for y, x in ((0, 0), (1, 0), (1, 2)):  # background, ignore index
        assert painted[y, x].tolist() == [100, 100, 100]


@pytest.mark.slow
def test_mmseg_train_script_loads_the_plugin_by_custom_imports(toy_seg, tmp_path):
    """One iteration of the toy UperNet through mmseg's own tools/train.py."""
    work = str(tmp_path / 'work')
    # No PYTHONPATH: only the config's custom_imports can register LaplacianFormer.
    log = run_tool([sys.executable, MMSEG_TRAIN, SEG_CONFIG, '--work-dir', work] +
                   seg_options(toy_seg, max_iters=1), cwd=str(tmp_path),
                   extra_env=dict(PYTHONPATH=''))
    assert 'SafeCheckpointHook' in log  # configs/_base_/safe_runtime.py's runner
    assert 'Iter(train) [1/1]' in log
    assert osp.isfile(osp.join(work, 'iter_1.pth'))
