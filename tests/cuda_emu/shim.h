// CPU emulation of the small part of CUDA C++ that ops/*.cu use, so that g++
// can compile the kernels unchanged and run them on the CPU for the tests.
//
// A launch runs the blocks one after another; the threads of a block are real
// std::threads (one set per launch, reused by every block), so __syncthreads() is a
// std::barrier across them, data races
// between them behave as on a GPU (any missing barrier can show up as a wrong
// result), and `__shared__` variables are `static` (one block at a time
// shares them). Warp-level intrinsics are not emulated: the kernels use none.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
inline std::barrier<>* emu_block_barrier = nullptr;
inline unsigned char* emu_dynamic_shared = nullptr;
inline bool emu_dynamic_shared_overrun = false;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)
#define LAP_DYNAMIC_SHARED_BYTES(name) unsigned char* name = emu_dynamic_shared

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

using std::max;
using std::min;

inline float lap_host_half_to_float(unsigned short bits) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return (float)h;
}

inline unsigned short lap_host_float_to_half(float v) {
    _Float16 h = (_Float16)v;  // round to nearest even, as cvt.rn.f16.f32
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}

inline float lap_host_bits_to_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline unsigned int lap_host_float_to_bits(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}

// Bytes after the requested dynamic shared memory that must keep this value: a kernel
// whose layout needs more than the host asked for overwrites them.
constexpr std::size_t emu_canary_bytes = 256;
constexpr unsigned char emu_canary = 0xA5;

// Runs `body` (the kernel call) for every thread of every block. One std::thread per
// thread of a block, started once per launch: each runs its thread of every block in
// turn, and a barrier closes each block, so no thread starts the next block (whose
// `static` shared memory is the same) before the whole block has finished, as when every
// block had threads of its own, without starting and joining a block's threads per block.
template <typename Body>
void emu_launch(dim3 grid, dim3 block, std::size_t dynamic_shared, Body body) {
    gridDim = grid;
    blockDim = block;
    std::vector<unsigned char> shared(dynamic_shared + emu_canary_bytes, emu_canary);
    emu_dynamic_shared = shared.data();
    const unsigned nthreads = block.x * block.y * block.z;
    std::barrier<> barrier(nthreads);
    emu_block_barrier = &barrier;
    std::vector<std::thread> threads;
    threads.reserve(nthreads);
    for (unsigned t = 0; t < nthreads; ++t) {
        threads.emplace_back([&, t] {
            threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            for (unsigned bz = 0; bz < grid.z; ++bz)
                for (unsigned by = 0; by < grid.y; ++by)
                    for (unsigned bx = 0; bx < grid.x; ++bx) {
                        blockIdx = dim3(bx, by, bz);
                        body();
                        barrier.arrive_and_wait();
                    }
        });
    }
    for (auto& th : threads) th.join();
    emu_dynamic_shared_overrun = std::any_of(shared.begin() + dynamic_shared, shared.end(),
                                             [](unsigned char b) { return b != emu_canary; });
}
