// Newton-Schulz inverse of symmetric positive definite m x m matrices, all
// iterations of one matrix inside one thread block:
//
//   X_0 = I / ||P||_inf              (init_authors = 0)
//   X_0 = 1.8 / ||P||_inf^2 * P      (init_authors = 1, the LaplacianFormer code's start)
//   X_{t+1} = 2 X_t - X_t (P X_t)
//
// Layout: in shared memory every matrix is stored padded to mp x ld, with
// mp = m rounded up to 4 and a row stride ld = mp or mp + 4 such that
// ld = 4 (mod 8). The padding holds zeros, and the iteration keeps it zero
// (P's padded rows and columns are zero, so are those of P X and X P X), so
// the products run over whole 4 x 4 tiles without bounds checks. ld = 4
// (mod 8) puts rows 4 apart 16 banks apart, so the two rows a warp reads at
// once never share a bank.
//
// Products: each thread owns one 4 x 4 tile (rows 4 ti.., columns 4 tj..;
// the host launches (mp/4)^2 threads rounded up to a warp). Per step over k
// it reads 16 bytes of each of its 4 rows of the left operand (the next
// 16 / sizeof(S) values of k) and 16 bytes of the right operand's row k at
// its 4 columns per k: vector loads, about 3 shared-memory wavefronts per k
// and warp for 16 FMAs per thread.
//
// X and T = P X always live in shared memory; P does too when P_SHARED
// (3 padded matrices fit the opt-in limit), otherwise it is read from global
// memory (L1/L2-resident: every iteration rereads it). S is float for
// fp32/fp16/bf16 callers (the host casts to fp32) and double for fp64.
// Blocks loop over the batch beyond the grid limit.
#include "newton_schulz.cuh"

// At most 1024 threads (m <= 128): the bound caps registers at 64 per thread
// so a full block of 1024 threads can launch.
template <typename S, bool P_SHARED>
__global__ void __launch_bounds__(1024)
newton_schulz(const S* __restrict__ P, S* __restrict__ out, long long batch, int m, int iters,
              int init_authors) {
    LAP_DYNAMIC_SHARED_BYTES(smem_bytes);
    const int mp = (m + NS_MT - 1) / NS_MT * NS_MT;
    const int ld = ns_stride(mp);
    const int size = mp * ld;
    S* X = reinterpret_cast<S*>(smem_bytes);
    S* T = X + size;
    S* Ps = T + size;
    const int tid = threadIdx.x;
    const int nthreads = blockDim.x;

    for (long long b = blockIdx.x; b < batch; b += gridDim.x) {
        const S* Pg = P + b * (long long)m * m;
        // Padded copies (zeros outside m x m).
        for (int e = tid; e < size; e += nthreads) {
            const int r = e / ld, c = e % ld;
            if (P_SHARED) Ps[e] = (r < m && c < m) ? Pg[r * m + c] : S(0);
            T[e] = S(0);
        }
        __syncthreads();
        ns_iterate<S, P_SHARED>(Pg, Ps, X, T, m, iters, init_authors);
        S* ob = out + b * (long long)m * m;
        for (int e = tid; e < m * m; e += nthreads) ob[e] = X[(e / m) * ld + e % m];
        // The next matrix of this block reuses X, T and Ps.
        __syncthreads();
    }
}
