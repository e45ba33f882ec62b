"""The op layer's shape: imports go one way, the reference is a leaf, two registered ops."""
import ast
import graphlib
from pathlib import Path

import torch
from _shared import ROOT

PACKAGE = Path(ROOT) / 'lapformer_mm'


def _imports():
    """{module: {modules of lapformer_mm it imports}}, module- and function-level imports both."""
    modules = {'.'.join(p.relative_to(ROOT).with_suffix('').parts).removesuffix('.__init__'): p
               for p in PACKAGE.rglob('*.py')}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == '__init__.py' else name.rpartition('.')[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ''
                if node.level:
                    anchor = package.split('.')[:len(package.split('.')) - node.level + 1]
                    base = '.'.join(anchor + ([base] if base else []))
                subs = {f'{base}.{a.name}' for a in node.names} & set(modules)
                targets.update(subs or {base})
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_imports_go_one_way_and_the_reference_is_a_leaf():
    graph = _imports()
    graphlib.TopologicalSorter(graph).prepare()  # a CycleError names the cycle
    assert graph['lapformer_mm.ops.reference'] == {'lapformer_mm.ops._checks'}
    for backend in ('cpu', 'cuda'):
        ours = graph[f'lapformer_mm.ops.backends.{backend}']
        assert ours <= {'lapformer_mm.ops.reference', 'lapformer_mm.ops.backends',
                        'lapformer_mm.ops.backends.cuda_plan'}, (backend, ours)
    # cli/ and analysis/ build on deploy, not the other way round.
    assert not [t for t in graph['lapformer_mm.deploy']
                if t.startswith(('lapformer_mm.cli', 'lapformer_mm.analysis'))]


def test_two_registered_ops_in_the_lapformer_mm_namespace():
    import lapformer_mm.ops  # noqa: F401 (registers)
    names = {op for op in dir(torch.ops.lapformer_mm) if not op.startswith('_')}
    assert names - {'name', 'dispatch'} == {'nystrom_attention', 'nystrom_attention_backward'}
