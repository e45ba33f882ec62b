"""``lapformer_mm::nystrom_attention`` (reference, CPU) against the dense fp64 attention."""
import pytest
import torch
import torch.nn.functional as F
from _attention_helpers import (
    dense_attention,
    dense_attention_grads,
    dense_injective,
    dense_l1_kernel,
    randn,
)

from lapformer_mm.ops import attention, nystrom_attention, pool_landmarks
from lapformer_mm.ops.attention import nystrom_attention_op

OPS = torch.ops.lapformer_mm
#: The op's options after the operands: the defaults, Newton–Schulz steps 16, the reference.
OPTIONS = ('laplacian', 4.0, 0.01, 16, 'identity', True, 'injective', 1e-5, 'reference')


@pytest.fixture(autouse=True)
def _reference(monkeypatch):  # the CPU backend has its dense tests in tests/ops/cpu
    monkeypatch.setenv('LAPFORMER_OPS', 'reference')


def inputs(batch, heads, hw, d, dv, grid, tied, dtype=torch.float64, seed=0):
    n = hw[0] * hw[1]
    q, k, v = randn((batch, heads, n, d), (batch, heads, n, d), (batch, heads, n, dv), seed=seed)
    k = q if tied else k
    return tuple(t.to(dtype) for t in (q, k, v, pool_landmarks(k, hw, grid)))


@pytest.mark.parametrize('kernel, lam', [('laplacian', 4.0), ('gaussian', 12.0)])
@pytest.mark.parametrize('normalize', ['injective', 'none'])
@pytest.mark.parametrize('tied', [True, False])
def test_values_and_gradients_match_dense_fp64(kernel, lam, normalize, tied):
    """Odd N (35), m = 12 < 49, d = 5 and d_v = 7 (not multiples of anything)."""
    q, k, v, landmarks = inputs(2, 3, (5, 7), 5, 7, 4, tied, seed=1)
    qa, va, la = (t.clone().requires_grad_() for t in (q, v, landmarks))
    ka = qa if tied else k.clone().requires_grad_()
    options = dict(kernel=kernel, lam=lam, normalize=normalize)
    out = nystrom_attention(qa, ka, va, la, iters=40, **options)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    expected, expected_grads = dense_attention_grads(q, k, v, landmarks, grad, tied,
                                                     **options)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)
    wrt = [qa, va, la] if tied else [qa, ka, va, la]
    for got, want in zip(torch.autograd.grad(out, wrt, grad), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-9)


def test_raw_op_layouts_and_saved_statistics_match_dense():
    """out (B, N, h, d_v), context [P⁻¹ R; v̄], X = P⁻¹ and stats (μ, s, c̄) against dense."""
    q, _, v, landmarks = inputs(2, 3, (5, 5), 3, 2, 3, True, seed=4)
    out = nystrom_attention(q, None, v, landmarks)
    assert out.transpose(1, 2).is_contiguous()
    raw = OPS.nystrom_attention(q, None, v, landmarks, *OPTIONS[:3], 40, *OPTIONS[4:])
    assert [tuple(t.shape) for t in raw] == [(2, 25, 3, 2), (2, 3, 10, 2), (2, 3, 9, 9),
                                             (2, 3, 3, 9)]
    _, context, inverse, stats = raw
    c = dense_l1_kernel(q, landmarks, 4.0)
    centred = c - c.mean(-1, keepdim=True)
    torch.testing.assert_close(stats[..., 0, :], centred.mean(-2))
    torch.testing.assert_close(stats[..., 1, :], (centred.var(-2, unbiased=False) + 1e-5).rsqrt())
    torch.testing.assert_close(stats[..., 2, :], c.mean(-2))
    p = dense_l1_kernel(landmarks, landmarks, 4.0) + 0.01 * torch.eye(9, dtype=torch.float64)
    torch.testing.assert_close(inverse, torch.linalg.inv(p), rtol=1e-8, atol=1e-8)
    mean = v.mean(-2, keepdim=True)
    torch.testing.assert_close(context[..., :9, :], torch.linalg.solve(p, c.mT @ (v - mean) / 25),
                               rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(context[..., 9:, :], mean)


@pytest.mark.parametrize('dtype, tol', [(torch.float32, 2e-5), (torch.bfloat16, 3e-2),
                                        (torch.float16, 4e-3)])
def test_16_bit_inputs_compute_in_fp32_and_return_their_dtype(dtype, tol):
    q, k, v, landmarks = inputs(1, 2, (6, 6), 8, 8, 3, False, dtype=dtype, seed=5)
    out = nystrom_attention(q, k, v, landmarks)
    # Mixed operand dtypes follow q.
    assert out.dtype == dtype == nystrom_attention(q, k, v.double(), landmarks.float()).dtype
    expected = dense_attention(q, k, v, landmarks)  # the rounded inputs, in fp64
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * scale)


def test_fp16_does_not_overflow_where_the_whitening_scale_reaches_its_bound():
    """Equal queries (s = 316), values of std 3000: statistics and context stay fp32."""
    k, v = randn((1, 1, 36, 8), (1, 1, 36, 8), seed=6)
    q, k, v = torch.zeros(1, 1, 36, 8, dtype=torch.half), (0.3 * k).half(), (3000 * v).half()
    landmarks = pool_landmarks(k, (6, 6), 3)
    _, context, _, stats = OPS.nystrom_attention(q, k, v, landmarks, *OPTIONS)
    scaled = stats[..., 1, :, None] * context[..., :-1, :]
    assert stats[0, 0, 1].min() > 316 and scaled.abs().max() > 7e4
    out = nystrom_attention(q, k, v, landmarks)
    expected = dense_attention(q, k, v, landmarks)
    torch.testing.assert_close(out.double(), expected, rtol=3e-3,
                               atol=3e-3 * expected.abs().max().item())


def test_entry_forms_give_the_dense_result():
    """Head views, other batch ranks, hw instead of landmarks, tied (k None or q) or not."""
    qkv, = randn((2, 20, 36), seed=8)
    q, k, v = (t.view(2, 20, 3, 4).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    landmarks = pool_landmarks(k, (4, 5), 2)
    expected = dense_attention(q, k, v, landmarks)
    folded = [nystrom_attention(q, k, v, landmarks, iters=40),
              torch.stack([nystrom_attention(*(t[i] for t in (q, k, v, landmarks)), iters=40)
                           for i in range(2)]),
              nystrom_attention(*(t.unsqueeze(2) for t in (q, k, v, landmarks)), iters=40)[:, :, 0]]
    for tied in (None, True, False):
        kk = None if tied is None else q if tied else k
        folded.append(nystrom_attention(q, kk, v, hw=(4, 5), landmark_grid=2, iters=40))
        maps = (q if tied is not False else k).transpose(-1, -2).reshape(6, 4, 4, 5)
        pooled = F.adaptive_avg_pool2d(maps, 2).reshape(2, 3, 4, 4).transpose(-1, -2)
        expected_hw = dense_attention(q, q if tied is not False else k, v, pooled)
        torch.testing.assert_close(folded.pop(), expected_hw, rtol=1e-9, atol=1e-10)
    for out in folded:
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)


def test_the_ops_pass_opcheck():
    """Schema and fake implementations agree with the real ops."""
    for tied in (True, False):
        q, k, v, landmarks = inputs(1, 2, (3, 4), 3, 2, 2, tied, dtype=torch.float32, seed=3)
        args = (q, None if tied else k, v, landmarks)
        torch.library.opcheck(OPS.nystrom_attention, args + OPTIONS)
        _, context, inverse, stats = OPS.nystrom_attention(*args, *OPTIONS)
        torch.library.opcheck(OPS.nystrom_attention_backward, (torch.randn(1, 12, 2, 2), *args,
                              context, inverse, stats, *OPTIONS[:3], *OPTIONS[5:]))


def test_dropout_and_other_solvers_take_the_reference_path(monkeypatch):
    """The op runs Newton–Schulz without dropout only; dropout acts on Z (design.md §2.6)."""
    calls = []
    monkeypatch.setattr(attention, 'nystrom_attention_op',
                        lambda *a: calls.append(a) or nystrom_attention_op(*a))
    q, k, v, landmarks = inputs(1, 2, (4, 4), 4, 4, 2, False, seed=11)
    for solver in ('exact', 'cg'):
        out = nystrom_attention(q, k, v, landmarks, solver=solver)
        torch.testing.assert_close(out, dense_attention(q, k, v, landmarks), rtol=1e-7,
                                   atol=1e-8)
    torch.manual_seed(0)
    dropped = nystrom_attention(q, k, v, landmarks, dropout_p=0.5)
    assert not calls
    z = dense_injective(dense_l1_kernel(q, landmarks, 4.0), 1e-5)
    torch.manual_seed(0)
    mask = F.dropout(torch.ones_like(z), 0.5)
    assert 0 < int((mask == 0).sum()) < mask.numel()
    # The dense context: dense_attention − v̄ = Z · context, Z (16 × 4) of full column rank.
    mean = v.mean(-2, keepdim=True)
    context = torch.linalg.lstsq(z, dense_attention(q, k, v, landmarks) - mean).solution
    torch.testing.assert_close(dropped, (z * mask) @ context + mean, rtol=1e-9, atol=1e-10)
    nystrom_attention(q, k, v, landmarks)
    assert len(calls) == 1
