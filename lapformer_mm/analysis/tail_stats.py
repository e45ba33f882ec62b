"""Query–key distances of captured attention calls and their tail statistics."""
import numpy as np
import torch

QUANTILES = (0.5, 0.9, 0.99, 0.999)
METRICS = ('l1', 'sq_l2')


def _sample(count, limit, generator):
    if count <= limit:
        return torch.arange(count)
    return torch.randperm(count, generator=generator)[:limit].sort().values


def pair_distances(q, k, pair_mask=None, max_queries=256, max_keys=256,
                   max_batches=64, generator=None):
    """ℓ1 and squared-ℓ2 distances (float64 numpy) of up to ``max_batches`` × ``max_queries``
    × ``max_keys`` sampled pairs, the same for every head, that ``pair_mask`` allows:
    q (B, h, N, d), k (B, h, M, d), pair_mask bool (B, 1|h, N, M) or None."""
    batch_idx = _sample(q.shape[0], max_batches, generator)
    query_idx = _sample(q.shape[2], max_queries, generator)
    key_idx = _sample(k.shape[2], max_keys, generator)
    qs = q[batch_idx][:, :, query_idx].double()
    ks = k[batch_idx][:, :, key_idx].double()
    l1 = torch.cdist(qs, ks, p=1.0)
    sq_l2 = torch.cdist(qs, ks, p=2.0).square()
    if pair_mask is None:
        return l1.flatten().numpy(), sq_l2.flatten().numpy()
    keep = pair_mask[batch_idx][:, :, query_idx][..., key_idx].expand_as(l1)
    return l1[keep].numpy(), sq_l2[keep].numpy()


class DistanceCollector:
    """Per-stage pools of sampled query–key distances of QKRecords; ``values`` returns at
    most ``max_samples`` of a stage's (a random subset)."""

    def __init__(self, max_queries=256, max_keys=256, max_batches=64,
                 max_samples=200_000, seed=0):
        self.limits = dict(max_queries=max_queries, max_keys=max_keys,
                           max_batches=max_batches)
        self.max_samples = max_samples
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.pools = {}

    def add(self, record):
        l1, sq_l2 = pair_distances(record.q, record.k, record.pair_mask,
                                   generator=self.generator, **self.limits)
        pool = self.pools.setdefault(record.stage, {m: [] for m in METRICS})
        pool['l1'].append(l1)
        pool['sq_l2'].append(sq_l2)

    def stages(self):
        return sorted(self.pools)

    def values(self, stage, metric):
        values = np.concatenate(self.pools[stage][metric])
        if values.size > self.max_samples:
            # The same permutation for both metrics keeps pairs aligned.
            state = np.random.default_rng(stage)
            values = values[state.permutation(values.size)[:self.max_samples]]
        return values


def excess_kurtosis(values):
    """m4 / m2² - 3 with population moments."""
    x = np.asarray(values, dtype=np.float64)
    centred = x - x.mean()
    m2 = np.mean(centred ** 2)
    if m2 == 0:
        return float('nan')
    return float(np.mean(centred ** 4) / m2 ** 2 - 3.0)


def upper_outlier_share(values):
    """Fraction of values above Tukey's upper fence Q3 + 1.5·IQR (linear quantiles)."""
    x = np.asarray(values, dtype=np.float64)
    q1, q3 = np.quantile(x, [0.25, 0.75])
    return float(np.mean(x > q3 + 1.5 * (q3 - q1)))


def tail_statistics(values, quantiles=QUANTILES):
    """n, mean, std, kurtosis, outlier_share, q<percent> per quantile and q99_over_q50 of a
    1-D sample."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size < 2:
        raise ValueError(f'values must be 1-D with at least 2 entries, got shape {x.shape}')
    stats = dict(n=int(x.size), mean=float(x.mean()), std=float(x.std()),
                 kurtosis=excess_kurtosis(x), outlier_share=upper_outlier_share(x))
    for q, value in zip(quantiles, np.quantile(x, quantiles)):
        stats[f'q{100 * q:g}'] = float(value)
    q50, q99 = np.quantile(x, [0.5, 0.99])
    stats['q99_over_q50'] = float(q99 / q50) if q50 > 0 else float('nan')
    return stats
