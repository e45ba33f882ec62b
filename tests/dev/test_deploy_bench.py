"""benchmarks/deploy.py: --profile and the --parity norms."""
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from benchmarks import deploy as bench


@pytest.fixture
def l1_file(tmp_path):
    """The standard file's ℓ1 step alone: Sub → Abs → ReduceSum over d."""
    nodes = [helper.make_node('Sub', ['x', 'y'], ['t']), helper.make_node('Abs', ['t'], ['a']),
             helper.make_node('ReduceSum', ['a', 'axes'], ['out'], keepdims=0)]
    graph = helper.make_graph(
        nodes, 'l1', [helper.make_tensor_value_info('x', TensorProto.FLOAT, [1, 8, 4096])],
        [helper.make_tensor_value_info('out', TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor('y', TensorProto.FLOAT, [7, 8, 1], [0.5] * 56),
                     helper.make_tensor('axes', TensorProto.INT64, [1], [1])])
    path = str(tmp_path / 'l1.onnx')
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid('', 20)]), path)
    return path


def test_profile_sums_kernel_time_by_operator_type(l1_file, tmp_path):
    x = torch.randn(1, 8, 4096)
    ops = bench.profile_by_op(l1_file, x, threads=1, repeats=3, folder=str(tmp_path))
    assert set(ops) == {'Sub', 'Abs', 'ReduceSum'}
    assert all(ms > 0 for ms in ops.values())
    assert list(ops.values()) == sorted(ops.values(), reverse=True)
    line = bench.format_profile({'l1 step': ops}, top=2).splitlines()[1]
    assert line.startswith(f'- l1 step: {sum(ops.values()):.0f} ms of kernels; ')
    assert line.count(',') == 1  # two operator types shown


def test_every_optimizer_is_scoped():
    from lapformer_mm import deploy
    kept = list(deploy.ORT_DISABLED_OPTIMIZERS)
    with pytest.raises(RuntimeError), bench.every_optimizer():
        assert deploy.ORT_DISABLED_OPTIMIZERS == []
        raise RuntimeError
    assert deploy.ORT_DISABLED_OPTIMIZERS == kept == ['SkipLayerNormFusion']


def test_parity_norms_measure_the_stage_map():
    import numpy as np
    ref = torch.randn(1, 8, 5, 7)
    out = ref + 1e-3 * torch.randn_like(ref)
    r, d = ref.numpy().astype(np.float64), out.numpy().astype(np.float64) - ref.numpy()
    assert bench.PARITY_NORMS['max'][1](out, ref) == pytest.approx(
        np.abs(d).max() / np.abs(r).max(), rel=1e-9)
    assert bench.PARITY_NORMS['l2'][1](out, ref) == pytest.approx(
        np.sqrt((d ** 2).sum() / (r ** 2).sum()), rel=1e-9)
    assert bench.parse_args(['--parity', '--norm', 'l2']).norm == 'l2'


@pytest.mark.parametrize('argv, names', [
    (['--parity', '--norm', 'rms'], ['--norm']), (['--models', 'foo'], ['--models']),
    (['--repeats', '0'], ['--repeats']), (['--threads', '1', '0'], ['--threads']),
    (['--parity', '--size', '64x64', '--threads', '2'], ['--parity', '--size', '--threads']),
    (['--precision', '--exporter', 'dynamo'], ['--precision', '--exporter']),
    (['--norm', 'l2'], ['--norm']), (['--parity', '--precision'], ['--parity', '--precision']),
])
def test_argument_errors(argv, names, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    err = capsys.readouterr().err
    assert 'error: ' in err and all(name in err for name in names), err


def test_mode_options_are_accepted_in_their_mode():
    assert bench.parse_args(['--parity', '--images', '2', '--seed', '0']).images == 2
    assert bench.parse_args(['--size', '64x64', '--threads', '1', '2']).threads == [1, 2]
