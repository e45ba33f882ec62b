"""Build the opt-in ONNX Runtime custom-operator library (docs/deploy.md).

Command-line entry point; the code is :mod:`lapformer_mm.cli.build_ort_ops`.
"""
import sys

from lapformer_mm.cli.build_ort_ops import main

if __name__ == '__main__':
    sys.exit(main())
