"""SafeCheckpointRunner; stock mmengine unchanged by ``import lapformer_mm``."""
import os

import pytest
import torch
from _runner_helpers import assert_refused_with_hint, make_runner
from mmengine.evaluator import BaseMetric, Evaluator
from mmengine.runner import Runner

import lapformer_mm  # noqa: F401
from lapformer_mm.checkpoint import safe_load
from lapformer_mm.engine import SafeCheckpointRunner, find_latest_checkpoint


@pytest.mark.parametrize('resume', [False, True])
@pytest.mark.usefixtures('mmdet_scope')
def test_load_from_and_resume_refuse_code_running_checkpoint(evil, tmp_path, resume):
    path, marker = evil
    runner = make_runner(tmp_path, 1, runner_cls=SafeCheckpointRunner, load_from=path,
                         resume=resume)
    with pytest.raises(RuntimeError) as info:
        runner.train()
    assert_refused_with_hint(str(info.value), path)
    assert not marker.exists()


def test_safe_runner_checkpoints_atomically(tmp_path):
    """CheckpointHook becomes SafeCheckpointHook on the atomic backend; no .tmp remains."""
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
def test_save_failing_mid_rotation_leaves_a_checkpoint_only_with_the_safe_runner(
        tmp_path, runner_cls, kept):
    """max_keep_ckpts=1, the save of epoch 2 fails: stock mmengine has deleted epoch_1.pth."""
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


class RisingScore(BaseMetric):
    """A score that improves at every validation: a new best checkpoint each epoch."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def process(self, data_batch, data_samples):
        self.results.append(0)

    def compute_metrics(self, results):
        self.calls += 1
        return dict(score=float(self.calls))


def test_safe_rotation_with_save_best_keeps_the_latest_checkpoint(tmp_path):
    """A new best saves the step's checkpoint again; that must not rotate it out."""
    runner = make_runner(
        tmp_path, 3, num_samples=4,
        checkpoint=dict(max_keep_ckpts=1, save_best='score', rule='greater'),
        runner_cls=SafeCheckpointRunner,
        val_dataloader=dict(dataset=[dict(inputs=torch.zeros(2))], batch_size=1,
                            collate_fn=dict(type='default_collate'),
                            sampler=dict(type='DefaultSampler', shuffle=False)),
        val_evaluator=Evaluator(RisingScore()), val_cfg=dict())
    runner.train()
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith('.pth')) == [
        'best_score_epoch_3.pth', 'epoch_3.pth']
    assert (tmp_path / 'last_checkpoint').read_text() == str(tmp_path / 'epoch_3.pth')


RESUMABLE = ['epoch_2.pth', 'epoch_10.pth', 'epoch_3.pth', 'best_coco_bbox_mAP_epoch_3.pth',
             'pretrained.pth']


@pytest.mark.parametrize('files, record, expected', [
    # Largest N, not newest file: a best_*.pth (no optimizer state) or a copied file is newer.
    (RESUMABLE, None, 'epoch_10.pth'), (RESUMABLE, '', 'epoch_10.pth'),
    (RESUMABLE, 'WORK/epoch_11.pth', 'epoch_10.pth'),
    (['epoch_1.pth', 'epoch_2.pth'], 'WORK/epoch_1.pth\n', 'epoch_1.pth'),  # intact
    ([], None, None),  # a fresh start
    (['iter_8.pth/'], 'WORK/iter_8.pth', 'iter_8.pth'),  # DeepSpeed saves a directory
    # A moved work dir: the record's name here, else the largest N.
    (['epoch_1.pth', 'epoch_3.pth', 'epoch_2.pth'], '/old/work_dir/epoch_2.pth', 'epoch_2.pth'),
    (['epoch_1.pth', 'epoch_3.pth', 'epoch_2.pth'], '/old/work_dir/epoch_5.pth', 'epoch_3.pth'),
    # A stale record naming a folder or another file: never the work dir or the record.
    (['epoch_1.pth', 'epoch_2.pth'], '/gone/work_dir/', 'epoch_2.pth'),
    (['epoch_1.pth', 'epoch_2.pth'], '/gone/work_dir/last_checkpoint', 'epoch_2.pth'),
])
def test_auto_resume_finds_the_checkpoint_to_resume_from(tmp_path, files, record, expected):
    for age, name in enumerate(files):
        if name.endswith('/'):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_bytes(b'x')
            os.utime(tmp_path / name, (1_000_000 + age, 1_000_000 + age))
    if record is not None:
        (tmp_path / 'last_checkpoint').write_text(record.replace('WORK', str(tmp_path)))
    found = find_latest_checkpoint(str(tmp_path))
    assert found == (expected and str(tmp_path / expected))


@pytest.mark.parametrize('record', ['epoch_4.pth', ''])
def test_auto_resume_refuses_a_record_with_nothing_to_resume_from(tmp_path, record):
    """A record exists only after a save: a fresh start would silently lose the run."""
    (tmp_path / 'best_coco_bbox_mAP_epoch_3.pth').write_bytes(b'x')
    (tmp_path / 'last_checkpoint').write_text(record and str(tmp_path / record))
    with pytest.raises(FileNotFoundError, match='out_dir'):
        find_latest_checkpoint(str(tmp_path))


def test_safe_runner_resumes_past_an_empty_last_checkpoint(tmp_path):
    """Auto-resume continues: the first two epochs' checkpoints are not written again."""
    make_runner(tmp_path, 2, num_samples=4).train()
    (tmp_path / 'last_checkpoint').write_text('')
    written = {n: os.stat(tmp_path / n).st_mtime_ns for n in ('epoch_1.pth', 'epoch_2.pth')}
    runner = make_runner(tmp_path, 3, num_samples=4, resume=True,
                         runner_cls=SafeCheckpointRunner)
    runner.train()
    assert runner.iter == 6
    assert safe_load(tmp_path / 'epoch_3.pth')['meta']['iter'] == 6
    assert {n: os.stat(tmp_path / n).st_mtime_ns for n in written} == written
