/*
 * dataio_impl.h — what the files of dataio/ share: CRC32C, little-endian
 * field access, whole-buffer file I/O and the on-disk layout constants of
 * docs/kplrecord.md.
 */
#ifndef KPL_DATAIO_IMPL_H
#define KPL_DATAIO_IMPL_H

#include "dataio.h"

#include <string.h>
#include <sys/types.h>

/* ---- layout (docs/kplrecord.md) ---- */
#define KPLR_DATA_MAGIC "KPLRDATA"
#define KPLR_INDEX_MAGIC "KPLRINDX"
#define KPLR_CHUNK_MAGIC "KCHK"
#define KPLR_FILE_HEADER 32
#define KPLR_CHUNK_HEADER 32
#define KPLR_CHUNK_ENTRY 32
#define KPLR_RECORD_ENTRY 8
#define KPLR_RECORD_HEADER 8
#define KPLR_FLAG_ZSTD 1u
#define KPLR_MAX_BODY 0x7fffffffu
#define KPLR_METADATA "METADATA"
#define KPLR_WRITING "WRITING"

/* ---- CRC32C (Castagnoli); SSE4.2 when the CPU has it ---- */
uint32_t kpl__crc32c_extend(uint32_t crc, const void *data, size_t n);
static inline uint32_t kpl__crc32c(const void *data, size_t n)
{
    return kpl__crc32c_extend(0, data, n);
}

/* ---- little-endian fields (x86 and ARM are little-endian; memcpy keeps
 *      unaligned access defined) ---- */
static inline uint32_t kpl__rd32(const void *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline uint64_t kpl__rd64(const void *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static inline void kpl__wr32(void *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void kpl__wr64(void *p, uint64_t v) { memcpy(p, &v, 8); }
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kpl's dataio assumes a little-endian host"
#endif

/* ---- file helpers: whole transfers, errors name the path ---- */
kpl_status kpl__write_all(int fd, const void *buf, size_t n, const char *path);
kpl_status kpl__pread_all(int fd, void *buf, size_t n, off_t off, const char *path);
/* Reads a whole file into a malloc'd buffer (NUL-terminated). */
kpl_status kpl__read_file(const char *path, char **buf, size_t *len);
/* "dir/name" into out[size]; KPL_EINVAL when it does not fit. */
kpl_status kpl__path_join(char *out, size_t size, const char *dir, const char *name);

/* Element size of a feature's values (1 for bytes and strings). */
static inline size_t kpl__feature_elem_size(kpl_feature_type t)
{
    return t == KPL_FEATURE_INT64 ? 8 : t == KPL_FEATURE_FLOAT ? 4 : 1;
}

/* The schema as METADATA's "features" array (a new jansson reference). */
struct json_t;
struct json_t *kpl__schema_json(int nf, const kpl_feature_spec *schema);

/* A progress line on stderr, rewritten in place ("\r"), at most every
 * 0.2 s; `done == total` ends it with a newline. */
typedef struct {
    const char *label;
    double last, start;
    bool on;
} kpl__progress;
void kpl__progress_init(kpl__progress *p, const char *label, bool on);
void kpl__progress_update(kpl__progress *p, uint64_t done, uint64_t total, const char *unit);

#endif /* KPL_DATAIO_IMPL_H */
