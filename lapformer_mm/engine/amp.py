"""Mixed-precision training on CPU: what ``tools/train.py --amp`` uses without a GPU.

mmengine's ``AmpOptimWrapper`` asserts a CUDA/NPU/MLU/MUSA device. mmcv's CPU ``roi_align``
and ``nms`` kernels exist only for float32: inside the autocast region they get float32
inputs and hand back their result in the input's dtype.
"""
import contextlib
import sys

import torch
from mmengine.optim import OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS

CPU_AMP_DTYPES = ('bfloat16', 'float16')


@contextlib.contextmanager
def mmcv_cpu_ops_in_fp32():
    """Within the block, mmcv's ``roi_align`` and ``nms`` compute in float32 (mmdet calls
    both through their modules' globals)."""
    import mmcv.ops  # noqa: F401  (loads the two modules below)
    nms_module = sys.modules['mmcv.ops.nms']
    roi_module = sys.modules['mmcv.ops.roi_align']
    nms, roi_align = nms_module.nms, roi_module.roi_align

    def nms_fp32(boxes, scores, *args, **kwargs):
        dets, keep = nms(boxes.float(), scores.float(), *args, **kwargs)
        return dets.to(boxes.dtype), keep

    def roi_align_fp32(feats, rois, *args, **kwargs):
        return roi_align(feats.float(), rois.float(), *args, **kwargs).to(feats.dtype)

    nms_module.nms, roi_module.roi_align = nms_fp32, roi_align_fp32
    try:
        yield
    finally:
        nms_module.nms, roi_module.roi_align = nms, roi_align


@OPTIM_WRAPPERS.register_module()
class CPUAmpOptimWrapper(OptimWrapper):
    """``OptimWrapper`` whose forward runs under ``torch.autocast('cpu', dtype)``, dtype
    'bfloat16' or 'float16'; ``loss_scale`` (float16 only) as mmengine's ``AmpOptimWrapper``'s."""

    def __init__(self, dtype='bfloat16', loss_scale='dynamic', **kwargs):
        super().__init__(**kwargs)
        name = dtype if isinstance(dtype, str) else str(dtype).replace('torch.', '')
        if name not in CPU_AMP_DTYPES:
            raise ValueError(f'CPUAmpOptimWrapper: dtype must be one of {CPU_AMP_DTYPES}, '
                             f'got {dtype!r}')
        self.cast_dtype = getattr(torch, name)
        self.loss_scaler = None
        # GradScaler.update(new_scale) pins a static scale; None lets it adapt.
        self._scale_update_param = None
        if self.cast_dtype == torch.float16:
            self.loss_scaler = self._make_scaler(loss_scale)

    def _make_scaler(self, loss_scale):
        if loss_scale == 'dynamic':
            return torch.amp.GradScaler('cpu')
        if isinstance(loss_scale, float):
            self._scale_update_param = loss_scale
            return torch.amp.GradScaler('cpu', init_scale=loss_scale)
        if isinstance(loss_scale, dict):
            return torch.amp.GradScaler('cpu', **loss_scale)
        raise TypeError("CPUAmpOptimWrapper: loss_scale must be 'dynamic', a float or a "
                        f'dict of GradScaler arguments, got {loss_scale!r}')

    def backward(self, loss, **kwargs):
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        super().backward(loss, **kwargs)

    def step(self, **kwargs):
        if self.loss_scaler is None:
            super().step(**kwargs)
            return
        self.loss_scaler.unscale_(self.optimizer)
        if self.clip_grad_kwargs:
            self._clip_grad()
        self.loss_scaler.step(self.optimizer, **kwargs)
        self.loss_scaler.update(self._scale_update_param)

    def state_dict(self):
        state = super().state_dict()
        if self.loss_scaler is not None:
            state['loss_scaler'] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        scaler_state = state_dict.pop('loss_scaler', None)
        if scaler_state is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler_state)
        super().load_state_dict(state_dict)

    @contextlib.contextmanager
    def optim_context(self, model):
        with super().optim_context(model), mmcv_cpu_ops_in_fp32(), \
                torch.autocast('cpu', dtype=self.cast_dtype):
            yield
