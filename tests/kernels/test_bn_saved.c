/* test_bn_saved.c — batch norm's CPU kernels: the statistics a batch norm's forward leaves
 * with its input for the backward (kernels/cpu/cpu_norm.c): a backward
 * that reads them gives the bits of one that computes them again, and
 * nothing stale is read after x changes, whichever way it changes. */
#include "test_util.h"
#include "kernels_impl.h"

#include <string.h>

/* A copy of t in a storage of its own (no statistics with it). */
static kpl_tensor *fresh(kpl_tensor *t)
{
    kpl_tensor *c = NULL;
    OK(kpl_tensor_empty_like(t, &c));
    OK(kpl_k_copy(c, t));
    return c;
}

/* The three gradients of x, gy; relu_y for the ReLU form (else NULL). */
typedef struct {
    kpl_tensor *gx, *gg, *gb;
} bn_grads;

static bn_grads bwd(kpl_tensor *x, kpl_tensor *relu_y, kpl_tensor *gy, kpl_tensor *g)
{
    int64_t c = kpl_tensor_shape(g)[0];
    bn_grads r = {tnew(kpl_tensor_dtype(x), kpl_tensor_ndim(x), kpl_tensor_shape(x)),
                  tnew(kpl_tensor_dtype(g), 1, &c), tnew(kpl_tensor_dtype(g), 1, &c)};
    if (relu_y)
        OK(kpl_k_batch_norm_relu_bwd(r.gx, r.gg, r.gb, x, relu_y, gy, g, 1e-5));
    else
        OK(kpl_k_batch_norm_bwd(r.gx, r.gg, r.gb, x, gy, g, 1e-5));
    return r;
}

static void same(kpl_tensor *a, kpl_tensor *b, const char *what, const char *ctx)
{
    size_t es = kpl_dtype_size(kpl_tensor_dtype(a));
    const unsigned char *pa = kpl_tensor_host_data(a), *pb = kpl_tensor_host_data(b);
    for (int64_t i = 0; i < kpl_tensor_numel(a); i++)
        if (memcmp(pa + i * es, pb + i * es, es)) {
            uint64_t ba = 0, bb = 0; /* the bits, for NaNs that differ in payload */
            memcpy(&ba, pa + i * es, es);
            memcpy(&bb, pb + i * es, es);
            fail_msg("%s, %s[%lld]: %.9g (bits %llx), want %.9g (bits %llx)", ctx, what,
                     (long long)i, tget(a, i), (unsigned long long)ba, tget(b, i),
                     (unsigned long long)bb);
        }
}

static void same_grads(bn_grads a, bn_grads b, const char *ctx)
{
    same(a.gx, b.gx, "gx", ctx);
    same(a.gg, b.gg, "ggamma", ctx);
    same(a.gb, b.gb, "gbeta", ctx);
    kpl_tensor *ts[] = {a.gx, a.gg, a.gb, b.gx, b.gg, b.gb};
    for (int i = 0; i < 6; i++) kpl_tensor_release(ts[i]);
}

/* Forward then backward against the backward of a copy of x, for each
 * dtype, the plain and the ReLU form, rows shorter than the sums' 8
 * lanes and longer with a tail; then x changed after the forward (by a
 * host write, by a kernel writing it in place) and a second view of the
 * same storage: each backward equals the one of a copy. */
static void test_bn_saved_statistics(void **state)
{
    (void)state;
    const kpl_dtype dts[3] = {KPL_F32, KPL_F64, KPL_BF16};
    const int64_t shapes[3][4] = {{6, 3, 2, 3}, {3, 5, 7, 9}, {2, 4, 1, 1}};
    for (int di = 0; di < 3; di++)
        for (int si = 0; si < 3; si++)
            for (int relu = 0; relu < 2; relu++) {
                kpl_dtype dt = dts[di], pdt = dt == KPL_BF16 ? KPL_F32 : dt;
                const int64_t *xs = shapes[si];
                int64_t c = xs[1];
                char ctx[96];
                snprintf(ctx, sizeof ctx, "%s (%lld,%lld,%lld,%lld)%s", kpl_dtype_name(dt),
                         (long long)xs[0], (long long)xs[1], (long long)xs[2],
                         (long long)xs[3], relu ? " relu" : "");
                /* a mean far from 0, as after a convolution with a bias */
                kpl_tensor *x = trand(dt, 4, xs, 11 + si, 2, 5), *gy = trand(dt, 4, xs, 12, -1, 1);
                kpl_tensor *g = trand(pdt, 1, &c, 13, 0.5, 1.5), *b = trand(pdt, 1, &c, 14, -1, 1);
                kpl_tensor *y = tnew(dt, 4, xs), *m = tnew(pdt, 1, &c), *v = tnew(pdt, 1, &c);
                if (relu)
                    OK(kpl_k_batch_norm_relu(y, m, v, x, g, b, 1e-5));
                else
                    OK(kpl_k_batch_norm(y, m, v, x, g, b, 1e-5));
                kpl_tensor *ry = relu ? y : NULL, *xc = fresh(x);
                same_grads(bwd(x, ry, gy, g), bwd(xc, ry, gy, g), ctx);
                /* twice: reading them leaves them */
                same_grads(bwd(x, ry, gy, g), bwd(xc, ry, gy, g), ctx);

                /* x changed after the forward, by a kernel writing it in
                 * place and then by the host (bytes of another tensor):
                 * stale statistics would show in every gradient, which the
                 * change moves (checked, so the test can see them) */
                for (int way = 0; way < 2; way++) {
                    if (relu)
                        OK(kpl_k_batch_norm_relu(y, m, v, x, g, b, 1e-5));
                    else
                        OK(kpl_k_batch_norm(y, m, v, x, g, b, 1e-5));
                    kpl_tensor *before = fresh(x);
                    if (way == 0) {
                        OK(kpl_k_binary_scalar(x, KPL_BIN_MUL, x, 3, false));
                    } else {
                        kpl_tensor *o = trand(dt, 4, xs, 21, -4, 9);
                        memcpy(kpl_tensor_host_mutable(x), kpl_tensor_host_data(o),
                               kpl_tensor_nbytes(x));
                        kpl_tensor_release(o);
                    }
                    kpl_tensor *after = fresh(x);
                    char ctx2[192];
                    snprintf(ctx2, sizeof ctx2, "%s, x %s after the forward", ctx,
                             way ? "written by the host" : "written in place by a kernel");
                    bn_grads stale = bwd(before, ry, gy, g), now = bwd(x, ry, gy, g);
                    if (!memcmp(kpl_tensor_host_data(stale.gg), kpl_tensor_host_data(now.gg),
                                (size_t)c * kpl_dtype_size(pdt)))
                        fail_msg("%s: ggamma did not move; the test would not see stale "
                                 "statistics", ctx2);
                    same_grads(now, bwd(after, ry, gy, g), ctx2);
                    kpl_tensor *sg[] = {stale.gx, stale.gg, stale.gb, before, after};
                    for (int i = 0; i < 5; i++) kpl_tensor_release(sg[i]);
                }

                /* two views of one storage: the forward of the first, then
                 * the backward of the second reads nothing of the first's */
                int64_t s2[4] = {2 * xs[0], xs[1], xs[2], xs[3]};
                kpl_tensor *both = trand(dt, 4, s2, 31, -2, 7), *va = NULL, *vb = NULL;
                OK(kpl_tensor_narrow(both, 0, xs[0], &va));
                OK(kpl_tensor_narrow(both, xs[0], xs[0], &vb));
                if (relu)
                    OK(kpl_k_batch_norm_relu(y, m, v, va, g, b, 1e-5));
                else
                    OK(kpl_k_batch_norm(y, m, v, va, g, b, 1e-5));
                kpl_tensor *ca = fresh(va), *cb = fresh(vb);
                char ctx3[160];
                snprintf(ctx3, sizeof ctx3, "%s, another view of the storage", ctx);
                same_grads(bwd(vb, ry, gy, g), bwd(cb, ry, gy, g), ctx3);
                same_grads(bwd(va, ry, gy, g), bwd(ca, ry, gy, g), ctx3);
                kpl_tensor *vs[] = {both, va, vb, ca, cb};
                for (int i = 0; i < 5; i++) kpl_tensor_release(vs[i]);
                kpl_tensor *ts[] = {x, gy, g, b, y, m, v, xc};
                for (int i = 0; i < 8; i++) kpl_tensor_release(ts[i]);
            }
}

/* A copy of the plain (N, C, H, W) tensor t held in kept layout `tag`. */
static kpl_tensor *kept_copy(kpl_tensor *t, kpl_kept tag)
{
    const int64_t *sh = kpl_tensor_shape(t);
    int64_t hw = sh[2] * sh[3];
    size_t es = kpl_dtype_size(kpl_tensor_dtype(t));
    kpl_tensor *k = tnew(kpl_tensor_dtype(t), 4, sh);
    const char *src = kpl_tensor_host_data(t);
    char *dst = kpl_tensor_host_mutable(k);
    kpl_kept_geom gm = kpl__kept_geom(tag, sh[1], hw);
    for (int64_t n = 0; n < sh[0]; n++)
        for (int64_t c = 0; c < sh[1]; c++)
            for (int64_t i = 0; i < hw; i++)
                memcpy(dst + (n * gm.ns + c / 16 * gm.cs + i * gm.ps + c % 16) * es,
                       src + ((n * sh[1] + c) * hw + i) * es, es);
    kpl__storage_set_kept(k, tag);
    return k;
}

/* Batch norm (and + ReLU) forward and backward on activations held in
 * nChw16c and NHWC against the plain kernels, bit for bit: f32 and bf16
 * (the vector sums) and f16, rows under 8 values, of 15, 16, 49 and 99
 * (spans of 64 pixels and a tail), 16, 32, 48 and 144 channels (a task's
 * several blocks). */
static void test_bn_kept_same_bits(void **state)
{
    (void)state;
    bool prev = kpl_set_blocked_layouts(true);
    const kpl_dtype dts[3] = {KPL_F32, KPL_BF16, KPL_F16};
    const int64_t shapes[5][4] = {{3, 32, 2, 3}, {2, 48, 7, 7}, {5, 16, 4, 4}, {2, 16, 9, 11},
                                  {2, 144, 3, 5}};
    const kpl_kept tags[2] = {KPL_KEPT_NC16, KPL_KEPT_NHWC};
    for (int di = 0; di < 3; di++)
        for (int si = 0; si < 5; si++)
            for (int ti = 0; ti < 2; ti++)
                for (int relu = 0; relu < 2; relu++) {
                    kpl_dtype dt = dts[di];
                    const int64_t *xs = shapes[si];
                    int64_t c = xs[1];
                    char ctx[96];
                    snprintf(ctx, sizeof ctx, "%s (%lld,%lld,%lld,%lld) %s%s",
                             kpl_dtype_name(dt), (long long)xs[0], (long long)xs[1],
                             (long long)xs[2], (long long)xs[3],
                             tags[ti] == KPL_KEPT_NHWC ? "NHWC" : "nChw16c", relu ? " relu" : "");
                    kpl_tensor *x = trand(dt, 4, xs, 41 + si, -1, 3);
                    kpl_tensor *gy = trand(dt, 4, xs, 42, -1, 1);
                    kpl_tensor *g = trand(KPL_F32, 1, &c, 43, 0.5, 1.5);
                    kpl_tensor *b = trand(KPL_F32, 1, &c, 44, -1, 1);
                    if (si == 3) { /* a NaN with a payload in gy: its channel's NaNs match */
                        char *p = kpl_tensor_host_mutable(gy);
                        if (dt == KPL_F32)
                            memcpy(p + 5 * 4, &(uint32_t){0x7fc00123u}, 4);
                        else
                            memcpy(p + 5 * 2, &(uint16_t){dt == KPL_BF16 ? 0x7fc2 : 0x7e02}, 2);
                    }
                    kpl_tensor *xk = kept_copy(x, tags[ti]), *gyk = kept_copy(gy, tags[ti]);
                    kpl_tensor *yp = tnew(dt, 4, xs), *yk = tnew(dt, 4, xs);
                    if (relu) {
                        OK(kpl_k_batch_norm_relu(yp, NULL, NULL, x, g, b, 1e-5));
                        OK(kpl_k_batch_norm_relu(yk, NULL, NULL, xk, g, b, 1e-5));
                    } else {
                        OK(kpl_k_batch_norm(yp, NULL, NULL, x, g, b, 1e-5));
                        OK(kpl_k_batch_norm(yk, NULL, NULL, xk, g, b, 1e-5));
                    }
                    if (kpl__kept(yk) != tags[ti])
                        fail_msg("%s: the forward's output is not held kept", ctx);
                    bn_grads gp = bwd(x, relu ? yp : NULL, gy, g);
                    /* the kept side twice: with the forward's statistics, and
                     * computing them (a copy of x in the layout) */
                    bn_grads gk = bwd(xk, relu ? yk : NULL, gyk, g);
                    if (kpl__kept(gk.gx) != tags[ti])
                        fail_msg("%s: the input gradient is not held kept", ctx);
                    kpl_tensor *xk2 = kept_copy(x, tags[ti]);
                    bn_grads gk2 = bwd(xk2, relu ? yk : NULL, gyk, g);
                    same(yk, yp, "y", ctx);
                    same(gk2.gx, gp.gx, "gx (statistics computed)", ctx);
                    same(gk2.gg, gp.gg, "ggamma (statistics computed)", ctx);
                    same(gk2.gb, gp.gb, "gbeta (statistics computed)", ctx);
                    same_grads(gk, gp, ctx);
                    kpl_tensor *ts[] = {x, gy, g, b, xk, gyk, yp, yk, xk2, gk2.gx, gk2.gg, gk2.gb};
                    for (int i = 0; i < 12; i++) kpl_tensor_release(ts[i]);
                }
    kpl_set_blocked_layouts(prev);
}

int run_bn_saved_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bn_saved_statistics),
        cmocka_unit_test(test_bn_kept_same_bits),
    };
    return cmocka_run_group_tests_name("bn_saved", tests, NULL, NULL);
}
