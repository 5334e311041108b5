/*
 * fcos_head.c — FCOS as a detector head (detector.h: kpl_detector_fcos):
 * its locations, target assignment, training losses and the decoding of
 * its outputs into detections (fcos_impl.h).  The assignment is plain
 * loops on the host, over locations x boxes of one image (a 128x128 input
 * has 341 locations, an 800x1333 one about 20 000); the losses run on the
 * model's device.
 */
#include "fcos_impl.h"

#include "vision.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int64_t kpl__fcos_count(const kpl__fcos_level *lv, int nlevels)
{
    int64_t n = 0;
    for (int l = 0; l < nlevels; l++) n += lv[l].h * lv[l].w;
    return n;
}

void kpl__fcos_points(const kpl__fcos_level *lv, int nlevels, float *xy)
{
    for (int l = 0; l < nlevels; l++) {
        int s = lv[l].stride;
        for (int64_t i = 0; i < lv[l].h; i++)
            for (int64_t j = 0; j < lv[l].w; j++, xy += 2) {
                xy[0] = (float)(s * j + s / 2);
                xy[1] = (float)(s * i + s / 2);
            }
    }
}

static float fmin4(float a, float b, float c, float d) { return fminf(fminf(a, b), fminf(c, d)); }
static float fmax4(float a, float b, float c, float d) { return fmaxf(fmaxf(a, b), fmaxf(c, d)); }

int64_t kpl__fcos_assign(const kpl__fcos_level *lv, int nlevels, const float *xy,
                         const float *boxes, const int64_t *labels, int64_t nb, double radius,
                         int64_t *cls, float *ltrb, float *ctr)
{
    int64_t p = 0, positives = 0;
    for (int l = 0; l < nlevels; l++) {
        float r = (float)(lv[l].stride * radius);
        for (int64_t k = 0; k < lv[l].h * lv[l].w; k++, p++) {
            float x = xy[2 * p], y = xy[2 * p + 1];
            int64_t best = -1;
            float best_area = FLT_MAX;
            for (int64_t b = 0; b < nb; b++) {
                const float *g = boxes + 4 * b;
                if (!(g[2] > g[0] && g[3] > g[1])) continue; /* empty (or NaN) */
                float dl = x - g[0], dt = y - g[1], dr = g[2] - x, db = g[3] - y;
                float inside;
                if (radius > 0) { /* the box cut to the centre region */
                    float cx = (g[0] + g[2]) / 2, cy = (g[1] + g[3]) / 2;
                    float x0 = fmaxf(cx - r, g[0]), y0 = fmaxf(cy - r, g[1]);
                    float x1 = fminf(cx + r, g[2]), y1 = fminf(cy + r, g[3]);
                    inside = fmin4(x - x0, y - y0, x1 - x, y1 - y);
                } else {
                    inside = fmin4(dl, dt, dr, db);
                }
                float reach = fmax4(dl, dt, dr, db);
                if (!(inside > 0) || reach < lv[l].lo || reach > lv[l].hi) continue;
                float area = (g[2] - g[0]) * (g[3] - g[1]);
                if (area < best_area) best_area = area, best = b;
            }
            if (best < 0) {
                cls[p] = -1;
                memset(ltrb + 4 * p, 0, 4 * sizeof *ltrb);
                ctr[p] = 0;
                continue;
            }
            const float *g = boxes + 4 * best;
            float d[4] = {x - g[0], y - g[1], g[2] - x, g[3] - y};
            memcpy(ltrb + 4 * p, d, sizeof d);
            cls[p] = labels[best];
            ctr[p] = sqrtf(fminf(d[0], d[2]) / fmaxf(d[0], d[2]) *
                           (fminf(d[1], d[3]) / fmaxf(d[1], d[3])));
            positives++;
        }
    }
    return positives;
}

/* ---- the losses ---------------------------------------------------------------------------- */

/* Every level's (n, ch, H, W) outputs from o->t[first...] as one (n x P, ch)
 * tensor, level after level, row-major inside each (the points' order). */
static kpl_tensor *flatten_levels(const kpl_tensor_list *o, int first, int levels, int64_t n,
                                  int64_t ch)
{
    static const int nhwc[4] = {0, 2, 3, 1};
    kpl_tensor *part[KPL_FCOS_MAX_LEVELS];
    int64_t p = 0;
    for (int l = 0; l < levels; l++) {
        kpl_tensor *x = o->t[first + l];
        int64_t hw = kpl_tensor_dim(x, 2) * kpl_tensor_dim(x, 3), shape[3] = {n, hw, ch};
        part[l] = kpl_reshape(kpl_permute(x, nhwc), 3, shape);
        p += hw;
    }
    int64_t flat[2] = {n * p, ch};
    return kpl_reshape(levels == 1 ? part[0] : kpl_concat(levels, part, 1), 2, flat);
}

/* A pool-owned tensor of a copy of host data on dev (NULL on failure,
 * kpl_last_status says why). */
static kpl_tensor *host_tensor(kpl_device *dev, kpl_dtype dt, int ndim, const int64_t *shape,
                               const void *data)
{
    kpl_tensor *x = NULL;
    if (kpl_tensor_from_data(dev, dt, ndim, shape, data, &x) < 0) return NULL;
    return kpl_autorelease(x);
}

kpl_status kpl__fcos_loss(const kpl__fcos_loss_config *c, const kpl_tensor_list *o, int64_t n,
                          const float *boxes, const int64_t *labels, const int64_t *nboxes,
                          int64_t maxb, const kpl_detector_ranks *ranks, kpl_tensor **loss,
                          int64_t *positives)
{
    int L = c->levels;
    KPL_CHECK(o->n == 3 * L, KPL_EINVAL, "fcos loss: %d outputs for %d levels (want %d)", o->n, L,
              3 * L);
    kpl__fcos_level lv[KPL_FCOS_MAX_LEVELS];
    int64_t classes = kpl_tensor_dim(o->t[0], 1);
    for (int l = 0; l < L; l++) {
        for (int k = 0; k < 3; k++)
            KPL_CHECK(kpl_tensor_ndim(o->t[k * L + l]) == 4 &&
                          kpl_tensor_dim(o->t[k * L + l], 0) == n &&
                          kpl_tensor_dim(o->t[k * L + l], 2) == kpl_tensor_dim(o->t[l], 2) &&
                          kpl_tensor_dim(o->t[k * L + l], 3) == kpl_tensor_dim(o->t[l], 3) &&
                          kpl_tensor_dim(o->t[k * L + l], 1) == (k == 0 ? classes : k == 1 ? 4 : 1),
                      KPL_EINVAL, "fcos loss: level %d: output %d is not (%lld, %lld, H, W) as "
                      "its level's", l, k * L + l, (long long)n,
                      (long long)(k == 0 ? classes : k == 1 ? 4 : 1));
        lv[l] = (kpl__fcos_level){c->stride[l], kpl_tensor_dim(o->t[l], 2),
                                  kpl_tensor_dim(o->t[l], 3), c->lo[l], c->hi[l]};
    }
    int64_t P = kpl__fcos_count(lv, L), NP = n * P;
    float *xy = malloc((size_t)P * 2 * sizeof *xy), *ltrb = malloc((size_t)NP * 4 * sizeof *ltrb);
    float *ctr = malloc((size_t)NP * sizeof *ctr), *onehot = calloc((size_t)(NP * classes), 4);
    int64_t *cls = malloc((size_t)NP * sizeof *cls);
    float *pos_xy = NULL, *pos_box = NULL, *pos_ctr = NULL;
    int64_t *pos_idx = NULL;
    kpl_status st = KPL_ERROR(KPL_ENOMEM, "fcos loss: out of memory for %lld locations",
                              (long long)NP);
    if (!xy || !ltrb || !ctr || !onehot || !cls) goto done;
    kpl__fcos_points(lv, L, xy);
    int64_t npos = 0;
    for (int64_t i = 0; i < n; i++) {
        st = KPL_ERROR(KPL_EINVAL, "fcos loss: image %lld has %lld boxes (0 to %lld)",
                       (long long)i, (long long)nboxes[i], (long long)maxb);
        if (nboxes[i] < 0 || nboxes[i] > maxb) goto done;
        for (int64_t b = 0; b < nboxes[i]; b++) {
            int64_t y = labels[i * maxb + b];
            st = KPL_ERROR(KPL_EINVAL, "fcos loss: image %lld, box %lld: label %lld is not in "
                           "[0, %lld) (model.num_classes)", (long long)i, (long long)b,
                           (long long)y, (long long)classes);
            if (y < 0 || y >= classes) goto done;
        }
        npos += kpl__fcos_assign(lv, L, xy, boxes + i * maxb * 4, labels + i * maxb, nboxes[i],
                                 c->radius, cls + i * P, ltrb + i * P * 4, ctr + i * P);
    }
    st = KPL_ERROR(KPL_ENOMEM, "fcos loss: out of memory for %lld positives", (long long)npos);
    pos_xy = malloc((size_t)(npos + 1) * 2 * sizeof *pos_xy);
    pos_box = malloc((size_t)(npos + 1) * 4 * sizeof *pos_box);
    pos_ctr = malloc((size_t)(npos + 1) * sizeof *pos_ctr);
    pos_idx = malloc((size_t)(npos + 1) * sizeof *pos_idx);
    if (!pos_xy || !pos_box || !pos_ctr || !pos_idx) goto done;
    double ctr_sum = 0;
    for (int64_t q = 0, k = 0; q < NP; q++) {
        if (cls[q] < 0) continue;
        onehot[q * classes + cls[q]] = 1;
        const float *p = xy + 2 * (q % P), *d = ltrb + 4 * q;
        pos_idx[k] = q;
        pos_xy[2 * k] = p[0], pos_xy[2 * k + 1] = p[1];
        float box[4] = {p[0] - d[0], p[1] - d[1], p[0] + d[2], p[1] + d[3]};
        memcpy(pos_box + 4 * k, box, sizeof box);
        pos_ctr[k] = ctr[q];
        ctr_sum += ctr[q];
        k++;
    }
    /* the normalisers: each rank's, averaged over the ranks */
    double norm[2] = {(double)npos, ctr_sum};
    int32_t world = ranks && ranks->sum ? ranks->world : 1;
    if (world > 1 && (st = ranks->sum(ranks->ctx, norm, 2)) < 0) goto done;
    double num_pos = fmax(norm[0] / world, 1.0), ctr_norm = fmax(norm[1] / world, 1e-6);

    kpl_device *dev = kpl_tensor_device(o->t[0]);
    kpl_tensor *logits = flatten_levels(o, 0, L, n, classes);
    kpl_tensor *reg = flatten_levels(o, L, L, n, 4);
    int64_t flat1[1] = {NP};
    kpl_tensor *cen = kpl_reshape(flatten_levels(o, 2 * L, L, n, 1), 1, flat1);
    int64_t s2[2] = {NP, classes};
    kpl_tensor *target = host_tensor(dev, KPL_F32, 2, s2, onehot);
    loss[0] = kpl_scalar_op(KPL_BIN_DIV, kpl_sigmoid_focal_loss(logits, target, c->alpha,
                                                                c->gamma, KPL_REDUCE_SUM),
                            num_pos, false);
    if (npos == 0) { /* every parameter still takes part (DDP waits for each) */
        loss[1] = kpl_scalar_op(KPL_BIN_MUL, kpl_sum(reg, NULL, 0, false), 0, false);
        loss[2] = kpl_scalar_op(KPL_BIN_MUL, kpl_sum(cen, NULL, 0, false), 0, false);
    } else {
        int64_t sk[1] = {npos}, sk2[2] = {npos, 2}, sk4[2] = {npos, 4};
        kpl_tensor *idx = host_tensor(dev, KPL_I64, 1, sk, pos_idx);
        kpl_tensor *w = host_tensor(dev, KPL_F32, 1, sk, pos_ctr);
        kpl_tensor *pts = host_tensor(dev, KPL_F32, 2, sk2, pos_xy);
        kpl_tensor *gt = host_tensor(dev, KPL_F32, 2, sk4, pos_box);
        kpl_tensor *pred = kpl_box_decode_ltrb(pts, kpl_index_select(reg, 0, idx));
        kpl_tensor *giou = kpl_box_giou_loss(pred, gt, KPL_REDUCE_NONE);
        loss[1] = kpl_scalar_op(KPL_BIN_DIV, kpl_sum(kpl_mul(giou, w), NULL, 0, false), ctr_norm,
                                false);
        loss[2] = kpl_scalar_op(KPL_BIN_DIV,
                                kpl_bce_with_logits(kpl_index_select(cen, 0, idx), w,
                                                    KPL_REDUCE_SUM),
                                num_pos, false);
    }
    st = loss[0] && loss[1] && loss[2] ? KPL_OK : kpl_last_status();
    if (positives) *positives = npos;
done:
    free(xy), free(ltrb), free(ctr), free(onehot), free(cls);
    free(pos_xy), free(pos_box), free(pos_ctr), free(pos_idx);
    return st;
}

/* ---- inference ---------------------------------------------------------------------------- */

typedef struct {
    float score;
    int32_t level;
    int64_t loc, cls; /* location within the level, class */
} candidate;

static int by_score(const void *a, const void *b)
{
    const candidate *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    /* ties: the order the locations and classes come in, as a stable sort */
    if (x->level != y->level) return x->level < y->level ? -1 : 1;
    if (x->loc != y->loc) return x->loc < y->loc ? -1 : 1;
    return x->cls < y->cls ? -1 : x->cls > y->cls;
}

static double sigmoid(double z) { return 1 / (1 + exp(-z)); }

int64_t kpl__fcos_detect_image(const kpl__fcos_decode_config *d, float *const *lc,
                               float *const *lr, float *const *lz, const int64_t (*hw)[2],
                               int64_t i, double img_h, double img_w, float *out_box,
                               float *out_score, int64_t *out_label)
{
    int L = d->levels;
    int64_t C = d->classes, ncand = 0, cap = 0;
    candidate *cand = NULL;
    kpl_status st = KPL_OK;
    for (int l = 0; l < L && st >= 0; l++) {
        int64_t H = hw[l][0], W = hw[l][1], HW = H * W, s = d->stride[l];
        const float *cl = lc[l] + i * C * HW, *z = lz[l] + i * HW;
        int64_t first = ncand;
        for (int64_t q = 0; q < HW; q++) {
            double px = (double)(s * (q % W) + s / 2), py = (double)(s * (q / W) + s / 2);
            if (px >= img_w || py >= img_h) continue; /* the batch's padding */
            double cz = sigmoid(z[q]);
            for (int64_t k = 0; k < C; k++) {
                double sc = sqrt(sigmoid(cl[k * HW + q]) * cz);
                if (!(sc > d->score_thresh)) continue;
                if (ncand == cap) {
                    cap = cap ? 2 * cap : 1024;
                    candidate *p = realloc(cand, (size_t)cap * sizeof *p);
                    if (!p) {
                        free(cand);
                        return KPL_ERROR(KPL_ENOMEM, "eval: out of memory");
                    }
                    cand = p;
                }
                cand[ncand++] = (candidate){(float)sc, l, q, k};
            }
        }
        if (ncand - first > d->topk) { /* the level's best */
            qsort(cand + first, (size_t)(ncand - first), sizeof *cand, by_score);
            ncand = first + d->topk;
        }
    }
    if (ncand == 0) {
        free(cand);
        return 0;
    }
    float *box = malloc((size_t)ncand * 4 * sizeof *box), *score = malloc((size_t)ncand * 4);
    int64_t *lab = malloc((size_t)ncand * sizeof *lab);
    int64_t kept = 0;
    if (!box || !score || !lab) st = KPL_ERROR(KPL_ENOMEM, "eval: out of memory");
    for (int64_t k = 0; st >= 0 && k < ncand; k++) {
        const candidate *c = &cand[k];
        int64_t H = hw[c->level][0], W = hw[c->level][1], HW = H * W, s = d->stride[c->level];
        const float *r = lr[c->level] + i * 4 * HW;
        float px = (float)(s * (c->loc % W) + s / 2), py = (float)(s * (c->loc / W) + s / 2);
        float b[4] = {px - r[c->loc], py - r[HW + c->loc], px + r[2 * HW + c->loc],
                      py + r[3 * HW + c->loc]};
        for (int j = 0; j < 4; j++) {
            float hi = (float)(j % 2 ? img_h : img_w);
            b[j] = isfinite(b[j]) ? fminf(fmaxf(b[j], 0), hi) : 0;
        }
        memcpy(box + 4 * k, b, sizeof b);
        score[k] = c->score, lab[k] = c->cls;
    }
    if (st >= 0) {
        kpl_device *cpu = kpl_device_cpu();
        int64_t s4[2] = {ncand, 4}, s1[1] = {ncand};
        kpl_tensor *keep = NULL;
        st = kpl_batched_nms(host_tensor(cpu, KPL_F32, 2, s4, box),
                             host_tensor(cpu, KPL_F32, 1, s1, score),
                             host_tensor(cpu, KPL_I64, 1, s1, lab), d->nms_iou, &keep);
        const int64_t *ki = st >= 0 ? kpl_tensor_host_data(keep) : NULL;
        kept = ki ? kpl_tensor_numel(keep) : 0;
        if (kept > d->max_dets) kept = d->max_dets;
        for (int64_t k = 0; k < kept; k++) {
            memcpy(out_box + 4 * k, box + 4 * ki[k], 4 * sizeof *box);
            out_score[k] = score[ki[k]], out_label[k] = lab[ki[k]];
        }
    }
    free(cand), free(box), free(score), free(lab);
    return st < 0 ? st : kept;
}

/* ---- the head (detector.h) ------------------------------------------------------------------ */

static kpl_status head_create(kpl_module *model, const kpl_keyvals *kv, const char *file,
                              void **state)
{
    *state = NULL;
    kpl__fcos_loss_config c = {0};
    c.levels = kpl_fcos_strides(model, c.stride);
    if (c.levels == 0) return KPL_ENOTFOUND; /* not an FCOS model: no message */
    double bounds[KPL_FCOS_MAX_LEVELS];
    int nb = 0;
    KPL_TRY(kpl_key_floats(kv, "regress_ranges", bounds, KPL_FCOS_MAX_LEVELS, &nb));
    KPL_CHECK(nb >= c.levels - 1, KPL_EINVAL, "%s: task.detection.regress_ranges: %d "
              "boundaries for %d levels (want %d)", file, nb, c.levels, c.levels - 1);
    for (int l = 0; l < c.levels; l++) {
        c.lo[l] = l == 0 ? -1 : bounds[l - 1];
        c.hi[l] = l == c.levels - 1 ? 1e8 : bounds[l];
        KPL_CHECK(c.hi[l] > c.lo[l], KPL_EINVAL, "%s: task.detection.regress_ranges: "
                  "boundaries must increase (%g then %g)", file, c.lo[l], c.hi[l]);
    }
    KPL_TRY(kpl_key_float(kv, "center_radius", &c.radius));
    KPL_TRY(kpl_key_float(kv, "focal_alpha", &c.alpha));
    KPL_TRY(kpl_key_float(kv, "focal_gamma", &c.gamma));
    kpl__fcos_loss_config *s = malloc(sizeof *s);
    KPL_CHECK(s, KPL_ENOMEM, "fcos: out of memory");
    *s = c;
    *state = s;
    return KPL_OK;
}

static void head_destroy(void *state) { free(state); }

static kpl_status head_loss(void *state, const kpl_tensor_list *o, const kpl_detector_targets *tg,
                            const kpl_detector_ranks *ranks, kpl_tensor **loss)
{
    return kpl__fcos_loss(state, o, tg->n, tg->boxes, tg->labels, tg->nboxes, tg->maxb, ranks,
                          loss, NULL);
}

static kpl_status head_decode(void *state, const kpl_tensor_list *o, const kpl_detector_decode *d,
                              int64_t n, const double *img_hw, float *box, float *score,
                              int64_t *label, int64_t *count)
{
    const kpl__fcos_loss_config *c = state;
    int L = c->levels;
    KPL_CHECK(o->n == 3 * L, KPL_EINVAL, "detection: the model gave %d outputs for %d levels",
              o->n, L);
    kpl__fcos_decode_config dc = {L, {0}, d->classes, d->topk, d->max_dets, d->score_thresh,
                                  d->nms_iou};
    memcpy(dc.stride, c->stride, sizeof dc.stride);
    float *lc[KPL_FCOS_MAX_LEVELS], *lr[KPL_FCOS_MAX_LEVELS], *lz[KPL_FCOS_MAX_LEVELS];
    int64_t hw[KPL_FCOS_MAX_LEVELS][2];
    for (int l = 0; l < L; l++) { /* on the host, once for the batch */
        lc[l] = (float *)kpl_tensor_host_data(o->t[l]);
        lr[l] = (float *)kpl_tensor_host_data(o->t[L + l]);
        lz[l] = (float *)kpl_tensor_host_data(o->t[2 * L + l]);
        if (!lc[l] || !lr[l] || !lz[l]) return kpl_last_status();
        hw[l][0] = kpl_tensor_dim(o->t[l], 2), hw[l][1] = kpl_tensor_dim(o->t[l], 3);
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t k = kpl__fcos_detect_image(&dc, lc, lr, lz, hw, i, img_hw[2 * i],
                                           img_hw[2 * i + 1], box + 4 * i * d->max_dets,
                                           score + i * d->max_dets, label + i * d->max_dets);
        if (k < 0) return (kpl_status)k;
        count[i] = k;
    }
    return KPL_OK;
}

const kpl_detector_head kpl_detector_fcos = {
    .name = "fcos",
    .create = head_create,
    .destroy = head_destroy,
    .nlosses = 3,
    .loss_names = {"loss_cls", "loss_box", "loss_ctr"},
    .loss = head_loss,
    .decode = head_decode,
};
