"""Peak-memory measurement of a callable, used by the memory test and the benchmark.

On CPU, PyTorch keeps no allocator statistics, so the profiler's allocator
events (``profile_memory=True``) are replayed in time order: every CPU tensor
allocation and free is reported there, including buffers that native kernels
allocate internally. On CUDA, the caching allocator's peak statistic is used.
"""
import torch
from torch.profiler import ProfilerActivity, profile


def _replay_peak(events):
    """Largest running sum of signed allocation sizes, in time order."""
    current = peak = 0
    for _, nbytes in sorted(events):
        current += nbytes
        peak = max(peak, current)
    return peak


def cpu_peak_memory(fn):
    """(peak bytes allocated above the level at entry, fn's result) on CPU."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
              if e.name() == '[memory]' and e.device_type() == torch.autograd.DeviceType.CPU]
    return _replay_peak(events), result


def cuda_peak_memory(fn, device=None):
    """(peak bytes allocated above the level at entry, fn's result) on CUDA."""
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start, result


def peak_memory_bytes(fn, device='cpu'):
    """Peak extra bytes allocated while ``fn()`` runs on ``device``, and its result."""
    if torch.device(device).type == 'cuda':
        return cuda_peak_memory(fn, device)
    return cpu_peak_memory(fn)
