"""Backbones compared in the analyses and benchmarks, built from config dicts.

Names accepted by :func:`build_backbone` (see ``BACKBONE_CONFIGS``):
``laplacianformer-t``, ``laplacianformer-s`` (ours, the backbone's default
layout; ``laplacianformer-t-softmax4`` is Tiny with SOFT's softmax attention
in stage 4), ``pvtv2-b1``, ``pvtv2-b2``
and ``swin-t`` (mmdet 3.3's PyramidVisionTransformerV2 and SwinTransformer with
the settings of mmdet's own ``configs/pvt`` and ``configs/swin`` files).

Weights are random (each model's ``init_weights``) unless the user passes a
checkpoint, which is read with ``weights_only=True`` and loaded non-strictly
(:func:`lapformer_mm.models.pretrained.load_backbone_weights`). Nothing is
downloaded.

Whole detectors and segmentors for FLOP counts and speed: :func:`build_from_config`
and :func:`data_samples`.
"""
import copy
import logging

BACKBONE_CONFIGS = {
    'laplacianformer-t': dict(type='LaplacianFormer', arch='tiny', drop_path_rate=0.0),
    'laplacianformer-s': dict(type='LaplacianFormer', arch='small', drop_path_rate=0.0),
    # SOFT's layout: plain softmax attention (quadratic in its tokens) in stage 4.
    'laplacianformer-t-softmax4': dict(type='LaplacianFormer', arch='tiny', drop_path_rate=0.0,
                                       stage4_attention='softmax'),
    'pvtv2-b1': dict(type='PyramidVisionTransformerV2', embed_dims=64,
                     num_layers=[2, 2, 2, 2], drop_path_rate=0.0),
    'pvtv2-b2': dict(type='PyramidVisionTransformerV2', embed_dims=64,
                     num_layers=[3, 4, 6, 3], drop_path_rate=0.0),
    'swin-t': dict(type='SwinTransformer', embed_dims=96, depths=[2, 2, 6, 2],
                   num_heads=[3, 6, 12, 24], window_size=7, mlp_ratio=4,
                   qkv_bias=True, drop_path_rate=0.0, convert_weights=False),
}


def backbone_config(name):
    """A copy of the config dict of backbone ``name``."""
    if name not in BACKBONE_CONFIGS:
        raise ValueError(f'backbone must be one of {sorted(BACKBONE_CONFIGS)}, '
                         f'got {name!r}')
    return copy.deepcopy(BACKBONE_CONFIGS[name])


def _registry():
    """mmdet's MODELS with LaplacianFormer registered (import side effect)."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    import lapformer_mm  # noqa: F401  registers LaplacianFormer
    register_all_modules(init_default_scope=False)
    return MODELS


def load_weights(model, checkpoint_path):
    """Load ``checkpoint_path`` safely and non-strictly; returns (missing, unexpected).

    Any layout :func:`lapformer_mm.models.pretrained.load_backbone_weights` accepts
    (plain, ``state_dict``, ``model``, ``backbone.``/``module.`` prefixes).
    """
    from lapformer_mm.models.pretrained import load_backbone_weights
    report = load_backbone_weights(model, checkpoint_path)
    return list(report.missing_keys), list(report.unexpected_keys)


def init_weights_quietly(model):
    """``model.init_weights()`` without mmengine's INFO line per parameter, which goes to the
    console (hundreds of lines for a detector) where no Runner has opened a log file.

    A filter of its own per call rather than the logger's level: calls overlapping in
    threads then leave the logger as they found it."""
    from mmengine.logging import MMLogger

    def only_warnings(record):
        return record.levelno >= logging.WARNING
    logger = MMLogger.get_current_instance()
    logger.addFilter(only_warnings)
    try:
        model.init_weights()
    finally:
        logger.removeFilter(only_warnings)


def build_backbone(name, checkpoint=None, config_overrides=None):
    """Build backbone ``name`` in eval mode, randomly initialised or from ``checkpoint``.

    config_overrides (dict | None): keys merged into the config (e.g. a smaller
    ``arch`` for tests). Returns the module.
    """
    cfg = backbone_config(name)
    cfg.update(config_overrides or {})
    from mmengine.registry import DefaultScope

    # Under mmdet's scope: Registry.build switches to the registry of whatever default scope
    # a Runner left (mmseg's has no PyramidVisionTransformerV2, and its Swin other arguments).
    with DefaultScope.overwrite_default_scope('mmdet'):
        model = _registry().build(cfg)
    init_weights_quietly(model)
    if checkpoint is not None:
        missing, unexpected = load_weights(model, checkpoint)
        if missing:
            print(f'{name}: {len(missing)} weights not in {checkpoint} '
                  f'(e.g. {missing[:3]})')
        if unexpected:
            print(f'{name}: {len(unexpected)} checkpoint keys unused '
                  f'(e.g. {unexpected[:3]})')
    # Some mmdet backbones' train() returns None, so no chaining.
    model.eval()
    return model


def describe(model):
    """The layout choices of a built backbone that change its cost, as a dict."""
    settings = {'class': type(model).__name__}
    for attribute in ('stage4_attention', 'qk_shared', 'arch_settings'):
        if hasattr(model, attribute):
            value = getattr(model, attribute)
            settings[attribute] = list(value) if isinstance(value, tuple) else value
    return settings


def count_parameters(model):
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())



def build_from_config(config, cfg_options=None):
    """(model in eval mode, scope) of an mmdet/mmseg config, random weights, nothing loaded.

    config: a config file path or an ``mmengine.Config``; cfg_options (dict | None):
    overrides merged into it (``--cfg-options``).
    """
    from mmengine.config import Config
    from mmengine.registry import init_default_scope

    import lapformer_mm  # noqa: F401  registers LaplacianFormer
    cfg = config if isinstance(config, Config) else Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    scope = cfg.get('default_scope', 'mmdet')
    init_default_scope(scope)
    if scope == 'mmseg':
        from mmseg.registry import MODELS
    else:
        from mmdet.registry import MODELS
    cfg.model.backbone.init_cfg = None
    model = MODELS.build(cfg.model)
    init_weights_quietly(model)
    model.eval()
    return model, scope


def data_samples(scope, height, width, count=1):
    """``count`` data samples of an unscaled (height, width) image, the meta the heads read."""
    meta = dict(img_shape=(height, width), ori_shape=(height, width),
                pad_shape=(height, width), batch_input_shape=(height, width),
                scale_factor=(1.0, 1.0))
    if scope == 'mmseg':
        from mmseg.structures import SegDataSample as Sample
    else:
        from mmdet.structures import DetDataSample as Sample
    return [Sample(metainfo=meta) for _ in range(count)]
