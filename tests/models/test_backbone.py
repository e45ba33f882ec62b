"""LaplacianFormer backbone: shapes, API switches, argument checks (CPU, small inputs)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from _attention_helpers import dense_attention_module, finite
from torch import nn

from lapformer_mm.analysis.landmark_solve import landmark_solve_residuals
from lapformer_mm.models import LaplacianAttention, LaplacianFormer
from lapformer_mm.models.backbone import ARCH_SETTINGS, resolve_arch

TINY_DIMS = ARCH_SETTINGS['tiny']['embed_dims']
SMALL_ARCH = dict(embed_dims=[16, 32, 32, 64], num_heads=[1, 1, 1, 2], depths=[1, 1, 1, 1])
TINY = dict(embed_dims=[32, 32, 32, 32], num_heads=[1, 1, 1, 1], depths=[1, 1, 1, 1])


def ceil_half(n, times):
    for _ in range(times):
        n = (n + 1) // 2
    return n


def expected_shapes(h, w, dims, indices=(0, 1, 2, 3)):
    """Stride-2 convolutions with padding 1 round up: 2 in the stem, 1 per stage 2-4."""
    return [(1, dims[i], ceil_half(h, 2 + i), ceil_half(w, 2 + i)) for i in indices]


@pytest.fixture(scope='module')
def tiny():
    torch.manual_seed(0)
    model = LaplacianFormer('tiny', drop_path_rate=0.0)
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize('hw', [(224, 224), (97, 131), (31, 33), (8, 8)])  # 8: below the grid
def test_output_shapes_any_size(tiny, hw):
    with torch.no_grad():
        outs = tiny(torch.randn(1, 3, *hw))
    assert [tuple(o.shape) for o in outs] == expected_shapes(*hw, TINY_DIMS)
    assert all(torch.isfinite(o).all() for o in outs)
    # mmcv's RoIAlign reads raw memory as NCHW (open-mmlab/mmcv#2203): a channels-last view
    # pooled scrambled features, which kept the toy Mask R-CNN at bbox AP50 0.04.
    assert all(o.is_contiguous() for o in outs)


@pytest.mark.filterwarnings('ignore:LaplacianFormer. out_indices=')
def test_out_indices_select_outputs_without_changing_them():
    """Every stage ends with its norm, returned or not: a classifier's weights run unchanged."""
    torch.manual_seed(0)
    full = LaplacianFormer(SMALL_ARCH, drop_path_rate=0.0)
    full.init_weights()
    for i in range(4):
        norm = getattr(full, f'norm{i}')
        nn.init.uniform_(norm.weight, 0.5, 2.0)
        nn.init.normal_(norm.bias)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = full.eval()(x)
        for indices in [(3, ), (1, ), (2, 0), (-1, -3)]:
            part = LaplacianFormer(SMALL_ARCH, out_indices=indices, drop_path_rate=0.0)
            result = part.load_state_dict(full.state_dict(), strict=False)
            assert not result.missing_keys
            wanted = sorted(i % 4 for i in indices)
            outs = part.eval()(x)
            assert len(outs) == len(wanted)
            for i, out in zip(wanted, outs):
                torch.testing.assert_close(out, expected[i], rtol=1e-6, atol=1e-6)


def test_stages_after_the_last_returned_one_do_not_run_and_are_named():
    with pytest.warns(UserWarning, match='num_stages'):
        model = LaplacianFormer(SMALL_ARCH, out_indices=(0, 1))
    calls = []
    model.stages[2].downsample.register_forward_hook(lambda *args: calls.append(1))
    outs = model(torch.randn(2, 3, 64, 64))
    assert len(outs) == 2 and not calls
    assert model.export_min_size() == 6 * 8 + 1  # the stages run: 7x7 landmarks at stride 8
    sum(o.sum() for o in outs).backward()
    assert all(p.grad is None for p in model.stages[3].parameters())


def block_params(c, hidden, attention):
    """Parameters of one block with attention 'softmax', 'tied' ([q, v]) or 'separate'."""
    norms = 2 * 2 * c
    mlp = c * hidden + hidden + hidden * c + c
    projections = 2 if attention == 'tied' else 3
    attn = c * projections * c + projections * c + c * c + c
    if attention != 'softmax':
        attn += 9 * c + c
    return norms + mlp + attn


DEFAULT_LAYOUT = ('tied', 'tied', 'tied', 'separate')


def closed_form_params(arch, out_indices=(3, ), layout=DEFAULT_LAYOUT):
    s = ARCH_SETTINGS[arch]
    dims, depths = s['embed_dims'], s['depths']
    total = 3 * 9 * 32 + 2 * 32 + 32 * 9 * 32 + 2 * 32 + 32 * 9 * dims[0] + 2 * dims[0]
    for i in range(4):
        if i:
            total += dims[i - 1] * 9 * dims[i] + 2 * dims[i]
        total += depths[i] * block_params(dims[i], 4 * dims[i], layout[i])
    return total + sum(2 * dims[i] for i in out_indices)


@pytest.mark.parametrize('kwargs, layout', [
    (dict(stage4_attention='softmax'), ('tied', 'tied', 'tied', 'softmax')),
    (dict(attn_cfg=dict(qk_shared=False)), ('separate',) * 4),
    (dict(attn_cfg=dict(qk_shared=True)), ('tied',) * 4),
    (dict(attn_cfg=dict(qk_shared=[False, True, False, True])),
     ('separate', 'tied', 'separate', 'tied')),
    # the default tiny; other options keep its layout
    (dict(), DEFAULT_LAYOUT),
    (dict(attn_cfg=dict(lam=2.0, solver='cg'), norm_cfg=dict(type='LN', eps=1e-6),
          act_cfg=dict(type='ReLU'),
          conv_norm_cfg=dict(type='GN', num_groups=8), conv_act_cfg=dict(type='SiLU')),
     DEFAULT_LAYOUT),
])
def test_layout_options_param_count(kwargs, layout):
    model = LaplacianFormer('tiny', **kwargs)
    assert sum(p.numel() for p in model.parameters()) == closed_form_params(
        'tiny', (0, 1, 2, 3), layout)


@pytest.mark.parametrize('name', ['small', 'medium', 'large', 'huge'])
def test_other_arches_param_count_and_forward(name):
    model = LaplacianFormer(name).eval()
    assert sum(p.numel() for p in model.parameters()) == closed_form_params(name, (0, 1, 2, 3))
    # 46.3 M parameters with a 1000-class head (paper); our layout must be within 3 %
    assert name != 'medium' or abs((closed_form_params(name) + 513_000) / 46.3e6 - 1) < 0.03
    dims = ARCH_SETTINGS[name]['embed_dims']
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 16, 16))
    assert [tuple(o.shape) for o in outs] == expected_shapes(16, 16, dims)


def test_arch_dict_numpy_numbers_and_alias():
    import numpy as np
    arch = dict(embed_dims=[np.int64(c) for c in (16, 32, 64, 64)], num_heads=[1, 1, 2, 2],
                depths=np.array([1, 1, 1, 1]).astype(np.int32).tolist(), mlp_ratios=np.float32(2))
    model = LaplacianFormer(arch).eval()
    outs = model(torch.randn(1, 3, 32, 32))
    assert [o.shape[1] for o in outs] == [16, 32, 64, 64]
    assert model.stages[0].blocks[0].mlp.fc1.out_features == 32
    assert resolve_arch('M') == resolve_arch('medium')


def test_attn_cfg_backend_is_the_old_name_of_impl():
    """Configs of the earlier release (attn_cfg backend=...) reach every attention as impl."""
    with pytest.warns(FutureWarning, match="'backend' is renamed 'impl'"):
        model = LaplacianFormer(SMALL_ARCH, attn_cfg=dict(backend='reference'))
    impls = {m.options.impl for m in model.modules() if isinstance(m, LaplacianAttention)}
    assert impls == {'reference'}


@pytest.mark.parametrize('kwargs, exc, name', [
    # Unknown keys were dropped, float widths failed deep in torch, an infinite ratio in int(),
    # a tiny one built a zero-width MLP.
    (dict(arch='giant'), ValueError, 'arch'),
    (dict(arch=dict(SMALL_ARCH, window=7)), ValueError, 'arch'),
    (dict(arch=dict(SMALL_ARCH, embed_dims=[16.0, 32, 32, 64])), ValueError, 'embed_dims'),
    (dict(arch=dict(SMALL_ARCH, depths=[1] * 3)), ValueError, 'depths'),
    (dict(arch=dict(SMALL_ARCH, mlp_ratios=float('inf'))), ValueError, 'mlp_ratios'),
    (dict(arch=dict(SMALL_ARCH, mlp_ratios=[4, 4, 4, 0.01])), ValueError, 'mlp_ratios'),
    (dict(arch=dict(SMALL_ARCH, num_heads=[3, 1, 1, 2])), ValueError, 'num_heads'),
    (dict(out_indices=(4, )), ValueError, 'out_indices'),
    (dict(out_indices=(1, 1)), ValueError, 'out_indices'),
    (dict(out_indices=(0.5, )), ValueError, 'out_indices'),
    # -2 froze nothing, 5 failed in an IndexError; 'linear' built Laplacian attention.
    (dict(frozen_stages=-2), ValueError, 'frozen_stages'),
    (dict(frozen_stages=5), ValueError, 'frozen_stages'),
    (dict(stage4_attention='linear'), ValueError, 'stage4_attention'),
    # Truthy stand-ins: qkv_bias='no' turned the bias on.
    (dict(qkv_bias='no'), TypeError, 'qkv_bias'), (dict(norm_eval='yes'), TypeError, 'norm_eval'),
    (dict(with_cp=1), TypeError, 'with_cp'),
    (dict(drop_path_rate=1.0), ValueError, 'drop_path_rate'),
    (dict(attn_cfg=dict(qk_shared=(True, False))), ValueError, 'qk_shared'),
    (dict(attn_cfg=dict(qk_shared='yes')), ValueError, 'qk_shared'),
    (dict(attn_cfg=dict(backend='reference', impl='reference')), ValueError, 'backend'),
    # A norm of dimension 1 normalised the tokens' N; a LayerNorm of the maps their W.
    (dict(norm_cfg=dict(type='BN')), ValueError, 'norm_cfg'),
    (dict(norm_cfg=dict(type='GN', num_groups=1)), ValueError, 'norm_cfg'),
    (dict(conv_norm_cfg=dict(type='LN')), ValueError, 'conv_norm_cfg'),
    (dict(init_cfg="{'type': 'Pretrained'}"), TypeError, 'init_cfg'),
])
@pytest.mark.filterwarnings('ignore::FutureWarning')
def test_bad_arguments_name_the_argument(kwargs, exc, name):
    """Through mmdet's MODELS.build: the same type and name as direct construction."""
    from mmdet.registry import MODELS
    from mmengine.registry import DefaultScope
    with DefaultScope.overwrite_default_scope('mmdet'), pytest.raises(exc, match=name):
        MODELS.build(dict(type='LaplacianFormer', **dict(dict(arch=SMALL_ARCH), **kwargs)))


def test_attn_cfg_reaches_every_laplacian_attention():
    """The options of attn_cfg are what each stage computes (dense fp64 reference)."""
    torch.manual_seed(0)
    options = dict(lam=2.0, kernel='gaussian', eps=0.05, whiten_eps=1e-3)
    qk_shared = (False, True, True, False)
    model = LaplacianFormer(SMALL_ARCH, drop_path_rate=0.0, attn_cfg=dict(
        options, qk_shared=qk_shared, landmark_grid=3, solver='exact')).double().eval()
    inputs = {}

    def record(name):
        def hook(module, args, out):
            inputs[name] = args, out
        return hook

    for name, module in model.named_modules():
        if isinstance(module, LaplacianAttention):
            module.register_forward_hook(record(name))
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 48, dtype=torch.float64))
    assert len(inputs) == 4
    for i in range(4):
        (x, hw), out = inputs[f'stages.{i}.blocks.0.attn']
        torch.testing.assert_close(
            out, dense_attention_module(model.stages[i].blocks[0].attn, x, hw, qk_shared[i], 3,
                                        **options))


def test_layer_cfgs_build_the_named_layers():
    model = LaplacianFormer(SMALL_ARCH, norm_cfg=dict(type='LN', eps=1e-6),
                            act_cfg=dict(type='ReLU'), conv_norm_cfg=dict(type='GN', num_groups=4),
                            conv_act_cfg=dict(type='SiLU'), norm_eval=True).train()
    block = model.stages[2].blocks[0]
    assert all(norm.eps == 1e-6 for norm in (block.norm1, block.norm2, model.norm3))
    assert type(block.mlp.act) is nn.ReLU
    assert [type(layer) for layer in model.stem[0]] == [nn.Conv2d, nn.GroupNorm, nn.SiLU]
    assert [type(layer) for layer in model.stages[1].downsample] == [
        nn.Conv2d, nn.GroupNorm, nn.SiLU]
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.GELU)) for m in model.modules())
    outs = model(torch.randn(2, 3, 32, 32))
    assert [o.shape[1] for o in outs] == SMALL_ARCH['embed_dims']
    default = LaplacianFormer(SMALL_ARCH)
    block = default.stages[0].blocks[0]
    assert type(block.norm1) is nn.LayerNorm and block.norm1.eps == 1e-5
    assert type(block.mlp.act) is nn.GELU
    conv, norm, act = default.stem[0]
    assert type(norm) is nn.BatchNorm2d and type(act) is nn.ReLU and act.inplace


def test_conv_norm_requires_grad_false_and_norm_eval_freeze_the_batchnorms():
    model = LaplacianFormer(SMALL_ARCH, conv_norm_cfg=dict(type='BN', requires_grad=False),
                            norm_eval=True).train()
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 6  # three in the stem, one per downsampling
    assert not any(p.requires_grad for norm in norms for p in norm.parameters())
    assert all(not bn.training for bn in norms) and model.stages[0].blocks[0].training


@pytest.mark.parametrize('frozen', [0, 2, 4])
def test_frozen_stages_survive_train(frozen):
    model = LaplacianFormer('tiny', frozen_stages=frozen)
    model.train()
    frozen_modules = [model.stem] + [model.stages[i] for i in range(frozen)]
    frozen_modules += [getattr(model, f'norm{i}') for i in range(frozen)]
    for module in frozen_modules:
        assert not module.training
        assert all(not p.requires_grad for p in module.parameters())
    for i in range(frozen, 4):
        assert model.stages[i].training
        assert all(p.requires_grad for p in model.stages[i].parameters())
    # frozen BN statistics do not move in a training step
    bn = model.stem[0][1]
    before = bn.running_mean.clone()
    model(torch.randn(2, 3, 32, 32))
    assert torch.equal(bn.running_mean, before)


def test_with_cp_same_outputs_and_grads():
    torch.manual_seed(0)
    arch = dict(SMALL_ARCH, depths=[2, 1, 1, 2])
    plain = LaplacianFormer(arch, drop_path_rate=0.0, norm_eval=True)
    plain.init_weights()
    ckpt = LaplacianFormer(arch, drop_path_rate=0.0, norm_eval=True, with_cp=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 48, 40)
    grads, outs, block_calls = [], [], []
    for model in (plain, ckpt):
        model.train()
        calls = []
        for stage in model.stages:
            for block in stage.blocks:
                block.register_forward_pre_hook(lambda m, _: calls.append(m))
        out = model(x)
        sum(o.square().mean() for o in out).backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in model.named_parameters()})
        block_calls.append(len(calls))
    # Checkpointing recomputes each of the 6 blocks' forward in the backward (a pre-hook:
    # the non-reentrant recompute stops early, before the forward hooks would run).
    assert block_calls == [6, 12]
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
    # every parameter takes part (DDP without find_unused_parameters)
    assert all(g is not None for g in grads[0].values())
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_drop_path_linear_over_blocks():
    model = LaplacianFormer('tiny', drop_path_rate=0.3)
    probs = [b.drop_path.drop_prob for s in model.stages for b in s.blocks]
    expected = torch.linspace(0, 0.3, len(probs)).tolist()
    assert probs == pytest.approx(expected)


def test_autocast_bfloat16_forward_and_backward_follow_fp32():
    """bf16 autocast: maps and gradients within bf16's precision of fp32's (1-7 %, 10 %)."""
    torch.manual_seed(0)
    model = LaplacianFormer(SMALL_ARCH, drop_path_rate=0.0).train()
    fp32 = copy.deepcopy(model)
    x = torch.randn(2, 3, 40, 36)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        outs = model(x)
    refs = fp32(x)
    assert [o.dtype for o in outs] == [torch.bfloat16] * 4
    for i, (out, ref) in enumerate(zip(outs, refs)):
        error = float((out.float() - ref).detach().norm() / ref.detach().norm())
        assert error < 0.12, (i, error)
    for loss_outs in (outs, refs):
        sum(o.float().square().mean() for o in loss_outs).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref_grad = torch.cat([p.grad.flatten() for p in fp32.parameters()])
    error = float((grad - ref_grad).norm() / ref_grad.norm())
    assert error < 0.2, error


def test_constant_image_gives_finite_gradients_and_small_residuals():
    torch.manual_seed(0)
    model = LaplacianFormer(arch=TINY)
    img = torch.full((2, 3, 48, 40), 0.5, requires_grad=True)
    outs = model(img)
    sum(o.square().sum() for o in outs).backward()
    assert finite(*outs, img.grad)
    assert all(finite(p.grad) for p in model.parameters() if p.grad is not None)
    reports = landmark_solve_residuals(model.eval(), img.detach())
    assert all(r.residual < 1e-2 for r in reports.values()), reports


@pytest.mark.parametrize('size', [(1, 1), (3, 5), (17, 9)])
def test_backbone_runs_images_down_to_one_pixel(size):
    """Every stage 1x1 or more; batch 2, as training-mode BatchNorm needs."""
    model = LaplacianFormer(arch=TINY)
    img = torch.randn(2, 3, *size, requires_grad=True)
    outs = model(img)
    sum(o.sum() for o in outs).backward()
    assert tuple(outs[-1].shape[-2:]) == (1, 1)
    assert finite(*outs, img.grad)
    with torch.no_grad():
        assert finite(*model.eval()(img[:1]))


def test_block_is_two_pre_norm_residuals():
    """x + attn(norm1(x)), then + mlp(norm2(·)): the composition written out."""
    torch.manual_seed(0)
    block = LaplacianFormer(SMALL_ARCH, drop_path_rate=0.0).eval().stages[1].blocks[0]
    for norm in (block.norm1, block.norm2):
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
    x, hw = torch.randn(2, 8 * 6, 32), (8, 6)
    with torch.no_grad():
        h = x + block.attn(F.layer_norm(x, (32, ), block.norm1.weight, block.norm1.bias), hw)
        h2 = F.layer_norm(h, (32, ), block.norm2.weight, block.norm2.bias)
        expected = h + block.mlp.fc2(F.gelu(block.mlp.fc1(h2)))
        torch.testing.assert_close(block(x, hw), expected)
