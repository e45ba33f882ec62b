"""GPU time, kernels and peak memory of LaplacianFormer-T against timm's PVTv2-b1 and Swin-T.

A script, not a test (tools/gpu_check.sh runs it). For each model, mode, dtype and
whether the call is replayed from a CUDA graph:

* ``fwd``: eval mode under ``torch.no_grad()``;
* ``fwdbwd``: train mode, loss = sum of the feature maps' means, backward (no optimiser);
* ``fp32`` (PyTorch's defaults: no TF32 for matmuls), ``bf16`` or ``fp16`` autocast (mmdet's
  ``--amp`` is fp16 autocast; no loss scaling is needed to time a step);
* ``graphed``: after a warm-up on a side stream, one call captured with
  ``torch.cuda.graph`` and replayed (the whole-network capture pattern).

Timing: warm-up calls (kernel compilation, cuDNN autotuning, allocator), then
``--repeats`` calls timed with CUDA events; the median is reported. ``launches``: GPU
kernels of one call (the profiler's CUDA kernel events, memcpy/memset excluded).
``peak_mib``: ``torch.cuda.max_memory_allocated`` during one eager call minus the memory
allocated before it (weights excluded); null for graphed rows, whose memory is the
graph's pool.

The baselines come from timm (random weights, ``features_only=True``, the four
stride-4..32 maps, as the detectors use them): ``pvt_v2_b1`` and
``swin_tiny_patch4_window7_224`` built for the input size with ``strict_img_size=False``
and its patch embedding's ``dynamic_img_pad`` on (Swin pads to whole patches and windows,
as mmdet's Swin does). LaplacianFormer-T is this package's backbone with impl='cupy' (the
fused attention op). timm is needed here, OpenMMLab is not (mmengine only, for the
backbone's base class).

    python3 benchmarks/backbones_gpu.py --json docs/cuda_results/backbones_h200.json

writes ``{"date", "device", "command", "rows": [{"model", "mode", "dtype", "graphed", "ms",
"launches", "peak_mib"}]}`` again after each row (a run stopped early keeps what it measured;
a markdown row on stdout each), then prints the table and the verdict of
issue #24's target: in every eager (mode, dtype) row LaplacianFormer-T takes at most 0.8x
the time of the faster of PVTv2-b1 and Swin-T. Exits 1 when a row failed to run (a missed
target is reported, not an error: ``--strict`` makes it one).
"""
import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from devtools.timing import parse_size, time_once

MODELS = ('laplacianformer-t', 'pvtv2-b1', 'swin-t')
BASELINES = ('pvtv2-b1', 'swin-t')
MODES = ('fwd', 'fwdbwd')
DTYPES = ('fp32', 'bf16', 'fp16')
TARGET_RATIO = 0.8
ROW_KEYS = ('model', 'mode', 'dtype', 'graphed', 'ms', 'launches', 'peak_mib')
_AUTOCAST = {'fp32': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs='+', default=list(MODELS), choices=MODELS)
    p.add_argument('--size', type=parse_size, default=(800, 1333), help='HxW')
    p.add_argument('--batch', type=int, default=2)
    p.add_argument('--modes', nargs='+', default=list(MODES), choices=MODES)
    p.add_argument('--dtypes', nargs='+', default=list(DTYPES), choices=DTYPES)
    p.add_argument('--graphed', nargs='+', default=['eager', 'graph'],
                   choices=['eager', 'graph'])
    p.add_argument('--repeats', type=int, default=10)
    p.add_argument('--json', type=Path, default=None, help='write the result rows here')
    p.add_argument('--strict', action='store_true', help='exit 1 when a target is missed')
    return p.parse_args(argv)


# ----------------------------------------------------------------------------
# Results: rows, the JSON file, the verdict (all tested on the CPU).
# ----------------------------------------------------------------------------

def make_row(model, mode, dtype, graphed, ms, launches=None, peak_mib=None):
    """One result row in the JSON format (values checked)."""
    if model not in MODELS or mode not in MODES or dtype not in DTYPES:
        raise ValueError(f'row ({model!r}, {mode!r}, {dtype!r}) outside {MODELS}, {MODES}, '
                         f'{DTYPES}')
    return dict(model=model, mode=mode, dtype=dtype, graphed=bool(graphed), ms=float(ms),
                launches=None if launches is None else int(launches),
                peak_mib=None if peak_mib is None else float(peak_mib))


def results_document(rows, device, command, date=None):
    """The JSON document: {"date": "YYYY-MM-DD", "device", "command", "rows"}."""
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return {'date': date, 'device': str(device), 'command': str(command),
            'rows': [{key: row[key] for key in ROW_KEYS} for row in rows]}


def write_results(path, rows, device, command, date=None):
    """Write :func:`results_document` to ``path`` (folders created); returns the document."""
    document = results_document(rows, device, command, date)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + '\n')
    return document


def verdicts(rows, ratio=TARGET_RATIO):
    """[(mode, dtype, ours ms, best baseline name, its ms, ours/best, verdict)] for every eager
    (mode, dtype) with a LaplacianFormer-T row; 'PASS' when ours <= ratio x the faster
    baseline, 'FAIL', or 'FAIL (not measured)' when a side is missing."""
    eager = {(r['model'], r['mode'], r['dtype']): r['ms'] for r in rows if not r['graphed']}
    out = []
    for mode in MODES:
        for dtype in DTYPES:
            ours = eager.get(('laplacianformer-t', mode, dtype))
            others = {name: eager[(name, mode, dtype)] for name in BASELINES
                      if (name, mode, dtype) in eager}
            if ours is None and not others:
                continue
            if ours is None or not others:
                out.append((mode, dtype, ours, None, None, None, 'FAIL (not measured)'))
                continue
            best = min(others, key=others.get)
            value = ours / others[best]
            out.append((mode, dtype, ours, best, others[best], value,
                        'PASS' if value <= ratio else 'FAIL'))
    return out


def markdown(rows, targets):
    lines = ['| model | mode | dtype | graphed | ms | launches | peak MiB |',
             '|---|---|---|---|---|---|---|']
    for r in rows:
        launches = '-' if r['launches'] is None else r['launches']
        peak = '-' if r['peak_mib'] is None else f"{r['peak_mib']:.0f}"
        lines.append(f"| {r['model']} | {r['mode']} | {r['dtype']} | {r['graphed']} | "
                     f"{r['ms']:.2f} | {launches} | {peak} |")
    lines += ['', f'Target: eager LaplacianFormer-T <= {TARGET_RATIO}x the faster baseline', '',
              '| mode | dtype | ours ms | faster baseline | its ms | ratio | verdict |',
              '|---|---|---|---|---|---|---|']
    for mode, dtype, ours, best, theirs, value, verdict in targets:
        def cell(v, fmt='{:.2f}'):
            return '-' if v is None else fmt.format(v) if isinstance(v, float) else str(v)
        lines.append(f'| {mode} | {dtype} | {cell(ours)} | {cell(best)} | {cell(theirs)} | '
                     f'{cell(value)} | {verdict} |')
    return '\n'.join(lines)


# ----------------------------------------------------------------------------
# Measurement (GPU).
# ----------------------------------------------------------------------------

def build(name, size):
    """The model on the GPU, random weights."""
    if name == 'laplacianformer-t':
        from lapformer_mm.models.backbone import LaplacianFormer
        return LaplacianFormer(arch='tiny', drop_path_rate=0.0, attn_cfg=dict(impl='cupy'))
    import timm
    if name == 'pvtv2-b1':
        return timm.create_model('pvt_v2_b1', pretrained=False, features_only=True)
    model = timm.create_model('swin_tiny_patch4_window7_224', pretrained=False,
                              features_only=True, img_size=size, strict_img_size=False)
    # Pad sizes that are not multiples of the patch (1333 = 4 * 333 + 1), as mmdet's Swin does.
    for module in model.modules():
        if hasattr(module, 'dynamic_img_pad'):
            module.dynamic_img_pad = True
    return model


def make_step(model, x, mode, dtype):
    """One call: forward (no grad) or forward + backward, under the dtype's autocast."""
    cast = _AUTOCAST[dtype]

    def autocast():
        return torch.autocast('cuda', dtype=cast or torch.float32, enabled=cast is not None)

    def fwd():
        with torch.no_grad(), autocast():
            return model(x)

    def fwdbwd():
        with autocast():
            loss = sum(o.float().mean() for o in model(x))
        loss.backward()
        return loss
    return fwd if mode == 'fwd' else fwdbwd


def graphed_step(model, step, warmups=3):
    """``step`` captured in a CUDA graph after warm-ups on a side stream; returns replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            model.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay, graph


def median_ms(fn, repeats):
    return statistics.median(time_once(fn, 'cuda') * 1e3 for _ in range(repeats))


def count_kernels(fn):
    """GPU kernels of one call of ``fn`` (profiler CUDA kernel events)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum('memcpy' not in n and 'memset' not in n for n in names)


def peak_mib(fn):
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / 2 ** 20


def measure(name, args, keep):
    """Measure one model's rows, each handed to ``keep`` as it is measured; returns a list of
    (row key, error) for calls that failed."""
    errors = []
    model = build(name, args.size).cuda()
    gen = torch.Generator(device='cuda').manual_seed(0)
    x = torch.randn(args.batch, 3, *args.size, device='cuda', generator=gen)
    for mode in args.modes:
        model.train(mode == 'fwdbwd')
        for dtype in args.dtypes:
            step = make_step(model, x, mode, dtype)
            for graphed in (g == 'graph' for g in args.graphed):
                key = (name, mode, dtype, graphed)
                try:
                    if graphed:
                        fn, graph = graphed_step(model, step)
                        peak = None
                    else:
                        for _ in range(2):
                            model.zero_grad(set_to_none=True)
                            step()
                        fn, graph = step, None
                        model.zero_grad(set_to_none=True)
                        peak = peak_mib(fn)
                    launches = count_kernels(fn)
                    row = make_row(name, mode, dtype, graphed, median_ms(fn, args.repeats),
                                   launches, peak)
                    del graph
                except Exception as exc:  # a row that fails is reported, the others still run
                    errors.append((key, f'{type(exc).__name__}: {exc}'[:300]))
                    print(f'# {key}: {errors[-1][1]}', flush=True)
                    continue
                finally:
                    model.zero_grad(set_to_none=True)
                keep(row)
                print(markdown([row], []).splitlines()[2], flush=True)
    del model
    torch.cuda.empty_cache()
    return errors


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit('backbones_gpu.py needs a CUDA device')
    device = torch.cuda.get_device_name(0)
    print(f'# {device}, torch {torch.__version__}, size {args.size}, batch {args.batch}')
    rows, errors = [], []
    command = 'python3 benchmarks/backbones_gpu.py ' + ' '.join(argv)

    def keep(row):
        rows.append(row)
        if args.json is not None:
            write_results(args.json, rows, device, command)
    for name in args.models:
        try:
            errors += measure(name, args, keep)
        except Exception as exc:  # a missing/old timm names itself
            errors.append(((name,), f'build error: {type(exc).__name__}: {exc}'[:300]))
            print(f'# {name}: {errors[-1][1]}', flush=True)
    targets = verdicts(rows)
    print(markdown(rows, targets))
    if errors:
        print(f'backbones_gpu: {len(errors)} row(s) failed', file=sys.stderr)
        return 1
    missed = [t for t in targets if t[-1] != 'PASS']
    return 1 if args.strict and missed else 0


if __name__ == '__main__':
    sys.exit(main())
