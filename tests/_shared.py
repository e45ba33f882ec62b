"""What several test modules share: the paths, the tool runner, the toy data."""
import contextlib
import io
import os
import os.path as osp
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TESTS = osp.join(ROOT, 'tests')
TOOLS = osp.join(ROOT, 'tools')
CONFIG_DIR = osp.join(ROOT, 'configs')
TOY_CONFIG = osp.join(CONFIG_DIR, 'toy', 'maskrcnn_lapformer_t_toy.py')
TRAIN_TOOL = osp.join(TOOLS, 'train.py')

# A copy of the checkout must import its own files only: the development install's editable
# finder would otherwise serve the copy's missing submodules (the built kernels) from ROOT.
# Prepended to the code of a ``python -c`` run in such a copy (or in an unpacked wheel).
OWN_FILES_ONLY = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
                  "if 'Editable' not in getattr(f, '__name__', type(f).__name__)]\n")


def tool_env(extra_env=None):
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1',
               PYTHONPATH=ROOT, PYTHON=sys.executable)
    env.update(extra_env or {})
    return env


def run_tool(args, cwd=ROOT, extra_env=None, timeout=600, returncode=0):
    """Run a tool in :func:`tool_env`, check its exit status, return its stdout+stderr."""
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=tool_env(extra_env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == returncode, proc.stdout[-4000:]
    return proc.stdout


def write_toy_coco(folder, num_train, seg=False):
    """A toy COCO set under ``folder/toy_coco`` (with ``seg``, ``folder/toy_seg`` too)."""
    # Here, not at the top: every test run loads this module through conftest.py, and the GPU
    # check's runs happen where cv2 and pycocotools (which make_toy_coco needs) may be missing.
    from lapformer_mm.cli import make_toy_coco

    root = osp.join(str(folder), 'toy_coco')
    seg_out = ['--seg-out', osp.join(str(folder), 'toy_seg')] if seg else []
    with contextlib.redirect_stdout(io.StringIO()):
        make_toy_coco.main(['--out', root, '--num-train', str(num_train), '--num-val', '2',
                            '--img-size', '64', '--max-objects', '2'] + seg_out)
    return root


def toy_data_options(root):
    """``--cfg-options`` values that point every split of the toy configs at ``root``."""
    ann_val = osp.join(root, 'annotations', 'instances_val.json')
    return [f'train_dataloader.dataset.data_root={root}/',
            f'val_dataloader.dataset.data_root={root}/',
            f'test_dataloader.dataset.data_root={root}/',
            f'val_evaluator.ann_file={ann_val}', f'test_evaluator.ann_file={ann_val}']


def toy_run_options(root, max_epochs):
    """``--cfg-options`` of the session's toy run (64 px, batches of 2, no evaluation)."""
    return ['--cfg-options', *toy_data_options(root),
            'train_dataloader.dataset.pipeline.2.scale=(64,64)',
            'train_dataloader.batch_size=2', f'train_cfg.max_epochs={max_epochs}',
            'train_cfg.val_interval=100', 'default_hooks.checkpoint.interval=1',
            'default_hooks.checkpoint.max_keep_ckpts=3', 'default_hooks.logger.interval=1']


def copy_checkout(dest):
    """The files git tracks or does not ignore, as in a fresh clone of this working tree."""
    listed = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        source = Path(ROOT, name)
        if source.is_file():
            (Path(dest) / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, Path(dest) / name)
