/* test_labelfree.c — splits whose records have no label (what `kpl data
 * convert --from images` writes: image and path) through kpl_trainer.  A
 * task that needs no labels trains and evaluates on them when the recipe
 * says data.<split>.label_feature: "" (its batches carry no label), or when
 * its own data hook clears the label feature, as a GAN's does; the default
 * label feature on such a set is an error naming what the set has; and
 * classification refuses an empty label feature, which would leave it no
 * classes to learn. */
#define _XOPEN_SOURCE 700
#include "kpl_test.h"
#include "trainer.h"

#include <ftw.h>
#include <stdlib.h>
#include <string.h>

#define SIDE 8

static char g_root[64];

/* A label-free split of n gray SIDE x SIDE images and their paths. */
static void write_unlabeled(const char *dir, int n)
{
    kpl_feature_spec schema[2] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {SIDE, SIDE, 1}},
        {.name = "path", .type = KPL_FEATURE_STRING},
    };
    kpl_record_writer_config wc = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 2, schema, &wc, &w));
    for (int e = 0; e < n; e++) {
        uint8_t px[SIDE * SIDE];
        for (int k = 0; k < SIDE * SIDE; k++) px[k] = (uint8_t)(e * 37 + k * 5);
        char path[32];
        snprintf(path, sizeof path, "faces/%03d.png", e);
        kpl_feature_value v[2] = {{px, sizeof px}, {path, (uint32_t)strlen(path)}};
        OK(kpl_record_writer_add(w, v));
    }
    OK(kpl_record_writer_close(w));
}

/* ---- a task that needs no labels: push the model's output towards 0 ---- */

static int64_t g_batches, g_labels_seen;

static kpl_status free_create(kpl_trainer *t, void **state)
{
    *state = NULL;
    kpl_module *m = NULL;
    kpl_status st = kpl_nn_sequential_root(kpl_trainer_device(t), 1, &m);
    if (st >= 0) st = kpl_nn_flatten(m, "flatten", NULL);
    if (st >= 0) st = kpl_nn_linear(m, "fc", SIDE * SIDE, 1, true, NULL);
    if (st < 0) {
        kpl_module_destroy(m);
        return st;
    }
    return kpl_trainer_add_model(t, "model", "probe", m, NULL, NULL);
}

static void free_destroy(void *state) { (void)state; }

static kpl_status free_step(kpl_trainer *t, void *state, const kpl_batch *b,
                            kpl_step_result *out)
{
    (void)state;
    g_batches++;
    g_labels_seen += b->label != NULL;
    /* the batch is on the CPU; the model on the trainer's device (a GPU
     * where there is one: device auto) */
    kpl_tensor *x = kpl_to_device(b->image, kpl_trainer_device(t));
    kpl_tensor *y = kpl_module_forward(kpl_trainer_model(t, 0), x);
    out->loss[0] = kpl_mean(kpl_square(y), NULL, 0, false);
    return out->loss[0] ? KPL_OK : kpl_last_status();
}

static kpl_status free_eval_begin(kpl_trainer *t, void *state)
{
    (void)t, (void)state;
    return KPL_OK;
}

static kpl_status free_eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    (void)state;
    g_labels_seen += b->label != NULL;
    return kpl_trainer_eval_add(t, "examples", (double)b->size);
}

static kpl_status free_eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    (void)state;
    res->examples = (int64_t)kpl_trainer_eval_total(t, "examples");
    return kpl_figures_set(&res->metrics, "n", (double)res->examples);
}

static const char *const free_sums[] = {"examples", NULL};

/* The GAN task's way: the task clears the label feature itself. */
static void clear_label(const kpl_recipe *r, bool train, kpl_loader_config *c)
{
    (void)r, (void)train;
    c->transform.label_feature = NULL;
}

static const kpl_task_kind free_task = {
    .name = "labelfree", .best_metric = "n", .best_higher = true,
    .create = free_create, .destroy = free_destroy, .train_step = free_step,
    .eval_sums = free_sums, .eval_begin = free_eval_begin, .eval_batch = free_eval_batch,
    .eval_end = free_eval_end,
};

/* ---- helpers ---- */

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static int setup(void **state)
{
    (void)state;
    snprintf(g_root, sizeof g_root, "/tmp/kpl-labelfree-XXXXXX");
    if (!mkdtemp(g_root)) return -1;
    char p[128];
    snprintf(p, sizeof p, "%s/train", g_root);
    write_unlabeled(p, 24);
    snprintf(p, sizeof p, "%s/val", g_root);
    write_unlabeled(p, 8);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return nftw(g_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* A recipe of `task` on the label-free splits; label_line goes into both splits. */
static void load(kpl_recipe *r, const char *task, const char *label_line)
{
    char yaml[2048];
    snprintf(yaml, sizeof yaml,
             "name: labelfree\ntask: %s\nseed: 3\nepochs: 1\nthreads: 1\n"
             "run_dir: %s/run-%s\n"
             "model: {name: mlp, num_classes: 4, hidden: [8]}\n"
             "data:\n  root: %s\n"
             "  train: {path: train, batch_size: 8, transform: {channels: 1}%s}\n"
             "  val: {path: val, batch_size: 8, transform: {channels: 1}%s}\n"
             "optimizer: {name: sgd, lr: 0.01}\n"
             "log: {every_steps: 100, progress: never, tensorboard: false}\n",
             task, g_root, task, g_root, label_line, label_line);
    OK(kpl_recipe_load_string(yaml, "labelfree", 0, NULL, r));
}

/* ---- the tests ---- */

/* label_feature "": batches without labels, training and evaluation run. */
static void test_recipe_without_labels(void **state)
{
    (void)state;
    kpl_recipe r;
    load(&r, "labelfree", ", label_feature: \"\"");
    kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
    kpl_trainer *t = NULL;
    g_batches = g_labels_seen = 0;
    OK(kpl_trainer_create(&r, &free_task, &o, &t));
    bool done = false;
    for (int i = 0; i < 3; i++) OK(kpl_trainer_step(t, &done));
    kpl_eval_result e;
    OK(kpl_trainer_evaluate(t, &e));
    assert_int_equal(e.examples, 8);
    assert_int_equal(g_batches, 3);
    assert_int_equal(g_labels_seen, 0);
    kpl_trainer_destroy(t);
}

/* The recipe's default label feature: fine when the task's data hook
 * clears it; without the hook, an error that says what the set holds. */
static void test_default_label_feature(void **state)
{
    (void)state;
    kpl_recipe r;
    load(&r, "labelfree", "");
    kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
    kpl_trainer *t = NULL;
    kpl_task_kind hooked = free_task;
    hooked.data = clear_label;
    g_labels_seen = 0;
    OK(kpl_trainer_create(&r, &hooked, &o, &t));
    bool done = false;
    OK(kpl_trainer_step(t, &done));
    assert_int_equal(g_labels_seen, 0);
    kpl_trainer_destroy(t);
    t = NULL;
    FAILS(kpl_trainer_create(&r, &free_task, &o, &t), KPL_EINVAL,
          "label_feature 'label' is not a feature of");
    assert_non_null(strstr(kpl_last_error(), "/train (it has: image, path)"));
    assert_null(t);
}

/* Classification on a set without labels: refused, naming the key. */
static void test_classification_needs_labels(void **state)
{
    (void)state;
    kpl_recipe r;
    load(&r, "classification", ", label_feature: \"\"");
    kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
    kpl_trainer *t = NULL;
    FAILS(kpl_trainer_create(&r, &kpl_task_classification, &o, &t), KPL_EINVAL,
          "data.train.label_feature is empty: classification needs a class per example");
    load(&r, "classification", "");
    FAILS(kpl_trainer_create(&r, &kpl_task_classification, &o, &t), KPL_EINVAL,
          "label_feature 'label' is not a feature of");
    assert_null(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_recipe_without_labels),
        cmocka_unit_test(test_default_label_feature),
        cmocka_unit_test(test_classification_needs_labels),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
