/*
 * philox.h — Philox-4x32-10 (Salmon et al., SC'11), shared by the CPU and
 * CUDA random kernels so both produce the same numbers for the same
 * (seed, counter).  Include after eltwise_math.h (for KPL_HD).
 *
 * Counter layout: words 0-1 = the 64-bit block index (offset + element/4),
 * words 2-3 = a 64-bit subsequence (0 for tensor fills).  Key = the seed.
 */
#ifndef KPL_PHILOX_H
#define KPL_PHILOX_H

#include <stdint.h>

KPL_HD void kpl_philox_block(uint64_t seed, uint64_t sub, uint64_t block,
                             uint32_t r[4])
{
    uint32_t c0 = (uint32_t)block, c1 = (uint32_t)(block >> 32);
    uint32_t c2 = (uint32_t)sub, c3 = (uint32_t)(sub >> 32);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    r[0] = c0;
    r[1] = c1;
    r[2] = c2;
    r[3] = c3;
}

/* [0, 1) with 24 random bits (float) or 53 (double). */
KPL_HD float kpl_u32_to_unit_f32(uint32_t v) { return (float)(v >> 8) * (1.0f / 16777216.0f); }
KPL_HD double kpl_u64_to_unit_f64(uint32_t hi, uint32_t lo)
{
    uint64_t v = ((uint64_t)hi << 32 | lo) >> 11;
    return (double)v * (1.0 / 9007199254740992.0);
}

/* Values per Philox block for a dtype: 4 for 32-bit floats (and f16/bf16,
 * generated through f32), 2 for f64. */
KPL_HD int kpl_philox_per_block(int is_f64) { return is_f64 ? 2 : 4; }

/* The values of one Philox block for a random fill, written once for the
 * CPU and the CUDA kernel.  f32 (also f16/bf16, generated as f32): four
 * values, uniform in [p1, p2) or normal(p1, p2) by Box-Muller on the word
 * pairs (0,1) and (2,3).  f64: two values from two 64-bit uniforms.
 * Uniform values are bit-identical on every device; normal values agree to
 * the last few ulps of each device's log/sin/cos. */
KPL_HD void kpl_random_block_f32(uint64_t seed, uint64_t block, int normal, double p1,
                                 double p2, float v[4])
{
    uint32_t w[4];
    kpl_philox_block(seed, 0, block, w);
    if (!normal) {
        for (int j = 0; j < 4; j++)
            v[j] = (float)p1 + ((float)p2 - (float)p1) * kpl_u32_to_unit_f32(w[j]);
        return;
    }
    for (int j = 0; j < 4; j += 2) {
        float u1 = 1.0f - kpl_u32_to_unit_f32(w[j]); /* (0, 1]: log is finite */
        float u2 = kpl_u32_to_unit_f32(w[j + 1]);
        float r = sqrtf(-2.0f * logf(u1));
        float th = 6.283185307179586f * u2;
        v[j] = (float)p1 + (float)p2 * r * cosf(th);
        v[j + 1] = (float)p1 + (float)p2 * r * sinf(th);
    }
}

KPL_HD void kpl_random_block_f64(uint64_t seed, uint64_t block, int normal, double p1,
                                 double p2, double v[2])
{
    uint32_t w[4];
    kpl_philox_block(seed, 0, block, w);
    double a = kpl_u64_to_unit_f64(w[0], w[1]), b = kpl_u64_to_unit_f64(w[2], w[3]);
    if (!normal) {
        v[0] = p1 + (p2 - p1) * a;
        v[1] = p1 + (p2 - p1) * b;
        return;
    }
    double r = sqrt(-2.0 * log(1.0 - a)), th = 6.283185307179586 * b;
    v[0] = p1 + p2 * r * cos(th);
    v[1] = p1 + p2 * r * sin(th);
}

#endif /* KPL_PHILOX_H */
