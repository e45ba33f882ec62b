"""Pretrained loading: plain, mmengine and classifier checkpoints; unsafe pickles refused."""
import os
from unittest import mock

import pytest
import torch
from _runner_helpers import RunsCode, assert_refused_with_hint

from lapformer_mm.models import LaplacianFormer
from lapformer_mm.models.pretrained import extract_backbone_state_dict, load_backbone_weights

ARCH = dict(embed_dims=[16, 32, 32, 64], num_heads=[1, 1, 1, 2], depths=[1, 1, 1, 1])


def small_model(**kwargs):
    return LaplacianFormer(ARCH, drop_path_rate=0.0, **kwargs)


@pytest.fixture
def source():
    torch.manual_seed(1)
    model = small_model(out_indices=(3, ))
    model.init_weights()
    for p in model.parameters():  # make every tensor distinguishable from a fresh init
        p.data.add_(torch.randn_like(p))
    return model


def assert_same_weights(model, state_dict):
    own = model.state_dict()
    for key, value in state_dict.items():
        assert torch.equal(own[key], value), key


def write_checkpoint(kind, state_dict, path):
    if kind == 'plain':
        obj = state_dict
    elif kind == 'mmengine':
        obj = dict(meta=dict(epoch=300, mmengine_version='0.10.7'), state_dict=state_dict,
                   optimizer=dict(state={}, param_groups=[dict(lr=1e-3)]))
    elif kind == 'classifier':
        weights = {f'backbone.{k}': v for k, v in state_dict.items()}
        weights['head.fc.weight'] = torch.randn(1000, 64)
        weights['head.fc.bias'] = torch.randn(1000)
        obj = dict(meta=dict(epoch=300), state_dict=weights)
    elif kind == 'ddp':
        obj = dict(state_dict={f'module.{k}': v for k, v in state_dict.items()})
    torch.save(obj, path)
    return str(path)


@pytest.mark.parametrize('kind, init_cfg', [
    ('plain', dict(type='Pretrained')), ('mmengine', dict(type='Pretrained')),
    ('classifier', dict(type='Pretrained')), ('ddp', dict(type='Pretrained')),
    # mmdet's PVT configs write no type; PVT reads a checkpoint whatever the type.
    ('classifier', dict()),
    # mmengine leaves _delete_ where the _base_ backbone had no init_cfg to replace.
    ('plain', dict(_delete_=True, type='Pretrained')),
])
def test_pretrained_init_cfg_loads_each_kind(kind, init_cfg, source, tmp_path):
    path = write_checkpoint(kind, source.state_dict(), tmp_path / f'{kind}.pth')
    target = small_model(out_indices=(3, ), init_cfg=dict(init_cfg, checkpoint=path))
    target.init_weights()
    assert_same_weights(target, source.state_dict())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(target.eval()(x)[0], source.eval()(x)[0])


def test_other_init_cfg_entries_run_before_the_checkpoint(source, tmp_path):
    """A list init_cfg: its other entries apply, then Pretrained (mmengine's order)."""
    path = write_checkpoint('classifier', without_norms(source.state_dict()),
                            tmp_path / 'cls.pth')
    target = small_model(init_cfg=[
        dict(type='Constant', layer='LayerNorm', val=0.5, bias=0.25),
        dict(type='Pretrained', checkpoint=path)])
    target.init_weights()
    assert (target.norm0.weight == 0.5).all() and (target.norm2.bias == 0.25).all()
    assert_same_weights(target, without_norms(source.state_dict()))


@pytest.mark.parametrize('init_cfg', [dict(type='Constant', layer='LayerNorm', val=0.5,
                                             bias=0.25),
                                        [dict(type='Constant', layer='LayerNorm', val=0.5,
                                              bias=0.25)]])
def test_init_cfg_without_a_checkpoint_keeps_the_default_init_elsewhere(init_cfg):
    """The entries apply after the default init (truncated-normal linears), not instead."""
    torch.manual_seed(0)
    target = small_model(init_cfg=init_cfg)
    target.init_weights()
    assert (target.norm0.weight == 0.5).all() and (target.norm3.bias == 0.25).all()
    fc1 = target.stages[0].blocks[0].mlp.fc1
    assert (fc1.bias == 0).all() and 0.015 < fc1.weight.std() < 0.025  # std 0.02, not 0.14


@pytest.mark.parametrize('saved_by_ddp', [False, True])
@pytest.mark.parametrize('prefix', ['student.backbone', 'student.backbone.'])
def test_prefix_is_read_as_mmengine_reads_it(source, tmp_path, prefix, saved_by_ddp):
    """With or without the dot; a DDP-saved checkpoint's prefix carries 'module.'."""
    from mmengine.runner.checkpoint import _load_checkpoint_with_prefix
    lead = 'module.' if saved_by_ddp else ''
    weights = {f'{lead}student.backbone.{k}': v for k, v in source.state_dict().items()}
    weights[f'{lead}student.backbone_ema.stem.0.0.weight'] = torch.zeros(1)
    path = tmp_path / 'kd.pth'
    torch.save(dict(state_dict=weights), path)
    expected = _load_checkpoint_with_prefix(lead + prefix, str(path))
    for spelling in {lead + prefix, prefix}:
        target = small_model(out_indices=(3, ), init_cfg=dict(
            type='Pretrained', checkpoint=str(path), prefix=spelling))
        target.init_weights()
        assert_same_weights(target, expected)


def without_norms(state_dict, stages=(0, 1, 2)):
    """A checkpoint of the earlier layout, whose classifiers held no norm0-norm2."""
    return {k: v for k, v in state_dict.items()
            if not any(k.startswith(f'norm{i}.') for i in stages)}


def test_report_lists_missing_and_unexpected_keys(source, tmp_path):
    path = write_checkpoint('classifier', without_norms(source.state_dict()),
                            tmp_path / 'cls.pth')
    target = small_model(out_indices=(0, 1, 2, 3))
    logger = mock.Mock()
    report = load_backbone_weights(target, path, logger=logger)
    expected = {f'norm{i}.{p}' for i in range(3) for p in ('weight', 'bias')}
    assert set(report.missing_keys) == expected
    assert report.unexpected_keys == ()
    assert 'missing keys' in str(logger.warning.call_args) and 'norm0.weight' in str(
        logger.warning.call_args)

    plain = source.state_dict()
    plain['extra.weight'] = torch.zeros(3)
    path = write_checkpoint('plain', plain, tmp_path / 'extra.pth')
    report = load_backbone_weights(small_model(out_indices=(3, )), path)
    assert report.unexpected_keys == ('extra.weight', )
    assert report.missing_keys == ()


def test_pretrained_from_a_storage_scheme_goes_through_mmengines_loader(source, tmp_path):
    """s3://, petrel://, open-mmlab://: mmengine's CheckpointLoader, as its Pretrained init."""
    from mmengine.runner import CheckpointLoader

    write_checkpoint('mmengine', source.state_dict(), tmp_path / 'x.pth')
    prefix = 'lapformer-test://'
    seen = []

    def load_from_test_storage(filename, map_location=None):
        seen.append(filename)
        return torch.load(tmp_path / filename[len(prefix):], map_location=map_location,
                          weights_only=True)

    CheckpointLoader.register_scheme(prefix, load_from_test_storage)
    try:
        target = small_model(out_indices=(3, ),
                             init_cfg=dict(type='Pretrained', checkpoint=f'{prefix}x.pth'))
        target.init_weights()
    finally:
        del CheckpointLoader._schemes[prefix]
    assert seen == [f'{prefix}x.pth']
    assert_same_weights(target, source.state_dict())


@pytest.mark.parametrize('theirs, mine, match', [
    (dict(arch=dict(ARCH, embed_dims=[16, 32, 64, 64])), {}, 'stages.2.'),
    # tiny, small and large share their widths: only the block count tells them apart.
    (dict(arch=dict(ARCH, depths=[1, 1, 1, 1])), dict(arch=dict(ARCH, depths=[1, 1, 2, 1])),
     'stage 2: 1 blocks'),
    (dict(arch=dict(ARCH, depths=[1, 1, 3, 1])), dict(arch=dict(ARCH, depths=[1, 1, 2, 1])),
     'stage 2: 3 blocks'),
    # Stage 4's projections have the same shapes either way: the Laplacian one's attn.local
    # tensors were only logged as missing or unexpected.
    (dict(stage4_attention='laplacian'), dict(stage4_attention='softmax'), 'stage4_attention'),
    (dict(stage4_attention='softmax'), dict(stage4_attention='laplacian'), 'stage4_attention'),
    (None, {}, 'conv1.weight'),
])
def test_checkpoint_of_another_model_is_an_error(tmp_path, theirs, mine, match):
    state = ({'conv1.weight': torch.zeros(1)} if theirs is None else
             LaplacianFormer(**dict(dict(arch=ARCH), **theirs)).state_dict())
    path = write_checkpoint('classifier', state, tmp_path / 'x.pth')
    with pytest.raises(ValueError, match=match):
        load_backbone_weights(LaplacianFormer(**dict(dict(arch=ARCH), **mine)), path)


def test_extract_rejects_tensorless_checkpoints():
    with pytest.raises(ValueError, match='no tensors'):
        extract_backbone_state_dict({'meta': {'epoch': 1}})
    with pytest.raises(TypeError, match='mapping'):
        extract_backbone_state_dict([torch.zeros(1)])


@pytest.mark.filterwarnings('ignore:LaplacianFormer. pretrained= is deprecated')
def test_backbone_init_cfg_refuses_code_running_checkpoint(source, tmp_path):
    """``init_cfg`` Pretrained and ``pretrained=`` through mmdet's MODELS: refused, not run."""
    from mmdet.registry import MODELS
    from mmengine.registry import DefaultScope
    marker = tmp_path / 'payload_ran'
    path = str(tmp_path / 'evil.pth')
    torch.save({'state_dict': source.state_dict(), 'meta': {'x': RunsCode(marker)}}, path)
    for kwargs in (dict(init_cfg=dict(type='Pretrained', checkpoint=path)),
                   dict(pretrained=path)):
        with DefaultScope.overwrite_default_scope('mmdet'):
            backbone = MODELS.build(dict(type='LaplacianFormer', arch=ARCH, **kwargs))
        with pytest.raises(RuntimeError) as info:
            backbone.init_weights()
        assert_refused_with_hint(str(info.value), path)
        assert 'posix.system' in str(info.value) or 'os.system' in str(info.value)
    assert not marker.exists()

    # the payload is real: an unsafe load does run it
    probe = tmp_path / 'probe'
    torch.save(dict(hook=RunsCode(probe)), tmp_path / 'probe.pth')
    torch.load(tmp_path / 'probe.pth', weights_only=False)
    assert os.path.exists(probe)


def test_pretrained_argument_warns_and_still_loads_the_weights(source, tmp_path):
    path = write_checkpoint('classifier', source.state_dict(), tmp_path / 'cls.pth')
    with pytest.warns(UserWarning, match='deprecated') as record:
        target = small_model(out_indices=(3, ), pretrained=path)
    # Python's default filters hide a DeprecationWarning raised outside __main__.
    assert all(w.category is UserWarning for w in record)
    assert target.init_cfg == dict(type='Pretrained', checkpoint=path)
    target.init_weights()
    assert_same_weights(target, source.state_dict())
    with pytest.raises(ValueError, match='pretrained'):
        small_model(pretrained=path, init_cfg=dict(type='Pretrained', checkpoint=path))


@pytest.mark.parametrize('kwargs, name', [
    # The second checkpoint was dropped without a word.
    (dict(init_cfg=[dict(type='Pretrained', checkpoint='a.pth'), dict(checkpoint='b.pth')]),
     'init_cfg'),
    # A misspelt prefix was ignored, so the default 'backbone.' was used.
    (dict(init_cfg=dict(type='Pretrained', checkpoint='a.pth', prefx='model.')), 'init_cfg'),
    (dict(init_cfg=[dict(type='Constant', val=1, layer='Linear'),
                    dict(checkpoint='a.pth', strict=True)]), 'init_cfg'),
    # Accepted, these failed in init_weights.
    (dict(init_cfg=dict(type='Pretrained')), 'init_cfg'),
    (dict(pretrained=''), 'pretrained'),
    (dict(pretrained=123), 'pretrained'),
    (dict(pretrained=['a.pth']), 'pretrained'),
])
def test_init_cfg_a_backbone_cannot_honour_fails_at_construction(kwargs, name):
    with pytest.raises(ValueError, match=name):
        small_model(**kwargs)


def test_pretrained_map_location_is_honoured(source, tmp_path):
    """mmengine's Pretrained takes map_location; init_weights hands it to torch.load."""
    path = write_checkpoint('plain', source.state_dict(), tmp_path / 'plain.pth')
    seen = []

    def record(storage, location):
        seen.append(location)
        return storage
    target = small_model(out_indices=(3, ), init_cfg=dict(type='Pretrained', checkpoint=path,
                                                          map_location=record))
    target.init_weights()
    assert seen and set(seen) == {'cpu'}
    assert_same_weights(target, source.state_dict())


def test_state_dict_names_are_those_of_released_checkpoints():
    """Checkpoints key the layers built from norm_cfg/act_cfg/attn_cfg by these names."""
    keys = set(LaplacianFormer('tiny', attn_cfg=dict(qk_shared=True)).state_dict())
    assert {'stem.0.0.weight', 'stem.0.1.running_mean', 'stem.2.1.bias',
            'stages.1.downsample.0.weight', 'stages.1.downsample.1.running_var',
            'stages.0.blocks.0.norm1.weight', 'stages.0.blocks.0.norm2.bias',
            'stages.2.blocks.2.attn.qkv.weight', 'stages.2.blocks.2.attn.local.bias',
            'stages.3.blocks.1.attn.proj.weight', 'stages.3.blocks.1.mlp.fc1.weight',
            'stages.3.blocks.1.mlp.fc2.bias', 'norm0.weight', 'norm3.bias'} <= keys
    assert len(keys) == 156
