// Helpers of the fused attention (nystrom_attention.cu): element types, the kernel
// function's terms, and the Newton-Schulz iteration on padded shared-memory matrices.
//
// The kernels are compiled at run time by NVRTC (through CuPy) with no CUDA
// headers on the include path, so nothing here includes <cuda_fp16.h> or the
// standard library: fp16 and bf16 tensors are read as raw 16-bit patterns and
// converted with PTX (fp16) or bit arithmetic (bf16). Without __CUDA_ARCH__
// (the g++ CPU emulation used by the tests) the conversions fall back to
// host functions that the emulation shim provides.
#pragma once

// One untyped dynamic shared buffer: templates may not redeclare an extern
// __shared__ array with a different element type. (The CPU emulation shim
// defines this macro itself.)
#ifdef __CUDA_ARCH__
#define LAP_DYNAMIC_SHARED_BYTES(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// Raw storage of torch.float16 / torch.bfloat16 elements (2 bytes each).
struct lap_half { unsigned short bits; };
struct lap_bf16 { unsigned short bits; };

__device__ __forceinline__ float lap_load(const float* p) { return *p; }

__device__ __forceinline__ float lap_load(const lap_half* p) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p->bits));
    return f;
#else
    return lap_host_half_to_float(p->bits);
#endif
}

__device__ __forceinline__ float lap_load(const lap_bf16* p) {
    // bf16 is the upper half of an fp32 bit pattern.
#ifdef __CUDA_ARCH__
    return __int_as_float(((int)p->bits) << 16);
#else
    return lap_host_bits_to_float(((unsigned int)p->bits) << 16);
#endif
}

__device__ __forceinline__ void lap_store(float* p, float v) { *p = v; }

__device__ __forceinline__ void lap_store(lap_half* p, float v) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p->bits = h;
#else
    p->bits = lap_host_float_to_half(v);
#endif
}

__device__ __forceinline__ void lap_store(lap_bf16* p, float v) {
    // Round to nearest even on the upper 16 bits (PTX cvt.rn.bf16.f32 needs
    // sm_80; this works on every architecture). NaN stays a quiet NaN.
#ifdef __CUDA_ARCH__
    unsigned int u = (unsigned int)__float_as_int(v);
#else
    unsigned int u = lap_host_float_to_bits(v);
#endif
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        p->bits = 0x7fc0;
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    p->bits = (unsigned short)(u >> 16);
}

// expf rather than __expf: __expf's error grows with |argument| and would
// break the 1e-5 relative agreement with PyTorch at large distances; one exp
// per output is negligible next to the d-long distance loop.
__device__ __forceinline__ float lap_exp(float v) { return expf(v); }

// fabsf rather than `v < 0 ? -v : v`: the library call lets ptxas fold
// |.| into the consuming FADD as an operand modifier (2 instructions per
// Laplacian term instead of 4); the two differ only for -0 and NaN.
__device__ __forceinline__ float lap_abs(float v) { return fabsf(v); }

// w * sign(a - b) with sign(0) = 0 (the subgradient of |t| at t = 0), given
// nw = -w. a and b are compared directly instead of subtracting them: CuPy
// compiles with -ftz=true, which would flush a subnormal a - b to 0 and lose
// its sign. The fp32 comparisons are written in PTX without .ftz so that
// subnormal a or b keep their sign too (PyTorch's CPU sign does).
__device__ __forceinline__ float lap_signed_weight(float a, float b, float w, float nw) {
#ifdef __CUDA_ARCH__
    float s;
    asm("{\n\t.reg .pred gt, lt;\n\t.reg .f32 t;\n\t"
        "setp.gt.f32 gt, %1, %2;\n\tsetp.lt.f32 lt, %1, %2;\n\t"
        "selp.f32 t, %4, 0f00000000, lt;\n\tselp.f32 %0, %3, t, gt;\n\t}"
        : "=f"(s) : "f"(a), "f"(b), "f"(w), "f"(nw));
    return s;
#else
    return a > b ? w : (a < b ? nw : 0.0f);
#endif
}

// ---------------------------------------------------------------------------
// Newton-Schulz.
// ---------------------------------------------------------------------------

#define NS_MT 4   // micro-tile edge
// A k-split partial in the scratch: its 4 x 4 tile row-major at a stride of 20 floats, so
// the 16-byte accesses of 8 consecutive tiles (a quarter-warp's) fall in distinct banks:
// 4 vector stores and loads a partial where entry-major scalars took 16 with a pointer step
// each.
#define NS_PART_STRIDE 20

// 16 bytes of S: one vector load or store.
template <typename S> struct __align__(16) ns_vec { S v[16 / sizeof(S)]; };

template <typename S>
__device__ __forceinline__ ns_vec<S> ns_load_vec(const S* p) {
    return *reinterpret_cast<const ns_vec<S>*>(p);
}

// Row stride of the padded layout: NS_LD_NARROW for m <= 52 (Tiny to Huge: 49 landmarks),
// else NS_LD_WIDE; both 4 (mod 8), which keeps the rows a warp reads together in different
// banks (the host sizes the buffers with the same rule). ns_iterate takes it as a constant,
// so the products' loads take immediate offsets: 79 instructions a k-quad against 86.
#define NS_LD_NARROW 52
#define NS_LD_WIDE 68
__device__ __forceinline__ int ns_stride(int mp) {
    return mp <= NS_LD_NARROW ? NS_LD_NARROW : NS_LD_WIDE;
}

// f(r, c) for every entry of a rows x cols matrix, spread over the block's threads in
// row-major order: the position steps on without a division per entry.
template <typename F>
__device__ __forceinline__ void ns_for_each(int rows, int cols, int tid, int nthreads, F f) {
    const int dr = nthreads / cols, dc = nthreads % cols;
    for (int r = tid / cols, c = tid % cols; r < rows;) {
        f(r, c);
        r += dr;
        c += dc;
        if (c >= cols) {
            c -= cols;
            ++r;
        }
    }
}

// acc = a[rows 4 ti.., k_begin:k_end] @ b[k_begin:k_end, cols 4 tj..]; a and b are padded
// shared memory (stride ld), read 16 bytes at a time; k_begin and k_end are multiples of
// 16 bytes of S.
template <typename S>
__device__ __forceinline__ void ns_tile_product(const S* __restrict__ a, const S* __restrict__ b,
                                                int k_begin, int k_end, int ld, int ti, int tj,
                                                S acc[NS_MT][NS_MT]) {
    constexpr int KV = 16 / sizeof(S);
#pragma unroll
    for (int r = 0; r < NS_MT; ++r)
#pragma unroll
        for (int c = 0; c < NS_MT; ++c) acc[r][c] = S(0);
    const int r0 = ti * NS_MT, c0 = tj * NS_MT;
    for (int k0 = k_begin; k0 < k_end; k0 += KV) {
        S av[NS_MT][KV];
#pragma unroll
        for (int r = 0; r < NS_MT; ++r) {
            const ns_vec<S> v = ns_load_vec(a + (r0 + r) * ld + k0);
#pragma unroll
            for (int kk = 0; kk < KV; ++kk) av[r][kk] = v.v[kk];
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

// Rows of a 4 x 4 block at (row r0, column c0) of M, 16 bytes at a time.
template <typename S>
__device__ __forceinline__ void ns_store_block(S* M, int ld, int r0, int c0,
                                               const S v[NS_MT][NS_MT]) {
    constexpr int KV = 16 / sizeof(S);
#pragma unroll
    for (int r = 0; r < NS_MT; ++r)
#pragma unroll
        for (int c = 0; c < NS_MT; c += KV) {
            ns_vec<S> out;
#pragma unroll
            for (int q = 0; q < KV; ++q) out.v[q] = v[r][c + q];
            *reinterpret_cast<ns_vec<S>*>(M + (r0 + r) * ld + c0 + c) = out;
        }
}

// acc <- scale * X[tile (ti, tj)] + sign * acc: X + X R (1, 1) and 2 X - X T (2, -1). Both
// scalings are exact, so each entry is rounded once, as the sum written out.
template <typename S>
__device__ __forceinline__ void ns_combine_tile(const S* X, int ld, int ti, int tj, S scale,
                                                S sign, S acc[NS_MT][NS_MT]) {
#pragma unroll
    for (int r = 0; r < NS_MT; ++r)
#pragma unroll
        for (int c = 0; c < NS_MT; ++c)
            acc[r][c] = scale * X[(ti * NS_MT + r) * ld + tj * NS_MT + c] + sign * acc[r][c];
}

// Tile (ti, tj), ti <= tj, of a symmetric M and its mirror (tj, ti). A diagonal tile takes
// its upper half for both halves, so M stays exactly symmetric.
template <typename S>
__device__ __forceinline__ void ns_store_symmetric(S* M, int ld, int ti, int tj,
                                                   const S v[NS_MT][NS_MT]) {
    S w[NS_MT][NS_MT];
#pragma unroll
    for (int r = 0; r < NS_MT; ++r)
#pragma unroll
        for (int c = 0; c < NS_MT; ++c) w[r][c] = (ti < tj || r <= c) ? v[r][c] : v[c][r];
    ns_store_block(M, ld, ti * NS_MT, tj * NS_MT, w);
    if (ti < tj) {
#pragma unroll
        for (int r = 0; r < NS_MT; ++r)
#pragma unroll
            for (int c = 0; c < NS_MT; ++c) w[r][c] = v[c][r];
        ns_store_block(M, ld, tj * NS_MT, ti * NS_MT, w);
    }
}

// One thread's share of a product over the nt x nt tile grid: tile (ti, tj) over the k
// range of its split. `upper`: only the tiles ti <= tj (the product is symmetric), numbered
// row-major. `copies` products side by side (tiles numbered product after product; `copy`
// says whose). Splits fill the block with tiles x splits threads as far as the scratch holds
// the partials of splits > 0 (max_partials floats, NS_PART_STRIDE a partial; the host's
// backends.cuda.ns_partials has the same rule).
struct ns_job {
    bool active;
    int ti, tj, copy, tile, tiles, split, splits, k_begin, k_end;
};

__device__ __forceinline__ int ns_splits(int tiles, int nk, int nthreads, int max_partials) {
    const int fill = nthreads / tiles, room = 1 + max_partials / (NS_PART_STRIDE * tiles);
    const int s = fill < nk ? fill : nk;
    return s < 1 ? 1 : (s > room ? room : s);
}

__device__ __forceinline__ ns_job ns_make_job(int tid, int nthreads, int nt, int nk, int kv,
                                              bool upper, int copies, int max_partials) {
    ns_job j;
    const int per = upper ? nt * (nt + 1) / 2 : nt * nt;
    j.tiles = copies * per;
    j.splits = ns_splits(j.tiles, nk, nthreads, max_partials);
    j.active = tid < j.splits * j.tiles;
    j.tile = j.active ? tid % j.tiles : 0;
    j.split = j.active ? tid / j.tiles : 0;
    j.copy = j.tile / per;
    int u = j.tile % per;
    if (upper) {
        int i = 0;
        while (u >= nt - i) {
            u -= nt - i;
            ++i;
        }
        j.ti = i;
        j.tj = i + u;
    } else {
        j.ti = u / nt;
        j.tj = u % nt;
    }
    j.k_begin = j.split * nk / j.splits * kv;
    j.k_end = (j.split + 1) * nk / j.splits * kv;
    return j;
}

// acc = the job's partial of a @ b; splits > 0 leave it in the scratch.
template <typename S>
__device__ __forceinline__ void ns_job_product(const S* a, const S* b, int ld, const ns_job& j,
                                               S* scratch, S acc[NS_MT][NS_MT]) {
    if (!j.active) return;
    ns_tile_product<S>(a, b, j.k_begin, j.k_end, ld, j.ti, j.tj, acc);
    if (j.split == 0) return;
    ns_store_block<S>(scratch + ((j.split - 1) * j.tiles + j.tile) * NS_PART_STRIDE, NS_MT, 0,
                      0, acc);
}

// acc (split 0's partial) += the other splits' partials, in split order.
template <typename S>
__device__ __forceinline__ void ns_job_add_partials(const ns_job& j, const S* scratch,
                                                    S acc[NS_MT][NS_MT]) {
    constexpr int KV = 16 / sizeof(S);
    for (int s = 1; s < j.splits; ++s) {
        const S* part = scratch + ((s - 1) * j.tiles + j.tile) * NS_PART_STRIDE;
#pragma unroll
        for (int r = 0; r < NS_MT; ++r)
#pragma unroll
            for (int c = 0; c < NS_MT; c += KV) {
                const ns_vec<S> v = ns_load_vec(part + r * NS_MT + c);
#pragma unroll
                for (int q = 0; q < KV; ++q) acc[r][c + q] += v.v[q];
            }
    }
}

// Newton's form runs the last NS_NEWTON_STEPS steps (all of them from the authors' start).
#define NS_NEWTON_STEPS 1
// Threads per row of ||P||_inf's row sums, and rows per group of its maximum.
#define NS_NORM_PARTS 8

// X = the Newton-Schulz inverse of P after `iters` steps: X <- 2X - X (P X), from
// X0 = I / ||P||_inf ('identity') or 1.8 P / ||P||_inf^2 ('authors'), as
// lapformer_mm/ops/reference.py. From the identity start every X_t is a polynomial in P,
// so with R_t = I - P X_t the same step is X <- X + X R and R <- R R (R_{t+1} = R_t^2 in
// exact arithmetic): two symmetric products of upper tiles (2 x 76K multiply-adds at
// m = 49) that run side by side on two barriers, where Newton's form needs P X whole
// (140K) then X (P X) whole (140K) and the mean with its transpose, one after the other
// on five. That product form does not
// correct its own rounding (alone, an fp32 X 5-12x further from P^-1 at cond(P) 75-4901),
// so the last NS_NEWTON_STEPS steps are Newton's: one brings X back to Newton's accuracy
// (test_inverse_is_as_accurate_as_newtons_form in tests/ops/cuda; in an fp32 study over
// clustered, collinear, gridded and outlying landmarks 0.8-1.6x Newton's own error, two
// steps 0.7-2.0x: both at the rounding floor). From the authors' start
// R_0 = I - 1.8 P^2 / ||P||^2 squares the conditioning, so that start runs Newton's form
// throughout.
// Newton's products are computed whole, T = P X and then 2 X - X T, and X is the mean of
// that and its transpose (exactly symmetric): mirroring the upper triangle of either would
// replace a non-symmetric rounding part by the transpose's, an error the condition number
// amplifies, and the refinement step (x + X (b - P x)) then removes far less of the
// solve's error near the ridge's limit cond(P) = 100 m + 1 (test_refinement_step_holds_
// near_identical_landmarks). Each product's tiles take k-splits that fill the block, their
// partials added in split order.
// P, X and the scratch T (R in the product steps) are padded mp x LD shared memory (LD =
// ns_stride(mp)), P's padding zero (T's is written zero, which keeps the products' padding
// zero); `scratch` holds max_partials floats for the partials (backends.cuda.ns_partials).
// Every thread of the block calls this.
template <typename S, int LD>
__device__ __forceinline__ void ns_iterate(const S* Ps, S* X, S* T, S* scratch, int m,
                                           int iters, int init_authors, int max_partials) {
    static_assert(LD == NS_LD_NARROW || LD == NS_LD_WIDE, "ns_stride's strides");
    constexpr int KV = 16 / sizeof(S), ld = LD;
    __shared__ S norm_shared;
    const int mp = (m + NS_MT - 1) / NS_MT * NS_MT;
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int nthreads = blockDim.x * blockDim.y * blockDim.z;
    const int nt = mp / NS_MT, nk = mp / KV;
    const int product_steps =
        init_authors || iters < NS_NEWTON_STEPS ? 0 : iters - NS_NEWTON_STEPS;
    const ns_job full = ns_make_job(tid, nthreads, nt, nk, KV, false, 1, max_partials);
    const ns_job upper = ns_make_job(tid, nthreads, nt, nk, KV, true, 1, max_partials);
    const ns_job pair = ns_make_job(tid, nthreads, nt, nk, KV, true, 2, max_partials);
    // ||P||_inf: row sums in NS_NORM_PARTS partials each, then the rows' sums in T's column
    // 0, each group of NS_NORM_PARTS rows' maximum in its first, and their maximum.
    for (int e = tid; e < m * NS_NORM_PARTS; e += nthreads) {
        const int r = e / NS_NORM_PARTS, part = e % NS_NORM_PARTS;
        S s = S(0);
        for (int c = part; c < m; c += NS_NORM_PARTS) s += lap_abs(Ps[r * ld + c]);
        T[r * ld + part] = s;
    }
    __syncthreads();
    for (int r = tid; r < m; r += nthreads) {
        S s = S(0);
#pragma unroll
        for (int part = 0; part < NS_NORM_PARTS; ++part) s += T[r * ld + part];
        T[r * ld] = s;
    }
    __syncthreads();
    for (int g = tid; g * NS_NORM_PARTS < m; g += nthreads) {
        const int first = g * NS_NORM_PARTS;
        S mx = T[first * ld];
        for (int r = first + 1; r < m && r < first + NS_NORM_PARTS; ++r)
            mx = T[r * ld] > mx ? T[r * ld] : mx;
        T[first * ld + 1] = mx;
    }
    __syncthreads();
    if (tid == 0) {
        S mx = T[1];
        for (int r = NS_NORM_PARTS; r < m; r += NS_NORM_PARTS)
            mx = T[r * ld + 1] > mx ? T[r * ld + 1] : mx;
        norm_shared = mx;
    }
    __syncthreads();
    const S norm = norm_shared;
    const S start_scale = init_authors ? S(1.8) / (norm * norm) : S(1) / norm;
    // X0, and in T R_0 = I - P X0 (the identity start) or zeros (T's padding stays zero).
    ns_for_each(mp, ld, tid, nthreads, [&](int r, int c) {
        S v = S(0), rv = S(0);
        if (r < m && c < m) {
            const S p = Ps[r * ld + c];
            v = init_authors ? p * start_scale : (r == c ? start_scale : S(0));
            rv = product_steps > 0 ? (r == c ? S(1) : S(0)) - p * start_scale : S(0);
        }
        X[r * ld + c] = v;
        T[r * ld + c] = rv;
    });
    __syncthreads();

    for (int it = 0; it < iters; ++it) {
        S acc[NS_MT][NS_MT];
        if (it < product_steps) {
            // X <- X + X R, and R <- R R while product steps follow. A reference: a copy of
            // the chosen job spills at the 128 registers the block allows (ptxas), and each
            // product's own call site lengthens its k-quad loop.
            const ns_job& j = it + 1 < product_steps ? pair : upper;
            const bool square = j.copy == 1;
            ns_job_product<S>(square ? T : X, T, ld, j, scratch, acc);
            // Every thread must finish reading X and R before any thread overwrites them.
            __syncthreads();
            if (j.active && j.split == 0) {
                ns_job_add_partials<S>(j, scratch, acc);
                if (!square) ns_combine_tile<S>(X, ld, j.ti, j.tj, S(1), S(1), acc);
                ns_store_symmetric<S>(square ? T : X, ld, j.ti, j.tj, acc);
            }
            __syncthreads();
            continue;
        }
        // T = P X.
        ns_job_product<S>(Ps, X, ld, full, scratch, acc);
        __syncthreads();
        if (full.active && full.split == 0) {
            ns_job_add_partials<S>(full, scratch, acc);
            ns_store_block<S>(T, ld, full.ti * NS_MT, full.tj * NS_MT, acc);
        }
        __syncthreads();
        // T <- 2 X - X T, every tile.
        ns_job_product<S>(X, T, ld, full, scratch, acc);
        // Every thread must finish reading T before any thread overwrites it.
        __syncthreads();
        if (full.active && full.split == 0) {
            ns_job_add_partials<S>(full, scratch, acc);
            ns_combine_tile<S>(X, ld, full.ti, full.tj, S(2), S(-1), acc);
            ns_store_block<S>(T, ld, full.ti * NS_MT, full.tj * NS_MT, acc);
        }
        __syncthreads();
        // X <- (T + T^T) / 2 (T's padding is zero, so X's stays zero).
        ns_for_each(mp, mp, tid, nthreads, [&](int r, int c) {
            X[r * ld + c] = S(0.5) * (T[r * ld + c] + T[c * ld + r]);
        });
        __syncthreads();
    }
}
