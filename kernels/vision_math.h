/*
 * vision_math.h — the box formulas, written once.
 *
 * Included by the CPU loops (kernels/cpu/cpu_vision.c) and the CUDA kernels
 * (kernels/cuda/cuda_vision.cu), as eltwise_math.h is for the element-wise
 * ops.  The IoU / GIoU below performs, step by step, the operations that
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

#endif /* KPL_VISION_MATH_H */
