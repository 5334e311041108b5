/*
 * eltwise_math.h — the element-wise formulas, written once.
 *
 * Included by the CPU loops (C11, kernels/cpu/cpu_eltwise.c) and by the CUDA
 * kernels (kernels/cuda/cuda_eltwise.cu), so the math the CPU tests check is
 * the math the GPU runs.  A formula is an expression in:
 *
 *   T            the element type (a local typedef in C, a template
 *                parameter in CUDA)
 *   x            the operand of a unary formula
 *   a, b         the operands of a binary formula
 *   alpha, beta  the unary attributes (double)
 *
 * Math functions are called by their double names (exp, tanh, ...): in C
 * <tgmath.h> picks expf for float, in CUDA C++ the float overloads do.  The
 * few pieces whose spelling differs between integer and float types go
 * through kpl_absv/kpl_divv/kpl_powv/kpl_maxv/kpl_minv, defined below for
 * both languages.
 */
#ifndef KPL_ELTWISE_MATH_H
#define KPL_ELTWISE_MATH_H

#include <stdint.h>

#if defined(__CUDACC__)
#include <math.h>
#define KPL_HD static __host__ __device__ __forceinline__

KPL_HD float kpl_absv(float v) { return fabsf(v); }
KPL_HD double kpl_absv(double v) { return fabs(v); }
KPL_HD int32_t kpl_absv(int32_t v) { return v < 0 ? -v : v; }
KPL_HD int64_t kpl_absv(int64_t v) { return v < 0 ? -v : v; }
KPL_HD uint8_t kpl_absv(uint8_t v) { return v; }

KPL_HD float kpl_divv(float p, float q) { return p / q; }
KPL_HD double kpl_divv(double p, double q) { return p / q; }
KPL_HD int32_t kpl_divv(int32_t p, int32_t q) { return q ? p / q : 0; }
KPL_HD int64_t kpl_divv(int64_t p, int64_t q) { return q ? p / q : 0; }
KPL_HD uint8_t kpl_divv(uint8_t p, uint8_t q) { return q ? p / q : 0; }

KPL_HD float kpl_powv(float p, float q) { return powf(p, q); }
KPL_HD double kpl_powv(double p, double q) { return pow(p, q); }
/* Integer power by squaring; a negative exponent gives the integer part of
 * the true result (0 except for bases 1 and -1). */
template <typename I> KPL_HD I kpl_ipow_nonneg(I p, I q)
{
    I r = 1;
    while (q) { if (q & 1) r *= p; p *= p; q >>= 1; }
    return r;
}
template <typename I> KPL_HD I kpl_ipow_signed(I p, I q)
{
    if (q < 0) return (p == 1) ? 1 : (p == (I)-1 ? ((q & 1) ? (I)-1 : 1) : 0);
    return kpl_ipow_nonneg(p, q);
}
KPL_HD int32_t kpl_powv(int32_t p, int32_t q) { return kpl_ipow_signed(p, q); }
KPL_HD int64_t kpl_powv(int64_t p, int64_t q) { return kpl_ipow_signed(p, q); }
KPL_HD uint8_t kpl_powv(uint8_t p, uint8_t q) { return kpl_ipow_nonneg(p, q); }

template <typename V> KPL_HD V kpl_maxv(V p, V q) { return (p > q || p != p) ? p : q; }
template <typename V> KPL_HD V kpl_minv(V p, V q) { return (p < q || p != p) ? p : q; }

#else /* C11 */
#include <tgmath.h>
#define KPL_HD static inline

#define KPL__ABS_INT(T, n) \
    KPL_HD T kpl_abs_##n(T v) { return v < 0 ? (T)-v : v; }
KPL__ABS_INT(int32_t, i32)
KPL__ABS_INT(int64_t, i64)
KPL_HD uint8_t kpl_abs_u8(uint8_t v) { return v; }
#define kpl_absv(v) _Generic((v), float: fabsf, double: fabs,         \
                             int32_t: kpl_abs_i32, int64_t: kpl_abs_i64, \
                             uint8_t: kpl_abs_u8)(v)

#define KPL__DIV(T, n) KPL_HD T kpl_div_##n(T p, T q) { return q ? (T)(p / q) : 0; }
KPL__DIV(int32_t, i32)
KPL__DIV(int64_t, i64)
KPL__DIV(uint8_t, u8)
KPL_HD float kpl_div_f32(float p, float q) { return p / q; }
KPL_HD double kpl_div_f64(double p, double q) { return p / q; }
#define kpl_divv(p, q) _Generic((p), float: kpl_div_f32, double: kpl_div_f64, \
                                int32_t: kpl_div_i32, int64_t: kpl_div_i64,   \
                                uint8_t: kpl_div_u8)(p, q)

/* Integer power by squaring; a negative exponent gives the integer part of
 * the true result (0 except for bases 1 and -1). */
#define KPL__IPOW(T, n, SIGNED)                                           \
    KPL_HD T kpl_pow_##n(T p, T q)                                        \
    {                                                                     \
        if (SIGNED && q < (T)(SIGNED - 1))                               \
            return (p == 1) ? 1 : (p == (T)-1 ? ((q & 1) ? (T)-1 : 1) : 0); \
        T r = 1;                                                          \
        while (q) { if (q & 1) r = (T)(r * p); p = (T)(p * p); q >>= 1; } \
        return r;                                                         \
    }
KPL__IPOW(int32_t, i32, 1)
KPL__IPOW(int64_t, i64, 1)
KPL__IPOW(uint8_t, u8, 0)
#define kpl_powv(p, q) _Generic((p), float: powf, double: pow,        \
                                int32_t: kpl_pow_i32, int64_t: kpl_pow_i64, \
                                uint8_t: kpl_pow_u8)(p, q)

/* NaN-propagating maximum/minimum (as numpy.maximum). */
#define kpl_maxv(p, q) (((p) > (q) || (p) != (p)) ? (p) : (q))
#define kpl_minv(p, q) (((p) < (q) || (p) != (p)) ? (p) : (q))
#endif

/* X(NAME, formula).  Every unary formula; the integer-safe ones are listed
 * again in KPL_UNARY_INT_FORMULAS. */
#define KPL_UNARY_FORMULAS(X)                                              \
    X(NEG, -x)                                                             \
    X(ABS, kpl_absv(x))                                                    \
    X(EXP, exp(x))                                                         \
    X(LOG, log(x))                                                         \
    X(SQRT, sqrt(x))                                                       \
    X(RSQRT, (T)1 / sqrt(x))                                               \
    X(SQUARE, x * x)                                                       \
    X(RECIPROCAL, (T)1 / x)                                                \
    X(SIN, sin(x))                                                         \
    X(COS, cos(x))                                                         \
    X(TANH, tanh(x))                                                       \
    X(SIGMOID, (T)1 / ((T)1 + exp(-x)))                                    \
    X(RELU, x < (T)0 ? (T)0 : x) /* NaN passes through */                 \
    X(LEAKY_RELU, x < (T)0 ? x * (T)alpha : x)                             \
    X(GELU, (T)0.5 * x * ((T)1 + erf(x * (T)0.70710678118654752440)))     \
    X(CLIP, x < (T)alpha ? (T)alpha : (x > (T)beta ? (T)beta : x))         \
    X(SIGN, (T)((x > (T)0) - (x < (T)0)))                                  \
    X(GELU_TANH, (T)0.5 * x *                                              \
                     ((T)1 + tanh((T)0.79788456080286535588 *              \
                                  (x + (T)0.044715 * x * x * x))))         \
    X(ERF, erf(x))                                                         \
    /* log(1 + e^x) without overflow, and log1p keeps the tiny values */    \
    X(SOFTPLUS, (x < (T)0 ? (T)0 : x) + log1p(exp(-kpl_absv(x))))

#define KPL_UNARY_INT_FORMULAS(X)                                          \
    X(NEG, (T)-x)                                                          \
    X(ABS, kpl_absv(x))                                                    \
    X(SQUARE, (T)(x * x))                                                  \
    X(RELU, x > (T)0 ? x : (T)0)                                           \
    X(SIGN, (T)((x > (T)0) - (x < (T)0)))

/* X(NAME, formula) producing T. */
#define KPL_BINARY_ARITH_FORMULAS(X)  \
    X(ADD, (T)(a + b))                \
    X(SUB, (T)(a - b))                \
    X(MUL, (T)(a * b))                \
    X(DIV, kpl_divv(a, b))            \
    X(POW, kpl_powv(a, b))            \
    X(MAXIMUM, kpl_maxv(a, b))        \
    X(MINIMUM, kpl_minv(a, b))        \
    X(RELU_BWD, (T)(a * (T)(b > (T)0)))

/* X(NAME, formula) producing a bool stored as uint8_t. */
#define KPL_BINARY_CMP_FORMULAS(X) \
    X(EQ, a == b)                  \
    X(NE, a != b)                  \
    X(LT, a < b)                   \
    X(LE, a <= b)                  \
    X(GT, a > b)                   \
    X(GE, a >= b)

#endif /* KPL_ELTWISE_MATH_H */
