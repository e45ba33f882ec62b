"""The pretraining path: toy ImageNet set, mmpretrain iterations, backbone conversion."""
import hashlib
import os.path as osp
import sys

import pytest
import torch
from _shared import CONFIG_DIR, TOOLS, run_tool
from mmengine.config import Config

from lapformer_mm.checkpoint import safe_load
from lapformer_mm.cli import convert_cls_to_backbone
from lapformer_mm.cli.convert_cls_to_backbone import convert
from lapformer_mm.cli.make_toy_imagenet import main as make_toy_imagenet_main
from lapformer_mm.models import LaplacianFormer
from lapformer_mm.models.pretrained import load_backbone_weights

CLASSES = ('circle', 'square', 'triangle', 'star')
CLS_TOY = osp.join(CONFIG_DIR, 'cls', 'lapformer_t_toy.py')
DET_PRETRAINED = osp.join(CONFIG_DIR, 'toy', 'maskrcnn_lapformer_t_toy_pretrained.py')


def make_toy_imagenet(out, per_class, seed=0):
    make_toy_imagenet_main(['--out', str(out), '--img-size', '32', '--per-class-train',
                            str(per_class), '--per-class-val', str(per_class),
                            '--seed', str(seed)])


def digests(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob('*.png'))}


def test_toy_imagenet_is_deterministic_class_folders(tmp_path):
    make_toy_imagenet(tmp_path / 'a', per_class=3)
    make_toy_imagenet(tmp_path / 'b', per_class=3)
    make_toy_imagenet(tmp_path / 'c', per_class=3, seed=1)
    files = digests(tmp_path / 'a')
    assert files == digests(tmp_path / 'b')
    assert files != digests(tmp_path / 'c')
    assert sorted(files) == sorted(f'{split}/{name}/{i:06d}.png' for split in ('train', 'val')
                                   for name in CLASSES for i in range(3))
    # Val images are not copies of train ones.
    assert not {files[f'train/{n}/{i:06d}.png'] for n in CLASSES for i in range(3)} & {
        files[f'val/{n}/{i:06d}.png'] for n in CLASSES for i in range(3)}


def test_toy_imagenet_rejects_tiny_images(tmp_path):
    log = run_tool([sys.executable, osp.join(TOOLS, 'make_toy_imagenet.py'),
                    '--out', tmp_path, '--img-size', '16'], returncode=2)
    assert '--img-size' in log


@pytest.mark.slow
def test_pretraining_iterations_through_the_train_tool_convert_into_the_detection_backbone(
        tmp_path):
    """The converted classifier initialises the detection backbone with no key left over."""
    make_toy_imagenet(tmp_path / 'data', per_class=2)
    work_dir = tmp_path / 'work'
    data_root = f"{tmp_path / 'data'}/"
    log = run_tool([
        sys.executable, osp.join(TOOLS, 'train.py'), CLS_TOY, '--work-dir', work_dir,
        '--cfg-options', 'train_cfg.max_epochs=1', 'train_cfg.val_interval=1',
        'train_dataloader.batch_size=4', f'train_dataloader.dataset.data_root={data_root}',
        f'val_dataloader.dataset.data_root={data_root}', 'default_hooks.logger.interval=1'])
    # 8 train images in batches of 4, then mmpretrain's Accuracy on the 8 val images.
    assert 'Epoch(train) [1][2/2]' in log
    assert 'accuracy/top1:' in log
    trained = safe_load(work_dir / 'epoch_1.pth')['state_dict']
    assert trained['head.fc.weight'].shape == (len(CLASSES), 512)

    # The converter's command line: tests/models/test_backbone_cls.py.
    dst = tmp_path / 'backbone.pth'
    convert(str(work_dir / 'epoch_1.pth'), str(dst), 'tiny')
    backbone_cfg = Config.fromfile(DET_PRETRAINED).model.backbone
    assert backbone_cfg.init_cfg.type == 'Pretrained'
    kwargs = {k: v for k, v in backbone_cfg.items() if k not in ('type', 'init_cfg')}
    detection_backbone = LaplacianFormer(**kwargs)
    report = load_backbone_weights(detection_backbone, str(dst))
    assert report.missing_keys == () and report.unexpected_keys == ()
    own = detection_backbone.state_dict()
    backbone_keys = [k for k in trained if k.startswith('backbone.')]
    assert len(backbone_keys) == len(own)
    for key in backbone_keys:
        assert torch.equal(own[key[len('backbone.'):]], trained[key]), key


def test_convert_ends_a_bad_source_or_destination_with_one_line(tmp_path, capsys):
    """The converter's other command-line tests: tests/models/test_backbone_cls.py."""
    arch = dict(embed_dims=[16, 32, 32, 64], num_heads=[1, 1, 1, 2], depths=[1, 1, 1, 1])
    src, notes, tensor = tmp_path / 'cls.pth', tmp_path / 'notes.pth', tmp_path / 'tensor.pth'
    torch.save({f'backbone.{k}': v for k, v in LaplacianFormer(arch).state_dict().items()}, src)
    notes.write_text('hello\n')
    torch.save(torch.ones(2), tensor)
    missing, out = str(tmp_path / 'missing.pth'), str(tmp_path / 'out.pth')
    for argv, named in [([missing, out], missing), ([str(notes), out], str(notes)),
                        ([str(tensor), out], 'mapping'),
                        ([str(src), str(notes / 'out.pth')], str(notes))]:
        assert convert_cls_to_backbone.main(argv) == 2
        captured = capsys.readouterr()
        assert named in captured.err and captured.err.count('\n') == 1 and not captured.out
    assert not (tmp_path / 'out.pth').exists()
    # A folder, or a path ending with a separator, takes <source name>_backbone.pth.
    for folder in (str(tmp_path), str(tmp_path / 'new') + osp.sep):
        assert convert_cls_to_backbone.main([str(src), folder]) == 0
        written = osp.join(folder, 'cls_backbone.pth')
        assert safe_load(written)['state_dict'].keys() == LaplacianFormer(arch).state_dict().keys()
    capsys.readouterr()
    log = run_tool([sys.executable, osp.join(TOOLS, 'convert_cls_to_backbone.py'), missing, out],
                   returncode=2)
    assert missing in log and 'Traceback' not in log


def test_toy_classifier_sees_the_detection_input():
    cls_cfg = Config.fromfile(CLS_TOY)
    det_cfg = Config.fromfile(DET_PRETRAINED)
    cls_pre, det_pre = cls_cfg.model.data_preprocessor, det_cfg.model.data_preprocessor
    assert (cls_pre.mean, cls_pre.std) == (det_pre.mean, det_pre.std)
    assert cls_pre.to_rgb == det_pre.bgr_to_rgb
    assert cls_cfg.model.backbone.arch == det_cfg.model.backbone.arch
    in1k = Config.fromfile(osp.join(CONFIG_DIR, 'cls', 'lapformer_t_in1k.py'))
    assert tuple(cls_cfg.model.backbone.out_indices) == tuple(in1k.model.backbone.out_indices)
    assert cls_cfg.model.head.num_classes == len(CLASSES)
    assert cls_cfg.val_evaluator.type == 'Accuracy'
