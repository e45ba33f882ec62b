"""The engine parts are opt-in: a stock mmengine job runs the same with the import."""
import glob
import json
import os
import os.path as osp
import subprocess
import sys

import pytest
from _shared import CONFIG_DIR, ROOT, TESTS
from mmengine.config import Config

CONFIGS = sorted(glob.glob(osp.join(CONFIG_DIR, 'cls', '*.py')))


def test_the_configs_are_the_classifiers_and_those_test_detection_builds():
    every = sorted(p for p in glob.glob(osp.join(CONFIG_DIR, '**', '*.py'), recursive=True)
                   if '_base_' not in p.split(os.sep))
    detection = glob.glob(osp.join(CONFIG_DIR, '*.py')) + glob.glob(
        osp.join(CONFIG_DIR, 'toy', '*.py'))
    assert CONFIGS and every == sorted(CONFIGS + detection)


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: osp.relpath(p, ROOT))
def test_every_config_uses_the_safe_runtime(path):
    cfg = Config.fromfile(path)
    assert cfg.runner_type == 'SafeCheckpointRunner'
    assert cfg.custom_imports == dict(imports=['lapformer_mm'], allow_failed_imports=False)


STOCK_JOB = r'''
import json, os, sys, tempfile

import torch

if sys.argv[1] == 'plugin':
    import lapformer_mm  # noqa: F401
from _runner_helpers import make_runner


def files(work_dir):
    names = sorted(n for n in os.listdir(work_dir) if n.endswith('.pth'))
    record = os.path.join(work_dir, 'last_checkpoint')
    if os.path.exists(record):
        with open(record) as f:
            names.append('last_checkpoint -> ' + os.path.relpath(f.read(), work_dir))
    return names


report = {}
work = tempfile.mkdtemp()
torch.manual_seed(0)  # TinyModel is built before the Runner seeds
runner = make_runner(work, 3, num_samples=4, checkpoint=dict(max_keep_ckpts=2))
report['hooks'] = [type(h).__module__ + '.' + type(h).__name__ for h in runner.hooks]
runner.train()
report['rotation'] = files(work)
report['weights'] = runner.model.linear.weight.tolist() + runner.model.linear.bias.tolist()

work = tempfile.mkdtemp()
runner = make_runner(work, 2, num_samples=4, checkpoint=dict(max_keep_ckpts=1))
save = runner.save_checkpoint


def dies_at_epoch_2(out_dir, filename, *args, **kwargs):
    if filename == 'epoch_2.pth':
        raise KeyboardInterrupt
    return save(out_dir, filename, *args, **kwargs)


runner.save_checkpoint = dies_at_epoch_2
try:
    runner.train()
except KeyboardInterrupt:
    pass
report['failed_save'] = files(work)

with open(os.path.join(work, 'last_checkpoint'), 'w') as f:
    f.write('')
try:
    make_runner(work, 3, num_samples=4, resume=True).train()
except Exception as err:
    report['resume_empty_record'] = f'{type(err).__name__}: {err}'.replace(work, 'WORK')
print(json.dumps(report))
'''


@pytest.mark.slow
def test_stock_mmengine_job_is_the_same_with_the_plugin_imported():
    """Hooks, rotation order, a failed save, the weights and an empty last_checkpoint."""
    reports = {}
    for mode in ('stock', 'plugin'):
        # The job imports tests/_runner_helpers.py: the tests folder goes on its PYTHONPATH.
        path = os.pathsep.join(p for p in (TESTS, os.environ.get('PYTHONPATH')) if p)
        proc = subprocess.run([sys.executable, '-c', STOCK_JOB, mode],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=path))
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    stock = reports['stock']
    assert 'mmengine.hooks.checkpoint_hook.CheckpointHook' in stock['hooks']
    assert stock['rotation'] == ['epoch_2.pth', 'epoch_3.pth', 'last_checkpoint -> epoch_3.pth']
    # mmengine deletes before it saves: the failed save leaves nothing to resume from.
    assert stock['failed_save'] == ['last_checkpoint -> epoch_1.pth']
    assert 'FileNotFoundError' in stock['resume_empty_record']
    assert reports['plugin'] == stock
