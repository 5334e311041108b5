/* test_module_recompute.c — recomputed modules (kpl_module_set_recompute,
 * memory.recompute: blocks): the zoo's ResNet and U-Net with their marked
 * blocks recomputed give the same loss, gradients and running statistics
 * bit for bit as without, in f32 and under bf16 autocast, while the
 * forward holds less; a kind that does not declare itself replayable is
 * refused by name. */
#include "kpl_test.h"
#include "trainer.h"

int run_module_recompute_tests(void);

typedef struct {
    float loss;
    int nvals;
    float *vals[160]; /* gradients, then buffers */
    size_t bytes[160];
    size_t held;
    uint64_t replays;
    int units;
} step_result;

static float *copy_of(kpl_tensor *t, size_t *bytes)
{
    assert_non_null(t);
    *bytes = kpl_tensor_nbytes(t);
    float *v = malloc(*bytes);
    assert_non_null(v);
    OK(kpl_tensor_to_host(t, v, *bytes));
    return v;
}

/* One training step; penalty: the loss also takes mean((d sum(y) / dx)^2)
 * through a double backward (WGAN-GP's form). */
static void step_with(const kpl_model_config *c, const int64_t *xs, bool recompute,
                      kpl_dtype autocast, bool regen, bool penalty, step_result *r)
{
    memset(r, 0, sizeof *r);
    bool prev_regen = kpl_set_regenerate(regen);
    /* what the step holds, apart from what earlier cases left cached (the
     * convolutions' own buffers) */
    size_t base = kpl_device_memory_stats(kpl_device_cpu()).allocated;
    kpl_module *m = NULL;
    OK(kpl_zoo_create(c, NULL, 3, &m));
    if (recompute) OK(kpl_module_recompute_units(m, true, &r->units));
    kpl_module_set_training(m, true);
    kpl_rng *rng = kpl_rng_create(9);
    uint64_t r0 = kpl_recompute_count();
    kpl_pool *p = NN(kpl_pool_push());
    kpl_tensor *x = NN(kpl_randn(kpl_device_cpu(), KPL_F32, 4, xs, rng, 0, 1));
    if (penalty) OK(kpl_set_requires_grad(x, true));
    kpl_dtype prev = KPL_F32;
    OK(kpl_set_autocast(autocast, &prev));
    kpl_tensor *y = NN(kpl_module_forward(m, x));
    OK(kpl_set_autocast(prev, NULL));
    kpl_tensor *loss = NN(kpl_mean(NN(kpl_square(y)), NULL, 0, false));
    if (penalty) {
        kpl_tensor *g = NULL;
        OK(kpl_grad(NN(kpl_sum(y, NULL, 0, false)), NULL, 1, &x, true, &g));
        loss = NN(kpl_add(loss, NN(kpl_mean(NN(kpl_square(NN(g))), NULL, 0, false))));
    }
    r->held = kpl_device_memory_stats(kpl_device_cpu()).allocated - base;
    OK(kpl_backward(loss, NULL, false));
    r->loss = (float)tget(loss, 0);
    int np = kpl_module_num_params(m), nb = kpl_module_num_buffers(m);
    assert_true(np + nb <= 160);
    for (int i = 0; i < np; i++)
        r->vals[r->nvals] = copy_of(kpl_grad_get(kpl_module_params(m)[i]), &r->bytes[r->nvals]),
        r->nvals++;
    for (int i = 0; i < nb; i++)
        r->vals[r->nvals] = copy_of(kpl_module_buffers(m)[i], &r->bytes[r->nvals]), r->nvals++;
    kpl_pool_pop(p);
    r->replays = kpl_recompute_count() - r0;
    kpl_rng_destroy(rng);
    kpl_module_destroy(m);
    kpl_set_regenerate(prev_regen);
}

static void one_step(const kpl_model_config *c, const int64_t *xs, bool recompute,
                     kpl_dtype autocast, step_result *r)
{
    step_with(c, xs, recompute, autocast, true, false, r);
}

static void expect_same(const step_result *a, const step_result *b)
{
    assert_memory_equal(&a->loss, &b->loss, sizeof a->loss);
    assert_int_equal(a->nvals, b->nvals);
    for (int i = 0; i < a->nvals; i++) {
        assert_int_equal(a->bytes[i], b->bytes[i]);
        if (memcmp(a->vals[i], b->vals[i], a->bytes[i]))
            print_message("value %d of %d differs (%zu bytes)\n", i, a->nvals, a->bytes[i]);
        assert_memory_equal(a->vals[i], b->vals[i], a->bytes[i]);
    }
}

static void free_result(step_result *r)
{
    for (int i = 0; i < r->nvals; i++)
        free(r->vals[i]);
}

/* A zoo model of width 8 on square inputs. */
static kpl_model_config model(const char *name, int64_t classes, int64_t channels, int64_t side,
                              int64_t depth)
{
    kpl_model_config c = {.num_classes = classes,
                          .in_channels = channels,
                          .in_h = side,
                          .in_w = side,
                          .depth = depth,
                          .width = 8};
    snprintf(c.name, sizeof c.name, "%s", name);
    return c;
}

static void test_zoo_blocks_exact(void **state)
{
    (void)state;
    kpl_model_config res = model("resnet", 10, 3, 16, 18), unet = model("unet", 3, 1, 32, 2);
    kpl_model_config deeplab = model("deeplabv3", 3, 3, 48, 18);
    res.stem = KPL_STEM_CIFAR;
    OK(kpl_keyvals_set(&unet.keys, "upsample", "transpose"));
    OK(kpl_keyvals_set(&deeplab.keys, "aux", "false"));
    OK(kpl_keyvals_set(&deeplab.keys, "aspp_channels", "16"));
    struct {
        const kpl_model_config *c;
        int64_t xs[4];
        int units;
    } cases[3] = {{&res, {8, 3, 16, 16}, 9}, /* 8 blocks and the stem */
                  {&unet, {4, 1, 32, 32}, 5},
                  {&deeplab, {2, 3, 48, 48}, 10}}; /* 8 blocks, the stem, ASPP */
    kpl_dtype dts[2] = {KPL_F32, KPL_BF16};
    for (int k = 0; k < 3; k++)
        for (int d = 0; d < 2; d++) {
            step_result a, b;
            /* a first step lets the convolutions' timed choice settle (its
             * first call of a problem may run another kernel) */
            one_step(cases[k].c, cases[k].xs, false, dts[d], &a);
            free_result(&a);
            one_step(cases[k].c, cases[k].xs, false, dts[d], &a);
            one_step(cases[k].c, cases[k].xs, true, dts[d], &b);
            print_message("%s %s: forward holds %zu bytes, %zu with %d blocks recomputed "
                          "(%llu replays)\n",
                          cases[k].c->name, kpl_dtype_name(dts[d]), a.held, b.held, b.units,
                          (unsigned long long)b.replays);
            assert_int_equal(b.units, cases[k].units);
            /* every unit but the last one before the backward runs again */
            assert_int_equal(b.replays, cases[k].units - 1);
            assert_int_equal(a.replays, 0);
            assert_true(b.held < a.held * 0.85);
            expect_same(&a, &b);
            free_result(&a);
            free_result(&b);
        }
}

/* Norm outputs made again in the backward (kpl_set_regenerate): the same
 * loss, gradients and running statistics bit for bit as when kept, with
 * less held at the forward's end; batch norm (fused with its ReLU), group
 * norm then ReLU, WGAN-GP's critic (layer norm then leaky ReLU), f32 and
 * bf16 autocast, a double backward, and with the blocks recomputed too. */
static void test_zoo_regenerate_exact(void **state)
{
    (void)state;
    kpl_model_config res = model("resnet", 10, 3, 16, 18), gn = model("resnet", 10, 3, 16, 18);
    kpl_model_config unet = model("unet", 3, 1, 32, 2), critic = model("dcgan_d", 1, 3, 32, 0);
    res.stem = gn.stem = KPL_STEM_CIFAR;
    gn.norm = KPL_NORM_GROUP;
    OK(kpl_keyvals_set(&unet.keys, "upsample", "transpose"));
    /* WGAN-GP's critic: layer norm (one group) then leaky ReLU */
    OK(kpl_keyvals_set(&critic.keys, "d_norm", "layer"));
    struct {
        const kpl_model_config *c;
        int64_t xs[4];
    } cases[4] = {{&res, {8, 3, 16, 16}},
                  {&gn, {4, 3, 16, 16}},
                  {&unet, {4, 1, 32, 32}},
                  {&critic, {8, 3, 32, 32}}};
    kpl_dtype dts[2] = {KPL_F32, KPL_BF16};
    for (int k = 0; k < 4; k++)
        for (int v = 0; v < 4; v++) {
            kpl_dtype dt = dts[v & 1];
            if (k == 3 && v == 3) continue; /* the critic marks no blocks */
            bool penalty = v == 2, blocks = v == 3;
            step_result a, b;
            step_with(cases[k].c, cases[k].xs, blocks, dt, false, penalty, &a); /* settles */
            free_result(&a);
            step_with(cases[k].c, cases[k].xs, blocks, dt, false, penalty, &a);
            step_with(cases[k].c, cases[k].xs, blocks, dt, true, penalty, &b);
            print_message("%s%s %s%s%s: forward holds %zu bytes kept, %zu made again\n",
                          cases[k].c->name, cases[k].c->norm == KPL_NORM_GROUP ? " (gn)" : "",
                          kpl_dtype_name(dt), penalty ? " double backward" : "",
                          blocks ? " blocks" : "", a.held, b.held);
            if (!blocks && !penalty) assert_true(b.held < a.held * (dt == KPL_F32 ? 0.9 : 0.95));
            expect_same(&a, &b);
            free_result(&a);
            free_result(&b);
        }
}

static int host_calls;

/* a module that counts its calls on the host: not replayable */
static kpl_status counting_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    (void)m;
    host_calls++;
    out->n = 1;
    out->t[0] = kpl_scalar_op(KPL_BIN_MUL, in->t[0], host_calls, false);
    return out->t[0] ? KPL_OK : kpl_last_status();
}

static const kpl_module_kind counting_kind = {"counting", counting_forward, NULL, 0};

static void test_not_replayable_refused(void **state)
{
    (void)state;
    kpl_module *net = NULL, *stage = NULL;
    OK(kpl_nn_sequential_root(NULL, 1, &net));
    OK(kpl_nn_sequential(net, "stage", &stage));
    OK(kpl_nn_linear(stage, "fc", 4, 4, true, NULL));
    OK(kpl_module_create(stage, "counter", &counting_kind, NULL, NULL));
    FAILS(kpl_module_set_recompute(stage, true), KPL_EINVAL,
          "module stage (sequential): cannot be recomputed: module stage.counter is of kind "
          "'counting'");
    assert_false(kpl_module_recompute(stage));
    /* the linear alone may be */
    OK(kpl_module_set_recompute(kpl_module_find(stage, "fc"), true));
    assert_true(kpl_module_recompute(kpl_module_find(stage, "fc")));
    /* no marks, no units */
    int n = -1;
    OK(kpl_module_recompute_units(net, true, &n));
    assert_int_equal(n, 0);
    /* a span of children: the linear alone is one; with the counter it is
     * refused the same way */
    FAILS(kpl_module_mark_recompute_span(stage, 1, 3), KPL_EINVAL,
          "span 1..2 is not a run of the module's 2 children");
    OK(kpl_module_mark_recompute_span(stage, 0, 1));
    OK(kpl_module_recompute_units(net, true, &n));
    assert_int_equal(n, 1);
    OK(kpl_module_mark_recompute_span(stage, 0, 2));
    FAILS(kpl_module_recompute_units(net, true, &n), KPL_EINVAL,
          "module stage.counter is of kind "
          "'counting'");
    kpl_module_mark_recompute_unit(stage);
    FAILS(kpl_module_recompute_units(net, true, &n), KPL_EINVAL, "kind 'counting'");
    kpl_module_destroy(net);
}

int run_module_recompute_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zoo_blocks_exact),
        cmocka_unit_test(test_zoo_regenerate_exact),
        cmocka_unit_test(test_not_replayable_refused),
    };
    return cmocka_run_group_tests_name("module_recompute", tests, NULL, NULL);
}
