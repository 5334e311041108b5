/*
 * cpu_vision.c — the detection kernels on the CPU: IoU / GIoU of every
 * pair or of matched pairs, greedy non-maximum suppression (one class, or
 * per class), and ROI Align forward and backward.  The formulas come from
 * vision_math.h (shared with CUDA); the visiting order of NMS
 * (kpl__nms_order) is shared with the CUDA kernel, which sorts on the
 * host as well.
 *
 * Built with -ffp-contract=off (kernels/CMakeLists.txt): see vision_math.h.
 */
#include "../vision_math.h"
#include "kernels_impl.h"

#include <stdlib.h>
#include <string.h>

/* ---- the visiting order ---------------------------------------------------------- */

/* Sorts idx[0..n) stably by key[idx[i]], ascending: least significant
 * byte first (LSD radix), skipping the bytes every key shares.  tmp holds
 * n entries.  Stability is what orders equal keys by their place in idx. */
static void radix_sort(int64_t *idx, int64_t *tmp, const uint64_t *key, int64_t n)
{
    int64_t *src = idx, *dst = tmp;
    for (int shift = 0; shift < 64; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < n; i++) count[((key[src[i]] >> shift) & 0xff) + 1]++;
        bool shared = false;
        for (int b = 1; b <= 256 && !shared; b++) shared = count[b] == n;
        if (shared) continue;
        for (int b = 1; b <= 256; b++) count[b] += count[b - 1];
        for (int64_t i = 0; i < n; i++) dst[count[(key[src[i]] >> shift) & 0xff]++] = src[i];
        int64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != idx) memcpy(idx, src, (size_t)n * sizeof *idx);
}

/* A key that grows as the score falls: NaN 0 (first), then +inf, ..., -inf;
 * -0 and +0 share one key, so they tie and go by index. */
static uint64_t score_key(double v)
{
    if (v != v) return 0;
    if (v == 0) v = 0;
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    u = (u >> 63) ? ~u : u | (1ull << 63); /* grows with v */
    return ~u;
}

kpl_status kpl__nms_order(const void *scores, kpl_dtype dt, int64_t n, int64_t *order)
{
    uint64_t *key = malloc((size_t)(n ? n : 1) * sizeof *key);
    int64_t *tmp = malloc((size_t)(n ? n : 1) * sizeof *tmp);
    if (!key || !tmp) {
        free(key);
        free(tmp);
        return KPL_ERROR(KPL_ENOMEM, "nms: no host memory to sort %lld scores", (long long)n);
    }
    for (int64_t i = 0; i < n; i++) {
        key[i] = score_key(dt == KPL_F64 ? ((const double *)scores)[i]
                                         : (double)((const float *)scores)[i]);
        order[i] = i;
    }
    radix_sort(order, tmp, key, n);
    free(key);
    free(tmp);
    return KPL_OK;
}

/* ---- typed loops --------------------------------------------------------------------- */

/* SoA columns of n boxes (rows visit[p] of `boxes`, or row p when visit is
 * NULL) and their areas, so the pair loops read each with stride 1. */
#define DEF_TYPED(T, tn, THRESHOLD)                                                            \
    static void columns_##tn(T *soa, const T *boxes, const int64_t *visit, int64_t n)          \
    {                                                                                          \
        T *x0 = soa, *y0 = soa + n, *x1 = soa + 2 * n, *y1 = soa + 3 * n, *ar = soa + 4 * n;   \
        for (int64_t p = 0; p < n; p++) {                                                      \
            const T *b = boxes + 4 * (visit ? visit[p] : p);                                   \
            x0[p] = b[0], y0[p] = b[1], x1[p] = b[2], y1[p] = b[3];                            \
            ar[p] = KPL_BOX_AREA(b[0], b[1], b[2], b[3]);                                      \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* o[j] = metric(box pa, column box j) for j < m. */                                       \
    KPL_CLONES static void metric_row_##tn(T *o, const T *pa, const T *soa, int64_t m,         \
                                           int giou)                                           \
    {                                                                                          \
        const T *x0 = soa, *y0 = soa + m, *x1 = soa + 2 * m, *y1 = soa + 3 * m;                \
        const T *ar = soa + 4 * m;                                                             \
        T ax0 = pa[0], ay0 = pa[1], ax1 = pa[2], ay1 = pa[3];                                  \
        T aa = KPL_BOX_AREA(ax0, ay0, ax1, ay1);                                               \
        if (giou) {                                                                            \
            _Pragma("omp simd") for (int64_t j = 0; j < m; j++) o[j] =                         \
                kpl_box_eval_##tn(ax0, ay0, ax1, ay1, aa, x0[j], y0[j], x1[j], y1[j],          \
                                  ar[j], 1);                                                   \
        } else {                                                                               \
            _Pragma("omp simd") for (int64_t j = 0; j < m; j++) o[j] =                         \
                kpl_box_eval_##tn(ax0, ay0, ax1, ay1, aa, x0[j], y0[j], x1[j], y1[j],          \
                                  ar[j], 0);                                                   \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static kpl_status metric_##tn(const kpl_box_attrs *a, T *o, const T *pa, const T *pb)      \
    {                                                                                          \
        int64_t n = a->n, m = a->m;                                                            \
        int giou = a->metric == KPL_BOX_GIOU;                                                  \
        if (!a->pairwise) {                                                                    \
            KPL_PARALLEL_FOR_IF(i, n, n > KPL_PAR_GRAIN / 8,                                   \
                const T *p = pa + 4 * i, *q = pb + 4 * i;                                      \
                o[i] = kpl_box_eval_##tn(p[0], p[1], p[2], p[3],                               \
                                         KPL_BOX_AREA(p[0], p[1], p[2], p[3]), q[0], q[1],     \
                                         q[2], q[3], KPL_BOX_AREA(q[0], q[1], q[2], q[3]),     \
                                         giou);                                                \
            );                                                                                 \
            return KPL_OK;                                                                     \
        }                                                                                      \
        T *soa = malloc((size_t)m * 5 * sizeof *soa);                                          \
        KPL_CHECK(soa != NULL, KPL_ENOMEM, "box_iou: no host memory for %lld boxes",           \
                  (long long)m);                                                               \
        columns_##tn(soa, pb, NULL, m);                                                        \
        KPL_PARALLEL_FOR_IF(i, n, n > 1 && n * m > KPL_PAR_GRAIN / 8,                          \
            metric_row_##tn(o + i * m, pa + 4 * i, soa, m, giou);                              \
        );                                                                                     \
        free(soa);                                                                             \
        return KPL_OK;                                                                         \
    }                                                                                          \
                                                                                               \
    /* sup[j] |= IoU(box i, box j) > thr for the column boxes i < j < e. */                    \
    KPL_CLONES static void suppress_##tn(const T *soa, int64_t n, int64_t i, int64_t e,        \
                                         T thr, uint8_t *sup)                                  \
    {                                                                                          \
        const T *x0 = soa, *y0 = soa + n, *x1 = soa + 2 * n, *y1 = soa + 3 * n;                \
        const T *ar = soa + 4 * n;                                                             \
        T ax0 = x0[i], ay0 = y0[i], ax1 = x1[i], ay1 = y1[i], aa = ar[i];                      \
        _Pragma("omp simd") for (int64_t j = i + 1; j < e; j++) {                              \
            T iou = kpl_box_eval_##tn(ax0, ay0, ax1, ay1, aa, x0[j], y0[j], x1[j], y1[j],      \
                                      ar[j], 0);                                               \
            sup[j] |= iou > thr;                                                               \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* Greedy NMS over the boxes in visiting order, each class a segment                       \
     * [seg[s], seg[s + 1]) of it: kept[p] for the survivors. */                               \
    static void nms_##tn(const T *boxes, const int64_t *visit, int64_t n, const int64_t *seg,  \
                         int64_t nseg, double thr, T *soa, uint8_t *sup, uint8_t *kept)        \
    {                                                                                          \
        columns_##tn(soa, boxes, visit, n);                                                    \
        T t = THRESHOLD(thr);                                                                  \
        /* Classes in parallel only when they hold enough pairs to pay for                     \
         * waking the team (5000 boxes in 80 classes take 0.3 ms on one thread). */            \
        double pairs = 0;                                                                      \
        for (int64_t s = 0; s < nseg; s++)                                                     \
            pairs += 0.5 * (double)(seg[s + 1] - seg[s]) * (double)(seg[s + 1] - seg[s]);      \
        _Pragma("omp parallel for schedule(dynamic, 1) if (nseg > 1 && pairs > 1e7)")          \
        for (int64_t s = 0; s < nseg; s++)                                                     \
            for (int64_t i = seg[s]; i < seg[s + 1]; i++) {                                    \
                if (sup[i]) continue;                                                          \
                kept[i] = 1;                                                                   \
                suppress_##tn(soa, n, i, seg[s + 1], t, sup);                                  \
            }                                                                                  \
    }

#define THRESHOLD_F64(thr) (thr)
DEF_TYPED(float, f32, kpl_nms_threshold_f32)
DEF_TYPED(double, f64, THRESHOLD_F64)
#undef DEF_TYPED

/* ---- NMS ------------------------------------------------------------------------------- */

/* visit = order stably grouped by class; seg[0..nseg] the class runs. */
static void group_by_class(const int64_t *cls, const int64_t *order, int64_t n, int64_t *visit,
                           int64_t *tmp, uint64_t *key, int64_t *seg, int64_t *nseg)
{
    memcpy(visit, order, (size_t)n * sizeof *visit);
    for (int64_t i = 0; i < n; i++) key[i] = (uint64_t)cls[i] ^ (1ull << 63);
    radix_sort(visit, tmp, key, n);
    int64_t k = 0;
    for (int64_t p = 0; p < n; p++)
        if (p == 0 || cls[visit[p]] != cls[visit[p - 1]]) seg[k++] = p;
    seg[k] = n;
    *nseg = k;
}

static kpl_status cpu_nms(const kpl_kernel_args *args)
{
    const kpl_box_attrs *a = args->attrs;
    const kpl_tensor *boxes = args->in[0], *scores = args->in[1], *cls = args->in[2];
    int64_t n = a->n, nseg = 1;
    size_t nn = (size_t)n, es = kpl_dtype_size(boxes->dtype);
    int64_t *order = malloc(nn * sizeof *order), *visit = NULL, *tmp = NULL;
    int64_t *seg = malloc((nn + 1) * sizeof *seg);
    uint64_t *key = NULL;
    uint8_t *flags = calloc(3, nn); /* suppressed, kept (visit order), kept (by index) */
    void *soa = malloc(5 * nn * es);
    kpl_status st = KPL_OK;
    if (cls) {
        visit = malloc(nn * sizeof *visit);
        tmp = malloc(nn * sizeof *tmp);
        key = malloc(nn * sizeof *key);
    }
    if (!order || !seg || !flags || !soa || (cls && (!visit || !tmp || !key))) {
        st = KPL_ERROR(KPL_ENOMEM, "nms: no host memory for %lld boxes", (long long)n);
        goto fail;
    }
    KPL_TRY_GOTO(kpl__nms_order(kpl__cdata(scores), scores->dtype, n, order));
    seg[0] = 0;
    seg[1] = n;
    if (cls) group_by_class(kpl__cdata(cls), order, n, visit, tmp, key, seg, &nseg);
    const int64_t *v = cls ? visit : order;
    uint8_t *sup = flags, *kept = flags + nn, *by_index = flags + 2 * nn;
    if (boxes->dtype == KPL_F64)
        nms_f64(kpl__cdata(boxes), v, n, seg, nseg, a->thr, soa, sup, kept);
    else
        nms_f32(kpl__cdata(boxes), v, n, seg, nseg, a->thr, soa, sup, kept);
    /* Out in score order, whatever order the classes were visited in. */
    for (int64_t p = 0; p < n; p++) by_index[v[p]] = kept[p];
    int64_t *out = kpl__data(args->out), k = 0;
    for (int64_t p = 0; p < n; p++)
        if (by_index[order[p]]) out[k++] = order[p];
    *a->nkeep = k;
fail:
    free(soa);
    free(flags);
    free(key);
    free(tmp);
    free(visit);
    free(seg);
    free(order);
    return st;
}

static kpl_status cpu_box(const kpl_kernel_args *args)
{
    const kpl_box_attrs *a = args->attrs;
    if (a->nms) return cpu_nms(args);
    if (args->out->dtype == KPL_F64)
        return metric_f64(a, kpl__data(args->out), kpl__cdata(args->in[0]),
                          kpl__cdata(args->in[1]));
    return metric_f32(a, kpl__data(args->out), kpl__cdata(args->in[0]), kpl__cdata(args->in[1]));
}

/* ---- ROI Align ------------------------------------------------------------------------ */

/* The rois are taken in chunks whose sample tables (the axis entries of
 * each roi's out_h gh row samples and out_w gw column samples, computed
 * once per roi and read by every channel) hold at most this many entries,
 * or one roi's when that alone needs more: the memory stays bounded
 * however large the rois. */
#define ROI_CHUNK ((int64_t)1 << 18)

#define ROI_ADD(p, v) (*(p) += (v))

#define DEF_ROI(T, tn)                                                                        \
    typedef struct {                                                                          \
        kpl_roi_geom_##tn g;                                                                  \
        int64_t batch;                                                                        \
        int64_t y, x; /* its first row / column entry in the chunk's table */                 \
    } roi_plan_##tn;                                                                          \
                                                                                              \
    /* The entries of one axis of a roi: `bins` bins of `grid` samples      \
     * from `start`, on an axis of `size` cells. */                         \
    static void roi_axis_table_##tn(kpl_roi_axis_##tn *ent, uint8_t *ok, int64_t bins,         \
                                    int64_t grid, T start, T bin, int64_t size)               \
    {                                                                                         \
        for (int64_t p = 0; p < bins; p++)                                                    \
            for (int64_t i = 0; i < grid; i++)                                                \
                ok[p * grid + i] = (uint8_t)kpl_roi_axis_at_##tn(                             \
                    &ent[p * grid + i], KPL_ROI_COORD(T, start, p, bin, i, grid), size);      \
    }                                                                                         \
                                                                                              \
    /* Fills the entries of rois [k0, k1), whose plans give their places. */                  \
    static void roi_tables_##tn(const kpl_roi_attrs *a, const roi_plan_##tn *plan,            \
                                int64_t k0, int64_t k1, kpl_roi_axis_##tn *ent, uint8_t *ok)  \
    {                                                                                         \
        for (int64_t k = k0; k < k1; k++) {                                                   \
            const kpl_roi_geom_##tn *g = &plan[k].g;                                          \
            roi_axis_table_##tn(ent + plan[k].y, ok + plan[k].y, a->p.out_h, g->gh, g->y0,    \
                                g->bh, a->h);                                                 \
            roi_axis_table_##tn(ent + plan[k].x, ok + plan[k].x, a->p.out_w, g->gw, g->x0,    \
                                g->bw, a->w);                                                 \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    /* Forward: the bins dst (out_h, out_w) of one roi over one channel   \
     * plane src (h, w).  Backward: its adjoint, the bins' gradients src   \
     * added into the plane's gradient dst. */                             \
    static inline __attribute__((always_inline)) void roi_plane_##tn(                        \
        const kpl_roi_attrs *a, const roi_plan_##tn *r, const kpl_roi_axis_##tn *ent,         \
        const uint8_t *ok, const T *src, T *dst, const bool bwd)                              \
    {                                                                                         \
        int64_t gh = r->g.gh, gw = r->g.gw, w = a->w, ow = a->p.out_w;                        \
        for (int64_t ph = 0; ph < a->p.out_h; ph++)                                           \
            for (int64_t pw = 0; pw < ow; pw++) {                                             \
                T sum = 0, gb = bwd ? src[ph * ow + pw] : 0;                                  \
                for (int64_t ey = r->y + ph * gh; ey < r->y + (ph + 1) * gh; ey++) {          \
                    if (!ok[ey]) continue;                                                    \
                    for (int64_t ex = r->x + pw * gw; ex < r->x + (pw + 1) * gw; ex++) {      \
                        if (!ok[ex]) continue;                                                \
                        if (bwd)                                                              \
                            KPL_ROI_SCATTER(ROI_ADD, dst, w, ent[ey], ent[ex], gb, r->g.count); \
                        else                                                                  \
                            sum += KPL_ROI_BILINEAR(src, w, ent[ey], ent[ex]);                \
                    }                                                                         \
                }                                                                             \
                if (!bwd) dst[ph * ow + pw] = sum / r->g.count;                               \
            }                                                                                 \
    }                                                                                         \
                                                                                              \
    /* Forward: out (k, c, oh, ow) from in = x; backward: out = gx from in = gy. */           \
    static kpl_status roi_align_##tn(const kpl_roi_attrs *a, T *out, const T *in,             \
                                     const T *rois)                                           \
    {                                                                                         \
        int64_t K = a->k, C = a->c, hw = a->h * a->w, oh = a->p.out_h, ow = a->p.out_w;       \
        roi_plan_##tn *plan = malloc((size_t)(K ? K : 1) * sizeof *plan);                     \
        KPL_CHECK(plan != NULL, KPL_ENOMEM, "roi_align: no host memory for %lld rois",        \
                  (long long)K);                                                              \
        int64_t cap = ROI_CHUNK;                                                              \
        for (int64_t k = 0; k < K; k++) {                                                     \
            kpl_roi_geom_set_##tn(&plan[k].g, rois + 5 * k, (T)a->p.spatial_scale, oh, ow,    \
                                  a->p.sampling_ratio, a->p.aligned);                         \
            plan[k].batch = (int64_t)rois[5 * k];                                             \
            int64_t need = oh * plan[k].g.gh + ow * plan[k].g.gw;                             \
            if (need > cap) cap = need;                                                       \
        }                                                                                     \
        kpl_roi_axis_##tn *ent = malloc((size_t)cap * sizeof *ent);                           \
        uint8_t *ok = malloc((size_t)cap);                                                    \
        if (!ent || !ok) {                                                                    \
            free(ok);                                                                         \
            free(ent);                                                                        \
            free(plan);                                                                       \
            return KPL_ERROR(KPL_ENOMEM, "roi_align: no host memory for %lld sample entries", \
                             (long long)cap);                                                 \
        }                                                                                     \
        if (a->bwd) memset(out, 0, (size_t)(a->n * C * hw) * sizeof *out);                    \
        for (int64_t k0 = 0, k1; k0 < K; k0 = k1) {                                           \
            int64_t used = 0;                                                                 \
            double work = 0;                                                                  \
            for (k1 = k0; k1 < K; k1++) {                                                     \
                int64_t need = oh * plan[k1].g.gh + ow * plan[k1].g.gw;                       \
                if (k1 > k0 && used + need > cap) break;                                      \
                plan[k1].y = used;                                                            \
                plan[k1].x = used + oh * plan[k1].g.gh;                                       \
                used += need;                                                                 \
                work += (double)(oh * ow) * (double)(plan[k1].g.gh * plan[k1].g.gw);          \
            }                                                                                 \
            roi_tables_##tn(a, plan, k0, k1, ent, ok);                                        \
            bool par = work * (double)C > (double)KPL_PAR_GRAIN;                              \
            if (!a->bwd) {                                                                    \
                KPL_PARALLEL_FOR_IF(i, (k1 - k0) * C, par && kpl_n_ > 1,                      \
                    int64_t k = k0 + i / C, c = i % C;                                        \
                    roi_plane_##tn(a, &plan[k], ent, ok, in + (plan[k].batch * C + c) * hw,   \
                                   out + (k * C + c) * oh * ow, false);                       \
                );                                                                            \
            } else {                                                                          \
                /* A plane at a time: the rois of one image add into it in order. */          \
                KPL_PARALLEL_FOR_IF(i, a->n * C, par && kpl_n_ > 1,                           \
                    int64_t n = i / C, c = i % C;                                             \
                    for (int64_t k = k0; k < k1; k++)                                         \
                        if (plan[k].batch == n)                                               \
                            roi_plane_##tn(a, &plan[k], ent, ok, in + (k * C + c) * oh * ow,  \
                                           out + i * hw, true);                               \
                );                                                                            \
            }                                                                                 \
        }                                                                                     \
        free(ok);                                                                             \
        free(ent);                                                                            \
        free(plan);                                                                           \
        return KPL_OK;                                                                        \
    }

DEF_ROI(float, f32)
DEF_ROI(double, f64)
#undef DEF_ROI

static kpl_status cpu_roi_align(const kpl_kernel_args *args)
{
    const kpl_roi_attrs *a = args->attrs;
    if (args->out->dtype == KPL_F64)
        return roi_align_f64(a, kpl__data(args->out), kpl__cdata(args->in[0]),
                             kpl__cdata(args->in[1]));
    return roi_align_f32(a, kpl__data(args->out), kpl__cdata(args->in[0]),
                         kpl__cdata(args->in[1]));
}

void kpl__cpu_register_vision(void)
{
    kpl_kernel_register(KPL_KOP_BOX, KPL_DEVICE_CPU, KPL_F32, cpu_box);
    kpl_kernel_register(KPL_KOP_BOX, KPL_DEVICE_CPU, KPL_F64, cpu_box);
    kpl_kernel_register(KPL_KOP_ROI_ALIGN, KPL_DEVICE_CPU, KPL_F32, cpu_roi_align);
    kpl_kernel_register(KPL_KOP_ROI_ALIGN, KPL_DEVICE_CPU, KPL_F64, cpu_roi_align);
}
