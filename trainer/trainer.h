/*
 * trainer.h — where everything meets: the model zoo, optimizers and
 * learning-rate schedules, data parallelism (kpl_ddp), recipes,
 * checkpoints and TensorBoard event files.  `kpl train` (trainer/train.c)
 * puts them together; a C program can use the pieces directly:
 *
 *   kpl_model *m = NULL;
 *   kpl_model_create("resnet18_cifar", 10, kpl_device_cpu(), 42, &m);
 *   kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;   // sgd, lr 0.1
 *   oc.momentum = 0.9;
 *   kpl_optim *opt = NULL;
 *   kpl_optim_create(&oc, kpl_model_num_params(m), kpl_model_params(m), NULL, &opt);
 *   for (...) {
 *       kpl_pool *p = kpl_pool_push();
 *       kpl_tensor *loss = kpl_cross_entropy(kpl_model_forward(m, x, true), y,
 *                                            KPL_REDUCE_MEAN, 0, -100);
 *       kpl_backward(loss, NULL, false);
 *       kpl_optim_step(opt);          // also clears the gradients
 *       kpl_pool_pop(p);
 *   }
 *   kpl_optim_destroy(opt);
 *   kpl_model_destroy(m);
 *
 * Thread-safety: a model or an optimizer is used by one thread at a time.
 */
#ifndef KPL_TRAINER_H
#define KPL_TRAINER_H

#include "autograd.h"
#include "collective.h"
#include "module.h"
#include "dataio.h"

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- models ------------------------------------------------------------------- */

typedef struct kpl_model kpl_model;

/* Names: "mlp" (784-512-256-C), "lenet" (LeNet-5 on 1x28x28, padding 2 on
 * the first conv), "resnet18_cifar" (3x3 stem, no max-pool, 3x32x32),
 * "resnet18", "resnet34", "resnet50" (ImageNet stems, 3x224x224).
 * Parameters start as PyTorch's do (Kaiming-uniform linear layers;
 * Kaiming-normal fan-out convolutions in ResNets; BN scale 1, shift 0),
 * drawn from Philox with `seed`.  *out owned by the caller
 * (kpl_model_destroy).  KPL_EINVAL for an unknown name, listing the known. */
kpl_status kpl_model_create(const char *name, int64_t num_classes, kpl_device *dev,
                            uint64_t seed, kpl_model **out);
void kpl_model_destroy(kpl_model *m);
/* Logits (N, num_classes) of x (N, C, H, W) (pool-owned; NULL on error).
 * `training` selects batch statistics (and moves the running ones) or the
 * running statistics in batch norm. */
kpl_tensor *kpl_model_forward(kpl_model *m, kpl_tensor *x, bool training);
/* The trainable parameters, in creation order (borrowed). */
int kpl_model_num_params(const kpl_model *m);
kpl_tensor *const *kpl_model_params(const kpl_model *m);
/* State that is not trained but belongs to the model (batch norm's
 * running statistics), in creation order (borrowed). */
int kpl_model_num_buffers(const kpl_model *m);
kpl_tensor *const *kpl_model_buffers(const kpl_model *m);
/* Parameter element count. */
int64_t kpl_model_param_count(const kpl_model *m);
/* Multiply-adds x 2 of the convolutions and linear layers of one forward
 * pass of one sample; `train_flops` adds their two backward products
 * (input gradient skipped for the first layer, as autograd does). */
double kpl_model_flops(const kpl_model *m, bool train_flops);
const char *kpl_model_name(const kpl_model *m);

/* ---- optimizers ------------------------------------------------------------------ */
/*
 * One optimizer object for every update rule, PyTorch's formulations:
 *
 *   sgd    g' = g + wd p;  v = momentum v + g' (v = g' at the first step);
 *          p -= lr (nesterov ? g' + momentum v : v)          (torch.optim.SGD)
 *   adam   g' = g + wd p;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2;
 *          p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
 *                                                            (torch.optim.Adam)
 *   adamw  p *= 1 - lr wd, then adam without the wd term     (torch.optim.AdamW)
 *   lars   g' = g + wd p;  trust = eta ||p|| / (||g|| + wd ||p||) when both
 *          norms are > 0, else 1;  v = momentum v + lr trust g';  p -= v
 *          (You et al. 2017, as MLPerf's ResNet-50 reference)
 *
 * t counts the steps that updated the parameter (per parameter, as PyTorch).
 * Parameters flagged in `no_decay` (batch-norm scales and shifts, biases,
 * when the recipe asks) get no weight decay, and under lars no trust
 * ratio either (plain momentum SGD), as the LARS references exclude them.
 *
 *   kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
 *   oc.kind = KPL_OPTIM_ADAMW; oc.lr = 1e-3; oc.weight_decay = 0.05;
 *   kpl_optim *opt = NULL;
 *   kpl_optim_create(&oc, kpl_model_num_params(m), kpl_model_params(m), NULL, &opt);
 *   each step: backward; kpl_clip_grad_norm(...); kpl_optim_set_lr(opt, lr);
 *              kpl_optim_step(opt);     // reads, then clears, every .grad
 */
typedef enum { KPL_OPTIM_SGD, KPL_OPTIM_ADAM, KPL_OPTIM_ADAMW, KPL_OPTIM_LARS } kpl_optim_kind;

/* "sgd", "adam", "adamw", "lars" (the table, NULL-terminated); parse returns -1 for other
 * names. */
extern const char *const kpl_optim_kind_names[];
const char *kpl_optim_kind_name(kpl_optim_kind k);
int kpl_optim_kind_parse(const char *name);

typedef struct {
    kpl_optim_kind kind;
    double lr;                /* >= 0 */
    double momentum;          /* sgd, lars: [0, 1) */
    bool nesterov;            /* sgd: needs momentum > 0 */
    double weight_decay;      /* >= 0 */
    double beta1, beta2, eps; /* adam, adamw: betas in [0, 1), eps > 0 */
    double trust_coefficient; /* lars: eta > 0 */
    bool keep_grad;           /* step leaves .grad alone: whoever owns the gradient
                                 buffers zeroes them (kpl_ddp_zero_grad) */
} kpl_optim_config;
#define KPL_OPTIM_CONFIG_INIT {KPL_OPTIM_SGD, 0.1, 0.0, false, 0.0, 0.9, 0.999, 1e-8, 0.001, false}

typedef struct kpl_optim kpl_optim;

/* params: n float tensors (borrowed; they must outlive the optimizer).
 * no_decay: NULL, or n flags (copied).  KPL_EINVAL naming the field for a
 * value out of range (only the fields the kind uses are checked).  Besides
 * the state, the optimizer keeps scratch memory of one or two times the
 * largest parameter per device.  *out owned by the caller. */
kpl_status kpl_optim_create(const kpl_optim_config *cfg, int n, kpl_tensor *const *params,
                            const bool *no_decay, kpl_optim **out);
void kpl_optim_destroy(kpl_optim *o); /* NULL is a no-op */
void kpl_optim_set_lr(kpl_optim *o, double lr); /* lr >= 0 and finite (asserted) */
double kpl_optim_lr(const kpl_optim *o);
/* Parameter groups, as multipliers: parameter i steps with lr x lr_mult
 * and weight_decay x wd_mult (1 and 1 at create), so that a schedule's
 * kpl_optim_set_lr moves every group together (torch's param_groups with
 * lr = base x mult).  KPL_EINVAL for i out of range or a multiplier that
 * is negative or not finite. */
kpl_status kpl_optim_set_multipliers(kpl_optim *o, int i, double lr_mult, double wd_mult);

/* A parameter group: the parameters whose dotted names match `params`
 * (fnmatch(3) without flags, so * crosses dots: "backbone.*",
 * "*.bn*.weight") step with these multipliers. */
typedef struct {
    char params[128];
    double lr_mult, weight_decay_mult;
} kpl_param_group;

/* Sets every parameter's multipliers from the first group whose pattern
 * matches names[i] (the optimizer's parameters' dotted names; unmatched
 * ones keep 1 and 1).  A group that matches no parameter is KPL_EINVAL
 * naming it (a typo would otherwise change nothing).  counts (may be
 * NULL) receives the parameters each group took. */
kpl_status kpl_optim_set_groups(kpl_optim *o, const char *const *names, int ngroups,
                                const kpl_param_group *groups, int *counts);
const kpl_optim_config *kpl_optim_get_config(const kpl_optim *o);
/* Updates every parameter that has a .grad (a parameter without one is
 * left alone, its state too), then clears the gradients (kpl_zero_grad),
 * also when it fails, unless the config says keep_grad.  .grad is read, never written.  KPL_EDTYPE /
 * KPL_ESHAPE for a .grad whose dtype or shape is not its parameter's.
 * Unrecorded (grad mode off); runs on the parameters' device. */
kpl_status kpl_optim_step(kpl_optim *o);

/* The state, for checkpoints.  Slots per parameter: sgd with momentum and
 * lars "momentum_buffer"; adam and adamw "exp_avg", "exp_avg_sq" and
 * "step" (a one-element i64 tensor on the CPU); sgd without momentum none.
 * *names (borrowed, static; names may be NULL) receives the slot names;
 * returns their count. */
int kpl_optim_state_slots(const kpl_optim *o, const char *const **names);
/* Parameter i's state in slot s (borrowed), NULL until a step created it.
 * i and s must be in range (asserted). */
kpl_tensor *kpl_optim_state_get(const kpl_optim *o, int i, int s);
/* Installs a copy of t as parameter i's state in slot s (checkpoint load;
 * t may live on another device): KPL_ESHAPE / KPL_EDTYPE naming the slot
 * when t does not fit, KPL_ERANGE for a negative "step", KPL_EINVAL for i
 * or s out of range.  A slot left NULL starts as at the first step. */
kpl_status kpl_optim_state_set(kpl_optim *o, int i, int s, const kpl_tensor *t);

/* Gradient clipping by the global norm (torch.nn.utils.clip_grad_norm_):
 * total = the 2-norm of all the .grad of params taken together; when
 * max_norm > 0 and total > max_norm, every gradient is multiplied by
 * max_norm / (total + 1e-6).  *total_norm (may be NULL) receives total
 * (inf or nan when a gradient is: nothing is scaled then).  Parameters
 * without .grad are skipped.  Scales in place (a tensor that is the .grad
 * of several parameters once).  KPL_EINVAL for a negative max_norm.  Reads
 * the norm to the host (a GPU sync). */
kpl_status kpl_clip_grad_norm(int n, kpl_tensor *const *params, double max_norm,
                              double *total_norm);

/* ---- learning-rate schedules ------------------------------------------------------- */
/*
 * lr as a pure function of training progress t in epochs (fractional: the
 * trainer passes epoch + step / steps_per_epoch, or whole epochs when the
 * schedule moves per epoch).  A linear warmup from warmup_factor x base_lr
 * at t = 0 to base_lr at t = warmup_epochs comes first; then
 *   constant   base_lr
 *   step       base_lr gamma^floor(t / step_size)
 *   multistep  base_lr gamma^(number of milestones <= t)
 *   cosine     min_lr + (base_lr - min_lr) (1 + cos(pi u)) / 2
 *   poly       min_lr + (base_lr - min_lr) (1 - u)^power
 * with u = (t - warmup_epochs) / (epochs - warmup_epochs) clamped to [0, 1].
 * step and multistep count epochs from 0 (milestones are absolute epochs,
 * as in torchvision's reference recipes).
 */
typedef enum {
    KPL_SCHED_CONSTANT,
    KPL_SCHED_STEP,
    KPL_SCHED_MULTISTEP,
    KPL_SCHED_COSINE,
    KPL_SCHED_POLY
} kpl_sched_kind;

/* "constant", "step", "multistep", "cosine", "poly" (the table, NULL-terminated); parse: -1
 * otherwise. */
extern const char *const kpl_sched_kind_names[];
const char *kpl_sched_kind_name(kpl_sched_kind k);
int kpl_sched_kind_parse(const char *name);

#define KPL_SCHED_MAX_MILESTONES 16
typedef struct {
    kpl_sched_kind kind;
    double base_lr;
    double epochs;          /* the end of cosine and poly */
    double warmup_epochs;   /* 0: none */
    double warmup_factor;   /* lr at t = 0 as a fraction of base_lr */
    double step_size;       /* step: epochs between decays */
    double gamma;           /* step, multistep: decay factor */
    double milestones[KPL_SCHED_MAX_MILESTONES]; /* multistep, increasing */
    int num_milestones;
    double power;           /* poly */
    double min_lr;          /* cosine, poly: the floor */
} kpl_lr_schedule;
#define KPL_LR_SCHEDULE_INIT {KPL_SCHED_CONSTANT, 0.1, 1, 0, 0, 30, 0.1, {0}, 0, 2.0, 0}

/* KPL_EINVAL naming the field when the schedule cannot be used. */
kpl_status kpl_lr_schedule_check(const kpl_lr_schedule *s);
double kpl_lr_at(const kpl_lr_schedule *s, double t);

/* ---- TensorBoard event files --------------------------------------------------------- */
/*
 * Scalars and images in TensorBoard's event-file format (TFRecord framing with masked
 * CRC32C, tensorflow.Event protobuf messages), readable by TensorBoard and
 * tensorboard.backend.event_processing without TensorFlow here.
 *
 *   kpl_tb_writer *tb = NULL;
 *   kpl_tb_writer_create("runs/x/tb", &tb);
 *   kpl_tb_add_scalar(tb, "train/loss", step, 0.42);
 *   kpl_tb_writer_close(tb);
 */
typedef struct kpl_tb_writer kpl_tb_writer;

/* Creates dir (and parents) and in it a new
 * events.out.tfevents.<seconds>.<hostname>.<pid> file holding the
 * file_version event.  *out owned by the caller (kpl_tb_writer_close). */
kpl_status kpl_tb_writer_create(const char *dir, kpl_tb_writer **out);
/* Appends one scalar summary event (wall time now).  Buffered. */
kpl_status kpl_tb_add_scalar(kpl_tb_writer *w, const char *tag, int64_t step, double value);
/* Appends one image summary (TensorBoard's IMAGES tab): 8-bit pixels,
 * height x width x channels row-major (channels 1 gray, 3 RGB, 4 RGBA),
 * stored as PNG.  KPL_EINVAL for a side outside 1..16384 or another
 * channel count.  Buffered. */
kpl_status kpl_tb_add_image(kpl_tb_writer *w, const char *tag, int64_t step, int height,
                            int width, int channels, const uint8_t *pixels);
/* Writes the buffered events to the file (no fsync). */
kpl_status kpl_tb_flush(kpl_tb_writer *w);
/* Flushes, closes and frees; NULL is a no-op. */
void kpl_tb_writer_close(kpl_tb_writer *w);
/* The event file's path (borrowed). */
const char *kpl_tb_writer_path(const kpl_tb_writer *w);

/* ---- data parallelism (DDP) ---------------------------------------------------- */
/*
 * Joins autograd to the bucketed allreduce of collective.h: every
 * parameter's gradient is a buffer in a bucket (kpl_grad_set_buffer), its
 * ready hook starts the bucket's allreduce while backward goes on, and
 * after kpl_ddp_finish each .grad holds the average over the ranks.
 *
 *   kpl_ddp_create(comm, n, params, nbuf, buffers, NULL, &ddp);  // rank 0's values
 *   each step:
 *       kpl_ddp_begin(ddp, true);         // false on accumulation micro-steps
 *       loss = ...; kpl_backward(loss, NULL, false);
 *       kpl_ddp_finish(ddp);              // waits for the buckets
 *       kpl_optim_step(opt);              // keep_grad: reads .grad, leaves it
 *       kpl_ddp_zero_grad(ddp);           // whole buckets to zero
 *
 * Each rank's loss is the mean over its own samples; averaging the
 * gradients makes the step the one of the mean over all ranks' samples.
 * Buffers (batch norm statistics) are broadcast once at create, then each
 * rank keeps its own (no SyncBN).
 */
typedef struct kpl_ddp kpl_ddp;

/* params / buffers: borrowed, must outlive the kpl_ddp; cfg NULL for
 * KPL_BUCKETER_CONFIG_INIT.  Collective: broadcasts rank 0's parameters
 * and buffers.  Adds a ready hook to every parameter (removed by
 * destroy, with any other hooks of the parameters: kpl_clear_hooks). */
kpl_status kpl_ddp_create(kpl_comm *comm, int n, kpl_tensor *const *params, int nbuf,
                          kpl_tensor *const *buffers, const kpl_bucketer_config *cfg,
                          kpl_ddp **out);
void kpl_ddp_destroy(kpl_ddp *d);
/* Before the backward of a (micro-)step.  sync false: an accumulation
 * micro-step, no communication; true: the step's gradients are reduced at
 * finish.  The bucket views stay installed as the parameters' gradient
 * buffers across steps (backward accumulates into them); a parameter whose
 * .grad was replaced or cleared gets its view back, zeroed. */
kpl_status kpl_ddp_begin(kpl_ddp *d, bool sync);
/* After the optimizer step (created with keep_grad): every gradient back to
 * zero, a fill per bucket, the views staying where they are. */
kpl_status kpl_ddp_zero_grad(kpl_ddp *d);
/* After backward: waits for the allreduces (zeroing unused parameters'
 * gradients); with sync, every .grad is then the average over ranks.
 * Reports a failure of the ready hooks too.  Collective. */
kpl_status kpl_ddp_finish(kpl_ddp *d);
/* The bucketer underneath (statistics, parameter check). */
kpl_bucketer *kpl_ddp_bucketer(kpl_ddp *d);

/* ---- model zoo, configured (kpl_model_config: module.h) ------------------------------- */

/* Builds the model (parameters initialised as PyTorch's layers do, from
 * Philox with `seed`).  KPL_EINVAL naming the field when the input is too
 * small for the architecture or a value is out of range. */
kpl_status kpl_model_create_config(const kpl_model_config *cfg, kpl_device *dev, uint64_t seed,
                                   kpl_model **out);
/* torchvision-style names ("layer2.0.bn1.running_mean") of the parameters
 * and buffers, in the order of kpl_model_params / kpl_model_buffers. */
const char *kpl_model_param_name(const kpl_model *m, int i);
const char *kpl_model_buffer_name(const kpl_model *m, int i);
/* Whether parameter i is a bias or a normalisation scale/shift (the
 * parameters optimizer.no_decay_bn_bias exempts). */
bool kpl_model_param_is_bias_or_norm(const kpl_model *m, int i);
/* The generator of the model's dropout masks (borrowed; checkpoints save
 * its position). */
kpl_rng *kpl_model_rng(kpl_model *m);
/* The input the model expects: (C, H, W). */
void kpl_model_input_shape(const kpl_model *m, int64_t *chw);
/* The module tree underneath (borrowed): its state dict, its parts. */
kpl_module *kpl_model_module(kpl_model *m);

/* ---- recipes ------------------------------------------------------------------------ */
/*
 * A recipe is a YAML file whose keys are fixed by kpl (docs/recipes.md
 * lists them all with their defaults): unknown keys, values of the wrong
 * type or out of range, and missing required keys are errors naming the
 * file, the line and the dotted key.  `base: other.yaml` (relative to the
 * file) loads another recipe first and lays this one over it, map by map.
 * Overrides "a.b.c=VALUE" (VALUE in YAML flow syntax: 0.1, text, [1, 2])
 * are applied last.
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
    /* The loader's own settings: batch_size (per rank; val 0: train's),
     * shuffle, shuffle_window, initial_fill, drop_last, limit, interleave,
     * and the transform's (channels, crop, out_h/out_w, scale, ratio,
     * resize_shorter, flip_prob, brightness, contrast, saturation, mean,
     * std, skip_corrupt).  Its pointers (path, device, feature names) are
     * NULL here: the trainer points them at the split's fields. */
    kpl_loader_config loader;
    int nmean, nstd;            /* values given for mean and std: 1 (for every channel) or 3 */
} kpl_recipe_split;

/* What a step whose loss or gradients are NaN or inf does. */
typedef enum { KPL_NONFINITE_STOP, KPL_NONFINITE_SKIP } kpl_nonfinite_policy;
/* optimizer.lr_scaling: none, or linear in the global batch (Goyal et al.). */
typedef enum { KPL_LR_SCALING_NONE, KPL_LR_SCALING_LINEAR } kpl_lr_scaling;
/* schedule.per: the lr moves every step or once per epoch. */
typedef enum { KPL_LR_PER_STEP, KPL_LR_PER_EPOCH } kpl_lr_per;
/* log.progress: a progress bar on a terminal (or as kplrun asks), always, never. */
typedef enum { KPL_PROGRESS_AUTO, KPL_PROGRESS_ALWAYS, KPL_PROGRESS_NEVER } kpl_progress_mode;

/* The recipe binds into the owning modules' configuration structs
 * (kpl_model_config, kpl_loader_config, kpl_convert_options,
 * kpl_optim_config, kpl_lr_schedule, kpl_comm_config,
 * kpl_bucketer_config); the rest is the trainer's.  Their pointer members
 * stay NULL, and the fields the trainer computes (the schedule's base_lr
 * and epochs, the loaders' ranks and seed) are filled when it starts. */
typedef struct {
    char file[KPL_RECIPE_PATH]; /* the recipe file ("" when loaded from a string) */
    char name[KPL_RECIPE_NAME];
    char task[KPL_RECIPE_NAME]; /* kpl_task_find's name */
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
    } eval;
    struct {
        kpl_comm_config comm;       /* backend, timeout, stall_warning */
        kpl_bucketer_config buckets; /* bucket_mb, first_bucket_mb, check_params */
    } dist;
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

/* ---- checkpoints -------------------------------------------------------------------- */
/*
 * Named tensors and a JSON object (docs/checkpoint.md):
 *
 *   kpl_checkpoint *c = NULL;
 *   kpl_checkpoint_create(&c);
 *   kpl_checkpoint_add(c, "model.fc.weight", w);     // read at save time
 *   kpl_checkpoint_set_meta(c, "{\"step\": 100}");
 *   kpl_checkpoint_save(c, "run/checkpoints/ckpt-0000000100.kpl");
 *   kpl_checkpoint_destroy(c);
 *
 *   kpl_checkpoint_load(path, &c);                    // every byte checked
 *   kpl_checkpoint_restore(c, "model.fc.weight", w);  // shape and dtype checked
 *
 * save writes PATH.tmp (zstd, CRC32C), fsyncs it, renames it to PATH,
 * fsyncs the directory, and then writes the completion marker PATH.done the
 * same way: a crash at any point leaves either the previous state or a
 * complete checkpoint, and a checkpoint without its marker is never picked
 * up as the latest.  Blocking; one thread per checkpoint object.
 */
typedef struct kpl_checkpoint kpl_checkpoint;

kpl_status kpl_checkpoint_create(kpl_checkpoint **out);
void kpl_checkpoint_destroy(kpl_checkpoint *c); /* NULL is a no-op */
/* Adds t (retained until destroy; its contents are read by save).  Names
 * are unique, 1 to 255 bytes. */
kpl_status kpl_checkpoint_add(kpl_checkpoint *c, const char *name, kpl_tensor *t);
/* The metadata: the text of a JSON object (copied). */
kpl_status kpl_checkpoint_set_meta(kpl_checkpoint *c, const char *json);
const char *kpl_checkpoint_meta(const kpl_checkpoint *c);
kpl_status kpl_checkpoint_save(kpl_checkpoint *c, const char *path);
/* Reads and checks a checkpoint (header and payload CRC32C, sizes, the
 * tensor table): KPL_EFORMAT naming the file and what is wrong,
 * KPL_ENOTFOUND for a missing file.  *out owned by the caller. */
kpl_status kpl_checkpoint_load(const char *path, kpl_checkpoint **out);
int kpl_checkpoint_num_tensors(const kpl_checkpoint *c);
const char *kpl_checkpoint_name(const kpl_checkpoint *c, int i);
/* The tensor called name (a CPU tensor over the loaded bytes, borrowed),
 * or NULL. */
kpl_tensor *kpl_checkpoint_find(const kpl_checkpoint *c, const char *name);
/* Copies the tensor called name into dst (any device): KPL_ENOTFOUND,
 * KPL_EDTYPE or KPL_ESHAPE naming the file, the tensor and both shapes. */
kpl_status kpl_checkpoint_restore(const kpl_checkpoint *c, const char *name, kpl_tensor *dst);

/* ---- tasks and the trainer ------------------------------------------------------------------ */
/*
 * kpl_trainer runs a recipe: data loaders, the communicator and DDP, one
 * optimizer per model, the schedule, checkpoints, metrics.jsonl and
 * TensorBoard.  What is particular to a kind of training lives in a task
 * (a vtable): it builds its models from the recipe, takes one training
 * micro-batch (forward, losses, kpl_trainer_backward), and evaluates.
 * `kpl train` is kpl_trainer_fit over the recipe's task; a program brings
 * its own task and modules (examples/autoencoder.c):
 *
 *   kpl_trainer *t = NULL;
 *   kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
 *   if (kpl_trainer_create(&recipe, &my_task, &o, &t) < 0) ...
 *   int rc = kpl_trainer_fit(t);            // epochs, evaluation, checkpoints
 *   kpl_trainer_destroy(t);
 *
 * or step by step: kpl_trainer_step, kpl_trainer_evaluate, kpl_trainer_save.
 * One thread per trainer; every call that communicates is collective.
 */
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

/* A kind of training.  `state` is the task's own (create makes it).
 * Every member but eval_report and data is required. */
typedef struct {
    const char *name;
    /* The metric that selects best.kpl, and whether higher is better. */
    const char *best_metric;
    bool best_higher;
    /* Builds the models (kpl_trainer_add_model) from kpl_trainer_recipe
     * and kpl_trainer_input_shape. */
    kpl_status (*create)(kpl_trainer *t, void **state);
    void (*destroy)(void *state);
    /* One training micro-batch: forward, the losses, kpl_trainer_backward
     * for each model to train (kpl_trainer_update between them when the
     * models step in turn, as a GAN's), kpl_trainer_record for the figures
     * to report. */
    kpl_status (*train_batch)(kpl_trainer *t, void *state, const kpl_batch *b);
    /* Evaluation: begin, each batch (grad mode off, models in eval mode),
     * then end, which combines the ranks' sums (kpl_trainer_sum) into res. */
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
} kpl_task_kind;

/* The tasks kpl knows by name ("classification"); NULL for others. */
const kpl_task_kind *kpl_task_find(const char *name);
extern const kpl_task_kind kpl_task_classification;

/* For tasks: the run's recipe, device, ranks, and the input (C, H, W) the
 * data gives (model.input_size and in_channels override it). */
const kpl_recipe *kpl_trainer_recipe(const kpl_trainer *t);
kpl_device *kpl_trainer_device(const kpl_trainer *t);
int32_t kpl_trainer_rank(const kpl_trainer *t);
int32_t kpl_trainer_world(const kpl_trainer *t);
const int64_t *kpl_trainer_input_shape(const kpl_trainer *t);
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
/* Element-wise sum of v over the ranks (collective; nothing on one rank). */
kpl_status kpl_trainer_sum(kpl_trainer *t, double *v, int n);
/* Whether sample i of an evaluation batch is an example of its own: the
 * repeats that even out the ranks' shares of the split are not. */
bool kpl_trainer_eval_counts(const kpl_trainer *t, const kpl_batch *b, int64_t i);
/* Rank 0's console and every rank's log file; warnings go to stderr. */
void kpl_trainer_info(kpl_trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kpl_trainer_warn(kpl_trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

typedef struct {
    const char *resume;     /* NULL: a new run; "": the newest checkpoint; else a file */
    const char *checkpoint; /* evaluation only: the models' weights; no training data,
                               optimizer or run directory */
    bool reset_optimizer;   /* with resume: every optimizer's state starts fresh (the
                               weights, data position and generators still resume).
                               Without it, a checkpoint whose optimizer differs from
                               the run's (another rule, momentum on or off) is
                               refused, naming both */
} kpl_trainer_options;
#define KPL_TRAINER_OPTIONS_INIT {NULL, NULL, false}

/* Everything up to the first step, in the order the data needs: ranks,
 * threads, device; data (converted when missing) and the checkpoint to
 * resume; loaders (they fork before any thread exists); communicator and
 * run directory; the task's models, optimizers, restored state, DDP.
 * *out owned by the caller.  Collective.  A failure is also reported as a
 * run reports it (stderr and this rank's log) and ends the job on every
 * rank; *out is then NULL.  KPL_EINVAL when the recipe's `task` is not
 * the task's name.  The trainer keeps its own copy of *r. */
kpl_status kpl_trainer_create(const kpl_recipe *r, const kpl_task_kind *task,
                              const kpl_trainer_options *o, kpl_trainer **out);
/* Ends the job on every rank when one fails (the others wait in a
 * collective for it), then frees; NULL is a no-op. */
void kpl_trainer_destroy(kpl_trainer *t);
/* One optimizer step of `accumulate` micro-batches; *epoch_done when it
 * took the epoch's last batch.  Collective. */
kpl_status kpl_trainer_step(kpl_trainer *t, bool *epoch_done);
/* The task's evaluation on the validation split.  Collective. */
kpl_status kpl_trainer_evaluate(kpl_trainer *t, kpl_eval_result *res);
/* A checkpoint of everything a resume needs; path (len bytes; may be
 * NULL) receives the file on rank 0, "" on the others.  A buffer too
 * small for the name is an error before anything is written.
 * Collective; rank 0 writes. */
kpl_status kpl_trainer_save(kpl_trainer *t, const char *why, char *path, size_t len);
/* The models' weights from a checkpoint (every tensor must match). */
kpl_status kpl_trainer_restore(kpl_trainer *t, const char *path);
/* The whole run: epochs of steps, reports, evaluation, checkpoints, best,
 * the final report.  It installs SIGINT / SIGTERM handlers for its
 * duration (restoring the defaults after): a signal to any rank stops
 * every rank after the same step (they agree after each step, and before
 * each evaluation batch), with a checkpoint; a stop starts no evaluation
 * and ends one under way, leaving it to --resume.  Returns the exit
 * status: 0, 1 after an error (printed), 130 / 143 after SIGINT /
 * SIGTERM.  Collective. */
int kpl_trainer_fit(kpl_trainer *t);
/* Steps done, and the epoch of the last step (from 0; the step after the
 * one that reported *epoch_done starts the next). */
int64_t kpl_trainer_steps(const kpl_trainer *t);
int64_t kpl_trainer_epoch(const kpl_trainer *t);

/* ---- state dicts: module trees in checkpoints --------------------------------------------- */
/*
 * A model's tensors travel by dotted name: `prefix` + "layer1.0.conv1.weight".
 *
 *   kpl_module_state_save(model, c, "model.");            // a resume's model
 *   // a classifier's backbone into a detector's "backbone" child:
 *   kpl_state_report rep;
 *   kpl_module_state_load(kpl_module_find(det, "backbone"), ckpt, "model.", false, &rep);
 *   printf("%d loaded, missing: %s, unexpected: %s\n", rep.nloaded, rep.missing, rep.unexpected);
 *   kpl_state_report_clear(&rep);
 */
typedef struct {
    int nloaded, nmissing, nunexpected, nmismatched;
    char *missing;    /* the first 20 model names the checkpoint lacks, ", "-joined (malloc'd) */
    char *unexpected; /* the first 20 checkpoint names under prefix the model lacks */
    char *mismatched; /* the first 20 model names whose shape or dtype differs in c */
} kpl_state_report;

/* Adds every parameter and buffer under m as prefix + dotted name (read
 * at save time). */
kpl_status kpl_module_state_save(kpl_module *m, kpl_checkpoint *c, const char *prefix);
/* Copies every tensor of m that c has (prefix + dotted name); a dtype or
 * shape that differs is an error naming both (and listing every tensor
 * that differs), and any error leaves m as it was (everything is checked
 * before anything is copied).  strict: a tensor of m missing from c, or a
 * tensor of c under prefix that m lacks, is KPL_ENOTFOUND listing them.
 * report (may be NULL) receives the counts and names, on success and on
 * failure alike (nloaded 0 then); free it with kpl_state_report_clear. */
kpl_status kpl_module_state_load(kpl_module *m, const kpl_checkpoint *c, const char *prefix,
                                 bool strict, kpl_state_report *report);
void kpl_state_report_clear(kpl_state_report *r);

#ifdef __cplusplus
}
#endif
#endif /* KPL_TRAINER_H */
