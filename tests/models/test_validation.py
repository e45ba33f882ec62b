"""lapformer_mm.models.validation: ``in_channels`` of necks and heads against the backbone."""
import copy
import os.path as osp
from types import SimpleNamespace

import pytest
import torch
from _shared import CONFIG_DIR, TOY_CONFIG
from mmengine.config import Config

import lapformer_mm  # noqa: F401  (registers LaplacianFormer)
from lapformer_mm.models import NeckChannelsCheckHook, check_built_model, check_model_cfg
from lapformer_mm.models.validation import ModelConfigError

pytestmark = pytest.mark.usefixtures('mmdet_scope')


UPERNET_CONFIG = osp.join(CONFIG_DIR, 'upernet_lapformer_t_ade20k.py')


def toy_model_cfg(**neck):
    cfg = Config.fromfile(TOY_CONFIG)
    cfg.model.neck.update(neck)
    return cfg.model


def test_neck_in_channels_follow_out_indices_and_arch():
    check_model_cfg(toy_model_cfg())
    with pytest.raises(ModelConfigError, match=r'model.neck.in_channels=\[64, 128, 320, 512\]'):
        check_model_cfg(toy_model_cfg(in_channels=[64, 128, 256, 512]))
    model = toy_model_cfg()
    model.backbone.out_indices = (1, 2, 3)
    with pytest.raises(ModelConfigError, match=r'model.neck.in_channels=\[128, 320, 512\]'):
        check_model_cfg(model)
    model.neck.in_channels = [128, 320, 512]
    check_model_cfg(model)
    model.backbone.arch = 'medium'
    with pytest.raises(ModelConfigError, match=r'in_channels=\[128, 288, 512\]'):
        check_model_cfg(model)


def test_neck_check_hook_fails_before_the_first_iteration():
    """Also for a model under a DDP wrapper (runner.model.module)."""
    from mmdet.registry import MODELS
    from mmengine.registry import HOOKS

    hook = HOOKS.build(dict(type='NeckChannelsCheckHook'))
    assert isinstance(hook, NeckChannelsCheckHook)
    model = MODELS.build(toy_model_cfg(in_channels=[64, 128, 320, 256]))

    class Wrapper(torch.nn.Module):  # as MMDistributedDataParallel: the model is .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    for wrapped in (model, Wrapper(model)):
        with pytest.raises(ValueError, match=r'model.neck.in_channels=\[64, 128, 320, 512\]'):
            hook.before_run(SimpleNamespace(model=wrapped))


def test_segmentor_heads_checked_through_their_in_index():
    """mmseg's auxiliary FCN head takes the stage-3 map (in_index=2)."""
    model = Config.fromfile(UPERNET_CONFIG).model
    check_model_cfg(model)
    model.decode_head.in_channels = [64, 128, 320]
    with pytest.raises(ModelConfigError, match='model.decode_head.in_channels'):
        check_model_cfg(model)
    model.backbone.arch = 'medium'
    model.decode_head.in_channels = [64, 128, 288, 512]
    with pytest.raises(ModelConfigError, match='model.auxiliary_head.in_channels=288'):
        check_model_cfg(model)
    model.auxiliary_head.in_channels = 288
    check_model_cfg(model)
    model.auxiliary_head = [dict(model.auxiliary_head), dict(model.auxiliary_head, in_index=3)]
    with pytest.raises(ModelConfigError, match='model.auxiliary_head.1.in_channels=512'):
        check_model_cfg(model)
    # A head reading a stage the backbone does not return: named, not an IndexError.
    model.auxiliary_head = dict(model.auxiliary_head[0], in_index=2)
    model.backbone.out_indices = (0, 1)
    model.decode_head.update(in_channels=[64, 128], in_index=[0, 1])
    with pytest.raises(ModelConfigError, match='model.auxiliary_head.in_index'):
        check_model_cfg(model)


@pytest.mark.filterwarnings('ignore:``build_loss`` would be deprecated')
@pytest.mark.filterwarnings('ignore:Default ``avg_non_ignore`` is False')
def test_built_segmentor_checks_its_auxiliary_heads():
    from mmengine.registry import DefaultScope
    from mmseg.registry import MODELS
    model_cfg = Config.fromfile(UPERNET_CONFIG).model
    model_cfg.backbone.arch = 'medium'
    model_cfg.decode_head.in_channels = [64, 128, 288, 512]
    model_cfg.data_preprocessor = None
    with DefaultScope.overwrite_default_scope('mmseg'):
        model = MODELS.build(model_cfg)
    with pytest.raises(ValueError, match='model.auxiliary_head.in_channels=288'):
        check_built_model(model)
    # A list of auxiliary heads (mmseg builds a ModuleList), the second on stage 4.
    first = model.auxiliary_head
    first.in_channels = 288
    second = copy.deepcopy(first)
    second.in_index = 3
    model.auxiliary_head = torch.nn.ModuleList([first, second])
    with pytest.raises(ValueError, match='model.auxiliary_head.1.in_channels=512'):
        check_built_model(model)


def test_heads_without_in_index_take_the_last_map_and_list_necks_are_left_alone():
    """mmseg's BaseDecodeHead defaults to in_index=-1."""
    model = Config.fromfile(UPERNET_CONFIG).model
    model.auxiliary_head.pop('in_index', None)
    model.auxiliary_head.in_channels = 512
    check_model_cfg(model)
    model.auxiliary_head.in_channels = 320
    with pytest.raises(ModelConfigError, match='model.auxiliary_head.in_channels=512'):
        check_model_cfg(model)
    model = Config.fromfile(UPERNET_CONFIG).model
    model.neck = [dict(type='FPN', in_channels=[64, 128, 320, 512], out_channels=256,
                       num_outs=4)]
    model.decode_head.in_channels = [256] * 4
    model.auxiliary_head.in_channels = 256
    check_model_cfg(model)


@pytest.mark.parametrize('update, name', [
    # README's detection snippet pasted into an mmseg config: the neck has nothing to merge into.
    (dict(neck=dict(in_channels=[64, 128, 320, 512])), 'model.neck'),
    # mmdet's PVTv2 config with only the type swapped; the build failed with a bare TypeError.
    (dict(backbone=dict(embed_dims=64, convert_weights=True)), 'convert_weights'),
    (dict(backbone=dict(_delete_=True)), '_delete_'),
    # The constructor's own errors, printed alone by the tools (exit status 2).
    (dict(backbone=dict(arch='base')), 'arch'),
    (dict(backbone=dict(out_indices=[0, 7])), 'out_indices'),
    (dict(backbone=dict(frozen_stages=9)), 'frozen_stages'),
    (dict(backbone=dict(attn_cfg=dict(lam=-1))), 'lam'),
])
def test_config_errors_name_the_key(update, name):
    model = Config.fromfile(UPERNET_CONFIG).model
    for key, values in update.items():
        if key == 'neck':
            model.neck = values
        else:
            model[key].update(values)
    with pytest.raises(ModelConfigError, match=name):
        check_model_cfg(model)


def test_backbone_check_leaves_the_warnings_to_the_build(recwarn):
    """The constructor runs on the meta device; the Runner's build gives the warnings."""
    model = toy_model_cfg(in_channels=[64, 128])
    model.backbone.update(out_indices=(0, 1), arch='huge')
    check_model_cfg(model)
    assert not [w for w in recwarn if 'LaplacianFormer' in str(w.message)]


def test_a_segmentor_pretrained_from_mmseg_resnet_bases_is_named(tmp_path):
    """On mmseg's upernet_r50.py base, model.pretrained (a ResNet) reached the backbone."""
    config = tmp_path / 'upernet_on_r50.py'
    config.write_text(
        "_base_ = ['mmseg::_base_/models/upernet_r50.py']\n"
        "model = dict(backbone=dict(_delete_=True, type='LaplacianFormer', arch='tiny', "
        "init_cfg=dict(type='Pretrained', checkpoint='bb.pth')), "
        "decode_head=dict(in_channels=[64, 128, 320, 512]), "
        "auxiliary_head=dict(in_channels=320))\n")
    model = Config.fromfile(str(config)).model
    for init_cfg in (model.backbone.init_cfg, None,
                     dict(type='TruncNormal', layer='Linear', std=0.02)):
        model.backbone.init_cfg = init_cfg
        with pytest.raises(ModelConfigError, match='model.pretrained'):
            check_model_cfg(model)
    model.pretrained = None
    check_model_cfg(model)
    # A segmentor's own LaplacianFormer checkpoint (mmseg's older spelling) stays allowed.
    model.pretrained = 'lapformer_t_in1k.pth'
    check_model_cfg(model)
    # mmpretrain's classifier loads its pretrained into itself, not into the backbone.
    classifier = Config.fromfile(osp.join(CONFIG_DIR, 'cls', 'lapformer_t_in1k.py')).model
    classifier.pretrained = 'epoch_300.pth'
    classifier.backbone.init_cfg = dict(type='Pretrained', checkpoint='lapformer_t_in1k.pth')
    check_model_cfg(classifier)
