/*
 * ops_vision.c — the front end of the detection kernels (kpl_k_box_*,
 * kpl_k_nms): the checks of boxes, values included (they decide results),
 * then the dispatch to cpu/cpu_vision.c or cuda/cuda_vision.cu.
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
    const void *h = kpl_tensor_host_data((kpl_tensor *)boxes);
    if (!h) return kpl_last_status();
    bool f64 = boxes->dtype == KPL_F64;
    for (int64_t i = 0; i < boxes->shape[0]; i++) {
        double v[4];
        for (int k = 0; k < 4; k++)
            v[k] = f64 ? ((const double *)h)[4 * i + k] : ((const float *)h)[4 * i + k];
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
