# Mask R-CNN + FPN with a LaplacianFormer-T backbone, COCO, 1x schedule
# (12 epochs, LR steps at 8 and 11), AdamW lr 1e-4, weight decay 0.05 (none on
# norm layers or position parameters), 2 images/GPU x 8 GPUs, 1333x800.
#
# The backbone starts from an ImageNet-1k LaplacianFormer checkpoint that you
# supply: put it at `pretrained` below (a classifier checkpoint with
# `backbone.` keys or a plain backbone state dict), or override on the command
# line: --cfg-options model.backbone.init_cfg.checkpoint=/path/to/in1k.pth
# To train from scratch instead: --cfg-options model.backbone.init_cfg=None
#
# 8 GPUs:  tools/dist_train.sh configs/maskrcnn_lapformer_t.py 8
# Other total batch sizes: add --auto-scale-lr (scales lr by batch/16).
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    'mmdet::_base_/default_runtime.py',
    './_base_/schedule_1x_adamw.py',
    './_base_/safe_runtime.py',
]

arch = 'tiny'
pretrained = 'checkpoints/lapformer_tiny_in1k.pth'  # user-supplied, see above
model = dict(
    backbone=dict(
        _delete_=True,
        type='LaplacianFormer',
        arch=arch,
        out_indices=(0, 1, 2, 3),
        drop_path_rate=0.1,
        norm_eval=False,
        with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 320, 512]))

train_dataloader = dict(batch_size=2, num_workers=2)
