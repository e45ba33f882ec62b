"""Write a small, deterministic COCO-format instance-segmentation data set.

Command-line entry point; the code is :mod:`lapformer_mm.cli.make_toy_coco`.
"""
from lapformer_mm.cli.make_toy_coco import main

if __name__ == '__main__':
    main()
