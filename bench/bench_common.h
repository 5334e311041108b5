/*
 * bench_common.h — what every kpl benchmark program shares: a monotonic
 * clock, medians, running a reference program and reading its output, and
 * the one JSON line per case of ../shared/DESIGN.md ("Benchmarks and
 * figures"):
 *
 *   {"bench":"matmul","case":"1024^3/t2","unit":"GFLOP/s","better":"higher",
 *    "kpl":151.2,"ref":143.9,"ref_name":"numpy-openblas","ratio":1.05,
 *    "target":0.9, ...extra fields}
 *
 * ratio = kpl/ref when higher is better, ref/kpl when lower is better, so a
 * ratio >= 1 always means kpl is ahead.  A missing reference prints ref and
 * ratio as null; a missing target prints null.  Non-finite numbers never
 * reach the output: they print as null, so every line is valid JSON.
 *
 * Conventions for a benchmark program (bench/README.md):
 *  - stdout carries only the JSON lines; progress and diagnostics go to
 *    stderr.
 *  - kpl and its reference alternate over several rounds in one run (the
 *    VMs have 0-50% CPU steal that changes by the minute); quote medians.
 *  - A kpl failure exits 1 at once.  A failing reference program prints
 *    its case with ref null, and the program exits with bench_exit_code()
 *    (3) at the end, so run.sh reports it.
 *
 * Header-only: each benchmark is one translation unit.
 */
#ifndef KPL_BENCH_COMMON_H
#define KPL_BENCH_COMMON_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Seconds on CLOCK_MONOTONIC (never jumps with the wall clock). */
static inline double bench_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of the n values of v; sorts v in place.  NaN entries are dropped
 * first (a failed reference round), so the result is NAN only when no
 * value is left. */
static inline double bench_median(double *v, int n)
{
    int m = 0;
    for (int i = 0; i < n; i++)
        if (!isnan(v[i])) v[m++] = v[i];
    if (m == 0) return NAN;
    qsort(v, (size_t)m, sizeof *v, bench_cmp_double);
    return m % 2 ? v[m / 2] : 0.5 * (v[m / 2 - 1] + v[m / 2]);
}

/* Smallest / largest non-NaN value of v (NAN when there is none). */
static inline double bench_min(const double *v, int n)
{
    double m = NAN;
    for (int i = 0; i < n; i++)
        if (!isnan(v[i]) && (isnan(m) || v[i] < m)) m = v[i];
    return m;
}

static inline double bench_max(const double *v, int n)
{
    double m = NAN;
    for (int i = 0; i < n; i++)
        if (!isnan(v[i]) && (isnan(m) || v[i] > m)) m = v[i];
    return m;
}

/* A JSON number, or null for NaN/Inf.  Integral values from 1e4 up (byte
 * counts) print in full; the rest with 4 significant digits.  Returns buf. */
#define BENCH_NUM_LEN 32
static inline const char *bench_jnum(char buf[BENCH_NUM_LEN], double v)
{
    if (!isfinite(v))
        snprintf(buf, BENCH_NUM_LEN, "null");
    else if (fabs(v) >= 1e4 && fabs(v) < 1e15 && v == floor(v))
        snprintf(buf, BENCH_NUM_LEN, "%.0f", v);
    else
        snprintf(buf, BENCH_NUM_LEN, "%.4g", v);
    return buf;
}

/* "[min,max]" of the non-NaN values of v, or null: the spread of the
 * rounds behind a median, for extra fields.  Returns buf. */
#define BENCH_RANGE_LEN (2 * BENCH_NUM_LEN + 4)
static inline const char *bench_jrange(char buf[BENCH_RANGE_LEN], const double *v, int n)
{
    char lo[BENCH_NUM_LEN], hi[BENCH_NUM_LEN];
    double a = bench_min(v, n), b = bench_max(v, n);
    if (isnan(a))
        snprintf(buf, BENCH_RANGE_LEN, "null");
    else
        snprintf(buf, BENCH_RANGE_LEN, "[%s,%s]", bench_jnum(lo, a), bench_jnum(hi, b));
    return buf;
}

/* Whether the "flags" line of /proc/cpuinfo lists `flag`. */
static inline int bench_cpu_has(const char *flag)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[8192];
    int found = 0;
    while (f && fgets(line, sizeof line, f)) {
        if (strncmp(line, "flags", 5) != 0) continue;
        for (char *tok = strtok(strchr(line, ':') ? strchr(line, ':') + 1 : line, " \t\n"); tok;
             tok = strtok(NULL, " \t\n"))
            if (!strcmp(tok, flag)) found = 1;
        break;
    }
    if (f) fclose(f);
    return found;
}

/* The fields every row carries about the CPU (the machines change between
 * runs): its model name and the vector features kpl's kernels choose by. */
static inline const char *bench_cpu_fields(void)
{
    static char fields[512];
    if (fields[0]) return fields;
    static const char *const wanted[] = {"sse4_2",      "avx",         "avx2",    "fma",
                                         "f16c",        "avx512f",     "avx512bw", "avx512vl",
                                         "avx512_vnni", "avx512_bf16", "amx_bf16"};
    char model[160] = "unknown", feats[256] = "";
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) != 0 || !colon) continue;
        snprintf(model, sizeof model, "%s", colon + 1 + (colon[1] == ' '));
        for (char *c = model; *c; c++)
            if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20) *c = ' ';
        for (size_t l = strlen(model); l && model[l - 1] == ' '; l--) model[l - 1] = 0;
        break;
    }
    if (f) fclose(f);
    for (size_t i = 0; i < sizeof wanted / sizeof wanted[0]; i++)
        if (bench_cpu_has(wanted[i])) {
            size_t l = strlen(feats);
            snprintf(feats + l, sizeof feats - l, "%s%s", l ? "," : "", wanted[i]);
        }
    snprintf(fields, sizeof fields, ",\"cpu\":\"%s\",\"cpu_features\":\"%s\"", model, feats);
    return fields;
}

/* Prints one case as one JSON line on stdout and flushes it.
 *  ref       the reference's median; <= 0 or NAN means "no reference" (ref
 *            and ratio print null; ref_name still says what was meant, or
 *            null when ref_name is NULL).
 *  target    the ratio asked for; NAN means none.
 *  extra     NULL, or a printf format for more fields that starts with a
 *            comma: ",\"peak_fraction\":%s" (use bench_jnum for numbers
 *            that may be missing).
 * The CPU's model and features close every row (bench_cpu_fields).
 * Names are written as given: keep quotes and backslashes out of them. */
static inline void bench_emit(const char *bench, const char *cas, const char *unit,
                              int higher_better, double kpl, double ref, const char *ref_name,
                              double target, const char *extra, ...)
{
    char nk[BENCH_NUM_LEN], nr[BENCH_NUM_LEN], nq[BENCH_NUM_LEN], nt[BENCH_NUM_LEN];
    int have_ref = isfinite(ref) && ref > 0;
    double ratio = NAN;
    if (have_ref && isfinite(kpl) && kpl > 0) ratio = higher_better ? kpl / ref : ref / kpl;
    printf("{\"bench\":\"%s\",\"case\":\"%s\",\"unit\":\"%s\",\"better\":\"%s\",\"kpl\":%s", bench,
           cas, unit, higher_better ? "higher" : "lower", bench_jnum(nk, kpl));
    printf(",\"ref\":%s", bench_jnum(nr, have_ref ? ref : NAN));
    if (ref_name)
        printf(",\"ref_name\":\"%s\"", ref_name);
    else
        printf(",\"ref_name\":null");
    /* The ratio keeps 3 significant digits: 1.05, 0.734. */
    if (isfinite(ratio))
        snprintf(nq, sizeof nq, "%.3g", ratio);
    else
        snprintf(nq, sizeof nq, "null");
    printf(",\"ratio\":%s,\"target\":%s", nq, bench_jnum(nt, target));
    if (extra) {
        va_list ap;
        va_start(ap, extra);
        vprintf(extra, ap);
        va_end(ap);
    }
    printf("%s}\n", bench_cpu_fields());
    fflush(stdout);
}

/* Reference failures seen by this program (see bench_exit_code). */
static int bench_ref_failures;

/* The exit status for main: 0, or 3 when a reference program failed. */
static inline int bench_exit_code(void)
{
    if (bench_ref_failures)
        fprintf(stderr, "bench: %d reference run(s) failed; their cases have ref null\n",
                bench_ref_failures);
    return bench_ref_failures ? 3 : 0;
}

/* Runs `cmd` through /bin/sh, calls on_line(line, ctx) for every line of
 * its stdout (its stderr passes through to ours), and returns 0 when it
 * exited with status 0.  Otherwise it says so on stderr, counts a
 * reference failure and returns -1. */
static inline int bench_run_lines(const char *cmd, void (*on_line)(const char *line, void *ctx),
                                  void *ctx)
{
    fflush(stdout); /* the child must not inherit unflushed JSON */
    FILE *p = popen(cmd, "r");
    if (!p) {
        fprintf(stderr, "bench: cannot start: %s\n", cmd);
        bench_ref_failures++;
        return -1;
    }
    char line[4096];
    while (fgets(line, sizeof line, p))
        if (on_line) on_line(line, ctx);
    int rc = pclose(p);
    if (rc != 0) {
        fprintf(stderr, "bench: reference command failed (wait status %d): %s\n", rc, cmd);
        bench_ref_failures++;
        return -1;
    }
    return 0;
}

/* oneDNN's own account of a run (bench_onednn_run). */
#define BENCH_IMPLS 32
struct bench_onednn_ {
    char isa[96];
    char impl[BENCH_IMPLS][64];
    int count[BENCH_IMPLS], n;
};

static inline void bench_onednn_line_(const char *line, void *ctx)
{
    struct bench_onednn_ *o = ctx;
    if (!strstr(line, "_verbose")) return;
    const char *at = strstr(line, "isa:");
    if (at && strstr(line, ",info,") && !o->isa[0]) {
        snprintf(o->isa, sizeof o->isa, "%s", at + 4);
        for (char *c = o->isa; *c; c++)
            if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20) *c = ' ';
        for (size_t l = strlen(o->isa); l && o->isa[l - 1] == ' '; l--) o->isa[l - 1] = 0;
        return;
    }
    at = strstr(line, ",exec,");
    const char *kind = at ? strstr(at, ",convolution,") : NULL;
    if (!kind) return;
    kind += strlen(",convolution,");
    size_t len = strcspn(kind, ",");
    char name[64];
    snprintf(name, sizeof name, "%.*s", (int)(len < 63 ? len : 63), kind);
    int j = 0;
    while (j < o->n && strcmp(o->impl[j], name)) j++;
    if (j == o->n) {
        if (o->n == BENCH_IMPLS) return;
        snprintf(o->impl[o->n], sizeof o->impl[0], "%s", name);
        o->count[o->n++] = 0;
    }
    o->count[j]++;
}

/* Runs `cmd` with oneDNN's verbose output on (ONEDNN_VERBOSE, and
 * DNNL_VERBOSE for oneDNN 2.x) and reads its account of the run: *isa the
 * text of its "isa:" line (the instruction set its kernels use), *impls the
 * convolutions it executed as "impl*calls,..." , the most called first: what
 * a reference (PyTorch) ran, for rows that print both sides' kernels.
 * Returns -1 (and "?" for both) when the command failed. */
static inline int bench_onednn_run(const char *cmd, char *isa, size_t isa_len, char *impls,
                                   size_t impls_len)
{
    static struct bench_onednn_ o;
    memset(&o, 0, sizeof o);
    char full[4200];
    snprintf(full, sizeof full, "ONEDNN_VERBOSE=1 DNNL_VERBOSE=1 %s", cmd);
    int rc = bench_run_lines(full, bench_onednn_line_, &o);
    snprintf(isa, isa_len, "%s", rc == 0 && o.isa[0] ? o.isa : "?");
    size_t at = 0;
    impls[0] = 0;
    for (int k = 0; k < o.n && at < impls_len; k++) {
        int best = 0;
        for (int j = 1; j < o.n; j++)
            if (o.count[j] > o.count[best]) best = j;
        int w = snprintf(impls + at, impls_len - at, "%s%s*%d", at ? "," : "", o.impl[best],
                         o.count[best]);
        at += w > 0 ? (size_t)w : 0;
        o.count[best] = -1;
    }
    if (rc != 0) snprintf(impls, impls_len, "?");
    return rc == 0 ? 0 : -1;
}

struct bench_ref_key_ {
    const char *prefix, *key;
    double value;
};

static inline void bench_ref_key_line_(const char *line, void *ctx)
{
    struct bench_ref_key_ *k = ctx;
    if (!isnan(k->value) || !strstr(line, k->prefix)) return;
    const char *at = strstr(line, k->key);
    if (at) k->value = strtod(at + strlen(k->key), NULL);
}

/* Runs `cmd` and returns the number that follows `key` on the first output
 * line containing `prefix`.  NAN (a reference failure) when the command
 * fails or prints no such line. */
static inline double bench_run_ref(const char *cmd, const char *prefix, const char *key)
{
    struct bench_ref_key_ k = {prefix, key, NAN};
    if (bench_run_lines(cmd, bench_ref_key_line_, &k) < 0) return NAN;
    if (isnan(k.value)) {
        fprintf(stderr, "bench: no \"%s ... %s<number>\" in the output of: %s\n", prefix, key, cmd);
        bench_ref_failures++;
    }
    return k.value;
}

/* An integer from the environment, `def` when unset or not in [lo, hi]. */
static inline int bench_env_int(const char *name, int def, int lo, int hi)
{
    const char *s = getenv(name);
    if (!s || !*s) return def;
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || v < lo || v > hi) {
        fprintf(stderr, "bench: ignoring %s=%s (want %d..%d)\n", name, s, lo, hi);
        return def;
    }
    return (int)v;
}

#endif /* KPL_BENCH_COMMON_H */
