"""Draw a detector's or a segmentor's predictions into PNG files.

Command-line entry point; the code is :mod:`lapformer_mm.cli.visualize_predictions`.
"""
import os.path as osp
import sys

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from lapformer_mm.cli.visualize_predictions import main  # noqa: E402

if __name__ == '__main__':
    main()
