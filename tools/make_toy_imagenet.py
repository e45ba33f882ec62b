"""Write a small, deterministic ImageNet-format classification set of toy shapes.

Command-line entry point; the code is :mod:`lapformer_mm.cli.make_toy_imagenet`.
"""
from lapformer_mm.cli.make_toy_imagenet import main

if __name__ == '__main__':
    main()
