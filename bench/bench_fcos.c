/*
 * bench_fcos.c — `bench/run.sh fcos`: the zoo's FCOS with a ResNet-18
 * backbone (trainer/nn/fcos.c) and its losses (kpl__fcos_loss) next to the
 * same network and losses written by hand in PyTorch (bench/torch_fcos.py;
 * torchvision is not installed here).
 *
 *   bench_fcos BENCH_DIR WORK_DIR
 *
 * The C side builds the model from a seed and writes every parameter and
 * buffer (dotted name, shape, f32 data) and the inputs to
 * WORK_DIR/fcos_init.bin; the Python side builds the same module tree,
 * checks that every name and shape matches, and loads them, so both start
 * from the same weights and see the same batch.  Then:
 *  - check (once): one forward in training mode and the three losses on
 *    both sides.  The losses must agree to FCOS_LOSS_RTOL relative (else
 *    exit 1); the head's outputs are compared too (kpl writes them to
 *    WORK_DIR/fcos_kpl_out.bin), their largest difference is reported.
 *  - fcos/r18_train_step_b8_128/t2: ms of one training step (forward, the
 *    three losses with target assignment, backward, SGD momentum 0.9 with
 *    weight decay), batch 8 of 128x128 images, 2 threads, BN in training
 *    mode.  Target kpl >= 1.2x faster.  The phases (forward, losses,
 *    backward, optimizer step) are timed too.
 *  - fcos/r18_infer_b{1,8}_128/t2: ms of one forward in evaluation mode
 *    without gradients.
 *  - fcos/r18_train_step_b8_128/peak_rss: the growth of the peak resident
 *    memory over MEM_STEPS training steps, over the resident memory once
 *    the model, batch and optimizer are made (the peak reset there through
 *    /proc/self/clear_refs); each side in a fresh process (kpl: this
 *    program with --mem; PyTorch: torch_fcos.py mem).  Target kpl <=
 *    0.8x (ratio: PyTorch's / kpl's, >= 1.25).
 *  - fcos/r18_train_step_b8_128/peak_rss_keep16: the same with kpl's
 *    allocator keeping 16 MiB of free blocks resident past its high-water
 *    mark (KPL_ALLOC_KEEP_MB=16; the default keeps all), against the same
 *    PyTorch run; with the fastest step after the first of each kpl memory
 *    run (step_ms_keep16, step_ms_default: the price in page faults).
 * kpl (in this process) and PyTorch (a fresh process per round) alternate
 * over KPL_BENCH_ROUNDS rounds (default 5), which goes first alternating
 * too; medians reported.  Each round starts both from the initial weights
 * and a fresh optimizer, so both time the same steps; the losses of the
 * last step on both sides are reported (loss_step7_*).  The reference runs with OPENBLAS_CORETYPE
 * and OPENBLAS_L2_SIZE unset (../shared/DESIGN.md, "Benchmarks and figures").
 */
#include "bench_common.h"
#include "bench_file.h"
#include "bench_snapshot.h"
#include "fcos_impl.h"

#include <stdint.h>

/* The network and losses of recipes/detection/fcos_r18_fmnistdet.yaml
 * (keep these in step with it): its regression ranges are COCO's (64,
 * 128, 256, 512) scaled down by 4 for 128 x 128 images.  With this batch
 * they put the positives on P4-P6 (27, 51, 8), where COCO's would put
 * them all on P3-P4. */
#define FCOS_DEPTH 18
#define FCOS_CLASSES 10
#define FCOS_FPN_CHANNELS 128
#define FCOS_LEVELS 5
#define FCOS_HEAD_CONVS 4
#define FCOS_GN_GROUPS 32
#define FCOS_PRIOR_PROB 0.01
#define FCOS_RADIUS 1.5
#define FCOS_ALPHA 0.25
#define FCOS_GAMMA 2.0
static const double fcos_lo[FCOS_LEVELS] = {-1, 16, 32, 64, 128};
static const double fcos_hi[FCOS_LEVELS] = {16, 32, 64, 128, 1e8};
/* The step's optimizer */
#define FCOS_LR 0.01
#define FCOS_MOMENTUM 0.9
#define FCOS_WEIGHT_DECAY 1e-4
/* The inputs: a batch of BATCH images SIDE x SIDE, 1 to MAXB boxes each */
#define FCOS_BATCH 8
#define FCOS_SIDE 128
#define FCOS_MAXB 8
#define FCOS_THREADS 2
#define FCOS_SEED 1234
/* How far the losses of kpl and PyTorch may be apart, relative. */
#define FCOS_LOSS_RTOL 1e-3
/* Steps a round: warm-up, then timed (medians) */
#define TRAIN_WARM 2
#define TRAIN_STEPS 5
#define INFER8_WARM 1
#define INFER8_STEPS 5
#define INFER1_WARM 2
#define INFER1_STEPS 10
/* Training steps of a memory run */
#define MEM_STEPS 3

static void die(const char *what)
{
    fprintf(stderr, "bench_fcos: %s: %s\n", what, kpl_last_error());
    exit(1);
}

static int rounds;

/* ---- the file the reference reads ----------------------------------------------------------
 * bench_file.h's, magic "KPLFCOS1".  Names: "p:<param>", "b:<buffer>",
 * "in:<input>", "out:<output>". */

/* ---- the inputs ------------------------------------------------------------------------------ */

typedef struct {
    kpl_tensor *images; /* (B, 3, SIDE, SIDE) */
    kpl_tensor *image0; /* (1, 3, SIDE, SIDE): the first image, for the b1 case */
    float boxes[FCOS_BATCH * FCOS_MAXB * 4]; /* (B, MAXB, 4) x0 y0 x1 y1, zeros past nboxes */
    int64_t labels[FCOS_BATCH * FCOS_MAXB];  /* (B, MAXB) */
    int64_t nboxes[FCOS_BATCH];              /* (B) */
} batch;

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double uniform(uint64_t *s) { return (double)(splitmix(s) >> 11) * 0x1.0p-53; }

/* Images N(0, 1); per image 1 to MAXB boxes inside it, sides 20-90 px
 * (fractional coordinates, so no location sits exactly on an edge),
 * labels 0 .. classes - 1. */
static void make_batch(batch *b, kpl_rng *rng)
{
    kpl_device *cpu = kpl_device_cpu();
    int64_t s[4] = {FCOS_BATCH, 3, FCOS_SIDE, FCOS_SIDE}, s1[4] = {1, 3, FCOS_SIDE, FCOS_SIDE};
    b->images = kpl_randn(cpu, KPL_F32, 4, s, rng, 0, 1);
    b->image0 = kpl_empty(cpu, KPL_F32, 4, s1);
    if (!b->images || !b->image0) die("images");
    kpl_tensor_retain(b->images);
    kpl_tensor_retain(b->image0);
    memcpy(kpl_tensor_host_mutable(b->image0), kpl_tensor_host_data(b->images),
           sizeof(float) * 3 * FCOS_SIDE * FCOS_SIDE);
    memset(b->boxes, 0, sizeof b->boxes);
    memset(b->labels, 0, sizeof b->labels);
    uint64_t st = FCOS_SEED;
    for (int i = 0; i < FCOS_BATCH; i++) {
        b->nboxes[i] = 1 + (int64_t)(uniform(&st) * FCOS_MAXB);
        for (int64_t k = 0; k < b->nboxes[i]; k++) {
            float *g = b->boxes + 4 * (i * FCOS_MAXB + k);
            double w = 20 + 70 * uniform(&st), h = 20 + 70 * uniform(&st);
            g[0] = (float)(uniform(&st) * (FCOS_SIDE - w));
            g[1] = (float)(uniform(&st) * (FCOS_SIDE - h));
            g[2] = (float)(g[0] + w), g[3] = (float)(g[1] + h);
            b->labels[i * FCOS_MAXB + k] = (int64_t)(uniform(&st) * FCOS_CLASSES);
        }
    }
}

static void put_batch(FILE *f, const batch *b)
{
    float lab[FCOS_BATCH * FCOS_MAXB], nb[FCOS_BATCH];
    for (int i = 0; i < FCOS_BATCH * FCOS_MAXB; i++) lab[i] = (float)b->labels[i];
    for (int i = 0; i < FCOS_BATCH; i++) nb[i] = (float)b->nboxes[i];
    bench_put_tensor(f, "in:", "images", b->images);
    bench_put_entry(f, "in:boxes", 3, (int64_t[]){FCOS_BATCH, FCOS_MAXB, 4}, b->boxes);
    bench_put_entry(f, "in:labels", 2, (int64_t[]){FCOS_BATCH, FCOS_MAXB}, lab);
    bench_put_entry(f, "in:nboxes", 1, (int64_t[]){FCOS_BATCH}, nb);
}

/* ---- the model and its step --------------------------------------------------------------- */

static kpl_module *make_model(void)
{
    kpl_model_config c;
    memset(&c, 0, sizeof c);
    snprintf(c.name, sizeof c.name, "fcos");
    c.num_classes = FCOS_CLASSES;
    c.in_channels = 3, c.in_h = c.in_w = FCOS_SIDE;
    c.depth = FCOS_DEPTH, c.width = 64, c.stem = KPL_STEM_IMAGENET;
    char v[32];
    snprintf(v, sizeof v, "%d", FCOS_FPN_CHANNELS);
    if (kpl_keyvals_set(&c.keys, "fpn_channels", v) < 0) die("model.fcos.fpn_channels");
    snprintf(v, sizeof v, "%d", FCOS_LEVELS);
    if (kpl_keyvals_set(&c.keys, "levels", v) < 0) die("model.fcos.levels");
    snprintf(v, sizeof v, "%d", FCOS_HEAD_CONVS);
    if (kpl_keyvals_set(&c.keys, "head_convs", v) < 0) die("model.fcos.head_convs");
    snprintf(v, sizeof v, "%d", FCOS_GN_GROUPS);
    if (kpl_keyvals_set(&c.keys, "gn_groups", v) < 0) die("model.fcos.gn_groups");
    snprintf(v, sizeof v, "%g", FCOS_PRIOR_PROB);
    if (kpl_keyvals_set(&c.keys, "prior_prob", v) < 0) die("model.fcos.prior_prob");
    if (kpl_model_config_complete(&c) < 0) die("model config");
    kpl_module *m = NULL;
    if (kpl_zoo_create(&c, kpl_device_cpu(), FCOS_SEED, &m) < 0) die("model");
    return m;
}

static kpl__fcos_loss_config loss_config(kpl_module *m)
{
    kpl__fcos_loss_config lc;
    memset(&lc, 0, sizeof lc);
    lc.levels = kpl_fcos_strides(m, lc.stride);
    if (lc.levels != FCOS_LEVELS) {
        fprintf(stderr, "bench_fcos: the model has %d levels, want %d\n", lc.levels, FCOS_LEVELS);
        exit(1);
    }
    for (int l = 0; l < lc.levels; l++) lc.lo[l] = fcos_lo[l], lc.hi[l] = fcos_hi[l];
    lc.radius = FCOS_RADIUS, lc.alpha = FCOS_ALPHA, lc.gamma = FCOS_GAMMA;
    return lc;
}

/* The forward and the three losses of the batch (pool-owned). */
static void forward_losses(kpl_module *m, const kpl__fcos_loss_config *lc, const batch *b,
                           kpl_tensor_list *out, kpl_tensor **loss, int64_t *positives)
{
    kpl_tensor_list in = {1, {b->images}};
    if (kpl_module_forward_list(m, &in, out) < 0) die("forward");
    if (out->n != 3 * lc->levels) {
        fprintf(stderr, "bench_fcos: the model gives %d outputs, want %d\n", out->n,
                3 * lc->levels);
        exit(1);
    }
    if (kpl__fcos_loss(lc, out, FCOS_BATCH, b->boxes, b->labels, b->nboxes, FCOS_MAXB, NULL, loss,
                       positives) < 0)
        die("fcos loss");
}

/* The phases of a training step, ms. */
enum { PH_FWD, PH_LOSS, PH_BWD, PH_STEP, PH_N };

/* One training step; *ms the whole, ph[] its phases; losses into l3. */
static double train_step(kpl_module *m, kpl_optim *opt, const kpl__fcos_loss_config *lc,
                         const batch *b, double ph[PH_N], double l3[3])
{
    double t0 = bench_now();
    kpl_pool *p = kpl_pool_push(), *fw = kpl_pool_push();
    kpl_tensor_list in = {1, {b->images}}, out;
    if (kpl_module_forward_list(m, &in, &out) < 0) die("forward");
    double t1 = bench_now();
    kpl_tensor *loss[3] = {NULL, NULL, NULL};
    if (kpl__fcos_loss(lc, &out, FCOS_BATCH, b->boxes, b->labels, b->nboxes, FCOS_MAXB, NULL,
                       loss, NULL) < 0)
        die("fcos loss");
    kpl_tensor *total = kpl_add(kpl_add(loss[0], loss[1]), loss[2]);
    if (!total) die("loss sum");
    for (int k = 0; k < 3; k++) kpl_tensor_get(loss[k], 0, &l3[k]);
    kpl_tensor_retain(total);
    kpl_pool_pop(fw); /* saved activations now die as backward goes */
    double t2 = bench_now();
    if (kpl_backward(total, NULL, false) < 0) die("backward");
    kpl_tensor_release(total);
    double t3 = bench_now();
    if (kpl_optim_step(opt) < 0) die("sgd step");
    kpl_pool_pop(p);
    double t4 = bench_now();
    ph[PH_FWD] = (t1 - t0) * 1e3, ph[PH_LOSS] = (t2 - t1) * 1e3;
    ph[PH_BWD] = (t3 - t2) * 1e3, ph[PH_STEP] = (t4 - t3) * 1e3;
    return (t4 - t0) * 1e3;
}

/* What every run starts from: the seed's batch and model, its losses'
 * configuration; the batch's tensors in the pool pushed at *top. */
typedef struct {
    kpl_rng *rng;
    batch b;
    kpl_pool *top;
    kpl_module *m;
    kpl__fcos_loss_config lc;
} start;

static void start_make(start *s)
{
    kpl_set_num_threads(FCOS_THREADS);
    s->rng = kpl_rng_create(FCOS_SEED);
    if (!s->rng) die("rng");
    s->top = kpl_pool_push();
    make_batch(&s->b, s->rng);
    s->m = make_model();
    s->lc = loss_config(s->m);
}

static void start_free(start *s)
{
    kpl_tensor_release(s->b.images);
    kpl_tensor_release(s->b.image0);
    kpl_pool_pop(s->top);
    kpl_module_destroy(s->m);
    kpl_rng_destroy(s->rng);
}

/* The step's optimizer, fresh (no momentum yet). */
static kpl_optim *make_optim(kpl_module *m)
{
    return bench_sgd(m, FCOS_LR, FCOS_MOMENTUM, FCOS_WEIGHT_DECAY);
}

/* --mem: MEM_STEPS training steps in this fresh process, then the MEM
 * line torch_fcos.py mem prints too, and "MEMSTEP ms=": the fastest step
 * after the first. */
static int mem_main(void)
{
    static start st;
    start_make(&st);
    kpl_module *m = st.m;
    kpl_optim *opt = make_optim(m);
    kpl_module_set_training(m, true);
    bench_mem_run run = bench_mem_begin();
    double fastest = INFINITY;
    for (int i = 0; i < MEM_STEPS; i++) {
        double ph[PH_N], l3[3], ms = train_step(m, opt, &st.lc, &st.b, ph, l3);
        if (i > 0 && ms < fastest) fastest = ms;
    }
    bench_mem_end(&run);
    printf("MEMSTEP ms=%.2f\n", fastest);
    kpl_optim_destroy(opt);
    start_free(&st);
    return 0;
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

/* ---- the reference's output ------------------------------------------------------------------ */

typedef struct {
    double loss[3], out_abs, out_rel, positives;
    int names;
} ref_check;

static void check_line(const char *line, void *ctx)
{
    ref_check *r = ctx;
    if (strncmp(line, "CHECK ", 6)) return;
    sscanf(line, "CHECK names=%d positives=%lf loss_cls=%lf loss_box=%lf loss_ctr=%lf "
           "out_max_abs=%lf out_max_rel=%lf", &r->names, &r->positives, &r->loss[0], &r->loss[1],
           &r->loss[2], &r->out_abs, &r->out_rel);
}

typedef struct {
    double train, ph[PH_N], infer1, infer8, last[3];
} ref_times;

static void time_line(const char *line, void *ctx)
{
    ref_times *r = ctx;
    if (!strncmp(line, "TRAIN ", 6))
        sscanf(line, "TRAIN ms=%lf fwd=%lf loss=%lf bwd=%lf step=%lf last=%lf,%lf,%lf",
               &r->train, &r->ph[0], &r->ph[1], &r->ph[2], &r->ph[3], &r->last[0], &r->last[1],
               &r->last[2]);
    else if (!strncmp(line, "INFER b=1 ", 10))
        sscanf(line, "INFER b=1 ms=%lf", &r->infer1);
    else if (!strncmp(line, "INFER b=8 ", 10))
        sscanf(line, "INFER b=8 ms=%lf", &r->infer8);
}

/* "[a,b,c]" of n numbers */
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

/* The reference's forward and losses at kpl's initial weights (*rc), the
 * largest relative difference of the three losses (*rel); 1 when they
 * disagree past FCOS_LOSS_RTOL or the positives differ. */
static int compare_ref(const char *py, const char *args, const char *out_path,
                       const double kloss[3], int64_t kpos, ref_check *rc, double *rel)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s check %s kpl_out=%s", py, args, out_path);
    if (bench_run_lines(cmd, check_line, rc) == 0 && isnan(rc->loss[0])) {
        fprintf(stderr, "bench_fcos: no CHECK line from: %s\n", cmd);
        bench_ref_failures++;
    }
    if (!isnan(rc->loss[0])) {
        *rel = 0;
        for (int k = 0; k < 3; k++) {
            double d = fabs(kloss[k] - rc->loss[k]) / fmax(fabs(rc->loss[k]), 1e-12);
            *rel = isnan(d) ? INFINITY : fmax(*rel, d);
        }
        fprintf(stderr,
                "bench_fcos: torch losses at init: cls %.6g box %.6g ctr %.6g (%g "
                "positives); max relative difference %.3g; head outputs differ by at most %.3g "
                "(relative %.3g)\n",
                rc->loss[0], rc->loss[1], rc->loss[2], rc->positives, *rel, rc->out_abs,
                rc->out_rel);
        if (!(*rel <= FCOS_LOSS_RTOL)) {
            fprintf(stderr,
                    "bench_fcos: FAIL: the losses of kpl and PyTorch disagree: max "
                    "relative difference %.3g > %g\n",
                    *rel, FCOS_LOSS_RTOL);
            return 1;
        }
        if (rc->positives != (double)kpos) {
            fprintf(stderr, "bench_fcos: FAIL: kpl assigns %lld positives, PyTorch %g\n",
                    (long long)kpos, rc->positives);
            return 1;
        }
    }

    return 0;
}

/* A kpl --mem run's lines: MEM, and MEMSTEP's step time. */
typedef struct {
    bench_mem_line mem;
    double step_ms;
} kpl_mem_run;

static void kpl_mem_parse(const char *line, void *ctx)
{
    kpl_mem_run *r = ctx;
    bench_mem_line_parse(line, &r->mem);
    if (!strncmp(line, "MEMSTEP ", 8)) sscanf(line, "MEMSTEP ms=%lf", &r->step_ms);
}

/* fcos/r18_train_step_b8_128/peak_rss and peak_rss_keep16: each side's
 * memory run in a fresh process (kpl: this program with --mem, by
 * default and with KPL_ALLOC_KEEP_MB=16; PyTorch: torch_fcos.py mem), and
 * the rows; 1 when a kpl run fails. */
static int mem_row(const char *py, const char *args)
{
    char kcmd[2048], rcmd[4096], self[1024], n1[BENCH_NUM_LEN], n2[BENCH_NUM_LEN],
        n3[BENCH_NUM_LEN];
    bench_self_path(self, sizeof self);
    bench_mem_line km, rm;
    snprintf(kcmd, sizeof kcmd, "OMP_NUM_THREADS=%d %s --mem", FCOS_THREADS, self);
    snprintf(rcmd, sizeof rcmd, "%s mem %s steps=%d", py, args, MEM_STEPS);
    if (bench_mem_pair("bench_fcos", kcmd, rcmd, &km, &rm)) return 1;
    /* the default's step time, and the run keeping 16 MiB */
    kpl_mem_run kd = {{NAN, NAN, NAN, NAN}, NAN}, kk = kd;
    char kcmd16[2100];
    snprintf(kcmd16, sizeof kcmd16, "KPL_ALLOC_KEEP_MB=16 %s", kcmd);
    const char *failed = NULL;
    if (bench_run_lines(kcmd, kpl_mem_parse, &kd) < 0 || isnan(kd.step_ms))
        failed = kcmd;
    else if (bench_run_lines(kcmd16, kpl_mem_parse, &kk) < 0 || isnan(kk.mem.growth))
        failed = kcmd16;
    if (failed) {
        fprintf(stderr, "bench_fcos: kpl's memory run failed: %s\n", failed);
        return 1;
    }
    fprintf(stderr,
            "bench_fcos: peak RSS growth over %d steps kpl %.0f MB (allocator peak %.0f "
            "MB; %.0f MB keeping 16 MiB of free blocks resident, step %.1f against %.1f ms), "
            "torch %.0f MB\n",
            MEM_STEPS, km.growth / 1e6, km.alloc_peak / 1e6, kk.mem.growth / 1e6, kk.step_ms,
            kd.step_ms, rm.growth / 1e6);

    char n4[BENCH_NUM_LEN], n5[BENCH_NUM_LEN], n6[BENCH_NUM_LEN], n7[BENCH_NUM_LEN],
        n8[BENCH_NUM_LEN];
    bench_emit("fcos", "r18_train_step_b8_128/peak_rss", "bytes", 0, km.growth, rm.growth,
               "torch-cpu-f32-nchw peak RSS growth", 1.25,
               ",\"measure\":\"peak RSS over %d training steps less the RSS with model, batch and "
               "optimizer made, a fresh process per side, each field the median of "
               "KPL_BENCH_MEM_ROUNDS alternating runs\",\"kpl_peak_rss\":%s,\"ref_peak_rss\":%s,"
               "\"kpl_base_rss\":%s,\"ref_base_rss\":%s,\"kpl_allocator_peak\":%s",
               MEM_STEPS, bench_jnum(n1, km.peak), bench_jnum(n2, rm.peak), bench_jnum(n3, km.base),
               bench_jnum(n4, rm.base), bench_jnum(n5, km.alloc_peak));
    bench_emit("fcos", "r18_train_step_b8_128/peak_rss_keep16", "bytes", 0, kk.mem.growth,
               rm.growth, "torch-cpu-f32-nchw peak RSS growth", 1.25,
               ",\"kpl_env\":\"KPL_ALLOC_KEEP_MB=16\",\"kpl_default_growth\":%s,"
               "\"step_ms_keep16\":%s,\"step_ms_default\":%s",
               bench_jnum(n6, kd.mem.growth), bench_jnum(n7, kk.step_ms),
               bench_jnum(n8, kd.step_ms));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--mem")) return mem_main();
    if (argc != 3) {
        fprintf(stderr, "usage: bench_fcos BENCH_DIR WORK_DIR | bench_fcos --mem\n");
        return 2;
    }
    const char *bench_dir = argv[1], *work = argv[2];
    rounds = bench_env_int("KPL_BENCH_ROUNDS", 5, 1, 64);
    static start st;
    start_make(&st);
    kpl_module *m = st.m;
    const kpl__fcos_loss_config lc = st.lc;

    char init_path[512], out_path[512];
    snprintf(init_path, sizeof init_path, "%s/fcos_init.bin", work);
    snprintf(out_path, sizeof out_path, "%s/fcos_kpl_out.bin", work);
    static snapshot init;
    snapshot_take(&init, m);
    FILE *f = bench_file_open(init_path, "KPLFCOS1");
    bench_put_module(f, "p:", "b:", m);
    put_batch(f, &st.b);
    if (fclose(f) != 0) die("closing the init file");

    /* kpl's forward and losses at the initial weights (training mode) */
    double kloss[3];
    int64_t kpos = 0;
    {
        kpl_pool *p = kpl_pool_push();
        kpl_tensor_list out;
        kpl_tensor *loss[3];
        bool prev = kpl_set_grad_enabled(false);
        forward_losses(m, &lc, &st.b, &out, loss, &kpos);
        kpl_set_grad_enabled(prev);
        for (int k = 0; k < 3; k++) kpl_tensor_get(loss[k], 0, &kloss[k]);
        f = bench_file_open(out_path, "KPLFCOS1");
        static const char *const kinds[3] = {"cls", "reg", "ctr"};
        for (int i = 0; i < out.n; i++) {
            char name[32];
            snprintf(name, sizeof name, "%s.%d", kinds[i / lc.levels], i % lc.levels);
            bench_put_tensor(f, "out:", name, out.t[i]);
        }
        if (fclose(f) != 0) die("closing the output file");
        kpl_pool_pop(p);
    }
    fprintf(stderr, "bench_fcos: kpl losses at init: cls %.6g box %.6g ctr %.6g (%lld positives)\n",
            kloss[0], kloss[1], kloss[2], (long long)kpos);

    /* The reference's command: MODE goes between py and args, then the
     * mode's own arguments. */
    char py[1024], args[1024], ranges[256] = "";
    for (int l = 0; l < FCOS_LEVELS; l++) {
        size_t o = strlen(ranges);
        snprintf(ranges + o, sizeof ranges - o, "%s%.17g,%.17g", l ? "," : "", fcos_lo[l],
                 fcos_hi[l]);
    }
    snprintf(py, sizeof py,
             "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=%d /usr/bin/python3 "
             "%s/torch_fcos.py",
             FCOS_THREADS, bench_dir);
    snprintf(args, sizeof args,
             "%s threads=%d classes=%d depth=%d fpn=%d levels=%d convs=%d groups=%d ranges=%s "
             "radius=%.17g alpha=%.17g gamma=%.17g lr=%.17g momentum=%.17g wd=%.17g",
             init_path, FCOS_THREADS, FCOS_CLASSES, FCOS_DEPTH, FCOS_FPN_CHANNELS, FCOS_LEVELS,
             FCOS_HEAD_CONVS, FCOS_GN_GROUPS, ranges, FCOS_RADIUS, FCOS_ALPHA, FCOS_GAMMA, FCOS_LR,
             FCOS_MOMENTUM, FCOS_WEIGHT_DECAY);
    char cmd[4096];

    /* the reference's forward and losses at the same weights */
    ref_check rc = {{NAN, NAN, NAN}, NAN, NAN, NAN, 0};
    double rel = NAN;
    if (compare_ref(py, args, out_path, kloss, kpos, &rc, &rel)) return 1;

    /* memory, each side in a fresh process */
    if (mem_row(py, args)) return 1;

    /* the timed rounds */
    snprintf(cmd, sizeof cmd, "%s time %s train=%d,%d infer8=%d,%d infer1=%d,%d", py, args,
             TRAIN_WARM, TRAIN_STEPS, INFER8_WARM, INFER8_STEPS, INFER1_WARM, INFER1_STEPS);
    double ktr[64], kph[PH_N][64], ki1[64], ki8[64], rtr[64], rph[PH_N][64], ri1[64], ri8[64];
    double first_ms = NAN, klast[3] = {NAN, NAN, NAN}, rlast[3] = {NAN, NAN, NAN};
    for (int r = 0; r < rounds; r++) {
        for (int side = 0; side < 2; side++) {
            if ((side + r) % 2 == 0) {
                double t[TRAIN_STEPS], ph[PH_N][TRAIN_STEPS], l3[3];
                /* the same start as the reference: initial weights, no momentum */
                snapshot_restore(&init);
                kpl_optim *opt = make_optim(m);
                kpl_module_set_training(m, true);
                for (int i = 0; i < TRAIN_WARM + TRAIN_STEPS; i++) {
                    double one[PH_N], ms = train_step(m, opt, &lc, &st.b, one, l3);
                    if (r == 0 && i == 0) first_ms = ms;
                    if (i >= TRAIN_WARM) {
                        t[i - TRAIN_WARM] = ms;
                        for (int k = 0; k < PH_N; k++) ph[k][i - TRAIN_WARM] = one[k];
                    }
                    if (!isfinite(l3[0] + l3[1] + l3[2])) {
                        fprintf(stderr, "bench_fcos: kpl's losses are not finite (%g %g %g)\n",
                                l3[0], l3[1], l3[2]);
                        return 1;
                    }
                }
                ktr[r] = bench_median(t, TRAIN_STEPS);
                for (int k = 0; k < PH_N; k++) kph[k][r] = bench_median(ph[k], TRAIN_STEPS);
                kpl_optim_destroy(opt);
                memcpy(klast, l3, sizeof klast);
                kpl_module_set_training(m, false);
                double t8[INFER8_STEPS], t1[INFER1_STEPS];
                for (int i = 0; i < INFER8_WARM + INFER8_STEPS; i++) {
                    double ms = infer(m, st.b.images);
                    if (i >= INFER8_WARM) t8[i - INFER8_WARM] = ms;
                }
                for (int i = 0; i < INFER1_WARM + INFER1_STEPS; i++) {
                    double ms = infer(m, st.b.image0);
                    if (i >= INFER1_WARM) t1[i - INFER1_WARM] = ms;
                }
                ki8[r] = bench_median(t8, INFER8_STEPS);
                ki1[r] = bench_median(t1, INFER1_STEPS);
            } else {
                ref_times one = {NAN, {NAN, NAN, NAN, NAN}, NAN, NAN, {NAN, NAN, NAN}};
                if (bench_run_lines(cmd, time_line, &one) == 0 &&
                    (isnan(one.train) || isnan(one.infer1) || isnan(one.infer8))) {
                    fprintf(stderr, "bench_fcos: no TRAIN/INFER lines from: %s\n", cmd);
                    bench_ref_failures++;
                }
                rtr[r] = one.train, ri1[r] = one.infer1, ri8[r] = one.infer8;
                if (!isnan(one.last[0])) memcpy(rlast, one.last, sizeof rlast);
                for (int k = 0; k < PH_N; k++) rph[k][r] = one.ph[k];
            }
        }
        fprintf(stderr, "bench_fcos: round %d: train kpl %.1f ms (fwd %.1f loss %.1f bwd %.1f "
                "step %.1f), torch %.1f ms (fwd %.1f loss %.1f bwd %.1f step %.1f); infer b8 kpl "
                "%.1f torch %.1f; b1 kpl %.2f torch %.2f\n",
                r, ktr[r], kph[0][r], kph[1][r], kph[2][r], kph[3][r], rtr[r], rph[0][r],
                rph[1][r], rph[2][r], rph[3][r], ki8[r], ri8[r], ki1[r], ri1[r]);
    }
    fprintf(stderr, "bench_fcos: losses at step %d from the initial weights: kpl %.5g %.5g %.5g, "
            "torch %.5g %.5g %.5g\n", TRAIN_WARM + TRAIN_STEPS, klast[0], klast[1], klast[2],
            rlast[0], rlast[1], rlast[2]);

    const char *refname = "torch-cpu-f32-nchw (same network and losses by hand; no torchvision)";
    char kr[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN], n1[BENCH_NUM_LEN], n2[BENCH_NUM_LEN],
        n3[BENCH_NUM_LEN];
    char lk[128], lr[128], pk[128], pr[128], sk[128], sr[128];
    double kphm[PH_N], rphm[PH_N];
    for (int k = 0; k < PH_N; k++)
        kphm[k] = bench_median(kph[k], rounds), rphm[k] = bench_median(rph[k], rounds);
    bench_jrange(kr, ktr, rounds);
    bench_jrange(rr, rtr, rounds);
    bench_emit("fcos", "r18_train_step_b8_128/t2", "ms", 0, bench_median(ktr, rounds),
               bench_median(rtr, rounds), refname, 1.2,
               ",\"threads\":%d,\"rounds\":%d,\"kpl_range\":%s,\"ref_range\":%s,"
               "\"phases\":\"fwd,loss,bwd,step\",\"kpl_phases_ms\":%s,\"ref_phases_ms\":%s,"
               "\"loss_kpl\":%s,\"loss_ref\":%s,\"loss_max_rel_diff\":%s,\"positives\":%lld,"
               "\"out_max_abs_diff\":%s,\"loss_step%d_kpl\":%s,\"loss_step%d_ref\":%s,"
               "\"first_step_ms_kpl\":%s,\"fpn_channels\":%d,\"omp_wait_policy\":\"%s\"",
               FCOS_THREADS, rounds, kr, rr, jlist(pk, sizeof pk, kphm, PH_N),
               jlist(pr, sizeof pr, rphm, PH_N), jlist(lk, sizeof lk, kloss, 3),
               jlist(lr, sizeof lr, rc.loss, 3), bench_jnum(n1, rel), (long long)kpos,
               bench_jnum(n2, rc.out_abs), TRAIN_WARM + TRAIN_STEPS, jlist(sk, sizeof sk, klast, 3),
               TRAIN_WARM + TRAIN_STEPS, jlist(sr, sizeof sr, rlast, 3), bench_jnum(n3, first_ms),
               FCOS_FPN_CHANNELS, getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "unset");
    const struct {
        const char *cas;
        double *k, *r;
    } inf[2] = {{"r18_infer_b1_128/t2", ki1, ri1}, {"r18_infer_b8_128/t2", ki8, ri8}};
    for (int c = 0; c < 2; c++) {
        bench_jrange(kr, inf[c].k, rounds);
        bench_jrange(rr, inf[c].r, rounds);
        bench_emit("fcos", inf[c].cas, "ms", 0, bench_median(inf[c].k, rounds),
                   bench_median(inf[c].r, rounds), refname, NAN,
                   ",\"threads\":%d,\"rounds\":%d,\"kpl_range\":%s,\"ref_range\":%s,"
                   "\"fpn_channels\":%d",
                   FCOS_THREADS, rounds, kr, rr, FCOS_FPN_CHANNELS);
    }
    snapshot_free(&init);
    start_free(&st);
    return bench_exit_code();
}
