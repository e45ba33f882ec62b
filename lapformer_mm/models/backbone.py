"""LaplacianFormer: a four-stage pyramid of Laplacian-kernel attention blocks.

Layout after SOFT/SOFT++ (docs/design.md §3): a convolutional stem to
stride 4, then four stages; stages 2-4 start with a 3x3 stride-2 conv-norm-act
(BatchNorm and ReLU by default). Each stage is a stack of pre-norm transformer
blocks on the (B, H*W, C) tokens of its grid. The API follows mmdet's PVT/Swin
backbones: attention options in ``attn_cfg``, layers in ``norm_cfg``/``act_cfg``.
"""
import math
import numbers
import warnings
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils.checkpoint as cp
from mmengine.logging import MMLogger
from mmengine.model import BaseModule, initialize
from mmengine.registry import MODELS
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..ops._checks import check_bool, trace_quiet
from ..ops.export import exporting
from .attention import LaplacianAttention, check_attn_cfg_keys
from .layers import (
    STEM_HIDDEN_CHANNELS,
    ConvStem,
    SoftmaxAttention,
    TransformerBlock,
    build_token_norm,
    check_group_norm,
    conv_norm_act,
)
from .pretrained import PRETRAINED_KEYS, is_pretrained_cfg, load_backbone_weights

ARCH_SETTINGS: Dict[str, Dict[str, List[int]]] = {
    'tiny': dict(
        embed_dims=[64, 128, 320, 512],
        num_heads=[2, 4, 10, 16],
        depths=[1, 2, 3, 2]),
    'small': dict(
        embed_dims=[64, 128, 320, 512],
        num_heads=[2, 4, 10, 16],
        depths=[1, 3, 20, 4]),
    'medium': dict(
        embed_dims=[64, 128, 288, 512],
        num_heads=[2, 4, 9, 16],
        depths=[1, 3, 29, 5]),
    'large': dict(
        embed_dims=[64, 128, 320, 512],
        num_heads=[2, 4, 10, 16],
        depths=[1, 3, 40, 5]),
    'huge': dict(
        embed_dims=[64, 128, 352, 512],
        num_heads=[2, 4, 11, 16],
        depths=[1, 5, 49, 5]),
}
ARCH_ALIASES = {'t': 'tiny', 's': 'small', 'm': 'medium', 'l': 'large',
                'h': 'huge'}
NUM_STAGES = 4
#: Output strides of the four stages (the stem's 4, then one stride-2 conv per stage).
STAGE_STRIDES = (4, 8, 16, 32)
STAGE4_ATTENTIONS = ('laplacian', 'softmax')
# The backbone's own attention defaults; every other key keeps LaplacianAttention's.
ATTN_CFG_DEFAULTS = dict(qk_shared=(True, True, True, False))


def resolve_arch(arch: Union[str, dict]) -> Dict[str, List]:
    """Validated per-stage settings of ``arch`` (a name or a dict).

    Returns a dict with four-element lists ``embed_dims``, ``num_heads``,
    ``depths`` and ``mlp_ratios``.
    """
    if isinstance(arch, str):
        name = ARCH_ALIASES.get(arch.lower(), arch.lower())
        if name not in ARCH_SETTINGS:
            raise ValueError(f'arch must be one of {sorted(ARCH_SETTINGS)} '
                             f'(or {sorted(ARCH_ALIASES)}) or a dict, got '
                             f'{arch!r}')
        settings = dict(ARCH_SETTINGS[name], mlp_ratios=4.0)
    elif isinstance(arch, dict):
        required = {'embed_dims', 'num_heads', 'depths'}
        allowed = required | {'mlp_ratios'}
        if not required <= set(arch) or not set(arch) <= allowed:
            raise ValueError(f'arch dict must have keys {sorted(required)} '
                             f'(optional: mlp_ratios), got {sorted(arch)}')
        settings = dict(arch)
        settings.setdefault('mlp_ratios', 4.0)
    else:
        raise TypeError(f'arch must be a str or a dict, got {type(arch)}')
    if (isinstance(settings['mlp_ratios'], numbers.Real)
            and not isinstance(settings['mlp_ratios'], bool)):
        settings['mlp_ratios'] = [float(settings['mlp_ratios'])] * NUM_STAGES
    for key in ('embed_dims', 'num_heads', 'depths', 'mlp_ratios'):
        value = settings[key]
        if not isinstance(value, Sequence) or len(value) != NUM_STAGES:
            raise ValueError(f'arch[{key!r}] must have {NUM_STAGES} entries, '
                             f'got {value!r}')
        # bool is an int to Python; a float width or depth fails deep inside torch, an
        # infinite ratio in int() of the MLP width.
        kinds = numbers.Real if key == 'mlp_ratios' else numbers.Integral
        if not all(isinstance(v, kinds) and not isinstance(v, bool) and v > 0
                   and math.isfinite(v) for v in value):
            what = 'finite numbers' if key == 'mlp_ratios' else 'ints'
            raise ValueError(f'arch[{key!r}] entries must be positive {what}, got '
                             f'{value!r}')
        settings[key] = list(value)
    for i, (dim, heads, ratio) in enumerate(
            zip(settings['embed_dims'], settings['num_heads'], settings['mlp_ratios'])):
        if dim % heads != 0:
            raise ValueError(f"arch: embed_dims[{i}]={dim} is not divisible "
                             f"by num_heads[{i}]={heads}")
        # torch builds a zero-width MLP without a word (its output is then the bias alone).
        if int(dim * ratio) < 1:
            raise ValueError(f"arch['mlp_ratios'][{i}]={ratio!r} gives the MLP of "
                             f'embed_dims[{i}]={dim} int({dim} * {ratio!r}) = 0 hidden '
                             f'channels; it must be at least 1/{dim}')
    return settings


def _renamed_backend_key(attn_cfg: dict) -> dict:
    """``attn_cfg`` with the key ``backend`` (the name before 2026-12) read as ``impl``.

    Configs written against the earlier release keep working, with a FutureWarning.
    """
    if 'backend' not in attn_cfg:
        return attn_cfg
    if 'impl' in attn_cfg:
        raise ValueError("attn_cfg: 'backend' is the old name of 'impl'; give only 'impl'")
    warnings.warn("attn_cfg key 'backend' is renamed 'impl'; 'backend' will be removed",
                  FutureWarning, stacklevel=4)
    attn_cfg = dict(attn_cfg)
    attn_cfg['impl'] = attn_cfg.pop('backend')
    return attn_cfg


def resolve_attn_cfg(attn_cfg: Optional[dict]) -> List[dict]:
    """LaplacianAttention keyword arguments of each stage, from the backbone's ``attn_cfg``.

    Keys not given take :data:`ATTN_CFG_DEFAULTS`, then LaplacianAttention's defaults;
    ``qk_shared`` may be one bool or one per stage. The values are checked where the
    attention modules are built.
    """
    if attn_cfg is None:
        attn_cfg = {}
    if not isinstance(attn_cfg, dict):
        raise TypeError(f'attn_cfg must be a dict or None, got {type(attn_cfg).__name__} '
                        f'{attn_cfg!r}')
    attn_cfg = _renamed_backend_key(attn_cfg)
    check_attn_cfg_keys('attn_cfg', attn_cfg)
    cfg = dict(ATTN_CFG_DEFAULTS, **attn_cfg)
    qk_shared = cfg.pop('qk_shared')
    if isinstance(qk_shared, bool):
        qk_shared = (qk_shared, ) * NUM_STAGES
    if (not isinstance(qk_shared, Sequence) or len(qk_shared) != NUM_STAGES
            or not all(isinstance(v, bool) for v in qk_shared)):
        raise TypeError(f'attn_cfg qk_shared must be a bool or {NUM_STAGES} bools (one '
                        f'per stage), got {qk_shared!r}')
    return [dict(cfg, qk_shared=shared) for shared in qk_shared]


def tokens_to_map(x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
    """(B, H*W, C) tokens -> (B, C, H, W) map.

    A view with channels-last strides, not a copy: the next stage's stride-2
    convolution reads it as is and hands back channels-last tokens.
    """
    B, _, C = x.shape
    return x.transpose(1, 2).reshape(B, C, hw[0], hw[1])


class LaplacianFormerStage(nn.Module):
    """The modules of one stage: an optional stride-2 downsampling conv, then a stack of
    blocks; :meth:`LaplacianFormer.forward` runs them, as mmdet's PVT runs its layers."""

    def __init__(self, downsample: nn.Module, blocks: List[nn.Module]):
        super().__init__()
        self.downsample = downsample
        self.blocks = nn.ModuleList(blocks)


def export_size_rule(minimum: int) -> str:
    """Why an export needs H, W >= ``minimum`` (export_min_size), for error messages."""
    return (f'every stage map with Laplacian attention must be at least its landmark grid, '
            f'so H and W must be >= {minimum} for this model (docs/deploy.md)')


@MODELS.register_module()
class LaplacianFormer(BaseModule):
    """LaplacianFormer backbone (Laplacian-kernel linear attention pyramid).

    Args:
        arch (str | dict): 'tiny', 'small', 'medium', 'large', 'huge' (or
            't'/'s'/'m'/'l'/'h'), or a dict with four-element lists
            ``embed_dims``, ``num_heads``, ``depths`` and optional
            ``mlp_ratios`` (a number or four numbers; default 4).
        in_channels (int): Input image channels. Default 3.
        out_indices (Sequence[int]): Stages (0 to ``num_stages`` - 1) whose
            maps are returned, at strides 4, 8, 16, 32. Default (0, 1, 2, 3).
        qkv_bias (bool): Bias in the q/k/v projections. Default True.
        drop_rate (float): Dropout after the MLP and attention projections.
        attn_drop_rate (float): Dropout on attention weights.
        drop_path_rate (float): Stochastic depth at the last block, in
            [0, 1); rises linearly from 0 over all blocks. Default 0.1.
        attn_cfg (dict | None): Options of the Laplacian attention: the
            keyword-only arguments of :class:`LaplacianAttention`, which
            describes them and whose defaults apply to keys left out:
            ``lam`` (λ), ``landmark_grid``, ``kernel`` ('laplacian' |
            'gaussian'), ``normalize`` ('injective' | 'none'), ``solver``
            ('newton' | 'exact' | 'cg'), ``iters`` (solver iterations),
            ``ns_init``, ``ns_refine``, ``eps``, ``whiten_eps``, ``impl``,
            ``global_term`` (False only in the ablations' control) and
            ``qk_shared``. An unknown key raises ValueError. Here
            ``qk_shared`` is one bool or one per stage, default
            (True, True, True, False): keys tied to queries in stages 1-3
            (the SOFT layout), separate in stage 4, which lands on the
            paper's Medium size (docs/model_size.md).
        norm_cfg (dict): Norm of the tokens (the blocks' two pre-norms and
            each stage's closing norm), as in mmdet's PVT; it must normalise the last
            dimension of (B, N, C). Default dict(type='LN').
        act_cfg (dict): Activation of the MLPs. Default dict(type='GELU').
        conv_norm_cfg (dict): Norm of the stem's and the downsampling
            convolutions (NCHW maps), e.g. dict(type='SyncBN') for
            multi-GPU training. Default dict(type='BN').
        conv_act_cfg (dict): Activation of those convolutions. Default
            dict(type='ReLU', inplace=True).
            The four layer configs are built by mmcv's build_norm_layer /
            build_activation_layer when mmcv is installed (any type in its
            registry); without mmcv, from ``layers.TORCH_NORMS`` and
            ``layers.TORCH_ACTIVATIONS``.
        stage4_attention (str): 'laplacian' (the same attention as stages
            1-3, so the cost stays linear in pixels; the default) or
            'softmax' (plain multi-head attention with separate q, k, v, the
            SOFT layout; ``attn_cfg`` does not apply to it).
        frozen_stages (int): -1 freezes nothing, 0 the stem, k >= 1 the stem
            and stages 1..k (with their closing norms). At most ``num_stages``.
        norm_eval (bool): Keep BatchNorm layers (of ``conv_norm_cfg``) in
            eval mode during training. Default False.
        with_cp (bool): Gradient checkpointing of each block. Default False.
        pretrained (str | None): Deprecated spelling of a ``Pretrained``
            init_cfg (mmseg's ``EncoderDecoder(pretrained=...)`` passes it).
        init_cfg (dict | list[dict] | None): ``dict(type='Pretrained',
            checkpoint=...)`` loads a plain state dict, an mmengine checkpoint
            or a classifier/detector checkpoint (``backbone.`` prefix, or
            the ``prefix`` given in the dict), loaded with
            ``weights_only=True`` (to ``map_location``, default 'cpu');
            missing/unexpected keys are logged. One such entry at most, with
            the keys of mmengine's ``Pretrained``: type, checkpoint, prefix,
            map_location.
        num_stages (int): Build the stem and the first ``num_stages`` stages
            (1-4), as mmdet's PVT (last in the signature, so positional calls keep
            their meaning); the per-stage settings (``arch``,
            ``qk_shared``) keep four entries and the first ones apply, so a
            checkpoint of the four-stage model loads into it (the keys of the
            stages left out are reported as unexpected). Default 4.
    """

    def __init__(self,
                 arch: Union[str, dict] = 'tiny',
                 in_channels: int = 3,
                 out_indices: Sequence[int] = (0, 1, 2, 3),
                 qkv_bias: bool = True,
                 drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.1,
                 attn_cfg: Optional[dict] = None,
                 norm_cfg: dict = dict(type='LN'),
                 act_cfg: dict = dict(type='GELU'),
                 conv_norm_cfg: dict = dict(type='BN'),
                 conv_act_cfg: dict = dict(type='ReLU', inplace=True),
                 stage4_attention: str = 'laplacian',
                 frozen_stages: int = -1,
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[Union[dict, List[dict]]] = None,
                 num_stages: int = NUM_STAGES):
        if not (pretrained is None or isinstance(pretrained, str)):
            raise TypeError(f'pretrained must be a str (a checkpoint path) or None, got '
                            f'{type(pretrained).__name__} {pretrained!r}')
        if pretrained == '':
            # Else a Pretrained init_cfg without a checkpoint, refused only by init_weights.
            raise ValueError("pretrained='' is not a checkpoint path: give one, or None (the "
                             'default) to start from the default initialisation')
        if pretrained is not None:
            if init_cfg is not None:
                raise ValueError('give either pretrained or init_cfg, not '
                                 f'both (pretrained={pretrained!r}, '
                                 f'init_cfg={init_cfg!r}); for another checkpoint where '
                                 'the config has a Pretrained init_cfg, set '
                                 'model.backbone.init_cfg.checkpoint=PATH; an mmseg '
                                 "segmentor's model.pretrained comes here as pretrained: "
                                 'set model.pretrained=None')
            # A UserWarning, as mmdet's PVT and Swin: Python hides DeprecationWarnings
            # raised outside __main__.
            warnings.warn('LaplacianFormer: pretrained= is deprecated, use '
                          "init_cfg=dict(type='Pretrained', checkpoint=...)")
            init_cfg = dict(type='Pretrained', checkpoint=pretrained)
        self._check_init_cfg(init_cfg)
        super().__init__(init_cfg=init_cfg)
        self.arch_settings = resolve_arch(arch)
        if (not isinstance(num_stages, int) or isinstance(num_stages, bool)
                or not 1 <= num_stages <= NUM_STAGES):
            raise ValueError(f'num_stages must be an int in [1, {NUM_STAGES}], got '
                             f'{num_stages!r}')
        self.num_stages = num_stages
        self.out_indices = self._check_out_indices(out_indices, num_stages)
        last = max(self.out_indices) + 1
        if last < num_stages:
            stages = f'stage {num_stages}' if last + 1 == num_stages else \
                f'stages {last + 1}-{num_stages}'
            warnings.warn(
                f'LaplacianFormer: out_indices={self.out_indices} returns no map of {stages}, '
                'built but not run, so its parameters get no gradient (DistributedDataParallel '
                f'then needs find_unused_parameters=True): num_stages={last} leaves it out')
        if (not isinstance(frozen_stages, int) or isinstance(frozen_stages, bool)
                or not -1 <= frozen_stages <= num_stages):
            raise ValueError(f'frozen_stages must be an int in [-1, '
                             f'{num_stages}] (num_stages={num_stages}), got '
                             f'{frozen_stages!r}')
        for name, rate in (('drop_rate', drop_rate), ('attn_drop_rate', attn_drop_rate),
                           ('drop_path_rate', drop_path_rate)):
            if not isinstance(rate, numbers.Real) or isinstance(rate, bool):
                raise TypeError(f'{name} must be a number in [0, 1), got '
                                f'{type(rate).__name__} {rate!r}')
            if not 0.0 <= rate < 1.0:
                raise ValueError(f'{name} must be in [0, 1), got {rate!r}')
        for name, flag in (('qkv_bias', qkv_bias), ('norm_eval', norm_eval),
                           ('with_cp', with_cp)):
            check_bool(name, flag)
        if stage4_attention not in STAGE4_ATTENTIONS:
            raise ValueError(f'stage4_attention must be one of '
                             f'{STAGE4_ATTENTIONS}, got {stage4_attention!r}')
        if (not isinstance(in_channels, int) or isinstance(in_channels, bool)
                or in_channels < 1):
            raise ValueError(
                f'in_channels must be a positive int, got {in_channels!r}')
        self.in_channels = in_channels
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.with_cp = with_cp
        self.stage4_attention = stage4_attention
        stage_attn_cfgs = resolve_attn_cfg(attn_cfg)
        self.qk_shared = tuple(cfg['qk_shared'] for cfg in stage_attn_cfgs)

        dims = self.arch_settings['embed_dims']
        depths = self.arch_settings['depths'][:num_stages]
        # On the CPU whatever the default device: check_model_cfg builds the model on the
        # meta device, whose tensors have no values to list.
        block_dpr = torch.linspace(0, drop_path_rate, sum(depths), device='cpu').tolist()
        common = dict(qkv_bias=qkv_bias, attn_drop=attn_drop_rate, proj_drop=drop_rate)

        # Every width at once: each layer's build would name only its own.
        check_group_norm('conv_norm_cfg', conv_norm_cfg,
                         [STEM_HIDDEN_CHANNELS] + list(dims[:num_stages]))
        self.stem = ConvStem(in_channels, dims[0], conv_norm_cfg, conv_act_cfg)
        self.stages = nn.ModuleList()
        first_block = 0
        for i in range(num_stages):
            heads = self.arch_settings['num_heads'][i]
            use_softmax = (i == NUM_STAGES - 1 and stage4_attention == 'softmax')
            blocks = [
                TransformerBlock(
                    dims[i],
                    SoftmaxAttention(dims[i], heads, **common) if use_softmax else
                    LaplacianAttention(dims[i], heads, **common, **stage_attn_cfgs[i]),
                    norm_cfg,
                    act_cfg,
                    mlp_ratio=self.arch_settings['mlp_ratios'][i],
                    drop=drop_rate,
                    drop_path_prob=block_dpr[first_block + j])
                for j in range(depths[i])
            ]
            first_block += depths[i]
            downsample = (
                nn.Identity() if i == 0 else conv_norm_act(
                    dims[i - 1], dims[i], 2, conv_norm_cfg, conv_act_cfg))
            self.stages.append(LaplacianFormerStage(downsample, blocks))
        for i in range(num_stages):
            self.add_module(f'norm{i}', build_token_norm(norm_cfg, dims[i]))
        self._freeze_stages()

    @staticmethod
    def _check_init_cfg(init_cfg) -> None:
        entries = init_cfg_entries(init_cfg)
        if not all(isinstance(e, dict) for e in entries):
            hint = (' (--cfg-options passes a dict as a string: give a checkpoint with '
                    'model.backbone.init_cfg.checkpoint=PATH where the config has a Pretrained '
                    'init_cfg, or model.backbone.pretrained=PATH where its init_cfg is None)'
                    if isinstance(init_cfg, str) else '')
            raise TypeError(f'init_cfg must be a dict, a list of dicts or None, got '
                            f'{type(init_cfg).__name__} {init_cfg!r}{hint}')
        names = ([f'init_cfg[{i}]' for i in range(len(entries))]
                 if isinstance(init_cfg, list) else ['init_cfg'])
        pretrained = [(name, e) for name, e in zip(names, entries) if is_pretrained_cfg(e)]
        if len(pretrained) > 1:
            # init_weights loads one checkpoint: the others would be dropped without a word.
            raise ValueError(f'init_cfg has {len(pretrained)} Pretrained entries '
                             f'({", ".join(name for name, _ in pretrained)}): the backbone '
                             f'loads one checkpoint; keep one, got {init_cfg!r}')
        for name, entry in pretrained:
            # mmengine leaves _delete_ in a dict whose _base_ had nothing there to replace.
            unknown = sorted(set(entry) - set(PRETRAINED_KEYS) - {'_delete_'})
            if unknown:
                raise ValueError(f'{name}={entry!r}: unknown key(s) '
                                 f'{", ".join(map(repr, unknown))} in a Pretrained entry; '
                                 f'allowed: {", ".join(PRETRAINED_KEYS)}')

    @staticmethod
    def _check_out_indices(out_indices: Sequence[int],
                           num_stages: int = NUM_STAGES) -> Tuple[int, ...]:
        if isinstance(out_indices, int):
            out_indices = (out_indices, )
        if (not isinstance(out_indices, Sequence) or not out_indices
                or not all(isinstance(i, int) and not isinstance(i, bool)
                           for i in out_indices)):
            raise TypeError('out_indices must be a non-empty sequence of '
                            f'ints, got {out_indices!r}')
        given = tuple(out_indices)
        out_indices = tuple(i + num_stages if i < 0 else i
                            for i in out_indices)
        if not all(0 <= i < num_stages for i in out_indices):
            raise ValueError(f'out_indices must be in [0, {num_stages}) (or '
                             f'negative from the end) with num_stages={num_stages}, '
                             f'got {given!r}')
        if len(set(out_indices)) != len(out_indices):
            raise ValueError(
                f'out_indices must not repeat, got {out_indices!r}')
        return tuple(sorted(out_indices))

    @property
    def embed_dims(self) -> List[int]:
        """Channels of the stage outputs (``num_stages`` of them)."""
        return list(self.arch_settings['embed_dims'][:self.num_stages])

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """(B, C_in, H, W) -> maps (B, C_i, ~H/s_i, ~W/s_i), s_i = 4, 8, 16, 32.

        Spatial sizes round up at each stride-2 step, so any H, W >= 1 works; B >= 1 (an
        empty batch is an error, where mmdet's PVTv2 returns empty maps).
        """
        self._check_input(x)
        export = exporting()
        if export:
            self._check_export_range(x)
        x = self.stem(x)
        outs = []
        for i, stage in enumerate(self._stages_run()):
            x = stage.downsample(x)
            # Python ints for the attention's checks, also under the FLOP counter's jit trace
            # (its sizes are tensors); symbolic while exporting, where int() would freeze
            # every reshape of the graph to the example size.
            hw = (x.shape[2], x.shape[3]) if export else (int(x.shape[2]), int(x.shape[3]))
            # Contiguous tokens once per stage: every residual add and norm of the
            # stage would otherwise stride through a transposed view.
            x = x.flatten(2).transpose(1, 2).contiguous()
            for block in stage.blocks:
                if self.with_cp and x.requires_grad:
                    x = cp.checkpoint(block, x, hw, use_reentrant=False)
                else:
                    x = block(x, hw)
            # Every stage ends with its norm, returned or not, as mmdet's PVT: the
            # stream, and so a classifier's weights, do not depend on out_indices.
            x = tokens_to_map(getattr(self, f'norm{i}')(x), hw)
            if i in self.out_indices:
                # Contiguous NCHW: mmcv's RoIAlign (and other ops that index raw
                # memory) read channels-last strides as garbage.
                outs.append(x.contiguous())
        return tuple(outs)

    def get_layer_depth(self, param_name: str, prefix: str = '') -> Tuple[int, int]:
        """(depth, number of depths) of a parameter, for mmpretrain's layer-wise learning
        rate decay (``LearningRateDecayOptimWrapperConstructor``), as its Swin's: the stem
        0, the blocks 1, 2, ... in order, a stage's downsampling and its norm with the
        blocks before and after, everything else (a head: names without ``prefix``) the
        last."""
        depths = self.arch_settings['depths'][:self.num_stages]
        num_layers = sum(depths) + 2
        if not param_name.startswith(prefix):
            return num_layers - 1, num_layers
        parts = param_name[len(prefix):].split('.')
        if parts[0] == 'stem':
            return 0, num_layers
        if parts[0].startswith('norm') and parts[0][4:].isdigit():
            return sum(depths[:int(parts[0][4:]) + 1]), num_layers
        if parts[0] == 'stages':
            stage = int(parts[1])
            if parts[2] == 'blocks':
                return sum(depths[:stage]) + int(parts[3]) + 1, num_layers
            return sum(depths[:stage]), num_layers
        return num_layers - 1, num_layers

    def _stages_run(self) -> nn.ModuleList:
        """The stages forward runs: up to the last one returned."""
        return self.stages[:max(self.out_indices) + 1]

    def export_min_size(self) -> int:
        """The smallest image height (and width) this backbone exports for.

        Every stage with Laplacian attention must be at least its landmark grid g × g:
        stage i maps are ceil(H / s_i) with s_i = :data:`STAGE_STRIDES`, so
        H >= (g - 1)·s_i + 1 (193 for g = 7 in all four stages, 97 with
        ``stage4_attention='softmax'``). Eager calls take any size (the grid is clipped
        to the map); the export form keeps m = g² landmarks, a static shape
        (docs/deploy.md).
        """
        minimum = 1
        for stride, stage in zip(STAGE_STRIDES, self._stages_run()):
            for block in stage.blocks:
                if isinstance(block.attn, LaplacianAttention):
                    minimum = max(minimum, (block.attn.landmark_grid - 1) * stride + 1)
        return minimum

    @trace_quiet
    def _check_input(self, x: torch.Tensor) -> None:
        """A floating (B, in_channels, H, W) batch, else an error saying what is wrong."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f'LaplacianFormer input must be a torch.Tensor, got '
                            f'{type(x).__name__}')
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f'LaplacianFormer input must be (B, {self.in_channels}, H, W) '
                f'(in_channels={self.in_channels}), got shape {tuple(x.shape)}')
        if not x.is_floating_point():
            raise TypeError(f'LaplacianFormer input must be a floating-point '
                            f'tensor (normalise images first), got dtype {x.dtype}')
        weight = self.stem[0][0].weight
        autocast = torch.is_autocast_enabled(x.device.type)
        double = x.dtype == torch.float64, weight.dtype == torch.float64
        if autocast:
            # autocast casts a 16- or 32-bit input and the weights to its dtype, and leaves
            # float64 alone: one float64 side is then a mismatch.
            fits = double[0] == double[1]
        else:
            fits = x.dtype == weight.dtype
        if not fits:
            # torch's convolution names neither side ("expected scalar type Half but found
            # Float").
            hint = '' if autocast or any(double) else ', or run under torch.autocast'
            raise TypeError(f'LaplacianFormer input has dtype {x.dtype} but its weights '
                            f'{weight.dtype}: cast the input (x.to({weight.dtype})) or the '
                            f'model{hint}')
        # mmdet's PVTv2 returns empty maps for an empty batch; here the attention's reshapes
        # would fail deep inside, so it is refused by name.
        if x.shape[0] == 0:
            raise ValueError(f'LaplacianFormer input batch size must be >= 1, got 0 (shape '
                             f'{tuple(x.shape)})')
        if x.shape[2] == 0 or x.shape[3] == 0:
            raise ValueError(f'LaplacianFormer input height and width must be >= 1, got '
                             f'{x.shape[2]}x{x.shape[3]} (shape {tuple(x.shape)})')
        if self.training and x.shape[0] == 1:
            self._check_batch_norm_sizes(x.shape[2], x.shape[3])

    def _check_batch_norm_sizes(self, height: int, width: int) -> None:
        """A batch of one image whose smallest map with a BatchNorm (the last stage run's
        downsampling, or the stem's) is 1×1: torch's error ("Expected more than 1 value per
        channel") would name neither the layer nor the rule."""
        run = self._stages_run()
        stride = STAGE_STRIDES[len(run) - 1]
        if -(-height // stride) > 1 or -(-width // stride) > 1:
            return
        norm = next((m for part in (self.stem, run) for m in part.modules()
                     if isinstance(m, _BatchNorm) and m.training), None)
        if norm is None:
            return
        raise ValueError(
            f'a training batch of one {height}x{width} image makes the stride-{stride} map '
            f'1x1, where the {type(norm).__name__} of conv_norm_cfg has a single value per '
            f'channel: train with images over {stride} px on a side, batches of 2 or more, '
            "or conv_norm_cfg=dict(type='GN', num_groups=...)")

    @trace_quiet
    def _check_export_range(self, x: torch.Tensor) -> None:
        """While exporting: refuse an input size, or a torch.export range, that reaches below
        export_min_size(), or a torch.export Dim on one side only.

        The export form keeps m = g² landmarks at every size, so a smaller example would
        trace a wrong graph without a word (the TorchScript exporter), and a user's
        ``Dim('h', min=100)`` would fail deep in the trace with a constraint violation that
        names a derived guard, not the rule.
        """
        from torch.fx.experimental.symbolic_shapes import statically_known_true
        minimum = self.export_min_size()
        rule = export_size_rule(minimum)
        height, width = x.shape[2], x.shape[3]
        symbolic = isinstance(height, torch.SymInt), isinstance(width, torch.SymInt)
        if not any(symbolic):
            # Static sizes: the TorchScript exporter, or torch.export without Dims.
            if min(int(height), int(width)) < minimum:
                raise ValueError(f'cannot export at the input size {int(height)}×{int(width)}: '
                                 f'{rule}; export with a larger example input')
            return
        if not all(symbolic):
            # Each stage splits its N = H·W tokens into H × W; with one side static, N is
            # e.g. 74·x + 74 and torch.export cannot prove (74·x + 74) % (x + 1) == 0 (its
            # sympy keeps the product expanded).
            side = 'height' if symbolic[0] else 'width'
            raise ValueError(
                f'only the {side} of the input has a torch.export Dim: give both H and W a Dim '
                f"(dynamic_shapes=({{2: Dim('h', min={minimum}, ...), 3: Dim('w', "
                f"min={minimum}, ...)}}, )), two separate ones, or neither; with one static "
                'side torch.export cannot prove that the stages split their H·W tokens into '
                'H × W (docs/deploy.md)')
        for name, size in (('H', height), ('W', width)):
            if not statically_known_true(size >= minimum):
                raise ValueError(
                    f'the export range of the input {name} reaches below {minimum}: {rule}; '
                    f'declare Dim(..., min={minimum}) or more')

    def _frozen_modules(self) -> List[nn.Module]:
        if self.frozen_stages < 0:
            return []
        modules = [self.stem]
        for i in range(self.frozen_stages):
            modules += [self.stages[i], getattr(self, f'norm{i}')]
        return modules

    def _freeze_stages(self) -> None:
        for module in self._frozen_modules():
            module.eval()
            for param in module.parameters():
                param.requires_grad = False

    def train(self, mode: bool = True) -> 'LaplacianFormer':
        """Switch mode, keeping frozen stages and (norm_eval) BNs in eval."""
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for module in self.modules():
                if isinstance(module, _BatchNorm):
                    module.eval()
        return self

    def _pretrained_cfg(self) -> Optional[dict]:
        for cfg in init_cfg_entries(self.init_cfg):
            if is_pretrained_cfg(cfg):
                if not cfg.get('checkpoint'):
                    raise ValueError("init_cfg of type 'Pretrained' needs a "
                                     f"'checkpoint', got {cfg!r}")
                return cfg
        return None

    def init_weights(self) -> None:
        """Default initialisation, then the other ``init_cfg`` entries, then the
        ``Pretrained`` checkpoint if any (mmengine's order). An entry with a
        ``checkpoint`` and no ``type`` is a ``Pretrained`` one, as for mmdet's PVT."""
        pretrained = self._pretrained_cfg()
        self.apply(init_layer)
        others = [cfg for cfg in init_cfg_entries(self.init_cfg) if not is_pretrained_cfg(cfg)]
        if others:
            initialize(self, others)
        if pretrained is not None:
            load_backbone_weights(
                self,
                pretrained['checkpoint'],
                logger=MMLogger.get_current_instance(),
                prefix=pretrained.get('prefix'),
                map_location=pretrained.get('map_location', 'cpu'))
        self._is_init = True


def init_cfg_entries(init_cfg) -> list:
    """An ``init_cfg`` (None, one entry or a list) as a list of its entries."""
    if init_cfg is None:
        return []
    return list(init_cfg) if isinstance(init_cfg, list) else [init_cfg]


def init_layer(module: nn.Module) -> None:
    """Truncated-normal linears, unit LayerNorm/BN/GN, fan-out convs."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, (nn.LayerNorm, _BatchNorm, nn.GroupNorm)):
        if module.weight is not None:
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Conv2d):
        fan_out = (module.kernel_size[0] * module.kernel_size[1] *
                   module.out_channels // module.groups)
        nn.init.normal_(module.weight, 0.0, (2.0 / fan_out)**0.5)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
