"""tools/gpu_check.sh run on the CPU: the steps that need no GPU run on a stub device (env,
compile, and the SKIP of a step whose tool or package is missing), and every Python snippet
of the script compiles and finds what it imports of lapformer_mm.

The stub (written by :func:`stub_gpu`, loaded as ``sitecustomize`` by every Python process the
script starts) makes torch report one CUDA device with an H100's limits and stands
devtools/fake_cupy.py in for CuPy, with CuPy's kernel cache a folder shared by the processes,
so the script's own Python runs as it would there.
"""
import ast
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _shared import ROOT

SCRIPT = Path(ROOT) / 'tools' / 'gpu_check.sh'

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


cupy = FakeCupy(record=False, disk=Disk(os.environ['CUPY_CACHE_DIR']))
cupy.__version__ = 'fake'
sys.modules['cupy'] = cupy
'''


# Loaded as ``sitecustomize`` too: the machine the script runs on has none of these packages
# (OpenMMLab's) or may lack them (those of the toy data writer), so every Python process the
# test starts finds them missing.
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
    match = re.search(rf'^\s*run_step {step} \d+ "\$OUT/[\w.]+" (.*)$', text, re.M)
    return [sys.executable if word == '$PY' else word for word in shlex.split(match.group(1))]


def test_the_tests_step_collects_without_openmmlab_or_the_toy_data_writers_packages(tmp_path):
    """The step's pytest loads tests/conftest.py and tests/_shared.py before any test: neither
    may need what the GPU machine lacks (OpenMMLab, and cv2 / pycocotools of the toy data
    writer)."""
    stub = blocking(tmp_path / 'block', *OPENMMLAB, 'cv2', 'pycocotools')
    env = dict(os.environ, PYTHONPATH=f'{stub}{os.pathsep}{ROOT}')
    proc = subprocess.run(step_command('tests') + ['--collect-only'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert re.search(r'^\d+ tests? collected', proc.stdout, re.M), proc.stdout[-4000:]


@pytest.fixture
def stub_gpu(tmp_path):
    folder = tmp_path / 'stub'
    folder.mkdir()
    (folder / 'sitecustomize.py').write_text(STUB)
    return folder


def run_script(stub, out, steps, **extra_env):
    env = dict(os.environ, OUT=str(out), STEPS=steps, PYTHON=sys.executable,
               PYTHONPATH=str(stub), CUPY_CACHE_DIR=str(out.parent / 'kernel_cache'),
               **extra_env)
    return subprocess.run(['bash', str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def summary(out):
    return (out / 'summary.txt').read_text()


def test_the_env_step_passes_on_a_stub_gpu(stub_gpu, tmp_path):
    out = tmp_path / 'out'
    proc = run_script(stub_gpu, out, 'env')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r'^PASS: env \(\d+s\)$', summary(out), re.M), summary(out)
    env = (out / 'env.txt').read_text()
    assert 'gpu NVIDIA H100 80GB HBM3 cc 9.0 sms 132 smem optin 232448' in env
    assert 'import without OpenMMLab packages' in env
    assert "plan m=49 dv=32: Plan(variant=Variant(name='dv32_tb32'" in env, env


def test_the_compile_step_leaves_every_pair_for_later_processes(stub_gpu, tmp_path):
    """benchmarks/cuda_compile.py in the script: 4 variants x 3 dtypes compiled by parallel
    workers, then every one loaded from the (stub's) kernel cache by this process."""
    out = tmp_path / 'out'
    proc = run_script(stub_gpu, out, 'compile')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r'^PASS: compile \(\d+s\)$', summary(out), re.M), summary(out)
    log = (out / 'env.txt').read_text()
    pairs = [(v, d) for v in ('dv32_tb32', 'dv32_tb16', 'dv64_tb32', 'dv64_tb16')
             for d in ('fp32', 'fp16', 'bf16')]
    for variant, dtype in pairs:
        assert re.search(rf'^{variant} {dtype}: compiled in ', log, re.M), log
        assert re.search(rf'^{variant} {dtype}, loaded again: cached in ', log, re.M), log


def missing(module):
    return importlib.util.find_spec(module) is None


@pytest.mark.skipif(shutil.which('compute-sanitizer') or shutil.which('ncu')
                    or not (missing('mmengine') or missing('timm')),
                    reason='a tool or the packages are there: the steps would run')
def test_steps_whose_tool_or_package_is_missing_are_skips_not_failures(stub_gpu, tmp_path):
    out = tmp_path / 'out'
    proc = run_script(stub_gpu, out, 'sanitizer ncu backbones')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = summary(out).splitlines()
    assert lines[:2] == ['SKIP: sanitizer (no compute-sanitizer)', 'SKIP: ncu (no ncu)']
    assert re.fullmatch(r'SKIP: backbones \(needs timm and mmengine; missing: [\w ]+\)',
                        lines[2]), lines
    assert lines[3:] == [
        'gpu_check: PASS (steps: sanitizer ncu backbones; skipped: sanitizer ncu backbones)']


# The GPU tests that build LaplacianAttention or the backbone (lapformer_mm.models).
MODELS_TESTS = 'module or backbone or kernels_per_attention'


def test_without_mmengine_the_gpu_tests_needing_it_and_the_backbones_step_are_skips(tmp_path):
    """(The rest of the tests step, a CUDA-graph capture, cannot run on the stub and is not
    looked at.)"""
    stub = blocking(tmp_path / 'stub', *OPENMMLAB)
    (stub / 'sitecustomize.py').write_text((stub / 'sitecustomize.py').read_text() + STUB)
    out = tmp_path / 'out'
    proc = run_script(stub, out, 'tests backbones', PYTEST_ADDOPTS=f'-k "{MODELS_TESTS}"')
    lines = summary(out).splitlines()
    assert re.fullmatch(r'PASS: tests \(\d+s\)', lines[0]), proc.stdout + proc.stderr
    assert lines[1] == 'SKIP: tests needing mmengine (3 skipped: mmengine is not installed)'
    assert re.fullmatch(r'SKIP: backbones \(needs timm and mmengine; missing: .*\bmmengine\b.*\)',
                        lines[-2]), lines


@pytest.mark.parametrize('needed', ['cv2', 'rich'])
def test_mmengine_without_a_module_it_needs_skips_backbones_and_fails_tests_saying_why(
        tmp_path, needed):
    """Without cv2, ``import mmengine`` works but ``import lapformer_mm.models`` does not;
    without rich, ``import mmengine`` fails too. Either way ``import lapformer_mm`` fails where
    mmengine is installed, so no GPU test could run: the tests step says so instead of
    running them, and the backbones step is a SKIP."""
    stub = blocking(tmp_path / 'stub', *OPENMMLAB[1:], needed)
    (stub / 'sitecustomize.py').write_text((stub / 'sitecustomize.py').read_text() + STUB)
    out = tmp_path / 'out'
    proc = run_script(stub, out, 'tests backbones')
    assert proc.returncode == 1
    lines = summary(out).splitlines()
    assert lines[0] == (f'FAIL (exit 1): tests (0s) (mmengine is installed without {needed}, so '
                        'import lapformer_mm fails: bring them as well, or leave mmengine out)')
    assert re.fullmatch(rf'SKIP: backbones \(needs timm and mmengine; missing: .*\b{needed}\)',
                        lines[1]), lines


def heredocs(text):
    """The Python programs the script feeds to "$PY" - <<'EOF'."""
    return re.findall(r"\"\$PY\" - [^\n]*<<'EOF'\n(.*?)\nEOF\n", text, re.S)


def test_every_snippet_compiles_and_its_lapformer_mm_imports_resolve():
    snippets = heredocs(SCRIPT.read_text())
    assert len(snippets) >= 2
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
