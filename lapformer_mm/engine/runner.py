"""``SafeCheckpointRunner``: mmengine's ``Runner`` with safe checkpoint loading, saving and
resume. The runner, not ``configs/_base_/safe_runtime.py``, upgrades the checkpoint hook:
every codebase's runtime sets ``default_hooks``, and mmengine forbids a key in two bases."""
import os
import re

from mmengine.hooks import CheckpointHook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

from ..checkpoint import is_remote, load_checkpoint
from . import _mmengine_private as private

ATOMIC_BACKEND_ARGS = dict(backend='atomic_local')


def safe_checkpoint_hook_cfg(cfg):
    """The ``SafeCheckpointHook`` config for a ``CheckpointHook`` config, on the atomic backend
    where it writes locally and names none; anything else unchanged."""
    if not isinstance(cfg, dict) or cfg.get('type') not in ('CheckpointHook', CheckpointHook):
        return cfg
    safe = dict(cfg, type='SafeCheckpointHook')
    names_backend = cfg.get('backend_args') is not None or cfg.get('file_client_args') is not None
    if not names_backend and not is_remote(cfg.get('out_dir') or ''):
        safe['backend_args'] = dict(ATOMIC_BACKEND_ARGS)
    return safe


_CHECKPOINT_NAME = re.compile(r'(?:epoch|iter)_(\d+)\.pth')


def _resumable_checkpoints(folder):
    """``epoch_N.pth`` / ``iter_N.pth`` in ``folder``, by N (``best_*.pth`` hold no optimizer
    state)."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), os.path.getmtime(os.path.join(folder, name)), name)
             for name in os.listdir(folder)
             for m in [_CHECKPOINT_NAME.fullmatch(name)] if m]
    return [os.path.join(folder, name) for *_, name in sorted(found)]


def find_latest_checkpoint(path):
    """mmengine's ``find_latest_checkpoint`` that survives a ``last_checkpoint`` left empty or
    stale by a kill or a moved work dir: then, with a warning, the recorded name in ``path``,
    else the largest N beside the record, else in ``path``. None for a fresh start;
    ``FileNotFoundError`` for a record with nothing to resume from (not a silent restart)."""
    record = os.path.join(path, 'last_checkpoint')
    recorded = None
    if os.path.isfile(record):
        with open(record) as f:
            recorded = f.read().strip()
    if recorded and (is_remote(recorded) or os.path.exists(recorded)):
        return recorded
    reason = (f'{record} names {recorded}, which does not exist' if recorded else
              f'{record} is empty' if recorded == '' else f'there is no {record}')
    name = os.path.basename(recorded) if recorded else ''
    moved = os.path.join(path, name)
    if _CHECKPOINT_NAME.fullmatch(name) and os.path.exists(moved):
        print_log(f'{reason} (the work dir was moved?); resuming from {moved}',
                  logger='current', level=30)
        return moved
    folders = list(dict.fromkeys([os.path.dirname(recorded), path] if recorded else [path]))
    candidates = next(filter(None, map(_resumable_checkpoints, folders)), [])
    if not candidates:
        if recorded is None:
            return None
        where = ' nor '.join(folders)
        raise FileNotFoundError(
            f'{reason}, and {"neither " if len(folders) > 1 else ""}{where} holds no '
            'epoch_N.pth or iter_N.pth to resume from '
            "(checkpoints saved with CheckpointHook's out_dir are in out_dir/<work_dir name>: "
            'pass that file to --resume)')
    print_log(f'{reason} (a run killed while checkpointing?); resuming from the latest '
              f'checkpoint, {candidates[-1]}', logger='current', level=30)
    return candidates[-1]


@RUNNERS.register_module()
class SafeCheckpointRunner(Runner):
    """``Runner`` whose checkpoints survive a kill and whose loads refuse code-running pickles
    (:func:`~lapformer_mm.checkpoint.load_checkpoint`, :func:`find_latest_checkpoint`,
    :class:`~lapformer_mm.engine.hooks.SafeCheckpointHook`)."""

    def register_default_hooks(self, hooks=None):
        hooks = dict(hooks or {})
        hooks['checkpoint'] = safe_checkpoint_hook_cfg(
            hooks.get('checkpoint', dict(type='CheckpointHook', interval=1)))
        super().register_default_hooks(hooks)

    def load_or_resume(self):
        if private.auto_resume_pending(self):
            latest = find_latest_checkpoint(self.work_dir)
            # None is a fresh start: mmengine's own lookup then finds nothing too, and logs it.
            if latest is not None:
                private.set_resume_path(self, latest)
        super().load_or_resume()

    def load_checkpoint(self, filename, map_location='cpu', strict=False,
                        revise_keys=[(r'^module.', '')]):
        # mmengine's Runner.load_checkpoint with safe_load for local files; the rest is its.
        checkpoint = load_checkpoint(filename, map_location=map_location)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        model = self.model.module if is_model_wrapper(self.model) else self.model
        checkpoint = private.load_checkpoint_to_model(model, checkpoint, strict, revise_keys)
        private.mark_loaded(self)
        self.logger.info(f'Load checkpoint from {filename}')
        return checkpoint
