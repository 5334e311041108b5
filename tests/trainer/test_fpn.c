/* test_fpn.c — the feature pyramid (layers.h's kpl_nn_fpn) against a
 * PyTorch implementation of torchvision's FeaturePyramidNetwork +
 * LastLevelP6P7 (tests/graph/detops_ref.py; its numbers in
 * tests/graph/data/fpn.bin): the parameters load by torchvision's names
 * and shapes, the five outputs and every gradient (inputs and weights)
 * agree; the initialisation; a GN head on top; the errors. */
#include "kpl_refdata.h"
#include "trainer.h"

static const char *const fpn_cases[] = {"a", "b"};

/* An FPN built from case `cs`'s sizes under a sequential root. */
static kpl_module *build(const kpl_ref_file *rf, const char *cs, kpl_module **root)
{
    const kpl_ref_tensor *pr = KPL_REF(rf, "fpn.%s.params", cs);
    int n = (int)pr->v[0];
    int64_t in[8];
    for (int i = 0; i < n; i++) in[i] = (int64_t)pr->v[1 + i];
    int64_t out = (int64_t)pr->v[1 + n];
    int extra = (int)pr->v[2 + n];
    bool from_input = pr->v[3 + n] != 0;
    kpl_module *fpn = NULL;
    OK(kpl_nn_sequential_root(NULL, 3, root));
    OK(kpl_nn_fpn(*root, "fpn", in, n, out, extra, from_input, &fpn));
    return fpn;
}

static void test_fpn_reference(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(DETOPS_DATA_DIR, "fpn.bin");
    for (size_t c = 0; c < sizeof fpn_cases / sizeof fpn_cases[0]; c++) {
        const char *cs = fpn_cases[c];
        kpl_module *root = NULL, *fpn = build(rf, cs, &root);
        /* every parameter has a torchvision twin of its name and shape, and
         * every one of the file's is used */
        int nparam = kpl_module_num_params(fpn), nfile = 0;
        for (int i = 0; i < rf->n; i++)
            if (!strncmp(rf->t[i].name, "fpn.", 4) && rf->t[i].name[4] == cs[0] &&
                !strncmp(rf->t[i].name + 5, ".param.", 7))
                nfile++;
        assert_int_equal(nparam, nfile);
        for (int i = 0; i < nparam; i++) {
            const char *name = kpl_module_param_name(fpn, i);
            const kpl_ref_tensor *r = kpl_ref_find(rf, "fpn.%s.param.%s", cs, name);
            if (!r) fail_msg("fpn %s: parameter %s has no torchvision twin", cs, name);
            kpl_tensor *p = kpl_module_params(fpn)[i];
            assert_int_equal(kpl_tensor_ndim(p), r->ndim);
            for (int d = 0; d < r->ndim; d++) assert_int_equal(kpl_tensor_shape(p)[d], r->shape[d]);
            float *v = kpl_tensor_host_mutable(p);
            for (int64_t j = 0; j < r->numel; j++) v[j] = (float)r->v[j];
        }
        kpl_pool *pool = NN(kpl_pool_push());
        int n = (int)KPL_REF(rf, "fpn.%s.params", cs)->v[0];
        kpl_tensor *xs[8];
        kpl_tensor_list in = {.n = n}, out;
        for (int i = 0; i < n; i++) {
            xs[i] = kpl_ref_param(KPL_REF(rf, "fpn.%s.x%d", cs, i), KPL_F32);
            in.t[i] = xs[i];
        }
        OK(kpl_module_forward_list(fpn, &in, &out));
        kpl_tensor *loss = NULL;
        for (int i = 0; i < out.n; i++) {
            char what[32];
            snprintf(what, sizeof what, "fpn %s P%d", cs, 3 + i);
            kpl_ref_expect(out.t[i], KPL_REF(rf, "fpn.%s.out%d", cs, i), 1e-5, 1e-6, what);
            kpl_tensor *gy = kpl_ref_tensor_of(KPL_REF(rf, "fpn.%s.gy%d", cs, i), KPL_F32);
            kpl_tensor *term = kpl_sum(kpl_mul(out.t[i], gy), NULL, 0, false);
            loss = loss ? kpl_add(loss, term) : term;
        }
        assert_null(kpl_ref_find(rf, "fpn.%s.out%d", cs, out.n)); /* no level missing */
        OK(kpl_backward(loss, NULL, false));
        for (int i = 0; i < n; i++) {
            char what[32];
            snprintf(what, sizeof what, "fpn %s d/dC%d", cs, 3 + i);
            kpl_ref_expect(kpl_grad_get(xs[i]), KPL_REF(rf, "fpn.%s.gx%d", cs, i), 1e-5, 1e-6,
                           what);
        }
        for (int i = 0; i < nparam; i++) {
            const char *name = kpl_module_param_name(fpn, i);
            kpl_ref_expect(kpl_grad_get(kpl_module_params(fpn)[i]),
                           KPL_REF(rf, "fpn.%s.grad.%s", cs, name), 1e-5, 1e-6, name);
        }
        kpl_pool_pop(pool);
        for (int i = 0; i < n; i++) kpl_tensor_release(xs[i]);
        kpl_module_destroy(root);
    }
    kpl_ref_free(rf);
}

/* torchvision's init: weights U(-sqrt(3 / fan_in), +), biases 0; the
 * names in torchvision's order. */
static void test_fpn_init(void **state)
{
    (void)state;
    kpl_module *root = NULL, *fpn = NULL;
    OK(kpl_nn_sequential_root(NULL, 11, &root));
    OK(kpl_nn_fpn(root, "fpn", (int64_t[]){128, 256, 512}, 3, 64, 2, true, &fpn));
    static const char *const names[] = {
        "inner_blocks.0.weight", "inner_blocks.0.bias", "inner_blocks.1.weight",
        "inner_blocks.1.bias",   "inner_blocks.2.weight", "inner_blocks.2.bias",
        "layer_blocks.0.weight", "layer_blocks.0.bias", "layer_blocks.1.weight",
        "layer_blocks.1.bias",   "layer_blocks.2.weight", "layer_blocks.2.bias",
        "extra_blocks.p6.weight", "extra_blocks.p6.bias", "extra_blocks.p7.weight",
        "extra_blocks.p7.bias"};
    assert_int_equal(kpl_module_num_params(fpn), 16);
    for (int i = 0; i < 16; i++) assert_string_equal(kpl_module_param_name(fpn, i), names[i]);
    for (int i = 0; i < 16; i++) {
        kpl_tensor *p = kpl_module_params(fpn)[i];
        int64_t n = kpl_tensor_numel(p);
        const float *v = kpl_tensor_host_data(p);
        if (i % 2) { /* a bias */
            for (int64_t j = 0; j < n; j++) assert_true(v[j] == 0);
            continue;
        }
        const int64_t *s = kpl_tensor_shape(p);
        double bound = sqrt(3.0 / (double)(s[1] * s[2] * s[3])), s2 = 0, mx = 0;
        for (int64_t j = 0; j < n; j++) {
            s2 += (double)v[j] * v[j];
            if (fabs(v[j]) > mx) mx = fabs(v[j]);
        }
        assert_true(mx <= bound);
        assert_true(mx > 0.95 * bound); /* the whole range is used */
        /* U(-b, b) has standard deviation b / sqrt(3) */
        assert_close(sqrt(s2 / (double)n), bound / sqrt(3.0), 0.05, 0, names[i], 0);
    }
    /* p6 reads C5 (512 channels) here, P5 (64) without extra_from_input */
    assert_int_equal(kpl_tensor_shape(kpl_module_get_param(kpl_module_find(fpn, "extra_blocks.p6"),
                                                           "weight"))[1], 512);
    kpl_module *fpn2 = NULL;
    OK(kpl_nn_fpn(root, "fpn2", (int64_t[]){128, 256, 512}, 3, 64, 1, false, &fpn2));
    assert_int_equal(kpl_tensor_shape(kpl_module_get_param(kpl_module_find(fpn2, "extra_blocks.p6"),
                                                           "weight"))[1], 64);
    assert_null(kpl_module_find(fpn2, "extra_blocks.p7"));
    kpl_module_destroy(root);
}

/* An FCOS-style use: P3..P7 of one image of 64 x 64 through a shared GN
 * head (conv 3x3 + group norm 32 + ReLU), the sizes of every level. */
static void test_fpn_with_gn_head(void **state)
{
    (void)state;
    kpl_module *root = NULL, *fpn = NULL, *head = NULL;
    OK(kpl_nn_sequential_root(NULL, 5, &root));
    OK(kpl_nn_fpn(root, "fpn", (int64_t[]){16, 32, 64}, 3, 64, 2, false, &fpn));
    OK(kpl_nn_sequential(root, "head", &head));
    kpl_nn_conv c = {KPL_NN_CONV_INIT(64, 64, 3), .padding = {1, 1}};
    OK(kpl_nn_conv2d(head, "0", &c, NULL));
    OK(kpl_nn_group_norm(head, "1", 32, 64, 1e-5, NULL));
    OK(kpl_nn_relu(head, "2", NULL));
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_rng *rng = kpl_rng_create(1);
    int64_t hw[3] = {8, 4, 2}, ch[3] = {16, 32, 64};
    kpl_tensor_list in = {.n = 3}, out;
    for (int i = 0; i < 3; i++)
        in.t[i] = NN(kpl_randn(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){1, ch[i], hw[i], hw[i]},
                               rng, 0, 1));
    OK(kpl_module_forward_list(fpn, &in, &out));
    assert_int_equal(out.n, 5);
    static const int64_t sizes[5] = {8, 4, 2, 1, 1};
    for (int i = 0; i < 5; i++) {
        kpl_tensor *y = NN(kpl_module_forward(head, out.t[i]));
        assert_int_equal(kpl_tensor_shape(y)[1], 64);
        assert_int_equal(kpl_tensor_shape(y)[2], sizes[i]);
        assert_int_equal(kpl_tensor_shape(y)[3], sizes[i]);
    }
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
    kpl_module_destroy(root);
}

static void test_fpn_errors(void **state)
{
    (void)state;
    kpl_module *root = NULL, *fpn = NULL;
    OK(kpl_nn_sequential_root(NULL, 5, &root));
    int64_t ch[3] = {4, 8, 16};
    FAILS(kpl_nn_fpn(root, "a", ch, 0, 8, 2, false, NULL), KPL_EINVAL,
          "fpn a: 0 input maps and 2 extra levels");
    FAILS(kpl_nn_fpn(root, "b", ch, 3, 8, 14, false, NULL), KPL_EINVAL, "at most 16 maps in all");
    FAILS(kpl_nn_fpn(root, "c", ch, 3, 0, 2, false, NULL), KPL_EINVAL,
          "fpn c: out_channels 0 must be positive");
    FAILS(kpl_nn_fpn(root, "d", (int64_t[]){4, -1, 8}, 3, 8, 2, false, NULL), KPL_EINVAL,
          "fpn d: in_channels[1] is -1");
    OK(kpl_nn_fpn(root, "fpn", ch, 3, 8, 2, false, &fpn));
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *c3 = NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){2, 4, 8, 8}, 1));
    kpl_tensor *c4 = NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){2, 8, 4, 4}, 1));
    kpl_tensor *c5 = NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){2, 16, 2, 2}, 1));
    kpl_tensor *bad = NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){2, 9, 4, 4}, 1));
    kpl_tensor *other = NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){1, 16, 2, 2}, 1));
    kpl_tensor_list out;
    FAILS(kpl_module_forward_list(fpn, &(kpl_tensor_list){.n = 2, .t = {c3, c4}}, &out),
          KPL_EINVAL, "fpn fpn: takes 3 feature maps, finest first; got 2");
    FAILS(kpl_module_forward_list(fpn, &(kpl_tensor_list){.n = 3, .t = {c3, bad, c5}}, &out),
          KPL_ESHAPE, "fpn fpn: map 1 has shape (2,9,4,4); expected (2, 8, H, W)");
    FAILS(kpl_module_forward_list(fpn, &(kpl_tensor_list){.n = 3, .t = {c3, c4, other}}, &out),
          KPL_ESHAPE, "map 2 has shape (1,16,2,2); expected (2, 16, H, W)");
    OK(kpl_module_forward_list(fpn, &(kpl_tensor_list){.n = 3, .t = {c3, c4, c5}}, &out));
    assert_int_equal(out.n, 5);
    kpl_pool_pop(pool);
    kpl_module_destroy(root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fpn_reference),
        cmocka_unit_test(test_fpn_init),
        cmocka_unit_test(test_fpn_with_gn_head),
        cmocka_unit_test(test_fpn_errors),
    };
    return cmocka_run_group_tests_name("fpn", tests, NULL, NULL);
}
