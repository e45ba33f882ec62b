"""tools/train.py: --auto-scale-lr, --amp, a resume after SIGKILL, unsafe checkpoints."""
import glob
import hashlib
import json
import math
import os
import os.path as osp
import re
import signal
import sys
import textwrap

import pytest
import torch
from _runner_helpers import DIES_MID_WRITE, assert_refused_with_hint, skipped_steps
from _shared import ROOT, TOOLS, TOY_CONFIG, run_tool, toy_data_options, toy_run_options
from mmengine.config import Config

from lapformer_mm.checkpoint import safe_load
from lapformer_mm.cli import train as train_tool
from lapformer_mm.models.validation import ConfigError


@pytest.mark.usefixtures('mmdet_scope')
def test_train_tool_names_an_auto_scale_lr_it_cannot_apply(tmp_path):
    cfg_path = tmp_path / 'no_scale.py'
    cfg_path.write_text(f"_base_ = ['{TOY_CONFIG}']\nauto_scale_lr = None\n")
    with pytest.raises(ConfigError, match='--auto-scale-lr'):
        train_tool.build_cfg(train_tool.parse_args([str(cfg_path), '--auto-scale-lr']))


@pytest.mark.usefixtures('mmdet_scope')
def test_train_tool_resume_refuses_code_running_checkpoint(evil, toy_coco, tmp_path):
    path, marker = evil
    with pytest.raises(RuntimeError) as info:
        train_tool.main([TOY_CONFIG, '--resume', path, '--work-dir', str(tmp_path / 'work'),
                        '--cfg-options', *toy_data_options(toy_coco)])
    assert_refused_with_hint(str(info.value), path)
    assert not marker.exists()


def amp_train(toy_coco, work, dtype, max_epochs):
    """``tools/train.py --amp``, 4 iterations per epoch; the log and the last checkpoint."""
    log = run_tool(
        [sys.executable, osp.join(TOOLS, 'train.py'), TOY_CONFIG, '--amp', '--work-dir', work,
         '--cfg-options', *toy_data_options(toy_coco), 'train_dataloader.dataset.indices=4',
         'train_dataloader.batch_size=1', f'train_cfg.max_epochs={max_epochs}',
         'train_cfg.val_interval=100', 'default_hooks.logger.interval=1',
         'default_hooks.checkpoint.interval=100', f'optim_wrapper.dtype={dtype}'], timeout=900)
    wrapper = 'AmpOptimWrapper' if torch.cuda.is_available() else 'CPUAmpOptimWrapper'
    assert f"type='{wrapper}'" in log
    losses = [float(line.split(' loss: ')[1].split()[0])
              for line in log.splitlines() if ' loss: ' in line]
    checkpoint = safe_load(sorted(glob.glob(osp.join(work, 'epoch_*.pth')))[-1])
    assert checkpoint['meta']['iter'] == 4 * max_epochs
    assert all(bool(torch.isfinite(t).all()) for t in checkpoint['state_dict'].values()
               if t.is_floating_point())
    return wrapper, losses, checkpoint


@pytest.mark.slow
@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_train_tool_amp_trains_finite_in_both_16_bit_types(toy_coco, tmp_path, dtype):
    """4 iterations: finite; bf16 keeps no loss scale on CPU, fp16 skipped at most 3 steps."""
    wrapper, losses, checkpoint = amp_train(toy_coco, str(tmp_path / 'work'), dtype, 1)
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), losses
    if dtype == 'float16':
        assert skipped_steps(checkpoint['optimizer']['loss_scaler']) <= 3
    else:
        # mmengine's GPU wrapper keeps an (idle) scaler for bf16 too; the CPU one has none.
        assert (checkpoint['optimizer'].get('loss_scaler') is None
                or wrapper == 'AmpOptimWrapper')


def test_amp_refuses_to_replace_another_wrapper_type():
    cfg = Config(dict(optim_wrapper=dict(type='ApexOptimWrapper', optimizer=dict(type='SGD'))))
    with pytest.raises(ConfigError, match='optim_wrapper.type'):
        train_tool.enable_amp(cfg)


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
    return hashlib.sha256(torch.as_tensor(t).cpu().contiguous().numpy().tobytes()).hexdigest()


def probe_env(base):
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


def logged_lrs(log):
    """{(epoch, step): 'lr' string} of the training log lines."""
    return {(int(e), int(s)): lr for e, s, lr in re.findall(
        r'Epoch\(train\)\s+\[(\d+)\]\[\s*(\d+)/\d+\].*?\slr: (\S+)', log)}


@pytest.mark.slow(seconds=30)
def test_sigkill_while_saving_keeps_the_previous_checkpoint_and_resume_continues_exactly(
        run_setup):
    """max_keep_ckpts=1, SIGKILL while writing epoch_2.pth: epoch_1.pth intact; --resume
    continues step for step as the killed run (bit-identical AdamW state)."""
    base, root, config = run_setup
    work = osp.join(base, 'work')
    one_kept = ['default_hooks.checkpoint.max_keep_ckpts=1']
    killed_log = run_tool(
        [sys.executable, osp.join(TOOLS, 'train.py'), osp.join(base, 'toy_kill_save.py'),
         '--work-dir', work] + toy_run_options(root, 2) + one_kept,
        extra_env=probe_env(base), timeout=300, returncode=-signal.SIGKILL)
    assert 'SafeCheckpointHook' in killed_log
    assert sorted(f for f in os.listdir(work) if f.endswith('.pth')) == ['epoch_1.pth']
    with open(osp.join(work, 'last_checkpoint')) as f:
        assert f.read() == osp.join(work, 'epoch_1.pth')
    saved = safe_load(osp.join(work, 'epoch_1.pth'))
    assert saved['meta']['iter'] == 4 and saved['meta']['epoch'] == 1

    log = run_tool(
        [sys.executable, osp.join(TOOLS, 'train.py'), config, '--work-dir', work, '--resume'] +
        toy_run_options(root, 2) + one_kept, extra_env=probe_env(base), timeout=300)
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
    assert sorted(resumed) == [(2, 1), (2, 2), (2, 3), (2, 4)]
    assert all(killed[step] == resumed[step] for step in resumed)
    assert sorted(f for f in os.listdir(work) if f.endswith('.pth')) == ['epoch_2.pth']
    assert safe_load(osp.join(work, 'epoch_2.pth'))['meta']['iter'] == 8
