"""Registration in mmengine's root registries, which mmdet's, mmseg's and mmpretrain's fall
back to: one registration serves all three without importing any. Each part registers itself
where it is defined; this module imports them, and builds models from configs."""
import logging


def register_all_modules():
    """Import the registered parts; False when mmengine is not installed."""
    try:
        import mmengine.registry  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name == 'mmengine':
            return False
        raise
    from . import engine, models  # noqa: F401
    return True


def init_weights_quietly(model):
    """``model.init_weights()`` without mmengine's INFO line per parameter, by a filter of
    its own per call (calls overlapping in threads leave the logger as they found it)."""
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
