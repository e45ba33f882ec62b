"""The command-line tools' code, importable (``main(argv=None)`` each); ``tools/*.py`` are thin
entry points. Not imported by ``import lapformer_mm``."""
import argparse
import math
import os
import os.path as osp


def int_at_least(minimum):
    def integer(text):
        value = int(text)  # not an integer: argparse's "invalid integer value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f'must be >= {minimum}, got {value}')
        return value
    return integer


def positive_float(text):
    value = float(text)  # not a number: argparse's "invalid positive_float value"
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f'must be a finite number > 0, got {text}')
    return value


def output_path(out, default_name):
    """``--out`` as a file: ``default_name`` in it when it names a folder (an existing one, or
    any path ending with a separator), ``default_name`` here when not given."""
    if not out:
        return default_name
    out = os.fspath(out)
    return osp.join(out, default_name) if osp.isdir(out) or out.endswith(os.sep) else out
