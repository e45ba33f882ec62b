"""The inputs of a run are checked before anything is built: ``lapformer_mm.preflight``,
``tools/train.py`` / ``tools/test.py`` (one message, exit status 2, no traceback) and
``InputCheckHook``; ``tools/make_toy_coco.py --layout official`` writes what the full-size
configs read.
"""
import json
import os
import os.path as osp
import pickle
import shutil
import sys

import pytest
import torch
from _shared import CONFIG_DIR, TOOLS, TOY_CONFIG, run_tool, toy_data_options
from mmengine.config import Config

from lapformer_mm.cli import make_toy_coco
from lapformer_mm.cli import test as test_tool
from lapformer_mm.cli import train as train_tool
from lapformer_mm.models import LaplacianFormer
from lapformer_mm.preflight import (
    README_SECTIONS,
    InputCheckError,
    check_config_inputs,
    data_root_options,
    find_input_problems,
)

ARCH = dict(embed_dims=[16, 32, 32, 64], num_heads=[1, 1, 1, 2], depths=[1, 1, 1, 1])
OTHER_ARCH = dict(embed_dims=[16, 32, 48, 64], num_heads=[1, 1, 1, 2], depths=[1, 1, 1, 1])


@pytest.fixture
def data(toy_data, tmp_path):
    """A private copy of the session's toy sets, to delete parts of."""
    for name in ('toy_coco', 'toy_seg'):
        shutil.copytree(toy_data / name, tmp_path / name)
    return tmp_path


def coco_dataset(root, split='train'):
    return dict(type='CocoDataset', data_root=f'{root}/',
                ann_file=f'annotations/instances_{split}.json', data_prefix=dict(img=f'{split}/'))


def ade_dataset(root, split='train'):
    return dict(type='ADE20KDataset', data_root=str(root),
                data_prefix=dict(img_path=f'img_dir/{split}', seg_map_path=f'ann_dir/{split}'))


def run_cfg(train_set, val_set=None, backbone=None, **extra):
    cfg = dict(train_dataloader=dict(dataset=train_set),
               model=dict(backbone=backbone or dict(type='LaplacianFormer', arch=ARCH)), **extra)
    if val_set is not None:
        cfg.update(val_dataloader=dict(dataset=val_set), val_cfg=dict(),
                   val_evaluator=dict(type='CocoMetric'))
    return cfg


def message(cfg, mode='train'):
    with pytest.raises(InputCheckError) as info:
        check_config_inputs(cfg, mode)
    return str(info.value)


def test_preflight_passes_complete_inputs(data):
    coco = data / 'toy_coco'
    check_config_inputs(run_cfg(coco_dataset(coco), coco_dataset(coco, 'val')))
    seg = data / 'toy_seg'
    check_config_inputs(run_cfg(ade_dataset(seg), ade_dataset(seg, 'val')))


def test_preflight_names_a_missing_annotation_file(data):
    coco = data / 'toy_coco'
    os.remove(coco / 'annotations' / 'instances_train.json')
    text = message(run_cfg(coco_dataset(coco), coco_dataset(coco, 'val')))
    assert (f"annotation file '{coco}/annotations/instances_train.json' does not exist "
            '(set by train_dataloader.dataset.ann_file)') in text
    assert 'would miss 1 input(s)' in text
    # The layout the config reads, and the ways forward.
    assert f'{coco}/train/' in text and f'{coco}/annotations/instances_val.json' in text
    assert 'README.md, "Train and test on COCO"' in text
    assert ('--cfg-options train_dataloader.dataset.data_root=/path/to/toy_coco/ '
            'val_dataloader.dataset.data_root=/path/to/toy_coco/') in text
    assert 'tools/smoke_fullsize.py' in text


def test_missing_and_empty_image_folders(data):
    coco = data / 'toy_coco'
    shutil.rmtree(coco / 'train')
    text = message(run_cfg(coco_dataset(coco)))
    assert (f"image folder '{coco}/train/' does not exist "
            '(set by train_dataloader.dataset.data_prefix.img)') in text
    os.makedirs(coco / 'train')
    assert f"image folder '{coco}/train/' is empty" in message(run_cfg(coco_dataset(coco)))


def test_missing_data_root_is_named_once_for_train_and_val(tmp_path):
    coco = tmp_path / 'coco'
    text = message(run_cfg(coco_dataset(coco), coco_dataset(coco, 'val')))
    assert (f"data root '{coco}/' does not exist (set by train_dataloader.dataset.data_root, "
            'val_dataloader.dataset.data_root)') in text
    assert 'would miss 1 input(s)' in text  # the paths under it are not listed as problems


def test_ade_label_folder_and_readme_section(data):
    seg = data / 'toy_seg'
    shutil.rmtree(seg / 'ann_dir' / 'val')
    text = message(run_cfg(ade_dataset(seg), ade_dataset(seg, 'val')))
    assert (f"label folder '{seg}/ann_dir/val' does not exist "
            '(set by val_dataloader.dataset.data_prefix.seg_map_path)') in text
    assert 'README.md, "Train and test on ADE20K"' in text


def test_wrappers_are_looked_through(data, tmp_path):
    coco = data / 'toy_coco'
    concat = dict(type='ConcatDataset', datasets=[coco_dataset(coco), coco_dataset(tmp_path / 'x')])
    repeat = dict(type='RepeatDataset', times=3, dataset=concat)
    problems = message(run_cfg(repeat)).split('\n\n')[0]
    assert f"data root '{tmp_path}/x/' does not exist (set by " \
           'train_dataloader.dataset.dataset.datasets.1.data_root)' in problems
    assert 'datasets.0' not in problems


def test_preflight_names_a_missing_mmpretrain_image_folder(data):
    folder = dict(type='CustomDataset', data_root=str(data / 'toy_coco'), data_prefix='nope')
    text = message(run_cfg(folder))
    assert (f"image folder '{data}/toy_coco/nope' does not exist "
            '(set by train_dataloader.dataset.data_prefix.img_path)') in text
    assert 'get the data set: README.md;' in text
    assert 'smoke_fullsize' not in text  # it writes COCO and ADE20K only
    # ImageNet's split names its image folder when data_prefix is not given.
    imagenet = dict(type='mmpretrain.ImageNet', data_root=str(data / 'toy_coco'), split='nope')
    text = message(run_cfg(imagenet))
    assert (f"image folder '{data}/toy_coco/nope' does not exist "
            '(set by train_dataloader.dataset.split)') in text
    assert 'get the data set: README.md, "Pretrain on ImageNet-1k";' in text
    assert 'smoke_fullsize' not in text
    imagenet.update(split='train')
    assert check_config_inputs(run_cfg(imagenet)) is None


def test_the_readme_has_the_sections_the_messages_name():
    with open(osp.join(osp.dirname(CONFIG_DIR), 'README.md')) as f:
        headings = {line[3:].strip() for line in f if line.startswith('## ')}
    assert set(README_SECTIONS.values()) <= headings


def test_mode_selects_the_loops_and_the_checkpoint(data, tmp_path):
    coco = data / 'toy_coco'
    missing_ckpt = dict(type='LaplacianFormer', arch=ARCH,
                        init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'in1k.pth')))
    cfg = run_cfg(coco_dataset(coco), coco_dataset(tmp_path / 'val'), backbone=missing_ckpt,
                  test_dataloader=dict(dataset=coco_dataset(coco, 'val')), test_cfg=dict(),
                  test_evaluator=dict(type='CocoMetric',
                                      ann_file=str(tmp_path / 'instances_test.json')))
    train = {p.item.key for p in find_input_problems(cfg, 'train')}
    assert train == {'val_dataloader.dataset.data_root', 'model.backbone.init_cfg.checkpoint'}
    # A test run does not initialise the backbone from its ImageNet checkpoint.
    assert {p.item.key for p in find_input_problems(cfg, 'test')} == {'test_evaluator.ann_file'}
    # Without a val loop (val_cfg=None), mmengine does not read the val data.
    assert {p.item.key for p in find_input_problems(dict(cfg, val_cfg=None), 'train')} == {
        'model.backbone.init_cfg.checkpoint'}
    with pytest.raises(ValueError, match=r"mode must be one of \['test', 'train', 'val'\], "
                                         "got 'eval'"):
        check_config_inputs(cfg, 'eval')


def pretrained_cfg(data, checkpoint):
    backbone = dict(type='LaplacianFormer', arch=ARCH,
                    init_cfg=dict(type='Pretrained', checkpoint=str(checkpoint)))
    return run_cfg(coco_dataset(data / 'toy_coco'), backbone=backbone)


def checkpoint_line(data, checkpoint):
    return message(pretrained_cfg(data, checkpoint)).splitlines()[1]


def test_preflight_names_a_missing_checkpoint(data, tmp_path):
    text = message(pretrained_cfg(data, tmp_path / 'in1k.pth'))
    assert (f"checkpoint '{tmp_path}/in1k.pth' does not exist "
            '(set by model.backbone.init_cfg.checkpoint)') in text
    assert 'configs/cls/lapformer_*_in1k.py' in text  # ARCH is a dict, not a named arch
    assert 'tools/convert_cls_to_backbone.py' in text and 'make pretrain' in text
    assert '--cfg-options model.backbone.init_cfg.checkpoint=PATH' in text
    assert '--cfg-options model.backbone.init_cfg=None' in text
    assert 'Ways forward for the data' not in text
    # mmseg's spelling: the segmentor's `pretrained`, handed to the backbone; the way to
    # train from scratch then drops that key.
    cfg = run_cfg(coco_dataset(data / 'toy_coco'), pretrained=str(tmp_path / 'in1k.pth'))
    cfg['model']['pretrained'] = cfg.pop('pretrained')
    text = message(cfg)
    assert '(set by model.pretrained)' in text
    assert '--cfg-options model.pretrained=None' in text
    # mmdet's PVT configs: a checkpoint without a type.
    cfg = pretrained_cfg(data, tmp_path / 'in1k.pth')
    del cfg['model']['backbone']['init_cfg']['type']
    assert '(set by model.backbone.init_cfg.checkpoint)' in message(cfg)
    # A list of entries: the key names the Pretrained one's index.
    cfg = pretrained_cfg(data, tmp_path / 'in1k.pth')
    backbone = cfg['model']['backbone']
    backbone['init_cfg'] = [dict(type='TruncNormal', layer='Linear', std=0.02),
                            backbone['init_cfg']]
    text = message(cfg)
    assert '(set by model.backbone.init_cfg.1.checkpoint)' in text
    assert '--cfg-options model.backbone.init_cfg.1.checkpoint=PATH' in text


def test_checkpoint_of_the_backbone_passes_in_each_layout(data, tmp_path):
    weights = LaplacianFormer(ARCH).state_dict()
    layouts = dict(plain=weights, mmengine=dict(state_dict=weights, meta=dict(epoch=1)),
                   classifier=dict(state_dict={f'backbone.{k}': v for k, v in weights.items()}))
    for name, obj in layouts.items():
        torch.save(obj, tmp_path / f'{name}.pth')
        check_config_inputs(pretrained_cfg(data, tmp_path / f'{name}.pth'))


def test_preflight_names_files_that_are_not_checkpoints(data, tmp_path):
    text_file = tmp_path / 'in1k.pth'
    text_file.write_text('<html>404 Not Found</html>')
    assert ("in1k.pth' is not a torch checkpoint (it starts with b'<html>404 Not Found</html>'"
            in checkpoint_line(data, text_file))
    truncated = tmp_path / 'truncated.pth'
    torch.save(LaplacianFormer(ARCH).state_dict(), truncated)
    truncated.write_bytes(truncated.read_bytes()[:1000])
    assert 'cannot be read as a torch checkpoint' in checkpoint_line(data, truncated)

    resnet = tmp_path / 'resnet.pth'
    torch.save({'conv1.weight': torch.zeros(1), 'layer1.0.conv1.weight': torch.zeros(1)}, resnet)
    line = checkpoint_line(data, resnet)
    assert 'holds none of the' in line and "'conv1.weight'" in line

    other_arch = tmp_path / 'other.pth'
    torch.save(LaplacianFormer(OTHER_ARCH).state_dict(), other_arch)
    line = checkpoint_line(data, other_arch)
    assert 'does not fit model.backbone' in line and 'checkpoint of another arch' in line
    # The same widths, stage 2 one block deeper (tiny, small and large differ only so).
    deeper = tmp_path / 'deeper.pth'
    torch.save(LaplacianFormer(dict(ARCH, depths=[1, 1, 2, 1])).state_dict(), deeper)
    assert ('stage 2: 2 blocks in the checkpoint, 1 in the model: a checkpoint of another '
            'arch') in checkpoint_line(data, deeper)
    # Stage 4 of the other attention: the shapes agree, so it loaded with a log line.
    softmax = tmp_path / 'softmax.pth'
    torch.save(LaplacianFormer(ARCH, stage4_attention='softmax').state_dict(), softmax)
    assert ('stage 4 has softmax attention in the checkpoint, laplacian in the model: a '
            'checkpoint of another stage4_attention') in checkpoint_line(data, softmax)

    unsafe = tmp_path / 'unsafe.pth'
    with open(unsafe, 'wb') as f:
        pickle.dump({'state_dict': os.getcwd}, f, protocol=2)
    assert 'Refused to load checkpoint' in checkpoint_line(data, unsafe)


def test_data_root_options_move_evaluator_files_with_the_root():
    cfg = dict(val_dataloader=dict(dataset=dict(type='RepeatDataset', dataset=dict(
                   data_root='data/coco/'))),
               val_cfg=dict(),
               val_evaluator=[dict(type='CocoMetric',
                                   ann_file='data/coco/annotations/instances_val2017.json')])
    assert data_root_options(cfg, ['val'], lambda root: '/d/' + root) == [
        'val_dataloader.dataset.dataset.data_root=/d/data/coco/',
        'val_evaluator.0.ann_file=/d/data/coco/annotations/instances_val2017.json']


# The tools: one message on stderr, exit status 2, nothing built.

def test_train_tool_exits_with_the_message(tmp_path):
    """As a new user runs it: the full-size config without COCO or the ImageNet checkpoint."""
    log = run_tool([sys.executable, osp.join(TOOLS, 'train.py'),
                    osp.join(CONFIG_DIR, 'maskrcnn_lapformer_t.py')],
                   cwd=tmp_path, timeout=300, returncode=2)
    assert 'Traceback' not in log
    assert (f'\nerror: {CONFIG_DIR}/maskrcnn_lapformer_t.py: this train run would miss '
            '2 input(s):\n') in log  # after the environment's pkg_resources warnings
    assert "data root 'data/coco/' does not exist" in log
    assert "checkpoint 'checkpoints/lapformer_tiny_in1k.pth' does not exist" in log
    assert not os.listdir(tmp_path), 'nothing was written: no work dir, no log'


def toy_options(root):
    return ['--cfg-options', *toy_data_options(root)]


def tool_error(tool, argv, capsys):
    with pytest.raises(SystemExit) as info:
        tool.main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_train_tool_names_missing_images_and_a_wrong_checkpoint(data, tmp_path, capsys):
    root = data / 'toy_coco'
    shutil.rmtree(root / 'val')
    classifier_head = tmp_path / 'head.pth'
    torch.save({'head.fc.weight': torch.zeros(2, 2)}, classifier_head)
    config = tmp_path / 'pretrained.py'
    config.write_text(f"_base_ = ['{TOY_CONFIG}']\nmodel = dict(backbone=dict(init_cfg=dict("
                      f"_delete_=True, type='Pretrained', checkpoint='{classifier_head}')))\n")
    err = tool_error(train_tool, [str(config), '--work-dir', str(tmp_path / 'w'),
                                  *toy_options(root)], capsys)
    assert f"image folder '{root}/val/' does not exist" in err
    assert f"checkpoint '{classifier_head}' does not fit" in err and 'holds none of the' in err
    assert not osp.exists(tmp_path / 'w')


def test_train_tool_names_a_neck_that_does_not_fit(data, tmp_path, capsys):
    err = tool_error(train_tool, [TOY_CONFIG, '--work-dir', str(tmp_path / 'w'),
                                  *toy_options(data / 'toy_coco'),
                                  'model.neck.in_channels=[64,128,320,256]'], capsys)
    assert err.startswith('error: model.neck.in_channels=[64, 128, 320, 256] does not match')
    assert not osp.exists(tmp_path / 'w')
    # A backbone value its constructor refuses: one line too, not the Runner's traceback.
    for option, name in (('arch=base', 'arch'), ('frozen_stages=9', 'frozen_stages')):
        err = tool_error(train_tool, [TOY_CONFIG, '--work-dir', str(tmp_path / 'w'),
                                      *toy_options(data / 'toy_coco'), f'model.backbone.{option}'],
                         capsys)
        assert err.startswith('error: model.backbone: ') and name in err and err.count('\n') == 1
    assert not osp.exists(tmp_path / 'w')


def test_test_tool_names_missing_checkpoint_and_annotations(data, tmp_path, capsys):
    root = data / 'toy_coco'
    err = tool_error(test_tool, [TOY_CONFIG, str(tmp_path / 'epoch_1.pth'), *toy_options(root)],
                     capsys)
    assert err.startswith('error: checkpoint') and f'{tmp_path}/epoch_1.pth' in err
    ckpt = tmp_path / 'epoch_1.pth'
    ckpt.write_bytes(b'x')
    os.remove(root / 'annotations' / 'instances_val.json')
    err = tool_error(test_tool, [TOY_CONFIG, str(ckpt), *toy_options(root)], capsys)
    assert f"annotation file '{root}/annotations/instances_val.json' does not exist" in err
    assert 'test_dataloader.dataset.ann_file, test_evaluator.ann_file' in err


# The hook, for mmdet's/mmseg's own tools.

def test_input_check_hook_stops_training_before_the_checkpoint_is_loaded(data, tmp_path):
    from mmengine.registry import HOOKS
    from mmengine.runner import Runner

    from lapformer_mm.engine import InputCheckHook
    assert HOOKS.get('InputCheckHook') is InputCheckHook
    root = data / 'toy_coco'
    shutil.rmtree(root / 'train')  # the dataset builds from its json; images come later
    cfg = Config.fromfile(TOY_CONFIG)
    cfg.merge_from_dict(train_tool.parse_args([TOY_CONFIG, *toy_options(root)]).cfg_options)
    cfg.model.backbone.init_cfg = dict(type='Pretrained', checkpoint=str(tmp_path / 'in1k.pth'))
    cfg.work_dir = str(tmp_path / 'w')
    cfg.custom_hooks = [dict(type='InputCheckHook')]
    runner = Runner.from_cfg(cfg)
    with pytest.raises(InputCheckError) as info:
        runner.train()
    text = str(info.value)
    assert f"image folder '{root}/train/' does not exist" in text
    assert f"checkpoint '{tmp_path}/in1k.pth' does not exist" in text


# The synthetic data in the layout of the full-size configs.

def test_official_layout_is_what_the_full_size_configs_read(tmp_path):
    data_dir = tmp_path / 'data'
    with_size = ['--img-size', '80', '48', '--num-train', '2', '--num-val', '1']
    make_toy_coco.main(['--layout', 'official', '--out', str(data_dir / 'coco'),
                        '--seg-out', str(data_dir / 'ade' / 'ADEChallengeData2016'), *with_size])
    for config in ('maskrcnn_lapformer_t.py', 'upernet_lapformer_t_ade20k.py'):
        cfg = Config.fromfile(osp.join(CONFIG_DIR, config))
        moved = data_root_options(cfg, ['train', 'val', 'test'], lambda root: osp.join(
            str(data_dir), osp.relpath(osp.normpath(root), 'data')))
        cfg.merge_from_dict(dict(option.split('=', 1) for option in moved))
        cfg.model.backbone.init_cfg = None
        for mode in ('train', 'test'):
            check_config_inputs(cfg, mode)
    coco = json.load(open(data_dir / 'coco' / 'annotations' / 'instances_train2017.json'))
    assert [(c['id'], c['name']) for c in coco['categories'][:2]] == [(1, 'person'),
                                                                      (2, 'bicycle')]
    assert len(coco['categories']) == 80
    assert {(i['width'], i['height']) for i in coco['images']} == {(80, 48)}
    assert {i['file_name'] for i in coco['images']} == {'000000000001.jpg', '000000000002.jpg'}
    ade = data_dir / 'ade' / 'ADEChallengeData2016'
    assert sorted(os.listdir(ade / 'images' / 'validation')) == ['000000000001.jpg']
    assert sorted(os.listdir(ade / 'annotations' / 'validation')) == ['000000000001.png']
