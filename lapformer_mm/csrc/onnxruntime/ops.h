// What the op library's builds share: one kernel-matrix problem, and each build's entry.
#pragma once

#include <cstdint>

namespace lapf_ort {

// K (batch, n, m) = exp(-dist(x_i, y_j) / lam) for x (batch, n, d) and y given transposed,
// yt (batch, d, padded), padded = m rounded up to whole vectors of the widest build (zeros
// beyond m). dist: the l1 distance (l1) or the squared l2 distance.
struct Problem {
  const float* x;
  const float* yt;
  float* out;
  int64_t n, m, d, padded;
  float lam;
  bool l1;
};

// Rows [begin, end) of batch entry `batch`, one definition per build.
#define LAPF_DECLARE(isa)                                                  \
  namespace isa {                                                          \
  void kernel_rows(const Problem& p, int64_t batch, int64_t begin, int64_t end); \
  }
LAPF_DECLARE(generic)
LAPF_DECLARE(avx2)
LAPF_DECLARE(avx512)
#undef LAPF_DECLARE

}  // namespace lapf_ort
