/*
 * convert_lmdb.c — Caffe Datum LMDB databases to KPLRecord.
 *
 * A Caffe database maps keys to serialized `Datum` protocol buffers:
 *   channels = 1, height = 2, width = 3 (int32), data = 4 (bytes: raw
 *   pixels in C x H x W order, or an encoded image when encoded = 7 is
 *   true), label = 5 (int32), float_data = 6 (repeated float).
 * The few fields are read with a small wire-format parser; protobuf-c would
 * need the generated code of caffe.proto for five fields.
 *
 * The database is opened read-only with MDB_NOLOCK: no lock file is created
 * or written, so read-only media and databases copied without their
 * lock.mdb work.  A first pass finds whether images are encoded, whether
 * their sizes agree (a fixed shape is then recorded; otherwise each record
 * carries its own in an `image_shape` feature, as Caffe's DataLayer takes
 * each Datum's own size) and whether float_data occurs; the second pass
 * writes.  Raw pixels are stored as H x W x C, kpl's raw layout, in the
 * channel order Caffe stored (BGR when the database was made by Caffe's
 * convert_imageset).  Every error names the key of the Datum at fault.
 */
#include "dataio_impl.h"

#include <errno.h>
#include <jansson.h>
#include <lmdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

typedef struct {
    int64_t channels, height, width, label;
    const uint8_t *data;
    size_t data_len;
    const uint8_t *floats; /* packed little-endian floats or NULL */
    size_t nfloats;
    bool floats_packed, encoded;
} datum;

/* ---- protobuf wire format ---- */

static bool varint(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return true;
    }
    return false;
}

/* Fills d from one serialized Datum; `why` receives the reason on failure. */
static bool parse_datum(const uint8_t *p, size_t n, datum *d, const char **why)
{
    const uint8_t *end = p + n;
    memset(d, 0, sizeof *d);
    const uint8_t *first_float = NULL;
    while (p < end) {
        uint64_t key, v;
        if (!varint(&p, end, &key)) return *why = "truncated field key", false;
        uint64_t field = key >> 3, wire = key & 7;
        switch (wire) {
        case 0:
            if (!varint(&p, end, &v)) return *why = "truncated varint", false;
            if (field == 1) d->channels = (int32_t)v;
            else if (field == 2) d->height = (int32_t)v;
            else if (field == 3) d->width = (int32_t)v;
            else if (field == 5) d->label = (int32_t)v;
            else if (field == 7) d->encoded = v != 0;
            break;
        case 1:
            if (end - p < 8) return *why = "truncated 64-bit field", false;
            p += 8;
            break;
        case 2:
            if (!varint(&p, end, &v) || v > (uint64_t)(end - p))
                return *why = "length-delimited field runs past the value", false;
            if (field == 4) {
                d->data = p;
                d->data_len = (size_t)v;
            } else if (field == 6) { /* packed float_data */
                if (v % 4) return *why = "packed float_data is not a multiple of 4 bytes", false;
                if (d->nfloats && !d->floats_packed)
                    return *why = "float_data mixes packed and unpacked", false;
                if (d->nfloats && d->floats + 4 * d->nfloats != p)
                    return *why = "float_data in several packed runs", false;
                if (!d->nfloats) d->floats = p;
                d->floats_packed = true;
                d->nfloats += (size_t)v / 4;
            }
            p += v;
            break;
        case 5:
            if (end - p < 4) return *why = "truncated 32-bit field", false;
            if (field == 6) { /* unpacked float_data: key byte + 4 bytes each */
                if (!d->nfloats) first_float = p;
                else if (d->floats_packed) return *why = "float_data mixes packed and unpacked", false;
                else if (p != first_float + 5 * d->nfloats)
                    return *why = "unpacked float_data values are not consecutive", false;
                d->floats = first_float;
                d->nfloats++;
            }
            p += 4;
            break;
        default:
            return *why = "unknown wire type", false;
        }
    }
    if (d->channels < 0 || d->height < 0 || d->width < 0)
        return *why = "negative channels/height/width", false;
    /* The product may not wrap (2^21 x 2^21 x 2^22 would pass as 0). */
    uint64_t px;
    if (!d->encoded &&
        (__builtin_mul_overflow((uint64_t)d->channels, (uint64_t)d->height, &px) ||
         __builtin_mul_overflow(px, (uint64_t)d->width, &px) || px != d->data_len))
        return *why = "raw data length differs from channels x height x width", false;
    return true;
}

/* Copies float_data of d to out[d->nfloats] (unpacked values are 5 bytes apart). */
static void datum_floats(const datum *d, float *out)
{
    for (size_t i = 0; i < d->nfloats; i++)
        memcpy(&out[i], d->floats + (d->floats_packed ? 4 * i : 5 * i), 4);
}

static const char *sniff(const uint8_t *b, size_t n)
{
    if (n >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff) return "jpeg";
    if (n >= 8 && !memcmp(b, "\x89PNG\r\n\x1a\n", 8)) return "png";
    return "";
}

/* A key as messages show it: at most KEY_SHOWN bytes, control bytes as '?'
 * (LMDB keys are any bytes; Caffe's are text). */
#define KEY_SHOWN 200
static void show_key(const MDB_val *k, char out[KEY_SHOWN + 1])
{
    size_t n = k->mv_size < KEY_SHOWN ? k->mv_size : KEY_SHOWN;
    const uint8_t *p = k->mv_data;
    for (size_t i = 0; i < n; i++) out[i] = p[i] < 0x20 || p[i] == 0x7f ? '?' : (char)p[i];
    out[n] = 0;
}

#define MDB_TRY(call, what)                                                                  \
    do {                                                                                     \
        int rc_ = (call);                                                                    \
        if (rc_) {                                                                           \
            st = KPL_ERROR(rc_ == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "lmdb %s: %s: %s", path, \
                           what, mdb_strerror(rc_));                                         \
            goto fail;                                                                       \
        }                                                                                    \
    } while (0)

/* What the first pass over the database found. */
typedef struct {
    bool any_encoded, any_raw, same, any_floats;
    int64_t c0, h0, w0, maxl;
    size_t max_floats, max_pixels;
    const char *enc0; /* the encoding all encoded images share, "" if they differ */
    char first_enc[KEY_SHOWN + 1], first_raw[KEY_SHOWN + 1];
} survey;

/* Pass 1: every Datum checked, the schema's facts gathered. */
static kpl_status scan(MDB_cursor *cur, const char *path, survey *sv)
{
    kpl_status st = KPL_OK;
    memset(sv, 0, sizeof *sv);
    sv->same = true;
    sv->c0 = sv->h0 = sv->w0 = sv->maxl = -1;
    MDB_val k, v;
    int rc;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        datum d;
        const char *why;
        char key[KEY_SHOWN + 1];
        show_key(&k, key);
        if (!parse_datum(v.mv_data, v.mv_size, &d, &why))
            return KPL_ERROR(KPL_EFORMAT, "lmdb %s: key '%s': not a Caffe Datum (%s)", path, key,
                             why);
        if (d.data_len == 0)
            return KPL_ERROR(KPL_EFORMAT, "lmdb %s: key '%s': an empty %s image (channels x "
                             "height x width = %lld x %lld x %lld, no data bytes)", path, key,
                             d.encoded ? "encoded" : "raw", (long long)d.channels,
                             (long long)d.height, (long long)d.width);
        if (d.data_len > KPLR_MAX_BODY / 2)
            return KPL_ERROR(KPL_EFORMAT, "lmdb %s: key '%s': a %zu-byte image is larger than a "
                             "record may be", path, key, d.data_len);
        if (d.encoded && !sv->first_enc[0]) snprintf(sv->first_enc, sizeof sv->first_enc, "%s", key);
        if (!d.encoded && !sv->first_raw[0]) snprintf(sv->first_raw, sizeof sv->first_raw, "%s", key);
        if (d.encoded) {
            const char *e = sniff(d.data, d.data_len);
            if (!sv->enc0) sv->enc0 = e;
            else if (strcmp(sv->enc0, e)) sv->enc0 = "";
        }
        sv->any_encoded |= d.encoded;
        sv->any_raw |= !d.encoded;
        if (sv->c0 < 0) sv->c0 = d.channels, sv->h0 = d.height, sv->w0 = d.width;
        sv->same &= d.channels == sv->c0 && d.height == sv->h0 && d.width == sv->w0;
        sv->any_floats |= d.nfloats > 0;
        sv->max_floats = d.nfloats > sv->max_floats ? d.nfloats : sv->max_floats;
        sv->max_pixels = d.data_len > sv->max_pixels ? d.data_len : sv->max_pixels;
        sv->maxl = d.label > sv->maxl ? d.label : sv->maxl;
    }
    if (rc != MDB_NOTFOUND) MDB_TRY(rc, "cursor_get");
    if (sv->any_encoded && sv->any_raw)
        return KPL_ERROR(KPL_EFORMAT, "lmdb %s: mixes encoded Datums (the first: key '%s') and "
                         "raw ones (the first: key '%s'); a dataset holds one kind, so convert "
                         "the two kinds from separate databases", path, sv->first_enc,
                         sv->first_raw);
fail:
    return st;
}

/* The dataset's features from the survey: image, label, key, and
 * float_data / image_shape when needed; *nf receives their count.  Raw
 * Datums of differing sizes: each record carries its own (H, W, C) in
 * `image_shape`, which the transform reads (docs/transforms.md). */
static void make_schema(const survey *sv, kpl_feature_spec *schema, int *nf)
{
    bool per_record = !sv->any_encoded && !sv->same;
    kpl_feature_spec base[5] = {
        {.name = "image", .type = KPL_FEATURE_BYTES},
        {.name = "label", .type = KPL_FEATURE_INT64},
        {.name = "key", .type = KPL_FEATURE_STRING},
        {.name = "float_data", .type = KPL_FEATURE_FLOAT},
        {.name = "image_shape", .type = KPL_FEATURE_INT64, .ndim = 1, .shape = {3}},
    };
    memcpy(schema, base, sizeof base);
    *nf = 3;
    if (sv->any_floats) (*nf)++;
    if (per_record) {
        if (!sv->any_floats) schema[3] = schema[4];
        (*nf)++;
    }
    if (sv->any_encoded) {
        snprintf(schema[0].encoding, sizeof schema[0].encoding, "%s", sv->enc0 ? sv->enc0 : "");
    } else {
        strcpy(schema[0].encoding, "raw");
        if (sv->same) {
            schema[0].ndim = 3;
            schema[0].shape[0] = sv->h0;
            schema[0].shape[1] = sv->w0;
            schema[0].shape[2] = sv->c0;
        }
    }
}

/* Pass 2: the records, in key order; *count receives them. */
static kpl_status write_records(MDB_cursor *cur, const char *path, const survey *sv,
                                kpl_record_writer *w, const kpl_convert_options *o,
                                const char *out_dir, int64_t n, int64_t *count)
{
    kpl_status st = KPL_OK;
    bool per_record = !sv->any_encoded && !sv->same;
    uint8_t *hwc = malloc(sv->max_pixels ? sv->max_pixels : 1);
    float *fl = malloc(sizeof *fl * (sv->max_floats ? sv->max_floats : 1));
    if (!hwc || !fl) {
        st = KPL_ERROR(KPL_ENOMEM, "lmdb %s: no memory", path);
        goto fail;
    }
    kpl__progress pr;
    kpl__progress_init(&pr, o, out_dir);
    int64_t i = 0;
    MDB_val k, v;
    int rc;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        datum d;
        const char *why;
        char key[KEY_SHOWN + 1];
        show_key(&k, key);
        if (!parse_datum(v.mv_data, v.mv_size, &d, &why) || d.data_len > sv->max_pixels ||
            d.nfloats > sv->max_floats || d.data_len == 0) { /* changed under us */
            st = KPL_ERROR(KPL_EFORMAT, "lmdb %s: key '%s' changed during conversion", path, key);
            goto fail;
        }
        const uint8_t *img = d.data;
        if (!d.encoded && d.channels > 1) { /* C x H x W -> H x W x C */
            int64_t hw = d.height * d.width;
            for (int64_t c = 0; c < d.channels; c++)
                for (int64_t q = 0; q < hw; q++) hwc[q * d.channels + c] = d.data[c * hw + q];
            img = hwc;
        }
        datum_floats(&d, fl);
        int64_t label = d.label, hwc_shape[3] = {d.height, d.width, d.channels};
        kpl_feature_value fv[5] = {{img, (uint32_t)d.data_len},
                                   {&label, 1},
                                   {k.mv_data, (uint32_t)k.mv_size},
                                   {fl, (uint32_t)d.nfloats},
                                   {hwc_shape, 3}};
        if (per_record && !sv->any_floats) fv[3] = fv[4];
        if (kpl_record_writer_add(w, fv) < 0) {
            st = KPL_ERROR(kpl_last_status(), "lmdb %s: key '%s': %s", path, key, kpl_last_error());
            goto fail;
        }
        KPL_TRY_GOTO(kpl__progress_update(&pr, (uint64_t)++i, (uint64_t)n, "records"));
    }
    if (rc != MDB_NOTFOUND) MDB_TRY(rc, "cursor_get");
    *count = i;
fail:
    free(hwc);
    free(fl);
    return st;
}

kpl_status kpl_convert_lmdb(const char *path, const char *out_dir,
                            const kpl_convert_options *opt, int64_t *count)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    if (opt) o = *opt;
    kpl_status st = KPL_OK;
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    kpl_record_writer *w = NULL;
    char *attrs = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return KPL_ERROR(KPL_ENOTFOUND, "lmdb %s: %s", path, strerror(errno));
    MDB_TRY(mdb_env_create(&env), "env_create");
    unsigned flags = MDB_RDONLY | MDB_NOLOCK | MDB_NOTLS | (S_ISDIR(sb.st_mode) ? 0 : MDB_NOSUBDIR);
    MDB_TRY(mdb_env_open(env, path, flags, 0444), "open");
    MDB_TRY(mdb_txn_begin(env, NULL, MDB_RDONLY, &txn), "txn_begin");
    MDB_dbi dbi;
    MDB_TRY(mdb_dbi_open(txn, NULL, 0, &dbi), "dbi_open");
    MDB_stat ms;
    MDB_TRY(mdb_stat(txn, dbi, &ms), "stat");
    int64_t n = (int64_t)ms.ms_entries;
    if (n == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "lmdb %s: the database is empty", path);
        goto fail;
    }
    MDB_TRY(mdb_cursor_open(txn, dbi, &cur), "cursor_open");
    survey sv;
    KPL_TRY_GOTO(scan(cur, path, &sv));
    kpl_feature_spec schema[5];
    int nf = 0;
    make_schema(&sv, schema, &nf);
    json_t *aj = json_pack("{s:s, s:I, s:s, s:s, s:s}", "source", "lmdb", "num_classes",
                           (json_int_t)(sv.maxl + 1), "path", path, "channel_order",
                           sv.any_encoded ? "as encoded" : "as stored (Caffe: BGR)", "image_size",
                           sv.any_encoded ? "as encoded" : sv.same ? "fixed" : "per record");
    attrs = aj ? json_dumps(aj, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(aj);
    if (!attrs) {
        st = KPL_ERROR(KPL_ENOMEM, "lmdb %s: no memory (or the path is not UTF-8)", path);
        goto fail;
    }
    o.writer.attributes_json = attrs;
    KPL_TRY_GOTO(kpl_record_writer_create(out_dir, nf, schema, &o.writer, &w));
    int64_t i = 0;
    KPL_TRY_GOTO(write_records(cur, path, &sv, w, &o, out_dir, n, &i));
    kpl_record_writer *done = w;
    w = NULL;
    KPL_TRY_GOTO(kpl_record_writer_close(done));
    if (count) *count = i;
fail:
    kpl_record_writer_destroy(w);
    if (cur) mdb_cursor_close(cur);
    if (txn) mdb_txn_abort(txn);
    if (env) mdb_env_close(env);
    free(attrs);
    return st;
}
