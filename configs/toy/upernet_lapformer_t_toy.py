# UperNet + LaplacianFormer-T on the bundled toy shapes, semantic segmentation
# on a CPU, from scratch (no pretrained weights).
#
# Data: `python tools/make_toy_coco.py --seg-out data/toy_seg` (mmseg's
# img_dir/ann_dir layout, 128 px images, label 0 = background, 1-4 = shapes).
# `reduce_zero_label=False`: 0 is a real class here (the background the model
# must tell from the shapes, and most of every image), not ADE20K's
# "unlabelled" that is turned into the ignore index 255.
# Run: `python tools/train.py configs/toy/upernet_lapformer_t_toy.py`
# (`make seg` trains and evaluates it with mmseg's IoUMetric; docs/results.md).
_base_ = [
    'mmseg::_base_/models/upernet_r50.py',
    'mmseg::_base_/default_runtime.py',
    '../_base_/safe_runtime.py',
]

data_root = 'data/toy_seg/'
classes = ('background', 'circle', 'square', 'triangle', 'star')
# RGB label colours of the overlays, unlike any shape's own colour so that a
# wrong class shows (circle magenta, square cyan, triangle orange, star white).
palette = [[0, 0, 0], [255, 0, 255], [0, 255, 255], [255, 140, 0],
           [255, 255, 255]]

# Heads slimmed to 64 channels: a ten-minute CPU budget cannot train mmseg's
# 512-channel UperNet from scratch, and 5 classes need far fewer. BatchNorm
# instead of the base's SyncBN (one process; with 4 images of 128 px per
# batch, the statistics cover 64k head pixels per step).
head_norm = dict(type='BN', requires_grad=True)
# Background covers 80% of the training pixels, circles 7.1%, squares 6.4%,
# triangles 3.2% and stars 2.9%. With plain cross-entropy the two rarest
# classes were still never predicted after 800 iterations (val IoU 0 for
# both, mIoU 54.4, measured with this recipe); weighting each class about
# inversely to its share of the shapes' pixels (background halved) fixes it.
class_weight = [0.5, 1.0, 1.0, 2.0, 2.0]
# mmseg 1.2.2's weighted cross-entropy indexes class_weight with every label,
# the ignore index 255 of padded pixels included (an IndexError), so images
# are never padded: size_divisor=32 leaves 128 px (and any multiple of 32) as
# it is.
data_preprocessor = dict(size=None, size_divisor=32)
model = dict(
    data_preprocessor=data_preprocessor,
    pretrained=None,
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
    decode_head=dict(
        in_channels=[64, 128, 320, 512],
        channels=64,
        norm_cfg=head_norm,
        num_classes=len(classes),
        loss_decode=dict(class_weight=class_weight)),
    auxiliary_head=dict(
        in_channels=320,
        channels=32,
        norm_cfg=head_norm,
        num_classes=len(classes),
        loss_decode=dict(class_weight=class_weight)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(type='PackSegInputs'),
]
dataset = dict(
    type='BaseSegDataset',
    data_root=data_root,
    metainfo=dict(classes=classes, palette=palette),
    img_suffix='.png',
    seg_map_suffix='.png',
    reduce_zero_label=False)
# num_workers=0 keeps data loading in the training process: deterministic
# and no competition for the two cores.
train_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        **dataset,
        data_prefix=dict(img_path='img_dir/train', seg_map_path='ann_dir/train'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        **dataset,
        data_prefix=dict(img_path='img_dir/val', seg_map_path='ann_dir/val'),
        test_mode=True,
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='IoUMetric', iou_metrics=['mIoU'])
test_evaluator = val_evaluator

# 800 iterations x 4 images = 10 passes over the 320 training images.
max_iters = 800
train_cfg = dict(
    type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
# From scratch: AdamW at the detection toy's 5e-4 after a short warm-up, then
# mmseg's linear (power 1) poly decay.
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=100),
    dict(type='PolyLR', power=1.0, eta_min=0.0, by_epoch=False, begin=100,
         end=max_iters),
]
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=5e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0),
    clip_grad=dict(max_norm=10.0, norm_type=2))
auto_scale_lr = dict(enable=False, base_batch_size=4)

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=10, log_metric_by_epoch=False),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=max_iters,
                    max_keep_ckpts=1),
    visualization=dict(type='SegVisualizationHook'))  # draws for tools/test.py --show-dir
log_processor = dict(by_epoch=False)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
randomness = dict(seed=0, deterministic=True)
