// The kernels of cpu_kernels.h built for at::vec's AVX2 capability.
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "cpu_kernels.h"

LAPF_REGISTER(lapformer_mm_cpu_avx2)
