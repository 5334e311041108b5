/*
 * cpu_norm.c — batch normalisation, forward and backward, as fused loops
 * over NCHW: one task per channel, rows of H*W contiguous values.
 *
 * Why not oneDNN's batch norm: its forward hands back mean and variance
 * that backward must be given again, and its plain-layout (ncsp) kernels
 * are no faster than these loops; these also serve f64, which the
 * gradient checks need.  Statistics are two-pass (mean, then squared
 * deviations) with f64 accumulation, so a large mean does not cancel the
 * variance away.
 */
#include "kernels_impl.h"

#include <math.h>

/* Mean and inverse standard deviation (and biased variance) of channel c. */
#define BN_STATS(T)                                                                       \
    static void stats_##T(const T *x, const kpl_bn_attrs *a, int64_t c, double *mean,     \
                          double *var)                                                    \
    {                                                                                     \
        double s = 0;                                                                     \
        for (int64_t n = 0; n < a->n; n++) {                                              \
            const T *r = x + (n * a->c + c) * a->hw;                                      \
            T rs = 0;                                                                     \
            for (int64_t i = 0; i < a->hw; i++) rs += r[i];                               \
            s += (double)rs;                                                              \
        }                                                                                 \
        double m = s / (double)(a->n * a->hw), q = 0;                                     \
        T mt = (T)m;                                                                      \
        for (int64_t n = 0; n < a->n; n++) {                                              \
            const T *r = x + (n * a->c + c) * a->hw;                                      \
            T rq = 0;                                                                     \
            for (int64_t i = 0; i < a->hw; i++) rq += (r[i] - mt) * (r[i] - mt);          \
            q += (double)rq;                                                              \
        }                                                                                 \
        *mean = m;                                                                        \
        *var = q / (double)(a->n * a->hw);                                                \
    }

#define BN_KERNELS(T)                                                                     \
    BN_STATS(T)                                                                           \
    static void fwd_##T(const kpl_kernel_args *args, const kpl_bn_attrs *a)               \
    {                                                                                     \
        const T *x = kpl__cdata(args->in[0]), *g = kpl__cdata(args->in[1]),               \
                *b = kpl__cdata(args->in[2]);                                             \
        T *y = kpl__data(args->out);                                                      \
        T *mo = a->mean ? kpl__data(a->mean) : NULL, *vo = a->var ? kpl__data(a->var) : NULL; \
        KPL_PARALLEL_FOR_IF(c, a->c, a->c > 1,                                            \
            double m, v;                                                                  \
            stats_##T(x, a, c, &m, &v);                                                   \
            if (mo) mo[c] = (T)m;                                                         \
            if (vo) vo[c] = (T)v;                                                         \
            double inv = 1.0 / sqrt(v + a->eps);                                          \
            T scale = (T)((double)g[c] * inv), shift = (T)((double)b[c] - m * (double)g[c] * inv); \
            for (int64_t n = 0; n < a->n; n++) {                                          \
                const T *r = x + (n * a->c + c) * a->hw;                                  \
                T *o = y + (n * a->c + c) * a->hw;                                        \
                for (int64_t i = 0; i < a->hw; i++) o[i] = r[i] * scale + shift;          \
            }                                                                             \
        );                                                                                \
    }                                                                                     \
    static void bwd_##T(const kpl_kernel_args *args, const kpl_bn_attrs *a)               \
    {                                                                                     \
        const T *x = kpl__cdata(args->in[0]), *gy = kpl__cdata(args->in[1]),              \
                *g = kpl__cdata(args->in[2]);                                             \
        T *gx = a->gx ? kpl__data(a->gx) : NULL;                                          \
        T *gg = a->ggamma ? kpl__data(a->ggamma) : NULL;                                  \
        T *gb = a->gbeta ? kpl__data(a->gbeta) : NULL;                                    \
        double cnt = (double)(a->n * a->hw);                                              \
        KPL_PARALLEL_FOR_IF(c, a->c, a->c > 1,                                            \
            double m, v;                                                                  \
            stats_##T(x, a, c, &m, &v);                                                   \
            double inv = 1.0 / sqrt(v + a->eps), sg = 0, sgx = 0;                         \
            T mt = (T)m;                                                                  \
            for (int64_t n = 0; n < a->n; n++) {                                          \
                const T *r = x + (n * a->c + c) * a->hw, *d = gy + (n * a->c + c) * a->hw; \
                T rs = 0, rsx = 0;                                                        \
                for (int64_t i = 0; i < a->hw; i++) {                                     \
                    rs += d[i];                                                           \
                    rsx += d[i] * (r[i] - mt);                                            \
                }                                                                         \
                sg += (double)rs;                                                         \
                sgx += (double)rsx;                                                       \
            }                                                                             \
            /* sum(gy xhat) = inv sum(gy (x - mean)) */                                   \
            if (gg) gg[c] = (T)(sgx * inv);                                               \
            if (gb) gb[c] = (T)sg;                                                        \
            if (gx) {                                                                     \
                /* gx = gamma inv (gy - mean(gy) - (x - mean) inv^2 mean(gy (x - mean))) */ \
                double k = (double)g[c] * inv;                                            \
                T ka = (T)k, kb = (T)(k * inv * inv * sgx / cnt),                         \
                  kc = (T)(k * sg / cnt);                                                 \
                for (int64_t n = 0; n < a->n; n++) {                                      \
                    const T *r = x + (n * a->c + c) * a->hw,                              \
                            *d = gy + (n * a->c + c) * a->hw;                             \
                    T *o = gx + (n * a->c + c) * a->hw;                                   \
                    for (int64_t i = 0; i < a->hw; i++)                                   \
                        o[i] = ka * d[i] - kb * (r[i] - mt) - kc;                         \
                }                                                                         \
            }                                                                             \
        );                                                                                \
    }

BN_KERNELS(float)
BN_KERNELS(double)

static kpl_status cpu_batch_norm(const kpl_kernel_args *args)
{
    const kpl_bn_attrs *a = args->attrs;
    bool f32 = args->in[0]->dtype == KPL_F32;
    if (a->bwd) {
        if (f32) bwd_float(args, a);
        else bwd_double(args, a);
    } else {
        if (f32) fwd_float(args, a);
        else fwd_double(args, a);
    }
    return KPL_OK;
}

void kpl__cpu_register_norm(void)
{
    kpl_kernel_register(KPL_KOP_BATCH_NORM, KPL_DEVICE_CPU, KPL_F32, cpu_batch_norm);
    kpl_kernel_register(KPL_KOP_BATCH_NORM, KPL_DEVICE_CPU, KPL_F64, cpu_batch_norm);
}
