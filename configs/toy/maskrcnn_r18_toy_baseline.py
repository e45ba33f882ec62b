# Diagnostic baseline, not a LaplacianFormer model: the toy Mask R-CNN of
# maskrcnn_lapformer_t_toy.py with mmdet's ResNet-18 (also from scratch) in
# place of LaplacianFormer-T, to tell recipe/data problems from backbone ones.
# Run: `python tools/train.py configs/toy/maskrcnn_r18_toy_baseline.py`
_base_ = ['./maskrcnn_lapformer_t_toy.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='ResNet',
        depth=18,
        num_stages=4,
        out_indices=(0, 1, 2, 3),
        frozen_stages=-1,
        norm_cfg=dict(type='BN', requires_grad=True),
        norm_eval=False,
        init_cfg=None),
    neck=dict(in_channels=[64, 128, 256, 512]))
