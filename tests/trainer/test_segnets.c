/* test_segnets.c — the zoo's segmentation networks (trainer/nn/segnets.c)
 * against the same networks in PyTorch (bench/torch_segnets.py; the
 * numbers in tests/trainer/data/segnets.bin, made by segnets_ref.py):
 *  - DeepLabv3 on a ResNet-18 of width 4, output stride 8 and 16, ASPP
 *    rates 1, 2, 3, an odd 33 x 35 input: in training mode (batch
 *    statistics, the aux head, the dropouts switched to evaluation mode on
 *    both sides so that nothing is random) the two outputs, the input's
 *    and every parameter's gradient, the running statistics after the
 *    forward; in evaluation mode (the file's running statistics) the one
 *    output and the gradients;
 *  - U-Net of width 4 and depth 3, transposed convolutions and bilinear
 *    upsampling, on an odd 21 x 20 input (the decoder pads);
 *  - torchvision's deeplabv3_resnet50(num_classes=21, aux_loss=True):
 *    every parameter and buffer name and shape, 42,004,074 parameters;
 *  - the errors of the models' own keys. */
#include "kpl_refdata.h"
#include "trainer.h"

/* Dropout layers under m to evaluation mode (the rest keeps its mode):
 * the reference does the same, so the comparison needs no random masks. */
static void dropouts_off(kpl_module *m)
{
    if (!strcmp(kpl_module_kind_of(m)->name, "dropout")) kpl_module_set_training(m, false);
    for (int i = 0; i < kpl_module_num_children(m); i++) dropouts_off(kpl_module_child(m, i));
}

/* Every parameter and buffer of m from <pfx>.param.<name> and
 * <pfx>.<bufs>.<name>: each has a twin of its name and shape, and the
 * file has no other. */
static void load(kpl_module *m, const kpl_ref_file *rf, const char *pfx, const char *bufs)
{
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%s.param.", pfx);
    assert_int_equal(kpl_module_num_params(m), kpl_ref_count_prefixed(rf, prefix));
    for (int i = 0; i < kpl_module_num_params(m); i++) {
        const char *name = kpl_module_param_name(m, i);
        const kpl_ref_tensor *r = kpl_ref_find(rf, "%s%s", prefix, name);
        if (!r) fail_msg("%s: parameter %s has no torch twin", pfx, name);
        kpl_ref_copy_into(kpl_module_params(m)[i], r, name);
    }
    snprintf(prefix, sizeof prefix, "%s.%s.", pfx, bufs);
    assert_int_equal(kpl_module_num_buffers(m), kpl_ref_count_prefixed(rf, prefix));
    for (int i = 0; i < kpl_module_num_buffers(m); i++) {
        const char *name = kpl_module_buffer_name(m, i);
        const kpl_ref_tensor *r = kpl_ref_find(rf, "%s%s", prefix, name);
        if (!r) fail_msg("%s: buffer %s has no torch twin", pfx, name);
        kpl_ref_copy_into(kpl_module_buffers(m)[i], r, name);
    }
}

/* t against <cs>.<name>: 1e-5 relative (test_fpn's), plus an absolute
 * allowance of ERR_FACTOR x PyTorch's own f32 error on this tensor of this
 * case (<cs>.f32err.<name>, a fraction of the largest value), at least
 * test_fpn's 1e-6.  Training-mode gradients pass through up to 20 batch
 * norms over a few dozen values each, where f32 loses up to 3e-5 of the
 * largest value in PyTorch as well.  kpl's f32 lands 1 to 4 times as far
 * (6.5 on a running mean off by 1e-7) as PyTorch's, whose sums go in
 * another order; 8 leaves room for that and still catches a wrong
 * dilation, pad or statistic, which move results by percents. */
#define ERR_FACTOR 8.0
static void expect(kpl_tensor *t, const kpl_ref_file *rf, const char *cs, const char *name)
{
    double e32 = KPL_REF(rf, "%s.f32err.%s", cs, name)->v[0];
    char what[160];
    snprintf(what, sizeof what, "%s %s", cs, name);
    kpl_ref_expect(t, KPL_REF(rf, "%s.%s", cs, name), 1e-5, fmax(1e-6, ERR_FACTOR * e32), what);
}

/* Runs m on <cs>.x and checks the outputs <cs>.out<i>; with gradients,
 * backward from sum(out_i * <cs>.gy<i>) and checks <cs>.gx and every
 * <cs>.grad.<name> (a parameter without one must get none: the aux head
 * in evaluation mode); in training, the running statistics <cs>.<bufs>.
 * Tolerances: expect's. */
static void check_case(kpl_module *m, const kpl_ref_file *rf, const char *cs, const char *bufs)
{
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = kpl_ref_param(KPL_REF(rf, "%s.x", cs), KPL_F32);
    kpl_tensor_list in = {.n = 1, .t = {x}}, out;
    OK(kpl_module_forward_list(m, &in, &out));
    assert_null(kpl_ref_find(rf, "%s.out%d", cs, out.n)); /* no output missing */
    bool grads = kpl_ref_find(rf, "%s.gx", cs) != NULL;
    kpl_tensor *loss = NULL;
    for (int i = 0; i < out.n; i++) {
        char name[16];
        snprintf(name, sizeof name, "out%d", i);
        expect(out.t[i], rf, cs, name);
        if (!grads) continue;
        kpl_tensor *gy = kpl_ref_tensor_of(KPL_REF(rf, "%s.gy%d", cs, i), KPL_F32);
        kpl_tensor *term = kpl_sum(kpl_mul(out.t[i], gy), NULL, 0, false);
        loss = loss ? kpl_add(loss, term) : term;
    }
    if (bufs && kpl_module_training(m))
        for (int i = 0; i < kpl_module_num_buffers(m); i++) {
            char name[160];
            snprintf(name, sizeof name, "%s.%s", bufs, kpl_module_buffer_name(m, i));
            expect(kpl_module_buffers(m)[i], rf, cs, name);
        }
    if (grads) {
        OK(kpl_backward(loss, NULL, false));
        expect(kpl_grad_get(x), rf, cs, "gx");
        for (int i = 0; i < kpl_module_num_params(m); i++) {
            const char *name = kpl_module_param_name(m, i);
            kpl_tensor *g = kpl_grad_get(kpl_module_params(m)[i]);
            char gname[160];
            snprintf(gname, sizeof gname, "grad.%s", name);
            if (kpl_ref_find(rf, "%s.%s", cs, gname)) {
                expect(g, rf, cs, gname);
                continue;
            }
            for (int64_t j = 0; g && j < kpl_tensor_numel(g); j++)
                if (tget(g, j) != 0) fail_msg("%s: %s has a gradient, torch's none", cs, name);
        }
    }
    kpl_pool_pop(pool);
    kpl_tensor_release(x);
}

/* The small DeepLabv3 of dl.config at output stride os. */
static kpl_module *make_deeplab(const kpl_ref_file *rf, int os, int64_t h, int64_t w)
{
    const kpl_ref_tensor *c = KPL_REF(rf, "dl.config");
    kpl_model_config mc;
    memset(&mc, 0, sizeof mc);
    snprintf(mc.name, sizeof mc.name, "deeplabv3");
    mc.depth = (int64_t)c->v[0], mc.width = (int64_t)c->v[1], mc.in_channels = (int64_t)c->v[2];
    mc.num_classes = (int64_t)c->v[3], mc.in_h = h, mc.in_w = w;
    char v[64];
    snprintf(v, sizeof v, "%d", os);
    OK(kpl_keyvals_set(&mc.keys, "output_stride", v));
    snprintf(v, sizeof v, "%lld", (long long)c->v[4]);
    OK(kpl_keyvals_set(&mc.keys, "aspp_channels", v));
    size_t at = (size_t)snprintf(v, sizeof v, "[");
    for (int64_t i = 5; i < c->numel; i++)
        at += (size_t)snprintf(v + at, sizeof v - at, "%s%lld", i > 5 ? ", " : "",
                               (long long)c->v[i]);
    snprintf(v + at, sizeof v - at, "]");
    OK(kpl_keyvals_set(&mc.keys, "aspp_rates", v));
    OK(kpl_keyvals_set(&mc.keys, "aux", "true"));
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&mc, NULL, 7, &m));
    return m;
}

static void test_deeplab_reference(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(SEG_DATA_DIR, "segnets.bin");
    static const char *const cases[] = {"os8.train", "os16.train", "os8.eval", "os16.eval"};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const kpl_ref_tensor *cc = KPL_REF(rf, "dl.%s.config", cases[k]);
        int os = (int)cc->v[0];
        bool training = strstr(cases[k], "train") != NULL;
        kpl_module *m = make_deeplab(rf, os, (int64_t)cc->v[3], (int64_t)cc->v[4]);
        load(m, rf, "dl", "buf");
        kpl_module_set_training(m, training);
        dropouts_off(m);
        char cs[32];
        snprintf(cs, sizeof cs, "dl.%s", cases[k]);
        check_case(m, rf, cs, "buf");
        kpl_module_destroy(m);
    }
    kpl_ref_free(rf);
}

static void test_unet_reference(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(SEG_DATA_DIR, "segnets.bin");
    static const char *const tags[] = {"t", "b"};
    for (int k = 0; k < 2; k++) {
        const kpl_ref_tensor *c = KPL_REF(rf, "unet.%s.config", tags[k]);
        kpl_model_config mc;
        memset(&mc, 0, sizeof mc);
        snprintf(mc.name, sizeof mc.name, "unet");
        mc.width = (int64_t)c->v[0], mc.depth = (int64_t)c->v[1];
        mc.num_classes = (int64_t)c->v[2];
        mc.in_channels = (int64_t)c->v[5], mc.in_h = (int64_t)c->v[6], mc.in_w = (int64_t)c->v[7];
        OK(kpl_keyvals_set(&mc.keys, "upsample", c->v[3] != 0 ? "bilinear" : "transpose"));
        kpl_module *m = NULL;
        OK(kpl_zoo_create(&mc, NULL, 7, &m));
        char pfx[16];
        snprintf(pfx, sizeof pfx, "unet.%s", tags[k]);
        load(m, rf, pfx, "buf");
        kpl_module_set_training(m, true);
        check_case(m, rf, pfx, "buf_after");
        kpl_module_destroy(m);
    }
    kpl_ref_free(rf);
}

/* torchvision's deeplabv3_resnet50(num_classes=21, aux_loss=True): the
 * same names, shapes and count. */
static void test_deeplab_resnet50_names(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(SEG_DATA_DIR, "segnets.bin");
    kpl_model_config mc;
    memset(&mc, 0, sizeof mc);
    snprintf(mc.name, sizeof mc.name, "deeplabv3");
    mc.depth = 50, mc.num_classes = 21, mc.in_channels = 3, mc.in_h = mc.in_w = 513;
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&mc, NULL, 1, &m)); /* the defaults: output stride 8, 12/24/36, 256, aux */
    assert_int_equal(kpl_module_param_count(m), (int64_t)KPL_REF(rf, "r50.count")->v[0]);
    assert_int_equal(kpl_module_param_count(m), 42004074);
    assert_int_equal(kpl_module_num_params(m), kpl_ref_count_prefixed(rf, "r50.p."));
    assert_int_equal(kpl_module_num_buffers(m), kpl_ref_count_prefixed(rf, "r50.b."));
    for (int pass = 0; pass < 2; pass++) {
        int n = pass ? kpl_module_num_buffers(m) : kpl_module_num_params(m);
        for (int i = 0; i < n; i++) {
            const char *name = pass ? kpl_module_buffer_name(m, i) : kpl_module_param_name(m, i);
            kpl_tensor *t = (pass ? kpl_module_buffers(m) : kpl_module_params(m))[i];
            const kpl_ref_tensor *r = kpl_ref_find(rf, "r50.%s.%s", pass ? "b" : "p", name);
            if (!r) fail_msg("%s has no torchvision twin", name);
            if (kpl_tensor_ndim(t) != r->numel) fail_msg("%s: %d dims, torchvision's %lld", name,
                                                         kpl_tensor_ndim(t), (long long)r->numel);
            for (int d = 0; d < kpl_tensor_ndim(t); d++)
                if (kpl_tensor_shape(t)[d] != (int64_t)r->v[d])
                    fail_msg("%s: dim %d is %lld, torchvision's %g", name, d,
                             (long long)kpl_tensor_shape(t)[d], r->v[d]);
        }
    }
    /* dilation, not stride, in layer3 and layer4 at output stride 8 */
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){1, 3, 65, 67}, 0.5));
    kpl_module_set_training(m, false);
    kpl_tensor *c5 = NN(kpl_module_forward(kpl_module_find(m, "backbone"), x));
    assert_int_equal(kpl_tensor_dim(c5, 1), 2048);
    assert_int_equal(kpl_tensor_dim(c5, 2), 9); /* ceil(65 / 8) */
    assert_int_equal(kpl_tensor_dim(c5, 3), 9);
    kpl_pool_pop(pool);
    kpl_module_destroy(m);
    kpl_ref_free(rf);
}

static void test_segnets_errors(void **state)
{
    (void)state;
    kpl_model_config mc;
    memset(&mc, 0, sizeof mc);
    snprintf(mc.name, sizeof mc.name, "deeplabv3");
    mc.depth = 18, mc.width = 8, mc.num_classes = 3, mc.in_channels = 3, mc.in_h = mc.in_w = 64;
    OK(kpl_keyvals_set(&mc.keys, "output_stride", "12"));
    kpl_module *m = NULL;
    FAILS(kpl_zoo_create(&mc, NULL, 1, &m), KPL_EINVAL, "output_stride: 8 or 16 (got 12)");
    assert_null(m);
    memset(&mc, 0, sizeof mc);
    snprintf(mc.name, sizeof mc.name, "unet");
    mc.depth = 5, mc.width = 4, mc.num_classes = 2, mc.in_channels = 1, mc.in_h = 16,
    mc.in_w = 64;
    FAILS(kpl_zoo_create(&mc, NULL, 1, &m), KPL_EINVAL, "5 halvings leave nothing of a 16x64");
    OK(kpl_keyvals_set(&mc.keys, "upsample", "nearest"));
    mc.depth = 2;
    FAILS(kpl_zoo_create(&mc, NULL, 1, &m), KPL_EINVAL, "upsample");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_deeplab_reference),
        cmocka_unit_test(test_unet_reference),
        cmocka_unit_test(test_deeplab_resnet50_names),
        cmocka_unit_test(test_segnets_errors),
    };
    return cmocka_run_group_tests_name("segnets", tests, NULL, NULL);
}
