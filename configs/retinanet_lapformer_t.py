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
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['lapformer_mm'], allow_failed_imports=False)

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

max_epochs = 12
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [
    dict(
        type='LinearLR', start_factor=0.001, by_epoch=False, begin=0,
        end=1000),
    dict(
        type='MultiStepLR',
        begin=0,
        end=max_epochs,
        by_epoch=True,
        milestones=[8, 11],
        gamma=0.1),
]
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(
        _delete_=True,
        type='AdamW',
        lr=1e-4,
        betas=(0.9, 0.999),
        weight_decay=0.05),
    paramwise_cfg=dict(
        norm_decay_mult=0.0,
        custom_keys={
            'pos_embed': dict(decay_mult=0.0),
            'pos_block': dict(decay_mult=0.0),
            'norm': dict(decay_mult=0.0),
        }))
auto_scale_lr = dict(enable=False, base_batch_size=16)
