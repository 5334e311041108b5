/*
 * fuzz_coco.c — COCO instances JSON through kpl_convert_coco (jansson's
 * parse, the structure and annotation checks, RLE strings and counts,
 * polygon rasterisation, the detection writer), and the RLE string parser
 * and the polygon rasteriser directly.
 *
 * Input, by its first bytes:
 *   "RLE H W " then a compressed RLE string: kpl_rle_from_string for an
 *       H x W mask (1..64 each), then decode, encode, to_string, parse
 *       again: the mask must survive the round trip.
 *   "POLY H W " then numbers x y x y ...: kpl_mask_fill_polygon.
 *   anything else: a COCO JSON, converted twice (strict, then skip_bad)
 *       with its images in the scratch directory: a.jpg (8 x 6 JPEG),
 *       b.png (5 x 4 PNG), bad.jpg (a cut JPEG); every dataset written
 *       must verify, and every mask in it must parse for its image's size.
 * Seeds (corpus/coco) are small COCO files by hand: polygons, both RLE
 * forms, crowd regions, bad annotations.
 */
#include "fuzz_common.h"

#include <png.h>
#include <turbojpeg.h>

#include "dataio.h"

static char img_dir[PATH_MAX];

/* The images the JSON may name, made once. */
static void make_images(const char *root)
{
    if (img_dir[0]) return;
    fuzz_path(img_dir, root, "img");
    mkdir(img_dir, 0700);
    uint8_t rgb[8 * 6 * 3];
    for (size_t i = 0; i < sizeof rgb; i++) rgb[i] = (uint8_t)(i * 13);
    tjhandle tj = tjInitCompress();
    unsigned char *jpg = NULL;
    unsigned long n = 0;
    if (!tj || tjCompress2(tj, rgb, 8, 0, 6, TJPF_RGB, &jpg, &n, TJSAMP_420, 90, 0)) abort();
    char p[PATH_MAX];
    fuzz_path(p, img_dir, "a.jpg");
    fuzz_write(p, jpg, n);
    fuzz_path(p, img_dir, "bad.jpg");
    fuzz_write(p, jpg, n / 2);
    tjFree(jpg);
    tjDestroy(tj);
    png_image im;
    memset(&im, 0, sizeof im);
    im.version = PNG_IMAGE_VERSION;
    im.width = 5;
    im.height = 4;
    im.format = PNG_FORMAT_RGB;
    fuzz_path(p, img_dir, "b.png");
    if (!png_image_write_to_file(&im, p, 0, rgb, 0, NULL)) abort();
}

/* "H W " at s: the sizes (1..64) and where the rest starts, or false. */
static bool sizes(const char *s, int64_t *h, int64_t *w, const char **rest)
{
    char *e;
    *h = strtol(s, &e, 10);
    if (e == s) return false;
    s = e;
    *w = strtol(s, &e, 10);
    if (e == s || *e != ' ') return false;
    *rest = e + 1;
    return *h >= 1 && *h <= 64 && *w >= 1 && *w <= 64;
}

static void rle_case(const char *s)
{
    int64_t h, w;
    const char *str;
    if (!sizes(s, &h, &w, &str)) return;
    kpl_rle r, r2;
    if (fuzz_st(kpl_rle_from_string(str, strlen(str), h, w, &r), "rle") < 0) return;
    uint8_t m[64 * 64], m2[64 * 64];
    if (kpl_rle_decode(&r, m) != KPL_OK) abort(); /* parsed, so it covers the mask */
    int64_t area = 0;
    for (int64_t i = 0; i < h * w; i++) area += m[i];
    if (area != kpl_rle_area(&r)) abort();
    char *t = NULL;
    size_t len = 0;
    if (kpl_rle_encode(m, h, w, &r2) != KPL_OK || kpl_rle_to_string(&r2, &t, &len) != KPL_OK)
        abort();
    kpl_rle_free(&r2);
    if (kpl_rle_from_string(t, len, h, w, &r2) != KPL_OK || kpl_rle_decode(&r2, m2) != KPL_OK)
        abort();
    if (memcmp(m, m2, (size_t)(h * w))) abort();
    free(t);
    kpl_rle_free(&r);
    kpl_rle_free(&r2);
}

static void poly_case(const char *s)
{
    int64_t h, w;
    const char *p;
    if (!sizes(s, &h, &w, &p)) return;
    double xy[256];
    int n = 0;
    for (char *e; n < 256; p = e) {
        xy[n] = strtod(p, &e);
        if (e == p) break;
        n++;
    }
    if (n < 2) return;
    uint8_t m[64 * 64] = {0};
    if (fuzz_st(kpl_mask_fill_polygon(xy, n / 2, h, w, m), "poly") < 0) return;
    for (int64_t i = 0; i < h * w; i++)
        if (m[i] > 1) abort();
}

/* Every example's masks parse for its size. */
static void check_dataset(const char *out)
{
    kpl_verify_stats vs;
    if (kpl_dataset_verify(out, &vs, NULL, NULL) != KPL_OK) {
        fprintf(stderr, "fuzz_coco: the dataset does not verify: %s\n", kpl_last_error());
        abort();
    }
    kpl_dataset *ds = NULL;
    if (kpl_dataset_open(out, &ds) != KPL_OK) abort();
    kpl_chunk *c = kpl_chunk_create();
    kpl_feature_value v[12];
    for (int64_t e = 0; e < kpl_dataset_num_examples(ds); e++) {
        if (kpl_dataset_read_example(ds, e, c, v) != KPL_OK) abort();
        int64_t h, w;
        memcpy(&h, v[3].data, 8);
        memcpy(&w, v[4].data, 8);
        const char *p = v[11].data, *end = p + v[11].count;
        for (uint32_t k = 0; k < v[6].count; k++) {
            const char *nl = memchr(p, '\n', (size_t)(end - p));
            const char *q = nl ? nl : end;
            kpl_rle r;
            if (q > p && kpl_rle_from_string(p, (size_t)(q - p), h, w, &r) != KPL_OK) {
                fprintf(stderr, "fuzz_coco: a stored mask does not parse: %s\n", kpl_last_error());
                abort();
            }
            if (q > p) kpl_rle_free(&r);
            if (!nl && k + 1 < v[6].count) abort(); /* one line per object */
            p = nl ? nl + 1 : end;
        }
    }
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_reset();
    const char *root = fuzz_dir("coco");
    make_images(root);
    char *s = fuzz_strndup(data, size);
    if (!strncmp(s, "RLE ", 4)) {
        rle_case(s + 4);
        free(s);
        return 0;
    }
    if (!strncmp(s, "POLY ", 5)) {
        poly_case(s + 5);
        free(s);
        return 0;
    }
    free(s);
    char json[PATH_MAX], out[PATH_MAX];
    fuzz_path(json, root, "ann.json");
    fuzz_path(out, root, "out");
    fuzz_write(json, data, size);
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.writer.zstd_level = 0;
    o.threads = 1;
    for (int pass = 0; pass < 2; pass++) {
        fuzz_rm_tree(out);
        o.skip_bad = pass == 1;
        kpl_detection_stats st;
        if (fuzz_st(kpl_convert_coco(json, img_dir, out, &o, &st), "convert") == KPL_OK)
            check_dataset(out);
    }
    fuzz_rm_tree(out);
    unlink(json);
    return 0;
}
