"""The injective feature map applied to the query–landmark kernel matrix."""
import torch

from ._checks import check_float_tensor, check_non_negative


def injective_normalize(C, whiten_eps=1e-5):
    """Centre over landmarks, whiten each landmark column over queries, add 1/m.

    C (..., N, m) -> Z (..., N, m), per sample and per head, no running
    statistics (identical in train and eval):

        Cc = C - mean_j C[..., j]
        s2_j = var_i Cc[i, j]            (biased)
        Z = Cc / sqrt(s2 + whiten_eps) + 1/m

    (a column with s2 + whiten_eps = 0 is all zeros once centred and stays 0.)
    """
    check_float_tensor('C', C)
    return whiten(C, check_non_negative('whiten_eps', whiten_eps))


def whitening_scale(var, whiten_eps):
    """s = (var + δ)^-½ of the whitening, 0 where var + δ = 0.

    With whiten_eps = 0 a column constant over the queries has var + δ = 0 and is all zeros
    once centred: keep it 0 (0 · rsqrt(0) would be NaN, and a masked-out rsqrt(0) would
    still put NaN into the gradient).
    """
    denom = var + whiten_eps
    positive = denom > 0
    return torch.where(positive, torch.where(positive, denom, torch.ones_like(denom)).rsqrt(),
                       torch.zeros_like(denom))


def whiten(C, whiten_eps):
    """:func:`injective_normalize` for callers that validated C and whiten_eps already."""
    centred = C - C.mean(-1, keepdim=True)
    scale = whitening_scale(centred.var(-2, unbiased=False, keepdim=True), whiten_eps)
    return centred * scale + 1.0 / C.shape[-1]
