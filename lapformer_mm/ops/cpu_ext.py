"""The C++ CPU kernels (``lapformer_mm/csrc``) behind the registered ops, for CPU tensors.

``setup.py`` builds one extension module per at::vec instruction set
(``lapformer_mm._cpu_default``, ``_cpu_avx2``, ``_cpu_avx512``); the one named by
``torch.backends.cpu.get_cpu_capability()`` is loaded (so ``ATEN_CPU_CAPABILITY=default``
selects the portable build), or the best one below it that was built. The environment
variable ``LAPFORMER_CPU_EXT=0`` disables the extension; when it was not built (no
compiler at install time) :func:`available` says so once, in a warning, and the ops run the
PyTorch reference.

Functions (called by the ops after they checked their operands):

* :func:`pairwise_forward`, :func:`pairwise_backward`: the kernel matrix of x (batch, N, d)
  and y (batch, M, d) and its gradient, like :mod:`.cupy_ops`;
* :func:`nystrom_attention_forward`, :func:`nystrom_attention_backward`: the fused
  attention of ``lapformer_mm::nystrom_attention`` (contract in :mod:`.nystrom`).

The attention reads q, k, v and the landmarks in the layout and dtype they come in (the
strided views of the qkv projection, 16-bit under autocast): the kernel matrices are formed
row by row in C++ and consumed there, the whitening statistics come from the same pass, and
the result is written in the (B, N, h, d_v) token layout.
"""
import functools
import importlib.util
import os
import warnings

import torch

from .normalize import whitening_scale
from .nystrom import apply_inverse
from .solvers import newton_schulz_iterate

ENV_VAR = 'LAPFORMER_CPU_EXT'
KINDS = {'laplacian': 0, 'gaussian': 1}

# torch.backends.cpu.get_cpu_capability() -> the builds that may run there, best first.
_BUILDS = {'AVX512': ('avx512', 'avx2', 'default'), 'AVX2': ('avx2', 'default')}


def disabled():
    """True when ``LAPFORMER_CPU_EXT=0`` asks for the PyTorch reference."""
    return os.environ.get(ENV_VAR, '1') == '0'


@functools.lru_cache(maxsize=1)
def _load():
    """(the ops namespace of the loaded build, its name) or (None, the reason)."""
    capability = torch.backends.cpu.get_cpu_capability()
    tried = []
    for build in _BUILDS.get(capability, ('default',)):
        spec = importlib.util.find_spec(f'lapformer_mm._cpu_{build}')
        if spec is None or spec.origin is None:
            tried.append(build)
            continue
        try:
            torch.ops.load_library(spec.origin)
        except OSError as err:
            return None, f'lapformer_mm._cpu_{build} does not load: {err}'
        return getattr(torch.ops, f'lapformer_mm_cpu_{build}'), build
    return None, (f'no build of the CPU kernels is installed (looked for '
                  f'{", ".join(f"lapformer_mm._cpu_{b}" for b in tried)}; '
                  f'reinstall with a C++ compiler: pip install --no-build-isolation -e .)')


@functools.lru_cache(maxsize=1)
def _warn_missing(reason):
    warnings.warn(f'lapformer_mm: the C++ CPU kernels are not available ({reason}); the '
                  f'attention runs the slower PyTorch reference on the CPU', RuntimeWarning,
                  stacklevel=3)


def available():
    """Whether the extension is loaded and not disabled; warns once when it is missing."""
    if disabled():
        return False
    ops, detail = _load()
    if ops is None:
        _warn_missing(detail)
    return ops is not None


def build():
    """The loaded build ('avx512', 'avx2', 'default') or None."""
    ops, detail = _load()
    return detail if ops is not None else None


def _ops():
    ops, detail = _load()
    if ops is None:
        raise RuntimeError(f'lapformer_mm: the C++ CPU kernels are not available ({detail})')
    return ops


# ----------------------------------------------------------------------------
# The kernel matrix and its gradient, (batch, n, d) operands.
# ----------------------------------------------------------------------------

def pairwise_forward(x3, y3, lam, kind):
    """K (batch, N, M) of x3 (batch, N, d) and y3 (batch, M, d), in x3's dtype."""
    kmat = _ops().pairwise_forward(x3.unsqueeze(1), y3.unsqueeze(1), lam, KINDS[kind])
    return kmat.squeeze(1).to(x3.dtype)


def pairwise_backward(grad, kmat, x3, y3, lam, kind, need_x, need_y):
    """(dx, dy) in the operands' dtypes for K = kmat and its gradient grad; empty if not needed."""
    dx, dy = _ops().pairwise_backward(grad.unsqueeze(1), kmat.unsqueeze(1), x3.unsqueeze(1),
                                      y3.unsqueeze(1), lam, KINDS[kind], need_x, need_y)
    return (dx.squeeze(1).to(x3.dtype) if need_x else x3.new_empty(0),
            dy.squeeze(1).to(y3.dtype) if need_y else y3.new_empty(0))


# ----------------------------------------------------------------------------
# The fused attention (lapformer_mm::nystrom_attention).
# ----------------------------------------------------------------------------

def _landmark_system(ops, landmarks, lam, kind, eps):
    """(k(L, L), P = k(L, L) + eps·I), (B, h, m, m) in the compute dtype."""
    w = ops.pairwise_forward(landmarks, landmarks, lam, kind)
    return w, w + eps * torch.eye(w.shape[-1], dtype=w.dtype)


def nystrom_attention_forward(*args):
    """(out (B, N, h, d_v) in q's dtype, context, inverse, stats) of the op's contract.

    Per (b, h): one pass over the rows of k (tied: q) forms k(k, L) and R = k(k, L)ᵀ v; with
    separate keys a second pass over q forms k(q, L). The query pass also accumulates the
    whitening statistics and keeps k(q, L) for the output, out = k(q, L) A + 1 bᵀ with
    A = (I − J/m) diag(s) context and b = colsum(context) / m (the whitening folded in).
    """
    # The m x m and m x d_v algebra stays in the compute dtype under autocast.
    with torch.autocast(device_type='cpu', enabled=False):
        return _attention_forward(*args)


def _attention_forward(q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine,
                       normalize, whiten_eps):
    ops = _ops()
    kind = KINDS[kernel]
    injective = normalize == 'injective'
    m = landmarks.shape[-2]
    _, P = _landmark_system(ops, landmarks, lam, kind, eps)
    inverse = newton_schulz_iterate(P.reshape(-1, m, m), iters, ns_init).view(P.shape)
    if k is None:
        rhs, raw, rows = ops.attention_rows_forward(q, landmarks, v, lam, kind, injective, True)
    else:
        rhs, _, _ = ops.attention_rows_forward(k, landmarks, v, lam, kind, False, False)
        _, raw, rows = ops.attention_rows_forward(q, landmarks, None, lam, kind, injective, True)
    context = apply_inverse(inverse, P, rhs, ns_refine)
    if injective:
        mean, scale = raw[:, :, :1], whitening_scale(raw[:, :, 1:], whiten_eps)
        stats = torch.cat((mean, scale), dim=2)
        scaled = scale.mT * context
        folded = scaled - scaled.mean(-2, keepdim=True)
        bias = context.sum(-2, keepdim=True) / m
    else:
        stats = context.new_empty(*context.shape[:2], 0, m)
        folded, bias = context, context.new_zeros(*context.shape[:2], 1, context.shape[-1])
    out = ops.attention_rows_apply(rows, folded, bias, q.dtype)
    return out, context, inverse, stats


def nystrom_attention_backward(*args):
    """(dq, dk, dv, dlandmarks) of the op's contract; dk is empty when k is None.

    A first pass over q recomputes C_q = k(q, L) and sums T = c̃ᵀ G and colsum(G); the
    m × d_v algebra in between gives dcontext, a and dR = P⁻¹ dcontext; a second pass forms
    each row's dC_q (and, with tied keys, dC_k = v dRᵀ and dv = C_k dR) and the kernel
    gradient of q and L from it; separate keys take a third pass over k.
    """
    with torch.autocast(device_type='cpu', enabled=False):
        return _attention_backward(*args)


def _attention_backward(grad, q, k, v, landmarks, context, inverse, stats, kernel, lam, eps,
                        ns_refine, normalize, whiten_eps):
    ops = _ops()
    kind = KINDS[kernel]
    injective = normalize == 'injective'
    g = grad.transpose(1, 2)
    n, m = q.shape[-2], landmarks.shape[-2]
    t, gsum, rows = ops.attention_grad_sums(q, landmarks, g, lam, kind, injective)
    if injective:
        mean, scale = stats[:, :, :1].contiguous(), stats[:, :, 1:]
        d_context = scale.mT * t + gsum / m
        a = (scale * scale * scale * (t * context).sum(-1).unsqueeze(-2) / n).contiguous()
        scaled = scale.mT * context
    else:
        mean = a = None
        d_context, scaled = t, context
    w, P = _landmark_system(ops, landmarks, lam, kind, eps)
    d_rhs = apply_inverse(inverse, P, d_context, ns_refine)
    if k is None:
        dq, dl, dv = ops.attention_rows_backward(q, landmarks, rows, g, scaled, a, mean, v,
                                                 d_rhs, True, lam, kind, injective)
        dk = q.new_empty(0)
    else:
        dq, dl, _ = ops.attention_rows_backward(q, landmarks, rows, g, scaled, a, mean, None,
                                                None, False, lam, kind, injective)
        dk, dl_k, dv = ops.attention_rows_backward(k, landmarks, None, None, None, None, None,
                                                   v, d_rhs, True, lam, kind, injective)
        dl = dl + dl_k
        dk = dk.transpose(1, 2)
    # P = k(L, L) + eps·I: L is both operands.
    d_p = -torch.matmul(d_rhs, context.mT)
    dlx, dly = ops.pairwise_backward(d_p, w, landmarks, landmarks, lam, kind, True, True)
    dl = dl + dlx + dly
    return dq.transpose(1, 2), dk, dv.transpose(1, 2), dl.to(landmarks.dtype)
