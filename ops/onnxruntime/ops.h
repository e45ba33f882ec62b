// What the op library's builds share: the problems of its kernels, and each build's entries.
#pragma once

#include <cstdint>

namespace lapf_ort {

// Rows per parallel task and per partial sum: a fixed partition of the rows, so results do
// not depend on the thread count.
constexpr int64_t kChunkRows = 256;
// Rows, evenly spaced, whose centred mean is the shift of the whitening statistics.
constexpr int64_t kShiftRows = 64;
// m and d_v are padded to whole vectors of the widest build.
constexpr int64_t kPadLanes = 16;

// K (batch, n, m) = exp(-dist(x_i, y_j) / lam), dist the l1 distance (l1) or the squared l2
// distance, for rows x_i of batch entry b at x + (b / heads) * sx_outer + (b % heads) * sx_head
// + i * sx_row (d contiguous values) and y given transposed, yt (batch, d, padded), padded = m
// rounded up to kPadLanes (zeros beyond m).
struct Problem {
  const float* x;
  const float* yt;
  float* out;
  int64_t n, m, d, padded;
  int64_t heads, sx_outer, sx_head, sx_row;
  float lam;
  bool l1;
};

// The attention's pass over the rows of x (B, N, H, d) for one chunk of rows of one (b, h):
// C = K(x, L) (kernel: the Problem of x and L; its out unused), and
//   rows:   C into (B, H, N, m), when not null;
//   sums:   when dv > 0, the chunk's sums of (C_i - r_i 1)^T v_i and C_i - r_i 1 into
//           rhs_parts (m × dvp, then `padded` floats) and of r_i v_i, v_i and r_i into
//           common_parts (dv, dv, 1, double; a few rows in float first), r_i the row's mean
//           over landmarks, v (B, N, H, dv);
//   stats:  when shift is not null, the chunk's sums of delta and delta^2 into stat_parts
//           (2, padded), delta = C_i - r_i 1 - shift, shift (B*H, padded) the centred mean of
//           kShiftRows sampled rows of C.
// Partials are per (bh * chunks + chunk). scratch: rows_scratch(...) floats.
struct RowsPass {
  Problem kernel;
  const float* v;
  int64_t dv, dvp, chunks;
  float* rows;
  const float* shift;
  float* rhs_parts;
  double* common_parts;
  float* stat_parts;
};
inline int64_t rows_scratch(int64_t padded, int64_t dvp) { return kChunkRows * (padded + dvp + 1); }

// out (B, N, H, dv) = C_i A + bias for rows C (B, H, N, m) of one chunk of one (b, h); with
// centre, C_i less its mean over landmarks. a (B*H, m, dvp) and bias (B*H, dvp), zeros beyond
// dv. scratch: apply_scratch(...) floats.
struct ApplyPass {
  const float* rows;
  const float* a;
  const float* bias;
  float* out;
  int64_t heads, n, m, dv, dvp, chunks;
  bool centre;
};
inline int64_t apply_scratch(int64_t dvp) { return 4 * dvp; }

// One definition per build: rows [begin, end) of batch entry `batch` of K; one chunk of each
// attention pass.
#define LAPF_DECLARE(isa)                                                              \
  namespace isa {                                                                      \
  void kernel_rows(const Problem& p, int64_t batch, int64_t begin, int64_t end);       \
  void rows_chunk(const RowsPass& p, int64_t bh, int64_t chunk, float* scratch);       \
  void apply_chunk(const ApplyPass& p, int64_t bh, int64_t chunk, float* scratch);     \
  }
LAPF_DECLARE(generic)
LAPF_DECLARE(avx2)
LAPF_DECLARE(avx512)
#undef LAPF_DECLARE

}  // namespace lapf_ort
