# Comparison baseline, not a LaplacianFormer model: the toy Mask R-CNN of
# maskrcnn_lapformer_t_toy.py (same data, heads, schedule and seed) with
# mmdet's PVTv2-b1 (also from scratch) in place of LaplacianFormer-T.
# mmdet's PVTv2-b1 arguments, but drop_path_rate=0.0 as the LaplacianFormer-T
# it is compared with (mmdet's default is 0.1).
# Run: `python tools/train.py configs/toy/maskrcnn_pvtv2_b1_toy_baseline.py`
# (`tools/ablate.py --config configs/toy/maskrcnn_lapformer_t_toy.py --peers
# pvtv2_b1` trains it beside the attention variants; docs/results.md).
_base_ = ['./maskrcnn_lapformer_t_toy.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='PyramidVisionTransformerV2',
        embed_dims=64,
        num_layers=[2, 2, 2, 2],
        out_indices=(0, 1, 2, 3),
        drop_path_rate=0.0,
        init_cfg=None),
    neck=dict(in_channels=[64, 128, 320, 512]))
