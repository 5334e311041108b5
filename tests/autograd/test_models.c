/* test_models.c — LeNet-5 and a CIFAR ResNet-18 built from the nn ops:
 * shapes and finiteness through forward and backward, and a LeNet that
 * learns a synthetic task. */
#include "kpl_test.h"
#include "autograd.h"

int run_model_tests(void);

typedef struct {
    kpl_tensor *p[128];
    int n;
    kpl_rng *rng;
} params;

static kpl_tensor *new_param(params *ps, int ndim, const int64_t *shape, double std)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, ndim, shape, &t));
    if (std > 0) OK(kpl_k_normal(t, ps->rng, 0, std));
    else OK(kpl_k_fill(t, -std)); /* std <= 0: constant -std */
    OK(kpl_set_requires_grad(t, true));
    assert_true(ps->n < 128);
    ps->p[ps->n++] = t;
    return t;
}

static kpl_tensor *conv_w(params *ps, int64_t o, int64_t c, int64_t k)
{
    int64_t s[4] = {o, c, k, k};
    return new_param(ps, 4, s, sqrt(2.0 / (double)(c * k * k)));
}

static kpl_tensor *vec(params *ps, int64_t n, double value)
{
    return new_param(ps, 1, &n, -value);
}

static void release_params(params *ps)
{
    for (int i = 0; i < ps->n; i++) kpl_tensor_release(ps->p[i]);
    kpl_rng_destroy(ps->rng);
}

/* ---- LeNet-5 --------------------------------------------------------------------- */

typedef struct {
    params ps;
    kpl_tensor *c1, *b1, *c2, *b2, *f1, *fb1, *f2, *fb2, *f3, *fb3;
} lenet;

static void lenet_init(lenet *m)
{
    memset(m, 0, sizeof *m);
    m->ps.rng = kpl_rng_create(1);
    m->c1 = conv_w(&m->ps, 6, 1, 5);
    m->b1 = vec(&m->ps, 6, 0);
    m->c2 = conv_w(&m->ps, 16, 6, 5);
    m->b2 = vec(&m->ps, 16, 0);
    int64_t s1[2] = {120, 400}, s2[2] = {84, 120}, s3[2] = {10, 84};
    m->f1 = new_param(&m->ps, 2, s1, sqrt(2.0 / 400));
    m->fb1 = vec(&m->ps, 120, 0);
    m->f2 = new_param(&m->ps, 2, s2, sqrt(2.0 / 120));
    m->fb2 = vec(&m->ps, 84, 0);
    m->f3 = new_param(&m->ps, 2, s3, sqrt(1.0 / 84));
    m->fb3 = vec(&m->ps, 10, 0);
}

static kpl_tensor *lenet_forward(lenet *m, kpl_tensor *x)
{
    kpl_conv2d_params pad2 = {{1, 1}, {2, 2}, {1, 1}, 1}, plain = KPL_CONV2D_PARAMS_INIT;
    kpl_pool2d_params pool = {{2, 2}, {2, 2}, {0, 0}, false};
    kpl_tensor *h = kpl_max_pool2d(kpl_relu(kpl_conv2d(x, m->c1, m->b1, &pad2)), &pool);
    h = kpl_max_pool2d(kpl_relu(kpl_conv2d(h, m->c2, m->b2, &plain)), &pool);
    int64_t flat[2] = {kpl_tensor_shape(x)[0], 400};
    h = kpl_reshape(h, 2, flat);
    h = kpl_relu(kpl_linear(h, m->f1, m->fb1));
    h = kpl_relu(kpl_linear(h, m->f2, m->fb2));
    return kpl_linear(h, m->f3, m->fb3);
}

static void test_lenet_learns(void **state)
{
    (void)state;
    lenet m;
    lenet_init(&m);
    kpl_device *cpu = kpl_device_cpu();
    kpl_rng *data = kpl_rng_create(2);
    int64_t ps[4] = {10, 1, 28, 28};
    kpl_tensor *proto = NULL;
    OK(kpl_tensor_empty(cpu, KPL_F32, 4, ps, &proto));
    OK(kpl_k_normal(proto, data, 0, 1));
    const int64_t B = 32;
    double first = 0, last = 0;
    for (int step = 0; step < 80; step++) {
        kpl_pool *p = NN(kpl_pool_push());
        int64_t xs[4] = {B, 1, 28, 28}, ls = B;
        kpl_tensor *x = NN(kpl_randn(cpu, KPL_F32, 4, xs, data, 0, 1));
        kpl_tensor *lab = NN(kpl_empty(cpu, KPL_I64, 1, &ls));
        int64_t *lv = kpl_tensor_host_mutable(lab);
        float *xv = kpl_tensor_host_mutable(x);
        const float *pv = kpl_tensor_host_data(proto);
        for (int64_t i = 0; i < B; i++) {
            lv[i] = (i * 3 + step) % 10;
            for (int64_t k = 0; k < 784; k++) xv[i * 784 + k] = 0.7f * xv[i * 784 + k] + pv[lv[i] * 784 + k];
        }
        kpl_tensor *loss = NN(kpl_cross_entropy(lenet_forward(&m, x), lab, KPL_REDUCE_MEAN, 0, -100));
        OK(kpl_backward(loss, NULL, false));
        double v = tget(loss, 0);
        if (step == 0) first = v;
        last = v;
        bool prev = kpl_set_grad_enabled(false);
        for (int i = 0; i < m.ps.n; i++) {
            kpl_tensor *g = kpl_grad_get(m.ps.p[i]);
            assert_non_null(g);
            OK(kpl_k_binary(m.ps.p[i], KPL_BIN_SUB, m.ps.p[i],
                            NN(kpl_scalar_op(KPL_BIN_MUL, g, 0.05, false))));
        }
        kpl_set_grad_enabled(prev);
        kpl_zero_grad(m.ps.n, m.ps.p);
        kpl_pool_pop(p);
    }
    print_message("LeNet-5 loss %.4f -> %.4f\n", first, last);
    assert_true(first > 1.5);
    assert_true(last < 0.1);
    kpl_tensor_release(proto);
    kpl_rng_destroy(data);
    release_params(&m.ps);
}

/* ---- ResNet-18, CIFAR variant ------------------------------------------------------ */

typedef struct {
    kpl_tensor *w, *g, *b, *rm, *rv;
} conv_bn;

static conv_bn make_cbn(params *ps, int64_t o, int64_t c, int64_t k)
{
    conv_bn r = {conv_w(ps, o, c, k), vec(ps, o, 1), vec(ps, o, 0), NULL, NULL};
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &o, &r.rm));
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 1, &o, &r.rv));
    OK(kpl_k_fill(r.rv, 1));
    return r;
}

static kpl_tensor *cbn(const conv_bn *c, kpl_tensor *x, int stride, int pad)
{
    kpl_conv2d_params p = {{stride, stride}, {pad, pad}, {1, 1}, 1};
    return kpl_batch_norm(kpl_conv2d(x, c->w, NULL, &p), c->g, c->b, c->rm, c->rv, true, 0.1, 1e-5);
}

typedef struct {
    conv_bn a, b, down;
    bool has_down;
    int stride;
} block;

static void test_resnet18_forward_backward(void **state)
{
    (void)state;
    params ps = {.rng = kpl_rng_create(3)};
    conv_bn stem = make_cbn(&ps, 64, 3, 3);
    block blocks[8];
    int64_t widths[4] = {64, 128, 256, 512}, in = 64;
    int nb = 0;
    for (int s = 0; s < 4; s++)
        for (int k = 0; k < 2; k++) {
            block *bl = &blocks[nb++];
            bl->stride = (s > 0 && k == 0) ? 2 : 1;
            bl->a = make_cbn(&ps, widths[s], in, 3);
            bl->b = make_cbn(&ps, widths[s], widths[s], 3);
            bl->has_down = bl->stride != 1 || in != widths[s];
            if (bl->has_down) bl->down = make_cbn(&ps, widths[s], in, 1);
            in = widths[s];
        }
    int64_t fs[2] = {10, 512};
    kpl_tensor *fc = new_param(&ps, 2, fs, sqrt(1.0 / 512)), *fcb = vec(&ps, 10, 0);

    kpl_pool *p = NN(kpl_pool_push());
    int64_t xs[4] = {2, 3, 32, 32}, ls = 2;
    kpl_tensor *x = NN(kpl_randn(kpl_device_cpu(), KPL_F32, 4, xs, ps.rng, 0, 1));
    kpl_tensor *h = kpl_relu(cbn(&stem, x, 1, 1));
    for (int i = 0; i < nb; i++) {
        block *bl = &blocks[i];
        kpl_tensor *y = cbn(&bl->b, kpl_relu(cbn(&bl->a, h, bl->stride, 1)), 1, 1);
        kpl_tensor *sc = bl->has_down ? cbn(&bl->down, h, bl->stride, 0) : h;
        h = kpl_relu(kpl_add(y, sc));
    }
    assert_non_null(h);
    assert_int_equal(kpl_tensor_shape(h)[1], 512);
    assert_int_equal(kpl_tensor_shape(h)[2], 4);
    int64_t flat[2] = {2, 512};
    kpl_tensor *logits = NN(kpl_linear(kpl_reshape(kpl_global_avg_pool2d(h), 2, flat), fc, fcb));
    assert_int_equal(kpl_tensor_shape(logits)[1], 10);
    kpl_tensor *lab = NN(kpl_full(kpl_device_cpu(), KPL_I64, 1, &ls, 3));
    kpl_tensor *loss = NN(kpl_cross_entropy(logits, lab, KPL_REDUCE_MEAN, 0, -100));
    OK(kpl_backward(loss, NULL, false));
    assert_true(isfinite(tget(loss, 0)));
    /* every parameter got a gradient of its own shape, all finite */
    for (int i = 0; i < ps.n; i++) {
        kpl_tensor *g = kpl_grad_get(ps.p[i]);
        assert_non_null(g);
        assert_int_equal(kpl_tensor_numel(g), kpl_tensor_numel(ps.p[i]));
        kpl_tensor *m = NN(kpl_max(NN(kpl_abs(g)), NULL, 0, false));
        assert_true(isfinite(tget(m, 0)));
    }
    print_message("ResNet-18 CIFAR: %d parameter tensors, loss %.4f\n", ps.n, tget(loss, 0));
    kpl_pool_pop(p);
    conv_bn *all[1 + 3 * 8];
    int na = 0;
    all[na++] = &stem;
    for (int i = 0; i < nb; i++) {
        all[na++] = &blocks[i].a;
        all[na++] = &blocks[i].b;
        if (blocks[i].has_down) all[na++] = &blocks[i].down;
    }
    for (int i = 0; i < na; i++) {
        kpl_tensor_release(all[i]->rm);
        kpl_tensor_release(all[i]->rv);
    }
    release_params(&ps);
}

int run_model_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lenet_learns),
        cmocka_unit_test(test_resnet18_forward_backward),
    };
    return cmocka_run_group_tests_name("models", tests, NULL, NULL);
}
