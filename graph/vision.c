/*
 * vision.c — the detection ops of vision.h.  The box metrics: argument
 * checks, then either the fused kernel (kernels/: cpu_vision.c,
 * cuda_vision.cu) or, when the result is to be recorded, the same formula
 * in recorded element-wise ops, whose gradients (autograd/grad_fns.c) are
 * again recorded ops, so IoU and GIoU are differentiable to any order with
 * no gradient function of their own.  The composition costs ~15 (IoU) or ~25 (GIoU) passes over the
 * (N, M) result where the kernel takes one, and keeps their inputs for
 * the backward pass: the fused kernel serves every call that records
 * nothing (matching anchors to targets, evaluation, NMS).
 */
#include "graph_impl.h"
#include "ir_impl.h"
#include "vision.h"

#include <float.h>
#include <math.h>

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

/* ---- ROI Align ------------------------------------------------------------------------- */

/* roi_align (in = x) or its adjoint (in = gy) into a new `shape`, recorded
 * with the rois cut from the graph: they take no gradient (as
 * torchvision's). */
static kpl_tensor *roi_op(kpl_op op, kpl_tensor *in, kpl_tensor *rois, const int64_t *shape,
                          const kpl_roi_align_params *p)
{
    in = kpl__autocast(op, in);
    if (!in) return NULL;
    kpl_tensor *out = NULL;
    if (kpl_tensor_empty(kpl_tensor_device(in), kpl_tensor_dtype(in), 4, shape, &out) < 0)
        return NULL;
    kpl_status st = op == KPL_OP_ROI_ALIGN ? kpl_k_roi_align(out, in, rois, p)
                                           : kpl_k_roi_align_bwd(out, in, rois, p);
    if (st == KPL_OK) {
        kpl_op_attrs at = {.roi = *p};
        kpl_tensor *ins[2] = {in, kpl_requires_grad(rois) ? kpl_detach(rois) : rois};
        st = ins[1] ? kpl__graph_record(op, &at, 2, ins, out) : kpl_last_status();
        if (st == KPL_OK) kpl__trace_op(op, &at, 2, (kpl_tensor *[]){in, rois}, 1, &out);
    }
    if (st < 0) {
        kpl_tensor_release(out);
        return NULL;
    }
    return kpl_autorelease(out);
}

kpl_tensor *kpl_roi_align(kpl_tensor *x, kpl_tensor *rois, int64_t out_h, int64_t out_w,
                          double spatial_scale, int sampling_ratio, bool aligned)
{
    if (!x || !rois) return NULL;
    kpl_roi_align_params p = {out_h, out_w, spatial_scale, sampling_ratio, aligned};
    /* Sizes that cannot be are left to the kernel's checks, which name
     * the argument at fault before they look at the result's shape. */
    int64_t shape[4] = {kpl_tensor_dim(rois, 0), kpl_tensor_ndim(x) == 4 ? kpl_tensor_dim(x, 1) : 0,
                        out_h > 0 ? out_h : 0, out_w > 0 ? out_w : 0};
    return roi_op(KPL_OP_ROI_ALIGN, x, rois, shape, &p);
}

kpl_tensor *kpl_roi_align_bwd(kpl_tensor *gy, kpl_tensor *rois, const int64_t *x_shape,
                              const kpl_roi_align_params *p)
{
    if (!gy || !rois) return NULL;
    if (!x_shape || !p) {
        KPL_ERROR(KPL_EINVAL, "roi_align_bwd: argument '%s' is NULL", x_shape ? "p" : "x_shape");
        return NULL;
    }
    for (int d = 0; d < 4; d++)
        if (x_shape[d] < 0) {
            KPL_ERROR(KPL_ESHAPE, "roi_align_bwd: x_shape[%d] is %lld", d, (long long)x_shape[d]);
            return NULL;
        }
    return roi_op(KPL_OP_ROI_ALIGN_BWD, gy, rois, x_shape, p);
}

/* In a graph (op_table.h's run and infer columns). */
kpl_status kpl__op_run_roi_align(const kpl_irn *n, kpl_tensor *const *in, kpl_tensor *const *out)
{
    return kpl_k_roi_align(out[0], in[0], in[1], &n->at.roi);
}

kpl_status kpl__op_run_roi_align_bwd(const kpl_irn *n, kpl_tensor *const *in,
                                     kpl_tensor *const *out)
{
    return kpl_k_roi_align_bwd(out[0], in[0], in[1], &n->at.roi);
}

kpl_status kpl__op_infer_roi_align(kpl__infer_ctx *c)
{
    KPL_CHECK(c->x[0]->ndim == 4 && c->x[1]->ndim == 2, KPL_ESHAPE, "roi_align: x and rois");
    c->nd[0] = 4;
    c->sh[0][0] = c->x[1]->shape[0];
    c->sh[0][1] = c->x[0]->shape[1];
    c->sh[0][2] = c->n->at.roi.out_h;
    c->sh[0][3] = c->n->at.roi.out_w;
    return KPL_OK;
}

/* ---- the focal loss -------------------------------------------------------------------------- */

/* Two tensors of one shape, one float dtype: KPL_ESHAPE / KPL_EDTYPE naming
 * both otherwise. */
static kpl_status same_float_shape(const char *op, kpl_tensor *a, const char *an, kpl_tensor *b,
                                   const char *bn)
{
    int nd = kpl_tensor_ndim(a);
    bool same = kpl_tensor_ndim(b) == nd;
    for (int d = 0; same && d < nd; d++) same = kpl_tensor_shape(a)[d] == kpl_tensor_shape(b)[d];
    char b1[96], b2[96];
    KPL_CHECK(same, KPL_ESHAPE, "%s: '%s' %s and '%s' %s must have one shape", op, an,
              kpl_shape_str(nd, kpl_tensor_shape(a), b1, sizeof b1), bn,
              kpl_shape_str(kpl_tensor_ndim(b), kpl_tensor_shape(b), b2, sizeof b2));
    kpl_dtype dt = kpl_tensor_dtype(a);
    KPL_CHECK((dt == KPL_F32 || dt == KPL_F64) && kpl_tensor_dtype(b) == dt, KPL_EDTYPE,
              "%s: '%s' has dtype %s and '%s' %s; both f32 or both f64", op, an,
              kpl_dtype_name(dt), bn, kpl_dtype_name(kpl_tensor_dtype(b)));
    return KPL_OK;
}

kpl_tensor *kpl_sigmoid_focal_loss(kpl_tensor *z, kpl_tensor *y, double alpha, double gamma,
                                   kpl_reduction red)
{
    static const char op[] = "sigmoid_focal_loss";
    if (!z || !y) return NULL;
    if (same_float_shape(op, z, "logits", y, "targets") < 0) return NULL;
    if (!(gamma >= 0 && isfinite(gamma)) || !(alpha < 0 || alpha <= 1)) {
        KPL_ERROR(KPL_EINVAL, "%s: gamma %g must be finite and >= 0, alpha %g in [0, 1] (or "
                  "negative: no weighting)", op, gamma, alpha);
        return NULL;
    }
    if (red != KPL_REDUCE_MEAN && red != KPL_REDUCE_SUM && red != KPL_REDUCE_NONE) {
        KPL_ERROR(KPL_EINVAL, "%s: unknown reduction %d", op, (int)red);
        return NULL;
    }
    kpl_tensor *loss;
    if (!kpl_requires_grad(y)) {
        /* the fused op: one kernel each way, nothing but the loss made */
        loss = kpl_sigmoid_focal(z, y, alpha, gamma);
        if (red == KPL_REDUCE_MEAN && kpl_tensor_numel(z) == 0) red = KPL_REDUCE_SUM;
        return kpl__reduce_loss(loss, red);
    }
    loss = kpl_bce_with_logits(z, y, KPL_REDUCE_NONE);
    if (gamma != 0) {
        /* 1 - p_t = y s(-z) + (1 - y) s(z): no cancellation at any z; kept
         * above the smallest normal number, where the power's derivative
         * gamma q^(gamma - 1) is finite (its factor dq/dz is ~0 there). */
        kpl_tensor *q = kpl_add(kpl_mul(y, kpl_sigmoid(kpl_neg(z))),
                                kpl_mul(kpl_scalar_op(KPL_BIN_SUB, y, 1, true), kpl_sigmoid(z)));
        double tiny = kpl_tensor_dtype(z) == KPL_F64 ? DBL_MIN : FLT_MIN;
        q = kpl_scalar_op(KPL_BIN_MAXIMUM, q, tiny, false);
        loss = kpl_mul(loss, gamma == 1 ? q : kpl_scalar_op(KPL_BIN_POW, q, gamma, false));
    }
    if (alpha >= 0) /* alpha y + (1 - alpha)(1 - y) */
        loss = kpl_mul(loss, kpl_scalar_op(KPL_BIN_ADD, kpl_scalar_op(KPL_BIN_MUL, y, 2 * alpha - 1,
                                                                      false), 1 - alpha, false));
    if (red == KPL_REDUCE_MEAN && kpl_tensor_numel(z) == 0) red = KPL_REDUCE_SUM;
    return kpl__reduce_loss(loss, red);
}

/* The fused focal loss (op SIGMOID_FOCAL) or its gradient in the logits
 * (SIGMOID_FOCAL_BWD, given gy), recorded. */
static kpl_tensor *focal_op(kpl_op op, kpl_tensor *z, kpl_tensor *y, kpl_tensor *gy, double alpha,
                            double gamma)
{
    bool fwd = op == KPL_OP_SIGMOID_FOCAL;
    z = kpl__autocast(op, z);
    y = kpl__autocast(op, y);
    if (!fwd) gy = kpl__autocast(op, gy);
    if (!z || !y || (!fwd && !gy)) return NULL;
    kpl_tensor *out = NULL;
    if (kpl_tensor_empty(kpl_tensor_device(z), kpl_tensor_dtype(z), kpl_tensor_ndim(z),
                         kpl_tensor_shape(z), &out) < 0)
        return NULL;
    kpl_status st = fwd ? kpl_k_sigmoid_focal(out, z, y, alpha, gamma)
                        : kpl_k_sigmoid_focal_bwd(out, z, y, gy, alpha, gamma);
    kpl_op_attrs at = {.alpha = alpha, .beta = gamma};
    /* the targets are cut from the tape: they take no gradient here */
    kpl_tensor *ins[3] = {z, kpl_requires_grad(y) ? kpl_detach(y) : y, gy};
    if (st == KPL_OK) st = ins[1] ? kpl__graph_record(op, &at, fwd ? 2 : 3, ins, out)
                                  : kpl_last_status();
    if (st == KPL_OK) kpl__trace_op(op, &at, fwd ? 2 : 3, (kpl_tensor *[]){z, y, gy}, 1, &out);
    if (st < 0) {
        kpl_tensor_release(out);
        return NULL;
    }
    return kpl_autorelease(out);
}

kpl_tensor *kpl_sigmoid_focal(kpl_tensor *logits, kpl_tensor *targets, double alpha,
                              double gamma)
{
    return focal_op(KPL_OP_SIGMOID_FOCAL, logits, targets, NULL, alpha, gamma);
}

kpl_tensor *kpl_sigmoid_focal_bwd(kpl_tensor *logits, kpl_tensor *targets, kpl_tensor *gy,
                                  double alpha, double gamma)
{
    return focal_op(KPL_OP_SIGMOID_FOCAL_BWD, logits, targets, gy, alpha, gamma);
}

kpl_status kpl__op_run_sigmoid_focal(const kpl_irn *n, kpl_tensor *const *in,
                                     kpl_tensor *const *out)
{
    return kpl_k_sigmoid_focal(out[0], in[0], in[1], n->at.alpha, n->at.beta);
}

kpl_status kpl__op_run_sigmoid_focal_bwd(const kpl_irn *n, kpl_tensor *const *in,
                                         kpl_tensor *const *out)
{
    return kpl_k_sigmoid_focal_bwd(out[0], in[0], in[1], in[2], n->at.alpha, n->at.beta);
}

/* ---- box coders ----------------------------------------------------------------------------- */

/* Columns `cols` (n of them) of t (N, m): one recorded index_select. */
static kpl_tensor *pick(kpl_tensor *t, int n, const int64_t *cols)
{
    return kpl_index_select(t, 1, kpl__index_tensor(kpl_tensor_device(t), n, cols));
}

static const int64_t XY[2] = {0, 1}, X1Y1[2] = {2, 3}, XYXY[4] = {0, 1, 0, 1};

/* A constant row (1, n) of t's dtype on t's device. */
static kpl_tensor *row(kpl_tensor *t, int n, const double *v)
{
    int64_t shape[2] = {1, n};
    kpl_tensor *r = NULL;
    if (kpl_tensor_from_data(kpl_tensor_device(t), KPL_F64, 2, shape, v, &r) < 0) return NULL;
    kpl__trace_const(r);
    return kpl_cast(kpl_autorelease(r), kpl_tensor_dtype(t));
}

/* (-1, -1, 1, 1): left and top count towards the point, right and bottom away. */
static kpl_tensor *ltrb_sign(kpl_tensor *t)
{
    return row(t, 4, (const double[]){-1, -1, 1, 1});
}

/* points (P, 2) beside `other` (P, 4), a box argument when `boxes`. */
static kpl_status check_coder_pair(const char *op, kpl_tensor *pts, const char *pn,
                                   kpl_tensor *other, const char *on, int pcols, bool boxes)
{
    char b1[96], b2[96];
    int64_t n = kpl_tensor_dim(other, 0);
    kpl_shape_str(kpl_tensor_ndim(pts), kpl_tensor_shape(pts), b1, sizeof b1);
    kpl_shape_str(kpl_tensor_ndim(other), kpl_tensor_shape(other), b2, sizeof b2);
    KPL_CHECK(kpl_tensor_ndim(other) == 2 && kpl_tensor_dim(other, 1) == 4, KPL_ESHAPE,
              "%s: '%s' has shape %s; expected (N, 4)", op, on, b2);
    KPL_CHECK(kpl_tensor_ndim(pts) == 2 && kpl_tensor_dim(pts, 1) == pcols &&
                  kpl_tensor_dim(pts, 0) == n,
              KPL_ESHAPE, "%s: '%s' has shape %s; expected (%lld, %d), a row per row of '%s' %s",
              op, pn, b1, (long long)n, pcols, on, b2);
    kpl_dtype dt = kpl_tensor_dtype(other);
    KPL_CHECK((dt == KPL_F32 || dt == KPL_F64) && kpl_tensor_dtype(pts) == dt, KPL_EDTYPE,
              "%s: '%s' has dtype %s and '%s' %s; both f32 or both f64", op, pn,
              kpl_dtype_name(kpl_tensor_dtype(pts)), on, kpl_dtype_name(dt));
    KPL_CHECK(kpl_tensor_device(pts) == kpl_tensor_device(other), KPL_EDEVICE,
              "%s: '%s' is on %s but '%s' is on %s (copy explicitly with kpl_to_device)", op, pn,
              kpl_device_name(kpl_tensor_device(pts)), on,
              kpl_device_name(kpl_tensor_device(other)));
    return boxes ? kpl_k_box_check(op, on, other) : KPL_OK;
}

kpl_tensor *kpl_box_encode_ltrb(kpl_tensor *points, kpl_tensor *boxes)
{
    if (!points || !boxes) return NULL;
    if (check_coder_pair("box_encode_ltrb", points, "points", boxes, "boxes", 2, true) < 0)
        return NULL;
    return kpl_mul(kpl_sub(boxes, pick(points, 4, XYXY)), ltrb_sign(boxes));
}

kpl_tensor *kpl_box_decode_ltrb(kpl_tensor *points, kpl_tensor *ltrb)
{
    if (!points || !ltrb) return NULL;
    if (check_coder_pair("box_decode_ltrb", points, "points", ltrb, "ltrb", 2, false) < 0)
        return NULL;
    return kpl_add(pick(points, 4, XYXY), kpl_mul(ltrb, ltrb_sign(ltrb)));
}

/* Every box of `t` (checked boxes) has a positive width and height. */
static kpl_status positive_sizes(const char *op, const char *name, kpl_tensor *t)
{
    int64_t n = kpl_tensor_dim(t, 0);
    if (n == 0) return KPL_OK;
    const void *h = kpl_tensor_host_data(t);
    if (!h) return kpl_last_status();
    for (int64_t i = 0; i < n; i++) {
        double v[4];
        kpl__host_row(h, kpl_tensor_dtype(t), i, 4, v);
        KPL_CHECK(v[2] > v[0] && v[3] > v[1], KPL_EINVAL,
                  "%s: '%s' row %lld (%g, %g, %g, %g) has no %s; the delta coder divides by "
                  "widths and heights", op, name, (long long)i, v[0], v[1], v[2], v[3],
                  v[2] > v[0] ? "height" : "width");
    }
    return KPL_OK;
}

static const kpl_box_coder *coder_or_default(const kpl_box_coder *c)
{
    static const kpl_box_coder dflt = KPL_BOX_CODER_INIT;
    return c ? c : &dflt;
}

static kpl_status check_coder(const char *op, const kpl_box_coder *c)
{
    for (int k = 0; k < 4; k++)
        KPL_CHECK(isfinite(c->weights[k]) && c->weights[k] > 0, KPL_EINVAL,
                  "%s: coder weight %d is %g; weights are finite and positive", op, k,
                  c->weights[k]);
    KPL_CHECK(!isnan(c->clip), KPL_EINVAL, "%s: the coder's clip is NaN", op);
    return KPL_OK;
}

/* Widths and heights (N, 2) and centres (N, 2) of boxes (N, 4), as
 * torchvision's BoxCoder computes them: x0 + 0.5 w. */
static void box_sizes(kpl_tensor *b, kpl_tensor **wh, kpl_tensor **ctr)
{
    kpl_tensor *lo = pick(b, 2, XY);
    *wh = kpl_sub(pick(b, 2, X1Y1), lo);
    *ctr = kpl_add(lo, kpl_scalar_op(KPL_BIN_MUL, *wh, 0.5, false));
}

kpl_tensor *kpl_box_encode_delta(kpl_tensor *boxes, kpl_tensor *anchors,
                                 const kpl_box_coder *coder)
{
    static const char op[] = "box_encode_delta";
    const kpl_box_coder *c = coder_or_default(coder);
    if (!boxes || !anchors) return NULL;
    if (check_coder(op, c) < 0 ||
        check_coder_pair(op, boxes, "boxes", anchors, "anchors", 4, true) < 0 ||
        kpl_k_box_check(op, "boxes", boxes) < 0 || positive_sizes(op, "anchors", anchors) < 0 ||
        positive_sizes(op, "boxes", boxes) < 0)
        return NULL;
    kpl_tensor *aw, *ac, *bw, *bc;
    box_sizes(anchors, &aw, &ac);
    box_sizes(boxes, &bw, &bc);
    const double *w = c->weights;
    kpl_tensor *dxy = kpl_div(kpl_mul(row(boxes, 2, w), kpl_sub(bc, ac)), aw);
    kpl_tensor *dwh = kpl_mul(row(boxes, 2, w + 2), kpl_log(kpl_div(bw, aw)));
    return kpl_concat(2, (kpl_tensor *[]){dxy, dwh}, 1);
}

kpl_tensor *kpl_box_decode_delta(kpl_tensor *deltas, kpl_tensor *anchors,
                                 const kpl_box_coder *coder)
{
    static const char op[] = "box_decode_delta";
    const kpl_box_coder *c = coder_or_default(coder);
    if (!deltas || !anchors) return NULL;
    if (check_coder(op, c) < 0 ||
        check_coder_pair(op, deltas, "deltas", anchors, "anchors", 4, true) < 0)
        return NULL;
    kpl_tensor *aw, *ac;
    box_sizes(anchors, &aw, &ac);
    const double *w = c->weights;
    kpl_tensor *dxy = kpl_div(pick(deltas, 2, XY), row(deltas, 2, w));
    kpl_tensor *dwh = kpl_div(pick(deltas, 2, X1Y1), row(deltas, 2, w + 2));
    dwh = kpl_scalar_op(KPL_BIN_MINIMUM, dwh, c->clip, false);
    kpl_tensor *ctr = kpl_add(kpl_mul(dxy, aw), ac);
    kpl_tensor *half = kpl_scalar_op(KPL_BIN_MUL, kpl_mul(kpl_exp(dwh), aw), 0.5, false);
    /* (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2) */
    return kpl_add(pick(ctr, 4, XYXY), kpl_mul(pick(half, 4, XYXY), ltrb_sign(deltas)));
}
