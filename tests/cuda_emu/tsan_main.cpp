// ThreadSanitizer run of the emulated kernels (tests/test_cuda_emulation.py builds it
// with -fsanitize=thread). The threads of an emulated block are std::threads and
// __syncthreads() a std::barrier, so a barrier missing between a shared-memory write
// and another thread's read is a data race TSan reports. Values are checked by the
// emulation tests; this program only launches each kernel family once on small, odd
// shapes (tails in every dimension, one and two reduction slices, P in shared and in
// global memory; the fused attention with tied and separate keys over two row slices)
// and exits 0.
#include <cstdio>
#include <vector>

#include "driver.cpp"

namespace {

int launch(const char* name, std::vector<void*> args, dim3 grid, dim3 block, std::size_t shared = 0) {
    const unsigned g[3] = {grid.x, grid.y, grid.z}, b[3] = {block.x, block.y, block.z};
    const int rc = emu_launch_kernel(name, args.data(), g, b, shared);
    if (rc != 0) std::fprintf(stderr, "%s: %s\n", name, rc == 1 ? "no such kernel" : "shared memory overrun");
    return rc;
}

std::vector<float> ramp(std::size_t n, float scale) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = scale * (float)((i * 37) % 23) - 1.0f;
    return v;
}

// Every stage of the fused attention (ops/nystrom_attention.cu) on one batch of two
// heads: N = 70 rows in two slices of 64 (tails in the 64- and 32-row tiles), m = 9,
// d = 17, d_v = 11. Operands are contiguous (B, h, N, d); the output gradient is the
// (B, N, h, d_v) layout of the output.
int nystrom_attention(bool tied) {
    long long bh = 2;
    int heads = 2, n = 70, m = 9, d = 17, dv = 11, chunk = 64, splits = 2, iters = 6, zero = 0,
        one = 1, smem_floats_solve = 3 * 12 * 12 + 2 * 9 * 11 + 64;
    float neg_inv_lam = -0.25f, neg_coef = -0.25f, eps = 0.01f, whiten_eps = 1e-5f;
    std::vector<float> q = ramp(bh * n * d, 0.05f), k = ramp(bh * n * d, 0.04f),
                       v = ramp(bh * n * dv, 0.03f), L = ramp(bh * m * d, 0.02f),
                       g = ramp(bh * n * dv, 0.01f);
    std::vector<float> part(bh * splits * (2 * m + m * dv)), fold(bh * (m + 1) * dv),
        context(bh * m * dv), inverse(bh * m * m), stats(bh * 2 * m), out(bh * n * dv),
        bpart(bh * splits * (m * dv + dv)), work(bh * (m * dv + m + m * d)),
        lpart(bh * splits * m * d), dq(bh * n * d), dk(bh * n * d), dvv(bh * n * dv),
        dl(bh * m * d);
    const float *qp = q.data(), *kp = tied ? nullptr : k.data(), *vp = v.data(), *lp = L.data(),
                *gp = g.data();
    float *partp = part.data(), *foldp = fold.data(), *ctxp = context.data(),
          *invp = inverse.data(), *statp = stats.data(), *outp = out.data(),
          *bpartp = bpart.data(), *workp = work.data(), *lpartp = lpart.data(), *dqp = dq.data(),
          *dkp = tied ? nullptr : dk.data(), *dvp = dvv.data(), *dlp = dl.data();
    // Strides of (B, h, N, width) operands and of the (B, N, h, d_v) gradient.
    long long qs[4] = {heads * n * d, n * d, d, 1}, vs[4] = {heads * n * dv, n * dv, dv, 1},
              ls[4] = {heads * m * d, m * d, d, 1}, gs[4] = {n * heads * dv, dv, heads * dv, 1};
    long long* ks = qs;
    const dim3 block(16, 16, 1);
    int rc = launch("nys_forward_stats<float, 0>",
                    {&qp, &kp, &vp, &lp, &qs[0], &qs[1], &qs[2], &qs[3], &ks[0], &ks[1], &ks[2],
                     &ks[3], &vs[0], &vs[1], &vs[2], &vs[3], &ls[0], &ls[1], &ls[2], &ls[3],
                     &partp, &bh, &heads, &n, &m, &d, &dv, &chunk, &neg_inv_lam, &one},
                    dim3(splits, 2), block);
    rc |= launch("nys_forward_solve<float, 0>",
                 {&lp, &ls[0], &ls[1], &ls[2], &ls[3], &partp, &ctxp, &invp, &statp, &foldp, &bh,
                  &heads, &n, &m, &d, &dv, &chunk, &splits, &neg_inv_lam, &eps, &iters, &zero,
                  &one, &one, &whiten_eps},
                 dim3(2), block, 4 * smem_floats_solve);
    rc |= launch("nys_forward_out<float, 0>",
                 {&qp, &qs[0], &qs[1], &qs[2], &qs[3], &lp, &ls[0], &ls[1], &ls[2], &ls[3],
                  &foldp, &outp, &bh, &heads, &n, &m, &d, &dv, &neg_inv_lam, &one},
                 dim3(2, 2), block);
    rc |= launch("nys_backward_reduce<float, 0>",
                 {&gp, &gs[0], &gs[1], &gs[2], &gs[3], &qp, &qs[0], &qs[1], &qs[2], &qs[3], &lp,
                  &ls[0], &ls[1], &ls[2], &ls[3], &bpartp, &bh, &heads, &n, &m, &d, &dv, &chunk,
                  &neg_inv_lam, &one},
                 dim3(splits, 2), block);
    rc |= launch("nys_backward_solve<float, 0>",
                 {&lp, &ls[0], &ls[1], &ls[2], &ls[3], &bpartp, &ctxp, &invp, &statp, &workp, &bh,
                  &heads, &n, &m, &d, &dv, &splits, &neg_inv_lam, &neg_coef, &eps, &one, &one},
                 dim3(2), block, 4 * (2 * m * m + 3 * m * dv + 2 * 64 + 64));
    const std::size_t grads_smem = 4 * (2 * 64 * 65 + 4 * 32 * 65 + 16 * (32 + 64 + 2) + 3 * 64 + 2 * 32);
    rc |= launch("nys_backward_grads<float, 0>",
                 {&gp, &gs[0], &gs[1], &gs[2], &gs[3], &qp, &qs[0], &qs[1], &qs[2], &qs[3], &kp,
                  &ks[0], &ks[1], &ks[2], &ks[3], &vp, &vs[0], &vs[1], &vs[2], &vs[3], &lp, &ls[0],
                  &ls[1], &ls[2], &ls[3], &ctxp, &statp, &workp, &dqp, &dkp, &qs[0], &qs[1],
                  &qs[2], &qs[3], &dvp, &vs[0], &vs[1], &vs[2], &vs[3], &lpartp, &bh, &heads, &n,
                  &m, &d, &dv, &chunk, &neg_inv_lam, &neg_coef, &one},
                 dim3(splits, 2), block, grads_smem);
    rc |= launch("nys_backward_landmarks<float>",
                 {&lpartp, &workp, &dlp, &ls[0], &ls[1], &ls[2], &ls[3], &bh, &heads, &m, &d, &dv,
                  &splits},
                 dim3(2), block);
    return rc;
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
    rc |= nystrom_attention(true);
    rc |= nystrom_attention(false);
    std::printf("launched, rc=%d\n", rc);
    return rc;
}
