/*
 * record_write.c — the KPLRecord writer (docs/kplrecord.md).
 *
 * Records are appended to one open chunk buffer; a full chunk is
 * compressed (when that pays), checksummed and written to the next shard in
 * round-robin order, and its index entries are kept in memory until close
 * writes the index files and, last, METADATA.  Until then a WRITING file
 * marks the directory as unfinished.
 *
 * The writer holds an exclusive flock(2) on WRITING for its whole life,
 * and the marker only appears under that name once locked (it is made
 * under a temporary name and hard-linked into place).  So "WRITING is
 * there but nobody holds its lock" means its writer died, and another
 * process (the trainer converting a split on first use) may clear the
 * directory without ever deleting the files of a writer that is alive.
 * A writer also removes only files that are still the ones it created.
 */
#include "dataio_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

typedef struct {
    uint64_t offset, first;
    uint32_t stored, raw, nrec, flags;
} chunk_ent;

/* A file this writer created: removed on abandon only while the name
 * still leads to it (somebody may have replaced the directory since). */
typedef struct {
    dev_t dev;
    ino_t ino;
} file_id;

typedef struct {
    int fd;
    char data_path[PATH_MAX], index_path[PATH_MAX];
    file_id data_id, index_id;
    bool index_made;
    uint64_t bytes, raw_total;
    uint32_t crc; /* of the data file so far */
    chunk_ent *chunks;
    int64_t nchunks, chunk_cap;
    uint32_t *recs; /* (chunk, offset) pairs */
    int64_t nrecs, rec_cap;
} shard_w;

struct kpl_record_writer {
    char dir[PATH_MAX], writing_path[PATH_MAX], meta_tmp[PATH_MAX];
    bool made_dir, writing_made, tmp_made;
    int writing_fd;    /* holds the marker's lock until close or destroy */
    file_id writing_id, meta_tmp_id;
    int nf;
    kpl_feature_spec *schema;
    kpl_record_writer_config cfg;
    char *attrs; /* JSON object text */
    uint64_t uid;
    char created[32];
    shard_w *shards;
    uint8_t *raw; /* the open chunk's raw payload */
    size_t raw_len, raw_cap;
    uint32_t *cur_off; /* record offsets in the open chunk */
    int64_t cur_n, cur_cap;
    void *zbuf;
    size_t zcap;
    ZSTD_CCtx *cctx;
    int64_t chunks_closed, count;
    int no_shrink; /* chunks in a row that zstd did not shrink */
};

const char *kpl_feature_type_name(kpl_feature_type t)
{
    switch (t) {
    case KPL_FEATURE_BYTES: return "bytes";
    case KPL_FEATURE_INT64: return "int64";
    case KPL_FEATURE_FLOAT: return "float";
    case KPL_FEATURE_STRING: return "string";
    }
    return "?";
}

static kpl_status grow(void **p, int64_t *cap, int64_t need, size_t elem)
{
    if (need <= *cap) return KPL_OK;
    int64_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    KPL_CHECK(q, KPL_ENOMEM, "record writer: no memory for %lld entries", (long long)c);
    *p = q;
    *cap = c;
    return KPL_OK;
}

static kpl_status mkdir_p(const char *dir, bool *made)
{
    char tmp[PATH_MAX];
    KPL_CHECK(strlen(dir) < sizeof tmp, KPL_EINVAL, "path too long: %s", dir);
    strcpy(tmp, dir);
    *made = false;
    for (char *p = tmp + 1;; p++) {
        if (*p == '/' || !*p) {
            char c = *p;
            *p = 0;
            if (mkdir(tmp, 0777) == 0) {
                if (!c) *made = true;
            } else if (errno != EEXIST) {
                return KPL_ERROR(KPL_EIO, "cannot create directory %s: %s", tmp, strerror(errno));
            }
            *p = c;
            if (!c) break;
        }
    }
    struct stat sb;
    KPL_CHECK(stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode), KPL_EINVAL, "%s is not a directory",
              dir);
    return KPL_OK;
}

/* The name of the first entry of `dir` other than . and .., or "" when the
 * directory is empty. */
static kpl_status first_entry(const char *dir, char *name, size_t n)
{
    DIR *d = opendir(dir);
    KPL_CHECK(d, KPL_EIO, "cannot read directory %s: %s", dir, strerror(errno));
    name[0] = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(name, n, "%s", e->d_name);
            break;
        }
    closedir(d);
    return KPL_OK;
}

static bool valid_name(const char *s)
{
    size_t n = strnlen(s, KPL_FEATURE_NAME_MAX);
    if (n == 0 || n >= KPL_FEATURE_NAME_MAX) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '/' || c == '-'))
            return false;
    }
    return true;
}

static kpl_status check_schema(int nf, const kpl_feature_spec *schema)
{
    KPL_CHECK(nf >= 1 && nf <= 1024 && schema, KPL_EINVAL,
              "record writer: %d features (want 1 to 1024)", nf);
    for (int i = 0; i < nf; i++) {
        const kpl_feature_spec *f = &schema[i];
        KPL_CHECK(valid_name(f->name), KPL_EINVAL,
                  "record writer: feature %d: name '%.*s' is not 1-63 characters of "
                  "[A-Za-z0-9_./-]", i, KPL_FEATURE_NAME_MAX, f->name);
        KPL_CHECK((unsigned)f->type <= KPL_FEATURE_STRING, KPL_EINVAL,
                  "record writer: feature '%s': unknown type %d", f->name, (int)f->type);
        KPL_CHECK(strnlen(f->encoding, sizeof f->encoding) < sizeof f->encoding, KPL_EINVAL,
                  "record writer: feature '%s': encoding is not terminated", f->name);
        KPL_CHECK(f->ndim >= 0 && f->ndim <= 8, KPL_EINVAL,
                  "record writer: feature '%s': ndim %d (want 0 to 8)", f->name, f->ndim);
        for (int d = 0; d < f->ndim; d++)
            KPL_CHECK(f->shape[d] > 0, KPL_EINVAL,
                      "record writer: feature '%s': shape[%d] = %lld", f->name, d,
                      (long long)f->shape[d]);
        for (int j = 0; j < i; j++)
            KPL_CHECK(strcmp(schema[j].name, f->name), KPL_EINVAL,
                      "record writer: feature name '%s' appears twice", f->name);
    }
    return KPL_OK;
}

static kpl_status open_excl(const char *path, int *fd, file_id *id)
{
    *fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    KPL_CHECK(*fd >= 0, KPL_EIO, "cannot create %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(*fd, &sb) == 0) *id = (file_id){sb.st_dev, sb.st_ino};
    return KPL_OK;
}

/* unlink(path) when path is still the file `id` (and not, say, a new
 * dataset's file of the same name made by someone who cleared ours). */
static void unlink_own(const char *path, const file_id *id)
{
    struct stat sb;
    if (lstat(path, &sb) == 0 && sb.st_dev == id->dev && sb.st_ino == id->ino) unlink(path);
}

/* The WRITING marker: made under a temporary name, locked, filled, then
 * linked into place, so that WRITING never exists unlocked while its
 * writer lives.  link() also fails when another writer got there first. */
static kpl_status make_marker(kpl_record_writer *w, const char *created)
{
    char tmp[PATH_MAX], name[64], host[128] = "?";
    snprintf(name, sizeof name, "%s.%d.tmp", KPLR_WRITING, (int)getpid());
    KPL_TRY(kpl__path_join(tmp, sizeof tmp, w->dir, name));
    gethostname(host, sizeof host - 1);
    int fd = -1;
    file_id id;
    KPL_TRY(open_excl(tmp, &fd, &id));
    char line[300];
    int n = snprintf(line, sizeof line, "pid %d host %s started %s lock flock\n", (int)getpid(),
                     host, created);
    kpl_status st = KPL_OK;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0)
        st = KPL_ERROR(KPL_EIO, "cannot lock %s: %s", tmp, strerror(errno));
    if (st >= 0) st = kpl__write_all(fd, line, (size_t)n, tmp);
    if (st >= 0 && link(tmp, w->writing_path) != 0)
        st = KPL_ERROR(errno == EEXIST ? KPL_ESTATE : KPL_EIO,
                       "cannot create %s: %s%s", w->writing_path, strerror(errno),
                       errno == EEXIST ? " (another writer started in the same directory)" : "");
    unlink(tmp);
    if (st < 0) {
        close(fd);
        return st;
    }
    w->writing_fd = fd;
    w->writing_id = id;
    w->writing_made = true;
    return KPL_OK;
}

/* A file header of the data or index file (docs/kplrecord.md): magic,
 * version, shard, uid and, for the index, the chunk count. */
static void file_header(uint8_t h[KPLR_FILE_HEADER], const char *magic, uint32_t shard,
                        uint64_t uid, uint32_t extra)
{
    memcpy(h, magic, 8);
    kpl__wr32(h + 8, KPL_RECORD_VERSION);
    kpl__wr32(h + 12, shard);
    kpl__wr64(h + 16, uid);
    kpl__wr32(h + 24, extra);
    kpl__wr32(h + 28, kpl__crc32c(h, 28));
}

kpl_status kpl_record_writer_create(const char *dir, int num_features,
                                    const kpl_feature_spec *schema,
                                    const kpl_record_writer_config *cfg,
                                    kpl_record_writer **out)
{
    *out = NULL;
    kpl_record_writer_config c = KPL_RECORD_WRITER_CONFIG_INIT;
    if (cfg) c = *cfg;
    KPL_TRY(check_schema(num_features, schema));
    KPL_CHECK(c.shards >= 1 && c.shards <= 99999, KPL_EINVAL,
              "record writer: shards = %d (want 1 to 99999)", c.shards);
    KPL_CHECK(c.chunk_bytes >= 4096 && c.chunk_bytes <= ((size_t)1 << 30), KPL_EINVAL,
              "record writer: chunk_bytes = %zu (want 4 KiB to 1 GiB)", c.chunk_bytes);
    KPL_CHECK(c.zstd_level >= 0 && c.zstd_level <= ZSTD_maxCLevel(), KPL_EINVAL,
              "record writer: zstd_level = %d (want 0 to %d)", c.zstd_level, ZSTD_maxCLevel());
    KPL_CHECK(dir && strlen(dir) + 16 < PATH_MAX, KPL_EINVAL, "record writer: bad path %s",
              dir ? dir : "(null)");
    json_t *attrs = NULL;
    if (c.attributes_json) {
        json_error_t je;
        attrs = json_loads(c.attributes_json, 0, &je);
        KPL_CHECK(attrs, KPL_EINVAL, "record writer: attributes are not JSON: %s (column %d)",
                  je.text, je.column);
        if (!json_is_object(attrs)) {
            json_decref(attrs);
            return KPL_ERROR(KPL_EINVAL, "record writer: attributes must be a JSON object");
        }
    }
    kpl_status st = KPL_OK;
    kpl_record_writer *w = calloc(1, sizeof *w);
    if (!w) {
        json_decref(attrs);
        return KPL_ERROR(KPL_ENOMEM, "record writer: no memory");
    }
    w->attrs = attrs ? json_dumps(attrs, JSON_COMPACT | JSON_PRESERVE_ORDER) : strdup("{}");
    json_decref(attrs);
    w->cfg = c;
    w->cfg.attributes_json = NULL;
    w->nf = num_features;
    w->schema = malloc(sizeof *schema * (size_t)num_features);
    w->shards = calloc((size_t)c.shards, sizeof *w->shards);
    if (!w->attrs || !w->schema || !w->shards) {
        st = KPL_ERROR(KPL_ENOMEM, "record writer: no memory");
        goto fail;
    }
    memcpy(w->schema, schema, sizeof *schema * (size_t)num_features);
    for (int i = 0; i < c.shards; i++) w->shards[i].fd = -1;
    w->writing_fd = -1;
    strcpy(w->dir, dir);

    KPL_TRY_GOTO(mkdir_p(dir, &w->made_dir));
    char first[256];
    KPL_TRY_GOTO(first_entry(dir, first, sizeof first));
    if (first[0]) {
        st = KPL_ERROR(KPL_EINVAL,
                       "record writer: %s is not empty (it holds '%s'); refusing to write a "
                       "dataset over existing files", dir, first);
        goto fail;
    }
    /* WRITING first: from here on an interrupted writer is detectable. */
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(w->created, sizeof w->created, "%Y-%m-%dT%H:%M:%SZ", &tm);
    KPL_TRY_GOTO(kpl__path_join(w->writing_path, PATH_MAX, dir, KPLR_WRITING));
    KPL_TRY_GOTO(kpl__path_join(w->meta_tmp, PATH_MAX, dir, KPLR_METADATA ".tmp"));
    KPL_TRY_GOTO(make_marker(w, w->created));

    if (getrandom(&w->uid, sizeof w->uid, 0) != (ssize_t)sizeof w->uid)
        w->uid = ((uint64_t)now << 20) ^ (uint64_t)getpid() ^ (uint64_t)(uintptr_t)w;
    for (int s = 0; s < c.shards; s++) {
        shard_w *sh = &w->shards[s];
        char name[32];
        snprintf(name, sizeof name, "%05d.data", s);
        KPL_TRY_GOTO(kpl__path_join(sh->data_path, PATH_MAX, dir, name));
        snprintf(name, sizeof name, "%05d.index", s);
        KPL_TRY_GOTO(kpl__path_join(sh->index_path, PATH_MAX, dir, name));
        KPL_TRY_GOTO(open_excl(sh->data_path, &sh->fd, &sh->data_id));
        uint8_t h[KPLR_FILE_HEADER];
        file_header(h, KPLR_DATA_MAGIC, (uint32_t)s, w->uid, 0);
        KPL_TRY_GOTO(kpl__write_all(sh->fd, h, sizeof h, sh->data_path));
        sh->crc = kpl__crc32c(h, sizeof h);
        sh->bytes = sizeof h;
    }
    if (c.zstd_level > 0 && !(w->cctx = ZSTD_createCCtx())) {
        st = KPL_ERROR(KPL_ENOMEM, "record writer: no memory for a zstd context");
        goto fail;
    }
    if (w->cctx) ZSTD_CCtx_setParameter(w->cctx, ZSTD_c_compressionLevel, c.zstd_level);
    *out = w;
    return KPL_OK;
fail:
    kpl_record_writer_destroy(w);
    return st;
}

/* Writes the open chunk to its shard and records its index entries. */
static kpl_status flush_chunk(kpl_record_writer *w)
{
    if (w->cur_n == 0) return KPL_OK;
    shard_w *sh = &w->shards[w->chunks_closed % w->cfg.shards];
    const void *payload = w->raw;
    size_t stored = w->raw_len;
    uint32_t flags = 0;
    /* Try zstd, but back off on data that does not shrink (encoded JPEG):
     * after 8 misses in a row only every 16th chunk is tried. */
    bool try_z = w->cctx && (w->no_shrink < 8 || w->chunks_closed % 16 == 0);
    if (try_z) {
        size_t bound = ZSTD_compressBound(w->raw_len);
        if (bound > w->zcap) {
            void *z = realloc(w->zbuf, bound);
            KPL_CHECK(z, KPL_ENOMEM, "record writer: no memory for %zu bytes", bound);
            w->zbuf = z;
            w->zcap = bound;
        }
        size_t zn = ZSTD_compress2(w->cctx, w->zbuf, w->zcap, w->raw, w->raw_len);
        KPL_CHECK(!ZSTD_isError(zn), KPL_EBACKEND, "record writer: zstd: %s",
                  ZSTD_getErrorName(zn));
        if (zn * 100 <= w->raw_len * 97) {
            payload = w->zbuf;
            stored = zn;
            flags = KPLR_FLAG_ZSTD;
            w->no_shrink = 0;
        } else {
            w->no_shrink++;
        }
    }
    uint8_t h[KPLR_CHUNK_HEADER];
    memcpy(h, KPLR_CHUNK_MAGIC, 4);
    kpl__wr32(h + 4, (uint32_t)sh->nchunks);
    kpl__wr32(h + 8, flags);
    kpl__wr32(h + 12, (uint32_t)w->cur_n);
    kpl__wr32(h + 16, (uint32_t)w->raw_len);
    kpl__wr32(h + 20, (uint32_t)stored);
    kpl__wr32(h + 24, kpl__crc32c(payload, stored));
    kpl__wr32(h + 28, kpl__crc32c(h, 28));
    KPL_TRY(kpl__write_all(sh->fd, h, sizeof h, sh->data_path));
    KPL_TRY(kpl__write_all(sh->fd, payload, stored, sh->data_path));

    KPL_TRY(grow((void **)&sh->chunks, &sh->chunk_cap, sh->nchunks + 1, sizeof *sh->chunks));
    KPL_TRY(grow((void **)&sh->recs, &sh->rec_cap, 2 * (sh->nrecs + w->cur_n), sizeof *sh->recs));
    sh->chunks[sh->nchunks] = (chunk_ent){sh->bytes, (uint64_t)sh->nrecs, (uint32_t)stored,
                                          (uint32_t)w->raw_len, (uint32_t)w->cur_n, flags};
    for (int64_t i = 0; i < w->cur_n; i++) {
        sh->recs[2 * (sh->nrecs + i)] = (uint32_t)sh->nchunks;
        sh->recs[2 * (sh->nrecs + i) + 1] = w->cur_off[i];
    }
    sh->crc = kpl_crc32c(kpl_crc32c(sh->crc, h, sizeof h), payload, stored);
    sh->bytes += sizeof h + stored;
    sh->raw_total += w->raw_len;
    sh->nrecs += w->cur_n;
    sh->nchunks++;
    w->chunks_closed++;
    w->raw_len = 0;
    w->cur_n = 0;
    return KPL_OK;
}

kpl_status kpl_record_writer_add(kpl_record_writer *w, const kpl_feature_value *values)
{
    KPL_CHECK(w && values, KPL_EINVAL, "record writer: NULL argument");
    uint64_t body = 0;
    for (int i = 0; i < w->nf; i++) {
        KPL_CHECK(values[i].data || values[i].count == 0, KPL_EINVAL,
                  "record writer: example %lld, feature '%s': NULL data with count %u",
                  (long long)w->count, w->schema[i].name, values[i].count);
        body += 4 + (uint64_t)values[i].count * kpl__feature_elem_size(w->schema[i].type);
        int64_t fixed = kpl__feature_fixed_count(&w->schema[i]);
        KPL_CHECK(fixed < 0 || values[i].count == fixed, KPL_EINVAL,
                  "record writer: example %lld, feature '%s': %u values, its shape needs %lld",
                  (long long)w->count, w->schema[i].name, values[i].count, (long long)fixed);
    }
    KPL_CHECK(body <= KPLR_MAX_BODY, KPL_ERANGE,
              "record writer: example %lld is %llu bytes (the limit is %u)",
              (long long)w->count, (unsigned long long)body, KPLR_MAX_BODY);
    size_t need = KPLR_RECORD_HEADER + (size_t)body;
    if (w->cur_n > 0 && w->raw_len + need > w->cfg.chunk_bytes) KPL_TRY(flush_chunk(w));
    KPL_CHECK(w->raw_len + need <= UINT32_MAX, KPL_ERANGE,
              "record writer: chunk would exceed 4 GiB");
    if (w->raw_len + need > w->raw_cap) {
        size_t cap = w->raw_cap ? w->raw_cap : 1 << 16;
        while (cap < w->raw_len + need) cap *= 2;
        uint8_t *r = realloc(w->raw, cap);
        KPL_CHECK(r, KPL_ENOMEM, "record writer: no memory for a %zu-byte chunk", cap);
        w->raw = r;
        w->raw_cap = cap;
    }
    KPL_TRY(grow((void **)&w->cur_off, &w->cur_cap, w->cur_n + 1, sizeof *w->cur_off));
    uint8_t *rec = w->raw + w->raw_len, *p = rec + KPLR_RECORD_HEADER;
    for (int i = 0; i < w->nf; i++) {
        size_t n = (size_t)values[i].count * kpl__feature_elem_size(w->schema[i].type);
        kpl__wr32(p, values[i].count);
        if (n) memcpy(p + 4, values[i].data, n);
        p += 4 + n;
    }
    kpl__wr32(rec, (uint32_t)body);
    kpl__wr32(rec + 4, kpl__crc32c(rec + KPLR_RECORD_HEADER, (size_t)body));
    w->cur_off[w->cur_n++] = (uint32_t)w->raw_len;
    w->raw_len += need;
    w->count++;
    return KPL_OK;
}

int64_t kpl_record_writer_count(const kpl_record_writer *w) { return w ? w->count : 0; }

static kpl_status write_index(kpl_record_writer *w, int s, uint32_t *crc, uint64_t *bytes)
{
    shard_w *sh = &w->shards[s];
    size_t n = KPLR_FILE_HEADER + KPLR_CHUNK_ENTRY * (size_t)sh->nchunks +
               KPLR_RECORD_ENTRY * (size_t)sh->nrecs + 4;
    uint8_t *b = malloc(n);
    KPL_CHECK(b, KPL_ENOMEM, "record writer: no memory for a %zu-byte index", n);
    file_header(b, KPLR_INDEX_MAGIC, (uint32_t)s, w->uid, (uint32_t)sh->nchunks);
    uint8_t *p = b + KPLR_FILE_HEADER;
    for (int64_t c = 0; c < sh->nchunks; c++, p += KPLR_CHUNK_ENTRY) {
        const chunk_ent *e = &sh->chunks[c];
        kpl__wr64(p, e->offset);
        kpl__wr32(p + 8, e->stored);
        kpl__wr32(p + 12, e->raw);
        kpl__wr32(p + 16, e->nrec);
        kpl__wr32(p + 20, e->flags);
        kpl__wr64(p + 24, e->first);
    }
    for (int64_t r = 0; r < 2 * sh->nrecs; r++, p += 4) kpl__wr32(p, sh->recs[r]);
    kpl__wr32(p, kpl__crc32c(b, n - 4));
    *crc = kpl__crc32c(b, n);
    *bytes = n;
    int fd = -1;
    kpl_status st = open_excl(sh->index_path, &fd, &sh->index_id);
    if (st == KPL_OK) {
        sh->index_made = true;
        st = kpl__write_all(fd, b, n, sh->index_path);
        if (st == KPL_OK && fsync(fd) < 0)
            st = KPL_ERROR(KPL_EIO, "%s: fsync: %s", sh->index_path, strerror(errno));
        close(fd);
    }
    free(b);
    return st;
}

static kpl_status write_metadata(kpl_record_writer *w, const uint32_t *icrc,
                                 const uint64_t *ibytes)
{
    json_t *m = json_object();
    char uid[17];
    snprintf(uid, sizeof uid, "%016llx", (unsigned long long)w->uid);
    json_object_set_new(m, "format", json_string("kplrecord"));
    json_object_set_new(m, "version", json_integer(KPL_RECORD_VERSION));
    json_object_set_new(m, "dataset_uid", json_string(uid));
    char writer[64];
    snprintf(writer, sizeof writer, "kpl %s", kpl_version());
    json_object_set_new(m, "writer", json_string(writer));
    json_object_set_new(m, "created", json_string(w->created));
    json_object_set_new(m, "num_examples", json_integer(w->count));
    json_object_set_new(m, "chunk_bytes", json_integer((json_int_t)w->cfg.chunk_bytes));
    json_object_set_new(m, "zstd_level", json_integer(w->cfg.zstd_level));
    json_object_set_new(m, "features", kpl__schema_json(w->nf, w->schema));
    json_object_set_new(m, "attributes", json_loads(w->attrs, 0, NULL));
    json_t *shards = json_array();
    for (int s = 0; s < w->cfg.shards; s++) {
        shard_w *sh = &w->shards[s];
        json_t *o = json_object();
        json_object_set_new(o, "data", json_string(strrchr(sh->data_path, '/') + 1));
        json_object_set_new(o, "index", json_string(strrchr(sh->index_path, '/') + 1));
        json_object_set_new(o, "num_examples", json_integer(sh->nrecs));
        json_object_set_new(o, "num_chunks", json_integer(sh->nchunks));
        json_object_set_new(o, "data_bytes", json_integer((json_int_t)sh->bytes));
        json_object_set_new(o, "index_bytes", json_integer((json_int_t)ibytes[s]));
        json_object_set_new(o, "raw_bytes", json_integer((json_int_t)sh->raw_total));
        json_object_set_new(o, "data_crc32c", json_integer(sh->crc));
        json_object_set_new(o, "index_crc32c", json_integer(icrc[s]));
        json_array_append_new(shards, o);
    }
    json_object_set_new(m, "shards", shards);
    char *text = kpl__metadata_text(m); /* with its checksum */
    json_decref(m);
    KPL_CHECK(text, KPL_ENOMEM, "record writer: no memory for METADATA");
    int fd = -1;
    kpl_status st = open_excl(w->meta_tmp, &fd, &w->meta_tmp_id);
    if (st == KPL_OK) {
        w->tmp_made = true;
        st = kpl__write_all(fd, text, strlen(text), w->meta_tmp);
        if (st == KPL_OK) st = kpl__write_all(fd, "\n", 1, w->meta_tmp);
        if (st == KPL_OK && fsync(fd) < 0)
            st = KPL_ERROR(KPL_EIO, "%s: fsync: %s", w->meta_tmp, strerror(errno));
        close(fd);
    }
    free(text);
    KPL_TRY(st);
    char meta[PATH_MAX];
    KPL_TRY(kpl__path_join(meta, sizeof meta, w->dir, KPLR_METADATA));
    KPL_CHECK(rename(w->meta_tmp, meta) == 0, KPL_EIO, "rename %s -> %s: %s", w->meta_tmp, meta,
              strerror(errno));
    w->tmp_made = false;
    return KPL_OK;
}

static void free_writer(kpl_record_writer *w)
{
    for (int s = 0; w->shards && s < w->cfg.shards; s++) {
        if (w->shards[s].fd >= 0) close(w->shards[s].fd);
        free(w->shards[s].chunks);
        free(w->shards[s].recs);
    }
    free(w->shards);
    if (w->writing_fd >= 0) close(w->writing_fd); /* releases the lock */
    free(w->schema);
    free(w->attrs);
    free(w->raw);
    free(w->cur_off);
    free(w->zbuf);
    ZSTD_freeCCtx(w->cctx);
    free(w);
}

kpl_status kpl_record_writer_close(kpl_record_writer *w)
{
    KPL_CHECK(w, KPL_EINVAL, "record writer: NULL");
    kpl_status st = KPL_OK;
    uint32_t *icrc = calloc((size_t)w->cfg.shards, sizeof *icrc);
    uint64_t *ibytes = calloc((size_t)w->cfg.shards, sizeof *ibytes);
    if (!icrc || !ibytes) {
        st = KPL_ERROR(KPL_ENOMEM, "record writer: no memory");
        goto fail;
    }
    KPL_TRY_GOTO(flush_chunk(w));
    for (int s = 0; s < w->cfg.shards; s++) {
        shard_w *sh = &w->shards[s];
        if (fsync(sh->fd) < 0) {
            st = KPL_ERROR(KPL_EIO, "%s: fsync: %s", sh->data_path, strerror(errno));
            goto fail;
        }
        close(sh->fd);
        sh->fd = -1;
        KPL_TRY_GOTO(write_index(w, s, &icrc[s], &ibytes[s]));
    }
    KPL_TRY_GOTO(write_metadata(w, icrc, ibytes));
    /* Complete: the marker goes (its lock with it, in free_writer), then
     * the directory entry changes are made durable. */
    unlink_own(w->writing_path, &w->writing_id);
    int dfd = open(w->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    free(icrc);
    free(ibytes);
    free_writer(w);
    return KPL_OK;
fail:
    free(icrc);
    free(ibytes);
    kpl_record_writer_destroy(w);
    return st;
}

void kpl_record_writer_destroy(kpl_record_writer *w)
{
    if (!w) return;
    for (int s = 0; w->shards && s < w->cfg.shards; s++) {
        shard_w *sh = &w->shards[s];
        if (sh->fd >= 0) {
            close(sh->fd);
            sh->fd = -1;
        }
        if (sh->data_path[0]) unlink_own(sh->data_path, &sh->data_id);
        if (sh->index_made) unlink_own(sh->index_path, &sh->index_id);
    }
    if (w->tmp_made) unlink_own(w->meta_tmp, &w->meta_tmp_id);
    /* the marker last, still locked: nobody clears the directory under us */
    if (w->writing_made) unlink_own(w->writing_path, &w->writing_id);
    if (w->made_dir) rmdir(w->dir);
    free_writer(w);
}

/* ---- unfinished datasets ---------------------------------------------------------- */

/* Whether the process named by a marker "pid P host H ..." could still be
 * its writer: markers written before the lock existed say nothing else. */
static bool legacy_writer_alive(const char *who)
{
    int pid = 0;
    char host[128] = "", me[128] = "";
    if (sscanf(who, "pid %d host %127s", &pid, host) != 2 || pid <= 0) return false;
    gethostname(me, sizeof me - 1);
    if (strcmp(host, me)) return true; /* another host: cannot tell, assume alive */
    return kill(pid, 0) == 0 || errno == EPERM;
}

/* Opens dir/WRITING and tries its lock (exclusive or shared, never
 * waiting).  *fd stays open (locked) when *state is DEAD; else -1. */
static kpl_status probe_marker(const char *dir, bool exclusive, kpl_writer_state *state,
                               char *who, size_t len, int *fd)
{
    char p[PATH_MAX];
    *fd = -1;
    *state = KPL_WRITER_NONE;
    if (who && len) who[0] = 0;
    KPL_TRY(kpl__path_join(p, sizeof p, dir, KPLR_WRITING));
    int f = open(p, (exclusive ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (f < 0 && errno == ENOENT) return KPL_OK;
    KPL_CHECK(f >= 0, KPL_EIO, "%s: %s", p, strerror(errno));
    char text[300];
    ssize_t n = pread(f, text, sizeof text - 1, 0);
    text[n > 0 ? n : 0] = 0;
    text[strcspn(text, "\n")] = 0;
    if (who && len) snprintf(who, len, "%s", text[0] ? text : "unknown writer");
    bool locked = flock(f, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0;
    if (locked && errno != EWOULDBLOCK) {
        int e = errno;
        close(f);
        return KPL_ERROR(KPL_EIO, "%s: cannot lock: %s", p, strerror(e));
    }
    /* A marker with the lock word is alive exactly while locked; one
     * written by an older kpl, by its pid. */
    bool alive = locked || (!strstr(text, " lock flock") && legacy_writer_alive(text));
    *state = alive ? KPL_WRITER_ALIVE : KPL_WRITER_DEAD;
    if (alive) close(f);
    else *fd = f;
    return KPL_OK;
}

kpl_status kpl_dataset_writer_state(const char *dir, kpl_writer_state *state, char *who,
                                    size_t len)
{
    KPL_CHECK(dir && state, KPL_EINVAL, "dataset_writer_state: NULL");
    int fd = -1;
    KPL_TRY(probe_marker(dir, false, state, who, len, &fd));
    if (fd >= 0) close(fd);
    return KPL_OK;
}

/* Names a KPLRecord writer (or an image-folder conversion) may leave. */
static bool writer_file(const char *n)
{
    const char *dot = strrchr(n, '.');
    return !strcmp(n, KPLR_WRITING) || !strcmp(n, KPLR_METADATA) || !strcmp(n, "classes.txt") ||
           !strncmp(n, KPLR_WRITING ".", sizeof KPLR_WRITING) ||
           !strncmp(n, KPLR_METADATA ".", sizeof KPLR_METADATA) ||
           !strncmp(n, "classes.txt.", 12) ||
           (dot && (!strcmp(dot, ".data") || !strcmp(dot, ".index")));
}

kpl_status kpl_dataset_remove_unfinished(const char *dir)
{
    KPL_CHECK(dir, KPL_EINVAL, "dataset_remove_unfinished: NULL");
    kpl_writer_state state;
    char who[300];
    int fd = -1;
    KPL_TRY(probe_marker(dir, true, &state, who, sizeof who, &fd));
    KPL_CHECK(state != KPL_WRITER_NONE, KPL_ENOTFOUND,
              "%s: no %s marker: not an unfinished dataset", dir, KPLR_WRITING);
    KPL_CHECK(state == KPL_WRITER_DEAD, KPL_ESTATE,
              "%s is being written right now (%s): not removed", dir, who);
    /* With the marker's lock held no writer can be inside; every name is
     * checked first, so that a folder with files of other kinds is left
     * whole. */
    DIR *d = opendir(dir);
    kpl_status st = d ? KPL_OK : KPL_ERROR(KPL_EIO, "%s: %s", dir, strerror(errno));
    struct dirent *e;
    while (st >= 0 && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && !writer_file(e->d_name))
            st = KPL_ERROR(KPL_ESTATE, "%s holds '%s', which no dataset writer makes: not "
                           "removed", dir, e->d_name);
    if (st >= 0) rewinddir(d);
    while (st >= 0 && (e = readdir(d))) {
        char f[PATH_MAX];
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") ||
            !strcmp(e->d_name, KPLR_WRITING))
            continue;
        if (kpl__path_join(f, sizeof f, dir, e->d_name) < 0 || (unlink(f) != 0 && errno != ENOENT))
            st = KPL_ERROR(KPL_EIO, "cannot remove %s/%s: %s", dir, e->d_name, strerror(errno));
    }
    if (d) closedir(d);
    char m[PATH_MAX];
    if (st >= 0 && kpl__path_join(m, sizeof m, dir, KPLR_WRITING) >= 0 && unlink(m) != 0)
        st = KPL_ERROR(KPL_EIO, "cannot remove %s: %s", m, strerror(errno));
    close(fd);
    if (st >= 0 && rmdir(dir) != 0)
        st = KPL_ERROR(KPL_EIO, "cannot remove %s: %s", dir, strerror(errno));
    return st;
}

/* ---- taking turns ----------------------------------------------------------------- */

kpl_status kpl_convert_lock(const char *parent, bool (*keep_waiting)(const char *lock,
                                                                    double waited, void *ctx),
                            void *ctx, int *fd)
{
    KPL_CHECK(parent && fd, KPL_EINVAL, "convert_lock: NULL");
    *fd = -1;
    bool made = false;
    KPL_TRY(mkdir_p(*parent ? parent : ".", &made));
    char lock[PATH_MAX];
    KPL_TRY(kpl__path_join(lock, sizeof lock, *parent ? parent : ".", ".kpl-convert.lock"));
    int f = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    KPL_CHECK(f >= 0, KPL_EIO, "cannot create the lock %s: %s", lock, strerror(errno));
    double t0 = kpl_seconds();
    while (flock(f, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        if (e != EWOULDBLOCK && e != EINTR) {
            close(f);
            return KPL_ERROR(KPL_EIO, "cannot lock %s: %s", lock, strerror(e));
        }
        if (keep_waiting && !keep_waiting(lock, kpl_seconds() - t0, ctx)) {
            close(f);
            return KPL_ERROR(KPL_ECANCELED, "gave up waiting for %s (another conversion into %s "
                             "holds it)", lock, *parent ? parent : ".");
        }
        usleep(100 * 1000);
    }
    *fd = f;
    return KPL_OK;
}

void kpl_convert_unlock(int fd)
{
    if (fd >= 0) close(fd); /* the lock goes with the descriptor */
}
