"""Laplacian-kernel Nyström attention module (docs/design.md §2)."""
import torch
import torch.nn.functional as F
from torch import nn

from ..ops import AttentionOptions, landmark_matrix, nystrom_attention, pool_landmarks
from ..ops._checks import check_bool, check_int, check_probability
from ..ops.attention import load_backends, one_projection


class LaplacianAttention(nn.Module):
    """Multi-head Nyström attention with a Laplacian kernel and a local term.

    For x (B, N, C) on an H×W grid, with h heads of width d = C / h: q, k, v by one linear
    layer (k = q with ``qk_shared``, the SOFT layout: tied in stages 1-3, docs/model_size.md);
    ``o = Z(k(q, L)) · (k(L, L) + eps·I)⁻¹ · k(k, L)ᵀ (v − v̄) / N + v̄`` per head, L the keys
    pooled on a ``landmark_grid``² grid (:func:`lapformer_mm.ops.nystrom_attention`); then
    ``o + dwconv3x3(v)`` and the output projection. ``global_term=False`` keeps the local term
    alone, the ablations' control. The keyword-only arguments (the backbone's ``attn_cfg``;
    ``**options`` the fields of :class:`lapformer_mm.ops.AttentionOptions`) are checked here,
    once.
    """

    #: The form an exporter writes (``deploy.prepare_for_export`` sets it in its copy; None:
    #: the default while an exporter traces).
    export_form = None

    def __init__(self, dim, num_heads, qkv_bias=True, attn_drop=0.0, proj_drop=0.0, *,
                 qk_shared=True, landmark_grid=7, global_term=True, **options):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim={dim} must be divisible by num_heads={num_heads}')
        self.dim = dim
        self.num_heads = num_heads
        # Truthy stand-ins (1, 'no') would take a branch without a word.
        self.qk_shared = check_bool('qk_shared', qk_shared)
        self.global_term = check_bool('global_term', global_term)
        self.landmark_grid = check_int('landmark_grid', landmark_grid)
        self.options = AttentionOptions(**options)
        # A negative rate would drop nothing.
        self.attn_drop = check_probability('attn_drop', attn_drop)
        num_projections = 2 if self.qk_shared else 3
        self.qkv = nn.Linear(dim, num_projections * dim, bias=check_bool('qkv_bias', qkv_bias))
        self.local = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self._local_weight_channels_last()
        self.register_load_state_dict_post_hook(
            lambda module, _: module._local_weight_channels_last())
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        load_backends()

    def _local_weight_channels_last(self):
        """Give the depth-wise weight the channels-last strides its CPU gradient comes back
        with (the same memory, but DistributedDataParallel compares strides and warns at every
        run); kept through ``.to(...)`` and ``load_state_dict(assign=True)`` by :meth:`_apply`
        and a load hook."""
        weight = self.local.weight
        channels_last = torch.empty_like(weight, memory_format=torch.channels_last)
        if weight.stride() != channels_last.stride():
            weight.data = channels_last.copy_(weight)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._local_weight_channels_last()
        return self

    def _split_heads(self, t):
        """(B, N, C) -> (B, h, N, d)."""
        batch, num_tokens, _ = t.shape
        return t.view(batch, num_tokens, self.num_heads, -1).transpose(1, 2)

    def _local_term(self, v, hw):
        """Depth-wise 3×3 convolution of v (B, N, C) on its H×W grid -> (B, N, C), through a
        channels-last view of the tokens: no copy either way."""
        batch, num_tokens, channels = v.shape
        grid = v.reshape(batch, *hw, channels).permute(0, 3, 1, 2)
        return self.local(grid).permute(0, 2, 3, 1).reshape(batch, num_tokens, channels)

    def project(self, x):
        """q, k (B, h, N, d) and v (B, N, C) of x (B, N, C); k is q when keys are tied. One
        product on a GPU (the kernels read strided head views; a launch costs more than a
        layout); one per projection on a CPU, so q, k and v are contiguous and the convolution
        and the pooling read them without a copy (docs/benchmarks.md)."""
        parts = 2 if self.qk_shared else 3
        if one_projection(x.device):
            projected = self.qkv(x).chunk(parts, dim=-1)
        else:
            biases = (self.qkv.bias.chunk(parts) if self.qkv.bias is not None
                      else (None,) * parts)
            projected = [F.linear(x, w, b)
                         for w, b in zip(self.qkv.weight.chunk(parts), biases)]
        q = self._split_heads(projected[0])
        k = q if self.qk_shared else self._split_heads(projected[1])
        return q, k, projected[-1]

    def landmark_system(self, x, hw):
        """P = k(L, L) + eps·I (B, h, m, m) the attention inverts for x (B, N, C), for analysis
        (:meth:`forward` builds it inside the op)."""
        _, k, _ = self.project(x)
        return landmark_matrix(pool_landmarks(k, hw, self.landmark_grid), self.options)

    def forward(self, x, hw):
        """x (B, N, C) with hw = (H, W), N = H·W -> (B, N, C)."""
        q, k, v = self.project(x)
        if not self.global_term:
            return self.proj_drop(self.proj(self._local_term(v, hw)))
        # The op pools the landmarks from the keys: it knows whether an exporter traces.
        out = nystrom_attention(q, k, self._split_heads(v), options=self.options, hw=hw,
                                landmark_grid=self.landmark_grid,
                                dropout_p=self.attn_drop if self.training else 0.0,
                                export=self.export_form)
        out = out.transpose(1, 2).reshape(x.shape) + self._local_term(v, hw)
        return self.proj_drop(self.proj(out))

    def extra_repr(self):
        control = '' if self.global_term else 'global_term=False, '
        return (f'dim={self.dim}, num_heads={self.num_heads}, qk_shared={self.qk_shared}, '
                f'landmark_grid={self.landmark_grid}, {control}{self.options}')

