/*
 * recipe.c — YAML recipes: libyaml's events become a small tree that
 * remembers where every value came from (file, line, column, or the
 * command line), bases and overrides are laid over it, and one table of
 * keys binds it into kpl_recipe.  The same table gives the defaults, the
 * checks, the resolved YAML written into every run directory, and the key
 * reference of `kpl train --keys`, so the four never disagree.
 */
#include "trainer_impl.h"

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

/* T_INT2 / T_FLOAT2: a pair of members ([h, w], [min, max], betas). */
typedef enum { T_BOOL, T_INT, T_FLOAT, T_STR, T_ENUM, T_INTS, T_FLOATS, T_INT2, T_FLOAT2,
               T_GROUPS } vtype;

typedef struct {
    const char *key;
    vtype type;
    size_t off, size; /* the member in kpl_recipe and its bytes (lists: an element's) */
    size_t off2;      /* pairs: the second member */
    size_t cap;       /* T_STR: buffer bytes; lists: element capacity; pairs: 2 when both
                         values are required, 0 when [] (both 0) or one value (both) will do */
    size_t count_off; /* lists: the int holding the count */
    const char *def;  /* the default as YAML text; NULL: required */
    double lo, hi;    /* numbers and list elements */
    const char *const *choices; /* T_ENUM: the owning module's table, NULL-terminated; the
                                   value is the index */
    const char *help;
    const char *form; /* pairs: what the two values are, "[h, w]" */
    void (*known)(char *buf, size_t len); /* T_STR naming a registered thing: the names
                                             known now (built-ins and plugins') */
} field;

/* The models model.name may name: the zoo's (plugins' too), or none. */
static void model_names(char *buf, size_t len)
{
    kpl__zoo_names(buf, len);
    size_t at = strlen(buf);
    snprintf(buf + at, len - at, "%snone", at ? ", " : "");
}

/* Whether name is one of list's ", "-separated names. */
static bool name_listed(const char *name, const char *list)
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
static const char *const scaling_names[] = {"none", "linear", NULL};
static const char *const per_names[] = {"step", "epoch", NULL};
static const char *const progress_names[] = {"auto", "always", "never", NULL};
static const char *const nonfinite_names[] = {"stop", "skip", NULL};

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
    F_STR("data." #sp ".label_feature", data.sp.label_feature, "label", "label feature"),    \
    F_INT("data." #sp ".transform.channels", data.sp.loader.transform.channels, "3", 1, 3,   \
          "image channels after decoding: 1 or 3"),                                          \
    F_ENUM("data." #sp ".transform.crop", data.sp.loader.transform.crop, "none",             \
           kpl_crop_mode_names, "none (whole image), random_resized, center"),               \
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
          "0", 0, 1 << 16, "center: shorter side before the crop (0: the crop size)"),       \
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

static const field fields[] = {
    F_STR("name", name, "\"\"", "run name (default: the recipe file's name)"),
    F_STR("task", task, "classification", "what the run trains: classification"),
    F_INT("seed", seed, "0", 0, BIG, "seed of initialisation, data order and augmentation"),
    F_INT("epochs", epochs, NULL, 1, 1e6, "epochs to train"),
    F_STR("device", device, "auto",
          "auto (a GPU per rank when there are GPUs, else cpu), cpu, cuda, cuda:N"),
    F_INT("threads", threads, "0", 0, 1024,
          "CPU threads per rank (0: OMP_NUM_THREADS, else cores / ranks on the node)"),
    F_BOOL("deterministic", deterministic, "false",
           "pick algorithms without timing them: bit-identical reruns and resumes"),
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
          "base width (0: lenet 6, cnn 32, resnet 64)"),
    F_INT("model.depth", model.depth, "0", 0, 1000,
          "resnet: 18, 34, 50, 101 or 152; cnn: conv stages (0: 2)"),
    F_ENUM("model.stem", model.stem, "imagenet", kpl_resnet_stem_names,
           "resnet stem: imagenet (7x7/2 + max-pool) or cifar (3x3/1)"),
    F_INTS("model.hidden", model.hidden, model.nhidden, "[]", 1, 1 << 20,
           "hidden layer widths (mlp default [512, 256]; cnn default [128])"),
    F_FLOAT("model.dropout", model.dropout, "0", 0, 0.99,
            "dropout before the last linear layer (mlp, cnn)"),
    F_BOOL("model.zero_init_residual", model.zero_init_residual, "false",
           "resnet: last batch norm of each block starts at scale 0"),

    F_STR("data.root", data.root, "\"\"", "directory the split paths are relative to"),
    F_ENUM("data.convert.from", data.convert.from, "none", kpl_convert_source_names,
           "build missing splits from a source first: none, idx, imagefolder, lmdb"),
    F_STR("data.convert.source", data.convert.source, "\"\"",
          "idx: a directory of IDX files; imagefolder/lmdb: root with one folder per split"),
    F_INT("data.convert.shards", data.convert.options.writer.shards, "1", 1, 1 << 16, "shards per split"),
    F_INT("data.convert.max_side", data.convert.options.max_side, "0", 0, 1 << 16,
          "imagefolder: re-encode JPEGs whose longer side exceeds this (0: keep)"),
    F_INT("data.convert.quality", data.convert.options.quality, "90", 1, 100,
          "imagefolder: JPEG quality of re-encoded images"),
    F_INT("data.workers", data.workers, "1", 1, 256, "transformer processes per rank and split"),
    F_INT("data.prefetch", data.prefetch, "2", 1, 64, "batches prepared ahead"),
    SPLIT(train, NULL, NULL, "chunk"),
    SPLIT(val, "\"\"", "0", "none"),

    F_FLOAT("loss.label_smoothing", loss.label_smoothing, "0", 0, 0.999,
            "cross-entropy label smoothing"),
    F_ENUM("loss.nonfinite", loss.nonfinite, "stop", nonfinite_names,
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
    F_FLOAT2("optimizer.betas", optimizer.config.beta1, optimizer.config.beta2, 2,
             "[beta1, beta2]", "[0.9, 0.999]", 0, 0.999999, "adam, adamw: [beta1, beta2]"),
    F_FLOAT("optimizer.eps", optimizer.config.eps, "1e-8", 1e-30, 1, "adam, adamw: epsilon"),
    F_FLOAT("optimizer.trust_coefficient", optimizer.config.trust_coefficient, "0.001", 1e-9, 10,
            "lars: eta"),
    F_BOOL("optimizer.no_decay_bn_bias", optimizer.no_decay_bn_bias, "false",
           "no weight decay (lars: no trust ratio) for batch-norm parameters and biases"),
    F_FLOAT("optimizer.clip_grad_norm", optimizer.clip_grad_norm, "0", 0, 1e9,
            "clip the global gradient norm to this (0: off)"),
    F_INT("optimizer.accumulate", optimizer.accumulate, "1", 1, 4096,
          "micro-batches per step (gradient accumulation)"),
    F_ENUM("optimizer.lr_scaling", optimizer.lr_scaling, "none", scaling_names,
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
    F_FLOAT("schedule.step_size", schedule.config.step_size, "30", 1e-9, 1e6, "step: epochs per decay"),
    F_FLOAT("schedule.gamma", schedule.config.gamma, "0.1", 1e-9, 1, "step, multistep: decay factor"),
    F_FLOATS("schedule.milestones", schedule.config.milestones, schedule.config.num_milestones, "[]", 1e-9, 1e6,
             "multistep: epochs at which lr is multiplied by gamma"),
    F_FLOAT("schedule.power", schedule.config.power, "2", 1e-9, 100, "poly: exponent"),
    F_FLOAT("schedule.min_lr", schedule.config.min_lr, "0", 0, 1e6, "cosine, poly: final lr"),
    F_ENUM("schedule.per", schedule.per, "step", per_names,
           "move the lr every step, or once per epoch"),

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
    F_ENUM("log.progress", log.progress, "auto", progress_names,
           "progress bar: auto (on a terminal, or as kplrun asks), always, never"),

    F_INT("eval.every_epochs", eval.every_epochs, "1", 0, BIG,
          "validate after every N epochs (0: only at the end)"),
    F_INT("eval.confusion_max_classes", eval.confusion_max_classes, "20", 0, 1000,
          "print the confusion matrix up to this many classes"),

    F_ENUM("dist.backend", dist.comm.backend, "auto", kpl_comm_backend_names,
           "collective backend: auto (mpi on CPU, nccl on GPU), mpi, ucx, nccl"),
    F_FLOAT("dist.bucket_mb", dist.buckets.bucket_mb, "25", 1e-3, 1e5, "gradient bucket size, MB"),
    F_FLOAT("dist.first_bucket_mb", dist.buckets.first_bucket_mb, "1", 1e-3, 1e5,
            "first gradient bucket size, MB"),
    F_FLOAT("dist.timeout", dist.comm.timeout, "300", 1e-3, 1e7,
            "seconds a collective may take before the job fails"),
    F_FLOAT("dist.stall_warning", dist.comm.stall_warning, "60", 0, 1e7,
            "seconds before a waiting rank reports who has not joined (0: never)"),
    F_BOOL("dist.check_params", dist.buckets.check_params, "true",
           "check after the first step that all ranks hold the same parameters"),
};
#define NFIELDS (int)(sizeof fields / sizeof fields[0])

/* ---- the tree ------------------------------------------------------------------------- */

typedef enum { N_SCALAR, N_SEQ, N_MAP } nkind;

typedef struct node {
    nkind kind;
    char *key;          /* this entry's key in its map */
    char *text;         /* scalars */
    bool null;          /* an empty plain scalar, ~ or null */
    const char *origin; /* file name, or the override text */
    int line, col;      /* the value's place: 1-based; line 0 for overrides */
    int kline, kcol;    /* its key's place in a map */
    struct node *first, *last, *next;
} node;

/* One load: the origins (file names, override texts) outlive the nodes
 * that point at them. */
typedef struct {
    char *origins[64];
    int norigins;
} ctx;

static const char *keep_origin(ctx *c, const char *s)
{
    if (c->norigins == (int)(sizeof c->origins / sizeof c->origins[0])) return "?";
    char *d = strdup(s);
    if (!d) return "?";
    c->origins[c->norigins++] = d;
    return d;
}

static void node_free(node *n)
{
    while (n) {
        node *next = n->next;
        node_free(n->first);
        free(n->key);
        free(n->text);
        free(n);
        n = next;
    }
}

static void append(node *parent, node *child)
{
    child->next = NULL;
    if (parent->last) parent->last->next = child;
    else parent->first = child;
    parent->last = child;
}

static node *child_named(const node *map, const char *key)
{
    for (node *c = map->first; c; c = c->next)
        if (!strcmp(c->key, key)) return c;
    return NULL;
}

/* What a message echoes of its input is cut short: the thread's message
 * holds under 1 KiB, and what is wrong comes after the value, so a long
 * override or YAML scalar would push it out.  A value keeps its first
 * ECHO_MAX bytes and "..."; a path its last PATH_ECHO_MAX, with its file
 * name.  Cuts fall between UTF-8 characters. */
#define ECHO_MAX 60
#define PATH_ECHO_MAX 200
#define CLIP(s) clip((s), false, (char[PATH_ECHO_MAX + 4]){0})
#define CLIP_PATH(s) clip((s), true, (char[PATH_ECHO_MAX + 4]){0})

static const char *clip(const char *s, bool path, char *buf)
{
    size_t n = strlen(s), max = path ? PATH_ECHO_MAX : ECHO_MAX;
    if (n <= max) return s;
    if (path) {
        const char *t = s + n - max;
        while ((*t & 0xC0) == 0x80) t++;
        snprintf(buf, PATH_ECHO_MAX + 4, "...%s", t);
    } else {
        while (max > 0 && (s[max] & 0xC0) == 0x80) max--;
        snprintf(buf, PATH_ECHO_MAX + 4, "%.*s...", (int)max, s);
    }
    return buf;
}

/* "file:12:3" or "override 'a.b=c'" */
static const char *where(const node *n, char *buf, size_t len)
{
    if (!n) snprintf(buf, len, "(default)");
    else if (n->line > 0) snprintf(buf, len, "%s:%d:%d", CLIP_PATH(n->origin), n->line, n->col);
    else snprintf(buf, len, "override '%s'", CLIP(n->origin));
    return buf;
}

/* The place of a map entry's key (the value's for overrides). */
static const char *where_key(const node *n, char *buf, size_t len)
{
    if (n && n->line > 0 && n->kline > 0) {
        snprintf(buf, len, "%s:%d:%d", CLIP_PATH(n->origin), n->kline, n->kcol);
        return buf;
    }
    return where(n, buf, len);
}

/* The dotted key of the node being parsed, for messages: `prefix` (an
 * override's key), the keys of the open maps ("[]" for a list's
 * elements), then `last` (the key the node is the value of, or is). */
static void key_path(const char *prefix, node *const *stack, int depth, const char *last,
                     char *buf, size_t len)
{
    size_t at = (size_t)snprintf(buf, len, "%s", prefix);
    for (int i = 1; i <= depth && at < len; i++) {
        const char *k = i < depth ? stack[i]->key : last;
        if (i < depth && !k) at += (size_t)snprintf(buf + at, len - at, "[]");
        else if (k) at += (size_t)snprintf(buf + at, len - at, "%s%s", at ? "." : "", k);
    }
}

/* libyaml's events into a tree.  Aliases are refused: recipes are read
 * by people, and a key whose value lives elsewhere helps nobody.  So are
 * tags (!!str 5): a recipe's key fixes the type of its value, and a tag
 * that kpl ignored would say one thing and do another.  `at_key` is the
 * key the text is the value of ("" for a file). */
static kpl_status parse_yaml(const char *text, size_t len, const char *origin, bool is_file,
                             const char *at_key, node **out)
{
    *out = NULL;
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p)) return KPL_ERROR(KPL_ENOMEM, "%s: out of memory", origin);
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    kpl_status st = KPL_OK;
    enum { DEPTH = 64 };
    node *stack[DEPTH];
    char *pending[DEPTH]; /* a map's key waiting for its value */
    int pline[DEPTH], pcol[DEPTH];
    int depth = 0, docs = 0;
    node *root = NULL;
    memset(pending, 0, sizeof pending);
    for (bool done = false; !done;) {
        yaml_event_t ev;
        char at[400]; /* the place of the event, or of the error */
        if (!yaml_parser_parse(&p, &ev)) {
            node mark = {.origin = origin, .line = is_file ? (int)p.problem_mark.line + 1 : 0,
                         .col = (int)p.problem_mark.column + 1};
            st = KPL_ERROR(KPL_EFORMAT, "%s: YAML syntax error: %s%s%s",
                           where(&mark, at, sizeof at), p.problem ? p.problem : "unknown",
                           p.context ? " " : "", p.context ? p.context : "");
            goto fail;
        }
        int line = is_file ? (int)ev.start_mark.line + 1 : 0;
        int col = (int)ev.start_mark.column + 1;
        node here = {.origin = origin, .line = line, .col = col};
        node *n = NULL;
        switch (ev.type) {
        case YAML_STREAM_END_EVENT: done = true; break;
        case YAML_DOCUMENT_START_EVENT:
            if (++docs > 1)
                st = KPL_ERROR(KPL_EFORMAT, "%s: a recipe is one YAML document, found a second "
                               "one", where(&here, at, sizeof at));
            break;
        case YAML_ALIAS_EVENT:
            st = KPL_ERROR(KPL_EFORMAT, "%s: YAML aliases (*%s) are not supported in recipes; "
                           "use 'base:' to share settings", where(&here, at, sizeof at),
                           CLIP((const char *)ev.data.alias.anchor));
            break;
        case YAML_SCALAR_EVENT:
        case YAML_SEQUENCE_START_EVENT:
        case YAML_MAPPING_START_EVENT: {
            node *parent = depth ? stack[depth - 1] : NULL;
            const char *tag = (const char *)(ev.type == YAML_SCALAR_EVENT ? ev.data.scalar.tag
                                             : ev.type == YAML_SEQUENCE_START_EVENT
                                                 ? ev.data.sequence_start.tag
                                                 : ev.data.mapping_start.tag);
            if (tag) {
                /* the key this is the value of, or the key it is */
                const char *last = NULL;
                if (parent && parent->kind == N_MAP)
                    last = pending[depth - 1] ? pending[depth - 1]
                           : ev.type == YAML_SCALAR_EVENT ? (const char *)ev.data.scalar.value
                                                           : NULL;
                char key[300], shown[80];
                key_path(at_key, stack, depth, last, key, sizeof key);
                const char *std = "tag:yaml.org,2002:"; /* !!str is short for it */
                if (!strncmp(tag, std, strlen(std)))
                    snprintf(shown, sizeof shown, "!!%s", CLIP(tag + strlen(std)));
                else snprintf(shown, sizeof shown, "%s", CLIP(tag));
                st = KPL_ERROR(KPL_EFORMAT, "%s: %s%sYAML tags (%s) are not supported in "
                               "recipes; write the value without one", where(&here, at, sizeof at),
                               CLIP(key), key[0] ? ": " : "", shown);
                break;
            }
            if (ev.type == YAML_SCALAR_EVENT &&
                strlen((const char *)ev.data.scalar.value) != ev.data.scalar.length) {
                /* "\0" in a quoted scalar: C strings would cut it short */
                st = KPL_ERROR(KPL_EFORMAT, "%s: a NUL character in a value or key",
                               where(&here, at, sizeof at));
                break;
            }
            if (parent && parent->kind == N_MAP && !pending[depth - 1]) {
                /* a key */
                if (ev.type != YAML_SCALAR_EVENT) {
                    st = KPL_ERROR(KPL_EFORMAT, "%s: keys must be plain names",
                                   where(&here, at, sizeof at));
                    break;
                }
                const char *k = (const char *)ev.data.scalar.value;
                if (child_named(parent, k)) {
                    node *prev = child_named(parent, k);
                    char w[1200];
                    st = KPL_ERROR(KPL_EFORMAT, "%s: key '%s' appears twice (first at %s)",
                                   where(&here, at, sizeof at), CLIP(k),
                                   where_key(prev, w, sizeof w));
                    break;
                }
                if (!(pending[depth - 1] = strdup(k))) st = KPL_ERROR(KPL_ENOMEM, "out of memory");
                pline[depth - 1] = line, pcol[depth - 1] = col;
                break;
            }
            n = calloc(1, sizeof *n);
            if (!n) {
                st = KPL_ERROR(KPL_ENOMEM, "out of memory");
                break;
            }
            n->origin = origin;
            n->line = line;
            n->col = col;
            if (ev.type == YAML_SCALAR_EVENT) {
                n->kind = N_SCALAR;
                n->text = strndup((const char *)ev.data.scalar.value, ev.data.scalar.length);
                const char *v = n->text ? n->text : "";
                n->null = ev.data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
                          (!*v || !strcmp(v, "~") || !strcmp(v, "null") || !strcmp(v, "Null") ||
                           !strcmp(v, "NULL"));
                if (!n->text) st = KPL_ERROR(KPL_ENOMEM, "out of memory");
            } else {
                n->kind = ev.type == YAML_MAPPING_START_EVENT ? N_MAP : N_SEQ;
            }
            if (parent) {
                if (parent->kind == N_MAP) {
                    n->key = pending[depth - 1];
                    n->kline = pline[depth - 1], n->kcol = pcol[depth - 1];
                    pending[depth - 1] = NULL;
                }
                append(parent, n);
            } else {
                root = n;
            }
            if (n->kind != N_SCALAR) {
                if (depth == DEPTH) {
                    st = KPL_ERROR(KPL_EFORMAT, "%s: nested too deeply",
                                   where(&here, at, sizeof at));
                    break;
                }
                pending[depth] = NULL;
                stack[depth++] = n;
            }
            break;
        }
        case YAML_SEQUENCE_END_EVENT:
        case YAML_MAPPING_END_EVENT: depth--; break;
        default: break;
        }
        yaml_event_delete(&ev);
        if (st < 0) goto fail;
    }
    *out = root;
    yaml_parser_delete(&p);
    return KPL_OK;
fail:
    for (int i = 0; i < DEPTH; i++) free(pending[i]);
    node_free(root);
    yaml_parser_delete(&p);
    return st;
}

/* Recipes are small text files; anything else (a FIFO, a device, a
 * directory, a huge file) is refused. */
#define RECIPE_MAX_BYTES (1 << 20)

/* What a path that is not a regular file is, for the message. */
static const char *file_kind(mode_t m)
{
    if (S_ISDIR(m)) return "a directory";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISSOCK(m)) return "a socket";
    return "of an unknown kind";
}

static kpl_status read_file(const char *path, char **text, size_t *len)
{
    /* Judged by stat before any open: opening a FIFO waits for a writer
     * that may never come, and opening a device can act on it. */
    struct stat sb;
    KPL_CHECK(stat(path, &sb) == 0, KPL_EIO, "recipe %s: %s", CLIP_PATH(path), strerror(errno));
    KPL_CHECK(S_ISREG(sb.st_mode), KPL_EINVAL, "recipe %s: not a regular file (%s)",
              CLIP_PATH(path), file_kind(sb.st_mode));
    KPL_CHECK(sb.st_size <= RECIPE_MAX_BYTES, KPL_EINVAL,
              "recipe %s: larger than 1 MiB: not a recipe", CLIP_PATH(path));
    /* Non-blocking and checked again: a path swapped for a FIFO after the
     * stat is refused, not waited on. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    KPL_CHECK(fd >= 0, KPL_EIO, "recipe %s: %s", CLIP_PATH(path), strerror(errno));
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return KPL_ERROR(KPL_EINVAL, "recipe %s: not a regular file", CLIP_PATH(path));
    }
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n + 4096 > cap) {
            cap = cap ? 2 * cap : 16384;
            char *b = realloc(buf, cap);
            if (!b) {
                free(buf);
                close(fd);
                return KPL_ERROR(KPL_ENOMEM, "recipe %s: out of memory", CLIP_PATH(path));
            }
            buf = b;
        }
        ssize_t r = read(fd, buf + n, cap - n - 1);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            free(buf);
            close(fd);
            return KPL_ERROR(KPL_EIO, "recipe %s: %s", CLIP_PATH(path), strerror(e));
        }
        if (r == 0) break;
        n += (size_t)r;
        if (n > RECIPE_MAX_BYTES) { /* it grew while being read */
            free(buf);
            close(fd);
            return KPL_ERROR(KPL_EINVAL, "recipe %s: larger than 1 MiB: not a recipe",
                             CLIP_PATH(path));
        }
    }
    close(fd);
    buf[n] = 0;
    *text = buf;
    *len = n;
    return KPL_OK;
}

/* src's entries laid over dst (maps merge key by key; everything else is
 * replaced); src is consumed. */
static void merge(node *dst, node *src)
{
    node *c = src->first;
    src->first = src->last = NULL;
    node_free(src);
    while (c) {
        node *next = c->next;
        c->next = NULL;
        node **link = &dst->first;
        while (*link && strcmp((*link)->key, c->key)) link = &(*link)->next;
        node *old = *link;
        if (old && old->kind == N_MAP && c->kind == N_MAP) {
            merge(old, c);
        } else if (old) {
            c->next = old->next;
            *link = c;
            if (dst->last == old) dst->last = c;
            old->next = NULL;
            node_free(old);
        } else {
            append(dst, c);
        }
        c = next;
    }
}

static kpl_status load_tree(ctx *cx, const char *text, size_t len, const char *origin,
                            bool is_file, const char *dir, int depth, node **out);

static kpl_status load_file(ctx *cx, const char *path, int depth, node **out)
{
    KPL_CHECK(depth < 8, KPL_EINVAL, "recipe %s: 'base' chain deeper than 8 (a loop?)",
              CLIP_PATH(path));
    char *text = NULL;
    size_t len = 0;
    KPL_TRY(read_file(path, &text, &len));
    char dir[KPL_RECIPE_PATH];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) slash[1] = 0;
    else dir[0] = 0;
    kpl_status st = load_tree(cx, text, len, keep_origin(cx, path), true, dir, depth, out);
    free(text);
    return st;
}

/* Parses one file's text, loads its base (relative to `dir`) and lays the
 * file over it. */
static kpl_status load_tree(ctx *cx, const char *text, size_t len, const char *origin,
                            bool is_file, const char *dir, int depth, node **out)
{
    node *root = NULL;
    KPL_TRY(parse_yaml(text, len, origin, is_file, "", &root));
    if (!root) { /* an empty file */
        root = calloc(1, sizeof *root);
        KPL_CHECK(root, KPL_ENOMEM, "out of memory");
        root->kind = N_MAP;
        root->origin = origin;
    }
    if (root->kind != N_MAP) {
        char w[1200];
        kpl_status st = KPL_ERROR(KPL_EFORMAT, "%s: a recipe is a mapping of keys to values",
                                  where(root, w, sizeof w));
        node_free(root);
        return st;
    }
    node **link = &root->first, *prev = NULL;
    while (*link && strcmp((*link)->key, "base")) {
        prev = *link;
        link = &(*link)->next;
    }
    node *b = *link;
    if (b) {
        char w[1200];
        *link = b->next;
        if (root->last == b) root->last = prev;
        b->next = NULL;
        if (b->kind != N_SCALAR || b->null) {
            kpl_status st = KPL_ERROR(KPL_EINVAL, "%s: base: expected the path of a recipe",
                                      where(b, w, sizeof w));
            node_free(b);
            node_free(root);
            return st;
        }
        char path[2 * KPL_RECIPE_PATH];
        if (b->text[0] == '/') snprintf(path, sizeof path, "%s", b->text);
        else snprintf(path, sizeof path, "%s%s", dir, b->text);
        node *base = NULL;
        kpl_status st = load_file(cx, path, depth + 1, &base);
        if (st < 0) {
            char msg[1600];
            snprintf(msg, sizeof msg, "%s", kpl_last_error());
            st = KPL_ERROR(st, "%s: in base: %s", where(b, w, sizeof w), msg);
            node_free(b);
            node_free(root);
            return st;
        }
        node_free(b);
        merge(base, root);
        root = base;
    }
    *out = root;
    return KPL_OK;
}

/* "a.b.c=value": value parsed as a YAML flow node and placed at a.b.c. */
static kpl_status apply_override(ctx *cx, node *root, const char *ov)
{
    const char *eq = strchr(ov, '=');
    KPL_CHECK(eq && eq > ov, KPL_EINVAL,
              "override '%s': expected KEY=VALUE with a dotted key, e.g. optimizer.lr=0.1",
              CLIP(ov));
    char key[256];
    size_t klen = (size_t)(eq - ov);
    KPL_CHECK(klen < sizeof key, KPL_EINVAL, "override '%s': key too long", CLIP(ov));
    memcpy(key, ov, klen);
    key[klen] = 0;
    const char *origin = keep_origin(cx, ov);
    node *value = NULL;
    const char *vtext = eq + 1;
    KPL_TRY(parse_yaml(vtext, strlen(vtext), origin, false, key, &value));
    if (!value) { /* "key=" */
        value = calloc(1, sizeof *value);
        KPL_CHECK(value, KPL_ENOMEM, "out of memory");
        value->kind = N_SCALAR;
        value->null = true;
        value->text = strdup("");
    }
    value->origin = origin;
    /* every node of the value names the override */
    node *m = root;
    kpl_status st = KPL_OK;
    for (char *seg = key;;) {
        char *dot = strchr(seg, '.');
        if (dot) *dot = 0;
        if (!*seg) {
            st = KPL_ERROR(KPL_EINVAL, "override '%s': empty part in the key", CLIP(ov));
            goto fail;
        }
        node *c = child_named(m, seg);
        if (!dot) {
            value->key = strdup(seg);
            if (!value->key) {
                st = KPL_ERROR(KPL_ENOMEM, "out of memory");
                goto fail;
            }
            if (c && c->kind == N_MAP && value->kind == N_MAP) {
                /* a section given as a map: laid over the recipe's key by
                 * key, as a base is (data={train: {path: x}} keeps the
                 * rest of data) */
                merge(c, value);
            } else if (c) { /* replace in place */
                node **link = &m->first;
                while (*link != c) link = &(*link)->next;
                value->next = c->next;
                *link = value;
                if (m->last == c) m->last = value;
                c->next = NULL;
                node_free(c);
            } else {
                append(m, value);
            }
            return KPL_OK;
        }
        if (c && c->kind != N_MAP) {
            char w[1200];
            st = KPL_ERROR(KPL_EINVAL, "override '%s': '%s' is a value (%s), not a section",
                           CLIP(ov), CLIP(seg), where(c, w, sizeof w));
            goto fail;
        }
        if (!c) {
            c = calloc(1, sizeof *c);
            if (!c || !(c->key = strdup(seg))) {
                free(c);
                st = KPL_ERROR(KPL_ENOMEM, "out of memory");
                goto fail;
            }
            c->kind = N_MAP;
            c->origin = origin;
            append(m, c);
        }
        m = c;
        seg = dot + 1;
    }
fail:
    node_free(value);
    return st;
}

/* ---- binding -------------------------------------------------------------------------- */

static node *lookup(node *root, const char *key)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", key);
    node *m = root;
    for (char *seg = buf; m;) {
        char *dot = strchr(seg, '.');
        if (dot) *dot = 0;
        if (m->kind != N_MAP) return NULL;
        node *c = child_named(m, seg);
        if (!dot) return c;
        m = c;
        seg = dot + 1;
    }
    return NULL;
}

static bool parse_bool(const char *s, bool *v)
{
    static const char *const t[] = {"true", "yes", "on"}, *const f[] = {"false", "no", "off"};
    for (int i = 0; i < 3; i++) {
        if (!strcasecmp(s, t[i])) return *v = true, true;
        if (!strcasecmp(s, f[i])) return *v = false, true;
    }
    return false;
}

/* A number from a scalar, checked against the field's range. */
static kpl_status scalar_number(const field *f, const node *n, const char *loc, bool integer,
                                double *out)
{
    const char *s = n->text;
    char *end = NULL;
    errno = 0;
    double v;
    if (integer) {
        long long i = strtoll(s, &end, 10);
        v = (double)i;
        if (end == s || *end || errno)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected an integer, got '%s'", loc, f->key,
                             CLIP(s));
    } else {
        v = strtod(s, &end);
        if (end == s || *end || errno || !isfinite(v))
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected a number, got '%s'", loc, f->key,
                             CLIP(s));
    }
    if (v < f->lo || v > f->hi)
        return KPL_ERROR(KPL_ERANGE, "%s: %s: %s is out of range [%.15g, %.15g]", loc, f->key,
                         CLIP(s), f->lo, f->hi);
    *out = v;
    return KPL_OK;
}

static const char *type_name(vtype t)
{
    switch (t) {
    case T_BOOL: return "true or false";
    case T_INT: return "an integer";
    case T_FLOAT: return "a number";
    case T_STR: return "a string";
    case T_ENUM: return "a name";
    case T_INTS: return "a list of integers";
    case T_FLOATS: return "a list of numbers";
    case T_INT2: return "two integers";
    case T_FLOAT2: return "two numbers";
    case T_GROUPS: return "a list of {params, lr_mult, weight_decay_mult}";
    }
    return "?";
}

/* Members of the modules' structs are int or int64_t, float or double:
 * stored and read at their own width. */
static void store_int(char *dst, size_t size, int64_t v)
{
    if (size == sizeof(int64_t)) memcpy(dst, &v, sizeof v);
    else if (size == sizeof(int32_t)) memcpy(dst, &(int32_t){(int32_t)v}, sizeof(int32_t));
    else KPL_ASSERT(false, "recipe: an integer member of unexpected width");
}

static int64_t load_int(const char *src, size_t size)
{
    int64_t v;
    int32_t w;
    if (size == sizeof v) return memcpy(&v, src, sizeof v), v;
    return memcpy(&w, src, sizeof w), w;
}

static void store_real(char *dst, size_t size, double v)
{
    if (size == sizeof(double)) memcpy(dst, &v, sizeof v);
    else memcpy(dst, &(float){(float)v}, sizeof(float));
}

static double load_real(const char *src, size_t size)
{
    double d;
    float f;
    if (size == sizeof d) return memcpy(&d, src, sizeof d), d;
    return memcpy(&f, src, sizeof f), f;
}

/* One number of a scalar into dst, at the member's width. */
static kpl_status bind_number(const field *f, const node *n, const char *loc, bool integer,
                              char *dst)
{
    double v = 0;
    KPL_TRY(scalar_number(f, n, loc, integer, &v));
    if (integer) store_int(dst, f->size, strtoll(n->text, NULL, 10));
    else store_real(dst, f->size, v);
    return KPL_OK;
}

/* A pair: [a, b]; with cap 0 also [] (both 0) and one value (both). */
static kpl_status bind_pair(const field *f, const node *n, const char *loc, kpl_recipe *r)
{
    char *dst[2] = {(char *)r + f->off, (char *)r + f->off2};
    bool integer = f->type == T_INT2;
    const node *e[2] = {NULL, NULL};
    int count = 0;
    if (n->kind == N_SEQ) {
        for (const node *c = n->first; c; c = c->next, count++)
            if (count < 2) e[count] = c;
    } else if (!n->null) {
        e[0] = n, count = 1;
    }
    if (count > 2 || (f->cap == 2 && count != 2))
        return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s%s", loc, f->key, f->form,
                         f->cap == 2 ? "" : " or one value");
    for (int i = 0; i < 2; i++) {
        const node *v = e[i] ? e[i] : e[0];
        if (!v) {
            store_int(dst[i], f->size, 0); /* []: the member's "unset" */
            continue;
        }
        char eloc[1200];
        where(v, eloc, sizeof eloc);
        if (v->kind != N_SCALAR || v->null)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s", eloc, f->key, type_name(f->type));
        KPL_TRY(bind_number(f, v, eloc, integer, dst[i]));
    }
    return KPL_OK;
}

typedef kpl_param_group group;

/* One parameter group: a map with `params` and the two multipliers. */
static kpl_status bind_group(const field *f, const node *e, group *g)
{
    char loc[1200];
    where(e, loc, sizeof loc);
    if (e->kind != N_MAP)
        return KPL_ERROR(KPL_EINVAL, "%s: %s: each group is a map {params: PATTERN, lr_mult: X, "
                                     "weight_decay_mult: Y}", loc, f->key);
    memset(g, 0, sizeof *g);
    g->lr_mult = g->weight_decay_mult = 1;
    bool have_params = false;
    for (const node *c = e->first; c; c = c->next) {
        char cloc[1200], key[160];
        where(c, cloc, sizeof cloc);
        snprintf(key, sizeof key, "%s[].%s", f->key, c->key);
        field sub = {key, T_FLOAT, 0, sizeof(double), 0, 0, 0, NULL, f->lo, f->hi, NULL, NULL,
                     NULL, NULL};
        if (c->kind != N_SCALAR || c->null)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected a %s", cloc, key,
                             strcmp(c->key, "params") ? "number" : "pattern");
        if (!strcmp(c->key, "params")) {
            if (!c->text[0] || strlen(c->text) >= sizeof g->params)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: a pattern of 1 to %zu characters", cloc, key,
                                 sizeof g->params - 1);
            for (const char *t = c->text; *t; t++)
                if ((unsigned char)*t < 0x20 || *t == 0x7f)
                    return KPL_ERROR(KPL_EINVAL, "%s: %s: control character 0x%02x", cloc, key,
                                     (unsigned char)*t);
            snprintf(g->params, sizeof g->params, "%s", c->text);
            have_params = true;
        } else if (!strcmp(c->key, "lr_mult")) {
            KPL_TRY(scalar_number(&sub, c, cloc, false, &g->lr_mult));
        } else if (!strcmp(c->key, "weight_decay_mult")) {
            KPL_TRY(scalar_number(&sub, c, cloc, false, &g->weight_decay_mult));
        } else {
            return KPL_ERROR(KPL_EINVAL, "%s: %s: unknown key (a group has params, lr_mult, "
                                         "weight_decay_mult)", where_key(c, cloc, sizeof cloc), key);
        }
    }
    if (!have_params)
        return KPL_ERROR(KPL_EINVAL, "%s: %s: a group needs params: PATTERN", loc, f->key);
    return KPL_OK;
}

static kpl_status bind_field(const field *f, const node *n, kpl_recipe *r)
{
    char loc[1200];
    where(n, loc, sizeof loc);
    char *dst = (char *)r + f->off;
    bool list = f->type == T_INTS || f->type == T_FLOATS || f->type == T_GROUPS ||
                f->type == T_INT2 || f->type == T_FLOAT2;
    if ((n->kind == N_MAP && f->type != T_GROUPS) || (n->kind == N_SEQ && !list))
        return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s, got a %s", loc, f->key,
                         type_name(f->type), n->kind == N_MAP ? "section" : "list");
    if (n->kind == N_SCALAR && n->null && f->type != T_STR && !list)
        return KPL_ERROR(KPL_EINVAL, "%s: %s: no value (expected %s)", loc, f->key,
                         type_name(f->type));
    switch (f->type) {
    case T_BOOL: {
        bool v;
        if (!parse_bool(n->text, &v))
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected true or false, got '%s'", loc, f->key,
                             CLIP(n->text));
        *(bool *)dst = v;
        return KPL_OK;
    }
    case T_INT:
    case T_FLOAT: return bind_number(f, n, loc, f->type == T_INT, dst);
    case T_INT2:
    case T_FLOAT2: return bind_pair(f, n, loc, r);
    case T_STR: {
        const char *s = n->null ? "" : n->text;
        if (f->known) { /* a registered thing's name: one of those known now */
            char known[1024];
            f->known(known, sizeof known);
            if (!name_listed(s, known))
                return KPL_ERROR(KPL_EINVAL, "%s: %s: expected one of %s; got '%s'", loc, f->key,
                                 known, CLIP(s));
        }
        if (strlen(s) >= f->cap)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: longer than %zu characters", loc, f->key,
                             f->cap - 1);
        /* names and paths: a newline or escape code would end up in file
         * names and logs */
        for (const char *c = s; *c; c++)
            if ((unsigned char)*c < 0x20 || *c == 0x7f)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: control character 0x%02x in '%s'", loc,
                                 f->key, (unsigned char)*c, CLIP(s));
        memcpy(dst, s, strlen(s) + 1);
        return KPL_OK;
    }
    case T_ENUM: {
        int i = kpl__name_index(f->choices, n->text);
        if (i >= 0) {
            store_int(dst, f->size, i);
            return KPL_OK;
        }
        char opts[256] = "";
        for (int c = 0; f->choices[c]; c++) {
            size_t l = strlen(opts);
            snprintf(opts + l, sizeof opts - l, "%s%s", c ? ", " : "", f->choices[c]);
        }
        return KPL_ERROR(KPL_EINVAL, "%s: %s: expected one of %s; got '%s'", loc, f->key, opts,
                         CLIP(n->text));
    }
    case T_INTS:
    case T_FLOATS: {
        int *count = (int *)((char *)r + f->count_off);
        *count = 0;
        if (n->kind == N_SCALAR && n->null) return KPL_OK;
        const node *e = n->kind == N_SEQ ? n->first : n; /* a scalar is a list of one */
        for (; e; e = n->kind == N_SEQ ? e->next : NULL) {
            char eloc[1200];
            where(e, eloc, sizeof eloc);
            if (e->kind != N_SCALAR || e->null)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s", eloc, f->key,
                                 type_name(f->type));
            if ((size_t)*count == f->cap)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: more than %zu values", loc, f->key, f->cap);
            KPL_TRY(bind_number(f, e, eloc, f->type == T_INTS, dst + (size_t)*count * f->size));
            (*count)++;
        }
        return KPL_OK;
    }
    case T_GROUPS: {
        int *count = (int *)((char *)r + f->count_off);
        *count = 0;
        if (n->kind == N_SCALAR && n->null) return KPL_OK;
        if (n->kind != N_SEQ)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s", loc, f->key, type_name(f->type));
        for (const node *e = n->first; e; e = e->next) {
            if ((size_t)*count == f->cap)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: more than %zu groups", loc, f->key, f->cap);
            KPL_TRY(bind_group(f, e, &((group *)dst)[*count]));
            (*count)++;
        }
        return KPL_OK;
    }
    }
    return KPL_OK;
}

/* Levenshtein distance, for "did you mean". */
static int distance(const char *a, const char *b)
{
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 60 || lb > 60) return 99;
    int d[61][61];
    for (int i = 0; i <= la; i++) d[i][0] = i;
    for (int j = 0; j <= lb; j++) d[0][j] = j;
    for (int i = 1; i <= la; i++)
        for (int j = 1; j <= lb; j++) {
            int c = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < c) c = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < c) c = d[i][j - 1] + 1;
            d[i][j] = c;
        }
    return d[la][lb];
}

static bool is_section(const char *path)
{
    size_t l = strlen(path);
    for (int i = 0; i < NFIELDS; i++)
        if (!strncmp(fields[i].key, path, l) && fields[i].key[l] == '.') return true;
    return false;
}

static const field *find_field(const char *path)
{
    for (int i = 0; i < NFIELDS; i++)
        if (!strcmp(fields[i].key, path)) return &fields[i];
    return NULL;
}

/* Every key of the tree must be a field or a section of fields. */
static kpl_status check_unknown(const node *map, const char *prefix)
{
    for (const node *c = map->first; c; c = c->next) {
        char path[512], loc[1200];
        snprintf(path, sizeof path, "%s%s%s", prefix, *prefix ? "." : "", c->key);
        if (find_field(path)) continue;
        if (is_section(path)) {
            if (c->kind != N_MAP)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: is a section of keys, not a value",
                                 where(c, loc, sizeof loc), path);
            KPL_TRY(check_unknown(c, path));
            continue;
        }
        /* an unknown section: name its first key, so that the hint can
         * compare whole keys ("optimiser.lr" -> "optimizer.lr") */
        for (const node *d = c; d->kind == N_MAP && d->first; d = d->first) {
            size_t l = strlen(path);
            snprintf(path + l, sizeof path - l, ".%s", d->first->key);
        }
        const char *best = NULL;
        int bd = 99;
        for (int i = 0; i < NFIELDS; i++) {
            int d = distance(path, fields[i].key);
            if (d < bd) bd = d, best = fields[i].key;
        }
        char hint[300] = "";
        if (best && bd <= 3) snprintf(hint, sizeof hint, " (did you mean '%s'?)", best);
        return KPL_ERROR(KPL_EINVAL, "%s: unknown key '%s'%s", where_key(c, loc, sizeof loc),
                         CLIP(path), hint);
    }
    return KPL_OK;
}

/* Rules that join several keys; messages point at the key to change.
 * known_task: the task must be one kpl_task_find knows (the kpl command). */
static kpl_status check_rules(node *root, kpl_recipe *r, bool known_task)
{
    char loc[1200];
#define AT(k) where(lookup(root, k), loc, sizeof loc)
    if (known_task && !kpl_task_find(r->task)) {
        char names[256];
        kpl__task_names(names, sizeof names);
        return KPL_ERROR(KPL_EINVAL, "%s: task: unknown task '%s' (kpl train and kpl eval know: "
                         "%s; a program with a task of its own runs it through "
                         "kpl_trainer_create)", AT("task"), CLIP(r->task), names);
    }
    /* the keys classification needs, as if they were required */
    if (!strcmp(r->task, "classification")) {
        const char *k = !strcmp(r->model.name, "none") ? "model.name"
                        : r->model.num_classes == 0     ? "model.num_classes"
                                                        : NULL;
        if (k)
            return KPL_ERROR(KPL_EINVAL, "%s: missing required key '%s' (task classification)",
                             *r->file ? CLIP_PATH(r->file) : "recipe", k);
    }
    kpl_recipe_split *sp[2] = {&r->data.train, &r->data.val};
    const char *spn[2] = {"data.train", "data.val"};
    for (int i = 0; i < 2; i++) {
        char k[128];
        kpl_transform_config *t = &sp[i]->loader.transform;
        int *count[2] = {&sp[i]->nmean, &sp[i]->nstd};
        float *value[2] = {t->mean, t->std};
        snprintf(k, sizeof k, "%s.transform.scale", spn[i]);
        if (t->scale[0] > t->scale[1] || t->scale[0] <= 0)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected [min, max] with 0 < min <= max <= 1",
                             AT(k), k);
        snprintf(k, sizeof k, "%s.transform.ratio", spn[i]);
        if (t->ratio[0] > t->ratio[1])
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected [min, max] with min <= max", AT(k), k);
        for (int m = 0; m < 2; m++) {
            snprintf(k, sizeof k, "%s.transform.%s", spn[i], m ? "std" : "mean");
            if (*count[m] != 1 && *count[m] != t->channels)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: %s, got %d", AT(k), k,
                                 t->channels == 1 ? "expected 1 value (transform.channels is 1)"
                                                  : "expected 1 value or 3 (one per channel)",
                                 *count[m]);
            for (int c = *count[m]; c < 3; c++) value[m][c] = value[m][0]; /* one for all */
        }
        snprintf(k, sizeof k, "%s.transform.channels", spn[i]);
        if (t->channels == 2)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: 1 or 3, not 2", AT(k), k);
        snprintf(k, sizeof k, "%s.transform.size", spn[i]);
        if (t->crop != KPL_CROP_NONE && t->out_h == 0)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: crop '%s' needs an output size", AT(k), k,
                             kpl_crop_mode_name(t->crop));
    }
    if (r->data.train.loader.batch_size < 1)
        return KPL_ERROR(KPL_EINVAL, "%s: data.train.batch_size: must be >= 1",
                         AT("data.train.batch_size"));
    if (r->data.convert.from != KPL_CONVERT_NONE && !r->data.convert.source[0])
        return KPL_ERROR(KPL_EINVAL, "%s: data.convert.source: needed with data.convert.from %s",
                         AT("data.convert.source"), kpl_convert_source_name(r->data.convert.from));
    if (!strcmp(r->model.name, "resnet")) {
        int64_t d = r->model.depth;
        if (d != 18 && d != 34 && d != 50 && d != 101 && d != 152)
            return KPL_ERROR(KPL_EINVAL, "%s: model.depth: resnet depth is 18, 34, 50, 101 or "
                             "152, got %lld", AT("model.depth"), (long long)d);
    }
    const kpl_optim_config *oc = &r->optimizer.config;
    if (oc->nesterov && (strcmp(oc->name, "sgd") || oc->momentum <= 0))
        return KPL_ERROR(KPL_EINVAL, "%s: optimizer.nesterov: needs optimizer.name sgd and "
                         "momentum > 0", AT("optimizer.nesterov"));
    const kpl_lr_schedule *sc = &r->schedule.config;
    if (sc->kind == KPL_SCHED_MULTISTEP && sc->num_milestones == 0)
        return KPL_ERROR(KPL_EINVAL, "%s: schedule.milestones: multistep needs milestones",
                         AT("schedule.milestones"));
    for (int i = 1; i < sc->num_milestones; i++)
        if (sc->milestones[i] <= sc->milestones[i - 1])
            return KPL_ERROR(KPL_EINVAL, "%s: schedule.milestones: must increase",
                             AT("schedule.milestones"));
    if ((sc->kind == KPL_SCHED_COSINE || sc->kind == KPL_SCHED_POLY) &&
        sc->warmup_epochs >= (double)r->epochs)
        return KPL_ERROR(KPL_EINVAL, "%s: schedule.warmup_epochs: %g leaves nothing of %lld "
                         "epochs for the %s schedule", AT("schedule.warmup_epochs"),
                         sc->warmup_epochs, (long long)r->epochs, kpl_sched_kind_name(sc->kind));
    if (sc->min_lr > oc->lr)
        return KPL_ERROR(KPL_EINVAL, "%s: schedule.min_lr: %g is above optimizer.lr %g",
                         AT("schedule.min_lr"), sc->min_lr, oc->lr);
    /* The name becomes a directory, runs/<name>-<time>: one path part. */
    for (const char *c = r->name; *c; c++)
        if (!isalnum((unsigned char)*c) && !strchr("._+-", *c))
            return KPL_ERROR(KPL_EINVAL, "%s: name: '%s' may hold only letters, digits and . _ + "
                             "- (it names the run directory runs/<name>-<time>)", AT("name"),
                             CLIP(r->name));
    if (r->name[0] == '.')
        return KPL_ERROR(KPL_EINVAL, "%s: name: '%s' must not start with '.'", AT("name"),
                         CLIP(r->name));
    const char *dev = r->device;
    if (strcmp(dev, "auto") && strcmp(dev, "cpu") && strcmp(dev, "cuda")) {
        char *end = NULL;
        if (strncmp(dev, "cuda:", 5) || !isdigit((unsigned char)dev[5]) ||
            (strtol(dev + 5, &end, 10), *end))
            return KPL_ERROR(KPL_EINVAL, "%s: device: expected auto, cpu, cuda or cuda:N; got "
                             "'%s'", AT("device"), dev);
    }
    return KPL_OK;
#undef AT
}

static kpl_status bind(node *root, const char *file, bool known_task, kpl_recipe *r)
{
    /* what no key sets keeps its module's default; pointers stay NULL */
    memset(r, 0, sizeof *r);
    kpl_recipe_split *sp[2] = {&r->data.train, &r->data.val};
    for (int i = 0; i < 2; i++) {
        sp[i]->loader = (kpl_loader_config)KPL_LOADER_CONFIG_INIT;
        sp[i]->loader.transform.image_feature = sp[i]->loader.transform.label_feature = NULL;
    }
    r->data.convert.options = (kpl_convert_options)KPL_CONVERT_OPTIONS_INIT;
    r->optimizer.config = (kpl_optim_config)KPL_OPTIM_CONFIG_INIT;
    r->schedule.config = (kpl_lr_schedule)KPL_LR_SCHEDULE_INIT;
    r->schedule.config.base_lr = r->schedule.config.epochs = 0; /* the trainer's */
    r->dist.comm = (kpl_comm_config)KPL_COMM_CONFIG_INIT;
    r->dist.buckets = (kpl_bucketer_config)KPL_BUCKETER_CONFIG_INIT;
    KPL_TRY(check_unknown(root, ""));
    for (int i = 0; i < NFIELDS; i++) {
        const field *f = &fields[i];
        node *n = lookup(root, f->key);
        if (n) {
            KPL_TRY(bind_field(f, n, r));
            continue;
        }
        if (!f->def)
            return KPL_ERROR(KPL_EINVAL, "%s: missing required key '%s' (%s)",
                             *file ? CLIP_PATH(file) : "recipe", f->key, f->help);
        node *d = NULL;
        KPL_TRY(parse_yaml(f->def, strlen(f->def), "default", false, "", &d));
        kpl_status st = bind_field(f, d, r);
        node_free(d);
        KPL_ASSERT(st >= 0, "recipe: a default does not fit its own key");
    }
    if (!r->name[0]) { /* the file's name without directory and extension */
        const char *b = strrchr(file, '/');
        b = b ? b + 1 : file;
        size_t l = strcspn(b, ".");
        if (l >= sizeof r->name) l = sizeof r->name - 1;
        memcpy(r->name, b, l);
        r->name[l] = 0;
        for (char *c = r->name; *c; c++) /* what the name rule allows */
            if (!isalnum((unsigned char)*c) && !strchr("_+-", *c)) *c = '_';
        if (!r->name[0]) snprintf(r->name, sizeof r->name, "run");
    }
    snprintf(r->file, sizeof r->file, "%s", file);
    return check_rules(root, r, known_task);
}

/* `plugins` (a path or a list of them), taken out of the tree and loaded
 * before anything else is read: what they register may be named by the
 * other keys.  Each path is relative to the file that names it (an
 * override's to the working directory); *n resolved paths into paths. */
static kpl_status take_plugins(node *root, char (*paths)[KPL_RECIPE_PATH], int *n)
{
    *n = 0;
    node **link = &root->first, *prev = NULL;
    while (*link && strcmp((*link)->key, "plugins")) {
        prev = *link;
        link = &(*link)->next;
    }
    node *p = *link;
    if (!p) return KPL_OK;
    *link = p->next;
    if (root->last == p) root->last = prev;
    p->next = NULL;
    char w[1200];
    kpl_status st = KPL_OK;
    const node *one[1] = {p};
    int count = p->kind == N_SEQ ? 0 : p->null ? 0 : 1;
    for (const node *e = p->kind == N_SEQ ? p->first : NULL; e; e = e->next) count++;
    if (p->kind == N_MAP) {
        st = KPL_ERROR(KPL_EINVAL, "%s: plugins: expected a list of paths", where(p, w, sizeof w));
    } else if (count > KPL_RECIPE_LIST) {
        st = KPL_ERROR(KPL_EINVAL, "%s: plugins: at most %d", where(p, w, sizeof w), KPL_RECIPE_LIST);
    }
    const node *e = p->kind == N_SEQ ? p->first : count ? one[0] : NULL;
    for (; st >= 0 && e; e = p->kind == N_SEQ ? e->next : NULL) {
        if (e->kind != N_SCALAR || e->null || !*e->text) {
            st = KPL_ERROR(KPL_EINVAL, "%s: plugins: expected the path of a shared library",
                           where(e, w, sizeof w));
            break;
        }
        char file[2 * KPL_RECIPE_PATH + 2];
        const char *slash = e->line > 0 ? strrchr(e->origin, '/') : NULL;
        if (e->text[0] != '/' && slash)
            snprintf(file, sizeof file, "%.*s/%s", (int)(slash - e->origin), e->origin, e->text);
        else
            snprintf(file, sizeof file, "%s", e->text);
        if ((st = kpl_plugin_load(file)) < 0) {
            kpl__error_prefix(st, "%s: plugins: ", where(e, w, sizeof w));
            break;
        }
        char real[PATH_MAX];
        if (!realpath(file, real) || strlen(real) >= KPL_RECIPE_PATH) {
            st = KPL_ERROR(KPL_EINVAL, "%s: plugins: path longer than %d bytes",
                           where(e, w, sizeof w), KPL_RECIPE_PATH - 1);
            break;
        }
        memcpy(paths[(*n)++], real, strlen(real) + 1);
    }
    node_free(p);
    return st;
}

static kpl_status load(const char *path, const char *yaml, const char *origin, int nov,
                       const char *const *ov, bool known_task, kpl_recipe *out)
{
    KPL_CHECK(out && (nov == 0 || ov), KPL_EINVAL, "recipe: bad arguments");
    ctx cx;
    memset(&cx, 0, sizeof cx);
    node *root = NULL;
    kpl_status st;
    if (path) st = load_file(&cx, path, 0, &root);
    else st = load_tree(&cx, yaml, strlen(yaml), keep_origin(&cx, origin), true, "", 0, &root);
    for (int i = 0; i < nov && st >= 0; i++) st = apply_override(&cx, root, ov[i]);
    static char plugins[KPL_RECIPE_LIST][KPL_RECIPE_PATH]; /* one recipe loads at a time */
    int nplugins = 0;
    if (st >= 0) st = take_plugins(root, plugins, &nplugins);
    if (st >= 0) st = bind(root, path ? path : "", known_task, out);
    if (st >= 0) {
        memcpy(out->plugins, plugins, sizeof plugins);
        out->nplugins = nplugins;
    }
    node_free(root);
    for (int i = 0; i < cx.norigins; i++) free(cx.origins[i]);
    return st;
}

kpl_status kpl_recipe_load(const char *path, int noverrides, const char *const *overrides,
                           kpl_recipe *out)
{
    KPL_CHECK(path, KPL_EINVAL, "recipe: no path");
    return load(path, NULL, NULL, noverrides, overrides, false, out);
}

kpl_status kpl__recipe_load_known_task(const char *path, int noverrides,
                                       const char *const *overrides, kpl_recipe *out)
{
    KPL_CHECK(path, KPL_EINVAL, "recipe: no path");
    return load(path, NULL, NULL, noverrides, overrides, true, out);
}

kpl_status kpl_recipe_load_string(const char *yaml, const char *origin, int noverrides,
                                  const char *const *overrides, kpl_recipe *out)
{
    KPL_CHECK(yaml, KPL_EINVAL, "recipe: no text");
    return load(NULL, yaml, origin ? origin : "recipe", noverrides, overrides, false, out);
}

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

/* The shortest decimal that reads back as the same double. */
/* The fewest digits that read back to the same double (or float). */
static void put_number(sbuf *b, double v, bool single)
{
    char s[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(s, sizeof s, "%.*g", prec, v);
        if (single ? strtof(s, NULL) == (float)v : strtod(s, NULL) == v) break;
    }
    /* "1" would read back as an integer, which a number key accepts too;
     * keep it a float in appearance for readers. */
    if (!strpbrk(s, ".eEn")) strcat(s, ".0");
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
        if (pair && f->cap == 0 && load_real_or_int(at[0], f->size, integer) == 0 &&
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
            const group *g = &((const group *)src)[i];
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
    for (int i = 0; i < NFIELDS; i++) {
        const field *f = &fields[i];
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
