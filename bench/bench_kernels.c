/*
 * bench_kernels.c — `bench/run.sh kernels`: element-wise bandwidth and GEMM
 * throughput of kpl's CPU kernels, each next to its reference in the same
 * process run, alternating the two sides over several rounds and printing
 * medians.
 *
 *   bench_kernels BASELINES_DIR TOOLS_DIR
 *
 * BASELINES_DIR is ../shared/baselines (gemm_bench.py); TOOLS_DIR holds
 * fma_peak and memcpy_bw built from it by run.sh.
 */
#include "bench_common.h"
#include "kernels.h"

#include <omp.h>

#define ROUNDS 5

static const char *baselines, *tools;

static void die(const char *what)
{
    fprintf(stderr, "bench_kernels: %s: %s\n", what, kpl_last_error());
    exit(1);
}

static kpl_tensor *make(int64_t n0, int64_t n1, double fill)
{
    kpl_tensor *t = NULL;
    int64_t s[2] = {n0, n1};
    if (kpl_tensor_empty(kpl_device_cpu(), KPL_F32, n1 ? 2 : 1, s, &t) < 0) die("alloc");
    if (kpl_k_fill(t, fill) < 0) die("fill");
    return t;
}

/* ---- element-wise add vs memcpy --------------------------------------------- */

/* Read+write bytes per second of a memcpy split across `threads`. */
static double memcpy_rate(char *dst, const char *src, size_t bytes, int threads)
{
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        double t0 = bench_now();
#pragma omp parallel num_threads(threads)
        {
            int i = omp_get_thread_num(), k = omp_get_num_threads();
            size_t s = bytes * (size_t)i / (size_t)k, e = bytes * (size_t)(i + 1) / (size_t)k;
            memcpy(dst + s, src + s, e - s);
        }
        double t = bench_now() - t0;
        if (t < best) best = t;
    }
    return 2.0 * (double)bytes / best;
}

static void bench_add(void)
{
    const int64_t n = (int64_t)64 << 20;
    kpl_tensor *a = make(n, 0, 1.0), *b = make(n, 0, 2.0), *c = make(n, 0, 0.0);
    size_t bytes = (size_t)256 << 20;
    char *src = malloc(bytes), *dst = malloc(bytes);
    if (!src || !dst) die("malloc");
    memset(src, 1, bytes);
    memset(dst, 2, bytes);
    /* The single-thread baseline program, for the record. */
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s/memcpy_bw 256", tools);
    double base = bench_run_ref(cmd, "memcpy", "MB: ");

    for (int threads = 1; threads <= 2; threads++) {
        kpl_set_num_threads(threads);
        double k[ROUNDS], r[ROUNDS];
        for (int round = 0; round < ROUNDS; round++) {
            double best = 1e30;
            for (int i = 0; i < 3; i++) {
                double t0 = bench_now();
                if (kpl_k_binary(c, KPL_BIN_ADD, a, b) < 0) die("add");
                double t = bench_now() - t0;
                if (t < best) best = t;
            }
            k[round] = 12.0 * (double)n / best / 1e9; /* read a, b; write c */
            r[round] = memcpy_rate(dst, src, bytes, threads) / 1e9;
        }
        double check;
        if (kpl_tensor_get(c, n - 1, &check) < 0 || check != 3.0) die("add gave a wrong value");
        char cas[64];
        snprintf(cas, sizeof cas, "add_f32_64M/t%d", threads);
        bench_emit("eltwise_add", cas, "GB/s", 1, bench_median(k, ROUNDS),
                   bench_median(r, ROUNDS), "memcpy", 0.7,
                   ",\"bytes_counted\":\"read+write\",\"memcpy_bw_baseline_1t_copy_rate\":%.2f",
                   isnan(base) ? 0.0 : base);
    }
    free(src);
    free(dst);
    kpl_tensor_release(a);
    kpl_tensor_release(b);
    kpl_tensor_release(c);
}

/* ---- matmul vs numpy (OpenBLAS) ------------------------------------------------ */

static double gemm_gflops(kpl_tensor *a, kpl_tensor *b, kpl_tensor *c, int64_t n, int reps)
{
    double t[16];
    for (int i = 0; i < reps; i++) {
        double t0 = bench_now();
        if (kpl_k_matmul(c, a, b, false, false) < 0) die("matmul");
        t[i] = bench_now() - t0;
    }
    return 2.0 * (double)n * (double)n * (double)n / bench_median(t, reps) / 1e9;
}

static void bench_matmul(void)
{
    /* FP32 FMA peak of one core, measured now (AVX-512 where the CPU has it). */
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[4096];
    int avx512 = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "flags", 5)) {
            avx512 = strstr(line, " avx512f") != NULL;
            break;
        }
    if (f) fclose(f);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s/fma_peak %d", tools, avx512 ? 512 : 256);
    double core_peak = bench_run_ref(cmd, "RESULT", "GFLOPs_med ");

    const int64_t sizes[2] = {1024, 2048};
    for (int threads = 1; threads <= 2; threads++) {
        kpl_set_num_threads(threads);
        double k[2][ROUNDS], r[2][ROUNDS];
        kpl_tensor *a[2], *b[2], *c[2];
        kpl_rng *rng = kpl_rng_create(0);
        for (int s = 0; s < 2; s++) {
            a[s] = make(sizes[s], sizes[s], 0);
            b[s] = make(sizes[s], sizes[s], 0);
            c[s] = make(sizes[s], sizes[s], 0);
            if (kpl_k_normal(a[s], rng, 0, 1) < 0 || kpl_k_normal(b[s], rng, 0, 1) < 0)
                die("normal");
            gemm_gflops(a[s], b[s], c[s], sizes[s], 2); /* warm-up, primitive creation */
        }
        int rounds = 3;
        for (int round = 0; round < rounds; round++) {
            for (int s = 0; s < 2; s++) k[s][round] = gemm_gflops(a[s], b[s], c[s], sizes[s], 7);
            /* numpy runs both sizes (3 warm-up + 15 timed each) in one go. */
            snprintf(cmd, sizeof cmd,
                     "OPENBLAS_NUM_THREADS=%d /usr/bin/python3 %s/gemm_bench.py numpy %d", threads,
                     baselines, threads);
            r[0][round] = r[1][round] = NAN;
            FILE *p = popen(cmd, "r");
            while (p && fgets(line, sizeof line, p))
                for (int q = 0; q < 2; q++) {
                    char want[64];
                    snprintf(want, sizeof want, " n=%lld ", (long long)sizes[q]);
                    const char *g = strstr(line, "GFLOPs_med=");
                    if (strstr(line, "RESULT") && strstr(line, want) && g)
                        r[q][round] = strtod(g + 11, NULL);
                }
            if (!p || pclose(p) != 0)
                fprintf(stderr, "bench_kernels: the numpy reference failed (is python3-numpy "
                                "installed? scripts/setup.sh --bench)\n");
        }
        for (int s = 0; s < 2; s++) {
            char cas[64];
            snprintf(cas, sizeof cas, "%lld^3/t%d", (long long)sizes[s], threads);
            double km = bench_median(k[s], rounds);
            int nref = 0;
            double rv[ROUNDS];
            for (int i = 0; i < rounds; i++)
                if (!isnan(r[s][i])) rv[nref++] = r[s][i];
            double peak = core_peak * threads;
            bench_emit("matmul", cas, "GFLOP/s", 1, km, nref ? bench_median(rv, nref) : NAN,
                       "numpy-openblas", 0.9,
                       ",\"peak_fraction\":%.3f,\"peak_gflops\":%.1f,\"peak_isa\":\"%s\","
                       "\"rounds\":%d",
                       isnan(peak) ? 0.0 : km / peak, isnan(peak) ? 0.0 : peak,
                       avx512 ? "avx512" : "avx2", rounds);
            kpl_tensor_release(a[s]);
            kpl_tensor_release(b[s]);
            kpl_tensor_release(c[s]);
        }
        kpl_rng_destroy(rng);
    }
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: bench_kernels BASELINES_DIR TOOLS_DIR\n");
        return 2;
    }
    baselines = argv[1];
    tools = argv[2];
    const char *wp = getenv("OMP_WAIT_POLICY");
    fprintf(stderr, "bench_kernels: OMP_WAIT_POLICY=%s\n", wp ? wp : "(default)");
    bench_add();
    bench_matmul();
    return 0;
}
