"""Bad input everywhere a user can reach: images, configs, tool arguments.

(The backbone's arguments, also through the registry, are tested in test_backbone.py, the
attention's in test_attention_module.py, tools/coco_eval.py's files in test_tools.py.)

Every case asserts the exception type and that the message names the offending
argument (and its value), so a user learns what to change without reading a traceback.
"""
import os.path as osp

import pytest
import torch
from _shared import CONFIG_DIR, TOY_CONFIG
from mmengine.config import Config

import lapformer_mm  # noqa: F401  (registers LaplacianFormer)
from lapformer_mm.cli import test as cli_test
from lapformer_mm.cli import train as cli_train
from lapformer_mm.models import (
    LaplacianFormer,
    NeckChannelsCheckHook,
    check_built_model,
    check_model_cfg,
)

UPERNET_CONFIG = osp.join(CONFIG_DIR, 'upernet_lapformer_t_ade20k.py')


@pytest.fixture(autouse=True)
def mmdet_scope():
    """Build under mmdet's scope whatever an earlier test's Runner left as default scope."""
    from mmengine.registry import DefaultScope
    with DefaultScope.overwrite_default_scope('mmdet'):
        yield


@pytest.mark.parametrize('make, exc, match', [
    (lambda: torch.rand(1, 1, 32, 32), ValueError,
     r'must be \(B, 3, H, W\) \(in_channels=3\), got shape \(1, 1, 32, 32\)'),
    (lambda: torch.rand(3, 32, 32), ValueError, r'got shape \(3, 32, 32\)'),
    (lambda: torch.zeros(1, 3, 32, 32, dtype=torch.uint8), TypeError,
     'must be a floating-point tensor .* got dtype torch.uint8'),
    (lambda: [torch.rand(3, 32, 32)], TypeError, 'must be a torch.Tensor, got list'),
])
def test_backbone_input_rejected_with_named_errors(make, exc, match):
    backbone = LaplacianFormer(arch=dict(embed_dims=[32] * 4, num_heads=[1] * 4,
                                         depths=[1] * 4))
    with pytest.raises(exc, match=match):
        backbone(make())


def toy_model_cfg(**neck):
    cfg = Config.fromfile(TOY_CONFIG)
    cfg.model.neck.update(neck)
    return cfg.model


def test_neck_in_channels_mismatch_named_before_building():
    check_model_cfg(toy_model_cfg())
    with pytest.raises(ValueError) as info:
        check_model_cfg(toy_model_cfg(in_channels=[64, 128, 256, 512]))
    message = str(info.value)
    assert 'model.neck.in_channels=[64, 128, 256, 512] does not match the backbone' in message
    assert "LaplacianFormer(arch='tiny', out_indices=(0, 1, 2, 3))" in message
    assert 'set model.neck.in_channels=[64, 128, 320, 512]' in message


def test_neck_in_channels_vs_out_indices_subset():
    model = toy_model_cfg()
    model.backbone.out_indices = (1, 2, 3)
    with pytest.raises(ValueError, match=r'set model.neck.in_channels=\[128, 320, 512\]'):
        check_model_cfg(model)
    model.neck.in_channels = [128, 320, 512]
    check_model_cfg(model)
    model.backbone.arch = 'medium'
    with pytest.raises(ValueError, match=r'in_channels=\[128, 288, 512\]'):
        check_model_cfg(model)


def test_decode_head_in_channels_checked_for_segmentors():
    model = Config.fromfile(UPERNET_CONFIG).model
    check_model_cfg(model)
    model.decode_head.in_channels = [64, 128, 320]
    with pytest.raises(ValueError, match=r'model.decode_head.in_channels=\[64, 128, 320\]'):
        check_model_cfg(model)


def test_mmdet_alone_reports_the_mismatch_only_at_forward():
    """Why the check exists: mmdet builds the bad model and fails deep inside FPN."""
    from mmdet.registry import MODELS
    model = MODELS.build(toy_model_cfg(in_channels=[64, 128, 256, 512]))
    feats = model.backbone(torch.rand(1, 3, 64, 64))
    with pytest.raises(RuntimeError, match='expected input.* to have 256 channels'):
        model.neck(feats)
    with pytest.raises(ValueError, match='does not match the backbone'):
        check_built_model(model)


def test_neck_check_hook_fails_before_the_first_iteration():
    from mmdet.registry import MODELS
    from mmengine.registry import HOOKS

    hook = HOOKS.build(dict(type='NeckChannelsCheckHook'))
    assert isinstance(hook, NeckChannelsCheckHook)

    class FakeRunner:
        model = MODELS.build(toy_model_cfg(in_channels=[64, 128, 320, 256]))

    with pytest.raises(ValueError, match=r'set model.neck.in_channels=\[64, 128, 320, 512\]'):
        hook.before_run(FakeRunner())


def test_test_tool_missing_checkpoint_and_config(tmp_path):
    test_tool = cli_test
    args = test_tool.parse_args([TOY_CONFIG, str(tmp_path / 'missing.pth')])
    with pytest.raises(FileNotFoundError, match="checkpoint '.*missing.pth' does not exist"):
        test_tool.build_cfg(args)
    args = test_tool.parse_args([str(tmp_path / 'nope.py'), str(tmp_path / 'x.pth')])
    with pytest.raises(FileNotFoundError, match='nope.py'):
        test_tool.build_cfg(args)


def test_test_tool_bad_out_suffix(capsys):
    test_tool = cli_test
    with pytest.raises(SystemExit):
        test_tool.parse_args([TOY_CONFIG, 'x.pth', '--out', 'preds.json'])
    assert '--out must be a .pkl/.pickle file or a folder' in capsys.readouterr().err


def test_train_tool_missing_config_and_bad_auto_scale_lr(tmp_path):
    train_tool = cli_train
    with pytest.raises(FileNotFoundError, match='nope.py'):
        train_tool.build_cfg(train_tool.parse_args([str(tmp_path / 'nope.py')]))
    cfg_path = tmp_path / 'no_scale.py'
    cfg_path.write_text(f"_base_ = ['{TOY_CONFIG}']\nauto_scale_lr = None\n")
    with pytest.raises(RuntimeError, match='--auto-scale-lr needs `auto_scale_lr'):
        train_tool.build_cfg(train_tool.parse_args([str(cfg_path), '--auto-scale-lr']))


def test_tools_name_neck_mismatch_before_building(tmp_path):
    ckpt = tmp_path / 'x.pth'
    ckpt.write_bytes(b'')
    for name, extra in (('train', []), ('test', [str(ckpt)])):
        tool = dict(test=cli_test, train=cli_train)[name]
        args = tool.parse_args([TOY_CONFIG, *extra, '--cfg-options',
                                'model.neck.in_channels=[64,128,256,512]'])
        with pytest.raises(ValueError,
                           match=r'set model.neck.in_channels=\[64, 128, 320, 512\]'):
            tool.build_cfg(args)
