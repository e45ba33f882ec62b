"""Every user config builds; the T-size detectors and segmentors train and predict."""
import copy
import glob
import os.path as osp

import mmdet
import pytest
import torch
from _shared import CONFIG_DIR, ROOT
from mmengine.config import Config
from mmengine.registry import init_default_scope

import lapformer_mm  # noqa: F401

CONFIGS = sorted(
    glob.glob(osp.join(CONFIG_DIR, '*.py')) +
    glob.glob(osp.join(CONFIG_DIR, 'toy', '*.py')))
NECK_INPUT = {'tiny': [64, 128, 320, 512], 'small': [64, 128, 320, 512],
              'medium': [64, 128, 288, 512], 'large': [64, 128, 320, 512]}


def models_registry(scope):
    init_default_scope(scope)
    if scope == 'mmseg':
        from mmseg.registry import MODELS
    else:
        from mmdet.registry import MODELS
    return MODELS


def load_cfg(name):
    return Config.fromfile(osp.join(CONFIG_DIR, name))


def test_all_configs_are_collected():
    names = {osp.relpath(c, CONFIG_DIR) for c in CONFIGS}
    assert {f'{kind}_lapformer_{size}{tail}.py' for size in 'tsml'
            for kind, tail in (('maskrcnn', ''), ('maskrcnn', '_3x'), ('retinanet', ''))} | {
        f'{kind}_lapformer_{size}_ade20k.py' for size in 'tsm' for kind in ('upernet', 'fpn')} | {
        'toy/maskrcnn_lapformer_t_toy.py', 'toy/upernet_lapformer_t_toy.py'} <= names


@pytest.mark.parametrize(
    'path', CONFIGS, ids=[osp.relpath(c, ROOT) for c in CONFIGS])
def test_every_config_builds_its_model_through_the_plugin(path):
    cfg = Config.fromfile(path)
    # The plugin and its runtime (the configs of configs/cls: tests/engine/test_opt_in.py).
    assert cfg.custom_imports == dict(imports=['lapformer_mm'], allow_failed_imports=False)
    assert cfg.runner_type == 'SafeCheckpointRunner'
    backbone = cfg.model.backbone
    models_registry(cfg.default_scope).build(cfg.model)
    if path.endswith('_baseline.py'):  # a comparison baseline: another backbone
        return
    assert backbone.type == 'LaplacianFormer'
    # the neck/decoder widths must be the backbone's stage widths (the table above)
    widths = [NECK_INPUT[backbone.arch][i] for i in backbone.get('out_indices', (0, 1, 2, 3))]
    neck = cfg.model.get('neck')
    head_in = (cfg.model.decode_head.in_channels
               if neck is None else neck.in_channels)
    assert list(head_in) == widths
    if 'toy' not in path:
        assert backbone.init_cfg.type == 'Pretrained'


def _scale_free(node):
    """A pipeline with each keep-ratio scale as (shorter, longer): (800, 1333) is (1333, 800)."""
    if isinstance(node, dict):
        return {k: _scale_free(v) for k, v in node.items() if k != 'backend_args'}
    if isinstance(node, (list, tuple)):
        if len(node) == 2 and all(isinstance(v, int) for v in node):
            return tuple(sorted(node))
        return [_scale_free(v) for v in node]
    return node


def test_coco_configs_follow_the_1x_3x_and_retinanet_recipes():
    """The 1x/3x/RetinaNet recipes the issue fixes: schedule, optimizer, batch."""
    for name, epochs, steps in (('maskrcnn_lapformer_t.py', 12, [8, 11]),
                                ('maskrcnn_lapformer_m_3x.py', 36, [27, 33]),
                                ('retinanet_lapformer_l.py', 12, [8, 11])):
        cfg = load_cfg(name)
        assert cfg.train_cfg.max_epochs == epochs
        assert cfg.param_scheduler[1].milestones == steps
        opt = cfg.optim_wrapper.optimizer
        assert (opt.type, opt.lr, opt.weight_decay) == ('AdamW', 1e-4, 0.05)
        assert cfg.optim_wrapper.paramwise_cfg.norm_decay_mult == 0.0
        assert cfg.train_dataloader.batch_size == 2
        assert cfg.auto_scale_lr.base_batch_size == 16
        if epochs == 12:
            resize = cfg.train_dataloader.dataset.pipeline[2]
            assert resize.scale == (1333, 800)
    swin_3x = Config.fromfile(osp.join(
        osp.dirname(mmdet.__file__), '.mim', 'configs', 'swin',
        'mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py'))
    assert (_scale_free(load_cfg('maskrcnn_lapformer_t_3x.py').train_pipeline)
            == _scale_free(swin_3x.train_pipeline))
    ade = load_cfg('upernet_lapformer_t_ade20k.py')
    assert ade.crop_size == (512, 512)
    assert ade.param_scheduler[1].end == 160000
    assert ade.optim_wrapper.optimizer.type == 'AdamW'
    fpn = load_cfg('fpn_lapformer_m_ade20k.py')  # PVT's Semantic FPN recipe
    assert fpn.model.neck.type == 'FPN' and fpn.model.decode_head.type == 'FPNHead'
    assert fpn.crop_size == (512, 512)
    assert fpn.train_cfg.max_iters == 80000
    assert [(s.type, s.power, s.end) for s in fpn.param_scheduler] == [
        ('PolyLR', 0.9, 80000)]
    opt = fpn.optim_wrapper.optimizer
    assert (opt.type, opt.lr, opt.weight_decay) == ('AdamW', 1e-4, 1e-4)
    assert fpn.train_dataloader.batch_size * 8 == fpn.auto_scale_lr.base_batch_size


def no_pretrained(cfg):
    cfg = copy.deepcopy(cfg)
    cfg.model.backbone.init_cfg = None
    return cfg


def det_inputs(num_classes, size=96, with_mask=True):
    """Two packed images with two boxes (and masks) each, as PackDetInputs makes."""
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData
    gen = torch.Generator().manual_seed(0)
    inputs, samples = [], []
    for i in range(2):
        inputs.append(torch.randint(0, 255, (3, size, size), generator=gen,
                                    dtype=torch.uint8))
        boxes = torch.tensor([[8., 10., 40., 50.], [30., 20., 90., 70.]])
        inst = InstanceData(bboxes=boxes,
                            labels=torch.tensor([i % num_classes, 1]))
        if with_mask:
            masks = torch.zeros(2, size, size, dtype=torch.uint8)
            for j, (x1, y1, x2, y2) in enumerate(boxes.int().tolist()):
                masks[j, y1:y2, x1:x2] = 1
            inst.masks = BitmapMasks(masks.numpy(), size, size)
        sample = DetDataSample(metainfo=dict(
            img_shape=(size, size), ori_shape=(size, size),
            pad_shape=(size, size), scale_factor=(1.0, 1.0), img_id=i))
        sample.gt_instances = inst
        samples.append(sample)
    return dict(inputs=inputs, data_samples=samples)


def loss_and_predict(model, data):
    """One optimizer step on the summed losses, then a predict pass."""
    torch.manual_seed(0)
    model.init_weights()
    model.train()
    batch = model.data_preprocessor(data, True)
    losses = model(**batch, mode='loss')
    loss, _ = model.parse_losses(losses)
    assert torch.isfinite(loss)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(n for n, g in grads.items() if g is None)
    model.eval()
    with torch.no_grad():
        preds = model(**model.data_preprocessor(data, False), mode='predict')
    return losses, missing, preds


@pytest.mark.slow
@pytest.mark.parametrize('name, loss_keys', [
    ('maskrcnn_lapformer_t.py', {'loss_rpn_cls', 'loss_cls', 'loss_bbox', 'loss_mask'}),
    ('retinanet_lapformer_t.py', {'loss_cls', 'loss_bbox'})])
def test_coco_t_loss_and_predict(name, loss_keys):
    """Every parameter gets a gradient (DDP without find_unused_parameters)."""
    cfg = no_pretrained(load_cfg(name))
    with_mask = 'mask' in name
    model = models_registry('mmdet').build(cfg.model)
    losses, missing, preds = loss_and_predict(model, det_inputs(80, with_mask=with_mask))
    assert loss_keys <= set(losses) and missing == []
    assert cfg.get('find_unused_parameters', False) is False
    inst = preds[0].pred_instances
    assert len(preds) == 2 and inst.bboxes.shape[1] == 4
    assert not with_mask or inst.masks.shape[1:] == (96, 96)


@pytest.mark.slow
@pytest.mark.parametrize('name, loss_keys', [
    ('upernet_lapformer_t_ade20k.py', {'decode.loss_ce', 'aux.loss_ce'}),
    ('fpn_lapformer_t_ade20k.py', {'decode.loss_ce'}),
])
def test_ade20k_t_loss_and_predict(name, loss_keys):
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    cfg = no_pretrained(load_cfg(name))
    # SyncBN needs a process group; plain BN is the same layer on one process
    for part in ('neck', 'decode_head', 'auxiliary_head'):
        if 'norm_cfg' in cfg.model.get(part, {}):
            cfg.model[part].norm_cfg = dict(type='BN', requires_grad=True)
    cfg.model.data_preprocessor.size = (64, 64)
    model = models_registry('mmseg').build(cfg.model)
    gen = torch.Generator().manual_seed(0)
    inputs, samples = [], []
    for _ in range(2):
        inputs.append(torch.randint(0, 255, (3, 64, 64), generator=gen,
                                    dtype=torch.uint8))
        sample = SegDataSample(metainfo=dict(
            img_shape=(64, 64), ori_shape=(64, 64), pad_shape=(64, 64)))
        sample.gt_sem_seg = PixelData(data=torch.randint(
            0, 150, (1, 64, 64), generator=gen))
        samples.append(sample)
    losses, missing, preds = loss_and_predict(
        model, dict(inputs=inputs, data_samples=samples))
    assert set(losses) >= loss_keys
    assert not missing
    assert preds[0].pred_sem_seg.data.shape == (1, 64, 64)
