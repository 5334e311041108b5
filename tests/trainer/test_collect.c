/* test_collect.c — the collectives a task asks of its trainer (task.h),
 * on one rank and under mpirun -np 2: sums, maxima and minima of host
 * numbers, a broadcast from either root, and an all-gather of byte strings
 * of different lengths (0 included) in rank order. */
#include "kpl_test.h"
#include "trainer.h"

#include <stdlib.h>
#include <unistd.h>

#define FM "/usr/share/datasets/fashion-mnist"

static kpl_status none_create(kpl_trainer *t, void **state)
{
    *state = NULL;
    kpl_module *m = NULL;
    KPL_TRY(kpl_nn_sequential_root(kpl_trainer_device(t), 1, &m));
    kpl_status st = kpl_nn_linear(m, "fc", 4, 2, true, NULL);
    if (st < 0) {
        kpl_module_destroy(m);
        return st;
    }
    return kpl_trainer_add_model(t, "model", "linear", m, NULL, NULL);
}
static void none_destroy(void *state) { (void)state; }
static kpl_status none_step(kpl_trainer *t, void *s, const kpl_batch *b, kpl_step_result *o)
{
    (void)t, (void)s, (void)b, (void)o;
    return kpl_set_error(KPL_ESTATE, "collect: no training here");
}
static kpl_status none_eval(kpl_trainer *t, void *s)
{
    (void)t, (void)s;
    return KPL_OK;
}
static kpl_status none_eval_batch(kpl_trainer *t, void *s, const kpl_batch *b)
{
    (void)t, (void)s, (void)b;
    return KPL_OK;
}
static kpl_status none_eval_end(kpl_trainer *t, void *s, kpl_eval_result *r)
{
    (void)t, (void)s, (void)r;
    return KPL_OK;
}
static const kpl_task_kind collect_task = {
    .name = "collect", .best_metric = "x", .best_higher = true, .create = none_create,
    .destroy = none_destroy, .train_step = none_step, .eval_begin = none_eval,
    .eval_batch = none_eval_batch, .eval_end = none_eval_end,
};

static void test_collectives(void **state)
{
    (void)state;
    if (access(FM "/train-images-idx3-ubyte.gz", R_OK) != 0)
        KPL_SKIP(KPL_TEST_SKIP_REF, "Fashion-MNIST (dataset-fashion-mnist)");
    const char *wsz = getenv("OMPI_COMM_WORLD_SIZE");
    int world = wsz ? atoi(wsz) : 1;
    /* one directory per job, the same on every rank of it (their parent) */
    char run[128], yaml[1024];
    snprintf(run, sizeof run, "/tmp/kpl-collect-%d-%d", (int)getppid(), world);
    snprintf(yaml, sizeof yaml,
             "task: collect\nepochs: 1\nthreads: 1\nrun_dir: %s/run\n"
             "data:\n  root: %s\n  convert: {from: idx, source: " FM "}\n"
             "  train: {path: train, batch_size: 8, limit: 64, transform: {channels: 1}}\n"
             "optimizer: {lr: 0.1}\nlog: {progress: never, tensorboard: false}\n",
             run, DATA_DIR);
    kpl_recipe *r = malloc(sizeof *r);
    assert_non_null(r);
    OK(kpl_recipe_load_string(yaml, "collect", 0, NULL, r));
    kpl_trainer *t = NULL;
    OK(kpl_trainer_create(r, &collect_task, NULL, &t));
    int rank = kpl_trainer_rank(t);
    assert_int_equal(kpl_trainer_world(t), world);

    /* sum, max and min, element-wise */
    double s[3] = {rank + 1.5, -rank, 7}, m[3] = {rank + 1.5, -rank, 7}, n[3] = {rank + 1.5, -rank, 7};
    OK(kpl_trainer_sum(t, s, 3));
    OK(kpl_trainer_max(t, m, 3));
    OK(kpl_trainer_min(t, n, 3));
    double sum0 = 0;
    for (int k = 0; k < world; k++) sum0 += k + 1.5;
    assert_float_equal(s[0], sum0, 0);
    assert_float_equal(s[1], -(world - 1) * world / 2.0, 0);
    assert_float_equal(s[2], 7.0 * world, 0);
    assert_float_equal(m[0], world - 1 + 1.5, 0);
    assert_float_equal(m[1], 0, 0);
    assert_float_equal(n[0], 1.5, 0);
    assert_float_equal(n[1], -(world - 1), 0);
    assert_float_equal(n[2], 7, 0);

    /* broadcast from every root in turn */
    for (int root = 0; root < world; root++) {
        char buf[32] = {0}, want[32] = {0};
        snprintf(buf, sizeof buf, "r%d-%d", rank, rank * 7);
        OK(kpl_trainer_broadcast(t, buf, sizeof buf, root));
        snprintf(want, sizeof want, "r%d-%d", root, root * 7);
        assert_memory_equal(buf, want, sizeof buf);
    }
    char b1[1] = {0};
    FAILS(kpl_trainer_broadcast(t, b1, 1, world), KPL_EINVAL, "root");

    /* all-gather: rank k gives 3 k + 1 bytes of value k + 1, then rank 0
     * gives nothing and the others 2 bytes, then nobody anything */
    for (int round = 0; round < 3; round++) {
        size_t len = round == 0 ? (size_t)(3 * rank + 1) : round == 1 ? (rank ? 2u : 0u) : 0u;
        unsigned char mine[64];
        memset(mine, rank + 1, sizeof mine);
        void *all = NULL;
        size_t lens[8] = {0};
        OK(kpl_trainer_all_gather(t, mine, len, &all, lens));
        size_t at = 0;
        for (int k = 0; k < world; k++) {
            size_t want = round == 0 ? (size_t)(3 * k + 1) : round == 1 ? (k ? 2u : 0u) : 0u;
            assert_int_equal(lens[k], want);
            for (size_t i = 0; i < want; i++) assert_int_equal(((unsigned char *)all)[at + i], k + 1);
            at += want;
        }
        if (at == 0) assert_null(all);
        free(all);
    }
    kpl_trainer_destroy(t);
    free(r);
    if (rank == 0) {
        char cmd[160];
        snprintf(cmd, sizeof cmd, "rm -rf %s", run);
        assert_int_equal(system(cmd), 0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_collectives)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
