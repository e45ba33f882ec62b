"""The hypothesis strategies of the property tests: shapes down to 1, feature scales 1e-4 …
1e4; ``derandomize=True`` keeps CI runs reproducible."""
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from lapformer_mm.ops import gaussian_kernel, laplacian_kernel, nystrom_attention, pool_landmarks

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
KERNELS = {'laplacian': laplacian_kernel, 'gaussian': gaussian_kernel}


@st.composite
def kernel_inputs(draw):
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    n, m, d = draw(st.integers(1, 40)), draw(st.integers(1, 20)), draw(st.integers(1, 40))
    scale = 10.0 ** draw(st.floats(-4, 4))
    seed = draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, n, d, generator=gen) * scale
    y = torch.randn(*batch, m, d, generator=gen) * scale
    lam = draw(st.sampled_from([0.5, 1.0, 4.0, 16.0]))
    kind = draw(st.sampled_from(sorted(KERNELS)))
    return x, y, lam, kind


@st.composite
def landmark_matrix_cases(draw):
    m = draw(st.integers(1, 49))
    d = draw(st.integers(1, 32))
    scale = 10.0 ** draw(st.floats(-4, 4))
    eps = draw(st.sampled_from([1e-3, 1e-2, 1e-1]))
    seed = draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    landmarks = torch.randn(2, m, d, generator=gen, dtype=torch.float64) * scale
    p = laplacian_kernel(landmarks, landmarks) + eps * torch.eye(m, dtype=torch.float64)
    return p, draw(st.integers(1, 30))


@st.composite
def attention_cases(draw, solvers=('newton', 'exact')):
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    hw = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    d = draw(st.integers(1, 16))
    scale = 10.0 ** draw(st.floats(-4, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    n = hw[0] * hw[1]
    q = torch.randn(b, h, n, d, generator=gen) * scale
    shared = draw(st.booleans())
    k = q if shared else torch.randn(b, h, n, d, generator=gen) * scale
    v = torch.randn(b, h, n, d, generator=gen)
    options = dict(kernel=draw(st.sampled_from(sorted(KERNELS))),
                   normalize=draw(st.sampled_from(['injective', 'none'])),
                   solver=draw(st.sampled_from(solvers)),
                   grid=draw(st.integers(1, 7)))
    return q, k, v, hw, options


def run_attention(q, k, v, hw, options, impl=None):
    options = dict(options)
    landmarks = pool_landmarks(k, hw, options.pop('grid'))
    return nystrom_attention(q, k, v, landmarks, impl=impl, **options)
