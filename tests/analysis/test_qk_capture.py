"""The q/k capture hooks of lapformer_mm.analysis on tiny LaplacianFormer, PVTv2 and Swin
models: q/k that reproduce each model's own attention."""
import logging

import pytest
import torch

from lapformer_mm.analysis import model_zoo, qk_capture

TINY_LAPLACIAN = dict(arch=dict(embed_dims=[8, 16, 16, 32], num_heads=[1, 2, 2, 4],
                                depths=[1, 2, 1, 1]), stage4_attention='laplacian')
TINY_PVT = dict(embed_dims=8, num_layers=[1, 2, 1, 1])
TINY_SWIN = dict(embed_dims=12, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4], window_size=4)


def _run(model, size):
    torch.manual_seed(0)
    with qk_capture.capture_qk(model) as records:
        model(torch.randn(2, 3, *size))
    return records


@pytest.mark.parametrize('qk_shared', [True, False])
def test_laplacianformer_records_shapes_and_q_fed_to_the_kernel(monkeypatch, qk_shared):
    import lapformer_mm.models.attention as attention_module
    model = model_zoo.build_backbone('laplacianformer-t', config_overrides=dict(
        TINY_LAPLACIAN, attn_cfg=dict(qk_shared=qk_shared)))
    seen = []
    original = attention_module.nystrom_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention_module, 'nystrom_attention', spy)
    records = _run(model, (32, 48))
    assert [r.stage for r in records] == [0, 1, 1, 2, 3]
    grids = [(8, 12), (4, 6), (4, 6), (2, 3), (1, 2)]
    heads_width = [(1, 8), (2, 8), (2, 8), (2, 8), (4, 8)]
    for record, hw, (heads, width) in zip(records, grids, heads_width):
        assert record.q.shape == (2, heads, hw[0] * hw[1], width)
        assert record.k.shape == record.q.shape
        assert record.pair_mask is None
    assert [r.hw for r in records] == grids
    # Every stage is Laplacian attention here: the captured q/k are what the kernel received.
    assert len(seen) == 5
    for record, (q, k) in zip(records, seen):
        torch.testing.assert_close(record.q, q)
        torch.testing.assert_close(record.k, k)
        assert torch.equal(record.q, record.k) == qk_shared


def test_pvt_records_reproduce_multihead_attention_weights():
    model = model_zoo.build_backbone('pvtv2-b1', config_overrides=TINY_PVT)
    weights = []
    handles = [layer[1][i].attn.attn.register_forward_hook(
        lambda m, args, kwargs, out: weights.append(out[1]), with_kwargs=True)
        for layer in model.layers for i in range(len(layer[1]))]
    records = _run(model, (64, 64))
    for handle in handles:
        handle.remove()
    assert [r.stage for r in records] == [0, 1, 1, 2, 3]
    sr_ratios, heads = [8, 4, 4, 2, 1], [1, 2, 2, 5, 8]
    for record, sr, h, grid, w in zip(records, sr_ratios, heads, [16, 8, 8, 4, 2], weights):
        n, m = grid * grid, (grid // sr) ** 2 if grid >= sr else 1
        assert record.q.shape == (2, h, n, 8)
        assert record.k.shape == (2, h, max(m, 1), 8)
        # nn.MultiheadAttention returns the head-averaged softmax(q kᵀ / sqrt(d)).
        probs = (record.q @ record.k.mT / record.q.shape[-1] ** 0.5).softmax(-1).mean(1)
        torch.testing.assert_close(probs, w, rtol=1e-4, atol=1e-6)


def test_swin_records_reproduce_window_softmax_including_shift_mask():
    model = model_zoo.build_backbone('swin-t', config_overrides=TINY_SWIN)
    probs = []
    handles = []
    for stage in model.stages:
        for block in stage.blocks:
            handles.append(block.attn.w_msa.softmax.register_forward_hook(
                lambda m, args, out: probs.append(out)))
    records = _run(model, (64, 64))
    for handle in handles:
        handle.remove()
    assert [r.stage for r in records] == [0, 0, 1, 1, 2, 2, 3, 3]
    windows_per_image = [16, 16, 4, 4, 1, 1, 1, 1]
    for i, (record, nw, p) in enumerate(zip(records, windows_per_image, probs)):
        w_msa = [b.attn.w_msa for s in model.stages for b in s.blocks][i]
        assert record.q.shape[0] == 2 * nw and record.q.shape[2] == 16
        # Every shifted block (odd index) masks, even with one window per image.
        assert (record.pair_mask is not None) == (i % 2 == 1)
        bias = w_msa.relative_position_bias_table[
            w_msa.relative_position_index.view(-1)].view(16, 16, -1).permute(2, 0, 1)
        logits = record.q * w_msa.scale @ record.k.mT + bias
        if record.pair_mask is not None:
            logits = logits.masked_fill(~record.pair_mask, -100.0)
        expected = logits.softmax(-1)
        if record.pair_mask is not None:
            # Swin adds -100 (not -inf); masked entries are ~e^-100, kept pairs must agree.
            expected = expected * record.pair_mask
            p = p * record.pair_mask
        torch.testing.assert_close(expected, p, rtol=1e-4, atol=1e-6)


def test_capture_removes_hooks_and_rejects_unknown_models():
    model = model_zoo.build_backbone('laplacianformer-t', config_overrides=TINY_LAPLACIAN)
    _run(model, (16, 16))
    assert all(not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(TypeError, match='LaplacianFormer'):
        with qk_capture.capture_qk(torch.nn.Linear(2, 2)):
            pass


def test_models_are_built_without_mmengine_init_lines():
    """init_weights' INFO line per parameter stays out of the tools' console."""
    from _shared import TOY_CONFIG
    from mmengine.logging import MMLogger
    logger = MMLogger.get_current_instance()
    filters = list(logger.filters)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        model_zoo.build_from_config(TOY_CONFIG)
        model_zoo.build_backbone('pvtv2-b1', config_overrides=TINY_PVT)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage()[:80] for r in records if r.levelno == logging.INFO] == []
    assert logger.filters == filters


def test_build_backbone_loads_a_checkpoint(tmp_path):
    """Here a DDP detector's checkpoint layout."""
    model = model_zoo.build_backbone('laplacianformer-t', config_overrides=TINY_LAPLACIAN)
    state = model.state_dict()
    path = tmp_path / 'det.pth'
    torch.save({'state_dict': {f'module.backbone.{k}': v for k, v in state.items()}}, path)
    other = model_zoo.build_backbone('laplacianformer-t', checkpoint=str(path),
                                     config_overrides=TINY_LAPLACIAN)
    for key, value in state.items():
        torch.testing.assert_close(other.state_dict()[key], value)


def test_peer_backbones_build_whatever_default_scope_a_runner_left():
    from mmengine.registry import DefaultScope
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    with DefaultScope.overwrite_default_scope('mmseg'):
        model = model_zoo.build_backbone('pvtv2-b1', config_overrides=TINY_PVT)
    assert type(model).__module__ == 'mmdet.models.backbones.pvt'
