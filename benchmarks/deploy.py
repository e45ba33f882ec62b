"""ONNX Runtime CPU latency and accuracy of exported backbones (docs/deploy.md).

Speed (default): exports LaplacianFormer-T in three forms — the standard-domain file
before this change (``ReduceL1``, rebuilt here for the comparison), today's standard file
(``Abs → ReduceSum`` in token blocks), and the file with the ONNX Runtime op library
(``--ort-ops``; skipped with a note when the library is not built) — and mmdet's PVTv2-b1
(and any ``--models``) the same way (one exporter, static SIZE, batch 1, fp64 residual),
then times, in this one process, each ONNX Runtime session and each model's eager forward
with ``--threads`` intra-op threads, all interleaved per round; the table has the median
of ``--repeats`` calls after one warm-up and each file's speed-up over PVTv2-b1 and over
the file before. The load average is printed before, between and after.
``--all-optimizers`` adds a session per file with every ONNX Runtime graph optimizer (what
a plain ``InferenceSession`` runs), beside :func:`lapformer_mm.deploy.ort_session`'s.
``--profile`` then runs each file ``--repeats`` times more under ONNX Runtime's profiler
and prints where its time goes: the kernel milliseconds per call of each operator type.

``--parity``: per-stage accuracy of LaplacianFormer-T exported with dynamic sizes by both
exporters (standard and op-library files) and by a plain ``torch.export.export`` with
the user's ``Dim``s, at sizes the exports never saw, on natural-like inputs (``--inputs
toy``, default: toy COCO scenes, :func:`lapformer_mm.deploy.toy_image_input`; ``smooth``:
smooth random fields, :func:`lapformer_mm.deploy.smooth_input`): per stage the largest
max |out - fp64| / max |fp64| (``--norm l2``: ||out - fp64|| / ||fp64||) over ``--images``
inputs per size, beside eager fp32's own;
and eager fp32 against fp64 on white noise at 800×1344. Over one input the ratio of two
fp32 evaluations' errors is a draw with a wide spread (0.3-3x for files that round no
worse than eager, docs/deploy.md), so each cell takes the worst of several. Random weights
unless ``--checkpoint`` gives trained ones (any checkpoint whose backbone is
LaplacianFormer-T, e.g. ``make main``'s ``work_dirs/main_job/epoch_6.pth``).

``--precision``: the accuracy of the two refinement-residual precisions.

    python benchmarks/deploy.py --size 800x1333 --repeats 5 [--profile] [--all-optimizers]
    python benchmarks/deploy.py --parity --images 3 [--seed S] [--checkpoint CKPT] [--norm l2]
    python benchmarks/deploy.py --precision
"""
import argparse
import collections
import contextlib
import copy
import dataclasses
import json
import math
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

from devtools.timing import load_average, machine, parse_size
from lapformer_mm import deploy
from lapformer_mm.analysis.model_zoo import BACKBONE_CONFIGS, build_backbone
from lapformer_mm.cli import int_at_least
from lapformer_mm.cpu_malloc import keep_large_blocks
from lapformer_mm.models.attention import LaplacianAttention
from lapformer_mm.ops import export as ops_export
from lapformer_mm.ops import reference

REFERENCE = 'laplacianformer-t'
BASELINE = 'pvtv2-b1'
DEFAULT_MODELS = ('laplacianformer-t', 'pvtv2-b1')
#: The forms of REFERENCE's file: (label, ort_ops, the ℓ1 form before this change).
FORMS = (('standard, before', False, True), ('standard', False, False),
         ('op library', True, False))


@contextlib.contextmanager
def previous_l1_form():
    """The standard file's ℓ1 kernel as it was before: ``ReduceL1`` of the differences, all
    tokens at once (the baseline of the speed table; the project no longer writes it)."""
    current = reference.similarity_export

    def reduce_l1(x, y, lam, kind, chunk=reference.LANDMARK_CHUNK):
        if kind != 'laplacian':
            return current(x, y, lam, kind, chunk)
        step = y.shape[-2] if chunk is None else chunk
        xt, yt = x.transpose(-1, -2).unsqueeze(-3), y.unsqueeze(-1)
        parts = [torch.linalg.vector_norm(xt - yt[..., i:i + step, :, :], ord=1, dim=-2)
                 for i in range(0, y.shape[-2], step)]
        dist = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
        return torch.exp(dist * (-1.0 / lam)).transpose(-1, -2)

    placeholder = ops_export.pairwise_placeholder
    reference.similarity_export = ops_export.pairwise_placeholder = reduce_l1
    try:
        yield
    finally:
        reference.similarity_export, ops_export.pairwise_placeholder = current, placeholder


#: The label suffix of a session with all of ONNX Runtime's graph optimizers (--all-optimizers).
ALL_OPTIMIZERS = 'all optimizers'


@contextlib.contextmanager
def every_optimizer():
    """Sessions made within leave out none of ONNX Runtime's graph optimizers, as a session
    made without :func:`lapformer_mm.deploy.ort_session` does."""
    disabled = deploy.ORT_DISABLED_OPTIMIZERS
    deploy.ORT_DISABLED_OPTIMIZERS = []
    try:
        yield
    finally:
        deploy.ORT_DISABLED_OPTIMIZERS = disabled


def export_all(names, size, exporter, folder):
    """[(label, name, model, onnx path or None, export seconds, error or None)]."""
    results = []
    try:
        deploy.ort_ops_library()
        have_library = True
    except FileNotFoundError as err:
        have_library = False
        print(f'# op library not built, its file is skipped: {err}', flush=True)
    for name in names:
        model = build_backbone(name)
        forms = FORMS if name == REFERENCE else (('standard', False, False), )
        for form, ort_ops, before in forms:
            if ort_ops and not have_library:
                continue
            label = name if name != REFERENCE else f'{name}, {form}'
            path = os.path.join(folder, f'{name}-{len(results)}.onnx')
            start = time.perf_counter()
            try:
                with previous_l1_form() if before else contextlib.nullcontext():
                    deploy.export_onnx(deploy.ExportModule(model), path, shape=size,
                                       exporter=exporter, ort_ops=ort_ops)
                error = None
            except Exception as err:  # report any exporter failure and go on
                path, error = None, f'{type(err).__name__}: {str(err).splitlines()[0][:300]}'
            seconds = time.perf_counter() - start
            print(f'# export {label}: {"ok" if error is None else error} ({seconds:.0f} s)',
                  flush=True)
            results.append((label, name, model, path, seconds, error))
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
                threads=args.threads, torch=torch.__version__, machine=machine(),
                started=time.strftime('%Y-%m-%d %H:%M:%S %Z'), load_before=load_average())
    import onnxruntime
    info['onnxruntime'] = onnxruntime.__version__
    print(f"# {info['started']} torch {info['torch']} onnxruntime {info['onnxruntime']}, "
          f"{info['machine']}, exporter {args.exporter}, {args.size[0]}x{args.size[1]}, "
          f"load average {info['load_before']}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        exported = export_all(args.models, args.size, args.exporter, folder)
        x = deploy.example_input(args.size, 1)
        rows = {}
        for threads in args.threads:
            label = f'{threads} thread' + ('s' if threads > 1 else '')
            torch.set_num_threads(threads)
            calls = {}
            for row_label, name, model, path, _, _ in exported:
                calls.setdefault((name, 'eager'), lambda m=model: _eager(m, x))
                if path is not None:
                    session = deploy.ort_session(path, threads)
                    calls[(row_label, 'ort')] = lambda s=session: deploy.run_onnx(s, x)
                    if args.all_optimizers:
                        with every_optimizer():
                            session = deploy.ort_session(path, threads)
                        calls[(f'{row_label}, {ALL_OPTIMIZERS}', 'ort')] = (
                            lambda s=session: deploy.run_onnx(s, x))
            info[f'load_before_{label}'] = load_average()
            times = time_round_robin(calls, args.repeats)
            for (row_label, kind), runs in times.items():
                row = rows.setdefault(row_label, {})
                row[f'{kind} {label}'] = statistics.median(w for w, _ in runs)
                row[f'{kind} {label} cpu'] = statistics.median(c for _, c in runs)
                row[f'{kind} {label} runs'] = runs
            print(f'# {label} done, load average {load_average()}', flush=True)
        torch.set_num_threads(all_threads)
        if args.profile:
            info['profile'] = {
                row_label: profile_by_op(path, x, args.threads[0], args.repeats, folder)
                for row_label, _, _, path, _, _ in exported if path is not None}
    info['load_after'] = load_average()
    info['exports'] = {label: dict(seconds=s, error=e) for label, _, _, _, s, e in exported}
    info['rows'] = rows
    print(format_table(info))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(info, f, indent=1)
    return info


def profile_by_op(path, x, threads, repeats, folder):
    """{operator type: kernel milliseconds per call} of the ONNX file at ``path``, largest
    first, from ONNX Runtime's profiler over ``repeats`` calls after a warm-up."""
    session = deploy.ort_session(path, threads, profile=os.path.join(folder, 'profile'))
    for _ in range(repeats + 1):
        deploy.run_onnx(session, x)
    with open(session.end_profiling()) as f:
        events = json.load(f)
    runs = sorted((e['ts'], e['ts'] + e['dur']) for e in events if e.get('name') == 'model_run')
    warm = runs[0][1]  # the warm-up's end: its first-touch costs are left out
    totals = collections.Counter()
    for event in events:
        if (event.get('cat') == 'Node' and event['name'].endswith('_kernel_time')
                and event['ts'] >= warm):
            totals[event['args']['op_name']] += event['dur']
    return {op: us / (len(runs) - 1) / 1e3 for op, us in totals.most_common()}


def format_profile(profile, top=8):
    """One line per file: its kernel time per call and its ``top`` operator types."""
    lines = ['kernel ms per call by operator type (ONNX Runtime profiler, after a warm-up):']
    for label, ops in profile.items():
        cells = ', '.join(f'{op} {ms:.0f}' for op, ms in list(ops.items())[:top])
        lines.append(f'- {label}: {sum(ops.values()):.0f} ms of kernels; {cells}')
    return '\n'.join(lines)


def _eager(model, x):
    with torch.no_grad():
        return model(x)


def format_table(info):
    """Median wall seconds per call (process CPU seconds in brackets), and speed-ups."""
    before = f'{REFERENCE}, standard, before'
    lines = []
    for threads in info['threads']:
        label = f'{threads} thread' + ('s' if threads > 1 else '')
        key = f'ort {label}'
        lines += [f'| file ({label}) | ONNX Runtime (s) | eager (s) | PVTv2-b1 / file | '
                  'before / file |', '|---|---|---|---|---|']
        rows = info['rows']
        base, old = rows.get(BASELINE, {}).get(key), rows.get(before, {}).get(key)
        for name, row in rows.items():
            if key not in row:
                continue
            eager = rows.get(name.split(',')[0], {}).get(f'eager {label}')
            cells = [f'{row[key]:.3f} ({row[key + " cpu"]:.3f})',
                     f'{eager:.3f}' if eager else '—',
                     f'{base / row[key]:.2f}' if base else '—',
                     f'{old / row[key]:.2f}' if old else '—']
            lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
        lines.append('')
    lines.append(f"load average before {info['load_before']}, after {info['load_after']}")
    for name, export in info['exports'].items():
        lines.append(f"export {name}: " + (export['error'] or f"{export['seconds']:.0f} s"))
    if 'profile' in info:
        lines += ['', format_profile(info['profile'])]
    return '\n'.join(lines)


#: The parity table's control row: eager fp32 with the attention's reference implementation.
CONTROL = 'eager fp32, impl=reference (control)'
#: The natural-like inputs of the parity table: (batch, 3, H, W) of a size, a batch and a seed.
PARITY_INPUTS = {'toy': deploy.toy_image_input, 'smooth': deploy.smooth_input}


def _l2_error(out, ref):
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


#: --norm: (its name in the tables, error of one stage's output against its fp64 value).
PARITY_NORMS = {
    'max': ('max |out - fp64| / max |fp64|',
            lambda out, ref: deploy.output_error([out], [ref])['max_rel']),
    'l2': ('||out - fp64|| / ||fp64||', _l2_error),
}


def parity_report(export_shape=(512, 640), sizes=((480, 736), (608, 800), (800, 1344)),
                  seed=3, inputs='toy', images=3, checkpoint=None, norm='max'):
    """Markdown: per-stage error against eager fp64 of each exported form.

    Each cell is the largest over ``images`` inputs of kind ``inputs`` (:data:`PARITY_INPUTS`)
    per size, seeds ``seed``, ``seed + 1``, ...; the backbone's weights from ``checkpoint``
    (random without one); each error in ``norm`` (:data:`PARITY_NORMS`). The TorchScript
    files and the torch.export program first, then the dynamo files (the slowest to
    export); each group's rows are printed as soon as they are measured.
    """
    from torch.export import Dim
    model = build_backbone(REFERENCE, checkpoint=checkpoint)
    module = deploy.ExportModule(model)
    module64 = copy.deepcopy(module).double()
    try:
        deploy.ort_ops_library()
        ort_forms = (False, True)
    except FileNotFoundError:
        ort_forms = (False, )
    make_input = PARITY_INPUTS[inputs]
    stage_error = PARITY_NORMS[norm][1]
    # [size][image]: the fp64 outputs, and per form its per-stage errors against them.
    batches = [[make_input(size, 1, seed=seed + i) for i in range(images)] for size in sizes]
    with torch.no_grad():
        refs = [[list(module64(x.double())) for x in xs] for xs in batches]
    errors = [{} for _ in sizes]

    def record(label, run):
        with torch.no_grad():
            for xs, size_refs, size_errors in zip(batches, refs, errors):
                size_errors[label] = [
                    [stage_error(o, r) for o, r in zip(run(x), ref)]
                    for x, ref in zip(xs, size_refs)]

    record('eager fp32', lambda x: list(module(x)))
    # The control: eager fp32 once more, the attention in ATen's plain-PyTorch reference
    # (what the exported graphs compute) instead of the C++ kernels; no export involved.
    control = copy.deepcopy(module)
    for layer in control.modules():
        if isinstance(layer, LaplacianAttention):
            layer.options = dataclasses.replace(layer.options, impl='reference')
    record(CONTROL, lambda x: list(control(x)))

    def measure(runners):
        for label, run in runners.items():
            record(label, run)
        print(format_parity(sizes, errors, inputs, images, norm), flush=True)

    with tempfile.TemporaryDirectory() as folder:
        for exporter in ('torchscript', 'dynamo'):
            runners = {}
            for ort_ops in ort_forms:
                label = f'ONNX Runtime, {exporter}' + (', op library' if ort_ops else '')
                path = os.path.join(folder, f'{exporter}-{ort_ops}.onnx')
                start = time.perf_counter()
                deploy.export_onnx(module, path, shape=export_shape, batch=2, dynamic=True,
                                   exporter=exporter, ort_ops=ort_ops)
                print(f'# exported {label} ({time.perf_counter() - start:.0f} s)', flush=True)
                runners[label] = lambda x, s=deploy.ort_session(path): deploy.run_onnx(s, x)
            if exporter == 'torchscript':
                # As a user writes it: plain Dims, a static batch of 2 (the case that failed).
                start = time.perf_counter()
                dims = {2: Dim('h', min=224, max=2048), 3: Dim('w', min=224, max=2048)}
                program = torch.export.export(
                    model, (make_input(export_shape, 2), ), dynamic_shapes=(dims, ))
                print(f'# torch.export ({time.perf_counter() - start:.0f} s)', flush=True)
                runners['torch.export (user Dims)'] = (
                    lambda x, p=program.module(): [o[:1] for o in p(x.expand(2, -1, -1, -1))])
            measure(runners)
    x = deploy.example_input((800, 1344), 1, seed=seed)
    with torch.no_grad():
        errs = [stage_error(o, r) for o, r in zip(module(x), module64(x.double()))]
    return (format_parity(sizes, errors, inputs, images, norm) + '\n\n800x1344, white noise: '
            'eager fp32 against fp64 per stage: ' + ', '.join(f'{e:.1e}' for e in errs))


def format_parity(sizes, errors, inputs, images, norm='max'):
    """Markdown tables of :func:`parity_report`'s errors: the worst over the images per
    stage, and its ratio to eager fp32's worst; then how many cells exceed 1.5×."""
    lines, over, cells_total, control_over = [], 0, 0, 0
    for size, size_errors in zip(sizes, errors):
        worst = {label: [max(stage) for stage in zip(*per_image)]
                 for label, per_image in size_errors.items()}
        eager = worst['eager fp32']
        lines += [f'{size[0]}x{size[1]}, {inputs} inputs, the worst of {images}: '
                  f"{PARITY_NORMS[norm][0]} (in brackets: / eager fp32's)", '',
                  '| | ' + ' | '.join(f'stage {i + 1}' for i in range(len(eager))) + ' |',
                  '|---' * (len(eager) + 1) + '|']
        for label, errs in worst.items():
            if label == CONTROL:
                control_over += sum(e > 1.5 * b for e, b in zip(errs, eager))
            elif label != 'eager fp32':
                over += sum(e > 1.5 * b for e, b in zip(errs, eager))
                cells_total += len(errs)
            cells = [f'{e:.1e}' + ('' if label == 'eager fp32' else f' ({e / b:.2f})')
                     for e, b in zip(errs, eager)]
            lines.append(f'| {label} | ' + ' | '.join(cells) + ' |')
        lines.append('')
    lines.append(f'cells above 1.5x eager fp32: {over} of {cells_total} exported; the '
                 f'control: {control_over} of {sum(len(e["eager fp32"][0]) for e in errors)}')
    # Paired, per image: a form that rounds no worse than eager has a geometric mean near 1
    # or below, whatever the spread of single draws.
    labels = [label for label in errors[0] if label != 'eager fp32']
    lines += ['', f'geometric mean over the {len(sizes) * images} (size, image) pairs of '
              "error / eager fp32's on the same image:", '',
              '| | ' + ' | '.join(f'stage {i + 1}' for i in range(len(errors[0]['eager fp32'][0])))
              + ' |', '|---' * (len(errors[0]['eager fp32'][0]) + 1) + '|']
    for label in labels:
        ratios = [[math.log(e / b) for e, b in zip(form, eager)]
                  for size_errors in errors
                  for form, eager in zip(size_errors[label], size_errors['eager fp32'])]
        means = [math.exp(statistics.fmean(stage)) for stage in zip(*ratios)]
        lines.append(f'| {label} | ' + ' | '.join(f'{m:.2f}' for m in means) + ' |')
    return '\n'.join(lines)


def precision_report():
    """Markdown tables: export-form error against conditioning, and at the backbone."""
    from benchmarks.numerics import EPS, LAM, SPREADS, WHITEN, dense_reference, inputs
    from lapformer_mm.ops import AttentionOptions, nystrom_attention
    from lapformer_mm.ops.export import ExportForm
    options = AttentionOptions(lam=LAM, eps=EPS, whiten_eps=WHITEN, impl='reference')
    lines = ['| spread | cond(P) | fp64 residual | fp32 residual |', '|---|---|---|---|']
    for spread in SPREADS:
        q, v, landmarks = inputs(spread)
        ref, cond = dense_reference(q, v, landmarks)
        errs = []
        for precision in ('fp64', 'fp32'):
            qf, vf, lf = q.float(), v.float(), landmarks.float()
            out = nystrom_attention(qf, qf, vf, lf, options, export=ExportForm(precision))
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


#: Options of one mode only (argparse dests): the others would ignore them.
SPEED_OPTIONS = ('models', 'size', 'exporter', 'repeats', 'threads', 'json', 'all_optimizers',
                 'profile')
PARITY_OPTIONS = ('inputs', 'norm', 'images', 'checkpoint')
_UNSET = object()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=list(DEFAULT_MODELS),
                        choices=sorted(BACKBONE_CONFIGS), metavar='MODEL',
                        help=f'backbones, of {", ".join(sorted(BACKBONE_CONFIGS))} (default: '
                             f'{" ".join(DEFAULT_MODELS)})')
    parser.add_argument('--size', type=parse_size, default=(800, 1333), help='HxW')
    parser.add_argument('--exporter', choices=deploy.EXPORTERS, default='dynamo')
    parser.add_argument('--repeats', type=int_at_least(1), default=3)
    parser.add_argument('--threads', type=int_at_least(1), nargs='+', default=[1],
                        help='intra-op thread counts to time (default: 1)')
    parser.add_argument('--json', help='also write the results to this file')
    parser.add_argument('--all-optimizers', action='store_true',
                        help='also time each file with all of ONNX Runtime\'s graph optimizers '
                             '(deploy.ort_session leaves out deploy.ORT_DISABLED_OPTIMIZERS)')
    parser.add_argument('--profile', action='store_true',
                        help="then each file's kernel time per operator type (ONNX Runtime's "
                             'profiler, the first --threads count)')
    parser.add_argument('--parity', action='store_true',
                        help='print the per-stage accuracy of the exported forms')
    parser.add_argument('--inputs', choices=sorted(PARITY_INPUTS), default='toy',
                        help='--parity inputs: toy COCO scenes (default) or smooth fields')
    parser.add_argument('--norm', choices=sorted(PARITY_NORMS), default='max',
                        help="--parity error of a stage's map: its largest difference (max, "
                             'default) or the whole map\'s (l2), relative to fp64\'s')
    parser.add_argument('--images', type=int, default=3,
                        help='--parity inputs per size; each cell is their worst (default 3)')
    parser.add_argument('--seed', type=int,
                        help='torch.manual_seed first: the same random weights each run '
                             '(default: new ones)')
    parser.add_argument('--checkpoint',
                        help='--parity: trained LaplacianFormer-T weights (default: random)')
    parser.add_argument('--precision', action='store_true',
                        help='print the accuracy of the refinement-residual precisions')
    args = parser.parse_args(argv)
    if args.images < 1:
        parser.error(f'--images must be >= 1, got {args.images}')
    # Parsed again over a namespace that already holds every mode-specific dest: argparse
    # leaves those not on the command line as they are, which tells them from defaults.
    given = parser.parse_args(argv, argparse.Namespace(
        **dict.fromkeys(SPEED_OPTIONS + PARITY_OPTIONS, _UNSET)))

    def refuse(mode, options):
        named = ['--' + o.replace('_', '-') for o in options if getattr(given, o) is not _UNSET]
        if named:
            parser.error(f'not used by {mode}: {", ".join(named)}')

    if args.parity and args.precision:
        parser.error('--parity and --precision: one mode per run')
    if args.parity or args.precision:
        refuse('--parity' if args.parity else '--precision', SPEED_OPTIONS)
    if not args.parity:
        refuse('--precision' if args.precision else 'the speed table (no --parity)',
               PARITY_OPTIONS)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    if args.parity:
        print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {machine()}, load average "
              f"{load_average()}")
        print(parity_report(inputs=args.inputs, images=args.images, norm=args.norm,
                            checkpoint=args.checkpoint))
        print(f'# load average {load_average()}')
        return 0
    if args.precision:
        print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {machine()}, load average "
              f"{load_average()}")
        print(precision_report())
        return 0
    benchmark(args)
    return 0


if __name__ == '__main__':
    sys.exit(main())
