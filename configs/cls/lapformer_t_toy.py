# LaplacianFormer-T classifier pretrained on the toy shapes set, sized for a CPU (mmpretrain).
#
# Data: `python tools/make_toy_imagenet.py` (writes data/toy_imagenet: 64 px images,
# one shape each, the 4 shape classes of the detection toy set in class folders).
# Run: `python tools/train.py configs/cls/lapformer_t_toy.py`; `make pretrain` trains it,
# converts the checkpoint with tools/convert_cls_to_backbone.py and starts the toy
# Mask R-CNN from it (configs/toy/maskrcnn_lapformer_t_toy_pretrained.py).
#
# Against the ImageNet recipe (_base_/lapformer_in1k.py): no Mixup/CutMix, RandAugment,
# random erasing, label smoothing or EMA (3 epochs on 2000 images), lr 3e-4 (1e-3 kept the
# loss near ln 4 for 3 epochs in a trial on a shape-only, 32 px variant of the set). As
# there, out_indices=(3,); every stage's norm is in the backbone all the same, so the
# converted checkpoint loads into the detection backbone with no missing keys.
# The pixel normalisation is the detection config's (mmdet's ImageNet mean/std, BGR->RGB).
_base_ = [
    'mmpretrain::_base_/default_runtime.py',
    '../_base_/safe_runtime.py',
]

data_root = 'data/toy_imagenet/'
classes = ('circle', 'square', 'triangle', 'star')

model = dict(
    type='ImageClassifier',
    data_preprocessor=dict(
        num_classes=len(classes),
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        to_rgb=True),
    backbone=dict(
        type='LaplacianFormer',
        arch='tiny',
        out_indices=(3, ),
        drop_path_rate=0.0,
        # GroupNorm as in the toy detectors that load this backbone (their batches of 4
        # make BN's statistics noisy: configs/toy/maskrcnn_lapformer_t_toy.py).
        conv_norm_cfg=dict(type='GN', num_groups=8)),
    neck=dict(type='GlobalAveragePooling'),
    head=dict(
        type='LinearClsHead',
        num_classes=len(classes),
        in_channels=512,
        loss=dict(type='CrossEntropyLoss', loss_weight=1.0)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    # Rotated shapes stay in their class when flipped either way.
    dict(type='RandomFlip', prob=0.5, direction=['horizontal', 'vertical']),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='PackInputs'),
]
# num_workers=0 keeps data loading in the training process: deterministic and no
# competition for the two cores.
train_dataloader = dict(
    batch_size=32,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=True),
    dataset=dict(
        type='CustomDataset',
        data_root=data_root,
        data_prefix='train',
        classes=classes,
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=50,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type='CustomDataset',
        data_root=data_root,
        data_prefix='val',
        classes=classes,
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_evaluator = val_evaluator

max_epochs = 3
train_cfg = dict(by_epoch=True, max_epochs=max_epochs, val_interval=max_epochs)
val_cfg = dict()
test_cfg = dict()
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=30),
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
    optimizer=dict(type='AdamW', lr=3e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0),
    clip_grad=dict(max_norm=5.0))
auto_scale_lr = dict(enable=False, base_batch_size=32)

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=10),
    checkpoint=dict(type='CheckpointHook', interval=max_epochs, max_keep_ckpts=1))
randomness = dict(seed=0, deterministic=True)
