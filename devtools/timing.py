"""Timers, machine load and argument parsing shared by the scripts in ``benchmarks/``.

Only torch and the standard library: the GPU benchmarks run without OpenMMLab.
"""
import argparse
import os
import time

import torch


def parse_size(text):
    """'HxW' -> (H, W), both positive; an ``argparse`` type."""
    try:
        height, width = (int(v) for v in text.lower().split('x'))
    except ValueError:
        raise argparse.ArgumentTypeError(f'size must be HxW, got {text!r}') from None
    if height < 1 or width < 1:
        raise argparse.ArgumentTypeError(f'size must be positive, got {text!r}')
    return height, width


def parse_device(text):
    """An ``argparse`` type: 'cpu', 'cuda' or 'cuda:N' (the devices the timing and memory
    code handle)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ('cpu', 'cuda'):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def device_problem(text):
    """Why a device that :func:`parse_device` took is not on this machine, or None."""
    device = torch.device(text)
    if device.type != 'cuda':
        return None
    count = torch.cuda.device_count()
    if count == 0:
        return (f'no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() '
                'is False); use cpu')
    if device.index is not None and device.index >= count:
        return f'this machine has cuda:0 to cuda:{count - 1}'
    return None


def machine():
    """What a measurement ran on, for a table's header: the CPU model (``/proc/cpuinfo``'s
    model name; ``platform.processor()`` is empty on Linux), the CPU count, the CPU
    kernels' ISA build and the checkout's commit, e.g. 'AMD EPYC, 2 CPUs, avx512 kernels,
    commit 9cffb4a'."""
    import platform
    import subprocess
    model = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            model = next(line.split(':', 1)[1].strip() for line in f
                         if line.startswith('model name'))
    except (OSError, StopIteration):
        pass
    parts = [model, f'{os.cpu_count()} CPUs']
    try:
        from lapformer_mm.ops.backends import cpu
        parts.append(f'{cpu.build() or "no"} CPU kernels')
    except Exception:  # no package, no extension: the header says less
        pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(['git', '-C', root, 'rev-parse', '--short', 'HEAD'],
                                capture_output=True, text=True).stdout.strip()
    except OSError:  # no git
        commit = ''
    if commit:
        parts.append(f'commit {commit}')
    return ', '.join(parts)


def load_average():
    """The 1/5/15-minute load averages as a string (the numbers ``uptime`` shows)."""
    one, five, fifteen = os.getloadavg()
    return f'{one:.2f}, {five:.2f}, {fifteen:.2f}'


def wall_times(fn, repeats):
    """Wall seconds of ``repeats`` runs of ``fn()`` after one untimed warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def timed(fn):
    """(wall s, process CPU s) of one call of ``fn()``; CPU time counts all threads."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def best_time(fn, repeats):
    """Minimum (wall s, process CPU s) of ``fn()`` over ``repeats`` runs after a warm-up.

    On cores shared with other jobs, interference only adds time, so the minimum is
    the least disturbed estimate. Process CPU time counts all threads.
    """
    fn()
    walls, cpus = zip(*(timed(fn) for _ in range(repeats)))
    return min(walls), min(cpus)


def time_once(fn, device):
    """Seconds of one call of ``fn()``: CUDA events on a CUDA device, wall clock otherwise."""
    if torch.device(device).type == 'cuda':
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
