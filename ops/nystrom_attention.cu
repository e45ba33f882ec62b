// The fused Nystrom attention: forward in 3 launches, backward in 4, no N x m matrix in
// global memory (lapformer_mm/ops/nystrom.py states the contract and the math).
//
// Per (batch, head) bh, with C = k(., L) the kernel rows against the m landmarks,
// c~ = C - rowmean(C), s the per-landmark whitening scale and P = k(L, L) + eps I:
//
//   forward   nys_forward_stats   over N: column statistics of c~ (Chan's per-tile
//                                 mean and M2) and R = C_k^T v, per row slice
//             nys_forward_solve   per bh: merge the slices in order, P, Newton-Schulz,
//                                 context = X R (+ X (R - P X R), residual in fp64),
//                                 fold = diag(s) context, b = colsum(context) / m
//             nys_forward_out     over N: out = c~ fold + b (normalize='none': C context),
//                                 written in the (B, N, h, d_v) token layout
//   backward  nys_backward_reduce over N: T = c~^T G and colsum(G), per row slice
//             nys_backward_solve  per bh: dcontext, a = s^3 (T . context) / N,
//                                 dR = X dcontext (refined), dP = -dR context^T and the
//                                 landmarks' gradient through P
//             nys_backward_grads  over N: dc~ = (G context^T) diag(s) - (c~ - mu) diag(a),
//                                 dC_q = dc~ - rowmean(dc~), dC_k = v dR^T, dv = C_k dR,
//                                 dq, dk through the kernel, landmark partials per slice
//             nys_backward_landmarks  per bh: the landmark gradient, slices summed in order
//
// Row slices ("splits") are fixed by the shapes and the SM count, and every sum over
// them runs in slice order: no atomics, bit-equal reruns. Inputs q, k, v, L and the
// output gradient are read with arbitrary strides; element types fp32, fp16, bf16
// (fp64 inputs take the unfused path); everything accumulates in fp32. Limits:
// m <= NYS_MP landmarks and d_v <= NYS_DV (cuda_runtime.nystrom_fused_supported);
// any N, d and number of (batch, head) pairs (blocks loop beyond the grid limits).
//
// Threads: 16 x 16 per block. A kernel tile is TN rows x NYS_MP landmark columns,
// each thread holding TN/16 x 4 of them (rows ty + 16 r, columns tx + 16 c) as the
// pairwise kernel does; d streams through shared memory in chunks of NYS_TK.
#include "lap_common.cuh"
#include "newton_schulz.cuh"

#define NYS_MP 64        // landmark columns of a tile (the most landmarks)
#define NYS_DV 64        // value columns (the widest head of v)
#define NYS_TN 64        // rows of a tile in the stats, output and reduce passes
#define NYS_TB 32        // rows of a tile in the gradient pass (more buffers per row)
#define NYS_TK 16        // d-chunk staged in shared memory
#define NYS_TX 16
#define NYS_TY 16
#define NYS_THREADS (NYS_TX * NYS_TY)

template <int KIND>
__device__ __forceinline__ float nys_term(float diff) {
    return KIND == 0 ? lap_abs(diff) : diff * diff;
}

// w * phi'(a - b) up to the constant: sign(a - b) (Laplacian), a - b (Gaussian).
template <int KIND>
__device__ __forceinline__ float nys_dphi(float a, float b, float w) {
    return KIND == 0 ? lap_signed_weight(a, b, w, -w) : w * (a - b);
}

// Offset of (batch, head) bh in an operand with batch and head strides sb, sh.
__device__ __forceinline__ long long nys_base(long long bh, int heads, long long sb, long long sh) {
    return (bh / heads) * sb + (bh % heads) * sh;
}

__device__ __forceinline__ int nys_tid() { return threadIdx.y * NYS_TX + threadIdx.x; }

// ct[i][j] = exp(-sum_t phi(x[i, t] - L[j, t]) / lam) for the tile's rows i < nrows and
// landmarks j < m, 0 elsewhere (so padded rows and columns add nothing to any sum).
// x points at the tile's first row. Ends with a barrier: ct is ready for every thread.
template <int TN, typename T, int KIND>
__device__ void nys_kernel_tile(const T* __restrict__ x, long long xsn, long long xsd, int nrows,
                                const T* __restrict__ L, long long lsn, long long lsd, int m,
                                int d, float neg_inv_lam, float (*xs)[TN + 1],
                                float (*ys)[NYS_MP + 1], float (*ct)[NYS_MP + 1]) {
    constexpr int R = TN / NYS_TY, C = NYS_MP / NYS_TX;
    const int tx = threadIdx.x, ty = threadIdx.y, tid = nys_tid();
    float acc[R][C];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] = 0.0f;
    for (int k0 = 0; k0 < d; k0 += NYS_TK) {
        // Zero padding on both sides makes the tail terms vanish.
        for (int e = tid; e < TN * NYS_TK; e += NYS_THREADS) {
            const int r = e / NYS_TK, kk = e % NYS_TK;
            float value = 0.0f;
            if (r < nrows && k0 + kk < d) value = lap_load(x + r * xsn + (k0 + kk) * xsd);
            xs[kk][r] = value;
        }
        for (int e = tid; e < NYS_MP * NYS_TK; e += NYS_THREADS) {
            const int j = e / NYS_TK, kk = e % NYS_TK;
            float value = 0.0f;
            if (j < m && k0 + kk < d) value = lap_load(L + j * lsn + (k0 + kk) * lsd);
            ys[kk][j] = value;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < NYS_TK; ++kk) {
            float xr[R], yc[C];
#pragma unroll
            for (int r = 0; r < R; ++r) xr[r] = xs[kk][ty + NYS_TY * r];
#pragma unroll
            for (int c = 0; c < C; ++c) yc[c] = ys[kk][tx + NYS_TX * c];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int c = 0; c < C; ++c) acc[r][c] += nys_term<KIND>(xr[r] - yc[c]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = ty + NYS_TY * r;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int j = tx + NYS_TX * c;
            ct[i][j] = (i < nrows && j < m) ? lap_exp(acc[r][c] * neg_inv_lam) : 0.0f;
        }
    }
    __syncthreads();
}

// rm[i] = mean over the m landmarks of row i (0 for padded rows). Ends with a barrier.
template <int TN>
__device__ void nys_row_means(float (*ct)[NYS_MP + 1], int nrows, int m, float* rm) {
    for (int i = nys_tid(); i < TN; i += NYS_THREADS) {
        float s = 0.0f;
        if (i < nrows)
            for (int j = 0; j < m; ++j) s += ct[i][j];
        rm[i] = s / (float)m;
    }
    __syncthreads();
}

// dst[i][t] = x[i, t] for rows i < nrows and columns t < width, 0 elsewhere (no barrier).
template <int TN, typename T>
__device__ void nys_load_rows(const T* __restrict__ x, long long sn, long long st, int nrows,
                              int width, float (*dst)[NYS_DV + 1]) {
    for (int e = nys_tid(); e < TN * NYS_DV; e += NYS_THREADS) {
        const int i = e / NYS_DV, t = e % NYS_DV;
        dst[i][t] = (i < nrows && t < width) ? lap_load(x + i * sn + t * st) : 0.0f;
    }
}

// acc[r][c] += sum_i a[i][ty + 16 r] * b[i][tx + 16 c]: the thread's 4 x 4 block of the
// (NYS_MP x NYS_DV) product a^T b over the tile's rows.
__device__ __forceinline__ void nys_acc_atb(float (*a)[NYS_MP + 1], float (*b)[NYS_DV + 1],
                                            int nrows, float acc[4][4]) {
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (int i = 0; i < nrows; ++i) {
        float ar[4], bc[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) ar[r] = a[i][ty + NYS_TY * r];
#pragma unroll
        for (int c = 0; c < 4; ++c) bc[c] = b[i][tx + NYS_TX * c];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][c] += ar[r] * bc[c];
    }
}

// ---------------------------------------------------------------------------
// Forward.
// ---------------------------------------------------------------------------

// Pass 1: one block per (row slice, bh). Writes, per slice, the column mean and M2 of
// c~ over the slice's rows (injective) and R = C_k^T v (m x d_v): part[bh, split] =
// [mean (m), M2 (m), R (m x d_v)]. k == nullptr: keys tied to queries (C_k = C_q).
template <typename T, int KIND>
__global__ void __launch_bounds__(NYS_THREADS)
nys_forward_stats(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const T* __restrict__ L, long long qsb, long long qsh, long long qsn,
                  long long qsd, long long ksb, long long ksh, long long ksn, long long ksd,
                  long long vsb, long long vsh, long long vsn, long long vsd, long long lsb,
                  long long lsh, long long lsn, long long lsd, float* __restrict__ part,
                  long long bh_count, int heads, int n, int m, int d, int dv, int chunk,
                  float neg_inv_lam, int injective) {
    __shared__ float xs[NYS_TK][NYS_TN + 1];
    __shared__ float ys[NYS_TK][NYS_MP + 1];
    __shared__ float ct[NYS_TN][NYS_MP + 1];
    __shared__ float vt[NYS_TN][NYS_DV + 1];
    __shared__ float rm[NYS_TN];
    const int tx = threadIdx.x, ty = threadIdx.y, tid = nys_tid();
    const int split = blockIdx.x, splits = gridDim.x;
    const int row_begin = split * chunk, row_end = min(n, row_begin + chunk);
    const long long part_stride = 2LL * m + (long long)m * dv;

    for (long long bh = blockIdx.y; bh < bh_count; bh += gridDim.y) {
        const T* qb = q + nys_base(bh, heads, qsb, qsh);
        const T* kb = k == nullptr ? nullptr : k + nys_base(bh, heads, ksb, ksh);
        const T* vb = v + nys_base(bh, heads, vsb, vsh);
        const T* lb = L + nys_base(bh, heads, lsb, lsh);
        // Column tid's running count, mean and M2 (threads tid < m).
        int count = 0;
        float mean = 0.0f, m2 = 0.0f;
        float acc[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;
        for (int row0 = row_begin; row0 < row_end; row0 += NYS_TN) {
            const int nrows = min(NYS_TN, row_end - row0);
            nys_kernel_tile<NYS_TN, T, KIND>(qb + row0 * qsn, qsn, qsd, nrows, lb, lsn, lsd, m, d,
                                             neg_inv_lam, xs, ys, ct);
            if (injective) {
                nys_row_means<NYS_TN>(ct, nrows, m, rm);
                if (tid < m) {
                    // Two passes over the tile, then Chan et al.'s merge: no E[x^2] - E[x]^2.
                    float s = 0.0f;
                    for (int i = 0; i < nrows; ++i) s += ct[i][tid] - rm[i];
                    const float tile_mean = s / (float)nrows;
                    float tile_m2 = 0.0f;
                    for (int i = 0; i < nrows; ++i) {
                        const float dev = ct[i][tid] - rm[i] - tile_mean;
                        tile_m2 += dev * dev;
                    }
                    const float na = (float)count, nb = (float)nrows, total = na + nb;
                    const float delta = tile_mean - mean;
                    mean += delta * (nb / total);
                    m2 += tile_m2 + delta * delta * (na * nb / total);
                    count += nrows;
                }
            }
            // The statistics read ct; the key tile overwrites it only after the staging
            // barrier inside nys_kernel_tile, which every thread reaches after reading.
            if (kb != nullptr)
                nys_kernel_tile<NYS_TN, T, KIND>(kb + row0 * ksn, ksn, ksd, nrows, lb, lsn, lsd, m,
                                                 d, neg_inv_lam, xs, ys, ct);
            nys_load_rows<NYS_TN, T>(vb + row0 * vsn, vsn, vsd, nrows, dv, vt);
            __syncthreads();
            nys_acc_atb(ct, vt, nrows, acc);
            // ct and vt are rewritten by the next tile.
            __syncthreads();
        }
        float* pb = part + (bh * splits + split) * part_stride;
        if (injective && tid < m) {
            pb[tid] = mean;
            pb[m + tid] = m2;
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int j = ty + NYS_TY * r;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int e = tx + NYS_TX * c;
                if (j < m && e < dv) pb[2 * m + j * dv + e] = acc[r][c];
            }
        }
    }
}

// Dynamic shared memory of the solve (floats): P, X and Newton-Schulz scratch, each
// padded as in newton_schulz.cuh, then R and the context (m x d_v each) and the scale
// (NYS_MP); cuda_runtime.nystrom_solve_smem computes the same size.
// P = k(L, L) + eps I into padded shared memory (zeros outside m x m); Tz zeroed.
template <typename T, int KIND>
__device__ void nys_landmark_system(const T* __restrict__ lb, long long lsn, long long lsd, int m,
                                    int d, float neg_inv_lam, float eps, float* Ps, float* Tz,
                                    int mp, int ld) {
    for (int e = nys_tid(); e < mp * ld; e += NYS_THREADS) {
        const int r = e / ld, c = e % ld;
        float value = 0.0f;
        if (r < m && c < m) {
            float dist = 0.0f;
            for (int t = 0; t < d; ++t)
                dist += nys_term<KIND>(lap_load(lb + r * lsn + t * lsd) -
                                       lap_load(lb + c * lsn + t * lsd));
            value = lap_exp(dist * neg_inv_lam) + (r == c ? eps : 0.0f);
        }
        Ps[e] = value;
        Tz[e] = 0.0f;
    }
}

// Pass 2: one block per bh (blocks loop over bh). Outputs context (bh, m, d_v),
// inverse (bh, m, m), stats (bh, 2, m) = [mean, s] (injective), and
// fold (bh, m + 1, d_v) = [diag(s) context; colsum(context) / m] for the output pass
// (normalize='none': [context; 0]).
template <typename T, int KIND>
__global__ void __launch_bounds__(NYS_THREADS)
nys_forward_solve(const T* __restrict__ L, long long lsb, long long lsh, long long lsn,
                  long long lsd, const float* __restrict__ part, float* __restrict__ context,
                  float* __restrict__ inverse, float* __restrict__ stats,
                  float* __restrict__ fold, long long bh_count, int heads, int n, int m, int d,
                  int dv, int chunk, int splits, float neg_inv_lam, float eps, int iters,
                  int init_authors, int refine, int injective, float whiten_eps) {
    LAP_DYNAMIC_SHARED_BYTES(smem_bytes);
    const int mp = (m + NS_MT - 1) / NS_MT * NS_MT;
    const int ld = ns_stride(mp);
    float* Ps = reinterpret_cast<float*>(smem_bytes);
    float* X = Ps + mp * ld;
    float* Tn = X + mp * ld;
    float* R = Tn + mp * ld;
    float* Cx = R + m * dv;
    float* sv = Cx + m * dv;
    const int tid = nys_tid();
    const int md = m * dv;
    const long long part_stride = 2LL * m + (long long)m * dv;

    for (long long bh = blockIdx.x; bh < bh_count; bh += gridDim.x) {
        const T* lb = L + nys_base(bh, heads, lsb, lsh);
        const float* pb = part + bh * splits * part_stride;
        nys_landmark_system<T, KIND>(lb, lsn, lsd, m, d, neg_inv_lam, eps, Ps, Tn, mp, ld);
        for (int e = tid; e < md; e += NYS_THREADS) {
            float s = 0.0f;
            for (int sp = 0; sp < splits; ++sp) s += pb[sp * part_stride + 2 * m + e];
            R[e] = s;
        }
        if (tid < m) {
            float scale = 1.0f, mean = 0.0f;
            if (injective) {
                float m2 = 0.0f, na = 0.0f;
                for (int sp = 0; sp < splits; ++sp) {
                    const float nb = (float)min(chunk, n - sp * chunk);
                    const float mean_b = pb[sp * part_stride + tid];
                    const float total = na + nb, delta = mean_b - mean;
                    mean += delta * (nb / total);
                    m2 += pb[sp * part_stride + m + tid] + delta * delta * (na * nb / total);
                    na = total;
                }
                // A column constant over the queries with whiten_eps = 0 stays 0.
                const float denom = m2 / (float)n + whiten_eps;
                scale = denom > 0.0f ? 1.0f / sqrtf(denom) : 0.0f;
                stats[bh * 2 * m + tid] = mean;
                stats[bh * 2 * m + m + tid] = scale;
            }
            sv[tid] = scale;
        }
        __syncthreads();
        ns_iterate<float, true>(nullptr, Ps, X, Tn, m, iters, init_authors);
        for (int e = tid; e < md; e += NYS_THREADS) {
            const int j = e / dv, c = e % dv;
            float s = 0.0f;
            for (int l = 0; l < m; ++l) s += X[j * ld + l] * R[l * dv + c];
            Cx[e] = s;
        }
        __syncthreads();
        if (refine) {
            // R <- R - P context in fp64 (each thread owns its element), then
            // context += X R, as the reference does.
            for (int e = tid; e < md; e += NYS_THREADS) {
                const int j = e / dv, c = e % dv;
                double s = (double)R[e];
                for (int l = 0; l < m; ++l) s -= (double)Ps[j * ld + l] * (double)Cx[l * dv + c];
                R[e] = (float)s;
            }
            __syncthreads();
            for (int e = tid; e < md; e += NYS_THREADS) {
                const int j = e / dv, c = e % dv;
                float s = 0.0f;
                for (int l = 0; l < m; ++l) s += X[j * ld + l] * R[l * dv + c];
                Cx[e] += s;
            }
            __syncthreads();
        }
        float* cb = context + bh * md;
        float* fb = fold + bh * (md + dv);
        for (int e = tid; e < md; e += NYS_THREADS) {
            cb[e] = Cx[e];
            fb[e] = sv[e / dv] * Cx[e];
        }
        for (int c = tid; c < dv; c += NYS_THREADS) {
            float s = 0.0f;
            if (injective)
                for (int j = 0; j < m; ++j) s += Cx[j * dv + c];
            fb[md + c] = s / (float)m;
        }
        float* ib = inverse + bh * m * m;
        for (int e = tid; e < m * m; e += NYS_THREADS) ib[e] = X[(e / m) * ld + e % m];
        // The next bh of this block reuses every buffer.
        __syncthreads();
    }
}

// Pass 3: one block per (row tile, bh). out (B, N, heads, d_v), contiguous, the input
// dtype: out[i] = (C[i] - rowmean C[i]) fold + b, or C[i] context for 'none'.
template <typename T, int KIND>
__global__ void __launch_bounds__(NYS_THREADS)
nys_forward_out(const T* __restrict__ q, long long qsb, long long qsh, long long qsn,
                long long qsd, const T* __restrict__ L, long long lsb, long long lsh,
                long long lsn, long long lsd, const float* __restrict__ fold,
                T* __restrict__ out, long long bh_count, int heads, int n, int m, int d, int dv,
                float neg_inv_lam, int injective) {
    __shared__ float xs[NYS_TK][NYS_TN + 1];
    __shared__ float ys[NYS_TK][NYS_MP + 1];
    __shared__ float ct[NYS_TN][NYS_MP + 1];
    __shared__ float fp[NYS_MP][NYS_DV + 1];
    __shared__ float bv[NYS_DV];
    __shared__ float rm[NYS_TN];
    const int tx = threadIdx.x, ty = threadIdx.y, tid = nys_tid();
    const int tiles = (n + NYS_TN - 1) / NYS_TN;

    for (long long bh = blockIdx.y; bh < bh_count; bh += gridDim.y) {
        const T* qb = q + nys_base(bh, heads, qsb, qsh);
        const T* lb = L + nys_base(bh, heads, lsb, lsh);
        const float* fb = fold + bh * (long long)(m + 1) * dv;
        for (int e = tid; e < m * dv; e += NYS_THREADS) fp[e / dv][e % dv] = fb[e];
        for (int c = tid; c < dv; c += NYS_THREADS) bv[c] = fb[m * dv + c];
        const long long batch = bh / heads, head = bh % heads;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            const int row0 = tile * NYS_TN, nrows = min(NYS_TN, n - row0);
            // fp and bv are complete after the barriers inside nys_kernel_tile.
            nys_kernel_tile<NYS_TN, T, KIND>(qb + row0 * qsn, qsn, qsd, nrows, lb, lsn, lsd, m, d,
                                             neg_inv_lam, xs, ys, ct);
            if (injective) nys_row_means<NYS_TN>(ct, nrows, m, rm);
            float acc[4][4];
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;
            for (int j = 0; j < m; ++j) {
                float cr[4], fc[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int i = ty + NYS_TY * r;
                    cr[r] = injective ? ct[i][j] - rm[i] : ct[i][j];
                }
#pragma unroll
                for (int c = 0; c < 4; ++c) fc[c] = fp[j][tx + NYS_TX * c];
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[r][c] += cr[r] * fc[c];
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = ty + NYS_TY * r;
                if (i >= nrows) continue;
                T* ob = out + ((batch * n + row0 + i) * heads + head) * dv;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int e = tx + NYS_TX * c;
                    if (e < dv) lap_store(ob + e, acc[r][c] + bv[e]);
                }
            }
            // ct and rm are rewritten by the next tile after its staging barrier.
        }
        // fp and bv are reloaded for the next bh.
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------
// Backward. G is the gradient of out: (B, N, heads, d_v) with strides gsb, gsn, gsh, gsd.
// ---------------------------------------------------------------------------

// Pass A: one block per (row slice, bh): part[bh, split] = [T = c~^T G (m x d_v),
// colsum(G) (d_v)] over the slice's rows (T = C_q^T G for 'none').
template <typename T, int KIND>
__global__ void __launch_bounds__(NYS_THREADS)
nys_backward_reduce(const T* __restrict__ g, long long gsb, long long gsh, long long gsn,
                    long long gsd, const T* __restrict__ q, long long qsb, long long qsh,
                    long long qsn, long long qsd, const T* __restrict__ L, long long lsb,
                    long long lsh, long long lsn, long long lsd, float* __restrict__ part,
                    long long bh_count, int heads, int n, int m, int d, int dv, int chunk,
                    float neg_inv_lam, int injective) {
    __shared__ float xs[NYS_TK][NYS_TN + 1];
    __shared__ float ys[NYS_TK][NYS_MP + 1];
    __shared__ float ct[NYS_TN][NYS_MP + 1];
    __shared__ float gt[NYS_TN][NYS_DV + 1];
    __shared__ float rm[NYS_TN];
    const int tx = threadIdx.x, ty = threadIdx.y, tid = nys_tid();
    const int split = blockIdx.x, splits = gridDim.x;
    const int row_begin = split * chunk, row_end = min(n, row_begin + chunk);
    const long long part_stride = (long long)m * dv + dv;

    for (long long bh = blockIdx.y; bh < bh_count; bh += gridDim.y) {
        const T* gb = g + nys_base(bh, heads, gsb, gsh);
        const T* qb = q + nys_base(bh, heads, qsb, qsh);
        const T* lb = L + nys_base(bh, heads, lsb, lsh);
        float acc[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;
        float gsum = 0.0f;  // column tid of G (threads tid < d_v)
        for (int row0 = row_begin; row0 < row_end; row0 += NYS_TN) {
            const int nrows = min(NYS_TN, row_end - row0);
            nys_kernel_tile<NYS_TN, T, KIND>(qb + row0 * qsn, qsn, qsd, nrows, lb, lsn, lsd, m, d,
                                             neg_inv_lam, xs, ys, ct);
            if (injective) {
                nys_row_means<NYS_TN>(ct, nrows, m, rm);
                for (int e = tid; e < NYS_TN * NYS_MP; e += NYS_THREADS) {
                    const int i = e / NYS_MP, j = e % NYS_MP;
                    if (i < nrows && j < m) ct[i][j] -= rm[i];
                }
            }
            nys_load_rows<NYS_TN, T>(gb + row0 * gsn, gsn, gsd, nrows, dv, gt);
            __syncthreads();
            nys_acc_atb(ct, gt, nrows, acc);
            if (tid < dv)
                for (int i = 0; i < nrows; ++i) gsum += gt[i][tid];
            // ct and gt are rewritten by the next tile.
            __syncthreads();
        }
        float* pb = part + (bh * splits + split) * part_stride;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int j = ty + NYS_TY * r;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int e = tx + NYS_TX * c;
                if (j < m && e < dv) pb[j * dv + e] = acc[r][c];
            }
        }
        if (tid < dv) pb[m * dv + tid] = gsum;
    }
}

// Dynamic shared memory of the backward solve (floats): k(L, L) and X (m x m each),
// context, dcontext and dR (m x d_v each), the scale and a (NYS_MP each), colsum(G)
// (NYS_DV); cuda_runtime.nystrom_backward_solve_smem computes the same size.
// Pass B0: one block per bh. work[bh] = [dR (m x d_v), a (m), dL through P (m x d)].
template <typename T, int KIND>
__global__ void __launch_bounds__(NYS_THREADS)
nys_backward_solve(const T* __restrict__ L, long long lsb, long long lsh, long long lsn,
                   long long lsd, const float* __restrict__ part,
                   const float* __restrict__ context, const float* __restrict__ inverse,
                   const float* __restrict__ stats, float* __restrict__ work,
                   long long bh_count, int heads, int n, int m, int d, int dv, int splits,
                   float neg_inv_lam, float neg_coef, float eps, int refine, int injective) {
    LAP_DYNAMIC_SHARED_BYTES(smem_bytes);
    float* K = reinterpret_cast<float*>(smem_bytes);   // k(L, L), later (dP + dP^T) * k
    float* X = K + m * m;                              // X, later dP
    float* Cx = X + m * m;
    float* Dc = Cx + m * dv;
    float* DR = Dc + m * dv;
    float* sv = DR + m * dv;
    float* av = sv + NYS_MP;
    float* gs = av + NYS_MP;
    const int tid = nys_tid();
    const int md = m * dv;
    const long long part_stride = (long long)md + dv;
    const long long work_stride = (long long)md + m + (long long)m * d;

    for (long long bh = blockIdx.x; bh < bh_count; bh += gridDim.x) {
        const T* lb = L + nys_base(bh, heads, lsb, lsh);
        const float* pb = part + bh * splits * part_stride;
        for (int e = tid; e < m * m; e += NYS_THREADS) {
            const int r = e / m, c = e % m;
            float dist = 0.0f;
            for (int t = 0; t < d; ++t)
                dist += nys_term<KIND>(lap_load(lb + r * lsn + t * lsd) -
                                       lap_load(lb + c * lsn + t * lsd));
            K[e] = lap_exp(dist * neg_inv_lam);
            X[e] = inverse[bh * m * m + e];
        }
        for (int e = tid; e < md; e += NYS_THREADS) {
            float s = 0.0f;
            for (int sp = 0; sp < splits; ++sp) s += pb[sp * part_stride + e];
            Dc[e] = s;                                     // T, until dcontext replaces it
            Cx[e] = context[bh * md + e];
        }
        for (int c = tid; c < dv; c += NYS_THREADS) {
            float s = 0.0f;
            for (int sp = 0; sp < splits; ++sp) s += pb[sp * part_stride + md + c];
            gs[c] = s;
        }
        if (tid < m) sv[tid] = injective ? stats[bh * 2 * m + m + tid] : 1.0f;
        __syncthreads();
        if (injective) {
            if (tid < m) {
                float ds = 0.0f;
                for (int c = 0; c < dv; ++c) ds += Dc[tid * dv + c] * Cx[tid * dv + c];
                const float s = sv[tid];
                av[tid] = s * s * s * ds / (float)n;
            }
            __syncthreads();
            for (int e = tid; e < md; e += NYS_THREADS)
                Dc[e] = sv[e / dv] * Dc[e] + gs[e % dv] / (float)m;
        } else if (tid < m) {
            av[tid] = 0.0f;
        }
        __syncthreads();
        for (int e = tid; e < md; e += NYS_THREADS) {
            const int j = e / dv, c = e % dv;
            float s = 0.0f;
            for (int l = 0; l < m; ++l) s += X[j * m + l] * Dc[l * dv + c];
            DR[e] = s;
        }
        __syncthreads();
        if (refine) {
            for (int e = tid; e < md; e += NYS_THREADS) {
                const int j = e / dv, c = e % dv;
                double s = (double)Dc[e];
                for (int l = 0; l < m; ++l)
                    s -= ((double)K[j * m + l] + (j == l ? (double)eps : 0.0)) * (double)DR[l * dv + c];
                Dc[e] = (float)s;
            }
            __syncthreads();
            for (int e = tid; e < md; e += NYS_THREADS) {
                const int j = e / dv, c = e % dv;
                float s = 0.0f;
                for (int l = 0; l < m; ++l) s += X[j * m + l] * Dc[l * dv + c];
                DR[e] += s;
            }
            __syncthreads();
        }
        // dP = -dR context^T into X's place (X is no longer needed).
        for (int e = tid; e < m * m; e += NYS_THREADS) {
            const int j = e / m, l = e % m;
            float s = 0.0f;
            for (int c = 0; c < dv; ++c) s += DR[j * dv + c] * Cx[l * dv + c];
            X[e] = -s;
        }
        __syncthreads();
        // L is both operands of the symmetric k(L, L): the weight is (dP + dP^T) * k.
        for (int e = tid; e < m * m; e += NYS_THREADS) {
            const int j = e / m, l = e % m;
            K[e] *= X[e] + X[l * m + j];
        }
        __syncthreads();
        float* wb = work + bh * work_stride;
        for (int e = tid; e < md; e += NYS_THREADS) wb[e] = DR[e];
        if (tid < m) wb[md + tid] = av[tid];
        for (int e = tid; e < m * d; e += NYS_THREADS) {
            const int j = e / d, t = e % d;
            const float a = lap_load(lb + j * lsn + t * lsd);
            float s = 0.0f;
            for (int l = 0; l < m; ++l) s += nys_dphi<KIND>(a, lap_load(lb + l * lsn + t * lsd),
                                                           K[j * m + l]);
            wb[md + m + e] = neg_coef * s;
        }
        // The next bh of this block reuses every buffer.
        __syncthreads();
    }
}

// Dynamic shared memory of the gradient pass (floats, a fixed size):
// 2 NYS_MP (NYS_DV + 1) + 4 NYS_TB (NYS_MP + 1) + NYS_TK (NYS_TB + NYS_MP + 2)
// + 3 NYS_MP + 2 NYS_TB, as laid out at the top of nys_backward_grads;
// cuda_runtime.NYSTROM_GRADS_SMEM is the same number of bytes.

// dgrad[i, t] = neg_coef * sum_j w[i][j] phi'(x[i, t] - L[j, t]) for the tile's rows,
// written in the input dtype to dx (row and column strides dxsn, dxsd), and the landmarks' share
// -neg_coef * sum_i (...) added to the slice's fp32 partial lp (m x d; written, not
// added, when `first`). Stages x and L chunk by chunk through xs, ys.
template <typename T, int KIND>
__device__ void nys_kernel_grads(const T* __restrict__ x, long long xsn, long long xsd,
                                 int nrows, const T* __restrict__ L, long long lsn,
                                 long long lsd, int m, int d, float (*w)[NYS_MP + 1],
                                 float neg_coef, T* __restrict__ dx, long long dxsn,
                                 long long dxsd, float* __restrict__ lp, bool first,
                                 float (*xs)[NYS_TB + 1], float (*ys)[NYS_MP + 1]) {
    const int tx = threadIdx.x, ty = threadIdx.y, tid = nys_tid();
    for (int k0 = 0; k0 < d; k0 += NYS_TK) {
        for (int e = tid; e < NYS_TB * NYS_TK; e += NYS_THREADS) {
            const int r = e / NYS_TK, kk = e % NYS_TK;
            xs[kk][r] = (r < nrows && k0 + kk < d) ? lap_load(x + r * xsn + (k0 + kk) * xsd) : 0.0f;
        }
        for (int e = tid; e < NYS_MP * NYS_TK; e += NYS_THREADS) {
            const int j = e / NYS_TK, kk = e % NYS_TK;
            ys[kk][j] = (j < m && k0 + kk < d) ? lap_load(L + j * lsn + (k0 + kk) * lsd) : 0.0f;
        }
        __syncthreads();
        const int t = k0 + tx;
        if (t < d) {
#pragma unroll
            for (int r = 0; r < NYS_TB / NYS_TY; ++r) {
                const int i = ty + NYS_TY * r;
                if (i >= nrows) continue;
                const float xi = xs[tx][i];
                float s = 0.0f;
                for (int j = 0; j < m; ++j) s += nys_dphi<KIND>(xi, ys[tx][j], w[i][j]);
                lap_store(dx + i * dxsn + t * dxsd, neg_coef * s);
            }
#pragma unroll
            for (int r = 0; r < NYS_MP / NYS_TY; ++r) {
                const int j = ty + NYS_TY * r;
                if (j >= m) continue;
                const float lj = ys[tx][j];
                float s = 0.0f;
                for (int i = 0; i < nrows; ++i) s += nys_dphi<KIND>(xs[tx][i], lj, w[i][j]);
                float* dst = lp + j * (long long)d + t;
                *dst = first ? -neg_coef * s : *dst - neg_coef * s;
            }
        }
        // xs and ys are restaged for the next chunk.
        __syncthreads();
    }
}

// Pass B: one block per (row slice, bh). dq, dk (B, h, N, d) with strides dqs* (both)
// and dv (B, h, N, d_v) with strides dvs*, the input dtype; lpart[bh, split] (m x d,
// fp32) the landmarks' gradient through C_q and C_k over the slice's rows.
// k == nullptr: tied keys (dk is in dq).
template <typename T, int KIND>
__global__ void __launch_bounds__(NYS_THREADS)
nys_backward_grads(const T* __restrict__ g, long long gsb, long long gsh, long long gsn,
                   long long gsd, const T* __restrict__ q, long long qsb, long long qsh,
                   long long qsn, long long qsd, const T* __restrict__ k, long long ksb,
                   long long ksh, long long ksn, long long ksd, const T* __restrict__ v,
                   long long vsb, long long vsh, long long vsn, long long vsd,
                   const T* __restrict__ L, long long lsb, long long lsh, long long lsn,
                   long long lsd, const float* __restrict__ context,
                   const float* __restrict__ stats, const float* __restrict__ work,
                   T* __restrict__ dq, T* __restrict__ dk, long long dqsb, long long dqsh,
                   long long dqsn, long long dqsd, T* __restrict__ dv_out, long long dvsb,
                   long long dvsh, long long dvsn, long long dvsd, float* __restrict__ lpart,
                   long long bh_count, int heads, int n, int m, int d, int dv, int chunk,
                   float neg_inv_lam, float neg_coef, int injective) {
    LAP_DYNAMIC_SHARED_BYTES(smem_bytes);
    typedef float RowM[NYS_MP + 1];
    typedef float RowV[NYS_DV + 1];
    typedef float RowB[NYS_TB + 1];
    RowV* cx = reinterpret_cast<RowV*>(smem_bytes);   // context
    RowV* dr = cx + NYS_MP;                            // dR
    RowM* cq = reinterpret_cast<RowM*>(dr + NYS_MP);   // C_q tile
    RowM* wq = cq + NYS_TB;                            // dc~, then dC_q * C_q (+ dC_k * C_q)
    RowV* gt = reinterpret_cast<RowV*>(wq + NYS_TB);   // G, then dC_k * C_k (separate keys)
    RowV* vt = gt + NYS_TB;                            // v, then the C_k tile
    RowB* xs = reinterpret_cast<RowB*>(vt + NYS_TB);
    RowM* ys = reinterpret_cast<RowM*>(xs + NYS_TK);
    float* sv = reinterpret_cast<float*>(ys + NYS_TK);
    float* mu = sv + NYS_MP;
    float* av = mu + NYS_MP;
    float* rm = av + NYS_MP;
    float* rm2 = rm + NYS_TB;
    // gt and vt double as landmark-wide tiles: NYS_DV == NYS_MP.
    RowM* wk = reinterpret_cast<RowM*>(gt);
    RowM* ck = reinterpret_cast<RowM*>(vt);
    constexpr int R = NYS_TB / NYS_TY;
    const int tx = threadIdx.x, ty = threadIdx.y, tid = nys_tid();
    const int split = blockIdx.x, splits = gridDim.x;
    const int row_begin = split * chunk, row_end = min(n, row_begin + chunk);
    const int md = m * dv;
    const long long work_stride = (long long)md + m + (long long)m * d;

    for (long long bh = blockIdx.y; bh < bh_count; bh += gridDim.y) {
        const T* gb = g + nys_base(bh, heads, gsb, gsh);
        const T* qb = q + nys_base(bh, heads, qsb, qsh);
        const T* kb = k == nullptr ? nullptr : k + nys_base(bh, heads, ksb, ksh);
        const T* vb = v + nys_base(bh, heads, vsb, vsh);
        const T* lb = L + nys_base(bh, heads, lsb, lsh);
        const float* wb = work + bh * work_stride;
        const long long dq_base = nys_base(bh, heads, dqsb, dqsh);
        T* dvb = dv_out + nys_base(bh, heads, dvsb, dvsh);
        for (int e = tid; e < NYS_MP * NYS_DV; e += NYS_THREADS) {
            const int j = e / NYS_DV, c = e % NYS_DV;
            const bool in = j < m && c < dv;
            cx[j][c] = in ? context[bh * md + j * dv + c] : 0.0f;
            dr[j][c] = in ? wb[j * dv + c] : 0.0f;
        }
        for (int j = tid; j < NYS_MP; j += NYS_THREADS) {
            const bool in = injective && j < m;
            mu[j] = in ? stats[bh * 2 * m + j] : 0.0f;
            sv[j] = in ? stats[bh * 2 * m + m + j] : 0.0f;
            av[j] = in ? wb[md + j] : 0.0f;
        }
        float* lp = lpart + (bh * splits + split) * (long long)m * d;
        for (int row0 = row_begin; row0 < row_end; row0 += NYS_TB) {
            const int nrows = min(NYS_TB, row_end - row0);
            const bool first = row0 == row_begin;
            // cx, dr and the vectors are complete after the barriers inside.
            nys_kernel_tile<NYS_TB, T, KIND>(qb + row0 * qsn, qsn, qsd, nrows, lb, lsn, lsd, m, d,
                                             neg_inv_lam, xs, ys, cq);
            nys_load_rows<NYS_TB, T>(gb + row0 * gsn, gsn, gsd, nrows, dv, gt);
            nys_load_rows<NYS_TB, T>(vb + row0 * vsn, vsn, vsd, nrows, dv, vt);
            if (injective)
                nys_row_means<NYS_TB>(cq, nrows, m, rm);
            else
                __syncthreads();
            // G context^T -> dc~, and dC_k = v dR^T, for the thread's rows and landmarks.
            float dck[R][4];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int i = ty + NYS_TY * r;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int j = tx + NYS_TX * c;
                    float gc = 0.0f, vd = 0.0f;
                    for (int e = 0; e < dv; ++e) {
                        gc += gt[i][e] * cx[j][e];
                        vd += vt[i][e] * dr[j][e];
                    }
                    const bool in = i < nrows && j < m;
                    float dct = gc;
                    if (injective) dct = sv[j] * gc - av[j] * (cq[i][j] - rm[i] - mu[j]);
                    wq[i][j] = in ? dct : 0.0f;
                    dck[r][c] = in ? vd : 0.0f;
                }
            }
            // wq is complete, and every thread is done with gt and vt.
            __syncthreads();
            if (injective) nys_row_means<NYS_TB>(wq, nrows, m, rm2);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int i = ty + NYS_TY * r;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int j = tx + NYS_TX * c;
                    const float dcq = injective && j < m && i < nrows ? wq[i][j] - rm2[i] : wq[i][j];
                    if (kb == nullptr) {
                        wq[i][j] = (dcq + dck[r][c]) * cq[i][j];
                    } else {
                        wq[i][j] = dcq * cq[i][j];
                        wk[i][j] = dck[r][c];
                    }
                }
            }
            if (kb != nullptr)
                // The C_k tile goes to vt's place after the staging barrier inside.
                nys_kernel_tile<NYS_TB, T, KIND>(kb + row0 * ksn, ksn, ksd, nrows, lb, lsn, lsd, m,
                                                 d, neg_inv_lam, xs, ys, ck);
            else
                __syncthreads();
            // dv = C_k dR for the thread's rows and value columns.
            RowM* cv = kb == nullptr ? cq : ck;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int i = ty + NYS_TY * r;
                if (i >= nrows) continue;
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int j = 0; j < m; ++j) {
                    const float c_ij = cv[i][j];
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[c] += c_ij * dr[j][tx + NYS_TX * c];
                }
                T* dvi = dvb + (row0 + i) * dvsn;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int e = tx + NYS_TX * c;
                    if (e < dv) lap_store(dvi + e * dvsd, acc[c]);
                }
            }
            if (kb != nullptr) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const int i = ty + NYS_TY * r;
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int j = tx + NYS_TX * c;
                        wk[i][j] *= ck[i][j];
                    }
                }
            }
            // wq and wk are complete; the staging below overwrites only xs and ys.
            __syncthreads();
            nys_kernel_grads<T, KIND>(qb + row0 * qsn, qsn, qsd, nrows, lb, lsn, lsd, m, d, wq,
                                      neg_coef, dq + dq_base + row0 * dqsn, dqsn, dqsd, lp, first,
                                      xs, ys);
            if (kb != nullptr)
                nys_kernel_grads<T, KIND>(kb + row0 * ksn, ksn, ksd, nrows, lb, lsn, lsd, m, d, wk,
                                          neg_coef, dk + dq_base + row0 * dqsn, dqsn, dqsd, lp,
                                          false, xs, ys);
        }
    }
}

// Pass B1: one block per bh. dL (B, h, m, d) with strides dls*, the input dtype: the
// part through P plus the slices' partials in slice order.
template <typename T>
__global__ void __launch_bounds__(NYS_THREADS)
nys_backward_landmarks(const float* __restrict__ lpart, const float* __restrict__ work,
                       T* __restrict__ dl, long long dlsb, long long dlsh, long long dlsn,
                       long long dlsd, long long bh_count, int heads, int m, int d, int dv,
                       int splits) {
    const long long md = (long long)m * d;
    const long long work_stride = (long long)m * dv + m + md;
    for (long long bh = blockIdx.x; bh < bh_count; bh += gridDim.x) {
        const float* pb = lpart + bh * splits * md;
        const float* wb = work + bh * work_stride + (long long)m * dv + m;
        T* db = dl + nys_base(bh, heads, dlsb, dlsh);
        for (long long e = nys_tid(); e < md; e += NYS_THREADS) {
            float s = wb[e];
            for (int sp = 0; sp < splits; ++sp) s += pb[sp * md + e];
            lap_store(db + (e / d) * dlsn + (e % d) * dlsd, s);
        }
    }
}
