"""LaplacianFormer models: the attention module and the backbone (torch + mmengine)."""
from .attention import LaplacianAttention
from .backbone import ARCH_SETTINGS, LaplacianFormer

__all__ = ['ARCH_SETTINGS', 'LaplacianAttention', 'LaplacianFormer']
