"""tools/ablate.py: the toy task, the variants, the smoke sweep, the real-data path."""
import json
import math
import os
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
import torch
from _shared import CONFIG_DIR, ROOT, TOOLS, TOY_CONFIG, run_tool

from lapformer_mm.ablation.real import PEERS, collect_run, peer_config, plan_runs
from lapformer_mm.ablation.tasks import HUES, SameColourTask, build_task
from lapformer_mm.ablation.toy import takeoff_step
from lapformer_mm.ablation.variants import NAMED_VARIANTS, parse_variants
from lapformer_mm.cli import ablate

TOY_CLS_CONFIG = osp.join(CONFIG_DIR, 'cls', 'lapformer_t_toy.py')
TOY_SEG_CONFIG = osp.join(CONFIG_DIR, 'toy', 'upernet_lapformer_t_toy.py')


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_same_colour_is_deterministic_per_seed_with_its_geometry_hues_and_labels():
    task = build_task('same_colour')
    images, labels = task.sample(16, gen(3))
    again, labels_again = task.sample(16, gen(3))
    assert torch.equal(images, again) and torch.equal(labels, labels_again)
    assert not torch.equal(images, task.sample(16, gen(4))[0])
    assert images.shape == (16, 3, 64, 64) and labels.dtype == torch.int64
    assert 0 <= images.min() and images.max() <= 1
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
    with pytest.raises(ValueError, match='min_distance'):  # no room for the objects
        SameColourTask(min_distance=1.5)


def test_variant_tokens_parse_into_attention_options():
    variants = parse_variants(['gaussian', 'lam=1,2.5', 'cg_capped', 'gaussian', 'none'])
    assert variants == [('default', {}), ('noglobal', {'global_term': False}),
                        ('gaussian', {'kernel': 'gaussian'}), ('lam=1', {'lam': 1.0}),
                        ('lam=2.5', {'lam': 2.5}), ('cg_capped', {'solver': 'cg', 'iters': 16}),
                        ('none', {'normalize': 'none'})]
    assert parse_variants(['cg'])[-1] == ('cg', {'solver': 'cg'})
    assert [name for name, _ in parse_variants([])] == ['default', 'noglobal']
    for token in ('softmax', 'lam=', 'lam=1,0', 'lam=2,x', 'lam=nan', 'lam=inf'):
        with pytest.raises(ValueError, match='--variants'):
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
    assert takeoff_step([0.1] * 30, 2) == 25  # not before the window is full
    losses = plateau + [0.2] * 30
    step = takeoff_step(losses, 2)
    # The 25-step mean falls below 0.8 ln 2 once enough low losses are in the window.
    assert 35 < step < 60
    assert takeoff_step(losses, 2, steps=[10 * (i + 1) for i in range(60)]) == 10 * step


def test_cli_rejects_bad_input(capsys):
    for argv, name in ((['--variants', 'softmax'], '--variants'), (['--task', 'mnist'], '--task'),
                       (['--steps', '10', '--warmup', '10'], '--warmup'),
                       (['--lr', '-1'], '--lr'), (['--lr', 'nan'], '--lr'), (['--lr', '0'], '--lr'),
                       (['--config', TOY_CLS_CONFIG, '--peers', 'r18'], '--peers'),
                       (['--peers', 'r18'], '--peers'),
                       (['--config', TOY_SEG_CONFIG, '--peers', 'vit'], '--peers'),
                       (['--config', TOY_SEG_CONFIG, '--extra', TOY_SEG_CONFIG], '--extra'),
                       (['--config', TOY_SEG_CONFIG, '--extra', 'x=nowhere.py'], '--extra'),
                       (['--config', TOY_SEG_CONFIG, '--extra', f'r18={TOY_SEG_CONFIG}',
                         '--peers', 'r18'], '--extra'),
                       (['--config', 'nowhere.py'], '--config')):
        with pytest.raises(SystemExit):
            ablate.parse_args(argv)
        assert name in capsys.readouterr().err, argv


@pytest.fixture
def one_thread():
    """--threads 1 sets torch's thread count for the process: put it back afterwards."""
    threads = torch.get_num_threads()
    yield ['--threads', '1']
    torch.set_num_threads(threads)


def test_smoke_sweep_writes_table_json_and_plot(tmp_path, capsys, one_thread):
    """Two variants (default and the control), one seed, a few steps."""
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
    """--jobs 2 gives every run bit for bit as --jobs 1 does, in the same order."""
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


@pytest.mark.slow  # a sweep process started and killed: 12 s
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


PARTIAL_SETTINGS = dict(task='same_colour', steps=2, warmup=1, batch_size=2, lr=1e-3,
                        val_size=4, early_step=1, started='2026-12-01 21:00 UTC')


def write_partial(out, variant, seed, final_acc):
    out.mkdir()
    fake = dict(variant=variant, seed=seed, attn_cfg=dict(NAMED_VARIANTS[variant]),
                losses=[0.7, 0.6], takeoff_step=None, early_step=1, early_acc=0.5,
                final_acc=final_acc, seconds=1.0)
    (out / 'runs.partial.json').write_text(json.dumps(dict(settings=PARTIAL_SETTINGS,
                                                           runs=[fake])))


def test_resume_keeps_finished_runs(tmp_path, capsys, one_thread):
    out = tmp_path / 'ablate'
    args = ['--variants', 'default', '--seeds', '1', '--steps', '2', '--warmup', '1',
            '--batch-size', '2', '--val-size', '4', '--out', str(out)] + one_thread
    write_partial(out, 'default', 0, 0.25)
    assert ablate.main(args + ['--resume']) == 0
    assert 'kept from' in capsys.readouterr().out
    runs = json.loads((out / 'runs.json').read_text())['runs']
    assert runs[0]['final_acc'] == 0.25 and runs[1]['variant'] == 'noglobal'


def fabricate_work_dir(work_dir, accs, losses):
    """A finished run's <timestamp>/vis_data/scalars.json as mmengine 0.10.7 writes it."""
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
    """Through tools/ablate.py, run from the checkout (no training: the real-config path)."""
    from mmengine.config import Config
    out = tmp_path / 'real'
    printed = run_tool([sys.executable, osp.join(TOOLS, 'ablate.py'), '--config', TOY_CLS_CONFIG,
                        '--variants', 'gaussian', 'lam=2', '--seeds', '2', '--out', out])
    assert 'commands.sh' in printed
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
                 '--launcher', 'dist', '--gpus', '4'])
    assert (f'tools/dist_train.sh {out}/configs/lapformer_t_toy__default.py 4 --work-dir'
            in capsys.readouterr().out)


def test_real_config_collects_finished_work_dirs(tmp_path, capsys):
    out = tmp_path / 'real'
    assert ablate.main(['--config', TOY_CLS_CONFIG, '--seeds', '1', '--out',
                        str(tmp_path), '--collect']) == 1
    assert 'no finished run to collect' in capsys.readouterr().err
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


def test_report_only_writes_the_finished_runs_of_an_interrupted_sweep(tmp_path, capsys):
    out = tmp_path / 'ablate'
    write_partial(out, 'noglobal', 1, 0.5)
    args = ['--seeds', '2', '--steps', '2', '--warmup', '1', '--batch-size', '2',
            '--val-size', '4', '--out', str(out), '--resume', '--report-only']
    assert ablate.main(args) == 0
    assert 'not run (--report-only)' in capsys.readouterr().out
    data = json.loads((out / 'runs.json').read_text())
    assert [(r['variant'], r['seed']) for r in data['runs']] == [('noglobal', 1)]
    assert data['settings']['missing'] == [['default', 0], ['noglobal', 0], ['default', 1]]
    assert data['settings']['started'] == '2026-12-01 21:00 UTC'
    assert (out / 'runs.partial.json').exists()


def command_lines(out):
    return (out / 'commands.sh').read_text().splitlines()[3:]


def test_peers_and_extras_are_rows_trained_then_tested(tmp_path, capsys):
    """Segmentation and detection: every run trains (resumable) then tests its checkpoint."""
    extra = tmp_path / 'wide.py'
    extra.write_text(f'_base_ = [{TOY_SEG_CONFIG!r}]\n')
    out = tmp_path / 'seg'
    assert ablate.main(['--config', TOY_SEG_CONFIG, '--peers', 'swin_t', 'r18', '--extra',
                        f'wide={extra}', '--seeds', '2', '--out', str(out), '--cfg-options',
                        'train_cfg.max_iters=2']) == 0
    lines = command_lines(out)
    assert capsys.readouterr().out.count('tools/train.py') == len(lines) == 2 * 5
    assert [line.split()[2] for line in lines[:5]] == [  # seed by seed
        f'{out}/configs/upernet_lapformer_t_toy__default.py',
        f'{out}/configs/upernet_lapformer_t_toy__noglobal.py',
        osp.relpath(osp.join(CONFIG_DIR, 'toy', 'upernet_swin_t_toy_baseline.py')),
        osp.relpath(osp.join(CONFIG_DIR, 'toy', 'upernet_r18_toy_baseline.py')), str(extra)]
    swin, work = lines[7].split()[2], f'{out}/work_dirs/swin_t/seed1'
    assert lines[7] == (
        f'python tools/train.py {swin} --work-dir {work} --resume --cfg-options '
        f'randomness.seed=1 train_cfg.val_begin=1000000 train_cfg.max_iters=2 && '
        f'python tools/test.py {swin} "$(cat {work}/last_checkpoint)" --work-dir {work}/test '
        f'--metrics-json {work}/metrics.json --cfg-options train_cfg.max_iters=2 '
        f'> {work}/test.log 2>&1')
    assert f'--work-dir {out}/work_dirs/wide/seed0 ' in lines[4]

    out = tmp_path / 'det'
    assert ablate.main(['--config', TOY_CONFIG, '--peers', *PEERS, '--seeds', '1',
                        '--out', str(out), '--launcher', 'slurm', '--gpus', '4',
                        '--partition', 'p1']) == 0
    lines = command_lines(out)
    pvt = osp.relpath(osp.join(CONFIG_DIR, 'toy', 'maskrcnn_pvtv2_b1_toy_baseline.py'))
    work = f'{out}/work_dirs/pvtv2_b1/seed0'
    assert lines[2] == (
        f'GPUS=4 tools/slurm_train.sh p1 ablate_pvtv2_b1_s0 {pvt} {work} --resume '
        f'--cfg-options randomness.seed=0 train_cfg.val_begin=1000000 && GPUS=4 '
        f'tools/slurm_test.sh p1 ablate_pvtv2_b1_s0 {pvt} "$(cat {work}/last_checkpoint)" '
        f'--work-dir {work}/test --metrics-json {work}/metrics.json --cfg-options '
        f'test_evaluator.classwise=True > {work}/test.log 2>&1')
    for task, head in (('seg', 'upernet'), ('det', 'maskrcnn')):
        for peer in PEERS:
            text = open(peer_config(task, peer)).read()
            assert text.startswith('# Comparison baseline') or peer == 'r18'
            assert f"_base_ = ['./{head}_lapformer_t_toy.py']" in text


def test_run_skips_finished_runs_and_runs_the_rest_with_one_thread(tmp_path, monkeypatch,
                                                                     capsys):
    out = tmp_path / 'seg'
    args = ['--config', TOY_SEG_CONFIG, '--peers', 'r18', '--seeds', '2', '--out', str(out)]
    runs = plan_runs(TOY_SEG_CONFIG, parse_variants([]), [0, 1], str(out), peers=['r18'],
                     task='seg')
    finished = [run for run in runs if (run['variant'], run['seed']) != ('r18', 1)
                and run['seed'] == 1]
    for run in finished:
        os.makedirs(run['work_dir'])
        open(osp.join(run['work_dir'], 'metrics.json'), 'w').write('{}')
    called = []

    def fake_run(command, shell, stdout, stderr, env):
        called.append(command)
        assert shell and env['OMP_NUM_THREADS'] == env['MKL_NUM_THREADS'] == '1'
        assert env['PATH'].startswith(osp.dirname(sys.executable) + os.pathsep)
        return subprocess.CompletedProcess(command, 1 if '/r18/seed1 ' in command else 0)

    monkeypatch.setattr(ablate.subprocess, 'run', fake_run)
    assert ablate.main(args + ['--run', '--jobs', '2']) == 1  # r18 seed 1 failed
    expected = [run['command'] for run in runs if run not in finished]
    assert sorted(called) == sorted(expected) and len(called) == 4
    printed = capsys.readouterr().out
    assert 'running 4 of 6 runs (2 finished before)' in printed
    assert f'r18 seed 1: FAILED (exit 1; {out}/work_dirs/r18/seed1/run.log)' in printed


def mmengine_line(text):
    return f'12/07 05:15:55 - mmengine - INFO - {text}\n'


def fabricate_tested_run(work_dir, metrics, log, losses):
    """A finished run of the sweep: --metrics-json, test.log and the training's scalars.json."""
    folder = osp.join(work_dir, '20261207_051517', 'vis_data')
    os.makedirs(folder)
    with open(osp.join(folder, 'scalars.json'), 'w') as f:
        for i, loss in enumerate(losses):
            f.write(json.dumps(dict(lr=5e-4, data_time=0.01, loss=loss, **{
                'decode.loss_ce': loss * 0.7, 'aux.loss_ce': loss * 0.3,
                'decode.acc_seg': 90.0}, time=0.5, iter=10 * (i + 1), memory=0,
                step=10 * (i + 1))) + '\n')
    with open(osp.join(work_dir, 'metrics.json'), 'w') as f:
        json.dump(metrics, f, indent=2)
    with open(osp.join(work_dir, 'test.log'), 'w') as f:
        f.write(log)


SEG_CLASSES = ('background', 'circle', 'square', 'triangle', 'star')


def seg_test_log(iou, acc):
    """mmseg 1.2.2 IoUMetric's per-class table in tools/test.py's output."""
    from prettytable import PrettyTable
    table = PrettyTable()
    for key, values in (('Class', SEG_CLASSES), ('IoU', iou), ('Acc', acc)):
        table.add_column(key, list(values))
    return (mmengine_line('Load checkpoint from x/iter_800.pth')
            + mmengine_line('per class results:') + mmengine_line('\n' + table.get_string())
            + mmengine_line('Iter(test) [20/20]    aAcc: 95.0  mIoU: 80.0  mAcc: 90.0'))


def spread(values, digits):
    """mean ± sample standard deviation, computed here with numpy."""
    return f'{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}'


def test_collect_seg_writes_mean_spread_and_per_class_iou(tmp_path, capsys):
    out = tmp_path / 'seg'
    runs = plan_runs(TOY_SEG_CONFIG, parse_variants([]), [0, 1, 2], str(out),
                     peers=['r18'], task='seg')
    rng = np.random.default_rng(0)
    results = {}
    for run in runs:
        if run['variant'] == 'noglobal' or (run['variant'], run['seed']) == ('r18', 2):
            continue  # not finished
        iou, acc = rng.uniform(50, 99, (2, 5)).round(2)
        miou, losses = float(iou.mean()), list(rng.uniform(0.1, 1.0, 3))
        fabricate_tested_run(run['work_dir'], dict(aAcc=96.0, mIoU=miou, mAcc=float(acc.mean())),
                             seg_test_log(iou, acc), losses)
        results.setdefault(run['variant'], []).append((miou, iou, losses[-1]))
    assert ablate.main(['--config', TOY_SEG_CONFIG, '--peers', 'r18', '--seeds', '3',
                        '--out', str(out), '--collect']) == 0
    assert capsys.readouterr().err.count('not finished (no metrics.json in') == 4
    table = (out / 'table.md').read_text()
    assert table.startswith('Mean ± sample standard deviation (n − 1) over the seeds')
    assert ('| row | attn_cfg or config | params (M): backbone / all | seeds | mIoU (%) | '
            'aAcc (%) | mAcc (%) | final train loss |') in table
    for name, size in (('default', '12.08 / 13.04'), ('r18', '11.20 / 12.13')):
        mious, ious, losses = zip(*results[name])
        assert (f'| {name} | ' in table and f' | {size} | {len(mious)} | '
                f'{spread(mious, 2)} | 96.00 ± 0.00 |') in table
        assert f'| {spread(losses, 4)} |' in table
        per_class = ' | '.join(spread(column, 2) for column in np.array(ious).T)
        assert f'\n| {name} | {per_class} |' in table
    assert '\n| row | background | circle | square | triangle | star |' in table
    data = json.loads((out / 'runs.json').read_text())
    assert [row['variant'] for row in data['table']] == ['default', 'r18']
    row = data['table'][1]
    assert row['config'] == peer_config('seg', 'r18') and row['kind'] == 'peer'
    assert row['metrics']['mIoU (%)']['values'] == [m for m, _, _ in results['r18']]
    assert row['classwise']['IoU']['star']['std'] == pytest.approx(
        np.std([iou[4] for _, iou, _ in results['r18']], ddof=1))
    assert data['settings']['missing'] == [['noglobal', 0], ['noglobal', 1], ['noglobal', 2],
                                           ['r18', 2]]
    assert data['runs'][0]['final_losses']['decode.loss_ce'] == pytest.approx(
        0.7 * results['default'][0][2])


def det_test_log(bbox, segm):
    """mmdet 3.3.0 CocoMetric's classwise output, then tools/test.py's own table."""
    from terminaltables import AsciiTable
    text = ''
    for iou_type, rows in (('bbox', bbox), ('segm', segm)):
        text += (mmengine_line(f'Evaluating {iou_type}...') + 'Loading and preparing results...\n'
                 ' Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ] = 0.6\n')
        table = [['category', 'mAP', 'mAP_50', 'mAP_75', 'mAP_s', 'mAP_m', 'mAP_l']]
        table += [[name, str(ap), str(ap50), '0.5', 'nan', '0.5', '0.6']
                  for name, (ap, ap50) in rows.items()]
        text += mmengine_line('\n' + AsciiTable(table).table)
        text += mmengine_line(f'{iou_type}_mAP_copypaste: 0.600 0.900 0.700 -1.000 0.600 0.650')
    return text + '| | AP | AP50 | AP75 | APs | APm | APl |\n|---|---|---|---|---|---|---|\n'


def test_collect_det_reads_the_bbox_tables_of_cocometric(tmp_path, monkeypatch):
    out = tmp_path / 'det'
    runs = plan_runs(TOY_CONFIG, parse_variants([]), [0, 1], str(out), peers=['swin_t'],
                     task='det')
    by_key = {(run['variant'], run['seed']): run for run in runs}
    for seed, (ap, ap50) in enumerate(((0.61, 0.9), (0.65, 0.95))):
        bbox = {'circle': (ap, ap50), 'star': (ap - 0.1, ap50 - 0.1)}
        segm = {'circle': (0.1, 0.2), 'star': (0.3, 0.4)}  # differs from bbox on purpose
        fabricate_tested_run(by_key['swin_t', seed]['work_dir'], {
            'coco/circle_precision': 0.1, 'coco/bbox_mAP': ap, 'coco/bbox_mAP_50': ap50,
            'coco/bbox_mAP_75': 0.7, 'coco/segm_mAP': 0.2, 'coco/segm_mAP_50': 0.3},
            det_test_log(bbox, segm), [2.0, 1.5])
    monkeypatch.setattr(ablate, 'model_params', lambda config: (27.52, 28.85))
    assert ablate.main(['--config', TOY_CONFIG, '--peers', 'swin_t', '--seeds', '2',
                        '--out', str(out), '--collect']) == 0
    table = (out / 'table.md').read_text()
    assert ('| swin_t | ' + peer_config('det', 'swin_t') + ' | 27.52 / 28.85 | 2 | '
            f'{spread([0.61, 0.65], 3)} | {spread([0.9, 0.95], 3)} | 0.200 ± 0.000 | '
            '1.5000 ± 0.0000 |') in table
    assert ('Per class: bbox AP\n\n| row | circle | star |\n|---|---|---|\n'
            f'| swin_t | {spread([0.61, 0.65], 3)} | {spread([0.51, 0.55], 3)} |') in table
    assert ('Per class: bbox AP50\n\n| row | circle | star |\n|---|---|---|\n'
            f'| swin_t | {spread([0.9, 0.95], 3)} | {spread([0.8, 0.85], 3)} |') in table
    classwise = json.loads((out / 'runs.json').read_text())['runs'][0]['classwise']
    assert classwise['segm AP50'] == {'circle': 0.2, 'star': 0.4}


@pytest.mark.slow(seconds=120)
def test_peer_sweep_trains_tests_and_collects(toy_seg, tmp_path, monkeypatch):
    """Two iterations per row through the real tools: the metrics are the test step's."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / 'sweep'
    options = [f'{part}.dataset.data_root={toy_seg}/' for part in
               ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    assert ablate.main(['--config', TOY_SEG_CONFIG, '--peers', 'r18', '--seeds', '1',
                        '--out', str(out), '--run', '--jobs', '2', '--collect',
                        '--cfg-options', *options, 'train_cfg.max_iters=2',
                        'default_hooks.logger.interval=1']) == 0
    data = json.loads((out / 'runs.json').read_text())
    assert [run['variant'] for run in data['runs']] == ['default', 'noglobal', 'r18']
    for run in data['runs']:
        assert set(run['classwise']['IoU']) == set(SEG_CLASSES)
        assert len(run['losses']) == 2 and 'aux.loss_ce' in run['final_losses']
        with open(osp.join(run['work_dir'], 'metrics.json')) as f:
            assert run['metrics']['mIoU'] == json.load(f)['mIoU']
