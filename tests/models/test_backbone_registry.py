"""`import lapformer_mm` makes LaplacianFormer buildable through mmdet/mmseg/mmpretrain MODELS
(registered once, in mmengine's root MODELS)."""
import importlib
import subprocess
import sys

import pytest
import torch
from _shared import ROOT
from mmengine.model import revert_sync_batchnorm

import lapformer_mm  # noqa: F401  (registers LaplacianFormer)
from lapformer_mm.models import LaplacianFormer

CFG = dict(type='LaplacianFormer', arch='tiny', out_indices=(1, 3), frozen_stages=1,
           attn_cfg=dict(lam=2.0, qk_shared=False), conv_norm_cfg=dict(type='SyncBN'))


def build_and_run(registry):
    model = registry.build(CFG)
    assert type(model) is LaplacianFormer
    assert model.out_indices == (1, 3) and model.frozen_stages == 1
    attn = model.stages[3].blocks[0].attn
    assert attn.options.lam == 2.0 and not attn.qk_shared
    assert isinstance(model.stem[0][1], torch.nn.SyncBatchNorm)
    model = revert_sync_batchnorm(model)  # SyncBN runs only in a process group
    with torch.no_grad():
        outs = model.eval()(torch.randn(1, 3, 32, 32))
    assert [o.shape[1] for o in outs] == [128, 512]


@pytest.mark.parametrize('package', ['mmdet', 'mmseg', 'mmpretrain'])
def test_built_and_found_through_every_codebase_registry(package):
    from mmengine.registry import MODELS as ROOT_MODELS
    from mmengine.registry import DefaultScope

    registry = importlib.import_module(f'{package}.registry').MODELS
    # As in a config with default_scope=package (an earlier Runner may have left another).
    with DefaultScope.overwrite_default_scope(package):
        build_and_run(registry)
    importlib.import_module(f'{package}.models')  # what the registry's get() does first
    assert 'LaplacianFormer' not in registry.module_dict
    assert registry.get('LaplacianFormer') is LaplacianFormer
    assert ROOT_MODELS.module_dict['LaplacianFormer'] is LaplacianFormer


def test_registration_is_idempotent():
    assert lapformer_mm.registry.register_all_modules()
    assert lapformer_mm.registry.register_all_modules()


def test_core_imports_without_openmmlab_downstream_packages():
    """mmcv, mmdet, mmseg and mmpretrain blocked: the backbone needs only torch + mmengine."""
    code = """
import sys
for name in ('mmcv', 'mmdet', 'mmseg', 'mmpretrain'):
    sys.modules[name] = None
import lapformer_mm
from mmengine.registry import MODELS
print(type(MODELS.build(dict(type='LaplacianFormer', arch='tiny'))).__name__)
model = MODELS.build(dict(type='LaplacianFormer', arch='tiny',
                          norm_cfg=dict(type='LN', eps=1e-6), act_cfg=dict(type='SiLU'),
                          conv_norm_cfg=dict(type='GN', num_groups=8, requires_grad=False),
                          conv_act_cfg=dict(type='GELU')))
block = model.stages[0].blocks[0]
print(block.norm1.eps, type(block.mlp.act).__name__,
      [type(m).__name__ for m in model.stem[0]], model.stem[0][1].weight.requires_grad)
try:
    MODELS.build(dict(type='LaplacianFormer', conv_norm_cfg=dict(type='IN')))
except ValueError as err:
    print(err)
"""
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ['LaplacianFormer', "1e-06 SiLU ['Conv2d', 'GroupNorm', 'GELU'] False"]
    assert lines[2].startswith('conv_norm_cfg') and 'mmcv' in lines[2]
