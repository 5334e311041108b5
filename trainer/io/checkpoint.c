/*
 * checkpoint.c — named tensors and a JSON object in one zstd stream,
 * written so that a crash never leaves something that looks complete:
 * the file goes to PATH.tmp, its header (sizes, checksums) is written
 * last, it is fsync'd and renamed to PATH, and only then is the
 * completion marker PATH.done written the same way.  A reader trusts a
 * checkpoint only with its marker, and checks every byte anyway
 * (docs/checkpoint.md is the format).
 */
#include "checkpoint.h"
#include "io_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#define CKPT_MAGIC "KPLCKPT\n"
#define CKPT_VERSION 1u
#define CKPT_HEADER 40
#define CKPT_ALIGN 64
#define CKPT_LEVEL 3 /* zstd: fast; float weights barely compress at any level */

typedef struct {
    char *name;
    kpl_tensor *t; /* retained */
} entry;

struct kpl_checkpoint {
    entry *e;
    int n, cap;
    char *meta;           /* JSON object text */
    kpl_storage *storage; /* loaded: the decompressed payload */
    char path[PATH_MAX];  /* loaded: where from */
};

kpl_status kpl_checkpoint_create(kpl_checkpoint **out)
{
    KPL_CHECK(out, KPL_EINVAL, "checkpoint_create: NULL");
    *out = calloc(1, sizeof **out);
    KPL_CHECK(*out, KPL_ENOMEM, "checkpoint: out of memory");
    (*out)->meta = strdup("{}");
    if (!(*out)->meta) {
        free(*out);
        *out = NULL;
        return KPL_ERROR(KPL_ENOMEM, "checkpoint: out of memory");
    }
    return KPL_OK;
}

void kpl_checkpoint_destroy(kpl_checkpoint *c)
{
    if (!c) return;
    for (int i = 0; i < c->n; i++) {
        free(c->e[i].name);
        kpl_tensor_release(c->e[i].t);
    }
    free(c->e);
    free(c->meta);
    kpl_storage_release(c->storage);
    free(c);
}

static kpl_status add_entry(kpl_checkpoint *c, const char *name, kpl_tensor *t)
{
    KPL_CHECK(name && *name && strlen(name) < 256, KPL_EINVAL,
              "checkpoint: tensor names are 1 to 255 bytes");
    KPL_CHECK(!kpl_checkpoint_find(c, name), KPL_EINVAL, "checkpoint: tensor '%s' added twice",
              name);
    if (c->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 64;
        entry *e = realloc(c->e, (size_t)cap * sizeof *e);
        KPL_CHECK(e, KPL_ENOMEM, "checkpoint: out of memory");
        c->e = e;
        c->cap = cap;
    }
    char *nm = strdup(name);
    KPL_CHECK(nm, KPL_ENOMEM, "checkpoint: out of memory");
    c->e[c->n++] = (entry){nm, t};
    return KPL_OK;
}

kpl_status kpl_checkpoint_add(kpl_checkpoint *c, const char *name, kpl_tensor *t)
{
    KPL_CHECK(c && t, KPL_EINVAL, "checkpoint_add: NULL");
    KPL_TRY(add_entry(c, name, t));
    kpl_tensor_retain(t);
    return KPL_OK;
}

kpl_status kpl_checkpoint_set_meta(kpl_checkpoint *c, const char *json)
{
    KPL_CHECK(c && json, KPL_EINVAL, "checkpoint_set_meta: NULL");
    json_error_t err;
    json_t *j = json_loads(json, 0, &err);
    KPL_CHECK(j, KPL_EINVAL, "checkpoint: metadata is not JSON: %s (line %d)", err.text,
              err.line);
    bool obj = json_is_object(j);
    json_decref(j);
    KPL_CHECK(obj, KPL_EINVAL, "checkpoint: metadata must be a JSON object");
    char *m = strdup(json);
    KPL_CHECK(m, KPL_ENOMEM, "checkpoint: out of memory");
    free(c->meta);
    c->meta = m;
    return KPL_OK;
}

const char *kpl_checkpoint_meta(const kpl_checkpoint *c) { return c->meta; }
int kpl_checkpoint_num_tensors(const kpl_checkpoint *c) { return c->n; }
const char *kpl_checkpoint_name(const kpl_checkpoint *c, int i) { return c->e[i].name; }

kpl_tensor *kpl_checkpoint_find(const kpl_checkpoint *c, const char *name)
{
    for (int i = 0; i < c->n; i++)
        if (!strcmp(c->e[i].name, name)) return c->e[i].t;
    return NULL;
}

kpl_status kpl_checkpoint_restore(const kpl_checkpoint *c, const char *name, kpl_tensor *dst)
{
    KPL_TRY(kpl_checkpoint_check(c, name, dst));
    return kpl_k_copy(dst, kpl_checkpoint_find(c, name));
}

kpl_status kpl_checkpoint_check(const kpl_checkpoint *c, const char *name, const kpl_tensor *dst)
{
    kpl_tensor *t = kpl_checkpoint_find(c, name);
    const char *file = c->path[0] ? c->path : "checkpoint";
    KPL_CHECK(t, KPL_ENOTFOUND, "%s: has no tensor '%s'", file, name);
    char a[96], b[96];
    KPL_CHECK(kpl_tensor_dtype(t) == kpl_tensor_dtype(dst), KPL_EDTYPE,
              "%s: tensor '%s' is %s, the model's is %s", file, name,
              kpl_dtype_name(kpl_tensor_dtype(t)), kpl_dtype_name(kpl_tensor_dtype(dst)));
    bool same = kpl_tensor_ndim(t) == kpl_tensor_ndim(dst);
    for (int i = 0; same && i < kpl_tensor_ndim(t); i++)
        same = kpl_tensor_shape(t)[i] == kpl_tensor_shape(dst)[i];
    KPL_CHECK(same, KPL_ESHAPE, "%s: tensor '%s' has shape %s, the model's has %s", file, name,
              kpl_shape_str(kpl_tensor_ndim(t), kpl_tensor_shape(t), a, sizeof a),
              kpl_shape_str(kpl_tensor_ndim(dst), kpl_tensor_shape(dst), b, sizeof b));
    return KPL_OK;
}

/* ---- writing -------------------------------------------------------------------------- */

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }


/* The compressor's output goes to the file, checksummed on its way. */
typedef struct {
    ZSTD_CCtx *z;
    int fd;
    const char *path;
    uint8_t *out;
    size_t out_cap;
    uint32_t crc;
    uint64_t raw, stored;
} zwriter;

static kpl_status zw_feed(zwriter *w, const void *data, size_t n, ZSTD_EndDirective end)
{
    ZSTD_inBuffer in = {data, n, 0};
    for (;;) {
        ZSTD_outBuffer o = {w->out, w->out_cap, 0};
        size_t left = ZSTD_compressStream2(w->z, &o, &in, end);
        KPL_CHECK(!ZSTD_isError(left), KPL_EIO, "%s: zstd: %s", w->path, ZSTD_getErrorName(left));
        if (o.pos) {
            w->crc = kpl_crc32c(w->crc, w->out, o.pos);
            w->stored += o.pos;
            KPL_TRY(kpl__write_all(w->fd, w->out, o.pos, w->path));
        }
        bool done = end == ZSTD_e_end ? left == 0 : in.pos == in.size;
        if (done) break;
    }
    w->raw += n;
    return KPL_OK;
}

static kpl_status zw_pad(zwriter *w)
{
    static const uint8_t zeros[CKPT_ALIGN];
    size_t pad = (size_t)((CKPT_ALIGN - w->raw % CKPT_ALIGN) % CKPT_ALIGN);
    return pad ? zw_feed(w, zeros, pad, ZSTD_e_continue) : KPL_OK;
}

static kpl_status fsync_dir_of(const char *path)
{
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    else snprintf(dir, sizeof dir, ".");
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    KPL_CHECK(fd >= 0, KPL_EIO, "%s: cannot open directory: %s", dir, strerror(errno));
    int rc = fsync(fd);
    close(fd);
    KPL_CHECK(rc == 0, KPL_EIO, "%s: fsync of the directory failed: %s", dir, strerror(errno));
    return KPL_OK;
}

/* The JSON at the start of the payload: the metadata and the tensor table.
 * Offsets are from the payload's start, each a multiple of CKPT_ALIGN. */
static char *table_json(const kpl_checkpoint *c, uint64_t *first_offset)
{
    json_t *meta = json_loads(c->meta, 0, NULL);
    json_t *root = json_object(), *arr = json_array();
    if (!meta || !root || !arr) {
        json_decref(meta), json_decref(root), json_decref(arr);
        return NULL;
    }
    json_object_set_new(root, "format", json_string("kpl-checkpoint"));
    json_object_set_new(root, "version", json_integer(CKPT_VERSION));
    json_object_set_new(root, "meta", meta);
    json_object_set_new(root, "tensors", arr);
    /* The table's own size decides where the data starts; offsets are
     * written as fixed-width numbers so that the size does not depend on
     * them: two passes with the same length. */
    char *text = NULL;
    for (int pass = 0; pass < 2; pass++) {
        json_array_clear(arr);
        uint64_t off = *first_offset;
        for (int i = 0; i < c->n; i++) {
            kpl_tensor *t = c->e[i].t;
            json_t *e = json_object(), *shape = json_array();
            for (int d = 0; d < kpl_tensor_ndim(t); d++)
                json_array_append_new(shape, json_integer(kpl_tensor_shape(t)[d]));
            char offs[32];
            snprintf(offs, sizeof offs, "%020llu", (unsigned long long)off);
            json_object_set_new(e, "name", json_string(c->e[i].name));
            json_object_set_new(e, "dtype", json_string(kpl_dtype_name(kpl_tensor_dtype(t))));
            json_object_set_new(e, "shape", shape);
            json_object_set_new(e, "offset", json_string(offs));
            json_object_set_new(e, "bytes", json_integer((json_int_t)kpl_tensor_nbytes(t)));
            json_array_append_new(arr, e);
            off += (kpl_tensor_nbytes(t) + CKPT_ALIGN - 1) / CKPT_ALIGN * CKPT_ALIGN;
        }
        free(text);
        text = json_dumps(root, JSON_COMPACT);
        if (!text) break;
        uint64_t start = 8 + strlen(text);
        start = (start + CKPT_ALIGN - 1) / CKPT_ALIGN * CKPT_ALIGN;
        if (start == *first_offset) break;
        *first_offset = start;
    }
    json_decref(root);
    return text;
}

kpl_status kpl_checkpoint_save(kpl_checkpoint *c, const char *path)
{
    return kpl__checkpoint_write(c, path, true);
}

kpl_status kpl__checkpoint_write(kpl_checkpoint *c, const char *path, bool marker)
{
    KPL_CHECK(c && path && *path, KPL_EINVAL, "checkpoint_save: bad arguments");
    KPL_CHECK(strlen(path) + 8 < PATH_MAX, KPL_EINVAL, "checkpoint: path too long");
    char done[PATH_MAX];
    snprintf(done, sizeof done, "%s.done", path);
    /* An older checkpoint of the same name loses its marker first, so a
     * crash below never pairs the old marker with the new file. */
    if (marker && unlink(done) != 0 && errno != ENOENT)
        return KPL_ERROR(KPL_EIO, "%s: cannot remove: %s", done, strerror(errno));
    uint64_t first = 0;
    char *table = table_json(c, &first);
    KPL_CHECK(table, KPL_ENOMEM, "checkpoint: out of memory");
    KPL_ASSERT(first >= 8 + strlen(table), "checkpoint: table offsets");
    zwriter w;
    memset(&w, 0, sizeof w);
    kpl__afile a = {.fd = -1};
    w.fd = -1;
    w.path = a.tmp;
    kpl_status st = KPL_OK;
    w.z = ZSTD_createCCtx();
    w.out_cap = ZSTD_CStreamOutSize();
    w.out = malloc(w.out_cap);
    if (!w.z || !w.out) {
        st = KPL_ERROR(KPL_ENOMEM, "checkpoint: out of memory");
        goto fail;
    }
    ZSTD_CCtx_setParameter(w.z, ZSTD_c_compressionLevel, CKPT_LEVEL);
    KPL_TRY_GOTO(kpl__afile_open(&a, path));
    w.fd = a.fd;
    uint8_t header[CKPT_HEADER];
    memset(header, 0, sizeof header);
    KPL_TRY_GOTO(kpl__write_all(w.fd, header, sizeof header, a.tmp)); /* filled in at the end */
    uint8_t len8[8];
    put64(len8, strlen(table));
    KPL_TRY_GOTO(zw_feed(&w, len8, 8, ZSTD_e_continue));
    KPL_TRY_GOTO(zw_feed(&w, table, strlen(table), ZSTD_e_continue));
    KPL_TRY_GOTO(zw_pad(&w));
    for (int i = 0; i < c->n; i++) {
        kpl_tensor *t = c->e[i].t;
        const void *data = kpl_tensor_host_data(t); /* copies a device tensor to the host */
        if (!data) {
            st = kpl_last_status();
            goto fail;
        }
        KPL_TRY_GOTO(zw_feed(&w, data, kpl_tensor_nbytes(t), ZSTD_e_continue));
        KPL_TRY_GOTO(zw_pad(&w));
    }
    KPL_TRY_GOTO(zw_feed(&w, NULL, 0, ZSTD_e_end));
    memcpy(header, CKPT_MAGIC, 8);
    put32(header + 8, CKPT_VERSION);
    put32(header + 12, 1); /* flags: zstd */
    put64(header + 16, w.raw);
    put64(header + 24, w.stored);
    put32(header + 32, w.crc);
    put32(header + 36, kpl_crc32c(0, header, 36));
    if (pwrite(w.fd, header, sizeof header, 0) != (ssize_t)sizeof header) {
        st = KPL_ERROR(KPL_EIO, "%s: header write failed: %s", a.tmp, strerror(errno));
        goto fail;
    }
    w.fd = -1;
    KPL_TRY_GOTO(kpl__afile_commit(&a)); /* fsync, rename over path */
    KPL_TRY_GOTO(fsync_dir_of(path));
    if (!marker) goto done_ok;
    char mtext[512];
    const char *base = strrchr(path, '/');
    snprintf(mtext, sizeof mtext,
             "{\"file\":\"%.200s\",\"bytes\":%llu,\"crc32c\":%u,\"version\":%u}\n",
             base ? base + 1 : path, (unsigned long long)(w.stored + CKPT_HEADER), w.crc,
             CKPT_VERSION);
    KPL_TRY_GOTO(kpl__write_file_atomic(done, mtext, strlen(mtext)));
    KPL_TRY_GOTO(fsync_dir_of(done));
done_ok:
    free(table);
    free(w.out);
    ZSTD_freeCCtx(w.z);
    return KPL_OK;
fail:
    kpl__afile_abort(&a);
    free(table);
    free(w.out);
    ZSTD_freeCCtx(w.z);
    return st;
}

/* ---- reading -------------------------------------------------------------------------- */

static uint32_t get32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static void free_payload(void *p) { free(p); }

/* Binds the tensor table of the decompressed payload. */
static kpl_status bind_table(kpl_checkpoint *c, uint8_t *raw, uint64_t raw_bytes)
{
    const char *f = c->path;
    KPL_CHECK(raw_bytes >= 8, KPL_EFORMAT, "%s: payload too short", f);
    uint64_t tl = get64(raw);
    KPL_CHECK(tl <= raw_bytes - 8, KPL_EFORMAT, "%s: table length %llu past the payload", f,
              (unsigned long long)tl);
    json_error_t err;
    json_t *root = json_loadb((const char *)raw + 8, (size_t)tl, 0, &err);
    KPL_CHECK(root, KPL_EFORMAT, "%s: tensor table is not JSON: %s", f, err.text);
    kpl_status st = KPL_OK;
    json_t *meta = json_object_get(root, "meta"), *arr = json_object_get(root, "tensors");
    const char *fmt = json_string_value(json_object_get(root, "format"));
    if (!fmt || strcmp(fmt, "kpl-checkpoint") || !json_is_object(meta) || !json_is_array(arr)) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: not a kpl checkpoint table", f);
        goto fail;
    }
    char *m = json_dumps(meta, JSON_COMPACT);
    if (!m) {
        st = KPL_ERROR(KPL_ENOMEM, "checkpoint: out of memory");
        goto fail;
    }
    free(c->meta);
    c->meta = m;
    size_t i;
    json_t *e;
    json_array_foreach(arr, i, e) {
        const char *name = json_string_value(json_object_get(e, "name"));
        const char *dts = json_string_value(json_object_get(e, "dtype"));
        const char *offs = json_string_value(json_object_get(e, "offset"));
        json_t *shape = json_object_get(e, "shape"), *bytes = json_object_get(e, "bytes");
        kpl_dtype dt;
        if (!name || !dts || !offs || !json_is_array(shape) || !json_is_integer(bytes) ||
            json_array_size(shape) > KPL_MAX_DIMS || kpl_dtype_parse(dts, &dt) < 0) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: tensor entry %zu is malformed", f, i);
            goto fail;
        }
        int64_t dims[KPL_MAX_DIMS], numel = 1;
        int nd = (int)json_array_size(shape);
        for (int d = 0; d < nd; d++) {
            json_t *v = json_array_get(shape, (size_t)d);
            dims[d] = json_is_integer(v) ? (int64_t)json_integer_value(v) : -1;
            if (dims[d] < 0 || (dims[d] && numel > INT64_MAX / dims[d])) {
                st = KPL_ERROR(KPL_EFORMAT, "%s: tensor '%s' has a bad shape", f, name);
                goto fail;
            }
            numel *= dims[d];
        }
        char *end = NULL;
        errno = 0;
        unsigned long long off = strtoull(offs, &end, 10);
        uint64_t nb = (uint64_t)json_integer_value(bytes);
        if ((uint64_t)numel > raw_bytes / kpl_dtype_size(dt)) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: tensor '%s' has %lld elements of %s, more than the "
                           "%llu-byte payload holds", f, name, (long long)numel, dts,
                           (unsigned long long)raw_bytes);
            goto fail;
        }
        if (nb != (uint64_t)numel * kpl_dtype_size(dt)) {
            char sh[96];
            st = KPL_ERROR(KPL_EFORMAT, "%s: tensor '%s' is said to hold %llu bytes, but its "
                           "shape %s of %s needs %llu", f, name, (unsigned long long)nb,
                           kpl_shape_str(nd, dims, sh, sizeof sh), dts,
                           (unsigned long long)numel * kpl_dtype_size(dt));
            goto fail;
        }
        if (errno || *end || off % CKPT_ALIGN || off < 8 + tl || off > raw_bytes ||
            nb > raw_bytes - off) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: tensor '%s' (%llu bytes at %s) does not fit the "
                           "%llu-byte payload", f, name, (unsigned long long)nb, offs,
                           (unsigned long long)raw_bytes);
            goto fail;
        }
        kpl_tensor *t = NULL;
        KPL_TRY_GOTO(kpl_tensor_from_storage(c->storage, (size_t)off, dt, nd, dims, &t));
        if ((st = add_entry(c, name, t)) < 0) {
            kpl_tensor_release(t);
            goto fail;
        }
    }
fail:
    json_decref(root);
    return st;
}

kpl_status kpl_checkpoint_load(const char *path, kpl_checkpoint **out)
{
    KPL_CHECK(path && out, KPL_EINVAL, "checkpoint_load: bad arguments");
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    KPL_CHECK(fd >= 0, errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "checkpoint %s: %s", path,
              strerror(errno));
    kpl_checkpoint *c = NULL;
    ZSTD_DCtx *z = NULL;
    uint8_t *in = NULL, *raw = NULL;
    kpl_status st = kpl_checkpoint_create(&c);
    if (st < 0) goto fail;
    snprintf(c->path, sizeof c->path, "%s", path);
    struct stat sb;
    uint8_t h[CKPT_HEADER];
    if (fstat(fd, &sb) != 0 || pread(fd, h, sizeof h, 0) != (ssize_t)sizeof h) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: shorter than a checkpoint header (%d bytes)", path,
                       CKPT_HEADER);
        goto fail;
    }
    if (memcmp(h, CKPT_MAGIC, 8)) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: not a kpl checkpoint (bad magic)", path);
        goto fail;
    }
    if (get32(h + 36) != kpl_crc32c(0, h, 36)) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: header checksum mismatch: the file is damaged or was "
                       "not finished", path);
        goto fail;
    }
    if (get32(h + 8) != CKPT_VERSION) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: checkpoint version %u; this kpl reads version %u", path,
                       get32(h + 8), CKPT_VERSION);
        goto fail;
    }
    uint64_t raw_bytes = get64(h + 16), stored = get64(h + 24);
    if (get32(h + 12) != 1 || stored != (uint64_t)sb.st_size - CKPT_HEADER) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: %llu bytes after the header, the header says %llu: the "
                       "file is truncated or extended", path,
                       (unsigned long long)sb.st_size - CKPT_HEADER, (unsigned long long)stored);
        goto fail;
    }
    if (raw_bytes > ((uint64_t)1 << 40)) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: implausible payload size %llu", path,
                       (unsigned long long)raw_bytes);
        goto fail;
    }
    /* The header's size is only a claim (its checksum can be forged): the
     * buffer grows with what really decompresses, up to that size. */
    size_t cap = raw_bytes < ((size_t)1 << 20) ? (size_t)raw_bytes : (size_t)1 << 20;
    if (cap == 0) cap = 1;
    raw = malloc(cap);
    size_t in_cap = ZSTD_DStreamInSize();
    in = malloc(in_cap);
    z = ZSTD_createDCtx();
    if (!raw || !in || !z) {
        st = KPL_ERROR(KPL_ENOMEM, "%s: no memory for a %llu-byte checkpoint", path,
                       (unsigned long long)raw_bytes);
        goto fail;
    }
    uint32_t crc = 0;
    uint64_t at = CKPT_HEADER;
    ZSTD_outBuffer o = {raw, cap < raw_bytes ? cap : (size_t)raw_bytes, 0};
    size_t zret = 1;
    while (at < (uint64_t)sb.st_size) {
        ssize_t r = pread(fd, in, in_cap, (off_t)at);
        if (r <= 0) {
            st = KPL_ERROR(KPL_EIO, "%s: read failed at byte %llu: %s", path,
                           (unsigned long long)at, r < 0 ? strerror(errno) : "end of file");
            goto fail;
        }
        at += (uint64_t)r;
        crc = kpl_crc32c(crc, in, (size_t)r);
        ZSTD_inBuffer ib = {in, (size_t)r, 0};
        for (;;) {
            if (o.pos == o.size && o.size < raw_bytes) {
                size_t grown = o.size * 2 < raw_bytes ? o.size * 2 : (size_t)raw_bytes;
                uint8_t *g = realloc(raw, grown);
                if (!g) {
                    st = KPL_ERROR(KPL_ENOMEM, "%s: no memory for a %llu-byte checkpoint", path,
                                   (unsigned long long)raw_bytes);
                    goto fail;
                }
                raw = g;
                o.dst = raw;
                o.size = grown;
            }
            size_t before = o.pos, ipos = ib.pos;
            zret = ZSTD_decompressStream(z, &o, &ib);
            if (ZSTD_isError(zret)) {
                st = KPL_ERROR(KPL_EFORMAT, "%s: zstd: %s", path, ZSTD_getErrorName(zret));
                goto fail;
            }
            if (ib.pos == ib.size && (zret == 0 || o.pos < o.size)) break; /* input used up */
            if (o.pos == before && ib.pos == ipos) break;   /* past the claimed size: below */
        }
    }
    if (crc != get32(h + 32)) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: payload checksum mismatch (stored %08x, computed %08x): "
                       "the file is damaged", path, get32(h + 32), crc);
        goto fail;
    }
    if (zret != 0 || o.pos != raw_bytes) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: payload decompresses to %zu bytes, the header says %llu",
                       path, o.pos, (unsigned long long)raw_bytes);
        goto fail;
    }
    st = kpl_storage_wrap(raw, raw_bytes ? raw_bytes : 1, free_payload, raw, &c->storage);
    if (st < 0) goto fail;
    raw = NULL; /* the storage owns it */
    KPL_TRY_GOTO(bind_table(c, kpl_storage_host_mutable(c->storage), raw_bytes));
    ZSTD_freeDCtx(z);
    free(in);
    close(fd);
    *out = c;
    return KPL_OK;
fail:
    ZSTD_freeDCtx(z);
    free(in);
    free(raw);
    close(fd);
    kpl_checkpoint_destroy(c);
    return st;
}

/* ---- finding ------------------------------------------------------------------------------ */

/* ckpt-<step>.kpl with its marker. */
static bool parse_name(const char *name, int64_t *step)
{
    unsigned long long s;
    int n = 0;
    if (sscanf(name, "ckpt-%llu.kpl%n", &s, &n) != 1 || name[n]) return false;
    *step = (int64_t)s;
    return true;
}

kpl_status kpl__checkpoint_list(const char *dir, int64_t *steps, int max, int *count)
{
    *count = 0;
    DIR *d = opendir(dir);
    if (!d && errno == ENOENT) return KPL_OK;
    KPL_CHECK(d, KPL_EIO, "%s: %s", dir, strerror(errno));
    struct dirent *de;
    while ((de = readdir(d))) {
        int64_t s;
        if (!parse_name(de->d_name, &s)) continue;
        char done[PATH_MAX];
        snprintf(done, sizeof done, "%s/%s.done", dir, de->d_name);
        if (access(done, F_OK) != 0) continue; /* unfinished */
        if (*count < max) steps[(*count)++] = s;
    }
    closedir(d);
    /* ascending */
    for (int i = 1; i < *count; i++)
        for (int j = i; j > 0 && steps[j - 1] > steps[j]; j--) {
            int64_t t = steps[j];
            steps[j] = steps[j - 1];
            steps[j - 1] = t;
        }
    return KPL_OK;
}

/* Whether `name` is something an interrupted save leaves in a checkpoint
 * directory: a temporary file, a checkpoint without its marker, or a
 * marker without its checkpoint. */
static bool unfinished(const char *dir, const char *name)
{
    size_t l = strlen(name);
    bool ours = !strncmp(name, "ckpt-", 5) || !strncmp(name, "best.kpl", 8);
    if (!ours) return false;
    if (l > 4 && !strcmp(name + l - 4, ".tmp")) return true;
    char other[PATH_MAX];
    if (l > 5 && !strcmp(name + l - 5, ".done")) { /* its checkpoint must exist */
        snprintf(other, sizeof other, "%s/%.*s", dir, (int)(l - 5), name);
        return access(other, F_OK) != 0;
    }
    if (l > 4 && !strcmp(name + l - 4, ".kpl")) { /* its marker must exist */
        snprintf(other, sizeof other, "%s/%s.done", dir, name);
        return access(other, F_OK) != 0;
    }
    return false;
}

kpl_status kpl__checkpoint_clean(const char *dir, const char *keep, int *removed, double *bytes)
{
    *removed = 0;
    *bytes = 0;
    struct stat kb;
    bool have_keep = keep && *keep && stat(keep, &kb) == 0;
    DIR *d = opendir(dir);
    if (!d && errno == ENOENT) return KPL_OK;
    KPL_CHECK(d, KPL_EIO, "%s: %s", dir, strerror(errno));
    kpl_status st = KPL_OK;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!unfinished(dir, de->d_name)) continue;
        char f[PATH_MAX];
        struct stat sb;
        snprintf(f, sizeof f, "%s/%s", dir, de->d_name);
        bool found = stat(f, &sb) == 0;
        if (found && have_keep && sb.st_dev == kb.st_dev && sb.st_ino == kb.st_ino) continue;
        double size = found ? (double)sb.st_size : 0;
        if (unlink(f) != 0 && errno != ENOENT) {
            st = KPL_ERROR(KPL_EIO, "cannot remove %s: %s", f, strerror(errno));
            break;
        }
        (*removed)++;
        *bytes += size;
    }
    closedir(d);
    return st;
}

void kpl__checkpoint_path(const char *dir, int64_t step, char *path, size_t len)
{
    snprintf(path, len, "%s/ckpt-%010lld.kpl", dir, (long long)step);
}

kpl_status kpl__checkpoint_remove(const char *path)
{
    char done[PATH_MAX];
    snprintf(done, sizeof done, "%s.done", path);
    /* the marker first: a checkpoint half removed is never complete */
    KPL_CHECK(unlink(done) == 0 || errno == ENOENT, KPL_EIO, "%s: cannot remove: %s", done,
              strerror(errno));
    KPL_CHECK(unlink(path) == 0 || errno == ENOENT, KPL_EIO, "%s: cannot remove: %s", path,
              strerror(errno));
    return KPL_OK;
}

kpl_status kpl__checkpoint_mark_evaluated(const char *path)
{
    char done[PATH_MAX + 8];
    snprintf(done, sizeof done, "%s.done", path);
    json_error_t err;
    json_t *m = json_load_file(done, 0, &err);
    KPL_CHECK(m && json_is_object(m), KPL_EFORMAT, "%s: %s", done,
              m ? "not a JSON object" : err.text);
    json_object_set_new(m, "evaluated", json_true());
    char *text = json_dumps(m, JSON_COMPACT);
    json_decref(m);
    KPL_CHECK(text, KPL_ENOMEM, "checkpoint: out of memory");
    size_t n = strlen(text);
    char *line = realloc(text, n + 2);
    if (!line) {
        free(text);
        return KPL_ERROR(KPL_ENOMEM, "checkpoint: out of memory");
    }
    memcpy(line + n, "\n", 2);
    kpl_status st = kpl__write_file_atomic(done, line, strlen(line));
    free(line);
    KPL_TRY(st);
    return fsync_dir_of(done);
}

bool kpl__checkpoint_evaluated(const char *path)
{
    char done[PATH_MAX + 8];
    snprintf(done, sizeof done, "%s.done", path);
    json_t *m = json_load_file(done, 0, NULL);
    bool yes = json_is_true(json_object_get(m, "evaluated"));
    json_decref(m);
    return yes;
}

kpl_status kpl__checkpoint_link(const char *src, const char *dst)
{
    char tmp[PATH_MAX + 8], done[PATH_MAX + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", dst);
    snprintf(done, sizeof done, "%s.done", dst);
    KPL_CHECK(unlink(done) == 0 || errno == ENOENT, KPL_EIO, "%s: cannot remove: %s", done,
              strerror(errno));
    unlink(tmp);
    if (link(src, tmp) != 0) {
        /* a file system without hard links: copy */
        int in = open(src, O_RDONLY | O_CLOEXEC);
        KPL_CHECK(in >= 0, KPL_EIO, "%s: %s", src, strerror(errno));
        int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (out < 0) {
            close(in);
            return KPL_ERROR(KPL_EIO, "%s: cannot create: %s", tmp, strerror(errno));
        }
        char buf[1 << 16];
        ssize_t r;
        kpl_status st = KPL_OK;
        while ((r = read(in, buf, sizeof buf)) > 0 && st >= 0) st = kpl__write_all(out, buf, (size_t)r, tmp);
        if (r < 0) st = KPL_ERROR(KPL_EIO, "%s: read failed: %s", src, strerror(errno));
        if (st >= 0 && fsync(out) != 0) st = KPL_ERROR(KPL_EIO, "%s: fsync: %s", tmp, strerror(errno));
        close(in);
        close(out);
        if (st < 0) {
            unlink(tmp);
            return st;
        }
    }
    KPL_CHECK(rename(tmp, dst) == 0, KPL_EIO, "%s: rename to %s failed: %s", tmp, dst,
              strerror(errno));
    char srcdone[PATH_MAX + 8];
    snprintf(srcdone, sizeof srcdone, "%s.done", src);
    FILE *f = fopen(srcdone, "r");
    char marker[512] = "{}\n";
    if (f) {
        size_t n = fread(marker, 1, sizeof marker - 1, f);
        marker[n] = 0;
        fclose(f);
    }
    KPL_TRY(kpl__write_file_atomic(done, marker, strlen(marker)));
    return fsync_dir_of(done);
}
