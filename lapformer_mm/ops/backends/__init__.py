"""The compiled implementations of the attention op, each saying what it supports.

Each backend module has ``NAME`` (the ``impl`` users pass), ``DEVICE`` (the tensors' device
type), ``available()``, ``not_supported(q, k, v, landmarks, opts)`` (reasons; empty when it
can run the call), ``forward`` and ``backward`` with the op's contract
(:mod:`lapformer_mm.ops.attention`); where ``available()`` can be False for more than one
reason, ``unavailable_reason()`` says which (else the message gives ``INSTALL_HINT``). They
import nothing of ours but the reference.
"""
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[2]


def kernel_sources(kind):
    """The folder of the kernel sources ``kind`` ('cuda', 'onnxruntime'): the copy a wheel
    ships (``lapformer_mm/ops_src/<kind>``, setup.py), else the checkout's ``ops/<kind>`` (a
    source tree or an editable install); the shipped path when neither exists."""
    shipped = _PACKAGE / 'ops_src' / kind
    checkout = _PACKAGE.parent / 'ops' / kind
    return checkout if not shipped.is_dir() and checkout.is_dir() else shipped
