/* test_transform.c — the DataTransformer's per-sample work: JPEG decodes
 * (full, region, DCT-scaled, gray, progressive, CMYK) against TurboJPEG's
 * own decode of the same bytes, bit for bit; PNG decodes of every color
 * type against the values written; the resize against a double-precision
 * reference of the same filter; random-resized-crop parameters, keying,
 * flip, normalization and jitter against hand arithmetic; boxes and masks
 * through crop, resize and flip, for every crop mode; keep_ratio's sizes
 * and its draw of the short side; corrupt images; config validation. */
#define KPL_TEST_NAME "transform"
#include "dataio_test.h"
#include "transform_impl.h"

#include <glob.h>
#include <stdlib.h>
#include <unistd.h>

#include <jpeglib.h>
#include <png.h>
#include <turbojpeg.h>

static int set_no;

/* ---- helpers ------------------------------------------------------------------------ */

/* A photo-like test pattern: gradients, a few edges, some noise. */
static uint8_t *pattern(int w, int h, int c, uint32_t seed)
{
    uint8_t *p = malloc((size_t)w * h * c);
    uint32_t r = seed * 2654435761u + 1;
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int k = 0; k < c; k++) {
                r = r * 1664525u + 1013904223u;
                int v = (x * (3 + k) + y * (5 - k)) / 2 + ((x / 23 + y / 17) % 2) * 60 +
                        (int)(r >> 28) - 8;
                p[((size_t)y * w + x) * c + k] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
            }
    return p;
}

/* JPEG bytes (tjFree them) of `pix` (TJPF_RGB or TJPF_GRAY). */
static unsigned char *tj_encode(const uint8_t *pix, int w, int h, int pf, int subsamp, int flags,
                                unsigned long *len)
{
    tjhandle t = tjInitCompress();
    unsigned char *buf = NULL;
    *len = 0;
    if (tjCompress2(t, pix, w, 0, h, pf, &buf, len, subsamp, 90, flags) != 0)
        fail_msg("tjCompress2: %s", tjGetErrorStr2(t));
    tjDestroy(t);
    return buf;
}

/* TurboJPEG's decode at scale 1/denom (malloc'd); *w, *h get the size. */
static uint8_t *tj_decode(const unsigned char *jpg, unsigned long len, int pf, int denom, int *w,
                          int *h)
{
    tjhandle t = tjInitDecompress();
    int W, H, ss, cs;
    if (tjDecompressHeader3(t, jpg, len, &W, &H, &ss, &cs) != 0)
        fail_msg("tjDecompressHeader3: %s", tjGetErrorStr2(t));
    tjscalingfactor f = {1, denom};
    *w = TJSCALED(W, f);
    *h = TJSCALED(H, f);
    uint8_t *out = malloc((size_t)*w * *h * tjPixelSize[pf]);
    if (tjDecompress2(t, jpg, len, out, *w, 0, *h, pf, 0) != 0)
        fail_msg("tjDecompress2: %s", tjGetErrorStr2(t));
    tjDestroy(t);
    return out;
}

/* The window of a decoded view must equal the window of `ref` (rw wide, c
 * channels) at (x, y) exactly. */
static void assert_window(const kpl__img_view *v, const uint8_t *ref, int rw, int c, int x, int y,
                          const char *what)
{
    assert_int_equal(v->c, c);
    for (int r = 0; r < v->h; r++)
        for (int i = 0; i < v->w * c; i++) {
            int a = v->data[(size_t)r * v->stride + i];
            int b = ref[((size_t)(y + r) * rw + x) * c + i];
            if (a != b)
                fail_msg("%s: window (%d,%d %dx%d) pixel (%d,%d) ch %d: %d, TurboJPEG %d", what, x,
                         y, v->w, v->h, x + i / c, y + r, i % c, a, b);
        }
}

static kpl_feature_spec image_schema[2] = {
    {.name = "image", .type = KPL_FEATURE_BYTES},
    {.name = "label", .type = KPL_FEATURE_INT64},
};

/* A dataset of `n` images (bytes[i], len[i]) with labels 100 + i; the
 * image feature's encoding and shape as given. */
static kpl_dataset *image_set(int n, const void *const *bytes, const size_t *len,
                              const char *encoding, int ndim, const int64_t *shape)
{
    char dir[128];
    snprintf(dir, sizeof dir, "%s/set%d", tmp_root, set_no++);
    kpl_feature_spec sc[2];
    memcpy(sc, image_schema, sizeof sc);
    snprintf(sc[0].encoding, sizeof sc[0].encoding, "%s", encoding);
    sc[0].ndim = ndim;
    for (int i = 0; i < ndim; i++) sc[0].shape[i] = shape[i];
    kpl_record_writer_config wc = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 2, sc, &wc, &w));
    for (int i = 0; i < n; i++) {
        int64_t label = 100 + i;
        kpl_feature_value v[2] = {{bytes[i], (uint32_t)len[i]}, {&label, 1}};
        OK(kpl_record_writer_add(w, v));
    }
    OK(kpl_record_writer_close(w));
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(dir, &ds));
    return ds;
}

/* Runs one sample of `example` through cfg (image into img). */
static kpl_status sample(kpl_dataset *ds, const kpl_transform_config *cfg, int64_t example,
                         uint64_t seed, int64_t epoch, void *img, kpl__sample_out *extra)
{
    kpl__xform x;
    kpl_status st = kpl__xform_init(&x, cfg, ds);
    if (st < 0) return st;
    kpl_chunk *c = kpl_chunk_create();
    kpl_feature_value v[8];
    st = kpl_dataset_read_example(ds, example, c, v);
    kpl__xform_scratch *s = kpl__xform_scratch_create();
    kpl__sample_out o = {0};
    if (extra) o = *extra;
    o.image = img;
    if (st == KPL_OK) st = kpl__xform_sample(&x, v, seed, epoch, example, s, &o);
    kpl__xform_scratch_destroy(s);
    kpl_chunk_destroy(c);
    return st;
}

/* CHW u8 output against HWC reference pixels. */
static void assert_chw_equals_hwc(const uint8_t *chw, const uint8_t *hwc, int w, int h, int c,
                                  const char *what)
{
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int k = 0; k < c; k++) {
                int a = chw[((size_t)k * h + y) * w + x], b = hwc[((size_t)y * w + x) * c + k];
                if (a != b) fail_msg("%s: (%d,%d) ch %d: %d, expected %d", what, x, y, k, a, b);
            }
}

static uint8_t *read_whole(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n);
    if (fread(b, 1, (size_t)n, f) != (size_t)n) fail_msg("short read of %s", path);
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* ---- (1) full JPEG decode through the transform ---------------------------------- */

static void check_full_decode(const unsigned char *jpg, size_t len, const char *what)
{
    int w, h;
    uint8_t *ref = tj_decode(jpg, len, TJPF_RGB, 1, &w, &h);
    const void *b[1] = {jpg};
    kpl_dataset *ds = image_set(1, b, &len, "jpeg", 0, NULL);
    kpl_transform_config cfg = KPL_TRANSFORM_CONFIG_INIT;
    cfg.out_dtype = KPL_U8;
    cfg.out_h = h;
    cfg.out_w = w;
    uint8_t *out = malloc((size_t)3 * w * h);
    int64_t label = 0;
    kpl__sample_out ex = {.label = &label};
    OK(sample(ds, &cfg, 0, 1, 0, out, &ex));
    assert_int_equal(label, 100);
    assert_chw_equals_hwc(out, ref, w, h, 3, what);
    free(out);
    free(ref);
    kpl_dataset_close(ds);
}

static void test_jpeg_full_decode(void **state)
{
    (void)state;
    const int W = 203, H = 157;
    uint8_t *pix = pattern(W, H, 3, 1);
    int subs[2] = {TJSAMP_420, TJSAMP_444};
    for (int k = 0; k < 2; k++) {
        unsigned long len;
        unsigned char *jpg = tj_encode(pix, W, H, TJPF_RGB, subs[k], 0, &len);
        check_full_decode(jpg, len, k ? "4:4:4" : "4:2:0");
        tjFree(jpg);
    }
    free(pix);
    glob_t g;
    if (glob("/work/shared/baselines/jpeg/*.jpg", 0, NULL, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc; i++) {
            size_t len;
            uint8_t *b = read_whole(g.gl_pathv[i], &len);
            check_full_decode(b, len, g.gl_pathv[i]);
            free(b);
        }
        globfree(&g);
    } else {
        fprintf(stderr, "test_transform: no photos in /work/shared/baselines/jpeg: skipped\n");
    }
}

/* ---- (2)-(4) region, scaled, gray, progressive, CMYK ---------------------------- */

/* Every window of the list (clipped to the image) at every scale equals the
 * same window of TurboJPEG's decode at that scale. */
static void check_regions(const unsigned char *jpg, size_t len, int channels, const char *what)
{
    kpl__decoder *d = NN(kpl__decoder_create());
    int pf = channels == 1 ? TJPF_GRAY : TJPF_RGB;
    for (int denom = 1; denom <= 8; denom *= 2) {
        int w, h;
        uint8_t *ref = tj_decode(jpg, len, pf, denom, &w, &h);
        const int win[][4] = {{0, 0, 100000, 100000}, {1, 1, 10, 10},  {17, 5, 33, 40},
                              {15, 16, 1, 1},         {16, 16, 16, 16}, {31, 0, 1, 100000},
                              {0, 100000, 100000, 1}, {100000, 100000, 7, 9},
                              {7, 9, 100000, 100000}, {33, 47, 61, 29}, {8, 8, 2, 3}};
        for (size_t k = 0; k < sizeof win / sizeof win[0]; k++) {
            int x = win[k][0], y = win[k][1], ww = win[k][2], hh = win[k][3];
            /* 100000 means "to the edge" (as a size) or "from the edge" (as
             * an offset, the window then ending at the edge). */
            if (x >= w) x = w - (ww < w ? ww : w);
            if (y >= h) y = h - (hh < h ? hh : h);
            if (x >= w) x = w - 1;
            if (y >= h) y = h - 1;
            if (ww > w - x) ww = w - x;
            if (hh > h - y) hh = h - y;
            kpl__img_info info;
            int raw[3] = {0, 0, 0};
            OK(kpl__img_open(d, jpg, len, "", raw, "test", &info));
            assert_int_equal(info.kind, KPL__IMG_JPEG);
            kpl__img_view v;
            OK(kpl__img_decode(d, denom, x, y, ww, hh, channels, &v));
            char name[160];
            snprintf(name, sizeof name, "%s 1/%d", what, denom);
            assert_window(&v, ref, w, channels, x, y, name);
        }
        free(ref);
    }
    kpl__decoder_destroy(d);
}

static void test_jpeg_region_and_scaled(void **state)
{
    (void)state;
    const int W = 203, H = 157;
    uint8_t *pix = pattern(W, H, 3, 2);
    const int subs[4] = {TJSAMP_420, TJSAMP_444, TJSAMP_422, TJSAMP_440};
    const char *names[4] = {"4:2:0", "4:4:4", "4:2:2", "4:4:0"};
    for (int k = 0; k < 4; k++) {
        unsigned long len;
        unsigned char *jpg = tj_encode(pix, W, H, TJPF_RGB, subs[k], 0, &len);
        check_regions(jpg, len, 3, names[k]);
        check_regions(jpg, len, 1, names[k]); /* color to gray */
        tjFree(jpg);
    }
    unsigned long len;
    unsigned char *jpg = tj_encode(pix, W, H, TJPF_RGB, TJSAMP_420, TJFLAG_PROGRESSIVE, &len);
    check_regions(jpg, len, 3, "progressive 4:2:0");
    tjFree(jpg);
    uint8_t *gray = pattern(W, H, 1, 3);
    jpg = tj_encode(gray, W, H, TJPF_GRAY, TJSAMP_GRAY, 0, &len);
    check_regions(jpg, len, 1, "gray to gray");
    check_regions(jpg, len, 3, "gray to RGB");
    tjFree(jpg);
    free(gray);
    free(pix);
    glob_t g;
    if (glob("/work/shared/baselines/jpeg/*.jpg", 0, NULL, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc; i++) {
            size_t n;
            uint8_t *b = read_whole(g.gl_pathv[i], &n);
            check_regions(b, n, 3, g.gl_pathv[i]);
            free(b);
        }
        globfree(&g);
    }
}

/* A CMYK JPEG written by libjpeg (Adobe marker, values stored inverted as
 * Photoshop does): flat 16x16 patches, so the lossy round trip stays close. */
static void test_jpeg_cmyk(void **state)
{
    (void)state;
    const int W = 64, H = 48;
    uint8_t *cmyk = malloc((size_t)W * H * 4);
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            int p = (x / 16) + 4 * (y / 16);
            uint8_t *q = cmyk + ((size_t)y * W + x) * 4;
            q[0] = (uint8_t)(255 - p * 13), q[1] = (uint8_t)(40 + p * 17);
            q[2] = (uint8_t)(200 - p * 9), q[3] = (uint8_t)(255 - p * 7);
        }
    struct jpeg_compress_struct c;
    struct jpeg_error_mgr jerr;
    c.err = jpeg_std_error(&jerr);
    jpeg_create_compress(&c);
    unsigned char *buf = NULL;
    unsigned long len = 0;
    jpeg_mem_dest(&c, &buf, &len);
    c.image_width = W;
    c.image_height = H;
    c.input_components = 4;
    c.in_color_space = JCS_CMYK;
    jpeg_set_defaults(&c);
    jpeg_set_quality(&c, 98, TRUE);
    jpeg_start_compress(&c, TRUE);
    while (c.next_scanline < (JDIMENSION)H) {
        JSAMPROW row = cmyk + (size_t)c.next_scanline * W * 4;
        jpeg_write_scanlines(&c, &row, 1);
    }
    jpeg_finish_compress(&c);
    jpeg_destroy_compress(&c);

    kpl__decoder *d = NN(kpl__decoder_create());
    kpl__img_info info;
    int raw[3] = {0};
    OK(kpl__img_open(d, buf, len, "jpeg", raw, "cmyk", &info));
    assert_int_equal(info.channels, 4);
    kpl__img_view v;
    OK(kpl__img_decode(d, 1, 0, 0, W, H, 3, &v));
    int maxerr = 0;
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            const uint8_t *q = cmyk + ((size_t)y * W + x) * 4;
            for (int k = 0; k < 3; k++) {
                double want = q[k] * q[3] / 255.0;
                int e = abs((int)lrint(want) - v.data[(size_t)y * v.stride + 3 * x + k]);
                if (e > maxerr) maxerr = e;
            }
        }
    if (maxerr > 4) fail_msg("CMYK to RGB: max error %d", maxerr);
    /* The same through a window and to gray: the luma of the RGB above. */
    OK(kpl__img_open(d, buf, len, "jpeg", raw, "cmyk", &info));
    kpl__img_view g;
    OK(kpl__img_decode(d, 1, 21, 17, 30, 20, 1, &g));
    for (int y = 0; y < 20; y++)
        for (int x = 0; x < 30; x++) {
            const uint8_t *q = cmyk + ((size_t)(y + 17) * W + x + 21) * 4;
            double r = q[0] * q[3] / 255.0, gg = q[1] * q[3] / 255.0, b = q[2] * q[3] / 255.0;
            double want = 0.299 * r + 0.587 * gg + 0.114 * b;
            if (fabs(want - g.data[(size_t)y * g.stride + x]) > 4.5)
                fail_msg("CMYK to gray at (%d,%d): %d, want %.1f", x, y,
                         g.data[(size_t)y * g.stride + x], want);
        }
    kpl__decoder_destroy(d);
    free(buf);
    free(cmyk);
}

/* ---- (4b) EXIF orientation ----------------------------------------------------------- */

/* jpg with an APP1 Exif segment inserted after SOI: IFD0 holds a Make tag
 * and then Orientation (SHORT) = orient, in the byte order asked for.
 * malloc'd, *len bytes. */
static unsigned char *with_exif(const unsigned char *jpg, size_t n, int orient, bool big_endian,
                                size_t *len)
{
    uint8_t t[64];
    size_t k = 0;
#define P16(v) (big_endian ? (t[k++] = (uint8_t)((v) >> 8), t[k++] = (uint8_t)(v)) \
                           : (t[k++] = (uint8_t)(v), t[k++] = (uint8_t)((v) >> 8)))
#define P32(v) (big_endian ? (P16((v) >> 16), P16((v) & 0xffff)) : (P16((v) & 0xffff), P16((v) >> 16)))
    t[k++] = big_endian ? 'M' : 'I';
    t[k++] = big_endian ? 'M' : 'I';
    P16(42);
    P32(8u);          /* IFD0 right after the header */
    P16(2);           /* two entries */
    P16(0x010f);      /* Make, ASCII, 4 bytes inline */
    P16(2);
    P32(4u);
    memcpy(t + k, "kpl", 4), k += 4;
    P16(0x0112);      /* Orientation, SHORT, 1 */
    P16(3);
    P32(1u);
    P16((unsigned)orient);
    P16(0);
    P32(0u);          /* no next IFD */
#undef P16
#undef P32
    size_t seg = 2 + 6 + k;
    unsigned char *out = malloc(n + 2 + seg);
    memcpy(out, jpg, 2);
    out[2] = 0xff, out[3] = 0xe1, out[4] = (uint8_t)(seg >> 8), out[5] = (uint8_t)seg;
    memcpy(out + 6, "Exif\0\0", 6);
    memcpy(out + 12, t, k);
    memcpy(out + 12 + k, jpg + 2, n - 2);
    *len = n + 2 + seg;
    return out;
}

/* PIL's ImageOps.exif_transpose of a w x h x c image, written out as
 * Pillow's transposes define it (out[oy][ox] = in[y][x]):
 * 2 FLIP_LEFT_RIGHT, 3 ROTATE_180, 4 FLIP_TOP_BOTTOM, 5 TRANSPOSE,
 * 6 ROTATE_270 (90 degrees clockwise), 7 TRANSVERSE, 8 ROTATE_90. */
static uint8_t *exif_transpose_ref(const uint8_t *in, int w, int h, int c, int o, int *ow, int *oh)
{
    bool swap = o >= 5;
    *ow = swap ? h : w;
    *oh = swap ? w : h;
    uint8_t *out = malloc((size_t)w * h * c);
    for (int oy = 0; oy < *oh; oy++)
        for (int ox = 0; ox < *ow; ox++) {
            int x, y;
            switch (o) {
            case 2: x = w - 1 - ox, y = oy; break;
            case 3: x = w - 1 - ox, y = h - 1 - oy; break;
            case 4: x = ox, y = h - 1 - oy; break;
            case 5: x = oy, y = ox; break;
            case 6: x = oy, y = h - 1 - ox; break;
            case 7: x = w - 1 - oy, y = h - 1 - ox; break;
            case 8: x = w - 1 - oy, y = ox; break;
            default: x = ox, y = oy; break;
            }
            memcpy(out + ((size_t)oy * *ow + ox) * c, in + ((size_t)y * w + x) * c, (size_t)c);
        }
    return out;
}

/* Every orientation, both byte orders, every scale, windows all over:
 * the decoder's window equals the same window of TurboJPEG's decode at
 * that scale turned by exif_transpose_ref; the size it reports is the
 * turned one.  Then the transform on a 5-8 image (its output the turned
 * size), hand-checked values of two flat blocks, and malformed Exif. */
static void test_jpeg_exif_orientation(void **state)
{
    (void)state;
    const int W = 75, H = 43; /* not multiples of 8: the scaled sizes round up */
    uint8_t *pix = pattern(W, H, 3, 6);
    unsigned long jl;
    unsigned char *jpg = tj_encode(pix, W, H, TJPF_RGB, TJSAMP_420, 0, &jl);
    kpl__decoder *d = NN(kpl__decoder_create());
    int raw[3] = {0, 0, 0};
    for (int o = 1; o <= 8; o++)
        for (int be = 0; be < 2; be++) {
            size_t n;
            unsigned char *e = with_exif(jpg, jl, o, be, &n);
            for (int denom = 1; denom <= 8; denom *= 2)
                for (int channels = 1; channels <= 3; channels += 2) {
                    int sw, sh, ow, oh;
                    uint8_t *dec = tj_decode(jpg, jl, channels == 1 ? TJPF_GRAY : TJPF_RGB, denom,
                                             &sw, &sh);
                    uint8_t *ref = exif_transpose_ref(dec, sw, sh, channels, o, &ow, &oh);
                    const int win[][4] = {{0, 0, ow, oh}, {1, 2, 5, 3}, {ow - 4, oh - 3, 4, 3},
                                          {ow / 2, 0, 1, oh}, {0, oh / 2, ow, 1}};
                    for (size_t k = 0; k < sizeof win / sizeof win[0]; k++) {
                        int x = win[k][0], y = win[k][1], ww = win[k][2], hh = win[k][3];
                        if (x < 0 || y < 0 || ww > ow - x || hh > oh - y) continue;
                        kpl__img_info info;
                        OK(kpl__img_open(d, e, n, "", raw, "exif", &info));
                        assert_int_equal(info.orientation, o);
                        assert_int_equal(info.width, o >= 5 ? H : W);
                        assert_int_equal(info.height, o >= 5 ? W : H);
                        int iw, ih;
                        kpl__img_scaled_size(&info, denom, &iw, &ih);
                        assert_int_equal(iw, ow);
                        assert_int_equal(ih, oh);
                        kpl__img_view v;
                        OK(kpl__img_decode(d, denom, x, y, ww, hh, channels, &v));
                        char what[96];
                        snprintf(what, sizeof what, "orientation %d %s 1/%d c%d", o,
                                 be ? "MM" : "II", denom, channels);
                        assert_window(&v, ref, ow, channels, x, y, what);
                    }
                    free(ref);
                    free(dec);
                }
            /* Through the transform: CROP_NONE at the turned size copies it. */
            if (!be) {
                int sw, sh, ow, oh;
                uint8_t *dec = tj_decode(jpg, jl, TJPF_RGB, 1, &sw, &sh);
                uint8_t *ref = exif_transpose_ref(dec, sw, sh, 3, o, &ow, &oh);
                const void *b[1] = {e};
                kpl_dataset *ds = image_set(1, b, &n, "jpeg", 0, NULL);
                kpl_transform_config cfg = KPL_TRANSFORM_CONFIG_INIT;
                cfg.out_dtype = KPL_U8;
                cfg.out_h = oh;
                cfg.out_w = ow;
                uint8_t *out = malloc((size_t)3 * ow * oh);
                OK(sample(ds, &cfg, 0, 1, 0, out, NULL));
                assert_chw_equals_hwc(out, ref, ow, oh, 3, "exif through the transform");
                free(out);
                free(ref);
                free(dec);
                kpl_dataset_close(ds);
            }
            free(e);
        }
    tjFree(jpg);
    free(pix);

    /* By hand: a 16 x 8 gray JPEG at quality 100, left block 40, right
     * block 200 (flat blocks survive exactly).  Orientation 6 (rotate 90
     * clockwise) gives 8 x 16 with the left block on top; 8 (counter-
     * clockwise) puts it below; 3 (180) puts it on the right. */
    uint8_t g[16 * 8];
    for (int y = 0; y < 8; y++)
        for (int x = 0; x < 16; x++) g[y * 16 + x] = x < 8 ? 40 : 200;
    tjhandle t = tjInitCompress();
    unsigned char *gj = NULL;
    unsigned long gl = 0;
    assert_int_equal(tjCompress2(t, g, 16, 0, 8, TJPF_GRAY, &gj, &gl, TJSAMP_GRAY, 100, 0), 0);
    tjDestroy(t);
    const int cases[3][3] = {{6, 40, 200}, {8, 200, 40}, {3, 200, 40}}; /* o, first, second */
    for (int k = 0; k < 3; k++) {
        size_t n;
        unsigned char *e = with_exif(gj, gl, cases[k][0], k == 1, &n);
        kpl__img_info info;
        OK(kpl__img_open(d, e, n, "", raw, "hand", &info));
        kpl__img_view v;
        OK(kpl__img_decode(d, 1, 0, 0, info.width, info.height, 1, &v));
        for (int y = 0; y < v.h; y++)
            for (int x = 0; x < v.w; x++) {
                bool first = cases[k][0] == 3 ? x < 8 : y < 8;
                assert_int_equal(v.data[(size_t)y * v.stride + x], first ? cases[k][1] : cases[k][2]);
            }
        assert_int_equal(v.w, cases[k][0] == 3 ? 16 : 8);
        free(e);
    }

    /* Malformed or out-of-range Exif means no orientation, never a crash:
     * values 0 and 9, an IFD offset past the segment, an entry count
     * larger than the segment holds. */
    for (int k = 0; k < 4; k++) {
        size_t n;
        unsigned char *e = with_exif(gj, gl, k == 0 ? 0 : k == 1 ? 9 : 6, false, &n);
        if (k == 2) e[12 + 4] = 0xf0;               /* IFD0 offset 0xf0 */
        if (k == 3) e[12 + 8] = 0xff, e[12 + 9] = 0x7f; /* 32767 entries: the tag is past the end */
        if (k == 3) e[12 + 8 + 2 + 12] = 0x11;       /* ... and the real one is renamed */
        kpl__img_info info;
        OK(kpl__img_open(d, e, n, "", raw, "bad exif", &info));
        assert_int_equal(info.orientation, 1);
        assert_int_equal(info.width, 16);
        kpl__img_view v;
        OK(kpl__img_decode(d, 1, 0, 0, 16, 8, 1, &v));
        free(e);
    }
    tjFree(gj);
    kpl__decoder_destroy(d);
}

/* ---- (5) corrupt images --------------------------------------------------------------- */

static unsigned char *png_encode(const void *pix, int w, int h, uint32_t format,
                                 const void *colormap, int entries, size_t *len);

static void test_corrupt(void **state)
{
    (void)state;
    const int W = 203, H = 157;
    uint8_t *pix = pattern(W, H, 3, 4);
    unsigned long jl;
    unsigned char *jpg = tj_encode(pix, W, H, TJPF_RGB, TJSAMP_420, 0, &jl);
    uint8_t garbage[300];
    for (int i = 0; i < 300; i++) garbage[i] = (uint8_t)(i * 37 + 11);
    size_t pl;
    unsigned char *png = png_encode(pix, W, H, PNG_FORMAT_RGB, NULL, 0, &pl);
    /* The first IDAT chunk's stored CRC, one byte off. */
    unsigned char *bad_png = malloc(pl);
    memcpy(bad_png, png, pl);
    size_t at = 8;
    while (at + 8 < pl && memcmp(bad_png + at + 4, "IDAT", 4)) at += 12 + __builtin_bswap32(kpl__rd32(bad_png + at));
    bad_png[at + 8 + __builtin_bswap32(kpl__rd32(bad_png + at)) + 1] ^= 0x55;
    /* A JPEG whose entropy data is cut at half, and one with a bit flipped
     * in the middle of it. */
    unsigned char *flip = malloc(jl);
    memcpy(flip, jpg, jl);
    for (unsigned long i = jl / 2; i < jl / 2 + 40; i++) flip[i] ^= 0xff;

    const void *b[5] = {jpg, garbage, bad_png, jpg, flip};
    size_t n[5] = {jl, sizeof garbage, pl, jl / 2, jl};
    kpl_dataset *ds = image_set(5, b, n, "", 0, NULL);
    kpl_transform_config cfg = KPL_TRANSFORM_CONFIG_INIT;
    cfg.out_h = H;
    cfg.out_w = W;
    float *out = malloc(sizeof(float) * 3 * W * H);
    OK(sample(ds, &cfg, 0, 1, 0, out, NULL));
    FAILS(sample(ds, &cfg, 1, 1, 0, out, NULL), KPL_EFORMAT, "example 1, feature 'image': neither");
    FAILS(sample(ds, &cfg, 2, 1, 0, out, NULL), KPL_EFORMAT, "example 2, feature 'image': PNG");
    FAILS(sample(ds, &cfg, 2, 1, 0, out, NULL), KPL_EFORMAT, "CRC");
    FAILS(sample(ds, &cfg, 3, 1, 0, out, NULL), KPL_EFORMAT,
          "example 3, feature 'image': JPEG: Premature end");
    FAILS(sample(ds, &cfg, 4, 1, 0, out, NULL), KPL_EFORMAT, "example 4, feature 'image': JPEG:");
    /* The decoder recovers: the good image after the bad ones. */
    OK(sample(ds, &cfg, 0, 1, 0, out, NULL));
    kpl_dataset_close(ds);
    free(out);
    free(flip);
    free(bad_png);
    free(png);
    tjFree(jpg);
    free(pix);
}

/* ---- (6) PNG ------------------------------------------------------------------------ */

static unsigned char *png_encode(const void *pix, int w, int h, uint32_t format,
                                 const void *colormap, int entries, size_t *len)
{
    png_image im;
    memset(&im, 0, sizeof im);
    im.version = PNG_IMAGE_VERSION;
    im.width = (png_uint_32)w;
    im.height = (png_uint_32)h;
    im.format = format;
    im.colormap_entries = (png_uint_32)entries;
    png_alloc_size_t n = 0;
    if (!png_image_write_to_memory(&im, NULL, &n, 0, pix, 0, colormap))
        fail_msg("png size: %s", im.message);
    unsigned char *buf = malloc(n);
    if (!png_image_write_to_memory(&im, buf, &n, 0, pix, 0, colormap))
        fail_msg("png write: %s", im.message);
    *len = n;
    return buf;
}

/* A 16-bit gray PNG of exactly these values (libpng's simplified API
 * writes 16-bit formats as linear light, so this goes through the full
 * one). */
typedef struct {
    unsigned char *p;
    size_t n, cap;
} membuf;
static void mem_write(png_structp png, png_bytep data, size_t n)
{
    membuf *b = png_get_io_ptr(png);
    if (b->n + n > b->cap) {
        b->cap = 2 * (b->n + n);
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
}
static void mem_flush(png_structp png) { (void)png; }
static unsigned char *png_encode16_gray(const uint16_t *v, int w, int h, size_t *len)
{
    membuf b = {NULL, 0, 0};
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png_create_info_struct(png);
    if (setjmp(png_jmpbuf(png))) fail_msg("png16 write failed");
    png_set_write_fn(png, &b, mem_write, mem_flush);
    png_set_IHDR(png, info, (png_uint_32)w, (png_uint_32)h, 16, PNG_COLOR_TYPE_GRAY,
                 PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    uint8_t *row = malloc((size_t)w * 2);
    for (int y = 0; y < h; y++) {
        for (int x = 0; x < w; x++) {
            row[2 * x] = (uint8_t)(v[y * w + x] >> 8);
            row[2 * x + 1] = (uint8_t)v[y * w + x];
        }
        png_write_row(png, row);
    }
    png_write_end(png, NULL);
    png_destroy_write_struct(&png, &info);
    free(row);
    *len = b.n;
    return b.p;
}

/* Decodes the whole PNG through the decoder at `channels`. */
static kpl__img_view png_decode(kpl__decoder *d, const unsigned char *png, size_t len, int channels)
{
    kpl__img_info info;
    int raw[3] = {0};
    OK(kpl__img_open(d, png, len, "", raw, "png", &info));
    assert_int_equal(info.kind, KPL__IMG_PNG);
    kpl__img_view v;
    OK(kpl__img_decode(d, 1, 0, 0, info.width, info.height, channels, &v));
    return v;
}

static int luma(int r, int g, int b) { return (19595 * r + 38470 * g + 7471 * b + 32768) >> 16; }

static void test_png(void **state)
{
    (void)state;
    enum { W = 7, H = 5, N = W * H };
    kpl__decoder *d = NN(kpl__decoder_create());
    uint8_t rgba[N * 4], gray[N], idx[N], cmap[4 * 3];
    uint16_t g16[N], rgb16[N * 3];
    for (int i = 0; i < N; i++) {
        for (int k = 0; k < 4; k++) rgba[4 * i + k] = (uint8_t)(i * 7 + k * 60);
        gray[i] = (uint8_t)(i * 7);
        idx[i] = (uint8_t)(i % 4);
        g16[i] = (uint16_t)(i * 1800);
        for (int k = 0; k < 3; k++) rgb16[3 * i + k] = (uint16_t)(257 * (i * 5 + k));
    }
    for (int k = 0; k < 12; k++) cmap[k] = (uint8_t)(k * 21 + 3);
    size_t len;
    unsigned char *p;
    kpl__img_view v;

    p = png_encode(gray, W, H, PNG_FORMAT_GRAY, NULL, 0, &len);
    v = png_decode(d, p, len, 1);
    for (int i = 0; i < N; i++) assert_int_equal(v.data[(i / W) * v.stride + i % W], gray[i]);
    v = png_decode(d, p, len, 3);
    for (int i = 0; i < N; i++)
        for (int k = 0; k < 3; k++) assert_int_equal(v.data[(i / W) * v.stride + 3 * (i % W) + k], gray[i]);
    free(p);

    uint8_t rgb[N * 3];
    for (int i = 0; i < N; i++)
        for (int k = 0; k < 3; k++) rgb[3 * i + k] = rgba[4 * i + k];
    p = png_encode(rgb, W, H, PNG_FORMAT_RGB, NULL, 0, &len);
    v = png_decode(d, p, len, 3);
    for (int i = 0; i < N * 3; i++) assert_int_equal(v.data[(i / (3 * W)) * v.stride + i % (3 * W)], rgb[i]);
    v = png_decode(d, p, len, 1);
    for (int i = 0; i < N; i++)
        assert_int_equal(v.data[(i / W) * v.stride + i % W], luma(rgb[3 * i], rgb[3 * i + 1], rgb[3 * i + 2]));
    free(p);

    /* RGBA: alpha dropped (as PIL's convert("RGB")), colors as stored. */
    p = png_encode(rgba, W, H, PNG_FORMAT_RGBA, NULL, 0, &len);
    v = png_decode(d, p, len, 3);
    for (int i = 0; i < N * 3; i++) assert_int_equal(v.data[(i / (3 * W)) * v.stride + i % (3 * W)], rgb[i]);
    free(p);

    /* Gray + alpha to gray. */
    uint8_t ga[N * 2];
    for (int i = 0; i < N; i++) ga[2 * i] = gray[i], ga[2 * i + 1] = (uint8_t)(255 - i);
    p = png_encode(ga, W, H, PNG_FORMAT_GA, NULL, 0, &len);
    v = png_decode(d, p, len, 1);
    for (int i = 0; i < N; i++) assert_int_equal(v.data[(i / W) * v.stride + i % W], gray[i]);
    free(p);

    /* Palette: expanded for an image, indices as stored for a mask. */
    p = png_encode(idx, W, H, PNG_FORMAT_RGB_COLORMAP, cmap, 4, &len);
    v = png_decode(d, p, len, 3);
    for (int i = 0; i < N; i++)
        for (int k = 0; k < 3; k++)
            assert_int_equal(v.data[(i / W) * v.stride + 3 * (i % W) + k], cmap[3 * idx[i] + k]);
    kpl__img_view m;
    OK(kpl__mask_decode(d, p, len, "png", W, H, "mask", &m));
    for (int i = 0; i < N; i++) assert_int_equal(m.data[(i / W) * m.stride + i % W], idx[i]);
    FAILS(kpl__mask_decode(d, p, len, "png", W + 1, H, "example 9, feature 'mask'", &m), KPL_EFORMAT,
          "example 9, feature 'mask': mask is 7x5");
    free(p);
    p = png_encode(gray, W, H, PNG_FORMAT_GRAY, NULL, 0, &len);
    OK(kpl__mask_decode(d, p, len, "", W, H, "mask", &m));
    for (int i = 0; i < N; i++) assert_int_equal(m.data[(i / W) * m.stride + i % W], gray[i]);
    free(p);
    p = png_encode(rgb, W, H, PNG_FORMAT_RGB, NULL, 0, &len);
    FAILS(kpl__mask_decode(d, p, len, "", W, H, "example 4, feature 'mask'", &m), KPL_EFORMAT,
          "must be gray (up to 16 bits) or a palette (color type 2");
    free(p);
    /* VOC's palette: index k has the colour of bit-interleaved k, index
     * 255 (the boundary, "ignore") is (224, 224, 192); the mask is the
     * indices, never a colour. */
    {
        uint8_t voc[256 * 3], vidx[N];
        for (int k = 0; k < 256; k++) {
            int r = 0, g = 0, b = 0;
            for (int j = 0, c = k; j < 8; j++, c >>= 3) {
                r |= ((c >> 0) & 1) << (7 - j);
                g |= ((c >> 1) & 1) << (7 - j);
                b |= ((c >> 2) & 1) << (7 - j);
            }
            voc[3 * k] = (uint8_t)r, voc[3 * k + 1] = (uint8_t)g, voc[3 * k + 2] = (uint8_t)b;
        }
        assert_int_equal(voc[3 * 1], 128); /* aeroplane (128, 0, 0) */
        assert_int_equal(voc[3 * 255 + 2], 192);
        for (int i = 0; i < N; i++) vidx[i] = (uint8_t)(i % 7 == 6 ? 255 : i % 21);
        p = png_encode(vidx, W, H, PNG_FORMAT_RGB_COLORMAP, voc, 256, &len);
        OK(kpl__mask_decode(d, p, len, "png", W, H, "mask", &m));
        for (int i = 0; i < N; i++) assert_int_equal(m.data[(i / W) * m.stride + i % W], vidx[i]);
        free(p);
    }
    /* 16-bit gray masks: values as stored (no scaling), each at most 255. */
    {
        uint16_t m16[N];
        for (int i = 0; i < N; i++) m16[i] = (uint16_t)(i % 3 == 2 ? 255 : i);
        p = png_encode16_gray(m16, W, H, &len);
        OK(kpl__mask_decode(d, p, len, "", W, H, "mask", &m));
        for (int i = 0; i < N; i++) assert_int_equal(m.data[(i / W) * m.stride + i % W], m16[i]);
        free(p);
        m16[2 * W + 3] = 300;
        p = png_encode16_gray(m16, W, H, &len);
        FAILS(kpl__mask_decode(d, p, len, "png", W, H, "example 12, feature 'mask'", &m),
              KPL_EFORMAT, "example 12, feature 'mask': 16-bit mask value 300 at (x 3, y 2) is "
              "past 255");
        free(p);
    }

    /* 16 bits (the linear formats are written as 16-bit samples): rounded
     * to 8 bits, v * 255 / 65535. */
    p = png_encode(g16, W, H, PNG_FORMAT_LINEAR_Y, NULL, 0, &len);
    v = png_decode(d, p, len, 1);
    for (int i = 0; i < N; i++)
        assert_int_equal(v.data[(i / W) * v.stride + i % W], (int)lrint(g16[i] * 255.0 / 65535.0));
    free(p);
    p = png_encode(rgb16, W, H, PNG_FORMAT_LINEAR_RGB, NULL, 0, &len);
    v = png_decode(d, p, len, 3);
    for (int i = 0; i < N; i++)
        for (int k = 0; k < 3; k++)
            assert_int_equal(v.data[(i / W) * v.stride + 3 * (i % W) + k], i * 5 + k);
    free(p);
    kpl__decoder_destroy(d);
}

/* ---- (7) resize against a double-precision reference ------------------------------- */

/* PIL's bilinear filter, separable, in double, taps clamped to the image. */
static void ref_axis(double in0, double scale, int n, int insize, int i, int *xmin, int *cnt,
                     double *w)
{
    double fs = scale > 1 ? scale : 1;
    double center = in0 + (i + 0.5) * scale;
    int a = (int)floor(center - fs + 0.5), b = (int)floor(center + fs + 0.5);
    if (a < 0) a = 0;
    if (b > insize) b = insize;
    double ww = 0;
    for (int j = a; j < b; j++) {
        double t = fabs((j - center + 0.5) / fs);
        w[j - a] = t < 1 ? 1 - t : 0;
        ww += w[j - a];
    }
    for (int j = 0; j < b - a; j++) w[j] /= ww;
    *xmin = a;
    *cnt = b - a;
    (void)n;
}

static void ref_resize(const uint8_t *src, int sw, int sh, int c, double x0, double y0, double bw,
                       double bh, int ow, int oh, double *out)
{
    double *tmp = malloc(sizeof(double) * (size_t)sh * ow * c), wx[4096], wy[4096];
    for (int y = 0; y < sh; y++)
        for (int x = 0; x < ow; x++) {
            int a, n;
            ref_axis(x0, bw / ow, ow, sw, x, &a, &n, wx);
            for (int k = 0; k < c; k++) {
                double s = 0;
                for (int j = 0; j < n; j++) s += wx[j] * src[((size_t)y * sw + a + j) * c + k];
                tmp[((size_t)y * ow + x) * c + k] = s;
            }
        }
    for (int y = 0; y < oh; y++) {
        int a, n;
        ref_axis(y0, bh / oh, oh, sh, y, &a, &n, wy);
        for (int i = 0; i < ow * c; i++) {
            double s = 0;
            for (int j = 0; j < n; j++) s += wy[j] * tmp[(size_t)(a + j) * ow * c + i];
            out[(size_t)y * ow * c + i] = s;
        }
    }
    free(tmp);
}

static void test_resize_reference(void **state)
{
    (void)state;
    kpl__xform_scratch *s = NN(kpl__xform_scratch_create());
    const struct {
        int sw, sh, c;
        double x0, y0, bw, bh;
        int ow, oh;
    } cases[] = {
        {203, 157, 3, 0, 0, 203, 157, 64, 48},       /* down ~3x */
        {203, 157, 3, 10, 7, 150, 120, 224, 224},    /* up */
        {203, 157, 1, 3.25, 9.5, 97.5, 31.75, 40, 90}, /* fractional box, mixed */
        {500, 375, 3, 0, 0, 500, 375, 61, 7},        /* strong shrink */
        {33, 29, 3, 0, 0, 33, 29, 33, 29},           /* identity */
        {40, 30, 3, 0.5, 0.5, 39, 29, 39, 29},       /* half-pixel shift */
        {17, 13, 1, 0, 0, 17, 13, 300, 5},
    };
    int worst = 0;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int sw = cases[k].sw, sh = cases[k].sh, c = cases[k].c, ow = cases[k].ow, oh = cases[k].oh;
        uint8_t *src = pattern(sw, sh, c, 10 + (uint32_t)k);
        uint8_t *out = malloc((size_t)ow * oh * c);
        double *ref = malloc(sizeof(double) * (size_t)ow * oh * c);
        kpl__img_view v = {src, sw, sh, c, (size_t)sw * c};
        OK(kpl__resize(s, &v, cases[k].x0, cases[k].y0, cases[k].bw, cases[k].bh, ow, oh, out));
        ref_resize(src, sw, sh, c, cases[k].x0, cases[k].y0, cases[k].bw, cases[k].bh, ow, oh, ref);
        for (size_t i = 0; i < (size_t)ow * oh * c; i++) {
            double e = fabs(out[i] - ref[i]);
            if (e > 1.0)
                fail_msg("resize case %zu, element %zu: %d, reference %.3f", k, i, out[i], ref[i]);
            if (e > 0.5 && e > worst) worst = 1;
        }
        if (k == 4) /* identity is exact */
            assert_memory_equal(out, src, (size_t)ow * oh * c);
        free(src);
        free(out);
        free(ref);
    }
    /* A flat image stays exactly flat at every scale. */
    uint8_t flat[50 * 40 * 3], o[123 * 17 * 3];
    memset(flat, 201, sizeof flat);
    kpl__img_view v = {flat, 50, 40, 3, 150};
    OK(kpl__resize(s, &v, 1.3, 2.1, 37.7, 30.2, 123, 17, o));
    for (size_t i = 0; i < sizeof o; i++) assert_int_equal(o[i], 201);
    kpl__xform_scratch_destroy(s);
}

/* ---- (8) crops, keying, flip, normalize, jitter ----------------------------------- */

static void test_rrc_params(void **state)
{
    (void)state;
    const float scale[2] = {0.08f, 1.0f}, ratio[2] = {3.0f / 4, 4.0f / 3};
    const int W = 500, H = 375;
    int accepted = 0;
    for (int i = 0; i < 20000; i++) {
        kpl__rng r = kpl__rng_key(7, 0, (uint64_t)i);
        int x, y, cw, ch;
        kpl__rrc_params(&r, W, H, scale, ratio, &x, &y, &cw, &ch);
        assert_true(cw >= 1 && ch >= 1 && x >= 0 && y >= 0 && x + cw <= W && y + ch <= H);
        if (cw == W && ch == H) continue; /* may be the fallback */
        accepted++;
        /* w and h were rounded from sqrt(a r), sqrt(a / r): allow half a
         * pixel on each. */
        double amin = (cw - 0.5) * (ch - 0.5), amax = (cw + 0.5) * (ch + 0.5);
        assert_true(amax >= 0.08 * W * H && amin <= 1.0 * W * H);
        double rmin = (cw - 0.5) / (ch + 0.5), rmax = (cw + 0.5) / (ch - 0.5);
        assert_true(rmax >= 0.75 && rmin <= 4.0 / 3);
    }
    assert_true(accepted > 19000);
    /* The fallback: a 1000x10 strip cannot hold any crop of ratio 1 and
     * area >= 90%: the whole height, a centered square. */
    const float s2[2] = {0.9f, 1.0f}, r2[2] = {1.0f, 1.0f};
    kpl__rng r = kpl__rng_key(1, 2, 3);
    int x, y, cw, ch;
    kpl__rrc_params(&r, 1000, 10, s2, r2, &x, &y, &cw, &ch);
    assert_int_equal(cw, 10);
    assert_int_equal(ch, 10);
    assert_int_equal(x, 495);
    assert_int_equal(y, 0);
    /* Tall image, ratio range [3/4, 4/3]: width kept, h = round(w / (3/4)). */
    const float s3[2] = {1.5f, 2.0f};
    kpl__rrc_params(&r, 30, 1000, s3, ratio, &x, &y, &cw, &ch);
    assert_int_equal(cw, 30);
    assert_int_equal(ch, 40);
    assert_int_equal(x, 0);
    assert_int_equal(y, 480);
    /* Inside the ratio range the fallback is the whole image. */
    kpl__rrc_params(&r, 100, 90, s3, ratio, &x, &y, &cw, &ch);
    assert_true(x == 0 && y == 0 && cw == 100 && ch == 90);
}

static void test_keying_and_flip(void **state)
{
    (void)state;
    const int W = 203, H = 157, O = 64;
    uint8_t *pix = pattern(W, H, 3, 5);
    unsigned long len;
    unsigned char *jpg = tj_encode(pix, W, H, TJPF_RGB, TJSAMP_420, 0, &len);
    const void *b[2] = {jpg, jpg};
    size_t n[2] = {len, len};
    kpl_dataset *ds = image_set(2, b, n, "jpeg", 0, NULL);
    kpl_transform_config cfg = KPL_TRANSFORM_CONFIG_INIT;
    cfg.crop = KPL_CROP_RANDOM_RESIZED;
    cfg.out_h = cfg.out_w = O;
    cfg.flip_prob = 0.5f;
    cfg.brightness = cfg.contrast = cfg.saturation = 0.4f;
    size_t nb = sizeof(float) * 3 * O * O;
    float *a = malloc(nb), *a2 = malloc(nb), *c = malloc(nb);
    OK(sample(ds, &cfg, 0, 42, 3, a, NULL));
    OK(sample(ds, &cfg, 0, 42, 3, a2, NULL));
    assert_memory_equal(a, a2, nb); /* same key: the same bytes */
    OK(sample(ds, &cfg, 1, 42, 3, c, NULL));
    assert_true(memcmp(a, c, nb) != 0); /* same image, another example: another crop */
    OK(sample(ds, &cfg, 0, 42, 4, c, NULL));
    assert_true(memcmp(a, c, nb) != 0); /* another epoch */

    /* End to end against TurboJPEG's full decode: the crop drawn from the
     * same key, cut out of tj's decode (at the scale the transform picks)
     * and resized with the tested resize, equals the transform's output:
     * the region decode hands over exactly the pixels a full decode has. */
    cfg.brightness = cfg.contrast = cfg.saturation = 0;
    cfg.out_dtype = KPL_U8;
    cfg.flip_prob = 0;
    kpl__xform_scratch *s = NN(kpl__xform_scratch_create());
    uint8_t *u = malloc((size_t)3 * O * O), *want = malloc((size_t)3 * O * O);
    int scaled_seen = 0;
    for (int64_t ex = 0; ex < 2; ex++)
        for (int epoch = 0; epoch < 40; epoch++) {
            OK(sample(ds, &cfg, ex, 9, epoch, u, NULL));
            kpl__rng r = kpl__rng_key(9, (uint64_t)epoch, (uint64_t)ex);
            for (int k = 0; k < 4; k++) kpl__rng_uniform(&r);
            int x, y, cw, ch;
            kpl__rrc_params(&r, W, H, cfg.scale, cfg.ratio, &x, &y, &cw, &ch);
            int denom = 1;
            for (int d = 8; d >= 2; d /= 2)
                if (cw >= d * O && ch >= d * O) {
                    denom = d;
                    break;
                }
            scaled_seen += denom > 1;
            int sw, sh;
            uint8_t *full = tj_decode(jpg, len, TJPF_RGB, denom, &sw, &sh);
            double fx = (double)sw / W, fy = (double)sh / H;
            int x0 = (int)floor(x * fx), y0 = (int)floor(y * fy);
            int x1 = (int)ceil((x + cw) * fx), y1 = (int)ceil((y + ch) * fy);
            if (x1 > sw) x1 = sw;
            if (y1 > sh) y1 = sh;
            kpl__img_view v = {full + ((size_t)y0 * sw + x0) * 3, x1 - x0, y1 - y0, 3,
                               (size_t)sw * 3};
            OK(kpl__resize(s, &v, x * fx - x0, y * fy - y0, cw * fx, ch * fy, O, O, want));
            assert_chw_equals_hwc(u, want, O, O, 3, "random-resized crop vs tj + resize");
            free(full);
        }
    assert_true(scaled_seen > 0); /* some crops took the DCT-scaled path */

    /* Flip: p = 1 mirrors the p = 0 output exactly (same key, same crop). */
    uint8_t *f = malloc((size_t)3 * O * O);
    cfg.flip_prob = 1;
    OK(sample(ds, &cfg, 1, 5, 0, f, NULL));
    cfg.flip_prob = 0;
    OK(sample(ds, &cfg, 1, 5, 0, u, NULL));
    for (int k = 0; k < 3; k++)
        for (int y = 0; y < O; y++)
            for (int x = 0; x < O; x++)
                assert_int_equal(f[(k * O + y) * O + x], u[(k * O + y) * O + O - 1 - x]);
    /* f32 without jitter is normalized as the resize stores it: the same
     * numbers as the u8 output put through (x/255 - mean) / std. */
    cfg.flip_prob = 1;
    cfg.out_dtype = KPL_F32;
    const float mean[3] = {0.485f, 0.456f, 0.406f}, std[3] = {0.229f, 0.224f, 0.225f};
    memcpy(cfg.mean, mean, sizeof mean);
    memcpy(cfg.std, std, sizeof std);
    OK(sample(ds, &cfg, 1, 5, 0, a, NULL));
    for (int i = 0; i < 3 * O * O; i++) {
        float want = ((float)f[i] / 255.0f - mean[i / (O * O)]) / std[i / (O * O)];
        if (a[i] != want) fail_msg("f32 element %d: %.9g, want %.9g", i, a[i], want);
    }
    kpl__xform_scratch_destroy(s);
    free(f);
    free(u);
    free(want);
    free(a);
    free(a2);
    free(c);
    kpl_dataset_close(ds);
    tjFree(jpg);
    free(pix);
}

/* A raw (2, 3, 3) image: normalization, and each jitter on its own and
 * together, against the formulas of dataio.h / docs/transforms.md. */
static const uint8_t tiny[2 * 3 * 3] = {10, 200, 30, 250, 0, 128, 77, 77, 77,
                                        0, 0, 0, 255, 255, 255, 90, 160, 220};

static double clampd(double v) { return v < 0 ? 0 : v > 255 ? 255 : v; }

static void test_normalize_and_jitter(void **state)
{
    (void)state;
    const int64_t shape[3] = {2, 3, 3};
    const void *b[1] = {tiny};
    size_t n[1] = {sizeof tiny};
    kpl_dataset *ds = image_set(1, b, n, "raw", 3, shape);
    kpl_transform_config cfg = KPL_TRANSFORM_CONFIG_INIT;
    const float mean[3] = {0.485f, 0.456f, 0.406f}, std[3] = {0.229f, 0.224f, 0.225f};
    memcpy(cfg.mean, mean, sizeof mean);
    memcpy(cfg.std, std, sizeof std);
    float out[18];
    OK(sample(ds, &cfg, 0, 1, 0, out, NULL));
    for (int k = 0; k < 3; k++)
        for (int p = 0; p < 6; p++)
            assert_close(out[k * 6 + p], ((double)tiny[3 * p + k] / 255 - mean[k]) / std[k], 1e-6,
                         1e-6, "normalize", k * 6 + p);

    const float amounts[4][3] = {{0.5f, 0, 0}, {0, 0.5f, 0}, {0, 0, 0.9f}, {0.3f, 0.6f, 0.8f}};
    for (int t = 0; t < 4; t++) {
        cfg.brightness = amounts[t][0];
        cfg.contrast = amounts[t][1];
        cfg.saturation = amounts[t][2];
        for (uint64_t seed = 0; seed < 5; seed++) {
            OK(sample(ds, &cfg, 0, seed, 2, out, NULL));
            /* The draws: flip, brightness, contrast, saturation. */
            kpl__rng r = kpl__rng_key(seed, 2, 0);
            kpl__rng_uniform(&r);
            double f[3];
            for (int j = 0; j < 3; j++) {
                double u = kpl__rng_uniform(&r), x = amounts[t][j];
                double lo = x < 1 ? 1 - x : 0;
                f[j] = x > 0 ? lo + (1 + x - lo) * u : 1;
            }
            double v[6][3], mean_gray = 0;
            for (int p = 0; p < 6; p++) {
                for (int k = 0; k < 3; k++) v[p][k] = clampd(f[0] * tiny[3 * p + k]);
                mean_gray += (0.299 * v[p][0] + 0.587 * v[p][1] + 0.114 * v[p][2]) / 6;
            }
            for (int p = 0; p < 6; p++) {
                for (int k = 0; k < 3; k++) v[p][k] = clampd(f[1] * v[p][k] + (1 - f[1]) * mean_gray);
                double g = 0.299 * v[p][0] + 0.587 * v[p][1] + 0.114 * v[p][2];
                for (int k = 0; k < 3; k++) v[p][k] = clampd(f[2] * v[p][k] + (1 - f[2]) * g);
                for (int k = 0; k < 3; k++)
                    assert_close(out[k * 6 + p], (v[p][k] / 255 - mean[k]) / std[k], 1e-5, 1e-5,
                                 "jitter", t * 100 + k * 6 + p);
            }
        }
    }
    kpl_dataset_close(ds);
}

/* ---- (9) boxes and masks ------------------------------------------------------------ */

static void test_boxes_and_mask(void **state)
{
    (void)state;
    enum { W = 100, H = 80 };
    static uint8_t img[W * H * 3], mask[W * H];
    for (int i = 0; i < W * H * 3; i++) img[i] = (uint8_t)(i % 251);
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) mask[y * W + x] = (uint8_t)(x + 100 * (y % 2));
    const float boxes[] = {
        10, 0, 50, 40,    /* inside the crop */
        0, 10, 20, 30,    /* partly left of the crop: clipped */
        40, 40, 40, 60,   /* zero width: dropped */
        95, 0, 100, 10,   /* right of the crop: dropped */
        20, 60, 120, 100, /* clipped right and bottom */
        30, 30, 40, 40,   /* the sixth: max_boxes must be 6 or more */
    };
    const int64_t blabels[6] = {1, 2, 3, 4, 5, 6}, crowd[6] = {0, 1, 0, 0, 0, 0};
    kpl_feature_spec sc[5] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {H, W, 3}},
        {.name = "boxes", .type = KPL_FEATURE_FLOAT},
        {.name = "cls", .type = KPL_FEATURE_INT64},
        {.name = "seg", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 2, .shape = {H, W}},
        {.name = "crowd", .type = KPL_FEATURE_INT64},
    };
    char dir[128];
    snprintf(dir, sizeof dir, "%s/boxes", tmp_root);
    kpl_record_writer_config wc = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 5, sc, &wc, &w));
    kpl_feature_value v[5] = {{img, sizeof img}, {boxes, 24}, {blabels, 6}, {mask, sizeof mask},
                              {crowd, 6}};
    OK(kpl_record_writer_add(w, v));
    v[1].count = 23; /* not a multiple of 4 */
    OK(kpl_record_writer_add(w, v));
    OK(kpl_record_writer_close(w));
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(dir, &ds));

    /* Center crop: 100x80 -> shorter side 40 gives 50x40, the centered 40x40
     * starts at x = 5, i.e. the box x in [10, 90), y in [0, 80) of the
     * stored image, scaled by 1/2. */
    kpl_transform_config cfg = KPL_TRANSFORM_CONFIG_INIT;
    cfg.label_feature = NULL;
    cfg.boxes_feature = "boxes";
    cfg.box_labels_feature = "cls";
    cfg.mask_feature = "seg";
    cfg.crop = KPL_CROP_CENTER;
    cfg.resize_shorter = 40;
    cfg.out_h = cfg.out_w = 40;
    float out_img[3 * 40 * 40], ob[4 * 6];
    int64_t ol[6], nbox = -1;
    uint8_t om[40 * 40];
    /* Six stored boxes and room for 4 is an error naming the example, not
     * a truncation to the first 4 (even though only 4 survive this crop),
     * and KPL_EINVAL, which skip_corrupt does not skip. */
    cfg.max_boxes = 4;
    kpl__sample_out ex4 = {.boxes = ob, .box_labels = ol, .num_boxes = &nbox};
    FAILS(sample(ds, &cfg, 0, 1, 0, out_img, &ex4), KPL_EINVAL,
          "example 0, feature 'boxes': 6 boxes, more than max_boxes 4 (raise max_boxes to the "
          "most boxes an example holds; in a recipe data.<split>.max_boxes)");
    cfg.max_boxes = 6;
    for (int flip = 0; flip < 2; flip++) {
        cfg.flip_prob = (float)flip;
        kpl__sample_out ex = {.boxes = ob, .box_labels = ol, .num_boxes = &nbox, .mask = om};
        OK(sample(ds, &cfg, 0, 1, 0, out_img, &ex));
        const float want[4][4] = {{0, 0, 20, 20}, {0, 5, 5, 15}, {5, 30, 40, 40}, {10, 15, 15, 20}};
        const int64_t wl[4] = {1, 2, 5, 6};
        assert_int_equal(nbox, 4);
        for (int i = 0; i < 4; i++) {
            float x0 = want[i][0], x1 = want[i][2];
            if (flip) x0 = 40 - want[i][2], x1 = 40 - want[i][0];
            assert_close(ob[4 * i], x0, 0, 1e-5, "box x0", i);
            assert_close(ob[4 * i + 1], want[i][1], 0, 1e-5, "box y0", i);
            assert_close(ob[4 * i + 2], x1, 0, 1e-5, "box x1", i);
            assert_close(ob[4 * i + 3], want[i][3], 0, 1e-5, "box y1", i);
            assert_int_equal(ol[i], wl[i]);
        }
        for (int i = 16; i < 24; i++) assert_true(ob[i] == 0);
        assert_int_equal(ol[4], -1);
        assert_int_equal(ol[5], -1);
        /* Nearest: output (i, j) reads stored (10 + 2i + 1, 2j + 1). */
        for (int j = 0; j < 40; j++)
            for (int i = 0; i < 40; i++) {
                int si = flip ? 39 - i : i;
                assert_int_equal(om[j * 40 + i], mask[(2 * j + 1) * W + 10 + 2 * si + 1]);
            }
    }
    /* Fewer boxes than max_boxes: unused rows zero, labels -1. */
    cfg.max_boxes = 8;
    cfg.flip_prob = 0;
    float ob8[32];
    int64_t ol8[8];
    kpl__sample_out ex8 = {.boxes = ob8, .box_labels = ol8, .num_boxes = &nbox};
    memset(ob8, 0x7f, sizeof ob8);
    OK(sample(ds, &cfg, 0, 1, 0, out_img, &ex8));
    assert_int_equal(nbox, 4);
    for (int i = 16; i < 32; i++) assert_true(ob8[i] == 0);
    assert_int_equal(ol8[3], 6);
    for (int i = 4; i < 8; i++) assert_int_equal(ol8[i], -1);
    /* Flagged boxes (box_ignore_feature: crowd regions) are left out: the
     * second box (label 2) goes, the others keep their order. */
    cfg.box_ignore_feature = "crowd";
    OK(sample(ds, &cfg, 0, 1, 0, out_img, &ex8));
    assert_int_equal(nbox, 3);
    const int64_t kept[3] = {1, 5, 6};
    for (int i = 0; i < 3; i++) assert_int_equal(ol8[i], kept[i]);
    assert_close(ob8[4], 5, 0, 1e-5, "box x0 after the crowd box", 0);
    assert_int_equal(ol8[3], -1);
    cfg.box_ignore_feature = "cls"; /* any int64 list of one flag per box */
    cfg.box_labels_feature = NULL;
    OK(sample(ds, &cfg, 0, 1, 0, out_img, &ex8)); /* cls has 6 entries too: all flagged */
    assert_int_equal(nbox, 0);
    cfg.box_ignore_feature = "seg";
    FAILS(sample(ds, &cfg, 0, 1, 0, out_img, &ex8), KPL_EINVAL,
          "transform: box_ignore_feature 'seg' is bytes, not int64");
    cfg.box_ignore_feature = NULL;
    cfg.box_labels_feature = "cls";
    FAILS(sample(ds, &cfg, 1, 1, 0, out_img, &ex8), KPL_EFORMAT,
          "example 1, feature 'boxes': 23 box values");
    kpl_dataset_close(ds);
}

/* ---- (9b) boxes and masks through every geometric transform ------------------------- */

/* Two stored images of their own sizes (raw, with an image_shape feature):
 * a bright rectangle on a dark texture (values < 40), its box, and a mask
 * that holds 250 inside the rectangle and a code of the position outside,
 * so that a mask pixel read from the wrong place shows. */
typedef struct {
    int w, h;
    float rect[4]; /* x0, y0, x1, y1 */
} geo_image;
static const geo_image geos[2] = {{120, 90, {30, 20, 78, 62}}, {70, 110, {10, 40, 50, 95}}};

static uint8_t geo_mask(const geo_image *g, int x, int y)
{
    bool in = x >= g->rect[0] && x < g->rect[2] && y >= g->rect[1] && y < g->rect[3];
    return (uint8_t)(in ? 250 : (x + 3 * y) % 200);
}

static kpl_dataset *geometry_set(void)
{
    const char *dir = tmp_path("geometry");
    kpl_dataset *ds = NULL;
    if (access(dir, F_OK) == 0) { /* made by an earlier test */
        OK(kpl_dataset_open(dir, &ds));
        return ds;
    }
    kpl_feature_spec sc[5];
    det_schema(sc);
    kpl_record_writer_config wc = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 5, sc, &wc, &w));
    for (int e = 0; e < 2; e++) {
        const geo_image *g = &geos[e];
        uint8_t *img = malloc((size_t)g->w * g->h * 3), *mask = malloc((size_t)g->w * g->h);
        for (int y = 0; y < g->h; y++)
            for (int x = 0; x < g->w; x++) {
                bool in = x >= g->rect[0] && x < g->rect[2] && y >= g->rect[1] && y < g->rect[3];
                for (int c = 0; c < 3; c++)
                    img[((size_t)y * g->w + x) * 3 + c] = (uint8_t)(in ? 255 : (x * 7 + y * 3 + c) % 40);
                mask[(size_t)y * g->w + x] = geo_mask(g, x, y);
            }
        int64_t shape[3] = {g->h, g->w, 3}, cls = 7 + e;
        kpl_feature_value v[5] = {{img, (uint32_t)(g->w * g->h * 3)}, {shape, 3},
                                  {g->rect, 4}, {&cls, 1}, {mask, (uint32_t)(g->w * g->h)}};
        OK(kpl_record_writer_add(w, v));
        free(img);
        free(mask);
    }
    OK(kpl_record_writer_close(w));
    OK(kpl_dataset_open(dir, &ds));
    return ds;
}

/* Example e through cfg (u8 output) against the geometry the test worked
 * out by hand: the crop box (bx, by, bw, bh) in stored pixels, resized to
 * ow x oh, mirrored when flip.  Checks
 *  - the sample's size (oh, ow) and stored size;
 *  - the box: the rectangle through the same mapping, clipped, mirrored
 *    (to 1e-3 px), with its label; or no box when the crop misses it;
 *  - the bright region: the bounding box of the output pixels >= 128 is the
 *    box to within one pixel on each side (the resampling blurs an edge
 *    over a pixel, its half level stays on the edge);
 *  - the mask, exactly: output (i, j) is the stored mask pixel under its
 *    center, (floor(by + (j + 0.5) bh / oh), floor(bx + (i' + 0.5) bw / ow))
 *    with i' = ow - 1 - i when flipped, clamped to the image.
 * Returns whether the box survived. */
static bool check_geometry(kpl_dataset *ds, const kpl_transform_config *cfg, int64_t e,
                           uint64_t seed, int64_t epoch, double bx, double by, double bw, double bh,
                           int ow, int oh, bool flip, const char *what)
{
    const geo_image *g = &geos[e];
    size_t cap = (size_t)kpl_transform_canvas_side(cfg);
    if (!cap) cap = (size_t)(ow > oh ? ow : oh);
    uint8_t *img = malloc(3 * cap * cap), *mask = malloc(cap * cap);
    float box[4 * 2];
    int64_t lab[2], nbox = -1, size[2] = {0, 0}, orig[2] = {0, 0};
    kpl__sample_out o = {.boxes = box, .box_labels = lab, .num_boxes = &nbox, .mask = mask,
                         .size = size, .orig_size = orig};
    OK(sample(ds, cfg, e, seed, epoch, img, &o));
    if (size[0] != oh || size[1] != ow)
        fail_msg("%s: size %lldx%lld, want %dx%d", what, (long long)size[0], (long long)size[1],
                 oh, ow);
    assert_int_equal(orig[0], g->h);
    assert_int_equal(orig[1], g->w);

    double want[4] = {(g->rect[0] - bx) * ow / bw, (g->rect[1] - by) * oh / bh,
                      (g->rect[2] - bx) * ow / bw, (g->rect[3] - by) * oh / bh};
    for (int k = 0; k < 4; k++) want[k] = fmin(fmax(want[k], 0), k % 2 ? oh : ow);
    if (flip) {
        double t = ow - want[2];
        want[2] = ow - want[0];
        want[0] = t;
    }
    bool survives = want[2] > want[0] && want[3] > want[1];
    assert_int_equal(nbox, survives ? 1 : 0);
    if (survives) {
        for (int k = 0; k < 4; k++)
            if (fabs(box[k] - want[k]) > 1e-3)
                fail_msg("%s: box[%d] %.4f, want %.4f", what, k, box[k], want[k]);
        assert_int_equal(lab[0], 7 + e);
    }
    assert_int_equal(lab[1], -1);

    int x0 = ow, y0 = oh, x1 = 0, y1 = 0; /* the bright pixels' bounding box */
    for (int y = 0; y < oh; y++)
        for (int x = 0; x < ow; x++)
            if (img[(size_t)y * ow + x] >= 128) {
                if (x < x0) x0 = x;
                if (y < y0) y0 = y;
                if (x + 1 > x1) x1 = x + 1;
                if (y + 1 > y1) y1 = y + 1;
            }
    if (x1 > x0) {
        assert_true(survives);
        double got[4] = {x0, y0, x1, y1};
        for (int k = 0; k < 4; k++)
            if (fabs(got[k] - want[k]) > 1.0)
                fail_msg("%s: bright region [%d, %d) x [%d, %d), box %.2f %.2f %.2f %.2f", what,
                         x0, x1, y0, y1, want[0], want[1], want[2], want[3]);
    } else if (survives) { /* only a sliver of the rectangle is left: no pixel half bright */
        assert_true(want[2] - want[0] < 1.5 || want[3] - want[1] < 1.5);
    }

    for (int j = 0; j < oh; j++)
        for (int i = 0; i < ow; i++) {
            int si = flip ? ow - 1 - i : i;
            int sx = (int)floor(bx + (si + 0.5) * bw / ow), sy = (int)floor(by + (j + 0.5) * bh / oh);
            sx = sx < 0 ? 0 : sx >= g->w ? g->w - 1 : sx;
            sy = sy < 0 ? 0 : sy >= g->h ? g->h - 1 : sy;
            if (mask[(size_t)j * ow + i] != geo_mask(g, sx, sy))
                fail_msg("%s: mask (%d, %d) is %d, want stored (%d, %d) = %d", what, i, j,
                         mask[(size_t)j * ow + i], sx, sy, geo_mask(g, sx, sy));
        }
    free(img);
    free(mask);
    return survives;
}

static void test_geometry_every_transform(void **state)
{
    (void)state;
    kpl_dataset *ds = geometry_set();
    kpl_transform_config base = KPL_TRANSFORM_CONFIG_INIT;
    base.label_feature = NULL;
    base.boxes_feature = "boxes";
    base.box_labels_feature = "classes";
    base.mask_feature = "mask";
    base.max_boxes = 2;
    base.out_dtype = KPL_U8;
    for (int flip = 0; flip < 2; flip++) {
        base.flip_prob = (float)flip;
        char what[96];
        for (int e = 0; e < 2; e++) {
            const double W = geos[e].w, H = geos[e].h;
            /* none: the whole image to 45 x 60 */
            kpl_transform_config c = base;
            c.out_h = 45, c.out_w = 60;
            snprintf(what, sizeof what, "none, example %d, flip %d", e, flip);
            assert_true(check_geometry(ds, &c, e, 1, 0, 0, 0, W, H, 60, 45, flip, what));

            /* center: shorter side to 60 (120x90 -> 80x60, 70x110 -> 60x94
             * truncated), then the centered 60x60: offsets round(20 / 2) =
             * 10 across, round(34 / 2) = 17 down; in stored pixels times
             * 120/80 and 90/60, or 70/60 and 110/94 */
            c = base;
            c.crop = KPL_CROP_CENTER;
            c.resize_shorter = 60;
            c.out_h = c.out_w = 60;
            double fx = e == 0 ? 120.0 / 80 : 70.0 / 60, fy = e == 0 ? 90.0 / 60 : 110.0 / 94;
            double cx = e == 0 ? 10 * fx : 0, cy = e == 0 ? 0 : 17 * fy;
            snprintf(what, sizeof what, "center, example %d, flip %d", e, flip);
            assert_true(check_geometry(ds, &c, e, 1, 0, cx, cy, 60 * fx, 60 * fy, 60, 60, flip,
                                       what));

            /* keep_ratio: 120x90 with short side 72 -> scale 0.8, 96x72;
             * 70x110 -> scale 72/70, 72 x round(113.14) = 113; capped by
             * max_side 84: scale 0.7, 84x63 and 84/110: 53x84; and up,
             * short side 135: 180x135 and 135x212 */
            c = base;
            c.crop = KPL_CROP_KEEP_RATIO;
            c.num_short_sides = 1;
            const int kr[3][2] = {{72, 1000}, {72, 84}, {135, 1000}};
            const int want[2][3][2] = {{{96, 72}, {84, 63}, {180, 135}},
                                       {{72, 113}, {53, 84}, {135, 212}}};
            for (int k = 0; k < 3; k++) {
                c.short_sides[0] = kr[k][0];
                c.max_side = kr[k][1];
                snprintf(what, sizeof what, "keep_ratio %d/%d, example %d, flip %d", kr[k][0],
                         kr[k][1], e, flip);
                assert_true(check_geometry(ds, &c, e, 1, 0, 0, 0, W, H, want[e][k][0],
                                           want[e][k][1], flip, what));
            }

            /* random_resized to 48x48: the crops of 60 epochs, drawn from the
             * same key as the transform does (4 uniforms first); small ones
             * (2-20% of the area) miss the rectangle now and then */
            c = base;
            c.crop = KPL_CROP_RANDOM_RESIZED;
            c.out_h = c.out_w = 48;
            c.scale[0] = 0.02f;
            c.scale[1] = 0.2f;
            int kept = 0, dropped = 0;
            for (int epoch = 0; epoch < 60; epoch++) {
                kpl__rng r = kpl__rng_key(3, (uint64_t)epoch, (uint64_t)e);
                for (int k = 0; k < 4; k++) kpl__rng_uniform(&r);
                int x, y, cw, ch;
                kpl__rrc_params(&r, (int)W, (int)H, c.scale, c.ratio, &x, &y, &cw, &ch);
                snprintf(what, sizeof what, "random_resized epoch %d, example %d, flip %d",
                         epoch, e, flip);
                if (check_geometry(ds, &c, e, 3, epoch, x, y, cw, ch, 48, 48, flip, what))
                    kept++;
                else
                    dropped++;
            }
            assert_true(kept >= 10 && dropped >= 3); /* both cases, each checked */
            print_message("random_resized, example %d: %d crops keep the box, %d miss it\n", e,
                          kept, dropped);
        }
    }
    kpl_dataset_close(ds);
}

/* keep_ratio's size: hand arithmetic of scale = min(s / short, max / long),
 * sides floor(x * scale + 0.5). */
static void test_keep_ratio_size(void **state)
{
    (void)state;
    const struct {
        int w, h, s, max, ow, oh;
    } cases[] = {
        {640, 480, 800, 1333, 1067, 800}, /* landscape: 800/480, 640 * 5/3 = 1066.7 */
        {480, 640, 800, 1333, 800, 1067}, /* portrait */
        {1000, 200, 800, 1333, 1333, 267}, /* capped: 1333/1000, 200 * 1.333 = 266.6 */
        {200, 1000, 800, 1333, 267, 1333},
        {500, 375, 600, 1000, 800, 600},   /* exactly 1.6 */
        {427, 640, 800, 1333, 800, 1199},  /* COCO's 427x640: 640 * 800/427 = 1199.06 */
        {300, 300, 100, 1333, 100, 100},   /* shrinking */
        {16384, 1, 8, 100, 100, 1},        /* the short side rounds to 0: at least 1 */
        {640, 480, 0, 1333, 640, 480},     /* short side 0: the stored size */
        {2000, 1000, 0, 1333, 1333, 667},  /* ... unless the long side passes max_side */
        {500, 2048, 0, 1024, 250, 1024},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int ow = 0, oh = 0;
        kpl__keep_ratio_size(cases[i].w, cases[i].h, cases[i].s, cases[i].max, &ow, &oh);
        if (ow != cases[i].ow || oh != cases[i].oh)
            fail_msg("%dx%d, short %d, max %d: %dx%d, want %dx%d", cases[i].w, cases[i].h,
                     cases[i].s, cases[i].max, ow, oh, cases[i].ow, cases[i].oh);
    }
    /* The canvas: max_side rounded up to size_divisor (0 and 1: as is). */
    kpl_transform_config c = KPL_TRANSFORM_CONFIG_INIT;
    assert_int_equal(kpl_transform_canvas_side(&c), 0); /* not keep_ratio */
    c.crop = KPL_CROP_KEEP_RATIO;
    c.max_side = 1333;
    assert_int_equal(kpl_transform_canvas_side(&c), 1344);
    c.size_divisor = 0;
    assert_int_equal(kpl_transform_canvas_side(&c), 1333);
    c.size_divisor = 1;
    assert_int_equal(kpl_transform_canvas_side(&c), 1333);
    c.size_divisor = 64;
    c.max_side = 128;
    assert_int_equal(kpl_transform_canvas_side(&c), 128);

    /* The short side drawn from the list with the sample's own key: after
     * the 4 uniforms of flip and jitter, one integer below the count.  The
     * 120x90 image with short sides 40, 60, 80: 53x40, 80x60, 107x80. */
    kpl_dataset *ds = geometry_set();
    kpl_transform_config k = KPL_TRANSFORM_CONFIG_INIT;
    k.label_feature = NULL;
    k.crop = KPL_CROP_KEEP_RATIO;
    k.short_sides[0] = 40, k.short_sides[1] = 60, k.short_sides[2] = 80;
    k.num_short_sides = 3;
    k.max_side = 1000;
    k.flip_prob = 0.5f;
    k.out_dtype = KPL_U8;
    kpl__xform x;
    OK(kpl__xform_init(&x, &k, ds));
    assert_int_equal(x.out_h, 1024); /* the canvas */
    assert_int_equal(x.out_w, 1024);
    assert_int_equal(kpl__xform_image_bytes(&x), 3 * 1024 * 1024);
    const int64_t sizes[3][2] = {{40, 53}, {60, 80}, {80, 107}};
    uint8_t *img = malloc(3 * 107 * 80), *again = malloc(3 * 107 * 80);
    int seen[3] = {0, 0, 0};
    for (int epoch = 0; epoch < 90; epoch++) {
        kpl__rng r = kpl__rng_key(11, (uint64_t)epoch, 0);
        for (int j = 0; j < 4; j++) kpl__rng_uniform(&r);
        int want = (int)kpl__rng_below(&r, 3);
        seen[want]++;
        int64_t size[2] = {0, 0};
        kpl__sample_out o = {.size = size};
        OK(sample(ds, &k, 0, 11, epoch, img, &o));
        assert_int_equal(size[0], sizes[want][0]);
        assert_int_equal(size[1], sizes[want][1]);
        OK(sample(ds, &k, 0, 11, epoch, again, &o)); /* the same key: the same bytes */
        assert_memory_equal(img, again, (size_t)(3 * size[0] * size[1]));
    }
    for (int j = 0; j < 3; j++) assert_true(seen[j] >= 18); /* 30 expected of each */
    /* One value (evaluation): always it, and no draw is made for it. */
    k.num_short_sides = 1;
    k.short_sides[0] = 60;
    for (int epoch = 0; epoch < 5; epoch++) {
        int64_t size[2] = {0, 0};
        kpl__sample_out o = {.size = size};
        OK(sample(ds, &k, 0, 11, epoch, img, &o));
        assert_true(size[0] == 60 && size[1] == 80);
    }
    free(img);
    free(again);
    kpl_dataset_close(ds);
}

/* ---- (10) Fashion-MNIST-like raw images --------------------------------------------- */

static void test_raw_fmnist(void **state)
{
    (void)state;
    uint8_t im[3][784];
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 784; i++) im[k][i] = (uint8_t)((i * (k + 3) + k * 50) % 256);
    const int64_t shape[3] = {28, 28, 1};
    const void *b[3] = {im[0], im[1], im[2]};
    size_t n[3] = {784, 784, 784};
    kpl_dataset *ds = image_set(3, b, n, "raw", 3, shape);
    kpl_transform_config cfg = KPL_TRANSFORM_CONFIG_INIT;
    cfg.channels = 1;
    float out[784];
    for (int k = 0; k < 3; k++) {
        int64_t label = -1;
        kpl__sample_out ex = {.label = &label};
        OK(sample(ds, &cfg, k, 0, 0, out, &ex));
        assert_int_equal(label, 100 + k);
        for (int i = 0; i < 784; i++)
            if (out[i] != (float)im[k][i] / 255.0f)
                fail_msg("image %d pixel %d: %.9g, want %.9g", k, i, out[i], im[k][i] / 255.0f);
    }
    /* To 3 channels: the gray value replicated. */
    cfg.channels = 3;
    float out3[3 * 784];
    OK(sample(ds, &cfg, 1, 0, 0, out3, NULL));
    for (int c = 0; c < 3; c++)
        for (int i = 0; i < 784; i++) assert_true(out3[c * 784 + i] == im[1][i] / 255.0f);
    /* Wrong length for the shape: readers and the writer refuse such a
     * record (the shape is binding), and the transform does too when
     * handed one directly. */
    cfg.channels = 1;
    kpl__xform x;
    OK(kpl__xform_init(&x, &cfg, ds));
    kpl__xform_scratch *s = NN(kpl__xform_scratch_create());
    int64_t label = 7;
    kpl_feature_value v[2] = {{im[0], 700}, {&label, 1}};
    kpl__sample_out o = {.image = out};
    FAILS(kpl__xform_sample(&x, v, 0, 0, 0, s, &o), KPL_EFORMAT,
          "example 0, feature 'image': raw image of 700 bytes");
    kpl__xform_scratch_destroy(s);
    kpl_dataset_close(ds);
}

/* ---- config validation ----------------------------------------------------------------- */

static void test_init_validation(void **state)
{
    (void)state;
    uint8_t px[12] = {0};
    const int64_t shape[3] = {2, 2, 3};
    const void *b[1] = {px};
    size_t n[1] = {12};
    kpl_dataset *ds = image_set(1, b, n, "raw", 3, shape);
    kpl__xform x;
    kpl_transform_config c = KPL_TRANSFORM_CONFIG_INIT;
    OK(kpl__xform_init(&x, &c, ds));
    assert_int_equal(x.out_h, 2);
    assert_int_equal(kpl__xform_image_bytes(&x), 4 * 3 * 2 * 2);
    assert_int_equal(kpl__xform_mask_bytes(&x), 0);
    c.image_feature = "img";
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "image_feature 'img' is not a feature");
    c = (kpl_transform_config)KPL_TRANSFORM_CONFIG_INIT;
    c.label_feature = "image";
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "label_feature 'image' is bytes, not int64");
    c = (kpl_transform_config)KPL_TRANSFORM_CONFIG_INIT;
    c.channels = 2;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "channels");
    c = (kpl_transform_config)KPL_TRANSFORM_CONFIG_INIT;
    c.crop = KPL_CROP_RANDOM_RESIZED;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "out_h");
    c.out_h = c.out_w = 8;
    c.scale[0] = 0.9f, c.scale[1] = 0.5f;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "scale");
    c = (kpl_transform_config)KPL_TRANSFORM_CONFIG_INIT;
    c.crop = KPL_CROP_CENTER;
    c.out_h = c.out_w = 8;
    c.resize_shorter = 7;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "resize_shorter");
    c = (kpl_transform_config)KPL_TRANSFORM_CONFIG_INIT;
    c.flip_prob = 1.5f;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "flip_prob");
    c = (kpl_transform_config)KPL_TRANSFORM_CONFIG_INIT;
    c.std[1] = 0;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "std");
    c = (kpl_transform_config)KPL_TRANSFORM_CONFIG_INIT;
    c.boxes_feature = "label";
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "boxes_feature 'label' is int64, not float");
    c = (kpl_transform_config)KPL_TRANSFORM_CONFIG_INIT;
    c.out_dtype = KPL_I64;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "out_dtype");
    kpl_dataset_close(ds);
    /* A JPEG set has no fixed stored size. */
    ds = image_set(1, b, n, "jpeg", 0, NULL);
    c = (kpl_transform_config)KPL_TRANSFORM_CONFIG_INIT;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "must be raw with a fixed shape");
    kpl_dataset_close(ds);
}

/* keep_ratio's settings: each bad one refused by name. */
static void test_keep_ratio_validation(void **state)
{
    (void)state;
    kpl_dataset *ds = geometry_set();
    assert_int_equal(kpl_crop_mode_parse("keep_ratio"), KPL_CROP_KEEP_RATIO);
    assert_string_equal(kpl_crop_mode_name(KPL_CROP_KEEP_RATIO), "keep_ratio");
    kpl__xform x;
    kpl_transform_config ok = KPL_TRANSFORM_CONFIG_INIT;
    ok.crop = KPL_CROP_KEEP_RATIO;
    ok.label_feature = NULL;
    ok.short_sides[0] = 800;
    ok.num_short_sides = 1;
    ok.max_side = 1333;
    OK(kpl__xform_init(&x, &ok, ds));
    assert_int_equal(x.out_h, 1344);
    kpl_transform_config c = ok;
    c.num_short_sides = 0;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "keep_ratio needs 1 to 8 short_sides, got 0");
    c = ok;
    c.num_short_sides = 9;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "keep_ratio needs 1 to 8 short_sides, got 9");
    c = ok;
    c.num_short_sides = 2;
    c.short_sides[1] = -1;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL,
          "short_sides[1] -1 is not in [0, 16384] (0: the stored size)");
    c = ok;
    c.max_side = 0;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "keep_ratio needs max_side in [1, 16384], got 0");
    c = ok;
    c.out_h = c.out_w = 224;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "out_h x out_w (224 x 224) must be 0");
    c = ok;
    c.size_divisor = -1;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "size_divisor -1 is not in [0, 1024]");
    c = ok;
    c.mask_pad = 256;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "mask_pad 256 is not in [0, 255]");
    kpl_dataset_close(ds);
}

/* A deterministic fuzz of the image wrappers: thousands of damaged JPEGs
 * (baseline and progressive) and PNGs — bytes overwritten, streams cut —
 * through the whole sample path.  Each must decode or fail with
 * KPL_EFORMAT; never crash, hang or touch memory it should not (the
 * sanitizer build runs this too). */
static void test_fuzz_damaged_images(void **state)
{
    (void)state;
    const int W = 61, H = 45;
    uint8_t *pix = pattern(W, H, 3, 9);
    unsigned long l1, l2;
    unsigned char *j1 = tj_encode(pix, W, H, TJPF_RGB, TJSAMP_420, 0, &l1);
    unsigned char *j2 = tj_encode(pix, W, H, TJPF_RGB, TJSAMP_444, TJFLAG_PROGRESSIVE, &l2);
    size_t l3;
    unsigned char *p3 = png_encode(pix, W, H, PNG_FORMAT_RGB, NULL, 0, &l3);
    const void *src[3] = {j1, j2, p3};
    size_t len[3] = {l1, l2, l3};
    kpl_dataset *ds = image_set(3, src, len, "", 0, NULL);
    kpl_transform_config cfg = KPL_TRANSFORM_CONFIG_INIT;
    cfg.crop = KPL_CROP_RANDOM_RESIZED;
    cfg.out_h = cfg.out_w = 24;
    cfg.flip_prob = 0.5f;
    kpl__xform x;
    OK(kpl__xform_init(&x, &cfg, ds));
    kpl__xform_scratch *s = NN(kpl__xform_scratch_create());
    float *img = malloc(3 * 24 * 24 * sizeof *img);
    int64_t label;
    kpl__sample_out o = {.image = img, .label = &label};
    uint8_t *buf = malloc(l1 + l2 + l3);
    kpl__rng r = {12345};
    int ok = 0, bad = 0;
    for (int it = 0; it < 3000; it++) {
        int k = it % 3;
        size_t n = len[k];
        memcpy(buf, src[k], n);
        int edits = 1 + (int)kpl__rng_below(&r, 8);
        for (int e = 0; e < edits; e++)
            buf[kpl__rng_below(&r, n)] = (uint8_t)kpl__rng_next(&r);
        if (kpl__rng_below(&r, 4) == 0) n = 1 + kpl__rng_below(&r, n);
        kpl_feature_value v[2] = {{buf, (uint32_t)n}, {&label, 1}};
        label = 7;
        kpl_status st = kpl__xform_sample(&x, v, 1, 0, it, s, &o);
        if (st != KPL_OK && st != KPL_EFORMAT)
            fail_msg("iteration %d: %s: %s", it, kpl_status_str(st), kpl_last_error());
        if (st == KPL_EFORMAT && !strstr(kpl_last_error(), "example"))
            fail_msg("iteration %d: message without the example: %s", it, kpl_last_error());
        ok += st == KPL_OK;
        bad += st == KPL_EFORMAT;
    }
    /* Both outcomes are exercised. */
    assert_true(ok > 100);
    assert_true(bad > 100);
    free(buf);
    free(img);
    free(pix);
    tjFree(j1);
    tjFree(j2);
    free(p3);
    kpl__xform_scratch_destroy(s);
    kpl_dataset_close(ds);
}


/* ---- (12) scale_crop: segmentation's random scale, crop and pad --------------------- */

enum { SC_W = 64, SC_H = 48 };

/* A raw 64x48 image whose R and G say where a pixel is stored (R = 4x,
 * G = 5y, B = 3x + 2y) and a mask (x * 7 + y * 3) % 200 ("pos"); then the
 * same size of 8x8 blocks of class (bx + 2 by) % 5, the image 40 class + 20
 * in every channel, the mask the class ("blocks"); then class 1 in the top
 * left 16x16, 0 elsewhere, the image 100 ("corner"). */
static kpl_dataset *scale_crop_set(void)
{
    const char *dir = tmp_path("scale_crop");
    kpl_dataset *ds = NULL;
    if (access(dir, F_OK) == 0) {
        OK(kpl_dataset_open(dir, &ds));
        return ds;
    }
    kpl_feature_spec sc[2] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {SC_H, SC_W, 3}},
        {.name = "mask", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 2,
         .shape = {SC_H, SC_W}},
    };
    kpl_record_writer_config wc = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 2, sc, &wc, &w));
    static uint8_t img[SC_H * SC_W * 3], mask[SC_H * SC_W];
    for (int kind = 0; kind < 3; kind++) {
        for (int y = 0; y < SC_H; y++)
            for (int x = 0; x < SC_W; x++) {
                uint8_t *px = img + 3 * (y * SC_W + x), *m = mask + y * SC_W + x;
                if (kind == 0) {
                    px[0] = (uint8_t)(4 * x), px[1] = (uint8_t)(5 * y);
                    px[2] = (uint8_t)(3 * x + 2 * y);
                    *m = (uint8_t)((x * 7 + y * 3) % 200);
                } else if (kind == 1) {
                    *m = (uint8_t)((x / 8 + 2 * (y / 8)) % 5);
                    px[0] = px[1] = px[2] = (uint8_t)(40 * *m + 20);
                } else {
                    *m = x < 16 && y < 16;
                    px[0] = px[1] = px[2] = 100;
                }
            }
        kpl_feature_value v[2] = {{img, sizeof img}, {mask, sizeof mask}};
        OK(kpl_record_writer_add(w, v));
    }
    OK(kpl_record_writer_close(w));
    OK(kpl_dataset_open(dir, &ds));
    return ds;
}

static uint8_t sc_pos_mask(int x, int y) { return (uint8_t)((x * 7 + y * 3) % 200); }

static kpl_transform_config scale_crop_config(int out_h, int out_w, float lo, float hi)
{
    kpl_transform_config c = KPL_TRANSFORM_CONFIG_INIT;
    c.label_feature = NULL;
    c.mask_feature = "mask";
    c.crop = KPL_CROP_SCALE_CROP;
    c.out_h = out_h, c.out_w = out_w;
    c.scale_range[0] = lo, c.scale_range[1] = hi;
    c.mask_pad = 255;
    c.out_dtype = KPL_U8;
    return c;
}

static void test_scale_crop(void **state)
{
    (void)state;
    kpl_dataset *ds = scale_crop_set();
    assert_int_equal(kpl_crop_mode_parse("scale_crop"), KPL_CROP_SCALE_CROP);
    static uint8_t img[3 * 96 * 96], mask[96 * 96];
    static float imf[3 * 96 * 96];
    int64_t size[2];

    /* Factor 1: the crop is the stored pixels themselves, found by R and G;
     * the mask follows pixel for pixel, mirrored with the image. */
    kpl_transform_config c = scale_crop_config(32, 40, 1, 1);
    c.flip_prob = 0.5f;
    int flips = 0, places = 0, last_cx = -1;
    for (int epoch = 0; epoch < 12; epoch++) {
        kpl__sample_out o = {.mask = mask, .size = size};
        OK(sample(ds, &c, 0, 3, epoch, img, &o));
        assert_int_equal(size[0], 32);
        assert_int_equal(size[1], 40);
        bool flip = img[0] > img[39];
        int cx = (flip ? img[39] : img[0]) / 4, cy = img[32 * 40] / 5;
        assert_true(cx <= SC_W - 40 && cy <= SC_H - 32);
        flips += flip;
        places += cx != last_cx;
        last_cx = cx;
        for (int j = 0; j < 32; j++)
            for (int i = 0; i < 40; i++) {
                int sx = cx + (flip ? 39 - i : i), sy = cy + j;
                assert_int_equal(img[j * 40 + i], 4 * sx);
                assert_int_equal(img[32 * 40 + j * 40 + i], 5 * sy);
                assert_int_equal(img[2 * 32 * 40 + j * 40 + i], (uint8_t)(3 * sx + 2 * sy));
                assert_int_equal(mask[j * 40 + i], sc_pos_mask(sx, sy));
            }
    }
    assert_true(flips > 0 && flips < 12);
    assert_true(places > 3);

    /* A crop larger than the image: the image at the top left, padded
     * bottom and right with the mean (u8: round(mean * 255); f32: 0), the
     * mask with mask_pad. */
    c = scale_crop_config(56, 80, 1, 1);
    c.mean[0] = 0.2f, c.mean[1] = 0.4f, c.mean[2] = 0.6f;
    c.std[0] = c.std[1] = c.std[2] = 0.5f;
    kpl__sample_out o = {.mask = mask, .size = size};
    OK(sample(ds, &c, 0, 3, 0, img, &o));
    assert_int_equal(size[0], SC_H);
    assert_int_equal(size[1], SC_W);
    const uint8_t upad[3] = {51, 102, 153};
    for (int j = 0; j < 56; j++)
        for (int i = 0; i < 80; i++) {
            bool in = j < SC_H && i < SC_W;
            for (int k = 0; k < 3; k++) {
                int want = !in ? upad[k] : k == 0 ? 4 * i : k == 1 ? 5 * j : (uint8_t)(3 * i + 2 * j);
                assert_int_equal(img[(k * 56 + j) * 80 + i], want);
            }
            assert_int_equal(mask[j * 80 + i], in ? sc_pos_mask(i, j) : 255);
        }
    c.out_dtype = KPL_F32;
    c.mask_pad = 7;
    OK(sample(ds, &c, 0, 3, 0, imf, &o));
    for (int j = 0; j < 56; j++)
        for (int i = 0; i < 80; i++) {
            bool in = j < SC_H && i < SC_W;
            float want = in ? (4 * i / 255.0f - 0.2f) / 0.5f : 0.0f;
            assert_true(imf[j * 80 + i] == want);
            if (!in) assert_true(imf[(2 * 56 + j) * 80 + i] == 0.0f);
            assert_int_equal(mask[j * 80 + i], in ? sc_pos_mask(i, j) : 7);
        }

    /* resize_shorter 24 halves the 64x48 image (32x24), then a 16x16 crop:
     * the mask is nearest-neighbour, output (i, j) reading stored
     * (2 (cx + i) + 1, 2 (cy + j) + 1); R there is about 4 (2 cx + 0.5). */
    c = scale_crop_config(16, 16, 1, 1);
    c.resize_shorter = 24;
    for (int epoch = 0; epoch < 6; epoch++) {
        OK(sample(ds, &c, 0, 5, epoch, img, &o));
        assert_int_equal(size[0], 16);
        assert_int_equal(size[1], 16);
        int cx = (int)lrint((img[0] / 4.0 - 0.5) / 2), cy = (int)lrint((img[256] / 5.0 - 0.5) / 2);
        assert_true(cx >= 0 && cx <= 16 && cy >= 0 && cy <= 8);
        for (int j = 0; j < 16; j++)
            for (int i = 0; i < 16; i++)
                assert_int_equal(mask[j * 16 + i], sc_pos_mask(2 * (cx + i) + 1, 2 * (cy + j) + 1));
    }

    /* Random factors 0.5 .. 2 on the blocks: the mask takes only stored
     * classes (0..4) and 255 in the padding; where a pixel's 3x3
     * neighbourhood is one class, the image there is that class's level
     * (the mask stays on the image); the padding is the mean (0 here). */
    c = scale_crop_config(48, 48, 0.5f, 2.0f);
    c.flip_prob = 0.5f;
    int padded = 0, full = 0;
    for (int epoch = 0; epoch < 24; epoch++) {
        OK(sample(ds, &c, 1, 11, epoch, img, &o));
        const int vh = (int)size[0], vw = (int)size[1];
        assert_true(vh >= 1 && vh <= 48 && vw >= 1 && vw <= 48);
        if (vh < 48 || vw < 48) padded++;
        else full++;
        for (int j = 0; j < 48; j++)
            for (int i = 0; i < 48; i++) {
                int m = mask[j * 48 + i];
                if (j >= vh || i >= vw) {
                    assert_int_equal(m, 255);
                    for (int k = 0; k < 3; k++) assert_int_equal(img[(k * 48 + j) * 48 + i], 0);
                    continue;
                }
                assert_true(m <= 4);
                bool uniform = j > 0 && i > 0 && j + 1 < vh && i + 1 < vw;
                for (int dj = -1; dj <= 1 && uniform; dj++)
                    for (int di = -1; di <= 1 && uniform; di++)
                        uniform = mask[(j + dj) * 48 + i + di] == m;
                if (uniform)
                    for (int k = 0; k < 3; k++)
                        if (abs(img[(k * 48 + j) * 48 + i] - (40 * m + 20)) > 2)
                            fail_msg("epoch %d: pixel (%d, %d) of class %d is %d, want %d", epoch,
                                     i, j, m, img[(k * 48 + j) * 48 + i], 40 * m + 20);
            }
    }
    assert_true(padded > 0 && full > 0);

    /* cat_max_ratio: crops of the corner set that hold both classes with
     * neither 90% or more are rare by chance and common with retries. */
    int pass[2] = {0, 0};
    for (int r = 0; r < 2; r++) {
        c = scale_crop_config(16, 16, 1, 1);
        c.cat_max_ratio = r ? 0.9f : 0.0f;
        for (int epoch = 0; epoch < 100; epoch++) {
            OK(sample(ds, &c, 2, 1, epoch, img, &o));
            int ones = 0;
            for (int k = 0; k < 256; k++) ones += mask[k];
            pass[r] += ones > 0 && ones < 256 && ones < 0.9 * 256 && 256 - ones < 0.9 * 256;
        }
    }
    if (!(pass[0] < 25 && pass[1] > 40))
        fail_msg("crops passing cat_max_ratio 0.9: %d of 100 without it, %d with", pass[0],
                 pass[1]);

    /* Validation. */
    kpl__xform x;
    c = scale_crop_config(0, 0, 0.5f, 2);
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "scale_crop needs out_h and out_w");
    c = scale_crop_config(16, 16, 2, 1);
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "scale_range [2, 1] must satisfy 0 < lo <= hi");
    c = scale_crop_config(16, 16, 0, 1);
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "scale_range [0, 1]");
    c = scale_crop_config(16, 16, 1, 1);
    c.mask_pad = 300;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "mask_pad 300 is not in [0, 255]");
    c = scale_crop_config(16, 16, 1, 1);
    c.mask_feature = NULL;
    c.cat_max_ratio = 0.75f;
    FAILS(kpl__xform_init(&x, &c, ds), KPL_EINVAL, "cat_max_ratio 0.75 needs mask_feature");
    c.cat_max_ratio = 1;
    OK(kpl__xform_init(&x, &c, ds));
    kpl_dataset_close(ds);
}

/* keep_ratio with short side 0: the stored size (whole-image evaluation at
 * full resolution), the pixels and mask exactly as stored. */
static void test_keep_ratio_full_size(void **state)
{
    (void)state;
    kpl_dataset *ds = scale_crop_set();
    kpl_transform_config c = KPL_TRANSFORM_CONFIG_INIT;
    c.label_feature = NULL;
    c.mask_feature = "mask";
    c.crop = KPL_CROP_KEEP_RATIO;
    c.num_short_sides = 1; /* short_sides[0] = 0 */
    c.max_side = 512;
    c.out_dtype = KPL_U8;
    c.mask_pad = 255;
    static uint8_t img[3 * 512 * 512], mask[512 * 512];
    int64_t size[2];
    kpl__sample_out o = {.mask = mask, .size = size};
    OK(sample(ds, &c, 0, 1, 0, img, &o));
    assert_int_equal(size[0], SC_H);
    assert_int_equal(size[1], SC_W);
    for (int j = 0; j < SC_H; j++)
        for (int i = 0; i < SC_W; i++) {
            assert_int_equal(img[j * SC_W + i], 4 * i);
            assert_int_equal(img[SC_H * SC_W + j * SC_W + i], 5 * j);
            assert_int_equal(mask[j * SC_W + i], sc_pos_mask(i, j));
        }
    c.max_side = 32; /* too large: the long side scaled to 32 (64x48 -> 32x24) */
    OK(sample(ds, &c, 0, 1, 0, img, &o));
    assert_int_equal(size[0], 24);
    assert_int_equal(size[1], 32);
    for (int j = 0; j < 24; j++)
        for (int i = 0; i < 32; i++)
            assert_int_equal(mask[j * 32 + i], sc_pos_mask(2 * i + 1, 2 * j + 1));
    kpl_dataset_close(ds);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_jpeg_full_decode),
        cmocka_unit_test(test_jpeg_region_and_scaled),
        cmocka_unit_test(test_jpeg_cmyk),
        cmocka_unit_test(test_jpeg_exif_orientation),
        cmocka_unit_test(test_corrupt),
        cmocka_unit_test(test_png),
        cmocka_unit_test(test_resize_reference),
        cmocka_unit_test(test_rrc_params),
        cmocka_unit_test(test_keying_and_flip),
        cmocka_unit_test(test_normalize_and_jitter),
        cmocka_unit_test(test_boxes_and_mask),
        cmocka_unit_test(test_geometry_every_transform),
        cmocka_unit_test(test_keep_ratio_size),
        cmocka_unit_test(test_raw_fmnist),
        cmocka_unit_test(test_init_validation),
        cmocka_unit_test(test_keep_ratio_validation),
        cmocka_unit_test(test_fuzz_damaged_images),
        cmocka_unit_test(test_scale_crop),
        cmocka_unit_test(test_keep_ratio_full_size),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
