# Mask R-CNN + FPN with a LaplacianFormer-L backbone, COCO, 1x schedule.
# Same recipe as maskrcnn_lapformer_t.py (read it for the pretrained-checkpoint
# notes); only the backbone size, its checkpoint and drop-path rate differ.
_base_ = ['./maskrcnn_lapformer_t.py']

arch = 'large'
pretrained = 'checkpoints/lapformer_large_in1k.pth'  # user-supplied
model = dict(
    backbone=dict(
        arch=arch,
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 320, 512]))
