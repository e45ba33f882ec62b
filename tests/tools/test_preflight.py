"""The inputs of a run are checked before anything is built: ``lapformer_mm.preflight``,
the tools (one message, exit status 2, nothing built) and ``InputCheckHook``."""
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

from lapformer_mm.cli import make_toy_coco, visualize_predictions
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


def problems(cfg, mode='train'):
    """{key: (path, reason)} of what a ``mode`` run of ``cfg`` would miss."""
    return {p.item.key: (p.item.path, p.reason) for p in find_input_problems(cfg, mode)}


def message(cfg, mode='train'):
    with pytest.raises(InputCheckError) as info:
        check_config_inputs(cfg, mode)
    return str(info.value)


def pretrained(checkpoint):
    return dict(type='LaplacianFormer', arch=ARCH,
                init_cfg=dict(type='Pretrained', checkpoint=str(checkpoint)))


def test_complete_inputs_pass_and_each_missing_one_is_named_by_its_key(data, tmp_path):
    coco, seg = data / 'toy_coco', data / 'toy_seg'
    check_config_inputs(run_cfg(coco_dataset(coco), coco_dataset(coco, 'val')))
    check_config_inputs(run_cfg(ade_dataset(seg), ade_dataset(seg, 'val')))
    os.remove(coco / 'annotations' / 'instances_train.json')
    shutil.rmtree(coco / 'val')
    shutil.rmtree(seg / 'ann_dir' / 'val')
    os.makedirs(seg / 'img_dir' / 'empty')
    found = problems(run_cfg(coco_dataset(coco), coco_dataset(coco, 'val')))
    assert {key: path for key, (path, _) in found.items()} == {
        'train_dataloader.dataset.ann_file': f'{coco}/annotations/instances_train.json',
        'val_dataloader.dataset.data_prefix.img': f'{coco}/val/'}
    found = problems(run_cfg(dict(ade_dataset(seg), data_prefix=dict(
        img_path='img_dir/empty', seg_map_path='ann_dir/train')), ade_dataset(seg, 'val')))
    assert set(found) == {'train_dataloader.dataset.data_prefix.img_path',
                          'val_dataloader.dataset.data_prefix.seg_map_path'}
    assert 'empty' in found['train_dataloader.dataset.data_prefix.img_path'][1]
    # A missing data root explains the paths under it; wrappers are looked through.
    missing = tmp_path / 'x'
    repeat = dict(type='RepeatDataset', times=3, dataset=dict(
        type='ConcatDataset', datasets=[coco_dataset(coco, 'val'), coco_dataset(missing)]))
    assert set(problems(run_cfg(repeat, coco_dataset(missing, 'val')))) == {
        'train_dataloader.dataset.dataset.datasets.0.data_prefix.img',
        'train_dataloader.dataset.dataset.datasets.1.data_root',
        'val_dataloader.dataset.data_root'}
    # mmpretrain: a folder dataset's data_prefix, ImageNet's split.
    folder = dict(type='CustomDataset', data_root=str(coco), data_prefix='nope')
    imagenet = dict(type='mmpretrain.ImageNet', data_root=str(coco), split='nope')
    assert problems(run_cfg(folder))['train_dataloader.dataset.data_prefix.img_path'][0] == \
        f'{coco}/nope'
    assert problems(run_cfg(imagenet))['train_dataloader.dataset.split'][0] == f'{coco}/nope'
    check_config_inputs(run_cfg(dict(imagenet, split='train')))


def test_the_message_names_each_input_once_and_the_ways_forward(data, tmp_path):
    coco = tmp_path / 'coco'
    text = message(run_cfg(coco_dataset(coco), coco_dataset(coco, 'val')))
    assert text.count(f"'{coco}/'") == 1  # train and val share the root: one line
    assert 'train_dataloader.dataset.data_root, val_dataloader.dataset.data_root' in text
    assert f'README.md, "{README_SECTIONS["CocoDataset"]}"' in text
    assert 'tools/smoke_fullsize.py' in text and '--cfg-options' in text
    with open(osp.join(osp.dirname(CONFIG_DIR), 'README.md')) as f:
        headings = {line[3:].strip() for line in f if line.startswith('## ')}
    assert set(README_SECTIONS.values()) <= headings
    text = message(run_cfg(dict(type='mmpretrain.ImageNet', data_root=str(coco), split='x')))
    assert README_SECTIONS['ImageNet'] in text and 'smoke_fullsize' not in text
    text = message(run_cfg(coco_dataset(data / 'toy_coco'),
                           backbone=pretrained(tmp_path / 'in1k.pth')))
    assert 'tools/convert_cls_to_backbone.py' in text and 'make pretrain' in text
    assert 'model.backbone.init_cfg=None' in text


def test_mode_selects_the_loops_and_the_checkpoint(data, tmp_path):
    coco = data / 'toy_coco'
    cfg = run_cfg(coco_dataset(coco), coco_dataset(tmp_path / 'val'),
                  backbone=pretrained(tmp_path / 'in1k.pth'),
                  test_dataloader=dict(dataset=coco_dataset(coco, 'val')), test_cfg=dict(),
                  test_evaluator=dict(type='CocoMetric',
                                      ann_file=str(tmp_path / 'instances_test.json')))
    assert set(problems(cfg)) == {'val_dataloader.dataset.data_root',
                                  'model.backbone.init_cfg.checkpoint'}
    # A test run does not initialise the backbone from its ImageNet checkpoint.
    assert set(problems(cfg, 'test')) == {'test_evaluator.ann_file'}
    # Without a val loop (val_cfg=None), mmengine does not read the val data.
    assert set(problems(dict(cfg, val_cfg=None))) == {'model.backbone.init_cfg.checkpoint'}
    with pytest.raises(ValueError, match='mode'):
        check_config_inputs(cfg, 'eval')


def test_the_backbone_checkpoint_is_found_wherever_a_config_sets_it(data, tmp_path):
    coco = coco_dataset(data / 'toy_coco')
    missing = tmp_path / 'in1k.pth'
    cfg = run_cfg(coco, pretrained=str(missing))  # mmseg's spelling
    cfg['model']['pretrained'] = cfg.pop('pretrained')
    assert set(problems(cfg)) == {'model.pretrained'}
    assert 'model.pretrained=None' in message(cfg)
    backbone = pretrained(missing)
    del backbone['init_cfg']['type']  # mmdet's PVT configs
    assert set(problems(run_cfg(coco, backbone=backbone))) == {
        'model.backbone.init_cfg.checkpoint'}
    backbone = pretrained(missing)
    backbone['init_cfg'] = [dict(type='TruncNormal', layer='Linear'), backbone['init_cfg']]
    assert set(problems(run_cfg(coco, backbone=backbone))) == {
        'model.backbone.init_cfg.1.checkpoint'}


def test_checkpoints_pass_in_each_layout_and_others_are_named(data, tmp_path):
    weights = LaplacianFormer(ARCH).state_dict()
    coco = coco_dataset(data / 'toy_coco')
    for obj in (weights, dict(state_dict=weights, meta=dict(epoch=1)),
                dict(state_dict={f'backbone.{k}': v for k, v in weights.items()})):
        torch.save(obj, tmp_path / 'ok.pth')
        check_config_inputs(run_cfg(coco, backbone=pretrained(tmp_path / 'ok.pth')))
    (tmp_path / 'html.pth').write_text('<html>404 Not Found</html>')
    torch.save(weights, tmp_path / 'truncated.pth')
    (tmp_path / 'truncated.pth').write_bytes((tmp_path / 'truncated.pth').read_bytes()[:1000])
    torch.save({'conv1.weight': torch.zeros(1)}, tmp_path / 'resnet.pth')
    torch.save(LaplacianFormer(dict(ARCH, embed_dims=[16, 32, 48, 64])).state_dict(),
               tmp_path / 'widths.pth')
    torch.save(LaplacianFormer(dict(ARCH, depths=[1, 1, 2, 1])).state_dict(),
               tmp_path / 'deeper.pth')
    torch.save(LaplacianFormer(ARCH, stage4_attention='softmax').state_dict(),
               tmp_path / 'softmax.pth')
    with open(tmp_path / 'unsafe.pth', 'wb') as f:
        pickle.dump({'state_dict': os.getcwd}, f, protocol=2)
    # Each is one problem: what the reason names (a stage, the attention) is the behaviour.
    for name, named in (('html', '<html>'), ('truncated', 'truncated.pth'),
                        ('resnet', 'conv1.weight'), ('widths', 'pth'), ('deeper', 'stage 2'),
                        ('softmax', 'stage4_attention'), ('unsafe', 'unsafe.pth')):
        found = problems(run_cfg(coco, backbone=pretrained(tmp_path / f'{name}.pth')))
        assert list(found) == ['model.backbone.init_cfg.checkpoint'], name
        assert named in message(run_cfg(coco, backbone=pretrained(
            tmp_path / f'{name}.pth'))), name


def test_data_root_options_move_evaluator_files_with_the_root():
    cfg = dict(val_dataloader=dict(dataset=dict(type='RepeatDataset', dataset=dict(
                   data_root='data/coco/'))),
               val_cfg=dict(),
               val_evaluator=[dict(type='CocoMetric',
                                   ann_file='data/coco/annotations/instances_val2017.json')])
    assert data_root_options(cfg, ['val'], lambda root: '/d/' + root) == [
        'val_dataloader.dataset.dataset.data_root=/d/data/coco/',
        'val_evaluator.0.ann_file=/d/data/coco/annotations/instances_val2017.json']


def test_train_tool_exits_with_the_message_and_writes_nothing(tmp_path):
    """As a new user runs it: the full-size config without COCO or the ImageNet checkpoint."""
    log = run_tool([sys.executable, osp.join(TOOLS, 'train.py'),
                    osp.join(CONFIG_DIR, 'maskrcnn_lapformer_t.py')],
                   cwd=tmp_path, timeout=300, returncode=2)
    assert 'Traceback' not in log and '\nerror: ' in log
    assert "'data/coco/'" in log and "'checkpoints/lapformer_tiny_in1k.pth'" in log
    assert not os.listdir(tmp_path), 'nothing was written: no work dir, no log'


def tool_error(tool, argv, capsys):
    with pytest.raises(SystemExit) as info:
        tool.main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith('error: ') and captured.out == ''
    return captured.err


@pytest.mark.parametrize('tool', [train_tool, test_tool, visualize_predictions])
def test_each_tool_ends_a_missing_input_or_a_config_error_with_one_message(
        tool, data, tmp_path, capsys):
    root = data / 'toy_coco'
    os.remove(root / 'annotations' / 'instances_val.json')
    ckpt = [] if tool is train_tool else [str(tmp_path / 'epoch_1.pth')]
    extra = ['--out-dir', str(tmp_path / 'vis')] if tool is visualize_predictions else [
        '--work-dir', str(tmp_path / 'w')]
    options = ['--cfg-options', *toy_data_options(root)]
    err = tool_error(tool, [TOY_CONFIG, *ckpt, *extra, *options], capsys)
    assert f'{root}/annotations/instances_val.json' in err and all(c in err for c in ckpt)
    # A neck that does not fit the backbone, a backbone value its constructor refuses.
    for option, name in (('model.neck.in_channels=[64,128,320,256]', 'model.neck.in_channels'),
                         ('model.backbone.frozen_stages=9', 'frozen_stages')):
        err = tool_error(tool, [TOY_CONFIG, *ckpt, *extra, *options, option], capsys)
        assert name in err and err.count('\n') == 1
    err = tool_error(tool, [str(tmp_path / 'nope.py'), *ckpt, *extra], capsys)
    assert 'nope.py' in err
    assert not osp.exists(tmp_path / 'w') and not osp.exists(tmp_path / 'vis')


def test_input_check_hook_stops_training_before_the_checkpoint_is_loaded(data, tmp_path):
    from mmengine.registry import HOOKS
    from mmengine.runner import Runner

    from lapformer_mm.engine import InputCheckHook
    assert HOOKS.get('InputCheckHook') is InputCheckHook
    root = data / 'toy_coco'
    shutil.rmtree(root / 'train')  # the dataset builds from its json; images come later
    cfg = Config.fromfile(TOY_CONFIG)
    cfg.merge_from_dict(train_tool.parse_args(
        [TOY_CONFIG, '--cfg-options', *toy_data_options(root)]).cfg_options)
    cfg.model.backbone.init_cfg = dict(type='Pretrained', checkpoint=str(tmp_path / 'in1k.pth'))
    cfg.work_dir = str(tmp_path / 'w')
    cfg.custom_hooks = [dict(type='InputCheckHook')]
    with pytest.raises(InputCheckError) as info:
        Runner.from_cfg(cfg).train()
    assert f"'{root}/train/'" in str(info.value) and f"'{tmp_path}/in1k.pth'" in str(info.value)


def test_official_layout_is_what_the_full_size_configs_read(tmp_path):
    data_dir = tmp_path / 'data'
    make_toy_coco.main(['--layout', 'official', '--out', str(data_dir / 'coco'),
                        '--seg-out', str(data_dir / 'ade' / 'ADEChallengeData2016'),
                        '--img-size', '80', '48', '--num-train', '2', '--num-val', '1'])
    for config in ('maskrcnn_lapformer_t.py', 'upernet_lapformer_t_ade20k.py'):
        cfg = Config.fromfile(osp.join(CONFIG_DIR, config))
        moved = data_root_options(cfg, ['train', 'val', 'test'], lambda root: osp.join(
            str(data_dir), osp.relpath(osp.normpath(root), 'data')))
        cfg.merge_from_dict(dict(option.split('=', 1) for option in moved))
        cfg.model.backbone.init_cfg = None
        for mode in ('train', 'test'):
            check_config_inputs(cfg, mode)
    with open(data_dir / 'coco' / 'annotations' / 'instances_train2017.json') as f:
        coco = json.load(f)
    assert [(c['id'], c['name']) for c in coco['categories'][:2]] == [(1, 'person'),
                                                                      (2, 'bicycle')]
    assert len(coco['categories']) == 80
    assert {(i['width'], i['height']) for i in coco['images']} == {(80, 48)}
    assert {i['file_name'] for i in coco['images']} == {'000000000001.jpg', '000000000002.jpg'}
    ade = data_dir / 'ade' / 'ADEChallengeData2016'
    assert sorted(os.listdir(ade / 'images' / 'validation')) == ['000000000001.jpg']
    assert sorted(os.listdir(ade / 'annotations' / 'validation')) == ['000000000001.png']
