/*
 * transform.c — the DataTransformer's per-sample work (docs/transforms.md):
 * choose the crop, decode only what it needs (image_decode.c), resize with
 * PIL's antialiased bilinear filter, then flip, jitter, normalize and
 * transpose to CHW in one pass; boxes and masks follow the same geometry.
 *
 * The resize is separable and in fixed point: per-output weights (14
 * fractional bits, summing to exactly 1) are computed once per sample and
 * held in the scratch, the vertical pass runs first over whole input rows
 * (contiguous, vectorized) into a 16-bit row with 6 fractional bits, and
 * the horizontal pass then only touches the out_h rows that remain.
 * Integer arithmetic keeps the result the same on every CPU, whichever
 * clone of the loops it runs.
 */
#include "transform_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define KPL_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define KPL_CLONES
#endif

#define WBITS 14   /* weight fraction bits */
#define LINE_PAD 16 /* zeroed elements after each plane line: SIMD loads may run over */
#define MAX_SIDE 16384

/* One axis of a resize: output i reads inputs start[i] .. start[i] + taps
 * (relative to lo) with weights w[i * taps ...]; [lo, hi) is what the axis
 * reads of its input. */
typedef struct {
    int n, taps, lo, hi;
    int *start, *cnt;
    int16_t *w;
    int16_t *w8; /* taps <= 8: the weights padded to 8 per output, for the SIMD pass */
    double *wd;  /* one output's weights before quantization */
    size_t cap_n, cap_cnt, cap_w, cap_w8, cap_wd;
} axis;

struct kpl__xform_scratch {
    kpl__decoder *dec;
    kpl__decoder *mdec; /* scale_crop with cat_max_ratio: the mask, decoded before the image
                         * (made on first use) */
    axis ax, ay;
    uint16_t *line;  /* (w * C) its result */
    uint16_t *plane; /* (C, w + LINE_PAD) the same, one channel after the other */
    size_t line_cap, plane_cap;
    const uint8_t **rows;
    size_t rows_cap;
    uint8_t *img; /* (C, out_h, out_w) after the resize */
    size_t img_cap;
};

static kpl_status grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return KPL_OK;
    size_t n = need + need / 4 + 16;
    void *q = realloc(*p, n * elem);
    KPL_CHECK(q, KPL_ENOMEM, "transform: no memory for %zu bytes", n * elem);
    *p = q;
    *cap = n;
    return KPL_OK;
}

kpl__xform_scratch *kpl__xform_scratch_create(void)
{
    kpl__xform_scratch *s = calloc(1, sizeof *s);
    if (!s) {
        KPL_ERROR(KPL_ENOMEM, "transform scratch: no memory");
        return NULL;
    }
    s->dec = kpl__decoder_create();
    if (!s->dec) {
        free(s);
        return NULL;
    }
    return s;
}

static void axis_free(axis *a)
{
    free(a->start);
    free(a->cnt);
    free(a->w);
    free(a->w8);
    free(a->wd);
}

void kpl__xform_scratch_destroy(kpl__xform_scratch *s)
{
    if (!s) return;
    kpl__decoder_destroy(s->dec);
    kpl__decoder_destroy(s->mdec);
    axis_free(&s->ax);
    axis_free(&s->ay);
    free(s->line);
    free(s->plane);
    free(s->rows);
    free(s->img);
    free(s);
}

/* ---- init -------------------------------------------------------------------------- */

KPL_ENUM_DEFINE(kpl_crop_mode, KPL_CROP_MODES)

static kpl_status find(const kpl_dataset *ds, const char *field, const char *name,
                       kpl_feature_type type, int *idx)
{
    *idx = -1;
    if (!name || !*name) return KPL_OK;
    int i = kpl_dataset_find_feature(ds, name);
    if (i < 0) {
        /* naming what the set has: a set without labels (--from images)
         * read by a task that wants them is the likely case */
        char have[512];
        int at = 0;
        for (int k = 0; k < kpl_dataset_num_features(ds) && at < (int)sizeof have; k++)
            at += snprintf(have + at, sizeof have - (size_t)at, "%s%s", k ? ", " : "",
                           kpl_dataset_feature(ds, k)->name);
        return KPL_ERROR(KPL_EINVAL, "transform: %s '%s' is not a feature of %s (it has: %s)",
                         field, name, kpl_dataset_path(ds), have);
    }
    kpl_feature_type t = kpl_dataset_feature(ds, i)->type;
    KPL_CHECK(t == type, KPL_EINVAL, "transform: %s '%s' is %s, not %s", field, name,
              kpl_feature_type_name(t), kpl_feature_type_name(type));
    *idx = i;
    return KPL_OK;
}

static bool known_encoding(const char *e, bool mask)
{
    return !*e || !strcmp(e, "png") || !strcmp(e, "raw") || (!mask && !strcmp(e, "jpeg"));
}

static kpl_status check_sizes(kpl__xform *x, const kpl_transform_config *cfg, const char *image_name);

kpl_status kpl__xform_init(kpl__xform *x, const kpl_transform_config *cfg, const kpl_dataset *ds)
{
    KPL_CHECK(x && cfg && ds, KPL_EINVAL, "transform: NULL argument");
    memset(x, 0, sizeof *x);
    x->cfg = *cfg;
    KPL_CHECK(cfg->image_feature && *cfg->image_feature, KPL_EINVAL,
              "transform: image_feature is not set");
    KPL_TRY(find(ds, "image_feature", cfg->image_feature, KPL_FEATURE_BYTES, &x->image));
    KPL_TRY(find(ds, "label_feature", cfg->label_feature, KPL_FEATURE_INT64, &x->label));
    KPL_TRY(find(ds, "boxes_feature", cfg->boxes_feature, KPL_FEATURE_FLOAT, &x->boxes));
    KPL_TRY(find(ds, "box_labels_feature", cfg->box_labels_feature, KPL_FEATURE_INT64,
                 &x->box_labels));
    KPL_TRY(find(ds, "mask_feature", cfg->mask_feature, KPL_FEATURE_BYTES, &x->mask));
    KPL_TRY(find(ds, "box_ignore_feature", cfg->box_ignore_feature, KPL_FEATURE_INT64,
                 &x->box_ignore));
    KPL_CHECK(x->box_labels < 0 || x->boxes >= 0, KPL_EINVAL,
              "transform: box_labels_feature '%s' without boxes_feature", cfg->box_labels_feature);
    KPL_CHECK(x->box_ignore < 0 || x->boxes >= 0, KPL_EINVAL,
              "transform: box_ignore_feature '%s' without boxes_feature", cfg->box_ignore_feature);
    if (x->boxes >= 0)
        KPL_CHECK(cfg->max_boxes >= 1 && cfg->max_boxes <= 65536, KPL_EINVAL,
                  "transform: max_boxes %lld is not in [1, 65536]", (long long)cfg->max_boxes);

    const kpl_feature_spec *im = kpl_dataset_feature(ds, x->image);
    KPL_CHECK(known_encoding(im->encoding, false), KPL_EINVAL,
              "transform: image feature '%s' has encoding '%s' (want jpeg, png, raw or empty)",
              im->name, im->encoding);
    x->raw_shape = -1;
    if (!strcmp(im->encoding, "raw") && im->ndim == 0) {
        /* Raw images of differing sizes (an LMDB of raw Datums): each record
         * says its own (H, W, C). */
        char name[KPL_FEATURE_NAME_MAX + 8];
        snprintf(name, sizeof name, "%s_shape", im->name);
        int f = kpl_dataset_find_feature(ds, name);
        KPL_CHECK(f >= 0 && kpl_dataset_feature(ds, f)->type == KPL_FEATURE_INT64, KPL_EINVAL,
                  "transform: raw image feature '%s' has no fixed shape (H, W, C) and no int64 "
                  "feature '%s' giving each record's", im->name, name);
        x->raw_shape = f;
    } else if (!strcmp(im->encoding, "raw")) {
        bool ok = (im->ndim == 3 && (im->shape[2] == 1 || im->shape[2] == 3)) || im->ndim == 2;
        KPL_CHECK(ok && im->shape[0] >= 1 && im->shape[0] <= MAX_SIDE && im->shape[1] >= 1 &&
                      im->shape[1] <= MAX_SIDE,
                  KPL_EINVAL, "transform: raw image feature '%s' needs a fixed shape (H, W, C) "
                  "with C 1 or 3 and sides up to %d", im->name, MAX_SIDE);
        x->raw_h = (int)im->shape[0];
        x->raw_w = (int)im->shape[1];
        x->raw_c = im->ndim == 3 ? (int)im->shape[2] : 1;
    }
    if (x->mask >= 0) {
        const kpl_feature_spec *m = kpl_dataset_feature(ds, x->mask);
        KPL_CHECK(known_encoding(m->encoding, true), KPL_EINVAL,
                  "transform: mask feature '%s' has encoding '%s' (want png, raw or empty)",
                  m->name, m->encoding);
    }

    return check_sizes(x, cfg, im->name);
}

/* The numbers of cfg and the output size (x's features resolved). */
static kpl_status check_sizes(kpl__xform *x, const kpl_transform_config *cfg, const char *image_name)
{
    KPL_CHECK(cfg->channels == 1 || cfg->channels == 3, KPL_EINVAL,
              "transform: channels is %d, not 1 or 3", cfg->channels);
    x->out_c = cfg->channels;
    KPL_CHECK(cfg->out_h >= 0 && cfg->out_h <= MAX_SIDE && cfg->out_w >= 0 &&
                  cfg->out_w <= MAX_SIDE,
              KPL_EINVAL, "transform: out_h x out_w %d x %d is not in [0, %d]", cfg->out_h,
              cfg->out_w, MAX_SIDE);
    switch (cfg->crop) {
    case KPL_CROP_NONE:
        KPL_CHECK((cfg->out_h > 0) == (cfg->out_w > 0), KPL_EINVAL,
                  "transform: out_h and out_w must both be set or both 0");
        if (cfg->out_h == 0) {
            KPL_CHECK(x->raw_h > 0, KPL_EINVAL,
                      "transform: crop none with out_h = out_w = 0 keeps the stored size, so "
                      "image feature '%s' must be raw with a fixed shape", image_name);
            x->out_h = x->raw_h;
            x->out_w = x->raw_w;
        } else {
            x->out_h = cfg->out_h;
            x->out_w = cfg->out_w;
        }
        break;
    case KPL_CROP_RANDOM_RESIZED:
        KPL_CHECK(cfg->out_h > 0 && cfg->out_w > 0, KPL_EINVAL,
                  "transform: random-resized crop needs out_h and out_w");
        KPL_CHECK(isfinite(cfg->scale[0]) && isfinite(cfg->scale[1]) && cfg->scale[0] > 0 &&
                      cfg->scale[0] <= cfg->scale[1],
                  KPL_EINVAL, "transform: scale [%g, %g] must satisfy 0 < scale[0] <= scale[1]",
                  cfg->scale[0], cfg->scale[1]);
        KPL_CHECK(isfinite(cfg->ratio[0]) && isfinite(cfg->ratio[1]) && cfg->ratio[0] > 0 &&
                      cfg->ratio[0] <= cfg->ratio[1],
                  KPL_EINVAL, "transform: ratio [%g, %g] must satisfy 0 < ratio[0] <= ratio[1]",
                  cfg->ratio[0], cfg->ratio[1]);
        x->out_h = cfg->out_h;
        x->out_w = cfg->out_w;
        break;
    case KPL_CROP_CENTER:
        KPL_CHECK(cfg->out_h > 0 && cfg->out_w > 0, KPL_EINVAL,
                  "transform: center crop needs out_h and out_w");
        KPL_CHECK(cfg->resize_shorter >= cfg->out_h && cfg->resize_shorter >= cfg->out_w &&
                      cfg->resize_shorter <= MAX_SIDE,
                  KPL_EINVAL, "transform: resize_shorter %d must be at least out_h and out_w "
                  "(%d, %d) and at most %d", cfg->resize_shorter, cfg->out_h, cfg->out_w,
                  MAX_SIDE);
        x->out_h = cfg->out_h;
        x->out_w = cfg->out_w;
        break;
    case KPL_CROP_KEEP_RATIO:
        KPL_CHECK(cfg->out_h == 0 && cfg->out_w == 0, KPL_EINVAL,
                  "transform: keep_ratio takes each sample's size from short_sides and max_side; "
                  "out_h x out_w (%d x %d) must be 0", cfg->out_h, cfg->out_w);
        KPL_CHECK(cfg->num_short_sides >= 1 && cfg->num_short_sides <= KPL_SHORT_SIDES_MAX,
                  KPL_EINVAL, "transform: keep_ratio needs 1 to %d short_sides, got %d",
                  KPL_SHORT_SIDES_MAX, cfg->num_short_sides);
        for (int i = 0; i < cfg->num_short_sides; i++)
            KPL_CHECK(cfg->short_sides[i] >= 0 && cfg->short_sides[i] <= MAX_SIDE, KPL_EINVAL,
                      "transform: short_sides[%d] %d is not in [0, %d] (0: the stored size)", i,
                      cfg->short_sides[i], MAX_SIDE);
        KPL_CHECK(cfg->max_side >= 1 && cfg->max_side <= MAX_SIDE, KPL_EINVAL,
                  "transform: keep_ratio needs max_side in [1, %d], got %d", MAX_SIDE,
                  cfg->max_side);
        KPL_CHECK(cfg->size_divisor >= 0 && cfg->size_divisor <= 1024, KPL_EINVAL,
                  "transform: size_divisor %d is not in [0, 1024]", cfg->size_divisor);
        KPL_CHECK(cfg->mask_pad >= 0 && cfg->mask_pad <= 255, KPL_EINVAL,
                  "transform: mask_pad %d is not in [0, 255]", cfg->mask_pad);
        x->out_h = x->out_w = kpl_transform_canvas_side(cfg);
        break;
    case KPL_CROP_SCALE_CROP:
        KPL_CHECK(cfg->out_h > 0 && cfg->out_w > 0, KPL_EINVAL,
                  "transform: scale_crop needs out_h and out_w (the crop size)");
        KPL_CHECK(isfinite(cfg->scale_range[0]) && isfinite(cfg->scale_range[1]) &&
                      cfg->scale_range[0] > 0 && cfg->scale_range[0] <= cfg->scale_range[1] &&
                      cfg->scale_range[1] <= 16,
                  KPL_EINVAL, "transform: scale_range [%g, %g] must satisfy 0 < lo <= hi <= 16",
                  cfg->scale_range[0], cfg->scale_range[1]);
        KPL_CHECK(cfg->resize_shorter >= 0 && cfg->resize_shorter <= MAX_SIDE, KPL_EINVAL,
                  "transform: resize_shorter %d is not in [0, %d] (0: the stored size)",
                  cfg->resize_shorter, MAX_SIDE);
        KPL_CHECK(cfg->mask_pad >= 0 && cfg->mask_pad <= 255, KPL_EINVAL,
                  "transform: mask_pad %d is not in [0, 255]", cfg->mask_pad);
        KPL_CHECK(cfg->cat_max_ratio >= 0 && cfg->cat_max_ratio <= 1, KPL_EINVAL,
                  "transform: cat_max_ratio %g is not in [0, 1]", cfg->cat_max_ratio);
        KPL_CHECK(cfg->cat_max_ratio <= 0 || cfg->cat_max_ratio >= 1 || x->mask >= 0,
                  KPL_EINVAL, "transform: cat_max_ratio %g needs mask_feature (it counts the "
                  "mask's classes in each crop)", cfg->cat_max_ratio);
        x->out_h = cfg->out_h;
        x->out_w = cfg->out_w;
        break;
    default:
        return KPL_ERROR(KPL_EINVAL, "transform: crop mode %d is unknown", (int)cfg->crop);
    }
    KPL_CHECK(cfg->flip_prob >= 0 && cfg->flip_prob <= 1, KPL_EINVAL,
              "transform: flip_prob %g is not in [0, 1]", cfg->flip_prob);
    const float jit[3] = {cfg->brightness, cfg->contrast, cfg->saturation};
    static const char *jn[3] = {"brightness", "contrast", "saturation"};
    for (int i = 0; i < 3; i++)
        KPL_CHECK(jit[i] >= 0 && jit[i] <= 1e6f, KPL_EINVAL, "transform: %s %g is not >= 0",
                  jn[i], jit[i]);
    KPL_CHECK(cfg->out_dtype == KPL_F32 || cfg->out_dtype == KPL_U8, KPL_EINVAL,
              "transform: out_dtype %s is not f32 or u8", kpl_dtype_name(cfg->out_dtype));
    if (cfg->out_dtype == KPL_F32)
        for (int c = 0; c < x->out_c; c++)
            KPL_CHECK(isfinite(cfg->mean[c]) && isfinite(cfg->std[c]) && cfg->std[c] != 0,
                      KPL_EINVAL, "transform: mean[%d] %g / std[%d] %g (std must be nonzero)", c,
                      cfg->mean[c], c, cfg->std[c]);
    return KPL_OK;
}

int kpl_transform_canvas_side(const kpl_transform_config *cfg)
{
    if (!cfg || cfg->crop != KPL_CROP_KEEP_RATIO || cfg->max_side < 1) return 0;
    int d = cfg->size_divisor > 1 ? cfg->size_divisor : 1;
    return (cfg->max_side + d - 1) / d * d;
}

void kpl__keep_ratio_size(int w, int h, int s, int max_side, int *out_w, int *out_h)
{
    double lo = w < h ? w : h, hi = w < h ? h : w;
    double scale = fmin(s > 0 ? s / lo : 1.0, max_side / hi);
    /* Python's int(x + 0.5) on a positive x, as mmcv's _scale_size. */
    int ow = (int)floor(w * scale + 0.5), oh = (int)floor(h * scale + 0.5);
    *out_w = ow < 1 ? 1 : ow > max_side ? max_side : ow;
    *out_h = oh < 1 ? 1 : oh > max_side ? max_side : oh;
}

size_t kpl__xform_image_bytes(const kpl__xform *x)
{
    return (size_t)x->out_c * (size_t)x->out_h * (size_t)x->out_w *
           kpl_dtype_size(x->cfg.out_dtype);
}

size_t kpl__xform_mask_bytes(const kpl__xform *x)
{
    return x->mask < 0 ? 0 : (size_t)x->out_h * (size_t)x->out_w;
}

/* ---- random-resized crop ------------------------------------------------------------- */

void kpl__rrc_params(kpl__rng *r, int w, int h, const float scale[2], const float ratio[2],
                     int *x, int *y, int *cw, int *ch)
{
    double area = (double)w * (double)h;
    double lr0 = log((double)ratio[0]), lr1 = log((double)ratio[1]);
    for (int attempt = 0; attempt < 10; attempt++) {
        double ta = area * (scale[0] + (scale[1] - scale[0]) * kpl__rng_uniform(r));
        double ar = exp(lr0 + (lr1 - lr0) * kpl__rng_uniform(r));
        /* rint rounds half to even, as Python's round does. */
        double fw = rint(sqrt(ta * ar)), fh = rint(sqrt(ta / ar));
        if (fw > 0 && fw <= w && fh > 0 && fh <= h) {
            *cw = (int)fw;
            *ch = (int)fh;
            *y = (int)kpl__rng_below(r, (uint64_t)(h - *ch) + 1);
            *x = (int)kpl__rng_below(r, (uint64_t)(w - *cw) + 1);
            return;
        }
    }
    /* Fallback: the whole image, center-cropped to the nearest allowed ratio. */
    double in_ratio = (double)w / (double)h;
    int fw = w, fh = h;
    if (in_ratio < ratio[0]) {
        fh = (int)rint(w / (double)ratio[0]);
    } else if (in_ratio > ratio[1]) {
        fw = (int)rint(h * (double)ratio[1]);
    }
    if (fw < 1) fw = 1;
    if (fh < 1) fh = 1;
    if (fw > w) fw = w;
    if (fh > h) fh = h;
    *cw = fw;
    *ch = fh;
    *x = (w - fw) / 2;
    *y = (h - fh) / 2;
}

/* ---- resize ------------------------------------------------------------------------- */

/* PIL's precompute_coeffs for the bilinear (triangle) filter: output i is
 * centered at in0 + (i + 0.5) * scale; when shrinking the support widens by
 * the scale (antialiasing).  Taps are clamped to [clo, chi).  The weights
 * are quantized to WBITS with their sum made exact (a flat image stays
 * flat), zero taps at the ends are trimmed, and every output is padded to
 * the same tap count, its window shifted left where it would pass hi. */
KPL_CLONES static kpl_status axis_compute(axis *a, double in0, double scale, int n, int clo,
                                         int chi)
{
    double fs = scale > 1 ? scale : 1, support = fs, ifs = 1 / fs;
    int tmax = (int)ceil(support) * 2 + 1;
    KPL_TRY(grow((void **)&a->start, &a->cap_n, (size_t)n, sizeof(int)));
    KPL_TRY(grow((void **)&a->cnt, &a->cap_cnt, (size_t)n, sizeof(int)));
    KPL_TRY(grow((void **)&a->w, &a->cap_w, (size_t)n * (size_t)tmax, sizeof(int16_t)));
    KPL_TRY(grow((void **)&a->wd, &a->cap_wd, (size_t)tmax, sizeof(double)));
    int lo = chi, hi = clo, taps = 1;
    for (int i = 0; i < n; i++) {
        double center = in0 + (i + 0.5) * scale;
        int xmin = (int)floor(center - support + 0.5), xmax = (int)floor(center + support + 0.5);
        if (xmin < clo) xmin = clo;
        if (xmax > chi) xmax = chi;
        if (xmax <= xmin) { /* only for a center outside [clo, chi): the nearest pixel */
            xmin = center < clo ? clo : chi - 1;
            xmax = xmin + 1;
        }
        int k = xmax - xmin;
        if (k > tmax) k = tmax;
        double *wd = a->wd, ww = 0;
        for (int j = 0; j < k; j++) {
            double t = fabs((j + xmin - center + 0.5) * ifs);
            wd[j] = t < 1 ? 1 - t : 0;
            ww += wd[j];
        }
        int16_t *w = a->w + (size_t)i * tmax;
        int sum = 0, big = 0;
        double norm = (ww > 0 ? 1 / ww : 0) * (1 << WBITS);
        for (int j = 0; j < k; j++) {
            w[j] = (int16_t)(ww > 0 ? lrint(wd[j] * norm) : (1 << WBITS) / k);
            sum += w[j];
            if (w[j] > w[big]) big = j;
        }
        w[big] = (int16_t)(w[big] + ((1 << WBITS) - sum));
        int f = 0, l = k - 1;
        while (f < l && w[f] == 0) f++;
        while (l > f && w[l] == 0) l--;
        if (f > 0)
            for (int j = f; j <= l; j++) w[j - f] = w[j];
        a->start[i] = xmin + f;
        a->cnt[i] = k = l - f + 1;
        if (k > taps) taps = k;
        if (xmin + f < lo) lo = xmin + f;
        if (xmin + f + k > hi) hi = xmin + f + k;
    }
    for (int i = 0; i < n; i++) {
        int16_t *src = a->w + (size_t)i * tmax, *w = a->w + (size_t)i * taps;
        int k = a->cnt[i], s0 = a->start[i], sh = s0 + taps > hi ? s0 + taps - hi : 0;
        /* Compacting to stride `taps` moves weights down (taps <= tmax),
         * so a forward copy never overwrites what it has yet to read
         * except within one row, which memmove handles. */
        memmove(w + sh, src, (size_t)k * sizeof(int16_t));
        for (int j = 0; j < sh; j++) w[j] = 0;
        for (int j = sh + k; j < taps; j++) w[j] = 0;
        a->start[i] = s0 - sh - lo;
    }
    if (taps <= 8) {
        KPL_TRY(grow((void **)&a->w8, &a->cap_w8, (size_t)n * 8, sizeof(int16_t)));
        for (int i = 0; i < n; i++)
            for (int j = 0; j < 8; j++) a->w8[8 * i + j] = j < taps ? a->w[(size_t)i * taps + j] : 0;
    }
    a->n = n;
    a->taps = taps;
    a->lo = lo;
    a->hi = hi;
    return KPL_OK;
}

static bool axis_identity(const axis *a)
{
    if (a->taps != 1) return false;
    for (int i = 0; i < a->n; i++)
        if (a->start[i] != i) return false;
    return true;
}

/* The vertical pass: line[i] = sum_k w[k] * rows[k][i] with 6 fraction
 * bits, in 16-bit arithmetic: each term is the high half of (x << 8) times
 * the weight in 16 bits (Q14 << 2, 1.0 capped to 65535), so a term is
 * x * w * 256 truncated, the sum at most 255 * 256, and the final >> 2
 * leaves 6 fraction bits.  The truncations cost under T / 256 of a level,
 * far below the final rounding; scalar and SIMD code compute the same
 * numbers. */
static inline uint16_t vweight(int16_t w14)
{
    int w = w14 * 4;
    return (uint16_t)(w > 65535 ? 65535 : w);
}

static void vpass_scalar(const uint8_t *const *rows, const int16_t *w, int taps, int from,
                         int len, uint16_t *restrict line)
{
    uint16_t wk[64];
    int T = taps < 64 ? taps : 64;
    for (int k = 0; k < T; k++) wk[k] = vweight(w[k]);
    for (int i = from; i < len; i++) {
        uint32_t sum = 0;
        for (int k = 0; k < T; k++) sum += ((uint32_t)rows[k][i] << 8) * wk[k] >> 16;
        for (int k = T; k < taps; k++) sum += ((uint32_t)rows[k][i] << 8) * vweight(w[k]) >> 16;
        line[i] = (uint16_t)(sum >> 2);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PASSES 1
__attribute__((target("avx2"))) static void vpass_avx2(const uint8_t *const *rows,
                                                       const int16_t *w, int taps, int len,
                                                       uint16_t *restrict line)
{
    const __m256i zero = _mm256_setzero_si256();
    for (int i = 0; i < len; i += 32) {
        /* The last block overlaps the one before: same numbers, no tail. */
        if (i + 32 > len) i = len - 32;
        __m256i lo = zero, hi = zero;
        for (int k = 0; k < taps; k++) {
            __m256i wk = _mm256_set1_epi16((short)vweight(w[k]));
            __m256i x = _mm256_loadu_si256((const __m256i *)(rows[k] + i));
            /* unpack with zero below: x << 8 in 16 bits (lanes interleave
             * the same way for lo and hi, undone at the store) */
            lo = _mm256_add_epi16(lo, _mm256_mulhi_epu16(_mm256_unpacklo_epi8(zero, x), wk));
            hi = _mm256_add_epi16(hi, _mm256_mulhi_epu16(_mm256_unpackhi_epi8(zero, x), wk));
        }
        lo = _mm256_srli_epi16(lo, 2);
        hi = _mm256_srli_epi16(hi, 2);
        /* lo = elements [0..8) and [16..24), hi = [8..16) and [24..32) */
        _mm256_storeu_si256((__m256i *)(line + i), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)(line + i + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
}
#endif

static void vpass(const uint8_t *const *rows, const int16_t *w, int taps, int len,
                  uint16_t *restrict line)
{
#ifdef HAVE_AVX2_PASSES
    if (len >= 32 && __builtin_cpu_supports("avx2")) {
        vpass_avx2(rows, w, taps, len, line);
        return;
    }
#endif
    vpass_scalar(rows, w, taps, 0, len, line);
}

static inline uint8_t clip8(int32_t v)
{
    v >>= 20;
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* The normalization of dataio.h, (x/255 - mean) / std, written out as it
 * reads: the vector code below computes the same IEEE operations, so every
 * path gives the same bits (division is as fast as a table lookup here). */
static inline float normalize(float v, float mean, float std) { return (v / 255.0f - mean) / std; }

/* Where the horizontal pass writes one output row of one channel: u8, or
 * f32 normalized with mean and std; mirrored when flip. */
typedef struct {
    void *row;
    bool f32, flip;
    float mean, std;
} hsink;

static inline void sink_put(const hsink *k, int n, int x, int32_t acc)
{
    uint8_t v = clip8(acc);
    int at = k->flip ? n - 1 - x : x;
    if (k->f32)
        ((float *)k->row)[at] = normalize(v, k->mean, k->std);
    else
        ((uint8_t *)k->row)[at] = v;
}

/* The horizontal pass over one channel's line: outputs [from, n). */
static void hpass_scalar(const uint16_t *line, const axis *a, int from, const hsink *k)
{
    const int T = a->taps;
    for (int x = from; x < a->n; x++) {
        const int16_t *w = a->w + (size_t)x * T;
        const uint16_t *p = line + a->start[x];
        int32_t v = 1 << 19;
        for (int j = 0; j < T; j++) v += w[j] * p[j];
        sink_put(k, a->n, x, v);
    }
}

#ifdef HAVE_AVX2_PASSES
/* Eight outputs at a time for taps <= 8: each output's 8 inputs (one
 * unaligned 128-bit load; the line is padded) times its 8 padded weights
 * with pmaddwd, two outputs per register, then horizontal adds.  Line
 * values (< 2^14) and weights (<= 2^14) fit int16, sums int32.  The
 * results are normalized and stored, mirrored when flipping, right away. */
__attribute__((target("avx2"))) static void hpass_avx2(const uint16_t *line, const axis *a,
                                                       const hsink *k)
{
    const int n = a->n, n8 = n & ~7;
    const __m256i round = _mm256_set1_epi32(1 << 19), zero = _mm256_setzero_si256();
    const __m256i top = _mm256_set1_epi32(255);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i rev = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const __m128i rev8 = _mm_setr_epi8(7, 6, 5, 4, 3, 2, 1, 0, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256 c255 = _mm256_set1_ps(255.0f), mean = _mm256_set1_ps(k->mean);
    const __m256 std = _mm256_set1_ps(k->std);
    for (int x = 0; x < n8; x += 8) {
        const int *st = a->start + x;
        const int16_t *w = a->w8 + (size_t)x * 8;
        __m256i m[4];
        for (int j = 0; j < 4; j++) {
            __m128i lo = _mm_loadu_si128((const __m128i *)(line + st[2 * j]));
            __m128i hi = _mm_loadu_si128((const __m128i *)(line + st[2 * j + 1]));
            __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
            m[j] = _mm256_madd_epi16(v, _mm256_loadu_si256((const __m256i *)(w + 16 * j)));
        }
        /* m[j] = [out 2j: 4 partial sums | out 2j+1: 4 partial sums] */
        __m256i h01 = _mm256_hadd_epi32(m[0], m[1]), h23 = _mm256_hadd_epi32(m[2], m[3]);
        __m256i h = _mm256_hadd_epi32(h01, h23); /* [o0 o2 o4 o6 | o1 o3 o5 o7] */
        h = _mm256_permutevar8x32_epi32(h, order);
        h = _mm256_srai_epi32(_mm256_add_epi32(h, round), 20);
        h = _mm256_min_epi32(_mm256_max_epi32(h, zero), top);
        int at = k->flip ? n - 8 - x : x;
        if (k->f32) {
            if (k->flip) h = _mm256_permutevar8x32_epi32(h, rev);
            __m256 f = _mm256_div_ps(_mm256_cvtepi32_ps(h), c255);
            f = _mm256_div_ps(_mm256_sub_ps(f, mean), std);
            _mm256_storeu_ps((float *)k->row + at, f);
        } else {
            __m128i p16 = _mm_packus_epi32(_mm256_castsi256_si128(h),
                                           _mm256_extracti128_si256(h, 1));
            __m128i p8 = _mm_packus_epi16(p16, p16);
            if (k->flip) p8 = _mm_shuffle_epi8(p8, rev8);
            _mm_storel_epi64((__m128i *)((uint8_t *)k->row + at), p8);
        }
    }
    hpass_scalar(line, a, n8, k);
}
#endif

static void hpass(const uint16_t *line, const axis *a, const hsink *k)
{
#ifdef HAVE_AVX2_PASSES
    if (a->taps <= 8 && __builtin_cpu_supports("avx2")) {
        hpass_avx2(line, a, k);
        return;
    }
#endif
    hpass_scalar(line, a, 0, k);
}

/* One interleaved line of n pixels to three planes (vectorized by the
 * compiler in the x86-64-v3 clone). */
KPL_CLONES static void split3_u16(const uint16_t *restrict p, uint16_t *restrict r,
                                  uint16_t *restrict g, uint16_t *restrict b, int n)
{
    for (int i = 0; i < n; i++) {
        r[i] = p[3 * i];
        g[i] = p[3 * i + 1];
        b[i] = p[3 * i + 2];
    }
}

KPL_CLONES static void split3_u8(const uint8_t *restrict p, uint8_t *restrict r,
                                 uint8_t *restrict g, uint8_t *restrict b, int n)
{
    for (int i = 0; i < n; i++) {
        r[i] = p[3 * i];
        g[i] = p[3 * i + 1];
        b[i] = p[3 * i + 2];
    }
}

/* Resizes src, which holds exactly [ax.lo, ax.hi) x [ay.lo, ay.hi) of the
 * input, to planes (c, ay.n, ax.n): u8 at `out`, or, when `norm` is not
 * NULL, f32 normalized with its mean and std at `outf`; mirrored when
 * `flip`. */
static kpl_status resize_run(kpl__xform_scratch *s, const kpl__img_view *src, uint8_t *out,
                             float *outf, const kpl_transform_config *norm, bool flip)
{
    const axis *ax = &s->ax, *ay = &s->ay;
    const int c = src->c, ow = ax->n, oh = ay->n, rw = src->w;
    const size_t plane = (size_t)ow * oh;
    size_t len = (size_t)rw * (size_t)c, pl = (size_t)rw + LINE_PAD;
    KPL_TRY(grow((void **)&s->line, &s->line_cap, len + LINE_PAD, sizeof(uint16_t)));
    KPL_TRY(grow((void **)&s->plane, &s->plane_cap, 3 * pl, sizeof(uint16_t)));
    KPL_TRY(grow((void **)&s->rows, &s->rows_cap, (size_t)ay->taps, sizeof(uint8_t *)));
    for (int k = 0; k < 3; k++) memset(s->plane + k * pl + rw, 0, LINE_PAD * sizeof(uint16_t));
    memset(s->line + len, 0, LINE_PAD * sizeof(uint16_t));
    for (int y = 0; y < oh; y++) {
        const int16_t *wy = ay->w + (size_t)y * ay->taps;
        for (int k = 0; k < ay->taps; k++)
            s->rows[k] = src->data + (size_t)(ay->start[y] + k) * src->stride;
        vpass(s->rows, wy, ay->taps, (int)len, s->line);
        if (c == 3) split3_u16(s->line, s->plane, s->plane + pl, s->plane + 2 * pl, rw);
        for (int k = 0; k < c; k++) {
            size_t o = k * plane + (size_t)y * ow;
            hsink sk = {norm ? (void *)(outf + o) : (void *)(out + o), norm != NULL, flip,
                        norm ? norm->mean[k] : 0, norm ? norm->std[k] : 1};
            hpass(c == 3 ? s->plane + k * pl : s->line, ax, &sk);
        }
    }
    return KPL_OK;
}

/* src (its window [ax.lo, ...) x [ay.lo, ...)) to planes (c, ay.n, ax.n)
 * u8 at out: the resize, or a copy when both axes are the identity. */
static kpl_status resize_to_planes(kpl__xform_scratch *s, const kpl__img_view *src, uint8_t *out)
{
    const int c = src->c, ow = s->ax.n, oh = s->ay.n;
    const size_t plane = (size_t)ow * oh;
    if (axis_identity(&s->ax) && axis_identity(&s->ay)) {
        for (int y = 0; y < oh; y++) {
            const uint8_t *row = src->data + (size_t)y * src->stride;
            uint8_t *o = out + (size_t)y * ow;
            if (c == 3)
                split3_u8(row, o, o + plane, o + 2 * plane, ow);
            else
                memcpy(o, row, (size_t)ow);
        }
        return KPL_OK;
    }
    return resize_run(s, src, out, NULL, NULL, false);
}

kpl_status kpl__resize(kpl__xform_scratch *s, const kpl__img_view *src, double x0, double y0,
                       double bw, double bh, int out_w, int out_h, uint8_t *out)
{
    KPL_TRY(axis_compute(&s->ax, x0, bw / out_w, out_w, 0, src->w));
    KPL_TRY(axis_compute(&s->ay, y0, bh / out_h, out_h, 0, src->h));
    kpl__img_view v = {src->data + (size_t)s->ay.lo * src->stride + (size_t)s->ax.lo * src->c,
                       s->ax.hi - s->ax.lo, s->ay.hi - s->ay.lo, src->c, src->stride};
    const size_t plane = (size_t)out_w * out_h, n = plane * src->c;
    KPL_TRY(grow((void **)&s->img, &s->img_cap, n, 1));
    KPL_TRY(resize_to_planes(s, &v, s->img));
    for (size_t i = 0; i < plane; i++)
        for (int k = 0; k < src->c; k++) out[i * src->c + k] = s->img[k * plane + i];
    return KPL_OK;
}

/* ---- flip, jitter, normalize, CHW ------------------------------------------------ */

static inline float clamp255(float v) { return v < 0 ? 0 : v > 255 ? 255 : v; }

/* torchvision's grayscale weights (ITU-R 601) on 0..255 values. */
static inline float gray3(const float *v) { return 0.299f * v[0] + 0.587f * v[1] + 0.114f * v[2]; }

/* One plane row normalized, mirrored or not (vectorized by the compiler). */
KPL_CLONES static void norm_row(const uint8_t *restrict src, float mean, float std,
                                float *restrict d, int n, bool flip)
{
    if (flip)
        for (int i = 0; i < n; i++) d[i] = normalize(src[n - 1 - i], mean, std);
    else
        for (int i = 0; i < n; i++) d[i] = normalize(src[i], mean, std);
}

/* The last pass: img (C, H, W) u8 to out (C, H, W), mirrored when `flip`,
 * jittered by factors jb, jc, js (1: off) in that order, then normalized
 * (f32) or rounded (u8). */
static void emit(const kpl__xform *x, const uint8_t *img, int H, int W, bool flip, float jb,
                 float jc, float js, void *dst)
{
    const int C = x->out_c;
    const size_t plane = (size_t)H * W;
    const bool f32 = x->cfg.out_dtype == KPL_F32;
    const bool jitter = jb != 1 || jc != 1 || (js != 1 && C == 3);
    if (!jitter) {
        for (int c = 0; c < C; c++)
            for (int y = 0; y < H; y++) {
                size_t o = c * plane + (size_t)y * W;
                const uint8_t *row = img + o;
                if (f32) {
                    norm_row(row, x->cfg.mean[c], x->cfg.std[c], (float *)dst + o, W, flip);
                } else {
                    uint8_t *d = (uint8_t *)dst + o;
                    if (flip)
                        for (int i = 0; i < W; i++) d[i] = row[W - 1 - i];
                    else
                        memcpy(d, row, (size_t)W);
                }
            }
        return;
    }
    /* Contrast blends with the mean gray level of the image as brightness
     * left it, so that mean needs a pass of its own. */
    float mean = 0;
    if (jc != 1) {
        double sum = 0;
        for (size_t i = 0; i < plane; i++) {
            float v[3];
            for (int c = 0; c < C; c++) v[c] = clamp255(jb * img[c * plane + i]);
            sum += C == 3 ? gray3(v) : v[0];
        }
        mean = (float)(sum / (double)plane);
    }
    for (int y = 0; y < H; y++)
        for (int i = 0; i < W; i++) {
            size_t at = (size_t)y * W + (size_t)(flip ? W - 1 - i : i);
            float v[3];
            for (int c = 0; c < C; c++) v[c] = img[c * plane + at];
            if (jb != 1)
                for (int c = 0; c < C; c++) v[c] = clamp255(jb * v[c]);
            if (jc != 1)
                for (int c = 0; c < C; c++) v[c] = clamp255(jc * v[c] + (1 - jc) * mean);
            if (js != 1 && C == 3) {
                float g = gray3(v);
                for (int c = 0; c < C; c++) v[c] = clamp255(js * v[c] + (1 - js) * g);
            }
            size_t o = (size_t)y * W + (size_t)i;
            for (int c = 0; c < C; c++) {
                if (f32)
                    ((float *)dst)[c * plane + o] = normalize(v[c], x->cfg.mean[c], x->cfg.std[c]);
                else
                    ((uint8_t *)dst)[c * plane + o] = (uint8_t)(v[c] + 0.5f);
            }
        }
}

/* ---- one sample ---------------------------------------------------------------------- */

static float jitter_factor(float amount, double u)
{
    if (amount <= 0) return 1.0f;
    double lo = amount < 1 ? 1.0 - amount : 0.0, hi = 1.0 + amount;
    return (float)(lo + (hi - lo) * u);
}

/* Boxes of the stored image through the crop box (bx, by, bw, bh), the
 * resize to OW x OH and the flip: clipped, empty ones and flagged ones
 * (box_ignore_feature) dropped.  More stored
 * boxes than max_boxes is an error, not a truncation: which boxes a loss
 * sees must not depend on their order in the file. */
static kpl_status do_boxes(const kpl__xform *x, const kpl_feature_value *values, double bx,
                           double by, double bw, double bh, int OW, int OH, bool flip,
                           const char *where, const kpl__sample_out *out)
{
    const kpl_feature_value *fb = &values[x->boxes];
    KPL_CHECK(fb->count % 4 == 0, KPL_EFORMAT, "%s: %u box values, not a multiple of 4", where,
              fb->count);
    uint32_t n = fb->count / 4;
    if (x->box_labels >= 0)
        KPL_CHECK(values[x->box_labels].count == n, KPL_EFORMAT,
                  "%s: %u box labels for %u boxes", where, values[x->box_labels].count, n);
    if (x->box_ignore >= 0)
        KPL_CHECK(values[x->box_ignore].count == n, KPL_EFORMAT,
                  "%s: %u box ignore flags (%s) for %u boxes", where, values[x->box_ignore].count,
                  x->cfg.box_ignore_feature, n);
    const int64_t M = x->cfg.max_boxes;
    /* KPL_EINVAL, not KPL_EFORMAT: the file is fine, the configuration is
     * too small for it, so skip_corrupt does not drop the sample. */
    KPL_CHECK(n <= M, KPL_EINVAL, "%s: %u boxes, more than max_boxes %lld (raise max_boxes to "
              "the most boxes an example holds; in a recipe data.<split>.max_boxes)", where, n,
              (long long)M);
    const float W = (float)OW, H = (float)OH;
    const double sx = OW / bw, sy = OH / bh;
    int64_t kept = 0;
    for (uint32_t i = 0; i < n; i++) {
        float b[4];
        memcpy(b, (const uint8_t *)fb->data + 16 * (size_t)i, 16);
        if (x->box_ignore >= 0) {
            int64_t flag;
            memcpy(&flag, (const uint8_t *)values[x->box_ignore].data + 8 * (size_t)i, 8);
            if (flag) continue;
        }
        float x0 = (float)((b[0] - bx) * sx), x1 = (float)((b[2] - bx) * sx);
        float y0 = (float)((b[1] - by) * sy), y1 = (float)((b[3] - by) * sy);
        x0 = fminf(fmaxf(x0, 0), W);
        x1 = fminf(fmaxf(x1, 0), W);
        y0 = fminf(fmaxf(y0, 0), H);
        y1 = fminf(fmaxf(y1, 0), H);
        if (!(x1 > x0 && y1 > y0)) continue; /* also drops NaN */
        if (flip) {
            float t = W - x1;
            x1 = W - x0;
            x0 = t;
        }
        if (out->boxes) {
            float *o = out->boxes + 4 * kept;
            o[0] = x0, o[1] = y0, o[2] = x1, o[3] = y1;
        }
        if (out->box_labels) {
            int64_t l = -1;
            if (x->box_labels >= 0) memcpy(&l, (const uint8_t *)values[x->box_labels].data + 8 * (size_t)i, 8);
            out->box_labels[kept] = l;
        }
        kept++;
    }
    if (out->boxes) memset(out->boxes + 4 * kept, 0, (size_t)(M - kept) * 4 * sizeof(float));
    if (out->box_labels)
        for (int64_t k = kept; k < M; k++) out->box_labels[k] = -1;
    if (out->num_boxes) *out->num_boxes = kept;
    return KPL_OK;
}

/* Nearest-neighbour: output pixel centers mapped into the stored image,
 * written as (H, W). */
static void do_mask(const kpl__img_view *m, double bx, double by, double bw, double bh, int H,
                    int W, bool flip, kpl__xform_scratch *s, uint8_t *out)
{
    int *col = s->ax.start; /* reuse: resize is done; sized >= W */
    for (int i = 0; i < W; i++) {
        int sx = (int)floor(bx + (i + 0.5) * bw / W);
        col[flip ? W - 1 - i : i] = sx < 0 ? 0 : sx >= m->w ? m->w - 1 : sx;
    }
    for (int y = 0; y < H; y++) {
        int sy = (int)floor(by + (y + 0.5) * bh / H);
        sy = sy < 0 ? 0 : sy >= m->h ? m->h - 1 : sy;
        const uint8_t *row = m->data + (size_t)sy * m->stride;
        uint8_t *o = out + (size_t)y * W;
        for (int i = 0; i < W; i++) o[i] = row[col[i]];
    }
}

/* scale_crop: the padding of a crop smaller than the output.  buf holds
 * `planes` planes of h x w elements of es bytes, densely; they are spread
 * to planes of H x W (H >= h, W >= w), each at the top left, the rest of
 * plane c filled with the es bytes at pad + c * es.  In place, back to
 * front: a row's destination is never below its source, and the padding
 * of a plane is written only where every source row still to be moved
 * lies below it. */
static void pad_planes(uint8_t *buf, size_t es, int planes, int h, int w, int H, int W,
                       const uint8_t *pad)
{
    const size_t rw = (size_t)w * es, RW = (size_t)W * es;
    for (int c = planes - 1; c >= 0; c--) {
        const uint8_t *pv = pad + (size_t)c * es;
        uint8_t *plane = buf + (size_t)c * H * RW;
        for (size_t at = (size_t)h * RW; at < (size_t)H * RW; at += es) memcpy(plane + at, pv, es);
        for (int y = h - 1; y >= 0; y--) {
            uint8_t *d = plane + (size_t)y * RW;
            memmove(d, buf + ((size_t)c * h + (size_t)y) * rw, rw);
            for (size_t at = rw; at < RW; at += es) memcpy(d + at, pv, es);
        }
    }
}

/* Whether no mask class but 255 (ignore) covers cat_max_ratio or more of
 * the crop (bx, by, bw, bh) read at vw x vh with do_mask's sampling, and
 * it holds two classes or more (mmsegmentation's RandomCrop test). */
static bool crop_classes_ok(const kpl__img_view *m, double bx, double by, double bw, double bh,
                            int vw, int vh, float ratio)
{
    int64_t hist[256] = {0};
    for (int j = 0; j < vh; j++) {
        int sy = (int)floor(by + (j + 0.5) * bh / vh);
        sy = sy < 0 ? 0 : sy >= m->h ? m->h - 1 : sy;
        const uint8_t *row = m->data + (size_t)sy * m->stride;
        for (int i = 0; i < vw; i++) {
            int sx = (int)floor(bx + (i + 0.5) * bw / vw);
            hist[row[sx < 0 ? 0 : sx >= m->w ? m->w - 1 : sx]]++;
        }
    }
    int64_t most = 0, sum = 0;
    int classes = 0;
    for (int k = 0; k < 255; k++) {
        classes += hist[k] > 0;
        sum += hist[k];
        if (hist[k] > most) most = hist[k];
    }
    return classes > 1 && (double)most < (double)ratio * (double)sum;
}

/* scale_crop's geometry for a W x H image: the factor, then the crop's
 * top and left in the scaled image (redrawn under cat_max_ratio, which
 * decodes the mask into *m first, *have_mask then true).  Gives the crop
 * box in stored pixels and the part of the output it fills, vw x vh. */
static kpl_status scale_crop_params(const kpl__xform *x, const kpl_feature_value *values, int W,
                                    int H, kpl__rng *r, kpl__xform_scratch *s, const char *mwhere,
                                    kpl__img_view *m, bool *have_mask, double box[4], int *vw,
                                    int *vh)
{
    const kpl_transform_config *cfg = &x->cfg;
    const int OW = x->out_w, OH = x->out_h;
    double f = cfg->scale_range[0] +
               (cfg->scale_range[1] - cfg->scale_range[0]) * kpl__rng_uniform(r);
    double t = f * (cfg->resize_shorter > 0 ? (double)cfg->resize_shorter / (W < H ? W : H) : 1);
    /* each side floor(side * t + 0.5), at least 1 (as keep_ratio's sizes) */
    int sw = (int)floor(W * t + 0.5), sh = (int)floor(H * t + 0.5);
    sw = sw < 1 ? 1 : sw;
    sh = sh < 1 ? 1 : sh;
    const bool retry = cfg->cat_max_ratio > 0 && cfg->cat_max_ratio < 1 && x->mask >= 0;
    if (retry) {
        if (!s->mdec && !(s->mdec = kpl__decoder_create())) return kpl_last_status();
        const kpl_feature_value *mv = &values[x->mask];
        KPL_TRY(kpl__mask_decode(s->mdec, mv->data, mv->count, "", W, H, mwhere, m));
        *have_mask = true;
    }
    for (int attempt = 0;; attempt++) {
        int cy = (int)kpl__rng_below(r, (uint64_t)(sh > OH ? sh - OH : 0) + 1);
        int cx = (int)kpl__rng_below(r, (uint64_t)(sw > OW ? sw - OW : 0) + 1);
        *vw = sw - cx < OW ? sw - cx : OW;
        *vh = sh - cy < OH ? sh - cy : OH;
        box[0] = (double)cx * W / sw, box[1] = (double)cy * H / sh;
        box[2] = (double)*vw * W / sw, box[3] = (double)*vh * H / sh;
        if (!retry || attempt == 10 ||
            crop_classes_ok(m, box[0], box[1], box[2], box[3], *vw, *vh, cfg->cat_max_ratio))
            return KPL_OK;
    }
}

/* The stored (H, W, C) of a raw image: the schema's, or this record's own
 * '<image>_shape' feature. */
static kpl_status raw_dims(const kpl__xform *x, const kpl_feature_value *values,
                           const char *where, int raw[3])
{
    raw[0] = x->raw_h, raw[1] = x->raw_w, raw[2] = x->raw_c;
    if (x->raw_shape < 0) return KPL_OK;
    const kpl_feature_value *sv = &values[x->raw_shape];
    int64_t d[3] = {0, 0, 1};
    KPL_CHECK(sv->count == 2 || sv->count == 3, KPL_EFORMAT, "%s: its '%s_shape' has %u "
              "values, not (H, W, C)", where, x->cfg.image_feature, sv->count);
    memcpy(d, sv->data, 8 * (size_t)sv->count);
    KPL_CHECK(d[0] >= 1 && d[0] <= MAX_SIDE && d[1] >= 1 && d[1] <= MAX_SIDE &&
                  (d[2] == 1 || d[2] == 3),
              KPL_EFORMAT, "%s: raw image of shape (%lld, %lld, %lld): want sides of 1 to %d "
              "and 1 or 3 channels", where, (long long)d[0], (long long)d[1], (long long)d[2],
              MAX_SIDE);
    raw[0] = (int)d[0], raw[1] = (int)d[1], raw[2] = (int)d[2];
    return KPL_OK;
}

/* scale_crop: a crop of OH x OW that does not fill the output is padded
 * (bottom, right): the image with the mean, the mask with mask_pad. */
static void pad_short_crop(const kpl__xform *x, int OH, int OW, const kpl__sample_out *out)
{
    const kpl_transform_config *cfg = &x->cfg;
    if (out->image) {
        const bool f32 = cfg->out_dtype == KPL_F32;
        uint8_t pad[3 * sizeof(float)];
        for (int c = 0; c < x->out_c; c++) {
            if (f32) {
                float z = 0; /* (mean - mean) / std */
                memcpy(pad + c * sizeof z, &z, sizeof z);
            } else {
                float v = cfg->mean[c] * 255.0f + 0.5f;
                pad[c] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
            }
        }
        pad_planes(out->image, f32 ? sizeof(float) : 1, x->out_c, OH, OW, x->out_h, x->out_w,
                   pad);
    }
    if (x->mask >= 0 && out->mask) {
        uint8_t mp = (uint8_t)cfg->mask_pad;
        pad_planes(out->mask, 1, 1, OH, OW, x->out_h, x->out_w, &mp);
    }
}

kpl_status kpl__xform_sample(const kpl__xform *x, const kpl_feature_value *values, uint64_t seed,
                             int64_t epoch, int64_t example, kpl__xform_scratch *s,
                             const kpl__sample_out *out)
{
    const kpl_transform_config *cfg = &x->cfg;
    char where[160], mw[160];
    snprintf(where, sizeof where, "example %lld, feature '%s'", (long long)example,
             cfg->image_feature);
    snprintf(mw, sizeof mw, "example %lld, feature '%s'", (long long)example,
             cfg->mask_feature ? cfg->mask_feature : "");
    const kpl_feature_value *iv = &values[x->image];
    int raw[3];
    KPL_TRY(raw_dims(x, values, where, raw));
    kpl__img_info info;
    /* Raw was resolved at init; JPEG and PNG are told apart by their
     * signatures whatever the schema's hint says. */
    KPL_TRY(kpl__img_open(s->dec, iv->data, iv->count, raw[0] > 0 ? "raw" : "", raw, where,
                          &info));
    const int W = info.width, H = info.height;
    int OW = x->out_w, OH = x->out_h;

    /* The draws, in this order: flip, brightness, contrast, saturation, then
     * the crop's (docs/transforms.md). */
    kpl__rng r = kpl__rng_key(seed, (uint64_t)epoch, (uint64_t)example);
    bool flip = kpl__rng_uniform(&r) < cfg->flip_prob;
    float jb = jitter_factor(cfg->brightness, kpl__rng_uniform(&r));
    float jc = jitter_factor(cfg->contrast, kpl__rng_uniform(&r));
    float js = jitter_factor(cfg->saturation, kpl__rng_uniform(&r));

    /* The crop box in stored pixels, and the range its filter may read. */
    double bx = 0, by = 0, bw = W, bh = H;
    bool clamp_to_box = false, have_mask = false;
    kpl__img_view pre_mask = {0};
    if (cfg->crop == KPL_CROP_RANDOM_RESIZED) {
        int cx, cy, cw, ch;
        kpl__rrc_params(&r, W, H, cfg->scale, cfg->ratio, &cx, &cy, &cw, &ch);
        bx = cx, by = cy, bw = cw, bh = ch;
        clamp_to_box = true; /* torchvision crops, then resizes the crop */
    } else if (cfg->crop == KPL_CROP_CENTER) {
        /* torchvision: Resize(S) (shorter side to S, the longer truncated),
         * then CenterCrop; one resample from the stored image does both. */
        int S = cfg->resize_shorter, rw, rh;
        if (W <= H)
            rw = S, rh = (int)((int64_t)S * H / W);
        else
            rh = S, rw = (int)((int64_t)S * W / H);
        double top = rint((rh - OH) / 2.0), left = rint((rw - OW) / 2.0);
        double fx = (double)W / rw, fy = (double)H / rh;
        bx = left * fx, by = top * fy, bw = OW * fx, bh = OH * fy;
    } else if (cfg->crop == KPL_CROP_KEEP_RATIO) {
        /* The whole image at this sample's own size. */
        int n = cfg->num_short_sides;
        int k = n > 1 ? (int)kpl__rng_below(&r, (uint64_t)n) : 0;
        kpl__keep_ratio_size(W, H, cfg->short_sides[k], cfg->max_side, &OW, &OH);
    } else if (cfg->crop == KPL_CROP_SCALE_CROP) {
        /* Resize-then-crop, done as one resample of the crop's box: the
         * filter reads past the box as the whole-image resize would. */
        double b[4] = {0, 0, W, H};
        KPL_TRY(scale_crop_params(x, values, W, H, &r, s, mw, &pre_mask, &have_mask, b, &OW,
                                  &OH));
        bx = b[0], by = b[1], bw = b[2], bh = b[3];
    }

    /* DCT-domain scaling: the strongest that leaves the crop at least the
     * output size. */
    int denom = 1;
    if (info.kind == KPL__IMG_JPEG)
        for (int d = 8; d >= 2; d /= 2)
            if (bw >= (double)d * OW && bh >= (double)d * OH) {
                denom = d;
                break;
            }
    int sw, sh;
    kpl__img_scaled_size(&info, denom, &sw, &sh);
    double fx = (double)sw / W, fy = (double)sh / H;
    int clo_x = 0, chi_x = sw, clo_y = 0, chi_y = sh;
    if (clamp_to_box) {
        clo_x = (int)floor(bx * fx), chi_x = (int)ceil((bx + bw) * fx);
        clo_y = (int)floor(by * fy), chi_y = (int)ceil((by + bh) * fy);
        if (chi_x > sw) chi_x = sw;
        if (chi_y > sh) chi_y = sh;
    }
    KPL_TRY(axis_compute(&s->ax, bx * fx, bw * fx / OW, OW, clo_x, chi_x));
    KPL_TRY(axis_compute(&s->ay, by * fy, bh * fy / OH, OH, clo_y, chi_y));

    kpl__img_view v;
    KPL_TRY(kpl__img_decode(s->dec, denom, s->ax.lo, s->ay.lo, s->ax.hi - s->ax.lo,
                            s->ay.hi - s->ay.lo, x->out_c, &v));
    size_t npix = (size_t)OW * OH * x->out_c;
    KPL_TRY(grow((void **)&s->img, &s->img_cap, npix, 1));
    /* Without jitter (which needs the whole image first), the resize
     * writes the output itself: flip, normalization and the planar layout
     * happen as its last pass stores. */
    bool jitter = jb != 1 || jc != 1 || (js != 1 && x->out_c == 3);
    bool identity = axis_identity(&s->ax) && axis_identity(&s->ay);
    if (out->image && !jitter && !identity) {
        bool f32 = cfg->out_dtype == KPL_F32;
        KPL_TRY(resize_run(s, &v, f32 ? NULL : out->image, f32 ? out->image : NULL,
                           f32 ? cfg : NULL, flip));
    } else if (out->image) {
        KPL_TRY(resize_to_planes(s, &v, s->img));
        emit(x, s->img, OH, OW, flip, jb, jc, js, out->image);
    }
    if (out->size) out->size[0] = OH, out->size[1] = OW;
    if (out->orig_size) out->orig_size[0] = H, out->orig_size[1] = W;

    if (out->label && x->label >= 0) {
        KPL_CHECK(values[x->label].count >= 1, KPL_EFORMAT, "example %lld: label feature '%s' "
                  "is empty", (long long)example, cfg->label_feature);
        memcpy(out->label, values[x->label].data, 8);
    }
    if (x->boxes >= 0) {
        char bw_where[160];
        snprintf(bw_where, sizeof bw_where, "example %lld, feature '%s'", (long long)example,
                 cfg->boxes_feature);
        KPL_TRY(do_boxes(x, values, bx, by, bw, bh, OW, OH, flip, bw_where, out));
    }
    if (x->mask >= 0 && out->mask) {
        const kpl_feature_value *mv = &values[x->mask];
        kpl__img_view m = pre_mask;
        if (!have_mask) KPL_TRY(kpl__mask_decode(s->dec, mv->data, mv->count, "", W, H, mw, &m));
        do_mask(&m, bx, by, bw, bh, OH, OW, flip, s, out->mask);
    }
    if (cfg->crop == KPL_CROP_SCALE_CROP && (OW < x->out_w || OH < x->out_h))
        pad_short_crop(x, OH, OW, out);
    return KPL_OK;
}

kpl_status kpl_transform_image(const kpl_transform_config *cfg, const void *data, size_t n,
                               kpl_tensor *out)
{
    KPL_CHECK(cfg && data && out, KPL_EINVAL, "transform_image: NULL argument");
    kpl__xform x;
    memset(&x, 0, sizeof x);
    x.cfg = *cfg;
    x.cfg.image_feature = "image";
    x.cfg.label_feature = x.cfg.boxes_feature = x.cfg.box_labels_feature = NULL;
    x.cfg.mask_feature = x.cfg.box_ignore_feature = NULL;
    x.image = 0;
    x.label = x.boxes = x.box_labels = x.mask = x.box_ignore = x.raw_shape = -1;
    KPL_CHECK(cfg->crop != KPL_CROP_KEEP_RATIO && cfg->crop != KPL_CROP_SCALE_CROP &&
                  (cfg->crop != KPL_CROP_NONE || (cfg->out_h > 0 && cfg->out_w > 0)),
              KPL_EINVAL, "transform_image: crop '%s' %s", kpl_crop_mode_name(cfg->crop),
              cfg->crop == KPL_CROP_NONE ? "needs out_h and out_w (the size to resize to)"
                                         : "has no fixed output size");
    KPL_TRY(check_sizes(&x, &x.cfg, "image"));
    int64_t want[3] = {x.out_c, x.out_h, x.out_w};
    char b1[96], b2[96];
    KPL_CHECK(kpl_tensor_ndim(out) == 3 && !memcmp(kpl_tensor_shape(out), want, sizeof want) &&
                  kpl_tensor_dtype(out) == cfg->out_dtype &&
                  kpl_device_type_of(kpl_tensor_device(out)) == KPL_DEVICE_CPU,
              KPL_ESHAPE, "transform_image: out is %s %s, the transform makes %s %s on the CPU",
              kpl_dtype_name(kpl_tensor_dtype(out)),
              kpl_shape_str(kpl_tensor_ndim(out), kpl_tensor_shape(out), b1, sizeof b1),
              kpl_dtype_name(cfg->out_dtype), kpl_shape_str(3, want, b2, sizeof b2));
    kpl__xform_scratch *sc = kpl__xform_scratch_create();
    KPL_CHECK(sc, KPL_ENOMEM, "transform_image: no host memory");
    void *img = kpl_tensor_host_mutable(out);
    int64_t size[2], orig[2];
    kpl__sample_out so = {.image = img, .size = size, .orig_size = orig};
    kpl_feature_value v = {data, (uint32_t)(n > UINT32_MAX ? UINT32_MAX : n)};
    kpl_status st = img ? kpl__xform_sample(&x, &v, 0, 0, 0, sc, &so) : kpl_last_status();
    kpl__xform_scratch_destroy(sc);
    return st;
}

kpl_status kpl_transform_example(const kpl_transform_config *cfg, kpl_dataset *ds, int64_t example,
                                 kpl_chunk *chunk, kpl_tensor *out, int64_t *label)
{
    KPL_CHECK(cfg && ds && chunk && out, KPL_EINVAL, "transform_example: NULL argument");
    kpl__xform x;
    kpl_transform_config c = *cfg;
    if (!label) c.label_feature = NULL;
    c.boxes_feature = c.box_labels_feature = c.mask_feature = c.box_ignore_feature = NULL;
    KPL_TRY(kpl__xform_init(&x, &c, ds));
    KPL_CHECK(c.crop != KPL_CROP_KEEP_RATIO && c.crop != KPL_CROP_SCALE_CROP, KPL_EINVAL,
              "transform_example: crop '%s' has no fixed output size", kpl_crop_mode_name(c.crop));
    int64_t want[3] = {x.out_c, x.out_h, x.out_w};
    char b1[96], b2[96];
    KPL_CHECK(kpl_tensor_ndim(out) == 3 && !memcmp(kpl_tensor_shape(out), want, sizeof want) &&
                  kpl_tensor_dtype(out) == c.out_dtype &&
                  kpl_device_type_of(kpl_tensor_device(out)) == KPL_DEVICE_CPU,
              KPL_ESHAPE, "transform_example: out is %s %s, the transform makes %s %s on the CPU",
              kpl_dtype_name(kpl_tensor_dtype(out)),
              kpl_shape_str(kpl_tensor_ndim(out), kpl_tensor_shape(out), b1, sizeof b1),
              kpl_dtype_name(c.out_dtype), kpl_shape_str(3, want, b2, sizeof b2));
    KPL_CHECK(example >= 0 && example < kpl_dataset_num_examples(ds), KPL_ERANGE,
              "transform_example: example %lld of %lld", (long long)example,
              (long long)kpl_dataset_num_examples(ds));
    kpl_feature_value *values = calloc((size_t)kpl_dataset_num_features(ds), sizeof *values);
    kpl__xform_scratch *sc = kpl__xform_scratch_create();
    kpl_status st = values && sc ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "transform_example: no host memory");
    if (st == KPL_OK) st = kpl_dataset_read_example(ds, example, chunk, values);
    int64_t size[2], orig[2], lab = -1;
    void *img = st == KPL_OK ? kpl_tensor_host_mutable(out) : NULL;
    if (st == KPL_OK && !img) st = kpl_last_status();
    kpl__sample_out so = {.image = img, .size = size, .orig_size = orig,
                          .label = x.label >= 0 ? &lab : NULL};
    if (st == KPL_OK) st = kpl__xform_sample(&x, values, 0, 0, example, sc, &so);
    if (st == KPL_OK && label) *label = lab;
    free(values);
    kpl__xform_scratch_destroy(sc);
    return st;
}
