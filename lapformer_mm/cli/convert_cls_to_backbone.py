"""Turn an ImageNet classifier checkpoint into a LaplacianFormer backbone state dict.

CLS_CKPT is read with ``weights_only=True`` in any layout ``lapformer_mm.models.pretrained``
reads; OUT_PTH (a folder: ``<CLS_CKPT name>_backbone.pth``) gets the backbone tensors for a
``Pretrained`` init_cfg. With ``--arch`` they are checked against that backbone first.
"""
import argparse
import os
import os.path as osp
import sys

import torch

from lapformer_mm.checkpoint import CheckpointError, load_checkpoint
from lapformer_mm.cli import output_path
from lapformer_mm.models.backbone import STAGE4_ATTENTIONS
from lapformer_mm.models.pretrained import backbone_mismatch, extract_backbone_state_dict


def convert(src: str, dst: str, arch=None, stage4_attention: str = 'laplacian') -> dict:
    """Write the backbone tensors of ``src`` to ``dst``, first checked against ``arch`` when
    given (:func:`check_against_arch`); returns them."""
    state_dict = extract_backbone_state_dict(load_checkpoint(src))
    state_dict = {k: v.detach().clone().contiguous() for k, v in state_dict.items()}
    if arch is not None:
        state_dict = check_against_arch(state_dict, arch, stage4_attention)
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    # Opened here, a path that cannot be written is an OSError naming it, not torch's
    # "[enforce fail at inline_container.cc]".
    with open(dst, 'wb') as f:
        torch.save(dict(state_dict=state_dict, meta=dict(source=os.path.basename(src))), f)
    return state_dict


def check_against_arch(state_dict: dict, arch: str, stage4_attention: str = 'laplacian') -> dict:
    """The tensors of ``state_dict`` that a backbone of ``arch`` has, the keys it lacks or does
    not use printed; ValueError for a bad ``arch`` or a checkpoint that cannot initialise it."""
    from lapformer_mm.models import LaplacianFormer

    try:
        own = LaplacianFormer(arch, stage4_attention=stage4_attention).state_dict()
    except ValueError as err:
        raise ValueError(f'--arch: {err}' if 'stage4_attention' not in str(err) else
                         f'--stage4-attention: {err}') from None
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    wrong = sorted(k for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape)
    print(f'arch {arch}: {len(missing)} missing, {len(unexpected)} unexpected, '
          f'{len(wrong)} with another shape')
    for title, keys in (('missing', missing), ('unexpected', unexpected), ('shape', wrong)):
        for key in keys:
            print(f'  {title}: {key}')
    mismatch = backbone_mismatch(state_dict, own)
    if mismatch is not None:
        raise ValueError(f'the checkpoint does not fit --arch {arch!r} --stage4-attention '
                         f'{stage4_attention!r}: {mismatch}; nothing written')
    return {k: v for k, v in state_dict.items() if k in own}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('src', help='classifier checkpoint (path or URL)')
    parser.add_argument('dst', help='output .pth, or a folder for <src name>_backbone.pth')
    parser.add_argument('--arch', default=None, help='check the keys against this arch')
    parser.add_argument('--stage4-attention', default='laplacian',
                        choices=STAGE4_ATTENTIONS,
                        help="the classifier's stage4_attention, for --arch (default "
                             'laplacian)')
    args = parser.parse_args(argv)
    dst = output_path(args.dst, f'{osp.splitext(osp.basename(args.src))[0]}_backbone.pth')
    try:
        state_dict = convert(args.src, dst, args.arch, args.stage4_attention)
    # TypeError: a checkpoint that is no mapping.
    except (OSError, CheckpointError, ValueError, TypeError) as err:
        print(f'convert_cls_to_backbone: {err}', file=sys.stderr)
        return 2
    print(f'wrote {len(state_dict)} tensors '
          f'({sum(v.numel() for v in state_dict.values()) / 1e6:.2f} M values) to {dst}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
