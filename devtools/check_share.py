"""Share of argument checks among the package lines one reference forward executes.

    python devtools/check_share.py [--arch tiny] [--size 224] [--list]

Traces (``sys.settrace``) one eval forward of ``LaplacianFormer(arch)`` on a (1, 3, size,
size) input with ``impl='reference'``, after a warm-up call, and counts the distinct lines of
``lapformer_mm/**`` that run. A line is a check when it lies in a function whose name starts
with ``check``/``_check``, is the test of an ``if`` whose body raises, or is a ``raise``.
"""
import argparse
import ast
import os
import sys

import torch

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       'lapformer_mm')


def check_lines(path):
    """Line numbers of ``path`` that count as checks."""
    lines = set()
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        span = range(getattr(node, 'lineno', 0), getattr(node, 'end_lineno', 0) + 1)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name.lstrip('_').startswith('check'):
            lines.update(span)
        elif isinstance(node, ast.Raise):
            lines.update(span)
        elif isinstance(node, ast.If) and any(isinstance(n, ast.Raise) for s in node.body
                                              for n in ast.walk(s)):
            lines.update(range(node.test.lineno, node.test.end_lineno + 1))
    return lines


def executed_lines(fn):
    """{path: {line}} of the package lines ``fn()`` runs."""
    seen = {}

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(PACKAGE):
            return None
        if event == 'line':
            seen.setdefault(path, set()).add(frame.f_lineno)
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return seen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--arch', default='tiny')
    parser.add_argument('--size', type=int, default=224)
    parser.add_argument('--list', action='store_true', help='print each check line run')
    args = parser.parse_args(argv)
    from lapformer_mm.models import LaplacianFormer
    torch.manual_seed(0)
    model = LaplacianFormer(args.arch, attn_cfg=dict(impl='reference')).eval()
    x = torch.randn(1, 3, args.size, args.size)
    with torch.no_grad():
        model(x)
        seen = executed_lines(lambda: model(x))
    total = checks = 0
    for path, lines in sorted(seen.items()):
        hits = sorted(lines & check_lines(path))
        total, checks = total + len(lines), checks + len(hits)
        rel = os.path.relpath(path, os.path.dirname(PACKAGE))
        print(f'{rel}: {len(hits)} of {len(lines)}')
        if args.list:
            source = open(path).read().splitlines()
            for line in hits:
                print(f'  {line}: {source[line - 1].strip()}')
    print(f'checks: {checks} of {total} lines ({100 * checks / total:.0f} %)')


if __name__ == '__main__':
    main()
