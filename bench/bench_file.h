/* bench_file.h — what the benchmarks that hand a model to a PyTorch
 * twin share (bench_fcos.c, bench_seg.c, bench_gan.c): the file of
 * weights and inputs the Python side reads, and the peak-memory probe
 * both sides run alike.
 *
 * The file: a magic ("KPLSEG1", "KPLFCOS1", "KPLGAN1"), then entries until
 * the end: u32 name length, the name, u32 ndim, ndim x i64 dims, f32 data
 * (little-endian, as written).  Errors writing it end the program (exit 1):
 * a benchmark without its reference file has nothing to compare. */
#ifndef KPL_BENCH_FILE_H
#define KPL_BENCH_FILE_H

#include "bench_common.h"
#include "trainer.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* path opened for writing with the magic written; exits on failure. */
static inline FILE *bench_file_open(const char *path, const char *magic)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(magic, 1, strlen(magic), f) != strlen(magic)) {
        fprintf(stderr, "bench: cannot write %s\n", path);
        exit(1);
    }
    return f;
}

static inline void bench_put_entry(FILE *f, const char *name, int ndim, const int64_t *shape,
                                   const float *v)
{
    uint32_t len = (uint32_t)strlen(name), nd = (uint32_t)ndim;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    if (fwrite(&len, 4, 1, f) != 1 || fwrite(name, 1, len, f) != len || fwrite(&nd, 4, 1, f) != 1 ||
        fwrite(shape, 8, (size_t)ndim, f) != (size_t)ndim ||
        fwrite(v, 4, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "bench: write error (%s)\n", name);
        exit(1);
    }
}

/* t (f32, on the CPU) as the entry prefix + name. */
static inline void bench_put_tensor(FILE *f, const char *prefix, const char *name, kpl_tensor *t)
{
    char full[256];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    const float *v = kpl_tensor_dtype(t) == KPL_F32 ? kpl_tensor_host_data(t) : NULL;
    if (!v) {
        fprintf(stderr, "bench: %s is not an f32 tensor on the CPU: %s\n", full, kpl_last_error());
        exit(1);
    }
    bench_put_entry(f, full, kpl_tensor_ndim(t), kpl_tensor_shape(t), v);
}

/* Every parameter, then every buffer, of m as prefix + its dotted name. */
static inline void bench_put_module(FILE *f, const char *pparam, const char *pbuf, kpl_module *m)
{
    for (int i = 0; i < kpl_module_num_params(m); i++)
        bench_put_tensor(f, pparam, kpl_module_param_name(m, i), kpl_module_params(m)[i]);
    for (int i = 0; i < kpl_module_num_buffers(m); i++)
        bench_put_tensor(f, pbuf, kpl_module_buffer_name(m, i), kpl_module_buffers(m)[i]);
}

/* ---- peak memory, measured alike on both sides ----------------------------------------------- */

/* A field of /proc/self/status in bytes, -1 when absent. */
static inline long long bench_status_bytes(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long long v = -1;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':') v = atoll(line + n + 1) * 1024;
    if (f) fclose(f);
    return v;
}

/* This program's path into buf (the --mem runs start it again); exits
 * when /proc/self/exe cannot be read. */
static inline void bench_self_path(char *buf, size_t len)
{
    ssize_t n = readlink("/proc/self/exe", buf, len - 1);
    if (n <= 0) {
        fprintf(stderr, "bench: cannot read /proc/self/exe\n");
        exit(1);
    }
    buf[n] = 0;
}

/* Resets VmHWM to the current resident set (Linux >= 4.0). */
static inline void bench_reset_peak_rss(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) {
        fputs("5", f);
        fclose(f);
    }
}

/* A memory run in a fresh process: bench_mem_begin once the model, batch
 * and optimizer are made (the resident set then, every peak reset),
 * bench_mem_end after the steps (the MEM line below, with the allocator's
 * peak over the steps and its reserved peak). */
typedef struct {
    long long base;
    size_t alloc0;
} bench_mem_run;

static inline bench_mem_run bench_mem_begin(void)
{
    bench_mem_run r = {bench_status_bytes("VmRSS"), 0};
    bench_reset_peak_rss();
    kpl_device_reset_peak(kpl_device_cpu());
    r.alloc0 = kpl_device_memory_stats(kpl_device_cpu()).allocated;
    return r;
}

static inline void bench_mem_end(const bench_mem_run *r)
{
    long long peak = bench_status_bytes("VmHWM");
    kpl_memory_stats ms = kpl_device_memory_stats(kpl_device_cpu());
    printf("MEM peak_rss=%lld base_rss=%lld growth=%lld alloc_peak=%zu reserved_peak=%zu\n", peak,
           r->base, peak - r->base, ms.peak_allocated - r->alloc0, ms.peak_reserved);
}

/* A training step's SGD for module m, fresh (no momentum yet); exits on
 * failure. */
static inline kpl_optim *bench_sgd(kpl_module *m, double lr, double momentum, double wd)
{
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    oc.lr = lr, oc.momentum = momentum, oc.weight_decay = wd;
    kpl_optim *opt = NULL;
    if (kpl_optim_create(&oc, kpl_module_num_params(m), kpl_module_params(m), NULL, &opt) < 0) {
        fprintf(stderr, "bench: sgd: %s\n", kpl_last_error());
        exit(1);
    }
    return opt;
}

/* "MEM peak_rss=<B> base_rss=<B> growth=<B> [alloc_peak=<B>]", the line
 * both sides print. */
typedef struct {
    double peak, base, growth, alloc_peak;
} bench_mem_line;

static inline void bench_mem_line_parse(const char *line, void *ctx)
{
    bench_mem_line *r = ctx;
    if (!strncmp(line, "MEM ", 4))
        sscanf(line, "MEM peak_rss=%lf base_rss=%lf growth=%lf alloc_peak=%lf", &r->peak, &r->base,
               &r->growth, &r->alloc_peak);
}

/* The most memory runs a side makes (KPL_BENCH_MEM_ROUNDS). */
#define BENCH_MEM_MAX_ROUNDS 9

/* Each field's median over n <= BENCH_MEM_MAX_ROUNDS runs' lines (NAN
 * where no run has it). */
static inline bench_mem_line bench_mem_median(const bench_mem_line *runs, int n)
{
    double v[4][BENCH_MEM_MAX_ROUNDS];
    for (int i = 0; i < n; i++)
        v[0][i] = runs[i].peak, v[1][i] = runs[i].base, v[2][i] = runs[i].growth,
        v[3][i] = runs[i].alloc_peak;
    return (bench_mem_line){bench_median(v[0], n), bench_median(v[1], n), bench_median(v[2], n),
                            bench_median(v[3], n)};
}

/* Both sides' memory runs, each a fresh process: kpl's (kcmd) and the
 * reference's (rcmd), alternating over KPL_BENCH_MEM_ROUNDS rounds
 * (default 3; PyTorch's peak moves by up to 25% from run to run with
 * glibc's heap), the median of each MEM field into *k and *r (NAN where
 * absent).  Returns 1 when a kpl run fails (its message names bench and
 * the command); a reference without its line counts as a reference
 * failure. */
static inline int bench_mem_pair(const char *bench, const char *kcmd, const char *rcmd,
                                 bench_mem_line *k, bench_mem_line *r)
{
    int rounds = bench_env_int("KPL_BENCH_MEM_ROUNDS", 3, 1, BENCH_MEM_MAX_ROUNDS);
    bench_mem_line kr[BENCH_MEM_MAX_ROUNDS], rr[BENCH_MEM_MAX_ROUNDS];
    for (int i = 0; i < rounds; i++) {
        kr[i] = rr[i] = (bench_mem_line){NAN, NAN, NAN, NAN};
        if (bench_run_lines(kcmd, bench_mem_line_parse, &kr[i]) < 0 || isnan(kr[i].growth)) {
            fprintf(stderr, "%s: kpl's memory run failed: %s\n", bench, kcmd);
            return 1;
        }
        if (bench_run_lines(rcmd, bench_mem_line_parse, &rr[i]) == 0 && isnan(rr[i].growth)) {
            fprintf(stderr, "%s: no MEM line from: %s\n", bench, rcmd);
            bench_ref_failures++;
        }
        fprintf(stderr, "%s: memory round %d: peak RSS growth kpl %.1f MB, reference %.1f MB\n",
                bench, i + 1, kr[i].growth / 1e6, rr[i].growth / 1e6);
    }
    *k = bench_mem_median(kr, rounds);
    *r = bench_mem_median(rr, rounds);
    return 0;
}

#endif /* KPL_BENCH_FILE_H */
