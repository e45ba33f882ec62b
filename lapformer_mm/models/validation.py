"""Build-time checks that a model config wires the backbone to its neck correctly.

A backbone cannot see its neck, and mmdet's FPN (or mmseg's decode heads) accept any
``in_channels`` at construction: a mismatch surfaces only at the first forward pass as
a convolution shape error deep inside the neck. These checks compare the neck's
``in_channels`` with the channels the LaplacianFormer backbone actually returns
(``embed_dims[i]`` for ``i`` in ``out_indices``) and name the fix:

- :func:`check_model_cfg` on a config dict, before anything is built (tools can call it
  right after reading the config);
- :func:`check_built_model` on a built detector or segmentor;
- :class:`NeckChannelsCheckHook`, registered in mmengine's ``HOOKS``, runs
  :func:`check_built_model` in ``before_run``, before the first iteration.
"""
from typing import List, Mapping, Optional, Sequence

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from .backbone import NUM_STAGES, LaplacianFormer, resolve_arch

BACKBONE_TYPE = 'LaplacianFormer'


def backbone_out_channels(backbone_cfg: Mapping) -> Optional[List[int]]:
    """Channels of the maps a LaplacianFormer config returns, or None for another type."""
    if backbone_cfg.get('type') not in (BACKBONE_TYPE, LaplacianFormer):
        return None
    dims = resolve_arch(backbone_cfg.get('arch', 'tiny'))['embed_dims']
    out_indices = LaplacianFormer._check_out_indices(
        backbone_cfg.get('out_indices', tuple(range(NUM_STAGES))))
    return [dims[i] for i in out_indices]


def _consumer(model_cfg: Mapping):
    """(name, cfg) of the module that takes the backbone's maps, or (None, None)."""
    neck = model_cfg.get('neck')
    if isinstance(neck, Mapping):
        return 'neck', neck
    head = model_cfg.get('decode_head')
    if neck is None and isinstance(head, Mapping):
        return 'decode_head', head
    return None, None


def expected_in_channels(out_channels: Sequence[int], consumer: Mapping):
    """What ``consumer.in_channels`` must be; a decode head may pick maps by ``in_index``."""
    in_index = consumer.get('in_index')
    if isinstance(in_index, int):
        return out_channels[in_index]
    if isinstance(in_index, Sequence):
        return [out_channels[i] for i in in_index]
    return list(out_channels)


def mismatch_message(where: str, got, expected, backbone: str) -> str:
    return (f'model.{where}.in_channels={list(got) if isinstance(got, Sequence) else got} '
            f'does not match the backbone: {backbone} returns maps with {expected} channels; '
            f'set model.{where}.in_channels={expected} (or change the backbone\'s '
            'out_indices/arch)')


def _compare(where, got, out_channels, consumer, backbone):
    if got is None:
        return
    try:
        expected = expected_in_channels(out_channels, consumer)
    except IndexError:
        raise ValueError(
            f'model.{where}.in_index={consumer.get("in_index")!r} selects maps that the '
            f'backbone does not return ({backbone} returns {len(out_channels)} maps)'
        ) from None
    got_cmp = list(got) if isinstance(got, Sequence) else got
    if got_cmp != expected:
        raise ValueError(mismatch_message(where, got, expected, backbone))


def check_model_cfg(model_cfg: Mapping) -> None:
    """Raise ValueError when the neck (or decode head) ``in_channels`` do not fit the backbone.

    ``model_cfg`` is the ``model`` dict of an mmdet/mmseg config. Configs whose backbone is
    not a LaplacianFormer, or whose neck has no ``in_channels`` list, are left alone.
    """
    backbone = model_cfg.get('backbone')
    if not isinstance(backbone, Mapping):
        return
    out_channels = backbone_out_channels(backbone)
    if out_channels is None:
        return
    where, consumer = _consumer(model_cfg)
    if consumer is None:
        return
    out_indices = LaplacianFormer._check_out_indices(
        backbone.get('out_indices', tuple(range(NUM_STAGES))))
    _compare(where, consumer.get('in_channels'), out_channels, consumer,
             f"LaplacianFormer(arch={backbone.get('arch', 'tiny')!r}, "
             f'out_indices={out_indices})')


def check_built_model(model) -> None:
    """:func:`check_model_cfg` for a built detector/segmentor (DDP wrappers unwrapped)."""
    model = getattr(model, 'module', model)
    backbone = getattr(model, 'backbone', None)
    if not isinstance(backbone, LaplacianFormer):
        return
    out_channels = [backbone.embed_dims[i] for i in backbone.out_indices]
    neck = getattr(model, 'neck', None)
    where, consumer = ('neck', neck) if neck is not None else (
        'decode_head', getattr(model, 'decode_head', None))
    if consumer is None:
        return
    attrs = {'in_index': getattr(consumer, 'in_index', None)}
    _compare(where, getattr(consumer, 'in_channels', None), out_channels, attrs,
             f"LaplacianFormer(embed_dims={backbone.embed_dims}, "
             f'out_indices={backbone.out_indices})')


@HOOKS.register_module()
class NeckChannelsCheckHook(Hook):
    """Fail before the first iteration when the neck does not fit the backbone.

    ``custom_hooks = [dict(type='NeckChannelsCheckHook')]``.
    """

    priority = 'VERY_HIGH'

    def before_run(self, runner) -> None:
        check_built_model(runner.model)
