"""The attention is a weighted average of the values: its scale does not grow with N."""
import pytest
import torch
import torch.nn.functional as F

from lapformer_mm.models.attention import LaplacianAttention
from lapformer_mm.models.backbone import init_layer
from lapformer_mm.ops import nystrom_attention


def smooth_field(hw, channels=64, seed=0):
    """One scene at any resolution: an 8×8 random field, upsampled bilinearly and
    layer-normed, as (1, H·W, C) tokens."""
    gen = torch.Generator().manual_seed(seed)
    field = F.interpolate(torch.randn(1, channels, 8, 8, generator=gen), size=hw,
                          mode='bilinear', align_corners=False)
    return F.layer_norm(field.flatten(2).transpose(1, 2), (channels,))


def global_term_ratio(attn, hw):
    """std of the Nyström term over std of v for the scene at ``hw``."""
    with torch.no_grad():
        q, k, v = attn.project(smooth_field(hw))
        v = attn._split_heads(v)
        out = nystrom_attention(q, k, v, options=attn.options, hw=hw,
                                landmark_grid=attn.landmark_grid)
    return (out.std() / v.std()).item()


def train_briefly(attn, steps=60):
    """Fit the layer at 16×16 to map one scene to another, so q, k and v leave their init."""
    x, target = smooth_field((16, 16)), smooth_field((16, 16), seed=1)
    opt = torch.optim.Adam(attn.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(attn(x, (16, 16)), target).backward()
        opt.step()


@pytest.mark.parametrize('trained', [False, True])
def test_output_scale_does_not_depend_on_the_number_of_tokens(trained):
    """N = 256 to 40,000 tokens of one scene: the output's std over v's std within 2×
    (an attention summing N kernel weights grew ~160× over this range)."""
    torch.manual_seed(0)
    attn = LaplacianAttention(64, 2)
    attn.apply(init_layer)
    if trained:
        train_briefly(attn)
    attn.eval()
    ratios = [global_term_ratio(attn, hw) for hw in ((16, 16), (64, 64), (200, 200))]
    assert max(ratios) < 2 * min(ratios), ratios


def test_output_shifts_with_the_values():
    """Rows of weights that sum to 1: adding c to every value adds c to the output."""
    gen = torch.Generator().manual_seed(2)
    q, v = (torch.randn(1, 2, 36, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    shift = torch.randn(1, 2, 1, 8, generator=gen, dtype=torch.float64)
    out = nystrom_attention(q, q, v, hw=(6, 6), landmark_grid=3)
    torch.testing.assert_close(nystrom_attention(q, q, v + shift, hw=(6, 6), landmark_grid=3),
                               out + shift)
