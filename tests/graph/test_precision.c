/*
 * test_precision.c — mixed precision: the autocast policy (which ops run
 * low, which stay f32, what dtype each result has, that parameters' gradients
 * come back f32) and the low-precision convolution and matmul kernels
 * against f32 within a bound derived from the format.
 *
 * The bound: with inputs rounded to a format of unit roundoff u (bf16 2^-8,
 * f16 2^-11) and f32 accumulation, an output y = sum_k a_k b_k differs from
 * the f32 result by at most 2u sum_k |a_k b_k| (both factors rounded) plus u
 * |y| (the result rounded), plus f32's own accumulation error.  The same op
 * on |a| and |b| gives sum_k |a_k b_k| per element.
 *
 * Batch norm and the element-wise ops on f16/bf16 are checked exactly:
 * they compute in f32 (or double) on the widened values and round once.
 *
 * Run twice by ctest: natively, and with ONEDNN_MAX_CPU_ISA=AVX2, where
 * bf16 has no native kernel and is computed in f32 (the same bound holds).
 */
#include "kpl_test.h"

#include "autograd.h"
#include "kernels_impl.h"

#include <ctype.h>
#include <stdlib.h>

static kpl_device *cpu;
static kpl_rng *rng;

static double unit_roundoff(kpl_dtype dt) { return dt == KPL_BF16 ? 0x1p-8 : 0x1p-11; }

static kpl_tensor *randn(int nd, const int64_t *shape)
{
    return NN(kpl_randn(cpu, KPL_F32, nd, shape, rng, 0, 1));
}

/* y_low (any dtype) against y (f32) within 2u * mag + u |y| + 1e-5 mag. */
static void assert_within_format(kpl_tensor *y_low, kpl_tensor *y, kpl_tensor *mag,
                                 kpl_dtype dt, const char *what)
{
    double u = unit_roundoff(dt);
    int64_t n = kpl_tensor_numel(y);
    assert_int_equal(kpl_tensor_numel(y_low), n);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++) {
        double a = tget(y_low, i), b = tget(y, i), m = tget(mag, i);
        double tol = 2 * u * m + u * fabs(b) + 1e-5 * m;
        if (!(fabs(a - b) <= tol))
            fail_msg("%s[%lld]: %s gives %.9g, f32 %.9g (bound %.3g)", what, (long long)i,
                     kpl_dtype_name(dt), a, b, tol);
        differ += a != b;
    }
    /* the low format really was used: most outputs are not f32's */
    if (differ < n / 2)
        fail_msg("%s: only %lld of %lld %s outputs differ from f32", what, (long long)differ,
                 (long long)n, kpl_dtype_name(dt));
}

static kpl_tensor *as(kpl_tensor *t, kpl_dtype dt) { return NN(kpl_cast(t, dt)); }

static void test_policy_table(void **state)
{
    (void)state;
    assert_int_equal(kpl_autocast_class_of(KPL_OP_MATMUL), KPL_AUTOCAST_LOW);
    assert_int_equal(kpl_autocast_class_of(KPL_OP_CONV2D), KPL_AUTOCAST_LOW);
    assert_int_equal(kpl_autocast_class_of(KPL_OP_CONV2D_BWD_DATA), KPL_AUTOCAST_LOW);
    const kpl_op f32_ops[] = {KPL_OP_SUM, KPL_OP_MEAN, KPL_OP_VAR, KPL_OP_LOGSUMEXP,
                              KPL_OP_EXP, KPL_OP_LOG, KPL_OP_POW, KPL_OP_SOFTPLUS};
    for (size_t i = 0; i < sizeof f32_ops / sizeof *f32_ops; i++)
        assert_int_equal(kpl_autocast_class_of(f32_ops[i]), KPL_AUTOCAST_F32);
    const kpl_op keep[] = {KPL_OP_RELU, KPL_OP_RESHAPE, KPL_OP_PERMUTE, KPL_OP_CAST,
                           KPL_OP_AVG_POOL2D, KPL_OP_PLANE_GATHER, KPL_OP_PLANE_SCATTER,
                           KPL_OP_INDEX_SELECT, KPL_OP_NEG, KPL_OP_CUSTOM};
    for (size_t i = 0; i < sizeof keep / sizeof *keep; i++)
        assert_int_equal(kpl_autocast_class_of(keep[i]), KPL_AUTOCAST_KEEP);
    assert_int_equal(kpl_autocast_class_of(KPL_OP_BATCH_NORM), KPL_AUTOCAST_MIXED);
    assert_int_equal(kpl_autocast_class_of(KPL_OP_ADD), KPL_AUTOCAST_PROMOTE);
    assert_int_equal(kpl_autocast_class_of(KPL_OP_WHERE), KPL_AUTOCAST_PROMOTE);
    assert_int_equal(kpl_autocast_class_of(KPL_OP_COUNT), KPL_AUTOCAST_KEEP);

    assert_int_equal(kpl_autocast_dtype(), KPL_F32);
    kpl_dtype prev = KPL_I64;
    OK(kpl_set_autocast(KPL_BF16, &prev));
    assert_int_equal(prev, KPL_F32);
    assert_int_equal(kpl_autocast_dtype(), KPL_BF16);
    FAILS(kpl_set_autocast(KPL_I64, NULL), KPL_EDTYPE, "not a precision");
    assert_int_equal(kpl_autocast_dtype(), KPL_BF16);
    OK(kpl_set_autocast(KPL_F32, NULL));
}

/* What each op makes of its inputs' dtypes under autocast. */
static void test_result_dtypes(void **state)
{
    (void)state;
    kpl_pool *pool = kpl_pool_push();
    int64_t xs[4] = {2, 3, 6, 6}, ws[4] = {4, 3, 3, 3}, bs[1] = {4};
    kpl_tensor *x = randn(4, xs), *w = randn(4, ws), *b = randn(1, bs);
    kpl_conv2d_params p = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    const kpl_dtype lows[2] = {KPL_BF16, KPL_F16};
    for (int l = 0; l < 2; l++) {
        kpl_dtype lo = lows[l];
        OK(kpl_set_autocast(lo, NULL));
        kpl_tensor *y = NN(kpl_conv2d(x, w, b, &p));
        assert_int_equal(kpl_tensor_dtype(y), lo);
        assert_int_equal(kpl_tensor_dtype(NN(kpl_relu(y))), lo);      /* keep */
        assert_int_equal(kpl_tensor_dtype(NN(kpl_reshape(y, 2, (int64_t[]){2, 144}))), lo);
        assert_int_equal(kpl_tensor_dtype(NN(kpl_add(y, y))), lo);    /* same dtypes */
        kpl_tensor *f = randn(4, (int64_t[]){2, 4, 6, 6});
        assert_int_equal(kpl_tensor_dtype(NN(kpl_add(y, f))), KPL_F32); /* promote */
        assert_int_equal(kpl_tensor_dtype(NN(kpl_sub(f, y))), KPL_F32);
        assert_int_equal(kpl_tensor_dtype(NN(kpl_sum(y, NULL, 0, false))), KPL_F32);
        assert_int_equal(kpl_tensor_dtype(NN(kpl_exp(y))), KPL_F32);
        /* batch norm keeps low activations (f32 statistics and running
         * statistics); eval mode's composed form runs in f32 */
        kpl_tensor *rm = NN(kpl_full(cpu, KPL_F32, 1, (int64_t[]){4}, 0));
        kpl_tensor *rv = NN(kpl_full(cpu, KPL_F32, 1, (int64_t[]){4}, 1));
        kpl_tensor *bn = NN(kpl_batch_norm(y, NULL, NULL, rm, rv, true, 0.5, 1e-5));
        assert_int_equal(kpl_tensor_dtype(bn), lo);
        assert_int_equal(kpl_tensor_dtype(rm), KPL_F32);
        assert_true(tget(rm, 0) != 0 && tget(rv, 0) != 1); /* updated from the batch */
        assert_int_equal(kpl_tensor_dtype(NN(kpl_batch_norm(y, NULL, NULL, rm, rv, false, 0.1,
                                                            1e-5))),
                         KPL_F32);
        kpl_pool2d_params pp = {.kernel = {2, 2}, .stride = {2, 2}};
        assert_int_equal(kpl_tensor_dtype(NN(kpl_max_pool2d(y, &pp))), lo); /* keep */
        assert_int_equal(kpl_tensor_dtype(NN(kpl_avg_pool2d(y, &pp))), lo);
        kpl_tensor *h = NN(kpl_reshape(y, 2, (int64_t[]){2, 144}));
        kpl_tensor *lw = randn(2, (int64_t[]){5, 144}), *lb = randn(1, (int64_t[]){5});
        kpl_tensor *logits = NN(kpl_linear(h, lw, lb));
        assert_int_equal(kpl_tensor_dtype(logits), lo);
        int64_t lab[2] = {1, 4};
        kpl_tensor *labels = NULL;
        OK(kpl_tensor_from_data(cpu, KPL_I64, 1, (int64_t[]){2}, lab, &labels));
        kpl_autorelease(labels);
        kpl_tensor *loss = NN(kpl_cross_entropy(logits, labels, KPL_REDUCE_MEAN, 0, -100));
        assert_int_equal(kpl_tensor_dtype(loss), KPL_F32);
        OK(kpl_set_autocast(KPL_F32, NULL));
        assert_int_equal(kpl_tensor_dtype(NN(kpl_conv2d(x, w, b, &p))), KPL_F32);
        /* f64 is never lowered (gradient checks ask for it) */
        OK(kpl_set_autocast(lo, NULL));
        kpl_tensor *x64 = as(x, KPL_F64), *w64 = as(w, KPL_F64);
        assert_int_equal(kpl_tensor_dtype(NN(kpl_conv2d(x64, w64, NULL, &p))), KPL_F64);
        OK(kpl_set_autocast(KPL_F32, NULL));
    }
    kpl_pool_pop(pool);
}

/* A small conv net's gradients under autocast: f32 (the parameters' dtype)
 * and within the format's reach of the f32 gradients. */
static void test_gradients_come_back_f32(void **state)
{
    (void)state;
    const kpl_dtype lows[2] = {KPL_BF16, KPL_F16};
    for (int l = 0; l < 2; l++) {
        kpl_pool *pool = kpl_pool_push();
        kpl_tensor *x = randn(4, (int64_t[]){4, 2, 8, 8});
        kpl_tensor *w = randn(4, (int64_t[]){6, 2, 3, 3}), *lw = randn(2, (int64_t[]){3, 96});
        kpl_tensor *gamma = NN(kpl_rand(cpu, KPL_F32, 1, (int64_t[]){6}, rng, 0.5, 1.5));
        kpl_tensor *beta = randn(1, (int64_t[]){6});
        kpl_tensor *ps[4] = {w, lw, gamma, beta};
        for (int i = 0; i < 4; i++) OK(kpl_set_requires_grad(ps[i], true));
        kpl_conv2d_params p = {.stride = {2, 2}, .padding = {1, 1}, .dilation = {1, 1},
                               .groups = 1};
        int64_t lab[4] = {0, 2, 1, 2};
        kpl_tensor *labels = NULL;
        OK(kpl_tensor_from_data(cpu, KPL_I64, 1, (int64_t[]){4}, lab, &labels));
        kpl_autorelease(labels);
        kpl_tensor *g32[4], *glo[4];
        for (int pass = 0; pass < 2; pass++) {
            OK(kpl_set_autocast(pass ? lows[l] : KPL_F32, NULL));
            kpl_tensor *c = NN(kpl_conv2d(x, w, NULL, &p));
            kpl_tensor *bn = NN(kpl_batch_norm(c, gamma, beta, NULL, NULL, true, 0.1, 1e-5));
            kpl_tensor *h = NN(kpl_relu(bn));
            kpl_tensor *logits = NN(kpl_linear(NN(kpl_reshape(h, 2, (int64_t[]){4, 96})), lw,
                                               NULL));
            kpl_tensor *loss = NN(kpl_cross_entropy(logits, labels, KPL_REDUCE_MEAN, 0, -100));
            OK(kpl_set_autocast(KPL_F32, NULL));
            kpl_tensor **out = pass ? glo : g32;
            OK(kpl_grad(loss, NULL, 4, ps, false, out));
        }
        for (int i = 0; i < 4; i++) {
            assert_int_equal(kpl_tensor_dtype(glo[i]), KPL_F32);
            double worst = 0, scale = 0;
            for (int64_t j = 0; j < kpl_tensor_numel(g32[i]); j++) {
                double d = fabs(tget(glo[i], j) - tget(g32[i], j));
                worst = d > worst ? d : worst;
                scale = fabs(tget(g32[i], j)) > scale ? fabs(tget(g32[i], j)) : scale;
            }
            /* a few roundings of u each along the chain, relative to the
             * largest gradient; and not bit-identical (low math was used) */
            if (!(worst <= 16 * unit_roundoff(lows[l]) * scale) || worst == 0)
                fail_msg("%s: parameter %d's gradient is off by %.3g (largest %.3g)",
                         kpl_dtype_name(lows[l]), i, worst, scale);
        }
        kpl_pool_pop(pool);
    }
}

typedef struct {
    int64_t x[4], w[4];
    kpl_conv2d_params p;
} conv_case;

/* Forward, backward data and backward weights of one convolution in `dt`
 * against f32 within the format's bound. */
static void conv_against_f32(const conv_case *c, kpl_dtype dt)
{
    kpl_pool *pool = kpl_pool_push();
    kpl_tensor *x = randn(4, c->x), *w = randn(4, c->w);
    kpl_tensor *b = randn(1, (int64_t[]){c->w[0]});
    kpl_tensor *ax = NN(kpl_abs(x)), *aw = NN(kpl_abs(w)), *ab = NN(kpl_abs(b));
    kpl_tensor *y = NN(kpl_conv2d(x, w, b, &c->p));
    kpl_tensor *ylo = NN(kpl_conv2d(as(x, dt), as(w, dt), as(b, dt), &c->p));
    assert_int_equal(kpl_tensor_dtype(ylo), dt);
    assert_within_format(ylo, y, NN(kpl_conv2d(ax, aw, ab, &c->p)), dt, "conv2d forward");

    kpl_tensor *gy = randn(4, kpl_tensor_shape(y)), *agy = NN(kpl_abs(gy));
    kpl_tensor *gx = NN(kpl_conv2d_bwd_data(gy, w, c->x, &c->p));
    kpl_tensor *gxlo = NN(kpl_conv2d_bwd_data(as(gy, dt), as(w, dt), c->x, &c->p));
    assert_within_format(gxlo, gx, NN(kpl_conv2d_bwd_data(agy, aw, c->x, &c->p)), dt,
                         "conv2d backward data");

    kpl_tensor *gw = NN(kpl_conv2d_bwd_weight(x, gy, c->w, &c->p));
    kpl_tensor *gwlo = NN(kpl_conv2d_bwd_weight(as(x, dt), as(gy, dt), c->w, &c->p));
    assert_within_format(gwlo, gw, NN(kpl_conv2d_bwd_weight(ax, agy, c->w, &c->p)), dt,
                         "conv2d backward weights");

    /* the bias gradient through the kernel call that writes it */
    kpl_tensor *gw2 = NN(kpl_empty(cpu, dt, 4, c->w)), *gb = NN(kpl_empty(cpu, dt, 1, &c->w[0]));
    OK(kpl_k_conv2d_bwd_weight(gw2, gb, as(x, dt), as(gy, dt), &c->p));
    kpl_tensor *gb32 = NN(kpl_sum(gy, (int[]){0, 2, 3}, 3, false));
    kpl_tensor *agb = NN(kpl_sum(agy, (int[]){0, 2, 3}, 3, false));
    double u = unit_roundoff(dt);
    for (int64_t o = 0; o < c->w[0]; o++) {
        double m = tget(agb, o), ref = tget(gb32, o);
        assert_close(tget(gb, o), ref, 0, 2 * u * m + u * fabs(ref) + 1e-5 * m, "bias gradient",
                     o);
    }
    kpl_pool_pop(pool);
}

static const conv_case conv_cases[] = {
    {{2, 3, 9, 9}, {8, 3, 3, 3}, {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1}},
    {{3, 16, 8, 10}, {32, 16, 3, 3}, {.stride = {2, 2}, .padding = {1, 0}, .dilation = {1, 1}, .groups = 1}},
    {{2, 8, 7, 7}, {8, 2, 3, 3}, {.stride = {1, 1}, .padding = {2, 2}, .dilation = {2, 2}, .groups = 4}},
    {{4, 64, 6, 6}, {64, 64, 1, 1}, {.stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1}},
};

static void test_conv_bf16(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof conv_cases / sizeof *conv_cases; i++)
        conv_against_f32(&conv_cases[i], KPL_BF16);
    print_message("bf16 convolution under %s: last kernel %s\n", kpl_cpu_math_info(),
                  kpl__cpu_conv_last().impl);
}

static void test_conv_f16(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof conv_cases / sizeof *conv_cases; i++)
        conv_against_f32(&conv_cases[i], KPL_F16);
}

static void matmul_against_f32(const int64_t *as_, int na, const int64_t *bs_, int nb, bool ta,
                               bool tb, kpl_dtype dt)
{
    kpl_pool *pool = kpl_pool_push();
    kpl_tensor *a = randn(na, as_), *b = randn(nb, bs_);
    kpl_tensor *y = NN(kpl_matmul(a, b, ta, tb));
    kpl_tensor *ylo = NN(kpl_matmul(as(a, dt), as(b, dt), ta, tb));
    assert_int_equal(kpl_tensor_dtype(ylo), dt);
    kpl_tensor *mag = NN(kpl_matmul(NN(kpl_abs(a)), NN(kpl_abs(b)), ta, tb));
    assert_within_format(ylo, y, mag, dt, "matmul");
    kpl_pool_pop(pool);
}

static void test_matmul_low(void **state)
{
    (void)state;
    const kpl_dtype dts[2] = {KPL_BF16, KPL_F16};
    for (int d = 0; d < 2; d++) {
        matmul_against_f32((int64_t[]){33, 70}, 2, (int64_t[]){70, 17}, 2, false, false, dts[d]);
        matmul_against_f32((int64_t[]){70, 33}, 2, (int64_t[]){17, 70}, 2, true, true, dts[d]);
        matmul_against_f32((int64_t[]){3, 20, 64}, 3, (int64_t[]){64, 9}, 2, false, false,
                           dts[d]);
        matmul_against_f32((int64_t[]){4, 16, 24}, 3, (int64_t[]){4, 16, 24}, 3, false, true,
                           dts[d]);
    }
}

/* Where every value and sum is exact in the format (small integers), the
 * low-precision result equals f32's bit for bit. */
static void test_exact_cases(void **state)
{
    (void)state;
    const kpl_dtype dts[2] = {KPL_BF16, KPL_F16};
    for (int d = 0; d < 2; d++) {
        kpl_pool *pool = kpl_pool_push();
        kpl_tensor *x = NN(kpl_rand(cpu, KPL_F32, 4, (int64_t[]){2, 4, 5, 5}, rng, -3, 3));
        kpl_tensor *w = NN(kpl_rand(cpu, KPL_F32, 4, (int64_t[]){3, 4, 2, 2}, rng, -2, 2));
        /* integers in [-2, 2]: every product sum stays below 2^8 */
        x = NN(kpl_scalar_op(KPL_BIN_MINIMUM, NN(kpl_scalar_op(KPL_BIN_MAXIMUM, x, -2, false)), 2,
                             false));
        kpl_tensor *xi = NN(kpl_cast(NN(kpl_cast(x, KPL_I64)), KPL_F32));
        kpl_tensor *wi = NN(kpl_cast(NN(kpl_cast(w, KPL_I64)), KPL_F32));
        kpl_conv2d_params p = {.stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1},
                               .groups = 1};
        kpl_tensor *y = NN(kpl_conv2d(xi, wi, NULL, &p));
        kpl_tensor *ylo = NN(kpl_conv2d(as(xi, dts[d]), as(wi, dts[d]), NULL, &p));
        for (int64_t i = 0; i < kpl_tensor_numel(y); i++)
            assert_true(tget(ylo, i) == tget(y, i));
        kpl_tensor *m = NN(kpl_reshape(xi, 2, (int64_t[]){10, 20}));
        kpl_tensor *mm = NN(kpl_matmul(m, m, false, true));
        kpl_tensor *mmlo = NN(kpl_matmul(as(m, dts[d]), as(m, dts[d]), false, true));
        for (int64_t i = 0; i < kpl_tensor_numel(mm); i++)
            assert_true(tget(mmlo, i) == tget(mm, i));
        kpl_pool_pop(pool);
    }
}

/* Batch norm on f16/bf16 activations (f32 gamma, beta and statistics):
 * the sums are the f32 kernel's double sums of the same widened values,
 * so on inputs already rounded to the format, y and the input gradient
 * are exactly the f32 kernel's results rounded once, and the statistics
 * and parameter gradients are equal. */
static void test_batch_norm_low(void **state)
{
    (void)state;
    const kpl_dtype dts[2] = {KPL_BF16, KPL_F16};
    const int64_t shapes[3][4] = {{3, 5, 4, 6}, {8, 3, 1, 1}, {2, 4, 33, 1}};
    for (int d = 0; d < 2; d++)
        for (int s = 0; s < 3; s++) {
            kpl_pool *pool = kpl_pool_push();
            kpl_dtype dt = dts[d];
            const int64_t *sh = shapes[s];
            int64_t c = sh[1];
            /* a large mean: the statistics must not cancel */
            kpl_tensor *x = as(NN(kpl_randn(cpu, KPL_F32, 4, sh, rng, 3, 2)), dt);
            kpl_tensor *gy = as(randn(4, sh), dt);
            kpl_tensor *x32 = as(x, KPL_F32), *gy32 = as(gy, KPL_F32);
            kpl_tensor *g = NN(kpl_rand(cpu, KPL_F32, 1, &c, rng, 0.5, 2));
            kpl_tensor *b = randn(1, &c);
            kpl_tensor *v[2][7]; /* y, mean, var, gx, gg, gb per precision */
            for (int k = 0; k < 2; k++) {
                kpl_dtype adt = k ? dt : KPL_F32;
                v[k][0] = NN(kpl_empty(cpu, adt, 4, sh));
                v[k][3] = NN(kpl_empty(cpu, adt, 4, sh));
                for (int i = 1; i < 7; i++)
                    if (i != 3) v[k][i] = NN(kpl_empty(cpu, KPL_F32, 1, &c));
                OK(kpl_k_batch_norm(v[k][0], v[k][1], v[k][2], k ? x : x32, g, b, 1e-5));
                OK(kpl_k_batch_norm_bwd(v[k][3], v[k][4], v[k][5], k ? x : x32, k ? gy : gy32,
                                        g, 1e-5));
            }
            kpl_tensor *y_ref = as(v[0][0], dt), *gx_ref = as(v[0][3], dt);
            for (int64_t i = 0; i < kpl_tensor_numel(x); i++) {
                if (tget(v[1][0], i) != tget(y_ref, i))
                    fail_msg("%s batch_norm y[%lld] = %.9g, f32 rounded %.9g", kpl_dtype_name(dt),
                             (long long)i, tget(v[1][0], i), tget(y_ref, i));
                if (tget(v[1][3], i) != tget(gx_ref, i))
                    fail_msg("%s batch_norm gx[%lld] = %.9g, f32 rounded %.9g", kpl_dtype_name(dt),
                             (long long)i, tget(v[1][3], i), tget(gx_ref, i));
            }
            for (int i = 1; i < 6; i++)
                if (i != 3)
                    for (int64_t j = 0; j < c; j++)
                        assert_true(tget(v[1][i], j) == tget(v[0][i], j));
            /* f16/bf16 statistics vectors are refused, with their name */
            kpl_tensor *glo = as(g, dt);
            FAILS(kpl_k_batch_norm(v[1][0], NULL, NULL, x, glo, b, 1e-5), KPL_EDTYPE, "gamma");
            kpl_pool_pop(pool);
        }
}

/* Pooling on f16/bf16 (each plane widened to f32, pooled, rounded once):
 * max pooling, its indices, the gather and the scatter of its backward
 * equal the f32 kernels' exactly; average pooling and its backward equal
 * the f32 results rounded once. */
static void test_pool_low(void **state)
{
    (void)state;
    const kpl_dtype dts[2] = {KPL_BF16, KPL_F16};
    const kpl_pool2d_params ps[3] = {
        {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}, /* ResNet's stem */
        {.kernel = {2, 2}, .stride = {2, 2}},                    /* the fast 2x2 path */
        {.kernel = {3, 2}, .stride = {1, 2}, .padding = {1, 0}, .ceil_mode = true},
    };
    const int64_t xs[4] = {2, 3, 9, 11};
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 3; k++) {
            kpl_pool *pool = kpl_pool_push();
            kpl_dtype dt = dts[d];
            const kpl_pool2d_params *p = &ps[k];
            kpl_tensor *x = as(randn(4, xs), dt), *x32 = as(x, KPL_F32);
            int64_t ys[4];
            OK(kpl_shape_pool2d(xs, p, ys));
            kpl_tensor *y = NN(kpl_empty(cpu, dt, 4, ys)), *y32 = NN(kpl_empty(cpu, KPL_F32, 4, ys));
            kpl_tensor *i = NN(kpl_empty(cpu, KPL_I64, 4, ys)), *i32 = NN(kpl_empty(cpu, KPL_I64, 4, ys));
            OK(kpl_k_max_pool2d(y, i, x, p));
            OK(kpl_k_max_pool2d(y32, i32, x32, p));
            kpl_tensor *gy = as(randn(4, ys), dt), *gy32 = as(gy, KPL_F32);
            kpl_tensor *g = NN(kpl_empty(cpu, dt, 4, ys)), *g32 = NN(kpl_empty(cpu, KPL_F32, 4, ys));
            OK(kpl_k_plane_gather(g, x, i));
            OK(kpl_k_plane_gather(g32, x32, i32));
            kpl_tensor *gx = NN(kpl_empty(cpu, dt, 4, xs)), *gx32 = NN(kpl_empty(cpu, KPL_F32, 4, xs));
            OK(kpl_k_plane_scatter(gx, gy, i));
            OK(kpl_k_plane_scatter(gx32, gy32, i32));
            kpl_tensor *a = NN(kpl_empty(cpu, dt, 4, ys)), *a32 = NN(kpl_empty(cpu, KPL_F32, 4, ys));
            OK(kpl_k_avg_pool2d(a, x, p));
            OK(kpl_k_avg_pool2d(a32, x32, p));
            kpl_tensor *ab = NN(kpl_empty(cpu, dt, 4, xs)), *ab32 = NN(kpl_empty(cpu, KPL_F32, 4, xs));
            OK(kpl_k_avg_pool2d_bwd(ab, gy, p));
            OK(kpl_k_avg_pool2d_bwd(ab32, gy32, p));
            kpl_tensor *got[6] = {y, i, g, gx, a, ab};
            kpl_tensor *want[6] = {y32, i32, g32, as(gx32, dt), as(a32, dt), as(ab32, dt)};
            const char *what[6] = {"max", "argmax", "gather", "scatter", "avg", "avg_bwd"};
            for (int r = 0; r < 6; r++)
                for (int64_t j = 0; j < kpl_tensor_numel(want[r]); j++)
                    if (tget(got[r], j) != tget(want[r], j))
                        fail_msg("%s %s (params %d)[%lld] = %.9g, f32 %.9g", kpl_dtype_name(dt),
                                 what[r], k, (long long)j, tget(got[r], j), tget(want[r], j));
            kpl_pool_pop(pool);
        }
}

/* The CPU's element-wise loops on f16/bf16: every op equals the f32 op on
 * the widened inputs, rounded once (what the f32 detour computed), across
 * broadcasts, scalars on either side, blocks longer than the stack block,
 * and in place. */
static void test_eltwise_low(void **state)
{
    (void)state;
    const kpl_dtype dts[2] = {KPL_BF16, KPL_F16};
    const int64_t sa[2] = {3, 1100}, sbs[3][2] = {{3, 1100}, {1, 1100}, {3, 1}};
    for (int d = 0; d < 2; d++) {
        kpl_pool *pool = kpl_pool_push();
        kpl_dtype dt = dts[d];
        kpl_tensor *a = as(NN(kpl_rand(cpu, KPL_F32, 2, sa, rng, 0.1, 3)), dt);
        kpl_tensor *a32 = as(a, KPL_F32);
        kpl_tensor *out = NN(kpl_empty(cpu, dt, 2, sa)), *o32 = NN(kpl_empty(cpu, KPL_F32, 2, sa));
        kpl_tensor *ob = NN(kpl_empty(cpu, KPL_BOOL, 2, sa)), *ob32 = NN(kpl_empty(cpu, KPL_BOOL, 2, sa));
        for (int u = 0; u < KPL_UNARY_COUNT; u++) {
            OK(kpl_k_unary(out, (kpl_unary_op)u, a, 0.5, 2.0));
            OK(kpl_k_unary(o32, (kpl_unary_op)u, a32, 0.5, 2.0));
            kpl_tensor *ref = as(o32, dt);
            for (int64_t i = 0; i < kpl_tensor_numel(out); i++)
                if (!(tget(out, i) == tget(ref, i) || (isnan(tget(out, i)) && isnan(tget(ref, i)))))
                    fail_msg("%s %s[%lld] = %.9g, f32 rounded %.9g", kpl_dtype_name(dt),
                             kpl_unary_name((kpl_unary_op)u), (long long)i, tget(out, i),
                             tget(ref, i));
        }
        for (int bs = 0; bs < 3; bs++) {
            kpl_tensor *b = as(NN(kpl_rand(cpu, KPL_F32, 2, sbs[bs], rng, -2, 2)), dt);
            kpl_tensor *b32 = as(b, KPL_F32);
            for (int op = 0; op < KPL_BINARY_COUNT; op++) {
                /* tensor op tensor, then the scalar forms (bs = 0 only) */
                for (int form = 0; form < (bs ? 1 : 3); form++) {
                    bool cmp = kpl_binary_is_compare((kpl_binary_op)op);
                    kpl_tensor *o = cmp ? ob : out, *r = cmp ? ob32 : o32;
                    if (form == 0) {
                        OK(kpl_k_binary(o, (kpl_binary_op)op, a, b));
                        OK(kpl_k_binary(r, (kpl_binary_op)op, a32, b32));
                    } else {
                        OK(kpl_k_binary_scalar(o, (kpl_binary_op)op, a, 1.3, form == 2));
                        OK(kpl_k_binary_scalar(r, (kpl_binary_op)op, a32, 1.3, form == 2));
                    }
                    kpl_tensor *ref = cmp ? r : as(r, dt);
                    for (int64_t i = 0; i < kpl_tensor_numel(o); i++) {
                        double x = tget(o, i), y = tget(ref, i);
                        if (!(x == y || (isnan(x) && isnan(y))))
                            fail_msg("%s %s (b %lldx%lld, form %d)[%lld] = %.9g, f32 rounded %.9g",
                                     kpl_dtype_name(dt), kpl_binary_name((kpl_binary_op)op),
                                     (long long)sbs[bs][0], (long long)sbs[bs][1], form,
                                     (long long)i, x, y);
                    }
                }
            }
        }
        /* in place: a += a */
        kpl_tensor *c = as(a32, dt), *twice = as(NN(kpl_add(a32, a32)), dt);
        OK(kpl_k_binary(c, KPL_BIN_ADD, c, c));
        for (int64_t i = 0; i < kpl_tensor_numel(c); i++) assert_true(tget(c, i) == tget(twice, i));
        kpl_pool_pop(pool);
    }
}

/* Native bf16 kernels exist exactly where the CPU (as oneDNN is allowed to
 * use it) has AVX512-BF16; f16 is never native on the CPU. */
static void test_native_where_expected(void **state)
{
    (void)state;
    const char *info = kpl_cpu_math_info();
    print_message("cpu: %s\n", info);
    const char *max_isa = getenv("ONEDNN_MAX_CPU_ISA");
    /* a cap below AVX512_CORE_BF16 (AVX2, AVX512_CORE, ..._VNNI) takes bf16 away */
    char cap[64] = "";
    for (size_t i = 0; max_isa && max_isa[i] && i + 1 < sizeof cap; i++)
        cap[i] = (char)toupper((unsigned char)max_isa[i]);
    bool limited = cap[0] && strcmp(cap, "ALL") != 0 && !strstr(cap, "BF16") && !strstr(cap, "AMX");
    bool flag = strstr(info, "avx512_bf16") != NULL;
    assert_int_equal(kpl_precision_native(KPL_DEVICE_CPU, KPL_BF16), flag && !limited);
    assert_false(kpl_precision_native(KPL_DEVICE_CPU, KPL_F16));
    assert_true(kpl_precision_native(KPL_DEVICE_CPU, KPL_F32));
    assert_non_null(strstr(info, kpl_precision_native(KPL_DEVICE_CPU, KPL_BF16) ? "bf16 native"
                                                                                  : "bf16 emulated"));
}

int main(void)
{
    cpu = kpl_device_cpu();
    rng = kpl_rng_create(1234);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_policy_table),
        cmocka_unit_test(test_result_dtypes),
        cmocka_unit_test(test_gradients_come_back_f32),
        cmocka_unit_test(test_conv_bf16),
        cmocka_unit_test(test_conv_f16),
        cmocka_unit_test(test_matmul_low),
        cmocka_unit_test(test_exact_cases),
        cmocka_unit_test(test_batch_norm_low),
        cmocka_unit_test(test_eltwise_low),
        cmocka_unit_test(test_pool_low),
        cmocka_unit_test(test_native_where_expected),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    kpl_rng_destroy(rng);
    return rc;
}
