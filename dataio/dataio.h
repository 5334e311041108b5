/*
 * dataio.h — datasets: the KPLRecord format (docs/kplrecord.md is the
 * specification), its writer and reader, the converters from IDX, image
 * folders (with classes or without), LMDB, CIFAR-10/100, COCO and Pascal
 * VOC (detection and segmentation), image and mask folders, COCO's run-length mask encoding, and synthetic
 * detection and segmentation sets (docs/detection-data.md,
 * docs/segmentation-data.md).
 *
 * Writing a dataset:
 *
 *   kpl_feature_spec schema[2] = {
 *       {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "jpeg"},
 *       {.name = "label", .type = KPL_FEATURE_INT64},
 *   };
 *   kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
 *   cfg.shards = 4;
 *   kpl_record_writer *w = NULL;
 *   kpl_record_writer_create("out/train", 2, schema, &cfg, &w);
 *   for (each example) {
 *       kpl_feature_value v[2] = {{jpeg, jpeg_len}, {&label, 1}};
 *       kpl_record_writer_add(w, v);
 *   }
 *   kpl_record_writer_close(w);      // the dataset is complete only now
 *
 * Reading it:
 *
 *   kpl_dataset *ds = NULL;
 *   kpl_dataset_open("out/train", &ds);
 *   kpl_chunk *c = kpl_chunk_create();
 *   for (int64_t k = 0; k < kpl_dataset_num_chunks(ds); k++) {
 *       kpl_dataset_read_chunk(ds, k, c);          // checked, decompressed
 *       for (int i = 0; i < kpl_chunk_num_records(c); i++) {
 *           kpl_feature_value v[2];
 *           kpl_chunk_record(c, i, v);               // views into c
 *       }
 *   }
 *   kpl_chunk_destroy(c);
 *   kpl_dataset_close(ds);
 *
 * Every function that can fail returns a kpl_status; the message from
 * kpl_last_error() names the file, shard, chunk and record at fault.
 */
#ifndef KPL_DATAIO_H
#define KPL_DATAIO_H

#include "kernels.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The KPLRecord version written (METADATA's and the shard headers'): 2 adds
 * METADATA's checksum and makes fixed shapes binding; readers read 1 and 2. */
#define KPL_RECORD_VERSION 2
#define KPL_FEATURE_NAME_MAX 64 /* including the terminating NUL */

/* Append only (the numbers are not stored; names are). */
typedef enum {
    KPL_FEATURE_BYTES,  /* opaque bytes: JPEG, PNG, raw pixels */
    KPL_FEATURE_INT64,  /* list of int64 */
    KPL_FEATURE_FLOAT,  /* list of float32 */
    KPL_FEATURE_STRING, /* UTF-8 text */
} kpl_feature_type;

/* "bytes", "int64", "float", "string". */
const char *kpl_feature_type_name(kpl_feature_type t);

/* One feature of the schema: a plain value. */
typedef struct {
    char name[KPL_FEATURE_NAME_MAX];
    kpl_feature_type type;
    char encoding[16]; /* hint: "", "jpeg", "png", "raw" */
    int ndim;          /* 0: no fixed shape */
    int64_t shape[8];  /* e.g. (H, W, C) of raw pixels */
} kpl_feature_spec;

/* One feature's value: a view, owned by whoever made it.  `count` is in
 * bytes for BYTES and STRING, in elements for INT64 and FLOAT. */
typedef struct {
    const void *data;
    uint32_t count;
} kpl_feature_value;

/* CRC32C (Castagnoli, RFC 3720) of n bytes, continuing `crc` (0 to start):
 * the checksum of KPLRecord files, checkpoints and TensorBoard records.
 * SSE4.2 when the CPU has it.  Thread-safe. */
uint32_t kpl_crc32c(uint32_t crc, const void *data, size_t n);

/* ---- writer ------------------------------------------------------------------------ */

typedef struct kpl_record_writer kpl_record_writer;

typedef struct {
    int shards;                  /* >= 1 */
    size_t chunk_bytes;          /* target raw size of a chunk */
    int zstd_level;              /* 1..19; 0 stores chunks uncompressed */
    const char *attributes_json; /* NULL or a JSON object, copied into METADATA */
} kpl_record_writer_config;
#define KPL_RECORD_WRITER_CONFIG_INIT {1, (size_t)4 << 20, 3, NULL}

/* Creates `dir` (and its parents) and starts a dataset there.  A directory
 * that already holds files is refused (KPL_EINVAL): nothing is overwritten.
 * *out is owned by the caller: finish with _close, or abandon with
 * _destroy.  Blocking (file I/O); a writer is used by one thread. */
kpl_status kpl_record_writer_create(const char *dir, int num_features,
                                    const kpl_feature_spec *schema,
                                    const kpl_record_writer_config *cfg,
                                    kpl_record_writer **out);
/* Appends one example: values[num_features], in schema order; copied. */
kpl_status kpl_record_writer_add(kpl_record_writer *w, const kpl_feature_value *values);
/* Examples added so far. */
int64_t kpl_record_writer_count(const kpl_record_writer *w);
/* Flushes, writes the indexes and METADATA, fsyncs, and frees w (also on
 * error).  Only after it returns KPL_OK is the dataset complete. */
kpl_status kpl_record_writer_close(kpl_record_writer *w);
/* Abandons an unfinished dataset: removes the files this writer created
 * (and `dir` if it created it).  NULL is a no-op. */
void kpl_record_writer_destroy(kpl_record_writer *w);

/* ---- reader ------------------------------------------------------------------------ */

typedef struct kpl_dataset kpl_dataset;
typedef struct kpl_chunk kpl_chunk;

/* Opens a complete dataset: reads METADATA and every index (CRC-checked),
 * checks every shard file's header and size.  Refuses a dataset whose
 * writer did not finish (a WRITING file), naming its pid and host.
 * *out owned by the caller (kpl_dataset_close).  The handle may be shared
 * by threads: reads use pread and each thread brings its own kpl_chunk. */
kpl_status kpl_dataset_open(const char *dir, kpl_dataset **out);
void kpl_dataset_close(kpl_dataset *ds);

/* Whether a writer is still at work in `dir`.  A writer holds a lock on
 * its WRITING marker for its whole life, so a marker nobody holds was left
 * by a writer that died.  (A marker written by an older kpl, which had no
 * lock, counts as alive while its pid lives, on the same host.) */
typedef enum {
    KPL_WRITER_NONE,  /* no WRITING marker: finished, or never started */
    KPL_WRITER_ALIVE, /* its writer is still writing */
    KPL_WRITER_DEAD,  /* left unfinished by a writer that died */
} kpl_writer_state;
/* *state for `dir`; who (may be NULL) receives the marker's text, e.g.
 * "pid 4242 host node3 started 2026-11-23T10:00:00Z".  Non-blocking. */
kpl_status kpl_dataset_writer_state(const char *dir, kpl_writer_state *state, char *who,
                                    size_t len);
/* Removes a dataset left unfinished by a dead writer: its files, then
 * `dir`, holding the marker's lock so that no writer can start meanwhile.
 * KPL_ESTATE (nothing removed) when the writer is alive or when `dir` holds
 * files no dataset writer makes; KPL_ENOTFOUND without a marker. */
kpl_status kpl_dataset_remove_unfinished(const char *dir);
/* Conversions into the datasets of one directory take turns: `kpl data
 * convert` and kpl train's conversion on first use both hold this lock
 * (`parent`/.kpl-convert.lock, an flock(2)) while they write a dataset
 * directory inside `parent`.  Creates `parent` if needed.  While another
 * process holds the lock, keep_waiting (may be NULL: wait for good) is
 * called about every 100 ms with the seconds waited so far; false gives
 * up with KPL_ECANCELED.  *fd receives the lock, for kpl_convert_unlock. */
kpl_status kpl_convert_lock(const char *parent, bool (*keep_waiting)(const char *lock,
                                                                    double waited, void *ctx),
                            void *ctx, int *fd);
void kpl_convert_unlock(int fd);

int64_t kpl_dataset_num_examples(const kpl_dataset *ds);
int kpl_dataset_num_features(const kpl_dataset *ds);
/* Borrowed; i in [0, num_features). */
const kpl_feature_spec *kpl_dataset_feature(const kpl_dataset *ds, int i);
/* Index of the feature called `name`, or -1. */
int kpl_dataset_find_feature(const kpl_dataset *ds, const char *name);
/* METADATA's "attributes" object as JSON text (borrowed; "{}" if none). */
const char *kpl_dataset_attributes(const kpl_dataset *ds);
const char *kpl_dataset_path(const kpl_dataset *ds);

/* Chunks are numbered shard-major over the whole dataset, like examples. */
typedef struct {
    int shard;
    int64_t chunk_in_shard;
    int64_t first_example; /* global number of its first record */
    int64_t num_records;
    size_t stored_bytes, raw_bytes;
    bool compressed;
} kpl_chunk_info;

int64_t kpl_dataset_num_chunks(const kpl_dataset *ds);
kpl_chunk_info kpl_dataset_chunk_info(const kpl_dataset *ds, int64_t chunk);
/* The chunk holding `example` and the record's position in it. */
kpl_status kpl_dataset_locate(const kpl_dataset *ds, int64_t example, int64_t *chunk,
                              int *record);

/* A reusable chunk buffer (grows to the largest chunk read); NULL on OOM. */
kpl_chunk *kpl_chunk_create(void);
void kpl_chunk_destroy(kpl_chunk *c);
/* Reads chunk `chunk` into c: checks the header and payload CRC32C,
 * decompresses, checks every record's length chain and CRC32C.
 * KPL_EFORMAT names the shard file, chunk, record and what is wrong;
 * KPL_EIO a read error.  Blocking. */
kpl_status kpl_dataset_read_chunk(kpl_dataset *ds, int64_t chunk, kpl_chunk *c);
int kpl_chunk_num_records(const kpl_chunk *c);
int64_t kpl_chunk_first_example(const kpl_chunk *c);
/* The features of record i of c: values[num_features], views into c valid
 * until c is read into again.  Numeric data may be unaligned (memcpy it). */
kpl_status kpl_chunk_record(const kpl_chunk *c, int i, kpl_feature_value *values);
/* Random access: reads the example's chunk into c (unless c holds it) and
 * returns its features as kpl_chunk_record does. */
kpl_status kpl_dataset_read_example(kpl_dataset *ds, int64_t example, kpl_chunk *c,
                                    kpl_feature_value *values);

/* A JSON summary: path, counts, schema, attributes, shards, bytes and the
 * compression ratio.  *json is malloc'd, owned by the caller. */
kpl_status kpl_dataset_describe(const kpl_dataset *ds, char **json);

/* Reads every byte of the dataset at `dir` and checks every rule of the
 * specification: whole-file checksums, chunk headers and payloads, records,
 * index agreement, raw feature sizes.  Returns the first violation as
 * KPL_EFORMAT with a message naming the file, chunk and record; on success
 * fills the counts read.  `progress` (may be NULL) is called now and then
 * with the bytes read so far and the total. */
typedef struct {
    int64_t examples, chunks;
    uint64_t bytes;
} kpl_verify_stats;
kpl_status kpl_dataset_verify(const char *dir, kpl_verify_stats *stats,
                              void (*progress)(uint64_t done, uint64_t total, void *ctx),
                              void *ctx);

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

/* ---- COCO's run-length encoding of binary masks ----------------------------------- */
/*
 * An h x w binary mask as COCO stores it: the lengths of alternating runs
 * of 0s and 1s, the first run of 0s (possibly empty), over the pixels in
 * column-major order (pixel (x, y) is number x * h + y); they sum to h * w.
 * The compressed string form is pycocotools' (docs/kplrecord.md, "Masks").
 * Masks in memory are row-major (H, W) u8, 0 or 1 (any non-zero input is 1).
 */
typedef struct {
    int64_t h, w;
    int64_t n;         /* runs */
    uint32_t *counts;  /* n run lengths, malloc'd: kpl_rle_free */
} kpl_rle;

/* Frees r's counts and zeroes it; NULL is a no-op. */
void kpl_rle_free(kpl_rle *r);
/* The RLE of mask (H = h, W = w).  *out owns new counts. */
kpl_status kpl_rle_encode(const uint8_t *mask, int64_t h, int64_t w, kpl_rle *out);
/* Writes r as a row-major (h, w) mask of 0s and 1s. */
kpl_status kpl_rle_decode(const kpl_rle *r, uint8_t *mask);
/* The pixels set (the sum of the odd-numbered runs). */
int64_t kpl_rle_area(const kpl_rle *r);
/* pycocotools' compressed string of r: malloc'd, NUL-terminated, *len
 * (may be NULL) its length. */
kpl_status kpl_rle_to_string(const kpl_rle *r, char **s, size_t *len);
/* Parses a compressed string of len bytes for an h x w mask.  KPL_EFORMAT
 * for a byte outside '0'..'o', a value cut short, a run that is negative,
 * or runs that do not sum to h * w. */
kpl_status kpl_rle_from_string(const char *s, size_t len, int64_t h, int64_t w, kpl_rle *out);
/* Sets to 1 the pixels of mask (row-major (h, w)) inside the polygon of
 * npoints points xy[2 * npoints] (x, y in pixels), as pycocotools' frPoly
 * rasterises it (docs/kplrecord.md, "Polygons"); pixels outside it are left
 * as they are, so calls for the parts of an object give their union.
 * KPL_ERANGE for a coordinate that is not finite or past 2^24 in size. */
kpl_status kpl_mask_fill_polygon(const double *xy, int64_t npoints, int64_t h, int64_t w,
                                 uint8_t *mask);

/* The synthetic detection set fmnist-det: Fashion-MNIST items pasted onto
 * textured backgrounds, written as COCO (docs/detection-data.md). */
typedef struct {
    const char *fmnist_dir; /* holds {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] */
    int64_t train, val;     /* images per split (0: no such split) */
    int size;               /* image side, pixels (>= 32) */
    uint64_t seed;
    int min_side, max_side; /* an item's pasted side, pixels */
    int max_objects;        /* items drawn per image: 1 .. max_objects */
    int threshold;          /* item pixels above this (0..255) are the object */
    float min_visible;      /* an earlier item keeps at least this share of its pixels */
    int quality;            /* JPEG quality */
    int threads;            /* 0: the OpenMP default */
    bool progress;          /* a progress line on stderr */
} kpl_synth_det_config;
#define KPL_SYNTH_DET_CONFIG_INIT                                                           \
    {"/usr/share/datasets/fashion-mnist", 2000, 500, 128, 0, 20, 90, 8, 48, 0.5f, 90, 0, false}

/* Writes out_dir/train.json and out_dir/val.json (COCO instances, masks as
 * compressed RLE) and the JPEGs under out_dir/train/ and out_dir/val/.
 * out_dir must not hold files.  The bytes written are a function of cfg
 * only (not of the thread count).  *objects (may be NULL) receives the
 * number of objects of both splits.  Blocking. */
kpl_status kpl_synth_fmnist_det(const char *out_dir, const kpl_synth_det_config *cfg,
                                int64_t *objects);

/* fmnist-seg: the same scenes as fmnist-det for the same cfg, with a class
 * per pixel instead of objects: out_dir/<split>/images/NNNNNN.jpg,
 * out_dir/<split>/masks/NNNNNN.png (8-bit gray: 0 background, Fashion-MNIST
 * label + 1 where an item's pixel is above the threshold, the item pasted
 * last winning) for train and val, and out_dir/classes.txt (background and
 * the 10 names): what kpl_convert_masks reads.  Same rules as
 * kpl_synth_fmnist_det; *objects counts the items pasted. */
kpl_status kpl_synth_fmnist_seg(const char *out_dir, const kpl_synth_det_config *cfg,
                                int64_t *objects);

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

/* ---- the loader: DataReader -> DataTransformer -> DataIterator -------------------- */
/*
 * One loader per rank.  kpl_loader_create forks a reader process (this
 * rank's share of the examples, in the epoch's order, read chunk by chunk,
 * checked and decompressed) and `workers` transformer processes (decode and
 * augment into shared-memory batch slots); kpl_loader_next, in the calling
 * process, hands out the finished batches in order as tensors that view the
 * slots, without copies.
 *
 *   kpl_loader_config cfg = KPL_LOADER_CONFIG_INIT;
 *   cfg.path = "data/train"; cfg.batch_size = 256; cfg.workers = 4;
 *   cfg.rank = rank; cfg.world_size = world;
 *   cfg.transform.crop = KPL_CROP_RANDOM_RESIZED; cfg.transform.out_h = 224; ...
 *   kpl_loader *l = NULL;
 *   kpl_loader_create(&cfg, &l);
 *   for (int64_t epoch = 0; epoch < epochs; epoch++) {
 *       kpl_batch b;
 *       bool last = false;
 *       while (!last && kpl_loader_next(l, &b) == KPL_OK) {
 *           if (b.size) train_step(b.image, b.label);
 *           last = b.last;
 *           kpl_batch_release(&b);      // gives the slot back to the workers
 *       }
 *   }
 *   kpl_loader_destroy(l);
 *
 * A detector's images keep their aspect ratio and have sizes of their own:
 *
 *   cfg.transform.crop = KPL_CROP_KEEP_RATIO;    // short side 640..800, long <= 1333
 *   int s[6] = {640, 672, 704, 736, 768, 800};
 *   memcpy(cfg.transform.short_sides, s, sizeof s);
 *   cfg.transform.num_short_sides = 6;
 *   cfg.transform.max_side = 1333;
 *   cfg.transform.boxes_feature = "boxes"; cfg.transform.max_boxes = 100;
 *   // each batch: image (N, 3, Hb, Wb), Hb and Wb multiples of size_divisor
 *   // (32), image i at the top left, image_size[i] = its (h, w), orig_size[i]
 *   // the stored (h, w), boxes in the resized image's pixels
 *
 * The sample sequence is a pure function of (seed, epoch, rank, world size)
 * and the dataset; each sample's augmentation of (seed, epoch, example).  So
 * the number of workers never changes the batches, and a loader created
 * with start_epoch/start_position from kpl_loader_position continues exactly
 * where an interrupted run stopped.
 *
 * A worker that dies is noticed within about 100 ms: kpl_loader_next
 * returns KPL_ECHILD naming the stage, pid and signal or exit status, after
 * stopping and reaping the other processes.  Children ignore SIGINT (the
 * trainer decides) and die with their parent (PR_SET_PDEATHSIG).  The
 * loader forks: create it before starting threads that hold locks the
 * children might need (OpenMP pools are fine; the children use none).
 */

/* none: dataset order; chunk: chunk order shuffled, then examples inside
 * windows of shuffle_window chunks (sequential I/O); buffer: dataset
 * order through a shuffle buffer of initial_fill; example: a full
 * permutation (random access: SSD or small sets) */
#define KPL_SHUFFLE_MODES(X)                                                            \
    X(KPL_SHUFFLE_NONE, "none") X(KPL_SHUFFLE_CHUNK, "chunk") X(KPL_SHUFFLE_BUFFER, "buffer") \
    X(KPL_SHUFFLE_EXAMPLE, "example")
typedef enum { KPL_SHUFFLE_MODES(KPL_ENUM_VALUE) } kpl_shuffle_mode;

/* kpl_shuffle_mode_names (NULL-terminated), _name, _parse (-1 for others) */
KPL_ENUM_DECLARE(kpl_shuffle_mode);

typedef struct {
    const char *path;          /* the KPLRecord dataset directory */
    int64_t batch_size;        /* >= 1 */
    int workers;               /* transformer processes, >= 1 */
    int prefetch;              /* batches prepared ahead of the one in use, >= 1 */
    uint64_t seed;
    int32_t rank, world_size;  /* this rank's share of every epoch */
    kpl_shuffle_mode shuffle;
    int shuffle_window;        /* CHUNK: chunks per shuffle window */
    int64_t initial_fill;      /* BUFFER: examples in the shuffle buffer */
    bool pad;   /* examples % world_size != 0: every rank gets ceil(N/world) by
                 * repeating the epoch's first examples (true), or floor(N/world)
                 * with the epoch's last examples left out (false) */
    bool rotate;               /* each epoch, partition r goes to rank (r - epoch) mod world */
    bool drop_last;            /* drop an epoch's last partial batch */
    int64_t start_epoch;       /* resume point (kpl_loader_position) */
    int64_t start_position;
    int64_t limit;             /* > 0: only the dataset's first `limit` examples (a subset
                                * for quick runs); 0: all */
    bool interleave;           /* rank r takes examples r, r + world, ... of the epoch's
                                * sequence instead of a contiguous slice: the global batch
                                * of a step is then the same for any world size (shuffle
                                * none or example), at the cost of read locality */
    size_t cache_bytes;        /* reader: decompressed chunks kept for reuse */
    kpl_device *device;        /* NULL or CPU; a GPU device pins the batch memory */
    kpl_transform_config transform;
} kpl_loader_config;
#define KPL_LOADER_CONFIG_INIT                                                              \
    {NULL, 32, 1, 2, 0, 0, 1, KPL_SHUFFLE_CHUNK, 8, 4096, false, false, false, 0, 0, 0, false, \
     (size_t)256 << 20, NULL, KPL_TRANSFORM_CONFIG_INIT}

typedef struct kpl_loader kpl_loader;

/* One batch: tensors viewing a shared-memory slot, owned by the caller
 * (kpl_batch_release; the slot returns to the workers when every tensor
 * of the batch is released).  Outputs the transform lacks are NULL. */
typedef struct {
    int64_t size;             /* samples; 0 only in an epoch's last batch when every
                                 sample of it was corrupt (skip_corrupt) */
    bool last;                /* the epoch's last batch: the next one starts the next */
    int64_t epoch;
    int64_t position;         /* position in the epoch of its first sample */
    int64_t skipped;          /* corrupt samples dropped from it (skip_corrupt) */
    kpl_tensor *image;        /* (N, C, H, W) f32 or u8; keep_ratio: H, W the batch's padded
                               * size, each image at the top left, 0 around it; scale_crop:
                               * a crop smaller than (H, W) at the top left, the mean
                               * around it */
    kpl_tensor *label;        /* (N) i64 */
    kpl_tensor *boxes;        /* (N, max_boxes, 4) f32, in output pixels */
    kpl_tensor *box_labels;   /* (N, max_boxes) i64 */
    kpl_tensor *num_boxes;    /* (N) i64 */
    kpl_tensor *mask;         /* (N, H, W) u8; keep_ratio, scale_crop: padded with mask_pad */
    kpl_tensor *example;      /* (N) i64: the dataset example of each sample */
    kpl_tensor *image_size;   /* (N, 2) i64: (h, w) of each image in `image` before padding
                               * (after the resize) */
    kpl_tensor *orig_size;    /* (N, 2) i64: (h, w) of each stored image (upright, as its
                               * boxes are given) */
} kpl_batch;

/* Opens the dataset, checks cfg (KPL_EINVAL naming the field), sets up the
 * shared memory and starts the processes.  *out owned by the caller. */
kpl_status kpl_loader_create(const kpl_loader_config *cfg, kpl_loader **out);
/* The next batch, in order; blocks until it is ready.  An epoch's last
 * batch says so (b->last); the next one is the next epoch's first.  A
 * batch whose samples were all corrupt (skip_corrupt) is passed over,
 * unless it is the epoch's last: that one comes with size 0.  KPL_ECHILD when
 * a process of the pipeline died (message: stage, pid, signal or status),
 * or when the batch cannot be finished because a process reported an
 * error (its own message, e.g. a corrupt record); the loader is then
 * stopped for good.  KPL_ESTATE when every slot is still held by batches
 * not released.  Not thread-safe (one consumer). */
kpl_status kpl_loader_next(kpl_loader *l, kpl_batch *b);
/* Whether every process of the pipeline is still alive, without waiting
 * for anything: KPL_OK, or KPL_ECHILD with the message kpl_loader_next
 * would give (stage, pid, signal or exit status) when one died — killed
 * by a signal, or ended without reporting an error — after which the
 * loader is stopped for good, as after next.  An error a process
 * reported (a sample it cannot decode without skip_corrupt, a read error)
 * is not a death: it is left for kpl_loader_next, which returns it when
 * it reaches a batch the error spoiled (batches finished before it are
 * still handed out).  Cheap (a waitpid(WNOHANG) per process), so a
 * trainer can call it every step for a loader it is not reading from,
 * e.g. the validation loader between evaluations: a worker killed while
 * that loader sits idle is reported at the next step instead of at the
 * end of the epoch.  When it reports a death it may take up to 0.2 s to
 * name the process that died first.  Not thread-safe (the consumer's
 * thread, like kpl_loader_next). */
kpl_status kpl_loader_check(kpl_loader *l);
/* Releases the batch's tensors (NULLs them); NULL or empty is a no-op. */
void kpl_batch_release(kpl_batch *b);
/* b's member `name` ("image", "label", "boxes", "box_labels", "num_boxes",
 * "mask", "example", "image_size", "orig_size"), borrowed.  NULL with KPL_ENOTFOUND when the loader
 * was not asked for it, naming it and the transform field that asks for it
 * (a recipe's data.<split>.boxes_feature), or for an unknown name. */
kpl_tensor *kpl_batch_get(const kpl_batch *b, const char *name);
/* Samples per epoch for this rank (after pad/drop; before drop_last). */
int64_t kpl_loader_epoch_size(const kpl_loader *l);
/* Examples the epochs are drawn from (the dataset's, or `limit`). */
int64_t kpl_loader_num_examples(const kpl_loader *l);
/* Batches per epoch (after drop_last), counted from position 0. */
int64_t kpl_loader_batches_per_epoch(const kpl_loader *l);
/* Where the next call to kpl_loader_next continues: give these to a new
 * loader as start_epoch/start_position to resume. */
void kpl_loader_position(const kpl_loader *l, int64_t *epoch, int64_t *position);
/* Corrupt samples dropped from the batches handed out so far (skip_corrupt),
 * every epoch's: an example that fails each epoch counts each time. */
int64_t kpl_loader_skipped(const kpl_loader *l);
/* Process ids: [0] the reader, then the workers; returns how many (<= max). */
int kpl_loader_pids(const kpl_loader *l, int *pids, int max);
/* Stops the processes (SIGTERM, then SIGKILL after 2 s), reaps them and
 * frees the loader.  Batches still held stay valid until released.  NULL
 * is a no-op. */
void kpl_loader_destroy(kpl_loader *l);

#ifdef __cplusplus
}
#endif
#endif /* KPL_DATAIO_H */
