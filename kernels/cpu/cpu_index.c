/* cpu_index.c — index_select (any dtype, moved by element size) and its
 * adjoint index_add (f32, f64) along one axis. */
#include "kernels_impl.h"

#include <string.h>

static kpl_status cpu_index(const kpl_kernel_args *args)
{
    const kpl_index_attrs *a = args->attrs;
    const int64_t *idx = kpl__cdata(args->in[1]);
    for (int64_t k = 0; k < a->k; k++)
        KPL_CHECK(idx[k] >= 0 && idx[k] < a->dim, KPL_ERANGE,
                  "%s: index %lld at position %lld is outside [0, %lld)",
                  a->add ? "index_add" : "index_select", (long long)idx[k], (long long)k,
                  (long long)a->dim);
    size_t es = kpl_dtype_size(args->out->dtype), row = (size_t)a->inner * es;
    const char *src = kpl__cdata(args->in[0]);
    char *dst = kpl__data(args->out);
    if (!a->add) {
        KPL_PARALLEL_FOR_IF(o, a->outer, a->outer * a->k * a->inner > KPL_PAR_GRAIN,
            for (int64_t k = 0; k < a->k; k++)
                memcpy(dst + ((size_t)(o * a->k + k)) * row,
                       src + ((size_t)(o * a->dim + idx[k])) * row, row);
        );
        return KPL_OK;
    }
    /* out (outer, dim, inner) += g (outer, k, inner) at idx: each o is
     * independent, so parallel over o has no write conflicts. */
    bool f64 = args->out->dtype == KPL_F64;
    KPL_PARALLEL_FOR_IF(o, a->outer, a->outer > 1 && a->outer * a->k * a->inner > KPL_PAR_GRAIN,
        memset(dst + (size_t)(o * a->dim) * row, 0, (size_t)a->dim * row);
        for (int64_t k = 0; k < a->k; k++) {
            int64_t d = (o * a->dim + idx[k]) * a->inner, s = (o * a->k + k) * a->inner;
            if (f64) {
                double *dp = (double *)(void *)dst;
                const double *sp = (const double *)(const void *)src;
                for (int64_t i = 0; i < a->inner; i++) dp[d + i] += sp[s + i];
            } else {
                float *dp = (float *)(void *)dst;
                const float *sp = (const float *)(const void *)src;
                for (int64_t i = 0; i < a->inner; i++) dp[d + i] += sp[s + i];
            }
        }
    );
    return KPL_OK;
}

void kpl__cpu_register_index(void)
{
    for (int dt = 0; dt < KPL_DTYPE_COUNT; dt++)
        kpl_kernel_register(KPL_KOP_INDEX, KPL_DEVICE_CPU, (kpl_dtype)dt, cpu_index);
}
