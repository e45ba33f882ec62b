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
import functools
import os
import re
import warnings

import numpy as np
import torch

TRUST_ENV = 'TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD'
TRUST_HINT = (
    'Only if you trust the file, load it without the safety for one run with '
    f'`{TRUST_ENV}=1`, or re-save its tensors as a plain state dict.')


def trust_requested():
    """True when the user set torch's opt-out ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` to a true value.

    torch itself honours the variable only where ``weights_only`` is not passed; the
    loaders here pass it, so they read the variable themselves to keep one switch.
    """
    return os.environ.get(TRUST_ENV, '0').lower() in ('1', 'y', 'yes', 'true')


def _history_buffer_getattr(obj, name):
    """``getattr`` restricted to the statistics methods of mmengine's ``HistoryBuffer``."""
    from mmengine.logging import HistoryBuffer

    allowed = {'min', 'max', 'current', 'mean', *HistoryBuffer._statistics_methods}
    if obj is HistoryBuffer and name in allowed:
        return getattr(obj, name)
    raise pickle_error(f'getattr({obj!r}, {name!r}) is not allowed in a checkpoint')


def pickle_error(message):
    return torch.serialization.pickle.UnpicklingError(message)


def _numpy_globals():
    core = np._core if hasattr(np, '_core') else np.core
    scalar_dtypes = [type(np.dtype(t)) for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64)]
    return [np.ndarray, np.dtype, core.multiarray._reconstruct, core.multiarray.scalar,
            *scalar_dtypes]


def allow_mmengine_checkpoints():
    """Allowlist the data types of mmengine full checkpoints for ``weights_only`` loading.

    Idempotent. A no-op on torch versions without ``add_safe_globals`` (< 2.4), which also
    do not default to ``weights_only=True``.
    """
    if not hasattr(torch.serialization, 'add_safe_globals'):
        return
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
    """``torch.load`` with ``weights_only=True`` and an error that says what was refused.

    Args:
        filename (str | os.PathLike): a local checkpoint file.
        map_location: as for :func:`torch.load`.

    Returns:
        The loaded object (a state dict or an mmengine checkpoint dict).

    Raises:
        FileNotFoundError: ``filename`` does not exist.
        RuntimeError: the file needs unpickling of objects outside the allowlist, or it
            is truncated or not a torch checkpoint.
    """
    filename = os.path.expanduser(os.fspath(filename))
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
        raise RuntimeError(
            f'Refused to load checkpoint {filename!r}: it contains objects that are not plain '
            f'weights, and unpickling them could run code. {TRUST_HINT}\n'
            f'Details: {_refusal_reason(err)}') from err
    except (OSError, RuntimeError, EOFError) as err:
        # A truncated zip (a save killed mid-write) surfaces as EINVAL or a
        # PytorchStreamReader error that names neither the file nor the cause.
        raise RuntimeError(
            f'checkpoint file {filename!r} cannot be read as a torch checkpoint '
            f'({type(err).__name__}: {err}); it is truncated (a save that was '
            'interrupted?) or not a checkpoint') from err


def _refusal_reason(err):
    """The line of torch's weights-only error that names the refused object."""
    lines = str(err).splitlines()
    reasons = [line.strip() for line in lines if 'GLOBAL' in line]
    return reasons[0] if reasons else (lines[0] if lines else repr(err))


def atomic_write_bytes(data, filepath):
    """Write ``data`` to ``filepath`` so that a reader sees the old file or the whole new one.

    The bytes go to a temporary file in the same directory, are flushed and fsynced, and
    then renamed over ``filepath`` (``os.replace`` is atomic on POSIX and Windows within
    one file system). A process killed mid-write leaves only a stray ``.tmp`` file.
    """
    filepath = os.fspath(filepath)
    directory = os.path.dirname(os.path.abspath(filepath))
    os.makedirs(directory, exist_ok=True)
    tmp_path = os.path.join(directory,
                            f'.{os.path.basename(filepath)}.{os.getpid()}.tmp')
    try:
        with open(tmp_path, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, filepath)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


def _atomic_local_put(self, obj, filepath):
    """``LocalBackend.put`` through :func:`atomic_write_bytes`."""
    atomic_write_bytes(obj, filepath)


def enable_atomic_checkpoint_save():
    """Make mmengine write local checkpoints atomically (write to a temp file, then rename).

    mmengine's ``save_checkpoint`` serialises into memory and hands the bytes to
    ``LocalBackend.put``, which opens the final path with ``'wb'`` and writes in place: a
    run killed during the write (SIGKILL, OOM killer, preemption) leaves a truncated
    ``epoch_N.pth`` that ``--resume`` then fails to read. This replaces
    ``LocalBackend.put`` (used for every local file mmengine writes through its file
    backends, checkpoints included) with :func:`atomic_write_bytes`. Idempotent.

    Returns:
        bool: True when the patch is in place (False without mmengine).
    """
    try:
        from mmengine.fileio.backends.local_backend import LocalBackend
    except ImportError:
        return False
    LocalBackend.put = _atomic_local_put
    return True


class _DeferredRemovals:
    """A file backend whose ``remove``/``rmtree`` are recorded, to be run by :meth:`apply`."""

    def __init__(self, backend):
        self._backend = backend
        self._pending = []

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def remove(self, filepath):
        self._pending.append((self._backend.remove, filepath))

    def rmtree(self, dir_path):
        self._pending.append((self._backend.rmtree, dir_path))

    def apply(self):
        for remove, path in self._pending:
            remove(path)


def _prune_after_save(save_with_step):
    """Wrap ``CheckpointHook._save_checkpoint_with_step`` to delete outdated checkpoints last.

    mmengine deletes the checkpoint that falls out of ``max_keep_ckpts`` *before* it writes
    the new one and ``last_checkpoint``: a run killed in between (with
    ``max_keep_ckpts=1``) is left with no checkpoint at all, or a ``last_checkpoint`` that
    names a deleted file. Deferred, the old file goes only once the new one and the record
    are on disk; a failed save deletes nothing.
    """
    @functools.wraps(save_with_step)
    def save(self, runner, step, meta):
        backend = self.file_backend
        deferred = _DeferredRemovals(backend)
        self.file_backend = deferred
        try:
            save_with_step(self, runner, step, meta)
        finally:
            self.file_backend = backend
        deferred.apply()

    save.prunes_after_save = True
    return save


_CHECKPOINT_NAME = re.compile(r'(?:epoch|iter)_(\d+)\.pth')


def _resumable_checkpoints(folder):
    """``epoch_N.pth`` / ``iter_N.pth`` in ``folder`` (files, or DeepSpeed's directories), oldest
    first by N. ``best_*.pth`` and other weights are left out: they hold no optimizer state."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), os.path.getmtime(os.path.join(folder, name)), name)
             for name in os.listdir(folder)
             for m in [_CHECKPOINT_NAME.fullmatch(name)] if m]
    return [os.path.join(folder, name) for *_, name in sorted(found)]


def find_latest_checkpoint(path):
    """mmengine's ``find_latest_checkpoint`` that survives a run killed while checkpointing.

    The ``last_checkpoint`` record in ``path`` is rewritten in place after each save, so a kill
    can leave it empty, or missing next to a checkpoint that was already written. Then the
    ``epoch_N.pth``/``iter_N.pth`` with the largest N beside the record (or in ``path``) is
    used, with a warning. Returns None when there is neither a record nor such a checkpoint
    (a fresh start, as in mmengine). Raises ``FileNotFoundError`` when there is a record but
    nothing to resume from, rather than silently training from scratch.
    """
    from mmengine.logging import print_log
    record = os.path.join(path, 'last_checkpoint')
    recorded = None
    if os.path.isfile(record):
        with open(record) as f:
            recorded = f.read().strip()
    if recorded and ('://' in recorded or os.path.exists(recorded)):
        return recorded
    folder = os.path.dirname(recorded) if recorded else path
    candidates = _resumable_checkpoints(folder)
    if not candidates:
        if recorded is None:
            print_log('Did not find last_checkpoint to be resumed.')
            return None
        state = f'names {recorded}, which does not exist' if recorded else 'is empty'
        raise FileNotFoundError(
            f'{record} {state}, and {folder} holds no epoch_N.pth or iter_N.pth to resume from '
            "(checkpoints saved with CheckpointHook's out_dir are in out_dir/<work_dir name>: "
            'pass that file to --resume)')
    reason = (f'{record} names {recorded}, which does not exist' if recorded else
              f'{record} is empty' if recorded == '' else f'there is no {record}')
    print_log(f'{reason} (a run killed while checkpointing?); resuming from the latest '
              f'checkpoint, {candidates[-1]}', logger='current', level=30)
    return candidates[-1]


def enable_safe_checkpoint_rotation():
    """Make mmengine's checkpoint rotation and auto-resume safe against a kill mid-save.

    :func:`_prune_after_save` orders ``CheckpointHook``'s save as write new, record, delete
    old (the ``max_keep_ckpts`` rotation; a replaced ``best_*.pth`` is still deleted first);
    :func:`find_latest_checkpoint` replaces the one ``Runner``, ``FlexibleRunner`` and the
    strategies use for ``--resume`` without a path. Idempotent; False without mmengine.
    """
    try:
        import mmengine.runner
        from mmengine.hooks import CheckpointHook
        from mmengine.runner import _flexible_runner, checkpoint, runner
    except ImportError:
        return False
    if not getattr(CheckpointHook._save_checkpoint_with_step, 'prunes_after_save', False):
        CheckpointHook._save_checkpoint_with_step = _prune_after_save(
            CheckpointHook._save_checkpoint_with_step)
    # Runner, FlexibleRunner and the strategies (which import it from mmengine.runner when
    # they resume) each look the function up by their own name.
    for module in (mmengine.runner, runner, _flexible_runner, checkpoint):
        module.find_latest_checkpoint = find_latest_checkpoint
    return True


def _load_from_local_safe(filename, map_location):
    """mmengine's local checkpoint loader, through :func:`safe_load`."""
    return safe_load(filename, map_location=map_location)


def install_safe_local_loader():
    """Route mmengine's local checkpoint loads (``load_from``, ``--resume``, ``tools/test.py``,
    ``Pretrained`` init of any module) through :func:`safe_load`.

    mmengine's own loader calls ``torch.load`` without ``weights_only``: torch >= 2.6 still
    refuses a code-running pickle, but with a message about ``torch.load`` arguments that
    a user of ``tools/test.py`` cannot pass. Through :func:`safe_load` the refusal names the
    file and says how to allow a trusted one. Idempotent; False without mmengine.
    """
    try:
        from mmengine.runner.checkpoint import CheckpointLoader
    except ImportError:
        return False
    CheckpointLoader.register_scheme(prefixes='', loader=_load_from_local_safe, force=True)
    return True
