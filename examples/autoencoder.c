/*
 * autoencoder.c — a model, a task and an optimizer rule defined outside
 * kpl, trained by kpl_trainer: a convolutional autoencoder on
 * Fashion-MNIST with a mean squared error loss, and Lion.  The same file
 * is a program and a plugin for the stock `kpl train`:
 *
 *   build/bin/example_autoencoder examples/autoencoder.yaml [KEY=VALUE ...] [--resume]
 *   kpl train --plugin build/lib/libkpl_autoencoder.so examples/autoencoder.yaml
 *   kplrun -np 2 -- kpl train --plugin build/lib/libkpl_autoencoder.so examples/autoencoder.yaml
 *
 * What a program brings:
 *   1. a module kind (here the autoencoder itself, whose forward returns
 *      the reconstruction and the code: a module may give several outputs),
 *      built from kpl's layers;
 *   2. a task: how to build the model from the recipe, one training
 *      micro-batch (the loss, kpl_trainer_backward, the figures to report),
 *      the evaluation (named metrics; "mse" picks best.kpl), and images for
 *      TensorBoard (inputs over their reconstructions);
 *   3. recipe keys of their own (keys.h): the model's
 *      model.autoencoder.width and .code, the task's
 *      task.autoencoder.noise, checked like kpl's keys and listed by
 *      `kpl train --keys --plugin ...`;
 *   4. registration (kpl_task_register, kpl_zoo_register,
 *      kpl_optim_register) in a constructor, so that recipes find them by
 *      name (task: autoencoder, model.name: autoencoder, optimizer.name:
 *      lion); KPL_PLUGIN_ABI marks the plugin's kpl;
 *   5. main (the program only): load the recipe, create the trainer with
 *      the task, fit.
 * Everything else — data loading, mpirun ranks and DDP, the optimizer and
 * schedule, checkpoints and --resume, metrics.jsonl, TensorBoard — is the
 * trainer's, configured by the same recipe keys as `kpl train`.
 */
#include "trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the model: encoder -> code -> decoder ------------------------------------------------ */

/* forward: (N, C, H, W) -> [reconstruction (N, C, H, W), code (N, code, H/4, W/4)] */
static kpl_status autoencoder_forward(kpl_module *m, const kpl_tensor_list *in,
                                      kpl_tensor_list *out)
{
    kpl_tensor *code = kpl_module_forward(kpl_module_find(m, "encoder"), in->t[0]);
    kpl_tensor *rec = kpl_module_forward(kpl_module_find(m, "decoder"), code);
    if (!rec) return kpl_last_status();
    out->n = 2;
    out->t[0] = rec;
    out->t[1] = code;
    return KPL_OK;
}

static const kpl_module_kind autoencoder_kind = {"autoencoder", autoencoder_forward, NULL,
                                                 KPL_MODULE_REPLAYABLE};

/* The zoo's create (zoo.h): a root on dev, or a child of parent. */
static kpl_status autoencoder_create(kpl_module *parent, const char *child,
                                     const kpl_model_config *cfg, kpl_device *dev, uint64_t seed,
                                     kpl_module **out)
{
    KPL_CHECK(cfg->in_h % 4 == 0 && cfg->in_w % 4 == 0, KPL_EINVAL,
              "autoencoder: the input's sides must be multiples of 4 (got %lldx%lld)",
              (long long)cfg->in_h, (long long)cfg->in_w);
    /* its own keys, checked and completed with their defaults by now */
    int64_t channels = cfg->in_channels, width = 0, code = 0;
    KPL_TRY(kpl_key_int(&cfg->keys, "width", &width));
    KPL_TRY(kpl_key_int(&cfg->keys, "code", &code));
    if (code == 0) code = 2 * width;
    kpl_module *m = NULL, *enc = NULL, *dec = NULL;
    if (parent) KPL_TRY(kpl_module_create(parent, child, &autoencoder_kind, NULL, &m));
    else KPL_TRY(kpl_module_create_root(dev, seed, &autoencoder_kind, NULL, &m));
    *out = m; /* the caller destroys a root also when a step below fails */
    kpl_nn_conv c1 = {KPL_NN_CONV_INIT(channels, width, 3), .stride = {2, 2}, .padding = {1, 1}};
    kpl_nn_conv c2 = {KPL_NN_CONV_INIT(width, code, 3), .stride = {2, 2}, .padding = {1, 1}};
    kpl_nn_conv d1 = {KPL_NN_CONV_INIT(code, width, 4), .stride = {2, 2}, .padding = {1, 1}};
    kpl_nn_conv d2 = {KPL_NN_CONV_INIT(width, channels, 4), .stride = {2, 2}, .padding = {1, 1}};
    KPL_TRY(kpl_nn_sequential(m, "encoder", &enc));
    KPL_TRY(kpl_nn_conv2d(enc, "conv1", &c1, NULL));
    KPL_TRY(kpl_nn_relu(enc, "relu1", NULL));
    KPL_TRY(kpl_nn_conv2d(enc, "conv2", &c2, NULL));
    KPL_TRY(kpl_nn_relu(enc, "relu2", NULL));
    KPL_TRY(kpl_nn_sequential(m, "decoder", &dec));
    KPL_TRY(kpl_nn_conv_transpose2d(dec, "deconv1", &d1, NULL));
    KPL_TRY(kpl_nn_relu(dec, "relu1", NULL));
    KPL_TRY(kpl_nn_conv_transpose2d(dec, "deconv2", &d2, NULL));
    KPL_TRY(kpl_nn_activation(dec, "sigmoid", KPL_NN_SIGMOID, 0, NULL));
    return KPL_OK;
}

/* model.autoencoder.<key> in a recipe */
static const kpl_key autoencoder_keys[] = {
    {"width", KPL_KEY_INT, "16", 1, 1024, NULL, "channels of the first convolution"},
    {"code", KPL_KEY_INT, "0", 0, 4096, NULL, "channels of the code (0: 2 x width)"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};

/* ---- the task ------------------------------------------------------------------------------ */

/* task.autoencoder.<key> */
static const kpl_key ae_keys[] = {
    {"noise", KPL_KEY_FLOAT, "0", 0, 1, NULL,
     "denoising: training inputs get Gaussian noise of this standard deviation (the target "
     "stays clean; the model's generator draws it, so resume is exact)"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};

#define SHOWN 8 /* images shown in TensorBoard */

/* The evaluation's sums (kpl_trainer_eval_add): squared errors, pixels,
 * examples; the trainer adds them up over the ranks. */
static const char *const ae_sums[] = {"sq_err", "pixels", "examples", NULL};

typedef struct {
    double noise;      /* task.autoencoder.noise */
    float *shown;      /* the first SHOWN inputs, then their reconstructions (C, H, W each) */
    int nshown;
    int64_t chw[3];    /* of the shown images, from the batch itself */
} ae_state;

static kpl_status ae_create(kpl_trainer *t, void **state)
{
    const kpl_recipe *r = kpl_trainer_recipe(t);
    const int64_t *chw = kpl_trainer_input_shape(t);
    /* KPL_CHECK and KPL_TRY (kernels.h): kpl's own error discipline; the
     * message names this file and line */
    ae_state *s = calloc(1, sizeof *s);
    KPL_CHECK(s, KPL_ENOMEM, "autoencoder: out of memory");
    *state = s;
    KPL_TRY(kpl_key_float(kpl_trainer_task_keys(t), "noise", &s->noise));
    /* the recipe's model section, on the data's input: model.name
     * autoencoder (registered below), or another model of the zoo */
    kpl_model_config mc = r->model;
    if (!strcmp(mc.name, "none")) snprintf(mc.name, sizeof mc.name, "autoencoder");
    mc.in_channels = chw[0], mc.in_h = chw[1], mc.in_w = chw[2];
    kpl_module *m = NULL;
    KPL_TRY(kpl_zoo_create(&mc, kpl_trainer_device(t), (uint64_t)r->seed, &m));
    return kpl_trainer_add_model(t, "model", mc.name, m, NULL, NULL);
}

static void ae_destroy(void *state)
{
    ae_state *s = state;
    if (s) free(s->shown);
    free(s);
}

/* The batch's images where the model is (the batch's own on the CPU). */
static kpl_tensor *images(kpl_trainer *t, const kpl_batch *b)
{
    kpl_device *dev = kpl_trainer_device(t);
    return kpl_device_type_of(dev) == KPL_DEVICE_CPU ? b->image : kpl_to_device(b->image, dev);
}

/* One micro-batch: the forward pass and its loss; the trainer frees the
 * forward's temporaries, runs backward and reports the loss. */
static kpl_status ae_train_step(kpl_trainer *t, void *state, const kpl_batch *b,
                                kpl_step_result *out)
{
    ae_state *s = state;
    kpl_tensor *x = images(t, b), *input = x;
    if (x && s->noise > 0) { /* from the model's generator: in checkpoints with it */
        kpl_module *m = kpl_trainer_model(t, 0);
        input = kpl_add(x, kpl_randn(kpl_module_device(m), kpl_tensor_dtype(x),
                                     kpl_tensor_ndim(x), kpl_tensor_shape(x),
                                     kpl_module_rng(m), 0, s->noise));
    }
    kpl_tensor_list in = {1, {input}}, rec;
    KPL_TRY(input ? kpl_module_forward_list(kpl_trainer_model(t, 0), &in, &rec) : kpl_last_status());
    out->loss[0] = kpl_mse_loss(rec.t[0], x, KPL_REDUCE_MEAN);
    return out->loss[0] ? KPL_OK : kpl_last_status();
}

static kpl_status ae_eval_begin(kpl_trainer *t, void *state)
{
    (void)t;
    ae_state *s = state;
    s->nshown = 0;
    return KPL_OK;
}

/* The first batch's first images and reconstructions, kept for images(). */
static kpl_status keep_shown(kpl_trainer *t, ae_state *s, const kpl_batch *b, kpl_tensor *rec)
{
    (void)t;
    const int64_t *shape = kpl_tensor_shape(b->image); /* (N, C, H, W) */
    KPL_CHECK(kpl_tensor_numel(rec) == kpl_tensor_numel(b->image), KPL_EINVAL,
              "autoencoder: the reconstruction has %lld values for %lld input values",
              (long long)kpl_tensor_numel(rec), (long long)kpl_tensor_numel(b->image));
    size_t per = (size_t)(shape[1] * shape[2] * shape[3]);
    if (!s->shown || memcmp(s->chw, shape + 1, sizeof s->chw)) {
        free(s->shown);
        s->shown = malloc(2 * SHOWN * per * sizeof *s->shown);
        KPL_CHECK(s->shown, KPL_ENOMEM, "autoencoder: out of memory");
        memcpy(s->chw, shape + 1, sizeof s->chw);
    }
    const float *x = kpl_tensor_host_data(b->image), *y = kpl_tensor_host_data(rec);
    if (!x || !y) return kpl_last_status();
    s->nshown = b->size < SHOWN ? (int)b->size : SHOWN;
    memcpy(s->shown, x, (size_t)s->nshown * per * sizeof *x);
    memcpy(s->shown + SHOWN * per, y, (size_t)s->nshown * per * sizeof *y);
    return KPL_OK;
}

static kpl_status ae_eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    ae_state *s = state;
    kpl_tensor_list in = {1, {images(t, b)}}, out; /* out: reconstruction, code */
    KPL_TRY(kpl_module_forward_list(kpl_trainer_model(t, 0), &in, &out));
    if (s->nshown == 0 && kpl_trainer_rank(t) == 0) KPL_TRY(keep_shown(t, s, b, out.t[0]));
    kpl_tensor *se = kpl_mse_loss(out.t[0], in.t[0], KPL_REDUCE_NONE); /* (N, C, H, W) */
    const float *e = se ? kpl_tensor_host_data(se) : NULL;
    if (!e) return kpl_last_status();
    int64_t per = kpl_tensor_numel(se) / b->size;
    double v[3] = {0};
    for (int64_t i = 0; i < b->size; i++) {
        if (!kpl_trainer_eval_counts(t, b, i)) continue; /* a repeat of another rank's */
        for (int64_t k = 0; k < per; k++) v[0] += e[i * per + k];
        v[1] += (double)per;
        v[2]++;
    }
    for (int k = 0; k < 3; k++) KPL_TRY(kpl_trainer_eval_add(t, ae_sums[k], v[k]));
    return KPL_OK;
}

static kpl_status ae_eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    (void)state;
    double pixels = kpl_trainer_eval_total(t, "pixels");
    double mse = pixels > 0 ? kpl_trainer_eval_total(t, "sq_err") / pixels : NAN;
    res->examples = (int64_t)kpl_trainer_eval_total(t, "examples");
    res->nonfinite = isfinite(mse) ? 0 : res->examples;
    KPL_TRY(kpl_figures_set(&res->metrics, "mse", mse));
    return kpl_figures_set(&res->metrics, "psnr", mse > 0 ? -10 * log10(mse) : NAN);
}

/* TensorBoard: a row of inputs over a row of their reconstructions. */
static kpl_status ae_images(kpl_trainer *t, void *state, kpl_tb_writer *tb, int64_t step)
{
    ae_state *s = state;
    (void)t;
    int c = (int)s->chw[0], h = (int)s->chw[1], w = (int)s->chw[2], n = s->nshown;
    if (n == 0) return KPL_OK;
    uint8_t *grid = malloc((size_t)(2 * h) * (size_t)(n * w) * (size_t)c);
    KPL_CHECK(grid, KPL_ENOMEM, "autoencoder: out of memory");
    for (int row = 0; row < 2; row++)
        for (int i = 0; i < n; i++) {
            const float *img = s->shown + ((size_t)row * SHOWN + (size_t)i) * (size_t)(c * h * w);
            for (int y = 0; y < h; y++)
                for (int x = 0; x < w; x++)
                    for (int k = 0; k < c; k++) { /* CHW in [0, 1] -> HWC bytes */
                        float v = img[((size_t)k * h + y) * w + x];
                        v = v < 0 ? 0 : v > 1 ? 1 : v;
                        grid[(((size_t)row * h + y) * (size_t)(n * w) + (size_t)i * w + x) * c +
                             k] = (uint8_t)lrintf(v * 255);
                    }
        }
    kpl_status st = kpl_tb_add_image(tb, "val/reconstructions", step, 2 * h, n * w, c, grid);
    free(grid);
    return st;
}

static const kpl_task_kind autoencoder_task = {
    .name = "autoencoder",
    .best_metric = "mse",
    .best_higher = false,
    .create = ae_create,
    .destroy = ae_destroy,
    .train_step = ae_train_step,
    .eval_sums = ae_sums,
    .eval_begin = ae_eval_begin,
    .eval_batch = ae_eval_batch,
    .eval_end = ae_eval_end,
    .images = ae_images,
    .keys = ae_keys,
    .export_output = "reconstruction", /* kpl export: model 0's forward */
};

/* ---- an optimizer rule: Lion ------------------------------------------------------------------ */

/* Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
 * Algorithms"): c = b1 m + (1 - b1) g;  p -= lr (sign(c) + wd p);
 * m = b2 m + (1 - b2) g.  One state slot, exp_avg, saved in checkpoints as
 * the built-in rules' are. */
static const char *const lion_slots[] = {"exp_avg"};

static int lion_slot_names(const kpl_optim_config *c, const char *const **names)
{
    (void)c;
    *names = lion_slots;
    return 1;
}

static int lion_scratch(const kpl_optim_config *c)
{
    (void)c;
    return 2;
}

static kpl_status lion_check(const kpl_optim_config *c)
{
    KPL_CHECK(c->beta1 >= 0 && c->beta1 < 1 && c->beta2 >= 0 && c->beta2 < 1, KPL_EINVAL,
              "lion: betas (%g, %g) must be in [0, 1)", c->beta1, c->beta2);
    return KPL_OK;
}

static kpl_status lion_update(const kpl_optim_update *u)
{
    const kpl_optim_config *c = u->cfg;
    kpl_tensor *p = u->param, *a = u->scratch[0], *b = u->scratch[1], **m = &u->slot[0];
    if (!*m) KPL_TRY(kpl_optim_slot_zeros(u, "exp_avg", m));
    KPL_TRY(kpl_k_binary_scalar(a, KPL_BIN_MUL, *m, c->beta1, false));
    KPL_TRY(kpl_k_binary_scalar(b, KPL_BIN_MUL, u->grad, 1 - c->beta1, false));
    KPL_TRY(kpl_k_binary(a, KPL_BIN_ADD, a, b));
    KPL_TRY(kpl_k_unary(a, KPL_UN_SIGN, a, 0, 0));
    if (u->weight_decay > 0)
        KPL_TRY(kpl_k_binary_scalar(p, KPL_BIN_MUL, p, 1 - u->lr * u->weight_decay, false));
    KPL_TRY(kpl_k_binary_scalar(a, KPL_BIN_MUL, a, u->lr, false));
    KPL_TRY(kpl_k_binary(p, KPL_BIN_SUB, p, a));
    KPL_TRY(kpl_k_binary_scalar(*m, KPL_BIN_MUL, *m, c->beta2, false));
    KPL_TRY(kpl_k_binary_scalar(b, KPL_BIN_MUL, u->grad, 1 - c->beta2, false));
    return kpl_k_binary(*m, KPL_BIN_ADD, *m, b);
}

static const kpl_optim_rule lion = {
    .name = "lion",
    .slots = lion_slot_names,
    .scratch = lion_scratch,
    .check = lion_check,
    .update = lion_update,
};

/* ---- registration: the same file is a program and a plugin --------------------------------------- */

static const kpl_zoo_model autoencoder_model = {
    .name = "autoencoder",
    .doc = "a convolutional autoencoder (examples/autoencoder.c)",
    .create = autoencoder_create,
    .keys = autoencoder_keys,
};

/* Built against these headers (checked when kpl train --plugin loads it). */
KPL_PLUGIN_ABI;

/* Runs when the program starts, or when kpl_plugin_load (kpl train
 * --plugin) loads the shared library; what is registered then waits for
 * the ABI check. */
__attribute__((constructor)) static void register_autoencoder(void)
{
    kpl_task_register(&autoencoder_task);
    kpl_zoo_register(&autoencoder_model);
    kpl_optim_register(&lion);
}

#ifndef KPL_EXAMPLE_PLUGIN
/* ---- main ------------------------------------------------------------------------------------ */

/* What the trainer says: rank 0's lines on stdout, every rank's warnings
 * and errors on stderr (no progress bar). */
static void say(void *ctx, const kpl_log_event *e)
{
    (void)ctx;
    if (e->kind == KPL_LOG_WARN || e->kind == KPL_LOG_ERROR)
        fprintf(stderr, "autoencoder[%d]: %s\n", (int)e->rank, e->text);
    else if (e->rank == 0 && e->kind != KPL_LOG_PROGRESS)
        printf("%s\n", e->text);
}

int main(int argc, char **argv)
{
    /* RECIPE.yaml [KEY=VALUE ...] [--resume [FILE]] */
    kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
    o.log = say;
    const char *recipe = NULL, *overrides[64];
    int n = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--resume")) {
            o.resume = i + 1 < argc && !strchr(argv[i + 1], '=') ? argv[++i] : "";
        } else if (!recipe) {
            recipe = argv[i];
        } else if (n < 64) {
            overrides[n++] = argv[i];
        }
    }
    if (!recipe) {
        fprintf(stderr, "usage: %s RECIPE.yaml [KEY=VALUE ...] [--resume [FILE]]\n", argv[0]);
        return 2;
    }
    kpl_recipe *r = malloc(sizeof *r); /* a plain value, but a large one */
    if (!r) return 1;
    if (kpl_recipe_load(recipe, n, overrides, r) < 0) {
        fprintf(stderr, "%s\n", kpl_last_error());
        free(r);
        return 2;
    }
    /* SIGINT / SIGTERM stop the run after a step, with a checkpoint */
    kpl_catch_stop_signals(true);
    kpl_trainer *t = NULL;
    kpl_status st = kpl_trainer_create(r, &autoencoder_task, &o, &t); /* errors are said */
    if (st >= 0) st = kpl_trainer_fit(t);
    int rc = st >= 0 ? 0 : st == KPL_ECANCELED ? 128 + kpl_stop_requested() : 1;
    if (st < 0 && st != KPL_ECANCELED) kpl_trainer_end_job(t, 1); /* the other ranks too */
    kpl_trainer_destroy(t);
    free(r);
    return rc;
}
#endif /* KPL_EXAMPLE_PLUGIN */
