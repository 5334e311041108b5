/* test_train_graph.c — a whole training step of a zoo model (forward,
 * cross entropy, backward, kpl_optim's SGD) traced once and run by the
 * executor equals eager steps bit for bit, following the learning-rate
 * schedule; what such a trace refuses. */
#include "kpl_test.h"
#include "trainer.h"

typedef struct {
    kpl_module *net;
    kpl_optim *opt;
} model;

static void model_init(model *m, const char *preset, int64_t classes, bool nesterov)
{
    kpl_model_config c;
    OK(kpl_zoo_preset(preset, classes, &c));
    OK(kpl_zoo_create(&c, kpl_device_cpu(), 7, &m->net));
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    oc.lr = 0.05;
    oc.momentum = 0.9;
    oc.nesterov = nesterov;
    oc.weight_decay = 5e-4;
    OK(kpl_optim_create(&oc, kpl_module_num_params(m->net), kpl_module_params(m->net), NULL,
                        &m->opt));
}

static void model_free(model *m)
{
    kpl_optim_destroy(m->opt);
    kpl_module_destroy(m->net);
}

/* forward, loss, backward, update; the loss (pool-owned) */
static kpl_tensor *step(model *m, kpl_tensor *x, kpl_tensor *y)
{
    kpl_tensor *loss = NN(kpl_cross_entropy(kpl_module_forward(m->net, x), y, KPL_REDUCE_MEAN,
                                            0.0, -100));
    OK(kpl_backward(loss, NULL, false));
    OK(kpl_optim_step(m->opt));
    return loss;
}

static double lr_at(int s) { return 0.05 * (1.0 - s / 40.0); } /* a schedule: changes every step */

static void batches(int steps, int64_t b, const int64_t *img, int64_t classes, kpl_tensor **xs,
                    kpl_tensor **ys)
{
    kpl_rng *r = kpl_rng_create(3);
    for (int s = 0; s < steps; s++) {
        int64_t shape[4] = {b, img[0], img[1], img[2]};
        OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 4, shape, &xs[s]));
        OK(kpl_k_normal(xs[s], r, 0, 1));
        kpl_autorelease(xs[s]);
        int64_t lab[64];
        for (int i = 0; i < b; i++) lab[i] = (s * 5 + i * 3) % classes;
        OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &b, lab, &ys[s]));
        kpl_autorelease(ys[s]);
    }
    kpl_rng_destroy(r);
}

static void same_params(model *a, model *b)
{
    int n = kpl_module_num_params(a->net);
    for (int i = 0; i < n; i++) {
        kpl_tensor *p = kpl_module_params(a->net)[i], *q = kpl_module_params(b->net)[i];
        if (memcmp(kpl_tensor_host_data(p), kpl_tensor_host_data(q), kpl_tensor_nbytes(p)))
            fail_msg("parameter %s differs", kpl_module_param_name(a->net, i));
    }
    n = kpl_module_num_buffers(a->net);
    for (int i = 0; i < n; i++) {
        kpl_tensor *p = kpl_module_buffers(a->net)[i], *q = kpl_module_buffers(b->net)[i];
        if (memcmp(kpl_tensor_host_data(p), kpl_tensor_host_data(q), kpl_tensor_nbytes(p)))
            fail_msg("buffer %s differs", kpl_module_buffer_name(a->net, i));
    }
}

/* Eager steps 0..steps-1 on one model; on the other, step 0 eager (SGD
 * makes its momenta), step 1 traced, the rest run by the graph at
 * `level` with the schedule's lr set before each. */
static void compare(const char *preset, int64_t classes, const int64_t *img, int64_t b,
                    int steps, int level, bool nesterov)
{
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *xs[24], *ys[24];
    batches(steps, b, img, classes, xs, ys);
    model ref, m;
    model_init(&ref, preset, classes, nesterov);
    model_init(&m, preset, classes, nesterov);
    double want[24];
    for (int s = 0; s < steps; s++) {
        kpl_pool *p = kpl_pool_push();
        kpl_optim_set_lr(ref.opt, lr_at(s));
        want[s] = tget(step(&ref, xs[s], ys[s]), 0);
        kpl_pool_pop(p);
    }
    kpl_pool *p = kpl_pool_push();
    kpl_optim_set_lr(m.opt, lr_at(0));
    assert_true(tget(step(&m, xs[0], ys[0]), 0) == want[0]);
    kpl_optim_set_lr(m.opt, lr_at(1));
    OK(kpl_trace_begin());
    kpl_tensor *x = NN(kpl_trace_input(xs[1], "image"));
    kpl_tensor *y = NN(kpl_trace_input(ys[1], "label"));
    kpl_tensor *loss = step(&m, x, y);
    kpl_ir *ir = NULL;
    OK(kpl_trace_end(1, &loss, (const char *[]){"loss"}, &ir));
    assert_true(tget(loss, 0) == want[1]);
    kpl_pool_pop(p);
    /* every parameter and momentum, and the running statistics, written back */
    int np = kpl_module_num_params(m.net), nb = kpl_module_num_buffers(m.net);
    int nstats = 0;
    for (int i = 0; i < nb; i++)
        nstats += strstr(kpl_module_buffer_name(m.net, i), "running_") != NULL;
    assert_int_equal(kpl_ir_num_updates(ir), 2 * np + nstats);
    OK(kpl_ir_optimize(ir, level, false));
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    for (int s = 2; s < steps; s++) {
        kpl_optim_set_lr(m.opt, lr_at(s));
        OK(kpl_exec_set_input(ex, 0, xs[s]));
        OK(kpl_exec_set_input(ex, 1, ys[s]));
        OK(kpl_exec_run(ex));
        double got = tget(kpl_exec_output(ex, 0), 0);
        if (got != want[s])
            fail_msg("%s O%d: step %d loss %.9g, eager %.9g", preset, level, s, got, want[s]);
    }
    same_params(&ref, &m);
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    model_free(&m);
    model_free(&ref);
    kpl_pool_pop(pool);
}

static void test_lenet_steps(void **state)
{
    (void)state;
    int64_t img[3] = {1, 28, 28};
    for (int level = 0; level <= 3; level++) compare("lenet", 10, img, 16, 20, level, level == 1);
}

static void test_resnet_steps(void **state)
{
    (void)state;
    int64_t img[3] = {3, 32, 32};
    compare("resnet18_cifar", 10, img, 4, 6, 3, false);
    compare("resnet18_cifar", 10, img, 4, 4, 2, true);
}

/* What a traced step cannot hold fails the trace, naming it. */
static void test_refusals(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    int64_t img[3] = {1, 28, 28};
    kpl_tensor *xs[1], *ys[1];
    batches(1, 4, img, 10, xs, ys);
    /* SGD's first step makes the momenta: a different computation */
    model m;
    model_init(&m, "lenet", 10, false);
    OK(kpl_trace_begin());
    kpl_tensor *loss = step(&m, NN(kpl_trace_input(xs[0], "image")), ys[0]);
    kpl_ir *ir = NULL;
    FAILS(kpl_trace_end(1, &loss, NULL, &ir), KPL_EINVAL, "no momentum buffer yet");
    assert_null(ir);
    model_free(&m);
    /* Adam keeps its step count on the host */
    kpl_model_config c;
    OK(kpl_zoo_preset("lenet", 10, &c));
    OK(kpl_zoo_create(&c, kpl_device_cpu(), 7, &m.net));
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    snprintf(oc.name, sizeof oc.name, "adam");
    OK(kpl_optim_create(&oc, kpl_module_num_params(m.net), kpl_module_params(m.net), NULL, &m.opt));
    NN(step(&m, xs[0], ys[0]));
    OK(kpl_trace_begin());
    loss = step(&m, NN(kpl_trace_input(xs[0], "image")), ys[0]);
    FAILS(kpl_trace_end(1, &loss, NULL, &ir), KPL_EINVAL, "rule 'adam'");
    model_free(&m);
    /* a traced step is not a model file */
    model_init(&m, "lenet", 10, false);
    NN(step(&m, xs[0], ys[0]));
    OK(kpl_trace_begin());
    kpl_tensor *x = NN(kpl_trace_input(xs[0], "image"));
    kpl_tensor *y = NN(kpl_trace_input(ys[0], "label"));
    loss = step(&m, x, y);
    OK(kpl_trace_end(1, &loss, NULL, &ir));
    FAILS(kpl_model_save(ir, NULL, "/tmp/kpl-test-never.kplm"), KPL_EINVAL, "training step");
    FAILS(kpl_onnx_export(ir, "/tmp/kpl-test-never.onnx"), KPL_EINVAL, "training step");
    kpl_ir_destroy(ir);
    model_free(&m);
    kpl_pool_pop(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lenet_steps),
        cmocka_unit_test(test_resnet_steps),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
