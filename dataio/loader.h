/*
 * loader.h — the loader: DataReader -> DataTransformer -> DataIterator, the sampler,
 * batches.
 * (dataio.h includes every part of dataio/.)
 */
#ifndef KPL_LOADER_H
#define KPL_LOADER_H

#include "convert.h"
#include "transform.h"

#ifdef __cplusplus
extern "C" {
#endif

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
#endif /* KPL_LOADER_H */
