"""tools/setup_env.sh's source-build fallback: the C++ standard patch of mmcv's setup.py."""
import os.path as osp
import subprocess

from _shared import TOOLS

SCRIPT = osp.join(TOOLS, 'setup_env.sh')
# The lines of mmcv 2.1.0's setup.py that set a C++ standard (CPU ops, MPS, nvcc; Windows).
MMCV_LINES = """\
                extra_compile_args['cxx'] = ['-std=c++14']
                extra_compile_args['cxx'] = ['-std=c++17']
                extra_compile_args['cxx'] = ['/std:c++17']
            extra_compile_args['cxx'] = ['-Wall', '-std=c++17']
                extra_compile_args['nvcc'] += ['-std=c++17']
"""


def raise_cxx_standard(path):
    return subprocess.run(['bash', '-c', f'source "{SCRIPT}" && raise_cxx_standard "{path}"'],
                          capture_output=True, text=True)


def test_raises_every_gnu_cxx17_flag_to_cxx20_or_refuses_a_setup_py_without_it(tmp_path):
    setup_py = tmp_path / 'setup.py'
    setup_py.write_text(MMCV_LINES)
    assert raise_cxx_standard(setup_py).returncode == 0
    assert setup_py.read_text() == MMCV_LINES.replace('-std=c++17', '-std=c++20')
    result = raise_cxx_standard(setup_py)  # now without the flag
    assert result.returncode == 1 and str(setup_py) in result.stdout


def test_mmcv_is_reinstalled_when_torch_changes(tmp_path):
    """An mmcv whose ops import beside a torch it was not built for is not taken as installed."""
    import sys
    venv = tmp_path / 'venv'
    (venv / 'bin').mkdir(parents=True)
    # A launcher, not a symlink: the test interpreter's venv (with mmcv) must stay active.
    (venv / 'bin' / 'python').write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / 'bin' / 'python').chmod(0o755)

    def built_for(version):
        cmd = f'source "{SCRIPT}" && mmcv_built_for {version}'
        env = {'LAPFORMER_VENV': str(venv), 'PATH': '/usr/bin:/bin'}
        return subprocess.run(['bash', '-c', cmd], env=env, capture_output=True).returncode == 0
    assert not built_for('2.14.1')  # no record: install
    (venv / '.lapformer-mmcv-torch').write_text('2.13.0+cpu\n')
    assert not built_for('2.14.1')  # built for another torch: reinstall
    (venv / '.lapformer-mmcv-torch').write_text('2.14.1\n')
    assert built_for('2.14.1')
