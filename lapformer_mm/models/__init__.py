"""LaplacianFormer models: the attention module and the backbone (torch + mmengine)."""
from .attention import LaplacianAttention
from .backbone import ARCH_SETTINGS, LaplacianFormer
from .validation import NeckChannelsCheckHook, check_built_model, check_model_cfg

__all__ = ['ARCH_SETTINGS', 'LaplacianAttention', 'LaplacianFormer', 'NeckChannelsCheckHook',
           'check_built_model', 'check_model_cfg']
