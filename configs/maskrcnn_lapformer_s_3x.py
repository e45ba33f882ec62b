# Mask R-CNN + FPN, LaplacianFormer-S, COCO, 3x multi-scale schedule:
# the recipe of maskrcnn_lapformer_t_3x.py with the backbone of
# maskrcnn_lapformer_s.py (pretrained-checkpoint notes there).
_base_ = ['./maskrcnn_lapformer_t_3x.py']

arch = 'small'
pretrained = 'checkpoints/lapformer_small_in1k.pth'  # user-supplied
model = dict(
    backbone=dict(
        arch=arch,
        drop_path_rate=0.2,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 320, 512]))
