"""NVRTC through ctypes: compile the CUDA sources without a GPU, driver or CuPy.

Used by the CI compile test and ``benchmarks/cuda_sass.py``. NVRTC is the compiler
CuPy uses at run time; the library comes from the ``nvidia-cuda-nvrtc-cu12``
wheel (or ``$LAPFORMER_NVRTC_LIB``, or the system's ``libnvrtc``).
"""
import ctypes
import ctypes.util
import glob
import os
import sys
from pathlib import Path

#: Options CuPy's RawModule adds to ours (cupy/cuda/compiler.py, CuPy 13-14).
CUPY_ADDED_OPTIONS = ('-ftz=true', '--device-as-default-execution-space')


def nvidia_wheel_files(pattern):
    """Files under the ``nvidia/`` folders of the pip wheels on ``sys.path`` matching
    ``pattern``."""
    hits = []
    for site in sys.path:
        hits += glob.glob(str(Path(site) / 'nvidia' / '**' / pattern), recursive=True)
    return hits


def find_nvrtc():
    """Path of libnvrtc: $LAPFORMER_NVRTC_LIB, the pip wheel, or the system library."""
    explicit = os.environ.get('LAPFORMER_NVRTC_LIB')
    if explicit:
        return explicit
    hits = [h for h in nvidia_wheel_files('libnvrtc.so*')
            if 'builtins' not in h and '.alt.' not in h]
    # NVRTC 12 first: it is the last one that targets sm_70.
    hits.sort(key=lambda h: (not h.endswith('.so.12'), h))
    return hits[0] if hits else ctypes.util.find_library('nvrtc')


class Nvrtc:
    """The few NVRTC entry points needed to compile a program and read its results."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def version(self):
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), 'nvrtcVersion')
        return major.value, minor.value

    def supported_archs(self):
        count = ctypes.c_int()
        self._check(self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), 'archs')
        archs = (ctypes.c_int * count.value)()
        self._check(self.lib.nvrtcGetSupportedArchs(archs), 'archs')
        return {f'sm_{a}' for a in archs}

    def _check(self, status, what):
        if status != 0:
            raise RuntimeError(f'{what}: {self.lib.nvrtcGetErrorString(status).decode()}')

    def compile(self, source, name, options, name_expressions):
        """(status, log, {name expression: lowered name}, cubin bytes; empty on failure)."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                                0, None, None), 'nvrtcCreateProgram')
        try:
            for expr in name_expressions:
                self._check(self.lib.nvrtcAddNameExpression(prog, expr.encode()), expr)
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), 'log size')
            log = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetProgramLog(prog, log), 'log')
            lowered, cubin = {}, b''
            if status == 0:
                for expr in name_expressions:
                    out = ctypes.c_char_p()
                    self._check(
                        self.lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)), expr)
                    lowered[expr] = out.value.decode()
                size = ctypes.c_size_t()
                self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), 'cubin size')
                buffer = ctypes.create_string_buffer(size.value)
                self._check(self.lib.nvrtcGetCUBIN(prog, buffer), 'cubin')
                cubin = buffer.raw
            return status, log.value.decode(errors='replace'), lowered, cubin
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
