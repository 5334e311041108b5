/* test_graph.c — eager ops, autorelease pools, grad mode and the recorded
 * nodes of the dynamic graph. */
#include "kpl_test.h"
#include "graph.h"

/* A parameter outside any pool (the caller releases it). */
static kpl_tensor *param(int ndim, const int64_t *shape, const float *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, ndim, shape, v, &t));
    OK(kpl_set_requires_grad(t, true));
    return t;
}

static void test_pool_and_values(void **state)
{
    (void)state;
    kpl_device *cpu = kpl_device_cpu();
    kpl_device_empty_cache(cpu);
    size_t before = kpl_device_memory_stats(cpu).allocated;
    kpl_pool *pool = NN(kpl_pool_push());
    int64_t s23[2] = {2, 3}, s3 = 3;
    float xv[6] = {1, 2, 3, 4, 5, 6}, bv[3] = {10, 20, 30};
    kpl_tensor *x = NULL, *b = NULL;
    OK(kpl_tensor_from_data(cpu, KPL_F32, 2, s23, xv, &x));
    OK(kpl_tensor_from_data(cpu, KPL_F32, 1, &s3, bv, &b));
    kpl_autorelease(x);
    kpl_autorelease(b);
    /* y = sum(relu(x + b) * 2, axis 1) = [2*(11+22+33), 2*(14+25+36)] */
    int ax = 1;
    kpl_tensor *y = NN(kpl_sum(kpl_scalar_op(KPL_BIN_MUL, kpl_relu(kpl_add(x, b)), 2, false),
                               &ax, 1, false));
    assert_int_equal(kpl_tensor_ndim(y), 1);
    assert_float_equal(tget(y, 0), 132, 0);
    assert_float_equal(tget(y, 1), 150, 0);
    /* matmul and views */
    int64_t s32[2] = {3, 2};
    kpl_tensor *xt = NN(kpl_reshape(x, 2, s32));
    kpl_tensor *m = NN(kpl_matmul(x, xt, false, false)); /* (2,3)@(3,2) */
    assert_float_equal(tget(m, 0), 1 * 1 + 2 * 3 + 3 * 5, 0);
    int perm[2] = {1, 0};
    kpl_tensor *p = NN(kpl_permute(x, perm));
    assert_float_equal(tget(p, 1), 4, 0);
    int64_t s223[3] = {2, 2, 3};
    kpl_tensor *e = NN(kpl_expand(b, 3, s223));
    assert_float_equal(tget(e, 11), 30, 0);
    kpl_tensor *cmp = NN(kpl_compare(KPL_BIN_GT, x, kpl_full(cpu, KPL_F32, 0, NULL, 3.5)));
    assert_int_equal(kpl_tensor_dtype(cmp), KPL_BOOL);
    assert_float_equal(tget(cmp, 3), 1, 0);
    kpl_tensor *w = NN(kpl_where(cmp, x, kpl_neg(x)));
    assert_float_equal(tget(w, 0), -1, 0);
    assert_float_equal(tget(w, 5), 6, 0);
    assert_int_equal(kpl_pool_count(pool), 14); /* every result, plus x and b */
    kpl_tensor *ar = NN(kpl_arange(cpu, KPL_I64, 5, 10, -2));
    assert_float_equal(tget(ar, 4), 2, 0);
    kpl_tensor *cp = NN(kpl_to_device(x, cpu));
    assert_false(kpl_tensor_shares_storage(cp, x));
    assert_float_equal(tget(cp, 5), 6, 0);
    /* nothing recorded: no input requires grad */
    assert_null(kpl_tensor_node(y, NULL));
    kpl_pool_pop(pool);
    /* every temporary is gone */
    assert_int_equal(kpl_device_memory_stats(cpu).allocated, before);
}

static void test_errors(void **state)
{
    (void)state;
    int64_t s2 = 2, s3 = 3;
    /* No pool: the result is dropped with a clear message. */
    kpl_tensor *t = kpl_full(kpl_device_cpu(), KPL_F32, 1, &s2, 1);
    assert_null(t);
    assert_non_null(strstr(kpl_last_error(), "no pool is open"));
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *a = NN(kpl_full(kpl_device_cpu(), KPL_F32, 1, &s2, 1));
    kpl_tensor *b = NN(kpl_full(kpl_device_cpu(), KPL_F32, 1, &s3, 1));
    /* The first failure of a chain is the one reported. */
    kpl_tensor *r = kpl_exp(kpl_mul(kpl_add(a, b), a));
    assert_null(r);
    assert_non_null(strstr(kpl_last_error(), "add: shapes (2) and (3) cannot be broadcast"));
    int64_t s5 = 5;
    assert_null(kpl_expand(a, 1, &s5));
    assert_non_null(strstr(kpl_last_error(), "expand: shapes (2) and (5) cannot be broadcast"));
    int64_t s31[2] = {3, 1};
    assert_null(kpl_expand(a, 2, s31));
    assert_non_null(strstr(kpl_last_error(), "expand: (2) cannot be broadcast to (3,1)"));
    kpl_tensor *i = NN(kpl_cast(a, KPL_I32));
    assert_int_equal(kpl_set_requires_grad(i, true), KPL_EDTYPE);
    assert_non_null(strstr(kpl_last_error(), "float dtypes only"));
    kpl_pool_pop(pool);
}

static void test_recording(void **state)
{
    (void)state;
    int64_t s23[2] = {2, 3}, s3 = 3;
    float xv[6] = {1, -2, 3, -4, 5, -6}, wv[3] = {0.5f, 1, 2};
    kpl_tensor *w = param(1, &s3, wv);
    /* op_table.h: mul's gradient needs both inputs, exp's its output */
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = NN(kpl_full(kpl_device_cpu(), KPL_F32, 2, s23, 0));
    memcpy(kpl_tensor_host_mutable(x), xv, sizeof xv);
    kpl_tensor *h = NN(kpl_mul(x, w));   /* x: constant, w: parameter */
    kpl_tensor *e = NN(kpl_exp(h));
    kpl_tensor *l = NN(kpl_sum(e, NULL, 0, false));
    assert_true(kpl_requires_grad(h) && kpl_requires_grad(e) && kpl_requires_grad(l));
    assert_false(kpl_requires_grad(x));
    int oi = -1;
    kpl_node *nl = kpl_tensor_node(l, &oi);
    assert_non_null(nl);
    assert_int_equal(kpl_node_op(nl), KPL_OP_SUM);
    assert_int_equal(oi, 0);
    kpl_node *ne = kpl_node_input_node(nl, 0, NULL);
    assert_ptr_equal(ne, kpl_tensor_node(e, NULL));
    assert_int_equal(kpl_node_op(ne), KPL_OP_EXP);
    assert_non_null(kpl_node_saved_output(ne));
    assert_true(kpl_tensor_shares_storage(kpl_node_saved_output(ne), e));
    assert_null(kpl_node_saved_input(ne, 0));
    kpl_node *nh = kpl_node_input_node(ne, 0, NULL);
    assert_int_equal(kpl_node_op(nh), KPL_OP_MUL);
    assert_int_equal(kpl_node_num_inputs(nh), 2);
    assert_false(kpl_node_input_requires_grad(nh, 0));
    assert_null(kpl_node_input_node(nh, 0, NULL));
    assert_null(kpl_node_input_leaf(nh, 0));
    assert_ptr_equal(kpl_node_input_leaf(nh, 1), w);
    assert_non_null(kpl_node_saved_input(nh, 0));
    int64_t shp[KPL_MAX_DIMS];
    assert_int_equal(kpl_node_input_shape(nh, 1, shp), 1);
    assert_int_equal(shp[0], 3);
    assert_int_equal(kpl_node_output_shape(nh, shp), 2);
    /* the GC hook frees what a node saved */
    kpl_node_free_saved(nh);
    assert_true(kpl_node_saved_freed(nh));
    assert_null(kpl_node_saved_input(nh, 0));
    /* no-grad records nothing */
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor *q = NN(kpl_mul(x, w));
    assert_null(kpl_tensor_node(q, NULL));
    assert_false(kpl_requires_grad(q));
    kpl_set_grad_enabled(prev);
    assert_true(kpl_grad_enabled());
    /* results are not leaves */
    assert_int_equal(kpl_set_requires_grad(h, true), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "result of 'mul'"));
    /* the parameter is kept alive by the graph, then let go */
    assert_true(kpl_tensor_refcount(w) >= 2);
    kpl_pool_pop(pool);
    assert_int_equal(kpl_tensor_refcount(w), 1);
    kpl_tensor_release(w);
}

static void test_detach(void **state)
{
    (void)state;
    int64_t s23[2] = {2, 3};
    float wv[6] = {1, -2, 3, -4, 5, -6};
    kpl_tensor *w = param(2, s23, wv);
    kpl_pool *pool = NN(kpl_pool_push());
    /* a parameter: the same values and storage, no grad, no node */
    kpl_tensor *d = NN(kpl_detach(w));
    assert_int_equal(kpl_tensor_ndim(d), 2);
    assert_int_equal(kpl_tensor_shape(d)[0], 2);
    assert_int_equal(kpl_tensor_shape(d)[1], 3);
    assert_int_equal(kpl_tensor_dtype(d), KPL_F32);
    for (int i = 0; i < 6; i++) assert_float_equal(tget(d, i), wv[i], 0);
    assert_true(kpl_tensor_shares_storage(d, w));
    assert_false(kpl_requires_grad(d));
    assert_null(kpl_tensor_node(d, NULL));
    assert_true(kpl_requires_grad(w)); /* x itself is untouched */
    /* a recorded result: its node stays with it, not with the copy */
    kpl_tensor *e = NN(kpl_exp(w));
    kpl_tensor *de = NN(kpl_detach(e));
    assert_non_null(kpl_tensor_node(e, NULL));
    assert_null(kpl_tensor_node(de, NULL));
    assert_false(kpl_requires_grad(de));
    assert_float_equal(tget(de, 2), expf(3), 1e-5);
    /* ops on it record nothing: no input requires grad */
    kpl_tensor *q = NN(kpl_mul(de, d));
    assert_null(kpl_tensor_node(q, NULL));
    assert_false(kpl_requires_grad(q));
    /* it may become a parameter of its own (a leaf), unlike e */
    assert_int_equal(kpl_set_requires_grad(de, true), KPL_OK);
    assert_int_equal(kpl_set_requires_grad(e, true), KPL_EINVAL);
    /* shared storage: a write through w shows in d (as torch's detach) */
    ((float *)kpl_tensor_host_mutable(w))[0] = 42;
    assert_float_equal(tget(d, 0), 42, 0);
    /* pool-owned: one more entry */
    size_t n = kpl_pool_count(pool);
    NN(kpl_detach(w));
    assert_int_equal(kpl_pool_count(pool), n + 1);
    /* NULL in, NULL out, the first failure's message kept */
    int64_t s2 = 2;
    kpl_tensor *a = NN(kpl_full(kpl_device_cpu(), KPL_F32, 1, &s2, 1));
    assert_null(kpl_detach(kpl_add(a, w)));
    assert_int_equal(kpl_last_status(), KPL_ESHAPE);
    assert_non_null(strstr(kpl_last_error(), "add: shapes (2) and (2,3) cannot be broadcast"));
    kpl_pool_pop(pool);
    /* with no pool open the view is dropped with the usual message */
    assert_null(kpl_detach(w));
    assert_non_null(strstr(kpl_last_error(), "no pool is open"));
    assert_int_equal(kpl_tensor_refcount(w), 1);
    kpl_tensor_release(w);
}

static void test_long_chain_release(void **state)
{
    (void)state;
    /* 100k recorded nodes in one chain are released without recursion. */
    int64_t s1 = 1;
    float one = 1;
    kpl_tensor *w = param(1, &s1, &one);
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *y = w;
    for (int i = 0; i < 100000; i++) {
        kpl_pool *inner = NN(kpl_pool_push());
        kpl_tensor *z = NN(kpl_scalar_op(KPL_BIN_ADD, y, 1, false));
        kpl_tensor_retain(z);
        kpl_pool_pop(inner);
        if (y != w) kpl_tensor_release(y);
        y = z;
    }
    assert_float_equal(tget(y, 0), 100001, 0);
    kpl_tensor_release(y);
    kpl_pool_pop(pool);
    assert_int_equal(kpl_tensor_refcount(w), 1);
    kpl_tensor_release(w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_and_values),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_recording),
        cmocka_unit_test(test_detach),
        cmocka_unit_test(test_long_chain_release),
    };
    return cmocka_run_group_tests_name("graph", tests, NULL, NULL);
}
