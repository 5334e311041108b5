/*
 * transform.h — the per-sample transforms (the DataTransformer's work): decode, crop,
 * resize, flip, colour jitter, normalise (docs/transforms.md).
 * (dataio.h includes every part of dataio/.)
 */
#ifndef KPL_TRANSFORM_H
#define KPL_TRANSFORM_H

#include "record.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- per-sample transforms (the DataTransformer's work) --------------------------- */

/* none: the whole image, resized to out_h x out_w if those are set;
 * random_resized: torchvision's RandomResizedCrop(scale, ratio);
 * center: the shorter side resized to resize_shorter, then a center crop;
 * keep_ratio: the whole image resized keeping its aspect ratio, the shorter
 * side to one of short_sides and the longer at most max_side (mmdetection's
 * Resize(keep_ratio=True), Detectron2's ResizeShortestEdge): each sample has
 * its own size, and the loader pads every batch (docs/transforms.md);
 * scale_crop: segmentation's training crop (mmsegmentation's RandomResize
 * with a ratio range, then RandomCrop and Pad): the image scaled by a
 * factor drawn from scale_range, then a random out_h x out_w crop, padded
 * bottom and right where the scaled image is smaller */
#define KPL_CROP_MODES(X)                                                               \
    X(KPL_CROP_NONE, "none") X(KPL_CROP_RANDOM_RESIZED, "random_resized")                \
    X(KPL_CROP_CENTER, "center") X(KPL_CROP_KEEP_RATIO, "keep_ratio")                    \
    X(KPL_CROP_SCALE_CROP, "scale_crop")
typedef enum { KPL_CROP_MODES(KPL_ENUM_VALUE) } kpl_crop_mode;

/* kpl_crop_mode_names (NULL-terminated), _name, _parse (-1 for others) */
KPL_ENUM_DECLARE(kpl_crop_mode);

#define KPL_SHORT_SIDES_MAX 8 /* values of kpl_transform_config.short_sides */

/* What happens to one example on its way into a batch.  Images are decoded
 * from the feature's encoding ("jpeg", "png", or "raw" with a fixed (H, W, C)
 * shape; an empty encoding is sniffed from the bytes), converted to
 * `channels`, cropped, resized (bilinear, antialiased when shrinking),
 * flipped, jittered, and written as CHW.  Every random choice derives from
 * (seed, epoch, example), never from the worker that runs it.  Boxes and
 * masks follow every crop, resize and flip (docs/transforms.md). */
typedef struct {
    const char *image_feature;      /* "image" */
    const char *label_feature;      /* "label"; NULL or "": no label output */
    const char *boxes_feature;      /* NULL: no boxes; else float list of 4n: x0,y0,x1,y1 in
                                     * pixels of the stored image */
    const char *box_labels_feature; /* NULL, or int64 list of n (with boxes) */
    const char *mask_feature;       /* NULL, or bytes: PNG or raw (H, W) u8, the image's size */
    int64_t max_boxes;              /* box rows per sample; an example that stores more boxes
                                     * is an error (KPL_EINVAL naming it), never truncated */
    int channels;                   /* 1 or 3 */
    kpl_crop_mode crop;
    int out_h, out_w;               /* output size; 0 with CROP_NONE: the stored size;
                                     * 0 with CROP_KEEP_RATIO (each sample has its own) */
    float scale[2], ratio[2];       /* random-resized-crop area and aspect ranges */
    int resize_shorter;             /* CROP_CENTER: shorter side before the crop;
                                     * CROP_SCALE_CROP: the base shorter side that the
                                     * factor scales (0: the stored size is the base) */
    float flip_prob;                /* horizontal flip probability */
    float brightness, contrast, saturation; /* jitter: factor uniform in [max(0,1-x), 1+x] */
    kpl_dtype out_dtype;            /* KPL_F32: (x/255 - mean) / std; KPL_U8: 0..255 */
    float mean[3], std[3];
    bool skip_corrupt; /* a sample that cannot be decoded (KPL_EFORMAT: libjpeg errors
                        * and data warnings, PNG CRC errors, oversized images, bad
                        * masks/boxes) is dropped from its batch, counted, and named in
                        * one warning line on stderr when its batch is handed out
                        * (example, shard, chunk, record, path or key), instead of
                        * failing the iterator */
    /* CROP_KEEP_RATIO: the shorter side becomes short_sides[k], k drawn
     * uniformly per sample (one value: always it), unless the longer side
     * would pass max_side: scale = min(s / short, max_side / long).  A
     * short side of 0 is the stored size: scale = min(1, max_side / long)
     * (whole-image evaluation at full resolution) */
    int short_sides[KPL_SHORT_SIDES_MAX];
    int num_short_sides;
    int max_side;
    int size_divisor; /* CROP_KEEP_RATIO batches are padded (bottom, right) to their
                       * largest height and width rounded up to a multiple of this;
                       * 0 or 1: not rounded */
    int mask_pad;     /* CROP_KEEP_RATIO and CROP_SCALE_CROP: the value of padded mask
                       * pixels (0..255; 255 for segmentation's "ignore").  Images are
                       * padded with the mean: 0 in f32 output, round(mean * 255) in u8 */
    const char *box_ignore_feature; /* NULL, or an int64 list of n flags (with boxes): a
                                     * box whose flag is not 0 is left out of the batch
                                     * (COCO's crowd regions, VOC's difficult objects,
                                     * which detectors do not train on) */
    /* CROP_SCALE_CROP: the scale factor is uniform in [scale_range[0],
     * scale_range[1]] (0 < lo <= hi <= 16).  cat_max_ratio in (0, 1)
     * (mmsegmentation's): a crop whose most frequent mask class (255, the
     * ignore value, not counted) covers this share of it or more, or that
     * holds one class only, is drawn again, up to 10 times (needs
     * mask_feature); 0 or 1: off */
    float scale_range[2];
    float cat_max_ratio;
} kpl_transform_config;
#define KPL_TRANSFORM_CONFIG_INIT                                                           \
    {"image", "label", NULL, NULL, NULL, 0, 3, KPL_CROP_NONE, 0, 0, {0.08f, 1.0f},           \
     {3.0f / 4.0f, 4.0f / 3.0f}, 0, 0.0f, 0.0f, 0.0f, 0.0f, KPL_F32, {0, 0, 0}, {1, 1, 1}, false, \
     {0}, 0, 0, 32, 0, NULL, {0.5f, 2.0f}, 0.0f}

/* The side of the square canvas that holds any CROP_KEEP_RATIO sample of
 * cfg: max_side rounded up to size_divisor; no batch is larger.  0 for the
 * other modes (their output size is fixed).  Pure. */
int kpl_transform_canvas_side(const kpl_transform_config *cfg);

/* One encoded image (JPEG or PNG, n bytes) through cfg, as the loader
 * would transform it, into out (C, out_h, out_w) of cfg's out_dtype on the
 * CPU: for inference on image files.  Crop none must name the size
 * (out_h, out_w); keep_ratio and scale_crop, whose size varies, are
 * KPL_EINVAL.  Random augmentations draw as for example 0 of epoch 0 of
 * seed 0.  KPL_EFORMAT for bytes that are not a readable image. */
kpl_status kpl_transform_image(const kpl_transform_config *cfg, const void *data, size_t n,
                               kpl_tensor *out);
/* The same for an example of a dataset (read into `chunk`), with its label
 * (the label feature's first value; -1 when it has none) into *label when
 * label is not NULL. */
kpl_status kpl_transform_example(const kpl_transform_config *cfg, kpl_dataset *ds, int64_t example,
                                 kpl_chunk *chunk, kpl_tensor *out, int64_t *label);

#ifdef __cplusplus
}
#endif
#endif /* KPL_TRANSFORM_H */
