"""Nyström kernel attention with Laplacian (or Gaussian) kernel, linear in tokens."""
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from ._checks import (
    KERNELS,
    NORMALIZATIONS,
    NS_INITS,
    SOLVERS,
    check_bool,
    check_choice,
    check_float_tensor,
    check_non_negative,
    check_optional_int,
    check_positive,
    check_probability,
)
from ._precision import compute_dtype
from .dispatch import backend_uses_cupy, requested_backend
from .export import export_attention, exporting
from .kernels import newton_schulz, pairwise_kernel
from .normalize import whiten
from .solvers import cg_solve, exact_solve


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Validated options of the Nyström attention; built once, used on every call.

    kernel: 'laplacian' exp(-||·||_1/lam) or 'gaussian' exp(-||·||_2²/lam), lam > 0.
    eps: ridge ε >= 0 added to k(L, L).
    solver: 'newton' (Newton–Schulz, ``iters`` steps from the ``ns_init`` start
    'identity' or 'authors'; with ``ns_refine``, the default, one step of
    iterative refinement follows), 'exact' or 'cg' (to a tolerance, at most
    ``iters`` steps).
    iters: None for the solver's default.
    normalize: 'injective' (:func:`injective_normalize`) or 'none' (plain Nyström).
    whiten_eps: δ >= 0 of the whitening; with 0, a landmark column constant over
    the queries (every 1×1 grid) is centred to 0 rather than divided by 0.
    backend: 'reference', 'cupy' or None (the environment variable
    ``LAPFORMER_OPS`` when set, else CuPy for CUDA tensors when it imports);
    the environment is read here, once.
    """
    kernel: str = 'laplacian'
    lam: float = 4.0
    eps: float = 0.01
    solver: str = 'newton'
    iters: Optional[int] = None
    ns_init: str = 'identity'
    ns_refine: bool = True
    normalize: str = 'injective'
    whiten_eps: float = 1e-5
    backend: Optional[str] = None

    def __post_init__(self):
        checked = dict(
            kernel=check_choice('kernel', self.kernel, KERNELS),
            lam=check_positive('lam', self.lam),
            eps=check_non_negative('eps', self.eps),
            solver=check_choice('solver', self.solver, SOLVERS),
            iters=check_optional_int('iters', self.iters),
            ns_init=check_choice('ns_init', self.ns_init, NS_INITS),
            ns_refine=check_bool('ns_refine', self.ns_refine),
            normalize=check_choice('normalize', self.normalize, NORMALIZATIONS),
            whiten_eps=check_non_negative('whiten_eps', self.whiten_eps),
            backend=requested_backend(self.backend))
        for name, value in checked.items():
            object.__setattr__(self, name, value)


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


def solve_landmark_system(P, rhs, options, use_cupy):
    """P⁻¹ · rhs for P (..., m, m), rhs (..., m, d) with the solver of ``options``.

    With ``ns_refine`` (the default), 'newton' follows the Newton–Schulz inverse X
    with one step of iterative refinement, x ← x + X (rhs − P x): with
    near-identical landmarks (cond(P) in the thousands) an fp32 X is accurate to
    only ~1e-3, which the whitening then amplifies to 1e-2..5e-2 in the attention
    output; the step brings it to the error of an fp32 direct solve. The residual
    is formed in fp64, so neither cancellation nor a TF32 matmul limits it; it is
    an (m × m)·(m × d) product (docs/numerics.md).
    """
    if options.solver == 'newton':
        inverse = newton_schulz(P, options.iters, options.ns_init, use_cupy)
        x = torch.matmul(inverse, rhs)
        if options.ns_refine:
            residual = rhs.double() - torch.matmul(P.double(), x.double())
            x = x + torch.matmul(inverse, residual.to(x.dtype))
        return x
    if options.solver == 'exact':
        return exact_solve(P, rhs)
    return cg_solve(P, rhs, options.iters)


def landmark_matrix(landmarks, options, use_cupy=None):
    """P = k(L, L) + eps·I (..., m, m) for landmarks L (..., m, d) and :class:`AttentionOptions`.

    ``use_cupy=None`` decides from ``options.backend`` and the landmarks' device.
    """
    if use_cupy is None:
        use_cupy = backend_uses_cupy(options.backend, landmarks)
    w = pairwise_kernel(landmarks, landmarks, options.lam, options.kernel, use_cupy)
    return w + options.eps * torch.eye(w.shape[-1], dtype=w.dtype, device=w.device)


def nystrom_forward(q, k, v, landmarks, options, dropout_p=0.0):
    """:func:`nystrom_attention` with options validated beforehand and inputs trusted.

    For modules that validate at construction: q, k (B, h, N, d),
    v (B, h, N, d_v), landmarks (B, h, m, d) on one device; ``options`` an
    :class:`AttentionOptions`; ``k is q`` when keys are tied.
    """
    if exporting():
        return export_attention(q, k, v, landmarks, options, dropout_p)
    use_cupy = backend_uses_cupy(options.backend, q)
    out_dtype = q.dtype
    dtype = compute_dtype(q.dtype)
    shared = k is q
    with torch.autocast(device_type=q.device.type, enabled=False):
        q = q.to(dtype)
        k = q if shared else k.to(dtype)
        v, landmarks = v.to(dtype), landmarks.to(dtype)
        c_q = pairwise_kernel(q, landmarks, options.lam, options.kernel, use_cupy)
        # With tied keys the two kernel matrices coincide; compute it once.
        c_k = c_q if shared else pairwise_kernel(k, landmarks, options.lam, options.kernel,
                                                 use_cupy)
        # Right to left: (m, d) products only, never N×N or N×m×d.
        context = solve_landmark_system(landmark_matrix(landmarks, options, use_cupy),
                                        torch.matmul(c_k.mT, v), options, use_cupy)
        z = whiten(c_q, options.whiten_eps) if options.normalize == 'injective' else c_q
        if dropout_p > 0:
            z = F.dropout(z, dropout_p, training=True)
        out = torch.matmul(z, context)
    return out.to(out_dtype)


def nystrom_attention(q, k, v, landmarks, *, dropout_p=0.0, **options):
    """Z(k(q, L)) · (k(L, L) + eps·I)⁻¹ · (k(k, L)ᵀ · v), evaluated right to left.

    q, k (B, h, N, d), v (B, h, N, d_v), landmarks L (B, h, m, d) -> (B, h, N, d_v).
    Cost O(N·m·d + m²·d + m³·iters), memory O(N·m + N·d).

    ``options`` are the fields of :class:`AttentionOptions` (kernel, lam, eps,
    solver, iters, ns_init, ns_refine, normalize, whiten_eps, backend).
    dropout_p: dropout on the normalised query features Z (attention dropout).
    The kernels, normalisation and solve run in fp32 (fp64 stays fp64) with
    autocast disabled; the result is cast back to q's dtype.
    """
    check_attention_inputs(q, k, v, landmarks)
    dropout_p = check_probability('dropout_p', dropout_p)
    return nystrom_forward(q, k, v, landmarks, AttentionOptions(**options), dropout_p)
