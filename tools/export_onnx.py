"""Export a model's backbone, features or raw outputs to ONNX.

Command-line entry point; the code is :mod:`lapformer_mm.cli.export_onnx`.
"""
import sys

from lapformer_mm.cli.export_onnx import main

if __name__ == '__main__':
    sys.exit(main())
