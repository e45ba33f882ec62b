# Comparison baseline, not a LaplacianFormer model: the toy UperNet of
# upernet_lapformer_t_toy.py (same data, heads, schedule and seed) with
# mmseg's Swin-T (also from scratch) in place of LaplacianFormer-T.
# drop_path_rate=0.0 as the LaplacianFormer-T it is compared with (mmseg's
# default is 0.1). The 128 px images give 32-4 px maps, which Swin pads to
# multiples of the 7 px window.
# Run: `python tools/train.py configs/toy/upernet_swin_t_toy_baseline.py`
# (`tools/ablate.py --config configs/toy/upernet_lapformer_t_toy.py --peers
# swin_t` trains it beside the attention variants; docs/results.md).
_base_ = ['./upernet_lapformer_t_toy.py']

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
    decode_head=dict(in_channels=[96, 192, 384, 768]),
    auxiliary_head=dict(in_channels=384))
