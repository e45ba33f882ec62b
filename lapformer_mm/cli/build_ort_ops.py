"""Build lapformer_mm's ONNX Runtime custom-operator library (opt-in, docs/deploy.md).

A plain C++ shared library (``ops/onnxruntime``) that needs ONNX Runtime's C API
headers (``--ort-include DIR`` or ``ORT_INCLUDE_DIR``); it goes to ``deploy.ORT_OPS_LIBRARY``
unless ``--out`` names another file.
"""
import argparse
import os
import os.path as osp
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile

from lapformer_mm.cli import output_path
from lapformer_mm.deploy import ORT_OPS_LIBRARY
from lapformer_mm.ops.backends import kernel_sources

SOURCES = str(kernel_sources('onnxruntime'))
LIBRARY_NAME = osp.basename(ORT_OPS_LIBRARY)
INCLUDE_ENV = 'ORT_INCLUDE_DIR'
HEADER = 'onnxruntime_c_api.h'
COMMON_FLAGS = ['-std=c++17', '-O3', '-fPIC', '-fvisibility=hidden', '-fno-math-errno',
                '-ffp-contract=fast',
                '-Wall', '-Wextra', '-Werror']
#: One object per instruction set, as the CPU kernels (ops/cpu) are built; the
#: library picks one at registration (register_ops.cpp).
KERNELS = {'default': [], 'avx2': ['-mavx2', '-mfma', '-mno-avx256-split-unaligned-load',
                                        '-mno-avx256-split-unaligned-store'],
           'avx512': ['-mavx512f']}


def find_include(include_dir=None):
    """The ONNX Runtime include folder: ``include_dir``, else $ORT_INCLUDE_DIR; checked."""
    folder = include_dir or os.environ.get(INCLUDE_ENV)
    if not folder:
        raise FileNotFoundError(
            f'ONNX Runtime C API headers are needed to build the op library: pass '
            f'--ort-include DIR or set {INCLUDE_ENV} to the folder holding {HEADER} (the '
            f'include/ of an ONNX Runtime release; the onnxruntime wheel ships none)')
    if not osp.isfile(osp.join(folder, HEADER)):
        raise FileNotFoundError(f'{HEADER} is not in the ONNX Runtime include folder '
                                f'{folder!r} (--ort-include / {INCLUDE_ENV})')
    return osp.abspath(folder)


def build(include_dir=None, out=None, cxx=None, verbose=False):
    """Compile and link the library; return its path. Raises FileNotFoundError (no
    headers, no compiler) or RuntimeError (a compiler error, with its output)."""
    include = find_include(include_dir)
    out = osp.abspath(output_path(out, LIBRARY_NAME) if out else ORT_OPS_LIBRARY)
    compiler = shlex.split(cxx or os.environ.get('CXX') or 'g++')
    if shutil.which(compiler[0]) is None:
        raise FileNotFoundError(f'C++ compiler {compiler[0]!r} not found (set CXX)')
    x86 = platform.machine().lower() in ('x86_64', 'amd64')
    kernels = KERNELS if x86 else {'default': []}
    with tempfile.TemporaryDirectory() as tmp:
        objects = []
        jobs = [(osp.join(SOURCES, 'register_ops.cpp'), ['-I', include])]
        jobs += [(osp.join(SOURCES, f'kernel_{name}.cpp'), flags)
                 for name, flags in kernels.items()]
        for source, flags in jobs:
            obj = osp.join(tmp, osp.basename(source) + '.o')
            _run(compiler + COMMON_FLAGS + flags + ['-c', source, '-o', obj], verbose)
            objects.append(obj)
        staged = osp.join(tmp, LIBRARY_NAME)
        # Only RegisterCustomOps is exported (the version script hides libstdc++'s
        # template instances too); no debug information.
        _run(compiler + ['-shared', '-s', '-o', staged] + objects
             + [f'-Wl,--version-script={osp.join(SOURCES, "exports.map")}'], verbose)
        os.makedirs(osp.dirname(out), exist_ok=True)
        # Copied, then renamed: a session that has the old file open keeps it intact.
        partial = out + '.partial'
        try:
            shutil.copyfile(staged, partial)
            os.replace(partial, out)
        finally:
            if osp.exists(partial):
                os.remove(partial)
    return out


def _run(cmd, verbose):
    if verbose:
        print(' '.join(map(shlex.quote, cmd)))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f'building the ONNX Runtime op library failed:\n'
                           f'{" ".join(map(shlex.quote, cmd))}\n{proc.stdout[-4000:]}')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--ort-include', help=f'ONNX Runtime include folder (holding {HEADER}; '
                                              f'default: ${INCLUDE_ENV})')
    parser.add_argument('--out', help=f'library path, or a folder for {LIBRARY_NAME} '
                                      f'(default: {ORT_OPS_LIBRARY})')
    parser.add_argument('--cxx', help='C++ compiler (default: $CXX or g++)')
    parser.add_argument('-v', '--verbose', action='store_true', help='print the commands')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        path = build(args.ort_include, args.out, args.cxx, args.verbose)
    except (OSError, RuntimeError) as err:
        print(f'build_ort_ops: {err}', file=sys.stderr)
        return 2
    print(f'wrote {path} ({osp.getsize(path) / 1024:.0f} KB)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
