/*
 * image_decode.c — one image's bytes to u8 pixels, for the DataTransformer:
 * JPEG through libjpeg-turbo's libjpeg API, PNG through libpng, and raw
 * pixels with a fixed shape.
 *
 * A JPEG is decoded only where the transform will look: the window is
 * chosen before decoding, the rows above it are skipped
 * (jpeg_skip_scanlines: entropy decoding only), the columns outside it are
 * cropped (jpeg_crop_scanline: no IDCT, upsampling or color conversion
 * there), decoding stops after its last row (jpeg_abort_decompress), and a
 * crop much larger than the output is decoded at 1/2, 1/4 or 1/8 scale in
 * the DCT domain.  libjpeg-turbo's "fancy" chroma upsampling treats the
 * left and right edges of a cropped row as image edges, so the requested
 * window is widened by a pixel on the left and two on the right; the pixels
 * handed back then equal those of a full decode exactly (the tests check
 * this).
 *
 * Every libjpeg error and every warning about corrupt data ends the decode
 * with KPL_EFORMAT carrying the library's message: a JPEG that libjpeg
 * would patch up with gray blocks is refused rather than trained on.
 *
 * A JPEG's EXIF Orientation (APP1 "Exif", IFD0 tag 0x0112, values 1-8) is
 * applied as PIL's ImageOps.exif_transpose does: the image's size is the
 * oriented one, a window is mapped to the stored pixels it covers, decoded
 * there, and turned into place.  An error leaves nothing behind: every
 * entry point resets the decompressor (jpeg_abort_decompress) before it
 * starts, and a PNG gets fresh libpng structs each time.
 */
#define _GNU_SOURCE /* strcasestr */
#include "transform_impl.h"

#include <limits.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>

#include <jerror.h>
#include <jpeglib.h>
#include <png.h>

/* Larger images are refused before any allocation (a header can claim
 * 65535 x 65535). */
#define MAX_PIXELS ((int64_t)1 << 28)

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jb;
    char msg[JMSG_LENGTH_MAX];
    bool trailing; /* past the last pixel: only the markers up to EOI are left */
} jerr_mgr;

struct kpl__decoder {
    struct jpeg_decompress_struct jd;
    jerr_mgr jerr;
    bool jd_live; /* jd was created */

    const uint8_t *data; /* the open image */
    size_t n;
    kpl__img_info info;
    const char *where;
    int raw_c;
    int stored_w, stored_h; /* JPEG: before the EXIF orientation */

    uint8_t *buf; /* decoded pixels */
    size_t buf_cap;
    uint8_t *obuf; /* a window turned to its EXIF orientation */
    size_t obuf_cap;
    JSAMPROW *rows;
    size_t rows_cap;
    char pmsg[200]; /* libpng's error message */
};

static kpl_status grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return KPL_OK;
    size_t n = need + need / 4;
    void *q = realloc(*p, n * elem);
    KPL_CHECK(q, KPL_ENOMEM, "image decode: no memory for %zu bytes", n * elem);
    *p = q;
    *cap = n;
    return KPL_OK;
}

static void jerr_exit(j_common_ptr ci)
{
    jerr_mgr *e = (jerr_mgr *)ci->err;
    ci->err->format_message(ci, e->msg);
    longjmp(e->jb, 1);
}

/* Warnings (level -1) about the data are errors here; trace messages are
 * dropped.  An unknown JFIF revision or a malformed ICC marker says nothing
 * about the pixels and is let through, and so are stray bytes before the
 * EOI marker once every pixel has been decoded ("extraneous bytes before
 * marker 0xd9", which some cameras write: the image is whole, and a window
 * decode never reads that far). */
static void jerr_emit(j_common_ptr ci, int level)
{
    if (level >= 0) return;
    int code = ci->err->msg_code;
    if (code == JWRN_JFIF_MAJOR || code == JWRN_BOGUS_ICC) return;
    if (code == JWRN_EXTRANEOUS_DATA && ((jerr_mgr *)ci->err)->trailing) return;
    jerr_exit(ci);
}

static bool jd_create(kpl__decoder *d)
{
    if (setjmp(d->jerr.jb)) return false;
    jpeg_create_decompress(&d->jd);
    d->jd_live = true;
    return true;
}

kpl__decoder *kpl__decoder_create(void)
{
    kpl__decoder *d = calloc(1, sizeof *d);
    if (!d) {
        KPL_ERROR(KPL_ENOMEM, "decoder: no memory");
        return NULL;
    }
    d->jd.err = jpeg_std_error(&d->jerr.pub);
    d->jerr.pub.error_exit = jerr_exit;
    d->jerr.pub.emit_message = jerr_emit;
    if (!jd_create(d)) {
        KPL_ERROR(KPL_ENOMEM, "decoder: libjpeg: %s", d->jerr.msg);
        free(d);
        return NULL;
    }
    return d;
}

void kpl__decoder_destroy(kpl__decoder *d)
{
    if (!d) return;
    if (d->jd_live) jpeg_destroy_decompress(&d->jd);
    free(d->buf);
    free(d->obuf);
    free(d->rows);
    free(d);
}

/* ---- JPEG ------------------------------------------------------------------------ */

/* The status of a libjpeg failure: running out of memory is not the
 * file's fault (a loader must not skip the sample as corrupt for it). */
static kpl_status jpeg_status(const kpl__decoder *d)
{
    return d->jerr.pub.msg_code == JERR_OUT_OF_MEMORY ? KPL_ENOMEM : KPL_EFORMAT;
}

static unsigned rd16e(const uint8_t *p, bool le)
{
    return le ? (unsigned)p[0] | (unsigned)p[1] << 8 : (unsigned)p[0] << 8 | p[1];
}

static uint32_t rd32e(const uint8_t *p, bool le)
{
    return le ? (uint32_t)rd16e(p, true) | (uint32_t)rd16e(p + 2, true) << 16
              : (uint32_t)rd16e(p, false) << 16 | rd16e(p + 2, false);
}

/* The Orientation tag (0x0112) of the TIFF structure t[0..n) of an Exif
 * segment (either byte order), read from IFD0; 1 when absent or bad. */
static int tiff_orientation(const uint8_t *t, size_t n)
{
    if (n < 8) return 1;
    bool le;
    if (t[0] == 'I' && t[1] == 'I') le = true;
    else if (t[0] == 'M' && t[1] == 'M') le = false;
    else return 1;
    if (rd16e(t + 2, le) != 42) return 1;
    uint64_t ifd = rd32e(t + 4, le);
    if (ifd + 2 > n) return 1;
    uint64_t count = rd16e(t + ifd, le);
    for (uint64_t k = 0; k < count && ifd + 2 + 12 * (k + 1) <= n; k++) {
        const uint8_t *e = t + ifd + 2 + 12 * k;
        if (rd16e(e, le) != 0x0112) continue;
        unsigned type = rd16e(e + 2, le);
        uint32_t v = type == 3 ? rd16e(e + 8, le) : type == 4 ? rd32e(e + 8, le) : 0;
        return v >= 1 && v <= 8 ? (int)v : 1;
    }
    return 1;
}

/* The EXIF Orientation of a JPEG (1-8; 1 without one): the first APP1
 * segment that starts "Exif\0\0", looked for in the markers before the
 * first scan.  Bounds-checked walk; a malformed marker ends it. */
static int jpeg_orientation(const uint8_t *p, size_t n)
{
    size_t at = 2; /* after SOI */
    while (at + 4 <= n) {
        if (p[at] != 0xff) return 1;
        uint8_t m = p[at + 1];
        if (m == 0xff) { /* fill byte */
            at++;
            continue;
        }
        if (m == 0x01 || m == 0xd8 || (m >= 0xd0 && m <= 0xd7)) { /* no length */
            at += 2;
            continue;
        }
        if (m == 0xda || m == 0xd9) return 1; /* SOS, EOI: no more header markers */
        size_t len = (size_t)p[at + 2] << 8 | p[at + 3];
        if (len < 2 || at + 2 + len > n) return 1;
        if (m == 0xe1 && len >= 2 + 6 && !memcmp(p + at + 4, "Exif\0\0", 6))
            return tiff_orientation(p + at + 10, len - 8);
        at += 2 + len;
    }
    return 1;
}

static kpl_status jpeg_open(kpl__decoder *d)
{
    struct jpeg_decompress_struct *ci = &d->jd;
    if (setjmp(d->jerr.jb)) {
        jpeg_abort_decompress(ci);
        return KPL_ERROR(jpeg_status(d), "%s: JPEG: %s", d->where, d->jerr.msg);
    }
    /* Whatever an earlier image left (a failed header, a decode stopped
     * half-way) goes: the decompressor starts from DSTATE_START. */
    jpeg_abort_decompress(ci);
    d->jerr.trailing = false;
    jpeg_mem_src(ci, d->data, (unsigned long)d->n);
    jpeg_read_header(ci, TRUE);
    d->stored_w = (int)ci->image_width;
    d->stored_h = (int)ci->image_height;
    d->info.orientation = jpeg_orientation(d->data, d->n);
    bool swap = d->info.orientation >= 5;
    d->info.width = swap ? d->stored_h : d->stored_w;
    d->info.height = swap ? d->stored_w : d->stored_h;
    d->info.channels = ci->num_components;
    if ((int64_t)ci->image_width * ci->image_height > MAX_PIXELS) {
        jpeg_abort_decompress(ci);
        return KPL_ERROR(KPL_EFORMAT, "%s: JPEG of %ux%u pixels is too large (limit %lld)",
                         d->where, ci->image_width, ci->image_height, (long long)MAX_PIXELS);
    }
    return KPL_OK;
}

/* CMYK as libjpeg delivers an Adobe file (inverted: 255 = no ink) to RGB,
 * in place (the 3-byte writes trail the 4-byte reads). */
static void cmyk_to_rgb(uint8_t *p, int n)
{
    for (int i = 0; i < n; i++) {
        unsigned c = p[4 * i], m = p[4 * i + 1], y = p[4 * i + 2], k = p[4 * i + 3];
        p[3 * i] = (uint8_t)((c * k + 127) / 255);
        p[3 * i + 1] = (uint8_t)((m * k + 127) / 255);
        p[3 * i + 2] = (uint8_t)((y * k + 127) / 255);
    }
}

/* ITU-R 601 luma with libjpeg's fixed-point weights and rounding. */
static inline uint8_t luma(unsigned r, unsigned g, unsigned b)
{
    return (uint8_t)((19595u * r + 38470u * g + 7471u * b + 32768u) >> 16);
}

static void rgb_to_gray(const uint8_t *s, int step, uint8_t *o, int n)
{
    for (int i = 0; i < n; i++) o[i] = luma(s[step * i], s[step * i + 1], s[step * i + 2]);
}

/* Decodes the window [x, x+w) x [y, y+h) of the stored (not oriented)
 * image scaled by 1/denom. */
static kpl_status jpeg_region(kpl__decoder *d, int denom, int x, int y, int w, int h, int channels,
                              kpl__img_view *out)
{
    struct jpeg_decompress_struct *ci = &d->jd;
    bool cmyk = ci->jpeg_color_space == JCS_CMYK || ci->jpeg_color_space == JCS_YCCK;
    if (setjmp(d->jerr.jb)) {
        jpeg_abort_decompress(ci);
        return KPL_ERROR(jpeg_status(d), "%s: JPEG: %s", d->where, d->jerr.msg);
    }
    ci->scale_num = 1;
    ci->scale_denom = (unsigned)denom;
    ci->out_color_space = cmyk ? JCS_CMYK : channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
    ci->dct_method = JDCT_ISLOW;
    jpeg_start_decompress(ci);
    int W = (int)ci->output_width, comps = ci->output_components;

    /* Widen by a pixel on the left and two on the right so that no pixel
     * handed back lies on an edge of the cropped rows (see the top). */
    JDIMENSION xo = (JDIMENSION)(x > 0 ? x - 1 : 0);
    JDIMENSION cw = (JDIMENSION)((x + w + 2 < W ? x + w + 2 : W) - (int)xo);
    if (xo > 0 || (int)cw < W) jpeg_crop_scanline(ci, &xo, &cw);
    size_t stride = (size_t)ci->output_width * (size_t)comps;
    KPL_TRY(grow((void **)&d->buf, &d->buf_cap, stride * (size_t)h + 64, 1));
    KPL_TRY(grow((void **)&d->rows, &d->rows_cap, (size_t)h, sizeof(JSAMPROW)));
    for (int r = 0; r < h; r++) d->rows[r] = d->buf + (size_t)r * stride;
    if (y > 0) jpeg_skip_scanlines(ci, (JDIMENSION)y);
    int got = 0;
    while (got < h) {
        JDIMENSION k = jpeg_read_scanlines(ci, d->rows + got, (JDIMENSION)(h - got));
        if (k == 0) {
            jpeg_abort_decompress(ci);
            return KPL_ERROR(KPL_EFORMAT, "%s: JPEG: no rows after row %d", d->where, y + got);
        }
        got += (int)k;
    }
    jpeg_abort_decompress(ci);

    int off = x - (int)xo;
    if (cmyk) {
        int cwi = (int)ci->output_width;
        for (int r = 0; r < h; r++) {
            uint8_t *row = d->rows[r];
            cmyk_to_rgb(row, cwi);
            if (channels == 1) rgb_to_gray(row, 3, row, cwi);
        }
        comps = channels;
    }
    out->data = d->buf + (size_t)off * (size_t)comps;
    out->w = w;
    out->h = h;
    out->c = comps;
    out->stride = stride;
    return KPL_OK;
}

/* The window [x, x+w) x [y, y+h) of the oriented image scaled by 1/denom:
 * the stored window under it is decoded, then turned (PIL's transposes:
 * 2 mirror, 3 rotate 180, 4 flip, 5 transpose, 6 rotate 90 clockwise,
 * 7 transverse, 8 rotate 90 counter-clockwise). */
static kpl_status jpeg_oriented(kpl__decoder *d, int denom, int x, int y, int w, int h,
                                int channels, kpl__img_view *out)
{
    int o = d->info.orientation;
    if (o <= 1) return jpeg_region(d, denom, x, y, w, h, channels, out);
    int sw = (d->stored_w + denom - 1) / denom, sh = (d->stored_h + denom - 1) / denom;
    /* Stored window (sx, sy, ww, wh) covering the oriented one. */
    int sx, sy, ww = o >= 5 ? h : w, wh = o >= 5 ? w : h;
    switch (o) {
    case 2: sx = sw - x - w, sy = y; break;
    case 3: sx = sw - x - w, sy = sh - y - h; break;
    case 4: sx = x, sy = sh - y - h; break;
    case 5: sx = y, sy = x; break;
    case 6: sx = y, sy = sh - x - w; break;
    case 7: sx = sw - y - h, sy = sh - x - w; break;
    default: sx = sw - y - h, sy = x; break; /* 8 */
    }
    kpl__img_view s;
    KPL_TRY(jpeg_region(d, denom, sx, sy, ww, wh, channels, &s));
    const int c = s.c;
    const size_t ostride = (size_t)w * (size_t)c;
    KPL_TRY(grow((void **)&d->obuf, &d->obuf_cap, ostride * (size_t)h + 64, 1));
    /* Output pixel (i, j) of the window reads stored window pixel (a, b):
     * 2 (w-1-i, j), 3 (w-1-i, h-1-j), 4 (i, h-1-j), 5 (j, i), 6 (j, w-1-i),
     * 7 (h-1-j, w-1-i), 8 (h-1-j, i).  Along a row, a step in i is a step
     * of one pixel (2-4) or one stored row (5-8). */
    const ptrdiff_t px = c, row = (ptrdiff_t)s.stride;
    ptrdiff_t step;
    switch (o) {
    case 2: case 3: step = -px; break;
    case 4: step = px; break;
    case 5: case 8: step = row; break;
    default: step = -row; break; /* 6, 7 */
    }
    for (int j = 0; j < h; j++) {
        int a, b; /* the stored pixel of i = 0 */
        switch (o) {
        case 2: a = w - 1, b = j; break;
        case 3: a = w - 1, b = h - 1 - j; break;
        case 4: a = 0, b = h - 1 - j; break;
        case 5: a = j, b = 0; break;
        case 6: a = j, b = w - 1; break;
        case 7: a = h - 1 - j, b = w - 1; break;
        default: a = h - 1 - j, b = 0; break; /* 8 */
        }
        const uint8_t *p = s.data + (ptrdiff_t)b * row + (ptrdiff_t)a * px;
        uint8_t *q = d->obuf + (size_t)j * ostride;
        if (c == 1)
            for (int i = 0; i < w; i++, p += step) q[i] = *p;
        else
            for (int i = 0; i < w; i++, p += step, q += 3) q[0] = p[0], q[1] = p[1], q[2] = p[2];
    }
    *out = (kpl__img_view){d->obuf, w, h, c, ostride};
    return KPL_OK;
}

/* Decodes every row at 1/8 scale (every coefficient is still entropy
 * decoded, so corrupt data, a premature end or a missing EOI is found,
 * at a fraction of the IDCT's cost), then reads the markers up to EOI. */
static kpl_status jpeg_check(kpl__decoder *d)
{
    struct jpeg_decompress_struct *ci = &d->jd;
    bool cmyk = ci->jpeg_color_space == JCS_CMYK || ci->jpeg_color_space == JCS_YCCK;
    if (setjmp(d->jerr.jb)) {
        jpeg_abort_decompress(ci);
        d->jerr.trailing = false;
        return KPL_ERROR(jpeg_status(d), "%s: JPEG: %s", d->where, d->jerr.msg);
    }
    ci->scale_num = 1;
    ci->scale_denom = 8;
    ci->out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
    ci->dct_method = JDCT_ISLOW;
    jpeg_start_decompress(ci);
    size_t stride = (size_t)ci->output_width * (size_t)ci->output_components;
    int nr = ci->rec_outbuf_height > 0 ? ci->rec_outbuf_height : 1;
    kpl_status st = grow((void **)&d->buf, &d->buf_cap, stride * (size_t)nr + 64, 1);
    if (st == KPL_OK)
        st = grow((void **)&d->rows, &d->rows_cap, (size_t)nr, sizeof(JSAMPROW));
    if (st < 0) {
        jpeg_abort_decompress(ci);
        return st;
    }
    for (int r = 0; r < nr; r++) d->rows[r] = d->buf + (size_t)r * stride;
    while (ci->output_scanline < ci->output_height)
        if (jpeg_read_scanlines(ci, d->rows, (JDIMENSION)nr) == 0) {
            jpeg_abort_decompress(ci);
            return KPL_ERROR(KPL_EFORMAT, "%s: JPEG: no rows after row %u", d->where,
                             ci->output_scanline);
        }
    d->jerr.trailing = true;
    jpeg_finish_decompress(ci);
    d->jerr.trailing = false;
    return KPL_OK;
}

/* ---- PNG -------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *p;
    size_t n, at;
} png_src;

static void png_read_mem(png_structp png, png_bytep out, size_t len)
{
    png_src *s = png_get_io_ptr(png);
    if (len > s->n - s->at) png_error(png, "unexpected end of data (truncated file)");
    memcpy(out, s->p + s->at, len);
    s->at += len;
}

static void png_err(png_structp png, png_const_charp msg)
{
    kpl__decoder *d = png_get_error_ptr(png);
    snprintf(d->pmsg, sizeof d->pmsg, "%s", msg);
    png_longjmp(png, 1);
}

static void png_warn(png_structp png, png_const_charp msg)
{
    (void)png;
    (void)msg; /* benign (an sRGB profile note, say); corrupt data is an error */
}

/* Decodes the whole PNG into d->buf as 8-bit rows (with `to_end`, reads
 * and checks the chunks after the pixels too).  As a mask (`mask`):
 * values as stored, which must be one channel of <= 8 bits; as an image:
 * palette expanded, low bit depths scaled to 8 bits, 16 bits rounded to 8;
 * *nch is then 1..4 (gray, gray+alpha, RGB, RGBA). */
static kpl_status png_decode_full(kpl__decoder *d, const uint8_t *data, size_t n, bool mask,
                                  bool to_end, int *nch)
{
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, d, png_err, png_warn);
    KPL_CHECK(png, KPL_ENOMEM, "%s: PNG: no memory", d->where);
    png_infop info = png_create_info_struct(png);
    if (!info) {
        png_destroy_read_struct(&png, NULL, NULL);
        return KPL_ERROR(KPL_ENOMEM, "%s: PNG: no memory", d->where);
    }
    png_src src = {data, n, 0};
    kpl_status st = KPL_OK;
    /* Set before the setjmp: read after a longjmp, so volatile. */
    volatile bool bad_kind = false;
    if (setjmp(png_jmpbuf(png))) {
        /* libpng says "Out of memory" (or "out of memory") when an
         * allocation fails: not the file's fault. */
        kpl_status code = strcasestr(d->pmsg, "of memory") ? KPL_ENOMEM : KPL_EFORMAT;
        st = bad_kind ? KPL_EFORMAT : KPL_ERROR(code, "%s: PNG: %s", d->where, d->pmsg);
        goto done;
    }
    png_set_read_fn(png, &src, png_read_mem);
    png_set_crc_action(png, PNG_CRC_ERROR_QUIT, PNG_CRC_ERROR_QUIT);
    png_read_info(png, info);
    png_uint_32 w = png_get_image_width(png, info), h = png_get_image_height(png, info);
    int ct = png_get_color_type(png, info), depth = png_get_bit_depth(png, info);
    if ((int64_t)w * h > MAX_PIXELS) {
        bad_kind = true;
        KPL_ERROR(KPL_EFORMAT, "%s: PNG of %ux%u pixels is too large", d->where, w, h);
        png_longjmp(png, 1);
    }
    /* A 16-bit gray mask is read as stored (big-endian pairs) and
     * narrowed below, each value checked to fit in 8 bits. */
    const bool wide = mask && depth == 16;
    if (mask) {
        if (ct != PNG_COLOR_TYPE_GRAY && (ct != PNG_COLOR_TYPE_PALETTE || depth > 8)) {
            bad_kind = true;
            KPL_ERROR(KPL_EFORMAT,
                      "%s: a mask PNG must be gray (up to 16 bits) or a palette (color type %d, "
                      "bit depth %d)", d->where, ct, depth);
            png_longjmp(png, 1);
        }
        if (depth < 8) png_set_packing(png);
    } else {
        png_set_expand(png);
        if (depth == 16) png_set_scale_16(png);
    }
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
    int ch = png_get_channels(png, info);
    size_t rb = png_get_rowbytes(png, info);
    if (rb != (size_t)w * (size_t)ch * (wide ? 2 : 1)) {
        bad_kind = true;
        KPL_ERROR(KPL_EFORMAT, "%s: PNG: unexpected row size %zu", d->where, rb);
        png_longjmp(png, 1);
    }
    if (grow((void **)&d->buf, &d->buf_cap, rb * h + 64, 1) < 0 ||
        grow((void **)&d->rows, &d->rows_cap, h, sizeof(JSAMPROW)) < 0) {
        bad_kind = true;
        png_longjmp(png, 1);
    }
    for (png_uint_32 r = 0; r < h; r++) d->rows[r] = d->buf + (size_t)r * rb;
    png_read_image(png, d->rows);
    if (to_end) png_read_end(png, NULL); /* the chunks after the pixels, up to IEND */
    if (wide) {
        /* Narrowed in place: row r moves to r * w, each value from 2x to x,
         * never past what is still to be read. */
        for (png_uint_32 r = 0; r < h && st == KPL_OK; r++) {
            const uint8_t *in = d->rows[r];
            uint8_t *o = d->buf + (size_t)r * w;
            for (png_uint_32 x = 0; x < w; x++) {
                unsigned v = (unsigned)in[2 * x] << 8 | in[2 * x + 1];
                if (v > 255) {
                    st = KPL_ERROR(KPL_EFORMAT, "%s: 16-bit mask value %u at (x %u, y %u) is "
                                   "past 255 (masks are u8 class indices, 255 = ignore)",
                                   d->where, v, x, r);
                    break;
                }
                o[x] = (uint8_t)v;
            }
        }
    }
    d->info.width = (int)w;
    d->info.height = (int)h;
    *nch = ch;
done:
    if (bad_kind) st = kpl_last_status() < 0 ? kpl_last_status() : KPL_EFORMAT;
    png_destroy_read_struct(&png, &info, NULL);
    return st;
}

/* The header fields without decoding: IHDR is the first chunk. */
static kpl_status png_header(kpl__decoder *d)
{
    const uint8_t *p = d->data;
    if (d->n < 33 || memcmp(p + 12, "IHDR", 4) != 0)
        return KPL_ERROR(KPL_EFORMAT, "%s: PNG: no IHDR chunk", d->where);
    uint32_t w = __builtin_bswap32(kpl__rd32(p + 16)), h = __builtin_bswap32(kpl__rd32(p + 20));
    if (w == 0 || h == 0 || w > 0x7fffffffu || h > 0x7fffffffu || (int64_t)w * h > MAX_PIXELS)
        return KPL_ERROR(KPL_EFORMAT, "%s: PNG: bad or too large size %ux%u", d->where, w, h);
    static const int chans[7] = {1, 0, 3, 1, 2, 0, 4};
    int ct = p[25];
    d->info.width = (int)w;
    d->info.height = (int)h;
    d->info.channels = ct <= 6 ? chans[ct] : 0;
    if (d->info.channels == 0)
        return KPL_ERROR(KPL_EFORMAT, "%s: PNG: bad color type %d", d->where, ct);
    return KPL_OK;
}

/* ---- the interface ------------------------------------------------------------------ */

static const uint8_t png_sig[8] = {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a};

kpl_status kpl__img_open(kpl__decoder *d, const void *data, size_t n, const char *encoding,
                         const int raw_hwc[3], const char *where, kpl__img_info *info)
{
    d->data = data;
    d->n = n;
    d->where = where;
    memset(&d->info, 0, sizeof d->info);
    d->info.orientation = 1;
    const uint8_t *p = data;
    if (!strcmp(encoding, "raw")) {
        size_t want = (size_t)raw_hwc[0] * (size_t)raw_hwc[1] * (size_t)raw_hwc[2];
        KPL_CHECK(n == want, KPL_EFORMAT, "%s: raw image of %zu bytes, its shape (%d, %d, %d) "
                  "needs %zu", where, n, raw_hwc[0], raw_hwc[1], raw_hwc[2], want);
        d->info = (kpl__img_info){KPL__IMG_RAW, raw_hwc[1], raw_hwc[0], raw_hwc[2], 1};
    } else if (!strcmp(encoding, "jpeg") || (!*encoding && n >= 3 && p[0] == 0xff && p[1] == 0xd8)) {
        d->info.kind = KPL__IMG_JPEG;
        KPL_TRY(jpeg_open(d));
    } else if (!strcmp(encoding, "png") || (!*encoding && n >= 8 && !memcmp(p, png_sig, 8))) {
        d->info.kind = KPL__IMG_PNG;
        KPL_CHECK(n >= 8 && !memcmp(p, png_sig, 8), KPL_EFORMAT, "%s: not a PNG (no signature)",
                  where);
        KPL_TRY(png_header(d));
    } else if (!*encoding) {
        return KPL_ERROR(KPL_EFORMAT, "%s: neither JPEG nor PNG (%zu bytes starting %02x %02x)",
                         where, n, n > 0 ? p[0] : 0, n > 1 ? p[1] : 0);
    } else {
        return KPL_ERROR(KPL_EFORMAT, "%s: unknown image encoding '%s'", where, encoding);
    }
    *info = d->info;
    return KPL_OK;
}

void kpl__img_scaled_size(const kpl__img_info *info, int denom, int *w, int *h)
{
    *w = (info->width + denom - 1) / denom;
    *h = (info->height + denom - 1) / denom;
}

/* n pixels of `from` channels (1..4: gray, gray+alpha, RGB, RGBA) to `to`
 * (1 or 3) channels; alpha is dropped, as PIL's convert does. */
static void convert_px(const uint8_t *s, int from, uint8_t *o, int to, int n)
{
    if (to == 1) {
        if (from <= 2)
            for (int i = 0; i < n; i++) o[i] = s[from * i];
        else
            rgb_to_gray(s, from, o, n);
    } else {
        for (int i = 0; i < n; i++) {
            const uint8_t *q = s + from * i;
            if (from <= 2)
                o[3 * i] = o[3 * i + 1] = o[3 * i + 2] = q[0];
            else
                o[3 * i] = q[0], o[3 * i + 1] = q[1], o[3 * i + 2] = q[2];
        }
    }
}

kpl_status kpl__img_decode(kpl__decoder *d, int denom, int x, int y, int w, int h, int channels,
                           kpl__img_view *out)
{
    const kpl__img_info *in = &d->info;
    KPL_ASSERT(in->kind, "kpl__img_decode without a successful open");
    KPL_ASSERT(denom == 1 || (in->kind == KPL__IMG_JPEG && (denom == 2 || denom == 4 || denom == 8)),
               "bad scale denominator");
    int sw, sh;
    kpl__img_scaled_size(in, denom, &sw, &sh);
    KPL_ASSERT(x >= 0 && y >= 0 && w > 0 && h > 0 && x + w <= sw && y + h <= sh,
               "decode window outside the image");
    if (in->kind == KPL__IMG_JPEG) return jpeg_oriented(d, denom, x, y, w, h, channels, out);

    const uint8_t *base;
    size_t stride;
    int from;
    if (in->kind == KPL__IMG_RAW) {
        from = in->channels;
        stride = (size_t)in->width * (size_t)from;
        base = d->data;
    } else {
        KPL_TRY(png_decode_full(d, d->data, d->n, false, false, &from));
        stride = (size_t)in->width * (size_t)from;
        base = d->buf;
    }
    if (from == channels) {
        *out = (kpl__img_view){base + (size_t)y * stride + (size_t)x * (size_t)from, w, h,
                               channels, stride};
        return KPL_OK;
    }
    /* Convert the window in place (PNG: the rows only shrink or the
     * converted window is written behind its source) or, for raw bytes and
     * channel growth, behind the decoded image. */
    size_t ostride = (size_t)w * (size_t)channels;
    size_t at = in->kind == KPL__IMG_PNG ? stride * (size_t)in->height : 0;
    KPL_TRY(grow((void **)&d->buf, &d->buf_cap, at + ostride * (size_t)h + 64, 1));
    if (in->kind == KPL__IMG_PNG) base = d->buf;
    for (int r = 0; r < h; r++)
        convert_px(base + (size_t)(y + r) * stride + (size_t)x * (size_t)from, from,
                   d->buf + at + (size_t)r * ostride, channels, w);
    *out = (kpl__img_view){d->buf + at, w, h, channels, ostride};
    return KPL_OK;
}

kpl_status kpl__img_check(kpl__decoder *d)
{
    const kpl__img_info *in = &d->info;
    KPL_ASSERT(in->kind, "kpl__img_check without a successful open");
    if (in->kind == KPL__IMG_RAW) return KPL_OK;
    if (in->kind == KPL__IMG_PNG) {
        int nch;
        return png_decode_full(d, d->data, d->n, false, true, &nch);
    }
    KPL_TRY(jpeg_check(d));
    return jpeg_open(d); /* ready for a decode again */
}

kpl_status kpl__mask_decode(kpl__decoder *d, const void *data, size_t n, const char *encoding,
                            int width, int height, const char *where, kpl__img_view *out)
{
    d->where = where;
    const uint8_t *p = data;
    if (!strcmp(encoding, "raw") || (!*encoding && !(n >= 8 && !memcmp(p, png_sig, 8)))) {
        KPL_CHECK(n == (size_t)width * (size_t)height, KPL_EFORMAT,
                  "%s: raw mask of %zu bytes, the %dx%d image needs %zu", where, n, width,
                  height, (size_t)width * (size_t)height);
        *out = (kpl__img_view){p, width, height, 1, (size_t)width};
        return KPL_OK;
    }
    KPL_CHECK(n >= 8 && !memcmp(p, png_sig, 8), KPL_EFORMAT, "%s: mask is not a PNG", where);
    int nch = 0;
    kpl__img_info keep = d->info;
    kpl_status st = png_decode_full(d, p, n, true, false, &nch);
    int mw = d->info.width, mh = d->info.height;
    d->info = keep;
    KPL_TRY(st);
    KPL_CHECK(mw == width && mh == height, KPL_EFORMAT,
              "%s: mask is %dx%d, the image %dx%d", where, mw, mh, width, height);
    *out = (kpl__img_view){d->buf, width, height, 1, (size_t)width};
    return KPL_OK;
}
