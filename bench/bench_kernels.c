/*
 * bench_kernels.c — `bench/run.sh kernels`: memory bandwidth of an
 * element-wise kernel and GEMM throughput of kpl's CPU kernels, each next to
 * its reference in the same run.  The two sides alternate over ROUNDS
 * rounds (which side goes first alternates too), and medians are printed.
 *
 *   bench_kernels BASELINES_DIR TOOLS_DIR
 *
 * BASELINES_DIR is ../shared/baselines (gemm_bench.py is run from there);
 * TOOLS_DIR holds memcpy_bw and fma_peak, compiled from it by run.sh.
 * Environment: KPL_BENCH_ROUNDS (default 5); OMP_WAIT_POLICY is set by
 * run.sh (PASSIVE unless overridden) and recorded in every line.
 *
 * Cases (bench/README.md):
 *  - eltwise add_f32_64M/t{1,2}: c = a + b over 64M f32 (kpl_k_binary on
 *    preallocated tensors), GB/s counting 12 bytes per element (two reads,
 *    one write).  Reference, counted the same way (read + write):
 *    t1 = memcpy_bw.c's copy rate x 2; t2 = a memcpy of 256 MB split over
 *    2 OpenMP threads in this process, 2 x bytes copied / s.  Each round
 *    takes the best of 9 runs on both sides (memcpy_bw's own statistic).
 *    Target 0.7.
 *  - matmul {1024,2048}^3/t{1,2}: f32 C = A @ B with kpl_k_matmul, 3
 *    warm-up + 15 timed runs, median, GFLOP/s = 2 n^3 / t; reference numpy
 *    + OpenBLAS (gemm_bench.py numpy T with OPENBLAS_NUM_THREADS=T, which
 *    does the same 3 + 15 runs per size).  Target 0.9.  peak_fraction is
 *    kpl / (one core's FP32 FMA peak x T), the peak measured each round by
 *    fma_peak.c with the widest vectors /proc/cpuinfo offers.
 */
#include "bench_common.h"
#include "kernels.h"

#include <omp.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct {
    const char *baselines, *tools;
    int rounds;
    const char *wait_policy; /* as exported by run.sh, for the record */
} bench_cfg;

#define MAX_ROUNDS 50

static void die(const char *what)
{
    fprintf(stderr, "bench_kernels: %s: %s\n", what, kpl_last_error());
    exit(1);
}

/* A (n0) or (n0, n1) f32 tensor on the CPU filled with `value` (which also
 * touches every page before any timing). */
static kpl_tensor *make_f32(int64_t n0, int64_t n1, double value)
{
    kpl_tensor *t = NULL;
    int64_t shape[2] = {n0, n1};
    if (kpl_tensor_empty(kpl_device_cpu(), KPL_F32, n1 ? 2 : 1, shape, &t) < 0) die("alloc");
    if (kpl_k_fill(t, value) < 0) die("fill");
    return t;
}

/* ---- element-wise add vs memcpy ----------------------------------------- */

enum { ADD_BEST_OF = 9 };

/* GB/s of c = a + b, 12 bytes per element, best of ADD_BEST_OF. */
static double kpl_add_rate(kpl_tensor *c, const kpl_tensor *a, const kpl_tensor *b)
{
    double best = INFINITY;
    for (int i = 0; i < ADD_BEST_OF; i++) {
        double t0 = bench_now();
        if (kpl_k_binary(c, KPL_BIN_ADD, a, b) < 0) die("add");
        double t = bench_now() - t0;
        if (t < best) best = t;
    }
    return 12.0 * (double)kpl_tensor_numel(c) / best / 1e9;
}

/* GB/s (2 x bytes copied) of a memcpy of `bytes` split into `threads`
 * contiguous parts, one per OpenMP thread, best of ADD_BEST_OF. */
static double omp_memcpy_rate(char *dst, const char *src, size_t bytes, int threads)
{
    double best = INFINITY;
    for (int r = 0; r < ADD_BEST_OF; r++) {
        double t0 = bench_now();
#pragma omp parallel num_threads(threads)
        {
            size_t i = (size_t)omp_get_thread_num(), k = (size_t)omp_get_num_threads();
            size_t lo = bytes * i / k, hi = bytes * (i + 1) / k;
            memcpy(dst + lo, src + lo, hi - lo);
        }
        double t = bench_now() - t0;
        if (t < best) best = t;
    }
    return 2.0 * (double)bytes / best / 1e9;
}

/* The reference of the add case for `threads`, in GB/s read + write. */
static double memcpy_ref(const bench_cfg *cfg, int threads, char *dst, const char *src,
                         size_t bytes)
{
    if (threads == 1) {
        /* memcpy_bw prints the copy rate (bytes copied / s, read and write
         * counted once): doubled, it is read + write traffic like ours. */
        char cmd[4096];
        snprintf(cmd, sizeof cmd, "'%s/memcpy_bw' %zu", cfg->tools, bytes >> 20);
        return 2.0 * bench_run_ref(cmd, "memcpy", "MB: ");
    }
    return omp_memcpy_rate(dst, src, bytes, threads);
}

static void bench_add(const bench_cfg *cfg)
{
    const int64_t n = (int64_t)64 << 20;
    const size_t copy_bytes = (size_t)256 << 20;
    kpl_tensor *a = make_f32(n, 0, 1.5), *b = make_f32(n, 0, 2.25), *c = make_f32(n, 0, 0.0);
    char *src = malloc(copy_bytes), *dst = malloc(copy_bytes);
    if (!src || !dst) die("malloc of the memcpy buffers");
    memset(src, 1, copy_bytes);
    memset(dst, 2, copy_bytes);

    for (int threads = 1; threads <= 2; threads++) {
        kpl_set_num_threads(threads);
        double k[MAX_ROUNDS], r[MAX_ROUNDS];
        for (int round = 0; round < cfg->rounds; round++) {
            if (round % 2 == 0) {
                k[round] = kpl_add_rate(c, a, b);
                r[round] = memcpy_ref(cfg, threads, dst, src, copy_bytes);
            } else {
                r[round] = memcpy_ref(cfg, threads, dst, src, copy_bytes);
                k[round] = kpl_add_rate(c, a, b);
            }
            fprintf(stderr, "bench_kernels: add t%d round %d/%d: kpl %.2f GB/s, memcpy %.2f GB/s\n",
                    threads, round + 1, cfg->rounds, k[round], r[round]);
        }
        const int64_t probes[3] = {0, n / 2 + 7, n - 1};
        for (int i = 0; i < 3; i++) {
            double v;
            if (kpl_tensor_get(c, probes[i], &v) < 0 || v != 3.75) die("add gave a wrong value");
        }
        char cas[64], kr[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN];
        snprintf(cas, sizeof cas, "add_f32_64M/t%d", threads);
        bench_jrange(kr, k, cfg->rounds);
        bench_jrange(rr, r, cfg->rounds);
        double km = bench_median(k, cfg->rounds), rm = bench_median(r, cfg->rounds);
        bench_emit("eltwise", cas, "GB/s", 1, km, rm, threads == 1 ? "memcpy_bw" : "memcpy-omp",
                   0.7,
                   ",\"threads\":%d,\"bytes_counted\":\"read+write\",\"kpl_bytes_per_elem\":12,"
                   "\"ref_convention\":\"%s\",\"stat\":\"median of rounds, each the best of %d\","
                   "\"rounds\":%d,\"kpl_range\":%s,\"ref_range\":%s,\"omp_wait_policy\":\"%s\"",
                   threads,
                   threads == 1 ? "memcpy_bw.c 256 MB copy rate x 2"
                                : "in-process memcpy 256 MB over 2 OpenMP threads, 2 x bytes copied",
                   ADD_BEST_OF, cfg->rounds, kr, rr, cfg->wait_policy);
    }
    free(src);
    free(dst);
    kpl_tensor_release(a);
    kpl_tensor_release(b);
    kpl_tensor_release(c);
}

/* ---- matmul vs numpy (OpenBLAS) ------------------------------------------ */

enum { MM_SIZES = 2, MM_WARMUP = 3, MM_TIMED = 15, MM_TIMED_MIN = 5 };
/* Seconds of timed kpl runs per size and round before the rest are skipped
 * (at least MM_TIMED_MIN run), so a slow kernel cannot stall the group. */
#define MM_BUDGET_S 10.0

typedef struct {
    int64_t n;
    kpl_tensor *a, *b, *c; /* (n, n) each */
} mm_case;

/* GFLOP/s of the median of up to MM_TIMED runs after MM_WARMUP, as
 * gemm_bench.py does it; *timed receives the number of timed runs. */
static double kpl_gemm(mm_case *m, int *timed)
{
    double t[MM_TIMED];
    for (int i = 0; i < MM_WARMUP; i++)
        if (kpl_k_matmul(m->c, m->a, m->b, false, false) < 0) die("matmul");
    double spent = 0;
    int i = 0;
    while (i < MM_TIMED && (i < MM_TIMED_MIN || spent < MM_BUDGET_S)) {
        double t0 = bench_now();
        if (kpl_k_matmul(m->c, m->a, m->b, false, false) < 0) die("matmul");
        t[i] = bench_now() - t0;
        spent += t[i++];
    }
    *timed = i;
    double n = (double)m->n;
    return 2.0 * n * n * n / bench_median(t, i) / 1e9;
}

/* A few entries of C against dot products in double precision. */
static void check_gemm(mm_case *m)
{
    const float *a = kpl_tensor_host_data(m->a), *b = kpl_tensor_host_data(m->b);
    const float *c = kpl_tensor_host_data(m->c);
    if (!a || !b || !c) die("host data");
    int64_t n = m->n;
    for (int p = 0; p < 8; p++) {
        int64_t i = (p * 977 + 3) % n, j = (p * 331 + 11) % n;
        double dot = 0, mag = 0;
        for (int64_t k = 0; k < n; k++) {
            dot += (double)a[i * n + k] * b[k * n + j];
            mag += fabs((double)a[i * n + k] * b[k * n + j]);
        }
        if (fabs(c[i * n + j] - dot) > 2e-4 * mag + 1e-6) {
            fprintf(stderr, "bench_kernels: matmul %lld^3 C[%lld,%lld] = %g, expected %g\n",
                    (long long)n, (long long)i, (long long)j, c[i * n + j], dot);
            exit(1);
        }
    }
}

typedef struct {
    const int64_t *sizes;
    double gflops[MM_SIZES];
} numpy_result;

/* gemm_bench.py prints "RESULT lib=numpy threads=T n=N ... GFLOPs_med=G ...". */
static void numpy_line(const char *line, void *ctx)
{
    numpy_result *res = ctx;
    const char *g = strstr(line, "GFLOPs_med=");
    if (strncmp(line, "RESULT ", 7) != 0 || !g) return;
    for (int s = 0; s < MM_SIZES; s++) {
        char want[48];
        snprintf(want, sizeof want, " n=%lld ", (long long)res->sizes[s]);
        if (strstr(line, want)) res->gflops[s] = strtod(g + strlen("GFLOPs_med="), NULL);
    }
}

static void numpy_gemm(const bench_cfg *cfg, int threads, const int64_t *sizes,
                       double out[MM_SIZES])
{
    numpy_result res = {sizes, {NAN, NAN}};
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "OPENBLAS_NUM_THREADS=%d OMP_NUM_THREADS=%d /usr/bin/python3 '%s/gemm_bench.py' numpy %d",
             threads, threads, cfg->baselines, threads);
    if (bench_run_lines(cmd, numpy_line, &res) < 0) {
        fprintf(stderr, "bench_kernels: the numpy reference failed (python3-numpy installed? "
                        "scripts/setup.sh --bench)\n");
    } else if (isnan(res.gflops[0]) || isnan(res.gflops[1])) {
        fprintf(stderr, "bench_kernels: gemm_bench.py printed no RESULT line for a size\n");
        bench_ref_failures++;
    }
    for (int s = 0; s < MM_SIZES; s++) out[s] = res.gflops[s];
}

static void bench_matmul(const bench_cfg *cfg)
{
    /* fma_peak.c has a 512-bit (zmm) and a 256-bit (ymm) loop; run the
     * widest the CPU has.  run.sh compiles it with -mavx512f -mfma on every
     * x86 CPU because the zmm loop does not compile without it; the ymm
     * path and main() contain no AVX-512 instruction, so `fma_peak 256`
     * runs on AVX2-only CPUs such as the Zen 3 VMs. */
    int width = 0;
    const char *isa = NULL;
    if (bench_cpu_has("avx512f")) {
        width = 512;
        isa = "avx512";
    } else if (bench_cpu_has("avx2") && bench_cpu_has("fma")) {
        width = 256;
        isa = "avx2";
    } else {
        fprintf(stderr, "bench_kernels: no AVX2+FMA: peak_fraction will be null\n");
    }

    static const int64_t sizes[MM_SIZES] = {1024, 2048};
    mm_case mm[MM_SIZES];
    kpl_rng *rng = kpl_rng_create(0);
    if (!rng) die("rng");
    for (int s = 0; s < MM_SIZES; s++) {
        mm[s].n = sizes[s];
        mm[s].a = make_f32(sizes[s], sizes[s], 0);
        mm[s].b = make_f32(sizes[s], sizes[s], 0);
        mm[s].c = make_f32(sizes[s], sizes[s], 0);
        if (kpl_k_normal(mm[s].a, rng, 0, 1) < 0 || kpl_k_normal(mm[s].b, rng, 0, 1) < 0)
            die("normal");
    }

    /* k[t][s][round], r[...]: GFLOP/s; peak[round]: one core's GFLOP/s. */
    double k[2][MM_SIZES][MAX_ROUNDS], r[2][MM_SIZES][MAX_ROUNDS], peak[MAX_ROUNDS];
    int timed_min = MM_TIMED;
    for (int round = 0; round < cfg->rounds; round++) {
        peak[round] = NAN;
        if (width) {
            char cmd[4096];
            snprintf(cmd, sizeof cmd, "'%s/fma_peak' %d", cfg->tools, width);
            peak[round] = bench_run_ref(cmd, "RESULT", "GFLOPs_med ");
        }
        for (int t = 0; t < 2; t++) {
            int threads = t + 1;
            kpl_set_num_threads(threads);
            for (int side = 0; side < 2; side++) {
                if ((side == 0) == (round % 2 == 0)) {
                    for (int s = 0; s < MM_SIZES; s++) {
                        int timed;
                        k[t][s][round] = kpl_gemm(&mm[s], &timed);
                        if (timed < timed_min) timed_min = timed;
                        if (round == 0 && t == 0) check_gemm(&mm[s]);
                    }
                } else {
                    double ref[MM_SIZES];
                    numpy_gemm(cfg, threads, sizes, ref);
                    for (int s = 0; s < MM_SIZES; s++) r[t][s][round] = ref[s];
                }
            }
            fprintf(stderr,
                    "bench_kernels: matmul t%d round %d/%d: kpl %.1f / %.1f, numpy %.1f / %.1f "
                    "GFLOP/s (1024 / 2048); core peak %.1f\n",
                    threads, round + 1, cfg->rounds, k[t][0][round], k[t][1][round],
                    r[t][0][round], r[t][1][round], peak[round]);
        }
    }

    double core_peak = bench_median(peak, cfg->rounds);
    for (int t = 0; t < 2; t++)
        for (int s = 0; s < MM_SIZES; s++) {
            int threads = t + 1;
            char cas[64], kr[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN], pf[BENCH_NUM_LEN],
                pg[BENCH_NUM_LEN], pisa[32];
            snprintf(cas, sizeof cas, "%lld^3/t%d", (long long)sizes[s], threads);
            bench_jrange(kr, k[t][s], cfg->rounds);
            bench_jrange(rr, r[t][s], cfg->rounds);
            double km = bench_median(k[t][s], cfg->rounds);
            double rm = bench_median(r[t][s], cfg->rounds);
            double pk = core_peak * threads;
            if (isa)
                snprintf(pisa, sizeof pisa, "\"%s\"", isa);
            else
                snprintf(pisa, sizeof pisa, "null");
            bench_emit("matmul", cas, "GFLOP/s", 1, km, rm, "numpy-openblas", 0.9,
                       ",\"threads\":%d,\"peak_fraction\":%s,\"peak_gflops\":%s,\"peak_isa\":%s,"
                       "\"peak_source\":\"fma_peak.c %d: one core x threads, median of rounds\","
                       "\"reps\":\"%d warm-up + %d timed, median\",\"kpl_timed_min\":%d,"
                       "\"rounds\":%d,\"kpl_range\":%s,\"ref_range\":%s,\"omp_wait_policy\":\"%s\"",
                       threads, bench_jnum(pf, km / pk), bench_jnum(pg, pk), pisa, width,
                       MM_WARMUP, MM_TIMED, timed_min, cfg->rounds, kr, rr, cfg->wait_policy);
        }
    for (int s = 0; s < MM_SIZES; s++) {
        kpl_tensor_release(mm[s].a);
        kpl_tensor_release(mm[s].b);
        kpl_tensor_release(mm[s].c);
    }
    kpl_rng_destroy(rng);
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: bench_kernels BASELINES_DIR TOOLS_DIR\n");
        return 2;
    }
    /* The policy goes into the JSON verbatim, so only a plain word passes. */
    const char *wp = getenv("OMP_WAIT_POLICY");
    if (!wp || !*wp || strspn(wp, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz") != strlen(wp))
        wp = "default";
    bench_cfg cfg = {argv[1], argv[2], bench_env_int("KPL_BENCH_ROUNDS", 5, 1, MAX_ROUNDS), wp};
    fprintf(stderr, "bench_kernels: kpl %s, %d rounds, OMP_WAIT_POLICY=%s\n", kpl_version(),
            cfg.rounds, cfg.wait_policy);
    double t0 = bench_now();
    bench_add(&cfg);
    bench_matmul(&cfg);
    fprintf(stderr, "bench_kernels: done in %.0f s\n", bench_now() - t0);
    return bench_exit_code();
}
