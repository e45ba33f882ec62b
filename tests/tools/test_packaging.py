"""A regular (non-editable) install ships the CUDA sources and finds them at run time."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _shared import ROOT


@pytest.mark.slow
def test_wheel_ships_cuda_sources_and_runtime_finds_them(built_wheel, tmp_path):
    """The session's wheel (conftest.py's ``built_wheel``, a fresh copy of the checkout; its
    CPU kernels are checked by tests/ops/cpu/test_kernels.py's
    test_fresh_checkout_wheel_builds_the_extension_which_loads)."""
    folder = Path(ROOT, 'lapformer_mm', 'csrc', 'cuda')
    sources = sorted(p.name for p in folder.iterdir() if p.suffix in ('.cu', '.cuh'))
    assert sources
    with zipfile.ZipFile(built_wheel.wheel) as archive:
        shipped = sorted(Path(n).name for n in archive.namelist()
                         if n.startswith('lapformer_mm/csrc/cuda/'))
    assert shipped == sources

    # From the unpacked wheel alone (outside the repo), the backend finds and inlines them.
    site = built_wheel.site
    code = ('from lapformer_mm.ops.backends import _cuda_launch as cl; '
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
