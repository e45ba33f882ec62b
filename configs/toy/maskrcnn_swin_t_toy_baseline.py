# Comparison baseline, not a LaplacianFormer model: the toy Mask R-CNN of
# maskrcnn_lapformer_t_toy.py (same data, heads, schedule and seed) with
# mmdet's Swin-T (also from scratch) in place of LaplacianFormer-T.
# drop_path_rate=0.0 as the LaplacianFormer-T it is compared with (mmdet's
# default is 0.1); the 7 px windows pad the 32-4 px maps of 128 px images.
# Run: `python tools/train.py configs/toy/maskrcnn_swin_t_toy_baseline.py`
# (`tools/ablate.py --config configs/toy/maskrcnn_lapformer_t_toy.py --peers
# swin_t` trains it beside the attention variants; docs/results.md).
_base_ = ['./maskrcnn_lapformer_t_toy.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='SwinTransformer',
        embed_dims=96,
        depths=[2, 2, 6, 2],
        num_heads=[3, 6, 12, 24],
        window_size=7,
        out_indices=(0, 1, 2, 3),
        drop_path_rate=0.0,
        init_cfg=None),
    neck=dict(in_channels=[96, 192, 384, 768]))
