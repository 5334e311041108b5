/*
 * convert.h — the converters into KPLRecord (IDX, image folders, LMDB, CIFAR, COCO,
 * Pascal VOC, image and mask folders), the synthetic detection and
 * segmentation sets, and the converters' records.
 * (dataio.h includes every part of dataio/.)
 */
#ifndef KPL_CONVERT_H
#define KPL_CONVERT_H

#include "record.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- converters ------------------------------------------------------------------- */

/* Where a dataset is converted from: nothing, IDX files (MNIST's format),
 * an image folder, an LMDB of Caffe Datums, COCO instances JSON, Pascal VOC
 * (detection), Pascal VOC's segmentation masks, a folder of images with a
 * folder of masks, CIFAR-10/100 (binary or python layout), a folder of
 * images without classes. */
#define KPL_CONVERT_SOURCES(X)                                                          \
    X(KPL_CONVERT_NONE, "none") X(KPL_CONVERT_IDX, "idx")                                \
    X(KPL_CONVERT_IMAGEFOLDER, "imagefolder") X(KPL_CONVERT_LMDB, "lmdb")                \
    X(KPL_CONVERT_COCO, "coco") X(KPL_CONVERT_VOC, "voc") X(KPL_CONVERT_VOC_SEG, "voc-seg") \
    X(KPL_CONVERT_MASKS, "masks") X(KPL_CONVERT_CIFAR, "cifar") X(KPL_CONVERT_IMAGES, "images")
typedef enum { KPL_CONVERT_SOURCES(KPL_ENUM_VALUE) } kpl_convert_source;
/* kpl_convert_source_names (NULL-terminated), _name, _parse (-1 for others) */
KPL_ENUM_DECLARE(kpl_convert_source);

/* Options shared by the converters; KPL_CONVERT_OPTIONS_INIT for defaults. */
typedef struct {
    kpl_record_writer_config writer;
    int threads;   /* reading/checking threads (0: the OpenMP default) */
    bool progress; /* a progress line on stderr (callers pass isatty(2)) */
    const char *label; /* what the progress line calls this job */
    bool keep_order;   /* imagefolder, images: keep the sorted walk order */
    uint64_t seed;     /* imagefolder, images: the order's shuffle seed */
    bool skip_bad;     /* imagefolder, images, coco, voc: skip bad images (and annotations)
                        * with a warning naming each, instead of failing */
    int max_side;      /* imagefolder, images: JPEGs with a longer side are decoded, resized
                        * (antialiased) to this longer side and re-encoded; 0: keep */
    int quality;       /* imagefolder, images: JPEG quality of re-encoded images (1..100) */
    /* Asked between records (or batches of images): true stops the
     * conversion with KPL_ECANCELED, its partial output removed.  NULL:
     * never.  Called on the converting thread. */
    bool (*cancel)(void *ctx);
    void *cancel_ctx;
    bool drop_empty;   /* coco, voc: leave out images without objects (crowd
                        * regions and VOC's difficult objects do not count) */
    bool semantic;     /* coco: each example also gets `mask`, a class-per-pixel PNG
                        * (kpl_convert_coco) */
} kpl_convert_options;
#define KPL_CONVERT_OPTIONS_INIT                                                            \
    {KPL_RECORD_WRITER_CONFIG_INIT, 0, false, NULL, false, 0, false, 0, 90, NULL, NULL, false, \
     false}

/* MNIST-family IDX files (gzip-compressed or not): an images file (u8,
 * (N, H, W)) and a labels file (u8, (N)).  Writes features image (bytes,
 * encoding raw, shape (H, W, 1)) and label (int64[1]), in file order.
 * `*count` (may be NULL) receives the number of examples. */
kpl_status kpl_convert_idx(const char *images_path, const char *labels_path,
                           const char *out_dir, const kpl_convert_options *opt,
                           int64_t *count);

/* A Caffe Datum LMDB database (a directory holding data.mdb, or the .mdb
 * file itself), opened read-only without a lock file.  Writes features
 * image (bytes: the encoded image, or raw pixels as H x W x C with a fixed
 * shape when all agree), label (int64[1]), key (string: the LMDB key),
 * then when any Datum has it float_data (float list), then for raw Datums
 * of differing sizes image_shape (int64 (H, W, C) per record, which the
 * transform reads), in key order.  KPL_EFORMAT naming the key for a value
 * that is not a Datum or is empty, and naming the first key of each kind
 * for a database that mixes encoded and raw Datums. */
kpl_status kpl_convert_lmdb(const char *path, const char *out_dir,
                            const kpl_convert_options *opt, int64_t *count);

/* An image folder, ImageNet layout: root/<class>/<image>.{jpg,jpeg,png}.
 * Class index = sorted folder order (names written to OUT/classes.txt).
 * Images are stored as their original bytes after a full decode with the
 * loader's decoder (JPEGs larger than max_side re-encoded at that size,
 * upright by their EXIF orientation; PNGs always as they are); the order
 * is a seeded shuffle unless keep_order.  Features: image (bytes), label
 * (int64[1]), path (string, relative to root).  An image the loader could
 * not decode (truncated, no EOI, corrupt data, bad CRC, too large) is an
 * error naming the file, or with skip_bad a warning naming it, counted in
 * *skipped.  A bad file never affects the next one. */
kpl_status kpl_convert_imagefolder(const char *root, const char *out_dir,
                                   const kpl_convert_options *opt, int64_t *count,
                                   int64_t *skipped);

/* A folder of images without classes (a GAN's data: faces, scenes): every
 * .jpg, .jpeg and .png file under root, in subfolders too (hidden files
 * and folders, and links to folders, are passed over), checked and stored
 * as kpl_convert_imagefolder stores them, in a seeded shuffle of the
 * byte-wise sorted relative paths unless keep_order.  Features: image
 * (bytes) and path (string, relative to root); no label.  Options and
 * errors as for kpl_convert_imagefolder. */
kpl_status kpl_convert_images(const char *root, const char *out_dir,
                              const kpl_convert_options *opt, int64_t *count, int64_t *skipped);

/* One split of CIFAR-10 or CIFAR-100 ("train", or "test", also called
 * "val"), from the folder of either layout as distributed, found from the
 * files in src (or in its one subfolder cifar-10-batches-bin,
 * cifar-10-batches-py, cifar-100-binary or cifar-100-python): the binary
 * version's records, or the python version's pickles, read by a strict
 * reader of protocol 2 that runs nothing.  Writes features image (bytes,
 * encoding raw, shape (32, 32, 3), RGB) and label (int64[1]; CIFAR-100's
 * fine label), and for CIFAR-100 coarse_label (int64[1]), in file order
 * (train: data_batch_1 .. 5), then classes.txt (and for CIFAR-100
 * coarse_classes.txt) from the meta files when they are there.  Every file
 * of the split is checked before the dataset is started: a file cut short,
 * a record of the wrong size, a label that is no class, a pickle of
 * another shape or with an opcode outside the few these files use is
 * KPL_EFORMAT naming the file and the record or byte offset. */
kpl_status kpl_convert_cifar(const char *src, const char *split, const char *out_dir,
                             const kpl_convert_options *opt, int64_t *count);

/* ---- detection sets: COCO, Pascal VOC, a synthetic set ------------------------------ */
/*
 * A detection example is one image with its objects (docs/kplrecord.md,
 * "Detection examples"): features image (the file's bytes), path, image_id,
 * height, width, boxes (float x0,y0,x1,y1 per object, in pixels: what the
 * loader's boxes_feature reads), labels (int64, contiguous), then for COCO
 * category_ids, iscrowd, area, annotation_ids and masks (one COCO RLE
 * string per object, '\n' between), for VOC difficult.  Examples follow
 * the image ids in ascending order (COCO) or the split file (VOC).
 */

/* What a detection conversion did. */
typedef struct {
    int64_t images;           /* examples written */
    int64_t objects;          /* objects written (crowd and difficult ones included) */
    int64_t skipped_images;   /* bad images left out (skip_bad) */
    int64_t skipped_objects;  /* bad objects left out (skip_bad), and those of bad images */
    int64_t dropped_empty;    /* images left out for having no objects (drop_empty) */
    int64_t clipped_boxes;    /* boxes clipped to the image (within the tolerance) */
    int64_t dropped_polygons; /* polygon parts of fewer than 3 points, left out */
} kpl_detection_stats;

/* How far (pixels) a box or polygon may reach past the image: up to this it
 * is clipped to the image, beyond it the object is bad. */
#define KPL_DET_BOX_TOLERANCE 1.0

/* A COCO instances JSON (images, categories, annotations with bbox,
 * iscrowd, area and polygon or RLE segmentation) with its images under
 * image_dir.  Labels are the categories' positions in ascending id order;
 * OUT/classes.txt holds their names, OUT/categories.json the mapping.
 * Checked: the JSON's structure (a malformed or truncated file, a
 * duplicate id: KPL_EFORMAT naming the place), each annotation (image and
 * category known, box of positive size inside the image within
 * KPL_DET_BOX_TOLERANCE, positive area, valid segmentation) and each
 * image (file present, decodes whole, the size the JSON says): a bad one
 * is KPL_EFORMAT naming its id, or with o->skip_bad a warning and a count.
 * With o->semantic every example also gets `mask` (bytes, an 8-bit gray
 * PNG of the image's size): 0 background, label + 1 where an object is,
 * 255 (ignore) in crowd regions and where objects of different classes
 * overlap (docs/segmentation-data.md); classes.txt then starts with
 * "background", so its line k names mask value k.
 * Blocking; o->threads check images and rasterise polygons. */
kpl_status kpl_convert_coco(const char *annotations_json, const char *image_dir,
                            const char *out_dir, const kpl_convert_options *opt,
                            kpl_detection_stats *stats);

/* A Pascal VOC 2007/2012 tree: the ids of ImageSets/Main/<split>.txt,
 * their Annotations/<id>.xml and JPEGImages/<id>.jpg.  Labels are the 20
 * VOC classes in the standard order (aeroplane ... tvmonitor); boxes follow
 * mmdetection's reading of VOC's 1-based pixel indices (each coordinate
 * truncated to an integer, minus 1).  Bad objects and images as for COCO. */
kpl_status kpl_convert_voc(const char *voc_root, const char *split, const char *out_dir,
                           const kpl_convert_options *opt, kpl_detection_stats *stats);

/* ---- segmentation sets ------------------------------------------------------------- */
/*
 * A segmentation example is one image with a class per pixel
 * (docs/segmentation-data.md): features image (the file's bytes), mask
 * (bytes, encoding "png": a 1-channel PNG of the image's size, gray or
 * palette, whose values — a palette's indices — are the classes, 255 =
 * ignore), path (string), height and width (int64[1]).  The loader's
 * mask_feature reads `mask`.  Images are kept as they are (checked whole;
 * an EXIF orientation other than 1 is refused: the mask is of the stored
 * pixels), masks too, except 16-bit gray ones, stored re-encoded as 8-bit
 * (a value past 255 is bad).  A bad image or mask — missing, truncated,
 * corrupt, of another size than its image (naming both files and sizes),
 * a value that is neither a class nor 255 — is KPL_EFORMAT naming it, or
 * with skip_bad a warning and a count in *skipped.  Blocking; o->threads
 * check the files.  max_side must be 0.
 */

/* Pascal VOC's SegmentationClass: the ids of ImageSets/Segmentation/
 * <split>.txt in file order, JPEGImages/<id>.jpg and masks_dir/<id>.png
 * (palette PNGs; 0 background, 1..20 the classes, 255 the boundary).
 * masks_dir NULL: SegmentationClass when it holds every listed id's mask,
 * else SegmentationClassAug (the SBD "aug" set's 8-bit gray masks, with
 * its train_aug.txt) when that does, else whichever of the two exists.
 * OUT/classes.txt: background, aeroplane ... tvmonitor (21 lines). */
kpl_status kpl_convert_voc_seg(const char *voc_root, const char *split, const char *masks_dir,
                               const char *out_dir, const kpl_convert_options *opt,
                               int64_t *count, int64_t *skipped);

/* The images of image_dir (.jpg, .jpeg, .png) with the masks of mask_dir
 * (.png) of the same file stem, in stem order; an image without a mask or
 * a mask without an image is bad (an error naming it, or skip_bad), two
 * images of one stem an error.  classes_file (NULL: none) names the
 * classes, one a line, line k for value k: then every mask value must be
 * a class or 255, and OUT/classes.txt is written. */
kpl_status kpl_convert_masks(const char *image_dir, const char *mask_dir,
                             const char *classes_file, const char *out_dir,
                             const kpl_convert_options *opt, int64_t *count, int64_t *skipped);

/* ---- the converters as records (convert_registry.c) ---------------------------------- */
/*
 * One record per source, read by `kpl data convert` (run: the paths given)
 * and by a recipe's data.convert (split: one split found in the source
 * directory), so the two cannot disagree on what a source takes.
 */

/* What one conversion made. */
typedef struct {
    int64_t examples;         /* examples written */
    int64_t skipped;          /* bad inputs left out (options.skip_bad) */
    kpl_detection_stats det;  /* coco, voc: their counts (examples = det.images) */
} kpl_convert_result;

/* The paths of one `kpl data convert`: its inputs before OUT, and the
 * options that name files (NULL when not given). */
typedef struct {
    const char *in[2];
    const char *split;     /* voc, voc-seg: the ImageSets list */
    const char *labels;    /* idx: the labels file of an images file */
    const char *masks_dir; /* voc-seg: the masks' directory */
    const char *classes;   /* masks: the class names' file */
} kpl_convert_inputs;

/* Around each dataset a run writes (an IDX directory and CIFAR write
 * several): `before` may refuse (its error stops the run); `after` gets
 * what was made and how long it took.  Either may be NULL. */
typedef struct {
    kpl_status (*before)(const char *out, void *ctx);
    void (*after)(const char *src, const char *out, const kpl_convert_result *r, double seconds,
                  void *ctx);
    void *ctx;
} kpl_convert_hooks;

/* What a converter takes and reports (kpl_converter.flags). */
enum {
    KPL_CONVERT_TAKES_LABELS = 1 << 0,     /* --labels */
    KPL_CONVERT_TAKES_SPLIT = 1 << 1,      /* --split (required) */
    KPL_CONVERT_TAKES_MASKS_DIR = 1 << 2,  /* --masks-dir */
    KPL_CONVERT_TAKES_CLASSES = 1 << 3,    /* --classes */
    KPL_CONVERT_TAKES_SEMANTIC = 1 << 4,   /* options.semantic */
    KPL_CONVERT_TAKES_DROP_EMPTY = 1 << 5, /* options.drop_empty, data.convert.drop_empty */
    KPL_CONVERT_TAKES_SKIP_BAD = 1 << 6,   /* options.skip_bad, data.convert.skip_bad */
    KPL_CONVERT_TAKES_MAX_SIDE = 1 << 7,   /* options.max_side and quality, data.convert.* */
    KPL_CONVERT_TAKES_KEEP_ORDER = 1 << 8, /* options.keep_order */
    KPL_CONVERT_REPORTS_SKIPPED = 1 << 16, /* result.skipped */
    KPL_CONVERT_REPORTS_OBJECTS = 1 << 17, /* result.det */
};

typedef struct {
    kpl_convert_source source;
    const char *name;   /* --from, data.convert.from */
    const char *inputs; /* its inputs before OUT, in words: "SRC", "IMAGE_DIR, MASK_DIR" */
    int ninputs;        /* 1 or 2 */
    unsigned flags;     /* KPL_CONVERT_TAKES_*, KPL_CONVERT_REPORTS_* */
    /* Optional: whether the inputs of a run make sense before anything is
     * written (idx: the labels file an images file needs); KPL_EINVAL for
     * a usage error, naming what to give. */
    kpl_status (*check)(const kpl_convert_inputs *in);
    /* kpl data convert: in into out (or, when out_holds_splits, into
     * out/<split> each), between the hooks.  o->label is set to each out. */
    kpl_status (*run)(const kpl_convert_inputs *in, const char *out,
                      const kpl_convert_options *o, const kpl_convert_hooks *h);
    /* data.convert: the split at `path` under the source directory (its
     * last part `split`: what sources holding several splits look for)
     * into out. */
    kpl_status (*split)(const char *source, const char *path, const char *split,
                        const char *out, const kpl_convert_options *o, kpl_convert_result *r);
    /* Whether run writes out/<split> directories rather than out itself
     * (NULL: never). */
    bool (*out_holds_splits)(const kpl_convert_inputs *in);
} kpl_converter;

/* The record of a source (static storage); NULL for KPL_CONVERT_NONE. */
const kpl_converter *kpl_converter_of(kpl_convert_source s);
int kpl_converter_count(void);
const kpl_converter *kpl_converter_at(int i);
/* "a, b and c": the names of the converters whose flags hold every bit of
 * `flags`, for messages ("--split is for --from voc and voc-seg"). */
void kpl_converter_names(unsigned flags, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* KPL_CONVERT_H */
