"""Registration in mmengine's root registries.

mmdet's, mmseg's and mmpretrain's registries are children of mmengine's and fall back to
it, so one registration serves all three without importing any of them (as mmdet's own
PVT and Swin are found by mmseg configs). Every part registers itself with the registry's
decorator where it is defined; this module only imports them.
"""


def register_all_modules():
    """Import the registered parts (each module registers its own with a decorator).

    ``LaplacianFormer`` (MODELS), ``NeckChannelsCheckHook`` (HOOKS) and the engine parts
    of :mod:`lapformer_mm.engine`. Importing twice registers once (Python caches modules).

    Returns:
        bool: False when mmengine is not installed (the bare ``lapformer_mm.ops`` use on a
        GPU box), where there is nothing to register into.
    """
    try:
        import mmengine.registry  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name == 'mmengine':
            return False
        raise
    from . import engine, models  # noqa: F401
    return True
