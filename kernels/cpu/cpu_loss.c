/*
 * cpu_loss.c — the fused loss kernels on the CPU: softmax cross entropy
 * over the class axis (kpl_k_softmax_xent and its backward) and the
 * sigmoid focal loss per element (kpl_k_sigmoid_focal and its backward,
 * vision_math.h's formula in one vector loop).
 *
 * x is viewed as (n, c, inner).  With inner > 1 (per-pixel losses) a task
 * is one sample's block of up to XB columns: each pass over the classes
 * reads a stride-1 run of every class row, so the loops vectorise along
 * the columns; with inner == 1 (one row of logits per sample) a task is a
 * block of rows, each a stride-1 run over the classes.  Per position:
 *   forward   max over the classes, sum of exp(x - max) in f64 (and the
 *             sum of x with label smoothing), then the loss; 2 passes;
 *   backward  the same 2 passes for lse, then gx = gy (exp(x - lse) - eps
 *             / C), the label's class less gy (1 - eps); 3 passes.
 * Nothing the size of x is made besides gx.  Labels are checked in the
 * same tasks; the first one out of range (in row-major order) is reported
 * and its position gets no loss.  Built with glibc's vector exp (libmvec,
 * see kernels/CMakeLists.txt) for each ISA (KPL_CLONES).
 */
#include "kernels_impl.h"
#include "../vision_math.h"

#include <float.h>
#include <math.h>
#include <stdint.h>

#define XB 64 /* columns per task */

/* The first bad label of a task: its flat position (INT64_MAX when none). */
static inline int64_t first_bad(const kpl_xent_attrs *a, const int64_t *y, int64_t from, int64_t k)
{
    for (int64_t j = 0; j < k; j++) {
        int64_t v = y[from + j];
        if (v != a->ignore && (v < 0 || v >= a->c)) return from + j;
    }
    return INT64_MAX;
}

/* Whether label v counts (in range and not ignored). */
#define COUNTS(a, v) ((v) != (a)->ignore && (v) >= 0 && (v) < (a)->c)

#define DEF_XENT(T, tn, EXP)                                                                    \
    /* Columns j0 .. j0 + k of sample s (inner > 1). */                                         \
    KPL_CLONES static void cols_##tn(const kpl_xent_attrs *a, const T *x, const int64_t *y,     \
                                     const T *gy, T *out, int64_t s, int64_t j0, int64_t k)     \
    {                                                                                           \
        const int64_t in = a->inner, C = a->c;                                                  \
        const T *xs = x + s * C * in + j0;                                                      \
        T m[XB], lse[XB];                                                                       \
        double sum[XB], sx[XB];                                                                 \
        for (int64_t j = 0; j < k; j++) m[j] = xs[j], sum[j] = 0, sx[j] = 0;                    \
        for (int64_t c = 1; c < C; c++) {                                                       \
            const T *r = xs + c * in;                                                           \
            _Pragma("omp simd") for (int64_t j = 0; j < k; j++) m[j] = r[j] > m[j] ? r[j] : m[j]; \
        }                                                                                       \
        for (int64_t c = 0; c < C; c++) {                                                       \
            const T *r = xs + c * in;                                                           \
            _Pragma("omp simd") for (int64_t j = 0; j < k; j++)                                 \
                sum[j] += (double)EXP(r[j] - m[j]);                                             \
            if (a->eps > 0)                                                                     \
                _Pragma("omp simd") for (int64_t j = 0; j < k; j++) sx[j] += (double)r[j];      \
        }                                                                                       \
        for (int64_t j = 0; j < k; j++) lse[j] = (T)((double)m[j] + log(sum[j]));               \
        const int64_t *ys = y + s * in + j0;                                                    \
        if (!a->bwd) {                                                                          \
            T *o = out + s * in + j0;                                                           \
            for (int64_t j = 0; j < k; j++) {                                                   \
                int64_t v = ys[j];                                                              \
                double l = (double)lse[j];                                                      \
                o[j] = COUNTS(a, v) ? (T)((1 - a->eps) * (l - (double)xs[v * in + j]) +         \
                                          a->eps * (l - sx[j] / (double)C))                     \
                                    : (T)0;                                                     \
            }                                                                                   \
            return;                                                                             \
        }                                                                                       \
        T g[XB];                                                                                \
        const T off = (T)(a->eps / (double)C), hit = (T)(1 - a->eps);                           \
        for (int64_t j = 0; j < k; j++) g[j] = COUNTS(a, ys[j]) ? gy[s * in + j0 + j] : (T)0;   \
        for (int64_t c = 0; c < C; c++) {                                                       \
            const T *r = xs + c * in;                                                           \
            T *gr = out + s * C * in + c * in + j0;                                             \
            _Pragma("omp simd") for (int64_t j = 0; j < k; j++)                                 \
                gr[j] = g[j] * (EXP(r[j] - lse[j]) - off);                                      \
        }                                                                                       \
        for (int64_t j = 0; j < k; j++) {                                                       \
            int64_t v = ys[j];                                                                  \
            if (!COUNTS(a, v)) continue;                                                        \
            out[s * C * in + v * in + j0 + j] = g[j] * (EXP(xs[v * in + j] - lse[j]) - off - hit); \
        }                                                                                       \
    }                                                                                           \
    /* Row s (inner == 1): its C logits are contiguous. */                                      \
    KPL_CLONES static void row_##tn(const kpl_xent_attrs *a, const T *x, const int64_t *y,      \
                                    const T *gy, T *out, int64_t s)                             \
    {                                                                                           \
        const int64_t C = a->c;                                                                 \
        const T *r = x + s * C;                                                                 \
        T m = r[0];                                                                             \
        for (int64_t c = 1; c < C; c++) m = r[c] > m ? r[c] : m;                                \
        double sum = 0, sx = 0;                                                                 \
        _Pragma("omp simd reduction(+ : sum)") for (int64_t c = 0; c < C; c++)                  \
            sum += (double)EXP(r[c] - m);                                                       \
        if (a->eps > 0)                                                                         \
            _Pragma("omp simd reduction(+ : sx)") for (int64_t c = 0; c < C; c++)               \
                sx += (double)r[c];                                                             \
        T lse = (T)((double)m + log(sum));                                                      \
        int64_t v = y[s];                                                                       \
        bool counts = COUNTS(a, v);                                                             \
        if (!a->bwd) {                                                                          \
            double l = (double)lse;                                                             \
            out[s] = counts ? (T)((1 - a->eps) * (l - (double)r[v]) +                           \
                                  a->eps * (l - sx / (double)C))                                \
                            : (T)0;                                                             \
            return;                                                                             \
        }                                                                                       \
        const T off = (T)(a->eps / (double)C), hit = (T)(1 - a->eps);                           \
        T g = counts ? gy[s] : (T)0, *gr = out + s * C;                                         \
        _Pragma("omp simd") for (int64_t c = 0; c < C; c++) gr[c] = g * (EXP(r[c] - lse) - off); \
        if (counts) gr[v] = g * (EXP(r[v] - lse) - off - hit);                                  \
    }                                                                                           \
    static int64_t xent_##tn(const kpl_xent_attrs *a, const T *x, const int64_t *y,             \
                             const T *gy, T *out)                                               \
    {                                                                                           \
        int64_t bad = INT64_MAX, in = a->inner;                                                 \
        bool rows = in == 1;                                                                    \
        int64_t nblk = rows ? 1 : (in + XB - 1) / XB;                                           \
        int64_t tasks = rows ? a->n : a->n * nblk;                                              \
        bool par = tasks > 1 && a->n * a->c * in > 2 * KPL_PAR_GRAIN;                           \
        _Pragma("omp parallel for schedule(static) reduction(min : bad) if (par)")              \
        for (int64_t t = 0; t < tasks; t++) {                                                   \
            if (rows) {                                                                         \
                int64_t b = first_bad(a, y, t, 1);                                              \
                bad = b < bad ? b : bad;                                                        \
                row_##tn(a, x, y, gy, out, t);                                                  \
                continue;                                                                       \
            }                                                                                   \
            int64_t s = t / nblk, j0 = (t % nblk) * XB;                                         \
            int64_t k = in - j0 < XB ? in - j0 : XB;                                            \
            int64_t b = first_bad(a, y, s * in + j0, k);                                        \
            bad = b < bad ? b : bad;                                                            \
            cols_##tn(a, x, y, gy, out, s, j0, k);                                              \
        }                                                                                       \
        return bad;                                                                             \
    }

DEF_XENT(float, f32, expf)
DEF_XENT(double, f64, exp)

static kpl_status cpu_xent(const kpl_kernel_args *args)
{
    const kpl_xent_attrs *a = args->attrs;
    const void *x = kpl__cdata(args->in[0]), *gy = a->bwd ? kpl__cdata(args->in[2]) : NULL;
    const int64_t *y = kpl__cdata(args->in[1]);
    void *out = kpl__data(args->out);
    int64_t bad = args->in[0]->dtype == KPL_F64 ? xent_f64(a, x, y, gy, out)
                                                : xent_f32(a, x, y, gy, out);
    if (bad == INT64_MAX) return KPL_OK;
    if (a->bad) a->bad[0] = bad, a->bad[1] = y[bad];
    return KPL_ERROR(KPL_ERANGE, "softmax_xent: label %lld out of range", (long long)y[bad]);
}

/* ---- the sigmoid focal loss ---------------------------------------------------------- */

#define FOCAL_CHUNK 4096 /* elements per task */

/* One loop per (direction, kind of gamma): no branch inside, so each
 * vectorises with libmvec's exp and log. */
#define FOCAL_LOOP(T, EXP, LOG, POWQ, BWD)                                                      \
    _Pragma("omp simd") for (int64_t i = i0; i < i1; i++)                                       \
    {                                                                                           \
        T l, d;                                                                                 \
        KPL_FOCAL_ELEM(T, EXP, LOG, POWQ, z[i], y[i], al, g, tiny, l, d);                       \
        out[i] = BWD ? gy[i] * d : l;                                                           \
    }
#define DEF_FOCAL(T, tn, EXP, LOG, TINY)                                                        \
    KPL_CLONES static void focal_##tn(const kpl_focal_attrs *a, const T *z, const T *y,         \
                                      const T *gy, T *out, int64_t i0, int64_t i1)              \
    {                                                                                           \
        const T al = (T)a->alpha, g = (T)a->gamma, tiny = TINY;                                 \
        if (g == (T)2) {                                                                        \
            if (a->bwd) FOCAL_LOOP(T, EXP, LOG, KPL_FOCAL_POW2, 1)                              \
            else FOCAL_LOOP(T, EXP, LOG, KPL_FOCAL_POW2, 0)                                     \
        } else if (g == (T)0) {                                                                 \
            if (a->bwd) FOCAL_LOOP(T, EXP, LOG, KPL_FOCAL_POW0, 1)                              \
            else FOCAL_LOOP(T, EXP, LOG, KPL_FOCAL_POW0, 0)                                     \
        } else if (g == (T)1) {                                                                 \
            if (a->bwd) FOCAL_LOOP(T, EXP, LOG, KPL_FOCAL_POW1, 1)                              \
            else FOCAL_LOOP(T, EXP, LOG, KPL_FOCAL_POW1, 0)                                     \
        } else {                                                                                \
            if (a->bwd) FOCAL_LOOP(T, EXP, LOG, POWG_##tn, 1)                                   \
            else FOCAL_LOOP(T, EXP, LOG, POWG_##tn, 0)                                          \
        }                                                                                       \
    }
#define POWG_f32(q) expf(g * logf(q))
#define POWG_f64(q) exp(g * log(q))

DEF_FOCAL(float, f32, expf, logf, FLT_MIN)
DEF_FOCAL(double, f64, exp, log, DBL_MIN)

static kpl_status cpu_focal(const kpl_kernel_args *args)
{
    const kpl_focal_attrs *a = args->attrs;
    const void *z = kpl__cdata(args->in[0]), *y = kpl__cdata(args->in[1]);
    const void *gy = a->bwd ? kpl__cdata(args->in[2]) : NULL;
    void *out = kpl__data(args->out);
    bool f64 = args->in[0]->dtype == KPL_F64;
    int64_t tasks = (a->n + FOCAL_CHUNK - 1) / FOCAL_CHUNK;
    KPL_PARALLEL_FOR_IF(t, tasks, tasks > 1 && a->n > KPL_PAR_GRAIN,
        int64_t i0 = t * FOCAL_CHUNK, i1 = i0 + FOCAL_CHUNK < a->n ? i0 + FOCAL_CHUNK : a->n;
        if (f64) focal_f64(a, z, y, gy, out, i0, i1);
        else focal_f32(a, z, y, gy, out, i0, i1);
    );
    return KPL_OK;
}

void kpl__cpu_register_loss(void)
{
    kpl_kernel_register(KPL_KOP_XENT, KPL_DEVICE_CPU, KPL_F32, cpu_xent);
    kpl_kernel_register(KPL_KOP_XENT, KPL_DEVICE_CPU, KPL_F64, cpu_xent);
    kpl_kernel_register(KPL_KOP_FOCAL, KPL_DEVICE_CPU, KPL_F32, cpu_focal);
    kpl_kernel_register(KPL_KOP_FOCAL, KPL_DEVICE_CPU, KPL_F64, cpu_focal);
}
