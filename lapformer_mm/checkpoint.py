"""Checkpoint loading that keeps ``torch.load(weights_only=True)`` on.

torch >= 2.6 refuses the few non-tensor objects mmengine writes into full checkpoints
(``HistoryBuffer``, numpy arrays, scalars, dtypes); :func:`allow_mmengine_checkpoints` adds
exactly those to torch's allowlist rather than turning the safety off. ``HistoryBuffer``
pickles its statistics as ``getattr(HistoryBuffer, 'min')``; allowing ``builtins.getattr``
itself would reach any module's globals, so a restricted ``getattr`` takes its name.
"""
import os
import warnings
import zipfile

import numpy as np
import torch

TRUST_ENV = 'TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD'
TRUST_HINT = (
    'Only if you trust the file, load it without the safety for one run with '
    f'`{TRUST_ENV}=1`, or re-save its tensors as a plain state dict.')


# torch.save writes a zip archive; files of torch < 1.6 (and plain pickles) start with
# pickle's PROTO opcode.
CHECKPOINT_MAGIC = (b'PK\x03\x04', b'\x80')


class CheckpointError(RuntimeError):
    """A checkpoint file refused as unsafe, or unreadable; the message names the file."""


def trust_requested():
    # torch honours its opt-out only where weights_only is not passed; the loaders here pass it.
    return os.environ.get(TRUST_ENV, '0').lower() in ('1', 'y', 'yes', 'true')


def _history_buffer_getattr(obj, name):
    from mmengine.logging import HistoryBuffer

    allowed = {'min', 'max', 'current', 'mean', *HistoryBuffer._statistics_methods}
    if obj is HistoryBuffer and name in allowed:
        return getattr(obj, name)
    raise torch.serialization.pickle.UnpicklingError(
        f'getattr({obj!r}, {name!r}) is not allowed in a checkpoint')


def _numpy_globals():
    """numpy's pickling globals under numpy 1's ``numpy.core`` and numpy 2's ``numpy._core``."""
    core = np._core if hasattr(np, '_core') else np.core
    scalar_dtypes = [type(np.dtype(t)) for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64)]
    spellings = [(obj, f'numpy.{module}.multiarray.{obj.__name__}')
                 for obj in (core.multiarray._reconstruct, core.multiarray.scalar)
                 for module in ('core', '_core')]
    return [np.ndarray, np.dtype, *spellings, *scalar_dtypes]


def allow_mmengine_checkpoints():
    """Allowlist the data types of mmengine full checkpoints (idempotent)."""
    safe = _numpy_globals()
    try:
        from mmengine.logging import HistoryBuffer
    except ImportError:
        pass
    else:
        safe += [HistoryBuffer,
                 (_history_buffer_getattr, 'builtins.getattr'),
                 (_history_buffer_getattr, '__builtin__.getattr')]
    torch.serialization.add_safe_globals(safe)


def safe_load(filename, map_location='cpu'):
    """``torch.load(weights_only=True)`` of a local file; errors name the file and what was
    refused or why it cannot be read."""
    _check_map_location(map_location)
    filename = os.path.expanduser(os.fspath(filename))
    if os.path.isdir(filename):
        raise IsADirectoryError(f'checkpoint {filename!r} is a folder, not a file')
    if not os.path.isfile(filename):
        raise FileNotFoundError(f'checkpoint file {filename!r} does not exist')
    if trust_requested():
        warnings.warn(f'{TRUST_ENV}=1: loading {filename!r} with full unpickling '
                      '(weights_only=False); only do this for files you trust')
        return torch.load(filename, map_location=map_location, weights_only=False)
    try:
        return torch.load(filename, map_location=map_location, weights_only=True)
    except torch.serialization.pickle.UnpicklingError as err:
        if 'Unsupported operand' in str(err) and not _looks_like_a_checkpoint(filename):
            raise _unreadable(filename, err) from err
        raise CheckpointError(
            f'Refused to load checkpoint {filename!r}: it contains objects that are not plain '
            f'weights, and unpickling them could run code. {TRUST_HINT}\n'
            f'Details: {_refusal_reason(err)}') from err
    except (OSError, RuntimeError, EOFError, KeyError, IndexError, ValueError) as err:
        raise _unreadable(filename, err) from err


def _check_map_location(map_location):
    # Inside the load a bad device string reads as an unreadable file; torch.device names it.
    if isinstance(map_location, str):
        torch.device(map_location)


def is_remote(path) -> bool:
    return '://' in os.fspath(path)


def load_checkpoint(filename, map_location='cpu'):
    """:func:`safe_load` of a local file; a ``scheme://`` path through mmengine's
    ``CheckpointLoader`` (whose ``torch.load`` defaults to ``weights_only`` since torch 2.6)."""
    if not is_remote(filename):
        return safe_load(filename, map_location=map_location)
    _check_map_location(map_location)
    from mmengine.runner import CheckpointLoader
    return CheckpointLoader.load_checkpoint(os.fspath(filename), map_location=map_location)


def _looks_like_a_checkpoint(filename):
    # Then an opcode the safe loader lacks (pickle protocols 4, 5) is a refusal, not other bytes.
    with open(filename, 'rb') as f:
        return f.read(4).startswith(CHECKPOINT_MAGIC)


def _unreadable(filename, err):
    # A truncated zip (a save killed mid-write) surfaces as EINVAL or a PytorchStreamReader
    # error, a file of other bytes as a KeyError, an IndexError (a config file: 'a' pops an
    # empty stack) or an unknown pickle opcode: none names the file or the cause.
    detail = str(err).strip().splitlines()
    detail = next((line.strip() for line in detail if 'Unsupported operand' in line),
                  detail[0] if detail else '')
    if zipfile.is_zipfile(filename):  # a whole archive, so torch failed on something else
        return CheckpointError(f'checkpoint file {filename!r} cannot be loaded '
                               f'({type(err).__name__}: {detail})')
    return CheckpointError(
        f'checkpoint file {filename!r} cannot be read as a torch checkpoint '
        f'({type(err).__name__}: {detail}); it is truncated (a save that was '
        'interrupted?) or not a checkpoint')


def _refusal_reason(err):
    lines = str(err).splitlines()
    reasons = [line.strip() for line in lines if 'GLOBAL' in line]
    return reasons[0] if reasons else (lines[0] if lines else repr(err))
