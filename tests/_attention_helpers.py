"""Shared helpers of the attention tests: independent dense computations and inputs."""
import torch
import torch.nn.functional as F

from lapformer_mm.ops import pool_landmarks


def dense_l1_kernel(x, y, lam):
    """exp(-||x_i - y_j||_1 / lam) through an explicit (..., N, M, d) tensor."""
    return torch.exp(-(x.unsqueeze(-2) - y.unsqueeze(-3)).abs().sum(-1) / lam)


def dense_gaussian_kernel(x, y, lam):
    """exp(-||x_i - y_j||_2^2 / lam) through an explicit (..., N, M, d) tensor."""
    return torch.exp(-((x.unsqueeze(-2) - y.unsqueeze(-3)) ** 2).sum(-1) / lam)


def dense_kernel(x, y, lam, kind):
    """The kernel named ``kind`` through an explicit difference tensor."""
    return {'laplacian': dense_l1_kernel, 'gaussian': dense_gaussian_kernel}[kind](x, y, lam)


def dense_injective(C, whiten_eps):
    """The injective map of docs/design.md §2.4 written out term by term."""
    m = C.shape[-1]
    centred = C - C.sum(-1, keepdim=True) / m
    mean_i = centred.mean(-2, keepdim=True)
    var = ((centred - mean_i) ** 2).mean(-2, keepdim=True)
    return centred / torch.sqrt(var + whiten_eps) + 1.0 / m


def dense_average(weights, v):
    """weights (..., N, M) applied as the attention applies them to v (..., M, d_v):
    weights · (v − v̄) / M + v̄, so that every row of the N × M matrix acting on v,
    (weights − rowmean) / M + 1/M, sums to 1 (docs/design.md §2.6)."""
    mean = v.sum(-2, keepdim=True) / v.shape[-2]
    return weights @ (v - mean) / v.shape[-2] + mean


def smooth_tokens(batch, hw, dim, scale, seed, dtype=torch.float64):
    """Blurred noise tokens (batch, 1, H·W, dim) with std ``scale``."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch * dim, 1, *hw, generator=gen, dtype=dtype)
    taps = torch.exp(-torch.arange(-4, 5, dtype=dtype) ** 2 / 8.0)
    blur = (taps / taps.sum())
    field = F.conv2d(F.pad(noise, (4, 4, 4, 4), mode='reflect'), blur.view(1, 1, 1, -1))
    field = F.conv2d(field, blur.view(1, 1, -1, 1)).reshape(batch, dim, *hw)
    field = field / field.std(dim=(2, 3), keepdim=True)
    return (scale * field).flatten(2).transpose(1, 2).unsqueeze(1)


def nearly_equal_columns_cases(seeds=4):
    """(q, v, landmarks, expected) per seed: smooth tokens on 64×96, their pooled landmarks,
    values offset by 3, and the dense fp64 attention. Every key is nearly equally similar to
    every landmark, so the output reads only k(k, L)ᵀ v's small landmark-to-landmark
    differences (issue 34's numerics case)."""
    for seed in range(seeds):
        q = smooth_tokens(1, (64, 96), 32, 0.5, seed)
        v = smooth_tokens(1, (64, 96), 32, 1.0, seed + 100) + 3.0
        landmarks = pool_landmarks(q, (64, 96), 7)
        yield q, v, landmarks, dense_attention(q, q, v, landmarks)


def dense_newton_schulz_solve(p, b, iters, ns_init='identity', ns_refine=True):
    """P⁻¹ b by docs/design.md §2.5 written out, for unconverged iterates (where a direct
    solve is not the truth): X_{t+1} = X_t (2I − P X_t) from X₀ = I / ‖P‖∞ ('identity') or
    1.8 / ‖P‖∞² · P ('authors'); S r = X r, and with ``ns_refine`` X r + X (r − P X r).

    The value is x = S b; the gradient is the closed form the op's backward takes for the
    solve that X stands for, dx = S (db − dP x), not autograd through the loop."""
    fixed = p.detach()
    eye = torch.eye(p.shape[-1], dtype=p.dtype)
    norm = fixed.abs().sum(-1).amax(-1)[..., None, None]
    x = eye / norm if ns_init == 'identity' else 1.8 * fixed / norm ** 2
    for _ in range(iters):
        x = x @ (2 * eye - fixed @ x)

    def solve(r):
        s = x @ r
        return s + x @ (r - fixed @ s) if ns_refine else s

    value = solve(b.detach())
    residual = b - p @ value
    return value + solve(residual - residual.detach())


def dense_attention(q, k, v, landmarks, lam=4.0, eps=0.01, whiten_eps=1e-5, kernel='laplacian',
                    normalize='injective', iters=None, ns_init='identity', ns_refine=True):
    """The attention in fp64 with explicit kernel tensors and a direct solve.

    Z(k(q, L)) · (k(L, L) + eps·I)⁻¹ · k(k, L)ᵀ (v − v̄) / N + v̄, every tensor cast to fp64:
    the one independent reference the op, module and backbone tests compare with. With
    ``iters`` the solve is that many Newton–Schulz steps (:func:`dense_newton_schulz_solve`).
    """
    q, k, v, landmarks = (t.double() for t in (q, k, v, landmarks))
    kernel_fn = dense_l1_kernel if kernel == 'laplacian' else dense_gaussian_kernel
    c_q = kernel_fn(q, landmarks, lam)
    w = kernel_fn(landmarks, landmarks, lam)
    p = w + eps * torch.eye(w.shape[-1], dtype=w.dtype)
    z = dense_injective(c_q, whiten_eps) if normalize == 'injective' else c_q
    mean = v.sum(-2, keepdim=True) / v.shape[-2]
    rhs = kernel_fn(k, landmarks, lam).mT @ (v - mean) / v.shape[-2]
    if iters is None:
        return z @ torch.linalg.solve(p, rhs) + mean
    return z @ dense_newton_schulz_solve(p, rhs, iters, ns_init, ns_refine) + mean


def dense_attention_module(module, x, hw, qk_shared, landmark_grid, **options):
    """A LaplacianAttention's output for x (B, N, C) on hw, written out with
    :func:`dense_attention`.

    Reads only the module's weights; ``qk_shared``, ``landmark_grid`` and the
    :func:`dense_attention` ``options`` are what the caller expects the module to use.
    """
    batch, num_tokens, channels = x.shape
    parts = F.linear(x, module.qkv.weight, module.qkv.bias).chunk(2 if qk_shared else 3, dim=-1)

    def split(t):
        return t.view(batch, num_tokens, module.num_heads, -1).transpose(1, 2)

    q, v = split(parts[0]), parts[-1]
    k = q if qk_shared else split(parts[1])
    out = dense_attention(q, k, split(v), pool_landmarks(k, hw, landmark_grid), **options)
    out = out.transpose(1, 2).reshape(batch, num_tokens, channels)
    out = out + dense_local_term(module, v, hw)
    return F.linear(out, module.proj.weight, module.proj.bias)


def dense_local_term(module, v, hw):
    """A LaplacianAttention's depth-wise 3×3 term of v (B, N, C) on hw, through NCHW."""
    batch, _, channels = v.shape
    local = F.conv2d(v.transpose(1, 2).reshape(batch, channels, *hw), module.local.weight,
                     module.local.bias, padding=1, groups=channels)
    return local.flatten(2).transpose(1, 2)


def dense_attention_grads(q, k, v, landmarks, grad, tied, **options):
    """(out, gradients) of :func:`dense_attention` for ``grad``; no k gradient when ``tied``."""
    qd, vd, ld = (t.detach().double().requires_grad_() for t in (q, v, landmarks))
    kd = qd if tied else k.detach().double().requires_grad_()
    out = dense_attention(qd, kd, vd, ld, **options)
    wrt = [qd, vd, ld] if tied else [qd, kd, vd, ld]
    return out, torch.autograd.grad(out, wrt, grad.double())


def finite(*tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def randn(*shapes, seed=0, dtype=torch.float64):
    """One normal tensor per shape, from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen, dtype=dtype) for shape in shapes)
