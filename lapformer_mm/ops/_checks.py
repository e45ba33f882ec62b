"""Argument checks of the attention, run where its options are built: each error names the
argument, its value and what is allowed."""
import math
from numbers import Integral, Real

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
