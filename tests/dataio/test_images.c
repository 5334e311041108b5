/* test_images.c — a folder of images without classes (kpl_convert_images,
 * `kpl data convert --from images`): every PNG and JPEG under it,
 * subfolders included, while hidden entries, other files and links to
 * folders are passed over; records hold the files' own bytes and their
 * paths and no label, in sorted order or a seeded shuffle that no thread
 * count changes; the loader gives batches without labels, and names what
 * the set has when a label is asked of it; bad and empty folders. */
#define KPL_TEST_NAME "images"
#include "dataio_test.h"
#include "image_files.h"

#include <sys/stat.h>
#include <unistd.h>

enum { NFILES = 5 };
/* The images in byte-wise order of their paths; flink.png links to b.png. */
static const char *const rels[NFILES] = {"a/1.png", "a/deep/er/2.jpg", "b.png", "c/3.PNG",
                                         "flink.png"};
static unsigned char *bytes[NFILES];
static size_t lens[NFILES];
static char root[300];

static void make_tree(void)
{
    snprintf(root, sizeof root, "%s", tmp_path("faces"));
    const char *dirs[] = {"", "/a", "/a/deep", "/a/deep/er", "/c", "/.git"};
    char p[512];
    for (int i = 0; i < 6; i++) {
        snprintf(p, sizeof p, "%s%s", root, dirs[i]);
        assert_int_equal(mkdir(p, 0755), 0);
    }
    for (int i = 0; i < 4; i++) {
        unsigned long jl = 0;
        if (i == 1) {
            unsigned char *j = make_jpeg(20, 14, i + 1, &jl);
            bytes[i] = malloc(jl);
            memcpy(bytes[i], j, jl);
            tjFree(j);
            lens[i] = jl;
        } else {
            bytes[i] = make_png(12 + i, 10 - i, i + 1, &lens[i]);
        }
        snprintf(p, sizeof p, "%s/%s", root, rels[i]);
        write_bytes(p, bytes[i], lens[i]);
    }
    bytes[4] = bytes[2], lens[4] = lens[2];
    char target[512];
    snprintf(p, sizeof p, "%s/flink.png", root);
    snprintf(target, sizeof target, "%s/b.png", root);
    assert_int_equal(symlink(target, p), 0);
    /* passed over: hidden, not an image, a link to a folder */
    const char *ignored[] = {".hidden.png", ".git/x.png", "notes.txt", "a/readme.md"};
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", root, ignored[i]);
        write_bytes(p, bytes[0], lens[0]);
    }
    snprintf(p, sizeof p, "%s/again", root);
    snprintf(target, sizeof target, "%s/a", root);
    assert_int_equal(symlink(target, p), 0);
}

/* The records' paths, '\n' after each, in dataset order (malloc'd). */
static char *paths(const char *dir)
{
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(dir, &ds));
    int f = kpl_dataset_find_feature(ds, "path");
    assert_true(f >= 0);
    kpl_chunk *c = NN(kpl_chunk_create());
    char *s = calloc(1, 4096);
    for (int64_t i = 0; i < kpl_dataset_num_examples(ds); i++) {
        kpl_feature_value v[2];
        OK(kpl_dataset_read_example(ds, i, c, v));
        strncat(s, v[f].data, v[f].count);
        strcat(s, "\n");
    }
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    return s;
}

static void test_images_import(void **state)
{
    (void)state;
    make_tree();
    const char *sorted = tmp_path("sorted"), *one = tmp_path("one"), *two = tmp_path("two");
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.keep_order = true;
    int64_t n = 0, skipped = -1;
    OK(kpl_convert_images(root, sorted, &o, &n, &skipped));
    assert_int_equal(n, NFILES);
    assert_int_equal(skipped, 0);

    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(sorted, &ds));
    assert_int_equal(kpl_dataset_num_features(ds), 2);
    assert_string_equal(kpl_dataset_feature(ds, 0)->name, "image");
    assert_string_equal(kpl_dataset_feature(ds, 0)->encoding, ""); /* PNGs and a JPEG */
    assert_string_equal(kpl_dataset_feature(ds, 1)->name, "path");
    assert_int_equal(kpl_dataset_find_feature(ds, "label"), -1);
    assert_non_null(strstr(kpl_dataset_attributes(ds), "\"source\":\"images\""));
    assert_non_null(strstr(kpl_dataset_attributes(ds), "\"labels\":false"));
    kpl_chunk *c = NN(kpl_chunk_create());
    for (int i = 0; i < NFILES; i++) {
        kpl_feature_value v[2];
        OK(kpl_dataset_read_example(ds, i, c, v));
        assert_int_equal(v[1].count, strlen(rels[i]));
        assert_memory_equal(v[1].data, rels[i], v[1].count);
        assert_int_equal(v[0].count, lens[i]);
        assert_memory_equal(v[0].data, bytes[i], lens[i]);
    }
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);

    /* shuffled by the seed, the same for any thread count */
    o.keep_order = false;
    o.seed = 3;
    o.threads = 1;
    OK(kpl_convert_images(root, one, &o, NULL, NULL));
    o.threads = 2;
    OK(kpl_convert_images(root, two, &o, NULL, NULL));
    char *k = paths(sorted), *a = paths(one), *b = paths(two);
    assert_string_equal(k, "a/1.png\na/deep/er/2.jpg\nb.png\nc/3.PNG\nflink.png\n");
    assert_string_equal(a, b);
    assert_string_not_equal(a, k);
    assert_int_equal(strlen(a), strlen(k));
    free(k), free(a), free(b);

    /* the loader: batches without labels; a label asked of it is named */
    kpl_loader_config lc = KPL_LOADER_CONFIG_INIT;
    lc.path = sorted;
    lc.batch_size = NFILES;
    lc.shuffle = KPL_SHUFFLE_NONE;
    lc.transform.label_feature = NULL;
    lc.transform.out_h = lc.transform.out_w = 8;
    lc.transform.out_dtype = KPL_U8;
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&lc, &l));
    kpl_batch bt;
    OK(kpl_loader_next(l, &bt));
    assert_int_equal(bt.size, NFILES);
    assert_null(bt.label);
    assert_int_equal(kpl_tensor_dim(bt.image, 0), NFILES);
    assert_int_equal(kpl_tensor_dim(bt.image, 1), 3);
    assert_null(kpl_batch_get(&bt, "label"));
    kpl_batch_release(&bt);
    kpl_loader_destroy(l);
    lc.transform.label_feature = "label";
    l = NULL;
    FAILS(kpl_loader_create(&lc, &l), KPL_EINVAL, "label_feature 'label' is not a feature of");
    assert_non_null(strstr(kpl_last_error(), "(it has: image, path)"));
    assert_null(l);
}

static void test_images_refused(void **state)
{
    (void)state;
    char p[512], dir[300];
    snprintf(dir, sizeof dir, "%s", tmp_path("bad"));
    mkdir(dir, 0755);
    snprintf(p, sizeof p, "%s/notes.txt", dir);
    write_bytes(p, "x", 1);
    FAILS(kpl_convert_images(dir, tmp_path("bad_out"), NULL, NULL, NULL), KPL_EFORMAT,
          "no .jpg/.jpeg/.png files in it or its subfolders");
    FAILS(kpl_convert_images(tmp_path("nowhere"), tmp_path("bad_out"), NULL, NULL, NULL),
          KPL_ENOTFOUND, "nowhere");
    /* a PNG cut short: an error naming it, or skipped and counted */
    size_t len = 0;
    unsigned char *png = make_png(9, 9, 5, &len);
    snprintf(p, sizeof p, "%s/ok.png", dir);
    write_bytes(p, png, len);
    snprintf(p, sizeof p, "%s/sub", dir);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/sub/cut.png", dir);
    write_bytes(p, png, len / 2);
    free(png);
    char want[400];
    snprintf(want, sizeof want, "images: %s/sub/cut.png: ", dir);
    FAILS(kpl_convert_images(dir, tmp_path("bad_out"), NULL, NULL, NULL), KPL_EFORMAT, want);
    struct stat sb;
    assert_int_equal(stat(tmp_path("bad_out"), &sb), -1); /* nothing left behind */
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.skip_bad = true;
    int64_t n = 0, skipped = 0;
    OK(kpl_convert_images(dir, tmp_path("bad_out"), &o, &n, &skipped));
    assert_int_equal(n, 1);
    assert_int_equal(skipped, 1);
    /* a flat folder is no ImageNet layout: imagefolder points here */
    snprintf(dir, sizeof dir, "%s", tmp_path("flat"));
    mkdir(dir, 0755);
    snprintf(p, sizeof p, "%s/x.png", dir);
    write_bytes(p, bytes[0], lens[0]);
    FAILS(kpl_convert_imagefolder(dir, tmp_path("flat_out"), NULL, NULL, NULL), KPL_EFORMAT,
          "no class folders (want root/<class>/<image>; for images without classes use the "
          "images source)");
}

static int teardown_images(void **state)
{
    for (int i = 0; i < NFILES - 1; i++) free(bytes[i]);
    return teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_images_import),
        cmocka_unit_test(test_images_refused),
    };
    return cmocka_run_group_tests(tests, setup, teardown_images);
}
