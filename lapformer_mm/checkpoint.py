"""Checkpoint loading that keeps ``torch.load(weights_only=True)`` on.

PyTorch >= 2.6 loads with ``weights_only=True`` by default, which refuses the few
non-tensor objects that mmengine writes into its full checkpoints (resume, ``load_from``,
``tools/test.py``): the message hub's ``HistoryBuffer``, numpy arrays, scalars and dtypes.
Turning the safety off for everything would let any downloaded ``.pth`` run code when it is
unpickled. Instead, :func:`allow_mmengine_checkpoints` adds exactly those data types to
torch's allowlist, so mmengine's own ``torch.load`` calls keep working and a pickle that
reaches for ``os.system`` or ``eval`` is still refused.

``HistoryBuffer`` pickles its statistics methods as ``getattr(HistoryBuffer, 'min')``;
allowing ``builtins.getattr`` itself would open the door again (attribute walks reach any
module's globals), so a ``getattr`` that resolves only those method names is registered
under its pickled name instead.
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
    """True when the user set torch's opt-out ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``: torch honours
    it only where ``weights_only`` is not passed, and the loaders here pass it."""
    return os.environ.get(TRUST_ENV, '0').lower() in ('1', 'y', 'yes', 'true')


def _history_buffer_getattr(obj, name):
    """``getattr`` restricted to the statistics methods of mmengine's ``HistoryBuffer``."""
    from mmengine.logging import HistoryBuffer

    allowed = {'min', 'max', 'current', 'mean', *HistoryBuffer._statistics_methods}
    if obj is HistoryBuffer and name in allowed:
        return getattr(obj, name)
    raise torch.serialization.pickle.UnpicklingError(
        f'getattr({obj!r}, {name!r}) is not allowed in a checkpoint')


def _numpy_globals():
    """numpy's array, dtype and scalar pickling globals under both module spellings: numpy 2
    pickles them from ``numpy._core.multiarray``, numpy 1 from ``numpy.core.multiarray``."""
    core = np._core if hasattr(np, '_core') else np.core
    scalar_dtypes = [type(np.dtype(t)) for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64)]
    spellings = [(obj, f'numpy.{module}.multiarray.{obj.__name__}')
                 for obj in (core.multiarray._reconstruct, core.multiarray.scalar)
                 for module in ('core', '_core')]
    return [np.ndarray, np.dtype, *spellings, *scalar_dtypes]


def allow_mmengine_checkpoints():
    """Allowlist the data types of mmengine full checkpoints for ``weights_only`` loading
    (idempotent)."""
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
    """``torch.load`` of a local file with ``weights_only=True``: FileNotFoundError,
    IsADirectoryError, or a :class:`CheckpointError` that names the file and what was refused
    (objects outside the allowlist) or why it cannot be read."""
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
    # The allowlist is in place: importing this module ran lapformer_mm/__init__.py.
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
    """A device string torch cannot parse fails inside the load as if the file could not be
    read: checked before it (torch.device names the string)."""
    if isinstance(map_location, str):
        torch.device(map_location)


def is_remote(path) -> bool:
    """True for a ``scheme://`` path (http(s), s3, petrel, open-mmlab, ...), not a local file."""
    return '://' in os.fspath(path)


def load_checkpoint(filename, map_location='cpu'):
    """A checkpoint from a local file (:func:`safe_load`) or a ``scheme://`` path, http(s)
    included, through mmengine's ``CheckpointLoader``, as its ``Runner`` and ``Pretrained``
    init read them. Its loaders call ``torch.load`` without ``weights_only``: True since
    torch 2.6, with this module's allowlist."""
    if not is_remote(filename):
        return safe_load(filename, map_location=map_location)
    _check_map_location(map_location)
    from mmengine.runner import CheckpointLoader
    return CheckpointLoader.load_checkpoint(os.fspath(filename), map_location=map_location)


def _looks_like_a_checkpoint(filename):
    """A zip archive (torch.save) or a pickle (the legacy format): an opcode the safe
    loader lacks (pickle protocols 4 and 5) is then a refusal, not a file of other bytes."""
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
    """The line of torch's weights-only error that names the refused object."""
    lines = str(err).splitlines()
    reasons = [line.strip() for line in lines if 'GLOBAL' in line]
    return reasons[0] if reasons else (lines[0] if lines else repr(err))
