/* test_gather.c — gather, scatter_add and detach in the graph: values
 * against hand computations (torch.gather / Tensor.scatter_add give the
 * same numbers), gradients against finite differences to the second and
 * third order, the gradients' own recorded ops, and the errors of bad
 * indices. */
#include "ag_test.h"

int run_gather_tests(void);

static kpl_tensor *f64t(int ndim, const int64_t *shape, const double *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, ndim, shape, v, &t));
    return kpl_autorelease(t);
}

static kpl_tensor *i64t(int ndim, const int64_t *shape, const int64_t *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, ndim, shape, v, &t));
    return kpl_autorelease(t);
}

/* t has `shape` and the values v, exactly. */
static void expect(kpl_tensor *t, int ndim, const int64_t *shape, const double *v,
                   const char *what)
{
    if (!t) fail_msg("%s: NULL (%s)", what, kpl_last_error());
    assert_int_equal(kpl_tensor_ndim(t), ndim);
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) {
        assert_int_equal(kpl_tensor_shape(t)[d], shape[d]);
        n *= shape[d];
    }
    for (int64_t i = 0; i < n; i++) assert_close(tget(t, i), v[i], 0, 0, what, i);
}

/* x (2, 3) = [[1, 2, 3], [4, 5, 6]]; x3 (2, 2, 3) = 1..12. */
static const double X23[6] = {1, 2, 3, 4, 5, 6};
static const double X223[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};

static void test_gather_values(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    kpl_tensor *x = f64t(2, (int64_t[]){2, 3}, X23);
    /* axis 1: out[i][j] = x[i][idx[i][j]] */
    kpl_tensor *i1 = i64t(2, (int64_t[]){2, 2}, (int64_t[]){2, 0, 1, 1});
    expect(kpl_gather(x, 1, i1), 2, (int64_t[]){2, 2}, (double[]){3, 1, 5, 5}, "gather 2-D axis 1");
    expect(kpl_gather(x, -1, i1), 2, (int64_t[]){2, 2}, (double[]){3, 1, 5, 5},
           "gather 2-D axis -1");
    /* axis 0: out[i][j] = x[idx[i][j]][j]; idx has fewer rows than x */
    kpl_tensor *i0 = i64t(2, (int64_t[]){1, 3}, (int64_t[]){1, 0, 1});
    expect(kpl_gather(x, 0, i0), 2, (int64_t[]){1, 3}, (double[]){4, 2, 6}, "gather 2-D axis 0");
    /* and more rows than x along the axis, repeating them */
    kpl_tensor *i0b = i64t(2, (int64_t[]){3, 2}, (int64_t[]){1, 1, 0, 1, 1, 0});
    expect(kpl_gather(x, 0, i0b), 2, (int64_t[]){3, 2}, (double[]){4, 5, 1, 5, 4, 2},
           "gather 2-D axis 0, 3 rows");

    kpl_tensor *x3 = f64t(3, (int64_t[]){2, 2, 3}, X223);
    /* axis 0: out[0][j][k] = x3[idx[0][j][k]][j][k], idx (1, 2, 2) */
    kpl_tensor *a0 = i64t(3, (int64_t[]){1, 2, 2}, (int64_t[]){1, 0, 0, 1});
    expect(kpl_gather(x3, 0, a0), 3, (int64_t[]){1, 2, 2}, (double[]){7, 2, 4, 11},
           "gather 3-D axis 0");
    /* axis 1: out[i][0][k] = x3[i][idx[i][0][k]][k], idx (2, 1, 3) */
    kpl_tensor *a1 = i64t(3, (int64_t[]){2, 1, 3}, (int64_t[]){1, 0, 1, 0, 1, 1});
    expect(kpl_gather(x3, 1, a1), 3, (int64_t[]){2, 1, 3}, (double[]){4, 2, 6, 7, 11, 12},
           "gather 3-D axis 1");
    /* axis 2: out[i][j][k] = x3[i][j][idx[i][j][k]], idx (2, 2, 2) */
    kpl_tensor *a2 = i64t(3, (int64_t[]){2, 2, 2}, (int64_t[]){2, 2, 0, 1, 1, 0, 2, 0});
    expect(kpl_gather(x3, 2, a2), 3, (int64_t[]){2, 2, 2}, (double[]){3, 3, 4, 5, 8, 7, 12, 10},
           "gather 3-D axis 2");
    expect(kpl_gather(x3, -1, a2), 3, (int64_t[]){2, 2, 2}, (double[]){3, 3, 4, 5, 8, 7, 12, 10},
           "gather 3-D axis -1");
    /* f32 the same */
    kpl_tensor *xf = NN(kpl_cast(x, KPL_F32));
    kpl_tensor *gf = NN(kpl_gather(xf, 1, i1));
    assert_int_equal(kpl_tensor_dtype(gf), KPL_F32);
    expect(gf, 2, (int64_t[]){2, 2}, (double[]){3, 1, 5, 5}, "gather f32");
    /* not recorded when nothing requires grad */
    assert_null(kpl_tensor_node(gf, NULL));
    kpl_pool_pop(p);
}

static void test_scatter_add_values(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    kpl_tensor *x = f64t(2, (int64_t[]){2, 3}, X23);
    /* axis 1, repeated indices: row 0 adds 10 + 20 at column 0 and 30 at
     * column 2; row 1 adds 1 + 2 + 3 at column 1 */
    kpl_tensor *i1 = i64t(2, (int64_t[]){2, 3}, (int64_t[]){0, 0, 2, 1, 1, 1});
    kpl_tensor *s1 = f64t(2, (int64_t[]){2, 3}, (double[]){10, 20, 30, 1, 2, 3});
    kpl_tensor *r = NN(kpl_scatter_add(x, 1, i1, s1));
    expect(r, 2, (int64_t[]){2, 3}, (double[]){31, 2, 33, 4, 11, 6}, "scatter_add 2-D axis 1");
    expect(x, 2, (int64_t[]){2, 3}, X23, "scatter_add leaves x alone");
    assert_false(kpl_tensor_shares_storage(r, x));
    /* axis 0 into zeros (3, 2): out[idx[i][j]][j] += src[i][j] */
    kpl_tensor *z = NN(kpl_full(kpl_device_cpu(), KPL_F64, 2, (int64_t[]){3, 2}, 0));
    kpl_tensor *i0 = i64t(2, (int64_t[]){2, 2}, (int64_t[]){2, 0, 2, 2});
    kpl_tensor *s0 = f64t(2, (int64_t[]){2, 2}, (double[]){1, 2, 3, 4});
    expect(kpl_scatter_add(z, 0, i0, s0), 2, (int64_t[]){3, 2}, (double[]){0, 2, 0, 0, 4, 4},
           "scatter_add 2-D axis 0");
    expect(kpl_scatter_add(z, -2, i0, s0), 2, (int64_t[]){3, 2}, (double[]){0, 2, 0, 0, 4, 4},
           "scatter_add 2-D axis -2");

    kpl_tensor *x3 = f64t(3, (int64_t[]){2, 2, 3}, X223);
    /* axis 2, idx (2, 1, 2): x3[0][0][2] += 1 + 1, x3[1][0][0] += 5, x3[1][0][1] += 7 */
    kpl_tensor *a2 = i64t(3, (int64_t[]){2, 1, 2}, (int64_t[]){2, 2, 0, 1});
    kpl_tensor *s2 = f64t(3, (int64_t[]){2, 1, 2}, (double[]){1, 1, 5, 7});
    expect(kpl_scatter_add(x3, 2, a2, s2), 3, (int64_t[]){2, 2, 3},
           (double[]){1, 2, 5, 4, 5, 6, 12, 15, 9, 10, 11, 12}, "scatter_add 3-D axis 2");
    /* axis 1 into zeros, idx (2, 3, 1) smaller than x in the last dim:
     * [0][1][0] += 1 + 2, [0][0][0] += 3, [1][0][0] += 4 + 5 + 6 */
    kpl_tensor *z3 = NN(kpl_full(kpl_device_cpu(), KPL_F64, 3, (int64_t[]){2, 2, 3}, 0));
    kpl_tensor *a1 = i64t(3, (int64_t[]){2, 3, 1}, (int64_t[]){1, 1, 0, 0, 0, 0});
    kpl_tensor *s31 = f64t(3, (int64_t[]){2, 3, 1}, (double[]){1, 2, 3, 4, 5, 6});
    expect(kpl_scatter_add(z3, 1, a1, s31), 3, (int64_t[]){2, 2, 3},
           (double[]){3, 0, 0, 3, 0, 0, 15, 0, 0, 0, 0, 0}, "scatter_add 3-D axis 1");
    /* axis 0, idx (2, 2, 3) with every element of a column to row 1 */
    kpl_tensor *a0 = i64t(3, (int64_t[]){2, 2, 3}, (int64_t[]){1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1});
    expect(kpl_scatter_add(z3, 0, a0, x3), 3, (int64_t[]){2, 2, 3},
           (double[]){0, 0, 0, 4, 5, 6, 8, 10, 12, 10, 11, 12}, "scatter_add 3-D axis 0");
    /* f32 */
    kpl_tensor *xf = NN(kpl_cast(x, KPL_F32)), *sf = NN(kpl_cast(s1, KPL_F32));
    expect(kpl_scatter_add(xf, 1, i1, sf), 2, (int64_t[]){2, 3}, (double[]){31, 2, 33, 4, 11, 6},
           "scatter_add f32");
    kpl_pool_pop(p);
}

/* ---- gradients ------------------------------------------------------------------------ */

/* idx (3, 5, 4) in [0, 4) along axis 1 of x (3, 4, 4): repeated rows, so
 * gather's gradient adds several output gradients into one element. */
static kpl_tensor *idx_3x5x4(void)
{
    int64_t v[60];
    for (int i = 0; i < 60; i++) v[i] = (i * 7 + i / 4) % 4;
    return i64t(3, (int64_t[]){3, 5, 4}, v);
}
/* idx (2, 3, 2) in [0, 4) along axis 0 of x (4, 3, 5): smaller than x in
 * the last dim (the general, unmerged geometry). */
static kpl_tensor *idx_2x3x2(void)
{
    return i64t(3, (int64_t[]){2, 3, 2}, (int64_t[]){3, 0, 1, 1, 2, 3, 0, 0, 3, 2, 1, 3});
}
/* idx (3, 6) in [0, 4) along the last axis of x (3, 4), repeated. */
static kpl_tensor *idx_3x6(void)
{
    return i64t(2, (int64_t[]){3, 6},
                (int64_t[]){0, 3, 3, 1, 0, 0, 2, 2, 2, 2, 1, 0, 3, 1, 0, 2, 3, 3});
}

/* Squared, so the output gradient depends on the inputs and each order
 * reaches the next gradient's inputs. */
static kpl_tensor *f_gather_ax1(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_gather(x[0], 1, idx_3x5x4()));
}
static kpl_tensor *f_gather_general(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_mul(kpl_gather(x[0], 0, idx_2x3x2()), kpl_gather(x[0], -3, idx_2x3x2()));
}
static kpl_tensor *f_scatter_last(kpl_tensor *const *x, void *u)
{
    (void)u;
    return kpl_square(kpl_scatter_add(x[0], -1, idx_3x6(), x[1]));
}
static kpl_tensor *f_scatter_ax1(kpl_tensor *const *x, void *u)
{
    (void)u;
    /* src is itself a gather of x[0], so both ops meet in every order */
    kpl_tensor *src = kpl_mul(kpl_gather(x[0], 1, idx_3x5x4()), x[1]);
    return kpl_square(kpl_scatter_add(x[0], 1, idx_3x5x4(), src));
}

static void test_gather_scatter_gradcheck(void **state)
{
    (void)state;
    kpl_tensor *x344 = param(3, (int64_t[]){3, 4, 4}, 31, -1, 1);
    kpl_tensor *x435 = param(3, (int64_t[]){4, 3, 5}, 32, -1, 1);
    kpl_tensor *x34 = param(2, (int64_t[]){3, 4}, 33, -1, 1);
    kpl_tensor *s36 = param(2, (int64_t[]){3, 6}, 34, -1, 1);
    kpl_tensor *s354 = param(3, (int64_t[]){3, 5, 4}, 35, -1, 1);
    kpl_pool *p = NN(kpl_pool_push());
    for (int order = 1; order <= 3; order++) {
        double tol = order == 1 ? 1e-7 : 1e-6;
        if (kpl_gradcheck(f_gather_ax1, NULL, 1, &x344, order, 1e-6, tol, 1e-5) != KPL_OK)
            fail_msg("gather axis 1, order %d: %s", order, kpl_last_error());
        if (kpl_gradcheck(f_gather_general, NULL, 1, &x435, order, 1e-6, tol, 1e-5) != KPL_OK)
            fail_msg("gather axis 0 (general), order %d: %s", order, kpl_last_error());
        kpl_tensor *in2[2] = {x34, s36};
        if (kpl_gradcheck(f_scatter_last, NULL, 2, in2, order, 1e-6, tol, 1e-5) != KPL_OK)
            fail_msg("scatter_add last axis, order %d: %s", order, kpl_last_error());
        kpl_tensor *in3[2] = {x344, s354};
        if (kpl_gradcheck(f_scatter_ax1, NULL, 2, in3, order, 1e-6, tol, 1e-5) != KPL_OK)
            fail_msg("scatter_add of a gather, order %d: %s", order, kpl_last_error());
    }
    kpl_pool_pop(p);
    kpl_tensor *all[] = {x344, x435, x34, s36, s354};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kpl_tensor_release(all[i]);
}

/* By hand: y = sum(gather(x, 1, [[0, 0, 2]])^2) = 2 x0^2 + x2^2, so
 * dy/dx = (4 x0, 0, 2 x2), recorded as a scatter_add, whose sum has the
 * gradient (4, 0, 2), recorded as a gather. */
static void test_gather_double_backward_by_hand(void **state)
{
    (void)state;
    kpl_tensor *x = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 2, (int64_t[]){1, 3},
                            (double[]){1.5, -2, 3}, &x));
    OK(kpl_set_requires_grad(x, true));
    kpl_pool *p = NN(kpl_pool_push());
    kpl_tensor *idx = i64t(2, (int64_t[]){1, 3}, (int64_t[]){0, 0, 2});
    kpl_tensor *y = NN(kpl_sum(kpl_square(kpl_gather(x, 1, idx)), NULL, 0, false));
    assert_float_equal(tget(y, 0), 2 * 2.25 + 9, 0);
    kpl_tensor *g = NULL;
    OK(kpl_grad(y, NULL, 1, &x, true, &g));
    expect(g, 2, (int64_t[]){1, 3}, (double[]){6, 0, 6}, "dy/dx");
    /* recorded: the scatter_add into zeros that made it */
    kpl_node *gn = kpl_tensor_node(g, NULL);
    assert_non_null(gn);
    assert_int_equal(kpl_node_op(gn), KPL_OP_SCATTER_ADD);
    kpl_tensor *g2 = NULL;
    OK(kpl_grad(kpl_sum(g, NULL, 0, false), NULL, 1, &x, false, &g2));
    expect(g2, 2, (int64_t[]){1, 3}, (double[]){4, 0, 2}, "d(sum dy/dx)/dx");
    /* scatter_add: d/dsrc of sum(w * scatter_add(x, 1, idx, src)) is w
     * gathered at idx: (w0, w0, w2) */
    kpl_tensor *src = param(2, (int64_t[]){1, 3}, 7, -1, 1);
    kpl_tensor *w = f64t(2, (int64_t[]){1, 3}, (double[]){10, 20, 30});
    kpl_tensor *l = NN(kpl_sum(kpl_mul(w, kpl_scatter_add(x, 1, idx, src)), NULL, 0, false));
    kpl_tensor *in[2] = {x, src}, *gs[2] = {NULL, NULL};
    OK(kpl_grad(l, NULL, 2, in, false, gs));
    expect(gs[0], 2, (int64_t[]){1, 3}, (double[]){10, 20, 30}, "d/dx scatter_add");
    expect(gs[1], 2, (int64_t[]){1, 3}, (double[]){10, 10, 30}, "d/dsrc scatter_add");
    kpl_pool_pop(p);
    kpl_tensor_release(src);
    kpl_tensor_release(x);
}

/* ---- detach ---------------------------------------------------------------------------- */

static void test_detach_blocks_gradients(void **state)
{
    (void)state;
    kpl_tensor *x = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 1, (int64_t[]){3}, (double[]){1, -2, 0.5},
                            &x));
    OK(kpl_set_requires_grad(x, true));
    kpl_pool *p = NN(kpl_pool_push());
    /* y = sum(x^2 + 3 detach(x)): dy/dx = 2x, the detached term a constant */
    kpl_tensor *d = NN(kpl_detach(x));
    expect(d, 1, (int64_t[]){3}, (double[]){1, -2, 0.5}, "detach values");
    assert_false(kpl_requires_grad(d));
    assert_null(kpl_tensor_node(d, NULL));
    assert_true(kpl_tensor_shares_storage(d, x));
    kpl_tensor *y = NN(kpl_sum(kpl_add(kpl_square(x), kpl_scalar_op(KPL_BIN_MUL, d, 3, false)),
                               NULL, 0, false));
    assert_float_equal(tget(y, 0), 1 + 4 + 0.25 + 3 * (1 - 2 + 0.5), 1e-12);
    OK(kpl_backward(y, NULL, false));
    expect(kpl_grad_get(x), 1, (int64_t[]){3}, (double[]){2, -4, 1}, "dy/dx past detach");
    kpl_zero_grad(1, &x);
    /* a detached intermediate: l = sum(detach(2 x) * x) has dl/dx = 2x, not 4x */
    kpl_tensor *h = NN(kpl_scalar_op(KPL_BIN_MUL, x, 2, false));
    assert_true(kpl_requires_grad(h));
    kpl_tensor *dh = NN(kpl_detach(h));
    assert_false(kpl_requires_grad(dh));
    kpl_tensor *l = NN(kpl_sum(kpl_mul(dh, x), NULL, 0, false));
    OK(kpl_backward(l, NULL, false));
    expect(kpl_grad_get(x), 1, (int64_t[]){3}, (double[]){2, -4, 1}, "dl/dx past detach");
    /* a loss made only of detached values does not require grad at all */
    kpl_tensor *c = NN(kpl_sum(kpl_square(kpl_detach(x)), NULL, 0, false));
    assert_false(kpl_requires_grad(c));
    assert_int_equal(kpl_backward(c, NULL, false), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "does not require grad"));
    kpl_pool_pop(p);
    kpl_tensor_release(x);
}

/* ---- errors -------------------------------------------------------------------------- */

static void test_gather_errors(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    kpl_tensor *x = f64t(3, (int64_t[]){2, 2, 3}, X223);
    /* out of range: the axis, the value, its position in idx and the range */
    kpl_tensor *bad = i64t(3, (int64_t[]){2, 1, 3}, (int64_t[]){1, 0, 1, 0, 2, 1});
    assert_null(kpl_gather(x, 1, bad));
    assert_int_equal(kpl_last_status(), KPL_ERANGE);
    assert_non_null(strstr(kpl_last_error(), "gather: index 2 at position (1,0,1) of idx is "
                                             "outside [0, 2) along axis 1 of x (2,2,3)"));
    kpl_tensor *neg = i64t(3, (int64_t[]){2, 1, 3}, (int64_t[]){1, 0, 1, 0, 0, -1});
    assert_null(kpl_gather(x, -2, neg));
    assert_non_null(strstr(kpl_last_error(), "index -1 at position (1,0,2) of idx is outside "
                                             "[0, 2) along axis 1"));
    kpl_tensor *src = NN(kpl_full(kpl_device_cpu(), KPL_F64, 3, (int64_t[]){2, 1, 3}, 1));
    assert_null(kpl_scatter_add(x, 1, bad, src));
    assert_int_equal(kpl_last_status(), KPL_ERANGE);
    assert_non_null(strstr(kpl_last_error(), "scatter_add: index 2 at position (1,0,1) of idx"));
    /* recording does not hide it: x a parameter, the same message */
    kpl_tensor *w = param(3, (int64_t[]){2, 2, 3}, 9, -1, 1);
    assert_null(kpl_gather(w, 1, bad));
    assert_non_null(strstr(kpl_last_error(), "index 2 at position (1,0,1)"));
    /* wrong index dtype */
    kpl_tensor *fidx = NN(kpl_cast(neg, KPL_F64));
    assert_null(kpl_gather(x, 1, fidx));
    assert_int_equal(kpl_last_status(), KPL_EDTYPE);
    assert_non_null(strstr(kpl_last_error(), "gather: 'idx' has dtype f64, expected i64"));
    assert_null(kpl_scatter_add(x, 1, fidx, src));
    assert_non_null(strstr(kpl_last_error(), "scatter_add: 'idx' has dtype f64, expected i64"));
    /* wrong rank */
    kpl_tensor *flat = i64t(1, (int64_t[]){3}, (int64_t[]){0, 1, 0});
    assert_null(kpl_gather(x, 1, flat));
    assert_int_equal(kpl_last_status(), KPL_ESHAPE);
    assert_non_null(strstr(kpl_last_error(), "gather: idx (3) has 1 dims and x (2,2,3) has 3; "
                                             "they must have the same number"));
    /* larger than x off the axis */
    kpl_tensor *zeros = NN(kpl_full(kpl_device_cpu(), KPL_F64, 3, (int64_t[]){2, 1, 4}, 0));
    kpl_tensor *wide = NN(kpl_cast(zeros, KPL_I64));
    assert_null(kpl_gather(x, 1, wide));
    assert_non_null(strstr(kpl_last_error(), "gather: idx (2,1,4) is larger than x (2,2,3) in dim "
                                             "2 (4 > 3); only along axis 1 may it be larger"));
    /* axis */
    assert_null(kpl_gather(x, 3, neg));
    assert_non_null(strstr(kpl_last_error(), "gather: axis 3 is out of range for x (2,2,3)"));
    assert_null(kpl_scatter_add(x, -4, neg, src));
    assert_non_null(strstr(kpl_last_error(), "scatter_add: axis -4 is out of range for x (2,2,3)"));
    /* src must have idx's shape; the dtype must be a float one */
    kpl_tensor *ok = i64t(3, (int64_t[]){2, 1, 3}, (int64_t[]){1, 0, 1, 0, 1, 1});
    kpl_tensor *src2 = NN(kpl_full(kpl_device_cpu(), KPL_F64, 3, (int64_t[]){2, 2, 3}, 1));
    assert_null(kpl_scatter_add(x, 1, ok, src2));
    assert_non_null(strstr(kpl_last_error(), "scatter_add: 'src' has shape (2,2,3), expected "
                                             "(2,1,3) like 'idx'"));
    kpl_tensor *xi = NN(kpl_cast(x, KPL_I32)), *si = NN(kpl_cast(src, KPL_I32));
    assert_null(kpl_scatter_add(xi, 1, ok, si));
    assert_non_null(strstr(kpl_last_error(), "scatter_add: 'x' has dtype i32; f32 and f64 are supported"));
    /* but gather takes integers */
    expect(kpl_gather(xi, 1, ok), 3, (int64_t[]){2, 1, 3}, (double[]){4, 2, 6, 7, 11, 12},
           "gather i32");
    /* a NULL input passes through with the first failure's message */
    assert_null(kpl_gather(kpl_gather(x, 1, bad), 0, ok));
    assert_non_null(strstr(kpl_last_error(), "index 2 at position (1,0,1)"));
    assert_null(kpl_scatter_add(x, 1, ok, kpl_gather(x, 1, bad)));
    assert_non_null(strstr(kpl_last_error(), "index 2 at position (1,0,1)"));
    assert_null(kpl_detach(kpl_gather(x, 1, bad)));
    assert_int_equal(kpl_last_status(), KPL_ERANGE);
    assert_non_null(strstr(kpl_last_error(), "index 2 at position (1,0,1)"));
    kpl_pool_pop(p);
    kpl_tensor_release(w);
}

int run_gather_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gather_values),
        cmocka_unit_test(test_scatter_add_values),
        cmocka_unit_test(test_gather_scatter_gradcheck),
        cmocka_unit_test(test_gather_double_backward_by_hand),
        cmocka_unit_test(test_detach_blocks_gradients),
        cmocka_unit_test(test_gather_errors),
    };
    return cmocka_run_group_tests_name("gather", tests, NULL, NULL);
}
