"""Launch the fused attention's kernels once per case on small, odd shapes (for compute-sanitizer).

    export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    compute-sanitizer --tool memcheck --kernel-name kns=nys_ --report-api-errors no \
        python3 benchmarks/cuda_sanitize_cases.py
    (and --tool racecheck, synccheck, initcheck; kns=nys_: our kernels only; failing API
    calls, which torch, cuBLAS and CuPy make at start-up by design, not reported)

Without PyTorch's caching allocator every tensor is its own cudaMalloc, so memcheck sees a
read or write past any tensor's end. The cases are the fused ones of the backbones: m = 49
and m = 64 landmarks, d_v = 32 and 64, tied and separate keys, fp32 (and bf16 at m = 49),
N with tails in every tile and two row slices; each forward and backward against the
reference (``impl='reference'``), so a wrong value fails the script too (exit 1).
"""
import sys

import torch


def close(name, got, expected, rtol):
    scale = expected.abs().max().item() or 1.0
    err = (got.double() - expected.double()).abs().max().item() / scale
    ok = err <= rtol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max error / max |expected| = {err:.2e}")
    return ok


def fused_attention_cases():
    from lapformer_mm.ops import nystrom_attention, pool_landmarks
    ok = True
    gen = torch.Generator().manual_seed(2)
    for grid, dv, dtype, rtol in ((7, 32, torch.float32, 1e-4), (7, 64, torch.float32, 1e-4),
                                  (8, 32, torch.float32, 1e-4), (8, 64, torch.float32, 1e-4),
                                  (7, 32, torch.bfloat16, 5e-2)):
        for tied in (True, False):
            hw = (9, 10)
            n = hw[0] * hw[1]
            # Every operand of the fused kernels made on the host and copied over: the
            # sanitizer checks only our kernels (--kernel-name), and initcheck counts memory
            # as written by a checked kernel or by a memcpy, not by PyTorch's unchecked ones.
            qk = torch.randn(2, n, 2 * 2 * 17, generator=gen).to(dtype)
            q, k = (t.view(2, n, 2, 17).transpose(1, 2) for t in qk.chunk(2, dim=-1))
            landmarks = pool_landmarks(q if tied else k, hw, grid).cuda()
            q, k = (t.view(2, n, 2, 17).transpose(1, 2) for t in qk.cuda().chunk(2, dim=-1))
            k = q if tied else k
            v = torch.randn(2, 2, n, dv, generator=gen).to(dtype).cuda()
            grad = torch.randn(2, 2, n, dv, generator=gen).to(dtype).cuda()
            results = {}
            for impl in ('cupy', 'reference'):
                leaves = [t.detach().requires_grad_() for t in (q, k, v, landmarks)]
                if tied:
                    leaves[1] = leaves[0]
                out = nystrom_attention(*leaves, impl=impl)
                wrt = [leaves[i] for i in ((0, 2, 3) if tied else (0, 1, 2, 3))]
                results[impl] = (out,) + torch.autograd.grad(out, wrt, grad)
            tag = f'm={grid * grid} dv={dv} {dtype} tied={tied}'
            names = ('out', 'dq', 'dv', 'dL') if tied else ('out', 'dq', 'dk', 'dv', 'dL')
            for name, got, expected in zip(names, results['cupy'], results['reference']):
                ok &= close(f'fused attention {name} {tag}', got, expected, rtol)
    return ok


def main():
    if not torch.cuda.is_available():
        raise SystemExit('cuda_sanitize_cases.py needs a CUDA device')
    from lapformer_mm.ops.backends import cuda
    cuda.target_blocks = lambda device: 8  # two row slices at N = 90, bh = 4
    ok = fused_attention_cases()
    torch.cuda.synchronize()
    print('all cases ok' if ok else 'some cases FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
