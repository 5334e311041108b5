/* kpl_test.h — what every kpl test executable shares: cmocka, and checks
 * that print kpl's error message when a call fails. */
#ifndef KPL_TEST_H
#define KPL_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* The call must succeed. */
#define OK(expr)                                                                  \
    do {                                                                          \
        kpl_status st_ = (expr);                                                  \
        if (st_ != KPL_OK) fail_msg("%s -> %s: %s", #expr, kpl_status_str(st_),  \
                                    kpl_last_error());                            \
    } while (0)

/* The call must fail with `code` and a message containing `needle`. */
#define FAILS(expr, code, needle)                                                 \
    do {                                                                          \
        kpl_clear_error();                                                        \
        kpl_status st_ = (expr);                                                  \
        if (st_ != (code))                                                        \
            fail_msg("%s -> %s, expected %s (%s)", #expr, kpl_status_str(st_),    \
                     kpl_status_str(code), kpl_last_error());                     \
        if (!strstr(kpl_last_error(), (needle)))                                  \
            fail_msg("%s: message '%s' lacks '%s'", #expr, kpl_last_error(), (needle)); \
    } while (0)

/* The pointer must not be NULL (for calls that return one). */
#define NN(expr) kpl_test_nn_((expr), #expr)
static inline void *kpl_test_nn_(void *p, const char *what)
{
    if (!p) fail_msg("%s returned NULL: %s", what, kpl_last_error());
    return p;
}

/* Element i of t as a double. */
/* Writes text to dir/name; its path into path. */
static inline void kpl_test_write(const char *dir, const char *name, const char *text,
                                  char *path, size_t len)
{
    snprintf(path, len, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static inline double tget(kpl_tensor *t, int64_t i)
{
    double v = 0;
    OK(kpl_tensor_get(t, i, &v));
    return v;
}

/* |a - b| <= atol + rtol * |b|, NaNs equal. */
static inline void assert_close(double a, double b, double rtol, double atol, const char *what,
                                int64_t i)
{
    if (isnan(a) && isnan(b)) return;
    if (isinf(a) && isinf(b) && (a > 0) == (b > 0)) return;
    if (!(fabs(a - b) <= atol + rtol * fabs(b)))
        fail_msg("%s[%lld]: got %.17g, expected %.17g (off by %.3g, allowed %.3g)", what,
                 (long long)i, a, b, fabs(a - b), atol + rtol * fabs(b));
}

/* A check that cannot run here (see tests/skip.sh, its shell side):
 * KPL_TEST_SKIP_ENV when the machine lacks a capability (a skip, always);
 * KPL_TEST_SKIP_REF when a reference tool or data set that
 * scripts/setup.sh installs is missing: a failure under
 * KPL_REQUIRE_REFS=1 (scripts/test.sh) or CI=true, else a skip.  Each
 * skip is noted in $KPL_SKIP_LOG, which scripts/test.sh prints at its
 * end, since cmocka's skipped cases leave the test passed for ctest. */
typedef enum { KPL_TEST_SKIP_ENV, KPL_TEST_SKIP_REF } kpl_test_skip_kind;

static inline bool kpl_test_refs_required(void)
{
    const char *r = getenv("KPL_REQUIRE_REFS"), *ci = getenv("CI");
    return (r && !strcmp(r, "1")) || (ci && !strcmp(ci, "true"));
}

/* Notes the skip; false for a required reference (the caller fails). */
static inline bool kpl_test_skip_note(kpl_test_skip_kind kind, const char *where, const char *why)
{
    const char *k = kind == KPL_TEST_SKIP_REF ? "ref" : "env";
    if (kind == KPL_TEST_SKIP_REF && kpl_test_refs_required()) return false;
    const char *isa = getenv("ONEDNN_MAX_CPU_ISA");
    char who[256];
    snprintf(who, sizeof who, "%s%s%s%s", where, isa ? " [ONEDNN_MAX_CPU_ISA=" : "",
             isa ? isa : "", isa ? "]" : "");
    printf("skipped (%s): %s: %s\n", k, who, why);
    const char *log = getenv("KPL_SKIP_LOG");
    FILE *f = log && *log ? fopen(log, "a") : NULL;
    if (f) {
        fprintf(f, "%s: %s: %s\n", who, k, why);
        fclose(f);
    }
    return true;
}

/* Skips the running cmocka case (or fails it, for a required reference). */
#define KPL_SKIP(kind, why)                                                             \
    do {                                                                                \
        if (!kpl_test_skip_note(kind, __func__, why))                                   \
            fail_msg("reference missing: %s (scripts/setup.sh installs it)", why);      \
        skip();                                                                         \
        return;                                                                         \
    } while (0)

/* The ISA variants of a test (ctest label isa: ONEDNN_MAX_CPU_ISA set)
 * say first which ISA oneDNN runs under and what the CPU has. */
__attribute__((constructor)) static void kpl_test_say_isa(void)
{
    if (getenv("ONEDNN_MAX_CPU_ISA"))
        printf("ONEDNN_MAX_CPU_ISA=%s: %s\n", getenv("ONEDNN_MAX_CPU_ISA"), kpl_cpu_math_info());
}

/* cuda:0 for a GPU test: exits 77 (ctest's skip) when there is no CUDA
 * device, 1 when it cannot be opened. */
static inline kpl_device *kpl_test_gpu(void)
{
    kpl_device *gpu = NULL;
    if (kpl_device_count(KPL_DEVICE_CUDA) == 0) {
        printf("no CUDA device: skipping\n");
        exit(77);
    }
    if (kpl_device_get("cuda:0", &gpu) < 0) {
        fprintf(stderr, "cuda:0: %s\n", kpl_last_error());
        exit(1);
    }
    return gpu;
}

#endif
