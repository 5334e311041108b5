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

#endif /* KPL_PHILOX_H */
