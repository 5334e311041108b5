/* test_custom.c — kpl_custom, a caller-defined op: a "y = 3 x" whose
 * backward is "3 gy" against finite differences and against the same
 * expression built from kpl's own ops, the user pointer, nothing recorded
 * without grad, and the errors of a failing or ill-shaped backward. */
#include "ag_test.h"

int run_custom_tests(void);

typedef struct {
    int calls;       /* backward runs */
    bool fail;       /* return NULL with an error */
    bool bad_shape;  /* return a gradient of the wrong shape */
} times3_state;

static kpl_tensor *times3_bwd(kpl_tensor *gy, void *user)
{
    times3_state *s = user;
    if (s) {
        s->calls++;
        if (s->fail) {
            kpl_set_error(KPL_ETIMEOUT, "allreduce of the batch statistics timed out");
            return NULL;
        }
        if (s->bad_shape) return kpl_sum(gy, NULL, 0, false);
    }
    return kpl_scalar_op(KPL_BIN_MUL, gy, 3, false);
}

static const kpl_custom_fn times3 = {"times3", times3_bwd};

/* 3 x computed outside the graph, recorded as times3(x). */
static kpl_tensor *custom3(kpl_tensor *x, times3_state *s)
{
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor *y = kpl_scalar_op(KPL_BIN_MUL, x, 3, false);
    kpl_set_grad_enabled(prev);
    return kpl_custom(x, y, &times3, s);
}

/* sum(tanh(c(x^2)) * x) with c = times3 or kpl's own multiply. */
static kpl_tensor *expr(kpl_tensor *x, bool use_custom)
{
    kpl_tensor *x2 = kpl_square(x);
    kpl_tensor *c = use_custom ? custom3(x2, NULL) : kpl_scalar_op(KPL_BIN_MUL, x2, 3, false);
    return kpl_sum(kpl_mul(kpl_tanh(c), x), NULL, 0, false);
}

static kpl_tensor *g_plain(kpl_tensor *const *x, void *u) { return custom3(x[0], u); }
static kpl_tensor *g_expr(kpl_tensor *const *x, void *u) { (void)u; return expr(x[0], true); }

static void test_custom_gradcheck(void **state)
{
    (void)state;
    int64_t s[2] = {3, 4};
    kpl_tensor *x = param(2, s, 11, -1, 1);
    times3_state st = {0};
    OK(kpl_gradcheck(g_plain, &st, 1, &x, 1, 1e-6, 1e-7, 1e-6));
    assert_true(st.calls > 0);
    OK(kpl_gradcheck(g_expr, NULL, 1, &x, 1, 1e-6, 1e-7, 1e-6));
    OK(kpl_gradcheck(g_expr, NULL, 1, &x, 2, 1e-6, 1e-6, 1e-5));
    kpl_tensor_release(x);
}

/* The same gradients, first and second order, as with kpl's multiply. */
static void test_custom_matches_builtin(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s[2] = {3, 4};
    kpl_tensor *x = param(2, s, 12, -1, 1);
    kpl_tensor *g[2], *gg[2];
    for (int k = 0; k < 2; k++) {
        kpl_tensor *y = NN(expr(x, k == 0));
        OK(kpl_grad(y, NULL, 1, &x, true, &g[k]));
        kpl_tensor *gs = NN(kpl_sum(kpl_square(g[k]), NULL, 0, false));
        OK(kpl_grad(gs, NULL, 1, &x, false, &gg[k]));
    }
    for (int64_t i = 0; i < 12; i++) {
        assert_close(tget(g[0], i), tget(g[1], i), 1e-14, 1e-14, "grad", i);
        assert_close(tget(gg[0], i), tget(gg[1], i), 1e-13, 1e-13, "second order", i);
    }
    /* .grad accumulates through kpl_backward as for any op */
    kpl_tensor *y = NN(kpl_sum(custom3(x, NULL), NULL, 0, false));
    OK(kpl_backward(y, NULL, false));
    for (int64_t i = 0; i < 12; i++) assert_float_equal(tget(kpl_grad_get(x), i), 3, 0);
    kpl_tensor_release(x);
    kpl_pool_pop(p);
}

static void test_custom_not_recorded(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s[2] = {2, 2};
    kpl_tensor *x = param(2, s, 13, -1, 1);
    kpl_tensor *y = NN(kpl_full(kpl_device_cpu(), KPL_F64, 2, s, 5));
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor *r = NN(kpl_custom(x, y, &times3, NULL));
    kpl_set_grad_enabled(prev);
    assert_null(kpl_tensor_node(r, NULL));
    assert_false(kpl_requires_grad(r));
    assert_true(kpl_tensor_shares_storage(r, y));
    /* recorded: the node is the custom op, y itself is left as it was */
    r = NN(kpl_custom(x, y, &times3, NULL));
    assert_int_equal(kpl_node_op(kpl_tensor_node(r, NULL)), KPL_OP_CUSTOM);
    assert_string_equal(kpl_op_name(KPL_OP_CUSTOM), "custom");
    assert_false(kpl_requires_grad(y));
    assert_null(kpl_custom(x, y, NULL, NULL));
    assert_int_equal(kpl_last_status(), KPL_EINVAL);
    kpl_custom_fn nob = {"nob", NULL};
    assert_null(kpl_custom(x, y, &nob, NULL));
    assert_non_null(strstr(kpl_last_error(), "custom: fn->backward is NULL"));
    kpl_tensor_release(x);
    kpl_pool_pop(p);
}

static void test_custom_backward_errors(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    int64_t s[2] = {3, 4};
    kpl_tensor *x = param(2, s, 14, -1, 1);
    times3_state st = {.fail = true};
    kpl_tensor *y = NN(kpl_sum(kpl_tanh(custom3(x, &st)), NULL, 0, false));
    assert_int_equal(kpl_backward(y, NULL, false), KPL_ETIMEOUT);
    assert_int_equal(st.calls, 1);
    assert_non_null(strstr(kpl_last_error(), "backward of custom op 'times3': "));
    assert_non_null(strstr(kpl_last_error(), "allreduce of the batch statistics timed out"));
    assert_null(kpl_grad_get(x));
    st = (times3_state){.bad_shape = true};
    y = NN(kpl_sum(custom3(x, &st), NULL, 0, false));
    assert_int_equal(kpl_backward(y, NULL, false), KPL_ESHAPE);
    assert_non_null(strstr(kpl_last_error(), "backward of custom op 'times3' returned () f64 for "
                                             "an input (3,4) f64"));
    kpl_tensor_release(x);
    kpl_pool_pop(p);
}

int run_custom_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_custom_gradcheck),
        cmocka_unit_test(test_custom_matches_builtin),
        cmocka_unit_test(test_custom_not_recorded),
        cmocka_unit_test(test_custom_backward_errors),
    };
    return cmocka_run_group_tests_name("custom", tests, NULL, NULL);
}
