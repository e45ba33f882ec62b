"""Building blocks of the LaplacianFormer backbone (torch only).

Token tensors are (B, N, C) with N = H * W in row-major order of the H x W grid;
feature maps are NCHW.
"""
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn


def drop_path(x: torch.Tensor, drop_prob: float, training: bool) -> torch.Tensor:
    """Stochastic depth: zero whole samples of a residual branch.

    x: (B, ...). Surviving samples are scaled by 1 / (1 - drop_prob) so the
    expectation matches eval mode, where the branch is kept as is.
    """
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    mask_shape = (x.shape[0], ) + (1, ) * (x.ndim - 1)
    mask = x.new_empty(mask_shape).bernoulli_(keep)
    return x * mask / keep


class DropPath(nn.Module):
    """Module form of :func:`drop_path`."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(
                f'drop_prob must be in [0, 1), got {drop_prob!r}')
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training)

    def extra_repr(self) -> str:
        return f'drop_prob={self.drop_prob}'


def conv_bn_relu(in_channels: int, out_channels: int,
                 stride: int) -> nn.Sequential:
    """3x3 convolution (no bias, BN follows) + BatchNorm + ReLU.

    (B, in, H, W) -> (B, out, ceil(H / stride), ceil(W / stride)).
    """
    return nn.Sequential(
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size=3,
            stride=stride,
            padding=1,
            bias=False), nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))


class ConvStem(nn.Sequential):
    """Three 3x3 conv-BN-ReLU layers with strides 2/1/2 (SOFT's stem).

    (B, in_channels, H, W) -> (B, out_channels, ceil(ceil(H/2)/2), ...).
    """

    def __init__(self, in_channels: int, out_channels: int,
                 hidden_channels: int = 32):
        super().__init__(
            conv_bn_relu(in_channels, hidden_channels, 2),
            conv_bn_relu(hidden_channels, hidden_channels, 1),
            conv_bn_relu(hidden_channels, out_channels, 2))


class Mlp(nn.Module):
    """Linear -> GELU -> dropout -> Linear -> dropout; (B, N, C) -> (B, N, C)."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.act(self.fc1(x)))
        return self.drop(self.fc2(x))


class SoftmaxAttention(nn.Module):
    """Plain multi-head softmax self-attention (SOFT's stage-4 layout).

    forward(x, hw): x (B, N, C) -> (B, N, C); hw is accepted for the same call
    signature as LaplacianAttention and not used. Quadratic in N, which is
    cheap only where N is small (stage 4, stride 32).
    """

    def __init__(self,
                 dim: int,
                 num_heads: int,
                 qkv_bias: bool = True,
                 attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads '
                             f'({num_heads})')
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads,
                                  C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        out = out.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(out))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + DropPath(Attn(LN(x))), then x + DropPath(MLP(LN(x))).

    forward(x, hw): x (B, N, C), hw = (H, W) with H * W = N -> (B, N, C).
    """

    def __init__(self,
                 dim: int,
                 attn: nn.Module,
                 mlp_ratio: float = 4.0,
                 drop: float = 0.0,
                 drop_path_prob: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        self.drop_path = DropPath(drop_path_prob)

    def forward(self, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), hw))
        return x + self.drop_path(self.mlp(self.norm2(x)))
