/*
 * cocoeval_impl.h — what the COCO evaluation's files share (not
 * installed): metrics/cocoeval.c (matching, accumulation, the figures) and
 * metrics/cocoeval_json.c (COCO's JSON in and out).
 */
#ifndef KPL_COCOEVAL_IMPL_H
#define KPL_COCOEVAL_IMPL_H

#include "cocoeval.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>

/* Whether the four numbers of a box are finite. */
static inline bool kpl__coco_finite4(const double b[4])
{
    return isfinite(b[0]) && isfinite(b[1]) && isfinite(b[2]) && isfinite(b[3]);
}

/* The shortest of %.15g, %.16g, %.17g that reads back to v, into buf (as
 * snprintf).  -0 would read back as the integer 0: it is written -0.0. */
int kpl__coco_fmt_num(char *buf, size_t len, double v);

/* Everything kpl_coco_gt_create says, with `name` and `code` for the
 * errors (a file's name and KPL_EFORMAT when it comes from a file). */
kpl_status kpl__coco_gt_build(const int64_t *image_ids, int64_t nimages,
                              const int64_t *category_ids, int64_t ncategories,
                              const kpl_coco_annotation *anns, int64_t nanns, const char *name,
                              kpl_status code, kpl_coco_gt **out);

#endif /* KPL_COCOEVAL_IMPL_H */
