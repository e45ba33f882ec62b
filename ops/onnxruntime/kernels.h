// The kernels of the ONNX Runtime op library, for one instruction set: the kernel matrix
// K = exp(-dist(x_i, y_j) / lam) and the attention's two passes over the rows (ops.h).
// Included by kernel_{default,avx2,avx512}.cpp, each compiled with its own flags; LAPF_ISA
// names the namespace, so no inline function of one build can be picked by the linker for
// another (the reason the kernels use no std:: templates either: their COMDAT copies would
// be shared across the builds).
//
// Vectorisation is GCC's vector extension at the build's width: y is transposed to
// (d, M) padded to whole vectors, and each step broadcasts one x value against a tile of
// landmark columns held in registers, so no (N, M, d) difference exists. The passes follow
// ops/cpu/cpu_kernels.h (attention_rows_forward, attention_rows_apply), which
// the eager CPU backend runs: the same sums, in the same precisions.
#ifndef LAPF_ISA
#error "define LAPF_ISA (and LAPF_LANES, LAPF_ROWS) before including kernels.h"
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
// Rows of the attention pass's float partials of its double sums.
constexpr int64_t kSumRows = 8;

static inline vf splat(float v) { return v - vf{}; }
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
// x: R rows of stride sx; out: R rows of stride ldo, columns [col, m) written.
template <bool kL1, int R, int V>
static inline void tile(const float* x, int64_t sx, int64_t d, const float* yt, int64_t padded,
                        int64_t col, float scale, float* out, int64_t ldo, int64_t m) {
  vf acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < V; ++t) acc[r][t] = splat(0.0f);
  // With FMA the l1 sums run as acc + |diff| * 1 (exact: the same rounding as the add) on
  // the multiply units, beside the subtractions on the add units (two of each on AMD's
  // Zen): the empty asm hides the 1 from the compiler, which would fold it back to an add.
  vf one = splat(1.0f);
#if defined(__FMA__)
  __asm__("" : "+x"(one));
#endif
  for (int64_t k = 0; k < d; ++k) {
    const float* yk = yt + k * padded + col;
    vf yv[V];
    for (int t = 0; t < V; ++t) yv[t] = load(yk + t * kLanes);
    for (int r = 0; r < R; ++r) {
      vf xv = splat(x[r * sx + k]);
      for (int t = 0; t < V; ++t) {
        vf diff = xv - yv[t];
        acc[r][t] += kL1 ? vabs(diff) * one : diff * diff;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* row = out + r * ldo;
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
static void columns(const Problem& p, const float* x, const float* yt, int64_t count,
                    int64_t col, float* out, int64_t ldo) {
  const float scale = -1.0f / p.lam;
  int64_t i = 0;
  for (; i + kRows <= count; i += kRows)
    tile<kL1, kRows, V>(x + i * p.sx_row, p.sx_row, p.d, yt, p.padded, col, scale,
                        out + i * ldo, ldo, p.m);
  for (; i < count; ++i)
    tile<kL1, 1, V>(x + i * p.sx_row, p.sx_row, p.d, yt, p.padded, col, scale, out + i * ldo,
                    ldo, p.m);
}

template <bool kL1>
static void rows(const Problem& p, const float* x, const float* yt, int64_t count, float* out,
                 int64_t ldo) {
  for (int64_t col = 0; col < p.m; col += kTile * kLanes) {
    int64_t left = (p.m - col + kLanes - 1) / kLanes;
    if (left >= 4)
      columns<kL1, 4>(p, x, yt, count, col, out, ldo);
    else if (left == 3)
      columns<kL1, 3>(p, x, yt, count, col, out, ldo);
    else if (left == 2)
      columns<kL1, 2>(p, x, yt, count, col, out, ldo);
    else
      columns<kL1, 1>(p, x, yt, count, col, out, ldo);
  }
}

// Rows [begin, end) of batch entry b of K into out (row stride ldo).
static void kernel_block(const Problem& p, int64_t b, int64_t begin, int64_t end, float* out,
                         int64_t ldo) {
  const float* x = p.x + (b / p.heads) * p.sx_outer + (b % p.heads) * p.sx_head + begin * p.sx_row;
  const float* yt = p.yt + b * p.d * p.padded;
  if (p.l1)
    rows<true>(p, x, yt, end - begin, out, ldo);
  else
    rows<false>(p, x, yt, end - begin, out, ldo);
}

void kernel_rows(const Problem& p, int64_t batch, int64_t begin, int64_t end) {
  kernel_block(p, batch, begin, end, p.out + (batch * p.n + begin) * p.m, p.m);
}

// The sum of a row's first `count` values (zeros beyond them up to whole vectors).
static inline float padded_sum(const float* row, int64_t np) {
  vf s = splat(0.0f);
  for (int64_t j = 0; j < np; j += kLanes) s += load(row + j);
  float lanes[kLanes];
  store(lanes, s);
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// acc[j0 .. j0 + JB)[v0 .. v0 + VB vectors) += sum over `count` rows r of c[r][j] v[r][...]
// (c, v: rows of strides ldc, ldv; acc: rows of dvp): the tile stays in registers over all
// the rows.
template <int JB, int VB>
static inline void outer_tile(const float* c, int64_t ldc, const float* v, int64_t ldv,
                              int64_t dvp, int64_t count, int64_t j0, int64_t v0, float* acc) {
  vf s[JB][VB];
  for (int q = 0; q < JB; ++q)
    for (int t = 0; t < VB; ++t) s[q][t] = load(acc + (j0 + q) * dvp + v0 + t * kLanes);
  for (int64_t r = 0; r < count; ++r) {
    vf bv[VB];
    for (int t = 0; t < VB; ++t) bv[t] = load(v + r * ldv + v0 + t * kLanes);
    for (int q = 0; q < JB; ++q) {
      const vf cq = splat(c[r * ldc + j0 + q]);
      for (int t = 0; t < VB; ++t) s[q][t] += cq * bv[t];
    }
  }
  for (int q = 0; q < JB; ++q)
    for (int t = 0; t < VB; ++t) store(acc + (j0 + q) * dvp + v0 + t * kLanes, s[q][t]);
}

// acc (m, dvp) += c^T v for `count` rows: tiles of kOuterRows landmarks × kRows vectors.
constexpr int kOuterRows = 6;
template <int VB>
static inline void outer_columns(const float* c, int64_t ldc, const float* v, int64_t ldv,
                                 int64_t m, int64_t dvp, int64_t count, int64_t v0,
                                 float* acc) {
  int64_t j = 0;
  for (; j + kOuterRows <= m; j += kOuterRows)
    outer_tile<kOuterRows, VB>(c, ldc, v, ldv, dvp, count, j, v0, acc);
  for (; j < m; ++j) outer_tile<1, VB>(c, ldc, v, ldv, dvp, count, j, v0, acc);
}

static inline void accumulate_outer(const float* c, int64_t ldc, const float* v, int64_t ldv,
                                    int64_t m, int64_t dvp, int64_t count, float* acc) {
  int64_t v0 = 0;
  for (; v0 + kRows * kLanes <= dvp; v0 += kRows * kLanes)
    outer_columns<kRows>(c, ldc, v, ldv, m, dvp, count, v0, acc);
  for (; v0 < dvp; v0 += kLanes) outer_columns<1>(c, ldc, v, ldv, m, dvp, count, v0, acc);
}

void rows_chunk(const RowsPass& p, int64_t bh, int64_t chunk, float* scratch) {
  const Problem& k = p.kernel;
  const int64_t m = k.m, mp = k.padded, dv = p.dv, dvp = p.dvp;
  const int64_t begin = chunk * kChunkRows;
  const int64_t count = k.n - begin < kChunkRows ? k.n - begin : kChunkRows;
  const int64_t b = bh / k.heads, h = bh % k.heads;
  float* kb = scratch;                  // count × mp: the chunk's rows of C, then less their means
  float* vb = kb + kChunkRows * mp;     // count × dvp: its rows of v padded, when dv is not
  float* mean = vb + kChunkRows * dvp;  // count: the rows' means over landmarks
  for (int64_t e = 0; e < count * mp; ++e) kb[e] = 0.0f;
  kernel_block(k, bh, begin, begin + count, kb, mp);
  if (p.rows) {
    float* dst = p.rows + (bh * k.n + begin) * m;
    for (int64_t i = 0; i < count; ++i)
      for (int64_t j = 0; j < m; ++j) dst[i * m + j] = kb[i * mp + j];
  }
  const float inv_m = 1.0f / static_cast<float>(m);
  for (int64_t i = 0; i < count; ++i) {
    float* kr = kb + i * mp;
    mean[i] = padded_sum(kr, mp) * inv_m;
    // Lanes beyond m become -mean; nothing below reads them.
    const vf mr = splat(mean[i]);
    for (int64_t v0 = 0; v0 < mp; v0 += kLanes) store(kr + v0, load(kr + v0) - mr);
  }
  const int64_t part = bh * p.chunks + chunk;
  if (p.shift) {
    float* sp = p.stat_parts + part * 2 * mp;
    const float* sh = p.shift + bh * mp;
    for (int64_t e = 0; e < 2 * mp; ++e) sp[e] = 0.0f;
    for (int64_t i = 0; i < count; ++i) {
      const float* kr = kb + i * mp;
      for (int64_t v0 = 0; v0 < mp; v0 += kLanes) {
        const vf delta = load(kr + v0) - load(sh + v0);
        store(sp + v0, load(sp + v0) + delta);
        store(sp + mp + v0, load(sp + mp + v0) + delta * delta);
      }
    }
  }
  if (!dv) return;
  // The chunk's rows of v: read in place when they are whole vectors, else padded copies.
  const float* vc = p.v + ((b * k.n + begin) * k.heads + h) * dv;
  int64_t ldv = k.heads * dv;
  if (dv != dvp) {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t e = 0; e < dvp; ++e) vb[i * dvp + e] = e < dv ? vc[i * ldv + e] : 0.0f;
    vc = vb;
    ldv = dvp;
  }
  float* rp = p.rhs_parts + part * (m * dvp + mp);
  float* kp = rp + m * dvp;
  double* cp = p.common_parts + part * (2 * dv + 1);
  for (int64_t e = 0; e < m * dvp + mp; ++e) rp[e] = 0.0f;
  for (int64_t e = 0; e < 2 * dv + 1; ++e) cp[e] = 0.0;
  accumulate_outer(kb, mp, vc, ldv, m, dvp, count, rp);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t v0 = 0; v0 < mp; v0 += kLanes)
      store(kp + v0, load(kp + v0) + load(kb + i * mp + v0));
  // r^T v, Σv and Σr: kSumRows terms at a time in float, then into the chunk's double sums.
  for (int64_t i0 = 0; i0 < count; i0 += kSumRows) {
    const int64_t block = count - i0 < kSumRows ? count - i0 : kSumRows;
    for (int64_t v0 = 0; v0 < dvp; v0 += kLanes) {
      vf sum = splat(0.0f), vsum = splat(0.0f);
      for (int64_t r = i0; r < i0 + block; ++r) {
        const vf vr = load(vc + r * ldv + v0);
        sum += splat(mean[r]) * vr;
        vsum += vr;
      }
      float lanes[kLanes], vlanes[kLanes];
      store(lanes, sum);
      store(vlanes, vsum);
      for (int l = 0; l < kLanes && v0 + l < dv; ++l) {
        cp[v0 + l] += static_cast<double>(lanes[l]);
        cp[dv + v0 + l] += static_cast<double>(vlanes[l]);
      }
    }
    float rsum = 0.0f;
    for (int64_t r = i0; r < i0 + block; ++r) rsum += mean[r];
    cp[2 * dv] += static_cast<double>(rsum);
  }
}

// out[r][v0 : v0 + JV vectors] = sum_k (c[r][k] - mean[r]) A[k][...] + bias: R × JV
// accumulators (the rows centred as read: the same fp32 differences as a centred copy); out
// rows of stride ldo.
template <int R, int JV>
static inline void rows_times_tile(const float* c, int64_t ldc, int64_t m, const float* mean,
                                   const float* a, int64_t dvp, const float* bias, float* out,
                                   int64_t ldo, int64_t v0) {
  vf acc[R][JV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < JV; ++t) acc[r][t] = splat(0.0f);
  for (int64_t k = 0; k < m; ++k) {
    vf av[JV];
    for (int t = 0; t < JV; ++t) av[t] = load(a + k * dvp + v0 + t * kLanes);
    for (int r = 0; r < R; ++r) {
      const vf cr = splat(c[r * ldc + k] - mean[r]);
      for (int t = 0; t < JV; ++t) acc[r][t] += cr * av[t];
    }
  }
  for (int t = 0; t < JV; ++t) {
    const vf b0 = load(bias + v0 + t * kLanes);
    for (int r = 0; r < R; ++r) store(out + r * ldo + v0 + t * kLanes, acc[r][t] + b0);
  }
}

template <int R>
static inline void apply_rows(const ApplyPass& p, int64_t bh, int64_t row0, float* scratch) {
  const int64_t m = p.m, dvp = p.dvp;
  const float* c = p.rows + (bh * p.n + row0) * m;
  float mean[R];
  for (int r = 0; r < R; ++r) {
    mean[r] = 0.0f;
    if (!p.centre) continue;
    const float* cr = c + r * m;
    vf s = splat(0.0f);
    int64_t j = 0;
    for (; j + kLanes <= m; j += kLanes) s += load(cr + j);
    float lanes[kLanes];
    store(lanes, s);
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];
    for (; j < m; ++j) sum += cr[j];
    mean[r] = sum / static_cast<float>(m);
  }
  // Straight into out when its rows are whole vectors, else through R × dvp of scratch.
  const int64_t b = bh / p.heads, h = bh % p.heads;
  float* dst = p.out + ((b * p.n + row0) * p.heads + h) * p.dv;
  const bool direct = p.dv == dvp;
  float* ob = direct ? dst : scratch;
  const int64_t ldo = direct ? p.heads * p.dv : dvp;
  const float* a = p.a + bh * m * dvp;
  const float* bias = p.bias + bh * dvp;
  for (int64_t v0 = 0; v0 < dvp; v0 += kTile * kLanes) {
    const int64_t left = (dvp - v0) / kLanes;
    if (left >= 4)
      rows_times_tile<R, 4>(c, m, m, mean, a, dvp, bias, ob, ldo, v0);
    else if (left == 3)
      rows_times_tile<R, 3>(c, m, m, mean, a, dvp, bias, ob, ldo, v0);
    else if (left == 2)
      rows_times_tile<R, 2>(c, m, m, mean, a, dvp, bias, ob, ldo, v0);
    else
      rows_times_tile<R, 1>(c, m, m, mean, a, dvp, bias, ob, ldo, v0);
  }
  if (direct) return;
  for (int r = 0; r < R; ++r)
    for (int64_t e = 0; e < p.dv; ++e) dst[r * p.heads * p.dv + e] = ob[r * dvp + e];
}

void apply_chunk(const ApplyPass& p, int64_t bh, int64_t chunk, float* scratch) {
  const int64_t begin = chunk * kChunkRows;
  const int64_t end = p.n - begin < kChunkRows ? p.n : begin + kChunkRows;
  int64_t i = begin;
  for (; i + kRows <= end; i += kRows) apply_rows<kRows>(p, bh, i, scratch);
  for (; i < end; ++i) apply_rows<1>(p, bh, i, scratch);
}

}  // namespace LAPF_ISA
}  // namespace lapf_ort
