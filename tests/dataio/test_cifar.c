/* test_cifar.c — CIFAR-10 and CIFAR-100 import from both layouts, and the
 * strict pickle reader under it.  gen_cifar.py (python3 with numpy) writes
 * small sets as distributed: the binary version, and the same images and
 * labels pickled by Python 3 and as Python 2's cPickle wrote them.  Every
 * pixel and label of every converted record is compared with the binary
 * files, read here on their own; classes.txt with the names files.  Then
 * damaged inputs: a batch cut short, a label that is no class, a pickle
 * opcode that is not read, a pickle of another shape; each is an error
 * naming the file and the record or byte offset, and leaves no dataset.
 * The reader itself runs hand-made pickles: every opcode it reads, and
 * the ways a pickle can lie. */
#define KPL_TEST_NAME "cifar"
#include "dataio_test.h"
#include "dataio_impl.h"
#include "pickle_impl.h"

#include <sys/stat.h>
#include <unistd.h>

static const char *gen; /* the generated sets: tmp_root/gen */

static int setup_sets(void **state)
{
    if (setup(state) != 0) return -1;
    char cmd[512];
    gen = strdup(tmp_path("gen"));
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s/gen_cifar.py' '%s'", KPL_TEST_SOURCE_DIR, gen);
    if (system(cmd) != 0) {
        fprintf(stderr, "test_cifar: '%s' failed (python3 with numpy: scripts/setup.sh)\n", cmd);
        return -1;
    }
    return 0;
}

static int teardown_sets(void **state)
{
    free((void *)gen);
    return teardown(state);
}

/* The whole file (NUL-terminated, malloc'd). */
static char *slurp(const char *path, size_t *len)
{
    char *b = NULL;
    OK(kpl__read_file(path, &b, len));
    return b;
}

/* ---- the ground truth: the binary files, read record by record ---- */

typedef struct {
    int64_t n;
    uint8_t *rec; /* n records of `size` bytes, the split's files in order */
    size_t size;  /* 3073 or 3074 */
} truth;

static void read_truth(bool c100, bool test, truth *t)
{
    const char *dir = c100 ? "c100/cifar-100-binary" : "c10/cifar-10-batches-bin";
    const char *files[5];
    int nf = 0;
    if (c100) files[nf++] = test ? "test.bin" : "train.bin";
    else if (test) files[nf++] = "test_batch.bin";
    else for (int i = 0; i < 5; i++) {
        static const char *const b[5] = {"data_batch_1.bin", "data_batch_2.bin",
                                         "data_batch_3.bin", "data_batch_4.bin",
                                         "data_batch_5.bin"};
        files[nf++] = b[i];
    }
    t->size = c100 ? 3074 : 3073;
    t->n = 0;
    t->rec = NULL;
    for (int i = 0; i < nf; i++) {
        char p[512];
        size_t len = 0;
        snprintf(p, sizeof p, "%s/%s/%s", gen, dir, files[i]);
        char *b = slurp(p, &len);
        assert_int_equal(len % t->size, 0);
        t->rec = realloc(t->rec, (size_t)t->n * t->size + len);
        memcpy(t->rec + (size_t)t->n * t->size, b, len);
        t->n += (int64_t)(len / t->size);
        free(b);
    }
}

/* Every record of the dataset at `out` against the truth: its pixels at
 * (y, x, c) are the file's plane c at (y, x); its labels the file's bytes. */
static void check_split(const char *out, bool c100, bool test)
{
    truth t;
    read_truth(c100, test, &t);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(out, &ds));
    assert_int_equal(kpl_dataset_num_examples(ds), t.n);
    assert_int_equal(kpl_dataset_num_features(ds), c100 ? 3 : 2);
    const kpl_feature_spec *im = kpl_dataset_feature(ds, 0);
    assert_string_equal(im->name, "image");
    assert_string_equal(im->encoding, "raw");
    assert_int_equal(im->ndim, 3);
    assert_int_equal(im->shape[0], 32);
    assert_int_equal(im->shape[1], 32);
    assert_int_equal(im->shape[2], 3);
    assert_string_equal(kpl_dataset_feature(ds, 1)->name, "label");
    assert_int_equal(kpl_dataset_feature(ds, 1)->type, KPL_FEATURE_INT64);
    if (c100) assert_string_equal(kpl_dataset_feature(ds, 2)->name, "coarse_label");
    assert_non_null(strstr(kpl_dataset_attributes(ds), c100 ? "\"dataset\":\"cifar-100\""
                                                            : "\"dataset\":\"cifar-10\""));
    kpl_chunk *c = kpl_chunk_create();
    for (int64_t i = 0; i < t.n; i++) {
        kpl_feature_value v[3];
        OK(kpl_dataset_read_example(ds, i, c, v));
        const uint8_t *r = t.rec + (size_t)i * t.size, *px = r + (c100 ? 2 : 1);
        const uint8_t *hwc = v[0].data;
        assert_int_equal(v[0].count, 3072);
        for (int y = 0; y < 32; y++)
            for (int x = 0; x < 32; x++)
                for (int ch = 0; ch < 3; ch++)
                    if (hwc[(y * 32 + x) * 3 + ch] != px[ch * 1024 + y * 32 + x])
                        fail_msg("%s: example %lld pixel (%d, %d, %d) is %d, the file's %d", out,
                                 (long long)i, y, x, ch, hwc[(y * 32 + x) * 3 + ch],
                                 px[ch * 1024 + y * 32 + x]);
        int64_t label, coarse;
        assert_int_equal(v[1].count, 1);
        memcpy(&label, v[1].data, 8);
        assert_int_equal(label, r[c100 ? 1 : 0]);
        if (c100) {
            assert_int_equal(v[2].count, 1);
            memcpy(&coarse, v[2].data, 8);
            assert_int_equal(coarse, r[0]);
        }
    }
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    free(t.rec);
}

/* out/name holds the names of the generator's text file `names` (blank
 * lines left out), one a line. */
static void check_names(const char *out, const char *name, const char *names)
{
    char p[512], want[8192];
    size_t len = 0, n = 0;
    snprintf(p, sizeof p, "%s/%s", gen, names);
    char *src = slurp(p, &len);
    for (size_t i = 0; i < len; i++)
        if (!(src[i] == '\n' && (n == 0 || want[n - 1] == '\n'))) want[n++] = src[i];
    want[n] = 0;
    free(src);
    snprintf(p, sizeof p, "%s/%s", out, name);
    char *got = slurp(p, &len);
    assert_string_equal(got, want);
    free(got);
}

static void convert_and_check(const char *src, bool c100, const char *tag)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.writer.chunk_bytes = 20000; /* several chunks */
    for (int k = 0; k < 2; k++) {
        char in[512], out[512];
        snprintf(in, sizeof in, "%s/%s", gen, src);
        snprintf(out, sizeof out, "%s/%s-%s", tmp_root, tag, k ? "test" : "train");
        int64_t n = 0;
        OK(kpl_convert_cifar(in, k ? "test" : "train", out, &o, &n));
        assert_int_equal(n, c100 ? (k ? 11 : 300) : (k ? 9 : 25));
        check_split(out, c100, k == 1);
        check_names(out, "classes.txt", c100 ? "c100/cifar-100-binary/fine_label_names.txt"
                                             : "c10/cifar-10-batches-bin/batches.meta.txt");
        if (c100)
            check_names(out, "coarse_classes.txt", "c100/cifar-100-binary/coarse_label_names.txt");
        OK(kpl_dataset_verify(out, NULL, NULL, NULL));
    }
}

static void test_cifar10_layouts(void **state)
{
    (void)state;
    convert_and_check("c10/cifar-10-batches-bin", false, "c10bin");
    convert_and_check("c10/cifar-10-batches-py", false, "c10py");
    /* the folder holding the layout's folder, as the archive extracts */
    convert_and_check("c10py2", false, "c10py2");
}

static void test_cifar100_layouts(void **state)
{
    (void)state;
    convert_and_check("c100/cifar-100-binary", true, "c100bin");
    convert_and_check("c100/cifar-100-python", true, "c100py");
    convert_and_check("c100py2", true, "c100py2");
}

static bool exists(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0;
}

/* A scratch copy of a generated layout folder. */
static const char *copy_layout(const char *from, const char *name)
{
    const char *dst = tmp_path(name);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s/%s' '%s'", dst, gen, from, dst);
    assert_int_equal(system(cmd), 0);
    return dst;
}

static void patch_byte(const char *path, long off, uint8_t v)
{
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    fseek(f, off, SEEK_SET);
    fputc(v, f);
    fclose(f);
}

static void test_layout_found_or_refused(void **state)
{
    (void)state;
    char p[512];
    const char *out = tmp_path("found");
    /* c10 holds both cifar-10 folders: which one is meant is not guessed */
    snprintf(p, sizeof p, "%s/c10", gen);
    FAILS(kpl_convert_cifar(p, "train", out, NULL, NULL), KPL_EINVAL,
          "holds both cifar-10-batches-bin and cifar-10-batches-py: give one of them");
    FAILS(kpl_convert_cifar(tmp_path("nowhere"), "train", out, NULL, NULL), KPL_ENOTFOUND,
          "nowhere");
    snprintf(p, sizeof p, "%s/c10/cifar-10-batches-bin/test_batch.bin", gen);
    FAILS(kpl_convert_cifar(p, "test", out, NULL, NULL), KPL_EINVAL,
          "is not a directory (extract the archive first");
    mkdir(tmp_path("empty"), 0755);
    FAILS(kpl_convert_cifar(tmp_path("empty"), "test", out, NULL, NULL), KPL_ENOTFOUND,
          "holds no CIFAR files");
    snprintf(p, sizeof p, "%s/c10py2", gen);
    FAILS(kpl_convert_cifar(p, "extra", out, NULL, NULL), KPL_EINVAL,
          "split 'extra': CIFAR has train and test");
    /* val is test */
    int64_t n = 0;
    OK(kpl_convert_cifar(p, "val", out, NULL, &n));
    assert_int_equal(n, 9);
    /* a missing batch names the file */
    const char *d = copy_layout("c10/cifar-10-batches-py", "missing");
    snprintf(p, sizeof p, "%s/data_batch_4", d);
    unlink(p);
    FAILS(kpl_convert_cifar(d, "train", tmp_path("missing-out"), NULL, NULL), KPL_ENOTFOUND,
          "data_batch_4 is missing (the cifar-10-batches-py layout's train split needs it)");
    assert_false(exists(tmp_path("missing-out")));
    /* without the names files: no classes.txt, the rest as before */
    d = copy_layout("c100/cifar-100-binary", "nonames");
    snprintf(p, sizeof p, "%s/fine_label_names.txt", d);
    unlink(p);
    snprintf(p, sizeof p, "%s/coarse_label_names.txt", d);
    unlink(p);
    OK(kpl_convert_cifar(d, "test", tmp_path("nonames-out"), NULL, &n));
    assert_int_equal(n, 11);
    snprintf(p, sizeof p, "%s/classes.txt", tmp_path("nonames-out"));
    assert_false(exists(p));
}

/* A copy of the layout folder `from` whose `file` has its byte `off` set
 * to v: the split's conversion fails with `needle` and leaves no output. */
static void refused_byte(const char *from, const char *tag, const char *file, long off,
                         uint8_t v, const char *split, const char *needle)
{
    char p[512], out[300];
    const char *d = copy_layout(from, tag);
    snprintf(p, sizeof p, "%s/%s", d, file);
    patch_byte(p, off, v);
    snprintf(out, sizeof out, "%s-out", d);
    FAILS(kpl_convert_cifar(d, split, out, NULL, NULL), KPL_EFORMAT, needle);
    assert_false(exists(out));
}

static void test_damaged_batches(void **state)
{
    (void)state;
    char p[512];
    /* cut short: data_batch_3.bin holds 6 records */
    const char *d = copy_layout("c10/cifar-10-batches-bin", "cut");
    snprintf(p, sizeof p, "%s/data_batch_3.bin", d);
    assert_int_equal(truncate(p, 6 * 3073 - 100), 0);
    FAILS(kpl_convert_cifar(d, "train", tmp_path("cut-out"), NULL, NULL), KPL_EFORMAT,
          "data_batch_3.bin: 18338 bytes is not a whole number of 3073-byte records (CIFAR-10 "
          "binary: 1 label byte and 3072 pixel bytes each): record 5 is cut short after 2973 "
          "bytes");
    assert_false(exists(tmp_path("cut-out")));
    /* labels that are no class */
    refused_byte("c10/cifar-10-batches-bin", "badlabel", "test_batch.bin", 2 * 3073, 10, "test",
                 "test_batch.bin: record 2 (byte offset 6146): label 10 is not a class (0..9)");
    refused_byte("c100/cifar-100-binary", "badcoarse", "test.bin", 3 * 3074, 20, "test",
                 "test.bin: record 3 (byte offset 9222): coarse label 20 is not a class (0..19)");
    refused_byte("c100/cifar-100-binary", "badfine", "train.bin", 7 * 3074 + 1, 100, "train",
                 "train.bin: record 7 (byte offset 21519): fine label 100 is not a class (0..99)");
    /* CIFAR-100's files where CIFAR-10's are expected: the record size */
    size_t len = 0;
    snprintf(p, sizeof p, "%s/c100/cifar-100-binary/test.bin", gen);
    char *b = slurp(p, &len);
    kpl__cifar_batch batch;
    FAILS(kpl__cifar_parse_binary((const uint8_t *)b, len, "test.bin", false, &batch),
          KPL_EFORMAT, "(truncated, or the other CIFAR's file?)");
    free(b);
    /* a pickle opcode that is not read: the first one after PROTO is
     * EMPTY_DICT ('}'), made INST ('i'), which would import and call */
    refused_byte("c10py2/cifar-10-batches-py", "opcode", "data_batch_2", 2, 'i', "train",
                 "data_batch_2: pickle byte offset 2: opcode 0x69 (INST) is not one kpl reads");
    /* a pickle cut short */
    d = copy_layout("c100/cifar-100-python", "cutpickle");
    snprintf(p, sizeof p, "%s/test", d);
    assert_int_equal(truncate(p, 20000), 0);
    FAILS(kpl_convert_cifar(d, "test", tmp_path("cutpickle-out"), NULL, NULL), KPL_EFORMAT,
          "the file has");
    assert_non_null(strstr(kpl_last_error(), "cutpickle/test: pickle byte offset"));
    assert_non_null(strstr(kpl_last_error(), "(cut short?)"));
    /* a bad meta file is an error too, before anything is written */
    d = copy_layout("c10/cifar-10-batches-bin", "badmeta");
    snprintf(p, sizeof p, "%s/batches.meta.txt", d);
    FILE *f = fopen(p, "a");
    fputs("eleventh\n", f);
    fclose(f);
    FAILS(kpl_convert_cifar(d, "test", tmp_path("badmeta-out"), NULL, NULL), KPL_EFORMAT,
          "batches.meta.txt: 11 class names, CIFAR has 10");
    assert_false(exists(tmp_path("badmeta-out")));
}

/* ---- hand-made pickles ---- */

typedef struct {
    uint8_t *b;
    size_t n, cap;
} pk;

static void put(pk *p, const void *s, size_t n)
{
    if (p->n + n > p->cap) {
        p->cap = 2 * (p->n + n) + 256;
        p->b = realloc(p->b, p->cap);
        assert_non_null(p->b);
    }
    memcpy(p->b + p->n, s, n);
    p->n += n;
}
static void op(pk *p, uint8_t c) { put(p, &c, 1); }
static void op32(pk *p, uint8_t c, uint32_t v)
{
    uint8_t b[5] = {c, (uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    put(p, b, 5);
}
/* SHORT_BINSTRING, as Python 2 writes a str */
static void str8(pk *p, const char *s)
{
    op(p, 'U');
    op(p, (uint8_t)strlen(s));
    put(p, s, strlen(s));
}
static void uni(pk *p, const char *s)
{
    op32(p, 'X', (uint32_t)strlen(s));
    put(p, s, strlen(s));
}
static void small_int(pk *p, int v)
{
    op(p, 'K');
    op(p, (uint8_t)v);
}
static void global(pk *p, const char *mod, const char *name)
{
    op(p, 'c');
    put(p, mod, strlen(mod));
    op(p, '\n');
    put(p, name, strlen(name));
    op(p, '\n');
}
/* A numpy uint8 array as numpy pickles it, with these extents and bytes. */
static void array(pk *p, int ndim, const int *shape, const uint8_t *data, size_t len, bool fortran,
                  const char *dtype)
{
    global(p, "numpy.core.multiarray", "_reconstruct");
    global(p, "numpy", "ndarray");
    small_int(p, 0);
    op(p, 0x85);
    str8(p, "b");
    op(p, 0x87);
    op(p, 'R');
    op(p, '(');
    small_int(p, 1);
    op(p, '(');
    for (int i = 0; i < ndim; i++) op32(p, 'J', (uint32_t)shape[i]);
    op(p, 't');
    global(p, "numpy", "dtype");
    str8(p, dtype);
    small_int(p, 0);
    small_int(p, 1);
    op(p, 0x87);
    op(p, 'R');
    op(p, '(');
    small_int(p, 3);
    str8(p, "|");
    op(p, 'N'), op(p, 'N'), op(p, 'N');
    op32(p, 'J', 0xffffffffu);
    op32(p, 'J', 0xffffffffu);
    small_int(p, 0);
    op(p, 't');
    op(p, 'b');
    op(p, fortran ? 0x88 : 0x89);
    op32(p, 'T', (uint32_t)len);
    put(p, data, len);
    op(p, 't');
    op(p, 'b');
}

/* A CIFAR-10 batch of n images whose `data` has the given extents. */
static pk batch(int n, int ndim, const int *shape, const int *labels, int nlabels)
{
    pk p = {0};
    size_t len = 1;
    for (int i = 0; i < ndim; i++) len *= (size_t)shape[i];
    uint8_t *px = malloc(len);
    for (size_t i = 0; i < len; i++) px[i] = (uint8_t)(i * 7 + 3);
    op(&p, 0x80), op(&p, 2);
    op(&p, '}');
    op(&p, '(');
    str8(&p, "data");
    array(&p, ndim, shape, px, len, false, "u1");
    str8(&p, "labels");
    op(&p, ']');
    op(&p, '(');
    for (int i = 0; i < nlabels; i++) small_int(&p, labels[i]);
    op(&p, 'e');
    op(&p, 'u');
    op(&p, '.');
    free(px);
    (void)n;
    return p;
}

static void test_pickle_batches(void **state)
{
    (void)state;
    kpl__cifar_batch b;
    int labels[3] = {4, 9, 0};
    pk p = batch(3, 2, (int[]){3, 3072}, labels, 3);
    OK(kpl__cifar_parse_pickle(p.b, p.n, "ok", false, &b));
    assert_int_equal(b.n, 3);
    for (int i = 0; i < 3; i++) assert_int_equal(b.label[i], labels[i]);
    for (size_t i = 0; i < 3 * 3072; i++) assert_int_equal(b.pixels[i], (uint8_t)(i * 7 + 3));
    assert_null(b.coarse);
    kpl__cifar_batch_free(&b);
    free(p.b);
    /* another shape: (2, 32, 32, 3), the pixels interleaved */
    p = batch(2, 4, (int[]){2, 32, 32, 3}, labels, 2);
    FAILS(kpl__cifar_parse_pickle(p.b, p.n, "shape", false, &b), KPL_EFORMAT,
          "shape: 'data' is a (2, 32, 32, 3) array");
    free(p.b);
    p = batch(2, 2, (int[]){2, 1024}, labels, 2);
    FAILS(kpl__cifar_parse_pickle(p.b, p.n, "gray", false, &b), KPL_EFORMAT,
          "gray: 'data' is a (2, 1024) array (byte offset");
    free(p.b);
    p = batch(3, 2, (int[]){3, 3072}, labels, 2);
    FAILS(kpl__cifar_parse_pickle(p.b, p.n, "short", false, &b), KPL_EFORMAT,
          "short: 'labels' has 2 entries for 3 images");
    free(p.b);
    p = batch(3, 2, (int[]){3, 3072}, (int[]){1, 2, 10}, 3);
    FAILS(kpl__cifar_parse_pickle(p.b, p.n, "label", false, &b), KPL_EFORMAT,
          "label: labels[2] is 10 (byte offset");
    assert_non_null(strstr(kpl_last_error(), "not a class (0..9)"));
    /* a CIFAR-10 batch read as CIFAR-100 says which keys it has */
    FAILS(kpl__cifar_parse_pickle(p.b, p.n, "ten", true, &b), KPL_EFORMAT,
          "ten: the pickle's dict has no 'fine_labels' (it has 'labels': a CIFAR-10 file?)");
    free(p.b);
}

/* Parses p and expects failure at `offset` with `needle` in the message. */
static void refused(pk *p, size_t offset, const char *needle)
{
    kpl__pickle *k = NULL;
    kpl_clear_error();
    kpl_status st = kpl__pickle_load(p->b, p->n, "t.pkl", &k);
    if (st != KPL_EFORMAT) fail_msg("parsed (%d): wanted '%s'", st, needle);
    char at[64];
    snprintf(at, sizeof at, "t.pkl: pickle byte offset %zu: ", offset);
    if (!strstr(kpl_last_error(), at) || !strstr(kpl_last_error(), needle))
        fail_msg("message '%s' lacks '%s' or '%s'", kpl_last_error(), at, needle);
    free(p->b);
    memset(p, 0, sizeof *p);
}

static pk start(void)
{
    pk p = {0};
    op(&p, 0x80);
    op(&p, 2);
    return p;
}

static void test_pickle_reader(void **state)
{
    (void)state;
    /* what the reader reads: memo far and near (the dict holding itself),
     * single APPEND and SETITEM, every tuple opcode, None, bools, ints of
     * every width, str and bytes, empty bytes through __builtin__.bytes,
     * bytes through _codecs.encode */
    pk p = start();
    op(&p, '}');
    op32(&p, 'r', 300); /* LONG_BINPUT */
    str8(&p, "list");
    op(&p, ']');
    small_int(&p, 7);
    op(&p, 'a');
    op(&p, 's');
    uni(&p, "t");
    op(&p, 'N');
    op(&p, 0x85);
    op(&p, 0x88);
    op(&p, 0x89);
    op(&p, 0x86);
    op(&p, 'M'), op(&p, 0x34), op(&p, 0x12);
    op32(&p, 'J', (uint32_t)-5);
    op(&p, 0x86);
    op(&p, 0x87);
    op(&p, 'q'), op(&p, 1);
    op(&p, 's');
    uni(&p, "again");
    op(&p, 'h'), op(&p, 1);
    op(&p, 's');
    uni(&p, "e");
    op(&p, '(');
    op(&p, 't');
    op(&p, ')');
    op(&p, 0x86);
    op(&p, 's');
    uni(&p, "empty");
    global(&p, "__builtin__", "bytes");
    op(&p, ')');
    op(&p, 'R');
    op(&p, 's');
    uni(&p, "latin");
    global(&p, "_codecs", "encode");
    uni(&p, "a\xc3\xbf\xc2\x80"); /* 'a', U+00FF, U+0080 */
    uni(&p, "latin1");
    op(&p, 0x86);
    op(&p, 'R');
    op(&p, 's');
    uni(&p, "self");
    op32(&p, 'j', 300); /* LONG_BINGET */
    op(&p, 's');
    char pad[601];
    memset(pad, 'x', 600);
    pad[600] = 0;
    uni(&p, "pad"); /* memo indices up to half the file's length are fine */
    uni(&p, pad);
    op(&p, 's');
    op(&p, '.');
    kpl__pickle *k = NULL;
    OK(kpl__pickle_load(p.b, p.n, "t.pkl", &k));
    const kpl__pk_value *root = kpl__pickle_root(k), *v = NULL;
    assert_int_equal(root->kind, KPL__PK_DICT);
    assert_int_equal(root->n, 2 * 8);
    assert_ptr_equal(kpl__pk_dict_get(root, "self"), root);
    v = kpl__pk_dict_get(root, "list");
    assert_int_equal(v->kind, KPL__PK_LIST);
    assert_int_equal(v->n, 1);
    assert_int_equal(v->items[0]->num, 7);
    v = kpl__pk_dict_get(root, "t");
    assert_ptr_equal(kpl__pk_dict_get(root, "again"), v);
    assert_int_equal(v->kind, KPL__PK_TUPLE);
    assert_int_equal(v->n, 3);
    assert_int_equal(v->items[0]->n, 1);
    assert_int_equal(v->items[0]->items[0]->kind, KPL__PK_NONE);
    assert_int_equal(v->items[1]->items[0]->kind, KPL__PK_BOOL);
    assert_int_equal(v->items[1]->items[0]->num, 1);
    assert_int_equal(v->items[1]->items[1]->num, 0);
    assert_int_equal(v->items[2]->items[0]->num, 0x1234);
    assert_int_equal(v->items[2]->items[1]->num, -5);
    v = kpl__pk_dict_get(root, "e");
    assert_int_equal(v->n, 2);
    assert_int_equal(v->items[0]->kind, KPL__PK_TUPLE);
    assert_int_equal(v->items[0]->n + v->items[1]->n, 0);
    v = kpl__pk_dict_get(root, "empty");
    assert_int_equal(v->kind, KPL__PK_BYTES);
    assert_int_equal(v->len, 0);
    v = kpl__pk_dict_get(root, "latin");
    assert_int_equal(v->kind, KPL__PK_BYTES);
    assert_int_equal(v->len, 3);
    assert_memory_equal(v->bytes, "a\xff\x80", 3);
    kpl__pickle_free(k);
    free(p.b);

    /* ... and what it refuses, each at the offset of the opcode at fault */
    p = start();
    op(&p, '(');
    global(&p, "os", "system");
    refused(&p, 3, "GLOBAL os.system: kpl reads only numpy uint8 arrays");
    p = (pk){0};
    op(&p, 0x80), op(&p, 4), op(&p, '}'), op(&p, '.');
    refused(&p, 0, "pickle protocol 4: kpl reads protocol 2");
    p = start();
    op(&p, 0x95);
    refused(&p, 2, "opcode 0x95 (FRAME) is not one kpl reads");
    p = start();
    op(&p, 0xfe);
    refused(&p, 2, "opcode 0xfe (not a pickle opcode)");
    p = start();
    op(&p, '}');
    op32(&p, 'r', 1u << 30);
    refused(&p, 3, "memo index 1073741824 (kpl allows up to 4 in a file of 8 bytes)");
    /* the same text decoded again and again: more bytes than the file */
    p = start();
    uni(&p, "0123456789abcdef0123456789abcdef");
    op(&p, 'q'), op(&p, 0);
    uni(&p, "latin1");
    op(&p, 'q'), op(&p, 1);
    op(&p, ']');
    size_t first = p.n, each = 0;
    for (int i = 0; i < 8; i++) { /* 8 x 32 bytes from a file of 239 */
        global(&p, "_codecs", "encode");
        op(&p, 'h'), op(&p, 0);
        op(&p, 'h'), op(&p, 1);
        op(&p, 0x86);
        op(&p, 'R');
        op(&p, 'a');
        if (!each) each = p.n - first;
    }
    refused(&p, first + 8 * each - 2, "_codecs.encode makes more bytes than the file holds");
    p = start();
    op(&p, 'N');
    op(&p, 'q'), op(&p, 1);
    op(&p, 'h'), op(&p, 2);
    refused(&p, 5, "memo 2 was never stored");
    p = start();
    small_int(&p, 1);
    op(&p, 'a');
    refused(&p, 4, "APPEND finds no list below its values");
    p = start();
    op(&p, ']');
    op(&p, '(');
    op(&p, 'q'), op(&p, 0);
    refused(&p, 4, "BINPUT finds no value on the stack (underflow)");
    p = start();
    op(&p, 'e');
    refused(&p, 2, "APPENDS without a MARK");
    p = start();
    op(&p, 'N');
    op(&p, '.');
    op(&p, 'N');
    refused(&p, 3, "1 bytes after STOP");
    p = start();
    op(&p, 'N');
    op(&p, 'N');
    op(&p, '.');
    refused(&p, 4, "STOP with 1 values and 0 MARKs left over");
    p = start();
    op32(&p, 'T', 0x80000000u);
    refused(&p, 2, "BINSTRING of negative length");
    p = start();
    op32(&p, 'X', 1000);
    put(&p, "abc", 3);
    refused(&p, 2, "BINUNICODE needs 1000 bytes, the file has 3 left (cut short?)");
    p = start();
    uni(&p, "\xc0\x80"); /* an overlong NUL */
    refused(&p, 2, "BINUNICODE that is not UTF-8");
    p = start();
    global(&p, "_codecs", "encode");
    uni(&p, "\xe2\x82\xac"); /* U+20AC */
    uni(&p, "latin1");
    op(&p, 0x86);
    op(&p, 'R');
    refused(&p, p.n - 1, "_codecs.encode of text with a character past U+00FF");
    p = start();
    global(&p, "numpy", "dtype");
    str8(&p, "f8");
    small_int(&p, 0), small_int(&p, 1);
    op(&p, 0x87);
    op(&p, 'R');
    refused(&p, p.n - 1, "numpy.dtype 'f8': kpl reads only uint8 ('u1') arrays");
    uint8_t px[6] = {0};
    p = start();
    array(&p, 2, (int[]){2, 3}, px, 6, true, "u1");
    refused(&p, p.n - 1, "a Fortran-ordered array");
    p = start();
    array(&p, 2, (int[]){2, 3}, px, 5, false, "u1");
    refused(&p, p.n - 1, "an array of 6 elements holds 5 bytes of data");
    p = start();
    array(&p, 2, (int[]){2, 3}, px, 6, false, "u1");
    size_t again = p.n;
    op(&p, '(');
    op(&p, 't');
    op(&p, 'b');
    refused(&p, again + 2, "BUILD of a uint8 array built already");
    p = start();
    global(&p, "numpy", "ndarray");
    op(&p, ')');
    op(&p, 'R');
    refused(&p, p.n - 1, "REDUCE calls numpy.ndarray itself");
    p = start();
    small_int(&p, 1);
    op(&p, ')');
    op(&p, 'R');
    refused(&p, p.n - 1, "REDUCE calls a int");
    p = start();
    op(&p, '}');
    refused(&p, 3, "the file ends before STOP (cut short?)");
    p = (pk){0};
    op(&p, '}'), op(&p, '.');
    kpl__pickle *none = NULL;
    FAILS(kpl__pickle_load(p.b, p.n, "t.pkl", &none), KPL_EFORMAT,
          "t.pkl: not a protocol 2 pickle (it starts with no PROTO opcode)");
    free(p.b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cifar10_layouts),
        cmocka_unit_test(test_cifar100_layouts),
        cmocka_unit_test(test_layout_found_or_refused),
        cmocka_unit_test(test_damaged_batches),
        cmocka_unit_test(test_pickle_batches),
        cmocka_unit_test(test_pickle_reader),
    };
    return cmocka_run_group_tests(tests, setup_sets, teardown_sets);
}
