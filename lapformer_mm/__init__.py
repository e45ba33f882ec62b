"""LaplacianFormer for OpenMMLab: Laplacian-kernel linear attention backbones.

``import lapformer_mm`` (or ``custom_imports=dict(imports=['lapformer_mm'])``) registers,
in mmengine's root registries that mmdet's, mmseg's and mmpretrain's fall back to:
``LaplacianFormer`` (MODELS), ``NeckChannelsCheckHook``, ``SafeCheckpointHook`` and
``InputCheckHook`` (HOOKS), ``SafeCheckpointRunner`` (RUNNERS), ``CPUAmpOptimWrapper``
(OPTIM_WRAPPERS) and the ``atomic_local`` file backend. None of them is used until a config selects it
(:mod:`lapformer_mm.engine`).

The import changes nothing in torch, mmengine or the OpenMMLab codebases, and imports none
of mmdet, mmseg, mmpretrain or ``mmcv.ops``. Its one global action is additive:
:func:`~lapformer_mm.checkpoint.allow_mmengine_checkpoints` adds the data types mmengine
writes into checkpoints to ``torch.serialization``'s safe globals, so that
``torch.load(weights_only=True)`` (torch's default since 2.6) reads mmengine checkpoints.

``lapformer_mm.ops`` needs only torch (and CuPy on GPU); without mmengine nothing is
registered.
"""
from .checkpoint import allow_mmengine_checkpoints
from .registry import register_all_modules

__version__ = '0.1.0'

allow_mmengine_checkpoints()
register_all_modules()
