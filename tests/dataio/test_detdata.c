/* test_detdata.c — detection data: COCO's RLE and polygon rasterisation
 * against pycocotools' own output (tests/dataio/data/coco_rle_ref.txt,
 * made by gen_coco_rle_refs.py) and against pixel sets known exactly; the
 * COCO converter on a JSON the test writes (polygons, both RLE forms, crowd
 * regions, non-contiguous category ids, an image without annotations, each
 * kind of bad annotation and image, malformed JSON); the VOC converter on a
 * tree the test writes; and the synthetic fmnist-det set: the same seed
 * gives the same bytes, boxes are tight around the masks, 1..8 objects an
 * image, and the set converts through --from coco and loads with the
 * loader's boxes. */
#define KPL_TEST_NAME "detdata"
#include "dataio_test.h"
#include "convert_impl.h"
#include "image_files.h"

#include <dirent.h>
#include <jansson.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef KPL_TEST_DATA_DIR
#error "KPL_TEST_DATA_DIR must name tests/dataio/data"
#endif

/* ---- helpers --------------------------------------------------------------------- */

/* A w x h JPEG (pixels depend on seed) written to path; its bytes into
 * *out (malloc'd) when out. */
static void write_jpeg(const char *path, int w, int h, int seed, uint8_t **out, size_t *len)
{
    unsigned long n = 0;
    unsigned char *jpg = make_jpeg(w, h, seed, &n);
    write_bytes(path, jpg, n);
    if (out) {
        *out = malloc(n);
        memcpy(*out, jpg, n);
        *len = n;
    }
    tjFree(jpg);
}

static void write_png(const char *path, int w, int h)
{
    size_t n = 0;
    unsigned char *png = make_png(w, h, 7, &n);
    write_bytes(path, png, n);
    free(png);
}

static void write_text(const char *path, const char *text)
{
    write_bytes(path, text, strlen(text));
}

/* Row-major (h, w) mask with [x0, x1) x [y0, y1) set. */
static uint8_t *rect_mask(int h, int w, int x0, int y0, int x1, int y1)
{
    uint8_t *m = calloc((size_t)h * w, 1);
    for (int y = y0; y < y1; y++)
        for (int x = x0; x < x1; x++) m[y * w + x] = 1;
    return m;
}

/* Decodes one line of a masks feature and compares it with want. */
static void assert_mask(const char *rle, size_t len, int h, int w, const uint8_t *want)
{
    kpl_rle r;
    OK(kpl_rle_from_string(rle, len, h, w, &r));
    uint8_t *m = malloc((size_t)h * w);
    OK(kpl_rle_decode(&r, m));
    for (int i = 0; i < h * w; i++)
        if (m[i] != want[i]) fail_msg("mask pixel (%d, %d): %d, want %d", i % w, i / w, m[i], want[i]);
    free(m);
    kpl_rle_free(&r);
}

/* The n-th '\n'-separated line of a masks value. */
static void mask_line(const kpl_feature_value *v, int n, const char **s, size_t *len)
{
    const char *p = v->data, *end = p + v->count;
    for (int k = 0; k < n; k++) {
        p = memchr(p, '\n', (size_t)(end - p));
        assert_non_null(p);
        p++;
    }
    const char *e = memchr(p, '\n', (size_t)(end - p));
    *s = p;
    *len = (size_t)((e ? e : end) - p);
}

static int64_t i64_at(const kpl_feature_value *v, int k)
{
    int64_t x;
    memcpy(&x, (const char *)v->data + 8 * k, 8);
    return x;
}

static float f32_at(const kpl_feature_value *v, int k)
{
    float x;
    memcpy(&x, (const char *)v->data + 4 * k, 4);
    return x;
}

/* ---- RLE and polygons -------------------------------------------------------------- */

/* pycocotools' strings for random polygons and masks, byte for byte. */
static void test_rle_matches_pycocotools(void **state)
{
    (void)state;
    FILE *f = fopen(KPL_TEST_DATA_DIR "/coco_rle_ref.txt", "r");
    assert_non_null(f);
    char *line = NULL;
    size_t cap = 0;
    int npoly = 0, ncounts = 0;
    while (getline(&line, &cap, f) > 0) {
        char kind[16];
        int h, w, off = 0;
        assert_int_equal(sscanf(line, "%15s %d %d | %n", kind, &h, &w, &off), 3);
        char *body = line + off, *bar = strstr(body, " | ");
        assert_non_null(bar);
        *bar = 0;
        char *want = bar + 3;
        want[strcspn(want, "\n")] = 0;
        kpl_rle r;
        if (!strcmp(kind, "poly")) {
            uint8_t *m = calloc((size_t)h * w, 1);
            for (char *part = strtok(body, ";"); part; part = strtok(NULL, ";")) {
                double xy[64];
                int n = 0;
                for (char *t = part, *e; n < 64; t = e) {
                    xy[n] = strtod(t, &e);
                    if (e == t) break;
                    n++;
                }
                OK(kpl_mask_fill_polygon(xy, n / 2, h, w, m));
            }
            OK(kpl_rle_encode(m, h, w, &r));
            free(m);
            npoly++;
        } else {
            uint32_t c[4096];
            int n = 0;
            for (char *t = body, *e; n < 4096; t = e) {
                c[n] = (uint32_t)strtoul(t, &e, 10);
                if (e == t) break;
                n++;
            }
            r = (kpl_rle){h, w, n, malloc(sizeof *c * (size_t)n)};
            memcpy(r.counts, c, sizeof *c * (size_t)n);
            /* the string parses back to the same counts */
            kpl_rle back;
            OK(kpl_rle_from_string(want, strlen(want), h, w, &back));
            assert_int_equal(back.n, n);
            assert_memory_equal(back.counts, c, sizeof *c * (size_t)n);
            kpl_rle_free(&back);
            ncounts++;
        }
        char *s = NULL;
        size_t len = 0;
        OK(kpl_rle_to_string(&r, &s, &len));
        if (strcmp(s, want)) fail_msg("%s %dx%d: got %s, pycocotools %s", kind, h, w, s, want);
        assert_int_equal(len, strlen(want));
        free(s);
        kpl_rle_free(&r);
    }
    free(line);
    fclose(f);
    assert_int_equal(npoly, 300);
    assert_int_equal(ncounts, 60);
}

/* Pixel sets known exactly: a pixel is in when its center is inside, away
 * from the boundary's rounding (5x supersampling). */
static void test_polygon_exact_pixels(void **state)
{
    (void)state;
    const int h = 20, w = 24;
    /* integer rectangle [3, 11) x [2, 9) */
    double rect[8] = {3, 2, 11, 2, 11, 9, 3, 9};
    uint8_t *m = calloc(h * w, 1), *want = rect_mask(h, w, 3, 2, 11, 9);
    OK(kpl_mask_fill_polygon(rect, 4, h, w, m));
    assert_memory_equal(m, want, h * w);
    /* fractional corners: x in [2.3, 7.6] covers centers 2.5 .. 7.5 */
    double frac[8] = {2.3, 1.2, 7.6, 1.2, 7.6, 4.8, 2.3, 4.8};
    free(want);
    want = rect_mask(h, w, 2, 1, 8, 5);
    memset(m, 0, h * w);
    OK(kpl_mask_fill_polygon(frac, 4, h, w, m));
    assert_memory_equal(m, want, h * w);
    /* right triangle (0,0) (9.6,0) (0,9.6): centers with x + y < 9.6, i.e.
     * columns n, rows r with n + r <= 8 (45 pixels), in either winding */
    double tri[2][6] = {{0, 0, 9.6, 0, 0, 9.6}, {0, 9.6, 9.6, 0, 0, 0}};
    for (int k = 0; k < 2; k++) {
        memset(m, 0, h * w);
        OK(kpl_mask_fill_polygon(tri[k], 3, h, w, m));
        int area = 0;
        for (int y = 0; y < h; y++)
            for (int x = 0; x < w; x++) {
                assert_int_equal(m[y * w + x], x + y <= 8);
                area += m[y * w + x];
            }
        assert_int_equal(area, 45);
    }
    /* a rectangle reaching past the image is clipped to it */
    double past[8] = {-3, -2, 30, -2, 30, 5, -3, 5};
    free(want);
    want = rect_mask(h, w, 0, 0, w, 5);
    memset(m, 0, h * w);
    OK(kpl_mask_fill_polygon(past, 4, h, w, m));
    assert_memory_equal(m, want, h * w);
    /* two calls give the union */
    double a[8] = {0, 0, 4, 0, 4, 4, 0, 4}, b[8] = {2, 2, 6, 2, 6, 6, 2, 6};
    memset(m, 0, h * w);
    OK(kpl_mask_fill_polygon(a, 4, h, w, m));
    OK(kpl_mask_fill_polygon(b, 4, h, w, m));
    int area = 0;
    for (int i = 0; i < h * w; i++) area += m[i];
    assert_int_equal(area, 16 + 16 - 4);
    double nan[6] = {0, 0, NAN, 1, 2, 2};
    FAILS(kpl_mask_fill_polygon(nan, 3, h, w, m), KPL_ERANGE, "not finite");
    /* a vertex 13 million pixels away: refused before a walk of 10^8 steps */
    double far[6] = {5, -3, 0, 13333330, -3, -2};
    FAILS(kpl_mask_fill_polygon(far, 3, h, w, m), KPL_ERANGE, "perimeter is past");
    free(m);
    free(want);
}

static void test_rle_round_trip_and_bad_strings(void **state)
{
    (void)state;
    const int h = 7, w = 5;
    uint8_t m[35], back[35];
    for (int i = 0; i < 35; i++) m[i] = (uint8_t)((i * 7 + i / 3) % 3 == 0);
    kpl_rle r;
    OK(kpl_rle_encode(m, h, w, &r));
    int64_t area = 0;
    for (int i = 0; i < 35; i++) area += m[i];
    assert_int_equal(kpl_rle_area(&r), area);
    OK(kpl_rle_decode(&r, back));
    assert_memory_equal(back, m, 35);
    char *s = NULL;
    size_t len;
    OK(kpl_rle_to_string(&r, &s, &len));
    kpl_rle r2;
    OK(kpl_rle_from_string(s, len, h, w, &r2));
    assert_int_equal(r2.n, r.n);
    assert_memory_equal(r2.counts, r.counts, sizeof *r.counts * (size_t)r.n);
    kpl_rle_free(&r2);
    /* a string for another size, a byte outside '0'..'o', a value cut
     * short, a value of 8 characters, a negative run */
    FAILS(kpl_rle_from_string(s, len, h, w + 1, &r2), KPL_EFORMAT, "cover");
    FAILS(kpl_rle_from_string("1p", 2, h, w, &r2), KPL_EFORMAT, "not one of");
    FAILS(kpl_rle_from_string("1X", 2, h, w, &r2), KPL_EFORMAT, "ends inside");
    FAILS(kpl_rle_from_string("PPPPPPPP", 8, h, w, &r2), KPL_EFORMAT, "longer than 7");
    FAILS(kpl_rle_from_string("@", 1, h, w, &r2), KPL_EFORMAT, "negative");
    FAILS(kpl_rle_from_string("", 0, 0, w, &r2), KPL_EINVAL, "mask size");
    kpl_rle_free(&r);
    free(s);
}

/* ---- COCO ------------------------------------------------------------------------ */

/* The images of the good COCO set: id 7 a.jpg 40 x 30, id 3 b.png 32 x 24,
 * id 12 c.jpg 20 x 20 (no annotations), id 5 d.jpg 16 x 16 (a crowd region
 * only).  Categories 90 zebra, 4 ant, 17 cat: labels ant 0, cat 1, zebra 2. */
static char coco_dir[256];
static uint8_t *jpeg_a, *jpeg_c;
static size_t jpeg_a_len, jpeg_c_len;

static void make_coco_images(void)
{
    snprintf(coco_dir, sizeof coco_dir, "%s", tmp_path("coco_img"));
    mkdir(coco_dir, 0777);
    char p[400];
    snprintf(p, sizeof p, "%s/a.jpg", coco_dir);
    write_jpeg(p, 40, 30, 3, &jpeg_a, &jpeg_a_len);
    snprintf(p, sizeof p, "%s/sub", coco_dir);
    mkdir(p, 0777);
    snprintf(p, sizeof p, "%s/sub/b.png", coco_dir);
    write_png(p, 32, 24);
    snprintf(p, sizeof p, "%s/c.jpg", coco_dir);
    write_jpeg(p, 20, 20, 5, &jpeg_c, &jpeg_c_len);
    snprintf(p, sizeof p, "%s/d.jpg", coco_dir);
    write_jpeg(p, 16, 16, 9, NULL, NULL);
}

/* The column-major counts of mask (h, w), as a JSON list. */
static char *counts_json(const uint8_t *m, int h, int w)
{
    char *s = malloc(16 * (size_t)h * w + 8);
    size_t k = (size_t)sprintf(s, "[");
    int run = 0, prev = 0;
    for (int x = 0; x < w; x++)
        for (int y = 0; y < h; y++) {
            int v = m[y * w + x];
            if (v != prev) {
                k += (size_t)sprintf(s + k, "%d,", run);
                run = 0;
                prev = v;
            }
            run++;
        }
    sprintf(s + k, "%d]", run);
    return s;
}

static const char *coco_head =
    "{\"info\": {\"description\": \"test\"},\n"
    " \"images\": [\n"
    "  {\"id\": 7, \"file_name\": \"a.jpg\", \"width\": 40, \"height\": 30},\n"
    "  {\"id\": 12, \"file_name\": \"c.jpg\", \"width\": 20, \"height\": 20},\n"
    "  {\"id\": 3, \"file_name\": \"sub/b.png\", \"width\": 32, \"height\": 24},\n"
    "  {\"id\": 5, \"file_name\": \"d.jpg\", \"width\": 16, \"height\": 16}%s],\n"
    " \"categories\": [{\"id\": 90, \"name\": \"zebra\", \"supercategory\": \"animal\"},\n"
    "  {\"id\": 4, \"name\": \"ant\"}, {\"id\": 17, \"name\": \"cat\"}],\n";

/* The good set's JSON (extra: more images and annotations, each starting
 * with ","). */
static char *good_coco_json(const char *extra_images, const char *extra_anns)
{
    uint8_t *m103 = rect_mask(24, 32, 4, 2, 10, 6), *m104 = rect_mask(24, 32, 20, 10, 31, 20);
    uint8_t *m105 = rect_mask(16, 16, 0, 0, 16, 16);
    char *c103 = counts_json(m103, 24, 32), *c105 = counts_json(m105, 16, 16), *s104 = NULL;
    kpl_rle r;
    OK(kpl_rle_encode(m104, 24, 32, &r));
    OK(kpl_rle_to_string(&r, &s104, NULL));
    kpl_rle_free(&r);
    size_t cap = 1 << 16;
    char *j = malloc(cap);
    size_t k = (size_t)snprintf(j, cap, coco_head, extra_images);
    snprintf(j + k, cap - k,
             " \"annotations\": [\n"
             "  {\"id\": 101, \"image_id\": 7, \"category_id\": 17, \"bbox\": [2, 3, 10, 8],\n"
             "   \"iscrowd\": 0, \"segmentation\": [[2, 3, 12, 3, 12, 11, 2, 11]]},\n"
             "  {\"id\": 102, \"image_id\": 7, \"category_id\": 90, \"bbox\": [20, 5, 9.6, 9.6],\n"
             "   \"area\": 46.08, \"segmentation\": [[20, 5, 29.6, 5, 20, 14.6], [1, 1, 2, 2]]},\n"
             "  {\"id\": 103, \"image_id\": 3, \"category_id\": 4, \"bbox\": [4, 2, 6, 4],\n"
             "   \"iscrowd\": 1, \"area\": 24, \"segmentation\": {\"size\": [24, 32], \"counts\": %s}},\n"
             "  {\"id\": 104, \"image_id\": 3, \"category_id\": 17, \"bbox\": [20, 10, 11, 10],\n"
             "   \"iscrowd\": false, \"segmentation\": {\"size\": [24, 32], \"counts\": \"%s\"}},\n"
             "  {\"id\": 105, \"image_id\": 5, \"category_id\": 4, \"bbox\": [0, 0, 16, 16],\n"
             "   \"iscrowd\": 1, \"segmentation\": {\"size\": [16, 16], \"counts\": %s}},\n"
             "  {\"id\": 106, \"image_id\": 7, \"category_id\": 4, \"bbox\": [-0.5, 20, 10, 10.4]}%s\n"
             " ]}\n",
             c103, s104, c105, extra_anns);
    free(m103);
    free(m104);
    free(m105);
    free(c103);
    free(c105);
    free(s104);
    return j;
}

static void test_coco_convert(void **state)
{
    (void)state;
    make_coco_images();
    char *j = good_coco_json("", "");
    const char *json = tmp_path("coco_good.json");
    write_text(json, j);
    free(j);
    const char *out = tmp_path("coco_out");
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.threads = 2;
    kpl_detection_stats st;
    OK(kpl_convert_coco(json, coco_dir, out, &o, &st));
    assert_int_equal(st.images, 4);
    assert_int_equal(st.objects, 6);
    assert_int_equal(st.skipped_images + st.skipped_objects + st.dropped_empty, 0);
    assert_int_equal(st.clipped_boxes, 1);    /* 106 */
    assert_int_equal(st.dropped_polygons, 1); /* 102's two-point part */

    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(out, &ds));
    static const char *names[12] = {"image", "path", "image_id", "height", "width", "boxes",
                                    "labels", "category_ids", "iscrowd", "area",
                                    "annotation_ids", "masks"};
    assert_int_equal(kpl_dataset_num_features(ds), 12);
    for (int f = 0; f < 12; f++) assert_string_equal(kpl_dataset_feature(ds, f)->name, names[f]);
    assert_string_equal(kpl_dataset_feature(ds, 0)->encoding, ""); /* jpg and png */
    assert_non_null(strstr(kpl_dataset_attributes(ds), "\"category_ids\":[4,17,90]"));
    assert_int_equal(kpl_dataset_num_examples(ds), 4);
    kpl_chunk *c = NN(kpl_chunk_create());
    kpl_feature_value v[12];
    /* image id order: 3, 5, 7, 12 */
    static const int64_t ids[4] = {3, 5, 7, 12}, hs[4] = {24, 16, 30, 20}, ws[4] = {32, 16, 40, 20};
    static const int nobj[4] = {2, 1, 3, 0};
    for (int e = 0; e < 4; e++) {
        OK(kpl_dataset_read_example(ds, e, c, v));
        assert_int_equal(i64_at(&v[2], 0), ids[e]);
        assert_int_equal(i64_at(&v[3], 0), hs[e]);
        assert_int_equal(i64_at(&v[4], 0), ws[e]);
        assert_int_equal(v[5].count, 4 * nobj[e]);
        for (int f = 6; f <= 10; f++) assert_int_equal(v[f].count, nobj[e]);
    }
    /* image 3: 103 (crowd, uncompressed RLE), 104 (compressed RLE) */
    OK(kpl_dataset_read_example(ds, 0, c, v));
    assert_int_equal(v[1].count, strlen("sub/b.png"));
    assert_memory_equal(v[1].data, "sub/b.png", v[1].count);
    static const float b3[8] = {4, 2, 10, 6, 20, 10, 31, 20};
    for (int k = 0; k < 8; k++) assert_float_equal(f32_at(&v[5], k), b3[k], 0);
    assert_int_equal(i64_at(&v[6], 0), 0);  /* ant */
    assert_int_equal(i64_at(&v[6], 1), 1);  /* cat */
    assert_int_equal(i64_at(&v[7], 0), 4);
    assert_int_equal(i64_at(&v[7], 1), 17);
    assert_int_equal(i64_at(&v[8], 0), 1);
    assert_int_equal(i64_at(&v[8], 1), 0);
    assert_float_equal(f32_at(&v[9], 0), 24, 0);   /* given */
    assert_float_equal(f32_at(&v[9], 1), 110, 0);  /* the mask's 11 x 10 pixels */
    assert_int_equal(i64_at(&v[10], 0), 103);
    assert_int_equal(i64_at(&v[10], 1), 104);
    const char *s;
    size_t len;
    uint8_t *want = rect_mask(24, 32, 4, 2, 10, 6);
    mask_line(&v[11], 0, &s, &len);
    assert_mask(s, len, 24, 32, want);
    free(want);
    want = rect_mask(24, 32, 20, 10, 31, 20);
    mask_line(&v[11], 1, &s, &len);
    assert_mask(s, len, 24, 32, want);
    free(want);
    /* image 7: 101 (rectangle polygon), 102 (triangle), 106 (clipped box, no mask) */
    OK(kpl_dataset_read_example(ds, 2, c, v));
    assert_int_equal(v[0].count, jpeg_a_len);
    assert_memory_equal(v[0].data, jpeg_a, jpeg_a_len);
    static const float b7[12] = {2, 3, 12, 11, 20, 5, 29.6f, 14.6f, 0, 20, 9.5f, 30};
    for (int k = 0; k < 12; k++) assert_float_equal(f32_at(&v[5], k), b7[k], 1e-5);
    assert_int_equal(i64_at(&v[6], 0), 1);
    assert_int_equal(i64_at(&v[6], 1), 2);
    assert_int_equal(i64_at(&v[6], 2), 0);
    assert_float_equal(f32_at(&v[9], 0), 80, 0);      /* computed from the mask */
    assert_float_equal(f32_at(&v[9], 1), 46.08f, 0);  /* given */
    assert_float_equal(f32_at(&v[9], 2), 9.5f * 10, 1e-4); /* no mask: the clipped box */
    want = rect_mask(30, 40, 2, 3, 12, 11);
    mask_line(&v[11], 0, &s, &len);
    assert_mask(s, len, 30, 40, want);
    memset(want, 0, 30 * 40);
    for (int y = 0; y < 30; y++)
        for (int x = 0; x < 40; x++) want[y * 40 + x] = x >= 20 && y >= 5 && (x - 20) + (y - 5) <= 8;
    mask_line(&v[11], 1, &s, &len);
    assert_mask(s, len, 30, 40, want);
    free(want);
    mask_line(&v[11], 2, &s, &len);
    assert_int_equal(len, 0); /* no segmentation: an empty line */
    /* image 12: no objects */
    OK(kpl_dataset_read_example(ds, 3, c, v));
    assert_int_equal(v[0].count, jpeg_c_len);
    assert_int_equal(v[11].count, 0);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    char *classes = NULL, *cats = NULL;
    char p[400];
    snprintf(p, sizeof p, "%s/classes.txt", out);
    OK(kpl__read_file(p, &classes, NULL));
    assert_string_equal(classes, "ant\ncat\nzebra\n");
    snprintf(p, sizeof p, "%s/categories.json", out);
    OK(kpl__read_file(p, &cats, NULL));
    json_t *cj = json_loads(cats, 0, NULL);
    assert_non_null(cj);
    assert_int_equal(json_array_size(cj), 3);
    assert_int_equal(json_integer_value(json_object_get(json_array_get(cj, 2), "id")), 90);
    assert_int_equal(json_integer_value(json_object_get(json_array_get(cj, 2), "label")), 2);
    assert_string_equal(json_string_value(json_object_get(json_array_get(cj, 2), "supercategory")),
                        "animal");
    json_decref(cj);
    free(classes);
    free(cats);

    /* drop_empty: image 12 (nothing) and 5 (a crowd region only) go */
    o.drop_empty = true;
    const char *out2 = tmp_path("coco_out_drop");
    OK(kpl_convert_coco(json, coco_dir, out2, &o, &st));
    assert_int_equal(st.images, 2);
    assert_int_equal(st.dropped_empty, 2);
    OK(kpl_dataset_open(out2, &ds));
    c = NN(kpl_chunk_create());
    OK(kpl_dataset_read_example(ds, 0, c, v));
    assert_int_equal(i64_at(&v[2], 0), 3);
    OK(kpl_dataset_read_example(ds, 1, c, v));
    assert_int_equal(i64_at(&v[2], 0), 7);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
}

/* One bad thing at a time: an error naming the annotation or image; then
 * all of them at once with skip_bad: each skipped and counted, the rest
 * written. */
static void test_coco_bad_annotations(void **state)
{
    (void)state;
    if (!coco_dir[0]) make_coco_images();
    char p[400];
    snprintf(p, sizeof p, "%s/trunc.jpg", coco_dir);
    uint8_t *tj;
    size_t tl;
    write_jpeg(p, 16, 16, 2, &tj, &tl);
    write_bytes(p, tj, tl / 2); /* cut in half */
    free(tj);
    static const struct {
        const char *image, *ann, *needle;
    } bad[] = {
        {"", ",{\"id\": 201, \"image_id\": 7, \"category_id\": 4, \"bbox\": [35, 1, 7, 5]}",
         "annotation 201 (annotations[6], image 7): bbox [35, 1, 7, 5] reaches outside the 40 x 30 image by more than 1 pixel"},
        {"", ",{\"id\": 202, \"image_id\": 7, \"category_id\": 4, \"bbox\": [3, 1, 0, 5]}",
         "annotation 202 (annotations[6], image 7): bbox [3, 1, 0, 5] has zero or negative width"},
        {"", ",{\"id\": 203, \"image_id\": 7, \"category_id\": 4, \"bbox\": [3, 1, 2, -5]}",
         "annotation 203 (annotations[6], image 7): bbox [3, 1, 2, -5] has zero or negative height"},
        {"", ",{\"id\": 204, \"image_id\": 7, \"category_id\": 4, \"bbox\": [3, 1, 2, 5], \"area\": 0}",
         "annotation 204 (annotations[6], image 7): \"area\" is not positive"},
        {"", ",{\"id\": 205, \"image_id\": 7, \"category_id\": 5, \"bbox\": [3, 1, 2, 5]}",
         "annotation 205 (annotations[6], image 7): category id 5 is not in \"categories\""},
        {"", ",{\"id\": 206, \"image_id\": 8, \"category_id\": 4, \"bbox\": [3, 1, 2, 5]}",
         "annotation 206 (annotations[6], image 8): image id 8 is not in \"images\""},
        {"", ",{\"id\": 207, \"image_id\": 3, \"category_id\": 4, \"bbox\": [3, 1, 2, 5], "
             "\"segmentation\": {\"size\": [32, 24], \"counts\": [768]}}",
         "annotation 207 (annotations[6], image 3): RLE size [32, 24] is not the image's [24, 32] (h, w)"},
        {"", ",{\"id\": 208, \"image_id\": 3, \"category_id\": 4, \"bbox\": [3, 1, 2, 5], "
             "\"segmentation\": {\"size\": [24, 32], \"counts\": [700, 10]}}",
         "annotation 208 (annotations[6], image 3): RLE counts cover 710 pixels of the 24 x 32 image"},
        {"", ",{\"id\": 209, \"image_id\": 3, \"category_id\": 4, \"bbox\": [3, 1, 2, 5], "
             "\"segmentation\": {\"size\": [24, 32], \"counts\": \"0~\"}}",
         "annotation 209 (annotations[6], image 3): RLE string: byte 1 is 0x7e"},
        {"", ",{\"id\": 210, \"image_id\": 3, \"category_id\": 4, \"bbox\": [3, 1, 2, 5], "
             "\"segmentation\": [[3, 1, 5, 1, 5, 30]]}",
         "annotation 210 (annotations[6], image 3): segmentation polygon 0: y = 30 lies outside"},
        {"", ",{\"id\": 211, \"image_id\": 3, \"category_id\": 4, \"bbox\": [3, 1, 2, 5], "
             "\"segmentation\": [[3, 1, \"5\", 1, 5, 3]]}",
         "annotation 211 (annotations[6], image 3): segmentation polygon 0: coordinate 2 is not a finite number"},
        {"", ",{\"id\": 212, \"image_id\": 3, \"category_id\": 4, \"bbox\": [3, 1, 2, 5], \"iscrowd\": 2}",
         "annotation 212 (annotations[6], image 3): \"iscrowd\" is not 0 or 1"},
        {"", ",{\"id\": 213, \"image_id\": 3, \"category_id\": 4, \"bbox\": [3, 1, 2]}",
         "annotation 213 (annotations[6], image 3): no \"bbox\" of four finite numbers"},
        {",{\"id\": 9, \"file_name\": \"missing.jpg\", \"width\": 16, \"height\": 16}", "",
         "image 9 (" /* path */},
        {",{\"id\": 10, \"file_name\": \"d.jpg\", \"width\": 20, \"height\": 16}", "",
         "image 10 ("},
        {",{\"id\": 11, \"file_name\": \"trunc.jpg\", \"width\": 16, \"height\": 16}", "",
         "image 11 ("},
        {",{\"id\": 13, \"file_name\": 5, \"width\": 16, \"height\": 16}", "",
         "image 13 (images[4]): no \"file_name\" string"},
    };
    static const char *tails[] = {
        NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
        "missing.jpg): cannot read", "d.jpg): the file is 16 x 16, the annotations say 20 x 16",
        "trunc.jpg): ", NULL,
    };
    const int nbad = (int)(sizeof bad / sizeof bad[0]);
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.threads = 1;
    for (int i = 0; i < nbad; i++) {
        char *j = good_coco_json(bad[i].image, bad[i].ann);
        char name[64];
        snprintf(name, sizeof name, "coco_bad%d.json", i);
        const char *json = tmp_path(name);
        write_text(json, j);
        free(j);
        snprintf(name, sizeof name, "coco_bad_out%d", i);
        FAILS(kpl_convert_coco(json, coco_dir, tmp_path(name), &o, NULL), KPL_EFORMAT,
              bad[i].needle);
        if (tails[i]) assert_non_null(strstr(kpl_last_error(), tails[i]));
        struct stat sb;
        assert_int_not_equal(stat(tmp_path(name), &sb), 0); /* nothing left behind */
    }
    /* all at once, skipped */
    char images[2048] = "", anns[8192] = "";
    for (int i = 0; i < nbad; i++) {
        strcat(images, bad[i].image);
        /* each annotation's id stays, its position changes: fine */
        strcat(anns, bad[i].ann);
    }
    char *j = good_coco_json(images, anns);
    const char *json = tmp_path("coco_bad_all.json");
    write_text(json, j);
    free(j);
    o.skip_bad = true;
    kpl_detection_stats st;
    OK(kpl_convert_coco(json, coco_dir, tmp_path("coco_bad_all_out"), &o, &st));
    assert_int_equal(st.skipped_objects, 13);
    assert_int_equal(st.skipped_images, 4);
    assert_int_equal(st.images, 4);
    assert_int_equal(st.objects, 6);
}

/* Files that are not COCO: clear errors naming the place, no crash. */
static void test_coco_malformed_json(void **state)
{
    (void)state;
    if (!coco_dir[0]) make_coco_images();
    char *good = good_coco_json("", "");
    static const struct {
        const char *text, *needle;
    } cases[] = {
        {NULL, "expected near end of file"}, /* the good file cut in the middle */
        {"[1, 2]", "the file is a list, not a COCO object"},
        {"{\"categories\": []}", "no \"images\" list"},
        {"{\"images\": {}, \"categories\": []}", "\"images\" is an object, not a list"},
        {"{\"images\": [], \"categories\": []}", "\"categories\" is empty"},
        {"{\"images\": [], \"categories\": [{\"id\": 1}]}", "categories[0] (id 1) has no \"name\""},
        {"{\"images\": [{\"file_name\": \"a.jpg\"}], \"categories\": [{\"id\": 1, \"name\": \"x\"}]}",
         "images[0] is an object without an integer \"id\""},
        {"{\"images\": [7], \"categories\": [{\"id\": 1, \"name\": \"x\"}]}",
         "images[0] is an integer"},
        {"{\"images\": [{\"id\": 1}, {\"id\": 2}, {\"id\": 1}], \"categories\": [{\"id\": 1, \"name\": \"x\"}]}",
         "images[0] and images[2] have the same id 1"},
        {"{\"images\": [], \"categories\": [{\"id\": 1, \"name\": \"x\"}], \"annotations\": [{\"id\": 3}, {\"id\": 3.5}]}",
         "annotations[1] is an object without an integer \"id\""},
        {"{\"images\": [], \"categories\": [{\"id\": 1, \"name\": \"x\"}], \"annotations\": \"none\"}",
         "\"annotations\" is a string, not a list"},
        {"{\"images\": [], \"categories\": [{\"id\": 1, \"name\": \"x\"}, {\"id\": 1, \"name\": \"y\"}]}",
         "categories[0] and categories[1] have the same id 1"},
        {"{\"images\": [], \"images\": []}", "duplicate object key"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "coco_malformed%zu.json", i);
        const char *json = tmp_path(name);
        if (cases[i].text) write_text(json, cases[i].text);
        else write_bytes(json, good, strlen(good) / 2);
        snprintf(name, sizeof name, "coco_malformed_out%zu", i);
        FAILS(kpl_convert_coco(json, coco_dir, tmp_path(name), NULL, NULL), KPL_EFORMAT,
              cases[i].needle);
    }
    free(good);
    FAILS(kpl_convert_coco(tmp_path("no_such.json"), coco_dir, tmp_path("x"), NULL, NULL),
          KPL_ENOTFOUND, "no_such.json");
    /* an image list with no usable image left */
    write_text(tmp_path("coco_none.json"),
               "{\"images\": [{\"id\": 1, \"file_name\": \"nope.jpg\", \"width\": 2, \"height\": 2}],"
               " \"categories\": [{\"id\": 1, \"name\": \"x\"}]}");
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.skip_bad = true;
    FAILS(kpl_convert_coco(tmp_path("coco_none.json"), coco_dir, tmp_path("coco_none_out"), &o,
                           NULL), KPL_EFORMAT, "every image was bad");
}

/* ---- VOC ------------------------------------------------------------------------- */

static void voc_xml(const char *root, const char *id, int w, int h, const char *objects)
{
    char p[400], x[4096];
    snprintf(p, sizeof p, "%s/Annotations/%s.xml", root, id);
    snprintf(x, sizeof x,
             "<annotation>\n  <folder>VOC2007</folder>\n  <filename>%s.jpg</filename>\n"
             "  <size><width>%d</width><height>%d</height><depth>3</depth></size>\n%s"
             "</annotation>\n", id, w, h, objects);
    write_text(p, x);
}

static const char *voc_obj(char *buf, size_t n, const char *name, int diff, const char *box)
{
    snprintf(buf, n, "  <object><name>%s</name><pose>Left</pose><truncated>0</truncated>"
             "<difficult>%d</difficult><bndbox>%s</bndbox></object>\n", name, diff, box);
    return buf;
}

static void test_voc_convert(void **state)
{
    (void)state;
    char root[300], p[400];
    snprintf(root, sizeof root, "%s", tmp_path("VOC2007"));
    const char *sub[3] = {"Annotations", "JPEGImages", "ImageSets"};
    mkdir(root, 0777);
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", root, sub[i]);
        mkdir(p, 0777);
    }
    snprintf(p, sizeof p, "%s/ImageSets/Main", root);
    mkdir(p, 0777);
    snprintf(p, sizeof p, "%s/ImageSets/Main/train.txt", root);
    write_text(p, "000005\n000007\n\n000009  \n");
    snprintf(p, sizeof p, "%s/ImageSets/Main/bad.txt", root);
    write_text(p, "000005\n000011\n000012\n000013\n");
    const char *ids[6] = {"000005", "000007", "000009", "000011", "000012", "000013"};
    int sizes[6][2] = {{50, 40}, {30, 20}, {20, 20}, {20, 20}, {20, 20}, {20, 20}};
    for (int i = 0; i < 6; i++) {
        snprintf(p, sizeof p, "%s/JPEGImages/%s.jpg", root, ids[i]);
        write_jpeg(p, sizes[i][0], sizes[i][1], i + 1, NULL, NULL);
    }
    char o1[512], o2[512], objs[2048];
    snprintf(objs, sizeof objs, "%s%s",
             voc_obj(o1, sizeof o1, "chair", 0,
                     "<xmin>11</xmin><ymin>6</ymin><xmax>30</xmax><ymax>40</ymax>"),
             voc_obj(o2, sizeof o2, "tvmonitor", 1,
                     "<xmin>1</xmin><ymin>1.9</ymin><xmax>50</xmax><ymax>20.7</ymax>"));
    voc_xml(root, "000005", 50, 40, objs);
    voc_xml(root, "000007", 30, 20,
            voc_obj(o1, sizeof o1, " aeroplane ", 0,
                    "<xmin>2</xmin><ymin>3</ymin><xmax>9</xmax><ymax>8</ymax>"));
    voc_xml(root, "000009", 20, 20, ""); /* no objects */
    voc_xml(root, "000011", 20, 20,
            voc_obj(o1, sizeof o1, "unicorn", 0,
                    "<xmin>2</xmin><ymin>3</ymin><xmax>9</xmax><ymax>8</ymax>"));
    voc_xml(root, "000012", 20, 20,
            voc_obj(o1, sizeof o1, "dog", 0,
                    "<xmin>2</xmin><ymin>3</ymin><xmax>25</xmax><ymax>8</ymax>"));
    snprintf(p, sizeof p, "%s/Annotations/000013.xml", root);
    write_text(p, "<annotation><size><width>20</width>"); /* cut short */

    const char *out = tmp_path("voc_out");
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    kpl_detection_stats st;
    OK(kpl_convert_voc(root, "train", out, &o, &st));
    assert_int_equal(st.images, 3);
    assert_int_equal(st.objects, 3);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(out, &ds));
    assert_int_equal(kpl_dataset_num_features(ds), 8);
    assert_string_equal(kpl_dataset_feature(ds, 7)->name, "difficult");
    assert_string_equal(kpl_dataset_feature(ds, 0)->encoding, "jpeg");
    kpl_chunk *c = NN(kpl_chunk_create());
    kpl_feature_value v[8];
    OK(kpl_dataset_read_example(ds, 0, c, v));
    assert_int_equal(i64_at(&v[2], 0), 0);
    assert_memory_equal(v[1].data, "JPEGImages/000005.jpg", v[1].count);
    assert_int_equal(i64_at(&v[3], 0), 40);
    assert_int_equal(i64_at(&v[4], 0), 50);
    /* mmdetection's reading: truncate, minus 1 (all four) */
    static const float b5[8] = {10, 5, 29, 39, 0, 0, 49, 19};
    for (int k = 0; k < 8; k++) assert_float_equal(f32_at(&v[5], k), b5[k], 0);
    assert_int_equal(i64_at(&v[6], 0), 8);  /* chair */
    assert_int_equal(i64_at(&v[6], 1), 19); /* tvmonitor */
    assert_int_equal(i64_at(&v[7], 0), 0);
    assert_int_equal(i64_at(&v[7], 1), 1);
    OK(kpl_dataset_read_example(ds, 1, c, v));
    assert_int_equal(i64_at(&v[6], 0), 0); /* aeroplane, name trimmed */
    static const float b7[4] = {1, 2, 8, 7};
    for (int k = 0; k < 4; k++) assert_float_equal(f32_at(&v[5], k), b7[k], 0);
    OK(kpl_dataset_read_example(ds, 2, c, v));
    assert_int_equal(i64_at(&v[2], 0), 2);
    assert_int_equal(v[5].count, 0);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    char *classes = NULL;
    snprintf(p, sizeof p, "%s/classes.txt", out);
    OK(kpl__read_file(p, &classes, NULL));
    assert_true(!strncmp(classes, "aeroplane\nbicycle\n", 18));
    assert_non_null(strstr(classes, "sofa\ntrain\ntvmonitor\n"));
    free(classes);

    /* drop_empty leaves 000009 out; a difficult object alone does not count */
    o.drop_empty = true;
    OK(kpl_convert_voc(root, "train", tmp_path("voc_out_drop"), &o, &st));
    assert_int_equal(st.images, 2);
    assert_int_equal(st.dropped_empty, 1);
    o.drop_empty = false;

    /* bad ones: unknown class, box past the image, XML cut short */
    FAILS(kpl_convert_voc(root, "bad", tmp_path("voc_bad"), &o, NULL), KPL_EFORMAT,
          "voc: image 1 (000011): object 0 (Annotations/000011.xml): class 'unicorn' is not one of VOC's 20");
    o.skip_bad = true;
    OK(kpl_convert_voc(root, "bad", tmp_path("voc_bad_skip"), &o, &st));
    assert_int_equal(st.images, 3); /* 000005, 000011 and 000012 without their bad objects */
    assert_int_equal(st.skipped_objects, 2);
    assert_int_equal(st.skipped_images, 1); /* 000013 */
    o.skip_bad = false;
    snprintf(p, sizeof p, "%s/ImageSets/Main/bad2.txt", root);
    write_text(p, "000012\n");
    FAILS(kpl_convert_voc(root, "bad2", tmp_path("voc_bad2"), &o, NULL), KPL_EFORMAT,
          "box (1, 2)-(24, 7) (0-based) reaches outside the 20 x 20 image by more than 1 pixel");
    snprintf(p, sizeof p, "%s/ImageSets/Main/bad3.txt", root);
    write_text(p, "000013\n");
    FAILS(kpl_convert_voc(root, "bad3", tmp_path("voc_bad3"), &o, NULL), KPL_EFORMAT,
          "voc: image 0 (000013): Annotations/000013.xml: ");
    FAILS(kpl_convert_voc(root, "nosuch", tmp_path("voc_bad4"), &o, NULL), KPL_ENOTFOUND,
          "ImageSets/Main/nosuch.txt");

    /* numbers only in decimal; a field given twice; a FIFO (never opened:
     * it would block); a link loop (its own error, not "no such file") */
    static const struct {
        const char *id, *xml_objects, *needle;
    } odd[] = {
        {"000021", "<xmin>0x5</xmin><ymin>3</ymin><xmax>9</xmax><ymax>8</ymax>",
         "no <bndbox> with a number in <xmin>"},
        {"000022", "<xmin>inf</xmin><ymin>3</ymin><xmax>9</xmax><ymax>8</ymax>",
         "no <bndbox> with a number in <xmin>"},
        {"000023", "<xmin>2</xmin><xmin>5</xmin><ymin>3</ymin><xmax>9</xmax><ymax>8</ymax>",
         "<xmin> appears twice in <bndbox>"},
    };
    for (size_t i = 0; i < sizeof odd / sizeof *odd; i++) {
        snprintf(p, sizeof p, "%s/JPEGImages/%s.jpg", root, odd[i].id);
        write_jpeg(p, 20, 20, 7, NULL, NULL);
        voc_xml(root, odd[i].id, 20, 20, voc_obj(o1, sizeof o1, "dog", 0, odd[i].xml_objects));
        snprintf(p, sizeof p, "%s/ImageSets/Main/odd.txt", root);
        char line[16];
        snprintf(line, sizeof line, "%s\n", odd[i].id);
        write_text(p, line);
        FAILS(kpl_convert_voc(root, "odd", tmp_path("voc_odd"), &o, NULL), KPL_EFORMAT,
              odd[i].needle);
    }
    snprintf(p, sizeof p, "%s/JPEGImages/000024.jpg", root);
    write_jpeg(p, 20, 20, 7, NULL, NULL);
    voc_xml(root, "000024", 20, 20, "<object><name>dog</name><name>cat</name><bndbox><xmin>2</xmin>"
            "<ymin>3</ymin><xmax>9</xmax><ymax>8</ymax></bndbox></object>");
    snprintf(p, sizeof p, "%s/ImageSets/Main/odd.txt", root);
    write_text(p, "000024\n");
    FAILS(kpl_convert_voc(root, "odd", tmp_path("voc_odd"), &o, NULL), KPL_EFORMAT,
          "<name> appears twice in <object>");
    char fifo[400], a1[400], a2[400];
    snprintf(fifo, sizeof fifo, "%s/Annotations/000025.xml", root);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    write_text(p, "000025\n");
    FAILS(kpl_convert_voc(root, "odd", tmp_path("voc_odd"), &o, NULL), KPL_EFORMAT,
          "Annotations/000025.xml: not a regular file");
    snprintf(a1, sizeof a1, "%s/Annotations/000026.xml", root);
    snprintf(a2, sizeof a2, "%s/Annotations/loop.xml", root);
    assert_int_equal(symlink(a2, a1), 0);
    assert_int_equal(symlink(a1, a2), 0);
    write_text(p, "000026\n");
    FAILS(kpl_convert_voc(root, "odd", tmp_path("voc_odd"), &o, NULL), KPL_EFORMAT,
          "Annotations/000026.xml: Too many levels of symbolic links");
}

/* ---- the synthetic set --------------------------------------------------------------- */

static const char *fmnist = "/usr/share/datasets/fashion-mnist";

/* Every file under dir (recursively) equal to the same file under other. */
static void assert_same_tree(const char *dir, const char *other, int *files)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char a[512], b[512];
        snprintf(a, sizeof a, "%s/%s", dir, e->d_name);
        snprintf(b, sizeof b, "%s/%s", other, e->d_name);
        struct stat sb;
        assert_int_equal(stat(a, &sb), 0);
        if (S_ISDIR(sb.st_mode)) {
            assert_same_tree(a, b, files);
            continue;
        }
        char *x = NULL, *y = NULL;
        size_t nx, ny;
        OK(kpl__read_file(a, &x, &nx));
        OK(kpl__read_file(b, &y, &ny));
        if (nx != ny || memcmp(x, y, nx)) fail_msg("%s and %s differ", a, b);
        free(x);
        free(y);
        (*files)++;
    }
    closedir(d);
}

static void test_synth_fmnist_det(void **state)
{
    (void)state;
    char im[256];
    snprintf(im, sizeof im, "%s/t10k-images-idx3-ubyte.gz", fmnist);
    if (access(im, R_OK)) KPL_SKIP(KPL_TEST_SKIP_REF, "Fashion-MNIST (dataset-fashion-mnist)");
    kpl_synth_det_config cfg = KPL_SYNTH_DET_CONFIG_INIT;
    cfg.train = 40;
    cfg.val = 12;
    cfg.size = 96;
    cfg.seed = 11;
    cfg.threads = 1;
    const char *a = tmp_path("synth_a"), *b = tmp_path("synth_b"), *c3 = tmp_path("synth_c");
    int64_t objects = 0, objects_b = 0;
    OK(kpl_synth_fmnist_det(a, &cfg, &objects));
    cfg.threads = 2; /* the thread count changes nothing */
    OK(kpl_synth_fmnist_det(b, &cfg, &objects_b));
    assert_int_equal(objects, objects_b);
    int files = 0;
    assert_same_tree(a, b, &files);
    assert_int_equal(files, 40 + 12 + 2);
    cfg.seed = 12;
    OK(kpl_synth_fmnist_det(c3, &cfg, NULL));
    char p1[400], p2[400];
    snprintf(p1, sizeof p1, "%s/train/000001.jpg", a);
    snprintf(p2, sizeof p2, "%s/train/000001.jpg", c3);
    char *x = NULL, *y = NULL;
    size_t nx, ny;
    OK(kpl__read_file(p1, &x, &nx));
    OK(kpl__read_file(p2, &y, &ny));
    assert_true(nx != ny || memcmp(x, y, nx)); /* another seed, another image */
    free(x);
    free(y);
    FAILS(kpl_synth_fmnist_det(a, &cfg, NULL), KPL_EINVAL, "holds files");

    /* The JSON: 1..8 objects an image; each box tight around its mask,
     * each area its mask's pixels; masks of an image disjoint (an item's
     * mask is what later items leave visible). */
    char jp[400];
    snprintf(jp, sizeof jp, "%s/train.json", a);
    json_error_t err;
    json_t *root = json_load_file(jp, 0, &err);
    assert_non_null(root);
    json_t *anns = json_object_get(root, "annotations");
    assert_int_equal(json_array_size(json_object_get(root, "images")), 40);
    int per_image[41] = {0};
    uint8_t *seen = calloc(41 * 96 * 96, 1), *m = malloc(96 * 96);
    int64_t total_train = (int64_t)json_array_size(anns);
    for (size_t i = 0; i < json_array_size(anns); i++) {
        json_t *an = json_array_get(anns, i);
        int64_t iid = json_integer_value(json_object_get(an, "image_id"));
        assert_true(iid >= 1 && iid <= 40);
        per_image[iid]++;
        int64_t cat = json_integer_value(json_object_get(an, "category_id"));
        assert_true(cat >= 1 && cat <= 10);
        json_t *seg = json_object_get(an, "segmentation"), *bb = json_object_get(an, "bbox");
        const char *counts = json_string_value(json_object_get(seg, "counts"));
        kpl_rle r;
        OK(kpl_rle_from_string(counts, strlen(counts), 96, 96, &r));
        OK(kpl_rle_decode(&r, m));
        kpl_rle_free(&r);
        int x0 = 96, y0 = 96, x1 = 0, y1 = 0, area = 0;
        for (int yy = 0; yy < 96; yy++)
            for (int xx = 0; xx < 96; xx++)
                if (m[yy * 96 + xx]) {
                    area++;
                    x0 = xx < x0 ? xx : x0;
                    y0 = yy < y0 ? yy : y0;
                    x1 = xx + 1 > x1 ? xx + 1 : x1;
                    y1 = yy + 1 > y1 ? yy + 1 : y1;
                    assert_int_equal(seen[iid * 96 * 96 + yy * 96 + xx]++, 0);
                }
        assert_true(area > 0);
        assert_int_equal(json_integer_value(json_object_get(an, "area")), area);
        assert_int_equal(json_integer_value(json_array_get(bb, 0)), x0);
        assert_int_equal(json_integer_value(json_array_get(bb, 1)), y0);
        assert_int_equal(json_integer_value(json_array_get(bb, 2)), x1 - x0);
        assert_int_equal(json_integer_value(json_array_get(bb, 3)), y1 - y0);
        /* items are 20..90 px; the visible part of one is inside that */
        assert_true(x1 - x0 <= 90 && y1 - y0 <= 90);
    }
    int more_than_one = 0;
    for (int i = 1; i <= 40; i++) {
        assert_true(per_image[i] >= 1 && per_image[i] <= 8);
        more_than_one += per_image[i] > 1;
    }
    assert_true(more_than_one >= 10);
    free(seen);
    free(m);

    /* Through --from coco, then the loader's boxes. */
    char img_dir[400];
    snprintf(img_dir, sizeof img_dir, "%s/train", a);
    const char *out = tmp_path("synth_records");
    kpl_detection_stats st;
    OK(kpl_convert_coco(jp, img_dir, out, NULL, &st));
    assert_int_equal(st.images, 40);
    assert_int_equal(st.objects, total_train);
    kpl_loader_config lc = KPL_LOADER_CONFIG_INIT;
    lc.path = out;
    lc.batch_size = 8;
    lc.workers = 2;
    lc.shuffle = KPL_SHUFFLE_EXAMPLE;
    lc.transform.label_feature = NULL;
    lc.transform.boxes_feature = "boxes";
    lc.transform.box_labels_feature = "labels";
    lc.transform.max_boxes = 8;
    lc.transform.out_h = lc.transform.out_w = 96;
    lc.transform.out_dtype = KPL_U8;
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&lc, &l));
    int64_t samples = 0;
    kpl_batch bt;
    for (bool last = false; !last;) {
        OK(kpl_loader_next(l, &bt));
        last = bt.last;
        const int64_t *ex = kpl_tensor_host_data(bt.example);
        const float *bx = kpl_tensor_host_data(bt.boxes);
        const int64_t *bl = kpl_tensor_host_data(bt.box_labels);
        const int64_t *nb = kpl_tensor_host_data(bt.num_boxes);
        for (int64_t i = 0; i < bt.size; i++) {
            int64_t iid = ex[i] + 1; /* one shard, image id order: example e is image e + 1 */
            assert_int_equal(nb[i], per_image[iid]);
            int k = 0;
            for (size_t q = 0; q < json_array_size(anns); q++) {
                json_t *an = json_array_get(anns, q);
                if (json_integer_value(json_object_get(an, "image_id")) != iid) continue;
                json_t *bb = json_object_get(an, "bbox");
                double want[4] = {(double)json_integer_value(json_array_get(bb, 0)),
                                  (double)json_integer_value(json_array_get(bb, 1)), 0, 0};
                want[2] = want[0] + (double)json_integer_value(json_array_get(bb, 2));
                want[3] = want[1] + (double)json_integer_value(json_array_get(bb, 3));
                for (int d = 0; d < 4; d++) assert_float_equal(bx[(i * 8 + k) * 4 + d], want[d], 1e-4);
                assert_int_equal(bl[i * 8 + k],
                                 json_integer_value(json_object_get(an, "category_id")) - 1);
                k++;
            }
            samples++;
        }
        kpl_batch_release(&bt);
    }
    assert_int_equal(samples, 40);
    kpl_loader_destroy(l);
    json_decref(root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rle_matches_pycocotools),
        cmocka_unit_test(test_polygon_exact_pixels),
        cmocka_unit_test(test_rle_round_trip_and_bad_strings),
        cmocka_unit_test(test_coco_convert),
        cmocka_unit_test(test_coco_bad_annotations),
        cmocka_unit_test(test_coco_malformed_json),
        cmocka_unit_test(test_voc_convert),
        cmocka_unit_test(test_synth_fmnist_det),
    };
    int rc = cmocka_run_group_tests(tests, setup, teardown);
    free(jpeg_a);
    free(jpeg_c);
    return rc;
}
