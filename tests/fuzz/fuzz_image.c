/*
 * fuzz_image.c — image decoding and the per-sample transform
 * (dataio/image_decode.c, dataio/transform.c): kpl__img_open,
 * kpl__img_decode of a window at a DCT scale, kpl__resize, kpl__mask_decode,
 * and kpl__xform_sample with crop, flip, jitter, resize, boxes and mask
 * settings taken from the input, exactly as a loader worker runs it.
 *
 * Input: 12 settings bytes, then parts separated by "@KPL@":
 *   image [@KPL@ mask [@KPL@ boxes (f32 x0,y0,x1,y1 ...) [@KPL@ box labels (i64 ...)]]]
 * Settings:
 *   s[0]  bits 0-1 crop (none, random_resized, center, keep_ratio), bit 2 three channels,
 *         bit 3 u8 output, bits 4-5 the image feature (sniffed JPEG/PNG; raw
 *         (6, 5, 3); raw (7, 4, 1); raw (5, 6)), bit 6 boxes, bit 7 mask
 *   s[1], s[2]  output height and width (1..48); keep_ratio: its short sides
 *   s[3]  center crop: resize_shorter beyond the output size; keep_ratio: bit 0
 *         one or two short sides, max_side 1 + s[3] % 64 (size_divisor s[6] & 31)
 *   s[4]  flip probability;  s[5] jitter amounts;  s[6] scale and ratio
 *   s[7]  bits 0-1 the direct decode's encoding ("", jpeg, png, raw),
 *         bits 2-3 its DCT scale (1/1 .. 1/8), bit 4 its channels, bits 5-7
 *         the example number (the random draws)
 *   s[8..11]  the direct decode's window (x, y, w, h as fractions)
 * Images larger than KPL_FUZZ_MAX_PIXELS (environment; default 2^20) are
 * opened but not decoded, to keep the harness fast: a header alone can
 * claim 2^28 pixels, which kpl accepts.
 * Seeds (corpus/image) come from gen_image_seeds.py: JPEGs (gray, RGB,
 * CMYK, progressive, restart markers) and PNGs (every color type, bit
 * depths 1 to 16, palette with transparency, interlaced).
 */
#include "fuzz_common.h"

#include "transform_impl.h"

#define SEP "@KPL@"
#define NSET 12
#define NDS 4

static const char *root;
static kpl_dataset *ds[NDS];
static kpl__xform_scratch *scratch;
static kpl__decoder *dec;
static int64_t max_pixels = (int64_t)1 << 20;

/* One dataset per image feature kind, each with one example: only their
 * schemas matter (kpl__xform_init resolves a transform against one). */
static kpl_dataset *make_dataset(const char *name, const char *enc, int ndim, const int64_t *shape)
{
    kpl_feature_spec schema[5] = {
        {.name = "image", .type = KPL_FEATURE_BYTES},
        {.name = "label", .type = KPL_FEATURE_INT64},
        {.name = "boxes", .type = KPL_FEATURE_FLOAT},
        {.name = "box_labels", .type = KPL_FEATURE_INT64},
        {.name = "mask", .type = KPL_FEATURE_BYTES},
    };
    snprintf(schema[0].encoding, sizeof schema[0].encoding, "%s", enc);
    schema[0].ndim = ndim;
    for (int d = 0; d < ndim; d++) schema[0].shape[d] = shape[d];
    char dir[PATH_MAX];
    fuzz_path(dir, root, name);
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    uint8_t px[256] = {0};
    int64_t label = 0;
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    kpl_feature_value v[5] = {{px, (uint32_t)(ndim ? n : 1)}, {&label, 1}, {NULL, 0}, {NULL, 0},
                              {NULL, 0}};
    kpl_dataset *out = NULL;
    if (kpl_record_writer_create(dir, 5, schema, &cfg, &w) != KPL_OK ||
        kpl_record_writer_add(w, v) != KPL_OK || kpl_record_writer_close(w) != KPL_OK ||
        kpl_dataset_open(dir, &out) != KPL_OK) {
        fprintf(stderr, "fuzz_image: setup: %s\n", kpl_last_error());
        abort();
    }
    return out;
}

static void teardown(void)
{
    for (int i = 0; i < NDS; i++) kpl_dataset_close(ds[i]);
    kpl__xform_scratch_destroy(scratch);
    kpl__decoder_destroy(dec);
}

static void setup(void)
{
    if (root) return;
    root = fuzz_dir("image");
    static const int64_t s3[3] = {6, 5, 3}, s1[3] = {7, 4, 1}, s2[2] = {5, 6};
    ds[0] = make_dataset("sniff", "", 0, NULL);
    ds[1] = make_dataset("raw3", "raw", 3, s3);
    ds[2] = make_dataset("raw1", "raw", 3, s1);
    ds[3] = make_dataset("raw2d", "raw", 2, s2);
    scratch = kpl__xform_scratch_create();
    dec = kpl__decoder_create();
    if (!scratch || !dec) abort();
    const char *e = getenv("KPL_FUZZ_MAX_PIXELS");
    if (e && atoll(e) > 0) max_pixels = atoll(e);
    atexit(teardown);
}

static void touch_view(const kpl__img_view *v)
{
    for (int r = 0; r < v->h; r++) fuzz_touch(v->data + (size_t)r * v->stride, (size_t)v->w * v->c);
}

/* The decoder's pieces called directly: open, a window at a scale, a
 * resize of what came out, and a mask of the image's size. */
static void direct(const uint8_t *s, fuzz_part img, fuzz_part mask)
{
    static const char *const encs[4] = {"", "jpeg", "png", "raw"};
    const char *enc = encs[s[7] & 3];
    const int raw[3] = {1 + s[1] % 16, 1 + s[2] % 16, 1 + (s[3] & 3)};
    kpl__img_info info;
    if (fuzz_st(kpl__img_open(dec, img.p, img.n, enc, raw, "fuzz", &info), "open") != KPL_OK)
        return;
    if (info.width < 1 || info.height < 1) abort(); /* open promised an image */
    if ((int64_t)info.width * info.height > max_pixels) return;
    int denom = info.kind == KPL__IMG_JPEG ? 1 << ((s[7] >> 2) & 3) : 1;
    int sw, sh;
    kpl__img_scaled_size(&info, denom, &sw, &sh);
    int x = s[8] * sw / 256, y = s[9] * sh / 256;
    int w = 1 + s[10] * (sw - x - 1) / 255, h = 1 + s[11] * (sh - y - 1) / 255;
    int ch = s[7] & 16 ? 3 : 1;
    kpl__img_view v;
    if (fuzz_st(kpl__img_decode(dec, denom, x, y, w, h, ch, &v), "decode") != KPL_OK) return;
    if (v.w != w || v.h != h || v.c != ch) abort();
    touch_view(&v);
    int ow = 1 + s[1] % 32, oh = 1 + s[2] % 32;
    double bx = (s[8] & 15) * w / 16.0, by = (s[9] & 15) * h / 16.0;
    double bw = (w - bx) * (1 + (s[10] & 15)) / 16.0, bh = (h - by) * (1 + (s[11] & 15)) / 16.0;
    uint8_t *out = malloc((size_t)ow * oh * ch);
    if (!out) abort();
    if (kpl__resize(scratch, &v, bx, by, bw, bh, ow, oh, out) == KPL_OK)
        fuzz_touch(out, (size_t)ow * oh * ch);
    free(out);
    if (mask.p) {
        kpl__img_view m;
        if (kpl__mask_decode(dec, mask.p, mask.n, s[7] & 32 ? "raw" : "", info.width,
                             info.height, "fuzz mask", &m) == KPL_OK)
            touch_view(&m);
    }
}

/* kpl__xform_sample as a loader worker runs it. */
static void sample(const uint8_t *s, fuzz_part *parts, int np)
{
    int which = (s[0] >> 4) & 3;
    bool boxes = s[0] & 64, mask = (s[0] & 128) && np > 1;
    kpl_transform_config cfg = KPL_TRANSFORM_CONFIG_INIT;
    cfg.crop = (kpl_crop_mode)(s[0] & 3); /* none, random_resized, center, keep_ratio */
    cfg.channels = s[0] & 4 ? 3 : 1;
    cfg.out_dtype = s[0] & 8 ? KPL_U8 : KPL_F32;
    cfg.out_h = 1 + s[1] % 48;
    cfg.out_w = 1 + s[2] % 48;
    cfg.resize_shorter = (cfg.out_h > cfg.out_w ? cfg.out_h : cfg.out_w) + s[3] % 32;
    cfg.flip_prob = s[4] / 255.0f;
    cfg.brightness = (s[5] & 3) * 0.25f;
    cfg.contrast = ((s[5] >> 2) & 3) * 0.3f;
    cfg.saturation = ((s[5] >> 4) & 3) * 0.4f;
    cfg.scale[0] = 0.05f + (s[6] & 15) * 0.06f;
    cfg.scale[1] = cfg.scale[0] + (1.0f - cfg.scale[0]) * ((s[5] >> 6) & 3) / 3.0f;
    cfg.ratio[0] = 0.25f + (s[6] >> 4) * 0.05f;
    cfg.ratio[1] = cfg.ratio[0] * (1.0f + (s[6] >> 4) * 0.2f);
    if (cfg.crop == KPL_CROP_KEEP_RATIO) {
        cfg.out_h = cfg.out_w = 0;
        cfg.short_sides[0] = 1 + s[1] % 48;
        cfg.short_sides[1] = 1 + s[2] % 48;
        cfg.num_short_sides = 1 + (s[3] & 1);
        cfg.max_side = 1 + s[3] % 64;
        cfg.size_divisor = s[6] & 31;
    }
    for (int c = 0; c < 3; c++) cfg.mean[c] = 0.45f, cfg.std[c] = 0.25f;
    if (boxes) {
        cfg.boxes_feature = "boxes";
        cfg.box_labels_feature = np > 3 ? "box_labels" : NULL;
        cfg.max_boxes = 1 + (s[3] >> 5);
    }
    if (mask) cfg.mask_feature = "mask";
    kpl__xform x;
    if (kpl__xform_init(&x, &cfg, ds[which]) != KPL_OK) {
        fprintf(stderr, "fuzz_image: a valid transform was refused: %s\n", kpl_last_error());
        abort();
    }
    /* The values as kpl_chunk_record hands them out (copies of exactly
     * their size, so that the sanitizers see any overrun). */
    uint8_t *copy[4] = {NULL};
    kpl_feature_value v[5] = {{NULL, 0}};
    for (int i = 0; i < 4; i++) {
        size_t n = i < np ? parts[i].n : 0;
        copy[i] = malloc(n ? n : 1);
        if (!copy[i]) abort();
        if (n) memcpy(copy[i], parts[i].p, n);
    }
    int64_t label = s[7];
    v[0] = (kpl_feature_value){copy[0], (uint32_t)parts[0].n};
    v[1] = (kpl_feature_value){&label, s[1] == 255 ? 0 : 1}; /* an empty label, rarely */
    v[2] = (kpl_feature_value){copy[2], np > 2 ? (uint32_t)(parts[2].n / 4) : 0};
    v[3] = (kpl_feature_value){copy[3], np > 3 ? (uint32_t)(parts[3].n / 8) : 0};
    v[4] = (kpl_feature_value){copy[1], np > 1 ? (uint32_t)parts[1].n : 0};

    size_t ib = kpl__xform_image_bytes(&x), mb = kpl__xform_mask_bytes(&x);
    int64_t M = boxes ? cfg.max_boxes : 0, out_label = 0, nbox = 0;
    void *oimg = malloc(ib);
    uint8_t *omask = mb ? malloc(mb) : NULL;
    float *obox = M ? malloc(sizeof(float) * 4 * (size_t)M) : NULL;
    int64_t *olab = M ? malloc(sizeof(int64_t) * (size_t)M) : NULL;
    if (!oimg || (mb && !omask) || (M && (!obox || !olab))) abort();
    kpl__sample_out out = {.image = oimg, .label = &out_label, .boxes = obox, .box_labels = olab,
                           .num_boxes = boxes ? &nbox : NULL, .mask = omask};
    int64_t example = s[7] >> 5;
    if (fuzz_st(kpl__xform_sample(&x, v, 7, example & 1, example, scratch, &out), "sample") ==
        KPL_OK) {
        fuzz_touch(oimg, ib);
        if (omask) fuzz_touch(omask, mb);
        if (boxes && (nbox < 0 || nbox > M)) abort();
    }
    free(oimg);
    free(omask);
    free(obox);
    free(olab);
    for (int i = 0; i < 4; i++) free(copy[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < NSET) return 0;
    setup();
    fuzz_reset();
    const uint8_t *s = data;
    fuzz_part parts[4];
    int np = fuzz_split(data + NSET, size - NSET, SEP, strlen(SEP), parts, 4);
    direct(s, parts[0], np > 1 ? parts[1] : (fuzz_part){NULL, 0});
    /* The transform decodes the image whole or in part: skip the images
     * too large to decode quickly (a header tells). */
    int which = (s[0] >> 4) & 3;
    if (which == 0) {
        kpl__img_info info;
        const int raw[3] = {0, 0, 0};
        if (kpl__img_open(dec, parts[0].p, parts[0].n, "", raw, "fuzz", &info) == KPL_OK &&
            (int64_t)info.width * info.height > max_pixels)
            return 0;
    }
    sample(s, parts, np);
    return 0;
}
