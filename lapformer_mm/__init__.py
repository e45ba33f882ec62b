"""LaplacianFormer for OpenMMLab: Laplacian-kernel linear attention backbones.

``import lapformer_mm``

- registers ``LaplacianFormer`` in the mmdet, mmseg and mmpretrain ``MODELS`` registries
  that are installed;
- allowlists mmengine's checkpoint contents for ``torch.load(weights_only=True)`` and
  routes mmengine's local checkpoint loads (``load_from``, ``--resume``, ``tools/test.py``)
  through :func:`lapformer_mm.checkpoint.safe_load`, which refuses code-running pickles
  with a message that says how to allow a trusted file;
- makes mmengine write local files (checkpoints) atomically, delete the checkpoint that
  falls out of ``max_keep_ckpts`` only after the new one is recorded, and auto-resume
  from the latest ``epoch_N``/``iter_N`` checkpoint when ``last_checkpoint`` is empty or
  stale, so a run killed mid-save keeps its previous checkpoint and ``--resume`` finds it.

``lapformer_mm.ops`` needs only torch (and CuPy on GPU); without mmengine the steps above
that concern it are skipped.
"""
from .checkpoint import (allow_mmengine_checkpoints, enable_atomic_checkpoint_save,
                         enable_safe_checkpoint_rotation, install_safe_local_loader)
from .registry import register_modules

__version__ = '0.1.0'

allow_mmengine_checkpoints()
install_safe_local_loader()
enable_atomic_checkpoint_save()
enable_safe_checkpoint_rotation()
register_modules()
