/*
 * amp_math.h — the per-element step of kpl_k_amp_unscale, written once for
 * the CPU loop (cpu/cpu_misc.c) and the CUDA kernel (cuda/cuda_misc.cu), so
 * both devices give the same bits.  Include after convert_math.h.
 *
 * Each function scales *p by s in place and returns 1 when the value it
 * found there was +-inf or NaN (tested on the exponent bits, which no
 * compiler flag can fold away), else 0.  Halves are widened to f32,
 * multiplied in f32 and rounded back once.
 */
#ifndef KPL_AMP_MATH_H
#define KPL_AMP_MATH_H

#include <stdint.h>
#include <string.h>

KPL_HD int kpl_amp_f32(float *p, float s)
{
    float v = *p;
    int bad = (kpl_f32_bits(v) & 0x7f800000u) == 0x7f800000u;
    *p = v * s;
    return bad;
}

KPL_HD int kpl_amp_f64(double *p, double s)
{
    double v = *p;
    uint64_t u;
    memcpy(&u, &v, 8);
    int bad = (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
    *p = v * s;
    return bad;
}

KPL_HD int kpl_amp_f16(uint16_t *p, float s)
{
    uint16_t h = *p;
    *p = kpl_cvt_f32_to_f16(kpl_cvt_f16_to_f32(h) * s);
    return (h & 0x7c00u) == 0x7c00u;
}

KPL_HD int kpl_amp_bf16(uint16_t *p, float s)
{
    uint16_t h = *p;
    *p = kpl_cvt_f32_to_bf16(kpl_cvt_bf16_to_f32(h) * s);
    return (h & 0x7f80u) == 0x7f80u;
}

#endif /* KPL_AMP_MATH_H */
