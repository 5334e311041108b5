/* fuzz_ckpt.h — for the harnesses of files in the checkpoint container
 * (checkpoints, model files): a valid container around a payload, so that
 * mutations of the payload reach the parsers behind the checksums. */
#ifndef KPL_FUZZ_CKPT_H
#define KPL_FUZZ_CKPT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zstd.h>

#include "dataio.h"

static inline void fuzz_put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void fuzz_put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* A checkpoint file around `payload` (docs/checkpoint.md): header + one
 * zstd frame, both CRC32Cs right.  malloc'd, *len its size. */
static inline uint8_t *fuzz_ckpt_wrap(const uint8_t *payload, size_t n, size_t *len)
{
    size_t cap = ZSTD_compressBound(n);
    uint8_t *f = malloc(40 + cap);
    if (!f) abort();
    size_t z = ZSTD_compress(f + 40, cap, payload, n, 1);
    if (ZSTD_isError(z)) abort();
    memcpy(f, "KPLCKPT\n", 8);
    fuzz_put32(f + 8, 1);
    fuzz_put32(f + 12, 1);
    fuzz_put64(f + 16, n);
    fuzz_put64(f + 24, z);
    fuzz_put32(f + 32, kpl_crc32c(0, f + 40, z));
    fuzz_put32(f + 36, kpl_crc32c(0, f, 36));
    *len = 40 + z;
    return f;
}

#endif
