"""Registration in mmengine's root registries.

mmdet's, mmseg's and mmpretrain's registries are children of mmengine's and fall back to
it, so one registration serves all three without importing any of them (as mmdet's own
PVT and Swin are found by mmseg configs). Every part registers itself with the registry's
decorator where it is defined; this module only imports them, and builds models from configs
(:func:`build_from_config`, for the deploy and analysis tools).
"""
import logging


def register_all_modules():
    """Import the registered parts: ``LaplacianFormer`` (MODELS), ``NeckChannelsCheckHook``
    (HOOKS) and :mod:`lapformer_mm.engine`'s; False when mmengine is not installed (nothing to
    register into)."""
    try:
        import mmengine.registry  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name == 'mmengine':
            return False
        raise
    from . import engine, models  # noqa: F401
    return True


def init_weights_quietly(model):
    """``model.init_weights()`` without mmengine's INFO line per parameter (hundreds on the
    console for a detector), by a filter of its own per call: calls overlapping in threads
    leave the logger as they found it."""
    from mmengine.logging import MMLogger

    def only_warnings(record):
        return record.levelno >= logging.WARNING
    logger = MMLogger.get_current_instance()
    logger.addFilter(only_warnings)
    try:
        model.init_weights()
    finally:
        logger.removeFilter(only_warnings)


def build_from_config(config, cfg_options=None):
    """(model in eval mode, scope) of an mmdet/mmseg config (a path or an ``mmengine.Config``)
    with ``cfg_options`` merged, random weights, nothing loaded."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope

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
