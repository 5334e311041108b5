/*
 * vision.h — box ops for detection, beside graph.h as torchvision.ops sits
 * beside torch.nn: IoU and generalized IoU (differentiable), the GIoU loss
 * FCOS and DETR train with, and non-maximum suppression.
 *
 * Boxes follow torchvision's convention: an (N, 4) tensor (f32 or f64) of
 * rows (x0, y0, x1, y1) in pixels with x1 >= x0 and y1 >= y0; a box's area
 * is (x1 - x0) (y1 - y0), with no +1.  Every op checks its boxes and
 * fails with KPL_EINVAL naming the argument and the first bad row when a
 * coordinate is NaN or infinite or a box is inverted (kpl_k_box_check; on
 * CUDA that reads the boxes back to the host).
 *
 *   kpl_pool *pool = kpl_pool_push();
 *   kpl_tensor *iou = kpl_box_iou(anchors, gt);          // (A, G), e.g. for matching
 *   kpl_tensor *loss = kpl_box_giou_loss(pred, target, KPL_REDUCE_MEAN);
 *   kpl_tensor *keep = NULL;                             // at inference
 *   if (kpl_nms(boxes, scores, 0.5, &keep) < 0) fprintf(stderr, "%s\n", kpl_last_error());
 *   kpl_pool_pop(pool);
 *
 * Gradients: IoU, GIoU and the loss are differentiable with respect to
 * both box arguments, to any order.  When grad mode is on and a box input
 * requires grad they are recorded as a composition of element-wise ops
 * (minimum, maximum, sub, relu, mul, add, where, div), so gradients of
 * gradients come for free; otherwise one fused kernel computes the same
 * bits.  At points where the formula is not smooth (touching or equal
 * edges) the gradient is that of the element-wise ops there (relu's 0 at
 * 0, half to each side of a tie in minimum/maximum).  NMS is not
 * differentiable.
 *
 * Errors and ownership as in graph.h: results are owned by the current
 * pool; a NULL input gives NULL (or its status) and keeps the message of
 * the failure that made it.  Thread-safety: as graph.h (per-thread pools
 * and grad mode; tensors are not locked).
 */
#ifndef KPL_VISION_H
#define KPL_VISION_H

#include "graph.h"

#ifdef __cplusplus
extern "C" {
#endif

/* IoU of every pair: a (N, 4), b (M, 4) of one dtype and device -> (N, M),
 * intersection / union, and 0 where the union is 0 (two boxes without
 * area; torchvision gives NaN there).  torchvision.ops.box_iou. */
kpl_tensor *kpl_box_iou(kpl_tensor *a, kpl_tensor *b);

/* Generalized IoU of every pair -> (N, M): IoU - (C - union) / C with C
 * the area of the smallest box enclosing both, in [-1, 1]; the second
 * term is 0 where C is 0 (then both boxes are one point or lie on one
 * line, and so the GIoU is 0, where torchvision gives NaN).
 * torchvision.ops.generalized_box_iou. */
kpl_tensor *kpl_generalized_box_iou(kpl_tensor *a, kpl_tensor *b);

/* 1 - GIoU of matched pairs pred[i], target[i] (both (N, 4), one dtype and
 * device), reduced: KPL_REDUCE_NONE gives (N), SUM and MEAN a scalar; the
 * mean of no pairs is 0 (as torchvision.ops.generalized_box_iou_loss).
 * Ratios with a zero denominator are 0 as above, where torchvision adds
 * eps = 1e-7 to both denominators instead (a difference of ~1e-7
 * relative).  Gradients reach pred and target. */
kpl_tensor *kpl_box_giou_loss(kpl_tensor *pred, kpl_tensor *target, kpl_reduction red);

/* Non-maximum suppression, torchvision.ops.nms: boxes (N, 4) are visited
 * by decreasing score (scores (N), f32 or f64) and each is kept unless its
 * IoU with a box kept before it is greater than iou_threshold (strictly
 * greater: an IoU equal to the threshold does not suppress).  Equal scores
 * are visited by lower index first; NaN scores rank above every number
 * (as torch.sort and kpl_topk), so a NaN-scored box is kept first and
 * suppresses its neighbours.  iou_threshold >= 0 (KPL_EINVAL otherwise;
 * above 1 keeps every box).  *keep receives the indices of the kept boxes
 * (KPL_I64, (K), pool-owned) in visiting order, or NULL on error.  Not
 * recorded: no gradient flows through the choice.  Blocking: the count
 * comes back to the host. */
kpl_status kpl_nms(kpl_tensor *boxes, kpl_tensor *scores, double iou_threshold,
                   kpl_tensor **keep);

/* NMS within each class, torchvision.ops.batched_nms: idxs (N) (KPL_I64)
 * gives each box a class id, and boxes of different classes never
 * suppress each other.  *keep is ordered as kpl_nms's, by decreasing score
 * over all classes (ties by lower index), as torchvision's. */
kpl_status kpl_batched_nms(kpl_tensor *boxes, kpl_tensor *scores, kpl_tensor *idxs,
                           double iou_threshold, kpl_tensor **keep);

#ifdef __cplusplus
}
#endif
#endif /* KPL_VISION_H */
