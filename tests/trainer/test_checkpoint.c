/* test_checkpoint.c — checkpoints: tensors and metadata round trip bit for
 * bit; every flipped byte, truncation or extension is refused with the
 * file named; a checkpoint is listed as complete only with its marker;
 * removal and the best-link keep the marker discipline; restore checks
 * names, dtypes and shapes. */
#include "kpl_test.h"
#include "run_impl.h"

#include <jansson.h>
#include <stdlib.h>
#include <zstd.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[64];

static kpl_tensor *make(kpl_dtype dt, int nd, const int64_t *shape, uint64_t seed)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), dt, nd, shape, &t));
    uint8_t *p = kpl_tensor_host_mutable(t);
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < kpl_tensor_nbytes(t); i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p[i] = (uint8_t)x;
    }
    return t;
}

static bool exists(const char *p) { return access(p, F_OK) == 0; }

static void save_sample(const char *path, kpl_tensor **ts, int n)
{
    static const char *const names[] = {"model.a", "model.b", "optim.c", "scalar", "empty", "big"};
    kpl_checkpoint *c = NULL;
    OK(kpl_checkpoint_create(&c));
    for (int i = 0; i < n; i++) OK(kpl_checkpoint_add(c, names[i], ts[i]));
    OK(kpl_checkpoint_set_meta(c, "{\"train\": {\"step\": 42}, \"note\": \"h\\u00e9\"}"));
    OK(kpl_checkpoint_save(c, path));
    kpl_checkpoint_destroy(c);
}

static void test_round_trip(void **state)
{
    (void)state;
    int64_t s1[2] = {3, 4}, s2[1] = {5}, s4[2] = {0, 3}, s5[1] = {300000};
    kpl_tensor *ts[6] = {make(KPL_F32, 2, s1, 1), make(KPL_I64, 1, s2, 2), make(KPL_U8, 1, s2, 3),
                         make(KPL_F64, 0, NULL, 4), make(KPL_F32, 2, s4, 5),
                         make(KPL_F32, 1, s5, 6)};
    char path[128], done[160];
    snprintf(path, sizeof path, "%s/ckpt-0000000042.kpl", dir);
    snprintf(done, sizeof done, "%s.done", path);
    save_sample(path, ts, 6);
    assert_true(exists(path) && exists(done));
    char tmp[160];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    assert_false(exists(tmp));
    kpl_checkpoint *c = NULL;
    OK(kpl_checkpoint_load(path, &c));
    assert_int_equal(kpl_checkpoint_num_tensors(c), 6);
    for (int i = 0; i < 6; i++) {
        kpl_tensor *t = kpl_checkpoint_find(c, kpl_checkpoint_name(c, i));
        assert_non_null(t);
        assert_int_equal(kpl_tensor_dtype(t), kpl_tensor_dtype(ts[i]));
        assert_int_equal(kpl_tensor_ndim(t), kpl_tensor_ndim(ts[i]));
        for (int d = 0; d < kpl_tensor_ndim(t); d++)
            assert_int_equal(kpl_tensor_shape(t)[d], kpl_tensor_shape(ts[i])[d]);
        assert_int_equal(kpl_tensor_nbytes(t), kpl_tensor_nbytes(ts[i]));
        assert_memory_equal(kpl_tensor_host_data(t), kpl_tensor_host_data(ts[i]),
                            kpl_tensor_nbytes(t));
    }
    json_t *m = json_loads(kpl_checkpoint_meta(c), 0, NULL);
    assert_non_null(m);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(m, "train"), "step")), 42);
    assert_string_equal(json_string_value(json_object_get(m, "note")), "h\xc3\xa9");
    json_decref(m);
    /* restore: a copy into the caller's tensor, with every mismatch named */
    kpl_tensor *dst = make(KPL_F32, 2, s1, 9);
    OK(kpl_checkpoint_restore(c, "model.a", dst));
    assert_memory_equal(kpl_tensor_host_data(dst), kpl_tensor_host_data(ts[0]), 48);
    FAILS(kpl_checkpoint_restore(c, "model.zz", dst), KPL_ENOTFOUND, "has no tensor 'model.zz'");
    FAILS(kpl_checkpoint_restore(c, "model.b", dst), KPL_EDTYPE, "'model.b' is i64, the model's is f32");
    int64_t s1b[2] = {4, 3};
    kpl_tensor *wrong = make(KPL_F32, 2, s1b, 9);
    FAILS(kpl_checkpoint_restore(c, "model.a", wrong), KPL_ESHAPE,
          "'model.a' has shape (3,4), the model's has (4,3)");
    kpl_tensor_release(wrong);
    kpl_tensor_release(dst);
    /* tensors outlive the checkpoint object that loaded them */
    kpl_tensor *keep = kpl_checkpoint_find(c, "big");
    kpl_tensor_retain(keep);
    kpl_checkpoint_destroy(c);
    assert_memory_equal(kpl_tensor_host_data(keep), kpl_tensor_host_data(ts[5]), 1200000);
    kpl_tensor_release(keep);
    for (int i = 0; i < 6; i++) kpl_tensor_release(ts[i]);

    kpl_checkpoint *e = NULL;
    OK(kpl_checkpoint_create(&e));
    FAILS(kpl_checkpoint_set_meta(e, "[1]"), KPL_EINVAL, "must be a JSON object");
    FAILS(kpl_checkpoint_set_meta(e, "{"), KPL_EINVAL, "not JSON");
    kpl_tensor *t = make(KPL_F32, 1, s2, 1);
    OK(kpl_checkpoint_add(e, "x", t));
    FAILS(kpl_checkpoint_add(e, "x", t), KPL_EINVAL, "added twice");
    FAILS(kpl_checkpoint_save(e, "/nonexistent-dir/ckpt.kpl"), KPL_EIO,
          "/nonexistent-dir/ckpt.kpl.tmp: cannot create");
    kpl_tensor_release(t);
    kpl_checkpoint_destroy(e);
}

static void *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    rewind(f);
    void *b = malloc(*n);
    assert_int_equal(fread(b, 1, *n, f), *n);
    fclose(f);
    return b;
}

static void write_all(const char *path, const void *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, n, f), n);
    fclose(f);
}

/* Every byte flipped, every truncation, an extension: refused, naming the
 * file, never a crash. */
static void test_damage(void **state)
{
    (void)state;
    int64_t s1[2] = {7, 9}, s2[1] = {33};
    kpl_tensor *ts[2] = {make(KPL_F32, 2, s1, 1), make(KPL_I64, 1, s2, 2)};
    char path[128], bad[128];
    snprintf(path, sizeof path, "%s/ckpt-0000000001.kpl", dir);
    snprintf(bad, sizeof bad, "%s/bad.kpl", dir);
    save_sample(path, ts, 2);
    size_t n = 0;
    uint8_t *good = read_all(path, &n), *b = malloc(n + 16);
    for (size_t i = 0; i < n; i++) {
        memcpy(b, good, n);
        b[i] ^= (uint8_t)(1u << (i % 8));
        write_all(bad, b, n);
        kpl_checkpoint *c = NULL;
        kpl_clear_error();
        kpl_status st = kpl_checkpoint_load(bad, &c);
        if (st != KPL_EFORMAT || !strstr(kpl_last_error(), bad))
            fail_msg("byte %zu flipped: %s '%s'", i, kpl_status_str(st), kpl_last_error());
        assert_null(c);
    }
    for (size_t cut = 0; cut < n; cut += cut < 64 ? 1 : 13) {
        write_all(bad, good, cut);
        kpl_checkpoint *c = NULL;
        FAILS(kpl_checkpoint_load(bad, &c), KPL_EFORMAT, bad);
    }
    memcpy(b, good, n);
    memset(b + n, 0, 16);
    write_all(bad, b, n + 16);
    kpl_checkpoint *c = NULL;
    FAILS(kpl_checkpoint_load(bad, &c), KPL_EFORMAT, "truncated or extended");
    FAILS(kpl_checkpoint_load("/nonexistent.kpl", &c), KPL_ENOTFOUND, "/nonexistent.kpl");
    /* a header (checksum fixed up) that claims a huge payload: refused by
     * what the payload really holds, not by an allocation of the claim
     * (the fuzzer's header-claims-1tib) */
    uint64_t claims[2] = {(uint64_t)1 << 39, (uint64_t)n}; /* 512 GiB; a little more than real */
    for (int k = 0; k < 2; k++) {
        memcpy(b, good, n);
        memcpy(b + 16, &claims[k], 8);
        uint32_t hc = kpl_crc32c(0, b, 36);
        memcpy(b + 36, &hc, 4);
        write_all(bad, b, n);
        FAILS(kpl_checkpoint_load(bad, &c), KPL_EFORMAT, "payload decompresses to");
    }
    free(good);
    free(b);
    kpl_tensor_release(ts[0]);
    kpl_tensor_release(ts[1]);
}

/* A file in the checkpoint format around a hand-written tensor table. */
static void write_with_table(const char *path, const char *table, size_t data_bytes)
{
    size_t tl = strlen(table), raw_n = (8 + tl + 63) / 64 * 64 + data_bytes;
    uint8_t *raw = calloc(1, raw_n);
    uint64_t tl64 = tl;
    memcpy(raw, &tl64, 8);
    memcpy(raw + 8, table, tl);
    size_t cap = ZSTD_compressBound(raw_n);
    uint8_t *file = malloc(40 + cap);
    size_t z = ZSTD_compress(file + 40, cap, raw, raw_n, 3);
    assert_false(ZSTD_isError(z));
    uint32_t v = 1, flags = 1, crc = kpl_crc32c(0, file + 40, z);
    uint64_t r64 = raw_n, z64 = z;
    memcpy(file, "KPLCKPT\n", 8);
    memcpy(file + 8, &v, 4), memcpy(file + 12, &flags, 4);
    memcpy(file + 16, &r64, 8), memcpy(file + 24, &z64, 8), memcpy(file + 32, &crc, 4);
    uint32_t hc = kpl_crc32c(0, file, 36);
    memcpy(file + 36, &hc, 4);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(file, 1, 40 + z, f), 40 + z);
    fclose(f);
    free(file);
    free(raw);
}

/* A table whose byte count and shape disagree is named as such (not as a
 * tensor that does not fit the payload), and so is a shape that needs more
 * than the file holds. */
static void test_table(void **state)
{
    (void)state;
    char path[128];
    snprintf(path, sizeof path, "%s/table.kpl", dir);
    const char *fmt = "{\"format\":\"kpl-checkpoint\",\"version\":1,\"meta\":{},\"tensors\":"
                      "[{\"name\":\"w\",\"dtype\":\"f32\",\"shape\":%s,\"offset\":"
                      "\"00000000000000000192\",\"bytes\":%s}]}";
    char table[512];
    kpl_checkpoint *c = NULL;
    snprintf(table, sizeof table, fmt, "[3]", "12");
    write_with_table(path, table, 64);
    OK(kpl_checkpoint_load(path, &c));
    kpl_checkpoint_destroy(c);
    c = NULL;
    snprintf(table, sizeof table, fmt, "[3]", "8");
    write_with_table(path, table, 64);
    FAILS(kpl_checkpoint_load(path, &c), KPL_EFORMAT,
          "tensor 'w' is said to hold 8 bytes, but its shape (3) of f32 needs 12");
    snprintf(table, sizeof table, fmt, "[4611686018427387904]", "0");
    write_with_table(path, table, 64);
    FAILS(kpl_checkpoint_load(path, &c), KPL_EFORMAT, "more than the");
    assert_null(c);
}

/* Only checkpoints with a marker are listed; removal takes the marker
 * first; the best-link is a complete checkpoint of its own. */
static void test_markers(void **state)
{
    (void)state;
    char sub[96];
    snprintf(sub, sizeof sub, "%s/ck", dir);
    mkdir(sub, 0755);
    int64_t s1[1] = {10};
    kpl_tensor *t = make(KPL_F32, 1, s1, 3);
    int64_t steps[8];
    int count = -1;
    OK(kpl__checkpoint_list(sub, steps, 8, &count));
    assert_int_equal(count, 0);
    int64_t made[4] = {200, 5, 1000, 40};
    for (int i = 0; i < 4; i++) {
        char p[160];
        kpl__checkpoint_path(sub, made[i], p, sizeof p);
        save_sample(p, &t, 1);
    }
    char p5[160], p40[160], done[200];
    kpl__checkpoint_path(sub, 5, p5, sizeof p5);
    assert_non_null(strstr(p5, "/ck/ckpt-0000000005.kpl"));
    kpl__checkpoint_path(sub, 40, p40, sizeof p40);
    snprintf(done, sizeof done, "%s.done", p40);
    unlink(done); /* as if the save of step 40 had died before its marker */
    OK(kpl__checkpoint_list(sub, steps, 8, &count));
    assert_int_equal(count, 3);
    assert_int_equal(steps[0], 5);
    assert_int_equal(steps[1], 200);
    assert_int_equal(steps[2], 1000);
    OK(kpl__checkpoint_remove(p5));
    assert_false(exists(p5));
    OK(kpl__checkpoint_list(sub, steps, 8, &count));
    assert_int_equal(count, 2);
    /* saving over a name: the old marker goes first, the new one comes last */
    save_sample(p40, &t, 1);
    OK(kpl__checkpoint_list(sub, steps, 8, &count));
    assert_int_equal(count, 3);
    char best[160], p200[160];
    snprintf(best, sizeof best, "%s/best.kpl", sub);
    kpl__checkpoint_path(sub, 200, p200, sizeof p200);
    OK(kpl__checkpoint_link(p200, best));
    snprintf(done, sizeof done, "%s.done", best);
    assert_true(exists(best) && exists(done));
    OK(kpl__checkpoint_remove(p200)); /* the best one survives its source */
    kpl_checkpoint *c = NULL;
    OK(kpl_checkpoint_load(best, &c));
    assert_int_equal(kpl_checkpoint_num_tensors(c), 1);
    kpl_checkpoint_destroy(c);
    OK(kpl__checkpoint_list(sub, steps, 8, &count)); /* best.kpl is not a step */
    assert_int_equal(count, 2);
    kpl_tensor_release(t);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/kpl-ckpt-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_damage),
        cmocka_unit_test(test_table),
        cmocka_unit_test(test_markers),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0 && rc == 0) rc = 1;
    return rc;
}
