"""Mixed-precision training of the toy Mask R-CNN stays finite (CPU autocast, GPU --amp).

What happens on a CPU-only machine, measured here (torch 2.13 CPU, mmengine 0.10.7,
mmcv 2.1.0):

- ``tools/train.py --amp`` cannot run: mmengine's ``AmpOptimWrapper`` asserts a
  CUDA/NPU/MLU/MUSA device when it is built, for fp16 and bf16 alike, so the tool
  refuses it up front (:func:`test_train_tool_amp_on_cpu_is_refused_up_front`).
- ``torch.autocast('cpu')`` works for the whole detector in bf16 and in fp16 once
  mmcv's CPU ``nms`` and ``roi_align`` (fp32-only kernels) get fp32 inputs; that is
  what these tests do, through mmengine's own ``train_step`` and an ``OptimWrapper``
  that autocasts (with ``torch.amp.GradScaler('cpu')`` for fp16).
- fp16 convolutions on CPU take torch's slow reference path (``_slow_conv2d_*``, ~2 s
  per step here against ~0.3 s in bf16), so the fp16 CPU test runs 8 steps; the 50-step
  fp16 run is the GPU test through ``tools/train.py --amp``.
"""
import contextlib
import io
import math
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config
from mmengine.dataset import pseudo_collate
from mmengine.optim import OptimWrapper

import lapformer_mm  # noqa: F401

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TOOLS = osp.join(ROOT, 'tools')
TOY_CONFIG = osp.join(ROOT, 'configs', 'toy', 'maskrcnn_lapformer_t_toy.py')
sys.path.insert(0, TOOLS)

import make_toy_coco  # noqa: E402


class CpuAutocastOptimWrapper(OptimWrapper):
    """OptimWrapper whose forward runs under ``torch.autocast('cpu', dtype)``.

    fp16 scales the loss with ``torch.amp.GradScaler('cpu')`` (dynamic, as ``--amp``
    does on GPU): steps whose gradients overflow are skipped and the scale halves.
    """

    def __init__(self, dtype, **kwargs):
        super().__init__(**kwargs)
        self.dtype = dtype
        self.scaler = torch.amp.GradScaler('cpu') if dtype == torch.float16 else None
        self.skipped_steps = 0

    def backward(self, loss, **kwargs):
        super().backward(self.scaler.scale(loss) if self.scaler else loss, **kwargs)

    def step(self, **kwargs):
        if self.scaler is None:
            super().step(**kwargs)
            return
        self.scaler.unscale_(self.optimizer)
        if self.clip_grad_kwargs:
            self._clip_grad()
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer, **kwargs)
        self.scaler.update()
        self.skipped_steps += self.scaler.get_scale() < scale

    @contextlib.contextmanager
    def optim_context(self, model):
        with super().optim_context(model), torch.autocast('cpu', dtype=self.dtype):
            yield


@contextlib.contextmanager
def mmcv_cpu_ops_in_fp32():
    """Feed mmcv's fp32-only CPU nms/roi_align fp32 inputs; results back in the input dtype."""
    import mmcv.ops  # noqa: F401
    nms_module = sys.modules['mmcv.ops.nms']
    roi_module = sys.modules['mmcv.ops.roi_align']
    nms, roi_align = nms_module.nms, roi_module.roi_align

    def nms_fp32(boxes, scores, *args, **kwargs):
        return nms(boxes.float(), scores.float(), *args, **kwargs)

    def roi_align_fp32(feats, rois, *args, **kwargs):
        return roi_align(feats.float(), rois.float(), *args, **kwargs).to(feats.dtype)

    nms_module.nms, roi_module.roi_align = nms_fp32, roi_align_fp32
    try:
        yield
    finally:
        nms_module.nms, roi_module.roi_align = nms, roi_align


@pytest.fixture(scope='module')
def toy_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('amp') / 'toy_coco')
    with contextlib.redirect_stdout(io.StringIO()):
        make_toy_coco.main(['--out', root, '--num-train', '4', '--num-val', '2',
                            '--img-size', '64', '--max-objects', '2'])
    return root


def build_toy_detector(toy_root):
    """The toy config's Mask R-CNN and two one-image batches, resized to 64 px."""
    from mmdet.registry import DATASETS, MODELS
    from mmengine.registry import init_default_scope

    cfg = Config.fromfile(TOY_CONFIG)
    init_default_scope('mmdet')
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    model.init_weights()
    dataset_cfg = cfg.train_dataloader.dataset
    dataset_cfg.data_root = toy_root + '/'
    dataset_cfg.pipeline[2]['scale'] = (64, 64)
    dataset = DATASETS.build(dataset_cfg)
    batches = [pseudo_collate([dataset[i]]) for i in range(2)]
    return model, batches, cfg.optim_wrapper


def train_steps(toy_root, dtype, steps):
    model, batches, optim_cfg = build_toy_detector(toy_root)
    wrapper = CpuAutocastOptimWrapper(
        dtype, optimizer=torch.optim.AdamW(model.parameters(), lr=optim_cfg.optimizer.lr,
                                           weight_decay=0.05),
        clip_grad=dict(optim_cfg.clip_grad))
    losses = []
    threads = torch.get_num_threads()
    # One thread: the shared 2-core machine runs these small ops fastest that way.
    torch.set_num_threads(1)
    try:
        with mmcv_cpu_ops_in_fp32(), torch.random.fork_rng():
            torch.manual_seed(0)
            for step in range(steps):
                log = model.train_step(batches[step % 2], wrapper)
                losses.append(log['loss'].item())
    finally:
        torch.set_num_threads(threads)
    return model, losses, wrapper


def assert_finite_training(model, losses):
    assert all(math.isfinite(v) for v in losses), losses
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert losses[-1] < losses[0], (losses[0], losses[-1])  # it learns, not just survives


def test_bf16_autocast_50_steps_stay_finite(toy_root):
    model, losses, _ = train_steps(toy_root, torch.bfloat16, 50)
    assert_finite_training(model, losses)
    assert all(bool(torch.isfinite(b).all()) for b in model.buffers() if b.is_floating_point())


def test_fp16_autocast_steps_stay_finite(toy_root):
    """8 steps: fp16 CPU convolutions run torch's slow reference kernels (see module doc)."""
    model, losses, wrapper = train_steps(toy_root, torch.float16, 8)
    assert_finite_training(model, losses)
    # The dynamic scale starts at 2^16 and halves on each overflow; measured here: 2-3 of
    # the first steps are skipped before it settles.
    assert wrapper.skipped_steps <= 4
    assert wrapper.scaler.get_scale() == 2.0 ** (16 - wrapper.skipped_steps)


def test_train_tool_amp_on_cpu_is_refused_up_front(toy_root, tmp_path):
    """``--amp`` on a CPU-only machine: tools/train.py says why before building anything
    (mmengine's AmpOptimWrapper would assert later, after model and data are built)."""
    if torch.cuda.is_available():
        pytest.skip('CPU-only behaviour')
    spec = __import__('importlib.util').util.spec_from_file_location(
        'tools_train', osp.join(TOOLS, 'train.py'))
    train_tool = __import__('importlib.util').util.module_from_spec(spec)
    spec.loader.exec_module(train_tool)
    argv = [TOY_CONFIG, '--amp', '--work-dir', str(tmp_path), '--cfg-options',
            f'train_dataloader.dataset.data_root={toy_root}/']
    with pytest.raises(RuntimeError, match=r"--amp needs a GPU .*AmpOptimWrapper refuses"):
        train_tool.build_cfg(train_tool.parse_args(argv))


@pytest.mark.gpu
def test_train_tool_amp_50_iterations_on_gpu(toy_root, tmp_path):
    """The real thing: ``tools/train.py --amp`` (fp16 + dynamic loss scale) for 50 steps."""
    ann_val = osp.join(toy_root, 'annotations', 'instances_val.json')
    work = str(tmp_path / 'work')
    proc = subprocess.run(
        [sys.executable, osp.join(TOOLS, 'train.py'), TOY_CONFIG, '--amp', '--work-dir', work,
         '--cfg-options', f'train_dataloader.dataset.data_root={toy_root}/',
         f'val_dataloader.dataset.data_root={toy_root}/', f'val_evaluator.ann_file={ann_val}',
         'train_dataloader.batch_size=1', 'train_cfg.max_epochs=13', 'train_cfg.val_interval=100',
         'default_hooks.logger.interval=1', 'default_hooks.checkpoint.interval=100'],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    losses = [float(line.split(' loss: ')[1].split()[0])
              for line in proc.stdout.splitlines() if ' loss: ' in line]
    assert len(losses) >= 50 and all(math.isfinite(v) for v in losses)
