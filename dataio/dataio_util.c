/*
 * dataio_util.c — CRC32C, file I/O helpers and the progress line.
 */
#include "dataio_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The converters' sources (convert_idx.c, convert_folder.c, convert_lmdb.c). */
KPL_ENUM_DEFINE(kpl_convert_source, KPL_CONVERT_SOURCES)

/* ---- CRC32C ---------------------------------------------------------------------- */

/* Slicing-by-8 tables for CPUs without SSE4.2; built once. */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static bool crc_hw;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
#if defined(__x86_64__)
    __builtin_cpu_init();
    crc_hw = __builtin_cpu_supports("sse4.2");
#endif
}

static uint32_t crc_sw(uint32_t c, const uint8_t *p, size_t n)
{
    while (n >= 8) {
        uint64_t v = kpl__rd64(p) ^ c;
        c = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^
            crc_table[5][(v >> 16) & 0xff] ^ crc_table[4][(v >> 24) & 0xff] ^
            crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
            crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__)
/* One stream of the crc32 instruction: several GB/s, well above what disks
 * and zstd deliver, so the interleaved three-stream form is not worth its
 * complexity here. */
__attribute__((target("sse4.2"))) static uint32_t crc_hw_run(uint32_t c, const uint8_t *p,
                                                             size_t n)
{
    uint64_t c64 = c;
    while (n >= 8) {
        c64 = __builtin_ia32_crc32di(c64, kpl__rd64(p));
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--) c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}
#endif

uint32_t kpl__crc32c_extend(uint32_t crc, const void *data, size_t n)
{
    pthread_once(&crc_once, crc_init);
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (crc_hw) return ~crc_hw_run(c, data, n);
#endif
    return ~crc_sw(c, data, n);
}

uint32_t kpl_crc32c(uint32_t crc, const void *data, size_t n)
{
    return kpl__crc32c_extend(crc, data, n);
}

/* ---- files ----------------------------------------------------------------------- */

kpl_status kpl__pread_all(int fd, void *buf, size_t n, off_t off, const char *path)
{
    char *p = buf;
    while (n) {
        ssize_t r = pread(fd, p, n, off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0)
            return KPL_ERROR(KPL_EIO, "%s: read at offset %lld failed: %s", path,
                             (long long)off, strerror(errno));
        if (r == 0)
            return KPL_ERROR(KPL_EFORMAT, "%s: file ends at offset %lld, %zu bytes short",
                             path, (long long)off, n);
        p += r;
        off += r;
        n -= (size_t)r;
    }
    return KPL_OK;
}

kpl_status kpl__read_file(const char *path, char **buf, size_t *len)
{
    *buf = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return KPL_ERROR(errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "%s: %s", path,
                                 strerror(errno));
    struct stat sb;
    kpl_status st = KPL_OK;
    char *b = NULL;
    if (fstat(fd, &sb) < 0) {
        st = KPL_ERROR(KPL_EIO, "%s: %s", path, strerror(errno));
        goto fail;
    }
    b = malloc((size_t)sb.st_size + 1);
    if (!b) {
        st = KPL_ERROR(KPL_ENOMEM, "%s: no memory for %lld bytes", path, (long long)sb.st_size);
        goto fail;
    }
    KPL_TRY_GOTO(kpl__pread_all(fd, b, (size_t)sb.st_size, 0, path));
    b[sb.st_size] = 0;
    *buf = b;
    if (len) *len = (size_t)sb.st_size;
    close(fd);
    return KPL_OK;
fail:
    free(b);
    close(fd);
    return st;
}

kpl_status kpl__path_join(char *out, size_t size, const char *dir, const char *name)
{
    int n = snprintf(out, size, "%s/%s", dir, name);
    KPL_CHECK(n > 0 && (size_t)n < size, KPL_EINVAL, "path too long: %s/%s", dir, name);
    return KPL_OK;
}

/* ---- schema ---------------------------------------------------------------------- */

json_t *kpl__schema_json(int nf, const kpl_feature_spec *schema)
{
    json_t *a = json_array();
    for (int i = 0; i < nf; i++) {
        const kpl_feature_spec *f = &schema[i];
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(f->name));
        json_object_set_new(o, "type", json_string(kpl_feature_type_name(f->type)));
        if (f->encoding[0]) json_object_set_new(o, "encoding", json_string(f->encoding));
        if (f->ndim) {
            json_t *sh = json_array();
            for (int d = 0; d < f->ndim; d++) json_array_append_new(sh, json_integer(f->shape[d]));
            json_object_set_new(o, "shape", sh);
        }
        json_array_append_new(a, o);
    }
    return a;
}

void kpl__shape_str(const kpl_feature_spec *f, char *out, size_t n)
{
    size_t k = (size_t)snprintf(out, n, "[");
    for (int d = 0; d < f->ndim && d < 8 && k < n; d++)
        k += (size_t)snprintf(out + k, n - k, "%s%lld", d ? ", " : "", (long long)f->shape[d]);
    if (k < n) snprintf(out + k, n - k, "]");
}

/* ---- METADATA's checksum ------------------------------------------------------------ */

char *kpl__metadata_text(json_t *m)
{
    KPL_ASSERT(json_is_object(m) && !json_object_get(m, KPLR_METADATA_CRC_KEY),
               "METADATA object already sealed");
    char *t = json_dumps(m, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    if (!t) return NULL;
    /* "{\n  ...last value\n}": keep up to the last value, add the key. */
    size_t n = strlen(t);
    while (n > 0 && t[n - 1] != '}') n--;
    KPL_ASSERT(n > 0, "json_dumps of an object without '}'");
    n--;
    while (n > 0 && (t[n - 1] == '\n' || t[n - 1] == ' ')) n--;
    bool empty = n > 0 && t[n - 1] == '{';
    const char *sep = empty ? "\n  " : ",\n  ";
    size_t cap = n + 64;
    char *out = malloc(cap);
    if (!out) {
        free(t);
        return NULL;
    }
    memcpy(out, t, n);
    free(t);
    size_t k = n + (size_t)snprintf(out + n, cap - n, "%s", sep);
    uint32_t crc = kpl__crc32c(out, k);
    snprintf(out + k, cap - k, "\"%s\": %u\n}", KPLR_METADATA_CRC_KEY, crc);
    return out;
}

int64_t kpl__metadata_crc_end(const char *text, size_t n)
{
    static const char key[] = "\"" KPLR_METADATA_CRC_KEY "\"";
    const size_t kl = sizeof key - 1;
    for (size_t i = n >= kl ? n - kl + 1 : 0; i-- > 0;)
        if (text[i] == '"' && !memcmp(text + i, key, kl)) return (int64_t)i;
    return -1;
}

/* ---- progress -------------------------------------------------------------------- */

void kpl__progress_init(kpl__progress *p, const kpl_convert_options *o, const char *out_dir)
{
    p->label = o->label ? o->label : out_dir ? out_dir : "";
    p->on = o->progress;
    p->start = kpl_seconds();
    p->last = 0;
    p->cancel = o->cancel;
    p->cancel_ctx = o->cancel_ctx;
}

kpl_status kpl__progress_update(kpl__progress *p, uint64_t done, uint64_t total, const char *unit)
{
    if (p->cancel && p->cancel(p->cancel_ctx)) {
        if (p->on) fputc('\n', stderr);
        return KPL_ERROR(KPL_ECANCELED, "%s: conversion stopped on request after %llu of %llu "
                         "%s (its partial output is removed)", p->label,
                         (unsigned long long)done, (unsigned long long)total, unit);
    }
    if (!p->on) return KPL_OK;
    double t = kpl_seconds();
    bool end = done >= total;
    if (!end && t - p->last < 0.2) return KPL_OK;
    p->last = t;
    double el = t - p->start, rate = el > 0 ? (double)done / el : 0;
    int width = 30, fill = total ? (int)((double)width * (double)done / (double)total) : width;
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    double eta = rate > 0 && total > done ? (double)(total - done) / rate : 0;
    fprintf(stderr, "\r%s [%s] %llu/%llu %s, %.0f %s/s, %s %.0f s   ", p->label, bar,
            (unsigned long long)done, (unsigned long long)total, unit, rate, unit,
            end ? "took" : "eta", end ? el : eta);
    if (end) fputc('\n', stderr);
    fflush(stderr);
    return KPL_OK;
}
