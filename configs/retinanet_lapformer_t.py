# RetinaNet + FPN with a LaplacianFormer-T backbone, COCO, 1x schedule
# (12 epochs, steps at 8 and 11), AdamW lr 1e-4, weight decay 0.05 (none on
# norm layers or position parameters), 2 images/GPU x 8 GPUs, 1333x800.
#
# RetinaNet uses the stride-8/16/32 maps only, so the backbone returns stages
# 1-3 (out_indices=(1, 2, 3)) and the FPN starts at its first input: no
# parameter is left without a gradient, and DDP needs no
# find_unused_parameters.
#
# Pretrained checkpoint (user-supplied): set `pretrained` below or pass
# --cfg-options model.backbone.init_cfg.checkpoint=/path/to/in1k.pth
# (model.backbone.init_cfg=None trains from scratch).
# 8 GPUs:  tools/dist_train.sh configs/retinanet_lapformer_t.py 8
_base_ = [
    'mmdet::_base_/models/retinanet_r50_fpn.py',
    'mmdet::_base_/datasets/coco_detection.py',
    'mmdet::_base_/default_runtime.py',
    './_base_/schedule_1x_adamw.py',
    './_base_/safe_runtime.py',
]

arch = 'tiny'
pretrained = 'checkpoints/lapformer_tiny_in1k.pth'  # user-supplied
model = dict(
    backbone=dict(
        _delete_=True,
        type='LaplacianFormer',
        arch=arch,
        out_indices=(1, 2, 3),
        drop_path_rate=0.1,
        norm_eval=False,
        with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[128, 320, 512], start_level=0, num_outs=5))

train_dataloader = dict(batch_size=2, num_workers=2)
