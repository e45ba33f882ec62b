import pytest
import torch


def _cuda_and_cupy():
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    if _cuda_and_cupy():
        return
    skip = pytest.mark.skip(reason='needs CUDA and CuPy')
    for item in items:
        if 'gpu' in item.keywords:
            item.add_marker(skip)
