/*
 * vision.c — the box ops of vision.h: argument checks, then either the
 * fused kernel (kernels/: cpu_vision.c, cuda_vision.cu) or, when the
 * result is to be recorded, the same formula in recorded element-wise ops,
 * whose gradients (autograd/grad_fns.c) are again recorded ops, so IoU and
 * GIoU are differentiable to any order with no gradient function of their
 * own.  The composition costs ~15 (IoU) or ~25 (GIoU) passes over the
 * (N, M) result where the kernel takes one, and keeps their inputs for
 * the backward pass: the fused kernel serves every call that records
 * nothing (matching anchors to targets, evaluation, NMS).
 */
#include "graph_impl.h"
#include "vision.h"

/* ---- checks --------------------------------------------------------------------------- */

/* A NULL input is the result of a failed op, whose message stays; a NULL
 * from the caller itself gets one. */
static kpl_status null_input(const char *op, const char *name)
{
    kpl_status last = kpl_last_status();
    return last < 0 ? last : KPL_ERROR(KPL_EINVAL, "%s: argument '%s' is NULL", op, name);
}

/* Both box arguments: boxes each, one dtype and device, and as many rows
 * when they are matched pairs. */
static kpl_status check_pair(const char *op, kpl_tensor *a, const char *an, kpl_tensor *b,
                             const char *bn, bool matched)
{
    KPL_TRY(kpl_k_box_check(op, an, a));
    KPL_TRY(kpl_k_box_check(op, bn, b));
    KPL_CHECK(kpl_tensor_dtype(a) == kpl_tensor_dtype(b), KPL_EDTYPE,
              "%s: '%s' has dtype %s and '%s' %s; they must match", op, an,
              kpl_dtype_name(kpl_tensor_dtype(a)), bn, kpl_dtype_name(kpl_tensor_dtype(b)));
    KPL_CHECK(kpl_tensor_device(a) == kpl_tensor_device(b), KPL_EDEVICE,
              "%s: '%s' is on %s but '%s' is on %s (copy explicitly with kpl_to_device)", op, an,
              kpl_device_name(kpl_tensor_device(a)), bn, kpl_device_name(kpl_tensor_device(b)));
    int64_t n = kpl_tensor_shape(a)[0], m = kpl_tensor_shape(b)[0];
    KPL_CHECK(!matched || n == m, KPL_ESHAPE,
              "%s: '%s' has %lld boxes and '%s' %lld; matched pairs need as many of each", op,
              an, (long long)n, bn, (long long)m);
    return KPL_OK;
}

/* ---- the recorded composition ----------------------------------------------------------- */

/* The coordinate columns of boxes (N, 4), each (N, 1), or (1, N) with
 * `across`: views of one recorded transpose. */
static void columns(kpl_tensor *t, bool across, kpl_tensor **c)
{
    int64_t n = kpl_tensor_shape(t)[0], shape[2] = {across ? 1 : n, across ? n : 1};
    kpl_tensor *tt = kpl_transpose(t, 0, 1);
    for (int k = 0; k < 4; k++) c[k] = kpl_reshape(kpl_narrow(tt, k, 1), 2, shape);
}

/* x where x > 0, else 1: the denominator of a ratio that is 0 when x is
 * (its numerator is then 0 too).  A where, not a clamp, so that the
 * gradient through x stays exact wherever x > 0. */
static kpl_tensor *nonzero(kpl_tensor *x, kpl_tensor *zero, kpl_tensor *one)
{
    return kpl_where(kpl_compare(KPL_BIN_GT, x, zero), x, one);
}

/* vision_math.h's formula, op by op in the same order, so the bits are
 * the kernel's.  a's boxes run down the result; b's across it (pairwise)
 * or down beside a's (matched). */
static kpl_tensor *metric_recorded(kpl_tensor *a, kpl_tensor *b, bool pairwise, bool giou)
{
    kpl_tensor *p[4], *q[4];
    columns(a, false, p);
    columns(b, pairwise, q);
    kpl_device *dev = kpl_tensor_device(a);
    kpl_dtype dt = kpl_tensor_dtype(a);
    kpl_tensor *zero = kpl_full(dev, dt, 0, NULL, 0), *one = kpl_full(dev, dt, 0, NULL, 1);
    kpl_tensor *iw = kpl_relu(kpl_sub(kpl_minimum(p[2], q[2]), kpl_maximum(p[0], q[0])));
    kpl_tensor *ih = kpl_relu(kpl_sub(kpl_minimum(p[3], q[3]), kpl_maximum(p[1], q[1])));
    kpl_tensor *inter = kpl_mul(iw, ih);
    kpl_tensor *area_a = kpl_mul(kpl_sub(p[2], p[0]), kpl_sub(p[3], p[1]));
    kpl_tensor *area_b = kpl_mul(kpl_sub(q[2], q[0]), kpl_sub(q[3], q[1]));
    kpl_tensor *uni = kpl_sub(kpl_add(area_a, area_b), inter);
    kpl_tensor *r = kpl_div(inter, nonzero(uni, zero, one));
    if (giou) {
        kpl_tensor *cw = kpl_sub(kpl_maximum(p[2], q[2]), kpl_minimum(p[0], q[0]));
        kpl_tensor *ch = kpl_sub(kpl_maximum(p[3], q[3]), kpl_minimum(p[1], q[1]));
        kpl_tensor *encl = kpl_mul(cw, ch);
        r = kpl_sub(r, kpl_div(kpl_sub(encl, uni), nonzero(encl, zero, one)));
    }
    if (pairwise) return r;
    int64_t n = kpl_tensor_shape(a)[0];
    return kpl_reshape(r, 1, &n);
}

/* ---- the ops ------------------------------------------------------------------------------- */

/* IoU / GIoU of checked boxes: recorded when an input asks for gradients,
 * else the fused kernel. */
static kpl_tensor *metric(kpl_tensor *a, kpl_tensor *b, bool pairwise, kpl_box_metric m)
{
    if (kpl_grad_enabled() && (kpl_requires_grad(a) || kpl_requires_grad(b)))
        return metric_recorded(a, b, pairwise, m == KPL_BOX_GIOU);
    int64_t shape[2] = {kpl_tensor_shape(a)[0], kpl_tensor_shape(b)[0]};
    kpl_tensor *out = NULL;
    if (kpl_tensor_empty(kpl_tensor_device(a), kpl_tensor_dtype(a), pairwise ? 2 : 1, shape,
                         &out) < 0)
        return NULL;
    if (kpl_k_box_iou(out, a, b, m, pairwise) < 0) {
        kpl_tensor_release(out);
        return NULL;
    }
    return kpl_autorelease(out);
}

static kpl_tensor *pairwise(const char *op, kpl_tensor *a, kpl_tensor *b, kpl_box_metric m)
{
    if (!a || !b) return NULL;
    if (check_pair(op, a, "a", b, "b", false) < 0) return NULL;
    return metric(a, b, true, m);
}

kpl_tensor *kpl_box_iou(kpl_tensor *a, kpl_tensor *b)
{
    return pairwise("box_iou", a, b, KPL_BOX_IOU);
}

kpl_tensor *kpl_generalized_box_iou(kpl_tensor *a, kpl_tensor *b)
{
    return pairwise("generalized_box_iou", a, b, KPL_BOX_GIOU);
}

kpl_tensor *kpl_box_giou_loss(kpl_tensor *pred, kpl_tensor *target, kpl_reduction red)
{
    static const char op[] = "box_giou_loss";
    if (!pred || !target) return NULL;
    if (red != KPL_REDUCE_MEAN && red != KPL_REDUCE_SUM && red != KPL_REDUCE_NONE) {
        KPL_ERROR(KPL_EINVAL, "%s: unknown reduction %d", op, (int)red);
        return NULL;
    }
    if (check_pair(op, pred, "pred", target, "target", true) < 0) return NULL;
    kpl_tensor *per = kpl_scalar_op(KPL_BIN_SUB, metric(pred, target, false, KPL_BOX_GIOU), 1,
                                    true);
    /* The mean of no pairs is 0 (their sum), not 0 / 0. */
    if (red == KPL_REDUCE_MEAN && kpl_tensor_shape(pred)[0] == 0) red = KPL_REDUCE_SUM;
    return kpl__reduce_loss(per, red);
}

static kpl_status nms(const char *op, kpl_tensor *boxes, kpl_tensor *scores, kpl_tensor *idxs,
                      bool batched, double iou_threshold, kpl_tensor **keep)
{
    KPL_CHECK(keep != NULL, KPL_EINVAL, "%s: argument 'keep' is NULL", op);
    *keep = NULL;
    if (!boxes) return null_input(op, "boxes");
    if (!scores) return null_input(op, "scores");
    if (batched && !idxs) return null_input(op, "idxs");
    /* Room for every box; the result is a view of the kept ones. */
    int64_t n = kpl_tensor_ndim(boxes) > 0 ? kpl_tensor_shape(boxes)[0] : 0, nkeep = 0;
    kpl_tensor *all = NULL, *view = NULL;
    KPL_TRY(kpl_tensor_empty(kpl_tensor_device(boxes), KPL_I64, 1, &n, &all));
    kpl_status st = kpl_k_nms(all, &nkeep, boxes, scores, idxs, iou_threshold);
    if (st == KPL_OK) st = kpl_tensor_narrow(all, 0, nkeep, &view);
    kpl_tensor_release(all);
    KPL_TRY(st);
    *keep = kpl_autorelease(view);
    return *keep ? KPL_OK : kpl_last_status();
}

kpl_status kpl_nms(kpl_tensor *boxes, kpl_tensor *scores, double iou_threshold,
                   kpl_tensor **keep)
{
    return nms("nms", boxes, scores, NULL, false, iou_threshold, keep);
}

kpl_status kpl_batched_nms(kpl_tensor *boxes, kpl_tensor *scores, kpl_tensor *idxs,
                           double iou_threshold, kpl_tensor **keep)
{
    return nms("batched_nms", boxes, scores, idxs, true, iou_threshold, keep);
}
