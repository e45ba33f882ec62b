"""Argument checks of the attention, run where its options are built: each error names the
argument, its value and what is allowed."""
import functools
import math
import warnings
from numbers import Integral, Real

import torch

KERNELS = ('laplacian', 'gaussian')
NORMALIZATIONS = ('injective', 'none')
SOLVERS = ('newton', 'exact', 'cg')
NS_INITS = ('identity', 'authors')


def check_choice(name, value, allowed):
    """Require ``value`` to be one of the strings in ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f'{name}={value!r} is not supported; allowed: '
                         f'{", ".join(repr(a) for a in allowed)}')
    return value


def _check_real(name, value, ok, allowed):
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f'{name} must be a real number, got {type(value).__name__} {value!r}')
    if not ok(float(value)):
        raise ValueError(f'{name}={value!r} must be {allowed}')
    return float(value)


def check_positive(name, value):
    """Require a finite real ``value > 0``."""
    return _check_real(name, value, lambda v: math.isfinite(v) and v > 0, 'finite and > 0')


def check_non_negative(name, value):
    """Require a finite real ``value >= 0``."""
    return _check_real(name, value, lambda v: math.isfinite(v) and v >= 0, 'finite and >= 0')


def check_probability(name, value):
    """Require a real ``0 <= value < 1`` (a dropout rate)."""
    return _check_real(name, value, lambda v: 0.0 <= v < 1.0, 'in [0, 1)')


def check_bool(name, value):
    """Require a bool (not a truthy stand-in such as 1 or 'yes')."""
    if not isinstance(value, bool):
        raise TypeError(f'{name} must be a bool, got {type(value).__name__} {value!r}')
    return value


def check_int(name, value, minimum=1):
    """Require an integer ``value >= minimum``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f'{name} must be an int, got {type(value).__name__} {value!r}')
    if value < minimum:
        raise ValueError(f'{name}={value!r} must be >= {minimum}')
    return int(value)


def trace_quiet(fn):
    """``fn`` with jit's TracerWarning silenced while a jit trace runs (the TorchScript
    ONNX exporter, the FLOP counter). Sizes are tensors there: reading one as a Python value
    (export.token_blocks' block count) is right for the traced input, and the warning that
    the reading is not recorded in the graph says what is meant."""
    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        if not torch.jit.is_tracing():
            return fn(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', torch.jit.TracerWarning)
            return fn(*args, **kwargs)
    return quiet


def check_square(name, P):
    """Require a floating tensor (..., m, m) with every size >= 1 (the solvers would return an
    empty result for an empty one)."""
    if not (P.is_floating_point() and P.dim() >= 2 and P.shape[-1] == P.shape[-2]
            and P.numel() > 0):
        raise ValueError(f'{name} must be a floating tensor (..., m, m) with every size >= 1, '
                         f'got {P.dtype} {tuple(P.shape)}')
    return P


def check_rhs(P, B):
    """Require B (..., m, k) for the system P (..., m, m): P's m, batch dims that broadcast with
    P's (torch's errors name neither the argument nor the rule)."""
    try:
        torch.broadcast_shapes(P.shape[:-2], B.shape[:-2])
        fits = B.is_floating_point() and B.shape[-2] == P.shape[-1]
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f'B must be a floating tensor (..., m, k) with m = {P.shape[-1]} and '
                         f'batch dims that broadcast with those of P {tuple(P.shape)}, got '
                         f'{B.dtype} {tuple(B.shape)}')
    return B
