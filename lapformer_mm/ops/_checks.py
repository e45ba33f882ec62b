"""Argument checks for where options are built: each error names the argument and its value."""
import math
from numbers import Integral, Real

KERNELS = ('laplacian', 'gaussian')
NORMALIZATIONS = ('injective', 'none')
SOLVERS = ('newton', 'exact', 'cg')
NS_INITS = ('identity', 'authors')


def check_choice(name, value, allowed):
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f'{name}={value!r} is not supported; allowed: '
                         f'{", ".join(repr(a) for a in allowed)}')
    return value


def _real_check(ok, allowed):
    def check(name, value):
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f'{name} must be a real number, got {type(value).__name__} {value!r}')
        if not ok(float(value)):
            raise ValueError(f'{name}={value!r} must be {allowed}')
        return float(value)
    return check


check_positive = _real_check(lambda v: math.isfinite(v) and v > 0, 'finite and > 0')
check_non_negative = _real_check(lambda v: math.isfinite(v) and v >= 0, 'finite and >= 0')
check_probability = _real_check(lambda v: 0.0 <= v < 1.0, 'in [0, 1)')


def check_bool(name, value):
    """A bool, not a truthy stand-in such as 1 or 'yes'."""
    if not isinstance(value, bool):
        raise TypeError(f'{name} must be a bool, got {type(value).__name__} {value!r}')
    return value


def check_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f'{name} must be an int, got {type(value).__name__} {value!r}')
    if value < minimum:
        raise ValueError(f'{name}={value!r} must be >= {minimum}')
    return int(value)
