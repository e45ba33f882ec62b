"""LaplacianFormer(num_stages=k): the first k stages; four-stage checkpoints load."""
import pytest
import torch

from lapformer_mm.models import LaplacianFormer
from lapformer_mm.models.pretrained import load_backbone_weights

ARCH = dict(embed_dims=[16, 32, 32, 64], num_heads=[1, 1, 1, 2], depths=[1, 2, 1, 1])


def build(**kwargs):
    kwargs.setdefault('drop_path_rate', 0.0)
    return LaplacianFormer(ARCH, **kwargs)


@pytest.mark.parametrize('num_stages', [1, 2, 3, 4])
def test_builds_and_returns_only_the_first_stages(num_stages):
    model = build(num_stages=num_stages, out_indices=tuple(range(num_stages))).eval()
    assert len(model.stages) == num_stages
    assert model.embed_dims == ARCH['embed_dims'][:num_stages]
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 64, 32))
    assert [tuple(o.shape) for o in outs] == [
        (1, ARCH['embed_dims'][i], 16 // 2**i, 8 // 2**i) for i in range(num_stages)]


@pytest.mark.parametrize('kwargs, name', [
    (dict(num_stages=2), 'out_indices'),  # the default (0, 1, 2, 3)
    (dict(num_stages=2, out_indices=(-3, )), 'out_indices'),
    (dict(num_stages=2, out_indices=(1, ), frozen_stages=3), 'frozen_stages'),
    (dict(num_stages=0, out_indices=(0, )), 'num_stages'),
])
def test_ranges_follow_num_stages(kwargs, name):
    with pytest.raises(ValueError, match=name):
        build(**kwargs)
    model = build(num_stages=2, out_indices=(0, 1), frozen_stages=2).train()
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.stages[1].training


def test_per_stage_attn_cfg_keeps_four_entries():
    model = build(num_stages=2, out_indices=(1, ),
                  attn_cfg=dict(qk_shared=(False, True, True, True)))
    assert model.qk_shared == (False, True, True, True)
    assert not model.stages[0].blocks[0].attn.qk_shared
    assert model.stages[1].blocks[0].attn.qk_shared


def test_full_checkpoint_loads_into_fewer_stages_a_prefix_of_the_full_model(tmp_path):
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match='returns no map of stages 3, 4'):
        full = build(out_indices=(1, ))
    for p in full.parameters():
        p.data.add_(torch.randn_like(p))
    path = tmp_path / 'full.pth'
    torch.save(dict(state_dict=full.state_dict()), path)
    two = build(num_stages=2, out_indices=(-1, ))
    assert two.out_indices == (1, )  # the last built index is -1
    report = load_backbone_weights(two, str(path))
    assert report.missing_keys == ()
    assert report.unexpected_keys
    assert all(k.startswith(('stages.2.', 'stages.3.', 'norm2.', 'norm3.'))
               for k in report.unexpected_keys)
    own = two.state_dict()
    for key, value in full.state_dict().items():
        if key in own:
            assert torch.equal(own[key], value), key
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(two.eval()(x)[0], full.eval()(x)[0])


def test_default_is_four_stages_positional_arguments_unchanged():
    model = LaplacianFormer(ARCH, 3, (0, 3))
    assert model.num_stages == len(model.stages) == 4 and model.out_indices == (0, 3)
