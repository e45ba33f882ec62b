// Shared helpers of the lapformer_mm CUDA kernels.
//
// The kernels are compiled at run time by NVRTC (through CuPy) with no CUDA
// headers on the include path, so nothing here includes <cuda_fp16.h> or the
// standard library: fp16 and bf16 tensors are read as raw 16-bit patterns and
// converted with PTX (fp16) or bit arithmetic (bf16). Without __CUDA_ARCH__
// (the g++ CPU emulation used by the tests) the conversions fall back to
// host functions that the emulation shim provides.
#pragma once

// One untyped dynamic shared buffer: templates may not redeclare an extern
// __shared__ array with a different element type. (The CPU emulation shim
// defines this macro itself.)
#ifdef __CUDA_ARCH__
#define LAP_DYNAMIC_SHARED_BYTES(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// Raw storage of torch.float16 / torch.bfloat16 elements (2 bytes each).
struct lap_half { unsigned short bits; };
struct lap_bf16 { unsigned short bits; };

// Accumulation type: fp32 for fp32/fp16/bf16 inputs, fp64 for fp64 inputs.
template <typename T> struct lap_acc { typedef float type; };
template <> struct lap_acc<double> { typedef double type; };

__device__ __forceinline__ float lap_load(const float* p) { return *p; }
__device__ __forceinline__ double lap_load(const double* p) { return *p; }

__device__ __forceinline__ float lap_load(const lap_half* p) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p->bits));
    return f;
#else
    return lap_host_half_to_float(p->bits);
#endif
}

__device__ __forceinline__ float lap_load(const lap_bf16* p) {
    // bf16 is the upper half of an fp32 bit pattern.
#ifdef __CUDA_ARCH__
    return __int_as_float(((int)p->bits) << 16);
#else
    return lap_host_bits_to_float(((unsigned int)p->bits) << 16);
#endif
}

__device__ __forceinline__ void lap_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void lap_store(double* p, double v) { *p = v; }

__device__ __forceinline__ void lap_store(lap_half* p, float v) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p->bits = h;
#else
    p->bits = lap_host_float_to_half(v);
#endif
}

__device__ __forceinline__ void lap_store(lap_bf16* p, float v) {
    // Round to nearest even on the upper 16 bits (PTX cvt.rn.bf16.f32 needs
    // sm_80; this works on every architecture). NaN stays a quiet NaN.
#ifdef __CUDA_ARCH__
    unsigned int u = (unsigned int)__float_as_int(v);
#else
    unsigned int u = lap_host_float_to_bits(v);
#endif
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        p->bits = 0x7fc0;
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    p->bits = (unsigned short)(u >> 16);
}

// expf/exp rather than __expf: __expf's error grows with |argument| and would
// break the 1e-5 relative agreement with PyTorch at large distances; one exp
// per output is negligible next to the d-long distance loop.
__device__ __forceinline__ float lap_exp(float v) { return expf(v); }
__device__ __forceinline__ double lap_exp(double v) { return exp(v); }

// fabsf/fabs rather than `v < 0 ? -v : v`: the library call lets ptxas fold
// |.| into the consuming FADD as an operand modifier (2 instructions per
// Laplacian term instead of 4); the two differ only for -0 and NaN.
__device__ __forceinline__ float lap_abs(float v) { return fabsf(v); }
__device__ __forceinline__ double lap_abs(double v) { return fabs(v); }

// w * sign(a - b) with sign(0) = 0 (the subgradient of |t| at t = 0), given
// nw = -w. a and b are compared directly instead of subtracting them: CuPy
// compiles with -ftz=true, which would flush a subnormal a - b to 0 and lose
// its sign. The fp32 comparisons are written in PTX without .ftz so that
// subnormal a or b keep their sign too (PyTorch's CPU sign does).
__device__ __forceinline__ float lap_signed_weight(float a, float b, float w, float nw) {
#ifdef __CUDA_ARCH__
    float s;
    asm("{\n\t.reg .pred gt, lt;\n\t.reg .f32 t;\n\t"
        "setp.gt.f32 gt, %1, %2;\n\tsetp.lt.f32 lt, %1, %2;\n\t"
        "selp.f32 t, %4, 0f00000000, lt;\n\tselp.f32 %0, %3, t, gt;\n\t}"
        : "=f"(s) : "f"(a), "f"(b), "f"(w), "f"(nw));
    return s;
#else
    return a > b ? w : (a < b ? nw : 0.0f);
#endif
}

__device__ __forceinline__ double lap_signed_weight(double a, double b, double w, double nw) {
    return a > b ? w : (a < b ? nw : 0.0);
}
