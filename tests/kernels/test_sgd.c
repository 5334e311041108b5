/* test_sgd.c — kpl_k_sgd_update, the fused SGD step, against the
 * element-wise ops it replaces (trainer/optim/optim.c's composed form),
 * bit for bit, and its bad input. */
#include "test_util.h"

#include <math.h>
#include <string.h>

/* The composed step: the ops optim.c ran before the fused kernel. */
static void composed(kpl_tensor *p, kpl_tensor *v, kpl_tensor *g, double lr, double mu, double wd,
                     bool nesterov, bool first)
{
    kpl_tensor *d = g, *t1 = NULL, *t2 = NULL;
    OK(kpl_tensor_empty_like(p, &t1));
    OK(kpl_tensor_empty_like(p, &t2));
    if (wd > 0) {
        OK(kpl_k_binary_scalar(t1, KPL_BIN_MUL, p, wd, false));
        OK(kpl_k_binary(t1, KPL_BIN_ADD, t1, g));
        d = t1;
    }
    if (v) {
        if (first) {
            OK(kpl_k_copy(v, d));
        } else {
            OK(kpl_k_binary_scalar(v, KPL_BIN_MUL, v, mu, false));
            OK(kpl_k_binary(v, KPL_BIN_ADD, v, d));
        }
        if (nesterov) {
            OK(kpl_k_binary_scalar(t2, KPL_BIN_MUL, v, mu, false));
            OK(kpl_k_binary(t2, KPL_BIN_ADD, t2, d));
            d = t2;
        } else {
            d = v;
        }
    }
    kpl_tensor *s = d == t1 || d == t2 ? d : t1; /* d scaled in place when scratch */
    OK(kpl_k_binary_scalar(s, KPL_BIN_MUL, d, lr, false));
    OK(kpl_k_binary(p, KPL_BIN_SUB, p, s));
    kpl_tensor_release(t1);
    kpl_tensor_release(t2);
}

static kpl_tensor *copy_of(kpl_tensor *t)
{
    kpl_tensor *c = NULL;
    OK(kpl_tensor_empty_like(t, &c));
    OK(kpl_k_copy(c, t));
    return c;
}

static void same_bits(kpl_tensor *a, kpl_tensor *b, const char *what, const char *ctx, int step)
{
    size_t es = kpl_dtype_size(kpl_tensor_dtype(a));
    const unsigned char *pa = kpl_tensor_host_data(a), *pb = kpl_tensor_host_data(b);
    for (int64_t i = 0; i < kpl_tensor_numel(a); i++)
        if (memcmp(pa + i * es, pb + i * es, es))
            fail_msg("%s, step %d, %s[%lld]: fused %.17g, composed %.17g", ctx, step, what,
                     (long long)i, tget(a, i), tget(b, i));
}

/* Three steps of every form (f32, f64; momentum 0 and 0.9; weight decay 0
 * and 1e-4; Nesterov) on a parameter long enough to split over threads
 * and odd in length, with gradients of every sign and size: parameter and
 * momentum buffer equal the composed ops' bit for bit. */
static void test_sgd_fused_same_bits(void **state)
{
    (void)state;
    const kpl_dtype dts[2] = {KPL_F32, KPL_F64};
    int64_t n = 300007;
    for (int di = 0; di < 2; di++)
        for (int form = 0; form < 6; form++) {
            double mu = form % 3 == 0 ? 0 : 0.9, wd = form < 3 ? 0 : 1e-4;
            bool nesterov = form % 3 == 2;
            kpl_dtype dt = dts[di];
            char ctx[96];
            snprintf(ctx, sizeof ctx, "%s momentum %g wd %g%s", kpl_dtype_name(dt), mu, wd,
                     nesterov ? " nesterov" : "");
            kpl_tensor *p = trand(dt, 1, &n, 1, -2, 2), *pc = copy_of(p);
            kpl_tensor *v = mu > 0 ? tnew(dt, 1, &n) : NULL, *vc = mu > 0 ? tnew(dt, 1, &n) : NULL;
            for (int step = 0; step < 3; step++) {
                kpl_tensor *g = trand(dt, 1, &n, 10 + (uint64_t)step, -1e3, 1e3);
                double lr = 0.1 / (step + 1); /* a schedule's changing rate */
                OK(kpl_k_sgd_update(p, v, g, lr, mu, wd, nesterov, step == 0));
                composed(pc, vc, g, lr, mu, wd, nesterov, step == 0);
                same_bits(p, pc, "p", ctx, step);
                if (v) same_bits(v, vc, "v", ctx, step);
                kpl_tensor_release(g);
            }
            kpl_tensor *ts[] = {p, pc, v, vc};
            for (int i = 0; i < 4; i++)
                if (ts[i]) kpl_tensor_release(ts[i]);
        }
}

/* p - g lr by hand on three values; then each bad argument named. */
static void test_sgd_values_and_errors(void **state)
{
    (void)state;
    int64_t three = 3, two = 2;
    kpl_tensor *p = tf32(1, &three, (float[]){1, -2, 0.5f});
    kpl_tensor *g = tf32(1, &three, (float[]){4, 2, -1});
    kpl_tensor *v = tnew(KPL_F32, 1, &three);
    OK(kpl_k_sgd_update(p, v, g, 0.5, 0.9, 0, false, true)); /* v = g, p -= 0.5 g */
    double want[3] = {-1, -3, 1};
    assert_tensor_close(p, want, 0, 0, "p after the first step");
    assert_tensor_close(v, (double[]){4, 2, -1}, 0, 0, "v after the first step");
    OK(kpl_k_sgd_update(p, v, g, 0.5, 0.5, 0, false, false)); /* v = 0.5 v + g = 1.5 g */
    assert_tensor_close(v, (double[]){6, 3, -1.5}, 0, 0, "v after the second step");
    assert_tensor_close(p, (double[]){-4, -4.5, 1.75}, 0, 0, "p after the second step");

    FAILS(kpl_k_sgd_update(p, NULL, g, 0.1, 0.9, 0, false, false), KPL_EINVAL,
          "sgd_update: a momentum buffer 'v' goes with momentum > 0");
    FAILS(kpl_k_sgd_update(p, v, g, 0.1, 0, 0, false, false), KPL_EINVAL,
          "sgd_update: a momentum buffer 'v' goes with momentum > 0");
    FAILS(kpl_k_sgd_update(p, NULL, g, NAN, 0, 0, false, false), KPL_EINVAL,
          "sgd_update: lr nan");
    FAILS(kpl_k_sgd_update(p, NULL, g, 0.1, 0, -1, false, false), KPL_EINVAL,
          "must be finite, momentum and weight decay not negative");
    FAILS(kpl_k_sgd_update(p, NULL, g, 0.1, 0, 0, true, false), KPL_EINVAL,
          "sgd_update: nesterov needs momentum > 0");
    FAILS(kpl_k_sgd_update(p, NULL, p, 0.1, 0, 0, false, false), KPL_EINVAL, "sgd_update");
    kpl_tensor *g2 = tnew(KPL_F32, 1, &two), *g64 = tnew(KPL_F64, 1, &three);
    kpl_tensor *i64 = tnew(KPL_I64, 1, &three);
    FAILS(kpl_k_sgd_update(p, NULL, g2, 0.1, 0, 0, false, false), KPL_ESHAPE, "sgd_update");
    FAILS(kpl_k_sgd_update(p, NULL, g64, 0.1, 0, 0, false, false), KPL_EDTYPE, "sgd_update");
    FAILS(kpl_k_sgd_update(i64, NULL, i64, 0.1, 0, 0, false, false), KPL_EDTYPE, "f32 or f64");
    /* a bad call wrote nothing */
    assert_tensor_close(p, (double[]){-4, -4.5, 1.75}, 0, 0, "p after the refused calls");
    kpl_tensor *ts[] = {p, g, v, g2, g64, i64};
    for (int i = 0; i < 6; i++) kpl_tensor_release(ts[i]);
}

int run_sgd_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sgd_fused_same_bits),
        cmocka_unit_test(test_sgd_values_and_errors),
    };
    return cmocka_run_group_tests_name("sgd", tests, NULL, NULL);
}
