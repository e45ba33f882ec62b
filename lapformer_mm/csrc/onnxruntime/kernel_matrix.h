// The kernel matrix K = exp(-dist(x_i, y_j) / lam) of the ONNX Runtime op library, for one
// instruction set. Included by kernel_{default,avx2,avx512}.cpp, each compiled with its own
// flags; LAPF_ISA names the namespace, so no inline function of one build can be picked by
// the linker for another (the reason the kernels use no std:: templates either: their
// COMDAT copies would be shared across the builds).
//
// Vectorisation is GCC's vector extension at the build's width: y is transposed to
// (d, M) padded to whole vectors, and each step broadcasts one x value against a tile of
// landmark columns held in registers, so no (N, M, d) difference exists.
#ifndef LAPF_ISA
#error "define LAPF_ISA (and LAPF_LANES, LAPF_ROWS) before including kernel_matrix.h"
#endif

#include <cstddef>
#include <cstdint>

#include "ops.h"

namespace lapf_ort {
namespace LAPF_ISA {

typedef float vf __attribute__((vector_size(4 * LAPF_LANES)));
typedef float vf_u __attribute__((vector_size(4 * LAPF_LANES), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * LAPF_LANES)));
constexpr int kLanes = LAPF_LANES;
// Vectors of landmark columns per register tile, and x rows per tile: the accumulators
// (kRows × kTile) plus kTile column loads fit the register file (16 on AVX2, 32 on AVX-512).
constexpr int kTile = 4;
constexpr int kRows = LAPF_ROWS;

static inline vf splat(float v) { return vf{} + v; }
static inline vf load(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
static inline void store(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }
static inline vf vabs(vf v) { return reinterpret_cast<vf>(reinterpret_cast<vi>(v) & 0x7fffffff); }

// exp(t) for t <= 0 (Cephes' expf: range reduction by ln 2 in two parts, degree-6
// polynomial; within 2 ulp of expf), 0 below -87.3 (expf's underflow).
static inline vf vexp_nonpositive(vf t) {
  const vf lo = splat(-87.33654f);
  vi under = t < lo;
  t = t < lo ? lo : t;
  vf scaled = t * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(scaled, vi);  // truncation: floor + 1 for negatives
  vf nf = __builtin_convertvector(n, vf);
  vi too_big = nf > scaled;
  n = n + too_big;  // the mask is -1 where truncation rounded up
  nf = __builtin_convertvector(n, vf);
  vf r = t - nf * 0.693359375f;
  r = r + nf * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits = (n + 127) << 23;
  vf result = p * reinterpret_cast<vf>(bits);
  return reinterpret_cast<vf>(reinterpret_cast<vi>(result) & ~under);
}

// R rows × V column vectors, both compile-time, so the accumulators stay in registers.
template <bool kL1, int R, int V>
static inline void tile(const float* x, int64_t d, const float* yt, int64_t padded,
                        int64_t col, float scale, float* out, int64_t m) {
  vf acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < V; ++t) acc[r][t] = splat(0.0f);
  for (int64_t k = 0; k < d; ++k) {
    const float* yk = yt + k * padded + col;
    vf yv[V];
    for (int t = 0; t < V; ++t) yv[t] = load(yk + t * kLanes);
    for (int r = 0; r < R; ++r) {
      vf xv = splat(x[r * d + k]);
      for (int t = 0; t < V; ++t) {
        vf diff = xv - yv[t];
        acc[r][t] += kL1 ? vabs(diff) : diff * diff;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* row = out + r * m;
    for (int t = 0; t < V; ++t) {
      vf k = vexp_nonpositive(acc[r][t] * scale);
      int64_t j = col + t * kLanes;
      if (j + kLanes <= m) {
        store(row + j, k);
      } else {
        float part[kLanes];
        store(part, k);
        for (int64_t q = j; q < m; ++q) row[q] = part[q - j];
      }
    }
  }
}

template <bool kL1, int V>
static void columns(const Problem& p, int64_t batch, int64_t begin, int64_t end, int64_t col) {
  const int64_t d = p.d, m = p.m, padded = p.padded;
  const float* yt = p.yt + batch * d * padded;
  const float scale = -1.0f / p.lam;
  int64_t i = begin;
  for (; i + kRows <= end; i += kRows)
    tile<kL1, kRows, V>(p.x + (batch * p.n + i) * d, d, yt, padded, col, scale,
                        p.out + (batch * p.n + i) * m, m);
  for (; i < end; ++i)
    tile<kL1, 1, V>(p.x + (batch * p.n + i) * d, d, yt, padded, col, scale,
                    p.out + (batch * p.n + i) * m, m);
}

template <bool kL1>
static void rows(const Problem& p, int64_t batch, int64_t begin, int64_t end) {
  for (int64_t col = 0; col < p.m; col += kTile * kLanes) {
    int64_t left = (p.m - col + kLanes - 1) / kLanes;
    if (left >= 4)
      columns<kL1, 4>(p, batch, begin, end, col);
    else if (left == 3)
      columns<kL1, 3>(p, batch, begin, end, col);
    else if (left == 2)
      columns<kL1, 2>(p, batch, begin, end, col);
    else
      columns<kL1, 1>(p, batch, begin, end, col);
  }
}

void kernel_rows(const Problem& p, int64_t batch, int64_t begin, int64_t end) {
  if (p.l1)
    rows<true>(p, batch, begin, end);
  else
    rows<false>(p, batch, begin, end);
}

}  // namespace LAPF_ISA
}  // namespace lapf_ort
