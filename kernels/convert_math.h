/*
 * convert_math.h — dtype conversions written once for the CPU (tensor.c,
 * cpu/cpu_misc.c) and the CUDA kernels (cuda/cuda_misc.cu): f16 and bf16
 * with round-to-nearest-even, and float -> integer conversions that
 * truncate toward zero and saturate (NaN -> 0), so no input value is
 * undefined behaviour.  Include after eltwise_math.h (for KPL_HD).
 */
#ifndef KPL_CONVERT_MATH_H
#define KPL_CONVERT_MATH_H

#include <stdint.h>

#if defined(__CUDACC__)
#include <string.h>
/* memcpy works in host and device code alike (the fill value is
 * converted on the host, cast kernels convert on the device). */
KPL_HD uint32_t kpl_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
KPL_HD float kpl_bits_f32(uint32_t x)
{
    float f;
    memcpy(&f, &x, 4);
    return f;
}
#else
KPL_HD uint32_t kpl_f32_bits(float f)
{
    union { float f; uint32_t u; } v = {.f = f};
    return v.u;
}
KPL_HD float kpl_bits_f32(uint32_t x)
{
    union { uint32_t u; float f; } v = {.u = x};
    return v.f;
}
#endif

KPL_HD uint16_t kpl_cvt_f32_to_f16(float f)
{
    uint32_t x = kpl_f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t man = x & 0x7fffffu;
    if (exp == 0xff) /* Inf or NaN (NaN stays a quiet NaN) */
        return (uint16_t)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0));
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u); /* overflow to Inf */
    if (e <= 0) {
        /* A subnormal half (or zero): shift the whole mantissa into place
         * and round to nearest even. */
        if (e < -10) return (uint16_t)sign;
        uint32_t m = man | 0x800000u;
        int shift = 14 - e;
        uint32_t h = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)e << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++; /* may carry into Inf */
    return (uint16_t)(sign | h);
}

KPL_HD float kpl_cvt_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f; /* man * 2^-24, exact */
        return (h & 0x8000u) ? -f : f;
    }
    if (exp == 31) return kpl_bits_f32(sign | 0x7f800000u | (man << 13));
    return kpl_bits_f32(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

KPL_HD uint16_t kpl_cvt_f32_to_bf16(float f)
{
    uint32_t x = kpl_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

KPL_HD float kpl_cvt_bf16_to_f32(uint16_t h) { return kpl_bits_f32((uint32_t)h << 16); }

KPL_HD int64_t kpl_sat_i64(double v)
{
    if (v != v) return 0;
    if (v >= 9223372036854775807.0) return INT64_MAX;
    if (v <= -9223372036854775808.0) return INT64_MIN;
    return (int64_t)v;
}

KPL_HD int32_t kpl_sat_i32(double v)
{
    if (v != v) return 0;
    if (v >= 2147483647.0) return INT32_MAX;
    if (v <= -2147483648.0) return INT32_MIN;
    return (int32_t)v;
}

KPL_HD uint8_t kpl_sat_u8(double v)
{
    if (v != v || v <= 0) return 0;
    if (v >= 255.0) return 255;
    return (uint8_t)v;
}

#endif /* KPL_CONVERT_MATH_H */
