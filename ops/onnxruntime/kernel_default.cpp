// The op library's kernels for any x86-64 (SSE2) or other CPU: 4-lane vectors.
#define LAPF_ISA generic
#define LAPF_LANES 4
#define LAPF_ROWS 2
#include "kernels.h"
