# Mask R-CNN + FPN, LaplacianFormer-T, COCO, 3x schedule (36 epochs, LR steps at
# 27 and 33) with mmdet's Swin 3x augmentation (mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco,
# from DETR): the shorter side drawn from 480..800 (step 32), the longer capped at 1333,
# or, half the time, a random crop of a 400/500/600 resize first. Test scale 1333x800.
# Pretrained-checkpoint notes: see maskrcnn_lapformer_t.py.
_base_ = ['./maskrcnn_lapformer_t.py']

multi_scale = [(1333, short) for short in range(480, 801, 32)]
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args={{_base_.backend_args}}),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomFlip', prob=0.5),
    dict(
        type='RandomChoice',
        transforms=[
            [dict(type='RandomChoiceResize', scales=multi_scale, keep_ratio=True)],
            [
                dict(type='RandomChoiceResize',
                     scales=[(1333, 400), (1333, 500), (1333, 600)], keep_ratio=True),
                dict(type='RandomCrop', crop_type='absolute_range', crop_size=(384, 600),
                     allow_negative_crop=True),
                dict(type='RandomChoiceResize', scales=multi_scale, keep_ratio=True),
            ],
        ]),
    dict(type='PackDetInputs'),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))

max_epochs = 36
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
        milestones=[27, 33],
        gamma=0.1),
]
