"""Interrupted training loses nothing; a checkpoint is never left half-written.

Faults injected: SIGKILL of ``tools/train.py`` in the middle of an epoch and in the middle
of writing a checkpoint (the toy config, with ``configs/_base_/safe_runtime.py``), and
SIGKILL in the middle of writing a checkpoint file with mmengine's in-place write and with
the ``atomic_local`` backend. Stock mmengine (``Runner``, ``CheckpointHook``) is checked to
behave as it always did after ``import lapformer_mm``.
"""
import hashlib
import json
import os
import os.path as osp
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from _runner_helpers import make_runner
from _shared import ROOT, TOOLS, TOY_CONFIG, run_tool, tool_env, toy_data_options
from mmengine.runner import Runner

from lapformer_mm.checkpoint import safe_load
from lapformer_mm.engine import SafeCheckpointRunner, atomic_write_bytes, find_latest_checkpoint

# Shared by the two child processes below: a file write that the process does not survive.
DIES_MID_WRITE = '''
import os
import signal


def open_dying_mid_write(real_open, directory):
    """``open`` whose files opened for writing in ``directory`` SIGKILL the process halfway
    through their first write."""
    def open_(file, mode='r', *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        inside = os.path.dirname(os.path.abspath(str(file))) == os.path.abspath(directory)
        return DiesMidWrite(f) if inside and 'w' in mode else f
    return open_


class DiesMidWrite:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def write(self, data):
        self.f.write(data[:len(data) // 2])
        self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name):
        return getattr(self.f, name)
'''

PROBE = '''
import builtins
import hashlib
import json

import torch
from mmengine.hooks import Hook
from mmengine.registry import HOOKS


@HOOKS.register_module()
class ResumeProbeHook(Hook):
    """Dump what the run holds when training starts (after any resume)."""

    def __init__(self, out):
        self.out = out

    def before_train(self, runner):
        optimizer = runner.optim_wrapper.optimizer
        state = {str(i): {k: hashlib.sha256(torch.as_tensor(v).cpu().contiguous().numpy()
                                            .tobytes()).hexdigest() for k, v in s.items()}
                 for i, s in enumerate(optimizer.state_dict()['state'].values())}
        with open(self.out, 'w') as f:
            json.dump(dict(iter=runner.iter, epoch=runner.epoch,
                           lr=[g['lr'] for g in optimizer.param_groups], state=state), f)


@HOOKS.register_module()
class KillDuringSaveHook(Hook):
    """SIGKILL this process halfway through writing the checkpoint of epoch ``epoch``."""

    def __init__(self, epoch):
        self.epoch = epoch

    def before_save_checkpoint(self, runner, checkpoint):
        if checkpoint['meta']['epoch'] == self.epoch:
            builtins.open = open_dying_mid_write(builtins.open, runner.work_dir)
'''


def tensor_digest(t):
    """sha256 of a tensor's bytes: bit-exact comparison of optimizer state."""
    return hashlib.sha256(torch.as_tensor(t).cpu().contiguous().numpy().tobytes()).hexdigest()


def probe_env(base):
    """The tools' environment, with the probe hooks of ``base`` importable."""
    return dict(PYTHONPATH=os.pathsep.join([ROOT, base]))


@pytest.fixture(scope='module')
def run_setup(tmp_path_factory, toy_coco):
    """The toy data (8 train images: 4 steps of 2 per epoch), a probe hook and a config."""
    base = tmp_path_factory.mktemp('resume')
    root = toy_coco
    (base / 'relprobe.py').write_text(DIES_MID_WRITE + PROBE)
    config = base / 'toy_probe.py'
    config.write_text(textwrap.dedent(f'''\
        _base_ = ['{TOY_CONFIG}']
        custom_imports = dict(imports=['lapformer_mm', 'relprobe'], allow_failed_imports=False)
        custom_hooks = [dict(type='ResumeProbeHook', out='{base}/probe.json')]
        '''))
    (base / 'toy_kill_save.py').write_text(textwrap.dedent(f'''\
        _base_ = ['{config}']
        custom_hooks = [dict(type='KillDuringSaveHook', epoch=2)]
        '''))
    return str(base), root, str(config)


def options(root, max_epochs):
    # Every split points at the test's own data: a clean checkout has no data/toy_coco.
    return ['--cfg-options', *toy_data_options(root),
            'train_dataloader.dataset.pipeline.2.scale=(64,64)',
            'train_dataloader.batch_size=2', f'train_cfg.max_epochs={max_epochs}',
            'train_cfg.val_interval=100', 'default_hooks.checkpoint.interval=1',
            'default_hooks.checkpoint.max_keep_ckpts=3', 'default_hooks.logger.interval=1']


def logged_lrs(log):
    """{(epoch, step): 'lr' string} of the training log lines."""
    return {(int(e), int(s)): lr for e, s, lr in re.findall(
        r'Epoch\(train\)\s+\[(\d+)\]\[\s*(\d+)/\d+\].*?\slr: (\S+)', log)}


def kill_when_logged(proc, log_path, pattern, timeout=240):
    """SIGKILL ``proc`` as soon as ``pattern`` appears in its log; return the log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path) as f:
            log = f.read()
        if re.search(pattern, log):
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            return log
        assert proc.poll() is None, log[-3000:]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f'{pattern!r} never logged')


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_continues_exactly(run_setup):
    base, root, config = run_setup
    work = osp.join(base, 'work')
    log_path = osp.join(base, 'killed.log')
    with open(log_path, 'w') as log_file:
        proc = subprocess.Popen(
            [sys.executable, osp.join(TOOLS, 'train.py'), config, '--work-dir', work] +
            options(root, 3), cwd=ROOT, env=tool_env(probe_env(base)), stdout=log_file,
            stderr=subprocess.STDOUT)
        killed_log = kill_when_logged(proc, log_path, r'Epoch\(train\)\s+\[2\]\[\s*2/4\]')
    assert proc.returncode == -signal.SIGKILL
    assert sorted(f for f in os.listdir(work) if f.endswith('.pth')) == ['epoch_1.pth']
    with open(osp.join(work, 'last_checkpoint')) as f:
        assert f.read().strip().endswith('epoch_1.pth')
    saved = safe_load(osp.join(work, 'epoch_1.pth'))
    assert saved['meta']['iter'] == 4 and saved['meta']['epoch'] == 1

    log = run_tool(
        [sys.executable, osp.join(TOOLS, 'train.py'), config, '--work-dir', work, '--resume'] +
        options(root, 2), extra_env=probe_env(base), timeout=300)
    assert 'resumed epoch: 1, iter: 4' in log
    assert 'Epoch(train) [1]' not in log

    with open(osp.join(base, 'probe.json')) as f:
        probe = json.load(f)
    assert (probe['iter'], probe['epoch']) == (4, 1)
    assert probe['lr'] == [g['lr'] for g in saved['optimizer']['param_groups']]
    expected_state = {str(i): {k: tensor_digest(v) for k, v in s.items()}
                      for i, s in enumerate(saved['optimizer']['state'].values())}
    assert probe['state'] == expected_state and expected_state

    killed, resumed = logged_lrs(killed_log), logged_lrs(log)
    assert killed[(2, 1)] == resumed[(2, 1)] and killed[(2, 2)] == resumed[(2, 2)]
    assert sorted(resumed) == [(2, 1), (2, 2), (2, 3), (2, 4)]
    assert safe_load(osp.join(work, 'epoch_2.pth'))['meta']['iter'] == 8


@pytest.mark.slow
def test_sigkill_while_saving_keeps_the_previous_checkpoint_and_resume_continues(run_setup):
    """max_keep_ckpts=1, killed halfway through writing epoch_2.pth: epoch_1.pth, which stock
    mmengine deletes first, is intact and recorded, and --resume trains epoch 2 again."""
    base, root, config = run_setup
    work = osp.join(base, 'work_kill_save')
    one_kept = ['default_hooks.checkpoint.max_keep_ckpts=1']
    log = run_tool(
        [sys.executable, osp.join(TOOLS, 'train.py'), osp.join(base, 'toy_kill_save.py'),
         '--work-dir', work] + options(root, 2) + one_kept,
        extra_env=probe_env(base), timeout=300, returncode=-signal.SIGKILL)
    assert 'SafeCheckpointHook' in log
    assert sorted(f for f in os.listdir(work) if f.endswith('.pth')) == ['epoch_1.pth']
    with open(osp.join(work, 'last_checkpoint')) as f:
        assert f.read() == osp.join(work, 'epoch_1.pth')
    assert safe_load(osp.join(work, 'epoch_1.pth'))['meta']['iter'] == 4

    log = run_tool(
        [sys.executable, osp.join(TOOLS, 'train.py'), config, '--work-dir', work, '--resume'] +
        options(root, 2) + one_kept, extra_env=probe_env(base), timeout=300)
    assert 'resumed epoch: 1, iter: 4' in log
    assert sorted(f for f in os.listdir(work) if f.endswith('.pth')) == ['epoch_2.pth']
    assert safe_load(osp.join(work, 'epoch_2.pth'))['meta']['iter'] == 8


KILL_DURING_SAVE = DIES_MID_WRITE + '''
import builtins, sys

import torch
from mmengine.runner.checkpoint import save_checkpoint

import lapformer_mm  # noqa: F401  (mmengine's own write must stay as it was)

mode, path = sys.argv[1], sys.argv[2]
backend_args = dict(backend='atomic_local') if mode == 'atomic' else None
save_checkpoint({'state_dict': {'w': torch.zeros(4096)}, 'meta': {'epoch': 1}}, path,
                backend_args=backend_args)

builtins.open = open_dying_mid_write(builtins.open, os.path.dirname(path))
save_checkpoint({'state_dict': {'w': torch.ones(4096)}, 'meta': {'epoch': 2}}, path,
                backend_args=backend_args)
'''


def kill_during_save(tmp_path, mode):
    script = tmp_path / 'kill_during_save.py'
    script.write_text(KILL_DURING_SAVE)
    path = str(tmp_path / 'ckpt' / 'latest.pth')
    run_tool([sys.executable, script, mode, path], timeout=120, returncode=-signal.SIGKILL)
    return path


def test_mmengine_in_place_save_killed_mid_write_corrupts_the_file(tmp_path):
    """Why the atomic backend exists: mmengine's default, unchanged by ``import lapformer_mm``,
    truncates the old file first."""
    path = kill_during_save(tmp_path, 'in_place')
    with pytest.raises(RuntimeError, match='latest.pth.* cannot be read .* truncated'):
        safe_load(path)


def test_atomic_save_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    path = kill_during_save(tmp_path, 'atomic')
    checkpoint = safe_load(path)
    assert checkpoint['meta']['epoch'] == 1
    assert torch.equal(checkpoint['state_dict']['w'], torch.zeros(4096))
    leftovers = [f for f in os.listdir(osp.dirname(path)) if f != 'latest.pth']
    assert len(leftovers) == 1 and leftovers[0].endswith('.tmp')


def test_atomic_write_replaces_whole_file_and_cleans_up_on_error(tmp_path):
    target = tmp_path / 'sub' / 'f.bin'
    atomic_write_bytes(b'old', target)
    atomic_write_bytes(b'new contents', target)
    assert target.read_bytes() == b'new contents'

    class Unwritable:
        def __len__(self):
            return 1

    with pytest.raises(TypeError):
        atomic_write_bytes(Unwritable(), target)
    assert target.read_bytes() == b'new contents'
    assert os.listdir(target.parent) == ['f.bin']


def test_safe_runner_checkpoints_atomically(tmp_path):
    """A whole run with SafeCheckpointRunner: its CheckpointHook became SafeCheckpointHook on
    the atomic backend; checkpoints load and no temporary file remains."""
    from lapformer_mm.engine import AtomicLocalBackend, SafeCheckpointHook

    runner = make_runner(tmp_path, 2, num_samples=4, runner_cls=SafeCheckpointRunner)
    runner.train()
    hook, = [h for h in runner.hooks if isinstance(h, SafeCheckpointHook)]
    assert isinstance(hook.file_backend, AtomicLocalBackend)
    assert safe_load(tmp_path / 'epoch_2.pth')['meta']['iter'] == 4
    assert not [f for f in os.listdir(tmp_path) if f.endswith('.tmp')]


def test_safe_runner_keeps_a_chosen_backend_and_other_hook_types(tmp_path):
    from mmengine.hooks import CheckpointHook

    from lapformer_mm.engine.runner import safe_checkpoint_hook_cfg
    local = dict(type='CheckpointHook', interval=2, backend_args=dict(backend='local'))
    assert safe_checkpoint_hook_cfg(local) == dict(local, type='SafeCheckpointHook')
    remote = dict(type=CheckpointHook, out_dir='s3://bucket/run')
    assert safe_checkpoint_hook_cfg(remote) == dict(remote, type='SafeCheckpointHook')
    other = dict(type='MyCheckpointHook')
    assert safe_checkpoint_hook_cfg(other) is other
    assert safe_checkpoint_hook_cfg(None) is None


@pytest.mark.parametrize('runner_cls, kept',
                         [(Runner, []), (SafeCheckpointRunner, ['epoch_1.pth'])])
def test_save_failing_mid_rotation(tmp_path, runner_cls, kept):
    """max_keep_ckpts=1 and the save of epoch 2 fails. Stock mmengine (unchanged by the import)
    has already deleted epoch_1.pth, which last_checkpoint still names: nothing to resume
    from. SafeCheckpointRunner keeps epoch_1.pth."""
    runner = make_runner(tmp_path, 2, num_samples=4, checkpoint=dict(max_keep_ckpts=1),
                         runner_cls=runner_cls)
    save = runner.save_checkpoint

    def dies_at_epoch_2(out_dir, filename, *args, **kwargs):
        if filename == 'epoch_2.pth':
            raise KeyboardInterrupt('killed while saving epoch 2')
        return save(out_dir, filename, *args, **kwargs)

    runner.save_checkpoint = dies_at_epoch_2
    with pytest.raises(KeyboardInterrupt):
        runner.train()
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith('.pth')) == kept
    assert (tmp_path / 'last_checkpoint').read_text() == str(tmp_path / 'epoch_1.pth')


def test_safe_rotation_still_keeps_max_keep_ckpts(tmp_path):
    make_runner(tmp_path, 3, num_samples=4, checkpoint=dict(max_keep_ckpts=2),
                runner_cls=SafeCheckpointRunner).train()
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith('.pth')) == [
        'epoch_2.pth', 'epoch_3.pth']


def write_checkpoints(folder, names):
    folder.mkdir(exist_ok=True)
    for age, name in enumerate(names):
        (folder / name).write_bytes(b'x')
        os.utime(folder / name, (1_000_000 + age, 1_000_000 + age))


@pytest.mark.parametrize('record', [None, '', 'epoch_11.pth'])
def test_auto_resume_falls_back_to_the_checkpoint_with_the_largest_step(tmp_path, record):
    """Largest N, not newest file: a best_*.pth (no optimizer state) or a copied file is
    newer, and is not a checkpoint to resume from."""
    write_checkpoints(tmp_path, ['epoch_2.pth', 'epoch_10.pth', 'epoch_3.pth',
                                 'best_coco_bbox_mAP_epoch_3.pth', 'pretrained.pth'])
    if record is not None:
        (tmp_path / 'last_checkpoint').write_text(record and str(tmp_path / record))
    assert find_latest_checkpoint(str(tmp_path)) == str(tmp_path / 'epoch_10.pth')


def test_auto_resume_uses_an_intact_record_and_starts_fresh_on_an_empty_dir(tmp_path):
    write_checkpoints(tmp_path, ['epoch_1.pth', 'epoch_2.pth'])
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / 'epoch_1.pth') + '\n')
    assert find_latest_checkpoint(str(tmp_path)) == str(tmp_path / 'epoch_1.pth')
    assert find_latest_checkpoint(str(tmp_path / 'nothing_here')) is None


def test_auto_resume_accepts_a_recorded_checkpoint_directory(tmp_path):
    """DeepSpeed saves a checkpoint as a directory named like the file."""
    (tmp_path / 'iter_8.pth').mkdir()
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / 'iter_8.pth'))
    assert find_latest_checkpoint(str(tmp_path)) == str(tmp_path / 'iter_8.pth')


@pytest.mark.parametrize('record, message', [
    ('epoch_4.pth', 'epoch_4.pth, which does not exist'),
    ('', 'last_checkpoint is empty'),
])
def test_auto_resume_refuses_a_record_with_nothing_to_resume_from(tmp_path, record, message):
    """A record exists only after a save, so a fresh start would silently lose the run
    (e.g. checkpoints written to CheckpointHook's out_dir, not beside the record)."""
    write_checkpoints(tmp_path, ['best_coco_bbox_mAP_epoch_3.pth'])
    (tmp_path / 'last_checkpoint').write_text(record and str(tmp_path / record))
    with pytest.raises(FileNotFoundError, match=f"{message}.*out_dir"):
        find_latest_checkpoint(str(tmp_path))


def test_safe_runner_resumes_past_an_empty_last_checkpoint(tmp_path):
    """SafeCheckpointRunner's auto-resume continues, not restarts: the first two epochs'
    checkpoints are not written again."""
    make_runner(tmp_path, 2, num_samples=4).train()
    (tmp_path / 'last_checkpoint').write_text('')
    written = {n: os.stat(tmp_path / n).st_mtime_ns for n in ('epoch_1.pth', 'epoch_2.pth')}
    runner = make_runner(tmp_path, 3, num_samples=4, resume=True,
                         runner_cls=SafeCheckpointRunner)
    runner.train()
    assert runner.iter == 6
    assert safe_load(tmp_path / 'epoch_3.pth')['meta']['iter'] == 6
    assert {n: os.stat(tmp_path / n).st_mtime_ns for n in written} == written
