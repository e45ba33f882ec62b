"""Smoke-run the full-size configs on a few synthetic images at COCO's training size.

Command-line entry point; the code is :mod:`lapformer_mm.cli.smoke_fullsize`.
"""
import sys

from lapformer_mm.cli.smoke_fullsize import main

if __name__ == '__main__':
    sys.exit(main())
