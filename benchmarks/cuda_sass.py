"""Print the SASS instruction counts of the CUDA kernels' hot loops (no GPU needed).

See :mod:`devtools.sass` for what is counted. Needs the pip packages
``nvidia-cuda-nvrtc-cu12`` and ``nvidia-cuda-nvdisasm``.

    python benchmarks/cuda_sass.py                       # the default variant, sm_90
    python benchmarks/cuda_sass.py --variant dv32_tb16 --arch sm_75
"""
import argparse
import sys
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devtools.sass import SassToolError, report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--variant', default='dv64_tb32', help='a name of backends.cuda_plan.VARIANTS')
    p.add_argument('--arch', default='sm_90')
    p.add_argument('--kernels', default='float', help='substring of the instantiations to show')
    args = p.parse_args(argv)
    try:
        rows = [r for r in report(args.variant, args.arch) if args.kernels in r['kernel']]
    except SassToolError as err:
        print(f'cuda_sass: {err}', file=sys.stderr)
        return 2
    print(f'| kernel ({args.arch}) | hot-loop instructions | terms | per term | main opcodes |')
    print('|---|---|---|---|---|')
    for r in rows:
        top = ', '.join(f'{op} {n}' for op, n in list(r['histogram'].items())[:8])
        per = '-' if r['per_term'] is None else f"{r['per_term']:.2f}"
        print(f"| `{r['kernel']}` | {r['instructions']} | {r['terms']} | {per} | {top} |")
    return 0


if __name__ == '__main__':
    sys.exit(main())
