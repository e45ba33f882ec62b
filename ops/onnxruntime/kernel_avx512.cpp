// The op library's kernels built for AVX-512F: 16-lane vectors, 4 × 4 accumulators.
#define LAPF_ISA avx512
#define LAPF_LANES 16
#define LAPF_ROWS 4
#include "kernels.h"
