"""Ablate the attention options: every variant × seed, one table, one plot, one JSON. A toy
task (``--task``) trains here; for a real config (``--config``) the commands of every row and
seed are printed or run (``--run``), and ``--collect`` reads their work_dirs (docs/results.md).
"""
import argparse
import concurrent.futures
import ctypes
import datetime
import json
import multiprocessing
import os
import os.path as osp
import signal
import subprocess
import sys
import time

from lapformer_mm.ablation.real import (
    LAUNCHERS,
    PEERS,
    TEST_METRICS,
    collect_run,
    collect_test_run,
    config_num_classes,
    config_task,
    metrics_path,
    model_params,
    plan_runs,
)
from lapformer_mm.ablation.report import write_report
from lapformer_mm.ablation.tasks import TASKS, build_task
from lapformer_mm.ablation.variants import NAMED_VARIANTS, parse_variants
from lapformer_mm.cli import int_at_least, positive_float


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Ablation sweep of the attention options (toy task or real config)')
    source = parser.add_mutually_exclusive_group()
    source.add_argument('--task', choices=sorted(TASKS), default=None,
                        help='toy task trained here (default: same_colour)')
    source.add_argument('--config', help='classification, segmentation or detection config')
    parser.add_argument('--variants', nargs='+', default=['default'],
                        help=f'any of {", ".join(NAMED_VARIANTS)} or lam=V1,V2,...; '
                        'default and noglobal always run')
    parser.add_argument('--seeds', type=int_at_least(1), default=5,
                        help='seeds 0..N-1 per variant')
    parser.add_argument('--out', default='work_dirs/ablate', help='output folder')
    toy = parser.add_argument_group('toy task')
    toy.add_argument('--steps', type=int_at_least(1), default=600, help='steps per run')
    toy.add_argument('--warmup', type=int, default=30, help='linear LR warm-up steps')
    toy.add_argument('--batch-size', type=int_at_least(1), default=32)
    toy.add_argument('--lr', type=positive_float, default=1e-3, help='AdamW learning rate')
    toy.add_argument('--val-size', type=int_at_least(1), default=2000,
                     help='images of the fixed validation set')
    toy.add_argument('--early-step', type=int, default=None,
                     help='step of the early accuracy column (default: steps // 2)')
    toy.add_argument('--log-every', type=int_at_least(1), default=100,
                     help='progress interval (steps)')
    toy.add_argument('--resume', action='store_true', help='keep the finished runs of an '
                     'interrupted sweep with the same settings and run only the others')
    toy.add_argument('--report-only', action='store_true',
                     help='with --resume: write the report of the finished runs, train none')
    parser.add_argument('--threads', type=int_at_least(1), default=None,
                        help="torch's threads per run (default: torch's choice on the toy "
                        'task, 1 for --run)')
    parser.add_argument('--jobs', type=int_at_least(1), default=1,
                        help='runs at once, each in its own process')
    real = parser.add_argument_group('real config')
    real.add_argument('--launcher', choices=LAUNCHERS, default='train',
                      help='tools/train.py, tools/dist_train.sh or tools/slurm_train.sh')
    real.add_argument('--gpus', type=int_at_least(1), default=8,
                      help='GPUS of dist/slurm launchers')
    real.add_argument('--partition', default='PARTITION', help='Slurm partition')
    real.add_argument('--peers', nargs='+', choices=PEERS, default=[],
                      help='rows of the toy baselines of a segmentation or detection config')
    real.add_argument('--extra', nargs='+', default=[], metavar='NAME=CONFIG',
                      help='rows of other configs (e.g. architecture variants)')
    real.add_argument('--cfg-options', nargs='+', default=[], metavar='KEY=VALUE',
                      help="every run's --cfg-options (training and test)")
    real.add_argument('--run', action='store_true', help='run the commands here, --jobs at '
                      'once, skipping each run whose metrics.json is there; else print them')
    real.add_argument('--collect', action='store_true',
                      help="read the finished work_dirs' metrics into the table")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f'--warmup must be in [0, --steps={args.steps}), got {args.warmup}')
    if args.early_step is None:
        args.early_step = max(1, args.steps // 2)
    elif not 1 <= args.early_step <= args.steps:
        parser.error(f'--early-step must be in [1, --steps={args.steps}], got '
                     f'{args.early_step}')
    if args.config is None and (args.run or args.collect or args.peers or args.extra):
        parser.error('--run, --collect, --peers and --extra need --config')
    if args.config is not None:
        try:
            args.config_task = config_task(args.config)
        except (OSError, ValueError) as err:
            parser.error(f'--config {args.config}: {err}')
        if args.peers and args.config_task not in TEST_METRICS:
            parser.error('--peers: only segmentation and detection configs have peers')
    args.extras = [tuple(item.split('=', 1)) for item in args.extra]
    for item, extra in zip(args.extra, args.extras):
        if len(extra) != 2 or not osp.isfile(extra[1]):
            parser.error(f'--extra must be NAME=CONFIG with an existing CONFIG, got {item!r}')
    if args.report_only and not args.resume:
        parser.error('--report-only needs --resume')
    try:
        args.variant_cfgs = parse_variants(args.variants)
    except ValueError as err:
        parser.error(str(err))
    args.peers = list(dict.fromkeys(args.peers))
    names = [name for name, _ in args.variant_cfgs] + args.peers
    for name, _ in args.extras:
        if name in names:
            parser.error(f'--extra: the row name {name!r} is taken')
        names.append(name)
    return args


def _now():
    return datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')


# The settings that make runs of two sweeps the same runs.
RUN_SETTINGS = ('task', 'steps', 'warmup', 'batch_size', 'lr', 'val_size', 'early_step')


def _resumable_runs(path, settings):
    """({(variant, seed): run}, settings) of ``path`` if written with the same RUN_SETTINGS."""
    if not osp.exists(path):
        return {}, {}
    with open(path) as f:
        saved = json.load(f)
    differ = [key for key in RUN_SETTINGS if saved['settings'].get(key) != settings[key]]
    if differ:
        print(f'--resume: {path} has other settings ({", ".join(differ)}); starting over',
              flush=True)
        return {}, {}
    return {(run['variant'], run['seed']): run for run in saved['runs']}, saved['settings']


# One process of a --jobs sweep: its task, validation set and thread count, set once.
_WORKER = {}


def _stop_with_parent(parent):
    """Linux: a worker stops when the sweep's process dies (``kill PID``), not after its run."""
    if sys.platform.startswith('linux'):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the prctl call
            os._exit(1)


def _init_worker(task_name, val_size, threads, parent=None):
    import torch

    from lapformer_mm.ablation.toy import validation_set

    if parent is not None:
        _stop_with_parent(parent)
    if threads is not None:
        torch.set_num_threads(threads)
    task = build_task(task_name)
    _WORKER.update(task=task, val_set=validation_set(task, val_size))


def _train(name, attn_cfg, seed, prefix, options):
    from lapformer_mm.ablation.toy import train_run

    run = train_run(_WORKER['task'], attn_cfg, seed, val_set=_WORKER['val_set'],
                    progress=lambda text: print(prefix, text, flush=True), **options)
    return dict(variant=name, **run)


def _finished_runs(args, task_name, todo, options):
    """(index, prefix, run) of every job of ``todo`` as it finishes, here or in ``--jobs``
    processes."""
    worker_args = (task_name, args.val_size, args.threads)
    if args.jobs == 1:
        _init_worker(*worker_args)
        for index, name, attn_cfg, seed, prefix in todo:
            yield index, prefix, _train(name, attn_cfg, seed, prefix, options)
        return
    # spawn, not fork: a forked child of a process whose OpenMP pool ran can hang.
    with concurrent.futures.ProcessPoolExecutor(
            args.jobs, mp_context=multiprocessing.get_context('spawn'),
            initializer=_init_worker, initargs=worker_args + (os.getpid(),)) as pool:
        futures = {pool.submit(_train, name, attn_cfg, seed, prefix, options): (index, prefix)
                   for index, name, attn_cfg, seed, prefix in todo}
        for future in concurrent.futures.as_completed(futures):
            yield *futures[future], future.result()


def run_toy(args):
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    task_name = args.task or 'same_colour'
    task = build_task(task_name)
    seeds = list(range(args.seeds))
    total = len(args.variant_cfgs) * len(seeds)
    settings = dict(task=task_name, describe=task.describe(),
                    variants=[name for name, _ in args.variant_cfgs], seeds=seeds,
                    steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
                    lr=args.lr, val_size=args.val_size, early_step=args.early_step,
                    threads=torch.get_num_threads(), jobs=args.jobs, started=_now(),
                    load_average_start=os.getloadavg(), command=sys.argv)
    print(f'{task.describe()}; {len(args.variant_cfgs)} variants x {len(seeds)} seeds, '
          f'{args.steps} steps each, {torch.get_num_threads()} thread(s), '
          f'{args.jobs} at once', flush=True)
    os.makedirs(args.out, exist_ok=True)
    partial = osp.join(args.out, 'runs.partial.json')
    done, saved_settings = _resumable_runs(partial, settings) if args.resume else ({}, {})
    options = dict(steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
                   lr=args.lr, early_step=args.early_step, log_every=args.log_every)
    # Seed-major: an interrupted sweep has the same seeds of every variant.
    plan = [(index, name, attn_cfg, seed, f'[{index + 1}/{total} {name} seed {seed}]')
            for index, (seed, (name, attn_cfg)) in enumerate(
                (seed, variant) for seed in seeds for variant in args.variant_cfgs)]
    finished, start = {}, time.perf_counter()
    for index, name, _, seed, prefix in plan:
        if (name, seed) in done:
            finished[index] = done.pop((name, seed))
            print(f'{prefix} kept from {partial}', flush=True)
        elif args.report_only:
            settings.setdefault('missing', []).append([name, seed])
            print(f'{prefix} not run (--report-only)', flush=True)
    todo = [job for job in plan if job[0] not in finished and not args.report_only]
    for index, prefix, run in _finished_runs(args, task_name, todo, options):
        finished[index] = run
        took_off = ('never took off' if run['takeoff_step'] is None
                    else f"took off at step {run['takeoff_step']}")
        print(f"{prefix} final acc {100 * run['final_acc']:.1f} %, {took_off}, "
              f"{run['seconds']:.0f} s", flush=True)
        # For --resume; kept runs not reached yet stay in the file.
        with open(partial, 'w') as f:
            json.dump(dict(settings=settings, runs=[finished[i] for i in sorted(finished)]
                           + list(done.values())), f)
    runs = [finished[i] for i in sorted(finished)]
    if not runs:
        print(f'no finished run in {partial}', file=sys.stderr)
        return 1
    if args.report_only:
        # The sweep's own times, not this call's.
        settings.update(started=saved_settings.get('started'),
                        seconds=sum(run['seconds'] for run in runs),
                        load_average_start=saved_settings.get('load_average_start'))
    else:
        settings.update(seconds=time.perf_counter() - start)
    settings.update(finished=_now(), load_average_end=os.getloadavg())
    table, paths = write_report(
        runs, args.out, settings,
        plot_title=f"{settings['task']}: {args.steps} steps, warm-up {args.warmup}, "
        f'{len(seeds)} seeds')
    if osp.exists(partial) and not args.report_only:
        os.remove(partial)
    print(table)
    print(f"{total} runs in {settings['seconds'] / 60:.1f} min; wrote "
          + ', '.join(paths.values()))
    return 0


def run_commands(runs, jobs, threads):
    """Run each run's shell command, ``jobs`` at once, ``threads`` threads each, this
    interpreter as ``python``, the output in its work_dir's run.log; a run whose metrics.json
    is there is skipped. Returns the failed runs."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PATH=osp.dirname(sys.executable) + os.pathsep + os.environ.get('PATH', ''))
    todo = [run for run in runs if not osp.isfile(metrics_path(run))]
    print(f'running {len(todo)} of {len(runs)} runs ({len(runs) - len(todo)} finished '
          f'before), {jobs} at once, {threads} thread(s) each; output in each '
          "work_dir's run.log", flush=True)

    def run_one(run):
        os.makedirs(run['work_dir'], exist_ok=True)
        start = time.perf_counter()
        with open(osp.join(run['work_dir'], 'run.log'), 'w') as log:
            code = subprocess.run(run['command'], shell=True, stdout=log,
                                  stderr=subprocess.STDOUT, env=env).returncode
        return code, time.perf_counter() - start

    failed = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(run_one, run): run for run in todo}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            run, (code, seconds) = futures[future], future.result()
            result = f'{seconds:.0f} s' if code == 0 else (
                f"FAILED (exit {code}; {osp.join(run['work_dir'], 'run.log')})")
            print(f"[{done}/{len(todo)}] {run['variant']} seed {run['seed']}: {result}",
                  flush=True)
            if code:
                failed.append(run)
    return failed


def collect(args, runs, seeds):
    spec = TEST_METRICS.get(args.config_task)
    if spec is None:
        num_classes = config_num_classes(args.config)
    collected, missing = [], []
    for run in runs:
        record = collect_test_run(run, args.config_task) if spec else collect_run(
            run, num_classes)
        (collected if record else missing).append(record or run)
    for run in missing:
        print(f"not finished (no {'metrics.json' if spec else 'validation'} in "
              f"{run['work_dir']})", file=sys.stderr)
    if not collected:
        print('no finished run to collect', file=sys.stderr)
        return 1
    params = ({run['variant']: model_params(run['config'])
               for run in {run['variant']: run for run in collected}.values()}
              if spec else None)
    settings = dict(config=args.config, task=args.config_task,
                    variants=[n for n, _ in args.variant_cfgs], peers=args.peers,
                    extras=args.extras, cfg_options=args.cfg_options, seeds=seeds,
                    collected=_now(), missing=[[r['variant'], r['seed']] for r in missing])
    table, paths = write_report(collected, args.out, settings,
                                plot_title=osp.basename(args.config),
                                early_label='first validation acc (%)', spec=spec,
                                params=params)
    print(table)
    print('wrote ' + ', '.join(paths.values()))
    return 0


def run_real(args):
    seeds = list(range(args.seeds))
    runs = plan_runs(args.config, args.variant_cfgs, seeds, args.out, args.launcher,
                     args.gpus, args.partition, args.peers, args.extras, args.config_task,
                     args.cfg_options)
    status = 0
    if args.run or not args.collect:
        for run in runs:
            print(run['command'], flush=True)
        print(f"# {len(runs)} commands, also in {osp.join(args.out, 'commands.sh')}; then "
              f'the same arguments with --collect')
    if args.run:
        failed = run_commands(runs, args.jobs, args.threads or 1)
        status = int(bool(failed))
    if args.collect:
        status = max(status, collect(args, runs, seeds))
    return status


def main(argv=None):
    args = parse_args(argv)
    return run_real(args) if args.config else run_toy(args)


if __name__ == '__main__':
    sys.exit(main())
