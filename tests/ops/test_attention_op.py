"""The fused attention op ``lapformer_mm::nystrom_attention`` against the dense fp64 reference.

Every implementation keeps the contract of :mod:`lapformer_mm.ops.attention`; here the
reference implementation runs (CPU), through the public entry and the raw op: values and
gradients against autograd of ``dense_attention``, the output layout, 16-bit inputs,
autocast, strided operands, the op checks and the composite path.
"""
import pytest
import torch
import torch.nn.functional as F
from _attention_helpers import (
    dense_attention,
    dense_attention_grads,
    dense_injective,
    dense_l1_kernel,
)

from lapformer_mm.ops import AttentionOptions, nystrom_attention, pool_landmarks
from lapformer_mm.ops.attention import nystrom_attention_op

OPS = torch.ops.lapformer_mm


def inputs(batch, heads, hw, d, dv, grid, tied, dtype=torch.float64, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    n = hw[0] * hw[1]
    q = scale * torch.randn(batch, heads, n, d, generator=gen, dtype=torch.float64)
    k = q if tied else scale * torch.randn(batch, heads, n, d, generator=gen,
                                           dtype=torch.float64)
    v = torch.randn(batch, heads, n, dv, generator=gen, dtype=torch.float64)
    landmarks = pool_landmarks(k, hw, grid)
    return tuple(t.to(dtype) for t in (q, k, v, landmarks))


KERNEL_LAM = [('laplacian', 4.0), ('gaussian', 12.0)]


@pytest.mark.parametrize('kernel, lam', KERNEL_LAM)
@pytest.mark.parametrize('normalize', ['injective', 'none'])
@pytest.mark.parametrize('tied', [True, False])
def test_values_and_gradients_match_dense_fp64(kernel, lam, normalize, tied):
    """Odd N (35), m = 12 < 49, d = 5 and d_v = 7 (not multiples of anything)."""
    q, k, v, landmarks = inputs(2, 3, (5, 7), 5, 7, 4, tied, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, v, landmarks)]
    qa, va, la = leaves
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


def test_output_is_a_view_of_the_token_layout():
    q, k, v, landmarks = inputs(2, 3, (4, 4), 4, 6, 2, False)
    out = nystrom_attention(q, k, v, landmarks, AttentionOptions())
    assert out.shape == (2, 3, 16, 6)
    tokens = out.transpose(1, 2)
    assert tokens.is_contiguous() and tokens.reshape(2, 16, 18).data_ptr() == out.data_ptr()
    raw = OPS.nystrom_attention(q, None, v, landmarks, 'laplacian', 4.0, 0.01, 16, 'identity',
                                True, 'injective', 1e-5, 'reference')
    shapes = [tuple(t.shape) for t in raw]
    assert shapes == [(2, 16, 3, 6), (2, 3, 5, 6), (2, 3, 4, 4), (2, 3, 3, 4)]
    assert [t.dtype for t in raw[1:]] == [torch.float64] * 3


def test_saved_statistics_are_the_whitening_of_the_kernel_rows():
    q, _, v, landmarks = inputs(1, 2, (5, 5), 3, 2, 3, True, seed=4)
    _, context, inverse, stats = OPS.nystrom_attention(
        q, None, v, landmarks, 'laplacian', 4.0, 0.01, 40, 'identity', True, 'injective', 1e-5,
        'reference')
    c = torch.exp(-(q.unsqueeze(-2) - landmarks.unsqueeze(-3)).abs().sum(-1) / 4.0)
    centred = c - c.mean(-1, keepdim=True)
    torch.testing.assert_close(stats[..., 0, :], centred.mean(-2))
    torch.testing.assert_close(stats[..., 1, :], (centred.var(-2, unbiased=False) + 1e-5).rsqrt())
    torch.testing.assert_close(stats[..., 2, :], c.mean(-2))
    p = torch.exp(-(landmarks.unsqueeze(-2) - landmarks.unsqueeze(-3)).abs().sum(-1) / 4.0)
    p = p + 0.01 * torch.eye(9, dtype=p.dtype)
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
    assert out.dtype == dtype
    expected = dense_attention(q, k, v, landmarks)  # the rounded inputs, in fp64
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * scale)


def test_fp16_does_not_overflow_where_the_whitening_scale_reaches_its_bound():
    """36 equal queries, keys of spread 0.3 and values of std 3000: each query column's
    variance is 0, the whitening scale exactly 1/sqrt(whiten_eps) = 316, and s · context
    (~8e4) would overflow fp16 (65504) if it were kept in the input dtype; statistics and
    context stay fp32."""
    gen = torch.Generator().manual_seed(6)
    q = torch.zeros(1, 1, 36, 8, dtype=torch.half)
    k = (0.3 * torch.randn(1, 1, 36, 8, generator=gen, dtype=torch.float64)).half()
    v = (3000 * torch.randn(1, 1, 36, 8, generator=gen, dtype=torch.float64)).half()
    landmarks = pool_landmarks(k, (6, 6), 3)
    _, context, _, stats = OPS.nystrom_attention(q, k, v, landmarks, 'laplacian', 4.0, 0.01,
                                                 16, 'identity', True, 'injective', 1e-5,
                                                 'reference')
    scaled = stats[..., 1, :, None] * context[..., :-1, :]
    assert stats[0, 0, 1].min() > 316 and scaled.abs().max() > 7e4
    out = nystrom_attention(q, k, v, landmarks)
    assert torch.isfinite(out).all()
    expected = dense_attention(q, k, v, landmarks)
    torch.testing.assert_close(out.double(), expected, rtol=3e-3,
                               atol=3e-3 * expected.abs().max().item())


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_autocast_keeps_16_bit_operands_and_casts_nothing(dtype):
    """The op has no autocast rule: it receives the 16-bit tensors and returns that dtype."""
    q, k, v, landmarks = inputs(1, 2, (4, 5), 4, 4, 2, False, dtype=dtype, seed=7)
    seen = []
    with torch.autocast('cpu', dtype=dtype):
        out = nystrom_attention(q, k, v, landmarks)
        with _DtypeSpy(seen):
            nystrom_attention(q, k, v, landmarks)
    assert out.dtype == dtype
    assert seen and all(d == dtype for d in seen)


class _DtypeSpy(torch.overrides.TorchFunctionMode):
    """Records the dtypes of the tensors handed to the fused op."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.lapformer_mm.nystrom_attention.default:
            self.seen.extend(a.dtype for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


def test_strided_operands_give_the_dense_result():
    """The module hands over head views of one (B, N, 3C) projection; nothing is copied for
    the op's sake, and any stride pattern reads right."""
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(2, 20, 3 * 12, generator=gen, dtype=torch.float64)
    q, k, v = (t.view(2, 20, 3, 4).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    assert not q.is_contiguous()
    landmarks = pool_landmarks(k, (4, 5), 2)
    out = nystrom_attention(q, k, v, landmarks, iters=40)
    torch.testing.assert_close(out, dense_attention(q, k, v, landmarks), rtol=1e-9, atol=1e-10)


def test_other_batch_ranks_fold_into_the_op():
    q, k, v, landmarks = inputs(2, 3, (4, 4), 4, 5, 2, False, seed=9)
    flat = nystrom_attention(q[0], k[0], v[0], landmarks[0])
    torch.testing.assert_close(flat, nystrom_attention(q, k, v, landmarks)[0])
    nested = [t.reshape(2, 3, 1, *t.shape[-2:]) for t in (q, k, v, landmarks)]
    torch.testing.assert_close(nystrom_attention(*nested)[:, :, 0],
                               nystrom_attention(q, k, v, landmarks))


def test_the_entry_pools_the_landmarks_given_hw():
    """hw instead of landmarks: the keys average-pooled on the landmark grid (ATen's adaptive
    pooling of their (B·h, d, H, W) maps here), tied (k None or k is q) or separate; exactly
    one of the two."""
    for tied in (None, True, False):
        q, k, v, _ = inputs(2, 3, (5, 7), 4, 5, 3, tied is not False, seed=13)
        maps = k.transpose(-1, -2).reshape(6, 4, 5, 7)
        landmarks = F.adaptive_avg_pool2d(maps, 3).reshape(2, 3, 4, 9).transpose(-1, -2)
        out = nystrom_attention(q, None if tied is None else k, v, hw=(5, 7), landmark_grid=3,
                                iters=40)
        torch.testing.assert_close(out, dense_attention(q, k, v, landmarks), rtol=1e-9,
                                   atol=1e-10)
    with pytest.raises(TypeError, match='give either the landmarks'):
        nystrom_attention(q, k, v)
    with pytest.raises(TypeError, match='give either the landmarks'):
        nystrom_attention(q, k, v, landmarks, hw=(5, 7))


def test_mixed_operand_dtypes_follow_q_at_the_public_entry():
    q, k, v, landmarks = inputs(1, 2, (4, 4), 4, 4, 2, False, dtype=torch.float32)
    out = nystrom_attention(q, k, v.double(), landmarks.half())
    assert out.dtype == torch.float32


def test_the_ops_pass_opcheck():
    """Schema and fake implementations agree with the real ops (autograd is the
    NystromAttention Function's, tested above and below)."""
    for tied in (True, False):
        q, k, v, landmarks = inputs(1, 2, (3, 4), 3, 2, 2, tied, dtype=torch.float32, seed=3)
        args = (q, None if tied else k, v, landmarks, 'laplacian', 4.0, 0.01, 16, 'identity',
                True, 'injective', 1e-5, 'reference')
        torch.library.opcheck(OPS.nystrom_attention, args)
        _, context, inverse, stats = OPS.nystrom_attention(*args)
        grad = torch.randn(1, 12, 2, 2)
        torch.library.opcheck(OPS.nystrom_attention_backward,
                              (grad,) + args[:4] + (context, inverse, stats, 'laplacian', 4.0,
                                                    0.01, True, 'injective', 1e-5, 'reference'))


def test_dropout_and_other_solvers_take_the_reference_path(monkeypatch):
    """The op (Newton–Schulz, no dropout) is not called for 'exact', 'cg' or dropout; dropout
    acts on Z (design.md §2.6): the dense attention with the same mask on Z."""
    from lapformer_mm.ops import attention as nystrom
    calls = []
    monkeypatch.setattr(nystrom, 'nystrom_attention_op',
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
    system = dense_l1_kernel(landmarks, landmarks, 4.0) + 0.01 * torch.eye(landmarks.shape[-2],
                                                                        dtype=z.dtype)
    mean = v.mean(-2, keepdim=True)
    context = torch.linalg.solve(system, dense_l1_kernel(k, landmarks, 4.0).mT @ (v - mean) / 16)
    torch.testing.assert_close(dropped, (z * mask) @ context + mean, rtol=1e-9, atol=1e-10)
    nystrom_attention(q, k, v, landmarks)
    assert len(calls) == 1
