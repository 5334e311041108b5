/* test_focal.c — the sigmoid focal loss (graph/vision.h), the recorded
 * composition and the fused op pair: against PyTorch's numbers
 * (data/focal_loss.bin, made by detops_ref.py), by hand, by finite
 * differences to the third order, fused against composed, and through its
 * error messages.  A second group of the test_detops executable. */
#include "detops_test.h"

int run_focal_tests(void);

/* ---- the focal loss ----------------------------------------------------------------------- */

static const char *const focal_cases[] = {"a", "b", "c", "d", "e"};

static void test_focal_reference(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(DETOPS_DATA_DIR, "focal_loss.bin");
    for (size_t c = 0; c < sizeof focal_cases / sizeof focal_cases[0]; c++)
        for (int f = 0; f < 2; f++) {
            kpl_dtype dt = dtypes[f];
            kpl_pool *pool = NN(kpl_pool_push());
            const char *cs = focal_cases[c];
            const kpl_ref_tensor *pr = KPL_REF(rf, "focal.%s.params", cs);
            double alpha = pr->v[0], gamma = pr->v[1];
            kpl_tensor *z = kpl_ref_param(KPL_REF(rf, "focal.%s.logits", cs), dt);
            kpl_tensor *y = kpl_ref_tensor_of(KPL_REF(rf, "focal.%s.targets", cs), dt);
            kpl_tensor *gy = kpl_ref_tensor_of(KPL_REF(rf, "focal.%s.gy", cs), dt);
            char what[64];
            snprintf(what, sizeof what, "focal %s %s", cs, kpl_dtype_name(dt));
            kpl_tensor *l = NN(kpl_sigmoid_focal_loss(z, y, alpha, gamma, KPL_REDUCE_NONE));
            kpl_ref_expect(l, KPL_REF(rf, "focal.%s.loss", cs), RTOL(dt), ATOL(dt), what);
            kpl_tensor *g = grad_of(l, gy, z);
            for (int64_t i = 0; i < kpl_tensor_numel(g); i++)
                if (!isfinite(tget(g, i))) fail_msg("%s: gradient %lld is not finite", what,
                                                    (long long)i);
            kpl_ref_expect(g, KPL_REF(rf, "focal.%s.grad", cs), RTOL(dt), ATOL(dt), what);
            kpl_tensor *m = NN(kpl_sigmoid_focal_loss(z, y, alpha, gamma, KPL_REDUCE_MEAN));
            kpl_ref_expect(m, KPL_REF(rf, "focal.%s.mean", cs), RTOL(dt), ATOL(dt), what);
            kpl_ref_expect(grad_of(m, NULL, z), KPL_REF(rf, "focal.%s.grad_mean", cs), RTOL(dt),
                           ATOL(dt), what);
            kpl_ref_expect(NN(kpl_sigmoid_focal_loss(z, y, alpha, gamma, KPL_REDUCE_SUM)),
                           KPL_REF(rf, "focal.%s.sum", cs), RTOL(dt), ATOL(dt), what);
            kpl_pool_pop(pool);
            kpl_tensor_release(z);
        }
    kpl_ref_free(rf);
}

static void test_focal_by_hand(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = dtypes[f];
        double tol = dt == KPL_F64 ? 1e-15 : 1e-6;
        int64_t n = 6;
        /* logit 0: p = 1/2, CE = log 2, 1 - p_t = 1/2 for either target */
        kpl_tensor *z0 = tensor(dt, 1, &n, (double[]){0, 0, 0, 0, 0, 0});
        kpl_tensor *y0 = tensor(dt, 1, &n, (double[]){1, 0, 1, 0, 1, 0});
        double l2 = log(2.0);
        expect_values(NN(kpl_sigmoid_focal_loss(z0, y0, 0.25, 2, KPL_REDUCE_NONE)),
                      (double[]){0.25 * 0.25 * l2, 0.75 * 0.25 * l2, 0.25 * 0.25 * l2,
                                 0.75 * 0.25 * l2, 0.25 * 0.25 * l2, 0.75 * 0.25 * l2},
                      n, tol, "logit 0");
        /* gamma 0, no alpha: the binary cross entropy itself */
        kpl_tensor *z = tensor(dt, 1, &n, (double[]){-3, -1, 0.5, 2, 4, 1});
        kpl_tensor *a = NN(kpl_sigmoid_focal_loss(z, y0, -1, 0, KPL_REDUCE_NONE));
        kpl_tensor *b = NN(kpl_bce_with_logits(z, y0, KPL_REDUCE_NONE));
        /* (the fused kernel's vector exp and log1p may round differently
         * from the element-wise ops' in the last bit) */
        for (int64_t i = 0; i < n; i++)
            assert_close(tget(a, i), tget(b, i), dt == KPL_F64 ? 5e-16 : 2.5e-7, 0, "gamma 0", i);
        /* Large logits: right ones cost 0 with gradient 0, wrong ones cost
         * |z| (weighted) with gradient -+1 (weighted); all finite, for
         * gamma 2 and 0.5 alike. */
        kpl_tensor *zl = NULL;
        double zv[6] = {1000, -1000, 1000, -1000, 200, -200};
        OK(kpl_tensor_to_device(tensor(dt, 1, &n, zv), kpl_device_cpu(), &zl));
        OK(kpl_set_requires_grad(zl, true));
        kpl_tensor *yl = tensor(dt, 1, &n, (double[]){1, 0, 0, 1, 1, 1});
        for (int gi = 0; gi < 2; gi++) {
            double gamma = gi ? 0.5 : 2;
            kpl_tensor *l = NN(kpl_sigmoid_focal_loss(zl, yl, 0.25, gamma, KPL_REDUCE_NONE));
            expect_values(l, (double[]){0, 0, 0.75 * 1000, 0.25 * 1000, 0, 0.25 * 200}, n,
                          1e-12 * 1000, "large logits");
            expect_values(grad_of(kpl_sum(l, NULL, 0, false), NULL, zl),
                          (double[]){0, 0, 0.75, -0.25, 0, -0.25}, n,
                          1e-12, "large logits, gradient");
        }
        kpl_tensor_release(zl);
    }
    /* the mean of nothing is 0 */
    int64_t zero = 0;
    kpl_tensor *e = tensor(KPL_F32, 1, &zero, NULL);
    expect_values(NN(kpl_sigmoid_focal_loss(e, e, 0.25, 2, KPL_REDUCE_MEAN)), (double[]){0}, 1, 0,
                  "empty mean");
    kpl_pool_pop(pool);
}

typedef struct {
    double alpha, gamma;
    kpl_reduction red;
} focal_user;

static kpl_tensor *f_focal(kpl_tensor *const *in, void *u)
{
    const focal_user *f = u;
    return kpl_sigmoid_focal_loss(in[0], in[1], f->alpha, f->gamma, f->red);
}

static void test_focal_gradcheck(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    double zv[12] = {-4, -2.5, -1, -0.3, 0.2, 0.9, 1.7, 3, 5, -6, 0.05, 2.2};
    double yv[12] = {1, 0, 1, 0, 0.3, 1, 0, 0.8, 1, 0, 1, 0};
    kpl_tensor *z = param(KPL_F64, 2, (int64_t[]){3, 4}, zv);
    kpl_tensor *y = param(KPL_F64, 2, (int64_t[]){3, 4}, yv);
    kpl_tensor *in[2] = {z, y};
    focal_user cases[] = {{0.25, 2, KPL_REDUCE_MEAN}, {-1, 1.5, KPL_REDUCE_NONE},
                          {0.6, 0.5, KPL_REDUCE_SUM}, {0.25, 1, KPL_REDUCE_SUM},
                          {0.25, 0, KPL_REDUCE_NONE}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int order = 1; order <= 3; order++)
            if (kpl_gradcheck(f_focal, &cases[i], 2, in, order, 1e-6, 1e-6, 1e-5) != KPL_OK)
                fail_msg("focal alpha %g gamma %g, order %d: %s", cases[i].alpha, cases[i].gamma,
                         order, kpl_last_error());
    kpl_pool_pop(pool);
    kpl_tensor_release(z);
    kpl_tensor_release(y);
}

/* The same cases with constant targets run the fused op pair (its
 * backward's gradient composed): to the third order in the logits, and
 * the backward op to the second order in gy as well. */
typedef struct {
    focal_user f;
    kpl_tensor *y;
} focal_const;

static kpl_tensor *f_focal_const(kpl_tensor *const *in, void *u)
{
    const focal_const *c = u;
    return kpl_sigmoid_focal_loss(in[0], c->y, c->f.alpha, c->f.gamma, c->f.red);
}

static kpl_tensor *f_focal_bwd(kpl_tensor *const *in, void *u)
{
    const focal_const *c = u;
    return kpl_sigmoid_focal_bwd(in[0], c->y, in[1], c->f.alpha, c->f.gamma);
}

static void test_focal_fused_gradcheck(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    double zv[12] = {-4, -2.5, -1, -0.3, 0.2, 0.9, 1.7, 3, 5, -6, 0.05, 2.2};
    double yv[12] = {1, 0, 1, 0, 0.3, 1, 0, 0.8, 1, 0, 1, 0};
    double gv[12] = {0.5, -1, 2, 0.1, -0.7, 1, 1.5, -0.2, 0.3, 0.9, -1.1, 0.4};
    int64_t s34[2] = {3, 4};
    kpl_tensor *z = param(KPL_F64, 2, s34, zv), *gy = param(KPL_F64, 2, s34, gv);
    focal_const cases[] = {{{0.25, 2, KPL_REDUCE_MEAN}, NULL}, {{-1, 1.5, KPL_REDUCE_NONE}, NULL},
                           {{0.6, 0.5, KPL_REDUCE_SUM}, NULL}, {{0.25, 1, KPL_REDUCE_SUM}, NULL},
                           {{0.25, 0, KPL_REDUCE_NONE}, NULL}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cases[i].y = tensor(KPL_F64, 2, s34, yv);
        for (int order = 1; order <= 3; order++)
            if (kpl_gradcheck(f_focal_const, &cases[i], 1, &z, order, 1e-6, 1e-6, 1e-5) != KPL_OK)
                fail_msg("fused focal alpha %g gamma %g, order %d: %s", cases[i].f.alpha,
                         cases[i].f.gamma, order, kpl_last_error());
        for (int order = 1; order <= 2; order++)
            if (kpl_gradcheck(f_focal_bwd, &cases[i], 2, (kpl_tensor *[]){z, gy}, order, 1e-6,
                              1e-6, 1e-5) != KPL_OK)
                fail_msg("focal bwd alpha %g gamma %g, order %d: %s", cases[i].f.alpha,
                         cases[i].f.gamma, order, kpl_last_error());
    }
    kpl_pool_pop(pool);
    kpl_tensor_release(z);
    kpl_tensor_release(gy);
}

/* The fused op (constant targets) against the recorded composition
 * (targets that require grad), values and logit gradients, over logits
 * from -30 to 30 and hard and soft targets; f16/bf16 are the f32 kernel
 * rounded once; a traced loss and gradient run by the executor give
 * eager's bits. */
static void test_focal_fused_vs_composed(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    int64_t n = 601;
    double *zv = malloc((size_t)n * sizeof *zv), *yv = malloc((size_t)n * sizeof *yv);
    assert_true(zv && yv);
    for (int64_t i = 0; i < n; i++) {
        zv[i] = -30 + 0.1 * (double)i;
        yv[i] = i % 3 == 0 ? 1 : i % 3 == 1 ? 0 : 0.25;
    }
    const double params[3][2] = {{0.25, 2}, {-1, 0.5}, {0.7, 0}};
    for (int f = 0; f < 2; f++)
        for (int k = 0; k < 3; k++) {
            kpl_dtype dt = dtypes[f];
            kpl_tensor *z = param(dt, 1, &n, zv), *yc = tensor(dt, 1, &n, yv);
            kpl_tensor *yg = param(dt, 1, &n, yv);
            double a = params[k][0], g = params[k][1];
            kpl_tensor *lf = NN(kpl_sigmoid_focal_loss(z, yc, a, g, KPL_REDUCE_NONE));
            kpl_tensor *lc = NN(kpl_sigmoid_focal_loss(z, yg, a, g, KPL_REDUCE_NONE));
            kpl_tensor *gf = grad_of(NN(kpl_sum(lf, NULL, 0, false)), NULL, z);
            kpl_tensor *gc = grad_of(NN(kpl_sum(lc, NULL, 0, false)), NULL, z);
            double tol = dt == KPL_F64 ? 1e-13 : 2e-6;
            for (int64_t i = 0; i < n; i++) {
                assert_close(tget(lf, i), tget(lc, i), tol, tol, "fused loss", i);
                assert_close(tget(gf, i), tget(gc, i), tol, tol, "fused gradient", i);
            }
            kpl_tensor_release(z);
            kpl_tensor_release(yg);
        }
    kpl_tensor *z = tensor(KPL_F32, 1, &n, zv), *y = tensor(KPL_F32, 1, &n, yv);
    for (int h = 0; h < 2; h++) {
        kpl_dtype hd = h ? KPL_BF16 : KPL_F16;
        kpl_tensor *zh = NN(kpl_cast(z, hd)), *yh = NN(kpl_cast(y, hd));
        kpl_tensor *l = NN(kpl_sigmoid_focal(zh, yh, 0.25, 2));
        kpl_tensor *w = NN(kpl_cast(NN(kpl_sigmoid_focal(NN(kpl_cast(zh, KPL_F32)),
                                                         NN(kpl_cast(yh, KPL_F32)), 0.25, 2)), hd));
        assert_int_equal(kpl_tensor_dtype(l), hd);
        for (int64_t i = 0; i < n; i++) assert_true(tget(l, i) == tget(w, i));
    }
    kpl_tensor *zp = param(KPL_F32, 1, &n, zv);
    kpl_tensor *loss = NN(kpl_sigmoid_focal_loss(zp, y, 0.25, 2, KPL_REDUCE_SUM)), *gz = NULL;
    OK(kpl_grad(loss, NULL, 1, &zp, false, &gz));
    OK(kpl_trace_begin());
    kpl_tensor *tz = NN(kpl_trace_input(zp, "z")), *ty = NN(kpl_trace_input(y, "y"));
    OK(kpl_set_requires_grad(tz, true));
    kpl_tensor *tl = NN(kpl_sigmoid_focal_loss(tz, ty, 0.25, 2, KPL_REDUCE_SUM)), *tg = NULL;
    OK(kpl_grad(tl, NULL, 1, &tz, false, &tg));
    kpl_ir *ir = NULL;
    OK(kpl_trace_end(2, (kpl_tensor *[]){tl, tg}, (const char *[]){"loss", "gz"}, &ir));
    char *dump = ir_dump_text(ir);
    if (!strstr(dump, "= sigmoid_focal(") || !strstr(dump, "= sigmoid_focal_bwd(") ||
        !strstr(dump, ") alpha=0.25 gamma=2"))
        fail_msg("graph dump lacks the fused pair:\n%s", dump);
    free(dump);
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    OK(kpl_exec_set_input(ex, 0, zp));
    OK(kpl_exec_set_input(ex, 1, y));
    OK(kpl_exec_run(ex));
    assert_true(tget(kpl_exec_output(ex, 0), 0) == tget(loss, 0));
    for (int64_t i = 0; i < n; i++) assert_true(tget(kpl_exec_output(ex, 1), i) == tget(gz, i));
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    kpl_tensor_release(zp);
    free(zv);
    free(yv);
    kpl_pool_pop(pool);
}

static kpl_status focal_st(kpl_tensor *z, kpl_tensor *y, double alpha, double gamma,
                           kpl_reduction red)
{
    return kpl_sigmoid_focal_loss(z, y, alpha, gamma, red) ? KPL_OK : kpl_last_status();
}

static void test_focal_errors(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    double v[6] = {0};
    kpl_tensor *z = tensor(KPL_F32, 2, (int64_t[]){2, 3}, v);
    OK(focal_st(z, z, 0.25, 2, KPL_REDUCE_SUM));
    FAILS(focal_st(z, tensor(KPL_F32, 1, (int64_t[]){6}, v), 0.25, 2, KPL_REDUCE_SUM), KPL_ESHAPE,
          "sigmoid_focal_loss: 'logits' (2,3) and 'targets' (6) must have one shape");
    FAILS(focal_st(z, tensor(KPL_F64, 2, (int64_t[]){2, 3}, v), 0.25, 2, KPL_REDUCE_SUM),
          KPL_EDTYPE, "sigmoid_focal_loss: 'logits' has dtype f32 and 'targets' f64");
    kpl_tensor *zi = tensor(KPL_I64, 2, (int64_t[]){2, 3}, v);
    FAILS(focal_st(zi, zi, 0.25, 2, KPL_REDUCE_SUM), KPL_EDTYPE, "both f32 or both f64");
    FAILS(focal_st(z, z, 0.25, -1, KPL_REDUCE_SUM), KPL_EINVAL,
          "sigmoid_focal_loss: gamma -1 must be finite and >= 0");
    FAILS(focal_st(z, z, 0.25, INFINITY, KPL_REDUCE_SUM), KPL_EINVAL, "gamma inf must be");
    FAILS(focal_st(z, z, 1.5, 2, KPL_REDUCE_SUM), KPL_EINVAL, "alpha 1.5 in [0, 1]");
    FAILS(focal_st(z, z, NAN, 2, KPL_REDUCE_SUM), KPL_EINVAL, "alpha nan in [0, 1]");
    FAILS(focal_st(z, z, 0.25, 2, (kpl_reduction)9), KPL_EINVAL,
          "sigmoid_focal_loss: unknown reduction 9");
    kpl_pool_pop(pool);
}

int run_focal_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_focal_reference),       cmocka_unit_test(test_focal_by_hand),
        cmocka_unit_test(test_focal_gradcheck),       cmocka_unit_test(test_focal_errors),
        cmocka_unit_test(test_focal_fused_gradcheck), cmocka_unit_test(test_focal_fused_vs_composed),
    };
    return cmocka_run_group_tests_name("focal", tests, NULL, NULL);
}
