"""Mixed-precision training of the toy Mask R-CNN through ``tools/train.py --amp`` stays finite.

On a GPU ``--amp`` is mmengine's ``AmpOptimWrapper``; on CPU (mmengine's wrapper refuses
it) it is :class:`lapformer_mm.engine.amp.CPUAmpOptimWrapper`. The same tests run on either.
fp16 convolutions on CPU take torch's slow reference path (about 2 s per step of the
64 px toy detector on this machine, against 0.3 s in bf16), which makes the fp16 run the
slowest test of the suite.
"""
import glob
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


@pytest.mark.slow
@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_train_tool_amp_50_iterations_stay_finite(toy_coco, tmp_path, dtype):
    """``tools/train.py --amp`` for 52 iterations (13 epochs of the toy set's first 4 images):
    finite losses and weights, the loss falls, and for fp16 the dynamic loss scale skipped
    only a few steps."""
    work = str(tmp_path / 'work')
    log = run_tool(
        [sys.executable, osp.join(TOOLS, 'train.py'), TOY_CONFIG, '--amp', '--work-dir', work,
         '--cfg-options', *toy_data_options(toy_coco), 'train_dataloader.dataset.indices=4',
         'train_dataloader.batch_size=1', 'train_cfg.max_epochs=13', 'train_cfg.val_interval=100',
         'default_hooks.logger.interval=1', 'default_hooks.checkpoint.interval=100',
         f'optim_wrapper.dtype={dtype}'], timeout=900)
    wrapper = 'AmpOptimWrapper' if torch.cuda.is_available() else 'CPUAmpOptimWrapper'
    assert f"type='{wrapper}'" in log
    losses = [float(line.split(' loss: ')[1].split()[0])
              for line in log.splitlines() if ' loss: ' in line]
    assert len(losses) >= 50 and all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-5:]) < sum(losses[:5]), losses  # it learns, not just survives
    checkpoint = safe_load(sorted(glob.glob(osp.join(work, 'epoch_*.pth')))[-1])
    assert checkpoint['meta']['iter'] == 52
    assert all(bool(torch.isfinite(t).all()) for t in checkpoint['state_dict'].values()
               if t.is_floating_point())
    scaler = checkpoint['optimizer'].get('loss_scaler')
    if dtype == 'bfloat16':
        # mmengine's GPU wrapper keeps an (idle) scaler for bf16 too; the CPU one has none.
        assert scaler is None or wrapper == 'AmpOptimWrapper'
    else:
        # Starts at 2^16 and halves on each overflow; measured here: 3 skipped steps.
        skipped = 16 - math.log2(scaler['scale'])
        assert skipped == int(skipped) and skipped <= 4, scaler


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
