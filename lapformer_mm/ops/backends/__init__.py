"""The compiled implementations of the attention op, each saying what it supports.

Each backend module has ``NAME`` (the ``impl`` users pass), ``DEVICE`` (the tensors' device
type), ``available()``, ``not_supported(q, k, v, landmarks, opts)`` (reasons; empty when it
can run the call), ``forward`` and ``backward`` with the op's contract
(:mod:`lapformer_mm.ops.attention`); where ``available()`` can be False for more than one
reason, ``unavailable_reason()`` says which (else the message gives ``INSTALL_HINT``). They
import nothing of ours but the reference.
"""
