// The fused Nystrom attention: forward in 4 launches, backward in 5, no N x m matrix in
// global memory (lapformer_mm/ops/attention.py states the contract, reference.py the math).
//
// Per (batch, head) bh, with C = k(., L) the kernel rows against the m landmarks,
// c~ = C - rowmean(C), s the per-landmark whitening scale, P = k(L, L) + eps I, vbar the
// mean value and cbar = colmean(C_k) (reference.landmark_rhs, forward, value_grads):
// R = C_k^T (v - 1 vbar^T) / N, context = [X R; vbar^T], out = Z X R + 1 vbar^T.
//
//   forward   nys_forward_stats   over N: column statistics of c~ (Chan's per-tile
//                                 mean and M2), (C_k - r 1^T)^T v and its column sums
//                                 (C_k - r 1^T)^T 1, and in fp64 r^T v, sum r and
//                                 sum v (r: C_k's row means), per row slice
//             nys_forward_solve   per bh, one block: P, Newton-Schulz; beside it, many
//                                 blocks merge the slices (statistics, s, cbar, and the
//                                 fp64 sums into vbar and (r^T v - (sum r) vbar^T) / N)
//             nys_forward_context per (value columns, bh): R = [(C_k - r 1^T)^T v -
//                                 (C_k - r 1^T)^T 1 vbar^T] / N + the fp64 common part,
//                                 context = X R (+ X (R - P X R), residual in fp64),
//                                 fold = diag(s) context, b = colsum(context) / m + vbar
//             nys_forward_out     over N: out = c~ fold + b (normalize='none':
//                                 C context + vbar), in the (B, N, h, d_v) token layout
//   backward  nys_backward_reduce over N: T = c~^T G and colsum(G), per row slice
//             nys_backward_merge  per (entries, bh): the slices summed
//             nys_backward_solve  per bh: dcontext, a = s^3 (T . context) / N,
//                                 dR = X dcontext (refined), dP = -dR context^T,
//                                 W = (dP + dP^T) * k(L, L), dR~ = dR / N and
//                                 w = colsum(G) / N - cbar dR~
//             nys_backward_grads  over N: dc~ = (G context^T) diag(s) - (c~ - mu) diag(a),
//                                 dC_q = dc~ - rowmean(dc~), dC_k = (v - vbar) dR~^T,
//                                 dv = C_k dR~ + w, dq, dk through the kernel, landmark
//                                 partials per slice
//             nys_backward_landmarks  per (entries, bh): the landmark gradient through P
//                                 plus the slices
//
// The math is lapformer_mm/ops/reference.py's (the stage functions named there); the
// backend lapformer_mm/ops/backends/cuda.py fills one nys_params per call and launches.
//
// Row slices ("splits") are fixed by the shapes and the SM count, and every sum over
// them runs in a fixed order (consecutive slices per group, then the groups in order,
// nys_slice_range): no atomics, bit-equal reruns. Inputs q, k, v, L and the
// output gradient are read with arbitrary strides; element types fp32, fp16, bf16
// (fp64 inputs take the reference); everything accumulates in fp32 but the common
// part of R (r^T v, sum r, sum v) and the refinement's residual (fp64). Limits: m <= NYS_MP
// landmarks and d_v <= NYS_DV (the backend's not_supported says which variant fits);
// any N, d and number of (batch, head) pairs (blocks loop beyond the grid limits).
//
// Threads: NYS_TX x NYS_TY per block. A kernel tile is TN rows x NYS_MP landmark
// columns, each thread holding TN/NYS_TY x NYS_MP/NYS_TX of them (rows ty + NYS_TY r,
// columns tx + NYS_TX c); d streams through shared memory in chunks of NYS_TK.
#include "lap_common.cuh"

// The tile geometry comes from the host, one source for both sides
// (lapformer_mm/ops/backends/cuda.py, VARIANTS), as -D options that are part of
// the compile's cache key.
#if !defined(NYS_MP) || !defined(NYS_DV) || !defined(NYS_TN) || !defined(NYS_TB) || \
    !defined(NYS_TK) || !defined(NYS_TX) || !defined(NYS_TY) || !defined(NYS_LANES) || \
    !defined(NYS_CC) || !defined(NYS_SY)
#error "compile with the tile geometry of a variant: -DNYS_MP= -DNYS_DV= -DNYS_TN= -DNYS_TB= -DNYS_TK= -DNYS_TX= -DNYS_TY= -DNYS_LANES= -DNYS_CC= -DNYS_SY= (lapformer_mm/ops/backends/cuda.py)"
#endif
// NYS_MP: landmark columns of a tile (the most landmarks); NYS_DV: value columns (the
// widest head of v); NYS_TN / NYS_TB: rows of a tile in the row passes / the gradient
// pass; NYS_TK: the d-chunk staged in shared memory; NYS_TX x NYS_TY threads a block;
// NYS_LANES: consecutive entries a slice merge takes per block (one warp's coalesced
// row); NYS_CC: value columns per block of nys_forward_context; NYS_TX x NYS_SY threads
// the block of nys_forward_solve (Newton-Schulz on more warps than the other kernels).
#define NYS_THREADS (NYS_TX * NYS_TY)
// A kernel: a __global__ template where kernels are reached as templates (the emulation,
// tests/cuda_emu), else, for the host's modules of one element type (-DNYS_ELEMENT), a
// device function inlined into the module's entry points at the end of this file.
#ifdef NYS_ELEMENT
#define NYS_KERNEL(threads) __device__ __forceinline__ void
#define NYS_PARAMS const nys_params&
#else
#define NYS_KERNEL(threads) __global__ void __launch_bounds__(threads)
#define NYS_PARAMS const nys_params
#endif
#define NYS_SOLVE_THREADS (NYS_TX * NYS_SY)
#define NYS_DW (NYS_MP > NYS_DV ? NYS_MP : NYS_DV)  // tiles that hold G or v, then C_k
static_assert(NYS_MP % NYS_TX == 0 && NYS_MP % NYS_TY == 0 && NYS_DV % NYS_TX == 0 &&
                  NYS_TN % NYS_TY == 0 && NYS_TB % NYS_TY == 0,
              "each thread holds whole rows and columns of a tile");
static_assert(NYS_TK == NYS_TX, "the gradient pass maps the d-chunk onto threadIdx.x");
static_assert(NYS_THREADS % NYS_MP == 0, "the column statistics split rows among groups");
static_assert(NYS_THREADS % NYS_DV == 0, "the common part of R splits rows among groups");
constexpr int NYS_RM = NYS_MP / NYS_TY;  // landmark rows per thread of a C^T x product
constexpr int NYS_CM = NYS_MP / NYS_TX;  // landmark columns per thread of a kernel tile
constexpr int NYS_CV = NYS_DV / NYS_TX;  // value columns per thread
constexpr int NYS_GROUPS = NYS_THREADS / NYS_MP;  // row groups of the column statistics
constexpr int NYS_CGROUPS = NYS_THREADS / NYS_DV;  // row groups of the common part r^T v
// dP's elements per thread in the backward solve (held in registers over the chunks).
constexpr int NYS_DPR = (NYS_MP * NYS_MP + NYS_THREADS - 1) / NYS_THREADS;
static_assert(NYS_THREADS % NYS_LANES == 0, "the slice merges split the block into groups");
constexpr int NYS_SGROUPS = NYS_THREADS / NYS_LANES;  // slice groups of a merge
static_assert(NYS_SY % NYS_TY == 0 && NYS_MP % NYS_SY == 0, "whole merge units and tile rows");
// Merge units of a nys_forward_solve block: NYS_THREADS threads each, one piece apiece.
constexpr int NYS_UNITS = NYS_SY / NYS_TY;
// Floats of a kernel tile of the landmarks against themselves (staged d-chunks and tile).
constexpr int NYS_LTILE = (2 * NYS_TK + NYS_MP) * (NYS_MP + 1);

// One operand: base pointer and element strides of its batch, head, row and column.
struct nys_operand {
    void* ptr;
    long long sb, sh, sn, sd;
};

// Everything a launch reads, filled once per call on the host and passed by value to
// every kernel (flash-attn's Flash_fwd_params pattern). The host mirrors this layout as
// a numpy structured dtype (backends.cuda.PARAMS_DTYPE); the emulation checks the offsets.
struct nys_params {
    nys_operand q, k, v, L;  // inputs; k.ptr null: keys tied to queries (C_k = C_q)
    nys_operand g;           // the gradient of out, (B, N, h, d_v) as (b, h, n, c) strides
    nys_operand grad_q, grad_k, grad_v, grad_l;  // grad_k.ptr null when keys are tied
    void* out;               // (B, N, h, d_v), contiguous
    float* part;             // per-slice partials of the row passes
    float* fold;             // forward: [diag(s) context; b] per bh
    float* context;          // (bh, m + 1, d_v): X R, then vbar
    float* inverse;
    float* stats;            // (bh, 3, m) [mu, s, cbar] (injective) or (bh, 1, m) [cbar]
    float* work;             // per bh: nys_forward_work_stride, nys_backward_work_stride
    float* lpart;            // backward: the landmarks' gradient per slice
    double* common;          // forward: per slice, [r^T v (d_v), sum v (d_v), sum r]
    long long bh_count;
    int heads, n, m, d, dv;
    int chunk, splits;       // rows of a slice, slices per bh
    int iters, init_authors, refine, injective;
    int solve_cols;          // value columns per pass of the solve kernels
    int ns_partials;         // floats of the forward solve's Newton-Schulz k-split partials
    float neg_inv_lam, neg_coef, eps, whiten_eps;
};

template <typename T>
__device__ __forceinline__ const T* nys_in(const nys_operand& o, long long bh, int heads) {
    return static_cast<const T*>(o.ptr) + (bh / heads) * o.sb + (bh % heads) * o.sh;
}

template <typename T>
__device__ __forceinline__ T* nys_out(const nys_operand& o, long long bh, int heads) {
    return static_cast<T*>(o.ptr) + (bh / heads) * o.sb + (bh % heads) * o.sh;
}

// The stats of bh: [mu, s, cbar] (injective) or [cbar], m each.
__device__ __forceinline__ float* nys_stats(const nys_params& p, long long bh) {
    return p.stats + bh * (p.injective ? 3 : 1) * (long long)p.m;
}

// The keys' mean kernel row cbar of bh, the last row of its stats.
__device__ __forceinline__ float* nys_key_mean(const nys_params& p, long long bh) {
    return nys_stats(p, bh) + (p.injective ? 2 * p.m : 0);
}

// The context of bh: X R (m x d_v), then the mean value vbar (d_v).
__device__ __forceinline__ float* nys_context(const nys_params& p, long long bh) {
    return p.context + bh * (long long)(p.m + 1) * p.dv;
}

template <int KIND>
__device__ __forceinline__ float nys_term(float diff) {
    return KIND == 0 ? lap_abs(diff) : diff * diff;
}

// w * phi'(a - b) up to the constant: sign(a - b) (Laplacian), a - b (Gaussian).
template <int KIND>
__device__ __forceinline__ float nys_dphi(float a, float b, float w) {
    return KIND == 0 ? lap_signed_weight(a, b, w, -w) : w * (a - b);
}

__device__ __forceinline__ int nys_tid() { return threadIdx.y * NYS_TX + threadIdx.x; }

// Zeroes a thread's accumulator block.
template <int R, int C>
__device__ __forceinline__ void nys_zero(float (&acc)[R][C]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] = 0.0f;
}

// ct[i][j] = exp(-sum_t phi(x[i, t] - L[j, t]) / lam) for the tile's rows i < nrows and
// landmarks j < p.m, 0 elsewhere (so padded rows and columns add nothing to any sum); the
// accumulation is the l1 line (nys_term). x points at the tile's first row, L at the bh's
// landmarks (strides, m, d and lam from p). Ends with a barrier: ct is ready for every thread.
// TY: thread rows of the tile (NYS_TX x TY threads); BLOCK: the block's threads, the ones
// past the tile's only passing the barriers.
template <int TN, typename T, int KIND, int TY = NYS_TY, int BLOCK = NYS_TX * TY>
__device__ void nys_kernel_tile(const nys_params& p, const T* __restrict__ x, long long xsn,
                                long long xsd, int nrows, const T* __restrict__ L,
                                float (*xs)[TN + 1], float (*ys)[NYS_MP + 1],
                                float (*ct)[NYS_MP + 1]) {
    constexpr int R = TN / TY, C = NYS_CM, THREADS = NYS_TX * TY;
    const int tx = threadIdx.x, ty = threadIdx.y, tid = nys_tid();
    static_assert(BLOCK >= THREADS, "the tile's threads are the block's first");
    const bool on = BLOCK == THREADS || tid < THREADS;
    const long long lsn = p.L.sn, lsd = p.L.sd;
    const int m = p.m, d = p.d;
    const float neg_inv_lam = p.neg_inv_lam;
    float acc[R][C];
    nys_zero(acc);
    for (int k0 = 0; k0 < d; k0 += NYS_TK) {
        // Zero padding on both sides makes the tail terms vanish.
        for (int e = on ? tid : TN * NYS_TK; e < TN * NYS_TK; e += THREADS) {
            const int r = e / NYS_TK, kk = e % NYS_TK;
            float value = 0.0f;
            if (r < nrows && k0 + kk < d) value = lap_load(x + r * xsn + (k0 + kk) * xsd);
            xs[kk][r] = value;
        }
        for (int e = on ? tid : NYS_MP * NYS_TK; e < NYS_MP * NYS_TK; e += THREADS) {
            const int j = e / NYS_TK, kk = e % NYS_TK;
            float value = 0.0f;
            if (j < m && k0 + kk < d) value = lap_load(L + j * lsn + (k0 + kk) * lsd);
            ys[kk][j] = value;
        }
        __syncthreads();
        if (on) {
#pragma unroll
            for (int kk = 0; kk < NYS_TK; ++kk) {
                float xr[R], yc[C];
#pragma unroll
                for (int r = 0; r < R; ++r) xr[r] = xs[kk][ty + TY * r];
#pragma unroll
                for (int c = 0; c < C; ++c) yc[c] = ys[kk][tx + NYS_TX * c];
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int c = 0; c < C; ++c) acc[r][c] += nys_term<KIND>(xr[r] - yc[c]);
            }
        }
        __syncthreads();
    }
    if (on) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int i = ty + TY * r;
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const int j = tx + NYS_TX * c;
                ct[i][j] = (i < nrows && j < m) ? lap_exp(acc[r][c] * neg_inv_lam) : 0.0f;
            }
        }
    }
    __syncthreads();
}

// rm[i] = mean over the m landmarks of row i (0 for padded rows), and with rc the mean of
// the row minus rm[i]: c~ = (c - rm) - rc is reference.centre_rows's twice-centred row. A
// row's values nearly agree, so rm's rounding is most of what one pass leaves, common to
// the row, and the whitening's s scales it into every column. Ends with a barrier.
template <int TN>
__device__ void nys_row_means(float (*ct)[NYS_MP + 1], int nrows, int m, float* rm,
                              float* rc = nullptr) {
    for (int i = nys_tid(); i < TN; i += NYS_THREADS) {
        float s = 0.0f;
        if (i < nrows)
            for (int j = 0; j < m; ++j) s += ct[i][j];
        const float mean = s / (float)m;
        rm[i] = mean;
        if (rc == nullptr) continue;
        s = 0.0f;
        if (i < nrows)
            for (int j = 0; j < m; ++j) s += ct[i][j] - mean;
        rc[i] = s / (float)m;
    }
    __syncthreads();
}

// dst[i][t] = x[i, t] (less shift[t] where given) for rows i < nrows and columns
// t < width, 0 elsewhere, over the first NYS_DV columns of rows W + 1 wide (no barrier).
template <int TN, int W, typename T>
__device__ void nys_load_rows(const T* __restrict__ x, long long sn, long long st, int nrows,
                              int width, float (*dst)[W + 1], const float* shift = nullptr) {
    for (int e = nys_tid(); e < TN * NYS_DV; e += NYS_THREADS) {
        const int i = e / NYS_DV, t = e % NYS_DV;
        const bool in = i < nrows && t < width;
        dst[i][t] = in ? lap_load(x + i * sn + t * st) - (shift ? shift[t] : 0.0f) : 0.0f;
    }
}

// acc[r][c] += sum_i a[i][ty + NYS_TY r] * b[i][tx + NYS_TX c]: the thread's block of the
// (NYS_MP x NYS_DV) product a^T b over the tile's rows.
__device__ __forceinline__ void nys_acc_atb(float (*a)[NYS_MP + 1], float (*b)[NYS_DV + 1],
                                            int nrows, float acc[NYS_RM][NYS_CV]) {
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (int i = 0; i < nrows; ++i) {
        float ar[NYS_RM], bc[NYS_CV];
#pragma unroll
        for (int r = 0; r < NYS_RM; ++r) ar[r] = a[i][ty + NYS_TY * r];
#pragma unroll
        for (int c = 0; c < NYS_CV; ++c) bc[c] = b[i][tx + NYS_TX * c];
#pragma unroll
        for (int r = 0; r < NYS_RM; ++r)
#pragma unroll
            for (int c = 0; c < NYS_CV; ++c) acc[r][c] += ar[r] * bc[c];
    }
}

// Writes the thread's block of a C^T x product (rows j < m, columns e < dv) to dst (m x dv).
__device__ __forceinline__ void nys_store_atb(const float (&acc)[NYS_RM][NYS_CV], int m, int dv,
                                              float* __restrict__ dst) {
    const int tx = threadIdx.x, ty = threadIdx.y;
#pragma unroll
    for (int r = 0; r < NYS_RM; ++r) {
        const int j = ty + NYS_TY * r;
#pragma unroll
        for (int c = 0; c < NYS_CV; ++c) {
            const int e = tx + NYS_TX * c;
            if (j < m && e < dv) dst[j * dv + e] = acc[r][c];
        }
    }
}

// Shared memory of a row pass's kernel tile: the staged d-chunks, the tile, its row means
// (nys_row_means's rm and rc).
struct nys_row_smem {
    float xs[NYS_TK][NYS_TN + 1];
    float ys[NYS_TK][NYS_MP + 1];
    float ct[NYS_TN][NYS_MP + 1];
    float rm[NYS_TN];
    float rc[NYS_TN];
};

// k(L, L) (no eps) into ct[j][l] for j, l < m, zeros elsewhere, through the staged, coalesced
// loads of a kernel tile on the first NYS_THREADS threads of a BLOCK-thread block (more
// threads a tile would take more rows each and more staging per term: 6.2 instructions a
// term on 512 against 4.2 on 256); `tile` holds NYS_LTILE floats. Returns ct; ends with a
// barrier.
template <typename T, int KIND, int BLOCK = NYS_THREADS>
__device__ __forceinline__ float (*nys_landmark_tile(const nys_params& p, const T* lb,
                                                     float* tile))[NYS_MP + 1] {
    typedef float Row[NYS_MP + 1];
    Row* xs = reinterpret_cast<Row*>(tile);
    Row* ys = xs + NYS_TK;
    Row* ct = ys + NYS_TK;
    nys_kernel_tile<NYS_MP, T, KIND, NYS_TY, BLOCK>(p, lb, p.L.sn, p.L.sd, p.m, lb, xs, ys, ct);
    return ct;
}

// Slices [first, last) of group g of a merge: NYS_SGROUPS groups of consecutive slices, so
// every sum over slices runs in slice order within a group and then over the groups in order.
__device__ __forceinline__ void nys_slice_range(int splits, int g, int& first, int& last) {
    const int per = (splits + NYS_SGROUPS - 1) / NYS_SGROUPS;
    first = min(splits, g * per);
    last = min(splits, first + per);
}

// sum over slices sp of src[sp * stride + e] for the block's NYS_LANES entries (lane =
// tid % NYS_LANES, entry e valid or not), in the order above, returned to the threads of
// group 0 (the others get their group's part). red: NYS_SGROUPS x NYS_LANES floats. Begins
// and ends with nothing pending: the barriers are inside.
__device__ __forceinline__ float nys_sum_slices(const float* __restrict__ src, long long stride,
                                                int splits, long long e, bool valid, float* red) {
    const int tid = nys_tid(), lane = tid % NYS_LANES, group = tid / NYS_LANES;
    int first, last;
    nys_slice_range(splits, group, first, last);
    float s = 0.0f;
    if (valid)
#pragma unroll 4
        for (int sp = first; sp < last; ++sp) s += src[sp * stride + e];
    red[group * NYS_LANES + lane] = s;
    __syncthreads();
    if (group == 0) {
        s = 0.0f;
        for (int g = 0; g < NYS_SGROUPS; ++g) s += red[g * NYS_LANES + lane];
    }
    // red is rewritten by the next call.
    __syncthreads();
    return s;
}

// Per bh of the backward: [dR~ = dR / N (m x d_v), a (m), W = (dP + dP^T) * k(L, L)
// (m x m), the merged T (m x d_v) and colsum(G) (d_v), w = colsum(G) / N - cbar dR~ (d_v)].
__device__ __forceinline__ long long nys_backward_work_stride(int m, int dv) {
    return 2LL * m * dv + m + (long long)m * m + 2LL * dv;
}

// ---------------------------------------------------------------------------
// Forward.
// ---------------------------------------------------------------------------

// Per bh of the forward: [P (m x m), the merged centred R (m x d_v), its column sums
// (m), the common part (r^T v - (sum r) vbar^T) / N (d_v), vbar (d_v)].
__device__ __forceinline__ long long nys_forward_work_stride(int m, int dv) {
    return (long long)m * m + (long long)m * dv + m + 2LL * dv;
}

// Doubles of a slice's fp64 sums in p.common: [r^T v (d_v), sum v (d_v), sum r].
__device__ __forceinline__ long long nys_common_stride(int dv) { return 2LL * dv + 1; }

// Pass 1: one block per (row slice, bh). Writes, per slice, the column mean and M2 of
// c~ over the slice's rows (injective) and the parts of R = C_k^T (v - 1 vbar^T) / N as
// reference.landmark_rhs sums it, (C_k - r 1^T)^T (v - 1 vbar^T) + 1 r^T (v - 1 vbar^T), r
// the key rows' means over the landmarks, without a pass for vbar: the centred
// (C_k - r 1^T)^T v and its column sums (C_k - r 1^T)^T 1 in fp32, part[bh, split] =
// [mean (m), M2 (m), centred R (m x d_v), column sums (m)], and r^T v, sum v and sum r
// in fp64, common[bh, split] (nys_common_stride); nys_forward_context combines them.
// Every key is nearly equally similar to every landmark: the output reads only R's
// small landmark-to-landmark differences, which a plain fp32 N-sum loses
// (docs/numerics.md).
template <typename T, int KIND>
NYS_KERNEL(NYS_THREADS) nys_forward_stats(NYS_PARAMS p) {
    __shared__ nys_row_smem rs;
    __shared__ float vt[NYS_TN][NYS_DV + 1];
    float (*ct)[NYS_MP + 1] = rs.ct;
    const float* rm = rs.rm;
    const float* rc = rs.rc;
    __shared__ float group_mean[NYS_GROUPS][NYS_MP];
    __shared__ float group_m2[NYS_GROUPS][NYS_MP];
    __shared__ double group_common[NYS_CGROUPS][NYS_DV];
    __shared__ double group_rsum[NYS_CGROUPS];
    const int tid = nys_tid();
    const int m = p.m, dv = p.dv;
    const int split = blockIdx.x, splits = gridDim.x;
    const int row_begin = split * p.chunk, row_end = min(p.n, row_begin + p.chunk);
    const long long part_stride = 3LL * m + (long long)m * dv;
    // Every thread works on the statistics and the column sums of the centred key tile:
    // column tid % NYS_MP over the tile rows of its group, the groups merged in order by
    // the first NYS_MP threads.
    constexpr int GROUP_ROWS = (NYS_TN + NYS_GROUPS - 1) / NYS_GROUPS;
    const int column = tid % NYS_MP, group = tid / NYS_MP;
    // The fp64 sums: value column tid % NYS_DV over the tile rows of its group, over the
    // whole slice, the groups summed in order at its end.
    constexpr int CGROUP_ROWS = (NYS_TN + NYS_CGROUPS - 1) / NYS_CGROUPS;
    const int vcolumn = tid % NYS_DV, cgroup = tid / NYS_DV;

    for (long long bh = blockIdx.y; bh < p.bh_count; bh += gridDim.y) {
        const T* qb = nys_in<T>(p.q, bh, p.heads);
        const T* kb = p.k.ptr == nullptr ? nullptr : nys_in<T>(p.k, bh, p.heads);
        const T* vb = nys_in<T>(p.v, bh, p.heads);
        const T* lb = nys_in<T>(p.L, bh, p.heads);
        // Column tid's running count, mean and M2 (threads tid < m).
        int count = 0;
        float mean = 0.0f, m2 = 0.0f;
        float acc[NYS_RM][NYS_CV];
        nys_zero(acc);
        // Column `column` of (C_k - r 1^T)^T 1 over the group's rows; r^T v and sum v of
        // value column `vcolumn` and sum r over the cgroup's rows.
        float ksum = 0.0f;
        double common = 0.0, vsum = 0.0, rsum = 0.0;
        for (int row0 = row_begin; row0 < row_end; row0 += NYS_TN) {
            const int nrows = min(NYS_TN, row_end - row0);
            nys_kernel_tile<NYS_TN, T, KIND>(p, qb + row0 * p.q.sn, p.q.sn, p.q.sd, nrows, lb,
                                             rs.xs, rs.ys, rs.ct);
            if (p.injective) {
                nys_row_means<NYS_TN>(rs.ct, nrows, p.m, rs.rm, rs.rc);
                // Two passes over the group's rows, then Chan et al.'s merge: no
                // E[x^2] - E[x]^2.
                const int i0 = min(nrows, group * GROUP_ROWS);
                const int i1 = min(nrows, i0 + GROUP_ROWS);
                float s = 0.0f, gm2 = 0.0f;
                for (int i = i0; i < i1; ++i) s += ct[i][column] - rm[i] - rc[i];
                const float gmean = i1 > i0 ? s / (float)(i1 - i0) : 0.0f;
                for (int i = i0; i < i1; ++i) {
                    const float dev = ct[i][column] - rm[i] - rc[i] - gmean;
                    gm2 += dev * dev;
                }
                group_mean[group][column] = gmean;
                group_m2[group][column] = gm2;
                __syncthreads();
                if (tid < m) {
                    for (int gi = 0; gi < NYS_GROUPS; ++gi) {
                        const int nb_rows = min(nrows, (gi + 1) * GROUP_ROWS) -
                                            min(nrows, gi * GROUP_ROWS);
                        if (nb_rows <= 0) continue;
                        const float na = (float)count, nb = (float)nb_rows, total = na + nb;
                        const float delta = group_mean[gi][tid] - mean;
                        mean += delta * (nb / total);
                        m2 += group_m2[gi][tid] + delta * delta * (na * nb / total);
                        count += nb_rows;
                    }
                }
            }
            // The statistics read ct, rm and the group sums; the key tile overwrites ct
            // (and its row means rm) and the next tile the sums only after the staging
            // barrier inside nys_kernel_tile, which every thread reaches after reading.
            // With tied keys the statistics' ct and rm are the key tile's, and their reads
            // end at the barrier after the group sums.
            if (kb != nullptr)
                nys_kernel_tile<NYS_TN, T, KIND>(p, kb + row0 * p.k.sn, p.k.sn, p.k.sd, nrows, lb,
                                                 rs.xs, rs.ys, rs.ct);
            if (kb != nullptr || !p.injective) nys_row_means<NYS_TN>(rs.ct, nrows, p.m, rs.rm);
            nys_load_rows<NYS_TN, NYS_DV, T>(vb + row0 * p.v.sn, p.v.sn, p.v.sd, nrows, dv, vt);
            // The key tile centred, C_k - r 1^T (padding stays 0).
            for (int e = tid; e < nrows * NYS_MP; e += NYS_THREADS) {
                const int i = e / NYS_MP, j = e % NYS_MP;
                if (j < m) ct[i][j] -= rm[i];
            }
            __syncthreads();
            nys_acc_atb(ct, vt, nrows, acc);
            {
                const int i0 = min(nrows, cgroup * CGROUP_ROWS);
                const int i1 = min(nrows, i0 + CGROUP_ROWS);
                for (int i = i0; i < i1; ++i) {
                    const double r = (double)rm[i], value = (double)vt[i][vcolumn];
                    common += r * value;
                    vsum += value;
                    rsum += r;
                }
            }
            {
                const int i0 = min(nrows, group * GROUP_ROWS);
                const int i1 = min(nrows, i0 + GROUP_ROWS);
                for (int i = i0; i < i1; ++i) ksum += ct[i][column];
            }
            // ct, rm and vt are rewritten by the next tile.
            __syncthreads();
        }
        float* pb = p.part + (bh * splits + split) * part_stride;
        double* cb = p.common + (bh * splits + split) * nys_common_stride(dv);
        if (p.injective && tid < m) {
            pb[tid] = mean;
            pb[m + tid] = m2;
        }
        nys_store_atb(acc, m, dv, pb + 2 * m);
        // The statistics' group sums are free after the last tile's barrier.
        group_mean[group][column] = ksum;
        group_common[cgroup][vcolumn] = common;
        __syncthreads();
        if (tid < m) {
            float s = 0.0f;
            for (int g = 0; g < NYS_GROUPS; ++g) s += group_mean[g][tid];
            pb[2 * m + m * dv + tid] = s;
        }
        if (tid < dv) {
            double s = 0.0;
            for (int g = 0; g < NYS_CGROUPS; ++g) s += group_common[g][tid];
            cb[tid] = s;
        }
        // group_common is rewritten with sum v.
        __syncthreads();
        group_common[cgroup][vcolumn] = vsum;
        if (vcolumn == 0) group_rsum[cgroup] = rsum;
        __syncthreads();
        if (tid < dv) {
            double s = 0.0;
            for (int g = 0; g < NYS_CGROUPS; ++g) s += group_common[g][tid];
            cb[dv + tid] = s;
        }
        if (tid == 0) {
            double s = 0.0;
            for (int g = 0; g < NYS_CGROUPS; ++g) s += group_rsum[g];
            cb[2 * dv] = s;
        }
        // group_mean, group_common and group_rsum are rewritten by the next bh.
        __syncthreads();
    }
}

// The Newton-Schulz job of nys_forward_solve for one bh, on all NYS_SOLVE_THREADS threads:
// P = k(L, L) + eps I, X its inverse; writes X to inverse and P to work. smem: P, X, T
// (padded mp x ld each) and p.ns_partials floats of ns_iterate's k-split partials, with the
// landmark tile staged at X first.
template <typename T, int KIND>
__device__ void nys_solve_inverse(const nys_params& p, long long bh, float* smem) {
    const int m = p.m, tid = nys_tid();
    const int mp = (m + NS_MT - 1) / NS_MT * NS_MT;
    const int ld = ns_stride(mp);
    float* Ps = smem;
    float* X = Ps + mp * ld;
    float* Tn = X + mp * ld;
    float* scratch = Tn + mp * ld;
    const float (*ct)[NYS_MP + 1] =
        nys_landmark_tile<T, KIND, NYS_SOLVE_THREADS>(p, nys_in<T>(p.L, bh, p.heads), X);
    ns_for_each(mp, ld, tid, NYS_SOLVE_THREADS, [&](int r, int c) {
        Ps[r * ld + c] = (r < m && c < m) ? ct[r][c] + (r == c ? p.eps : 0.0f) : 0.0f;
    });
    // The tile overlaps X and Tn.
    __syncthreads();
    if (ld == NS_LD_NARROW)
        ns_iterate<float, NS_LD_NARROW>(Ps, X, Tn, scratch, m, p.iters, p.init_authors,
                                        p.ns_partials);
    else
        ns_iterate<float, NS_LD_WIDE>(Ps, X, Tn, scratch, m, p.iters, p.init_authors,
                                      p.ns_partials);
    float* ib = p.inverse + bh * m * m;
    float* wb = p.work + bh * nys_forward_work_stride(m, p.dv);
    ns_for_each(m, m, tid, NYS_SOLVE_THREADS, [&](int r, int c) {
        ib[r * m + c] = X[r * ld + c];
        wb[r * m + c] = Ps[r * ld + c];
    });
}

// A merge unit of nys_forward_solve (the block's NYS_THREADS threads from unit * NYS_THREADS
// on): the slices' sums for NYS_LANES consecutive entries `piece` of [m statistics
// columns, R's m x d_v centred entries, its m column sums, d_v value columns] (none past
// them). Writes stats' [mean, s] (injective) and cbar = (column sums + sum r) / N, and into
// work after P the merged centred R, its column sums, and per value column, from the fp64
// sums, vbar = sum v / N and the common part (r^T v - (sum r) vbar) / N, rounded once (the two
// nearly cancel). red: the unit's 9 x NYS_THREADS floats, the last 6 x NYS_THREADS 8-byte
// aligned. Every thread of the block calls this (one barrier).
__device__ void nys_merge_forward(const nys_params& p, long long bh, int piece, float* red) {
    const int tid = nys_tid() % NYS_THREADS, lane = tid % NYS_LANES, group = tid / NYS_LANES;
    const int m = p.m, dv = p.dv, md = m * dv;
    const int e = piece * NYS_LANES + lane;
    const bool stat = e < m, colsum = e >= m + md && e < 2 * m + md, column = e >= 2 * m + md,
               valid = e < 2 * m + md + dv && (!stat || p.injective);
    const long long stride = 3LL * m + (long long)md, cstride = nys_common_stride(dv);
    const float* pb = p.part + bh * p.splits * stride;
    const double* cb = p.common + bh * p.splits * cstride;
    double* cred = reinterpret_cast<double*>(red + 3 * NYS_THREADS);
    int first, last;
    nys_slice_range(p.splits, group, first, last);
    // Statistics: Chan et al.'s merge of (count, mean, M2) over the group's slices in order;
    // R and the column sums: the sum (in `mean`); in fp64, sum r (column sums and value
    // columns, in `rsum`), r^T v and sum v (value columns).
    float count = 0.0f, mean = 0.0f, m2 = 0.0f;
    double common = 0.0, vsum = 0.0, rsum = 0.0;
    if (valid && column) {
        const int c = e - 2 * m - md;
        for (int sp = first; sp < last; ++sp) {
            common += cb[sp * cstride + c];
            vsum += cb[sp * cstride + dv + c];
            rsum += cb[sp * cstride + 2 * dv];
        }
    } else if (valid && stat) {
        for (int sp = first; sp < last; ++sp) {
            const float nb = (float)min(p.chunk, p.n - sp * p.chunk);
            const float total = count + nb, delta = pb[sp * stride + e] - mean;
            mean += delta * (nb / total);
            m2 += pb[sp * stride + m + e] + delta * delta * (count * nb / total);
            count = total;
        }
    } else if (valid) {
#pragma unroll 4
        for (int sp = first; sp < last; ++sp) mean += pb[sp * stride + m + e];
        if (colsum)
            for (int sp = first; sp < last; ++sp) rsum += cb[sp * cstride + 2 * dv];
    }
    red[tid] = count;
    red[NYS_THREADS + tid] = mean;
    red[2 * NYS_THREADS + tid] = m2;
    cred[tid] = common;
    cred[NYS_THREADS + tid] = vsum;
    cred[2 * NYS_THREADS + tid] = rsum;
    __syncthreads();
    if (group == 0 && valid) {
        float* wb = p.work + bh * nys_forward_work_stride(m, dv) + (long long)m * m;
        const double n = (double)p.n;
        if (column) {
            common = vsum = rsum = 0.0;
            for (int g = 0; g < NYS_SGROUPS; ++g) {
                const int i = g * NYS_LANES + lane;
                common += cred[i];
                vsum += cred[NYS_THREADS + i];
                rsum += cred[2 * NYS_THREADS + i];
            }
            const double vmean = vsum / n;
            wb[e - m] = (float)((common - rsum * vmean) / n);
            wb[e - m + dv] = (float)vmean;
        } else if (stat) {
            count = mean = m2 = 0.0f;
            for (int g = 0; g < NYS_SGROUPS; ++g) {
                const int i = g * NYS_LANES + lane;
                const float nb = red[i];
                if (nb == 0.0f) continue;
                const float total = count + nb, delta = red[NYS_THREADS + i] - mean;
                mean += delta * (nb / total);
                m2 += red[2 * NYS_THREADS + i] + delta * delta * (count * nb / total);
                count = total;
            }
            // A column constant over the queries with whiten_eps = 0 stays 0.
            const float denom = m2 / (float)p.n + p.whiten_eps;
            float* sb = nys_stats(p, bh);
            sb[e] = mean;
            sb[m + e] = denom > 0.0f ? 1.0f / sqrtf(denom) : 0.0f;
        } else {
            float s = 0.0f;
            rsum = 0.0;
            for (int g = 0; g < NYS_SGROUPS; ++g) {
                s += red[NYS_THREADS + g * NYS_LANES + lane];
                rsum += cred[2 * NYS_THREADS + g * NYS_LANES + lane];
            }
            wb[e - m] = s;
            if (colsum) nys_key_mean(p, bh)[e - m - md] = (float)(((double)s + rsum) / n);
        }
    }
}

// Pass 2: grid (jobs, bh), blocks of NYS_TX x NYS_SY threads loop over both. Job 0 of a bh
// builds P = k(L, L) + eps I and runs Newton-Schulz (the one serial part); jobs 1.. merge
// the slices of pass 1 in parallel with it, NYS_UNITS pieces of NYS_LANES entries each
// (a unit's threads: NYS_SGROUPS groups of consecutive slices times NYS_LANES coalesced
// entries). Outputs inverse (bh, m, m), stats (bh, 3, m) = [mean, s, cbar] (injective; s =
// (sigma^2 + delta)^-1/2; 'none': (bh, 1, m) = [cbar]) and work (bh) =
// nys_forward_work_stride's [P, centred R, its column sums, common part, vbar].
//
// Dynamic shared memory (floats), backends.cuda.solve_smem: P, X and the Newton-Schulz
// scratch (mp x ld each, the padded layout of ns_iterate) and p.ns_partials floats of its
// k-split partials; at least the landmark tile (NYS_LTILE) after P; a merge job uses
// 9 NYS_SOLVE_THREADS of it.
static_assert(9 * NYS_SOLVE_THREADS <= NYS_LTILE, "a merge job fits the landmark tile's room");
static_assert(NYS_SOLVE_THREADS >= (NYS_MP / NS_MT) * (NYS_MP / NS_MT + 1),
              "every tile of Newton-Schulz's X R beside R R has a thread");
static_assert(NYS_THREADS % 2 == 0, "a merge unit's fp64 sums stay 8-byte aligned");
template <typename T, int KIND>
NYS_KERNEL(NYS_SOLVE_THREADS) nys_forward_solve(NYS_PARAMS p) {
    LAP_DYNAMIC_SHARED_BYTES(smem_bytes);
    float* smem = reinterpret_cast<float*>(smem_bytes);
    const int pieces = (2 * p.m + p.m * p.dv + p.dv + NYS_LANES - 1) / NYS_LANES;
    const int jobs = 1 + (pieces + NYS_UNITS - 1) / NYS_UNITS;
    const int unit = nys_tid() / NYS_THREADS;
    for (long long bh = blockIdx.y; bh < p.bh_count; bh += gridDim.y)
        for (int job = blockIdx.x; job < jobs; job += gridDim.x) {
            if (job == 0)
                nys_solve_inverse<T, KIND>(p, bh, smem);
            else
                nys_merge_forward(p, bh, (job - 1) * NYS_UNITS + unit,
                                  smem + unit * 9 * NYS_THREADS);
            // The next job reuses the shared memory.
            __syncthreads();
        }
}

// Pass 2b: grid (value-column groups of NYS_CC, bh). R = [centred R - (its column sums)
// vbar^T] / N plus the common part, context = X R and the refinement step X (R - P X R)
// with its residual in fp64, as the reference; context's row m = vbar; fold (bh, m + 1,
// d_v) = [diag(s) context; colsum(context) / m + vbar] for the output pass
// (normalize='none': [context; vbar]). Every value column is independent, so the columns
// spread over blocks.
template <typename T>
NYS_KERNEL(NYS_THREADS) nys_forward_context(NYS_PARAMS p) {
    __shared__ float Xs[NYS_MP][NYS_MP + 1];
    __shared__ float Ps[NYS_MP][NYS_MP + 1];
    __shared__ float R[NYS_MP][NYS_CC + 1];
    __shared__ float Cx[NYS_MP][NYS_CC + 1];
    __shared__ float sv[NYS_MP];
    const int m = p.m, dv = p.dv, tid = nys_tid();
    const int md = m * dv, groups = (dv + NYS_CC - 1) / NYS_CC;
    const float n = (float)p.n;
    for (long long bh = blockIdx.y; bh < p.bh_count; bh += gridDim.y) {
        const float* wb = p.work + bh * nys_forward_work_stride(m, dv);
        const float* ib = p.inverse + bh * m * m;
        for (int e = tid; e < m * m; e += NYS_THREADS) {
            Xs[e / m][e % m] = ib[e];
            Ps[e / m][e % m] = wb[e];
        }
        for (int j = tid; j < m; j += NYS_THREADS)
            sv[j] = p.injective ? nys_stats(p, bh)[m + j] : 1.0f;
        float* cb = nys_context(p, bh);
        float* fb = p.fold + bh * (md + dv);
        // The merge's sums (nys_forward_work_stride).
        const float* rt = wb + m * m;
        const float* ksum = rt + md;
        const float* common = ksum + m;
        const float* vmean = common + dv;
        for (int g = blockIdx.x; g < groups; g += gridDim.x) {
            const int c0 = g * NYS_CC, w = min(NYS_CC, dv - c0), mw = m * w;
            for (int e = tid; e < mw; e += NYS_THREADS) {
                const int j = e / w, c = e % w;
                // (C_k - r 1^T)^T (v - 1 vbar^T) / N plus the common part r^T (v - 1 vbar^T) / N
                // (rounded to fp32 in the merge), as reference.landmark_rhs.
                R[j][c] = (rt[j * dv + c0 + c] - ksum[j] * vmean[c0 + c]) / n + common[c0 + c];
            }
            __syncthreads();
            for (int e = tid; e < mw; e += NYS_THREADS) {
                const int j = e / w, c = e % w;
                float s = 0.0f;
                for (int l = 0; l < m; ++l) s += Xs[j][l] * R[l][c];
                Cx[j][c] = s;
            }
            __syncthreads();
            if (p.refine) {
                // R <- R - P context in fp64 (each thread owns its entry), then
                // context += X R.
                for (int e = tid; e < mw; e += NYS_THREADS) {
                    const int j = e / w, c = e % w;
                    double s = (double)R[j][c];
                    for (int l = 0; l < m; ++l) s -= (double)Ps[j][l] * (double)Cx[l][c];
                    R[j][c] = (float)s;
                }
                __syncthreads();
                for (int e = tid; e < mw; e += NYS_THREADS) {
                    const int j = e / w, c = e % w;
                    float s = 0.0f;
                    for (int l = 0; l < m; ++l) s += Xs[j][l] * R[l][c];
                    Cx[j][c] += s;
                }
                __syncthreads();
            }
            for (int e = tid; e < mw; e += NYS_THREADS) {
                const int j = e / w, c = e % w;
                cb[j * dv + c0 + c] = Cx[j][c];
                fb[j * dv + c0 + c] = sv[j] * Cx[j][c];
            }
            for (int c = tid; c < w; c += NYS_THREADS) {
                float s = 0.0f;
                if (p.injective)
                    for (int j = 0; j < m; ++j) s += Cx[j][c];
                cb[md + c0 + c] = vmean[c0 + c];
                fb[md + c0 + c] = s / (float)m + vmean[c0 + c];
            }
            // R and Cx are rewritten by the next columns.
            __syncthreads();
        }
        // X, P and the scales are reloaded for the next bh.
        __syncthreads();
    }
}

// Pass 3: one block per (row tile, bh). out (B, N, heads, d_v), contiguous, the input
// dtype: out[i] = c~[i] fold + b, or C[i] context + vbar for 'none' (fold = [context; vbar]).
template <typename T, int KIND>
NYS_KERNEL(NYS_THREADS) nys_forward_out(NYS_PARAMS p) {
    __shared__ nys_row_smem rs;
    __shared__ float fp[NYS_MP][NYS_DV + 1];
    __shared__ float bv[NYS_DV];
    const float (*ct)[NYS_MP + 1] = rs.ct;
    const float* rm = rs.rm;
    const float* rc = rs.rc;
    constexpr int R = NYS_TN / NYS_TY;
    const int tx = threadIdx.x, ty = threadIdx.y, tid = nys_tid();
    const int n = p.n, m = p.m, dv = p.dv, heads = p.heads;
    const int tiles = (n + NYS_TN - 1) / NYS_TN;
    T* out = static_cast<T*>(p.out);

    for (long long bh = blockIdx.y; bh < p.bh_count; bh += gridDim.y) {
        const T* qb = nys_in<T>(p.q, bh, heads);
        const T* lb = nys_in<T>(p.L, bh, heads);
        const float* fb = p.fold + bh * (long long)(m + 1) * dv;
        for (int e = tid; e < m * dv; e += NYS_THREADS) fp[e / dv][e % dv] = fb[e];
        for (int c = tid; c < dv; c += NYS_THREADS) bv[c] = fb[m * dv + c];
        const long long batch = bh / heads, head = bh % heads;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            const int row0 = tile * NYS_TN, nrows = min(NYS_TN, n - row0);
            // fp and bv are complete after the barriers inside nys_kernel_tile.
            nys_kernel_tile<NYS_TN, T, KIND>(p, qb + row0 * p.q.sn, p.q.sn, p.q.sd, nrows, lb,
                                             rs.xs, rs.ys, rs.ct);
            if (p.injective) nys_row_means<NYS_TN>(rs.ct, nrows, p.m, rs.rm, rs.rc);
            float acc[R][NYS_CV];
            nys_zero(acc);
            for (int j = 0; j < m; ++j) {
                float cr[R], fc[NYS_CV];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const int i = ty + NYS_TY * r;
                    cr[r] = p.injective ? ct[i][j] - rm[i] - rc[i] : ct[i][j];
                }
#pragma unroll
                for (int c = 0; c < NYS_CV; ++c) fc[c] = fp[j][tx + NYS_TX * c];
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int c = 0; c < NYS_CV; ++c) acc[r][c] += cr[r] * fc[c];
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int i = ty + NYS_TY * r;
                if (i >= nrows) continue;
                T* ob = out + ((batch * n + row0 + i) * heads + head) * dv;
#pragma unroll
                for (int c = 0; c < NYS_CV; ++c) {
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
// Backward. G is the gradient of out, (B, N, heads, d_v), operand p.g.
// ---------------------------------------------------------------------------

// Pass A: one block per (row slice, bh): part[bh, split] = [T = c~^T G (m x d_v),
// colsum(G) (d_v)] over the slice's rows (T = C_q^T G for 'none').
template <typename T, int KIND>
NYS_KERNEL(NYS_THREADS) nys_backward_reduce(NYS_PARAMS p) {
    __shared__ nys_row_smem rs;
    __shared__ float gt[NYS_TN][NYS_DV + 1];
    float (*ct)[NYS_MP + 1] = rs.ct;
    const float* rm = rs.rm;
    const float* rc = rs.rc;
    const int tid = nys_tid();
    const int m = p.m, dv = p.dv;
    const int split = blockIdx.x, splits = gridDim.x;
    const int row_begin = split * p.chunk, row_end = min(p.n, row_begin + p.chunk);
    const long long part_stride = (long long)m * dv + dv;

    for (long long bh = blockIdx.y; bh < p.bh_count; bh += gridDim.y) {
        const T* gb = nys_in<T>(p.g, bh, p.heads);
        const T* qb = nys_in<T>(p.q, bh, p.heads);
        const T* lb = nys_in<T>(p.L, bh, p.heads);
        float acc[NYS_RM][NYS_CV];
        nys_zero(acc);
        float gsum = 0.0f;  // column tid of G (threads tid < d_v)
        for (int row0 = row_begin; row0 < row_end; row0 += NYS_TN) {
            const int nrows = min(NYS_TN, row_end - row0);
            nys_kernel_tile<NYS_TN, T, KIND>(p, qb + row0 * p.q.sn, p.q.sn, p.q.sd, nrows, lb,
                                             rs.xs, rs.ys, rs.ct);
            if (p.injective) {
                nys_row_means<NYS_TN>(rs.ct, nrows, p.m, rs.rm, rs.rc);
                for (int e = tid; e < NYS_TN * NYS_MP; e += NYS_THREADS) {
                    const int i = e / NYS_MP, j = e % NYS_MP;
                    if (i < nrows && j < m) ct[i][j] = ct[i][j] - rm[i] - rc[i];
                }
            }
            nys_load_rows<NYS_TN, NYS_DV, T>(gb + row0 * p.g.sn, p.g.sn, p.g.sd, nrows, dv, gt);
            __syncthreads();
            nys_acc_atb(ct, gt, nrows, acc);
            if (tid < dv)
                for (int i = 0; i < nrows; ++i) gsum += gt[i][tid];
            // ct and gt are rewritten by the next tile.
            __syncthreads();
        }
        float* pb = p.part + (bh * splits + split) * part_stride;
        nys_store_atb(acc, m, dv, pb);
        if (tid < dv) pb[m * dv + tid] = gsum;
    }
}

// Pass A2: grid (pieces of NYS_LANES entries, bh): the slices of pass A summed per entry,
// [T (m x d_v), colsum(G) (d_v)], into the merged part of work (nys_backward_work_stride).
template <typename T>
NYS_KERNEL(NYS_THREADS) nys_backward_merge(NYS_PARAMS p) {
    __shared__ float red[NYS_THREADS];
    const int m = p.m, dv = p.dv, md = m * dv;
    const long long part_stride = (long long)md + dv;
    const int pieces = (md + dv + NYS_LANES - 1) / NYS_LANES;
    const int lane = nys_tid() % NYS_LANES, group = nys_tid() / NYS_LANES;
    for (long long bh = blockIdx.y; bh < p.bh_count; bh += gridDim.y) {
        const float* pb = p.part + bh * p.splits * part_stride;
        float* merged = p.work + bh * nys_backward_work_stride(m, dv) + md + m + (long long)m * m;
        for (int piece = blockIdx.x; piece < pieces; piece += gridDim.x) {
            const int e = piece * NYS_LANES + lane;
            const float s = nys_sum_slices(pb, part_stride, p.splits, e, e < md + dv, red);
            if (group == 0 && e < md + dv) merged[e] = s;
        }
    }
}

// Pass B0: one block per bh. work[bh] = [dR~ = dR / N (m x d_v), a (m), W = (dP + dP^T)
// * k(L, L)] and w = colsum(G) / N - cbar dR~ (nys_backward_work_stride), from the merged T
// and colsum(G), and cbar (read from the stats where w is formed).
//
// Dynamic shared memory (floats): k(L, L) (m x m); X (m x m), then dP (m x (m + 1));
// the context, dcontext and dR for solve_cols value columns at a time (m x (solve_cols
// + 1) each: the odd row stride keeps the dP loop's reads of the context in distinct
// banks); the scale (NYS_MP); colsum(G) (solve_cols); the landmark tile (NYS_LTILE) is
// staged at X first; backends.cuda.backward_solve_smem sizes it. dP sums over every value
// column, so each thread keeps its dP entries in registers across the column passes.
template <typename T, int KIND>
NYS_KERNEL(NYS_THREADS) nys_backward_solve(NYS_PARAMS p) {
    LAP_DYNAMIC_SHARED_BYTES(smem_bytes);
    const int m = p.m, dv = p.dv, cw = p.solve_cols, lc = cw + 1;
    float* K = reinterpret_cast<float*>(smem_bytes);   // k(L, L)
    float* X = K + m * m;                              // X, later dP (row stride m + 1)
    float* Cx = X + m * (m + 1);
    float* Dc = Cx + m * lc;
    float* DR = Dc + m * lc;
    float* sv = DR + m * lc;
    float* gs = sv + NYS_MP;
    const int tid = nys_tid();
    const int md = m * dv;
    const long long work_stride = nys_backward_work_stride(m, dv);

    for (long long bh = blockIdx.x; bh < p.bh_count; bh += gridDim.x) {
        const T* lb = nys_in<T>(p.L, bh, p.heads);
        const float* cb = nys_context(p, bh);
        const float* kmean = nys_key_mean(p, bh);
        float* wb = p.work + bh * work_stride;
        const float* tb = wb + md + m + m * m;   // the merged T, then colsum(G), then w
        float* wv = wb + 2 * md + m + m * m + dv;
        const float (*ct)[NYS_MP + 1] = nys_landmark_tile<T, KIND>(p, lb, X);
        for (int e = tid; e < m * m; e += NYS_THREADS) K[e] = ct[e / m][e % m];
        // The tile overlaps X.
        __syncthreads();
        for (int e = tid; e < m * m; e += NYS_THREADS) X[e] = p.inverse[bh * m * m + e];
        if (tid < m) sv[tid] = p.injective ? nys_stats(p, bh)[m + tid] : 1.0f;
        // a_j = s_j^3 sum_e T_je context_je / N, summed over the passes in column order.
        float ds = 0.0f;
        float dp[NYS_DPR];
#pragma unroll
        for (int r = 0; r < NYS_DPR; ++r) dp[r] = 0.0f;
        for (int c0 = 0; c0 < dv; c0 += cw) {
            const int w = min(cw, dv - c0), mw = m * w;
            for (int e = tid; e < mw; e += NYS_THREADS) {
                const int j = e / w, c = e % w;
                Dc[j * lc + c] = tb[j * dv + c0 + c];      // T, until dcontext replaces it
                Cx[j * lc + c] = cb[j * dv + c0 + c];
            }
            for (int c = tid; c < w; c += NYS_THREADS) gs[c] = tb[md + c0 + c];
            __syncthreads();
            if (p.injective) {
                if (tid < m)
                    for (int c = 0; c < w; ++c) ds += Dc[tid * lc + c] * Cx[tid * lc + c];
                __syncthreads();
                for (int e = tid; e < mw; e += NYS_THREADS) {
                    const int j = e / w, c = e % w;
                    Dc[j * lc + c] = sv[j] * Dc[j * lc + c] + gs[c] / (float)m;
                }
                __syncthreads();
            }
            for (int e = tid; e < mw; e += NYS_THREADS) {
                const int j = e / w, c = e % w;
                float s = 0.0f;
                for (int l = 0; l < m; ++l) s += X[j * m + l] * Dc[l * lc + c];
                DR[j * lc + c] = s;
            }
            __syncthreads();
            if (p.refine) {
                for (int e = tid; e < mw; e += NYS_THREADS) {
                    const int j = e / w, c = e % w;
                    double s = (double)Dc[j * lc + c];
                    for (int l = 0; l < m; ++l)
                        s -= ((double)K[j * m + l] + (j == l ? (double)p.eps : 0.0)) *
                             (double)DR[l * lc + c];
                    Dc[j * lc + c] = (float)s;
                }
                __syncthreads();
                for (int e = tid; e < mw; e += NYS_THREADS) {
                    const int j = e / w, c = e % w;
                    float s = 0.0f;
                    for (int l = 0; l < m; ++l) s += X[j * m + l] * Dc[l * lc + c];
                    DR[j * lc + c] += s;
                }
                __syncthreads();
            }
            // dP = -dR context^T, summed over the value columns in order.
#pragma unroll
            for (int r = 0; r < NYS_DPR; ++r) {
                const int e = tid + r * NYS_THREADS;
                if (e < m * m) {
                    const int j = e / m, l = e % m;
                    float s = dp[r];
                    for (int c = 0; c < w; ++c) s += DR[j * lc + c] * Cx[l * lc + c];
                    dp[r] = s;
                }
            }
            for (int e = tid; e < mw; e += NYS_THREADS) {
                const int j = e / w, c = e % w;
                wb[j * dv + c0 + c] = DR[j * lc + c] / (float)p.n;
            }
            // vbar's share of both paths to v (reference.value_grads).
            for (int c = tid; c < w; c += NYS_THREADS) {
                float s = gs[c];
                for (int j = 0; j < m; ++j) s -= kmean[j] * DR[j * lc + c];
                wv[c0 + c] = s / (float)p.n;
            }
            // Cx, Dc, DR and gs are rewritten by the next columns.
            __syncthreads();
        }
        // X is no longer needed: dP takes its place.
#pragma unroll
        for (int r = 0; r < NYS_DPR; ++r) {
            const int e = tid + r * NYS_THREADS;
            if (e < m * m) X[(e / m) * (m + 1) + e % m] = -dp[r];
        }
        __syncthreads();
        // L is both operands of the symmetric k(L, L): the weight is (dP + dP^T) * k.
        for (int e = tid; e < m * m; e += NYS_THREADS) {
            const int j = e / m, l = e % m;
            wb[md + m + e] = K[e] * (X[j * (m + 1) + l] + X[l * (m + 1) + j]);
        }
        if (tid < m) {
            const float s = sv[tid];
            wb[md + tid] = p.injective ? s * s * s * ds / (float)p.n : 0.0f;
        }
        // The next bh of this block reuses every buffer.
        __syncthreads();
    }
}

// dgrad[i, t] = neg_coef * sum_j w[i][j] phi'(x[i, t] - L[j, t]) for the tile's rows,
// written in the input dtype to dx (row and column strides dxsn, dxsd), and the landmarks'
// share -neg_coef * sum_i (...) added to the slice's fp32 partial lp (m x d; written, not
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
            for (int r = 0; r < NYS_RM; ++r) {
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

// Pass B: one block per (row slice, bh). grad_q, grad_k (B, h, N, d) and grad_v
// (B, h, N, d_v) in the input dtype; lpart[bh, split] (m x d, fp32) the landmarks'
// gradient through C_q and C_k over the slice's rows.
//
// Dynamic shared memory (floats, fixed by the variant):
// 2 NYS_MP (NYS_DV + 1) + 2 NYS_TB (NYS_MP + 1) + 2 NYS_TB (NYS_DW + 1)
// + NYS_TK (NYS_TB + 1) + NYS_TK (NYS_MP + 1) + 3 NYS_MP + 2 NYS_TB + 2 NYS_DV, as laid
// out below; backends.cuda_plan.grads_smem is the same number of bytes.
template <typename T, int KIND>
NYS_KERNEL(NYS_THREADS) nys_backward_grads(NYS_PARAMS p) {
    LAP_DYNAMIC_SHARED_BYTES(smem_bytes);
    typedef float RowM[NYS_MP + 1];
    typedef float RowV[NYS_DV + 1];
    typedef float RowW[NYS_DW + 1];
    typedef float RowB[NYS_TB + 1];
    RowV* cx = reinterpret_cast<RowV*>(smem_bytes);   // context
    RowV* dr = cx + NYS_MP;                            // dR~ = dR / N
    RowM* cq = reinterpret_cast<RowM*>(dr + NYS_MP);   // C_q tile
    RowM* wq = cq + NYS_TB;                            // dc~, then dC_q * C_q (+ dC_k * C_q)
    RowW* gt = reinterpret_cast<RowW*>(wq + NYS_TB);   // G, then dC_k * C_k (separate keys)
    RowW* vt = gt + NYS_TB;                            // v - vbar, then the C_k tile
    RowB* xs = reinterpret_cast<RowB*>(vt + NYS_TB);
    RowM* ys = reinterpret_cast<RowM*>(xs + NYS_TK);
    float* sv = reinterpret_cast<float*>(ys + NYS_TK);
    float* mu = sv + NYS_MP;
    float* av = mu + NYS_MP;
    float* rm = av + NYS_MP;
    float* rm2 = rm + NYS_TB;
    float* vmean = rm2 + NYS_TB;                       // vbar
    float* wv = vmean + NYS_DV;                        // w = colsum(G) / N - cbar dR~
    // C_q's second row means (nys_row_means's rc) are read before rm2 is written.
    float* rc = rm2;
    // gt and vt double as landmark-wide tiles: rows of NYS_DW >= NYS_MP floats.
    RowM* wk = reinterpret_cast<RowM*>(gt);
    RowM* ck = reinterpret_cast<RowM*>(vt);
    constexpr int R = NYS_TB / NYS_TY;
    const int tx = threadIdx.x, ty = threadIdx.y, tid = nys_tid();
    const int m = p.m, d = p.d, dv = p.dv, injective = p.injective;
    const float neg_coef = p.neg_coef;
    const int split = blockIdx.x, splits = gridDim.x;
    const int row_begin = split * p.chunk, row_end = min(p.n, row_begin + p.chunk);
    const int md = m * dv;
    const long long work_stride = nys_backward_work_stride(m, dv);
    const bool tied = p.k.ptr == nullptr;

    for (long long bh = blockIdx.y; bh < p.bh_count; bh += gridDim.y) {
        const T* gb = nys_in<T>(p.g, bh, p.heads);
        const T* qb = nys_in<T>(p.q, bh, p.heads);
        const T* kb = tied ? nullptr : nys_in<T>(p.k, bh, p.heads);
        const T* vb = nys_in<T>(p.v, bh, p.heads);
        const T* lb = nys_in<T>(p.L, bh, p.heads);
        const float* wb = p.work + bh * work_stride;
        T* dqb = nys_out<T>(p.grad_q, bh, p.heads);
        T* dkb = tied ? nullptr : nys_out<T>(p.grad_k, bh, p.heads);
        T* dvb = nys_out<T>(p.grad_v, bh, p.heads);
        const float* cb = nys_context(p, bh);
        for (int e = tid; e < NYS_MP * NYS_DV; e += NYS_THREADS) {
            const int j = e / NYS_DV, c = e % NYS_DV;
            const bool in = j < m && c < dv;
            cx[j][c] = in ? cb[j * dv + c] : 0.0f;
            dr[j][c] = in ? wb[j * dv + c] : 0.0f;
        }
        for (int j = tid; j < NYS_MP; j += NYS_THREADS) {
            const bool in = injective && j < m;
            mu[j] = in ? nys_stats(p, bh)[j] : 0.0f;
            sv[j] = in ? nys_stats(p, bh)[m + j] : 0.0f;
            av[j] = in ? wb[md + j] : 0.0f;
        }
        for (int c = tid; c < NYS_DV; c += NYS_THREADS) {
            vmean[c] = c < dv ? cb[md + c] : 0.0f;
            wv[c] = c < dv ? wb[2 * md + m + m * m + dv + c] : 0.0f;
        }
        float* lp = p.lpart + (bh * splits + split) * (long long)m * d;
        for (int row0 = row_begin; row0 < row_end; row0 += NYS_TB) {
            const int nrows = min(NYS_TB, row_end - row0);
            const bool first = row0 == row_begin;
            // cx, dr and the vectors are complete after the barriers inside.
            nys_kernel_tile<NYS_TB, T, KIND>(p, qb + row0 * p.q.sn, p.q.sn, p.q.sd, nrows, lb, xs,
                                             ys, cq);
            nys_load_rows<NYS_TB, NYS_DW, T>(gb + row0 * p.g.sn, p.g.sn, p.g.sd, nrows, dv, gt);
            nys_load_rows<NYS_TB, NYS_DW, T>(vb + row0 * p.v.sn, p.v.sn, p.v.sd, nrows, dv, vt,
                                             vmean);
            if (injective)
                nys_row_means<NYS_TB>(cq, nrows, m, rm, rc);
            else
                __syncthreads();
            // G context^T -> dc~, and dC_k = (v - vbar) dR~^T, for the thread's rows and
            // landmarks.
            float dck[R][NYS_CM];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int i = ty + NYS_TY * r;
#pragma unroll
                for (int c = 0; c < NYS_CM; ++c) {
                    const int j = tx + NYS_TX * c;
                    float gc = 0.0f, vd = 0.0f;
                    for (int e = 0; e < dv; ++e) {
                        gc += gt[i][e] * cx[j][e];
                        vd += vt[i][e] * dr[j][e];
                    }
                    const bool in = i < nrows && j < m;
                    float dct = gc;
                    if (injective) dct = sv[j] * gc - av[j] * (cq[i][j] - rm[i] - rc[i] - mu[j]);
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
                for (int c = 0; c < NYS_CM; ++c) {
                    const int j = tx + NYS_TX * c;
                    const float dcq = injective && j < m && i < nrows ? wq[i][j] - rm2[i] : wq[i][j];
                    if (tied) {
                        wq[i][j] = (dcq + dck[r][c]) * cq[i][j];
                    } else {
                        wq[i][j] = dcq * cq[i][j];
                        wk[i][j] = dck[r][c];
                    }
                }
            }
            if (!tied)
                // The C_k tile goes to vt's place after the staging barrier inside.
                nys_kernel_tile<NYS_TB, T, KIND>(p, kb + row0 * p.k.sn, p.k.sn, p.k.sd, nrows, lb,
                                                 xs, ys, ck);
            else
                __syncthreads();
            // dv = C_k dR~ + w for the thread's rows and value columns.
            RowM* cv = tied ? cq : ck;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int i = ty + NYS_TY * r;
                if (i >= nrows) continue;
                float acc[NYS_CV];
#pragma unroll
                for (int c = 0; c < NYS_CV; ++c) acc[c] = 0.0f;
                for (int j = 0; j < m; ++j) {
                    const float c_ij = cv[i][j];
#pragma unroll
                    for (int c = 0; c < NYS_CV; ++c) acc[c] += c_ij * dr[j][tx + NYS_TX * c];
                }
                T* dvi = dvb + (row0 + i) * p.grad_v.sn;
#pragma unroll
                for (int c = 0; c < NYS_CV; ++c) {
                    const int e = tx + NYS_TX * c;
                    if (e < dv) lap_store(dvi + e * p.grad_v.sd, acc[c] + wv[e]);
                }
            }
            if (!tied) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const int i = ty + NYS_TY * r;
#pragma unroll
                    for (int c = 0; c < NYS_CM; ++c) {
                        const int j = tx + NYS_TX * c;
                        wk[i][j] *= ck[i][j];
                    }
                }
            }
            // wq and wk are complete; the staging below overwrites only xs and ys.
            __syncthreads();
            nys_kernel_grads<T, KIND>(qb + row0 * p.q.sn, p.q.sn, p.q.sd, nrows, lb, p.L.sn,
                                      p.L.sd, m, d, wq, neg_coef, dqb + row0 * p.grad_q.sn,
                                      p.grad_q.sn, p.grad_q.sd, lp, first, xs, ys);
            if (!tied)
                nys_kernel_grads<T, KIND>(kb + row0 * p.k.sn, p.k.sn, p.k.sd, nrows, lb, p.L.sn,
                                          p.L.sd, m, d, wk, neg_coef, dkb + row0 * p.grad_k.sn,
                                          p.grad_k.sn, p.grad_k.sd, lp, false, xs, ys);
        }
    }
}

// Pass B1: grid (pieces of NYS_LANES entries, bh). grad_l (B, h, m, d), the input dtype:
// the part through P, sum_l W[j][l] phi'(L[j, t] - L[l, t]), plus the slices' partials,
// each summed by NYS_SGROUPS groups (of landmarks, of slices) and the groups in order.
template <typename T, int KIND>
NYS_KERNEL(NYS_THREADS) nys_backward_landmarks(NYS_PARAMS p) {
    __shared__ float red[NYS_THREADS];
    const int m = p.m, d = p.d, md = m * d;
    const int lane = nys_tid() % NYS_LANES, group = nys_tid() / NYS_LANES;
    const int pieces = (md + NYS_LANES - 1) / NYS_LANES;
    const int per = (m + NYS_SGROUPS - 1) / NYS_SGROUPS;
    const int l0 = min(m, group * per), l1 = min(m, l0 + per);
    for (long long bh = blockIdx.y; bh < p.bh_count; bh += gridDim.y) {
        const T* lb = nys_in<T>(p.L, bh, p.heads);
        const float* pb = p.lpart + bh * p.splits * (long long)md;
        const float* W = p.work + bh * nys_backward_work_stride(m, p.dv) + m * p.dv + m;
        T* db = nys_out<T>(p.grad_l, bh, p.heads);
        for (int piece = blockIdx.x; piece < pieces; piece += gridDim.x) {
            const int e = piece * NYS_LANES + lane, j = e / d, t = e % d;
            const bool valid = e < md;
            float s = 0.0f;
            if (valid) {
                const float a = lap_load(lb + j * p.L.sn + t * p.L.sd);
                for (int l = l0; l < l1; ++l)
                    s += nys_dphi<KIND>(a, lap_load(lb + l * p.L.sn + t * p.L.sd), W[j * m + l]);
            }
            const float slices = nys_sum_slices(pb, md, p.splits, e, valid, red);
            red[nys_tid()] = s;
            __syncthreads();
            if (group == 0 && valid) {
                float through_p = 0.0f;
                for (int g = 0; g < NYS_SGROUPS; ++g) through_p += red[g * NYS_LANES + lane];
                lap_store(db + j * p.grad_l.sn + t * p.grad_l.sd,
                          p.neg_coef * through_p + slices);
            }
            // red is rewritten by the next piece.
            __syncthreads();
        }
    }
}

#ifdef NYS_ELEMENT
// The entry points of a module of one element type, under fixed C names, so that the host
// needs no name expressions and CuPy's kernel cache serves the module by its source and
// options alone: <stage>_<kernel function> for the stages that evaluate one, <stage>_entry
// for the two that do not (backends.cuda_plan.entry_name).
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_forward_stats_laplacian(const nys_params p) { nys_forward_stats<NYS_ELEMENT, 0>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_forward_stats_gaussian(const nys_params p) { nys_forward_stats<NYS_ELEMENT, 1>(p); }
extern "C" __global__ void __launch_bounds__(NYS_SOLVE_THREADS)
nys_forward_solve_laplacian(const nys_params p) { nys_forward_solve<NYS_ELEMENT, 0>(p); }
extern "C" __global__ void __launch_bounds__(NYS_SOLVE_THREADS)
nys_forward_solve_gaussian(const nys_params p) { nys_forward_solve<NYS_ELEMENT, 1>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_forward_context_entry(const nys_params p) { nys_forward_context<NYS_ELEMENT>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_forward_out_laplacian(const nys_params p) { nys_forward_out<NYS_ELEMENT, 0>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_forward_out_gaussian(const nys_params p) { nys_forward_out<NYS_ELEMENT, 1>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_backward_reduce_laplacian(const nys_params p) { nys_backward_reduce<NYS_ELEMENT, 0>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_backward_reduce_gaussian(const nys_params p) { nys_backward_reduce<NYS_ELEMENT, 1>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_backward_merge_entry(const nys_params p) { nys_backward_merge<NYS_ELEMENT>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_backward_solve_laplacian(const nys_params p) { nys_backward_solve<NYS_ELEMENT, 0>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_backward_solve_gaussian(const nys_params p) { nys_backward_solve<NYS_ELEMENT, 1>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_backward_grads_laplacian(const nys_params p) { nys_backward_grads<NYS_ELEMENT, 0>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_backward_grads_gaussian(const nys_params p) { nys_backward_grads<NYS_ELEMENT, 1>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_backward_landmarks_laplacian(const nys_params p) { nys_backward_landmarks<NYS_ELEMENT, 0>(p); }
extern "C" __global__ void __launch_bounds__(NYS_THREADS)
nys_backward_landmarks_gaussian(const nys_params p) { nys_backward_landmarks<NYS_ELEMENT, 1>(p); }
#endif
