"""Time and minor page faults of allocating large CPU tensors, with glibc's defaults or with
:func:`lapformer_mm.cpu_malloc.keep_large_blocks` (docs/analysis.md, section 3).

For each size: ``x + 1`` on a (1, side², 64) fp32 tensor, two warm-up adds, then the mean time
and mean minor-fault count of ten adds (the means include the heap's growth in the first
adds). One torch thread.

Example::

    python benchmarks/malloc_faults.py            # glibc defaults
    python benchmarks/malloc_faults.py --keep     # thresholds raised first
"""
import argparse
import resource
import sys
import time

import torch

from lapformer_mm.cpu_malloc import keep_large_blocks


def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(side, adds=10):
    """Mean seconds and minor faults of one fresh ``x + 1`` on a (1, side², 64) tensor."""
    x = torch.randn(1, side * side, 64)
    for _ in range(2):
        y = x + 1
        del y
    faults, start = minor_faults(), time.perf_counter()
    for _ in range(adds):
        y = x + 1
        del y
    return (time.perf_counter() - start) / adds, (minor_faults() - faults) / adds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--keep', action='store_true', help='call keep_large_blocks() first')
    parser.add_argument('--sides', type=int, nargs='+', default=[256, 512, 1024])
    args = parser.parse_args(argv)
    if args.keep and not keep_large_blocks():
        sys.exit('keep_large_blocks() did not take effect (not glibc?)')
    torch.set_num_threads(1)
    setting = 'keep_large_blocks' if args.keep else 'glibc defaults'
    print(f'| tensor | mean ms per add | mean minor faults per add ({setting}) |')
    print('|---|---|---|')
    for side in args.sides:
        seconds, faults = measure(side)
        print(f'| {side * side * 64 * 4 / 2**20:.0f} MiB | {seconds * 1e3:.1f} | {faults:.0f} |')


if __name__ == '__main__':
    main()
