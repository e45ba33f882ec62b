"""The attention's compute dtype."""
import torch


def compute_dtype(dtype):
    """fp64 stays fp64; every other floating dtype computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
