"""Nyström kernel attention with Laplacian (or Gaussian) kernel, linear in tokens."""
import torch
import torch.nn.functional as F

from ._checks import (KERNELS, NORMALIZATIONS, NS_INITS, SOLVERS, check_bool, check_choice,
                      check_float_tensor, check_non_negative, check_optional_int,
                      check_positive, check_probability)
from ._precision import compute_dtype
from .kernels import KERNEL_FUNCTIONS, newton_schulz_pinv
from .normalize import injective_normalize
from .solvers import cg_solve, exact_solve, small_matmul


def check_attention_inputs(q, k, v, landmarks):
    """q, k, v (B, h, N, d) and landmarks (B, h, m, d) must agree."""
    for name, t in (('q', q), ('k', k), ('v', v), ('landmarks', landmarks)):
        check_float_tensor(name, t, min_dim=3)
    if k.shape != q.shape:
        raise ValueError(f'k must have the shape of q {tuple(q.shape)}, got '
                         f'{tuple(k.shape)}')
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f'v must be (..., N, d_v) with the batch dims and N of q '
                         f'{tuple(q.shape)}, got {tuple(v.shape)}')
    if landmarks.shape[:-2] != q.shape[:-2] or landmarks.shape[-1] != q.shape[-1]:
        raise ValueError(f'landmarks must be (..., m, d) with the batch dims and d '
                         f'of q {tuple(q.shape)}, got {tuple(landmarks.shape)}')
    devices = {t.device for t in (q, k, v, landmarks)}
    if len(devices) != 1:
        raise ValueError(f'q, k, v, landmarks must be on one device, got {devices}')


def solve_landmark_system(P, rhs, solver, iters, backend, ns_init='identity', ns_refine=False):
    """P⁻¹ · rhs for P (..., m, m), rhs (..., m, d) with the named solver.

    With ``ns_refine``, 'newton' follows the Newton–Schulz inverse X with one step
    of iterative refinement, x ← x + X (rhs − P x): with near-identical landmarks
    (cond(P) in the thousands) an fp32 X is accurate to only ~1e-3, which the
    whitening then amplifies to 1e-2..5e-2 in the attention output; the step
    brings it to the error of an fp32 direct solve for two (m × m)·(m × d)
    products (docs/numerics.md, which also says why it is off by default).
    """
    if solver == 'newton':
        inverse = newton_schulz_pinv(P, iters, ns_init, backend=backend)
        x = small_matmul(inverse, rhs)
        if ns_refine:
            x = x + small_matmul(inverse, rhs - small_matmul(P, x))
        return x
    if solver == 'exact':
        return exact_solve(P, rhs)
    return cg_solve(P, rhs, iters)


def _nystrom_fp32(q, k, v, landmarks, kernel, lam, eps, solver, iters, ns_init, ns_refine,
                  normalize, whiten_eps, dropout_p, backend):
    """The attention on already-cast tensors; see :func:`nystrom_attention`."""
    kernel_fn = KERNEL_FUNCTIONS[kernel]
    c_q = kernel_fn(q, landmarks, lam, backend=backend)
    # With qk_shared the two kernel matrices coincide; compute it once.
    c_k = c_q if k is q else kernel_fn(k, landmarks, lam, backend=backend)
    w = kernel_fn(landmarks, landmarks, lam, backend=backend)
    p = w + eps * torch.eye(w.shape[-1], dtype=w.dtype, device=w.device)
    # Right to left: (m, d) products only, never N×N or N×m×d.
    context = solve_landmark_system(p, torch.matmul(c_k.mT, v), solver, iters,
                                    backend, ns_init, ns_refine)
    z = injective_normalize(c_q, whiten_eps) if normalize == 'injective' else c_q
    if dropout_p > 0:
        z = F.dropout(z, dropout_p, training=True)
    return torch.matmul(z, context)


def nystrom_attention(q, k, v, landmarks, *, kernel='laplacian', lam=4.0, eps=0.01,
                      solver='newton', iters=None, ns_init='identity', ns_refine=False,
                      normalize='injective', whiten_eps=1e-5, dropout_p=0.0, backend=None):
    """Z(k(q, L)) · (k(L, L) + eps·I)⁻¹ · (k(k, L)ᵀ · v), evaluated right to left.

    q, k (B, h, N, d), v (B, h, N, d_v), landmarks L (B, h, m, d) -> (B, h, N, d_v).
    Cost O(N·m·d + m²·d + m³·iters), memory O(N·m + N·d).

    kernel: 'laplacian' exp(-||·||_1/lam) or 'gaussian' exp(-||·||_2²/lam).
    normalize: 'injective' (:func:`injective_normalize`) or 'none' (plain Nyström).
    solver: 'newton' (Newton–Schulz, ``iters`` steps from the ``ns_init`` start
    'identity' or 'authors'; with ``ns_refine`` one step of iterative refinement
    follows), 'exact' or 'cg' (to a tolerance, at most ``iters`` steps).
    whiten_eps: δ >= 0 of the whitening; with 0, a landmark column constant over
    the queries (every 1×1 grid) is centred to 0 rather than divided by 0.
    dropout_p: dropout on the normalised query features Z (attention dropout).
    The kernels, normalisation and solve run in fp32 (fp64 stays fp64) with
    autocast disabled; the result is cast back to q's dtype.
    """
    check_attention_inputs(q, k, v, landmarks)
    check_choice('kernel', kernel, KERNELS)
    check_choice('normalize', normalize, NORMALIZATIONS)
    check_choice('solver', solver, SOLVERS)
    lam = check_positive('lam', lam)
    eps = check_non_negative('eps', eps)
    whiten_eps = check_non_negative('whiten_eps', whiten_eps)
    iters = check_optional_int('iters', iters)
    check_choice('ns_init', ns_init, NS_INITS)
    check_bool('ns_refine', ns_refine)
    dropout_p = check_probability('dropout_p', dropout_p)
    out_dtype = q.dtype
    dtype = compute_dtype(q.dtype)
    shared = k is q
    with torch.autocast(device_type=q.device.type, enabled=False):
        q32 = q.to(dtype)
        k32 = q32 if shared else k.to(dtype)
        out = _nystrom_fp32(q32, k32, v.to(dtype), landmarks.to(dtype), kernel, lam,
                            eps, solver, iters, ns_init, ns_refine, normalize, whiten_eps, dropout_p,
                            backend)
    return out.to(out_dtype)
