"""TEMPORARY (issue #33): :mod:`.backends.cuda` behind the old implementation-module
interface of :mod:`.dispatch`, until the op module of issue #31 calls the backend itself
(then this file goes). Falls back to the reference where the backend gives reasons."""
from typing import NamedTuple

from .backends import cuda


class _Options(NamedTuple):
    kernel: str
    lam: float
    eps: float
    iters: int
    ns_init: str
    ns_refine: bool
    normalize: str
    whiten_eps: float


def nystrom_attention_forward(q, k, v, landmarks, kernel, lam, eps, iters, ns_init, ns_refine,
                              normalize, whiten_eps):
    opts = _Options(kernel, lam, eps, iters, ns_init, ns_refine, normalize, whiten_eps)
    if cuda.not_supported(q, k, v, landmarks, opts):
        from .nystrom import nystrom_attention_reference
        return nystrom_attention_reference(q, k, v, landmarks, *opts)
    return cuda.forward(q, k, v, landmarks, opts)


def nystrom_attention_backward(grad, q, k, v, landmarks, context, inverse, stats, kernel, lam,
                               eps, ns_refine, normalize, whiten_eps):
    opts = _Options(kernel, lam, eps, 0, 'identity', ns_refine, normalize, whiten_eps)
    if cuda.not_supported(q, k, v, landmarks, opts):
        from .nystrom import nystrom_attention_backward_reference
        return nystrom_attention_backward_reference(grad, q, k, v, landmarks, context, inverse,
                                                    stats, kernel, lam, eps, ns_refine,
                                                    normalize, whiten_eps)
    return cuda.backward(grad, q, k, v, landmarks, context, inverse, stats, opts)
