"""Smoke-run the full-size configs on a few synthetic images at COCO's training size.

Per config two training iterations and one evaluation through ``tools/train.py`` (data roots
under ``WORK_DIR/data``, no ImageNet checkpoint), reporting each iteration's and image's time,
the peak resident memory and the load average (``WORK_DIR/summary.json``; docs/full_size.md).
"""
import argparse
import glob
import json
import os
import os.path as osp
import re
import subprocess
import sys
import time

from lapformer_mm.cli import make_toy_coco

DEFAULT_CONFIGS = ['configs/maskrcnn_lapformer_t.py', 'configs/retinanet_lapformer_t.py',
                   'configs/upernet_lapformer_t_ade20k.py', 'configs/fpn_lapformer_t_ade20k.py']
NUM_TRAIN, NUM_VAL = 4, 2
# An iteration's line of mmengine's log, 'Epoch(train) [1][2/2] ... eta: ... time: 51.4'
# or 'Iter(val) [2/2] eta: ... time: 4.3'; the summary line of an evaluation has no eta.
LOG_TIME = re.compile(r'\((train|val)\)\s+(?:\[\d+\])?\[\s*\d+/\d+\].*?\beta: \S+\s+time: ([\d.]+)')


def write_data(data_dir, img_size):
    make_toy_coco.main(['--layout', 'official', '--img-size', *map(str, img_size),
                        '--num-train', str(NUM_TRAIN), '--num-val', str(NUM_VAL),
                        '--out', osp.join(data_dir, 'coco'),
                        '--seg-out', osp.join(data_dir, 'ade', 'ADEChallengeData2016')])


def smoke_options(cfg, data_dir):
    from lapformer_mm.preflight import data_root_options

    # The configs read data/<set>; the synthetic sets mirror that under data_dir.
    options = data_root_options(cfg, ('train', 'val', 'test'), lambda root: osp.join(
        data_dir, osp.relpath(osp.normpath(root), 'data')))
    if 'max_epochs' in cfg.train_cfg:
        options += ['train_cfg.max_epochs=1', 'train_cfg.val_interval=1']
    else:
        options += ['train_cfg.max_iters=2', 'train_cfg.val_interval=2']
    return options + ['model.backbone.init_cfg=None', 'default_hooks.logger.interval=1',
                      'log_processor.window_size=1']


def run_measured(cmd, log_path):
    start = time.perf_counter()
    with open(log_path, 'w') as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        # wait4's ru_maxrss covers the process and the descendants it waited for
        # (the dataloader workers): the largest of them, in KiB on Linux.
        _, status, usage = os.wait4(proc.pid, 0)
    return (os.waitstatus_to_exitcode(status), usage.ru_maxrss / 2**20,
            time.perf_counter() - start)


def parse_times(log_text):
    found = LOG_TIME.findall(log_text)
    return {mode: [float(s) for m, s in found if m == mode] for mode in ('train', 'val')}


def smoke(config, work_root, data_dir, keep_checkpoints):
    from mmengine.config import Config

    name = osp.splitext(osp.basename(config))[0]
    work_dir = osp.join(work_root, name)
    os.makedirs(work_dir, exist_ok=True)
    cfg = Config.fromfile(config)
    cmd = [sys.executable, '-m', 'lapformer_mm.cli.train', config, '--work-dir', work_dir,
           '--cfg-options', *smoke_options(cfg, data_dir)]
    load_before = os.getloadavg()
    log_path = osp.join(work_dir, 'smoke.log')
    code, peak_gib, wall = run_measured(cmd, log_path)
    with open(log_path) as f:
        times = parse_times(f.read())
    if not keep_checkpoints:
        for path in glob.glob(osp.join(work_dir, '*.pth')):
            os.remove(path)
    return dict(config=config, exit_code=code, train_iter_s=times['train'],
                val_image_s=times['val'], peak_rss_gib=round(peak_gib, 2),
                wall_s=round(wall, 1), load_before=[round(x, 2) for x in load_before],
                load_after=[round(x, 2) for x in os.getloadavg()], log=log_path,
                command=' '.join(cmd))


def markdown_row(result):
    train = ' / '.join(f'{t:.1f}' for t in result['train_iter_s']) or '-'
    val = ' / '.join(f'{t:.1f}' for t in result['val_image_s']) or '-'
    load = '{:.1f} → {:.1f}'.format(result['load_before'][0], result['load_after'][0])
    status = 'ok' if result['exit_code'] == 0 else f'exit {result["exit_code"]}'
    return (f'| {osp.basename(result["config"])} | {train} | {val} | '
            f'{result["peak_rss_gib"]:.1f} | {result["wall_s"]:.0f} | {load} | {status} |')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('configs', nargs='*', default=DEFAULT_CONFIGS,
                        help=f'configs to run (default: {" ".join(DEFAULT_CONFIGS)})')
    parser.add_argument('--work-dir', default='work_dirs/smoke_fullsize',
                        help='data, logs and summary.json go here')
    parser.add_argument('--img-size', type=int, nargs=2, default=[1333, 800],
                        metavar=('WIDTH', 'HEIGHT'), help='synthetic image size')
    parser.add_argument('--keep-checkpoints', action='store_true',
                        help='keep the checkpoints the runs save')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    work_root = osp.abspath(args.work_dir)
    data_dir = osp.join(work_root, 'data')
    write_data(data_dir, args.img_size)
    print('| config | train iterations (s) | eval per image (s) | peak RSS (GiB) | wall (s) '
          '| load (1 min) | |\n|---|---|---|---|---|---|---|', flush=True)
    results = []
    for config in args.configs:
        results.append(smoke(config, work_root, data_dir, args.keep_checkpoints))
        print(markdown_row(results[-1]), flush=True)
    with open(osp.join(work_root, 'summary.json'), 'w') as f:
        json.dump(dict(img_size=args.img_size, threads=os.cpu_count(), results=results), f,
                  indent=2)
    failed = [r['config'] for r in results if r['exit_code'] != 0]
    if failed:
        print(f'failed: {", ".join(failed)} (logs under {work_root})', file=sys.stderr)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
