// ThreadSanitizer run of the emulated kernels (tests/ops/cuda/test_fused_emulation.py builds it
// with -fsanitize=thread, -DEMU_THREADS and one variant's -D geometry). With EMU_THREADS the
// threads of an emulated block are std::threads and __syncthreads() a std::barrier (not the
// fibers of the value tests), so a barrier missing between a
// shared-memory write and another thread's read is a data race TSan reports. Values are
// checked by the emulation tests; this program only launches every stage of the fused
// attention on small, odd shapes (tails in every tile, two row slices, the solves in
// several column passes) with tied and separate keys (and normalize='none' on the
// latter), and exits 0.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "driver.cpp"

namespace {

int launch(const char* name, nys_params& p, dim3 grid, std::size_t shared = 0,
           unsigned rows = NYS_TY) {
    void* args[1] = {&p};
    const unsigned g[3] = {grid.x, grid.y, grid.z}, b[3] = {NYS_TX, rows, 1};
    const int rc = emu_launch_kernel(name, args, g, b, shared);
    if (rc != 0) std::fprintf(stderr, "%s: %s\n", name, rc == 1 ? "no such kernel" : "shared memory overrun");
    return rc;
}

std::vector<float> ramp(std::size_t n, float scale) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = scale * (float)((i * 37) % 23) - 1.0f;
    return v;
}

nys_operand operand(float* data, long long sb, long long sh, long long sn, long long sd) {
    return nys_operand{data, sb, sh, sn, sd};
}

// One batch of two heads: N = 70 rows in two slices of 64, m = 9, d = 17, d_v = 11, value
// columns in passes of 4 (backward solve) and groups of NYS_CC (context), the merge and
// context blocks each looping over several pieces. Operands contiguous (B, h, N, .); the
// output gradient in the (B, N, h, d_v) layout of the output.
int nystrom_attention(bool tied, bool injective) {
    const int heads = 2, n = 70, m = 9, d = 17, dv = 11, splits = 2, cols = 4, mp = 12, ld = 52;
    const long long bh = 2;
    std::vector<float> q = ramp(bh * n * d, 0.05f), k = ramp(bh * n * d, 0.04f),
                       v = ramp(bh * n * dv, 0.03f), L = ramp(bh * m * d, 0.02f),
                       g = ramp(bh * n * dv, 0.01f);
    std::vector<float> part(bh * splits * (3 * m + m * dv)), fold(bh * (m + 1) * dv),
        context(bh * (m + 1) * dv), inverse(bh * m * m), stats(bh * 3 * m), out(bh * n * dv),
        fwork(bh * (m * m + m * dv + m + 2 * dv)), bpart(bh * splits * (m * dv + dv)),
        work(bh * (2 * m * dv + m + m * m + 2 * dv)), lpart(bh * splits * m * d),
        dq(bh * n * d), dk(bh * n * d), dvv(bh * n * dv), dl(bh * m * d);
    std::vector<double> common(bh * splits * (2 * dv + 1));
    nys_params p{};
    p.q = operand(q.data(), heads * n * d, n * d, d, 1);
    p.k = tied ? nys_operand{} : operand(k.data(), heads * n * d, n * d, d, 1);
    p.v = operand(v.data(), heads * n * dv, n * dv, dv, 1);
    p.L = operand(L.data(), heads * m * d, m * d, d, 1);
    p.g = operand(g.data(), n * heads * dv, dv, heads * dv, 1);
    p.grad_q = operand(dq.data(), heads * n * d, n * d, d, 1);
    p.grad_k = tied ? nys_operand{} : operand(dk.data(), heads * n * d, n * d, d, 1);
    p.grad_v = operand(dvv.data(), heads * n * dv, n * dv, dv, 1);
    p.grad_l = operand(dl.data(), heads * m * d, m * d, d, 1);
    p.out = out.data();
    p.fold = fold.data();
    p.context = context.data();
    p.inverse = inverse.data();
    p.stats = stats.data();
    p.lpart = lpart.data();
    p.common = common.data();
    p.bh_count = bh;
    p.heads = heads, p.n = n, p.m = m, p.d = d, p.dv = dv, p.chunk = 64, p.splits = splits;
    p.iters = 6, p.init_authors = 0, p.refine = 1, p.injective = injective, p.solve_cols = cols;
    p.neg_inv_lam = -0.25f, p.neg_coef = -0.25f, p.eps = 0.01f, p.whiten_eps = 1e-5f;
    // backends.cuda.ns_partials, solve_smem and backward_solve_smem at m = 9 (mp = 12, ld = 52:
    // 3 k-splits of the 12 tiles of X R beside R R, whose partials are the largest).
    p.ns_partials = 2 * 12 * 20;
    const std::size_t solve =
        4 * std::max<std::size_t>(mp * ld + NYS_LTILE, 3 * mp * ld + p.ns_partials);
    const std::size_t bsolve = 4 * (m * m + std::max<std::size_t>(
                                                NYS_LTILE, m * (m + 1) + 3 * m * (cols + 1) +
                                                               NYS_MP + cols));
    const std::size_t grads = 4 * (2 * NYS_MP * (NYS_DV + 1) + 2 * NYS_TB * (NYS_MP + 1) +
                                   2 * NYS_TB * (NYS_DW + 1) + NYS_TK * (NYS_TB + 1) +
                                   NYS_TK * (NYS_MP + 1) + 3 * NYS_MP + 2 * NYS_TB + 2 * NYS_DV);
    const unsigned pieces = (2 * m + m * dv + dv + NYS_LANES - 1) / NYS_LANES;
    const unsigned jobs = 1 + (pieces + NYS_UNITS - 1) / NYS_UNITS;
    p.part = part.data();
    p.work = fwork.data();
    int rc = launch("nys_forward_stats<float, 0>", p, dim3(splits, 2));
    // Fewer blocks than jobs: a block runs the Newton-Schulz job and merges.
    rc |= launch("nys_forward_solve<float, 0>", p, dim3(jobs / 2, 2), solve, NYS_SY);
    rc |= launch("nys_forward_context<float>", p, dim3(1, 2));
    rc |= launch("nys_forward_out<float, 0>", p, dim3(2, 2));
    p.part = bpart.data();
    p.work = work.data();
    rc |= launch("nys_backward_reduce<float, 0>", p, dim3(splits, 2));
    rc |= launch("nys_backward_merge<float>", p, dim3(2, 2));
    rc |= launch("nys_backward_solve<float, 0>", p, dim3(2), bsolve);
    rc |= launch("nys_backward_grads<float, 0>", p, dim3(splits, 2), grads);
    rc |= launch("nys_backward_landmarks<float, 0>", p, dim3(2, 2));
    return rc;
}

}  // namespace

int main() {
    int rc = nystrom_attention(true, true);
    rc |= nystrom_attention(false, true);
    rc |= nystrom_attention(false, false);
    std::printf("launched, rc=%d\n", rc);
    return rc;
}
