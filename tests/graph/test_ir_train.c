/* test_ir_train.c — whole SGD training steps traced into the static
 * graph: the executor's steps against eager ones bit for bit, traced cross
 * entropy, and what a graph with updates is refused as.  A second group of
 * the test_ir executable. */
#include "ir_net.h"

int run_train_tests(void);

/* One SGD step (momentum 0.9, weight decay 1e-4) on the net in training
 * mode, written with the write ops as an optimizer is: forward, loss,
 * backward, update.  Returns the loss (pool-owned). */
static kpl_tensor *train_step(net *n, kpl_tensor **mom, kpl_tensor *x, kpl_tensor *labels)
{
    kpl_tensor *loss = NN(kpl_nll_loss(net_forward_mode(n, x, true), labels, KPL_REDUCE_MEAN, 3));
    OK(kpl_backward(loss, NULL, false));
    bool prev = kpl_set_grad_enabled(false);
    int k = 0;
    for (kpl_tensor **p = &n->w1; p <= &n->fb; p++, k++) {
        kpl_tensor *g = kpl_grad_get(*p);
        if (!g) continue; /* the running statistics */
        kpl_tensor *t = NN(kpl_empty(kpl_device_cpu(), KPL_F32, kpl_tensor_ndim(*p),
                                     kpl_tensor_shape(*p)));
        OK(kpl_write_scalar(t, KPL_BIN_MUL, *p, 1e-4, false));
        OK(kpl_write_binary(t, KPL_BIN_ADD, t, g));
        OK(kpl_write_scalar(mom[k], KPL_BIN_MUL, mom[k], 0.9, false));
        OK(kpl_write_binary(mom[k], KPL_BIN_ADD, mom[k], t));
        OK(kpl_write_scalar(t, KPL_BIN_MUL, mom[k], 0.05, false));
        OK(kpl_write_binary(*p, KPL_BIN_SUB, *p, t));
    }
    kpl_set_grad_enabled(prev);
    kpl_zero_grad(13, &n->w1);
    return loss;
}

static void moms_init(const net *n, kpl_tensor **mom)
{
    int k = 0;
    for (kpl_tensor *const *p = &n->w1; p <= &n->fb; p++, k++) {
        OK(kpl_tensor_empty_like(*p, &mom[k]));
        OK(kpl_k_fill(mom[k], 0));
    }
}

static void assert_same_bits(kpl_tensor *a, kpl_tensor *b, const char *what, int step)
{
    assert_int_equal(kpl_tensor_nbytes(a), kpl_tensor_nbytes(b));
    const void *pa = kpl_tensor_host_data(a), *pb = kpl_tensor_host_data(b);
    if (memcmp(pa, pb, kpl_tensor_nbytes(a)))
        fail_msg("%s after step %d: traced and eager differ (max %g)", what, step,
                 max_abs_diff(a, b));
}

/* A whole training step traced once, then run by the executor for the
 * next 19 batches, equals 20 eager steps bit for bit (losses, weights,
 * momenta, running statistics) at every level; the graph writes 9
 * parameters, 9 momenta and 4 running statistics back. */
static void test_train_step(void **state)
{
    (void)state;
    enum { STEPS = 20, B = 6 };
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *xs[STEPS], *ls[STEPS];
    for (int s = 0; s < STEPS; s++) {
        xs[s] = kpl_autorelease(owned_randn(4, (int64_t[]){B, 3, 8, 8}, 100 + (uint64_t)s, 1));
        int64_t lab[B];
        for (int i = 0; i < B; i++) lab[i] = (s * 7 + i * 3) % 5;
        OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, (int64_t[]){B}, lab, &ls[s]));
        kpl_autorelease(ls[s]);
    }
    /* the label 3 is ignore_index: the mean is over the others */
    net ref;
    net_init(&ref);
    kpl_tensor *mref[13];
    moms_init(&ref, mref);
    double want[STEPS];
    for (int s = 0; s < STEPS; s++) {
        kpl_pool *p = kpl_pool_push();
        want[s] = tget(train_step(&ref, mref, xs[s], ls[s]), 0);
        kpl_pool_pop(p);
    }
    for (int level = 0; level <= 3; level++) {
        net n;
        net_init(&n);
        kpl_tensor *mom[13];
        moms_init(&n, mom);
        OK(kpl_trace_begin());
        kpl_tensor *x = NN(kpl_trace_input(xs[0], "image"));
        kpl_tensor *l = NN(kpl_trace_input(ls[0], "label"));
        kpl_tensor *loss = train_step(&n, mom, x, l);
        kpl_ir *ir = NULL;
        OK(kpl_trace_end(1, &loss, (const char *[]){"loss"}, &ir));
        assert_int_equal(kpl_ir_num_updates(ir), 9 + 9 + 4);
        assert_true(tget(loss, 0) == want[0]);
        OK(kpl_ir_optimize(ir, level, false));
        FAILS(kpl_ir_optimize(ir, level, true), KPL_EINVAL, "a training step");
        kpl_exec *ex = NULL;
        OK(kpl_exec_create(ir, &ex));
        kpl_exec_stats es = kpl_exec_get_stats(ex);
        if (level >= 2) assert_true(es.n_inplace > 9); /* the updates at least */
        for (int s = 1; s < STEPS; s++) {
            OK(kpl_exec_set_input(ex, 0, xs[s]));
            OK(kpl_exec_set_input(ex, 1, ls[s]));
            OK(kpl_exec_run(ex));
            double got = tget(kpl_exec_output(ex, 0), 0);
            if (got != want[s])
                fail_msg("O%d: step %d loss %.9g, eager %.9g", level, s, got, want[s]);
        }
        for (int k = 0; k < 13; k++) {
            assert_same_bits((&n.w1)[k], (&ref.w1)[k], "a parameter", STEPS);
            assert_same_bits(mom[k], mref[k], "a momentum", STEPS);
        }
        kpl_exec_destroy(ex);
        kpl_ir_destroy(ir);
        for (int k = 0; k < 13; k++) kpl_tensor_release(mom[k]);
        net_free(&n);
    }
    for (int k = 0; k < 13; k++) kpl_tensor_release(mref[k]);
    net_free(&ref);
    kpl_pool_pop(pool);
}

/* Cross entropy traced computes its targets in ops: with class weights
 * and every label ignored the graph's loss is 0, as eager mode's (not
 * 0 / 0); with some counted, eager's value. */
static void test_traced_cross_entropy(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *logits = kpl_autorelease(owned_randn(2, (int64_t[]){4, 3}, 61, 1));
    kpl_tensor *w = kpl_autorelease(owned_randn(1, (int64_t[]){3}, 62, 1));
    OK(kpl_k_unary(w, KPL_UN_ABS, w, 0, 0));
    kpl_tensor *none = NULL, *some = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, (int64_t[]){4}, (int64_t[]){-1, -1, -1, -1}, &none));
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, (int64_t[]){4}, (int64_t[]){2, -1, 0, 1}, &some));
    kpl_autorelease(none);
    kpl_autorelease(some);
    for (int weighted = 0; weighted < 2; weighted++) {
        OK(kpl_trace_begin());
        kpl_tensor *x = NN(kpl_trace_input(logits, "logits"));
        kpl_tensor *l = NN(kpl_trace_input(none, "labels"));
        kpl_tensor *loss = NN(kpl_cross_entropy_weighted(x, l, weighted ? w : NULL, KPL_REDUCE_MEAN, 0.1, -1));
        kpl_ir *ir = NULL;
        OK(kpl_trace_end(1, &loss, NULL, &ir));
        assert_true(tget(loss, 0) == 0);
        kpl_exec *ex = NULL;
        OK(kpl_exec_create(ir, &ex));
        OK(kpl_exec_set_input(ex, 0, logits));
        OK(kpl_exec_set_input(ex, 1, none));
        OK(kpl_exec_run(ex));
        assert_true(tget(kpl_exec_output(ex, 0), 0) == 0);
        OK(kpl_exec_set_input(ex, 1, some));
        OK(kpl_exec_run(ex));
        double want = tget(NN(kpl_cross_entropy_weighted(logits, some, weighted ? w : NULL,
                                                         KPL_REDUCE_MEAN, 0.1, -1)), 0);
        if (tget(kpl_exec_output(ex, 0), 0) != want)
            fail_msg("weighted %d: graph %.9g, eager %.9g", weighted, tget(kpl_exec_output(ex, 0), 0), want);
        kpl_exec_destroy(ex);
        kpl_ir_destroy(ir);
    }
    kpl_pool_pop(pool);
}

/* A graph with updates is not an inference model: neither file format
 * takes it (trainer/), and the dump lists the updates. */
static void test_train_step_dump(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    net n;
    net_init(&n);
    kpl_tensor *mom[13];
    moms_init(&n, mom);
    kpl_tensor *x0 = kpl_autorelease(owned_randn(4, (int64_t[]){4, 3, 8, 8}, 7, 1));
    kpl_tensor *l0 = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, (int64_t[]){4}, (int64_t[]){0, 1, 2, 4},
                            &l0));
    kpl_autorelease(l0);
    OK(kpl_trace_begin());
    kpl_tensor *xin = NN(kpl_trace_input(x0, "image"));
    kpl_tensor *lin = NN(kpl_trace_input(l0, "label"));
    kpl_tensor *loss = train_step(&n, mom, xin, lin);
    kpl_ir *ir = NULL;
    OK(kpl_trace_end(1, &loss, NULL, &ir));
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    OK(kpl_ir_dump(ir, f, false));
    fclose(f);
    assert_non_null(strstr(buf, "22 updates"));
    assert_non_null(strstr(buf, "batch_norm_bwd("));
    assert_non_null(strstr(buf, "binary(") ); /* relu_bwd */
    assert_non_null(strstr(buf, "update %"));
    free(buf);
    /* a label out of range is the graph's error when it runs, naming the node */
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    ((int64_t *)kpl_tensor_host_mutable(l0))[2] = 9;
    OK(kpl_exec_set_input(ex, 1, l0));
    FAILS(kpl_exec_run(ex), KPL_ERANGE, "gather");
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    for (int k = 0; k < 13; k++) kpl_tensor_release(mom[k]);
    net_free(&n);
    kpl_pool_pop(pool);
}

int run_train_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_train_step),
        cmocka_unit_test(test_train_step_dump),
        cmocka_unit_test(test_traced_cross_entropy),
    };
    return cmocka_run_group_tests_name("training steps", tests, NULL, NULL);
}
