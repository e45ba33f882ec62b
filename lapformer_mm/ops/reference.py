"""The attention's math in plain PyTorch (docs/design.md §2), the ground truth on every device and
the stages the backends share, in the order it runs: 1. landmarks, 2. the similarity k(x, y) =
exp(-dist / λ), 3. P = k(L, L) + εI, 4. context = P⁻¹ k(k, L)ᵀ (v − v̄) / N, 5. Z = c̃ diag(s) + 1/m,
6. out = Z · context + v̄, 7. the closed-form backward; then the exporters' forms of ``cdist`` and
adaptive pooling. All in fp32 (fp64 stays fp64). A leaf: it imports torch and the checks."""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._checks import KERNELS, check_int

#: A kernel's code in the compiled kernels (KIND template argument, ONNX attribute).
KERNEL_CODES = {name: code for code, name in enumerate(KERNELS)}


class OpOptions(NamedTuple):
    """The options the op and its backends read (validated by ``AttentionOptions``)."""
    kernel: str
    lam: float
    eps: float
    iters: int
    ns_init: str
    ns_refine: bool
    normalize: str
    whiten_eps: float


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# 1. Landmarks ------------------------------------------------------------------------------------
def pool_landmarks(t, hw, grid=7, export=False):
    """t (B, h, N, d) averaged on a min(grid, H) × min(grid, W) grid -> (B, h, m, d), row-major."""
    batch, heads, _, width = t.shape
    if export:
        return pool_landmarks_export(t, hw, grid)
    # Through the (B, H, W, h·d) token view: a reshape straight to (B, h·d, H, W) may give a
    # batch of one an odd stride, which makes aten pool a contiguous copy instead.
    maps = t.transpose(1, 2).reshape(batch, *hw, heads * width).permute(0, 3, 1, 2)
    pooled = F.adaptive_avg_pool2d(maps, (min(grid, hw[0]), min(grid, hw[1])))
    return pooled.permute(0, 2, 3, 1).reshape(batch, -1, heads, width).transpose(1, 2)


# 2. Similarity: the kernel function k(x, y) and its gradient -------------------------------------
#: Rows of b per ``_cdist_backward`` call, which rereads b per row of a: cache-sized (docs/cpu.md).
NATIVE_BLOCK_ROWS = 512


def _l1_grad_native(g, a3, b3):
    """sum_j g[:, i, j] · sign(a_i - b_j) by ``aten._cdist_backward`` (CPU)."""
    grad = None
    for start in range(0, b3.shape[1], NATIVE_BLOCK_ROWS):
        g_block = g[:, :, start:start + NATIVE_BLOCK_ROWS].contiguous()
        part = torch.ops.aten._cdist_backward(
            g_block, a3.contiguous(), b3[:, start:start + NATIVE_BLOCK_ROWS].contiguous(),
            1.0, g_block)
        grad = part if grad is None else grad.add_(part)
    return grad


def _l1_grad_chunked(g, a3, b3, chunk_bytes=32 * 2 ** 20):
    """The same in chunks of a's rows of ``chunk_bytes`` (CUDA's op allocates (N, M, d))."""
    batch, num_a, width = a3.shape
    per_row = batch * b3.shape[1] * width * a3.element_size()
    rows = max(1, chunk_bytes // max(per_row, 1))
    grad = torch.empty_like(a3)
    for start in range(0, num_a, rows):
        sign = torch.sign(a3[:, start:start + rows, None, :] - b3[:, None, :, :])
        grad[:, start:start + rows] = torch.einsum('bij,bijd->bid', g[:, start:start + rows], sign)
    return grad


def _as3(t):
    return t.reshape(-1, t.shape[-2], t.shape[-1])


class _Similarity(torch.autograd.Function):
    """k(x, y) with the gradient of :func:`similarity_grads`: no (..., N, M, d) tensor."""

    @staticmethod
    def forward(ctx, x, y, lam, kernel):
        kmat = similarity(x, y, lam, kernel)
        ctx.save_for_backward(x, y, kmat)
        ctx.options = (lam, kernel)
        return kmat

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, y, kmat = ctx.saved_tensors
        return (*similarity_grads(grad * kmat, x, y, *ctx.options, ctx.needs_input_grad[:2]),
                None, None)


def similarity_grads(w, x, y, lam, kernel, needs=(True, True)):
    """(dx, dy) of Σ_ij g_ij k(x_i, y_j) given w = g ⊙ k(x, y) (None where not ``needs``):
    dk/d dist = -k / lam, d|t|/dt = sign(t) (0 at t = 0), d t²/dt = 2t."""
    def grad(w, rows, red):
        if kernel == 'gaussian':
            return (w.sum(-1, keepdim=True) * rows - torch.bmm(w, red)).mul_(-2.0 / lam)
        native = rows.device.type == 'cpu' and w.numel() > 0
        return (_l1_grad_native if native else _l1_grad_chunked)(w, rows, red).mul_(-1.0 / lam)
    w3, x3, y3 = _as3(w), _as3(x), _as3(y)
    return (grad(w3, x3, y3).view(x.shape) if needs[0] else None,
            grad(w3.mT, y3, x3).view(y.shape) if needs[1] else None)


def similarity(x, y, lam, kernel):
    """exp(-dist(x_i, y_j) / lam) (..., N, M). The squared ℓ2 comes from coordinate
    differences: |x|² + |y|² − 2x·y cancels in fp32."""
    # A jit trace (the FLOP counter's) must see aten::cdist, not an opaque Function.
    if (torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
            and not torch.jit.is_tracing()):
        return _Similarity.apply(x, y, lam, kernel)
    if kernel == 'laplacian':
        dist = torch.cdist(x, y, p=1.0)
    else:
        dist = torch.cdist(x, y, p=2.0, compute_mode='donot_use_mm_for_euclid_dist').square_()
    return dist.mul_(-1.0 / lam).exp_()


# 3–4. The landmark system and its solve ----------------------------------------------------------
def landmark_system(landmarks, lam, eps, kernel, export=False):
    """P = k(L, L) + eps·I (..., m, m); exports take all m landmarks in one step."""
    w = (similarity_export(landmarks, landmarks, lam, kernel, chunk=None) if export
         else similarity(landmarks, landmarks, lam, kernel))
    return w + eps * torch.eye(w.shape[-1], dtype=w.dtype, device=w.device)


#: Newton–Schulz iterations used when ``iters=None``: enough for the worst case ε = 0.01
#: allows, identical landmarks (cond 4901 at m = 49), to reach 1e-3 (docs/design.md §2.5).
DEFAULT_NS_ITERS = 16


def newton_schulz(P, iters, init):
    """X ≈ P⁻¹ for SPD P (..., m, m): X_{t+1} = 2 X_t − X_t P X_t from X₀ = I / ||P||_inf
    ('identity': every eigenvalue of P X₀ in (0, 1]) or 1.8 / ||P||_inf² · P ('authors', the
    LaplacianFormer code's start). fp64 on CUDA, where fp32 matmuls may be TF32 (~1e-3)."""
    p = _as3(P.double() if P.is_cuda else P)
    norm = p.abs().sum(-1).amax(-1).view(-1, 1, 1)
    if init == 'identity':
        x = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device) / norm
    else:
        x = p * (1.8 / (norm * norm))
    x = x.expand_as(p).contiguous()
    for _ in range(iters):
        x = torch.baddbmm(x, x, torch.bmm(p, x), beta=2.0, alpha=-1.0)
    return x.view(P.shape).to(P.dtype)


def apply_inverse(inverse, P, rhs, ns_refine, residual=torch.float64):
    """X rhs, then with ``ns_refine`` x + X (rhs − P x), the residual in ``residual``: this step
    brings an fp32 X of near-identical landmarks to a direct solve's error (docs/numerics.md)."""
    x = torch.matmul(inverse, rhs)
    if not ns_refine:
        return x
    wide = torch.promote_types(residual, x.dtype)
    residual = rhs.to(wide) - torch.matmul(P.to(wide), x.to(wide))
    return x + torch.matmul(inverse, residual.to(x.dtype))


def landmark_rhs(c_k, v, residual=torch.float64):
    """(R, v̄): R = k(k, L)ᵀ (v − v̄) / N (..., m, d_v), v̄ (..., 1, d_v). The output reads only
    R's small landmark-to-landmark differences, which a plain fp32 N-sum loses: R = (C_k − r 1ᵀ)ᵀ
    ṽ + 1 (rᵀ ṽ), r = C_k's row means, the common part in ``residual`` (docs/numerics.md)."""
    n = v.shape[-2]
    mean = v.mean(-2, keepdim=True)
    centred = v - mean
    row = c_k.mean(-1, keepdim=True)
    wide = torch.promote_types(residual, v.dtype)
    # transpose, not .mT: the TorchScript exporter has no aten::mT.
    common = torch.matmul(row.to(wide).transpose(-1, -2), centred.to(wide)).to(v.dtype)
    return (torch.matmul((c_k - row).transpose(-1, -2), centred) + common) / n, mean


def solve_context(P, rhs, opts, residual=torch.float64):
    """(context, X): context = P⁻¹ rhs by Newton–Schulz and the refinement step."""
    inverse = newton_schulz(P, opts.iters, opts.ns_init)
    return apply_inverse(inverse, P, rhs, opts.ns_refine, residual), inverse


def exact_solve(P, B):
    """P⁻¹ B for P (..., m, m), B (..., m, k); a singular P raises."""
    x, info = torch.linalg.solve_ex(P.to(compute_dtype(P.dtype)), B.to(compute_dtype(P.dtype)))
    if bool((info != 0).any()):
        raise ValueError('the landmark matrix P = k(L, L) + eps·I is singular (identical '
                         'landmarks with eps=0?): use eps > 0 (default 0.01)')
    return x.to(B.dtype)


def exact_inverse(P):
    return exact_solve(P, torch.eye(P.shape[-1], dtype=P.dtype, device=P.device).expand_as(P))


def _cg_step_size(num, den, active):
    """num / den on active columns with den != 0, else 0 (den replaced first: no NaN gradient)."""
    active = active & (den != 0)
    safe = torch.where(active, den, torch.ones_like(den))
    return torch.where(active, num / safe, torch.zeros_like(num))


#: CG stops at ||r|| <= CG_TOL_EPS · eps(dtype) · ||b|| per column, or CG_MAX_ITERS_PER_M · m steps.
CG_TOL_EPS = 10.0
CG_MAX_ITERS_PER_M = 10


def cg_solve(P, B, iters=None):
    """CG for SPD P (..., m, m), all columns of B (..., m, k) at once; a converged column stops
    (its next steps would divide round-off by round-off). Synchronises once per step."""
    iters = CG_MAX_ITERS_PER_M * P.shape[-1] if iters is None else check_int('iters', iters)
    dtype = compute_dtype(P.dtype)
    P, residual = P.to(dtype), B.to(dtype)
    x = torch.zeros_like(residual)
    direction = residual
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


# 5. The injective feature map --------------------------------------------------------------------
def whitening_scale(var, whiten_eps):
    """s = (var + δ)^-½, 0 where var + δ = 0 (replaced first: no NaN gradient)."""
    denom = var + whiten_eps
    positive = denom > 0
    return torch.where(positive, torch.where(positive, denom, torch.ones_like(denom)).rsqrt(),
                       torch.zeros_like(denom))


def centre_rows(C):
    """C − rowmean(C), centred twice: a row's values nearly agree, so the first mean's rounding
    is most of what is left, and s scales it into every column (docs/numerics.md)."""
    centred = C - C.mean(-1, keepdim=True)
    return centred - centred.mean(-1, keepdim=True)


def whiten(C, whiten_eps):
    """(Z, stats) for C (..., N, m): Z = c̃ diag(s) + 1/m, c̃ centred over landmarks and whitened
    over queries; stats (..., 2, m) = c̃'s column mean μ and s = (var + δ)^-½ (biased var)."""
    centred = centre_rows(C)
    mean = centred.mean(-2, keepdim=True)
    scale = whitening_scale((centred - mean).square().mean(-2, keepdim=True), whiten_eps)
    return centred * scale + 1.0 / C.shape[-1], torch.cat((mean, scale), dim=-2)


# 6. The forward ----------------------------------------------------------------------------------
def forward(q, k, v, landmarks, opts, solver='newton', dropout_p=0.0, export=None):
    """(out (B, h, N, d_v), context, X, stats) of the op contract (:mod:`.attention`); X None
    for 'exact' and 'cg'; dropout on Z; ``export``: None or the ``ExportForm`` traced."""
    dtype = compute_dtype(q.dtype)
    rows = similarity if export is None else export.similarity
    residual = torch.float64 if export is None else export.residual_dtype
    with torch.autocast(device_type=q.device.type, enabled=False):
        qa, va, la = q.to(dtype), v.to(dtype), landmarks.to(dtype)
        c_q = rows(qa, la, opts.lam, opts.kernel)
        c_k = c_q if k is None else rows(k.to(dtype), la, opts.lam, opts.kernel)
        P = landmark_system(la, opts.lam, opts.eps, opts.kernel, export is not None)
        rhs, mean_v = landmark_rhs(c_k, va, residual)
        if solver == 'newton':
            context, inverse = solve_context(P, rhs, opts, residual)
        else:
            inverse = None
            context = exact_solve(P, rhs) if solver == 'exact' else cg_solve(P, rhs, opts.iters)
        key_mean = c_k.mean(-2, keepdim=True)
        if opts.normalize == 'injective':
            z, stats = whiten(c_q, opts.whiten_eps)
            stats = torch.cat((stats, key_mean), dim=-2)
        else:
            z, stats = c_q, key_mean
        if dropout_p > 0:
            z = F.dropout(z, dropout_p, training=True)
        out = torch.matmul(z, context) + mean_v
    return out.to(q.dtype), torch.cat((context, mean_v), dim=-2), inverse, stats


# 7. The backward (closed form; it treats the solve as exact) -------------------------------------
def context_grads(t, gsum, context, stats, n, normalize):
    """(dcontext, a, scaled) from T = c̃ᵀ G (or C_qᵀ G) and colsum(G): dcontext = diag(s) T +
    1 colsum(G)ᵀ / m, a_j = s_j³ Σ_e T_je context_je / N, scaled = diag(s) context ('none': T,
    None, context)."""
    if normalize != 'injective':
        return t, None, context
    scale = stats[..., 1:2, :]
    m = context.shape[-2]
    d_context = scale.mT * t + gsum / m
    a = scale.square() * scale * (t * context).sum(-1).unsqueeze(-2) / n
    return d_context, a, scale.mT * context


def solve_grads(inverse, P, d_context, context, ns_refine):
    """(dR, dP): dR = P⁻¹ dcontext (X, refined as the forward), dP = −dR contextᵀ."""
    d_rhs = apply_inverse(inverse, P, d_context, ns_refine)
    return d_rhs, -torch.matmul(d_rhs, context.mT)


def value_grads(d_rhs, gsum, key_mean, n):
    """(dR̃, w) of R = C_kᵀ (v − 1 v̄ᵀ) / N and out's + v̄: dR̃ = dR / N, so dC_k = (v − 1 v̄ᵀ)
    dR̃ᵀ and dv = C_k dR̃ + 1 w, w = colsum(G) / N − c̄ dR̃ (v̄'s share of both paths)."""
    d_rhs = d_rhs / n
    return d_rhs, gsum / n - torch.matmul(key_mean, d_rhs)


def backward(grad, q, k, v, landmarks, context, inverse, stats, opts):
    """(dq, dk, dv, dlandmarks) of :func:`forward` for grad G (B, h, N, d_v):
    dc̃ = G contextᵀ diag(s) − (c̃ − μ) diag(a), dC_q = dc̃ − rowmean(dc̃), dC_k = (v − v̄) dR̃ᵀ,
    dv = C_k dR̃ + 1 w, then the similarity gradients; dk is empty when k is None."""
    dtype = compute_dtype(q.dtype)
    tied = k is None
    with torch.autocast(device_type=q.device.type, enabled=False):
        g, qa, va, la = grad.to(dtype), q.to(dtype), v.to(dtype), landmarks.to(dtype)
        ka = qa if tied else k.to(dtype)
        c_q = similarity(qa, la, opts.lam, opts.kernel)
        c_k = c_q if tied else similarity(ka, la, opts.lam, opts.kernel)
        injective = opts.normalize == 'injective'
        m, n = la.shape[-2], q.shape[-2]
        context, mean_v = context[..., :m, :], context[..., m:, :]
        centred = centre_rows(c_q) if injective else c_q
        gsum = g.sum(-2, keepdim=True)
        d_context, a, _ = context_grads(torch.matmul(centred.mT, g), gsum, context, stats, n,
                                        opts.normalize)
        d_cq = torch.matmul(g, context.mT)
        if injective:
            d_centred = d_cq * stats[..., 1:2, :] - (centred - stats[..., :1, :]) * a
            d_cq = d_centred - d_centred.mean(-1, keepdim=True)
        P = landmark_system(la, opts.lam, opts.eps, opts.kernel)
        d_rhs, d_p = solve_grads(inverse, P, d_context, context, opts.ns_refine)
        d_rhs, w = value_grads(d_rhs, gsum, stats[..., -1:, :], n)
        d_ck = torch.matmul(va - mean_v, d_rhs.mT)
        dv = torch.matmul(c_k, d_rhs) + w
        dq, dl = similarity_grads((d_cq + d_ck if tied else d_cq) * c_q, qa, la, opts.lam,
                                  opts.kernel)
        if tied:
            dk = q.new_empty(0)
        else:
            dk, dl_k = similarity_grads(d_ck * c_k, ka, la, opts.lam, opts.kernel)
            dl, dk = dl + dl_k, dk.to(k.dtype)
        # P = k(L, L) + eps·I: L is both operands and k is symmetric.
        w_p = (d_p + d_p.mT) * (P - opts.eps * torch.eye(P.shape[-1], dtype=P.dtype,
                                                           device=P.device))
        dl = dl + similarity_grads(w_p, la, la, opts.lam, opts.kernel, (True, False))[0]
    return dq.to(q.dtype), dk, dv.to(v.dtype), dl.to(landmarks.dtype)


# Export forms of the two primitives (standard operators only) ------------------------------------
#: Landmarks per step of the exported similarity: a (..., 7, d, N) difference, one node a step.
LANDMARK_CHUNK = 7


def similarity_export(x, y, lam, kernel, chunk=LANDMARK_CHUNK):
    """:func:`similarity` from differences laid out (..., chunk, d, N), ``chunk`` landmarks a
    step (None: all; M static): ONNX Runtime then reduces over d across whole rows."""
    num = y.shape[-2]
    step = chunk or num
    xt = x.transpose(-1, -2).unsqueeze(-3)
    yt = y.unsqueeze(-1)
    parts = []
    for start in range(0, num, step):
        diff = xt - yt[..., start:start + step, :, :]
        # Abs/Mul then ReduceSum, not ReduceL1/ReduceL2: the same sums (exact for ℓ1; for the
        # Gaussian no sqrt-then-square round trip), and ONNX Runtime's ReduceSum is vectorised
        # where its ReduceL1 runs a scalar loop (docs/deploy.md).
        parts.append(diff.abs().sum(dim=-2) if kernel == 'laplacian'
                     else (diff * diff).sum(dim=-2))
    d = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
    return torch.exp(d * (-1.0 / lam)).transpose(-1, -2)


def bin_average_matrix(size, bins, dtype, device):
    """(bins, size) matrix of adaptive pooling's bins, ATen's edges: bin i covers
    [floor(i·size / bins), ceil((i + 1)·size / bins)); ``size`` may be symbolic or traced."""
    index = torch.arange(bins, device=device)
    start = torch.div(index * size, bins, rounding_mode='floor')
    end = torch.div((index + 1) * size + (bins - 1), bins, rounding_mode='floor')
    cols = torch.arange(size, device=device)
    inside = (cols >= start.unsqueeze(-1)) & (cols < end.unsqueeze(-1))
    return inside.to(dtype) / (end - start).unsqueeze(-1).to(dtype)


def adaptive_avg_pool2d_export(maps, output_size):
    """``F.adaptive_avg_pool2d(maps, output_size)`` for maps (..., H, W), from matmuls."""
    out_h, out_w = output_size
    lead, (height, width) = maps.shape[:-2], maps.shape[-2:]
    rows = bin_average_matrix(height, out_h, maps.dtype, maps.device)
    cols = bin_average_matrix(width, out_w, maps.dtype, maps.device)
    # bmm over one leading dim of spelled-out count: matmul's fold to (B·C·H, W), or a -1,
    # makes torch.export guard on divisions it cannot prove over a user's Dim range.
    count = 1
    for size in lead:
        count = count * size
    flat = maps.reshape(count, height, width)
    pooled = torch.bmm(rows.expand(count, out_h, height),
                       torch.bmm(flat, cols.transpose(0, 1).expand(count, width, out_w)))
    return pooled.reshape(*lead, out_h, out_w)


def pool_landmarks_export(t, hw, grid):
    """:func:`pool_landmarks` by bin matrices; m = grid² (every map is at least grid × grid)."""
    batch, heads, _, width = t.shape
    height, cols = hw
    if torch.compiler.is_exporting():
        # A runtime check in the exported program, a clear error at export time.
        message = f'every stage map must be at least {grid} × {grid} to export (docs/deploy.md)'
        torch._check(height >= grid, lambda: message)
        torch._check(cols >= grid, lambda: message)
    maps = t.transpose(-1, -2).reshape(batch * heads, width, height, cols)
    pooled = adaptive_avg_pool2d_export(maps, (grid, grid))
    return pooled.reshape(batch, heads, width, grid * grid).transpose(-1, -2)
