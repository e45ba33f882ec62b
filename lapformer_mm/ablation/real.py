"""The ablation variants on a real classification config: one config per variant, the
training commands, and the metrics of the finished work_dirs in the sweep's table.

Layout under the sweep's ``out`` folder::

    configs/<config>__<variant>.py        _base_ = the given config, + the variant's attn_cfg
    work_dirs/<variant>/seed<S>/          one mmengine work_dir per run (tools/train.py)
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


def safe_name(variant):
    """A file-name form of a variant name: 'lam=2.5' -> 'lam2p5'."""
    return re.sub(r'[^A-Za-z0-9_]', '', variant.replace('.', 'p'))


def write_variant_configs(config, variants, out_dir):
    """One config per variant under ``out_dir/configs``, inheriting ``config`` and
    setting ``model.backbone.attn_cfg`` (merged into the config's own); {variant: path}."""
    if not osp.isfile(config):
        raise FileNotFoundError(f'--config: no such file {config!r}')
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


def train_command(launcher, config, work_dir, seed, gpus=8, partition='PARTITION',
                  job_name='ablate'):
    """The command (a list of words) that trains ``config`` into ``work_dir`` from ``seed``
    with ``tools/train.py``, ``tools/dist_train.sh`` or ``tools/slurm_train.sh``."""
    options = ['--cfg-options', f'randomness.seed={seed}']
    if launcher == 'train':
        return ['python', 'tools/train.py', config, '--work-dir', work_dir] + options
    if launcher == 'dist':
        return ['tools/dist_train.sh', config, str(gpus), '--work-dir', work_dir] + options
    if launcher == 'slurm':
        return ([f'GPUS={gpus}', 'tools/slurm_train.sh', partition, job_name, config,
                 work_dir] + options)
    raise ValueError(f'--launcher must be one of {", ".join(LAUNCHERS)}, got {launcher!r}')


def plan_runs(config, variants, seeds, out_dir, launcher='train', gpus=8,
              partition='PARTITION'):
    """Write the variant configs and ``commands.sh``; return the planned runs (dicts with
    ``variant``, ``seed``, ``config``, ``work_dir``, ``command``: a shell line)."""
    configs = write_variant_configs(config, variants, out_dir)
    runs = []
    for name, attn_cfg in variants:
        for seed in seeds:
            work_dir = run_work_dir(out_dir, name, seed)
            words = train_command(launcher, configs[name], work_dir, seed, gpus, partition,
                                  job_name=f'ablate_{safe_name(name)}_s{seed}')
            runs.append(dict(variant=name, seed=seed, attn_cfg=attn_cfg,
                             config=configs[name], work_dir=work_dir,
                             command=shlex.join(words)))
    with open(osp.join(out_dir, 'commands.sh'), 'w') as f:
        f.write('#!/usr/bin/env bash\n# Written by tools/ablate.py; run from the '
                'repository root.\nset -e\n')
        f.write(''.join(run['command'] + '\n' for run in runs))
    return runs


def latest_scalars(work_dir):
    """The ``<timestamp>/vis_data/scalars.json`` of the latest run in ``work_dir``, or None.

    mmengine's LocalVisBackend writes one JSON object per line there: training records
    with ``loss``, ``iter`` and ``step`` (the iteration) every logger interval, and
    validation records with the metrics and ``step`` (the epoch for epoch-based loops).
    """
    found = sorted(glob.glob(osp.join(work_dir, '*', 'vis_data', 'scalars.json')))
    return found[-1] if found else None


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
    """The finished run's record (final and first-validation accuracy as fractions,
    training losses, take-off step), or None when its work_dir has no validation yet."""
    path = latest_scalars(run['work_dir'])
    if path is None:
        return None
    train, val = read_scalars(path)
    if not val:
        return None
    losses = [record['loss'] for record in train]
    steps = [record['step'] for record in train]
    return dict(variant=run['variant'], seed=run['seed'], attn_cfg=run['attn_cfg'],
                work_dir=run['work_dir'], scalars=path,
                final_acc=val[-1][ACCURACY_KEY] / 100, final_step=val[-1]['step'],
                early_acc=val[0][ACCURACY_KEY] / 100, early_step=val[0]['step'],
                losses=losses, loss_steps=steps,
                # Logged losses are means over the logger interval already: a shorter
                # window of records covers as many iterations as the toy's.
                takeoff_step=takeoff_step(losses, num_classes, window=min(5, len(losses)),
                                          steps=steps) if losses else None)


def config_num_classes(config):
    """``model.head.num_classes`` of a classification config (for the take-off level)."""
    from mmengine.config import Config
    cfg = Config.fromfile(config)
    try:
        return int(cfg.model.head.num_classes)
    except (AttributeError, KeyError, TypeError):
        raise ValueError(f'--config {config!r}: model.head.num_classes not found; the real-'
                         f'data sweep needs a classification config') from None
