"""LaplacianFormer for OpenMMLab: Laplacian-kernel linear attention backbones.

``import lapformer_mm`` (or ``custom_imports=dict(imports=['lapformer_mm'])``) registers the
backbone, its hooks, runner, CPU AMP wrapper and ``atomic_local`` file backend in mmengine's
root registries (:mod:`.registry`); none is used until a config selects it. It imports none
of mmdet, mmseg, mmpretrain or ``mmcv.ops``, and its one global action is additive:
:func:`~lapformer_mm.checkpoint.allow_mmengine_checkpoints` lets
``torch.load(weights_only=True)`` read mmengine checkpoints. ``lapformer_mm.ops`` needs only
torch (and CuPy on GPU).
"""
import re

import torch

__version__ = '0.1.0'
#: The lowest torch the package is checked with (docs/getting_started.md, the pinned stack);
#: the ops need ``torch.library.Library`` define/impl and ``register_fake``.
TORCH_FLOOR = '2.7'


def _torch_release(version):
    return tuple(int(part) for part in re.match(r'(\d+)\.(\d+)', version).groups())


if _torch_release(torch.__version__) < _torch_release(TORCH_FLOOR):
    raise ImportError(f'lapformer_mm needs torch>={TORCH_FLOOR} (the lowest release it is checked '
                      f'with); found torch {torch.__version__}. '
                      f'Upgrade with: pip install "torch>={TORCH_FLOOR}"')

from .checkpoint import allow_mmengine_checkpoints  # noqa: E402
from .registry import register_all_modules  # noqa: E402

allow_mmengine_checkpoints()
register_all_modules()
