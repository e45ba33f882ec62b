// Fused pairwise kernel matrices and their gradients.
//
//   KIND 0 (Laplacian): C[b, i, j] = exp(-sum_t |x[b, i, t] - y[b, j, t]| / lam)
//   KIND 1 (Gaussian):  C[b, i, j] = exp(-sum_t (x[b, i, t] - y[b, j, t])^2 / lam)
//
// x is (batch, n, d), y is (batch, m, d), C is (batch, n, m), all contiguous.
// The forward is a GEMM-shaped loop in which the multiply-add is replaced by
// the distance term: 64x64 output tiles, d streamed through shared memory in
// chunks of 16, each of the 256 threads keeping a 4x4 block of distances in
// registers; the exponential is applied in registers, so no distance matrix
// is ever written. Offsets are 64-bit; every n, m, d and batch size works
// (tails are zero-padded; blocks loop over batch and row tiles beyond the
// grid limits).
#include "lap_common.cuh"

#define PW_TILE 64        // output tile edge (rows and columns)
#define PW_TK 16          // d-chunk staged in shared memory per step
#define PW_TX 16          // threads along columns
#define PW_TY 16          // threads along rows
#define PW_R (PW_TILE / PW_TY)
#define PW_C (PW_TILE / PW_TX)

template <int KIND, typename A>
__device__ __forceinline__ A pw_term(A diff) {
    return KIND == 0 ? lap_abs(diff) : diff * diff;
}

template <typename T, int KIND>
__global__ void __launch_bounds__(PW_TX * PW_TY)
pairwise_forward(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out,
                 long long batch, int n, int m, int d, double neg_inv_lam) {
    typedef typename lap_acc<T>::type A;
    // +1 column: the staging stores walk the d index fastest, which would
    // otherwise hit one bank 16 times.
    __shared__ A xs[PW_TK][PW_TILE + 1];
    __shared__ A ys[PW_TK][PW_TILE + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int tid = ty * PW_TX + tx;
    const int tiles_n = (n + PW_TILE - 1) / PW_TILE;
    const int col0 = blockIdx.x * PW_TILE;
    const A scale = (A)neg_inv_lam;

    for (long long b = blockIdx.z; b < batch; b += gridDim.z) {
        const T* xb = x + b * (long long)n * d;
        const T* yb = y + b * (long long)m * d;
        T* ob = out + b * (long long)n * m;
        for (int tn = blockIdx.y; tn < tiles_n; tn += gridDim.y) {
            const int row0 = tn * PW_TILE;
            A acc[PW_R][PW_C];
#pragma unroll
            for (int r = 0; r < PW_R; ++r)
#pragma unroll
                for (int c = 0; c < PW_C; ++c) acc[r][c] = A(0);

            for (int k0 = 0; k0 < d; k0 += PW_TK) {
                for (int e = tid; e < PW_TILE * PW_TK; e += PW_TX * PW_TY) {
                    const int r = e / PW_TK, k = e % PW_TK;
                    const bool k_ok = k0 + k < d;
                    // Padding with 0 on both sides makes the tail terms vanish.
                    A xv = A(0), yv = A(0);
                    if (k_ok && row0 + r < n) xv = lap_load(xb + (long long)(row0 + r) * d + k0 + k);
                    if (k_ok && col0 + r < m) yv = lap_load(yb + (long long)(col0 + r) * d + k0 + k);
                    xs[k][r] = xv;
                    ys[k][r] = yv;
                }
                __syncthreads();
#pragma unroll
                for (int k = 0; k < PW_TK; ++k) {
                    A xr[PW_R], yc[PW_C];
#pragma unroll
                    for (int r = 0; r < PW_R; ++r) xr[r] = xs[k][ty + PW_TY * r];
#pragma unroll
                    for (int c = 0; c < PW_C; ++c) yc[c] = ys[k][tx + PW_TX * c];
#pragma unroll
                    for (int r = 0; r < PW_R; ++r)
#pragma unroll
                        for (int c = 0; c < PW_C; ++c) acc[r][c] += pw_term<KIND>(xr[r] - yc[c]);
                }
                __syncthreads();
            }
            // Consecutive threads own consecutive columns: coalesced stores.
#pragma unroll
            for (int r = 0; r < PW_R; ++r) {
                const int i = row0 + ty + PW_TY * r;
#pragma unroll
                for (int c = 0; c < PW_C; ++c) {
                    const int j = col0 + tx + PW_TX * c;
                    if (i < n && j < m) lap_store(ob + (long long)i * m + j, lap_exp(acc[r][c] * scale));
                }
            }
        }
    }
}

// Gradient with respect to one operand ("rows", n_rows x d) given the other
// ("red", n_red x d), the upstream gradient g and the forward output C:
//
//   grad[i, t] = -coef * sum_j g(i, j) C(i, j) phi(rows[i, t] - red[j, t])
//
// phi = sign, coef = 1/lam (Laplacian); phi = identity, coef = 2/lam
// (Gaussian). The formula is symmetric, so dx uses rows = x, red = y and
// g, C as stored ((n, m): TRANS = false), and dy uses rows = y, red = x and
// reads g, C transposed (TRANS = true). Nothing of size n * m * d exists: the
// weights g*C of a 64 x 32 chunk are staged in shared memory and the operand
// values in registers. Each 64 x 32 output tile reduces over one slice of
// `red_chunk` reduction indices (split-K: the long reduction over n for dy
// would otherwise leave the GPU idle). With one slice (`partial` null) the
// tile is written to `out` (batch, n_rows, d) in the input dtype; with
// several, slices write fp32/fp64 partial sums to `partial` (splits, batch,
// n_rows, d), which the host sums in a fixed order, so the result is
// deterministic (no atomics).
#define PB_TR 64          // rows of the output tile
#define PB_TD 32          // d-columns of the output tile
#define PB_TJ 32          // reduction indices staged per step
#define PB_TX 16
#define PB_TY 16
#define PB_R (PB_TR / PB_TY)
#define PB_C (PB_TD / PB_TX)

template <typename T, int KIND, bool TRANS>
__global__ void __launch_bounds__(PB_TX * PB_TY)
pairwise_backward(const T* __restrict__ g, const T* __restrict__ cmat, const T* __restrict__ rows,
                  const T* __restrict__ red, T* __restrict__ out,
                  typename lap_acc<T>::type* __restrict__ partial, long long batch, int n_rows, int n_red, int d, int red_chunk, double neg_coef) {
    typedef typename lap_acc<T>::type A;
    __shared__ A ws[PB_TJ][PB_TR + 1];
    __shared__ A rs[PB_TJ][PB_TD + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int tid = ty * PB_TX + tx;
    const int tiles_d = (d + PB_TD - 1) / PB_TD;
    const int split = blockIdx.x / tiles_d;
    const int t0 = (blockIdx.x % tiles_d) * PB_TD;
    const int tiles_r = (n_rows + PB_TR - 1) / PB_TR;
    const int j_begin = split * red_chunk;
    const int j_end = min(n_red, j_begin + red_chunk);
    const A scale = (A)neg_coef;

    for (long long b = blockIdx.z; b < batch; b += gridDim.z) {
        // g and C are (n_rows, n_red) for dx and (n_red, n_rows) for dy.
        const long long gc_off = b * (long long)n_rows * n_red;
        const T* gb = g + gc_off;
        const T* cb = cmat + gc_off;
        const T* rowb = rows + b * (long long)n_rows * d;
        const T* redb = red + b * (long long)n_red * d;
        const long long out_off = b * (long long)n_rows * d;
        A* pb = partial == nullptr ? nullptr : partial + (long long)split * batch * n_rows * d + out_off;
        for (int tr = blockIdx.y; tr < tiles_r; tr += gridDim.y) {
            const int row0 = tr * PB_TR;
            A own[PB_R][PB_C];
            A acc[PB_R][PB_C];
#pragma unroll
            for (int r = 0; r < PB_R; ++r) {
                const int i = row0 + ty + PB_TY * r;
#pragma unroll
                for (int c = 0; c < PB_C; ++c) {
                    const int t = t0 + tx + PB_TX * c;
                    own[r][c] = (i < n_rows && t < d) ? (A)lap_load(rowb + (long long)i * d + t) : A(0);
                    acc[r][c] = A(0);
                }
            }
            for (int j0 = j_begin; j0 < j_end; j0 += PB_TJ) {
                for (int e = tid; e < PB_TR * PB_TJ; e += PB_TX * PB_TY) {
                    // Walk whichever index is contiguous in memory fastest.
                    const int r = TRANS ? e % PB_TR : e / PB_TJ;
                    const int j = TRANS ? e / PB_TR : e % PB_TJ;
                    const int i = row0 + r, jj = j0 + j;
                    A w = A(0);
                    if (i < n_rows && jj < j_end) {
                        const long long off = TRANS ? (long long)jj * n_rows + i : (long long)i * n_red + jj;
                        w = (A)lap_load(gb + off) * (A)lap_load(cb + off);
                    }
                    ws[j][r] = w;
                }
                for (int e = tid; e < PB_TJ * PB_TD; e += PB_TX * PB_TY) {
                    const int j = e / PB_TD, t = e % PB_TD;
                    A v = A(0);
                    if (j0 + j < j_end && t0 + t < d) v = lap_load(redb + (long long)(j0 + j) * d + t0 + t);
                    rs[j][t] = v;
                }
                __syncthreads();
#pragma unroll 4
                for (int j = 0; j < PB_TJ; ++j) {
                    A wr[PB_R], nw[PB_R], rc[PB_C];
#pragma unroll
                    for (int r = 0; r < PB_R; ++r) {
                        wr[r] = ws[j][ty + PB_TY * r];
                        nw[r] = -wr[r];
                    }
#pragma unroll
                    for (int c = 0; c < PB_C; ++c) rc[c] = rs[j][tx + PB_TX * c];
#pragma unroll
                    for (int r = 0; r < PB_R; ++r)
#pragma unroll
                        for (int c = 0; c < PB_C; ++c) {
                            if (KIND == 0)
                                acc[r][c] += lap_signed_weight(own[r][c], rc[c], wr[r], nw[r]);
                            else
                                acc[r][c] += wr[r] * (own[r][c] - rc[c]);
                        }
                }
                __syncthreads();
            }
#pragma unroll
            for (int r = 0; r < PB_R; ++r) {
                const int i = row0 + ty + PB_TY * r;
#pragma unroll
                for (int c = 0; c < PB_C; ++c) {
                    const int t = t0 + tx + PB_TX * c;
                    if (i < n_rows && t < d) {
                        const long long e = (long long)i * d + t;
                        if (pb == nullptr)
                            lap_store(out + out_off + e, acc[r][c] * scale);
                        else
                            pb[e] = acc[r][c] * scale;
                    }
                }
            }
        }
    }
}
