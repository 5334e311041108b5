/*
 * bench_autograd.c — `bench/run.sh autograd`: the reverse-mode GC's peak
 * memory and the eager dispatch overhead, next to PyTorch (the shared
 * torch_autograd.py, run in the same invocation).
 *
 *   bench_autograd BASELINES_DIR
 *
 * Cases:
 *  - mlp16x2048_b256 peak: allocator peak over one forward+backward of 16 x
 *    (Linear(2048) + ReLU), batch 256, softmax cross entropy, f32, above
 *    the parameters: GC on (the forward pool is closed before backward, so
 *    saved activations and gradients are freed as backward goes) against
 *    GC off (everything kept to the end of the step).  Target: GC on <= 0.6
 *    of GC off.  (Here the 268 MB of weight gradients, which no GC can
 *    free, are most of the GC-on peak.)  PyTorch's figure is its first step's peak RSS growth less
 *    its momentum buffers (= parameter bytes): activations + gradients +
 *    temporaries, measured by RSS because its CPU allocator has no counters.
 *  - tiny_add_grad: ns per eager add of 16 floats with grad recording,
 *    pool drained every 1000 ops (included).  Target < 1 us.
 */
#include "autograd.h"
#include "bench_common.h"

static void die(const char *what)
{
    fprintf(stderr, "bench_autograd: %s: %s\n", what, kpl_last_error());
    exit(1);
}

enum { LAYERS = 16, WIDTH = 2048, BATCH = 256 };

static size_t mlp_peak(bool gc, kpl_tensor **W, kpl_tensor **b, kpl_tensor *x,
                       kpl_tensor *onehot, double *ms)
{
    kpl_device *cpu = kpl_device_cpu();
    kpl_device_reset_peak(cpu);
    size_t base = kpl_device_memory_stats(cpu).allocated;
    double t0 = bench_now();
    kpl_pool *step = kpl_pool_push(), *fw = kpl_pool_push();
    kpl_tensor *h = x;
    for (int l = 0; l < LAYERS; l++)
        h = kpl_relu(kpl_add(kpl_matmul(h, W[l], false, false), b[l]));
    int ax = 1;
    kpl_tensor *loss = kpl_mean(kpl_sub(kpl_logsumexp(h, &ax, 1, false),
                                        kpl_sum(kpl_mul(h, onehot), &ax, 1, false)),
                                NULL, 0, false);
    if (!loss) die("forward");
    kpl_tensor_retain(loss);
    if (gc) kpl_pool_pop(fw);
    if (kpl_backward(loss, NULL, !gc) < 0) die("backward");
    kpl_tensor_release(loss);
    if (!gc) kpl_pool_pop(fw);
    kpl_pool_pop(step);
    *ms = (bench_now() - t0) * 1e3;
    size_t peak = kpl_device_memory_stats(cpu).peak_allocated - base;
    for (int l = 0; l < LAYERS; l++) {
        kpl_grad_set(W[l], NULL);
        kpl_grad_set(b[l], NULL);
    }
    return peak;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: bench_autograd BASELINES_DIR\n");
        return 2;
    }
    kpl_set_num_threads(2);
    kpl_device *cpu = kpl_device_cpu();
    kpl_rng *rng = kpl_rng_create(0);
    kpl_tensor *W[LAYERS], *b[LAYERS], *x = NULL, *onehot = NULL;
    int64_t ws[2] = {WIDTH, WIDTH}, bs[1] = {WIDTH}, xs[2] = {BATCH, WIDTH};
    for (int l = 0; l < LAYERS; l++) {
        if (kpl_tensor_empty(cpu, KPL_F32, 2, ws, &W[l]) < 0 ||
            kpl_k_normal(W[l], rng, 0, 0.02) < 0 || kpl_tensor_zeros(cpu, KPL_F32, 1, bs, &b[l]) < 0 ||
            kpl_set_requires_grad(W[l], true) < 0 || kpl_set_requires_grad(b[l], true) < 0)
            die("parameters");
    }
    if (kpl_tensor_empty(cpu, KPL_F32, 2, xs, &x) < 0 || kpl_k_normal(x, rng, 0, 1) < 0 ||
        kpl_tensor_zeros(cpu, KPL_F32, 2, xs, &onehot) < 0)
        die("inputs");
    float *oh = kpl_tensor_host_mutable(onehot);
    for (int i = 0; i < BATCH; i++) oh[i * WIDTH + (i * 37) % WIDTH] = 1;

    /* PyTorch first (its own process), then kpl: the two never overlap. */
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/torch_autograd.py 2", argv[1]);
    double torch_ns = NAN, torch_growth = NAN, torch_params = NAN;
    FILE *p = popen(cmd, "r");
    char line[2048];
    while (p && fgets(line, sizeof line, p)) {
        static const char *keys[3] = {"\"ns_per_op\": ", "\"first_step_peak_growth_bytes\": ",
                                      "\"param_bytes\": "};
        double *vals[3] = {&torch_ns, &torch_growth, &torch_params};
        for (int k = 0; k < 3; k++) {
            const char *at = strstr(line, keys[k]);
            if (at) *vals[k] = strtod(at + strlen(keys[k]), NULL);
        }
    }
    if (!p || pclose(p) != 0)
        fprintf(stderr, "bench_autograd: the PyTorch reference failed (scripts/setup.sh --bench)\n");

    double ms_off, ms_on;
    size_t off = mlp_peak(false, W, b, x, onehot, &ms_off);
    size_t on = mlp_peak(true, W, b, x, onehot, &ms_on);
    bench_emit("autograd_peak", "mlp16x2048_b256/gc_vs_keep", "bytes", 0, (double)on, (double)off,
               "kpl-gc-off", 1.0 / 0.6, ",\"step_ms_gc\":%.0f,\"step_ms_keep\":%.0f", ms_on,
               ms_off);
    double torch_equiv = torch_growth - torch_params;
    bench_emit("autograd_peak", "mlp16x2048_b256/vs_torch", "bytes", 0, (double)on,
               isnan(torch_equiv) ? NAN : torch_equiv, "torch-rss-growth-minus-momentum", NAN,
               ",\"torch_measure\":\"first-step peak RSS growth minus momentum bytes\"");

    /* dispatch overhead of a tiny recorded op */
    int64_t n16 = 16;
    kpl_tensor *a = NULL, *c = NULL;
    if (kpl_tensor_empty(cpu, KPL_F32, 1, &n16, &a) < 0 || kpl_k_fill(a, 1) < 0 ||
        kpl_tensor_empty(cpu, KPL_F32, 1, &n16, &c) < 0 || kpl_k_fill(c, 2) < 0 ||
        kpl_set_requires_grad(a, true) < 0)
        die("tiny");
    double runs[5];
    for (int r = 0; r < 5; r++) {
        const int n = 200000;
        double t0 = bench_now();
        for (int i = 0; i < n; i += 1000) {
            kpl_pool *pool = kpl_pool_push();
            for (int j = 0; j < 1000; j++)
                if (!kpl_add(a, c)) die("add");
            kpl_pool_pop(pool);
        }
        runs[r] = (bench_now() - t0) / n * 1e9;
    }
    bench_emit("dispatch", "tiny_add_grad", "ns/op", 0, bench_median(runs, 5), torch_ns, "torch",
               NAN, ",\"target_abs_ns\":1000");
    for (int l = 0; l < LAYERS; l++) {
        kpl_tensor_release(W[l]);
        kpl_tensor_release(b[l]);
    }
    kpl_tensor_release(x);
    kpl_tensor_release(onehot);
    kpl_tensor_release(a);
    kpl_tensor_release(c);
    kpl_rng_destroy(rng);
    return 0;
}
