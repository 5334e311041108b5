/*
 * detect_impl.h — what the detection task's files share (not installed):
 * FCOS's locations and target assignment (tasks/fcos_assign.c).
 */
#ifndef KPL_DETECT_IMPL_H
#define KPL_DETECT_IMPL_H

#include "trainer_impl.h"

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

#endif /* KPL_DETECT_IMPL_H */
