"""COCO evaluation of a results file with pycocotools (see lapformer_mm/cli/coco_eval.py)."""
import sys

from lapformer_mm.cli.coco_eval import main

if __name__ == '__main__':
    sys.exit(main())
