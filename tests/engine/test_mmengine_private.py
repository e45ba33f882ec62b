"""The mmengine internals lapformer_mm.engine relies on are the ones it was written against.

A failure here means mmengine changed code that ``lapformer_mm/engine/_mmengine_private.py``
lists: read the new mmengine source, adapt SafeCheckpointHook / SafeCheckpointRunner,
then update the digest.
"""
import pytest

from lapformer_mm.engine._mmengine_private import PINNED, source_digest


@pytest.mark.parametrize('name', sorted(PINNED))
def test_pinned_mmengine_source_is_unchanged(name):
    obj, digest = PINNED[name]
    assert source_digest(obj) == digest, (
        f'{name} changed in this mmengine: review lapformer_mm/engine against it')


def test_digest_differs_for_different_source():
    def f():
        return 1

    def g():
        return 2

    assert source_digest(f) != source_digest(g)
