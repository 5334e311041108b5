/*
 * ops_vision.c — the front end of the detection kernels (kpl_k_box_*,
 * kpl_k_nms, kpl_k_roi_align*): the checks of boxes and rois, values
 * included (they index memory or decide results), then the dispatch to
 * cpu/cpu_vision.c or cuda/cuda_vision.cu.
 */
#include "ops_impl.h"

#include <math.h>

/* ---- boxes ---------------------------------------------------------------------- */

/* An (N, 4) operand of f32 or f64 boxes. */
#define BOXES .rank = 2, .cols = 4, .shape_is = "boxes are (N, 4) rows (x0, y0, x1, y1)", \
              .dtypes = KPL_DT_F32_F64, .dtypes_are = "boxes are f32 or f64"

static const kpl_arg_spec box_arg = {"boxes", BOXES};

/* kpl_k_box_iou(out, a, b) */
enum { IOU_A, IOU_B, IOU_OUT };
static const kpl_op_spec box_iou_spec = {{
    [IOU_A] = {"a", BOXES},
    [IOU_B] = {"b", BOXES, .device = KPL_AS(IOU_A), .dtype = KPL_AS(IOU_A)},
    [IOU_OUT] = {"out", .device = KPL_AS(IOU_A), .dtype = KPL_AS(IOU_A),
                 .disjoint = KPL_ARGSET(IOU_A) | KPL_ARGSET(IOU_B)},
}};
/* kpl_k_nms(keep, boxes, scores, idxs) */
enum { NMS_BOXES, NMS_SCORES, NMS_IDXS, NMS_KEEP };
static const kpl_op_spec nms_spec = {{
    [NMS_BOXES] = {"boxes", BOXES},
    [NMS_SCORES] = {"scores", .dtypes = KPL_DT_F32_F64, .device = KPL_AS(NMS_BOXES)},
    [NMS_IDXS] = {"idxs", .optional = true, .dtypes = KPL_DT(KPL_I64),
                  .device = KPL_AS(NMS_BOXES)},
    [NMS_KEEP] = {"keep", .dtypes = KPL_DT(KPL_I64), .device = KPL_AS(NMS_BOXES)},
}};

/* Every row of checked boxes is a box: finite, x1 >= x0, y1 >= y0. */
static kpl_status box_values(const char *op, const char *name, const kpl_tensor *boxes)
{
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

kpl_status kpl_k_box_check(const char *op, const char *name, const kpl_tensor *boxes)
{
    op = op ? op : "box_check";
    name = name ? name : "boxes";
    CHECK_ARG(op, boxes, name);
    KPL_TRY(kpl__ops_check_arg(op, &box_arg, name, boxes));
    return box_values(op, name, boxes);
}

kpl_status kpl_k_box_iou(kpl_tensor *out, const kpl_tensor *a, const kpl_tensor *b,
                         kpl_box_metric metric, bool pairwise)
{
    const char *op = metric == KPL_BOX_GIOU ? "generalized_box_iou" : "box_iou";
    KPL_CHECK(metric == KPL_BOX_IOU || metric == KPL_BOX_GIOU, KPL_EINVAL,
              "box_iou: unknown metric %d", (int)metric);
    KPL_TRY(kpl__ops_check(op, &box_iou_spec, (const kpl_tensor *[]){a, b, out}));
    int64_t n = a->shape[0], m = b->shape[0], os[2] = {n, m};
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(pairwise || n == m, KPL_ESHAPE, "%s: matched pairs need as many boxes in 'b' %s "
              "as in 'a' %s", op, KPL_SHAPE(b, b1), KPL_SHAPE(a, b2));
    KPL_TRY(same_shape(op, out, "out", pairwise ? 2 : 1, os));
    if (out->numel == 0) return KPL_OK;
    kpl_box_attrs at = {.metric = metric, .pairwise = pairwise, .n = n, .m = m};
    return dispatch(KPL_KOP_BOX, a->dtype, out, a, b, NULL, &at);
}

kpl_status kpl_k_nms(kpl_tensor *keep, int64_t *nkeep, const kpl_tensor *boxes,
                     const kpl_tensor *scores, const kpl_tensor *idxs, double iou_threshold)
{
    const char *op = idxs ? "batched_nms" : "nms";
    KPL_TRY(kpl__ops_check(op, &nms_spec, (const kpl_tensor *[]){boxes, scores, idxs, keep}));
    KPL_CHECK(nkeep != NULL, KPL_EINVAL, "%s: argument 'nkeep' is NULL", op);
    KPL_CHECK(iou_threshold >= 0, KPL_EINVAL, "%s: iou_threshold %g must be >= 0 (a box is "
              "suppressed when its IoU with a kept box is greater)", op, iou_threshold);
    int64_t n = boxes->shape[0];
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(scores->ndim == 1 && scores->shape[0] == n, KPL_ESHAPE,
              "%s: 'scores' has shape %s; expected (%lld), one per row of 'boxes' %s", op,
              KPL_SHAPE(scores, b1), (long long)n, KPL_SHAPE(boxes, b2));
    if (idxs)
        KPL_CHECK(idxs->ndim == 1 && idxs->shape[0] == n, KPL_ESHAPE,
                  "%s: 'idxs' has shape %s; expected (%lld), a class id per row of 'boxes' %s",
                  op, KPL_SHAPE(idxs, b1), (long long)n, KPL_SHAPE(boxes, b2));
    KPL_TRY(same_shape(op, keep, "keep", 1, &n));
    KPL_TRY(box_values(op, "boxes", boxes));
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

/* kpl_k_roi_align(out, x, rois) and kpl_k_roi_align_bwd(gx, gy, rois):
 * the feature map (x or gx, (N, C, H, W)), the rois, the bins (out or gy,
 * (K, C, out_h, out_w)). */
enum { ROI_FEAT, ROI_ROIS, ROI_BINS };
#define ROI_SPEC(feat, bins)                                                                  \
    {{                                                                                        \
        [ROI_FEAT] = {feat, .rank = 4, .shape_is = "expected (N, C, H, W)",                   \
                      .dtypes = KPL_DT_F32_F64,                                               \
                      .disjoint = KPL_ARGSET(ROI_ROIS) | KPL_ARGSET(ROI_BINS)},               \
        [ROI_ROIS] = {"rois", .rank = 2, .cols = 5,                                           \
                      .shape_is = "rois are (K, 5) rows (batch index, x0, y0, x1, y1)",       \
                      .device = KPL_AS(ROI_FEAT), .dtype = KPL_AS(ROI_FEAT)},                 \
        [ROI_BINS] = {bins, .device = KPL_AS(ROI_FEAT), .dtype = KPL_AS(ROI_FEAT)},           \
    }}
static const kpl_op_spec roi_fwd_spec = ROI_SPEC("x", "out");
static const kpl_op_spec roi_bwd_spec = ROI_SPEC("gx", "gy");

/* The checks the two directions share once their operands passed their
 * spec: the feature map has a plane, the parameters, the bins' shape, the
 * rois' values. */
static kpl_status roi_common(const char *op, const kpl_op_spec *spec, const kpl_tensor *feat,
                             const kpl_tensor *bins, const kpl_tensor *rois,
                             const kpl_roi_align_params *p, kpl_roi_attrs *a)
{
    const char *fname = spec->arg[ROI_FEAT].name, *bname = spec->arg[ROI_BINS].name;
    KPL_CHECK(p != NULL, KPL_EINVAL, "%s: argument 'p' is NULL", op);
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK((feat->shape[2] > 0 && feat->shape[3] > 0) || rois->shape[0] == 0, KPL_ESHAPE,
              "%s: '%s' has shape %s: no feature map to sample the rois from", op, fname,
              KPL_SHAPE(feat, b1));
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
    KPL_TRY(roi_values(op, rois, feat->shape[0], p));
    *a = (kpl_roi_attrs){.n = feat->shape[0], .c = feat->shape[1], .h = feat->shape[2],
                         .w = feat->shape[3], .k = rois->shape[0], .p = *p};
    return KPL_OK;
}

kpl_status kpl_k_roi_align(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *rois,
                           const kpl_roi_align_params *p)
{
    const char *op = "roi_align";
    KPL_TRY(kpl__ops_check(op, &roi_fwd_spec, (const kpl_tensor *[]){x, rois, out}));
    kpl_roi_attrs a;
    KPL_TRY(roi_common(op, &roi_fwd_spec, x, out, rois, p, &a));
    if (out->numel == 0) return KPL_OK;
    return dispatch(KPL_KOP_ROI_ALIGN, x->dtype, out, x, rois, NULL, &a);
}

kpl_status kpl_k_roi_align_bwd(kpl_tensor *gx, const kpl_tensor *gy, const kpl_tensor *rois,
                               const kpl_roi_align_params *p)
{
    const char *op = "roi_align_bwd";
    KPL_TRY(kpl__ops_check(op, &roi_bwd_spec, (const kpl_tensor *[]){gx, rois, gy}));
    kpl_roi_attrs a;
    KPL_TRY(roi_common(op, &roi_bwd_spec, gx, gy, rois, p, &a));
    a.bwd = true;
    if (gx->numel == 0) return KPL_OK;
    if (gy->numel == 0) return kpl_k_fill(gx, 0);
    return dispatch(KPL_KOP_ROI_ALIGN, gx->dtype, gx, gy, rois, NULL, &a);
}

/* ---- the sigmoid focal loss ---------------------------------------------------------- */

/* kpl_k_sigmoid_focal(out, z, y) and its backward (gz, z, y, gy): every
 * operand of one shape. */
enum { FOC_Z, FOC_Y, FOC_OUT, FOC_GY };
#define FOCAL_ZY_SPEC                                                                         \
    [FOC_Z] = {"z", .dtypes = KPL_DT_FLOAT},                                                  \
    [FOC_Y] = {"y", .device = KPL_AS(FOC_Z), .dtype = KPL_AS(FOC_Z), .shape = KPL_AS(FOC_Z)}
static const kpl_op_spec focal_spec = {{
    FOCAL_ZY_SPEC,
    [FOC_OUT] = {"out", .device = KPL_AS(FOC_Z), .dtype = KPL_AS(FOC_Z), .shape = KPL_AS(FOC_Z),
                 .disjoint = KPL_ARGSET(FOC_Z) | KPL_ARGSET(FOC_Y)},
}};
static const kpl_op_spec focal_bwd_spec = {{
    FOCAL_ZY_SPEC,
    [FOC_OUT] = {"gz", .device = KPL_AS(FOC_Z), .dtype = KPL_AS(FOC_Z), .shape = KPL_AS(FOC_Z),
                 .disjoint = KPL_ARGSET(FOC_Z) | KPL_ARGSET(FOC_Y) | KPL_ARGSET(FOC_GY)},
    [FOC_GY] = {"gy", .device = KPL_AS(FOC_Z), .dtype = KPL_AS(FOC_Z), .shape = KPL_AS(FOC_Z)},
}};

static kpl_status focal_run(const char *op, kpl_tensor *out, const kpl_tensor *z,
                            const kpl_tensor *y, const kpl_tensor *gy, double alpha, double gamma)
{
    KPL_CHECK(isfinite(gamma) && gamma >= 0 && (alpha < 0 || alpha <= 1), KPL_EINVAL,
              "%s: gamma %g must be finite and >= 0, alpha %g in [0, 1] (or negative: no "
              "weighting)", op, gamma, alpha);
    kpl_focal_attrs a = {.bwd = gy != NULL, .n = z->numel, .alpha = alpha, .gamma = gamma};
    if (out->numel == 0) return KPL_OK;
    if (is_half(z->dtype) && !native_half(KPL_KOP_FOCAL, out, z->dtype))
        return kpl__ops_via_f32(KPL_KOP_FOCAL, out, false, z, y, gy, &a);
    return dispatch(KPL_KOP_FOCAL, z->dtype, out, z, y, gy, &a);
}

kpl_status kpl_k_sigmoid_focal(kpl_tensor *out, const kpl_tensor *z, const kpl_tensor *y,
                               double alpha, double gamma)
{
    const char *op = "sigmoid_focal";
    KPL_TRY(kpl__ops_check(op, &focal_spec, (const kpl_tensor *[]){z, y, out}));
    return focal_run(op, out, z, y, NULL, alpha, gamma);
}

kpl_status kpl_k_sigmoid_focal_bwd(kpl_tensor *gz, const kpl_tensor *z, const kpl_tensor *y,
                                   const kpl_tensor *gy, double alpha, double gamma)
{
    const char *op = "sigmoid_focal_bwd";
    KPL_TRY(kpl__ops_check(op, &focal_bwd_spec, (const kpl_tensor *[]){z, y, gz, gy}));
    return focal_run(op, gz, z, y, gy, alpha, gamma);
}
