/*
 * gen_seeds.c — writes the binary seed corpora of the fuzz targets from
 * kpl's own writers, in each harness's input format:
 *   record/       KPLRecord datasets (kpl_record_writer): one and two
 *                 shards, stored and zstd chunks, several chunks, every
 *                 feature type, a raw feature with a shape, an unfinished one
 *   record_parse/ record bodies with their schemas
 *   checkpoint/   checkpoints (kpl_checkpoint_save), as files and as payloads
 *   model/        model files (kpl_model_save) of a small traced network,
 *                 fused at O3 and as traced, as files and as payloads
 *   lmdb/         Caffe Datums: raw, encoded, float_data packed and not
 * The image seeds come from gen_image_seeds.py, the text seeds (recipe,
 * hosts) are written by hand.  Built only in the fuzz build:
 *   build-fuzz/bin/gen_seeds tests/fuzz/corpus
 * The output differs from run to run (dataset uids, times): regenerate only
 * when a format changes.
 */
#include "fuzz_common.h"

#include <zstd.h>

#include "dataio_impl.h"
#include "trainer.h"

#define SEP "@KPL@"

static const char *out_root;
static char scratch[PATH_MAX];

#define CHECK(expr)                                                                          \
    do {                                                                                     \
        if ((expr) < 0) {                                                                    \
            fprintf(stderr, "gen_seeds: %s: %s\n", #expr, kpl_last_error());                 \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

/* ---- a growable byte buffer ---- */
typedef struct {
    uint8_t *p;
    size_t n, cap;
} buf;

static void put(buf *b, const void *p, size_t n)
{
    if (!n) return;
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}

static void put_file(buf *b, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(1);
    }
    uint8_t tmp[4096];
    size_t r;
    while ((r = fread(tmp, 1, sizeof tmp, f)) > 0) put(b, tmp, r);
    fclose(f);
}

static void emit(const char *target, const char *name, const buf *b)
{
    char dir[PATH_MAX], path[PATH_MAX];
    fuzz_path(dir, out_root, target);
    mkdir(dir, 0755);
    fuzz_path(path, dir, name);
    fuzz_write(path, b->p, b->n);
}

/* ---- record ---- */

/* The dataset at `dir` as fuzz_record's input, with the given flags. */
static void pack_dataset(const char *dir, int shards, uint8_t flags, const char *writing,
                         buf *b)
{
    char p[PATH_MAX];
    put(b, &flags, 1);
    fuzz_path(p, dir, "METADATA");
    put_file(b, p);
    for (int s = 0; s < shards; s++) {
        char name[32];
        snprintf(name, sizeof name, "%05d.index", s);
        fuzz_path(p, dir, name);
        put(b, SEP, strlen(SEP));
        put_file(b, p);
        snprintf(name, sizeof name, "%05d.data", s);
        fuzz_path(p, dir, name);
        put(b, SEP, strlen(SEP));
        put_file(b, p);
    }
    if (writing) {
        put(b, SEP, strlen(SEP));
        put(b, writing, strlen(writing));
    }
}

static void record_seed(const char *name, int nf, const kpl_feature_spec *schema, int shards,
                        size_t chunk_bytes, int zstd, int n,
                        void (*fill)(int i, kpl_feature_value *v, uint8_t *tmp))
{
    char dir[PATH_MAX];
    fuzz_path(dir, scratch, name);
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    cfg.shards = shards;
    cfg.chunk_bytes = chunk_bytes;
    cfg.zstd_level = zstd;
    cfg.attributes_json = "{\"source\":\"fuzz\",\"num_classes\":3}";
    kpl_record_writer *w = NULL;
    CHECK(kpl_record_writer_create(dir, nf, schema, &cfg, &w));
    for (int i = 0; i < n; i++) {
        kpl_feature_value v[8];
        uint8_t tmp[2048];
        fill(i, v, tmp);
        CHECK(kpl_record_writer_add(w, v));
    }
    CHECK(kpl_record_writer_close(w));
    const uint8_t flags[] = {0, 3};
    for (size_t k = 0; k < sizeof flags; k++) {
        buf b = {0};
        char fname[64];
        pack_dataset(dir, shards, flags[k], NULL, &b);
        snprintf(fname, sizeof fname, "%s-f%d", name, flags[k]);
        emit("record", fname, &b);
        free(b.p);
    }
}

static int64_t lab[64];
static float flt[64];

static void fill_img(int i, kpl_feature_value *v, uint8_t *tmp)
{
    /* bytes that look like the start of a JPEG, and a label */
    static const uint8_t jpg[] = {0xff, 0xd8, 0xff, 0xe0, 0, 16, 'J', 'F', 'I', 'F', 0};
    memcpy(tmp, jpg, sizeof jpg);
    tmp[sizeof jpg] = (uint8_t)i;
    lab[i % 64] = i % 3;
    v[0] = (kpl_feature_value){tmp, (uint32_t)(sizeof jpg + 1 + i % 5)};
    v[1] = (kpl_feature_value){&lab[i % 64], 1};
}

/* Two in a 4 KiB chunk. */
static void fill_big(int i, kpl_feature_value *v, uint8_t *tmp)
{
    fill_img(i, v, tmp);
    for (int k = 16; k < 1500; k++) tmp[k] = (uint8_t)(k * 31 + i * 7 + (k >> 3));
    v[0].count = 1500 + (uint32_t)i;
}

/* Compressible: four or five in a 4 KiB chunk. */
static void fill_all(int i, kpl_feature_value *v, uint8_t *tmp)
{
    for (int k = 0; k < 900; k++) tmp[k] = (uint8_t)(k % 7 + i);
    lab[i % 64] = -i;
    flt[i % 64] = 0.5f * (float)i;
    static const char *const words[] = {"cat", "dog", "", "a longer string value"};
    const char *s = words[i % 4];
    v[0] = (kpl_feature_value){tmp, (uint32_t)(i % 3 ? 900 : 0)};
    v[1] = (kpl_feature_value){&lab[i % 64], 1};
    v[2] = (kpl_feature_value){&flt[i % 64], (uint32_t)(i % 2)};
    v[3] = (kpl_feature_value){s, (uint32_t)strlen(s)};
}

static void fill_raw(int i, kpl_feature_value *v, uint8_t *tmp)
{
    for (int k = 0; k < 12; k++) tmp[k] = (uint8_t)(k + i);
    lab[i % 64] = i;
    v[0] = (kpl_feature_value){tmp, 12};
    v[1] = (kpl_feature_value){&lab[i % 64], 1};
}

static void record_seeds(void)
{
    kpl_feature_spec img[2] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "jpeg"},
        {.name = "label", .type = KPL_FEATURE_INT64},
    };
    kpl_feature_spec all[4] = {
        {.name = "bytes", .type = KPL_FEATURE_BYTES},
        {.name = "label", .type = KPL_FEATURE_INT64},
        {.name = "score", .type = KPL_FEATURE_FLOAT},
        {.name = "text", .type = KPL_FEATURE_STRING},
    };
    kpl_feature_spec raw[2] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {2, 2, 3}},
        {.name = "label", .type = KPL_FEATURE_INT64},
    };
    record_seed("stored-1shard", 2, img, 1, 1 << 20, 0, 3, fill_img);
    record_seed("stored-chunks", 2, img, 1, 4096, 0, 5, fill_big);
    record_seed("zstd-2shards", 4, all, 2, 4096, 19, 14, fill_all);
    record_seed("zstd-1chunk", 4, all, 1, 1 << 20, 3, 5, fill_all);
    record_seed("raw-shape", 2, raw, 1, 4096, 0, 4, fill_raw);
    record_seed("raw-3shards", 2, raw, 3, 4096, 0, 5, fill_raw);

    /* An unfinished dataset: a finished one plus the marker of a writer. */
    char dir[PATH_MAX];
    fuzz_path(dir, scratch, "stored-1shard");
    buf b = {0};
    pack_dataset(dir, 1, 7, "pid 4242 host nohost started 2026-11-23T10:00:00Z lock flock\n", &b);
    emit("record", "writing-f7", &b);
    free(b.p);
}

/* ---- record_parse ---- */

static void value(buf *b, uint32_t count, const void *p, size_t elem)
{
    put(b, &count, 4);
    put(b, p, count * elem);
}

static void record_parse_seeds(void)
{
    static const int64_t i64[2] = {7, -1};
    static const float f32[2] = {1.0f, 2.5f};
    buf b = {0};
    uint8_t head[3] = {1, 0x04}; /* two features: bytes, int64 */
    put(&b, head, 2);
    value(&b, 3, "abc", 1);
    value(&b, 1, i64, 8);
    emit("record_parse", "bytes-int64", &b);

    b.n = 0;
    head[1] = 0x0e; /* float, string */
    put(&b, head, 2);
    value(&b, 2, f32, 4);
    value(&b, 2, "hi", 1);
    emit("record_parse", "float-string", &b);

    b.n = 0;
    head[0] = 3, head[1] = 0xe4; /* bytes, int64, float, string: all empty */
    put(&b, head, 2);
    for (int f = 0; f < 4; f++) value(&b, 0, NULL, 1);
    emit("record_parse", "empty-4", &b);

    b.n = 0;
    head[0] = 7, head[1] = 0xe4, head[2] = 0x1b; /* eight features of every type */
    put(&b, head, 3);
    value(&b, 1, "x", 1);
    value(&b, 2, i64, 8);
    value(&b, 1, f32, 4);
    value(&b, 0, NULL, 1);
    value(&b, 2, "yz", 1);
    value(&b, 2, f32, 4);
    value(&b, 0, NULL, 8);
    value(&b, 1, "q", 1);
    emit("record_parse", "eight", &b);
    free(b.p);
}

/* ---- model ---- */

/* path's file and its decompressed payload as the two seeds of `target`. */
static void container_seeds(const char *target, const char *name, const char *path)
{
    buf file = {0};
    put_file(&file, path);
    buf b = {0};
    uint8_t mode = 0;
    put(&b, &mode, 1);
    put(&b, file.p, file.n);
    char fname[64];
    snprintf(fname, sizeof fname, "%s-file", name);
    emit(target, fname, &b);
    uint64_t raw;
    memcpy(&raw, file.p + 16, 8);
    uint8_t *payload = malloc(raw + 1);
    if (!payload) abort();
    size_t got = ZSTD_decompress(payload, raw, file.p + 40, file.n - 40);
    if (ZSTD_isError(got) || got != raw) abort();
    b.n = 0;
    mode = 1;
    put(&b, &mode, 1);
    put(&b, payload, raw);
    snprintf(fname, sizeof fname, "%s-payload", name);
    emit(target, fname, &b);
    free(payload);
    free(b.p);
    free(file.p);
}

static kpl_tensor *seed_tensor(int nd, const int64_t *shape, uint64_t seed, double lo)
{
    kpl_rng *r = kpl_rng_create(seed);
    kpl_tensor *t = NULL;
    CHECK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, nd, shape, &t));
    CHECK(kpl_k_uniform(t, r, lo, 1));
    kpl_rng_destroy(r);
    return t;
}

/* conv (+ bias), eval batch norm, relu, max pool, linear: traced. */
static void model_seed(const char *name, bool fused, int level)
{
    kpl_tensor *w = seed_tensor(4, (int64_t[]){4, 2, 3, 3}, 1, -1);
    kpl_tensor *b = seed_tensor(1, (int64_t[]){4}, 2, -1);
    kpl_tensor *mean = seed_tensor(1, (int64_t[]){4}, 3, -1), *var = seed_tensor(1, (int64_t[]){4}, 4, 0.5);
    kpl_tensor *g = seed_tensor(1, (int64_t[]){4}, 5, -1), *be = seed_tensor(1, (int64_t[]){4}, 6, -1);
    kpl_tensor *fw = seed_tensor(2, (int64_t[]){3, 16}, 7, -1), *fb = seed_tensor(1, (int64_t[]){3}, 8, -1);
    kpl_tensor *x = seed_tensor(4, (int64_t[]){1, 2, 6, 6}, 9, -1);
    kpl_pool *pool = kpl_pool_push();
    CHECK(kpl_trace_begin());
    kpl_conv2d_params cp = KPL_CONV2D_PARAMS_INIT;
    cp.padding[0] = cp.padding[1] = 1;
    kpl_pool2d_params pp = {{3, 3}, {3, 3}, {0, 0}, false, false};
    kpl_tensor *h = kpl_conv2d(kpl_trace_input(x, "image"), w, b, &cp);
    h = kpl_max_pool2d(kpl_relu(kpl_batch_norm(h, g, be, mean, var, false, 0.1, 1e-5)), &pp);
    h = kpl_linear(kpl_reshape(h, 2, (int64_t[]){1, 16}), fw, fb);
    kpl_ir *ir = NULL;
    CHECK(h ? kpl_trace_end(1, &h, (const char *[]){"logits"}, &ir) : kpl_last_status());
    const char *names[] = {"conv.weight", "conv.bias", "bn.running_mean", "bn.running_var",
                           "bn.weight", "bn.bias", "fc.weight", "fc.bias"};
    kpl_tensor *ts[] = {w, b, mean, var, g, be, fw, fb};
    kpl_ir_name_params(ir, 8, names, ts);
    CHECK(kpl_ir_optimize(ir, level, fused));
    char path[PATH_MAX];
    fuzz_path(path, scratch, name);
    CHECK(kpl_model_save(ir, "{\"task\":\"classification\",\"transform\":{\"crop\":\"none\","
                             "\"out_h\":6,\"out_w\":6,\"resize_shorter\":0,\"channels\":2,"
                             "\"out_dtype\":\"f32\",\"mean\":[0.5,0.5],\"std\":[0.25,0.25]}}",
                         path));
    container_seeds("model", name, path);
    if (!fused) { /* the same graph as ONNX: the import's seed */
        char onnx[PATH_MAX];
        fuzz_path(onnx, scratch, "m.onnx");
        CHECK(kpl_onnx_export(ir, onnx));
        buf b = {0};
        put(&b, (uint8_t[]){1}, 1); /* options: a prefix */
        put_file(&b, onnx);
        char seed[128];
        snprintf(seed, sizeof seed, "%s.onnx", name);
        emit("onnx", seed, &b);
        free(b.p);
    }
    kpl_ir_destroy(ir);
    kpl_pool_pop(pool);
    for (int i = 0; i < 8; i++) kpl_tensor_release(ts[i]);
    kpl_tensor_release(x);
}

/* ---- checkpoint ---- */

static void checkpoint_seed(const char *name, int ntensors)
{
    kpl_device *cpu = kpl_device_cpu();
    kpl_checkpoint *c = NULL;
    CHECK(kpl_checkpoint_create(&c));
    static const kpl_dtype dts[] = {KPL_F32, KPL_I64, KPL_U8, KPL_F16, KPL_BOOL, KPL_I32};
    for (int i = 0; i < ntensors; i++) {
        int64_t shape[3] = {2, 1 + i, 3};
        int nd = 1 + i % 3;
        kpl_tensor *t = NULL;
        CHECK(kpl_tensor_zeros(cpu, dts[i % 6], nd, shape, &t));
        uint8_t *p = kpl_tensor_host_mutable(t);
        for (size_t k = 0; k < kpl_tensor_nbytes(t); k++) p[k] = dts[i % 6] == KPL_BOOL ? k & 1 : (uint8_t)(k * 13);
        char tn[64];
        snprintf(tn, sizeof tn, "model.layer%d.weight", i);
        CHECK(kpl_checkpoint_add(c, tn, t));
        kpl_tensor_release(t); /* the checkpoint holds its own reference */
    }
    CHECK(kpl_checkpoint_set_meta(c, "{\"step\": 100, \"train\": {\"epoch\": 1, \"rng\": [[7, 0]]}}"));
    char path[PATH_MAX];
    fuzz_path(path, scratch, name);
    CHECK(kpl_checkpoint_save(c, path));
    kpl_checkpoint_destroy(c);
    container_seeds("checkpoint", name, path);
}

static void varint(buf *b, uint64_t v)
{
    do {
        uint8_t c = (uint8_t)(v & 0x7f);
        v >>= 7;
        if (v) c |= 0x80;
        put(b, &c, 1);
    } while (v);
}

static void field_varint(buf *b, int field, uint64_t v)
{
    varint(b, (uint64_t)field << 3);
    varint(b, v);
}

static void field_bytes(buf *b, int field, const void *p, size_t n)
{
    varint(b, (uint64_t)field << 3 | 2);
    varint(b, n);
    put(b, p, n);
}

static void datum_raw(buf *b, int c, int h, int w, int label)
{
    field_varint(b, 1, (uint64_t)c);
    field_varint(b, 2, (uint64_t)h);
    field_varint(b, 3, (uint64_t)w);
    uint8_t px[64];
    for (int i = 0; i < c * h * w; i++) px[i] = (uint8_t)(i * 5);
    field_bytes(b, 4, px, (size_t)(c * h * w));
    field_varint(b, 5, (uint64_t)label);
}

static void lmdb_seeds(void)
{
    buf b = {0};
    datum_raw(&b, 3, 2, 2, 1);
    emit("lmdb", "raw-3x2x2", &b);
    put(&b, SEP, strlen(SEP));
    datum_raw(&b, 3, 2, 2, 4);
    put(&b, SEP, strlen(SEP));
    datum_raw(&b, 3, 2, 2, 0);
    emit("lmdb", "raw-three", &b);

    b.n = 0;
    datum_raw(&b, 1, 4, 3, 2);
    float fl[3] = {0.5f, -1.0f, 2.0f};
    field_bytes(&b, 6, fl, sizeof fl); /* packed float_data */
    put(&b, SEP, strlen(SEP));
    datum_raw(&b, 1, 4, 3, 1);
    for (int i = 0; i < 2; i++) { /* unpacked: key 0x35 and 4 bytes each */
        uint8_t key = 6 << 3 | 5;
        put(&b, &key, 1);
        put(&b, &fl[i], 4);
    }
    emit("lmdb", "floats", &b);

    b.n = 0;
    static const uint8_t jpeg[] = {0xff, 0xd8, 0xff, 0xe0, 0, 16, 'J', 'F', 'I', 'F', 0, 1,
                                   1, 0, 0, 1, 0, 1, 0, 0, 0xff, 0xd9};
    field_varint(&b, 1, 3);
    field_varint(&b, 2, 0);
    field_varint(&b, 3, 0);
    field_bytes(&b, 4, jpeg, sizeof jpeg);
    field_varint(&b, 5, 7);
    field_varint(&b, 7, 1);
    put(&b, SEP, strlen(SEP));
    static const uint8_t png[] = {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a, 0, 0, 0, 13,
                                  'I', 'H', 'D', 'R'};
    field_bytes(&b, 4, png, sizeof png);
    field_varint(&b, 7, 1);
    field_varint(&b, 5, 2);
    emit("lmdb", "encoded", &b);

    b.n = 0; /* fixed64 and unknown fields are skipped */
    varint(&b, 9 << 3 | 1);
    put(&b, "12345678", 8);
    datum_raw(&b, 2, 1, 3, 9);
    field_bytes(&b, 11, "xyz", 3);
    emit("lmdb", "unknown-fields", &b);
    free(b.p);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_seeds CORPUS_DIR\n");
        return 2;
    }
    out_root = argv[1];
    mkdir(out_root, 0755);
    snprintf(scratch, sizeof scratch, "/tmp/kpl-gen-seeds-XXXXXX");
    if (!mkdtemp(scratch)) {
        perror("mkdtemp");
        return 1;
    }
    record_seeds();
    record_parse_seeds();
    checkpoint_seed("ckpt-small", 3);
    checkpoint_seed("ckpt-six", 6);
    checkpoint_seed("ckpt-empty", 0);
    model_seed("model-o3", true, 3);
    model_seed("model-traced", false, 0);
    lmdb_seeds();
    fuzz_rm_tree(scratch);
    return 0;
}
