# Semantic FPN with a LaplacianFormer-T backbone, ADE20K (150 classes): the
# segmentation recipe of the PVT and SOFT papers (Kirillov et al.'s Semantic
# FPN; 512x512 crops, 80k iterations, AdamW lr 1e-4, weight decay 1e-4, poly
# decay with power 0.9, 2 images/GPU x 8 GPUs), beside the UperNet recipe of
# upernet_lapformer_t_ade20k.py.
#
# Pretrained checkpoint (user-supplied): set `pretrained` below or pass
# --cfg-options model.backbone.init_cfg.checkpoint=/path/to/in1k.pth
# (model.backbone.init_cfg=None trains from scratch).
# 8 GPUs:  tools/dist_train.sh configs/fpn_lapformer_t_ade20k.py 8
_base_ = [
    'mmseg::_base_/models/fpn_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_80k.py',
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
    neck=dict(in_channels=[64, 128, 320, 512]),
    decode_head=dict(num_classes=150))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(
        type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4))
param_scheduler = [
    dict(
        type='PolyLR',
        eta_min=0.0,
        power=0.9,
        begin=0,
        end=80000,
        by_epoch=False),
]
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
auto_scale_lr = dict(enable=False, base_batch_size=16)
