/*
 * fuzz_cocoeval.c — COCO box evaluation (trainer/metrics/cocoeval.c): the
 * instances parser, the results parser, then the evaluation of what
 * parsed, and kpl_coco_dets_save / kpl_coco_dets_load of the detections.
 *
 * Input: a COCO instances file, a line "#--", a COCO results file:
 *   {"images": [{"id": 1}], "categories": [{"id": 3}], "annotations": [...]}
 *   #--
 *   [{"image_id": 1, "category_id": 3, "bbox": [0, 0, 10, 10], "score": 0.9}]
 *
 * Checks: every figure is -1 or in [0, 1]; the counts add up; the
 * detections saved read back to the very same doubles.
 */
#include "fuzz_common.h"

#include "cocoeval.h"

#define SEP "\n#--\n"

static void check_stats(const kpl_coco_stats *s, int64_t ndets)
{
    for (int i = 0; i < KPL_COCO_NSTATS; i++)
        if (!(s->stats[i] == -1 || (s->stats[i] >= 0 && s->stats[i] <= 1))) abort();
    if (s->detections + s->dets_skipped != ndets || s->gt_boxes < 0 || s->gt_skipped < 0)
        abort();
}

static void round_trip(const kpl_coco_detection *d, int64_t n)
{
    char path[PATH_MAX];
    fuzz_path(path, fuzz_dir("cocoeval"), "dets.json");
    if (fuzz_st(kpl_coco_dets_save(path, d, n), "save") < 0) abort(); /* all finite */
    kpl_coco_detection *back = NULL;
    int64_t m = 0;
    if (fuzz_st(kpl_coco_dets_load(path, &back, &m), "load") < 0 || m != n ||
        (n && memcmp(back, d, sizeof *d * (size_t)n) != 0))
        abort();
    free(back);
    unlink(path);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_reset();
    fuzz_part parts[2];
    int np = fuzz_split(data, size, SEP, strlen(SEP), parts, 2);
    kpl_coco_gt *gt = NULL;
    kpl_coco_detection *dets = NULL;
    int64_t n = 0;
    kpl_status gst = fuzz_st(kpl_coco_gt_parse((const char *)parts[0].p, parts[0].n, NULL, &gt),
                             "ground truth");
    if ((gst < 0) != (gt == NULL)) abort();
    if (np == 2 && fuzz_st(kpl_coco_dets_parse((const char *)parts[1].p, parts[1].n, NULL, &dets,
                                               &n), "detections") == KPL_OK) {
        if (n < 0 || (n == 0) != (dets == NULL)) abort();
        round_trip(dets, n);
        kpl_coco_stats s;
        if (gt && fuzz_st(kpl_coco_evaluate(gt, dets, n, &s), "evaluate") == KPL_OK)
            check_stats(&s, n);
    }
    free(dets);
    kpl_coco_gt_destroy(gt);
    return 0;
}
