"""A regular (non-editable) install: the wheel of a fresh checkout builds the CPU kernels
without a warning and loads the one this CPU selects, ships the CUDA sources and finds them
at run time (both tests share conftest.py's ``built_wheel``)."""
import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from _shared import OWN_FILES_ONLY, ROOT


@pytest.mark.slow
def test_wheel_ships_cuda_sources_and_runtime_finds_them(built_wheel, tmp_path):
    """The session's wheel (conftest.py's ``built_wheel``, a fresh copy of the checkout; its
    CPU kernels are checked by test_fresh_checkout_wheel_builds_the_extension_which_loads)."""
    folder = Path(ROOT, 'lapformer_mm', 'csrc', 'cuda')
    sources = sorted(p.name for p in folder.iterdir() if p.suffix in ('.cu', '.cuh'))
    assert sources
    with zipfile.ZipFile(built_wheel.wheel) as archive:
        shipped = sorted(Path(n).name for n in archive.namelist()
                         if n.startswith('lapformer_mm/csrc/cuda/'))
    assert shipped == sources

    # From the unpacked wheel alone (outside the repo), the backend finds and inlines them.
    site = built_wheel.site
    code = ('from lapformer_mm.ops.backends import cuda as cl; '
            'print(cl.source_dir()); assert "struct nys_params" in cl.load_source()')
    found = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, check=True,
                           capture_output=True, text=True,
                           env={'PYTHONPATH': str(site), 'PATH': '/usr/bin:/bin'})
    assert Path(found.stdout.strip()) == site / 'lapformer_mm' / 'csrc' / 'cuda'


def test_torch_floor_is_stated_once_and_required_everywhere(tmp_path):
    """setup.py reads lapformer_mm.TORCH_FLOOR; requirements.txt states the same range."""
    import lapformer_mm
    requirement = f'torch>={lapformer_mm.TORCH_FLOOR}'
    assert requirement in Path(ROOT, 'requirements.txt').read_text().split()
    metadata = subprocess.run([sys.executable, 'setup.py', '-q', 'egg_info', '--egg-base',
                               str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert metadata.returncode == 0, metadata.stderr
    requires = (tmp_path / 'lapformer_mm.egg-info' / 'requires.txt').read_text().split()
    assert requirement in requires


def test_import_on_a_torch_below_the_floor_names_it():
    code = ("import torch; torch.__version__ = '2.6.0+cu124'\n"
            "try:\n    import lapformer_mm\nexcept ImportError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         check=True).stdout
    import lapformer_mm
    assert f'lapformer_mm needs torch>={lapformer_mm.TORCH_FLOOR}' in out
    assert 'found torch 2.6.0+cu124' in out


# The modules setup.py builds on this machine: one per at::vec instruction set on x86-64.
_BUILT_HERE = (('default', 'avx2', 'avx512') if platform.machine().lower() in ('x86_64', 'amd64')
               else ('default', ))


@pytest.mark.slow(seconds=100)  # the session wheel build
def test_fresh_checkout_wheel_builds_the_extension_which_loads(built_wheel):
    """setup.py's ext_modules, built from the checkout's files alone (conftest.py's
    ``built_wheel``: pip wheel of a fresh copy, shared with the test above),
    build without a warning, and the installed package loads the build this CPU selects and
    computes with it."""
    assert 'WARNING' not in built_wheel.log, built_wheel.log[-4000:]
    shipped = sorted(p.name.split('.')[0] for p in
                     (built_wheel.site / 'lapformer_mm').glob('_cpu_*.so'))
    assert shipped == sorted(f'_cpu_{name}' for name in _BUILT_HERE)
    code = ('import torch; from lapformer_mm.ops.backends import cpu\n'
            'print(cpu.__file__)\n'
            'x = torch.randn(1, 1, 5, 3, dtype=torch.float64)\n'
            'd = (x[:, :, :, None] - x[:, :, None]).abs().sum(-1)\n'
            'print(cpu.build(), torch.allclose(cpu._ops().pairwise_forward(x, x, 2.0, 0), '
            '(-d / 2.0).exp()))')
    result = subprocess.run([sys.executable, '-c', OWN_FILES_ONLY + code], cwd=built_wheel.site,
                            env={**os.environ, 'PYTHONPATH': str(built_wheel.site)},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    expected = {'AVX512': 'avx512', 'AVX2': 'avx2'}.get(
        torch.backends.cpu.get_cpu_capability(), 'default')
    module, *loaded = result.stdout.split()
    assert Path(module).is_relative_to(built_wheel.site), module
    assert loaded == [expected, 'True']
