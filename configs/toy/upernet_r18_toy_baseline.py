# Comparison baseline, not a LaplacianFormer model: the toy UperNet of
# upernet_lapformer_t_toy.py (same data, heads, schedule and seed) with
# mmseg's ResNet-18 (ResNetV1c, the ResNet family of mmseg's UperNet configs,
# also from scratch) in place of LaplacianFormer-T.
# Run: `python tools/train.py configs/toy/upernet_r18_toy_baseline.py`
# (docs/results.md compares the two).
_base_ = ['./upernet_lapformer_t_toy.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='ResNetV1c',
        depth=18,
        num_stages=4,
        out_indices=(0, 1, 2, 3),
        dilations=(1, 1, 1, 1),
        strides=(1, 2, 2, 2),
        norm_cfg=dict(type='BN', requires_grad=True),
        norm_eval=False,
        style='pytorch',
        contract_dilation=True,
        init_cfg=None),
    decode_head=dict(in_channels=[64, 128, 256, 512]),
    auxiliary_head=dict(in_channels=256))
