"""Opt-in engine parts, registered in mmengine's root registries when this package is imported.

Nothing here is active until a config selects it:

- ``runner_type='SafeCheckpointRunner'`` (RUNNERS): safe loading, resilient auto-resume,
  and the two parts below for its checkpoint hook;
- ``default_hooks.checkpoint.type='SafeCheckpointHook'`` (HOOKS): rotation that deletes the
  outdated checkpoint last;
- ``backend_args=dict(backend='atomic_local')`` (mmengine's fileio backends): atomic writes;
- ``optim_wrapper.type='CPUAmpOptimWrapper'`` (OPTIM_WRAPPERS): mixed precision on CPU;
- ``custom_hooks=[dict(type='InputCheckHook')]`` (HOOKS): the run's inputs checked when it
  starts (:mod:`lapformer_mm.preflight`).
"""
from .amp import CPUAmpOptimWrapper
from .fileio import AtomicLocalBackend, atomic_write_bytes
from .hooks import InputCheckHook, SafeCheckpointHook
from .runner import SafeCheckpointRunner, find_latest_checkpoint

__all__ = ['AtomicLocalBackend', 'CPUAmpOptimWrapper', 'InputCheckHook', 'SafeCheckpointHook',
           'SafeCheckpointRunner', 'atomic_write_bytes', 'find_latest_checkpoint']
