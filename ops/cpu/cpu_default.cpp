// The kernels of cpu_kernels.h built for at::vec's DEFAULT capability.
#define CPU_CAPABILITY DEFAULT

#include "cpu_kernels.h"

LAPF_REGISTER(lapformer_mm_cpu_default)
