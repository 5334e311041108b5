/*
 * bench_parity.c — `bench/run.sh parity`: does kpl learn what PyTorch
 * learns?  The same network, the same initial weights, the very same
 * batches, the same optimizer and learning rate at every step, N steps;
 * then both sides' final weights evaluated the same way.
 *
 *   bench_parity BENCH_DIR ROOT KPL WORK_DIR [--cases fcos,unet] [--train N]
 *                [--val N] [--epochs E] [--control 0|1]
 *
 * Defaults: both cases, 800 training and 200 validation images, 4 epochs
 * (200 steps of 16), the control on.
 *
 * For each case (a recipe of ROOT/recipes on a set `KPL data synth` makes
 * under WORK_DIR):
 *  - kpl trains the recipe (kpl_trainer_fit, the run `kpl train` makes,
 *    1 rank, the machine's threads) for E epochs of N images, logging every
 *    step (metrics.jsonl: each step's losses and learning rate), evaluating
 *    once at the end, with `deterministic: true`: by default kpl times its
 *    candidate kernels under whatever load the machine has and keeps the
 *    fastest, and the rounding changes with the choice, so two runs part
 *    as the control below does; chosen without timing, the row is the same
 *    from run to run, as PyTorch's CPU side is.  Its task is the registered one with train_step and
 *    eval_batch wrapped: each training batch, as the loader gave it after
 *    the transform (augmentation included), goes to WORK/<case>/train.bin,
 *    and the evaluation's batches to val.bin.  The models' weights are
 *    written before the first step (init.bin) and after the last
 *    (kpl_final.bin).
 *  - bench/torch_parity.py builds the same network in PyTorch
 *    (torch_fcos.py, torch_segnets.py), loads init.bin, and trains it on
 *    train.bin's batches in order: AdamW with the recipe's betas, eps and
 *    weight decay (none on parameters of at most one dimension:
 *    optimizer.no_decay_bn_bias), clipping at optimizer.clip_grad_norm,
 *    and at each step the learning rate kpl used at that step.  Then it
 *    evaluates its own final weights and kpl's on val.bin's batches with
 *    one evaluator: FCOS's decoding and class-wise NMS as kpl's (score >
 *    0.05, 1000 a level, IoU 0.6, 100 an image) and pycocotools' AP
 *    (ground truth: the batches' boxes); U-Net's argmax and the confusion
 *    matrix's mIoU (classes absent from labels and predictions left out).
 *  - The control (--control 1): PyTorch once more, from the initial weights
 *    each moved by about one unit in the last place (x (1 +- 2^-23)), on
 *    the same batches.  Two runs that differ only in rounding part as the
 *    steps go on (training is chaotic: docs/gpu.md, train_cuda); how far
 *    the control ends from PyTorch is the yardstick for how far kpl does.
 *
 * One JSON line per case: kpl = the metric of kpl's final weights, ref =
 * that of PyTorch's, ctl = the control's (one evaluator for the three),
 * ratio kpl / ref; the loss curves (kpl_loss, ref_loss, ctl_loss: every
 * step); the first step's losses (which must agree: same weights, same
 * batch; else exit 1, the two setups differ); the mean loss over the last
 * tenth of the steps on each side and the mean relative gap there
 * (loss_gap_last_tenth: kpl to PyTorch, control to PyTorch); kpl's own
 * evaluation of its weights (kpl_own: kpl's COCO evaluator or its
 * segmentation metrics, which the Python evaluator must reproduce for
 * kpl's weights, else exit 1); the seconds each side took; both sides'
 * ISA.  This is no timing benchmark: the sides are not alternated.
 */
#include "bench_common.h"
#include "bench_file.h"
#include "task.h"

#include <errno.h>
#include <stdint.h>
#include <sys/stat.h>

#define PARITY_MAGIC "KPLPAR1"
/* The first step's total loss, same weights and batch on both sides */
#define PARITY_STEP1_RTOL 1e-4
/* kpl's own evaluation of its weights against the Python evaluator's */
#define PARITY_EVAL_ATOL 2e-3

typedef struct {
    const char *name;   /* the case */
    const char *set;    /* kpl data synth's set */
    const char *recipe; /* under ROOT */
    const char *metric; /* the figure compared: kpl's name for it */
    const char *second; /* one more figure both sides report */
    const char *torch;  /* torch_parity.py's KEY=VALUE for the network */
} parity_case;

/* The recipes as they are, on smaller sets.  The PyTorch side's network,
 * losses and decoding are these KEY=VALUEs, kept in step with the recipes
 * by hand: should they part, the check of every parameter's name and
 * shape, the first step's losses or the evaluator check fails. */
static const parity_case cases[] = {
    {"fcos", "fmnist-det", "recipes/detection/fcos_r18_fmnistdet.yaml", "ap", "ap50",
     "depth=18 width=32 fpn=128 classes=10 levels=5 convs=4 groups=32 "
     "ranges=-1,16,16,32,32,64,64,128,128,1e8 radius=1.5 alpha=0.25 gamma=2 "
     "score_thresh=0.05 topk=1000 nms_iou=0.6 max_dets=100"},
    {"unet", "fmnist-seg", "recipes/segmentation/unet_fmnistseg.yaml", "miou", "aacc",
     "model=unet in_channels=3 classes=11 width=16 depth=4 upsample=transpose ignore=255"},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

static void die(const char *what)
{
    fprintf(stderr, "bench_parity: %s: %s\n", what, kpl_last_error());
    exit(1);
}

/* ---- the wrapped task: every batch to a file ----------------------------------------------- */

static struct {
    const kpl_task_kind *task; /* the registered one */
    FILE *train, *val;
    int64_t steps, vbatches;
    bool val_done; /* the first evaluation's batches are written: later ones are not */
} dump;

/* A batch tensor as f32 (u8 masks, i64 labels and counts are exact). */
static void put_any(FILE *f, const char *name, kpl_tensor *t)
{
    int64_t n = kpl_tensor_numel(t);
    const void *src = kpl_tensor_host_data(t);
    float *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    if (!src || !v) die(name);
    switch (kpl_tensor_dtype(t)) {
    case KPL_F32: memcpy(v, src, (size_t)n * sizeof *v); break;
    case KPL_U8:
        for (int64_t i = 0; i < n; i++) v[i] = ((const uint8_t *)src)[i];
        break;
    case KPL_I64:
        for (int64_t i = 0; i < n; i++) v[i] = (float)((const int64_t *)src)[i];
        break;
    default:
        fprintf(stderr, "bench_parity: batch tensor %s has dtype %s\n", name,
                kpl_dtype_name(kpl_tensor_dtype(t)));
        exit(1);
    }
    bench_put_entry(f, name, kpl_tensor_ndim(t), kpl_tensor_shape(t), v);
    free(v);
}

static void put_batch(FILE *f, const char *prefix, int64_t i, const kpl_batch *b)
{
    struct {
        const char *name;
        kpl_tensor *t;
    } parts[] = {{"image", b->image},       {"boxes", b->boxes}, {"labels", b->box_labels},
                 {"nboxes", b->num_boxes}, {"mask", b->mask},
                 {"image_size", b->image_size}};
    for (size_t k = 0; k < sizeof parts / sizeof parts[0]; k++) {
        if (!parts[k].t) continue;
        char name[64];
        snprintf(name, sizeof name, "%s:%lld:%s", prefix, (long long)i, parts[k].name);
        put_any(f, name, parts[k].t);
    }
}

static kpl_status dump_train_step(kpl_trainer *t, void *state, const kpl_batch *b,
                                  kpl_step_result *out)
{
    put_batch(dump.train, "t", dump.steps++, b);
    return dump.task->train_step(t, state, b, out);
}

static kpl_status dump_eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    if (!dump.val_done) put_batch(dump.val, "v", dump.vbatches++, b);
    return dump.task->eval_batch(t, state, b);
}

static kpl_status dump_eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    dump.val_done = true;
    return dump.task->eval_end(t, state, res);
}

static void put_weights(kpl_trainer *t, const char *path)
{
    FILE *f = bench_file_open(path, PARITY_MAGIC);
    bench_put_module(f, "p:", "b:", kpl_trainer_model(t, 0));
    if (fclose(f)) die(path);
}

/* ---- one case ---------------------------------------------------------------------------------- */

/* A loss curve, one value a step, from 0. */
typedef struct {
    int n, cap;
    double *v;
} curve;

/* Sets step i (which must be the next) to x; false when out of order. */
static bool curve_put(curve *c, int i, double x)
{
    if (i != c->n) return false;
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 256;
        c->v = realloc(c->v, (size_t)c->cap * sizeof *c->v);
        if (!c->v) die("memory");
    }
    c->v[c->n++] = x;
    return true;
}

typedef struct {
    curve kpl, ref, ctl; /* losses: kpl's (its metrics.jsonl), PyTorch's, the control's */
    double kpl_eval, ref_eval, ctl_eval, kpl_own, kpl_second, ref_second, ctl_second;
    double ref_s; /* PyTorch's training seconds */
    char ref_isa[64], ref_name[64]; /* ref_name: "torch <version>" */
} parity_result;

/* torch_parity.py's lines (its docstring) into r. */
static void ref_line(const char *line, void *ctx)
{
    parity_result *r = ctx;
    int i;
    double k, p;
    /* a line out of order is left out, and the counts say so */
    if (sscanf(line, "STEP %d kpl=%lf torch=%lf", &i, &k, &p) == 3) {
        if (curve_put(&r->kpl, i, k)) curve_put(&r->ref, i, p);
    } else if (sscanf(line, "CTL %d loss=%lf", &i, &p) == 2) {
        curve_put(&r->ctl, i, p);
    } else if (!strncmp(line, "EVAL weights=kpl ", 17)) {
        sscanf(line + 17, "metric=%lf second=%lf", &r->kpl_eval, &r->kpl_second);
    } else if (!strncmp(line, "EVAL weights=torch ", 19)) {
        sscanf(line + 19, "metric=%lf second=%lf seconds=%lf", &r->ref_eval, &r->ref_second,
               &r->ref_s);
    } else if (!strncmp(line, "EVAL weights=control ", 21)) {
        sscanf(line + 21, "metric=%lf second=%lf", &r->ctl_eval, &r->ctl_second);
    } else if (!strncmp(line, "META ", 5)) {
        char v[48] = "";
        sscanf(line + 5, "torch=%47s isa=%63s", v, r->ref_isa);
        snprintf(r->ref_name, sizeof r->ref_name, "torch %s", v);
    }
}

/* "[v0,v1,...]" of n numbers (null for NaN), malloc'd. */
static char *jarray(const double *v, int n)
{
    size_t cap = 3 + (size_t)n * (BENCH_NUM_LEN + 1), at = 0;
    char *s = malloc(cap), num[BENCH_NUM_LEN];
    if (!s) die("memory");
    s[at++] = '[';
    for (int i = 0; i < n; i++) {
        char one[BENCH_NUM_LEN];
        snprintf(one, sizeof one, "%.6g", v[i]);
        at += (size_t)snprintf(s + at, cap - at, "%s%s", i ? "," : "",
                               isfinite(v[i]) ? one : bench_jnum(num, NAN));
    }
    snprintf(s + at, cap - at, "]");
    return s;
}

/* The last tenth of the steps (at least one): [n - k, n). */
static int tail_from(int n) { return n - (n / 10 > 0 ? n / 10 : 1); }

static double tail_mean(const curve *c)
{
    double s = 0;
    int m = 0;
    for (int i = tail_from(c->n); i < c->n; i++)
        if (i >= 0 && isfinite(c->v[i])) s += c->v[i], m++;
    return m ? s / m : NAN;
}

/* Mean of |a - b| / |b| over the last tenth of the steps: how far two
 * curves are apart at the end (NAN when either is short). */
static double tail_gap(const curve *a, const curve *b)
{
    if (a->n != b->n || !a->n) return NAN;
    double s = 0;
    int m = 0;
    for (int i = tail_from(a->n); i < a->n; i++)
        if (isfinite(a->v[i]) && isfinite(b->v[i]) && b->v[i] != 0)
            s += fabs(a->v[i] - b->v[i]) / fabs(b->v[i]), m++;
    return m ? s / m : NAN;
}

static void mkdirs(const char *path)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", path);
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_parity: cannot make %s\n", path);
        exit(1);
    }
}

/* What kpl's side of a case leaves for the rest: the recipe (its optimizer
 * settings go to PyTorch), the steps, the seconds of the fit, the threads. */
typedef struct {
    kpl_recipe r;
    int64_t steps;
    double seconds;
    int threads;
} kpl_side;

/* kpl's run of case c in dir (the set made once per size under work):
 * the fit through the wrapped task, the batches and the weights written. */
static void run_kpl(const parity_case *c, const char *root, const char *kpl, const char *work,
                    const char *dir, int ntrain, int nval, int epochs, kpl_side *k)
{
    char data[2048], cmd[8192], path[2200];
    snprintf(data, sizeof data, "%s/data-%s-%d-%d", work, c->set, ntrain, nval);
    mkdirs(dir);
    /* the set, once per size */
    snprintf(path, sizeof path, "%s/.done", data);
    struct stat sb;
    if (stat(path, &sb) != 0) {
        snprintf(cmd, sizeof cmd,
                 "rm -rf '%s' && '%s' data synth %s '%s' --train %d --val %d --quiet >&2 && "
                 "touch '%s/.done'", data, kpl, c->set, data, ntrain, nval, data);
        fprintf(stderr, "bench_parity: %s\n", cmd);
        if (system(cmd) != 0) {
            fprintf(stderr, "bench_parity: kpl data synth failed\n");
            exit(1);
        }
    }
    /* kpl's run, from nothing each time */
    snprintf(cmd, sizeof cmd, "rm -rf '%s/run'", dir);
    if (system(cmd) != 0) exit(1);
    char o_root[2100], o_src[2100], o_run[2100], o_epochs[64], o_eval[64];
    snprintf(o_root, sizeof o_root, "data.root=%s", data);
    snprintf(o_src, sizeof o_src, "data.convert.source=%s", data);
    snprintf(o_run, sizeof o_run, "run_dir=%s/run", dir);
    snprintf(o_epochs, sizeof o_epochs, "epochs=%d", epochs);
    snprintf(o_eval, sizeof o_eval, "eval.every_epochs=%d", epochs);
    const char *ov[] = {o_root, o_src, o_run, o_epochs, o_eval, "log.every_steps=1",
                        "log.progress=never", "checkpoint.keep_last=1", "deterministic=true"};
    snprintf(path, sizeof path, "%s/%s", root, c->recipe);
    if (kpl_recipe_load(path, (int)(sizeof ov / sizeof ov[0]), ov, &k->r) < 0) die(path);

    const kpl_task_kind *task = kpl_task_find(k->r.task);
    if (!task || !task->train_step || !task->eval_batch) {
        fprintf(stderr, "bench_parity: task %s has no train_step to wrap\n", k->r.task);
        exit(1);
    }
    kpl_task_kind wrapped = *task;
    wrapped.train_step = dump_train_step;
    wrapped.eval_batch = dump_eval_batch;
    wrapped.eval_end = dump_eval_end;
    memset(&dump, 0, sizeof dump);
    dump.task = task;
    snprintf(path, sizeof path, "%s/train.bin", dir);
    dump.train = bench_file_open(path, PARITY_MAGIC);
    snprintf(path, sizeof path, "%s/val.bin", dir);
    dump.val = bench_file_open(path, PARITY_MAGIC);

    kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
    kpl_trainer *t = NULL;
    if (kpl_trainer_create(&k->r, &wrapped, &o, &t) < 0) die("kpl_trainer_create");
    snprintf(path, sizeof path, "%s/init.bin", dir);
    put_weights(t, path);
    k->threads = kpl_get_num_threads(); /* the trainer's (threads: 0 is every core) */
    fprintf(stderr, "bench_parity: %s: kpl trains %s (%d epoch%s of %d images)\n", c->name,
            c->recipe, epochs, epochs == 1 ? "" : "s", ntrain);
    double t0 = bench_now();
    if (kpl_trainer_fit(t) < 0) die("kpl_trainer_fit");
    k->seconds = bench_now() - t0;
    snprintf(path, sizeof path, "%s/kpl_final.bin", dir);
    put_weights(t, path);
    k->steps = kpl_trainer_steps(t);
    kpl_trainer_destroy(t);
    if (fclose(dump.train) || fclose(dump.val)) die("closing the batch files");
    if (k->steps < 1 || k->steps != dump.steps || !dump.vbatches) {
        fprintf(stderr, "bench_parity: %s: %lld steps but %lld batches written, %lld val "
                "batches\n", c->name, (long long)k->steps, (long long)dump.steps,
                (long long)dump.vbatches);
        exit(1);
    }
}

/* kpl's own evaluation: the last "val_<metric>" of its metrics.jsonl (NAN
 * when there is none). */
static double kpl_own_figure(const char *dir, const char *metric)
{
    char path[2200], line[8192], key[64];
    double v = NAN;
    snprintf(path, sizeof path, "%s/run/metrics.jsonl", dir);
    snprintf(key, sizeof key, "\"val_%s\":", metric);
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f)) {
        const char *at = strstr(line, key);
        if (at) v = strtod(at + strlen(key), NULL);
    }
    if (f) fclose(f);
    return v;
}

/* The case's JSON line. */
static void emit_row(const parity_case *c, const parity_result *res, const kpl_side *k, int epochs,
                     int ntrain, int nval)
{
    char *ka = jarray(res->kpl.v, res->kpl.n), *ra = jarray(res->ref.v, res->ref.n),
         *ca = jarray(res->ctl.v, res->ctl.n);
    char cas[128], n1[BENCH_NUM_LEN], n2[BENCH_NUM_LEN], n3[BENCH_NUM_LEN], n4[BENCH_NUM_LEN],
        n5[BENCH_NUM_LEN], n6[BENCH_NUM_LEN], n7[BENCH_NUM_LEN], n8[BENCH_NUM_LEN],
        n9[BENCH_NUM_LEN], n10[BENCH_NUM_LEN], n11[BENCH_NUM_LEN], n12[BENCH_NUM_LEN],
        n13[BENCH_NUM_LEN], n14[BENCH_NUM_LEN];
    snprintf(cas, sizeof cas, "%s/%lldsteps_%dimg/t%d", c->name, (long long)k->steps, ntrain,
             k->threads);
    bench_emit("parity", cas, c->metric, 1, res->kpl_eval, res->ref_eval, res->ref_name, NAN,
               ",\"ctl\":%s,\"kpl_own\":%s,\"kpl_%s\":%s,\"ref_%s\":%s,\"ctl_%s\":%s,"
               "\"steps\":%lld,\"epochs\":%d,\"train_images\":%d,\"val_images\":%d,"
               "\"loss_step1\":[%s,%s],\"loss_last_tenth\":[%s,%s,%s],"
               "\"loss_gap_last_tenth\":{\"kpl_ref\":%s,\"ctl_ref\":%s},"
               "\"kpl_fit_s\":%s,\"ref_train_s\":%s,\"kpl_math\":\"%s\",\"ref_isa\":\"%s\","
               "\"recipe\":\"%s\",\"kpl_loss\":%s,\"ref_loss\":%s,\"ctl_loss\":%s",
               bench_jnum(n1, res->ctl_eval), bench_jnum(n2, res->kpl_own), c->second,
               bench_jnum(n3, res->kpl_second), c->second, bench_jnum(n4, res->ref_second),
               c->second, bench_jnum(n5, res->ctl_second), (long long)k->steps, epochs, ntrain,
               nval, bench_jnum(n6, res->kpl.n ? res->kpl.v[0] : NAN),
               bench_jnum(n7, res->ref.n ? res->ref.v[0] : NAN),
               bench_jnum(n8, tail_mean(&res->kpl)), bench_jnum(n9, tail_mean(&res->ref)),
               bench_jnum(n10, tail_mean(&res->ctl)), bench_jnum(n11, tail_gap(&res->kpl, &res->ref)),
               bench_jnum(n12, tail_gap(&res->ctl, &res->ref)), bench_jnum(n13, k->seconds),
               bench_jnum(n14, res->ref_s), kpl_cpu_math_info(), res->ref_isa, c->recipe, ka, ra,
               ca);
    free(ka), free(ra), free(ca);
}

static int run_case(const parity_case *c, const char *bench_dir, const char *root, const char *kpl,
                    const char *work, int ntrain, int nval, int epochs, int control)
{
    char dir[2048], cmd[8192];
    snprintf(dir, sizeof dir, "%s/%s", work, c->name);
    kpl_side k;
    run_kpl(c, root, kpl, work, dir, ntrain, nval, epochs, &k);

    /* PyTorch on the same batches (and the control) */
    parity_result res;
    memset(&res, 0, sizeof res);
    res.kpl_eval = res.ref_eval = res.ctl_eval = NAN;
    res.kpl_second = res.ref_second = res.ctl_second = res.ref_s = NAN;
    snprintf(res.ref_name, sizeof res.ref_name, "torch");
    const kpl_recipe *r = &k.r;
    snprintf(cmd, sizeof cmd,
             "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 '%s/torch_parity.py' "
             "%s '%s' threads=%d betas=%.17g,%.17g eps=%.17g wd=%.17g no_decay=%d clip=%.17g "
             "control=%d %s",
             bench_dir, c->name, dir, k.threads, r->optimizer.config.beta1,
             r->optimizer.config.beta2, r->optimizer.config.eps, r->optimizer.config.weight_decay,
             r->optimizer.no_decay_bn_bias ? 1 : 0, r->optimizer.clip_grad_norm, control, c->torch);
    fprintf(stderr, "bench_parity: %s\n", cmd);
    int rc = bench_run_lines(cmd, ref_line, &res);
    res.kpl_own = kpl_own_figure(dir, c->metric);

    int fail = 0, n = res.kpl.n;
    int64_t steps = k.steps;
    if (rc == 0 && (n != steps || res.ref.n != steps || (control && res.ctl.n != steps))) {
        fprintf(stderr, "bench_parity: %s: PyTorch reported %d, %d (control) steps of %lld\n",
                c->name, res.ref.n, res.ctl.n, (long long)steps);
        bench_ref_failures++, rc = -1;
    }
    if (rc == 0) {
        double k1 = res.kpl.v[0], r1 = res.ref.v[0];
        if (!(fabs(k1 - r1) / fmax(fabs(r1), 1e-12) <= PARITY_STEP1_RTOL)) {
            fprintf(stderr, "bench_parity: FAIL: %s: the first step's losses differ (kpl %.9g, "
                    "PyTorch %.9g): the two sides do not start from the same weights and batch\n",
                    c->name, k1, r1);
            fail = 1;
        }
        if (!(fabs(res.kpl_eval - res.kpl_own) <= PARITY_EVAL_ATOL)) {
            fprintf(stderr, "bench_parity: FAIL: %s: the Python evaluator gives kpl's weights %s "
                    "%.6g, kpl's own evaluation %.6g\n", c->name, c->metric, res.kpl_eval,
                    res.kpl_own);
            fail = 1;
        }
        fprintf(stderr, "bench_parity: %s loss curves (step: kpl, PyTorch%s)\n", c->name,
                control ? ", control" : "");
        int every = n > 40 ? n / 20 : 1;
        for (int i = 0; i < n; i++)
            if (i % every == 0 || i == n - 1) {
                fprintf(stderr, "  %5d  %9.5f  %9.5f", i + 1, res.kpl.v[i], res.ref.v[i]);
                if (control) fprintf(stderr, "  %9.5f", res.ctl.v[i]);
                fprintf(stderr, "\n");
            }
    }
    emit_row(c, &res, &k, epochs, ntrain, nval);
    free(res.kpl.v), free(res.ref.v), free(res.ctl.v);
    return fail;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: bench_parity BENCH_DIR ROOT KPL WORK_DIR [--cases fcos,unet] "
                "[--train N] [--val N] [--epochs E] [--control 0|1]\n");
        return 2;
    }
    const char *which = "fcos,unet";
    int ntrain = 800, nval = 200, epochs = 4, control = 1;
    for (int i = 5; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_parity: %s needs a value\n", a);
            return 2;
        }
        char *end = NULL;
        long n = strtol(v, &end, 10);
        bool num_ok = end && end != v && !*end && n > 0 && n <= 1000000;
        bool flag_ok = end && end != v && !*end && (n == 0 || n == 1);
        if (!strcmp(a, "--cases")) which = v;
        else if (!strcmp(a, "--train") && num_ok) ntrain = (int)n;
        else if (!strcmp(a, "--val") && num_ok) nval = (int)n;
        else if (!strcmp(a, "--epochs") && num_ok) epochs = (int)n;
        else if (!strcmp(a, "--control") && flag_ok) control = (int)n;
        else {
            fprintf(stderr, "bench_parity: bad option %s %s\n", a, v);
            return 2;
        }
        i++;
    }
    /* every name in --cases must be a case */
    for (const char *p = which; *p;) {
        size_t len = strcspn(p, ",");
        bool known = false;
        for (int k = 0; k < NCASES; k++)
            known |= len == strlen(cases[k].name) && !strncmp(p, cases[k].name, len);
        if (!known) {
            fprintf(stderr, "bench_parity: --cases: unknown case '%.*s' (cases: fcos, unet)\n",
                    (int)len, p);
            return 2;
        }
        p += len + (p[len] == ',');
    }
    int fail = 0, ran = 0;
    for (int k = 0; k < NCASES; k++) {
        size_t n = strlen(cases[k].name);
        const char *at = strstr(which, cases[k].name);
        bool listed = false;
        for (; at; at = strstr(at + 1, cases[k].name))
            if ((at == which || at[-1] == ',') && (at[n] == 0 || at[n] == ','))
                listed = true;
        if (!listed) continue;
        ran++;
        fail |= run_case(&cases[k], argv[1], argv[2], argv[3], argv[4], ntrain, nval, epochs,
                         control);
    }
    if (!ran) {
        fprintf(stderr, "bench_parity: no case in '%s' (cases: fcos, unet)\n", which);
        return 2;
    }
    return fail ? 1 : bench_exit_code();
}
