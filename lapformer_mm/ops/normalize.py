"""The injective feature map applied to the query–landmark kernel matrix."""
from ._checks import check_float_tensor, check_non_negative


def injective_normalize(C, whiten_eps=1e-5):
    """Centre over landmarks, whiten each landmark column over queries, add 1/m.

    C (..., N, m) -> Z (..., N, m), per sample and per head, no running
    statistics (identical in train and eval):

        Cc = C - mean_j C[..., j]
        s2_j = var_i Cc[i, j]            (biased)
        Z = Cc / sqrt(s2 + whiten_eps) + 1/m
    """
    check_float_tensor('C', C)
    whiten_eps = check_non_negative('whiten_eps', whiten_eps)
    centred = C - C.mean(-1, keepdim=True)
    var = centred.var(-2, unbiased=False, keepdim=True)
    return centred * (var + whiten_eps).rsqrt() + 1.0 / C.shape[-1]
