"""The suite's fixtures and markers.

- ``gpu`` tests are skipped without CUDA and CuPy;
- ``toy_data`` (with ``toy_coco`` and ``toy_seg``): the session's toy data set, written once;
- ``toy_run``: one epoch of the toy Mask R-CNN through ``tools/train.py``, trained once and
  shared by the tests of the train/test/resume tools and of mmdet's own train script;
- ``built_wheel``: ``pip wheel`` of a fresh copy of the checkout (the CPU kernels compiled
  in it), built once and shared by the packaging and kernel-build tests;
- ``mmdet_scope``: builds under mmdet's default scope whatever an earlier test's Runner left;
- ``evil``: a backbone checkpoint that runs code when unpickled, and the marker file it
  creates if it does.

The paths (``ROOT``, ``TOOLS``, ``CONFIG_DIR``, ``TOY_CONFIG``) and the tool runner
(``run_tool``) are constants and functions of ``_shared.py``, which test modules import.
The ``slow`` marker is registered in pytest.ini; ``make test-fast`` leaves those tests out.
"""
import os
import os.path as osp
import subprocess
import sys
import zipfile
from types import SimpleNamespace

import pytest
import torch
from _shared import TOY_CONFIG, TRAIN_TOOL, copy_checkout, run_tool, toy_run_options, write_toy_coco
from _xdist_order import longest_files_first


def _cuda_and_cupy():
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


# Under pytest-xdist (`make test`: -n auto --dist loadfile) one worker runs a whole file, so a
# file's tests share their module-scoped fixtures (the emulation build, the NVRTC compiles);
# the tests of each shared session fixture (toy_run, built_wheel) sit in one file for the same
# reason. The longest files go first (_xdist_order.py; the Makefile's --no-loadscope-reorder
# keeps that order, where xdist would put the files with the most tests first).
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
    """The folder of the toy COCO set (``toy_coco/``: 8 train / 2 val images of 64 px, at most
    2 objects each; 4 iterations per epoch at the toy configs' batch 2) and the same scenes as
    an mmseg set with label maps (``toy_seg/``).

    Shared by the whole session: read it, never change it (copy what a test breaks). A test
    that needs fewer train images selects the first ones (``dataset.indices``): the first N
    images of the set are those of an N-image set.
    """
    folder = tmp_path_factory.mktemp('toy_data')
    write_toy_coco(folder, num_train=8, seg=True)
    return folder


@pytest.fixture(scope='session')
def toy_coco(toy_data):
    """The root of the session's toy COCO set (a str)."""
    return str(toy_data / 'toy_coco')


@pytest.fixture(scope='session')
def toy_seg(toy_data):
    """The root of the session's toy mmseg set (a str): img_dir/ and ann_dir/."""
    return str(toy_data / 'toy_seg')


@pytest.fixture(scope='session')
def toy_run(tmp_path_factory, toy_coco):
    """One epoch (4 iterations) of the toy Mask R-CNN through ``tools/train.py`` with
    :func:`_shared.toy_run_options`: ``work`` (its work dir: epoch_1.pth, last_checkpoint),
    ``checkpoint`` (epoch_1.pth), ``log`` (the tool's output) and ``data`` (the data root).

    Shared by the whole session: read it, never change it; a test that continues the run
    does so in a copy (:func:`_shared.copy_run`)."""
    work = str(tmp_path_factory.mktemp('toy_run') / 'work')
    log = run_tool([sys.executable, TRAIN_TOOL, TOY_CONFIG, '--work-dir', work] +
                   toy_run_options(toy_coco, max_epochs=1))
    return SimpleNamespace(work=work, checkpoint=osp.join(work, 'epoch_1.pth'), log=log,
                           data=toy_coco)


@pytest.fixture(scope='session')
def built_wheel(tmp_path_factory):
    """``pip wheel --no-build-isolation`` of a fresh copy of the checkout (the files git
    tracks or does not ignore), built once: setup.py compiles the CPU kernels into it.

    ``wheel`` (its path), ``site`` (the wheel unpacked: what a regular install puts in
    site-packages), ``log`` (pip's verbose output, the build's stderr included)."""
    base = tmp_path_factory.mktemp('wheel')
    checkout = base / 'checkout'
    copy_checkout(checkout)
    proc = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps',
                           '--no-build-isolation', '--disable-pip-version-check', '-v',
                           '-w', str(base / 'dist'), str(checkout)],
                          capture_output=True, text=True, timeout=1800)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    wheel, = (base / 'dist').glob('lapformer_mm-*.whl')
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(base / 'site')
    return SimpleNamespace(wheel=wheel, site=base / 'site', log=log)


@pytest.fixture
def mmdet_scope():
    """Build under mmdet's scope whatever an earlier test's Runner left as default scope."""
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

