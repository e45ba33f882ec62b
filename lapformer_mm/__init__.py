"""LaplacianFormer for OpenMMLab: Laplacian-kernel linear attention backbones.

``import lapformer_mm`` registers ``LaplacianFormer`` in the mmdet, mmseg and mmpretrain
``MODELS`` registries that are installed, and allowlists mmengine's checkpoint contents for
``torch.load(weights_only=True)``. ``lapformer_mm.ops`` needs only torch (and CuPy on GPU).
"""
from .checkpoint import allow_mmengine_checkpoints
from .registry import register_modules

__version__ = '0.1.0'

allow_mmengine_checkpoints()
register_modules()
