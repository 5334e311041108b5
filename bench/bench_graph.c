/*
 * bench_graph.c — the static graph (graph/ir.h): inference through the
 * traced, fused, O3-planned graph against kpl's own eager forward, PyTorch
 * (shared/baselines/torch_resnet.py infer) and onnxruntime running the
 * ONNX file kpl exports of the same graph (bench/ort_infer.py), side by
 * side in alternating rounds; and the memory each level plans.
 *
 *   bench_graph BASELINES BENCH_DIR          every case, JSON lines on stdout
 *   bench_graph --child MODEL BATCH WARM STEPS {exec|eager|onnx PATH}
 *       one side in a process of its own: "RESULT ms_median=..." (or the
 *       ONNX file written)
 *   bench_graph --train-child MODEL BATCH WARM STEPS {exec LEVEL|eager}
 *       SGD training steps, eager or a traced step run by the executor:
 *       "RESULT ms_median=... peak_MiB=..."
 *
 * Rows (bench/README.md):
 *   infer_vs_ort/{model}_b{B}    ms per forward, kpl O3 graph vs onnxruntime
 *                                on kpl's ONNX export; target >= 1.0
 *   infer_vs_torch/{model}_b{B}  the same against PyTorch eval + no_grad
 *   infer_vs_eager/{model}_b{B}  the graph against kpl's eager forward
 *   infer_plan/{model}_b{B}      the bytes of the buffers each level plans
 *                                (O0: every value; O3: one arena)
 *   train_mem/resnet50_b8        a training step's peak memory beyond the
 *                                model and optimizer state: the traced step
 *                                at O3 (O0-O2 as fields) against eager with
 *                                reverse-mode GC; target O3 <= 0.85x eager
 *                                (ratio eager / O3 >= 1.18)
 *   train_vs_eager/lenet_b{128,16} ms per SGD step, the traced step at O3
 *                                against eager; target >= 1.2 (at 128)
 * Models: resnet18_cifar (32x32, the baselines' "r18") and resnet50 (224);
 * for inference also bench_seg's U-Net (w16, 128 px; batch 1 and 32) and
 * DeepLabv3-R18 (513 px, batch 1; batch 32 would take minutes a round on
 * two cores), against onnxruntime and kpl's eager forward (PyTorch's
 * segmentation inference is bench_seg's row).
 * Threads: 2 on every side (OMP_NUM_THREADS for kpl, torch.set_num_threads,
 * onnxruntime's intra-op threads).
 */
#include "bench_common.h"
#include "bench_zoo.h"
#include "trainer.h"

#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static void die(const char *what)
{
    fprintf(stderr, "bench_graph: %s: %s\n", what, kpl_last_error());
    exit(1);
}

/* The model in eval mode and its inference graph at `level` (fused). */
static kpl_ir *traced(kpl_module *m, const int64_t *shape, int level)
{
    kpl_pool *pool = kpl_pool_push();
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor *x = kpl_full(kpl_device_cpu(), KPL_F32, 4, shape, 0);
    if (!x || kpl_trace_begin() < 0) die("trace");
    kpl_tensor *y = kpl_module_forward(m, kpl_trace_input(x, "image"));
    kpl_ir *ir = NULL;
    if (!y || kpl_trace_end(1, &y, (const char *[]){"logits"}, &ir) < 0) die("trace");
    kpl_set_grad_enabled(prev);
    kpl_pool_pop(pool);
    int np = kpl_module_num_params(m), nb = kpl_module_num_buffers(m);
    const char *names[1024];
    kpl_tensor *ts[1024];
    int n = 0;
    for (int i = 0; i < np && n < 1024; i++, n++)
        names[n] = kpl_module_param_name(m, i), ts[n] = kpl_module_params(m)[i];
    for (int i = 0; i < nb && n < 1024; i++, n++)
        names[n] = kpl_module_buffer_name(m, i), ts[n] = kpl_module_buffers(m)[i];
    kpl_ir_name_params(ir, n, names, ts);
    if (kpl_ir_optimize(ir, level, true) < 0) die("passes");
    return ir;
}

static bool is_seg(const char *name) { return !strcmp(name, "unet") || !strcmp(name, "deeplab"); }

/* A segmentation network's input side: U-Net 128, DeepLab 513 (bench_seg's). */
static int64_t seg_size(const char *name) { return strcmp(name, "unet") ? 513 : 128; }

static kpl_module *model(const char *name, int64_t *shape, int64_t batch)
{
    kpl_module *m = NULL;
    int64_t hw = strcmp(name, "resnet50") ? 32 : 224, ch = 3;
    if (is_seg(name)) {
        kpl_model_config mc;
        char tag[64];
        hw = seg_size(name), ch = strcmp(name, "unet") ? 3 : 1;
        if (bench_seg_config(name, hw, 16, &mc, tag, sizeof tag) < 0 ||
            kpl_zoo_create(&mc, kpl_device_cpu(), 0, &m) < 0)
            die("model");
    } else if (bench_zoo(name, strcmp(name, "resnet50") ? 10 : 1000, kpl_device_cpu(), 0, &m) < 0) {
        die("model");
    }
    kpl_module_set_training(m, false);
    int64_t s[4] = {batch, ch, hw, hw};
    memcpy(shape, s, sizeof s);
    return m;
}

static int child(int argc, char **argv)
{
    if (argc < 7) return 2;
    const char *name = argv[2], *mode = argv[6];
    int64_t batch = atoll(argv[3]), shape[4];
    int warm = atoi(argv[4]), steps = atoi(argv[5]);
    kpl_module *m = model(name, shape, batch);
    kpl_tensor *x = NULL;
    kpl_rng *rng = kpl_rng_create(0);
    if (kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 4, shape, &x) < 0 ||
        kpl_k_normal(x, rng, 0, 1) < 0)
        die("input");
    if (!strcmp(mode, "onnx")) {
        kpl_ir *ir = traced(m, shape, 3);
        if (argc < 8 || kpl_onnx_export(ir, argv[7]) < 0) die("onnx export");
        kpl_ir_destroy(ir);
        printf("RESULT onnx=%s\n", argv[7]);
        return 0;
    }
    bool graph = !strcmp(mode, "exec");
    kpl_ir *ir = graph ? traced(m, shape, 3) : NULL;
    kpl_exec *ex = NULL;
    if (graph && kpl_exec_create(ir, &ex) < 0) die("executor");
    double ms[256];
    if (steps > 256) steps = 256;
    bool prev = kpl_set_grad_enabled(false);
    for (int i = 0; i < warm + steps; i++) {
        double t0 = bench_now();
        if (graph) {
            if (kpl_exec_set_input(ex, 0, x) < 0 || kpl_exec_run(ex) < 0) die("run");
            (void)kpl_tensor_host_data(kpl_exec_output(ex, 0));
        } else {
            kpl_pool *p = kpl_pool_push();
            kpl_tensor *y = kpl_module_forward(m, x);
            if (!y) die("forward");
            (void)kpl_tensor_host_data(y);
            kpl_pool_pop(p);
        }
        if (i >= warm) ms[i - warm] = (bench_now() - t0) * 1e3;
    }
    kpl_set_grad_enabled(prev);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    int kl = graph ? kpl_exec_get_stats(ex).kept_layout : -1;
    printf("RESULT mode=%s ms_median=%.3f maxrss_MiB=%.0f layout=%s\n", mode,
           bench_median(ms, steps), (double)ru.ru_maxrss / 1024.0,
           kl == KPL_LAYOUT_NHWC      ? "nhwc"
           : kl == KPL_LAYOUT_NCHW16C ? "nchw16c"
           : kl == KPL_LAYOUT_AUTO    ? "auto"
                                      : "untuned");
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    kpl_tensor_release(x);
    kpl_rng_destroy(rng);
    kpl_module_destroy(m);
    return 0;
}

/* The buffers each level plans for the model's graph. */
static void plan_row(const char *name, int64_t batch)
{
    int64_t shape[4];
    kpl_module *m = model(name, shape, batch);
    double bytes[4];
    size_t values = 0;
    for (int lv = 0; lv < 4; lv++) {
        kpl_ir *ir = traced(m, shape, lv);
        kpl_exec *ex = NULL;
        if (kpl_exec_create(ir, &ex) < 0) die("plan");
        kpl_exec_stats s = kpl_exec_get_stats(ex);
        bytes[lv] = (double)s.arena_bytes / 1048576.0;
        values = s.value_bytes;
        kpl_exec_destroy(ex);
        kpl_ir_destroy(ir);
    }
    char label[64], b0[BENCH_NUM_LEN], b1[BENCH_NUM_LEN], b2[BENCH_NUM_LEN];
    snprintf(label, sizeof label, "%s_b%lld", name, (long long)batch);
    bench_emit("infer_plan", label, "MiB", 0, bytes[3], bytes[0], "kpl-O0", NAN,
               ",\"O1_MiB\":%s,\"O2_MiB\":%s,\"values_MiB\":%s", bench_jnum(b0, bytes[1]),
               bench_jnum(b1, bytes[2]), bench_jnum(b2, (double)values / 1048576.0));
    kpl_module_destroy(m);
}

/* A kpl child's RESULT line: its median and the layout its executor chose. */
typedef struct {
    double ms;
    char layout[16];
} exec_result;

static void exec_line(const char *line, void *ctx)
{
    exec_result *r = ctx;
    if (strncmp(line, "RESULT", 6)) return;
    const char *at = strstr(line, "ms_median=");
    if (at) r->ms = strtod(at + 10, NULL);
    if ((at = strstr(line, "layout=")))
        snprintf(r->layout, sizeof r->layout, "%.*s", (int)strcspn(at + 7, " \n"), at + 7);
}

static void infer_rows(const char *self, const char *baselines, const char *benchdir,
                       const char *name, int64_t batch, int warm, int steps, int rounds)
{
    char cmd[4096], onnx[256];
    snprintf(onnx, sizeof onnx, "/tmp/kpl-bench-graph-%d-%s-b%lld.onnx", (int)getpid(), name,
             (long long)batch);
    snprintf(cmd, sizeof cmd, "%s --child %s %lld 0 0 onnx %s", self, name, (long long)batch, onnx);
    bool have_onnx = bench_run_lines(cmd, NULL, NULL) == 0;
    double g[16], e[16], t[16], o[16];
    char layout[16] = "?"; /* the last round's */
    for (int r = 0; r < rounds && r < 16; r++) {
        snprintf(cmd, sizeof cmd, "%s --child %s %lld %d %d exec", self, name, (long long)batch,
                 warm, steps);
        exec_result er = {NAN, "?"};
        if (bench_run_lines(cmd, exec_line, &er) < 0) er.ms = NAN;
        g[r] = er.ms;
        memcpy(layout, er.layout, sizeof layout);
        snprintf(cmd, sizeof cmd, "%s --child %s %lld %d %d eager", self, name, (long long)batch,
                 warm, steps);
        e[r] = bench_run_ref(cmd, "RESULT", "ms_median=");
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/torch_resnet.py %s infer 2 %lld %d %d",
                 baselines, strcmp(name, "resnet50") ? "r18" : "r50", (long long)batch, warm, steps);
        t[r] = is_seg(name) ? NAN : bench_run_ref(cmd, "RESULT", "ms_median=");
        o[r] = NAN;
        if (have_onnx) {
            snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/ort_infer.py %s 2 %d %d", benchdir, onnx,
                     warm, steps);
            o[r] = bench_run_ref(cmd, "RESULT", "ms_median=");
        }
    }
    unlink(onnx);
    int n = rounds < 16 ? rounds : 16;
    char label[96], rg[BENCH_RANGE_LEN];
    if (is_seg(name)) {
        kpl_model_config mc;
        char tag[64];
        if (bench_seg_config(name, seg_size(name), 16, &mc, tag, sizeof tag) < 0) die("model");
        snprintf(label, sizeof label, "%s_%lld_b%lld", tag, (long long)seg_size(name),
                 (long long)batch);
    } else {
        snprintf(label, sizeof label, "%s_b%lld", name, (long long)batch);
    }
    bench_jrange(rg, g, n);
    double gm = bench_median(g, n);
    char isa[48];
    bench_kpl_isa(isa, sizeof isa);
    bench_emit("infer_vs_ort", label, "ms", 0, gm, bench_median(o, n), "onnxruntime-kpl-onnx",
               1.0, ",\"kpl_range\":%s,\"kpl_isa\":\"%s\",\"kpl_layout\":\"%s\","
               "\"ref_kernels\":\"onnxruntime CPUExecutionProvider (MLAS)\","
               "\"omp_wait_policy\":\"%s\"",
               rg, isa, layout, getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "unset");
    if (!is_seg(name)) /* PyTorch's seg inference: bench_seg's rows */
        bench_emit("infer_vs_torch", label, "ms", 0, gm, bench_median(t, n), "pytorch-eval-f32",
                   NAN, NULL);
    bench_emit("infer_vs_eager", label, "ms", 0, gm, bench_median(e, n), "kpl-eager", NAN, NULL);
}

/* ---- training steps ---- */

/* SGD (momentum 0.9, weight decay 1e-4) steps on random data, in training
 * mode: the first eager (the momenta are made there); then either eager
 * steps or step 2 traced and the rest run by the executor at `level`.
 * Peak: the device's peak allocation during the measured steps (the
 * executor's plan made among them) beyond what was allocated before. */
static int train_child(int argc, char **argv)
{
    if (argc < 7) return 2;
    const char *name = argv[2], *mode = argv[6];
    int64_t batch = atoll(argv[3]);
    int warm = atoi(argv[4]), steps = atoi(argv[5]);
    int level = argc > 7 ? atoi(argv[7]) : 3;
    bool lenet = !strcmp(name, "lenet");
    int64_t classes = lenet ? 10 : 1000, hw = lenet ? 28 : 224;
    int64_t shape[4] = {batch, lenet ? 1 : 3, hw, hw};
    kpl_device *cpu = kpl_device_cpu();
    kpl_module *m = NULL;
    if (bench_zoo(name, classes, cpu, 0, &m) < 0) die("model");
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    oc.lr = 0.01, oc.momentum = 0.9, oc.weight_decay = 1e-4;
    kpl_optim *opt = NULL;
    if (kpl_optim_create(&oc, kpl_module_num_params(m), kpl_module_params(m), NULL, &opt) < 0)
        die("optimizer");
    kpl_tensor *x = NULL, *y = NULL;
    kpl_rng *rng = kpl_rng_create(0);
    int64_t *lab = malloc((size_t)batch * sizeof *lab);
    for (int64_t i = 0; i < batch; i++) lab[i] = (i * 7) % classes;
    if (!lab || kpl_tensor_empty(cpu, KPL_F32, 4, shape, &x) < 0 || kpl_k_normal(x, rng, 0, 1) < 0 ||
        kpl_tensor_from_data(cpu, KPL_I64, 1, &batch, lab, &y) < 0)
        die("input");
    bool graph = !strcmp(mode, "exec");
    kpl_ir *ir = NULL;
    kpl_exec *ex = NULL;
    size_t base = 0;
    double ms[256];
    if (steps > 256) steps = 256;
    for (int i = -2; i < warm + steps; i++) {
        if (i == 0 && !graph) { /* what is allocated before the measured steps */
            base = kpl_device_memory_stats(cpu).allocated;
            kpl_device_reset_peak(cpu);
        }
        double t0 = bench_now();
        if (graph && i >= 0) {
            if (kpl_exec_set_input(ex, 0, x) < 0 || kpl_exec_set_input(ex, 1, y) < 0 ||
                kpl_exec_run(ex) < 0)
                die("run");
            (void)kpl_tensor_host_data(kpl_exec_output(ex, 0));
        } else {
            kpl_pool *p = kpl_pool_push();
            bool trace = graph && i == -1;
            if (trace && kpl_trace_begin() < 0) die("trace");
            kpl_tensor *xi = trace ? kpl_trace_input(x, "image") : x;
            kpl_tensor *yi = trace ? kpl_trace_input(y, "label") : y;
            kpl_tensor *loss = kpl_cross_entropy(kpl_module_forward(m, xi), yi, KPL_REDUCE_MEAN, 0, -100);
            if (!loss || kpl_backward(loss, NULL, false) < 0 || kpl_optim_step(opt) < 0) die("step");
            if (trace) {
                if (kpl_trace_end(1, &loss, (const char *[]){"loss"}, &ir) < 0) die("trace");
            } else {
                (void)kpl_tensor_host_data(loss);
            }
            kpl_pool_pop(p);
            if (trace) {
                if (kpl_ir_optimize(ir, level, false) < 0) die("passes");
                base = kpl_device_memory_stats(cpu).allocated; /* the trace's tensors gone */
                kpl_device_reset_peak(cpu);
                if (kpl_exec_create(ir, &ex) < 0) die("executor");
                kpl_exec_stats es = kpl_exec_get_stats(ex);
                fprintf(stderr, "plan O%d: arena %.1f MiB, most alive at once %.1f MiB, %d in place\n",
                        level, es.arena_bytes / 1048576.0, es.live_bytes / 1048576.0, es.n_inplace);
            }
        }
        if (i >= warm) ms[i - warm] = (bench_now() - t0) * 1e3;
    }
    double peak = (double)(kpl_device_memory_stats(cpu).peak_allocated - base) / 1048576.0;
    printf("RESULT mode=%s ms_median=%.3f peak_MiB=%.1f\n", mode, bench_median(ms, steps), peak);
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    kpl_tensor_release(x);
    kpl_tensor_release(y);
    free(lab);
    kpl_rng_destroy(rng);
    kpl_optim_destroy(opt);
    kpl_module_destroy(m);
    return 0;
}

static void train_rows(const char *self, int rounds)
{
    char cmd[1024];
    /* peak memory: one run per side is enough (the plan is deterministic) */
    double mem[5];
    for (int lv = 0; lv <= 4; lv++) {
        if (lv < 4)
            snprintf(cmd, sizeof cmd, "%s --train-child resnet50 8 0 1 exec %d", self, lv);
        else
            snprintf(cmd, sizeof cmd, "%s --train-child resnet50 8 0 1 eager", self);
        mem[lv] = bench_run_ref(cmd, "RESULT", "peak_MiB=");
    }
    char b0[BENCH_NUM_LEN], b1[BENCH_NUM_LEN], b2[BENCH_NUM_LEN], b3[BENCH_NUM_LEN];
    bench_emit("train_mem", "resnet50_b8", "MiB", 0, mem[3], mem[4], "kpl-eager-gc", 1 / 0.85,
               ",\"O0_MiB\":%s,\"O1_MiB\":%s,\"O2_MiB\":%s,\"O3_over_eager\":%s",
               bench_jnum(b0, mem[0]), bench_jnum(b1, mem[1]), bench_jnum(b2, mem[2]),
               bench_jnum(b3, mem[3] / mem[4]));
    /* batch 128 (the case), and 16, where dispatch weighs more */
    for (int batch = 128; batch >= 16; batch /= 8) {
        double g[16], e[16];
        int n = rounds < 16 ? rounds : 16;
        for (int r = 0; r < n; r++) {
            snprintf(cmd, sizeof cmd, "%s --train-child lenet %d 5 40 exec 3", self, batch);
            g[r] = bench_run_ref(cmd, "RESULT", "ms_median=");
            snprintf(cmd, sizeof cmd, "%s --train-child lenet %d 5 40 eager", self, batch);
            e[r] = bench_run_ref(cmd, "RESULT", "ms_median=");
        }
        char rg[BENCH_RANGE_LEN], label[32];
        bench_jrange(rg, g, n);
        snprintf(label, sizeof label, "lenet_b%d", batch);
        bench_emit("train_vs_eager", label, "ms", 0, bench_median(g, n), bench_median(e, n),
                   "kpl-eager", batch == 128 ? 1.2 : NAN, ",\"kpl_range\":%s", rg);
    }
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "--child")) return child(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "--train-child")) return train_child(argc, argv);
    if (argc < 3) {
        fprintf(stderr, "usage: bench_graph BASELINES BENCH_DIR\n");
        return 2;
    }
    setenv("OMP_NUM_THREADS", "2", 0);
    int rounds = bench_env_int("KPL_BENCH_ROUNDS", 5, 1, 16);
    plan_row("resnet18_cifar", 32);
    plan_row("resnet50", 8);
    train_rows(argv[0], rounds);
    /* warm-ups past the executor's layout tuning (kpl_exec_run: up to 27
     * runs where a run is short, 9 where it is long) */
    infer_rows(argv[0], argv[1], argv[2], "resnet18_cifar", 1, 27, 30, rounds);
    infer_rows(argv[0], argv[1], argv[2], "resnet18_cifar", 32, 9, 10, rounds);
    infer_rows(argv[0], argv[1], argv[2], "resnet50", 1, 27, 10, rounds);
    infer_rows(argv[0], argv[1], argv[2], "resnet50", 32, 9, 3, rounds);
    infer_rows(argv[0], argv[1], argv[2], "unet", 1, 27, 10, rounds);
    infer_rows(argv[0], argv[1], argv[2], "unet", 32, 9, 3, rounds);
    infer_rows(argv[0], argv[1], argv[2], "deeplab", 1, 9, 3, rounds);
    return bench_exit_code();
}
