"""A tiny LaplacianFormer exported once per exporter and run in ONNX Runtime elsewhere.

Each exporter writes the backbone once, traced at batch 2 and EXPORT_SHAPE with dynamic
batch, height and width and the fp32 refinement residual; ONNX Runtime then runs it at
that size and at two others with batch 1, each output held to FACTOR × the distance of
eager fp32 from eager fp64 (tests/_deploy_helpers.py). The dynamo exporter's file is
converted from the ``torch.export`` program that the torch.export test lowers to core
ATen (what :func:`lapformer_mm.deploy.export_onnx` does), so the program is traced once.
"""
import pytest
import torch
from _deploy_helpers import (
    assert_as_close_as_fp32,
    fp64_tensors,
    frozen_reshapes,
    non_standard_nodes,
    stage_sizes,
    tiny_backbone,
)

from lapformer_mm import deploy

onnx = pytest.importorskip('onnx')
pytest.importorskip('onnxruntime')

#: Stage maps 58×74, 29×37, 15×19 and 8×10: none of their sizes is a number of the model
#: (channels, heads, widths, the grid), so a Reshape frozen to them is recognisable.
EXPORT_SHAPE = (232, 296)
#: 231×257 is no multiple of 32; 256×320 is, but its stride-32 map (8×10) is no multiple
#: of the 7×7 landmark grid (uneven bins).
OTHER_SIZES = [(231, 257), (256, 320)]


@pytest.fixture(scope='module')
def backbone():
    return tiny_backbone()


@pytest.fixture(scope='module')
def program(backbone):
    return deploy.export_program(deploy.ExportModule(backbone), shape=EXPORT_SHAPE, batch=2,
                                 residual='fp32')


@pytest.fixture(scope='module', params=[pytest.param('dynamo', marks=pytest.mark.slow),
                                        'torchscript'])
def exported(request, backbone, tmp_path_factory):
    path = str(tmp_path_factory.mktemp('deploy') / f'{request.param}.onnx')
    if request.param == 'dynamo':
        program = request.getfixturevalue('program')
        deploy.program_to_onnx(program, path,
                               output_names=[f'stage{i}' for i in range(4)])
    else:
        deploy.export_onnx(deploy.ExportModule(backbone), path, shape=EXPORT_SHAPE, batch=2,
                           dynamic=True, exporter='torchscript', residual='fp32')
    return path


def test_graph_is_checked_standard_fp32_and_symbolic(exported):
    proto = onnx.load(exported)
    onnx.checker.check_model(proto, full_check=True)
    assert non_standard_nodes(proto) == []
    assert fp64_tensors(proto) == []
    # Numbers below 11 are left out: they are also heads, strides and kernel sizes.
    traced = {n for n in stage_sizes(EXPORT_SHAPE) if n > 10}
    assert frozen_reshapes(proto, traced) == []
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert [bool(d.dim_param) for d in dims] == [True, False, True, True]


@pytest.mark.parametrize('size, batch', [(EXPORT_SHAPE, 2), (OTHER_SIZES[0], 1),
                                         (OTHER_SIZES[1], 1)])
def test_onnx_runtime_as_close_as_fp32_at_other_sizes(exported, backbone, size, batch):
    x = deploy.example_input(size, batch, seed=size[0])
    outs = deploy.run_onnx(deploy.ort_session(exported), x)
    assert [tuple(o.shape) for o in outs] == [
        (batch, c, -(-size[0] // s), -(-size[1] // s))
        for c, s in zip(backbone.embed_dims, (4, 8, 16, 32))]
    assert_as_close_as_fp32(outs, backbone, x, exported)


@pytest.mark.slow
def test_torch_export_lowers_to_core_aten_and_matches_eager(program, backbone):
    lowered = program.run_decompositions()
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == 'call_function'}
    assert not [t for t in targets if 'lapformer_mm' in t or '_cdist' in t
                or 'adaptive_avg_pool' in t], sorted(targets)
    x = deploy.example_input(OTHER_SIZES[0], 1, seed=5)
    with torch.no_grad():
        outs = lowered.module()(x)
    assert_as_close_as_fp32(list(outs), backbone, x, 'torch.export')
    # The size range is part of the program.
    with pytest.raises(Exception, match='193'):
        lowered.module()(deploy.example_input((150, 300), 1))


def test_fp64_residual_is_the_default_and_runs(backbone, tmp_path):
    path = str(tmp_path / 'fp64.onnx')
    deploy.export_onnx(backbone, path, shape=EXPORT_SHAPE, batch=2, dynamic=True,
                       exporter='torchscript')
    assert fp64_tensors(onnx.load(path))  # the check above can see an fp64 tensor
    x = deploy.example_input(OTHER_SIZES[1], 1, seed=7)
    assert_as_close_as_fp32(deploy.run_onnx(deploy.ort_session(path), x), backbone, x, path)


def test_export_size_below_the_range_names_the_minimum(backbone, tmp_path):
    assert backbone.export_min_size() == 193
    with pytest.raises(ValueError, match='H and W must be >= 193'):
        deploy.export_onnx(backbone, str(tmp_path / 'x.onnx'), shape=(192, 400))
    softmax4 = tiny_backbone(stage4_attention='softmax')
    assert softmax4.export_min_size() == 97
    grid5 = tiny_backbone(attn_cfg=dict(landmark_grid=5))
    assert grid5.export_min_size() == 129


@pytest.mark.parametrize('kwargs, match', [
    (dict(shape=(224, )), 'shape must be'), (dict(batch=0), 'batch must be'),
    (dict(exporter='tensorrt'), "exporter='tensorrt' is not supported"),
    (dict(residual='fp16'), "residual='fp16' is not supported")])
def test_bad_export_arguments_are_named(backbone, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        deploy.export_onnx(backbone, str(tmp_path / 'x.onnx'), **kwargs)
