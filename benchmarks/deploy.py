"""ONNX Runtime CPU latency of exported backbones beside PyTorch eager (docs/deploy.md).

Exports LaplacianFormer-T, mmdet's PVTv2-b1 and Swin-T (random weights, eval mode) the
same way (:func:`lapformer_mm.deploy.export_onnx`: one exporter, static SIZE, batch 1,
the default fp64 refinement residual) and times, in this one process, each model's ONNX
Runtime session and its eager forward (``torch.no_grad``) with one intra-op thread and
with all of them, models interleaved per round; the table has the median of
``--repeats`` calls after one warm-up and each model's ratio to LaplacianFormer-T. A
model that does not export is reported with the exporter's error. The load average is
printed before and after.

``--precision`` instead prints the accuracy of the two refinement-residual precisions of
the export form (fp64, fp32) against a dense fp64 evaluation, on the inputs of
``benchmarks/numerics.py`` (error against conditioning), and of a whole exported
backbone against eager fp64.

    python benchmarks/deploy.py --size 800x1333 --repeats 3 --json bench_deploy.json
    python benchmarks/deploy.py --precision
"""
import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from devtools.timing import load_average, parse_size
from lapformer_mm import deploy
from lapformer_mm.analysis.model_zoo import build_backbone
from lapformer_mm.cpu_malloc import keep_large_blocks

REFERENCE = 'laplacianformer-t'
DEFAULT_MODELS = ('laplacianformer-t', 'pvtv2-b1', 'swin-t')


def export_all(names, size, exporter, folder):
    """{name: (model, onnx path or None, export seconds, error text or None)}."""
    results = {}
    for name in names:
        model = build_backbone(name)
        path = os.path.join(folder, f'{name}.onnx')
        start = time.perf_counter()
        try:
            deploy.export_onnx(deploy.ExportModule(model), path, shape=size, exporter=exporter)
            error = None
        except Exception as err:  # report any exporter failure and go on with the others
            path, error = None, f'{type(err).__name__}: {str(err).splitlines()[0][:300]}'
        seconds = time.perf_counter() - start
        print(f'# export {name}: {"ok" if error is None else error} ({seconds:.0f} s)',
              flush=True)
        results[name] = (model, path, seconds, error)
    return results


def time_round_robin(calls, repeats):
    """{key: [(wall s, process CPU s), ...]}: one warm-up each, then ``repeats`` rounds in
    rotated order (load changes hit every model alike)."""
    for fn in calls.values():
        fn()
    keys = list(calls)
    times = {k: [] for k in keys}
    for round_index in range(repeats):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            wall, cpu = time.perf_counter(), time.process_time()
            calls[key]()
            times[key].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def benchmark(args):
    keep_large_blocks()
    all_threads = torch.get_num_threads()
    info = dict(size=args.size, exporter=args.exporter, repeats=args.repeats,
                torch=torch.__version__, all_threads=all_threads,
                started=time.strftime('%Y-%m-%d %H:%M:%S %Z'), load_before=load_average())
    import onnxruntime
    info['onnxruntime'] = onnxruntime.__version__
    print(f"# {info['started']} torch {info['torch']} onnxruntime {info['onnxruntime']}, "
          f"exporter {args.exporter}, {args.size[0]}x{args.size[1]}, load average "
          f"{info['load_before']}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        exported = export_all(args.models, args.size, args.exporter, folder)
        x = deploy.example_input(args.size, 1)
        rows = {}
        for threads, label in ((1, '1 thread'), (None, f'{all_threads} threads')):
            torch.set_num_threads(threads or all_threads)
            calls = {}
            for name, (model, path, _, _) in exported.items():
                calls[(name, 'eager')] = lambda m=model: _eager(m, x)
                if path is not None:
                    session = deploy.ort_session(path, threads)
                    calls[(name, 'ort')] = lambda s=session: deploy.run_onnx(s, x)
            info[f'load_before_{label}'] = load_average()
            times = time_round_robin(calls, args.repeats)
            for (name, kind), runs in times.items():
                row = rows.setdefault(name, {})
                row[f'{kind} {label}'] = statistics.median(w for w, _ in runs)
                row[f'{kind} {label} cpu'] = statistics.median(c for _, c in runs)
                row[f'{kind} {label} runs'] = runs
            print(f'# {label} done, load average {load_average()}', flush=True)
        torch.set_num_threads(all_threads)
    info['load_after'] = load_average()
    info['exports'] = {n: dict(seconds=s, error=e) for n, (_, _, s, e) in exported.items()}
    info['rows'] = rows
    print(format_table(info))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(info, f, indent=1)
    return info


def _eager(model, x):
    with torch.no_grad():
        return model(x)


def format_table(info):
    """Median wall seconds per call (process CPU seconds in brackets for one thread)."""
    all_label = f"{info['all_threads']} threads"
    columns = [('ort', '1 thread'), ('eager', '1 thread'), ('ort', all_label),
               ('eager', all_label)]
    head = ('| model | ' + ' | '.join(f'{"ONNX Runtime" if k == "ort" else "eager"} '
                                      f'{label} (s)' for k, label in columns)
            + ' | ONNX Runtime 1 thread, PVTv2-b1 / model | eager 1 thread, PVTv2-b1 / '
              'model |')
    lines = [head, '|---' * (len(columns) + 3) + '|']
    rows = info['rows']
    base = rows.get('pvtv2-b1', {})
    for name, row in rows.items():
        cells = []
        for kind, label in columns:
            key = f'{kind} {label}'
            if key not in row:
                cells.append('does not export')
                continue
            cell = f'{row[key]:.3f}'
            if label == '1 thread':
                cell += f' ({row[key + " cpu"]:.3f})'
            cells.append(cell)
        for key in ('ort 1 thread', 'eager 1 thread'):
            ratio = base.get(key), row.get(key)
            cells.append(f'{ratio[0] / ratio[1]:.2f}' if all(ratio) else '—')
        lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
    lines.append(f"\nload average before {info['load_before']}, after {info['load_after']}")
    for name, export in info['exports'].items():
        if export['error']:
            lines.append(f"{name} does not export: {export['error']}")
    return '\n'.join(lines)


def precision_report():
    """Markdown tables: export-form error against conditioning, and at the backbone."""
    from benchmarks.numerics import EPS, LAM, SPREADS, WHITEN, dense_reference, inputs
    from lapformer_mm.ops import AttentionOptions, nystrom_attention
    from lapformer_mm.ops.export import residual_precision
    options = AttentionOptions(lam=LAM, eps=EPS, whiten_eps=WHITEN, impl='reference')
    lines = ['| spread | cond(P) | fp64 residual | fp32 residual |', '|---|---|---|---|']
    for spread in SPREADS:
        q, v, landmarks = inputs(spread)
        ref, cond = dense_reference(q, v, landmarks)
        errs = []
        for precision in ('fp64', 'fp32'):
            qf, vf, lf = q.float(), v.float(), landmarks.float()
            with residual_precision(precision):
                out = nystrom_attention(qf, qf, vf, lf, options, export=True)
            errs.append(((out.double() - ref).norm() / ref.norm()).item())
        lines.append(f'| {spread:g} | {cond:.3g} | {errs[0]:.1e} | {errs[1]:.1e} |')
    lines += ['', backbone_precision()]
    return '\n'.join(lines)


def backbone_precision(size=(448, 640)):
    """Whole LaplacianFormer-T exported with each residual precision, against eager fp64."""
    model = build_backbone(REFERENCE)
    module = deploy.ExportModule(model)
    module64 = copy.deepcopy(module).double()
    x = deploy.example_input(size, 1, seed=1)
    with torch.no_grad():
        ref64 = module64(x.double())
        eager = module(x)
    lines = [f'LaplacianFormer-T, random weights, {size[0]}x{size[1]}, batch 1, ONNX Runtime '
             'CPU: max |out - fp64| / max |fp64| per stage',
             '', '| | ' + ' | '.join(f'stage {i + 1}' for i in range(len(ref64))) + ' |',
             '|---' * (len(ref64) + 1) + '|']

    def cells(outs):
        return ' | '.join(f"{deploy.output_error([o], [r])['max_rel']:.1e}"
                          for o, r in zip(outs, ref64))

    lines.append(f'| eager fp32 | {cells(eager)} |')
    with tempfile.TemporaryDirectory() as folder:
        for precision in ('fp64', 'fp32'):
            path = os.path.join(folder, f'{precision}.onnx')
            deploy.export_onnx(module, path, shape=size, residual=precision)
            outs = deploy.run_onnx(deploy.ort_session(path), x)
            lines.append(f'| ONNX, {precision} residual | {cells(outs)} |')
    return '\n'.join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=list(DEFAULT_MODELS),
                        help=f'backbones (default: {" ".join(DEFAULT_MODELS)})')
    parser.add_argument('--size', type=parse_size, default=(800, 1333), help='HxW')
    parser.add_argument('--exporter', choices=deploy.EXPORTERS, default='dynamo')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--json', help='also write the results to this file')
    parser.add_argument('--precision', action='store_true',
                        help='print the accuracy of the refinement-residual precisions')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.precision:
        print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {load_average()}")
        print(precision_report())
        return 0
    benchmark(args)
    return 0


if __name__ == '__main__':
    sys.exit(main())
