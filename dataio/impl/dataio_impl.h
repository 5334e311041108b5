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

/* ---- CRC32C of a whole buffer (kpl_crc32c continues one, kernels.h) ---- */
static inline uint32_t kpl__crc32c(const void *data, size_t n) { return kpl_crc32c(0, data, n); }

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

/* The count every value of a feature must have, fixed by its shape
 * (docs/kplrecord.md): the product of the extents for an int64 or float
 * feature, and for a bytes feature whose encoding is "raw"; -1 when there
 * is no shape or it is only a hint (encoded images, strings).  A product
 * past 2^32 - 1 comes back as INT64_MAX, which no count matches. */
static inline int64_t kpl__feature_fixed_count(const kpl_feature_spec *f)
{
    if (f->ndim <= 0 || f->type == KPL_FEATURE_STRING ||
        (f->type == KPL_FEATURE_BYTES && strcmp(f->encoding, "raw")))
        return -1;
    uint64_t n = 1;
    for (int d = 0; d < f->ndim && d < 8; d++) {
        if (f->shape[d] <= 0 || (uint64_t)f->shape[d] > 0xffffffffull ||
            __builtin_mul_overflow(n, (uint64_t)f->shape[d], &n) || n > 0xffffffffull)
            return INT64_MAX;
    }
    return (int64_t)n;
}

/* "[28, 28, 1]" into out[n]. */
void kpl__shape_str(const kpl_feature_spec *f, char *out, size_t n);

/* ---- counter-based randomness: every draw is a pure function of its
 *      key, so an order or an augmentation never depends on which process
 *      or thread made it ---- */
static inline uint64_t kpl__mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
/* A splitmix64 stream. */
typedef struct {
    uint64_t s;
} kpl__rng;
/* A stream keyed by up to three numbers (e.g. seed, epoch, example). */
static inline kpl__rng kpl__rng_key(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t k = kpl__mix64(a + 0x9E3779B97F4A7C15ull);
    k = kpl__mix64(k ^ (b + 0xD1B54A32D192ED03ull));
    k = kpl__mix64(k ^ (c + 0x8CB92BA72F3D8DD7ull));
    return (kpl__rng){k};
}
static inline uint64_t kpl__rng_next(kpl__rng *r)
{
    return kpl__mix64(r->s += 0x9E3779B97F4A7C15ull);
}
/* Uniform in [0, 1) with 53 random bits. */
static inline double kpl__rng_uniform(kpl__rng *r)
{
    return (double)(kpl__rng_next(r) >> 11) * 0x1.0p-53;
}
/* Uniform integer in [0, n), n >= 1, without modulo bias (Lemire). */
static inline uint64_t kpl__rng_below(kpl__rng *r, uint64_t n)
{
    unsigned __int128 m = (unsigned __int128)kpl__rng_next(r) * n;
    uint64_t lo = (uint64_t)m;
    if (lo < n) {
        uint64_t t = -n % n;
        while (lo < t) {
            m = (unsigned __int128)kpl__rng_next(r) * n;
            lo = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}
/* Fisher-Yates shuffle of v[0..n). */
static inline void kpl__rng_shuffle(kpl__rng *r, int64_t *v, int64_t n)
{
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)kpl__rng_below(r, (uint64_t)i + 1);
        int64_t t = v[i];
        v[i] = v[j];
        v[j] = t;
    }
}

/* ---- records: raw bodies for the pipeline, parsed where they are used ---- */
/* Record i of chunk c as its stored body (CRC already checked by
 * kpl_dataset_read_chunk): a view into c. */
void kpl__chunk_record_body(const kpl_chunk *c, int i, const uint8_t **body, uint32_t *len);
/* I/O hints for a reader: the access pattern of the shard files, and a
 * chunk that will be read soon (read-ahead starts now).  Never fail. */
void kpl__dataset_advise(const kpl_dataset *ds, bool sequential);
void kpl__dataset_willneed(const kpl_dataset *ds, int64_t chunk);
/* Reads one record of an uncompressed chunk by itself (one pread of its
 * bytes: random access without reading the chunk), checks its length
 * against the index and its CRC32C.  *buf grows as needed (*cap bytes);
 * *body views into it. */
kpl_status kpl__dataset_read_record(const kpl_dataset *ds, int64_t example, uint8_t **buf,
                                    size_t *cap, const uint8_t **body, uint32_t *len);
/* Splits a record body into values[nf] (views into body), checking that
 * the feature counts fill it exactly; `where` prefixes the error. */
kpl_status kpl__record_parse(int nf, const kpl_feature_spec *schema, const uint8_t *body,
                             uint32_t len, kpl_feature_value *values, const char *where);

/* The schema as METADATA's "features" array (a new jansson reference). */
struct json_t;
struct json_t *kpl__schema_json(int nf, const kpl_feature_spec *schema);

/* METADATA's text (version 2) for the JSON object m, which must not hold
 * the key itself: m indented, then as its last key "metadata_crc32c", the
 * CRC32C of every byte of the text before that key's opening quote, so an
 * edited METADATA is refused (docs/kplrecord.md).  No trailing newline.
 * malloc'd; NULL on OOM. */
#define KPLR_METADATA_CRC_KEY "metadata_crc32c"
char *kpl__metadata_text(struct json_t *m);
/* Where the checksummed bytes of a METADATA text end: the offset of the
 * last '"metadata_crc32c"' in text[0..n), or -1. */
int64_t kpl__metadata_crc_end(const char *text, size_t n);

/* A converter's progress: a line on stderr when o->progress, rewritten in
 * place ("\r"), at most every 0.2 s (`done == total` ends it with a
 * newline), and o->cancel asked at every update (KPL_ECANCELED, naming
 * the label, when it says stop).  label: o->label, else `out_dir`. */
typedef struct {
    const char *label;
    double last, start;
    bool on;
    bool (*cancel)(void *ctx);
    void *cancel_ctx;
} kpl__progress;
void kpl__progress_init(kpl__progress *p, const kpl_convert_options *o, const char *out_dir);
kpl_status kpl__progress_update(kpl__progress *p, uint64_t done, uint64_t total,
                                const char *unit);

#endif /* KPL_DATAIO_IMPL_H */
