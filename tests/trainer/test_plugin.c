/* test_plugin.c — the registries and kpl_plugin_load, in one process
 * linked to libkpl.so as the kpl command is: a refused plugin keeps
 * nothing (its items are never read), a name is registered once, a plugin
 * loads once, and what a good plugin registers is found by name. */
#include "kpl_test.h"
#include "trainer.h"

#ifndef PLUGIN_DIR
#error "PLUGIN_DIR: where the test plugins are built"
#endif

static kpl_status nop_create(kpl_trainer *t, void **state)
{
    (void)t, (void)state;
    return KPL_OK;
}

#define KPL_STR_(x) #x
#define KPL_STR(x) KPL_STR_(x)

static void test_refused_plugins_keep_nothing(void **state)
{
    (void)state;
    int tasks = kpl_task_count();
    FAILS(kpl_plugin_load(PLUGIN_DIR "/libplugin_bad_abi.so"), KPL_EFORMAT,
          "was built against kpl ABI 999, this kpl is ABI " KPL_STR(KPL_ABI_VERSION));
    assert_null(kpl_task_find("from_another_kpl"));
    FAILS(kpl_plugin_load(PLUGIN_DIR "/libplugin_dup.so"), KPL_EINVAL,
          "task 'classification' is registered twice: by kpl itself and by plugin ");
    assert_ptr_equal(kpl_task_find("classification"), &kpl_task_classification);
    FAILS(kpl_plugin_load(PLUGIN_DIR "/libplugin_none.so"), KPL_EFORMAT, "not a kpl plugin");
    assert_null(kpl_task_find("no_abi"));
    assert_int_equal(kpl_task_count(), tasks);
    assert_int_equal(kpl_plugin_count(), 0);
    FAILS(kpl_plugin_load(PLUGIN_DIR "/nothere.so"), KPL_ENOTFOUND, "no such file");
}

static void test_good_plugin(void **state)
{
    (void)state;
    OK(kpl_plugin_load(AE_PLUGIN));
    OK(kpl_plugin_load(AE_PLUGIN)); /* once */
    assert_int_equal(kpl_plugin_count(), 1);
    assert_non_null(strstr(kpl_plugin_path(0), "/lib/libkpl_autoencoder.so"));
    const kpl_task_kind *t = kpl_task_find("autoencoder");
    assert_non_null(t);
    assert_string_equal(t->best_metric, "mse");
    assert_non_null(kpl_zoo_find("autoencoder"));
    const kpl_optim_rule *lion = kpl_optim_rule_find("lion");
    assert_non_null(lion);
    /* its model builds from a config, as a root and as a child */
    kpl_model_config c = {.name = "autoencoder", .in_channels = 1, .in_h = 28, .in_w = 28, .width = 4};
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m));
    assert_true(kpl_module_num_params(m) > 0);
    kpl_module_destroy(m);
    /* Lion by hand: m = 0, g = [0.5, -2], b1 0.9, b2 0.99, lr 0.1, wd 0:
     * p -= 0.1 sign(0.1 g) = p - 0.1 [1, -1];  m = 0.01 g */
    int64_t two = 2;
    kpl_tensor *p = NULL, *g = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 1, &two, &p));
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 1, &two, &g));
    float *pv = kpl_tensor_host_mutable(p), *gv = kpl_tensor_host_mutable(g);
    pv[0] = 1, pv[1] = 1, gv[0] = 0.5f, gv[1] = -2;
    OK(kpl_set_requires_grad(p, true));
    kpl_grad_set(p, g);
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    snprintf(oc.name, sizeof oc.name, "lion");
    oc.beta2 = 0.99;
    kpl_optim *o = NULL;
    OK(kpl_optim_create(&oc, 1, &p, NULL, &o));
    const char *const *slots = NULL;
    assert_int_equal(kpl_optim_state_slots(o, &slots), 1);
    assert_string_equal(slots[0], "exp_avg");
    OK(kpl_optim_step(o));
    assert_float_equal(tget(p, 0), 0.9, 1e-7);
    assert_float_equal(tget(p, 1), 1.1, 1e-7);
    kpl_tensor *mv = kpl_optim_state_get(o, 0, 0);
    assert_float_equal(tget(mv, 0), 0.005, 1e-8);
    assert_float_equal(tget(mv, 1), -0.02, 1e-8);
    kpl_optim_destroy(o);
    kpl_tensor_release(g);
    kpl_tensor_release(p);
    /* a program registering a name a plugin has */
    static const kpl_task_kind again = {.name = "autoencoder", .create = nop_create};
    FAILS(kpl_task_register(&again), KPL_EINVAL,
          "task 'autoencoder' is registered twice: by plugin ");
    static const kpl_task_kind bad_name = {.name = "Bad Name", .create = nop_create};
    FAILS(kpl_task_register(&bad_name), KPL_EINVAL, "use a-z, 0-9, _ and -");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refused_plugins_keep_nothing),
        cmocka_unit_test(test_good_plugin),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
