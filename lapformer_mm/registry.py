"""Registration in mmengine's root registries.

mmdet's, mmseg's and mmpretrain's registries are children of mmengine's and fall back to
it, so one registration serves all three without importing any of them (as mmdet's own
PVT and Swin are found by mmseg configs). The engine parts register themselves when
:mod:`lapformer_mm.engine` is imported.
"""


def register_all_modules():
    """Register ``LaplacianFormer`` (MODELS) and the engine parts. Idempotent.

    Returns:
        bool: False when mmengine is not installed (the bare ``lapformer_mm.ops`` use on a
        GPU box), where there is nothing to register into.
    """
    try:
        from mmengine.registry import MODELS
    except ModuleNotFoundError as err:
        if err.name == 'mmengine':
            return False
        raise
    from . import engine  # noqa: F401
    from .models import LaplacianFormer

    # A second call finds it registered; another class under the name is an error.
    if MODELS.module_dict.get('LaplacianFormer') is not LaplacianFormer:
        MODELS.register_module(module=LaplacianFormer)
    return True
