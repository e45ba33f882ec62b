// CPU emulation of the small part of CUDA C++ that ops/cuda/*.cu use, so that g++
// can compile the kernels unchanged and run them on the CPU for the tests.
//
// A launch runs the blocks one after another, and `__shared__` variables are `static`
// (one block at a time shares them). The threads of a block are fibers on the calling
// thread (ucontext): each runs until its next __syncthreads() or its end, then the next
// one, in thread order in one barrier phase and in reverse order in the next, so a
// missing barrier between a write and another thread's read gives a wrong result
// whichever of the two comes first — deterministically, and without hundreds of OS
// threads per launch competing for the cores. With -DEMU_THREADS (the ThreadSanitizer
// build) they are real std::threads and __syncthreads() a std::barrier, so TSan sees
// such a race as one. Warp-level intrinsics are not emulated: the kernels use none.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <vector>

#ifdef EMU_THREADS
#include <thread>
#else
#include <sys/mman.h>
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#endif

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

#ifdef EMU_THREADS
inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline std::barrier<>* emu_block_barrier = nullptr;
inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
#else
// One OS thread runs every fiber; the scheduler sets these before it resumes one.
inline dim3 threadIdx;
inline dim3 blockIdx;
inline ucontext_t emu_scheduler;
inline ucontext_t* emu_running = nullptr;
inline void __syncthreads() { swapcontext(emu_running, &emu_scheduler); }
#endif
inline dim3 blockDim;
inline dim3 gridDim;
inline unsigned char* emu_dynamic_shared = nullptr;
inline std::size_t emu_dynamic_shared_bytes = 0;
inline bool emu_dynamic_shared_overrun = false;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)
#define LAP_DYNAMIC_SHARED_BYTES(name) unsigned char* name = emu_dynamic_shared

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
// What a block finds in its dynamic shared memory: all-ones bytes, a NaN as float and as
// double, so that a read before the block's own write spreads NaN into the results
// (a small finite value could vanish in them).
constexpr unsigned char emu_poison = 0xFF;

inline void emu_poison_dynamic_shared() {
    std::memset(emu_dynamic_shared, emu_poison, emu_dynamic_shared_bytes);
}

template <typename Body>
void emu_run_blocks(dim3 grid, dim3 block, Body body);

// Runs `body` (the kernel call) for every thread of every block, one block after another,
// with `dynamic_shared` bytes of dynamic shared memory, poisoned, followed by a canary.
template <typename Body>
void emu_launch(dim3 grid, dim3 block, std::size_t dynamic_shared, Body body) {
    gridDim = grid;
    blockDim = block;
    std::vector<unsigned char> shared(dynamic_shared + emu_canary_bytes, emu_canary);
    emu_dynamic_shared = shared.data();
    emu_dynamic_shared_bytes = dynamic_shared;
    emu_poison_dynamic_shared();
    emu_run_blocks(grid, block, body);
    emu_dynamic_shared_overrun = std::any_of(shared.begin() + dynamic_shared, shared.end(),
                                             [](unsigned char b) { return b != emu_canary; });
}

inline dim3 emu_thread_index(unsigned t, dim3 block) {
    return dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
}

#ifdef EMU_THREADS
// One std::thread per thread of a block, started once per launch: each runs its thread of
// every block in turn, and a barrier closes each block, so no thread starts the next block
// (whose `static` shared memory is the same) before the whole block has finished. Dynamic
// shared memory is poisoned once per launch here (this build looks for races).
template <typename Body>
void emu_run_blocks(dim3 grid, dim3 block, Body body) {
    const unsigned nthreads = block.x * block.y * block.z;
    std::barrier<> barrier(nthreads);
    emu_block_barrier = &barrier;
    std::vector<std::thread> threads;
    threads.reserve(nthreads);
    for (unsigned t = 0; t < nthreads; ++t) {
        threads.emplace_back([&, t] {
            threadIdx = emu_thread_index(t, block);
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
}
#else
// Each fiber's stack: far more than a kernel thread's locals need, mapped lazily, with an
// inaccessible page below it so that an overflow faults instead of corrupting a neighbour.
constexpr std::size_t emu_stack_bytes = 256 * 1024, emu_guard_bytes = 4096;

struct emu_fiber {
    ucontext_t context;
    unsigned char* mapping = nullptr;
    bool done = false;
};

template <typename Body>
struct emu_fiber_start {
    static inline Body* body = nullptr;
    static inline emu_fiber* fiber = nullptr;
    static void run() {
        emu_fiber* self = fiber;
        (*body)();
        self->done = true;
        swapcontext(&self->context, &emu_scheduler);  // never resumed after this
    }
};

// The fibers of one block start at the kernel's entry, on dynamic shared memory poisoned
// again (what an earlier block left there is no more defined on the GPU); the scheduler
// resumes each fiber that has not finished once per barrier phase until all have (a
// thread that returns early no longer takes part in the block's barriers, as on the GPU
// since Volta).
template <typename Body>
void emu_run_blocks(dim3 grid, dim3 block, Body body) {
    const unsigned nthreads = block.x * block.y * block.z;
    std::vector<emu_fiber> fibers(nthreads);
    for (auto& f : fibers) {
        void* m = mmap(nullptr, emu_stack_bytes + emu_guard_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED || mprotect(m, emu_guard_bytes, PROT_NONE) != 0) {
            std::perror("emu: fiber stack");
            std::abort();
        }
        f.mapping = static_cast<unsigned char*>(m);
    }
    emu_fiber_start<Body>::body = &body;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = dim3(bx, by, bz);
                emu_poison_dynamic_shared();
                for (auto& f : fibers) {
                    getcontext(&f.context);
                    f.context.uc_stack.ss_sp = f.mapping + emu_guard_bytes;
                    f.context.uc_stack.ss_size = emu_stack_bytes;
                    f.context.uc_link = nullptr;
                    makecontext(&f.context, &emu_fiber_start<Body>::run, 0);
                    f.done = false;
                }
                unsigned finished = 0;
                for (bool forward = true; finished < nthreads; forward = !forward) {
                    for (unsigned i = 0; i < nthreads; ++i) {
                        const unsigned t = forward ? i : nthreads - 1 - i;
                        emu_fiber& f = fibers[t];
                        if (f.done) continue;
                        threadIdx = emu_thread_index(t, block);
                        emu_running = &f.context;
                        emu_fiber_start<Body>::fiber = &f;
                        swapcontext(&emu_scheduler, &f.context);
                        finished += f.done;
                    }
                }
            }
    for (auto& f : fibers) munmap(f.mapping, emu_stack_bytes + emu_guard_bytes);
}
#endif
