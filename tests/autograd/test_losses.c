/* test_losses.c — linear, softmax and the losses of graph/nn.c: values
 * against hand computations, gradients against finite differences, and
 * the errors of bad labels. */
#include "ag_test.h"

int run_loss_tests(void);

static kpl_tensor *labels3(void)
{
    int64_t n = 3, v[3] = {2, 0, 1};
    kpl_tensor *l = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &n, v, &l));
    return kpl_autorelease(l);
}

static void test_values(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s13[2] = {1, 3};
    double v[3] = {1, 2, 3};
    kpl_tensor *x = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 2, s13, v, &x));
    kpl_autorelease(x);
    kpl_tensor *sm = NN(kpl_softmax(x, 1));
    double z = exp(1) + exp(2) + exp(3);
    assert_float_equal(tget(sm, 2), exp(3) / z, 1e-12);
    kpl_tensor *ls = NN(kpl_log_softmax(x, -1));
    assert_float_equal(tget(ls, 0), 1 - log(z), 1e-12);
    /* cross entropy of (3, 4) logits, labels (2, 0, 1), by hand */
    int64_t s34[2] = {3, 4};
    double lv[12] = {0.1, 0.2, 0.3, 0.4, 1, -1, 0, 2, 0.5, 0.5, -0.5, 0};
    kpl_tensor *lg = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 2, s34, lv, &lg));
    kpl_autorelease(lg);
    const int lab[3] = {2, 0, 1};
    double per[3], smooth[3], sum = 0;
    for (int i = 0; i < 3; i++) {
        double zz = 0, mlp = 0;
        for (int c = 0; c < 4; c++) zz += exp(lv[i * 4 + c]);
        for (int c = 0; c < 4; c++) mlp += (lv[i * 4 + c] - log(zz)) / 4;
        per[i] = -(lv[i * 4 + lab[i]] - log(zz));
        smooth[i] = 0.9 * per[i] - 0.1 * mlp;
        sum += per[i];
    }
    kpl_tensor *lab_t = labels3();
    assert_float_equal(tget(NN(kpl_cross_entropy(lg, lab_t, KPL_REDUCE_MEAN, 0, -100)), 0), sum / 3, 1e-12);
    assert_float_equal(tget(NN(kpl_cross_entropy(lg, lab_t, KPL_REDUCE_SUM, 0, -100)), 0), sum, 1e-12);
    kpl_tensor *none = NN(kpl_cross_entropy(lg, lab_t, KPL_REDUCE_NONE, 0, -100));
    assert_float_equal(tget(none, 1), per[1], 1e-12);
    assert_float_equal(tget(NN(kpl_cross_entropy(lg, lab_t, KPL_REDUCE_MEAN, 0.1, -100)), 0),
                       (smooth[0] + smooth[1] + smooth[2]) / 3, 1e-12);
    /* ignore_index: rows labelled 0 drop out of the mean */
    assert_float_equal(tget(NN(kpl_cross_entropy(lg, lab_t, KPL_REDUCE_MEAN, 0, 0)), 0),
                       (per[0] + per[2]) / 2, 1e-12);
    /* regression losses */
    double a[3] = {1, -2, 3}, b[3] = {0.5, 0, 3.5};
    int64_t s3 = 3;
    kpl_tensor *ta = NULL, *tb = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 1, &s3, a, &ta));
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 1, &s3, b, &tb));
    kpl_autorelease(ta);
    kpl_autorelease(tb);
    assert_float_equal(tget(NN(kpl_mse_loss(ta, tb, KPL_REDUCE_MEAN)), 0), (0.25 + 4 + 0.25) / 3, 1e-12);
    assert_float_equal(tget(NN(kpl_l1_loss(ta, tb, KPL_REDUCE_SUM)), 0), 0.5 + 2 + 0.5, 1e-12);
    /* smooth l1, beta 1: 0.5*0.25, 2-0.5, 0.5*0.25 */
    assert_float_equal(tget(NN(kpl_smooth_l1_loss(ta, tb, KPL_REDUCE_SUM, 1)), 0), 0.125 + 1.5 + 0.125, 1e-12);
    /* a (3, 1) output against a (3) target is refused, not broadcast to (3, 3) */
    kpl_tensor *col = NN(kpl_reshape(ta, 2, (int64_t[]){3, 1}));
    assert_null(kpl_mse_loss(col, tb, KPL_REDUCE_MEAN));
    assert_int_equal(kpl_last_status(), KPL_ESHAPE);
    assert_non_null(strstr(kpl_last_error(), "mse_loss: target (3) must have the shape of the input (3,1)"));
    assert_null(kpl_l1_loss(col, tb, KPL_REDUCE_MEAN));
    assert_non_null(strstr(kpl_last_error(), "l1_loss: target (3)"));
    assert_null(kpl_smooth_l1_loss(col, tb, KPL_REDUCE_MEAN, 1));
    assert_non_null(strstr(kpl_last_error(), "smooth_l1_loss: target (3)"));
    /* bce with logits against the plain formula */
    double y01[3] = {1, 0, 0.5};
    kpl_tensor *ty = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 1, &s3, y01, &ty));
    kpl_autorelease(ty);
    double ref = 0;
    for (int i = 0; i < 3; i++) {
        double s = 1 / (1 + exp(-a[i]));
        ref += -(y01[i] * log(s) + (1 - y01[i]) * log(1 - s));
    }
    assert_float_equal(tget(NN(kpl_bce_with_logits(ta, ty, KPL_REDUCE_SUM)), 0), ref, 1e-12);
    /* linear: x (2, 3) @ w (4, 3)^T + b */
    int64_t s23[2] = {2, 3}, s43[2] = {4, 3}, s4 = 4;
    kpl_tensor *lx = NN(kpl_full(kpl_device_cpu(), KPL_F64, 2, s23, 1));
    kpl_tensor *lw = NN(kpl_full(kpl_device_cpu(), KPL_F64, 2, s43, 2));
    kpl_tensor *lb = NN(kpl_full(kpl_device_cpu(), KPL_F64, 1, &s4, 0.5));
    kpl_tensor *ly = NN(kpl_linear(lx, lw, lb));
    assert_int_equal(kpl_tensor_shape(ly)[1], 4);
    assert_float_equal(tget(ly, 7), 6.5, 0);
    kpl_pool_pop(p);
}

static void test_errors(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s34[2] = {3, 4}, n = 3, bad[3] = {1, 7, 0};
    kpl_tensor *lg = NN(kpl_full(kpl_device_cpu(), KPL_F32, 2, s34, 0));
    kpl_tensor *lb = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &n, bad, &lb));
    kpl_autorelease(lb);
    assert_null(kpl_cross_entropy(lg, lb, KPL_REDUCE_MEAN, 0, -100));
    assert_non_null(strstr(kpl_last_error(), "cross_entropy: label 7 in row 1 is outside [0, 4) (input (3,4))"));
    kpl_tensor *lf = NN(kpl_cast(lb, KPL_F32));
    assert_null(kpl_cross_entropy(lg, lf, KPL_REDUCE_MEAN, 0, -100));
    assert_non_null(strstr(kpl_last_error(), "labels have dtype f32, expected i64"));
    assert_null(kpl_cross_entropy(lg, lb, KPL_REDUCE_MEAN, 1.5, 7));
    assert_non_null(strstr(kpl_last_error(), "label_smoothing 1.5"));
    kpl_pool_pop(p);
}

static kpl_tensor *g_ce(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_cross_entropy(x[0], labels3(), KPL_REDUCE_MEAN, 0.1, 0);
}
static kpl_tensor *g_linear(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_tanh(kpl_linear(x[0], x[1], x[2]));
}
static kpl_tensor *g_mse(kpl_tensor *const *x, void *u) { (void)u; return kpl_mse_loss(x[0], x[1], KPL_REDUCE_MEAN); }
static kpl_tensor *g_sl1(kpl_tensor *const *x, void *u) { (void)u; return kpl_smooth_l1_loss(x[0], x[1], KPL_REDUCE_SUM, 0.5); }
static kpl_tensor *g_bce(kpl_tensor *const *x, void *u) { (void)u; return kpl_bce_with_logits(x[0], x[1], KPL_REDUCE_MEAN); }

static void test_gradients(void **state)
{
    (void)state;
    int64_t s34[2] = {3, 4}, s24[2] = {2, 4}, s54[2] = {5, 4}, s5 = 5;
    kpl_tensor *lg = param(2, s34, 1, -2, 2);
    kpl_tensor *ce[1] = {lg};
    OK(kpl_gradcheck(g_ce, NULL, 1, ce, 1, 1e-6, 1e-7, 1e-5));
    OK(kpl_gradcheck(g_ce, NULL, 1, ce, 2, 1e-6, 1e-6, 1e-5));
    /* x (2, 4), w (5, 4), b (5) */
    kpl_tensor *lin[3] = {param(2, s24, 2, -1, 1), param(2, s54, 3, -1, 1), param(1, &s5, 4, -1, 1)};
    OK(kpl_gradcheck(g_linear, NULL, 3, lin, 1, 1e-6, 1e-7, 1e-5));
    OK(kpl_gradcheck(g_linear, NULL, 3, lin, 2, 1e-6, 1e-6, 1e-5));
    kpl_tensor *r[2] = {param(2, s34, 6, -2, 2), param(2, s34, 7, -2, 2)};
    OK(kpl_gradcheck(g_mse, NULL, 2, r, 2, 1e-6, 1e-6, 1e-5));
    OK(kpl_gradcheck(g_sl1, NULL, 2, r, 1, 1e-6, 1e-6, 1e-5));
    kpl_tensor *bt[2] = {r[0], param(2, s34, 8, 0, 1)};
    OK(kpl_gradcheck(g_bce, NULL, 2, bt, 2, 1e-6, 1e-6, 1e-5));
    kpl_tensor *all[] = {lg, lin[0], lin[1], lin[2], r[0], r[1], bt[1]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kpl_tensor_release(all[i]);
}

static void test_norms_and_dropout_values(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    kpl_device *cpu = kpl_device_cpu();
    int64_t xs[4] = {4, 3, 5, 5}, s3 = 3;
    kpl_rng *rng = kpl_rng_create(9);
    kpl_tensor *x = NN(kpl_randn(cpu, KPL_F64, 4, xs, rng, 2, 3));
    kpl_tensor *rm = NULL, *rv = NULL;
    OK(kpl_tensor_zeros(cpu, KPL_F64, 1, &s3, &rm));
    OK(kpl_tensor_empty(cpu, KPL_F64, 1, &s3, &rv));
    OK(kpl_k_fill(rv, 1));
    kpl_tensor *y = NN(kpl_batch_norm(x, NULL, NULL, rm, rv, true, 0.1, 1e-5));
    int ax[3] = {0, 2, 3};
    kpl_tensor *ym = NN(kpl_mean(y, ax, 3, false)), *yv = NN(kpl_var(y, ax, 3, false, 0));
    kpl_tensor *xm = NN(kpl_mean(x, ax, 3, false)), *xv = NN(kpl_var(x, ax, 3, false, 1));
    for (int c = 0; c < 3; c++) {
        assert_float_equal(tget(ym, c), 0, 1e-12);
        assert_float_equal(tget(yv, c), 1, 1e-4); /* eps */
        assert_float_equal(tget(rm, c), 0.1 * tget(xm, c), 1e-12);
        assert_float_equal(tget(rv, c), 0.9 + 0.1 * tget(xv, c), 1e-12);
    }
    /* eval: (x - rm) / sqrt(rv + eps) */
    kpl_tensor *ye = NN(kpl_batch_norm(x, NULL, NULL, rm, rv, false, 0.1, 1e-5));
    assert_float_equal(tget(ye, 30), (tget(x, 30) - tget(rm, 1)) / sqrt(tget(rv, 1) + 1e-5), 1e-12);
    assert_null(kpl_batch_norm(x, NULL, NULL, NULL, NULL, false, 0.1, 1e-5));
    assert_non_null(strstr(kpl_last_error(), "eval mode needs the running statistics"));
    int64_t s4 = 4;
    kpl_tensor *g4 = NN(kpl_full(cpu, KPL_F64, 1, &s4, 1));
    assert_null(kpl_batch_norm(x, g4, NULL, NULL, NULL, true, 0.1, 1e-5));
    assert_non_null(strstr(kpl_last_error(), "gamma must have shape (3)"));
    /* layer norm over the last 2 dims; group norm with C groups = instance norm */
    kpl_tensor *ln = NN(kpl_layer_norm(x, 2, NULL, NULL, 1e-5));
    assert_float_equal(tget(NN(kpl_mean(ln, (int[]){2, 3}, 2, false)), 5), 0, 1e-12);
    kpl_tensor *gn = NN(kpl_group_norm(x, 3, NULL, NULL, 1e-5));
    for (int64_t i = 0; i < kpl_tensor_numel(gn); i += 17)
        assert_float_equal(tget(gn, i), tget(ln, i), 1e-12);
    assert_null(kpl_group_norm(x, 2, NULL, NULL, 1e-5));
    assert_non_null(strstr(kpl_last_error(), "3 channels do not divide into 2 groups"));
    /* dropout: ~p zeros, survivors scaled, reproducible, identity in eval */
    int64_t big = 100000;
    kpl_tensor *ones = NN(kpl_full(cpu, KPL_F32, 1, &big, 1));
    kpl_rng *r1 = kpl_rng_create(3), *r2 = kpl_rng_create(3);
    kpl_tensor *d1 = NN(kpl_dropout(ones, 0.3, true, r1)), *d2 = NN(kpl_dropout(ones, 0.3, true, r2));
    assert_memory_equal(kpl_tensor_host_data(d1), kpl_tensor_host_data(d2), (size_t)big * 4);
    double kept = tget(NN(kpl_sum(d1, NULL, 0, false)), 0) * 0.7; /* survivors count */
    assert_true(fabs(kept / (double)big - 0.7) < 0.01);
    assert_float_equal(tget(NN(kpl_max(d1, NULL, 0, false)), 0), 1 / 0.7, 1e-6);
    assert_ptr_equal(kpl_dropout(ones, 0.3, false, r1), ones);
    assert_null(kpl_dropout(ones, 1.0, true, r1));
    kpl_rng_destroy(r1);
    kpl_rng_destroy(r2);
    kpl_rng_destroy(rng);
    kpl_tensor_release(rm);
    kpl_tensor_release(rv);
    kpl_pool_pop(p);
}

static kpl_tensor *g_bn(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_batch_norm(x[0], x[1], x[2], NULL, NULL, true, 0.1, 1e-5));
}
static kpl_tensor *g_bnr(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_batch_norm_relu(x[0], x[1], x[2], NULL, NULL, true, 0.1, 1e-5));
}
static kpl_tensor *g_ln(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_layer_norm(x[0], 1, x[1], x[2], 1e-5));
}
static kpl_tensor *g_gn(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_group_norm(x[0], 2, x[1], x[2], 1e-5));
}
static kpl_tensor *g_drop(kpl_tensor *const *x, void *u)
{
    (void)u;
    kpl_rng *r = kpl_rng_create(5); /* the same mask at every evaluation */
    kpl_tensor *y = kpl_square(kpl_dropout(x[0], 0.4, true, r));
    kpl_rng_destroy(r);
    return y;
}

/* Group norm against its definition in f64 (values, gx, ggamma, gbeta for
 * a given gy): one op each way on the CPU (the fused kernels; gradients
 * without create_graph), in f64 and f32, groups of several channels, one
 * channel (instance norm), all channels (one group), one value per group
 * (y = beta), a 3-D input, and one large enough to run on several
 * threads; no gamma/beta.  Then a bad group count. */
static void test_group_norm_fused(void **state)
{
    (void)state;
    static const struct {
        int nd, groups;
        int64_t s[4];
        bool affine;
    } cases[] = {{4, 3, {2, 6, 5, 7}, true},  {4, 8, {3, 8, 1, 1}, true},
                 {4, 1, {2, 4, 3, 3}, true},  {4, 4, {2, 4, 6, 5}, false},
                 {3, 32, {1, 32, 4, 0}, true}, {4, 2, {2, 4, 67, 61}, true}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int f = 0; f < 2; f++) {
            kpl_dtype dt = f ? KPL_F32 : KPL_F64;
            kpl_pool *pool = NN(kpl_pool_push());
            int nd = cases[k].nd, G = cases[k].groups;
            const int64_t *xs = cases[k].s;
            int64_t n = xs[0], c = xs[1], hw = 1;
            for (int d = 2; d < nd; d++) hw *= xs[d];
            kpl_tensor *x64 = kpl_autorelease(param(nd, xs, 40 + k, -3, 2));
            kpl_tensor *g64 = kpl_autorelease(param(1, &c, 50 + k, 0.5, 1.5));
            kpl_tensor *b64 = kpl_autorelease(param(1, &c, 60 + k, -1, 1));
            kpl_tensor *gy64 = kpl_autorelease(param(nd, xs, 70 + k, -1, 1));
            bool prev = kpl_set_grad_enabled(false); /* leaves in dt */
            kpl_tensor *x = NN(kpl_cast(x64, dt)), *g = NN(kpl_cast(g64, dt));
            kpl_tensor *b = NN(kpl_cast(b64, dt)), *gy = NN(kpl_cast(gy64, dt));
            kpl_set_grad_enabled(prev);
            OK(kpl_set_requires_grad(x, true));
            OK(kpl_set_requires_grad(g, true));
            OK(kpl_set_requires_grad(b, true));
            bool aff = cases[k].affine;
            kpl_tensor *y = NN(kpl_group_norm(x, G, aff ? g : NULL, aff ? b : NULL, 1e-5));
            kpl_tensor *gr[3] = {NULL, NULL, NULL};
            OK(kpl_grad(y, gy, aff ? 3 : 1, (kpl_tensor *[]){x, g, b}, false, gr));
            /* the reference, from the values the tensors hold */
            int64_t cg = c / G, len = cg * hw, m = n * c * hw;
            double *ry = calloc((size_t)m, sizeof *ry), *rg = calloc((size_t)m, sizeof *rg);
            double *rgg = calloc((size_t)c, sizeof *rgg), *rgb = calloc((size_t)c, sizeof *rgb);
            assert_true(ry && rg && rgg && rgb);
            for (int64_t s0 = 0; s0 < n * G; s0++) {
                int64_t base = s0 * len, c0 = (s0 % G) * cg;
                double mean = 0, var = 0, A = 0, B = 0;
                for (int64_t i = 0; i < len; i++) mean += tget(x, base + i) / (double)len;
                for (int64_t i = 0; i < len; i++)
                    var += (tget(x, base + i) - mean) * (tget(x, base + i) - mean) / (double)len;
                double rstd = 1 / sqrt(var + 1e-5);
                for (int64_t i = 0; i < len; i++) {
                    int64_t ch = c0 + i / hw;
                    double gm = aff ? tget(g, ch) : 1, xh = (tget(x, base + i) - mean) * rstd;
                    ry[base + i] = xh * gm + (aff ? tget(b, ch) : 0);
                    A += tget(gy, base + i) * gm;
                    B += tget(gy, base + i) * gm * xh;
                    rgg[ch] += tget(gy, base + i) * xh;
                    rgb[ch] += tget(gy, base + i);
                }
                for (int64_t i = 0; i < len; i++) {
                    int64_t ch = c0 + i / hw;
                    double gm = aff ? tget(g, ch) : 1, xh = (tget(x, base + i) - mean) * rstd;
                    rg[base + i] = rstd * (tget(gy, base + i) * gm - A / (double)len -
                                           xh * B / (double)len);
                }
            }
            double tol = dt == KPL_F64 ? 1e-10 : 2e-5;
            char what[64];
            snprintf(what, sizeof what, "case %zu %s", k, kpl_dtype_name(dt));
            for (int64_t i = 0; i < m; i++) {
                assert_close(tget(y, i), ry[i], tol, tol, what, i);
                assert_close(tget(gr[0], i), rg[i], tol, tol * 10, what, i);
            }
            for (int64_t i = 0; aff && i < c; i++) {
                assert_close(tget(gr[1], i), rgg[i], tol, tol * 10, what, i);
                assert_close(tget(gr[2], i), rgb[i], tol, tol * 10, what, i);
            }
            free(ry), free(rg), free(rgg), free(rgb);
            kpl_pool_pop(pool);
        }
    kpl_pool *pool = NN(kpl_pool_push());
    int64_t s3[3] = {2, 6, 4};
    kpl_tensor *x = NN(kpl_full(kpl_device_cpu(), KPL_F32, 3, s3, 1));
    assert_null(kpl_group_norm(x, 4, NULL, NULL, 1e-5));
    assert_non_null(strstr(kpl_last_error(), "6 channels do not divide into 4 groups"));
    int64_t c5 = 5;
    kpl_tensor *g5 = NN(kpl_full(kpl_device_cpu(), KPL_F32, 1, &c5, 1));
    assert_null(kpl_group_norm(x, 3, g5, NULL, 1e-5));
    assert_non_null(strstr(kpl_last_error(), "'gamma' has 5 values for 6 channels"));
    kpl_pool_pop(pool);
}

static void test_norm_gradients(void **state)
{
    (void)state;
    int64_t xs[4] = {3, 4, 2, 3}, s4 = 4, s3 = 3;
    kpl_tensor *bn[3] = {param(4, xs, 11, -1, 1), param(1, &s4, 12, 0.5, 1.5), param(1, &s4, 13, -1, 1)};
    OK(kpl_gradcheck(g_bn, NULL, 3, bn, 1, 1e-6, 1e-6, 1e-5));
    OK(kpl_gradcheck(g_bn, NULL, 3, bn, 2, 1e-5, 1e-5, 1e-4));
    /* the fused batch_norm_relu: recorded as one op on the CPU, its
     * gradients (and theirs) those of the two ops */
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *yr = NN(kpl_batch_norm_relu(bn[0], bn[1], bn[2], NULL, NULL, true, 0.1, 1e-5));
    assert_int_equal(kpl_node_op(kpl_tensor_node(yr, NULL)), KPL_OP_BATCH_NORM_RELU);
    kpl_pool_pop(pool);
    OK(kpl_gradcheck(g_bnr, NULL, 3, bn, 1, 1e-6, 1e-6, 1e-5));
    OK(kpl_gradcheck(g_bnr, NULL, 3, bn, 2, 1e-5, 1e-5, 1e-4));
    OK(kpl_gradcheck(g_gn, NULL, 3, bn, 2, 1e-5, 1e-5, 1e-4));
    kpl_tensor *ln[3] = {bn[0], param(1, &s3, 14, 0.5, 1.5), param(1, &s3, 15, -1, 1)};
    OK(kpl_gradcheck(g_ln, NULL, 3, ln, 2, 1e-5, 1e-5, 1e-4));
    OK(kpl_gradcheck(g_drop, NULL, 1, bn, 2, 1e-6, 1e-6, 1e-5));
    kpl_tensor *all[] = {bn[0], bn[1], bn[2], ln[1], ln[2]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kpl_tensor_release(all[i]);
}

static kpl_tensor *f64t(int ndim, const int64_t *shape, const double *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, ndim, shape, v, &t));
    return kpl_autorelease(t);
}

static kpl_tensor *i64t(int64_t n, const int64_t *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &n, v, &t));
    return kpl_autorelease(t);
}

static void expect(kpl_tensor *t, int n, const double *v, const char *what)
{
    assert_non_null(t);
    assert_int_equal(kpl_tensor_numel(t), n);
    for (int i = 0; i < n; i++) assert_close(tget(t, i), v[i], 1e-12, 1e-12, what, i);
}

static void test_shape_ops_values(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s23[2] = {2, 3};
    double xv[6] = {1, 2, 3, 4, 5, 6};
    kpl_tensor *x = f64t(2, s23, xv);
    expect(kpl_index_select(x, 1, i64t(3, (int64_t[]){2, 0, 2})), 6,
           (double[]){3, 1, 3, 6, 4, 6}, "index_select");
    expect(kpl_index_add(x, 1, i64t(3, (int64_t[]){1, 1, 0}), 2), 4, (double[]){3, 3, 6, 9},
           "index_add");
    assert_null(kpl_index_select(x, 0, i64t(1, (int64_t[]){5})));
    assert_non_null(strstr(kpl_last_error(), "index 5 at position 0 is outside [0, 2)"));
    kpl_tensor *e = kpl_embedding(x, i64t(3, (int64_t[]){1, 0, 1}));
    assert_int_equal(kpl_tensor_ndim(e), 2);
    expect(e, 9, (double[]){4, 5, 6, 1, 2, 3, 4, 5, 6}, "embedding");
    expect(kpl_slice(x, 1, 1, 2), 4, (double[]){2, 3, 5, 6}, "slice");
    assert_null(kpl_slice(x, 1, 2, 2));
    assert_non_null(strstr(kpl_last_error(), "[2, 4) along axis 1 is out of range for (2,3)"));
    kpl_tensor *cs[2] = {x, kpl_slice(x, 1, 0, 1)};
    expect(kpl_concat(2, cs, 1), 8, (double[]){1, 2, 3, 1, 4, 5, 6, 4}, "concat");
    expect(kpl_transpose(x, 0, 1), 6, (double[]){1, 4, 2, 5, 3, 6}, "transpose");
    int64_t s3 = 3;
    kpl_tensor *r = f64t(1, &s3, (double[]){1, 2, 3});
    expect(kpl_pad(r, 1, (int64_t[]){2, 1}, KPL_PAD_REFLECT, 0), 6, (double[]){3, 2, 1, 2, 3, 2},
           "reflect pad");
    expect(kpl_pad(r, 1, (int64_t[]){1, 2}, KPL_PAD_CONSTANT, 2.5), 6,
           (double[]){2.5, 1, 2, 3, 2.5, 2.5}, "constant pad");
    int64_t s1122[4] = {1, 1, 2, 2};
    kpl_tensor *im = f64t(4, s1122, (double[]){1, 2, 3, 4});
    expect(kpl_upsample_nearest(im, 4, 4), 16,
           (double[]){1, 1, 2, 2, 1, 1, 2, 2, 3, 3, 4, 4, 3, 3, 4, 4}, "nearest");
    expect(kpl_upsample_bilinear(im, 3, 3, true), 9,
           (double[]){1, 1.5, 2, 2, 2.5, 3, 3, 3.5, 4}, "bilinear align_corners");
    /* PyTorch's F.interpolate(..., 'bilinear', align_corners=False), first row */
    kpl_tensor *b4 = kpl_upsample_bilinear(im, 4, 4, false);
    expect(kpl_slice(b4, 2, 0, 1), 4, (double[]){1, 1.25, 1.75, 2}, "bilinear");
    kpl_pool_pop(p);
}

static kpl_tensor *g_deconv(kpl_tensor *const *x, void *u)
{
    (void)u;
    kpl_conv2d_params p = {{2, 1}, {1, 0}, {1, 2}, 2};
    return kpl_square(kpl_conv_transpose2d(x[0], x[1], x[2], &p, (int[]){1, 0}));
}

static void test_conv_transpose(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    /* stride 2, 2x2 ones kernel: each input pixel becomes a 2x2 block */
    int64_t s1122[4] = {1, 1, 2, 2}, w[4] = {1, 1, 2, 2};
    kpl_tensor *x = f64t(4, s1122, (double[]){1, 2, 3, 4});
    kpl_tensor *k = NN(kpl_full(kpl_device_cpu(), KPL_F64, 4, w, 1));
    kpl_conv2d_params cp = {{2, 2}, {0, 0}, {1, 1}, 1};
    kpl_tensor *y = NN(kpl_conv_transpose2d(x, k, NULL, &cp, NULL));
    assert_int_equal(kpl_tensor_shape(y)[2], 4);
    expect(y, 16, (double[]){1, 1, 2, 2, 1, 1, 2, 2, 3, 3, 4, 4, 3, 3, 4, 4}, "conv_transpose2d");
    assert_null(kpl_conv_transpose2d(x, k, NULL, &cp, (int[]){2, 0}));
    assert_non_null(strstr(kpl_last_error(), "output_padding (2,0)"));
    kpl_pool_pop(p);
    /* gradients: groups 2, stride (2,1), dilation (1,2), padding, output_padding */
    int64_t xs[4] = {2, 4, 3, 4}, ws[4] = {4, 3, 2, 2}, bs = 6;
    kpl_tensor *in[3] = {param(4, xs, 31, -1, 1), param(4, ws, 32, -1, 1), param(1, &bs, 33, -1, 1)};
    OK(kpl_gradcheck(g_deconv, NULL, 3, in, 2, 1e-5, 1e-5, 1e-4));
    for (int i = 0; i < 3; i++) kpl_tensor_release(in[i]);
}

/* ---- PyTorch parity (torch 1.13, f64; the expressions are in the comments) ---- */

/* An f64 leaf that requires grad, from values; the caller releases it. */
static kpl_tensor *leaf(int ndim, const int64_t *shape, const double *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, ndim, shape, v, &t));
    OK(kpl_set_requires_grad(t, true));
    return t;
}

/* sum(y * r) with r[i] = 1 + 0.1 i over y's flat index: the projection
 * the PyTorch gradients below come from, `(y * r).sum().backward()` with
 * r = torch.arange(y.numel()).reshape(y.shape) * 0.1 + 1. */
static kpl_tensor *ramp_sum(kpl_tensor *y)
{
    if (!y) return NULL;
    kpl_tensor *r = kpl_arange(kpl_tensor_device(y), kpl_tensor_dtype(y), kpl_tensor_numel(y), 1,
                               0.1);
    return kpl_sum(kpl_mul(y, kpl_reshape(r, kpl_tensor_ndim(y), kpl_tensor_shape(y))), NULL, 0,
                   false);
}

static void expect_tol(kpl_tensor *t, int n, const double *v, double rtol, double atol,
                       const char *what)
{
    assert_non_null(t);
    assert_int_equal(kpl_tensor_numel(t), n);
    for (int i = 0; i < n; i++) assert_close(tget(t, i), v[i], rtol, atol, what, i);
}

/* The gradient at z = 0 is (sigmoid(0) - y) w = (0.5 - y) w: a zero-
 * initialised output layer sits there on every element. */
static void test_bce_logits_at_zero(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s23[2] = {2, 3};
    double zeros[6] = {0}, yv[6] = {0, 1, 0.5, 0.2, 0.9, 1};
    kpl_tensor *z = leaf(2, s23, zeros), *y = leaf(2, s23, yv), *in[2] = {z, y}, *g[2];
    kpl_tensor *l = NN(kpl_bce_with_logits(z, y, KPL_REDUCE_MEAN));
    assert_close(tget(l, 0), 0.6931471805599453, 1e-15, 0, "bce at 0", 0); /* log 2 */
    OK(kpl_grad(l, NULL, 2, in, false, g));
    /* F.binary_cross_entropy_with_logits(torch.zeros(2, 3), y).backward():
     * z.grad = (0.5 - y) / 6, y.grad = -z / 6 = 0 */
    expect(g[0], 6, (double[]){0.08333333333333333, -0.08333333333333333, 0, 0.049999999999999996,
                               -0.06666666666666667, -0.08333333333333333}, "bce dz at 0");
    expect(g[1], 6, zeros, "bce dy at 0");
    kpl_pool_pop(p);
    kpl_tensor_release(z);
    kpl_tensor_release(y);
}

/* Large |z| and z near 0, f64 and f32, reduction none.  The loss is
 * y softplus(-z) + (1 - y) softplus(z), evaluated in Python with
 * math.log1p (exact to the last bit here); torch 1.13 itself returns 0
 * for z = 40, y = 1 (it forms log(1 + e^-40)).  Gradients: s(z) - y, as
 * -y s(-z) + (1 - y) s(z) with a stable sigmoid. */
static void test_bce_logits_large_logits(void **state)
{
    (void)state;
    static const double zs[9] = {-100, -40, -20, -1e-4, 0, 1e-4, 20, 40, 100};
    static const double ys[9] = {0, 0, 1, 0.3, 0.5, 0.7, 1, 1, 0};
    static const double loss[9] = {3.720075976020836e-44, 4.248354255291589e-18,
                                   20.000000002061153,    0.6931271818099453,
                                   0.6931471805599453,    0.6931271818099453,
                                   2.061153620314381e-09, 4.248354255291589e-18, 100.0};
    static const double grad[9] = {3.720075976020836e-44,  4.248354255291589e-18,
                                   -0.9999999979388463,    0.19997500000002083, 0.0,
                                   -0.1999750000000208,    -2.0611536181902033e-09,
                                   -4.248354255291589e-18, 1.0};
    int64_t n = 9;
    for (int f32 = 0; f32 < 2; f32++) {
        kpl_pool *p = NN(kpl_pool_push());
        kpl_tensor *z = leaf(1, &n, zs), *y = NULL, *g = NULL;
        OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 1, &n, ys, &y));
        kpl_autorelease(y);
        kpl_tensor *zz = f32 ? NN(kpl_cast(z, KPL_F32)) : z, *yy = f32 ? NN(kpl_cast(y, KPL_F32)) : y;
        /* f32: a few ulp, and 3.7e-44 is subnormal there */
        double rtol = f32 ? 2e-6 : 1e-13, atol = f32 ? 1e-43 : 0;
        kpl_tensor *l = NN(kpl_bce_with_logits(zz, yy, KPL_REDUCE_NONE));
        expect_tol(l, 9, loss, rtol, atol, f32 ? "bce f32" : "bce f64");
        OK(kpl_grad(kpl_sum(l, NULL, 0, false), NULL, 1, &z, false, &g));
        expect_tol(g, 9, grad, rtol, atol, f32 ? "bce grad f32" : "bce grad f64");
        kpl_pool_pop(p);
        kpl_tensor_release(z);
    }
}

static void test_bce_logits_shape_check(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s41[2] = {4, 1}, s4 = 4;
    kpl_tensor *z = NN(kpl_full(kpl_device_cpu(), KPL_F64, 2, s41, 0));
    kpl_tensor *y = NN(kpl_full(kpl_device_cpu(), KPL_F64, 1, &s4, 1));
    /* broadcasting (4, 1) with (4) would silently give a (4, 4) loss;
     * PyTorch: "Target size (torch.Size([4])) must be the same as input
     * size (torch.Size([4, 1]))" */
    assert_null(kpl_bce_with_logits(z, y, KPL_REDUCE_MEAN));
    assert_non_null(strstr(kpl_last_error(), "bce_with_logits: target (4) must have the shape of the logits (4,1)"));
    kpl_pool_pop(p);
}

/* pos_weight (C) over the classes of z (N, C), as PyTorch's
 * BCEWithLogitsLoss(pos_weight=...), and an element weight on top. */
static void test_bce_logits_pos_weight(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s23[2] = {2, 3}, s3 = 3;
    kpl_tensor *z = leaf(2, s23, (double[]){0, 1.5, -2, 3, -0.5, 0.25});
    kpl_tensor *y = leaf(2, s23, (double[]){0, 1, 0.5, 0.2, 0.9, 1}), *in[2] = {z, y}, *g[2];
    kpl_tensor *pw = f64t(1, &s3, (double[]){2, 0.5, 3}), *wt = f64t(1, &s3, (double[]){1, 2, 0.5});
    /* F.binary_cross_entropy_with_logits(z, y, pos_weight=pw, reduction='none') */
    expect(kpl_bce_with_logits_weighted(z, y, NULL, pw, KPL_REDUCE_NONE), 6,
           (double[]){0.6931471805599453, 0.10070663899137623, 3.2538560220859454,
                      2.4583048218884906, 0.48574234129905874, 1.727818259636531},
           "bce pos_weight");
    /* ... reduction='mean', then .backward() */
    kpl_tensor *l = NN(kpl_bce_with_logits_weighted(z, y, NULL, pw, KPL_REDUCE_MEAN));
    assert_close(tget(l, 0), 1.4532625440768914, 1e-14, 0, "bce pos_weight mean", 0);
    OK(kpl_grad(l, NULL, 2, in, false, g));
    expect(g[0], 6, (double[]){0.08333333333333333, -0.015202126983863029, -0.21026569265929415,
                               0.12384815869782001, -0.04039210536017001, -0.218911749557101},
           "bce pos_weight dz");
    expect(g[1], 6, (double[]){0.11552453009332421, -0.26678443983189604, 1.0423093370143244,
                               -0.491902108071043, 0.002160251318324443, 0.1503131399596145},
           "bce pos_weight dy");
    /* ... weight=wt, pos_weight=pw, reduction='sum' */
    l = NN(kpl_bce_with_logits_weighted(z, y, wt, pw, KPL_REDUCE_SUM));
    assert_close(tget(l, 0), 6.815187103890544, 1e-14, 0, "bce weight+pos_weight sum", 0);
    OK(kpl_grad(l, NULL, 2, in, false, g));
    expect(g[0], 6, (double[]){0.5, -0.18242552380635635, -0.6307970779778824, 0.7430889521869201,
                               -0.48470526432204014, -0.656735248671303},
           "bce weight+pos_weight dz");
    expect(g[1], 6, (double[]){0.6931471805599453, -3.2014132779827524, 3.126928011042973,
                               -2.951412648426258, 0.025923015819893314, 0.4509394198788435},
           "bce weight+pos_weight dy");
    /* large logits stay exact: z = 40, y = 1, pos_weight 2 -> 2 log1p(e^-40);
     * z = -40, y = 0 -> log1p(e^-40) (math.log1p) */
    int64_t s2 = 2, s1 = 1;
    kpl_tensor *big = NN(kpl_bce_with_logits_weighted(f64t(1, &s2, (double[]){40, -40}),
                                                      f64t(1, &s2, (double[]){1, 0}), NULL,
                                                      f64t(1, &s1, (double[]){2}), KPL_REDUCE_NONE));
    expect_tol(big, 2, (double[]){8.496708510583178e-18, 4.248354255291589e-18}, 1e-13, 0,
               "bce pos_weight large");
    /* shapes that would enlarge the loss are refused (PyTorch: "output with
     * shape [2, 3] doesn't match the broadcast shape [2, 2, 3]") */
    int64_t s223[3] = {2, 2, 3}, s4 = 4;
    assert_null(kpl_bce_with_logits_weighted(z, y, NULL, NN(kpl_full(kpl_device_cpu(), KPL_F64, 3,
                                                                     s223, 1)),
                                             KPL_REDUCE_MEAN));
    assert_non_null(strstr(kpl_last_error(), "bce_with_logits: pos_weight (2,2,3) does not "
                                             "broadcast to the logits' shape (2,3)"));
    assert_null(kpl_bce_with_logits_weighted(z, y, NN(kpl_full(kpl_device_cpu(), KPL_F64, 1, &s4, 1)),
                                             NULL, KPL_REDUCE_MEAN));
    assert_non_null(strstr(kpl_last_error(), "weight (4) does not broadcast"));
    kpl_pool_pop(p);
    kpl_tensor_release(z);
    kpl_tensor_release(y);
}

static kpl_tensor *g_bce_pw(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_bce_with_logits_weighted(x[0], x[1], x[3], x[2], KPL_REDUCE_MEAN);
}

static void test_bce_logits_pos_weight_gradcheck(void **state)
{
    (void)state;
    int64_t s34[2] = {3, 4}, s4 = 4, s14[2] = {1, 4};
    /* z, y, pos_weight (4), weight (1, 4): every input, to second order */
    kpl_tensor *in[4] = {param(2, s34, 61, -3, 3), param(2, s34, 62, 0, 1), param(1, &s4, 63, 0.5, 3),
                         param(2, s14, 64, 0.5, 2)};
    OK(kpl_gradcheck(g_bce_pw, NULL, 4, in, 1, 1e-6, 1e-7, 1e-5));
    OK(kpl_gradcheck(g_bce_pw, NULL, 4, in, 2, 1e-5, 1e-6, 1e-5));
    for (int i = 0; i < 4; i++) kpl_tensor_release(in[i]);
}

/* output_padding may reach max(stride, dilation) - 1: with stride 1 and
 * dilation 2 the extra row is zeros the kernel never reaches. */
static void test_conv_transpose_output_padding(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    /* A: x = arange(9).reshape(1,1,3,3), w = [1,2,3,4].reshape(1,1,2,2),
     * F.conv_transpose2d(x, w, stride=1, padding=0, output_padding=(1,0), dilation=2) */
    int64_t xs[4] = {1, 1, 3, 3}, ws[4] = {1, 1, 2, 2};
    double xv[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    kpl_tensor *x = leaf(4, xs, xv), *w = leaf(4, ws, (double[]){1, 2, 3, 4}), *in[3], *g[3];
    kpl_conv2d_params cp = {{1, 1}, {0, 0}, {2, 2}, 1};
    kpl_tensor *y = NN(kpl_conv_transpose2d(x, w, NULL, &cp, (int[]){1, 0}));
    assert_int_equal(kpl_tensor_shape(y)[2], 6);
    assert_int_equal(kpl_tensor_shape(y)[3], 5);
    expect(y, 30, (double[]){0, 1, 2, 2, 4, 3, 4, 11, 8, 10, 6, 10, 26, 18, 24,
                             9, 12, 27, 16, 20, 18, 21, 48, 28, 32, 0, 0, 0, 0, 0},
           "conv_transpose2d A");
    in[0] = x, in[1] = w;
    OK(kpl_grad(ramp_sum(y), NULL, 2, in, false, g));
    expect(g[0], 9, (double[]){18.2, 19.2, 20.2, 23.2, 24.2, 25.2, 28.2, 29.2, 30.2}, "A gx");
    expect(g[1], 4, (double[]){67.2, 74.4, 103.2, 110.4}, "A gw");
    kpl_tensor_release(x);
    kpl_tensor_release(w);
    /* B: stride 2, dilation 3, padding 1, output_padding 2, bias, two
     * input channels: x = arange(12).reshape(1,2,2,3) - 5,
     * w = [1,-1,2,.5, .25,3,-2,1].reshape(2,1,2,2), b = [.5] */
    int64_t bxs[4] = {1, 2, 2, 3}, bws[4] = {2, 1, 2, 2}, one = 1;
    double bxv[12];
    for (int i = 0; i < 12; i++) bxv[i] = i - 5;
    x = leaf(4, bxs, bxv);
    w = leaf(4, bws, (double[]){1, -1, 2, 0.5, 0.25, 3, -2, 1});
    kpl_tensor *b = leaf(1, &one, (double[]){0.5});
    kpl_conv2d_params cb = {{2, 2}, {1, 1}, {3, 3}, 1};
    y = NN(kpl_conv_transpose2d(x, w, b, &cb, (int[]){2, 2}));
    assert_int_equal(kpl_tensor_shape(y)[2], 6);
    assert_int_equal(kpl_tensor_shape(y)[3], 8);
    expect(y, 48, (double[]){0.5, 0.5, 0.5,   0.5,  0.5, 0.5,  0.5, 0.5, 0.5, 0.75, 14.5, 2.0,
                             16.5, 0.5, 18.5, 0.5,  0.5, -11.5, -1.0, -11.5, 0.5, 0.5, 2.0, 0.5,
                             0.5, 0.5, 0.5,   0.5,  0.5, 0.5,  0.5, 0.5, 0.5, -11.5, 3.5, -11.5,
                             5.0, 0.5, 6.5,   0.5,  0.5, 0.5,  0.5, 0.5, 0.5, 0.5,  0.5, 0.5},
           "conv_transpose2d B");
    in[0] = x, in[1] = w, in[2] = b;
    OK(kpl_grad(ramp_sum(y), NULL, 3, in, false, g));
    expect(g[0], 12, (double[]){1.4, 6.9, 7.4, 0.2, 10.6, 11.1, 2.8, -2.4, -2.6, 10.4, 3.075, 3.525},
           "B gx");
    expect(g[1], 8, (double[]){-1.9, -6.2, -23.8, -49.0, 22.1, 33.4, 62.6, 87.8}, "B gw");
    expect(g[2], 1, (double[]){160.8}, "B gb");
    kpl_tensor_release(x);
    kpl_tensor_release(w);
    kpl_tensor_release(b);
    /* C: groups 2, stride 1, padding (1,0), dilation (2,3), output_padding
     * (1,2): x = arange(16).reshape(1,4,2,2) * .25 - 1,
     * w = arange(16).reshape(4,1,2,2) * .5 - 3, b = [.5, -1] */
    int64_t cxs[4] = {1, 4, 2, 2}, cws[4] = {4, 1, 2, 2}, two = 2;
    double cxv[16], cwv[16];
    for (int i = 0; i < 16; i++) cxv[i] = i * 0.25 - 1, cwv[i] = i * 0.5 - 3;
    x = leaf(4, cxs, cxv);
    w = leaf(4, cws, cwv);
    b = leaf(1, &two, (double[]){0.5, -1});
    kpl_conv2d_params cc = {{1, 1}, {1, 0}, {2, 3}, 2};
    y = NN(kpl_conv_transpose2d(x, w, b, &cc, (int[]){1, 2}));
    assert_int_equal(kpl_tensor_shape(y)[1], 2);
    assert_int_equal(kpl_tensor_shape(y)[2], 3);
    assert_int_equal(kpl_tensor_shape(y)[3], 7);
    expect(y, 42, (double[]){1.5,  0.5,   0.5,  1.5,  0.75, 0.5,  0.5,  2.5,  2.0,  0.5,  2.0,
                             1.75, 0.5,   0.5,  1.5,  1.0,  0.5,  1.5,  1.25, 0.5,  0.5,  8.0,
                             9.0,  -1.0,  10.0, 11.25, -1.0, -1.0, 9.0,  10.5, -1.0, 10.5, 12.25,
                             -1.0, -1.0,  12.0, 13.5, -1.0, 14.0, 15.75, -1.0, -1.0},
           "conv_transpose2d C");
    in[0] = x, in[1] = w, in[2] = b;
    OK(kpl_grad(ramp_sum(y), NULL, 3, in, false, g));
    expect(g[0], 16, (double[]){-6.4, -6.75, -15.1, -16.0, 1.0, 1.05, -0.3, -0.4, 17.85, 18.3, 29.2,
                                29.9, 33.65, 34.5, 60.8, 62.3},
           "C gx");
    expect(g[1], 16, (double[]){-0.775, -1.0, -4.875, -5.625, 1.325, 1.7, 3.525, 3.975, 10.25,
                                11.225, 23.475, 25.125, 16.55, 18.125, 40.275, 43.125},
           "C gw");
    expect(g[2], 2, (double[]){42.0, 86.1}, "C gb");
    kpl_tensor_release(x);
    kpl_tensor_release(w);
    kpl_tensor_release(b);
    /* D: no input row reaches the output rows: padding 1 crops the only
     * row the 1x1 kernel makes, output_padding 2 adds one of zeros.
     * F.conv_transpose2d(x (1,1,1,2) = [2, 3], ones(1,1,1,1), [.5], stride=1,
     * padding=1, output_padding=2, dilation=3) = [.5, .5], x.grad = 0 */
    int64_t dxs[4] = {1, 1, 1, 2}, dws[4] = {1, 1, 1, 1};
    x = leaf(4, dxs, (double[]){2, 3});
    w = leaf(4, dws, (double[]){1});
    b = leaf(1, &one, (double[]){0.5});
    kpl_conv2d_params cd = {{1, 1}, {1, 1}, {3, 3}, 1};
    y = NN(kpl_conv_transpose2d(x, w, b, &cd, (int[]){2, 2}));
    assert_int_equal(kpl_tensor_shape(y)[2], 1);
    assert_int_equal(kpl_tensor_shape(y)[3], 2);
    expect(y, 2, (double[]){0.5, 0.5}, "conv_transpose2d D");
    in[0] = x, in[1] = w, in[2] = b;
    OK(kpl_grad(kpl_sum(y, NULL, 0, false), NULL, 3, in, false, g));
    expect(g[0], 2, (double[]){0, 0}, "D gx");
    expect(g[2], 1, (double[]){2}, "D gb");
    kpl_tensor_release(x);
    kpl_tensor_release(w);
    kpl_tensor_release(b);
    kpl_pool_pop(p);
    /* still refused: output_padding >= max(stride, dilation) */
    p = NN(kpl_pool_push());
    kpl_tensor *x1 = NN(kpl_full(kpl_device_cpu(), KPL_F64, 4, xs, 1));
    kpl_tensor *w1 = NN(kpl_full(kpl_device_cpu(), KPL_F64, 4, ws, 1));
    assert_null(kpl_conv_transpose2d(x1, w1, NULL, &cp, (int[]){0, 2}));
    assert_non_null(strstr(kpl_last_error(), "output_padding (0,2)"));
    /* channels and bias that do not fit, named by the op (they were
     * conv2d_bwd_data's and reshape's errors) */
    int64_t w2s[4] = {2, 1, 2, 2}, b5 = 5;
    assert_null(kpl_conv_transpose2d(x1, NN(kpl_full(kpl_device_cpu(), KPL_F64, 4, w2s, 1)), NULL, &cp,
                                     NULL));
    assert_non_null(strstr(kpl_last_error(), "conv_transpose2d: input (1,1,3,3), weights (2,1,2,2)"));
    assert_null(kpl_conv_transpose2d(x1, w1, NN(kpl_full(kpl_device_cpu(), KPL_F64, 1, &b5, 1)), &cp,
                                     NULL));
    assert_non_null(strstr(kpl_last_error(), "bias (5) do not fit (expected Cin = 1, bias (1))"));
    /* padding larger than the output: named, not a negative allocation */
    kpl_conv2d_params big = {{1, 1}, {3, 0}, {1, 1}, 1};
    assert_null(kpl_conv_transpose2d(x1, w1, NULL, &big, NULL));
    assert_non_null(strstr(kpl_last_error(), "conv_transpose2d: input (1,1,3,3) with weights "
                                             "(1,1,2,2), padding (3,0) gives an empty output "
                                             "(-2x4)"));
    kpl_pool_pop(p);
}

static kpl_tensor *g_deconv_op(kpl_tensor *const *x, void *u)
{
    (void)u;
    /* groups 2, output_padding (2, 1) >= stride (1, 1), < dilation (3, 2) */
    kpl_conv2d_params p = {{1, 1}, {1, 1}, {3, 2}, 2};
    return kpl_square(kpl_conv_transpose2d(x[0], x[1], x[2], &p, (int[]){2, 1}));
}

static void test_conv_transpose_output_padding_gradcheck(void **state)
{
    (void)state;
    int64_t xs[4] = {2, 4, 3, 2}, ws[4] = {4, 3, 2, 2}, bs = 6;
    kpl_tensor *in[3] = {param(4, xs, 34, -1, 1), param(4, ws, 35, -1, 1), param(1, &bs, 36, -1, 1)};
    OK(kpl_gradcheck(g_deconv_op, NULL, 3, in, 1, 1e-6, 1e-6, 1e-5));
    OK(kpl_gradcheck(g_deconv_op, NULL, 3, in, 2, 1e-5, 1e-5, 1e-4));
    for (int i = 0; i < 3; i++) kpl_tensor_release(in[i]);
}

/* Training with one value per channel normalises every value to 0 (the
 * variance is 0): PyTorch refuses it, and so does kpl. */
static void test_batch_norm_one_value_per_channel(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    kpl_device *cpu = kpl_device_cpu();
    int64_t s1311[4] = {1, 3, 1, 1}, s13[2] = {1, 3}, s3 = 3, s2311[4] = {2, 3, 1, 1};
    kpl_tensor *x = NN(kpl_full(cpu, KPL_F64, 4, s1311, 2));
    kpl_tensor *rm = NN(kpl_full(cpu, KPL_F64, 1, &s3, 1)), *rv = NN(kpl_full(cpu, KPL_F64, 1, &s3, 4));
    /* F.batch_norm(torch.zeros(1, 3, 1, 1), None, None, training=True):
     * "Expected more than 1 value per channel when training, got input
     * size torch.Size([1, 3, 1, 1])" */
    assert_null(kpl_batch_norm(x, NULL, NULL, rm, rv, true, 0.1, 1e-5));
    assert_non_null(strstr(kpl_last_error(), "batch_norm: expected more than 1 value per channel "
                                             "when training, got input size (1,3,1,1)"));
    assert_float_equal(tget(rm, 0), 1, 0); /* running statistics untouched */
    assert_float_equal(tget(rv, 0), 4, 0);
    assert_null(kpl_batch_norm(NN(kpl_full(cpu, KPL_F64, 2, s13, 2)), NULL, NULL, NULL, NULL, true,
                               0.1, 1e-5));
    assert_non_null(strstr(kpl_last_error(), "got input size (1,3)"));
    /* eval mode uses the running statistics: (2 - 1) / sqrt(4 + 1e-5) */
    kpl_tensor *ye = NN(kpl_batch_norm(x, NULL, NULL, rm, rv, false, 0.1, 1e-5));
    assert_close(tget(ye, 2), 0.49999937500117186, 1e-15, 0, "bn eval", 2);
    /* two values per channel are enough: x = [[1], [3]] per channel -> -1, 1 (eps aside) */
    double v2[6] = {1, 1, 1, 3, 3, 3};
    kpl_tensor *x2 = f64t(4, s2311, v2);
    kpl_tensor *y2 = NN(kpl_batch_norm(x2, NULL, NULL, NULL, NULL, true, 0.1, 1e-5));
    assert_close(tget(y2, 0), -1 / sqrt(1 + 1e-5), 1e-14, 0, "bn N=2", 0);
    assert_close(tget(y2, 3), 1 / sqrt(1 + 1e-5), 1e-14, 0, "bn N=2", 3);
    kpl_pool_pop(p);
}

/* Every label ignored: kpl's mean cross entropy is 0 with gradient 0 —
 * a deliberate departure from PyTorch, whose mean over no rows is NaN
 * since 1.11 (pytorch/pytorch#64572; F.cross_entropy(torch.randn(3, 4),
 * torch.full((3,), -100)) is nan).  A NaN loss stops a kpl run, and a
 * batch (or a rank's shard) with no labelled rows should add nothing
 * instead.  Sum and none agree with PyTorch (0 and zeros). */
static void test_cross_entropy_all_ignored(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s34[2] = {3, 4};
    kpl_tensor *z = leaf(2, s34, (double[]){0.1, 0.2, 0.3, 0.4, 1, -1, 0, 2, 0.5, 0.5, -0.5, 0});
    kpl_tensor *lab = i64t(3, (int64_t[]){-100, -100, -100}), *g = NULL;
    const double zero12[12] = {0};
    for (int smooth = 0; smooth < 2; smooth++) {
        double eps = smooth ? 0.1 : 0;
        kpl_tensor *l = NN(kpl_cross_entropy(z, lab, KPL_REDUCE_MEAN, eps, -100));
        assert_float_equal(tget(l, 0), 0, 0); /* not NaN */
        OK(kpl_grad(l, NULL, 1, &z, false, &g));
        expect(g, 12, zero12, "cross_entropy all ignored, mean: gradient");
        l = NN(kpl_cross_entropy(z, lab, KPL_REDUCE_SUM, eps, -100));
        assert_float_equal(tget(l, 0), 0, 0);
        OK(kpl_grad(l, NULL, 1, &z, false, &g));
        expect(g, 12, zero12, "cross_entropy all ignored, sum: gradient");
        expect(kpl_cross_entropy(z, lab, KPL_REDUCE_NONE, eps, -100), 3, zero12,
               "cross_entropy all ignored, none");
    }
    /* nll_loss (the same code) on log-probabilities, an ignore_index of 2 */
    kpl_tensor *l = NN(kpl_nll_loss(NN(kpl_log_softmax(z, 1)), i64t(3, (int64_t[]){2, 2, 2}),
                                    KPL_REDUCE_MEAN, 2));
    assert_float_equal(tget(l, 0), 0, 0);
    OK(kpl_grad(l, NULL, 1, &z, false, &g));
    expect(g, 12, zero12, "nll_loss all ignored: gradient");
    kpl_pool_pop(p);
    kpl_tensor_release(z);
}

/* The input gradient of f32 batch norm in training mode against one in
 * double from the same f32 values: gamma inv ((gy - mean(gy)) - (x - mean)
 * inv^2 mean(gy (x - mean))).  With two values per channel the two terms
 * agree but for eps / (var + eps) ~ 1e-5 of either, and so they do for any
 * shape when gy is nearly x - mean (`aligned`); kpl once lost 1e-2 to 8x
 * of the result there (f32 statistics and terms).  Now every element is
 * within a few f32 roundings of the reference, measured against the
 * largest of its channel (a near-zero element cannot carry the f32
 * rounding of the terms that cancel into it). */
static void bn_grad_f32_case(int64_t n, int64_t c, int64_t hw, double mu, bool aligned,
                             bool create_graph, uint64_t seed)
{
    kpl_pool *p = NN(kpl_pool_push());
    kpl_device *cpu = kpl_device_cpu();
    int64_t xs[4] = {n, c, hw, 1}, tot = n * c * hw;
    kpl_rng *rng = kpl_rng_create(seed);
    kpl_tensor *r1 = NN(kpl_randn(cpu, KPL_F64, 4, xs, rng, 0, 1));
    kpl_tensor *r2 = NN(kpl_randn(cpu, KPL_F64, 4, xs, rng, 0, 1));
    kpl_tensor *r3 = NN(kpl_rand(cpu, KPL_F64, 1, &c, rng, 0.5, 1.5));
    kpl_rng_destroy(rng);
    float xv[64], gyv[64], gv[8];
    double gx_ref[64];
    assert_true(tot <= 64 && c <= 8);
    for (int64_t i = 0; i < tot; i++) {
        xv[i] = (float)(mu + tget(r1, i));
        gyv[i] = (float)(aligned ? tget(r1, i) + 1e-3 * tget(r2, i) : tget(r2, i));
    }
    for (int64_t k = 0; k < c; k++) gv[k] = (float)tget(r3, k);
    const double eps = 1e-5, cnt = (double)(n * hw);
    for (int64_t k = 0; k < c; k++) {
        double m = 0, v = 0, sg = 0, sgx = 0;
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < hw; i++) m += xv[(b * c + k) * hw + i];
        m /= cnt;
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < hw; i++) {
                int64_t e = (b * c + k) * hw + i;
                v += (xv[e] - m) * (xv[e] - m);
                sg += gyv[e];
                sgx += gyv[e] * (xv[e] - m);
            }
        double inv = 1 / sqrt(v / cnt + eps);
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < hw; i++) {
                int64_t e = (b * c + k) * hw + i;
                gx_ref[e] = gv[k] * inv * ((gyv[e] - sg / cnt) - (xv[e] - m) * inv * inv * sgx / cnt);
            }
    }
    kpl_tensor *x = NULL, *gy = NULL, *gamma = NULL, *gx = NULL;
    OK(kpl_tensor_from_data(cpu, KPL_F32, 4, xs, xv, &x));
    OK(kpl_tensor_from_data(cpu, KPL_F32, 4, xs, gyv, &gy));
    OK(kpl_tensor_from_data(cpu, KPL_F32, 1, &c, gv, &gamma));
    kpl_autorelease(gy);
    kpl_autorelease(gamma);
    OK(kpl_set_requires_grad(x, true));
    kpl_tensor *y = NN(kpl_batch_norm(x, gamma, NULL, NULL, NULL, true, 0.1, eps));
    OK(kpl_grad(y, gy, 1, &x, create_graph, &gx));
    assert_int_equal(kpl_tensor_dtype(gx), KPL_F32);
    char what[96];
    snprintf(what, sizeof what, "bn gx f32 (%lld,%lld,%lld,1) mu %g%s%s", (long long)n,
             (long long)c, (long long)hw, mu, aligned ? " aligned" : "",
             create_graph ? " create_graph" : "");
    for (int64_t k = 0; k < c; k++) {
        double big = 0;
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < hw; i++) big = fmax(big, fabs(gx_ref[(b * c + k) * hw + i]));
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < hw; i++) {
                int64_t e = (b * c + k) * hw + i;
                assert_close(tget(gx, e), gx_ref[e], 0, 2.5e-7 * big, what, e);
            }
    }
    kpl_pool_pop(p);
    kpl_tensor_release(x);
}

static void test_batch_norm_grad_f32_accuracy(void **state)
{
    (void)state;
    for (int cg = 0; cg < 2; cg++) {
        /* two values per channel, 1x1: the case PyTorch's f32 beat kpl's by 3.6x */
        bn_grad_f32_case(2, 4, 1, 0, false, cg, 1);
        bn_grad_f32_case(2, 3, 1, 3, false, cg, 2);
        /* other small shapes, with gy along x - mean, and a mean far from 0 */
        bn_grad_f32_case(3, 4, 1, 0, true, cg, 3);
        bn_grad_f32_case(2, 3, 4, 0, true, cg, 4);
        bn_grad_f32_case(4, 3, 4, 100, false, cg, 5);
        bn_grad_f32_case(4, 2, 8, 100, true, cg, 6);
    }
    /* f32 under create_graph runs the recorded formula in f64 between two
     * casts: its second order is the f64 one, up to f32 rounding */
    int64_t xs[4] = {3, 2, 2, 2}, s2 = 2;
    double g2[2][24];
    for (int d = 0; d < 2; d++) {
        kpl_pool *p = NN(kpl_pool_push());
        kpl_dtype dt = d ? KPL_F64 : KPL_F32;
        kpl_tensor *x = param(4, xs, 71, -1, 1), *g = param(1, &s2, 72, 0.5, 1.5);
        kpl_tensor *in[2] = {NN(kpl_cast(x, dt)), NN(kpl_cast(g, dt))}, *g1[2], *gg[2];
        kpl_tensor *l = NN(ramp_sum(kpl_square(kpl_batch_norm(in[0], in[1], NULL, NULL, NULL,
                                                             true, 0.1, 1e-5))));
        OK(kpl_grad(l, NULL, 2, in, true, g1));
        assert_int_equal(kpl_tensor_dtype(g1[0]), dt);
        kpl_tensor *l2 = NN(ramp_sum(kpl_add(kpl_sum(g1[0], NULL, 0, false), kpl_square(g1[0]))));
        OK(kpl_grad(l2, NULL, 2, in, false, gg));
        for (int i = 0; i < 24; i++) g2[d][i] = tget(gg[0], i);
        kpl_pool_pop(p);
        kpl_tensor_release(x);
        kpl_tensor_release(g);
    }
    double big = 0;
    for (int i = 0; i < 24; i++) big = fmax(big, fabs(g2[1][i]));
    for (int i = 0; i < 24; i++) assert_close(g2[0][i], g2[1][i], 1e-4, 1e-5 * big, "bn f32 2nd order", i);
}

/* beta = 0 is the L1 loss (PyTorch: "beta=0 is equivalent to L1Loss"),
 * no division by zero.  F.smooth_l1_loss(a, b, beta=0.0, reduction='sum')
 * = 3.0 with a.grad = [1, -1, -1, -1]; kpl gives 0 where a == b, as
 * F.l1_loss does (torch 1.13's smooth_l1 kernel returns -1 there). */
static void test_smooth_l1_beta_zero(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s4 = 4;
    kpl_tensor *a = leaf(1, &s4, (double[]){1, -2, 3, 0.5}), *g = NULL;
    kpl_tensor *b = f64t(1, &s4, (double[]){0.5, 0, 3.5, 0.5});
    kpl_tensor *l = NN(kpl_smooth_l1_loss(a, b, KPL_REDUCE_SUM, 0));
    assert_float_equal(tget(l, 0), 3.0, 1e-15);
    OK(kpl_grad(l, NULL, 1, &a, false, &g));
    expect(g, 4, (double[]){1, -1, -1, 0}, "smooth_l1 beta 0 grad");
    l = NN(kpl_smooth_l1_loss(a, b, KPL_REDUCE_MEAN, 0));
    assert_float_equal(tget(l, 0), 0.75, 1e-15);
    OK(kpl_grad(l, NULL, 1, &a, false, &g));
    expect(g, 4, (double[]){0.25, -0.25, -0.25, 0}, "smooth_l1 beta 0 mean grad");
    /* "smooth_l1_loss does not support negative values for beta." */
    assert_null(kpl_smooth_l1_loss(a, b, KPL_REDUCE_SUM, -1));
    assert_non_null(strstr(kpl_last_error(), "smooth_l1_loss: beta -1 must be >= 0"));
    kpl_pool_pop(p);
    kpl_tensor_release(a);
}

/* Pooling with ceil_mode: values and gradients (through ramp_sum) from
 * F.max_pool2d / F.avg_pool2d(x, kernel, stride, padding, ceil_mode=True). */
static void test_pool_ceil_mode(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    kpl_tensor *g = NULL;
    /* max, 2x2 / stride 2 on 5x5, x = [(i * 7) % 25 for i in range(25)] */
    int64_t s55[4] = {1, 1, 5, 5};
    double v55[25];
    for (int i = 0; i < 25; i++) v55[i] = (i * 7) % 25;
    kpl_tensor *x = leaf(4, s55, v55);
    kpl_pool2d_params mp = {.kernel = {2, 2}, .stride = {2, 2}, .ceil_mode = true};
    kpl_tensor *y = NN(kpl_max_pool2d(x, &mp));
    expect(y, 9, (double[]){17, 24, 13, 20, 19, 23, 22, 11, 18}, "max ceil 5x5");
    OK(kpl_grad(ramp_sum(y), NULL, 1, &x, false, &g));
    expect(g, 25, (double[]){0, 0, 0, 0, 0, 0, 1.0, 1.1, 0, 1.2, 1.3, 0, 0, 0, 1.5, 0, 0, 1.4, 0, 0,
                             0, 1.6, 0, 1.7, 1.8},
           "max ceil 5x5 grad");
    /* avg, same windows, count_include_pad: hanging windows divide by the
     * cells they cover (F.avg_pool2d(x, 2, 2, 0, ceil_mode=True,
     * count_include_pad=True)) */
    mp.count_include_pad = true;
    y = NN(kpl_avg_pool2d(x, &mp));
    expect(y, 9, (double[]){8.5, 16.25, 8.0, 9.75, 11.25, 15.5, 18.5, 7.5, 18.0}, "avg ceil 5x5");
    OK(kpl_grad(ramp_sum(y), NULL, 1, &x, false, &g));
    expect(g, 25, (double[]){0.25, 0.25, 0.275, 0.275, 0.6, 0.25, 0.25, 0.275, 0.275, 0.6,
                             0.325, 0.325, 0.35, 0.35, 0.75, 0.325, 0.325, 0.35, 0.35, 0.75,
                             0.8, 0.8, 0.85, 0.85, 1.8},
           "avg ceil 5x5 grad");
    kpl_tensor_release(x);
    /* max, 3x3 / stride 2 / padding 1 on 6x7, x = [(i * 11) % 42 - 20 ...] */
    int64_t s67[4] = {1, 1, 6, 7};
    double v67[42];
    for (int i = 0; i < 42; i++) v67[i] = (i * 11) % 42 - 20;
    x = leaf(4, s67, v67);
    kpl_pool2d_params m3 = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true};
    y = NN(kpl_max_pool2d(x, &m3));
    assert_int_equal(kpl_tensor_shape(y)[2], 4);
    assert_int_equal(kpl_tensor_shape(y)[3], 4);
    expect(y, 16, (double[]){15, 13, 17, 4, 19, 19, 21, 21, 12, 20, 20, 18, -2, 20, 20, 11},
           "max ceil 6x7");
    OK(kpl_grad(ramp_sum(y), NULL, 1, &x, false, &g));
    expect(g, 42, (double[]){0, 0, 0, 1.1, 0, 0, 1.3, 1.0, 0, 0, 0, 1.2, 0, 0, 0, 2.9, 0, 0, 0,
                             3.3, 0, 0, 1.8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2.1, 0, 2.2, 0,
                             8.6, 0, 0, 2.5},
           "max ceil 6x7 grad");
    kpl_tensor_release(x);
    /* avg, 3x3 / stride 2 / padding 1 on 5x6, x = [((i * 5) % 30) * .5 - 3 ...],
     * count_include_pad True and False */
    int64_t s56[4] = {1, 1, 5, 6};
    double v56[30];
    for (int i = 0; i < 30; i++) v56[i] = ((i * 5) % 30) * 0.5 - 3;
    x = leaf(4, s56, v56);
    static const double want[2][12] = {
        {-1.75, 2.0, 7.0, 9.5, -1.75, 2.0, 7.0, 9.5, -1.75, 2.0, 7.0, 9.5},
        {-0.7777777777777778, 1.3333333333333333, 4.666666666666667, 3.1666666666666665,
         -1.1666666666666667, 2.0, 7.0, 4.75, -0.7777777777777778, 1.3333333333333333,
         4.666666666666667, 3.1666666666666665}};
    static const double wantg[2][30] = {
        {0.25, 0.43333333333333335, 0.18333333333333335, 0.3833333333333333, 0.19999999999999998,
         0.85, 0.4833333333333333, 0.8333333333333333, 0.35, 0.7277777777777777,
         0.37777777777777777, 1.5944444444444446, 0.2333333333333333, 0.39999999999999997,
         0.16666666666666666, 0.34444444444444444, 0.17777777777777778, 0.7444444444444446,
         0.6833333333333333, 1.1666666666666665, 0.4833333333333333, 0.9944444444444445,
         0.5111111111111111, 2.127777777777778, 0.45, 0.7666666666666666, 0.31666666666666665,
         0.6499999999999999, 0.3333333333333333, 1.3833333333333333},
        {0.1111111111111111, 0.23333333333333334, 0.12222222222222223, 0.25555555555555554,
         0.13333333333333333, 0.35, 0.26666666666666666, 0.5555555555555556, 0.28888888888888886,
         0.6, 0.3111111111111111, 0.8111111111111111, 0.15555555555555556, 0.3222222222222222,
         0.16666666666666666, 0.34444444444444444, 0.17777777777777778, 0.46111111111111114,
         0.35555555555555557, 0.7333333333333333, 0.37777777777777777, 0.7777777777777778, 0.4,
         1.0333333333333334, 0.2, 0.4111111111111111, 0.2111111111111111, 0.43333333333333335,
         0.2222222222222222, 0.5722222222222222}};
    for (int inc = 0; inc < 2; inc++) {
        kpl_pool2d_params ap = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1},
                                .count_include_pad = inc, .ceil_mode = true};
        y = NN(kpl_avg_pool2d(x, &ap));
        assert_int_equal(kpl_tensor_shape(y)[3], 4);
        expect(y, 12, want[inc], inc ? "avg ceil include_pad" : "avg ceil");
        OK(kpl_grad(ramp_sum(y), NULL, 1, &x, false, &g));
        expect(g, 30, wantg[inc], inc ? "avg ceil include_pad grad" : "avg ceil grad");
    }
    kpl_tensor_release(x);
    kpl_pool_pop(p);
}

static kpl_tensor *g_topk(kpl_tensor *const *x, void *u)
{
    (void)u;
    kpl_tensor *v = NULL, *i = NULL;
    if (kpl_topk(x[0], 2, true, &v, &i) < 0) return NULL;
    return kpl_square(v);
}

static void test_split_topk(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s25[2] = {2, 5};
    kpl_tensor *x = f64t(2, s25, (double[]){3, 1, 4, 1, 5, 9, 2, 6, 5, 3});
    kpl_tensor *parts[2];
    OK(kpl_split(x, 1, 2, (int64_t[]){2, 3}, parts));
    expect(parts[1], 6, (double[]){4, 1, 5, 6, 5, 3}, "split");
    FAILS(kpl_split(x, 1, 2, (int64_t[]){2, 2}, parts), KPL_ESHAPE, "sizes sum to 4 but axis 1 has 5");
    kpl_tensor *v = NULL, *i = NULL;
    OK(kpl_topk(x, 3, true, &v, &i));
    expect(v, 6, (double[]){5, 4, 3, 9, 6, 5}, "topk values");
    expect(i, 6, (double[]){4, 2, 0, 0, 2, 3}, "topk indices"); /* tie 5/5: lower index */
    OK(kpl_topk(x, 2, false, &v, &i));
    expect(v, 4, (double[]){1, 1, 2, 3}, "bottomk values");
    expect(i, 4, (double[]){1, 3, 1, 4}, "bottomk indices");
    FAILS(kpl_topk(x, 6, true, &v, &i), KPL_ERANGE, "k = 6 but the last dim has 5");
    kpl_pool_pop(p);
    int64_t s34[2] = {3, 4};
    kpl_tensor *g = param(2, s34, 41, -1, 1);
    OK(kpl_gradcheck(g_topk, NULL, 1, &g, 2, 1e-6, 1e-6, 1e-5));
    kpl_tensor_release(g);
}

static kpl_tensor *g_adaptive(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_adaptive_avg_pool2d(x[0], 2, 3));
}

static void test_adaptive_pool(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    /* 1x1x3x5 -> 2x3: rows {0,1}, {1,2}; cols {0,1}, {1,2,3}, {3,4} */
    int64_t xs[4] = {1, 1, 3, 5};
    kpl_tensor *x = NN(kpl_arange(kpl_device_cpu(), KPL_F64, 15, 0, 1));
    x = NN(kpl_reshape(x, 4, xs));
    kpl_tensor *y = NN(kpl_adaptive_avg_pool2d(x, 2, 3));
    double r0 = (0 + 1 + 5 + 6) / 4.0, r1 = (1 + 2 + 3 + 6 + 7 + 8) / 6.0;
    assert_float_equal(tget(y, 0), r0, 1e-12);
    assert_float_equal(tget(y, 1), r1, 1e-12);
    assert_float_equal(tget(y, 5), (8 + 9 + 13 + 14) / 4.0, 1e-12);
    /* output size 1 is the global average */
    assert_float_equal(tget(NN(kpl_adaptive_avg_pool2d(x, 1, 1)), 0), 7, 1e-12);
    kpl_pool_pop(p);
    int64_t gs[4] = {2, 2, 5, 7};
    kpl_tensor *g = param(4, gs, 51, -1, 1);
    OK(kpl_gradcheck(g_adaptive, NULL, 1, &g, 2, 1e-6, 1e-6, 1e-5));
    kpl_tensor_release(g);
}

static kpl_tensor *g_shapes(kpl_tensor *const *x, void *u)
{
    (void)u;
    /* every shape op on one path: pad reflect + constant, slice, concat,
     * upsample, embedding-style index_select */
    kpl_tensor *h = kpl_pad(x[0], 2, (int64_t[]){1, 2, 1, 0}, KPL_PAD_REFLECT, 0);
    h = kpl_pad(h, 1, (int64_t[]){1, 1}, KPL_PAD_CONSTANT, 0.5);
    kpl_tensor *parts[2] = {kpl_slice(h, 3, 0, 4), kpl_transpose(kpl_slice(h, 3, 4, 4), 2, 3)};
    h = kpl_concat(2, parts, 1);
    h = kpl_upsample_bilinear(h, 5, 4, false);
    h = kpl_index_select(h, 2, i64t(4, (int64_t[]){4, 0, 0, 2}));
    return kpl_square(h);
}

static void test_shape_ops_gradients(void **state)
{
    (void)state;
    int64_t xs[4] = {1, 2, 3, 3};
    kpl_tensor *x = param(4, xs, 21, -1, 1);
    kpl_pool *p = NN(kpl_pool_push());
    OK(kpl_gradcheck(g_shapes, NULL, 1, &x, 1, 1e-6, 1e-6, 1e-5));
    OK(kpl_gradcheck(g_shapes, NULL, 1, &x, 2, 1e-5, 1e-5, 1e-4));
    kpl_pool_pop(p);
    kpl_tensor_release(x);
}

/* concat along each axis of (2, 3, 4) pieces: five pieces (two ops, the
 * first result the first piece of the second), against the elements placed
 * by hand; any dtype; mixed float dtypes under autocast meet in the
 * widest; errors name the shapes. */
static void test_concat_values(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t base[3] = {2, 3, 4};
    for (int ax = 0; ax < 3; ax++) {
        kpl_tensor *xs[5];
        int64_t lens[5] = {1, 2, 1, 3, 1}, total = 8;
        for (int i = 0; i < 5; i++) {
            int64_t s[3] = {base[0], base[1], base[2]};
            s[ax] = lens[i];
            int64_t n = s[0] * s[1] * s[2];
            double v[3 * 3 * 4]; /* the largest piece */
            for (int64_t j = 0; j < n; j++) v[j] = 100 * i + (double)j;
            xs[i] = f64t(3, s, v);
        }
        kpl_tensor *y = NN(kpl_concat(5, xs, ax - 3)); /* a negative axis */
        assert_int_equal(kpl_tensor_shape(y)[ax], total);
        int64_t ys[3] = {base[0], base[1], base[2]};
        ys[ax] = total;
        for (int64_t a = 0; a < ys[0]; a++)
            for (int64_t b = 0; b < ys[1]; b++)
                for (int64_t c = 0; c < ys[2]; c++) {
                    int64_t idx[3] = {a, b, c}, k = idx[ax], piece = 0;
                    while (k >= lens[piece]) k -= lens[piece++];
                    idx[ax] = k;
                    int64_t s[3] = {base[0], base[1], base[2]};
                    s[ax] = lens[piece];
                    double want = 100.0 * (double)piece + (double)((idx[0] * s[1] + idx[1]) * s[2] + idx[2]);
                    assert_true(tget(y, (a * ys[1] + b) * ys[2] + c) == want);
                }
    }
    /* integers */
    kpl_tensor *ints[2] = {i64t(2, (int64_t[]){7, 8}), i64t(3, (int64_t[]){-1, -2, -3})};
    kpl_tensor *ic = NN(kpl_concat(2, ints, 0));
    assert_int_equal(kpl_tensor_dtype(ic), KPL_I64);
    expect(ic, 5, (double[]){7, 8, -1, -2, -3}, "i64 concat");
    /* mixed float dtypes under autocast: the widest */
    int64_t s2 = 2;
    kpl_tensor *a = NN(kpl_cast(f64t(1, &s2, (double[]){1, 2}), KPL_BF16));
    kpl_tensor *b = NN(kpl_cast(f64t(1, &s2, (double[]){3, 4}), KPL_F32));
    kpl_dtype prev;
    OK(kpl_set_autocast(KPL_BF16, &prev));
    kpl_tensor *m = kpl_concat(3, (kpl_tensor *[]){a, b, a}, 0);
    OK(kpl_set_autocast(prev, NULL));
    assert_non_null(m);
    assert_int_equal(kpl_tensor_dtype(m), KPL_F32);
    expect(NN(kpl_cast(m, KPL_F64)), 6, (double[]){1, 2, 3, 4, 1, 2}, "autocast concat");
    /* errors */
    int64_t s23[2] = {2, 3}, s32[2] = {3, 2};
    double v6[6] = {0};
    assert_null(kpl_concat(2, (kpl_tensor *[]){f64t(2, s23, v6), f64t(2, s32, v6)}, 1));
    assert_non_null(strstr(kpl_last_error(), "concat: (2,3) and (3,2) differ outside axis 1"));
    assert_null(kpl_concat(1, (kpl_tensor *[]){f64t(2, s23, v6)}, 2));
    assert_non_null(strstr(kpl_last_error(), "axis 2 out of range for 2 dims"));
    assert_null(kpl_concat(2, (kpl_tensor *[]){a, b}, 0)); /* no autocast: dtypes differ */
    assert_non_null(strstr(kpl_last_error(), "concat: piece 1 is f32 but piece 0 is bf16"));
    kpl_pool_pop(p);
}

static kpl_tensor *g_concat(kpl_tensor *const *x, void *u)
{
    int ax = *(const int *)u;
    kpl_tensor *parts[5] = {x[0], kpl_square(x[1]), x[0], kpl_slice(x[1], ax, 1, 1), x[1]};
    return kpl_square(kpl_concat(5, parts, ax));
}

/* Five pieces (two ops), two inputs used twice each: first and second order. */
static void test_concat_gradients(void **state)
{
    (void)state;
    int64_t s0[3] = {2, 3, 2};
    kpl_tensor *x0 = param(3, s0, 31, -1, 1), *x1 = param(3, s0, 32, -1, 1);
    kpl_pool *p = NN(kpl_pool_push());
    for (int ax = 0; ax < 3; ax++) {
        OK(kpl_gradcheck(g_concat, &ax, 2, (kpl_tensor *[]){x0, x1}, 1, 1e-6, 1e-6, 1e-5));
        OK(kpl_gradcheck(g_concat, &ax, 2, (kpl_tensor *[]){x0, x1}, 2, 1e-5, 1e-5, 1e-4));
    }
    kpl_pool_pop(p);
    kpl_tensor_release(x0);
    kpl_tensor_release(x1);
}

int run_loss_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_values),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_gradients),
        cmocka_unit_test(test_norms_and_dropout_values),
        cmocka_unit_test(test_group_norm_fused),
        cmocka_unit_test(test_norm_gradients),
        cmocka_unit_test(test_shape_ops_values),
        cmocka_unit_test(test_shape_ops_gradients),
        cmocka_unit_test(test_concat_values),
        cmocka_unit_test(test_concat_gradients),
        cmocka_unit_test(test_conv_transpose),
        cmocka_unit_test(test_split_topk),
        cmocka_unit_test(test_adaptive_pool),
        cmocka_unit_test(test_bce_logits_at_zero),
        cmocka_unit_test(test_bce_logits_large_logits),
        cmocka_unit_test(test_bce_logits_shape_check),
        cmocka_unit_test(test_bce_logits_pos_weight),
        cmocka_unit_test(test_bce_logits_pos_weight_gradcheck),
        cmocka_unit_test(test_conv_transpose_output_padding),
        cmocka_unit_test(test_conv_transpose_output_padding_gradcheck),
        cmocka_unit_test(test_batch_norm_one_value_per_channel),
        cmocka_unit_test(test_batch_norm_grad_f32_accuracy),
        cmocka_unit_test(test_cross_entropy_all_ignored),
        cmocka_unit_test(test_smooth_l1_beta_zero),
        cmocka_unit_test(test_pool_ceil_mode),
    };
    return cmocka_run_group_tests_name("nn", tests, NULL, NULL);
}
