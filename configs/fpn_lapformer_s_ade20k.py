# Semantic FPN with a LaplacianFormer-S backbone, ADE20K, 512x512, 80k
# iterations: the recipe of fpn_lapformer_t_ade20k.py (pretrained-checkpoint
# notes there) with a larger backbone.
_base_ = ['./fpn_lapformer_t_ade20k.py']

arch = 'small'
pretrained = 'checkpoints/lapformer_small_in1k.pth'  # user-supplied
model = dict(
    backbone=dict(
        arch=arch,
        drop_path_rate=0.2,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 320, 512]))
