"""Shared by the checkpoint, resume and amp tests: a tiny Runner, a code-running payload."""
import itertools
import math
import os
import os.path as osp

import torch
import torch.nn as nn
from mmengine.model import BaseModel
from mmengine.runner import Runner

from lapformer_mm.checkpoint import TRUST_ENV

_RUNNER_IDS = itertools.count()


class RunsCode:
    """Unpickling this creates a marker file: stands for any code execution."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}', ))


def assert_refused_with_hint(message, path):
    """``message`` is lapformer_mm's refusal of ``path``, naming the file and the opt-in."""
    assert 'Refused to load checkpoint' in message and osp.basename(path) in message
    assert 'unpickling them could run code' in message
    assert f'{TRUST_ENV}=1' in message and 'plain state dict' in message


class TinyModel(BaseModel):

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        out = self.linear(inputs)
        return dict(loss=out.pow(2).mean()) if mode == 'loss' else out


def make_runner(work_dir, max_epochs, num_samples=8, checkpoint=None, runner_cls=Runner,
                **kwargs):
    """TinyModel, batches of 2, AdamW, a checkpoint every epoch (``checkpoint``: more args)."""
    dataset = [dict(inputs=torch.full((2,), float(i))) for i in range(num_samples)]
    # The message hub is named after the experiment, by default the start time to the second:
    # two runners started within a second would share its record of the kept checkpoints.
    kwargs.setdefault('experiment_name', f'tiny_{next(_RUNNER_IDS)}')
    return runner_cls(
        model=TinyModel(), work_dir=str(work_dir),
        train_dataloader=dict(dataset=dataset, batch_size=2,
                              collate_fn=dict(type='default_collate'),
                              sampler=dict(type='DefaultSampler', shuffle=True)),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=0.01)),
        param_scheduler=[dict(type='MultiStepLR', milestones=[1])],
        train_cfg=dict(by_epoch=True, max_epochs=max_epochs),
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=1,
                                           **(checkpoint or {}))),
        randomness=dict(seed=0), **kwargs)


# Prepended to the code of a child process: a file write that the process does not survive.
DIES_MID_WRITE = '''
import os
import signal


def open_dying_mid_write(real_open, directory):
    """``open`` whose files opened for writing in ``directory`` SIGKILL the process halfway
    through their first write."""
    def open_(file, mode='r', *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        inside = os.path.dirname(os.path.abspath(str(file))) == os.path.abspath(directory)
        return DiesMidWrite(f) if inside and 'w' in mode else f
    return open_


class DiesMidWrite:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def write(self, data):
        self.f.write(data[:len(data) // 2])
        self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name):
        return getattr(self.f, name)
'''


def skipped_steps(scaler_state):
    """Steps a dynamic loss scale skipped: it starts at 2^16 and halves on each overflow."""
    skipped = 16 - math.log2(scaler_state['scale'])
    assert skipped == int(skipped), scaler_state
    return int(skipped)
