"""Compile the fused attention's kernels for this GPU in parallel, for the processes after it.

    python benchmarks/cuda_compile.py                  # every variant the device fits, 3 dtypes
    python benchmarks/cuda_compile.py --dtypes fp32 --jobs 4

tools/gpu_check.sh's compile step. One process per (variant, dtype), as many at once as
``--jobs`` (default: the cores): every variant whose kernels fit the device's shared memory
(on an H100 or H200 all four; the GPU tests force the smaller devices' variants on it), for
each dtype. Each one loads through the backend (``cuda.load_group``), which compiles it and
leaves the binary in CuPy's kernel cache (docs/cuda.md, "Compiles, once per machine"), or
loads it from there. Then this process loads every pair again, as the tests and benchmarks
after it will, and says what CuPy did (``cuda.loaded_from``): a pair compiled again means
every later process would compile it too (10-40 s each), and the script exits 1, as it does
when a compile fails.
"""
import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds lapformer_mm/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = ('fp32', 'fp16', 'bf16')


def _load(variant_name, dtype_name):
    """(variant, dtype, seconds, 'compiled' / 'cached' / 'FAILED: ...') of one load_group on
    the current device."""
    import torch

    from lapformer_mm.ops.backends import cuda, cuda_plan
    dtype = {'fp32': torch.float32, 'fp16': torch.float16, 'bf16': torch.bfloat16}[dtype_name]
    index = torch.cuda.current_device()
    variant, element = cuda_plan.VARIANT_BY_NAME[variant_name], cuda_plan.ELEMENT_TYPES[dtype]
    start = time.perf_counter()
    try:
        cuda.load_group(index, variant, element)
        how = cuda.loaded_from[(index, variant.name, element)]
    except Exception as exc:  # reported, and the script fails
        how = f'FAILED: {type(exc).__name__}: {exc}'
    return variant_name, dtype_name, time.perf_counter() - start, how


def device_variants():
    """The variants whose kernels fit the current device's shared memory."""
    import torch

    from lapformer_mm.ops.backends import cuda, cuda_plan
    limits = cuda.device_limits(torch.device('cuda', torch.cuda.current_device()))
    return [v.name for v in cuda_plan.VARIANTS if cuda_plan.variant_fits(v, limits.smem_optin)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--dtypes', nargs='+', default=list(DTYPES), choices=DTYPES)
    p.add_argument('--jobs', type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    # Spawned workers, so that this process may use CUDA before and after them.
    spawn = multiprocessing.get_context('spawn')
    pairs = [(v, d) for v in device_variants() for d in args.dtypes]
    start, compiled = time.perf_counter(), []
    with concurrent.futures.ProcessPoolExecutor(max(1, min(args.jobs, len(pairs))),
                                                mp_context=spawn) as pool:
        for variant, dtype, seconds, how in pool.map(_load, *zip(*pairs)):
            print(f'{variant} {dtype}: {how} in {seconds:.1f} s', flush=True)
            if not how.startswith('FAILED'):
                compiled.append((variant, dtype))
    print(f'{len(pairs)} (variant, dtype) pairs in {time.perf_counter() - start:.1f} s, '
          f'{min(args.jobs, len(pairs))} at once', flush=True)
    for variant, dtype in compiled:
        variant, dtype, seconds, how = _load(variant, dtype)
        print(f'{variant} {dtype}, loaded again: {how} in {seconds:.2f} s', flush=True)
        if how != 'cached':
            print("CuPy's kernel cache did not serve the kernels: every later process compiles "
                  'them again', flush=True)
            return 1
    return 0 if len(compiled) == len(pairs) else 1


if __name__ == '__main__':
    sys.exit(main())
