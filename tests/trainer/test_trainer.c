/* test_trainer.c — the model zoo and SGD: parameter counts against
 * PyTorch's, shapes and finite gradients through the ResNets, a LeNet that
 * learns a synthetic task, a steady-state step that creates no primitive,
 * and SGD's update rule by hand (test_optim.c checks every optimizer
 * against PyTorch). */
#include "kpl_test.h"
#include "trainer.h"

static kpl_module *make(const char *name, int64_t classes)
{
    kpl_model_config c;
    OK(kpl_zoo_preset(name, classes, &c));
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&c, kpl_device_cpu(), 7, &m));
    return m;
}

/* The model's output for x in training or evaluation mode. */
static kpl_tensor *fwd(kpl_module *m, kpl_tensor *x, bool training)
{
    kpl_module_set_training(m, training);
    return kpl_module_forward(m, x);
}

/* Parameter counts printed by ../shared/baselines (torchvision layouts). */
static void test_zoo_parameter_counts(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        int64_t classes, params;
        int tensors;
    } want[] = {
        {"mlp", 10, 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10, 6},
        {"lenet", 10, 61706, 10},
        {"resnet18_cifar", 10, 11173962, 62},
        {"resnet50", 1000, 25557032, 161},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        kpl_module *m = make(want[i].name, want[i].classes);
        assert_int_equal(kpl_module_param_count(m), want[i].params);
        assert_int_equal(kpl_module_num_params(m), want[i].tensors);
        kpl_module_destroy(m);
    }
    kpl_model_config c;
    FAILS(kpl_zoo_preset("resnet51", 10, &c), KPL_EINVAL,
          "unknown preset 'resnet51' (known: mlp, lenet");
    FAILS(kpl_zoo_preset("lenet", 0, &c), KPL_EINVAL, "num_classes > 0");
    /* FLOPs: LeNet forward = 2 x (conv1 6*25*784 + conv2 16*150*100 + fc 48120+10164+850) */
    kpl_module *m = make("lenet", 10);
    int64_t chw[3] = {1, 28, 28};
    double flops = 0;
    OK(kpl_module_count_flops(m, 3, chw, false, &flops));
    assert_float_equal(flops, 2.0 * (6 * 25 * 784 + 16 * 150 * 100 + 400 * 120 + 120 * 84 + 84 * 10),
                       0);
    kpl_module_destroy(m);
}

static void sgd_step(kpl_module *m, kpl_optim *opt, kpl_tensor *x, kpl_tensor *y, double *loss)
{
    kpl_pool *p = NN(kpl_pool_push());
    kpl_tensor *l = NN(kpl_cross_entropy(fwd(m, x, true), y, KPL_REDUCE_MEAN, 0, -100));
    OK(kpl_backward(l, NULL, false));
    *loss = tget(l, 0);
    OK(kpl_optim_step(opt));
    kpl_pool_pop(p);
}

/* LeNet-5 on a synthetic task: images are class prototypes plus noise. */
static void test_lenet_learns_and_steady_state(void **state)
{
    (void)state;
    kpl_module *m = make("lenet", 10);
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    oc.lr = 0.03;
    oc.momentum = 0.9;
    kpl_optim *opt = NULL;
    OK(kpl_optim_create(&oc, kpl_module_num_params(m), kpl_module_params(m), NULL, &opt));
    kpl_device *cpu = kpl_device_cpu();
    kpl_rng *data = kpl_rng_create(2);
    int64_t ps[4] = {10, 1, 28, 28}, xs[4] = {32, 1, 28, 28}, B = 32;
    kpl_tensor *proto = NULL, *x = NULL, *lab = NULL;
    OK(kpl_tensor_empty(cpu, KPL_F32, 4, ps, &proto));
    OK(kpl_k_normal(proto, data, 0, 1));
    OK(kpl_tensor_empty(cpu, KPL_F32, 4, xs, &x));
    OK(kpl_tensor_empty(cpu, KPL_I64, 1, &B, &lab));
    double first = 0, last = 0, tail = 0; /* tail: mean loss of the last 10 steps */
    kpl_algo_cache_stats before = {0, 0, 0};
    for (int step = 0; step < 100; step++) {
        OK(kpl_k_normal(x, data, 0, 1));
        int64_t *lv = kpl_tensor_host_mutable(lab);
        float *xv = kpl_tensor_host_mutable(x);
        const float *pv = kpl_tensor_host_data(proto);
        for (int64_t i = 0; i < B; i++) {
            lv[i] = (i * 3 + step) % 10;
            for (int64_t k = 0; k < 784; k++) xv[i * 784 + k] = 0.7f * xv[i * 784 + k] + pv[lv[i] * 784 + k];
        }
        if (step == 2) before = kpl_algo_cache_stats_get(KPL_DEVICE_CPU);
        sgd_step(m, opt, x, lab, step == 0 ? &first : &last);
        if (step >= 90) tail += last / 10;
        if (step == 2) { /* a steady-state step builds no primitive */
            kpl_algo_cache_stats after = kpl_algo_cache_stats_get(KPL_DEVICE_CPU);
            assert_int_equal(after.misses, before.misses);
            assert_true(after.hits > before.hits);
        }
    }
    print_message("LeNet-5 loss %.4f -> %.4f (mean of the last 10 steps)\n", first, tail);
    assert_true(first > 2.0);
    assert_true(tail < 0.1);
    kpl_tensor_release(proto);
    kpl_tensor_release(x);
    kpl_tensor_release(lab);
    kpl_rng_destroy(data);
    kpl_optim_destroy(opt);
    kpl_module_destroy(m);
}

static void test_resnet18_forward_backward(void **state)
{
    (void)state;
    kpl_module *m = make("resnet18_cifar", 10);
    kpl_pool *p = NN(kpl_pool_push());
    kpl_rng *rng = kpl_rng_create(3);
    int64_t xs[4] = {2, 3, 32, 32}, ls = 2;
    kpl_tensor *x = NN(kpl_randn(kpl_device_cpu(), KPL_F32, 4, xs, rng, 0, 1));
    kpl_tensor *logits = NN(fwd(m, x, true));
    assert_int_equal(kpl_tensor_ndim(logits), 2);
    assert_int_equal(kpl_tensor_shape(logits)[0], 2);
    assert_int_equal(kpl_tensor_shape(logits)[1], 10);
    kpl_tensor *lab = NN(kpl_full(kpl_device_cpu(), KPL_I64, 1, &ls, 3));
    kpl_tensor *loss = NN(kpl_cross_entropy(logits, lab, KPL_REDUCE_MEAN, 0, -100));
    OK(kpl_backward(loss, NULL, false));
    assert_true(isfinite(tget(loss, 0)));
    /* every parameter got a gradient of its own shape, all finite */
    kpl_tensor *const *ps = kpl_module_params(m);
    for (int i = 0; i < kpl_module_num_params(m); i++) {
        kpl_tensor *g = kpl_grad_get(ps[i]);
        assert_non_null(g);
        assert_int_equal(kpl_tensor_numel(g), kpl_tensor_numel(ps[i]));
        assert_true(isfinite(tget(NN(kpl_max(NN(kpl_abs(g)), NULL, 0, false)), 0)));
    }
    /* eval mode uses the running statistics: a different, finite answer */
    kpl_tensor *ev = NN(fwd(m, x, false));
    assert_true(isfinite(tget(ev, 0)));
    assert_true(fabs(tget(ev, 0) - tget(logits, 0)) > 1e-6);
    /* a wrong input channel count names the layer and the shapes */
    int64_t bad[4] = {2, 4, 32, 32};
    assert_null(fwd(m, NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, bad, 0)), true));
    assert_non_null(strstr(kpl_last_error(), "module conv1 (conv2d): conv2d: input (2,4,32,32) has "
                                             "4 channels but weights (64,3,3,3) expect 3"));
    kpl_rng_destroy(rng);
    kpl_pool_pop(p);
    kpl_module_destroy(m);
}

/* v = momentum v + g (v = g at the first step); p -= lr v.  Nesterov steps
 * by g + momentum v; weight decay adds wd p to g. */
static void test_sgd_by_hand(void **state)
{
    (void)state;
    int64_t one = 1;
    kpl_tensor *p[3];
    for (int i = 0; i < 3; i++) {
        OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F64, 1, &one, &p[i]));
        OK(kpl_k_fill(p[i], 1));
        OK(kpl_set_requires_grad(p[i], true));
    }
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT; /* sgd, lr 0.1 */
    kpl_optim *all[3] = {NULL, NULL, NULL};
    oc.momentum = 0.9;
    OK(kpl_optim_create(&oc, 1, &p[0], NULL, &all[0]));
    oc.nesterov = true;
    OK(kpl_optim_create(&oc, 1, &p[1], NULL, &all[1]));
    oc.momentum = 0;
    oc.nesterov = false;
    oc.weight_decay = 0.5;
    OK(kpl_optim_create(&oc, 1, &p[2], NULL, &all[2]));
    for (int step = 0; step < 2; step++) {
        kpl_pool *pool = NN(kpl_pool_push());
        for (int i = 0; i < 3; i++) {
            kpl_grad_set(p[i], NN(kpl_full(kpl_device_cpu(), KPL_F64, 1, &one, 0.5)));
            OK(kpl_optim_step(all[i]));
            assert_null(kpl_grad_get(p[i]));
        }
        kpl_pool_pop(pool);
    }
    /* plain: v1 = .5, p = .95; v2 = .95, p = .855 */
    assert_float_equal(tget(p[0], 0), 0.855, 1e-12);
    /* nesterov: v1 = .5, p = 1 - .1 (.5 + .45) = .905; v2 = .95, p -= .1 (.5 + .855) */
    assert_float_equal(tget(p[1], 0), 0.905 - 0.1355, 1e-12);
    /* wd, no momentum: p = 1 - .1 (.5 + .5) = .9; p = .9 - .1 (.5 + .45) = .805 */
    assert_float_equal(tget(p[2], 0), 0.805, 1e-12);
    for (int i = 0; i < 3; i++) {
        kpl_optim_destroy(all[i]);
        kpl_tensor_release(p[i]);
    }
}

/* Models from a recipe's model section: torchvision's parameter counts
 * and names, the small CNN, widths, inputs of other sizes, and the
 * errors. */
static void test_zoo_configs(void **state)
{
    (void)state;
    static const struct {
        const char *arch;
        int64_t depth, width, c, h, classes, params;
        bool cifar;
        int tensors;
    } want[] = {
        /* torchvision resnet34 / resnet101 / resnet152 (1000 classes) */
        {"resnet", 34, 0, 3, 224, 1000, 21797672, false, 110},
        {"resnet", 101, 0, 3, 224, 1000, 44549160, false, 314},
        {"resnet", 152, 0, 3, 224, 1000, 60192808, false, 467},
        /* ResNet-18, CIFAR stem, 1 input channel, half width: 2.8M */
        {"resnet", 18, 32, 1, 28, 10, 2797034, true, 62},
        /* cnn: conv 3x3 1->32 (no bias) + BN, conv 32->64 + BN, 3136 -> 128 -> 10 */
        {"cnn", 0, 0, 1, 28, 10, 288 + 64 + 18432 + 128 + 3136 * 128 + 128 + 1290, false, 10},
        /* lenet on 3x32x32 (CIFAR's LeNet): conv1 3->6, flatten 16x6x6 */
        {"lenet", 0, 0, 3, 32, 10, 456 + 2416 + 576 * 120 + 120 + 10164 + 850, false, 10},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        kpl_model_config c;
        memset(&c, 0, sizeof c);
        snprintf(c.name, sizeof c.name, "%s", want[i].arch);
        c.depth = want[i].depth, c.width = want[i].width;
        c.in_channels = want[i].c, c.in_h = c.in_w = want[i].h;
        c.num_classes = want[i].classes, c.stem = want[i].cifar ? KPL_STEM_CIFAR : KPL_STEM_IMAGENET;
        kpl_module *m = NULL;
        OK(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m));
        if (kpl_module_param_count(m) != want[i].params)
            fail_msg("case %zu (%s): %lld parameters, expected %lld", i, c.name,
                     (long long)kpl_module_param_count(m), (long long)want[i].params);
        assert_int_equal(kpl_module_num_params(m), want[i].tensors);
        kpl_module_set_training(m, false);
        if (want[i].h > 32) { /* the small inputs run through: the classes come out */
            kpl_module_destroy(m);
            continue;
        }
        kpl_pool *p = NN(kpl_pool_push());
        int64_t xs[4] = {1, want[i].c, want[i].h, want[i].h};
        kpl_tensor *y = NN(kpl_module_forward(m, NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, xs, 0))));
        assert_int_equal(kpl_tensor_shape(y)[1], want[i].classes);
        kpl_pool_pop(p);
        kpl_module_destroy(m);
    }
    /* torchvision's names, and which parameters skip weight decay */
    kpl_model_config c;
    memset(&c, 0, sizeof c);
    snprintf(c.name, sizeof c.name, "resnet");
    c.depth = 50, c.in_channels = 3, c.in_h = c.in_w = 64;
    c.num_classes = 5, c.zero_init_residual = true;
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m));
    assert_string_equal(kpl_module_param_name(m, 0), "conv1.weight");
    assert_string_equal(kpl_module_param_name(m, 1), "bn1.weight");
    assert_string_equal(kpl_module_buffer_name(m, 0), "bn1.running_mean");
    assert_string_equal(kpl_module_param_name(m, 3), "layer1.0.conv1.weight");
    bool down = false, zero = false;
    for (int i = 0; i < kpl_module_num_params(m); i++) {
        const char *n = kpl_module_param_name(m, i);
        down |= !strcmp(n, "layer2.0.downsample.0.weight");
        /* the 1-d tensors optimizer.no_decay_bn_bias exempts: biases and norms' scales/shifts */
        size_t len = strlen(n);
        bool bn = strstr(n, "bn") || strstr(n, "downsample.1.");
        assert_int_equal(kpl_tensor_ndim(kpl_module_params(m)[i]) == 1,
                         (len > 5 && !strcmp(n + len - 5, ".bias")) || bn);
        if (!strcmp(n, "layer3.5.bn3.weight")) zero = tget(kpl_module_params(m)[i], 0) == 0;
    }
    assert_true(down && zero); /* zero_init_residual: the blocks' last BN scale */
    assert_string_equal(kpl_module_param_name(m, kpl_module_num_params(m) - 1), "fc.bias");
    kpl_module_destroy(m);
    /* errors name the architecture and the input */
    c.in_h = c.in_w = 16;
    FAILS(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m), KPL_EINVAL,
          "model resnet: input 16x16 is too small for the imagenet stem");
    c.depth = 20, c.in_h = c.in_w = 64;
    FAILS(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m), KPL_EINVAL, "depth is 18, 34");
    snprintf(c.name, sizeof c.name, "cnn");
    c.depth = 6, c.in_h = c.in_w = 28;
    FAILS(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m), KPL_EINVAL,
          "model cnn: 6 stages halve 28x28 to nothing");
    snprintf(c.name, sizeof c.name, "mlp");
    c.dropout = 1.5;
    FAILS(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m), KPL_EINVAL, "dropout 1.5");
    assert_null(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zoo_parameter_counts),
        cmocka_unit_test(test_zoo_configs),
        cmocka_unit_test(test_sgd_by_hand),
        cmocka_unit_test(test_lenet_learns_and_steady_state),
        cmocka_unit_test(test_resnet18_forward_backward),
    };
    return cmocka_run_group_tests_name("trainer", tests, NULL, NULL);
}
