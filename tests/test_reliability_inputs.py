"""Bad input everywhere a user can reach: module arguments, configs, images, tool arguments.

Every case asserts the exception type and that the message names the offending
argument (and its value), so a user learns what to change without reading a traceback.
"""
import json
import os.path as osp
import re

import pytest
import torch
from _shared import CONFIG_DIR, TOY_CONFIG
from mmengine.config import Config

import lapformer_mm  # noqa: F401  (registers LaplacianFormer)
from lapformer_mm.cli import coco_eval
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




@pytest.mark.parametrize('kwargs, exc, match', [
    (dict(arch='giant'), ValueError, "arch must be one of .* got 'giant'"),
    (dict(arch=3), TypeError, 'arch must be a str or a dict'),
    (dict(arch=dict(embed_dims=[64] * 4, num_heads=[2] * 4)), ValueError,
     r"arch dict must have keys \['depths', 'embed_dims', 'num_heads'\]"),
    (dict(arch=dict(embed_dims=[64] * 4, num_heads=[2] * 4, depths=[1, 0, 1, 1])),
     ValueError, r"arch\['depths'\] entries must be positive"),
    (dict(arch=dict(embed_dims=[64] * 3, num_heads=[2] * 3, depths=[1] * 3)),
     ValueError, r"arch\['embed_dims'\] must have 4 entries"),
    (dict(arch=dict(embed_dims=[64, 64, 64, 66], num_heads=[2, 2, 2, 4], depths=[1] * 4)),
     ValueError, r'embed_dims\[3\]=66 is not divisible by num_heads\[3\]=4'),
    (dict(attn_cfg=dict(landmark_grid=0)), ValueError, 'landmark_grid=0 must be >= 1'),
    (dict(attn_cfg=dict(landmark_grid=-1)), ValueError, 'landmark_grid=-1 must be >= 1'),
    (dict(out_indices=(4, )), ValueError, r'out_indices must be in \[0, 4\)'),
    (dict(out_indices=()), TypeError, 'out_indices must be a non-empty sequence'),
    (dict(out_indices=(1, 1)), ValueError, 'out_indices must not repeat'),
    (dict(frozen_stages=5), ValueError, r'frozen_stages must be an int in \[-1, 4\]'),
    (dict(drop_path_rate=1.0), ValueError, r'drop_path_rate must be in \[0, 1\)'),
    (dict(stage4_attention='linear'), ValueError, 'stage4_attention must be one of'),
    (dict(in_channels=0), ValueError, 'in_channels must be a positive int, got 0'),
    (dict(attn_cfg=dict(qk_shared='yes')), TypeError, 'qk_shared must be a bool or 4 bools'),
    (dict(attn_cfg=dict(kernel='rbf')), ValueError, "kernel='rbf' is not supported"),
    (dict(attn_cfg=dict(newton_iters=3)), ValueError,
     "attn_cfg: unknown key\\(s\\) 'newton_iters'"),
    (dict(pretrained='a.pth', init_cfg=dict(type='Pretrained', checkpoint='b.pth')),
     ValueError, 'give either pretrained or init_cfg'),
])
def test_backbone_config_values_rejected_through_the_registry(kwargs, exc, match):
    """The same errors reach a user who builds from a config (mmdet's MODELS.build)."""
    from mmdet.registry import MODELS
    with pytest.raises(exc, match=match):
        MODELS.build(dict(type='LaplacianFormer', **kwargs))


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


def write_gt(tmp_path):
    gt = dict(images=[dict(id=1, width=40, height=30, file_name='1.png')],
              annotations=[dict(id=1, image_id=1, category_id=1, bbox=[5, 5, 10, 10],
                                area=100.0, iscrowd=0,
                                segmentation=[[5, 5, 15, 5, 15, 15, 5, 15]])],
              categories=[dict(id=1, name='a')])
    path = tmp_path / 'gt.json'
    path.write_text(json.dumps(gt))
    return str(path)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_coco_eval_bad_files_named(tmp_path, capsys):
    gt = write_gt(tmp_path)
    good = dict(image_id=1, category_id=1, bbox=[5, 5, 10, 10], score=0.9)
    cases = [
        ([str(tmp_path / 'nope.json'), gt], "annotation file '.*nope.json' does not exist"),
        ([gt, str(tmp_path / 'nope.json')], "results file '.*nope.json' does not exist"),
        ([gt, write(tmp_path, 'empty.json', '[]')], 'is empty'),
        ([gt, write(tmp_path, 'blank.json', '')], 'is not valid JSON'),
        ([gt, write(tmp_path, 'dict.json', '{}')], 'must hold a JSON list of detections'),
        ([gt, write(tmp_path, 'other_img.json', json.dumps([dict(good, image_id=7)]))],
         r'image id\(s\) not in the annotation file .*another annotation file'),
        ([gt, write(tmp_path, 'other_cat.json', json.dumps([dict(good, category_id=9)]))],
         r'category id\(s\) \[9\] .*another annotation file'),
        ([gt, write(tmp_path, 'nobox.json', json.dumps([{'image_id': 1, 'category_id': 1,
                                                         'score': 1.0}]))],
         "has no 'bbox' field"),
        ([gt, write(tmp_path, 'noseg.json', json.dumps([good])), '--types', 'segm'],
         "has no 'segmentation' field, needed for --types segm"),
    ]
    for argv, pattern in cases:
        assert coco_eval.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.search(pattern, err), (argv, err)
        assert 'Traceback' not in err


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
