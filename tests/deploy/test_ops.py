"""The export forms and the ONNX Runtime op library against independent fp64 computations,
through both ONNX exporters; the forms are taken only while an exporter traces."""
import copy
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from _attention_helpers import dense_attention, dense_attention_module, dense_kernel, smooth_tokens
from _deploy_helpers import (
    ORT_INCLUDE,
    non_standard_nodes,
    relative_errors,
    require_ort_headers,
    require_ort_library,
    tiny_backbone,
)

from lapformer_mm import deploy
from lapformer_mm.models import LaplacianAttention
from lapformer_mm.ops import AttentionOptions, nystrom_attention, pool_landmarks
from lapformer_mm.ops import export as ex
from lapformer_mm.ops import reference as ref
from lapformer_mm.ops.backends import cpu

onnx = pytest.importorskip('onnx')
ort = pytest.importorskip('onnxruntime')


@pytest.mark.parametrize('hw, out', [((7, 7), (7, 7)), ((56, 72), (7, 7)), ((29, 37), (7, 7)),
                                     ((8, 10), (7, 7)), ((13, 9), (6, 6)), ((3, 5), (7, 7)),
                                     ((11, 17), (1, 1)), ((20, 23), (3, 2))])
def test_adaptive_avg_pool2d_export_matches_aten(hw, out):
    maps = torch.randn(2, 3, *hw, dtype=torch.float64)
    expected = F.adaptive_avg_pool2d(maps, out)
    torch.testing.assert_close(ref.adaptive_avg_pool2d_export(maps, out), expected,
                               rtol=1e-12, atol=1e-13)
    module = deploy.AdaptiveAvgPool2dExport(out)
    torch.testing.assert_close(module(maps), expected, rtol=1e-12, atol=1e-13)
    with pytest.raises(ValueError, match='output_size'):  # None: the input's size
        deploy.AdaptiveAvgPool2dExport((2, None))


@pytest.mark.parametrize('hw', [(7, 7), (9, 8), (29, 37)])
def test_pool_landmarks_export_matches_pool_landmarks(hw):
    tokens = torch.randn(2, 3, hw[0] * hw[1], 5, dtype=torch.float64)
    torch.testing.assert_close(ref.pool_landmarks_export(tokens, hw, 7),
                               pool_landmarks(tokens, hw, 7), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize('kind', ['laplacian', 'gaussian'])
@pytest.mark.parametrize('num_landmarks, chunk', [(10, 7), (49, 7), (49, None), (3, 7),
                                                  (13, 4)])
def test_pairwise_kernel_export_matches_dense(kind, num_landmarks, chunk):
    gen = torch.Generator().manual_seed(num_landmarks)
    x = torch.randn(2, 3, 50, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(2, 3, num_landmarks, 8, generator=gen, dtype=torch.float64)
    got = ref.similarity_export(x, y, 2.5, kind, chunk=chunk)
    torch.testing.assert_close(got, dense_kernel(x, y, 2.5, kind), rtol=1e-12, atol=1e-14)


def test_gaussian_export_is_exact_at_large_norms():
    # k(x, x) = 1 in fp32 at any norm (the matmul expansion gives 0.14 at |x| ~ 5700).
    x = torch.full((1, 4, 32), 1000.0)
    got = ref.similarity_export(x, x, 4.0, 'gaussian')
    torch.testing.assert_close(torch.diagonal(got, dim1=-2, dim2=-1), torch.ones(1, 4))


OPTION_CASES = [
    dict(),
    dict(kernel='gaussian', lam=8.0),
    dict(normalize='none'),
    dict(ns_refine=False),
    dict(ns_init='authors', iters=24),
    dict(eps=0.1, whiten_eps=0.0),
]


@pytest.mark.parametrize('options', OPTION_CASES)
@pytest.mark.parametrize('shared', [True, False])
def test_export_attention_matches_dense_fp64(options, shared):
    q = smooth_tokens(2, (14, 16), 8, 1.0, seed=3)
    k = q if shared else smooth_tokens(2, (14, 16), 8, 1.0, seed=4)
    v = smooth_tokens(2, (14, 16), 8, 1.0, seed=5)
    landmarks = pool_landmarks(k, (14, 16), 7)
    opts = AttentionOptions(impl='reference', **options)
    got = nystrom_attention(q, k, v, landmarks, opts, export=ex.ExportForm())
    dense_args = {key: val for key, val in options.items()
                  if key in ('lam', 'eps', 'whiten_eps', 'kernel', 'normalize')}
    expected = dense_attention(q, k, v, landmarks, **dense_args)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('precision', ex.RESIDUAL_PRECISIONS)
def test_export_attention_fp32_both_residuals_near_dense(precision):
    q = smooth_tokens(1, (14, 16), 8, 1.0, seed=6)
    v = smooth_tokens(1, (14, 16), 8, 1.0, seed=7)
    landmarks = pool_landmarks(q, (14, 16), 7)
    expected = dense_attention(q, q, v, landmarks)
    qf, vf, lf = q.float(), v.float(), landmarks.float()
    got = nystrom_attention(qf, qf, vf, lf, AttentionOptions(), export=ex.ExportForm(precision))
    assert got.dtype == torch.float32
    assert relative_errors([got], [expected])[0] < 1e-5


def test_export_form_is_checked_when_built():
    with pytest.raises(ValueError, match='residual'):
        ex.ExportForm('fp16')
    with pytest.raises(TypeError, match='ort'):
        ex.ExportForm(ort=1)


@pytest.mark.parametrize('options', [dict(solver='exact'), dict(solver='cg'),
                                     dict(impl='cupy'), dict(impl='cpu')])
def test_only_newton_and_reference_export(options):
    name = next(iter(options))
    with pytest.raises(ValueError, match=name):
        ex.check_exportable(AttentionOptions(**options))
    with pytest.raises(ValueError, match=f'stages.0.blocks.0.attn: {name}'):
        deploy.prepare_for_export(tiny_backbone(attn_cfg=options))


class Primitives(torch.nn.Module):
    """Every export form in one graph: q (B, h, N, d), v, landmarks (B, h, m, d), maps."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, v, landmarks, maps):
        eye = torch.eye(landmarks.shape[-2], dtype=q.dtype)
        P = ref.similarity_export(landmarks, landmarks, 4.0, 'laplacian', None) + 0.01 * eye
        return (ref.similarity_export(q, landmarks, 4.0, 'laplacian'),
                ref.similarity_export(q, landmarks, 4.0, 'gaussian'),
                ref.newton_schulz(P, 16, 'identity'),
                ref.adaptive_avg_pool2d_export(maps, (7, 7)),
                nystrom_attention(q, q, v, landmarks, AttentionOptions(), export=self.form))


def primitive_inputs(num_tokens, hw, seed):
    gen = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(2, 2, num_tokens, 8, generator=gen)
    v = torch.randn(2, 2, num_tokens, 8, generator=gen)
    landmarks = q[:, :, :49] + 0.1 * torch.randn(2, 2, 49, 8, generator=gen)
    maps = torch.randn(2, 3, *hw, generator=gen)
    return q, v, landmarks, maps


def primitive_references(q, v, landmarks, maps):
    """The dense fp64 computations of each output of :class:`Primitives`."""
    q, v, landmarks, maps = (t.double() for t in (q, v, landmarks, maps))
    P = dense_kernel(landmarks, landmarks, 4.0, 'laplacian') + 0.01 * torch.eye(
        49, dtype=torch.float64)
    return [dense_kernel(q, landmarks, 4.0, 'laplacian'),
            dense_kernel(q, landmarks, 4.0, 'gaussian'), torch.linalg.inv(P),
            F.adaptive_avg_pool2d(maps, (7, 7)), dense_attention(q, q, v, landmarks)]


@pytest.mark.parametrize('exporter, precision', [('dynamo', 'fp64'), ('torchscript', 'fp64'),
                                                 ('torchscript', 'fp32')])
def test_primitives_through_both_exporters_and_onnx_runtime(tmp_path, exporter, precision):
    path = str(tmp_path / 'primitives.onnx')
    names = ['q', 'v', 'landmarks', 'maps']
    args = primitive_inputs(120, (20, 23), seed=0)
    module = Primitives(ex.ExportForm(precision)).eval()
    with torch.no_grad():
        if exporter == 'dynamo':
            n = torch.export.Dim('n', min=49)
            h, w = torch.export.Dim('h', min=2), torch.export.Dim('w', min=2)
            torch.onnx.export(module, args, path, dynamo=True, verbose=False,
                              input_names=names, dynamic_shapes=(
                                  {2: n}, {2: n}, None, {2: h, 3: w}))
        else:
            torch.onnx.export(module, args, path, dynamo=False, opset_version=18,
                              input_names=names, dynamic_axes={
                                  'q': {2: 'n'}, 'v': {2: 'n'}, 'maps': {2: 'h', 3: 'w'}})
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    assert non_standard_nodes(proto) == []
    # The ℓ1 step as Abs + ReduceSum: ONNX Runtime runs ReduceL1 as a scalar loop.
    ops = {n.op_type for n in proto.graph.node}
    assert {'Abs', 'ReduceSum'} <= ops and not ops & {'ReduceL1', 'ReduceL2'}, ops
    session = deploy.ort_session(path)
    for num_tokens, hw in ((120, (20, 23)), (203, (57, 31))):  # the export size and another
        inputs = primitive_inputs(num_tokens, hw, seed=num_tokens)
        outs = session.run(None, {name: t.numpy() for name, t in zip(names, inputs)})
        errors = relative_errors([torch.from_numpy(o) for o in outs],
                                 primitive_references(*inputs))
        assert max(errors) < 1e-5, (exporter, num_tokens, errors)


class Kernels(torch.nn.Module):
    """x (B, h, N, d) against 49 landmarks (whole chunks) and 10 (a chunk tail)."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, x, y49, y10):
        return (self.form.similarity(x, y49, 2.5, 'laplacian'),
                self.form.similarity(x, y10, 0.7, 'gaussian'))


def kernel_inputs(num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple(0.5 * torch.randn(1, 2, n, 8, generator=gen) for n in (num_tokens, 49, 10))


def test_token_blocks_follow_the_byte_budget():
    # LaplacianFormer-T's stage 1 at 800×1333: 7 landmarks × 64 × 66,800 tokens × 4 B.
    assert ex.token_blocks(torch.empty(1, 1, 66800, 64), 49) == 29
    assert ex.token_blocks(torch.empty(1, 1, 1000, 64), 49) == 1
    assert ex.token_blocks(torch.empty(1, 1, 10 ** 6, 64), 49) == ex.MAX_BLOCKS
    assert ex.token_blocks(torch.empty(1, 1, 10 ** 6, 64), 16) == 16  # N ≥ m: no empty block


@pytest.mark.parametrize('exporter', ['dynamo', 'torchscript'])
def test_placeholders_expand_into_exact_token_blocks(tmp_path, monkeypatch, exporter):
    # 8 KiB blocks: 10 and 32 of them (the caps) at N = 700. The blocked file against the fp64
    # kernels, and bit for bit against the one-block form the exporters write unaided.
    monkeypatch.setattr(ex, 'BLOCK_BYTES', 1 << 13)
    names = ['x', 'y49', 'y10']
    paths = {}
    for form in ('blocks', 'plain'):
        paths[form] = path = str(tmp_path / f'{form}.onnx')
        module = Kernels(ex.ExportForm(blocks=form == 'blocks')).eval()
        with torch.no_grad():
            if exporter == 'dynamo':
                torch.onnx.export(module, kernel_inputs(700, 0), path, dynamo=True,
                                  verbose=False, input_names=names, dynamic_shapes=(
                                      {2: torch.export.Dim('n', min=49)}, None, None))
            else:
                torch.onnx.export(module, kernel_inputs(700, 0), path, dynamo=False,
                                  opset_version=18, input_names=names,
                                  dynamic_axes={'x': {2: 'n'}})
    proto = onnx.load(paths['blocks'])
    assert [n.domain for n in proto.graph.node].count(ex.PLACEHOLDER_DOMAIN) == 2
    onnx.save(deploy.expand_placeholders(proto), paths['blocks'])
    onnx.checker.check_model(proto, full_check=True)
    assert non_standard_nodes(proto) == []
    assert ex.PLACEHOLDER_DOMAIN not in {o.domain for o in proto.opset_import}
    assert sorted(len(n.output) for n in proto.graph.node if n.op_type == 'Split') == [10, 32]
    sessions = {form: deploy.ort_session(path, threads=1) for form, path in paths.items()}
    for num_tokens in (700, 49, 1531):
        inputs = kernel_inputs(num_tokens, seed=num_tokens)
        feed = {name: t.numpy() for name, t in zip(names, inputs)}
        blocked, plain = ([torch.from_numpy(o) for o in sessions[form].run(None, feed)]
                          for form in ('blocks', 'plain'))
        assert all(torch.equal(a, b) for a, b in zip(blocked, plain)), num_tokens
        x, y49, y10 = (t.double() for t in inputs)
        errors = relative_errors(blocked, [dense_kernel(x, y49, 2.5, 'laplacian'),
                                           dense_kernel(x, y10, 0.7, 'gaussian')])
        assert max(errors) < 1e-6, (num_tokens, errors)


class AttentionPair(torch.nn.Module):
    """Tied and separate keys outside the backbone, on a 10 × 13 map the grid does not divide."""

    def __init__(self):
        super().__init__()
        self.tied = LaplacianAttention(32, 2)
        self.separate = LaplacianAttention(32, 2, qk_shared=False)

    def forward(self, x):
        return self.tied(x, (10, 13)), self.separate(x, (10, 13))


@pytest.mark.parametrize('exporter', ['torchscript', 'torch.export'])
def test_standalone_attention_exports_its_reference_form(tmp_path, exporter):
    # Nothing passes these an export form: the entry asks torch whether it traces.
    torch.manual_seed(0)
    module = AttentionPair().eval()
    x = torch.randn(2, 130, 32)
    with torch.no_grad():
        if exporter == 'torch.export':
            program = torch.export.export(module, (x, ))
            assert not [n.target for n in program.graph.nodes if 'lapformer_mm' in str(n.target)]
            outs = program.module()(x)
        else:
            path = str(tmp_path / 'attention.onnx')
            torch.onnx.export(module, (x, ), path, dynamo=False, opset_version=18,
                              input_names=['x'])
            assert non_standard_nodes(onnx.load(path)) == []
            outs = deploy.run_onnx(deploy.ort_session(path), x)
    for out, attn, shared in zip(outs, (module.tied, module.separate), (True, False)):
        expected = dense_attention_module(copy.deepcopy(attn).double(), x.double(), (10, 13),
                                          shared, 7)
        assert relative_errors([out], [expected])[0] < 1e-5


def _cpu_isas():
    capability = torch.backends.cpu.get_cpu_capability()
    return {'default': True, 'avx2': capability in ('AVX2', 'AVX512'),
            'avx512': capability == 'AVX512'}


def _op_session(library, op, inputs, outputs, **attrs):
    """An ONNX Runtime session of one op library node ``op`` with the given input names."""
    from onnx import TensorProto, helper
    node = helper.make_node(op, inputs, outputs, domain=ex.ORT_DOMAIN, **attrs)
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 20),
                                                    helper.make_opsetid(ex.ORT_DOMAIN, 1)])
    path = os.path.join(tempfile.mkdtemp(), f'{op}.onnx')
    onnx.save(model, path)
    return deploy.ort_session(path, threads=2, ort_ops=library)


def _rows_session(library, lam, kind, want_stats, want_rows):
    return _op_session(library, ex.ORT_ROWS_OP, ['x', 'l', 'v'], ['rhs', 'stats', 'rows'],
                       lam=lam, kind=kind, want_stats=want_stats, want_rows=want_rows)


def _rows_case(n, m, dv, seed):
    """x (B, N, h, d) and v (B, N, h, dv) in the token layout, landmarks (B, h, m, d)."""
    gen = torch.Generator().manual_seed(seed)
    x = 0.5 * torch.randn(2, n, 3, 8, generator=gen)
    landmarks = 0.5 * torch.randn(2, 3, m, 8, generator=gen)
    return x, landmarks, torch.randn(2, n, 3, dv, generator=gen) + 2.0


def _rows_dense(x, landmarks, v, lam, kind):
    """(rhs, stats, rows) of AttentionRows in fp64 with the dense kernel."""
    c = dense_kernel(x.double().transpose(1, 2), landmarks.double(), lam, kind)
    v = v.double().transpose(1, 2)
    mean_v = v.mean(-2, keepdim=True)
    centred = c - c.mean(-1, keepdim=True)
    stats = torch.cat((centred.mean(-2, keepdim=True), centred.var(-2, False, keepdim=True),
                       c.mean(-2, keepdim=True)), -2)
    return torch.cat((c.mT @ (v - mean_v) / c.shape[-2], mean_v), -2), stats, c


# (N, m, dv, kind): row-block and chunk tails, m beyond one register tile, no v (with as
# many chunks as heads: a task that takes another's chunk leaves rows unwritten).
ROWS_CASES = [(257, 49, 24, 'laplacian'), (3, 5, 40, 'gaussian'), (600, 49, 0, 'laplacian')]


def test_ort_op_library_ops_match_dense_fp64(monkeypatch):
    library = require_ort_library()
    for isa, supported in _cpu_isas().items():
        monkeypatch.setenv('LAPFORMER_ORT_ISA', isa)
        if not supported:
            # Every instruction set this CPU lacks must refuse to register, by name.
            with pytest.raises(Exception, match='LAPFORMER_ORT_ISA'):
                _op_session(library, ex.ORT_KERNEL_OP, ['x', 'y'], ['k'], lam=4.0,
                            kind='laplacian')
            continue
        for n, m, dv, kind in ROWS_CASES:
            x, landmarks, v = _rows_case(n, m, dv, seed=n)
            feed = {'x': x.numpy(), 'l': landmarks.numpy(), 'v': v.numpy()}
            outs = _rows_session(library, 2.5, kind, 1, 1).run(None, feed)
            rhs, stats, rows = (torch.from_numpy(o) for o in outs)
            want_rhs, want_stats, want_rows = _rows_dense(x, landmarks, v, 2.5, kind)
            assert relative_errors([rows], [want_rows])[0] < 2e-6, (isa, n, m)
            assert rhs.shape == (2, 3, m + 1, dv)
            assert stats.shape == (2, 3, 3 if dv else 2, m)
            if dv:
                # R, v̄ and c̄ each against its own scale (v is offset by twice its spread).
                assert max(relative_errors(
                    [rhs[:, :, :m], rhs[:, :, m:], stats[:, :, 2:]],
                    [want_rhs[:, :, :m], want_rhs[:, :, m:], want_stats[:, :, 2:]])) < 1e-5
            # Each statistic against its own scale (the variance is ~1e-3 of the mean's).
            assert max(relative_errors([stats[:, :, :1], stats[:, :, 1:2]],
                                       [want_stats[:, :, :1], want_stats[:, :, 1:2]])) < 1e-5
            # Not wanted: empty outputs (c̄ alone with v), and the same rhs.
            outs = _rows_session(library, 2.5, kind, 0, 0).run(None, feed)
            assert outs[1].shape == (2, 3, 1 if dv else 0, m) and outs[2].shape == (2, 3, 0, m)
            assert (outs[0] == rhs.numpy()).all() and (outs[1] == stats[:, :, 2:].numpy()).all()
            gen = torch.Generator().manual_seed(n)
            a = torch.randn(2, 3, m, 40, generator=gen)
            bias = torch.randn(2, 3, 1, 40, generator=gen)
            for centre in (1, 0):
                apply = _op_session(library, ex.ORT_APPLY_OP, ['c', 'a', 'b'], ['out'],
                                    centre=centre)
                out = apply.run(None, {'c': rows.numpy(), 'a': a.numpy(), 'b': bias.numpy()})[0]
                c64 = want_rows - want_rows.mean(-1, keepdim=True) if centre else want_rows
                want = (c64 @ a.double() + bias.double()).transpose(1, 2)
                assert relative_errors([torch.from_numpy(out)], [want])[0] < 2e-6, (isa, n)


def test_ort_op_library_statistics_do_not_hinge_on_the_first_token(monkeypatch):
    # As tests/ops/cpu/test_kernels.py's: token 0 far from every other.
    library = require_ort_library()
    gen = torch.Generator().manual_seed(60)
    landmarks = 0.3 * torch.randn(1, 1, 49, 8, generator=gen)
    x = 0.3 * torch.randn(1, 1, 1, 8, generator=gen) + 1e-3 * torch.randn(1, 4096, 1, 8,
                                                                           generator=gen)
    x[:, 0] = 5.0
    v = x[..., :0]
    _, want, _ = _rows_dense(x, landmarks, v, 1.0, 'laplacian')
    for isa, supported in _cpu_isas().items():
        if not supported:
            continue
        monkeypatch.setenv('LAPFORMER_ORT_ISA', isa)
        stats = torch.from_numpy(_rows_session(library, 1.0, 'laplacian', 1, 0).run(
            None, {'x': x.numpy(), 'l': landmarks.numpy(), 'v': v.numpy()})[1])
        assert relative_errors([stats[:, :, :1]], [want[:, :, :1]])[0] < 1e-6, isa
        assert stats.shape == (1, 1, 2, 49)  # no v: no c̄
        assert ((stats[:, :, 1:] - want[:, :, 1:2]).abs() / want[:, :, 1:2]).max() < 1e-5, isa


def test_ort_op_library_sessions_keep_the_instruction_set_they_registered(monkeypatch):
    # The builds round differently: a switch of an open session's kernels shows bitwise.
    library = require_ort_library()
    others = [isa for isa, ok in _cpu_isas().items() if ok and isa != 'default']
    if not others:
        pytest.skip('this CPU has only the generic build')
    x, landmarks, _ = _rows_case(300, 49, 0, seed=5)
    feed = {'x': x[:, :, 0].numpy(), 'y': landmarks[:, 0].numpy()}

    def kernel_session(isa):
        monkeypatch.setenv('LAPFORMER_ORT_ISA', isa)
        return _op_session(library, ex.ORT_KERNEL_OP, ['x', 'y'], ['k'], lam=1.0,
                           kind='laplacian')
    generic = kernel_session('default')
    first = generic.run(None, feed)[0]
    best = kernel_session(others[-1]).run(None, feed)[0]
    assert not (first == best).all(), 'the builds agree bitwise: the check below cannot fail'
    assert (generic.run(None, feed)[0] == first).all()


def test_ort_op_library_shares_one_domain_per_build(tmp_path):
    # One domain per build however many sessions, no race between threads, released with the
    # library: the library and a stub of ONNX Runtime's side under ThreadSanitizer.
    import shutil
    import subprocess

    from lapformer_mm.cli import build_ort_ops
    require_ort_headers()
    compiler = shutil.which(os.environ.get('CXX', 'g++'))
    if compiler is None:
        pytest.skip('no C++ compiler')
    tsan = [compiler, '-fsanitize=thread', '-g']
    # A folder for the output: the library's name in it, and no staging file left.
    library = build_ort_ops.build(ORT_INCLUDE, tmp_path, cxx=' '.join(tsan))
    assert library == str(tmp_path / build_ort_ops.LIBRARY_NAME)
    assert not list(tmp_path.glob('*.partial'))
    stub = tmp_path / 'ort_api_stub'
    build = subprocess.run(tsan + ['-std=c++17', '-O1', '-pthread', '-I', ORT_INCLUDE,
                                   os.path.join(os.path.dirname(__file__), 'ort_api_stub.cpp'),
                                   '-o', str(stub), '-ldl'], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    isas = [isa for isa, ok in _cpu_isas().items() if ok]
    # Four threads at once under this CPU's build ('auto'), then each build twice.
    run = subprocess.run([str(stub), library, 'auto'] + isas + isas, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and 'ThreadSanitizer' not in run.stderr, run.stderr[-4000:]
    counts = dict(line.rsplit(' ', 1) for line in run.stdout.splitlines())
    assert int(counts['registrations']) == 4 + 1 + 2 * len(isas)
    assert int(counts['created']) == int(counts['distinct']) == len(isas), counts
    assert int(counts['released']) == len(isas) and int(counts['double released']) == 0, counts


def test_ort_op_library_names_bad_operands_and_attributes(monkeypatch):
    library = require_ort_library()
    with monkeypatch.context() as patch:  # refused by ONNX Runtime: an OSError
        patch.setenv('LAPFORMER_ORT_ISA', 'sse')
        with pytest.raises(OSError, match='LAPFORMER_ORT_ISA'):
            _op_session(library, ex.ORT_KERNEL_OP, ['x', 'y'], ['k'], lam=1.0, kind='laplacian')
    x, landmarks, v = _rows_case(20, 5, 4, seed=0)
    session = _rows_session(library, 4.0, 'laplacian', 1, 1)
    with pytest.raises(Exception, match='AttentionRows: V '):
        session.run(None, {'x': x.numpy(), 'l': landmarks.numpy(), 'v': v[:, :7].numpy()})
    with pytest.raises(Exception, match='AttentionRows: L '):
        session.run(None, {'x': x.numpy(), 'l': landmarks[..., :4].numpy(), 'v': v.numpy()})
    with pytest.raises(Exception, match='want_stats'):
        _rows_session(library, 4.0, 'laplacian', 2, 1)
    for kind in ('cosine', 'laplacian' * 5):  # any length
        with pytest.raises(Exception, match='kind'):
            _op_session(library, ex.ORT_KERNEL_OP, ['x', 'y'], ['k'], lam=4.0, kind=kind)
    # 1 / lam overflows fp32: every exact match would be 0 * -inf = NaN.
    with pytest.raises(Exception, match='lam'):
        _op_session(library, ex.ORT_KERNEL_OP, ['x', 'y'], ['k'], lam=1e-39, kind='laplacian')
    apply = _op_session(library, ex.ORT_APPLY_OP, ['c', 'a', 'b'], ['out'], centre=1)
    with pytest.raises(Exception, match='AttentionApply: A '):
        apply.run(None, {'c': np_zeros(2, 3, 20, 5), 'a': np_zeros(2, 3, 6, 4),
                         'b': np_zeros(2, 3, 1, 4)})


def np_zeros(*shape):
    return torch.zeros(shape).numpy()


@pytest.mark.parametrize('shared', [True, False])
def test_ort_form_composes_the_cpu_backends_passes(shared):
    # Outside exporters the op library's nodes compute their standard forms: no library needed.
    q = smooth_tokens(2, (14, 16), 8, 1.0, seed=3)
    k = q if shared else smooth_tokens(2, (14, 16), 8, 1.0, seed=4)
    v = smooth_tokens(2, (14, 16), 8, 1.0, seed=5) + 2.0
    landmarks = pool_landmarks(k, (14, 16), 7)
    expected = dense_attention(q, k, v, landmarks)
    opts = AttentionOptions().op_options
    args = (q.float(), None if shared else k.float(), v.float(), landmarks.float(), opts)
    got = cpu.forward(*args, ops=ex.OrtNodes)[0]
    assert got.shape == (2, 14 * 16, 1, 8)  # the token layout (B, N, h, d_v)
    assert relative_errors([got.transpose(1, 2)], [expected])[0] < 1e-5


@pytest.mark.parametrize('exporter', ['dynamo', 'torchscript'])
def test_ort_op_library_attention_through_both_exporters(tmp_path, exporter):
    library = require_ort_library()
    torch.manual_seed(0)
    module = AttentionPair().eval()
    x = torch.randn(2, 130, 32)
    path = str(tmp_path / 'attention.onnx')
    with torch.no_grad():
        torch.onnx.export(deploy.prepare_for_export(module, ex.ExportForm(ort=True)), (x, ),
                          path, dynamo=exporter == 'dynamo', opset_version=20,
                          input_names=['x'])
    proto = onnx.load(path)
    assert non_standard_nodes(proto) == sorted((ex.ORT_DOMAIN, op) for op in ex.ORT_OPS)
    # Per attention P's PairwiseKernel, one AttentionApply and an AttentionRows per pass
    # (tied keys: one; separate: the key pass and the query pass).
    counts = {op: sum(n.op_type == op for n in proto.graph.node) for op in ex.ORT_OPS}
    assert counts == {ex.ORT_KERNEL_OP: 2, ex.ORT_ROWS_OP: 3, ex.ORT_APPLY_OP: 2}
    assert deploy.uses_ort_ops(path)
    outs = deploy.ort_session(path, ort_ops=library).run(None, {'x': x.numpy()})
    for out, attn, shared in zip(outs, (module.tied, module.separate), (True, False)):
        expected = dense_attention_module(copy.deepcopy(attn).double(), x.double(), (10, 13),
                                          shared, 7)
        with torch.no_grad():
            eager = attn(x, (10, 13))
        errors = relative_errors([torch.from_numpy(out), eager], [expected, expected])
        assert errors[0] < max(2 * errors[1], 1e-6), (shared, errors)


def test_ort_op_library_exports_only_its_entry_point():
    import shutil
    import subprocess
    library = require_ort_library()
    if shutil.which('nm') is None:
        pytest.skip('no nm to list the exported symbols')
    out = subprocess.run(['nm', '-D', '--defined-only', library], capture_output=True,
                         text=True, check=True).stdout
    assert [line.split()[-1] for line in out.splitlines()] == ['RegisterCustomOps']


def test_ort_op_library_needs_headers_and_is_named_when_missing(tmp_path, monkeypatch):
    from lapformer_mm.cli import build_ort_ops
    monkeypatch.delenv('ORT_INCLUDE_DIR', raising=False)
    with pytest.raises(FileNotFoundError, match='ORT_INCLUDE_DIR'):
        build_ort_ops.build()
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        build_ort_ops.build(str(tmp_path))
    assert build_ort_ops.main(['--ort-include', str(tmp_path)]) == 2
    missing = str(tmp_path / 'none.so')
    with pytest.raises(FileNotFoundError, match='tools/build_ort_ops.py'):
        deploy.ort_ops_library(missing)
    monkeypatch.setenv(deploy.ORT_OPS_ENV, missing)
    with pytest.raises(FileNotFoundError, match='none.so'):
        deploy.ort_ops_library()


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.name()))
        return func(*args, **(kwargs or {}))


def test_eager_and_flop_count_unchanged_outside_exporters(tmp_path):
    from lapformer_mm.analysis.flops import flop_analyzer, flop_totals
    model = tiny_backbone()
    x = torch.randn(1, 3, 200, 232)
    with torch.no_grad():
        before = model(x)
    flops_before = flop_totals(flop_analyzer(model, (x, )))
    # The registered ops carry the FLOP handles: the export form would have no kernel part.
    assert flops_before['kernel'] > 0 and flops_before['solve'] > 0
    recorder = _OpRecorder()
    with torch.no_grad(), recorder:
        model(x)
    assert any(op.startswith('lapformer_mm::') for op in recorder.ops), recorder.ops
    assert 'aten::linalg_vector_norm' not in recorder.ops  # the export form's ℓ1
    deploy.export_onnx(model, str(tmp_path / 'b.onnx'), shape=(200, 232),
                       exporter='torchscript')
    with torch.no_grad():
        after = model(copy.deepcopy(x))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert flop_totals(flop_analyzer(model, (x, ))) == flops_before
