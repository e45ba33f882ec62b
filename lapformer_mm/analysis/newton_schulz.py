"""How far Newton–Schulz gets on the landmark systems of a freshly initialised backbone."""
import torch


def landmark_systems(arch, size, backbone_kwargs=None, batch=2):
    """P = k(L, L) + eps·I of every Laplacian block with a full landmark grid, (K, m, m).

    A randomly initialised ``LaplacianFormer(arch)`` (seed 0) runs on a random
    (batch, 3, size, size) input; blocks whose token grid is smaller than the landmark
    grid are left out.
    """
    from lapformer_mm.models import LaplacianAttention, LaplacianFormer
    torch.manual_seed(0)
    model = LaplacianFormer(arch, out_indices=(3, ), **(backbone_kwargs or {}))
    model.init_weights()
    systems = []

    def record(attn, inputs, output):
        p = attn.landmark_system(*inputs)
        if p.shape[-1] == attn.landmark_grid**2:
            systems.append(p.flatten(0, 1))

    for module in model.modules():
        if isinstance(module, LaplacianAttention):
            module.register_forward_hook(record)
    with torch.no_grad():
        model.eval()(torch.randn(batch, 3, size, size))
    return torch.cat(systems)


def inverse_residuals(p, x):
    """||I - P X||_inf per matrix: p, x (..., m, m) -> (...)."""
    eye = torch.eye(p.shape[-1], dtype=p.dtype)
    return (eye - p @ x).abs().sum(-1).amax(-1)
