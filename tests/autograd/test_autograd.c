/* test_autograd.c — gradients of every op against finite differences,
 * higher orders, accumulation, errors, reverse-mode GC, and an MLP that
 * learns. */
#include "ag_test.h"

/* ---- op table for the gradient checks --------------------------------------------- */

typedef struct {
    const char *name;
    kpl_gradcheck_fn fn;
    int nin;
    double lo, hi; /* input range (positive for log, sqrt, ...) */
    int max_order; /* highest order checked */
} gcase;

#define U(NAME, EXPR) \
    static kpl_tensor *f_##NAME(kpl_tensor *const *x, void *u) { (void)u; return (EXPR); }

U(neg, kpl_neg(x[0]))
U(abs, kpl_abs(x[0]))
U(exp, kpl_exp(x[0]))
U(log, kpl_log(x[0]))
U(sqrt, kpl_sqrt(x[0]))
U(rsqrt, kpl_rsqrt(x[0]))
U(square, kpl_square(x[0]))
U(reciprocal, kpl_reciprocal(x[0]))
U(sin, kpl_sin(x[0]))
U(cos, kpl_cos(x[0]))
U(tanh, kpl_tanh(x[0]))
U(sigmoid, kpl_sigmoid(x[0]))
U(relu, kpl_relu(x[0]))
U(leaky_relu, kpl_leaky_relu(x[0], 0.1))
U(leaky_neg, kpl_leaky_relu(x[0], -0.3))
U(clip, kpl_clip(x[0], -0.5, 0.5))
U(add, kpl_add(x[0], x[1]))
U(sub, kpl_sub(x[0], x[1]))
U(mul, kpl_mul(x[0], x[1]))
U(div, kpl_div(x[0], x[1]))
U(pow, kpl_pow(x[0], x[1]))
U(maximum, kpl_maximum(x[0], x[1]))
U(minimum, kpl_minimum(x[0], x[1]))
U(add_s, kpl_scalar_op(KPL_BIN_ADD, x[0], 1.5, false))
U(rsub_s, kpl_scalar_op(KPL_BIN_SUB, x[0], 1.5, true))
U(mul_s, kpl_scalar_op(KPL_BIN_MUL, x[0], -2.5, false))
U(div_s, kpl_scalar_op(KPL_BIN_DIV, x[0], 3, false))
U(rdiv_s, kpl_scalar_op(KPL_BIN_DIV, x[0], 3, true))
U(pow_s, kpl_scalar_op(KPL_BIN_POW, x[0], 2.5, false))
U(rpow_s, kpl_scalar_op(KPL_BIN_POW, x[0], 1.7, true))
U(max_s, kpl_scalar_op(KPL_BIN_MAXIMUM, x[0], 0.3, false))
U(where, kpl_where(kpl_compare(KPL_BIN_GT, x[0], x[1]), x[0], kpl_square(x[1])))
U(sum_ax, kpl_sum(x[0], (int[]){1}, 1, false))
U(mean_all, kpl_mean(x[0], NULL, 0, false))
U(max_ax, kpl_max(x[0], (int[]){0}, 1, true))
U(min_ax, kpl_min(x[0], (int[]){-1}, 1, false))
U(var_ax, kpl_var(x[0], (int[]){1}, 1, false, 1))
U(lse_ax, kpl_logsumexp(x[0], (int[]){1}, 1, false))
U(matmul, kpl_matmul(x[0], x[1], false, false))
U(matmul_tt, kpl_matmul(x[0], x[1], true, true))
U(reshape, kpl_square(kpl_reshape(x[0], 1, (int64_t[]){12})))
U(permute, kpl_mul(kpl_permute(x[0], (int[]){1, 0}), kpl_permute(x[0], (int[]){1, 0})))
U(expand, kpl_square(kpl_expand(x[0], 3, (int64_t[]){2, 3, 4})))
U(cast, kpl_square(kpl_cast(x[0], KPL_F32)))
U(erf, kpl_erf(x[0]))
U(gelu, kpl_gelu(x[0]))
U(gelu_tanh, kpl_gelu_tanh(x[0]))
U(narrow, kpl_square(kpl_narrow(x[0], 1, 2)))
U(pad_rows, kpl_square(kpl_pad_rows(x[0], 2, 1)))
U(softplus, kpl_softplus(x[0]))

static kpl_conv2d_params conv_p;
static kpl_tensor *f_conv(kpl_tensor *const *x, void *u)
{
    /* squared, so the output gradient depends on x and w and the second
     * order reaches every input of the gradient halves */
    return kpl_square(kpl_conv2d(x[0], x[1], u ? x[2] : NULL, &conv_p));
}

static kpl_tensor *f_conv_relu(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_conv2d_relu(x[0], x[1], x[2], &conv_p));
}

static void check(const gcase *c, int order, const int64_t shapes[][3], const int *ndims)
{
    kpl_tensor *in[3] = {NULL, NULL, NULL};
    for (int i = 0; i < c->nin; i++) in[i] = param(ndims[i], shapes[i], 100 + (uint64_t)i, c->lo, c->hi);
    bool f32 = c->fn == f_cast;
    kpl_status st = kpl_gradcheck(c->fn, NULL, c->nin, in, order, f32 ? 1e-3 : 1e-6,
                                  f32 ? 1e-2 : 1e-6, f32 ? 1e-2 : 1e-5);
    if (st != KPL_OK) fail_msg("%s order %d: %s", c->name, order, kpl_last_error());
    for (int i = 0; i < c->nin; i++) kpl_tensor_release(in[i]);
}

static void test_gradcheck_all_ops(void **state)
{
    (void)state;
    const gcase cases[] = {
        {"neg", f_neg, 1, -2, 2, 2},        {"abs", f_abs, 1, 0.2, 2, 2},
        {"exp", f_exp, 1, -1, 1, 2},        {"log", f_log, 1, 0.5, 2, 2},
        {"sqrt", f_sqrt, 1, 0.5, 2, 2},     {"rsqrt", f_rsqrt, 1, 0.5, 2, 2},
        {"square", f_square, 1, -2, 2, 2},  {"reciprocal", f_reciprocal, 1, 0.5, 2, 2},
        {"sin", f_sin, 1, -2, 2, 2},        {"cos", f_cos, 1, -2, 2, 2},
        {"tanh", f_tanh, 1, -2, 2, 2},      {"sigmoid", f_sigmoid, 1, -2, 2, 2},
        {"relu", f_relu, 1, 0.1, 2, 2},     {"leaky_relu", f_leaky_relu, 1, 0.1, 2, 2},
        {"leaky_relu<0", f_leaky_relu, 1, -2, -0.1, 2}, {"leaky_neg", f_leaky_neg, 1, 0.1, 2, 2},
        {"leaky_neg<0", f_leaky_neg, 1, -2, -0.1, 2},
        {"clip", f_clip, 1, -0.4, 0.4, 2},  {"add", f_add, 2, -2, 2, 4},
        {"sub", f_sub, 2, -2, 2, 4},        {"mul", f_mul, 2, -2, 2, 4},
        {"div", f_div, 2, 0.5, 2, 2},       {"pow", f_pow, 2, 0.5, 2, 2},
        {"maximum", f_maximum, 2, -2, 2, 2}, {"minimum", f_minimum, 2, -2, 2, 2},
        {"add_s", f_add_s, 1, -2, 2, 2},    {"rsub_s", f_rsub_s, 1, -2, 2, 2},
        {"mul_s", f_mul_s, 1, -2, 2, 2},    {"div_s", f_div_s, 1, -2, 2, 2},
        {"rdiv_s", f_rdiv_s, 1, 0.5, 2, 2}, {"pow_s", f_pow_s, 1, 0.5, 2, 2},
        {"rpow_s", f_rpow_s, 1, -1, 1, 2},  {"max_s", f_max_s, 1, -2, 2, 2},
        {"where", f_where, 2, -2, 2, 1},    {"sum_ax", f_sum_ax, 1, -2, 2, 2},
        {"mean_all", f_mean_all, 1, -2, 2, 2}, {"max_ax", f_max_ax, 1, -2, 2, 1},
        {"min_ax", f_min_ax, 1, -2, 2, 1},  {"var_ax", f_var_ax, 1, -2, 2, 2},
        {"lse_ax", f_lse_ax, 1, -2, 2, 2},  {"reshape", f_reshape, 1, -2, 2, 2},
        {"permute", f_permute, 1, -2, 2, 2}, {"cast", f_cast, 1, -2, 2, 1},
        {"erf", f_erf, 1, -2, 2, 2},        {"gelu", f_gelu, 1, -2, 2, 2},
        {"gelu_tanh", f_gelu_tanh, 1, -2, 2, 2}, {"narrow", f_narrow, 1, -2, 2, 2},
        {"pad_rows", f_pad_rows, 1, -2, 2, 2}, {"softplus", f_softplus, 1, -3, 3, 3},
    };
    /* Binary ops broadcast: (3,4) with (4); unary ops see (3,4). */
    const int64_t shapes[3][3] = {{3, 4}, {4}, {3, 4}};
    const int ndims[3] = {2, 1, 2};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int order = 1; order <= cases[k].max_order; order++)
            check(&cases[k], order, shapes, ndims);
    /* matmul with batch broadcasting and transposes; second order too */
    const gcase mm = {"matmul", f_matmul, 2, -1, 1, 2};
    const int64_t mshapes[2][3] = {{2, 3, 4}, {4, 5}};
    const int mnd[2] = {3, 2};
    check(&mm, 1, mshapes, mnd);
    check(&mm, 2, mshapes, mnd);
    const gcase mmt = {"matmul_tt", f_matmul_tt, 2, -1, 1, 1};
    const int64_t tshapes[2][3] = {{4, 3}, {5, 4}};
    const int tnd[2] = {2, 2};
    check(&mmt, 1, tshapes, tnd);
    /* 1-D operands: (4) @ (4,5), (2,3,4) @ (4), (4) @ (4) */
    const int64_t v1[2][3] = {{4}, {4, 5}}, v2[2][3] = {{2, 3, 4}, {4}}, v3[2][3] = {{4}, {4}};
    const int nd1[2] = {1, 2}, nd2[2] = {3, 1}, nd3[2] = {1, 1};
    check(&mm, 1, v1, nd1);
    check(&mm, 2, v1, nd1);
    check(&mm, 1, v2, nd2);
    check(&mm, 2, v2, nd2);
    check(&mm, 1, v3, nd3);
    check(&mm, 2, v3, nd3);
    const gcase ex = {"expand", f_expand, 1, -1, 1, 2};
    const int64_t eshapes[1][3] = {{3, 1}};
    const int end[1] = {2};
    check(&ex, 1, eshapes, end);
    check(&ex, 2, eshapes, end);
}

static void test_gradcheck_conv2d(void **state)
{
    (void)state;
    /* stride 2 + padding, dilation 2, groups 2 (with bias), depthwise */
    const kpl_conv2d_params ps[4] = {
        {{2, 2}, {1, 1}, {1, 1}, 1}, {{1, 1}, {2, 2}, {2, 2}, 1},
        {{1, 2}, {1, 0}, {1, 1}, 2}, {{1, 1}, {1, 1}, {1, 1}, 4}};
    const int64_t xs[4][4] = {{2, 2, 5, 6}, {1, 2, 5, 5}, {1, 4, 5, 6}, {1, 4, 4, 5}};
    const int64_t ws[4][4] = {{3, 2, 3, 3}, {2, 2, 3, 2}, {4, 2, 2, 3}, {4, 1, 3, 3}};
    for (int k = 0; k < 4; k++) {
        conv_p = ps[k];
        int64_t bs = ws[k][0];
        kpl_tensor *in[3] = {param(4, xs[k], 40, -1, 1), param(4, ws[k], 41, -1, 1),
                             param(1, &bs, 42, -1, 1)};
        /* order 3 reaches the gradients of the gradient halves' own inputs */
        for (int order = 1; order <= (k == 0 ? 3 : 2); order++) {
            kpl_status st = kpl_gradcheck(f_conv, (void *)1, 3, in, order, 1e-6, 1e-6, 1e-5);
            if (st != KPL_OK) fail_msg("conv2d case %d order %d: %s", k, order, kpl_last_error());
        }
        if (k == 0) {
            /* the fused conv2d_relu: one op on the CPU, the two ops' gradients */
            kpl_pool *pool = NN(kpl_pool_push());
            kpl_tensor *y = NN(kpl_conv2d_relu(in[0], in[1], in[2], &conv_p));
            assert_int_equal(kpl_node_op(kpl_tensor_node(y, NULL)), KPL_OP_CONV2D_RELU);
            kpl_pool_pop(pool);
            for (int order = 1; order <= 2; order++) {
                kpl_status st = kpl_gradcheck(f_conv_relu, NULL, 3, in, order, 1e-6, 1e-6, 1e-5);
                if (st != KPL_OK) fail_msg("conv2d_relu order %d: %s", order, kpl_last_error());
            }
        }
        for (int i = 0; i < 3; i++) kpl_tensor_release(in[i]);
    }
}

static kpl_pool2d_params pool_p;
static kpl_tensor *f_maxpool(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_max_pool2d(x[0], &pool_p));
}
static kpl_tensor *f_avgpool(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_avg_pool2d(x[0], &pool_p));
}
static kpl_tensor *f_gap(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_global_avg_pool2d(x[0]));
}

static void test_gradcheck_pooling(void **state)
{
    (void)state;
    int64_t xs[4] = {2, 3, 5, 6};
    kpl_tensor *x = param(4, xs, 60, -1, 1);
    /* on 5x6: the ceil_mode cases have a last row (2x2) or column (3x3)
     * of windows hanging over the input */
    const kpl_pool2d_params ps[5] = {
        {.kernel = {2, 2}, .stride = {2, 2}},
        {.kernel = {3, 3}, .stride = {2, 1}, .padding = {1, 1}},
        {.kernel = {3, 2}, .stride = {1, 2}, .padding = {1, 1}, .count_include_pad = true},
        {.kernel = {2, 2}, .stride = {2, 2}, .ceil_mode = true},
        {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .count_include_pad = true,
         .ceil_mode = true},
    };
    for (int k = 0; k < 5; k++) {
        pool_p = ps[k];
        for (int order = 1; order <= 2; order++) {
            if (kpl_gradcheck(f_maxpool, NULL, 1, &x, order, 1e-6, 1e-6, 1e-5) != KPL_OK)
                fail_msg("max_pool2d case %d order %d: %s", k, order, kpl_last_error());
            if (kpl_gradcheck(f_avgpool, NULL, 1, &x, order, 1e-6, 1e-6, 1e-5) != KPL_OK)
                fail_msg("avg_pool2d case %d order %d: %s", k, order, kpl_last_error());
        }
    }
    OK(kpl_gradcheck(f_gap, NULL, 1, &x, 2, 1e-6, 1e-6, 1e-5));
    kpl_tensor_release(x);
}

/* An f64 leaf (requires_grad) from values; the caller releases it. */
static kpl_tensor *leaf_of(int ndim, const int64_t *shape, const double *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, ndim, shape, v, &t));
    OK(kpl_set_requires_grad(t, true));
    return t;
}

static void expect_values(kpl_tensor *t, int n, const double *v, const char *what)
{
    assert_non_null(t);
    assert_int_equal(kpl_tensor_numel(t), n);
    for (int i = 0; i < n; i++) assert_close(tget(t, i), v[i], 0, 0, what, i);
}

/* maximum/minimum at ties split the gradient in half, as PyTorch's
 * derivatives.yaml: self gets where(self == other, grad / 2, grad)
 * .masked_fill_(self < other, 0), other the same with self > other
 * (minimum: the comparisons swapped); with a NaN neither comparison
 * holds and both get grad.  The scalar forms are clamp_min/clamp_max:
 * where(self >= min, grad, 0), the whole gradient at a tie; clamp's
 * clamp_backward is where(self >= min & self <= max, grad, 0). */
static void test_maximum_minimum_ties(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s5 = 5;
    kpl_tensor *a = leaf_of(1, &s5, (double[]){1, 2, 3, 5, NAN});
    kpl_tensor *b = leaf_of(1, &s5, (double[]){1, 3, 2, 5, 1});
    kpl_tensor *gy = NULL, *g[2];
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 1, &s5,
                            (double[]){1, 10, 100, 1000, 10000}, &gy));
    kpl_autorelease(gy);
    OK(kpl_grad(kpl_maximum(a, b), gy, 2, (kpl_tensor *[]){a, b}, false, g));
    expect_values(g[0], 5, (double[]){0.5, 0, 100, 500, 10000}, "maximum d/da");
    expect_values(g[1], 5, (double[]){0.5, 10, 0, 500, 10000}, "maximum d/db");
    OK(kpl_grad(kpl_minimum(a, b), gy, 2, (kpl_tensor *[]){a, b}, false, g));
    expect_values(g[0], 5, (double[]){0.5, 10, 0, 500, 10000}, "minimum d/da");
    expect_values(g[1], 5, (double[]){0.5, 0, 100, 500, 10000}, "minimum d/db");
    /* Broadcast: a (2,3) against b (3); b's gradient is summed over the
     * rows: col 0 = 1/2 (tie) + 1 (0 < 1), col 1 = 1/2 + 1/2, col 2 =
     * 1/2 + 0 (4 > 3). */
    int64_t s23[2] = {2, 3}, s3 = 3;
    kpl_tensor *a2 = leaf_of(2, s23, (double[]){1, 2, 3, 0, 2, 4});
    kpl_tensor *b2 = leaf_of(1, &s3, (double[]){1, 2, 3});
    kpl_tensor *l = kpl_sum(kpl_maximum(a2, b2), NULL, 0, false);
    OK(kpl_grad(l, NULL, 2, (kpl_tensor *[]){a2, b2}, false, g));
    expect_values(g[0], 6, (double[]){0.5, 0.5, 0.5, 0, 0.5, 1}, "maximum broadcast d/da");
    expect_values(g[1], 3, (double[]){1.5, 1, 0.5}, "maximum broadcast d/db");
    /* Second order at a tie: y = maximum(a, b), d/da sum(y^2) = 2 y / 2
     * = a where a == b, and d/da of that sum is 1/2 * 1/2 * 2 = 0.5 (the
     * mask is constant); b's second derivative likewise; where a < b
     * (element 1) a's is 0 and b's 2. */
    kpl_tensor *y = kpl_maximum(a2, b2), *g1[2], *g2[2];
    OK(kpl_grad(kpl_sum(kpl_square(y), NULL, 0, false), NULL, 2, (kpl_tensor *[]){a2, b2},
                true, g1));
    expect_values(g1[0], 6, (double[]){1, 2, 3, 0, 2, 8}, "maximum 1st order");
    OK(kpl_grad(kpl_sum(g1[0], NULL, 0, false), NULL, 2, (kpl_tensor *[]){a2, b2}, false, g2));
    expect_values(g2[0], 6, (double[]){0.5, 0.5, 0.5, 0, 0.5, 2}, "maximum d2/da2");
    /* d/db sum(g1[0]) sums 2 coef_a coef_b over the rows: 0.5 + 0,
     * 0.5 + 0.5, 0.5 + 0 */
    expect_values(g2[1], 3, (double[]){0.5, 1, 0.5}, "maximum d2/dadb");
    /* scalar forms: clamp_min(x, 2) / clamp_max(x, 2) keep the whole gradient at x == 2 */
    int64_t s3b = 3;
    kpl_tensor *x = leaf_of(1, &s3b, (double[]){1, 2, 3});
    OK(kpl_grad(kpl_sum(kpl_scalar_op(KPL_BIN_MAXIMUM, x, 2, false), NULL, 0, false), NULL, 1,
                &x, false, g));
    expect_values(g[0], 3, (double[]){0, 1, 1}, "clamp_min d/dx");
    OK(kpl_grad(kpl_sum(kpl_scalar_op(KPL_BIN_MINIMUM, x, 2, false), NULL, 0, false), NULL, 1,
                &x, false, g));
    expect_values(g[0], 3, (double[]){1, 1, 0}, "clamp_max d/dx");
    /* clip is clamp(x, lo, hi): the whole gradient at either bound */
    OK(kpl_grad(kpl_sum(kpl_clip(x, 1, 2), NULL, 0, false), NULL, 1, &x, false, g));
    expect_values(g[0], 3, (double[]){1, 1, 0}, "clamp d/dx");
    kpl_pool_pop(p);
    kpl_tensor *all[] = {a, b, a2, b2, x};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kpl_tensor_release(all[i]);
}

/* Leaky ReLU keeps its output for the gradient, not its input (y > 0
 * exactly where x > 0 for a slope >= 0): the gradient where x is 0, -0,
 * NaN, +-inf, and a slope of 0; a negative slope is composed of recorded
 * ops with PyTorch's values and gradient (x > 0 ? x : x slope). */
static void test_leaky_relu_saved(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s7 = 7;
    double xs[7] = {-2, -0.0, 0, 3, NAN, INFINITY, -INFINITY};
    kpl_tensor *x = leaf_of(1, &s7, xs), *gy = NULL, *g = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 1, &s7, (double[]){1, 2, 4, 8, 16, 32, 64},
                            &gy));
    kpl_autorelease(gy);
    kpl_tensor *y = kpl_leaky_relu(x, 0.25);
    kpl_node *n = kpl_tensor_node(y, NULL);
    assert_non_null(n);
    assert_null(kpl_node_saved_input(n, 0));
    assert_non_null(kpl_node_saved_output(n));
    OK(kpl_grad(y, gy, 1, &x, false, &g));
    expect_values(g, 7, (double[]){0.25, 0.5, 1, 8, 4, 32, 16}, "leaky_relu(0.25) d/dx");
    OK(kpl_grad(kpl_leaky_relu(x, 0), gy, 1, &x, false, &g));
    expect_values(g, 7, (double[]){0, 0, 0, 8, 0, 32, 0}, "leaky_relu(0) d/dx");
    kpl_tensor *yn = kpl_leaky_relu(x, -0.5);
    double v[7];
    OK(kpl_tensor_to_host(yn, v, sizeof v));
    const double want[7] = {1, 0.0, -0.0, 3, NAN, INFINITY, INFINITY};
    for (int i = 0; i < 7; i++) {
        if (isnan(want[i])) {
            assert_true(isnan(v[i]));
            continue;
        }
        assert_true(v[i] == want[i] && !signbit(v[i]) == !signbit(want[i]));
    }
    assert_int_not_equal(kpl_node_op(kpl_tensor_node(yn, NULL)), KPL_OP_LEAKY_RELU);
    OK(kpl_grad(yn, gy, 1, &x, false, &g));
    expect_values(g, 7, (double[]){-0.5, -1, -2, 8, -8, 32, -32}, "leaky_relu(-0.5) d/dx");
    kpl_pool_pop(p);
    kpl_tensor_release(x);
}

static void test_accumulate_and_errors(void **state)
{
    (void)state;
    int64_t s3 = 3;
    kpl_tensor *w = param(1, &s3, 1, -1, 1);
    for (int rep = 1; rep <= 2; rep++) {
        kpl_pool *p = kpl_pool_push();
        kpl_tensor *l = kpl_sum(kpl_scalar_op(KPL_BIN_MUL, w, 3, false), NULL, 0, false);
        OK(kpl_backward(l, NULL, false));
        kpl_pool_pop(p);
        assert_float_equal(tget(kpl_grad_get(w), 2), 3.0 * rep, 1e-12); /* accumulates */
    }
    kpl_zero_grad(1, &w);
    assert_null(kpl_grad_get(w));
    /* a second backward through a freed graph is an error */
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *l = kpl_sum(kpl_exp(w), NULL, 0, false);
    OK(kpl_backward(l, NULL, false));
    assert_int_equal(kpl_backward(l, NULL, false), KPL_ESTATE);
    assert_non_null(strstr(kpl_last_error(), "retain_graph"));
    /* retain_graph allows it */
    kpl_tensor *l2 = kpl_sum(kpl_exp(w), NULL, 0, false);
    OK(kpl_backward(l2, NULL, true));
    OK(kpl_backward(l2, NULL, false));
    /* non-scalar outputs need grad_output */
    kpl_tensor *v = kpl_exp(w);
    assert_int_equal(kpl_backward(v, NULL, false), KPL_ESHAPE);
    assert_non_null(strstr(kpl_last_error(), "pass grad_output"));
    /* no-grad: nothing recorded, backward refuses */
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor *q = kpl_sum(kpl_exp(w), NULL, 0, false);
    kpl_set_grad_enabled(prev);
    assert_null(kpl_tensor_node(q, NULL));
    assert_int_equal(kpl_backward(q, NULL, false), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "does not require grad"));
    kpl_pool_pop(p);
    kpl_tensor_release(w);
}

static void test_grad_of_intermediate(void **state)
{
    (void)state;
    int64_t s2 = 2;
    kpl_tensor *x = param(1, &s2, 3, 1, 2);
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *h = kpl_square(x);            /* h = x^2 */
    kpl_tensor *y = kpl_sum(kpl_mul(h, h), NULL, 0, false); /* y = sum x^4 */
    kpl_tensor *in[2] = {h, x}, *g[2];
    OK(kpl_grad(y, NULL, 2, in, false, g));
    assert_float_equal(tget(g[0], 1), 2 * tget(h, 1), 1e-12);             /* dy/dh = 2h */
    assert_float_equal(tget(g[1], 0), 4 * pow(tget(x, 0), 3), 1e-9);      /* dy/dx = 4x^3 */
    assert_null(kpl_grad_get(x));                                     /* .grad untouched */
    kpl_pool_pop(p);
    kpl_tensor_release(x);
}

static int ready_order[16], n_ready;
static kpl_status on_ready(kpl_tensor *p, void *user)
{
    (void)p;
    ready_order[n_ready++] = (int)(intptr_t)user;
    return KPL_OK;
}
/* A ready hook that fails: the backward ends with its status and message. */
static kpl_status refuse(kpl_tensor *p, void *user)
{
    (void)p;
    ready_order[n_ready++] = (int)(intptr_t)user;
    return kpl_set_error(KPL_ECOMM, "hook %d refused", (int)(intptr_t)user);
}

static kpl_tensor *times_ten(kpl_tensor *t, kpl_tensor *g, void *user)
{
    (void)t;
    (void)user;
    return kpl_scalar_op(KPL_BIN_MUL, g, 10, false);
}

static void test_hooks(void **state)
{
    (void)state;
    int64_t s22[2] = {2, 2};
    kpl_tensor *w[3];
    for (int i = 0; i < 3; i++) {
        w[i] = param(2, s22, 20 + (uint64_t)i, -1, 1);
        OK(kpl_add_ready_hook(w[i], on_ready, (void *)(intptr_t)i));
    }
    n_ready = 0;
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *h = kpl_matmul(kpl_matmul(w[0], w[1], false, false), w[2], false, false);
    kpl_tensor *l = kpl_sum(h, NULL, 0, false);
    OK(kpl_backward(l, NULL, false));
    /* each parameter once, in backward order: w2 first, w0 last */
    assert_int_equal(n_ready, 3);
    assert_int_equal(ready_order[0], 2);
    assert_int_equal(ready_order[1], 1);
    assert_int_equal(ready_order[2], 0);
    double g_plain = tget(kpl_grad_get(w[0]), 0);
    /* a gradient hook on an intermediate result scales what flows upstream */
    kpl_zero_grad(3, w);
    kpl_tensor *h2 = kpl_matmul(w[0], w[1], false, false);
    OK(kpl_add_grad_hook(h2, times_ten, NULL));
    kpl_tensor *l2 = kpl_sum(kpl_matmul(h2, w[2], false, false), NULL, 0, false);
    OK(kpl_backward(l2, NULL, false));
    assert_float_equal(tget(kpl_grad_get(w[0]), 0), 10 * g_plain, 1e-9);
    /* and on a parameter, before it accumulates */
    kpl_zero_grad(3, w);
    OK(kpl_add_grad_hook(w[0], times_ten, NULL));
    kpl_tensor *l3 = kpl_sum(kpl_matmul(kpl_matmul(w[0], w[1], false, false), w[2], false, false),
                             NULL, 0, false);
    OK(kpl_backward(l3, NULL, false));
    assert_float_equal(tget(kpl_grad_get(w[0]), 0), 10 * g_plain, 1e-9);
    kpl_tensor *c = kpl_full(kpl_device_cpu(), KPL_F64, 0, NULL, 1);
    assert_int_equal(kpl_add_grad_hook(c, times_ten, NULL), KPL_EINVAL);
    /* a ready hook's failure ends the backward: w2's hook refuses, so the
     * backward stops there and w1's and w0's hooks never run */
    kpl_zero_grad(3, w);
    for (int i = 0; i < 3; i++) kpl_clear_hooks(w[i]);
    for (int i = 0; i < 3; i++) OK(kpl_add_ready_hook(w[i], i == 2 ? refuse : on_ready,
                                                      (void *)(intptr_t)i));
    n_ready = 0;
    kpl_tensor *l4 = kpl_sum(kpl_matmul(kpl_matmul(w[0], w[1], false, false), w[2], false, false),
                             NULL, 0, false);
    FAILS(kpl_backward(l4, NULL, false), KPL_ECOMM, "hook 2 refused");
    assert_int_equal(n_ready, 1);
    kpl_pool_pop(p);
    for (int i = 0; i < 3; i++) kpl_tensor_release(w[i]);
}

/* Gradient buffers (the DDP bucketer's views): backward adds into the
 * installed tensor in place, across backwards, and the ready hook sees the
 * total there; a plain .grad set afterwards ends the mode. */
static void test_grad_buffer(void **state)
{
    (void)state;
    const int64_t s22[2] = {2, 2};
    kpl_tensor *a = param(2, s22, 31, -1, 1), *b = param(2, s22, 32, -1, 1);
    kpl_tensor *w[2] = {a, b};
    /* The reference: ordinary accumulation of two backwards of
     * sum(a * b + a + b) (d/da = b + 1, d/db = a + 1, doubled). */
    double want[2][4];
    kpl_pool *p = kpl_pool_push();
    for (int k = 0; k < 2; k++) {
        kpl_tensor *l = kpl_sum(kpl_add(kpl_add(kpl_mul(a, b), a), b), NULL, 0, false);
        OK(kpl_backward(l, NULL, false));
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            want[i][j] = tget(kpl_grad_get(w[i]), j);
            assert_float_equal(want[i][j], 2 * (tget(w[1 - i], j) + 1), 1e-12);
        }
    kpl_zero_grad(2, w);
    /* The same into buffers; `a + b` hands one gradient tensor to both
     * parameters, which must not make the two buffers one. */
    kpl_tensor *buf[2];
    for (int i = 0; i < 2; i++) {
        OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F64, 2, s22, &buf[i]));
        OK(kpl_grad_set_buffer(w[i], buf[i]));
        assert_true(kpl_grad_is_buffer(w[i]));
        OK(kpl_add_ready_hook(w[i], on_ready, (void *)(intptr_t)i));
    }
    for (int k = 0; k < 2; k++) {
        n_ready = 0;
        kpl_tensor *l = kpl_sum(kpl_add(kpl_add(kpl_mul(a, b), a), b), NULL, 0, false);
        OK(kpl_backward(l, NULL, false));
        assert_int_equal(n_ready, 2);
    }
    for (int i = 0; i < 2; i++) {
        assert_ptr_equal(kpl_grad_get(w[i]), buf[i]); /* still the buffer, added into */
        for (int j = 0; j < 4; j++) assert_float_equal(tget(buf[i], j), want[i][j], 1e-12);
    }
    /* A mismatched buffer is refused; kpl_grad_set ends the mode. */
    const int64_t s4 = 3;
    kpl_tensor *bad = NULL;
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F64, 1, &s4, &bad));
    FAILS(kpl_grad_set_buffer(a, bad), KPL_ESHAPE, "does not fit parameter");
    kpl_grad_set(a, NULL);
    assert_false(kpl_grad_is_buffer(a));
    kpl_pool_pop(p);
    kpl_tensor_release(bad);
    for (int i = 0; i < 2; i++) {
        kpl_clear_hooks(w[i]);
        kpl_tensor_release(buf[i]);
        kpl_tensor_release(w[i]);
    }
}

/* Peak allocator bytes of one step of a deep MLP: the GC frees saved
 * activations and gradients as backward goes. */
static size_t mlp_step_peak(bool free_forward_pool, int layers, int64_t width, int64_t batch)
{
    kpl_device *cpu = kpl_device_cpu();
    kpl_tensor *w[16];
    int64_t ws[2] = {width, width}, xs[2] = {batch, width};
    for (int i = 0; i < layers; i++) w[i] = param(2, ws, 10 + (uint64_t)i, -0.05, 0.05);
    kpl_device_empty_cache(cpu);
    kpl_device_reset_peak(cpu);
    size_t base = kpl_device_memory_stats(cpu).allocated;
    kpl_pool *step = kpl_pool_push();
    kpl_pool *fw = kpl_pool_push();
    kpl_rng *r = kpl_rng_create(1);
    kpl_tensor *h = kpl_randn(cpu, KPL_F64, 2, xs, r, 0, 1);
    kpl_rng_destroy(r);
    for (int i = 0; i < layers; i++) h = kpl_tanh(kpl_matmul(h, w[i], false, false));
    kpl_tensor *loss = kpl_mean(kpl_square(h), NULL, 0, false);
    kpl_tensor_retain(loss);
    if (free_forward_pool) kpl_pool_pop(fw);
    OK(kpl_backward(loss, NULL, false));
    kpl_tensor_release(loss);
    if (!free_forward_pool) kpl_pool_pop(fw);
    kpl_pool_pop(step);
    size_t peak = kpl_device_memory_stats(cpu).peak_allocated - base;
    for (int i = 0; i < layers; i++) kpl_tensor_release(w[i]);
    return peak;
}

static void test_gc_lowers_peak(void **state)
{
    (void)state;
    size_t kept = mlp_step_peak(false, 8, 256, 128);
    size_t gc = mlp_step_peak(true, 8, 256, 128);
    print_message("MLP step peak: %zu bytes with the forward pool held, %zu with GC\n", kept, gc);
    assert_true(gc < kept * 0.8);
}

/* An MLP on a separable synthetic problem: 784-512-256-10, softmax cross
 * entropy, SGD; the loss must fall below a fixed bound in 200 steps. */
static void test_mlp_learns(void **state)
{
    (void)state;
    kpl_device *cpu = kpl_device_cpu();
    const int64_t B = 64, D = 784, C = 10;
    int64_t sizes[4] = {D, 512, 256, C};
    kpl_tensor *W[3], *bias[3];
    kpl_rng *rng = kpl_rng_create(7);
    for (int l = 0; l < 3; l++) {
        int64_t ws[2] = {sizes[l], sizes[l + 1]}, bs[1] = {sizes[l + 1]};
        OK(kpl_tensor_empty(cpu, KPL_F32, 2, ws, &W[l]));
        OK(kpl_k_normal(W[l], rng, 0, sqrt(2.0 / (double)sizes[l])));
        OK(kpl_tensor_zeros(cpu, KPL_F32, 1, bs, &bias[l]));
        OK(kpl_set_requires_grad(W[l], true));
        OK(kpl_set_requires_grad(bias[l], true));
    }
    /* class prototypes; inputs = prototype of the label + noise */
    int64_t ps[2] = {C, D};
    kpl_tensor *proto = NULL;
    OK(kpl_tensor_empty(cpu, KPL_F32, 2, ps, &proto));
    OK(kpl_k_normal(proto, rng, 0, 1));
    double first = 0, last = 0;
    for (int step = 0; step < 200; step++) {
        kpl_pool *p = kpl_pool_push();
        int64_t xs[2] = {B, D}, ys[2] = {B, C};
        kpl_tensor *x = kpl_randn(cpu, KPL_F32, 2, xs, rng, 0, 1);
        kpl_tensor *onehot = kpl_full(cpu, KPL_F32, 2, ys, 0);
        float *oh = kpl_tensor_host_mutable(onehot);
        float *xv = kpl_tensor_host_mutable(x);
        const float *pv = kpl_tensor_host_data(proto);
        for (int64_t i = 0; i < B; i++) {
            int64_t c = (i * 7 + step) % C;
            oh[i * C + c] = 1;
            for (int64_t d = 0; d < D; d++) xv[i * D + d] = 0.5f * xv[i * D + d] + pv[c * D + d];
        }
        kpl_tensor *h = x;
        for (int l = 0; l < 3; l++) {
            h = kpl_add(kpl_matmul(h, W[l], false, false), bias[l]);
            if (l < 2) h = kpl_relu(h);
        }
        /* cross entropy = mean(logsumexp(z) - sum(z * onehot)) */
        int ax = 1;
        kpl_tensor *loss = kpl_mean(kpl_sub(kpl_logsumexp(h, &ax, 1, false),
                                            kpl_sum(kpl_mul(h, onehot), &ax, 1, false)),
                                    NULL, 0, false);
        if (!loss) fail_msg("forward: %s", kpl_last_error());
        OK(kpl_backward(loss, NULL, false));
        double v = tget(loss, 0);
        if (step == 0) first = v;
        last = v;
        for (int l = 0; l < 3; l++) { /* SGD, in place, outside the graph */
            kpl_tensor *ps2[2] = {W[l], bias[l]};
            for (int k = 0; k < 2; k++) {
                kpl_tensor *g = kpl_grad_get(ps2[k]);
                kpl_tensor *upd = kpl_scalar_op(KPL_BIN_MUL, g, 0.05, false);
                OK(kpl_k_binary(ps2[k], KPL_BIN_SUB, ps2[k], upd));
            }
            kpl_zero_grad(2, ps2);
        }
        kpl_pool_pop(p);
    }
    print_message("MLP loss %.4f -> %.4f\n", first, last);
    assert_true(first > 1.0);
    assert_true(last < 0.05);
    for (int l = 0; l < 3; l++) {
        kpl_tensor_release(W[l]);
        kpl_tensor_release(bias[l]);
    }
    kpl_tensor_release(proto);
    kpl_rng_destroy(rng);
}

int run_loss_tests(void);
int run_gather_tests(void);
int run_custom_tests(void);
int run_recompute_tests(void);
int run_op_table_tests(void);

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gradcheck_all_ops),
        cmocka_unit_test(test_gradcheck_conv2d),
        cmocka_unit_test(test_gradcheck_pooling),
        cmocka_unit_test(test_maximum_minimum_ties),
        cmocka_unit_test(test_leaky_relu_saved),
        cmocka_unit_test(test_accumulate_and_errors),
        cmocka_unit_test(test_grad_of_intermediate),
        cmocka_unit_test(test_hooks),
        cmocka_unit_test(test_grad_buffer),
        cmocka_unit_test(test_gc_lowers_peak),
        cmocka_unit_test(test_mlp_learns),
    };
    int failed = cmocka_run_group_tests_name("autograd", tests, NULL, NULL);
    failed += run_loss_tests();
    failed += run_gather_tests();
    failed += run_custom_tests();
    failed += run_op_table_tests();
    failed += run_recompute_tests();
    return failed ? 1 : 0;
}
