"""One training iteration of the full-size Mask R-CNN-LaplacianFormer-T config at 1333×800
on synthetic scenes in COCO's layout."""
import math
import os.path as osp

import pytest
from _shared import CONFIG_DIR

from lapformer_mm.cli import smoke_fullsize
from lapformer_mm.cli import train as train_tool

CONFIG = osp.join(CONFIG_DIR, 'maskrcnn_lapformer_t.py')
WIDTH, HEIGHT = 1333, 800


@pytest.mark.slow(seconds=45)
@pytest.mark.usefixtures('mmdet_scope')
def test_maskrcnn_t_trains_one_iteration_at_full_size(tmp_path):
    from mmengine.config import Config

    data_dir = str(tmp_path / 'data')
    smoke_fullsize.make_toy_coco.main([
        '--layout', 'official', '--img-size', str(WIDTH), str(HEIGHT), '--num-train', '1',
        '--num-val', '1', '--out', osp.join(data_dir, 'coco')])
    options = smoke_fullsize.smoke_options(Config.fromfile(CONFIG), data_dir) + [
        'train_dataloader.batch_size=1', 'train_dataloader.num_workers=0',
        'train_dataloader.persistent_workers=False', 'train_cfg.val_interval=2',
        'default_hooks.checkpoint.interval=2', 'default_hooks.checkpoint.save_last=False']
    args = train_tool.parse_args([CONFIG, '--work-dir', str(tmp_path / 'work'),
                                  '--cfg-options', *options])
    cfg = train_tool.checked_cfg(train_tool.build_cfg, args, 'train')
    assert cfg.train_pipeline[2].scale == (WIDTH, HEIGHT)  # the 1x recipe, unchanged
    runner = train_tool.build_runner(cfg)
    runner.train()
    sample = runner.train_dataloader.dataset[0]['data_samples']
    assert sample.img_shape == (HEIGHT, WIDTH)
    assert runner.iter == 1
    losses = {k: runner.message_hub.get_scalar(f'train/{k}').current()
              for k in ('loss', 'loss_rpn_cls', 'loss_cls', 'loss_bbox', 'loss_mask')}
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert losses['loss_mask'] > 0
