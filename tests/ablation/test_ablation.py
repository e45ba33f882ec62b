"""tools/ablate.py: the toy task, the variant names, the smoke sweep, the real-data path."""
import json
import math
import os
import os.path as osp
import sys

import pytest
import torch
from _shared import CONFIG_DIR, TOOLS, run_tool

from lapformer_mm.ablation.real import collect_run, plan_runs
from lapformer_mm.ablation.tasks import HUES, SameColourTask, build_task
from lapformer_mm.ablation.toy import takeoff_step
from lapformer_mm.ablation.variants import parse_variants
from lapformer_mm.cli import ablate

TOY_CLS_CONFIG = osp.join(CONFIG_DIR, 'cls', 'lapformer_t_toy.py')


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_same_colour_is_deterministic_per_seed():
    task = build_task('same_colour')
    images, labels = task.sample(16, gen(3))
    again, labels_again = task.sample(16, gen(3))
    assert torch.equal(images, again) and torch.equal(labels, labels_again)
    other, _ = task.sample(16, gen(4))
    assert not torch.equal(images, other)
    assert images.shape == (16, 3, 64, 64) and labels.dtype == torch.int64
    assert 0 <= images.min() and images.max() <= 1


def test_same_colour_geometry_hues_and_labels():
    task = SameColourTask()
    scenes = task.layout(500, gen(0))
    centres = scenes['centres']
    assert ((centres[:, 0] - centres[:, 1]).norm(dim=-1) >= 0.55 * 64).all()
    assert ((3 <= scenes['radii']) & (scenes['radii'] <= 6)).all()
    assert ((centres >= 6) & (centres <= 63 - 6)).all()  # objects inside the image
    hues = scenes['hues']
    assert torch.equal(scenes['labels'], (hues[:, 0] == hues[:, 1]).long())
    assert 0.4 < scenes['labels'].float().mean() < 0.6
    assert set(hues.flatten().tolist()) == set(range(6))
    assert scenes['squares'].any() and not scenes['squares'].all()
    # Each object's centre pixel has its hue; the background is dark.
    images = task.render({k: v[:20] for k, v in scenes.items()}, gen(1))
    for i in range(20):
        for obj in range(2):
            y, x = centres[i, obj].round().long().tolist()
            assert torch.equal(images[i, :, y, x], HUES[hues[i, obj]])
    assert images[:, :, 0, 0].mean() < 0.2


def test_unknown_task_names_the_argument_and_the_choices():
    with pytest.raises(ValueError, match=r"--task must be one of same_colour, got 'mnist'"):
        build_task('mnist')
    with pytest.raises(ValueError, match='min_distance'):
        SameColourTask(min_distance=1.5)


def test_variant_tokens_parse_into_attention_options():
    variants = parse_variants(['gaussian', 'lam=1,2.5', 'cg_capped', 'gaussian', 'none'])
    assert variants == [('default', {}), ('noglobal', {'global_term': False}),
                        ('gaussian', {'kernel': 'gaussian'}), ('lam=1', {'lam': 1.0}),
                        ('lam=2.5', {'lam': 2.5}), ('cg_capped', {'solver': 'cg', 'iters': 16}),
                        ('none', {'normalize': 'none'})]
    assert parse_variants(['cg'])[-1] == ('cg', {'solver': 'cg'})
    assert [name for name, _ in parse_variants([])] == ['default', 'noglobal']


@pytest.mark.parametrize('token, match', [
    ('softmax', r"unknown variant 'softmax'; allowed: default, noglobal, gaussian"),
    ('lam=', r"'lam=' must be lam= followed by positive numbers .* got ''"),
    ('lam=1,0', r"got '0'"),
    ('lam=2,x', r"got 'x'"),
    ('lam=nan', r"got 'nan'"),
])
def test_bad_variants_name_the_argument_and_the_allowed(token, match):
    with pytest.raises(ValueError, match=r'--variants: .*' + match):
        parse_variants([token])


# What each variant's attention modules hold: the backbone's defaults with the variant's
# changes (written out here, not read from variants.py).
ATTENTION_DEFAULTS = dict(global_term=True, kernel='laplacian', lam=4.0, solver='newton',
                          iters=None, normalize='injective')
VARIANT_ATTENTION = {
    'default': {}, 'noglobal': {'global_term': False}, 'gaussian': {'kernel': 'gaussian'},
    'none': {'normalize': 'none'}, 'cg': {'solver': 'cg'},
    'cg_capped': {'solver': 'cg', 'iters': 16}, 'exact': {'solver': 'exact'}, 'lam=2': {'lam': 2.0},
}


def test_every_variant_builds_the_backbone_with_its_attention_options():
    from lapformer_mm.ablation.toy import ToyClassifier
    from lapformer_mm.models.attention import LaplacianAttention
    variants = parse_variants(['gaussian', 'none', 'cg', 'cg_capped', 'exact', 'lam=2'])
    assert [name for name, _ in variants] == list(VARIANT_ATTENTION)
    for name, cfg in variants:
        model = ToyClassifier(cfg, 2)
        assert 150_000 < sum(p.numel() for p in model.parameters()) < 160_000
        attns = [m for m in model.modules() if isinstance(m, LaplacianAttention)]
        assert len(attns) == 4  # depths [2, 2] of the two built stages
        expected = {**ATTENTION_DEFAULTS, **VARIANT_ATTENTION[name]}
        for attn in attns:
            got = {key: getattr(attn if key == 'global_term' else attn.options, key)
                   for key in expected}
            assert got == expected, name


def test_takeoff_step_is_where_the_loss_window_leaves_the_plateau():
    plateau = [math.log(2)] * 30
    assert takeoff_step(plateau, 2) is None
    losses = plateau + [0.2] * 30
    step = takeoff_step(losses, 2)
    # The 25-step mean falls below 0.8 ln 2 once enough low losses are in the window.
    assert 35 < step < 60
    assert takeoff_step(losses, 2, steps=[10 * (i + 1) for i in range(60)]) == 10 * step


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit):
        ablate.parse_args(['--variants', 'softmax'])
    assert "unknown variant 'softmax'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ablate.parse_args(['--task', 'mnist'])
    err = capsys.readouterr().err
    assert "--task: invalid choice: 'mnist'" in err and 'same_colour' in err
    with pytest.raises(SystemExit):
        ablate.parse_args(['--steps', '10', '--warmup', '10'])
    assert '--warmup must be in [0, --steps=10)' in capsys.readouterr().err
    for lr in ('-1', 'nan', '0'):
        with pytest.raises(SystemExit):
            ablate.parse_args(['--lr', lr])
        assert (f'argument --lr: must be a finite number > 0, got {lr}'
                in capsys.readouterr().err)


@pytest.fixture
def one_thread():
    """--threads 1 sets torch's thread count for the process: put it back afterwards."""
    threads = torch.get_num_threads()
    yield ['--threads', '1']
    torch.set_num_threads(threads)


def test_smoke_sweep_writes_table_json_and_plot(tmp_path, capsys, one_thread):
    """Two variants (default and the control), one seed, a few steps: the fast tier's check
    of `make ablate`."""
    out = tmp_path / 'ablate'
    assert ablate.main(['--task', 'same_colour', '--variants', 'default', '--seeds', '1',
                        '--steps', '3', '--warmup', '1', '--batch-size', '4',
                        '--val-size', '8', '--log-every', '1', '--out', str(out)]
                       + one_thread) == 0
    printed = capsys.readouterr().out
    assert '[1/2 default seed 0] step 1/3 loss' in printed  # progress
    table = (out / 'table.md').read_text()
    assert table.splitlines()[0].startswith('| variant | attn_cfg | runs | final acc (%) | '
                                            'took off | mean take-off step | acc at step 1')
    assert '| noglobal | global_term=False | 1 |' in table and table in printed
    data = json.loads((out / 'runs.json').read_text())
    assert [(r['variant'], r['seed']) for r in data['runs']] == [('default', 0), ('noglobal', 0)]
    assert all(len(r['losses']) == 3 and 0 <= r['final_acc'] <= 1 for r in data['runs'])
    assert data['settings']['steps'] == 3
    assert (out / 'loss_curves.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert not (out / 'runs.partial.json').exists()


@pytest.mark.slow  # two spawned processes each import torch and the package
def test_parallel_jobs_train_the_same_runs(tmp_path, one_thread):
    """--jobs 2 (two spawned processes) gives every run bit for bit as --jobs 1 does, in the
    same order."""
    runs = {}
    for jobs in ('1', '2'):
        out = tmp_path / f'jobs{jobs}'
        assert ablate.main(['--variants', 'default', 'gaussian', '--seeds', '1', '--steps', '2',
                            '--warmup', '1', '--batch-size', '2', '--val-size', '4',
                            '--out', str(out), '--jobs', jobs] + one_thread) == 0
        runs[jobs] = [{k: v for k, v in run.items() if k != 'seconds'}
                      for run in json.loads((out / 'runs.json').read_text())['runs']]
    assert [r['variant'] for r in runs['2']] == ['default', 'noglobal', 'gaussian']
    assert runs['2'] == runs['1']


PARENT_SCRIPT = """
import multiprocessing, os, sys, time
from lapformer_mm.cli.ablate import _stop_with_parent

def worker(parent, path):
    _stop_with_parent(parent)
    with open(path, 'w') as f:
        f.write(str(os.getpid()))
    time.sleep(120)

if __name__ == '__main__':
    multiprocessing.get_context('spawn').Process(
        target=worker, args=(os.getpid(), sys.argv[1])).start()
    time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='PR_SET_PDEATHSIG is Linux')
def test_a_worker_stops_when_the_sweep_process_is_killed(tmp_path):
    """A --jobs worker whose parent is SIGKILLed exits within seconds, not after its run."""
    import signal
    import subprocess
    import time

    script, pid_file = tmp_path / 'parent.py', tmp_path / 'worker.pid'
    script.write_text(PARENT_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None, 'no worker started'
            time.sleep(0.1)
        worker = int(pid_file.read_text())
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while osp.exists(f'/proc/{worker}') and 'zombie' not in _state(worker):
        if time.monotonic() > deadline:
            os.kill(worker, signal.SIGKILL)
            pytest.fail('the worker kept running after its parent was killed')
        time.sleep(0.1)


def _state(pid):
    try:
        with open(f'/proc/{pid}/status') as f:
            return f.read().lower()
    except OSError:
        return 'zombie'


def test_resume_keeps_finished_runs(tmp_path, capsys, one_thread):
    out = tmp_path / 'ablate'
    args = ['--variants', 'default', '--seeds', '1', '--steps', '2', '--warmup', '1',
            '--batch-size', '2', '--val-size', '4', '--out', str(out)] + one_thread
    fake = dict(variant='default', seed=0, attn_cfg={}, losses=[0.7, 0.6],
                takeoff_step=None, early_step=1, early_acc=0.5, final_acc=0.25, seconds=1.0)
    settings = dict(task='same_colour', steps=2, warmup=1, batch_size=2, lr=1e-3,
                    val_size=4, early_step=1)
    out.mkdir()
    (out / 'runs.partial.json').write_text(json.dumps(dict(settings=settings, runs=[fake])))
    assert ablate.main(args + ['--resume']) == 0
    assert 'kept from' in capsys.readouterr().out
    runs = json.loads((out / 'runs.json').read_text())['runs']
    assert runs[0]['final_acc'] == 0.25 and runs[1]['variant'] == 'noglobal'


def fabricate_work_dir(work_dir, accs, losses):
    """A finished mmengine run as 0.10.7's LocalVisBackend writes it:
    <timestamp>/vis_data/scalars.json, one JSON record per line (train every logger
    interval, val with mmpretrain's accuracy/top1 in percent, step = epoch)."""
    folder = osp.join(work_dir, '20261201_120000', 'vis_data')
    os.makedirs(folder)
    lines = []
    for i, loss in enumerate(losses):
        lines.append(dict(lr=3e-4, data_time=0.01, loss=loss, time=0.5,
                          epoch=1 + i // 4, iter=10 * (i + 1), memory=0, step=10 * (i + 1)))
        if (i + 1) % 4 == 0 and accs:
            lines.append({'accuracy/top1': accs.pop(0), 'data_time': 0.01, 'time': 0.2,
                          'step': (i + 1) // 4})
    with open(osp.join(folder, 'scalars.json'), 'w') as f:
        f.write(''.join(json.dumps(line) + '\n' for line in lines))


def test_real_config_writes_configs_and_prints_commands(tmp_path, capsys):
    from mmengine.config import Config
    out = tmp_path / 'real'
    assert ablate.main(['--config', TOY_CLS_CONFIG, '--variants', 'gaussian', 'lam=2',
                        '--seeds', '2', '--out', str(out)]) == 0
    printed = capsys.readouterr().out
    commands = [line for line in printed.splitlines() if line.startswith('python')]
    assert len(commands) == 4 * 2
    assert (f"python tools/train.py {out}/configs/lapformer_t_toy__lam2.py --work-dir "
            f"{out}/work_dirs/lam2/seed1 --cfg-options randomness.seed=1") in commands
    assert (out / 'commands.sh').read_text().count('tools/train.py') == 8
    cfg = Config.fromfile(str(out / 'configs' / 'lapformer_t_toy__noglobal.py'))
    assert cfg.model.backbone.attn_cfg == dict(global_term=False)
    assert cfg.model.backbone.arch == 'tiny'  # the rest of the config is inherited
    cfg = Config.fromfile(str(out / 'configs' / 'lapformer_t_toy__gaussian.py'))
    assert cfg.model.backbone.attn_cfg == dict(kernel='gaussian')
    from lapformer_mm.models import LaplacianFormer
    LaplacianFormer(**{k: v for k, v in cfg.model.backbone.items() if k != 'type'})

    ablate.main(['--config', TOY_CLS_CONFIG, '--seeds', '1', '--out', str(out),
                 '--launcher', 'slurm', '--gpus', '16', '--partition', 'p1'])
    assert (f'GPUS=16 tools/slurm_train.sh p1 ablate_default_s0 '
            f'{out}/configs/lapformer_t_toy__default.py {out}/work_dirs/default/seed0 '
            f'--cfg-options randomness.seed=0') in capsys.readouterr().out
    ablate.main(['--config', TOY_CLS_CONFIG, '--seeds', '1', '--out', str(out),
                 '--launcher', 'dist', '--gpus', '4'])
    assert (f'tools/dist_train.sh {out}/configs/lapformer_t_toy__default.py 4 --work-dir'
            in capsys.readouterr().out)


def test_real_config_collects_finished_work_dirs(tmp_path, capsys):
    out = tmp_path / 'real'
    runs = plan_runs(TOY_CLS_CONFIG, parse_variants([]), [0, 1], str(out))
    by_key = {(r['variant'], r['seed']): r for r in runs}
    plateau = [math.log(4)] * 4
    fabricate_work_dir(by_key['default', 0]['work_dir'], [40.0, 60.0, 90.0],
                       plateau + [0.5] * 8)
    fabricate_work_dir(by_key['default', 1]['work_dir'], [30.0, 50.0, 80.0], plateau * 3)
    fabricate_work_dir(by_key['noglobal', 0]['work_dir'], [25.0, 25.0, 25.0], plateau * 3)
    # noglobal seed 1 has not finished: no work_dir.
    record = collect_run(by_key['default', 0], num_classes=4)
    assert record['final_acc'] == 0.9 and record['early_acc'] == 0.4
    # The 5-record mean drops below 0.8 ln 4 at the second low record (iteration 60).
    assert record['early_step'] == 1 and record['takeoff_step'] == 60
    assert ablate.main(['--config', TOY_CLS_CONFIG, '--seeds', '2', '--out', str(out),
                        '--collect']) == 0
    captured = capsys.readouterr()
    assert 'not finished' in captured.err and 'noglobal/seed1' in captured.err
    table = (out / 'table.md').read_text()
    assert table.splitlines()[0].endswith('| first validation acc (%) |')
    assert '| default | (defaults) | 2 | 85.0 ± 7.1 | 1/2 | 60 | 35.0 ± 7.1 |' in table
    assert '| noglobal | global_term=False | 1 | 25.0 ± 0.0 | 0/1 | — |' in table
    data = json.loads((out / 'runs.json').read_text())
    assert data['settings']['missing'] == [['noglobal', 1]]
    assert (out / 'loss_curves.png').exists()


def test_collect_without_finished_runs_fails(tmp_path, capsys):
    assert ablate.main(['--config', TOY_CLS_CONFIG, '--seeds', '1', '--out',
                        str(tmp_path), '--collect']) == 1
    assert 'no finished run to collect' in capsys.readouterr().err


def test_report_only_writes_the_finished_runs_of_an_interrupted_sweep(tmp_path, capsys):
    out = tmp_path / 'ablate'
    out.mkdir()
    settings = dict(task='same_colour', steps=2, warmup=1, batch_size=2, lr=1e-3,
                    val_size=4, early_step=1, started='2026-12-01 21:00 UTC')
    fake = dict(variant='noglobal', seed=1, attn_cfg={'global_term': False},
                losses=[0.7, 0.7], takeoff_step=None, early_step=1, early_acc=0.5,
                final_acc=0.5, seconds=2.0)
    (out / 'runs.partial.json').write_text(json.dumps(dict(settings=settings, runs=[fake])))
    args = ['--seeds', '2', '--steps', '2', '--warmup', '1', '--batch-size', '2',
            '--val-size', '4', '--out', str(out), '--resume', '--report-only']
    assert ablate.main(args) == 0
    assert 'not run (--report-only)' in capsys.readouterr().out
    data = json.loads((out / 'runs.json').read_text())
    assert [(r['variant'], r['seed']) for r in data['runs']] == [('noglobal', 1)]
    assert data['settings']['missing'] == [['default', 0], ['noglobal', 0], ['default', 1]]
    assert data['settings']['started'] == '2026-12-01 21:00 UTC'
    assert (out / 'runs.partial.json').exists()


def test_tool_wrapper_prints_the_commands(tmp_path):
    """tools/ablate.py runs from the checkout (no training: the real-config path)."""
    out = run_tool([sys.executable, osp.join(TOOLS, 'ablate.py'), '--config', TOY_CLS_CONFIG,
                    '--seeds', '1', '--out', tmp_path])
    assert out.count('python tools/train.py') == 2 and 'commands.sh' in out
