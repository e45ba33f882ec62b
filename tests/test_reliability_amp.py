"""Mixed-precision training of the toy Mask R-CNN through ``tools/train.py --amp`` stays finite.

On a GPU ``--amp`` is mmengine's ``AmpOptimWrapper``; on CPU (mmengine's wrapper refuses
it) it is :class:`lapformer_mm.engine.amp.CPUAmpOptimWrapper`. The same tests run on either.
fp16 convolutions and matrix products on CPU take torch's slow reference paths (several
seconds per step of the 64 px toy detector on this machine, against 0.3 s in bf16): the
detector trains 4 fp16 steps through the tool, and the 50-step fp16 stability is checked on
the backbone alone, in this process.
"""
import glob
import json
import math
import os.path as osp
import sys

import pytest
import torch
from _shared import TOOLS, TOY_CONFIG, run_tool, toy_data_options
from mmengine.config import Config

from lapformer_mm.checkpoint import safe_load
from lapformer_mm.cli import train as train_tool
from lapformer_mm.engine.amp import CPUAmpOptimWrapper, mmcv_cpu_ops_in_fp32


def amp_train(toy_coco, work, dtype, max_epochs):
    """``tools/train.py --amp`` on the toy set's first 4 images, batches of 1 (4 iterations
    per epoch); the log and the last checkpoint."""
    log = run_tool(
        [sys.executable, osp.join(TOOLS, 'train.py'), TOY_CONFIG, '--amp', '--work-dir', work,
         '--cfg-options', *toy_data_options(toy_coco), 'train_dataloader.dataset.indices=4',
         'train_dataloader.batch_size=1', f'train_cfg.max_epochs={max_epochs}',
         'train_cfg.val_interval=100', 'default_hooks.logger.interval=1',
         'default_hooks.checkpoint.interval=100', f'optim_wrapper.dtype={dtype}'], timeout=900)
    wrapper = 'AmpOptimWrapper' if torch.cuda.is_available() else 'CPUAmpOptimWrapper'
    assert f"type='{wrapper}'" in log
    losses = [float(line.split(' loss: ')[1].split()[0])
              for line in log.splitlines() if ' loss: ' in line]
    checkpoint = safe_load(sorted(glob.glob(osp.join(work, 'epoch_*.pth')))[-1])
    assert checkpoint['meta']['iter'] == 4 * max_epochs
    assert all(bool(torch.isfinite(t).all()) for t in checkpoint['state_dict'].values()
               if t.is_floating_point())
    return wrapper, losses, checkpoint


def skipped_steps(scaler_state):
    """Steps a dynamic loss scale skipped: it starts at 2^16 and halves on each overflow
    (and would double only after 2000 clean steps)."""
    skipped = 16 - math.log2(scaler_state['scale'])
    assert skipped == int(skipped), scaler_state
    return int(skipped)


@pytest.mark.slow
def test_train_tool_bf16_amp_52_iterations_stay_finite_and_learn(toy_coco, tmp_path):
    """``tools/train.py --amp`` (bf16) for 52 iterations (13 epochs of the toy set's first 4
    images): finite losses and weights, the loss falls, no loss scale on CPU."""
    wrapper, losses, checkpoint = amp_train(toy_coco, str(tmp_path / 'work'), 'bfloat16', 13)
    assert len(losses) >= 50 and all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-5:]) < sum(losses[:5]), losses  # it learns, not just survives
    # mmengine's GPU wrapper keeps an (idle) scaler for bf16 too; the CPU one has none.
    assert checkpoint['optimizer'].get('loss_scaler') is None or wrapper == 'AmpOptimWrapper'


@pytest.mark.slow
def test_train_tool_fp16_amp_trains_finite_with_a_dynamic_loss_scale(toy_coco, tmp_path):
    """``tools/train.py --amp`` with ``optim_wrapper.dtype=float16`` for 4 iterations (fp16
    convolutions take torch's slow reference path on CPU, several seconds a step of the
    detector): finite losses and weights, and the dynamic loss scale, saved in the
    checkpoint, skipped at most 3 of the 4 steps. That 50 fp16 steps stay finite, learn and
    skip only a few steps is test_backbone_fp16_autocast_50_steps_stay_finite_and_learn."""
    _, losses, checkpoint = amp_train(toy_coco, str(tmp_path / 'work'), 'float16', 1)
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), losses
    assert skipped_steps(checkpoint['optimizer']['loss_scaler']) <= 3


@pytest.mark.slow
def test_backbone_fp16_autocast_50_steps_stay_finite_and_learn(toy_coco):
    """The toy config's backbone under ``--amp``'s fp16 wrapper (its optim_wrapper as
    ``tools/train.py --amp`` makes it: AdamW, gradient clipping, a dynamic loss scale), in
    this process: 50 steps of batches of 1 on the toy set's first 4 images, a linear head
    naming the classes each shows. Finite losses and weights, the loss falls, and the scale
    skipped only a few steps (measured here: 2)."""
    import cv2
    from mmengine.optim import build_optim_wrapper

    from lapformer_mm.models import LaplacianFormer

    cfg = Config.fromfile(TOY_CONFIG)
    cfg.merge_from_dict({'optim_wrapper.dtype': 'float16'})
    train_tool.enable_amp(cfg)  # on CPU: the wrapper tools/train.py --amp builds
    cfg.optim_wrapper.type = 'CPUAmpOptimWrapper'  # also where --amp would pick a GPU's
    torch.manual_seed(0)
    backbone = {k: v for k, v in cfg.model.backbone.items() if k not in ('type', '_delete_')}
    model = torch.nn.ModuleDict(dict(backbone=LaplacianFormer(**backbone),
                                     head=torch.nn.Linear(512, 4)))
    wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    assert isinstance(wrapper, CPUAmpOptimWrapper) and wrapper.cast_dtype == torch.float16

    with open(osp.join(toy_coco, 'annotations', 'instances_train.json')) as f:
        coco = json.load(f)
    mean, std = (torch.tensor(cfg.model.data_preprocessor[k]).view(3, 1, 1)
                 for k in ('mean', 'std'))
    images, targets = [], []
    for info in coco['images'][:4]:
        bgr = cv2.imread(osp.join(toy_coco, 'train', info['file_name']))
        images.append((torch.from_numpy(bgr[..., ::-1].copy()).permute(2, 0, 1) - mean) / std)
        target = torch.zeros(4)
        for ann in coco['annotations']:
            if ann['image_id'] == info['id']:
                target[ann['category_id'] - 1] = 1
        targets.append(target)

    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tools run (tool_env): two threads of tiny fp16 products
    try:                      # spin against each other on a loaded 2-core machine
        for step in range(50):
            image, target = images[step % 4][None], targets[step % 4][None]
            with wrapper.optim_context(model):
                logits = model['head'](model['backbone'](image)[-1].mean((2, 3)))
            assert logits.dtype == torch.float16
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), target)
            wrapper.update_params(loss)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-5:]) < sum(losses[:5]), losses  # it learns, not just survives
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert skipped_steps(wrapper.loss_scaler.state_dict()) <= 4


def tiny_wrapper(dtype, **kwargs):
    model = torch.nn.Linear(4, 2)
    return model, CPUAmpOptimWrapper(
        dtype=dtype, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_cpu_amp_wrapper_runs_the_forward_in_the_chosen_dtype():
    for dtype in ('bfloat16', torch.float16):
        model, wrapper = tiny_wrapper(dtype)
        with wrapper.optim_context(model):
            out = model(torch.randn(3, 4))
        assert out.dtype == getattr(torch, str(dtype).replace('torch.', ''))
        wrapper.update_params(out.float().square().mean())
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_cpu_amp_wrapper_skips_overflowing_steps_and_resumes_its_scale():
    model, wrapper = tiny_wrapper('float16', loss_scale=dict(init_scale=1024.0))
    before = model.weight.detach().clone()
    wrapper.update_params(model(torch.ones(1, 4)).sum() * float('inf'))
    assert torch.equal(model.weight, before)  # the step was skipped
    assert wrapper.loss_scaler.get_scale() == 512.0
    state = wrapper.state_dict()
    _, resumed = tiny_wrapper('float16')
    resumed.load_state_dict(state)
    assert resumed.loss_scaler.get_scale() == 512.0


def test_cpu_amp_wrapper_float_loss_scale_is_static_as_in_mmengine():
    model, wrapper = tiny_wrapper('float16', loss_scale=1024.0)
    before = model.weight.detach().clone()
    wrapper.update_params(model(torch.ones(1, 4)).sum() * float('inf'))
    assert torch.equal(model.weight, before)  # still skipped
    assert wrapper.loss_scaler.get_scale() == 1024.0  # but the scale stays


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(dtype='float32'), ValueError, r"dtype must be one of \('bfloat16', 'float16'\), "
                                        r"got 'float32'"),
    (dict(dtype='float16', loss_scale='static'), TypeError,
     r"loss_scale must be 'dynamic', a float or a dict"),
])
def test_cpu_amp_wrapper_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        tiny_wrapper(**kwargs)


def test_mmcv_cpu_ops_compute_in_fp32_inside_the_block_only():
    from mmcv.ops import RoIAlign
    roi_module = sys.modules['mmcv.ops.roi_align']  # mmcv.ops.roi_align is also the function
    feats = torch.randn(1, 8, 16, 16)
    rois = torch.tensor([[0, 2., 3., 40., 50.]])
    layer = RoIAlign((7, 7), 0.25, 0)
    reference = layer(feats, rois)
    original = roi_module.roi_align
    with mmcv_cpu_ops_in_fp32():
        pooled = layer(feats.bfloat16(), rois)
    assert pooled.dtype == torch.bfloat16
    torch.testing.assert_close(pooled.float(), reference, rtol=2e-2, atol=2e-2)
    assert roi_module.roi_align is original


def test_amp_refuses_to_replace_another_wrapper_type():
    cfg = Config(dict(optim_wrapper=dict(type='ApexOptimWrapper', optimizer=dict(type='SGD'))))
    with pytest.raises(ValueError,
                       match=r"--amp replaces .* optim_wrapper.type='ApexOptimWrapper'"):
        train_tool.enable_amp(cfg)
