"""Train a detector or segmentor from a config (mmdet's ``tools/train.py`` interface).

Command-line entry point; the code is :mod:`lapformer_mm.cli.train`.
"""
import os.path as osp
import sys

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from lapformer_mm.cli.train import main  # noqa: E402

if __name__ == '__main__':
    main()
