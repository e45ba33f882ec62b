"""Attention rows of one query of one LaplacianFormer block under the Laplacian and Gaussian
kernels and softmax, dense and injective, and the layer's own Nyström row; |dk/dr| of both
kernels (``tools/analysis/attention_maps.py``, docs/analysis.md). Random weights unless a
checkpoint is given."""
import numpy as np
import torch

from . import pyplot
from .qk_capture import capture_qk

MAX_DENSE_TOKENS = 8192
ROW_NAMES = ('laplacian', 'gaussian', 'softmax', 'laplacian_injective',
             'gaussian_injective', 'laplacian_nystrom')


def query_index(hw, position):
    """Token index of a (row, col) position given as fractions in [0, 1] of an H×W grid."""
    row = int(round(position[0] * (hw[0] - 1)))
    col = int(round(position[1] * (hw[1] - 1)))
    return row * hw[1] + col


def row_normalised_kernel_row(q_i, k, kernel, lam):
    """k(q_i, k_j) / sum_j k(q_i, k_j): q_i (h, d), k (h, N, d) -> (h, N)."""
    from lapformer_mm.ops import gaussian_kernel, laplacian_kernel
    fn = laplacian_kernel if kernel == 'laplacian' else gaussian_kernel
    row = fn(q_i[:, None], k, lam)[:, 0]
    return row / row.sum(-1, keepdim=True)


def softmax_row(q_i, k):
    logits = torch.einsum('hd,hnd->hn', q_i, k) / k.shape[-1] ** 0.5
    return logits.softmax(-1)


def injective_dense_row(q, k, index, kernel, lam, whiten_eps):
    """Row ``index`` of injective_normalize(k(q, k)), all keys landmarks: q, k (h, N, d) ->
    (h, N). The whitening needs every query's row, hence MAX_DENSE_TOKENS."""
    from lapformer_mm.ops import gaussian_kernel, injective_normalize, laplacian_kernel
    if q.shape[-2] > MAX_DENSE_TOKENS:
        raise ValueError(f'the dense injective row needs N <= {MAX_DENSE_TOKENS} tokens, '
                         f'got N={q.shape[-2]}; use a smaller --size or a later --stage')
    fn = laplacian_kernel if kernel == 'laplacian' else gaussian_kernel
    return injective_normalize(fn(q, k, lam), whiten_eps)[:, index]


def nystrom_row(q, k, hw, index, attn):
    """The weights w (h, N) with w v = the layer's output for query ``index``: with
    r = z_i S k(k, L)ᵀ (S the solve's operator: Newton–Schulz's X, 2X − XPX when refined, else
    the inverse), w = (r − mean(r) + 1) / N."""
    from lapformer_mm.ops import (
        injective_normalize,
        kernel_matrix,
        landmark_matrix,
        newton_schulz_pinv,
        pool_landmarks,
    )
    opts = attn.options
    landmarks = pool_landmarks(k[None], hw, attn.landmark_grid)[0]
    c_q = kernel_matrix(opts.kernel, q, landmarks, opts.lam)
    c_k = kernel_matrix(opts.kernel, k, landmarks, opts.lam)
    p = landmark_matrix(landmarks, opts)
    if opts.solver == 'newton':
        x = newton_schulz_pinv(p, opts.iters, opts.ns_init)
        p_inv = 2 * x - x @ p @ x if opts.ns_refine else x
    else:
        p_inv = torch.linalg.inv(p)
    z = injective_normalize(c_q, opts.whiten_eps) if opts.normalize == 'injective' else c_q
    r = torch.einsum('hm,hmn,hjn->hj', z[:, index], p_inv, c_k)
    return (r - r.mean(-1, keepdim=True) + 1) / r.shape[-1]


def attention_rows(q, k, hw, index, attn):
    q, k = q.double(), k.double()
    q_i = q[:, index]
    return dict(
        laplacian=row_normalised_kernel_row(q_i, k, 'laplacian', attn.options.lam),
        gaussian=row_normalised_kernel_row(q_i, k, 'gaussian', attn.options.lam),
        softmax=softmax_row(q_i, k),
        laplacian_injective=injective_dense_row(q, k, index, 'laplacian', attn.options.lam,
                                                attn.options.whiten_eps),
        gaussian_injective=injective_dense_row(q, k, index, 'gaussian', attn.options.lam,
                                               attn.options.whiten_eps),
        laplacian_nystrom=nystrom_row(q, k, hw, index, attn))


def kernel_gradient_curves(distances, lam):
    """{'laplacian', 'gaussian'} -> (k(r), dk/dr) at r > 0 (float64), by autograd in 1-D."""
    from lapformer_mm.ops import gaussian_kernel, laplacian_kernel
    r = torch.as_tensor(np.asarray(distances), dtype=torch.float64)
    if (r <= 0).any():
        raise ValueError('distances must be > 0 (|t| has no derivative at 0)')
    curves = {}
    for name, fn in (('laplacian', laplacian_kernel), ('gaussian', gaussian_kernel)):
        x = r[:, None].clone().requires_grad_(True)
        values = fn(x, torch.zeros(1, 1, dtype=torch.float64), lam)
        (grad,) = torch.autograd.grad(values.sum(), x)
        curves[name] = (values.detach()[:, 0].numpy(), grad[:, 0].numpy())
    return curves


def plot_kernel_gradients(lam, r_max, path, points=400):
    plt = pyplot()
    r = np.linspace(r_max / points, r_max, points)
    curves = kernel_gradient_curves(r, lam)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    labels = {'laplacian': 'Laplacian exp(-r/λ), r = ℓ1',
              'gaussian': 'Gaussian exp(-r²/λ), r = ℓ2'}
    for name, (values, grads) in curves.items():
        axes[0].plot(r, values, label=labels[name])
        axes[1].plot(r, np.abs(grads), label=labels[name])
    axes[1].axhline(1.0 / lam, color='k', lw=0.7, ls=':', label='1/λ')
    axes[0].set_title(f'kernel value, λ = {lam:g}', fontsize=9)
    axes[1].set_title('|dk/dr| (autograd through lapformer_mm.ops)', fontsize=9)
    for ax in axes:
        ax.set_xlabel('distance r', fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return curves


def _grid(row, hw):
    return row.mean(0).reshape(hw).numpy()


def plot_attention_rows(image, rows, hw, index, path, title):
    plt = pyplot()
    qy, qx = divmod(index, hw[1])
    scale_y, scale_x = image.shape[0] / hw[0], image.shape[1] / hw[1]
    fig, axes = plt.subplots(2, 4, figsize=(13, 6.6))
    axes[0, 0].imshow(image)
    axes[0, 0].plot((qx + 0.5) * scale_x, (qy + 0.5) * scale_y, 'r+', ms=14, mew=2)
    axes[0, 0].set_title('image and query', fontsize=9)
    titles = dict(laplacian='Laplacian, row-normalised', gaussian='Gaussian, row-normalised',
                  softmax='softmax(q·k/√d)', laplacian_injective='Laplacian + injective (dense)',
                  gaussian_injective='Gaussian + injective (dense)',
                  laplacian_nystrom='layer row (Nyström, pooled landmarks)')
    places = dict(laplacian=(0, 1), gaussian=(0, 2), softmax=(0, 3), laplacian_injective=(1, 1),
                  gaussian_injective=(1, 2), laplacian_nystrom=(1, 3))
    for name, (r, c) in places.items():
        ax = axes[r, c]
        im = ax.imshow(_grid(rows[name], hw), cmap='viridis')
        ax.plot(qx, qy, 'r+', ms=10, mew=1.5)
        ax.set_title(titles[name], fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02).ax.tick_params(labelsize=6)
    ax = axes[1, 0]
    for name in ('laplacian', 'gaussian', 'softmax'):
        profile = _grid(rows[name], hw)[qy]
        ax.plot(profile / profile.max(), label=name)
    ax.axvline(qx, color='r', lw=0.7)
    ax.set_title("profile along the query's grid row (/ max)", fontsize=9)
    ax.set_xlabel('grid column', fontsize=8)
    ax.legend(fontsize=7)
    for ax in [*axes[0], *axes[1, 1:]]:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def capture_block(model, tensor, stage, block):
    """(q (h, N, d), k, hw, attn) of block ``block`` of stage ``stage`` (both 1-based)."""
    blocks = model.stages[stage - 1].blocks if 1 <= stage <= len(model.stages) else []
    if not 1 <= block <= len(blocks):
        raise ValueError(f'stage {stage} has no block {block}')
    from lapformer_mm.models import LaplacianAttention
    attn = blocks[block - 1].attn
    if not isinstance(attn, LaplacianAttention):
        raise ValueError(f'stage {stage} uses {type(attn).__name__}, not LaplacianAttention; '
                         'choose a Laplacian stage')
    name = f'stages.{stage - 1}.blocks.{block - 1}.attn'
    with capture_qk(model) as records:
        model(tensor)
    record = next(r for r in records if r.layer == name)
    return record.q[0], record.k[0], record.hw, attn
