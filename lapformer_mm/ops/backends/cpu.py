"""The C++ CPU kernels (``ops/cpu``, one ``lapformer_mm._cpu_<build>`` per at::vec instruction
set; the best this CPU runs is loaded) as the op's 'cpu' backend: kernel rows in C++, the m × m
steps the reference's. ``LAPFORMER_CPU_EXT=0`` disables it; without a build the op warns once."""
import importlib.util
import os
import warnings

import torch

from .. import reference

NAME = 'cpu'
DEVICE = 'cpu'
ENV_VAR = 'LAPFORMER_CPU_EXT'
#: What makes the backend usable where it is not.
INSTALL_HINT = 'reinstall with a C++ compiler: pip install --no-build-isolation -e .'
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# torch.backends.cpu.get_cpu_capability() -> the builds that may run there, best first.
_BUILDS = {'AVX512': ('avx512', 'avx2', 'default'), 'AVX2': ('avx2', 'default')}

# Filled once (load(), disabled()); plain globals, which a compiled graph reads as constants.
_LOADED, _DISABLED, _WARNED = [], [], []


def load():
    """(the ops namespace of the best build this CPU runs, its name), or (None, why none
    loaded); loads once, warns nothing."""
    if not _LOADED:
        _LOADED.append(_load())
    return _LOADED[0]


def _load():
    builds = _BUILDS.get(torch.backends.cpu.get_cpu_capability(), ('default',))
    for build in builds:
        spec = importlib.util.find_spec(f'lapformer_mm._cpu_{build}')
        if spec is not None and spec.origin is not None:
            try:
                torch.ops.load_library(spec.origin)
            except OSError as err:
                return None, f'lapformer_mm._cpu_{build} does not load: {err}'
            return getattr(torch.ops, f'lapformer_mm_cpu_{build}'), build
    return None, (f'no build of the CPU kernels is installed (looked for '
                  f'{", ".join(f"lapformer_mm._cpu_{b}" for b in builds)}; {INSTALL_HINT})')


def disabled():
    """True when ``LAPFORMER_CPU_EXT=0`` asks for the PyTorch reference (read once)."""
    if not _DISABLED:
        _DISABLED.append(os.environ.get(ENV_VAR, '1') == '0')
    return _DISABLED[0]


def available():
    """Whether a build is loaded and the backend not disabled; warns once when none is built
    (at the first attention that would run it)."""
    if disabled():
        return False
    ops, detail = load()
    if ops is None and not _WARNED:
        _WARNED.append(True)
        warnings.warn(f'lapformer_mm: the C++ CPU kernels are not available ({detail}); '
                      f'the attention runs the slower PyTorch reference on the CPU',
                      RuntimeWarning, stacklevel=4)
    return ops is not None


def build():
    """The loaded build ('avx512', 'avx2', 'default') or None."""
    ops, name = load()
    return None if ops is None else name


def _ops():
    ops, detail = load()
    if ops is None:
        raise RuntimeError(f'lapformer_mm: the C++ CPU kernels are not available ({detail})')
    return ops


def not_supported(q, k, v, landmarks, opts):
    """Why the kernels cannot run this call (empty: they can); the operands share q's dtype."""
    if q.dtype not in DTYPES:
        return [f'dtype {q.dtype} (supported: {", ".join(map(str, DTYPES))})']
    return []


def _landmark_system(ops, landmarks, opts):
    """(k(L, L), P = k(L, L) + eps·I), (B, h, m, m) in the compute dtype."""
    w = ops.pairwise_forward(landmarks, landmarks, opts.lam, reference.KERNEL_CODES[opts.kernel])
    return w, w + opts.eps * torch.eye(w.shape[-1], dtype=w.dtype)


def forward(q, k, v, landmarks, opts, ops=None, residual=torch.float64):
    """(out (B, N, h, d_v), context, inverse, stats) of the op's contract; ``ops``: the kernels
    (None: this build's) or the ONNX Runtime op library's nodes of the same signatures
    (``export.OrtNodes``), which an export composes so, refining in ``residual``. A pass over
    k forms R = k(k, L)ᵀ (v − v̄) / N, v̄ and c̄; the query pass (the same one when tied) sums the
    whitening statistics, folded in as out = k(q, L) (I − J/m) diag(s) context + 1 bᵀ."""
    ops, kind = ops or _ops(), reference.KERNEL_CODES[opts.kernel]
    injective = opts.normalize == 'injective'
    with torch.autocast(device_type='cpu', enabled=False):
        _, P = _landmark_system(ops, landmarks, opts)
        if k is None:
            sums, raw, rows = ops.attention_rows_forward(q, landmarks, v, opts.lam, kind,
                                                         injective, True)
            key_mean = raw[:, :, -1:]
        else:
            sums, key_mean, _ = ops.attention_rows_forward(k, landmarks, v, opts.lam, kind,
                                                           False, False)
            _, raw, rows = ops.attention_rows_forward(q, landmarks, None, opts.lam, kind,
                                                      injective, True)
        m = landmarks.shape[-2]
        mean_v = sums[:, :, m:]
        context, inverse = reference.solve_context(P, sums[:, :, :m], opts, residual)
        if injective:
            mean = raw[:, :, :1]
            scale = reference.whitening_scale(raw[:, :, 1:2], opts.whiten_eps)
            stats = torch.cat((mean, scale, key_mean), dim=2)
            # transpose, not .mT: the TorchScript exporter has no aten::mT.
            scaled = scale.transpose(-1, -2) * context
            folded = scaled - scaled.mean(-2, keepdim=True)
            bias = context.sum(-2, keepdim=True) / m + mean_v
        else:
            stats = key_mean
            folded, bias = context, mean_v
        out = ops.attention_rows_apply(rows, folded, bias, injective, q.dtype)
    return out, torch.cat((context, mean_v), dim=2), inverse, stats


def backward(grad, q, k, v, landmarks, context, inverse, stats, opts):
    """(dq, dk, dv, dlandmarks) of the op's contract; dk is empty when k is None. A pass over
    q sums T = c̃ᵀ G and colsum(G); after the reference's m × d_v algebra a second forms each
    row's dC_q (tied: also dC_k and dv) and the gradients of q and L; separate keys a third."""
    ops, kind = _ops(), reference.KERNEL_CODES[opts.kernel]
    injective = opts.normalize == 'injective'
    g = grad.transpose(1, 2)
    with torch.autocast(device_type='cpu', enabled=False):
        t, gsum, rows = ops.attention_grad_sums(q, landmarks, g, opts.lam, kind, injective)
        m, n = landmarks.shape[-2], q.shape[-2]
        context, mean_v = context[:, :, :m], context[:, :, m:]
        d_context, a, scaled = reference.context_grads(t, gsum, context, stats, n,
                                                       opts.normalize)
        mean = stats[:, :, :1].contiguous() if injective else None
        a = a.contiguous() if injective else None
        w, P = _landmark_system(ops, landmarks, opts)
        d_rhs, d_p = reference.solve_grads(inverse, P, d_context, context, opts.ns_refine)
        # dR̃, then the row w that every row of dv gains.
        d_rhs = torch.cat(reference.value_grads(d_rhs, gsum, stats[:, :, -1:], n), dim=2)
        if k is None:
            dq, dl, dv = ops.attention_rows_backward(q, landmarks, rows, g, scaled, a, mean, v,
                                                     mean_v, d_rhs, True, opts.lam, kind,
                                                     injective)
            dk = q.new_empty(0)
        else:
            dq, dl, _ = ops.attention_rows_backward(q, landmarks, rows, g, scaled, a, mean, None,
                                                    None, None, False, opts.lam, kind, injective)
            dk, dl_k, dv = ops.attention_rows_backward(k, landmarks, None, None, None, None,
                                                       None, v, mean_v, d_rhs, True, opts.lam,
                                                       kind, injective)
            dl = dl + dl_k
            dk = dk.transpose(1, 2)
        # P = k(L, L) + eps·I: L is both operands.
        dlx, dly = ops.pairwise_backward(d_p, w, landmarks, landmarks, opts.lam, kind, True, True)
        dl = dl + dlx + dly
    return dq.transpose(1, 2), dk, dv.transpose(1, 2), dl.to(landmarks.dtype)
