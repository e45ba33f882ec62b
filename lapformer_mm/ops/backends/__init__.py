"""The compiled implementations of the attention op; each module has ``NAME`` (the ``impl``),
``DEVICE``, ``available()``, ``not_supported(q, k, v, landmarks, opts)`` (reasons, empty when
it runs the call), ``forward`` and ``backward`` (:mod:`lapformer_mm.ops.attention`'s contract)
and ``INSTALL_HINT`` or ``unavailable_reason()``. They import nothing of ours but the reference.
"""
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[2]


def kernel_sources(kind):
    """ops/<kind> ('cuda', 'onnxruntime'): a wheel's copy (lapformer_mm/ops_src/<kind>, setup.py),
    else the checkout's (a source tree, an editable install); the wheel's path when neither is."""
    shipped, checkout = _PACKAGE / 'ops_src' / kind, _PACKAGE.parent / 'ops' / kind
    return checkout if not shipped.is_dir() and checkout.is_dir() else shipped
