"""LaplacianFormer for OpenMMLab. ``import lapformer_mm`` registers the backbone and the
engine parts in mmengine's root registries (none used until a config selects it), imports no
codebase, and lets ``torch.load(weights_only=True)`` read mmengine checkpoints."""
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
