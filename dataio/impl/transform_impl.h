/*
 * transform_impl.h — the DataTransformer's per-sample work: image decoding
 * (JPEG region + DCT-scaled decode, PNG, raw pixels) and the augmentations
 * of kpl_transform_config, with box- and mask-aware geometry.  The loader
 * (loader.c) runs it in its worker processes; tests and benchmarks call it
 * directly.
 */
#ifndef KPL_TRANSFORM_IMPL_H
#define KPL_TRANSFORM_IMPL_H

#include "dataio_impl.h"

/* A transform resolved against a dataset's schema: feature indices and
 * the per-sample output sizes (fixed; for CROP_KEEP_RATIO the canvas, the
 * largest a sample can be).  Plain value, no resources. */
typedef struct {
    kpl_transform_config cfg; /* the strings point into the caller's config */
    int image, label, boxes, box_labels, mask, box_ignore; /* feature indices, -1: absent */
    int raw_h, raw_w, raw_c; /* the image feature's fixed shape when encoding is "raw" */
    int raw_shape;           /* raw without a fixed shape: the int64 feature "<image>_shape"
                              * holding each record's (H, W, C); -1 otherwise */
    int out_h, out_w, out_c; /* resolved output size; keep_ratio: the canvas */
} kpl__xform;

/* Resolves cfg against ds: finds the features (each missing or mistyped one
 * is KPL_EINVAL naming it), checks the numbers (channels 1 or 3, sizes,
 * ranges), fixes the output size.  Non-blocking. */
kpl_status kpl__xform_init(kpl__xform *x, const kpl_transform_config *cfg,
                           const kpl_dataset *ds);

/* Bytes of one sample's outputs (0 for an absent output). */
size_t kpl__xform_image_bytes(const kpl__xform *x); /* (out_c, out_h, out_w) of out_dtype */
size_t kpl__xform_mask_bytes(const kpl__xform *x);  /* (out_h, out_w) u8 */

/* CROP_KEEP_RATIO's output size for a w x h image and short side s:
 * scale = min(s / min(w, h), max_side / max(w, h)) (s 0: min(1, max_side /
 * max(w, h)), the stored size unless too large), each side
 * floor(side * scale + 0.5) (mmcv's rescale_size), at least 1. */
void kpl__keep_ratio_size(int w, int h, int s, int max_side, int *out_w, int *out_h);

/* Where one sample's outputs go (NULL for outputs the transform lacks).
 * Image and mask are written densely at the sample's own size (h, w):
 * (out_h, out_w), or for CROP_KEEP_RATIO its resized size, which `size`
 * receives. */
typedef struct {
    void *image;          /* (C, h, w) of cfg.out_dtype */
    int64_t *label;       /* (1): the label feature's first value */
    float *boxes;         /* (max_boxes, 4) x0,y0,x1,y1 in output pixels; unused rows 0 */
    int64_t *box_labels;  /* (max_boxes); unused -1 */
    int64_t *num_boxes;   /* (1) */
    uint8_t *mask;        /* (h, w), nearest-neighbour resampled */
    int64_t *size;        /* (2): h, w of the image and mask written */
    int64_t *orig_size;   /* (2): h, w of the stored image (after its EXIF orientation) */
} kpl__sample_out;

/* Per-process scratch memory (decode and resize buffers), grown on demand
 * and reused, so a steady state allocates nothing.  Not thread-safe: one
 * per worker. */
typedef struct kpl__xform_scratch kpl__xform_scratch;
kpl__xform_scratch *kpl__xform_scratch_create(void);
void kpl__xform_scratch_destroy(kpl__xform_scratch *s);

/* Decodes and transforms one example whose features are `values` (as
 * kpl_chunk_record gives them).  Randomness comes from
 * kpl__rng_key(seed, epoch, example) only.  A corrupt or unsupported image
 * returns KPL_EFORMAT with a message naming `example` and what is wrong;
 * outputs are then unspecified.  Blocking (CPU work only). */
kpl_status kpl__xform_sample(const kpl__xform *x, const kpl_feature_value *values,
                             uint64_t seed, int64_t epoch, int64_t example,
                             kpl__xform_scratch *s, const kpl__sample_out *out);

/* ---- internal: the pieces kpl__xform_sample is made of, exposed for the
 *      tests and the benchmark; not for other callers ---------------------- */

/* image_decode.c: one image's bytes to u8 pixels.  A decoder keeps libjpeg's
 * state and the decode buffers between images (one per worker, not
 * thread-safe).  The usage is open, then at most one region decode. */
typedef struct kpl__decoder kpl__decoder;
kpl__decoder *kpl__decoder_create(void);
void kpl__decoder_destroy(kpl__decoder *d); /* NULL is a no-op */

typedef enum { KPL__IMG_JPEG = 1, KPL__IMG_PNG, KPL__IMG_RAW } kpl__img_kind;

typedef struct {
    kpl__img_kind kind;
    int width, height; /* the image's size: a JPEG's after its EXIF orientation */
    int channels;      /* in the file: 1 gray, 2 gray+alpha, 3 color, 4 RGBA or CMYK/YCCK */
    int orientation;   /* the EXIF orientation applied (JPEG: 1-8), 1 for the rest */
} kpl__img_info;

/* Rows of w * c u8 pixels, `stride` bytes apart; borrowed from the decoder
 * (or from the raw bytes), valid until its next call. */
typedef struct {
    const uint8_t *data;
    int w, h, c;
    size_t stride;
} kpl__img_view;

/* Reads the header of `data` (n bytes).  `encoding` is the feature's hint:
 * "jpeg", "png", "raw" (then raw_hwc is its fixed (H, W, C)), or "" to
 * sniff JPEG / PNG from the bytes.  `where` ("example 7, feature 'image'")
 * prefixes every error message; the decoder keeps the pointer until the
 * decode.  KPL_EFORMAT for bytes that are not a readable image. */
kpl_status kpl__img_open(kpl__decoder *d, const void *data, size_t n, const char *encoding,
                         const int raw_hwc[3], const char *where, kpl__img_info *info);
/* The image's size when decoded at scale 1/denom (denom 1, 2, 4, 8; JPEG
 * only, other kinds have only 1): ceil(size / denom). */
void kpl__img_scaled_size(const kpl__img_info *info, int denom, int *w, int *h);
/* Decodes the window [x, x+w) x [y, y+h), in pixels of the image scaled by
 * 1/denom, to `channels` (1: gray, 3: RGB).  A JPEG decodes only that
 * window (cropped scanlines, skipped rows above, stopped after the last
 * row, DCT-domain scaling); the result equals the same window of a full
 * decode at that scale exactly, turned to the EXIF orientation (PIL's
 * exif_transpose of the scaled image). */
kpl_status kpl__img_decode(kpl__decoder *d, int denom, int x, int y, int w, int h, int channels,
                           kpl__img_view *out);
/* Checks the whole image after a successful open, as a converter must
 * before storing it: a JPEG's every scan is entropy decoded (at 1/8 scale:
 * every coefficient is read, the IDCT is cheap) and its markers read up to
 * EOI, a PNG is decoded to its IEND with every CRC checked.  KPL_EFORMAT
 * for anything the loader would refuse (libjpeg errors and data warnings,
 * a premature end, a missing EOI, a bad CRC).  The decoder stays open on
 * the image: kpl__img_decode may follow. */
kpl_status kpl__img_check(kpl__decoder *d);
/* Decodes a segmentation mask: a 1-channel PNG, gray of any bit depth or
 * palette (values as stored: no scaling, and a palette's indices, never
 * its colours), or raw (H, W) u8 bytes when encoding is "raw" (width,
 * height: the expected size).  A 16-bit gray value past 255 is KPL_EFORMAT
 * naming `where`, the value and its pixel: masks are u8 in batches. */
kpl_status kpl__mask_decode(kpl__decoder *d, const void *data, size_t n, const char *encoding,
                            int width, int height, const char *where, kpl__img_view *out);

/* transform.c: torchvision's RandomResizedCrop.get_params on a w x h image:
 * the crop (*x, *y, *cw, *ch) in pixels. */
void kpl__rrc_params(kpl__rng *r, int w, int h, const float scale[2], const float ratio[2],
                     int *x, int *y, int *cw, int *ch);
/* Antialiased bilinear resize (PIL's BILINEAR filter) of the source box
 * [x0, x0 + bw) x [y0, y0 + bh) of src (in src pixels, fractional allowed),
 * to out_w x out_h x src->c u8 (rows of out_w * c).  Filter taps are
 * clamped to [0, src->w) x [0, src->h).  Uses s's buffers. */
kpl_status kpl__resize(kpl__xform_scratch *s, const kpl__img_view *src, double x0, double y0,
                       double bw, double bh, int out_w, int out_h, uint8_t *out);

#endif /* KPL_TRANSFORM_IMPL_H */
