"""Solvers for the landmark system P X = B with P (..., m, m) symmetric positive definite.

* :func:`newton_schulz_iterate` — the attention's solver: X ≈ P⁻¹ by Newton–Schulz
  iterations (the reference implementation of the registered op
  :func:`lapformer_mm.ops.kernels.newton_schulz_op`).
* :func:`exact_solve` — ``torch.linalg.solve``, for tests and ablations.
* :func:`cg_solve` — conjugate gradient, the paper's ablation baseline.

All compute in fp32 (fp64 stays fp64) and return the caller's dtype. None
touches torch's global precision or thread settings; on CUDA, CG's fp32
matmuls follow the user's TF32 setting (it is an ablation baseline).
"""
import torch

from ._checks import check_float_tensor, check_optional_int
from ._precision import compute_dtype

#: Newton–Schulz iterations used when ``iters=None``. From X₀ = I / ||P||_inf the
#: residual after t steps is at most (1 − ε/(m + ε))^(2^t); 16 steps bring the worst
#: case ε = 0.01 allows, identical landmarks (P = 1 1ᵀ + ε I, cond 4901 at m = 49),
#: to ||I - P X||_2 = 1.6e-6, below 1e-3 (15 left 1.25e-3; docs/numerics.md,
#: ``benchmarks/numerics.py``).
DEFAULT_NS_ITERS = 16


def check_square(name, P):
    """Require a floating tensor (..., m, m)."""
    check_float_tensor(name, P)
    if P.shape[-1] != P.shape[-2]:
        raise ValueError(f'{name} must be square (..., m, m), got shape '
                         f'{tuple(P.shape)}')
    return P


def _inf_norm(P):
    """Max absolute row sum per matrix, shape (..., 1, 1)."""
    return P.abs().sum(-1).amax(-1).view(*P.shape[:-2], 1, 1)


def newton_schulz_start(P, init):
    """Starting guess X_0 (..., m, m) for the SPD matrix P.

    'identity': I / ||P||_inf, so every eigenvalue of P X_0 lies in (0, 1].
    'authors': 1.8 / ||P||_inf² · P (the LaplacianFormer code's start).
    """
    norm = _inf_norm(P)
    if init == 'identity':
        eye = torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
        return eye / norm
    return P * (1.8 / (norm * norm))


def newton_schulz_iterate(P, iters, init):
    """X_{t+1} = 2 X_t - X_t P X_t from :func:`newton_schulz_start`; P (batch, m, m).

    On CUDA the iterate runs in fp64: torch's fp32 matmuls there follow the user's
    TF32 setting, whose 10-bit mantissa caps the residual near 1e-3, and the
    m x m products are too small for fp64 to cost anything that matters.
    """
    p = P.double() if P.is_cuda else P
    x = newton_schulz_start(p, init).expand_as(p).contiguous()
    for _ in range(iters):
        x = torch.baddbmm(x, x, torch.bmm(p, x), beta=2.0, alpha=-1.0)
    return x.to(P.dtype)


def exact_solve(P, B):
    """Solve P X = B exactly; P (..., m, m), B (..., m, k) -> (..., m, k).

    A singular P (e.g. identical landmarks with ``eps=0``) raises a
    ``ValueError`` that says so, rather than torch's ``LinAlgError``.
    """
    check_square('P', P)
    check_float_tensor('B', B)
    dtype = compute_dtype(P.dtype)
    x, info = torch.linalg.solve_ex(P.to(dtype), B.to(dtype))
    if bool((info != 0).any()):
        raise ValueError('the landmark matrix P = k(L, L) + eps·I is singular (identical '
                         'landmarks with eps=0?): use eps > 0 (default 0.01)')
    return x.to(B.dtype)


def exact_inverse(P):
    """Exact inverse of P (..., m, m) via ``torch.linalg.inv``."""
    check_square('P', P)
    dtype = compute_dtype(P.dtype)
    x = torch.linalg.inv(P.to(dtype))
    return x.to(P.dtype)


def _cg_step_size(num, den, active):
    """num / den for the active columns, 0 elsewhere and where den == 0.

    The denominator is replaced before dividing, not after: a masked-out
    division by ~0 would still put NaN into the gradient.
    """
    active = active & (den != 0)
    safe = torch.where(active, den, torch.ones_like(den))
    return torch.where(active, num / safe, torch.zeros_like(num))


#: CG stops when every column's residual is below this share of its right-hand
#: side's (times the dtype's epsilon), or after CG_MAX_ITERS_PER_M * m steps.
CG_TOL_EPS = 10.0
CG_MAX_ITERS_PER_M = 10


def cg_solve(P, B, iters=None):
    """Conjugate gradient for SPD P (..., m, m), all columns of B (..., m, k) at once.

    Runs until every column's residual ||r|| is at most ``CG_TOL_EPS`` x the
    dtype's epsilon x ||b||, at most
    ``iters`` steps (default ``CG_MAX_ITERS_PER_M * m``: in floating point CG
    needs more than the m steps of exact arithmetic, and stopping at m left
    1e-4..1e-3 relative error in fp64 at moderate conditioning). A converged
    column stops moving: its next steps would divide round-off by round-off
    (NaN gradients, e.g. with identical landmarks or underflowed kernel
    values). Checking convergence synchronises with the device once per step;
    CG is the ablation baseline, not the attention's solver.
    """
    check_square('P', P)
    check_float_tensor('B', B)
    iters = check_optional_int('iters', iters)
    if B.shape[-2] != P.shape[-1]:
        raise ValueError(f'B must be (..., m, k) with m = {P.shape[-1]}, got '
                         f'shape {tuple(B.shape)}')
    iters = CG_MAX_ITERS_PER_M * P.shape[-1] if iters is None else iters
    dtype = compute_dtype(P.dtype)
    P, rhs = P.to(dtype), B.to(dtype)
    x = torch.zeros_like(rhs)
    residual = rhs
    direction = rhs
    rs = (residual * residual).sum(-2, keepdim=True)
    tol = torch.finfo(dtype).eps * CG_TOL_EPS
    floor = torch.clamp(tol * tol * rs, min=torch.finfo(dtype).tiny)
    for _ in range(iters):
        active = rs > floor
        if not bool(active.any()):
            break
        p_dir = torch.matmul(P, direction)
        alpha = _cg_step_size(rs, (direction * p_dir).sum(-2, keepdim=True), active)
        x = x + alpha * direction
        residual = residual - alpha * p_dir
        rs_new = (residual * residual).sum(-2, keepdim=True)
        direction = residual + _cg_step_size(rs_new, rs, active) * direction
        rs = torch.where(active, rs_new, rs)
    return x.to(B.dtype)
