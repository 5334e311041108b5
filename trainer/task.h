/*
 * task.h — what is particular to a kind of training, as a vtable the
 * trainer (trainer.h) drives: build the models from the recipe, take one
 * training micro-batch, evaluate; and what a task may ask of its trainer.
 */
#ifndef KPL_TASK_H
#define KPL_TASK_H

#include "autograd.h"
#include "checkpoint.h"
#include "dataio.h"
#include "keys.h"
#include "module.h"
#include "recipe.h"
#include "tboard.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kpl_trainer kpl_trainer;

/* Named numbers: an evaluation's metrics ("loss", "top1"). */
#define KPL_FIGURES_MAX 16
typedef struct {
    int n;
    char name[KPL_FIGURES_MAX][32];
    double value[KPL_FIGURES_MAX];
} kpl_figures;
/* Sets name to v (added at the end when new).  KPL_EINVAL for a name of
 * 0 or more than 31 bytes or not [a-z0-9_], or when the list is full. */
kpl_status kpl_figures_set(kpl_figures *f, const char *name, double v);
/* NAN when there is no such figure. */
double kpl_figures_get(const kpl_figures *f, const char *name);

/* What an evaluation found, over every rank. */
typedef struct {
    kpl_figures metrics;
    int64_t examples;  /* each example of the split once */
    int64_t nonfinite; /* examples whose outputs were NaN or inf (counted as wrong) */
    int64_t skipped;   /* corrupt examples the loader dropped */
} kpl_eval_result;

/* What one training micro-batch gives back (train_step): the losses to
 * learn from and the figures to report.  Tensors may be pool-owned (the
 * trainer keeps them past the forward's pool). */
#define KPL_STEP_MODELS 4
#define KPL_STEP_FIGURES 8
typedef struct {
    /* loss[i]: model i's loss on the batch, a mean over its samples; NULL:
     * model i does not learn from this batch.  Reported as the figure
     * "loss" (model 0) or "loss_<model name>". */
    kpl_tensor *loss[KPL_STEP_MODELS];
    /* More figures, reported as sum / count over the ranks and steps since
     * the last report: "acc" = the right answers x 100, over the batch
     * size.  Sums stay on the device (one element; no gradient). */
    struct {
        const char *name; /* static */
        kpl_tensor *sum;
        double count;
    } figure[KPL_STEP_FIGURES];
    int nfigures;
} kpl_step_result;

/* Adds a figure to r: KPL_ERANGE when r is full, the error of sum's op
 * when sum is NULL (so `kpl_step_figure(r, "acc", kpl_sum(...), n)`
 * reports a failing op). */
kpl_status kpl_step_figure(kpl_step_result *r, const char *name, kpl_tensor *sum, double count);

/* A kind of training.  `state` is the task's own (create makes it).
 * Every member but eval_report, data and one of train_step and
 * train_batch is required. */
typedef struct {
    const char *name;
    /* The metric that selects best.kpl, and whether higher is better. */
    const char *best_metric;
    bool best_higher;
    /* Builds the models (kpl_trainer_add_model) from kpl_trainer_recipe
     * and kpl_trainer_input_shape. */
    kpl_status (*create)(kpl_trainer *t, void **state);
    void (*destroy)(void *state);
    /* One training micro-batch, the short way: the forward pass, its
     * losses and figures into *out.  The trainer does the rest in the
     * order that keeps memory low: the forward's temporaries go, backward
     * of each loss (DDP), then the figures, recorded where they are. */
    kpl_status (*train_step)(kpl_trainer *t, void *state, const kpl_batch *b,
                             kpl_step_result *out);
    /* Or the whole micro-batch by hand, for models that step in turn (a
     * GAN's): forward, the losses, kpl_trainer_backward for each model to
     * train, kpl_trainer_update between them, kpl_trainer_record for the
     * figures.  Used when train_step is NULL. */
    kpl_status (*train_batch)(kpl_trainer *t, void *state, const kpl_batch *b);
    /* Optional: the names of the evaluation's sums (NULL-terminated,
     * static; at most 32): kpl_trainer_eval_add, kpl_trainer_eval_total. */
    const char *const *eval_sums;
    /* Evaluation: begin, each batch (grad mode off, models in eval mode),
     * then end, which makes res from the totals (kpl_trainer_eval_total;
     * kpl_trainer_sum for anything else over the ranks). */
    kpl_status (*eval_begin)(kpl_trainer *t, void *state);
    kpl_status (*eval_batch)(kpl_trainer *t, void *state, const kpl_batch *b);
    kpl_status (*eval_end)(kpl_trainer *t, void *state, kpl_eval_result *res);
    /* Optional: more about the last evaluation for the log (a confusion
     * matrix), on rank 0 after the final one. */
    void (*eval_report)(kpl_trainer *t, void *state);
    /* Optional: adjusts a split's loader after the recipe has set it up,
     * before it starts (train: the training split, else validation): the
     * features the task's batches carry (transform.boxes_feature,
     * mask_feature, max_boxes; names must be static strings).  Runs before
     * create, on every rank. */
    void (*data)(const kpl_recipe *r, bool train, kpl_loader_config *c);
    /* Optional: images for TensorBoard after each evaluation (rank 0, with
     * log.tensorboard on): kpl_tb_add_image(tb, "val/...", step, ...). */
    kpl_status (*images)(kpl_trainer *t, void *state, kpl_tb_writer *tb, int64_t step);
    /* Optional: the task's own state in checkpoints (an EMA of weights, a
     * loss scaler's scale, a counter as a one-element tensor).  save adds
     * tensors named "task.<anything>" to c (kpl_checkpoint_add; read when
     * the file is written); it runs on rank 0 alone, so it must not call
     * collectives.  restore runs on every rank when a run resumes (after
     * the models and optimizers are back) and when kpl_trainer_restore
     * loads a checkpoint for evaluation; it finds its tensors with
     * kpl_checkpoint_find (NULL in a checkpoint written without them: a
     * warm start) and copies them into its own.  A model's generator
     * (kpl_module_rng: sampling noise, latents) is saved and restored by
     * the trainer, per rank. */
    kpl_status (*save)(kpl_trainer *t, void *state, kpl_checkpoint *c);
    kpl_status (*restore)(kpl_trainer *t, void *state, const kpl_checkpoint *c);
    /* Optional: its own recipe keys, task.<name>.<key> (keys.h), read with
     * kpl_key_*(kpl_trainer_task_keys(t), ...); a NULL-named row ends them. */
    const kpl_key *keys;
    /* Optional: the recipe's common keys it needs given (NULL-terminated,
     * "model.num_classes"): their defaults will not do for this task. */
    const char *const *needs;
    /* Optional: rules joining the task's keys with each other and with
     * the recipe's (a list's length, one key's bound by another), checked
     * as the recipe loads, before anything starts (kpl train exits 2).
     * kv holds the task's keys checked, defaults filled.  On a violation:
     * KPL_EINVAL with a message saying what is wrong and *key set to the
     * dotted key to change ("task.gan.fid_samples", "model.num_classes");
     * the recipe puts the file, line and key in front. */
    kpl_status (*check)(const kpl_recipe *r, const kpl_keyvals *kv, const char **key);
    /* Optional: the task's inference is model 0's forward on an image
     * batch (its first output, when it gives several), and this names the
     * graph's output ("logits"): `kpl export` and kpl_trainer_export write
     * it.  NULL: no inference graph (a
     * detector's boxes, a GAN's sampling; kpl export refuses). */
    const char *export_output;
} kpl_task_kind;

/* KPL_EINVAL naming task when it has no inference graph (export_output). */
kpl_status kpl_task_export_check(const kpl_task_kind *task);

/* The tasks kpl knows by name ("classification"); NULL for others. */
const kpl_task_kind *kpl_task_find(const char *name);
extern const kpl_task_kind kpl_task_classification;
/* FCOS on the zoo's "fcos" model, COCO's figures (trainer/tasks/detect.c,
 * docs/detection.md). */
extern const kpl_task_kind kpl_task_detection;
/* Per-pixel classes on the zoo's deeplabv3 or unet (any model giving
 * (N, classes, H, W) logits), mIoU from a confusion matrix over every
 * rank (trainer/tasks/segment.c, docs/segmentation.md). */
extern const kpl_task_kind kpl_task_segmentation;
/* A generator and a discriminator trained in turn (DCGAN, WGAN-GP, SNGAN),
 * FID and Inception Score with a feature network, sample grids
 * (trainer/tasks/gan.c, docs/gan.md). */
extern const kpl_task_kind kpl_task_gan;
/* Adds a task kpl_task_find (and so `kpl train`) finds by its name; k is
 * borrowed (static).  KPL_EINVAL for a name known already, naming who
 * registered it.  From a plugin's constructor: see kpl_plugin_load. */
kpl_status kpl_task_register(const kpl_task_kind *k);
/* Every task known, built-ins first. */
int kpl_task_count(void);
const kpl_task_kind *kpl_task_at(int i);

/* For tasks: the run's recipe, device, ranks, and the input (C, H, W) the
 * data gives (model.input_size and in_channels override it). */
const kpl_recipe *kpl_trainer_recipe(const kpl_trainer *t);
/* The task's own keys (task.<name>.<key>), checked, defaults filled. */
const kpl_keyvals *kpl_trainer_task_keys(const kpl_trainer *t);
kpl_device *kpl_trainer_device(const kpl_trainer *t);
int32_t kpl_trainer_rank(const kpl_trainer *t);
int32_t kpl_trainer_world(const kpl_trainer *t);
const int64_t *kpl_trainer_input_shape(const kpl_trainer *t);
/* The factor optimizer.lr_scaling multiplies the recipe's learning rates
 * by (1 without it): for a model given its own optimizer configuration. */
double kpl_trainer_lr_scale(const kpl_trainer *t);
/* The run directory ("" under kpl eval, which makes none). */
const char *kpl_trainer_run_dir(const kpl_trainer *t);
/* A split's KPLRecord directory (train, or validation; "" when the recipe
 * has none) and the examples its loader draws from (data.<split>.limit
 * applied; 0 without a loader): for a task that reads the split's records
 * itself, as detection reads its ground truth. */
const char *kpl_trainer_data_path(const kpl_trainer *t, bool train);
int64_t kpl_trainer_data_examples(const kpl_trainer *t, bool train);
/* Adds a model: the trainer owns `m` from here on (also on failure), and
 * gives it an optimizer (oc, or NULL for the recipe's optimizer section
 * with its groups), a DDP and a place in checkpoints ("<name>.<tensor>";
 * the first model is "model"; "optim" is taken by optimizer state).
 * label names it in the log ("resnet50").  *index (may be NULL) receives
 * its number.  Only inside create.  Every parameter must exist by then
 * (the optimizer and DDP take them now; a later one is an error at the
 * next backward); buffers may be added later. */
kpl_status kpl_trainer_add_model(kpl_trainer *t, const char *name, const char *label,
                                 kpl_module *m, const kpl_optim_config *oc, int *index);
int kpl_trainer_num_models(const kpl_trainer *t);
kpl_module *kpl_trainer_model(const kpl_trainer *t, int i);
/* Backward of a micro-batch's loss for model i (scaled by 1 / accumulate;
 * DDP reduces on the step's last micro-batch).  *value (may be NULL)
 * receives the loss (a host read: on a GPU, a wait for the device).  A NaN
 * or inf loss is an error naming the step under loss.nonfinite stop: with
 * value NULL, found without a wait one step later (or at the next report,
 * checkpoint or evaluation, which then fail; no checkpoint holds such a
 * step).  Under skip the loss is read at once, and the step is left out. */
kpl_status kpl_trainer_backward(kpl_trainer *t, int model, kpl_tensor *loss, double *value);
/* Steps model i's optimizer now (clipping, the schedule's lr) instead of
 * at the end of the step; for models that train in turn. */
kpl_status kpl_trainer_update(kpl_trainer *t, int model);
/* Adds a training figure: reported as sum / count over the ranks and the
 * steps since the last report ("loss": loss x batch, batch). */
kpl_status kpl_trainer_record(kpl_trainer *t, const char *name, double sum, double count);
/* The same with the sum as a one-element tensor where the model is: it is
 * added up there and read at the report, so a step never waits for the
 * device ("acc": kpl_sum of the right answers).  Not recorded by autograd;
 * left out for a step whose loss was not finite under loss.nonfinite skip. */
kpl_status kpl_trainer_record_tensor(kpl_trainer *t, const char *name, kpl_tensor *sum,
                                     double count);
/* Collectives for tasks: every rank calls them in the same order with
 * the same n (len for broadcast); nothing happens on one rank.  A rank
 * that fails one fails the run (kpl_trainer_end_job ends the others).
 * Element-wise sum, max and min of v over the ranks, in place. */
kpl_status kpl_trainer_sum(kpl_trainer *t, double *v, int n);
kpl_status kpl_trainer_max(kpl_trainer *t, double *v, int n);
kpl_status kpl_trainer_min(kpl_trainer *t, double *v, int n);
/* root's len bytes of buf into every rank's buf. */
kpl_status kpl_trainer_broadcast(kpl_trainer *t, void *buf, size_t len, int32_t root);
/* Every rank's bytes, of any length (0 too), to every rank: *all (malloc'd,
 * the caller's to free; NULL when the total is 0) holds rank 0's lens[0]
 * bytes, then rank 1's, ...; lens has kpl_trainer_world entries.  For an
 * exact metric over every rank's results (a detector's boxes for mAP). */
kpl_status kpl_trainer_all_gather(kpl_trainer *t, const void *data, size_t len, void **all,
                                  size_t *lens);
/* An evaluation's sums, by the names the task kind lists in eval_sums:
 * zero when the evaluation begins, added to by eval_batch on each rank,
 * summed over the ranks before eval_end, which reads the totals.
 * KPL_EINVAL for a name the kind does not list, or outside an evaluation. */
kpl_status kpl_trainer_eval_add(kpl_trainer *t, const char *name, double v);
/* In eval_end: the total over every rank (NAN for an unlisted name). */
double kpl_trainer_eval_total(const kpl_trainer *t, const char *name);
/* Whether sample i of an evaluation batch is an example of its own: the
 * repeats that even out the ranks' shares of the split are not. */
bool kpl_trainer_eval_counts(const kpl_trainer *t, const kpl_batch *b, int64_t i);
/* Rank 0's console and every rank's log file; warnings go to stderr. */
void kpl_trainer_info(kpl_trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kpl_trainer_warn(kpl_trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#ifdef __cplusplus
}
#endif
#endif /* KPL_TASK_H */
