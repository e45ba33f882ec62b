# Mask R-CNN + FPN, LaplacianFormer-M, COCO, 3x multi-scale schedule:
# the recipe of maskrcnn_lapformer_t_3x.py with the backbone of
# maskrcnn_lapformer_m.py (pretrained-checkpoint notes there).
_base_ = ['./maskrcnn_lapformer_t_3x.py']

arch = 'medium'
pretrained = 'checkpoints/lapformer_medium_in1k.pth'  # user-supplied
model = dict(
    backbone=dict(
        arch=arch,
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 288, 512]))
