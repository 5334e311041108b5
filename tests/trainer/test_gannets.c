/* test_gannets.c — the zoo's GAN networks (trainer/nn/gannets.c) and the
 * layers under them against the same networks in PyTorch
 * (bench/torch_gans.py; the numbers in tests/trainer/data/gannets.bin, made
 * by gannets_ref.py):
 *  - DCGAN's generator (batch norm; no norm) and discriminator (batch norm
 *    with spectral norm, layer norm, instance norm), SN-GAN's ResNet
 *    generator and discriminator (with and without spectral norm), all
 *    narrow: outputs, the input's and every parameter's gradient and the
 *    buffers (running statistics, spectral norm's u and v after 3 power
 *    iterations) in training mode, the same in evaluation mode (stored
 *    statistics and u, v);
 *  - penalties through double backward: WGAN-GP's gradient penalty on the
 *    layer-norm DCGAN critic and on SN-GAN's critic with and without
 *    spectral norm, R1 on the batch-norm, spectrally normalised DCGAN
 *    discriminator: the value and its gradient for every parameter;
 *  - pixel shuffle and instance norm against F.pixel_shuffle and
 *    nn.InstanceNorm2d;
 *  - the full-size SN-GAN networks: every parameter and buffer name and
 *    shape, 4,276,739 and 1,053,824 parameters;
 *  - second order by finite differences (f64): transposed convolution,
 *    batch norm, leaky ReLU, convolution, layer norm and tanh in one
 *    chain, the spectrally normalised weight, pixel shuffle, instance norm;
 *  - spectral norm's API (names, power iteration, modes, checkpoints) and
 *    the errors of the layers and models. */
#include "kpl_refdata.h"
#include "trainer.h"
#include "run_impl.h"

#include <unistd.h>

/* Every parameter and buffer of m from <net>.param.<name> and
 * <net>.buf.<name>: each has a twin of its name and shape, and the file
 * has no other. */
static void load(kpl_module *m, const kpl_ref_file *rf, const char *net)
{
    char prefix[64];
    for (int pass = 0; pass < 2; pass++) {
        snprintf(prefix, sizeof prefix, "%s.%s.", net, pass ? "buf" : "param");
        int n = pass ? kpl_module_num_buffers(m) : kpl_module_num_params(m);
        assert_int_equal(n, kpl_ref_count_prefixed(rf, prefix));
        for (int i = 0; i < n; i++) {
            const char *name = pass ? kpl_module_buffer_name(m, i) : kpl_module_param_name(m, i);
            const kpl_ref_tensor *r = kpl_ref_find(rf, "%s%s", prefix, name);
            if (!r) fail_msg("%s: %s has no torch twin", net, name);
            kpl_ref_copy_into((pass ? kpl_module_buffers(m) : kpl_module_params(m))[i], r, name);
        }
    }
}

/* t against <cs>.<name>: 1e-5 relative, plus an absolute allowance of
 * ERR_FACTOR x PyTorch's own f32 error on this tensor of this case
 * (<cs>.f32err.<name>, a fraction of the largest value), at least 1e-6 of
 * it: test_segnets' rule.  kpl's f32 sums run in another order than
 * PyTorch's and land 1 to 4 times as far from the f64 numbers; a wrong
 * layer, norm or power iteration moves results by percents. */
#define ERR_FACTOR 8.0
static void expect(kpl_tensor *t, const kpl_ref_file *rf, const char *cs, const char *name)
{
    double e32 = KPL_REF(rf, "%s.f32err.%s", cs, name)->v[0];
    char what[160];
    snprintf(what, sizeof what, "%s %s", cs, name);
    kpl_ref_expect(t, KPL_REF(rf, "%s.%s", cs, name), 1e-5, fmax(1e-6, ERR_FACTOR * e32), what);
}

/* The network <net> of the file: its model config, built and loaded. */
static kpl_module *make_net(const kpl_ref_file *rf, const char *net)
{
    const double *c = KPL_REF(rf, "%s.config", net)->v;
    static const char *const norms[] = {"none", "batch", "instance", "layer"};
    bool d = c[0] != 0, dcgan = net[0] == 'd';
    kpl_model_config mc;
    memset(&mc, 0, sizeof mc);
    snprintf(mc.name, sizeof mc.name, "%s%s", dcgan ? "dcgan" : "sngan", d ? "_d" : "");
    mc.in_channels = (int64_t)c[3], mc.in_h = mc.in_w = (int64_t)c[4];
    char v[32];
    if (!d) {
        snprintf(v, sizeof v, "%lld", (long long)c[1]);
        OK(kpl_keyvals_set(&mc.keys, "latent_dim", v));
    }
    snprintf(v, sizeof v, "%lld", (long long)c[2]);
    if (dcgan) mc.width = (int64_t)c[2];
    else OK(kpl_keyvals_set(&mc.keys, d ? "d_width" : "g_width", v));
    if (dcgan) OK(kpl_keyvals_set(&mc.keys, d ? "d_norm" : "g_norm", norms[(int)c[5]]));
    OK(kpl_keyvals_set(&mc.keys, "spectral_norm", c[6] != 0 ? "true" : "false"));
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&mc, NULL, 11, &m));
    load(m, rf, net);
    return m;
}

/* Case train or eval: `pre` forwards without gradients on x, then
 * out0 = m(x) and the gradients of sum(out0 gy0) for x and every
 * parameter; in training the buffers after. */
static void check_plain(kpl_module *m, const kpl_ref_file *rf, const char *cs)
{
    const double *cfg = KPL_REF(rf, "%s.config", cs)->v;
    bool training = cfg[0] != 0;
    kpl_module_set_training(m, training);
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = kpl_ref_param(KPL_REF(rf, "%s.x", cs), KPL_F32);
    bool prev = kpl_set_grad_enabled(false);
    for (int i = 0; i < (int)cfg[1]; i++) NN(kpl_module_forward(m, x));
    kpl_set_grad_enabled(prev);
    kpl_tensor *y = NN(kpl_module_forward(m, x));
    expect(y, rf, cs, "out0");
    kpl_tensor *gy = kpl_ref_tensor_of(KPL_REF(rf, "%s.gy0", cs), KPL_F32);
    OK(kpl_backward(NN(kpl_sum(kpl_mul(y, gy), NULL, 0, false)), NULL, false));
    expect(kpl_grad_get(x), rf, cs, "gx");
    char name[200];
    for (int i = 0; i < kpl_module_num_params(m); i++) {
        snprintf(name, sizeof name, "grad.%s", kpl_module_param_name(m, i));
        expect(kpl_grad_get(kpl_module_params(m)[i]), rf, cs, name);
    }
    for (int i = 0; training && i < kpl_module_num_buffers(m); i++) {
        snprintf(name, sizeof name, "buf.%s", kpl_module_buffer_name(m, i));
        expect(kpl_module_buffers(m)[i], rf, cs, name);
    }
    kpl_zero_grad(kpl_module_num_params(m), kpl_module_params(m));
    kpl_pool_pop(pool);
    kpl_tensor_release(x);
}

/* Case gp or r1 in training mode: g = grad(sum m(x), x) with
 * create_graph, the penalty mean((|g| - 1)^2) or mean(|g|^2), and its
 * gradient for every parameter (none where torch's is None or zeros). */
static void check_penalty(kpl_module *m, const kpl_ref_file *rf, const char *cs, bool r1)
{
    kpl_module_set_training(m, true);
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = kpl_ref_param(KPL_REF(rf, "%s.x", cs), KPL_F32), *g = NULL;
    kpl_tensor *s = NN(kpl_sum(kpl_module_forward(m, x), NULL, 0, false));
    OK(kpl_grad(s, NULL, 1, &x, true, &g));
    kpl_tensor *n = kpl_sqrt(kpl_sum(kpl_square(NN(g)), (int[]){1, 2, 3}, 3, false));
    kpl_tensor *pen = NN(kpl_mean(r1 ? kpl_square(n) : kpl_square(kpl_scalar_op(KPL_BIN_SUB, n,
                                                                                1, false)),
                                  NULL, 0, false));
    expect(NN(kpl_reshape(pen, 1, (int64_t[]){1})), rf, cs, "value");
    int np = kpl_module_num_params(m);
    kpl_tensor **grads = calloc((size_t)np, sizeof *grads);
    assert_non_null(grads);
    OK(kpl_grad(pen, NULL, np, kpl_module_params(m), false, grads));
    for (int i = 0; i < np; i++) {
        char name[200];
        snprintf(name, sizeof name, "grad.%s", kpl_module_param_name(m, i));
        const kpl_ref_tensor *r = kpl_ref_find(rf, "%s.%s", cs, name);
        if (r && !grads[i]) {
            /* kpl's graph does not reach the parameter where torch's
             * reaches it through a ReLU mask or a bias, with zeros */
            for (int64_t j = 0; j < r->numel; j++)
                if (r->v[j] != 0) fail_msg("%s: %s has no gradient, torch's is not 0", cs, name);
            continue;
        }
        if (r) {
            expect(grads[i], rf, cs, name);
            continue;
        }
        for (int64_t j = 0; grads[i] && j < kpl_tensor_numel(grads[i]); j++)
            if (tget(grads[i], j) != 0)
                fail_msg("%s: %s has a gradient, torch's none", cs, name);
    }
    free(grads);
    kpl_pool_pop(pool);
    kpl_tensor_release(x);
}

static void test_networks_reference(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(GAN_DATA_DIR, "gannets.bin");
    static const struct {
        const char *net, *cases[3];
    } nets[] = {
        {"dg", {"train", "eval"}},      {"dgn", {"train"}},
        {"dd", {"train", "eval", "r1"}}, {"dl", {"train", "gp"}},
        {"di", {"train"}},              {"sg", {"train"}},
        {"sd", {"train", "eval", "gp"}}, {"sdn", {"gp"}},
    };
    for (size_t i = 0; i < sizeof nets / sizeof nets[0]; i++)
        for (int k = 0; k < 3 && nets[i].cases[k]; k++) {
            /* every case from the file's weights and buffers */
            kpl_module *m = make_net(rf, nets[i].net);
            const char *c = nets[i].cases[k];
            char cs[32];
            snprintf(cs, sizeof cs, "%s.%s", nets[i].net, c);
            if (!strcmp(c, "gp") || !strcmp(c, "r1")) check_penalty(m, rf, cs, c[0] == 'r');
            else check_plain(m, rf, cs);
            kpl_module_destroy(m);
        }
    kpl_ref_free(rf);
}

static void test_layers_reference(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(GAN_DATA_DIR, "gannets.bin");
    kpl_module *root = NULL, *ps = NULL, *in = NULL, *plain = NULL;
    OK(kpl_nn_sequential_root(NULL, 1, &root));
    OK(kpl_nn_pixel_shuffle(root, "ps", 2, &ps));
    OK(kpl_nn_instance_norm(root, "in", 3, true, 1e-5, &in));
    OK(kpl_nn_instance_norm(root, "plain", 3, false, 1e-5, &plain));
    assert_int_equal(kpl_module_num_own_params(plain), 0);
    kpl_ref_copy_into(kpl_module_get_param(in, "weight"), KPL_REF(rf, "inorm.weight"), "weight");
    kpl_ref_copy_into(kpl_module_get_param(in, "bias"), KPL_REF(rf, "inorm.bias"), "bias");
    static const struct {
        const char *tag;
        int which;
    } cases[] = {{"ps", 0}, {"inorm", 1}, {"inorm.plain", 2}};
    for (size_t k = 0; k < 3; k++) {
        kpl_module *m = cases[k].which == 0 ? ps : cases[k].which == 1 ? in : plain;
        const char *t = cases[k].tag;
        kpl_pool *pool = NN(kpl_pool_push());
        kpl_tensor *x = kpl_ref_param(KPL_REF(rf, "%s.x", t), KPL_F32);
        kpl_tensor *y = NN(kpl_module_forward(m, x));
        kpl_ref_expect(y, KPL_REF(rf, "%s.out", t), 1e-5, 1e-6, t);
        kpl_tensor *gy = kpl_ref_tensor_of(KPL_REF(rf, "%s.gy", t), KPL_F32);
        OK(kpl_backward(NN(kpl_sum(kpl_mul(y, gy), NULL, 0, false)), NULL, false));
        kpl_ref_expect(kpl_grad_get(x), KPL_REF(rf, "%s.gx", t), 1e-5, 1e-6, t);
        if (cases[k].which == 1) {
            kpl_ref_expect(kpl_grad_get(kpl_module_get_param(in, "weight")),
                           KPL_REF(rf, "inorm.gweight"), 1e-5, 1e-6, "inorm weight");
            kpl_ref_expect(kpl_grad_get(kpl_module_get_param(in, "bias")),
                           KPL_REF(rf, "inorm.gbias"), 1e-5, 1e-6, "inorm bias");
        }
        kpl_pool_pop(pool);
        kpl_tensor_release(x);
    }
    /* pixel shuffle moves values: bit for bit */
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = kpl_ref_tensor_of(KPL_REF(rf, "ps.x"), KPL_F64);
    kpl_tensor *y = NN(kpl_module_forward(ps, x));
    const kpl_ref_tensor *ry = KPL_REF(rf, "ps.out");
    for (int64_t i = 0; i < ry->numel; i++) assert_true(tget(y, i) == ry->v[i]);
    kpl_pool_pop(pool);
    kpl_module_destroy(root);
    kpl_ref_free(rf);
}

/* SN-GAN's CIFAR-10 networks at full size: PyTorch's names, shapes and
 * counts. */
static void test_sngan_full_size(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(GAN_DATA_DIR, "gannets.bin");
    static const char *const names[2] = {"sngan", "sngan_d"}, *const tags[2] = {"sg", "sd"};
    static const int64_t counts[2] = {4276739, 1053824};
    for (int k = 0; k < 2; k++) {
        kpl_model_config mc;
        memset(&mc, 0, sizeof mc);
        snprintf(mc.name, sizeof mc.name, "%s", names[k]);
        mc.in_channels = 3, mc.in_h = mc.in_w = 32;
        kpl_module *m = NULL;
        OK(kpl_zoo_create(&mc, NULL, 1, &m)); /* the defaults: 128, 256, 128, spectral norm */
        assert_int_equal(kpl_module_param_count(m), (int64_t)KPL_REF(rf, "full.%s.count", tags[k])->v[0]);
        assert_int_equal(kpl_module_param_count(m), counts[k]);
        for (int pass = 0; pass < 2; pass++) {
            char prefix[32];
            snprintf(prefix, sizeof prefix, "full.%s.%s.", tags[k], pass ? "b" : "p");
            int n = pass ? kpl_module_num_buffers(m) : kpl_module_num_params(m);
            assert_int_equal(n, kpl_ref_count_prefixed(rf, prefix));
            for (int i = 0; i < n; i++) {
                const char *name = pass ? kpl_module_buffer_name(m, i) : kpl_module_param_name(m, i);
                kpl_tensor *t = (pass ? kpl_module_buffers(m) : kpl_module_params(m))[i];
                const kpl_ref_tensor *r = kpl_ref_find(rf, "%s%s", prefix, name);
                if (!r) fail_msg("%s %s has no PyTorch twin", names[k], name);
                if (kpl_tensor_ndim(t) != r->numel)
                    fail_msg("%s: %d dims, PyTorch's %lld", name, kpl_tensor_ndim(t),
                             (long long)r->numel);
                for (int d = 0; d < kpl_tensor_ndim(t); d++)
                    if (kpl_tensor_shape(t)[d] != (int64_t)r->v[d])
                        fail_msg("%s: dim %d is %lld, PyTorch's %g", name, d,
                                 (long long)kpl_tensor_shape(t)[d], r->v[d]);
            }
        }
        /* a batch through it: images in [-1, 1] / one score each */
        kpl_pool *pool = NN(kpl_pool_push());
        int64_t shape[4] = {2, k ? 3 : 128, 32, 32};
        kpl_tensor *x = NN(kpl_full(kpl_device_cpu(), KPL_F32, k ? 4 : 2, shape, 0.25));
        kpl_tensor *y = NN(kpl_module_forward(m, x));
        assert_int_equal(kpl_tensor_ndim(y), k ? 2 : 4);
        assert_int_equal(kpl_tensor_dim(y, 1), k ? 1 : 3);
        for (int64_t i = 0; !k && i < kpl_tensor_numel(y); i++)
            assert_true(fabs(tget(y, i)) <= 1);
        kpl_pool_pop(pool);
        kpl_module_destroy(m);
    }
    kpl_ref_free(rf);
}

/* ---- second order by finite differences (f64) ---- */

/* tanh(layer_norm(conv2d(leaky_relu(batch_norm(conv_transpose2d(x)))))):
 * DCGAN's generator and discriminator layers in one chain. */
static kpl_tensor *f_chain(kpl_tensor *const *in, void *u)
{
    (void)u;
    kpl_conv2d_params up = {.stride = {2, 2}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    kpl_conv2d_params down = up;
    kpl_tensor *h = kpl_conv_transpose2d(in[0], in[1], NULL, &up, NULL);
    h = kpl_leaky_relu(kpl_batch_norm(h, in[2], in[3], NULL, NULL, true, 0.1, 1e-5), 0.2);
    h = kpl_layer_norm(kpl_conv2d(h, in[4], NULL, &down), 3, NULL, NULL, 1e-5);
    return kpl_tanh(h);
}

typedef struct {
    kpl_tensor *u, *v;
    int dim;
} sn_case;

/* conv2d of x with the spectrally normalised weight (stored u, v) */
static kpl_tensor *f_sn(kpl_tensor *const *in, void *user)
{
    const sn_case *c = user;
    kpl_conv2d_params p = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    kpl_tensor *w = kpl__spectral_weight(in[1], c->u, c->v, c->dim, 1, 1e-12, false);
    if (c->dim == 1) return kpl_tanh(kpl_conv_transpose2d(in[0], w, NULL, &p, NULL));
    return kpl_tanh(kpl_conv2d(in[0], w, NULL, &p));
}

static kpl_tensor *f_module(kpl_tensor *const *in, void *user)
{
    return kpl_square(kpl_module_forward(user, in[0]));
}

static kpl_tensor *f64_param(int nd, const int64_t *shape, kpl_rng *rng, double lo, double hi)
{
    kpl_tensor *t = NN(kpl_rand(kpl_device_cpu(), KPL_F64, nd, shape, rng, lo, hi));
    kpl_tensor_retain(t);
    OK(kpl_set_requires_grad(t, true));
    return t;
}

static void test_second_order(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_rng *rng = kpl_rng_create(5);
    int64_t xs[4] = {2, 3, 3, 3}, wts[4] = {3, 2, 4, 4}, cs[1] = {2}, ws[4] = {4, 2, 4, 4};
    kpl_tensor *chain[5] = {f64_param(4, xs, rng, -1, 1), f64_param(4, wts, rng, -0.5, 0.5),
                            f64_param(1, cs, rng, 0.5, 1.5), f64_param(1, cs, rng, -0.5, 0.5),
                            f64_param(4, ws, rng, -0.3, 0.3)};
    OK(kpl_gradcheck(f_chain, NULL, 5, chain, 1, 1e-6, 1e-6, 1e-5));
    OK(kpl_gradcheck(f_chain, NULL, 5, chain, 2, 1e-5, 1e-5, 1e-4));
    /* the spectrally normalised weight: conv2d (dim 0) and transposed (dim 1) */
    for (int dim = 0; dim < 2; dim++) {
        int64_t w4[4] = {4, 3, 3, 3}, x4[4] = {2, dim ? 4 : 3, 4, 4};
        int64_t h = w4[dim], n = 108 / h;
        sn_case c = {kpl_randn(kpl_device_cpu(), KPL_F64, 1, &h, rng, 0, 1),
                     kpl_randn(kpl_device_cpu(), KPL_F64, 1, &n, rng, 0, 1), dim};
        kpl_tensor *in[2] = {f64_param(4, x4, rng, -1, 1), f64_param(4, w4, rng, -1, 1)};
        OK(kpl_gradcheck(f_sn, &c, 2, in, 1, 1e-6, 1e-6, 1e-5));
        OK(kpl_gradcheck(f_sn, &c, 2, in, 2, 1e-5, 1e-5, 1e-4));
        kpl_tensor_release(in[0]);
        kpl_tensor_release(in[1]);
    }
    /* pixel shuffle and instance norm (no affine: the module's tensors are f32) */
    kpl_module *root = NULL, *ps = NULL, *inorm = NULL;
    OK(kpl_nn_sequential_root(NULL, 1, &root));
    OK(kpl_nn_pixel_shuffle(root, "ps", 2, &ps));
    OK(kpl_nn_instance_norm(root, "in", 3, false, 1e-5, &inorm));
    int64_t ps_s[4] = {1, 8, 2, 3}, in_s[4] = {2, 3, 2, 3};
    kpl_tensor *x1 = f64_param(4, ps_s, rng, -1, 1), *x2 = f64_param(4, in_s, rng, -1, 1);
    OK(kpl_gradcheck(f_module, ps, 1, &x1, 2, 1e-6, 1e-6, 1e-5));
    OK(kpl_gradcheck(f_module, inorm, 1, &x2, 2, 1e-5, 1e-5, 1e-4));
    kpl_module_destroy(root);
    for (int i = 0; i < 5; i++) kpl_tensor_release(chain[i]);
    kpl_tensor_release(x1);
    kpl_tensor_release(x2);
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
}

/* ---- spectral norm's API ---- */

static double norm_of(kpl_tensor *t)
{
    double s = 0;
    for (int64_t i = 0; i < kpl_tensor_numel(t); i++) s += tget(t, i) * tget(t, i);
    return sqrt(s);
}

static void test_spectral_norm_api(void **state)
{
    (void)state;
    kpl_module *root = NULL, *lin = NULL, *ct = NULL, *relu = NULL;
    OK(kpl_nn_sequential_root(NULL, 3, &root));
    OK(kpl_nn_linear(root, "0", 2, 2, true, &lin));
    kpl_nn_conv c = {KPL_NN_CONV_INIT(6, 4, 3), .groups = 2};
    OK(kpl_nn_conv_transpose2d(root, "1", &c, &ct));
    OK(kpl_nn_relu(root, "2", &relu));
    /* W = diag(3, 1): sigma 3 */
    float *w = kpl_tensor_host_mutable(kpl_module_get_param(lin, "weight"));
    w[0] = 3, w[1] = 0, w[2] = 0, w[3] = 1;
    OK(kpl_k_fill(kpl_module_get_param(lin, "bias"), 0));
    OK(kpl_nn_spectral_norm(lin, 1, 1e-12));
    OK(kpl_nn_spectral_norm(ct, 2, 1e-12));
    /* PyTorch's names and order: bias, then weight_orig; buffers u, v */
    assert_string_equal(kpl_module_param_name(root, 0), "0.bias");
    assert_string_equal(kpl_module_param_name(root, 1), "0.weight_orig");
    assert_string_equal(kpl_module_param_name(root, 2), "1.bias");
    assert_string_equal(kpl_module_param_name(root, 3), "1.weight_orig");
    assert_null(kpl_module_get_param(lin, "weight"));
    assert_int_equal(kpl_module_num_buffers(root), 4);
    assert_string_equal(kpl_module_buffer_name(root, 0), "0.weight_u");
    assert_string_equal(kpl_module_buffer_name(root, 1), "0.weight_v");
    /* a transposed convolution's dim 1: out/groups = 2 rows, 6 x 3 x 3 columns */
    kpl_tensor *cu = kpl_module_get_buffer(ct, "weight_u"), *cv = kpl_module_get_buffer(ct, "weight_v");
    assert_int_equal(kpl_tensor_numel(cu), 2);
    assert_int_equal(kpl_tensor_numel(cv), 54);
    assert_float_equal(norm_of(cu), 1, 1e-6);
    assert_float_equal(norm_of(cv), 1, 1e-6);
    kpl_tensor *u = kpl_module_get_buffer(lin, "weight_u");
    assert_float_equal(norm_of(u), 1, 1e-6);

    /* training: the power iteration finds sigma 3, so W / sigma = diag(1, 1/3) */
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = NN(kpl_full(kpl_device_cpu(), KPL_F32, 2, (int64_t[]){1, 2}, 1));
    kpl_tensor *y = NULL;
    for (int i = 0; i < 40; i++) y = NN(kpl_module_forward(lin, x));
    assert_float_equal(tget(y, 0), 1, 1e-5);
    assert_float_equal(tget(y, 1), 1.0 / 3, 1e-5);
    assert_float_equal(fabs(tget(u, 0)), 1, 1e-5);
    /* evaluation and frozen: u and v stay */
    float before[2] = {(float)tget(u, 0), (float)tget(u, 1)};
    OK(kpl_k_fill(u, 0.6));
    before[0] = before[1] = 0.6f;
    kpl_module_set_training(root, false);
    NN(kpl_module_forward(lin, x));
    assert_true(tget(u, 0) == before[0] && tget(u, 1) == before[1]);
    kpl_module_set_training(root, true);
    OK(kpl_module_freeze(lin));
    NN(kpl_module_forward(lin, x));
    assert_true(tget(u, 0) == before[0]);
    kpl_pool_pop(pool);

    /* u and v travel in checkpoints under PyTorch's names */
    char dir[] = "/tmp/kpl_gannets_XXXXXX", path[64];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/sn.kpl", dir);
    kpl_checkpoint *ck = NULL;
    OK(kpl_checkpoint_create(&ck));
    OK(kpl_module_state_save(root, ck, "model."));
    OK(kpl_checkpoint_save(ck, path));
    kpl_checkpoint_destroy(ck);
    OK(kpl_checkpoint_load(path, &ck));
    assert_non_null(kpl_checkpoint_find(ck, "model.0.weight_orig"));
    assert_non_null(kpl_checkpoint_find(ck, "model.1.weight_v"));
    kpl_module *other = NULL, *olin = NULL;
    OK(kpl_nn_sequential_root(NULL, 4, &other));
    OK(kpl_nn_linear(other, "0", 2, 2, true, &olin));
    OK(kpl_nn_conv_transpose2d(other, "1", &c, NULL));
    OK(kpl_nn_spectral_norm(olin, 1, 1e-12));
    OK(kpl_nn_spectral_norm(kpl_module_find(other, "1"), 2, 1e-12));
    OK(kpl_module_state_load(other, ck, "model.", true, NULL));
    assert_true(tget(kpl_module_get_buffer(olin, "weight_u"), 0) == before[0]);
    kpl_checkpoint_destroy(ck);
    unlink(path);
    rmdir(dir);
    kpl_module_destroy(other);

    /* errors */
    FAILS(kpl_nn_spectral_norm(relu, 1, 1e-12), KPL_EINVAL, "has no weight to normalise");
    FAILS(kpl_nn_spectral_norm(lin, 1, 1e-12), KPL_EINVAL, "normalised already");
    kpl_module *l2 = NULL;
    OK(kpl_nn_linear(root, "3", 2, 2, false, &l2));
    FAILS(kpl_nn_spectral_norm(l2, 0, 1e-12), KPL_EINVAL, "power_iterations 0");
    FAILS(kpl_nn_spectral_norm(l2, 1, 0), KPL_EINVAL, "eps 0");
    kpl_module_destroy(root);
}

/* ---- the models: shapes, keys, errors ---- */

static kpl_model_config config(const char *name, int64_t c, int64_t side)
{
    kpl_model_config mc;
    memset(&mc, 0, sizeof mc);
    snprintf(mc.name, sizeof mc.name, "%s", name);
    mc.in_channels = c, mc.in_h = mc.in_w = side;
    return mc;
}

/* G's images (N, C, side, side) in [-1, 1] and D's scores (N, 1) */
static void run_pair(kpl_model_config *mc, int64_t latent)
{
    kpl_model_config dc = *mc;
    snprintf(dc.name, sizeof dc.name, "%.29s_d", mc->name);
    kpl_module *g = NULL, *d = NULL;
    OK(kpl_zoo_create(mc, NULL, 1, &g));
    OK(kpl_zoo_create(&dc, NULL, 2, &d));
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_rng *rng = kpl_rng_create(1);
    kpl_tensor *z = NN(kpl_randn(kpl_device_cpu(), KPL_F32, 2, (int64_t[]){3, latent}, rng, 0, 1));
    kpl_tensor *img = NN(kpl_module_forward(g, z));
    assert_int_equal(kpl_tensor_ndim(img), 4);
    assert_int_equal(kpl_tensor_dim(img, 1), mc->in_channels);
    assert_int_equal(kpl_tensor_dim(img, 2), mc->in_h);
    assert_int_equal(kpl_tensor_dim(img, 3), mc->in_w);
    for (int64_t i = 0; i < kpl_tensor_numel(img); i++) assert_true(fabs(tget(img, i)) <= 1);
    kpl_tensor *s = NN(kpl_module_forward(d, img));
    assert_int_equal(kpl_tensor_ndim(s), 2);
    assert_int_equal(kpl_tensor_dim(s, 0), 3);
    assert_int_equal(kpl_tensor_dim(s, 1), 1);
    /* the wrong input names what the model wants */
    assert_null(kpl_module_forward(d, z));
    assert_non_null(strstr(kpl_last_error(), "image batch"));
    assert_null(kpl_module_forward(g, img));
    assert_non_null(strstr(kpl_last_error(), "latent batch"));
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
    kpl_module_destroy(g);
    kpl_module_destroy(d);
}

static void test_models(void **state)
{
    (void)state;
    /* DCGAN at 28 (7 -> 14 -> 28), 32 and 64, with every D norm */
    static const struct {
        int64_t c, side, width;
        const char *d_norm;
        bool sn;
    } dc[] = {{1, 28, 8, "batch", false}, {3, 32, 8, "layer", false},
              {3, 64, 4, "instance", true}, {1, 20, 4, "none", true}};
    for (size_t i = 0; i < sizeof dc / sizeof dc[0]; i++) {
        kpl_model_config mc = config("dcgan", dc[i].c, dc[i].side);
        mc.width = dc[i].width;
        OK(kpl_keyvals_set(&mc.keys, "latent_dim", "16"));
        OK(kpl_keyvals_set(&mc.keys, "d_norm", dc[i].d_norm));
        OK(kpl_keyvals_set(&mc.keys, "spectral_norm", dc[i].sn ? "true" : "false"));
        run_pair(&mc, 16);
    }
    /* the channel schedule: 28 = 7 x 2^2, G 2w -> w -> C */
    kpl_model_config mc = config("dcgan", 1, 28);
    kpl_module *g = NULL;
    OK(kpl_zoo_create(&mc, NULL, 1, &g));
    assert_int_equal(kpl_tensor_dim(kpl_module_get_param(kpl_module_find(g, "main.0"), "weight"), 1),
                     128);
    assert_int_equal(kpl_tensor_dim(kpl_module_get_param(kpl_module_find(g, "main.0"), "weight"), 0),
                     100);
    assert_int_equal(kpl_tensor_dim(kpl_module_get_param(kpl_module_find(g, "main.0"), "weight"), 2),
                     7);
    kpl_module_destroy(g);
    /* SN-GAN at 32 and 48 (a 6 x 6 first map) */
    for (int64_t side = 32; side <= 48; side += 16) {
        kpl_model_config sc = config("sngan", 3, side);
        OK(kpl_keyvals_set(&sc.keys, "g_width", "16"));
        OK(kpl_keyvals_set(&sc.keys, "d_width", "8"));
        OK(kpl_keyvals_set(&sc.keys, "latent_dim", "12"));
        run_pair(&sc, 12);
    }
    /* the pairs share one key table */
    assert_ptr_equal(kpl_zoo_find("dcgan")->keys, kpl_zoo_find("dcgan_d")->keys);
    assert_ptr_equal(kpl_zoo_find("sngan")->keys, kpl_zoo_find("sngan_d")->keys);
}

static void test_errors(void **state)
{
    (void)state;
    kpl_module *m = NULL;
    kpl_model_config mc = config("dcgan", 3, 36); /* 9 x 2^2 */
    FAILS(kpl_zoo_create(&mc, NULL, 1, &m), KPL_EINVAL, "the side 36 is not s0 x 2^k");
    mc = config("dcgan_d", 3, 6);
    FAILS(kpl_zoo_create(&mc, NULL, 1, &m), KPL_EINVAL, "the side 6 is not");
    mc = config("dcgan", 3, 32);
    mc.in_w = 64;
    FAILS(kpl_zoo_create(&mc, NULL, 1, &m), KPL_EINVAL, "needs square images (got 32x64)");
    mc = config("dcgan_d", 3, 32);
    OK(kpl_keyvals_set(&mc.keys, "d_norm", "group"));
    FAILS(kpl_zoo_create(&mc, NULL, 1, &m), KPL_EINVAL, "d_norm");
    mc = config("dcgan", 3, 32);
    OK(kpl_keyvals_set(&mc.keys, "g_norm", "layer"));
    FAILS(kpl_zoo_create(&mc, NULL, 1, &m), KPL_EINVAL, "g_norm");
    mc = config("sngan_d", 3, 28);
    FAILS(kpl_zoo_create(&mc, NULL, 1, &m), KPL_EINVAL, "side 32, 40, 48, 56 or 64 (got 28x28)");
    mc = config("sngan", 3, 128);
    FAILS(kpl_zoo_create(&mc, NULL, 1, &m), KPL_EINVAL, "(got 128x128)");
    assert_null(m);
    /* the layers' own */
    kpl_module *root = NULL, *ps = NULL, *in = NULL;
    OK(kpl_nn_sequential_root(NULL, 1, &root));
    FAILS(kpl_nn_pixel_shuffle(root, "p0", 0, NULL), KPL_EINVAL, "factor 0");
    FAILS(kpl_nn_instance_norm(root, "i0", 0, true, 1e-5, NULL), KPL_EINVAL, "channels 0");
    OK(kpl_nn_pixel_shuffle(root, "ps", 2, &ps));
    OK(kpl_nn_instance_norm(root, "in", 3, false, 1e-5, &in));
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){1, 6, 2, 2}, 1));
    assert_null(kpl_module_forward(ps, x));
    assert_non_null(strstr(kpl_last_error(), "expected (N, C x 4, H, W) input"));
    assert_null(kpl_module_forward(in, x));
    assert_non_null(strstr(kpl_last_error(), "expected (N, 3, ...) input"));
    kpl_tensor *one = NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){2, 3, 1, 1}, 1));
    assert_null(kpl_module_forward(in, one));
    assert_non_null(strstr(kpl_last_error(), "more than 1 spatial element"));
    kpl_pool_pop(pool);
    kpl_module_destroy(root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_networks_reference),
        cmocka_unit_test(test_layers_reference),
        cmocka_unit_test(test_sngan_full_size),
        cmocka_unit_test(test_second_order),
        cmocka_unit_test(test_spectral_norm_api),
        cmocka_unit_test(test_models),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests_name("gannets", tests, NULL, NULL);
}
