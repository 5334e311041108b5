/*
 * ops_vision.c — the front end of the detection kernels (kpl_k_box_*,
 * kpl_k_nms, kpl_k_roi_align*): the checks of boxes and rois, values
 * included (they index memory or decide results), then the dispatch to
 * cpu/cpu_vision.c or cuda/cuda_vision.cu.
 */
#include "ops_impl.h"

#include <math.h>

/* ---- boxes ---------------------------------------------------------------------- */

static kpl_status box_arg(const char *op, const kpl_tensor *t, const char *name)
{
    char b[KPL_SHAPE_BUF];
    KPL_CHECK(t->ndim == 2 && t->shape[1] == 4, KPL_ESHAPE,
              "%s: '%s' has shape %s; boxes are (N, 4) rows (x0, y0, x1, y1)", op, name,
              KPL_SHAPE(t, b));
    KPL_CHECK(t->dtype == KPL_F32 || t->dtype == KPL_F64, KPL_EDTYPE,
              "%s: '%s' has dtype %s; boxes are f32 or f64", op, name, kpl_dtype_name(t->dtype));
    return KPL_OK;
}

kpl_status kpl_k_box_check(const char *op, const char *name, const kpl_tensor *boxes)
{
    op = op ? op : "box_check";
    name = name ? name : "boxes";
    CHECK_ARG(op, boxes, name);
    KPL_TRY(box_arg(op, boxes, name));
    if (boxes->numel == 0) return KPL_OK;
    const void *h = kpl__host_cdata(boxes);
    if (!h) return kpl_last_status();
    for (int64_t i = 0; i < boxes->shape[0]; i++) {
        double v[4];
        kpl__host_row(h, boxes->dtype, i, 4, v);
        const char *why = !isfinite(v[0]) || !isfinite(v[1]) || !isfinite(v[2]) || !isfinite(v[3])
                              ? "a coordinate is NaN or infinite"
                          : v[2] < v[0] ? "x1 < x0"
                          : v[3] < v[1] ? "y1 < y0"
                                        : NULL;
        if (why)
            return KPL_ERROR(KPL_EINVAL, "%s: '%s' row %lld (%g, %g, %g, %g) is not a box "
                             "(x0, y0, x1, y1): %s", op, name, (long long)i, v[0], v[1], v[2],
                             v[3], why);
    }
    return KPL_OK;
}

kpl_status kpl_k_box_iou(kpl_tensor *out, const kpl_tensor *a, const kpl_tensor *b,
                         kpl_box_metric metric, bool pairwise)
{
    const char *op = metric == KPL_BOX_GIOU ? "generalized_box_iou" : "box_iou";
    CHECK_ARG(op, out, "out");
    CHECK_ARG(op, a, "a");
    CHECK_ARG(op, b, "b");
    KPL_CHECK(metric == KPL_BOX_IOU || metric == KPL_BOX_GIOU, KPL_EINVAL,
              "box_iou: unknown metric %d", (int)metric);
    KPL_TRY(box_arg(op, a, "a"));
    KPL_TRY(box_arg(op, b, "b"));
    KPL_TRY(same_device(op, b, "b", a, "a"));
    KPL_TRY(same_device(op, out, "out", a, "a"));
    KPL_TRY(want_dtype(op, b, "b", a->dtype));
    KPL_TRY(want_dtype(op, out, "out", a->dtype));
    int64_t n = a->shape[0], m = b->shape[0], os[2] = {n, m};
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(pairwise || n == m, KPL_ESHAPE, "%s: matched pairs need as many boxes in 'b' %s "
              "as in 'a' %s", op, KPL_SHAPE(b, b1), KPL_SHAPE(a, b2));
    KPL_TRY(same_shape(op, out, pairwise ? 2 : 1, os));
    KPL_CHECK(out->storage != a->storage && out->storage != b->storage, KPL_EINVAL,
              "%s: 'out' may not alias 'a' or 'b'", op);
    if (out->numel == 0) return KPL_OK;
    kpl_box_attrs at = {.metric = metric, .pairwise = pairwise, .n = n, .m = m};
    return dispatch(KPL_KOP_BOX, a->dtype, out, a, b, NULL, &at);
}

kpl_status kpl_k_nms(kpl_tensor *keep, int64_t *nkeep, const kpl_tensor *boxes,
                     const kpl_tensor *scores, const kpl_tensor *idxs, double iou_threshold)
{
    const char *op = idxs ? "batched_nms" : "nms";
    CHECK_ARG(op, keep, "keep");
    KPL_CHECK(nkeep != NULL, KPL_EINVAL, "%s: argument 'nkeep' is NULL", op);
    CHECK_ARG(op, boxes, "boxes");
    CHECK_ARG(op, scores, "scores");
    KPL_CHECK(iou_threshold >= 0, KPL_EINVAL, "%s: iou_threshold %g must be >= 0 (a box is "
              "suppressed when its IoU with a kept box is greater)", op, iou_threshold);
    KPL_TRY(kpl_k_box_check(op, "boxes", boxes));
    int64_t n = boxes->shape[0];
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(scores->ndim == 1 && scores->shape[0] == n, KPL_ESHAPE,
              "%s: 'scores' has shape %s; expected (%lld), one per row of 'boxes' %s", op,
              KPL_SHAPE(scores, b1), (long long)n, KPL_SHAPE(boxes, b2));
    KPL_CHECK(scores->dtype == KPL_F32 || scores->dtype == KPL_F64, KPL_EDTYPE,
              "%s: 'scores' has dtype %s; f32 and f64 are supported", op,
              kpl_dtype_name(scores->dtype));
    KPL_TRY(same_device(op, scores, "scores", boxes, "boxes"));
    if (idxs) {
        KPL_CHECK(idxs->ndim == 1 && idxs->shape[0] == n, KPL_ESHAPE,
                  "%s: 'idxs' has shape %s; expected (%lld), a class id per row of 'boxes' %s",
                  op, KPL_SHAPE(idxs, b1), (long long)n, KPL_SHAPE(boxes, b2));
        KPL_TRY(want_dtype(op, idxs, "idxs", KPL_I64));
        KPL_TRY(same_device(op, idxs, "idxs", boxes, "boxes"));
    }
    KPL_TRY(want_dtype(op, keep, "keep", KPL_I64));
    KPL_TRY(same_device(op, keep, "keep", boxes, "boxes"));
    KPL_TRY(same_shape(op, keep, 1, &n));
    *nkeep = 0;
    if (n == 0) return KPL_OK;
    kpl_box_attrs at = {.nms = true, .n = n, .thr = iou_threshold, .nkeep = nkeep};
    return dispatch(KPL_KOP_BOX, boxes->dtype, keep, boxes, scores, idxs, &at);
}

/* ---- ROI Align ----------------------------------------------------------------------- */

/* The bins of a checked roi row, in double: its samples per bin side. */
static void roi_grid(const double *r, const kpl_roi_align_params *p, double *gh, double *gw)
{
    double off = p->aligned ? 0.5 : 0, s = p->spatial_scale;
    double rw = (r[3] * s - off) - (r[1] * s - off), rh = (r[4] * s - off) - (r[2] * s - off);
    if (!p->aligned) {
        rw = rw > 1 ? rw : 1;
        rh = rh > 1 ? rh : 1;
    }
    *gh = p->sampling_ratio > 0 ? p->sampling_ratio : ceil(rh / (double)p->out_h);
    *gw = p->sampling_ratio > 0 ? p->sampling_ratio : ceil(rw / (double)p->out_w);
}

/* Every row of rois (k, 5) a roi for n images: finite, a whole batch
 * index in [0, n), x1 >= x0, y1 >= y0, a sampling grid within bounds. */
static kpl_status roi_values(const char *op, const kpl_tensor *rois, int64_t n,
                             const kpl_roi_align_params *p)
{
    if (rois->numel == 0) return KPL_OK;
    const void *h = kpl__host_cdata(rois);
    if (!h) return kpl_last_status();
    for (int64_t i = 0; i < rois->shape[0]; i++) {
        double r[5];
        kpl__host_row(h, rois->dtype, i, 5, r);
        const char *why = NULL;
        char buf[192];
        bool finite = isfinite(r[0]) && isfinite(r[1]) && isfinite(r[2]) && isfinite(r[3]) &&
                      isfinite(r[4]);
        double gh = 0, gw = 0;
        if (finite) roi_grid(r, p, &gh, &gw);
        if (!finite) {
            why = "a value is NaN or infinite";
        } else if (r[0] != floor(r[0]) || r[0] < 0 || r[0] >= (double)n) {
            snprintf(buf, sizeof buf, "batch index %g is not one of the %lld images of 'x' "
                     "(a whole number in [0, %lld))", r[0], (long long)n, (long long)n);
            why = buf;
        } else if (r[3] < r[1]) {
            why = "x1 < x0";
        } else if (r[4] < r[2]) {
            why = "y1 < y0";
        } else if (gh > KPL_ROI_ALIGN_MAX_GRID || gw > KPL_ROI_ALIGN_MAX_GRID) {
            snprintf(buf, sizeof buf, "%g x %g samples per bin, more than %d per side (check "
                     "spatial_scale %g, or pass a sampling_ratio)", gh, gw,
                     KPL_ROI_ALIGN_MAX_GRID, p->spatial_scale);
            why = buf;
        }
        if (why)
            return KPL_ERROR(KPL_EINVAL, "%s: 'rois' row %lld (%g, %g, %g, %g, %g) is not a roi "
                             "(batch index, x0, y0, x1, y1): %s", op, (long long)i, r[0], r[1],
                             r[2], r[3], r[4], why);
    }
    return KPL_OK;
}

/* The checks the two directions share: `feat` is x (forward) or gx
 * (backward), (N, C, H, W); `bins` is out or gy, (K, C, out_h, out_w). */
static kpl_status roi_common(const char *op, const kpl_tensor *feat, const char *fname,
                             const kpl_tensor *bins, const char *bname, const kpl_tensor *rois,
                             const kpl_roi_align_params *p, kpl_roi_attrs *a)
{
    CHECK_ARG(op, feat, fname);
    CHECK_ARG(op, bins, bname);
    CHECK_ARG(op, rois, "rois");
    KPL_CHECK(p != NULL, KPL_EINVAL, "%s: argument 'p' is NULL", op);
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(feat->ndim == 4, KPL_ESHAPE, "%s: '%s' has shape %s; expected (N, C, H, W)", op,
              fname, KPL_SHAPE(feat, b1));
    KPL_CHECK(feat->dtype == KPL_F32 || feat->dtype == KPL_F64, KPL_EDTYPE,
              "%s: '%s' has dtype %s; f32 and f64 are supported", op, fname,
              kpl_dtype_name(feat->dtype));
    KPL_CHECK(rois->ndim == 2 && rois->shape[1] == 5, KPL_ESHAPE,
              "%s: 'rois' has shape %s; rois are (K, 5) rows (batch index, x0, y0, x1, y1)", op,
              KPL_SHAPE(rois, b1));
    KPL_CHECK((feat->shape[2] > 0 && feat->shape[3] > 0) || rois->shape[0] == 0, KPL_ESHAPE,
              "%s: '%s' has shape %s: no feature map to sample the rois from", op, fname,
              KPL_SHAPE(feat, b1));
    KPL_TRY(want_dtype(op, rois, "rois", feat->dtype));
    KPL_TRY(want_dtype(op, bins, bname, feat->dtype));
    KPL_TRY(same_device(op, rois, "rois", feat, fname));
    KPL_TRY(same_device(op, bins, bname, feat, fname));
    KPL_CHECK(p->out_h >= 1 && p->out_w >= 1, KPL_EINVAL,
              "%s: the output size %lld x %lld must be at least 1 x 1", op, (long long)p->out_h,
              (long long)p->out_w);
    KPL_CHECK(isfinite(p->spatial_scale) && p->spatial_scale > 0, KPL_EINVAL,
              "%s: spatial_scale %g must be finite and positive", op, p->spatial_scale);
    KPL_CHECK(p->sampling_ratio <= KPL_ROI_ALIGN_MAX_GRID, KPL_EINVAL,
              "%s: sampling_ratio %d is more than %d samples per bin side", op,
              p->sampling_ratio, KPL_ROI_ALIGN_MAX_GRID);
    int64_t bs[4] = {rois->shape[0], feat->shape[1], p->out_h, p->out_w};
    bool eq = bins->ndim == 4;
    for (int d = 0; eq && d < 4; d++) eq = bins->shape[d] == bs[d];
    KPL_CHECK(eq, KPL_ESHAPE, "%s: '%s' has shape %s; expected %s (rois, channels, out_h, out_w)",
              op, bname, KPL_SHAPE(bins, b1), kpl_shape_str(4, bs, b2, sizeof b2));
    KPL_CHECK(feat->storage != bins->storage && feat->storage != rois->storage, KPL_EINVAL,
              "%s: '%s' may not share memory with '%s' or 'rois'", op, fname, bname);
    KPL_TRY(roi_values(op, rois, feat->shape[0], p));
    *a = (kpl_roi_attrs){.n = feat->shape[0], .c = feat->shape[1], .h = feat->shape[2],
                         .w = feat->shape[3], .k = rois->shape[0], .p = *p};
    return KPL_OK;
}

kpl_status kpl_k_roi_align(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *rois,
                           const kpl_roi_align_params *p)
{
    kpl_roi_attrs a;
    KPL_TRY(roi_common("roi_align", x, "x", out, "out", rois, p, &a));
    if (out->numel == 0) return KPL_OK;
    return dispatch(KPL_KOP_ROI_ALIGN, x->dtype, out, x, rois, NULL, &a);
}

kpl_status kpl_k_roi_align_bwd(kpl_tensor *gx, const kpl_tensor *gy, const kpl_tensor *rois,
                               const kpl_roi_align_params *p)
{
    kpl_roi_attrs a;
    KPL_TRY(roi_common("roi_align_bwd", gx, "gx", gy, "gy", rois, p, &a));
    a.bwd = true;
    if (gx->numel == 0) return KPL_OK;
    if (gy->numel == 0) return kpl_k_fill(gx, 0);
    return dispatch(KPL_KOP_ROI_ALIGN, gx->dtype, gx, gy, rois, NULL, &a);
}
