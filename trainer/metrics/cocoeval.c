/*
 * cocoeval.c — COCO box evaluation (cocoeval.h, docs/cocoeval.md).
 *
 * The definitions are those of pycocotools' COCOeval with iouType 'bbox'
 * and its default parameters; where a choice of floating-point order
 * changes a last bit (the thresholds, IoU, precision, the final means) it
 * is made as pycocotools and numpy make it, so that the figures are the
 * same doubles, not merely close ones.
 *
 * The work is organised by category: a category's ground truth and
 * detections are grouped by image (a "cell"), each cell is matched once
 * per area range and IoU threshold, and the category's detections are then
 * walked in the global score order to build its precision/recall curves.
 * Memory is linear in the boxes, never categories x images.  Reading and
 * writing COCO's JSON is cocoeval_json.c's.
 */
#include "cocoeval_impl.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

KPL_ENUM_DEFINE(kpl_coco_stat, KPL_COCO_STATS)

/* COCO's defaults: IoU thresholds, recall points, area ranges, detections
 * per image (each kept per image and category, as pycocotools keeps them). */
enum { NT = 10, NR = 101, NA = 4, NM = 3, MAXDET = 100 };
static const int max_dets[NM] = {1, 10, MAXDET};
static const double area_lo[NA] = {0, 0, 32 * 32, 96 * 96};
static const double area_hi[NA] = {1e10, 32 * 32, 96 * 96, 1e10};
enum { AREA_ALL, AREA_SMALL, AREA_MEDIUM, AREA_LARGE };

/* numpy.linspace's values, which pycocotools uses: i * step + start with
 * the last point set to stop.  0.75 and every recall point must be these
 * exact doubles, since recalls and IoUs are compared with them. */
static void thresholds(double iou[NT], double rec[NR])
{
    double step = (0.95 - 0.5) / (NT - 1);
    for (int i = 0; i < NT; i++) iou[i] = (double)i * step + 0.5;
    iou[NT - 1] = 0.95;
    step = 1.0 / (NR - 1);
    for (int i = 0; i < NR; i++) rec[i] = (double)i * step;
    rec[NR - 1] = 1.0;
}

typedef struct {
    double box[4], area;
    int64_t id, img; /* img: index into kpl_coco_gt.img_ids */
    int32_t crowd;
} gt_box;

struct kpl_coco_gt {
    int64_t nimg, ncat, nbox, skipped;
    int64_t *img_ids, *cat_ids; /* sorted, distinct */
    gt_box *box;                /* by category, then image, then input order */
    int64_t *cat_start;         /* ncat + 1: category k's are [cat_start[k], cat_start[k + 1]) */
};

/* ---- small helpers --------------------------------------------------------------------------- */

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* Sorts and removes repeats; returns the distinct count. */
static int64_t sort_unique(int64_t *v, int64_t n)
{
    if (n == 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_i64);
    int64_t m = 1;
    for (int64_t i = 1; i < n; i++)
        if (v[i] != v[m - 1]) v[m++] = v[i];
    return m;
}

/* The index of id in the sorted v, or -1. */
static int64_t find_id(const int64_t *v, int64_t n, int64_t id)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (v[mid] < id) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && v[lo] == id ? lo : -1;
}

int kpl__coco_fmt_num(char *buf, size_t len, double v)
{
    if (v == 0 && signbit(v)) return snprintf(buf, len, "-0.0");
    char tmp[40];
    for (int p = 15; p <= 17; p++) {
        snprintf(tmp, sizeof tmp, "%.*g", p, v);
        if (strtod(tmp, NULL) == v || p == 17) break;
    }
    return snprintf(buf, len, "%s", tmp);
}

/* numpy's pairwise summation: blocks of up to 128 summed with 8
 * interleaved accumulators, halves above that. */
static double pairwise_sum(const double *a, int64_t n)
{
    if (n < 8) {
        double s = -0.0;
        for (int64_t i = 0; i < n; i++) s += a[i];
        return s;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; j++) r[j] = a[j];
        int64_t i;
        for (i = 8; i < n - n % 8; i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) s += a[i];
        return s;
    }
    int64_t h = n / 2;
    h -= h % 8;
    return pairwise_sum(a, h) + pairwise_sum(a + h, n - h);
}

/* What np.mean adds with: pairwise within each 8192 values (numpy's
 * default buffer size, the length its reduction loop is handed), those
 * sums one after another. */
static double numpy_sum(const double *a, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i += 8192) s += pairwise_sum(a + i, n - i < 8192 ? n - i : 8192);
    return s;
}

/* ---- ground truth ---------------------------------------------------------------------------- */

void kpl_coco_gt_destroy(kpl_coco_gt *gt)
{
    if (!gt) return;
    free(gt->img_ids);
    free(gt->cat_ids);
    free(gt->box);
    free(gt->cat_start);
    free(gt);
}

typedef struct {
    int64_t id, index;
} id_at;

static int cmp_id_at(const void *a, const void *b)
{
    const id_at *x = a, *y = b;
    if (x->id != y->id) return x->id < y->id ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

typedef struct {
    int64_t cat, img, index;
} box_key;

static int cmp_box_key(const void *a, const void *b)
{
    const box_key *x = a, *y = b;
    if (x->cat != y->cat) return x->cat < y->cat ? -1 : 1;
    if (x->img != y->img) return x->img < y->img ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

kpl_status kpl__coco_gt_build(const int64_t *image_ids, int64_t nimages,
                              const int64_t *category_ids, int64_t ncategories,
                              const kpl_coco_annotation *anns, int64_t nanns, const char *name,
                              kpl_status code, kpl_coco_gt **out)
{
    KPL_CHECK(out, KPL_EINVAL, "%s: out is NULL", name);
    *out = NULL;
    KPL_CHECK(nimages >= 0 && ncategories >= 0 && nanns >= 0, KPL_EINVAL,
              "%s: negative count (%lld images, %lld categories, %lld annotations)", name,
              (long long)nimages, (long long)ncategories, (long long)nanns);
    KPL_CHECK((image_ids || !nimages) && (category_ids || !ncategories) && (anns || !nanns),
              KPL_EINVAL, "%s: an array is NULL but its count is not 0", name);
    for (int64_t i = 0; i < nanns; i++) {
        const kpl_coco_annotation *a = &anns[i];
        KPL_CHECK(kpl__coco_finite4(a->bbox) && isfinite(a->area), code,
                  "%s: annotations[%lld] (id %lld): bbox or area is not a finite number", name,
                  (long long)i, (long long)a->id);
        KPL_CHECK(a->iscrowd == 0 || a->iscrowd == 1, code,
                  "%s: annotations[%lld] (id %lld): iscrowd is %d, not 0 or 1", name,
                  (long long)i, (long long)a->id, (int)a->iscrowd);
    }
    kpl_status st = KPL_OK;
    kpl_coco_gt *gt = calloc(1, sizeof *gt);
    id_at *ids = malloc(sizeof *ids * (size_t)(nanns ? nanns : 1));
    box_key *keys = malloc(sizeof *keys * (size_t)(nanns ? nanns : 1));
    if (!gt || !ids || !keys) goto nomem;
    gt->img_ids = malloc(sizeof(int64_t) * (size_t)(nimages ? nimages : 1));
    gt->cat_ids = malloc(sizeof(int64_t) * (size_t)(ncategories ? ncategories : 1));
    gt->cat_start = calloc((size_t)ncategories + 1, sizeof(int64_t));
    if (!gt->img_ids || !gt->cat_ids || !gt->cat_start) goto nomem;
    if (nimages) memcpy(gt->img_ids, image_ids, sizeof(int64_t) * (size_t)nimages);
    if (ncategories) memcpy(gt->cat_ids, category_ids, sizeof(int64_t) * (size_t)ncategories);
    gt->nimg = sort_unique(gt->img_ids, nimages);
    gt->ncat = sort_unique(gt->cat_ids, ncategories);

    /* pycocotools keeps annotations in a dict by id, so a repeated id
     * silently evaluates one annotation twice; it is refused here. */
    for (int64_t i = 0; i < nanns; i++) ids[i] = (id_at){anns[i].id, i};
    qsort(ids, (size_t)nanns, sizeof *ids, cmp_id_at);
    for (int64_t i = 1; i < nanns; i++)
        if (ids[i].id == ids[i - 1].id) {
            st = KPL_ERROR(code, "%s: annotations[%lld] and annotations[%lld] have the same id "
                           "%lld", name, (long long)ids[i - 1].index, (long long)ids[i].index,
                           (long long)ids[i].id);
            goto fail;
        }

    int64_t kept = 0;
    for (int64_t i = 0; i < nanns; i++) {
        int64_t img = find_id(gt->img_ids, gt->nimg, anns[i].image_id);
        int64_t cat = find_id(gt->cat_ids, gt->ncat, anns[i].category_id);
        if (img < 0 || cat < 0) {
            gt->skipped++;
            continue;
        }
        keys[kept++] = (box_key){cat, img, i};
    }
    qsort(keys, (size_t)kept, sizeof *keys, cmp_box_key);
    gt->box = malloc(sizeof *gt->box * (size_t)(kept ? kept : 1));
    if (!gt->box) goto nomem;
    for (int64_t j = 0; j < kept; j++) {
        const kpl_coco_annotation *a = &anns[keys[j].index];
        gt_box *b = &gt->box[j];
        memcpy(b->box, a->bbox, sizeof b->box);
        b->area = a->area;
        b->id = a->id;
        b->img = keys[j].img;
        b->crowd = a->iscrowd;
        gt->cat_start[keys[j].cat + 1]++;
    }
    for (int64_t k = 0; k < gt->ncat; k++) gt->cat_start[k + 1] += gt->cat_start[k];
    gt->nbox = kept;
    free(ids);
    free(keys);
    *out = gt;
    return KPL_OK;
nomem:
    st = KPL_ERROR(KPL_ENOMEM, "%s: out of memory for %lld annotations", name, (long long)nanns);
fail:
    free(keys);
    free(ids);
    kpl_coco_gt_destroy(gt);
    return st;
}

kpl_status kpl_coco_gt_create(const int64_t *image_ids, int64_t nimages,
                              const int64_t *category_ids, int64_t ncategories,
                              const kpl_coco_annotation *anns, int64_t nanns, kpl_coco_gt **out)
{
    return kpl__coco_gt_build(image_ids, nimages, category_ids, ncategories, anns, nanns,
                    "kpl_coco_gt_create", KPL_EINVAL, out);
}

/* ---- evaluation ------------------------------------------------------------------------------ */

typedef struct {
    double box[4], score;
    int64_t cat, img, index; /* gt's category and image indices; the input position */
} det;

/* What a detection became at each area range: bit t set when it is a
 * true positive (tp) or ignored (ig) at IoU threshold t; neither is a
 * false positive.  rank: its place in its image's score order. */
typedef struct {
    uint16_t tp[NA], ig[NA];
    int32_t rank;
} det_result;

/* IoU of a detection with a ground-truth box as pycocotools' bbIou has
 * it: for a crowd region the union is the detection's own area. */
static double box_iou(const double d[4], const double g[4], bool crowd)
{
    double w = fmin(d[0] + d[2], g[0] + g[2]) - fmax(d[0], g[0]);
    if (w <= 0) return 0;
    double h = fmin(d[1] + d[3], g[1] + g[3]) - fmax(d[1], g[1]);
    if (h <= 0) return 0;
    double inter = w * h, da = d[2] * d[3];
    return inter / (crowd ? da : da + g[2] * g[3] - inter);
}

/* Scratch for one cell, sized for the category's largest. */
typedef struct {
    double *iou;    /* (D, G) */
    int64_t *order; /* G: the boxes to try, not ignored first */
    uint8_t *ign, *taken;
} cell_work;

/* Matches one image's detections (score order, at most MAXDET) to its
 * ground truth of the category, at every area range and threshold.
 * npig[a] counts the boxes that are not ignored at range a. */
static void match_cell(const gt_box *g, int64_t ng, const det *d, int64_t nd,
                       const double thr[NT], cell_work *w, det_result *res, int64_t npig[NA])
{
    for (int64_t i = 0; i < nd; i++)
        for (int64_t j = 0; j < ng; j++)
            w->iou[i * ng + j] = box_iou(d[i].box, g[j].box, g[j].crowd);
    for (int a = 0; a < NA; a++) {
        int64_t no = 0;
        for (int64_t j = 0; j < ng; j++) {
            w->ign[j] = g[j].crowd || g[j].area < area_lo[a] || g[j].area > area_hi[a];
            if (!w->ign[j]) w->order[no++] = j;
        }
        npig[a] += no;
        for (int64_t j = 0; j < ng; j++)
            if (w->ign[j]) w->order[no++] = j;
        for (int t = 0; t < NT; t++) {
            memset(w->taken, 0, (size_t)ng);
            for (int64_t i = 0; i < nd; i++) {
                /* The best box at or above the threshold; a later box of
                 * equal IoU wins; once a box that counts has matched, the
                 * ignored ones (sorted last) are not tried. */
                double best = fmin(thr[t], 1 - 1e-10);
                int64_t m = -1;
                for (int64_t p = 0; p < ng; p++) {
                    int64_t j = w->order[p];
                    if (w->taken[j] && !g[j].crowd) continue;
                    if (m >= 0 && !w->ign[m] && w->ign[j]) break;
                    if (w->iou[i * ng + j] < best) continue;
                    best = w->iou[i * ng + j];
                    m = j;
                }
                /* pycocotools records a match as the box's id and reads
                 * id 0 as "no match": a box with id 0 gives false
                 * positives there, and here too. */
                bool matched = m >= 0 && g[m].id != 0;
                double area = d[i].box[2] * d[i].box[3];
                bool ignored = (m >= 0 && w->ign[m]) ||
                               (!matched && (area < area_lo[a] || area > area_hi[a]));
                if (m >= 0) w->taken[m] = 1;
                if (ignored) res[i].ig[a] |= (uint16_t)(1u << t);
                else if (matched) res[i].tp[a] |= (uint16_t)(1u << t);
            }
        }
    }
}

/* One category's curves from its detections' results in global score
 * order: prec (NA, NT, NR, K) at MAXDET per image, rec (NA, NM, NT, K);
 * entries stay -1 where pycocotools leaves them (no box that counts at
 * that range).  rc and pr: scratch of nd. */
static void accumulate(const det_result *res, int64_t nd, const int64_t npig[NA],
                       const double rec_thr[NR], int64_t k, int64_t K, double *rc, double *pr,
                       double *prec, double *rec)
{
    for (int a = 0; a < NA; a++) {
        if (npig[a] == 0) continue;
        double np = (double)npig[a];
        for (int t = 0; t < NT; t++) {
            uint16_t bit = (uint16_t)(1u << t);
            int64_t tp[NM] = {0}, fp = 0, n = 0;
            for (int64_t i = 0; i < nd; i++) {
                if (res[i].ig[a] & bit) continue;
                if (res[i].tp[a] & bit)
                    for (int mi = 0; mi < NM; mi++) tp[mi] += res[i].rank < max_dets[mi];
                else
                    fp++;
                /* the curve at MAXDET, where every detection counts */
                rc[n] = (double)tp[NM - 1] / np;
                pr[n] = (double)tp[NM - 1] / ((double)fp + (double)tp[NM - 1] + DBL_EPSILON);
                n++;
            }
            for (int mi = 0; mi < NM; mi++)
                rec[((a * NM + mi) * NT + t) * K + k] = (double)tp[mi] / np;
            /* The precision envelope, then precision at the first point
             * reaching each recall threshold (0 past the end). */
            for (int64_t i = n - 1; i > 0; i--)
                if (pr[i] > pr[i - 1]) pr[i - 1] = pr[i];
            double *out = &prec[((a * NT + t) * NR) * K + k];
            int64_t i = 0;
            for (int r = 0; r < NR; r++) {
                while (i < n && rc[i] < rec_thr[r]) i++;
                out[(int64_t)r * K] = i < n ? pr[i] : 0;
            }
        }
    }
}

/* The mean of the entries of v[0..n) that are not -1, numpy's way; -1
 * when there is none. */
static double mean_defined(const double *v, int64_t n, double *scratch)
{
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (v[i] > -1) scratch[m++] = v[i];
    return m ? numpy_sum(scratch, m) / (double)m : -1;
}

typedef struct {
    double score;
    int64_t i;
} scored;

static int cmp_scored(const void *a, const void *b)
{
    const scored *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* Puts the m detections of *dv (in input order) in the order of cells,
 * category then image, each cell by score (higher first) and input order
 * after that: pycocotools' stable sort by score.  Two stable counting
 * sorts and a sort per cell: linear in m, images and categories.  *dv is
 * replaced by a new array. */
static kpl_status order_dets(det **dv, int64_t m, int64_t nimg, int64_t ncat)
{
    int64_t nb = (nimg > ncat ? nimg : ncat) + 1;
    int64_t *count = malloc(sizeof *count * (size_t)nb);
    int64_t *by_img = malloc(sizeof *by_img * (size_t)(m ? m : 1));
    scored *sc = malloc(sizeof *sc * (size_t)(m ? m : 1));
    det *out = malloc(sizeof *out * (size_t)(m ? m : 1));
    kpl_status st = KPL_OK;
    if (!count || !by_img || !sc || !out) {
        st = KPL_ERROR(KPL_ENOMEM, "kpl_coco_evaluate: out of memory for %lld detections",
                       (long long)m);
        free(out);
        goto done;
    }
    const det *d = *dv;
    memset(count, 0, sizeof *count * (size_t)nb);
    for (int64_t i = 0; i < m; i++) count[d[i].img + 1]++;
    for (int64_t b = 1; b < nb; b++) count[b] += count[b - 1];
    for (int64_t i = 0; i < m; i++) by_img[count[d[i].img]++] = i;
    memset(count, 0, sizeof *count * (size_t)nb);
    for (int64_t i = 0; i < m; i++) count[d[i].cat + 1]++;
    for (int64_t b = 1; b < nb; b++) count[b] += count[b - 1];
    for (int64_t j = 0; j < m; j++) {
        int64_t i = by_img[j];
        sc[count[d[i].cat]++] = (scored){d[i].score, i};
    }
    for (int64_t j = 0; j < m;) {
        int64_t e = j + 1;
        const det *c = &d[sc[j].i];
        while (e < m && d[sc[e].i].cat == c->cat && d[sc[e].i].img == c->img) e++;
        qsort(sc + j, (size_t)(e - j), sizeof *sc, cmp_scored);
        j = e;
    }
    for (int64_t j = 0; j < m; j++) out[j] = d[sc[j].i];
    free(*dv);
    *dv = out;
done:
    free(sc);
    free(by_img);
    free(count);
    return st;
}

/* One category's detections matched: dv holds them (by image, then
 * score; at most MAXDET per image and category), res receives each one's
 * result (rank, tp, ig) in the same order, npig the boxes that count per
 * area range. */
static kpl_status match_category(const kpl_coco_gt *gt, int64_t k, const det *dv, int64_t nd,
                                 const double thr[NT], det_result *res, int64_t npig[NA])
{
    const gt_box *g = gt->box + gt->cat_start[k];
    int64_t ng = gt->cat_start[k + 1] - gt->cat_start[k];
    if (ng == 0 && nd == 0) return KPL_OK; /* pycocotools: no image to accumulate */
    int64_t maxg = 0;
    for (int64_t j = 0; j < ng;) {
        int64_t e = j;
        while (e < ng && g[e].img == g[j].img) e++;
        if (e - j > maxg) maxg = e - j;
        j = e;
    }
    cell_work w = {0};
    w.iou = malloc(sizeof *w.iou * (size_t)(MAXDET * (maxg ? maxg : 1)));
    w.order = malloc(sizeof *w.order * (size_t)(maxg ? maxg : 1));
    w.ign = malloc((size_t)(maxg ? maxg : 1));
    w.taken = malloc((size_t)(maxg ? maxg : 1));
    kpl_status st = KPL_OK;
    if (!w.iou || !w.order || !w.ign || !w.taken) {
        st = KPL_ERROR(KPL_ENOMEM, "kpl_coco_evaluate: out of memory");
        goto done;
    }
    /* The cells in image order: both lists are sorted by image. */
    for (int64_t gi = 0, di = 0; gi < ng || di < nd;) {
        int64_t img = gi < ng && (di >= nd || g[gi].img <= dv[di].img) ? g[gi].img : dv[di].img;
        int64_t ge = gi, de = di;
        while (ge < ng && g[ge].img == img) ge++;
        while (de < nd && dv[de].img == img) {
            res[de].rank = (int32_t)(de - di);
            de++;
        }
        match_cell(g + gi, ge - gi, dv + di, de - di, thr, &w, res + di, npig);
        gi = ge;
        di = de;
    }
done:
    free(w.taken);
    free(w.ign);
    free(w.order);
    free(w.iou);
    return st;
}

/* ---- parts: the matching of a share of the images, as bytes ------------------------------------ */

/* A part: this header, then cat_ids[K], npig[K][NA] (int64) and nrec
 * records; every field native (one build, one byte order). */
#define PART_MAGIC 0x31434f434c504bULL /* "KPLCOC1" */
typedef struct {
    uint64_t magic;
    int64_t bytes;                     /* the whole part */
    int64_t ncat, nimg, nbox, gt_skipped, dets, dets_skipped, nrec;
} part_head;

typedef struct {
    double score;
    int64_t img_id; /* pycocotools' order of equal scores: image (by id), then rank */
    int32_t cat, rank;
    uint16_t tp[NA], ig[NA];
} part_rec;

static size_t part_size(int64_t K, int64_t nrec)
{
    return sizeof(part_head) + (size_t)K * sizeof(int64_t) * (1 + NA) +
           (size_t)nrec * sizeof(part_rec);
}

kpl_status kpl_coco_match(const kpl_coco_gt *gt, const kpl_coco_detection *dets, int64_t n,
                          void **part, size_t *bytes)
{
    KPL_CHECK(gt && part && bytes && n >= 0 && (dets || !n), KPL_EINVAL,
              "kpl_coco_match: bad argument (gt, part, bytes NULL, n < 0 or dets NULL)");
    *part = NULL;
    *bytes = 0;
    for (int64_t i = 0; i < n; i++)
        KPL_CHECK(kpl__coco_finite4(dets[i].bbox) && isfinite(dets[i].score), KPL_EINVAL,
                  "kpl_coco_evaluate: detection %lld (image_id %lld): bbox or score is not a "
                  "finite number", (long long)i, (long long)dets[i].image_id);
    int64_t K = gt->ncat;
    kpl_status st = KPL_OK;
    det *dv = malloc(sizeof *dv * (size_t)(n ? n : 1));
    det_result *res = calloc((size_t)(n ? n : 1), sizeof *res);
    uint8_t *out = NULL;
    if (!dv || !res) goto nomem;
    int64_t m = 0, skipped = 0;
    for (int64_t i = 0; i < n; i++) {
        const kpl_coco_detection *d = &dets[i];
        int64_t img = find_id(gt->img_ids, gt->nimg, d->image_id);
        if (img < 0) {
            st = KPL_ERROR(KPL_EINVAL, "kpl_coco_evaluate: detection %lld: image_id %lld is not "
                           "an image of the ground truth", (long long)i, (long long)d->image_id);
            goto done;
        }
        int64_t cat = find_id(gt->cat_ids, gt->ncat, d->category_id);
        if (cat < 0) {
            skipped++;
            continue;
        }
        dv[m] = (det){{d->bbox[0], d->bbox[1], d->bbox[2], d->bbox[3]}, d->score, cat, img, i};
        m++;
    }
    if ((st = order_dets(&dv, m, gt->nimg, K)) < 0) goto done;
    /* Keep the MAXDET best of each image and category. */
    int64_t kept = 0, rank = 0, cat = -1, img = -1;
    for (int64_t i = 0; i < m; i++) {
        rank = dv[i].cat == cat && dv[i].img == img ? rank + 1 : 0;
        cat = dv[i].cat;
        img = dv[i].img;
        if (rank < MAXDET) dv[kept++] = dv[i];
    }
    size_t size = part_size(K, kept);
    out = calloc(1, size);
    if (!out) goto nomem;
    part_head *h = (part_head *)out;
    *h = (part_head){PART_MAGIC, (int64_t)size, K, gt->nimg, gt->nbox, gt->skipped, m, skipped,
                     kept};
    int64_t *cat_ids = (int64_t *)(h + 1), *npig = cat_ids + K;
    part_rec *rec = (part_rec *)(npig + K * NA);
    memcpy(cat_ids, gt->cat_ids, sizeof *cat_ids * (size_t)K);
    double thr[NT], rec_thr[NR];
    thresholds(thr, rec_thr);
    for (int64_t k = 0, i = 0; k < K; k++) {
        int64_t e = i;
        while (e < kept && dv[e].cat == k) e++;
        if ((st = match_category(gt, k, dv + i, e - i, thr, res + i, npig + k * NA)) < 0) goto done;
        for (int64_t j = i; j < e; j++) {
            part_rec *r = &rec[j];
            r->score = dv[j].score;
            r->img_id = gt->img_ids[dv[j].img];
            r->cat = (int32_t)k;
            r->rank = res[j].rank;
            memcpy(r->tp, res[j].tp, sizeof r->tp);
            memcpy(r->ig, res[j].ig, sizeof r->ig);
        }
        i = e;
    }
    *part = out;
    *bytes = size;
    out = NULL;
    goto done;
nomem:
    st = KPL_ERROR(KPL_ENOMEM, "kpl_coco_evaluate: out of memory for %lld detections", (long long)n);
done:
    free(out);
    free(res);
    free(dv);
    return st;
}

/* A category's records, then pycocotools' stable sort of the images'
 * detections (concatenated in image order) by score: score, image, rank. */
static int cmp_rec(const void *a, const void *b)
{
    const part_rec *x = a, *y = b;
    if (x->cat != y->cat) return x->cat < y->cat ? -1 : 1;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    if (x->img_id != y->img_id) return x->img_id < y->img_id ? -1 : 1;
    return (x->rank > y->rank) - (x->rank < y->rank);
}

kpl_status kpl_coco_finish(const void *parts, size_t bytes, kpl_coco_stats *out)
{
    KPL_CHECK(out && (parts || !bytes), KPL_EINVAL, "kpl_coco_finish: bad argument");
    memset(out, 0, sizeof *out);
    const uint8_t *p = parts;
    int64_t K = -1, nrec = 0, nparts = 0;
    const int64_t *cat0 = NULL;
    /* the parts, checked: whole, of one category list */
    for (size_t at = 0; at < bytes; nparts++) {
        part_head h;
        KPL_CHECK(bytes - at >= sizeof h, KPL_EINVAL, "kpl_coco_finish: part %lld is cut short",
                  (long long)nparts);
        memcpy(&h, p + at, sizeof h);
        KPL_CHECK(h.magic == PART_MAGIC && h.ncat >= 0 && h.nrec >= 0 && h.nrec <= h.dets &&
                      h.ncat < ((int64_t)1 << 32) && h.nrec < ((int64_t)1 << 40) &&
                      (size_t)h.bytes == part_size(h.ncat, h.nrec) &&
                      (size_t)h.bytes <= bytes - at,
                  KPL_EINVAL, "kpl_coco_finish: part %lld is not a kpl_coco_match part",
                  (long long)nparts);
        const int64_t *cats = (const int64_t *)(p + at + sizeof h);
        if (K < 0) K = h.ncat, cat0 = cats;
        KPL_CHECK(h.ncat == K && !memcmp(cats, cat0, sizeof *cats * (size_t)K), KPL_EINVAL,
                  "kpl_coco_finish: part %lld has other categories than part 0",
                  (long long)nparts);
        out->images += h.nimg;
        out->gt_boxes += h.nbox;
        out->gt_skipped += h.gt_skipped;
        out->detections += h.dets;
        out->dets_skipped += h.dets_skipped;
        nrec += h.nrec;
        at += (size_t)h.bytes;
    }
    if (K < 0) K = 0;
    out->categories = K;
    size_t nprec = (size_t)NA * NT * NR * (size_t)K, nrc = (size_t)NA * NM * NT * (size_t)K;
    kpl_status st = KPL_OK;
    part_rec *all = malloc(sizeof *all * (size_t)(nrec ? nrec : 1));
    det_result *res = malloc(sizeof *res * (size_t)(nrec ? nrec : 1));
    int64_t *npig = calloc((size_t)(K ? K : 1) * NA, sizeof *npig);
    double *rc = malloc(sizeof *rc * (size_t)(nrec ? nrec : 1));
    double *pr = malloc(sizeof *pr * (size_t)(nrec ? nrec : 1));
    double *prec = malloc(sizeof *prec * (nprec ? nprec : 1));
    double *rec = malloc(sizeof *rec * (nrc ? nrc : 1));
    double *scratch = malloc(sizeof *scratch * (nprec ? nprec : 1));
    if (!all || !res || !npig || !rc || !pr || !prec || !rec || !scratch) {
        st = KPL_ERROR(KPL_ENOMEM, "kpl_coco_evaluate: out of memory for %lld detections",
                       (long long)nrec);
        goto done;
    }
    int64_t got = 0;
    for (size_t at = 0; at < bytes;) {
        part_head h;
        memcpy(&h, p + at, sizeof h);
        const int64_t *np = (const int64_t *)(p + at + sizeof h) + K;
        for (int64_t i = 0; i < K * NA; i++) npig[i] += np[i];
        memcpy(all + got, np + K * NA, sizeof *all * (size_t)h.nrec);
        got += h.nrec;
        at += (size_t)h.bytes;
    }
    for (int64_t i = 0; i < nrec; i++)
        if (all[i].cat < 0 || all[i].cat >= K) {
            st = KPL_ERROR(KPL_EINVAL, "kpl_coco_finish: a record of category %d of %lld",
                           (int)all[i].cat, (long long)K);
            goto done;
        }
    qsort(all, (size_t)nrec, sizeof *all, cmp_rec);
    double thr[NT], rec_thr[NR];
    thresholds(thr, rec_thr);
    for (size_t i = 0; i < nprec; i++) prec[i] = -1;
    for (size_t i = 0; i < nrc; i++) rec[i] = -1;
    for (int64_t i = 0; i < nrec; i++) {
        res[i].rank = all[i].rank;
        memcpy(res[i].tp, all[i].tp, sizeof res[i].tp);
        memcpy(res[i].ig, all[i].ig, sizeof res[i].ig);
    }
    for (int64_t k = 0, i = 0; k < K; k++) {
        int64_t e = i;
        while (e < nrec && all[e].cat == k) e++;
        accumulate(res + i, e - i, npig + k * NA, rec_thr, k, K, rc, pr, prec, rec);
        i = e;
    }
    /* summarize(): means over thresholds, recall points and categories of
     * the entries that are defined, in numpy's order (threshold, recall
     * point, category). */
    size_t tk = (size_t)NT * (size_t)K, rk = (size_t)NR * (size_t)K;
    double *s = out->stats;
    s[KPL_COCO_AP] = mean_defined(prec, (int64_t)(tk * NR), scratch);
    s[KPL_COCO_AP50] = mean_defined(prec, (int64_t)rk, scratch);
    s[KPL_COCO_AP75] = mean_defined(prec + 5 * rk, (int64_t)rk, scratch);
    for (int a = AREA_SMALL; a <= AREA_LARGE; a++) {
        s[KPL_COCO_APS + a - 1] = mean_defined(prec + (size_t)a * tk * NR, (int64_t)(tk * NR),
                                               scratch);
        s[KPL_COCO_ARS + a - 1] = mean_defined(rec + ((size_t)a * NM + 2) * tk, (int64_t)tk,
                                               scratch);
    }
    for (int mi = 0; mi < NM; mi++)
        s[KPL_COCO_AR1 + mi] = mean_defined(rec + (size_t)mi * tk, (int64_t)tk, scratch);
done:
    free(scratch);
    free(rec);
    free(prec);
    free(pr);
    free(rc);
    free(npig);
    free(res);
    free(all);
    return st;
}

kpl_status kpl_coco_evaluate(const kpl_coco_gt *gt, const kpl_coco_detection *dets, int64_t n,
                             kpl_coco_stats *out)
{
    KPL_CHECK(gt && out && n >= 0 && (dets || !n), KPL_EINVAL,
              "kpl_coco_evaluate: bad argument (gt, out NULL, n < 0 or dets NULL)");
    memset(out, 0, sizeof *out);
    void *part = NULL;
    size_t bytes = 0;
    KPL_TRY(kpl_coco_match(gt, dets, n, &part, &bytes));
    kpl_status st = kpl_coco_finish(part, bytes, out);
    free(part);
    return st;
}

int kpl_coco_stats_json(const kpl_coco_stats *s, char *buf, size_t len)
{
    int total = 0;
    for (int i = 0; i < KPL_COCO_NSTATS; i++) {
        char num[40];
        kpl__coco_fmt_num(num, sizeof num, s->stats[i]);
        size_t at = (size_t)total < len ? (size_t)total : len;
        total += snprintf(buf ? buf + at : NULL, buf ? len - at : 0, "%s\"%s\":%s",
                          i ? "," : "{", kpl_coco_stat_names[i], num);
    }
    size_t at = (size_t)total < len ? (size_t)total : len;
    total += snprintf(buf ? buf + at : NULL, buf ? len - at : 0, "}");
    return total;
}
