/*
 * cocoeval.h — COCO box evaluation: the twelve figures that pycocotools'
 * COCOeval(iouType='bbox') prints in summarize(), in C and equal to them
 * (docs/cocoeval.md).
 *
 * Ground truth comes from a COCO instances file ("images", "categories",
 * "annotations") or from arrays; detections from a COCO results file (a
 * JSON array of {image_id, category_id, bbox, score}) or from an array,
 * e.g. what a detector gathered from every rank:
 *
 *   kpl_coco_gt *gt = NULL;
 *   kpl_coco_detection *dets = NULL;
 *   int64_t n = 0;
 *   kpl_coco_stats s;
 *   kpl_status st = kpl_coco_gt_load("instances_val2017.json", &gt);
 *   if (st >= 0) st = kpl_coco_dets_load("detections.json", &dets, &n);
 *   if (st >= 0) st = kpl_coco_evaluate(gt, dets, n, &s);
 *   if (st >= 0) printf("mAP %.3f  AP50 %.3f\n", s.stats[KPL_COCO_AP], s.stats[KPL_COCO_AP50]);
 *   else fprintf(stderr, "%s\n", kpl_last_error());
 *   free(dets);
 *   kpl_coco_gt_destroy(gt);
 *
 * What is computed is COCO's default: IoU thresholds .50:.05:.95, 101
 * recall points, at most 1, 10 and 100 detections per image, the area
 * ranges all, small (< 32^2), medium and large (> 96^2) of the
 * ground truth's "area" and of the detections' box areas; crowd regions,
 * greedy matching by score and the precision envelope exactly as
 * pycocotools defines them.  Figures that are undefined (no ground truth
 * in a range) are -1, as pycocotools prints them.
 *
 * Inputs are checked: malformed JSON, a missing or mistyped field, a
 * detection on an image the ground truth lacks, a repeated annotation id,
 * a box or score that is NaN or infinite are KPL_EFORMAT (files) or
 * KPL_EINVAL (arrays) naming the entry.  Detections of a category the
 * ground truth lacks are skipped and counted, as pycocotools skips them.
 *
 * Every function is blocking and keeps no state outside its arguments; a
 * kpl_coco_gt is read-only once made, so several threads may evaluate
 * against one.
 */
#ifndef KPL_COCOEVAL_H
#define KPL_COCOEVAL_H

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One ground-truth object (a COCO "annotation"). */
typedef struct {
    int64_t id;                    /* unique among the annotations */
    int64_t image_id, category_id; /* ids of the ground truth's images and categories */
    double bbox[4];                /* x, y, width, height in pixels */
    double area;                   /* what the area ranges judge: COCO gives the mask's area */
    int32_t iscrowd;               /* 1: a crowd region (ignored; detections in it are neither
                                      right nor wrong), 0: one object */
} kpl_coco_annotation;

/* One detection (an entry of a COCO results file). */
typedef struct {
    int64_t image_id, category_id;
    double bbox[4]; /* x, y, width, height in pixels */
    double score;   /* higher first; ties keep the input order */
} kpl_coco_detection;

/* The twelve figures, in COCOeval.summarize()'s order: AP at IoU
 * .50:.95, .50, .75; AP of small, medium, large objects; AR with at most
 * 1, 10, 100 detections per image; AR of small, medium, large objects. */
#define KPL_COCO_STATS(X)                                                        \
    X(KPL_COCO_AP, "AP") X(KPL_COCO_AP50, "AP50") X(KPL_COCO_AP75, "AP75")       \
    X(KPL_COCO_APS, "APs") X(KPL_COCO_APM, "APm") X(KPL_COCO_APL, "APl")         \
    X(KPL_COCO_AR1, "AR1") X(KPL_COCO_AR10, "AR10") X(KPL_COCO_AR100, "AR100")   \
    X(KPL_COCO_ARS, "ARs") X(KPL_COCO_ARM, "ARm") X(KPL_COCO_ARL, "ARl")
typedef enum { KPL_COCO_STATS(KPL_ENUM_VALUE) KPL_COCO_NSTATS } kpl_coco_stat;
/* kpl_coco_stat_names[] ("AP", "AP50", ...), kpl_coco_stat_name(),
 * kpl_coco_stat_parse(). */
KPL_ENUM_DECLARE(kpl_coco_stat);

/* What an evaluation found. */
typedef struct {
    double stats[KPL_COCO_NSTATS]; /* in [0, 1], or -1 where undefined */
    int64_t images, categories;    /* of the ground truth (distinct ids) */
    int64_t gt_boxes;              /* annotations evaluated, crowd regions among them */
    int64_t gt_skipped;            /* annotations naming an image or category the ground
                                      truth does not list (pycocotools skips them too) */
    int64_t detections;            /* detections of the ground truth's categories (past
                                      the 100 best of an image and category they are
                                      not looked at, as in pycocotools) */
    int64_t dets_skipped;          /* detections of categories the ground truth lacks */
} kpl_coco_stats;

/* ---- ground truth -------------------------------------------------------------------------- */
typedef struct kpl_coco_gt kpl_coco_gt;

/* Ground truth from arrays (all copied; the caller keeps its own).  Image
 * and category ids may repeat (counted once) and need not be contiguous;
 * annotations naming an image or category not listed are kept out and
 * counted (kpl_coco_stats.gt_skipped).  KPL_EINVAL naming the entry for a
 * negative count, a repeated annotation id, a non-finite bbox or area, an
 * iscrowd other than 0 or 1.  *out owned by the caller
 * (kpl_coco_gt_destroy). */
kpl_status kpl_coco_gt_create(const int64_t *image_ids, int64_t nimages,
                              const int64_t *category_ids, int64_t ncategories,
                              const kpl_coco_annotation *anns, int64_t nanns, kpl_coco_gt **out);
/* Ground truth from a COCO instances file: "images" and "categories"
 * (arrays of objects with an integer "id"; other fields are not read) and
 * "annotations" (may be absent: no objects), each with integer "id",
 * "image_id", "category_id" and a "bbox" of 4 numbers; "area" defaults to
 * the box's width x height and "iscrowd" (0, 1, false or true) to 0;
 * "segmentation" is not read.  KPL_ENOTFOUND for a missing file, KPL_EIO
 * for one that cannot be read, KPL_EFORMAT naming the file, the entry
 * (index and id) and the field for anything else. */
kpl_status kpl_coco_gt_load(const char *path, kpl_coco_gt **out);
/* The same from the text of such a file (len bytes, no NUL needed);
 * `name` labels error messages (NULL: "ground truth"). */
kpl_status kpl_coco_gt_parse(const char *text, size_t len, const char *name, kpl_coco_gt **out);
/* NULL is a no-op. */
void kpl_coco_gt_destroy(kpl_coco_gt *gt);

/* ---- detections ---------------------------------------------------------------------------- */
/* Detections from a COCO results file: a JSON array of objects with
 * integer "image_id" and "category_id", "bbox" (4 numbers) and "score";
 * other fields are not read.  *dets is malloc'd (free it; NULL when *n is
 * 0).  KPL_ENOTFOUND for a missing file, KPL_EIO for one that cannot be
 * read, KPL_EFORMAT naming the file, the entry's index and the field for
 * anything else. */
kpl_status kpl_coco_dets_load(const char *path, kpl_coco_detection **dets, int64_t *n);
/* The same from the text of such a file; `name` labels error messages
 * (NULL: "detections"). */
kpl_status kpl_coco_dets_parse(const char *text, size_t len, const char *name,
                               kpl_coco_detection **dets, int64_t *n);
/* Writes n detections as a COCO results file (numbers printed so that
 * they read back to the same doubles), through path.tmp renamed to path.
 * KPL_EIO naming the file. */
kpl_status kpl_coco_dets_save(const char *path, const kpl_coco_detection *dets, int64_t n);

/* ---- evaluation ---------------------------------------------------------------------------- */
/* COCOeval(iouType='bbox') over every image and category of gt: evaluate,
 * accumulate and summarize; the figures and counts into *out.  dets may
 * be in any order (ties in score keep it) and NULL when n is 0; no
 * detection at all gives 0 for every figure that has ground truth.
 * Detections of categories gt lacks are skipped and counted.  KPL_EINVAL
 * naming the detection's index for an image gt lacks (pycocotools stops
 * there too) or a non-finite bbox or score. */
kpl_status kpl_coco_evaluate(const kpl_coco_gt *gt, const kpl_coco_detection *dets, int64_t n,
                             kpl_coco_stats *out);
/* The same in parts, for processes that each hold a share of the images
 * (their ground truth, made with the same category list, and their
 * detections): kpl_coco_match matches one share into a part, a flat
 * malloc'd buffer of *bytes bytes (free it) to send as bytes between
 * processes of one build; kpl_coco_finish takes the parts of disjoint
 * shares laid end to end (what an all-gather of them gives) and computes
 * the figures of their union, the very doubles kpl_coco_evaluate gives on
 * the whole (which is match and finish of one part).  The counts in *out
 * are the parts' sums.  KPL_EINVAL for a buffer that is not such parts
 * (cut short, another category list). */
kpl_status kpl_coco_match(const kpl_coco_gt *gt, const kpl_coco_detection *dets, int64_t n,
                          void **part, size_t *bytes);
kpl_status kpl_coco_finish(const void *parts, size_t bytes, kpl_coco_stats *out);
/* The figures as one JSON object, {"AP":0.5, ..., "ARl":-1} in
 * kpl_coco_stat order, each number the shortest that reads back to the
 * same double.  Writes at most len bytes with a NUL; returns the length
 * the whole text needs (as snprintf does). */
int kpl_coco_stats_json(const kpl_coco_stats *s, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* KPL_COCOEVAL_H */
