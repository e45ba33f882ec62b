"""Backbones compared in the analyses and benchmarks (ours, mmdet's PVTv2 and Swin as in
mmdet's configs), random weights unless a checkpoint is given; nothing is downloaded."""
import copy

from ..registry import build_from_config, init_weights_quietly  # noqa: F401

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


def _registry():
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    import lapformer_mm  # noqa: F401  registers LaplacianFormer
    register_all_modules(init_default_scope=False)
    return MODELS


def build_backbone(name, checkpoint=None, config_overrides=None):
    """Backbone ``name`` in eval mode, its config with ``config_overrides``, random weights or
    ``checkpoint``'s."""
    cfg = copy.deepcopy(BACKBONE_CONFIGS[name])
    cfg.update(config_overrides or {})
    from mmengine.registry import DefaultScope

    # Under mmdet's scope: Registry.build switches to the registry of whatever default scope
    # a Runner left (mmseg's has no PyramidVisionTransformerV2, and its Swin other arguments).
    with DefaultScope.overwrite_default_scope('mmdet'):
        model = _registry().build(cfg)
    init_weights_quietly(model)
    if checkpoint is not None:
        from lapformer_mm.models.pretrained import load_backbone_weights
        missing, unexpected = load_backbone_weights(model, checkpoint)
        if missing:
            print(f'{name}: {len(missing)} weights not in {checkpoint} '
                  f'(e.g. {missing[:3]})')
        if unexpected:
            print(f'{name}: {len(unexpected)} checkpoint keys unused '
                  f'(e.g. {unexpected[:3]})')
    model.eval()
    return model


def describe(model):
    settings = {'class': type(model).__name__}
    for attribute in ('stage4_attention', 'qk_shared', 'arch_settings'):
        if hasattr(model, attribute):
            value = getattr(model, attribute)
            settings[attribute] = list(value) if isinstance(value, tuple) else value
    return settings


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def data_samples(scope, height, width, count=1):
    """``count`` data samples of an unscaled (height, width) image."""
    meta = dict(img_shape=(height, width), ori_shape=(height, width),
                pad_shape=(height, width), batch_input_shape=(height, width),
                scale_factor=(1.0, 1.0))
    if scope == 'mmseg':
        from mmseg.structures import SegDataSample as Sample
    else:
        from mmdet.structures import DetDataSample as Sample
    return [Sample(metainfo=meta) for _ in range(count)]
