// Exposes every kernel instantiation of ops/*.cu, compiled for the CPU through
// shim.h, behind one C entry point with CUDA's launch ABI (an array of
// pointers to the argument values), for tests/test_cuda_emulation.py.
#include "shim.h"

#include <map>
#include <string>
#include <type_traits>
#include <utility>

#include "newton_schulz.cu"
#include "nystrom_attention.cu"
#include "pairwise_kernel.cu"

namespace {

typedef void (*Launcher)(void** args, dim3 grid, dim3 block, std::size_t shared);

template <typename... Args, std::size_t... I>
void call_kernel(void (*kernel)(Args...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::decay_t<Args>*>(args[I])...);
}

template <typename... Args>
constexpr std::size_t arity(void (*)(Args...)) { return sizeof...(Args); }

template <auto Kernel>
void launch_kernel(void** args, dim3 grid, dim3 block, std::size_t shared) {
    emu_launch(grid, block, shared,
               [&] { call_kernel(Kernel, args, std::make_index_sequence<arity(Kernel)>{}); });
}

#define EMU_ENTRY(...) {#__VA_ARGS__, &launch_kernel<&__VA_ARGS__>}

#define EMU_PAIRWISE(T)                                            \
    EMU_ENTRY(pairwise_forward<T, 0>), EMU_ENTRY(pairwise_forward<T, 1>),           \
    EMU_ENTRY(pairwise_backward<T, 0, false>), EMU_ENTRY(pairwise_backward<T, 0, true>), \
    EMU_ENTRY(pairwise_backward<T, 1, false>), EMU_ENTRY(pairwise_backward<T, 1, true>)

#define EMU_NYSTROM_KIND(T, K)                                                          \
    EMU_ENTRY(nys_forward_stats<T, K>), EMU_ENTRY(nys_forward_solve<T, K>),                \
    EMU_ENTRY(nys_forward_out<T, K>), EMU_ENTRY(nys_backward_reduce<T, K>),                \
    EMU_ENTRY(nys_backward_solve<T, K>), EMU_ENTRY(nys_backward_grads<T, K>)

#define EMU_NYSTROM(T) \
    EMU_NYSTROM_KIND(T, 0), EMU_NYSTROM_KIND(T, 1), EMU_ENTRY(nys_backward_landmarks<T>)

const std::map<std::string, Launcher>& kernels() {
    static const std::map<std::string, Launcher> table = {
        EMU_PAIRWISE(float), EMU_PAIRWISE(double), EMU_PAIRWISE(lap_half), EMU_PAIRWISE(lap_bf16),
        EMU_ENTRY(newton_schulz<float, true>), EMU_ENTRY(newton_schulz<float, false>),
        EMU_ENTRY(newton_schulz<double, true>), EMU_ENTRY(newton_schulz<double, false>),
        EMU_NYSTROM(float), EMU_NYSTROM(lap_half), EMU_NYSTROM(lap_bf16),
    };
    return table;
}

}  // namespace

extern "C" int emu_has_kernel(const char* name) { return kernels().count(name) ? 1 : 0; }

// 0: launched; 1: no such kernel; 2: the kernel wrote past the dynamic shared memory
// the host asked for.
extern "C" int emu_launch_kernel(const char* name, void** args, const unsigned* grid, const unsigned* block,
                                 unsigned long long shared) {
    auto it = kernels().find(name);
    if (it == kernels().end()) return 1;
    it->second(args, dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]), shared);
    return emu_dynamic_shared_overrun ? 2 : 0;
}
