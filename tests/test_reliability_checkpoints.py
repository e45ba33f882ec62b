"""Untrusted checkpoints are refused everywhere a user can pass a path.

Entry points: ``load_from`` and ``resume`` of ``SafeCheckpointRunner`` (what
``configs/_base_/safe_runtime.py`` selects), ``tools/train.py --resume``, tools/test.py
and tools/convert_cls_to_backbone.py (the backbone's ``init_cfg=dict(type='Pretrained', ...)``
and deprecated ``pretrained=``: tests/test_backbone_checkpoint.py). Each refusal must leave
the payload unrun, name the file and say how to allow a trusted one: torch's own refusal,
which names neither, does not pass these tests. The documented opt-in must actually work.
"""
import numpy as np
import pytest
import torch
from _runner_helpers import RunsCode, TinyModel, assert_refused_with_hint, make_runner
from _shared import TOY_CONFIG, toy_data_options

import lapformer_mm  # noqa: F401
from lapformer_mm.checkpoint import TRUST_ENV, safe_load
from lapformer_mm.cli import convert_cls_to_backbone
from lapformer_mm.cli import test as cli_test
from lapformer_mm.cli import train as cli_train
from lapformer_mm.engine import SafeCheckpointRunner

TINY = dict(embed_dims=[32, 32, 32, 32], num_heads=[1, 1, 1, 1], depths=[1, 1, 1, 1])


@pytest.fixture(autouse=True)
def mmdet_scope():
    """Build under mmdet's scope whatever an earlier test's Runner left as default scope."""
    from mmengine.registry import DefaultScope
    with DefaultScope.overwrite_default_scope('mmdet'):
        yield


class HarmlessCustomObject:
    """Not on the allowlist but harmless: what a trusted third-party checkpoint may hold."""

    def __init__(self):
        self.note = 'trusted'


@pytest.fixture
def evil(tmp_path):
    """(checkpoint path, marker path): a backbone state dict plus a code-running payload."""
    from lapformer_mm.models import LaplacianFormer
    marker = tmp_path / 'payload_ran'
    path = tmp_path / 'evil.pth'
    state = LaplacianFormer(arch=TINY).state_dict()
    torch.save({'state_dict': state, 'meta': {'x': RunsCode(marker)}}, path)
    return str(path), marker


def test_numpy_object_array_cannot_smuggle_a_payload(tmp_path):
    """numpy arrays are allowlisted (mmengine writes them); object arrays must not open a door."""
    marker = tmp_path / 'ran'
    payload = np.empty(1, dtype=object)
    payload[0] = RunsCode(marker)
    path = tmp_path / 'npobj.pth'
    torch.save({'state_dict': {}, 'meta': {'arr': payload}}, path)
    with pytest.raises(RuntimeError, match='Refused to load checkpoint'):
        safe_load(path)
    assert not marker.exists()


def test_trust_opt_in_named_in_the_message_works(tmp_path, monkeypatch):
    path = tmp_path / 'custom.pth'
    torch.save({'state_dict': {'w': torch.ones(2)}, 'meta': HarmlessCustomObject()}, path)
    with pytest.raises(RuntimeError, match='Refused to load checkpoint'):
        safe_load(path)
    monkeypatch.setenv(TRUST_ENV, '1')
    with pytest.warns(UserWarning, match='full unpickling'):
        loaded = safe_load(path)
    assert loaded['meta'].note == 'trusted'


@pytest.mark.parametrize('resume', [False, True])
def test_load_from_and_resume_refuse_code_running_checkpoint(evil, tmp_path, resume):
    path, marker = evil
    runner = make_runner(tmp_path, 1, runner_cls=SafeCheckpointRunner, load_from=path,
                         resume=resume)
    with pytest.raises(RuntimeError) as info:
        runner.train()
    assert_refused_with_hint(str(info.value), path)
    assert not marker.exists()


def test_stock_runner_is_left_to_torch_refusal(evil, tmp_path):
    """Without the fragment mmengine loads as before: torch refuses, without naming the file."""
    path, marker = evil
    with pytest.raises(Exception, match='Weights only load failed') as info:
        make_runner(tmp_path, 1, load_from=path).train()
    assert 'Refused to load checkpoint' not in str(info.value)
    assert not marker.exists()


def test_safe_runner_still_loads_mmengine_checkpoints(tmp_path):
    from mmengine.runner.checkpoint import save_checkpoint
    model = TinyModel()
    path = str(tmp_path / 'ok.pth')
    save_checkpoint({'state_dict': model.state_dict(), 'meta': {'epoch': 3},
                     'arr': np.arange(3)}, path)
    runner = make_runner(tmp_path, 1, runner_cls=SafeCheckpointRunner)
    checkpoint = runner.load_checkpoint(path)
    assert checkpoint['meta']['epoch'] == 3
    torch.testing.assert_close(runner.model.linear.weight, model.linear.weight)


def test_test_tool_refuses_code_running_checkpoint(evil, toy_coco, tmp_path):
    path, marker = evil
    with pytest.raises(RuntimeError) as info:
        cli_test.main([TOY_CONFIG, path, '--work-dir', str(tmp_path / 'work'),
                       '--cfg-options', *toy_data_options(toy_coco)])
    assert_refused_with_hint(str(info.value), path)
    assert not marker.exists()


@pytest.mark.slow
def test_train_tool_resume_refuses_code_running_checkpoint(evil, toy_coco, tmp_path):
    path, marker = evil
    with pytest.raises(RuntimeError) as info:
        cli_train.main([TOY_CONFIG, '--resume', path, '--work-dir', str(tmp_path / 'work'),
                        '--cfg-options', *toy_data_options(toy_coco)])
    assert_refused_with_hint(str(info.value), path)
    assert not marker.exists()


def test_converter_refuses_code_running_checkpoint(evil, tmp_path):
    path, marker = evil
    convert = convert_cls_to_backbone
    out = tmp_path / 'backbone.pth'
    with pytest.raises(RuntimeError) as info:
        convert.convert(path, str(out))
    assert_refused_with_hint(str(info.value), path)
    assert not out.exists() and not marker.exists()
