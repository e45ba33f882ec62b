"""Landmarks: adaptive average pooling of tokens on their H×W grid."""
import torch.nn.functional as F

from ._checks import check_float_tensor, check_int
from .export import exporting, pool_tokens_export


def check_hw(hw, num_tokens):
    """Require hw = (H, W) positive ints with H·W == num_tokens; returns (H, W).

    While exporting, H and W are symbolic (SymInt, or traced sizes under the TorchScript
    exporter): only the pair is checked, since comparing them would specialise the graph
    to the example size.
    """
    if not isinstance(hw, (tuple, list)) or len(hw) != 2:
        raise TypeError(f'hw must be a pair (H, W), got {hw!r}')
    if exporting():
        return hw[0], hw[1]
    height, width = (check_int(n, v) for n, v in zip(('hw[0]', 'hw[1]'), hw))
    if height * width != num_tokens:
        raise ValueError(f'hw={tuple(hw)} gives H*W={height * width} but the '
                         f'input has N={num_tokens} tokens')
    return height, width


def landmark_grid_size(hw, grid):
    """(gh, gw): the grid clipped to the input grid, so gh·gw <= grid²."""
    return min(grid, hw[0]), min(grid, hw[1])


def pool_landmarks(t, hw, grid=7):
    """Adaptive average pooling of tokens t (B, h, N, d) on an H×W grid.

    Returns (B, h, m, d) with m = min(grid, H) · min(grid, W), in row-major
    grid order.
    """
    check_float_tensor('t', t, min_dim=4)
    if t.dim() != 4:
        raise ValueError(f't must be (B, h, N, d), got shape {tuple(t.shape)}')
    return pool_tokens(t, check_hw(hw, t.shape[2]), check_int('grid', grid))


def pool_tokens(t, hw, grid):
    """:func:`pool_landmarks` for callers that validated t, hw = (H, W) and grid already.

    The heads are pooled as the channels of one (B, h·d, H, W) map. For head views of the
    token layout (B, N, h·d), as the attention module has them, that map is a channels-last
    view of the tokens and the pooling reads them in place; the result is a (B, h, m, d)
    view of the pooled channels-last map.
    """
    if exporting():
        return pool_tokens_export(t, hw, grid)
    batch, heads, _, width = t.shape
    # Through the (B, H, W, h·d) token view: a reshape straight to (B, h·d, H, W) may give a
    # batch of one an odd stride, which makes aten pool a contiguous copy instead.
    maps = t.transpose(1, 2).reshape(batch, *hw, heads * width).permute(0, 3, 1, 2)
    pooled = F.adaptive_avg_pool2d(maps, landmark_grid_size(hw, grid))
    return pooled.permute(0, 2, 3, 1).reshape(batch, -1, heads, width).transpose(1, 2)
