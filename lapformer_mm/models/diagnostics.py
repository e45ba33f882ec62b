"""Residuals of the attention's landmark solve, measured on a model's real activations.

Each :class:`~lapformer_mm.models.attention.LaplacianAttention` inverts
``P = k(L, L) + eps·I`` (m×m per sample and head) with a fixed number of Newton–Schulz
steps. Whether those steps were enough depends on the conditioning of ``P``, i.e. on
the data: identical landmarks (a constant image) make ``k(L, L)`` the all-ones matrix
and ``P`` rests on ``eps`` alone. :func:`landmark_solve_residuals` runs one forward pass
and reports, per attention module, the worst ``||I - P X||_2`` and the condition number
of ``P``, recomputing ``P`` and ``X`` from the module's input with the public ops.
"""
from typing import Dict, NamedTuple

import torch

from ..ops import cg_solve, exact_inverse, newton_schulz_pinv
from .attention import LaplacianAttention


class SolveReport(NamedTuple):
    """Worst case over the batch and heads of one attention call."""
    residual: float  # max ||I - P X||_2, evaluated in fp64
    condition: float  # max cond_2(P)
    num_landmarks: int  # m


def solve_report(module: LaplacianAttention, x: torch.Tensor, hw) -> SolveReport:
    """:class:`SolveReport` of ``module``'s landmark solve for input x (B, N, C) on hw.

    Computes in fp32 as the attention does (fp64 input and module stay fp64).
    """
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        x = x if x.dtype == torch.float64 else x.float()
        p = module.landmark_system(x, hw)
        eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
        if module.options.solver == 'newton':
            inverse = newton_schulz_pinv(p, module.options.iters, module.options.ns_init)
        elif module.options.solver == 'cg':
            # CG solves P X = rhs column by column; on the identity it yields its inverse.
            inverse = cg_solve(p, eye.expand_as(p), module.options.iters)
        else:
            inverse = exact_inverse(p)
        # In fp64: forming I - P X in fp32 would itself add ~cond(P)·m·2^-24 of
        # round-off and hide how good the fp32 inverse is.
        p64 = p.double()
        residual = torch.linalg.matrix_norm(eye.double() - p64 @ inverse.double(), ord=2)
        condition = torch.linalg.cond(p64)
    return SolveReport(float(residual.max()), float(condition.max()), int(p.shape[-1]))


def landmark_solve_residuals(model: torch.nn.Module, *inputs, **kwargs
                             ) -> Dict[str, SolveReport]:
    """Run ``model(*inputs, **kwargs)`` once and report every attention's landmark solve.

    Returns ``{module name: SolveReport}`` for each LaplacianAttention that ran; the
    model's own output is discarded. Hooks are removed afterwards, also on error.
    """
    reports: Dict[str, SolveReport] = {}
    handles = []

    def make_hook(name):
        def hook(module, args):
            reports[name] = solve_report(module, args[0], args[1])
        return hook

    for name, module in model.named_modules():
        if isinstance(module, LaplacianAttention):
            handles.append(module.register_forward_pre_hook(make_hook(name)))
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return reports
