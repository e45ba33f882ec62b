# The toy Mask R-CNN (maskrcnn_lapformer_t_toy.py, same heads, data and 6-epoch budget)
# started from a toy-pretrained LaplacianFormer-T backbone instead of from scratch.
#
# The checkpoint comes from `make pretrain` (tools/pretrain_job.sh): configs/cls/
# lapformer_t_toy.py trained on data/toy_imagenet, then tools/convert_cls_to_backbone.py.
# Another checkpoint: `--cfg-options model.backbone.init_cfg.checkpoint=PATH`.
# The classifier returns stage 4 only (out_indices=(3,), as the ImageNet recipe) and holds
# every stage's norm all the same, so the load logs no missing or unexpected keys.
_base_ = ['./maskrcnn_lapformer_t_toy.py']

model = dict(
    backbone=dict(
        init_cfg=dict(
            _delete_=True,
            type='Pretrained',
            checkpoint='work_dirs/pretrain/backbone_lapformer_t_toy.pth')))
