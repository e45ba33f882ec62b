"""Ablation sweep of the attention options on a toy task or a real classification config.

Command-line entry point; the code is :mod:`lapformer_mm.cli.ablate`.
"""
import os.path as osp
import sys

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from lapformer_mm.cli.ablate import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main())
