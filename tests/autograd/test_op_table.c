/* test_op_table.c — graph/op_table.h, the one record per op: every row has
 * every column (a row missing one does not compile; here each value is
 * checked to be one the readers know, or their explicit none), the
 * readers agree with it (autograd's gradients, the names of the kernels it
 * runs, the executor), and each op that a graph runs through a generic
 * kernel computes there what the kernel computes eagerly. */
#include "ag_test.h"

#include "ir.h"

int run_op_table_tests(void);

static bool kind_has_kernel(kpl_op_run_kind k)
{
    return k == KPL_OP_RUN_UN || k == KPL_OP_RUN_UNA || k == KPL_OP_RUN_BIN ||
           k == KPL_OP_RUN_BINS || k == KPL_OP_RUN_RED;
}

static void test_every_row_complete(void **state)
{
    (void)state;
    for (int k = 0; k < KPL_OP_COUNT; k++) {
        const kpl_op_info *r = kpl_op_info_of((kpl_op)k);
        assert_non_null(r);
        assert_non_null(r->name);
        assert_true(r->name[0] != 0);
        assert_string_equal(kpl_op_name((kpl_op)k), r->name);
        assert_int_equal(kpl_op_from_name(r->name), k); /* unique */
        /* arity: a graph node holds at most KPL_IR_MAX_*; a recorded
         * (differentiable) node at most 3 inputs */
        assert_true(r->in_min >= 1 && r->in_min <= r->in_max);
        assert_true(r->in_max <= KPL_IR_MAX_INPUTS);
        assert_true(r->out_min >= 1 && r->out_min <= r->out_max);
        assert_true(r->out_max <= KPL_IR_MAX_OUTPUTS);
        if (r->differentiable) assert_true(r->in_max <= 3);
        assert_true(r->attrs >= KPL_ATTRS_NONE && r->attrs < KPL_ATTRS_COUNT);
        assert_true(r->autocast >= KPL_AUTOCAST_KEEP && r->autocast <= KPL_AUTOCAST_MIXED);
        /* saved: only inputs it has, only output 0, nothing without a gradient */
        assert_true(r->saved_in < (1u << r->in_max));
        assert_true(r->saved_out <= 1);
        if (!r->differentiable) assert_true(r->saved_in == 0 && r->saved_out == 0);
        /* run: a kernel id exactly for the generic kinds, a function name
         * exactly for EW and FN, no shape inference exactly when none */
        assert_true(r->run >= KPL_OP_RUN_NONE && r->run <= KPL_OP_RUN_VIEW);
        assert_int_equal(r->kernel >= 0, kind_has_kernel(r->run));
        assert_int_equal(r->run_fn != NULL, r->run == KPL_OP_RUN_EW || r->run == KPL_OP_RUN_FN);
        assert_non_null(r->infer);
        assert_int_equal(!strcmp(r->infer, "none"), r->run == KPL_OP_RUN_NONE);
        /* the gradient: autograd's table is built from the same column */
        assert_int_equal(kpl_op_has_grad((kpl_op)k), r->differentiable);
        /* onnx: a type (capitalised), an emitter (lower case) or none;
         * nothing a graph cannot hold leaves as ONNX */
        switch (r->onnx) {
        case KPL_ONNX_DIRECT:
            assert_true(r->onnx_name && r->onnx_name[0] >= 'A' && r->onnx_name[0] <= 'Z');
            break;
        case KPL_ONNX_CODED:
            assert_true(r->onnx_name && r->onnx_name[0] >= 'a' && r->onnx_name[0] <= 'z');
            break;
        case KPL_ONNX_NONE: assert_null(r->onnx_name); break;
        default: fail_msg("%s: onnx kind %d", r->name, (int)r->onnx);
        }
        if (r->onnx != KPL_ONNX_NONE) assert_int_not_equal(r->run, KPL_OP_RUN_NONE);
    }
    assert_null(kpl_op_info_of(KPL_OP_COUNT));
    assert_string_equal(kpl_op_name(KPL_OP_COUNT), "invalid-op");
    assert_int_equal(kpl_op_from_name("no_such_op"), KPL_OP_COUNT);
    assert_int_equal(kpl_op_from_name(NULL), KPL_OP_COUNT);
}

/* The kernel a row names is the op of the same name: unary ops share
 * their kernel's name, scalar ops are "<binary>_scalar", reductions the
 * reduction's. */
static void test_kernels_match_names(void **state)
{
    (void)state;
    int seen = 0;
    for (int k = 0; k < KPL_OP_COUNT; k++) {
        const kpl_op_info *r = kpl_op_info_of((kpl_op)k);
        char want[64];
        switch (r->run) {
        case KPL_OP_RUN_UN:
        case KPL_OP_RUN_UNA:
            assert_true(r->kernel < KPL_UNARY_COUNT);
            assert_string_equal(kpl_unary_name((kpl_unary_op)r->kernel), r->name);
            break;
        case KPL_OP_RUN_BIN:
            assert_true(r->kernel < KPL_BINARY_COUNT);
            assert_string_equal(kpl_binary_name((kpl_binary_op)r->kernel), r->name);
            break;
        case KPL_OP_RUN_BINS:
            assert_true(r->kernel < KPL_BINARY_COUNT);
            snprintf(want, sizeof want, "%s_scalar", kpl_binary_name((kpl_binary_op)r->kernel));
            assert_string_equal(want, r->name);
            break;
        case KPL_OP_RUN_RED:
            assert_true(r->kernel < KPL_REDUCE_COUNT);
            assert_string_equal(kpl_reduce_name((kpl_reduce_op)r->kernel), r->name);
            break;
        default: continue;
        }
        seen++;
    }
    assert_true(seen >= 40);
}

/* Fills t (f64) with values in [lo, hi] from a fixed sequence. */
static void fill(kpl_tensor *t, double lo, double hi, unsigned seed)
{
    double *p = kpl_tensor_host_mutable(t);
    int64_t n = kpl_tensor_numel(t);
    unsigned s = seed * 2654435761u + 1;
    for (int64_t i = 0; i < n; i++) {
        s = s * 1103515245u + 12345u;
        p[i] = lo + (hi - lo) * ((s >> 8) & 0xffff) / 65535.0;
    }
}

/* Each op a graph runs through a generic kernel (unary, binary, scalar,
 * reduction): a one-node graph built from the row (arity, shape inference,
 * run) gives the kernel's own eager result, bit for bit. */
static void test_generic_ops_run_in_a_graph(void **state)
{
    (void)state;
    const int64_t shape[2] = {3, 4};
    int ran = 0;
    for (int k = 0; k < KPL_OP_COUNT; k++) {
        const kpl_op_info *r = kpl_op_info_of((kpl_op)k);
        if (!kind_has_kernel(r->run)) continue;
        kpl_pool *pool = NN(kpl_pool_push());
        kpl_op_attrs at = {.alpha = 0.1, .beta = 0.7, .scalar = 1.5, .naxes = 1, .axes = {1}};
        if (r->run == KPL_OP_RUN_UNA && k == KPL_OP_CLIP) at.alpha = -0.3;
        kpl_tensor *x[2] = {NULL, NULL}, *want = NULL;
        for (int i = 0; i < r->in_min; i++) {
            OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F64, 2, shape, &x[i]));
            kpl_autorelease(x[i]);
            fill(x[i], 0.25, 2.0, (unsigned)(k * 7 + i));
        }
        int64_t ys[KPL_MAX_DIMS];
        int ynd = 2;
        memcpy(ys, shape, sizeof shape);
        kpl_dtype ydt = KPL_F64;
        if (r->run == KPL_OP_RUN_RED) {
            ynd = 1;
            ys[0] = 3;
            if (r->kernel == KPL_RED_ARGMAX || r->kernel == KPL_RED_ARGMIN) ydt = KPL_I64;
        }
        OK(kpl_tensor_zeros(kpl_device_cpu(), ydt, ynd, ys, &want));
        kpl_autorelease(want);
        switch (r->run) {
        case KPL_OP_RUN_UN:
        case KPL_OP_RUN_UNA:
            OK(kpl_k_unary(want, (kpl_unary_op)r->kernel, x[0], at.alpha, at.beta));
            break;
        case KPL_OP_RUN_BIN: OK(kpl_k_binary(want, (kpl_binary_op)r->kernel, x[0], x[1])); break;
        case KPL_OP_RUN_BINS:
            OK(kpl_k_binary_scalar(want, (kpl_binary_op)r->kernel, x[0], at.scalar, false));
            break;
        default:
            OK(kpl_k_reduce(want, (kpl_reduce_op)r->kernel, x[0], at.axes, 1, false,
                            r->kernel == KPL_RED_VAR));
            at.correction = r->kernel == KPL_RED_VAR;
        }
        kpl_ir *ir = NULL;
        OK(kpl_ir_create(&ir));
        int in[2], out;
        for (int i = 0; i < r->in_min; i++)
            in[i] = kpl_ir_add_value(ir, KPL_IRV_INPUT, KPL_F64, 2, shape, i ? "b" : "a", NULL);
        out = kpl_ir_add_value(ir, KPL_IRV_OP, ydt, ynd, ys, NULL, NULL);
        assert_true(in[0] >= 0 && out >= 0);
        if (kpl_ir_add_node(ir, (kpl_op)k, &at, r->in_min, in, 1, &out) < 0)
            fail_msg("%s: %s", r->name, kpl_last_error());
        OK(kpl_ir_set_io(ir, r->in_min, in, 1, &out, NULL));
        if (kpl_ir_check(ir) < 0) fail_msg("%s: %s", r->name, kpl_last_error());
        kpl_exec *ex = NULL;
        OK(kpl_exec_create(ir, &ex));
        for (int i = 0; i < r->in_min; i++) OK(kpl_exec_set_input(ex, i, x[i]));
        OK(kpl_exec_run(ex));
        kpl_tensor *got = NN(kpl_exec_output(ex, 0));
        assert_int_equal(kpl_tensor_dtype(got), ydt);
        assert_int_equal(kpl_tensor_nbytes(got), kpl_tensor_nbytes(want));
        if (memcmp(kpl_tensor_host_data(got), kpl_tensor_host_data(want), kpl_tensor_nbytes(want)))
            fail_msg("%s: the graph's result differs from the kernel's", r->name);
        kpl_exec_destroy(ex);
        kpl_ir_destroy(ir);
        kpl_pool_pop(pool);
        ran++;
    }
    assert_true(ran >= 40);
}

int run_op_table_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_row_complete),
        cmocka_unit_test(test_kernels_match_names),
        cmocka_unit_test(test_generic_ops_run_in_a_graph),
    };
    return cmocka_run_group_tests_name("op_table", tests, NULL, NULL);
}
