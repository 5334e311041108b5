/*
 * dataio_util.c — file I/O helpers and the progress line.
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
