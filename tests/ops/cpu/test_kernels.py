"""The C++ CPU kernels against dense fp64 (tests/_attention_helpers.py), skipped unbuilt."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _attention_helpers import dense_attention, dense_kernel
from _shared import OWN_FILES_ONLY, ROOT, TESTS, copy_checkout

from lapformer_mm.ops import nystrom_attention, pool_landmarks
from lapformer_mm.ops.backends import cpu as cpu_ext

KINDS = ('laplacian', 'gaussian')

needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason='CPU kernels not built')


def _randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _builds():
    """The modules built here that this CPU can run, each as its ops namespace."""
    runnable = {'AVX512': ('default', 'avx2', 'avx512'), 'AVX2': ('default', 'avx2')}.get(
        torch.backends.cpu.get_cpu_capability(), ('default',))
    found = []
    for build in runnable:
        spec = importlib.util.find_spec(f'lapformer_mm._cpu_{build}')
        if spec is not None:
            torch.ops.load_library(spec.origin)
            found.append(pytest.param(getattr(torch.ops, f'lapformer_mm_cpu_{build}'), id=build))
    return found


def _close(got, want, rtol):
    """Relative error in the 2-norm: entries near 0 (exp of large distances) weigh nothing."""
    err = (got.double() - want).norm() / want.norm().clamp_min(1e-300)
    assert err <= rtol, f'relative error {err:.2e} > {rtol:.0e}'


def _pairwise_matches_dense(ops, x, y, g, lam, kind, rtol, grad_rtol, k_layout=lambda k: k):
    """k(x, y) and its gradients against autograd of the dense fp64 kernel; returns (k, dx)."""
    xd, yd = (t.detach().double().requires_grad_() for t in (x, y))
    want = dense_kernel(xd, yd, lam, kind)
    dx_want, dy_want = torch.autograd.grad((want * g.double()).sum(), (xd, yd))
    k = ops.pairwise_forward(x, y, lam, KINDS.index(kind))
    dx, dy = ops.pairwise_backward(g, k_layout(k), x, y, lam, KINDS.index(kind), True, True)
    for got, expected, tol in ((k, want, rtol), (dx, dx_want, grad_rtol), (dy, dy_want, grad_rtol)):
        _close(got, expected.detach(), tol)
    return k, dx


# == The kernel matrix and its gradients, each build. ==

# (B, H, N, M, d): odd sizes, a single row, more columns than one register tile (64 fp32
# lanes with AVX-512), more rows than columns and the reverse (the backward swaps roles),
# and more rows than one chunk of 256 (the chunked sums).
SHAPES = [(2, 3, 37, 5, 7), (1, 1, 1, 49, 32), (1, 2, 300, 67, 33), (2, 1, 11, 300, 3),
          (1, 1, 600, 49, 1)]


@needs_ext
@pytest.mark.parametrize('ops', _builds())
@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: 'x'.join(map(str, s)))
def test_values_and_gradients_match_dense_fp64(ops, kind, shape):
    batch, heads, n, m, d = shape
    x = _randn(batch, heads, n, d, seed=1) * 0.5
    y = _randn(batch, heads, m, d, seed=2) * 0.5
    g = _randn(batch, heads, n, m, seed=3)
    _pairwise_matches_dense(ops, x, y, g, 2.5, kind, 1e-14, 1e-13)
    k32, dx32 = _pairwise_matches_dense(ops, x.float(), y.float(), g.float(), 2.5, kind, 1e-6,
                                        1e-5)
    assert k32.dtype == dx32.dtype == torch.float32


@needs_ext
@pytest.mark.parametrize('ops', _builds())
@pytest.mark.parametrize('kind', KINDS)
def test_strided_operands_read_right(ops, kind):
    """Operands as the attention hands them over: head views of a projection, transposes."""
    proj = _randn(2, 40, 3 * 12, seed=4)
    x = proj[..., :12].view(2, 40, 3, 4).transpose(1, 2)          # row stride 36
    y = _randn(2, 3, 4, 9, seed=5).transpose(-1, -2)[..., :4]     # channel stride 9
    g = _randn(2, 3, 9, 40, seed=6).transpose(-1, -2)             # (2, 3, 40, 9), column-major
    assert not (x.is_contiguous() or y.is_contiguous() or g.is_contiguous())
    _pairwise_matches_dense(ops, x, y, g, 1.5, kind, 1e-14, 1e-13,
                            k_layout=lambda k: k.mT.contiguous().mT)


@needs_ext
@pytest.mark.parametrize('ops', _builds())
def test_ties_have_gradient_zero(ops):
    """|t| has gradient 0 at t = 0: coordinates equal to a landmark's add nothing."""
    y = torch.tensor([[[[0.5, -1.0, 2.0] + [0.0] * 14]]], dtype=torch.float64)
    x = torch.cat([y[0, 0], torch.tensor([[0.5] + [0.25] * 16], dtype=torch.float64)]).view(
        1, 1, 2, 17)
    g = torch.ones(1, 1, 2, 1, dtype=torch.float64)
    k = ops.pairwise_forward(x, y, 2.0, 0)
    dx, dy = ops.pairwise_backward(g, k, x, y, 2.0, 0, True, True)
    diff = x - y
    expected_dx = -(k[..., :1] / 2.0) * torch.sign(diff)          # sign(0) = 0
    torch.testing.assert_close(dx, expected_dx, rtol=1e-14, atol=0)
    torch.testing.assert_close(dy, -expected_dx.sum(-2, keepdim=True), rtol=1e-14, atol=0)
    assert (dx[0, 0, 0] == 0).all() and dx[0, 0, 1, 0] == 0
    # The landmark system's diagonal: x = y, every difference 0.
    kll = ops.pairwise_forward(y, y, 2.0, 0)
    dxl, dyl = ops.pairwise_backward(torch.ones_like(kll), kll, y, y, 2.0, 0, True, True)
    assert (dxl == 0).all() and (dyl == 0).all()


@needs_ext
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('kind', KINDS)
def test_16_bit_inputs_accumulate_in_fp32(dtype, kind):
    x = _randn(1, 2, 300, 32, seed=7).to(dtype)
    y = _randn(1, 2, 49, 32, seed=8).to(dtype)
    g = _randn(1, 2, 300, 49, seed=9, dtype=torch.float32)
    # Against the rounded inputs' values: only the accumulation is under test.
    k, _ = _pairwise_matches_dense(cpu_ext._ops(), x, y, g, 8.0, kind, 1e-6, 1e-5)
    assert k.dtype == torch.float32


# == The fused attention. ==

def _projected(batch, heads, hw, d, dv, tied, seed, dtype=torch.float64):
    """q, k, v head views of one (B, N, ·) projection, as the module builds them."""
    n = hw[0] * hw[1]
    proj = _randn(batch, n, heads * (2 * d + dv), seed=seed, dtype=dtype) * 0.8

    def heads_of(t, width):
        return t.reshape(batch, n, heads, width).transpose(1, 2)
    q = heads_of(proj[..., :heads * d], d)
    k = q if tied else heads_of(proj[..., heads * d:2 * heads * d], d)
    v = heads_of(proj[..., 2 * heads * d:], dv)
    return q, k, v


# (B, h, hw, d, d_v, grid): a 7x7 grid (m = 49), odd everything, one row of landmarks, more
# tokens than one chunk.
ATTENTION_CASES = [(2, 3, (9, 11), 5, 7, 3), (1, 2, (23, 29), 32, 32, 7), (1, 1, (5, 3), 3, 1, 1),
                   (2, 1, (3, 17), 4, 6, 2)]


@needs_ext
@pytest.mark.parametrize('case', ATTENTION_CASES, ids=lambda c: f'{c[0]}x{c[1]}x{c[2]}')
@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'separate'])
@pytest.mark.parametrize('kernel', KINDS)
@pytest.mark.parametrize('normalize', ['injective', 'none'])
def test_attention_matches_dense_fp64(case, tied, kernel, normalize):
    batch, heads, hw, d, dv, grid = case
    q, k, v = _projected(batch, heads, hw, d, dv, tied, seed=20)
    landmarks = pool_landmarks(k, hw, grid)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, landmarks)]
    qd, kd, vd, ld = leaves
    want = dense_attention(qd, qd if tied else kd, vd, ld, kernel=kernel, normalize=normalize)
    upstream = _randn(*want.shape, seed=21)
    wants = torch.autograd.grad((want * upstream).sum(), [qd, vd, ld] + ([] if tied else [kd]))
    qc, kc, vc, lc = (t.detach().clone().requires_grad_() for t in (q, k, v, landmarks))
    got = nystrom_attention(qc, qc if tied else kc, vc, lc, kernel=kernel, normalize=normalize,
                            impl='cpu', iters=30)
    grads = torch.autograd.grad((got * upstream).sum(), [qc, vc, lc] + ([] if tied else [kc]))
    _close(got, want.detach(), 1e-12)
    for name, g, w in zip(('q', 'v', 'landmarks', 'k'), grads, wants):
        assert g.shape == w.shape, name
        _close(g, w, 1e-11)


def _rows_dense(x, y, v, lam, kind):
    """(rhs, stats) of attention_rows_forward in fp64: rhs = [C^T (v - v̄) / N; v̄], stats =
    (column mean, biased variance of the row-centred C, c̄)."""
    c = dense_kernel(x.double(), y.double(), lam, kind)
    v = v.double()
    mean_v = v.mean(-2, keepdim=True)
    centred = c - c.mean(-1, keepdim=True)
    stats = (centred.mean(-2, keepdim=True), centred.var(-2, unbiased=False, keepdim=True),
             c.mean(-2, keepdim=True))
    return torch.cat((c.mT @ (v - mean_v) / c.shape[-2], mean_v), -2), torch.cat(stats, -2)


@needs_ext
@pytest.mark.parametrize('ops', _builds())
@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('dtype, rtol', [(torch.float64, 1e-12), (torch.float32, 3e-5),
                                         (torch.bfloat16, 3e-5)])
def test_keys_pass_sums_match_dense_fp64(ops, kind, dtype, rtol):
    """R = C^T (v - v̄) / N, v̄ and c̄ with v offset by 3 times its spread (fp32: R's error
    1.1e-5 at most here); 16-bit v read as it is."""
    x = (_randn(2, 3, 600, 7, seed=50) * 0.2).to(dtype)
    y = (_randn(2, 3, 9, 7, seed=51) * 0.2).to(dtype)
    v = (_randn(2, 3, 600, 33, seed=52) + 3.0).to(dtype)
    code = KINDS.index(kind)
    rhs, stats, rows = ops.attention_rows_forward(x, y, v, 4.0, code, True, False)
    want_rhs, want_stats = _rows_dense(x, y, v, 4.0, kind)
    assert rhs.shape == (2, 3, 10, 33) and stats.shape == (2, 3, 3, 9) and rows.numel() == 0
    _close(rhs[:, :, :9], want_rhs[:, :, :9], rtol)
    small = 1e-14 if dtype == torch.float64 else 1e-6
    _close(rhs[:, :, 9:], want_rhs[:, :, 9:], small)
    for row in (0, 2):  # the variance is checked by test_whitening_statistics_...
        _close(stats[:, :, row], want_stats[:, :, row], small)
    # Without the statistics c̄ is the only row; rhs is the same bit for bit.
    lean, key_mean, _ = ops.attention_rows_forward(x, y, v, 4.0, code, False, False)
    assert torch.equal(lean, rhs) and torch.equal(key_mean, stats[:, :, 2:])


_BUILD_ATTENTION_CODE = '''
import torch
from _attention_helpers import dense_attention
from lapformer_mm.ops import nystrom_attention, pool_landmarks
from lapformer_mm.ops.backends import cpu as cpu_ext
g = torch.Generator().manual_seed(0)
proj = torch.randn(2, 11 * 13, 3 * 3 * 5, generator=g, dtype=torch.float64)
q, k, v = (proj[..., i * 15:(i + 1) * 15].view(2, 143, 3, 5).transpose(1, 2) for i in range(3))
worst = 0.0
for keys in (q, k):
    leaves = [t.detach().clone().requires_grad_() for t in (q, keys, v)]
    tied = keys is q
    lm = [pool_landmarks(leaves[1], (11, 13), 3) for _ in range(2)]
    got = nystrom_attention(leaves[0], leaves[0] if tied else leaves[1], leaves[2], lm[0],
                            impl='cpu', iters=30)
    want = dense_attention(leaves[0], leaves[0] if tied else leaves[1], leaves[2], lm[1])
    grads = [torch.autograd.grad(o.square().sum(), leaves) for o in (got, want)]
    for a, b in zip([got] + list(grads[0]), [want] + list(grads[1])):
        worst = max(worst, ((a - b).norm() / b.norm()).item())
print(cpu_ext.build(), worst)
'''


@needs_ext
@pytest.mark.parametrize('ops', _builds())
def test_every_build_runs_the_attention(ops):
    """The attention's row passes in each build, selected as torch selects its own kernels."""
    build = ops.name.rsplit('_', 1)[-1]
    result = _run_python(_BUILD_ATTENTION_CODE, {'ATEN_CPU_CAPABILITY': build})
    assert result.returncode == 0, result.stderr
    loaded, worst = result.stdout.split()
    assert loaded == build
    assert float(worst) < 1e-11


@needs_ext
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_attention_16_bit_operands_match_the_reference(dtype):
    """16-bit operands are read as they are; the result agrees with the reference's fp32 math."""
    q, k, v = _projected(1, 2, (16, 16), 32, 32, True, seed=23, dtype=torch.float32)
    q, v = q.to(dtype), v.to(dtype)
    landmarks = pool_landmarks(q, (16, 16), 7)
    leaves = [[t.detach().clone().requires_grad_() for t in (q, v, landmarks)] for _ in range(2)]
    outs = [nystrom_attention(a, a, b, c, impl=impl)
            for (a, b, c), impl in zip(leaves, ('cpu', 'reference'))]
    assert outs[0].dtype == dtype
    upstream = _randn(*outs[0].shape, seed=24).to(dtype)
    grads = [torch.autograd.grad((o * upstream).sum(), ls) for o, ls in zip(outs, leaves)]
    _close(outs[0].float(), outs[1].double(), 2e-2)
    for got, want in zip(*grads):
        assert got.dtype == dtype
        _close(got.float(), want.double(), 5e-2)


# == Thread count, fallback, build. ==

def _with_threads(threads, fn):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(saved)


@needs_ext
@pytest.mark.parametrize('kind', KINDS)
def test_results_bit_equal_with_1_and_2_threads(kind):
    """Every reduction has a fixed partition (chunks of 256 rows) and order."""
    ops = cpu_ext._ops()
    x = _randn(2, 2, 1500, 32, seed=30, dtype=torch.float32)
    y = _randn(2, 2, 49, 32, seed=31, dtype=torch.float32)
    g = _randn(2, 2, 1500, 49, seed=32, dtype=torch.float32)
    v = _randn(2, 2, 1500, 16, seed=33, dtype=torch.float32)
    gv = _randn(2, 2, 1500, 16, seed=34, dtype=torch.float32)
    small = [_randn(2, 2, *s, seed=35 + i, dtype=torch.float32)
             for i, s in enumerate([(49, 16), (1, 49), (1, 49), (50, 16)])]
    code = KINDS.index(kind)

    def run():
        k = ops.pairwise_forward(x, y, 4.0, code)
        results = [k, *ops.pairwise_backward(g, k, x, y, 4.0, code, True, True),
                   *ops.pairwise_backward(g.mT, k.mT, y, x, 4.0, code, True, True)]
        rhs, stats, rows = ops.attention_rows_forward(x, y, v, 4.0, code, True, True)
        results += [rhs, stats, rows, ops.attention_rows_apply(rows, small[0], small[1][..., :16],
                                                               True, torch.float32)]
        results += ops.attention_grad_sums(x, y, gv, 4.0, code, True)
        results += ops.attention_rows_backward(x, y, None, gv, small[0], small[1], small[2], v,
                                               small[3][..., :1, :], small[3], True, 4.0, code,
                                               True)
        return results

    one, two = _with_threads(1, run), _with_threads(2, run)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@needs_ext
@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'separate'])
def test_attention_bit_equal_with_1_and_2_threads(tied):
    """The whole op, forward and gradients (its small products are not split by the BLAS)."""
    proj = _randn(2, 1200, 3 * 64, seed=40, dtype=torch.float32).requires_grad_()

    def run():
        q, k, v = (proj[..., i * 64:(i + 1) * 64].view(2, 1200, 2, 32).transpose(1, 2)
                   for i in range(3))
        k = q if tied else k
        out = nystrom_attention(q, k, v, pool_landmarks(k, (30, 40), 7), impl='cpu')
        return [out, *torch.autograd.grad(out.square().sum(), proj)]

    for a, b in zip(_with_threads(1, run), _with_threads(2, run)):
        assert torch.equal(a, b)


def _run_python(code, env_extra, cwd=ROOT):
    # tests/ on the path for the helpers the snippets import (_attention_helpers).
    env = {**os.environ, **env_extra, 'PYTHONPATH': os.pathsep.join([str(cwd), TESTS])}
    if Path(cwd) != Path(ROOT):
        code = OWN_FILES_ONLY + code
    return subprocess.run([sys.executable, '-c', code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


_FALLBACK_CODE = '''
import warnings, torch
from lapformer_mm.ops import AttentionOptions, nystrom_attention, pool_landmarks, resolve_impl
{setup}
q = torch.randn(1, 2, 36, 8, dtype=torch.float64)
v = torch.randn(1, 2, 36, 8, dtype=torch.float64)
L = pool_landmarks(q, (6, 6), 3)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    outs = [nystrom_attention(q, q, v, L) for _ in range(3)]
    ref = nystrom_attention(q, q, v, L, impl='reference')
print('impl', resolve_impl(q, q, v, L, AttentionOptions()))
print('equal', all(torch.equal(o, ref) for o in outs))
print('warnings', len([w for w in caught if 'CPU kernels' in str(w.message)]))
for w in caught:
    print('message', w.message)
'''


# Without the builds: every lapformer_mm._cpu_* module looked for is not found.
_NO_BUILDS = ('import importlib.util\n'
              '_find = importlib.util.find_spec\n'
              'importlib.util.find_spec = lambda name, *a: (None if name.startswith('
              '"lapformer_mm._cpu_") else _find(name, *a))')


@pytest.mark.parametrize('env, setup, warned', [('0', '', 0), ('1', _NO_BUILDS, 1)],
                         ids=['disabled', 'missing'])
def test_disabled_or_missing_extension_runs_the_reference(env, setup, warned):
    """LAPFORMER_CPU_EXT=0: silently; no build: with one warning."""
    result = _run_python(_FALLBACK_CODE.format(setup=setup), {'LAPFORMER_CPU_EXT': env})
    assert result.returncode == 0, result.stderr
    assert 'impl reference' in result.stdout and 'equal True' in result.stdout
    assert f'warnings {warned}' in result.stdout, result.stdout


def test_no_compiler_completes_the_build_with_a_warning(tmp_path):
    copy_checkout(tmp_path)
    env = {**os.environ, 'CC': 'false', 'CXX': 'false'}
    build = subprocess.run([sys.executable, 'setup.py', 'build_ext', '--inplace'], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    assert 'WARNING' in build.stderr
    assert not list((tmp_path / 'lapformer_mm').glob('_cpu_*.so'))
    result = _run_python('from lapformer_mm.ops.backends import cpu; print(cpu.available())',
                         {}, cwd=tmp_path)
    assert result.stdout.strip() == 'False' and 'RuntimeWarning' in result.stderr


@pytest.mark.skipif(os.environ.get('LAPFORMER_REQUIRE_CPU_EXT') != '1',
                    reason='only where the project set up the environment (make test sets '
                           'LAPFORMER_REQUIRE_CPU_EXT=1)')
def test_the_install_step_built_the_extension():
    """`make env` builds the kernels in place: else every kernel test above would skip."""
    assert cpu_ext.available(), 'the install step did not build lapformer_mm._cpu_*'


@needs_ext
def test_every_build_calls_the_openmp_runtime():
    """Without -fopenmp the inline at::parallel_for runs on the calling thread alone."""
    for build in ('default', 'avx2', 'avx512'):
        spec = importlib.util.find_spec(f'lapformer_mm._cpu_{build}')
        if spec is not None:
            assert b'GOMP_parallel' in Path(spec.origin).read_bytes(), spec.origin


def _outlier_first_token(n, d, m, spread, seed):
    """x (1, 1, n, d) within ``spread`` of one point but token 0; landmarks y (1, 1, m, d)."""
    gen = torch.Generator().manual_seed(seed)
    y = 0.3 * torch.randn(1, 1, m, d, generator=gen)
    x = 0.3 * torch.randn(1, 1, 1, d, generator=gen) + spread * torch.randn(1, 1, n, d,
                                                                             generator=gen)
    x[:, :, 0] = 5.0
    return x, y


@needs_ext
@pytest.mark.parametrize('kind', KINDS)
def test_whitening_statistics_do_not_hinge_on_the_first_token(kind):
    """With token 0 as the shift, a token far from the rest cost the variance 1e-3 of it."""
    x, y = _outlier_first_token(4096, 8, 49, 1e-3, seed=60)
    code = KINDS.index(kind)
    _, stats, _ = cpu_ext._ops().attention_rows_forward(x, y, None, 1.0, code, True, True)
    mean, var = _rows_dense(x, y, x[..., :1], 1.0, kind)[1].unbind(-2)[:2]
    assert ((stats[:, :, 0] - mean).abs().max() / mean.abs().max()).item() < 1e-6
    assert ((stats[:, :, 1] - var).abs() / var).max().item() < 1e-5
