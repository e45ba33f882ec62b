"""``import lapformer_mm`` registers and does nothing else (each check a fresh interpreter)."""
import json
import subprocess
import sys

import pytest
from _shared import ROOT

# Every global of these modules and attribute of their classes, by identity before and after
# the import: a replaced one is a changed id (the objects the plugin used to patch named).
SNAPSHOT = r'''
import importlib, inspect, json, sys, warnings

warnings.simplefilter('ignore')  # deprecated torch aliases warn when inspected

import torch  # noqa: F401
import mmengine.fileio.backends.local_backend
import mmengine.fileio.io
import mmengine.hooks
import mmengine.runner
import mmengine.runner._flexible_runner
import mmengine.runner.checkpoint
import mmengine.runner.runner
from mmengine.registry import Registry, root

preload = sys.argv[1:]
for name in preload:
    importlib.import_module(name)
PREFIXES = ('mmengine', 'mmcv', 'mmdet', 'mmseg', 'mmpretrain', 'torch')
# What torch's registration APIs change: add_safe_globals rebinds this set, torch.library
# adds the ops' namespace.
ALLOWED = {'torch._weights_only_unpickler._marked_safe_globals_set', 'torch.ops.lapformer_mm'}


def snapshot():
    ids = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(PREFIXES):
            continue
        for key, value in list(vars(module).items()):
            ids[f'{name}.{key}'] = id(value)
            if inspect.isclass(value) and value.__module__ == name:
                for attr, member in list(vars(value).items()):
                    ids[f'{name}.{key}.{attr}'] = id(member)
    from mmengine.runner.checkpoint import CheckpointLoader
    ids.update({f'CheckpointLoader scheme {p!r}': id(f)
                for p, f in CheckpointLoader._schemes.items()})
    ids.update({f'fileio prefix {p!r}': id(b)
                for p, b in mmengine.fileio.io.prefix_to_backends.items()})
    for registry_name, registry in vars(root).items():
        if isinstance(registry, Registry):
            ids.update({f'{registry_name}[{k!r}]': id(v)
                        for k, v in registry.module_dict.items()})
    return ids


def changes(after):
    # Replaced, and added to a module or class that was there (a method shadowing an
    # inherited one, say); modules the import loads are not compared.
    owners = {k.rsplit('.', 1)[0] for k in before}
    return sorted(k for k in after.keys() | before.keys()
                  if after.get(k) != before.get(k) and k not in ALLOWED
                  and (k in before or k.rsplit('.', 1)[0] in owners))


before = snapshot()
import lapformer_mm  # noqa: E402
changed = changes(snapshot())
loaded = sorted(m for m in ('mmdet', 'mmseg', 'mmpretrain', 'mmcv.ops')
                if m in sys.modules and m not in preload)
# What the plugin used to do to mmengine, and two torch replacements, done here after the
# import: the same comparison must name each of them.
mmengine.runner.runner.find_latest_checkpoint = lambda path: None
mmengine.fileio.backends.local_backend.LocalBackend.put = lambda *a: None
mmengine.hooks.CheckpointHook._save_checkpoint_with_step = lambda *a: None
mmengine.runner.checkpoint.CheckpointLoader.register_scheme('', lambda f, m: None, force=True)
torch.nn.functional.linear = lambda *a: None
torch.Tensor.contiguous = lambda self: self
print(json.dumps(dict(changed=changed, loaded=loaded, checked=len(before),
                      seen_patches=changes(snapshot()))))
'''


def import_report(*preload, script=SNAPSHOT):
    """The report ``script`` prints in a fresh interpreter that first imports ``preload``."""
    proc = subprocess.run([sys.executable, '-c', script, *preload], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_replaces_nothing_in_torch_or_mmengine_and_imports_no_codebase():
    report = import_report()
    assert report['changed'] == []
    assert report['loaded'] == []
    # A floor against a snapshot that silently covers nothing; the patches made after the
    # import show the names the plugin used to patch are among those compared.
    assert report['checked'] > 50000
    assert report['seen_patches'] == [
        "CheckpointLoader scheme ''",
        'mmengine.fileio.backends.local_backend.LocalBackend.put',
        'mmengine.hooks.checkpoint_hook.CheckpointHook._save_checkpoint_with_step',
        'mmengine.runner.checkpoint.CheckpointLoader._schemes',
        'mmengine.runner.runner.find_latest_checkpoint',
        'torch.Tensor.contiguous',
        'torch.nn.functional.linear']


@pytest.mark.slow
def test_import_replaces_nothing_in_the_codebases_already_loaded():
    """With mmcv.ops, mmdet, mmseg and their registries loaded first, as in a training job."""
    report = import_report('mmcv.ops', 'mmdet.registry', 'mmdet.models', 'mmseg.registry',
                           'mmseg.models')
    assert report['changed'] == []
    assert report['checked'] > 20000


def test_import_adds_only_its_own_modules_to_a_loaded_mmengine():
    """With mmengine's runner loaded, the import adds its own modules only."""
    code = ('import sys, torch, mmengine.runner, mmengine.model, mmengine.hooks, '
            'mmengine.optim, mmengine.fileio\n'
            'before = set(sys.modules)\n'
            'import lapformer_mm\n'
            'print(sorted(m for m in set(sys.modules) - before '
            "if m.split('.')[0] != 'lapformer_mm'))")
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == '[]'


def test_parts_are_registered_in_mmengine_root_registries_the_backend_by_name_only():
    import mmengine.registry
    from mmengine.fileio.io import backends, prefix_to_backends

    import lapformer_mm  # noqa: F401
    from lapformer_mm.engine.fileio import AtomicLocalBackend
    for registry, name in [('MODELS', 'LaplacianFormer'), ('HOOKS', 'SafeCheckpointHook'),
                           ('HOOKS', 'NeckChannelsCheckHook'), ('HOOKS', 'InputCheckHook'),
                           ('RUNNERS', 'SafeCheckpointRunner'),
                           ('OPTIM_WRAPPERS', 'CPUAmpOptimWrapper')]:
        assert name in getattr(mmengine.registry, registry).module_dict
    assert backends['atomic_local'] is AtomicLocalBackend
    assert AtomicLocalBackend not in prefix_to_backends.values()
