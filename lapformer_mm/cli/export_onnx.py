"""Export a detector's or segmentor's backbone, features or raw outputs to one ONNX file;
``--verify`` prints its error in ONNX Runtime against PyTorch beside how far rounding moves
eager fp32 (docs/deploy.md). Needs the ``[deploy]`` extra.
"""
import argparse
import os.path as osp
import sys
import time

from mmengine.config import DictAction

from lapformer_mm import deploy
from lapformer_mm.cli import int_at_least, output_path
from lapformer_mm.ops.export import RESIDUAL_PRECISIONS

VERIFY_INPUTS = {'toy': 'toy COCO scenes', 'smooth': 'smooth random fields',
                 'noise': 'white noise'}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Export a model to ONNX')
    parser.add_argument('config', help='mmdet or mmseg config file')
    parser.add_argument('checkpoint', nargs='?', default=None,
                        help='checkpoint file (default: random weights)')
    parser.add_argument('--target', choices=deploy.TARGETS, default='model',
                        help="'backbone', 'features' (backbone + neck) or 'model' (raw head "
                             'outputs, no post-processing; default)')
    parser.add_argument('--shape', type=int, nargs=2, default=(800, 1344),
                        metavar=('H', 'W'), help='example input size (default 800 1344)')
    parser.add_argument('--batch', type=int, default=1, help='example batch (default 1)')
    parser.add_argument('--dynamic', action='store_true',
                        help='symbolic batch, height and width instead of the example sizes')
    parser.add_argument('--exporter', choices=deploy.EXPORTERS, default='dynamo',
                        help='torch.onnx.export(dynamo=True) (default) or the TorchScript '
                             'exporter (dynamo=False)')
    parser.add_argument('--residual', choices=RESIDUAL_PRECISIONS, default='fp64',
                        help="the attention's refinement residual: fp64 (default) or fp32 "
                             '(no fp64 tensor: OpenVINO, TensorRT, mobile runtimes)')
    parser.add_argument('--opset', type=int, default=deploy.DEFAULT_OPSET,
                        help=f'ONNX opset (default {deploy.DEFAULT_OPSET}; lowest: '
                             f'{deploy.LOWEST_OPSET})')
    parser.add_argument('--ort-ops', action='store_true',
                        help="each attention as the ONNX Runtime op library's nodes "
                             '(tools/build_ort_ops.py): a file only ONNX Runtime with the '
                             'library runs')
    parser.add_argument('--out', help='output file, or a folder for the default name '
                                      '(<config name>_<target>.onnx)')
    parser.add_argument('--verify', action='store_true',
                        help='print the error of the file in ONNX Runtime against PyTorch')
    parser.add_argument('--verify-input', choices=VERIFY_INPUTS, default='toy',
                        help=f'what --verify feeds: {VERIFY_INPUTS} (default toy)')
    parser.add_argument('--verify-images', type=int_at_least(1), default=1, metavar='N',
                        help='inputs per size for --verify (default 1)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out = output_path(args.out, f'{osp.splitext(osp.basename(args.config))[0]}_'
                                f'{args.target}.onnx')
    start = time.perf_counter()
    try:
        module, names = deploy.export_config(
            args.config, out, checkpoint=args.checkpoint, target=args.target,
            cfg_options=args.cfg_options, shape=tuple(args.shape), batch=args.batch,
            dynamic=args.dynamic, exporter=args.exporter, residual=args.residual,
            opset=args.opset, ort_ops=args.ort_ops)
        nodes = len(deploy._import('onnx').load(out, load_external_data=False).graph.node)
        print(f'wrote {out} ({osp.getsize(out) / 2 ** 20:.1f} MB, {nodes} nodes, opset '
              f'{args.opset}, {args.exporter} exporter, '
              f'{"dynamic" if args.dynamic else "static"} shape, '
              f'{time.perf_counter() - start:.0f} s); outputs: {", ".join(names)}')
        if not args.verify:
            return 0
        sizes = (deploy.verify_sizes(args.shape, deploy.export_min_size(module))
                 if args.dynamic else [tuple(args.shape)])
        rows = deploy.verify_onnx(out, module, sizes, batch=args.batch,
                                  inputs=args.verify_input, images=args.verify_images)
    # OSError: --ort-ops without the library, or one ONNX Runtime refuses; RuntimeError:
    # torch's (an example below the export range, a checkpoint's tensors of another shape).
    except (ValueError, OSError, ImportError, RuntimeError) as err:
        print(f'export_onnx: {err}', file=sys.stderr)
        return 2
    print(f'ONNX Runtime against PyTorch eager on {VERIFY_INPUTS[args.verify_input]}'
          f'{"" if args.dynamic else " at the export size (a static file)"} (max rel: largest '
          'error / largest output value, the largest over the outputs):')
    print(deploy.format_rows(rows))
    wrong = deploy.wrong_rows(rows)
    if wrong:
        sizes = ', '.join(f"{r['size'][0]}x{r['size'][1]} ({r['max_rel']:.1e} against "
                          f"{r['rounding_rel']:.1e})" for r in wrong)
        print(f'export_onnx: the file is off by more than {deploy.WRONG_FACTOR:g}x what '
              f'rounding moves eager fp32 at {sizes}: it does not compute the model '
              'there (a size fixed in the trace? see docs/deploy.md)', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
