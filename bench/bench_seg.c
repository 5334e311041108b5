/*
 * bench_seg.c — `bench/run.sh seg`: the zoo's segmentation networks
 * (trainer/nn/segnets.c) next to the same networks written by hand in
 * PyTorch (bench/torch_segnets.py; torchvision is not installed here).
 *
 *   bench_seg BENCH_DIR WORK_DIR [--cases unet,deeplab] [--unet-batch 8]
 *             [--unet-size 128] [--unet-width 16] [--deeplab-batch 2]
 *             [--deeplab-size 513]
 *
 * Two cases:
 *  - unet: U-Net of width 16 and depth 4 (transposed convolutions), 1
 *    input channel, 11 classes, batch 8 of 128 x 128;
 *  - deeplab: DeepLabv3 on a ResNet-18 at output stride 16, ASPP of 256
 *    at rates 6, 12, 18, the aux head, 21 classes, batch 2 of 513 x 513
 *    crops (the VOC recipe's batch of 16 on 8 ranks).
 * For each, the C side builds the model from a seed and writes every
 * parameter and buffer (dotted name, shape, f32 data), the images, the
 * labels and its outputs of one training-mode forward (dropouts off) to
 * WORK_DIR/seg_<case>.bin; the Python side builds the same module tree,
 * checks every name and shape, loads them, and compares its forward and
 * loss (exit 1 past SEG_RTOL).  Then, in rounds that alternate which side
 * goes first (KPL_BENCH_ROUNDS, default 5; medians reported), with 2
 * threads on both sides, PyTorch in both its CPU layouts each round (NCHW
 * and channels_last; a row takes the faster layout's median and names it;
 * its peak RSS is NCHW's):
 *  - seg/<case>_train_step: ms of a training step: forward, per-pixel
 *    cross entropy with ignore_index 255 (the aux head's added at weight
 *    0.5), backward, SGD momentum 0.9 with weight decay 1e-4; both sides
 *    take the loss of the (N, C, H, W) logits as they are.  Target kpl
 *    >= 1.2x faster.  The phases
 *    (forward, loss, backward, optimizer step) are timed too.
 *  - seg/<case>_infer_b1: ms of one forward of the first image in
 *    evaluation mode without gradients.
 *  - seg/<case>_infer_exec_b1: the same forward by kpl's inference
 *    executor (the model traced in eval mode, level-3 passes and the
 *    inference fusions, as `kpl export` writes it; layout tuning done in
 *    the warm-up) against the same PyTorch row.  Target >= 1.3.
 *  - seg/<case>_train_step/peak_rss: the memory of SEG_MEM_STEPS training
 *    steps, measured alike for both in a fresh process each (kpl: this
 *    program with --mem; PyTorch: torch_segnets.py mem): the growth of the
 *    peak resident set over the resident set once the model and the batch
 *    are loaded (the peak reset there through /proc/self/clear_refs).
 *    Target kpl <= 0.8x (ratio >= 1.25).  kpl's allocator peak is
 *    reported beside it.
 * Each round starts both sides from the initial weights and a fresh
 * optimizer.
 * A third case, `ops`, times the ops kpl fuses for these models alone
 * against the same calls in PyTorch (bench/torch_segops.py, torchvision's
 * sigmoid_focal_loss), forward and forward + backward (the gradients of
 * every input that takes one), median of 5 runs a round:
 * seg_ops/resize (8, 21, 64, 64) -> 512 x 512, concat of two (8, 128, 64,
 * 64), cross_entropy over (8, 21, 256, 256) with 5% 255 labels (mean),
 * group_norm (8, 256, 32, 32) in 32 groups with affine, focal (16384, 80)
 * logits with one-hot rows at every tenth location (alpha 0.25, gamma 2,
 * sum).  The reference runs with OPENBLAS_CORETYPE and
 * OPENBLAS_L2_SIZE unset (../shared/DESIGN.md, "Benchmarks and figures").
 */
#include "bench_common.h"
#include "kernels_impl.h"
#include "bench_file.h"
#include "bench_snapshot.h"
#include "bench_zoo.h"
#include "trainer.h"
#include "vision.h"

#include <stdint.h>

#include "bench_seg.h"

#define SEG_LR 0.01
#define SEG_MOMENTUM 0.9
#define SEG_WEIGHT_DECAY 1e-4
#define SEG_AUX_WEIGHT 0.5
#define SEG_IGNORE 255
#define SEG_IGNORE_FRACTION 0.05 /* labels 255 (VOC's borders) */
/* How far the forward outputs and the loss of kpl and PyTorch may be
 * apart, relative to the largest output / the loss. */
#define SEG_RTOL 1e-3
#define SEG_MEM_STEPS 2

static void die(const char *what)
{
    fprintf(stderr, "bench_seg: %s: %s\n", what, kpl_last_error());
    exit(1);
}

/* One benchmarked network and its batch. */
typedef struct {
    const char *name; /* "unet", "deeplab" */
    char tag[64];     /* the case's name in the rows */
    kpl_model_config mc;
    int64_t batch, size;
    int train_warm, train_steps, infer_warm, infer_steps;
    char torch_args[512]; /* KEY=VALUE for torch_segnets.py */
} seg_case;

static void make_case(seg_case *c, const char *name, int64_t batch, int64_t size, int64_t width)
{
    memset(c, 0, sizeof *c);
    c->name = name, c->batch = batch, c->size = size;
    if (bench_seg_config(name, size, width, &c->mc, c->tag, sizeof c->tag) < 0) die("model config");
    if (!strcmp(name, "unet")) {
        snprintf(c->torch_args, sizeof c->torch_args,
                 "model=unet depth=4 width=%lld in_channels=1 classes=11 upsample=transpose",
                 (long long)width);
        c->train_warm = 2, c->train_steps = 5, c->infer_warm = 2, c->infer_steps = 10;
    } else {
        snprintf(c->torch_args, sizeof c->torch_args,
                 "model=deeplabv3 depth=18 width=64 in_channels=3 classes=21 output_stride=16 "
                 "rates=6,12,18 aspp=256 aux=1");
        c->train_warm = 1, c->train_steps = 3, c->infer_warm = 1, c->infer_steps = 3;
    }
}

/* ---- the batch ------------------------------------------------------------------------------ */

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct {
    kpl_tensor *images; /* (N, C, H, W) */
    kpl_tensor *image0; /* (1, C, H, W): the first image */
    kpl_tensor *labels; /* (N H W) i64: class per pixel, or SEG_IGNORE */
    float *flabels;     /* the same as f32, for the file */
} seg_batch;

/* Images N(0, 1); labels in 8 x 8 pixel blocks (regions, as masks have),
 * a few of them SEG_IGNORE. */
static void make_batch(seg_batch *b, const seg_case *c)
{
    kpl_device *cpu = kpl_device_cpu();
    int64_t C = c->mc.in_channels, H = c->size, W = c->size, N = c->batch;
    kpl_rng *rng = kpl_rng_create(SEG_SEED);
    if (!rng) die("rng");
    b->images = kpl_randn(cpu, KPL_F32, 4, (int64_t[]){N, C, H, W}, rng, 0, 1);
    b->image0 = kpl_empty(cpu, KPL_F32, 4, (int64_t[]){1, C, H, W});
    b->labels = kpl_empty(cpu, KPL_I64, 1, (int64_t[]){N * H * W});
    b->flabels = malloc(sizeof(float) * (size_t)(N * H * W));
    if (!b->images || !b->image0 || !b->labels || !b->flabels) die("batch");
    kpl_tensor_retain(b->images);
    kpl_tensor_retain(b->image0);
    kpl_tensor_retain(b->labels);
    memcpy(kpl_tensor_host_mutable(b->image0), kpl_tensor_host_data(b->images),
           sizeof(float) * (size_t)(C * H * W));
    int64_t *lab = kpl_tensor_host_mutable(b->labels);
    uint64_t st = SEG_SEED;
    int64_t bw = (W + 7) / 8, bh = (H + 7) / 8, classes = c->mc.num_classes;
    int64_t *blk = malloc(sizeof(int64_t) * (size_t)(N * bh * bw));
    if (!blk) die("labels");
    for (int64_t i = 0; i < N * bh * bw; i++) {
        double u = (double)(splitmix(&st) >> 11) * 0x1.0p-53;
        blk[i] = u < SEG_IGNORE_FRACTION ? SEG_IGNORE : (int64_t)(splitmix(&st) % (uint64_t)classes);
    }
    for (int64_t n = 0; n < N; n++)
        for (int64_t y = 0; y < H; y++)
            for (int64_t x = 0; x < W; x++) {
                int64_t i = (n * H + y) * W + x;
                lab[i] = blk[(n * bh + y / 8) * bw + x / 8];
                b->flabels[i] = (float)lab[i];
            }
    free(blk);
    kpl_rng_destroy(rng);
}

static void free_batch(seg_batch *b)
{
    kpl_tensor_release(b->images);
    kpl_tensor_release(b->image0);
    kpl_tensor_release(b->labels);
    free(b->flabels);
}

/* ---- the file the reference reads: bench_file.h's, magic "KPLSEG1"; names
 * "p:<param>", "b:<buffer>", "in:images", "in:labels", "out:<i>". */

/* ---- the model and its step --------------------------------------------------------------- */

static kpl_module *make_model(const seg_case *c)
{
    kpl_module *m = NULL;
    if (kpl_zoo_create(&c->mc, kpl_device_cpu(), SEG_SEED, &m) < 0) die("model");
    return m;
}

static void dropouts_off(kpl_module *m)
{
    if (!strcmp(kpl_module_kind_of(m)->name, "dropout")) kpl_module_set_training(m, false);
    for (int i = 0; i < kpl_module_num_children(m); i++) dropouts_off(kpl_module_child(m, i));
}

/* Per-pixel cross entropy of logits (N, C, H, W) against labels (N H W),
 * viewed as (N, H, W) as the segmentation task gives them. */
static kpl_tensor *pixel_ce(kpl_tensor *logits, kpl_tensor *labels)
{
    const int64_t *s = kpl_tensor_shape(logits);
    int64_t nhw[3] = {s[0], s[2], s[3]};
    return kpl_cross_entropy(logits, kpl_reshape(labels, 3, nhw), KPL_REDUCE_MEAN, 0, SEG_IGNORE);
}

static kpl_tensor *seg_loss(const kpl_tensor_list *out, kpl_tensor *labels)
{
    kpl_tensor *loss = pixel_ce(out->t[0], labels);
    if (out->n > 1)
        loss = kpl_add(loss, kpl_scalar_op(KPL_BIN_MUL, pixel_ce(out->t[1], labels), SEG_AUX_WEIGHT,
                                           false));
    return loss;
}

enum { PH_FWD, PH_LOSS, PH_BWD, PH_STEP, PH_N };

static double train_step(kpl_module *m, kpl_optim *opt, const seg_batch *b, double ph[PH_N],
                         double *loss_out)
{
    double t0 = bench_now();
    kpl_pool *p = kpl_pool_push(), *fw = kpl_pool_push();
    kpl_tensor_list in = {1, {b->images}}, out;
    if (kpl_module_forward_list(m, &in, &out) < 0) die("forward");
    double t1 = bench_now();
    kpl_tensor *loss = seg_loss(&out, b->labels);
    if (!loss) die("loss");
    kpl_tensor_get(loss, 0, loss_out);
    kpl_tensor_retain(loss);
    kpl_pool_pop(fw); /* saved activations now die as backward goes */
    double t2 = bench_now();
    if (kpl_backward(loss, NULL, false) < 0) die("backward");
    kpl_tensor_release(loss);
    double t3 = bench_now();
    if (kpl_optim_step(opt) < 0) die("sgd step");
    kpl_pool_pop(p);
    double t4 = bench_now();
    ph[PH_FWD] = (t1 - t0) * 1e3, ph[PH_LOSS] = (t2 - t1) * 1e3;
    ph[PH_BWD] = (t3 - t2) * 1e3, ph[PH_STEP] = (t4 - t3) * 1e3;
    return (t4 - t0) * 1e3;
}

static double infer(kpl_module *m, kpl_tensor *x)
{
    double t0 = bench_now();
    kpl_pool *p = kpl_pool_push();
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor_list in = {1, {x}}, out;
    if (kpl_module_forward_list(m, &in, &out) < 0) die("inference");
    kpl_set_grad_enabled(prev);
    kpl_pool_pop(p);
    return (bench_now() - t0) * 1e3;
}

/* The model's inference graph (traced in eval mode on x, the level-3
 * passes and the inference fusions, as `kpl export` makes it) run by the
 * executor: median ms of `steps` runs after EXEC_WARM, which covers the
 * executor's layout tuning (kpl_exec_run: at most 27 runs). */
#define EXEC_WARM 27

static double exec_infer(kpl_module *m, kpl_tensor *x, int steps)
{
    kpl_pool *p = kpl_pool_push();
    bool prev = kpl_set_grad_enabled(false);
    kpl_ir *ir = NULL;
    kpl_exec *ex = NULL;
    if (kpl_trace_begin() < 0) die("trace");
    kpl_tensor_list in = {1, {kpl_trace_input(x, "image")}}, out;
    if (kpl_module_forward_list(m, &in, &out) < 0 ||
        kpl_trace_end(1, &out.t[0], (const char *[]){"logits"}, &ir) < 0)
        die("trace");
    kpl_pool_pop(p);
    if (kpl_ir_optimize(ir, 3, true) < 0 || kpl_exec_create(ir, &ex) < 0) die("executor");
    double t[64];
    if (steps > 64) steps = 64;
    for (int i = 0; i < EXEC_WARM + steps; i++) {
        double t0 = bench_now();
        if (kpl_exec_set_input(ex, 0, x) < 0 || kpl_exec_run(ex) < 0) die("executor run");
        (void)kpl_tensor_host_data(kpl_exec_output(ex, 0));
        if (i >= EXEC_WARM) t[i - EXEC_WARM] = (bench_now() - t0) * 1e3;
    }
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    kpl_set_grad_enabled(prev);
    return bench_median(t, steps);
}

static kpl_optim *make_optim(kpl_module *m)
{
    return bench_sgd(m, SEG_LR, SEG_MOMENTUM, SEG_WEIGHT_DECAY);
}

/* ---- memory ----------------------------------------------------------------------------------- */

/* --mem: SEG_MEM_STEPS training steps in this fresh process, then the MEM
 * line torch_segnets.py prints too. */
static int mem_main(const seg_case *c, bool recompute)
{
    seg_batch b;
    kpl_pool *top = kpl_pool_push();
    make_batch(&b, c);
    kpl_module *m = make_model(c);
    if (recompute && kpl_module_recompute_units(m, true, NULL) < 0) die("recompute");
    kpl_optim *opt = make_optim(m);
    kpl_module_set_training(m, true);
    bench_mem_run run = bench_mem_begin();
    for (int i = 0; i < SEG_MEM_STEPS; i++) {
        double ph[PH_N], loss;
        train_step(m, opt, &b, ph, &loss);
    }
    bench_mem_end(&run);
    kpl_optim_destroy(opt);
    kpl_module_destroy(m);
    free_batch(&b);
    kpl_pool_pop(top);
    return 0;
}

/* ---- the reference's output ------------------------------------------------------------------ */

typedef struct {
    double loss, out_abs, out_rel;
    int names;
} ref_check;

static void check_line(const char *line, void *ctx)
{
    ref_check *r = ctx;
    if (!strncmp(line, "CHECK ", 6))
        sscanf(line, "CHECK names=%d loss=%lf out_max_abs=%lf out_max_rel=%lf", &r->names,
               &r->loss, &r->out_abs, &r->out_rel);
}

typedef struct {
    double train, ph[PH_N], infer, last;
} ref_times;

static void time_line(const char *line, void *ctx)
{
    ref_times *r = ctx;
    if (!strncmp(line, "TRAIN ", 6))
        sscanf(line, "TRAIN ms=%lf fwd=%lf loss=%lf bwd=%lf step=%lf last=%lf", &r->train,
               &r->ph[0], &r->ph[1], &r->ph[2], &r->ph[3], &r->last);
    else if (!strncmp(line, "INFER ", 6))
        sscanf(line, "INFER ms=%lf", &r->infer);
}

static const char *jlist(char *buf, size_t len, const double *v, int n)
{
    size_t off = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < n && off < len; i++) {
        char nb[BENCH_NUM_LEN];
        off += (size_t)snprintf(buf + off, len - off, "%s%s", i ? "," : "", bench_jnum(nb, v[i]));
    }
    if (off < len) snprintf(buf + off, len - off, "]");
    return buf;
}

/* ---- one case ------------------------------------------------------------------------------- */

static int rounds;
/* The reference runs in both of PyTorch's CPU layouts each round; a row
 * takes the faster one's median and names it. */
static const char *const layouts[2] = {"nchw", "channels_last"};

/* One kpl round: the training steps from the initial weights (median ms
 * and phases, the last loss), then inference of the first image (median
 * ms).  1 when the loss is not finite. */
static int kpl_round(const seg_case *c, kpl_module *m, const seg_batch *b, snapshot *init,
                     double *train, double ph_out[PH_N], double *inf, double *inf_exec,
                     double *last)
{
    double t[16], ph[PH_N][16], loss = NAN;
    snapshot_restore(init);
    kpl_optim *opt = make_optim(m);
    kpl_module_set_training(m, true);
    for (int i = 0; i < c->train_warm + c->train_steps; i++) {
        double one[PH_N], ms = train_step(m, opt, b, one, &loss);
        if (i >= c->train_warm) {
            t[i - c->train_warm] = ms;
            for (int k = 0; k < PH_N; k++) ph[k][i - c->train_warm] = one[k];
        }
        if (!isfinite(loss)) {
            fprintf(stderr, "bench_seg: kpl's loss is not finite (%g)\n", loss);
            kpl_optim_destroy(opt);
            return 1;
        }
    }
    *train = bench_median(t, c->train_steps);
    for (int k = 0; k < PH_N; k++) ph_out[k] = bench_median(ph[k], c->train_steps);
    kpl_optim_destroy(opt);
    *last = loss;
    kpl_module_set_training(m, false);
    double t1[16];
    for (int i = 0; i < c->infer_warm + c->infer_steps; i++) {
        double ms = infer(m, b->image0);
        if (i >= c->infer_warm) t1[i - c->infer_warm] = ms;
    }
    *inf = bench_median(t1, c->infer_steps);
    *inf_exec = exec_infer(m, b->image0, c->infer_steps);
    return 0;
}

/* One PyTorch round in `layout` (a fresh process); NaNs when it failed. */
static ref_times torch_round(const seg_case *c, const char *py, const char *args,
                             const char *layout)
{
    char cmd[4096];
    ref_times one = {NAN, {NAN, NAN, NAN, NAN}, NAN, NAN};
    snprintf(cmd, sizeof cmd, "%s time %s train=%d,%d infer=%d,%d layout=%s", py, args,
             c->train_warm, c->train_steps, c->infer_warm, c->infer_steps, layout);
    if (bench_run_lines(cmd, time_line, &one) == 0 && (isnan(one.train) || isnan(one.infer))) {
        fprintf(stderr, "bench_seg: no TRAIN/INFER lines from: %s\n", cmd);
        bench_ref_failures++;
    }
    return one;
}

/* Which layout's rounds (ms[0] NCHW, ms[1] channels_last) have the lower
 * median, and the reference's name saying so. */
static int faster_layout(double ms[2][64], char *name, size_t len)
{
    double m0 = bench_median(ms[0], rounds), m1 = bench_median(ms[1], rounds);
    int l = m1 < m0;
    snprintf(name, len, "torch-cpu-f32-%s (the faster of nchw %.2f and channels_last %.2f ms; "
             "same network by hand)", layouts[l], m0, m1);
    return l;
}

/* The inference rows: kpl's eager forward (ki) and its executor (kx, what
 * `kpl infer` runs) against the same PyTorch eager forward (ri, iname's
 * layout), medians of the rounds. */
static void infer_rows(const char *tag, int64_t S, double *ki, double *kx, double *ri,
                       const char *iname)
{
    char kr[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN], cas[128];
    bench_jrange(kr, ki, rounds);
    bench_jrange(rr, ri, rounds);
    snprintf(cas, sizeof cas, "%s_infer_b1_%lld/t%d", tag, (long long)S, SEG_THREADS);
    bench_emit("seg", cas, "ms", 0, bench_median(ki, rounds), bench_median(ri, rounds), iname,
               NAN, ",\"threads\":%d,\"rounds\":%d,\"kpl_range\":%s,\"ref_range\":%s", SEG_THREADS,
               rounds, kr, rr);
    bench_jrange(kr, kx, rounds);
    snprintf(cas, sizeof cas, "%s_infer_exec_b1_%lld/t%d", tag, (long long)S, SEG_THREADS);
    bench_emit("seg", cas, "ms", 0, bench_median(kx, rounds), bench_median(ri, rounds), iname,
               1.3, ",\"kpl_side\":\"executor (traced, O3, inference fusions, tuned layout)\","
               "\"threads\":%d,\"rounds\":%d,\"kpl_range\":%s,\"ref_range\":%s",
               SEG_THREADS, rounds, kr, rr);
}

static int run_case(const seg_case *c, const char *bench_dir, const char *work, const char *self,
                    const char *argtail)
{
    seg_batch b;
    kpl_pool *top = kpl_pool_push();
    make_batch(&b, c);
    kpl_module *m = make_model(c);
    int64_t N = c->batch, S = c->size;
    fprintf(stderr, "bench_seg: %s: %lld parameters, batch %lld of %lldx%lld\n", c->tag,
            (long long)kpl_module_param_count(m), (long long)N, (long long)S, (long long)S);

    /* the file: weights, batch, then kpl's outputs of one training-mode
     * forward without dropout (which moves the running statistics: the
     * snapshot puts them back) */
    char path[512];
    snprintf(path, sizeof path, "%s/seg_%s.bin", work, c->name);
    static snapshot init;
    snapshot_take(&init, m);
    FILE *f = bench_file_open(path, "KPLSEG1");
    bench_put_module(f, "p:", "b:", m);
    bench_put_tensor(f, "in:", "images", b.images);
    bench_put_entry(f, "in:labels", 3, (int64_t[]){N, S, S}, b.flabels);
    double kloss = NAN;
    {
        kpl_pool *p = kpl_pool_push();
        bool prev = kpl_set_grad_enabled(false);
        kpl_module_set_training(m, true);
        dropouts_off(m);
        kpl_tensor_list in = {1, {b.images}}, out;
        if (kpl_module_forward_list(m, &in, &out) < 0) die("forward");
        kpl_tensor *loss = seg_loss(&out, b.labels);
        if (!loss) die("loss");
        kpl_tensor_get(loss, 0, &kloss);
        for (int i = 0; i < out.n; i++) {
            char name[16];
            snprintf(name, sizeof name, "%d", i);
            bench_put_tensor(f, "out:", name, out.t[i]);
        }
        kpl_set_grad_enabled(prev);
        kpl_pool_pop(p);
    }
    if (fclose(f) != 0) die("closing the file");
    kpl_module_set_training(m, true); /* dropouts back on */
    snapshot_restore(&init);

    char py[1024], args[2048], cmd[4096];
    snprintf(py, sizeof py,
             "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=%d /usr/bin/python3 "
             "%s/torch_segnets.py",
             SEG_THREADS, bench_dir);
    snprintf(args, sizeof args, "%s threads=%d %s aux_weight=%g lr=%.17g momentum=%.17g wd=%.17g",
             path, SEG_THREADS, c->torch_args, SEG_AUX_WEIGHT, SEG_LR, SEG_MOMENTUM,
             SEG_WEIGHT_DECAY);
    ref_check rc = {NAN, NAN, NAN, 0};
    snprintf(cmd, sizeof cmd, "%s check %s", py, args);
    if (bench_run_lines(cmd, check_line, &rc) == 0 && isnan(rc.loss)) {
        fprintf(stderr, "bench_seg: no CHECK line from: %s\n", cmd);
        bench_ref_failures++;
    }
    double loss_rel = fabs(kloss - rc.loss) / fmax(fabs(rc.loss), 1e-12);
    if (!isnan(rc.loss)) {
        fprintf(stderr, "bench_seg: %s: loss kpl %.7g torch %.7g (relative %.3g); outputs differ "
                "by %.3g (%.3g of the largest); %d tensors\n", c->tag, kloss, rc.loss, loss_rel,
                rc.out_abs, rc.out_rel, rc.names);
        if (!(loss_rel <= SEG_RTOL) || !(rc.out_rel <= SEG_RTOL)) {
            fprintf(stderr, "bench_seg: FAIL: kpl and PyTorch disagree past %g\n", SEG_RTOL);
            return 1;
        }
    }

    /* memory, each side in a fresh process */
    bench_mem_line km, rm;
    char kcmd[4096];
    snprintf(kcmd, sizeof kcmd, "OMP_NUM_THREADS=%d %s --mem %s %s", SEG_THREADS, self, c->name,
             argtail);
    snprintf(cmd, sizeof cmd, "%s mem %s what=train steps=%d", py, args, SEG_MEM_STEPS);
    if (bench_mem_pair("bench_seg", kcmd, cmd, &km, &rm)) return 1;
    fprintf(stderr, "bench_seg: %s: peak RSS growth over %d steps kpl %.0f MB (allocator peak "
            "%.0f MB), torch %.0f MB; peak RSS kpl %.0f MB, torch %.0f MB\n", c->tag,
            SEG_MEM_STEPS, km.growth / 1e6, km.alloc_peak / 1e6, rm.growth / 1e6, km.peak / 1e6,
            rm.peak / 1e6);

    /* memory.recompute: blocks at this batch and at twice it (target:
     * DeepLab at twice the batch in PyTorch's peak) */
    bench_mem_line kr1 = {NAN, NAN, NAN, NAN}, kr2 = {NAN, NAN, NAN, NAN};
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=%d %s --mem %s %s --recompute", SEG_THREADS, self,
             c->name, argtail);
    if (bench_run_lines(cmd, bench_mem_line_parse, &kr1) < 0 || isnan(kr1.growth)) {
        fprintf(stderr, "bench_seg: kpl's memory run failed: %s\n", cmd);
        return 1;
    }
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=%d %s --mem %s %s --%s-batch %lld --recompute",
             SEG_THREADS, self, c->name, argtail, c->name, 2 * (long long)c->batch);
    if (bench_run_lines(cmd, bench_mem_line_parse, &kr2) < 0 || isnan(kr2.growth)) {
        fprintf(stderr, "bench_seg: kpl's memory run failed: %s\n", cmd);
        return 1;
    }
    fprintf(stderr,
            "bench_seg: %s: with memory.recompute: blocks, peak RSS growth %.0f MB "
            "(allocator %.0f MB); at twice the batch %.0f MB (allocator %.0f MB)\n",
            c->tag, kr1.growth / 1e6, kr1.alloc_peak / 1e6, kr2.growth / 1e6, kr2.alloc_peak / 1e6);

    /* the timed rounds */
    double ktr[64], kph[PH_N][64], ki[64], kx[64], ltr[2][64], lph[2][PH_N][64], li[2][64];
    double klast = NAN, rlast = NAN;
    for (int r = 0; r < rounds; r++) {
        for (int side = 0; side < 2; side++) {
            if ((side + r) % 2 == 0) {
                double ph[PH_N];
                if (kpl_round(c, m, &b, &init, &ktr[r], ph, &ki[r], &kx[r], &klast)) return 1;
                for (int k = 0; k < PH_N; k++) kph[k][r] = ph[k];
            } else {
                for (int l = 0; l < 2; l++) {
                    ref_times one = torch_round(c, py, args, layouts[l]);
                    ltr[l][r] = one.train, li[l][r] = one.infer, rlast = one.last;
                    for (int k = 0; k < PH_N; k++) lph[l][k][r] = one.ph[k];
                }
            }
        }
        fprintf(stderr, "bench_seg: %s round %d: train kpl %.1f ms (fwd %.1f loss %.1f bwd %.1f "
                "step %.1f), torch nchw %.1f ms (fwd %.1f loss %.1f bwd %.1f step %.1f), "
                "channels_last %.1f ms; infer b1 kpl %.1f (executor %.1f) torch %.1f / %.1f\n",
                c->tag, r, ktr[r], kph[0][r], kph[1][r], kph[2][r], kph[3][r], ltr[0][r],
                lph[0][0][r], lph[0][1][r], lph[0][2][r], lph[0][3][r], ltr[1][r], ki[r], kx[r],
                li[0][r], li[1][r]);
    }
    /* the faster layout's figures, train and inference each */
    char tname[160], iname[160];
    int lt = faster_layout(ltr, tname, sizeof tname), lf = faster_layout(li, iname, sizeof iname);
    double *rtr = ltr[lt], *ri = li[lf], rph[PH_N][64];
    memcpy(rph, lph[lt], sizeof rph);

    char kr[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN], cas[128], n1[BENCH_NUM_LEN],
        n2[BENCH_NUM_LEN], n3[BENCH_NUM_LEN], n4[BENCH_NUM_LEN], n5[BENCH_NUM_LEN],
        n6[BENCH_NUM_LEN], pk[128], pr[128];
    double kphm[PH_N], rphm[PH_N];
    for (int k = 0; k < PH_N; k++)
        kphm[k] = bench_median(kph[k], rounds), rphm[k] = bench_median(rph[k], rounds);
    bench_jrange(kr, ktr, rounds);
    bench_jrange(rr, rtr, rounds);
    /* what each side's oneDNN ran: kpl's convolution cache, PyTorch's
     * convolutions in one training step of the faster layout, verbose */
    char kisa[48], kimpl[256], risa[96], rimpl[256], vcmd[4096];
    bench_kpl_isa(kisa, sizeof kisa);
    kpl__cpu_conv_impls(kimpl, sizeof kimpl);
    snprintf(vcmd, sizeof vcmd, "%s time %s train=0,1 infer=0,1 layout=%s", py, args, layouts[lt]);
    bench_onednn_run(vcmd, risa, sizeof risa, rimpl, sizeof rimpl);
    snprintf(cas, sizeof cas, "%s_train_step_b%lld_%lld/t%d", c->tag, (long long)N, (long long)S,
             SEG_THREADS);
    bench_emit("seg", cas, "ms", 0, bench_median(ktr, rounds), bench_median(rtr, rounds), tname,
               1.2,
               ",\"threads\":%d,\"rounds\":%d,\"kpl_range\":%s,\"ref_range\":%s,"
               "\"phases\":\"fwd,loss,bwd,step\",\"kpl_phases_ms\":%s,\"ref_phases_ms\":%s,"
               "\"loss_kpl\":%s,\"loss_ref\":%s,\"out_max_rel_diff\":%s,\"last_loss_kpl\":%s,"
               "\"last_loss_ref\":%s,\"kpl_loss\":\"kpl_cross_entropy on (N, C, H, W)\","
               "\"omp_wait_policy\":\"%s\",\"kpl_isa\":\"%s\",\"kpl_conv_impls\":\"%s\","
               "\"ref_isa\":\"%s\",\"ref_conv_impls\":\"%s\"",
               SEG_THREADS, rounds, kr, rr, jlist(pk, sizeof pk, kphm, PH_N),
               jlist(pr, sizeof pr, rphm, PH_N), bench_jnum(n1, kloss), bench_jnum(n2, rc.loss),
               bench_jnum(n3, rc.out_rel), bench_jnum(n4, klast), bench_jnum(n5, rlast),
               getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "unset", kisa,
               kimpl[0] ? kimpl : "none", risa, rimpl);
    snprintf(cas, sizeof cas, "%s_train_step_b%lld_%lld/peak_rss", c->tag, (long long)N,
             (long long)S);
    bench_emit("seg", cas, "bytes", 0, km.growth, rm.growth, "torch-cpu-f32 peak RSS growth", 1.25,
               ",\"measure\":\"peak RSS over %d training steps less the RSS with model and batch "
               "loaded, a fresh process per side, each field the median of KPL_BENCH_MEM_ROUNDS "
               "alternating runs\",\"kpl_peak_rss\":%s,\"ref_peak_rss\":%s,"
               "\"kpl_base_rss\":%s,\"ref_base_rss\":%s,\"kpl_allocator_peak\":%s",
               SEG_MEM_STEPS, bench_jnum(n1, km.peak), bench_jnum(n2, rm.peak),
               bench_jnum(n3, km.base), bench_jnum(n4, rm.base), bench_jnum(n6, km.alloc_peak));
    for (int k = 0; k < 2; k++) {
        const bench_mem_line *kr = k ? &kr2 : &kr1;
        snprintf(cas, sizeof cas, "%s_train_step_b%lld_%lld_recompute/peak_rss", c->tag,
                 (long long)N * (k + 1), (long long)S);
        bench_emit("seg", cas, "bytes", 0, kr->growth, rm.growth,
                   k ? "torch-cpu-f32 peak RSS growth at half the batch"
                     : "torch-cpu-f32 peak RSS growth",
                   k ? (strcmp(c->name, "deeplab") ? NAN : 1.0) : 1.25,
                   ",\"measure\":\"as the row without recomputation; kpl with memory.recompute: "
                   "blocks\",\"kpl_peak_rss\":%s,\"kpl_allocator_peak\":%s,\"ref_batch\":%lld",
                   bench_jnum(n1, kr->peak), bench_jnum(n6, kr->alloc_peak), (long long)N);
    }
    infer_rows(c->tag, S, ki, kx, ri, iname);
    snapshot_free(&init);
    kpl_module_destroy(m);
    free_batch(&b);
    kpl_pool_pop(top);
    return 0;
}

int main(int argc, char **argv)
{
    const char *usage =
        "usage: bench_seg BENCH_DIR WORK_DIR [--cases unet,deeplab,ops] "
        "[--unet-batch B] [--unet-size S] [--unet-width W] [--deeplab-batch B] "
        "[--deeplab-size S]\n       bench_seg --mem unet|deeplab [options] [--recompute]\n";
    int64_t ub = 8, us = 128, uw = 16, db = 2, ds = 513;
    const char *cases = "unet,deeplab,ops", *mem = NULL;
    bool recompute = false; /* --mem: with memory.recompute: blocks */
    const char *pos[2] = {NULL, NULL};
    int npos = 0;
    char tail[512] = "";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int64_t *dst = !strcmp(a, "--unet-batch")      ? &ub
                       : !strcmp(a, "--unet-size")     ? &us
                       : !strcmp(a, "--unet-width")    ? &uw
                       : !strcmp(a, "--deeplab-batch") ? &db
                       : !strcmp(a, "--deeplab-size")  ? &ds
                                                       : NULL;
        if (dst && i + 1 < argc) {
            *dst = atoll(argv[++i]);
            size_t l = strlen(tail);
            snprintf(tail + l, sizeof tail - l, " %s %s", a, argv[i]);
            if (*dst <= 0 || *dst > 4096) {
                fprintf(stderr, "bench_seg: %s %s out of range\n", a, argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--cases") && i + 1 < argc) {
            cases = argv[++i];
        } else if (!strcmp(a, "--mem") && i + 1 < argc) {
            mem = argv[++i];
        } else if (!strcmp(a, "--recompute")) {
            recompute = true;
        } else if (a[0] != '-' && npos < 2) {
            pos[npos++] = a;
        } else {
            fputs(usage, stderr);
            return 2;
        }
    }
    kpl_set_num_threads(SEG_THREADS);
    seg_case uc, dc;
    make_case(&uc, "unet", ub, us, uw);
    make_case(&dc, "deeplab", db, ds, 64);
    if (mem) {
        if (strcmp(mem, "unet") && strcmp(mem, "deeplab")) {
            fputs(usage, stderr);
            return 2;
        }
        return mem_main(!strcmp(mem, "unet") ? &uc : &dc, recompute);
    }
    if (npos != 2) {
        fputs(usage, stderr);
        return 2;
    }
    rounds = bench_env_int("KPL_BENCH_ROUNDS", 5, 1, 64);
    char self[1024];
    bench_self_path(self, sizeof self);
    if (strstr(cases, "unet") && run_case(&uc, pos[0], pos[1], self, tail)) return 1;
    if (strstr(cases, "deeplab") && run_case(&dc, pos[0], pos[1], self, tail)) return 1;
    if (strstr(cases, "ops")) bench_seg_ops(pos[0], rounds);
    return bench_exit_code();
}
