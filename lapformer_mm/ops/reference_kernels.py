"""Pure-PyTorch Laplacian and Gaussian kernel matrices with hand-written backward.

Both are ``torch.autograd.Function``s whose forward and backward never build an
(..., N, M, d) tensor: memory is O(N·M + (N+M)·d).

* Laplacian: the ℓ1 distance matrix comes from ``torch.cdist(p=1)``, and its
  gradient ``sum_j g_ij · sign(x_i - y_j)`` on CPU from
  ``aten._cdist_backward``, both native loops over (i, j) pairs vectorised
  over d. Elsewhere the gradient is a loop over row chunks of bounded size,
  because the CUDA ``_cdist_backward`` allocates an (N, M, d) buffer.
  ``sign(0) = 0`` gives the subgradient 0 of |t| at t = 0.
* Gaussian: ``||x - y||²`` from the coordinate differences (``torch.cdist``
  without its matmul shortcut, exact on the diagonal at any norm); the gradient
  ``sum_j w_ij (x_i - y_j) = x_i sum_j w_ij - sum_j w_ij y_j`` is a batched matmul.
"""
import torch


def _flatten_batch(t):
    """(..., N, d) -> contiguous (batch, N, d)."""
    return t.reshape(-1, t.shape[-2], t.shape[-1]).contiguous()


def _l1_distance(x3, y3):
    """ℓ1 distances (batch, N, M) of x3 (batch, N, d) and y3 (batch, M, d)."""
    return torch.cdist(x3, y3, p=1.0)


#: Byte budget of the (rows, M, d) sign tensor of the chunked ℓ1 backward.
CHUNK_BYTES = 32 * 2 ** 20


#: Rows of b per ``_cdist_backward`` call when summing over many b rows (the
#: landmark gradient sums over all N tokens): that kernel rereads b once per
#: row of a, so blocks that stay in cache made the landmark gradient 4-5x faster
#: at N = 262144 (``tools/bench_attention.py micro``, docs/attention.md).
NATIVE_BLOCK_ROWS = 512


def _l1_distance_grad_native(g, a3, b3):
    """sum_j g[:, i, j] · sign(a_i - b_j) by ``aten._cdist_backward`` (CPU).

    Its ``cdist`` argument is read only for p not in {1, 2, inf}; the
    gradient block is passed there because it has the required shape.
    """
    grad = None
    for start in range(0, b3.shape[1], NATIVE_BLOCK_ROWS):
        g_block = g[:, :, start:start + NATIVE_BLOCK_ROWS].contiguous()
        part = torch.ops.aten._cdist_backward(
            g_block, a3, b3[:, start:start + NATIVE_BLOCK_ROWS], 1.0, g_block)
        grad = part if grad is None else grad.add_(part)
    return grad


def _l1_distance_grad_chunked(g, a3, b3, chunk_bytes=CHUNK_BYTES):
    """sum_j g[:, i, j] · sign(a_i - b_j), rows of a in chunks of bounded size.

    Each step holds one (batch, rows, Nb, d) sign tensor of at most
    ``chunk_bytes``; used off CPU, where ``_cdist_backward`` allocates a full
    (batch, Nb, Na, d) buffer.
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


def _l1_distance_grad(g, a3, b3):
    """sum_j g[:, i, j] · sign(a_i - b_j): (batch, Na, d) for g (batch, Na, Nb)."""
    if a3.device.type == 'cpu':
        return _l1_distance_grad_native(g, a3, b3)
    return _l1_distance_grad_chunked(g, a3, b3)


class LaplacianKernel(torch.autograd.Function):
    """K = exp(-||x_i - y_j||_1 / lam); x (..., N, d), y (..., M, d) -> (..., N, M)."""

    @staticmethod
    def forward(ctx, x, y, lam):
        x3, y3 = _flatten_batch(x), _flatten_batch(y)
        kernel = _l1_distance(x3, y3).mul_(-1.0 / lam).exp_()
        # Saving K (not the distances) lets the backward skip one exp pass.
        ctx.save_for_backward(x3, y3, kernel)
        ctx.lam = lam
        ctx.shapes = (x.shape, y.shape)
        return kernel.view(*x.shape[:-1], y.shape[-2])

    @staticmethod
    def backward(ctx, grad):
        x3, y3, kernel = ctx.saved_tensors
        x_shape, y_shape = ctx.shapes
        # dK/dD = -K / lam, so the distance gradient is -g·K/lam.
        g_dist = (grad.reshape(kernel.shape) * kernel).mul_(-1.0 / ctx.lam)
        grad_x = grad_y = None
        if ctx.needs_input_grad[0]:
            grad_x = _l1_distance_grad(g_dist, x3, y3).view(x_shape)
        if ctx.needs_input_grad[1]:
            grad_y = _l1_distance_grad(g_dist.mT, y3, x3).view(y_shape)
        return grad_x, grad_y, None


class GaussianKernel(torch.autograd.Function):
    """K = exp(-||x_i - y_j||_2^2 / lam); x (..., N, d), y (..., M, d) -> (..., N, M)."""

    @staticmethod
    def forward(ctx, x, y, lam):
        x3, y3 = _flatten_batch(x), _flatten_batch(y)
        # Differences, not |x|² + |y|² - 2 x·y: in fp32 the expansion loses the
        # distance to cancellation at large norms (k(x, x) = 0.14 at |x| = 5700),
        # which exp(-d/lam) turns into a relative error of the kernel value.
        dist = torch.cdist(x3, y3, p=2.0, compute_mode='donot_use_mm_for_euclid_dist')
        kernel = dist.square_().mul_(-1.0 / lam).exp_()
        ctx.save_for_backward(x3, y3, kernel)
        ctx.lam = lam
        ctx.shapes = (x.shape, y.shape)
        return kernel.view(*x.shape[:-1], y.shape[-2])

    @staticmethod
    def backward(ctx, grad):
        x3, y3, kernel = ctx.saved_tensors
        x_shape, y_shape = ctx.shapes
        # d||x-y||²/dx = 2(x - y), weighted by g_sq = -g·K/lam.
        g_sq = (grad.reshape(kernel.shape) * kernel).mul_(-2.0 / ctx.lam)
        grad_x = grad_y = None
        if ctx.needs_input_grad[0]:
            grad_x = (g_sq.sum(-1, keepdim=True) * x3
                      - torch.bmm(g_sq, y3)).view(x_shape)
        if ctx.needs_input_grad[1]:
            grad_y = (g_sq.sum(-2).unsqueeze(-1) * y3
                      - torch.bmm(g_sq.mT, x3)).view(y_shape)
        return grad_x, grad_y, None


def laplacian_kernel_reference(x, y, lam):
    """Reference Laplacian kernel matrix (..., N, M); see :class:`LaplacianKernel`."""
    return LaplacianKernel.apply(x, y, lam)


def gaussian_kernel_reference(x, y, lam):
    """Reference Gaussian kernel matrix (..., N, M); see :class:`GaussianKernel`."""
    return GaussianKernel.apply(x, y, lam)
