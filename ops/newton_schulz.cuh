// The Newton-Schulz iteration on padded matrices in shared memory, shared by the
// stand-alone solve (newton_schulz.cu) and the fused attention's solve
// (nystrom_attention.cu). newton_schulz.cu describes the layout and the products.
#pragma once
#include "lap_common.cuh"

#define NS_MT 4   // micro-tile edge

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

// X = the Newton-Schulz inverse of P after `iters` steps, in padded shared memory
// (mp x ld; T is scratch of the same size). P is the padded shared copy Ps when
// P_SHARED, else the unpadded m x m matrix Pg in global memory; T must hold zeros on
// entry (its padding stays zero, which keeps the products' padding zero). Every thread of the block calls this; threads past
// the (mp/4)^2 tiles only help with the element-wise steps.
template <typename S, bool P_SHARED>
__device__ __forceinline__ void ns_iterate(const S* __restrict__ Pg, const S* Ps, S* X, S* T,
                                           int m, int iters, int init_authors) {
    __shared__ S norm_shared;
    const int mp = (m + NS_MT - 1) / NS_MT * NS_MT;
    const int ld = ns_stride(mp);
    const int size = mp * ld;
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int nthreads = blockDim.x * blockDim.y * blockDim.z;
    const int nt = mp / NS_MT;
    const bool has_tile = tid < nt * nt;
    const int ti = has_tile ? tid / nt : 0;
    const int tj = has_tile ? tid % nt : 0;
    // ||P||_inf's row sums in T's column 0.
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
        if (r < m && c < m) {
            const S p = P_SHARED ? Ps[r * ld + c] : Pg[r * m + c];
            v = init_authors ? p * start_scale : (r == c ? start_scale : S(0));
        }
        X[e] = v;
    }
    // The first product overwrites T's column 0 before anything reads T again.
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
}
