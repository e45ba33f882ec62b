// Fused CPU kernels of the attention: the kernel matrix exp(-dist(x_i, y_j) / lam) and its
// gradients (Laplacian: l1 distance, Gaussian: squared l2), never forming an (N, M, d) tensor.
//
// Included by one source per instruction set (cpu_default.cpp, cpu_avx2.cpp, cpu_avx512.cpp),
// each compiled into its own extension module with its own flags and registering its ops in
// its own namespace (lapformer_mm_cpu_<capability>); lapformer_mm/ops/backends/cpu.py loads the one
// torch.backends.cpu.get_cpu_capability() names. Separate modules, not one: inline functions of
// the headers compiled with AVX-512 flags must not be picked by the linker for the code paths
// that run on machines without it.
//
// Vectorisation is at::vec's for the capability; the default build is its generic (scalar)
// implementation. Inputs of any strides and of fp32, fp64, fp16, bf16 (16-bit: converted as
// read, fp32 accumulation); results in fp32 (fp64 for fp64 inputs).
//
// Determinism: rows are cut into chunks of kChunkRows, a partition fixed by the problem size
// alone; every sum over rows is a per-chunk partial, the partials are added in chunk order.
// The thread count changes only which thread computes a chunk, so results are bit-equal for
// any number of threads.
#pragma once

#ifndef CPU_CAPABILITY
#error "define CPU_CAPABILITY (DEFAULT, AVX2 or AVX512) before including cpu_kernels.h"
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

namespace lapf {
inline namespace CPU_CAPABILITY {

using at::vec::Vectorized;
using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

// Rows per chunk of every parallel loop over rows: large enough that a chunk's partial sums
// are few, small enough that 2 threads get work at N = 1024.
constexpr int64_t kChunkRows = 256;
// Rows, evenly spaced, whose centred mean is the shift of the whitening statistics: close to
// every column's mean, so the one-pass sums around it do not cancel, unless most rows are
// far from those sampled (one atypical row moves it by 1/64 of its distance).
constexpr int64_t kShiftRows = 64;
// Column vectors per register tile of the kernel matrix (4 x 16 fp32 lanes on AVX-512).
constexpr int kMaxTileVecs = 4;
enum Kind : int64_t { kLaplacian = 0, kGaussian = 1 };

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows of a register block: the accumulators of R rows and a tile of columns must fit the
// register file (32 vector registers with AVX-512, 16 below it).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kBlockRows = 4;
#else
constexpr int kBlockRows = 2;
#endif

// A (B, H, n, d) operand: base pointer and element strides.
template <typename T>
struct Operand {
  const T* data;
  int64_t sb, sh, sn, sc;
  const T* row(int64_t b, int64_t h, int64_t i) const { return data + b * sb + h * sh + i * sn; }
};

template <typename T>
Operand<T> operand(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// Checks of the operators' arguments.
inline void check_operand(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), name, " must be a tensor");
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D (B, H, n, d), got shape ", t.sizes());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kFloat8_e4m3fn,
              name, " must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
}

inline void check_like(const char* name, const at::Tensor& t, const at::Tensor& x,
                       int64_t rows) {
  check_operand(name, t);
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), name, " must have x's dtype ",
              x.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.size(0) == x.size(0) && t.size(1) == x.size(1) && t.size(2) == rows, name,
              " must be (", x.size(0), ", ", x.size(1), ", ", rows, ", *), got ", t.sizes());
}

inline at::ScalarType acc_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// A small float tensor (B, H, rows, cols) of the compute dtype.
inline void check_small(const char* name, const at::Tensor& t, const at::Tensor& x, int64_t rows,
                        int64_t cols) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.dim() == 4, name,
              " must be a 4-D CPU tensor");
  TORCH_CHECK(t.scalar_type() == acc_type(x.scalar_type()), name, " must be ",
              acc_type(x.scalar_type()), ", got ", t.scalar_type());
  TORCH_CHECK(t.size(0) == x.size(0) && t.size(1) == x.size(1) && t.size(2) == rows &&
                  (cols < 0 || t.size(3) == cols),
              name, " must be (", x.size(0), ", ", x.size(1), ", ", rows, ", ",
              cols < 0 ? std::string("*") : std::to_string(cols), "), got ", t.sizes());
}

inline void check_pair(const at::Tensor& x, const at::Tensor& y, double lam, int64_t kind) {
  check_operand("x", x);
  check_operand("y", y);
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype, got ",
              x.scalar_type(), " and ", y.scalar_type());
  TORCH_CHECK(x.size(0) == y.size(0) && x.size(1) == y.size(1) && x.size(3) == y.size(3),
              "x (B, H, N, d) and y (B, H, M, d) must agree in B, H and d, got ", x.sizes(),
              " and ", y.sizes());
  TORCH_CHECK(lam > 0, "lam must be > 0, got ", lam);
  TORCH_CHECK(kind == kLaplacian || kind == kGaussian,
              "kind must be 0 (laplacian) or 1 (gaussian), got ", kind);
}

inline bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

#define LAPF_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

// ---------------------------------------------------------------------------------------------
// Forward: rows of exp(-dist / lam), vectorised over the columns j.
// ---------------------------------------------------------------------------------------------

// y (M, d) transposed into tiles: tile t holds columns [t*TW, (t+1)*TW) as d rows of TW lanes,
// zero beyond M.
template <typename scalar_t, typename acc_t>
void pack_columns(const scalar_t* y, int64_t sm, int64_t sc, int64_t M, int64_t d, int64_t TW,
                  acc_t* out) {
  const int64_t tiles = ceil_div(M, TW);
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t c = 0; c < d; ++c) {
      acc_t* dst = out + (t * d + c) * TW;
      for (int64_t l = 0; l < TW; ++l) {
        const int64_t j = t * TW + l;
        dst[l] = j < M ? static_cast<acc_t>(y[j * sm + c * sc]) : acc_t(0);
      }
    }
  }
}

// Register-block dispatch: f(std::integral_constant<int, R>, i) for row blocks of a chunk.
template <typename F>
inline void for_each_block(int64_t rows, F&& f) {
  int64_t i = 0;
  for (; i + kBlockRows <= rows; i += kBlockRows) f(std::integral_constant<int, kBlockRows>(), i);
  for (; i < rows; ++i) f(std::integral_constant<int, 1>(), i);
}

// R rows of x against one tile of JV column vectors: out[r][0:ncols] = exp(-dist / lam).
template <int KIND, int R, int JV, typename scalar_t, typename acc_t>
inline void kernel_tile(const scalar_t* x, int64_t sxn, int64_t sxc, int64_t d, const acc_t* yt,
                        int64_t TW, acc_t neg_inv_lam, acc_t* out, int64_t ldo, int64_t ncols) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t VL = Vec::size();
  Vec acc[R][JV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < JV; ++v) acc[r][v] = Vec(acc_t(0));
  for (int64_t c = 0; c < d; ++c) {
    Vec xb[R];
    for (int r = 0; r < R; ++r) xb[r] = Vec(static_cast<acc_t>(x[r * sxn + c * sxc]));
    const acc_t* yc = yt + c * TW;
    for (int v = 0; v < JV; ++v) {
      const Vec yv = Vec::loadu(yc + v * VL);
      for (int r = 0; r < R; ++r) {
        const Vec t = xb[r] - yv;
        if constexpr (KIND == kLaplacian) {
          acc[r][v] = acc[r][v] + t.abs();
        } else {
          acc[r][v] = at::vec::fmadd(t, t, acc[r][v]);
        }
      }
    }
  }
  const Vec scale(neg_inv_lam);
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < JV; ++v) {
      const Vec k = (acc[r][v] * scale).exp();
      const int64_t col = v * VL;
      if (col + VL <= ncols) {
        k.store(out + r * ldo + col);
      } else if (col < ncols) {
        k.store(out + r * ldo + col, ncols - col);
      }
    }
  }
}

// Rows [0, rows) of x against all tiles of the packed columns: out rows of M values each
// (row stride ldo). Kind, rows per register block and vectors per tile become template
// arguments here, so kernel_tile keeps its accumulators in registers.
template <typename scalar_t, typename acc_t>
void kernel_rows(int64_t kind, const scalar_t* x, int64_t sxn, int64_t sxc, int64_t rows,
                 int64_t d, const acc_t* packed, int64_t M, acc_t neg_inv_lam, acc_t* out,
                 int64_t ldo) {
  constexpr int64_t VL = Vectorized<acc_t>::size();
  constexpr int64_t TW = kMaxTileVecs * VL;
  for (int64_t t = 0; t * TW < M; ++t) {
    const int64_t ncols = std::min(TW, M - t * TW);
    const acc_t* yt = packed + t * d * TW;
    auto tiles = [&](auto kind_c, auto jv_c) {
      for_each_block(rows, [&](auto rows_c, int64_t i) {
        kernel_tile<decltype(kind_c)::value, decltype(rows_c)::value, decltype(jv_c)::value>(
            x + i * sxn, sxn, sxc, d, yt, TW, neg_inv_lam, out + i * ldo + t * TW, ldo, ncols);
      });
    };
    auto by_width = [&](auto kind_c) {
      switch (ceil_div(ncols, VL)) {
        case 1:
          return tiles(kind_c, std::integral_constant<int, 1>());
        case 2:
          return tiles(kind_c, std::integral_constant<int, 2>());
        case 3:
          return tiles(kind_c, std::integral_constant<int, 3>());
        default:
          return tiles(kind_c, std::integral_constant<int, 4>());
      }
    };
    if (kind == kLaplacian) {
      by_width(std::integral_constant<int, kLaplacian>());
    } else {
      by_width(std::integral_constant<int, kGaussian>());
    }
  }
}

template <typename acc_t>
inline int64_t tile_width() {
  return kMaxTileVecs * Vectorized<acc_t>::size();
}

template <typename acc_t>
inline int64_t packed_size(int64_t M, int64_t d) {
  return ceil_div(M, tile_width<acc_t>()) * d * tile_width<acc_t>();
}

// K (B, H, N, M) contiguous, acc_t, for x (B, H, N, d) and y (B, H, M, d).
inline at::Tensor pairwise_forward(const at::Tensor& x, const at::Tensor& y, double lam,
                                  int64_t kind) {
  check_pair(x, y, lam, kind);
  return LAPF_DISPATCH_FLOATING(x.scalar_type(), "pairwise_forward", [&]() -> at::Tensor {
    using acc_t = typename AccOf<scalar_t>::type;
    const int64_t B = x.size(0), H = x.size(1), N = x.size(2), d = x.size(3), M = y.size(2);
    at::Tensor out =
        at::empty({B, H, N, M}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    if (out.numel() == 0) return out;
    const auto xo = operand<scalar_t>(x);
    const auto yo = operand<scalar_t>(y);
    const int64_t psize = packed_size<acc_t>(M, d);
    // Packing M x d values per (b, h) is too little work for a parallel region.
    std::vector<acc_t> packed(static_cast<size_t>(B * H * psize));
    for (int64_t bh = 0; bh < B * H; ++bh)
      pack_columns(yo.row(bh / H, bh % H, 0), yo.sn, yo.sc, M, d, tile_width<acc_t>(),
                   packed.data() + bh * psize);
    const int64_t chunks = ceil_div(N, kChunkRows);
    const acc_t neg_inv_lam = static_cast<acc_t>(-1.0 / lam);
    acc_t* po = out.data_ptr<acc_t>();
    at::parallel_for(0, B * H * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t bh = w / chunks, i0 = (w % chunks) * kChunkRows;
        const int64_t rows = std::min(kChunkRows, N - i0);
        const scalar_t* xr = xo.row(bh / H, bh % H, i0);
        acc_t* o = po + (bh * N + i0) * M;
        const acc_t* p = packed.data() + bh * psize;
        kernel_rows(kind, xr, xo.sn, xo.sc, rows, d, p, M, neg_inv_lam, o, M);
      }
    });
    return out;
  });
}

// ---------------------------------------------------------------------------------------------
// Backward: dx_i = -s sum_j w_ij phi(x_i - y_j), dy_j = +s sum_i w_ij phi(x_i - y_j) with
// w = grad * K, phi = sign (Laplacian, s = 1/lam; sign(0) = 0) or the identity (Gaussian,
// s = 2/lam). Vectorised over the channels c; y rows padded to dp channels with zeros, so the
// padding lanes contribute phi(0) = 0.
// ---------------------------------------------------------------------------------------------

// ax += phi(t) w and sum += phi(t) w.
template <int KIND, typename acc_t>
inline void add_phi(const Vectorized<acc_t>& t, const Vectorized<acc_t>& w,
                    Vectorized<acc_t>& ax, Vectorized<acc_t>& sum) {
  using Vec = Vectorized<acc_t>;
  if constexpr (KIND == kLaplacian) {
    // w with the sign of t flipped in; lanes with t == 0 (also -0) add nothing.
#if defined(CPU_CAPABILITY_AVX512)
    const Vec signed_w = w ^ (t & Vec(acc_t(-0.0)));
    // Masked adds: one instruction less per lane group than and-ing with a compare mask.
    if constexpr (std::is_same_v<acc_t, float>) {
      const __mmask16 nz = _mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_NEQ_UQ);
      ax = _mm512_mask_add_ps(ax, nz, ax, signed_w);
      sum = _mm512_mask_add_ps(sum, nz, sum, signed_w);
    } else {
      const __mmask8 nz = _mm512_cmp_pd_mask(t, _mm512_setzero_pd(), _CMP_NEQ_UQ);
      ax = _mm512_mask_add_pd(ax, nz, ax, signed_w);
      sum = _mm512_mask_add_pd(sum, nz, sum, signed_w);
    }
#elif defined(CPU_CAPABILITY_AVX2) || defined(__aarch64__)
    const Vec s = (w ^ (t & Vec(acc_t(-0.0)))) & (t != Vec(acc_t(0)));
    ax = ax + s;
    sum = sum + s;
#else
    // The portable build: at::vec's generic compare and bitwise ops go through memory lane
    // by lane; a plain select per lane is what the compiler vectorises.
    for (int64_t l = 0; l < Vec::size(); ++l) {
      const acc_t s = t[l] > 0 ? w[l] : (t[l] < 0 ? -w[l] : acc_t(0));
      ax[l] += s;
      sum[l] += s;
    }
#endif
  } else {
    ax = at::vec::fmadd(t, w, ax);
    sum = at::vec::fmadd(t, w, sum);
  }
}

// R rows: xr (R x dp, staged), w (R x M weights, row stride ldw) against yp (M x dp).
// dx (R x dp) accumulates; dy (M x dp) accumulates when NEED_Y.
template <int KIND, int R, bool NEED_Y, typename acc_t>
inline void grad_rows(const acc_t* xr, const acc_t* w, int64_t ldw, const acc_t* yp, int64_t M,
                      int64_t dp, acc_t* dx, acc_t* dy) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t VL = Vec::size();
  for (int64_t cv = 0; cv < dp; cv += VL) {
    Vec xv[R], ax[R];
    for (int r = 0; r < R; ++r) {
      xv[r] = Vec::loadu(xr + r * dp + cv);
      ax[r] = Vec::loadu(dx + r * dp + cv);
    }
    for (int64_t j = 0; j < M; ++j) {
      const Vec yv = Vec::loadu(yp + j * dp + cv);
      // Two partial sums over the rows halve the dependent chain into dy.
      Vec sum[2] = {Vec(acc_t(0)), Vec(acc_t(0))};
      for (int r = 0; r < R; ++r)
        add_phi<KIND>(xv[r] - yv, Vec(w[r * ldw + j]), ax[r], sum[r & 1]);
      if constexpr (NEED_Y)
        (Vec::loadu(dy + j * dp + cv) + (sum[0] + sum[1])).store(dy + j * dp + cv);
    }
    for (int r = 0; r < R; ++r) ax[r].store(dx + r * dp + cv);
  }
}

template <typename scalar_t, typename acc_t>
inline void stage_row(const scalar_t* src, int64_t sc, int64_t d, int64_t dp, acc_t* dst) {
  for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<acc_t>(src[c * sc]);
  for (int64_t c = d; c < dp; ++c) dst[c] = acc_t(0);
}

template <typename T>
inline int64_t padded_width(int64_t d) {
  constexpr int64_t VL = Vectorized<T>::size();
  return ceil_div(d, VL) * VL;
}

// The gradient of one chunk of rows [i0, i0 + rows) of one (b, h). wrow(i, buf) fills buf
// with the M weights of row i. dx rows go to dx_out (row stride ldx, d values each, scaled by
// -scale); dy_part (M x dp) receives the chunk's unscaled partial sum.
template <int KIND, typename acc_t, typename scalar_t, typename WeightFn>
void grad_chunk(const scalar_t* x, int64_t sxn, int64_t sxc, int64_t rows, int64_t d,
                const acc_t* yp, int64_t M, WeightFn&& wrow, acc_t scale, bool need_x,
                acc_t* dx_out, int64_t ldx, bool need_y, acc_t* dy_part) {
  const int64_t dp = padded_width<acc_t>(d);
  constexpr int R = kBlockRows;
  std::vector<acc_t> xbuf(R * dp), wbuf(R * M), dxbuf(R * dp);
  int64_t i = 0;
  auto finish = [&](int n) {
    if (!need_x) return;
    for (int r = 0; r < n; ++r)
      for (int64_t c = 0; c < d; ++c) dx_out[(i + r) * ldx + c] = -scale * dxbuf[r * dp + c];
  };
  auto block = [&](auto rows_const) {
    constexpr int n = decltype(rows_const)::value;
    for (int r = 0; r < n; ++r) {
      stage_row(x + (i + r) * sxn, sxc, d, dp, xbuf.data() + r * dp);
      wrow(i + r, wbuf.data() + r * M);
    }
    std::fill(dxbuf.begin(), dxbuf.end(), acc_t(0));
    if (need_y) {
      grad_rows<KIND, n, true>(xbuf.data(), wbuf.data(), M, yp, M, dp, dxbuf.data(), dy_part);
    } else {
      grad_rows<KIND, n, false>(xbuf.data(), wbuf.data(), M, yp, M, dp, dxbuf.data(), dy_part);
    }
    finish(n);
  };
  for (; i + R <= rows; i += R) block(std::integral_constant<int, R>());
  for (; i < rows; ++i) block(std::integral_constant<int, 1>());
}

// Sums the chunk partials parts[(bh * chunks + c) * count + e] over c in chunk order (a fixed
// order whatever the threads) and hands store(bh, e, sum) each. One parallel region for all
// (b, h); a small reduction runs inline (each region costs a wake-up of the pool).
template <typename acc_t, typename Store>
void reduce_partials(const acc_t* parts, int64_t BH, int64_t chunks, int64_t count,
                     Store&& store) {
  at::parallel_for(0, BH * count, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t bh = k / count, e = k % count;
      const acc_t* p = parts + bh * chunks * count + e;
      acc_t s = p[0];
      for (int64_t c = 1; c < chunks; ++c) s += p[c * count];
      store(bh, e, s);
    }
  });
}

// (dx, dy) for grad and K (B, H, N, M) of any strides; x (B, H, N, d), y (B, H, M, d).
// Rows of the longer operand are the parallel dimension.
// grad and kmat are of type w_t: x's dtype or the compute dtype.
template <typename scalar_t, typename w_t>
std::tuple<at::Tensor, at::Tensor> pairwise_backward_typed(const at::Tensor& grad,
                                                           const at::Tensor& kmat,
                                                           const at::Tensor& x,
                                                           const at::Tensor& y, double lam,
                                                           int64_t kind, bool need_x,
                                                           bool need_y) {
  using acc_t = typename AccOf<scalar_t>::type;
  if (y.size(2) > x.size(2)) {
    auto [dy, dx] = pairwise_backward_typed<scalar_t, w_t>(
        grad.transpose(2, 3), kmat.transpose(2, 3), y, x, lam, kind, need_y, need_x);
    return {dx, dy};
  }
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), d = x.size(3), M = y.size(2);
  const auto acc_opts = x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  at::Tensor dx = need_x ? at::empty({B, H, N, d}, acc_opts) : at::empty({0}, acc_opts);
  at::Tensor dy = need_y ? at::empty({B, H, M, d}, acc_opts) : at::empty({0}, acc_opts);
  if ((!need_x && !need_y) || B * H == 0) return {dx, dy};
  if (N == 0 || M == 0 || d == 0) {
    if (need_x) dx.zero_();
    if (need_y) dy.zero_();
    return {dx, dy};
  }
  const int64_t dp = padded_width<acc_t>(d);
  const auto xo = operand<scalar_t>(x);
  const auto yo = operand<scalar_t>(y);
  const auto go = operand<w_t>(grad);
  const auto ko = operand<w_t>(kmat);
  std::vector<acc_t> ypack(static_cast<size_t>(B * H * M * dp));
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t j = 0; j < M; ++j)
      stage_row(yo.row(bh / H, bh % H, j), yo.sc, d, dp, ypack.data() + (bh * M + j) * dp);
  const int64_t chunks = ceil_div(N, kChunkRows);
  const int64_t part_size = M * dp;
  std::vector<acc_t> parts(need_y ? static_cast<size_t>(B * H * chunks * part_size) : 0);
  const acc_t scale = static_cast<acc_t>((kind == kLaplacian ? 1.0 : 2.0) / lam);
  acc_t* pdx = need_x ? dx.data_ptr<acc_t>() : nullptr;
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t bh = w / chunks, chunk = w % chunks, b = bh / H, h = bh % H;
      const int64_t i0 = chunk * kChunkRows, rows = std::min(kChunkRows, N - i0);
      const w_t* g = go.row(b, h, i0);
      const w_t* k = ko.row(b, h, i0);
      auto wrow = [&](int64_t i, acc_t* buf) {
        for (int64_t j = 0; j < M; ++j)
          buf[j] = static_cast<acc_t>(g[i * go.sn + j * go.sc]) *
                   static_cast<acc_t>(k[i * ko.sn + j * ko.sc]);
      };
      acc_t* part = need_y ? parts.data() + (bh * chunks + chunk) * part_size : nullptr;
      if (part) std::fill(part, part + part_size, acc_t(0));
      acc_t* dxo = pdx ? pdx + (bh * N + i0) * d : nullptr;
      const acc_t* yp = ypack.data() + bh * M * dp;
      if (kind == kLaplacian) {
        grad_chunk<kLaplacian>(xo.row(b, h, i0), xo.sn, xo.sc, rows, d, yp, M, wrow, scale,
                               need_x, dxo, d, need_y, part);
      } else {
        grad_chunk<kGaussian>(xo.row(b, h, i0), xo.sn, xo.sc, rows, d, yp, M, wrow, scale,
                              need_x, dxo, d, need_y, part);
      }
    }
  });
  if (need_y) {
    acc_t* pdy = dy.data_ptr<acc_t>();
    reduce_partials(parts.data(), B * H, chunks, part_size, [&](int64_t bh, int64_t e, acc_t s) {
      const int64_t j = e / dp, c = e % dp;
      if (c < d) pdy[(bh * M + j) * d + c] = scale * s;
    });
  }
  return {dx, dy};
}

// ---------------------------------------------------------------------------------------------
// The attention's passes over the rows of q (or k): per (b, h), C = K(x, L) (N x m) row by row,
// each row consumed while it is in cache. Small row-times-matrix products are vectorised over
// their output width; every sum over rows is a chunk partial (see the top of the file).
// ---------------------------------------------------------------------------------------------

// acc (M x np) += sum_r a[r][j] * b[r][:] (a: R rows of row stride lda, b: R x np). Eight
// rows of acc at a time: eight independent FMA chains, not one chain of R.
template <int R, int J, typename acc_t>
inline void accumulate_outer_rows(const acc_t* a, int64_t lda, const Vectorized<acc_t>* bv,
                                  int64_t j0, int64_t np, int64_t v0, acc_t* acc) {
  using Vec = Vectorized<acc_t>;
  Vec s[J];
  for (int q = 0; q < J; ++q) s[q] = Vec::loadu(acc + (j0 + q) * np + v0);
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < J; ++q) s[q] = at::vec::fmadd(Vec(a[r * lda + j0 + q]), bv[r], s[q]);
  for (int q = 0; q < J; ++q) s[q].store(acc + (j0 + q) * np + v0);
}

template <int R, typename acc_t>
inline void accumulate_outer(const acc_t* a, int64_t lda, const acc_t* b, int64_t M, int64_t np,
                             acc_t* acc) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t VL = Vec::size();
  for (int64_t v0 = 0; v0 < np; v0 += VL) {
    Vec bv[R];
    for (int r = 0; r < R; ++r) bv[r] = Vec::loadu(b + r * np + v0);
    int64_t j = 0;
    for (; j + 8 <= M; j += 8) accumulate_outer_rows<R, 8>(a, lda, bv, j, np, v0, acc);
    for (; j < M; ++j) accumulate_outer_rows<R, 1>(a, lda, bv, j, np, v0, acc);
  }
}

// out[r][v0 : v0 + JV vectors] = bias + sum_k a[r][k] * B[k][...]: R x JV independent
// accumulators.
template <int R, int JV, typename acc_t>
inline void rows_times_tile(const acc_t* a, int64_t lda, int64_t K, const acc_t* B, int64_t np,
                            const acc_t* bias, acc_t* out, int64_t v0) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t VL = Vec::size();
  Vec acc[R][JV];
  for (int v = 0; v < JV; ++v) {
    const Vec b0 = bias ? Vec::loadu(bias + v0 + v * VL) : Vec(acc_t(0));
    for (int r = 0; r < R; ++r) acc[r][v] = b0;
  }
  for (int64_t k = 0; k < K; ++k) {
    Vec bv[JV];
    for (int v = 0; v < JV; ++v) bv[v] = Vec::loadu(B + k * np + v0 + v * VL);
    for (int r = 0; r < R; ++r) {
      const Vec ar(a[r * lda + k]);
      for (int v = 0; v < JV; ++v) acc[r][v] = at::vec::fmadd(ar, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < JV; ++v) acc[r][v].store(out + r * np + v0 + v * VL);
}

// out[r][:] = bias + sum_k a[r][k] * B[k][:] (a: R rows of row stride lda, B: K x np).
template <int R, typename acc_t>
inline void rows_times(const acc_t* a, int64_t lda, int64_t K, const acc_t* B, int64_t np,
                       const std::type_identity_t<acc_t>* bias, acc_t* out) {
  constexpr int64_t VL = Vectorized<acc_t>::size();
  for (int64_t v0 = 0; v0 < np; v0 += kMaxTileVecs * VL) {
    switch (std::min<int64_t>(kMaxTileVecs, (np - v0) / VL)) {
      case 1:
        rows_times_tile<R, 1>(a, lda, K, B, np, bias, out, v0);
        break;
      case 2:
        rows_times_tile<R, 2>(a, lda, K, B, np, bias, out, v0);
        break;
      case 3:
        rows_times_tile<R, 3>(a, lda, K, B, np, bias, out, v0);
        break;
      default:
        rows_times_tile<R, 4>(a, lda, K, B, np, bias, out, v0);
    }
  }
}

template <typename acc_t>
inline acc_t lane_sum(const acc_t* row, int64_t np) {
  using Vec = Vectorized<acc_t>;
  Vec s(acc_t(0));
  for (int64_t v0 = 0; v0 < np; v0 += Vec::size()) s = s + Vec::loadu(row + v0);
  return at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return a + b; }, s);
}

// A (m, n) matrix of a (b, h) copied into rows of np lanes (zero-padded), or its transpose.
template <typename acc_t>
std::vector<acc_t> pack_matrix(const at::Tensor& t, int64_t bh, bool transpose, int64_t np) {
  const auto a = t.accessor<acc_t, 4>();
  const int64_t H = t.size(1), b = bh / H, h = bh % H;
  const int64_t rows = transpose ? t.size(3) : t.size(2), cols = transpose ? t.size(2) : t.size(3);
  std::vector<acc_t> out(static_cast<size_t>(rows * np), acc_t(0));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * np + c] = transpose ? a[b][h][c][r] : a[b][h][r][c];
  return out;
}

template <typename acc_t>
std::vector<acc_t> pack_vector(const at::Tensor& t, int64_t bh, int64_t row, int64_t np) {
  // t (B, H, k, n): row `row` of (b, h), zero-padded to np.
  const auto a = t.accessor<acc_t, 4>();
  const int64_t H = t.size(1);
  std::vector<acc_t> out(static_cast<size_t>(np), acc_t(0));
  for (int64_t c = 0; c < t.size(3); ++c) out[c] = a[bh / H][bh % H][row][c];
  return out;
}

// Geometry of one pass: x (B, H, N, d), landmarks (B, H, m, d).
template <typename acc_t>
struct PassShape {
  int64_t B, H, N, d, M, Mp, chunks;
  PassShape(const at::Tensor& x, const at::Tensor& l)
      : B(x.size(0)), H(x.size(1)), N(x.size(2)), d(x.size(3)), M(l.size(2)),
        Mp(ceil_div(l.size(2), tile_width<acc_t>()) * tile_width<acc_t>()),
        chunks(ceil_div(x.size(2), kChunkRows)) {}
  int64_t items() const { return B * H * chunks; }
};

template <typename scalar_t, typename acc_t>
std::vector<acc_t> pack_landmark_columns(const Operand<scalar_t>& lo, const PassShape<acc_t>& s) {
  const int64_t psize = packed_size<acc_t>(s.M, s.d);
  std::vector<acc_t> packed(static_cast<size_t>(s.B * s.H * psize));
  for (int64_t bh = 0; bh < s.B * s.H; ++bh)
    pack_columns(lo.row(bh / s.H, bh % s.H, 0), lo.sn, lo.sc, s.M, s.d, tile_width<acc_t>(),
                 packed.data() + bh * psize);
  return packed;
}

// Runs body(bh, b, h, i0, rows, chunk) over every (b, h, chunk) in parallel.
template <typename acc_t, typename Body>
void for_each_chunk(const PassShape<acc_t>& s, Body&& body) {
  at::parallel_for(0, s.items(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t bh = w / s.chunks, chunk = w % s.chunks;
      const int64_t i0 = chunk * kChunkRows;
      body(bh, bh / s.H, bh % s.H, i0, std::min(kChunkRows, s.N - i0), chunk);
    }
  });
}


// Sums parts (per (b, h): chunks x rows x np) in chunk order into out (B, H, rows, cols).
template <typename acc_t>
void reduce_into(const std::vector<acc_t>& parts, int64_t BH, int64_t chunks, int64_t rows,
                 int64_t np, at::Tensor& out) {
  const int64_t cols = out.size(3);
  acc_t* po = out.data_ptr<acc_t>();
  reduce_partials(parts.data(), BH, chunks, rows * np, [&](int64_t bh, int64_t e, acc_t v) {
    const int64_t r = e / np, c = e % np;
    if (c < cols) po[(bh * rows + r) * cols + c] = v;
  });
}

// Forward pass over the rows of x: C = K(x, L) row by row. Optionally
//   with v:  the keys' sums of the op's contract (reference.landmark_rhs), in this one pass:
//            rhs (B, H, m + 1, d_v), rows < m R = C^T (v - 1 v̄^T) / N, row m v̄ = colmean(v);
//            and c̄ = colmean(C), the last row of stats. The pass sums C̃^T v and C̃^T 1 in
//            acc_t (C̃ = C - r 1^T, r the row means over landmarks) and r^T v, Σr and Σv in
//            double (each block's few rows in acc_t first); then, in double,
//            R = [C̃^T v - (C̃^T 1) v̄^T] / N + 1 [r^T v - (Σr) v̄^T] / N, c̄ = (C̃^T 1 + Σr) / N.
//   stats:   (B, H, 2 (+ 1 with v), m), the column mean and (biased) variance over rows of the
//            row-centred C, accumulated around the centred mean of kShiftRows sampled rows
//            (no cancellation for nearly constant columns), chunk partials summed in double;
//   rows:    C itself (B, H, N, m), when a later pass reads it.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_rows_forward(
    const at::Tensor& x, const at::Tensor& l, const c10::optional<at::Tensor>& v, double lam,
    int64_t kind, bool want_stats, bool want_rows) {
  check_pair(x, l, lam, kind);
  if (given(v)) check_like("v", *v, x, x.size(2));
  return LAPF_DISPATCH_FLOATING(x.scalar_type(), "attention_rows_forward", [&]() -> Tensors3 {
    using acc_t = typename AccOf<scalar_t>::type;
    using Vec = Vectorized<acc_t>;
    constexpr int64_t VL = Vec::size();
    const PassShape<acc_t> s(x, l);
    const auto acc_opts = x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
    const bool with_v = given(v);
    const int64_t dv = with_v ? v->size(3) : 0, dvp = padded_width<acc_t>(dv);
    const int64_t stat_rows = (want_stats ? 2 : 0) + (with_v ? 1 : 0);
    at::Tensor rhs = with_v ? at::empty({s.B, s.H, s.M + 1, dv}, acc_opts) : at::empty({0}, acc_opts);
    at::Tensor stats = stat_rows ? at::empty({s.B, s.H, stat_rows, s.M}, acc_opts) : at::empty({0}, acc_opts);
    at::Tensor rows = want_rows ? at::empty({s.B, s.H, s.N, s.M}, acc_opts) : at::empty({0}, acc_opts);
    if (s.B * s.H == 0) return {rhs, stats, rows};
    if (s.N == 0 || s.M == 0) {
      rhs.zero_();
      stats.zero_();
      return {rhs, stats, rows};
    }
    const auto xo = operand<scalar_t>(x);
    const auto lo = operand<scalar_t>(l);
    const auto packed = pack_landmark_columns(lo, s);
    const int64_t psize = packed_size<acc_t>(s.M, s.d);
    const acc_t neg_inv_lam = static_cast<acc_t>(-1.0 / lam);
    // The shift of the statistics per (b, h): the centred mean of kShiftRows sampled rows.
    std::vector<acc_t> shift(want_stats ? static_cast<size_t>(s.B * s.H * s.Mp) : 0, acc_t(0));
    if (want_stats) {
      const int64_t samples = std::min(s.N, kShiftRows);
      std::vector<acc_t> row(static_cast<size_t>(s.Mp), acc_t(0));
      std::vector<double> sum(static_cast<size_t>(s.M));
      for (int64_t bh = 0; bh < s.B * s.H; ++bh) {
        std::fill(sum.begin(), sum.end(), 0.0);
        for (int64_t k = 0; k < samples; ++k) {
          kernel_rows(kind, xo.row(bh / s.H, bh % s.H, k * s.N / samples), xo.sn, xo.sc, 1,
                      s.d, packed.data() + bh * psize, s.M, neg_inv_lam, row.data(), s.Mp);
          const acc_t mean = lane_sum(row.data(), s.Mp) / static_cast<acc_t>(s.M);
          for (int64_t j = 0; j < s.M; ++j) sum[j] += static_cast<double>(row[j] - mean);
        }
        acc_t* sh = shift.data() + bh * s.Mp;
        for (int64_t j = 0; j < s.M; ++j) sh[j] = static_cast<acc_t>(sum[j] / samples);
      }
    }
    // Per chunk: C̃^T v (m x dvp), then C̃^T 1 (Mp); in double r^T v, Σv (dv each), then Σr.
    const int64_t rhs_part = with_v ? s.M * dvp + s.Mp : 0, stat_part = want_stats ? 2 * s.Mp : 0;
    const int64_t common_part = with_v ? 2 * dv + 1 : 0;
    std::vector<acc_t> rhs_parts(static_cast<size_t>(s.items() * rhs_part));
    std::vector<double> common_parts(static_cast<size_t>(s.items() * common_part));
    std::vector<acc_t> stat_parts(static_cast<size_t>(s.items() * stat_part));
    const auto vo = with_v ? operand<scalar_t>(*v) : Operand<scalar_t>{nullptr, 0, 0, 0, 0};
    acc_t* prows = want_rows ? rows.data_ptr<acc_t>() : nullptr;
    for_each_chunk(s, [&](int64_t bh, int64_t b, int64_t h, int64_t i0, int64_t n, int64_t chunk) {
      std::vector<acc_t> kbuf(kBlockRows * s.Mp, acc_t(0)), vbuf(kBlockRows * dvp);
      std::vector<acc_t> cbuf(with_v ? kBlockRows * s.Mp : 0), tbuf(with_v ? 2 * dvp : 0);
      acc_t* rp = rhs_parts.data() + (bh * s.chunks + chunk) * rhs_part;
      acc_t* sp = stat_parts.data() + (bh * s.chunks + chunk) * stat_part;
      double* cp = common_parts.data() + (bh * s.chunks + chunk) * common_part;
      std::fill(rp, rp + rhs_part, acc_t(0));
      std::fill(cp, cp + common_part, 0.0);
      std::fill(sp, sp + stat_part, acc_t(0));
      const acc_t* sh = want_stats ? shift.data() + bh * s.Mp : nullptr;
      for_each_block(n, [&](auto rows_const, int64_t i) {
        constexpr int R = decltype(rows_const)::value;
        const int64_t row0 = i0 + i;
        kernel_rows(kind, xo.row(b, h, row0), xo.sn, xo.sc, R, s.d,
                    packed.data() + bh * psize, s.M, neg_inv_lam, kbuf.data(), s.Mp);
        if (prows) {
          for (int r = 0; r < R; ++r)
            std::copy(kbuf.data() + r * s.Mp, kbuf.data() + r * s.Mp + s.M,
                      prows + ((bh * s.N) + row0 + r) * s.M);
        }
        acc_t row_mean[R];
        for (int r = 0; r < R; ++r)
          row_mean[r] = lane_sum(kbuf.data() + r * s.Mp, s.Mp) / static_cast<acc_t>(s.M);
        if (want_stats) {
          for (int r = 0; r < R; ++r) {
            const acc_t* kr = kbuf.data() + r * s.Mp;
            const Vec mean(row_mean[r]);
            for (int64_t v0 = 0; v0 < s.Mp; v0 += VL) {
              const Vec delta = Vec::loadu(kr + v0) - mean - Vec::loadu(sh + v0);
              (Vec::loadu(sp + v0) + delta).store(sp + v0);
              at::vec::fmadd(delta, delta, Vec::loadu(sp + s.Mp + v0)).store(sp + s.Mp + v0);
            }
          }
        }
        if (with_v) {
          acc_t* kp = rp + s.M * dvp;
          for (int r = 0; r < R; ++r) {
            stage_row(vo.row(b, h, row0 + r), vo.sc, dv, dvp, vbuf.data() + r * dvp);
            const Vec mean(row_mean[r]);
            // Lanes beyond m hold -mean; nothing reads them.
            for (int64_t v0 = 0; v0 < s.Mp; v0 += VL) {
              const Vec c = Vec::loadu(kbuf.data() + r * s.Mp + v0) - mean;
              c.store(cbuf.data() + r * s.Mp + v0);
              (Vec::loadu(kp + v0) + c).store(kp + v0);
            }
          }
          accumulate_outer<R>(cbuf.data(), s.Mp, vbuf.data(), s.M, dvp, rp);
          // r^T v and Σv: the block's R terms in acc_t, then into the chunk's double sums
          // (as good as an fp64 N-sum, and the scalar double work is 1/R of the rows').
          for (int64_t v0 = 0; v0 < dvp; v0 += VL) {
            Vec sum(acc_t(0)), vsum(acc_t(0));
            for (int r = 0; r < R; ++r) {
              const Vec vr = Vec::loadu(vbuf.data() + r * dvp + v0);
              sum = at::vec::fmadd(Vec(row_mean[r]), vr, sum);
              vsum = vsum + vr;
            }
            sum.store(tbuf.data() + v0);
            vsum.store(tbuf.data() + dvp + v0);
          }
          acc_t rsum = 0;
          for (int r = 0; r < R; ++r) rsum += row_mean[r];
          for (int64_t c = 0; c < dv; ++c) {
            cp[c] += static_cast<double>(tbuf[c]);
            cp[dv + c] += static_cast<double>(tbuf[dvp + c]);
          }
          cp[2 * dv] += static_cast<double>(rsum);
        }
      });
    });
    if (with_v) {
      const int64_t BH = s.B * s.H;
      std::vector<acc_t> sums(static_cast<size_t>(BH * rhs_part));
      reduce_partials(rhs_parts.data(), BH, s.chunks, rhs_part,
                      [&](int64_t bh, int64_t e, acc_t sum) { sums[bh * rhs_part + e] = sum; });
      acc_t* pr = rhs.data_ptr<acc_t>();
      acc_t* pk = stats.data_ptr<acc_t>() + (stat_rows - 1) * s.M;
      const double inv_n = 1.0 / static_cast<double>(s.N);
      std::vector<double> total(static_cast<size_t>(common_part)), mean(dv), common(dv);
      for (int64_t bh = 0; bh < BH; ++bh) {
        std::fill(total.begin(), total.end(), 0.0);
        for (int64_t k = 0; k < s.chunks; ++k)
          for (int64_t e = 0; e < common_part; ++e)
            total[e] += common_parts[(bh * s.chunks + k) * common_part + e];
        const double row_sum = total[2 * dv];
        for (int64_t c = 0; c < dv; ++c) {
          mean[c] = total[dv + c] * inv_n;
          common[c] = (total[c] - row_sum * mean[c]) * inv_n;
        }
        const acc_t* ctv = sums.data() + bh * rhs_part;
        const acc_t* ct1 = ctv + s.M * dvp;
        acc_t* out = pr + bh * (s.M + 1) * dv;
        for (int64_t j = 0; j < s.M; ++j)
          for (int64_t c = 0; c < dv; ++c)
            out[j * dv + c] = static_cast<acc_t>(
                (static_cast<double>(ctv[j * dvp + c]) - static_cast<double>(ct1[j]) * mean[c]) * inv_n +
                common[c]);
        for (int64_t c = 0; c < dv; ++c) out[s.M * dv + c] = static_cast<acc_t>(mean[c]);
        for (int64_t j = 0; j < s.M; ++j)
          pk[bh * stat_rows * s.M + j] = static_cast<acc_t>((static_cast<double>(ct1[j]) + row_sum) * inv_n);
      }
    }
    if (want_stats) {
      auto st = stats.accessor<acc_t, 4>();
      for (int64_t bh = 0; bh < s.B * s.H; ++bh) {
        for (int64_t j = 0; j < s.M; ++j) {
          double s1 = 0, s2 = 0;
          for (int64_t c = 0; c < s.chunks; ++c) {
            const acc_t* sp = stat_parts.data() + (bh * s.chunks + c) * stat_part;
            s1 += sp[j];
            s2 += sp[s.Mp + j];
          }
          const double off = s1 / s.N;
          st[bh / s.H][bh % s.H][0][j] = static_cast<acc_t>(shift[bh * s.Mp + j] + off);
          st[bh / s.H][bh % s.H][1][j] = static_cast<acc_t>(std::max(s2 / s.N - off * off, 0.0));
        }
      }
    }
    return {rhs, stats, rows};
  });
}

// out (B, N, H, d_v) in out_dtype: out_i = C_i A + bias for rows C (B, H, N, m), A (B, H, m,
// d_v), bias (B, H, 1, d_v); with `centre`, C_i less its mean over landmarks. For the
// whitening's folded A = (I - J/m) diag(s) context that is the same in math, but a row's
// values nearly agree, so uncentred its mean times the fp32 rounding of 1^T A (~0) is most
// of the error (docs/numerics.md).
template <typename acc_t, typename out_t>
at::Tensor attention_rows_apply_typed(const at::Tensor& rows, const at::Tensor& A,
                                      const at::Tensor& bias, bool centre,
                                      at::ScalarType out_dtype) {
  const int64_t B = rows.size(0), H = rows.size(1), N = rows.size(2), M = rows.size(3);
  using Vec = Vectorized<acc_t>;
  constexpr int64_t VL = Vec::size();
  const int64_t dv = A.size(3), dvp = padded_width<acc_t>(dv);
  at::Tensor out = at::empty({B, N, H, dv}, rows.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  const int64_t chunks = ceil_div(N, kChunkRows);
  std::vector<std::vector<acc_t>> packs(B * H), biases(B * H);
  for (int64_t bh = 0; bh < B * H; ++bh) {
    packs[bh] = pack_matrix<acc_t>(A, bh, false, dvp);
    biases[bh] = pack_vector<acc_t>(bias, bh, 0, dvp);
  }
  const acc_t* pr = rows.data_ptr<acc_t>();
  out_t* po = out.data_ptr<out_t>();
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> obuf(kBlockRows * dvp), cbuf(centre ? kBlockRows * M : 0);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t bh = w / chunks, b = bh / H, h = bh % H, i0 = (w % chunks) * kChunkRows;
      const int64_t n = std::min(kChunkRows, N - i0);
      for_each_block(n, [&](auto rows_const, int64_t i) {
        constexpr int R = decltype(rows_const)::value;
        const int64_t row0 = i0 + i;
        const acc_t* a = pr + (bh * N + row0) * M;
        if (centre) {
          for (int r = 0; r < R; ++r) {
            const acc_t* ar = a + r * M;
            acc_t* cr = cbuf.data() + r * M;
            Vec acc(acc_t(0));
            int64_t j = 0;
            for (; j + VL <= M; j += VL) acc = acc + Vec::loadu(ar + j);
            acc_t sum = at::vec::vec_reduce_all<acc_t>([](Vec& x, Vec& y) { return x + y; }, acc);
            for (; j < M; ++j) sum += ar[j];
            const acc_t mean = sum / static_cast<acc_t>(M);
            const Vec vmean(mean);
            for (j = 0; j + VL <= M; j += VL) (Vec::loadu(ar + j) - vmean).store(cr + j);
            for (; j < M; ++j) cr[j] = ar[j] - mean;
          }
          a = cbuf.data();
        }
        rows_times<R>(a, M, M, packs[bh].data(), dvp, biases[bh].data(), obuf.data());
        for (int r = 0; r < R; ++r) {
          out_t* dst = po + ((b * N + row0 + r) * H + h) * dv;
          for (int64_t e = 0; e < dv; ++e) dst[e] = static_cast<out_t>(obuf[r * dvp + e]);
        }
      });
    }
  });
  return out;
}

// Backward pass 1 over the rows of x (= q): recomputes C = K(x, L) and returns
// T = Cc^T G (B, H, m, d_v) (Cc: C row-centred when `centre`, else C), colsum(G) (B, H, 1,
// d_v) and C (B, H, N, m) for pass 2. g (B, H, N, d_v), any strides.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_grad_sums(
    const at::Tensor& x, const at::Tensor& l, const at::Tensor& g, double lam, int64_t kind,
    bool centre) {
  check_pair(x, l, lam, kind);
  check_like("grad", g, x, x.size(2));
  return LAPF_DISPATCH_FLOATING(x.scalar_type(), "attention_grad_sums", [&]() -> Tensors3 {
    using acc_t = typename AccOf<scalar_t>::type;
    using Vec = Vectorized<acc_t>;
    constexpr int64_t VL = Vec::size();
    const PassShape<acc_t> s(x, l);
    const auto acc_opts = x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
    const int64_t dv = g.size(3), dvp = padded_width<acc_t>(dv);
    at::Tensor t = at::zeros({s.B, s.H, s.M, dv}, acc_opts);
    at::Tensor gsum = at::zeros({s.B, s.H, 1, dv}, acc_opts);
    at::Tensor rows = at::empty({s.B, s.H, s.N, s.M}, acc_opts);
    if (s.B * s.H == 0 || s.M == 0 || s.N == 0) return {t, gsum, rows};
    const auto xo = operand<scalar_t>(x);
    const auto lo = operand<scalar_t>(l);
    const auto go = operand<scalar_t>(g);
    const auto packed = pack_landmark_columns(lo, s);
    const int64_t psize = packed_size<acc_t>(s.M, s.d);
    const acc_t neg_inv_lam = static_cast<acc_t>(-1.0 / lam);
    const int64_t part = (s.M + 1) * dvp;  // T rows, then colsum(G)
    std::vector<acc_t> parts(static_cast<size_t>(s.items() * part));
    acc_t* prows = rows.data_ptr<acc_t>();
    for_each_chunk(s, [&](int64_t bh, int64_t b, int64_t h, int64_t i0, int64_t n, int64_t chunk) {
      std::vector<acc_t> kbuf(kBlockRows * s.Mp, acc_t(0)), gbuf(kBlockRows * dvp);
      acc_t* pp = parts.data() + (bh * s.chunks + chunk) * part;
      std::fill(pp, pp + part, acc_t(0));
      for_each_block(n, [&](auto rows_const, int64_t i) {
        constexpr int R = decltype(rows_const)::value;
        const int64_t row0 = i0 + i;
        kernel_rows(kind, xo.row(b, h, row0), xo.sn, xo.sc, R, s.d,
                    packed.data() + bh * psize, s.M, neg_inv_lam, kbuf.data(), s.Mp);
        for (int r = 0; r < R; ++r) {
          acc_t* kr = kbuf.data() + r * s.Mp;
          std::copy(kr, kr + s.M, prows + (bh * s.N + row0 + r) * s.M);
          if (centre) {
            const acc_t mean = lane_sum(kr, s.Mp) / static_cast<acc_t>(s.M);
            for (int64_t j = 0; j < s.M; ++j) kr[j] -= mean;
          }
          stage_row(go.row(b, h, row0 + r), go.sc, dv, dvp, gbuf.data() + r * dvp);
          for (int64_t v0 = 0; v0 < dvp; v0 += VL) {
            acc_t* gs = pp + s.M * dvp + v0;
            (Vec::loadu(gs) + Vec::loadu(gbuf.data() + r * dvp + v0)).store(gs);
          }
        }
        accumulate_outer<R>(kbuf.data(), s.Mp, gbuf.data(), s.M, dvp, pp);
      });
    });
    std::vector<acc_t> t_parts(static_cast<size_t>(s.items() * s.M * dvp));
    std::vector<acc_t> g_parts(static_cast<size_t>(s.items() * dvp));
    for (int64_t w = 0; w < s.items(); ++w) {
      std::copy(parts.begin() + w * part, parts.begin() + w * part + s.M * dvp,
                t_parts.begin() + w * s.M * dvp);
      std::copy(parts.begin() + w * part + s.M * dvp, parts.begin() + (w + 1) * part,
                g_parts.begin() + w * dvp);
    }
    reduce_into(t_parts, s.B * s.H, s.chunks, s.M, dvp, t);
    reduce_into(g_parts, s.B * s.H, s.chunks, 1, dvp, gsum);
    return {t, gsum, rows};
  });
}

// Backward pass 2 over the rows of x: with C = K(x, L) (read from `rows`, else recomputed),
//   W = (Dc + E) * C, where
//     Dc = D - a * (Cc - mu), minus its row mean (centre) or D (no centre), D = G ctx_s^T,
//          present when g is given;
//     E = (v - 1 v̄^T) dR^T, present when v is given (v_mean v̄ (B, H, 1, d_v); v centred
//         as read, in acc_t);
// and returns dx (B, N, H, d) in x's dtype (a (B, H, N, d) view by transposing),
// dl (B, H, m, d) in acc_t and, with need_dv, dv = C dR + 1 w^T (B, N, H, d_v) in v's dtype.
// d_rhs (B, H, m + 1, d_v): dR, then the row w.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_rows_backward(
    const at::Tensor& x, const at::Tensor& l, const c10::optional<at::Tensor>& rows_in,
    const c10::optional<at::Tensor>& g, const c10::optional<at::Tensor>& ctx_s,
    const c10::optional<at::Tensor>& a, const c10::optional<at::Tensor>& mu,
    const c10::optional<at::Tensor>& v, const c10::optional<at::Tensor>& v_mean,
    const c10::optional<at::Tensor>& d_rhs, bool need_dv,
    double lam, int64_t kind, bool centre) {
  check_pair(x, l, lam, kind);
  const int64_t N = x.size(2), M = l.size(2);
  if (given(rows_in)) {
    check_small("rows", *rows_in, x, N, M);
    TORCH_CHECK(rows_in->is_contiguous(), "rows must be contiguous");
  }
  if (given(g)) {
    check_like("grad", *g, x, N);
    check_small("ctx_s", *ctx_s, x, M, g->size(3));
    if (centre) {
      check_small("a", *a, x, 1, M);
      check_small("mu", *mu, x, 1, M);
    }
  }
  TORCH_CHECK(!need_dv || given(v), "need_dv needs v");
  if (given(v)) {
    check_like("v", *v, x, N);
    check_small("v_mean", *v_mean, x, 1, v->size(3));
    check_small("d_rhs", *d_rhs, x, M + 1, v->size(3));
  }
  return LAPF_DISPATCH_FLOATING(x.scalar_type(), "attention_rows_backward", [&]() -> Tensors3 {
    using acc_t = typename AccOf<scalar_t>::type;
    using Vec = Vectorized<acc_t>;
    constexpr int64_t VL = Vec::size();
    const PassShape<acc_t> s(x, l);
    const auto acc_opts = x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
    const bool with_g = given(g), with_v = given(v), with_rows = given(rows_in);
    const int64_t dg = with_g ? g->size(3) : 0, dgp = padded_width<acc_t>(dg);
    const int64_t dv = with_v ? v->size(3) : 0;
    const int64_t dvp = padded_width<acc_t>(dv), dp = padded_width<acc_t>(s.d);
    at::Tensor dx = at::empty({s.B, s.N, s.H, s.d}, x.options());
    at::Tensor dl = at::zeros({s.B, s.H, s.M, s.d}, acc_opts);
    at::Tensor dvo = need_dv ? at::empty({s.B, s.N, s.H, dv}, v->options()) : at::empty({0}, x.options());
    if (s.B * s.H == 0 || s.N == 0) return {dx, dl, dvo};
    if (s.M == 0) {
      dx.zero_();
      if (need_dv) dvo.zero_();
      return {dx, dl, dvo};
    }
    const auto xo = operand<scalar_t>(x);
    const auto lo = operand<scalar_t>(l);
    const auto go = with_g ? operand<scalar_t>(*g) : Operand<scalar_t>{nullptr, 0, 0, 0, 0};
    const auto vo = with_v ? operand<scalar_t>(*v) : Operand<scalar_t>{nullptr, 0, 0, 0, 0};
    std::vector<acc_t> packed;
    if (!with_rows) packed = pack_landmark_columns(lo, s);
    const int64_t psize = packed_size<acc_t>(s.M, s.d);
    const acc_t neg_inv_lam = static_cast<acc_t>(-1.0 / lam);
    const acc_t scale = static_cast<acc_t>((kind == kLaplacian ? 1.0 : 2.0) / lam);
    // Per (b, h): L rows padded to dp; ctx_s^T (d_g x Mp); a, mu (Mp); dR^T (d_v x Mp);
    // v̄ (dvp); dR and w ((m + 1) x dvp).
    const int64_t BH = s.B * s.H;
    std::vector<std::vector<acc_t>> lpack(BH), cst(BH), av(BH), muv(BH), drt(BH), vmv(BH), dr(BH);
    const at::Tensor d_key = with_v ? d_rhs->narrow(2, 0, s.M) : at::Tensor();
    for (int64_t bh = 0; bh < BH; ++bh) {
      lpack[bh].resize(s.M * dp);
      for (int64_t j = 0; j < s.M; ++j)
        stage_row(lo.row(bh / s.H, bh % s.H, j), lo.sc, s.d, dp, lpack[bh].data() + j * dp);
      if (with_g) {
        cst[bh] = pack_matrix<acc_t>(*ctx_s, bh, true, s.Mp);
        if (centre) {
          av[bh] = pack_vector<acc_t>(*a, bh, 0, s.Mp);
          muv[bh] = pack_vector<acc_t>(*mu, bh, 0, s.Mp);
        }
      }
      if (with_v) {
        drt[bh] = pack_matrix<acc_t>(d_key, bh, true, s.Mp);
        vmv[bh] = pack_vector<acc_t>(*v_mean, bh, 0, dvp);
      }
      if (need_dv) dr[bh] = pack_matrix<acc_t>(*d_rhs, bh, false, dvp);
    }
    const int64_t part = s.M * dp;
    std::vector<acc_t> parts(static_cast<size_t>(s.items() * part));
    scalar_t* pdx = dx.data_ptr<scalar_t>();
    scalar_t* pdv = need_dv ? dvo.data_ptr<scalar_t>() : nullptr;
    const acc_t* prows = with_rows ? rows_in->data_ptr<acc_t>() : nullptr;
    const acc_t inv_m = acc_t(1) / static_cast<acc_t>(s.M);
    for_each_chunk(s, [&](int64_t bh, int64_t b, int64_t h, int64_t i0, int64_t n, int64_t chunk) {
      constexpr int RB = kBlockRows;
      std::vector<acc_t> kbuf(RB * s.Mp, acc_t(0)), wbuf(RB * s.Mp), tbuf(RB * s.Mp);
      std::vector<acc_t> gbuf(RB * dgp), vbuf(RB * dvp), obuf(RB * dvp);
      std::vector<acc_t> xbuf(RB * dp), dxbuf(RB * dp);
      acc_t* pp = parts.data() + (bh * s.chunks + chunk) * part;
      std::fill(pp, pp + part, acc_t(0));
      for_each_block(n, [&](auto rows_const, int64_t i) {
        constexpr int R = decltype(rows_const)::value;
        const int64_t row0 = i0 + i;
        if (with_rows) {
          for (int r = 0; r < R; ++r)
            std::copy(prows + (bh * s.N + row0 + r) * s.M, prows + (bh * s.N + row0 + r + 1) * s.M,
                      kbuf.data() + r * s.Mp);
        } else {
          kernel_rows(kind, xo.row(b, h, row0), xo.sn, xo.sc, R, s.d,
                      packed.data() + bh * psize, s.M, neg_inv_lam, kbuf.data(), s.Mp);
        }
        std::fill(wbuf.begin(), wbuf.end(), acc_t(0));
        if (with_g) {
          for (int r = 0; r < R; ++r)
            stage_row(go.row(b, h, row0 + r), go.sc, dg, dgp, gbuf.data() + r * dgp);
          rows_times<R>(gbuf.data(), dgp, dg, cst[bh].data(), s.Mp, nullptr, wbuf.data());
          if (centre) {
            for (int r = 0; r < R; ++r) {
              const acc_t* kr = kbuf.data() + r * s.Mp;
              acc_t* wr = wbuf.data() + r * s.Mp;
              const Vec row_mean(lane_sum(kr, s.Mp) * inv_m);
              for (int64_t v0 = 0; v0 < s.Mp; v0 += VL) {
                const Vec centred = Vec::loadu(kr + v0) - row_mean - Vec::loadu(muv[bh].data() + v0);
                (Vec::loadu(wr + v0) - Vec::loadu(av[bh].data() + v0) * centred).store(wr + v0);
              }
              // Lanes beyond m: D, a and mu are zero there, so is this row's value.
              for (int64_t j = s.M; j < s.Mp; ++j) wr[j] = acc_t(0);
              const Vec wmean(lane_sum(wr, s.Mp) * inv_m);
              for (int64_t v0 = 0; v0 < s.Mp; v0 += VL)
                (Vec::loadu(wr + v0) - wmean).store(wr + v0);
            }
          }
        }
        if (with_v) {
          for (int r = 0; r < R; ++r) {
            acc_t* vr = vbuf.data() + r * dvp;
            stage_row(vo.row(b, h, row0 + r), vo.sc, dv, dvp, vr);
            for (int64_t v0 = 0; v0 < dvp; v0 += VL)
              (Vec::loadu(vr + v0) - Vec::loadu(vmv[bh].data() + v0)).store(vr + v0);
          }
          rows_times<R>(vbuf.data(), dvp, dv, drt[bh].data(), s.Mp, nullptr, tbuf.data());
          for (int64_t e = 0; e < R * s.Mp; ++e) wbuf[e] += tbuf[e];
        }
        if (need_dv) {
          const acc_t* w = dr[bh].data() + s.M * dvp;
          rows_times<R>(kbuf.data(), s.Mp, s.M, dr[bh].data(), dvp, w, obuf.data());
          for (int r = 0; r < R; ++r) {
            scalar_t* dst = pdv + ((b * s.N + row0 + r) * s.H + h) * dv;
            for (int64_t e = 0; e < dv; ++e) dst[e] = static_cast<scalar_t>(obuf[r * dvp + e]);
          }
        }
        for (int64_t e = 0; e < R * s.Mp; ++e) wbuf[e] *= kbuf[e];
        for (int r = 0; r < R; ++r)
          stage_row(xo.row(b, h, row0 + r), xo.sc, s.d, dp, xbuf.data() + r * dp);
        std::fill(dxbuf.begin(), dxbuf.end(), acc_t(0));
        if (kind == kLaplacian) {
          grad_rows<kLaplacian, R, true>(xbuf.data(), wbuf.data(), s.Mp, lpack[bh].data(), s.M, dp,
                                         dxbuf.data(), pp);
        } else {
          grad_rows<kGaussian, R, true>(xbuf.data(), wbuf.data(), s.Mp, lpack[bh].data(), s.M, dp,
                                        dxbuf.data(), pp);
        }
        for (int r = 0; r < R; ++r) {
          scalar_t* dst = pdx + ((b * s.N + row0 + r) * s.H + h) * s.d;
          for (int64_t c = 0; c < s.d; ++c) dst[c] = static_cast<scalar_t>(-scale * dxbuf[r * dp + c]);
        }
      });
    });
    reduce_into(parts, BH, s.chunks, s.M, dp, dl);
    dl.mul_(scale);
    return {dx, dl, dvo};
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace lapf

// ---------------------------------------------------------------------------------------------
// The other operator entry points and the registration (lapformer_mm/ops/backends/cpu.py calls
// the operators).
// ---------------------------------------------------------------------------------------------
namespace lapf {
inline namespace CPU_CAPABILITY {

inline std::tuple<at::Tensor, at::Tensor> pairwise_backward(
    const at::Tensor& grad, const at::Tensor& kmat, const at::Tensor& x, const at::Tensor& y,
    double lam, int64_t kind, bool need_x, bool need_y) {
  check_pair(x, y, lam, kind);
  const bool compute_dtype = grad.defined() && grad.scalar_type() != x.scalar_type() &&
                             grad.scalar_type() == acc_type(x.scalar_type());
  for (const auto& [name, t] : {std::pair{"grad", &grad}, std::pair{"kmat", &kmat}}) {
    if (compute_dtype) {
      check_small(name, *t, x, x.size(2), y.size(2));
    } else {
      check_like(name, *t, x, x.size(2));
      TORCH_CHECK(t->size(3) == y.size(2), name, " must have M = ", y.size(2),
                  " columns, got ", t->sizes());
    }
  }
  std::tuple<at::Tensor, at::Tensor> out;
  LAPF_DISPATCH_FLOATING(x.scalar_type(), "pairwise_backward", [&] {
    using acc_t = typename AccOf<scalar_t>::type;
    out = compute_dtype
              ? pairwise_backward_typed<scalar_t, acc_t>(grad, kmat, x, y, lam, kind, need_x,
                                                         need_y)
              : pairwise_backward_typed<scalar_t, scalar_t>(grad, kmat, x, y, lam, kind, need_x,
                                                            need_y);
  });
  return out;
}

inline at::Tensor attention_rows_apply(const at::Tensor& rows, const at::Tensor& a,
                                       const at::Tensor& bias, bool centre,
                                       at::ScalarType dtype) {
  TORCH_CHECK(rows.defined() && rows.device().is_cpu() && rows.dim() == 4 && rows.is_contiguous()
                  && (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kDouble),
              "rows must be a contiguous 4-D float32 or float64 CPU tensor");
  check_small("a", a, rows, rows.size(3), -1);
  check_small("bias", bias, rows, 1, a.size(3));
  TORCH_CHECK(at::isFloatingType(dtype), "dtype must be a floating dtype, got ", dtype);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "attention_rows_apply", [&] {
    using acc_t = scalar_t;
    LAPF_DISPATCH_FLOATING(dtype, "attention_rows_apply_out", [&] {
      out = attention_rows_apply_typed<acc_t, scalar_t>(rows, a, bias, centre, dtype);
    });
  });
  return out;
}

inline void define_ops(torch::Library& m) {
  m.def("pairwise_forward(Tensor x, Tensor y, float lam, int kind) -> Tensor");
  m.def("pairwise_backward(Tensor grad, Tensor kmat, Tensor x, Tensor y, float lam, int kind, "
        "bool need_x, bool need_y) -> (Tensor, Tensor)");
  m.def("attention_rows_forward(Tensor x, Tensor landmarks, Tensor? v, float lam, int kind, "
        "bool want_stats, bool want_rows) -> (Tensor, Tensor, Tensor)");
  m.def("attention_rows_apply(Tensor rows, Tensor a, Tensor bias, bool centre, "
        "ScalarType dtype) -> Tensor");
  m.def("attention_grad_sums(Tensor x, Tensor landmarks, Tensor grad, float lam, int kind, "
        "bool centre) -> (Tensor, Tensor, Tensor)");
  m.def("attention_rows_backward(Tensor x, Tensor landmarks, Tensor? rows, Tensor? grad, "
        "Tensor? ctx_s, Tensor? a, Tensor? mu, Tensor? v, Tensor? v_mean, Tensor? d_rhs, "
        "bool need_dv, float lam, int kind, bool centre) -> (Tensor, Tensor, Tensor)");
}

inline void implement_ops(torch::Library& m) {
  m.impl("pairwise_forward", &pairwise_forward);
  m.impl("pairwise_backward", &pairwise_backward);
  m.impl("attention_rows_forward", &attention_rows_forward);
  m.impl("attention_rows_apply", &attention_rows_apply);
  m.impl("attention_grad_sums", &attention_grad_sums);
  m.impl("attention_rows_backward", &attention_rows_backward);
}

}  // namespace CPU_CAPABILITY
}  // namespace lapf

// TORCH_LIBRARY pastes its namespace argument; one level of indirection expands the macro first.
#define LAPF_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LAPF_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)
#define LAPF_REGISTER(ns)                                   \
  LAPF_LIBRARY(ns, m) { lapf::define_ops(m); }              \
  LAPF_LIBRARY_IMPL(ns, m) { lapf::implement_ops(m); }
