# Semantic FPN with a LaplacianFormer-M backbone, ADE20K, 512x512, 80k
# iterations: the recipe of fpn_lapformer_t_ade20k.py (pretrained-checkpoint
# notes there) with a larger backbone.
_base_ = ['./fpn_lapformer_t_ade20k.py']

arch = 'medium'
pretrained = 'checkpoints/lapformer_medium_in1k.pth'  # user-supplied
model = dict(
    backbone=dict(
        arch=arch,
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 288, 512]))
