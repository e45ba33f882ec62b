"""``SafeCheckpointHook``: mmengine's ``CheckpointHook`` with a rotation that survives a kill;
``InputCheckHook``: the run's inputs checked when it starts (:mod:`lapformer_mm.preflight`)."""
import os.path as osp

from mmengine.dist import is_main_process
from mmengine.hooks import CheckpointHook, Hook
from mmengine.registry import HOOKS

from ..preflight import check_config_inputs
from . import _mmengine_private as private
from .fileio import atomic_write_bytes


@HOOKS.register_module()
class SafeCheckpointHook(CheckpointHook):
    """``CheckpointHook`` that deletes an outdated checkpoint only after the new one is recorded
    (``last_checkpoint`` replaced atomically): mmengine's deletes first, so a run killed in
    between has no checkpoint, or a ``last_checkpoint`` naming a deleted one."""

    def _save_checkpoint_with_step(self, runner, step, meta):
        # mmengine's private method (pinned), with the deletion moved to the end.
        outdated = self._rotate(runner, step)
        ckpt_filename = self.filename_tmpl.format(step)
        self.last_ckpt = self.file_backend.join_path(self.out_dir, ckpt_filename)
        runner.message_hub.update_info('last_ckpt', self.last_ckpt)
        runner.save_checkpoint(
            self.out_dir,
            ckpt_filename,
            self.file_client_args,
            save_optimizer=self.save_optimizer,
            save_param_scheduler=self.save_param_scheduler,
            meta=meta,
            by_epoch=self.by_epoch,
            backend_args=self.backend_args,
            **self.args)
        # Sharded (model-parallel) saves run on every rank; the bookkeeping on one.
        if not is_main_process():
            return
        atomic_write_bytes(self.last_ckpt.encode(), osp.join(runner.work_dir, 'last_checkpoint'))
        if outdated is not None:
            self._remove(outdated)

    def _rotate(self, runner, step):
        """Record ``step`` among the kept checkpoints; return the path that falls out, if any
        (a second save of one step, the best checkpoint's, changes nothing)."""
        if self.max_keep_ckpts <= 0 or (self.keep_ckpt_ids and self.keep_ckpt_ids[-1] == step):
            return None
        outdated = None
        if len(self.keep_ckpt_ids) == self.max_keep_ckpts:
            outdated = self.file_backend.join_path(
                self.out_dir, self.filename_tmpl.format(self.keep_ckpt_ids.popleft()))
        self.keep_ckpt_ids.append(step)
        runner.message_hub.update_info('keep_ckpt_ids', list(self.keep_ckpt_ids))
        return outdated

    def _remove(self, path):
        # DeepSpeed saves directories.
        if self.file_backend.isfile(path):
            self.file_backend.remove(path)
        elif self.file_backend.isdir(path):
            self.file_backend.rmtree(path)


@HOOKS.register_module()
class InputCheckHook(Hook):
    """:func:`lapformer_mm.preflight.check_config_inputs` in ``before_run``. mmengine builds the
    datasets before any hook runs, so a missing annotation file fails first with mmdet's own
    error: ``tools/train.py`` and ``tools/test.py`` check before ``Runner.from_cfg``."""

    priority = 'VERY_HIGH'

    def before_run(self, runner) -> None:
        loops = private.built_loops(runner)
        mode = next((m for m in ('train', 'test', 'val') if m in loops), None)
        if mode is not None:
            check_config_inputs(runner.cfg, mode)
