"""Benchmarks and measurements of the Laplacian Nyström attention (a script, not a test).

Two studies, each printing a table:

``python benchmarks/attention.py speed``
    Time and peak memory of forward and forward+backward versus the number of
    tokens N for Laplacian Nyström, Gaussian Nyström, softmax
    ``scaled_dot_product_attention`` and dense Laplacian attention (while its
    N×N matrix fits the ``--dense-max`` limit); writes a plot
    (``--plot``, default docs/bench_attention.png).

``python benchmarks/attention.py micro``
    The measurements behind two CPU choices of the reference ops: the
    Newton–Schulz solve on one thread, and the landmark gradient in blocks.

``python benchmarks/attention.py soft [--threads 1 0]``
    Forward and forward+backward of the Laplacian attention (the C++ CPU kernels and the
    PyTorch reference) beside SOFT's attention core written out from its public
    description (Gaussian kernel through GEMMs, 20 Newton iterations with the closed-form
    inverse gradient), same shapes and landmarks, models interleaved in one process; the
    ratios and the 16,384 -> 65,536 growth.

``python benchmarks/attention.py ns``
    Newton–Schulz iterations needed to reach a spectral residual
    ||I - P X||_2 < tol on landmark matrices P = k(L, L) + eps·I of smooth
    pooled features, bucketed by condition number; this chose
    ``lapformer_mm.ops.DEFAULT_NS_ITERS``.

Peak memory is measured with the PyTorch profiler's allocator events
(``profile_memory=True``), which see every CPU tensor allocation including
those made inside native kernels.
"""
import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from devtools.profiling import peak_memory_bytes
from devtools.timing import best_time, load_average, machine, timed, wall_times
from lapformer_mm.cli import int_at_least, positive_float
from lapformer_mm.ops import (
    DEFAULT_NS_ITERS,
    injective_normalize,
    laplacian_kernel,
    nystrom_attention,
    pool_landmarks,
)
from lapformer_mm.ops.reference import newton_schulz as newton_schulz_iterate

# ---------------------------------------------------------------- NS study
#: Blur widths (grid cells) of the features: smooth to rough landmark matrices.
SMOOTHNESSES = (1.0, 3.0, 6.0)
#: --grid-hw's least value: reflect padding needs a map wider than the widest blur's radius.
MIN_GRID_HW = int(2 * max(SMOOTHNESSES)) + 2


def smooth_features(batch, hw, dim, scale, smoothness, generator):
    """Gaussian-blurred noise (batch, 1, H·W, dim), unit std times ``scale``."""
    height, width = hw
    noise = torch.randn(batch * dim, 1, height, width, generator=generator)
    radius = int(2 * smoothness) + 1
    taps = torch.arange(-radius, radius + 1, dtype=torch.float32)
    blur = torch.exp(-taps ** 2 / (2 * smoothness ** 2))
    blur = blur / blur.sum()
    padded = F.pad(noise, (radius, radius, radius, radius), mode='reflect')
    field = F.conv2d(F.conv2d(padded, blur.view(1, 1, 1, -1)), blur.view(1, 1, -1, 1))
    field = field.reshape(batch, dim, height, width)
    field = field / field.std(dim=(2, 3), keepdim=True)
    return (scale * field).flatten(2).transpose(1, 2).unsqueeze(1)


def iterations_to_tol(P, init, tol, max_iters):
    """Per matrix, the first Newton–Schulz step count with ||I - P X||_2 < tol.

    Iterates in fp32 (as the op does) and measures the residual in fp64;
    -1 where ``max_iters`` steps are not enough.
    """
    p64 = P.double()
    eye = torch.eye(P.shape[-1], dtype=torch.float64)
    needed = torch.full(P.shape[:-2], -1, dtype=torch.long)
    for steps in range(max_iters + 1):
        x = newton_schulz_iterate(P.float(), steps, init).double()
        residual = torch.linalg.matrix_norm(eye - p64 @ x, ord=2)
        newly = (residual < tol) & (needed < 0)
        needed[newly] = steps
        if (needed >= 0).all():
            break
    return needed


def ns_study(args):
    generator = torch.Generator().manual_seed(args.seed)
    hw = (args.grid_hw, args.grid_hw)
    conds, needs = [], {'identity': [], 'authors': []}
    for scale in args.scales:
        for smoothness in SMOOTHNESSES:
            feats = smooth_features(args.samples, hw, args.head_dim, scale, smoothness,
                                    generator)
            landmarks = pool_landmarks(feats, hw, args.landmark_grid)
            w = laplacian_kernel(landmarks.double(), landmarks.double(), args.lam)
            P = w + args.eps * torch.eye(w.shape[-1], dtype=torch.float64)
            eig = torch.linalg.eigvalsh(P)
            conds.append((eig[..., -1] / eig[..., 0]).flatten())
            for init in needs:
                needs[init].append(iterations_to_tol(P, init, args.tol,
                                                     args.max_iters).flatten())
    cond = torch.cat(conds)
    needs = {k: torch.cat(v) for k, v in needs.items()}
    edges = [1, 10, 100, 500, 1000, 2000, 5000]
    print(f'# Newton-Schulz iterations to ||I - P X||_2 < {args.tol:g} '
          f'(fp32 iterations, fp64 residual); P = k(L, L) + {args.eps:g} I, '
          f'm = {args.landmark_grid ** 2}, d = {args.head_dim}, lam = {args.lam:g}')
    print('| condition number | matrices | identity start: max (median) | '
          'authors start: max (median) |')
    print('|---|---|---|---|')
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (cond >= lo) & (cond < hi)
        if not sel.any():
            continue
        cells = []
        for init in ('identity', 'authors'):
            n = needs[init][sel]
            worst = 'not reached' if (n < 0).any() else str(int(n.max()))
            cells.append(f'{worst} ({int(n.median())})')
        print(f'| {lo}-{hi} | {int(sel.sum())} | {cells[0]} | {cells[1]} |')
    upto = cond < args.cond_limit
    ident = needs['identity'][upto]
    print(f'identity start, cond < {args.cond_limit:g}: max iterations '
          f'{"not reached" if (ident < 0).any() else int(ident.max())} over '
          f'{int(upto.sum())} matrices (max cond {float(cond[upto].max()):.0f})')


# ---------------------------------------------------------------- speed study
def dense_laplacian_attention(q, k, v, lam):
    """normalize(k(q, k)) · v with the full N×N kernel matrix (the exact limit)."""
    return injective_normalize(laplacian_kernel(q, k, lam)) @ v


def grid_for(num_tokens):
    """A near-square (H, W) with H·W = num_tokens."""
    height = int(math.isqrt(num_tokens))
    while num_tokens % height:
        height -= 1
    return height, num_tokens // height


METHOD_NAMES = ('laplacian_nystrom', 'gaussian_nystrom', 'softmax_sdpa', 'dense_laplacian')


def make_methods(args):
    """name -> (max N or None, fn(q, k, v, hw))."""
    def nystrom(kernel):
        def run(q, k, v, hw):
            landmarks = pool_landmarks(k, hw, args.landmark_grid)
            return nystrom_attention(q, k, v, landmarks, kernel=kernel, lam=args.lam)
        return run
    return {
        'laplacian_nystrom': (None, nystrom('laplacian')),
        'gaussian_nystrom': (None, nystrom('gaussian')),
        'softmax_sdpa': (args.sdpa_max,
                         lambda q, k, v, hw: F.scaled_dot_product_attention(q, k, v)),
        'dense_laplacian': (args.dense_max,
                            lambda q, k, v, hw: dense_laplacian_attention(q, k, v, args.lam)),
    }


def prepare(method, num_tokens, args):
    """The forward and the forward+backward of ``method`` at N tokens, as closures."""
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.heads, num_tokens, args.head_dim)
    q, k, v = (torch.randn(shape, generator=generator) for _ in range(3))
    hw = grid_for(num_tokens)

    def forward():
        with torch.no_grad():
            return method(q, k, v, hw)

    def forward_backward():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        method(*leaves, hw).sum().backward()
        return leaves

    return forward, forward_backward


def speed_study(args):
    torch.set_num_threads(args.threads or torch.get_num_threads())
    methods = make_methods(args)
    runs = {(name, n): prepare(method, n, args) for n in args.tokens
            for name, (limit, method) in methods.items()
            if name in args.methods and (limit is None or n <= limit)}
    print(f'# B={args.batch} h={args.heads} d={args.head_dim} m<={args.landmark_grid ** 2} '
          f'lam={args.lam:g} threads={torch.get_num_threads()} torch {torch.__version__}, '
          f'{machine()}, load average {os.getloadavg()[0]:.1f}; minimum of {args.repeats} '
          'rounds, each timing every (method, N) once in turn')
    # Round-robin: every (method, N) is timed once per round, so the ratios the targets
    # read (N against N, method against method) see the same load.
    times = {key: {'fwd': [], 'fb': []} for key in runs}
    for round_index in range(args.repeats + 1):  # round 0 warms up
        for key, (forward, forward_backward) in runs.items():
            for kind, fn in (('fwd', forward), ('fb', forward_backward)):
                result = timed(fn)
                if round_index:
                    times[key][kind].append(result)
    rows = []
    print('| method | N | fwd ms | fwd+bwd ms | fwd+bwd CPU ms | fwd+bwd peak MiB |')
    print('|---|---|---|---|---|---|')
    for (name, num_tokens), (_, forward_backward) in runs.items():
        t_fwd, t_fb = ((min(t[0] for t in times[(name, num_tokens)][kind]),
                        min(t[1] for t in times[(name, num_tokens)][kind]))
                       for kind in ('fwd', 'fb'))
        peak, _ = peak_memory_bytes(forward_backward)
        rows.append((name, num_tokens, t_fwd, t_fb, peak))
        print(f'| {name} | {num_tokens} | {t_fwd[0] * 1e3:.1f} | {t_fb[0] * 1e3:.1f} | '
              f'{t_fb[1] * 1e3:.1f} | {peak / 2 ** 20:.1f} |', flush=True)
    summarize(rows)
    print(f'load average at the end: {os.getloadavg()[0]:.1f}')
    if args.plot:
        plot(rows, args.plot)


def summarize(rows):
    """Print the two targets: 16k -> 64k growth and the speed-up over SDPA at 16k."""
    lap = 'laplacian_nystrom'
    for index, clock in enumerate(('wall', 'CPU')):
        fb = {(name, n): t[index] for name, n, _, t, _ in rows}
        if (lap, 16384) in fb and (lap, 65536) in fb:
            print(f'laplacian_nystrom fwd+bwd growth 16384 -> 65536 ({clock}): '
                  f'{fb[(lap, 65536)] / fb[(lap, 16384)]:.2f}x (target <= 4.6x)')
        if (lap, 16384) in fb and ('softmax_sdpa', 16384) in fb:
            print(f'speed-up over softmax_sdpa at N=16384, fwd+bwd ({clock}): '
                  f'{fb[("softmax_sdpa", 16384)] / fb[(lap, 16384)]:.1f}x (target >= 10x)')


def plot(rows, path):
    """Log-log fwd+bwd time and peak memory versus N, one line per method."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r[0] for r in rows):
        sel = [r for r in rows if r[0] == name]
        ns = [r[1] for r in sel]
        ax_t.plot(ns, [r[3][0] * 1e3 for r in sel], marker='o', label=name)
        ax_m.plot(ns, [r[4] / 2 ** 20 for r in sel], marker='o', label=name)
    for ax, label in ((ax_t, 'forward+backward time (ms)'),
                      (ax_m, 'forward+backward peak memory (MiB)')):
        ax.set_xscale('log', base=2)
        ax.set_yscale('log')
        ax.set_xlabel('tokens N')
        ax.set_ylabel(label)
        ax.grid(True, which='both', alpha=0.3)
    ax_t.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f'plot written to {path}')


# ---------------------------------------------------------------- SOFT comparison
class SoftNewtonInverse(torch.autograd.Function):
    """SOFT's Newton inverse of k(L, L) (fudan-zvg/SOFT, ``SOFT/kernel/inverse.py``).

    alpha = 1.8 / max row sum², P = A + 0.01 I, X0 = alpha P, ``iters`` steps of
    X <- 2X - X P X without autograd; backward -Xᵀ G Xᵀ.
    """

    @staticmethod
    def forward(ctx, mat, iters):
        with torch.no_grad():
            alpha = 0.9 * 2 / mat.sum(-1).amax(-1) ** 2
            p = mat + 0.01 * torch.eye(mat.shape[-1], dtype=mat.dtype)
            x = alpha[..., None, None] * p
            for _ in range(iters):
                x = 2 * x - x @ p @ x
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        xt = x.mT
        return -(xt @ grad @ xt), None


def soft_squared_distance(a, b):
    """||a_i - b_j||² through GEMMs, as SOFT's ``subtraction_gaussian_kernel_torch``."""
    ones_b = torch.ones(a.shape[-1], b.shape[-2], dtype=a.dtype)
    ones_a = torch.ones(a.shape[-2], a.shape[-1], dtype=a.dtype)
    return (a * a) @ ones_b + ones_a @ (b * b).mT - 2.0 * (a @ b.mT)


def soft_core(q, v, hw, grid, iters=20):
    """SOFT's attention core: exp(-|q - L|²/2) (P⁻¹ by Newton) exp(-|L - q|²/2) v, tied keys.

    Queries scaled by d^(-1/4) as SOFT does; the landmarks pooled like ours.
    """
    q = q / q.shape[-1] ** 0.25
    landmarks = pool_landmarks(q, hw, grid)
    k1 = torch.exp(-soft_squared_distance(q, landmarks) / 2)
    k2 = torch.exp(-soft_squared_distance(landmarks, landmarks) / 2)
    return (k1 @ SoftNewtonInverse.apply(k2, iters)) @ (k1.mT @ v)


SOFT_METHODS = ('laplacian_cpu', 'laplacian_reference', 'soft_core')


def soft_methods(args):
    """name -> fn(q, v, hw): our attention (tied keys, as the backbone's stages 1-3) or SOFT's."""
    def ours(impl):
        def run(q, v, hw):
            return nystrom_attention(q, q, v, pool_landmarks(q, hw, args.landmark_grid),
                                     lam=args.lam, impl=impl)
        return run
    return {'laplacian_cpu': ours('cpu'), 'laplacian_reference': ours('reference'),
            'soft_core': lambda q, v, hw: soft_core(q, v, hw, args.landmark_grid)}


def projected_inputs(num_tokens, args, generator):
    """q and v (B, N, h·d) as two projections give them, LaplacianAttention's and SOFT's
    (``W_q``, ``W_v``) alike; ``heads`` splits one into (B, h, N, d) views."""
    width = args.heads * args.head_dim
    q, v = (torch.randn(args.batch, num_tokens, width, generator=generator) for _ in range(2))

    def heads(t):
        return t.view(args.batch, num_tokens, args.heads, args.head_dim).transpose(1, 2)
    return q, v, heads


def time_soft_round(methods, num_tokens, args, generator):
    """{(name, mode): [(wall s, CPU s), ...]}: the methods interleaved, rotated per round."""
    q, v, heads = projected_inputs(num_tokens, args, generator)
    hw = grid_for(num_tokens)

    def call(name, mode):
        leaves = [t.detach().requires_grad_(mode == 'fwdbwd') for t in (q, v)]
        with torch.set_grad_enabled(mode == 'fwdbwd'):
            out = methods[name](heads(leaves[0]), heads(leaves[1]), hw)
        if mode == 'fwdbwd':
            out.sum().backward()

    keys = [(name, mode) for mode in ('fwd', 'fwdbwd') for name in methods]
    for key in keys:
        call(*key)  # warm-up
    times = {key: [] for key in keys}
    for round_index in range(args.repeats):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            wall, cpu = time.perf_counter(), time.process_time()
            call(*key)
            times[key].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def soft_study(args):
    from lapformer_mm.cpu_malloc import keep_large_blocks
    from lapformer_mm.ops.backends import cpu as cpu_ext
    if not cpu_ext.available():
        raise SystemExit('the C++ CPU kernels are not built: python setup.py build_ext --inplace')
    # As benchmarks/backbones.py: large blocks reused, not page-faulted in on every call.
    malloc = 'glibc large blocks kept' if keep_large_blocks() else 'glibc defaults'
    methods = {n: f for n, f in soft_methods(args).items() if n in args.methods}
    saved = torch.get_num_threads()
    # 0 is torch's default, which may equal a count also asked for (1 under
    # OMP_NUM_THREADS=1): measured twice, its second block would overwrite the first's medians.
    thread_counts = list(dict.fromkeys(t or saved for t in args.threads))
    print(f'# B={args.batch} h={args.heads} d={args.head_dim} m<={args.landmark_grid ** 2} '
          f'lam={args.lam:g}, {malloc}, torch {torch.__version__}, {machine()}, '
          f'{time.strftime("%Y-%m-%d %H:%M %Z")}, load average {load_average()}')
    if len(thread_counts) < len(args.threads):
        print(f'# --threads {" ".join(map(str, args.threads))} (0: torch default, {saved}) '
              f'measure {" ".join(map(str, thread_counts))}, each once')
    print('| threads | N | method | fwd ms | fwd+bwd ms | fwd+bwd CPU ms | '
          'fwd+bwd / soft_core |')
    print('|---|---|---|---|---|---|---|')
    medians = {}
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for num_tokens in args.tokens:
            generator = torch.Generator().manual_seed(args.seed)
            times = time_soft_round(methods, num_tokens, args, generator)
            for key, runs in times.items():
                medians[(torch.get_num_threads(), num_tokens) + key] = (
                    statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
            for name in methods:
                at = (torch.get_num_threads(), num_tokens, name)
                fwd, fb = medians[at + ('fwd',)], medians[at + ('fwdbwd',)]
                soft = medians.get((torch.get_num_threads(), num_tokens, 'soft_core', 'fwdbwd'))
                ratio = f'{fb[0] / soft[0]:.2f}' if soft else '-'
                print(f'| {torch.get_num_threads()} | {num_tokens} | {name} | {fwd[0] * 1e3:.1f} | '
                      f'{fb[0] * 1e3:.1f} | {fb[1] * 1e3:.1f} | {ratio} |', flush=True)
    torch.set_num_threads(saved)
    for (threads, num_tokens, name, mode), (wall, cpu) in sorted(medians.items()):
        big = medians.get((threads, 4 * num_tokens, name, mode))
        if mode == 'fwdbwd' and big is not None:
            print(f'{name}, {threads} thread(s): fwd+bwd growth {num_tokens} -> {4 * num_tokens}: '
                  f'{big[0] / wall:.2f}x wall, {big[1] / cpu:.2f}x CPU (target <= 4.6x)')
    print(f'median of {args.repeats} interleaved rounds; load average at the end: '
          f'{load_average()}')


# ---------------------------------------------------------------- micro study
def micro_study(args):
    """The two measurements behind the CPU-specific choices in the reference ops."""
    from lapformer_mm.ops import reference
    iterate = reference.newton_schulz
    P = torch.randn(1, 49, 49)
    P = P @ P.mT + torch.eye(49)
    saved = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        walls = sorted(wall_times(lambda: iterate(P, DEFAULT_NS_ITERS, 'identity'),
                                  args.repeats))
        print(f'Newton-Schulz, {DEFAULT_NS_ITERS} iterations, one 49x49 fp32 matrix, '
              f'{threads} thread(s): '
              f'min {walls[0] * 1e3:.2f} ms, median {walls[len(walls) // 2] * 1e3:.2f} ms, '
              f'max {walls[-1] * 1e3:.2f} ms over {len(walls)} runs')
    torch.set_num_threads(args.threads or saved)
    n = args.tokens
    x, y, g = torch.randn(1, n, 32), torch.randn(1, 49, 32), torch.randn(1, 49, n)
    full = g.contiguous()
    wall_full, _ = best_time(
        lambda: torch.ops.aten._cdist_backward(full, y, x, 1.0, full), args.repeats)
    wall_blocked, _ = best_time(
        lambda: reference._l1_grad_native(g, y, x), args.repeats)
    print(f'landmark gradient at N={n}, {torch.get_num_threads()} thread(s): one '
          f'_cdist_backward call {wall_full * 1e3:.1f} ms, blocks of '
          f'{reference.NATIVE_BLOCK_ROWS} rows {wall_blocked * 1e3:.1f} ms')
    torch.set_num_threads(saved)
    print(f'load average: {os.getloadavg()[0]:.1f}')


def parse_args(argv=None):
    positive, nonnegative = int_at_least(1), int_at_least(0)
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = parser.add_subparsers(dest='study', required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument('--head-dim', type=positive, default=32)
    common.add_argument('--landmark-grid', type=positive, default=7)
    common.add_argument('--lam', type=positive_float, default=4.0)
    common.add_argument('--seed', type=int, default=0)
    speed = sub.add_parser('speed', parents=[common], help='time and memory vs N')
    speed.add_argument('--tokens', type=positive, nargs='+',
                       default=[1024, 4096, 16384, 65536, 262144])
    speed.add_argument('--methods', nargs='+', default=list(METHOD_NAMES),
                       choices=METHOD_NAMES)
    speed.add_argument('--batch', type=positive, default=1)
    speed.add_argument('--heads', type=positive, default=1)
    speed.add_argument('--repeats', type=positive, default=5)
    speed.add_argument('--threads', type=nonnegative, default=0, help='0: torch default')
    speed.add_argument('--sdpa-max', type=int, default=16384)
    speed.add_argument('--dense-max', type=int, default=8192)
    speed.add_argument('--plot', default='docs/bench_attention.png')
    ns = sub.add_parser('ns', parents=[common], help='Newton-Schulz iterations study')
    ns.add_argument('--scales', type=float, nargs='+',
                    default=[0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0])
    ns.add_argument('--samples', type=positive, default=8)
    ns.add_argument('--grid-hw', type=int_at_least(MIN_GRID_HW), default=56)
    ns.add_argument('--eps', type=float, default=0.01)
    ns.add_argument('--tol', type=float, default=1e-3)
    ns.add_argument('--cond-limit', type=float, default=2000.0)
    ns.add_argument('--max-iters', type=positive, default=40)
    soft = sub.add_parser('soft', parents=[common], help="beside SOFT's attention core")
    soft.add_argument('--tokens', type=positive, nargs='+', default=[16384, 65536])
    soft.add_argument('--methods', nargs='+', default=list(SOFT_METHODS), choices=SOFT_METHODS)
    soft.add_argument('--batch', type=positive, default=1)
    soft.add_argument('--heads', type=positive, default=2)
    soft.add_argument('--repeats', type=positive, default=5)
    soft.add_argument('--threads', type=nonnegative, nargs='+', default=[1, 0],
                      help='intra-op thread counts, one table block each (0: torch default)')
    micro = sub.add_parser('micro', help='thread and blocking micro-measurements')
    micro.add_argument('--tokens', type=positive, default=262144)
    micro.add_argument('--repeats', type=positive, default=21)
    micro.add_argument('--threads', type=nonnegative, default=0,
                       help='intra-op threads of the landmark-gradient timing (0: torch '
                            'default); the Newton-Schulz timing runs on 1 and 2')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    studies = {'speed': speed_study, 'ns': ns_study, 'micro': micro_study, 'soft': soft_study}
    studies[args.study](args)


if __name__ == '__main__':
    main()
