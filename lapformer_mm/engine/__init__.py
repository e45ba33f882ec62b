"""Opt-in engine parts, inactive until a config selects them: ``SafeCheckpointRunner``,
``SafeCheckpointHook``, the ``atomic_local`` file backend, ``CPUAmpOptimWrapper`` and
``InputCheckHook``."""
from .amp import CPUAmpOptimWrapper
from .fileio import AtomicLocalBackend, atomic_write_bytes
from .hooks import InputCheckHook, SafeCheckpointHook
from .runner import SafeCheckpointRunner, find_latest_checkpoint

__all__ = ['AtomicLocalBackend', 'CPUAmpOptimWrapper', 'InputCheckHook', 'SafeCheckpointHook',
           'SafeCheckpointRunner', 'atomic_write_bytes', 'find_latest_checkpoint']
