# UperNet with a LaplacianFormer-T backbone, ADE20K (150 classes), 512x512
# crops, 160k iterations, AdamW lr 6e-5, weight decay 0.01 (none on norm
# layers or position parameters), 2 images/GPU x 8 GPUs (mmseg's Swin recipe).
#
# Pretrained checkpoint (user-supplied): set `pretrained` below or pass
# --cfg-options model.backbone.init_cfg.checkpoint=/path/to/in1k.pth
# (model.backbone.init_cfg=None trains from scratch).
# 8 GPUs:  tools/dist_train.sh configs/upernet_lapformer_t_ade20k.py 8
_base_ = [
    'mmseg::_base_/models/upernet_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
    './_base_/safe_runtime.py',
]

arch = 'tiny'
pretrained = 'checkpoints/lapformer_tiny_in1k.pth'  # user-supplied
crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='LaplacianFormer',
        arch=arch,
        out_indices=(0, 1, 2, 3),
        drop_path_rate=0.1,
        norm_eval=False,
        with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    decode_head=dict(in_channels=[64, 128, 320, 512], num_classes=150),
    auxiliary_head=dict(in_channels=320, num_classes=150))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(
        type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg=dict(norm_decay_mult=0.0))
param_scheduler = [
    dict(
        type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0,
        end=1500),
    dict(
        type='PolyLR',
        eta_min=0.0,
        power=1.0,
        begin=1500,
        end=160000,
        by_epoch=False),
]
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
auto_scale_lr = dict(enable=False, base_batch_size=16)
