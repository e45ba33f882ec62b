"""How well each attention's landmark solve converges on a model's activations: the worst
residual ``||I - P X||`` of its own solver and cond(P), P = k(L, L) + eps·I (identical
landmarks, e.g. a constant image, leave P resting on eps)."""
from typing import Dict, NamedTuple

import torch

from ..models.attention import LaplacianAttention
from ..ops import cg_solve, exact_inverse, newton_schulz_pinv


class SolveReport(NamedTuple):
    """Worst case over the batch and heads of one attention call."""
    residual: float  # ||I - P X||_2 in fp64
    condition: float
    num_landmarks: int


def solve_residual(p, inverse, ord=2):
    """||I - P X|| (``ord`` 2 or 'inf') per matrix of p, inverse (..., m, m), in fp64: in fp32
    the product would add ~cond(P)·m·2^-24 of round-off and hide how good an inverse is."""
    p64 = p.double()
    residual = torch.eye(p.shape[-1], dtype=torch.float64, device=p.device) - p64 @ inverse.double()
    if ord == 'inf':
        return residual.abs().sum(-1).amax(-1)
    return torch.linalg.matrix_norm(residual, ord=ord)


def module_inverse(module: LaplacianAttention, p):
    options = module.options
    if options.solver == 'newton':
        return newton_schulz_pinv(p, options.iters, options.ns_init)
    if options.solver == 'cg':
        eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
        return cg_solve(p, eye.expand_as(p), options.iters)
    return exact_inverse(p)


def solve_report(module: LaplacianAttention, x: torch.Tensor, hw) -> SolveReport:
    """:class:`SolveReport` of ``module``'s solve for x (B, N, C), in fp32 as the attention
    computes (fp64 stays fp64)."""
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        x = x if x.dtype == torch.float64 else x.float()
        p = module.landmark_system(x, hw)
        residual = solve_residual(p, module_inverse(module, p))
        condition = torch.linalg.cond(p.double())
    return SolveReport(float(residual.max()), float(condition.max()), int(p.shape[-1]))


def _run_with_attention_hooks(model, hook_factory, inputs, kwargs):
    handles = [module.register_forward_pre_hook(hook_factory(name))
               for name, module in model.named_modules()
               if isinstance(module, LaplacianAttention)]
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def landmark_solve_residuals(model: torch.nn.Module, *inputs, **kwargs
                             ) -> Dict[str, SolveReport]:
    reports: Dict[str, SolveReport] = {}

    def make_hook(name):
        def hook(module, args):
            reports[name] = solve_report(module, args[0], args[1])
        return hook

    _run_with_attention_hooks(model, make_hook, inputs, kwargs)
    return reports


def landmark_systems(model: torch.nn.Module, *inputs, **kwargs) -> Dict[str, torch.Tensor]:
    systems: Dict[str, torch.Tensor] = {}

    def make_hook(name):
        def hook(module, args):
            systems[name] = module.landmark_system(args[0], args[1])
        return hook

    _run_with_attention_hooks(model, make_hook, inputs, kwargs)
    return systems


def random_backbone_systems(arch, size, backbone_kwargs=None, batch=2):
    """P (K, m, m) of every block with a full landmark grid of a seeded ``LaplacianFormer(arch)``
    on a random input."""
    from ..models import LaplacianFormer
    torch.manual_seed(0)
    model = LaplacianFormer(arch, out_indices=(3, ), **(backbone_kwargs or {}))
    model.init_weights()
    full = {name: module.landmark_grid ** 2 for name, module in model.named_modules()
            if isinstance(module, LaplacianAttention)}
    systems = landmark_systems(model.eval(), torch.randn(batch, 3, size, size))
    return torch.cat([p.flatten(0, 1) for name, p in systems.items() if p.shape[-1] == full[name]])
