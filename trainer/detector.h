/*
 * detector.h — a detector's head as the detection task sees it: its
 * training losses from the boxes of a batch (target assignment included)
 * and its decoding into scored, labelled boxes.  The task
 * (tasks/detect.c) keeps everything else: the data and its box features,
 * the COCO evaluation over every rank, detections.json, TensorBoard.
 *
 * kpl's head is FCOS (kpl_detector_fcos, nn/fcos_head.c, on the zoo's
 * "fcos" models).  A second head registers beside it (a plugin's
 * constructor may: examples/centernet_head.c is CenterNet, with a zoo
 * model of its own) and the same task trains and evaluates it:
 *
 *   static const kpl_detector_head my_head = {.name = "retina", .create = ..., ...};
 *   __attribute__((constructor)) static void add(void) { kpl_detector_head_register(&my_head); }
 *
 * The task builds the recipe's model (model.name, the zoo) and gives it to
 * each registered head in turn; the first whose create accepts it trains
 * it.
 */
#ifndef KPL_DETECTOR_H
#define KPL_DETECTOR_H

#include "keys.h"
#include "module.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A batch's boxes on the host. */
typedef struct {
    int64_t n, maxb;
    const float *boxes;     /* (n, maxb, 4): x0, y0, x1, y1 in input pixels */
    const int64_t *labels;  /* (n, maxb): class indices in [0, model.num_classes) */
    const int64_t *nboxes;  /* (n): the boxes of each image, at most maxb */
} kpl_detector_targets;

/* How a loss averages its normalisers over the ranks (as mmdetection's
 * reduce_mean): sum(ctx, v, n) adds n values up over every rank in place
 * (collective); world ranks.  sum NULL: one process. */
typedef struct {
    kpl_status (*sum)(void *ctx, double *v, int n);
    void *ctx;
    int32_t world;
} kpl_detector_ranks;

/* The decoding's settings (the task's keys task.detection.*). */
typedef struct {
    int64_t classes;      /* model.num_classes */
    int64_t topk;         /* candidates kept per level before NMS */
    int64_t max_dets;     /* detections kept per image */
    double score_thresh;  /* candidates need a score above it */
    double nms_iou;       /* class-wise NMS's IoU threshold */
} kpl_detector_decode;

/* Every member is required. */
typedef struct {
    const char *name;
    /* Takes on model (the task's model 0) with the task's keys (kv) when it
     * is one of this head's: *state the head's own.  KPL_ENOTFOUND when
     * the model is not (the task asks the next head); another error
     * (naming `file`, the recipe's, and the key) stops the run. */
    kpl_status (*create)(kpl_module *model, const kpl_keyvals *kv, const char *file,
                         void **state);
    void (*destroy)(void *state);
    /* Its losses, summed into the model's loss and reported as figures of
     * these names ("loss_cls"; static strings). */
    int nlosses;
    const char *loss_names[4];
    /* The losses of a batch from the model's outputs o (its forward on the
     * batch's images): nlosses pool-owned scalars into loss[]. */
    kpl_status (*loss)(void *state, const kpl_tensor_list *o, const kpl_detector_targets *tg,
                       const kpl_detector_ranks *ranks, kpl_tensor **loss);
    /* The detections of the batch's n images from o: image i, valid in
     * img_hw[2i] x img_hw[2i + 1] input pixels (the rest is the batch's
     * padding), gets count[i] <= d->max_dets boxes (box + 4 (i max_dets + j):
     * x0, y0, x1, y1 in input pixels, clipped to the image), scores and
     * labels, best first. */
    kpl_status (*decode)(void *state, const kpl_tensor_list *o, const kpl_detector_decode *d,
                         int64_t n, const double *img_hw, float *box, float *score,
                         int64_t *label, int64_t *count);
} kpl_detector_head;

/* kpl's FCOS head (Tian et al. 2019): focal, GIoU and centerness losses
 * with center sampling, the zoo's "fcos" models (kpl_fcos_strides). */
extern const kpl_detector_head kpl_detector_fcos;

/* The registry of heads, FCOS first.  Registering a name twice, or a head
 * with a member missing, is KPL_EINVAL. */
kpl_status kpl_detector_head_register(const kpl_detector_head *h);
const kpl_detector_head *kpl_detector_head_find(const char *name);
int kpl_detector_head_count(void);
const kpl_detector_head *kpl_detector_head_at(int i);

#ifdef __cplusplus
}
#endif
#endif /* KPL_DETECTOR_H */
