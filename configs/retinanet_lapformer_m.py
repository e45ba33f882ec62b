# RetinaNet + FPN with a LaplacianFormer-M backbone, COCO, 1x schedule.
# Same recipe as retinanet_lapformer_t.py (pretrained-checkpoint and DDP notes
# there); only the backbone size, its checkpoint and drop-path rate differ.
_base_ = ['./retinanet_lapformer_t.py']

arch = 'medium'
pretrained = 'checkpoints/lapformer_medium_in1k.pth'  # user-supplied
model = dict(
    backbone=dict(
        arch=arch,
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[128, 288, 512]))
