/* test_ir.c — the static graph: tracing, shape inference, the passes, the
 * executor's memory plans and layout tuning, and what a trace refuses
 * (training steps traced: test_ir_train.c, the same executable). */
#include "ir_net.h"

int run_train_tests(void);

/* Traced at every level, with and without the inference fusions, the graph
 * computes what eager mode computes on another input. */
static void test_trace_and_levels(void **state)
{
    (void)state;
    net n;
    net_init(&n);
    kpl_pool *pool = NN(kpl_pool_push());
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor *x0 = net_image(21), *x1 = net_image(22);
    kpl_tensor *want = NN(net_forward(&n, x1));
    for (int fuse = 0; fuse < 2; fuse++)
        for (int level = 0; level <= 3; level++) {
            kpl_ir *ir = trace_net(&n, x0);
            int nodes0 = kpl_ir_num_nodes(ir);
            OK(kpl_ir_optimize(ir, level, fuse));
            if (fuse) assert_true(kpl_ir_num_nodes(ir) < nodes0);
            kpl_exec *ex = NULL;
            OK(kpl_exec_create(ir, &ex));
            OK(kpl_exec_set_input(ex, 0, x1));
            OK(kpl_exec_run(ex));
            kpl_tensor *got = NN(kpl_exec_output(ex, 0));
            double d = max_abs_diff(got, want);
            if (fuse) assert_true(d < 1e-5);
            else if (d != 0) fail_msg("O%d without fusions differs from eager by %g", level, d);
            /* a second run on the first input gives the first output */
            OK(kpl_exec_set_input(ex, 0, x0));
            OK(kpl_exec_run(ex));
            kpl_tensor *want0 = NN(net_forward(&n, x0));
            assert_true(max_abs_diff(kpl_exec_output(ex, 0), want0) < (fuse ? 1e-5 : 1e-300));
            kpl_exec_stats es = kpl_exec_get_stats(ex);
            if (level >= 2 && !fuse) assert_true(es.n_inplace > 0);
            if (level < 2) assert_int_equal(es.n_inplace, 0);
            if (level == 3 && !fuse) assert_true(es.arena_bytes < es.value_bytes / 3);
            kpl_exec_destroy(ex);
            kpl_ir_destroy(ir);
        }
    kpl_set_grad_enabled(prev);
    kpl_pool_pop(pool);
    net_free(&n);
}

/* An executor on the CPU times its graph with the convolutions' layouts
 * as chosen one by one, with every convolution NHWC and with every one
 * nChw16c, settles on one within 27 runs, and computes what eager mode computes on every run,
 * tuning or not; with a layout asked for (process-wide) or in
 * deterministic mode it does not tune. */
static void test_layout_tuning(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    bool prev = kpl_set_grad_enabled(false);
    net n;
    net_init(&n);
    kpl_tensor *x = net_image(23), *want = NN(net_forward(&n, x));
    for (int mode = 0; mode < 3; mode++) { /* tuning, NHWC asked, deterministic */
        kpl_layout pl = kpl_set_kept_layout(mode == 1 ? KPL_LAYOUT_NHWC : KPL_LAYOUT_AUTO);
        if (mode == 2) kpl_set_deterministic(true);
        kpl_ir *ir = trace_net(&n, x);
        OK(kpl_ir_optimize(ir, 3, true));
        kpl_exec *ex = NULL;
        OK(kpl_exec_create(ir, &ex));
        OK(kpl_exec_set_input(ex, 0, x));
        int settled = -1;
        for (int r = 0; r < 30; r++) {
            OK(kpl_exec_run(ex));
            double d = max_abs_diff(kpl_exec_output(ex, 0), want);
            if (!(d < 1e-5)) fail_msg("mode %d run %d: %g from eager", mode, r, d);
            int kl = kpl_exec_get_stats(ex).kept_layout;
            if (settled >= 0) assert_int_equal(kl, settled); /* settled stays */
            if (kl >= 0 && settled < 0) {
                settled = kl;
                print_message("settled on %s after %d runs\n",
                              kl == KPL_LAYOUT_NHWC      ? "NHWC"
                              : kl == KPL_LAYOUT_NCHW16C ? "nChw16c"
                                                         : "auto",
                              r + 1);
                assert_true(r + 1 >= 9 && r + 1 <= 27);
            }
        }
        if (mode == 0)
            assert_true(settled == KPL_LAYOUT_AUTO || settled == KPL_LAYOUT_NHWC ||
                        settled == KPL_LAYOUT_NCHW16C);
        else assert_int_equal(settled, -1);
        kpl_exec_destroy(ex);
        kpl_ir_destroy(ir);
        kpl_set_kept_layout(pl);
        kpl_set_deterministic(false);
    }
    kpl_set_grad_enabled(prev);
    kpl_pool_pop(pool);
    net_free(&n);
}

/* An inference executor marks its parameters constant while it lives
 * (its convolutions keep their weights reordered) and leaves them as they
 * were when it goes; a parameter written between runs is read anew, and
 * one constant before stays so. */
static void test_frozen_params(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    bool prev = kpl_set_grad_enabled(false);
    /* NHWC asked: blocked weights (no plain-weights kernel), so a kept copy */
    kpl_layout pl = kpl_set_kept_layout(KPL_LAYOUT_NHWC);
    net n, m; /* m: the same values, never constant, for eager's results */
    net_init(&n);
    net_init(&m);
    kpl_tensor_set_constant(n.fw, true);
    kpl_tensor *x = net_image(29);
    kpl_ir *ir = trace_net(&n, x);
    OK(kpl_ir_optimize(ir, 3, false)); /* no fusion: the convolutions read w1, w2 */
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    assert_true(kpl_tensor_constant(n.w1) && kpl_tensor_constant(n.w2));
    OK(kpl_exec_set_input(ex, 0, x));
    for (int r = 0; r < 8; r++) {
        if (r == 4) /* a write between runs, through an accessor */
            for (int k = 0; k < 2; k++) {
                kpl_tensor *w = k ? m.w2 : n.w2;
                OK(kpl_k_binary_scalar(w, KPL_BIN_MUL, w, -0.5, false));
            }
        OK(kpl_exec_run(ex));
        kpl_tensor *want = NN(net_forward(&m, x));
        double d = max_abs_diff(kpl_exec_output(ex, 0), want);
        if (!(d < 1e-5)) fail_msg("run %d: %g from eager", r, d);
    }
    kpl_exec_destroy(ex);
    assert_false(kpl_tensor_constant(n.w1) || kpl_tensor_constant(n.w2));
    assert_true(kpl_tensor_constant(n.fw)); /* constant before: left so */
    kpl_tensor_set_constant(n.fw, false);
    kpl_set_kept_layout(pl);
    kpl_ir_destroy(ir);
    kpl_set_grad_enabled(prev);
    kpl_pool_pop(pool);
    net_free(&n);
    net_free(&m);
}

/* The fusions leave the expected ops: the first conv absorbed its batch
 * norm and relu, the second its batch norm; no batch-norm arithmetic is
 * left between them. */
static void test_fusions_shape_the_graph(void **state)
{
    (void)state;
    net n;
    net_init(&n);
    kpl_pool *pool = NN(kpl_pool_push());
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor *x = kpl_autorelease(owned_randn(4, (int64_t[]){1, 3, 8, 8}, 31, 1));
    kpl_ir *ir = trace_net(&n, x);
    int changed = 0;
    OK(kpl_ir_fuse_inference(ir, &changed));
    assert_true(changed > 0);
    OK(kpl_ir_prune(ir, NULL));
    int convs = 0, relu_convs = 0, muls = 0;
    for (int i = 0; i < kpl_ir_num_nodes(ir); i++) {
        kpl_op op = kpl_ir_node_op(ir, i);
        convs += op == KPL_OP_CONV2D;
        relu_convs += op == KPL_OP_CONV2D_RELU;
        muls += op == KPL_OP_MUL || op == KPL_OP_RSQRT || op == KPL_OP_ADD_SCALAR;
    }
    assert_int_equal(convs + relu_convs, 2);
    assert_int_equal(relu_convs, 2);
    assert_int_equal(muls, 0);
    /* the parameters were not touched: eager still gives the same */
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    OK(kpl_exec_set_input(ex, 0, x));
    OK(kpl_exec_run(ex));
    assert_true(max_abs_diff(kpl_exec_output(ex, 0), net_forward(&n, x)) < 1e-5);
    /* dumps */
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    OK(kpl_ir_dump(ir, f, false));
    fclose(f);
    assert_non_null(strstr(buf, "conv2d_relu("));
    assert_non_null(strstr(buf, "input  %0:image f32 (1,3,8,8)"));
    assert_non_null(strstr(buf, "output logp ="));
    free(buf);
    f = open_memstream(&buf, &len);
    OK(kpl_ir_dump(ir, f, true));
    fclose(f);
    assert_true(!strncmp(buf, "digraph kpl {", 13));
    assert_non_null(strstr(buf, "-> out0"));
    free(buf);
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    kpl_set_grad_enabled(prev);
    kpl_pool_pop(pool);
    net_free(&n);
}

/* Residual adds fold into the convolution before them (conv2d_add, with
 * the ReLU after the add: conv2d_add_relu): a block whose shortcut
 * convolution is made after the main branch (the shortcut takes the branch
 * as its addend), an identity block without ReLU; an add that broadcasts
 * and a convolution read twice stay as they were.  The executor's values
 * equal eager's at every level: through the copy of the addend (O1) and
 * over its bytes (O2, O3); bit for bit in f64. */
static kpl_tensor *residual_net(kpl_tensor *x, kpl_tensor *const *w, kpl_tensor *bias)
/* w: 6 convolutions' weights */
{
    kpl_conv2d_params p3 = KPL_CONV2D_PARAMS_INIT, p1 = KPL_CONV2D_PARAMS_INIT;
    p3.padding[0] = p3.padding[1] = 1;
    kpl_tensor *a = kpl_relu(kpl_conv2d(x, w[0], bias, &p3));
    kpl_tensor *y = kpl_conv2d(a, w[1], NULL, &p3);
    kpl_tensor *h = kpl_relu(kpl_add(y, kpl_conv2d(x, w[2], bias, &p1))); /* shortcut last */
    kpl_tensor *z = kpl_add(h, kpl_conv2d(h, w[3], bias, &p3));           /* identity */
    kpl_tensor *t = kpl_conv2d(z, w[4], NULL, &p3);                       /* read twice */
    kpl_tensor *u = kpl_add(kpl_mul(t, t), t);
    kpl_tensor *m = kpl_mean(x, (int[]){2, 3}, 2, true); /* (N, 16, 1, 1): broadcast */
    return kpl_add(kpl_conv2d(u, w[5], NULL, &p1), m);
}

/* An owned N(0, std) tensor given to the pool, in dtype dt. */
static kpl_tensor *pooled_randn(kpl_dtype dt, int ndim, const int64_t *shape, uint64_t seed,
                                double std)
{
    return NN(kpl_cast(kpl_autorelease(owned_randn(ndim, shape, seed, std)), dt));
}

static void residual_case(kpl_dtype dt)
{
    kpl_pool *pool = NN(kpl_pool_push());
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor *w[6], *bias = pooled_randn(dt, 1, (int64_t[]){16}, 60, 0.2);
    for (int i = 0; i < 6; i++) {
        int64_t k = i == 2 || i == 5 ? 1 : 3;
        w[i] = pooled_randn(dt, 4, (int64_t[]){16, 16, k, k}, 61 + i, 0.15);
    }
    kpl_tensor *x = pooled_randn(dt, 4, (int64_t[]){2, 16, 9, 7}, 70, 1);
    kpl_tensor *want = residual_net(x, w, bias);
    double big = 0; /* f32: the order of a convolution's sums may differ */
    for (int64_t i = 0; i < kpl_tensor_numel(want); i++) big = fmax(big, fabs(tget(want, i)));
    for (int level = 1; level <= 3; level++) {
        OK(kpl_trace_begin());
        kpl_tensor *y = NN(residual_net(NN(kpl_trace_input(x, "x")), w, bias));
        kpl_ir *ir = NULL;
        OK(kpl_trace_end(1, &y, NULL, &ir));
        OK(kpl_ir_optimize(ir, level, true));
        int n[3] = {0, 0, 0}; /* conv2d_add, conv2d_add_relu, add */
        for (int i = 0; i < kpl_ir_num_nodes(ir); i++) {
            kpl_op op = kpl_ir_node_op(ir, i);
            n[0] += op == KPL_OP_CONV2D_ADD, n[1] += op == KPL_OP_CONV2D_ADD_RELU;
            n[2] += op == KPL_OP_ADD;
        }
        assert_int_equal(n[0], 1);
        assert_int_equal(n[1], 1);
        assert_int_equal(n[2], 2); /* u's and the broadcast */
        kpl_exec *ex = NULL;
        OK(kpl_exec_create(ir, &ex));
        OK(kpl_exec_set_input(ex, 0, x));
        OK(kpl_exec_run(ex));
        double d = max_abs_diff(kpl_exec_output(ex, 0), want);
        if (dt == KPL_F64) assert_true(d == 0);
        else if (!(d <= 2e-6 * big)) fail_msg("O%d: %g of %g", level, d, big);
        if (level >= 2) assert_true(kpl_exec_get_stats(ex).n_inplace >= 2);
        kpl_exec_destroy(ex);
        kpl_ir_destroy(ir);
    }
    kpl_set_grad_enabled(prev);
    kpl_pool_pop(pool);
}

static void test_residual_fusion(void **state)
{
    (void)state;
    residual_case(KPL_F32);
    residual_case(KPL_F64);
    /* the fused kernel's operands are checked as conv2d's; a dtype without
     * the kernel says so (the pass does not fuse there) */
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_conv2d_params p3 = KPL_CONV2D_PARAMS_INIT;
    p3.padding[0] = p3.padding[1] = 1;
    kpl_tensor *x = kpl_autorelease(owned_randn(4, (int64_t[]){1, 16, 5, 5}, 80, 1));
    kpl_tensor *w = kpl_autorelease(owned_randn(4, (int64_t[]){16, 16, 3, 3}, 81, 0.1));
    kpl_tensor *small = kpl_autorelease(owned_randn(4, (int64_t[]){1, 16, 4, 4}, 82, 1));
    FAILS(kpl_k_conv2d_acc(x, x, w, NULL, &p3, false), KPL_EINVAL, "may not alias");
    FAILS(kpl_k_conv2d_acc(small, x, w, NULL, &p3, true), KPL_ESHAPE, "conv2d_acc");
    kpl_tensor *h[3];
    for (int i = 0; i < 3; i++) h[i] = NN(kpl_cast(i == 1 ? w : x, KPL_F16));
    FAILS(kpl_k_conv2d_acc(h[2], h[0], h[1], NULL, &p3, false), KPL_ENOKERNEL, "conv2d_acc");
    /* concatenation: a missing piece, pieces that do not add up */
    kpl_tensor *cat = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){1, 32, 5, 5}, &cat));
    kpl_autorelease(cat);
    FAILS(kpl_k_concat(cat, 2, (const kpl_tensor *[]){x, NULL}, 1), KPL_EINVAL, "piece 1");
    FAILS(kpl_k_concat(cat, 3, (const kpl_tensor *[]){x, x, x}, 1), KPL_ERANGE, "copy_slab");
    FAILS(kpl_k_concat(cat, 2, (const kpl_tensor *[]){x, small}, 1), KPL_ESHAPE, "differ");
    kpl_pool_pop(pool);
}

/* A trace holds no values: a chain of ops whose intermediates are dropped
 * as they are used (as modules do) peaks where eager mode peaks, not at
 * the sum of every value (the tracer used to hold each tensor it saw);
 * the freed headers' addresses, reused by the next results, are not taken
 * for the old values; and the graph repeats the chain. */
static void test_trace_holds_no_values(void **state)
{
    (void)state;
    kpl_device *cpu = kpl_device_cpu();
    kpl_pool *pool = NN(kpl_pool_push());
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor *x = kpl_autorelease(owned_randn(2, (int64_t[]){256, 1024}, 90, 1)); /* 1 MiB */
    size_t peak[2];
    kpl_tensor *last = NULL;
    for (int traced = 0; traced < 2; traced++) {
        size_t base = kpl_device_memory_stats(cpu).allocated;
        kpl_device_reset_peak(cpu);
        if (traced) OK(kpl_trace_begin());
        kpl_tensor *h = traced ? NN(kpl_trace_input(x, "x")) : x;
        kpl_tensor_retain(h);
        for (int i = 0; i < 16; i++) {
            kpl_pool *p = NN(kpl_pool_push());
            kpl_tensor *y = NN(kpl_scalar_op(KPL_BIN_MUL, h, 1.0 + i / 64.0, false));
            kpl_tensor_retain(y);
            kpl_pool_pop(p);
            kpl_tensor_release(h);
            h = y;
        }
        peak[traced] = kpl_device_memory_stats(cpu).peak_allocated - base;
        if (traced) {
            kpl_ir *ir = NULL;
            OK(kpl_trace_end(1, &h, NULL, &ir));
            assert_int_equal(kpl_ir_num_nodes(ir), 16);
            kpl_exec *ex = NULL;
            OK(kpl_exec_create(ir, &ex));
            OK(kpl_exec_set_input(ex, 0, x));
            OK(kpl_exec_run(ex));
            assert_true(max_abs_diff(kpl_exec_output(ex, 0), last) == 0);
            kpl_exec_destroy(ex);
            kpl_ir_destroy(ir);
            kpl_tensor_release(h);
        } else {
            last = kpl_autorelease(h);
        }
    }
    print_message("peak over the chain: eager %.1f MiB, traced %.1f MiB\n", peak[0] / 1048576.0,
                  peak[1] / 1048576.0);
    assert_true(peak[1] <= peak[0] + (1u << 20)); /* holding the values: 16 MiB more */
    kpl_set_grad_enabled(prev);
    kpl_pool_pop(pool);
}

/* O1 drops what the outputs do not need; side outputs stay when asked. */
static void test_prune(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = kpl_autorelease(owned_randn(2, (int64_t[]){4, 6}, 41, 1));
    OK(kpl_trace_begin());
    kpl_tensor *in = NN(kpl_trace_input(x, NULL));
    kpl_tensor *unused = NN(kpl_exp(kpl_sum(in, NULL, 0, false)));
    (void)unused;
    kpl_tensor *y = NN(kpl_relu(kpl_scalar_op(KPL_BIN_MUL, in, 2, false)));
    int ax = 1;
    kpl_tensor *idx = NN(kpl_argmax(y, ax, false));
    kpl_ir *ir = NULL;
    OK(kpl_trace_end(1, &idx, NULL, &ir));
    assert_int_equal(kpl_ir_num_nodes(ir), 5);
    int changed = 0;
    OK(kpl_ir_prune(ir, &changed));
    assert_int_equal(kpl_ir_num_nodes(ir), 3);
    assert_true(changed >= 2);
    assert_string_equal(kpl_ir_output_name(ir, 0), "output0");
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    float v[6] = {1, -5, 7, 7, 0, 2};
    kpl_tensor *x2 = NULL;
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 2, (int64_t[]){4, 6}, &x2));
    memcpy(kpl_tensor_host_mutable(x2), v, sizeof v);
    OK(kpl_exec_set_input(ex, 0, x2));
    OK(kpl_exec_run(ex));
    kpl_tensor *o = kpl_exec_output(ex, 0);
    assert_int_equal(kpl_tensor_dtype(o), KPL_I64);
    assert_float_equal(tget(o, 0), 2, 0); /* the first of the two 7s */
    assert_float_equal(tget(o, 1), 0, 0); /* zeros: the first */
    /* a wrong input is refused, naming both shapes */
    kpl_tensor *bad = kpl_autorelease(owned_randn(2, (int64_t[]){4, 5}, 42, 1));
    FAILS(kpl_exec_set_input(ex, 0, bad), KPL_ESHAPE, "input 'input0' is f32 (4,6), got f32 (4,5)");
    kpl_tensor_release(x2);
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    kpl_pool_pop(pool);
}

/* What a trace cannot hold is an error at trace_end that says what. */
static void test_trace_refusals(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = kpl_autorelease(owned_randn(2, (int64_t[]){3, 4}, 51, 1));
    kpl_ir *ir = NULL;

    /* a branch on data */
    OK(kpl_trace_begin());
    kpl_tensor *in = NN(kpl_trace_input(x, "x"));
    kpl_tensor *s = NN(kpl_sum(in, NULL, 0, false));
    double v;
    OK(kpl_tensor_get(s, 0, &v));
    kpl_tensor *y = v > 0 ? kpl_relu(in) : kpl_neg(in);
    FAILS(kpl_trace_end(1, &y, NULL, &ir), KPL_EINVAL, "read the values of %1 () (sum) on the host");
    assert_null(ir);
    assert_false(kpl_tracing());

    /* a tensor computed outside the ops */
    OK(kpl_trace_begin());
    in = NN(kpl_trace_input(x, "x"));
    kpl_tensor *side = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 2, (int64_t[]){3, 4}, &side));
    OK(kpl_k_unary(side, KPL_UN_EXP, in, 0, 0));
    kpl_autorelease(side);
    y = NN(kpl_add(in, side));
    FAILS(kpl_trace_end(1, &y, NULL, &ir), KPL_EINVAL, "input 1 of 'add' (f32 (3,4)) was made outside");

    /* a write into a constant of the trace */
    OK(kpl_trace_begin());
    in = NN(kpl_trace_input(x, "x"));
    kpl_tensor *c = NN(kpl_full(kpl_device_cpu(), KPL_F32, 2, (int64_t[]){3, 4}, 2));
    y = NN(kpl_mul(in, c));
    OK(kpl_write_scalar(c, KPL_BIN_ADD, c, 1, false));
    FAILS(kpl_trace_end(1, &y, NULL, &ir), KPL_EINVAL, "wrote into constant");

    /* a host write of a parameter */
    kpl_tensor *w = kpl_autorelease(owned_randn(2, (int64_t[]){3, 4}, 53, 1));
    OK(kpl_trace_begin());
    in = NN(kpl_trace_input(x, "x"));
    y = NN(kpl_mul(in, w));
    NN(kpl_tensor_host_mutable(w));
    FAILS(kpl_trace_end(1, &y, NULL, &ir), KPL_EINVAL, "wrote parameter");

    /* writes of every kind of binary op trace as ops of their dtype: a
     * comparison's bool mask, then relu_bwd through it */
    OK(kpl_trace_begin());
    in = NN(kpl_trace_input(x, "x"));
    kpl_tensor *mask = NULL, *g = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_BOOL, 2, (int64_t[]){3, 4}, &mask));
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 2, (int64_t[]){3, 4}, &g));
    kpl_autorelease(mask);
    kpl_autorelease(g);
    OK(kpl_write_binary(mask, KPL_BIN_GT, in, NN(kpl_full(kpl_device_cpu(), KPL_F32, 0, NULL, 0))));
    OK(kpl_write_binary(g, KPL_BIN_RELU_BWD, in, in));
    y = NN(kpl_where(mask, g, NN(kpl_neg(in))));
    OK(kpl_trace_end(1, &y, NULL, &ir));
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    kpl_tensor *x2 = kpl_autorelease(owned_randn(2, (int64_t[]){3, 4}, 56, 1));
    OK(kpl_exec_set_input(ex, 0, x2));
    OK(kpl_exec_run(ex));
    for (int i = 0; i < 12; i++) /* |x2|: x where x > 0, -x elsewhere */
        assert_true(tget(kpl_exec_output(ex, 0), i) == fabs(tget(x2, i)));
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);

    /* a write through a view of a parameter */
    kpl_tensor *pw = kpl_autorelease(owned_randn(2, (int64_t[]){3, 4}, 55, 1));
    OK(kpl_trace_begin());
    in = NN(kpl_trace_input(x, "x"));
    y = NN(kpl_mul(in, pw));
    kpl_tensor *view = NULL;
    OK(kpl_tensor_reshape(pw, 1, (int64_t[]){12}, &view));
    kpl_autorelease(view);
    OK(kpl_write_copy(view, NN(kpl_reshape(y, 1, (int64_t[]){12}))));
    FAILS(kpl_trace_end(1, &y, NULL, &ir), KPL_EINVAL, "cannot follow a write through one of two");

    /* a gradient from before the trace added to */
    kpl_tensor *wg = kpl_autorelease(owned_randn(2, (int64_t[]){3, 4}, 54, 1));
    OK(kpl_set_requires_grad(wg, true));
    OK(kpl_backward(NN(kpl_sum(kpl_mul(x, wg), NULL, 0, false)), NULL, false));
    OK(kpl_trace_begin());
    in = NN(kpl_trace_input(x, "x"));
    y = NN(kpl_sum(kpl_mul(in, wg), NULL, 0, false));
    OK(kpl_backward(y, NULL, false));
    FAILS(kpl_trace_end(1, &y, NULL, &ir), KPL_EINVAL, "accumulation over steps");
    kpl_zero_grad(1, &wg);

    /* random numbers */
    kpl_rng *rng = kpl_rng_create(1);
    OK(kpl_trace_begin());
    in = NN(kpl_trace_input(x, "x"));
    y = NN(kpl_dropout(in, 0.5, true, rng));
    FAILS(kpl_trace_end(1, &y, NULL, &ir), KPL_EINVAL, "random numbers cannot be traced");
    kpl_rng_destroy(rng);

    /* outputs that are no op's result */
    OK(kpl_trace_begin());
    in = NN(kpl_trace_input(x, "x"));
    FAILS(kpl_trace_end(1, &in, NULL, &ir), KPL_EINVAL, "output 0 is a placeholder");
    FAILS(kpl_trace_end(1, &in, NULL, &ir), KPL_ESTATE, "no trace is open");

    /* one trace per thread */
    OK(kpl_trace_begin());
    FAILS(kpl_trace_begin(), KPL_ESTATE, "already open");
    kpl_trace_abort();
    assert_false(kpl_tracing());
    kpl_pool_pop(pool);
}

/* Shape inference catches a graph whose recorded shapes do not follow. */
static void test_check_shapes(void **state)
{
    (void)state;
    kpl_ir *ir = NULL;
    OK(kpl_ir_create(&ir));
    int a = kpl_ir_add_value(ir, KPL_IRV_INPUT, KPL_F32, 2, (int64_t[]){2, 3}, "a", NULL);
    int b = kpl_ir_add_value(ir, KPL_IRV_INPUT, KPL_F32, 2, (int64_t[]){3, 4}, "b", NULL);
    int c = kpl_ir_add_value(ir, KPL_IRV_OP, KPL_F32, 2, (int64_t[]){2, 5}, NULL, NULL);
    kpl_op_attrs at = {0};
    assert_true(kpl_ir_add_node(ir, KPL_OP_MATMUL, &at, 2, (int[]){a, b}, 1, &c) == 0);
    OK(kpl_ir_set_io(ir, 2, (int[]){a, b}, 1, &c, NULL));
    FAILS(kpl_ir_check(ir), KPL_ESHAPE, "node 0 (matmul) makes f32 (2,4) for output 0, the graph says %2 is f32 (2,5)");
    kpl_ir_destroy(ir);
    /* an add with one input, a relu with two outputs, a placeholder not
     * listed as an input: refused before any shape is read */
    OK(kpl_ir_create(&ir));
    a = kpl_ir_add_value(ir, KPL_IRV_INPUT, KPL_F32, 1, (int64_t[]){3}, "a", NULL);
    c = kpl_ir_add_value(ir, KPL_IRV_OP, KPL_F32, 1, (int64_t[]){3}, NULL, NULL);
    int d = kpl_ir_add_value(ir, KPL_IRV_OP, KPL_F32, 1, (int64_t[]){3}, NULL, NULL);
    assert_true(kpl_ir_add_node(ir, KPL_OP_ADD, &at, 1, &a, 1, &c) == 0);
    OK(kpl_ir_set_io(ir, 1, &a, 1, &c, NULL));
    FAILS(kpl_ir_check(ir), KPL_EINVAL, "'add' has 1 inputs and 1 outputs (it takes 2 to 2 and makes 1 to 1)");
    kpl_ir_destroy(ir);
    OK(kpl_ir_create(&ir));
    a = kpl_ir_add_value(ir, KPL_IRV_INPUT, KPL_F32, 1, (int64_t[]){3}, "a", NULL);
    c = kpl_ir_add_value(ir, KPL_IRV_OP, KPL_F32, 1, (int64_t[]){3}, NULL, NULL);
    d = kpl_ir_add_value(ir, KPL_IRV_OP, KPL_F32, 1, (int64_t[]){3}, NULL, NULL);
    assert_true(kpl_ir_add_node(ir, KPL_OP_RELU, &at, 1, &a, 2, (int[]){c, d}) == 0);
    OK(kpl_ir_set_io(ir, 1, &a, 1, &c, NULL));
    FAILS(kpl_ir_check(ir), KPL_EINVAL, "'relu' has 1 inputs and 2 outputs");
    kpl_ir_destroy(ir);
    OK(kpl_ir_create(&ir));
    a = kpl_ir_add_value(ir, KPL_IRV_INPUT, KPL_F32, 1, (int64_t[]){3}, "a", NULL);
    b = kpl_ir_add_value(ir, KPL_IRV_INPUT, KPL_F32, 1, (int64_t[]){3}, "b", NULL);
    c = kpl_ir_add_value(ir, KPL_IRV_OP, KPL_F32, 1, (int64_t[]){3}, NULL, NULL);
    assert_true(kpl_ir_add_node(ir, KPL_OP_ADD, &at, 2, (int[]){a, b}, 1, &c) == 0);
    OK(kpl_ir_set_io(ir, 1, &a, 1, &c, NULL));
    FAILS(kpl_ir_check(ir), KPL_EINVAL, "%1 is a placeholder not listed as an input");
    kpl_ir_destroy(ir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_trace_and_levels),
        cmocka_unit_test(test_fusions_shape_the_graph),
        cmocka_unit_test(test_residual_fusion),
        cmocka_unit_test(test_layout_tuning),
        cmocka_unit_test(test_frozen_params),
        cmocka_unit_test(test_trace_holds_no_values),
        cmocka_unit_test(test_prune),
        cmocka_unit_test(test_trace_refusals),
        cmocka_unit_test(test_check_shapes),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    return failed + run_train_tests();
}
