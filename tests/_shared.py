"""What several test modules share: the checkout's paths, the tool runner and the toy COCO
writer. ``conftest.py`` builds the session's toy data set with :func:`write_toy_coco`.

Import these (``from _shared import ROOT, run_tool``); no test module imports another.
"""
import contextlib
import io
import os
import os.path as osp
import subprocess
import sys

from lapformer_mm.cli import make_toy_coco

# The checkout the tests run from (the parent of tests/), and its folders.
ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TOOLS = osp.join(ROOT, 'tools')
CONFIG_DIR = osp.join(ROOT, 'configs')
TOY_CONFIG = osp.join(CONFIG_DIR, 'toy', 'maskrcnn_lapformer_t_toy.py')


def tool_env(extra_env=None):
    """This environment, with one thread and the checkout on PYTHONPATH (``extra_env`` on
    top)."""
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1',
               PYTHONPATH=ROOT, PYTHON=sys.executable)
    env.update(extra_env or {})
    return env


def run_tool(args, cwd=ROOT, extra_env=None, timeout=600, returncode=0):
    """Run a tool (``args``, starting with this interpreter or a shell) in :func:`tool_env`;
    check its exit status; return its stdout+stderr."""
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=tool_env(extra_env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == returncode, proc.stdout[-4000:]
    return proc.stdout


def write_toy_coco(folder, num_train, seg=False):
    """A tiny toy COCO set (64 px images, 2 val images, at most 2 objects each) under
    ``folder/toy_coco`` (``num_train`` train images); return that path.

    With ``seg``, also the same scenes as an mmseg set with label maps under ``folder/toy_seg``.
    """
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
