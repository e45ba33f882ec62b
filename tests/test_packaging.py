"""A regular (non-editable) install ships the CUDA sources and finds them at run time."""
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_ships_cuda_sources_and_runtime_finds_them(tmp_path):
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation',
                    '-q', '-w', str(tmp_path / 'dist'), str(REPO)], check=True)
    wheel, = (tmp_path / 'dist').glob('lapformer_mm-*.whl')
    sources = sorted(p.name for p in (REPO / 'ops').iterdir() if p.suffix in ('.cu', '.cuh'))
    assert sources
    with zipfile.ZipFile(wheel) as archive:
        shipped = sorted(Path(n).name for n in archive.namelist()
                         if n.startswith('lapformer_mm/_cuda_src/'))
        archive.extractall(tmp_path / 'site')
    assert shipped == sources

    # From the unpacked wheel alone (outside the repo), the runtime locates every source there.
    code = ('import lapformer_mm.ops.cuda_runtime as rt, sys; '
            f'print(*[rt.find_source(n) for n in {sources!r}], sep="\\n")')
    found = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, check=True,
                           capture_output=True, text=True,
                           env={'PYTHONPATH': str(tmp_path / 'site'), 'PATH': '/usr/bin:/bin'})
    located = [Path(line) for line in found.stdout.split()]
    assert [p.name for p in located] == sources
    assert all(p.is_relative_to(tmp_path / 'site' / 'lapformer_mm' / '_cuda_src') for p in located)
