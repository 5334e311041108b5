/*
 * convert_impl.h — what the image converters share (convert_folder.c,
 * convert_coco.c, convert_voc.c, synth_det.c): reading an image file and
 * checking it whole with the loader's own decoder, on several threads; a
 * bad item reported as an error or, under skip_bad, as a warning; small
 * text files written next to a dataset; IDX files (synth_det.c reads
 * Fashion-MNIST with convert_idx.c's reader); and the detection sets'
 * writer (convert_det.c), which the COCO and VOC converters fill.
 */
#ifndef KPL_CONVERT_IMPL_H
#define KPL_CONVERT_IMPL_H

#include "transform_impl.h"

#include <zlib.h>

/* One converting thread's decoder, resizer and JPEG encoder. */
typedef struct kpl__codec kpl__codec;

/* The codec's JPEG compressor (a tjhandle), for converters that encode. */
void *kpl__codec_encoder(kpl__codec *c);

/* An image file as read and checked. */
typedef struct {
    uint8_t *bytes;     /* the file's bytes (or their re-encoded form), malloc'd */
    size_t len;
    kpl__img_info info; /* its kind and size (after a JPEG's EXIF orientation) */
    char why[320];      /* non-empty: the file is bad, and why */
    bool fatal;         /* not the file's fault (no memory): skip_bad does not apply */
} kpl__loaded_image;

/* Reads `path` and checks that it is a JPEG or PNG that decodes whole with
 * the loader's decoder (kpl__img_check).  A JPEG whose longer side exceeds
 * max_side (> 0) is re-encoded at that side with `quality` (see
 * kpl_convert_imagefolder).  Never fails: problems go to l->why.  c may be
 * NULL (no codec could be made): then l says so, as fatal. */
void kpl__load_image(const char *path, int max_side, int quality, kpl__codec *c,
                     kpl__loaded_image *l);

/* A segmentation mask file as read and checked. */
typedef struct {
    uint8_t *bytes; /* what to store: the file's bytes, or, for a 16-bit gray PNG, the
                     * same values re-encoded as an 8-bit gray PNG; malloc'd */
    size_t len;
    int width, height;
    char why[480]; /* non-empty: the file is bad, and why */
    bool fatal;    /* not the file's fault (no memory) */
} kpl__loaded_mask;

/* Reads `path` and checks that it is a mask the loader reads
 * (kpl__mask_decode: a 1-channel PNG, gray up to 16 bits or palette, every
 * value <= 255) of width x height pixels, and, when num_classes > 0, that
 * every value is a class (< num_classes) or 255 (ignore).  A size that
 * differs names both files (`image`, the image's path) and both sizes.
 * Never fails: problems go to l->why.  c may be NULL (fatal, as for
 * images). */
void kpl__load_mask(const char *path, const char *image, int width, int height,
                    int64_t num_classes, kpl__codec *c, kpl__loaded_mask *l);

/* An 8-bit gray PNG of pix (h, w) u8, deterministic bytes, malloc'd. */
kpl_status kpl__png_encode_gray(const uint8_t *pix, int w, int h, uint8_t **out, size_t *len);

/* Sorted names of the entries of `dir` that are directories (want_dirs)
 * or regular .jpg/.jpeg/.png files (not hidden); *out and each name
 * malloc'd.  `what` prefixes errors (KPL_ENOTFOUND for a missing dir). */
kpl_status kpl__list_dir(const char *what, const char *dir, bool want_dirs, char ***out,
                         int64_t *n);

/* Runs work(i, codec, ctx) for every i in [0, n) on `threads` OpenMP
 * threads (<= 0: the OpenMP default), each with a codec of its own (NULL
 * when it could not be made).  Blocks until all are done. */
void kpl__convert_parallel(int64_t n, int threads,
                           void (*work)(int64_t i, kpl__codec *c, void *ctx), void *ctx);

/* A bad item (an image, an annotation), described by the formatted text:
 * with o->skip_bad and !fatal, a warning "kpl: skipping <text>" on stderr,
 * counted in *nskip, and KPL_OK; otherwise KPL_EFORMAT (KPL_ENOMEM when
 * fatal) with the text as its message. */
kpl_status kpl__convert_bad(const kpl_convert_options *o, bool fatal, int64_t *nskip,
                            const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* Writes `text` to out_dir/name (through name.tmp, fsync'd, renamed). */
kpl_status kpl__write_text(const char *out_dir, const char *name, const char *text, size_t len);
/* Writes n lines, one a line, to out_dir/name the same way. */
kpl_status kpl__write_lines(const char *out_dir, const char *name, char *const *lines,
                            int64_t n);

/* ---- IDX files (convert_idx.c): a big-endian header, then u8 values ---- */
typedef struct {
    gzFile f;
    const char *path;
    int ndim;
    int64_t dims[4];
} kpl__idx_file;
/* Opens an IDX file of u8 values with want_ndim dimensions (gzip or not). */
kpl_status kpl__idx_open(kpl__idx_file *x, const char *path, int want_ndim);
/* Reads n bytes of values; `what` names them in errors. */
kpl_status kpl__idx_read(kpl__idx_file *x, void *buf, size_t n, const char *what);

/* ---- detection sets (convert_det.c) ---- */

/* One object of a detection set. */
typedef struct {
    float box[4];          /* x0, y0, x1, y1 in pixels, inside the image */
    float area;            /* < 0: to compute (the mask's pixels, else the box's area) */
    int64_t label;         /* contiguous class index */
    int64_t category_id;   /* the source's category id (COCO), else the label */
    int64_t annotation_id; /* the source's annotation id (COCO), else its index */
    int64_t flag;          /* COCO iscrowd, VOC difficult: 0 or 1 */
    const struct json_t *seg; /* COCO segmentation (checked), or NULL: no mask */
} kpl__det_obj;

/* One image of a detection set; its objects are objs[first, first + count). */
typedef struct {
    int64_t id;            /* COCO image id; VOC: line number in the split file, from 0 */
    char *file;            /* relative to the image directory, malloc'd */
    int64_t width, height; /* what the annotations say; 0: take the file's */
    int64_t first, count;
    int64_t skipped_objs;  /* its bad objects left out (skip_bad) */
    bool bad;              /* left out already (a bad entry, reported) */
} kpl__det_image;

typedef enum { KPL__DET_COCO, KPL__DET_VOC } kpl__det_kind;

typedef struct {
    kpl__det_kind kind;
    const char *image_dir;     /* files are image_dir/file */
    kpl__det_image *images;    /* in the order they are written */
    int64_t nimages;
    kpl__det_obj *objs;
    int64_t nobjs;
    char **classes;            /* class names by label (num_classes of them) */
    int64_t num_classes;
    const char *attributes;    /* METADATA attributes (JSON object text) */
    const char *categories_json; /* COCO: OUT/categories.json's text, or NULL */
} kpl__det_set;

/* Checks every image of s whole (in parallel, with o->threads), compares
 * its size with the annotations', builds the COCO masks, and writes one
 * example per image (docs/kplrecord.md, "Detection examples"), then
 * classes.txt (and categories.json).  Bad images are errors or, under
 * skip_bad, skipped with a warning; *stats (may be NULL) gets the counts;
 * its skipped_* members must hold the counts of earlier phases. */
kpl_status kpl__det_write(const kpl__det_set *s, const char *out_dir,
                          const kpl_convert_options *o, kpl_detection_stats *stats);

/* ---- segmentation sets (convert_seg.c) ---- */

/* One example of a segmentation set: its image and mask files. */
typedef struct {
    char *image, *mask; /* paths, malloc'd */
    char *path;         /* what the `path` feature holds (relative to the source), malloc'd */
} kpl__seg_item;

typedef struct {
    const char *src;           /* "voc-seg", "masks": prefixes messages */
    kpl__seg_item *items;      /* in the order they are written */
    int64_t n;
    char *const *classes;      /* class names by value (num_classes), or NULL: no classes.txt
                                * and no value check */
    int64_t num_classes;
    const char *attributes;    /* METADATA attributes (JSON object text) */
} kpl__seg_set;

/* Checks every image (kpl__load_image, no re-encoding; an EXIF orientation
 * other than 1 is bad: the mask is of the stored pixels) and its mask
 * (kpl__load_mask) in parallel, and writes one example per item
 * (docs/segmentation-data.md): image, mask, path, height, width; then
 * classes.txt.  Bad items are errors or, under skip_bad, skipped with a
 * warning (counted in *skipped). */
kpl_status kpl__seg_write(const kpl__seg_set *s, const char *out_dir,
                          const kpl_convert_options *o, int64_t *count, int64_t *skipped);

/* Whether seg (a COCO segmentation value; NULL or null: none) is valid for
 * an h x w image, with polygon points at most `tol` pixels outside it; on
 * failure why[n] says what is wrong.  *parts receives the number of usable
 * parts (0: no mask); *dropped counts polygon parts of fewer than 3 points
 * (or an odd number of coordinates), which are left out. */
bool kpl__coco_seg_check(const struct json_t *seg, int64_t h, int64_t w, double tol,
                         int64_t *parts, int64_t *dropped, char *why, size_t n);

#endif /* KPL_CONVERT_IMPL_H */
