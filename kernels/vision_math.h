/*
 * vision_math.h — the box formulas, written once.
 *
 * Included by the CPU loops (kernels/cpu/cpu_vision.c) and the CUDA kernels
 * (kernels/cuda/cuda_vision.cu), as eltwise_math.h is for the element-wise
 * ops: box IoU / GIoU and NMS's threshold, then ROI Align's sampling, and
 * bilinear resizing's taps (cpu_pool.c, cuda_nn.cu).
 * The IoU / GIoU below performs, step by step, the operations that
 * graph/vision.c records when gradients are wanted (minimum, maximum, sub,
 * relu, mul, add, where, div; each rounded once), and both kernel files are
 * compiled without fusing a multiply and an add into an FMA, so the fused
 * kernel and the recorded composition give the same bits.
 */
#ifndef KPL_VISION_MATH_H
#define KPL_VISION_MATH_H

#include "eltwise_math.h"

/* The area of box (x0, y0, x1, y1). */
#define KPL_BOX_AREA(x0, y0, x1, y1) (((x1) - (x0)) * ((y1) - (y0)))

/* IoU (giou = 0) or GIoU (giou = 1) of box a = (ax0, ay0, ax1, ay1) of
 * area aa with box b of area ba.  A ratio whose denominator is 0 counts
 * as 0: the union is 0 only when both boxes have no area, and the
 * enclosing box has no area only when the union has none. */
#define KPL__BOX_METRIC_BODY(T)                                  \
    T iw = kpl_minv(ax1, bx1) - kpl_maxv(ax0, bx0);              \
    T ih = kpl_minv(ay1, by1) - kpl_maxv(ay0, by0);              \
    iw = iw < (T)0 ? (T)0 : iw;                                  \
    ih = ih < (T)0 ? (T)0 : ih;                                  \
    T inter = iw * ih;                                           \
    T uni = (aa + ba) - inter;                                   \
    T iou = inter / (uni > (T)0 ? uni : (T)1);                   \
    if (!giou) return iou;                                       \
    T cw = kpl_maxv(ax1, bx1) - kpl_minv(ax0, bx0);              \
    T ch = kpl_maxv(ay1, by1) - kpl_minv(ay0, by0);              \
    T encl = cw * ch;                                            \
    return iou - (encl - uni) / (encl > (T)0 ? encl : (T)1);

#if defined(__CUDACC__)
template <typename T>
KPL_HD T kpl_box_eval(T ax0, T ay0, T ax1, T ay1, T aa, T bx0, T by0, T bx1, T by1, T ba, int giou)
{
    KPL__BOX_METRIC_BODY(T)
}
#else
#define KPL__BOX_METRIC_DEF(T, tn)                                                       \
    KPL_HD T kpl_box_eval_##tn(T ax0, T ay0, T ax1, T ay1, T aa, T bx0, T by0, T bx1, T by1, \
                               T ba, int giou)                                           \
    {                                                                                    \
        KPL__BOX_METRIC_BODY(T)                                                          \
    }
KPL__BOX_METRIC_DEF(float, f32)
KPL__BOX_METRIC_DEF(double, f64)
#undef KPL__BOX_METRIC_DEF
#endif

/* NMS compares an IoU of the boxes' dtype with a double threshold.  For
 * f32 the comparison runs in float against the largest float not above
 * thr: for a float iou, iou > that exactly when iou > thr in double. */
static inline float kpl_nms_threshold_f32(double thr)
{
    float f = (float)thr;
    if ((double)f > thr) f = nextafterf(f, -HUGE_VALF);
    return f;
}

/* ---- ROI Align --------------------------------------------------------------------------- */

/* torchvision.ops.roi_align's arithmetic, step by step in the order its
 * kernels take, in the features' dtype T.  The CPU (tables of the axis
 * entries below, kernels/cpu/cpu_vision.c) and CUDA (the same entries
 * computed per sample) round alike and compile without FMA, so they give
 * the same bits. */

/* The bins of one roi (batch, x0, y0, x1, y1) on the feature map: the
 * start (y0, x0) of its first bin, the bin size (bh, bw), the samples per
 * bin side (gh, gw: sampling_ratio, or when that is <= 0 ceil(roi side /
 * bins)), and count = max(gh gw, 1), which a bin's sum is divided by.
 * Without `aligned` a roi is at least 1 x 1 (torchvision's legacy rule). */
#define KPL__ROI_GEOM_BODY(T, CEIL)                                              \
    T off = aligned ? (T)0.5 : (T)0;                                             \
    T sx = roi[1] * scale - off, sy = roi[2] * scale - off;                      \
    T rw = (roi[3] * scale - off) - sx, rh = (roi[4] * scale - off) - sy;        \
    if (!aligned) {                                                              \
        rw = rw > (T)1 ? rw : (T)1;                                              \
        rh = rh > (T)1 ? rh : (T)1;                                              \
    }                                                                            \
    g->y0 = sy;                                                                  \
    g->x0 = sx;                                                                  \
    g->bh = rh / (T)oh;                                                          \
    g->bw = rw / (T)ow;                                                          \
    g->gh = sampling > 0 ? (int64_t)sampling : (int64_t)CEIL(rh / (T)oh);        \
    g->gw = sampling > 0 ? (int64_t)sampling : (int64_t)CEIL(rw / (T)ow);        \
    g->count = (T)(g->gh * g->gw > 1 ? g->gh * g->gw : 1);

/* One axis of torchvision's bilinear interpolation at coordinate c of an
 * axis of `size` cells: 0 when the sample lies outside [-1, size] (it adds
 * nothing); else 1 with the neighbouring cells lo <= hi and their weights
 * h (for lo) and l (for hi), h + l = 1.  Coordinates below 0 read cell 0,
 * at or past size - 1 the last cell. */
#define KPL__ROI_AXIS_BODY(T)                   \
    if (c < (T)-1 || c > (T)size) return 0;     \
    if (c <= (T)0) c = (T)0;                    \
    int64_t i = (int64_t)c;                     \
    if (i >= size - 1) {                        \
        i = size - 1;                           \
        c = (T)i;                               \
        e->hi = i;                              \
    } else {                                    \
        e->hi = i + 1;                          \
    }                                           \
    e->lo = i;                                  \
    e->l = c - (T)i;                            \
    e->h = (T)1 - e->l;                         \
    return 1;

/* The coordinate of sample i (of `grid`) in bin p along an axis. */
#define KPL_ROI_COORD(T, start, p, bin, i, grid) \
    ((start) + (T)(p) * (bin) + ((T)(i) + (T)0.5) * (bin) / (T)(grid))

/* The interpolated value at the sample of row entry ey and column entry
 * ex in plane p (w columns): torchvision's w1 v1 + w2 v2 + w3 v3 + w4 v4. */
#define KPL_ROI_BILINEAR(p, w, ey, ex)                                    \
    ((ey).h * (ex).h * (p)[(ey).lo * (w) + (ex).lo] +                     \
     (ey).h * (ex).l * (p)[(ey).lo * (w) + (ex).hi] +                     \
     (ey).l * (ex).h * (p)[(ey).hi * (w) + (ex).lo] +                     \
     (ey).l * (ex).l * (p)[(ey).hi * (w) + (ex).hi])

/* Its adjoint: the output gradient g of a bin of `count` samples spread
 * onto the four cells of plane gp, each through ADD(pointer, value). */
#define KPL_ROI_SCATTER(ADD, gp, w, ey, ex, g, count)                            \
    do {                                                                         \
        ADD(&(gp)[(ey).lo * (w) + (ex).lo], (g) * ((ey).h * (ex).h) / (count));  \
        ADD(&(gp)[(ey).lo * (w) + (ex).hi], (g) * ((ey).h * (ex).l) / (count));  \
        ADD(&(gp)[(ey).hi * (w) + (ex).lo], (g) * ((ey).l * (ex).h) / (count));  \
        ADD(&(gp)[(ey).hi * (w) + (ex).hi], (g) * ((ey).l * (ex).l) / (count));  \
    } while (0)

#if defined(__CUDACC__)
template <typename T> struct kpl_roi_geom {
    T y0, x0, bh, bw, count;
    int64_t gh, gw;
};
template <typename T> struct kpl_roi_axis {
    int64_t lo, hi;
    T l, h;
};
template <typename T>
KPL_HD void kpl_roi_geom_set(kpl_roi_geom<T> *g, const T *roi, T scale, int64_t oh, int64_t ow,
                             int sampling, int aligned)
{
    KPL__ROI_GEOM_BODY(T, ceil)
}
template <typename T> KPL_HD int kpl_roi_axis_at(kpl_roi_axis<T> *e, T c, int64_t size)
{
    KPL__ROI_AXIS_BODY(T)
}
#else
#define KPL__ROI_DEF(T, tn, CEIL)                                                          \
    typedef struct {                                                                       \
        T y0, x0, bh, bw, count;                                                           \
        int64_t gh, gw;                                                                    \
    } kpl_roi_geom_##tn;                                                                   \
    typedef struct {                                                                       \
        int64_t lo, hi;                                                                    \
        T l, h;                                                                            \
    } kpl_roi_axis_##tn;                                                                   \
    KPL_HD void kpl_roi_geom_set_##tn(kpl_roi_geom_##tn *g, const T *roi, T scale,         \
                                      int64_t oh, int64_t ow, int sampling, int aligned)   \
    {                                                                                      \
        KPL__ROI_GEOM_BODY(T, CEIL)                                                        \
    }                                                                                      \
    KPL_HD int kpl_roi_axis_at_##tn(kpl_roi_axis_##tn *e, T c, int64_t size)               \
    {                                                                                      \
        KPL__ROI_AXIS_BODY(T)                                                              \
    }
KPL__ROI_DEF(float, f32, ceilf)
KPL__ROI_DEF(double, f64, ceil)
#undef KPL__ROI_DEF
#endif

/* ---- bilinear resizing ------------------------------------------------------------------ */

/* Output cell i of a side of `out` cells reads input cells i0 and i1 (of
 * `in`) with weights 1 - l and l (kpl_k_upsample_bilinear).  In f64 on
 * every device. */
KPL_HD void kpl_lerp_tap(int64_t i, int64_t in, int64_t out, int align, int64_t *i0, int64_t *i1,
                         double *l)
{
    double s = align ? (out > 1 ? (double)i * (double)(in - 1) / (double)(out - 1) : 0)
                     : ((double)i + 0.5) * (double)in / (double)out - 0.5;
    if (s < 0) s = 0;
    int64_t a = (int64_t)s;
    if (a > in - 1) a = in - 1;
    *i0 = a;
    *i1 = a < in - 1 ? a + 1 : a;
    *l = s - (double)a;
}

/* The sigmoid focal loss of one element (graph/vision.h's formula) and its
 * derivative in the logit, in T with the given exp and log: z the logit,
 * y the target, a alpha (< 0: no alpha_t), g gamma, tiny the dtype's
 * smallest normal number (1 - p_t is kept above it, as the recorded
 * composition does).  Writes `loss` and `dz` (a caller that uses one lets
 * the compiler drop the other).  The cross entropy is y softplus(-z) + (1
 * - y) softplus(z) and 1 - p_t = y sigmoid(-z) + (1 - y) sigmoid(z), sums
 * of non-negative terms; d(q^g)/dz = g q^g (dq/dz) / q, with dq/dz =
 * sigmoid(z) sigmoid(-z) (1 - 2y) and |dq/dz| / q <= 1, so no power below 0
 * is taken.  Only exp and log are called, which have vector forms
 * (libmvec), so a loop of these vectorises: log1p(e) is log(u) e / (u - 1)
 * with u = 1 + e (e where u rounds to 1; Goldberg's accurate form), and
 * q^g is POWQ(q): 1, q, q q for gamma 0, 1, 2 (the usual one), exp(g log q)
 * for other gammas. */
#define KPL_FOCAL_ELEM(T, EXP, LOG, POWQ, z, y, a, g, tiny, loss, dz)                          \
    do {                                                                                      \
        T az_ = (z) < (T)0 ? -(z) : (z);                                                      \
        T e_ = EXP(-az_), u_ = (T)1 + e_, r_ = (T)1 / u_;                                     \
        T lg_ = LOG(u_) * (e_ / (u_ - (T)1));                                                 \
        T l_ = u_ == (T)1 ? e_ : lg_; /* log1p(e) */                                          \
        T spp_ = ((z) > (T)0 ? (z) : (T)0) + l_;  /* softplus(z) */                           \
        T spn_ = ((z) < (T)0 ? -(z) : (T)0) + l_; /* softplus(-z) */                          \
        T s_ = (z) >= (T)0 ? r_ : e_ * r_;        /* sigmoid(z) */                            \
        T c_ = (z) >= (T)0 ? e_ * r_ : r_;        /* sigmoid(-z) */                           \
        T ce_ = (y) * spn_ + ((T)1 - (y)) * spp_;                                             \
        T qr_ = (y) * c_ + ((T)1 - (y)) * s_;                                                 \
        bool in_ = qr_ > (tiny);                                                              \
        T q_ = in_ ? qr_ : (tiny);                                                            \
        T w_ = POWQ(q_);                                                                      \
        T at_ = (a) < (T)0 ? (T)1 : (a) * (y) + ((T)1 - (a)) * ((T)1 - (y));                  \
        T rq_ = in_ ? s_ * c_ * ((T)1 - (T)2 * (y)) / q_ : (T)0;                              \
        (loss) = at_ * ce_ * w_;                                                              \
        (dz) = at_ * w_ * ((s_ - (y)) + (g) * ce_ * rq_);                                     \
    } while (0)
/* q^gamma for KPL_FOCAL_ELEM's POWQ, by the kind of gamma (chosen outside
 * the loop, so each loop has no branch): 0, 1, 2, any (exp(g log q); the
 * caller defines KPL_FOCAL_G and KPL_FOCAL_EXP/LOG for that one). */
#define KPL_FOCAL_POW0(q) (1)
#define KPL_FOCAL_POW1(q) (q)
#define KPL_FOCAL_POW2(q) ((q) * (q))

#endif /* KPL_VISION_MATH_H */
