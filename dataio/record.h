/*
 * record.h — the KPLRecord format (docs/kplrecord.md is the specification): features,
 * the writer, the reader, and COCO's run-length encoding of masks.
 * (dataio.h includes every part of dataio/.)
 */
#ifndef KPL_RECORD_H
#define KPL_RECORD_H

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

/* kpl_crc32c (kernels.h) checksums the records. */

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

#ifdef __cplusplus
}
#endif
#endif /* KPL_RECORD_H */
