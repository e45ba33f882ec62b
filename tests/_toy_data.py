"""A tiny toy COCO set (64 px images, 2 val images, at most 2 objects each) for tool runs."""
import contextlib
import io
import os.path as osp

from lapformer_mm.cli import make_toy_coco


def write_toy_coco(folder, num_train, seg=False):
    """Write the set under ``folder/toy_coco`` (``num_train`` train images); return that path.

    With ``seg``, also the same scenes as an mmseg set with label maps under ``folder/toy_seg``.
    """
    root = osp.join(str(folder), 'toy_coco')
    seg_out = ['--seg-out', osp.join(str(folder), 'toy_seg')] if seg else []
    with contextlib.redirect_stdout(io.StringIO()):
        make_toy_coco.main(['--out', root, '--num-train', str(num_train), '--num-val', '2',
                            '--img-size', '64', '--max-objects', '2'] + seg_out)
    return root
