# The COCO 1x recipe shared by the LaplacianFormer detectors: 12 epochs with LR
# steps at 8 and 11 after a 1000-iteration linear warm-up, AdamW lr 1e-4 and
# weight decay 0.05 (none on norm layers), 2 images/GPU
# x 8 GPUs (auto_scale_lr's base batch 16; the detector configs set 2 images
# per GPU). It replaces the SGD of mmdet's schedules/schedule_1x.py.
_base_ = ['mmdet::_base_/schedules/schedule_1x.py']

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
# norm_decay_mult covers BatchNorm/LayerNorm/GroupNorm weights and biases (the
# backbone has no position parameters: docs/backbone.md, "Weight decay").
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(
        _delete_=True,
        type='AdamW',
        lr=1e-4,
        betas=(0.9, 0.999),
        weight_decay=0.05),
    paramwise_cfg=dict(norm_decay_mult=0.0))
auto_scale_lr = dict(enable=False, base_batch_size=16)
