"""Count what one call dispatches: ATen compute ops, views, allocations, ops of ours, launches.

:class:`OpCounter` is a ``TorchDispatchMode``; it also looks inside the ``lapformer_mm``
ops (whose own allocations would otherwise be hidden). Views (outputs that alias an
input, and ``_unsafe_view``) and allocations (``empty``/``empty_strided``, no kernel) are
counted apart from compute ops. Kernel launches of ours are counted by :meth:`launch`,
called from a wrapped ``backends.cuda.launch`` (:func:`counting_launch`). Used by
tests/ops/cuda/test_op_counts.py and benchmarks/cuda_host.py.
"""
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALLOCATIONS = {'aten::empty', 'aten::empty_strided', 'aten::new_empty',
                'aten::new_empty_strided', 'aten::empty_like'}
_VIEW_NAMES = {'aten::_unsafe_view', 'aten::lift_fresh'}


def is_view(func):
    """Whether ``func`` (an OpOverload) returns an alias of an input (no computation)."""
    if func._schema.name in _VIEW_NAMES:
        return True
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def _custom_op_body(func):
    """The Python implementation of one of our ops, or None."""
    from lapformer_mm.ops.attention import PYTHON_KERNELS
    return PYTHON_KERNELS.get(func)


class OpCounter(TorchDispatchMode):
    """Counters ``compute``, ``views``, ``allocations``, ``ours`` (lapformer_mm ops) and
    ``launches`` (kernel names), each a ``collections.Counter``."""

    def __init__(self):
        super().__init__()
        self.compute = collections.Counter()
        self.views = collections.Counter()
        self.allocations = collections.Counter()
        self.ours = collections.Counter()
        self.launches = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if func.namespace == 'lapformer_mm':
            self.ours[name] += 1
            body = _custom_op_body(func)
            if body is not None:
                # The op's Python body with this mode on again: what runs inside counts.
                with self:
                    return body(*args, **kwargs)
            return func(*args, **kwargs)
        if name in _ALLOCATIONS:
            self.allocations[name] += 1
        elif is_view(func):
            self.views[name] += 1
        else:
            self.compute[name] += 1
        return func(*args, **kwargs)

    def launch(self, entry):
        """Record a kernel launch (``entry[0]`` is its name)."""
        self.launches[entry[0].split('<')[0]] += 1

    def totals(self):
        """{'launches', 'compute', 'launches+compute', 'views', 'allocations', 'ours'}."""
        launches, compute = sum(self.launches.values()), sum(self.compute.values())
        return {'launches': launches, 'compute': compute, 'launches+compute': launches + compute,
                'views': sum(self.views.values()), 'allocations': sum(self.allocations.values()),
                'ours': sum(self.ours.values())}


@contextlib.contextmanager
def counting_launch(rt, counter):
    """Wrap ``rt.launch`` (``lapformer_mm.ops.backends.cuda``) so that each launch is
    recorded in ``counter``."""
    original = rt.launch

    def launch(*args, **kwargs):
        counter.launch((args[0],))
        return original(*args, **kwargs)
    rt.launch = launch
    try:
        yield counter
    finally:
        rt.launch = original


def count_call(fn, rt):
    """(result, OpCounter) of ``fn()`` with ATen ops and launches counted."""
    counter = OpCounter()
    with counting_launch(rt, counter), counter:
        result = fn()
    return result, counter


def module_call_counts(module, x, hw, rt, backward=True):
    """Counts of one forward, and of one forward+backward, of ``module(x, hw)``.

    x requires grad (as inside a network); the backward takes a fixed output gradient.
    """
    forward = count_call(lambda: module(x, hw), rt)[1]
    both = None
    if backward:
        grad = torch.ones(x.shape, dtype=x.dtype)
        # Gradients start unset, as in a training step after zero_grad(set_to_none=True).
        module.zero_grad(set_to_none=True)
        x.grad = None

        def step():
            out = module(x, hw)
            out.backward(grad)
        both = count_call(step, rt)[1]
    return forward, both
