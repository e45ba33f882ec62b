"""The suite's fixtures (session ones read-only: copy what a test breaks) and the gpu skip."""
import os
import os.path as osp
import sys
from types import SimpleNamespace

import pytest
import torch
from _shared import TOY_CONFIG, TRAIN_TOOL, run_tool, toy_run_options, write_toy_coco
from _xdist_order import longest_files_first


def _cuda_and_cupy():
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


# Under pytest-xdist (`make test`: --dist loadfile) one worker runs a whole file and its
# module-scoped fixtures; the longest files go first (_xdist_order.py).
def pytest_collection_modifyitems(config, items):
    if not _cuda_and_cupy():
        skip = pytest.mark.skip(reason='needs CUDA and CuPy')
        for item in items:
            if 'gpu' in item.keywords:
                item.add_marker(skip)
    if os.environ.get('PYTEST_XDIST_WORKER'):
        items[:] = longest_files_first(items)


def pytest_configure(config):
    # Each xdist worker gets its share of the cores, and so do the tools it starts
    # (OMP_NUM_THREADS is inherited): two workers of two threads on two cores spin against
    # each other.
    workers = os.environ.get('PYTEST_XDIST_WORKER_COUNT')
    if workers:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(threads)
        os.environ['OMP_NUM_THREADS'] = str(threads)


@pytest.fixture(scope='session')
def toy_data(tmp_path_factory):
    """``toy_coco/`` (8 train / 2 val images of 64 px) and the same scenes as ``toy_seg/``."""
    folder = tmp_path_factory.mktemp('toy_data')
    write_toy_coco(folder, num_train=8, seg=True)
    return folder


@pytest.fixture(scope='session')
def toy_coco(toy_data):
    return str(toy_data / 'toy_coco')


@pytest.fixture(scope='session')
def toy_seg(toy_data):
    return str(toy_data / 'toy_seg')


@pytest.fixture(scope='session')
def toy_run(tmp_path_factory, toy_coco):
    """One epoch of the toy Mask R-CNN through ``tools/train.py``."""
    work = str(tmp_path_factory.mktemp('toy_run') / 'work')
    log = run_tool([sys.executable, TRAIN_TOOL, TOY_CONFIG, '--work-dir', work] +
                   toy_run_options(toy_coco, max_epochs=1))
    return SimpleNamespace(work=work, checkpoint=osp.join(work, 'epoch_1.pth'), log=log,
                           data=toy_coco)


@pytest.fixture
def mmdet_scope():
    from mmengine.registry import DefaultScope
    with DefaultScope.overwrite_default_scope('mmdet'):
        yield


@pytest.fixture
def evil(tmp_path):
    """(checkpoint path, marker path): a backbone state dict plus a code-running payload."""
    # Imported here: the GPU check runs this conftest where mmengine is not installed.
    from _runner_helpers import RunsCode

    from lapformer_mm.models import LaplacianFormer
    marker = tmp_path / 'payload_ran'
    path = tmp_path / 'evil.pth'
    state = LaplacianFormer(arch=dict(embed_dims=[32] * 4, num_heads=[1] * 4,
                                      depths=[1] * 4)).state_dict()
    torch.save({'state_dict': state, 'meta': {'x': RunsCode(marker)}}, path)
    return str(path), marker

