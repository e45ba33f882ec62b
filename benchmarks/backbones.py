"""Latency and peak memory of LaplacianFormer-T/S against mmdet's PVTv2-b1/b2 and Swin-T.

Timing runs in this one process: every model is built once, then for each
input size and mode ('fwd' under no_grad in eval mode; 'fwdbwd' in train mode,
loss = sum of the output means, backward) each model gets one untimed warm-up
call, followed by ``--repeats`` rounds in which the models are called in
rotated order (interleaved, so load changes hit all models alike). The table
reports the median per model, and every model's ratio to LaplacianFormer-T.

Peak memory (``--memory``, measured first): one forked child process per
(model, size, mode), forked from this process before it builds any model, that
builds the model (one intra-op thread), records its resident set (VmRSS), resets the kernel's
high-water mark (``echo 5 > /proc/self/clear_refs``), makes one call and reads
VmHWM. Reported: VmHWM - VmRSS before the call, i.e. the extra resident memory
of the call (activations, autograd buffers, gradients, workspace) on top of
the built model. Linux only; on CUDA the tool reports
``torch.cuda.max_memory_allocated`` instead.

On CPU the tool first raises glibc's mmap and trim thresholds
(:func:`lapformer_mm.cpu_malloc.keep_large_blocks`), so tensors above 32 MiB are reused
instead of being page-faulted in afresh on every allocation, which otherwise dominates the
growth from 1024² to 2048² for every model; ``--glibc-malloc-defaults`` measures without
it. The JSON records which was used.

Background load matters on shared machines: ``uptime`` is printed before and
after the timing, and stored in the JSON.

Example::

    python benchmarks/backbones.py --sizes 512x512 800x1333 1024x1024 2048x2048 \\
        --modes fwd fwdbwd --repeats 3 --memory --plot docs/analysis/backbone_cost.png
    python benchmarks/backbones.py --profile laplacianformer-t --sizes 800x1333
"""
import argparse
import json
import os
import os.path as osp
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from devtools.profiling import cuda_peak_memory
from devtools.timing import device_problem, load_average, machine, parse_device, parse_size
from lapformer_mm.analysis.model_zoo import (
    BACKBONE_CONFIGS,
    build_backbone,
    count_parameters,
    describe,
)
from lapformer_mm.cli import int_at_least, positive_float
from lapformer_mm.cpu_malloc import KEEP_BYTES, keep_large_blocks

REFERENCE = 'laplacianformer-t'
MODES = ('fwd', 'fwdbwd')
DEFAULT_MODELS = ('laplacianformer-t', 'laplacianformer-s', 'pvtv2-b1', 'pvtv2-b2', 'swin-t')


def run_once(model, images, mode):
    """One forward ('fwd') or forward + backward ('fwdbwd') call of ``model``."""
    if mode == 'fwd':
        with torch.no_grad():
            return model(images)
    outputs = model(images)
    loss = sum(out.float().mean() for out in outputs)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return None


def set_mode(model, mode):
    """eval() for 'fwd', train() for 'fwdbwd' (no chaining: some train() return None)."""
    if mode == 'fwd':
        model.eval()
    else:
        model.train()


def synchronize(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def timed_call(model, images, mode, device):
    """(wall seconds, process CPU seconds) of one call, synchronised on CUDA."""
    synchronize(device)
    start, start_cpu = time.perf_counter(), time.process_time()
    run_once(model, images, mode)
    synchronize(device)
    return time.perf_counter() - start, time.process_time() - start_cpu


def time_models(models, size, mode, repeats, device, skip):
    """{name: [(wall s, CPU s), ...]} for one size and mode, models interleaved per round.

    ``skip`` is a set of names not to run (too slow at a smaller size).
    """
    images = torch.randn(1, 3, *size, device=device)
    names = [n for n in models if n not in skip]
    times = {n: [] for n in names}
    for name in names:
        set_mode(models[name], mode)
        times[name].append(timed_call(models[name], images, mode, device))  # warm-up
    for round_index in range(repeats):
        shift = round_index % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            set_mode(models[name], mode)
            times[name].append(timed_call(models[name], images, mode, device))
    # The warm-up call is dropped when there are repeats.
    return {n: (t[1:] if len(t) > 1 else t) for n, t in times.items()}


def read_status_kb(key):
    """A /proc/self/status field in kB (e.g. 'VmHWM', 'VmRSS')."""
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'{key} not in /proc/self/status')


def measure_memory_here(name, size, mode, device):
    """Peak extra memory (MiB) of one call of ``name`` in this (fresh) process."""
    model = build_backbone(name).to(device)
    set_mode(model, mode)
    images = torch.randn(1, 3, *size, device=device)
    if device.type == 'cuda':
        return cuda_peak_memory(lambda: run_once(model, images, mode), device)[0] / 2 ** 20
    before = read_status_kb('VmRSS')
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    run_once(model, images, mode)
    return (read_status_kb('VmHWM') - before) / 1024


def _memory_child(name, size, mode, device, conn):
    """Child side of :func:`measure_memory`: send the MiB (or the error) back.

    One intra-op thread: GNU OpenMP thread pools do not survive fork, so a
    forked child must not start a parallel region with the parent's pool.
    """
    try:
        torch.set_num_threads(1)
        conn.send(('ok', measure_memory_here(name, size, mode, device)))
    except Exception as err:  # reported by the parent, which keeps going
        conn.send(('error', f'{type(err).__name__}: {err}'))
    finally:
        conn.close()


def measure_memory(name, size, mode, device, timeout):
    """:func:`measure_memory_here` in a forked child; (MiB or None, error or None).

    Forked, so the child inherits the imports and starts with the parent's
    small footprint; call this before the parent allocates large tensors (the
    child runs with one intra-op thread, see :func:`_memory_child`).
    """
    import multiprocessing
    context = multiprocessing.get_context('fork')
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_memory_child, args=(name, size, mode, device, sender))
    child.start()
    sender.close()
    if not receiver.poll(timeout):
        child.terminate()
        child.join()
        return None, f'timed out after {timeout:.0f} s'
    try:
        status, value = receiver.recv()
    except EOFError:
        status, value = 'error', 'child died (out of memory?)'
    child.join()
    return (value, None) if status == 'ok' else (None, value)


def planned_configs(args):
    """[(mode, size)] that the run will measure, in order."""
    return [(mode, size) for mode in args.modes for size in args.sizes
            if not (mode == 'fwdbwd' and args.fwdbwd_max_pixels
                    and size[0] * size[1] > args.fwdbwd_max_pixels)]


def cost_key(device):
    """The entry field compared across models: CPU time on CPU, wall time on CUDA.

    On a shared CPU, process CPU time (with one intra-op thread) counts the work
    a model does and not the time it waits for a core; on CUDA the work runs
    asynchronously, so the synchronised wall time is the cost.
    """
    return 'median_cpu_s' if device.type == 'cpu' else 'median_s'


def summarise(runs, max_call_s, load, peak_mib):
    """Result entry of one (mode, size, model) from its [(wall, cpu), ...] runs."""
    walls, cpus = [w for w, _ in runs], [c for _, c in runs]
    return dict(median_s=statistics.median(walls), median_cpu_s=statistics.median(cpus),
                runs_s=walls, runs_cpu_s=cpus, load=load, slow=max(walls) > max_call_s,
                peak_mib=peak_mib)


def format_table(results, params, sizes, modes, key):
    """Markdown table per size and model: medians, ratio of ``key`` to REFERENCE, memory."""
    header = ['size', 'model', 'params (M)']
    for mode in modes:
        header += [f'{mode} wall (s)', f'{mode} CPU (s)', f'{mode} / LapF-T',
                   f'{mode} peak (MiB)']
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    for size in sizes:
        size_key = f'{size[0]}x{size[1]}'
        for name in params:
            if not any(name in results.get(m, {}).get(size_key, {}) for m in modes):
                continue
            row = [size_key, name, f'{params[name] / 1e6:.1f}']
            for mode in modes:
                entry = results.get(mode, {}).get(size_key, {}).get(name)
                ref = results.get(mode, {}).get(size_key, {}).get(REFERENCE)
                if entry is None:
                    row += ['-'] * 4
                    continue
                ratio = f'{entry[key] / ref[key]:.2f}' if ref else '-'
                mib = entry.get('peak_mib')
                row += [f"{entry['median_s']:.3f}", f"{entry['median_cpu_s']:.3f}", ratio,
                        f'{mib:.0f}' if mib is not None else '-']
            lines.append('| ' + ' | '.join(row) + ' |')
    return '\n'.join(lines)


def plot_costs(results, sizes, modes, key, path):
    """Median cost ``key`` (and peak memory, when measured) against megapixels, log-log -> PNG."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    with_memory = any(e.get('peak_mib') is not None for m in modes
                      for s in results.get(m, {}).values() for e in s.values())
    fig, axes = plt.subplots(1, 2 if with_memory else 1, figsize=(
        10.4 if with_memory else 5.2, 3.8), squeeze=False)
    axes = axes[0]
    styles = {'fwd': '-', 'fwdbwd': '--'}
    names = sorted({n for m in modes for s in results.get(m, {}).values() for n in s})
    for i, name in enumerate(names):
        for mode in modes:
            by_size = results.get(mode, {})
            points = sorted(((s[0] * s[1] / 1e6, by_size[f'{s[0]}x{s[1]}'][name])
                             for s in sizes if name in by_size.get(f'{s[0]}x{s[1]}', {})),
                            key=lambda point: point[0])
            if not points:
                continue
            axes[0].plot([p for p, _ in points], [e[key] for _, e in points], styles[mode],
                         marker='o', color=f'C{i}', label=f'{name} {mode}')
            mem = [(p, e['peak_mib']) for p, e in points if e.get('peak_mib') is not None]
            if mem:
                axes[1].plot([p for p, _ in mem], [m for _, m in mem], styles[mode],
                             marker='o', color=f'C{i}', label=f'{name} {mode}')
    axes[0].set_ylabel('median CPU time (s)' if key == 'median_cpu_s' else 'median latency (s)')
    if with_memory:
        axes[1].set_ylabel('peak extra memory (MiB)')
    ticks = []
    for megapixels in sorted(s[0] * s[1] / 1e6 for s in sizes):
        if not ticks or megapixels > 1.1 * ticks[-1]:  # 800x1333 and 1024x1024 share one
            ticks.append(megapixels)
    for ax in axes:
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xticks(ticks, [f'{t:.2f}' for t in ticks], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel('input megapixels (batch 1); slope 1 = linear in pixels')
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def region_label(name):
    """Profiler label of a submodule, or None: top levels, and attn/mlp merged per stage.

    'stem' -> 'region: stem'; 'stages.3' -> 'region: stages.3';
    'stages.3.blocks.0.attn' -> 'region: stages.3.attn'.
    """
    parts = name.split('.')
    if not name:
        return None
    if len(parts) <= 2:
        return 'region: ' + name
    if parts[-1] in ('attn', 'mlp', 'ffn'):
        return f"region: {'.'.join(parts[:2])}.{parts[-1]}"
    return None


def annotate_regions(model):
    """Hooks that wrap labelled submodules in profiler ranges; returns the handles."""
    stack, handles = [], []

    def enter(label):
        def hook(module, args):
            stack.append(torch.profiler.record_function(label))
            stack[-1].__enter__()
        return hook

    def leave(module, args, output):
        stack.pop().__exit__(None, None, None)

    for name, module in model.named_modules():
        label = region_label(name)
        if label is not None:
            handles.append(module.register_forward_pre_hook(enter(label)))
            handles.append(module.register_forward_hook(leave))
    return handles


def profile_model(name, size, device, rows=15):
    """torch.profiler tables of one forward of ``name`` after a warm-up.

    Returns (ops by self time, regions by total time), both as text.
    """
    from torch.profiler import ProfilerActivity, profile
    model = build_backbone(name).to(device)
    images = torch.randn(1, 3, *size, device=device)
    run_once(model, images, 'fwd')
    handles = annotate_regions(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    with profile(activities=activities) as prof:
        run_once(model, images, 'fwd')
    for handle in handles:
        handle.remove()
    device_key = 'cuda' if device.type == 'cuda' else 'cpu'
    averages = prof.key_averages()
    ops = averages.table(sort_by=f'self_{device_key}_time_total', row_limit=rows)
    regions = sorted((e for e in averages if e.key.startswith('region: ')),
                     key=lambda e: -getattr(e, f'{device_key}_time_total'))
    # Self times of all events add up to the whole forward.
    total = sum(getattr(e, f'self_{device_key}_time_total') for e in averages)
    lines = [f'{"region":40s} {"total ms":>10s} {"share":>7s}']
    for e in regions:
        t = getattr(e, f'{device_key}_time_total')
        lines.append(f'{e.key[8:]:40s} {t / 1e3:10.1f} {100 * t / max(total, 1):6.1f}%')
    return ops, '\n'.join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=list(DEFAULT_MODELS),
                        choices=sorted(BACKBONE_CONFIGS))
    parser.add_argument('--sizes', nargs='+', type=parse_size,
                        default=[(512, 512), (800, 1333), (1024, 1024), (2048, 2048)])
    parser.add_argument('--modes', nargs='+', default=list(MODES), choices=MODES)
    parser.add_argument('--fwdbwd-max-pixels', type=int_at_least(0), default=1024 * 1024,
                        help='skip fwdbwd above this many pixels (CPU time); 0 = no limit')
    parser.add_argument('--skip', nargs='+', default=[], metavar='MODEL@HxW',
                        help='configs not to run, e.g. pvtv2-b1@2048x2048 (memory)')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--max-call-s', type=positive_float, default=300.0,
                        help='a model with a timed call (not the warm-up) slower than this at '
                             'one size is not run at the later --sizes, in list order, of the '
                             'same mode')
    parser.add_argument('--threads', type=int_at_least(0), default=None,
                        help='intra-op threads (default or 0: torch default)')
    parser.add_argument('--device', type=parse_device, default='cpu',
                        help='cpu (default), cuda or cuda:N')
    parser.add_argument('--memory', action='store_true',
                        help='peak memory per config, one forked child each')
    parser.add_argument('--memory-timeout', type=float, default=900.0)
    parser.add_argument('--plot', default=None, help='PNG of cost against resolution')
    parser.add_argument('--json', default=None, help='write all results here')
    parser.add_argument('--from-json', metavar='JSON',
                        help='print the table and draw the plot of a saved run, run nothing')
    parser.add_argument('--profile', choices=sorted(BACKBONE_CONFIGS),
                        help='print a torch.profiler table of this model at each size and exit')
    parser.add_argument('--glibc-malloc-defaults', action='store_true',
                        help="CPU: keep glibc's default mmap/trim thresholds (see the module "
                        'doc)')
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f'--repeats must be >= 1, got {args.repeats}')
    if args.from_json:
        if not osp.isfile(args.from_json):
            parser.error(f'--from-json: no such file: {args.from_json!r}')
        return args  # nothing runs: the device need not exist here
    problem = device_problem(args.device)
    if problem:
        parser.error(f'--device {args.device}: {problem}')
    for item in args.skip:
        name, _, size = item.partition('@')
        if name not in BACKBONE_CONFIGS or not size:
            parser.error(f'--skip entries must be MODEL@HxW with MODEL in '
                         f'{sorted(BACKBONE_CONFIGS)}, got {item!r}')
        parse_size(size)
    return args


def growth(results, mode, name, small, large, key):
    """Cost ratio large/small of one model, or None when either is missing."""
    by_size = results.get(mode, {})
    a = by_size.get(f'{small[0]}x{small[1]}', {}).get(name)
    b = by_size.get(f'{large[0]}x{large[1]}', {}).get(name)
    return b[key] / a[key] if a and b else None


def git_commit():
    """HEAD of the repository this tool runs from, or None (layouts change between commits)."""
    import subprocess
    try:
        return subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True,
                              cwd=osp.dirname(osp.abspath(__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def report_saved_run(path, plot):
    """Print the table (and draw ``plot``) of a JSON written by ``--json``."""
    with open(path) as f:
        saved = json.load(f)
    results, params, info = saved['results'], saved['params'], saved['info']
    key = info.get('compared', 'median_cpu_s' if info['device'] == 'cpu' else 'median_s')
    modes = [m for m in MODES if m in results]
    sizes = sorted({parse_size(k) for m in modes for k in results[m]},
                   key=lambda s: s[0] * s[1])
    # Runs saved before the machine was recorded lack it.
    where = f", {info['machine']}" if 'machine' in info else ''
    print(f"# {info['started']} device={info['device']} threads={info['threads']}{where}, load "
          f"average before: {info['load_before']}, after timing: {info.get('load_after_timing')}")
    print(format_table(results, params, sizes, modes, key))
    if plot:
        plot_costs(results, sizes, modes, key, plot)
        print(f'wrote {plot}')


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.from_json:
        report_saved_run(args.from_json, args.plot)
        return
    malloc = 'glibc defaults'
    if device.type == 'cpu' and not args.glibc_malloc_defaults and keep_large_blocks():
        malloc = f'glibc mmap/trim thresholds {KEEP_BYTES} bytes'
    print(f'# CPU allocator: {malloc}', flush=True)
    if args.profile:
        for size in args.sizes:
            ops, regions = profile_model(args.profile, size, device)
            print(f'== {args.profile} forward at {size[0]}x{size[1]} on {device}, '
                  f'{torch.get_num_threads()} thread(s), load {load_average()}')
            print(ops)
            print(regions)
        return
    memory = {}
    if args.memory:
        # Before any model exists here, so each forked child starts small.
        for mode, size in planned_configs(args):
            for name in args.models:
                if f'{name}@{size[0]}x{size[1]}' in args.skip:
                    continue
                mib, error = measure_memory(name, size, mode, device, args.memory_timeout)
                memory[(mode, f'{size[0]}x{size[1]}', name)] = mib
                print(f'memory {mode} {size[0]}x{size[1]} {name}: '
                      f'{error or f"{mib:.0f} MiB"}', flush=True)
    models = {n: build_backbone(n).to(device) for n in args.models}
    params = {n: count_parameters(m) for n, m in models.items()}
    info = dict(device=str(device), threads=torch.get_num_threads(), torch=torch.__version__,
                machine=machine(), malloc=malloc,
                git_commit=git_commit(), layouts={n: describe(m) for n, m in models.items()},
                memory_method=None if not args.memory else (
                    'torch.cuda.max_memory_allocated' if device.type == 'cuda' else
                    'VmHWM - VmRSS of one call in a forked child, /proc/self/clear_refs reset'),
                load_before=load_average(), started=time.strftime('%Y-%m-%d %H:%M:%S %Z'))
    print(f"# {info['started']} device={device} threads={info['threads']} "
          f"torch {info['torch']}, {info['machine']}, "
          f"load average before: {info['load_before']}", flush=True)
    results = {}
    for mode, size in planned_configs(args):
        key = f'{size[0]}x{size[1]}'
        too_slow = {n for n in args.models
                    if any(e.get(n, {}).get('slow') for e in results.get(mode, {}).values())
                    or f'{n}@{key}' in args.skip}
        times = time_models(models, size, mode, args.repeats, device, too_slow)
        for name, runs in times.items():
            entry = summarise(runs, args.max_call_s, load_average(),
                              memory.get((mode, key, name)))
            results.setdefault(mode, {}).setdefault(key, {})[name] = entry
            print(f'{mode} {key} {name}: wall {[round(w, 2) for w, _ in runs]} s, '
                  f'CPU {[round(c, 2) for _, c in runs]} s (load {entry["load"]})', flush=True)
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(dict(info=info, params=params, results=results), f, indent=1)
    info['load_after_timing'] = load_average()
    info['finished'] = time.strftime('%Y-%m-%d %H:%M:%S %Z')
    print(f"# load average after timing: {info['load_after_timing']}")
    key = cost_key(device)
    info['compared'] = key
    print(format_table(results, params, args.sizes, args.modes, key))
    for name in args.models:
        ratio = growth(results, 'fwd', name, (1024, 1024), (2048, 2048), key)
        if ratio is not None:
            print(f'{name}: fwd {key} 2048x2048 / 1024x1024 = {ratio:.2f} (pixels x4)')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(info=info, params=params, results=results), f, indent=1)
    if args.plot:
        os.makedirs(osp.dirname(osp.abspath(args.plot)), exist_ok=True)
        plot_costs(results, args.sizes, args.modes, key, args.plot)
        print(f'wrote {args.plot}')

if __name__ == '__main__':
    main()
