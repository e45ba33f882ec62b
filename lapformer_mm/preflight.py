"""Check, before anything is built, that the files a config's run reads are there and usable
(a run without its data otherwise builds the model and dies deep in pycocotools or at the
first batch): :func:`check_config_inputs` raises :class:`InputCheckError` naming each missing
input, the expected layout and the ways forward. Remote paths are not checked.
"""
import os
import os.path as osp
from typing import List, Mapping, NamedTuple, Optional, Sequence

from . import checkpoint

# What each mode of a run reads: its dataloaders (val only with a val loop) and whether the
# backbone's init_cfg checkpoint (only training initialises the weights).
MODES = {'train': (('train', 'val'), True), 'val': (('val', ), False),
         'test': (('test', ), False)}
# data_prefix keys of mmengine, mmdet, mmseg and mmpretrain datasets, as the message names them.
PREFIX_ROLES = {'img': 'image folder', 'img_path': 'image folder', 'seg': 'label folder',
                'seg_map_path': 'label folder', 'ann_path': 'annotation folder'}
# mmpretrain's datasets whose `split` names the image folder when data_prefix is not given.
SPLIT_DATASETS = ('ImageNet', 'ImageNet21k')
README_SECTIONS = {'CocoDataset': 'Train and test on COCO',
                   'ADE20KDataset': 'Train and test on ADE20K',
                   'ImageNet': 'Pretrain on ImageNet-1k'}
CLS_CONFIGS = 'configs/cls/lapformer_{}_in1k.py'


class InputCheckError(RuntimeError):
    pass


class Input(NamedTuple):
    key: str            # where the config sets it, e.g. 'train_dataloader.dataset.ann_file'
    path: str           # as the run resolves it
    role: str           # 'annotation file', 'image folder', ...
    is_dir: bool
    owner: Optional[Mapping] = None  # the config dict that sets it (a dataset, an init_cfg)


class Problem(NamedTuple):
    item: Input
    reason: str
    kind: str           # 'data', 'checkpoint' (the backbone's) or 'load_from'


def is_remote(path: str, backend_args: Optional[Mapping] = None) -> bool:
    local = not backend_args or backend_args.get('backend', 'local') == 'local'
    return not local or checkpoint.is_remote(str(path))


def _join(data_root: Optional[str], path: str) -> str:
    # As mmengine's BaseDataset._join_prefix.
    return osp.join(data_root, path) if data_root and not osp.isabs(path) else path


def _dataset_leaves(dataset_cfg, key: str):
    """(key, cfg) of each dataset that reads files, through wrappers' dataset/datasets."""
    if not isinstance(dataset_cfg, Mapping):
        return
    inner = dataset_cfg.get('dataset')
    inners = dataset_cfg.get('datasets')
    if isinstance(inner, Mapping):
        yield from _dataset_leaves(inner, f'{key}.dataset')
    elif isinstance(inners, Sequence) and not isinstance(inners, str):
        for i, sub in enumerate(inners):
            yield from _dataset_leaves(sub, f'{key}.datasets.{i}')
    else:
        yield key, dataset_cfg


def dataset_inputs(dataset_cfg: Mapping, key: str) -> List[Input]:
    items = []
    for leaf_key, cfg in _dataset_leaves(dataset_cfg, key):
        if is_remote('', cfg.get('backend_args')):
            continue
        root = cfg.get('data_root') or ''
        if root:
            items.append(Input(f'{leaf_key}.data_root', root, 'data root', True, cfg))
        ann_file = cfg.get('ann_file')
        if ann_file:
            items.append(Input(f'{leaf_key}.ann_file', _join(root, ann_file),
                               'annotation file', False, cfg))
        prefixes = cfg.get('data_prefix') or {}
        split = cfg.get('split')
        if (not prefixes and isinstance(split, str) and split
                and str(cfg.get('type', '')).split('.')[-1] in SPLIT_DATASETS):
            items.append(Input(f'{leaf_key}.split', _join(root, split), 'image folder', True,
                               cfg))
        if isinstance(prefixes, str):  # mmpretrain's spelling of dict(img_path=...)
            prefixes = dict(img_path=prefixes)
        for name, prefix in prefixes.items():
            if isinstance(prefix, str) and (prefix or root):
                items.append(Input(f'{leaf_key}.data_prefix.{name}', _join(root, prefix),
                                   PREFIX_ROLES.get(name, f'{name} folder'), True, cfg))
    return [item for item in items if not is_remote(item.path)]


def evaluator_inputs(evaluator_cfg, key: str) -> List[Input]:
    metrics = evaluator_cfg if isinstance(evaluator_cfg, Sequence) else [evaluator_cfg]
    items = []
    for i, metric in enumerate(metrics):
        if not isinstance(metric, Mapping) or not metric.get('ann_file'):
            continue
        where = f'{key}.{i}' if metrics is evaluator_cfg else key
        if not is_remote(metric['ann_file'], metric.get('backend_args')):
            items.append(Input(f'{where}.ann_file', metric['ann_file'], 'annotation file',
                               False))
    return items


def split_inputs(cfg: Mapping, split: str) -> List[Input]:
    loader = cfg.get(f'{split}_dataloader')
    if not isinstance(loader, Mapping):
        return []
    if split != 'train' and (cfg.get(f'{split}_cfg') is None
                             or cfg.get(f'{split}_evaluator') is None):
        return []  # mmengine builds no val/test loop without all three parts
    items = dataset_inputs(loader.get('dataset') or {}, f'{split}_dataloader.dataset')
    if split != 'train':
        items += evaluator_inputs(cfg.get(f'{split}_evaluator'), f'{split}_evaluator')
    return items


def path_problem(item: Input) -> Optional[str]:
    if not osp.exists(item.path):
        return 'does not exist'
    if item.is_dir != osp.isdir(item.path):
        return 'is a file, not a folder' if item.is_dir else 'is a folder, not a file'
    if item.is_dir:
        with os.scandir(item.path) as entries:
            return 'is empty' if next(entries, None) is None else None
    return 'is empty' if osp.getsize(item.path) == 0 else None


def pretrained_checkpoint(model_cfg: Mapping) -> Optional[Input]:
    # A segmentor's pretrained too: mmseg hands it to the backbone.
    backbone_cfg = model_cfg['backbone']
    for key, owner in (('model.pretrained', model_cfg),
                       ('model.backbone.pretrained', backbone_cfg)):
        if owner.get('pretrained'):
            return Input(key, owner['pretrained'], 'checkpoint', False)
    from .models.backbone import init_cfg_entries
    from .models.pretrained import is_pretrained_cfg
    init_cfg = backbone_cfg.get('init_cfg')
    for i, cfg in enumerate(init_cfg_entries(init_cfg)):
        if is_pretrained_cfg(cfg) and cfg.get('checkpoint'):
            where = f'.{i}' if isinstance(init_cfg, list) else ''
            return Input(f'model.backbone.init_cfg{where}.checkpoint', cfg['checkpoint'],
                         'checkpoint', False, cfg)
    return None


def laplacianformer_mismatch(checkpoint_path: str, backbone_cfg: Mapping,
                             prefix: Optional[str]) -> Optional[str]:
    from .models import LaplacianFormer
    from .models.pretrained import backbone_mismatch, extract_backbone_state_dict

    with open(checkpoint_path, 'rb') as f:
        head = f.read(32)
    if not head.startswith(checkpoint.CHECKPOINT_MAGIC):
        return (f'is not a torch checkpoint (it starts with {head!r}; a web page saved by '
                'a failed download?)')
    try:
        state_dict = extract_backbone_state_dict(checkpoint.load_checkpoint(checkpoint_path),
                                                 prefix)
    except (RuntimeError, TypeError, ValueError) as err:
        return f'cannot be used: {err}'
    kwargs = {k: v for k, v in backbone_cfg.items()
              if k not in ('type', 'init_cfg', 'pretrained', '_scope_')}
    mismatch = backbone_mismatch(state_dict, LaplacianFormer(**kwargs).state_dict())
    return None if mismatch is None else f'does not fit model.backbone: {mismatch}'


def checkpoint_problems(cfg: Mapping) -> List[Problem]:
    backbone = (cfg.get('model') or {}).get('backbone')
    if not isinstance(backbone, Mapping):
        return []
    item = pretrained_checkpoint(cfg['model'])
    if item is None or is_remote(item.path):
        return []
    reason = path_problem(item)
    if reason is None and backbone.get('type') == 'LaplacianFormer':
        prefix = item.owner.get('prefix') if item.owner else None
        reason = laplacianformer_mismatch(item.path, backbone, prefix)
    return [Problem(item, reason, 'checkpoint')] if reason else []


def argument_problem(path: str, is_dir: bool = False) -> Optional[str]:
    """Why a file (or folder) given on a tool's command line cannot be read, or None."""
    return None if is_remote(path) else path_problem(Input('', path, '', is_dir))


def load_from_problems(cfg: Mapping) -> List[Problem]:
    load_from = cfg.get('load_from')
    if not load_from or is_remote(load_from):
        return []
    item = Input('load_from', load_from, 'checkpoint', False)
    reason = path_problem(item)
    return [Problem(item, reason, 'load_from')] if reason else []


def find_input_problems(cfg: Mapping, mode: str = 'train') -> List[Problem]:
    if mode not in MODES:
        raise ValueError(f'mode must be one of {sorted(MODES)}, got {mode!r}')
    splits, reads_init_checkpoint = MODES[mode]
    problems = []
    for split in splits:
        for item in split_inputs(cfg, split):
            reason = path_problem(item)
            if reason:
                problems.append(Problem(item, reason, 'data'))
    # A missing data root explains the paths under it: name only the root.
    roots = [p.item.path for p in problems if p.item.role == 'data root']
    problems = [p for p in problems if p.item.role == 'data root' or not any(
        p.item.path.startswith(osp.join(root, '')) for root in roots)]
    if reads_init_checkpoint:
        problems += checkpoint_problems(cfg)
    return problems + load_from_problems(cfg)


def data_root_options(cfg: Mapping, splits: Sequence[str], new_root) -> List[str]:
    """``--cfg-options`` (``key=value``) that move the data of ``splits`` to ``new_root(root)``
    of each dataset's ``data_root``; an evaluator's annotation file under it moves along."""
    options, moved = [], {}
    for split in splits:
        loader = cfg.get(f'{split}_dataloader')
        if not isinstance(loader, Mapping):
            continue
        for key, dataset in _dataset_leaves(loader.get('dataset'), f'{split}_dataloader.dataset'):
            root = dataset.get('data_root')
            if root:
                moved[osp.join(root, '')] = osp.join(new_root(root), '')
                options.append(f'{key}.data_root={moved[osp.join(root, "")]}')
        for item in evaluator_inputs(cfg.get(f'{split}_evaluator'), f'{split}_evaluator'):
            path = item.path
            for old, new in moved.items():
                if path.startswith(old):
                    path = new + path[len(old):]
            options.append(f'{item.key}={path}')
    return list(dict.fromkeys(options))


def _data_section(cfg: Mapping, splits: Sequence[str], problems: List[Problem]) -> List[str]:
    lines = ['', f'The data as this config reads it (relative paths start in {os.getcwd()}):']
    items = list({item.path: item for split in splits
                  for item in split_inputs(cfg, split)}.values())
    width = max(len(item.path) for item in items) + 3
    for item in items:
        path = osp.join(item.path, '') if item.is_dir else item.path
        lines.append(f'  {path:<{width}}{item.role}')
    types = sorted({str(p.item.owner.get('type')).split('.')[-1]
                    for p in problems if p.item.owner})
    sections = [f'README.md, "{README_SECTIONS[t]}"' for t in types if t in README_SECTIONS]
    lines += ['', 'Ways forward for the data:',
              f'  - get the data set: {" and ".join(sections) or "README.md"};']
    options = data_root_options(
        cfg, splits, lambda root: f'/path/to/{osp.basename(osp.normpath(root))}')
    if options:
        lines.append('  - the data is elsewhere: --cfg-options ' + ' '.join(options) + ';')
    if {'CocoDataset', 'ADE20KDataset'} & set(types):
        lines.append('  - to try the configs without the data: tools/smoke_fullsize.py writes '
                     'a few synthetic images in this layout and runs them (docs/full_size.md).')
    return lines


def _checkpoint_section(cfg: Mapping, problem: Problem) -> List[str]:
    arch = cfg['model']['backbone'].get('arch', 'tiny')
    cls_config = CLS_CONFIGS.format(arch[0].lower() if isinstance(arch, str) else '*')
    lines = ['', 'Ways forward for the backbone checkpoint:',
             f'  - pretrain it on ImageNet with {cls_config} (mmpretrain) and convert it with '
             'tools/convert_cls_to_backbone.py (README.md, "Use the backbone in your own '
             'config"; `make pretrain` runs that chain on toy data);',
             f'  - use one you have: --cfg-options {problem.item.key}=PATH;',
             # the deprecated pretrained itself, else the backbone's init_cfg
             '  - train from scratch: --cfg-options ' + (
                 f'{problem.item.key}=None' if problem.item.key.endswith('.pretrained')
                 else 'model.backbone.init_cfg=None')]
    if cfg.get('resume') or cfg.get('load_from'):
        lines[-1] += (' (this run resumes or loads a checkpoint, which replaces these '
                      'weights anyway)')
    return lines


def format_problems(cfg: Mapping, mode: str, problems: List[Problem]) -> str:
    name = getattr(cfg, 'filename', None) or 'the config'
    # One line per path: train and val often share a data root or a file.
    keys = {}
    for p in problems:
        keys.setdefault((p.item.role, p.item.path, p.reason), []).append(p.item.key)
    lines = [f'{name}: this {mode} run would miss {len(keys)} input(s):']
    for (role, path, reason), where in keys.items():
        lines.append(f'  - {role} {path!r} {reason} (set by {", ".join(where)})')
    data = [p for p in problems if p.kind == 'data']
    if data:
        lines += _data_section(cfg, MODES[mode][0], data)
    for p in problems:
        if p.kind == 'checkpoint':
            lines += _checkpoint_section(cfg, p)
        elif p.kind == 'load_from':
            lines += ['', f'Check the path of the checkpoint to load ({p.item.path!r}).']
    return '\n'.join(lines)


def check_config_inputs(cfg: Mapping, mode: str = 'train') -> None:
    """Raise :class:`InputCheckError` when a ``mode`` ('train', 'val', 'test') run of ``cfg``
    would miss an input."""
    problems = find_input_problems(cfg, mode)
    if problems:
        raise InputCheckError(format_problems(cfg, mode, problems))
