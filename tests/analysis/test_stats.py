"""lapformer_mm.analysis statistics against independent numpy/scipy computations."""
import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from lapformer_mm.analysis import attention_maps, images, tail_stats
from lapformer_mm.analysis.qk_capture import QKRecord


@pytest.fixture
def heavy_tailed():
    rng = np.random.default_rng(0)
    return np.concatenate([rng.standard_normal(5000), rng.standard_t(2, 500) * 5])


def test_excess_kurtosis_and_outlier_share_match_scipy(heavy_tailed):
    expected = scipy_stats.kurtosis(heavy_tailed, fisher=True, bias=True)
    assert tail_stats.excess_kurtosis(heavy_tailed) == pytest.approx(expected, rel=1e-10)
    assert abs(tail_stats.excess_kurtosis(np.random.default_rng(1).standard_normal(200_000))) \
        < 0.05
    fence = np.percentile(heavy_tailed, 75) + 1.5 * scipy_stats.iqr(heavy_tailed)
    expected = np.count_nonzero(heavy_tailed > fence) / heavy_tailed.size
    assert tail_stats.upper_outlier_share(heavy_tailed) == pytest.approx(expected)
    # Q1 = 2.25, Q3 = 6.75, fence = 13.5 (linear quantiles of 0..9 with 100 swapped in).
    values = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 100], dtype=float)
    assert tail_stats.upper_outlier_share(values) == pytest.approx(0.1)


def test_tail_statistics_quantiles_and_moments(heavy_tailed):
    heavy_tailed = np.abs(heavy_tailed)  # distances are non-negative
    result = tail_stats.tail_statistics(heavy_tailed)
    for q in tail_stats.QUANTILES:
        assert result[f'q{100 * q:g}'] == pytest.approx(np.percentile(heavy_tailed, 100 * q))
    assert result['n'] == heavy_tailed.size
    assert result['mean'] == pytest.approx(heavy_tailed.mean())
    assert result['std'] == pytest.approx(heavy_tailed.std())
    assert result['q99_over_q50'] == pytest.approx(
        np.percentile(heavy_tailed, 99) / np.median(heavy_tailed))
    with pytest.raises(ValueError, match='values'):  # 2-D: quantiles of the flattened sample
        tail_stats.tail_statistics(np.ones((3, 3)))


def _brute_force_distances(q, k):
    """(B, h, N, M) ℓ1 and squared ℓ2 by explicit differences."""
    diff = q.numpy()[:, :, :, None, :] - k.numpy()[:, :, None, :, :]
    return np.abs(diff).sum(-1), (diff ** 2).sum(-1)


@pytest.mark.parametrize('masked', [False, True])
def test_pair_distances_of_the_allowed_pairs_match_brute_force(masked):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 4, generator=gen), torch.randn(2, 3, 6, 4, generator=gen)
    mask = torch.rand(2, 1, 5, 6, generator=gen) > 0.5 if masked else None
    l1, sq = tail_stats.pair_distances(q, k, mask)
    ref_l1, ref_sq = _brute_force_distances(q, k)
    keep = np.broadcast_to(mask.numpy() if masked else True, ref_l1.shape)
    np.testing.assert_allclose(l1, ref_l1[keep], rtol=1e-6)
    np.testing.assert_allclose(sq, ref_sq[keep], rtol=1e-5)


def test_pair_distances_sampling_limits_and_subset():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, 1, 40, 3, generator=gen), torch.randn(5, 1, 30, 3, generator=gen)
    l1, _ = tail_stats.pair_distances(q, k, max_queries=7, max_keys=6, max_batches=2,
                                      generator=gen)
    assert l1.shape == (2 * 7 * 6,)
    ref_l1, _ = _brute_force_distances(q, k)
    nearest = np.abs(l1[:, None] - ref_l1.ravel()[None]).min(1)
    assert nearest.max() < 1e-4


def test_distance_collector_pools_per_stage_and_caps():
    collector = tail_stats.DistanceCollector(max_samples=50)
    gen = torch.Generator().manual_seed(3)
    for stage in (0, 0, 2):
        collector.add(QKRecord(stage, 'x', torch.randn(1, 1, 6, 2, generator=gen),
                               torch.randn(1, 1, 6, 2, generator=gen)))
    assert collector.stages() == [0, 2]
    assert collector.values(0, 'l1').shape == (50,)
    assert collector.values(2, 'sq_l2').shape == (36,)


class _Attn:
    """The attributes of LaplacianAttention that attention_maps reads."""

    def __init__(self, landmark_grid, eps, solver, newton_iters=None):
        from lapformer_mm.ops import AttentionOptions
        self.landmark_grid = landmark_grid
        self.options = AttentionOptions(eps=eps, solver=solver, iters=newton_iters)


@pytest.fixture
def qk_grid():
    gen = torch.Generator().manual_seed(4)
    hw = (4, 5)
    q = torch.randn(2, 20, 6, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 20, 6, generator=gen, dtype=torch.float64)
    return q, k, hw


def test_attention_rows_match_direct_numpy(qk_grid):
    q, k, hw = qk_grid
    index = attention_maps.query_index(hw, (0.5, 0.5))
    assert index == 2 * 5 + 2
    rows = attention_maps.attention_rows(q, k, hw, index, _Attn(7, 0.01, 'exact'))
    qn, kn, lam = q.numpy(), k.numpy(), 4.0
    diff = qn[:, :, None] - kn[:, None]
    lap = np.exp(-np.abs(diff).sum(-1) / lam)
    gau = np.exp(-(diff ** 2).sum(-1) / lam)
    logits = np.einsum('hd,hnd->hn', qn[:, index], kn) / np.sqrt(6)
    soft = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(rows['laplacian'],
                               lap[:, index] / lap[:, index].sum(-1, keepdims=True))
    np.testing.assert_allclose(rows['gaussian'],
                               gau[:, index] / gau[:, index].sum(-1, keepdims=True))
    np.testing.assert_allclose(rows['softmax'], soft / soft.sum(-1, keepdims=True))
    for name, kernel in (('laplacian_injective', lap), ('gaussian_injective', gau)):
        centred = kernel - kernel.mean(-1, keepdims=True)
        z = centred / np.sqrt(centred.var(-2, keepdims=True) + 1e-5) + 1 / 20
        np.testing.assert_allclose(rows[name], z[:, index], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize('solver,iters', [('exact', None), ('newton', 30)])
def test_nystrom_row_times_v_is_the_layer_output(qk_grid, solver, iters):
    from lapformer_mm.ops import nystrom_attention, pool_landmarks
    q, k, hw = qk_grid
    v = torch.randn(2, 20, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    attn = _Attn(2, 0.01, solver, iters)
    index = 7
    row = attention_maps.nystrom_row(q, k, hw, index, attn)
    landmarks = pool_landmarks(k[None], hw, 2)
    out = nystrom_attention(q[None], k[None], v[None], landmarks, lam=4.0, eps=0.01,
                            solver=solver, iters=iters, impl='reference')[0]
    np.testing.assert_allclose(torch.einsum('hn,hnd->hd', row, v), out[:, index],
                               rtol=1e-7, atol=1e-9)


def test_nystrom_row_with_all_keys_as_landmarks_is_dense_injective_row(qk_grid):
    q, k, hw = qk_grid
    # Landmarks = every key (grid >= H, W), no ridge, exact inverse: the dense limit, the
    # injective row averaged over the keys' deviations from their mean value.
    rows = attention_maps.attention_rows(q, k, hw, 3, _Attn(8, 0.0, 'exact'))
    z = rows['laplacian_injective']
    np.testing.assert_allclose(rows['laplacian_nystrom'],
                               (z - z.mean(-1, keepdims=True) + 1) / z.shape[-1],
                               rtol=1e-6, atol=1e-8)


def test_kernel_gradient_curves_match_analytic():
    lam = 4.0
    r = np.linspace(0.01, 10, 50)
    curves = attention_maps.kernel_gradient_curves(r, lam)
    lap_values, lap_grads = curves['laplacian']
    gau_values, gau_grads = curves['gaussian']
    np.testing.assert_allclose(lap_values, np.exp(-r / lam))
    np.testing.assert_allclose(lap_grads, -np.exp(-r / lam) / lam)
    np.testing.assert_allclose(gau_values, np.exp(-r ** 2 / lam))
    np.testing.assert_allclose(gau_grads, -2 * r / lam * np.exp(-r ** 2 / lam), atol=1e-15)
    # The paper's argument: near 0 the Laplacian slope tends to 1/λ, the Gaussian one to 0.
    near_zero = attention_maps.kernel_gradient_curves([1e-6], lam)
    assert abs(near_zero['laplacian'][1][0]) == pytest.approx(1 / lam, rel=1e-5)
    assert abs(near_zero['gaussian'][1][0]) < 1e-6
    with pytest.raises(ValueError, match='distances'):  # |t| has no derivative at 0
        attention_maps.kernel_gradient_curves([0.0, 1.0], 4.0)


def test_synthetic_images_are_deterministic_and_normalised():
    a = images.load_images(None, 2, (24, 32), seed=3)
    b = images.load_images(None, 2, (24, 32), seed=3)
    assert len(a) == 2 and a[0].shape == (24, 32, 3) and a[0].dtype == np.uint8
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], a[1])
    batch = images.to_tensor(a)
    assert batch.shape == (2, 3, 24, 32)
    expected = (a[0][5, 7, 1] - images.IMAGENET_MEAN[1]) / images.IMAGENET_STD[1]
    assert batch[0, 1, 5, 7].item() == pytest.approx(expected, rel=1e-6)


def test_pink_noise_spectrum_falls_with_frequency():
    field = images.pink_noise((128, 128), np.random.default_rng(0))
    power = np.abs(np.fft.rfft2(field - field.mean())) ** 2
    low, high = power[1:4, 1:4].mean(), power[40:60, 40:60].mean()
    assert low > 100 * high
