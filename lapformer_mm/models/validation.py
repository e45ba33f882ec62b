"""Checks, before the first forward, that a model config fits LaplacianFormer and its neck
(mmdet's FPN and mmseg's heads accept any ``in_channels`` and fail deep inside at the first
forward): on a config, on a built model, and in ``NeckChannelsCheckHook``."""
import inspect
import warnings
from typing import List, Mapping, Sequence

import torch
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from .backbone import LaplacianFormer, init_cfg_entries
from .pretrained import is_pretrained_cfg

BACKBONE_TYPE = 'LaplacianFormer'


class ConfigError(ValueError):
    """A config that cannot run as given; the tools print the message alone (status 2)."""


class ModelConfigError(ConfigError):
    pass


#: mmseg's decode heads take the last map by default (BaseDecodeHead(in_index=-1)); a neck
#: takes them all.
HEAD_IN_INDEX = -1


def _consumers(model_cfg: Mapping):
    """[(name, cfg)] of the modules that take the backbone's maps: the neck, or without one
    the decode head and the auxiliary head(s) (mmseg), a head's ``in_index`` defaulted."""
    neck = model_cfg.get('neck')
    if isinstance(neck, Mapping):
        if 'type' not in neck:
            raise ModelConfigError(
                f'model.neck={dict(neck)!r} has no type: the _base_ config defines no neck '
                '(a segmentor: set model.decode_head.in_channels and '
                'model.auxiliary_head.in_channels instead)')
        return [('neck', neck)]
    if neck is not None:  # a list of necks: the first takes the maps, unchecked
        return []
    heads = _heads(model_cfg.get('decode_head'), model_cfg.get('auxiliary_head'),
                   several=lambda aux: isinstance(aux, Sequence) and not isinstance(aux, str))
    return [(name, {'in_index': HEAD_IN_INDEX, **head}) for name, head in heads
            if isinstance(head, Mapping)]


def _heads(decode_head, auxiliary_head, several):
    heads = [('decode_head', decode_head)]
    if several(auxiliary_head):
        return heads + [(f'auxiliary_head.{i}', h) for i, h in enumerate(auxiliary_head)]
    return heads + [('auxiliary_head', auxiliary_head)]


def unknown_backbone_keys(backbone_cfg: Mapping) -> List[str]:
    taken = set(inspect.signature(LaplacianFormer.__init__).parameters) - {'self'}
    return sorted(k for k in backbone_cfg if k not in taken | {'type', '_scope_'})


def _compare(where, got, out_channels, consumer, backbone):
    if got is None:
        return
    index = consumer.get('in_index')
    try:
        expected = (out_channels[index] if isinstance(index, int) else list(out_channels)
                    if not isinstance(index, Sequence) else [out_channels[i] for i in index])
    except IndexError:
        raise ModelConfigError(f'model.{where}.in_index={index!r} selects maps that the '
                               f'backbone does not return ({backbone} returns '
                               f'{len(out_channels)})') from None
    got = list(got) if isinstance(got, Sequence) else got
    if got != expected:
        raise ModelConfigError(
            f'model.{where}.in_channels={got} does not match the backbone: {backbone} returns '
            f'maps with {expected} channels; set model.{where}.in_channels={expected} (or '
            "change the backbone's out_indices/arch)")


def _check_backbone_args(backbone_cfg: Mapping) -> LaplacianFormer:
    """The LaplacianFormer of a config, built on the meta device (no memory, no
    initialisation): its constructor's errors as a :class:`ModelConfigError`, which the tools
    print alone, where the same error inside the Runner's build is a traceback."""
    kwargs = {k: v for k, v in backbone_cfg.items() if k not in ('type', '_scope_')}
    try:
        # The build the Runner does next gives the warnings (deprecations, stages not run).
        with warnings.catch_warnings(), torch.device('meta'):
            warnings.simplefilter('ignore')
            return LaplacianFormer(**kwargs)
    except (TypeError, ValueError) as err:
        raise ModelConfigError(f'model.backbone: {err}') from None


# mmcv's model zoo: ImageNet CNNs (mmseg's ResNet bases name 'open-mmlab://resnet50_v1c').
CNN_ZOO_SCHEMES = ('open-mmlab://', 'torchvision://', 'open-mmlab-cpu://')


# mmseg's segmentors, which hand their ``pretrained`` to the backbone (mmpretrain's
# ImageClassifier loads its own into the whole classifier instead).
SEGMENTOR_TYPES = ('EncoderDecoder', 'CascadeEncoderDecoder')


def _check_segmentor_pretrained(model_cfg: Mapping, backbone: Mapping) -> None:
    """mmseg hands a segmentor's ``pretrained`` to its backbone: from a ResNet ``_base_``
    config it is a CNN checkpoint, beside (or instead of) the LaplacianFormer one."""
    pretrained = model_cfg.get('pretrained')
    if not pretrained or str(model_cfg.get('type', '')).split('.')[-1] not in SEGMENTOR_TYPES:
        return
    zoo = isinstance(pretrained, str) and pretrained.startswith(CNN_ZOO_SCHEMES)
    if backbone.get('pretrained') or any(
            is_pretrained_cfg(e) for e in init_cfg_entries(backbone.get('init_cfg'))):
        raise ModelConfigError(
            f'model.pretrained={pretrained!r} and model.backbone both name a checkpoint '
            '(mmseg hands model.pretrained to the backbone; mmseg\'s ResNet _base_ configs set '
            'it): set model.pretrained=None, as mmseg\'s transformer configs do')
    if zoo:
        raise ModelConfigError(
            f'model.pretrained={pretrained!r} is a CNN of mmcv\'s model zoo, kept from the '
            "_base_ config, which mmseg hands to the backbone: set model.pretrained=None (and "
            "model.backbone.init_cfg=dict(type='Pretrained', checkpoint=PATH) for "
            'LaplacianFormer weights)')


def check_model_cfg(model_cfg: Mapping) -> None:
    """Raise :class:`ModelConfigError` when the ``model`` dict of an mmdet/mmseg config gives
    a LaplacianFormer keys it does not take or values it refuses, or a neck (or heads) whose
    ``in_channels`` do not fit it."""
    backbone = model_cfg.get('backbone')
    if not isinstance(backbone, Mapping) or backbone.get('type') not in (BACKBONE_TYPE,
                                                                         LaplacianFormer):
        return
    unknown = unknown_backbone_keys(backbone)
    if '_delete_' in unknown:
        raise ModelConfigError(
            'model.backbone has _delete_=True but the _base_ config has no backbone for it to '
            'replace (mmengine then passes it on): remove _delete_')
    if unknown:
        raise ModelConfigError(
            f'model.backbone has keys LaplacianFormer does not take: {", ".join(unknown)} '
            '(another backbone\'s, kept from the _base_ config: add _delete_=True to the '
            'backbone dict to replace it; docs/backbone.md lists the arguments)')
    _check_segmentor_pretrained(model_cfg, backbone)
    built = _check_backbone_args(backbone)
    out_channels = [built.embed_dims[i] for i in built.out_indices]
    for where, consumer in _consumers(model_cfg):
        _compare(where, consumer.get('in_channels'), out_channels, consumer,
                 f"LaplacianFormer(arch={backbone.get('arch', 'tiny')!r}, "
                 f'out_indices={built.out_indices})')


def check_built_model(model) -> None:
    model = getattr(model, 'module', model)
    backbone = getattr(model, 'backbone', None)
    if not isinstance(backbone, LaplacianFormer):
        return
    out_channels = [backbone.embed_dims[i] for i in backbone.out_indices]
    neck = getattr(model, 'neck', None)
    consumers = [('neck', neck)] if neck is not None else _heads(
        getattr(model, 'decode_head', None), getattr(model, 'auxiliary_head', None),
        several=lambda aux: isinstance(aux, torch.nn.ModuleList))
    for where, consumer in consumers:
        if consumer is None:
            continue
        attrs = {'in_index': getattr(consumer, 'in_index', None)}
        _compare(where, getattr(consumer, 'in_channels', None), out_channels, attrs,
                 f"LaplacianFormer(embed_dims={backbone.embed_dims}, "
                 f'out_indices={backbone.out_indices})')


@HOOKS.register_module()
class NeckChannelsCheckHook(Hook):

    priority = 'VERY_HIGH'

    def before_run(self, runner) -> None:
        check_built_model(runner.model)
