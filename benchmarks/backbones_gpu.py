"""GPU latency and peak memory of LaplacianFormer-T against timm's PVTv2-b1 and Swin-T.

A script, not a test. For each model, input size, mode and precision:

* ``fwd``: eval mode under ``torch.no_grad()``;
* ``fwdbwd``: train mode, loss = sum of the feature maps' means, backward;
* ``fp32`` (PyTorch's defaults: no TF32 for matmuls) or ``bf16`` autocast.

Timing: one untimed warm-up call (kernel compilation, cuDNN autotuning,
allocator), then ``--repeats`` calls timed with CUDA events; the median is
reported. Peak memory: ``torch.cuda.max_memory_allocated`` during one call
minus the memory allocated before it (the model's weights are excluded).

The baselines come from timm (random weights, ``features_only=True``, the
four stride-4..32 maps, as the detectors use them): ``pvt_v2_b1`` and
``swin_tiny_patch4_window7_224`` built for the input size with
``strict_img_size=False`` and its patch embedding's ``dynamic_img_pad`` on
(Swin pads the image to a multiple of its patch and each stage to whole
windows, as mmdet's Swin does). LaplacianFormer-T is the
backbone of this package, with the CuPy kernels (``LAPFORMER_OPS=cupy``) and,
for comparison, with the PyTorch reference ops (``laplacianformer-t-ref``).
timm is needed here, OpenMMLab is not (mmengine only, for the backbone's base
class).

    python3 benchmarks/backbones_gpu.py --out "$OUT" --sizes 800x1333 --batch 2

Writes ``bench_backbones.md`` and ``.json`` to ``--out``; exits 1 when any
row failed.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from devtools.profiling import cuda_peak_memory
from devtools.timing import parse_size, time_once

MODELS = ('laplacianformer-t', 'laplacianformer-t-ref', 'pvtv2-b1', 'swin-t')
MODES = ('fwd', 'fwdbwd')
PRECISIONS = ('fp32', 'bf16')


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs='+', default=list(MODELS), choices=MODELS)
    p.add_argument('--sizes', nargs='+', type=parse_size, default=[(800, 1333)], help='HxW')
    p.add_argument('--batch', type=int, default=2)
    p.add_argument('--modes', nargs='+', default=list(MODES), choices=MODES)
    p.add_argument('--precisions', nargs='+', default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument('--repeats', type=int, default=10)
    p.add_argument('--out', type=Path, default=None)
    return p.parse_args(argv)


def build(name, size):
    """(module, ops backend or None) on the GPU, random weights."""
    if name.startswith('laplacianformer'):
        from lapformer_mm.models.backbone import LaplacianFormer
        backend = 'reference' if name.endswith('-ref') else 'cupy'
        return LaplacianFormer(arch='tiny', drop_path_rate=0.0), backend
    import timm
    if name == 'pvtv2-b1':
        return timm.create_model('pvt_v2_b1', pretrained=False, features_only=True), None
    model = timm.create_model('swin_tiny_patch4_window7_224', pretrained=False, features_only=True,
                              img_size=size, strict_img_size=False)
    # Pad sizes that are not multiples of the patch (1333 = 4 * 333 + 1), as mmdet's Swin does.
    for module in model.modules():
        if hasattr(module, 'dynamic_img_pad'):
            module.dynamic_img_pad = True
    return model, None


def feature_loss(outputs):
    return sum(o.float().mean() for o in outputs)


def make_call(model, x, mode, precision):
    autocast = torch.autocast('cuda', dtype=torch.bfloat16, enabled=precision == 'bf16')

    def fwd():
        with torch.no_grad(), autocast:
            model(x)

    def fwdbwd():
        with autocast:
            loss = feature_loss(model(x))
        loss.backward()
    return fwd if mode == 'fwd' else fwdbwd


def time_call(fn, repeats):
    """Median, min and max milliseconds of ``repeats`` calls, CUDA events."""
    times = [time_once(fn, 'cuda') * 1e3 for _ in range(repeats)]
    return statistics.median(times), min(times), max(times)


def measure(name, size, args):
    rows = []
    try:
        model, backend = build(name, size)
    except Exception as exc:  # a missing/old timm names itself in the row
        return [dict(model=name, size=f'{size[0]}x{size[1]}',
                     status=f'build error: {type(exc).__name__}: {exc}'[:300])]
    if backend is not None:
        os.environ['LAPFORMER_OPS'] = backend
    model = model.cuda()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    gen = torch.Generator(device='cuda').manual_seed(0)
    x = torch.randn(args.batch, 3, *size, device='cuda', generator=gen)
    for mode in args.modes:
        model.train(mode == 'fwdbwd')
        for precision in args.precisions:
            row = dict(model=name, size=f'{size[0]}x{size[1]}', batch=args.batch, mode=mode,
                       precision=precision, params_m=round(params, 2))
            try:
                fn = make_call(model, x, mode, precision)
                fn()
                model.zero_grad(set_to_none=True)
                row['peak_mib'] = cuda_peak_memory(fn)[0] / 2 ** 20
                model.zero_grad(set_to_none=True)
                row['ms'], row['ms_min'], row['ms_max'] = time_call(fn, args.repeats)
                model.zero_grad(set_to_none=True)
                row['status'] = 'ok'
            except Exception as exc:
                row['status'] = f'error: {type(exc).__name__}: {exc}'[:300]
            rows.append(row)
            print(format_row(row), flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


COLUMNS = ('model', 'size', 'batch', 'mode', 'precision', 'params_m', 'ms', 'ms_min', 'ms_max',
           'peak_mib', 'status')


def format_row(row):
    def cell(v):
        if v is None:
            return '-'
        return f'{v:.1f}' if isinstance(v, float) else str(v)
    return '| ' + ' | '.join(cell(row.get(c)) for c in COLUMNS) + ' |'


def environment():
    props = torch.cuda.get_device_properties(0)
    info = dict(date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
                command=' '.join(sys.argv), gpu=props.name, torch=torch.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
                cudnn_tf32=torch.backends.cudnn.allow_tf32)
    for package in ('timm', 'cupy'):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = None
    return info


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        raise SystemExit('backbones_gpu.py needs a CUDA device')
    env = environment()
    print('\n'.join(f'# {k}: {v}' for k, v in env.items()))
    print('| ' + ' | '.join(COLUMNS) + ' |')
    rows = [row for size in args.sizes for name in args.models for row in measure(name, size, args)]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        lines = ['# GPU backbone benchmark', ''] + [f'- {k}: {v}' for k, v in env.items()]
        lines += ['', '| ' + ' | '.join(COLUMNS) + ' |', '|' + '---|' * len(COLUMNS)]
        lines += [format_row(r) for r in rows]
        (args.out / 'bench_backbones.md').write_text('\n'.join(lines) + '\n')
        (args.out / 'bench_backbones.json').write_text(
            json.dumps(dict(env=env, rows=rows), indent=1))
    failed = [r for r in rows if r['status'] != 'ok']
    if failed:
        print(f'backbones_gpu: {len(failed)} row(s) failed', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
