"""Train from an mmdet, mmseg or mmpretrain config (mmdet's ``tools/train.py`` interface),
with the config and the run's inputs checked before anything is built (one message, exit
status 2), ``--amp`` on CPU and ``--launcher pytorch`` without CUDA (gloo).
"""
import argparse
import gc
import os
import os.path as osp
import sys
import warnings
import weakref

import torch
import torch.distributed as dist
from mmengine.config import Config, DictAction
from mmengine.logging import print_log
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

from lapformer_mm.models import check_model_cfg
from lapformer_mm.models.validation import ConfigError
from lapformer_mm.preflight import InputCheckError, check_config_inputs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train a detector or segmentor')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument('--amp', action='store_true',
                        help='enable automatic-mixed-precision training')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help='scale the LR by (total batch size / auto_scale_lr.base_batch_size)')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from this checkpoint; without a path, from the latest '
                        'checkpoint in the work directory')
    return parse_run_args(parser, argv)


def parse_run_args(parser, argv):
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value (e.g. train_cfg.max_epochs=1)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    # torch.distributed.launch passes --local-rank; torchrun sets LOCAL_RANK.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault('LOCAL_RANK', str(args.local_rank))
    return args


def enable_amp(cfg):
    """mmengine's ``AmpOptimWrapper`` on a GPU, ``CPUAmpOptimWrapper`` on CPU (which mmengine's
    refuses; bf16, or fp16 with ``optim_wrapper.dtype=float16``)."""
    from mmengine.device import get_device
    wanted = 'CPUAmpOptimWrapper' if get_device() == 'cpu' else 'AmpOptimWrapper'
    current = cfg.optim_wrapper.get('type', 'OptimWrapper')
    if current == wanted:
        return
    if current not in ('OptimWrapper', 'AmpOptimWrapper', 'CPUAmpOptimWrapper'):
        raise ConfigError(f'--amp replaces the optimizer wrapper with {wanted}, but the config '
                          f'sets optim_wrapper.type={current!r}')
    cfg.optim_wrapper.type = wanted
    cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    if wanted == 'CPUAmpOptimWrapper':
        dtype = cfg.optim_wrapper.get('dtype', 'bfloat16')
        scale = ('no loss scale; optim_wrapper.dtype=float16 for fp16' if dtype == 'bfloat16'
                 else 'dynamic loss scale')
        print_log(f'--amp on CPU: CPUAmpOptimWrapper, {dtype} autocast ({scale})',
                  logger='current')


def load_cfg(args):
    """The config with ``--cfg-options``, ``--launcher`` and ``--work-dir`` applied, its model
    checked."""
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:  # mmdet's default
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    check_model_cfg(cfg.model)
    return cfg


def build_cfg(args):
    cfg = load_cfg(args)
    if args.amp:
        enable_amp(cfg)
    if args.auto_scale_lr:
        if 'base_batch_size' not in (cfg.get('auto_scale_lr') or {}):
            raise ConfigError('--auto-scale-lr needs `auto_scale_lr = dict(enable=False, '
                              'base_batch_size=N)` in the config')
        cfg.auto_scale_lr.enable = True
    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    return cfg


def checked_cfg(build, args, mode):
    """``build(args)``, its inputs checked for a ``mode`` run: a problem ends the run before
    anything is built, its message alone on stderr and exit status 2."""
    try:
        cfg = build(args)
        check_config_inputs(cfg, mode)
    except (FileNotFoundError, InputCheckError, ConfigError) as err:
        print(f'error: {err}', file=sys.stderr)
        raise SystemExit(2) from None
    return cfg


def setup_cpu_distributed(cfg):
    """``--launcher pytorch`` without CUDA, where mmengine's launcher calls
    ``torch.cuda.set_device``: a gloo group started here makes mmengine skip its own, and a
    wrapper without device ids gives CPU DDP."""
    if cfg.launcher != 'pytorch' or torch.cuda.is_available():
        return
    if not dist.is_initialized():
        dist.init_process_group(backend='gloo', rank=int(os.environ['RANK']),
                                world_size=int(os.environ['WORLD_SIZE']))
    if cfg.get('model_wrapper_cfg') is None:
        cfg.model_wrapper_cfg = dict(
            type='MMDistributedDataParallel', device_ids=None, broadcast_buffers=False,
            find_unused_parameters=cfg.get('find_unused_parameters', False))


def close_distributed():
    """Destroy the process groups while the interpreter is whole: a gloo thread releasing a
    collective's tensors at finalization aborts the process. That joins the threads once
    nothing holds the group: the caller drops its runner (its DDP model holds it), the
    collection here frees the runner's reference cycles."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    gc.collect()
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    if world() is not None:
        warnings.warn('the default process group outlives destroy_process_group (something '
                      'still holds it, e.g. a model wrapped in DDP)', RuntimeWarning,
                      stacklevel=2)


def build_runner(cfg):
    return RUNNERS.build(cfg) if 'runner_type' in cfg else Runner.from_cfg(cfg)


def main(argv=None):
    args = parse_args(argv)
    cfg = checked_cfg(build_cfg, args, 'train')
    setup_cpu_distributed(cfg)
    build_runner(cfg).train()
    close_distributed()


if __name__ == '__main__':
    main()
