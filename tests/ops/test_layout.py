"""The op layer's shape: imports go one way, the reference is a leaf, two registered ops."""
import ast
from pathlib import Path

import torch
from _shared import ROOT

PACKAGE = Path(ROOT) / 'lapformer_mm'


def _module_name(path):
    parts = path.relative_to(ROOT).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _imports():
    """{module: {modules of lapformer_mm it imports}}, module- and function-level imports both."""
    modules = {_module_name(p): p for p in PACKAGE.rglob('*.py')}
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


def test_no_import_cycle_inside_the_package():
    graph = _imports()
    state = {}

    def visit(node, trail):
        state[node] = 'open'
        for target in sorted(graph[node]):
            assert state.get(target) != 'open', ' -> '.join(trail + [node, target])
            if target not in state:
                visit(target, trail + [node])
        state[node] = 'done'
    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_the_reference_imports_only_torch_and_the_checks():
    graph = _imports()
    assert graph['lapformer_mm.ops.reference'] == {'lapformer_mm.ops._checks'}
    for backend in ('cpu', 'cuda'):
        ours = graph[f'lapformer_mm.ops.backends.{backend}']
        assert ours <= {'lapformer_mm.ops.reference', 'lapformer_mm.ops.backends',
                        'lapformer_mm.ops.backends.cuda_plan'}, (backend, ours)


def test_two_registered_ops_in_the_lapformer_mm_namespace():
    import lapformer_mm.ops  # noqa: F401 (registers)
    names = {op for op in dir(torch.ops.lapformer_mm) if not op.startswith('_')}
    names -= {'name', 'dispatch'}
    assert names == {'nystrom_attention', 'nystrom_attention_backward'}


def test_deploy_imports_nothing_from_the_tools():
    """cli/ and analysis/ build on deploy, not the other way round."""
    tools = ('lapformer_mm.cli', 'lapformer_mm.analysis')
    assert not [t for t in _imports()['lapformer_mm.deploy'] if t.startswith(tools)]
