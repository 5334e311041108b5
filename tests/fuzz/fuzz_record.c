/*
 * fuzz_record.c — the KPLRecord reader (dataio/record_read.c) on a dataset
 * directory made from the input: METADATA, every index and data file,
 * kpl_dataset_open, every chunk read and every record parsed, random access
 * (kpl_dataset_read_example, kpl__dataset_read_record), describe, and
 * kpl_dataset_verify.
 *
 * Input: one flags byte, then parts separated by "@KPL@":
 *   METADATA @KPL@ 00000.index @KPL@ 00000.data [@KPL@ 00001.index @KPL@ 00001.data ...]
 *   [@KPL@ WRITING]   (with flag 4)
 * Flags: 1 = recompute the CRC32Cs of the binary files (file headers, chunk
 * headers and payloads, records of stored chunks, index tails), so that
 * mutations get past the checksums to the checks behind them; 2 = also
 * rewrite METADATA's per-shard sizes and CRCs to match the files (and seal
 * a version 2 METADATA again with its metadata_crc32c); 4 = the
 * last part is a WRITING marker (an unfinished dataset).
 * Seeds (corpus/record) are real datasets written by kpl_record_writer.
 */
#include "fuzz_common.h"

#include <jansson.h>

#include "dataio_impl.h"

#define SEP "@KPL@"
#define MAX_SHARDS 3
#define MAX_CHUNKS 256 /* chunks read per input: bounded time */

static uint32_t crc(const void *p, size_t n) { return kpl_crc32c(0, p, n); }

/* Header CRC, then each chunk's payload CRC (and its records' CRCs when
 * stored uncompressed) and header CRC, as far as the chunks fit. */
static void fix_data(uint8_t *d, size_t n)
{
    if (n < KPLR_FILE_HEADER) return;
    kpl__wr32(d + 28, crc(d, 28));
    size_t off = KPLR_FILE_HEADER;
    while (off + KPLR_CHUNK_HEADER <= n) {
        uint8_t *h = d + off;
        uint32_t flags = kpl__rd32(h + 8), stored = kpl__rd32(h + 20);
        if (stored > n - off - KPLR_CHUNK_HEADER) break;
        uint8_t *pl = h + KPLR_CHUNK_HEADER;
        if (!(flags & KPLR_FLAG_ZSTD))
            for (size_t pos = 0; pos + KPLR_RECORD_HEADER <= stored;) {
                uint32_t len = kpl__rd32(pl + pos);
                if (len > stored - pos - KPLR_RECORD_HEADER) break;
                kpl__wr32(pl + pos + 4, crc(pl + pos + KPLR_RECORD_HEADER, len));
                pos += KPLR_RECORD_HEADER + len;
            }
        kpl__wr32(h + 24, crc(pl, stored));
        kpl__wr32(h + 28, crc(h, 28));
        off += KPLR_CHUNK_HEADER + stored;
    }
}

static void fix_index(uint8_t *d, size_t n)
{
    if (n >= KPLR_FILE_HEADER) kpl__wr32(d + 28, crc(d, 28));
    if (n >= KPLR_FILE_HEADER + 4) kpl__wr32(d + n - 4, crc(d, n - 4));
}

/* METADATA's shards[i] sizes and CRCs from the files; the text is
 * replaced only when it parses. */
static void fix_metadata(fuzz_part *meta, char **owned, fuzz_part *files, int nfiles)
{
    json_t *m = json_loadb((const char *)meta->p, meta->n, 0, NULL);
    json_t *sa = json_object_get(m, "shards");
    for (size_t i = 0; json_is_array(sa) && i < json_array_size(sa); i++) {
        json_t *o = json_array_get(sa, i);
        if (!json_is_object(o)) continue;
        fuzz_part *ix = 2 * (int)i < nfiles ? &files[2 * i] : NULL;
        fuzz_part *da = 2 * (int)i + 1 < nfiles ? &files[2 * i + 1] : NULL;
        if (ix) {
            json_object_set_new(o, "index_bytes", json_integer((json_int_t)ix->n));
            json_object_set_new(o, "index_crc32c", json_integer(crc(ix->p, ix->n)));
        }
        if (da) {
            json_object_set_new(o, "data_bytes", json_integer((json_int_t)da->n));
            json_object_set_new(o, "data_crc32c", json_integer(crc(da->p, da->n)));
        }
    }
    if (json_is_object(m) && json_object_get(m, KPLR_METADATA_CRC_KEY)) {
        /* version 2: sealed again, as the writer seals it */
        json_object_del(m, KPLR_METADATA_CRC_KEY);
        *owned = kpl__metadata_text(m);
        if (*owned) *meta = (fuzz_part){(const uint8_t *)*owned, strlen(*owned)};
    } else if (json_is_object(m)) {
        *owned = json_dumps(m, JSON_COMPACT | JSON_PRESERVE_ORDER);
        if (*owned) *meta = (fuzz_part){(const uint8_t *)*owned, strlen(*owned)};
    }
    json_decref(m);
}

/* Everything a reader of an opened dataset does with it. */
static void read_all(kpl_dataset *ds)
{
    int nf = kpl_dataset_num_features(ds);
    for (int f = 0; f < nf; f++) {
        const kpl_feature_spec *s = kpl_dataset_feature(ds, f);
        if (kpl_dataset_find_feature(ds, s->name) < 0) abort();
    }
    fuzz_touch(kpl_dataset_attributes(ds), strlen(kpl_dataset_attributes(ds)));
    char *json = NULL;
    if (kpl_dataset_describe(ds, &json) == KPL_OK) free(json);

    kpl_feature_value *v = calloc((size_t)nf, sizeof *v);
    kpl_chunk *c = kpl_chunk_create();
    if (!v || !c) abort();
    uint8_t *rbuf = NULL;
    size_t rcap = 0;
    int64_t nch = kpl_dataset_num_chunks(ds);
    for (int64_t k = 0; k < nch && k < MAX_CHUNKS; k++) {
        kpl_chunk_info ci = kpl_dataset_chunk_info(ds, k);
        if (fuzz_st(kpl_dataset_read_chunk(ds, k, c), "read_chunk") != KPL_OK) continue;
        int n = kpl_chunk_num_records(c);
        for (int i = 0; i < n; i++) {
            if (kpl_chunk_record(c, i, v) != KPL_OK) continue;
            for (int f = 0; f < nf; f++)
                fuzz_touch(v[f].data,
                           v[f].count * kpl__feature_elem_size(kpl_dataset_feature(ds, f)->type));
            const uint8_t *body;
            uint32_t len;
            kpl__chunk_record_body(c, i, &body, &len);
            fuzz_touch(body, len);
            /* Open checked that every record entry names its own chunk,
             * so locating a record read from chunk k must give k back. */
            int64_t ex = kpl_chunk_first_example(c) + i, at;
            int rec;
            if (kpl_dataset_locate(ds, ex, &at, &rec) != KPL_OK || at != k || rec != i) {
                fprintf(stderr, "fuzz_record: example %lld of chunk %lld record %d located at "
                        "chunk %lld record %d\n", (long long)ex, (long long)k, i, (long long)at,
                        rec);
                abort();
            }
            if (!ci.compressed &&
                kpl__dataset_read_record(ds, ex, &rbuf, &rcap, &body, &len) == KPL_OK)
                fuzz_touch(body, len);
        }
    }
    int64_t nex = kpl_dataset_num_examples(ds);
    kpl_chunk *c2 = kpl_chunk_create();
    if (!c2) abort();
    const int64_t probe[3] = {0, nex / 2, nex - 1};
    for (int i = 0; i < 3; i++)
        if (probe[i] >= 0 && kpl_dataset_read_example(ds, probe[i], c2, v) == KPL_OK)
            for (int f = 0; f < nf; f++)
                fuzz_touch(v[f].data,
                           v[f].count * kpl__feature_elem_size(kpl_dataset_feature(ds, f)->type));
    kpl_chunk_destroy(c2);
    free(rbuf);
    kpl_chunk_destroy(c);
    free(v);
}

static void progress(uint64_t done, uint64_t total, void *ctx)
{
    (void)ctx;
    if (done > total) abort(); /* the verifier's own bookkeeping */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    fuzz_reset();
    const char *root = fuzz_dir("record");
    char dir[PATH_MAX], path[PATH_MAX];
    fuzz_path(dir, root, "ds");
    fuzz_empty_dir(dir);

    uint8_t flags = data[0];
    fuzz_part parts[2 + 2 * MAX_SHARDS];
    int np = fuzz_split(data + 1, size - 1, SEP, strlen(SEP), parts, 2 + 2 * MAX_SHARDS);
    fuzz_part writing = {NULL, 0};
    if ((flags & 4) && np > 1) writing = parts[--np];
    /* The binary parts, copied so that the checksums can be fixed. */
    int nfiles = np - 1 < 2 * MAX_SHARDS ? np - 1 : 2 * MAX_SHARDS;
    fuzz_part files[2 * MAX_SHARDS];
    uint8_t *copies[2 * MAX_SHARDS] = {NULL};
    for (int i = 0; i < nfiles; i++) {
        copies[i] = malloc(parts[1 + i].n ? parts[1 + i].n : 1);
        if (!copies[i]) abort();
        memcpy(copies[i], parts[1 + i].p, parts[1 + i].n);
        if (flags & 1) {
            if (i % 2) fix_data(copies[i], parts[1 + i].n);
            else fix_index(copies[i], parts[1 + i].n);
        }
        files[i] = (fuzz_part){copies[i], parts[1 + i].n};
    }
    fuzz_part meta = parts[0];
    char *meta_owned = NULL;
    if (flags & 2) fix_metadata(&meta, &meta_owned, files, nfiles);

    fuzz_path(path, dir, KPLR_METADATA);
    fuzz_write(path, meta.p, meta.n);
    for (int i = 0; i < nfiles; i++) {
        char name[32];
        snprintf(name, sizeof name, "%05d.%s", i / 2, i % 2 ? "data" : "index");
        fuzz_path(path, dir, name);
        fuzz_write(path, files[i].p, files[i].n);
    }
    if (writing.p) {
        fuzz_path(path, dir, KPLR_WRITING);
        fuzz_write(path, writing.p, writing.n);
        kpl_writer_state state;
        char who[300];
        kpl_dataset_writer_state(dir, &state, who, sizeof who);
    }

    kpl_dataset *ds = NULL;
    if (fuzz_st(kpl_dataset_open(dir, &ds), "open") == KPL_OK) {
        read_all(ds);
        kpl_dataset_close(ds);
        kpl_verify_stats vs;
        fuzz_st(kpl_dataset_verify(dir, &vs, progress, NULL), "verify");
    }

    free(meta_owned);
    for (int i = 0; i < nfiles; i++) free(copies[i]);
    return 0;
}
