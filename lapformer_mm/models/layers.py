"""Building blocks of the LaplacianFormer backbone (torch; mmcv's layer registry when installed).

Token tensors are (B, N, C) with N = H * W in row-major order of the H x W grid;
feature maps are NCHW.
"""
import functools
import importlib
import inspect
import math
import numbers
from typing import Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


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


# The types built with torch alone when mmcv is not installed (the backbone needs only
# torch and mmengine); with mmcv, every type in its registry, as in mmdet's backbones.
TORCH_NORMS = {'LN': nn.LayerNorm, 'BN': nn.BatchNorm2d, 'SyncBN': nn.SyncBatchNorm,
               'GN': nn.GroupNorm}
TORCH_ACTIVATIONS = {'ReLU': nn.ReLU, 'GELU': nn.GELU, 'SiLU': nn.SiLU}
#: The norm types mmcv registers, for the error on another one.
MMCV_NORMS = ('BN', 'SyncBN', 'GN', 'LN', 'IN')


@functools.lru_cache(maxsize=1)
def _mmcv_cnn():
    """``mmcv.cnn`` when mmcv is installed, else None."""
    try:
        return importlib.import_module('mmcv.cnn')
    except ImportError:
        return None


def _split_cfg(arg: str, cfg: dict, torch_types: dict):
    """(layer class, remaining kwargs) of ``cfg`` for the torch-only builders."""
    kwargs = dict(cfg)
    layer_type = kwargs.pop('type')
    if inspect.isclass(layer_type):
        return layer_type, kwargs
    if layer_type not in torch_types:
        raise ValueError(f'{arg}={cfg!r}: type {layer_type!r} needs mmcv (not installed); '
                         f'without it allowed: {", ".join(map(repr, torch_types))}')
    return torch_types[layer_type], kwargs


def _check_cfg(arg: str, cfg) -> None:
    if not isinstance(cfg, dict) or 'type' not in cfg:
        raise TypeError(f"{arg} must be a dict with a 'type' key (e.g. dict(type='LN')), "
                        f'got {cfg!r}')


def check_group_norm(arg: str, cfg: dict, widths: Sequence[int]) -> None:
    """For a GroupNorm ``cfg``: ``num_groups`` a positive int that divides each of ``widths``,
    the channels of every map it normalises, else a ValueError naming ``arg`` and them.

    mmcv asserts a missing num_groups with an empty message; torch's divisibility error
    names one width, which may be the stem's hidden 32 that the user never set, and
    num_groups=0 is a ZeroDivisionError there.
    """
    _check_cfg(arg, cfg)
    if cfg['type'] not in ('GN', 'GroupNorm', nn.GroupNorm):
        return
    widths = sorted(set(widths))
    listed = ', '.join(map(str, widths))
    divisor = functools.reduce(math.gcd, widths)
    if 'num_groups' not in cfg:
        raise ValueError(f'{arg}={cfg!r}: GroupNorm needs num_groups, a divisor of {divisor} '
                         f'(of every width it normalises: {listed}), e.g. '
                         f'{math.gcd(divisor, 32)}')
    groups = cfg['num_groups']
    if (isinstance(groups, bool) or not isinstance(groups, numbers.Integral) or groups < 1
            or any(width % groups for width in widths)):
        raise ValueError(f"{arg}={cfg!r}: GroupNorm's num_groups must be a positive int "
                         f'dividing every width it normalises ({listed}), so a divisor of '
                         f'{divisor}; got {groups!r}')


def build_norm(arg: str, cfg: dict, num_features: int) -> nn.Module:
    """The norm layer of an mmcv-style config over ``num_features`` channels.

    ``cfg`` as for mmcv's ``build_norm_layer`` (``dict(type='LN')``,
    ``dict(type='GN', num_groups=8)``, ``requires_grad=False`` freezes it); ``arg``
    names the argument in errors.
    """
    check_group_norm(arg, cfg, [num_features])
    mmcv_cnn = _mmcv_cnn()
    if mmcv_cnn is not None:
        try:
            return mmcv_cnn.build_norm_layer(cfg, num_features)[1]
        except KeyError as err:
            # mmcv's own message for a norm names the type as None
            raise ValueError(f'{arg}={cfg!r}: unknown norm type {cfg["type"]!r}; mmcv '
                             f'registers {", ".join(MMCV_NORMS)} (and their 1d/2d/3d '
                             f'forms) ({err})') from None
    layer_cls, kwargs = _split_cfg(arg, cfg, TORCH_NORMS)
    requires_grad = kwargs.pop('requires_grad', True)
    if layer_cls is nn.GroupNorm:
        layer = layer_cls(num_channels=num_features, **kwargs)
    else:
        layer = layer_cls(num_features, **kwargs)
    layer.requires_grad_(requires_grad)
    return layer


def build_activation(arg: str, cfg: dict) -> nn.Module:
    """The activation layer of an mmcv-style config (``dict(type='GELU')``)."""
    _check_cfg(arg, cfg)
    mmcv_cnn = _mmcv_cnn()
    if mmcv_cnn is not None:
        try:
            return mmcv_cnn.build_activation_layer(cfg)
        except KeyError as err:
            raise ValueError(f'{arg}={cfg!r}: unknown type ({err})') from None
    layer_cls, kwargs = _split_cfg(arg, cfg, TORCH_ACTIVATIONS)
    return layer_cls(**kwargs)


def build_token_norm(cfg: dict, dim: int) -> nn.Module:
    """The norm of (B, N, C) tokens from ``norm_cfg``: it must normalise the last dimension.

    Batch, instance and group norms normalise dimension 1 of NCHW maps, which for
    tokens is N, so they are refused here rather than failing at the first forward.
    """
    layer = build_norm('norm_cfg', cfg, dim)
    if isinstance(layer, (_NormBase, nn.GroupNorm)):
        raise ValueError(f'norm_cfg={cfg!r} builds {type(layer).__name__}, a norm of NCHW '
                         'maps; the blocks normalise (B, N, C) tokens over C: use a norm of '
                         "the last dimension such as dict(type='LN') (conv_norm_cfg sets the "
                         'norm of the stem and downsampling convolutions)')
    return layer


def build_map_norm(cfg: dict, channels: int) -> nn.Module:
    """The norm of (B, C, H, W) maps from ``conv_norm_cfg``: not a LayerNorm, which
    normalises the last dimension, W (build_token_norm's mirror image)."""
    layer = build_norm('conv_norm_cfg', cfg, channels)
    if type(layer) is nn.LayerNorm:  # subclasses (mmpretrain's LN2d) normalise channels
        raise ValueError(f'conv_norm_cfg={cfg!r} builds LayerNorm, a norm of the last '
                         'dimension, which for the stem and downsampling maps (B, C, H, W) '
                         "is W: use a norm of NCHW maps such as dict(type='BN'), "
                         "dict(type='SyncBN') or dict(type='GN', num_groups=...) (norm_cfg "
                         'sets the norm of the tokens)')
    return layer


def conv_norm_act(in_channels: int, out_channels: int, stride: int, norm_cfg: dict,
                  act_cfg: dict) -> nn.Sequential:
    """3x3 convolution (no bias, the norm follows) + norm + activation.

    (B, in, H, W) -> (B, out, ceil(H / stride), ceil(W / stride)).
    """
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1,
                  bias=False),
        build_map_norm(norm_cfg, out_channels),
        build_activation('conv_act_cfg', act_cfg))


#: The channels of the stem's first two layers.
STEM_HIDDEN_CHANNELS = 32


class ConvStem(nn.Sequential):
    """Three 3x3 conv-norm-activation layers with strides 2/1/2 (SOFT's stem).

    (B, in_channels, H, W) -> (B, out_channels, ceil(ceil(H/2)/2), ...).
    """

    def __init__(self, in_channels: int, out_channels: int, norm_cfg: dict, act_cfg: dict,
                 hidden_channels: int = STEM_HIDDEN_CHANNELS):
        super().__init__(
            conv_norm_act(in_channels, hidden_channels, 2, norm_cfg, act_cfg),
            conv_norm_act(hidden_channels, hidden_channels, 1, norm_cfg, act_cfg),
            conv_norm_act(hidden_channels, out_channels, 2, norm_cfg, act_cfg))


class Mlp(nn.Module):
    """Linear -> activation -> dropout -> Linear -> dropout; (B, N, C) -> (B, N, C)."""

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
    """Pre-norm block: x + DropPath(Attn(Norm(x))), then x + DropPath(MLP(Norm(x))).

    Norms from ``norm_cfg`` (:func:`build_token_norm`), the MLP activation from
    ``act_cfg``. forward(x, hw): x (B, N, C), hw = (H, W) with H * W = N -> (B, N, C).
    """

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
