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
    """impl=None on CPU tensors picks the CUDA backend; its launches run in the emulation,
    on an H200's 227 KiB shared-memory limit with 8 target blocks."""
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


FORWARD = [cuda.kernel_name(s, 'float', 0) for s in cuda.FORWARD]
BACKWARD = [cuda.kernel_name(s, 'float', 0) for s in cuda.BACKWARD]


@pytest.mark.parametrize('kernel, lam', [('laplacian', 4.0), ('gaussian', 12.0)])
@pytest.mark.parametrize('normalize', ['injective', 'none'])
@pytest.mark.parametrize('tied', [True, False])
def test_fp32_matches_dense_fp64_with_gradients(launches, kernel, lam, normalize, tied):
    """N = 67 (two row tiles of 64 with a tail, three of 32), m = 12, d = 20 (a d-chunk tail),
    d_v = 24; target_blocks = 8 over 3 (batch, head) pairs gives 2 row slices."""
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
    """16-bit operands are read directly (no cast kernels); fp32 inside, output in the input
    dtype, so the error is one rounding of the output (and of each gradient)."""
    q, k, v, landmarks = make_inputs(2, 1, (7, 5), 16, 16, 4, tied, dtype, seed=4)
    out, grads, grad = run(q, k, v, landmarks, tied)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    element = cuda.ELEMENT_TYPES[dtype]
    assert [e[0] for e in launches] == [cuda.kernel_name(s, element, 0) for s in cuda.STAGES]
    assert_dense(out, grads, grad, q, k, v, landmarks, tied, tol, grad_tol)


def test_fp16_stays_finite_where_the_whitening_scale_reaches_its_bound(launches):
    """36 equal queries, keys of spread 0.3 and values of std 3000 (tests/ops/
    test_attention_op.py's case): each query column's variance is 0, the whitening scale
    exactly 1/sqrt(whiten_eps) = 316, and s · context (~8e4) would overflow fp16 (65504) if
    it were stored in the input dtype; statistics and context stay fp32."""
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
    """q, k, v as head views of one (B, N, 3C) projection and a non-contiguous output
    gradient: the kernels read them in place, nothing is copied first."""
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
    """With every grid extent capped at 1, one block must walk all (batch, head) pairs, row
    tiles and slices, as it does past 65535 pairs on a GPU."""
    monkeypatch.setattr(cuda, 'MAX_GRID_YZ', 1)
    monkeypatch.setattr(cuda, 'MAX_GRID_X', 1)
    monkeypatch.setattr(cuda_plan, 'MAX_GRID_X', 1)  # the row slices (splits)
    cuda.splits.cache_clear()
    try:
        q, k, v, landmarks = make_inputs(2, 3, (10, 13), 8, 8, 3, False, torch.float32, seed=13)
        out, grads, grad = run(q, k, v, landmarks, False)
    finally:
        cuda.splits.cache_clear()
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
    """ns_refine off, either start, other eps/lam/whiten_eps and too few iterations to
    converge: the fused path equals the dense fp64 attention with that unconverged iterate
    (from the identity start the kernel's product-form steps reach Newton's iterate)."""
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
    """Five steps from the identity start at m = 49 with ||P||_inf's largest row sum in row
    `centre` (41 landmarks far apart, 8 from `first` on in a cluster around it): the last
    row, alone in the last group of the kernel's two-level maximum, or the first row of a
    group. The norm, the product-form steps and the element loops over the 52 x 52 layout
    (each thread several entries) reach the dense fp64 attention's unconverged output."""
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
    """LaplacianFormer-T's widths and heads with one block per stage (4 attention layers:
    tied keys, then separate at stage 4; m from 49 down to 2) end to end against its fp64
    evaluation: the fused path's feature maps and input gradient are within 3x the
    reference path's own fp32 error (both amplified by the whitening). One block per
    stage, not Tiny's 1-2-3-2: every stage's attention once, at half the emulation time."""
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
    """Tokens within ``spread`` of one point (a flat image region) make P = k(L, L) + eps I
    ill-conditioned and every row of C nearly constant: the fused output as close to the
    dense fp64 attention as the reference path's, in the part the attention adds to the
    mean value v̄ (measured 0.7-1.0x; with c~ centred once, up to 1.6x the fused error),
    and the refinement step worth at least 10x at spread 0.1 (measured 19x, 29x). At 0.003
    the keys are so alike that the output is v̄ within a few fp32 roundings of it, which
    hide the step (3x, 1x)."""
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
    """nys_forward_solve runs all but the last step in product form (X <- X + X R,
    R <- R R; lap_common.cuh: ns_iterate), which alone left X 5-12x further from the fp64
    inverse than Newton's form at cond(P) 75-4901 (measured). Its X against the fp64
    inverse of P: at most 1.5x the error of Newton's form run in fp32 on the CPU
    (reference.newton_schulz), over landmark spreads from cond(P) = 100 m + 1 down to ~75
    (measured 0.8-1.2x), and exactly symmetric."""
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
    """tests/ops/test_nystrom.py's case of that name on the emulated CUDA path: every key
    nearly equally similar to every landmark, so the output reads only R's small
    landmark-to-landmark differences. nys_forward_stats sums R about the key rows' means r
    (centred in fp32, the common part in fp64) with no pass for v̄, as reference.landmark_rhs
    sums it about v̄ too. Its error relative to the attention's deviation from v̄ (the
    values are offset by 3): 6.6e-6–8.6e-6 (mean 7.8e-6; the reference path's 1.1e-5);
    with R summed without r, 2.2e-5–2.9e-5."""
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
    for name, (dtype, offset) in cuda.PARAMS_DTYPE.fields.items():
        if dtype.fields:
            layout.update({f'{name}.{sub}': offset + o for sub, (_, o) in dtype.fields.items()})
        else:
            layout[name] = offset
    layout['sizeof'] = cuda.PARAMS_DTYPE.itemsize
    return layout


def test_parameter_struct_layout_matches_the_c_struct(emu_lib):  # noqa: F811
    """The numpy dtype the host fills is nys_params byte for byte as g++ lays it out
    (offsetof / sizeof from the emulation library; NVRTC uses the same x86-64 / NVPTX
    natural alignment for these 8- and 4-byte fields)."""
    lib = emu_lib.library(cuda.VARIANT_BY_NAME['dv32_tb32'])
    assert params_layout(lib) == host_params_layout()


# (m, d_v) of Tiny's stages (49 landmarks, 32-wide heads) and of the widest tiles.
LIMIT_CASES = [((7, 9), 7, 32), ((8, 9), 8, 64)]


@pytest.mark.slow
@pytest.mark.parametrize('kib', [48, 64, 96, 100, 164, 227])
def test_each_shared_memory_limit_picks_a_variant_or_the_reference(launches, monkeypatch, kib):
    """Per device limit (Pascal 48, T4 64, V100 96, RTX 30/40 100, A100 164, H100/H200 227
    KiB): the variant the plan picks is the one that runs, every launch asks no more shared
    memory than the limit (the emulation refuses more), and values and gradients match the
    dense fp64 reference; where nothing fits, no kernel runs and the reference answers."""
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
        if isinstance(plan, cuda.Plan):
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
            if isinstance(plan, cuda.Plan) else None
    assert picked(48, 49, 32) == ('dv32_tb16', 32)
    assert picked(48, 64, 32) is None and picked(48, 64, 64) is None
    assert picked(64, 49, 32) == ('dv32_tb32', 32)
    assert picked(64, 64, 32) == ('dv32_tb32', 32)
    assert picked(64, 64, 64) == ('dv64_tb16', 32)
    for kib in (96, 100, 164, 227):
        assert picked(kib, 49, 32) == ('dv32_tb32', 32)
        assert picked(kib, 64, 64) == ('dv64_tb32', 64)
    assert all(max(cuda.row_pass_static_smem(v), cuda.context_static_smem(v)) <= cuda.DEFAULT_SMEM
               for v in cuda.VARIANTS)


@pytest.mark.slow
def test_kernels_are_free_of_data_races_under_thread_sanitizer(tmp_path):
    """tests/cuda_emu/tsan_main.cpp launches every stage on the emulation of the 16-row
    gradient variant built with -fsanitize=thread, the solves in three column passes: a
    missing __syncthreads() between a shared-memory write and another thread's read is a
    reported race."""
    if shutil.which('g++') is None:
        pytest.skip('g++ (C++20) is needed to build the CPU emulation of the CUDA kernels')
    exe = tmp_path / 'tsan_main'
    variant = cuda.VARIANT_BY_NAME['dv32_tb16']
    command = build_command(exe, variant.defines + ('-DEMU_FLOAT_ONLY', '-DEMU_THREADS'),
                            '-fsanitize=thread', '-g', str(EMU_DIR / 'tsan_main.cpp'))
    build = subprocess.run([c if c != '-O2' else '-O1' for c in command], capture_output=True,
                           text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={'TSAN_OPTIONS': 'halt_on_error=1 exitcode=66'})
    assert run.returncode == 0 and 'ThreadSanitizer' not in run.stderr, run.stderr[-4000:]
    assert 'launched, rc=0' in run.stdout
