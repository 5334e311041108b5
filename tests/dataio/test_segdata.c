/* test_segdata.c — segmentation data: Pascal VOC's SegmentationClass
 * (palette masks whose colours are not their indices) and the SBD "aug"
 * layout, image and mask folders (pairs by stem, unmatched files, sizes,
 * truncated files, 16-bit masks, class values, nothing left behind on
 * failure), COCO's semantic masks (classes, overlaps, crowd regions), and
 * fmnist-seg against fmnist-det's scenes. */
#define _GNU_SOURCE /* asprintf */
#define KPL_TEST_NAME "segdata"
#include "dataio_test.h"
#include "convert_impl.h"
#include "image_files.h"

#include <jansson.h>
#include <sys/stat.h>
#include <unistd.h>

static void mkdirs(const char *p)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", p);
    assert_int_equal(system(cmd), 0);
}

static void write_text(const char *path, const char *text) { write_bytes(path, text, strlen(text)); }

/* VOC's palette: index k has the colour of k's bits interleaved. */
static void voc_palette(uint8_t pal[256 * 3])
{
    for (int k = 0; k < 256; k++) {
        int r = 0, g = 0, b = 0;
        for (int j = 0, c = k; j < 8; j++, c >>= 3) {
            r |= ((c >> 0) & 1) << (7 - j);
            g |= ((c >> 1) & 1) << (7 - j);
            b |= ((c >> 2) & 1) << (7 - j);
        }
        pal[3 * k] = (uint8_t)r, pal[3 * k + 1] = (uint8_t)g, pal[3 * k + 2] = (uint8_t)b;
    }
}

/* A mask PNG of values v (h x w): palette (VOC's colours) or 8-bit gray. */
static void write_mask(const char *path, const uint8_t *v, int w, int h, bool palette)
{
    static uint8_t pal[256 * 3];
    voc_palette(pal);
    png_image im;
    memset(&im, 0, sizeof im);
    im.version = PNG_IMAGE_VERSION;
    im.width = (png_uint_32)w;
    im.height = (png_uint_32)h;
    im.format = palette ? PNG_FORMAT_RGB_COLORMAP : PNG_FORMAT_GRAY;
    im.colormap_entries = palette ? 256 : 0;
    assert_true(png_image_write_to_file(&im, path, 0, v, 0, palette ? pal : NULL));
}

/* A 16-bit gray PNG of values v, through the full libpng API. */
static void write_mask16(const char *path, const uint16_t *v, int w, int h)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png_create_info_struct(png);
    if (setjmp(png_jmpbuf(png))) fail_msg("png16 write failed");
    png_init_io(png, f);
    png_set_IHDR(png, info, (png_uint_32)w, (png_uint_32)h, 16, PNG_COLOR_TYPE_GRAY,
                 PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    uint8_t *row = malloc((size_t)w * 2);
    for (int y = 0; y < h; y++) {
        for (int x = 0; x < w; x++) row[2 * x] = (uint8_t)(v[y * w + x] >> 8), row[2 * x + 1] = (uint8_t)v[y * w + x];
        png_write_row(png, row);
    }
    png_write_end(png, NULL);
    png_destroy_write_struct(&png, &info);
    free(row);
    fclose(f);
}

static void write_jpeg_file(const char *path, int w, int h, int seed)
{
    unsigned long len;
    unsigned char *j = make_jpeg(w, h, seed, &len);
    write_bytes(path, j, len);
    tjFree(j);
}

/* Values v (h x w) for test image k: a code of the position and k, with
 * `special` (a class or 255) in the top left 3x3. */
static void mask_values(uint8_t *v, int w, int h, int k, int classes, int special)
{
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) v[y * w + x] = (uint8_t)((x + 2 * y + k) % classes);
    for (int y = 0; y < 3; y++)
        for (int x = 0; x < 3; x++) v[y * w + x] = (uint8_t)special;
}

/* Every record's mask decodes (as the loader does) to want[i] (w x h). */
static void assert_record_masks(const char *dir, int n, const int *w, const int *h,
                                uint8_t *const *want)
{
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(dir, &ds));
    assert_int_equal(kpl_dataset_num_examples(ds), n);
    int fm = kpl_dataset_find_feature(ds, "mask"), fh = kpl_dataset_find_feature(ds, "height");
    int fw = kpl_dataset_find_feature(ds, "width");
    assert_true(fm >= 0 && fh >= 0 && fw >= 0);
    assert_string_equal(kpl_dataset_feature(ds, fm)->encoding, "png");
    kpl_chunk *c = kpl_chunk_create();
    kpl__decoder *d = kpl__decoder_create();
    for (int i = 0; i < n; i++) {
        kpl_feature_value v[16];
        OK(kpl_dataset_read_example(ds, i, c, v));
        int64_t hh, ww;
        memcpy(&hh, v[fh].data, 8);
        memcpy(&ww, v[fw].data, 8);
        assert_int_equal(hh, h[i]);
        assert_int_equal(ww, w[i]);
        kpl__img_view m;
        OK(kpl__mask_decode(d, v[fm].data, v[fm].count, "png", w[i], h[i], "mask", &m));
        for (int y = 0; y < h[i]; y++)
            for (int x = 0; x < w[i]; x++)
                if (m.data[y * m.stride + x] != want[i][y * w[i] + x])
                    fail_msg("%s example %d: mask (%d, %d) is %d, want %d", dir, i, x, y,
                             m.data[y * m.stride + x], want[i][y * w[i] + x]);
    }
    kpl__decoder_destroy(d);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
}

static int count_lines(const char *path)
{
    char *t = NULL;
    OK(kpl__read_file(path, &t, NULL));
    int n = 0;
    for (char *c = t; *c; c++) n += *c == '\n';
    free(t);
    return n;
}

/* ---- Pascal VOC ---------------------------------------------------------------- */

static void test_voc_seg(void **state)
{
    (void)state;
    char root[256]; /* tmp_path's buffers rotate */
    snprintf(root, sizeof root, "%s", tmp_path("VOC"));
    char p[512];
    snprintf(p, sizeof p, "%s/ImageSets/Segmentation", root);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/JPEGImages", root);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/SegmentationClass", root);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/ImageSets/Segmentation/train.txt", root);
    write_text(p, "2007_000032\n2007_000039\n");
    const char *ids[2] = {"2007_000032", "2007_000039"};
    int w[2] = {40, 24}, h[2] = {30, 36};
    uint8_t *want[2];
    for (int k = 0; k < 2; k++) {
        snprintf(p, sizeof p, "%s/JPEGImages/%s.jpg", root, ids[k]);
        write_jpeg_file(p, w[k], h[k], k + 3);
        want[k] = malloc((size_t)w[k] * h[k]);
        mask_values(want[k], w[k], h[k], k, 21, 255);
        snprintf(p, sizeof p, "%s/SegmentationClass/%s.png", root, ids[k]);
        write_mask(p, want[k], w[k], h[k], true);
    }
    int64_t n = 0, skipped = -1;
    const char *out = tmp_path("voc_seg_train");
    OK(kpl_convert_voc_seg(root, "train", NULL, out, NULL, &n, &skipped));
    assert_int_equal(n, 2);
    assert_int_equal(skipped, 0);
    /* the indices, not the palette's colours */
    assert_record_masks(out, 2, w, h, want);
    snprintf(p, sizeof p, "%s/classes.txt", out);
    assert_int_equal(count_lines(p), 21);
    char *cl = NULL;
    OK(kpl__read_file(p, &cl, NULL));
    assert_true(!strncmp(cl, "background\naeroplane\nbicycle\n", 29));
    assert_non_null(strstr(cl, "\ntvmonitor\n"));
    free(cl);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(out, &ds));
    assert_non_null(strstr(kpl_dataset_attributes(ds), "\"masks_dir\":\"SegmentationClass\""));
    assert_string_equal(kpl_dataset_feature(ds, 0)->encoding, "jpeg");
    kpl_chunk *c = kpl_chunk_create();
    kpl_feature_value v[5];
    OK(kpl_dataset_read_example(ds, 1, c, v));
    assert_int_equal(v[2].count, strlen("JPEGImages/2007_000039.jpg"));
    assert_memory_equal(v[2].data, "JPEGImages/2007_000039.jpg", v[2].count);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);

    /* A mask value that is no VOC class (21..254) is bad, naming the file. */
    want[1][5 * w[1] + 7] = 30;
    snprintf(p, sizeof p, "%s/SegmentationClass/%s.png", root, ids[1]);
    write_mask(p, want[1], w[1], h[1], true);
    FAILS(kpl_convert_voc_seg(root, "train", NULL, tmp_path("voc_bad"), NULL, NULL, NULL),
          KPL_EFORMAT, "SegmentationClass/2007_000039.png: value 30 at (x 7, y 5) is neither a "
          "class (0..20) nor 255 (ignore)");
    assert_int_equal(access(tmp_path("voc_bad"), F_OK), -1); /* nothing left behind */

    /* The SBD aug layout: SegmentationClassAug's gray masks, chosen because
     * SegmentationClass lacks a listed id. */
    snprintf(p, sizeof p, "%s/SegmentationClassAug", root);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/ImageSets/Segmentation/train_aug.txt", root);
    write_text(p, "2007_000032\n2008_000002\n");
    snprintf(p, sizeof p, "%s/JPEGImages/2008_000002.jpg", root);
    write_jpeg_file(p, 24, 36, 9);
    mask_values(want[1], 24, 36, 1, 21, 0);
    const char *aug_ids[2] = {"2007_000032", "2008_000002"};
    for (int k = 0; k < 2; k++) {
        snprintf(p, sizeof p, "%s/SegmentationClassAug/%s.png", root, aug_ids[k]);
        write_mask(p, want[k], w[k], h[k], false);
    }
    out = tmp_path("voc_seg_aug");
    OK(kpl_convert_voc_seg(root, "train_aug", NULL, out, NULL, &n, &skipped));
    assert_record_masks(out, 2, w, h, want);
    OK(kpl_dataset_open(out, &ds));
    assert_non_null(strstr(kpl_dataset_attributes(ds), "\"masks_dir\":\"SegmentationClassAug\""));
    kpl_dataset_close(ds);
    /* --masks-dir forces the other: 2008_000002 has no mask there */
    FAILS(kpl_convert_voc_seg(root, "train_aug", "SegmentationClass", tmp_path("voc_forced"),
                              NULL, NULL, NULL),
          KPL_EFORMAT, "voc-seg: JPEGImages/2008_000002.jpg: mask: cannot read (");
    assert_non_null(strstr(kpl_last_error(), "SegmentationClass/2008_000002.png: No such file"));
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.skip_bad = true;
    OK(kpl_convert_voc_seg(root, "train_aug", "SegmentationClass", tmp_path("voc_forced"), &o,
                           &n, &skipped));
    assert_int_equal(n, 1);
    assert_int_equal(skipped, 1);
    free(want[0]);
    free(want[1]);
}

/* ---- image and mask folders ------------------------------------------------------- */

static void test_mask_folders(void **state)
{
    (void)state;
    char im[256], mk[256];
    snprintf(im, sizeof im, "%s", tmp_path("mf/images"));
    snprintf(mk, sizeof mk, "%s", tmp_path("mf/masks"));
    mkdirs(im);
    mkdirs(mk);
    char p[512], q[512];
    int w[3] = {20, 33, 16}, h[3] = {14, 9, 16};
    const char *names[3] = {"a.jpg", "b.png", "c.jpeg"};
    uint8_t *want[3];
    for (int k = 0; k < 3; k++) {
        snprintf(p, sizeof p, "%s/%s", im, names[k]);
        if (k == 1) {
            size_t len;
            unsigned char *png = make_png(w[k], h[k], 5, &len);
            write_bytes(p, png, len);
            free(png);
        } else {
            write_jpeg_file(p, w[k], h[k], k + 1);
        }
        want[k] = malloc((size_t)w[k] * h[k]);
        mask_values(want[k], w[k], h[k], k, 4, k == 2 ? 255 : 3);
        snprintf(p, sizeof p, "%s/%c.png", mk, 'a' + k);
        if (k == 2) { /* 16-bit gray, values <= 255: stored re-encoded as 8 bits */
            uint16_t v16[16 * 16];
            for (int i = 0; i < 16 * 16; i++) v16[i] = want[k][i];
            write_mask16(p, v16, w[k], h[k]);
        } else {
            write_mask(p, want[k], w[k], h[k], k == 1);
        }
    }
    snprintf(p, sizeof p, "%s/names.txt", tmp_root);
    write_text(p, "background\ncat\ndog\n\nbird\n");
    char classes[256];
    snprintf(classes, sizeof classes, "%s", tmp_path("names.txt"));
    int64_t n = 0, skipped = -1;
    const char *out = tmp_path("mf_out");
    OK(kpl_convert_masks(im, mk, classes, out, NULL, &n, &skipped));
    assert_int_equal(n, 3);
    assert_int_equal(skipped, 0);
    assert_record_masks(out, 3, w, h, want);
    snprintf(p, sizeof p, "%s/classes.txt", out);
    assert_int_equal(count_lines(p), 4);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(out, &ds));
    assert_string_equal(kpl_dataset_feature(ds, 0)->encoding, ""); /* JPEGs and a PNG */
    kpl_chunk *c = kpl_chunk_create();
    kpl_feature_value v[5];
    OK(kpl_dataset_read_example(ds, 2, c, v));
    assert_memory_equal(v[2].data, "c.jpeg", 6);
    assert_int_equal(((const uint8_t *)v[1].data)[24], 8); /* IHDR bit depth: 8 */
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);

    /* With 3 classes, value 3 is none: the error names the file and value. */
    snprintf(p, sizeof p, "%s/three.txt", tmp_root);
    write_text(p, "background\ncat\ndog\n");
    FAILS(kpl_convert_masks(im, mk, p, tmp_path("mf_x"), NULL, NULL, NULL), KPL_EFORMAT,
          "masks/a.png: value 3 at (x 0, y 0) is neither a class (0..2) nor 255");

    /* A 16-bit value past 255. */
    uint16_t v16[16 * 16];
    for (int i = 0; i < 16 * 16; i++) v16[i] = want[2][i];
    v16[3 * 16 + 4] = 256;
    snprintf(p, sizeof p, "%s/c.png", mk);
    write_mask16(p, v16, 16, 16);
    FAILS(kpl_convert_masks(im, mk, NULL, tmp_path("mf_x"), NULL, NULL, NULL), KPL_EFORMAT,
          "masks/c.png: 16-bit mask value 256 at (x 4, y 3) is past 255");
    v16[3 * 16 + 4] = 1;
    write_mask16(p, v16, 16, 16);

    /* A mask of another size names both files and both sizes. */
    uint8_t small[10 * 7] = {0};
    snprintf(p, sizeof p, "%s/b.png", mk);
    write_mask(p, small, 10, 7, false);
    FAILS(kpl_convert_masks(im, mk, NULL, tmp_path("mf_x"), NULL, NULL, NULL), KPL_EFORMAT,
          "masks/b.png is 10x7, image ");
    assert_non_null(strstr(kpl_last_error(), "images/b.png is 33x9 (width x height)"));
    assert_int_equal(access(tmp_path("mf_x"), F_OK), -1);
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.skip_bad = true;
    OK(kpl_convert_masks(im, mk, NULL, tmp_path("mf_skip1"), &o, &n, &skipped));
    assert_int_equal(n, 2);
    assert_int_equal(skipped, 1);
    write_mask(p, want[1], w[1], h[1], true);

    /* A truncated mask, a truncated JPEG: errors naming the file. */
    size_t len;
    char *bytes = NULL;
    snprintf(p, sizeof p, "%s/a.png", mk);
    OK(kpl__read_file(p, &bytes, &len));
    write_bytes(p, bytes, len / 2);
    FAILS(kpl_convert_masks(im, mk, NULL, tmp_path("mf_x"), NULL, NULL, NULL), KPL_EFORMAT,
          "masks/a.png: PNG: ");
    write_bytes(p, bytes, len);
    free(bytes);
    snprintf(q, sizeof q, "%s/c.jpeg", im);
    OK(kpl__read_file(q, &bytes, &len));
    write_bytes(q, bytes, len - 40);
    FAILS(kpl_convert_masks(im, mk, NULL, tmp_path("mf_x"), NULL, NULL, NULL), KPL_EFORMAT,
          "masks: c.jpeg: image ");
    assert_non_null(strstr(kpl_last_error(), "images/c.jpeg: "));
    write_bytes(q, bytes, len);
    free(bytes);

    /* An image without a mask, a mask without an image. */
    snprintf(p, sizeof p, "%s/d.jpg", im);
    write_jpeg_file(p, 8, 8, 1);
    FAILS(kpl_convert_masks(im, mk, NULL, tmp_path("mf_x"), NULL, NULL, NULL), KPL_EFORMAT,
          "images/d.jpg has no mask ");
    OK(kpl_convert_masks(im, mk, NULL, tmp_path("mf_skip2"), &o, &n, &skipped));
    assert_int_equal(n, 3);
    assert_int_equal(skipped, 1);
    unlink(p);
    snprintf(p, sizeof p, "%s/e.png", mk);
    write_mask(p, small, 10, 7, false);
    FAILS(kpl_convert_masks(im, mk, NULL, tmp_path("mf_x"), NULL, NULL, NULL), KPL_EFORMAT,
          "masks/e.png has no image in ");
    unlink(p);
    /* two images of one stem */
    snprintf(p, sizeof p, "%s/a.png", im);
    write_bytes(p, "x", 1);
    FAILS(kpl_convert_masks(im, mk, NULL, tmp_path("mf_x"), NULL, NULL, NULL), KPL_EFORMAT,
          "have the same stem");
    unlink(p);
    o = (kpl_convert_options)KPL_CONVERT_OPTIONS_INIT;
    o.max_side = 100;
    FAILS(kpl_convert_masks(im, mk, NULL, tmp_path("mf_x"), &o, NULL, NULL), KPL_EINVAL,
          "max_side 100 would re-encode images");
    assert_int_equal(access(tmp_path("mf_x"), F_OK), -1);
    for (int k = 0; k < 3; k++) free(want[k]);
}

/* ---- COCO semantic masks ---------------------------------------------------------- */

static void test_coco_semantic(void **state)
{
    (void)state;
    char dir[256];
    snprintf(dir, sizeof dir, "%s", tmp_path("coco_sem"));
    mkdirs(dir);
    char p[512];
    snprintf(p, sizeof p, "%s/1.jpg", dir);
    write_jpeg_file(p, 20, 16, 2);
    /* Categories 7 (label 0, mask 1) and 9 (label 1, mask 2).  Object 1
     * (cat 7): x 2..10, y 2..8; object 2 (cat 9): x 8..14, y 4..12, over
     * object 1 in x 8..10, y 4..8: 255; object 3 (cat 7): x 1..3, y 10..14
     * and object 4 (cat 7) over it in x 2..4: one class, kept; a crowd
     * RLE (cat 9) of column 18, rows 0..16: 255. */
    char *json = NULL;
    int crowd_counts = 18 * 16;
    if (asprintf(&json,
                 "{\"images\": [{\"id\": 1, \"file_name\": \"1.jpg\", \"width\": 20, \"height\": "
                 "16}], \"categories\": [{\"id\": 9, \"name\": \"dog\"}, {\"id\": 7, \"name\": "
                 "\"cat\"}], \"annotations\": ["
                 "{\"id\": 1, \"image_id\": 1, \"category_id\": 7, \"bbox\": [2, 2, 8, 6], "
                 "\"area\": 48, \"iscrowd\": 0, \"segmentation\": [[2, 2, 10, 2, 10, 8, 2, 8]]},"
                 "{\"id\": 2, \"image_id\": 1, \"category_id\": 9, \"bbox\": [8, 4, 6, 8], "
                 "\"area\": 48, \"iscrowd\": 0, \"segmentation\": [[8, 4, 14, 4, 14, 12, 8, 12]]},"
                 "{\"id\": 3, \"image_id\": 1, \"category_id\": 7, \"bbox\": [1, 10, 2, 4], "
                 "\"area\": 8, \"iscrowd\": 0, \"segmentation\": [[1, 10, 3, 10, 3, 14, 1, 14]]},"
                 "{\"id\": 4, \"image_id\": 1, \"category_id\": 7, \"bbox\": [2, 10, 2, 4], "
                 "\"area\": 8, \"iscrowd\": 0, \"segmentation\": [[2, 10, 4, 10, 4, 14, 2, 14]]},"
                 "{\"id\": 5, \"image_id\": 1, \"category_id\": 9, \"bbox\": [18, 0, 1, 16], "
                 "\"area\": 16, \"iscrowd\": 1, \"segmentation\": {\"size\": [16, 20], "
                 "\"counts\": [%d, 16, 16]}}]}", crowd_counts) < 0)
        fail();
    snprintf(p, sizeof p, "%s/ann.json", tmp_root);
    write_text(p, json);
    free(json);
    /* the polygon rasterisation of each square, by pycocotools' rule (the
     * test asserts it against kpl_mask_fill_polygon, tested elsewhere) */
    uint8_t want[16 * 20] = {0}, sq[16 * 20];
    const double polys[4][8] = {{2, 2, 10, 2, 10, 8, 2, 8}, {8, 4, 14, 4, 14, 12, 8, 12},
                                {1, 10, 3, 10, 3, 14, 1, 14}, {2, 10, 4, 10, 4, 14, 2, 14}};
    const int cls[4] = {1, 2, 1, 1};
    for (int k = 0; k < 4; k++) {
        memset(sq, 0, sizeof sq);
        OK(kpl_mask_fill_polygon(polys[k], 4, 16, 20, sq));
        for (int i = 0; i < 16 * 20; i++)
            if (sq[i]) want[i] = want[i] && want[i] != cls[k] ? 255 : (uint8_t)cls[k];
    }
    for (int y = 0; y < 16; y++) want[y * 20 + 18] = 255;
    assert_int_equal(want[5 * 20 + 9], 255); /* the overlap of two classes */
    assert_int_equal(want[5 * 20 + 4], 1);
    assert_int_equal(want[6 * 20 + 12], 2);
    assert_int_equal(want[11 * 20 + 2], 1); /* an overlap of one class */
    assert_int_equal(want[0], 0);

    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.semantic = true;
    const char *out = tmp_path("coco_sem_out");
    OK(kpl_convert_coco(p, dir, out, &o, NULL));
    int w = 20, h = 16;
    uint8_t *wl[1] = {want};
    assert_record_masks(out, 1, &w, &h, wl);
    char cp[512];
    snprintf(cp, sizeof cp, "%s/classes.txt", out);
    char *cl = NULL;
    OK(kpl__read_file(cp, &cl, NULL));
    assert_string_equal(cl, "background\ncat\ndog\n");
    free(cl);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(out, &ds));
    assert_int_equal(kpl_dataset_num_features(ds), 13);
    assert_int_equal(kpl_dataset_find_feature(ds, "masks"), 11); /* detection's stay */
    kpl_dataset_close(ds);
    /* Without --semantic the records are detection's as before. */
    out = tmp_path("coco_det_out");
    OK(kpl_convert_coco(p, dir, out, NULL, NULL));
    OK(kpl_dataset_open(out, &ds));
    assert_int_equal(kpl_dataset_num_features(ds), 12);
    assert_int_equal(kpl_dataset_find_feature(ds, "mask"), -1);
    kpl_dataset_close(ds);
    snprintf(cp, sizeof cp, "%s/classes.txt", out);
    assert_int_equal(count_lines(cp), 2);
}

/* ---- fmnist-seg ------------------------------------------------------------------ */

static const char *fmnist = "/usr/share/datasets/fashion-mnist";

/* fmnist-seg's masks are fmnist-det's objects as classes: each object's RLE
 * pixels hold its category id (label + 1), all others 0; the JPEGs are
 * the same bytes; the bytes do not depend on the thread count. */
static void test_synth_fmnist_seg(void **state)
{
    (void)state;
    char p[512], q[512];
    snprintf(p, sizeof p, "%s/train-images-idx3-ubyte.gz", fmnist);
    snprintf(q, sizeof q, "%s/train-images-idx3-ubyte", fmnist);
    if (access(p, R_OK) && access(q, R_OK))
        KPL_SKIP(KPL_TEST_SKIP_REF, "Fashion-MNIST (dataset-fashion-mnist)");
    kpl_synth_det_config c = KPL_SYNTH_DET_CONFIG_INIT;
    c.train = 12, c.val = 4, c.size = 64, c.max_side = 40, c.seed = 3, c.threads = 2;
    int64_t nd = 0, ns = 0;
    OK(kpl_synth_fmnist_det(tmp_path("fd"), &c, &nd));
    OK(kpl_synth_fmnist_seg(tmp_path("fs"), &c, &ns));
    assert_int_equal(nd, ns);
    c.threads = 1;
    OK(kpl_synth_fmnist_seg(tmp_path("fs1"), &c, &ns));
    snprintf(p, sizeof p, "diff -r '%s' '%s'", tmp_path("fs"), tmp_path("fs1"));
    assert_int_equal(system(p), 0);
    snprintf(p, sizeof p, "%s/classes.txt", tmp_path("fs"));
    assert_int_equal(count_lines(p), 11);
    FAILS(kpl_synth_fmnist_seg(tmp_path("fs"), &c, NULL), KPL_EINVAL, "fmnist-seg: ");

    static const char *const split[2] = {"train", "val"};
    kpl__decoder *d = kpl__decoder_create();
    int64_t labelled = 0;
    for (int s = 0; s < 2; s++) {
        snprintf(p, sizeof p, "%s/%s.json", tmp_path("fd"), split[s]);
        json_error_t err;
        json_t *root = json_load_file(p, 0, &err);
        assert_non_null(root);
        json_t *anns = json_object_get(root, "annotations");
        for (int64_t id = 1; id <= (s ? 4 : 12); id++) {
            char *a = NULL, *b = NULL;
            size_t la, lb;
            snprintf(p, sizeof p, "%s/%s/%06lld.jpg", tmp_path("fd"), split[s], (long long)id);
            snprintf(q, sizeof q, "%s/%s/images/%06lld.jpg", tmp_path("fs"), split[s],
                     (long long)id);
            OK(kpl__read_file(p, &a, &la));
            OK(kpl__read_file(q, &b, &lb));
            assert_int_equal(la, lb);
            assert_memory_equal(a, b, la);
            free(a);
            free(b);
            snprintf(q, sizeof q, "%s/%s/masks/%06lld.png", tmp_path("fs"), split[s],
                     (long long)id);
            OK(kpl__read_file(q, &b, &lb));
            kpl__img_view m;
            OK(kpl__mask_decode(d, b, lb, "png", 64, 64, q, &m));
            uint8_t want[64 * 64] = {0}, bin[64 * 64];
            for (size_t k = 0; k < json_array_size(anns); k++) {
                json_t *an = json_array_get(anns, k);
                if (json_integer_value(json_object_get(an, "image_id")) != id) continue;
                const char *rle = json_string_value(
                    json_object_get(json_object_get(an, "segmentation"), "counts"));
                kpl_rle r;
                OK(kpl_rle_from_string(rle, strlen(rle), 64, 64, &r));
                OK(kpl_rle_decode(&r, bin));
                kpl_rle_free(&r);
                int cat = (int)json_integer_value(json_object_get(an, "category_id"));
                for (int i = 0; i < 64 * 64; i++)
                    if (bin[i]) {
                        assert_int_equal(want[i], 0); /* det's masks are disjoint */
                        want[i] = (uint8_t)cat;
                    }
            }
            for (int i = 0; i < 64 * 64; i++) {
                assert_int_equal(m.data[(i / 64) * m.stride + i % 64], want[i]);
                labelled += want[i] != 0;
            }
            free(b);
        }
        json_decref(root);
    }
    assert_true(labelled > 1000);
    kpl__decoder_destroy(d);
    /* and --from masks reads it */
    snprintf(p, sizeof p, "%s/train/images", tmp_path("fs"));
    snprintf(q, sizeof q, "%s/train/masks", tmp_path("fs"));
    char cls[512];
    snprintf(cls, sizeof cls, "%s/classes.txt", tmp_path("fs"));
    int64_t n = 0;
    OK(kpl_convert_masks(p, q, cls, tmp_path("fs_rec"), NULL, &n, NULL));
    assert_int_equal(n, 12);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_voc_seg),
        cmocka_unit_test(test_mask_folders),
        cmocka_unit_test(test_coco_semantic),
        cmocka_unit_test(test_synth_fmnist_seg),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
