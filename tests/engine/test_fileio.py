"""The ``atomic_local`` backend keeps the previous checkpoint when killed mid-write."""
import os
import os.path as osp
import signal
import sys

import pytest
import torch
from _runner_helpers import DIES_MID_WRITE
from _shared import run_tool

from lapformer_mm.checkpoint import safe_load
from lapformer_mm.engine import atomic_write_bytes

KILL_DURING_SAVE = DIES_MID_WRITE + '''
import builtins, sys

import torch
from mmengine.runner.checkpoint import save_checkpoint

import lapformer_mm  # noqa: F401  (mmengine's own write must stay as it was)

mode, path = sys.argv[1], sys.argv[2]
backend_args = dict(backend='atomic_local') if mode == 'atomic' else None
save_checkpoint({'state_dict': {'w': torch.zeros(4096)}, 'meta': {'epoch': 1}}, path,
                backend_args=backend_args)

builtins.open = open_dying_mid_write(builtins.open, os.path.dirname(path))
save_checkpoint({'state_dict': {'w': torch.ones(4096)}, 'meta': {'epoch': 2}}, path,
                backend_args=backend_args)
'''


def kill_during_save(tmp_path, mode):
    script = tmp_path / 'kill_during_save.py'
    script.write_text(KILL_DURING_SAVE)
    path = str(tmp_path / 'ckpt' / 'latest.pth')
    run_tool([sys.executable, script, mode, path], timeout=120, returncode=-signal.SIGKILL)
    return path


def test_mmengine_in_place_save_killed_mid_write_corrupts_the_file(tmp_path):
    """mmengine's default (unchanged by the import) truncates the old file first."""
    path = kill_during_save(tmp_path, 'in_place')
    with pytest.raises(RuntimeError, match='latest.pth'):
        safe_load(path)


def test_atomic_save_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    path = kill_during_save(tmp_path, 'atomic')
    checkpoint = safe_load(path)
    assert checkpoint['meta']['epoch'] == 1
    assert torch.equal(checkpoint['state_dict']['w'], torch.zeros(4096))
    leftovers = [f for f in os.listdir(osp.dirname(path)) if f != 'latest.pth']
    assert len(leftovers) == 1 and leftovers[0].endswith('.tmp')


def test_atomic_write_replaces_whole_file_and_cleans_up_on_error(tmp_path):
    target = tmp_path / 'sub' / 'f.bin'
    atomic_write_bytes(b'old', target)
    atomic_write_bytes(b'new contents', target)
    assert target.read_bytes() == b'new contents'

    class Unwritable:
        def __len__(self):
            return 1

    with pytest.raises(TypeError):
        atomic_write_bytes(Unwritable(), target)
    assert target.read_bytes() == b'new contents'
    assert os.listdir(target.parent) == ['f.bin']
