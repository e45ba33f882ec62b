"""Building blocks of the backbone: tokens (B, N, C), N = H * W row-major; maps NCHW."""
import functools
import importlib
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


class DropPath(nn.Module):
    """Stochastic depth: zero whole samples of a residual branch, the survivors scaled by
    1 / (1 - drop_prob) so the expectation matches eval mode, where the branch is kept."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(f'drop_path_rate must be in [0, 1), got {drop_prob!r}')
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0], ) + (1, ) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f'drop_prob={self.drop_prob}'


# The types built with torch alone when mmcv is not installed (the backbone needs only
# torch and mmengine); with mmcv, every type in its registry, as in mmdet's backbones.
TORCH_LAYERS = {'LN': nn.LayerNorm, 'BN': nn.BatchNorm2d, 'SyncBN': nn.SyncBatchNorm,
                'GN': nn.GroupNorm, 'ReLU': nn.ReLU, 'GELU': nn.GELU, 'SiLU': nn.SiLU}


@functools.lru_cache(maxsize=1)
def _mmcv_cnn():
    try:
        return importlib.import_module('mmcv.cnn')
    except ImportError:
        return None


def _torch_layer(arg: str, cfg: dict, *args) -> nn.Module:
    kwargs = dict(cfg)
    layer_type = kwargs.pop('type')
    if layer_type not in TORCH_LAYERS and not isinstance(layer_type, type):
        raise ValueError(f'{arg}: type {layer_type!r} needs mmcv (not installed); without it '
                         f'{", ".join(TORCH_LAYERS)}')
    layer_cls = TORCH_LAYERS.get(layer_type, layer_type)
    requires_grad = kwargs.pop('requires_grad', True)
    if layer_cls is nn.GroupNorm:
        kwargs['num_channels'] = args[0]
        args = ()
    return layer_cls(*args, **kwargs).requires_grad_(requires_grad)


def build_norm(arg: str, cfg: dict, num_features: int) -> nn.Module:
    mmcv_cnn = _mmcv_cnn()
    if mmcv_cnn is not None:
        return mmcv_cnn.build_norm_layer(cfg, num_features)[1]
    return _torch_layer(arg, cfg, num_features)


def build_activation(arg: str, cfg: dict) -> nn.Module:
    mmcv_cnn = _mmcv_cnn()
    return mmcv_cnn.build_activation_layer(cfg) if mmcv_cnn else _torch_layer(arg, cfg)


def build_token_norm(cfg: dict, dim: int) -> nn.Module:
    # Batch, instance and group norms normalise dimension 1, which for tokens is N.
    layer = build_norm('norm_cfg', cfg, dim)
    if isinstance(layer, (_NormBase, nn.GroupNorm)):
        raise ValueError(f'norm_cfg={cfg!r} builds {type(layer).__name__}, a norm of NCHW maps; '
                         "the tokens (B, N, C) need a norm of C such as dict(type='LN')")
    return layer


def conv_norm_act(in_channels: int, out_channels: int, stride: int, norm_cfg: dict,
                  act_cfg: dict) -> nn.Sequential:
    norm = build_norm('conv_norm_cfg', norm_cfg, out_channels)
    # A LayerNorm normalises the last dimension, W of these maps (mmpretrain's LN2d, a
    # subclass, normalises the channels).
    if type(norm) is nn.LayerNorm:
        raise ValueError(f'conv_norm_cfg={norm_cfg!r} builds LayerNorm, which for NCHW maps '
                         "normalises W: use dict(type='BN'), 'SyncBN' or 'GN'")
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1,
                  bias=False), norm, build_activation('conv_act_cfg', act_cfg))


STEM_HIDDEN_CHANNELS = 32


class ConvStem(nn.Sequential):
    """SOFT's stem: three 3x3 conv-norm-activation layers, strides 2/1/2."""

    def __init__(self, in_channels: int, out_channels: int, norm_cfg: dict, act_cfg: dict,
                 hidden_channels: int = STEM_HIDDEN_CHANNELS):
        super().__init__(
            conv_norm_act(in_channels, hidden_channels, 2, norm_cfg, act_cfg),
            conv_norm_act(hidden_channels, hidden_channels, 1, norm_cfg, act_cfg),
            conv_norm_act(hidden_channels, out_channels, 2, norm_cfg, act_cfg))


class Mlp(nn.Module):

    def __init__(self, dim: int, hidden_dim: int, act_cfg: dict, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = build_activation('act_cfg', act_cfg)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.act(self.fc1(x)))
        return self.drop(self.fc2(x))


class SoftmaxAttention(nn.Module):
    """Multi-head softmax self-attention (SOFT's stage 4); ``hw`` is not used."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f'dim={dim} must be divisible by num_heads={num_heads}')
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

    def __init__(self,
                 dim: int,
                 attn: nn.Module,
                 norm_cfg: dict,
                 act_cfg: dict,
                 mlp_ratio: float = 4.0,
                 drop: float = 0.0,
                 drop_path_prob: float = 0.0):
        super().__init__()
        self.norm1 = build_token_norm(norm_cfg, dim)
        self.attn = attn
        self.norm2 = build_token_norm(norm_cfg, dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_cfg, drop)
        self.drop_path = DropPath(drop_path_prob)

    def forward(self, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), hw))
        return x + self.drop_path(self.mlp(self.norm2(x)))
