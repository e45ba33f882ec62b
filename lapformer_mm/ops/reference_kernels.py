"""Reference math of the kernel matrices and their gradients, in plain PyTorch.

The default implementation of the registered ops in :mod:`lapformer_mm.ops.kernels`
(every device; on CUDA the CuPy kernels replace it when chosen). Operands are
(batch, N, d) and (batch, M, d); nothing builds an (batch, N, M, d) tensor
except the bounded chunks of the off-CPU ℓ1 gradient.

* Laplacian: the ℓ1 distance matrix comes from ``torch.cdist(p=1)``, and its
  gradient ``sum_j g_ij · sign(x_i - y_j)`` on CPU from
  ``aten._cdist_backward``, a native loop over (i, j) pairs vectorised over d.
  Elsewhere the gradient is a loop over row chunks of bounded size, because the
  CUDA ``_cdist_backward`` allocates an (N, M, d) buffer. ``sign(0) = 0`` gives
  the subgradient 0 of |t| at t = 0.
* Gaussian: ``||x - y||²`` from the coordinate differences (``torch.cdist``
  without its matmul shortcut): in fp32 the expansion |x|² + |y|² − 2x·y loses
  the distance to cancellation at large norms (k(x, x) = 0.14 at |x| = 5700).
  The gradient ``sum_j w_ij (x_i - y_j) = x_i sum_j w_ij - sum_j w_ij y_j`` is a
  batched matmul.
"""
import torch

#: Byte budget of the (rows, M, d) sign tensor of the chunked ℓ1 backward.
CHUNK_BYTES = 32 * 2 ** 20

#: Rows of b per ``_cdist_backward`` call when summing over many b rows (the
#: landmark gradient sums over all N tokens): that kernel rereads b once per
#: row of a, so blocks that stay in cache made the landmark gradient 4-5x faster
#: at N = 262144 (``benchmarks/attention.py micro``, docs/attention.md).
NATIVE_BLOCK_ROWS = 512


def cdist_backward_l1(g, a3, b3):
    """sum_j g[:, i, j] · sign(a_i - b_j) by ``aten._cdist_backward``; CPU tensors.

    The one use of that private op. Its ``cdist`` argument is read only for p
    not in {1, 2, inf}; the gradient block is passed there because it has the
    required shape.
    """
    grad = None
    for start in range(0, b3.shape[1], NATIVE_BLOCK_ROWS):
        g_block = g[:, :, start:start + NATIVE_BLOCK_ROWS].contiguous()
        part = torch.ops.aten._cdist_backward(
            g_block, a3.contiguous(), b3[:, start:start + NATIVE_BLOCK_ROWS].contiguous(),
            1.0, g_block)
        grad = part if grad is None else grad.add_(part)
    return grad


def chunked_l1_grad(g, a3, b3, chunk_bytes=CHUNK_BYTES):
    """sum_j g[:, i, j] · sign(a_i - b_j), rows of a in chunks of bounded size.

    Each step holds one (batch, rows, Nb, d) sign tensor of at most
    ``chunk_bytes``.
    """
    batch, num_a, width = a3.shape
    per_row = batch * b3.shape[1] * width * a3.element_size()
    rows = max(1, chunk_bytes // max(per_row, 1))
    grad = torch.empty_like(a3)
    for start in range(0, num_a, rows):
        stop = min(start + rows, num_a)
        sign = torch.sign(a3[:, start:stop, None, :] - b3[:, None, :, :])
        grad[:, start:stop] = torch.einsum('bij,bijd->bid', g[:, start:stop], sign)
    return grad


def l1_grad(g, a3, b3):
    """sum_j g[:, i, j] · sign(a_i - b_j): (batch, Na, d) for g (batch, Na, Nb)."""
    if a3.device.type == 'cpu' and g.numel() > 0:
        return cdist_backward_l1(g, a3, b3)
    return chunked_l1_grad(g, a3, b3)


def pairwise_distance(x3, y3, kind):
    """ℓ1 (``'laplacian'``) or squared ℓ2 (``'gaussian'``) distances (batch, N, M)."""
    if kind == 'laplacian':
        return torch.cdist(x3, y3, p=1.0)
    return torch.cdist(x3, y3, p=2.0, compute_mode='donot_use_mm_for_euclid_dist').square_()


def pairwise_kernel_reference(x3, y3, lam, kind):
    """exp(-dist(x_i, y_j) / lam) for x3 (batch, N, d), y3 (batch, M, d) -> (batch, N, M)."""
    return pairwise_distance(x3, y3, kind).mul_(-1.0 / lam).exp_()


def pairwise_grad_reference(w, rows, red, lam, kind):
    """d/d rows of sum_ij g_ij K_ij, given w = g ⊙ K (batch, n_rows, n_red) -> (batch, n_rows, d).

    dK/d dist = -K / lam; d|t|/dt = sign(t) and d t²/dt = 2t.
    """
    if kind == 'laplacian':
        return l1_grad(w, rows, red).mul_(-1.0 / lam)
    return (w.sum(-1, keepdim=True) * rows - torch.bmm(w, red)).mul_(-2.0 / lam)
