"""`import lapformer_mm` makes LaplacianFormer buildable through mmdet/mmseg/mmpretrain MODELS.

It is registered once, in mmengine's root MODELS, which their registries fall back to.
"""
import importlib
import os
import subprocess
import sys

import pytest
import torch

import lapformer_mm  # noqa: F401  (registers LaplacianFormer)
from lapformer_mm.models import LaplacianFormer

CFG = dict(type='LaplacianFormer', arch='tiny', out_indices=(1, 3), frozen_stages=1)


def build_and_run(registry):
    model = registry.build(CFG)
    assert type(model) is LaplacianFormer
    assert model.out_indices == (1, 3) and model.frozen_stages == 1
    with torch.no_grad():
        outs = model.eval()(torch.randn(1, 3, 32, 32))
    assert [o.shape[1] for o in outs] == [128, 512]


@pytest.mark.parametrize('package', ['mmdet', 'mmseg'])
def test_build_through_downstream_registry(package):
    from mmengine.registry import DefaultScope

    registry = importlib.import_module(f'{package}.registry').MODELS
    # As in a config with default_scope=package (an earlier Runner may have left another).
    with DefaultScope.overwrite_default_scope(package):
        build_and_run(registry)


@pytest.mark.parametrize('package', ['mmdet', 'mmseg', 'mmpretrain'])
def test_found_through_every_codebase_registry(package):
    from mmengine.registry import MODELS as ROOT_MODELS

    registry = importlib.import_module(f'{package}.registry').MODELS
    import_models_or_skip(package)  # what the registry's get() does first
    assert 'LaplacianFormer' not in registry.module_dict
    assert registry.get('LaplacianFormer') is LaplacianFormer
    assert ROOT_MODELS.module_dict['LaplacianFormer'] is LaplacianFormer


def test_registration_is_idempotent():
    assert lapformer_mm.registry.register_all_modules()
    assert lapformer_mm.registry.register_all_modules()


def import_models_or_skip(package):
    try:
        importlib.import_module(f'{package}.models')
    except Exception as err:  # e.g. mmpretrain without a torchvision wheel for this torch
        pytest.skip(f'{package}.models does not import here: {type(err).__name__}: {err}')


def test_build_through_mmpretrain_registry():
    import_models_or_skip('mmpretrain')
    from mmpretrain.registry import MODELS
    build_and_run(MODELS)


def test_core_imports_without_openmmlab_downstream_packages():
    # mmcv, mmdet, mmseg and mmpretrain blocked: the backbone needs only torch + mmengine
    code = ("import sys\n"
            "for name in ('mmcv', 'mmdet', 'mmseg', 'mmpretrain'):\n"
            "    sys.modules[name] = None\n"
            "import lapformer_mm\n"
            "from mmengine.registry import MODELS\n"
            "print(type(MODELS.build(dict(type='LaplacianFormer', arch='tiny'))).__name__)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            cwd=root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == 'LaplacianFormer'
