"""`make test`'s pytest-xdist options keep the order tests/_xdist_order.py gives the files."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from _shared import ROOT, TESTS

CONFTEST = """
from _xdist_order import longest_files_first


def pytest_collection_modifyitems(config, items):
    items[:] = longest_files_first(items)
"""
FILES = {
    # Six fast tests: xdist's own reordering (by number of tests) would put this file first.
    'test_a_many_fast.py': ''.join(f'def test_fast_{i}():\n    pass\n' for i in range(6)),
    'test_b_one_long.py': 'import pytest\n\n\n@pytest.mark.slow(seconds=100)\n'
                          'def test_long():\n    pass\n',
    'test_c_two_slow.py': 'import pytest\n\n\n@pytest.mark.slow\ndef test_slow_0():\n    pass\n'
                          '\n\n@pytest.mark.slow\ndef test_slow_1():\n    pass\n',
}


def makefile_xdist_options():
    text = Path(ROOT, 'Makefile').read_text()
    return shlex.split(re.search(r'^XDIST \?= (.+)$', text, re.M).group(1))


def test_make_tests_xdist_options_run_the_longest_file_first(tmp_path):
    for name, body in FILES.items():
        (tmp_path / name).write_text(body)
    (tmp_path / 'conftest.py').write_text(CONFTEST)
    (tmp_path / 'pytest.ini').write_text('[pytest]\nmarkers =\n    slow: slow\n    gpu: gpu\n')
    # One worker: the order the scheduler hands out is the order the tests run in.
    options = makefile_xdist_options()
    options[options.index('-n') + 1] = '1'
    env = {**os.environ, 'PYTHONPATH': TESTS}
    result = subprocess.run([sys.executable, '-m', 'pytest', '-v', '-p', 'no:cacheprovider',
                             *options, str(tmp_path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    ran = re.findall(r'PASSED (test_\w+)\.py::', result.stdout)
    files = list(dict.fromkeys(ran))
    assert files == ['test_b_one_long', 'test_c_two_slow', 'test_a_many_fast'], result.stdout
