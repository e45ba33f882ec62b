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
#include "lap_common.cuh"

#define NS_MT 4   // micro-tile edge

// One untyped dynamic shared buffer: templates may not redeclare an extern
// __shared__ array with a different element type. (The CPU emulation shim
// defines this macro itself.)
#ifdef __CUDA_ARCH__
#define LAP_DYNAMIC_SHARED_BYTES(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// 16 bytes of S: one vector load or store.
template <typename S> struct __align__(16) ns_vec { S v[16 / sizeof(S)]; };

template <typename S>
__device__ __forceinline__ ns_vec<S> ns_load_vec(const S* p) {
    return *reinterpret_cast<const ns_vec<S>*>(p);
}

// Row stride of the padded layout; must match cuda_runtime.newton_schulz_stride.
__device__ __forceinline__ int ns_stride(int mp) { return (mp % 8 == 4) ? mp : mp + 4; }

// acc = a[rows 4 ti.., :] @ b[:, cols 4 tj..] over the padded size mp.
// a is padded shared memory (stride ld), or with A_GLOBAL the unpadded
// m x m matrix in global memory.
template <typename S, bool A_GLOBAL>
__device__ __forceinline__ void ns_tile_product(const S* __restrict__ a, const S* __restrict__ b,
                                                int m, int mp, int ld, int ti, int tj,
                                                S acc[NS_MT][NS_MT]) {
    constexpr int KV = 16 / sizeof(S);
#pragma unroll
    for (int r = 0; r < NS_MT; ++r)
#pragma unroll
        for (int c = 0; c < NS_MT; ++c) acc[r][c] = S(0);
    const int r0 = ti * NS_MT, c0 = tj * NS_MT;
    for (int k0 = 0; k0 < mp; k0 += KV) {
        S av[NS_MT][KV];
#pragma unroll
        for (int r = 0; r < NS_MT; ++r) {
            if (A_GLOBAL) {
#pragma unroll
                for (int kk = 0; kk < KV; ++kk)
                    av[r][kk] = (r0 + r < m && k0 + kk < m) ? a[(r0 + r) * m + k0 + kk] : S(0);
            } else {
                const ns_vec<S> v = ns_load_vec(a + (r0 + r) * ld + k0);
#pragma unroll
                for (int kk = 0; kk < KV; ++kk) av[r][kk] = v.v[kk];
            }
        }
#pragma unroll
        for (int kk = 0; kk < KV; ++kk) {
            S bv[NS_MT];
#pragma unroll
            for (int c = 0; c < NS_MT; c += KV) {
                const ns_vec<S> v = ns_load_vec(b + (k0 + kk) * ld + c0 + c);
#pragma unroll
                for (int q = 0; q < KV; ++q) bv[c + q] = v.v[q];
            }
#pragma unroll
            for (int r = 0; r < NS_MT; ++r)
#pragma unroll
                for (int c = 0; c < NS_MT; ++c) acc[r][c] += av[r][kk] * bv[c];
        }
    }
}

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
    __shared__ S norm_shared;
    const int tid = threadIdx.x;
    const int nthreads = blockDim.x;
    const int nt = mp / NS_MT;
    const bool has_tile = tid < nt * nt;
    const int ti = has_tile ? tid / nt : 0;
    const int tj = has_tile ? tid % nt : 0;

    for (long long b = blockIdx.x; b < batch; b += gridDim.x) {
        const S* Pg = P + b * (long long)m * m;
        // Padded copies (zeros outside m x m) and ||P||_inf's row sums in T's column 0.
        for (int e = tid; e < size; e += nthreads) {
            const int r = e / ld, c = e % ld;
            if (P_SHARED) Ps[e] = (r < m && c < m) ? Pg[r * m + c] : S(0);
            T[e] = S(0);
        }
        __syncthreads();
        for (int r = tid; r < m; r += nthreads) {
            S s = S(0);
            for (int c = 0; c < m; ++c) s += lap_abs(P_SHARED ? Ps[r * ld + c] : Pg[r * m + c]);
            T[r * ld] = s;
        }
        __syncthreads();
        if (tid == 0) {
            S mx = T[0];
            for (int r = 1; r < m; ++r) mx = T[r * ld] > mx ? T[r * ld] : mx;
            norm_shared = mx;
        }
        __syncthreads();
        const S norm = norm_shared;
        const S start_scale = init_authors ? S(1.8) / (norm * norm) : S(1) / norm;
        for (int e = tid; e < size; e += nthreads) {
            const int r = e / ld, c = e % ld;
            S v = S(0);
            if (r < m && c < m) v = init_authors ? Pg[r * m + c] * start_scale : (r == c ? start_scale : S(0));
            X[e] = v;
        }
        __syncthreads();

        for (int it = 0; it < iters; ++it) {
            S acc[NS_MT][NS_MT];
            if (has_tile) {
                if (P_SHARED)
                    ns_tile_product<S, false>(Ps, X, m, mp, ld, ti, tj, acc);
                else
                    ns_tile_product<S, true>(Pg, X, m, mp, ld, ti, tj, acc);
#pragma unroll
                for (int r = 0; r < NS_MT; ++r)
#pragma unroll
                    for (int c = 0; c < NS_MT; ++c) T[(ti * NS_MT + r) * ld + tj * NS_MT + c] = acc[r][c];
            }
            __syncthreads();
            if (has_tile) ns_tile_product<S, false>(X, T, m, mp, ld, ti, tj, acc);
            // Every thread must finish reading X before any thread overwrites it.
            __syncthreads();
            if (has_tile) {
#pragma unroll
                for (int r = 0; r < NS_MT; ++r)
#pragma unroll
                    for (int c = 0; c < NS_MT; ++c) {
                        S* x = X + (ti * NS_MT + r) * ld + tj * NS_MT + c;
                        *x = S(2) * *x - acc[r][c];
                    }
            }
            __syncthreads();
        }
        S* ob = out + b * (long long)m * m;
        for (int e = tid; e < m * m; e += nthreads) ob[e] = X[(e / m) * ld + e % m];
        // The next matrix of this block reuses X, T and Ps.
        __syncthreads();
    }
}
