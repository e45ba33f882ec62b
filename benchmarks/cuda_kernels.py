"""Per-kernel GPU times of the fused attention from the profiler (forward + backward).

    python benchmarks/cuda_kernels.py --out kernel_times.md      # (bh, N) = (4, 66600), (32, 1050)
    ncu -k regex:nys_backward -c 5 python benchmarks/cuda_kernels.py --no-profiler

m = 49, d = d_v = 32 (Tiny); each configuration warmed up, then ``--repeats`` calls of
forward + backward under torch.profiler: the table gives each stage's mean time per call
(µs) and the sum of the solve-type kernels (one block per (batch, head)).
``--no-profiler``: the same calls without torch.profiler, for a profiler of its own (Nsight
Compute: two CUPTI clients in one process do not mix).
"""
import argparse
import collections
import sys
from pathlib import Path

import torch

if __package__ in (None, ''):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SOLVE_TYPE = ('nys_forward_solve', 'nys_forward_context', 'nys_backward_merge',
              'nys_backward_solve', 'nys_backward_landmarks')


def kernel_times(bh, n, repeats, m_grid=7, d=32, profiler=True):
    from torch.profiler import ProfilerActivity, profile

    from lapformer_mm.ops import nystrom_attention, pool_landmarks
    from lapformer_mm.ops.backends.cuda_plan import stage_of
    side = int(n ** 0.5)
    hw = (side, -(-n // side))
    n = hw[0] * hw[1]
    q, k, v = (torch.randn(1, bh, n, d, device='cuda', requires_grad=True) for _ in range(3))
    landmarks = pool_landmarks(k.detach(), hw, m_grid).requires_grad_()
    grad = torch.randn(1, n, bh, d, device='cuda').transpose(1, 2)

    def step():
        out = nystrom_attention(q, k, v, landmarks, impl='cupy')
        torch.autograd.grad(out, (q, k, v, landmarks), grad)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if not profiler:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
        return n, {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    totals = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name.startswith('nys_'):
            totals[stage_of(event.name)] += event.device_time / repeats
    return n, dict(totals)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out', default=None)
    p.add_argument('--repeats', type=int, default=20)
    p.add_argument('--no-profiler', action='store_true', help='run the calls, time nothing')
    args = p.parse_args(argv)
    lines = [f'GPU: {torch.cuda.get_device_name()}', '',
             '| bh | N | kernel | µs per call |', '|---|---|---|---|']
    print('\n'.join(lines), flush=True)
    for bh, n in ((4, 66_600), (32, 1_050)):
        n, totals = kernel_times(bh, n, args.repeats, profiler=not args.no_profiler)
        rows = [f'| {bh} | {n} | `{name}` | {us:.1f} |' for name, us in sorted(totals.items())]
        solve = sum(us for name, us in totals.items() if name in SOLVE_TYPE)
        rows.append(f'| {bh} | {n} | solve-type kernels, sum | {solve:.1f} |')
        print('\n'.join(rows), flush=True)  # as measured: a run stopped later keeps them
        lines += rows
    if args.out:
        Path(args.out).write_text('\n'.join(lines) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
