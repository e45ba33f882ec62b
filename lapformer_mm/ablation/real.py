"""The ablation sweep on a real config: rows (attention variants, backbone peers, extra
configs) × seeds, their commands, and the metrics of the finished work_dirs: a classifier's
training validation (top-1); for segmentation and detection ``tools/test.py``'s
``metrics.json`` and the per-class tables of its ``test.log``.

Layout under the sweep's ``out`` folder::

    configs/<config>__<variant>.py        _base_ = the given config, + the variant's attn_cfg
    work_dirs/<row>/seed<S>/              one mmengine work_dir per run (tools/train.py),
        run.log, test.log, metrics.json   with --run's output and tools/test.py's (seg, det)
    commands.sh                           every run's command
"""
import glob
import json
import os
import os.path as osp
import re
import shlex

from .toy import takeoff_step

LAUNCHERS = ('train', 'dist', 'slurm')
# The top-1 key of mmpretrain's Accuracy metric, in percent, as mmengine logs it.
ACCURACY_KEY = 'accuracy/top1'
#: A config's ``default_scope`` -> the sweep's task.
SCOPE_TASKS = {'mmpretrain': 'cls', 'mmseg': 'seg', 'mmdet': 'det'}
#: ``--peers``: the backbones of the toy baselines, ``configs/toy/<head>_<peer>_toy_baseline.py``.
PEERS = ('pvtv2_b1', 'swin_t', 'r18')
PEER_HEADS = {'seg': 'upernet', 'det': 'maskrcnn'}
TOY_CONFIGS = osp.join(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))),
                       'configs', 'toy')
#: Per tested task: the table's headline metrics (name, key of tools/test.py's
#: --metrics-json), their decimals, and the per-class tables of test.log in the report.
TEST_METRICS = {
    'seg': dict(headline=(('mIoU (%)', 'mIoU'), ('aAcc (%)', 'aAcc'), ('mAcc (%)', 'mAcc')),
                digits=2, classwise=('IoU',)),
    'det': dict(headline=(('bbox AP', 'coco/bbox_mAP'), ('bbox AP50', 'coco/bbox_mAP_50'),
                          ('segm AP', 'coco/segm_mAP')),
                digits=3, classwise=('bbox AP', 'bbox AP50')),
}
# A planned run's keys that its record repeats.
RUN_KEYS = ('variant', 'kind', 'seed', 'attn_cfg', 'config', 'work_dir')
# Past any iteration or epoch: the evaluation is tools/test.py's, not one in training.
NO_VAL = 'train_cfg.val_begin=1000000'


def config_task(config):
    from mmengine.config import Config
    scope = Config.fromfile(config).get('default_scope')
    if scope not in SCOPE_TASKS:
        raise ValueError(f'default_scope {scope!r} is none of {", ".join(SCOPE_TASKS)}')
    return SCOPE_TASKS[scope]


def peer_config(task, peer):
    return osp.relpath(osp.join(TOY_CONFIGS, f'{PEER_HEADS[task]}_{peer}_toy_baseline.py'))


def safe_name(variant):
    """'lam=2.5' -> 'lam2p5'."""
    return re.sub(r'[^A-Za-z0-9_]', '', variant.replace('.', 'p'))


def write_variant_configs(config, variants, out_dir):
    """{variant: path} of one config per variant inheriting ``config``, its attn_cfg merged."""
    folder = osp.join(out_dir, 'configs')
    os.makedirs(folder, exist_ok=True)
    stem = osp.splitext(osp.basename(config))[0]
    paths = {}
    for name, attn_cfg in variants:
        path = osp.join(folder, f'{stem}__{safe_name(name)}.py')
        with open(path, 'w') as f:
            f.write(f'# Written by tools/ablate.py: {config} with the ablation variant '
                    f'{name!r}.\n'
                    f'_base_ = [{osp.abspath(config)!r}]\n'
                    f'model = dict(backbone=dict(attn_cfg={attn_cfg!r}))\n')
        paths[name] = path
    return paths


def run_work_dir(out_dir, variant, seed):
    return osp.join(out_dir, 'work_dirs', safe_name(variant), f'seed{seed}')


def _launch(launcher, tool, args, gpus, partition, job_name):
    positional = 2 if tool == 'test' else 1
    if launcher == 'train':
        return ['python', f'tools/{tool}.py'] + args
    if launcher == 'dist':
        return [f'tools/dist_{tool}.sh'] + args[:positional] + [str(gpus)] + args[positional:]
    if launcher == 'slurm':
        return [f'GPUS={gpus}', f'tools/slurm_{tool}.sh', partition, job_name] + args
    raise ValueError(f'--launcher must be one of {", ".join(LAUNCHERS)}, got {launcher!r}')


def train_command(launcher, config, work_dir, seed, gpus=8, partition='PARTITION',
                  job_name='ablate', options=(), resume=False):
    args = ([config, work_dir] if launcher == 'slurm' else [config, '--work-dir', work_dir])
    args += ['--resume'] * resume + ['--cfg-options', f'randomness.seed={seed}', *options]
    return _launch(launcher, 'train', args, gpus, partition, job_name)


def test_command(launcher, task, config, work_dir, gpus=8, partition='PARTITION',
                 job_name='ablate', options=()):
    options = ['test_evaluator.classwise=True'] * (task == 'det') + list(options)
    args = [config, '@CKPT', '--work-dir', osp.join(work_dir, 'test'), '--metrics-json',
            osp.join(work_dir, 'metrics.json')] + ['--cfg-options'] * bool(options) + options
    line = shlex.join(_launch(launcher, 'test', args, gpus, partition, job_name))
    checkpoint = f'"$(cat {shlex.quote(osp.join(work_dir, "last_checkpoint"))})"'
    return (line.replace('@CKPT', checkpoint) + ' > '
            + shlex.quote(osp.join(work_dir, 'test.log')) + ' 2>&1')


def plan_runs(config, variants, seeds, out_dir, launcher='train', gpus=8,
              partition='PARTITION', peers=(), extras=(), task='cls', options=()):
    """Write the variant configs and ``commands.sh``; return the planned runs, seed by seed
    (dicts with ``variant`` (the row's name), ``kind`` (variant, peer or extra), ``seed``,
    ``attn_cfg``, ``config``, ``work_dir``, ``command``: a shell line).

    ``peers`` are names of :data:`PEERS`, ``extras`` (name, config path) pairs, ``options``
    ``--cfg-options`` words for every run (training and test).
    """
    configs = write_variant_configs(config, variants, out_dir)
    rows = ([('variant', name, configs[name], attn_cfg) for name, attn_cfg in variants]
            + [('peer', peer, peer_config(task, peer), None) for peer in peers]
            + [('extra', name, path, None) for name, path in extras])
    runs, tested = [], task in TEST_METRICS
    for seed in seeds:
        for kind, name, row_config, attn_cfg in rows:
            work_dir = run_work_dir(out_dir, name, seed)
            job_name = f'ablate_{safe_name(name)}_s{seed}'
            words = train_command(launcher, row_config, work_dir, seed, gpus, partition,
                                  job_name, [NO_VAL] * tested + list(options), resume=tested)
            command = shlex.join(words)
            if tested:
                command += ' && ' + test_command(launcher, task, row_config, work_dir, gpus,
                                                 partition, job_name, options)
            runs.append(dict(variant=name, kind=kind, seed=seed, attn_cfg=attn_cfg,
                             config=row_config, work_dir=work_dir, command=command))
    with open(osp.join(out_dir, 'commands.sh'), 'w') as f:
        f.write('#!/usr/bin/env bash\n# Written by tools/ablate.py; run from the '
                'repository root.\nset -e\n')
        f.write(''.join(run['command'] + '\n' for run in runs))
    return runs


def metrics_path(run):
    return osp.join(run['work_dir'], 'metrics.json')


def latest_scalars(work_dir, key='loss'):
    """The ``<timestamp>/vis_data/scalars.json`` (mmengine's LocalVisBackend: a JSON record a
    line) of the latest run in ``work_dir`` that logged ``key``, or None."""
    for path in sorted(glob.glob(osp.join(work_dir, '*', 'vis_data', 'scalars.json')),
                       reverse=True):
        with open(path) as f:
            if f'"{key}"' in f.read():
                return path
    return None


def read_scalars(path):
    train, val = [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            record = json.loads(line)
            if ACCURACY_KEY in record:
                val.append(record)
            elif 'loss' in record:
                train.append(record)
    return train, val


def collect_run(run, num_classes):
    """A finished classification run's record, or None before its first validation."""
    path = latest_scalars(run['work_dir'], ACCURACY_KEY)
    if path is None:
        return None
    train, val = read_scalars(path)
    losses = [record['loss'] for record in train]
    steps = [record['step'] for record in train]
    return dict(**{key: run[key] for key in RUN_KEYS}, scalars=path,
                final_acc=val[-1][ACCURACY_KEY] / 100, final_step=val[-1]['step'],
                early_acc=val[0][ACCURACY_KEY] / 100, early_step=val[0]['step'],
                losses=losses, loss_steps=steps,
                # Logged losses are means over the logger interval already: a shorter
                # window of records covers as many iterations as the toy's.
                takeoff_step=takeoff_step(losses, num_classes, window=min(5, len(losses)),
                                          steps=steps) if losses else None)


def log_tables(path):
    """(section, header cells, rows of cells) of each ASCII table of a log; the section is the
    iou type of CocoMetric's last ``Evaluating bbox...`` line before it, else None."""
    tables, section, table = [], None, None
    with open(path) as f:
        for line in f:
            if line.startswith('|'):
                cells = [cell.strip() for cell in line.strip().strip('|').split('|')]
                if table is None:
                    table = (section, cells, [])
                    tables.append(table)
                else:
                    table[2].append(cells)
            elif not line.startswith('+'):
                table = None
                found = re.search(r'Evaluating (\w+)\.\.\.', line)
                section = found.group(1) if found else section
    return tables


def classwise_results(path, task):
    """{'IoU': {class: value}} (seg) or {'bbox AP': ..., 'segm AP50': ...} (det) from the
    per-class tables of ``tools/test.py``'s log."""
    columns = ({'Class': {'IoU': 'IoU', 'Acc': 'Acc'}} if task == 'seg'
               else {'category': {'AP': 'mAP', 'AP50': 'mAP_50'}})
    out = {}
    for section, header, rows in log_tables(path):
        for name, column in columns.get(header[0], {}).items():
            key = name if task == 'seg' else f'{section} {name}'
            index = header.index(column)
            out[key] = {row[0]: float(row[index]) for row in rows}
    return out


def collect_test_run(run, task):
    """A finished segmentation or detection run's record, or None without metrics.json."""
    if not osp.isfile(metrics_path(run)):
        return None
    with open(metrics_path(run)) as f:
        metrics = json.load(f)
    scalars = latest_scalars(run['work_dir'])
    train = read_scalars(scalars)[0] if scalars else []
    return dict(**{key: run[key] for key in RUN_KEYS}, metrics=metrics,
                classwise=classwise_results(osp.join(run['work_dir'], 'test.log'), task),
                final_losses={k: v for k, v in (train[-1] if train else {}).items()
                              if 'loss' in k},
                losses=[record['loss'] for record in train],
                loss_steps=[record['step'] for record in train])


def model_params(config):
    from ..analysis.model_zoo import build_from_config, count_parameters
    model, _ = build_from_config(config)
    return count_parameters(model.backbone) / 1e6, count_parameters(model) / 1e6


def config_num_classes(config):
    from mmengine.config import Config
    cfg = Config.fromfile(config)
    try:
        return int(cfg.model.head.num_classes)
    except (AttributeError, KeyError, TypeError):
        raise ValueError(f'--config {config!r}: model.head.num_classes not found; the real-'
                         f'data sweep needs a classification config') from None
