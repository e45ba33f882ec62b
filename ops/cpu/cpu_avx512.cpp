// The kernels of cpu_kernels.h built for at::vec's AVX512 capability.
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "cpu_kernels.h"

LAPF_REGISTER(lapformer_mm_cpu_avx512)
