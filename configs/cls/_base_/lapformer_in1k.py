# ImageNet-1k pretraining recipe shared by lapformer_{t,s,m,l,h}_in1k.py (mmpretrain 1.x).
# DeiT/Swin recipe: 300 epochs, AdamW lr 1e-3 per 1024 images, wd 0.05 (none on norms,
# biases and 1-D params), 5 warm-up epochs then cosine, RandAugment m9, mixup 0.8,
# cutmix 1.0, label smoothing 0.1, random erasing 0.25, EMA of the weights.
# Batch: 16 GPUs x 64 images = 1024; auto_scale_lr rescales lr for other totals
# (pass --auto-scale-lr to mmpretrain's tools/train.py).
_base_ = [
    'mmpretrain::_base_/datasets/imagenet_bs64_swin_224.py',
    'mmpretrain::_base_/schedules/imagenet_bs1024_adamw_swin.py',
    'mmpretrain::_base_/default_runtime.py',
    '../../_base_/safe_runtime.py',
]

model = dict(
    type='ImageClassifier',
    backbone=dict(
        type='LaplacianFormer',
        arch='tiny',
        out_indices=(3, ),
        drop_path_rate=0.1),
    neck=dict(type='GlobalAveragePooling'),
    head=dict(
        type='LinearClsHead',
        num_classes=1000,
        in_channels=512,
        init_cfg=None,
        loss=dict(
            type='LabelSmoothLoss', label_smooth_val=0.1, mode='original'),
        cal_acc=False),
    init_cfg=[
        dict(type='TruncNormal', layer='Linear', std=0.02, bias=0.),
        dict(type='Constant', layer='LayerNorm', val=1., bias=0.)
    ],
    train_cfg=dict(augments=[
        dict(type='Mixup', alpha=0.8),
        dict(type='CutMix', alpha=1.0)
    ]),
)

warmup_epochs = 5
max_epochs = 300
optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05, eps=1e-8,
                   betas=(0.9, 0.999)),
    paramwise_cfg=dict(
        _delete_=True,
        norm_decay_mult=0.0,
        bias_decay_mult=0.0,
        flat_decay_mult=0.0),
    clip_grad=dict(max_norm=5.0),
)
param_scheduler = [
    dict(
        type='LinearLR',
        start_factor=1e-3,
        by_epoch=True,
        end=warmup_epochs,
        convert_to_iter_based=True),
    dict(
        type='CosineAnnealingLR',
        eta_min=1e-5,
        by_epoch=True,
        begin=warmup_epochs,
        end=max_epochs,
        convert_to_iter_based=True),
]
train_cfg = dict(by_epoch=True, max_epochs=max_epochs, val_interval=1)
auto_scale_lr = dict(base_batch_size=1024)

custom_hooks = [dict(type='EMAHook', momentum=1e-4, priority='ABOVE_NORMAL')]
