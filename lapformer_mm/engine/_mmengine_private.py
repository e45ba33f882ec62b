"""The mmengine internals that :mod:`lapformer_mm.engine` relies on, in one place.

mmengine 0.10 has no public way to reorder ``CheckpointHook``'s rotation, to change where
the ``Runner``'s auto-resume looks, or to load a checkpoint dict into a model the way
``Runner.load_checkpoint`` does. Everything that reaches past mmengine's public API goes
through this module, and :data:`PINNED` records the source each piece was written
against: ``tests/engine/test_mmengine_private.py`` fails when mmengine changes any of
them, so an upgrade is reviewed here rather than discovered as a silent misbehaviour.
"""
import hashlib
import inspect

from mmengine.hooks import CheckpointHook
from mmengine.runner import BaseLoop, Runner
from mmengine.runner.checkpoint import _load_checkpoint_to_model

# sha256 (first 16 hex digits) of ``inspect.getsource`` in mmengine 0.10.7.
PINNED = {
    # SafeCheckpointHook overrides _save_checkpoint_with_step (called by _save_checkpoint
    # and _save_best_checkpoint) and uses the attributes before_train sets.
    'mmengine.hooks.CheckpointHook': (CheckpointHook, '807f46f28b4a580c'),
    # SafeCheckpointRunner.load_or_resume sets _load_from before this runs.
    'mmengine.runner.Runner.load_or_resume': (Runner.load_or_resume, '9c653d074f921631'),
    # SafeCheckpointRunner.load_checkpoint repeats this with another loader; resume
    # reaches the loader through it.
    'mmengine.runner.Runner.load_checkpoint': (Runner.load_checkpoint, 'bebf88cd7097d2f1'),
    'mmengine.runner.Runner.resume': (Runner.resume, '30cc2d3b4e1afabd'),
    'mmengine.runner.checkpoint._load_checkpoint_to_model':
        (_load_checkpoint_to_model, 'e97ceb7819af8c87'),
    # InputCheckHook tells a training run by its built loop: train() builds its loops
    # before before_run and initialises the model's weights after it.
    'mmengine.runner.Runner.train': (Runner.train, '98de231f177d0396'),
}


def source_digest(obj):
    """First 16 hex digits of the sha256 of ``obj``'s source code."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def load_checkpoint_to_model(model, checkpoint, strict, revise_keys):
    """Load the state dict of a loaded ``checkpoint`` into ``model`` as mmengine's Runner does
    (``revise_keys`` rewrites the keys, e.g. strips ``module.``)."""
    return _load_checkpoint_to_model(model, checkpoint, strict, revise_keys=revise_keys)


def auto_resume_pending(runner):
    """True when ``runner`` was asked to resume without a path and has not loaded yet."""
    return runner._resume and runner._load_from is None and not runner._has_loaded


def set_resume_path(runner, path):
    """Make ``runner``'s ``load_or_resume`` resume from ``path``."""
    runner._load_from = path


def mark_loaded(runner):
    """Record that ``runner`` has loaded a checkpoint (``load_or_resume`` then does nothing)."""
    runner._has_loaded = True


def built_loops(runner):
    """The loops ('train', 'val', 'test') that ``runner`` has built so far, in that order."""
    return [name for name in ('train', 'val', 'test')
            if isinstance(getattr(runner, f'_{name}_loop', None), BaseLoop)]
