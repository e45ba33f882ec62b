// The op library's kernels built for AVX2 + FMA: 8-lane vectors, 2 × 4 accumulators.
#define LAPF_ISA avx2
#define LAPF_LANES 8
#define LAPF_ROWS 2
#include "kernels.h"
