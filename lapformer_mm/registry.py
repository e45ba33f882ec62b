"""Registration of the backbone into the OpenMMLab model registries that are installed.

mmdet, mmseg and mmpretrain each keep their own ``MODELS`` registry; a config built under
one of their scopes looks only there (and in mmengine's root). Each package is optional:
one that is not installed is skipped, one that is installed but broken is reported.
"""
import importlib
import warnings

DOWNSTREAM_PACKAGES = ('mmdet', 'mmseg', 'mmpretrain')


def _models_registry(package):
    """The ``MODELS`` registry of ``package``, or ``None`` when it is not installed."""
    try:
        return importlib.import_module(f'{package}.registry').MODELS
    except ModuleNotFoundError as err:
        if err.name is not None and err.name.split('.')[0] == package:
            return None
        raise


def register_modules():
    """Register ``LaplacianFormer`` in every installed downstream ``MODELS`` registry.

    Importing :mod:`lapformer_mm.amp` on the way registers ``CPUAmpOptimWrapper`` in
    mmengine's ``OPTIM_WRAPPERS``. Idempotent. Needs mmengine; without it (the bare
    ``lapformer_mm.ops`` use on a GPU box) nothing is registered.

    Returns:
        list[str]: the packages whose registry now holds ``LaplacianFormer``.
    """
    try:
        from . import amp  # noqa: F401
        from .models import LaplacianFormer
    except ModuleNotFoundError as err:
        if err.name == 'mmengine':
            return []
        raise
    registered = []
    for package in DOWNSTREAM_PACKAGES:
        try:
            registry = _models_registry(package)
        except Exception as err:  # a broken install of one package must not break the others
            warnings.warn(f'lapformer_mm: {package} is installed but failed to import '
                          f'({type(err).__name__}: {err}); LaplacianFormer is not registered '
                          f'in its MODELS registry.')
            continue
        if registry is None:
            continue
        if registry.module_dict.get('LaplacianFormer') is not LaplacianFormer:
            registry.register_module(module=LaplacianFormer, force=True)
        registered.append(package)
    return registered
