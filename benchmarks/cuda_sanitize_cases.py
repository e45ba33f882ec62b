"""Launch every CUDA kernel instantiation once on small, odd shapes (for compute-sanitizer).

    export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    compute-sanitizer --tool memcheck python3 benchmarks/cuda_sanitize_cases.py
    compute-sanitizer --tool racecheck python3 benchmarks/cuda_sanitize_cases.py

Without PyTorch's caching allocator every tensor is its own cudaMalloc, so
memcheck sees a read or write past any tensor's end. Shapes are not multiples
of the tiles (tails in N, M and d), the gradient runs with one reduction slice
and with several, and Newton–Schulz runs with P in shared memory and in global
memory, fp32 and fp64; the fused attention (every stage, fp32/fp16/bf16, both kernels,
tied and separate keys, strided operands, two row slices) forward and backward. Each
result is also compared with the ops' PyTorch reference (``impl='reference'``), so a
wrong value fails the script too (exit 1).
"""
import sys

import torch

from lapformer_mm.ops import cuda_runtime as rt
from lapformer_mm.ops import cupy_ops
from lapformer_mm.ops.solvers import newton_schulz_iterate


def close(name, got, expected, rtol):
    scale = expected.abs().max().item() or 1.0
    err = (got.double() - expected.double()).abs().max().item() / scale
    ok = err <= rtol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max error / max |expected| = {err:.2e}")
    return ok


def pairwise_cases():
    ops = torch.ops.lapformer_mm
    ok = True
    gen = torch.Generator(device='cuda').manual_seed(0)
    for dtype, rtol in ((torch.float32, 1e-5), (torch.float64, 1e-12), (torch.float16, 2e-2),
                        (torch.bfloat16, 5e-2)):
        for name, kind in rt.KINDS.items():
            x = torch.randn(2, 67, 33, device='cuda', generator=gen).to(dtype)
            y = torch.randn(2, 5, 33, device='cuda', generator=gen).to(dtype)
            lam = 4.0 if kind == rt.LAPLACIAN else 40.0
            kmat = cupy_ops.fused_pairwise_forward(x, y, lam, kind)
            tag = f'{dtype} kind={kind}'
            ok &= close(f'forward {tag}', kmat,
                        ops.pairwise_kernel(x, y, lam, name, 'reference'), rtol)
            g = torch.randn(kmat.shape, device='cuda', generator=gen).to(dtype)
            expected = ops.pairwise_kernel_backward(g, kmat, x, y, lam, name, True, True,
                                                    'reference')
            for blocks in (1, 10_000):  # one reduction slice, and as many as the sizes allow
                got = cupy_ops.fused_pairwise_backward(g, kmat, x, y, lam, kind, True, True, blocks)
                ok &= close(f'dx {tag} blocks={blocks}', got[0], expected[0], rtol)
                ok &= close(f'dy {tag} blocks={blocks}', got[1], expected[1], rtol)
    return ok


def newton_schulz_cases():
    ok = True
    gen = torch.Generator(device='cuda').manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        for m in (5, 49):
            pts = torch.randn(3, m, 8, device='cuda', dtype=torch.float64,
                              generator=gen).cumsum(1) * 0.3
            P = (torch.exp(-torch.cdist(pts, pts, p=1.0) / 4.0) + 0.01 * torch.eye(m, device='cuda',
                                                                                  dtype=torch.float64)).to(dtype)
            mp, ld = rt.newton_schulz_stride(m)
            expected = newton_schulz_iterate(P, 12, 'identity')
            for matrices in (3, 2):  # P in shared memory, then P read from global memory
                limit = matrices * P.element_size() * mp * ld + rt.NS_STATIC_SMEM
                got = cupy_ops.fused_newton_schulz(P, 12, False, limit)
                ok &= close(f'newton_schulz {dtype} m={m} matrices_in_shared={matrices}', got,
                            expected, 1e-4 if dtype == torch.float32 else 1e-10)
    return ok


def fused_attention_cases():
    """Every stage of ops/nystrom_attention.cu, forward and backward, against the reference."""
    from lapformer_mm.ops import nystrom_attention, pool_landmarks
    ok = True
    gen = torch.Generator(device='cuda').manual_seed(2)
    for dtype, rtol in ((torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
        for kernel, lam in (('laplacian', 4.0), ('gaussian', 20.0)):
            for tied in (True, False):
                # N = 70: two row slices of 64 (the 8 blocks asked for) and tails everywhere.
                qkv = torch.randn(2, 70, 3 * 2 * 17, device='cuda', generator=gen)
                q, k, v = (t.view(2, 70, 2, 17).transpose(1, 2).to(dtype)
                           for t in qkv.chunk(3, dim=-1))
                k = q if tied else k
                landmarks = pool_landmarks(k, (7, 10), 3)
                grad = torch.randn(2, 2, 70, 17, device='cuda', generator=gen).to(dtype)
                results = {}
                for impl in ('cupy', 'reference'):
                    leaves = [t.detach().requires_grad_() for t in (q, k, v, landmarks)]
                    if tied:
                        leaves[1] = leaves[0]
                    out = nystrom_attention(*leaves, kernel=kernel, lam=lam, impl=impl)
                    wrt = [leaves[i] for i in ((0, 2, 3) if tied else (0, 1, 2, 3))]
                    results[impl] = (out,) + torch.autograd.grad(out, wrt, grad)
                tag = f'{dtype} {kernel} tied={tied}'
                for name, got, expected in zip(('out', 'dq', 'dk', 'dv', 'dL')
                                               if not tied else ('out', 'dq', 'dv', 'dL'),
                                               results['cupy'], results['reference']):
                    ok &= close(f'fused attention {name} {tag}', got, expected, rtol)
    return ok


def main():
    if not torch.cuda.is_available():
        raise SystemExit('cuda_sanitize_cases.py needs a CUDA device')
    from lapformer_mm.ops import cupy_ops as ops_module
    ops_module.target_blocks = lambda device: 8  # two row slices at N = 70, bh = 4
    ok = pairwise_cases() & newton_schulz_cases() & fused_attention_cases()
    torch.cuda.synchronize()
    print('all cases ok' if ok else 'some cases FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
