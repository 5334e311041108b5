/*
 * fcos_impl.h — FCOS's locations, target assignment, losses and decoding
 * (nn/fcos_head.c, the kpl_detector_fcos head of detector.h), for its
 * tests and benchmark (not installed).
 */
#ifndef KPL_FCOS_IMPL_H
#define KPL_FCOS_IMPL_H

#include "detector.h"
#include "layers.h"

/* One level of the feature pyramid: its stride, its feature map's size
 * and the range of box sizes it regresses (the largest of l, t, r, b in
 * [lo, hi]). */
typedef struct {
    int stride;
    int64_t h, w;
    double lo, hi;
} kpl__fcos_level;

/* The locations of every level, level by level, row-major inside one:
 * (x, y) = (stride * j + stride / 2, stride * i + stride / 2) in input
 * pixels (integer division, as mmdetection's FCOS).  xy has 2 x the sum of
 * h x w floats. */
int64_t kpl__fcos_count(const kpl__fcos_level *lv, int nlevels);
void kpl__fcos_points(const kpl__fcos_level *lv, int nlevels, float *xy);

/* FCOS's targets for one image (Tian et al. 2019, with center sampling as
 * in the paper's improvements and mmdetection): a location is positive for
 * a box when it lies inside the box (with radius > 0: inside the box and
 * within radius x stride of its centre on both axes) and the box's largest
 * distance from it lies in the level's range; among such boxes the one of
 * least area wins (ties: the lower index).  For each location: cls (the
 * box's label, or -1 for background), ltrb (distances to the box's sides,
 * in pixels; zeros for background) and ctr (centerness, sqrt(min(l, r) /
 * max(l, r) x min(t, b) / max(t, b)); 0 for background).  boxes: nb x 4
 * (x0, y0, x1, y1); a box with x1 <= x0 or y1 <= y0 is ignored.  Returns
 * the positive count. */
int64_t kpl__fcos_assign(const kpl__fcos_level *lv, int nlevels, const float *xy,
                         const float *boxes, const int64_t *labels, int64_t nb, double radius,
                         int64_t *cls, float *ltrb, float *ctr);

/* FCOS's training losses, as the paper and mmdetection's FCOS define them:
 * the levels and their regression ranges, center sampling's radius (0:
 * none) and the focal loss's alpha and gamma. */
typedef struct {
    int levels, stride[KPL_FCOS_MAX_LEVELS];
    double lo[KPL_FCOS_MAX_LEVELS], hi[KPL_FCOS_MAX_LEVELS];
    double radius, alpha, gamma;
} kpl__fcos_loss_config;

/* The three losses of a batch from the head's outputs o (every level's
 * class logits, then distances, then centerness logits; kpl_nn_fcos_head)
 * and the batch's boxes (n, maxb, 4), labels (n, maxb) and box counts (n),
 * on the host:
 *   loss[0] = sigmoid focal loss over every location and class / N+
 *   loss[1] = sum over positives of centerness target x (1 - GIoU) / sum of
 *             the centerness targets
 *   loss[2] = BCE of the centerness logits over positives / N+
 * N+ the positives (at least 1).  With t and more than one rank both
 * normalisers are the average over the ranks of their own (as
 * mmdetection's reduce_mean), so that with DDP's mean of gradients 2 ranks
 * x 4 images learn what 1 x 8 does.  ranks NULL: this process alone.  The
 * losses are pool-owned scalars; *positives (may be NULL) receives this
 * batch's positive count. */
kpl_status kpl__fcos_loss(const kpl__fcos_loss_config *c, const kpl_tensor_list *o, int64_t n,
                          const float *boxes, const int64_t *labels, const int64_t *nboxes,
                          int64_t maxb, const kpl_detector_ranks *ranks, kpl_tensor **loss,
                          int64_t *positives);

/* FCOS's inference (docs/detection.md, "Evaluation"): the levels'
 * strides, the classes, and the decoding's keys (task.detection.*). */
typedef struct {
    int levels, stride[KPL_FCOS_MAX_LEVELS];
    int64_t classes, topk, max_dets;
    double score_thresh, nms_iou;
} kpl__fcos_decode_config;

/* Image i's detections from the head's outputs on the host (per level l:
 * class logits lc[l] (n, classes, h, w), distances lr[l] (n, 4, h, w),
 * centerness logits lz[l] (n, 1, h, w), hw[l] = {h, w}): per level,
 * scores sqrt(sigmoid(class) x sigmoid(centerness)) above score_thresh
 * at locations inside img_h x img_w, the level's topk best; boxes decoded
 * and clipped to the image; class-wise NMS at nms_iou; the max_dets best,
 * best first: boxes (k, 4) in the input's pixels, scores, labels.
 * Returns k, or < 0 on failure. */
int64_t kpl__fcos_detect_image(const kpl__fcos_decode_config *d, float *const *lc,
                               float *const *lr, float *const *lz, const int64_t (*hw)[2],
                               int64_t i, double img_h, double img_w, float *out_box,
                               float *out_score, int64_t *out_label);

#endif /* KPL_FCOS_IMPL_H */
