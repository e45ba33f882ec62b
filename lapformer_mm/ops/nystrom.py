"""Nyström kernel attention with Laplacian (or Gaussian) kernel, linear in tokens: one op per call.

The attention is one registered op, ``lapformer_mm::nystrom_attention``, with its backward
one op too, ``lapformer_mm::nystrom_attention_backward``; their plain-PyTorch reference
implementation is in this file and is the ground truth on every device.

Contract (shapes per batch element b and head h; every implementation keeps it):

``nystrom_attention(q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine,
normalize, whiten_eps, impl) -> (out, context, inverse, stats)``

* q (B, h, N, d); k (B, h, N, d) or None when keys are tied to queries; v (B, h, N, d_v);
  landmarks L (B, h, m, d). Any strides; one floating dtype (fp32, bf16, fp16 or fp64)
  and one device for all four.
* kernel 'laplacian' exp(-||·||_1/lam) or 'gaussian' exp(-||·||_2²/lam); eps the ridge
  added to k(L, L); iters, ns_init the Newton–Schulz steps and start; ns_refine one step
  of iterative refinement of the solve; normalize 'injective' or 'none'; whiten_eps δ;
  impl 'reference', 'cupy' or 'cpu' (:mod:`.dispatch`).
* out (B, N, h, d_v), contiguous, in q's dtype: the (B, N, h·d_v) token layout the
  module needs next (``out.transpose(1, 2)`` is the (B, h, N, d_v) result, a view).
* context (B, h, m, d_v): the solved P⁻¹ k(k, L)ᵀ v, P = k(L, L) + eps·I;
  inverse (B, h, m, m): the Newton–Schulz X ≈ P⁻¹; stats (B, h, 2, m): per landmark
  column, the mean μ over queries of the row-centred kernel row c̃ and the whitening scale
  s = (var + δ)^(-1/2) (0 where var + δ = 0); (B, h, 0, m) for normalize='none'. These
  three are fp32 (fp64 for fp64 inputs) and exist for the backward, as flash-attn saves
  softmax_lse.

``nystrom_attention_backward(grad, q, k, v, landmarks, context, inverse, stats, kernel, lam,
eps, ns_refine, normalize, whiten_eps, impl) -> (dq, dk, dv, dlandmarks)``

* grad (B, N, h, d_v) any strides, the gradient of out; the rest as the forward's inputs
  and saved outputs. dk is an empty tensor when k is None (its gradient is in dq). The
  gradients have their operands' dtypes.

The math (per (b, h); C_q = k(q, L), C_k = k(k, L), docs/design.md §2):

    context = X R (+ X (R − P X R) with ns_refine; the residual in fp64), R = C_kᵀ v
    c̃ = C_q − rowmean(C_q);  μ_j, σ²_j = mean, var over queries of c̃_j;  s = (σ² + δ)^-½
    out = (c̃ diag(s) + 1/m) context    (normalize='none': C_q context)

and the backward is its closed form, which treats the solve as exact (dR = P⁻¹ dcontext,
dP = −dR contextᵀ). The fused implementations use the folded forward
out = C_q ((I − J/m) diag(s) context) + 1 colsum(context)ᵀ/m, so the N × m matrix is never
stored. Each implementation module ('cupy': :mod:`.cupy_ops`, 'cpu': :mod:`.cpu_ext`)
provides ``nystrom_attention_forward`` and ``nystrom_attention_backward`` with the
arguments of the ops above except ``impl``, called after the op checked the operands.

Autograd: :class:`NystromAttention`, an ``autograd.Function`` around the two ops (defined
with ``torch.library`` define/impl); :func:`nystrom_attention_call` is the differentiable
call and :func:`nystrom_forward` the entry LaplacianAttention uses (where an export hook
goes). Dropout on Z (attention dropout in training) and the 'exact' and 'cg' solvers do
not fold: they run the composite path (:func:`nystrom_composite`, autograd through the
primitive ops of :mod:`.kernels`).
"""
import dataclasses
import math
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
from .dispatch import implementation, prepare, requested_impl, resolve_impl
from .export import export_attention, exporting
from .kernels import newton_schulz, pairwise_kernel
from .normalize import whiten, whitening_scale
from .reference_kernels import pairwise_grad_reference, pairwise_kernel_reference
from .solvers import DEFAULT_NS_ITERS, cg_solve, exact_solve, newton_schulz_iterate


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
    impl: 'reference', 'cupy', 'cpu' or None (the environment variable
    ``LAPFORMER_OPS`` when set, else the fast implementation of the tensors' device when
    it is usable; :mod:`lapformer_mm.ops.dispatch`); the environment is read here, once.
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
    impl: Optional[str] = None

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
            impl=requested_impl(self.impl))
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        prepare(self.impl)

    @property
    def fused(self):
        """Whether the attention takes the fused op (Newton–Schulz); else the composite path."""
        return self.solver == 'newton'


def check_attention_inputs(q, k, v, landmarks, min_dim=3):
    """q, k (..., N, d), v (..., N, d_v) and landmarks (..., m, d) must agree; k may be None."""
    for name, t in (('q', q), ('k', k), ('v', v), ('landmarks', landmarks)):
        if t is not None:
            check_float_tensor(name, t, min_dim=min_dim)
    if k is not None and k.shape != q.shape:
        raise ValueError(f'k must have the shape of q {tuple(q.shape)}, got '
                         f'{tuple(k.shape)}')
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f'v must be (..., N, d_v) with the batch dims and N of q '
                         f'{tuple(q.shape)}, got {tuple(v.shape)}')
    if landmarks.shape[:-2] != q.shape[:-2] or landmarks.shape[-1] != q.shape[-1]:
        raise ValueError(f'landmarks must be (..., m, d) with the batch dims and d '
                         f'of q {tuple(q.shape)}, got {tuple(landmarks.shape)}')
    operands = [t for t in (q, k, v, landmarks) if t is not None]
    devices = {t.device for t in operands}
    if len(devices) != 1:
        raise ValueError(f'q, k, v, landmarks must be on one device, got {devices}')


def _check_op_operands(op, q, k, v, landmarks):
    """The operands of the fused ops: 4-D, consistent, one dtype (kernels read one type)."""
    if q.dim() != 4:
        raise ValueError(f'{op}: q must be (B, h, N, d), got shape {tuple(q.shape)}')
    check_attention_inputs(q, k, v, landmarks, min_dim=4)
    for name, t in (('k', k), ('v', v), ('landmarks', landmarks)):
        if t is not None and t.dtype != q.dtype:
            raise TypeError(f'{op}: {name} has dtype {t.dtype} but q has {q.dtype}; '
                            f'all operands must share one dtype')


# ----------------------------------------------------------------------------
# The reference implementation: today's math in plain PyTorch.
# ----------------------------------------------------------------------------

def _as3(t):
    """(B, h, n, d) -> (B·h, n, d)."""
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _reference_kernel(x, y, lam, kernel):
    return pairwise_kernel_reference(_as3(x), _as3(y), lam, kernel).view(*x.shape[:-1],
                                                                         y.shape[-2])


def _landmark_system_reference(landmarks, lam, eps, kernel):
    """P = k(L, L) + eps·I (..., m, m)."""
    w = _reference_kernel(landmarks, landmarks, lam, kernel)
    return w + eps * torch.eye(w.shape[-1], dtype=w.dtype, device=w.device)


def apply_inverse(inverse, P, rhs, ns_refine):
    """X rhs for the Newton–Schulz inverse X of P, then with ``ns_refine`` one refinement step
    x + X (rhs − P x), the residual in fp64 (neither cancellation nor TF32 limits it)."""
    x = torch.matmul(inverse, rhs)
    if not ns_refine:
        return x
    residual = rhs.double() - torch.matmul(P.double(), x.double())
    return x + torch.matmul(inverse, residual.to(x.dtype))


def _whitening_stats(centred, whiten_eps):
    """(μ, s) (..., 1, m) of the row-centred C: column mean, (var + δ)^-½ (0 where var + δ = 0)."""
    mean = centred.mean(-2, keepdim=True)
    var = (centred - mean).square().mean(-2, keepdim=True)
    return mean, whitening_scale(var, whiten_eps)


def nystrom_attention_reference(q, k, v, landmarks, kernel, lam, eps, iters, ns_init,
                                ns_refine, normalize, whiten_eps):
    """The forward of the contract in plain PyTorch: Z(k(q, L)) · P⁻¹ · k(k, L)ᵀ v.

    Computes in fp32 (fp64 stays fp64) with autocast off; N × m matrices are formed.
    """
    out_dtype = q.dtype
    dtype = compute_dtype(q.dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, v, landmarks = q.to(dtype), v.to(dtype), landmarks.to(dtype)
        c_q = _reference_kernel(q, landmarks, lam, kernel)
        c_k = c_q if k is None else _reference_kernel(k.to(dtype), landmarks, lam, kernel)
        P = _landmark_system_reference(landmarks, lam, eps, kernel)
        batch_shape = P.shape
        inverse = newton_schulz_iterate(_as3(P), iters, ns_init).view(batch_shape)
        rhs = torch.matmul(c_k.mT, v)
        context = apply_inverse(inverse, P, rhs, ns_refine)
        m = landmarks.shape[-2]
        if normalize == 'injective':
            centred = c_q - c_q.mean(-1, keepdim=True)
            mean, scale = _whitening_stats(centred, whiten_eps)
            z = centred * scale + 1.0 / m
            stats = torch.cat((mean, scale), dim=-2)
        else:
            z = c_q
            stats = c_q.new_empty(*c_q.shape[:-2], 0, m)
        out = torch.matmul(z, context)
    return out.transpose(1, 2).to(out_dtype).contiguous(), context, inverse, stats


def nystrom_attention_backward_reference(grad, q, k, v, landmarks, context, inverse, stats,
                                         kernel, lam, eps, ns_refine, normalize, whiten_eps):
    """The closed-form backward of the contract in plain PyTorch (N × m matrices formed).

    With G = grad, T = c̃ᵀ G, a_j = s_j³ Σ_e T_je context_je / N:
    dcontext = diag(s) T + 1 colsum(G)ᵀ / m; dc̃ = (G contextᵀ) diag(s) − (c̃ − μ) diag(a);
    dC_q = dc̃ − rowmean(dc̃); dR = P⁻¹ dcontext (X, refined like the forward);
    dP = −dR contextᵀ; dC_k = v dRᵀ; dv = C_k dR; then the kernels' gradients.
    """
    dtype = compute_dtype(q.dtype)
    tied = k is None
    with torch.autocast(device_type=q.device.type, enabled=False):
        g = grad.transpose(1, 2).to(dtype)                      # (B, h, N, d_v)
        qa, va, la = q.to(dtype), v.to(dtype), landmarks.to(dtype)
        ka = qa if tied else k.to(dtype)
        c_q = _reference_kernel(qa, la, lam, kernel)
        c_k = c_q if tied else _reference_kernel(ka, la, lam, kernel)
        n, m = q.shape[-2], la.shape[-2]
        if normalize == 'injective':
            mean, scale = stats[..., :1, :], stats[..., 1:, :]
            centred = c_q - c_q.mean(-1, keepdim=True)
            t = torch.matmul(centred.mT, g)                     # (B, h, m, d_v)
            d_context = scale.mT * t + g.sum(-2, keepdim=True) / m
            a = scale.square() * scale * (t * context).sum(-1).unsqueeze(-2) / n
            d_centred = torch.matmul(g, context.mT) * scale - (centred - mean) * a
            d_cq = d_centred - d_centred.mean(-1, keepdim=True)
        else:
            d_context = torch.matmul(c_q.mT, g)
            d_cq = torch.matmul(g, context.mT)
        P = _landmark_system_reference(la, lam, eps, kernel)
        d_rhs = apply_inverse(inverse, P, d_context, ns_refine)
        d_p = -torch.matmul(d_rhs, context.mT)
        d_ck = torch.matmul(va, d_rhs.mT)
        dv = torch.matmul(c_k, d_rhs)
        w_q = (d_cq + d_ck if tied else d_cq) * c_q
        dq = pairwise_grad_reference(_as3(w_q), _as3(qa), _as3(la), lam, kernel)
        dl = pairwise_grad_reference(_as3(w_q.mT), _as3(la), _as3(qa), lam, kernel)
        if tied:
            dk = q.new_empty(0)
        else:
            w_k = d_ck * c_k
            dk = pairwise_grad_reference(_as3(w_k), _as3(ka), _as3(la), lam, kernel)
            dl = dl + pairwise_grad_reference(_as3(w_k.mT), _as3(la), _as3(ka), lam, kernel)
            dk = dk.view(k.shape).to(k.dtype)
        # P = k(L, L) + eps·I: L is both operands; k is symmetric.
        w_p = (d_p + d_p.mT) * (P - eps * torch.eye(m, dtype=P.dtype, device=P.device))
        dl = dl + pairwise_grad_reference(_as3(w_p), _as3(la), _as3(la), lam, kernel)
    return (dq.view(q.shape).to(q.dtype), dk, dv.to(v.dtype),
            dl.view(landmarks.shape).to(landmarks.dtype))


# ----------------------------------------------------------------------------
# The registered ops, and autograd on top of them.
#
# torch.library define/impl with an autograd.Function outside: measured the cheapest way
# to attach autograd (benchmarks/cuda_host.py, 2026-12-01, this 2-core CPU machine with
# a fake CuPy: forward with grad 59 µs and forward+backward 193 µs, against 147 µs and
# 299 µs for torch.library.custom_op with register_autograd, whose per-call wrapper
# rebuilds the schema's argument list; docs/cuda.md).
# ----------------------------------------------------------------------------

_LIBRARY = torch.library.Library('lapformer_mm', 'FRAGMENT')
_LIBRARY.define(
    'nystrom_attention(Tensor q, Tensor? k, Tensor v, Tensor landmarks, str kernel, float lam, '
    'float eps, int iters, str ns_init, bool ns_refine, str normalize, float whiten_eps, '
    'str impl) -> (Tensor, Tensor, Tensor, Tensor)')
_LIBRARY.define(
    'nystrom_attention_backward(Tensor grad, Tensor q, Tensor? k, Tensor v, Tensor landmarks, '
    'Tensor context, Tensor inverse, Tensor stats, str kernel, float lam, float eps, '
    'bool ns_refine, str normalize, float whiten_eps, str impl) '
    '-> (Tensor, Tensor, Tensor, Tensor)')


def nystrom_attention_kernel(q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine,
                             normalize, whiten_eps, impl):
    """The op's implementation: operands checked once, then the implementation of ``impl``."""
    _check_op_operands('nystrom_attention', q, k, v, landmarks)
    args = (q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine, normalize,
            whiten_eps)
    if impl == 'reference':
        return nystrom_attention_reference(*args)
    return implementation(impl).nystrom_attention_forward(*args)


def nystrom_attention_backward_kernel(grad, q, k, v, landmarks, context, inverse, stats, kernel,
                                      lam, eps, ns_refine, normalize, whiten_eps, impl):
    """The backward op's implementation."""
    args = (grad, q, k, v, landmarks, context, inverse, stats, kernel, lam, eps, ns_refine,
            normalize, whiten_eps)
    if impl == 'reference':
        grads = nystrom_attention_backward_reference(*args)
    else:
        grads = implementation(impl).nystrom_attention_backward(*args)
    return tuple(grad if ref is None else _in_layout_of(grad, ref)
                 for grad, ref in zip(grads, (q, k, v, landmarks)))


def _in_layout_of(t, ref):
    """t with the strides of ``torch.empty_like(ref)``, which the fake kernel declares.

    The fused kernels write each gradient in its operand's layout already (the module's
    head views, the pooled landmarks' channels-last view); other layouts pay a copy.
    """
    if t.stride() == ref.stride():
        return t
    out = torch.empty_like(ref)
    return t if out.stride() == t.stride() else out.copy_(t)


_LIBRARY.impl('nystrom_attention', nystrom_attention_kernel, 'CompositeExplicitAutograd')
_LIBRARY.impl('nystrom_attention_backward', nystrom_attention_backward_kernel,
              'CompositeExplicitAutograd')

#: The ops (OpOverloads): ``(out, context, inverse, stats)`` and ``(dq, dk, dv, dlandmarks)``
#: of the module docstring's contract.
nystrom_attention_op = torch.ops.lapformer_mm.nystrom_attention.default
nystrom_attention_backward_op = torch.ops.lapformer_mm.nystrom_attention_backward.default

#: op -> its Python implementation (devtools/op_counts.py looks inside with it).
PYTHON_KERNELS = {nystrom_attention_op: nystrom_attention_kernel,
                  nystrom_attention_backward_op: nystrom_attention_backward_kernel}


@torch.library.register_fake('lapformer_mm::nystrom_attention')
def _(q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine, normalize, whiten_eps,
      impl):
    _check_op_operands('nystrom_attention', q, k, v, landmarks)
    batch, heads, n, _ = q.shape
    m, dv = landmarks.shape[-2], v.shape[-1]
    acc = compute_dtype(q.dtype)
    rows = 2 if normalize == 'injective' else 0
    return (q.new_empty(batch, n, heads, dv), q.new_empty(batch, heads, m, dv, dtype=acc),
            q.new_empty(batch, heads, m, m, dtype=acc),
            q.new_empty(batch, heads, rows, m, dtype=acc))


@torch.library.register_fake('lapformer_mm::nystrom_attention_backward')
def _(grad, q, k, v, landmarks, context, inverse, stats, kernel, lam, eps, ns_refine, normalize,
      whiten_eps, impl):
    return (torch.empty_like(q), q.new_empty(0) if k is None else torch.empty_like(k),
            torch.empty_like(v), torch.empty_like(landmarks))


class NystromAttention(torch.autograd.Function):
    """Autograd of the op: the forward saves context, inverse and stats (non-differentiable
    outputs, no zero gradients made for them); the backward op recomputes the kernel rows
    from them (once differentiable). The op itself has no autograd kernel: differentiate
    through this Function (:func:`nystrom_attention_call`, :func:`nystrom_forward`)."""

    @staticmethod
    def forward(ctx, q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine, normalize,
                whiten_eps, impl):
        out, context, inverse, stats = nystrom_attention_op(
            q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine, normalize,
            whiten_eps, impl)
        ctx.save_for_backward(q, k, v, landmarks, context, inverse, stats)
        ctx.mark_non_differentiable(context, inverse, stats)
        ctx.set_materialize_grads(False)
        ctx.options = (kernel, lam, eps, ns_refine, normalize, whiten_eps, impl)
        return out, context, inverse, stats

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, grad_context, grad_inverse, grad_stats):
        if grad is None:
            return (None,) * 13
        q, k, v, landmarks, context, inverse, stats = ctx.saved_tensors
        dq, dk, dv, dl = nystrom_attention_backward_op(grad, q, k, v, landmarks, context,
                                                       inverse, stats, *ctx.options)
        return (dq, None if k is None else dk, dv, dl) + (None,) * 9


def nystrom_attention_call(q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine,
                           normalize, whiten_eps, impl):
    """The op's output (B, N, h, d_v) with autograd attached."""
    args = (q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine, normalize,
            whiten_eps, impl)
    if torch.jit.is_tracing():
        # A trace (the FLOP counter's) records the op itself; an autograd.Function would be
        # an opaque PythonOp node without its options.
        return nystrom_attention_op(*args)[0]
    if v is q or v is k:
        # torch.compile cannot trace a Function given one tensor twice; a view is another.
        args = args[:2] + (v.view(v.shape),) + args[3:]
    return NystromAttention.apply(*args)[0]


def nystrom_attention_flops(q_shape, v_shape, m, tied, iters, ns_refine):
    """{'kernel', 'solve', 'visible'} multiply-adds of one op call, q (B, h, N, d), v (..., d_v).

    The parts of the composite path's count, so a model counts the same either way:
    kernel: k(q, L), k(k, L) unless tied, k(L, L): (N·m·(1 or 2) + m²)·(d + 1);
    solve: Newton–Schulz, 2·m³·iters + m²; visible: C_kᵀ v and Z · context, 2·N·m·d_v,
    and the m × m by m × d_v products of the solve, three with ns_refine, else one.
    """
    batch = math.prod(q_shape[:-2])
    n, d = q_shape[-2], q_shape[-1]
    dv = v_shape[-1]
    kernel = (n * m * (1 if tied else 2) + m * m) * (d + 1)
    solve = 2 * m ** 3 * iters + m * m
    visible = 2 * n * m * dv + (3 if ns_refine else 1) * m * m * dv
    return {'kernel': batch * kernel, 'solve': batch * solve, 'visible': batch * visible}


# ----------------------------------------------------------------------------
# The composite path (dropout on Z, the 'exact' and 'cg' solvers): autograd through the
# primitive ops.
# ----------------------------------------------------------------------------

def solve_landmark_system(P, rhs, options, impl):
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
        inverse = newton_schulz(P, options.iters, options.ns_init, impl)
        return apply_inverse(inverse, P, rhs, options.ns_refine)
    if options.solver == 'exact':
        return exact_solve(P, rhs)
    return cg_solve(P, rhs, options.iters)


def landmark_matrix(landmarks, options, impl=None):
    """P = k(L, L) + eps·I (..., m, m) for landmarks L (..., m, d) and :class:`AttentionOptions`.

    ``impl=None`` decides from ``options.impl`` and the landmarks' device.
    """
    if impl is None:
        impl = resolve_impl(options.impl, landmarks.device)
    w = pairwise_kernel(landmarks, landmarks, options.lam, options.kernel, impl)
    return w + options.eps * torch.eye(w.shape[-1], dtype=w.dtype, device=w.device)


def nystrom_composite(q, k, v, landmarks, options, dropout_p=0.0):
    """The attention as separate primitive ops, (..., N, d_v); any solver, dropout on Z."""
    impl = resolve_impl(options.impl, q.device)
    out_dtype = q.dtype
    dtype = compute_dtype(q.dtype)
    shared = k is q
    with torch.autocast(device_type=q.device.type, enabled=False):
        q = q.to(dtype)
        k = q if shared else k.to(dtype)
        v, landmarks = v.to(dtype), landmarks.to(dtype)
        c_q = pairwise_kernel(q, landmarks, options.lam, options.kernel, impl)
        # With tied keys the two kernel matrices coincide; compute it once.
        c_k = c_q if shared else pairwise_kernel(k, landmarks, options.lam, options.kernel, impl)
        # Right to left: (m, d) products only, never N×N or N×m×d.
        context = solve_landmark_system(landmark_matrix(landmarks, options, impl),
                                        torch.matmul(c_k.mT, v), options, impl)
        z = whiten(c_q, options.whiten_eps) if options.normalize == 'injective' else c_q
        if dropout_p > 0:
            z = F.dropout(z, dropout_p, training=True)
        out = torch.matmul(z, context)
    return out.to(out_dtype)


# ----------------------------------------------------------------------------
# The public entry.
# ----------------------------------------------------------------------------

def nystrom_forward(q, k, v, landmarks, options, dropout_p=0.0):
    """The attention for modules that validated their options: (B, h, N, d_v).

    q, k (B, h, N, d) (``k is q`` when keys are tied), v (B, h, N, d_v), landmarks
    (B, h, m, d), any strides; ``options`` an :class:`AttentionOptions`. The result is a
    (B, h, N, d_v) view of the op's (B, N, h, d_v) output, so ``.transpose(1, 2)`` gives
    the token layout without a copy. Operands are checked once, in the op.
    """
    if exporting():
        return export_attention(q, k, v, landmarks, options, dropout_p)
    if dropout_p > 0 or not options.fused:
        check_attention_inputs(q, k, v, landmarks)
        return nystrom_composite(q, k, v, landmarks, options, dropout_p)
    impl = resolve_impl(options.impl, q.device)
    # The kernels read one element type: an odd operand follows q (under autocast all
    # four are the 16-bit outputs of one linear layer and nothing is cast).
    k = None if k is q else _like(k, q)
    out = nystrom_attention_call(
        q, k, _like(v, q), _like(landmarks, q), options.kernel, options.lam, options.eps,
        DEFAULT_NS_ITERS if options.iters is None else options.iters, options.ns_init,
        options.ns_refine, options.normalize, options.whiten_eps, impl)
    return out.transpose(1, 2)


def _like(t, q):
    return t if not isinstance(t, torch.Tensor) or t.dtype == q.dtype else t.to(q.dtype)


def nystrom_attention(q, k, v, landmarks, *, dropout_p=0.0, **options):
    """Z(k(q, L)) · (k(L, L) + eps·I)⁻¹ · (k(k, L)ᵀ · v), evaluated right to left.

    q, k (..., N, d), v (..., N, d_v), landmarks L (..., m, d) -> (..., N, d_v), at least
    one batch dim. Cost O(N·m·d + m²·d + m³·iters), memory O(N·m + N·d) (the fused
    implementations: O(N·d)).

    ``options`` are the fields of :class:`AttentionOptions` (kernel, lam, eps,
    solver, iters, ns_init, ns_refine, normalize, whiten_eps, impl).
    dropout_p: dropout on the normalised query features Z (attention dropout).
    The kernels, normalisation and solve run in fp32 (fp64 stays fp64) with
    autocast disabled; the result is cast back to q's dtype.
    """
    dropout_p = check_probability('dropout_p', dropout_p)
    options = AttentionOptions(**options)
    check_attention_inputs(q, k, v, landmarks)
    if q.dim() == 4:
        return nystrom_forward(q, k, v, landmarks, options, dropout_p)
    # The op is (B, h, N, d): fold the other batch dims into h.
    lead = q.shape[:-2]
    fold = [None if t is None else t.reshape(1, -1, *t.shape[-2:]) for t in (q, k, v, landmarks)]
    if k is q:
        fold[1] = fold[0]
    out = nystrom_forward(*fold, options, dropout_p)
    return out.reshape(*lead, *out.shape[-2:])
