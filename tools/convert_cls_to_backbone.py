"""Turn an ImageNet classifier checkpoint into a LaplacianFormer backbone state dict.

Command-line entry point; the code is :mod:`lapformer_mm.cli.convert_cls_to_backbone`.
"""
import sys

from lapformer_mm.cli.convert_cls_to_backbone import main

if __name__ == '__main__':
    sys.exit(main())
