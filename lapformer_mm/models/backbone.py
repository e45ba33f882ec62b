"""LaplacianFormer: a four-stage pyramid of Laplacian-kernel attention blocks, laid out after
SOFT/SOFT++ (docs/design.md §3): a convolutional stem to stride 4, then four stages of pre-norm
transformer blocks on the (B, H*W, C) tokens of their grid, stages 2-4 after a 3x3 stride-2
conv-norm-act."""
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

from ..ops._checks import check_bool
from ..ops.export import exporting
from .attention import LaplacianAttention
from .layers import ConvStem, SoftmaxAttention, TransformerBlock, build_token_norm, conv_norm_act
from .pretrained import PRETRAINED_KEYS, is_pretrained_cfg, load_backbone_weights

ARCH_SETTINGS: Dict[str, Dict[str, List[int]]] = {
    'tiny': dict(embed_dims=[64, 128, 320, 512], num_heads=[2, 4, 10, 16], depths=[1, 2, 3, 2]),
    'small': dict(embed_dims=[64, 128, 320, 512], num_heads=[2, 4, 10, 16], depths=[1, 3, 20, 4]),
    'medium': dict(embed_dims=[64, 128, 288, 512], num_heads=[2, 4, 9, 16], depths=[1, 3, 29, 5]),
    'large': dict(embed_dims=[64, 128, 320, 512], num_heads=[2, 4, 10, 16], depths=[1, 3, 40, 5]),
    'huge': dict(embed_dims=[64, 128, 352, 512], num_heads=[2, 4, 11, 16], depths=[1, 5, 49, 5]),
}
ARCH_ALIASES = {'t': 'tiny', 's': 'small', 'm': 'medium', 'l': 'large', 'h': 'huge'}
NUM_STAGES = 4
#: Output strides of the four stages (the stem's 4, then one stride-2 conv per stage).
STAGE_STRIDES = (4, 8, 16, 32)
STAGE4_ATTENTIONS = ('laplacian', 'softmax')
# The backbone's own attention defaults; every other key keeps LaplacianAttention's.
ATTN_CFG_DEFAULTS = dict(qk_shared=(True, True, True, False))


def resolve_arch(arch: Union[str, dict]) -> Dict[str, List]:
    if isinstance(arch, str):
        name = ARCH_ALIASES.get(arch.lower(), arch.lower())
        if name not in ARCH_SETTINGS:
            raise ValueError(f'arch must be one of {sorted(ARCH_SETTINGS)} (or '
                             f'{sorted(ARCH_ALIASES)}) or a dict, got {arch!r}')
        arch = ARCH_SETTINGS[name]
    # Unknown keys would be ignored without a word.
    if set(arch) - {'embed_dims', 'num_heads', 'depths', 'mlp_ratios'}:
        raise ValueError(f"arch dict takes embed_dims, num_heads, depths and mlp_ratios, got "
                         f'{sorted(arch)}')
    ratios = arch.get('mlp_ratios', 4.0)
    if isinstance(ratios, numbers.Real) and not isinstance(ratios, bool):
        ratios = [float(ratios)] * NUM_STAGES
    settings = dict(embed_dims=arch['embed_dims'], num_heads=arch['num_heads'],
                    depths=arch['depths'], mlp_ratios=ratios)
    for key, values in settings.items():
        kind = numbers.Real if key == 'mlp_ratios' else numbers.Integral
        # A float width fails deep in torch, a bool is an int, an infinite ratio overflows
        # int() of the MLP width, a tiny one builds a zero-width MLP without a word.
        if (not isinstance(values, Sequence) or len(values) != NUM_STAGES or not all(
                isinstance(v, kind) and not isinstance(v, bool) and 0 < v < math.inf
                for v in values)):
            raise ValueError(f'arch[{key!r}] must be {NUM_STAGES} positive '
                             f'{"numbers" if key == "mlp_ratios" else "ints"}, got {values!r}')
        settings[key] = list(values)
    for i, (dim, ratio) in enumerate(zip(settings['embed_dims'], settings['mlp_ratios'])):
        if int(dim * ratio) < 1:
            raise ValueError(f"arch['mlp_ratios'][{i}]={ratio!r} gives embed_dims[{i}]={dim} a "
                             'zero-width MLP')
    return settings


def resolve_attn_cfg(attn_cfg: Optional[dict]) -> List[dict]:
    cfg = dict(ATTN_CFG_DEFAULTS, **(attn_cfg or {}))
    if 'backend' in cfg:  # the name before 2026-12
        if 'impl' in cfg:
            raise ValueError("attn_cfg: 'backend' is the old name of 'impl'; give only 'impl'")
        warnings.warn("attn_cfg key 'backend' is renamed 'impl'; 'backend' will be removed",
                      FutureWarning, stacklevel=3)
        cfg['impl'] = cfg.pop('backend')
    qk_shared = cfg.pop('qk_shared')
    if isinstance(qk_shared, bool):
        qk_shared = (qk_shared, ) * NUM_STAGES
    if len(qk_shared) != NUM_STAGES:  # each is checked by its attention
        raise ValueError(f'attn_cfg qk_shared must be a bool or {NUM_STAGES} bools, got '
                         f'{qk_shared!r}')
    return [dict(cfg, qk_shared=shared) for shared in qk_shared]


def tokens_to_map(x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
    """(B, H*W, C) tokens -> (B, C, H, W) map: a view with channels-last strides, which the next
    stage's stride-2 convolution reads as is and hands back as channels-last tokens."""
    B, _, C = x.shape
    return x.transpose(1, 2).reshape(B, C, hw[0], hw[1])


class LaplacianFormerStage(nn.Module):
    """A stage's downsampling conv and blocks; :meth:`LaplacianFormer.forward` runs them."""

    def __init__(self, downsample: nn.Module, blocks: List[nn.Module]):
        super().__init__()
        self.downsample = downsample
        self.blocks = nn.ModuleList(blocks)


@MODELS.register_module()
class LaplacianFormer(BaseModule):
    """LaplacianFormer backbone, with the arguments of mmdet's PVT and Swin where they mean the
    same (docs/backbone.md describes each): ``arch`` a name or a dict of four-element lists;
    ``attn_cfg`` :class:`LaplacianAttention`'s keyword-only arguments, ``qk_shared`` one bool
    or one per stage; ``norm_cfg`` norms the tokens, ``conv_norm_cfg`` the NCHW maps."""

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
        if pretrained is not None:
            if not isinstance(pretrained, str) or not pretrained or init_cfg is not None:
                raise ValueError(f'pretrained must be a checkpoint path, given without init_cfg '
                                 "(an mmseg segmentor's model.pretrained comes here: set it to "
                                 f'None), got {pretrained!r} and init_cfg={init_cfg!r}')
            # A UserWarning, as mmdet's PVT and Swin: Python hides DeprecationWarnings
            # raised outside __main__.
            warnings.warn('LaplacianFormer: pretrained= is deprecated, use '
                          "init_cfg=dict(type='Pretrained', checkpoint=...)")
            init_cfg = dict(type='Pretrained', checkpoint=pretrained)
        self._check_init_cfg(init_cfg)
        super().__init__(init_cfg=init_cfg)
        self.arch_settings = resolve_arch(arch)
        if num_stages not in range(1, NUM_STAGES + 1):
            raise ValueError(f'num_stages must be in [1, {NUM_STAGES}], got {num_stages!r}')
        self.num_stages = num_stages
        self.out_indices = self._check_out_indices(out_indices, num_stages)
        last = max(self.out_indices) + 1
        if last < num_stages:
            unused = ', '.join(str(i + 1) for i in range(last, num_stages))
            warnings.warn(
                f'LaplacianFormer: out_indices={self.out_indices} returns no map of stages '
                f'{unused}, built but not run, so their parameters get no gradient '
                '(DistributedDataParallel then needs find_unused_parameters=True): '
                f'num_stages={last} leaves them out')
        # -2 would freeze nothing, num_stages + 1 fail in an IndexError.
        if frozen_stages not in range(-1, num_stages + 1):
            raise ValueError(f'frozen_stages must be in [-1, {num_stages}], got '
                             f'{frozen_stages!r}')
        if stage4_attention not in STAGE4_ATTENTIONS:  # else Laplacian without a word
            raise ValueError(f'stage4_attention must be one of {STAGE4_ATTENTIONS}, got '
                             f'{stage4_attention!r}')
        self.in_channels = in_channels
        self.frozen_stages = frozen_stages
        self.norm_eval = check_bool('norm_eval', norm_eval)
        self.with_cp = check_bool('with_cp', with_cp)
        self.stage4_attention = stage4_attention
        stage_attn_cfgs = resolve_attn_cfg(attn_cfg)
        self.qk_shared = tuple(cfg['qk_shared'] for cfg in stage_attn_cfgs)

        dims = self.arch_settings['embed_dims']
        depths = self.arch_settings['depths'][:num_stages]
        # On the CPU whatever the default device: check_model_cfg builds the model on the
        # meta device, whose tensors have no values to list.
        block_dpr = torch.linspace(0, drop_path_rate, sum(depths), device='cpu').tolist()
        common = dict(qkv_bias=qkv_bias, attn_drop=attn_drop_rate, proj_drop=drop_rate)
        self.stem = ConvStem(in_channels, dims[0], conv_norm_cfg, conv_act_cfg)
        self.stages = nn.ModuleList()
        first_block = 0
        for i in range(num_stages):
            heads = self.arch_settings['num_heads'][i]
            use_softmax = (i == NUM_STAGES - 1 and stage4_attention == 'softmax')
            blocks = [TransformerBlock(
                dims[i], SoftmaxAttention(dims[i], heads, **common) if use_softmax else
                LaplacianAttention(dims[i], heads, **common, **stage_attn_cfgs[i]), norm_cfg,
                act_cfg, self.arch_settings['mlp_ratios'][i], drop_rate,
                block_dpr[first_block + j]) for j in range(depths[i])]
            first_block += depths[i]
            downsample = nn.Identity() if i == 0 else conv_norm_act(
                dims[i - 1], dims[i], 2, conv_norm_cfg, conv_act_cfg)
            self.stages.append(LaplacianFormerStage(downsample, blocks))
        for i in range(num_stages):
            self.add_module(f'norm{i}', build_token_norm(norm_cfg, dims[i]))
        self._freeze_stages()

    @staticmethod
    def _check_init_cfg(init_cfg) -> None:
        # init_weights loads one checkpoint and reads mmengine's keys, dropping others unseen.
        entries = init_cfg_entries(init_cfg)
        if not all(isinstance(e, dict) for e in entries):
            raise TypeError(f'init_cfg must be a dict, a list of dicts or None, got '
                            f'{init_cfg!r} (a checkpoint from --cfg-options: '
                            'model.backbone.init_cfg.checkpoint=PATH)')
        pretrained = [e for e in entries if is_pretrained_cfg(e)]
        # mmengine leaves _delete_ in a dict whose _base_ had nothing there to replace.
        if len(pretrained) > 1 or any(
                not e.get('checkpoint') or set(e) - set(PRETRAINED_KEYS) - {'_delete_'}
                for e in pretrained):
            raise ValueError(f'init_cfg: one Pretrained entry at most, with a checkpoint and '
                             f'the keys {", ".join(PRETRAINED_KEYS)}; got {init_cfg!r}')

    @staticmethod
    def _check_out_indices(out_indices: Sequence[int],
                           num_stages: int = NUM_STAGES) -> Tuple[int, ...]:
        if isinstance(out_indices, int):
            out_indices = (out_indices, )
        indices = sorted({i + num_stages if isinstance(i, int) and i < 0 else i
                          for i in out_indices})
        if (not indices or len(indices) != len(out_indices)
                or not all(isinstance(i, int) and 0 <= i < num_stages for i in indices)):
            raise ValueError(f'out_indices must be distinct ints in [0, {num_stages}) (or '
                             f'negative from the end), got {out_indices!r}')
        return tuple(indices)

    @property
    def embed_dims(self) -> List[int]:
        return list(self.arch_settings['embed_dims'][:self.num_stages])

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """(B, C_in, H, W) -> maps (B, C_i, ~H/s_i, ~W/s_i), s_i = 4, 8, 16, 32.

        Spatial sizes round up at each stride-2 step, so any H, W >= 1 works eagerly.
        """
        export = exporting()
        if export:
            self._check_export_size(x)
        x = self.stem(x)
        outs = []
        for i, stage in enumerate(self._stages_run()):
            x = stage.downsample(x)
            # Symbolic while exporting, where int() would freeze every reshape of the graph
            # to the example size; Python ints otherwise, also under the FLOP counter's jit
            # trace (its sizes are tensors).
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
        """(depth, number of depths) of a parameter for mmpretrain's layer-wise learning rate
        decay, as its Swin's: the stem 0, the blocks 1, 2, ... in order, a stage's downsampling
        and norm with the blocks around, the rest (a head) the last."""
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
        return self.stages[:max(self.out_indices) + 1]

    def export_min_size(self) -> int:
        """The smallest H (and W) this backbone exports for: the export form keeps m = g²
        landmarks (eager calls clip the grid to the map), so every stage with Laplacian
        attention must be at least g × g: H >= (g - 1)·s_i + 1 at stride s_i (193 for g = 7)."""
        minimum = 1
        for stride, stage in zip(STAGE_STRIDES, self._stages_run()):
            for block in stage.blocks:
                if isinstance(block.attn, LaplacianAttention):
                    minimum = max(minimum, (block.attn.landmark_grid - 1) * stride + 1)
        return minimum

    def _check_export_size(self, x: torch.Tensor) -> None:
        """H, W >= :meth:`export_min_size` while exporting: the export form keeps m = g²
        landmarks, so a smaller example would trace a wrong graph without a word; torch.export
        narrows a dynamic range to it, or refuses a user's Dim that reaches below."""
        sizes = x.shape[2:]
        if torch.jit.is_tracing():  # the TorchScript exporter's: the example's, as tensors
            with warnings.catch_warnings():
                warnings.simplefilter('ignore', torch.jit.TracerWarning)
                sizes = [int(size) for size in sizes]
        if sum(isinstance(size, torch.SymInt) for size in sizes) == 1:
            # The stages' N = H·W is then e.g. 74·x + 74, and torch.export cannot prove that
            # it splits into H × W: a failure deep in the trace otherwise.
            raise ValueError('give the height and the width of the input each a torch.export '
                             'Dim, or neither (docs/deploy.md)')
        minimum = self.export_min_size()
        for size in sizes:
            torch._check(size >= minimum, lambda: (
                f'H and W must be >= {minimum} to export this model (export_min_size: every '
                'stage map with Laplacian attention at least its landmark grid; docs/deploy.md)'))

    def _freeze_stages(self) -> None:
        frozen = [] if self.frozen_stages < 0 else [self.stem]
        for i in range(max(self.frozen_stages, 0)):
            frozen += [self.stages[i], getattr(self, f'norm{i}')]
        for module in frozen:
            module.eval()
            module.requires_grad_(False)

    def train(self, mode: bool = True) -> 'LaplacianFormer':
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for module in self.modules():
                if isinstance(module, _BatchNorm):
                    module.eval()
        return self

    def init_weights(self) -> None:
        """Default initialisation, then the other ``init_cfg`` entries, then the ``Pretrained``
        checkpoint if any (mmengine's order; an entry with a checkpoint and no type is one)."""
        entries = init_cfg_entries(self.init_cfg)
        self.apply(init_layer)
        others = [cfg for cfg in entries if not is_pretrained_cfg(cfg)]
        if others:
            initialize(self, others)
        for cfg in entries:
            if is_pretrained_cfg(cfg):
                load_backbone_weights(self, cfg['checkpoint'],
                                      logger=MMLogger.get_current_instance(),
                                      prefix=cfg.get('prefix'),
                                      map_location=cfg.get('map_location', 'cpu'))
        self._is_init = True


def init_cfg_entries(init_cfg) -> list:
    if init_cfg is None:
        return []
    return list(init_cfg) if isinstance(init_cfg, list) else [init_cfg]


def init_layer(module: nn.Module) -> None:
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
