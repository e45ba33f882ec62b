"""Attention error against conditioning for the three landmark solvers (a script, not a test).

Inputs: queries (= keys), values and 49 landmarks all within ``spread`` of one point,
so k(L, L) + 0.01 I goes from well conditioned (spread 1) to the worst case the ridge
allows (spread -> 0, cond -> 100 m + 1 = 4901). For each spread, the relative error
||out - ref|| / ||ref - v̄|| (the attention's deviation from the mean value) of
``nystrom_attention`` in fp32 and in fp64 against a dense
fp64 evaluation with a direct solve, for solver='newton' with the defaults (Newton–Schulz
and one step of iterative refinement), 'newton' with ``ns_refine=False`` (Newton–Schulz
alone), 'exact' and 'cg'. Then the CPU time of the refinement step against the whole
attention.

    python benchmarks/numerics.py    # prints the tables of docs/benchmarks.md#numerics
"""
import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from devtools.timing import load_average, machine, timed
from lapformer_mm.ops import DEFAULT_NS_ITERS, nystrom_attention

SPREADS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
N, M, D, LAM, EPS, WHITEN = 400, 49, 32, 4.0, 0.01, 1e-5


def inputs(spread, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 1, 1, D, generator=gen, dtype=torch.float64)
    q = base + spread * torch.randn(1, 1, N, D, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 1, N, D, generator=gen, dtype=torch.float64)
    landmarks = base + spread * torch.randn(1, 1, M, D, generator=gen, dtype=torch.float64)
    return q, v, landmarks


def dense_reference(q, v, landmarks):
    """fp64, explicit (N, M, d) differences, torch.linalg.solve."""
    def kernel(x, y):
        return torch.exp(-(x.unsqueeze(-2) - y.unsqueeze(-3)).abs().sum(-1) / LAM)
    c = kernel(q, landmarks)
    p = kernel(landmarks, landmarks) + EPS * torch.eye(M, dtype=torch.float64)
    # Centred twice: with nearly equal kernel values one pass leaves a rounding residue
    # that the whitening carries into the result (docs/benchmarks.md).
    centred = c - c.mean(-1, keepdim=True)
    centred = centred - centred.mean(-1, keepdim=True)
    z = centred / torch.sqrt(centred.var(-2, unbiased=False, keepdim=True) + WHITEN) + 1.0 / M
    mean = v.mean(-2, keepdim=True)
    out = z @ torch.linalg.solve(p, c.mT @ (v - mean) / N) + mean
    return out, mean, torch.linalg.cond(p).item()


def errors():
    rows = []
    for spread in SPREADS:
        q, v, landmarks = inputs(spread)
        ref, mean, cond = dense_reference(q, v, landmarks)
        row = dict(spread=spread, cond=cond)
        for dtype, tag in ((torch.float32, 'fp32'), (torch.float64, 'fp64')):
            qd, vd, ld = q.to(dtype), v.to(dtype), landmarks.to(dtype)
            outs = {s: nystrom_attention(qd, qd, vd, ld, solver=s)
                    for s in ('newton', 'exact', 'cg')}
            outs['newton, ns_refine=False'] = nystrom_attention(qd, qd, vd, ld, ns_refine=False)
            for name, out in outs.items():
                # Against the attention's deviation from the mean value, which v̄ would hide.
                row[f'{name} {tag}'] = ((out.double() - ref).norm() / (ref - mean).norm()).item()
        rows.append(row)
    return rows


def refinement_cost(repeats=30):
    """CPU ms of the attention (3136 tokens, 2 heads, fp32) without and with ``ns_refine``:
    medians of calls that alternate between the two (a shared machine's load hits both)."""
    torch.manual_seed(0)
    q, v = torch.randn(1, 2, 3136, D), torch.randn(1, 2, 3136, D)
    landmarks = torch.randn(1, 2, M, D)
    times = {False: [], True: []}
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first round warms up
            for refine in (False, True):
                times[refine].append(timed(
                    lambda refine=refine: nystrom_attention(q, q, v, landmarks,
                                                            ns_refine=refine))[0])
    return tuple(1e3 * statistics.median(times[refine][1:]) for refine in (False, True))


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split('\n\n')[0]).parse_args(argv)
    columns = ['newton', 'newton, ns_refine=False', 'exact', 'cg']
    rows = errors()
    print(f'newton: {DEFAULT_NS_ITERS} Newton–Schulz iterations and one refinement step (the '
          f'defaults); torch {torch.__version__}, {torch.get_num_threads()} threads, '
          f'{machine()}, load {load_average()}')
    for tag in ('fp32', 'fp64'):
        print('\n| spread | cond(P) | ' + ' | '.join(f'{c} ({tag})' for c in columns) + ' |')
        print('|---|---|' + '---|' * len(columns))
        for row in rows:
            print(f"| {row['spread']:g} | {row['cond']:.3g} | "
                  + ' | '.join(f"{row[f'{c} {tag}']:.1e}" for c in columns) + ' |')
    plain, refined = refinement_cost()
    print(f'\nCPU cost, N = 3136, 2 heads, m = 49, fp32 (medians of 30 alternating calls): '
          f'{refined:.2f} ms '
          f'(default), {plain:.2f} ms with ns_refine=False.')

if __name__ == '__main__':
    main()
