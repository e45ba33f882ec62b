"""Argument checks of the attention: each error names the argument, its value and what is
allowed, so a bad config fails at construction time."""
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


def check_keys(name, keys, allowed):
    """Require every key of ``keys`` to be in ``allowed``; the error lists both."""
    unknown = sorted(set(keys) - set(allowed))
    if unknown:
        raise ValueError(f'{name}: unknown key(s) {", ".join(map(repr, unknown))}; '
                         f'allowed: {", ".join(allowed)}')


def check_int(name, value, minimum=1):
    """Require an integer ``value >= minimum``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f'{name} must be an int, got {type(value).__name__} {value!r}')
    if value < minimum:
        raise ValueError(f'{name}={value!r} must be >= {minimum}')
    return int(value)


def check_float_tensor(name, t, min_dim=2):
    """Require a floating-point tensor with at least ``min_dim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f'{name} must be a torch.Tensor, got {type(t).__name__}')
    if not t.is_floating_point():
        raise TypeError(f'{name} must be a floating-point tensor, got dtype {t.dtype}')
    if t.dim() < min_dim:
        raise ValueError(f'{name} must have at least {min_dim} dims, got shape {tuple(t.shape)}')
    return t


def check_nonempty(name, t, layout):
    """Require every size of the tensor ``t`` to be >= 1; ``layout`` (e.g. '(..., m, m)')
    names its dims in the message. An empty batch, head, grid or width gives an empty result
    on some paths and a reshape error deep inside on others (reshape(-1, ...) of no elements
    is ambiguous). Sizes traced by an exporter (SymInt) pass: torch takes them as >= 2."""
    if any(isinstance(size, int) and size == 0 for size in t.shape):
        raise ValueError(f'{name} must be {layout} with every size >= 1, got shape '
                         f'{tuple(t.shape)}')
    return t


def trace_quiet(fn):
    """``fn`` with jit's TracerWarning silenced while a jit trace runs (the TorchScript
    ONNX exporter, the FLOP counter). Sizes are tensors there: reading one as a Python value
    (a check's comparison, export.token_blocks' block count) is right for the traced input,
    and the warning that the reading is not recorded in the graph says what is meant."""
    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        if not torch.jit.is_tracing():
            return fn(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', torch.jit.TracerWarning)
            return fn(*args, **kwargs)
    return quiet


@trace_quiet
def check_square(name, P):
    """Require a floating tensor (..., m, m) with every size >= 1."""
    check_float_tensor(name, P)
    if P.shape[-1] != P.shape[-2]:
        raise ValueError(f'{name} must be square (..., m, m), got shape {tuple(P.shape)}')
    return check_nonempty(name, P, '(..., m, m)')


@trace_quiet
def check_rhs(P, B):
    """Require a floating B (..., m, k) for the system P (..., m, m): P's m, batch dims that
    broadcast with P's (torch's errors name neither the argument nor the rule)."""
    check_float_tensor('B', B)
    try:
        torch.broadcast_shapes(P.shape[:-2], B.shape[:-2])
    except RuntimeError:
        fits = False
    else:
        fits = B.shape[-2] == P.shape[-1]
    if not fits:
        raise ValueError(f'B must be (..., m, k) with m = {P.shape[-1]} and batch dims that '
                         f'broadcast with those of P {tuple(P.shape)}, got shape '
                         f'{tuple(B.shape)}')
    return B


@trace_quiet
def check_hw(hw, num_tokens):
    """Require hw = (H, W) positive ints with H·W == num_tokens; returns (H, W). Sizes traced by
    an exporter (SymInt, tensors) pass unchecked: comparing them would specialise the graph."""
    if not isinstance(hw, (tuple, list)) or len(hw) != 2:
        raise TypeError(f'hw must be a pair (H, W), got {hw!r}')
    if any(isinstance(size, (torch.SymInt, torch.Tensor)) for size in hw):
        return hw[0], hw[1]
    height, width = (check_int(n, v) for n, v in zip(('hw[0]', 'hw[1]'), hw))
    if height * width != num_tokens:
        raise ValueError(f'hw={tuple(hw)} gives H*W={height * width} but the '
                         f'input has N={num_tokens} tokens')
    return height, width


@trace_quiet
def check_kernel_pair(x, y):
    """Validate kernel inputs x (..., N, d) and y (..., M, d)."""
    check_float_tensor('x', x)
    check_float_tensor('y', y)
    if x.shape[:-2] != y.shape[:-2] or x.shape[-1] != y.shape[-1]:
        raise ValueError('x (..., N, d) and y (..., M, d) must share batch dims and d; '
                         f'got x {tuple(x.shape)} and y {tuple(y.shape)}')
    if x.dtype != y.dtype or x.device != y.device:
        raise ValueError(f'x and y must share dtype and device; got '
                         f'{x.dtype}/{x.device} and {y.dtype}/{y.device}')
