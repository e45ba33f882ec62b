// ThreadSanitizer run of the emulated kernels (tests/test_cuda_emulation.py builds it
// with -fsanitize=thread). The threads of an emulated block are std::threads and
// __syncthreads() a std::barrier, so a barrier missing between a shared-memory write
// and another thread's read is a data race TSan reports. Values are checked by the
// emulation tests; this program only launches each kernel family once on small, odd
// shapes (tails in every dimension, one and two reduction slices, P in shared and in
// global memory) and exits 0.
#include <cstdio>
#include <vector>

#include "driver.cpp"

namespace {

int launch(const char* name, std::vector<void*> args, dim3 grid, dim3 block, std::size_t shared = 0) {
    const unsigned g[3] = {grid.x, grid.y, grid.z}, b[3] = {block.x, block.y, block.z};
    const int rc = emu_launch_kernel(name, args.data(), g, b, shared);
    if (rc != 0) std::fprintf(stderr, "no kernel %s\n", name);
    return rc;
}

std::vector<float> ramp(std::size_t n, float scale) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = scale * (float)((i * 37) % 23) - 1.0f;
    return v;
}

}  // namespace

int main() {
    long long batch = 2;
    int n = 70, m = 9, d = 17;
    std::vector<float> x = ramp(batch * n * d, 0.1f), y = ramp(batch * m * d, 0.07f);
    std::vector<float> c(batch * n * m), g = ramp(batch * n * m, 0.01f);
    const float *xp = x.data(), *yp = y.data(), *gp = g.data(), *cp = c.data();
    float* op = c.data();
    double neg_inv_lam = -0.25;
    int rc = launch("pairwise_forward<float, 0>", {&xp, &yp, &op, &batch, &n, &m, &d, &neg_inv_lam},
                    dim3(1, 2, 2), dim3(16, 16, 1));

    // dy (rows = y, reduction over the 70 queries) in one slice, written directly...
    std::vector<float> dy(batch * m * d), partial(2 * batch * m * d);
    float* dyp = dy.data();
    float* no_partial = nullptr;
    float* pp = partial.data();
    int red_chunk = 96, half_chunk = 64;
    rc |= launch("pairwise_backward<float, 0, true>",
                 {&gp, &cp, &yp, &xp, &dyp, &no_partial, &batch, &m, &n, &d, &red_chunk, &neg_inv_lam},
                 dim3(1, 1, 2), dim3(16, 16, 1));
    // ...and in two slices of partial sums.
    rc |= launch("pairwise_backward<float, 0, true>",
                 {&gp, &cp, &yp, &xp, &dyp, &pp, &batch, &m, &n, &d, &half_chunk, &neg_inv_lam},
                 dim3(2, 1, 2), dim3(16, 16, 1));

    // Newton-Schulz, m = 9: padded to 12 x 12, 9 tiles -> one warp of 32 threads.
    int ms = 9, iters = 4, init = 0;
    std::vector<float> P(batch * ms * ms, 0.0f), X(batch * ms * ms);
    for (long long b = 0; b < batch; ++b)
        for (int i = 0; i < ms; ++i)
            for (int j = 0; j < ms; ++j) P[(b * ms + i) * ms + j] = i == j ? 2.0f : 0.1f;
    const float* Pp = P.data();
    float* Xp = X.data();
    rc |= launch("newton_schulz<float, true>", {&Pp, &Xp, &batch, &ms, &iters, &init}, dim3(2), dim3(32),
                 3 * sizeof(float) * 12 * 12);
    rc |= launch("newton_schulz<float, false>", {&Pp, &Xp, &batch, &ms, &iters, &init}, dim3(1), dim3(32),
                 2 * sizeof(float) * 12 * 12);
    std::printf("launched, rc=%d\n", rc);
    return rc;
}
