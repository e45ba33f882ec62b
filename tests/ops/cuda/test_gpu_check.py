"""tools/gpu_check.sh on the CPU: ``STUB`` (the ``sitecustomize`` of every process the script
starts) reports an H100 to torch and stands devtools/fake_cupy.py in for CuPy."""
import ast
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _shared import ROOT

SCRIPT = Path(ROOT) / 'tools' / 'gpu_check.sh'
# Each starts the script or pytest in fresh processes (torch imported each time).
pytestmark = pytest.mark.slow(seconds=15)

STUB = '''
import hashlib
import json
import os
import sys
import types

import torch

from devtools.fake_cupy import FakeCupy

props = types.SimpleNamespace(name='NVIDIA H100 80GB HBM3', major=9, minor=0,
                              multi_processor_count=132,
                              shared_memory_per_block_optin=232448)
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda device=None: props
torch.cuda.get_device_name = lambda device=None: props.name
torch.cuda.is_current_stream_capturing = lambda: False


class device:
    def __init__(self, index):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


torch.cuda.device = device


class Disk:
    """CuPy's kernel cache as the fake's {(code, options): binary}, one file per entry."""

    def __init__(self, folder):
        self.folder = folder

    def path(self, key):
        return os.path.join(self.folder, hashlib.sha256(repr(key).encode()).hexdigest())

    def __contains__(self, key):
        return os.path.exists(self.path(key))

    def __getitem__(self, key):
        with open(self.path(key)) as f:
            return json.load(f)

    def __setitem__(self, key, value):
        os.makedirs(self.folder, exist_ok=True)
        with open(self.path(key), 'w') as f:
            json.dump(value, f)


cupy = FakeCupy(record=False, disk=Disk(os.environ['CUPY_CACHE_DIR']),
                version=os.environ.get('FAKE_CUPY_VERSION', '14.2.0'))
sys.modules['cupy'] = cupy
'''


# Loaded as ``sitecustomize`` too: every Python process the test starts finds them missing.
BLOCK = '''
import sys

BLOCKED = {blocked!r}


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)


sys.meta_path.insert(0, Blocked())
'''
OPENMMLAB = ('mmengine', 'mmcv', 'mmdet', 'mmseg', 'mmpretrain')


def blocking(folder, *modules):
    """A folder whose ``sitecustomize`` makes ``modules`` missing."""
    folder.mkdir()
    (folder / 'sitecustomize.py').write_text(BLOCK.format(blocked=set(modules)))
    return folder


def step_command(step):
    """The command of the script's ``run_step STEP`` call, "$PY" as this interpreter."""
    text = SCRIPT.read_text().replace('\\\n', ' ')
    variables = dict(re.findall(r'^(COMPILED_TEST)=(\S+)$', text, re.M))
    match = re.search(rf'^\s*run_step {step} "\$LIMIT_\w+" "\$OUT/[\w.]+" (.*)$', text, re.M)
    words = [variables.get(w[1:], w) if w.startswith('$') else w
             for w in shlex.split(match.group(1))]
    return [sys.executable if word == '$PY' else word for word in words]


def test_the_tests_step_collects_without_openmmlab_or_the_toy_data_writers_packages(tmp_path):
    """tests/conftest.py and tests/_shared.py load without what the GPU machine lacks."""
    stub = blocking(tmp_path / 'block', *OPENMMLAB, 'cv2', 'pycocotools')
    env = dict(os.environ, PYTHONPATH=f'{stub}{os.pathsep}{ROOT}')
    proc = subprocess.run(step_command('tests') + ['--collect-only'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Every test but the torch.compile one, which has a step of its own.
    assert re.search(r'^(\d+)/(\d+) tests collected \(1 deselected\)', proc.stdout, re.M), \
        proc.stdout[-4000:]
    assert 'torch_compile' not in proc.stdout


@pytest.fixture
def stub_gpu(tmp_path):
    folder = tmp_path / 'stub'
    folder.mkdir()
    (folder / 'sitecustomize.py').write_text(STUB)
    return folder


def run_script(stub, out, steps, path=None, **extra_env):
    env = dict(os.environ, OUT=str(out), STEPS=steps, PYTHON=sys.executable,
               PYTHONPATH=str(stub), CUPY_CACHE_DIR=str(out.parent / 'kernel_cache'),
               WHEELS=str(out.parent / 'wheels'), LIMIT_SCALE='10', **extra_env)
    if path is not None:
        env['PATH'] = f'{path}{os.pathsep}{env["PATH"]}'
    return subprocess.run(['bash', str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def summary(out):
    return (out / 'summary.txt').read_text()


def verdict(out, step):
    """The summary's line of a step, time left out."""
    found = [re.sub(r' \(\d+s\)', '', line) for line in summary(out).splitlines()
             if re.match(rf'(PASS|FAIL[^:]*|SKIP): {re.escape(step)}( \(|$)', line)]
    assert len(found) == 1, summary(out)
    return found[0]


def fake_wheel(folder, name, version, code=''):
    """A pure-Python wheel of module ``name`` whose __version__ is ``version``."""
    folder.mkdir(exist_ok=True)
    path = folder / f'{name}-{version}-py3-none-any.whl'
    info = f'{name}-{version}.dist-info'
    with zipfile.ZipFile(path, 'w') as whl:
        whl.writestr(f'{name}/__init__.py', f'__version__ = {version!r}\n{code}')
        whl.writestr(f'{info}/METADATA', f'Metadata-Version: 2.1\nName: {name}\nVersion: '
                                         f'{version}\n')
        whl.writestr(f'{info}/WHEEL', 'Wheel-Version: 1.0\nGenerator: test\n'
                                      'Root-Is-Purelib: true\nTag: py3-none-any\n')
        whl.writestr(f'{info}/RECORD', '')
    return path


# The cache key differs by CuPy version in the compile step alone.
@pytest.mark.parametrize('version, steps', [('14.2.0', 'wheels env compile'),
                                            ('13.6.0', 'compile')])
def test_the_first_steps_pass_on_a_stub_gpu_under_both_cache_keys(stub_gpu, tmp_path, version,
                                                                   steps):
    """The 12 modules compiled, then each loaded from the kernel cache by another process."""
    out = tmp_path / 'out'
    # termcolor as mmengine uses it (lapformer_mm imports mmengine where it is installed).
    fake_wheel(tmp_path / 'wheels', 'termcolor', '9.9.9', 'def colored(text, *args, **kw):\n'
                                                         '    return text\n')
    proc = run_script(stub_gpu, out, steps, FAKE_CUPY_VERSION=version)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = (out / 'env.txt').read_text()
    if 'env' in steps:
        assert [verdict(out, step) for step in ('wheels', 'env', 'modules')] == [
            'PASS: wheels', 'PASS: env', 'PASS: modules'], summary(out)
        assert 'gpu NVIDIA H100 80GB HBM3 cc 9.0 sms 132 smem optin 232448' in env
        assert 'CuPy compiled and loaded a kernel' in env
        assert 'import without OpenMMLab packages' in env
        assert "plan m=49 dv=32: Plan(variant=Variant(name='dv32_tb32'" in env, env
        assert 'module termcolor 9.9.9' in env
    assert verdict(out, 'compile') == 'PASS: compile', summary(out)
    pairs = [(v, d) for v in ('dv32_tb32', 'dv32_tb16', 'dv64_tb32', 'dv64_tb16')
             for d in ('fp32', 'fp16', 'bf16')]
    for variant, dtype in pairs:
        assert re.search(rf'^{variant} {dtype}: compiled in ', env, re.M), env
        assert re.search(rf'^{variant} {dtype}, loaded again: cached in ', env, re.M), env


def test_a_kernel_cache_that_serves_nothing_fails_the_compile_step(stub_gpu, tmp_path):
    """CUPY_CACHE_IN_MEMORY=1: CuPy keeps no binary on disk."""
    out = tmp_path / 'out'
    proc = run_script(stub_gpu, out, 'compile', CUPY_CACHE_IN_MEMORY='1')
    assert proc.returncode == 1
    assert verdict(out, 'compile') == 'FAIL (exit 1): compile', summary(out)
    assert "CuPy's kernel cache did not serve the kernels" in (out / 'env.txt').read_text()


def missing(module):
    return importlib.util.find_spec(module) is None


@pytest.mark.skipif(shutil.which('compute-sanitizer') or shutil.which('ncu')
                    or not (missing('mmengine') or missing('timm')),
                    reason='a tool or the packages are there: the steps would run')
def test_steps_whose_tool_or_package_is_missing_are_skips_not_failures(stub_gpu, tmp_path):
    out = tmp_path / 'out'
    proc = run_script(stub_gpu, out, 'sanitizer ncu backbones')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdict(out, 'sanitizer') == 'SKIP: sanitizer (no compute-sanitizer)'
    assert verdict(out, 'ncu') == 'SKIP: ncu (no ncu)'
    assert re.fullmatch(r'SKIP: backbones \(needs timm and mmengine; missing or broken: '
                        r'[\w ]+\)', verdict(out, 'backbones'))


TOOL = """#!/usr/bin/env bash
echo "$(basename "$0") $*"
{body}
"""


def test_sanitizer_tools_run_at_once_on_our_kernels_and_ncu_without_permission_is_a_skip(
        stub_gpu, tmp_path):
    """compute-sanitizer fails racecheck alone; ncu prints the counter permission error."""
    tools = tmp_path / 'tools'
    tools.mkdir()
    for name, body in (('compute-sanitizer', '[ "$2" = racecheck ] && exit 3; exit 0'),
                       ('ncu', 'echo "==ERROR== ERR_NVGPUCTRPERM - The user does not have '
                               'permission to access NVIDIA GPU Performance Counters"')):
        (tools / name).write_text(TOOL.format(body=body))
        (tools / name).chmod(0o755)
    out = tmp_path / 'out'
    proc = run_script(stub_gpu, out, 'sanitizer ncu', path=tools)
    assert proc.returncode == 1
    assert [verdict(out, f'sanitizer {tool}') for tool in ('memcheck', 'racecheck',
                                                           'synccheck', 'initcheck')] == [
        'PASS: sanitizer memcheck', 'FAIL (exit 3): sanitizer racecheck',
        'PASS: sanitizer synccheck', 'PASS: sanitizer initcheck']
    calls = re.findall(r'^compute-sanitizer .*$', (out / 'sanitizer.txt').read_text(), re.M)
    assert len(calls) == 4 and all('--kernel-name kns=nys_ --report-api-errors no' in c
                                   for c in calls), calls
    assert verdict(out, 'ncu').startswith('SKIP: ncu (no permission')


# The GPU tests that build LaplacianAttention (lapformer_mm.models).
MODELS_TESTS = 'module or kernels_per_attention'


def blocking_stub_gpu(tmp_path, *modules):
    stub = blocking(tmp_path / 'stub', *modules)
    (stub / 'sitecustomize.py').write_text((stub / 'sitecustomize.py').read_text() + STUB)
    return stub


def test_without_mmengine_the_gpu_tests_needing_it_and_the_backbones_step_are_skips(tmp_path):
    out = tmp_path / 'out'
    proc = run_script(blocking_stub_gpu(tmp_path, *OPENMMLAB), out, 'tests backbones',
                      PYTEST_ADDOPTS=f'-k "{MODELS_TESTS}"')
    assert verdict(out, 'tests') == 'PASS: tests', proc.stdout + proc.stderr
    assert verdict(out, 'tests needing mmengine') == (
        'SKIP: tests needing mmengine (2 skipped: mmengine is not installed)')
    assert re.fullmatch(r'SKIP: backbones \(needs timm and mmengine; missing or broken: '
                        r'.*\bmmengine\b.*\)', verdict(out, 'backbones'))
    assert 'NOTE: modules missing: ' in summary(out)


@pytest.mark.parametrize('needed', ['cv2', 'rich'])
def test_mmengine_without_a_module_it_needs_skips_backbones_and_fails_tests_saying_why(
        tmp_path, needed):
    """Without cv2 or rich, ``import lapformer_mm`` fails where mmengine is installed."""
    out = tmp_path / 'out'
    proc = run_script(blocking_stub_gpu(tmp_path, *OPENMMLAB[1:], needed), out,
                      'tests backbones')
    assert proc.returncode == 1
    tests = verdict(out, 'tests')
    assert tests.startswith('FAIL (exit 1): tests (') and needed in tests, summary(out)
    assert re.fullmatch(rf'SKIP: backbones \(needs timm and mmengine; missing or broken: '
                        rf'.*\b{needed}\b.*\)', verdict(out, 'backbones'))


def heredocs(text):
    """The Python programs the script feeds to "$PY" - <<'EOF'."""
    return re.findall(r"\"\$PY\" - [^\n]*<<'EOF'\n(.*?)\nEOF\n", text, re.S)


def test_every_snippet_compiles_and_its_lapformer_mm_imports_resolve():
    snippets = heredocs(SCRIPT.read_text())
    assert len(snippets) >= 3
    for code in snippets:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith('lapformer_mm'):
                        importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom) and str(node.module).startswith('lapformer_mm'):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        importlib.import_module(f'{node.module}.{alias.name}')
