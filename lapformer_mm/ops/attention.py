"""The Nyström attention: options, the registered op pair, autograd, the entry. Newton–Schulz
without dropout runs as the op on the backend :func:`select_backend` picks (else the reference);
dropout, the 'exact' and 'cg' solvers and exports run ``reference.forward`` under autograd.

Op contract (every backend keeps it): ``nystrom_attention(q, k, v, landmarks, kernel, lam, eps,
iters, ns_init, ns_refine, normalize, whiten_eps, impl) -> (out, context, inverse, stats)`` for
q (B, h, N, d), k like q or None (tied), v (B, h, N, d_v), landmarks (B, h, m, d), any strides,
one dtype and device: out (B, N, h, d_v), contiguous, q's dtype, = Z · context[:m] + context[m];
context (B, h, m + 1, d_v) = [P⁻¹ k(k, L)ᵀ (v − v̄) / N; v̄]; inverse (B, h, m, m) the
Newton–Schulz X; stats (B, h, 3, m) = μ, s of the whitening and c̄ = colmean(k(k, L)) (c̄ alone
for 'none'); the three saved for the backward, fp32 (fp64 for fp64 inputs).
``nystrom_attention_backward(grad (B, N, h, d_v) any strides, q, k, v, landmarks, context,
inverse, stats, kernel, lam, eps, ns_refine, normalize, whiten_eps, impl) -> (dq, dk (empty when
k is None), dv, dlandmarks)``, each in its operand's dtype.
"""
import dataclasses
import functools
import os
import warnings
from typing import Optional

import torch

from . import _checks, reference
from .backends import cpu, cuda
from .export import ExportForm, OrtNodes, check_exportable, exporting

BACKENDS = {cuda.NAME: cuda, cpu.NAME: cpu}
IMPLS = ('reference',) + tuple(BACKENDS)
ENV_VAR = 'LAPFORMER_OPS'


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Validated options of the Nyström attention, checked once when built (docs/attention.md).
    ``impl=None`` reads ``LAPFORMER_OPS`` here, once; unset, :func:`select_backend` picks."""
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
        impl = self.impl if self.impl is not None else os.environ.get(ENV_VAR) or None
        name = 'impl' if self.impl is not None else f'environment variable {ENV_VAR}'
        checked = dict(
            kernel=_checks.check_choice('kernel', self.kernel, _checks.KERNELS),
            lam=_checks.check_positive('lam', self.lam),
            eps=_checks.check_non_negative('eps', self.eps),
            solver=_checks.check_choice('solver', self.solver, _checks.SOLVERS),
            iters=None if self.iters is None else _checks.check_int('iters', self.iters),
            ns_init=_checks.check_choice('ns_init', self.ns_init, _checks.NS_INITS),
            ns_refine=_checks.check_bool('ns_refine', self.ns_refine),
            normalize=_checks.check_choice('normalize', self.normalize, _checks.NORMALIZATIONS),
            whiten_eps=_checks.check_non_negative('whiten_eps', self.whiten_eps),
            impl=None if impl is None else _checks.check_choice(name, impl, IMPLS))
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        newton_default = self.iters is None and self.solver == 'newton'
        iters = reference.DEFAULT_NS_ITERS if newton_default else self.iters
        # What the op and the backends read (derived: not a field, not compared or printed).
        object.__setattr__(self, 'op_options', reference.OpOptions(
            self.kernel, self.lam, self.eps, iters, self.ns_init, self.ns_refine,
            self.normalize, self.whiten_eps))


@functools.lru_cache(maxsize=None)  # once per backend and reasons
def _warn_fallback(name, reasons):
    warnings.warn(f'lapformer_mm: the {name!r} attention backend does not support this call '
                  f'({"; ".join(reasons)}); running the PyTorch reference', RuntimeWarning,
                  stacklevel=4)


def load_backends():
    """Load the CPU kernels now (a first load inside a ``torch.compile`` trace breaks it)."""
    cpu.load()


def select_backend(q, k, v, landmarks, options):
    """The backend that runs this call, or None for the reference (docs/attention.md)."""
    impl = options.impl
    if impl == 'reference':
        return None
    device = q.device.type
    for backend in (BACKENDS[impl],) if impl else BACKENDS.values():
        if impl is None and (backend.DEVICE != device or not backend.available()):
            continue
        if backend.DEVICE != device:
            reasons = (f'it runs on {backend.DEVICE} tensors, got tensors on {device}',)
        elif not backend.available():
            why = getattr(backend, 'unavailable_reason', lambda: backend.INSTALL_HINT)()
            reasons = (f'it is not usable here ({why})',)
        else:
            reasons = tuple(backend.not_supported(q, k, v, landmarks, options.op_options))
        if not reasons:
            return backend
        if impl:
            raise RuntimeError(f'impl={impl!r} cannot run this call: {"; ".join(reasons)}; use '
                               f"impl='reference' or None, or unset {ENV_VAR}")
        _warn_fallback(backend.NAME, reasons)
    return None


def one_projection(device):
    """Whether q, k, v on ``device`` come as views of one product (the CUDA kernels' read)."""
    return device.type == cuda.DEVICE


def resolve_impl(q, k, v, landmarks, options):
    """The name of the implementation that runs this call."""
    backend = select_backend(q, None if k is q else k, v, landmarks, options)
    return 'reference' if backend is None else backend.NAME


# define/impl with an autograd.Function outside: the cheapest autograd per call (docs/cuda.md).
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


def _forward_impl(q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine, normalize,
                  whiten_eps, impl):
    opts = reference.OpOptions(kernel, lam, eps, iters, ns_init, ns_refine, normalize,
                               whiten_eps)
    if impl == 'reference':
        out, context, inverse, stats = reference.forward(q, k, v, landmarks, opts)
        return out.transpose(1, 2).contiguous(), context, inverse, stats
    return BACKENDS[impl].forward(q, k, v, landmarks, opts)


def _backward_impl(grad, q, k, v, landmarks, context, inverse, stats, kernel, lam, eps,
                   ns_refine, normalize, whiten_eps, impl):
    # The backward reuses the forward's inverse: it takes no iteration count or start.
    opts = reference.OpOptions(kernel, lam, eps, 0, 'identity', ns_refine, normalize,
                               whiten_eps)
    if impl == 'reference':
        grads = reference.backward(grad.transpose(1, 2), q, k, v, landmarks, context, inverse,
                                   stats, opts)
    else:
        grads = BACKENDS[impl].backward(grad, q, k, v, landmarks, context, inverse, stats, opts)
    return tuple(g if ref is None else _in_layout_of(g, ref)
                 for g, ref in zip(grads, (q, k, v, landmarks)))


def _in_layout_of(t, ref):
    """t with the strides of ``torch.empty_like(ref)``, which the fake kernel declares."""
    if t.stride() == ref.stride():
        return t
    out = torch.empty_like(ref)
    return t if out.stride() == t.stride() else out.copy_(t)


_LIBRARY.impl('nystrom_attention', _forward_impl, 'CompositeExplicitAutograd')
_LIBRARY.impl('nystrom_attention_backward', _backward_impl, 'CompositeExplicitAutograd')

nystrom_attention_op = torch.ops.lapformer_mm.nystrom_attention.default
nystrom_attention_backward_op = torch.ops.lapformer_mm.nystrom_attention_backward.default

#: op -> its Python implementation (devtools/op_counts.py looks inside with it).
PYTHON_KERNELS = {nystrom_attention_op: _forward_impl,
                  nystrom_attention_backward_op: _backward_impl}


@torch.library.register_fake('lapformer_mm::nystrom_attention')
def _(q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine, normalize, whiten_eps,
      impl):
    batch, heads, n, _ = q.shape
    m, dv = landmarks.shape[-2], v.shape[-1]
    acc = reference.compute_dtype(q.dtype)
    rows = 3 if normalize == 'injective' else 1
    return (q.new_empty(batch, n, heads, dv), q.new_empty(batch, heads, m + 1, dv, dtype=acc),
            q.new_empty(batch, heads, m, m, dtype=acc),
            q.new_empty(batch, heads, rows, m, dtype=acc))


@torch.library.register_fake('lapformer_mm::nystrom_attention_backward')
def _(grad, q, k, v, landmarks, context, inverse, stats, kernel, lam, eps, ns_refine, normalize,
      whiten_eps, impl):
    return (torch.empty_like(q), q.new_empty(0) if k is None else torch.empty_like(k),
            torch.empty_like(v), torch.empty_like(landmarks))


class NystromAttentionFunction(torch.autograd.Function):
    """Autograd of the op; the backward recomputes the kernel rows."""

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


def nystrom_attention(q, k, v, landmarks=None, options=None, *, hw=None, landmark_grid=7,
                      dropout_p=0.0, export=None, **kwargs):
    """Z(k(q, L)) · (k(L, L) + eps·I)⁻¹ · k(k, L)ᵀ (v − v̄) / N + v̄ (docs/design.md §2.6) for q,
    k (..., N, d) (k None or q: tied), v (..., N, d_v) -> (..., N, d_v) in q's dtype, landmarks
    (..., m, d) or ``hw`` = (H, W) to pool them from the keys; options: an
    :class:`AttentionOptions` or its fields as keywords; export: an :class:`~.export.ExportForm`."""
    if options is None:
        options = AttentionOptions(**kwargs)
    elif kwargs:  # they would be ignored
        raise TypeError(f'nystrom_attention: give options or its fields as keywords, got both '
                        f'({sorted(kwargs)})')
    if (landmarks is None) == (hw is None):  # both: which would win?
        raise TypeError('nystrom_attention: give either the landmarks (..., m, d) or hw = '
                        '(H, W), to pool them from the keys')
    k = q if k is None else k
    export = (ExportForm() if exporting() else None) if export is None else export
    # Shapes the math would broadcast, devices a kernel would read as its own (not while
    # exporting: the sizes are symbols or a trace's tensors).
    if export is None and (
            k.shape != q.shape or v.shape[:-1] != q.shape[:-1] or landmarks is not None and (
                landmarks.shape[:-2] != q.shape[:-2] or landmarks.shape[-1] != q.shape[-1])
            or len({t.device for t in (q, k, v, landmarks) if t is not None}) > 1):
        raise ValueError(
            'nystrom_attention: q, k (..., N, d), v (..., N, d_v) and landmarks (..., m, d) '
            f'must agree and share a device, got q {tuple(q.shape)}, k {tuple(k.shape)}, v '
            f'{tuple(v.shape)}, landmarks {None if landmarks is None else tuple(landmarks.shape)}')
    if hw is not None:
        landmarks = reference.pool_landmarks(k, hw, landmark_grid, export is not None)
    if q.dim() == 4:
        return _attention(q, k, v, landmarks, options, dropout_p, export)
    # The op is (B, h, N, d): fold the other batch dims into h.
    fold = [t.reshape(1, -1, *t.shape[-2:]) for t in (q, k, v, landmarks)]
    fold[1] = fold[0] if k is q else fold[1]
    out = _attention(*fold, options, dropout_p, export)
    return out.reshape(*q.shape[:-2], *out.shape[-2:])


def _attention(q, k, v, landmarks, options, dropout_p, export):
    tied = k is q
    if export is not None:
        check_exportable(options)
        if export.ort and q.dtype == torch.float32:  # the op library's type
            return cpu.forward(q, None if tied else k, v, landmarks, options.op_options,
                               OrtNodes, export.residual_dtype)[0].transpose(1, 2)
    if export is not None or dropout_p > 0 or options.solver != 'newton':
        # The reference under autograd; an exported graph has no dropout.
        return reference.forward(q, None if tied else k, v, landmarks, options.op_options,
                                 options.solver, 0.0 if export else dropout_p, export)[0]
    # The backends read one element type: an odd operand follows q.
    k, v, landmarks = (None if tied else k.to(q.dtype)), v.to(q.dtype), landmarks.to(q.dtype)
    backend = select_backend(q, k, v, landmarks, options)
    # Without a backend the op runs the reference: its closed-form backward is every backend's.
    args = (q, k, v, landmarks, *options.op_options,
            'reference' if backend is None else backend.NAME)
    if torch.jit.is_tracing():
        # A trace (the FLOP counter's) records the op itself, with its options.
        return nystrom_attention_op(*args)[0].transpose(1, 2)
    if v is q or v is k:
        # torch.compile cannot trace a Function given one tensor twice; a view is another.
        args = args[:2] + (v.view(v.shape),) + args[3:]
    return NystromAttentionFunction.apply(*args)[0].transpose(1, 2)
