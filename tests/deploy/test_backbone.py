"""A tiny LaplacianFormer exported once per exporter and run in ONNX Runtime and OpenVINO,
each output held to FACTOR × eager fp32's distance from fp64 (tests/_deploy_helpers.py)."""
import re

import pytest
import torch
from _deploy_helpers import (
    FACTOR,
    FLOOR,
    TINY_ARCH,
    assert_as_close_as_fp32,
    fp64_tensors,
    frozen_reshapes,
    non_standard_nodes,
    ort_library,
    stage_sizes,
    tiny_backbone,
)
from torch._dynamo.exc import UserError
from torch.export import Dim

from lapformer_mm import deploy
from lapformer_mm.ops import export as ex

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


@pytest.fixture(scope='module', params=[pytest.param('dynamo', marks=pytest.mark.slow),
                                        'torchscript'])
def exported(request, backbone, tmp_path_factory):
    path = str(tmp_path_factory.mktemp('deploy') / f'{request.param}.onnx')
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ex, 'BLOCK_BYTES', 1 << 18)
        # The dynamo file with its weights in a data file beside it, as above ~2 GB: the
        # token blocks' expansion must leave them there.
        patch.setattr(deploy, 'SINGLE_FILE_BYTES', 0 if request.param == 'dynamo' else 2 ** 40)
        deploy.export_onnx(deploy.ExportModule(backbone), path, shape=EXPORT_SHAPE, batch=2,
                           dynamic=True, exporter=request.param, residual='fp32')
    return path


def test_graph_is_checked_standard_fp32_and_symbolic(exported):
    external = [t for t in onnx.load(exported, load_external_data=False).graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL]
    assert bool(external) == exported.endswith('dynamo.onnx')
    proto = onnx.load(exported)
    onnx.checker.check_model(proto, full_check=True)
    assert non_standard_nodes(proto) == []
    assert fp64_tensors(proto) == []
    # The kernel matrices of stages 1-3 in 8, 4 and 2 token blocks of ≤ 256 KiB.
    assert sorted(len(n.output) for n in proto.graph.node if n.op_type == 'Split'
                  and n.name.startswith('lapformer_mm_kernel')) == [2, 4, 8]
    # Numbers below 11 are left out: they are also heads, strides and kernel sizes.
    traced = {n for n in stage_sizes(EXPORT_SHAPE) if n > 10}
    assert frozen_reshapes(proto, traced) == []
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ['batch', '', 'height', 'width']
    # torch.export's symbols (s0, s77, ...) renamed wherever the dynamo file uses them.
    outputs = [d.dim_param for o in proto.graph.output for d in o.type.tensor_type.shape.dim]
    assert not [p for p in outputs if re.search(r'\bs\d+\b', p)], outputs


@pytest.mark.parametrize('size, batch', [(EXPORT_SHAPE, 2), (OTHER_SIZES[0], 1),
                                         (OTHER_SIZES[1], 1)])
def test_onnx_runtime_as_close_as_fp32_at_other_sizes(exported, backbone, size, batch):
    x = deploy.example_input(size, batch, seed=size[0])
    outs = deploy.run_onnx(deploy.ort_session(exported), x)
    assert [tuple(o.shape) for o in outs] == [
        (batch, c, -(-size[0] // s), -(-size[1] // s))
        for c, s in zip(backbone.embed_dims, (4, 8, 16, 32))]
    assert_as_close_as_fp32(outs, backbone, x, exported)


def test_verify_refuses_sizes_below_the_export_range_and_runs_from_the_minimum(
        exported, backbone):
    """ONNX Runtime runs a file below its range, far from eager: such a size is refused."""
    for sizes in ([EXPORT_SHAPE, (192, 296)], [(33, 47)]):
        with pytest.raises(ValueError, match='sizes'):
            deploy.verify_onnx(exported, backbone, sizes)
    with pytest.raises(ValueError, match='images'):  # no rows would read as a pass
        deploy.verify_onnx(exported, backbone, [EXPORT_SHAPE], images=0)
    (row, ) = deploy.verify_onnx(exported, backbone, [[193, 193]])
    assert row['size'] == (193, 193)
    assert row['max_rel'] <= FACTOR * max(row['fp32_vs_fp64_rel'], FLOOR)


@pytest.mark.slow(seconds=15)
def test_torch_export_with_plain_dims_matches_eager(backbone):
    # What a user writes: a static batch of 2, Dims on H and W from the documented minimum.
    # (Lowering the program to core ATen is what both ONNX exports above do to it.)
    low = backbone.export_min_size()
    x = deploy.example_input(EXPORT_SHAPE, 2)
    dims = ({2: Dim('h', min=low, max=2048), 3: Dim('w', min=low, max=2048)}, )
    with torch.no_grad():
        program = torch.export.export(backbone, (x, ), dynamic_shapes=dims)
    targets = {str(n.target) for n in program.graph.nodes if n.op == 'call_function'}
    assert not [t for t in targets if 'lapformer_mm' in t or 'cdist' in t
                or 'adaptive_avg_pool' in t], sorted(targets)
    for size in OTHER_SIZES + [(low, low + 7)]:
        x = deploy.example_input(size, 2, seed=size[1])
        with torch.no_grad():
            outs = program.module()(x)
        assert_as_close_as_fp32(list(outs), backbone, x, 'torch.export')
    # A range reaching below the minimum is refused by the rule (the backbone's first guard).
    low = ({2: Dim('h', min=100, max=2048), 3: Dim('w', min=224, max=2048)}, )
    with pytest.raises(UserError, match=r"(?s)193 <= .*Dim\('h', min=193"):
        torch.export.export(backbone, (deploy.example_input(EXPORT_SHAPE, 2), ),
                            dynamic_shapes=low)


@pytest.mark.slow(seconds=60)
def test_the_dynamo_onnx_call_users_write_exports_and_runs_at_other_sizes(backbone, tmp_path):
    """Named dynamic dims, no wrapper and no range: the backbone's torch._check narrows H and
    W to export_min_size; the file runs at sizes and batches the export never saw."""
    path = str(tmp_path / 'user.onnx')
    x = deploy.example_input(EXPORT_SHAPE, 2)
    torch.onnx.export(backbone, (x, ), dynamo=True,
                      dynamic_shapes=({0: 'batch', 2: 'height', 3: 'width'}, )).save(path)
    dims = onnx.load(path).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ['batch', '', 'height', 'width']
    session = deploy.ort_session(path)
    for size, batch in [((193, 197), 1), (OTHER_SIZES[0], 3)]:
        x = deploy.example_input(size, batch, seed=size[0])
        assert_as_close_as_fp32(deploy.run_onnx(session, x), backbone, x, path)


@pytest.mark.parametrize('axis, side', [(2, 'height'), (3, 'width')])
def test_torch_export_with_one_dim_names_the_rule(backbone, axis, side):
    # torch.export cannot prove the token splits with one static side: the rule, not a guard.
    dims = ({axis: Dim('s', min=224, max=2048)}, )
    with pytest.raises(ValueError, match=side):
        torch.export.export(backbone, (deploy.example_input(EXPORT_SHAPE, 2), ),
                            dynamic_shapes=dims)


def test_openvino_runs_the_standard_file_in_fp32(exported, backbone):
    # In fp32: OpenVINO's bf16 default on CPUs with bf16 units turns the whitening's
    # amplification into noise (docs/deploy.md).
    ov = pytest.importorskip('openvino')
    core = ov.Core()
    compiled = core.compile_model(core.read_model(exported), 'CPU',
                                  {'INFERENCE_PRECISION_HINT': 'f32'})
    assert compiled.get_property('INFERENCE_PRECISION_HINT') == ov.Type.f32
    for size in OTHER_SIZES:
        x = deploy.example_input(size, 1, seed=size[1])
        results = compiled(x.numpy())
        outs = [torch.from_numpy(results[o]) for o in compiled.outputs]
        assert [tuple(o.shape) for o in outs] == [
            (1, c, -(-size[0] // s), -(-size[1] // s))
            for c, s in zip(backbone.embed_dims, (4, 8, 16, 32))]
        assert_as_close_as_fp32(outs, backbone, x, f'OpenVINO {exported}')


def test_fp64_residual_default_and_the_op_library(backbone, tmp_path):
    # The default residual is fp64; where the library builds, the attentions are its nodes.
    library = ort_library()
    path = str(tmp_path / 'fp64.onnx')
    deploy.export_onnx(backbone, path, shape=EXPORT_SHAPE, batch=2, dynamic=True,
                       exporter='torchscript', ort_ops=library is not None)
    proto = onnx.load(path)
    assert fp64_tensors(proto)  # the check above can see an fp64 tensor
    if library is not None:
        # Per attention P's kernel matrix, the passes over the rows (stages 1-3 tie keys to
        # queries: one; stage 4 does not: two) and the product.
        nodes = [n.op_type for n in proto.graph.node if n.domain == ex.ORT_DOMAIN]
        assert {op: nodes.count(op) for op in ex.ORT_OPS} == {
            ex.ORT_KERNEL_OP: 4, ex.ORT_ROWS_OP: 5, ex.ORT_APPLY_OP: 4}
    x = deploy.example_input(OTHER_SIZES[1], 1, seed=7)
    session = deploy.ort_session(path, ort_ops=library or False)
    assert_as_close_as_fp32(deploy.run_onnx(session, x), backbone, x, path)


def test_export_size_below_the_range_names_the_minimum(backbone, tmp_path):
    """A smaller example would trace a wrong graph (TorchScript) or a program failing the rule."""
    assert backbone.export_min_size() == 193
    small = deploy.example_input((160, 256), 1)
    for export in (lambda: deploy.export_onnx(backbone, str(tmp_path / 'x.onnx'),
                                              shape=(192, 400)),
                   lambda: torch.onnx.export(backbone, (small, ), str(tmp_path / 'y.onnx'),
                                             dynamo=False),
                   lambda: torch.export.export(backbone, (small, ))):
        with pytest.raises(RuntimeError, match='export_min_size'):
            export()
    softmax4 = tiny_backbone(stage4_attention='softmax')
    assert softmax4.export_min_size() == 97
    grid5 = tiny_backbone(attn_cfg=dict(landmark_grid=5))
    assert grid5.export_min_size() == 129


def test_bad_export_arguments_are_named(backbone, tmp_path):
    from onnxscript.version_converter import _version_converter
    # An unknown exporter took the TorchScript branch; a bad opset is refused before the
    # export (minutes), past onnxscript's converter too (onnx's has no adapters for these).
    for kwargs, name in ((dict(exporter='tensorrt'), 'exporter'),
                         (dict(residual='fp16'), 'residual'), (dict(opset=17), 'opset'),
                         (dict(opset=9, exporter='torchscript'), 'opset'),
                         (dict(opset=99, exporter='torchscript'), 'opset'),
                         (dict(opset=_version_converter.SUPPORTED_MAX_ONNX_OPSET + 1), 'opset')):
        with pytest.raises((ValueError, RuntimeError), match=name):
            deploy.export_onnx(backbone, str(tmp_path / 'x.onnx'), **kwargs)
    assert not (tmp_path / 'x.onnx').exists()


def test_an_opset_the_dynamo_exporter_falls_back_from_is_refused(tmp_path, monkeypatch):
    """The dynamo exporter keeps 18 with a log line only: refused, no file written."""
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.GELU()).eval()
    program = torch.export.export(module, (torch.randn(1, 3, 8, 8), ))
    path = tmp_path / 'x.onnx'
    export = torch.onnx.export
    with monkeypatch.context() as patch:
        patch.setattr(torch.onnx, 'export',
                      lambda *args, **kwargs: export(*args, **dict(kwargs, opset_version=18)))
        with pytest.raises(ValueError, match='opset=21'):
            deploy.program_to_onnx(program, str(path), opset=21)
    assert not path.exists()
    deploy.program_to_onnx(program, str(path), opset=21)
    assert onnx.load(str(path)).opset_import[0].version == 21


def test_verify_inputs_sizes_and_measure():
    assert deploy.verify_sizes([224, 300], 193) == [(224, 300), (193, 337), (269, 236)]
    # Unit spread wherever the field varies; a constant one is refused, not NaN.
    for shape, cells in (((1, 2), (2, 2)), ((2, 1), (2, 2)), ((3, 5), (2, 2)),
                         ((224, 224), (1, 8)), ((5, 1), (2, 1))):
        x = deploy.smooth_input(shape, 2, cells=cells)
        assert x.shape == (2, 3, *shape)
        assert torch.allclose(x.double().std((2, 3)), torch.ones(2, 3).double(), atol=1e-6)
    for shape, cells in (((1, 1), (6, 8)), ((5, 1), (1, 8)), ((1, 7), (6, 1))):
        with pytest.raises(ValueError, match='cells'):
            deploy.smooth_input(shape, 1, cells=cells)
    # No values would read as a match; a missing output or one of another shape would be
    # dropped or broadcast.
    one = torch.ones(2, 3)
    assert deploy.output_error([one, -one], [one, 2 * one]) == dict(max_abs=3.0, max_rel=1.5)
    for outs, refs in (([], []), ([one, torch.ones(0, 3)], [one, torch.ones(0, 3)]),
                       ([one, one], [one]), ([one], [one[:1]])):  # zip and broadcasting
        with pytest.raises(ValueError, match='outs and refs'):
            deploy.output_error(outs, refs)
    one = torch.randn(2, 3, 16, 16)
    moved = deploy.rounding_change(one, seed=3)
    step = (moved - one).abs()  # at most one ulp, about a quarter of the values
    assert (step <= torch.finfo(torch.float32).eps * one.abs()).all()
    assert 0.2 < (step > 0).double().mean() < 0.8
    assert torch.equal(moved, deploy.rounding_change(one, seed=3))


def test_backbone_outputs_are_named_by_stage():
    module = deploy.ExportModule(tiny_backbone(out_indices=(1, 3)))
    outs = module(deploy.example_input((224, 224), 1))
    assert module.output_names == ['stage1', 'stage3']
    assert [o.shape[-1] for o in outs] == [224 // 8, 224 // 32]


def test_toy_image_input_is_a_normalised_toy_scene():
    import numpy as np

    from lapformer_mm.scenes import render_image
    x = deploy.toy_image_input((97, 131), 2, seed=5)
    assert x.shape == (2, 3, 97, 131) and x.dtype == torch.float32
    assert torch.equal(x, deploy.toy_image_input((97, 131), 2, seed=5))
    # Image i is scene seed + i, normalised channel by channel with the configs' mean/std.
    image, _, _ = render_image(np.random.default_rng(6), 131, 97, 4)
    expect = (torch.from_numpy(image.astype(np.float64)).permute(2, 0, 1)
              - torch.tensor(deploy.IMAGE_MEAN, dtype=torch.float64).view(3, 1, 1)) \
        / torch.tensor(deploy.IMAGE_STD, dtype=torch.float64).view(3, 1, 1)
    assert torch.allclose(x[1].double(), expect, atol=1e-6)


def test_preparing_a_model_without_mmseg_parts_imports_no_codebase():
    """An mmdet export neither imports mmseg nor fails with an mmseg that does not import."""
    import subprocess
    import sys
    code = ('import sys; from lapformer_mm import deploy; '
            'from lapformer_mm.models import LaplacianFormer; '
            f'deploy.prepare_for_export(LaplacianFormer({TINY_ARCH!r})); '
            "print(sorted(m for m in ('mmseg', 'mmdet', 'mmpretrain') if m in sys.modules))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip().splitlines()[-1] == '[]'
