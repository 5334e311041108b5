/* test_trainer_api.c — kpl_trainer used as a program outside kpl uses it,
 * at the edges its own tasks do not reach: a tensor added to a model after
 * the trainer took it, the caller's recipe gone after create, a small path
 * buffer for a checkpoint, a model named like the optimizer's state,
 * model.input_size against the data, keep_ratio's varying input size, an
 * optimizer group of frozen parameters only, the epoch count after
 * resuming where an epoch ended; the device a rank picks from the recipe,
 * the launcher's KPL_DEVICE and what CUDA says, and a trainer that was
 * given a GPU CUDA cannot use failing with CUDA's reason.
 *
 * The task: regression of an 8x8 image's mean brightness by a module with
 * an own parameter ("shift") beside a child ("body": flatten, linear). */
#define _XOPEN_SOURCE 700
#include "kpl_test.h"
#include "trainer.h"
#include "run_impl.h"

#include <ftw.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define S 8
#define NTRAIN 96 /* 6 steps of 16 an epoch */
#define NVAL 32

static char g_dir[64];

static void write_split(const char *dir, uint64_t seed, int64_t n)
{
    kpl_feature_spec schema[1] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {S, S, 1}},
    };
    kpl_record_writer_config wc = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 1, schema, &wc, &w));
    uint64_t s = seed;
    for (int64_t e = 0; e < n; e++) {
        uint8_t img[S * S];
        for (int k = 0; k < S * S; k++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            img[k] = (uint8_t)(s >> 56);
        }
        kpl_feature_value v[1] = {{img, S * S}};
        OK(kpl_record_writer_add(w, v));
    }
    OK(kpl_record_writer_close(w));
}

/* ---- the model: body(x) + shift ---- */

/* A one-element f32 tensor the caller owns. */
static kpl_status scalar(kpl_device *dev, float v, kpl_tensor **out)
{
    int64_t one = 1;
    return kpl_tensor_from_data(dev, KPL_F32, 1, &one, &v, out);
}

static kpl_status reg_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    kpl_tensor *y = kpl_module_forward(kpl_module_find(m, "body"), in->t[0]);
    y = kpl_add(y, kpl_module_get_param(m, "shift"));
    if (!y) return kpl_last_status();
    out->n = 1;
    out->t[0] = y;
    return KPL_OK;
}

static const kpl_module_kind reg_kind = {"reg", reg_forward, NULL, KPL_MODULE_REPLAYABLE};

static kpl_status build(kpl_device *dev, uint64_t seed, kpl_module **out)
{
    kpl_module *m = NULL, *body = NULL;
    kpl_status st = kpl_module_create_root(dev, seed, &reg_kind, NULL, &m);
    if (st < 0) return st;
    *out = m;
    kpl_tensor *shift = NULL;
    if ((st = scalar(dev, 0, &shift)) < 0 || (st = kpl_module_add_param(m, "shift", shift)) < 0 ||
        (st = kpl_nn_sequential(m, "body", &body)) < 0 ||
        (st = kpl_nn_flatten(body, "flatten", NULL)) < 0 ||
        (st = kpl_nn_linear(body, "fc", S * S, 1, true, NULL)) < 0)
        return st;
    return KPL_OK;
}

/* ---- the task ---- */

static enum { PLAIN, LATE_BUFFER, LATE_PARAM, NAMED_OPTIM, FROZEN_BODY } g_mode;

typedef struct {
    double se, n;
    int batches;
} reg_state;

static void reg_data(const kpl_recipe *r, bool train, kpl_loader_config *c)
{
    (void)r, (void)train;
    c->transform.label_feature = NULL;
}

static kpl_status reg_create(kpl_trainer *t, void **state)
{
    if (!(*state = calloc(1, sizeof(reg_state)))) return kpl_set_error(KPL_ENOMEM, "out of memory");
    kpl_module *m = NULL;
    kpl_status st = build(kpl_trainer_device(t), (uint64_t)kpl_trainer_recipe(t)->seed, &m);
    if (st >= 0 && g_mode == FROZEN_BODY) st = kpl_module_freeze(kpl_module_find(m, "body"));
    if (st < 0) {
        kpl_module_destroy(m);
        return st;
    }
    return kpl_trainer_add_model(t, g_mode == NAMED_OPTIM ? "optim" : "model", "reg", m, NULL,
                                 NULL);
}

static void reg_destroy(void *state) { free(state); }

/* (prediction, target): the image's mean brightness, both (N, 1) */
static kpl_status predict(kpl_trainer *t, const kpl_batch *b, kpl_tensor **y, kpl_tensor **want)
{
    int axes[3] = {1, 2, 3};
    /* the batch is on the CPU; the model on the trainer's device (a GPU
     * where there is one: device auto) */
    kpl_tensor *x = kpl_to_device(b->image, kpl_trainer_device(t));
    *y = kpl_module_forward(kpl_trainer_model(t, 0), x);
    *want = kpl_reshape(kpl_mean(x, axes, 3, false), 2, (int64_t[]){b->size, 1});
    return *y && *want ? KPL_OK : kpl_last_status();
}

static kpl_status reg_train_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    reg_state *s = state;
    kpl_module *m = kpl_trainer_model(t, 0);
    kpl_status st = KPL_OK;
    kpl_tensor *late = NULL;
    /* a tensor added after kpl_trainer_add_model, on the first batch */
    if (s->batches++ == 0 && g_mode == LATE_BUFFER &&
        (st = scalar(kpl_trainer_device(t), 7, &late)) >= 0)
        st = kpl_module_add_buffer(kpl_module_find(m, "body"), "seen", late);
    if (s->batches == 1 && g_mode == LATE_PARAM &&
        (st = scalar(kpl_trainer_device(t), 0, &late)) >= 0)
        st = kpl_module_add_param(m, "late", late);
    if (st < 0) return st;
    kpl_pool *pool = kpl_pool_push();
    kpl_tensor *y, *want, *loss = NULL;
    st = predict(t, b, &y, &want);
    if (st >= 0 && !(loss = kpl_mse_loss(y, want, KPL_REDUCE_MEAN))) st = kpl_last_status();
    if (loss) kpl_tensor_retain(loss);
    kpl_pool_pop(pool);
    if (st >= 0) st = kpl_trainer_backward(t, 0, loss, NULL);
    kpl_tensor_release(loss);
    return st;
}

static kpl_status reg_eval_begin(kpl_trainer *t, void *state)
{
    (void)t;
    reg_state *s = state;
    s->se = s->n = 0;
    return KPL_OK;
}

static kpl_status reg_eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    reg_state *s = state;
    kpl_pool *pool = kpl_pool_push();
    kpl_tensor *y, *want;
    kpl_status st = predict(t, b, &y, &want);
    for (int64_t i = 0; st >= 0 && i < b->size; i++) {
        double a = 0, c = 0;
        if ((st = kpl_tensor_get(y, i, &a)) >= 0 && (st = kpl_tensor_get(want, i, &c)) >= 0 &&
            kpl_trainer_eval_counts(t, b, i))
            s->se += (a - c) * (a - c), s->n++;
    }
    kpl_pool_pop(pool);
    return st;
}

static kpl_status reg_eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    reg_state *s = state;
    double v[2] = {s->se, s->n};
    kpl_status st = kpl_trainer_sum(t, v, 2);
    if (st < 0) return st;
    res->examples = (int64_t)v[1];
    return kpl_figures_set(&res->metrics, "mse", v[1] > 0 ? v[0] / v[1] : NAN);
}

static const kpl_task_kind reg_task = {
    .name = "regression", .best_metric = "mse", .best_higher = false,
    .create = reg_create, .destroy = reg_destroy, .train_batch = reg_train_batch,
    .eval_begin = reg_eval_begin, .eval_batch = reg_eval_batch, .eval_end = reg_eval_end,
    .data = reg_data,
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
    snprintf(g_dir, sizeof g_dir, "/tmp/kpl-api-XXXXXX");
    assert_non_null(mkdtemp(g_dir));
    char path[128];
    snprintf(path, sizeof path, "%s/train", g_dir);
    write_split(path, 1, NTRAIN);
    snprintf(path, sizeof path, "%s/val", g_dir);
    write_split(path, 2, NVAL);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    nftw(g_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}

/* A recipe for run directory `run` under g_dir, with n overrides. */
static kpl_recipe *recipe_n(const char *run, int n, const char *const *overrides);

/* ... with one (or none). */
static kpl_recipe *recipe(const char *run, const char *override)
{
    return recipe_n(run, override ? 1 : 0, &override);
}

/* The recipe's text (yaml[2048]). */
static void recipe_text(char *yaml, const char *run)
{
    snprintf(yaml, 2048,
             "name: api\ntask: regression\nseed: 5\nepochs: 2\nthreads: 1\n"
             "deterministic: true\nrun_dir: %s/%s\n"
             "data:\n  root: %s\n"
             "  train: {path: train, batch_size: 16, shuffle: example,\n"
             "          transform: {channels: 1}}\n"
             "  val: {path: val, batch_size: 16, transform: {channels: 1}}\n"
             "optimizer: {name: sgd, lr: 0.05, momentum: 0.9}\n"
             "log: {every_steps: 100, progress: never, tensorboard: false}\n",
             g_dir, run, g_dir);
}

static kpl_recipe *recipe_n(const char *run, int n, const char *const *overrides)
{
    char yaml[2048];
    recipe_text(yaml, run);
    kpl_recipe *r = malloc(sizeof *r);
    assert_non_null(r);
    OK(kpl_recipe_load_string(yaml, "api", n, overrides, r));
    return r;
}

static kpl_trainer *create(const kpl_recipe *r, const char *resume)
{
    kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
    o.resume = resume;
    kpl_trainer *t = NULL;
    OK(kpl_trainer_create(r, &reg_task, &o, &t));
    return t;
}

static bool exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* ---- the tests ---- */

/* A buffer added under the model after the trainer took it: steps and
 * saves (the trainer's parameter names are its own, not the module's
 * list, which the addition rebuilds), and the checkpoint holds it. */
static void test_late_buffer(void **state)
{
    (void)state;
    g_mode = LATE_BUFFER;
    kpl_recipe *r = recipe("late_buffer", NULL);
    kpl_trainer *t = create(r, NULL);
    bool done = false;
    OK(kpl_trainer_step(t, &done));
    OK(kpl_trainer_step(t, &done));
    char path[512];
    OK(kpl_trainer_save(t, "test", path, sizeof path));
    kpl_checkpoint *c = NULL;
    OK(kpl_checkpoint_load(path, &c));
    kpl_tensor *seen = kpl_checkpoint_find(c, "model.body.seen");
    assert_non_null(seen);
    double v = 0;
    OK(kpl_tensor_get(seen, 0, &v));
    assert_float_equal(v, 7, 0);
    /* the optimizer's momentum under the model's parameter names */
    assert_non_null(kpl_checkpoint_find(c, "optim.model.shift.momentum_buffer"));
    assert_non_null(kpl_checkpoint_find(c, "optim.model.body.fc.weight.momentum_buffer"));
    kpl_checkpoint_destroy(c);
    kpl_trainer_destroy(t);
    free(r);
}

/* A parameter added after kpl_trainer_add_model would never train: the
 * next backward says so. */
static void test_late_param(void **state)
{
    (void)state;
    g_mode = LATE_PARAM;
    kpl_recipe *r = recipe("late_param", NULL);
    kpl_trainer *t = create(r, NULL);
    bool done = false;
    assert_int_equal(kpl_trainer_step(t, &done), KPL_ESTATE);
    assert_non_null(strstr(kpl_last_error(), "model 'model' has 4 parameters, 3 when it was added"));
    kpl_trainer_destroy(t);
    free(r);
}

/* The trainer copies the recipe: the caller's may go at once. */
static void test_recipe_copied(void **state)
{
    (void)state;
    g_mode = PLAIN;
    kpl_recipe *r = recipe("copied", NULL);
    kpl_trainer *t = create(r, NULL);
    memset(r, 0xa5, sizeof *r);
    free(r);
    bool done = false;
    for (int i = 0; i < 3; i++) OK(kpl_trainer_step(t, &done));
    assert_int_equal(kpl_trainer_recipe(t)->data.train.loader.batch_size, 16);
    assert_string_equal(kpl_trainer_recipe(t)->task, "regression");
    OK(kpl_trainer_save(t, "test", NULL, 0));
    kpl_eval_result e;
    OK(kpl_trainer_evaluate(t, &e));
    assert_int_equal(e.examples, NVAL);
    kpl_trainer_destroy(t);
}

/* A path buffer too small for the checkpoint's name is an error before
 * anything is written (the name was once cut short, and the file saved
 * beside the checkpoints directory under the cut name). */
static void test_save_path_buffer(void **state)
{
    (void)state;
    g_mode = PLAIN;
    kpl_recipe *r = recipe("small", NULL);
    kpl_trainer *t = create(r, NULL);
    bool done = false;
    OK(kpl_trainer_step(t, &done));
    char small[24], dir[256], path[512], cut[256];
    assert_int_equal(kpl_trainer_save(t, "test", small, sizeof small), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "the path buffer (24 bytes) cannot hold"));
    snprintf(cut, sizeof cut, "%s/small/che", g_dir);
    assert_false(exists(cut));
    snprintf(dir, sizeof dir, "%s/small/checkpoints/ckpt-0000000001.kpl", g_dir);
    assert_false(exists(dir));
    kpl_trainer_destroy(t); /* a failed save ends the run, as any failure */
    t = create(r, NULL);
    OK(kpl_trainer_step(t, &done));
    OK(kpl_trainer_save(t, "test", path, sizeof path));
    assert_string_equal(path, dir);
    assert_true(exists(dir));
    kpl_trainer_destroy(t);
    free(r);
}

/* "optim." holds the optimizer's state in checkpoints: no model takes it. */
static void test_model_named_optim(void **state)
{
    (void)state;
    g_mode = NAMED_OPTIM;
    kpl_recipe *r = recipe("optim", NULL);
    kpl_trainer *t = NULL;
    assert_int_equal(kpl_trainer_create(r, &reg_task, NULL, &t), KPL_EINVAL);
    assert_null(t);
    assert_non_null(strstr(kpl_last_error(), "the name 'optim' is taken"));
    free(r);
}

/* model.weights must be a checkpoint of finite tensors: a NaN is refused
 * naming the tensor, a model file (kpl export) saying what it is, before
 * a step is taken. */
static void test_weights_refused(void **state)
{
    (void)state;
    g_mode = PLAIN;
    kpl_recipe *r = recipe("wsrc", NULL);
    kpl_trainer *t = create(r, NULL);
    free(r);
    char good[600], nan_path[600], model_path[600], ov[700];
    snprintf(good, sizeof good, "%s/w_good.kpl", g_dir);
    snprintf(nan_path, sizeof nan_path, "%s/w_nan.kpl", g_dir);
    snprintf(model_path, sizeof model_path, "%s/w_model.kpl", g_dir);
    kpl_checkpoint *c = NULL;
    OK(kpl_checkpoint_create(&c));
    OK(kpl_module_state_save(kpl_trainer_model(t, 0), c, "model."));
    OK(kpl_checkpoint_save(c, good));
    OK(kpl_checkpoint_set_meta(c, "{\"format\": \"kpl-model\", \"version\": 1}"));
    OK(kpl_checkpoint_save(c, model_path));
    OK(kpl_checkpoint_set_meta(c, "{}"));
    int f32 = 0;
    while (kpl_tensor_dtype(kpl_checkpoint_find(c, kpl_checkpoint_name(c, f32))) != KPL_F32) f32++;
    char name[300];
    snprintf(name, sizeof name, "%s", kpl_checkpoint_name(c, f32));
    float *v = kpl_tensor_host_mutable(kpl_checkpoint_find(c, name));
    assert_non_null(v);
    v[0] = NAN;
    OK(kpl_checkpoint_save(c, nan_path));
    kpl_checkpoint_destroy(c);
    kpl_trainer_destroy(t);
    snprintf(ov, sizeof ov, "model.weights=%s", good);
    r = recipe("wgood", ov);
    t = create(r, NULL);
    kpl_trainer_destroy(t);
    free(r);
    const char *bad[2] = {nan_path, model_path};
    for (int i = 0; i < 2; i++) {
        snprintf(ov, sizeof ov, "model.weights=%s", bad[i]);
        r = recipe("wbad", ov);
        t = NULL;
        assert_int_equal(kpl_trainer_create(r, &reg_task, NULL, &t), KPL_EFORMAT);
        assert_null(t);
        const char *e = kpl_last_error();
        assert_non_null(strstr(e, "model.weights: "));
        assert_non_null(strstr(e, bad[i]));
        if (i == 0) {
            char want[400];
            snprintf(want, sizeof want, "tensor '%s' holds NaN or inf (element 0 of", name);
            if (!strstr(e, want)) fail_msg("'%s' lacks '%s'", e, want);
        } else {
            assert_non_null(strstr(e, "a model file (kpl export), not a checkpoint"));
        }
        free(r);
    }
}

/* schedule.span: cosine and poly decay over the epochs, or over
 * max_steps (reaching min_lr there); span max_steps without max_steps is
 * refused at load. */
static void test_schedule_span(void **state)
{
    (void)state;
    g_mode = PLAIN;
    const char *ov[3] = {"schedule={name: poly, power: 1, min_lr: 0.001}", "max_steps=3",
                         "schedule.span=max_steps"};
    kpl_recipe *r = recipe_n("span0", 2, ov);
    kpl_trainer *t = create(r, NULL);
    assert_true(t->sched.epochs == 2);
    kpl_trainer_destroy(t);
    free(r);
    r = recipe_n("span1", 3, ov);
    t = create(r, NULL);
    double spe = (double)t->steps_per_epoch;
    assert_true(t->steps_per_epoch > 3);
    if (fabs(t->sched.epochs - 3 / spe) > 1e-15) fail_msg("span %.17g epochs", t->sched.epochs);
    /* halfway: lr halfway down (power 1); at max_steps: min_lr */
    double mid = kpl_lr_at(&t->sched, 1.5 / spe), end = kpl_lr_at(&t->sched, 3 / spe);
    if (fabs(mid - (0.001 + (0.05 - 0.001) * 0.5)) > 1e-12 || fabs(end - 0.001) > 1e-15)
        fail_msg("lr at 1.5 steps %.17g, at 3 %.17g", mid, end);
    kpl_trainer_destroy(t);
    free(r);
    kpl_recipe *bad = malloc(sizeof *bad);
    char yaml[2048];
    recipe_text(yaml, "span2");
    assert_int_equal(kpl_recipe_load_string(yaml, "api", 1, ov + 2, bad), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "override 'schedule.span=max_steps': schedule.span: "
                                             "max_steps needs max_steps"));
    free(bad);
}

/* model.input_size and in_channels must agree with the data. */
static void test_input_size_checked(void **state)
{
    (void)state;
    g_mode = PLAIN;
    kpl_recipe *r = recipe("size", "model.input_size=[10, 10]");
    kpl_trainer *t = NULL;
    assert_int_equal(kpl_trainer_create(r, &reg_task, NULL, &t), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "model.input_size is [10, 10] but the training "
                                             "images are 8x8"));
    free(r);
    r = recipe("size", "model.in_channels=3");
    assert_int_equal(kpl_trainer_create(r, &reg_task, NULL, &t), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "model.in_channels is 3 but "
                                             "data.train.transform.channels is 1"));
    free(r);
    r = recipe("size", "model={input_size: [8, 8], in_channels: 1}"); /* agreeing: fine */
    t = create(r, NULL);
    assert_int_equal(kpl_trainer_input_shape(t)[0], 1);
    assert_int_equal(kpl_trainer_input_shape(t)[1], 8);
    assert_int_equal(kpl_trainer_input_shape(t)[2], 8);
    kpl_trainer_destroy(t);
    free(r);
}

/* keep_ratio: the input shape is the canvas (every batch fits it), a
 * fixed model.input_size is refused, a classification refuses the crop,
 * and a step trains on the padded batch. */
static void test_keep_ratio_input(void **state)
{
    (void)state;
    g_mode = PLAIN;
    const char *kr = "data={train: {transform: {crop: keep_ratio, short_sides: [4], "
                     "max_side: 8, size_divisor: 8}}}";
    kpl_recipe *r = recipe("kr", kr);
    kpl_trainer *t = create(r, NULL);
    assert_int_equal(kpl_trainer_input_shape(t)[0], 1);
    assert_int_equal(kpl_trainer_input_shape(t)[1], 8); /* max_side 8, a multiple of 8 */
    assert_int_equal(kpl_trainer_input_shape(t)[2], 8);
    bool done = false;
    OK(kpl_trainer_step(t, &done)); /* 8x8 images shrunk to 4x4, padded to 8x8 */
    kpl_trainer_destroy(t);
    free(r);
    const char *ov[2] = {kr, "model.input_size=[8, 8]"};
    r = malloc(sizeof *r);
    char yaml[1024];
    snprintf(yaml, sizeof yaml,
             "task: regression\nepochs: 1\nthreads: 1\nrun_dir: %s/kr2\ndata:\n  root: %s\n"
             "  train: {path: train, batch_size: 16, transform: {channels: 1}}\n"
             "optimizer: {lr: 0.05}\nlog: {progress: never, tensorboard: false}\n",
             g_dir, g_dir);
    OK(kpl_recipe_load_string(yaml, "kr", 2, ov, r));
    assert_int_equal(kpl_trainer_create(r, &reg_task, NULL, &t), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "model.input_size: not with "
                                             "data.train.transform.crop keep_ratio, whose "
                                             "batches each have their own size (at most 8x8)"));
    snprintf(yaml, sizeof yaml,
             "task: classification\nepochs: 1\nthreads: 1\nrun_dir: %s/kr3\n"
             "model: {name: cnn, num_classes: 2}\ndata:\n  root: %s\n"
             "  train: {path: train, batch_size: 16, label_feature: \"\", transform: {channels: 1}}\n"
             "optimizer: {lr: 0.05}\nlog: {progress: never, tensorboard: false}\n",
             g_dir, g_dir);
    OK(kpl_recipe_load_string(yaml, "kr", 1, ov, r));
    assert_int_equal(kpl_trainer_create(r, kpl_task_find("classification"), NULL, &t),
                     KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "data.train.transform.crop: classification needs "
                                             "images of one size, and keep_ratio gives each "
                                             "batch its own"));
    free(r);
}

/* A group whose pattern matches frozen parameters only changes nothing:
 * the run goes on (a warning says so), the frozen body stays as it was
 * and the shift still trains at the recipe's lr. */
static void test_group_of_frozen_parameters(void **state)
{
    (void)state;
    g_mode = FROZEN_BODY;
    kpl_recipe *r = recipe("frozen", "optimizer.groups=[{params: \"body.*\", lr_mult: 0.1}]");
    kpl_trainer *t = create(r, NULL);
    kpl_module *m = kpl_trainer_model(t, 0);
    double w0 = 0, w1 = 0, s0 = 0, s1 = 0;
    OK(kpl_tensor_get(kpl_module_get_param(kpl_module_find(m, "body.fc"), "weight"), 3, &w0));
    OK(kpl_tensor_get(kpl_module_get_param(m, "shift"), 0, &s0));
    bool done = false;
    for (int i = 0; i < 4; i++) OK(kpl_trainer_step(t, &done));
    OK(kpl_tensor_get(kpl_module_get_param(kpl_module_find(m, "body.fc"), "weight"), 3, &w1));
    OK(kpl_tensor_get(kpl_module_get_param(m, "shift"), 0, &s1));
    assert_true(w1 == w0);
    assert_true(s1 != s0);
    kpl_trainer_destroy(t);
    free(r);
}

/* Resumed from the checkpoint of an epoch's last step, the trainer is
 * where the uninterrupted one is: the last step was that epoch's, and the
 * next step starts the next epoch; the losses go on the same. */
static void test_epoch_after_resume(void **state)
{
    (void)state;
    g_mode = PLAIN;
    kpl_recipe *r = recipe("resume", NULL);
    kpl_trainer *t = create(r, NULL);
    bool done = false;
    int steps = 0;
    while (!done) {
        OK(kpl_trainer_step(t, &done));
        steps++;
    }
    assert_int_equal(steps, NTRAIN / 16);
    assert_int_equal(kpl_trainer_epoch(t), 0);
    char path[512];
    OK(kpl_trainer_save(t, "test", path, sizeof path));
    OK(kpl_trainer_step(t, &done));
    assert_int_equal(kpl_trainer_epoch(t), 1);
    double want = 0;
    OK(kpl_tensor_get(kpl_module_get_param(kpl_trainer_model(t, 0), "shift"), 0, &want));
    kpl_trainer_destroy(t);

    t = create(r, path);
    assert_int_equal(kpl_trainer_steps(t), steps);
    assert_int_equal(kpl_trainer_epoch(t), 0);
    OK(kpl_trainer_step(t, &done));
    assert_false(done);
    assert_int_equal(kpl_trainer_epoch(t), 1);
    double got = 0;
    OK(kpl_tensor_get(kpl_module_get_param(kpl_trainer_model(t, 0), "shift"), 0, &got));
    assert_true(got == want);
    kpl_trainer_destroy(t);
    free(r);
}

/* The device a rank trains on: the recipe's device, kplrun's KPL_DEVICE,
 * the GPUs CUDA sees and why there are none, the node-local rank. */
static void test_device_choice(void **state)
{
    (void)state;
    const char *why = "CUDA driver version is insufficient for CUDA runtime version";
    char name[48];
    /* auto without a launcher: a GPU per local rank, else the CPU */
    OK(kpl__trainer_device_choice("auto", NULL, 4, NULL, 5, name, sizeof name));
    assert_string_equal(name, "cuda:1");
    OK(kpl__trainer_device_choice("auto", "", 0, why, 5, name, sizeof name));
    assert_string_equal(name, "cpu");
    /* auto under kplrun: its pick, which counts visible GPUs only */
    OK(kpl__trainer_device_choice("auto", "cuda:0", 1, NULL, 3, name, sizeof name));
    assert_string_equal(name, "cuda:0");
    OK(kpl__trainer_device_choice("auto", "cpu", 8, NULL, 3, name, sizeof name));
    assert_string_equal(name, "cpu");
    /* the launcher saw GPUs, CUDA cannot use them: fail with CUDA's reason */
    FAILS(kpl__trainer_device_choice("auto", "cuda:2", 0, why, 2, name, sizeof name),
          KPL_EDEVICE, "KPL_DEVICE=cuda:2, but CUDA cannot use any: CUDA driver version is "
          "insufficient");
    FAILS(kpl__trainer_device_choice("auto", "cuda:1", 0, NULL, 1, name, sizeof name),
          KPL_EDEVICE, "CUDA reports no device");
    /* device: cuda asked for: the reason, never the CPU */
    FAILS(kpl__trainer_device_choice("cuda", NULL, 0, why, 0, name, sizeof name), KPL_EDEVICE,
          "device: cuda asked for, but CUDA cannot use any GPU: CUDA driver version");
    FAILS(kpl__trainer_device_choice("cuda", "cuda:0", 0, why, 0, name, sizeof name),
          KPL_EDEVICE, "insufficient");
    OK(kpl__trainer_device_choice("cuda", NULL, 2, NULL, 3, name, sizeof name));
    assert_string_equal(name, "cuda:1");
    OK(kpl__trainer_device_choice("cuda", "cuda:0", 1, NULL, 3, name, sizeof name));
    assert_string_equal(name, "cuda:0");
    /* explicit names pass through (kpl_device_get checks them) */
    OK(kpl__trainer_device_choice("cpu", "cuda:0", 0, why, 0, name, sizeof name));
    assert_string_equal(name, "cpu");
    OK(kpl__trainer_device_choice("cuda:3", NULL, 0, why, 0, name, sizeof name));
    assert_string_equal(name, "cuda:3");
    /* a launcher environment that is not a device */
    FAILS(kpl__trainer_device_choice("auto", "gpu0", 1, NULL, 0, name, sizeof name), KPL_EINVAL,
          "KPL_DEVICE='gpu0' (from the launcher's environment) is not a device");
    FAILS(kpl__trainer_device_choice("auto", "cuda:", 1, NULL, 0, name, sizeof name), KPL_EINVAL,
          "expected cpu or cuda:N");
}

/* A rank that kplrun gave a GPU (KPL_DEVICE=cuda:0) on a machine where
 * CUDA finds none fails at create, saying what CUDA said; on the CPU it
 * would train for days where it should take hours. */
static void test_launcher_gpu_unusable(void **state)
{
    (void)state;
    if (kpl_device_count(KPL_DEVICE_CUDA) > 0) /* a GPU here: nothing to refuse */
        KPL_SKIP(KPL_TEST_SKIP_ENV, "a GPU is present: nothing to refuse");
    g_mode = PLAIN;
    kpl_recipe *r = recipe("gpu_unusable", NULL);
    setenv("KPL_DEVICE", "cuda:0", 1);
    kpl_trainer *t = NULL;
    kpl_status st = kpl_trainer_create(r, &reg_task, NULL, &t);
    unsetenv("KPL_DEVICE");
    assert_int_equal(st, KPL_EDEVICE);
    assert_null(t);
    const char *why = kpl_device_unavailable_reason(KPL_DEVICE_CUDA);
    if (!strstr(kpl_last_error(), why) || !strstr(kpl_last_error(), "KPL_DEVICE=cuda:0"))
        fail_msg("'%s' lacks KPL_DEVICE=cuda:0 or the reason '%s'", kpl_last_error(), why);
    free(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_late_buffer),
        cmocka_unit_test(test_late_param),
        cmocka_unit_test(test_recipe_copied),
        cmocka_unit_test(test_save_path_buffer),
        cmocka_unit_test(test_model_named_optim),
        cmocka_unit_test(test_input_size_checked),
        cmocka_unit_test(test_keep_ratio_input),
        cmocka_unit_test(test_group_of_frozen_parameters),
        cmocka_unit_test(test_epoch_after_resume),
        cmocka_unit_test(test_device_choice),
        cmocka_unit_test(test_launcher_gpu_unusable),
        cmocka_unit_test(test_weights_refused),
        cmocka_unit_test(test_schedule_span),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
