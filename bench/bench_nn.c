/*
 * bench_nn.c — `bench/run.sh nn`: training steps of the model zoo next to
 * PyTorch CPU, and per-layer convolution timings of ResNet-50.
 *
 *   bench_nn BASELINES_DIR BENCH_DIR      all cases (the driver)
 *   bench_nn --step MODEL BATCH WARMUP STEPS [f32|bf16|fp16] [plain]
 *                [deterministic] [tf32] [device=NAME]
 *                                         one model in this process (bf16 or
 *                                         fp16 autocast, fp16 with a loss
 *                                         scale; plain layouts; TF32 on CUDA;
 *                                         on cpu or cuda:N); prints
 *                                         "RESULT ms_median=... maxrss_MiB=..."
 *                                         (the allocator peaks are the
 *                                         device's: GPU memory on cuda:N)
 *
 * Cases:
 *  - train_step/{lenet_b128, resnet18_cifar_b64, resnet50_b8}: images/s of
 *    zero_grad + forward + cross entropy + backward + SGD(momentum 0.9)
 *    on random in-memory inputs, 2 threads; kpl and PyTorch alternate
 *    (KPL_BENCH_ROUNDS rounds, default 3), each round a fresh process, so
 *    peak RSS is the process's own.  Extra fields: the achieved GFLOP/s
 *    (convolution and linear products only) and its fraction of the 2-core
 *    f32 matmul rate measured here; peak RSS of both.  The LeNet reference
 *    is torch_fmnist.py (one epoch of Fashion-MNIST, step time excludes data
 *    handling), the ResNets' torch_resnet.py.
 *  - train_peak_rss/resnet50_b8: peak RSS, kpl vs PyTorch (target <= 0.8x).
 *  - train_step_cl/{resnet18_cifar_b64, resnet50_b8}: kpl f32 against
 *    PyTorch's channels_last f32 (target 1.0).
 *  - train_step_best/...: kpl's best precision (bf16 where the CPU computes
 *    it natively, else f32) against PyTorch's strongest configuration
 *    (channels_last + autocast bf16 where the CPU has AVX512-BF16 or AMX,
 *    channels_last f32 elsewhere; shared/baselines/torch_resnet_variants.py)
 *    (target 1.2); and train_peak_rss_bf16/resnet50_b8, both in bf16
 *    (target <= 0.8x).  Each row names both precisions.
 *  - train_step_blocked/{model}_{f32,bf16}: kpl with activations kept in
 *    oneDNN's layouts against kpl with plain NCHW tensors
 *    (kpl_set_blocked_layouts), per precision; train_step_layout/...: kpl's
 *    default choice of kept layout against every convolution asked for
 *    NHWC (kpl_set_kept_layout), per precision (target 1.0: the default
 *    is the faster on this CPU).
 *  - conv_layer/resnet50_b8/...: every distinct ResNet-50 convolution, fwd,
 *    bwd_data and bwd_weight timed alone (median of 5 after a warm-up), in
 *    GFLOP/s, with PyTorch's F.conv2d / conv backward for the same shape
 *    (bench/torch_conv_layers.py) as the reference.
 *  - dilated_conv/deeplab_r18_b2/...: DeepLabv3-R18's dilated convolutions
 *    (dilation 2, 6, 12, 18 on its 33 x 33 map) as oneDNN runs them
 *    against the space-to-batch formulation's convolution (dilated_cases).
 *  - recompute/resnet50_b8/...: memory.recompute (bench_nn_recompute.c).
 */
#include "bench_common.h"
#include "bench_nn.h"
#include "bench_zoo.h"
#include "kernels_impl.h"
#include "trainer.h"

#include <sys/resource.h>
#include <unistd.h>

void die(const char *what)
{
    fprintf(stderr, "bench_nn: %s: %s\n", what, kpl_last_error());
    exit(1);
}

static double maxrss_mib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss / 1024.0;
}

/* ---- one model's steps (child process) --------------------------------------------- */

/* fp16's loss scale in --step, as PyTorch's GradScaler keeps it: starts at
 * 2^16, halves at a step whose gradients overflow (that step's update is
 * left out), grows only after 2000 good steps (never, in a bench).  The
 * gradients are divided by it and checked in one pass (kpl_k_amp_unscale),
 * as the trainer and GradScaler do. */
static double step_fp16_scale = 65536.0;

/* Unscales the gradients; *finite says whether to step. */
static kpl_status unscale_grads(kpl_module *m, kpl_device *dev, bool *finite)
{
    int64_t one = 1;
    kpl_tensor *found = NULL;
    kpl_status st = kpl_tensor_empty(dev, KPL_F32, 1, &one, &found);
    if (st >= 0) st = kpl_k_fill(found, 0);
    kpl_tensor *const *ps = kpl_module_params(m);
    for (int i = 0; st >= 0 && i < kpl_module_num_params(m); i++) {
        kpl_tensor *g = kpl_grad_get(ps[i]);
        if (g) st = kpl_k_amp_unscale(g, 1.0 / step_fp16_scale, found);
    }
    double inf = 0;
    if (st >= 0) st = kpl_tensor_get(found, 0, &inf);
    kpl_tensor_release(found);
    *finite = inf == 0;
    if (!*finite) step_fp16_scale *= 0.5;
    return st;
}

static int run_steps(const char *name, int64_t batch, int warm, int steps, kpl_dtype prec,
                     const char *devname, bool recompute, double budget_mb)
{
    kpl_set_num_threads(2);
    kpl_device *dev = NULL;
    if (kpl_device_get(devname, &dev) < 0) die(devname);
    kpl_device_reset_peak(dev);
    bool imagenet = strcmp(name, "resnet18_cifar") && strncmp(name, "resnet", 6) == 0;
    int64_t classes = imagenet ? 1000 : 10, hw = imagenet ? 224 : strcmp(name, "resnet18_cifar") ? 28 : 32;
    int64_t ch = hw == 28 ? 1 : 3;
    kpl_module *m = NULL;
    if (bench_zoo(name, classes, dev, 0, &m) < 0) die("model");
    int units = 0; /* memory.recompute: blocks */
    if ((recompute || budget_mb > 0) && kpl_module_recompute_units(m, true, &units) < 0)
        die("recompute");
    /* memory.recompute: auto */
    if (budget_mb > 0 && kpl_recompute_set_budget(dev, (size_t)(budget_mb * 1048576.0)) < 0)
        die("budget");
    uint64_t replays0 = kpl_recompute_count(), evictions0 = kpl_recompute_evictions();
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    oc.lr = 0.01;
    oc.momentum = 0.9;
    kpl_optim *opt = NULL;
    if (kpl_optim_create(&oc, kpl_module_num_params(m), kpl_module_params(m), NULL, &opt) < 0)
        die("sgd");
    kpl_rng *rng = kpl_rng_create(1);
    int64_t xs[4] = {batch, ch, hw, hw};
    kpl_tensor *x = NULL, *y = NULL;
    if (kpl_tensor_empty(dev, KPL_F32, 4, xs, &x) < 0 || kpl_k_normal(x, rng, 0, 1) < 0 ||
        kpl_tensor_empty(dev, KPL_I64, 1, &batch, &y) < 0)
        die("inputs");
    int64_t *yv = kpl_tensor_host_mutable(y);
    for (int64_t i = 0; i < batch; i++) yv[i] = (i * 7) % classes;
    double rss0 = maxrss_mib();
    double *ms = calloc((size_t)steps, sizeof *ms), loss0 = NAN, loss1 = NAN, first = NAN;
    for (int i = 0; i < warm + steps; i++) {
        double t0 = bench_now();
        kpl_pool *p = kpl_pool_push(), *fw = kpl_pool_push();
        kpl_set_autocast(prec, NULL); /* as kpl train's precision key */
        kpl_tensor *loss = kpl_cross_entropy(kpl_module_forward(m, x), y, KPL_REDUCE_MEAN, 0, -100);
        kpl_set_autocast(KPL_F32, NULL);
        if (!loss) die("forward");
        kpl_tensor *scaled =
            prec == KPL_F16 ? kpl_scalar_op(KPL_BIN_MUL, loss, step_fp16_scale, false) : loss;
        if (!scaled) die("loss scale");
        kpl_tensor_retain(loss);
        kpl_tensor_retain(scaled);
        kpl_pool_pop(fw); /* saved activations now die as backward goes */
        if (kpl_backward(scaled, NULL, false) < 0) die("backward");
        kpl_tensor_release(scaled);
        bool finite = true;
        if (prec == KPL_F16 && unscale_grads(m, dev, &finite) < 0) die("unscale");
        if (finite && kpl_optim_step(opt) < 0) die("sgd step");
        if (!finite) kpl_zero_grad(kpl_module_num_params(m), kpl_module_params(m));
        double v = NAN;
        kpl_tensor_get(loss, 0, &v);
        kpl_tensor_release(loss);
        kpl_pool_pop(p);
        double t = (bench_now() - t0) * 1e3;
        if (i == 0) loss0 = v, first = t;
        loss1 = v;
        if (i >= warm) ms[i - warm] = t;
        fprintf(stderr, "  %s step %d %.1f ms loss %.4f\n", name, i, t, v);
    }
    int64_t chw[3] = {ch, hw, hw};
    double flops = 0;
    if (kpl_module_count_flops(m, 3, chw, true, &flops) < 0) die("flops");
    bool kept = kpl_set_blocked_layouts(true); /* (the setting, read back) */
    kpl_set_blocked_layouts(kept);
    kpl_layout kl = kpl_get_kept_layout();
    const char *layout = !kept                         ? "plain"
                         : kl == KPL_LAYOUT_NHWC    ? "nhwc"
                         : kl == KPL_LAYOUT_NCHW16C ? "nchw16c"
                                                    : "auto";
    char isa[48], impls[256];
    bench_kpl_isa(isa, sizeof isa);
    kpl__cpu_conv_impls(impls, sizeof impls);
    printf("RESULT model=%s device=%s precision=%s tf32=%d layout=%s batch=%lld params=%lld "
           "ms_median=%.3f maxrss_MiB=%.0f rss_before_first_step_MiB=%.0f flops_per_sample=%.6g "
           "loss_first=%.4f loss_last=%.4f alloc_peak_MiB=%.0f reserved_peak_MiB=%.0f "
           "first_step_ms=%.1f recompute_units=%d replays_per_step=%.1f budget_MiB=%.0f "
           "evictions_per_step=%.1f isa=%s conv_impls=%s\n",
           name, kpl_device_name(dev), kpl_dtype_name(prec), (int)kpl_get_tf32(), layout,
           (long long)batch, (long long)kpl_module_param_count(m), bench_median(ms, steps),
           maxrss_mib(), rss0, flops, loss0, loss1,
           (double)kpl_device_memory_stats(dev).peak_allocated / 1048576.0,
           (double)kpl_device_memory_stats(dev).peak_reserved / 1048576.0, first, units,
           (double)(kpl_recompute_count() - replays0) / (warm + steps), budget_mb,
           (double)(kpl_recompute_evictions() - evictions0) / (warm + steps), isa,
           impls[0] ? impls : "none");
    free(ms);
    kpl_tensor_release(x);
    kpl_tensor_release(y);
    kpl_rng_destroy(rng);
    kpl_optim_destroy(opt);
    kpl_module_destroy(m);
    return 0;
}

/* ---- the driver ----------------------------------------------------------------- */

static void step_line(const char *line, void *ctx)
{
    step_result *r = ctx;
    if (strncmp(line, "RESULT", 6)) return;
    const char *keys[5] = {
        "ms_median=", "maxrss_MiB=", "flops_per_sample=", "first_step_ms=", "alloc_peak_MiB="};
    double *vals[5] = {&r->ms, &r->rss, &r->flops, &r->first, &r->alloc_peak};
    for (int k = 0; k < 5; k++) {
        const char *at = strstr(line, keys[k]);
        if (at) *vals[k] = strtod(at + strlen(keys[k]), NULL);
    }
    /* torch_fmnist.py says ms_per_step_median */
    const char *at = strstr(line, "ms_per_step_median=");
    if (at) r->ms = strtod(at + 19, NULL);
    const char *words[2] = {" isa=", " conv_impls="};
    char *into[2] = {r->isa, r->impls};
    size_t size[2] = {sizeof r->isa, sizeof r->impls};
    for (int k = 0; k < 2; k++)
        if ((at = strstr(line, words[k]))) {
            at += strlen(words[k]);
            snprintf(into[k], size[k], "%.*s", (int)strcspn(at, " \n"), at);
        }
}

step_result run_child(const char *cmd)
{
    step_result r = {NAN, NAN, NAN, NAN, NAN, "?", "?"};
    if (bench_run_lines(cmd, step_line, &r) < 0)
        return (step_result){NAN, NAN, NAN, NAN, NAN, "?", "?"};
    if (isnan(r.ms)) {
        fprintf(stderr, "bench_nn: no RESULT line from: %s\n", cmd);
        bench_ref_failures++;
    }
    return r;
}

/* The 2-thread f32 matmul rate (1024^3, median of 5), the yardstick for
 * the models' GFLOP/s. */
static double matmul_rate(void)
{
    kpl_set_num_threads(2);
    kpl_device *cpu = kpl_device_cpu();
    kpl_rng *rng = kpl_rng_create(3);
    int64_t s[2] = {1024, 1024};
    kpl_tensor *a = NULL, *b = NULL, *c = NULL;
    if (kpl_tensor_empty(cpu, KPL_F32, 2, s, &a) < 0 || kpl_k_normal(a, rng, 0, 1) < 0 ||
        kpl_tensor_empty(cpu, KPL_F32, 2, s, &b) < 0 || kpl_k_normal(b, rng, 0, 1) < 0 ||
        kpl_tensor_empty(cpu, KPL_F32, 2, s, &c) < 0)
        die("matmul operands");
    double t[7];
    for (int i = 0; i < 7; i++) {
        double t0 = bench_now();
        if (kpl_k_matmul(c, a, b, false, false) < 0) die("matmul");
        t[i] = 2.0 * 1024 * 1024 * 1024 / (bench_now() - t0) / 1e9;
    }
    kpl_tensor_release(a);
    kpl_tensor_release(b);
    kpl_tensor_release(c);
    kpl_rng_destroy(rng);
    return bench_median(t + 2, 5);
}

typedef struct {
    const char *model, *label;
    int64_t batch;
    int warm, steps;
    double target;
} model_case;

/* kpl in `prec` against torch_resnet_variants.py's `var`, alternating
 * rounds; medians of step time and peak RSS; each side's oneDNN ISA and
 * convolution kernels (kpl's from its algorithm cache, PyTorch's from one
 * more step under ONEDNN_VERBOSE). */
static void versus(const char *self, const char *baselines, const model_case *mc, int rounds,
                   const char *prec, const char *var, step_result *k, step_result *t)
{
    double kms[8], tms[8], krss[8], trss[8];
    char cmd[4096];
    for (int r = 0; r < rounds; r++) {
        snprintf(cmd, sizeof cmd, "%s --step %s %lld %d %d %s", self, mc->model,
                 (long long)mc->batch, mc->warm, mc->steps, prec);
        step_result a = run_child(cmd);
        if (isnan(a.ms)) die("kpl training step (see above)");
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/torch_resnet_variants.py %s %s 2 %lld %d %d",
                 baselines, strcmp(mc->model, "resnet50") ? "r18" : "r50", var,
                 (long long)mc->batch, mc->warm, mc->steps);
        step_result b = run_child(cmd);
        kms[r] = a.ms, krss[r] = a.rss, tms[r] = b.ms, trss[r] = b.rss;
    }
    k->ms = bench_median(kms, rounds), k->rss = bench_median(krss, rounds);
    t->ms = bench_median(tms, rounds), t->rss = bench_median(trss, rounds);
    snprintf(cmd, sizeof cmd, "%s --step %s %lld 1 1 %s", self, mc->model, (long long)mc->batch,
             prec);
    step_result a = run_child(cmd);
    memcpy(k->isa, a.isa, sizeof k->isa);
    memcpy(k->impls, a.impls, sizeof k->impls);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/torch_resnet_variants.py %s %s 2 %lld 1 1",
             baselines, strcmp(mc->model, "resnet50") ? "r18" : "r50", var, (long long)mc->batch);
    bench_onednn_run(cmd, t->isa, sizeof t->isa, t->impls, sizeof t->impls);
}

/* The kernels both sides ran, as row fields. */
static const char *kernels_fields(const step_result *k, const step_result *t)
{
    static char f[1024];
    snprintf(f, sizeof f,
             ",\"kpl_isa\":\"%s\",\"kpl_conv_impls\":\"%s\",\"ref_isa\":\"%s\","
             "\"ref_conv_impls\":\"%s\"",
             k->isa, k->impls, t->isa, t->impls);
    return f;
}

/* kpl's default (kept layouts as chosen) against kpl with `alt`: "plain"
 * (no kept layouts: what keeping them buys) or "nhwc" (every convolution
 * asked for NHWC: whether the default's choice is the faster here), in
 * `prec`, alternating rounds. */
static void layout_row(const char *self, const model_case *mc, int rounds, const char *prec,
                       const char *alt)
{
    double ms[2][8];
    char cmd[4096];
    for (int r = 0; r < rounds; r++)
        for (int other = 0; other < 2; other++) {
            snprintf(cmd, sizeof cmd, "%s --step %s %lld %d %d %s%s%s", self, mc->model,
                     (long long)mc->batch, mc->warm, mc->steps, prec, other ? " " : "",
                     other ? alt : "");
            step_result a = run_child(cmd);
            if (isnan(a.ms)) die("kpl training step (see above)");
            ms[other][r] = a.ms;
        }
    char label[96], extra[64], bench[48], ref[48];
    snprintf(label, sizeof label, "%s_%s", mc->label, prec);
    snprintf(extra, sizeof extra, ",\"precision_kpl\":\"%s\"", prec);
    bool plain = !strcmp(alt, "plain");
    snprintf(bench, sizeof bench, "%s", plain ? "train_step_blocked" : "train_step_layout");
    snprintf(ref, sizeof ref, "kpl-%s%s", alt, plain ? "-layout" : "-every-conv");
    bench_emit(bench, label, "img/s", 1, 1e3 * (double)mc->batch / bench_median(ms[0], rounds),
               1e3 * (double)mc->batch / bench_median(ms[1], rounds), ref, 1.0, "%s", extra);
}

/* The rows against PyTorch's channels_last and its strongest configuration. */
static void strongest(const char *self, const char *baselines, const model_case *mc, int rounds)
{
    step_result k, t;
    versus(self, baselines, mc, rounds, "f32", "cl", &k, &t);
    bench_emit("train_step_cl", mc->label, "img/s", 1, 1e3 * (double)mc->batch / k.ms,
               1e3 * (double)mc->batch / t.ms, "torch-cpu-channels_last", 1.0,
               ",\"precision_kpl\":\"f32\",\"precision_ref\":\"f32\"%s", kernels_fields(&k, &t));
    bool kbf = kpl_precision_native(KPL_DEVICE_CPU, KPL_BF16);
    bool tbf = bench_cpu_has("avx512_bf16") || bench_cpu_has("amx_bf16");
    if (!kbf || !tbf)
        fprintf(stderr, "bench_nn: %s has no native bf16 here (kpl: %s); comparing f32 with "
                        "PyTorch's %s\n", mc->label, kpl_cpu_math_info(),
                tbf ? "channels_last + bf16" : "channels_last f32");
    versus(self, baselines, mc, rounds, kbf ? "bf16" : "f32", tbf ? "cl_bf16" : "cl", &k, &t);
    char extra[160];
    snprintf(extra, sizeof extra, ",\"precision_kpl\":\"%s\",\"precision_ref\":\"%s\"",
             kbf ? "bf16" : "f32", tbf ? "channels_last+bf16" : "channels_last f32");
    bench_emit("train_step_best", mc->label, "img/s", 1, 1e3 * (double)mc->batch / k.ms,
               1e3 * (double)mc->batch / t.ms, "torch-cpu-strongest", 1.2, "%s%s", extra,
               kernels_fields(&k, &t));
    if (!strcmp(mc->model, "resnet50") && kbf && tbf)
        bench_emit("train_peak_rss_bf16", mc->label, "MiB", 0, k.rss, t.rss, "torch-cpu-cl-bf16",
                   1 / 0.8, "%s", extra);
    layout_row(self, mc, rounds, "f32", "plain");
    layout_row(self, mc, rounds, "f32", "nhwc");
    if (kbf) layout_row(self, mc, rounds, "bf16", "plain");
    if (kbf) layout_row(self, mc, rounds, "bf16", "nhwc");
}

static void model_cases(const char *self, const char *baselines, int rounds, double rate)
{
    static const model_case cases[] = {
        {"lenet", "lenet_b128", 128, 20, 100, 2.0},
        {"resnet18_cifar", "resnet18_cifar_b64", 64, 2, 5, 1.5},
        {"resnet50", "resnet50_b8", 8, 2, 5, 1.5},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const model_case *mc = &cases[c];
        double kms[8], rms[8], krss[8], rrss[8], kfirst[8], flops = NAN;
        char cmd[4096];
        for (int r = 0; r < rounds; r++) {
            snprintf(cmd, sizeof cmd, "%s --step %s %lld %d %d", self, mc->model,
                     (long long)mc->batch, mc->warm, mc->steps);
            step_result k = run_child(cmd);
            if (isnan(k.ms)) die("kpl training step (see above)");
            kms[r] = k.ms;
            krss[r] = k.rss;
            kfirst[r] = k.first;
            flops = k.flops;
            if (!strcmp(mc->model, "lenet"))
                snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/torch_fmnist.py lenet 2 1", baselines);
            else
                snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/torch_resnet.py %s train 2 %lld %d %d",
                         baselines, strcmp(mc->model, "resnet50") ? "r18" : "r50",
                         (long long)mc->batch, mc->warm, mc->steps);
            step_result t = run_child(cmd);
            rms[r] = t.ms;
            rrss[r] = t.rss;
        }
        char n1[BENCH_NUM_LEN], n2[BENCH_NUM_LEN], n3[BENCH_NUM_LEN], n4[BENCH_NUM_LEN],
            n5[BENCH_NUM_LEN], n6[BENCH_NUM_LEN];
        double kmed = bench_median(kms, rounds), rmed = bench_median(rms, rounds);
        double kimg = 1e3 * (double)mc->batch / kmed, rimg = 1e3 * (double)mc->batch / rmed;
        double gflops = flops * kimg / 1e9, tgflops = flops * rimg / 1e9;
        double kr = bench_median(krss, rounds), tr = bench_median(rrss, rounds);
        char ms_k[BENCH_RANGE_LEN], ms_r[BENCH_RANGE_LEN];
        bench_jrange(ms_k, kms, rounds);
        bench_jrange(ms_r, rms, rounds);
        bench_emit("train_step", mc->label, "img/s", 1, kimg, rimg, "torch-cpu", mc->target,
                   ",\"ms_kpl\":%s,\"ms_ref\":%s,\"gflops_kpl\":%s,\"gflops_ref\":%s,"
                   "\"matmul_gflops\":%s,\"fraction_of_matmul\":%s,\"maxrss_mib_kpl\":%s,"
                   "\"first_step_ms_kpl\":%s",
                   ms_k, ms_r, bench_jnum(n1, gflops), bench_jnum(n2, tgflops),
                   bench_jnum(n3, rate), bench_jnum(n4, gflops / rate), bench_jnum(n5, kr),
                   bench_jnum(n6, bench_median(kfirst, rounds)));
        if (!strcmp(mc->model, "resnet50"))
            bench_emit("train_peak_rss", mc->label, "MiB", 0, kr, tr, "torch-cpu", 1 / 0.8, NULL);
        if (strcmp(mc->model, "lenet")) strongest(self, baselines, mc, rounds);
    }
}

/* ---- fusions ---------------------------------------------------------------------- */

/* A (n, c, hw, hw) activation as a training step has it: a convolution's
 * output, detached; held blocked when `blocked` and the CPU's kernel is
 * (oneDNN's own preference: its timed choice for one lone convolution can
 * be the plain GEMM one, unlike in a network). */
static kpl_tensor *activation(kpl_rng *rng, kpl_dtype prec, int64_t n, int64_t c, int64_t hw,
                              bool leaf, bool blocked)
{
    bool det = kpl_get_deterministic(), blk = kpl_set_blocked_layouts(blocked);
    kpl_set_deterministic(true);
    kpl_device *cpu = kpl_device_cpu();
    kpl_tensor *in = kpl_randn(cpu, KPL_F32, 4, (int64_t[]){n, c, hw, hw}, rng, 0, 1);
    kpl_tensor *w = kpl_randn(cpu, KPL_F32, 4, (int64_t[]){c, c, 3, 3}, rng, 0, 0.05);
    kpl_conv2d_params p = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    if (kpl_set_autocast(prec, NULL) < 0) die("autocast");
    kpl_tensor *y = kpl_detach(kpl_conv2d(in, w, NULL, &p));
    kpl_set_deterministic(det);
    kpl_set_blocked_layouts(blk);
    if (kpl_set_autocast(KPL_F32, NULL) < 0 || !y) die("activation");
    if (leaf && kpl_set_requires_grad(y, true) < 0) die("requires_grad");
    return y;
}

/* One fused-or-composed training piece: batch norm + ReLU of x (gamma
 * a, beta b) backward from gy, or a 3x3 convolution of x (weights a,
 * bias b) + ReLU backward from an f32 sum. */
typedef struct {
    bool conv;
    kpl_dtype prec;
    kpl_tensor *x, *a, *b, *gy;
} fuse_case;

static void fuse_step(const fuse_case *c, bool fused)
{
    kpl_conv2d_params p = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    kpl_tensor *y, *out, *gout = NULL;
    if (c->conv) {
        if (kpl_set_autocast(c->prec, NULL) < 0) die("autocast");
        y = fused ? kpl_conv2d_relu(c->x, c->a, c->b, &p)
                  : kpl_relu(kpl_conv2d(c->x, c->a, c->b, &p));
        kpl_set_autocast(KPL_F32, NULL);
        out = kpl_sum(kpl_cast(y, KPL_F32), NULL, 0, false);
    } else {
        out = fused ? kpl_batch_norm_relu(c->x, c->a, c->b, NULL, NULL, true, 0.1, 1e-5)
                    : kpl_relu(kpl_batch_norm(c->x, c->a, c->b, NULL, NULL, true, 0.1, 1e-5));
        gout = c->gy;
    }
    kpl_tensor *ins[3] = {c->x, c->a, c->b}, *grads[3];
    if (!out || kpl_grad(out, gout, 3, ins, false, grads) < 0) die(kpl_last_error());
}

/* The fused and composed pieces alternating, 3 x rounds each after a
 * warm-up: one row with their median ms. */
static void fuse_row(const char *bench, const char *label, const char *ref, const fuse_case *c,
                     int rounds, const char *extra)
{
    int reps = 3 * rounds;
    double ms[2][24];
    for (int r = 0; r < reps + 1; r++)
        for (int fused = 0; fused < 2; fused++) {
            kpl_pool *it = kpl_pool_push();
            double t0 = bench_now();
            fuse_step(c, fused);
            if (r) ms[fused][r - 1] = 1e3 * (bench_now() - t0);
            kpl_pool_pop(it);
        }
    bench_emit(bench, label, "ms", 0, bench_median(ms[1], reps), bench_median(ms[0], reps), ref,
               NAN, extra ? "%s" : NULL, extra);
}

static kpl_tensor *param_full(int nd, const int64_t *shape, double v, kpl_rng *rng)
{
    kpl_device *cpu = kpl_device_cpu();
    kpl_tensor *t = rng ? kpl_randn(cpu, KPL_F32, nd, shape, rng, 0, v)
                        : kpl_full(cpu, KPL_F32, nd, shape, v);
    if (!t || kpl_set_requires_grad(t, true) < 0) die("parameters");
    return t;
}

/* Batch norm + ReLU forward and backward (training statistics), fused
 * (kpl_batch_norm_relu) against the two ops, on ResNet's activations,
 * blocked and plain; then a 3x3 convolution with bias + ReLU
 * (kpl_conv2d_relu: oneDNN's post-op) against the two ops.  f32 and bf16
 * (where the CPU has it). */
static void fusion_cases(int rounds)
{
    static const int64_t bn_shapes[][3] = {{64, 64, 32}, {8, 256, 56}};
    static const int64_t conv_shapes[][3] = {{64, 64, 32}, {8, 128, 56}};
    const kpl_dtype precs[2] = {KPL_F32, KPL_BF16};
    for (int pi = 0; pi < 2; pi++) {
        kpl_dtype prec = precs[pi];
        if (prec == KPL_BF16 && !kpl_precision_native(KPL_DEVICE_CPU, KPL_BF16)) {
            fprintf(stderr, "bench_nn: no native bf16 here (%s): bf16 fusions skipped\n",
                    kpl_cpu_math_info());
            continue;
        }
        for (int si = 0; si < 4; si++) {
            const int64_t *sh = bn_shapes[si / 2];
            bool want_blocked = si % 2 == 0;
            kpl_pool *pool = kpl_pool_push();
            kpl_rng *rng = kpl_rng_create(5);
            fuse_case c = {false, prec,
                           activation(rng, prec, sh[0], sh[1], sh[2], true, want_blocked),
                           param_full(1, &sh[1], 1, NULL), param_full(1, &sh[1], 0.1, NULL),
                           activation(rng, prec, sh[0], sh[1], sh[2], false, want_blocked)};
            char label[96], extra[64];
            snprintf(label, sizeof label, "%lldx%lldx%lldx%lld_%s_%s", (long long)sh[0],
                     (long long)sh[1], (long long)sh[2], (long long)sh[2], kpl_dtype_name(prec),
                     want_blocked ? "blocked" : "plain");
            bool held = kpl__kept(c.x) != KPL_KEPT_PLAIN;
            if (want_blocked && !held)
                fprintf(stderr, "bench_nn: bn_relu %s: the convolution's output is not blocked "
                                "here (%s)\n", label, kpl_cpu_math_info());
            snprintf(extra, sizeof extra, ",\"blocked\":%s", held ? "true" : "false");
            fuse_row("bn_relu_fwd_bwd", label, "kpl-bn-then-relu", &c, rounds, extra);
            kpl_rng_destroy(rng);
            kpl_pool_pop(pool);
        }
        for (int si = 0; si < 2; si++) {
            const int64_t *sh = conv_shapes[si];
            kpl_pool *pool = kpl_pool_push();
            kpl_rng *rng = kpl_rng_create(6);
            fuse_case c = {true, prec, activation(rng, prec, sh[0], sh[1], sh[2], true, true),
                           param_full(4, (int64_t[]){sh[1], sh[1], 3, 3}, 0.05, rng),
                           param_full(1, &sh[1], 0.1, rng), NULL};
            char label[96];
            snprintf(label, sizeof label, "%lldx%lldx%lldx%lld_k3_%s", (long long)sh[0],
                     (long long)sh[1], (long long)sh[2], (long long)sh[2], kpl_dtype_name(prec));
            fuse_row("conv_relu_fwd_bwd", label, "kpl-conv-then-relu", &c, rounds, NULL);
            kpl_rng_destroy(rng);
            kpl_pool_pop(pool);
        }
    }
}

int main(int argc, char **argv)
{
    if (argc >= 6 && !strcmp(argv[1], "--step")) {
        /* options: bf16 (autocast), plain (no kept layouts), nhwc / nchw16c
         * (every convolution asked for that kept layout), deterministic
         * (untimed algorithm choice) */
        kpl_dtype prec = KPL_F32;
        const char *devname = "cpu";
        bool recompute = false; /* memory.recompute: blocks */
        double budget_mb = 0;   /* memory.recompute: auto, memory.budget_mb */
        for (int i = 6; i < argc; i++) {
            if (!strcmp(argv[i], "bf16")) prec = KPL_BF16;
            else if (!strcmp(argv[i], "fp16")) prec = KPL_F16;
            else if (!strcmp(argv[i], "f32")) prec = KPL_F32;
            else if (!strcmp(argv[i], "plain")) kpl_set_blocked_layouts(false);
            else if (!strcmp(argv[i], "nhwc")) kpl_set_kept_layout(KPL_LAYOUT_NHWC);
            else if (!strcmp(argv[i], "nchw16c")) kpl_set_kept_layout(KPL_LAYOUT_NCHW16C);
            else if (!strcmp(argv[i], "deterministic")) kpl_set_deterministic(true);
            else if (!strcmp(argv[i], "recompute")) recompute = true;
            else if (!strncmp(argv[i], "budget=", 7))
                budget_mb = atof(argv[i] + 7);
            else if (!strcmp(argv[i], "tf32")) kpl_set_tf32(true);
            else if (!strncmp(argv[i], "device=", 7)) devname = argv[i] + 7;
            else
                die("--step: unknown option (f32, bf16, fp16, plain, nhwc, nchw16c, "
                    "deterministic, recompute, budget=MIB, tf32, device=NAME)");
        }
        return run_steps(argv[2], atoll(argv[3]), atoi(argv[4]), atoi(argv[5]), prec, devname,
                         recompute, budget_mb);
    }
    if (argc != 3) {
        fprintf(stderr, "usage: bench_nn BASELINES_DIR BENCH_DIR | bench_nn --step MODEL BATCH "
                        "WARMUP STEPS [f32|bf16|fp16] [plain|nhwc|nchw16c] [deterministic] "
                        "[recompute] [budget=MIB] [tf32] [device=NAME]\n");
        return 2;
    }
    char self[2048];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) die("cannot find my own executable");
    self[len] = 0;
    int rounds = bench_env_int("KPL_BENCH_ROUNDS", 3, 1, 8);
    /* "models", "layers", "fusions", "dilated" or "recompute" */
    const char *only = getenv("KPL_BENCH_NN_ONLY");
    double rate = matmul_rate();
    fprintf(stderr, "bench_nn: 2-thread f32 matmul 1024^3: %.1f GFLOP/s\n", rate);
    if (!only || !strcmp(only, "models")) model_cases(self, argv[1], rounds, rate);
    if (!only || !strcmp(only, "layers")) conv_layers(argv[2], rate);
    if (!only || !strcmp(only, "fusions")) fusion_cases(rounds);
    if (!only || !strcmp(only, "dilated")) dilated_cases();
    if (!only || !strcmp(only, "recompute")) recompute_cases(self, argv[2], argv[1], rounds);
    return bench_exit_code();
}
