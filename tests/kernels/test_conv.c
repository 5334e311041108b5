/* test_conv.c — the CPU convolution kernels: by hand, oneDNN's kernels
 * (direct and Winograd) and kpl's own loops against the f64 reference
 * loops, the fused ReLU, the chooser's cache and its bounds. */
#include "test_util.h"
#include "kernels_impl.h"

#include <stdlib.h>

static void test_conv2d_by_hand(void **state)
{
    (void)state;
    /* 1x1x4x4 input 0..15, 3x3 all-ones kernel, padding 1, bias 0.5:
     * the output at (0,0) sums x[0:2,0:2] = 0+1+4+5, at (1,1) sums x[0:3,0:3]. */
    int64_t xs[4] = {1, 1, 4, 4}, ws[4] = {1, 1, 3, 3}, ys[4] = {1, 1, 4, 4}, bs = 1;
    kpl_tensor *x = tnew(KPL_F32, 4, xs), *w = tnew(KPL_F32, 4, ws), *y = tnew(KPL_F32, 4, ys);
    kpl_tensor *b = tnew(KPL_F32, 1, &bs);
    OK(kpl_k_arange(x, 0, 1));
    OK(kpl_k_fill(w, 1));
    OK(kpl_k_fill(b, 0.5));
    kpl_conv2d_params p = KPL_CONV2D_PARAMS_INIT;
    p.padding[0] = p.padding[1] = 1;
    OK(kpl_k_conv2d(y, x, w, b, &p));
    /* within 1e-6 of sum |x w| + |b| (every term is positive here): the
     * chooser may time Winograd fastest on this, whose transforms round
     * to ~3e-7 of it (docs/precision.md; an ASan build once gave 10.499997) */
    assert_float_equal(tget(y, 0), 10.5, 1e-6 * 10.5);
    assert_float_equal(tget(y, 5), 0 + 1 + 2 + 4 + 5 + 6 + 8 + 9 + 10 + 0.5, 1e-6 * 45.5);
    assert_float_equal(tget(y, 15), 10 + 11 + 14 + 15 + 0.5, 1e-6 * 50.5);
    /* stride 2, no padding: 1x1x1x1... (4-3)/2+1 = 1 */
    kpl_conv2d_params p2 = KPL_CONV2D_PARAMS_INIT;
    p2.stride[0] = p2.stride[1] = 2;
    int64_t s1[4] = {1, 1, 1, 1};
    kpl_tensor *y1 = tnew(KPL_F32, 4, s1);
    OK(kpl_k_conv2d(y1, x, w, NULL, &p2));
    assert_float_equal(tget(y1, 0), 0 + 1 + 2 + 4 + 5 + 6 + 8 + 9 + 10, 1e-6);
    /* bad input: channels, kernel too large, bias size */
    int64_t w2s[4] = {1, 2, 3, 3}, big[4] = {1, 1, 7, 7}, b2s = 2;
    kpl_tensor *w2 = tnew(KPL_F32, 4, w2s), *wb = tnew(KPL_F32, 4, big), *b2 = tnew(KPL_F32, 1, &b2s);
    FAILS(kpl_k_conv2d(y, x, w2, NULL, &p), KPL_ESHAPE, "input (1,1,4,4) has 1 channels but weights (1,2,3,3) expect 2");
    FAILS(kpl_k_conv2d(y, x, wb, NULL, &p), KPL_ESHAPE, "kernel 7x7 (dilated 7x7) is larger than the padded input 6x6");
    FAILS(kpl_k_conv2d(y, x, w, b2, &p), KPL_ESHAPE, "bias (2) must have one value per filter (1)");
    kpl_conv2d_params p0 = KPL_CONV2D_PARAMS_INIT;
    p0.stride[1] = 0;
    FAILS(kpl_k_conv2d(y, x, w, NULL, &p0), KPL_EINVAL, "stride (1,0)");
    kpl_tensor *ts[] = {x, w, y, b, y1, w2, wb, b2};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

/* The implementation every f32 convolution of conv_case must have run
 * (a prefix of its name), NULL for any. */
static const char *conv_want;

static void expect_impl(const char *what)
{
    const char *impl = kpl__cpu_conv_last().impl;
    if (conv_want && strncmp(impl, conv_want, strlen(conv_want)))
        fail_msg("%s ran %s, not %s", what, impl, conv_want);
}

/* oneDNN (f32) against the reference loops (f64) on the same values. */
static void conv_case(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t k, int s,
                      int pad, int dil, int groups, bool bias)
{
    kpl_conv2d_params p = {{s, s}, {pad, pad}, {dil, dil}, groups};
    int64_t xs[4] = {n, c, h, w}, ws[4] = {o, c / groups, k, k}, ys[4], bs = o;
    OK(kpl_shape_conv2d(xs, ws, &p, ys));
    kpl_tensor *x64 = trand(KPL_F64, 4, xs, 1, -1, 1), *w64 = trand(KPL_F64, 4, ws, 2, -1, 1);
    kpl_tensor *b64 = trand(KPL_F64, 1, &bs, 3, -1, 1), *gy64 = trand(KPL_F64, 4, ys, 4, -1, 1);
    kpl_tensor *x32 = tnew(KPL_F32, 4, xs), *w32 = tnew(KPL_F32, 4, ws), *b32 = tnew(KPL_F32, 1, &bs);
    kpl_tensor *gy32 = tnew(KPL_F32, 4, ys);
    kpl_tensor *in64[4] = {x64, w64, b64, gy64}, *in32[4] = {x32, w32, b32, gy32};
    /* round the f64 values to f32 so both sides see the same numbers */
    for (int i = 0; i < 4; i++) {
        OK(kpl_k_cast(in32[i], in64[i]));
        OK(kpl_k_cast(in64[i], in32[i]));
    }
    kpl_tensor *y64 = tnew(KPL_F64, 4, ys), *y32 = tnew(KPL_F32, 4, ys);
    OK(kpl_k_conv2d(y64, x64, w64, bias ? b64 : NULL, &p));
    OK(kpl_k_conv2d(y32, x32, w32, bias ? b32 : NULL, &p));
    expect_impl("conv2d fwd");
    for (int64_t i = 0; i < kpl_tensor_numel(y32); i++)
        assert_close(tget(y32, i), tget(y64, i), 1e-4, 1e-4, "conv2d fwd", i);
    kpl_tensor *gx64 = tnew(KPL_F64, 4, xs), *gx32 = tnew(KPL_F32, 4, xs);
    OK(kpl_k_conv2d_bwd_data(gx64, gy64, w64, &p));
    OK(kpl_k_conv2d_bwd_data(gx32, gy32, w32, &p));
    expect_impl("conv2d bwd data");
    for (int64_t i = 0; i < kpl_tensor_numel(gx32); i++)
        assert_close(tget(gx32, i), tget(gx64, i), 1e-4, 1e-4, "conv2d bwd data", i);
    kpl_tensor *gw64 = tnew(KPL_F64, 4, ws), *gw32 = tnew(KPL_F32, 4, ws);
    kpl_tensor *gb64 = tnew(KPL_F64, 1, &bs), *gb32 = tnew(KPL_F32, 1, &bs);
    OK(kpl_k_conv2d_bwd_weight(gw64, gb64, x64, gy64, &p));
    OK(kpl_k_conv2d_bwd_weight(gw32, gb32, x32, gy32, &p));
    expect_impl("conv2d bwd weight");
    for (int64_t i = 0; i < kpl_tensor_numel(gw32); i++)
        assert_close(tget(gw32, i), tget(gw64, i), 1e-4, 1e-4, "conv2d bwd weight", i);
    for (int64_t i = 0; i < bs; i++)
        assert_close(tget(gb32, i), tget(gb64, i), 1e-4, 1e-4, "conv2d bwd bias", i);
    kpl_tensor *ts[] = {x64, w64, b64, gy64, x32, w32, b32, gy32, y64, y32, gx64, gx32, gw64, gw32, gb64, gb32};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

static void test_conv2d_onednn_vs_reference(void **state)
{
    (void)state;
    conv_case(2, 3, 9, 7, 4, 3, 1, 1, 1, 1, true);   /* plain, odd sizes */
    conv_case(2, 4, 11, 10, 6, 3, 2, 1, 1, 2, true); /* stride 2, groups 2 */
    conv_case(1, 3, 12, 12, 5, 3, 1, 2, 2, 1, false); /* dilation 2 */
    conv_case(2, 6, 8, 8, 6, 3, 1, 1, 1, 6, true);   /* depthwise */
    conv_case(3, 5, 7, 9, 4, 1, 1, 0, 1, 1, true);   /* 1x1 */
    conv_case(1, 2, 5, 5, 3, 5, 2, 2, 1, 1, true);   /* kernel 5, stride 2 */
    /* the primitive cache is hit by a repeated shape */
    kpl_algo_cache_stats s0 = kpl_algo_cache_stats_get(KPL_DEVICE_CPU);
    conv_case(2, 3, 9, 7, 4, 3, 1, 1, 1, 1, true);
    kpl_algo_cache_stats s1 = kpl_algo_cache_stats_get(KPL_DEVICE_CPU);
    assert_int_equal(s1.misses, s0.misses);
    assert_int_equal(s1.hits, s0.hits + 3);
}

/* conv2d_relu against conv2d then relu: f64 (the reference loops, the
 * ReLU after them) exactly; f32, bf16 and f16 (oneDNN with its ReLU
 * post-op, or the f32 detour) within their rounding, as the fused problem
 * is a chooser key of its own and may get another kernel. */
static void conv_relu_case(kpl_dtype dt, int64_t c, int64_t hw, int64_t o, int64_t k, int s,
                           bool bias)
{
    kpl_conv2d_params p = {{s, s}, {k / 2, k / 2}, {1, 1}, 1};
    int64_t xs[4] = {2, c, hw, hw}, ws[4] = {o, c, k, k}, ys[4], bs = o;
    OK(kpl_shape_conv2d(xs, ws, &p, ys));
    kpl_tensor *src[3] = {trand(KPL_F32, 4, xs, 31, -1, 1), trand(KPL_F32, 4, ws, 32, -0.5, 0.5),
                          trand(KPL_F32, 1, &bs, 33, -0.5, 0.5)};
    kpl_tensor *t[3];
    for (int i = 0; i < 3; i++) {
        t[i] = tnew(dt, kpl_tensor_ndim(src[i]), kpl_tensor_shape(src[i]));
        OK(kpl_k_cast(t[i], src[i]));
    }
    kpl_tensor *y = tnew(dt, 4, ys), *yr = tnew(dt, 4, ys);
    OK(kpl_k_conv2d(y, t[0], t[1], bias ? t[2] : NULL, &p));
    OK(kpl_k_conv2d_relu(yr, t[0], t[1], bias ? t[2] : NULL, &p));
    double tol = dt == KPL_F64 ? 0 : dt == KPL_F32 ? 1e-5 : dt == KPL_BF16 ? 2e-2 : 2e-3;
    int64_t zeros = 0, n = kpl_tensor_numel(y);
    for (int64_t i = 0; i < n; i++) {
        double v = tget(y, i), r = tget(yr, i), want = v < 0 ? 0 : v;
        zeros += r == 0;
        if (dt == KPL_F64 ? r != want : fabs(r - want) > tol * (1 + fabs(v)))
            fail_msg("%s conv2d_relu %lldx%lld k%lld s%d [%lld]: %.9g, relu(conv2d) %.9g",
                     kpl_dtype_name(dt), (long long)c, (long long)o, (long long)k, s,
                     (long long)i, r, want);
        assert_false(r < 0);
    }
    assert_true(zeros > n / 5 && zeros < n - n / 5);
    kpl_tensor *all[] = {src[0], src[1], src[2], t[0], t[1], t[2], y, yr};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kpl_tensor_release(all[i]);
}

static void test_conv2d_relu_kernels(void **state)
{
    (void)state;
    const kpl_dtype dts[4] = {KPL_F64, KPL_F32, KPL_BF16, KPL_F16};
    for (int i = 0; i < 4; i++) {
        conv_relu_case(dts[i], 3, 9, 4, 3, 1, true);    /* narrow, odd sizes */
        conv_relu_case(dts[i], 16, 8, 32, 3, 2, false); /* blocked-sized channels, stride 2 */
        conv_relu_case(dts[i], 32, 6, 16, 1, 1, true);  /* 1x1 */
    }
    /* deterministic mode: oneDNN's own first choice, untimed */
    kpl_set_deterministic(true);
    conv_relu_case(KPL_F32, 16, 10, 32, 3, 1, true);
    kpl_set_deterministic(false);
}

/* In deterministic mode (oneDNN's first kernel, untimed) a 3x3 stride-1
 * convolution of n x c x hw x hw to o channels (padding pad, dilation dil)
 * runs no implementation whose name starts with `not`. */
static void deterministic_not(int64_t n, int64_t c, int64_t hw, int64_t o, int pad, int dil,
                              const char *not)
{
    kpl_set_deterministic(true);
    kpl_conv2d_params p = {{1, 1}, {pad, pad}, {dil, dil}, 1};
    kpl_tensor *x = trand(KPL_F32, 4, (int64_t[]){n, c, hw, hw}, 7, -1, 1);
    kpl_tensor *w = trand(KPL_F32, 4, (int64_t[]){o, c, 3, 3}, 8, -1, 1);
    kpl_tensor *y = tnew(KPL_F32, 4, (int64_t[]){n, o, hw, hw});
    OK(kpl_k_conv2d(y, x, w, NULL, &p));
    assert_int_not_equal(strncmp(kpl__cpu_conv_last().impl, not, strlen(not)), 0);
    kpl_set_deterministic(false);
    kpl_tensor *all[] = {x, w, y};
    for (size_t i = 0; i < 3; i++) kpl_tensor_release(all[i]);
}

/* Winograd (oneDNN's jit_wino_*, a candidate for 3x3 stride-1 f32
 * convolutions on AVX-512) forced by the test hook, every direction,
 * against the reference loops at conv_case's bound; with its ReLU post-op
 * too.  Under an ISA cap below AVX-512 oneDNN has no Winograd kernel, and
 * the same problems run unforced.  Deterministic mode never picks it. */
static void test_conv2d_winograd(void **state)
{
    (void)state;
    bool wino = kpl__cpu_avx512();
    if (wino) kpl__cpu_conv_only("jit_wino");
    conv_want = wino ? "jit_wino" : NULL;
    conv_case(2, 16, 48, 48, 16, 3, 1, 1, 1, 1, true);  /* U-Net-like */
    conv_case(1, 16, 61, 45, 32, 3, 1, 1, 1, 1, false); /* odd sides, one image */
    conv_case(3, 32, 30, 30, 16, 3, 1, 1, 1, 1, true);  /* partial tiles */
    conv_want = NULL;
    conv_relu_case(KPL_F32, 16, 12, 32, 3, 1, true);
    if (wino) assert_int_equal(strncmp(kpl__cpu_conv_last().impl, "jit_wino", 8), 0);
    /* a problem Winograd does not cover (stride 2): named, not run */
    if (wino) {
        kpl_conv2d_params p = {{2, 2}, {1, 1}, {1, 1}, 1};
        kpl_tensor *x = trand(KPL_F32, 4, (int64_t[]){1, 16, 8, 8}, 5, -1, 1);
        kpl_tensor *w = trand(KPL_F32, 4, (int64_t[]){16, 16, 3, 3}, 6, -1, 1);
        kpl_tensor *y = tnew(KPL_F32, 4, (int64_t[]){1, 16, 4, 4});
        FAILS(kpl_k_conv2d(y, x, w, NULL, &p), KPL_EBACKEND, "no usable implementation");
        kpl_tensor *all[] = {x, w, y};
        for (size_t i = 0; i < 3; i++) kpl_tensor_release(all[i]);
        /* the training bound on its memory: 512 channels at 7 x 7 (batch 8)
         * need 37.7 MB of transformed weights alone, past 32 MB and 8x the
         * 0.8 MB activation, so Winograd is no candidate for changing
         * weights; for constant ones (inference) it is, and computes the
         * reference's values */
        kpl_conv2d_params p1 = {{1, 1}, {1, 1}, {1, 1}, 1};
        int64_t as[4] = {8, 512, 7, 7}, wsh[4] = {512, 512, 3, 3};
        kpl_tensor *a = trand(KPL_F32, 4, as, 9, -1, 1);
        kpl_tensor *k = trand(KPL_F32, 4, wsh, 10, -0.05, 0.05);
        kpl_tensor *o = tnew(KPL_F32, 4, as), *gk = tnew(KPL_F32, 4, wsh);
        FAILS(kpl_k_conv2d(o, a, k, NULL, &p1), KPL_EBACKEND, "no usable implementation");
        FAILS(kpl_k_conv2d_bwd_weight(gk, NULL, a, o, &p1), KPL_EBACKEND,
              "no usable implementation");
        kpl_tensor_set_constant(k, true);
        OK(kpl_k_conv2d(o, a, k, NULL, &p1));
        assert_int_equal(strncmp(kpl__cpu_conv_last().impl, "jit_wino", 8), 0);
        kpl__cpu_conv_only(NULL);
        kpl_set_deterministic(true); /* oneDNN's first direct kernel */
        kpl_tensor *o2 = tnew(KPL_F32, 4, as);
        OK(kpl_k_conv2d(o2, a, k, NULL, &p1));
        kpl_set_deterministic(false);
        for (int64_t i = 0; i < kpl_tensor_numel(o); i += 7)
            assert_close(tget(o, i), tget(o2, i), 1e-4, 1e-4, "winograd (constant weights)", i);
        kpl_tensor *more[] = {a, k, o, gk, o2};
        for (size_t i = 0; i < 5; i++) kpl_tensor_release(more[i]);
    }
    kpl__cpu_conv_only(NULL);
    deterministic_not(2, 32, 14, 32, 1, 1, "jit_wino");
}

/* A dilated forward (and with its ReLU) by brgconv on NHWC activations,
 * forced by the test hook, against the reference loops on the same
 * values. */
static void dilated_fwd_case(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int pad,
                             int dil, bool bias)
{
    kpl_conv2d_params p = {{1, 1}, {pad, pad}, {dil, dil}, 1};
    int64_t xs[4] = {n, c, h, w}, ws[4] = {o, c, 3, 3}, ys[4], bs = o;
    OK(kpl_shape_conv2d(xs, ws, &p, ys));
    kpl_tensor *in64[3] = {trand(KPL_F64, 4, xs, 41, -1, 1), trand(KPL_F64, 4, ws, 42, -1, 1),
                           trand(KPL_F64, 1, &bs, 43, -1, 1)};
    kpl_tensor *in32[3];
    for (int i = 0; i < 3; i++) { /* both sides see the same (f32) numbers */
        in32[i] = tnew(KPL_F32, kpl_tensor_ndim(in64[i]), kpl_tensor_shape(in64[i]));
        OK(kpl_k_cast(in32[i], in64[i]));
        OK(kpl_k_cast(in64[i], in32[i]));
    }
    kpl_tensor *y64 = tnew(KPL_F64, 4, ys), *y32 = tnew(KPL_F32, 4, ys), *r32 = tnew(KPL_F32, 4, ys);
    OK(kpl_k_conv2d(y64, in64[0], in64[1], bias ? in64[2] : NULL, &p));
    kpl__cpu_conv_only("brgconv");
    OK(kpl_k_conv2d(y32, in32[0], in32[1], bias ? in32[2] : NULL, &p));
    assert_int_equal(strncmp(kpl__cpu_conv_last().impl, "brgconv", 7), 0);
    OK(kpl_k_conv2d_relu(r32, in32[0], in32[1], bias ? in32[2] : NULL, &p));
    assert_int_equal(strncmp(kpl__cpu_conv_last().impl, "brgconv", 7), 0);
    kpl__cpu_conv_only(NULL);
    for (int64_t i = 0; i < kpl_tensor_numel(y32); i++) {
        double want = tget(y64, i);
        assert_close(tget(y32, i), want, 1e-4, 1e-4, "dilated conv2d (brgconv)", i);
        assert_close(tget(r32, i), want < 0 ? 0 : want, 1e-4, 1e-4, "dilated conv2d_relu", i);
    }
    kpl_tensor *all[] = {in64[0], in64[1], in64[2], in32[0], in32[1], in32[2], y64, y32, r32};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kpl_tensor_release(all[i]);
}

/* Dilated convolutions also try oneDNN's kernels on NHWC activations
 * where no layout is asked for: its brgconv forward computes only there,
 * and skips the taps that fall in the padding.  On AVX-512 (brgconv
 * does not exist below it) each is forced by the test hook, with ASPP's
 * geometry (rate 6 on a map smaller than 2 x 6 + 1, so corner taps read
 * padding only), a layer4-like one on odd sides and padding below the
 * rate.  Unforced, every direction of the same problems matches the
 * reference whatever the chooser picked; deterministic mode keeps
 * oneDNN's first kernel in its own layout. */
static void test_conv2d_dilated_nhwc(void **state)
{
    (void)state;
    if (kpl__cpu_avx512()) {
        dilated_fwd_case(1, 32, 11, 11, 16, 6, 6, true);
        dilated_fwd_case(2, 16, 13, 9, 32, 3, 2, false);
        dilated_fwd_case(2, 8, 12, 10, 24, 1, 4, true);
    }
    conv_case(1, 32, 11, 11, 16, 3, 1, 6, 6, 1, true);
    conv_case(2, 16, 13, 9, 32, 3, 1, 3, 2, 1, false);
    conv_case(2, 8, 12, 10, 24, 3, 1, 1, 4, 1, true);
    deterministic_not(1, 32, 11, 16, 6, 6, "brgconv");
}

/* kpl's own convolution loops (the chooser's plain-layout candidate),
 * called directly with one and two threads, against the reference loops
 * (f64) on the same values: all three directions, bias gradient included. */
static void direct_case(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh,
                        int64_t kw, int ph, int pw)
{
    kpl_conv2d_params p = {{1, 1}, {ph, pw}, {1, 1}, 1};
    int64_t xs[4] = {n, c, h, w}, ws[4] = {o, c, kh, kw}, ys[4], bs = o;
    OK(kpl_shape_conv2d(xs, ws, &p, ys));
    kpl_tensor *x64 = trand(KPL_F64, 4, xs, 11, -1, 1), *w64 = trand(KPL_F64, 4, ws, 12, -1, 1);
    kpl_tensor *b64 = trand(KPL_F64, 1, &bs, 13, -1, 1), *gy64 = trand(KPL_F64, 4, ys, 14, -1, 1);
    kpl_tensor *x32 = tnew(KPL_F32, 4, xs), *w32 = tnew(KPL_F32, 4, ws), *b32 = tnew(KPL_F32, 1, &bs);
    kpl_tensor *gy32 = tnew(KPL_F32, 4, ys);
    kpl_tensor *in64[4] = {x64, w64, b64, gy64}, *in32[4] = {x32, w32, b32, gy32};
    for (int i = 0; i < 4; i++) {
        OK(kpl_k_cast(in32[i], in64[i]));
        OK(kpl_k_cast(in64[i], in32[i]));
    }
    kpl_tensor *y64 = tnew(KPL_F64, 4, ys), *gx64 = tnew(KPL_F64, 4, xs), *gw64 = tnew(KPL_F64, 4, ws);
    kpl_tensor *gb64 = tnew(KPL_F64, 1, &bs);
    OK(kpl_k_conv2d(y64, x64, w64, b64, &p));
    OK(kpl_k_conv2d_bwd_data(gx64, gy64, w64, &p));
    OK(kpl_k_conv2d_bwd_weight(gw64, gb64, x64, gy64, &p));
    kpl_tensor *y32 = tnew(KPL_F32, 4, ys), *gx32 = tnew(KPL_F32, 4, xs), *gw32 = tnew(KPL_F32, 4, ws);
    kpl_tensor *gb32 = tnew(KPL_F32, 1, &bs);
    kpl_conv_attrs a = {.n = n, .c = c, .h = h, .w = w, .o = o, .kh = kh, .kw = kw,
                        .oh = ys[2], .ow = ys[3], .p = p};
    for (int kind = 0; kind < 3; kind++) {
        a.kind = (kpl_conv_kind)kind;
        assert_true(kpl__conv_direct_supports(&a));
    }
    for (int threads = 1; threads <= 2; threads++) {
        a.kind = KPL_CONV_FWD;
        kpl_kernel_args fa = {.out = y32, .in = {x32, w32, b32}, .attrs = &a};
        OK(kpl__conv_direct_run(&a, &fa, threads));
        for (int64_t i = 0; i < kpl_tensor_numel(y32); i++)
            assert_close(tget(y32, i), tget(y64, i), 1e-4, 1e-4, "direct fwd", i);
        a.kind = KPL_CONV_BWD_DATA;
        kpl_kernel_args da = {.out = gx32, .in = {gy32, w32, NULL}, .attrs = &a};
        OK(kpl__conv_direct_run(&a, &da, threads));
        for (int64_t i = 0; i < kpl_tensor_numel(gx32); i++)
            assert_close(tget(gx32, i), tget(gx64, i), 1e-4, 1e-4, "direct bwd data", i);
        a.kind = KPL_CONV_BWD_WEIGHT;
        kpl_kernel_args wa = {.out = gw32, .in = {x32, gy32, gb32}, .attrs = &a};
        OK(kpl__conv_direct_run(&a, &wa, threads));
        for (int64_t i = 0; i < kpl_tensor_numel(gw32); i++)
            assert_close(tget(gw32, i), tget(gw64, i), 1e-4, 1e-4, "direct bwd weight", i);
        for (int64_t i = 0; i < bs; i++)
            assert_close(tget(gb32, i), tget(gb64, i), 1e-4, 1e-4, "direct bwd bias", i);
    }
    kpl_tensor *ts[] = {x64, w64, b64, gy64, x32, w32, b32, gy32, y64, gx64, gw64, gb64,
                        y32, gx32, gw32, gb32};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

static void test_conv2d_direct_vs_reference(void **state)
{
    (void)state;
    direct_case(3, 1, 28, 28, 6, 5, 5, 2, 2);   /* LeNet conv1: two vectors a row, tail of 12 */
    direct_case(3, 6, 14, 14, 16, 5, 5, 0, 0);  /* LeNet conv2: two channel blocks, tail of 10 */
    direct_case(2, 3, 9, 37, 11, 3, 3, 1, 1);   /* a block of 3 channels, rows of 37 */
    direct_case(2, 2, 6, 20, 3, 2, 9, 0, 4);    /* kernel 2x9: kx in blocks of 8 and 1 */
    direct_case(1, 4, 5, 5, 2, 1, 1, 0, 0);     /* 1x1 */
    direct_case(2, 1, 28, 28, 32, 3, 3, 1, 1);  /* the fashion_mnist recipe's cnn */
    direct_case(2, 32, 14, 14, 64, 3, 3, 1, 1);
    /* not theirs: strides, dilations, groups, padding past the kernel */
    kpl_conv_attrs a = {.kind = KPL_CONV_FWD, .n = 1, .c = 2, .h = 8, .w = 8, .o = 2, .kh = 3,
                        .kw = 3, .oh = 4, .ow = 4, .p = {{2, 2}, {1, 1}, {1, 1}, 1}};
    assert_false(kpl__conv_direct_supports(&a));
    a.p = (kpl_conv2d_params){{1, 1}, {1, 1}, {1, 1}, 2};
    assert_false(kpl__conv_direct_supports(&a));
    a.p = (kpl_conv2d_params){{1, 1}, {3, 3}, {1, 1}, 1};
    a.kind = KPL_CONV_BWD_DATA;
    assert_false(kpl__conv_direct_supports(&a));
}

/* The loops' working memory, counted by hand, and the chooser's bound on
 * it in training: a 512-channel 3 x 3 weight gradient would need a
 * vector accumulator per weight and thread (151 MB each) for an 8 KB
 * activation, so even forced it is no candidate. */
static void test_conv2d_direct_scratch_bound(void **state)
{
    (void)state;
    /* LeNet conv1's weight gradient: n 3, 1 -> 6 channels, 5 x 5, padding
     * 2, 28 x 28: padded rows of 2 vectors + 4 = 36 floats, 32 rows; gy in
     * rows of 32; 6 x 25 weights + 6 biases; 3 groups of f64 sums */
    kpl_conv_attrs a = {.kind = KPL_CONV_BWD_WEIGHT,
                        .n = 3,
                        .c = 1,
                        .h = 28,
                        .w = 28,
                        .o = 6,
                        .kh = 5,
                        .kw = 5,
                        .oh = 28,
                        .ow = 28,
                        .p = {{1, 1}, {2, 2}, {1, 1}, 1}};
    int64_t per_thread = 1 * 32 * 36 * 4 + 6 * 28 * 32 * 4 + 156 * 64;
    assert_int_equal(kpl__conv_direct_scratch(&a, 2), 3 * 156 * 8 + 2 * per_thread);
    /* its forward: the packed weights (one block of 8 channels) and a
     * padded image a thread */
    a.kind = KPL_CONV_FWD;
    assert_int_equal(kpl__conv_direct_scratch(&a, 1), 8 * 1 * 25 * 4 + 1 * 32 * 36 * 4);
    kpl_conv2d_params p = {{1, 1}, {1, 1}, {1, 1}, 1};
    kpl_tensor *x = trand(KPL_F32, 4, (int64_t[]){1, 512, 4, 4}, 3, -1, 1);
    kpl_tensor *gy = trand(KPL_F32, 4, (int64_t[]){1, 512, 4, 4}, 4, -1, 1);
    kpl_tensor *gw = tnew(KPL_F32, 4, (int64_t[]){512, 512, 3, 3});
    kpl__cpu_conv_only("kpl_direct");
    assert_int_equal(kpl_k_conv2d_bwd_weight(gw, NULL, x, gy, &p), KPL_EBACKEND);
    kpl__cpu_conv_only(NULL);
    OK(kpl_k_conv2d_bwd_weight(gw, NULL, x, gy, &p));
    assert_int_not_equal(strcmp(kpl__cpu_conv_last().impl, "kpl_direct"), 0);
    /* a small one forced still runs them */
    kpl_tensor *xs = trand(KPL_F32, 4, (int64_t[]){3, 1, 28, 28}, 5, -1, 1);
    kpl_tensor *gys = trand(KPL_F32, 4, (int64_t[]){3, 6, 28, 28}, 6, -1, 1);
    kpl_tensor *gws = tnew(KPL_F32, 4, (int64_t[]){6, 1, 5, 5});
    kpl_conv2d_params p5 = {{1, 1}, {2, 2}, {1, 1}, 1};
    kpl__cpu_conv_only("kpl_direct");
    OK(kpl_k_conv2d_bwd_weight(gws, NULL, xs, gys, &p5));
    assert_string_equal(kpl__cpu_conv_last().impl, "kpl_direct");
    kpl__cpu_conv_only(NULL);
    kpl_tensor *all[] = {x, gy, gw, xs, gys, gws};
    for (size_t i = 0; i < 6; i++)
        kpl_tensor_release(all[i]);
}

/* The chooser bounds every training candidate's oneDNN scratchpad, not
 * only Winograd's: FCOS's 512-channel 4 x 4 weight gradient at batch 8
 * (a 262 KB activation) had gemm's 76 MB scratchpad timed, and oneDNN
 * kept that much for the process's life.  Within the bound (32 MB here)
 * unless no implementation fits it. */
static void test_conv2d_scratchpad_bound(void **state)
{
    (void)state;
    kpl_conv2d_params p = {{1, 1}, {1, 1}, {1, 1}, 1};
    kpl_tensor *x = trand(KPL_F32, 4, (int64_t[]){8, 512, 4, 4}, 7, -1, 1);
    kpl_tensor *gy = trand(KPL_F32, 4, (int64_t[]){8, 512, 4, 4}, 8, -1, 1);
    kpl_tensor *gw = tnew(KPL_F32, 4, (int64_t[]){512, 512, 3, 3});
    bool past = false;
    (void)kpl__cpu_conv_tried_scratch(NULL);
    OK(kpl_k_conv2d_bwd_weight(gw, NULL, x, gy, &p));
    int64_t tried = kpl__cpu_conv_tried_scratch(&past);
    printf("scratchpad bound: largest candidate %.1f MB (%s), chosen %s\n", (double)tried / 1e6,
           past ? "none fitted 32 MB" : "within 32 MB", kpl__cpu_conv_last().impl);
    assert_true(tried <= ((int64_t)32 << 20));
    /* oneDNN's direct kernels fit (gemm's 76 MB does not); below AVX2
     * (ONEDNN_MAX_CPU_ISA=SSE41) it has none, and gemm runs past the bound */
    if (past) assert_non_null(strstr(kpl__cpu_conv_last().impl, "gemm"));
    /* gemm alone: none fits, so the choice goes past the bound and runs */
    kpl_tensor *x2 = trand(KPL_F32, 4, (int64_t[]){8, 512, 4, 4}, 9, -1, 1);
    kpl__cpu_conv_only("x64:gemm");
    kpl_status st = kpl_k_conv2d_bwd_weight(gw, NULL, x2, gy, &p);
    kpl__cpu_conv_only(NULL);
    OK(st);
    tried = kpl__cpu_conv_tried_scratch(&past);
    printf("gemm alone: %s, chosen %s\n", past ? "past the bound" : "within it",
           kpl__cpu_conv_last().impl);
    assert_true(past);
    assert_non_null(strstr(kpl__cpu_conv_last().impl, "gemm"));
    kpl_tensor *all[] = {x, gy, gw, x2};
    for (size_t i = 0; i < 4; i++)
        kpl_tensor_release(all[i]);
}

int run_conv_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conv2d_by_hand),
        cmocka_unit_test(test_conv2d_onednn_vs_reference),
        cmocka_unit_test(test_conv2d_relu_kernels),
        cmocka_unit_test(test_conv2d_winograd),
        cmocka_unit_test(test_conv2d_direct_scratch_bound),
        cmocka_unit_test(test_conv2d_scratchpad_bound),
        cmocka_unit_test(test_conv2d_dilated_nhwc),
        cmocka_unit_test(test_conv2d_direct_vs_reference),
    };
    return cmocka_run_group_tests_name("conv", tests, NULL, NULL);
}
