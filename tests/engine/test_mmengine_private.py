"""The mmengine internals lapformer_mm.engine relies on are the ones it was written against;
on a failure, review lapformer_mm/engine against the new source, then update the digest."""
import pytest

from lapformer_mm.engine._mmengine_private import PINNED, source_digest


@pytest.mark.parametrize('name', sorted(PINNED))
def test_pinned_mmengine_source_is_unchanged(name):
    obj, digest = PINNED[name]
    assert source_digest(obj) == digest, (
        f'{name} changed in this mmengine: review lapformer_mm/engine against it')


def test_digest_differs_for_different_source():
    assert source_digest(source_digest) != source_digest(test_pinned_mmengine_source_is_unchanged)
