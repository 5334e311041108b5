/* test_dataio.c — KPLRecord: CRC32C against RFC 3720's vectors, round trips
 * of every feature type (compressed and not, several shards, records larger
 * than a chunk), random access, and every kind of damage the format must
 * catch: a flipped byte, a record whose chunk checksum was patched over,
 * truncated files, a METADATA that lies, an unfinished writer, a shard from
 * another dataset.  IDX import from files the test writes and, when
 * installed, from Debian's Fashion-MNIST. */
#define KPL_TEST_NAME "dataio"
#include "dataio_test.h"
#include "dataio_impl.h"
#include "transform_impl.h"
#include "image_files.h"

#include <fcntl.h>
#include <jansson.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
#include <lmdb.h>
#include <png.h>
#include <turbojpeg.h>
#include <zlib.h>

/* ---- CRC32C ---------------------------------------------------------------------- */

static void test_crc32c_vectors(void **state)
{
    (void)state;
    uint8_t b[32];
    assert_int_equal(kpl__crc32c("123456789", 9), 0xE3069283u);
    memset(b, 0, 32);
    assert_int_equal(kpl__crc32c(b, 32), 0x8A9136AAu);
    memset(b, 0xff, 32);
    assert_int_equal(kpl__crc32c(b, 32), 0x62A8AB43u);
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)i;
    assert_int_equal(kpl__crc32c(b, 32), 0x46DD794Eu);
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)(31 - i);
    assert_int_equal(kpl__crc32c(b, 32), 0x113FDB5Cu);
    /* Extending equals one pass, at every split (odd tails included). */
    uint8_t big[1000];
    for (int i = 0; i < 1000; i++) big[i] = (uint8_t)(i * 7 + 3);
    uint32_t whole = kpl__crc32c(big, 1000);
    for (size_t cut = 0; cut <= 1000; cut += 37)
        assert_int_equal(kpl_crc32c(kpl__crc32c(big, cut), big + cut, 1000 - cut), whole);
}

/* ---- round trips ------------------------------------------------------------------ */

/* Example i of the synthetic set: bytes of length i % 700 (a few large ones
 * spill over a chunk), a label list, a float list and a name. */
typedef struct {
    uint8_t bytes[9000];
    uint32_t nbytes;
    int64_t ints[3];
    uint32_t nints;
    float floats[5];
    char str[32];
} example;

static void make_example(int64_t i, example *e)
{
    e->nbytes = (uint32_t)(i % 97 == 5 ? 9000 : i % 700);
    for (uint32_t k = 0; k < e->nbytes; k++) e->bytes[k] = (uint8_t)((i * 31 + k * 7) ^ (k >> 3));
    e->nints = (uint32_t)(i % 4);
    for (uint32_t k = 0; k < e->nints; k++) e->ints[k] = (i << 20) - (int64_t)k * 1000000007LL;
    for (int k = 0; k < 5; k++) e->floats[k] = (float)i * 0.25f - (float)k;
    snprintf(e->str, sizeof e->str, "example-%lld", (long long)i);
}

static const kpl_feature_spec schema4[4] = {
    {.name = "payload", .type = KPL_FEATURE_BYTES},
    {.name = "ints", .type = KPL_FEATURE_INT64},
    {.name = "floats", .type = KPL_FEATURE_FLOAT},
    {.name = "name", .type = KPL_FEATURE_STRING},
};

static void write_set(const char *dir, int64_t n, int shards, size_t chunk, int level)
{
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    cfg.shards = shards;
    cfg.chunk_bytes = chunk;
    cfg.zstd_level = level;
    cfg.attributes_json = "{\"source\":\"test\",\"n\":3}";
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 4, schema4, &cfg, &w));
    example e;
    for (int64_t i = 0; i < n; i++) {
        make_example(i, &e);
        kpl_feature_value v[4] = {{e.bytes, e.nbytes}, {e.ints, e.nints}, {e.floats, 5},
                                  {e.str, (uint32_t)strlen(e.str)}};
        OK(kpl_record_writer_add(w, v));
    }
    assert_int_equal(kpl_record_writer_count(w), n);
    OK(kpl_record_writer_close(w));
}

/* The write-order number of an example, given its dataset number: chunks
 * were dealt round-robin, so the writer's chunk sequence is recovered by
 * interleaving the shards' chunk lists. */
static void check_example(const kpl_feature_value *v, int64_t i)
{
    example e;
    make_example(i, &e);
    assert_int_equal(v[0].count, e.nbytes);
    assert_memory_equal(v[0].data, e.bytes, e.nbytes);
    assert_int_equal(v[1].count, e.nints);
    if (e.nints) assert_memory_equal(v[1].data, e.ints, 8 * e.nints);
    assert_int_equal(v[2].count, 5);
    assert_memory_equal(v[2].data, e.floats, 20);
    assert_int_equal(v[3].count, strlen(e.str));
    assert_memory_equal(v[3].data, e.str, strlen(e.str));
}

static void round_trip(const char *dir, int64_t n, int shards, size_t chunk, int level)
{
    write_set(dir, n, shards, chunk, level);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(dir, &ds));
    assert_int_equal(kpl_dataset_num_examples(ds), n);
    assert_int_equal(kpl_dataset_num_features(ds), 4);
    assert_string_equal(kpl_dataset_feature(ds, 3)->name, "name");
    assert_int_equal(kpl_dataset_feature(ds, 1)->type, KPL_FEATURE_INT64);
    assert_int_equal(kpl_dataset_find_feature(ds, "floats"), 2);
    assert_int_equal(kpl_dataset_find_feature(ds, "nope"), -1);
    assert_string_equal(kpl_dataset_attributes(ds), "{\"source\":\"test\",\"n\":3}");

    /* Walk the chunks in dataset order; rebuild the write order: the k-th
     * chunk written is chunk k / shards of shard k % shards. */
    int64_t nchunks = kpl_dataset_num_chunks(ds), seen = 0, compressed = 0;
    int64_t *first_written = calloc((size_t)nchunks, sizeof *first_written);
    int64_t *shard_start = calloc((size_t)shards + 1, sizeof *shard_start);
    for (int64_t k = 0; k < nchunks; k++) shard_start[kpl_dataset_chunk_info(ds, k).shard + 1]++;
    for (int s = 0; s < shards; s++) shard_start[s + 1] += shard_start[s];
    int64_t written = 0;
    for (int64_t j = 0; j < nchunks; j++) { /* j-th chunk the writer closed */
        int s = (int)(j % shards);
        int64_t k = shard_start[s] + j / shards;
        first_written[k] = written;
        written += kpl_dataset_chunk_info(ds, k).num_records;
    }
    kpl_chunk *c = NN(kpl_chunk_create());
    kpl_feature_value v[4];
    for (int64_t k = 0; k < nchunks; k++) {
        kpl_chunk_info ci = kpl_dataset_chunk_info(ds, k);
        compressed += ci.compressed;
        assert_true(ci.raw_bytes <= chunk || ci.num_records == 1);
        OK(kpl_dataset_read_chunk(ds, k, c));
        assert_int_equal(kpl_chunk_num_records(c), ci.num_records);
        assert_int_equal(kpl_chunk_first_example(c), seen);
        for (int r = 0; r < kpl_chunk_num_records(c); r++) {
            OK(kpl_chunk_record(c, r, v));
            check_example(v, first_written[k] + r);
        }
        seen += ci.num_records;
    }
    assert_int_equal(seen, n);
    if (level == 0) assert_int_equal(compressed, 0);
    else assert_true(compressed > 0);
    /* Random access lands on the same records. */
    for (int64_t i = n - 1; i >= 0; i -= 17) {
        int64_t k;
        int r;
        OK(kpl_dataset_locate(ds, i, &k, &r));
        OK(kpl_dataset_read_example(ds, i, c, v));
        check_example(v, first_written[k] + r);
    }
    FAILS(kpl_dataset_read_example(ds, n, c, v), KPL_ERANGE, "out of range");
    FAILS(kpl_chunk_record(c, 100000, v), KPL_ERANGE, "out of range");
    char *json = NULL;
    OK(kpl_dataset_describe(ds, &json));
    char want[64];
    snprintf(want, sizeof want, "\"num_examples\": %lld", (long long)n);
    assert_non_null(strstr(json, want));
    free(json);
    kpl_verify_stats vs;
    OK(kpl_dataset_verify(dir, &vs, NULL, NULL));
    assert_int_equal(vs.examples, n);
    assert_int_equal(vs.chunks, nchunks);
    free(first_written);
    free(shard_start);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
}

static void test_round_trip_one_shard_zstd(void **state)
{
    (void)state;
    round_trip(tmp_path("rt1"), 1000, 1, 64 << 10, 3);
}

static void test_round_trip_shards_uncompressed(void **state)
{
    (void)state;
    round_trip(tmp_path("rt2"), 777, 3, 16 << 10, 0);
}

static void test_round_trip_more_shards_than_chunks(void **state)
{
    (void)state;
    round_trip(tmp_path("rt3"), 5, 4, 1 << 20, 1); /* one chunk, three empty shards */
}

/* Random bytes do not shrink: the writer stores them raw. */
static void test_incompressible_chunks_stored_raw(void **state)
{
    (void)state;
    const char *dir = tmp_path("noise");
    kpl_feature_spec s = {.name = "x", .type = KPL_FEATURE_BYTES};
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    cfg.chunk_bytes = 8192;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 1, &s, &cfg, &w));
    uint8_t buf[4000];
    uint64_t r = 88172645463325252ull;
    for (int i = 0; i < 40; i++) {
        for (int k = 0; k < 4000; k++) {
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            buf[k] = (uint8_t)r;
        }
        kpl_feature_value v = {buf, 4000};
        OK(kpl_record_writer_add(w, &v));
    }
    OK(kpl_record_writer_close(w));
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(dir, &ds));
    for (int64_t k = 0; k < kpl_dataset_num_chunks(ds); k++)
        assert_false(kpl_dataset_chunk_info(ds, k).compressed);
    kpl_dataset_close(ds);
}

/* ---- damage ----------------------------------------------------------------------- */

static void copy_set(const char *from, const char *to)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", to, from, to);
    assert_int_equal(system(cmd), 0);
}

static void patch(const char *file, long off, const void *bytes, size_t n)
{
    int fd = open(file, O_WRONLY);
    assert_true(fd >= 0);
    assert_int_equal(pwrite(fd, bytes, n, off), (ssize_t)n);
    close(fd);
}

static void read_at(const char *file, long off, void *bytes, size_t n)
{
    int fd = open(file, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(pread(fd, bytes, n, off), (ssize_t)n);
    close(fd);
}

static void flip(const char *file, long off)
{
    uint8_t b;
    read_at(file, off, &b, 1);
    b ^= 0x10;
    patch(file, off, &b, 1);
}

static void test_flipped_byte_named(void **state)
{
    (void)state;
    const char *good = tmp_path("good"), *bad = tmp_path("bad");
    write_set(good, 300, 2, 8 << 10, 3);
    copy_set(good, bad);
    char f[300];
    snprintf(f, sizeof f, "%s/00001.data", bad);
    /* Chunk 0 of shard 1 starts at 32; a byte inside its payload. */
    flip(f, 32 + 32 + 100);
    FAILS(kpl_dataset_verify(bad, NULL, NULL, NULL), KPL_EFORMAT, "00001.data chunk 0");
    assert_non_null(strstr(kpl_last_error(), "payload CRC32C mismatch"));
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(bad, &ds)); /* opening reads no payload... */
    kpl_chunk *c = NN(kpl_chunk_create());
    int64_t k = 0;
    while (kpl_dataset_chunk_info(ds, k).shard != 1) k++;
    FAILS(kpl_dataset_read_chunk(ds, k, c), KPL_EFORMAT, "payload CRC32C"); /* ...reading does */
    OK(kpl_dataset_read_chunk(ds, 0, c)); /* shard 0 is intact */
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    /* A flipped chunk header byte. */
    copy_set(good, bad);
    flip(f, 32 + 13);
    FAILS(kpl_dataset_verify(bad, NULL, NULL, NULL), KPL_EFORMAT, "chunk header CRC32C");
    /* A flipped byte in the index. */
    copy_set(good, bad);
    snprintf(f, sizeof f, "%s/00000.index", bad);
    flip(f, 40);
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "00000.index: index CRC32C mismatch");
    assert_null(ds);
}

/* A record corrupted behind a checksum-correct chunk (as a bad decompressor
 * or memory error would): the record's own CRC names it. */
static void test_record_crc_names_record(void **state)
{
    (void)state;
    const char *dir = tmp_path("rec");
    write_set(dir, 50, 1, 1 << 20, 0); /* one uncompressed chunk */
    char f[300];
    snprintf(f, sizeof f, "%s/00000.data", dir);
    uint8_t h[32];
    read_at(f, 32, h, 32);
    uint32_t stored = kpl__rd32(h + 20);
    uint8_t *payload = malloc(stored);
    read_at(f, 64, payload, stored);
    /* Record 3's body: walk the length chain. */
    uint32_t pos = 0;
    for (int r = 0; r < 3; r++) pos += 8 + kpl__rd32(payload + pos);
    payload[pos + 8 + 6] ^= 1; /* inside its first feature's bytes */
    patch(f, 64 + pos + 8 + 6, payload + pos + 8 + 6, 1);
    kpl__wr32(h + 24, kpl__crc32c(payload, stored));
    kpl__wr32(h + 28, kpl__crc32c(h, 28));
    patch(f, 32, h, 32);
    free(payload);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(dir, &ds));
    kpl_chunk *c = NN(kpl_chunk_create());
    FAILS(kpl_dataset_read_chunk(ds, 0, c), KPL_EFORMAT, "chunk 0 (offset 32) record 3 (example 3)");
    assert_non_null(strstr(kpl_last_error(), "record CRC32C mismatch"));
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
}

static void test_truncated_and_extended_files(void **state)
{
    (void)state;
    const char *good = tmp_path("tgood"), *bad = tmp_path("tbad");
    write_set(good, 200, 1, 8 << 10, 3);
    copy_set(good, bad);
    char f[300];
    snprintf(f, sizeof f, "%s/00000.data", bad);
    struct stat sb;
    assert_int_equal(stat(f, &sb), 0);
    assert_int_equal(truncate(f, sb.st_size - 10), 0);
    kpl_dataset *ds = NULL;
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "truncated or extended");
    assert_null(ds);
    assert_int_equal(truncate(f, sb.st_size + 1), 0);
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "00000.data");
    copy_set(good, bad);
    snprintf(f, sizeof f, "%s/00000.index", bad);
    assert_int_equal(stat(f, &sb), 0);
    assert_int_equal(truncate(f, sb.st_size - 8), 0);
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "00000.index");
    copy_set(good, bad);
    snprintf(f, sizeof f, "%s/00000.data", bad);
    assert_int_equal(unlink(f), 0);
    FAILS(kpl_dataset_open(bad, &ds), KPL_ENOTFOUND, "00000.data");
}

/* Rewrites METADATA with the first `from` after `anchor` (NULL: the start)
 * replaced by `to`; with `reseal`, its metadata_crc32c is then computed
 * again (as a writer would), so the edit reaches the checks behind it. */
static void edit_metadata_as(const char *dir, const char *anchor, const char *from, const char *to,
                             bool reseal)
{
    char f[300];
    snprintf(f, sizeof f, "%s/METADATA", dir);
    char *text = NULL;
    OK(kpl__read_file(f, &text, NULL));
    char *p = anchor ? strstr(text, anchor) : text;
    assert_non_null(p);
    p = strstr(p, from);
    assert_non_null(p);
    size_t cap = strlen(text) + strlen(to) + 64;
    char *t = malloc(cap);
    int n = snprintf(t, cap, "%.*s%s%s", (int)(p - text), text, to, p + strlen(from));
    int64_t at = kpl__metadata_crc_end(t, (size_t)n);
    if (reseal && at >= 0) {
        uint32_t crc = kpl__crc32c(t, (size_t)at);
        snprintf(t + at, cap - (size_t)at, "\"%s\": %u\n}", KPLR_METADATA_CRC_KEY, crc);
    }
    FILE *o = fopen(f, "w");
    fputs(t, o);
    fclose(o);
    free(t);
    free(text);
}

static void edit_metadata(const char *dir, const char *anchor, const char *from, const char *to)
{
    edit_metadata_as(dir, anchor, from, to, true);
}

static void test_metadata_that_lies(void **state)
{
    (void)state;
    const char *good = tmp_path("mgood"), *bad = tmp_path("mbad");
    write_set(good, 120, 2, 8 << 10, 3);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(good, &ds));
    int64_t n0 = 0;
    for (int64_t k = 0; k < kpl_dataset_num_chunks(ds); k++)
        if (kpl_dataset_chunk_info(ds, k).shard == 0) n0 += kpl_dataset_chunk_info(ds, k).num_records;
    kpl_dataset_close(ds);
    char from[64], to[64];

    copy_set(good, bad); /* the total */
    edit_metadata(bad, NULL, "\"num_examples\": 120", "\"num_examples\": 121");
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "num_examples is 121 but the shards hold 120");

    copy_set(good, bad); /* a shard's count */
    snprintf(from, sizeof from, "\"num_examples\": %lld", (long long)n0);
    snprintf(to, sizeof to, "\"num_examples\": %lld", (long long)n0 - 1);
    edit_metadata(bad, "\"shards\"", from, to);
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "00000.index");

    copy_set(good, bad); /* the version */
    edit_metadata(bad, NULL, "\"version\": 2", "\"version\": 3");
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "format version 3; this kpl reads versions 1 to 2");

    copy_set(good, bad); /* broken JSON: the message has a line number */
    edit_metadata(bad, NULL, "\"format\": \"kplrecord\",", "\"format\": \"kplrecord\" oops");
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "METADATA:2:");

    copy_set(good, bad); /* a shard from another dataset */
    char src[300], dst[300];
    write_set(tmp_path("other"), 120, 2, 8 << 10, 3);
    snprintf(src, sizeof src, "%s/00001.data", tmp_path("other"));
    snprintf(dst, sizeof dst, "%s/00001.data", bad);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", src, dst);
    assert_int_equal(system(cmd), 0);
    kpl_status st = kpl_dataset_open(bad, &ds);
    assert_int_equal(st, KPL_EFORMAT); /* size or uid, whichever check meets it first */
    assert_null(ds);
}


/* A set of n raw 28x28x1 images (pixel i of image e = e + i) with an int64
 * label, fixed at [1] when label_shape. */
static void write_raw_set(const char *dir, int n, bool label_shape)
{
    kpl_feature_spec schema[2] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {28, 28, 1}},
        {.name = "label", .type = KPL_FEATURE_INT64, .ndim = label_shape ? 1 : 0, .shape = {1}},
    };
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 2, schema, &cfg, &w));
    for (int64_t e = 0; e < n; e++) {
        uint8_t img[784];
        for (int i = 0; i < 784; i++) img[i] = (uint8_t)(e + i);
        kpl_feature_value v[2] = {{img, 784}, {&e, 1}};
        OK(kpl_record_writer_add(w, v));
    }
    OK(kpl_record_writer_close(w));
}

/* Rewrites a one-shard version 2 dataset as kpl wrote version 1 (before
 * METADATA had a checksum): headers say 1, METADATA has version 1 and no
 * metadata_crc32c, the whole-file CRCs follow. */
static void downgrade_to_v1(const char *dir)
{
    char f[2][400], meta[400];
    uint32_t crc[2];
    snprintf(f[0], sizeof f[0], "%s/00000.data", dir);
    snprintf(f[1], sizeof f[1], "%s/00000.index", dir);
    for (int k = 0; k < 2; k++) {
        char *b = NULL;
        size_t n = 0;
        OK(kpl__read_file(f[k], &b, &n));
        assert_int_equal(kpl__rd32(b + 8), 2);
        kpl__wr32(b + 8, 1);
        kpl__wr32(b + 28, kpl_crc32c(0, b, 28));
        if (k == 1) kpl__wr32(b + n - 4, kpl_crc32c(0, b, n - 4));
        crc[k] = kpl_crc32c(0, b, n);
        write_bytes(f[k], b, n);
        free(b);
    }
    snprintf(meta, sizeof meta, "%s/METADATA", dir);
    json_t *m = json_load_file(meta, 0, NULL);
    assert_non_null(m);
    assert_int_equal(json_object_del(m, KPLR_METADATA_CRC_KEY), 0);
    json_object_set_new(m, "version", json_integer(1));
    json_t *sh = json_array_get(json_object_get(m, "shards"), 0);
    json_object_set_new(sh, "data_crc32c", json_integer(crc[0]));
    json_object_set_new(sh, "index_crc32c", json_integer(crc[1]));
    assert_int_equal(json_dump_file(m, meta, JSON_INDENT(2) | JSON_PRESERVE_ORDER), 0);
    json_decref(m);
}

/* METADATA's shapes are binding and METADATA is checksummed (version 2):
 * an edit that keeps the byte count ([14, 56, 1] for 28x28x1) is refused
 * by the checksum; one that changes it is caught at open from the index's
 * record sizes, or by the record parse (and so by verify), naming the file,
 * chunk, record, shape and byte count.  Version 1 sets still read. */
static void test_metadata_shapes_and_checksum(void **state)
{
    (void)state;
    char good[300], bad[300];
    snprintf(good, sizeof good, "%s", tmp_path("shape_good"));
    snprintf(bad, sizeof bad, "%s", tmp_path("shape_bad"));
    write_raw_set(good, 10, false);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(good, &ds));
    char *json = NULL;
    OK(kpl_dataset_describe(ds, &json));
    assert_non_null(strstr(json, "\"version\": 2"));
    free(json);
    kpl_dataset_close(ds);
    char meta[320], *text = NULL;
    snprintf(meta, sizeof meta, "%s/METADATA", good);
    OK(kpl__read_file(meta, &text, NULL));
    assert_non_null(strstr(text, "\"version\": 2,"));
    /* The last key, covering every byte before it. */
    char *key = strstr(text, ",\n  \"metadata_crc32c\": ");
    assert_non_null(key);
    unsigned stored = 0;
    assert_int_equal(sscanf(key + 22, "%u", &stored), 1);
    assert_int_equal(stored, kpl_crc32c(0, text, (size_t)(key - text) + 4));
    assert_string_equal(strchr(key + 22, '\n'), "\n}\n");
    free(text);

    /* Same byte count: only the checksum can tell. */
    copy_set(good, bad);
    edit_metadata_as(bad, NULL, "28,\n        28,", "14,\n        56,", false);
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "METADATA checksum mismatch");
    FAILS(kpl_dataset_verify(bad, NULL, NULL, NULL), KPL_EFORMAT, "the file was changed");
    copy_set(good, bad); /* any edit, even a harmless one */
    edit_metadata_as(bad, NULL, "\"zstd_level\": 3", "\"zstd_level\": 3 ", false);
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "METADATA checksum mismatch");

    /* A larger shape: 28x28x3 needs 2352 of a record's 800 bytes (4 + 784
     * + 4 + 8): caught at open from the index. */
    copy_set(good, bad);
    edit_metadata(bad, NULL, "28,\n        1\n", "28,\n        3\n");
    char want[700];
    snprintf(want, sizeof want, "%s/00000.data chunk 0 record 0 (example 0): a 800-byte body, but "
             "METADATA's shapes ('image' [28, 28, 3] = 2352 bytes) make every body at least "
             "2360 bytes", bad);
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, want);
    /* A smaller one, 14x28x1 = 392 bytes, fits the open check (the label's
     * count is free) but not the record parse: reads and verify name it. */
    copy_set(good, bad);
    edit_metadata(bad, NULL, "28,\n        28,", "14,\n        28,");
    OK(kpl_dataset_open(bad, &ds));
    kpl_chunk *c = NN(kpl_chunk_create());
    kpl_feature_value v[2];
    snprintf(want, sizeof want, "%s/00000.data chunk 0 (offset 32) record 0 (example 0): feature "
             "'image' has 784 bytes, but its shape [14, 28, 1] needs 392", bad);
    FAILS(kpl_dataset_read_example(ds, 3, c, v), KPL_EFORMAT, want);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    FAILS(kpl_dataset_verify(bad, NULL, NULL, NULL), KPL_EFORMAT, want);
    /* With every feature fixed, the open check is exact: 4 + 392 + 4 + 8. */
    write_raw_set(tmp_path("shape_fixed"), 4, true);
    copy_set(tmp_path("shape_fixed"), bad);
    edit_metadata(bad, NULL, "28,\n        28,", "14,\n        28,");
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "make every body 408 bytes");

    /* The writer refuses a value its shape does not fit. */
    kpl_feature_spec schema[1] = {{.name = "x", .type = KPL_FEATURE_FLOAT, .ndim = 2,
                                   .shape = {2, 3}}};
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(tmp_path("shape_writer"), 1, schema, &cfg, &w));
    float f[6] = {0};
    kpl_feature_value fv[1] = {{f, 5}};
    FAILS(kpl_record_writer_add(w, fv), KPL_EINVAL, "feature 'x': 5 values, its shape needs 6");
    fv[0].count = 6;
    OK(kpl_record_writer_add(w, fv));
    OK(kpl_record_writer_close(w));

    /* Version 1 (no checksum) still reads, and verifies. */
    copy_set(good, bad);
    downgrade_to_v1(bad);
    OK(kpl_dataset_open(bad, &ds));
    OK(kpl_dataset_describe(ds, &json));
    assert_non_null(strstr(json, "\"version\": 1"));
    free(json);
    c = NN(kpl_chunk_create());
    OK(kpl_dataset_read_example(ds, 9, c, v));
    assert_int_equal(((const uint8_t *)v[0].data)[5], 14);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    OK(kpl_dataset_verify(bad, NULL, NULL, NULL));
    /* ... and its shapes are binding too. */
    edit_metadata(bad, NULL, "28,\n        1\n", "28,\n        3\n");
    FAILS(kpl_dataset_open(bad, &ds), KPL_EFORMAT, "'image' [28, 28, 3] = 2352 bytes");
}

static void test_unfinished_writer_refused_and_abandon_cleans(void **state)
{
    (void)state;
    const char *dir = tmp_path("unfinished");
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 4, schema4, NULL, &w));
    example e;
    make_example(1, &e);
    kpl_feature_value v[4] = {{e.bytes, e.nbytes}, {e.ints, e.nints}, {e.floats, 5},
                              {e.str, (uint32_t)strlen(e.str)}};
    OK(kpl_record_writer_add(w, v));
    kpl_dataset *ds = NULL;
    /* While the writer runs (or after it crashed: faults_e2e.sh, cli_data.sh),
     * readers refuse. */
    FAILS(kpl_dataset_open(dir, &ds), KPL_EFORMAT, "is still being written");
    assert_non_null(strstr(kpl_last_error(), "pid"));
    /* Abandoning removes what it wrote, including the directory it made. */
    kpl_record_writer_destroy(w);
    assert_int_equal(access(dir, F_OK), -1);
    FAILS(kpl_dataset_open(dir, &ds), KPL_ENOTFOUND, "no such directory");

    /* A directory with files in it is not written over. */
    const char *busy = tmp_path("busy");
    mkdir(busy, 0777);
    char keep[300];
    snprintf(keep, sizeof keep, "%s/precious.txt", busy);
    FILE *f = fopen(keep, "w");
    fputs("keep me\n", f);
    fclose(f);
    FAILS(kpl_record_writer_create(busy, 4, schema4, NULL, &w), KPL_EINVAL, "precious.txt");
    assert_null(w);
    assert_int_equal(access(keep, F_OK), 0);
    /* And a directory without METADATA is not a dataset. */
    FAILS(kpl_dataset_open(busy, &ds), KPL_ENOTFOUND, "no METADATA");
}

static void test_writer_rejects_bad_schema_and_values(void **state)
{
    (void)state;
    kpl_record_writer *w = NULL;
    kpl_feature_spec bad[2] = {{.name = "a b", .type = KPL_FEATURE_BYTES},
                               {.name = "x", .type = KPL_FEATURE_INT64}};
    FAILS(kpl_record_writer_create(tmp_path("s1"), 2, bad, NULL, &w), KPL_EINVAL, "'a b'");
    strcpy(bad[0].name, "x");
    FAILS(kpl_record_writer_create(tmp_path("s1"), 2, bad, NULL, &w), KPL_EINVAL, "appears twice");
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    cfg.attributes_json = "[1, 2]";
    FAILS(kpl_record_writer_create(tmp_path("s1"), 1, bad, &cfg, &w), KPL_EINVAL, "JSON object");
    cfg.attributes_json = NULL;
    cfg.shards = 0;
    FAILS(kpl_record_writer_create(tmp_path("s1"), 1, bad, &cfg, &w), KPL_EINVAL, "shards = 0");
    OK(kpl_record_writer_create(tmp_path("s1"), 1, bad, NULL, &w));
    kpl_feature_value v = {NULL, 3};
    FAILS(kpl_record_writer_add(w, &v), KPL_EINVAL, "example 0, feature 'x'");
    kpl_record_writer_destroy(w);
}

/* ---- IDX import -------------------------------------------------------------------- */

static void write_idx(const char *file, bool gz, int ndim, const uint32_t *dims,
                      const uint8_t *data, size_t n, size_t extra)
{
    uint8_t h[16] = {0, 0, 8, (uint8_t)ndim};
    for (int d = 0; d < ndim; d++) {
        h[4 + 4 * d] = (uint8_t)(dims[d] >> 24);
        h[5 + 4 * d] = (uint8_t)(dims[d] >> 16);
        h[6 + 4 * d] = (uint8_t)(dims[d] >> 8);
        h[7 + 4 * d] = (uint8_t)dims[d];
    }
    gzFile f = gzopen(file, gz ? "wb" : "wbT");
    assert_non_null(f);
    gzwrite(f, h, 4 + 4 * (unsigned)ndim);
    gzwrite(f, data, (unsigned)n);
    for (size_t i = 0; i < extra; i++) gzputc(f, 0);
    gzclose(f);
}

static void test_idx_import(void **state)
{
    (void)state;
    enum { N = 37, H = 5, W = 3 };
    uint8_t img[N * H * W], lab[N];
    for (int i = 0; i < N * H * W; i++) img[i] = (uint8_t)(i * 13 + 1);
    for (int i = 0; i < N; i++) lab[i] = (uint8_t)((i * 7) % 10);
    uint32_t di[3] = {N, H, W}, dl[1] = {N};
    for (int gz = 0; gz < 2; gz++) {
        char im[300], lb[300], out[300];
        snprintf(im, sizeof im, "%s/x-images-idx3-ubyte%s", tmp_root, gz ? ".gz" : "");
        snprintf(lb, sizeof lb, "%s/x-labels-idx1-ubyte%s", tmp_root, gz ? ".gz" : "");
        snprintf(out, sizeof out, "%s/idx%d", tmp_root, gz);
        write_idx(im, gz, 3, di, img, sizeof img, 0);
        write_idx(lb, gz, 1, dl, lab, sizeof lab, 0);
        kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
        o.writer.chunk_bytes = 4096;
        int64_t n = 0;
        OK(kpl_convert_idx(im, lb, out, &o, &n));
        assert_int_equal(n, N);
        kpl_dataset *ds = NULL;
        OK(kpl_dataset_open(out, &ds));
        const kpl_feature_spec *f = kpl_dataset_feature(ds, 0);
        assert_string_equal(f->encoding, "raw");
        assert_int_equal(f->ndim, 3);
        assert_int_equal(f->shape[0], H);
        assert_int_equal(f->shape[1], W);
        assert_non_null(strstr(kpl_dataset_attributes(ds), "\"num_classes\":10"));
        kpl_chunk *c = NN(kpl_chunk_create());
        kpl_feature_value v[2];
        for (int64_t i = 0; i < N; i++) { /* one shard: dataset order = file order */
            OK(kpl_dataset_read_example(ds, i, c, v));
            assert_int_equal(v[0].count, H * W);
            assert_memory_equal(v[0].data, img + i * H * W, H * W);
            int64_t l;
            memcpy(&l, v[1].data, 8);
            assert_int_equal(l, lab[i]);
        }
        kpl_chunk_destroy(c);
        kpl_dataset_close(ds);
        OK(kpl_dataset_verify(out, NULL, NULL, NULL));
    }
    /* Bad inputs: counts that differ, trailing bytes, a wrong magic. */
    char im[300], lb[300];
    snprintf(im, sizeof im, "%s/b-images-idx3-ubyte", tmp_root);
    snprintf(lb, sizeof lb, "%s/b-labels-idx1-ubyte", tmp_root);
    uint32_t dl2[1] = {N - 1};
    write_idx(im, false, 3, di, img, sizeof img, 0);
    write_idx(lb, false, 1, dl2, lab, N - 1, 0);
    FAILS(kpl_convert_idx(im, lb, tmp_path("idxbad1"), NULL, NULL), KPL_EFORMAT,
          "holds 37 images but");
    assert_int_equal(access(tmp_path("idxbad1"), F_OK), -1); /* nothing left behind */
    write_idx(lb, false, 1, dl, lab, N, 5);
    FAILS(kpl_convert_idx(im, lb, tmp_path("idxbad2"), NULL, NULL), KPL_EFORMAT, "bytes after");
    assert_int_equal(access(tmp_path("idxbad2"), F_OK), -1);
    write_idx(im, false, 3, di, img, sizeof img - 10, 0);
    write_idx(lb, false, 1, dl, lab, N, 0);
    FAILS(kpl_convert_idx(im, lb, tmp_path("idxbad3"), NULL, NULL), KPL_EFORMAT,
          "file ends inside image 36");
    FAILS(kpl_convert_idx(lb, im, tmp_path("idxbad4"), NULL, NULL), KPL_EFORMAT,
          "1 dimensions, expected 3");
}

/* ---- LMDB import -------------------------------------------------------------------- */

static uint8_t *put_varint(uint8_t *p, uint64_t v)
{
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

/* A serialized Caffe Datum; floats unpacked (wire type 5) when !packed. */
static size_t make_datum(uint8_t *out, int c, int h, int w, const uint8_t *data, size_t n,
                         int label, bool encoded, const float *fl, int nfl, bool packed)
{
    uint8_t *p = out;
    *p++ = 1 << 3, p = put_varint(p, (uint64_t)c);
    *p++ = 2 << 3, p = put_varint(p, (uint64_t)h);
    *p++ = 3 << 3, p = put_varint(p, (uint64_t)w);
    *p++ = 4 << 3 | 2, p = put_varint(p, n);
    if (n) memcpy(p, data, n);
    p += n;
    *p++ = 5 << 3, p = put_varint(p, (uint64_t)label);
    if (nfl && packed) {
        *p++ = 6 << 3 | 2, p = put_varint(p, 4 * (uint64_t)nfl);
        memcpy(p, fl, 4 * (size_t)nfl);
        p += 4 * nfl;
    }
    for (int i = 0; i < nfl && !packed; i++) {
        *p++ = 6 << 3 | 5;
        memcpy(p, &fl[i], 4);
        p += 4;
    }
    if (encoded) *p++ = 7 << 3, *p++ = 1;
    return (size_t)(p - out);
}

static void lmdb_put_all(const char *dir, int n, bool encoded, bool packed)
{
    mkdir(dir, 0777);
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    assert_int_equal(mdb_env_create(&env), 0);
    assert_int_equal(mdb_env_set_mapsize(env, 64 << 20), 0);
    assert_int_equal(mdb_env_open(env, dir, 0, 0664), 0);
    assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_dbi_open(txn, NULL, 0, &dbi), 0);
    for (int i = 0; i < n; i++) {
        uint8_t pix[3 * 4 * 5], buf[256];
        for (int k = 0; k < 60; k++) pix[k] = (uint8_t)(i * 60 + k);
        if (encoded) pix[0] = 0xff, pix[1] = 0xd8, pix[2] = 0xff;
        float fl[2] = {(float)i, -0.5f * (float)i};
        size_t len = make_datum(buf, 3, 4, 5, pix, encoded ? 20 + (size_t)i : 60, i % 7, encoded,
                                fl, i % 2 ? 2 : 0, packed);
        char key[32];
        snprintf(key, sizeof key, "%08d_img%d", i, i);
        MDB_val k = {strlen(key), key}, v = {len, buf};
        assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
    }
    assert_int_equal(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
}

/* ---- the converters' records ---------------------------------------------------------- */

typedef struct {
    int before, after;
    char outs[4][300];
    int64_t examples[4];
} hook_log;

static kpl_status log_before(const char *out, void *ctx)
{
    hook_log *l = ctx;
    snprintf(l->outs[l->before++ & 3], sizeof l->outs[0], "%s", out);
    return KPL_OK;
}

static void log_after(const char *src, const char *out, const kpl_convert_result *r, double s,
                      void *ctx)
{
    (void)src, (void)out;
    hook_log *l = ctx;
    assert_true(s >= 0);
    l->examples[l->after++ & 3] = r->examples;
}

/* Every source kpl names has one complete record; a run of the idx record
 * over a directory writes each split between the hooks, and the split
 * lookup a recipe uses finds t10k for "test". */
static void test_converter_records(void **state)
{
    (void)state;
    int n = 0;
    for (int k = 1; kpl_convert_source_names[k]; k++) {
        const kpl_converter *c = kpl_converter_of((kpl_convert_source)k);
        assert_non_null(c);
        assert_int_equal(c->source, k);
        assert_string_equal(c->name, kpl_convert_source_names[k]);
        assert_true(c->ninputs == 1 || c->ninputs == 2);
        assert_non_null(c->inputs);
        assert_non_null(c->run);
        assert_non_null(c->split);
        assert_ptr_equal(kpl_converter_at(n), c);
        n++;
    }
    assert_int_equal(kpl_converter_count(), n);
    assert_null(kpl_converter_of(KPL_CONVERT_NONE));
    assert_null(kpl_converter_at(n));
    char names[200];
    kpl_converter_names(KPL_CONVERT_TAKES_SPLIT, names, sizeof names);
    assert_string_equal(names, "voc and voc-seg");
    kpl_converter_names(KPL_CONVERT_TAKES_DROP_EMPTY, names, sizeof names);
    assert_string_equal(names, "coco and voc");
    kpl_converter_names(KPL_CONVERT_TAKES_CLASSES, names, sizeof names);
    assert_string_equal(names, "masks");

    /* an IDX directory: train and t10k, each into OUT/<split> */
    enum { N = 11, H = 4, W = 2 };
    uint8_t img[N * H * W], lab[N];
    for (int i = 0; i < N * H * W; i++) img[i] = (uint8_t)(i * 5 + 3);
    for (int i = 0; i < N; i++) lab[i] = (uint8_t)(i % 10);
    char dir[300], p[400];
    snprintf(dir, sizeof dir, "%s/idxdir", tmp_root);
    assert_int_equal(mkdir(dir, 0777), 0);
    const char *prefix[2] = {"train", "t10k"};
    for (int k = 0; k < 2; k++) {
        uint32_t di[3] = {N - (uint32_t)k, H, W}, dl[1] = {N - (uint32_t)k};
        snprintf(p, sizeof p, "%s/%s-images-idx3-ubyte", dir, prefix[k]);
        write_idx(p, 0, 3, di, img, (size_t)(N - k) * H * W, 0);
        snprintf(p, sizeof p, "%s/%s-labels-idx1-ubyte", dir, prefix[k]);
        write_idx(p, 0, 1, dl, lab, (size_t)(N - k), 0);
    }
    const kpl_converter *idx = kpl_converter_of(KPL_CONVERT_IDX);
    kpl_convert_inputs in = {{dir, NULL}, NULL, NULL, NULL, NULL};
    assert_true(idx->out_holds_splits(&in));
    hook_log l = {0};
    kpl_convert_hooks h = {log_before, log_after, &l};
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    char out[300];
    snprintf(out, sizeof out, "%s/idxout", tmp_root);
    OK(idx->run(&in, out, &o, &h));
    assert_int_equal(l.before, 2);
    assert_int_equal(l.after, 2);
    snprintf(p, sizeof p, "%s/test", out); /* sorted: t10k, then train */
    assert_string_equal(l.outs[0], p);
    assert_int_equal(l.examples[0], N - 1);
    assert_int_equal(l.examples[1], N);
    /* --labels goes with a file, not a directory */
    in.labels = "x";
    assert_int_equal(idx->run(&in, out, &o, &h), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "--labels goes with an images file"));
    /* a recipe's split "test" of the directory: t10k */
    kpl_convert_result r = {0};
    snprintf(out, sizeof out, "%s/idxsplit", tmp_root);
    OK(idx->split(dir, "fm/test", "test", out, &o, &r));
    assert_int_equal(r.examples, N - 1);
    assert_int_equal(idx->split(dir, "fm/val", "val", out, &o, &r), KPL_ENOTFOUND);
    assert_non_null(strstr(kpl_last_error(), "no val-images-idx3-ubyte"));
}

static void test_lmdb_import(void **state)
{
    (void)state;
    for (int variant = 0; variant < 3; variant++) { /* raw+packed, raw+unpacked, encoded */
        bool encoded = variant == 2, packed = variant == 0;
        char src[300], out[300];
        snprintf(src, sizeof src, "%s/lmdb%d", tmp_root, variant);
        snprintf(out, sizeof out, "%s/lmdbout%d", tmp_root, variant);
        lmdb_put_all(src, 23, encoded, packed);
        int64_t n = 0;
        OK(kpl_convert_lmdb(src, out, NULL, &n));
        assert_int_equal(n, 23);
        kpl_dataset *ds = NULL;
        OK(kpl_dataset_open(out, &ds));
        assert_int_equal(kpl_dataset_num_features(ds), 4);
        const kpl_feature_spec *f = kpl_dataset_feature(ds, 0);
        assert_string_equal(f->encoding, encoded ? "jpeg" : "raw");
        assert_int_equal(f->ndim, encoded ? 0 : 3);
        if (!encoded) { /* H, W, C */
            assert_int_equal(f->shape[0], 4);
            assert_int_equal(f->shape[1], 5);
            assert_int_equal(f->shape[2], 3);
        }
        assert_non_null(strstr(kpl_dataset_attributes(ds), "\"num_classes\":7"));
        kpl_chunk *c = NN(kpl_chunk_create());
        kpl_feature_value v[4];
        for (int i = 0; i < 23; i++) { /* keys are zero-padded: key order = i */
            OK(kpl_dataset_read_example(ds, i, c, v));
            const uint8_t *img = v[0].data;
            if (encoded) {
                assert_int_equal(v[0].count, 20 + i);
                assert_int_equal(img[5], (uint8_t)(i * 60 + 5));
            } else { /* pixel (y, x, ch) = CHW source (ch, y, x) */
                assert_int_equal(v[0].count, 60);
                for (int y = 0; y < 4; y++)
                    for (int x = 0; x < 5; x++)
                        for (int ch = 0; ch < 3; ch++)
                            assert_int_equal(img[(y * 5 + x) * 3 + ch],
                                             (uint8_t)(i * 60 + ch * 20 + y * 5 + x));
            }
            int64_t l;
            memcpy(&l, v[1].data, 8);
            assert_int_equal(l, i % 7);
            char key[32];
            snprintf(key, sizeof key, "%08d_img%d", i, i);
            assert_int_equal(v[2].count, strlen(key));
            assert_memory_equal(v[2].data, key, strlen(key));
            assert_int_equal(v[3].count, i % 2 ? 2 : 0);
            if (i % 2) {
                float fl[2];
                memcpy(fl, v[3].data, 8);
                assert_true(fl[0] == (float)i && fl[1] == -0.5f * (float)i);
            }
        }
        kpl_chunk_destroy(c);
        kpl_dataset_close(ds);
        OK(kpl_dataset_verify(out, NULL, NULL, NULL));
    }
    /* A value that is not a Datum is named by its key; nothing is left. */
    char src[300];
    snprintf(src, sizeof src, "%s/lmdbbad", tmp_root);
    lmdb_put_all(src, 3, false, true);
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    assert_int_equal(mdb_env_create(&env), 0);
    assert_int_equal(mdb_env_open(env, src, 0, 0664), 0);
    assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_dbi_open(txn, NULL, 0, &dbi), 0);
    MDB_val k = {5, "zzbad"}, v = {4, "\x0a\x09" "ab"}; /* field 1 length 9 > 2 bytes left */
    assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    FAILS(kpl_convert_lmdb(src, tmp_path("lmdbbadout"), NULL, NULL), KPL_EFORMAT,
          "key 'zzbad': not a Caffe Datum");
    assert_int_equal(access(tmp_path("lmdbbadout"), F_OK), -1);
    FAILS(kpl_convert_lmdb(tmp_path("nothere"), tmp_path("x"), NULL, NULL), KPL_ENOTFOUND, "nothere");
}

/* A fresh LMDB at dir holding keys[i] -> vals[i] (lens[i] bytes). */
static void lmdb_put(const char *dir, int n, const char *const *keys, const uint8_t *const *vals,
                     const size_t *lens)
{
    mkdir(dir, 0777);
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    assert_int_equal(mdb_env_create(&env), 0);
    assert_int_equal(mdb_env_set_mapsize(env, 16 << 20), 0);
    assert_int_equal(mdb_env_open(env, dir, 0, 0664), 0);
    assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_dbi_open(txn, NULL, 0, &dbi), 0);
    for (int i = 0; i < n; i++) {
        MDB_val k = {strlen(keys[i]), (void *)keys[i]}, v = {lens[i], (void *)vals[i]};
        assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
    }
    assert_int_equal(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
}

/* Raw Datums of differing sizes convert with each record's (H, W, C) in
 * image_shape, and the transform takes each at its own size; an empty
 * Datum, a size product that wraps, and a mix of encoded and raw are
 * errors naming the key. */
static void test_lmdb_shapes_and_bad_datums(void **state)
{
    (void)state;
    /* Flat images: channel ch of datum i is 10 + 40 i + ch everywhere. */
    static const int dims[3][3] = {{3, 4, 5}, {1, 6, 2}, {3, 2, 3}}; /* C, H, W */
    uint8_t bufs[3][256];
    const uint8_t *vals[3];
    size_t lens[3];
    const char *keys[3] = {"a", "b", "c"};
    for (int i = 0; i < 3; i++) {
        int c = dims[i][0], h = dims[i][1], w = dims[i][2];
        uint8_t pix[60];
        for (int k = 0; k < c * h * w; k++) pix[k] = (uint8_t)(10 + 40 * i + k / (h * w));
        lens[i] = make_datum(bufs[i], c, h, w, pix, (size_t)(c * h * w), i, false, NULL, 0, true);
        vals[i] = bufs[i];
    }
    char src[300], out[320];
    snprintf(src, sizeof src, "%s", tmp_path("lmdb_shapes"));
    snprintf(out, sizeof out, "%s", tmp_path("lmdb_shapes_out"));
    lmdb_put(src, 3, keys, vals, lens);
    int64_t n = 0;
    OK(kpl_convert_lmdb(src, out, NULL, &n));
    assert_int_equal(n, 3);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(out, &ds));
    assert_int_equal(kpl_dataset_num_features(ds), 4);
    const kpl_feature_spec *f = kpl_dataset_feature(ds, 0);
    assert_string_equal(f->encoding, "raw");
    assert_int_equal(f->ndim, 0);
    f = kpl_dataset_feature(ds, 3);
    assert_string_equal(f->name, "image_shape");
    assert_int_equal(f->type, KPL_FEATURE_INT64);
    assert_non_null(strstr(kpl_dataset_attributes(ds), "\"image_size\":\"per record\""));
    kpl_chunk *ch = NN(kpl_chunk_create());
    kpl_feature_value v[4];
    for (int i = 0; i < 3; i++) {
        OK(kpl_dataset_read_example(ds, i, ch, v));
        int64_t shape[3];
        assert_int_equal(v[3].count, 3);
        memcpy(shape, v[3].data, sizeof shape);
        assert_int_equal(shape[0], dims[i][1]);
        assert_int_equal(shape[1], dims[i][2]);
        assert_int_equal(shape[2], dims[i][0]);
        assert_int_equal(v[0].count, dims[i][0] * dims[i][1] * dims[i][2]);
        /* H x W x C: the channel index moves fastest. */
        const uint8_t *img = v[0].data;
        assert_int_equal(img[v[0].count - 1], 10 + 40 * i + dims[i][0] - 1);
    }
    /* Each at its own size into one 4 x 4 RGB output: flat stays flat,
     * gray is replicated, the stored channel order is kept. */
    kpl_transform_config cfg = KPL_TRANSFORM_CONFIG_INIT;
    cfg.out_h = cfg.out_w = 4;
    cfg.out_dtype = KPL_U8;
    kpl__xform x;
    OK(kpl__xform_init(&x, &cfg, ds));
    kpl__xform_scratch *s = NN(kpl__xform_scratch_create());
    for (int i = 0; i < 3; i++) {
        OK(kpl_dataset_read_example(ds, i, ch, v));
        uint8_t o[3 * 16];
        int64_t label = -1;
        kpl__sample_out so = {.image = o, .label = &label};
        OK(kpl__xform_sample(&x, v, 1, 0, i, s, &so));
        assert_int_equal(label, i);
        for (int c = 0; c < 3; c++)
            for (int k = 0; k < 16; k++)
                assert_int_equal(o[c * 16 + k], 10 + 40 * i + (dims[i][0] == 3 ? c : 0));
    }
    /* A record whose image_shape disagrees with its bytes is a bad sample. */
    OK(kpl_dataset_read_example(ds, 0, ch, v));
    int64_t lie[3] = {5, 4, 1};
    v[3].data = lie;
    uint8_t o[3 * 16];
    kpl__sample_out so = {.image = o};
    FAILS(kpl__xform_sample(&x, v, 1, 0, 0, s, &so), KPL_EFORMAT, "raw image of 60 bytes");
    kpl__xform_scratch_destroy(s);
    kpl_chunk_destroy(ch);
    kpl_dataset_close(ds);

    /* The errors, each naming the key. */
    uint8_t empty[64], wrap[64], enc[64];
    static const uint8_t jpeg_start[3] = {0xff, 0xd8, 0xff};
    size_t le = make_datum(empty, 0, 0, 0, NULL, 0, 1, false, NULL, 0, true);
    /* channels 2^21, height 2^21, width 2^22: the product wraps to 0 */
    static const uint8_t wrap_bytes[19] = {0x08, 0x80, 0x80, 0x80, 0x01, 0x10, 0x80, 0x80, 0x80,
                                           0x01, 0x18, 0x80, 0x80, 0x80, 0x02, 0x22, 0x00, 0x28,
                                           0x00};
    memcpy(wrap, wrap_bytes, sizeof wrap_bytes);
    size_t lj = make_datum(enc, 0, 0, 0, jpeg_start, 3, 1, true, NULL, 0, true);
    const struct {
        const char *name, *key, *want;
        const uint8_t *val;
        size_t len;
    } bad[3] = {
        {"lmdb_empty", "a_empty", "key 'a_empty': an empty raw image (channels x height x width "
                                  "= 0 x 0 x 0, no data bytes)", empty, le},
        {"lmdb_wrap", "a_wrap", "key 'a_wrap': not a Caffe Datum (raw data length differs from "
                                "channels x height x width)", wrap, sizeof wrap_bytes},
        {"lmdb_mixed", "zz_encoded", "mixes encoded Datums (the first: key 'zz_encoded') and raw "
                                     "ones (the first: key 'a')", enc, lj},
    };
    for (int k = 0; k < 3; k++) {
        const char *ks[2] = {keys[0], bad[k].key};
        const uint8_t *vs[2] = {vals[0], bad[k].val};
        size_t ls[2] = {lens[0], bad[k].len};
        snprintf(src, sizeof src, "%s", tmp_path(bad[k].name));
        snprintf(out, sizeof out, "%s_out", src);
        lmdb_put(src, 2, ks, vs, ls);
        FAILS(kpl_convert_lmdb(src, out, NULL, NULL), KPL_EFORMAT, bad[k].want);
        assert_int_equal(access(out, F_OK), -1);
    }
}

/* ---- image folder import ------------------------------------------------------------- */

/* The "path" feature of every example, in dataset order, joined by '\n'. */
static char *paths_of(const char *dir)
{
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(dir, &ds));
    size_t cap = 1 << 16, len = 0;
    char *out = calloc(1, cap);
    kpl_chunk *c = NN(kpl_chunk_create());
    kpl_feature_value v[3];
    for (int64_t i = 0; i < kpl_dataset_num_examples(ds); i++) {
        OK(kpl_dataset_read_example(ds, i, c, v));
        len += (size_t)snprintf(out + len, cap - len, "%.*s\n", (int)v[2].count,
                                (const char *)v[2].data);
    }
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    return out;
}

static void test_imagefolder_import(void **state)
{
    (void)state;
    char root[300]; /* tmp_path() reuses its buffers */
    snprintf(root, sizeof root, "%s", tmp_path("folder"));
    static const char *cls[3] = {"cat", "ant", "dog"}; /* sorted: ant 0, cat 1, dog 2 */
    char p[400];
    mkdir(root, 0777);
    int nimg = 0;
    unsigned char *jpgs[12];
    unsigned long lens[12];
    for (int c = 0; c < 3; c++) {
        snprintf(p, sizeof p, "%s/%s", root, cls[c]);
        mkdir(p, 0777);
        for (int i = 0; i < 4; i++, nimg++) {
            jpgs[nimg] = make_jpeg(16 + i, 8 + c, nimg + 1, &lens[nimg]);
            snprintf(p, sizeof p, "%s/%s/img%d.%s", root, cls[c], i, i == 3 ? "JPEG" : "jpg");
            write_bytes(p, jpgs[nimg], lens[nimg]);
        }
        snprintf(p, sizeof p, "%s/%s/notes.txt", root, cls[c]); /* ignored */
        write_bytes(p, "x", 1);
        snprintf(p, sizeof p, "%s/%s/.hidden.jpg", root, cls[c]); /* ignored */
        write_bytes(p, "x", 1);
    }
    snprintf(p, sizeof p, "%s/README", root); /* a file at the root: not a class */
    write_bytes(p, "x", 1);

    const char *out1 = tmp_path("folder_out1"), *out2 = tmp_path("folder_out2"), *out3 = tmp_path("folder_out3");
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.seed = 5;
    o.threads = 1;
    int64_t n = 0, skipped = -1;
    OK(kpl_convert_imagefolder(root, out1, &o, &n, &skipped));
    assert_int_equal(n, 12);
    assert_int_equal(skipped, 0);
    o.threads = 2;
    OK(kpl_convert_imagefolder(root, out2, &o, NULL, NULL));
    o.keep_order = true;
    OK(kpl_convert_imagefolder(root, out3, &o, NULL, NULL));
    char *a = paths_of(out1), *b = paths_of(out2), *k = paths_of(out3);
    assert_string_equal(a, b); /* the thread count changes nothing */
    assert_string_equal(k, "ant/img0.jpg\nant/img1.jpg\nant/img2.jpg\nant/img3.JPEG\n"
                           "cat/img0.jpg\ncat/img1.jpg\ncat/img2.jpg\ncat/img3.JPEG\n"
                           "dog/img0.jpg\ndog/img1.jpg\ndog/img2.jpg\ndog/img3.JPEG\n");
    assert_string_not_equal(a, k); /* shuffled by default */
    free(a);
    free(b);
    free(k);

    /* Bytes identical to the files; labels from the sorted class order. */
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(out1, &ds));
    assert_string_equal(kpl_dataset_feature(ds, 0)->encoding, "jpeg");
    assert_non_null(strstr(kpl_dataset_attributes(ds), "\"num_classes\":3"));
    kpl_chunk *c = NN(kpl_chunk_create());
    kpl_feature_value v[3];
    for (int64_t i = 0; i < 12; i++) {
        OK(kpl_dataset_read_example(ds, i, c, v));
        char rel[64];
        snprintf(rel, sizeof rel, "%.*s", (int)v[2].count, (const char *)v[2].data);
        int ci = rel[0] == 'c' ? 0 : rel[0] == 'a' ? 1 : 2; /* index into cls[] */
        int64_t label;
        memcpy(&label, v[1].data, 8);
        assert_int_equal(label, rel[0] == 'a' ? 0 : rel[0] == 'c' ? 1 : 2);
        int fi = -1;
        assert_int_equal(sscanf(strchr(rel, '/'), "/img%d", &fi), 1);
        int img = ci * 4 + fi;
        assert_int_equal(v[0].count, lens[img]);
        assert_memory_equal(v[0].data, jpgs[img], lens[img]);
    }
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    char *classes = NULL;
    snprintf(p, sizeof p, "%s/classes.txt", out1);
    OK(kpl__read_file(p, &classes, NULL));
    assert_string_equal(classes, "ant\ncat\ndog\n");
    free(classes);
    /* --max-side: every image (16..19 x 8..10) re-encoded with its longer
     * side at 12 and its aspect kept; a limit above every side keeps the
     * bytes. */
    for (int pass = 0; pass < 2; pass++) {
        o = (kpl_convert_options)KPL_CONVERT_OPTIONS_INIT;
        o.keep_order = true;
        o.max_side = pass ? 100 : 12;
        const char *out = tmp_path(pass ? "folder_max100" : "folder_max12");
        OK(kpl_convert_imagefolder(root, out, &o, NULL, NULL));
        OK(kpl_dataset_open(out, &ds));
        assert_non_null(strstr(kpl_dataset_attributes(ds), pass ? "\"max_side\":100" :
                                                                  "\"max_side\":12"));
        c = NN(kpl_chunk_create());
        tjhandle tj = tjInitDecompress();
        for (int64_t i = 0; i < 12; i++) {
            OK(kpl_dataset_read_example(ds, i, c, v));
            int img = (int)(i / 4 == 0 ? 4 : i / 4 == 1 ? 0 : 8) + (int)(i % 4); /* ant cat dog */
            int w0 = 16 + (int)(i % 4), h0 = 8 + img / 4, w, h, sub, cs;
            assert_int_equal(tjDecompressHeader3(tj, v[0].data, v[0].count, &w, &h, &sub, &cs), 0);
            if (pass) {
                assert_int_equal(v[0].count, lens[img]);
                assert_memory_equal(v[0].data, jpgs[img], lens[img]);
            } else {
                assert_int_equal(w, 12);
                assert_int_equal(h, (int)((double)h0 * 12 / w0 + 0.5));
            }
        }
        tjDestroy(tj);
        kpl_chunk_destroy(c);
        kpl_dataset_close(ds);
    }
    o = (kpl_convert_options)KPL_CONVERT_OPTIONS_INIT;
    o.quality = 0;
    FAILS(kpl_convert_imagefolder(root, tmp_path("folder_q0"), &o, NULL, NULL), KPL_EINVAL,
          "quality 0");
    for (int i = 0; i < 12; i++) tjFree(jpgs[i]);

    /* A corrupt image: an error naming it, or skipped and counted. */
    snprintf(p, sizeof p, "%s/dog/broken.jpg", root);
    write_bytes(p, "\xff\xd8\xff\xe0garbage", 11);
    FAILS(kpl_convert_imagefolder(root, tmp_path("folder_bad"), NULL, NULL, NULL), KPL_EFORMAT,
          "dog/broken.jpg: undecodable: JPEG");
    assert_int_equal(access(tmp_path("folder_bad"), F_OK), -1);
    snprintf(p, sizeof p, "%s/dog/text.png", root);
    write_bytes(p, "hello", 5);
    o = (kpl_convert_options)KPL_CONVERT_OPTIONS_INIT;
    o.skip_bad = true;
    OK(kpl_convert_imagefolder(root, tmp_path("folder_skip"), &o, &n, &skipped));
    assert_int_equal(n, 12);
    assert_int_equal(skipped, 2);
    FAILS(kpl_convert_imagefolder(tmp_path("nofolder"), tmp_path("x"), NULL, NULL, NULL), KPL_ENOTFOUND,
          "nofolder");
}

/* Offset of a JPEG's SOF marker (FF C0..C2), found by walking the
 * segments from SOI. */
static size_t sof_at(const unsigned char *j, size_t n)
{
    size_t at = 2;
    while (at + 4 < n && j[at] == 0xff && !(j[at + 1] >= 0xc0 && j[at + 1] <= 0xc2))
        at += 2 + ((size_t)j[at + 2] << 8 | j[at + 3]);
    assert_true(at + 10 < n && j[at] == 0xff);
    return at;
}

/* Damaged images the loader cannot decode, though their headers parse:
 * each is an error naming the file, or skipped (and counted) with
 * skip_bad; a bad file never costs the good ones after it. */
enum { BAD_SOF7, BAD_TRUNCATED, BAD_NO_EOI, BAD_PNG_CRC, BAD_HUGE_JPEG, BAD_HUGE_PNG, NBAD };
static const char *const bad_name[NBAD] = {"sof7.jpg", "truncated.jpg", "noeoi.jpg",
                                           "crc.png", "huge.jpg", "huge.png"};
static const char *const bad_why[NBAD] = {"JPEG: Bogus marker length", "Premature end of JPEG file",
                                          "Premature end of JPEG file", "CRC error",
                                          "too large", "too large"};

static void write_bad(const char *file, int kind)
{
    unsigned long jl;
    unsigned char *j = make_jpeg(64, 48, 3, &jl);
    size_t at = sof_at(j, jl), pl;
    unsigned char *png = make_png(40, 30, 5, &pl);
    switch (kind) {
    case BAD_SOF7: /* the SOF's component count: 7 (the review's file) */
        j[at + 9] = 7;
        write_bytes(file, j, jl);
        break;
    case BAD_TRUNCATED: /* cut inside the entropy-coded data */
        write_bytes(file, j, jl * 6 / 10);
        break;
    case BAD_NO_EOI: /* every scan byte, but no FF D9 */
        assert_true(j[jl - 2] == 0xff && j[jl - 1] == 0xd9);
        write_bytes(file, j, jl - 2);
        break;
    case BAD_PNG_CRC: { /* the IDAT chunk's CRC, one byte off */
        size_t c = 8;
        while (memcmp(png + c + 4, "IDAT", 4)) c += 12 + __builtin_bswap32(kpl__rd32(png + c));
        png[c + 8 + __builtin_bswap32(kpl__rd32(png + c)) + 1] ^= 0x55;
        write_bytes(file, png, pl);
        break;
    }
    case BAD_HUGE_JPEG: /* the frame header claims 20000 x 20000 */
        j[at + 5] = j[at + 7] = 20000 >> 8;
        j[at + 6] = j[at + 8] = 20000 & 0xff;
        write_bytes(file, j, jl);
        break;
    case BAD_HUGE_PNG: { /* IHDR claims 20000 x 20000, with its CRC fixed */
        uint32_t big = __builtin_bswap32(20000), crc;
        memcpy(png + 16, &big, 4);
        memcpy(png + 20, &big, 4);
        crc = __builtin_bswap32((uint32_t)crc32(0, png + 12, 17));
        memcpy(png + 29, &crc, 4);
        write_bytes(file, png, pl);
        break;
    }
    }
    free(png);
    tjFree(j);
}

static void test_imagefolder_bad_images(void **state)
{
    (void)state;
    char root[300], p[400];
    /* good, bad, good, good in one folder, on one thread and on two. */
    snprintf(root, sizeof root, "%s", tmp_path("seq"));
    mkdir(root, 0777);
    snprintf(p, sizeof p, "%s/c", root);
    mkdir(p, 0777);
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/c/%c.jpg", root, 'a' + i);
        if (i == 1) {
            write_bad(p, BAD_SOF7);
            continue;
        }
        unsigned long jl;
        unsigned char *j = make_jpeg(40 + i, 30, i + 1, &jl);
        write_bytes(p, j, jl);
        tjFree(j);
    }
    for (int threads = 1; threads <= 2; threads++) {
        kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
        o.keep_order = o.skip_bad = true;
        o.threads = threads;
        int64_t n = 0, skipped = 0;
        const char *out = tmp_path(threads == 1 ? "seq_out1" : "seq_out2");
        OK(kpl_convert_imagefolder(root, out, &o, &n, &skipped));
        assert_int_equal(n, 3);
        assert_int_equal(skipped, 1);
        char *paths = paths_of(out);
        assert_string_equal(paths, "c/a.jpg\nc/c.jpg\nc/d.jpg\n");
        free(paths);
    }

    /* Each kind of damage on its own: an error naming the file and what is
     * wrong, nothing written; with skip_bad, the good image alone. */
    for (int kind = 0; kind < NBAD; kind++) {
        char dir[64];
        snprintf(dir, sizeof dir, "bad%d", kind);
        snprintf(root, sizeof root, "%s", tmp_path(dir));
        mkdir(root, 0777);
        snprintf(p, sizeof p, "%s/k", root);
        mkdir(p, 0777);
        snprintf(p, sizeof p, "%s/k/%s", root, bad_name[kind]);
        write_bad(p, kind);
        unsigned long jl;
        unsigned char *j = make_jpeg(40, 30, 9, &jl);
        snprintf(p, sizeof p, "%s/k/zgood.jpg", root);
        write_bytes(p, j, jl);
        tjFree(j);
        char out[320], want[128];
        snprintf(out, sizeof out, "%s_out", root);
        snprintf(want, sizeof want, "k/%s: undecodable", bad_name[kind]);
        FAILS(kpl_convert_imagefolder(root, out, NULL, NULL, NULL), KPL_EFORMAT, want);
        if (!strstr(kpl_last_error(), bad_why[kind]))
            fail_msg("%s: '%s' lacks '%s'", bad_name[kind], kpl_last_error(), bad_why[kind]);
        assert_int_equal(access(out, F_OK), -1);
        kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
        o.skip_bad = true;
        int64_t n = 0, skipped = 0;
        OK(kpl_convert_imagefolder(root, out, &o, &n, &skipped));
        assert_int_equal(n, 1);
        assert_int_equal(skipped, 1);
    }

    /* Stray bytes before the EOI marker (some cameras write them; the
     * pixels are whole, and the loader never reads that far) are fine. */
    snprintf(root, sizeof root, "%s", tmp_path("junk"));
    mkdir(root, 0777);
    snprintf(p, sizeof p, "%s/k", root);
    mkdir(p, 0777);
    unsigned long jl;
    unsigned char *j = make_jpeg(64, 48, 4, &jl);
    unsigned char *jj = malloc(jl + 100);
    memcpy(jj, j, jl - 2);
    memset(jj + jl - 2, 0x5a, 100);
    memcpy(jj + jl + 98, "\xff\xd9", 2);
    snprintf(p, sizeof p, "%s/k/junk.jpg", root);
    write_bytes(p, jj, jl + 100);
    int64_t n = 0, skipped = -1;
    OK(kpl_convert_imagefolder(root, tmp_path("junk_out"), NULL, &n, &skipped));
    assert_int_equal(n, 1);
    assert_int_equal(skipped, 0);
    free(jj);
    tjFree(j);
}

/* --max-side re-encodes an EXIF-rotated JPEG upright: the new file has the
 * turned size and no Exif segment (its pixels need no tag); below the
 * limit the original bytes, tag included, are kept. */
static void test_imagefolder_exif_max_side(void **state)
{
    (void)state;
    unsigned long jl;
    unsigned char *j = make_jpeg(40, 20, 7, &jl);
    /* APP1: "Exif\0\0", little-endian TIFF, IFD0 = {Orientation = 6}. */
    static const uint8_t app1[] = {0xff, 0xe1, 0, 34, 'E', 'x', 'i', 'f', 0, 0,
                                   'I', 'I', 42, 0, 8, 0, 0, 0, 1, 0,
                                   0x12, 0x01, 3, 0, 1, 0, 0, 0, 6, 0, 0, 0,
                                   0, 0, 0, 0};
    size_t n = jl + sizeof app1;
    unsigned char *e = malloc(n);
    memcpy(e, j, 2);
    memcpy(e + 2, app1, sizeof app1);
    memcpy(e + 2 + sizeof app1, j + 2, jl - 2);
    char root[300], p[400];
    snprintf(root, sizeof root, "%s", tmp_path("exif"));
    mkdir(root, 0777);
    snprintf(p, sizeof p, "%s/k", root);
    mkdir(p, 0777);
    snprintf(p, sizeof p, "%s/k/rot6.jpg", root);
    write_bytes(p, e, n);
    for (int pass = 0; pass < 2; pass++) {
        kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
        o.max_side = pass ? 40 : 30; /* 20 x 40 upright: shrunk to 15 x 30, or kept */
        const char *out = tmp_path(pass ? "exif_keep" : "exif_30");
        OK(kpl_convert_imagefolder(root, out, &o, NULL, NULL));
        kpl_dataset *ds = NULL;
        OK(kpl_dataset_open(out, &ds));
        kpl_chunk *c = NN(kpl_chunk_create());
        kpl_feature_value v[3];
        OK(kpl_dataset_read_example(ds, 0, c, v));
        if (pass) {
            assert_int_equal(v[0].count, n);
            assert_memory_equal(v[0].data, e, n);
        } else {
            tjhandle tj = tjInitDecompress();
            int w, h, sub, cs;
            assert_int_equal(tjDecompressHeader3(tj, v[0].data, v[0].count, &w, &h, &sub, &cs), 0);
            tjDestroy(tj);
            assert_int_equal(w, 15);
            assert_int_equal(h, 30);
            const uint8_t *b = v[0].data;
            for (uint32_t i = 0; i + 6 < v[0].count; i++)
                assert_false(b[i] == 0xff && b[i + 1] == 0xe1); /* no APP1 */
        }
        kpl_chunk_destroy(c);
        kpl_dataset_close(ds);
    }
    free(e);
    tjFree(j);
}

/* Debian's Fashion-MNIST test split: 10,000 images, 1,000 of each class,
 * the first an ankle boot (9) and the second a pullover (2). */
static void test_fashion_mnist_import(void **state)
{
    (void)state;
    const char *im = "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz";
    const char *lb = "/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz";
    if (access(im, R_OK) || access(lb, R_OK))
        KPL_SKIP(KPL_TEST_SKIP_REF, "Fashion-MNIST (dataset-fashion-mnist)");
    const char *out = tmp_path("fmnist");
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.writer.shards = 2;
    OK(kpl_convert_idx(im, lb, out, &o, NULL));
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(out, &ds));
    assert_int_equal(kpl_dataset_num_examples(ds), 10000);
    int64_t hist[10] = {0};
    kpl_chunk *c = NN(kpl_chunk_create());
    kpl_feature_value v[2];
    for (int64_t k = 0; k < kpl_dataset_num_chunks(ds); k++) {
        OK(kpl_dataset_read_chunk(ds, k, c));
        for (int r = 0; r < kpl_chunk_num_records(c); r++) {
            OK(kpl_chunk_record(c, r, v));
            int64_t l;
            memcpy(&l, v[1].data, 8);
            assert_true(l >= 0 && l < 10);
            hist[l]++;
            assert_int_equal(v[0].count, 784);
        }
    }
    for (int i = 0; i < 10; i++) assert_int_equal(hist[i], 1000);
    /* Shard 0 starts with the file's first chunk. */
    OK(kpl_dataset_read_example(ds, 0, c, v));
    int64_t l0, l1;
    memcpy(&l0, v[1].data, 8);
    OK(kpl_dataset_read_example(ds, 1, c, v));
    memcpy(&l1, v[1].data, 8);
    assert_int_equal(l0, 9);
    assert_int_equal(l1, 2);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc32c_vectors),
        cmocka_unit_test(test_round_trip_one_shard_zstd),
        cmocka_unit_test(test_round_trip_shards_uncompressed),
        cmocka_unit_test(test_round_trip_more_shards_than_chunks),
        cmocka_unit_test(test_incompressible_chunks_stored_raw),
        cmocka_unit_test(test_flipped_byte_named),
        cmocka_unit_test(test_record_crc_names_record),
        cmocka_unit_test(test_truncated_and_extended_files),
        cmocka_unit_test(test_metadata_that_lies),
        cmocka_unit_test(test_metadata_shapes_and_checksum),
        cmocka_unit_test(test_unfinished_writer_refused_and_abandon_cleans),
        cmocka_unit_test(test_writer_rejects_bad_schema_and_values),
        cmocka_unit_test(test_idx_import),
        cmocka_unit_test(test_converter_records),
        cmocka_unit_test(test_lmdb_import),
        cmocka_unit_test(test_lmdb_shapes_and_bad_datums),
        cmocka_unit_test(test_imagefolder_import),
        cmocka_unit_test(test_imagefolder_bad_images),
        cmocka_unit_test(test_imagefolder_exif_max_side),
        cmocka_unit_test(test_fashion_mnist_import),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
