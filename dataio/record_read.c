/*
 * record_read.c — the KPLRecord reader and verifier (docs/kplrecord.md).
 *
 * Opening reads METADATA and every index in full and checks them against
 * each other and against the shard files' headers and sizes, so that a
 * truncated, extended, mixed-up or unfinished dataset is refused before any
 * example is handed out.  Chunk reads then check their own bytes: header,
 * payload CRC, decompressed size, every record's length chain and CRC.
 */
#include "dataio_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

typedef struct {
    int fd;
    char data_path[PATH_MAX], index_path[PATH_MAX];
    int64_t nchunks, nrecs;
    uint8_t *index; /* the whole index file */
    const uint8_t *chunk_ents, *rec_ents;
    uint64_t data_bytes, index_bytes, raw_bytes;
    uint32_t data_crc, index_crc;
    int64_t first_example, first_chunk; /* global numbers */
} shard_r;

struct kpl_dataset {
    char dir[PATH_MAX];
    int version; /* METADATA's: 1, or 2 with its checksum */
    int nf;
    kpl_feature_spec *schema;
    /* What the fixed shapes say of every record body: at least min_body
     * bytes, exactly that many when every feature is fixed; fixed_desc
     * lists them for messages ("'image' [28, 28, 1] = 784 bytes"). */
    uint64_t min_body;
    bool all_fixed;
    char fixed_desc[256];
    char *attrs, *created, *writer;
    uint64_t uid;
    int64_t chunk_bytes, zstd_level;
    int nshards;
    shard_r *shards;
    int64_t nexamples, nchunks;
};

struct kpl_chunk {
    uint8_t *buf; /* chunk header + stored payload, as in the file */
    size_t buf_cap;
    uint8_t *raw; /* decompressed payload (when compressed) */
    size_t raw_cap;
    const uint8_t *data; /* the raw payload: raw, or buf + header */
    size_t data_len, file_len;
    uint32_t *offs;
    int n, offs_cap;
    ZSTD_DCtx *dctx;
    const kpl_dataset *ds;
    int64_t chunk, first_example;
};

/* ---- METADATA --------------------------------------------------------------------- */

#define META_FAIL(...) KPL_ERROR(KPL_EFORMAT, __VA_ARGS__)

static kpl_status meta_int(const char *path, json_t *o, const char *where, const char *key,
                           int64_t lo, int64_t *v)
{
    json_t *x = json_object_get(o, key);
    if (!json_is_integer(x))
        return META_FAIL("%s: %s%s%s: missing or not an integer", path, where,
                         where[0] ? "." : "", key);
    *v = json_integer_value(x);
    if (*v < lo)
        return META_FAIL("%s: %s%s%s = %lld is below %lld", path, where, where[0] ? "." : "",
                         key, (long long)*v, (long long)lo);
    return KPL_OK;
}

static kpl_status meta_str(const char *path, json_t *o, const char *where, const char *key,
                           const char **v)
{
    json_t *x = json_object_get(o, key);
    if (!json_is_string(x))
        return META_FAIL("%s: %s%s%s: missing or not a string", path, where,
                         where[0] ? "." : "", key);
    *v = json_string_value(x);
    return KPL_OK;
}

static kpl_status parse_features(kpl_dataset *ds, const char *path, json_t *fa)
{
    if (!json_is_array(fa) || json_array_size(fa) == 0 || json_array_size(fa) > 1024)
        return META_FAIL("%s: features: want an array of 1 to 1024 features", path);
    ds->nf = (int)json_array_size(fa);
    ds->schema = calloc((size_t)ds->nf, sizeof *ds->schema);
    KPL_CHECK(ds->schema, KPL_ENOMEM, "%s: no memory", path);
    for (int i = 0; i < ds->nf; i++) {
        json_t *o = json_array_get(fa, (size_t)i);
        kpl_feature_spec *f = &ds->schema[i];
        char where[32];
        snprintf(where, sizeof where, "features[%d]", i);
        const char *name = NULL, *type = NULL;
        KPL_TRY(meta_str(path, o, where, "name", &name));
        KPL_TRY(meta_str(path, o, where, "type", &type));
        if (strlen(name) == 0 || strlen(name) >= KPL_FEATURE_NAME_MAX)
            return META_FAIL("%s: %s.name '%s' is empty or too long", path, where, name);
        strcpy(f->name, name);
        int t = -1;
        for (int k = 0; k <= KPL_FEATURE_STRING; k++)
            if (!strcmp(type, kpl_feature_type_name((kpl_feature_type)k))) t = k;
        if (t < 0)
            return META_FAIL("%s: %s.type '%s' is not bytes, int64, float or string", path,
                             where, type);
        f->type = (kpl_feature_type)t;
        json_t *enc = json_object_get(o, "encoding");
        if (enc) {
            if (!json_is_string(enc) || strlen(json_string_value(enc)) >= sizeof f->encoding)
                return META_FAIL("%s: %s.encoding: not a short string", path, where);
            strcpy(f->encoding, json_string_value(enc));
        }
        json_t *shape = json_object_get(o, "shape");
        if (shape) {
            if (!json_is_array(shape) || json_array_size(shape) > 8)
                return META_FAIL("%s: %s.shape: want an array of at most 8 extents", path, where);
            f->ndim = (int)json_array_size(shape);
            for (int d = 0; d < f->ndim; d++) {
                json_t *e = json_array_get(shape, (size_t)d);
                if (!json_is_integer(e) || json_integer_value(e) <= 0)
                    return META_FAIL("%s: %s.shape[%d]: not a positive integer", path, where, d);
                f->shape[d] = json_integer_value(e);
            }
        }
        /* A fixed shape fixes every record's value (docs/kplrecord.md). */
        int64_t fixed = kpl__feature_fixed_count(f);
        size_t es = kpl__feature_elem_size(f->type);
        char sh[128];
        kpl__shape_str(f, sh, sizeof sh);
        if (fixed >= 0 && (uint64_t)fixed * es + 4 > KPLR_MAX_BODY)
            return META_FAIL("%s: feature '%s' has shape %s: more than a record can hold", path,
                             f->name, sh);
        if (fixed >= 0) {
            ds->min_body += 4 + (uint64_t)fixed * es;
            size_t k = strlen(ds->fixed_desc);
            snprintf(ds->fixed_desc + k, sizeof ds->fixed_desc - k, "%s'%s' %s = %lld %s",
                     k ? ", " : "", f->name, sh, (long long)fixed,
                     f->type == KPL_FEATURE_BYTES ? "bytes" : "values");
        } else {
            ds->min_body += 4;
            ds->all_fixed = false;
        }
    }
    return KPL_OK;
}

/* ---- shard files ------------------------------------------------------------------- */

static kpl_status check_file_header(const uint8_t *h, const char *path, const char *magic,
                                    int shard, uint64_t uid, int version)
{
    if (memcmp(h, magic, 8))
        return META_FAIL("%s: not a KPLRecord %s file (bad magic)", path,
                         magic[4] == 'D' ? "data" : "index");
    if (kpl__rd32(h + 28) != kpl__crc32c(h, 28))
        return META_FAIL("%s: file header CRC32C mismatch", path);
    if (kpl__rd32(h + 8) != (uint32_t)version)
        return META_FAIL("%s: format version %u, METADATA says version %d", path,
                         kpl__rd32(h + 8), version);
    if (kpl__rd32(h + 12) != (uint32_t)shard)
        return META_FAIL("%s: header says shard %u, METADATA lists it as shard %d", path,
                         kpl__rd32(h + 12), shard);
    if (kpl__rd64(h + 16) != uid)
        return META_FAIL("%s: dataset uid %016" PRIx64 " differs from METADATA's %016" PRIx64
                         " (a file from another dataset?)", path, kpl__rd64(h + 16), uid);
    return KPL_OK;
}

/* Loads and checks one shard's index against its data file. */
static kpl_status open_shard(kpl_dataset *ds, int s, json_t *o)
{
    shard_r *sh = &ds->shards[s];
    char where[32];
    snprintf(where, sizeof where, "shards[%d]", s);
    char meta[PATH_MAX];
    KPL_TRY(kpl__path_join(meta, sizeof meta, ds->dir, KPLR_METADATA));
    const char *dname = NULL, *iname = NULL;
    int64_t nex, nch, dbytes, ibytes, rbytes = 0, dcrc, icrc;
    KPL_TRY(meta_str(meta, o, where, "data", &dname));
    KPL_TRY(meta_str(meta, o, where, "index", &iname));
    if (strchr(dname, '/') || strchr(iname, '/'))
        return META_FAIL("%s: %s: shard file names may not contain '/'", meta, where);
    KPL_TRY(meta_int(meta, o, where, "num_examples", 0, &nex));
    KPL_TRY(meta_int(meta, o, where, "num_chunks", 0, &nch));
    KPL_TRY(meta_int(meta, o, where, "data_bytes", KPLR_FILE_HEADER, &dbytes));
    KPL_TRY(meta_int(meta, o, where, "index_bytes", KPLR_FILE_HEADER + 4, &ibytes));
    KPL_TRY(meta_int(meta, o, where, "data_crc32c", 0, &dcrc));
    KPL_TRY(meta_int(meta, o, where, "index_crc32c", 0, &icrc));
    if (json_object_get(o, "raw_bytes")) KPL_TRY(meta_int(meta, o, where, "raw_bytes", 0, &rbytes));
    KPL_TRY(kpl__path_join(sh->data_path, PATH_MAX, ds->dir, dname));
    KPL_TRY(kpl__path_join(sh->index_path, PATH_MAX, ds->dir, iname));
    sh->data_bytes = (uint64_t)dbytes;
    sh->index_bytes = (uint64_t)ibytes;
    sh->raw_bytes = (uint64_t)rbytes;
    sh->data_crc = (uint32_t)dcrc;
    sh->index_crc = (uint32_t)icrc;
    sh->nchunks = nch;
    sh->nrecs = nex;

    /* The index, whole. */
    size_t ilen = 0;
    KPL_TRY(kpl__read_file(sh->index_path, (char **)&sh->index, &ilen));
    const char *ip = sh->index_path;
    if (ilen != (uint64_t)ibytes)
        return META_FAIL("%s: %zu bytes, METADATA says %lld (truncated or replaced)", ip, ilen,
                         (long long)ibytes);
    KPL_TRY(check_file_header(sh->index, ip, KPLR_INDEX_MAGIC, s, ds->uid, ds->version));
    if (kpl__rd32(sh->index + 24) != (uint64_t)nch)
        return META_FAIL("%s: %u chunks, METADATA says %lld", ip, kpl__rd32(sh->index + 24),
                         (long long)nch);
    uint64_t want = KPLR_FILE_HEADER + KPLR_CHUNK_ENTRY * (uint64_t)nch +
                    KPLR_RECORD_ENTRY * (uint64_t)nex + 4;
    if (want != ilen)
        return META_FAIL("%s: size %zu does not fit %lld chunks and %lld records (want %llu)",
                         ip, ilen, (long long)nch, (long long)nex, (unsigned long long)want);
    if (kpl__rd32(sh->index + ilen - 4) != kpl__crc32c(sh->index, ilen - 4))
        return META_FAIL("%s: index CRC32C mismatch (corrupt index)", ip);
    if (kpl__crc32c(sh->index, ilen) != sh->index_crc)
        return META_FAIL("%s: CRC32C differs from METADATA's index_crc32c", ip);
    sh->chunk_ents = sh->index + KPLR_FILE_HEADER;
    sh->rec_ents = sh->chunk_ents + KPLR_CHUNK_ENTRY * nch;

    /* Chunks contiguous from the header to the end of the data file, record
     * numbering consistent, every record entry inside its chunk. */
    uint64_t off = KPLR_FILE_HEADER, first = 0;
    for (int64_t c = 0; c < nch; c++) {
        const uint8_t *e = sh->chunk_ents + KPLR_CHUNK_ENTRY * c;
        uint32_t stored = kpl__rd32(e + 8), raw = kpl__rd32(e + 12), nrec = kpl__rd32(e + 16),
                 flags = kpl__rd32(e + 20);
        if (kpl__rd64(e) != off || kpl__rd64(e + 24) != first || nrec == 0 ||
            (flags & ~KPLR_FLAG_ZSTD) || (!flags && stored != raw))
            return META_FAIL("%s: chunk entry %lld is inconsistent (offset %llu, first record "
                             "%llu, %u records, flags %u)", ip, (long long)c,
                             (unsigned long long)kpl__rd64(e),
                             (unsigned long long)kpl__rd64(e + 24), nrec, flags);
        if (first + nrec > (uint64_t)nex) /* the record table's entries must all exist */
            return META_FAIL("%s: chunk entry %lld claims records %llu to %llu, the record "
                             "table has %lld", ip, (long long)c, (unsigned long long)first,
                             (unsigned long long)(first + nrec - 1), (long long)nex);
        for (uint32_t r = 0; r < nrec; r++) {
            const uint8_t *re = sh->rec_ents + KPLR_RECORD_ENTRY * (first + r);
            if (first + r >= (uint64_t)nex || kpl__rd32(re) != (uint32_t)c ||
                kpl__rd32(re + 4) + (uint64_t)KPLR_RECORD_HEADER > raw)
                return META_FAIL("%s: record entry %llu does not point into chunk %lld", ip,
                                 (unsigned long long)(first + r), (long long)c);
            /* Records follow each other, so the index gives each body's
             * size: the schema's fixed shapes must fit it (a METADATA whose
             * shape was edited is caught here when the size differs). */
            uint64_t at = kpl__rd32(re + 4),
                     next = r + 1 < nrec ? kpl__rd32(re + KPLR_RECORD_ENTRY + 4) : raw;
            if (next < at + KPLR_RECORD_HEADER)
                return META_FAIL("%s: record entry %llu is out of order in chunk %lld", ip,
                                 (unsigned long long)(first + r), (long long)c);
            uint64_t body = next - at - KPLR_RECORD_HEADER;
            if (body < ds->min_body || (ds->all_fixed && body != ds->min_body))
                return META_FAIL("%s chunk %lld record %u (example %lld): a %llu-byte body, "
                                 "but METADATA's shapes (%s) make every body %s%llu bytes: "
                                 "METADATA does not describe these records",
                                 sh->data_path, (long long)c, r,
                                 (long long)(ds->nexamples + (int64_t)first + r),
                                 (unsigned long long)body, ds->fixed_desc,
                                 ds->all_fixed ? "" : "at least ",
                                 (unsigned long long)ds->min_body);
        }
        off += KPLR_CHUNK_HEADER + (uint64_t)stored;
        first += nrec;
    }
    if (first != (uint64_t)nex)
        return META_FAIL("%s: chunks hold %llu records, METADATA says %lld", ip,
                         (unsigned long long)first, (long long)nex);
    if (off != (uint64_t)dbytes)
        return META_FAIL("%s: chunks end at byte %llu, METADATA says the data file has %lld",
                         ip, (unsigned long long)off, (long long)dbytes);

    /* The data file: its size and header. */
    sh->fd = open(sh->data_path, O_RDONLY | O_CLOEXEC);
    if (sh->fd < 0)
        return KPL_ERROR(errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "%s: %s", sh->data_path,
                         strerror(errno));
    struct stat sb;
    KPL_CHECK(fstat(sh->fd, &sb) == 0, KPL_EIO, "%s: %s", sh->data_path, strerror(errno));
    if ((uint64_t)sb.st_size != (uint64_t)dbytes)
        return META_FAIL("%s: %lld bytes, METADATA says %lld (truncated or extended)",
                         sh->data_path, (long long)sb.st_size, (long long)dbytes);
    uint8_t h[KPLR_FILE_HEADER];
    KPL_TRY(kpl__pread_all(sh->fd, h, sizeof h, 0, sh->data_path));
    KPL_TRY(check_file_header(h, sh->data_path, KPLR_DATA_MAGIC, s, ds->uid, ds->version));
    posix_fadvise(sh->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    return KPL_OK;
}

/* A WRITING marker: the dataset is not finished.  Its lock says whether
 * the writer still works on it (wait) or died (convert again: `kpl data
 * convert`, like kpl train, removes what a dead writer left first). */
static kpl_status refuse_unfinished(const char *dir)
{
    char p[PATH_MAX];
    KPL_TRY(kpl__path_join(p, sizeof p, dir, KPLR_WRITING));
    if (access(p, F_OK) != 0) return KPL_OK;
    kpl_writer_state ws;
    char who[300];
    if (kpl_dataset_writer_state(dir, &ws, who, sizeof who) < 0)
        return KPL_ERROR(KPL_EFORMAT, "%s was not closed cleanly (%s is present)", dir, p);
    if (ws == KPL_WRITER_ALIVE)
        return KPL_ERROR(KPL_EFORMAT, "%s is still being written (%s; %s is present): wait for "
                         "its writer to finish", dir, who, p);
    if (ws == KPL_WRITER_DEAD)
        return KPL_ERROR(KPL_EFORMAT, "%s was not closed cleanly: its writer (%s) did not finish "
                         "(%s is present); convert it again (kpl data convert removes what a "
                         "writer that died left)", dir, who, p);
    return KPL_OK; /* its writer finished just now */
}

kpl_status kpl_dataset_open(const char *dir, kpl_dataset **out)
{
    *out = NULL;
    KPL_CHECK(dir && strlen(dir) + 16 < PATH_MAX, KPL_EINVAL, "dataset: bad path");
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return KPL_ERROR(KPL_ENOTFOUND, "dataset %s: no such directory", dir);
    KPL_TRY(refuse_unfinished(dir));
    char meta[PATH_MAX];
    KPL_TRY(kpl__path_join(meta, sizeof meta, dir, KPLR_METADATA));
    if (access(meta, F_OK) != 0)
        return KPL_ERROR(KPL_ENOTFOUND, "%s: no METADATA file: not a KPLRecord dataset, or its "
                         "writer never finished", dir);
    char *text = NULL;
    size_t tlen = 0;
    KPL_TRY(kpl__read_file(meta, &text, &tlen));
    json_error_t je;
    json_t *m = json_loadb(text, tlen, JSON_REJECT_DUPLICATES, &je);
    if (!m) {
        free(text);
        return META_FAIL("%s:%d:%d: not valid JSON: %s", meta, je.line, je.column, je.text);
    }
    kpl_status st = KPL_OK;
    kpl_dataset *ds = calloc(1, sizeof *ds);
    if (!ds) {
        free(text);
        json_decref(m);
        return KPL_ERROR(KPL_ENOMEM, "dataset: no memory");
    }
    ds->all_fixed = true;
    strcpy(ds->dir, dir);
    const char *fmt = NULL, *uid = NULL;
    int64_t version, nex;
    if (!json_is_object(m)) {
        st = META_FAIL("%s: not a JSON object", meta);
        goto fail;
    }
    KPL_TRY_GOTO(meta_str(meta, m, "", "format", &fmt));
    if (strcmp(fmt, "kplrecord")) {
        st = META_FAIL("%s: format is '%s', not 'kplrecord'", meta, fmt);
        goto fail;
    }
    KPL_TRY_GOTO(meta_int(meta, m, "", "version", 0, &version));
    if (version < 1 || version > KPL_RECORD_VERSION) {
        st = META_FAIL("%s: format version %lld; this kpl reads versions 1 to %d", meta,
                       (long long)version, KPL_RECORD_VERSION);
        goto fail;
    }
    ds->version = (int)version;
    if (version >= 2) {
        /* Every byte before the checksum's key is covered: an edited
         * METADATA (a shape, a count) is refused, not trusted. */
        int64_t at = kpl__metadata_crc_end(text, tlen);
        int64_t want = -1;
        KPL_TRY_GOTO(meta_int(meta, m, "", KPLR_METADATA_CRC_KEY, 0, &want));
        uint32_t got = at < 0 ? 0 : kpl__crc32c(text, (size_t)at);
        if (at < 0 || want != (int64_t)got) {
            st = META_FAIL("%s: METADATA checksum mismatch (%s %lld, computed %u): the file was "
                           "changed after the dataset was written, and an edited shape or count "
                           "would make readers misread the records; convert the dataset again",
                           meta, KPLR_METADATA_CRC_KEY, (long long)want, got);
            goto fail;
        }
    }
    KPL_TRY_GOTO(meta_str(meta, m, "", "dataset_uid", &uid));
    char *end;
    ds->uid = strtoull(uid, &end, 16);
    if (strlen(uid) != 16 || *end) {
        st = META_FAIL("%s: dataset_uid '%s' is not 16 hex digits", meta, uid);
        goto fail;
    }
    KPL_TRY_GOTO(meta_int(meta, m, "", "num_examples", 0, &nex));
    ds->chunk_bytes = json_integer_value(json_object_get(m, "chunk_bytes"));
    ds->zstd_level = json_integer_value(json_object_get(m, "zstd_level"));
    const char *s = NULL;
    ds->created = strdup(meta_str(meta, m, "", "created", &s) == KPL_OK ? s : "");
    ds->writer = strdup(meta_str(meta, m, "", "writer", &s) == KPL_OK ? s : "");
    kpl_clear_error();
    json_t *attrs = json_object_get(m, "attributes");
    if (attrs && !json_is_object(attrs)) {
        st = META_FAIL("%s: attributes: not a JSON object", meta);
        goto fail;
    }
    ds->attrs = attrs ? json_dumps(attrs, JSON_COMPACT | JSON_PRESERVE_ORDER) : strdup("{}");
    if (!ds->attrs || !ds->created || !ds->writer) {
        st = KPL_ERROR(KPL_ENOMEM, "dataset: no memory");
        goto fail;
    }
    KPL_TRY_GOTO(parse_features(ds, meta, json_object_get(m, "features")));
    json_t *sa = json_object_get(m, "shards");
    if (!json_is_array(sa) || json_array_size(sa) == 0 || json_array_size(sa) > 99999) {
        st = META_FAIL("%s: shards: want an array of 1 to 99999 shards", meta);
        goto fail;
    }
    ds->nshards = (int)json_array_size(sa);
    ds->shards = calloc((size_t)ds->nshards, sizeof *ds->shards);
    if (!ds->shards) {
        st = KPL_ERROR(KPL_ENOMEM, "dataset: no memory");
        goto fail;
    }
    for (int i = 0; i < ds->nshards; i++) ds->shards[i].fd = -1;
    for (int i = 0; i < ds->nshards; i++) {
        shard_r *sh = &ds->shards[i];
        sh->first_example = ds->nexamples;
        sh->first_chunk = ds->nchunks;
        KPL_TRY_GOTO(open_shard(ds, i, json_array_get(sa, (size_t)i)));
        ds->nexamples += sh->nrecs;
        ds->nchunks += sh->nchunks;
    }
    if (ds->nexamples != nex) {
        st = META_FAIL("%s: num_examples is %lld but the shards hold %lld", meta, (long long)nex,
                       (long long)ds->nexamples);
        goto fail;
    }
    json_decref(m);
    free(text);
    *out = ds;
    return KPL_OK;
fail:
    json_decref(m);
    free(text);
    kpl_dataset_close(ds);
    return st;
}

void kpl_dataset_close(kpl_dataset *ds)
{
    if (!ds) return;
    for (int i = 0; ds->shards && i < ds->nshards; i++) {
        if (ds->shards[i].fd >= 0) close(ds->shards[i].fd);
        free(ds->shards[i].index);
    }
    free(ds->shards);
    free(ds->schema);
    free(ds->attrs);
    free(ds->created);
    free(ds->writer);
    free(ds);
}

int64_t kpl_dataset_num_examples(const kpl_dataset *ds) { return ds->nexamples; }
int kpl_dataset_num_features(const kpl_dataset *ds) { return ds->nf; }
const kpl_feature_spec *kpl_dataset_feature(const kpl_dataset *ds, int i)
{
    return i >= 0 && i < ds->nf ? &ds->schema[i] : NULL;
}
int kpl_dataset_find_feature(const kpl_dataset *ds, const char *name)
{
    for (int i = 0; i < ds->nf; i++)
        if (!strcmp(ds->schema[i].name, name)) return i;
    return -1;
}
const char *kpl_dataset_attributes(const kpl_dataset *ds) { return ds->attrs; }
const char *kpl_dataset_path(const kpl_dataset *ds) { return ds->dir; }
int64_t kpl_dataset_num_chunks(const kpl_dataset *ds) { return ds->nchunks; }

/* The shard holding global chunk `chunk` (or example, with by_example). */
static int find_shard(const kpl_dataset *ds, int64_t v, bool by_example)
{
    int lo = 0, hi = ds->nshards - 1;
    while (lo < hi) { /* last shard whose first number is <= v, skipping empty ones */
        int mid = (lo + hi + 1) / 2;
        int64_t f = by_example ? ds->shards[mid].first_example : ds->shards[mid].first_chunk;
        if (f <= v) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

kpl_chunk_info kpl_dataset_chunk_info(const kpl_dataset *ds, int64_t chunk)
{
    kpl_chunk_info ci;
    memset(&ci, 0, sizeof ci);
    if (chunk < 0 || chunk >= ds->nchunks) return ci;
    int s = find_shard(ds, chunk, false);
    const shard_r *sh = &ds->shards[s];
    int64_t c = chunk - sh->first_chunk;
    const uint8_t *e = sh->chunk_ents + KPLR_CHUNK_ENTRY * c;
    ci.shard = s;
    ci.chunk_in_shard = c;
    ci.first_example = sh->first_example + (int64_t)kpl__rd64(e + 24);
    ci.num_records = kpl__rd32(e + 16);
    ci.stored_bytes = kpl__rd32(e + 8);
    ci.raw_bytes = kpl__rd32(e + 12);
    ci.compressed = kpl__rd32(e + 20) & KPLR_FLAG_ZSTD;
    return ci;
}

kpl_status kpl_dataset_locate(const kpl_dataset *ds, int64_t example, int64_t *chunk, int *record)
{
    KPL_CHECK(example >= 0 && example < ds->nexamples, KPL_ERANGE,
              "dataset %s: example %lld out of range [0, %lld)", ds->dir, (long long)example,
              (long long)ds->nexamples);
    int s = find_shard(ds, example, true);
    const shard_r *sh = &ds->shards[s];
    int64_t local = example - sh->first_example;
    uint32_t c = kpl__rd32(sh->rec_ents + KPLR_RECORD_ENTRY * local);
    *chunk = sh->first_chunk + c;
    *record = (int)(local - (int64_t)kpl__rd64(sh->chunk_ents + KPLR_CHUNK_ENTRY * c + 24));
    return KPL_OK;
}

/* ---- chunks ----------------------------------------------------------------------- */

kpl_chunk *kpl_chunk_create(void)
{
    kpl_chunk *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->chunk = -1;
    if (!(c->dctx = ZSTD_createDCtx())) {
        free(c);
        return NULL;
    }
    return c;
}

void kpl_chunk_destroy(kpl_chunk *c)
{
    if (!c) return;
    free(c->buf);
    free(c->raw);
    free(c->offs);
    ZSTD_freeDCtx(c->dctx);
    free(c);
}

static kpl_status reserve(uint8_t **p, size_t *cap, size_t n)
{
    if (n <= *cap) return KPL_OK;
    uint8_t *q = realloc(*p, n);
    KPL_CHECK(q, KPL_ENOMEM, "chunk: no memory for %zu bytes", n);
    *p = q;
    *cap = n;
    return KPL_OK;
}

/* Walks record i's features: sets values (may be NULL) and checks that the
 * counts fill the body exactly. */
kpl_status kpl__record_parse(int nf, const kpl_feature_spec *schema, const uint8_t *body,
                             uint32_t len, kpl_feature_value *values, const char *where)
{
    uint64_t off = 0;
    for (int f = 0; f < nf; f++) {
        if (off + 4 > len)
            return KPL_ERROR(KPL_EFORMAT, "%s: body ends inside feature '%s'", where,
                             schema[f].name);
        uint32_t n = kpl__rd32(body + off);
        uint64_t sz = (uint64_t)n * kpl__feature_elem_size(schema[f].type);
        if (off + 4 + sz > len)
            return KPL_ERROR(KPL_EFORMAT, "%s: feature '%s' claims %u values, past the body's "
                             "end", where, schema[f].name, n);
        int64_t fixed = kpl__feature_fixed_count(&schema[f]);
        if (fixed >= 0 && (int64_t)n != fixed) {
            char sh[128];
            kpl__shape_str(&schema[f], sh, sizeof sh);
            return KPL_ERROR(KPL_EFORMAT, "%s: feature '%s' has %u %s, but its shape %s needs "
                             "%lld", where, schema[f].name, n,
                             schema[f].type == KPL_FEATURE_BYTES ? "bytes" : "values", sh,
                             (long long)fixed);
        }
        if (values) values[f] = (kpl_feature_value){body + off + 4, n};
        off += 4 + sz;
    }
    if (off != len)
        return KPL_ERROR(KPL_EFORMAT, "%s: features fill %llu of the body's %u bytes", where,
                         (unsigned long long)off, len);
    return KPL_OK;
}

kpl_status kpl_dataset_read_chunk(kpl_dataset *ds, int64_t chunk, kpl_chunk *c)
{
    KPL_CHECK(ds && c, KPL_EINVAL, "read_chunk: NULL argument");
    KPL_CHECK(chunk >= 0 && chunk < ds->nchunks, KPL_ERANGE,
              "dataset %s: chunk %lld out of range [0, %lld)", ds->dir, (long long)chunk,
              (long long)ds->nchunks);
    c->chunk = -1;
    kpl_chunk_info ci = kpl_dataset_chunk_info(ds, chunk);
    const shard_r *sh = &ds->shards[ci.shard];
    const uint8_t *e = sh->chunk_ents + KPLR_CHUNK_ENTRY * ci.chunk_in_shard;
    uint64_t off = kpl__rd64(e);
    uint32_t flags = kpl__rd32(e + 20);
    char where[PATH_MAX + 64];
    snprintf(where, sizeof where, "%s chunk %lld (offset %llu)", sh->data_path,
             (long long)ci.chunk_in_shard, (unsigned long long)off);
    size_t n = KPLR_CHUNK_HEADER + ci.stored_bytes;
    KPL_TRY(reserve(&c->buf, &c->buf_cap, n));
    KPL_TRY(kpl__pread_all(sh->fd, c->buf, n, (off_t)off, sh->data_path));
    c->file_len = n;
    const uint8_t *h = c->buf;
    if (memcmp(h, KPLR_CHUNK_MAGIC, 4))
        return KPL_ERROR(KPL_EFORMAT, "%s: bad chunk magic", where);
    if (kpl__rd32(h + 28) != kpl__crc32c(h, 28))
        return KPL_ERROR(KPL_EFORMAT, "%s: chunk header CRC32C mismatch", where);
    if (kpl__rd32(h + 4) != (uint32_t)ci.chunk_in_shard || kpl__rd32(h + 8) != flags ||
        kpl__rd32(h + 12) != ci.num_records || kpl__rd32(h + 16) != ci.raw_bytes ||
        kpl__rd32(h + 20) != ci.stored_bytes)
        return KPL_ERROR(KPL_EFORMAT, "%s: chunk header disagrees with the index", where);
    const uint8_t *payload = h + KPLR_CHUNK_HEADER;
    uint32_t crc = kpl__crc32c(payload, ci.stored_bytes);
    if (crc != kpl__rd32(h + 24))
        return KPL_ERROR(KPL_EFORMAT, "%s: payload CRC32C mismatch (stored %08x, computed "
                         "%08x): corrupt data", where, kpl__rd32(h + 24), crc);
    if (flags & KPLR_FLAG_ZSTD) {
        KPL_TRY(reserve(&c->raw, &c->raw_cap, ci.raw_bytes ? ci.raw_bytes : 1));
        size_t r = ZSTD_decompressDCtx(c->dctx, c->raw, ci.raw_bytes, payload, ci.stored_bytes);
        if (ZSTD_isError(r))
            return KPL_ERROR(KPL_EFORMAT, "%s: zstd: %s", where, ZSTD_getErrorName(r));
        if (r != ci.raw_bytes)
            return KPL_ERROR(KPL_EFORMAT, "%s: decompressed to %zu bytes, header says %zu",
                             where, r, ci.raw_bytes);
        c->data = c->raw;
    } else {
        c->data = payload;
    }
    c->data_len = ci.raw_bytes;
    if ((int64_t)ci.num_records > c->offs_cap) {
        uint32_t *o = realloc(c->offs, ci.num_records * sizeof *o);
        KPL_CHECK(o, KPL_ENOMEM, "chunk: no memory");
        c->offs = o;
        c->offs_cap = (int)ci.num_records;
    }
    /* The record chain must fill the payload exactly and agree with the
     * index entry of every record. */
    const uint8_t *rents = sh->rec_ents + KPLR_RECORD_ENTRY * (ci.first_example - sh->first_example);
    uint64_t pos = 0;
    for (int64_t i = 0; i < ci.num_records; i++) {
        char rw[sizeof where + 96];
        snprintf(rw, sizeof rw, "%s record %lld (example %lld)", where, (long long)i,
                 (long long)(ci.first_example + i));
        if (pos + KPLR_RECORD_HEADER > c->data_len)
            return KPL_ERROR(KPL_EFORMAT, "%s: payload ends before the record", rw);
        if (kpl__rd32(rents + KPLR_RECORD_ENTRY * i + 4) != pos)
            return KPL_ERROR(KPL_EFORMAT, "%s: at payload offset %llu, the index says %u", rw,
                             (unsigned long long)pos, kpl__rd32(rents + KPLR_RECORD_ENTRY * i + 4));
        uint32_t len = kpl__rd32(c->data + pos);
        if (len > KPLR_MAX_BODY || pos + KPLR_RECORD_HEADER + len > c->data_len)
            return KPL_ERROR(KPL_EFORMAT, "%s: length %u runs past the payload", rw, len);
        const uint8_t *body = c->data + pos + KPLR_RECORD_HEADER;
        uint32_t rc = kpl__crc32c(body, len);
        if (rc != kpl__rd32(c->data + pos + 4))
            return KPL_ERROR(KPL_EFORMAT, "%s: record CRC32C mismatch (stored %08x, computed "
                             "%08x)", rw, kpl__rd32(c->data + pos + 4), rc);
        KPL_TRY(kpl__record_parse(ds->nf, ds->schema, body, len, NULL, rw));
        c->offs[i] = (uint32_t)pos;
        pos += KPLR_RECORD_HEADER + len;
    }
    if (pos != c->data_len)
        return KPL_ERROR(KPL_EFORMAT, "%s: records end at byte %llu of a %zu-byte payload", where,
                         (unsigned long long)pos, c->data_len);
    c->n = (int)ci.num_records;
    c->ds = ds;
    c->chunk = chunk;
    c->first_example = ci.first_example;
    return KPL_OK;
}

int kpl_chunk_num_records(const kpl_chunk *c) { return c->chunk >= 0 ? c->n : 0; }
int64_t kpl_chunk_first_example(const kpl_chunk *c) { return c->first_example; }

kpl_status kpl_chunk_record(const kpl_chunk *c, int i, kpl_feature_value *values)
{
    KPL_CHECK(c && c->chunk >= 0, KPL_ESTATE, "chunk: nothing read into it");
    KPL_CHECK(i >= 0 && i < c->n, KPL_ERANGE, "chunk %lld: record %d out of range [0, %d)",
              (long long)c->chunk, i, c->n);
    const uint8_t *r = c->data + c->offs[i];
    return kpl__record_parse(c->ds->nf, c->ds->schema, r + KPLR_RECORD_HEADER, kpl__rd32(r),
                             values, "record");
}

void kpl__dataset_advise(const kpl_dataset *ds, bool sequential)
{
    for (int s = 0; s < ds->nshards; s++)
        posix_fadvise(ds->shards[s].fd, 0, 0,
                      sequential ? POSIX_FADV_SEQUENTIAL : POSIX_FADV_RANDOM);
}

void kpl__dataset_willneed(const kpl_dataset *ds, int64_t chunk)
{
    if (chunk < 0 || chunk >= ds->nchunks) return;
    kpl_chunk_info ci = kpl_dataset_chunk_info(ds, chunk);
    const shard_r *sh = &ds->shards[ci.shard];
    uint64_t off = kpl__rd64(sh->chunk_ents + KPLR_CHUNK_ENTRY * ci.chunk_in_shard);
    posix_fadvise(sh->fd, (off_t)off, (off_t)(KPLR_CHUNK_HEADER + ci.stored_bytes),
                  POSIX_FADV_WILLNEED);
}

kpl_status kpl__dataset_read_record(const kpl_dataset *ds, int64_t example, uint8_t **buf,
                                    size_t *cap, const uint8_t **body, uint32_t *len)
{
    int64_t chunk;
    int rec;
    KPL_TRY(kpl_dataset_locate(ds, example, &chunk, &rec));
    kpl_chunk_info ci = kpl_dataset_chunk_info(ds, chunk);
    KPL_ASSERT(!ci.compressed, "read_record on a compressed chunk");
    const shard_r *sh = &ds->shards[ci.shard];
    uint64_t off = kpl__rd64(sh->chunk_ents + KPLR_CHUNK_ENTRY * ci.chunk_in_shard);
    const uint8_t *re = sh->rec_ents + KPLR_RECORD_ENTRY * (example - sh->first_example);
    uint64_t pos = kpl__rd32(re + 4);
    uint64_t end = rec + 1 < ci.num_records ? kpl__rd32(re + KPLR_RECORD_ENTRY + 4) : ci.raw_bytes;
    char where[PATH_MAX + 96];
    snprintf(where, sizeof where, "%s chunk %lld record %d (example %lld)", sh->data_path,
             (long long)ci.chunk_in_shard, rec, (long long)example);
    if (end < pos + KPLR_RECORD_HEADER || end > ci.raw_bytes)
        return KPL_ERROR(KPL_EFORMAT, "%s: the index gives it %lld bytes", where,
                         (long long)end - (long long)pos);
    size_t n = (size_t)(end - pos);
    KPL_TRY(reserve(buf, cap, n));
    KPL_TRY(kpl__pread_all(sh->fd, *buf, n, (off_t)(off + KPLR_CHUNK_HEADER + pos),
                           sh->data_path));
    uint32_t l = kpl__rd32(*buf);
    if ((size_t)l + KPLR_RECORD_HEADER != n)
        return KPL_ERROR(KPL_EFORMAT, "%s: length %u, the index leaves %zu bytes", where, l,
                         n - KPLR_RECORD_HEADER);
    uint32_t crc = kpl__crc32c(*buf + KPLR_RECORD_HEADER, l);
    if (crc != kpl__rd32(*buf + 4))
        return KPL_ERROR(KPL_EFORMAT, "%s: record CRC32C mismatch (stored %08x, computed %08x)",
                         where, kpl__rd32(*buf + 4), crc);
    KPL_TRY(kpl__record_parse(ds->nf, ds->schema, *buf + KPLR_RECORD_HEADER, l, NULL, where));
    *body = *buf + KPLR_RECORD_HEADER;
    *len = l;
    return KPL_OK;
}

void kpl__chunk_record_body(const kpl_chunk *c, int i, const uint8_t **body, uint32_t *len)
{
    const uint8_t *r = c->data + c->offs[i];
    *body = r + KPLR_RECORD_HEADER;
    *len = kpl__rd32(r);
}

kpl_status kpl_dataset_read_example(kpl_dataset *ds, int64_t example, kpl_chunk *c,
                                    kpl_feature_value *values)
{
    int64_t chunk;
    int rec;
    KPL_TRY(kpl_dataset_locate(ds, example, &chunk, &rec));
    if (c->chunk != chunk || c->ds != ds) KPL_TRY(kpl_dataset_read_chunk(ds, chunk, c));
    return kpl_chunk_record(c, rec, values);
}

/* ---- describe and verify ----------------------------------------------------------- */

kpl_status kpl_dataset_describe(const kpl_dataset *ds, char **json)
{
    json_t *o = json_object();
    uint64_t data = 0, index = 0, raw = 0;
    int64_t zchunks = 0;
    json_t *shards = json_array();
    for (int s = 0; s < ds->nshards; s++) {
        const shard_r *sh = &ds->shards[s];
        data += sh->data_bytes;
        index += sh->index_bytes;
        raw += sh->raw_bytes;
        for (int64_t c = 0; c < sh->nchunks; c++)
            zchunks += kpl__rd32(sh->chunk_ents + KPLR_CHUNK_ENTRY * c + 20) & KPLR_FLAG_ZSTD;
        json_t *x = json_object();
        json_object_set_new(x, "data", json_string(strrchr(sh->data_path, '/') + 1));
        json_object_set_new(x, "num_examples", json_integer(sh->nrecs));
        json_object_set_new(x, "num_chunks", json_integer(sh->nchunks));
        json_object_set_new(x, "data_bytes", json_integer((json_int_t)sh->data_bytes));
        json_array_append_new(shards, x);
    }
    char uid[17];
    snprintf(uid, sizeof uid, "%016" PRIx64, ds->uid);
    json_object_set_new(o, "path", json_string(ds->dir));
    json_object_set_new(o, "format", json_string("kplrecord"));
    json_object_set_new(o, "version", json_integer(ds->version));
    json_object_set_new(o, "dataset_uid", json_string(uid));
    json_object_set_new(o, "writer", json_string(ds->writer));
    json_object_set_new(o, "created", json_string(ds->created));
    json_object_set_new(o, "num_examples", json_integer(ds->nexamples));
    json_object_set_new(o, "num_chunks", json_integer(ds->nchunks));
    json_object_set_new(o, "compressed_chunks", json_integer(zchunks));
    json_object_set_new(o, "num_shards", json_integer(ds->nshards));
    json_object_set_new(o, "features", kpl__schema_json(ds->nf, ds->schema));
    json_object_set_new(o, "attributes", json_loads(ds->attrs, 0, NULL));
    json_object_set_new(o, "data_bytes", json_integer((json_int_t)data));
    json_object_set_new(o, "index_bytes", json_integer((json_int_t)index));
    json_object_set_new(o, "raw_bytes", json_integer((json_int_t)raw));
    json_object_set_new(o, "compression_ratio",
                        json_real(data > 0 ? (double)raw / (double)(data - KPLR_FILE_HEADER *
                                                                    (uint64_t)ds->nshards -
                                                                    KPLR_CHUNK_HEADER *
                                                                    (uint64_t)ds->nchunks)
                                           : 1.0));
    json_object_set_new(o, "shards", shards);
    *json = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    KPL_CHECK(*json, KPL_ENOMEM, "describe: no memory");
    return KPL_OK;
}

kpl_status kpl_dataset_verify(const char *dir, kpl_verify_stats *stats,
                              void (*progress)(uint64_t, uint64_t, void *), void *ctx)
{
    kpl_dataset *ds = NULL;
    KPL_TRY(kpl_dataset_open(dir, &ds));
    kpl_status st = KPL_OK;
    kpl_chunk *c = kpl_chunk_create();
    if (!c) {
        st = KPL_ERROR(KPL_ENOMEM, "verify: no memory");
        goto fail;
    }
    uint64_t total = 0, done = 0;
    for (int s = 0; s < ds->nshards; s++) total += ds->shards[s].data_bytes;
    kpl_verify_stats vs = {0, 0, 0};
    for (int s = 0; s < ds->nshards; s++) {
        const shard_r *sh = &ds->shards[s];
        /* The chunks tile the file after its header (checked at open), so
         * the whole-file CRC is the header's extended by each chunk read. */
        uint8_t h[KPLR_FILE_HEADER];
        KPL_TRY_GOTO(kpl__pread_all(sh->fd, h, sizeof h, 0, sh->data_path));
        uint32_t crc = kpl__crc32c(h, sizeof h);
        for (int64_t k = 0; k < sh->nchunks; k++) {
            int64_t g = sh->first_chunk + k;
            KPL_TRY_GOTO(kpl_dataset_read_chunk(ds, g, c));
            crc = kpl_crc32c(crc, c->buf, c->file_len);
            /* (Reading the chunk parsed every record: feature counts,
             * and fixed shapes against them.) */
            vs.examples += c->n;
            vs.chunks++;
            done += c->file_len;
            if (progress) progress(done, total, ctx);
        }
        done += KPLR_FILE_HEADER;
        if (crc != sh->data_crc) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: whole-file CRC32C %08x differs from METADATA's "
                           "%08x", sh->data_path, crc, sh->data_crc);
            goto fail;
        }
    }
    vs.bytes = total;
    if (progress) progress(total, total, ctx);
    if (stats) *stats = vs;
fail:
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    return st;
}
