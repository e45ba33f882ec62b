# Mask R-CNN + LaplacianFormer-T on the bundled toy shapes set, sized for a CPU.
#
# Data: `python tools/make_toy_coco.py` (writes data/toy_coco, 128 px images,
# 4 classes). Trained from scratch (no pretrained weights), so the heads are
# slimmed down and anchors are halved to match the 26-77 px objects.
# Run: `python tools/train.py configs/toy/maskrcnn_lapformer_t_toy.py`
# (`make main` trains and evaluates it: bbox AP50 0.91 after 6 epochs,
# docs/results.md).
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/default_runtime.py',
    '../_base_/safe_runtime.py',
]

data_root = 'data/toy_coco/'
classes = ('circle', 'square', 'triangle', 'star')
img_size = 128
fpn_channels = 64

# GroupNorm in the neck and RoI heads: without pretrained weights, normalised
# heads are what makes a detector trainable in a few hundred steps
# (He et al., "Rethinking ImageNet Pre-training", 2019).
head_norm = dict(type='GN', num_groups=16, requires_grad=True)
model = dict(
    data_preprocessor=dict(pad_size_divisor=32),
    backbone=dict(
        _delete_=True,
        type='LaplacianFormer',
        arch='tiny',
        out_indices=(0, 1, 2, 3),
        drop_path_rate=0.0,
        # GroupNorm in the convolutional stem and downsamplings: BN's batch statistics
        # over 4 images differ from its running ones by 34% at the stem and 44-68% at
        # the outputs (train vs eval), and cost 5.0 mIoU / 3.5 AP50 here
        # (docs/results.md, Attention against its peers).
        conv_norm_cfg=dict(type='GN', num_groups=8),
        norm_eval=False,
        init_cfg=None),
    neck=dict(
        in_channels=[64, 128, 320, 512],
        out_channels=fpn_channels,
        norm_cfg=head_norm),
    rpn_head=dict(
        in_channels=fpn_channels,
        feat_channels=fpn_channels,
        anchor_generator=dict(scales=[4])),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=fpn_channels),
        bbox_head=dict(
            type='Shared4Conv1FCBBoxHead',
            in_channels=fpn_channels,
            conv_out_channels=fpn_channels,
            fc_out_channels=256,
            norm_cfg=head_norm,
            num_classes=len(classes)),
        mask_roi_extractor=dict(out_channels=fpn_channels),
        mask_head=dict(
            num_convs=2,
            in_channels=fpn_channels,
            conv_out_channels=fpn_channels,
            norm_cfg=head_norm,
            num_classes=len(classes))),
    train_cfg=dict(
        rpn=dict(sampler=dict(num=128)),
        rpn_proposal=dict(nms_pre=1000, max_per_img=300),
        rcnn=dict(sampler=dict(num=64, pos_fraction=0.5), mask_size=28)),
    test_cfg=dict(
        rpn=dict(nms_pre=300, max_per_img=100),
        rcnn=dict(max_per_img=20)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(img_size, img_size), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(img_size, img_size), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(
        type='PackDetInputs',
        meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape',
                   'scale_factor')),
]
# num_workers=0 keeps data loading in the training process: deterministic
# and no competition for the two cores.
train_dataloader = dict(
    batch_size=2,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=True),
    batch_sampler=dict(type='AspectRatioBatchSampler'),
    dataset=dict(
        type='CocoDataset',
        data_root=data_root,
        metainfo=dict(classes=classes),
        ann_file='annotations/instances_train.json',
        data_prefix=dict(img='train/'),
        filter_cfg=dict(filter_empty_gt=True, min_size=4),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=False,
    drop_last=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type='CocoDataset',
        data_root=data_root,
        metainfo=dict(classes=classes),
        ann_file='annotations/instances_val.json',
        data_prefix=dict(img='val/'),
        test_mode=True,
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(
    type='CocoMetric',
    ann_file=data_root + 'annotations/instances_val.json',
    metric=['bbox', 'segm'],
    format_only=False)
test_evaluator = val_evaluator

max_epochs = 6
train_cfg = dict(
    type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=max_epochs)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=200),
    dict(
        type='CosineAnnealingLR',
        T_max=max_epochs,
        eta_min_ratio=0.01,
        begin=0,
        end=max_epochs,
        by_epoch=True,
        convert_to_iter_based=True),
]
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=5e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0),
    clip_grad=dict(max_norm=10.0, norm_type=2))
auto_scale_lr = dict(enable=False, base_batch_size=2)

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=10),
    checkpoint=dict(type='CheckpointHook', interval=max_epochs, max_keep_ckpts=1))
env_cfg = dict(dist_cfg=dict(backend='gloo'))
randomness = dict(seed=0, deterministic=True)
