/* test_cuda.c — every kernel family on cuda:0 against the CPU kernels, with
 * the same inputs.  Label `cuda`: exits 77 (skipped) where no GPU is found.
 * The groups of test_cuda_mixed.c (mixed precision, TF32, determinism) and
 * test_cuda_memory.c (transfers, ordering, deferred index errors, large
 * tensors) run from main here.  KPL_TEST_CUDA_DRYRUN=1 runs everything with
 * the CPU standing in for the GPU (test_cuda_util.h). */
#include "test_cuda_util.h"

kpl_device *gpu;

static void test_random_identical(void **state)
{
    (void)state;
    int64_t n = 10007;
    kpl_dtype dts[3] = {KPL_F32, KPL_F64, KPL_BF16};
    for (int d = 0; d < 3; d++) {
        kpl_tensor *c = tnew(dts[d], 1, &n), *g = NULL;
        OK(kpl_tensor_empty(gpu, dts[d], 1, &n, &g));
        kpl_rng *r1 = kpl_rng_create(5), *r2 = kpl_rng_create(5);
        OK(kpl_k_uniform(c, r1, -2, 3));
        OK(kpl_k_uniform(g, r2, -2, 3));
        assert_same(g, c, 0, 0, "uniform"); /* bit-identical */
        OK(kpl_k_normal(c, r1, 1, 2));
        OK(kpl_k_normal(g, r2, 1, 2));
        assert_int_equal(kpl_rng_offset(r1), kpl_rng_offset(r2));
        /* log/sin/cos differ in their last ulps between devices; a bf16
         * value may then round to the neighbouring bf16. */
        double nr = dts[d] == KPL_F64 ? 1e-12 : dts[d] == KPL_F32 ? 1e-5 : 1e-2;
        assert_same(g, c, nr, nr * 0.1, "normal");
        kpl_rng_destroy(r1);
        kpl_rng_destroy(r2);
        kpl_tensor_release(c);
        kpl_tensor_release(g);
    }
}

static void test_unary_binary_where(void **state)
{
    (void)state;
    int64_t sa[3] = {4, 1, 300}, sb[2] = {7, 300}, so[3] = {4, 7, 300};
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = f ? KPL_F64 : KPL_F32;
        double rtol = f ? 1e-12 : 2e-6;
        kpl_tensor *a = trand(dt, 3, sa, 1, 0.1, 3), *b = trand(dt, 2, sb, 2, -3, 3);
        kpl_tensor *ga = to_gpu(a), *gb = to_gpu(b);
        kpl_tensor *o = tnew(dt, 3, so), *go = NULL;
        OK(kpl_tensor_empty(gpu, dt, 3, so, &go));
        for (int op = 0; op < KPL_BINARY_COUNT; op++) {
            if (kpl_binary_is_compare((kpl_binary_op)op)) continue;
            OK(kpl_k_binary(o, (kpl_binary_op)op, a, b));
            OK(kpl_k_binary(go, (kpl_binary_op)op, ga, gb));
            assert_same(go, o, rtol, rtol * 1e-2, kpl_binary_name((kpl_binary_op)op));
        }
        kpl_tensor *ua = tnew(dt, 3, sa), *gua = NULL;
        OK(kpl_tensor_empty(gpu, dt, 3, sa, &gua));
        for (int op = 0; op < KPL_UNARY_COUNT; op++) {
            OK(kpl_k_unary(ua, (kpl_unary_op)op, a, 0.1, 2.0));
            OK(kpl_k_unary(gua, (kpl_unary_op)op, ga, 0.1, 2.0));
            assert_same(gua, ua, f ? 1e-12 : 4e-6, f ? 1e-14 : 4e-8,
                        kpl_unary_name((kpl_unary_op)op));
        }
        /* comparisons and where */
        kpl_tensor *m = tnew(KPL_BOOL, 3, so), *gm = NULL;
        OK(kpl_tensor_empty(gpu, KPL_BOOL, 3, so, &gm));
        OK(kpl_k_binary(m, KPL_BIN_GT, a, b));
        OK(kpl_k_binary(gm, KPL_BIN_GT, ga, gb));
        assert_same(gm, m, 0, 0, "gt");
        OK(kpl_k_where(o, m, a, b));
        OK(kpl_k_where(go, gm, ga, gb));
        assert_same(go, o, 0, 0, "where");
        /* scalar forms */
        OK(kpl_k_binary_scalar(ua, KPL_BIN_SUB, a, 2.5, true));
        OK(kpl_k_binary_scalar(gua, KPL_BIN_SUB, ga, 2.5, true));
        assert_same(gua, ua, rtol, rtol * 1e-2, "rsub scalar");
        kpl_tensor *ts[] = {a, b, ga, gb, o, go, ua, gua, m, gm};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
    }
}

static void test_reduce(void **state)
{
    (void)state;
    int64_t s[3] = {5, 70, 33};
    kpl_tensor *x = trand(KPL_F32, 3, s, 3, -2, 2), *gx = to_gpu(x);
    const int axes_sets[4][2] = {{0, 0}, {1, 0}, {2, 0}, {0, 2}};
    const int naxes[4] = {1, 1, 1, 2};
    for (int op = 0; op < KPL_REDUCE_COUNT; op++)
        for (int k = 0; k < 4; k++) {
            bool arg = op == KPL_RED_ARGMAX || op == KPL_RED_ARGMIN;
            if (arg && naxes[k] != 1) continue;
            int no;
            int64_t os[3];
            OK(kpl_shape_reduce("t", 3, s, axes_sets[k], naxes[k], true, &no, os));
            kpl_tensor *o = tnew(arg ? KPL_I64 : KPL_F32, no, os), *go = NULL;
            OK(kpl_tensor_empty(gpu, arg ? KPL_I64 : KPL_F32, no, os, &go));
            OK(kpl_k_reduce(o, (kpl_reduce_op)op, x, axes_sets[k], naxes[k], true, 1));
            OK(kpl_k_reduce(go, (kpl_reduce_op)op, gx, axes_sets[k], naxes[k], true, 1));
            assert_same(go, o, arg ? 0 : 1e-5, arg ? 0 : 1e-7,
                        kpl_reduce_name((kpl_reduce_op)op));
            kpl_tensor_release(o);
            kpl_tensor_release(go);
        }
    kpl_tensor_release(x);
    kpl_tensor_release(gx);
}

static void test_matmul(void **state)
{
    (void)state;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            int64_t sa[2] = {ta ? 80 : 64, ta ? 64 : 80}, sb[2] = {tb ? 96 : 80, tb ? 80 : 96};
            int64_t sc[2] = {64, 96};
            kpl_tensor *a = trand(KPL_F32, 2, sa, 7, -1, 1), *b = trand(KPL_F32, 2, sb, 8, -1, 1);
            kpl_tensor *ga = to_gpu(a), *gb = to_gpu(b), *c = tnew(KPL_F32, 2, sc), *gc = NULL;
            OK(kpl_tensor_empty(gpu, KPL_F32, 2, sc, &gc));
            OK(kpl_k_matmul(c, a, b, ta, tb));
            OK(kpl_k_matmul(gc, ga, gb, ta, tb));
            /* Summation orders differ (cuBLAS vs oneDNN): an absolute
             * bound of a few ulps of sqrt(K)-sized partial sums. */
            assert_same(gc, c, 1e-5, 1e-5, "matmul");
            kpl_tensor *ts[] = {a, b, ga, gb, c, gc};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
        }
    /* broadcast batches: (2,1,4,3) @ (3,3,5) and a pattern needing per-matrix
     * offsets: (2,1,4,3) @ (1,3,3,5) -> (2,3,4,5) */
    int64_t sa[4] = {2, 1, 4, 3}, sb[4] = {1, 3, 3, 5}, sc[4] = {2, 3, 4, 5};
    kpl_tensor *a = trand(KPL_F64, 4, sa, 9, -1, 1), *b = trand(KPL_F64, 4, sb, 10, -1, 1);
    kpl_tensor *ga = to_gpu(a), *gb = to_gpu(b), *c = tnew(KPL_F64, 4, sc), *gc = NULL;
    OK(kpl_tensor_empty(gpu, KPL_F64, 4, sc, &gc));
    OK(kpl_k_matmul(c, a, b, false, false));
    kpl_event *e0 = NULL, *e1 = NULL;
    OK(kpl_event_create(gpu, &e0));
    OK(kpl_event_create(gpu, &e1));
    OK(kpl_event_record(e0));
    OK(kpl_k_matmul(gc, ga, gb, false, false));
    OK(kpl_event_record(e1));
    OK(kpl_event_synchronize(e1));
    bool done = false;
    OK(kpl_event_query(e1, &done));
    assert_true(done);
    double ms = -1;
    OK(kpl_event_elapsed_ms(e0, e1, &ms));
    assert_true(ms >= 0);
    kpl_event_destroy(e0);
    kpl_event_destroy(e1);
    assert_same(gc, c, 1e-12, 1e-13, "batched matmul");
    kpl_tensor *ts[] = {a, b, ga, gb, c, gc};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

static void test_fill_cast_copy_storage(void **state)
{
    (void)state;
    int64_t s[2] = {3, 1000};
    kpl_tensor *x = trand(KPL_F32, 2, s, 11, -300, 300), *gx = to_gpu(x);
    kpl_dtype dts[7] = {KPL_F16, KPL_BF16, KPL_I32, KPL_I64, KPL_U8, KPL_BOOL, KPL_F64};
    for (int d = 0; d < 7; d++) {
        kpl_tensor *c = tnew(dts[d], 2, s), *g = NULL;
        OK(kpl_tensor_empty(gpu, dts[d], 2, s, &g));
        OK(kpl_k_cast(c, x));
        OK(kpl_k_cast(g, gx));
        assert_same(g, c, 0, 0, "cast");
        OK(kpl_k_fill(c, -2.5));
        OK(kpl_k_fill(g, -2.5));
        assert_same(g, c, 0, 0, "fill");
        kpl_tensor_release(c);
        kpl_tensor_release(g);
    }
    /* permute (strided copy kernel) and arange */
    int perm[2] = {1, 0};
    kpl_tensor *p = NULL, *gp = NULL;
    OK(kpl_tensor_permute(x, perm, &p));
    OK(kpl_tensor_permute(gx, perm, &gp));
    assert_same(gp, p, 0, 0, "permute");
    kpl_tensor *ar = tnew(KPL_I64, 2, s), *gar = NULL;
    OK(kpl_tensor_empty(gpu, KPL_I64, 2, s, &gar));
    OK(kpl_k_arange(ar, 5, 3));
    OK(kpl_k_arange(gar, 5, 3));
    assert_same(gar, ar, 0, 0, "arange");
    if (!on_cuda()) { /* the rest is about two devices */
        RELEASE(x, gx, p, gp, ar, gar);
        return;
    }
    /* UnifiedMemory: a host write is seen by the next kernel, and a kernel's
     * result by the next host read. */
    float *h = kpl_tensor_host_mutable(gx);
    assert_non_null(h);
    assert_int_equal(kpl_storage_state(kpl_tensor_storage(gx)), KPL_MEM_HOST);
    h[0] = 1234.0f;
    kpl_tensor *gy = NULL;
    OK(kpl_tensor_empty(gpu, KPL_F32, 2, s, &gy));
    OK(kpl_k_unary(gy, KPL_UN_NEG, gx, 0, 0));
    assert_int_equal(kpl_storage_state(kpl_tensor_storage(gx)), KPL_MEM_SYNCED);
    assert_int_equal(kpl_storage_state(kpl_tensor_storage(gy)), KPL_MEM_DEVICE);
    assert_float_equal(tget(gy, 0), -1234.0, 0);
    assert_int_equal(kpl_storage_state(kpl_tensor_storage(gy)), KPL_MEM_SYNCED);
    /* the host copy of a storage lives while it is current, no longer: a
     * device write gives it back */
    assert_non_null(kpl_tensor_storage(gy)->host);
    OK(kpl_k_unary(gy, KPL_UN_NEG, gy, 0, 0));
    assert_int_equal(kpl_storage_state(kpl_tensor_storage(gy)), KPL_MEM_DEVICE);
    assert_null(kpl_tensor_storage(gy)->host);
    assert_float_equal(tget(gy, 0), 1234.0, 0);
    /* mixing devices is an error, not a silent copy */
    kpl_tensor *o = tnew(KPL_F32, 2, s);
    FAILS(kpl_k_binary(o, KPL_BIN_ADD, x, gx), KPL_EDEVICE, "is on cpu but 'b' is on cuda:0");
    /* out of memory on the GPU is an error with the size */
    kpl_device_set_memory_limit(gpu, kpl_device_memory_stats(gpu).reserved + (1 << 20));
    kpl_tensor *big = NULL;
    int64_t bs[1] = {(int64_t)1 << 28};
    FAILS(kpl_tensor_empty(gpu, KPL_F32, 1, bs, &big), KPL_ENOMEM, "out of memory on cuda:0");
    kpl_device_set_memory_limit(gpu, 0);
    OK(kpl_device_synchronize(gpu));
    kpl_tensor *ts[] = {x, gx, p, gp, ar, gar, gy, o};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

/* Convolutions (groups, stride, dilation, bias), batch norm, pooling and
 * index ops on the GPU against the CPU, f32 and f64. */
static void test_nn_kernels(void **state)
{
    (void)state;
    kpl_dtype dts[2] = {KPL_F32, KPL_F64};
    for (int d = 0; d < 2; d++) {
        kpl_dtype dt = dts[d];
        double tol = dt == KPL_F64 ? 1e-10 : 1e-4;
        int64_t xs[4] = {3, 4, 9, 11}, ws[4] = {6, 2, 3, 3}, c6 = 6;
        kpl_conv2d_params p = {{2, 1}, {1, 2}, {1, 2}, 2};
        int64_t ys[4];
        OK(kpl_shape_conv2d(xs, ws, &p, ys));
        kpl_tensor *x = trand(dt, 4, xs, 1, -1, 1), *w = trand(dt, 4, ws, 2, -1, 1);
        kpl_tensor *b = trand(dt, 1, &c6, 3, -1, 1), *gy = trand(dt, 4, ys, 4, -1, 1);
        kpl_tensor *gx_ = to_gpu(x), *gw_ = to_gpu(w), *gb_ = to_gpu(b), *ggy = to_gpu(gy);
        kpl_tensor *y = tnew(dt, 4, ys), *yg = NULL;
        OK(kpl_tensor_empty(gpu, dt, 4, ys, &yg));
        OK(kpl_k_conv2d(y, x, w, b, &p));
        OK(kpl_k_conv2d(yg, gx_, gw_, gb_, &p));
        assert_same(yg, y, tol, tol, "conv2d fwd");
        kpl_tensor *dx = tnew(dt, 4, xs), *dxg = NULL, *dw = tnew(dt, 4, ws), *dwg = NULL;
        kpl_tensor *db = tnew(dt, 1, &c6), *dbg = NULL;
        OK(kpl_tensor_empty(gpu, dt, 4, xs, &dxg));
        OK(kpl_tensor_empty(gpu, dt, 4, ws, &dwg));
        OK(kpl_tensor_empty(gpu, dt, 1, &c6, &dbg));
        OK(kpl_k_conv2d_bwd_data(dx, gy, w, &p));
        OK(kpl_k_conv2d_bwd_data(dxg, ggy, gw_, &p));
        assert_same(dxg, dx, tol, tol, "conv2d bwd_data");
        OK(kpl_k_conv2d_bwd_weight(dw, db, x, gy, &p));
        OK(kpl_k_conv2d_bwd_weight(dwg, dbg, gx_, ggy, &p));
        assert_same(dwg, dw, tol, tol, "conv2d bwd_weight");
        assert_same(dbg, db, tol, tol, "conv2d bias gradient");

        /* batch norm on the conv output (6 channels) */
        kpl_tensor *g6 = trand(dt, 1, &c6, 5, 0.5, 1.5), *gg6 = to_gpu(g6);
        kpl_tensor *bn = tnew(dt, 4, ys), *bng = NULL, *m = tnew(dt, 1, &c6), *mg = NULL;
        kpl_tensor *v = tnew(dt, 1, &c6), *vg = NULL;
        OK(kpl_tensor_empty(gpu, dt, 4, ys, &bng));
        OK(kpl_tensor_empty(gpu, dt, 1, &c6, &mg));
        OK(kpl_tensor_empty(gpu, dt, 1, &c6, &vg));
        OK(kpl_k_batch_norm(bn, m, v, y, g6, b, 1e-5));
        OK(kpl_k_batch_norm(bng, mg, vg, yg, gg6, gb_, 1e-5));
        assert_same(bng, bn, tol, tol, "batch_norm");
        assert_same(mg, m, tol, tol, "batch_norm mean");
        assert_same(vg, v, tol, tol, "batch_norm biased variance");
        kpl_tensor *bdx = tnew(dt, 4, ys), *bdxg = NULL, *bdg = tnew(dt, 1, &c6), *bdgg = NULL;
        OK(kpl_tensor_empty(gpu, dt, 4, ys, &bdxg));
        OK(kpl_tensor_empty(gpu, dt, 1, &c6, &bdgg));
        OK(kpl_k_batch_norm_bwd(bdx, bdg, NULL, y, gy, g6, 1e-5));
        OK(kpl_k_batch_norm_bwd(bdxg, bdgg, NULL, yg, ggy, gg6, 1e-5));
        assert_same(bdxg, bdx, 10 * tol, 10 * tol, "batch_norm_bwd gx");
        assert_same(bdgg, bdg, 10 * tol, 10 * tol, "batch_norm_bwd ggamma");
        {
            /* two values per channel: gx is ~1e-5 of the terms that cancel
             * into it, and both devices evaluate it in f64, so they agree
             * to f32 rounding */
            int64_t s2[4] = {2, 3, 1, 1}, c3 = 3;
            kpl_tensor *x2 = trand(dt, 4, s2, 7, -1, 1), *gy2 = trand(dt, 4, s2, 8, -1, 1);
            kpl_tensor *g3 = trand(dt, 1, &c3, 9, 0.5, 1.5), *dx2 = tnew(dt, 4, s2), *dx2g = NULL;
            kpl_tensor *x2g = to_gpu(x2), *gy2g = to_gpu(gy2), *g3g = to_gpu(g3), *h = NULL;
            OK(kpl_tensor_empty(gpu, dt, 4, s2, &dx2g));
            OK(kpl_k_batch_norm_bwd(dx2, NULL, NULL, x2, gy2, g3, 1e-5));
            OK(kpl_k_batch_norm_bwd(dx2g, NULL, NULL, x2g, gy2g, g3g, 1e-5));
            OK(kpl_tensor_to_device(dx2g, kpl_device_cpu(), &h));
            /* f64: the terms are ~1e5 times gx, so each device's rounding
             * of them (1e-16 relative) is ~1e-11 of gx, more in the other
             * device's summation order (the first GPU run: equal to 9
             * digits, not to 13) */
            for (int64_t i = 0; i < 6; i++)
                assert_close(tget(h, i), tget(dx2, i), 0,
                             (dt == KPL_F64 ? 1e-9 : 2.5e-7) * fabs(tget(dx2, i)),
                             "batch_norm_bwd gx, N=2 1x1", i);
            kpl_tensor *t2[] = {x2, gy2, g3, dx2, dx2g, x2g, gy2g, g3g, h};
            for (size_t i = 0; i < sizeof t2 / sizeof t2[0]; i++) kpl_tensor_release(t2[i]);
        }

        /* pooling: max with indices, the gather/scatter pair, average; the
         * second set has ceil_mode windows hanging over the 9 rows */
        const kpl_pool2d_params mps[2] = {
            {.kernel = {3, 2}, .stride = {2, 2}, .padding = {1, 1}},
            {.kernel = {2, 3}, .stride = {2, 2}, .padding = {0, 1}, .ceil_mode = true}};
        for (int set = 0; set < 2; set++) {
            kpl_pool2d_params mp = mps[set];
            int64_t ps[4];
            OK(kpl_shape_pool2d(xs, &mp, ps));
            kpl_tensor *py = tnew(dt, 4, ps), *pyg = NULL, *pi = tnew(KPL_I64, 4, ps), *pig = NULL;
            OK(kpl_tensor_empty(gpu, dt, 4, ps, &pyg));
            OK(kpl_tensor_empty(gpu, KPL_I64, 4, ps, &pig));
            OK(kpl_k_max_pool2d(py, pi, x, &mp));
            OK(kpl_k_max_pool2d(pyg, pig, gx_, &mp));
            assert_same(pyg, py, 0, 0, "max_pool2d");
            assert_same(pig, pi, 0, 0, "max_pool2d indices");
            kpl_tensor *sc = tnew(dt, 4, xs), *scg = NULL;
            OK(kpl_tensor_empty(gpu, dt, 4, xs, &scg));
            OK(kpl_k_plane_scatter(sc, py, pi));
            OK(kpl_k_plane_scatter(scg, pyg, pig));
            assert_same(scg, sc, tol, tol, "plane_scatter");
            for (int inc = 0; inc < 2; inc++) {
                mp.count_include_pad = inc;
                OK(kpl_k_avg_pool2d(py, x, &mp));
                OK(kpl_k_avg_pool2d(pyg, gx_, &mp));
                assert_same(pyg, py, tol, tol, "avg_pool2d");
                OK(kpl_k_avg_pool2d_bwd(sc, py, &mp));
                OK(kpl_k_avg_pool2d_bwd(scg, pyg, &mp));
                assert_same(scg, sc, tol, tol, "avg_pool2d_bwd");
            }
            kpl_tensor *pts[] = {py, pyg, pi, pig, sc, scg};
            for (size_t i = 0; i < sizeof pts / sizeof pts[0]; i++) kpl_tensor_release(pts[i]);
        }
        /* index_select / index_add along axis 2, with a repeated index */
        int64_t ks = 4, is[4] = {3, 4, 4, 11};
        kpl_tensor *idx = tnew(KPL_I64, 1, &ks);
        int64_t *iv = kpl_tensor_host_mutable(idx);
        iv[0] = 8, iv[1] = 0, iv[2] = 8, iv[3] = 3;
        kpl_tensor *idg = to_gpu(idx), *sel = tnew(dt, 4, is), *selg = NULL;
        OK(kpl_tensor_empty(gpu, dt, 4, is, &selg));
        OK(kpl_k_index_select(sel, x, 2, idx));
        OK(kpl_k_index_select(selg, gx_, 2, idg));
        assert_same(selg, sel, 0, 0, "index_select");
        OK(kpl_k_index_add(dx, sel, 2, idx));
        OK(kpl_k_index_add(dxg, selg, 2, idg));
        assert_same(dxg, dx, tol, tol, "index_add");
        iv[1] = 9; /* out of range: named, at the next read on CUDA */
        kpl_tensor *bad = to_gpu(idx);
        if (on_cuda()) {
            OK(kpl_k_index_select(selg, gx_, 2, bad));
            double v;
            FAILS(kpl_tensor_get(selg, 0, &v), KPL_ERANGE,
                  "index_select: index 9 at position (1) of idx is outside [0, 9)");
        } else {
            FAILS(kpl_k_index_select(selg, gx_, 2, bad), KPL_ERANGE, "outside [0, 9)");
        }
        /* gather / scatter_add: along axis 2 with idx as large as x off
         * it, then along axis 3 with idx smaller in every other dim */
        static const int64_t gis[2][4] = {{3, 4, 13, 11}, {2, 3, 5, 17}};
        for (int gc = 0; gc < 2; gc++) {
            int gax = 2 + gc;
            kpl_tensor *gi = tnew(KPL_I64, 4, gis[gc]);
            int64_t *gv = kpl_tensor_host_mutable(gi);
            for (int64_t i = 0; i < kpl_tensor_numel(gi); i++) gv[i] = (i * 7 + 3) % xs[gax];
            kpl_tensor *gig = to_gpu(gi), *gsrc = trand(dt, 4, gis[gc], 6, -1, 1);
            kpl_tensor *gsrcg = to_gpu(gsrc), *ga = tnew(dt, 4, gis[gc]), *gag = NULL;
            kpl_tensor *sa = tnew(dt, 4, xs), *sag = NULL;
            OK(kpl_tensor_empty(gpu, dt, 4, gis[gc], &gag));
            OK(kpl_tensor_empty(gpu, dt, 4, xs, &sag));
            OK(kpl_k_gather(ga, x, gax, gi));
            OK(kpl_k_gather(gag, gx_, gax, gig));
            assert_same(gag, ga, 0, 0, "gather");
            OK(kpl_k_scatter_add(sa, x, gax, gi, gsrc));
            OK(kpl_k_scatter_add(sag, gx_, gax, gig, gsrcg));
            assert_same(sag, sa, tol, tol, "scatter_add");
            gv[5] = xs[gax]; /* out of range: named with its position on both devices */
            kpl_tensor *gbad = to_gpu(gi);
            if (on_cuda()) { /* reported by the next copy to the host */
                double v;
                OK(kpl_k_gather(gag, gx_, gax, gbad));
                FAILS(kpl_tensor_get(gag, 0, &v), KPL_ERANGE, "at position (0,0,0,5) of idx");
                OK(kpl_k_scatter_add(sag, gx_, gax, gbad, gsrcg));
                FAILS(kpl_device_synchronize(gpu), KPL_ERANGE, "at position (0,0,0,5) of idx");
                OK(kpl_device_synchronize(gpu)); /* reported once */
            } else {
                FAILS(kpl_k_gather(gag, gx_, gax, gbad), KPL_ERANGE,
                      "at position (0,0,0,5) of idx");
                FAILS(kpl_k_scatter_add(sag, gx_, gax, gbad, gsrcg), KPL_ERANGE,
                      "at position (0,0,0,5) of idx");
            }
            kpl_tensor *gts[] = {gi, gig, gsrc, gsrcg, ga, gag, sa, sag, gbad};
            for (size_t i = 0; i < sizeof gts / sizeof gts[0]; i++) kpl_tensor_release(gts[i]);
        }
        kpl_tensor *all[] = {x, w, b, gy, gx_, gw_, gb_, ggy, y, yg, dx, dxg, dw, dwg, db, dbg,
                             g6, gg6, bn, bng, m, mg, v, vg, bdx, bdxg, bdg, bdgg, idx, idg,
                             sel, selg, bad};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kpl_tensor_release(all[i]);
    }
    kpl_algo_cache_stats s = kpl_algo_cache_stats_get(kpl_device_type_of(gpu));
    assert_true(s.entries >= 3); /* one algorithm per conv direction */
}

/* n boxes (n, 4) of dtype dt on a w x w field with sides in [lo, hi), from
 * a seed; every fifth box repeats an earlier one (IoU 1). */
static kpl_tensor *box_rand(kpl_dtype dt, int64_t n, uint64_t seed, double w, double lo,
                            double hi)
{
    int64_t s[2] = {n, 4};
    kpl_tensor *u = trand(KPL_F64, 2, s, seed, 0, 1), *b = tnew(dt, 2, s);
    const double *r = kpl_tensor_host_data(u);
    void *h = kpl_tensor_host_mutable(b);
    for (int64_t i = 0; i < n; i++) {
        int64_t src = i % 5 == 4 ? i / 2 : i;
        double v[4] = {r[4 * src] * w, r[4 * src + 1] * w, 0, 0};
        v[2] = v[0] + lo + r[4 * src + 2] * (hi - lo);
        v[3] = v[1] + lo + r[4 * src + 3] * (hi - lo);
        for (int k = 0; k < 4; k++) {
            if (dt == KPL_F64) ((double *)h)[4 * i + k] = v[k];
            else ((float *)h)[4 * i + k] = (float)v[k];
        }
    }
    kpl_tensor_release(u);
    return b;
}

/* Box IoU / GIoU (pairwise and matched) and NMS (one class and per class)
 * on the GPU against the CPU: the same formula without FMAs, so the same
 * bits, and the same visiting order, so the same kept boxes. */
static void test_box_kernels(void **state)
{
    (void)state;
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = f ? KPL_F64 : KPL_F32;
        kpl_tensor *a = box_rand(dt, 300, 1, 50, 0, 20), *b = box_rand(dt, 77, 2, 50, 0, 20);
        kpl_tensor *ga = to_gpu(a), *gb = to_gpu(b), *b300 = box_rand(dt, 300, 3, 50, 0, 20);
        kpl_tensor *gb300 = to_gpu(b300);
        int64_t ps[2] = {300, 77}, ms = 300;
        for (int m = 0; m < 2; m++) {
            kpl_box_metric metric = m ? KPL_BOX_GIOU : KPL_BOX_IOU;
            kpl_tensor *o = tnew(dt, 2, ps), *go = NULL, *mo = tnew(dt, 1, &ms), *gmo = NULL;
            OK(kpl_tensor_empty(gpu, dt, 2, ps, &go));
            OK(kpl_tensor_empty(gpu, dt, 1, &ms, &gmo));
            OK(kpl_k_box_iou(o, a, b, metric, true));
            OK(kpl_k_box_iou(go, ga, gb, metric, true));
            assert_same(go, o, 0, 0, m ? "generalized_box_iou" : "box_iou");
            OK(kpl_k_box_iou(mo, a, b300, metric, false));
            OK(kpl_k_box_iou(gmo, ga, gb300, metric, false));
            assert_same(gmo, mo, 0, 0, "matched pairs");
            kpl_tensor *ts[] = {o, go, mo, gmo};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
        }
        kpl_tensor *ts[] = {a, b, ga, gb, b300, gb300};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
    }
    /* NMS: scores on 16 levels (ties), 4 classes; 100003 boxes make the
     * GPU build its mask in several row blocks. */
    static const int64_t ns[3] = {1, 1000, 100003};
    for (int c = 0; c < 3; c++) {
        /* the dry run's "GPU" is the CPU's quadratic loop again: a few
         * minutes under ASan for the large case, which is about the GPU;
         * KPL_TEST_SMALL=1 keeps it small on the GPU too (compute-sanitizer's
         * racecheck takes minutes over the large one) */
        const char *small = getenv("KPL_TEST_SMALL");
        int64_t n = (on_cuda() && !(small && !strcmp(small, "1"))) || c < 2 ? ns[c] : 3001;
        kpl_dtype dt = c == 1 ? KPL_F64 : KPL_F32;
        kpl_tensor *bx = box_rand(dt, n, 10 + c, 300, 2, 40), *sc = trand(dt, 1, &n, 20 + c, 0, 1);
        kpl_tensor *cl = tnew(KPL_I64, 1, &n);
        void *sv = kpl_tensor_host_mutable(sc);
        int64_t *cv = kpl_tensor_host_mutable(cl);
        for (int64_t i = 0; i < n; i++) {
            double v = dt == KPL_F64 ? ((double *)sv)[i] : ((float *)sv)[i];
            v = (double)(int)(v * 16) / 16;
            if (i == n / 2) v = NAN; /* ranked first on both */
            if (dt == KPL_F64) ((double *)sv)[i] = v;
            else ((float *)sv)[i] = (float)v;
            cv[i] = (i * 7) % 4 - 1;
        }
        kpl_tensor *gbx = to_gpu(bx), *gsc = to_gpu(sc), *gcl = to_gpu(cl);
        kpl_tensor *keep = tnew(KPL_I64, 1, &n), *gkeep = NULL;
        OK(kpl_tensor_empty(gpu, KPL_I64, 1, &n, &gkeep));
        for (int t = 0; t < 3; t++) {
            double thr = t * 0.35;
            for (int batched = 0; batched < 2; batched++) {
                int64_t k = -1, gk = -2;
                OK(kpl_k_nms(keep, &k, bx, sc, batched ? cl : NULL, thr));
                OK(kpl_k_nms(gkeep, &gk, gbx, gsc, batched ? gcl : NULL, thr));
                assert_int_equal(gk, k);
                kpl_tensor *h = NULL;
                OK(kpl_tensor_to_device(gkeep, kpl_device_cpu(), &h));
                const int64_t *hk = kpl_tensor_host_data(h), *ck = kpl_tensor_host_data(keep);
                for (int64_t i = 0; i < k; i++)
                    if (hk[i] != ck[i])
                        fail_msg("nms n %lld thr %g batched %d: keep[%lld] %lld on the GPU, "
                                 "%lld on the CPU", (long long)n, thr, batched, (long long)i,
                                 (long long)hk[i], (long long)ck[i]);
                kpl_tensor_release(h);
            }
        }
        /* a bad box is named on the GPU too */
        void *bv = kpl_tensor_host_mutable(bx);
        if (dt == KPL_F64) ((double *)bv)[2] = -1;
        else ((float *)bv)[2] = -1;
        kpl_tensor *gbad = to_gpu(bx);
        int64_t k = 0;
        FAILS(kpl_k_nms(gkeep, &k, gbad, gsc, NULL, 0.5), KPL_EINVAL,
              "nms: 'boxes' row 0 (");
        kpl_tensor *ts[] = {bx, sc, cl, gbx, gsc, gcl, keep, gkeep, gbad};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
    }
}

/* ROI Align on the GPU against the CPU: the forward takes the same steps
 * in the same order without FMA (the same bits); the backward adds with
 * atomics in no fixed order (f32 to a few ulps of the sums).  Rois inside,
 * across the border and outside the map, large ones under the adaptive
 * grid, both alignments. */
static void test_roi_align_kernels(void **state)
{
    (void)state;
    const int64_t k = 60, xs[4] = {2, 3, 17, 23};
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = f ? KPL_F64 : KPL_F32;
        kpl_tensor *x = trand(dt, 4, xs, 30 + f, -1, 1), *gx = to_gpu(x);
        kpl_tensor *u = trand(KPL_F64, 2, (int64_t[]){k, 4}, 40 + f, 0, 1);
        kpl_tensor *rois = tnew(dt, 2, (int64_t[]){k, 5});
        const double *uv = kpl_tensor_host_data(u);
        void *rv = kpl_tensor_host_mutable(rois);
        for (int64_t i = 0; i < k; i++) {
            /* image coordinates: the map is 17 x 23 at scale 1/2 or 1 */
            double x0 = uv[4 * i] * 60 - 10, y0 = uv[4 * i + 1] * 44 - 8;
            double r[5] = {(double)(i % 2), x0, y0, x0 + uv[4 * i + 2] * 40,
                           y0 + uv[4 * i + 3] * 30};
            for (int c = 0; c < 5; c++) {
                if (dt == KPL_F64) ((double *)rv)[5 * i + c] = r[c];
                else ((float *)rv)[5 * i + c] = (float)r[c];
            }
        }
        kpl_tensor *grois = to_gpu(rois);
        for (int cfg = 0; cfg < 4; cfg++) {
            kpl_roi_align_params p = {3 + cfg % 2, 4, cfg < 2 ? 0.5 : 1.0, cfg % 2 ? 2 : 0,
                                      cfg % 3 == 0};
            int64_t os[4] = {k, xs[1], p.out_h, p.out_w};
            kpl_tensor *o = tnew(dt, 4, os), *go = NULL, *gxc = tnew(dt, 4, xs), *ggx = NULL;
            OK(kpl_tensor_empty(gpu, dt, 4, os, &go));
            OK(kpl_tensor_empty(gpu, dt, 4, xs, &ggx));
            OK(kpl_k_roi_align(o, x, rois, &p));
            OK(kpl_k_roi_align(go, gx, grois, &p));
            assert_same(go, o, 0, 0, "roi_align");
            kpl_tensor *gy = trand(dt, 4, os, 50 + cfg, -1, 1), *ggy = to_gpu(gy);
            OK(kpl_k_roi_align_bwd(gxc, gy, rois, &p));
            OK(kpl_k_roi_align_bwd(ggx, ggy, grois, &p));
            assert_same(ggx, gxc, f ? 1e-12 : 1e-5, f ? 1e-13 : 1e-6, "roi_align_bwd");
            kpl_tensor *ts[] = {o, go, gxc, ggx, gy, ggy};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
        }
        /* a bad roi is named on the GPU too */
        if (dt == KPL_F64) ((double *)rv)[5 * 7] = 2;
        else ((float *)rv)[5 * 7] = 2;
        kpl_tensor *gbad = to_gpu(rois), *go = NULL;
        kpl_roi_align_params p = {2, 2, 1, 2, true};
        OK(kpl_tensor_empty(gpu, dt, 4, (int64_t[]){k, xs[1], 2, 2}, &go));
        FAILS(kpl_k_roi_align(go, gx, gbad, &p), KPL_EINVAL,
              "roi_align: 'rois' row 7 (2, ");
        kpl_tensor *ts[] = {x, gx, u, rois, grois, gbad, go};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
    }
}

/* Bilinear resizing and its adjoint (the GPU's a gather per input cell,
 * the CPU's a scatter): up, down, mixed, to one row, both ways of
 * align_corners, f32, f64 and bf16 (through f32 on the GPU). */
static void test_resize_kernels(void **state)
{
    (void)state;
    const int64_t xs[4] = {2, 3, 13, 17};
    const int64_t sizes[4][2] = {{40, 51}, {5, 6}, {13, 4}, {1, 30}};
    kpl_dtype dts[3] = {KPL_F32, KPL_F64, KPL_BF16};
    for (int f = 0; f < 3; f++) {
        kpl_dtype dt = dts[f];
        kpl_tensor *x = trand(dt, 4, xs, 70 + f, -1, 1), *gx = to_gpu(x);
        for (int c = 0; c < 8; c++) {
            bool ac = c % 2;
            int64_t os[4] = {xs[0], xs[1], sizes[c / 2][0], sizes[c / 2][1]};
            kpl_tensor *o = tnew(dt, 4, os), *go = NULL, *gxc = tnew(dt, 4, xs), *ggx = NULL;
            OK(kpl_tensor_empty(gpu, dt, 4, os, &go));
            OK(kpl_tensor_empty(gpu, dt, 4, xs, &ggx));
            OK(kpl_k_upsample_bilinear(o, x, ac));
            OK(kpl_k_upsample_bilinear(go, gx, ac));
            double tol = dt == KPL_F64 ? 1e-12 : dt == KPL_F32 ? 1e-5 : 1e-2;
            assert_same(go, o, tol, tol * 0.1, "upsample_bilinear");
            kpl_tensor *gy = trand(dt, 4, os, 80 + c, -1, 1), *ggy = to_gpu(gy);
            OK(kpl_k_upsample_bilinear_bwd(gxc, gy, ac));
            OK(kpl_k_upsample_bilinear_bwd(ggx, ggy, ac));
            assert_same(ggx, gxc, tol, tol, "upsample_bilinear_bwd");
            kpl_tensor *ts[] = {o, go, gxc, ggx, gy, ggy};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
        }
        kpl_tensor_release(x);
        kpl_tensor_release(gx);
    }
}

/* The fused softmax cross entropy both ways, per-pixel (column blocks on
 * the CPU) and per-row, with ignored labels and smoothing; then a label
 * out of range reported at the next synchronisation, by position. */
static void test_xent_kernels(void **state)
{
    (void)state;
    const int64_t shapes[2][4] = {{2, 21, 9, 70}, {300, 37, 1, 1}};
    kpl_dtype dts[3] = {KPL_F32, KPL_F64, KPL_BF16};
    for (int s = 0; s < 2; s++)
        for (int f = 0; f < 3; f++) {
            kpl_dtype dt = dts[f];
            const int64_t *xs = shapes[s];
            int64_t ls[3] = {xs[0], xs[2], xs[3]}, m = xs[0] * xs[2] * xs[3];
            kpl_tensor *x = trand(dt, 4, xs, 90 + f, -5, 5), *gx = to_gpu(x);
            kpl_tensor *y = tnew(KPL_I64, 3, ls);
            int64_t *yv = kpl_tensor_host_mutable(y);
            for (int64_t i = 0; i < m; i++) yv[i] = i % 7 == 2 ? 255 : (i * 5) % xs[1];
            kpl_tensor *gyl = to_gpu(y), *gy = trand(dt, 3, ls, 95 + f, -1, 1), *ggy = to_gpu(gy);
            kpl_tensor *l = tnew(dt, 3, ls), *g = tnew(dt, 4, xs), *gl = NULL, *gg = NULL;
            OK(kpl_tensor_empty(gpu, dt, 3, ls, &gl));
            OK(kpl_tensor_empty(gpu, dt, 4, xs, &gg));
            double tol = dt == KPL_F64 ? 1e-12 : dt == KPL_F32 ? 1e-5 : 1e-2;
            for (int e = 0; e < 2; e++) {
                double eps = e ? 0.1 : 0;
                OK(kpl_k_softmax_xent(l, x, y, 255, eps));
                OK(kpl_k_softmax_xent(gl, gx, gyl, 255, eps));
                assert_same(gl, l, tol, tol * 0.1, "softmax_xent");
                OK(kpl_k_softmax_xent_bwd(g, x, y, gy, 255, eps));
                OK(kpl_k_softmax_xent_bwd(gg, gx, gyl, ggy, 255, eps));
                assert_same(gg, g, tol, tol * 0.1, "softmax_xent_bwd");
            }
            kpl_tensor *ts[] = {x, gx, y, gyl, gy, ggy, l, g, gl, gg};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
        }
    int64_t xs[4] = {2, 4, 3, 5}, ls[3] = {2, 3, 5};
    kpl_tensor *x = trand(KPL_F32, 4, xs, 99, -1, 1), *gx = to_gpu(x), *y = tnew(KPL_I64, 3, ls);
    int64_t *yv = kpl_tensor_host_mutable(y);
    for (int64_t i = 0; i < 30; i++) yv[i] = i % 4;
    yv[1 * 15 + 2 * 5 + 3] = 4;
    kpl_tensor *gyl = to_gpu(y), *gl = NULL;
    OK(kpl_tensor_empty(gpu, KPL_F32, 3, ls, &gl));
    if (on_cuda()) { /* reported by the next synchronisation, once */
        OK(kpl_k_softmax_xent(gl, gx, gyl, 255, 0));
        FAILS(kpl_device_synchronize(gpu), KPL_ERANGE, "softmax_xent: index 4 at position (1,2,3)");
        OK(kpl_device_synchronize(gpu));
    } else {
        FAILS(kpl_k_softmax_xent(gl, gx, gyl, 255, 0), KPL_ERANGE,
              "softmax_xent: label 4 at position (1,2,3)");
    }
    kpl_tensor *ts[] = {x, gx, y, gyl, gl};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

/* The fused sigmoid focal loss both ways, logits over +-20 with hard and
 * soft targets, for gamma 2, 0.5 and 0, with and without alpha. */
static void test_focal_kernels(void **state)
{
    (void)state;
    const int64_t xs[2] = {37, 1001};
    kpl_dtype dts[3] = {KPL_F32, KPL_F64, KPL_BF16};
    const double params[3][2] = {{0.25, 2}, {-1, 0.5}, {0.6, 0}};
    for (int f = 0; f < 3; f++) {
        kpl_dtype dt = dts[f];
        kpl_tensor *z = trand(dt, 2, xs, 110 + f, -20, 20), *gz = to_gpu(z);
        kpl_tensor *y = trand(dt, 2, xs, 113 + f, 0, 1), *gyl = to_gpu(y);
        kpl_tensor *gy = trand(dt, 2, xs, 116 + f, -1, 1), *ggy = to_gpu(gy);
        kpl_tensor *l = tnew(dt, 2, xs), *g = tnew(dt, 2, xs), *gl = NULL, *gg = NULL;
        OK(kpl_tensor_empty(gpu, dt, 2, xs, &gl));
        OK(kpl_tensor_empty(gpu, dt, 2, xs, &gg));
        double tol = dt == KPL_F64 ? 1e-12 : dt == KPL_F32 ? 1e-5 : 1e-2;
        for (int k = 0; k < 3; k++) {
            double a = params[k][0], gm = params[k][1];
            OK(kpl_k_sigmoid_focal(l, z, y, a, gm));
            OK(kpl_k_sigmoid_focal(gl, gz, gyl, a, gm));
            assert_same(gl, l, tol, tol * 0.1, "sigmoid_focal");
            OK(kpl_k_sigmoid_focal_bwd(g, z, y, gy, a, gm));
            OK(kpl_k_sigmoid_focal_bwd(gg, gz, gyl, ggy, a, gm));
            assert_same(gg, g, tol, tol * 0.1, "sigmoid_focal_bwd");
        }
        kpl_tensor *ts[] = {z, gz, y, gyl, gy, ggy, l, g, gl, gg};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
    }
}

/* A CPU integer tensor of dtype dt with values in [lo, hi) (truncated
 * uniform doubles). */
static kpl_tensor *tint(kpl_dtype dt, int ndim, const int64_t *shape, uint64_t seed, double lo,
                        double hi)
{
    kpl_tensor *f = trand(KPL_F64, ndim, shape, seed, lo, hi), *t = tnew(dt, ndim, shape);
    OK(kpl_k_cast(t, f));
    kpl_tensor_release(f);
    return t;
}

/* Integer and byte element-wise ops: every formula the front end allows
 * for i32, i64, u8 and bool, broadcast, against the CPU (exact). */
static void test_int_eltwise(void **state)
{
    (void)state;
    int64_t sa[2] = {3, 257}, sb[1] = {257};
    kpl_dtype dts[3] = {KPL_I32, KPL_I64, KPL_U8};
    for (int d = 0; d < 3; d++) {
        kpl_dtype dt = dts[d];
        bool u8 = dt == KPL_U8;
        kpl_tensor *a = tint(dt, 2, sa, 60 + d, u8 ? 0 : -1000, u8 ? 256 : 1000);
        kpl_tensor *b = tint(dt, 1, sb, 63 + d, u8 ? 0 : -20, u8 ? 256 : 20);
        /* small operands for pow (no overflow on either device) */
        kpl_tensor *pa = tint(dt, 2, sa, 66 + d, u8 ? 0 : -5, 6), *pb = tint(dt, 1, sb, 69 + d,
                                                                               u8 ? 0 : -2, 7);
        if (!u8) { /* a zero divisor: 0 on both devices */
            void *bv = kpl_tensor_host_mutable(b);
            if (dt == KPL_I32) ((int32_t *)bv)[3] = 0;
            else ((int64_t *)bv)[3] = 0;
        }
        kpl_tensor *ga = to_gpu(a), *gb = to_gpu(b), *gpa = to_gpu(pa), *gpb = to_gpu(pb);
        kpl_tensor *o = tnew(dt, 2, sa), *go = gnew(dt, 2, sa);
        kpl_tensor *m = tnew(KPL_BOOL, 2, sa), *gm = gnew(KPL_BOOL, 2, sa);
        for (int op = 0; op < KPL_BINARY_COUNT; op++) {
            kpl_binary_op bop = (kpl_binary_op)op;
            bool cmp = kpl_binary_is_compare(bop), pw = bop == KPL_BIN_POW;
            kpl_tensor *x = pw ? pa : a, *y = pw ? pb : b, *gx = pw ? gpa : ga, *gy = pw ? gpb : gb;
            OK(kpl_k_binary(cmp ? m : o, bop, x, y));
            OK(kpl_k_binary(cmp ? gm : go, bop, gx, gy));
            assert_bits(cmp ? gm : go, cmp ? m : o, kpl_binary_name(bop));
            OK(kpl_k_binary_scalar(cmp ? m : o, bop, x, 3, op % 2));
            OK(kpl_k_binary_scalar(cmp ? gm : go, bop, gx, 3, op % 2));
            assert_bits(cmp ? gm : go, cmp ? m : o, "scalar form");
        }
        if (!u8) {
            static const kpl_unary_op un[5] = {KPL_UN_NEG, KPL_UN_ABS, KPL_UN_SIGN, KPL_UN_SQUARE,
                                               KPL_UN_RELU};
            for (int k = 0; k < 5; k++) {
                OK(kpl_k_unary(o, un[k], a, 0, 0));
                OK(kpl_k_unary(go, un[k], ga, 0, 0));
                assert_bits(go, o, kpl_unary_name(un[k]));
            }
        }
        /* where on integers: the condition broadcast over rows */
        OK(kpl_k_binary(m, KPL_BIN_GT, a, b));
        OK(kpl_k_binary(gm, KPL_BIN_GT, ga, gb));
        OK(kpl_k_where(o, m, a, b));
        OK(kpl_k_where(go, gm, ga, gb));
        assert_bits(go, o, "where");
        RELEASE(a, b, pa, pb, ga, gb, gpa, gpb, o, go, m, gm);
    }
    /* bool: ==, !=, or (maximum), and (minimum) */
    int64_t n = 1000;
    kpl_tensor *p = tint(KPL_U8, 1, &n, 70, 0, 2), *q = tint(KPL_U8, 1, &n, 71, 0, 2);
    kpl_tensor *bp = tnew(KPL_BOOL, 1, &n), *bq = tnew(KPL_BOOL, 1, &n);
    OK(kpl_k_cast(bp, p));
    OK(kpl_k_cast(bq, q));
    kpl_tensor *gbp = to_gpu(bp), *gbq = to_gpu(bq), *r = tnew(KPL_BOOL, 1, &n);
    kpl_tensor *gr = gnew(KPL_BOOL, 1, &n);
    static const kpl_binary_op bops[4] = {KPL_BIN_EQ, KPL_BIN_NE, KPL_BIN_MAXIMUM, KPL_BIN_MINIMUM};
    for (int k = 0; k < 4; k++) {
        OK(kpl_k_binary(r, bops[k], bp, bq));
        OK(kpl_k_binary(gr, bops[k], gbp, gbq));
        assert_bits(gr, r, kpl_binary_name(bops[k]));
    }
    RELEASE(p, q, bp, bq, gbp, gbq, r, gr);
}

/* Reductions beyond test_reduce: runs of >= 256 values (the whole block
 * on one output), strided runs of 300, NaN inside, every axis at once,
 * and integer and byte inputs (exact). */
static void test_reduce_long_nan_int(void **state)
{
    (void)state;
    int64_t s1[2] = {4, 1000}, s2[3] = {3, 300, 40};
    kpl_tensor *x1 = trand(KPL_F32, 2, s1, 80, -3, 3), *x2 = trand(KPL_F32, 3, s2, 81, -3, 3);
    float *h1 = kpl_tensor_host_mutable(x1), *h2 = kpl_tensor_host_mutable(x2);
    h1[1 * 1000 + 777] = NAN;          /* row 1 */
    h2[(2 * 300 + 5) * 40 + 7] = NAN;  /* column (2, 7) */
    kpl_tensor *g1 = to_gpu(x1), *g2 = to_gpu(x2);
    for (int op = 0; op < KPL_REDUCE_COUNT; op++) {
        bool arg = op == KPL_RED_ARGMAX || op == KPL_RED_ARGMIN;
        kpl_dtype odt = arg ? KPL_I64 : KPL_F32;
        double tol = arg ? 0 : 2e-6;
        for (int k = 0; k < 3; k++) {
            kpl_tensor *x = k == 0 ? x1 : x2, *g = k == 0 ? g1 : g2;
            int ax = 1, naxes = k == 2 ? 0 : 1;
            if (k == 2 && arg) continue; /* a flat index: covered below for ints */
            int no;
            int64_t os[3];
            OK(kpl_shape_reduce("t", kpl_tensor_ndim(x), kpl_tensor_shape(x), &ax, naxes, false,
                                &no, os));
            kpl_tensor *o = tnew(odt, no, os), *go = gnew(odt, no, os);
            OK(kpl_k_reduce(o, (kpl_reduce_op)op, x, &ax, naxes, false, 1));
            OK(kpl_k_reduce(go, (kpl_reduce_op)op, g, &ax, naxes, false, 1));
            assert_same(go, o, tol, tol, kpl_reduce_name((kpl_reduce_op)op));
            RELEASE(o, go);
        }
    }
    /* integers: sums wrap in 64 bits on both devices; i64 values near
     * 2^40 make a 32-bit accumulator visible */
    int64_t si[2] = {5, 600};
    static const kpl_reduce_op iops[5] = {KPL_RED_SUM, KPL_RED_MAX, KPL_RED_MIN, KPL_RED_ARGMAX,
                                         KPL_RED_ARGMIN};
    kpl_dtype idts[4] = {KPL_I32, KPL_I64, KPL_U8, KPL_BOOL};
    for (int d = 0; d < 4; d++) {
        kpl_dtype dt = idts[d];
        double lo = dt == KPL_I64 ? -1e12 : dt == KPL_I32 ? -1e6 : 0;
        double hi = dt == KPL_I64 ? 1e12 : dt == KPL_I32 ? 1e6 : dt == KPL_U8 ? 256 : 2;
        kpl_tensor *x = tint(dt == KPL_BOOL ? KPL_U8 : dt, 2, si, 90 + d, lo, hi);
        if (dt == KPL_BOOL) {
            kpl_tensor *b = tnew(KPL_BOOL, 2, si);
            OK(kpl_k_cast(b, x));
            kpl_tensor_release(x);
            x = b;
        }
        kpl_tensor *g = to_gpu(x);
        for (int k = 0; k < 5; k++) {
            kpl_reduce_op op = iops[k];
            bool arg = op == KPL_RED_ARGMAX || op == KPL_RED_ARGMIN;
            if (op == KPL_RED_SUM && (dt == KPL_U8 || dt == KPL_BOOL)) continue;
            for (int all = 0; all < 2; all++) {
                int ax = 1, no;
                int64_t os[2];
                OK(kpl_shape_reduce("t", 2, si, &ax, all ? 0 : 1, false, &no, os));
                kpl_dtype odt = arg ? KPL_I64 : dt;
                kpl_tensor *o = tnew(odt, no, os), *go = gnew(odt, no, os);
                OK(kpl_k_reduce(o, op, x, &ax, all ? 0 : 1, false, 0));
                OK(kpl_k_reduce(go, op, g, &ax, all ? 0 : 1, false, 0));
                assert_bits(go, o, kpl_reduce_name(op));
                RELEASE(o, go);
            }
        }
        RELEASE(x, g);
    }
    RELEASE(x1, x2, g1, g2);
}

/* Convolutions without bias (forward and weight gradient), the algorithm
 * cache hit by a repeated problem, and missed by the same problem at
 * another pointer alignment (part of the key). */
static void test_conv_no_bias_cache(void **state)
{
    (void)state;
    int64_t xs[4] = {2, 3, 10, 10}, ws[4] = {4, 3, 3, 3}, ys[4];
    kpl_conv2d_params p = {{1, 1}, {1, 1}, {1, 1}, 1};
    OK(kpl_shape_conv2d(xs, ws, &p, ys));
    kpl_tensor *x = trand(KPL_F32, 4, xs, 100, -1, 1), *w = trand(KPL_F32, 4, ws, 101, -1, 1);
    kpl_tensor *gy = trand(KPL_F32, 4, ys, 102, -1, 1);
    kpl_tensor *gx = to_gpu(x), *gw = to_gpu(w), *ggy = to_gpu(gy);
    kpl_tensor *y = tnew(KPL_F32, 4, ys), *yg = gnew(KPL_F32, 4, ys);
    kpl_tensor *dw = tnew(KPL_F32, 4, ws), *dwg = gnew(KPL_F32, 4, ws);
    OK(kpl_k_conv2d(y, x, w, NULL, &p));
    OK(kpl_k_conv2d(yg, gx, gw, NULL, &p));
    assert_same(yg, y, 1e-5, 1e-5, "conv2d without bias");
    OK(kpl_k_conv2d_bwd_weight(dw, NULL, x, gy, &p));
    OK(kpl_k_conv2d_bwd_weight(dwg, NULL, gx, ggy, &p));
    assert_same(dwg, dw, 1e-4, 1e-4, "conv2d bwd_weight without bias gradient");
    /* the same problem again, on other buffers of the same alignment: a hit */
    kpl_tensor *yg2 = gnew(KPL_F32, 4, ys);
    kpl_algo_cache_stats s0 = kpl_algo_cache_stats_get(kpl_device_type_of(gpu));
    OK(kpl_k_conv2d(yg2, gx, gw, NULL, &p));
    kpl_algo_cache_stats s1 = kpl_algo_cache_stats_get(kpl_device_type_of(gpu));
    assert_same(yg2, y, 1e-5, 1e-5, "conv2d, cached algorithm");
    if (on_cuda()) {
        assert_int_equal(s1.hits, s0.hits + 1);
        assert_int_equal(s1.misses, s0.misses);
    }
    /* an input 4 bytes off 16-byte alignment: (3, 1, 1, 7) rows 1..2 */
    int64_t bs[4] = {3, 1, 1, 7}, w1s[4] = {2, 1, 1, 3}, y1s[4];
    kpl_conv2d_params p1 = KPL_CONV2D_PARAMS_INIT;
    kpl_tensor *xb = trand(KPL_F32, 4, bs, 103, -1, 1), *w1 = trand(KPL_F32, 4, w1s, 104, -1, 1);
    kpl_tensor *gxb = to_gpu(xb), *gw1 = to_gpu(w1), *v0 = NULL, *v1 = NULL, *c0 = NULL, *c1 = NULL;
    OK(kpl_tensor_narrow(gxb, 0, 2, &v0)); /* offset 0 */
    OK(kpl_tensor_narrow(gxb, 1, 2, &v1)); /* offset 28 bytes */
    OK(kpl_tensor_narrow(xb, 0, 2, &c0));
    OK(kpl_tensor_narrow(xb, 1, 2, &c1));
    int64_t v1s[4] = {2, 1, 1, 7};
    OK(kpl_shape_conv2d(v1s, w1s, &p1, y1s));
    kpl_tensor *r0 = tnew(KPL_F32, 4, y1s), *r1 = tnew(KPL_F32, 4, y1s);
    kpl_tensor *g0 = gnew(KPL_F32, 4, y1s), *g1 = gnew(KPL_F32, 4, y1s);
    OK(kpl_k_conv2d(r0, c0, w1, NULL, &p1));
    OK(kpl_k_conv2d(r1, c1, w1, NULL, &p1));
    OK(kpl_k_conv2d(g0, v0, gw1, NULL, &p1));
    s0 = kpl_algo_cache_stats_get(kpl_device_type_of(gpu));
    OK(kpl_k_conv2d(g1, v1, gw1, NULL, &p1));
    s1 = kpl_algo_cache_stats_get(kpl_device_type_of(gpu));
    if (on_cuda()) assert_int_equal(s1.misses, s0.misses + 1); /* another key */
    OK(kpl_k_conv2d(g1, v1, gw1, NULL, &p1));
    kpl_algo_cache_stats s2 = kpl_algo_cache_stats_get(kpl_device_type_of(gpu));
    if (on_cuda()) assert_int_equal(s2.hits, s1.hits + 1);
    assert_same(g0, r0, 1e-6, 1e-6, "conv2d, aligned view");
    assert_same(g1, r1, 1e-6, 1e-6, "conv2d, view 4 bytes off alignment");
    RELEASE(x, w, gy, gx, gw, ggy, y, yg, dw, dwg, yg2, xb, w1, gxb, gw1, v0, v1, c0, c1, r0, r1,
            g0, g1);
}

/* Batch norm's scratch paths against the CPU: statistics not asked for
 * (cuDNN's mean/var in scratch), only one of them, many values per
 * channel (the backward's chunks at their cap), and the backward with
 * each subset of outputs. */
static void test_batch_norm_paths(void **state)
{
    (void)state;
    int64_t xs[4] = {2, 3, 300, 300}, c3 = 3;
    kpl_tensor *x = trand(KPL_F32, 4, xs, 110, -2, 3), *gy = trand(KPL_F32, 4, xs, 111, -1, 1);
    kpl_tensor *ga = trand(KPL_F32, 1, &c3, 112, 0.5, 1.5), *be = trand(KPL_F32, 1, &c3, 113, -1, 1);
    kpl_tensor *gx = to_gpu(x), *ggy = to_gpu(gy), *gga = to_gpu(ga), *gbe = to_gpu(be);
    kpl_tensor *y = tnew(KPL_F32, 4, xs), *yg = gnew(KPL_F32, 4, xs);
    kpl_tensor *m = tnew(KPL_F32, 1, &c3), *mg = gnew(KPL_F32, 1, &c3);
    OK(kpl_k_batch_norm(y, NULL, NULL, x, ga, be, 1e-5));
    OK(kpl_k_batch_norm(yg, NULL, NULL, gx, gga, gbe, 1e-5));
    assert_same(yg, y, 1e-4, 1e-4, "batch_norm, no statistics kept");
    OK(kpl_k_batch_norm(y, m, NULL, x, ga, be, 1e-5));
    OK(kpl_k_batch_norm(yg, mg, NULL, gx, gga, gbe, 1e-5));
    assert_same(yg, y, 1e-4, 1e-4, "batch_norm, mean only");
    assert_same(mg, m, 1e-5, 1e-6, "batch_norm mean");
    kpl_tensor *dx = tnew(KPL_F32, 4, xs), *dxg = gnew(KPL_F32, 4, xs);
    kpl_tensor *dg = tnew(KPL_F32, 1, &c3), *dgg = gnew(KPL_F32, 1, &c3);
    kpl_tensor *db = tnew(KPL_F32, 1, &c3), *dbg = gnew(KPL_F32, 1, &c3);
    for (int set = 1; set < 8; set++) { /* bit 0: gx, 1: ggamma, 2: gbeta */
        kpl_tensor *o[3] = {set & 1 ? dx : NULL, set & 2 ? dg : NULL, set & 4 ? db : NULL};
        kpl_tensor *og[3] = {set & 1 ? dxg : NULL, set & 2 ? dgg : NULL, set & 4 ? dbg : NULL};
        OK(kpl_k_batch_norm_bwd(o[0], o[1], o[2], x, gy, ga, 1e-5));
        OK(kpl_k_batch_norm_bwd(og[0], og[1], og[2], gx, ggy, gga, 1e-5));
        if (o[0]) assert_same(dxg, dx, 1e-4, 1e-5, "batch_norm_bwd gx");
        /* sums of 180000 values */
        if (o[1]) assert_same(dgg, dg, 1e-5, 1e-3, "batch_norm_bwd ggamma");
        if (o[2]) assert_same(dbg, db, 1e-5, 1e-3, "batch_norm_bwd gbeta");
    }
    RELEASE(x, gy, ga, be, gx, ggy, gga, gbe, y, yg, m, mg, dx, dxg, dg, dgg, db, dbg);
}

int main(void)
{
    const char *dry = getenv("KPL_TEST_CUDA_DRYRUN");
    if (dry && !strcmp(dry, "1")) {
        gpu = kpl_device_cpu();
    } else {
        gpu = kpl_test_gpu();
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_identical),
        cmocka_unit_test(test_unary_binary_where),
        cmocka_unit_test(test_int_eltwise),
        cmocka_unit_test(test_reduce),
        cmocka_unit_test(test_reduce_long_nan_int),
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_fill_cast_copy_storage),
        cmocka_unit_test(test_nn_kernels),
        cmocka_unit_test(test_conv_no_bias_cache),
        cmocka_unit_test(test_batch_norm_paths),
        cmocka_unit_test(test_box_kernels),
        cmocka_unit_test(test_roi_align_kernels),
        cmocka_unit_test(test_resize_kernels),
        cmocka_unit_test(test_xent_kernels),
        cmocka_unit_test(test_focal_kernels),
    };
    int fails = RUN_GROUP("cuda", tests);
    fails += run_cuda_mixed_tests();
    fails += run_cuda_memory_tests();
    return fails ? 1 : 0;
}
