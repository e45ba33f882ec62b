"""Install lapformer_mm. The kernel sources live in the top-level ``ops/`` (one copy).

A wheel ships ``ops/cuda`` (compiled at run time by NVRTC, lapformer_mm/ops/backends/cuda.py)
and ``ops/onnxruntime`` (the ONNX Runtime op library, built on request by
tools/build_ort_ops.py) as ``lapformer_mm/ops_src/``; an editable install and a source
checkout read ``ops/`` itself (``lapformer_mm.ops.backends.kernel_sources``).

The CPU kernels (``ops/cpu``) are built here as C++ extensions, one module per
at::vec instruction set (``lapformer_mm._cpu_default``, ``_cpu_avx2``, ``_cpu_avx512`` on
x86-64). A failed build (no compiler, no torch at build time) does not fail the install: the
package then warns once on first use and runs the PyTorch reference
(``lapformer_mm/ops/backends/cpu.py``). ``LAPFORMER_BUILD_CPU_EXT=0`` skips the build.
"""
import os
import platform
import re
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent

# Hidden symbols: the modules share no code at link time and export only their op registration;
# no debug information (setuptools passes -g), which would triple the modules' size.
# The at::vec headers trip GCC's unknown-pragma and maybe-uninitialized warnings.
# -fopenmp: at::parallel_for is inline, and without _OPENMP it runs the whole range on the
# calling thread; torch's wheel loads libgomp.so.1 already, so the modules share its runtime.
CPU_OPENMP_FLAGS = ['-fopenmp']
CPU_COMMON_FLAGS = ['-O3', '-g0', '-fvisibility=hidden', '-Wno-unknown-pragmas',
                    '-Wno-maybe-uninitialized'] + CPU_OPENMP_FLAGS
# The compiler flags of each at::vec capability, as torch builds its own kernels with them.
CPU_CAPABILITY_FLAGS = {
    'default': [],
    'avx2': ['-mavx2', '-mfma', '-mf16c', '-mbmi2'],
    'avx512': ['-mavx512f', '-mavx512bw', '-mavx512vl', '-mavx512dq', '-mfma', '-mf16c'],
}


def cpu_kernel_build():
    """(ext_modules, cmdclass) of the CPU kernels, or ([], {}) when they cannot be built here."""
    if os.environ.get('LAPFORMER_BUILD_CPU_EXT', '1') == '0':
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as err:  # no torch at build time (an isolated build): reference only
        print(f'lapformer_mm: not building the CPU kernels ({type(err).__name__}: {err})',
              file=sys.stderr)
        return [], {}
    x86 = platform.machine().lower() in ('x86_64', 'amd64')
    names = list(CPU_CAPABILITY_FLAGS) if x86 else ['default']
    modules = [CppExtension(f'lapformer_mm._cpu_{name}', [f'ops/cpu/cpu_{name}.cpp'],
                            depends=['ops/cpu/cpu_kernels.h'],  # a newer header rebuilds
                            extra_compile_args=CPU_COMMON_FLAGS + CPU_CAPABILITY_FLAGS[name],
                            extra_link_args=CPU_OPENMP_FLAGS)
               for name in names]

    class OptionalBuildExtension(BuildExtension):
        """Builds each module it can, all at once; one that fails is reported and left out."""

        def __init__(self, *args, **kwargs):
            # Without ninja: torch writes one build.ninja per build folder, which modules
            # built in parallel would share. Each module is one source file anyway.
            super().__init__(*args, use_ninja=False, **kwargs)

        def finalize_options(self):
            super().finalize_options()
            # setuptools' -j: every module at once, even on fewer cores, so that compiles of
            # unequal length share the cores instead of the last waiting for a free one.
            if not self.parallel:
                self.parallel = max(len(self.extensions), os.cpu_count() or 1)

        def build_extensions(self):
            self.failed = set()
            try:
                super().build_extensions()
            except Exception as err:  # the compiler check itself failed (no compiler)
                self.report(None, err)
                self.failed = {ext.name for ext in self.extensions}
            # What is not built is neither copied in place nor listed among the outputs.
            self.extensions = [ext for ext in self.extensions if ext.name not in self.failed]

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as err:  # compile or link error: the package falls back
                self.report(ext.name, err)
                self.failed.add(ext.name)

        @staticmethod
        def report(name, err):
            what = name or 'the CPU kernels'
            print(f'lapformer_mm: WARNING: building {what} failed ({type(err).__name__}: '
                  f'{err}); lapformer_mm will run the PyTorch reference on the CPU',
                  file=sys.stderr)

    return modules, {'build_ext': OptionalBuildExtension}


#: The kernel sources a wheel ships under lapformer_mm/ops_src/, by folder of ops/.
SHIPPED_SOURCES = {'cuda': ('*.cu', '*.cuh'), 'onnxruntime': ('*.cpp', '*.h', '*.map')}


class BuildPyWithKernelSources(build_py):
    """build_py, plus ops/cuda and ops/onnxruntime copied to lapformer_mm/ops_src/."""

    def run(self):
        super().run()
        if self.editable_mode:  # the checkout's ops/ serves an editable install
            return
        for kind, patterns in SHIPPED_SOURCES.items():
            dest = Path(self.build_lib, 'lapformer_mm', 'ops_src', kind)
            self.mkpath(str(dest))
            for pattern in patterns:
                for source in sorted((HERE / 'ops' / kind).glob(pattern)):
                    self.copy_file(str(source), str(dest / source.name))


EXT_MODULES, CMDCLASS = cpu_kernel_build()
CMDCLASS['build_py'] = BuildPyWithKernelSources


def package_constant(name):
    """A string constant of lapformer_mm/__init__.py, read without importing torch."""
    text = (HERE / 'lapformer_mm' / '__init__.py').read_text()
    return re.search(rf"^{name} = '([^']+)'", text, re.M).group(1)


setup(
    name='lapformer_mm',
    version=package_constant('__version__'),
    description='LaplacianFormer (Laplacian-kernel linear attention) backbones for '
                'OpenMMLab detection and segmentation',
    long_description=(HERE / 'README.md').read_text(encoding='utf-8'),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    python_requires='>=3.9',
    packages=find_packages(include=['lapformer_mm', 'lapformer_mm.*']),
    install_requires=[f"torch>={package_constant('TORCH_FLOOR')}", 'numpy', 'mmengine>=0.10,<1'],
    extras_require={
        'det': ['mmcv>=2.0.0,<2.2.0', 'mmdet>=3.3,<3.4', 'pycocotools'],
        'seg': ['mmcv>=2.0.0,<2.2.0', 'mmsegmentation>=1.2,<1.3', 'ftfy', 'regex'],
        'cls': ['mmcv>=2.0.0,<2.2.0', 'mmpretrain>=1.2,<1.3', 'torchvision'],
        'cuda12': ['cupy-cuda12x>=13'],
        'cuda13': ['cupy-cuda13x>=13'],
        # ONNX export (both exporters) and its check on ONNX Runtime (lapformer_mm.deploy).
        'deploy': ['onnx>=1.16', 'onnxscript>=0.5', 'onnxruntime>=1.17'],
    },
    classifiers=[
        'Programming Language :: Python :: 3',
        'License :: OSI Approved :: Apache Software License',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
    zip_safe=False,
)
