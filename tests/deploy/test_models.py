"""Whole networks through ONNX Runtime at two other sizes than the export's, held to
FACTOR × eager fp32's error against fp64."""
import os.path as osp
import re
import warnings

import pytest
import torch
from _deploy_helpers import TINY_ARCH, assert_as_close_as_fp32, non_standard_nodes, ort_library
from _shared import ROOT
from torch.jit import TracerWarning

import lapformer_mm
from lapformer_mm import deploy
from lapformer_mm.cli import export_onnx as cli

onnx = pytest.importorskip('onnx')
pytest.importorskip('onnxruntime')
pytest.importorskip('mmdet')
pytest.importorskip('mmseg')

DIMS = TINY_ARCH['embed_dims']
FPN = 32
# The toy configs name their arch ('tiny'); a dict replaces the name only with _delete_.
ARCH = dict(TINY_ARCH, _delete_=True)
# The segmentors' backbones keep the local term only: the attention's graph, about half of a
# dynamo export's time, is the backbone tests' and the Mask R-CNN's; theirs add the heads'.
LOCAL = dict(global_term=False)
MASK_RCNN = ('configs/toy/maskrcnn_lapformer_t_toy.py', {
    'model.backbone.arch': ARCH, 'model.neck.in_channels': DIMS,
    'model.neck.out_channels': FPN, 'model.rpn_head.in_channels': FPN,
    'model.rpn_head.feat_channels': FPN,
    'model.roi_head.bbox_roi_extractor.out_channels': FPN,
    'model.roi_head.bbox_head.in_channels': FPN,
    'model.roi_head.bbox_head.conv_out_channels': FPN,
    'model.roi_head.mask_roi_extractor.out_channels': FPN,
    'model.roi_head.mask_head.in_channels': FPN,
    'model.roi_head.mask_head.conv_out_channels': FPN})
UPERNET = ('configs/toy/upernet_lapformer_t_toy.py', {
    'model.backbone.arch': ARCH, 'model.backbone.attn_cfg': LOCAL,
    'model.decode_head.in_channels': DIMS,
    'model.decode_head.channels': 16, 'model.auxiliary_head.in_channels': DIMS[2],
    'model.auxiliary_head.channels': 16})
# Semantic FPN: its head upsamples by 2 with mmseg's Upsample (prepare_for_export's form).
FPN_SEG = ('configs/fpn_lapformer_t_ade20k.py', {
    'model.backbone.arch': ARCH, 'model.backbone.init_cfg': None,
    'model.backbone.attn_cfg': LOCAL,
    'model.neck.in_channels': DIMS, 'model.neck.out_channels': 16,
    'model.decode_head.in_channels': [16] * 4, 'model.decode_head.channels': 16})
RETINANET = ('configs/toy/retinanet_lapformer_t_toy.py', )

EXPORT_SHAPE = (232, 296)
OTHER_SIZES = [(231, 257), (256, 320)]
EXPECTED_OUTPUTS = {
    'maskrcnn': [f'feat{i}' for i in range(5)] + [f'rpn_cls{i}' for i in range(5)]
    + [f'rpn_bbox{i}' for i in range(5)],
    'upernet': ['seg_logits'],
    'fpn': ['seg_logits'],
}


@pytest.fixture(scope='module')
def models():
    return {name: deploy.build_model(config, cfg_options=options)[0]
            for name, (config, options) in (('maskrcnn', MASK_RCNN), ('upernet', UPERNET),
                                            ('fpn', FPN_SEG))}


@pytest.mark.parametrize('exporter', [pytest.param('dynamo', marks=pytest.mark.slow(seconds=15)),
                                      'torchscript'])
@pytest.mark.parametrize('name', ['maskrcnn', 'upernet', 'fpn'])
def test_network_outputs_through_onnx_runtime(models, tmp_path, name, exporter):
    module = deploy.ExportModule(models[name], 'model')
    path = str(tmp_path / f'{name}.onnx')
    names = deploy.export_onnx(module, path, shape=EXPORT_SHAPE, batch=2, dynamic=True,
                               exporter=exporter)
    assert names == EXPECTED_OUTPUTS[name]
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    assert non_standard_nodes(proto) == []
    assert [o.name for o in proto.graph.output] == names
    session = deploy.ort_session(path)
    for size in OTHER_SIZES:
        x = deploy.example_input(size, 1, seed=size[1])
        outs = deploy.run_onnx(session, x)
        assert_as_close_as_fp32(outs, module, x, f'{name} {exporter}')


def test_targets_of_a_network(models):
    x = deploy.example_input(EXPORT_SHAPE, 1)
    model = models['maskrcnn']
    backbone = deploy.ExportModule(model, 'backbone')
    assert len(backbone(x)) == 4 and backbone.output_names == [f'stage{i}' for i in range(4)]
    features = deploy.ExportModule(model, 'features')
    assert len(features(x)) == 5 and features.output_names == [f'feat{i}' for i in range(5)]
    for module, target in ((model.backbone, 'features'), (model, 'head')):
        with pytest.raises(ValueError, match='target'):
            deploy.ExportModule(module, target)


def test_build_model_loads_a_checkpoint_or_names_what_does_not_fit(models, tmp_path):
    config, options = UPERNET
    # Weights no fresh build has; a DDP-wrapped run's checkpoint ('module.' keys) without
    # num_batches_tracked, which BatchNorm's load hook fills.
    state = {k: v + 0.5 if v.is_floating_point() else v
             for k, v in models['upernet'].state_dict().items()}
    tracked = [k for k in state if k.endswith('num_batches_tracked')]
    path = str(tmp_path / 'ddp.pth')
    torch.save({'state_dict': {f'module.{k}': v for k, v in state.items() if k not in tracked}},
               path)
    loaded = deploy.build_model(config, path, options)[0].state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in loaded.items() if k not in tracked)
    torch.save({k: v for k, v in state.items() if not k.startswith('decode_head.')}, path)
    with pytest.raises(ValueError, match='missing keys'):
        deploy.build_model(config, path, options)
    key = 'decode_head.conv_seg.weight'
    torch.save(dict(state, **{key: torch.zeros(19, 16, 1, 1)}), path)
    with pytest.raises(RuntimeError, match=key):
        deploy.build_model(config, path, options)
    torch.save([state[key]], path)
    with pytest.raises(ValueError, match='checkpoint'):
        deploy.build_model(config, path, options)


def tiny_retinanet_config(folder):
    """The toy RetinaNet with the tiny backbone (--cfg-options cannot make the arch a dict)."""
    path = folder / 'retinanet_tiny.py'
    path.write_text(f"_base_ = [{osp.join(ROOT, RETINANET[0])!r}]\n"
                    f"model = dict(backbone=dict(arch={ARCH!r}), "
                    f"neck=dict(in_channels={DIMS[1:]!r}))\n")
    return str(path)


@pytest.mark.slow(seconds=15)  # 12 s on 2 cores: over the fast tier's ~10 s
def test_cli_exports_retinanet_maps_and_verifies(tmp_path, capsys, monkeypatch):
    library = ort_library()  # --ort-ops where the op library builds: --verify registers it
    ort_args = [] if library is None else ['--ort-ops']
    if library is not None:
        monkeypatch.setenv(deploy.ORT_OPS_ENV, library)
    # A folder (created) for --out: the default name in it.
    folder = osp.join(str(tmp_path), 'exports', '')
    out = osp.join(folder, 'retinanet_tiny_model.onnx')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        code = cli.main([tiny_retinanet_config(tmp_path), '--target', 'model', '--shape',
                         *map(str, EXPORT_SHAPE), '--dynamic', '--exporter', 'torchscript',
                         '--out', folder, '--verify', '--verify-images', '2'] + ort_args)
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert 'ONNX Runtime against PyTorch eager on toy COCO scenes' in printed
    ours = [f'{w.filename}:{w.lineno}' for w in caught if issubclass(w.category, TracerWarning)
            and osp.dirname(lapformer_mm.__file__) in w.filename]
    assert not ours, ours
    assert deploy.uses_ort_ops(out) == (library is not None)
    names = [f'cls_score{i}' for i in range(5)] + [f'bbox_pred{i}' for i in range(5)]
    assert f'outputs: {", ".join(names)}' in printed
    rows = [line for line in printed.splitlines() if line.startswith('| 2') or
            line.startswith('| 1') or line.startswith('| 3')]
    assert len(rows) == 6, printed  # two images at the export size and two others
    for row in rows:
        image, rel, rounding, fp64 = (row.split('|')[i] for i in (2, 5, 6, 7))
        assert int(image) in (0, 1) and 0 < float(rounding) < 1e-3 and float(fp64) < 1e-3
        assert float(rel) < 1e-2, row
    # A file far from eager at a size (as one traced with a fixed size) fails --verify.
    verify = deploy.verify_onnx

    def off_at_other_sizes(*args, **kwargs):
        rows = verify(*args, **kwargs)
        for row in rows[1:]:
            row['max_rel'] = 101 * max(row['rounding_rel'], 1e-6) * (1 + 1e-6)
        return rows
    monkeypatch.setattr(deploy, 'verify_onnx', off_at_other_sizes)
    assert cli.main([tiny_retinanet_config(tmp_path), '--target', 'model', '--shape',
                     *map(str, EXPORT_SHAPE), '--dynamic', '--exporter', 'torchscript',
                     '--out', folder, '--verify']) == 1
    err = capsys.readouterr().err
    # The two sizes past the factor named, the export size not.
    sizes = re.findall(r'(\d+)x(\d+) \(', err)
    assert err.startswith('export_onnx: ') and len(sizes) == 2, err
    assert tuple(map(int, sizes[0])) != EXPORT_SHAPE


def test_cli_names_the_minimum_size(tmp_path, capsys):
    code = cli.main([tiny_retinanet_config(tmp_path), '--shape', '128', '128', '--exporter',
                     'torchscript', '--out', str(tmp_path / 'x.onnx')])
    assert code == 2
    assert 'export_min_size' in capsys.readouterr().err
    config = tiny_retinanet_config(tmp_path)  # a config file given as the checkpoint
    assert cli.main([config, config, '--out', str(tmp_path / 'x.onnx')]) == 2
    assert config in capsys.readouterr().err
