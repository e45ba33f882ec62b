"""Inference speed and peak memory of a detector/segmentor config (CPU or GPU).

Runs the whole model (``mode='predict'``: backbone, neck, heads, post-processing)
on random images of a fixed size with random weights (pretrained loading off),
after ``--warmup`` untimed calls. Reports images/s, median and mean latency per
batch, and peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during the
timed calls; on CPU the process's resident high-water mark (VmHWM, reset with
``/proc/self/clear_refs`` after the model is built) less its resident size then (Linux).
Speed on a shared machine depends on its load: ``os.getloadavg()`` is printed. On CPU,
glibc's mmap/trim thresholds are raised first (:mod:`lapformer_mm.cpu_malloc`) so large
tensors are reused rather than page-faulted in on every call; ``--glibc-malloc-defaults``
keeps the defaults.

Example::

    python benchmarks/inference.py configs/maskrcnn_lapformer_t.py --shape 800 1333 \\
        --device cuda --repeats 50
    python benchmarks/inference.py configs/toy/maskrcnn_lapformer_t_toy.py --shape 128 128
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from mmengine.config import DictAction

from devtools.timing import device_problem, machine, parse_device
from lapformer_mm.analysis.model_zoo import build_from_config, data_samples
from lapformer_mm.cli import int_at_least
from lapformer_mm.cpu_malloc import keep_large_blocks
from lapformer_mm.preflight import argument_problem


def random_batch(scope, batch_size, height, width):
    """Raw uint8 images + data samples, as the test dataloader would give."""
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 256, (3, height, width), generator=gen,
                            dtype=torch.uint8) for _ in range(batch_size)]
    return dict(inputs=inputs, data_samples=data_samples(scope, height, width, batch_size))


def status_mib(key):
    """A /proc/self/status field (e.g. 'VmHWM', 'VmRSS') in MiB."""
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f'{key} not in /proc/self/status')


def benchmark(model, data, repeats, warmup, device):
    """Latencies (s) of ``repeats`` timed predict calls and peak memory (MiB)."""
    cuda = torch.device(device).type == 'cuda'

    def call():
        with torch.no_grad():
            model.test_step(data)
        if cuda:
            torch.cuda.synchronize()

    # The process's high-water mark reset to the resident set of the built model: building
    # it may have peaked higher than any call, which ru_maxrss would keep.
    rss_before = status_mib('VmRSS')
    if not cuda:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
    for _ in range(warmup):
        call()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = status_mib('VmHWM') - rss_before
    return times, peak


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('config')
    parser.add_argument('--shape', type=int_at_least(1), nargs=2, metavar=('H', 'W'),
                        help='input size (default 800 1333; 512 512 for mmseg)')
    parser.add_argument('--batch-size', type=int, default=1)
    parser.add_argument('--repeats', type=int, default=10)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--device', type=parse_device, default='cuda' if
                        torch.cuda.is_available() else 'cpu')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    parser.add_argument('--glibc-malloc-defaults', action='store_true',
                        help="CPU: keep glibc's default mmap/trim thresholds instead of "
                        'lapformer_mm.cpu_malloc.keep_large_blocks()')
    args = parser.parse_args(argv)
    for name in ('batch_size', 'repeats'):
        if getattr(args, name) < 1:
            parser.error(f'--{name.replace("_", "-")} must be >= 1, got '
                         f'{getattr(args, name)}')
    if args.warmup < 0:
        parser.error(f'--warmup must be >= 0, got {args.warmup}')
    problem = argument_problem(args.config)
    if problem:
        parser.error(f'config {args.config!r} {problem}')
    problem = device_problem(args.device)
    if problem:
        parser.error(f'--device {args.device}: {problem}')
    return args


def main(argv=None):
    args = parse_args(argv)
    tuned_malloc = (args.device == 'cpu' and not args.glibc_malloc_defaults
                    and keep_large_blocks())
    model, scope = build_from_config(args.config, args.cfg_options)
    model.to(args.device)
    height, width = args.shape or ((512, 512) if scope == 'mmseg' else
                                   (800, 1333))
    data = random_batch(scope, args.batch_size, height, width)
    times, peak = benchmark(model, data, args.repeats, args.warmup, args.device)
    median = statistics.median(times)
    print(f'config:     {args.config}')
    print(f'machine:    {machine()}')
    print(f'device:     {args.device} (torch threads {torch.get_num_threads()}, '
          f'load average {os.getloadavg()[0]:.1f}'
          f'{", glibc malloc keeps blocks up to 1 GiB" if tuned_malloc else ""})')
    print(f'input:      {args.batch_size}x3x{height}x{width}, {args.repeats} '
          f'timed calls after {args.warmup} warm-up')
    print(f'throughput: {args.batch_size / median:.2f} images/s')
    print(f'latency:    median {median * 1e3:.1f} ms, mean '
          f'{statistics.mean(times) * 1e3:.1f} ms per batch')
    print(f'peak mem:   {peak:.0f} MiB '
          f'({"max_memory_allocated" if args.device.startswith("cuda") else "RSS growth"})')


if __name__ == '__main__':
    main()
