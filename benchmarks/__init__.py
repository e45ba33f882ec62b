"""Benchmark and measurement scripts (run from the repository root, e.g.
``python benchmarks/attention.py speed``); their shared parts live in
:mod:`lapformer_mm.analysis`.

- ``attention.py``: Nyström attention against softmax and dense attention (CPU), the
  Newton–Schulz iteration study, the thread and blocking micro-measurements;
- ``numerics.py``: attention error against conditioning for the landmark solvers;
- ``backbones.py``: LaplacianFormer-T/S against mmdet's PVTv2 and Swin (cost, memory, profile);
- ``backbones_gpu.py``: LaplacianFormer-T against timm's PVTv2-b1 and Swin-T on a GPU;
- ``inference.py``: speed and peak memory of a whole detector or segmentor config;
- ``cuda_kernels.py``: per-kernel GPU times of the fused attention from the profiler;
- ``cuda_sass.py``: instruction counts of the CUDA kernels' hot loops (no GPU);
- ``cuda_sanitize_cases.py``: every kernel instantiation once, for compute-sanitizer;
- ``malloc_faults.py``: page faults of large CPU allocations with and without
  :func:`lapformer_mm.cpu_malloc.keep_large_blocks`.
"""
