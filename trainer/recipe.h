/*
 * recipe.h — YAML recipes: the keys of a run, checked to the file, line and
 * key (docs/recipes.md).
 */
#ifndef KPL_RECIPE_H
#define KPL_RECIPE_H

#include "collective.h"
#include "dataio.h"
#include "optim.h"
#include "zoo.h"
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * A recipe is a YAML file whose keys are fixed by kpl (docs/recipes.md
 * lists them all with their defaults): unknown keys, values of the wrong
 * type or out of range, and missing required keys are errors naming the
 * file, the line and the dotted key.  `base: other.yaml` (relative to the
 * file) loads another recipe first and lays this one over it, map by map.
 * Overrides "a.b.c=VALUE" (VALUE in YAML flow syntax: 0.1, text, [1, 2])
 * are applied last.  A recipe's `plugins:` are loaded while it is read:
 * loading a recipe that names a plugin runs the plugin's code.
 *
 *   kpl_recipe *r = malloc(sizeof *r);
 *   const char *ov[] = {"optimizer.lr=0.2", "data.train.batch_size=64"};
 *   if (kpl_recipe_load("recipes/fashion_mnist/cnn.yaml", 2, ov, r) < 0)
 *       fprintf(stderr, "%s\n", kpl_last_error());  // "cnn.yaml:12:7: optimizer.lr: ..."
 *
 * kpl_recipe is a plain value (its pointers are NULL): copy it freely.
 */
#define KPL_RECIPE_PATH 1024
#define KPL_RECIPE_NAME 128
#define KPL_RECIPE_LIST 16

/* One split of the data (train or val) and the transform on its way. */
typedef struct {
    char path[KPL_RECIPE_PATH]; /* KPLRecord directory, relative to data.root; "" = none */
    char image_feature[KPL_RECIPE_NAME], label_feature[KPL_RECIPE_NAME];
    /* detection and segmentation targets ("": none): a float list of 4n
     * box corners, an int64 list of n box labels, a per-pixel mask;
     * loader.transform.max_boxes pads the boxes of a batch */
    char boxes_feature[KPL_RECIPE_NAME], box_labels_feature[KPL_RECIPE_NAME];
    char mask_feature[KPL_RECIPE_NAME];
    char box_ignore_feature[KPL_RECIPE_NAME]; /* int64 flags: boxes left out ("": none) */
    /* The loader's own settings: batch_size (per rank; val 0: train's),
     * shuffle, shuffle_window, initial_fill, drop_last, limit, interleave,
     * and the transform's (channels, crop, out_h/out_w, scale, ratio,
     * resize_shorter, short_sides, max_side, size_divisor, mask_pad,
     * scale_range, cat_max_ratio,
     * flip_prob, brightness, contrast, saturation, mean, std,
     * skip_corrupt).  Its pointers (path, device, feature names) are
     * NULL here: the trainer points them at the split's fields. */
    kpl_loader_config loader;
    int nmean, nstd;            /* values given for mean and std: 1 (for every channel) or 3 */
} kpl_recipe_split;

/* What a step whose loss or gradients are NaN or inf does. */
#define KPL_NONFINITE_POLICIES(X) X(KPL_NONFINITE_STOP, "stop") X(KPL_NONFINITE_SKIP, "skip")
typedef enum { KPL_NONFINITE_POLICIES(KPL_ENUM_VALUE) } kpl_nonfinite_policy;
KPL_ENUM_DECLARE(kpl_nonfinite_policy);
/* optimizer.lr_scaling: none, or linear in the global batch (Goyal et al.). */
#define KPL_LR_SCALINGS(X) X(KPL_LR_SCALING_NONE, "none") X(KPL_LR_SCALING_LINEAR, "linear")
typedef enum { KPL_LR_SCALINGS(KPL_ENUM_VALUE) } kpl_lr_scaling;
KPL_ENUM_DECLARE(kpl_lr_scaling);
/* schedule.per: the lr moves every step or once per epoch. */
#define KPL_LR_PERS(X) X(KPL_LR_PER_STEP, "step") X(KPL_LR_PER_EPOCH, "epoch")
typedef enum { KPL_LR_PERS(KPL_ENUM_VALUE) } kpl_lr_per;
KPL_ENUM_DECLARE(kpl_lr_per);
/* schedule.span: what cosine and poly decay over, the run's epochs or its
 * max_steps (an iteration schedule: "poly over 30k iterations"). */
#define KPL_LR_SPANS(X) X(KPL_LR_SPAN_EPOCHS, "epochs") X(KPL_LR_SPAN_MAX_STEPS, "max_steps")
typedef enum { KPL_LR_SPANS(KPL_ENUM_VALUE) } kpl_lr_span;
KPL_ENUM_DECLARE(kpl_lr_span);
/* log.progress: a progress bar on a terminal (or as kplrun asks), always, never. */
#define KPL_PROGRESS_MODES(X)                                                           \
    X(KPL_PROGRESS_AUTO, "auto") X(KPL_PROGRESS_ALWAYS, "always") X(KPL_PROGRESS_NEVER, "never")
typedef enum { KPL_PROGRESS_MODES(KPL_ENUM_VALUE) } kpl_progress_mode;
KPL_ENUM_DECLARE(kpl_progress_mode);
/* memory.recompute: keep every tensor the backward needs, recompute the
 * blocks the zoo marks (kpl_module_recompute_units) in the backward, or
 * only as many of them as memory.budget_mb needs (kpl_recompute_set_budget). */
#define KPL_RECOMPUTE_MODES(X)                                                                     \
    X(KPL_RECOMPUTE_NONE, "none") X(KPL_RECOMPUTE_BLOCKS, "blocks") X(KPL_RECOMPUTE_AUTO, "auto")
typedef enum { KPL_RECOMPUTE_MODES(KPL_ENUM_VALUE) } kpl_recompute_mode;
KPL_ENUM_DECLARE(kpl_recompute_mode);

/* The recipe binds into the owning modules' configuration structs
 * (kpl_model_config, kpl_loader_config, kpl_convert_options,
 * kpl_optim_config, kpl_lr_schedule, kpl_comm_config,
 * kpl_bucketer_config); the rest is the trainer's.  Their pointer members
 * stay NULL, and the fields the trainer computes (the schedule's base_lr
 * and epochs, the loaders' ranks and seed) are filled when it starts. */
typedef struct {
    char file[KPL_RECIPE_PATH]; /* the recipe file ("" when loaded from a string) */
    /* `plugins`: shared libraries loaded (kpl_plugin_load) before the other
     * keys are read, so that their tasks, models and optimizers can be
     * named; each path relative to the file naming it, kept resolved */
    char plugins[KPL_RECIPE_LIST][KPL_RECIPE_PATH];
    int nplugins;
    char name[KPL_RECIPE_NAME];
    char task[KPL_RECIPE_NAME]; /* task.name (or `task: NAME`): kpl_task_find's name */
    kpl_keyvals task_keys;      /* task.<name>.<key>: the task's own keys (task.h) */
    int64_t seed, epochs, threads, max_steps;
    char device[32];
    bool deterministic;
    char run_dir[KPL_RECIPE_PATH];
    kpl_model_config model;     /* in_channels, in_h, in_w 0: the data's */
    struct {
        char root[KPL_RECIPE_PATH];
        struct {
            kpl_convert_source from;
            char source[KPL_RECIPE_PATH];
            kpl_convert_options options; /* writer.shards, max_side, quality */
        } convert;
        int64_t workers, prefetch;
        kpl_recipe_split train, val;
    } data;
    struct {
        double label_smoothing;
        kpl_nonfinite_policy nonfinite;
        int64_t max_skips;      /* skip: give up after this many skipped steps in a row */
    } loss;
    kpl_dtype precision;        /* the math of convolutions and matmuls (the autocast dtype,
                                   graph.h): KPL_F32, KPL_BF16 or KPL_F16 ("fp16") */
    bool tf32;                  /* CUDA: f32 math on TF32 tensor cores (kpl_set_tf32) */
    struct { /* fp16's dynamic loss scale (torch.cuda.amp.GradScaler's) */
        double init, growth, backoff;
        int64_t interval;
    } loss_scale;
    struct {
        kpl_optim_config config; /* kind, lr, momentum, nesterov, weight_decay, betas, eps,
                                    trust_coefficient */
        double clip_grad_norm;
        bool no_decay_bn_bias;
        int64_t accumulate;
        kpl_lr_scaling lr_scaling;
        int64_t base_batch;
        kpl_param_group groups[KPL_RECIPE_LIST]; /* the first whose pattern matches */
        int ngroups;
    } optimizer;
    struct {
        kpl_lr_schedule config; /* base_lr and epochs: the trainer's */
        kpl_lr_per per;
        kpl_lr_span span;
    } schedule;
    struct {
        int64_t every_epochs, every_steps, keep_last;
        bool keep_best;
    } checkpoint;
    struct {
        int64_t every_steps;
        bool tensorboard;
        kpl_progress_mode progress;
    } log;
    struct {
        int64_t every_epochs, confusion_max_classes;
        bool at_start; /* also before the first step of a new run */
    } eval;
    struct {
        kpl_comm_config comm;       /* backend, timeout, stall_warning */
        kpl_bucketer_config buckets; /* bucket_mb, first_bucket_mb, check_params, grad_dtype */
        bool overlap;                /* false: buckets.after_backward */
    } dist;
    struct {
        /* [first, last]: the steps (1-based, counted as the logs count them,
         * across epochs and resumes) each rank traces into
         * RUN_DIR/profile/rank-NNNNN.trace.json; {0, 0}: off */
        int64_t steps[2];
        /* also the memory profile of that window: its peak's blocks, why
         * each is alive, into RUN_DIR/profile/memory-rank-NNNNN.json, and
         * a live-bytes counter in the trace (docs/memory.md) */
        bool memory;
    } profile;
    struct {
        kpl_recompute_mode recompute; /* docs/memory.md, "Recomputation" */
        double budget_mb;             /* auto: the allocator's bound, MiB */
        bool regenerate;              /* norms' outputs made again (kpl_set_regenerate) */
    } memory;
} kpl_recipe;

/* Loads `path`, its bases and the overrides into *out (every key set: the
 * defaults fill what the files leave out).  KPL_EINVAL / KPL_EFORMAT with
 * "file:line:column: key: what is wrong"; KPL_EIO when a file cannot be
 * read. */
kpl_status kpl_recipe_load(const char *path, int noverrides, const char *const *overrides,
                           kpl_recipe *out);
/* The same from YAML text; `origin` names it in messages.  A `base` key is
 * resolved relative to the working directory. */
kpl_status kpl_recipe_load_string(const char *yaml, const char *origin, int noverrides,
                                  const char *const *overrides, kpl_recipe *out);
/* The complete resolved recipe as YAML (every key, defaults included),
 * which kpl_recipe_load_string reads back to the same value.  *yaml is
 * malloc'd, owned by the caller. */
kpl_status kpl_recipe_to_yaml(const kpl_recipe *r, char **yaml);
/* Every key with its type, default and meaning, as the text of a YAML
 * file of comments (`kpl train --keys`). */
void kpl_recipe_print_keys(FILE *f);

#ifdef __cplusplus
}
#endif
#endif /* KPL_RECIPE_H */
