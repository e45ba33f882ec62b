"""Time and minor page faults of allocating large CPU tensors, with glibc's defaults or with
:func:`lapformer_mm.cpu_malloc.keep_large_blocks` (docs/analysis.md, section 3).

For each size, in a fresh process: ``x + 1`` on a (1, side², 64) fp32 tensor, warm-up adds
until one faults no page in (at most ten: with glibc's defaults every add does), then the
median time and minor-fault count of ten adds. The heap grows in the first adds, at a
point that depends on what the process allocated before, so neither a mean nor sizes
measured one after another in one process give the steady state. One torch thread.

Example::

    python benchmarks/malloc_faults.py            # glibc defaults
    python benchmarks/malloc_faults.py --keep     # thresholds raised first
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from devtools.timing import load_average, machine
from lapformer_mm.cpu_malloc import keep_large_blocks


def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _one_add(x):
    faults, start = minor_faults(), time.perf_counter()
    y = x + 1
    seconds = time.perf_counter() - start
    del y
    return seconds, minor_faults() - faults


def measure(side, adds=10, max_warmup=10):
    """Median seconds and minor faults of one fresh ``x + 1`` on a (1, side², 64) tensor, and
    the number of warm-up adds."""
    x = torch.randn(1, side * side, 64)
    warmups = 0
    while warmups < max_warmup:
        warmups += 1
        if _one_add(x)[1] == 0:
            break
    runs = [_one_add(x) for _ in range(adds)]
    return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
            warmups)


def _child(side, keep):
    if keep and not keep_large_blocks():
        sys.exit('keep_large_blocks() did not take effect (not glibc?)')
    torch.set_num_threads(1)
    print(json.dumps(measure(side)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--keep', action='store_true', help='call keep_large_blocks() first')
    parser.add_argument('--sides', type=int, nargs='+', default=[256, 512, 1024],
                        help='tensor sizes (1, side², 64), each in a fresh process')
    parser.add_argument('--child', type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return _child(args.child, args.keep)
    if any(side < 1 for side in args.sides):
        parser.error(f'--sides must be positive, got {args.sides}')
    setting = 'keep_large_blocks' if args.keep else 'glibc defaults'
    print(f'{machine()}; {setting}; one thread; load {load_average()}')
    print('| tensor | median ms per add | median minor faults per add | warm-up adds |')
    print('|---|---|---|---|')
    for side in args.sides:
        proc = subprocess.run([sys.executable, __file__, '--child', str(side)]
                              + (['--keep'] if args.keep else []),
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(proc.stderr.strip() or f'the measurement of side {side} failed')
        seconds, faults, warmups = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f'| {side * side * 64 * 4 / 2**20:.0f} MiB | {seconds * 1e3:.1f} | '
              f'{faults:.0f} | {warmups} |')


if __name__ == '__main__':
    main()
