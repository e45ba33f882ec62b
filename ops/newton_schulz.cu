// Newton-Schulz inverse of symmetric positive definite m x m matrices, all
// iterations of one matrix inside one thread block:
//
//   X_0 = I / ||P||_inf              (init_authors = 0)
//   X_0 = 1.8 / ||P||_inf^2 * P      (init_authors = 1, the LaplacianFormer code's start)
//   X_{t+1} = 2 X_t - X_t (P X_t)
//
// X and T = P X live in shared memory (dynamic, 2 m^2 elements), and so does
// P when it fits (`p_in_shared`, 3 m^2 elements); otherwise P is read from
// global memory, where it stays in L1/L2 because every iteration rereads it.
// S is float for fp32/fp16/bf16 callers (the host casts to fp32) and double
// for fp64. The m x m products use 4x4 register micro-tiles, one per thread
// (the host launches ceil(m/4)^2 threads rounded up to a warp), so the
// in-place update X <- 2X - X T only needs a barrier between computing and
// writing. Blocks loop over the batch beyond the grid limit.
#include "lap_common.cuh"

#define NS_MT 4   // micro-tile edge

// One untyped dynamic shared buffer: templates may not redeclare an extern
// __shared__ array with a different element type. (The CPU emulation shim
// defines this macro itself.)
#ifdef __CUDA_ARCH__
#define LAP_DYNAMIC_SHARED_BYTES(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// out[4x4 tile (ti, tj)] = sum_k a[row, k] * b[k, col] for m x m row-major
// a, b; entries outside the matrix are left 0.
template <typename S>
__device__ __forceinline__ void ns_tile_product(const S* a, const S* b, int m, int ti, int tj,
                                                S out[NS_MT][NS_MT]) {
#pragma unroll
    for (int r = 0; r < NS_MT; ++r)
#pragma unroll
        for (int c = 0; c < NS_MT; ++c) out[r][c] = S(0);
    const int r0 = ti * NS_MT, c0 = tj * NS_MT;
    for (int k = 0; k < m; ++k) {
        S av[NS_MT], bv[NS_MT];
#pragma unroll
        for (int r = 0; r < NS_MT; ++r) av[r] = (r0 + r < m) ? a[(r0 + r) * m + k] : S(0);
#pragma unroll
        for (int c = 0; c < NS_MT; ++c) bv[c] = (c0 + c < m) ? b[k * m + c0 + c] : S(0);
#pragma unroll
        for (int r = 0; r < NS_MT; ++r)
#pragma unroll
            for (int c = 0; c < NS_MT; ++c) out[r][c] += av[r] * bv[c];
    }
}

// At most 1024 threads (m <= 128): the bound caps registers at 64 per thread
// so a full block of 1024 threads can launch.
template <typename S>
__global__ void __launch_bounds__(1024) newton_schulz(const S* __restrict__ P, S* __restrict__ out, long long batch, int m,
                              int iters, int init_authors, int p_in_shared) {
    LAP_DYNAMIC_SHARED_BYTES(smem_bytes);
    S* smem = reinterpret_cast<S*>(smem_bytes);
    S* X = smem;
    S* T = smem + m * m;
    S* Ps = smem + 2 * m * m;
    __shared__ S norm_shared;
    const int tid = threadIdx.x;
    const int nthreads = blockDim.x;
    const int mm = m * m;
    const int nt = (m + NS_MT - 1) / NS_MT;
    const bool has_tile = tid < nt * nt;
    const int ti = has_tile ? tid / nt : 0;
    const int tj = has_tile ? tid % nt : 0;

    for (long long b = blockIdx.x; b < batch; b += gridDim.x) {
        const S* Pg = P + b * (long long)mm;
        const S* Pm = Pg;
        if (p_in_shared) {
            for (int e = tid; e < mm; e += nthreads) Ps[e] = Pg[e];
            Pm = Ps;
        }
        // ||P||_inf: row sums into T, then one thread takes the max.
        for (int r = tid; r < m; r += nthreads) {
            S s = S(0);
            for (int c = 0; c < m; ++c) s += lap_abs(Pg[r * m + c]);
            T[r] = s;
        }
        __syncthreads();
        if (tid == 0) {
            S mx = T[0];
            for (int r = 1; r < m; ++r) mx = T[r] > mx ? T[r] : mx;
            norm_shared = mx;
        }
        __syncthreads();
        const S norm = norm_shared;
        for (int e = tid; e < mm; e += nthreads) {
            const int r = e / m, c = e % m;
            X[e] = init_authors ? Pg[e] * (S(1.8) / (norm * norm)) : (r == c ? S(1) / norm : S(0));
        }
        __syncthreads();

        for (int it = 0; it < iters; ++it) {
            S acc[NS_MT][NS_MT];
            if (has_tile) {
                ns_tile_product(Pm, X, m, ti, tj, acc);
#pragma unroll
                for (int r = 0; r < NS_MT; ++r)
#pragma unroll
                    for (int c = 0; c < NS_MT; ++c) {
                        const int row = ti * NS_MT + r, col = tj * NS_MT + c;
                        if (row < m && col < m) T[row * m + col] = acc[r][c];
                    }
            }
            __syncthreads();
            if (has_tile) ns_tile_product((const S*)X, (const S*)T, m, ti, tj, acc);
            // Every thread must finish reading X before any thread overwrites it.
            __syncthreads();
            if (has_tile) {
#pragma unroll
                for (int r = 0; r < NS_MT; ++r)
#pragma unroll
                    for (int c = 0; c < NS_MT; ++c) {
                        const int row = ti * NS_MT + r, col = tj * NS_MT + c;
                        if (row < m && col < m) X[row * m + col] = S(2) * X[row * m + col] - acc[r][c];
                    }
            }
            __syncthreads();
        }
        S* ob = out + b * (long long)mm;
        for (int e = tid; e < mm; e += nthreads) ob[e] = X[e];
        // The next matrix of this block reuses X, T and Ps.
        __syncthreads();
    }
}
