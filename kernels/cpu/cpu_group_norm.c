/*
 * cpu_group_norm.c — group norm (kpl_k_group_norm and its gradient) on
 * the CPU, f32 and f64: one task per (sample, group), statistics in f64.
 * (Split from cpu_norm.c, batch norm's loops; built, as that file, without
 * FMA contraction, so every vector ISA rounds alike.)
 */
#include "kernels_impl.h"

#include <math.h>
#include <stdlib.h>

/* x viewed as (n, c, hw); a task is one (sample, group): its cg = c / groups
 * channels of hw values are contiguous.  Forward: mean and variance (f64
 * sums; one pass of sums and squares for f32 values, mean then squared
 * deviations for f64), then y = (x - mean) a + beta per channel,
 * a = gamma rstd (x a + (beta - mean a) would cancel to ~1e-4 of beta
 * where a group's variance is ~0 and rstd ~ 1 / sqrt(eps)).  Backward:
 * the statistics again, then per channel s1 = sum gy and s2 = sum gy (x -
 * mean) (one pass), then gx =
 * rstd (gy gamma - A / L - xhat B / L) with A = sum_c gamma s1, B = sum_c
 * gamma rstd s2 over the group (L its values); each (sample, channel)'s
 * rstd s2 and s1 go to a buffer that ggamma and gbeta sum in sample order. */
#define DEF_GN(T, tn)                                                                           \
    KPL_CLONES static void gn_stats_##tn(const T *x, int64_t len, double eps, double *mean,     \
                                         double *rstd)                                          \
    {                                                                                           \
        double s = 0, q = 0;                                                                    \
        if (sizeof(T) < sizeof(double)) {                                                       \
            /* f32 values: the squares' sum in f64 holds E[x^2] - mean^2 to ~1e-16 of          \
             * E[x^2], so one pass serves unless |mean| / std passes ~1e6 */                    \
            _Pragma("omp simd reduction(+ : s, q)") for (int64_t i = 0; i < len; i++)           \
            {                                                                                   \
                double v = (double)x[i];                                                        \
                s += v;                                                                         \
                q += v * v;                                                                     \
            }                                                                                   \
            double m = len ? s / (double)len : 0, var = len ? q / (double)len - m * m : 0;     \
            *mean = m;                                                                          \
            *rstd = 1 / sqrt((var > 0 ? var : 0) + eps);                                        \
            return;                                                                             \
        }                                                                                       \
        _Pragma("omp simd reduction(+ : s)") for (int64_t i = 0; i < len; i++) s += (double)x[i]; \
        double m = len ? s / (double)len : 0;                                                   \
        _Pragma("omp simd reduction(+ : q)") for (int64_t i = 0; i < len; i++)                  \
        {                                                                                       \
            double d = (double)x[i] - m;                                                        \
            q += d * d;                                                                         \
        }                                                                                       \
        *mean = m;                                                                              \
        *rstd = 1 / sqrt((len ? q / (double)len : 0) + eps);                                   \
    }                                                                                           \
    KPL_CLONES static void gn_fwd_##tn(const kpl_gn_attrs *a, const T *x, const T *gamma,       \
                                       const T *beta, T *y, int64_t t)                          \
    {                                                                                           \
        int64_t cg = a->c / a->groups, hw = a->hw, c0 = (t % a->groups) * cg;                   \
        const T *xs = x + t * cg * hw;                                                          \
        T *ys = y + t * cg * hw;                                                                \
        double mean, rstd;                                                                      \
        gn_stats_##tn(xs, cg * hw, a->eps, &mean, &rstd);                                       \
        T mv = (T)mean;                                                                         \
        for (int64_t k = 0; k < cg; k++) {                                                      \
            T av = (T)((double)gamma[c0 + k] * rstd), bv = beta[c0 + k];                        \
            const T *xr = xs + k * hw;                                                          \
            T *yr = ys + k * hw;                                                                \
            _Pragma("omp simd") for (int64_t i = 0; i < hw; i++) yr[i] = (xr[i] - mv) * av + bv; \
        }                                                                                       \
    }                                                                                           \
    KPL_CLONES static void gn_bwd_##tn(const kpl_gn_attrs *a, const T *x, const T *gy,          \
                                       const T *gamma, T *gx, double *part, int64_t t)          \
    {                                                                                           \
        int64_t cg = a->c / a->groups, hw = a->hw, c0 = (t % a->groups) * cg, n = t / a->groups; \
        int64_t len = cg * hw;                                                                  \
        const T *xs = x + t * len, *gs = gy + t * len;                                          \
        T *gxs = gx + t * len;                                                                  \
        double mean, rstd, A = 0, B = 0;                                                        \
        gn_stats_##tn(xs, len, a->eps, &mean, &rstd);                                           \
        for (int64_t k = 0; k < cg; k++) {                                                      \
            const T *xr = xs + k * hw, *gr = gs + k * hw;                                       \
            double s1 = 0, s2 = 0;                                                              \
            _Pragma("omp simd reduction(+ : s1, s2)") for (int64_t i = 0; i < hw; i++)          \
            {                                                                                   \
                s1 += (double)gr[i];                                                            \
                s2 += (double)gr[i] * ((double)xr[i] - mean);                                   \
            }                                                                                   \
            double g = (double)gamma[c0 + k];                                                   \
            A += g * s1;                                                                        \
            B += g * rstd * s2;                                                                 \
            part[2 * (n * a->c + c0 + k)] = rstd * s2;                                          \
            part[2 * (n * a->c + c0 + k) + 1] = s1;                                             \
        }                                                                                       \
        double am = A / (double)len, bm = B / (double)len;                                      \
        for (int64_t k = 0; k < cg; k++) {                                                      \
            const T *xr = xs + k * hw, *gr = gs + k * hw;                                       \
            T *o = gxs + k * hw;                                                                \
            double g = (double)gamma[c0 + k];                                                   \
            _Pragma("omp simd") for (int64_t i = 0; i < hw; i++)                                \
            {                                                                                   \
                double xh = ((double)xr[i] - mean) * rstd;                                      \
                o[i] = (T)(rstd * ((double)gr[i] * g - am - xh * bm));                          \
            }                                                                                   \
        }                                                                                       \
    }

DEF_GN(float, f32)
DEF_GN(double, f64)

static kpl_status cpu_group_norm(const kpl_kernel_args *args)
{
    const kpl_gn_attrs *a = args->attrs;
    bool f64 = args->in[0]->dtype == KPL_F64;
    /* forward: x, gamma, beta; backward: x, gy, gamma */
    const void *x = kpl__cdata(args->in[0]), *in1 = kpl__cdata(args->in[1]);
    const void *in2 = kpl__cdata(args->in[2]);
    void *out = kpl__data(args->out);
    int64_t tasks = a->n * a->groups;
    bool par = tasks > 1 && a->n * a->c * a->hw > 2 * KPL_PAR_GRAIN;
    if (!a->bwd) {
        KPL_PARALLEL_FOR_IF(t, tasks, par,
            if (f64) gn_fwd_f64(a, x, in1, in2, out, t);
            else gn_fwd_f32(a, x, in1, in2, out, t););
        return KPL_OK;
    }
    double *part = malloc(sizeof(double) * 2 * (size_t)(a->n * a->c));
    KPL_CHECK(part != NULL, KPL_ENOMEM, "group_norm_bwd: no memory for %lld partial sums",
              (long long)(2 * a->n * a->c));
    KPL_PARALLEL_FOR_IF(t, tasks, par,
        if (f64) gn_bwd_f64(a, x, in1, in2, out, part, t);
        else gn_bwd_f32(a, x, in1, in2, out, part, t););
    kpl_tensor *vec[2] = {a->ggamma, a->gbeta};
    for (int v = 0; v < 2; v++) {
        if (!vec[v]) continue;
        void *d = kpl__data(vec[v]);
        for (int64_t c = 0; c < a->c; c++) {
            double s = 0;
            for (int64_t n = 0; n < a->n; n++) s += part[2 * (n * a->c + c) + v];
            if (f64) ((double *)d)[c] = s;
            else ((float *)d)[c] = (float)s;
        }
    }
    free(part);
    return KPL_OK;
}

void kpl__cpu_register_group_norm(void)
{
    kpl_kernel_register(KPL_KOP_GROUP_NORM, KPL_DEVICE_CPU, KPL_F32, cpu_group_norm);
    kpl_kernel_register(KPL_KOP_GROUP_NORM, KPL_DEVICE_CPU, KPL_F64, cpu_group_norm);
}
