/* test_cuda_mixed.c — mixed precision, TF32 and determinism on the GPU,
 * against the CPU: loss-scale unscaling, f16/bf16 GEMMs and convolutions
 * (the kernels themselves, reached through the registry), strided-batched
 * GEMMs, TF32 on and off, and the deterministic algorithms and sums. */
#include "test_cuda_util.h"

/* Sets element i of a float tensor (host) to +inf (kind 1), -inf (2) or
 * NaN (3) in its own dtype's bits. */
static void set_special(kpl_tensor *t, int64_t i, int kind)
{
    void *p = kpl_tensor_host_mutable(t);
    double v = kind == 1 ? INFINITY : kind == 2 ? -INFINITY : NAN;
    switch (kpl_tensor_dtype(t)) {
    case KPL_F32: ((float *)p)[i] = (float)v; break;
    case KPL_F64: ((double *)p)[i] = v; break;
    case KPL_F16: ((uint16_t *)p)[i] = kind == 1 ? 0x7c00 : kind == 2 ? 0xfc00 : 0x7e00; break;
    default: ((uint16_t *)p)[i] = kind == 1 ? 0x7f80 : kind == 2 ? 0xff80 : 0x7fc0; break;
    }
}

/* kpl_k_amp_unscale on the GPU gives the CPU's bits and flag: every float
 * dtype, no special value or one of each kind deep in a tensor long
 * enough for several grid-stride passes, an inexact scale; the flag is
 * never lowered; and found_inf must live on g's device. */
static void test_amp_unscale_gpu(void **state)
{
    (void)state;
    const int64_t n = ((int64_t)1 << 22) + 77, one = 1;
    const kpl_dtype dts[4] = {KPL_F32, KPL_F16, KPL_BF16, KPL_F64};
    const int64_t where[4] = {0, n - 3, 5, n / 2};
    for (int d = 0; d < 4; d++) {
        for (int kind = 0; kind < 4; kind++) {
            kpl_tensor *src = trand(KPL_F64, 1, &n, 200 + d, -3000, 3000);
            kpl_tensor *g = tnew(dts[d], 1, &n), *f = tnew(KPL_F32, 1, &one);
            OK(kpl_k_cast(g, src));
            if (kind) set_special(g, where[kind], kind);
            OK(kpl_k_fill(f, 0));
            kpl_tensor *gg = to_gpu(g), *gf = to_gpu(f);
            double inv = kind % 2 ? 0.37 : 1.0 / 65536;
            OK(kpl_k_amp_unscale(g, inv, f));
            OK(kpl_k_amp_unscale(gg, inv, gf));
            /* exact values; a NaN's payload may differ (CUDA's canonical NaN) */
            assert_same(gg, g, 0, 0, "amp_unscale");
            assert_bits(gf, f, "amp_unscale found_inf");
            assert_float_equal(tget(f, 0), kind ? 1 : 0, 0);
            /* a later clean gradient leaves a raised flag raised */
            kpl_tensor *clean = to_gpu(src), *cg = gnew(dts[d], 1, &n);
            OK(kpl_k_cast(cg, clean));
            OK(kpl_k_amp_unscale(cg, 0.5, gf));
            assert_float_equal(tget(gf, 0), kind ? 1 : 0, 0);
            RELEASE(src, g, f, gg, gf, clean, cg);
        }
    }
    if (on_cuda()) {
        kpl_tensor *g = gnew(KPL_F32, 1, &n), *f = tnew(KPL_F32, 1, &one);
        FAILS(kpl_k_amp_unscale(g, 0.5, f), KPL_EDEVICE,
              "amp_unscale: 'found_inf' is on cpu but 'g' is on cuda:0");
        RELEASE(g, f);
    }
}

/* The attributes ops_matmul.c would make for (B?, M, K) @ (B?, K, N) products
 * with 3-D dims as stored. */
static kpl_matmul_attrs mm_attrs(const int64_t *ad, const int64_t *bd, const int64_t *od, bool ta,
                                 bool tb)
{
    kpl_matmul_attrs at;
    memset(&at, 0, sizeof at);
    at.ndim = 3;
    at.trans_a = ta;
    at.trans_b = tb;
    memcpy(at.a_dims, ad, 3 * sizeof *ad);
    memcpy(at.b_dims, bd, 3 * sizeof *bd);
    memcpy(at.out_dims, od, 3 * sizeof *od);
    return at;
}

/* Strided-batched GEMMs (batch > 1, a broadcast operand, transposes) in
 * f32, then the f16 and bf16 GEMM kernels against the CPU's f32 product
 * of the same (rounded) inputs, rounded once: within one unit in the last
 * place of the format (the sums' order differs). */
static void test_matmul_batched_half(void **state)
{
    (void)state;
    const int64_t B = 5, M = 33, K = 17, N = 29;
    for (int t = 0; t < 4; t++) {
        bool ta = t & 1, tb = t & 2;
        int64_t sa[3] = {B, ta ? K : M, ta ? M : K}, sb[3] = {B, tb ? N : K, tb ? K : N};
        int64_t so[3] = {B, M, N};
        kpl_tensor *a = trand(KPL_F32, 3, sa, 210 + t, -1, 1), *b = trand(KPL_F32, 3, sb, 214 + t, -1, 1);
        kpl_tensor *ga = to_gpu(a), *gb = to_gpu(b), *c = tnew(KPL_F32, 3, so), *gc = gnew(KPL_F32, 3, so);
        OK(kpl_k_matmul(c, a, b, ta, tb));
        OK(kpl_k_matmul(gc, ga, gb, ta, tb));
        assert_same(gc, c, 1e-5, 1e-5, "strided-batched matmul");
        /* b broadcast over the batch: a 2-D operand, stride 0 */
        kpl_tensor *b2 = NULL, *gb2 = NULL;
        OK(kpl_tensor_narrow(b, 0, 1, &b2));
        OK(kpl_tensor_squeeze(b2, 0, &gb2));
        kpl_tensor *b2d = NULL;
        OK(kpl_tensor_to_device(gb2, kpl_device_cpu(), &b2d));
        kpl_tensor *gb2d = to_gpu(b2d);
        OK(kpl_k_matmul(c, a, b2d, ta, tb));
        OK(kpl_k_matmul(gc, ga, gb2d, ta, tb));
        assert_same(gc, c, 1e-5, 1e-5, "batched matmul, broadcast b");
        RELEASE(a, b, ga, gb, c, gc, b2, gb2, b2d, gb2d);
    }
    const kpl_dtype hdt[2] = {KPL_F16, KPL_BF16};
    for (int h = 0; h < 2; h++) {
        kpl_dtype dt = hdt[h];
        double ulp = dt == KPL_F16 ? 1.0 / 1024 : 1.0 / 128;
        for (int t = 0; t < 4; t++) {
            bool ta = t & 1, tb = t & 2;
            const int64_t hb = 4, hm = 40, hk = 24, hn = 36;
            int64_t sa[3] = {hb, ta ? hk : hm, ta ? hm : hk}, sb[3] = {hb, tb ? hn : hk, tb ? hk : hn};
            int64_t so[3] = {hb, hm, hn};
            kpl_tensor *a32 = trand(KPL_F32, 3, sa, 220 + t, -1, 1);
            kpl_tensor *b32 = trand(KPL_F32, 3, sb, 224 + t, -1, 1);
            kpl_tensor *ah, *ab, *bh, *bb;
            half_pair(a32, dt, &ah, &ab);
            half_pair(b32, dt, &bh, &bb);
            kpl_tensor *ref = tnew(KPL_F32, 3, so), *refh = tnew(dt, 3, so);
            OK(kpl_k_matmul(ref, ab, bb, ta, tb));
            OK(kpl_k_cast(refh, ref));
            kpl_tensor *gah = to_gpu(ah), *gbh = to_gpu(bh), *gch = gnew(dt, 3, so);
            kpl_matmul_attrs at = mm_attrs(sa, sb, so, ta, tb);
            if (on_cuda()) { /* the CPU has no half GEMM kernel */
                OK(run_kernel(KPL_KOP_MATMUL, dt, gch, gah, gbh, NULL, &at));
                assert_same(gch, refh, ulp, 2 * ulp,
                            dt == KPL_F16 ? "f16 matmul kernel" : "bf16 matmul kernel");
            }
            /* and through the front end, whichever way it routes halves */
            OK(kpl_k_matmul(gch, gah, gbh, ta, tb));
            assert_same(gch, refh, ulp, 2 * ulp, "half matmul through kpl_k_matmul");
            RELEASE(a32, b32, ah, ab, bh, bb, ref, refh, gah, gbh, gch);
        }
    }
}

/* TF32: off, f32 GEMMs and convolutions match the CPU to f32 rounding; on,
 * to TF32's (10-bit mantissa products, f32 sums). */
static void test_tf32(void **state)
{
    (void)state;
    assert_false(kpl_get_tf32()); /* the default */
    int64_t sa[2] = {128, 256}, sb[2] = {256, 96}, sc[2] = {128, 96};
    kpl_tensor *a = trand(KPL_F32, 2, sa, 230, -1, 1), *b = trand(KPL_F32, 2, sb, 231, -1, 1);
    kpl_tensor *ga = to_gpu(a), *gb = to_gpu(b), *c = tnew(KPL_F32, 2, sc), *gc = gnew(KPL_F32, 2, sc);
    OK(kpl_k_matmul(c, a, b, false, false));
    int64_t xs[4] = {2, 16, 14, 14}, ws[4] = {32, 16, 3, 3}, ys[4];
    kpl_conv2d_params p = {{1, 1}, {1, 1}, {1, 1}, 1};
    OK(kpl_shape_conv2d(xs, ws, &p, ys));
    kpl_tensor *x = trand(KPL_F32, 4, xs, 232, -1, 1), *w = trand(KPL_F32, 4, ws, 233, -1, 1);
    kpl_tensor *gx = to_gpu(x), *gw = to_gpu(w), *y = tnew(KPL_F32, 4, ys), *gy = gnew(KPL_F32, 4, ys);
    OK(kpl_k_conv2d(y, x, w, NULL, &p));
    for (int on = 1; on >= 0; on--) { /* on first: then the off run needs its own key */
        kpl_set_tf32(on);
        assert_int_equal(kpl_get_tf32(), on);
        /* sums of 256 (GEMM) and 144 (conv) products of values in [-1, 1]:
         * TF32 rounds each factor to ~5e-4 relative */
        double tol = on ? 3e-2 : 2e-5;
        OK(kpl_k_matmul(gc, ga, gb, false, false));
        assert_same(gc, c, tol, tol, on ? "matmul, TF32" : "matmul, TF32 off");
        OK(kpl_k_conv2d(gy, gx, gw, NULL, &p));
        assert_same(gy, y, tol, tol, on ? "conv2d, TF32" : "conv2d, TF32 off");
    }
    assert_false(kpl_get_tf32());
    RELEASE(a, b, ga, gb, c, gc, x, w, gx, gw, y, gy);
}

/* The three f16/bf16 convolution kernels (grouped, with bias) against the
 * CPU's f32 convolution of the same rounded inputs, rounded once; the
 * forward's bias is added after a first rounding, hence two units. */
static void test_conv_half(void **state)
{
    (void)state;
    int64_t xs[4] = {2, 8, 12, 12}, ws[4] = {16, 4, 3, 3}, ys[4], c16 = 16;
    kpl_conv2d_params p = {{1, 1}, {1, 1}, {1, 1}, 2};
    OK(kpl_shape_conv2d(xs, ws, &p, ys));
    kpl_conv_attrs at;
    memset(&at, 0, sizeof at);
    at.n = xs[0], at.c = xs[1], at.h = xs[2], at.w = xs[3];
    at.o = ws[0], at.kh = ws[2], at.kw = ws[3], at.oh = ys[2], at.ow = ys[3];
    at.p = p;
    kpl_tensor *x32 = trand(KPL_F32, 4, xs, 240, -1, 1), *w32 = trand(KPL_F32, 4, ws, 241, -1, 1);
    kpl_tensor *b32 = trand(KPL_F32, 1, &c16, 242, -1, 1), *gy32 = trand(KPL_F32, 4, ys, 243, -1, 1);
    const kpl_dtype hdt[2] = {KPL_F16, KPL_BF16};
    for (int h = 0; h < 2; h++) {
        kpl_dtype dt = hdt[h];
        double ulp = dt == KPL_F16 ? 1.0 / 1024 : 1.0 / 128;
        kpl_tensor *xh, *xb, *wh, *wb, *bh, *bb, *gyh, *gyb;
        half_pair(x32, dt, &xh, &xb);
        half_pair(w32, dt, &wh, &wb);
        half_pair(b32, dt, &bh, &bb);
        half_pair(gy32, dt, &gyh, &gyb);
        kpl_tensor *gxh = to_gpu(xh), *gwh = to_gpu(wh), *gbh = to_gpu(bh), *ggyh = to_gpu(gyh);
        /* references: f32 on the CPU, rounded to the half dtype */
        kpl_tensor *y = tnew(KPL_F32, 4, ys), *dx = tnew(KPL_F32, 4, xs), *dw = tnew(KPL_F32, 4, ws);
        kpl_tensor *db = tnew(KPL_F32, 1, &c16);
        OK(kpl_k_conv2d(y, xb, wb, bb, &p));
        OK(kpl_k_conv2d_bwd_data(dx, gyb, wb, &p));
        OK(kpl_k_conv2d_bwd_weight(dw, db, xb, gyb, &p));
        kpl_tensor *yh = tnew(dt, 4, ys), *dxh = tnew(dt, 4, xs), *dwh = tnew(dt, 4, ws);
        kpl_tensor *dbh = tnew(dt, 1, &c16);
        OK(kpl_k_cast(yh, y));
        OK(kpl_k_cast(dxh, dx));
        OK(kpl_k_cast(dwh, dw));
        OK(kpl_k_cast(dbh, db));
        kpl_tensor *gy = gnew(dt, 4, ys), *gdx = gnew(dt, 4, xs), *gdw = gnew(dt, 4, ws);
        kpl_tensor *gdb = gnew(dt, 1, &c16);
        /* the CPU has no half convolution kernel: the dry run stops here */
        for (int rep = 0; rep < 2 && on_cuda(); rep++) { /* the second time from the cache */
            at.kind = KPL_CONV_FWD;
            OK(run_kernel(KPL_KOP_CONV2D, dt, gy, gxh, gwh, gbh, &at));
            assert_same(gy, yh, 2 * ulp, 4 * ulp, "half conv2d forward");
            at.kind = KPL_CONV_BWD_DATA;
            OK(run_kernel(KPL_KOP_CONV2D, dt, gdx, ggyh, gwh, NULL, &at));
            assert_same(gdx, dxh, ulp, 2 * ulp, "half conv2d bwd_data");
            at.kind = KPL_CONV_BWD_WEIGHT;
            OK(run_kernel(KPL_KOP_CONV2D, dt, gdw, gxh, ggyh, gdb, &at));
            /* sums of 2 x 144 products: a few f32 ulps before the rounding */
            assert_same(gdw, dwh, ulp, 8 * ulp, "half conv2d bwd_weight");
            assert_same(gdb, dbh, ulp, 8 * ulp, "half conv2d bias gradient");
        }
        RELEASE(xh, xb, wh, wb, bh, bb, gyh, gyb, gxh, gwh, gbh, ggyh, y, dx, dw, db, yh, dxh, dwh,
                dbh, gy, gdx, gdw, gdb);
    }
    RELEASE(x32, w32, b32, gy32);
}

/* Deterministic mode: convolutions chosen without timing repeat their
 * bits; the gather-form adjoints (plane_scatter, index_add, scatter_add)
 * add in the CPU's order and so give the CPU's bits, long runs of one
 * target included; back in the default mode the atomic adjoints agree to
 * rounding. */
static void test_deterministic(void **state)
{
    (void)state;
    kpl_set_deterministic(true);
    int64_t xs[4] = {4, 16, 20, 20}, ws[4] = {32, 16, 3, 3}, ys[4];
    kpl_conv2d_params p = {{1, 1}, {1, 1}, {1, 1}, 1};
    OK(kpl_shape_conv2d(xs, ws, &p, ys));
    kpl_tensor *x = trand(KPL_F32, 4, xs, 250, -1, 1), *w = trand(KPL_F32, 4, ws, 251, -1, 1);
    kpl_tensor *dy = trand(KPL_F32, 4, ys, 252, -1, 1);
    kpl_tensor *gx = to_gpu(x), *gw = to_gpu(w), *gdy = to_gpu(dy);
    kpl_tensor *y = tnew(KPL_F32, 4, ys), *dx = tnew(KPL_F32, 4, xs), *dw = tnew(KPL_F32, 4, ws);
    OK(kpl_k_conv2d(y, x, w, NULL, &p));
    OK(kpl_k_conv2d_bwd_data(dx, dy, w, &p));
    OK(kpl_k_conv2d_bwd_weight(dw, NULL, x, dy, &p));
    kpl_tensor *r[2][3];
    for (int run = 0; run < 2; run++) {
        r[run][0] = gnew(KPL_F32, 4, ys);
        r[run][1] = gnew(KPL_F32, 4, xs);
        r[run][2] = gnew(KPL_F32, 4, ws);
        OK(kpl_k_conv2d(r[run][0], gx, gw, NULL, &p));
        OK(kpl_k_conv2d_bwd_data(r[run][1], gdy, gw, &p));
        OK(kpl_k_conv2d_bwd_weight(r[run][2], NULL, gx, gdy, &p));
    }
    for (int k = 0; k < 3; k++) {
        kpl_tensor *h = to_cpu(r[0][k]);
        assert_bits(r[1][k], h, "deterministic conv2d, run to run");
        kpl_tensor_release(h);
    }
    assert_same(r[0][0], y, 1e-4, 1e-4, "deterministic conv2d forward");
    assert_same(r[0][1], dx, 1e-4, 1e-4, "deterministic conv2d bwd_data");
    assert_same(r[0][2], dw, 1e-4, 1e-3, "deterministic conv2d bwd_weight");

    /* max pooling's adjoint over overlapping windows */
    int64_t ps[4] = {2, 3, 17, 19}, pys[4];
    kpl_pool2d_params mp = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
    OK(kpl_shape_pool2d(ps, &mp, pys));
    kpl_tensor *px = trand(KPL_F32, 4, ps, 253, -1, 1), *pgy = trand(KPL_F32, 4, pys, 254, -1, 1);
    kpl_tensor *py = tnew(KPL_F32, 4, pys), *pi = tnew(KPL_I64, 4, pys), *pgx = tnew(KPL_F32, 4, ps);
    OK(kpl_k_max_pool2d(py, pi, px, &mp));
    OK(kpl_k_plane_scatter(pgx, pgy, pi));
    kpl_tensor *gpgy = to_gpu(pgy), *gpi = to_gpu(pi), *gpgx = gnew(KPL_F32, 4, ps);
    OK(kpl_k_plane_scatter(gpgx, gpgy, gpi));
    assert_bits(gpgx, pgx, "deterministic plane_scatter");
    /* runs of ~133 outputs on one cell (the long-run sort) */
    int64_t ls[4] = {1, 2, 3, 3}, lys[4] = {1, 2, 20, 20};
    kpl_tensor *lgy = trand(KPL_F64, 4, lys, 255, -1, 1), *li = tnew(KPL_I64, 4, lys);
    int64_t *lv = kpl_tensor_host_mutable(li);
    for (int64_t i = 0; i < 800; i++) lv[i] = (i * 7) % 3 + 3 * (i % 2);
    kpl_tensor *lgx = tnew(KPL_F64, 4, ls), *glgy = to_gpu(lgy), *gli = to_gpu(li);
    kpl_tensor *glgx = gnew(KPL_F64, 4, ls);
    OK(kpl_k_plane_scatter(lgx, lgy, li));
    OK(kpl_k_plane_scatter(glgx, glgy, gli));
    assert_bits(glgx, lgx, "deterministic plane_scatter, long runs");

    /* index_add (always gathered) and scatter_add along axis 1 */
    int64_t gs[3] = {3, 50, 5}, os[3] = {3, 9, 5}, k50 = 50;
    kpl_tensor *g = trand(KPL_F32, 3, gs, 256, -1, 1), *idx = tnew(KPL_I64, 1, &k50);
    int64_t *iv = kpl_tensor_host_mutable(idx);
    for (int64_t i = 0; i < 50; i++) iv[i] = i < 20 ? 4 : (i * 5) % 9; /* a heavy row 4 */
    kpl_tensor *o = tnew(KPL_F32, 3, os), *gg = to_gpu(g), *gidx = to_gpu(idx);
    kpl_tensor *go = gnew(KPL_F32, 3, os);
    OK(kpl_k_index_add(o, g, 1, idx));
    OK(kpl_k_index_add(go, gg, 1, gidx));
    assert_bits(go, o, "index_add");
    int64_t sxs[3] = {3, 7, 5}, sis[3] = {3, 40, 5};
    kpl_tensor *sx = trand(KPL_F32, 3, sxs, 257, -1, 1), *src = trand(KPL_F32, 3, sis, 258, -1, 1);
    kpl_tensor *si = tnew(KPL_I64, 3, sis), *so = tnew(KPL_F32, 3, sxs);
    int64_t *sv = kpl_tensor_host_mutable(si);
    for (int64_t i = 0; i < 600; i++) sv[i] = (i * 11 + i / 7) % 7;
    kpl_tensor *gsx = to_gpu(sx), *gsrc = to_gpu(src), *gsi = to_gpu(si), *gso = gnew(KPL_F32, 3, sxs);
    OK(kpl_k_scatter_add(so, sx, 1, si, src));
    OK(kpl_k_scatter_add(gso, gsx, 1, gsi, gsrc));
    assert_bits(gso, so, "deterministic scatter_add");

    kpl_set_deterministic(false);
    OK(kpl_k_plane_scatter(gpgx, gpgy, gpi));
    assert_same(gpgx, pgx, 1e-6, 1e-6, "plane_scatter (atomics)");
    OK(kpl_k_scatter_add(gso, gsx, 1, gsi, gsrc));
    assert_same(gso, so, 1e-6, 1e-6, "scatter_add (atomics)");
    OK(kpl_k_index_add(go, gg, 1, gidx));
    assert_bits(go, o, "index_add, default mode");
    RELEASE(x, w, dy, gx, gw, gdy, y, dx, dw, r[0][0], r[0][1], r[0][2], r[1][0], r[1][1], r[1][2],
            px, pgy, py, pi, pgx, gpgy, gpi, gpgx, lgy, li, lgx, glgy, gli, glgx, g, idx, o, gg,
            gidx, go, sx, src, si, so, gsx, gsrc, gsi, gso);
}

int run_cuda_mixed_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_amp_unscale_gpu),
        cmocka_unit_test(test_matmul_batched_half),
        cmocka_unit_test(test_tf32),
        cmocka_unit_test(test_conv_half),
        cmocka_unit_test(test_deterministic),
    };
    return RUN_GROUP("cuda mixed precision", tests);
}
