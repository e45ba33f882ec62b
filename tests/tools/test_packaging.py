"""Packaging: ops/ serves a checkout; a wheel ships the CPU kernels and the kernel sources."""
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch
from _shared import ROOT, copy_checkout


def test_a_checkout_reads_the_kernel_sources_from_ops():
    """The editable install (and a source tree) reads the one copy in the top-level ops/."""
    from lapformer_mm.cli import build_ort_ops
    from lapformer_mm.ops.backends import cuda
    assert cuda.source_dir() == Path(ROOT, 'ops', 'cuda')
    assert Path(build_ort_ops.SOURCES) == Path(ROOT, 'ops', 'onnxruntime')
    assert not Path(ROOT, 'lapformer_mm', 'ops_src').exists()


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


def build_wheel(base):
    """(wheel, log) of ``pip wheel`` run on a fresh copy of the checkout in ``base``."""
    checkout = base / 'checkout'
    copy_checkout(checkout)
    # The CPU kernels the install step built from these sources, where setuptools keeps a
    # build: build_ext reuses a module newer than its source and header (setup.py's depends)
    # instead of compiling it again (~80 s on 2 cores); an older one is compiled.
    built = checkout / 'build' / f'lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}'
    (built / 'lapformer_mm').mkdir(parents=True)
    for module in Path(ROOT, 'lapformer_mm').glob('_cpu_*'):
        shutil.copy2(module, built / 'lapformer_mm' / module.name)
    proc = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps',
                           '--no-build-isolation', '--disable-pip-version-check', '-v',
                           '-w', str(base / 'dist'), str(checkout)],
                          capture_output=True, text=True, timeout=1800)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    wheel, = (base / 'dist').glob('lapformer_mm-*.whl')
    return wheel, log


@pytest.mark.slow(seconds=20)
def test_wheel_installed_in_a_fresh_venv_ships_and_finds_what_it_needs(tmp_path):
    """A built wheel in a fresh venv: the shipped sources found, the CPU kernels compute."""
    wheel, log = build_wheel(tmp_path)
    assert 'WARNING' not in log, log[-4000:]
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    for kind in ('cuda', 'onnxruntime'):
        shipped = sorted(n.rsplit('/', 1)[1] for n in names
                         if n.startswith(f'lapformer_mm/ops_src/{kind}/'))
        assert shipped == sorted(p.name for p in Path(ROOT, 'ops', kind).iterdir()), kind
    assert sorted(Path(n).name.split('.')[0] for n in names if '/_cpu_' in n) == \
        sorted(f'_cpu_{name}' for name in _BUILT_HERE)

    venv = tmp_path / 'venv'
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True)
    python = venv / 'bin' / 'python'
    subprocess.run([sys.executable, '-m', 'pip', '--python', str(python), 'install', '-q',
                    '--no-deps', '--disable-pip-version-check', str(wheel)],
                   check=True, timeout=300)
    site = Path(subprocess.run([str(python), '-c', 'import sysconfig; '
                                'print(sysconfig.get_paths()["purelib"])'],
                               check=True, capture_output=True, text=True).stdout.strip())
    # A path line only: this venv's .pth files (the editable finder) are not run there.
    (site / 'deps.pth').write_text(sysconfig.get_paths()['purelib'] + '\n')
    code = ('import torch, lapformer_mm\n'
            'from lapformer_mm.cli import build_ort_ops\n'
            'from lapformer_mm.ops.backends import cpu, cuda\n'
            'print(lapformer_mm.__file__, cuda.source_dir(), build_ort_ops.SOURCES)\n'
            'assert "struct nys_params" in cuda.load_source()\n'
            'x = torch.randn(1, 1, 5, 3, dtype=torch.float64)\n'
            'd = (x[:, :, :, None] - x[:, :, None]).abs().sum(-1)\n'
            'print(cpu.build(), torch.allclose(cpu._ops().pairwise_forward(x, x, 2.0, 0), '
            '(-d / 2.0).exp()))')
    result = subprocess.run([str(python), '-c', code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600, env={'PATH': os.environ['PATH'],
                                                         'OMP_NUM_THREADS': '1'})
    assert result.returncode == 0, result.stderr
    package, cuda_dir, ort_dir, loaded, computed = result.stdout.split()
    installed = (site / 'lapformer_mm').resolve()
    assert Path(package).resolve().parent == installed
    assert Path(cuda_dir) == installed / 'ops_src' / 'cuda'
    assert Path(ort_dir) == installed / 'ops_src' / 'onnxruntime'
    expected = {'AVX512': 'avx512', 'AVX2': 'avx2'}.get(
        torch.backends.cpu.get_cpu_capability(), 'default')
    assert (loaded, computed) == (expected, 'True')
