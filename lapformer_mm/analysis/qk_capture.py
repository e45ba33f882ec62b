"""The queries and keys of every attention call, recomputed by forward pre-hooks from the
layers' inputs (the models are not changed). A query's keys: LaplacianFormer's, every token;
PVTv2's, every spatially reduced key; Swin's, its window's unmasked keys (unscaled)."""
import contextlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


@dataclass
class QKRecord:
    """Queries q (B', h, N, d) and keys k (B', h, M, d) of one attention call; pair_mask bool
    (B', 1, N, M) where query i attends key j (None: every pair); B' is batch × windows for
    Swin; hw the query grid of a global attention, else None."""
    stage: int
    layer: str
    q: torch.Tensor
    k: torch.Tensor
    pair_mask: Optional[torch.Tensor] = None
    hw: Optional[Tuple[int, int]] = None


def split_heads(t, num_heads):
    batch, num_tokens, channels = t.shape
    return t.reshape(batch, num_tokens, num_heads, channels // num_heads).transpose(1, 2)


def laplacian_attention_qk(attn, x):
    """q, k (B, h, N, d) of a LaplacianAttention or SoftmaxAttention for input x (B, N, C)."""
    qkv = attn.qkv(x)
    if getattr(attn, 'qk_shared', False):
        q = split_heads(qkv.chunk(2, dim=-1)[0], attn.num_heads)
        return q, q
    # LaplacianAttention (separate keys) and SoftmaxAttention both lay the
    # projection out as [q | k | v], heads contiguous within each.
    q, k, _ = qkv.chunk(3, dim=-1)
    return split_heads(q, attn.num_heads), split_heads(k, attn.num_heads)


def multihead_attention_qk(mha, query, key):
    """q (B, h, N, d), k (B, h, M, d) of an ``nn.MultiheadAttention`` call."""
    if not mha._qkv_same_embed_dim:
        raise ValueError('multihead_attention_qk needs a packed in_proj_weight')
    if not mha.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    w_q, w_k, _ = mha.in_proj_weight.chunk(3)
    b_q, b_k = (None, None) if mha.in_proj_bias is None else mha.in_proj_bias.chunk(3)[:2]
    return (split_heads(F.linear(query, w_q, b_q), mha.num_heads),
            split_heads(F.linear(key, w_k, b_k), mha.num_heads))


def window_attention_qk(w_msa, windows, mask):
    """q, k (B·nW, h, n, d) and pair_mask (B·nW, 1, n, n) or None of a Swin ``WindowMSA`` call
    on windows (B·nW, n, C) with its mask (nW, n, n), 0 where allowed, or None."""
    batch_windows, tokens, channels = windows.shape
    qkv = w_msa.qkv(windows).reshape(batch_windows, tokens, 3, w_msa.num_heads,
                                     channels // w_msa.num_heads).permute(2, 0, 3, 1, 4)
    pair_mask = None
    if mask is not None:
        num_windows = mask.shape[0]
        # Windows are ordered image-major, as WindowMSA's own view() assumes.
        pair_mask = (mask == 0).repeat(batch_windows // num_windows, 1, 1)[:, None]
    return qkv[0], qkv[1], pair_mask


def _arg(args, kwargs, index, name, default=None):
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else default)


def attention_hooks(model, records):
    from mmdet.models.backbones import PyramidVisionTransformer, SwinTransformer

    from lapformer_mm.models import LaplacianFormer
    if isinstance(model, LaplacianFormer):
        def capture(module, args, kwargs):
            q, k = laplacian_attention_qk(module, args[0])
            return q, k, None, tuple(_arg(args, kwargs, 1, 'hw'))
        layers, path = [stage.blocks for stage in model.stages], 'stages.{}.blocks.{}.attn'
        attention = 'attn'
    elif isinstance(model, PyramidVisionTransformer):
        def capture(module, args, kwargs):
            q, k = multihead_attention_qk(module, _arg(args, kwargs, 0, 'query'),
                                          _arg(args, kwargs, 1, 'key'))
            return q, k, None, None
        layers, path = [layer[1] for layer in model.layers], 'layers.{}.1.{}.attn.attn'
        attention = 'attn.attn'
    elif isinstance(model, SwinTransformer):
        def capture(module, args, kwargs):
            return (*window_attention_qk(module, args[0], _arg(args, kwargs, 1, 'mask')), None)
        layers, path = [stage.blocks for stage in model.stages], 'stages.{}.blocks.{}.attn.w_msa'
        attention = 'attn.w_msa'
    else:
        raise TypeError('model must be a LaplacianFormer, PyramidVisionTransformer(V2) or '
                        f'SwinTransformer, got {type(model).__name__}')
    hooks = []
    for stage, blocks in enumerate(layers):
        for index, block in enumerate(blocks):
            def hook(module, args, kwargs, stage=stage, name=path.format(stage, index)):
                records.append(QKRecord(stage, name, *capture(module, args, kwargs)))
            hooks.append((block.get_submodule(attention), hook))
    return hooks


@contextlib.contextmanager
def capture_qk(model):
    """Yields the list to which every attention call of ``model`` appends a QKRecord."""
    records = []
    handles = [module.register_forward_pre_hook(hook, with_kwargs=True)
               for module, hook in attention_hooks(model, records)]
    try:
        with torch.no_grad():
            yield records
    finally:
        for handle in handles:
            handle.remove()
