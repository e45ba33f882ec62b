"""Host time per call of the CUDA path, and its launches and ATen ops, without a GPU.

CuPy is replaced by devtools/fake_cupy.py (a launch records nothing and runs nothing), and
the fused op's CuPy path is chosen for CPU tensors, so what is timed is the host side a
GPU call pays before the kernels run: the custom op's dispatch, autograd, argument
packing, the launches' Python. Rows (median of ``--repeats`` calls after a warm-up):

* ``op``: ``torch.ops.lapformer_mm.nystrom_attention`` on inputs without grad;
* ``entry``: ``nystrom_attention`` (the module's entry: dispatch decision, op, view);
* ``entry+grad``: the same with inputs requiring grad (the autograd node is built);
* ``entry fwd+bwd``: that and the backward op;
* ``autograd.Function`` rows: the op and its backward op through the package's
  ``autograd.Function`` (``torch.library`` define/impl underneath), without the entry;
* ``register_autograd`` rows: the same implementation defined as a
  ``torch.library.custom_op`` with ``register_autograd``, the other way to attach autograd;
then the launches + ATen compute ops of one LaplacianAttention call (C = 64, 2 heads;
devtools/op_counts.py). The module's own projections and convolution compute on the CPU
here, so its time is not a host time and is not shown.

    python benchmarks/cuda_host.py            # prints a markdown table
"""
import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

if __package__ in (None, ''):
    # Run as a script (python benchmarks/NAME.py): the checkout's root holds devtools/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from devtools import fake_cupy
from devtools.cuda_emulation import route_cpu_tensors_to_cuda_backend
from devtools.op_counts import module_call_counts
from devtools.timing import load_average
from lapformer_mm.models.attention import LaplacianAttention
from lapformer_mm.ops import AttentionOptions, nystrom_attention, pool_landmarks
from lapformer_mm.ops.attention import NystromAttentionFunction as NystromAttention
from lapformer_mm.ops.attention import _backward_impl as nystrom_attention_backward_kernel
from lapformer_mm.ops.attention import _forward_impl as nystrom_attention_kernel
from lapformer_mm.ops.attention import nystrom_attention_op
from lapformer_mm.ops.backends import cuda as cuda_backend
from lapformer_mm.ops.backends import cuda_plan

OPTIONS = ('laplacian', 4.0, 0.01, 16, 'identity', True, 'injective', 1e-5)


def per_call_us(fns, repeats, rounds=10):
    """{name: (minimum, median) microseconds per call} of the functions ``fns`` (a dict),
    measured round-robin (``rounds`` rounds of ``repeats // rounds`` calls each) so that
    load on shared cores reaches every row alike; the minimum is the least disturbed."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(max(1, repeats // rounds)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: (1e6 * min(t), 1e6 * statistics.median(t)) for name, t in times.items()}


def install_fake():
    """The fake CuPy, and impl='cupy' for CPU tensors on an H200's limits; returns a
    function undoing it."""
    saved = {}

    def setattr_(obj, name, value):
        saved.setdefault(name, getattr(obj, name))
        setattr(obj, name, value)
    fake_cupy.install(cuda_backend, setattr_, current_device=None, record=False)
    route_cpu_tensors_to_cuda_backend(setattr_, cuda_plan.DeviceLimits((9, 0), 132,
                                                                          227 * 1024, 13))

    def undo():
        for name, value in saved.items():
            setattr(cuda_backend, name, value)
    return undo


def register_autograd_variant():
    """The same op as torch.library.custom_op with register_autograd: the other way to
    attach autograd, kept here to measure the choice (lapformer_mm/ops/attention.py)."""
    @torch.library.custom_op('lapformer_host_bench::nystrom_attention', mutates_args=())
    def forward(q: torch.Tensor, k: Optional[torch.Tensor], v: torch.Tensor,
                landmarks: torch.Tensor, kernel: str, lam: float, eps: float, iters: int,
                ns_init: str, ns_refine: bool, normalize: str, whiten_eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return nystrom_attention_kernel(q, k, v, landmarks, kernel, lam, eps, iters, ns_init,
                                        ns_refine, normalize, whiten_eps, 'cupy')

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:4], *output[1:])
        ctx.options = inputs[4:7] + inputs[9:]
        ctx.set_materialize_grads(False)

    def backward(ctx, grad, *unused):
        q, k, v, landmarks, context, inverse, stats = ctx.saved_tensors
        dq, dk, dv, dl = nystrom_attention_backward_kernel(grad, q, k, v, landmarks, context,
                                                           inverse, stats, *ctx.options, 'cupy')
        return (dq, None if k is None else dk, dv, dl) + (None,) * 8

    forward.register_autograd(backward, setup_context=setup)
    return forward


def rows(repeats):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 64, 3 * 64, generator=gen)
    q, k, v = (t.view(2, 64, 2, 32).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    landmarks = pool_landmarks(k, (8, 8), 7)
    grads = [t.detach().requires_grad_() for t in (q, k, v, landmarks)]
    options = AttentionOptions()
    g = torch.ones(2, 2, 64, 32)
    fns = {}

    def add(name, fn):
        fns[name] = fn

    add('op', lambda: nystrom_attention_op(q, k, v, landmarks, *OPTIONS, 'cupy'))
    add('entry', lambda: nystrom_attention(q, k, v, landmarks, options))
    add('entry+grad', lambda: nystrom_attention(*grads, options))
    add('entry fwd+bwd', lambda: torch.autograd.grad(nystrom_attention(*grads, options), grads, g))
    add('autograd.Function: fwd+grad',
        lambda: NystromAttention.apply(*grads, *OPTIONS, 'cupy')[0])
    add('autograd.Function: fwd+bwd', lambda: torch.autograd.grad(
        NystromAttention.apply(*grads, *OPTIONS, 'cupy')[0], grads, g.transpose(1, 2)))
    other = register_autograd_variant()
    add('register_autograd: fwd+grad', lambda: other(*grads, *OPTIONS)[0])
    add('register_autograd: fwd+bwd', lambda: torch.autograd.grad(
        other(*grads, *OPTIONS)[0], grads, g.transpose(1, 2)))
    results = per_call_us(fns, repeats)
    torch.manual_seed(0)
    module = LaplacianAttention(64, 2)
    x = torch.randn(2, 64, 64, requires_grad=True)
    return results, module_call_counts(module, x, (8, 8), cuda_backend)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--repeats', type=int, default=1000)
    args = p.parse_args(argv)
    undo = install_fake()
    try:
        results, (forward, both) = rows(args.repeats)
    finally:
        undo()
    print(f'# host time per call, fake CuPy (torch {torch.__version__}, '
          f'{torch.get_num_threads()} threads, load {load_average()})\n')
    print('| call | µs (minimum) | µs (median) |\n|---|---|---|')
    for name, (low, median) in results.items():
        print(f'| {name} | {low:.1f} | {median:.1f} |')
    print('\n| LaplacianAttention call | launches | ATen compute ops | sum | views | allocations |')
    print('|---|---|---|---|---|---|')
    for name, counter in (('forward', forward), ('forward+backward', both)):
        t = counter.totals()
        print(f"| {name} | {t['launches']} | {t['compute']} | {t['launches+compute']} | "
              f"{t['views']} | {t['allocations']} |")
    return 0


if __name__ == '__main__':
    sys.exit(main())
