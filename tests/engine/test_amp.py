"""CPUAmpOptimWrapper and the fp32 islands it gives mmcv's fp32-only CPU ops."""
import copy
import json
import math
import os.path as osp
import sys

import pytest
import torch
from _runner_helpers import skipped_steps
from _shared import TOY_CONFIG
from mmengine.config import Config

from lapformer_mm.cli import train as train_tool
from lapformer_mm.engine.amp import CPUAmpOptimWrapper, mmcv_cpu_ops_in_fp32


@pytest.mark.slow(seconds=15)
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_backbone_autocast_50_steps_stay_finite_and_learn(toy_coco, dtype):
    """The toy backbone under ``--amp``'s optim_wrapper, 50 steps: finite, the loss falls."""
    import cv2
    from mmengine.optim import build_optim_wrapper

    from lapformer_mm.models import LaplacianFormer

    cfg = Config.fromfile(TOY_CONFIG)
    cfg.merge_from_dict({'optim_wrapper.dtype': str(dtype).replace('torch.', '')})
    train_tool.enable_amp(cfg)  # on CPU: the wrapper tools/train.py --amp builds
    cfg.optim_wrapper.type = 'CPUAmpOptimWrapper'  # also where --amp would pick a GPU's
    torch.manual_seed(0)
    backbone = {k: v for k, v in cfg.model.backbone.items() if k not in ('type', '_delete_')}
    model = torch.nn.ModuleDict(dict(backbone=LaplacianFormer(**backbone),
                                     head=torch.nn.Linear(512, 4)))
    wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    assert isinstance(wrapper, CPUAmpOptimWrapper) and wrapper.cast_dtype == dtype

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
            assert logits.dtype == dtype
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), target)
            wrapper.update_params(loss)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-5:]) < sum(losses[:5]), losses  # it learns, not just survives
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    if dtype == torch.float16:
        assert skipped_steps(wrapper.loss_scaler.state_dict()) <= 4
    else:
        assert wrapper.loss_scaler is None


def tiny_wrapper(dtype, **kwargs):
    model = torch.nn.Linear(4, 2)
    return model, CPUAmpOptimWrapper(
        dtype=dtype, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_cpu_amp_step_is_the_fp32_step_within_the_dtypes_precision():
    """A clipped SGD step (fp16: unscaled before the clipping) against mmengine's fp32 one."""
    from mmengine.optim import OptimWrapper
    lr, max_norm = 1.0, 0.5
    for dtype, tol in (('bfloat16', 2e-2), ('float16', 2e-3)):
        torch.manual_seed(0)
        x = torch.randn(8, 4)
        ref_model = torch.nn.Linear(4, 3)
        amp_model = copy.deepcopy(ref_model)
        start = [p.detach().clone() for p in ref_model.parameters()]
        ref = OptimWrapper(optimizer=torch.optim.SGD(ref_model.parameters(), lr=lr),
                           clip_grad=dict(max_norm=max_norm))
        amp = CPUAmpOptimWrapper(dtype=dtype, loss_scale=1024.0, clip_grad=dict(max_norm=max_norm),
                                 optimizer=torch.optim.SGD(amp_model.parameters(), lr=lr))
        outs = []
        for model, wrapper in ((ref_model, ref), (amp_model, amp)):
            with wrapper.optim_context(model):
                out = model(x)
            wrapper.update_params((3 * out.float()).square().mean())
            outs.append(out)
        assert outs[1].dtype == getattr(torch, dtype)
        torch.testing.assert_close(outs[1].float(), outs[0], rtol=tol, atol=tol)
        # The clipping bites: the fp32 step moved the weights by lr * max_norm.
        moved = torch.cat([(p.detach() - p0).flatten()
                           for p, p0 in zip(ref_model.parameters(), start)])
        assert float(moved.norm()) == pytest.approx(lr * max_norm, rel=1e-5)
        for p, q in zip(amp_model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m: f'{dtype}: {m}')


@pytest.mark.parametrize('loss_scale, scale_after', [(dict(init_scale=1024.0), 512.0),
                                                      (1024.0, 1024.0)])  # a float is static
def test_cpu_amp_wrapper_skips_overflowing_steps_and_resumes_its_scale(loss_scale, scale_after):
    model, wrapper = tiny_wrapper('float16', loss_scale=loss_scale)
    before = model.weight.detach().clone()
    wrapper.update_params(model(torch.ones(1, 4)).sum() * float('inf'))
    assert torch.equal(model.weight, before)  # the step was skipped
    assert wrapper.loss_scaler.get_scale() == scale_after
    _, resumed = tiny_wrapper('float16')
    resumed.load_state_dict(wrapper.state_dict())
    assert resumed.loss_scaler.get_scale() == scale_after


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(dtype='float32'), ValueError, 'dtype'),
    (dict(dtype='float16', loss_scale='static'), TypeError, 'loss_scale'),
])
def test_cpu_amp_wrapper_names_a_bad_dtype_or_loss_scale(kwargs, error, match):
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
