/*
 * vision.h — the detection ops, beside graph.h as torchvision.ops sits
 * beside torch.nn: IoU and generalized IoU (differentiable), the GIoU loss
 * FCOS and DETR train with, non-maximum suppression, ROI Align, the
 * sigmoid focal loss, and the box coders of FCOS ((l, t, r, b) distances)
 * and of anchor-based heads ((dx, dy, dw, dh) deltas).
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
 *   kpl_tensor *cls = kpl_sigmoid_focal_loss(logits, onehot, 0.25, 2, KPL_REDUCE_SUM);
 *   kpl_tensor *feat = kpl_roi_align(p3, rois, 7, 7, 1.0 / 8, 2, true);  // (K, C, 7, 7)
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
 * 0, half to each side of a tie in minimum/maximum).  The focal loss and
 * the box coders are compositions of recorded ops too; ROI Align is an
 * op whose gradient (kpl_roi_align_bwd) is an op again.  NMS is not
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

/* ---- ROI Align ------------------------------------------------------------------------ */

/* torchvision.ops.roi_align(x, rois, (out_h, out_w), spatial_scale,
 * sampling_ratio, aligned): x (N, C, H, W) f32 or f64, rois (K, 5) of x's
 * dtype and device, rows (batch index, x0, y0, x1, y1) in the pixels of
 * the image x was computed from -> (K, C, out_h, out_w), each bin the
 * average of sampling_ratio^2 bilinear samples (<= 0: ceil(roi side /
 * bins) per side, per roi).  kernels.h's kpl_roi_align_params tells the
 * rules (the -0.5 shift of `aligned`, samples beyond the border).
 * spatial_scale is the feature map's size over the image's (1/8 for a
 * stride-8 level).
 * Errors (KPL_EINVAL naming the row and its values): a roi with a NaN or
 * infinite value, a batch index that is not a whole number in [0, N), x1
 * < x0 or y1 < y0 (torchvision takes inverted rois and makes them 1 x 1
 * or empty), or more than KPL_ROI_ALIGN_MAX_GRID samples per bin side;
 * out_h, out_w < 1 or spatial_scale <= 0; shapes, dtypes and devices
 * (KPL_ESHAPE, KPL_EDTYPE, KPL_EDEVICE).  The rois are read on the host.
 * Gradients reach x, to any order (recorded as an op whose gradient is
 * kpl_roi_align_bwd, recorded as well); the rois get none, as
 * torchvision's, even when they require grad. */
kpl_tensor *kpl_roi_align(kpl_tensor *x, kpl_tensor *rois, int64_t out_h, int64_t out_w,
                          double spatial_scale, int sampling_ratio, bool aligned);
/* The adjoint of roi_align in x: gy (K, C, out_h, out_w) spread onto
 * zeros of x_shape (N, C, H, W) with the samples' bilinear weights.  Its
 * own gradient (in gy) is roi_align with the same rois. */
kpl_tensor *kpl_roi_align_bwd(kpl_tensor *gy, kpl_tensor *rois, const int64_t *x_shape,
                              const kpl_roi_align_params *p);

/* ---- the focal loss ----------------------------------------------------------------------- */

/* Sigmoid focal loss (Lin et al. 2017), torchvision.ops.sigmoid_focal_loss:
 * per element alpha_t (1 - p_t)^gamma CE, with p = sigmoid(logits), CE the
 * binary cross entropy of the logits (kpl_bce_with_logits), 1 - p_t = y (1
 * - p) + (1 - y) p and alpha_t = alpha y + (1 - alpha)(1 - y), y the
 * target; then reduced (KPL_REDUCE_NONE: logits' shape; SUM, MEAN: a
 * scalar; the mean of nothing is 0 where torchvision's is NaN).  targets
 * have the logits' shape (no broadcasting), dtype (f32 or f64) and device;
 * they are meant to be 0 or 1, and soft values in [0, 1] follow the same
 * formula.  alpha < 0 leaves alpha_t out; otherwise alpha is in [0, 1].
 * gamma >= 0 (0: the cross entropy, weighted).
 * Numerically: CE is two softplus terms and 1 - p_t is y sigmoid(-z) + (1
 * - y) sigmoid(z), sums of non-negative terms, so no |logit| overflows or
 * cancels (torchvision's 1 - p_t is 0 from |z| ~ 17 in f32); 1 - p_t is
 * kept above the dtype's smallest normal number before the power, so the
 * gradient stays finite for any gamma (torchvision's is NaN for gamma < 1
 * there).  Differentiable in both inputs, to any order: a composition of
 * recorded element-wise ops. */
kpl_tensor *kpl_sigmoid_focal_loss(kpl_tensor *logits, kpl_tensor *targets, double alpha,
                                   double gamma, kpl_reduction red);
/* The fused op under kpl_sigmoid_focal_loss when the targets need no
 * gradient: the per-element losses (reduction 'none') in one kernel, the
 * same formula; its gradient in the logits is kpl_sigmoid_focal_bwd (gy
 * times the derivative, one kernel), itself differentiable (its own
 * gradient is composed).  The targets get no gradient through these. */
kpl_tensor *kpl_sigmoid_focal(kpl_tensor *logits, kpl_tensor *targets, double alpha,
                              double gamma);
kpl_tensor *kpl_sigmoid_focal_bwd(kpl_tensor *logits, kpl_tensor *targets, kpl_tensor *gy,
                                  double alpha, double gamma);

/* ---- box coders --------------------------------------------------------------------------- */

/* FCOS's regression targets: the distances (l, t, r, b) = (px - x0, py -
 * y0, x1 - px, y1 - py) from each point (P, 2) rows (px, py) to the sides
 * of its box (P, 4) -> (P, 4); negative where the point lies outside.
 * Points and boxes share dtype (f32, f64) and device; the boxes are
 * checked as boxes. */
kpl_tensor *kpl_box_encode_ltrb(kpl_tensor *points, kpl_tensor *boxes);
/* The inverse: boxes (px - l, py - t, px + r, py + b) -> (P, 4), from
 * points (P, 2) and distances ltrb (P, 4) (not checked: a network's
 * output).  Differentiable in both, to any order. */
kpl_tensor *kpl_box_decode_ltrb(kpl_tensor *points, kpl_tensor *ltrb);

/* The (dx, dy, dw, dh) coder of anchor-based heads (Faster R-CNN,
 * RetinaNet; torchvision's BoxCoder): weights (wx, wy, ww, wh) scale the
 * four codes; decoding clamps dw and dh from above at `clip` (bbox_xform_
 * clip) before exponentiating them, which keeps a wild prediction from
 * overflowing. */
typedef struct {
    double weights[4]; /* finite, > 0; (10, 10, 5, 5) for Faster R-CNN's box head */
    double clip;       /* not NaN; +inf: no clamp */
} kpl_box_coder;
/* weights 1 and clip log(1000 / 16), torchvision's defaults. */
#define KPL_BOX_CODER_INIT {{1.0, 1.0, 1.0, 1.0}, 4.135166556742356}

/* Encodes matched boxes (N, 4) (e.g. ground truth) relative to anchors
 * (N, 4) (torchvision's BoxCoder.encode_single(boxes, anchors)): with
 * widths, heights and centres w, h, cx, cy, dx = wx (cx - cx_a) / w_a, dy
 * = wy (cy - cy_a) / h_a, dw = ww log(w / w_a), dh = wh log(h / h_a) ->
 * (N, 4).  Both arguments must be boxes of positive width and height
 * (KPL_EINVAL naming the row otherwise); coder NULL: KPL_BOX_CODER_INIT.
 * Differentiable in both, to any order. */
kpl_tensor *kpl_box_encode_delta(kpl_tensor *boxes, kpl_tensor *anchors,
                                 const kpl_box_coder *coder);
/* Decodes deltas (N, 4) relative to anchors (N, 4) into boxes (N, 4)
 * (BoxCoder.decode_single): centre (cx_a + dx / wx w_a, ...), size
 * (exp(min(dw / ww, clip)) w_a, ...).  Several predictions per anchor
 * (torchvision's (N, 4 K) codes): reshape them to (N K, 4) against the
 * anchors repeated.  Differentiable in both, to any order (no gradient
 * through a clamped dw or dh, as torch.clamp). */
kpl_tensor *kpl_box_decode_delta(kpl_tensor *deltas, kpl_tensor *anchors,
                                 const kpl_box_coder *coder);

#ifdef __cplusplus
}
#endif
#endif /* KPL_VISION_H */
