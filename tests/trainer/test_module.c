/* test_module.c — the module system: layers against hand-computed values
 * and PyTorch's initialisation bounds, torchvision's state-dict names,
 * freezing, a module with several outputs (an FPN), errors that name the
 * module's path, and loading part of a state dict with its report. */
#include "kpl_test.h"
#include "trainer.h"

int run_module_recompute_tests(void);

static kpl_tensor *from(int ndim, const int64_t *shape, const float *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, ndim, shape, v, &t));
    return kpl_autorelease(t);
}

static void set(kpl_tensor *t, const float *v)
{
    float *d = kpl_tensor_host_mutable(t);
    memcpy(d, v, (size_t)kpl_tensor_numel(t) * sizeof *d);
}

static void expect(kpl_tensor *t, const float *want, int64_t n, const char *what)
{
    assert_int_equal(kpl_tensor_numel(t), n);
    for (int64_t i = 0; i < n; i++) assert_close(tget(t, i), want[i], 1e-6, 1e-6, what, i);
}

/* max |x| and the standard deviation of a tensor's elements */
static void spread(kpl_tensor *t, double *maxabs, double *std)
{
    double s = 0, s2 = 0, mx = 0;
    int64_t n = kpl_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        double v = tget(t, i);
        s += v, s2 += v * v;
        if (fabs(v) > mx) mx = fabs(v);
    }
    *maxabs = mx;
    *std = sqrt(s2 / (double)n - (s / (double)n) * (s / (double)n));
}

static void test_layers_by_hand(void **state)
{
    (void)state;
    kpl_module *net = NULL, *lin = NULL, *conv = NULL, *act = NULL, *up = NULL, *res = NULL;
    OK(kpl_nn_sequential_root(NULL, 1, &net));
    kpl_pool *p = NN(kpl_pool_push());
    /* linear: y = x W^T + b */
    OK(kpl_nn_linear(net, "lin", 2, 3, true, &lin));
    set(kpl_module_get_param(lin, "weight"), (float[]){1, 2, 3, 4, 5, 6});
    set(kpl_module_get_param(lin, "bias"), (float[]){0.5f, -1, 2});
    kpl_tensor *y = NN(kpl_module_forward(lin, from(2, (int64_t[]){2, 2}, (float[]){1, 1, 0, -1})));
    expect(y, (float[]){3.5f, 6, 13, -1.5f, -5, -4}, 6, "linear");
    /* conv 2x2 of ones over 1..9, bias 1: the window sums plus 1 */
    kpl_nn_conv cc = {KPL_NN_CONV_INIT(1, 1, 2)};
    OK(kpl_nn_conv2d(net, "conv", &cc, &conv));
    set(kpl_module_get_param(conv, "weight"), (float[]){1, 1, 1, 1});
    set(kpl_module_get_param(conv, "bias"), (float[]){1});
    float img[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    kpl_tensor *x9 = from(4, (int64_t[]){1, 1, 3, 3}, img);
    expect(NN(kpl_module_forward(conv, x9)), (float[]){13, 17, 25, 29}, 4, "conv");
    /* silu(1) = 1 / (1 + e^-1); leaky relu slope 0.1 */
    OK(kpl_nn_activation(net, "silu", KPL_NN_SILU, 0, &act));
    expect(NN(kpl_module_forward(act, from(1, (int64_t[]){2}, (float[]){1, -2}))),
           (float[]){0.7310585786f, -2 / (1 + expf(2))}, 2, "silu");
    OK(kpl_nn_activation(net, "leaky", KPL_NN_LEAKY_RELU, 0.1, &act));
    expect(NN(kpl_module_forward(act, from(1, (int64_t[]){2}, (float[]){3, -2}))),
           (float[]){3, -0.2f}, 2, "leaky_relu");
    /* nearest upsampling repeats each pixel 2x2 */
    OK(kpl_nn_upsample(net, "up", 2, false, &up));
    expect(NN(kpl_module_forward(up, from(4, (int64_t[]){1, 1, 1, 2}, (float[]){1, 2}))),
           (float[]){1, 1, 2, 2, 1, 1, 2, 2}, 8, "upsample");
    /* residual: relu(body(x) + x) with body = linear 2->2 */
    OK(kpl_nn_residual(net, "res", true, &res));
    kpl_module *body = NULL;
    OK(kpl_nn_linear(res, "body", 2, 2, false, &body));
    set(kpl_module_get_param(body, "weight"), (float[]){1, 0, 0, -3});
    expect(NN(kpl_module_forward(res, from(2, (int64_t[]){1, 2}, (float[]){2, 1}))),
           (float[]){4, 0}, 2, "residual"); /* (2 + 2, relu(-3 + 1)) */
    /* embedding rows */
    kpl_module *emb = NULL;
    OK(kpl_nn_embedding(net, "emb", 4, 3, &emb));
    kpl_tensor *ids = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, (int64_t[]){2}, (int64_t[]){3, 0}, &ids));
    kpl_tensor *e = NN(kpl_module_forward(emb, kpl_autorelease(ids)));
    kpl_tensor *w = kpl_module_get_param(emb, "weight");
    for (int k = 0; k < 3; k++) {
        assert_close(tget(e, k), tget(w, 9 + k), 0, 0, "embedding", k);
        assert_close(tget(e, 3 + k), tget(w, k), 0, 0, "embedding", 3 + k);
    }
    kpl_pool_pop(p);
    kpl_module_destroy(net);
}

/* A sequential's batch norm followed by a ReLU runs as the fused op in
 * training, with the values, running statistics and gradients of the two
 * ops; eval and kpl_nn_forward_relu of another kind compose them. */
/* A sequential frees each intermediate once the next child has run,
 * unless the graph keeps it: after linear -> leaky ReLU -> linear on a
 * batch that takes a gradient, only the leaky ReLU's output (kept by its
 * gradient and the second linear's) and the result stay allocated, not
 * the first linear's output nor the children's temporaries (the matmul
 * before its bias), which a module alone frees too; the values are the
 * children's run one by one. */
static void test_sequential_frees_intermediates(void **state)
{
    (void)state;
    kpl_module *net = NULL, *l1 = NULL, *l2 = NULL;
    OK(kpl_nn_sequential_root(NULL, 2, &net));
    OK(kpl_nn_linear(net, "l1", 64, 64, true, &l1));
    OK(kpl_nn_activation(net, "act", KPL_NN_LEAKY_RELU, 0.2, NULL));
    OK(kpl_nn_linear(net, "l2", 64, 64, true, &l2));
    kpl_pool *p = NN(kpl_pool_push());
    int64_t xs[2] = {256, 64}; /* 64 KiB a tensor: whole allocator blocks */
    kpl_tensor *x = NN(kpl_reshape(
        kpl_arange(kpl_device_cpu(), KPL_F32, xs[0] * xs[1], -1, 1.0 / 8192), 2, xs));
    OK(kpl_set_requires_grad(x, true));
    kpl_memory_stats s0 = kpl_device_memory_stats(kpl_device_cpu());
    kpl_tensor *y = NN(kpl_module_forward(net, x));
    kpl_memory_stats s1 = kpl_device_memory_stats(kpl_device_cpu());
    assert_int_equal(s1.allocated - s0.allocated, 2 * 256 * 64 * 4);
    /* a module alone: its temporaries (the product before the bias) go
     * when it ends, its output stays in the caller's pool */
    kpl_memory_stats s2 = kpl_device_memory_stats(kpl_device_cpu());
    kpl_tensor *h = NN(kpl_module_forward(l1, x));
    assert_int_equal(kpl_device_memory_stats(kpl_device_cpu()).allocated - s2.allocated,
                     256 * 64 * 4);
    kpl_tensor *ref = NN(kpl_module_forward(l2, kpl_leaky_relu(h, 0.2)));
    float a[256 * 64], b[256 * 64];
    OK(kpl_tensor_to_host(y, a, sizeof a));
    OK(kpl_tensor_to_host(ref, b, sizeof b));
    assert_memory_equal(a, b, sizeof a);
    OK(kpl_backward(kpl_sum(y, NULL, 0, false), NULL, false));
    assert_non_null(kpl_grad_get(x));
    kpl_pool_pop(p);
    kpl_module_destroy(net);
}

static void test_batch_norm_relu_fused(void **state)
{
    (void)state;
    kpl_module *net = NULL, *bn = NULL, *lin = NULL;
    OK(kpl_nn_sequential_root(NULL, 3, &net));
    OK(kpl_nn_batch_norm(net, "bn", 3, 0.1, 1e-5, &bn));
    OK(kpl_nn_relu(net, "relu", NULL));
    OK(kpl_nn_flatten(net, "flat", NULL));
    OK(kpl_nn_linear(net, "fc", 3 * 4, 2, true, &lin));
    OK(kpl_k_fill(kpl_module_get_param(bn, "bias"), 0.25));
    kpl_pool *p = NN(kpl_pool_push());
    kpl_rng *rng = kpl_rng_create(17);
    kpl_tensor *x = NN(kpl_randn(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){5, 3, 2, 2}, rng, 1, 2));
    kpl_tensor *g = kpl_module_get_param(bn, "weight"), *b = kpl_module_get_param(bn, "bias");
    kpl_tensor *rm = kpl_module_get_buffer(bn, "running_mean");
    kpl_tensor *rv = kpl_module_get_buffer(bn, "running_var");
    kpl_tensor *rm0 = NN(kpl_to_device(rm, kpl_device_cpu()));
    kpl_tensor *rv0 = NN(kpl_to_device(rv, kpl_device_cpu()));
    kpl_tensor *y = NN(kpl_nn_forward_relu(bn, x));
    assert_int_equal(kpl_node_op(kpl_tensor_node(y, NULL)), KPL_OP_BATCH_NORM_RELU);
    kpl_tensor *want = NN(kpl_relu(NN(kpl_batch_norm(x, g, b, rm0, rv0, true, 0.1, 1e-5))));
    int64_t zeros = 0;
    for (int64_t i = 0; i < kpl_tensor_numel(y); i++) {
        assert_true(tget(y, i) == tget(want, i));
        zeros += tget(y, i) == 0;
    }
    assert_true(zeros > 10 && zeros < 50);
    for (int c = 0; c < 3; c++) {
        assert_true(tget(rm, c) == tget(rm0, c));
        assert_true(tget(rv, c) == tget(rv0, c));
    }
    /* through the sequential: the same gradients as the composed ops */
    kpl_tensor *loss = NN(kpl_sum(NN(kpl_module_forward(net, x)), NULL, 0, false));
    kpl_tensor *gf[2], *gc[2], *ps[2] = {g, b};
    OK(kpl_grad(loss, NULL, 2, ps, false, gf));
    kpl_tensor *h = NN(kpl_relu(NN(kpl_batch_norm(x, g, b, NULL, NULL, true, 0.1, 1e-5))));
    h = NN(kpl_reshape(h, 2, (int64_t[]){5, 12}));
    kpl_tensor *lc = NN(kpl_sum(NN(kpl_module_forward(lin, h)), NULL, 0, false));
    OK(kpl_grad(lc, NULL, 2, ps, false, gc));
    assert_true(tget(loss, 0) == tget(lc, 0));
    for (int i = 0; i < 2; i++)
        for (int c = 0; c < 3; c++) assert_true(tget(gf[i], c) == tget(gc[i], c));
    /* eval: relu((x - running_mean) / sqrt(running_var + eps) gamma + beta) */
    kpl_module_set_training(net, false);
    y = NN(kpl_nn_forward_relu(bn, x));
    for (int64_t i = 0; i < kpl_tensor_numel(y); i++) {
        int64_t c = i / 4 % 3;
        double v = (tget(x, i) - tget(rm, c)) / sqrt(tget(rv, c) + 1e-5) * tget(g, c) + tget(b, c);
        assert_close(tget(y, i), v > 0 ? v : 0, 1e-5, 1e-6, "bn relu eval", i);
    }
    /* another kind: relu after its forward */
    kpl_tensor *xl = NN(kpl_reshape(x, 2, (int64_t[]){5, 12}));
    kpl_tensor *yl = NN(kpl_nn_forward_relu(lin, xl));
    kpl_tensor *wl = NN(kpl_relu(NN(kpl_module_forward(lin, xl))));
    for (int64_t i = 0; i < 10; i++) assert_true(tget(yl, i) == tget(wl, i));
    kpl_rng_destroy(rng);
    kpl_pool_pop(p);
    kpl_module_destroy(net);
}

/* A sequential's convolution followed by a ReLU runs as conv2d_relu,
 * with the two ops' values and gradients (within f32 rounding: the fused
 * problem may get another kernel). */
static void test_conv_relu_fused(void **state)
{
    (void)state;
    kpl_module *net = NULL, *conv = NULL;
    OK(kpl_nn_sequential_root(NULL, 4, &net));
    kpl_nn_conv c = {KPL_NN_CONV_INIT(3, 8, 3), .padding = {1, 1}};
    OK(kpl_nn_conv2d(net, "conv", &c, &conv));
    OK(kpl_nn_relu(net, "relu", NULL));
    kpl_pool *p = NN(kpl_pool_push());
    kpl_rng *rng = kpl_rng_create(19);
    kpl_tensor *x = NN(kpl_randn(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){2, 3, 6, 6}, rng, 0, 1));
    kpl_tensor *w = kpl_module_get_param(conv, "weight"), *b = kpl_module_get_param(conv, "bias");
    kpl_tensor *y = NN(kpl_module_forward(net, x));
    assert_int_equal(kpl_node_op(kpl_tensor_node(y, NULL)), KPL_OP_CONV2D_RELU);
    kpl_conv2d_params cp = {{1, 1}, {1, 1}, {1, 1}, 1};
    kpl_tensor *want = NN(kpl_relu(NN(kpl_conv2d(x, w, b, &cp))));
    int64_t zeros = 0, n = kpl_tensor_numel(y);
    for (int64_t i = 0; i < n; i++) {
        assert_close(tget(y, i), tget(want, i), 1e-5, 1e-5, "conv relu", i);
        zeros += tget(y, i) == 0;
    }
    assert_true(zeros > n / 5 && zeros < n - n / 5);
    kpl_tensor *ps[2] = {w, b}, *gf[2], *gc[2];
    OK(kpl_grad(NN(kpl_sum(NN(kpl_square(y)), NULL, 0, false)), NULL, 2, ps, false, gf));
    OK(kpl_grad(NN(kpl_sum(NN(kpl_square(want)), NULL, 0, false)), NULL, 2, ps, false, gc));
    for (int i = 0; i < 2; i++)
        for (int64_t j = 0; j < kpl_tensor_numel(gf[i]); j++)
            assert_close(tget(gf[i], j), tget(gc[i], j), 1e-4, 1e-4, "conv relu grad", j);
    assert_null(kpl_nn_forward_relu(NULL, x));
    assert_int_equal(kpl_last_status(), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "forward_relu: no module"));
    kpl_clear_error();
    /* kpl_nn_forward_relu on the convolution alone: the same op */
    kpl_tensor *y2 = NN(kpl_nn_forward_relu(conv, x));
    assert_int_equal(kpl_node_op(kpl_tensor_node(y2, NULL)), KPL_OP_CONV2D_RELU);
    for (int64_t i = 0; i < n; i++) assert_true(tget(y2, i) == tget(y, i));
    kpl_rng_destroy(rng);
    kpl_pool_pop(p);
    kpl_module_destroy(net);
}

static void test_batch_norm_and_dropout_modes(void **state)
{
    (void)state;
    kpl_module *net = NULL, *bn = NULL, *drop = NULL;
    OK(kpl_nn_sequential_root(NULL, 3, &net));
    OK(kpl_nn_batch_norm(net, "bn", 2, 0.1, 1e-5, &bn));
    OK(kpl_nn_dropout(net, "drop", 0.25, &drop));
    kpl_pool *p = NN(kpl_pool_push());
    /* channel 0 holds 1 and 3 (mean 2, unbiased var 2), channel 1 holds 0 and 0 */
    kpl_tensor *x = from(4, (int64_t[]){2, 2, 1, 1}, (float[]){1, 0, 3, 0});
    kpl_tensor *y = NN(kpl_module_forward(bn, x));
    assert_close(tget(y, 0), -1 / sqrt(1 + 1e-5), 1e-5, 0, "bn train", 0);
    kpl_tensor *rm = kpl_module_get_buffer(bn, "running_mean");
    kpl_tensor *rv = kpl_module_get_buffer(bn, "running_var");
    assert_close(tget(rm, 0), 0.2, 1e-6, 0, "running_mean", 0);
    assert_close(tget(rv, 0), 0.9 + 0.1 * 2, 1e-6, 0, "running_var", 0);
    /* eval: (x - 0.2) / sqrt(1.1 + eps), nothing moves */
    kpl_module_set_training(net, false);
    assert_false(kpl_module_training(bn));
    y = NN(kpl_module_forward(bn, x));
    assert_close(tget(y, 0), (1 - 0.2) / sqrt(1.1 + 1e-5), 1e-5, 0, "bn eval", 0);
    assert_close(tget(rm, 0), 0.2, 1e-6, 0, "running_mean after eval", 0);
    /* dropout: identity in eval; in training about a quarter zeroed, the rest x 4/3 */
    int64_t n = 4000;
    kpl_tensor *ones = NN(kpl_full(kpl_device_cpu(), KPL_F32, 1, &n, 1));
    kpl_tensor *d = NN(kpl_module_forward(drop, ones));
    for (int64_t i = 0; i < n; i += 97) assert_close(tget(d, i), 1, 0, 0, "dropout eval", i);
    kpl_module_set_training(net, true);
    d = NN(kpl_module_forward(drop, ones));
    int64_t zeros = 0;
    for (int64_t i = 0; i < n; i++) {
        double v = tget(d, i);
        if (v == 0) zeros++;
        else assert_close(v, 4.0 / 3.0, 1e-6, 0, "dropout scale", i);
    }
    assert_true(zeros > 900 && zeros < 1100);
    kpl_pool_pop(p);
    kpl_module_destroy(net);
}

/* PyTorch's initialisation: U(+-1/sqrt(fan_in)), fan_in of a transposed
 * conv from weight.size(1); Kaiming normal fan-out for ResNet convs. */
static void test_initialisation(void **state)
{
    (void)state;
    kpl_module *net = NULL, *m = NULL;
    OK(kpl_nn_sequential_root(NULL, 5, &net));
    double mx, sd;
    OK(kpl_nn_linear(net, "lin", 50, 40, true, &m));
    spread(kpl_module_get_param(m, "weight"), &mx, &sd);
    double bound = 1 / sqrt(50.0);
    assert_true(mx <= bound && mx > 0.95 * bound);
    assert_close(sd, bound / sqrt(3.0), 0.08, 0, "linear weight std", 0);
    spread(kpl_module_get_param(m, "bias"), &mx, &sd);
    assert_true(mx <= bound);
    kpl_nn_conv t = {KPL_NN_CONV_INIT(4, 6, 3), .groups = 2, .stride = {2, 2}};
    OK(kpl_nn_conv_transpose2d(net, "up", &t, &m));
    kpl_tensor *w = kpl_module_get_param(m, "weight");
    assert_int_equal(kpl_tensor_shape(w)[0], 4); /* (in, out/groups, kh, kw) */
    assert_int_equal(kpl_tensor_shape(w)[1], 3);
    spread(w, &mx, &sd);
    bound = 1 / sqrt(3.0 * 9);
    assert_true(mx <= bound && mx > 0.9 * bound);
    kpl_nn_conv k = {KPL_NN_CONV_INIT(16, 32, 3), .no_bias = true, .init = KPL_NN_INIT_KAIMING_OUT};
    OK(kpl_nn_conv2d(net, "k", &k, &m));
    assert_null(kpl_module_get_param(m, "bias"));
    spread(kpl_module_get_param(m, "weight"), &mx, &sd);
    assert_close(sd, sqrt(2.0 / (32 * 9)), 0.05, 0, "kaiming std", 0);
    /* one seed, one model */
    kpl_module *again = NULL;
    OK(kpl_nn_sequential_root(NULL, 5, &again));
    OK(kpl_nn_linear(again, "lin", 50, 40, true, &m));
    assert_close(tget(kpl_module_get_param(m, "weight"), 17),
                 tget(kpl_module_params(net)[0], 17), 0, 0, "same seed", 17);
    kpl_module_destroy(again);
    kpl_module_destroy(net);
}

/* torchvision.models.resnet18().named_parameters(), in order */
static const char *resnet18_names(int i, char *buf, size_t size)
{
    static const char *const block[6] = {"conv1.weight", "bn1.weight", "bn1.bias",
                                         "conv2.weight", "bn2.weight", "bn2.bias"};
    static const char *const down[3] = {"downsample.0.weight", "downsample.1.weight",
                                        "downsample.1.bias"};
    static const char *const stem[3] = {"conv1.weight", "bn1.weight", "bn1.bias"};
    if (i < 3) return stem[i];
    i -= 3;
    for (int s = 1; s <= 4; s++)
        for (int b = 0; b < 2; b++) {
            int n = (s > 1 && b == 0) ? 9 : 6;
            if (i < n) {
                snprintf(buf, size, "layer%d.%d.%s", s, b, i < 6 ? block[i] : down[i - 6]);
                return buf;
            }
            i -= n;
        }
    return i == 0 ? "fc.weight" : i == 1 ? "fc.bias" : "?";
}

static void test_state_dict_names(void **state)
{
    (void)state;
    kpl_model_config c = {.name = "resnet", .num_classes = 1000, .in_channels = 3,
                          .in_h = 224, .in_w = 224, .depth = 18};
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&c, NULL, 1, &m));
    assert_int_equal(kpl_module_num_params(m), 62);
    assert_int_equal(kpl_module_param_count(m), 11689512); /* torchvision's resnet18 */
    char buf[64];
    for (int i = 0; i < 62; i++)
        assert_string_equal(kpl_module_param_name(m, i), resnet18_names(i, buf, sizeof buf));
    assert_int_equal(kpl_module_num_buffers(m), 40); /* 20 norms x (running_mean, running_var) */
    assert_string_equal(kpl_module_buffer_name(m, 0), "bn1.running_mean");
    assert_string_equal(kpl_module_buffer_name(m, 39), "layer4.1.bn2.running_var");
    kpl_module *bn = kpl_module_find(m, "layer3.1.bn2");
    assert_non_null(bn);
    assert_string_equal(kpl_module_kind_of(bn)->name, "batch_norm");
    assert_int_equal(kpl_module_param_index(m, "layer2.0.downsample.0.weight"), 3 + 12 + 6);
    assert_null(kpl_module_find(m, "layer3.7"));
    /* names are checked */
    FAILS(kpl_nn_relu(m, "fc", NULL), KPL_EINVAL, "the name 'fc' is taken");
    FAILS(kpl_nn_relu(m, "a.b", NULL), KPL_EINVAL, "name 'a.b' has '.'");
    FAILS(kpl_nn_relu(m, "", NULL), KPL_EINVAL, "needs a name");
    kpl_module_destroy(m);
}

/* A frozen stage: no gradients, batch norm on running statistics. */
static void test_freeze(void **state)
{
    (void)state;
    kpl_model_config c = {.name = "resnet", .num_classes = 10, .in_channels = 3,
                          .in_h = 16, .in_w = 16, .depth = 18, .stem = KPL_STEM_CIFAR, .width = 8};
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&c, NULL, 2, &m));
    kpl_module *l1 = kpl_module_find(m, "layer1");
    OK(kpl_module_freeze(l1));
    kpl_module_set_training(m, true);
    assert_false(kpl_module_training(kpl_module_find(m, "layer1.0.bn1")));
    assert_true(kpl_module_training(kpl_module_find(m, "layer2.0.bn1")));
    kpl_tensor *rm1 = kpl_module_get_buffer(kpl_module_find(m, "layer1.0.bn1"), "running_mean");
    kpl_tensor *rm2 = kpl_module_get_buffer(kpl_module_find(m, "layer2.0.bn1"), "running_mean");
    kpl_pool *p = NN(kpl_pool_push());
    kpl_rng *rng = kpl_rng_create(4);
    int64_t xs[4] = {4, 3, 16, 16};
    kpl_tensor *x = NN(kpl_randn(kpl_device_cpu(), KPL_F32, 4, xs, rng, 1, 1));
    kpl_tensor *loss = NN(kpl_mean(NN(kpl_square(NN(kpl_module_forward(m, x)))), NULL, 0, false));
    OK(kpl_backward(loss, NULL, false));
    for (int i = 0; i < kpl_module_num_params(m); i++) {
        const char *n = kpl_module_param_name(m, i);
        bool frozen = !strncmp(n, "layer1.", 7);
        assert_int_equal(kpl_requires_grad(kpl_module_params(m)[i]), !frozen);
        if (frozen) assert_null(kpl_grad_get(kpl_module_params(m)[i]));
        else assert_non_null(kpl_grad_get(kpl_module_params(m)[i]));
    }
    for (int k = 0; k < 8; k++) {
        assert_close(tget(rm1, k), 0, 0, 0, "frozen running_mean", k);
        assert_true(tget(rm2, k) != 0);
    }
    kpl_pool_pop(p);
    kpl_rng_destroy(rng);
    kpl_module_destroy(m);
}

/* ---- an FPN-like module defined here, outside trainer/ ------------------------------------- */

/* children: c3, c4, c5 (stride-2 convs), l3, l4, l5 (1x1 laterals to 8
 * channels); out: p3, p4, p5 with the top-down sum */
static kpl_status fpn_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    const char *cn[3] = {"c3", "c4", "c5"}, *ln[3] = {"l3", "l4", "l5"};
    kpl_tensor *c[3], *x = in->t[0];
    for (int i = 0; i < 3; i++) x = c[i] = kpl_relu(kpl_module_forward(kpl_module_find(m, cn[i]), x));
    kpl_tensor *top = NULL;
    for (int i = 2; i >= 0; i--) {
        kpl_tensor *lat = kpl_module_forward(kpl_module_find(m, ln[i]), c[i]);
        if (top && lat)
            top = kpl_add(lat, kpl_upsample_nearest(top, kpl_tensor_shape(lat)[2],
                                                    kpl_tensor_shape(lat)[3]));
        else top = lat;
        out->t[i] = top;
    }
    out->n = 3;
    return top ? KPL_OK : kpl_last_status();
}

static const kpl_module_kind fpn_kind = {"fpn", fpn_forward, NULL, KPL_MODULE_REPLAYABLE};

static void test_module_with_several_outputs(void **state)
{
    (void)state;
    kpl_module *m = NULL;
    OK(kpl_module_create_root(NULL, 6, &fpn_kind, NULL, &m));
    int64_t ch[4] = {3, 4, 6, 8};
    for (int i = 0; i < 3; i++) {
        char n[4];
        snprintf(n, sizeof n, "c%d", i + 3);
        kpl_nn_conv c = {KPL_NN_CONV_INIT(ch[i], ch[i + 1], 3), .stride = {2, 2}, .padding = {1, 1}};
        OK(kpl_nn_conv2d(m, n, &c, NULL));
    }
    for (int i = 0; i < 3; i++) {
        char n[4];
        snprintf(n, sizeof n, "l%d", i + 3);
        kpl_nn_conv c = {KPL_NN_CONV_INIT(ch[i + 1], 8, 1)};
        OK(kpl_nn_conv2d(m, n, &c, NULL));
    }
    kpl_pool *p = NN(kpl_pool_push());
    kpl_rng *rng = kpl_rng_create(7);
    int64_t xs[4] = {2, 3, 32, 32};
    kpl_tensor_list in = {1, {NN(kpl_randn(kpl_device_cpu(), KPL_F32, 4, xs, rng, 0, 1))}}, out;
    OK(kpl_module_forward_list(m, &in, &out));
    assert_int_equal(out.n, 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kpl_tensor_shape(out.t[i])[1], 8);
        assert_int_equal(kpl_tensor_shape(out.t[i])[2], 16 >> i);
    }
    /* every parameter gets a gradient from a loss over all three maps */
    kpl_tensor *loss = NN(kpl_add(NN(kpl_add(NN(kpl_mean(out.t[0], NULL, 0, false)),
                                              NN(kpl_mean(out.t[1], NULL, 0, false)))),
                                  NN(kpl_mean(out.t[2], NULL, 0, false))));
    OK(kpl_backward(loss, NULL, false));
    for (int i = 0; i < kpl_module_num_params(m); i++)
        assert_non_null(kpl_grad_get(kpl_module_params(m)[i]));
    /* the one-output call says what to use instead */
    assert_null(kpl_module_forward(m, in.t[0]));
    assert_non_null(strstr(kpl_last_error(), "gives 3 outputs: use kpl_module_forward_list"));
    /* flops: c3 = 2 x 27 x 4 x 16 x 16 (input needs no gradient) ... */
    double f = 0;
    OK(kpl_module_count_flops(m, 3, xs + 1, false, &f));
    double want = 2.0 * (27 * 4 * 256 + 36 * 6 * 64 + 54 * 8 * 16 + 4 * 8 * 256 + 6 * 8 * 64 +
                         8 * 8 * 16);
    assert_close(f, want, 1e-12, 0, "flops", 0);
    kpl_pool_pop(p);
    kpl_rng_destroy(rng);
    kpl_module_destroy(m);
}

/* a + b of its two children's outputs */
static kpl_status sum_of_two_forward(kpl_module *m, const kpl_tensor_list *in,
                                     kpl_tensor_list *out)
{
    kpl_tensor *a = kpl_module_forward(kpl_module_child(m, 0), in->t[0]);
    kpl_tensor *b = kpl_module_forward(kpl_module_child(m, 1), in->t[0]);
    out->n = 1;
    out->t[0] = kpl_add(a, b);
    return out->t[0] ? KPL_OK : kpl_last_status();
}

static const kpl_module_kind sum_of_two = {"sum_of_two", sum_of_two_forward, NULL,
                                           KPL_MODULE_REPLAYABLE};

static void test_errors_name_the_module(void **state)
{
    (void)state;
    kpl_module *net = NULL, *stage = NULL;
    OK(kpl_nn_sequential_root(NULL, 1, &net));
    OK(kpl_nn_sequential(net, "stage", &stage));
    kpl_nn_conv c = {KPL_NN_CONV_INIT(3, 4, 3)};
    OK(kpl_nn_conv2d(stage, "conv", &c, NULL));
    kpl_pool *p = NN(kpl_pool_push());
    int64_t xs[4] = {1, 2, 8, 8};
    kpl_tensor *x = NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, xs, 1));
    assert_null(kpl_module_forward(net, x));
    assert_non_null(strstr(kpl_last_error(), "module stage.conv (conv2d): "));
    assert_null(strstr(kpl_last_error(), "module stage (")); /* named once, by the leaf */
    kpl_pool_pop(p);
    kpl_module_destroy(net);
    /* a module whose own op fails (it combines its children's outputs) is
     * named too: it is not a leaf */
    OK(kpl_module_create_root(NULL, 1, &sum_of_two, NULL, &net));
    OK(kpl_nn_linear(net, "a", 3, 2, true, NULL));
    OK(kpl_nn_linear(net, "b", 3, 5, true, NULL));
    p = NN(kpl_pool_push());
    x = NN(kpl_full(kpl_device_cpu(), KPL_F32, 2, (int64_t[]){4, 3}, 1));
    assert_null(kpl_module_forward(net, x));
    assert_non_null(strstr(kpl_last_error(), "module (root) (sum_of_two): add: "));
    kpl_pool_pop(p);
    kpl_module_destroy(net);
    OK(kpl_nn_sequential_root(NULL, 1, &net));
    OK(kpl_nn_sequential(net, "stage", &stage));
    p = NN(kpl_pool_push());
    FAILS(kpl_nn_conv2d(stage, "bad", &(kpl_nn_conv){KPL_NN_CONV_INIT(3, 4, 3), .groups = 2}, NULL),
          KPL_EINVAL, "multiples of groups 2");
    FAILS(kpl_nn_dropout(net, "d", 1.0, NULL), KPL_EINVAL, "p 1 not in [0, 1)");
    kpl_pool_pop(p);
    kpl_module_destroy(net);
}

/* A classifier's weights into a detector's backbone: the classifier's
 * head is reported unexpected, nothing is missing, the values arrive. */
static void test_partial_state_dict(void **state)
{
    (void)state;
    kpl_model_config c = {.name = "resnet", .num_classes = 10, .in_channels = 3,
                          .in_h = 32, .in_w = 32, .depth = 18, .stem = KPL_STEM_CIFAR, .width = 8};
    kpl_module *cls = NULL, *det = NULL, *bb = NULL;
    OK(kpl_zoo_create(&c, NULL, 11, &cls));
    kpl_checkpoint *ck = NULL;
    OK(kpl_checkpoint_create(&ck));
    OK(kpl_module_state_save(cls, ck, "model."));
    OK(kpl_nn_sequential_root(NULL, 12, &det));
    c.num_classes = 0; /* the backbone alone */
    OK(kpl_zoo_add(det, "backbone", &c, &bb));
    kpl_nn_conv hc = {KPL_NN_CONV_INIT(64, 5, 1)};
    OK(kpl_nn_conv2d(det, "head", &hc, NULL));
    int idx = kpl_module_param_index(det, "backbone.layer2.0.conv1.weight");
    assert_true(idx >= 0);
    kpl_tensor *w = kpl_module_params(det)[idx];
    kpl_tensor *src = kpl_checkpoint_find(ck, "model.layer2.0.conv1.weight");
    assert_true(tget(w, 5) != tget(src, 5));
    /* strict: refused, nothing copied */
    FAILS(kpl_module_state_load(bb, ck, "model.", true, NULL), KPL_ENOTFOUND,
          "0 missing (), 2 unexpected (fc.weight, fc.bias)");
    assert_true(tget(w, 5) != tget(src, 5));
    kpl_state_report rep;
    OK(kpl_module_state_load(bb, ck, "model.", false, &rep));
    assert_int_equal(rep.nloaded, 60 + 40);
    assert_int_equal(rep.nmissing, 0);
    assert_int_equal(rep.nunexpected, 2);
    assert_string_equal(rep.unexpected, "fc.weight, fc.bias");
    kpl_state_report_clear(&rep);
    for (int64_t i = 0; i < kpl_tensor_numel(w); i++)
        assert_close(tget(w, i), tget(src, i), 0, 0, "loaded", i);
    /* the whole detector: its head and backbone names are missing under
     * "model.": a load that matches nothing is a wrong prefix, an error
     * (the report still says what is missing) */
    FAILS(kpl_module_state_load(det, ck, "model.", false, &rep), KPL_ENOTFOUND,
          "state dict under 'model.': none of the model's 102 tensors (such as "
          "'model.backbone.conv1.weight') is in the checkpoint, which holds 102 (");
    assert_int_equal(rep.nloaded, 0);
    assert_int_equal(rep.nmissing, 100 + 2);
    assert_non_null(strstr(rep.missing, "backbone.conv1.weight"));
    kpl_state_report_clear(&rep);
    /* a shape that differs is an error whatever strict says */
    kpl_module *wide = NULL;
    c.width = 16;
    OK(kpl_zoo_create(&c, NULL, 1, &wide));
    FAILS(kpl_module_state_load(wide, ck, "model.", false, NULL), KPL_ESHAPE,
          "'model.conv1.weight' has shape (8,3,3,3), the model's has (16,3,3,3)");
    /* ... and every tensor that differs is listed, in the message and the
     * report, which a failed load fills too (strict or not) */
    memset(&rep, 0x5a, sizeof rep); /* what a caller's stack holds */
    FAILS(kpl_module_state_load(wide, ck, "model.", true, &rep), KPL_ESHAPE,
          "; 100 tensors differ in all (conv1.weight, bn1.weight, bn1.bias, layer1.0.conv1.weight");
    assert_int_equal(rep.nloaded, 0);
    /* every tensor of the (headless) wide backbone: 60 parameters, 40
     * batch-norm buffers; the report names the first 20 */
    assert_int_equal(rep.nmismatched, 100);
    assert_int_equal(rep.nmissing, 0);
    assert_int_equal(rep.nunexpected, 2); /* the classifier's head */
    int names = 1;
    for (const char *q = rep.mismatched; *q; q++) names += *q == ',';
    assert_int_equal(names, 20);
    kpl_state_report_clear(&rep);
    assert_null(rep.mismatched);
    kpl_module_destroy(wide);
    kpl_checkpoint_destroy(ck);
    kpl_module_destroy(det);
    kpl_module_destroy(cls);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layers_by_hand),
        cmocka_unit_test(test_batch_norm_and_dropout_modes),
        cmocka_unit_test(test_batch_norm_relu_fused),
        cmocka_unit_test(test_sequential_frees_intermediates),
        cmocka_unit_test(test_conv_relu_fused),
        cmocka_unit_test(test_initialisation),
        cmocka_unit_test(test_state_dict_names),
        cmocka_unit_test(test_freeze),
        cmocka_unit_test(test_module_with_several_outputs),
        cmocka_unit_test(test_errors_name_the_module),
        cmocka_unit_test(test_partial_state_dict),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    return failed + run_module_recompute_tests() ? 1 : 0;
}
