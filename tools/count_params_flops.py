"""Parameters and FLOPs of the LaplacianFormer family as ImageNet classifiers.

Usage:
    python tools/count_params_flops.py [--arch tiny small ...] [--size 224]
        [--qk-shared | --no-qk-shared] [--stage4-attention softmax|laplacian]
        [--iters N] [--markdown]
    python tools/count_params_flops.py --arch medium --ns-residual 7 16

The classifier is the backbone + global average pooling + a 1000-class linear head;
the counting convention and the ``visible``/``full`` totals are those of
:mod:`lapformer_mm.analysis.flops`.

``--ns-residual`` instead prints how far Newton–Schulz gets on the landmark
systems P = k(L, L) + eps·I of a freshly initialised model (random 224² input,
batch 2, 7×7-landmark blocks only): median and max of ||I - P X||_inf after
each given number of iterations (the fp32 inverse's residual, evaluated in fp64).
"""
import argparse

from lapformer_mm.analysis.flops import classifier_cost
from lapformer_mm.analysis.landmark_solve import random_backbone_systems, solve_residual
from lapformer_mm.cli import int_at_least
from lapformer_mm.models import ARCH_SETTINGS
from lapformer_mm.models.backbone import ARCH_ALIASES
from lapformer_mm.ops import DEFAULT_NS_ITERS, newton_schulz_pinv

COLUMNS = ('arch', 'params (M)', 'backbone params (M)', 'GFLOPs visible', 'GFLOPs full',
           'kernel GFLOPs', 'solve GFLOPs')


def print_ns_residuals(arch, size, backbone_kwargs, iters):
    """Median and max of ||I - P X_t||_inf over the landmark systems of ``arch``."""
    p = random_backbone_systems(arch, size, backbone_kwargs)
    print(f'{arch}: {p.shape[0]} landmark systems of size {p.shape[-1]}')
    for t in iters:
        residual = solve_residual(p, newton_schulz_pinv(p, t), ord='inf')
        print(f'  {t:3d} iterations: median {residual.median().item():.2e}, '
              f'max {residual.max().item():.2e}')


def print_costs(archs, size, backbone_kwargs, markdown):
    if markdown:
        print('| ' + ' | '.join(COLUMNS) + ' |')
        print('|' + '---|' * len(COLUMNS))
    else:
        print(f'size {size}x{size}, options {backbone_kwargs or "defaults"}')
        print(' '.join(f'{c:>20}' for c in COLUMNS))
    for arch in archs:
        r = classifier_cost(arch, size, backbone_kwargs)
        cells = [arch, f"{r['params']:.2f}", f"{r['backbone_params']:.2f}",
                 f"{r['visible']:.2f}", f"{r['full']:.2f}", f"{r['kernel']:.3f}",
                 f"{r['solve']:.3f}"]
        if markdown:
            print('| ' + ' | '.join(cells) + ' |')
        else:
            print(' '.join(f'{c:>20}' for c in cells), flush=True)


def arch_name(text):
    """An ``argparse`` type: a name of ARCH_SETTINGS or its alias, kept as written."""
    if ARCH_ALIASES.get(text.lower(), text.lower()) not in ARCH_SETTINGS:
        raise argparse.ArgumentTypeError(f'expected one of {sorted(ARCH_SETTINGS)} (or '
                                         f'{sorted(ARCH_ALIASES)}), got {text!r}')
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--arch', nargs='+', type=arch_name, default=list(ARCH_SETTINGS))
    parser.add_argument('--size', type=int_at_least(1), default=224)
    parser.add_argument('--qk-shared', action=argparse.BooleanOptionalAction, default=None,
                        help='default: the backbone default')
    parser.add_argument('--stage4-attention', choices=['softmax', 'laplacian'], default=None)
    parser.add_argument('--iters', type=int_at_least(1), default=None,
                        help=f'Newton-Schulz iterations; default: the attention default '
                             f'({DEFAULT_NS_ITERS})')
    parser.add_argument('--markdown', action='store_true', help='print a markdown table')
    parser.add_argument('--ns-residual', type=int_at_least(1), nargs='+', metavar='ITERS',
                        help='print Newton-Schulz residuals after these iteration counts')
    args = parser.parse_args(argv)
    attn_cfg = {k: v for k, v in dict(qk_shared=args.qk_shared, iters=args.iters).items()
                if v is not None}
    kwargs = dict(attn_cfg=attn_cfg)
    if args.stage4_attention is not None:
        kwargs['stage4_attention'] = args.stage4_attention
    if args.ns_residual:
        for arch in args.arch:
            print_ns_residuals(arch, args.size, kwargs, args.ns_residual)
    else:
        print_costs(args.arch, args.size, kwargs, args.markdown)


if __name__ == '__main__':
    main()
