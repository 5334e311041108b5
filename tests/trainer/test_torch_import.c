/*
 * test_torch_import.c — kpl_torch_import against files PyTorch wrote
 * (torch_ref.py views, with Debian's python3-torch): views of shared
 * storages (offsets, strides, overlapping views, 0-d and empty tensors)
 * in every dtype kpl reads come out as their contiguous copies, value for
 * value; a NaN, the legacy format, a whole module, a cut file, a missing
 * key are refused naming what is wrong; the pickle reader's torch dialect
 * refuses what torch.save does not write.
 */
#include "kpl_test.h"

#include "checkpoint.h"
#include "infer.h"
#include "pickle_impl.h"

#include <unistd.h>

static char dir[64];

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kpl-torch-XXXXXX");
    if (!mkdtemp(dir)) return -1;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 -c 'import torch' 2>/dev/null && "
             "/usr/bin/python3 %s views %s > %s/ref.log 2>&1", TORCH_REF, dir, dir);
    return system(cmd) == 0 ? 0 : (dir[0] = 0, 0); /* no torch: the tests skip (or fail) */
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    if (dir[0] && snprintf(cmd, sizeof cmd, "rm -rf %s", dir) < (int)sizeof cmd) (void)!system(cmd);
    return 0;
}

#define NEED_TORCH()                                                                           \
    do {                                                                                       \
        if (!dir[0]) KPL_SKIP(KPL_TEST_SKIP_REF, "python3-torch for /usr/bin/python3");       \
    } while (0)

static void path_of(char *out, size_t len, const char *name) { snprintf(out, len, "%s/%s", dir, name); }

static void test_views(void **state)
{
    (void)state;
    NEED_TORCH();
    char p[256], line[1 << 16];
    path_of(p, sizeof p, "views.pth");
    kpl_checkpoint *c = NULL;
    OK(kpl_torch_import(p, "", NULL, 0, NULL, &c));
    path_of(p, sizeof p, "views.txt");
    FILE *f = fopen(p, "r");
    assert_non_null(f);
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        char name[64], dt[16];
        int nd = 0, at = 0, used = 0;
        assert_int_equal(sscanf(line, "%63s %15s %d%n", name, dt, &nd, &at), 3);
        kpl_tensor *t = kpl_checkpoint_find(c, name);
        if (!t) fail_msg("tensor '%s' not imported", name);
        if (strcmp(kpl_dtype_name(kpl_tensor_dtype(t)), dt))
            fail_msg("%s: dtype %s, torch's %s", name, kpl_dtype_name(kpl_tensor_dtype(t)), dt);
        assert_int_equal(kpl_tensor_ndim(t), nd);
        for (int d = 0; d < nd; d++) {
            long long e = 0;
            assert_int_equal(sscanf(line + at, "%lld%n", &e, &used), 1);
            at += used;
            assert_int_equal(kpl_tensor_shape(t)[d], e);
        }
        long long count = 0;
        assert_int_equal(sscanf(line + at, "%lld%n", &count, &used), 1);
        at += used;
        assert_int_equal(kpl_tensor_numel(t), count);
        for (long long i = 0; i < count; i++) {
            double want = 0;
            assert_int_equal(sscanf(line + at, "%lf%n", &want, &used), 1);
            at += used;
            double got = tget(t, i);
            if (got != want) fail_msg("%s[%lld]: kpl %.17g, torch %.17g", name, i, got, want);
        }
        n++;
    }
    fclose(f);
    assert_int_equal(n, 17);
    assert_int_equal(kpl_checkpoint_num_tensors(c), n);
    kpl_checkpoint_destroy(c);
}

/* Prefix, exclusions and the wrapped state dict's key. */
static void test_names(void **state)
{
    (void)state;
    NEED_TORCH();
    char p[256];
    path_of(p, sizeof p, "views.pth");
    const char *ex[2] = {"over*", "*e"};
    kpl_checkpoint *c = NULL;
    OK(kpl_torch_import(p, "model.", NULL, 2, ex, &c));
    assert_non_null(kpl_checkpoint_find(c, "model.rows"));
    assert_null(kpl_checkpoint_find(c, "model.overlap_a"));
    assert_null(kpl_checkpoint_find(c, "model.whole"));
    assert_null(kpl_checkpoint_find(c, "rows"));
    kpl_checkpoint_destroy(c);
    FAILS(kpl_torch_import(p, "", "nothing", 0, NULL, &c), KPL_EFORMAT,
          "--key nothing names nothing in the file's dict");
    const char *all[1] = {"*"};
    FAILS(kpl_torch_import(p, "", NULL, 1, all, &c), KPL_ENOTFOUND, "the exclusions left no tensor");
}

static void test_refused(void **state)
{
    (void)state;
    NEED_TORCH();
    static const struct {
        const char *file, *needle;
    } cases[] = {
        {"nan.pth", "tensor 'fc.bias' holds NaN or inf (element 1 of 2)"},
        {"legacy.pth", "a legacy torch.save file (PyTorch before 1.6"},
        {"model.pth", "holds a pickled object, not a state dict"},
        {"missing.pth", "missing.pth: No such file or directory"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char p[256];
        path_of(p, sizeof p, cases[i].file);
        kpl_checkpoint *c = NULL;
        kpl_clear_error();
        assert_true(kpl_torch_import(p, "", NULL, 0, NULL, &c) < 0);
        assert_null(c);
        if (!strstr(kpl_last_error(), cases[i].needle))
            fail_msg("%s: '%s' lacks '%s'", cases[i].file, kpl_last_error(), cases[i].needle);
    }
    /* the archive cut anywhere: an error, never a crash */
    char p[256], q[256];
    path_of(p, sizeof p, "views.pth");
    path_of(q, sizeof q, "cut.pth");
    FILE *f = fopen(p, "rb");
    assert_non_null(f);
    static uint8_t buf[1 << 16];
    size_t len = fread(buf, 1, sizeof buf, f);
    fclose(f);
    for (size_t cut = 0; cut < len; cut += len / 37 + 1) {
        FILE *g = fopen(q, "wb");
        assert_non_null(g);
        assert_int_equal(fwrite(buf, 1, cut, g), cut);
        fclose(g);
        kpl_checkpoint *c = NULL;
        assert_true(kpl_torch_import(q, "", NULL, 0, NULL, &c) < 0);
        assert_non_null(strstr(kpl_last_error(), "cut.pth"));
    }
}

/* The torch dialect's pickle rules, on hand-made data.pkl bytes. */
static void test_dialect(void **state)
{
    (void)state;
    kpl__pickle *p = NULL;
    /* {'w': _rebuild_tensor_v2(('storage', torch.FloatStorage, '0', 'cpu', 4), 1, (2,), (1,),
     *  False, OrderedDict())} */
    static const char ok[] = /* (split where a letter follows a \x escape) */
        "\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
        "ctorch\nFloatStorage\nX\x01\x00\x00\x00" "0X\x03\x00\x00\x00" "cpuK\x04tQK\x01K\x02\x85K"
        "\x01\x85\x89" "ccollections\nOrderedDict\n)RtRq\x00s.";
    OK(kpl__pickle_load_torch((const uint8_t *)ok, sizeof ok - 1, "ok", &p));
    const kpl__pk_value *w = kpl__pk_dict_get(kpl__pickle_root(p), "w");
    assert_non_null(w);
    assert_int_equal(w->kind, KPL__PK_TENSOR);
    assert_int_equal(w->num, 1);
    assert_int_equal(w->ndim, 1);
    assert_int_equal(w->shape[0], 2);
    assert_int_equal(w->items[0]->kind, KPL__PK_STORAGE);
    assert_int_equal(w->items[0]->dtype, KPL_F32);
    kpl__pickle_free(p);
    /* the numpy dialect (CIFAR) knows none of it */
    FAILS(kpl__pickle_load((const uint8_t *)ok, sizeof ok - 1, "ok", &p), KPL_EFORMAT,
          "GLOBAL torch._utils._rebuild_tensor_v2");
#define B(s) s, sizeof s - 1
    static const struct {
        const char *bytes;
        size_t len;
        const char *needle;
    } bad[] = {
        /* a storage type kpl does not hold */
        {B("\x80\x02" "ctorch\nComplexFloatStorage\n."), "a storage of a dtype kpl does not hold"},
        /* a persistent id that is not torch's storage tuple */
        {B("\x80\x02K\x01Q."), "a persistent id other than torch's"},
        /* protocol 4 */
        {B("\x80\x04N."), "pickle protocol 4: kpl reads protocol 2, torch.save's default"},
        /* a view with a negative stride */
        {B("\x80\x02" "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
           "ctorch\nFloatStorage\nX\x01\x00\x00\x00" "0X\x03\x00\x00\x00" "cpuK\x04tQK\x00K\x02"
           "\x85J\xff\xff\xff\xff\x85\x89}tR."),
         "_rebuild_tensor_v2 with arguments other than"},
        /* LONG1 of 9 bytes */
        {B("\x80\x02\x8a\x09\x01\x02\x03\x04\x05\x06\x07\x08\x09."), "LONG1 of 9 bytes"},
    };
#undef B
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        kpl_clear_error();
        assert_true(kpl__pickle_load_torch((const uint8_t *)bad[i].bytes, bad[i].len, "bad", &p) < 0);
        if (!strstr(kpl_last_error(), bad[i].needle))
            fail_msg("case %zu: '%s' lacks '%s'", i, kpl_last_error(), bad[i].needle);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_views),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_dialect),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
