"""The fused attention kernels (ops/cuda) on the CPU through the g++ emulation
(devtools/cuda_emulation.py): values and gradients against the dense fp64 attention."""
import shutil
import subprocess
import warnings

import pytest
import torch
from _attention_helpers import (
    dense_attention,
    dense_attention_grads,
    nearly_equal_columns_cases,
)
from _emulation_fixtures import emu_lib  # noqa: F401 (a fixture)

from devtools.cuda_emulation import (
    EMU_DIR,
    build_command,
    emulated_limits,
    make_launch,
    params_layout,
    route_cpu_tensors_to_cuda_backend,
)
from lapformer_mm.ops import attention, nystrom_attention, pool_landmarks, reference
from lapformer_mm.ops.attention import nystrom_attention_op
from lapformer_mm.ops.backends import cuda, cuda_plan


def use_limits(monkeypatch, smem_optin=227 * 1024, sms=2):
    """The emulated device: its shared-memory opt-in limit, and 4 blocks per SM."""
    limits = emulated_limits(smem_optin=smem_optin, sms=sms)
    monkeypatch.setattr(cuda, 'device_limits', lambda device: limits)


@pytest.fixture
def launches(emu_lib, monkeypatch):  # noqa: F811 (the imported fixture)
    """impl=None on CPU tensors picks the CUDA backend; its launches run in the emulation."""
    record = []
    monkeypatch.setattr(cuda, 'launch', make_launch(emu_lib, record))
    route_cpu_tensors_to_cuda_backend(monkeypatch.setattr)
    return record


def make_inputs(batch, heads, hw, d, dv, grid, tied, dtype, seed, scale=1.0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    n = hw[0] * hw[1]
    width = 3 * heads * max(d, dv)
    if strided:
        # Head views of one projection, as LaplacianAttention hands them over.
        qkv = torch.randn(batch, n, width, generator=gen, dtype=torch.float64)
        parts = qkv.split(heads * max(d, dv), dim=-1)
        q, k, v = (p.view(batch, n, heads, -1).transpose(1, 2) for p in parts)
        q, k, v = q[..., :d], k[..., :d], v[..., :dv]
    else:
        q, k = (torch.randn(batch, heads, n, d, generator=gen, dtype=torch.float64)
                for _ in range(2))
        v = torch.randn(batch, heads, n, dv, generator=gen, dtype=torch.float64)
    q, k = scale * q, scale * k
    if tied:
        k = q
    landmarks = pool_landmarks(k, hw, grid)
    return tuple(t.to(dtype) for t in (q, k, v, landmarks))


def run(q, k, v, landmarks, tied, grad_seed=1, **options):
    """Output and gradients of the attention (fused path) for a fixed random output grad."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, v, landmarks)]
    qa, va, la = leaves
    ka = qa if tied else k.detach().clone().requires_grad_()
    out = nystrom_attention(qa, ka, va, la, **options)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed),
                       dtype=torch.float64).to(out.dtype)
    wrt = [qa, va, la] if tied else [qa, ka, va, la]
    return out, torch.autograd.grad(out, wrt, grad), grad


def assert_close_scaled(got, expected, tol):
    """|got - expected| <= tol · max|expected| + tol · |expected|, per tensor."""
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * scale)


def assert_dense(out, grads, grad, q, k, v, landmarks, tied, tol=2e-5, grad_tol=2e-4,
                 **options):
    """Output and gradients against the dense fp64 attention's, within tol and grad_tol."""
    expected, expected_grads = dense_attention_grads(q, k, v, landmarks, grad, tied, **options)
    assert_close_scaled(out, expected, tol)
    assert len(grads) == len(expected_grads)
    for got, want in zip(grads, expected_grads):
        assert_close_scaled(got, want, grad_tol)


FORWARD = [cuda_plan.kernel_name(s, 'float', 0) for s in cuda_plan.FORWARD]
BACKWARD = [cuda_plan.kernel_name(s, 'float', 0) for s in cuda_plan.BACKWARD]


@pytest.mark.parametrize('kernel, lam', [('laplacian', 4.0), ('gaussian', 12.0)])
@pytest.mark.parametrize('normalize', ['injective', 'none'])
@pytest.mark.parametrize('tied', [True, False])
def test_fp32_matches_dense_fp64_with_gradients(launches, kernel, lam, normalize, tied):
    """Row-tile and d-chunk tails; 8 target blocks over 3 (batch, head) pairs: 2 row slices."""
    q, k, v, landmarks = make_inputs(1, 3, (67, 1), 20, 24, 12, tied, torch.float32, seed=3)
    options = dict(kernel=kernel, lam=lam, normalize=normalize)
    out, grads, grad = run(q, k, v, landmarks, tied, iters=30, **options)
    names = [entry[0].replace(', 1>', ', 0>') for entry in launches]
    assert names == FORWARD + BACKWARD
    assert launches[0][1] == (2, 3)  # (row slices, batch·heads)
    assert_dense(out, grads, grad, q, k, v, landmarks, tied, **options)


@pytest.mark.parametrize('dtype, tol, grad_tol', [(torch.bfloat16, 2e-2, 5e-2),
                                                  (torch.float16, 3e-3, 1e-2)])
@pytest.mark.parametrize('tied', [True, False])
def test_16_bit_inputs_match_dense_fp64(launches, dtype, tol, grad_tol, tied):
    """16-bit operands read directly (no cast kernels), output in the input dtype."""
    q, k, v, landmarks = make_inputs(2, 1, (7, 5), 16, 16, 4, tied, dtype, seed=4)
    out, grads, grad = run(q, k, v, landmarks, tied)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    element = cuda_plan.ELEMENT_TYPES[dtype]
    assert [e[0] for e in launches] == [cuda_plan.kernel_name(s, element, 0) for s in cuda.STAGES]
    assert_dense(out, grads, grad, q, k, v, landmarks, tied, tol, grad_tol)


def test_fp16_stays_finite_where_the_whitening_scale_reaches_its_bound(launches):
    """Equal queries (s = 316), values of std 3000: statistics and context stay fp32."""
    gen = torch.Generator().manual_seed(6)
    q = torch.zeros(1, 1, 36, 8, dtype=torch.float16)
    k = (0.3 * torch.randn(1, 1, 36, 8, generator=gen, dtype=torch.float64)).half()
    v = (3000 * torch.randn(1, 1, 36, 8, generator=gen, dtype=torch.float64)).half()
    landmarks = pool_landmarks(k, (6, 6), 3)
    raw = torch.ops.lapformer_mm.nystrom_attention(
        q, k, v, landmarks, 'laplacian', 4.0, 0.01, 16, 'identity', True, 'injective', 1e-5,
        'cupy')
    assert [tuple(t.shape) for t in raw[1:]] == [(1, 1, 10, 8), (1, 1, 9, 9), (1, 1, 3, 9)]
    scaled = raw[3][..., 1, :, None] * raw[1][..., :-1, :]
    assert raw[3][0, 0, 1].min() > 316 and scaled.abs().max() > 7e4
    leaves = [t.clone().requires_grad_() for t in (q, k, v, landmarks)]
    out = nystrom_attention(*leaves)
    # dq reaches ~2e5 for an output gradient of std 1: fp16 holds it at std 0.01.
    grad = 0.01 * torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                              dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, grad.half())
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert_dense(out, grads, grad.half(), q, k, v, landmarks, False, 3e-3, 1e-2)


def test_strided_operands_and_gradient(launches):
    """Head views of one projection and a non-contiguous output gradient, read in place."""
    q, k, v, landmarks = make_inputs(2, 2, (5, 7), 12, 12, 3, False, torch.float32, seed=7,
                                     strided=True)
    assert not q.is_contiguous() and not v.is_contiguous()
    qa, ka, va, la = (t.clone().requires_grad_() for t in (q, k, v, landmarks))
    qa, ka, va = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (qa, ka, va))
    out = nystrom_attention(qa, ka, va, la)
    grad = torch.randn(2, 35, 2, 12, generator=torch.Generator().manual_seed(9)).transpose(1, 2)
    assert not grad.is_contiguous()
    got = torch.autograd.grad(out, (qa, ka, va, la), grad)
    assert_dense(out, got, grad.double(), q, k, v, landmarks, False)


@pytest.mark.slow
def test_largest_and_smallest_landmark_and_value_counts(launches):
    """m = 64 and d_v = 64 fill every tile column; m = 1 and N = 1 leave most of it padding."""
    for hw, grid, d, dv, seed in (((8, 9), 8, 17, 64, 10), ((1, 1), 1, 3, 1, 11),
                                  ((1, 9), 1, 5, 2, 12)):
        q, k, v, landmarks = make_inputs(1, 1, hw, d, dv, grid, False, torch.float32, seed=seed)
        out, grads, grad = run(q, k, v, landmarks, False)
        assert_dense(out, grads, grad, q, k, v, landmarks, False)


def test_blocks_loop_over_heads_and_tiles_beyond_the_grid_limits(launches, monkeypatch):
    """Every grid extent capped at 1: one block walks all (batch, head) pairs and row tiles."""
    monkeypatch.setattr(cuda, 'MAX_GRID_YZ', 1)
    monkeypatch.setattr(cuda, 'MAX_GRID_X', 1)
    monkeypatch.setattr(cuda_plan, 'MAX_GRID_X', 1)  # the row slices (splits)
    cuda_plan.splits.cache_clear()
    try:
        q, k, v, landmarks = make_inputs(2, 3, (10, 13), 8, 8, 3, False, torch.float32, seed=13)
        out, grads, grad = run(q, k, v, landmarks, False)
    finally:
        cuda_plan.splits.cache_clear()
    assert all(entry[1] in ((1, 1), (1,)) for entry in launches), launches
    assert_dense(out, grads, grad, q, k, v, landmarks, False)


def test_reruns_are_bit_equal_and_slices_only_reorder_sums(launches, monkeypatch):
    q, k, v, landmarks = make_inputs(1, 1, (13, 11), 8, 8, 3, False, torch.float32, seed=14)
    first = run(q, k, v, landmarks, False)
    again = run(q, k, v, landmarks, False)
    for a, b in zip((first[0],) + first[1], (again[0],) + again[1]):
        assert torch.equal(a, b)
    monkeypatch.setattr(cuda, 'target_blocks', lambda device: 1)
    single = run(q, k, v, landmarks, False)
    grids = {entry[0].split('<')[0]: entry[1] for entry in launches[-len(cuda.STAGES):]}
    assert grids['nys_forward_stats'] == grids['nys_backward_grads'] == (1, 1)  # one slice
    for a, b in zip((first[0],) + first[1], (single[0],) + single[1]):
        assert_close_scaled(a, b.double(), 1e-5)


@pytest.mark.parametrize('ns_init, iters', [('authors', 6), ('identity', 5)])
def test_options_reach_the_kernels(launches, ns_init, iters):
    """Each option against the dense fp64 attention with the same unconverged iterate."""
    q, k, v, landmarks = make_inputs(1, 2, (6, 7), 8, 8, 3, False, torch.float32, seed=15)
    options = dict(ns_refine=False, ns_init=ns_init, iters=iters, eps=0.05, lam=3.0,
                   whiten_eps=1e-3)
    out, grads, grad = run(q, k, v, landmarks, False, **options)
    expected = dense_attention(q, k, v, landmarks, **options)
    converged = dense_attention(q, k, v, landmarks, **dict(options, iters=None))
    assert (expected - converged).abs().max() > 1e-3 * converged.abs().max()
    assert_dense(out, grads, grad, q, k, v, landmarks, False, **options)


@pytest.mark.parametrize('centre, first', [(48, 41), (40, 40)])
def test_unconverged_iterate_at_49_landmarks_is_newtons(launches, centre, first):
    """Five steps at m = 49 with ||P||_inf's largest row sum in row `centre` (the last row, or
    a group's first in the kernel's two-level maximum): the dense fp64 unconverged output."""
    gen = torch.Generator().manual_seed(3)
    landmarks = 3.0 * torch.randn(1, 2, 49, 8, generator=gen)
    point = torch.randn(8, generator=gen)
    landmarks[..., first:first + 8, :] = point + 0.05 * torch.randn(1, 2, 8, 8, generator=gen)
    landmarks[..., centre, :] = point
    system = reference.landmark_system(landmarks.double(), 4.0, 0.01, 'laplacian')
    assert (system.sum(-1).argmax(-1) == centre).all()
    q, k, v = (torch.randn(1, 2, 64, 8, generator=gen) for _ in range(3))
    out = nystrom_attention(q, k, v, landmarks, ns_refine=False, iters=5)
    assert [e[0] for e in launches] == FORWARD
    expected = dense_attention(q, k, v, landmarks, ns_refine=False, iters=5)
    converged = dense_attention(q, k, v, landmarks)
    assert (expected - converged).abs().max() > 1e-3 * converged.abs().max()
    assert_close_scaled(out, expected, 2e-5)


@pytest.mark.slow
def test_backbone_on_the_emulated_cuda_path_is_as_exact_as_the_reference_math(launches):
    """LaplacianFormer-T's widths, one block per stage, against its fp64 evaluation: maps and
    input gradient within 3x the reference path's own fp32 error."""
    pytest.importorskip('mmengine')
    import copy

    from lapformer_mm.models.backbone import ARCH_SETTINGS, LaplacianFormer
    torch.manual_seed(0)
    arch = dict(ARCH_SETTINGS['tiny'], depths=[1, 1, 1, 1])
    fused = LaplacianFormer(arch=arch, drop_path_rate=0.0).eval()
    reference = LaplacianFormer(arch=arch, drop_path_rate=0.0,
                                attn_cfg=dict(impl='reference')).eval()
    reference.load_state_dict(fused.state_dict())
    exact = copy.deepcopy(reference).double()
    x = torch.randn(1, 3, 40, 56, generator=torch.Generator().manual_seed(1))

    def run(model, inputs):
        xg = inputs.clone().requires_grad_()
        outs = model(xg)
        grad, = torch.autograd.grad(sum(o.square().mean() for o in outs), xg)
        return [o.double() for o in outs] + [grad.double()]

    truth = run(exact, x.double())
    launches.clear()
    got, ref = run(fused, x), run(reference, x)
    assert {entry[0].split('<')[0] for entry in launches} == set(cuda.STAGES)
    for g, r, t in zip(got, ref, truth):
        scale = t.abs().max()
        error = ((g - t).abs().max() / scale).item()
        ref_error = ((r - t).abs().max() / scale).item()
        assert error <= max(3 * ref_error, 1e-5), (error, ref_error)


@pytest.mark.parametrize('kernel', ['laplacian', 'gaussian'])
@pytest.mark.parametrize('spread', [0.1, 0.003])
def test_refinement_step_holds_near_identical_landmarks(launches, kernel, spread):
    """Tokens within ``spread`` of one point: the fused output's deviation from v̄ as close to
    fp64 as the reference path's (measured 0.7-1.0x), the refinement step worth >= 10x at
    spread 0.1 (measured 19x, 29x); at 0.003 fp32 rounding of v̄ hides the step."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 8, generator=gen) + spread * torch.randn(1, 2, 49, 8, generator=gen)
    v = torch.randn(1, 2, 49, 8, generator=gen)
    landmarks = pool_landmarks(q, (7, 7), 7)
    expected = dense_attention(q, q, v, landmarks, kernel=kernel)
    deviation = (expected - v.double().mean(-2, keepdim=True)).abs().max()

    def error(**options):
        out = nystrom_attention(q, q, v, landmarks, kernel=kernel, **options)
        return ((out.double() - expected).abs().max() / deviation).item()

    fused, unrefined = error(), error(ns_refine=False)
    assert [e[0].split('<')[0] for e in launches[:4]] == [n.split('<')[0] for n in FORWARD]
    reference_error = error(impl='reference')
    assert fused <= 2 * reference_error + 1e-7, (fused, reference_error)
    if spread == 0.1:
        assert unrefined > 10 * fused, (unrefined, fused)
    # The gradients (the backward's passes centre the rows twice too).
    launches.clear()
    _, grads, grad = run(q, q, v, landmarks, True, kernel=kernel)
    assert [e[0].split('<')[0] for e in launches] == [n.split('<')[0] for n in FORWARD + BACKWARD]
    _, reference_grads, _ = run(q, q, v, landmarks, True, kernel=kernel, impl='reference')
    _, expected_grads = dense_attention_grads(q, q, v, landmarks, grad, True, kernel=kernel)
    for name, got, ref, want in zip('q v landmarks'.split(), grads, reference_grads,
                                    expected_grads):
        scale = want.abs().max().item()
        got_error = (got.double() - want).abs().max().item() / scale
        ref_error = (ref.double() - want).abs().max().item() / scale
        assert got_error <= 2 * ref_error + 1e-7, (name, got_error, ref_error)


@pytest.mark.parametrize('m', [49, 64])
def test_inverse_is_as_accurate_as_newtons_form(launches, m):
    """nys_forward_solve's X (product-form steps, then Newton's) against the fp64 inverse of P:
    at most 1.5x the error of reference.newton_schulz in fp32 (measured 0.8-1.2x; product
    form alone 5-12x), and exactly symmetric."""
    gen = torch.Generator().manual_seed(0)
    for spread in (0.0, 0.003, 0.01, 0.03, 0.1):
        centre = torch.randn(1, 1, 1, 32, generator=gen, dtype=torch.float64)
        landmarks = (centre + spread * torch.randn(1, 2, m, 32, generator=gen,
                                                   dtype=torch.float64)).float()
        q, v = (torch.randn(1, 2, 64, 32, generator=gen) for _ in range(2))
        launches.clear()
        _, _, inverse, _ = nystrom_attention_op(q, None, v, landmarks, 'laplacian', 4.0, 0.01,
                                                16, 'identity', True, 'injective', 1e-5, 'cupy')
        assert [e[0] for e in launches] == FORWARD
        system = reference.landmark_system(landmarks.double(), 4.0, 0.01, 'laplacian')
        truth = torch.linalg.inv(system)
        newton = reference.newton_schulz(system.float(), 16, 'identity')

        def error(x):
            return (torch.linalg.matrix_norm(x.double() - truth, 2)
                    / torch.linalg.matrix_norm(truth, 2)).mean().item()

        assert torch.equal(inverse, inverse.mT)
        assert error(inverse) <= 1.5 * error(newton), (spread, error(inverse), error(newton))


@pytest.mark.slow(seconds=40)
def test_fp32_attention_of_nearly_equal_kernel_columns_stays_near_fp64(launches):
    """tests/ops/test_nystrom.py's case on the emulated CUDA path: the error relative to the
    deviation from v̄ measured 6.6e-6–8.6e-6 (R summed without the rows' means: 2.2e-5)."""
    errors = []
    for q, v, landmarks, expected in nearly_equal_columns_cases():
        launches.clear()
        out = nystrom_attention(q.float(), q.float(), v.float(), landmarks.float())
        assert [e[0] for e in launches] == FORWARD
        deviation = (expected - v.mean(-2, keepdim=True)).abs().max()
        errors.append(float((out.double() - expected).abs().max() / deviation))
    assert sum(errors) / len(errors) < 1.2e-5, errors


def host_params_layout():
    """{field: byte offset} of the host's PARAMS_DTYPE, operands as 'q.ptr' ..., plus 'sizeof'."""
    layout = {}
    for name, (dtype, offset) in cuda_plan.PARAMS_DTYPE.fields.items():
        if dtype.fields:
            layout.update({f'{name}.{sub}': offset + o for sub, (_, o) in dtype.fields.items()})
        else:
            layout[name] = offset
    layout['sizeof'] = cuda_plan.PARAMS_DTYPE.itemsize
    return layout


def test_parameter_struct_layout_matches_the_c_struct(emu_lib):  # noqa: F811
    """The numpy dtype the host fills is nys_params as g++ lays it out (offsetof / sizeof)."""
    lib = emu_lib.library(cuda_plan.VARIANT_BY_NAME['dv32_tb32'])
    assert params_layout(lib) == host_params_layout()


# (m, d_v) of Tiny's stages (49 landmarks, 32-wide heads) and of the widest tiles.
LIMIT_CASES = [((7, 9), 7, 32), ((8, 9), 8, 64)]


@pytest.mark.slow
@pytest.mark.parametrize('kib', [48, 64, 96, 100, 164, 227])
def test_each_shared_memory_limit_picks_a_variant_or_the_reference(launches, monkeypatch, kib):
    """Per device limit: the planned variant within the limit, or the reference; dense fp64."""
    use_limits(monkeypatch, smem_optin=kib * 1024)
    attention._warn_fallback.cache_clear()
    for (hw, grid, dv) in LIMIT_CASES:
        launches.clear()
        q, k, v, landmarks = make_inputs(1, 1, hw, 12, dv, grid, False, torch.float32, seed=20)
        m = grid * grid
        plan = cuda.plan(m, dv, kib * 1024)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            out, grads, grad = run(q, k, v, landmarks, False)
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if isinstance(plan, cuda_plan.Plan):
            assert [e[0] for e in launches] == FORWARD + BACKWARD
            assert {e[4] for e in launches} == {plan.variant.name}
            assert max(e[3] for e in launches) <= kib * 1024
            assert not fallbacks
        else:
            assert not launches and plan
            assert len(fallbacks) == 1 and f'the device allows {kib * 1024:,}' in fallbacks[0]
        assert_dense(out, grads, grad, q, k, v, landmarks, False)


def test_the_variants_the_support_table_states():
    """docs/cuda.md's support table, from the plans: what each limit runs at Tiny's
    (m = 49, d_v = 32) and at (64, 64), and that 64 KiB (T4, RTX 20xx) runs both fused."""
    def picked(kib, m, dv):
        plan = cuda.plan(m, dv, kib * 1024)
        return (plan.variant.name, plan.backward_solve_cols) \
            if isinstance(plan, cuda_plan.Plan) else None
    assert picked(48, 49, 32) == ('dv32_tb16', 32)
    assert picked(48, 64, 32) is None and picked(48, 64, 64) is None
    assert picked(64, 49, 32) == ('dv32_tb32', 32)
    assert picked(64, 64, 32) == ('dv32_tb32', 32)
    assert picked(64, 64, 64) == ('dv64_tb16', 32)
    for kib in (96, 100, 164, 227):
        assert picked(kib, 49, 32) == ('dv32_tb32', 32)
        assert picked(kib, 64, 64) == ('dv64_tb32', 64)
    assert all(max(cuda_plan.row_pass_static_smem(v), cuda_plan.context_static_smem(v))
               <= cuda_plan.DEFAULT_SMEM for v in cuda_plan.VARIANTS)


@pytest.mark.slow
def test_kernels_are_free_of_data_races_under_thread_sanitizer(tmp_path):
    """tests/cuda_emu/tsan_main.cpp: every stage under -fsanitize=thread, no race reported."""
    if shutil.which('g++') is None:
        pytest.skip('g++ (C++20) is needed to build the CPU emulation of the CUDA kernels')
    exe = tmp_path / 'tsan_main'
    variant = cuda_plan.VARIANT_BY_NAME['dv32_tb16']
    command = build_command(exe, variant.defines + ('-DEMU_FLOAT_ONLY', '-DEMU_THREADS'),
                            '-fsanitize=thread', '-g', str(EMU_DIR / 'tsan_main.cpp'))
    build = subprocess.run([c if c != '-O2' else '-O1' for c in command], capture_output=True,
                           text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={'TSAN_OPTIONS': 'halt_on_error=1 exitcode=66'})
    assert run.returncode == 0 and 'ThreadSanitizer' not in run.stderr, run.stderr[-4000:]
    assert 'launched, rc=0' in run.stdout
