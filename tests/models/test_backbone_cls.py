"""ImageNet configs parse, the classifier->backbone converter, param counts, FLOP handlers."""
import os

import pytest
import torch
from _runner_helpers import assert_refused_with_hint
from _shared import CONFIG_DIR
from mmengine.config import Config

from lapformer_mm.cli import convert_cls_to_backbone
from lapformer_mm.models import ARCH_SETTINGS, LaplacianAttention, LaplacianFormer

SIZES = {'t': ('tiny', 0.1), 's': ('small', 0.2), 'm': ('medium', 0.3), 'l': ('large', 0.4),
         'h': ('huge', 0.5)}


@pytest.mark.parametrize('short', sorted(SIZES))
def test_in1k_config_parses_with_the_recipe(short):
    cfg = Config.fromfile(os.path.join(CONFIG_DIR, 'cls', f'lapformer_{short}_in1k.py'))
    arch, dpr = SIZES[short]
    backbone = cfg.model.backbone
    assert backbone.type == 'LaplacianFormer'
    assert (backbone.arch, backbone.drop_path_rate) == (arch, dpr)
    assert cfg.model.head.in_channels == ARCH_SETTINGS[arch]['embed_dims'][-1]
    assert cfg.model.neck.type == 'GlobalAveragePooling'
    assert cfg.model.head.loss.label_smooth_val == 0.1
    assert [(a.type, a.alpha) for a in cfg.model.train_cfg.augments] == [('Mixup', 0.8),
                                                                          ('CutMix', 1.0)]
    opt = cfg.optim_wrapper
    assert opt.optimizer.type == 'AdamW'
    assert (opt.optimizer.lr, opt.optimizer.weight_decay) == (1e-3, 0.05)
    assert opt.paramwise_cfg.norm_decay_mult == 0.0 and opt.paramwise_cfg.bias_decay_mult == 0.0
    assert 'custom_keys' not in opt.paramwise_cfg
    assert cfg.auto_scale_lr.base_batch_size == 1024
    warmup, cosine = cfg.param_scheduler
    assert warmup.type == 'LinearLR' and 5 <= warmup.end <= 10
    assert cosine.type == 'CosineAnnealingLR' and cosine.begin == warmup.end and cosine.end == 300
    assert cfg.train_cfg.max_epochs == 300
    steps = {t.type: t for t in cfg.train_dataloader.dataset.pipeline}
    assert steps['RandAugment'].magnitude_level == 9
    assert steps['RandomErasing'].erase_prob == 0.25
    assert [h.type for h in cfg.custom_hooks] == ['EMAHook']
    assert cfg.custom_imports.imports == ['lapformer_mm']


def test_in1k_classifier_builds_through_mmpretrain_and_classifies_a_batch():
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS

    cfg = Config.fromfile(os.path.join(CONFIG_DIR, 'cls', 'lapformer_t_in1k.py'))
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        model = MODELS.build(cfg.model)
    model.init_weights()
    assert type(model.backbone) is LaplacianFormer
    images = [torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8) for _ in range(2)]
    with torch.no_grad():
        samples = model.eval().test_step(dict(inputs=images))
    assert len(samples) == 2
    for sample in samples:
        assert sample.pred_score.shape == (1000, )
        assert torch.allclose(sample.pred_score.sum(), torch.tensor(1.0))
        assert sample.pred_label.item() == sample.pred_score.argmax().item()


def test_convert_checks_the_arch_before_writing(tmp_path, capsys):
    arch = dict(embed_dims=[16, 32, 32, 64], num_heads=[1, 1, 1, 2], depths=[1, 1, 1, 1])
    src, dst = tmp_path / 'cls.pth', tmp_path / 'backbone.pth'
    torch.save({f'backbone.{k}': v for k, v in LaplacianFormer(arch).state_dict().items()}, src)
    with pytest.raises(ValueError, match='arch'):
        convert_cls_to_backbone.convert(str(src), str(dst), dict(arch, depths=[1, 2, 1, 1]))
    # A classifier with softmax attention in stage 4 converts when told so.
    softmax = LaplacianFormer(arch, stage4_attention='softmax').state_dict()
    softmax_src = tmp_path / 'softmax.pth'
    torch.save(softmax, softmax_src)
    with pytest.raises(ValueError, match='--stage4-attention'):
        convert_cls_to_backbone.convert(str(softmax_src), str(dst), arch)
    assert not dst.exists()
    assert convert_cls_to_backbone.convert(str(softmax_src), str(dst), arch,
                                           'softmax').keys() == softmax.keys()
    dst.unlink()
    # The command line: one line on stderr and exit status 2, as for other user errors.
    assert convert_cls_to_backbone.main([str(src), str(dst), '--arch', 'xxl']) == 2
    err = capsys.readouterr().err
    assert '--arch' in err and 'xxl' in err and err.count('\n') == 1
    assert not dst.exists()
    convert_cls_to_backbone.convert(str(src), str(dst), arch)
    assert dst.exists()
    # A classifier saved without the backbone. prefix: its head is left out.
    own = LaplacianFormer(arch).state_dict()
    torch.save(dict(own, **{'head.fc.weight': torch.randn(10, 64)}), src)
    converted = convert_cls_to_backbone.convert(str(src), str(dst), arch)
    assert 'unexpected: head.fc.weight' in capsys.readouterr().out
    assert converted.keys() == own.keys()
    assert torch.load(dst, weights_only=True)['state_dict'].keys() == own.keys()


def test_flop_handlers_count_the_attention_core():
    from lapformer_mm.analysis.flops import flop_analyzer
    torch.manual_seed(0)
    dim, heads, hw, iters = 64, 2, (10, 12), 5
    attn = LaplacianAttention(dim, heads, iters=iters).eval()
    x = torch.randn(1, hw[0] * hw[1], dim)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x):
            return self.attn(x, hw)

    by_op = flop_analyzer(Wrapped(), (x, )).by_operator()
    n, d, m = hw[0] * hw[1], dim // heads, 7 * 7
    # qk_shared: k(q, L) once and k(L, L), each N·M·(d + 1)
    assert by_op['pairwise_kernel'] == heads * (n * m + m * m) * (d + 1)
    assert by_op['newton_schulz'] == heads * (2 * m**3 * iters + m * m)
    assert by_op['linear'] == n * dim * 2 * dim + n * dim * dim
    assert by_op['conv'] == n * dim * 9
    # Ck^T v and Z (...), then the landmark-sized X (Ck^T v), P x and X r of the
    # refinement step, all as matmul
    assert by_op['matmul'] == heads * (m * n * d + n * m * d + 3 * m * m * d)


@pytest.mark.usefixtures('mmdet_scope')
def test_converter_refuses_code_running_checkpoint(evil, tmp_path):
    path, marker = evil
    convert = convert_cls_to_backbone
    out = tmp_path / 'backbone.pth'
    with pytest.raises(RuntimeError) as info:
        convert.convert(path, str(out))
    assert_refused_with_hint(str(info.value), path)
    assert not out.exists() and not marker.exists()


def test_layer_wise_lr_decay_of_mmpretrain_reads_the_block_order():
    """mmpretrain's LearningRateDecayOptimWrapperConstructor reads each parameter's depth."""
    from mmengine.optim import build_optim_wrapper
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS
    model_cfg = Config.fromfile(os.path.join(CONFIG_DIR, 'cls', 'lapformer_t_toy.py')).model
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        model = MODELS.build(model_cfg)
        wrapper = build_optim_wrapper(model, dict(
            optimizer=dict(type='AdamW', lr=1.0, weight_decay=0.05),
            constructor='LearningRateDecayOptimWrapperConstructor',
            paramwise_cfg=dict(layer_decay_rate=0.5)))
    lr = {group['param_name']: group['lr'] for group in wrapper.optimizer.param_groups}
    depths = model.backbone.arch_settings['depths']
    top = sum(depths) + 1
    assert lr['backbone.stem.0.0.weight'] == 0.5 ** top
    assert lr['backbone.stages.0.blocks.0.attn.qkv.weight'] == 0.5 ** (top - 1)
    assert lr['backbone.stages.1.downsample.0.weight'] == 0.5 ** (top - 1)
    assert lr[f'backbone.stages.3.blocks.{depths[3] - 1}.mlp.fc2.bias'] == 0.5 ** 1
    assert lr['backbone.norm1.weight'] == 0.5 ** (top - depths[0] - depths[1])
    assert lr['backbone.norm3.weight'] == 0.5 ** 1 and lr['head.fc.weight'] == 1.0
