/*
 * bench_common.h — what every kpl benchmark shares: a monotonic clock,
 * medians, running a reference program, and the one JSON line per case of
 * ../shared/DESIGN.md ("Benchmarks and figures"):
 *
 *   {"bench":"matmul","case":"1024^3/t2","unit":"GFLOP/s","better":"higher",
 *    "kpl":151.2,"ref":143.9,"ref_name":"numpy-openblas","ratio":1.05,
 *    "target":0.9, ...extra fields}
 *
 * ratio = kpl/ref when higher is better, ref/kpl when lower is better, so a
 * ratio >= 1 always means kpl is ahead.  Missing ref/target print as null.
 */
#ifndef KPL_BENCH_COMMON_H
#define KPL_BENCH_COMMON_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline double bench_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of n values (sorts them in place); NAN for n == 0. */
static inline double bench_median(double *v, int n)
{
    if (n <= 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Prints one case.  ref <= 0 or NAN means "no reference"; target NAN means
 * none.  `extra` is either NULL or a printf format for more fields, starting
 * with a comma: ",\"peak_fraction\":%.3f". */
static inline void bench_emit(const char *bench, const char *cas, const char *unit,
                              int higher_better, double kpl, double ref, const char *ref_name,
                              double target, const char *extra, ...)
{
    printf("{\"bench\":\"%s\",\"case\":\"%s\",\"unit\":\"%s\",\"better\":\"%s\",\"kpl\":%.4g",
           bench, cas, unit, higher_better ? "higher" : "lower", kpl);
    if (ref > 0 && !isnan(ref) && kpl > 0) {
        double ratio = higher_better ? kpl / ref : ref / kpl;
        printf(",\"ref\":%.4g,\"ref_name\":\"%s\",\"ratio\":%.3f", ref, ref_name, ratio);
    } else {
        printf(",\"ref\":null,\"ref_name\":%s%s%s,\"ratio\":null", ref_name ? "\"" : "",
               ref_name ? ref_name : "null", ref_name ? "\"" : "");
    }
    if (isnan(target))
        printf(",\"target\":null");
    else
        printf(",\"target\":%.3g", target);
    if (extra) {
        va_list ap;
        va_start(ap, extra);
        vprintf(extra, ap);
        va_end(ap);
    }
    printf("}\n");
    fflush(stdout);
}

/* Runs `cmd` through the shell and returns the number after `key` on the
 * first output line containing `prefix` (NAN if none, or if it failed). */
static inline double bench_run_ref(const char *cmd, const char *prefix, const char *key)
{
    FILE *p = popen(cmd, "r");
    if (!p) return NAN;
    char line[1024];
    double v = NAN;
    while (fgets(line, sizeof line, p)) {
        if (!isnan(v) || !strstr(line, prefix)) continue;
        const char *k = strstr(line, key);
        if (k) v = strtod(k + strlen(key), NULL);
    }
    int rc = pclose(p);
    if (rc != 0) {
        fprintf(stderr, "bench: reference command failed (%d): %s\n", rc, cmd);
        return NAN;
    }
    return v;
}

#endif
