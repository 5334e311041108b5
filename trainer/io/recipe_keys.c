/*
 * recipe_keys.c — the recipe's keys: one table that binds each key into
 * kpl_recipe, with its type, default, range and meaning.  The same table
 * gives the defaults and checks (recipe.c), the resolved YAML written into
 * every run directory and the key reference of `kpl train --keys` (below),
 * so they never disagree.
 */
#include "recipe_impl.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

/* ---- the key table ------------------------------------------------------------------- */


/* The models model.name may name: the zoo's (plugins' too), or none. */
static void model_names(char *buf, size_t len)
{
    kpl__zoo_names(buf, len);
    size_t at = strlen(buf);
    snprintf(buf + at, len - at, "%snone", at ? ", " : "");
}

/* Whether name is one of list's ", "-separated names. */
bool kpl__rc_name_listed(const char *name, const char *list)
{
    size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const char *e = strstr(p, ", ");
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == n && !strncmp(p, name, n)) return true;
        if (!e) break;
        p = e + 2;
    }
    return false;
}

/* The trainer's own enums (the others are their modules'). */
KPL_ENUM_DEFINE(kpl_lr_scaling, KPL_LR_SCALINGS)
KPL_ENUM_DEFINE(kpl_lr_per, KPL_LR_PERS)
KPL_ENUM_DEFINE(kpl_lr_span, KPL_LR_SPANS)
KPL_ENUM_DEFINE(kpl_recompute_mode, KPL_RECOMPUTE_MODES)
/* The vocabularies of the recipe's model.stem, model.norm and
 * schedule.name: declared by their owners (zoo.h, optim.h), defined here at
 * the bottom with the keys that parse them. */
KPL_ENUM_DEFINE(kpl_resnet_stem, KPL_RESNET_STEMS)
KPL_ENUM_DEFINE(kpl_norm_kind, KPL_NORMS)
KPL_ENUM_DEFINE(kpl_sched_kind, KPL_SCHED_KINDS)
KPL_ENUM_DEFINE(kpl_progress_mode, KPL_PROGRESS_MODES)
KPL_ENUM_DEFINE(kpl_nonfinite_policy, KPL_NONFINITE_POLICIES)

/* precision and dist.grad_dtype: the value stored is the index, which must
 * be the kpl_dtype (the autocast dtype; the bucketer's config holds one),
 * from the recipe on.  "fp16" is how recipes spell f16. */
_Static_assert(KPL_F32 == 0 && KPL_F16 == 1 && KPL_BF16 == 2,
               "float_dtype_names is indexed by kpl_dtype");
static const char *const float_dtype_names[] = {
    [KPL_F32] = "f32", [KPL_F16] = "fp16", [KPL_BF16] = "bf16", NULL};

#define OFF(m) offsetof(kpl_recipe, m)
#define SZ(m) sizeof(((kpl_recipe *)0)->m)
#define ESZ(m) sizeof(((kpl_recipe *)0)->m[0])
#define CAP(m) (SZ(m) / ESZ(m))
#define BIG 9.2e18
#define F_INT(k, m, d, lo, hi, h) {k, T_INT, OFF(m), SZ(m), 0, 0, 0, d, lo, hi, NULL, h, NULL, NULL}
#define F_FLOAT(k, m, d, lo, hi, h) {k, T_FLOAT, OFF(m), SZ(m), 0, 0, 0, d, lo, hi, NULL, h, NULL, NULL}
#define F_BOOL(k, m, d, h) {k, T_BOOL, OFF(m), SZ(m), 0, 0, 0, d, 0, 1, NULL, h, NULL, NULL}
#define F_STR(k, m, d, h) {k, T_STR, OFF(m), 1, 0, CAP(m), 0, d, 0, 0, NULL, h, NULL, NULL}
#define F_ENUM(k, m, d, c, h) {k, T_ENUM, OFF(m), SZ(m), 0, 0, 0, d, 0, 0, c, h, NULL, NULL}
#define F_NAME(k, m, d, known, h) {k, T_STR, OFF(m), 1, 0, CAP(m), 0, d, 0, 0, NULL, h, NULL, known}
#define F_INTS(k, m, n, d, lo, hi, h)                                                         \
    {k, T_INTS, OFF(m), ESZ(m), 0, CAP(m), OFF(n), d, lo, hi, NULL, h, NULL, NULL}
#define F_FLOATS(k, m, n, d, lo, hi, h)                                                       \
    {k, T_FLOATS, OFF(m), ESZ(m), 0, CAP(m), OFF(n), d, lo, hi, NULL, h, NULL, NULL}
#define F_INT2(k, m1, m2, need, form, d, lo, hi, h)                                           \
    {k, T_INT2, OFF(m1), SZ(m1), OFF(m2), need, 0, d, lo, hi, NULL, h, form, NULL}
#define F_FLOAT2(k, m1, m2, need, form, d, lo, hi, h)                                         \
    {k, T_FLOAT2, OFF(m1), SZ(m1), OFF(m2), need, 0, d, lo, hi, NULL, h, form, NULL}
#define F_GROUPS(k, m, n, h)                                                                  \
    {k, T_GROUPS, OFF(m), ESZ(m), 0, CAP(m), OFF(n), "[]", 0, 1e6, NULL, h, NULL, NULL}

/* The keys of one data split; train and val differ in a few defaults. */
#define SPLIT(sp, path_def, bs_def, shuffle_def)                                             \
    F_STR("data." #sp ".path", data.sp.path, path_def,                                       \
          "KPLRecord directory, relative to data.root (\"\": none)"),                        \
    F_INT("data." #sp ".batch_size", data.sp.loader.batch_size, bs_def, 0, 1 << 24,           \
          "samples per step on each rank (val 0: train's)"),                                 \
    F_ENUM("data." #sp ".shuffle", data.sp.loader.shuffle, shuffle_def,                      \
           kpl_shuffle_mode_names,                                                           \
           "sample order: none, chunk (sequential reads), buffer, example"),                 \
    F_INT("data." #sp ".shuffle_window", data.sp.loader.shuffle_window, "8", 1, 1 << 20,      \
          "chunk shuffle: chunks whose examples are mixed together"),                        \
    F_INT("data." #sp ".initial_fill", data.sp.loader.initial_fill, "4096", 1, 1 << 30,       \
          "buffer shuffle: examples in the shuffle buffer"),                                 \
    F_BOOL("data." #sp ".drop_last", data.sp.loader.drop_last, "false",                      \
           "drop an epoch's last partial batch"),                                            \
    F_INT("data." #sp ".limit", data.sp.loader.limit, "0", 0, BIG,                            \
          "use only the first N examples of the set (0: all)"),                              \
    F_BOOL("data." #sp ".interleave", data.sp.loader.interleave, "false",                     \
           "ranks take every world-th example (same global batches for any rank count) "     \
           "instead of contiguous slices (sequential reads)"),                               \
    F_STR("data." #sp ".image_feature", data.sp.image_feature, "image", "image feature"),    \
    F_STR("data." #sp ".label_feature", data.sp.label_feature, "label",                      \
          "label feature (\"\": none, for tasks that need no labels)"),                        \
    F_STR("data." #sp ".boxes_feature", data.sp.boxes_feature, "\"\"",                      \
          "boxes feature: float list x0, y0, x1, y1, ... in pixels of the stored image; "    \
          "batches carry (N, max_boxes, 4) boxes and their count (\"\": none)"),              \
    F_STR("data." #sp ".box_labels_feature", data.sp.box_labels_feature, "\"\"",            \
          "box labels feature: int64 list, one per box (with boxes_feature; \"\": none)"),    \
    F_STR("data." #sp ".box_ignore_feature", data.sp.box_ignore_feature, "\"\"",            \
          "int64 flags, one per box: boxes flagged non-zero are left out of the batch "       \
          "(crowd regions; \"\": none, or the task's choice: detection's training split "    \
          "takes difficult, else iscrowd, when the records have them)"),                    \
    F_INT("data." #sp ".max_boxes", data.sp.loader.transform.max_boxes, "0", 0, 65536,        \
          "box rows per image: at least the most boxes an example stores (more is an "       \
          "error, never a truncation); needed with boxes_feature"),                         \
    F_STR("data." #sp ".mask_feature", data.sp.mask_feature, "\"\"",                        \
          "per-pixel mask feature: PNG or raw (H, W) u8 of the image's size, transformed "  \
          "with it (nearest neighbour); \"\": none"),                                         \
    F_INT("data." #sp ".transform.channels", data.sp.loader.transform.channels, "3", 1, 3,   \
          "image channels after decoding: 1 or 3"),                                          \
    F_ENUM("data." #sp ".transform.crop", data.sp.loader.transform.crop, "none",             \
           kpl_crop_mode_names,                                                              \
           "none (whole image), random_resized, center, keep_ratio (whole image, aspect "     \
           "kept: short_sides, max_side; batches padded), scale_crop (segmentation: "        \
           "scaled by a factor in scale_range, a random crop of size, padded)"),             \
    F_INT2("data." #sp ".transform.size", data.sp.loader.transform.out_h,                    \
           data.sp.loader.transform.out_w, 0, "[h, w]", "[]", 1, 1 << 16,                             \
           "output [h, w] (or one value for both); []: the stored size"),                    \
    F_FLOAT2("data." #sp ".transform.scale", data.sp.loader.transform.scale[0],              \
             data.sp.loader.transform.scale[1], 2, "[min, max]", "[0.08, 1.0]", 0, 1,                     \
             "random_resized: range of the crop's area fraction"),                          \
    F_FLOAT2("data." #sp ".transform.ratio", data.sp.loader.transform.ratio[0],              \
             data.sp.loader.transform.ratio[1], 2, "[min, max]",                            \
             "[0.75, 1.3333333333333333]", 1e-3, 1e3,                                        \
             "random_resized: range of the crop's aspect ratio"),                           \
    F_INT("data." #sp ".transform.resize_shorter", data.sp.loader.transform.resize_shorter,  \
          "0", 0, 1 << 16, "center: shorter side before the crop (0: the crop size); "       \
          "scale_crop: the shorter side the factor scales (0: the stored size)"),             \
    F_FLOAT2("data." #sp ".transform.scale_range", data.sp.loader.transform.scale_range[0],  \
             data.sp.loader.transform.scale_range[1], 2, "[min, max]", "[0.5, 2.0]", 1e-3,  \
             16, "scale_crop: range of the scale factor, drawn uniformly per sample"),        \
    F_FLOAT("data." #sp ".transform.cat_max_ratio", data.sp.loader.transform.cat_max_ratio,  \
            "0", 0, 1, "scale_crop: redraw a crop (up to 10 times) where one mask class "      \
            "covers this share or more (needs mask_feature; 0 or 1: off)"),                 \
    F_INTS("data." #sp ".transform.short_sides", data.sp.loader.transform.short_sides,       \
           data.sp.loader.transform.num_short_sides, "[]", 0, 1 << 14,                       \
           "keep_ratio: the shorter side, one of these per image, drawn per sample (up to "  \
           "8; evaluation: one; 0: the stored size, within max_side)"),                     \
    F_INT("data." #sp ".transform.max_side", data.sp.loader.transform.max_side, "0", 0,       \
          1 << 14, "keep_ratio: the longer side at most this (e.g. 1333)"),                  \
    F_INT("data." #sp ".transform.size_divisor", data.sp.loader.transform.size_divisor, "32",  \
          0, 1024, "keep_ratio: batches padded to a multiple of this (0 or 1: not rounded)"), \
    F_INT("data." #sp ".transform.mask_pad", data.sp.loader.transform.mask_pad, "0", 0, 255,  \
          "keep_ratio, scale_crop: the value of padded mask pixels (255: segmentation's "   \
          "ignore)"),                                                                        \
    F_FLOAT("data." #sp ".transform.flip", data.sp.loader.transform.flip_prob, "0", 0, 1,    \
            "horizontal flip probability"),                                                  \
    F_FLOAT("data." #sp ".transform.brightness", data.sp.loader.transform.brightness, "0", 0, \
            1, "brightness jitter"),                                                         \
    F_FLOAT("data." #sp ".transform.contrast", data.sp.loader.transform.contrast, "0", 0, 1,  \
            "contrast jitter"),                                                              \
    F_FLOAT("data." #sp ".transform.saturation", data.sp.loader.transform.saturation, "0", 0, \
            1, "saturation jitter"),                                                         \
    F_FLOATS("data." #sp ".transform.mean", data.sp.loader.transform.mean, data.sp.nmean,    \
             "[0]", -1e3, 1e3, "normalisation mean of x/255, one value or one per channel"), \
    F_FLOATS("data." #sp ".transform.std", data.sp.loader.transform.std, data.sp.nstd, "[1]", \
             1e-6, 1e3, "normalisation std of x/255, one value or one per channel"),        \
    F_BOOL("data." #sp ".skip_corrupt", data.sp.loader.transform.skip_corrupt, "false",      \
           "drop examples whose image cannot be decoded (warned, counted in metrics.jsonl) " \
           "instead of stopping the run")

const field kpl__rc_fields[] = {
    F_STR("name", name, "\"\"", "run name (default: the recipe file's name)"),
    F_STR("task.name", task, "classification",
          "what the run trains (`task: NAME` for short; a plugin may add tasks)"),
    F_INT("seed", seed, "0", 0, BIG, "seed of initialisation, data order and augmentation"),
    F_INT("epochs", epochs, NULL, 1, 1e6, "epochs to train"),
    F_STR("device", device, "auto",
          "auto (a GPU per rank when there are GPUs, else cpu), cpu, cuda, cuda:N"),
    F_INT("threads", threads, "0", 0, 1024,
          "CPU threads per rank (0: OMP_NUM_THREADS, else cores / ranks on the node)"),
    F_BOOL("deterministic", deterministic, "false",
           "pick algorithms without timing them: bit-identical reruns and resumes"),
    F_ENUM("precision", precision, "f32", float_dtype_names,
           "math of convolutions and matmuls: f32, bf16 or fp16 (mixed precision: parameters, "
           "norms, reductions and losses stay f32; docs/precision.md)"),
    F_BOOL("tf32", tf32, "false",
           "CUDA: f32 convolutions and matmuls on TF32 tensor cores (Ampere and later; about "
           "1e-3 relative error per product)"),
    F_FLOAT("loss_scale.init", loss_scale.init, "65536", 1, 1e30,
            "fp16: the dynamic loss scale to start with"),
    F_FLOAT("loss_scale.growth", loss_scale.growth, "2", 1, 1e6,
            "fp16: the scale's factor after loss_scale.interval steps with finite gradients"),
    F_FLOAT("loss_scale.backoff", loss_scale.backoff, "0.5", 1e-6, 1,
            "fp16: the scale's factor after a step with inf/NaN gradients (its update is "
            "skipped)"),
    F_INT("loss_scale.interval", loss_scale.interval, "2000", 1, BIG,
          "fp16: steps with finite gradients before the scale grows"),
    F_STR("run_dir", run_dir, "\"\"", "run directory (default: runs/<name>-<time>)"),
    F_INT("max_steps", max_steps, "0", 0, BIG, "stop after this many steps in all (0: no limit)"),

    F_NAME("model.name", model.name, "none", model_names,
           "the model (classification needs one; none: the task builds its own; a plugin "
           "may add others)"),
    F_INT("model.num_classes", model.num_classes, "0", 0, 1e7,
          "classes (classification needs them)"),
    F_INT("model.in_channels", model.in_channels, "0", 0, 64,
          "input channels (0: data.train.transform.channels)"),
    F_INT2("model.input_size", model.in_h, model.in_w, 0, "[h, w]", "[]", 1, 1 << 16,
           "input [h, w] (default: the train transform's size, else the stored one)"),
    F_INT("model.width", model.width, "0", 0, 4096,
          "base width (0: lenet 6, cnn 32, resnet 64, dcgan 64)"),
    F_INT("model.depth", model.depth, "0", 0, 1000,
          "resnet: 18, 34, 50, 101 or 152; cnn: conv stages (0: 2)"),
    F_ENUM("model.stem", model.stem, "imagenet", kpl_resnet_stem_names,
           "resnet stem: imagenet (7x7/2 + max-pool) or cifar (3x3/1)"),
    F_ENUM("model.norm", model.norm, "batch", kpl_norm_kind_names,
           "resnet (deeplabv3, unet, fcos) normalisation: batch norm, or group norm (32 groups; "
           "independent of the "
           "batch: small per-rank batches, detectors from scratch)"),
    F_INTS("model.hidden", model.hidden, model.nhidden, "[]", 1, 1 << 20,
           "hidden layer widths (mlp default [512, 256]; cnn default [128])"),
    F_FLOAT("model.dropout", model.dropout, "0", 0, 0.99,
            "dropout before the last linear layer (mlp, cnn)"),
    F_BOOL("model.zero_init_residual", model.zero_init_residual, "false",
           "resnet: last batch norm of each block starts at scale 0"),
    F_STR("model.weights", model.weights, "\"\"",
          "checkpoint whose model.* tensors start a fresh run (kpl import onnx writes one from "
          "a pretrained ONNX model; a resume ignores it)"),
    F_STR("model.weights_into", model.weights_into, "\"\"",
          "the module of the model model.weights go into (e.g. backbone; \"\": the whole model)"),
    F_BOOL("model.sync_bn", model.sync_bn, "false",
           "batch norms take their training statistics over every rank's batch (SyncBN: small "
           "per-rank batches, segmentation)"),

    F_STR("data.root", data.root, "\"\"", "directory the split paths are relative to"),
    F_ENUM("data.convert.from", data.convert.from, "none", kpl_convert_source_names,
           "build missing splits from a source first: none, idx, imagefolder, lmdb, coco, voc, "
           "voc-seg, masks, cifar, images"),
    F_STR("data.convert.source", data.convert.source, "\"\"",
          "idx: a directory of IDX files; imagefolder/images/lmdb: root with one folder per "
          "split; coco: root with <split>.json and <split>/ images; voc, voc-seg: the VOC root; "
          "masks: root with <split>/images, <split>/masks and classes.txt; cifar: the folder of "
          "either layout (or holding it), splits train and test (or val)"),
    F_INT("data.convert.shards", data.convert.options.writer.shards, "1", 1, 1 << 16,
          "shards per split"),
    F_INT("data.convert.max_side", data.convert.options.max_side, "0", 0, 1 << 16,
          "imagefolder, images: re-encode JPEGs whose longer side exceeds this (0: keep)"),
    F_INT("data.convert.quality", data.convert.options.quality, "90", 1, 100,
          "imagefolder, images: JPEG quality of re-encoded images"),
    F_BOOL("data.convert.skip_bad", data.convert.options.skip_bad, "false",
           "imagefolder, images, coco, voc, voc-seg, masks: leave out bad images and "
           "annotations with a warning naming each (counted), instead of failing"),
    F_BOOL("data.convert.drop_empty", data.convert.options.drop_empty, "false",
           "coco, voc: leave out of the training split the images without objects (crowds and "
           "VOC's difficult objects do not count; validation keeps every image)"),
    F_INT("data.workers", data.workers, "1", 1, 256, "transformer processes per rank and split"),
    F_INT("data.prefetch", data.prefetch, "2", 1, 64, "batches prepared ahead"),
    SPLIT(train, NULL, NULL, "chunk"),
    SPLIT(val, "\"\"", "0", "none"),

    F_FLOAT("loss.label_smoothing", loss.label_smoothing, "0", 0, 0.999,
            "cross-entropy label smoothing"),
    F_ENUM("loss.nonfinite", loss.nonfinite, "stop", kpl_nonfinite_policy_names,
           "a step whose loss or gradients are NaN or inf: stop the run with an error, or "
           "skip its update (counted in metrics.jsonl)"),
    F_INT("loss.max_skips", loss.max_skips, "20", 0, BIG,
          "skip: stop anyway after this many skipped steps in a row (0: never)"),

    F_NAME("optimizer.name", optimizer.config.name, "sgd", kpl__optim_names,
           "the update rule (a plugin may add others)"),
    F_FLOAT("optimizer.lr", optimizer.config.lr, NULL, 0, 1e6,
            "peak learning rate (for base_batch samples when lr_scaling is linear)"),
    F_FLOAT("optimizer.momentum", optimizer.config.momentum, "0", 0, 0.9999, "sgd, lars: momentum"),
    F_BOOL("optimizer.nesterov", optimizer.config.nesterov, "false", "sgd: Nesterov momentum"),
    F_FLOAT("optimizer.weight_decay", optimizer.config.weight_decay, "0", 0, 10, "weight decay"),
    F_FLOAT2("optimizer.betas", optimizer.config.beta1, optimizer.config.beta2, 2, "[beta1, beta2]",
             "[0.9, 0.999]", 0, 0.999999, "adam, adamw: [beta1, beta2]"),
    F_FLOAT("optimizer.eps", optimizer.config.eps, "1e-8", 1e-30, 1, "adam, adamw: epsilon"),
    F_FLOAT("optimizer.trust_coefficient", optimizer.config.trust_coefficient, "0.001", 1e-9, 10,
            "lars: eta"),
    F_BOOL("optimizer.no_decay_bn_bias", optimizer.no_decay_bn_bias, "false",
           "no weight decay (lars: no trust ratio) for batch-norm parameters and biases"),
    F_FLOAT("optimizer.clip_grad_norm", optimizer.clip_grad_norm, "0", 0, 1e9,
            "clip the global gradient norm to this (0: off)"),
    F_INT("optimizer.accumulate", optimizer.accumulate, "1", 1, 4096,
          "micro-batches per step (gradient accumulation)"),
    F_ENUM("optimizer.lr_scaling", optimizer.lr_scaling, "none", kpl_lr_scaling_names,
           "linear: lr x (batch_size x ranks x accumulate) / base_batch (Goyal et al.)"),
    F_INT("optimizer.base_batch", optimizer.base_batch, "256", 1, 1 << 30,
          "the global batch optimizer.lr is given for"),
    F_GROUPS("optimizer.groups", optimizer.groups, optimizer.ngroups,
             "parameter groups, a list of {params: PATTERN, lr_mult: 1, weight_decay_mult: 1}: "
             "a parameter whose dotted name (e.g. layer1.0.conv1.weight) matches PATTERN "
             "(shell wildcards; the first group that matches) takes lr and weight decay times "
             "these; a pattern that matches nothing is an error"),

    F_ENUM("schedule.name", schedule.config.kind, "constant", kpl_sched_kind_names,
           "constant, step, multistep, cosine or poly"),
    F_FLOAT("schedule.warmup_epochs", schedule.config.warmup_epochs, "0", 0, 1e6,
            "linear warmup length in epochs"),
    F_FLOAT("schedule.warmup_factor", schedule.config.warmup_factor, "0", 0, 1,
            "lr at the start of warmup, as a fraction of lr"),
    F_FLOAT("schedule.step_size", schedule.config.step_size, "30", 1e-9, 1e6,
            "step: epochs per decay"),
    F_FLOAT("schedule.gamma", schedule.config.gamma, "0.1", 1e-9, 1,
            "step, multistep: decay factor"),
    F_FLOATS("schedule.milestones", schedule.config.milestones, schedule.config.num_milestones,
             "[]", 1e-9, 1e6, "multistep: epochs at which lr is multiplied by gamma"),
    F_FLOAT("schedule.power", schedule.config.power, "2", 1e-9, 100, "poly: exponent"),
    F_FLOAT("schedule.min_lr", schedule.config.min_lr, "0", 0, 1e6, "cosine, poly: final lr"),
    F_ENUM("schedule.per", schedule.per, "step", kpl_lr_per_names,
           "move the lr every step, or once per epoch"),
    F_ENUM("schedule.span", schedule.span, "epochs", kpl_lr_span_names,
           "cosine, poly: decay over the run's epochs, or over its max_steps (an iteration "
           "schedule; a resume with another max_steps follows the new span)"),

    F_INT("checkpoint.every_epochs", checkpoint.every_epochs, "1", 0, BIG,
          "save after every N epochs (0: only at the end)"),
    F_INT("checkpoint.every_steps", checkpoint.every_steps, "0", 0, BIG,
          "also save every N steps (0: off)"),
    F_INT("checkpoint.keep_last", checkpoint.keep_last, "3", 0, 1 << 20,
          "checkpoints kept (0: all)"),
    F_BOOL("checkpoint.keep_best", checkpoint.keep_best, "true",
           "keep the checkpoint of the best val top-1 as best.kpl"),

    F_INT("log.every_steps", log.every_steps, "50", 1, BIG,
          "steps between metrics.jsonl records and log lines"),
    F_BOOL("log.tensorboard", log.tensorboard, "true", "write TensorBoard event files"),
    F_ENUM("log.progress", log.progress, "auto", kpl_progress_mode_names,
           "progress bar: auto (on a terminal, or as kplrun asks), always, never"),

    F_INT2("profile.steps", profile.steps[0], profile.steps[1], 1, "[first, last]", "[]", 1, BIG,
           "trace steps first..last (1-based, as the logs count them) on every rank into "
           "RUN_DIR/profile/rank-NNNNN.trace.json, a Chrome trace for Perfetto ([]: off; "
           "docs/profiling.md)"),
    F_BOOL("profile.memory", profile.memory, "false",
           "with profile.steps: the memory profile of those steps (every block alive at their "
           "peak, what made it and why it is alive) into RUN_DIR/profile/memory-rank-NNNNN.json "
           "and a live-bytes track in the trace (docs/memory.md)"),
    F_ENUM("memory.recompute", memory.recompute, "none", kpl_recompute_mode_names,
           "none; blocks: the blocks the model marks (ResNet's stem and residual blocks, "
           "U-Net's levels, ASPP, the FPN, SN-GAN's blocks) keep only their inputs and outputs and "
           "run again in the backward: less memory for about one more forward, the same "
           "losses and gradients; auto: only as many of them as keep the allocator under "
           "memory.budget_mb (docs/memory.md)"),
    F_BOOL("memory.regenerate", memory.regenerate, "true",
           "the outputs of batch norm, group norm and a (leaky) ReLU after either are not kept for "
           "the "
           "backward but made again from the norm's input when it needs them: one activation "
           "fewer per layer for one more pass of the norm, the same bits; off under "
           "memory.recompute: auto (docs/memory.md)"),
    F_FLOAT("memory.budget_mb", memory.budget_mb, "0", 0, 1e9,
            "memory.recompute: auto: the bound on the training device's allocated MiB (0 with "
            "auto is an error; a step that cannot fit stops the run, naming the module)"),

    F_INT("eval.every_epochs", eval.every_epochs, "1", 0, BIG,
          "validate after every N epochs (0: only at the end)"),
    F_BOOL("eval.at_start", eval.at_start, "false",
           "also validate before the first step of a new run (the untrained model's figures)"),
    F_INT("eval.confusion_max_classes", eval.confusion_max_classes, "20", 0, 1000,
          "print the confusion matrix up to this many classes"),

    F_ENUM("dist.backend", dist.comm.backend, "auto", kpl_comm_backend_names,
           "collective backend: auto (mpi on CPU, nccl on GPU), mpi, ucx, nccl"),
    F_FLOAT("dist.bucket_mb", dist.buckets.bucket_mb, "25", 0, 1e5,
            "gradient bucket size, MB (0: one allreduce per gradient tensor)"),
    F_FLOAT("dist.first_bucket_mb", dist.buckets.first_bucket_mb, "1", 0, 1e5,
            "first gradient bucket size, MB"),
    F_ENUM("dist.hierarchical", dist.comm.hierarchy, "off", kpl_comm_hierarchy_names,
           "allreduce within nodes, then across them (mpi backend): off, auto (from 256 KB when "
           "the job spans >= 2 nodes of >= 2 ranks), on"),
    F_INT("dist.node_ranks", dist.comm.node_ranks, "0", 0, 1 << 20,
          "ranks per node for dist.hierarchical (0: the ranks that share memory)"),
    F_BOOL("dist.overlap", dist.overlap, "true",
           "start each bucket's allreduce during backward (false: all after backward)"),
    F_FLOAT("dist.timeout", dist.comm.timeout, "300", 1e-3, 1e7,
            "seconds a collective may take before the job fails"),
    F_FLOAT("dist.stall_warning", dist.comm.stall_warning, "60", 0, 1e7,
            "seconds before a waiting rank reports who has not joined (0: never)"),
    F_BOOL("dist.check_params", dist.buckets.check_params, "true",
           "check after the first step that all ranks hold the same parameters"),
    F_ENUM("dist.grad_dtype", dist.buckets.grad_dtype, "f32", float_dtype_names,
           "dtype gradients are summed over the ranks in: f32, or bf16 / fp16 (half the bytes; "
           "per element within ranks x 2^-8 / 2^-11 of the mean |gradient|, fp16 overflows "
           "past 65504)"),
};
const int kpl__rc_nfields = (int)(sizeof kpl__rc_fields / sizeof kpl__rc_fields[0]);

/* ---- writing ------------------------------------------------------------------------------ */

typedef struct {
    char *buf;
    size_t len, cap;
    bool oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->buf ? b->buf + b->len : NULL, b->buf ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) return;
        if (b->buf && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->len + (size_t)n + 1) cap *= 2;
        char *nb = realloc(b->buf, cap);
        if (!nb) {
            b->oom = true;
            return;
        }
        b->buf = nb;
        b->cap = cap;
    }
}

void kpl__rc_number_text(double v, bool single, char *s, size_t cap)
{
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(s, cap, "%.*g", prec, v);
        if (single ? strtof(s, NULL) == (float)v : strtod(s, NULL) == v) break;
    }
    /* "1" would read back as an integer, which a number key accepts too;
     * keep it a float in appearance for readers. */
    if (!strpbrk(s, ".eEn") && strlen(s) + 2 < cap) strcat(s, ".0");
}

static void put_number(sbuf *b, double v, bool single)
{
    char s[40];
    kpl__rc_number_text(v, single, s, sizeof s);
    sb_printf(b, "%s", s);
}

static void put_string(sbuf *b, const char *s)
{
    sb_printf(b, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') sb_printf(b, "\\%c", c);
        else if (c < 0x20) sb_printf(b, "\\x%02x", c);
        else sb_printf(b, "%c", c);
    }
    sb_printf(b, "\"");
}

static double load_real_or_int(const char *src, size_t size, bool integer)
{
    return integer ? (double)load_int(src, size) : load_real(src, size);
}

static void put_real(sbuf *b, const char *src, size_t size)
{
    put_number(b, load_real(src, size), size == sizeof(float));
}

static void put_value(sbuf *b, const field *f, const kpl_recipe *r)
{
    const char *src = (const char *)r + f->off;
    switch (f->type) {
    case T_BOOL: sb_printf(b, "%s", *(const bool *)src ? "true" : "false"); break;
    case T_INT: sb_printf(b, "%lld", (long long)load_int(src, f->size)); break;
    case T_FLOAT: put_real(b, src, f->size); break;
    case T_STR: put_string(b, src); break;
    case T_ENUM: sb_printf(b, "%s", kpl__name_at(f->choices, (int)load_int(src, f->size))); break;
    case T_INTS:
    case T_FLOATS:
    case T_INT2:
    case T_FLOAT2: {
        bool pair = f->type == T_INT2 || f->type == T_FLOAT2;
        bool integer = f->type == T_INTS || f->type == T_INT2;
        const char *at[2] = {src, (const char *)r + f->off2};
        int n = pair ? 2 : *(const int *)((const char *)r + f->count_off);
        if (pair && f->cap != 2 && load_real_or_int(at[0], f->size, integer) == 0 &&
            load_real_or_int(at[1], f->size, integer) == 0)
            n = 0; /* unset */
        sb_printf(b, "[");
        for (int i = 0; i < n; i++) {
            const char *e = pair ? at[i] : src + (size_t)i * f->size;
            if (i) sb_printf(b, ", ");
            if (integer) sb_printf(b, "%lld", (long long)load_int(e, f->size));
            else put_real(b, e, f->size);
        }
        sb_printf(b, "]");
        break;
    }
    case T_GROUPS: {
        int n = *(const int *)((const char *)r + f->count_off);
        sb_printf(b, "[");
        for (int i = 0; i < n; i++) {
            const kpl_param_group *g = &((const kpl_param_group *)src)[i];
            sb_printf(b, "%s{params: ", i ? ", " : "");
            put_string(b, g->params);
            sb_printf(b, ", lr_mult: ");
            put_number(b, g->lr_mult, false);
            sb_printf(b, ", weight_decay_mult: ");
            put_number(b, g->weight_decay_mult, false);
            sb_printf(b, "}");
        }
        sb_printf(b, "]");
        break;
    }
    }
}

/* One owner key's line (below `  NAME:`): its value (help: its default,
 * doc and choices). */
static void put_owner_key(sbuf *b, const kpl_key *k, const char *value, bool help)
{
    sb_printf(b, "    %s: ", k->name);
    bool text = k->type == KPL_KEY_STRING || k->type == KPL_KEY_CHOICE;
    if (help) {
        sb_printf(b, "%s  # %s", k->def ? k->def : "REQUIRED", k->doc);
        if (k->type == KPL_KEY_CHOICE) sb_printf(b, " [%s]", k->choices);
        else if (k->min != 0 || k->max != 0) sb_printf(b, " [%.15g, %.15g]", k->min, k->max);
    } else if (text) {
        put_string(b, value);
    } else {
        sb_printf(b, "%s", value);
    }
    sb_printf(b, "\n");
}

/* The owners' sections at the end of section `which`: help lists every
 * registered owner's keys, a recipe the values of the owner it names. */
static void write_owners(sbuf *b, int which, const kpl_recipe *r, bool help)
{
    const char *name;
    const kpl_key *keys;
    if (!help) {
        bool known;
        const kpl_keyvals *kv =
            kpl__rc_owner_selected(which, (kpl_recipe *)r, &name, &keys, &known);
        if (kv->n == 0) return;
        sb_printf(b, "  %s:\n", name);
        for (const kpl_key *k = keys; k && k->name; k++) { /* in the owner's order */
            const char *value = NULL;
            if (kpl_key_string(kv, k->name, &value) >= 0) put_owner_key(b, k, value, false);
        }
        return;
    }
    for (int i = 0; i < kpl__rc_owner_count(which); i++) {
        const char *doc;
        keys = kpl__rc_owner_at(which, i, &name, &doc);
        const kpl_task_kind *task =
            which == KPL__OWN_TASK ? kpl__registry_at(&kpl__owners[which], i) : NULL;
        if (!(keys && keys->name) && !(task && task->needs)) continue;
        sb_printf(b, "  %s:%s  # %s %s's own keys", name, keys && keys->name ? "" : " {}",
                  kpl__rc_owner_sections[which], name);
        if (doc) sb_printf(b, " (%s)", doc);
        for (const char *const *n = task ? task->needs : NULL; n && *n; n++)
            sb_printf(b, "%s%s", n == task->needs ? "; it needs " : ", ", *n);
        sb_printf(b, "\n");
        for (const kpl_key *k = keys; k && k->name; k++) put_owner_key(b, k, NULL, true);
    }
}

/* The top section of key (its first part), as a length. */
static size_t top_len(const char *key)
{
    const char *dot = strchr(key, '.');
    return dot ? (size_t)(dot - key) : strlen(key);
}

/* Nested YAML from the dotted keys, which the table lists section by
 * section: open the sections a key needs that the previous key had not. */
static void write_tree(sbuf *b, const kpl_recipe *r, bool help)
{
    const char *prev = "";
    if (help) {
        sb_printf(b, "plugins: []  # shared libraries to load first (tasks, models, optimizers "
                     "they register), relative to the recipe: loading one runs its code\n");
    } else {
        sb_printf(b, "plugins: [");
        for (int i = 0; i < r->nplugins; i++) {
            if (i) sb_printf(b, ", ");
            put_string(b, r->plugins[i]);
        }
        sb_printf(b, "]\n");
    }
    for (int i = 0; i < kpl__rc_nfields; i++) {
        const field *f = &kpl__rc_fields[i];
        /* the common dotted prefix with the previous key */
        size_t common = 0;
        for (size_t k = 0; f->key[k] && f->key[k] == prev[k]; k++)
            if (f->key[k] == '.') common = k + 1;
        int depth = 0;
        for (size_t k = 0; k < common; k++) depth += f->key[k] == '.';
        const char *seg = f->key + common;
        for (const char *dot; (dot = strchr(seg, '.')); seg = dot + 1, depth++)
            sb_printf(b, "%*s%.*s:\n", 2 * depth, "", (int)(dot - seg), seg);
        sb_printf(b, "%*s%s: ", 2 * depth, "", seg);
        if (help) {
            if (f->def) sb_printf(b, "%s", f->def);
            else sb_printf(b, "REQUIRED");
            sb_printf(b, "  # %s", f->help);
            if (f->type == T_ENUM) {
                sb_printf(b, " [");
                for (int c = 0; f->choices[c]; c++) sb_printf(b, "%s%s", c ? "|" : "", f->choices[c]);
                sb_printf(b, "]");
            } else if (f->known) {
                char names[1024];
                f->known(names, sizeof names);
                for (char *c = names; (c = strstr(c, ", ")); c++) c[0] = '|', memmove(c + 1, c + 2, strlen(c + 2) + 1);
                sb_printf(b, " [%s]", names);
            }
        } else {
            put_value(b, f, r);
        }
        sb_printf(b, "\n");
        prev = f->key;
        /* the section's last key: then its owners' sections */
        size_t l = top_len(f->key);
        if (i + 1 < kpl__rc_nfields && top_len(f[1].key) == l && !strncmp(f[1].key, f->key, l))
            continue;
        for (int w = 0; w < KPL__RC_OWNERS; w++)
            if (strlen(kpl__rc_owner_sections[w]) == l &&
                !strncmp(kpl__rc_owner_sections[w], f->key, l))
                write_owners(b, w, r, help);
    }
}

kpl_status kpl_recipe_to_yaml(const kpl_recipe *r, char **yaml)
{
    KPL_CHECK(r && yaml, KPL_EINVAL, "recipe_to_yaml: bad arguments");
    sbuf b = {NULL, 0, 0, false};
    write_tree(&b, r, false);
    if (b.oom || !b.buf) {
        free(b.buf);
        return KPL_ERROR(KPL_ENOMEM, "recipe_to_yaml: out of memory");
    }
    *yaml = b.buf;
    return KPL_OK;
}

void kpl_recipe_print_keys(FILE *f)
{
    sbuf b = {NULL, 0, 0, false};
    write_tree(&b, NULL, true);
    if (b.buf) fputs(b.buf, f);
    free(b.buf);
}
