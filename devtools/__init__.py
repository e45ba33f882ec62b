"""Development tooling of a source checkout, not part of the installed package.

- :mod:`.nvrtc`: NVRTC through ctypes, to compile ``ops/cuda/*.cu`` without a GPU (the CI
  compile test);
- :mod:`.sass`: instruction counts of the kernels' hot loops from ``nvdisasm``
  (``benchmarks/cuda_sass.py``, the SASS test);
- :mod:`.profiling`: peak memory of a callable on CPU and CUDA;
- :mod:`.timing`: timers, load average and size parsing of ``benchmarks/``.

Importable from the repository root (pytest's ``pythonpath = .``, or run scripts from
there).
"""
