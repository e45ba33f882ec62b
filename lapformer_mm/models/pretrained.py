"""Loading backbone weights from the checkpoint layouts people actually have, without
arbitrary pickles: a plain state dict; an mmengine checkpoint (``state_dict``, or DeiT's
``model``; an EMA copy beside it is not read); a classifier or detector checkpoint whose
backbone keys carry a ``backbone.`` prefix (the other keys are dropped). A ``module.``
prefix left by DistributedDataParallel is stripped.
"""
import re
from typing import Dict, Iterable, Mapping, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..checkpoint import load_checkpoint

BACKBONE_PREFIX = 'backbone.'
DDP_PREFIX = 'module.'


def extract_backbone_state_dict(checkpoint: Mapping,
                                prefix: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Backbone tensors of any accepted checkpoint layout; ``prefix`` as mmengine's
    ``Pretrained`` reads it, by default ``backbone.`` where any key carries it."""
    if not isinstance(checkpoint, Mapping):  # a file of another object
        raise TypeError('checkpoint must be a mapping (state dict or '
                        f'mmengine checkpoint), got {type(checkpoint)}')
    if prefix:
        prefix = prefix if prefix.endswith('.') else prefix + '.'
        if prefix.startswith(DDP_PREFIX):
            prefix = prefix[len(DDP_PREFIX):]
    state_dict = checkpoint
    for key in ('state_dict', 'model'):
        if isinstance(checkpoint.get(key), Mapping):
            state_dict = checkpoint[key]
            break
    state_dict = {k[len(DDP_PREFIX):] if k.startswith(DDP_PREFIX) else k: v
                  for k, v in state_dict.items()}
    if prefix is None and any(k.startswith(BACKBONE_PREFIX) for k in state_dict):
        prefix = BACKBONE_PREFIX
    if prefix:
        state_dict = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    tensors = {k: v for k, v in state_dict.items() if torch.is_tensor(v)}
    if not tensors:
        raise ValueError('checkpoint holds no tensors under the accepted '
                         "layouts (plain, 'state_dict', 'model', "
                         f"prefix {prefix!r})")
    return tensors


def _stage_depths(keys: Iterable[str]) -> Dict[int, int]:
    depths: Dict[int, int] = {}
    for key in keys:
        match = re.match(r'stages\.(\d+)\.blocks\.(\d+)\.', key)
        if match:
            stage, block = int(match[1]), int(match[2])
            depths[stage] = max(depths.get(stage, 0), block + 1)
    return depths


def _stage_attentions(keys: Iterable[str]) -> Dict[int, str]:
    # SoftmaxAttention has no depth-wise attn.local.
    kinds: Dict[int, str] = {}
    for key in keys:
        match = re.match(r'stages\.(\d+)\.blocks\.\d+\.attn\.(\w+)\.', key)
        if match:
            stage = int(match[1])
            if match[2] == 'local' or stage not in kinds:
                kinds[stage] = 'laplacian' if match[2] == 'local' else 'softmax'
    return kinds


def backbone_mismatch(state_dict: Mapping, own: Mapping) -> Optional[str]:
    """Why a backbone state dict cannot initialise the model whose state dict is ``own``, and
    what checkpoint it then is, or None when it fits: none of the model's tensors; stage 4 of
    the other attention (the shapes can agree); tensors of another shape; stages of another
    number of blocks (tiny, small and large share their widths: no shape reveals it)."""
    if not any(k in own for k in state_dict):
        return (f'it holds none of the {len(own)} tensors of the model (its keys look like '
                f'{", ".join(repr(k) for k in list(state_dict)[:3])}): a checkpoint of another '
                "model, or one whose backbone keys sit under a prefix other than 'backbone.' "
                "(the Pretrained init_cfg's prefix=)")
    theirs, mine = _stage_attentions(state_dict), _stage_attentions(own)
    differ = [f'stage {i + 1} has {theirs[i]} attention in the checkpoint, {kind} in the model'
              for i, kind in sorted(mine.items()) if theirs.get(i, kind) != kind]
    if differ:
        return f'{"; ".join(differ)}: a checkpoint of another stage4_attention'
    differ = [f'{k}: checkpoint {tuple(v.shape)}, model {tuple(own[k].shape)}'
              for k, v in state_dict.items() if k in own and v.shape != own[k].shape]
    if differ:
        differ = [f'{len(differ)} tensors of another shape, e.g. {"; ".join(differ[:3])}']
    else:
        theirs, mine = _stage_depths(state_dict), _stage_depths(own)
        differ = [f'stage {i}: {theirs[i]} blocks in the checkpoint, {n} in the model'
                  for i, n in sorted(mine.items()) if i in theirs and theirs[i] != n]
    return f'{"; ".join(differ)}: a checkpoint of another arch' if differ else None


# mmengine's PretrainedInit arguments.
PRETRAINED_KEYS = ('type', 'checkpoint', 'prefix', 'map_location')


def is_pretrained_cfg(cfg) -> bool:
    """Whether an ``init_cfg`` entry loads a checkpoint: ``type='Pretrained'``, or no type and
    a ``checkpoint`` (the form mmdet's PVT and Swin configs write, which those backbones
    read as a checkpoint whatever the type)."""
    return isinstance(cfg, Mapping) and (
        cfg.get('type') == 'Pretrained' or ('type' not in cfg and 'checkpoint' in cfg))


class LoadReport(NamedTuple):
    missing_keys: Tuple[str, ...]
    unexpected_keys: Tuple[str, ...]


def load_backbone_weights(module: nn.Module, path_or_url: str, logger: Optional[object] = None,
                          prefix: Optional[str] = None, map_location='cpu') -> LoadReport:
    """Load a checkpoint into ``module`` non-strictly: another model, arch or stage-4 attention
    is an error; missing and unexpected keys are logged and returned."""
    state_dict = extract_backbone_state_dict(
        load_checkpoint(path_or_url, map_location=map_location), prefix)
    mismatch = backbone_mismatch(state_dict, module.state_dict())
    if mismatch is not None:
        raise ValueError(f'checkpoint {path_or_url!r} does not fit the model: {mismatch}')
    result = module.load_state_dict(state_dict, strict=False)
    report = LoadReport(tuple(result.missing_keys), tuple(result.unexpected_keys))
    if logger is not None:
        for kind, keys in zip(('missing', 'unexpected'), report):
            if keys:
                logger.warning(f'{kind} keys in {path_or_url}: {", ".join(keys)}')
        logger.info(f'loaded {len(state_dict) - len(report.unexpected_keys)} tensors from '
                    f'{path_or_url}')
    return report
