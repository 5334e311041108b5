/*
 * convert_common.c — what the image converters share (convert_impl.h):
 * an image file read and checked whole with the loader's decoder (and a
 * large JPEG re-encoded), threads that each own a codec, bad items as
 * errors or warnings, and the small text files beside a dataset.
 *
 * The check is the loader's own decoder (image_decode.c): a JPEG's every
 * scan entropy decoded at 1/8 scale and read to its EOI, libjpeg's data
 * warnings counted as errors; a PNG decoded to its IEND with every CRC
 * checked; the loader's size limit.  So a truncated or corrupt file is
 * caught at conversion, naming it, and not in the middle of an epoch.  The
 * decoder resets itself before every image, so a bad file never affects
 * the next one on its thread.
 */
#include "convert_impl.h"

#include <errno.h>
#include <limits.h>
#include <omp.h>
#include <png.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <turbojpeg.h>
#include <unistd.h>

struct kpl__codec {
    tjhandle tjc;
    kpl__decoder *dec;
    kpl__xform_scratch *scratch;
    uint8_t *pix;
    size_t pix_cap;
};

void *kpl__codec_encoder(kpl__codec *c)
{
    return c->tjc;
}

/* Re-encodes the JPEG open in c->dec (w x h after its EXIF orientation),
 * whose longer side exceeds max_side, at that longer side.  Decodes with
 * DCT scaling where the result stays at least max_side, turned to its EXIF
 * orientation (the new file carries no EXIF: its pixels are upright),
 * resizes with the training-time filter, encodes 4:2:0 (gray stays gray).
 * On success replaces l's bytes. */
static void shrink_jpeg(int max_side, int quality, kpl__codec *c, const kpl__img_info *info,
                        kpl__loaded_image *l)
{
    int w = info->width, h = info->height;
    int side = w > h ? w : h, ow, oh;
    if (w >= h) {
        ow = max_side;
        oh = (int)((double)h * max_side / w + 0.5);
    } else {
        oh = max_side;
        ow = (int)((double)w * max_side / h + 0.5);
    }
    if (ow < 1) ow = 1;
    if (oh < 1) oh = 1;
    int denom = 8;
    while (denom > 1 && (side + denom - 1) / denom < max_side) denom /= 2;
    int sw, sh, ch = info->channels == 1 ? 1 : 3;
    kpl__img_scaled_size(info, denom, &sw, &sh);
    kpl__img_view v;
    size_t need = (size_t)ow * oh * 3;
    if (need > c->pix_cap) {
        uint8_t *q = realloc(c->pix, need);
        if (!q) {
            snprintf(l->why, sizeof l->why, "no memory to re-encode");
            l->fatal = true;
            return;
        }
        c->pix = q;
        c->pix_cap = need;
    }
    if (kpl__img_decode(c->dec, denom, 0, 0, sw, sh, ch, &v) < 0 ||
        kpl__resize(c->scratch, &v, 0, 0, sw, sh, ow, oh, c->pix) < 0) {
        snprintf(l->why, sizeof l->why, "%s", kpl_last_error());
        l->fatal = kpl_last_status() != KPL_EFORMAT;
        return;
    }
    unsigned char *jpg = NULL;
    unsigned long len = 0;
    if (tjCompress2(c->tjc, c->pix, ow, 0, oh, ch == 1 ? TJPF_GRAY : TJPF_RGB, &jpg, &len,
                    ch == 1 ? TJSAMP_GRAY : TJSAMP_420, quality, 0) != 0) {
        snprintf(l->why, sizeof l->why, "JPEG encode: %s", tjGetErrorStr2(c->tjc));
        tjFree(jpg);
        /* A fresh handle, so that nothing of this failure reaches the next image. */
        tjDestroy(c->tjc);
        c->tjc = tjInitCompress();
        if (!c->tjc) l->fatal = true;
        return;
    }
    uint8_t *b = malloc(len);
    if (!b) {
        tjFree(jpg);
        snprintf(l->why, sizeof l->why, "no memory to re-encode");
        l->fatal = true;
        return;
    }
    memcpy(b, jpg, len);
    tjFree(jpg);
    free(l->bytes);
    l->bytes = b;
    l->len = len;
    l->info.width = ow;
    l->info.height = oh;
    l->info.orientation = 1;
}

/* Reads a file for a converting thread (its codec c): false, with why[n]
 * and *fatal set (prefixed by `what`), when there is no codec or the file
 * cannot be read. */
static bool read_item(const char *path, const kpl__codec *c, const char *what, char *why,
                      size_t n, bool *fatal, char **buf, size_t *len)
{
    if (!c) {
        snprintf(why, n, "no memory for a decoder");
        *fatal = true;
        return false;
    }
    if (kpl__read_file(path, buf, len) < 0) {
        snprintf(why, n, "%scannot read (%s)", what, kpl_last_error());
        *fatal = kpl_last_status() == KPL_ENOMEM;
        return false;
    }
    return true;
}

void kpl__load_image(const char *path, int max_side, int quality, kpl__codec *c,
                     kpl__loaded_image *l)
{
    l->bytes = NULL;
    l->len = 0;
    l->why[0] = 0;
    l->fatal = false;
    memset(&l->info, 0, sizeof l->info);
    char *buf = NULL;
    size_t len = 0;
    if (!read_item(path, c, "", l->why, sizeof l->why, &l->fatal, &buf, &len)) return;
    const uint8_t *b = (const uint8_t *)buf;
    bool jpeg = len >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff;
    bool png = len >= 8 && !memcmp(b, "\x89PNG\r\n\x1a\n", 8);
    if (len > KPLR_MAX_BODY - 1024)
        snprintf(l->why, sizeof l->why, "larger than 2 GiB");
    else if (!jpeg && !png)
        snprintf(l->why, sizeof l->why, "neither a JPEG nor a PNG (%zu bytes)", len);
    else if (kpl__img_open(c->dec, b, len, jpeg ? "jpeg" : "png", NULL, "undecodable",
                           &l->info) < 0 ||
             kpl__img_check(c->dec) < 0) {
        snprintf(l->why, sizeof l->why, "%s", kpl_last_error());
        l->fatal = kpl_last_status() != KPL_EFORMAT;
    }
    if (l->why[0]) {
        free(buf);
        return;
    }
    l->bytes = (uint8_t *)buf;
    l->len = len;
    if (max_side > 0 && jpeg && (l->info.width > max_side || l->info.height > max_side)) {
        kpl__img_info info = l->info;
        shrink_jpeg(max_side, quality, c, &info, l);
        if (l->why[0]) {
            char why[sizeof l->why];
            snprintf(why, sizeof why, "%s", l->why);
            snprintf(l->why, sizeof l->why, "cannot re-encode: %.280s", why);
            free(l->bytes);
            l->bytes = NULL;
        }
    }
}

kpl_status kpl__png_encode_gray(const uint8_t *pix, int w, int h, uint8_t **out, size_t *len)
{
    png_image im;
    memset(&im, 0, sizeof im);
    im.version = PNG_IMAGE_VERSION;
    im.width = (png_uint_32)w;
    im.height = (png_uint_32)h;
    im.format = PNG_FORMAT_GRAY;
    png_alloc_size_t n = 0;
    *out = NULL;
    KPL_CHECK(png_image_write_to_memory(&im, NULL, &n, 0, pix, 0, NULL), KPL_EFORMAT,
              "PNG encode of a %dx%d mask: %s", w, h, im.message);
    uint8_t *b = malloc(n);
    KPL_CHECK(b, KPL_ENOMEM, "PNG encode: no memory for %zu bytes", (size_t)n);
    if (!png_image_write_to_memory(&im, b, &n, 0, pix, 0, NULL)) {
        free(b);
        return KPL_ERROR(KPL_EFORMAT, "PNG encode of a %dx%d mask: %s", w, h, im.message);
    }
    *out = b;
    *len = n;
    return KPL_OK;
}

void kpl__load_mask(const char *path, const char *image, int width, int height,
                    int64_t num_classes, kpl__codec *c, kpl__loaded_mask *l)
{
    memset(l, 0, sizeof *l);
    char *buf = NULL;
    size_t len = 0;
    if (!read_item(path, c, "mask: ", l->why, sizeof l->why, &l->fatal, &buf, &len)) return;
    const uint8_t *b = (const uint8_t *)buf;
    if (len < 33 || memcmp(b, "\x89PNG\r\n\x1a\n", 8) || memcmp(b + 12, "IHDR", 4)) {
        snprintf(l->why, sizeof l->why, "mask %.300s: not a PNG (%zu bytes)", path, len);
        free(buf);
        return;
    }
    /* The size first, from IHDR, so that a mismatch names both files. */
    uint32_t mw = __builtin_bswap32(kpl__rd32(b + 16)), mh = __builtin_bswap32(kpl__rd32(b + 20));
    if (mw != (uint32_t)width || mh != (uint32_t)height) {
        snprintf(l->why, sizeof l->why, "mask %.150s is %ux%u, image %.150s is %dx%d (width x "
                 "height)", path, mw, mh, image, width, height);
        free(buf);
        return;
    }
    kpl__img_view v;
    if (kpl__mask_decode(c->dec, b, len, "png", width, height, path, &v) < 0) {
        snprintf(l->why, sizeof l->why, "mask %s", kpl_last_error());
        l->fatal = kpl_last_status() == KPL_ENOMEM;
        free(buf);
        return;
    }
    if (num_classes > 0)
        for (int y = 0; y < height && !l->why[0]; y++)
            for (int x = 0; x < width; x++) {
                int m = v.data[(size_t)y * v.stride + (size_t)x];
                if (m != 255 && m >= num_classes) {
                    snprintf(l->why, sizeof l->why, "mask %.280s: value %d at (x %d, y %d) is "
                             "neither a class (0..%lld) nor 255 (ignore)", path, m, x, y,
                             (long long)num_classes - 1);
                    break;
                }
            }
    if (l->why[0]) {
        free(buf);
        return;
    }
    l->width = width;
    l->height = height;
    if (b[24] == 16) { /* 16-bit gray, every value <= 255: stored as 8 bits */
        uint8_t *pix = malloc((size_t)width * height);
        uint8_t *png = NULL;
        size_t n = 0;
        if (pix)
            for (int y = 0; y < height; y++)
                memcpy(pix + (size_t)y * width, v.data + (size_t)y * v.stride, (size_t)width);
        kpl_status st = pix ? kpl__png_encode_gray(pix, width, height, &png, &n) : KPL_ENOMEM;
        free(pix);
        free(buf);
        if (st < 0) {
            snprintf(l->why, sizeof l->why, "mask %.300s: cannot re-encode as 8 bits", path);
            l->fatal = true;
            return;
        }
        l->bytes = png;
        l->len = n;
        return;
    }
    l->bytes = (uint8_t *)buf;
    l->len = len;
}

void kpl__convert_parallel(int64_t n, int threads,
                           void (*work)(int64_t i, kpl__codec *c, void *ctx), void *ctx)
{
    if (threads <= 0) threads = omp_get_max_threads();
    if (n < threads) threads = n > 0 ? (int)n : 1;
#pragma omp parallel num_threads(threads)
    {
        kpl__codec c = {tjInitCompress(), kpl__decoder_create(), kpl__xform_scratch_create(),
                        NULL, 0};
        bool ready = c.tjc && c.dec && c.scratch;
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < n; i++) {
            if (ready && !c.tjc) ready = (c.tjc = tjInitCompress()) != NULL;
            work(i, ready ? &c : NULL, ctx);
        }
        if (c.tjc) tjDestroy(c.tjc);
        kpl__decoder_destroy(c.dec);
        kpl__xform_scratch_destroy(c.scratch);
        free(c.pix);
    }
}

kpl_status kpl__convert_bad(const kpl_convert_options *o, bool fatal, int64_t *nskip,
                            const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!o->skip_bad || fatal) return KPL_ERROR(fatal ? KPL_ENOMEM : KPL_EFORMAT, "%s", msg);
    fprintf(stderr, "%skpl: skipping %s\n", o->progress ? "\n" : "", msg);
    if (nskip) (*nskip)++;
    return KPL_OK;
}

kpl_status kpl__write_text(const char *out_dir, const char *name, const char *text, size_t len)
{
    char p[PATH_MAX];
    KPL_TRY(kpl__path_join(p, sizeof p, out_dir, name));
    return kpl__write_file_atomic(p, text, len);
}

kpl_status kpl__write_lines(const char *out_dir, const char *name, char *const *lines, int64_t n)
{
    size_t len = 0;
    for (int64_t i = 0; i < n; i++) len += strlen(lines[i]) + 1;
    char *t = malloc(len + 1), *q = t;
    KPL_CHECK(t, KPL_ENOMEM, "%s/%s: no memory", out_dir, name);
    for (int64_t i = 0; i < n; i++) {
        size_t k = strlen(lines[i]);
        memcpy(q, lines[i], k);
        q[k] = '\n';
        q += k + 1;
    }
    kpl_status st = kpl__write_text(out_dir, name, t, len);
    free(t);
    return st;
}
