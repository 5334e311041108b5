/*
 * reduce.c — element-wise reductions on host memory for the host backends:
 * the ring steps of ucx and the half-precision MPI operations of mpi.  The
 * op and dtype are chosen outside the loops so that gcc vectorises each
 * loop body (f32 sum: one load of each input, an add, a store).
 */
#include "collective_impl.h"

#include <string.h>

/* max/min that propagate NaN from either side, as the MPI backend's
 * half-precision operations always did. */
#define MAXF(x, y) ((x) > (y) || (x) != (x) ? (x) : (y))
#define MINF(x, y) ((x) < (y) || (x) != (x) ? (x) : (y))
#define MAXI(x, y) ((x) > (y) ? (x) : (y))
#define MINI(x, y) ((x) < (y) ? (x) : (y))

/* A loop over a native type: d = f(x, y), then / n when n > 1. */
#define NATIVE_LOOP(T, F)                                                                  \
    do {                                                                                   \
        T *d_ = dst;                                                                       \
        const T *a_ = a, *b_ = b;                                                          \
        if (divide > 1) {                                                                  \
            const T n_ = (T)divide;                                                        \
            for (size_t i = 0; i < count; i++) {                                           \
                T x = a_[i], y = b_[i];                                                    \
                d_[i] = (T)(F) / n_;                                                       \
            }                                                                              \
        } else {                                                                           \
            for (size_t i = 0; i < count; i++) {                                           \
                T x = a_[i], y = b_[i];                                                    \
                d_[i] = (T)(F);                                                            \
            }                                                                              \
        }                                                                                  \
    } while (0)

#define NATIVE(T, MAXOP, MINOP)                                                            \
    do {                                                                                   \
        if (op == KPL_COMM_MAX) NATIVE_LOOP(T, MAXOP(x, y));                               \
        else if (op == KPL_COMM_MIN) NATIVE_LOOP(T, MINOP(x, y));                          \
        else NATIVE_LOOP(T, x + y);                                                        \
    } while (0)

/* A loop over 16-bit floats through f32. */
#define HALF_LOOP(TO32, FROM32, F)                                                         \
    do {                                                                                   \
        uint16_t *d_ = dst;                                                                \
        const uint16_t *a_ = a, *b_ = b;                                                   \
        const float n_ = (float)(divide > 1 ? divide : 1);                                 \
        for (size_t i = 0; i < count; i++) {                                               \
            float x = TO32(a_[i]), y = TO32(b_[i]);                                        \
            float r = (F);                                                                 \
            d_[i] = FROM32(divide > 1 ? r / n_ : r);                                       \
        }                                                                                  \
    } while (0)

#define HALF(TO32, FROM32)                                                                 \
    do {                                                                                   \
        if (op == KPL_COMM_MAX) HALF_LOOP(TO32, FROM32, MAXF(x, y));                       \
        else if (op == KPL_COMM_MIN) HALF_LOOP(TO32, FROM32, MINF(x, y));                  \
        else HALF_LOOP(TO32, FROM32, x + y);                                               \
    } while (0)

void kpl__comm_reduce(void *dst, const void *a, const void *b, size_t count, kpl_dtype dt,
                      kpl_comm_op op, int32_t divide)
{
    if (op != KPL_COMM_AVG) divide = 1;
    switch (dt) {
    case KPL_F32: NATIVE(float, MAXF, MINF); break;
    case KPL_F64: NATIVE(double, MAXF, MINF); break;
    case KPL_I32: NATIVE(int32_t, MAXI, MINI); break;
    case KPL_I64: NATIVE(int64_t, MAXI, MINI); break;
    case KPL_F16: HALF(kpl_f16_to_f32, kpl_f32_to_f16); break;
    case KPL_BF16: HALF(kpl_bf16_to_f32, kpl_f32_to_bf16); break;
    default: KPL_ASSERT(0, "kpl__comm_reduce: dtype checked by comm.c"); break;
    }
}

void kpl__comm_divide(void *out, size_t count, kpl_dtype dt, int32_t n)
{
    if (n <= 1) return;
    switch (dt) {
    case KPL_F32: for (size_t i = 0; i < count; i++) ((float *)out)[i] /= (float)n; break;
    case KPL_F64: for (size_t i = 0; i < count; i++) ((double *)out)[i] /= n; break;
    case KPL_I32: for (size_t i = 0; i < count; i++) ((int32_t *)out)[i] /= n; break;
    case KPL_I64: for (size_t i = 0; i < count; i++) ((int64_t *)out)[i] /= n; break;
    case KPL_F16:
        for (size_t i = 0; i < count; i++)
            ((uint16_t *)out)[i] = kpl_f32_to_f16(kpl_f16_to_f32(((uint16_t *)out)[i]) / n);
        break;
    case KPL_BF16:
        for (size_t i = 0; i < count; i++)
            ((uint16_t *)out)[i] = kpl_f32_to_bf16(kpl_bf16_to_f32(((uint16_t *)out)[i]) / n);
        break;
    default: KPL_ASSERT(0, "kpl__comm_divide: dtype checked by comm.c"); break;
    }
}
