// Exposes every kernel instantiation of ops/cuda/nystrom_attention.cu,
// compiled for the CPU through shim.h with one variant's tile geometry (-D options from
// lapformer_mm/ops/backends/cuda.py), behind one C entry point with CUDA's
// launch ABI: an array of pointers to the argument values, here the one nys_params.
// EMU_FLOAT_ONLY leaves out the 16-bit instantiations (variants other than the default
// are checked in fp32 only, which builds in a third of the time).
//
// Built with -fvisibility=hidden: several variants' libraries live in one process, and
// their template kernels' static (shared-memory) arrays, sized by each variant, must not
// be merged into one object by the dynamic linker (GNU unique symbols).
#include "shim.h"

#include <cstddef>
#include <cstdio>
#include <map>
#include <string>

#include "nystrom_attention.cu"

namespace {

typedef void (*Launcher)(void** args, dim3 grid, dim3 block, std::size_t shared);

template <void (*Kernel)(const nys_params)>
void launch_kernel(void** args, dim3 grid, dim3 block, std::size_t shared) {
    const nys_params p = *static_cast<const nys_params*>(args[0]);
    emu_launch(grid, block, shared, [&] { Kernel(p); });
}

#define EMU_ENTRY(...) {#__VA_ARGS__, &launch_kernel<&__VA_ARGS__>}

#define EMU_NYSTROM_KIND(T, K)                                                          \
    EMU_ENTRY(nys_forward_stats<T, K>), EMU_ENTRY(nys_forward_solve<T, K>),                \
    EMU_ENTRY(nys_forward_out<T, K>), EMU_ENTRY(nys_backward_reduce<T, K>),                \
    EMU_ENTRY(nys_backward_solve<T, K>), EMU_ENTRY(nys_backward_grads<T, K>),              \
    EMU_ENTRY(nys_backward_landmarks<T, K>)

#define EMU_NYSTROM(T)                                                                  \
    EMU_NYSTROM_KIND(T, 0), EMU_NYSTROM_KIND(T, 1), EMU_ENTRY(nys_forward_context<T>),     \
    EMU_ENTRY(nys_backward_merge<T>)

const std::map<std::string, Launcher>& kernels() {
    static const std::map<std::string, Launcher> table = {
        EMU_NYSTROM(float),
#ifndef EMU_FLOAT_ONLY
        EMU_NYSTROM(lap_half), EMU_NYSTROM(lap_bf16),
#endif
    };
    return table;
}


}  // namespace

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

EMU_EXPORT int emu_has_kernel(const char* name) { return kernels().count(name) ? 1 : 0; }

// "name offset" lines of nys_params as g++ lays it out, then "sizeof N": the host's
// numpy dtype must match (tests/ops/cuda/test_fused_emulation.py).
EMU_EXPORT const char* emu_params_layout() {
    static char buf[4096];
    int used = 0;
#define EMU_LINE(name, value) \
    used += std::snprintf(buf + used, sizeof buf - used, "%s %zu\n", name, (std::size_t)(value))
#define EMU_OPERAND(o)                                                   \
    EMU_LINE(#o ".ptr", offsetof(nys_params, o.ptr));                    \
    EMU_LINE(#o ".sb", offsetof(nys_params, o.sb));                      \
    EMU_LINE(#o ".sh", offsetof(nys_params, o.sh));                      \
    EMU_LINE(#o ".sn", offsetof(nys_params, o.sn));                      \
    EMU_LINE(#o ".sd", offsetof(nys_params, o.sd))
    EMU_OPERAND(q); EMU_OPERAND(k); EMU_OPERAND(v); EMU_OPERAND(L); EMU_OPERAND(g);
    EMU_OPERAND(grad_q); EMU_OPERAND(grad_k); EMU_OPERAND(grad_v); EMU_OPERAND(grad_l);
#define EMU_SCALAR(f) EMU_LINE(#f, offsetof(nys_params, f))
    EMU_SCALAR(out); EMU_SCALAR(part); EMU_SCALAR(fold); EMU_SCALAR(context);
    EMU_SCALAR(inverse); EMU_SCALAR(stats); EMU_SCALAR(work); EMU_SCALAR(lpart);
    EMU_SCALAR(common);
    EMU_SCALAR(bh_count); EMU_SCALAR(heads); EMU_SCALAR(n); EMU_SCALAR(m); EMU_SCALAR(d);
    EMU_SCALAR(dv); EMU_SCALAR(chunk); EMU_SCALAR(splits); EMU_SCALAR(iters);
    EMU_SCALAR(init_authors); EMU_SCALAR(refine); EMU_SCALAR(injective);
    EMU_SCALAR(solve_cols); EMU_SCALAR(ns_partials); EMU_SCALAR(neg_inv_lam);
    EMU_SCALAR(neg_coef); EMU_SCALAR(eps); EMU_SCALAR(whiten_eps);
    EMU_LINE("sizeof", sizeof(nys_params));
    return buf;
}

// 0: launched; 1: no such kernel; 2: the kernel wrote past the dynamic shared memory
// the host asked for.
EMU_EXPORT int emu_launch_kernel(const char* name, void** args, const unsigned* grid, const unsigned* block,
                                 unsigned long long shared) {
    auto it = kernels().find(name);
    if (it == kernels().end()) return 1;
    it->second(args, dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]), shared);
    return emu_dynamic_shared_overrun ? 2 : 0;
}
