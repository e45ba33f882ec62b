"""Per-stage error of LaplacianFormer-T (fused attention path) against its fp64 evaluation,
beside PVTv2-b1's, for fp32, bf16 and fp16 (autocast).

Random weights (seed 0), eval mode, one random image of ``--size``. The fp64 evaluation is
each model cast to fp64 (LaplacianFormer-T: the attention's reference math, which is what
fp64 runs). fp32 is the model in fp32; bf16 and fp16 are that model under the dtype's
autocast, as mmdet's ``--amp`` runs it. Per stage: max |out − out_fp64| / max |out_fp64|.

LaplacianFormer-T runs impl=None: on a GPU with CuPy the fused kernels
(ops/cuda/nystrom_attention.cu); with ``--emulate`` on the CPU the same kernels through the g++
emulation (devtools/cuda_emulation.py), at a size the CPU allows. PVTv2-b1 is timm's
``pvt_v2_b1`` (``--baseline timm``, the GPU machine) or mmdet's PyramidVisionTransformerV2
with the b1 settings (``--baseline mmdet``).

    python benchmarks/numerics_stages.py --device cuda --size 448x640 --baseline timm
    python benchmarks/numerics_stages.py --device cpu --emulate --size 64x96 --baseline mmdet
"""
import argparse
import copy
import datetime
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from devtools.timing import machine, parse_size

DTYPES = {'fp32': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default='cuda', choices=['cuda', 'cpu'])
    p.add_argument('--emulate', action='store_true',
                   help='CPU: run the CUDA kernels through the g++ emulation')
    p.add_argument('--size', type=parse_size, default=(448, 640), help='HxW')
    p.add_argument('--baseline', default='timm', choices=['timm', 'mmdet', 'none'])
    p.add_argument('--dtypes', nargs='+', default=list(DTYPES), choices=list(DTYPES))
    p.add_argument('--also-reference', action='store_true',
                   help="add LaplacianFormer-T rows with impl='reference' (the plain math)")
    return p.parse_args(argv)


def laplacianformer(impl=None):
    from lapformer_mm.models.backbone import LaplacianFormer
    torch.manual_seed(0)
    return LaplacianFormer(arch='tiny', drop_path_rate=0.0, attn_cfg=dict(impl=impl))


PATHS = {'cpu': 'the C++ CPU kernels', 'cupy': 'the fused CUDA kernels',
         'reference': 'the reference math'}


def path_of(model, device):
    """The implementation the model's attention runs on ``device`` (LAPFORMER_OPS, the
    kernels built or not), asked of the op's own selection."""
    from lapformer_mm.models.attention import LaplacianAttention
    from lapformer_mm.ops.attention import resolve_impl
    attention = next(m for m in model.modules() if isinstance(m, LaplacianAttention))
    q = torch.zeros(1, 1, 64, 32, device=device)
    return resolve_impl(q, q, q, torch.zeros(1, 1, 49, 32, device=device), attention.options)


def pvtv2_b1(baseline):
    torch.manual_seed(0)
    if baseline == 'timm':
        import timm
        return timm.create_model('pvt_v2_b1', pretrained=False, features_only=True)
    from lapformer_mm.analysis.model_zoo import build_backbone
    return build_backbone('pvtv2-b1')


def stage_errors(model, x, dtypes, device):
    """{dtype: [per-stage relative max error]} against the model in fp64."""
    model = model.eval()
    with torch.no_grad():
        reference = [o.double() for o in copy.deepcopy(model).double().to(device)(x.double())]
        fp32 = model.float().to(device)
        errors = {}
        for name in dtypes:
            cast = DTYPES[name]
            with torch.autocast(device, dtype=cast or torch.float32, enabled=cast is not None):
                outs = fp32(x)
            errors[name] = [((o.double() - r).abs().max() / r.abs().max()).item()
                            for o, r in zip(outs, reference)]
    return errors


def table(results):
    lines = ['| model | dtype | stage 1 | stage 2 | stage 3 | stage 4 |',
             '|---|---|---|---|---|---|']
    for model, errors in results.items():
        for dtype, values in errors.items():
            lines.append(f'| {model} | {dtype} | ' + ' | '.join(f'{v:.1e}' for v in values) + ' |')
    return '\n'.join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda needs a CUDA device')
    with tempfile.TemporaryDirectory(prefix='lapformer_emu_') as build_dir:
        return _measure(args, argv, build_dir)


def _measure(args, argv, build_dir):
    if args.emulate:
        from devtools.cuda_emulation import emulate
        emulate(build_dir)
    model = laplacianformer()
    path = PATHS[path_of(model, args.device)] + (', emulated on the CPU' if args.emulate else '')
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, *args.size, generator=gen).to(args.device)
    results = {f'LaplacianFormer-T ({path})': stage_errors(model, x, args.dtypes, args.device)}
    if args.also_reference:
        results['LaplacianFormer-T (reference math)'] = stage_errors(
            laplacianformer('reference'), x, args.dtypes, args.device)
    if args.baseline != 'none':
        results[f'PVTv2-b1 ({args.baseline})'] = stage_errors(pvtv2_b1(args.baseline), x,
                                                             args.dtypes, args.device)
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    print(f'# per-stage max |out - out_fp64| / max |out_fp64|, {args.size[0]}x{args.size[1]}, '
          f'random weights, {date}, torch {torch.__version__}, '
          f'{torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"}, {machine()}')
    print(f'# python benchmarks/numerics_stages.py {" ".join(argv)}\n')
    print(table(results))
    return 0


if __name__ == '__main__':
    sys.exit(main())
