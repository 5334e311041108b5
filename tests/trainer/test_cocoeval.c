/* test_cocoeval.c — COCO box evaluation (trainer/cocoeval.h): cases small
 * enough to work out by hand, the errors, and pycocotools' own figures on
 * the random awkward cases of data/cocoeval/ (made once by
 * cocoeval_ref.py; cocoeval_ref.py live checks fresh ones when pycocotools
 * is installed). */
#define _GNU_SOURCE
#include "kpl_test.h"

#include <jansson.h>
#include "cocoeval.h"

#include <dirent.h>
#include <stdlib.h>
#include <sys/wait.h>

/* The ground truth of most cases: images 1, 2, 3; categories 1 and 5. */
static const int64_t imgs[] = {1, 2, 3}, cats[] = {5, 1};

static kpl_coco_annotation ann(int64_t id, int64_t img, int64_t cat, double x, double y, double w,
                               double h, int crowd)
{
    return (kpl_coco_annotation){id, img, cat, {x, y, w, h}, w * h, crowd};
}

static kpl_coco_detection det(int64_t img, int64_t cat, double x, double y, double w, double h,
                              double score)
{
    return (kpl_coco_detection){img, cat, {x, y, w, h}, score};
}

static kpl_coco_stats eval(const kpl_coco_annotation *a, int na, const kpl_coco_detection *d,
                           int nd)
{
    kpl_coco_gt *gt = NULL;
    OK(kpl_coco_gt_create(imgs, 3, cats, 2, a, na, &gt));
    kpl_coco_stats s;
    OK(kpl_coco_evaluate(gt, d, nd, &s));
    kpl_coco_gt_destroy(gt);
    return s;
}

#define N(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* Each figure of s against want[] (12 values) within tol. */
static void expect(const kpl_coco_stats *s, const double want[KPL_COCO_NSTATS], double tol)
{
    for (int i = 0; i < KPL_COCO_NSTATS; i++)
        if (!(fabs(s->stats[i] - want[i]) <= tol))
            fail_msg("%s = %.17g, want %.17g", kpl_coco_stat_name((kpl_coco_stat)i), s->stats[i],
                     want[i]);
}

/* pycocotools' precision is tp / (tp + fp + 2^-52): "1" is a hair less. */
#define ONE 1.0
#define TOL 1e-12

static void test_perfect(void **state)
{
    (void)state;
    /* a small, a medium and a large object, each found exactly */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 10, 10, 20, 20, 0), ann(2, 1, 5, 50, 50, 60, 40, 0),
                               ann(3, 2, 1, 0, 0, 120, 100, 0)};
    kpl_coco_detection d[] = {det(1, 1, 10, 10, 20, 20, .9), det(1, 5, 50, 50, 60, 40, .8),
                              det(2, 1, 0, 0, 120, 100, .7)};
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    double want[] = {ONE, ONE, ONE, ONE, ONE, ONE, ONE, ONE, ONE, ONE, ONE, ONE};
    expect(&s, want, TOL);
    assert_int_equal(s.images, 3);
    assert_int_equal(s.categories, 2);
    assert_int_equal(s.gt_boxes, 3);
    assert_int_equal(s.detections, 3);
    assert_int_equal(s.dets_skipped, 0);
}

static void test_iou_062(void **state)
{
    (void)state;
    /* IoU 62/100: a match at thresholds .50, .55, .60 only */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 10, 10, 0)};
    kpl_coco_detection d[] = {det(1, 1, 0, 0, 10, 6.2, .9)};
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    double want[] = {.3, 1, 0, .3, -1, -1, .3, .3, .3, .3, -1, -1};
    expect(&s, want, TOL);
}

static void test_crowd(void **state)
{
    (void)state;
    /* Two detections inside a crowd region (IoU = intersection over the
     * detection's own area = 1) are ignored, the same region matched twice;
     * the object is found. */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 10, 10, 0), ann(2, 1, 1, 100, 100, 100, 100, 1)};
    kpl_coco_detection d[] = {det(1, 1, 110, 110, 20, 20, .9), det(1, 1, 150, 150, 30, 30, .8),
                              det(1, 1, 0, 0, 10, 10, .5)};
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    double want[] = {ONE, ONE, ONE, ONE, -1, -1, 0, 1, 1, 1, -1, -1}; /* AR1: an ignored one */
    expect(&s, want, TOL);
    /* Not a crowd: two false positives first, then one of two objects:
     * precision 1/3 up to recall .5 (51 of 101 points). */
    a[1].iscrowd = 0;
    s = eval(a, N(a), d, N(d));
    double p = 1.0 / 3 * 51 / 101;
    double want2[] = {p, p, p, 1.0 / 3, -1, 0, 0, .5, .5, 1, -1, 0};
    expect(&s, want2, 1e-12);
}

static void test_image_without_gt(void **state)
{
    (void)state;
    /* a confident detection on image 3, which has no object: precision .5 */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 10, 10, 0)};
    kpl_coco_detection d[] = {det(1, 1, 0, 0, 10, 10, .9), det(3, 1, 0, 0, 10, 10, .95)};
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    double want[] = {.5, .5, .5, .5, -1, -1, 1, 1, 1, 1, -1, -1};
    expect(&s, want, TOL);
}

static void test_image_without_dets(void **state)
{
    (void)state;
    /* image 2's object is never detected: recall .5 */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 10, 10, 0), ann(2, 2, 1, 0, 0, 10, 10, 0)};
    kpl_coco_detection d[] = {det(1, 1, 0, 0, 10, 10, .9)};
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    double p = 51.0 / 101;
    double want[] = {p, p, p, p, -1, -1, .5, .5, .5, .5, -1, -1};
    expect(&s, want, TOL);
}

static void test_over_100(void **state)
{
    (void)state;
    /* 150 false positives above the true detection: it is the 151st of its
     * image and category and not evaluated; as the 100th it is, for AR100
     * but not AR10. */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 10, 10, 0)};
    kpl_coco_detection d[151];
    for (int i = 0; i < 150; i++) d[i] = det(1, 1, 200 + i, 200, 10, 10, 0.9 - i * 0.001);
    d[150] = det(1, 1, 0, 0, 10, 10, .5);
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    double zero[] = {0, 0, 0, 0, -1, -1, 0, 0, 0, 0, -1, -1};
    expect(&s, zero, 0);
    assert_int_equal(s.detections, 151);
    d[150].score = 0.8015; /* 99 above it */
    s = eval(a, N(a), d, N(d));
    double want[] = {.01, .01, .01, .01, -1, -1, 0, 0, 1, 1, -1, -1};
    expect(&s, want, TOL);
}

static void test_ties(void **state)
{
    (void)state;
    /* Equal scores keep the input order within an image ... */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 10, 10, 0)};
    kpl_coco_detection fp = det(1, 1, 50, 50, 10, 10, .7), tp = det(1, 1, 0, 0, 10, 10, .7);
    kpl_coco_detection d1[] = {fp, tp}, d2[] = {tp, fp};
    assert_true(fabs(eval(a, N(a), d1, 2).stats[KPL_COCO_AP] - .5) < TOL);
    assert_true(fabs(eval(a, N(a), d2, 2).stats[KPL_COCO_AP] - 1) < TOL);
    /* ... and the image order (by id) across images, whatever the input order. */
    kpl_coco_annotation b[] = {ann(1, 2, 1, 0, 0, 10, 10, 0)};
    kpl_coco_detection fp1 = det(1, 1, 0, 0, 10, 10, .7), tp2 = det(2, 1, 0, 0, 10, 10, .7);
    kpl_coco_detection d3[] = {fp1, tp2}, d4[] = {tp2, fp1};
    assert_true(fabs(eval(b, N(b), d3, 2).stats[KPL_COCO_AP] - .5) < TOL);
    assert_true(fabs(eval(b, N(b), d4, 2).stats[KPL_COCO_AP] - .5) < TOL);
}

static void test_category_without_dets(void **state)
{
    (void)state;
    /* category 5 has an object and no detection: AP 0 for it, 1 for 1 */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 10, 10, 0), ann(2, 1, 5, 0, 0, 10, 10, 0)};
    kpl_coco_detection d[] = {det(1, 1, 0, 0, 10, 10, .9)};
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    double want[] = {.5, .5, .5, .5, -1, -1, .5, .5, .5, .5, -1, -1};
    expect(&s, want, TOL);
}

static void test_empty(void **state)
{
    (void)state;
    /* no detections: 0 wherever there is ground truth */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 100, 100, 0)};
    kpl_coco_stats s = eval(a, N(a), NULL, 0);
    double want[] = {0, 0, 0, -1, -1, 0, 0, 0, 0, -1, -1, 0};
    expect(&s, want, 0);
    /* no ground truth: -1 everywhere, detections or not */
    kpl_coco_detection d[] = {det(1, 1, 0, 0, 10, 10, .9)};
    s = eval(NULL, 0, d, N(d));
    for (int i = 0; i < KPL_COCO_NSTATS; i++) assert_true(s.stats[i] == -1);
}

static void test_boundaries_and_odd_boxes(void **state)
{
    (void)state;
    /* An area of exactly 32^2 is small and medium both (pycocotools'
     * ranges are closed); a detection of negative width overlaps nothing,
     * and with a negative area it is outside every range, so ignored (and
     * the only detection AR1 sees). */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 32, 32, 0)};
    kpl_coco_detection d[] = {det(1, 1, 0, 0, 32, 32, .9), det(1, 1, 5, 5, -10, 10, .95)};
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    double want[] = {ONE, ONE, ONE, ONE, ONE, -1, 0, 1, 1, 1, 1, -1};
    expect(&s, want, TOL);
}

static void test_equal_iou(void **state)
{
    (void)state;
    /* The first detection overlaps both objects equally (IoU 90/110): the
     * later object takes it, as in pycocotools, and the second detection
     * finds the first object exactly.  Had the earlier object been taken,
     * the second detection would reach the other only at IoU 80/120, and
     * thresholds .70 to .80 would see one hit instead of two.  Above .80
     * the first detection is a miss: recall .5 there. */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 10, 10, 0), ann(2, 1, 1, 2, 0, 10, 10, 0)};
    kpl_coco_detection d[] = {det(1, 1, 1, 0, 10, 10, .9), det(1, 1, 0, 0, 10, 10, .8)};
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    assert_true(fabs(s.stats[KPL_COCO_AP] - (7 + 3 * .5 * 51 / 101) / 10) < TOL);
    assert_true(fabs(s.stats[KPL_COCO_AR100] - .85) < TOL);
}

static void test_id_zero(void **state)
{
    (void)state;
    /* pycocotools reads a match to annotation id 0 as no match: a false
     * positive.  Kept for agreement (docs/cocoeval.md). */
    kpl_coco_annotation a[] = {ann(0, 1, 1, 0, 0, 10, 10, 0)};
    kpl_coco_detection d[] = {det(1, 1, 0, 0, 10, 10, .9)};
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    assert_true(s.stats[KPL_COCO_AP] == 0 && s.stats[KPL_COCO_AR100] == 0);
    a[0].id = 1;
    s = eval(a, N(a), d, N(d));
    assert_true(fabs(s.stats[KPL_COCO_AP] - 1) < TOL);
}

static void test_skipped(void **state)
{
    (void)state;
    /* what pycocotools leaves out quietly is counted */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, 10, 10, 0), ann(2, 9, 1, 0, 0, 10, 10, 0),
                               ann(3, 1, 7, 0, 0, 10, 10, 0)};
    kpl_coco_detection d[] = {det(1, 1, 0, 0, 10, 10, .9), det(1, 42, 0, 0, 10, 10, .99)};
    kpl_coco_stats s = eval(a, N(a), d, N(d));
    assert_true(fabs(s.stats[KPL_COCO_AP] - 1) < TOL);
    assert_int_equal(s.gt_boxes, 1);
    assert_int_equal(s.gt_skipped, 2);
    assert_int_equal(s.detections, 1);
    assert_int_equal(s.dets_skipped, 1);
}

static kpl_status gt_text(const char *text, kpl_coco_gt **gt)
{
    return kpl_coco_gt_parse(text, strlen(text), "gt.json", gt);
}

static kpl_status dets_text(const char *text, kpl_coco_detection **d, int64_t *n)
{
    return kpl_coco_dets_parse(text, strlen(text), "dt.json", d, n);
}

static void test_errors(void **state)
{
    (void)state;
    kpl_coco_gt *gt = NULL;
    FAILS(gt_text("{\"images\": [", &gt), KPL_EFORMAT, "gt.json: line 1");
    FAILS(gt_text("[]", &gt), KPL_EFORMAT, "not a COCO instances file");
    FAILS(gt_text("{\"categories\": []}", &gt), KPL_EFORMAT, "gt.json: no \"images\"");
    FAILS(gt_text("{\"images\": {}, \"categories\": []}", &gt), KPL_EFORMAT,
          "\"images\" is not an array");
    FAILS(gt_text("{\"images\": [{\"id\": \"a\"}], \"categories\": []}", &gt), KPL_EFORMAT,
          "images[0] has a non-integer \"id\"");
    FAILS(gt_text("{\"images\": [{\"id\": 1}], \"categories\": [{\"id\": 1}], \"annotations\": "
                  "[{\"id\": 3, \"image_id\": 1, \"category_id\": 1}]}", &gt),
          KPL_EFORMAT, "annotations[0] (id 3): \"bbox\" is not an array of 4 numbers");
    FAILS(gt_text("{\"images\": [{\"id\": 1}], \"categories\": [{\"id\": 1}], \"annotations\": "
                  "[{\"id\": 3, \"category_id\": 1, \"bbox\": [0,0,1,1]}]}", &gt),
          KPL_EFORMAT, "annotations[0] (id 3) has no \"image_id\"");
    FAILS(gt_text("{\"images\": [{\"id\": 1}], \"categories\": [{\"id\": 1}], \"annotations\": "
                  "[{\"id\": 3, \"image_id\": 1, \"category_id\": 1, \"bbox\": [0,0,1,1], "
                  "\"iscrowd\": 2}]}", &gt),
          KPL_EFORMAT, "\"iscrowd\" is not 0, 1");
    FAILS(gt_text("{\"images\": [{\"id\": 1}], \"categories\": [{\"id\": 1}], \"annotations\": "
                  "[{\"id\": 3, \"image_id\": 1, \"category_id\": 1, \"bbox\": [0,0,1,1]},"
                  " {\"id\": 3, \"image_id\": 1, \"category_id\": 1, \"bbox\": [0,0,2,2]}]}", &gt),
          KPL_EFORMAT, "annotations[0] and annotations[1] have the same id 3");
    assert_null(gt);
    FAILS(kpl_coco_gt_load("/nonexistent/gt.json", &gt), KPL_ENOTFOUND, "/nonexistent/gt.json");

    kpl_coco_detection *d = NULL;
    int64_t n = 0;
    FAILS(dets_text("{}", &d, &n), KPL_EFORMAT, "not a COCO results file");
    FAILS(dets_text("[{\"image_id\": 1, \"category_id\": 1, \"bbox\": [0,0,1,1], \"score\": 1},"
                    " {\"image_id\": 1, \"category_id\": 1, \"bbox\": [0,0,1,1]}]", &d, &n),
          KPL_EFORMAT, "dt.json: [1] (image_id 1): \"score\" is missing");
    FAILS(dets_text("[{\"image_id\": 1.5, \"category_id\": 1}]", &d, &n), KPL_EFORMAT,
          "[0] has a non-integer \"image_id\"");
    FAILS(dets_text("[{\"image_id\": 1, \"category_id\": 1, \"bbox\": [0,0,1], \"score\": 1}]",
                    &d, &n), KPL_EFORMAT, "\"bbox\" is not an array of 4 numbers");
    FAILS(dets_text("[1, 2", &d, &n), KPL_EFORMAT, "dt.json: line 1");
    assert_null(d);
    /* an integral real is an integer, as Python has it; an empty list is no detection */
    OK(dets_text("[{\"image_id\": 2.0, \"category_id\": 1, \"bbox\": [0,0,1,1], \"score\": 1}]",
                 &d, &n));
    assert_int_equal(n, 1);
    assert_int_equal(d[0].image_id, 2);
    free(d);
    OK(dets_text("[]", &d, &n));
    assert_int_equal(n, 0);
    assert_null(d);

    /* arrays: non-finite numbers; a detection on an unknown image */
    kpl_coco_annotation a[] = {ann(1, 1, 1, 0, 0, NAN, 10, 0)};
    FAILS(kpl_coco_gt_create(imgs, 3, cats, 2, a, 1, &gt), KPL_EINVAL,
          "annotations[0] (id 1): bbox or area is not a finite number");
    a[0] = ann(1, 1, 1, 0, 0, 10, 10, 0);
    OK(kpl_coco_gt_create(imgs, 3, cats, 2, a, 1, &gt));
    kpl_coco_stats s;
    kpl_coco_detection bad[] = {det(1, 1, 0, 0, 10, 10, .5), det(77, 1, 0, 0, 10, 10, .5)};
    FAILS(kpl_coco_evaluate(gt, bad, 2, &s), KPL_EINVAL,
          "detection 1: image_id 77 is not an image of the ground truth");
    bad[1] = det(1, 1, 0, 0, 10, 10, INFINITY);
    FAILS(kpl_coco_evaluate(gt, bad, 2, &s), KPL_EINVAL, "detection 1 (image_id 1): bbox or score");
    FAILS(kpl_coco_evaluate(gt, NULL, 3, &s), KPL_EINVAL, "bad argument");
    kpl_coco_gt_destroy(gt);
    kpl_coco_gt_destroy(NULL);
}

static void test_json_defaults(void **state)
{
    (void)state;
    /* "area" defaults to the box's area, "iscrowd" to 0, "annotations" to
     * none; ids need not be contiguous nor sorted; extra fields are fine */
    kpl_coco_gt *gt = NULL;
    OK(gt_text("{\"info\": {}, \"images\": [{\"id\": 30, \"file_name\": \"x.jpg\"}, {\"id\": 4}],"
               " \"categories\": [{\"id\": 90, \"name\": \"a\"}, {\"id\": 2}], \"annotations\": "
               "[{\"id\": 8, \"image_id\": 30, \"category_id\": 90, \"bbox\": [0, 0, 100, 100],"
               " \"segmentation\": [[0, 0, 1, 1]], \"iscrowd\": false}]}", &gt));
    kpl_coco_detection d[] = {det(30, 90, 0, 0, 100, 100, 1)};
    kpl_coco_stats s;
    OK(kpl_coco_evaluate(gt, d, 1, &s));
    double want[] = {ONE, ONE, ONE, -1, -1, ONE, 1, 1, 1, -1, -1, 1};
    expect(&s, want, TOL);
    kpl_coco_gt_destroy(gt);
    OK(gt_text("{\"images\": [{\"id\": 1}], \"categories\": [{\"id\": 1}]}", &gt));
    OK(kpl_coco_evaluate(gt, NULL, 0, &s));
    assert_true(s.stats[KPL_COCO_AP] == -1 && s.gt_boxes == 0);
    kpl_coco_gt_destroy(gt);
}

static void test_save_load(void **state)
{
    (void)state;
    char dir[] = "/tmp/kpl_cocoeval_XXXXXX", path[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/dets.json", dir);
    kpl_coco_detection d[] = {det(1, 1, 0.1 + 0.2, 1e-300, 12345.678, 1.0 / 3, 0.30000000000000004),
                              det(-5, 7, -1, 2.5, -0.0, 3e300, 1)};
    OK(kpl_coco_dets_save(path, d, 2));
    kpl_coco_detection *r = NULL;
    int64_t n = 0;
    OK(kpl_coco_dets_load(path, &r, &n));
    assert_int_equal(n, 2);
    assert_memory_equal(r, d, sizeof d);
    free(r);
    d[0].score = NAN;
    FAILS(kpl_coco_dets_save(path, d, 2), KPL_EINVAL, "detection 0");
    remove(path);
    rmdir(dir);

    kpl_coco_stats s = {.stats = {0.5, 1, 0, -1, 0.1 + 0.2, 1.0 / 3, 0, 0, 0, 0, 0, 0}};
    char buf[512];
    int len = kpl_coco_stats_json(&s, buf, sizeof buf);
    assert_int_equal(len, (int)strlen(buf));
    assert_non_null(strstr(buf, "{\"AP\":0.5,\"AP50\":1,\"AP75\":0,\"APs\":-1,"
                                "\"APm\":0.30000000000000004,\"APl\":0.3333333333333333,"));
    assert_non_null(strstr(buf, ",\"ARl\":0}"));
    char small[10];
    assert_int_equal(kpl_coco_stats_json(&s, small, sizeof small), len);
    assert_int_equal(strlen(small), 9);
}

/* The number after "KEY": in a flat JSON object. */
static double json_field(const char *text, const char *key)
{
    char pat[32];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(text, pat);
    if (!p) fail_msg("no %s in %s", pat, text);
    return strtod(p + strlen(pat), NULL);
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) fail_msg("%s: cannot open", path);
    static char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* Compares got (a JSON object's text) with a case's expected file;
 * counts the figures that are the same double. */
static void compare_case(const char *name, const char *got, int *exact, double *worst)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s.expected.json", COCO_DATA_DIR, name);
    const char *want = slurp(path);
    double w[KPL_COCO_NSTATS];
    for (int i = 0; i < KPL_COCO_NSTATS; i++) w[i] = json_field(want, kpl_coco_stat_names[i]);
    for (int i = 0; i < KPL_COCO_NSTATS; i++) {
        double g = json_field(got, kpl_coco_stat_names[i]), diff = fabs(g - w[i]);
        if (!(diff <= 1e-3))
            fail_msg("%s: %s = %.17g, pycocotools %.17g", name, kpl_coco_stat_names[i], g, w[i]);
        *exact += g == w[i];
        if (diff > *worst) *worst = diff;
    }
}

static int case_names(char names[][128], int max)
{
    DIR *dir = opendir(COCO_DATA_DIR);
    assert_non_null(dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir)) && n < max) {
        char *p = strstr(e->d_name, ".expected.json");
        if (p && !p[strlen(".expected.json")])
            snprintf(names[n++], 128, "%.*s", (int)(p - e->d_name), e->d_name);
    }
    closedir(dir);
    return n;
}

static void test_pycocotools_cases(void **state)
{
    (void)state;
    char names[64][128];
    int n = case_names(names, 64), exact = 0;
    double worst = 0;
    assert_true(n >= 12);
    for (int c = 0; c < n; c++) {
        char gp[512], dp[512], got[512];
        snprintf(gp, sizeof gp, "%s/%.127s.gt.json", COCO_DATA_DIR, names[c]);
        snprintf(dp, sizeof dp, "%s/%.127s.dt.json", COCO_DATA_DIR, names[c]);
        kpl_coco_gt *gt = NULL;
        kpl_coco_detection *d = NULL;
        int64_t nd = 0;
        kpl_coco_stats s;
        OK(kpl_coco_gt_load(gp, &gt));
        OK(kpl_coco_dets_load(dp, &d, &nd));
        OK(kpl_coco_evaluate(gt, d, nd, &s));
        kpl_coco_stats_json(&s, got, sizeof got);
        compare_case(names[c], got, &exact, &worst);
        free(d);
        kpl_coco_gt_destroy(gt);
    }
    print_message("pycocotools cases: %d, %d of %d figures the same double, largest "
                  "difference %.3g\n", n, exact, n * KPL_COCO_NSTATS, worst);
}

/* Evaluation in parts (kpl_coco_match on shares of the images, then
 * kpl_coco_finish on the parts laid end to end): the same doubles and
 * counts as the whole at 1, 2, 3 and 5 uneven shares, on every case; and
 * what is not such parts refused. */
static void test_parts(void **state)
{
    (void)state;
    char names[64][128];
    int n = case_names(names, 64);
    assert_true(n >= 12);
    for (int c = 0; c < n; c++) {
        char gp[512], dp[512];
        snprintf(gp, sizeof gp, "%s/%.127s.gt.json", COCO_DATA_DIR, names[c]);
        snprintf(dp, sizeof dp, "%s/%.127s.dt.json", COCO_DATA_DIR, names[c]);
        json_t *root = json_load_file(gp, 0, NULL);
        assert_non_null(root);
        json_t *ims = json_object_get(root, "images"), *cats = json_object_get(root, "categories");
        json_t *anns = json_object_get(root, "annotations");
        int64_t ni = (int64_t)json_array_size(ims), nc = (int64_t)json_array_size(cats);
        int64_t na = (int64_t)json_array_size(anns);
        int64_t *img = calloc((size_t)ni + 1, sizeof *img), *cat = calloc((size_t)nc + 1, sizeof *cat);
        kpl_coco_annotation *a = calloc((size_t)na + 1, sizeof *a);
        for (int64_t i = 0; i < ni; i++)
            img[i] = json_integer_value(json_object_get(json_array_get(ims, (size_t)i), "id"));
        for (int64_t i = 0; i < nc; i++)
            cat[i] = json_integer_value(json_object_get(json_array_get(cats, (size_t)i), "id"));
        for (int64_t i = 0; i < na; i++) {
            json_t *e = json_array_get(anns, (size_t)i), *b = json_object_get(e, "bbox");
            a[i].id = json_integer_value(json_object_get(e, "id"));
            a[i].image_id = json_integer_value(json_object_get(e, "image_id"));
            a[i].category_id = json_integer_value(json_object_get(e, "category_id"));
            for (int k = 0; k < 4; k++) a[i].bbox[k] = json_number_value(json_array_get(b, (size_t)k));
            json_t *ar = json_object_get(e, "area");
            a[i].area = ar ? json_number_value(ar) : a[i].bbox[2] * a[i].bbox[3];
            a[i].iscrowd = json_is_true(json_object_get(e, "iscrowd")) ||
                           json_integer_value(json_object_get(e, "iscrowd")) == 1;
        }
        kpl_coco_detection *d = NULL;
        int64_t nd = 0;
        OK(kpl_coco_dets_load(dp, &d, &nd));
        kpl_coco_gt *whole = NULL;
        kpl_coco_stats want, got;
        OK(kpl_coco_gt_create(img, ni, cat, nc, a, na, &whole));
        OK(kpl_coco_evaluate(whole, d, nd, &want));
        const int shares[4] = {1, 2, 3, 5};
        for (int si = 0; si < 4; si++) {
            int S = shares[si];
            uint8_t *all = NULL;
            size_t total = 0;
            for (int r = 0; r < S; r++) {
                /* image id i goes to share (3i + 1) mod S: uneven, interleaved
                 * (a repeated id to one share: the shares are disjoint) */
                int64_t *mi = calloc((size_t)ni + 1, sizeof *mi), m = 0, ma = 0, md = 0;
                kpl_coco_annotation *sa = calloc((size_t)na + 1, sizeof *sa);
                kpl_coco_detection *sd = calloc((size_t)nd + 1, sizeof *sd);
                for (int64_t i = 0; i < ni; i++)
                    if (((3 * img[i] + 1) % S + S) % S == r) mi[m++] = img[i];
                for (int64_t i = 0; i < na; i++)
                    for (int64_t j = 0; j < m; j++)
                        if (a[i].image_id == mi[j]) {
                            sa[ma++] = a[i];
                            break;
                        }
                for (int64_t i = 0; i < nd; i++)
                    for (int64_t j = 0; j < m; j++)
                        if (d[i].image_id == mi[j]) {
                            sd[md++] = d[i];
                            break;
                        }
                kpl_coco_gt *g = NULL;
                void *part = NULL;
                size_t bytes = 0;
                OK(kpl_coco_gt_create(mi, m, cat, nc, sa, ma, &g));
                OK(kpl_coco_match(g, sd, md, &part, &bytes));
                all = realloc(all, total + bytes);
                memcpy(all + total, part, bytes);
                total += bytes;
                free(part), free(sd), free(sa), free(mi);
                kpl_coco_gt_destroy(g);
            }
            OK(kpl_coco_finish(all, total, &got));
            for (int k = 0; k < KPL_COCO_NSTATS; k++)
                if (memcmp(&got.stats[k], &want.stats[k], sizeof(double)))
                    fail_msg("%s, %d shares: %s %.17g, whole %.17g", names[c], S,
                             kpl_coco_stat_name((kpl_coco_stat)k), got.stats[k], want.stats[k]);
            assert_int_equal(got.images, want.images);
            assert_int_equal(got.gt_boxes, want.gt_boxes);
            assert_int_equal(got.detections, want.detections);
            assert_int_equal(got.categories, want.categories);
            if (S == 3 && c == 0) { /* not parts: cut short, another category list, a stray byte */
                FAILS(kpl_coco_finish(all, total - 1, &got), KPL_EINVAL, "kpl_coco_finish: part");
                uint8_t *junk = calloc(1, total + 8);
                memcpy(junk, all, total);
                FAILS(kpl_coco_finish(junk, total + 8, &got), KPL_EINVAL, "is cut short");
                free(junk);
                kpl_coco_gt *other = NULL;
                void *part = NULL;
                size_t bytes = 0;
                int64_t one = cat[0];
                OK(kpl_coco_gt_create(img, ni, &one, 1, a, na, &other));
                OK(kpl_coco_match(other, NULL, 0, &part, &bytes));
                uint8_t *mixed = malloc(total + bytes);
                memcpy(mixed, all, total);
                memcpy(mixed + total, part, bytes);
                if (nc > 1)
                    FAILS(kpl_coco_finish(mixed, total + bytes, &got), KPL_EINVAL,
                          "other categories than part 0");
                free(mixed), free(part);
                kpl_coco_gt_destroy(other);
            }
            free(all);
        }
        kpl_coco_gt_destroy(whole);
        free(d), free(a), free(cat), free(img);
        json_decref(root);
    }
}

/* `kpl data cocoeval`: the same figures on stdout; bad input is exit 2. */
static void test_cli(void **state)
{
    (void)state;
    char names[64][128], cmd[2048], got[512] = "";
    assert_true(case_names(names, 64) > 0);
    snprintf(cmd, sizeof cmd, "'%s' data cocoeval '%s/%s.gt.json' '%s/%s.dt.json' --iou-type bbox",
             KPL_CLI, COCO_DATA_DIR, names[0], COCO_DATA_DIR, names[0]);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    assert_non_null(fgets(got, sizeof got, p));
    assert_int_equal(pclose(p), 0);
    int exact = 0;
    double worst = 0;
    compare_case(names[0], got, &exact, &worst);
    const char *bad[] = {"'%s' data cocoeval '%s/%s.dt.json' '%s/%s.dt.json' 2>/dev/null",
                         "'%s' data cocoeval '%s/%s.gt.json' '%s/%s.gt.json' 2>/dev/null",
                         "'%s' data cocoeval '%s/%s.gt.json' '%s/%s.dt.json' --iou-type segm "
                         "2>/dev/null",
                         "'%s' data cocoeval '%s/%s.gt.json' 2>/dev/null # %s %s"};
    for (int i = 0; i < 4; i++) {
        snprintf(cmd, sizeof cmd, bad[i], KPL_CLI, COCO_DATA_DIR, names[0], COCO_DATA_DIR,
                 names[0]);
        int rc = system(cmd);
        assert_true(WIFEXITED(rc));
        assert_int_equal(WEXITSTATUS(rc), 2);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_perfect),
        cmocka_unit_test(test_parts),
        cmocka_unit_test(test_iou_062),
        cmocka_unit_test(test_crowd),
        cmocka_unit_test(test_image_without_gt),
        cmocka_unit_test(test_image_without_dets),
        cmocka_unit_test(test_over_100),
        cmocka_unit_test(test_ties),
        cmocka_unit_test(test_category_without_dets),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_boundaries_and_odd_boxes),
        cmocka_unit_test(test_equal_iou),
        cmocka_unit_test(test_id_zero),
        cmocka_unit_test(test_skipped),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_json_defaults),
        cmocka_unit_test(test_save_load),
        cmocka_unit_test(test_pycocotools_cases),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
