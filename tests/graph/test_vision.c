/* test_vision.c — the box ops of graph/vision.h: IoU and GIoU against hand
 * computations (identical, disjoint, nested, overlapping, touching and
 * zero-area boxes), the fused kernel against the recorded composition bit
 * for bit, gradients against finite differences to the second order, NMS
 * against a plain greedy reference on random boxes with tied scores,
 * batched NMS against NMS per class, NaN scores, the strict threshold,
 * and the error messages.
 *
 * Built with -ffp-contract=off (CMakeLists.txt): the reference IoU below
 * rounds each step as the kernels do, so NMS decisions compare exactly. */
#include "kpl_test.h"
#include "autograd.h"
#include "vision.h"

#include <stdlib.h>

/* ---- helpers ------------------------------------------------------------------------- */

/* (n, 4) boxes (or any shape) of dtype dt from doubles, pool-owned. */
static kpl_tensor *tensor(kpl_dtype dt, int ndim, const int64_t *shape, const double *v)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    kpl_tensor *t = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), dt, ndim, shape, &t));
    void *h = kpl_tensor_host_mutable(t);
    for (int64_t i = 0; i < n; i++) {
        if (dt == KPL_F64) ((double *)h)[i] = v[i];
        else if (dt == KPL_F32) ((float *)h)[i] = (float)v[i];
        else ((int64_t *)h)[i] = (int64_t)v[i];
    }
    return kpl_autorelease(t);
}

static kpl_tensor *boxes(kpl_dtype dt, int64_t n, const double *v)
{
    int64_t s[2] = {n, 4};
    return tensor(dt, 2, s, v);
}

static kpl_tensor *vec(kpl_dtype dt, int64_t n, const double *v) { return tensor(dt, 1, &n, v); }

/* A leaf that requires grad, owned by the caller. */
static kpl_tensor *param_boxes(int64_t n, const double *v)
{
    int64_t s[2] = {n, 4};
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 2, s, v, &t));
    OK(kpl_set_requires_grad(t, true));
    return t;
}

/* A small deterministic generator (the tests must not depend on rand()). */
static uint64_t lcg_state;
static double uniform(void)
{
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(lcg_state >> 11) * (1.0 / 9007199254740992.0);
}

/* n random boxes on a w x w field with sides in [lo, hi). */
static void random_boxes(double *v, int64_t n, double w, double lo, double hi)
{
    for (int64_t i = 0; i < n; i++) {
        double x = uniform() * w, y = uniform() * w;
        v[4 * i] = x;
        v[4 * i + 1] = y;
        v[4 * i + 2] = x + lo + uniform() * (hi - lo);
        v[4 * i + 3] = y + lo + uniform() * (hi - lo);
    }
}

/* ---- values by hand ------------------------------------------------------------------ */

typedef struct {
    const char *what;
    double a[4], b[4];
    double iou, giou;
} box_case;

static const box_case cases[] = {
    {"identical", {1, 2, 4, 6}, {1, 2, 4, 6}, 1, 1},
    /* union 2, enclosing 3 */
    {"disjoint", {0, 0, 1, 1}, {2, 0, 3, 1}, 0, -1.0 / 3},
    /* union 2, enclosing 9 */
    {"disjoint diagonal", {0, 0, 1, 1}, {2, 2, 3, 3}, 0, -7.0 / 9},
    {"nested", {0, 0, 4, 4}, {1, 1, 3, 3}, 0.25, 0.25},
    /* intersection 1, union 7, enclosing 9 */
    {"overlapping", {0, 0, 2, 2}, {1, 1, 3, 3}, 1.0 / 7, 1.0 / 7 - 2.0 / 9},
    /* intersection 1 x 1.5, union 4 + 2 x 2.5 - 1.5 = 7.5, enclosing 3 x 3 */
    {"overlapping, fractions", {0, 0, 2, 2}, {1, 0.5, 3, 3}, 0.2, 0.2 - 1.5 / 9},
    {"touching edges", {0, 0, 1, 1}, {1, 0, 2, 1}, 0, 0},
    /* union 2, enclosing 4 */
    {"touching corners", {0, 0, 1, 1}, {1, 1, 2, 2}, 0, -0.5},
    {"one point twice", {1, 1, 1, 1}, {1, 1, 1, 1}, 0, 0},
    {"a point inside a box", {1, 1, 1, 1}, {0, 0, 2, 2}, 0, 0},
    /* union 0, enclosing 1 */
    {"two points", {0, 0, 0, 0}, {1, 1, 1, 1}, 0, -1},
    {"a line along a box's edge", {0, 0, 2, 0}, {0, 0, 2, 2}, 0, 0},
    /* union 0 and enclosing 0: both ratios are 0 */
    {"two segments of one line", {0, 0, 2, 0}, {1, 0, 3, 0}, 0, 0},
};
#define NCASES ((int64_t)(sizeof cases / sizeof cases[0]))

/* Checks every case through kpl_box_iou / kpl_generalized_box_iou (the
 * diagonal of the pairwise result, and the transposed pairs) and the loss,
 * with or without recording. */
static void check_cases(kpl_dtype dt, bool record)
{
    double va[4 * NCASES], vb[4 * NCASES];
    for (int64_t c = 0; c < NCASES; c++)
        for (int k = 0; k < 4; k++) va[4 * c + k] = cases[c].a[k], vb[4 * c + k] = cases[c].b[k];
    kpl_tensor *a = boxes(dt, NCASES, va), *b = boxes(dt, NCASES, vb);
    if (record) { /* a leaf asking for gradients makes the ops record */
        kpl_tensor *pa = NULL;
        OK(kpl_tensor_to_device(a, kpl_device_cpu(), &pa));
        OK(kpl_set_requires_grad(pa, true));
        a = kpl_autorelease(pa);
    }
    double tol = dt == KPL_F64 ? 1e-15 : 1e-7;
    kpl_tensor *iou = NN(kpl_box_iou(a, b)), *giou = NN(kpl_generalized_box_iou(a, b));
    kpl_tensor *iou_t = NN(kpl_box_iou(b, a)), *giou_t = NN(kpl_generalized_box_iou(b, a));
    assert_int_equal(kpl_tensor_ndim(iou), 2);
    assert_int_equal(kpl_tensor_shape(iou)[0], NCASES);
    assert_int_equal(kpl_tensor_shape(iou)[1], NCASES);
    assert_true(kpl_requires_grad(iou) == record);
    kpl_tensor *loss = NN(kpl_box_giou_loss(a, b, KPL_REDUCE_NONE));
    assert_int_equal(kpl_tensor_ndim(loss), 1);
    double sum = 0;
    for (int64_t c = 0; c < NCASES; c++) {
        int64_t d = c * NCASES + c;
        assert_close(tget(iou, d), cases[c].iou, 0, tol, cases[c].what, c);
        assert_close(tget(giou, d), cases[c].giou, 0, tol, cases[c].what, c);
        assert_close(tget(iou_t, d), cases[c].iou, 0, tol, cases[c].what, c);
        assert_close(tget(giou_t, d), cases[c].giou, 0, tol, cases[c].what, c);
        assert_close(tget(loss, c), 1 - cases[c].giou, 0, tol, cases[c].what, c);
        sum += 1 - cases[c].giou;
    }
    /* an off-diagonal pair: "identical" (1, 2, 4, 6) against "nested"'s
     * (1, 1, 3, 3): intersection 2 x 1, union 12 + 4 - 2, enclosing 3 x 5 */
    assert_close(tget(iou, 0 * NCASES + 3), 2.0 / 14, 0, tol, "identical x nested", 0);
    assert_close(tget(giou, 0 * NCASES + 3), 2.0 / 14 - 1.0 / 15, 0, tol, "identical x nested", 0);
    kpl_tensor *ls = NN(kpl_box_giou_loss(a, b, KPL_REDUCE_SUM));
    kpl_tensor *lm = NN(kpl_box_giou_loss(a, b, KPL_REDUCE_MEAN));
    assert_int_equal(kpl_tensor_ndim(ls), 0);
    assert_close(tget(ls, 0), sum, 0, 8 * tol, "loss sum", 0);
    assert_close(tget(lm, 0), sum / NCASES, 0, 8 * tol, "loss mean", 0);
}

static void test_values(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    for (int r = 0; r < 2; r++) {
        check_cases(KPL_F64, r);
        check_cases(KPL_F32, r);
    }
    /* empty sides */
    double v[8] = {0, 0, 1, 1, 2, 2, 3, 3};
    kpl_tensor *e = boxes(KPL_F32, 0, v), *two = boxes(KPL_F32, 2, v);
    kpl_tensor *r = NN(kpl_box_iou(e, two));
    assert_int_equal(kpl_tensor_shape(r)[0], 0);
    assert_int_equal(kpl_tensor_shape(r)[1], 2);
    r = NN(kpl_generalized_box_iou(two, e));
    assert_int_equal(kpl_tensor_shape(r)[0], 2);
    assert_int_equal(kpl_tensor_shape(r)[1], 0);
    /* the mean loss of no pairs is 0 (torchvision's too) */
    assert_close(tget(NN(kpl_box_giou_loss(e, e, KPL_REDUCE_MEAN)), 0), 0, 0, 0, "empty mean", 0);
    kpl_pool_pop(p);
}

/* The fused kernel and the recorded composition give the same bits. */
static void test_paths_agree(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    lcg_state = 7;
    enum { N = 37, M = 53 };
    double va[4 * N], vb[4 * M];
    random_boxes(va, N, 20, 0, 8);
    random_boxes(vb, M, 20, 0, 8);
    vb[0] = 0, vb[1] = 0, vb[2] = 0, vb[3] = 0; /* a zero-area box among them */
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = f ? KPL_F64 : KPL_F32;
        kpl_tensor *a = boxes(dt, N, va), *b = boxes(dt, M, vb), *b_n = boxes(dt, N, vb);
        kpl_tensor *pa = NULL;
        OK(kpl_tensor_to_device(a, kpl_device_cpu(), &pa));
        OK(kpl_set_requires_grad(pa, true));
        kpl_autorelease(pa);
        kpl_tensor *k[3] = {NN(kpl_box_iou(a, b)), NN(kpl_generalized_box_iou(a, b)),
                            NN(kpl_box_giou_loss(a, b_n, KPL_REDUCE_NONE))};
        kpl_tensor *g[3] = {NN(kpl_box_iou(pa, b)), NN(kpl_generalized_box_iou(pa, b)),
                            NN(kpl_box_giou_loss(pa, b_n, KPL_REDUCE_NONE))};
        for (int i = 0; i < 3; i++) {
            assert_false(kpl_requires_grad(k[i]));
            assert_true(kpl_requires_grad(g[i]));
            assert_int_equal(kpl_tensor_numel(k[i]), kpl_tensor_numel(g[i]));
            for (int64_t j = 0; j < kpl_tensor_numel(k[i]); j++)
                assert_close(tget(g[i], j), tget(k[i], j), 0, 0, "recorded vs kernel", j);
        }
        /* under no_grad the parameter takes the kernel */
        bool prev = kpl_set_grad_enabled(false);
        assert_false(kpl_requires_grad(NN(kpl_box_iou(pa, b))));
        kpl_set_grad_enabled(prev);
    }
    kpl_pool_pop(p);
}

/* ---- gradients ------------------------------------------------------------------------- */

static kpl_tensor *f_iou(kpl_tensor *const *in, void *u)
{
    (void)u;
    return kpl_box_iou(in[0], in[1]);
}
static kpl_tensor *f_giou(kpl_tensor *const *in, void *u)
{
    (void)u;
    return kpl_generalized_box_iou(in[0], in[1]);
}
static kpl_tensor *f_loss(kpl_tensor *const *in, void *u)
{
    return kpl_box_giou_loss(in[0], in[1], u ? KPL_REDUCE_NONE : KPL_REDUCE_MEAN);
}

static void test_gradcheck(void **state)
{
    (void)state;
    /* Boxes that overlap, nest and miss one another, with no two edges
     * within a finite-difference step of each other (the formula is smooth
     * there). */
    lcg_state = 11;
    double va[4 * 5], vb[4 * 5];
    random_boxes(va, 5, 8, 1, 6);
    random_boxes(vb, 5, 8, 1, 6);
    va[16] = 20, va[17] = 20, va[18] = 22.5, va[19] = 21.25; /* far from every b */
    vb[16] = 0.5, vb[17] = 0.75, vb[18] = 30, vb[19] = 29;   /* holds most a */
    kpl_tensor *a = param_boxes(5, va), *b = param_boxes(5, vb), *in[2] = {a, b};
    kpl_tensor *b4 = param_boxes(4, vb), *in4[2] = {a, b4};
    struct {
        const char *what;
        kpl_gradcheck_fn fn;
        void *user;
        kpl_tensor **in;
    } fs[] = {
        {"box_iou", f_iou, NULL, in4},
        {"generalized_box_iou", f_giou, NULL, in4},
        {"box_giou_loss mean", f_loss, NULL, in},
        {"box_giou_loss none", f_loss, (void *)1, in},
    };
    for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++)
        for (int order = 1; order <= 2; order++)
            if (kpl_gradcheck(fs[i].fn, fs[i].user, 2, fs[i].in, order, 1e-6, 1e-6, 1e-5) != KPL_OK)
                fail_msg("%s, order %d: %s", fs[i].what, order, kpl_last_error());
    /* One gradient by hand: IoU of a = (0, 0, 2, 2) with b = (1, 1, 3, 3)
     * is I / U with I = (2 - 1)(2 - 1) = 1, U = 7.  Moving a's x1 right
     * grows I by 1 per unit and U by 2 - 1 = 1 (a's height minus the
     * overlap's): d/dx1 = (U - I) / U^2 = 6 / 49; moving a's x0 right
     * shrinks a only: d/dx0 = I * 2 / U^2 = 2 / 49. */
    kpl_pool *p = NN(kpl_pool_push());
    kpl_tensor *ha = param_boxes(1, (double[]){0, 0, 2, 2});
    kpl_tensor *hb = boxes(KPL_F64, 1, (double[]){1, 1, 3, 3}), *g = NULL;
    OK(kpl_grad(NN(kpl_box_iou(ha, hb)), NULL, 1, &ha, false, &g));
    assert_close(tget(g, 0), 2.0 / 49, 0, 1e-15, "d iou / d x0", 0);
    assert_close(tget(g, 2), 6.0 / 49, 0, 1e-15, "d iou / d x1", 0);
    kpl_pool_pop(p);
    kpl_tensor_release(ha);
    kpl_tensor_release(a);
    kpl_tensor_release(b);
    kpl_tensor_release(b4);
}

/* ---- NMS -------------------------------------------------------------------------------- */

/* The reference: sort by score (descending, ties by index; no NaN here),
 * then the textbook greedy loop.  IoU rounds each step in the dtype T. */
#define DEF_REF(T, tn)                                                                      \
    static T iou_##tn(const T *a, const T *b)                                               \
    {                                                                                       \
        T iw = (a[2] < b[2] ? a[2] : b[2]) - (a[0] > b[0] ? a[0] : b[0]);                   \
        T ih = (a[3] < b[3] ? a[3] : b[3]) - (a[1] > b[1] ? a[1] : b[1]);                   \
        if (iw < 0) iw = 0;                                                                 \
        if (ih < 0) ih = 0;                                                                 \
        T inter = iw * ih;                                                                  \
        T uni = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter;      \
        return uni > 0 ? inter / uni : 0;                                                   \
    }                                                                                       \
    static int64_t ref_nms_##tn(const T *bx, const double *score, const int64_t *cls,       \
                                int64_t n, double thr, int64_t *keep)                       \
    {                                                                                       \
        int64_t *order = malloc((size_t)(n ? n : 1) * sizeof *order), nk = 0;               \
        char *sup = calloc((size_t)(n ? n : 1), 1);                                         \
        for (int64_t i = 0; i < n; i++) { /* insertion sort: stable */                      \
            int64_t j = i;                                                                  \
            while (j > 0 && score[order[j - 1]] < score[i]) {                               \
                order[j] = order[j - 1];                                                    \
                j--;                                                                        \
            }                                                                               \
            order[j] = i;                                                                   \
        }                                                                                   \
        for (int64_t p = 0; p < n; p++) {                                                   \
            int64_t i = order[p];                                                           \
            if (sup[i]) continue;                                                           \
            keep[nk++] = i;                                                                 \
            for (int64_t q = p + 1; q < n; q++) {                                           \
                int64_t j = order[q];                                                       \
                if ((!cls || cls[i] == cls[j]) && iou_##tn(bx + 4 * i, bx + 4 * j) > thr)   \
                    sup[j] = 1;                                                             \
            }                                                                               \
        }                                                                                   \
        free(order);                                                                        \
        free(sup);                                                                          \
        return nk;                                                                          \
    }
DEF_REF(float, f32)
DEF_REF(double, f64)

static int64_t ref_nms(kpl_dtype dt, const double *v, const double *score, const int64_t *cls,
                       int64_t n, double thr, int64_t *keep)
{
    if (dt == KPL_F64) return ref_nms_f64(v, score, cls, n, thr, keep);
    float *f = malloc((size_t)(4 * n + 1) * sizeof *f);
    for (int64_t i = 0; i < 4 * n; i++) f[i] = (float)v[i];
    int64_t k = ref_nms_f32(f, score, cls, n, thr, keep);
    free(f);
    return k;
}

static void expect_keep(kpl_tensor *keep, const int64_t *ref, int64_t nref, const char *what)
{
    assert_int_equal(kpl_tensor_dtype(keep), KPL_I64);
    assert_int_equal(kpl_tensor_ndim(keep), 1);
    if (kpl_tensor_numel(keep) != nref)
        fail_msg("%s: kept %lld boxes, the reference %lld", what,
                 (long long)kpl_tensor_numel(keep), (long long)nref);
    const int64_t *k = kpl_tensor_host_data(keep);
    for (int64_t i = 0; i < nref; i++)
        if (k[i] != ref[i])
            fail_msg("%s: keep[%lld] = %lld, the reference %lld", what, (long long)i,
                     (long long)k[i], (long long)ref[i]);
}

/* Random boxes of a crowded field with scores on a few levels (many
 * ties), some boxes repeated, some scores too. */
static void nms_case(int64_t n, double *v, double *s, int64_t *cls, int ncls)
{
    random_boxes(v, n, 100, 4, 40);
    for (int64_t i = 0; i < n; i++) {
        s[i] = (double)(int)(uniform() * 8) / 8;
        cls[i] = (int64_t)(uniform() * ncls) * 1000003 - 2; /* negative and large ids too */
        if (i > 3 && uniform() < 0.1) { /* a duplicate box, sometimes with its score */
            int64_t j = (int64_t)(uniform() * (double)i);
            for (int k = 0; k < 4; k++) v[4 * i + k] = v[4 * j + k];
            if (uniform() < 0.5) s[i] = s[j];
        }
    }
}

static void test_nms_reference(void **state)
{
    (void)state;
    static const int64_t sizes[] = {1, 2, 17, 300, 701};
    static const double thrs[] = {0, 0.3, 0.5, 0.7, 1};
    lcg_state = 3;
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        int64_t n = sizes[si];
        double *v = malloc((size_t)n * 4 * sizeof *v), *s = malloc((size_t)n * sizeof *s);
        int64_t *cls = malloc((size_t)n * sizeof *cls), *ref = malloc((size_t)n * sizeof *ref);
        nms_case(n, v, s, cls, 4);
        for (int f = 0; f < 2; f++) {
            kpl_dtype dt = f ? KPL_F64 : KPL_F32;
            kpl_pool *p = NN(kpl_pool_push());
            kpl_tensor *b = boxes(dt, n, v), *sc = vec(dt, n, s), *keep = NULL;
            kpl_tensor *sc64 = vec(KPL_F64, n, s); /* scores of the other dtype */
            for (size_t ti = 0; ti < sizeof thrs / sizeof thrs[0]; ti++) {
                char what[96];
                snprintf(what, sizeof what, "nms %s n %lld thr %g", kpl_dtype_name(dt),
                         (long long)n, thrs[ti]);
                int64_t nref = ref_nms(dt, v, s, NULL, n, thrs[ti], ref);
                OK(kpl_nms(b, sc, thrs[ti], &keep));
                expect_keep(keep, ref, nref, what);
                OK(kpl_nms(b, sc64, thrs[ti], &keep));
                expect_keep(keep, ref, nref, what);
                if (thrs[ti] >= 1) assert_int_equal(nref, n); /* nothing has IoU > 1 */
            }
            kpl_pool_pop(p);
        }
        free(v);
        free(s);
        free(cls);
        free(ref);
    }
}

/* batched_nms: the reference with classes, and kpl_nms run on each class
 * alone and merged by score. */
static void test_batched_nms(void **state)
{
    (void)state;
    lcg_state = 5;
    enum { N = 500 };
    double v[4 * N], s[N], sub_v[4 * N], sub_s[N];
    int64_t cls[N], ref[N], merged[N], sub_i[N];
    nms_case(N, v, s, cls, 5);
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = f ? KPL_F64 : KPL_F32;
        for (int t = 0; t < 3; t++) {
            double thr = 0.25 * (t + 1);
            kpl_pool *p = NN(kpl_pool_push());
            kpl_tensor *keep = NULL;
            double cv[N];
            for (int64_t i = 0; i < N; i++) cv[i] = (double)cls[i];
            OK(kpl_batched_nms(boxes(dt, N, v), vec(dt, N, s),
                               tensor(KPL_I64, 1, (int64_t[]){N}, cv), thr, &keep));
            int64_t nref = ref_nms(dt, v, s, cls, N, thr, ref);
            expect_keep(keep, ref, nref, "batched_nms vs reference");
            /* per class: each class's boxes alone through kpl_nms */
            int64_t nm = 0;
            for (int c = 0; c < 5; c++) {
                int64_t id = (int64_t)c * 1000003 - 2, k = 0;
                for (int64_t i = 0; i < N; i++)
                    if (cls[i] == id) {
                        for (int q = 0; q < 4; q++) sub_v[4 * k + q] = v[4 * i + q];
                        sub_s[k] = s[i];
                        sub_i[k++] = i;
                    }
                kpl_tensor *ck = NULL;
                OK(kpl_nms(boxes(dt, k, sub_v), vec(dt, k, sub_s), thr, &ck));
                for (int64_t j = 0; j < kpl_tensor_numel(ck); j++)
                    merged[nm++] = sub_i[(int64_t)tget(ck, j)];
            }
            /* merged by decreasing score, ties by index (insertion sort) */
            for (int64_t i = 1; i < nm; i++)
                for (int64_t j = i; j > 0; j--) {
                    int64_t x = merged[j - 1], y = merged[j];
                    if (s[x] > s[y] || (s[x] == s[y] && x < y)) break;
                    merged[j - 1] = y, merged[j] = x;
                }
            expect_keep(keep, merged, nm, "batched_nms vs nms per class");
            kpl_pool_pop(p);
        }
    }
    /* Two classes of ~4000 boxes: enough pairs for the CPU kernel to run
     * the classes on two threads. */
    enum { L = 8000 };
    double *lv = malloc(4 * L * sizeof *lv), *ls = malloc(L * sizeof *ls);
    double *lc = malloc(L * sizeof *lc);
    int64_t *lcls = malloc(L * sizeof *lcls), *lref = malloc(L * sizeof *lref);
    nms_case(L, lv, ls, lcls, 2);
    for (int64_t i = 0; i < L; i++) lc[i] = (double)lcls[i];
    kpl_pool *p = NN(kpl_pool_push());
    kpl_tensor *keep = NULL;
    OK(kpl_batched_nms(boxes(KPL_F32, L, lv), vec(KPL_F32, L, ls),
                       tensor(KPL_I64, 1, (int64_t[]){L}, lc), 0.6, &keep));
    int64_t nref = ref_nms(KPL_F32, lv, ls, lcls, L, 0.6, lref);
    expect_keep(keep, lref, nref, "batched_nms, 8000 boxes");
    kpl_pool_pop(p);
    free(lv);
    free(ls);
    free(lc);
    free(lcls);
    free(lref);
}

static void test_nms_rules(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    kpl_tensor *keep = NULL;
    /* IoU of (0, 0, 2, 1) with (0, 0, 1, 1) is 1 / 2 exactly: suppressed
     * above a threshold below it, kept at a threshold equal to it */
    double v2[8] = {0, 0, 2, 1, 0, 0, 1, 1};
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = f ? KPL_F64 : KPL_F32;
        kpl_tensor *b = boxes(dt, 2, v2), *s = vec(dt, 2, (double[]){0.9, 0.8});
        OK(kpl_nms(b, s, 0.5, &keep));
        expect_keep(keep, (int64_t[]){0, 1}, 2, "IoU equal to the threshold");
        OK(kpl_nms(b, s, 0.4999999, &keep));
        expect_keep(keep, (int64_t[]){0}, 1, "IoU above the threshold");
        /* the later box first when it scores higher */
        OK(kpl_nms(b, vec(dt, 2, (double[]){0.1, 0.8}), 0.3, &keep));
        expect_keep(keep, (int64_t[]){1}, 1, "by score");
    }
    /* equal scores: lower index first, so box 0 suppresses box 1 and box 2
     * (its duplicate) and box 3 survives; touching boxes (IoU 0) survive
     * even at threshold 0 */
    double v4[16] = {0, 0, 4, 4, 1, 1, 4, 4, 0, 0, 4, 4, 4, 0, 6, 4};
    kpl_tensor *b4 = boxes(KPL_F32, 4, v4);
    OK(kpl_nms(b4, vec(KPL_F32, 4, (double[]){0.5, 0.5, 0.5, 0.5}), 0, &keep));
    expect_keep(keep, (int64_t[]){0, 3}, 2, "ties by index");
    OK(kpl_nms(b4, vec(KPL_F32, 4, (double[]){0.5, 0.7, 0.5, 0.5}), 0, &keep));
    expect_keep(keep, (int64_t[]){1, 3}, 2, "a higher score first");
    /* -0 and +0 tie: index order */
    OK(kpl_nms(b4, vec(KPL_F32, 4, (double[]){0.0, -0.0, 0.0, -1}), 2, &keep));
    expect_keep(keep, (int64_t[]){0, 1, 2, 3}, 4, "-0 ties +0");
    /* NaN scores rank above every number (torch.sort's order), by index
     * among themselves: box 2 is visited first and suppresses 0 and 1 */
    OK(kpl_nms(b4, vec(KPL_F32, 4, (double[]){INFINITY, 0.9, NAN, 0.1}), 0.5, &keep));
    expect_keep(keep, (int64_t[]){2, 3}, 2, "NaN first");
    OK(kpl_nms(b4, vec(KPL_F64, 4, (double[]){NAN, 0.9, NAN, -INFINITY}), 2, &keep));
    expect_keep(keep, (int64_t[]){0, 2, 1, 3}, 4, "NaNs by index, then numbers");
    /* batched: box 2 duplicates box 0 but is of another class */
    kpl_tensor *c4 = tensor(KPL_I64, 1, (int64_t[]){4}, (double[]){7, 7, 8, 7});
    OK(kpl_batched_nms(b4, vec(KPL_F32, 4, (double[]){0.5, 0.5, 0.5, 0.5}), c4, 0, &keep));
    expect_keep(keep, (int64_t[]){0, 2, 3}, 3, "classes apart");
    /* no boxes */
    OK(kpl_nms(boxes(KPL_F32, 0, v4), vec(KPL_F32, 0, v4), 0.5, &keep));
    assert_int_equal(kpl_tensor_numel(keep), 0);
    kpl_pool_pop(p);
}

/* ---- errors -------------------------------------------------------------------------------- */

static void test_errors(void **state)
{
    (void)state;
    kpl_pool *p = NN(kpl_pool_push());
    double v[12] = {0, 0, 1, 1, 0, 0, 2, 2, 1, 1, 3, 3};
    kpl_tensor *a = boxes(KPL_F32, 3, v), *b64 = boxes(KPL_F64, 3, v);
    kpl_tensor *s = vec(KPL_F32, 3, (double[]){1, 2, 3}), *keep = NULL;
    kpl_tensor *n3 = tensor(KPL_F32, 2, (int64_t[]){4, 3}, v);
    /* shapes */
    FAILS(kpl_box_iou(a, n3) ? KPL_OK : kpl_last_status(), KPL_ESHAPE,
          "box_iou: 'b' has shape (4,3); boxes are (N, 4) rows (x0, y0, x1, y1)");
    FAILS(kpl_nms(n3, s, 0.5, &keep), KPL_ESHAPE, "nms: 'boxes' has shape (4,3)");
    assert_null(keep);
    FAILS(kpl_nms(a, vec(KPL_F32, 2, v), 0.5, &keep), KPL_ESHAPE,
          "nms: 'scores' has shape (2); expected (3), one per row of 'boxes' (3,4)");
    FAILS(kpl_box_giou_loss(a, boxes(KPL_F32, 2, v), KPL_REDUCE_MEAN) ? KPL_OK
                                                                       : kpl_last_status(),
          KPL_ESHAPE, "box_giou_loss: 'pred' has 3 boxes and 'target' 2");
    FAILS(kpl_batched_nms(a, s, tensor(KPL_I64, 1, (int64_t[]){2}, v), 0.5, &keep), KPL_ESHAPE,
          "batched_nms: 'idxs' has shape (2)");
    /* dtypes */
    FAILS(kpl_generalized_box_iou(a, b64) ? KPL_OK : kpl_last_status(), KPL_EDTYPE,
          "generalized_box_iou: 'a' has dtype f32 and 'b' f64; they must match");
    FAILS(kpl_box_iou(tensor(KPL_I64, 2, (int64_t[]){3, 4}, v), a) ? KPL_OK : kpl_last_status(),
          KPL_EDTYPE, "box_iou: 'a' has dtype i64; boxes are f32 or f64");
    FAILS(kpl_nms(a, tensor(KPL_I64, 1, (int64_t[]){3}, v), 0.5, &keep), KPL_EDTYPE,
          "nms: 'scores' has dtype i64");
    FAILS(kpl_batched_nms(a, s, vec(KPL_F32, 3, v), 0.5, &keep), KPL_EDTYPE,
          "batched_nms: 'idxs' has dtype f32, expected i64");
    /* values: NaN, infinite, inverted */
    double bad[12];
    memcpy(bad, v, sizeof bad);
    bad[5] = NAN;
    FAILS(kpl_nms(boxes(KPL_F32, 3, bad), s, 0.5, &keep), KPL_EINVAL,
          "nms: 'boxes' row 1 (0, nan, 2, 2) is not a box (x0, y0, x1, y1): a coordinate is "
          "NaN or infinite");
    FAILS(kpl_box_iou(a, boxes(KPL_F64, 3, bad)) ? KPL_OK : kpl_last_status(), KPL_EINVAL,
          "box_iou: 'b' row 1 (0, nan, 2, 2) is not a box");
    bad[5] = INFINITY;
    FAILS(kpl_box_giou_loss(boxes(KPL_F64, 3, bad), b64, KPL_REDUCE_SUM) ? KPL_OK
                                                                         : kpl_last_status(),
          KPL_EINVAL, "box_giou_loss: 'pred' row 1 (0, inf, 2, 2) is not a box");
    bad[5] = 0;
    bad[8] = 4; /* row 2: x0 = 4 > x1 = 3 */
    FAILS(kpl_generalized_box_iou(boxes(KPL_F32, 3, bad), a) ? KPL_OK : kpl_last_status(),
          KPL_EINVAL, "'a' row 2 (4, 1, 3, 3) is not a box (x0, y0, x1, y1): x1 < x0");
    bad[8] = 1, bad[11] = 0.5;
    FAILS(kpl_batched_nms(boxes(KPL_F32, 3, bad), s, tensor(KPL_I64, 1, (int64_t[]){3}, v), 0.5,
                          &keep),
          KPL_EINVAL, "batched_nms: 'boxes' row 2 (1, 1, 3, 0.5) is not a box (x0, y0, x1, y1): "
          "y1 < y0");
    /* the threshold */
    FAILS(kpl_nms(a, s, -0.1, &keep), KPL_EINVAL, "nms: iou_threshold -0.1 must be >= 0");
    FAILS(kpl_nms(a, s, NAN, &keep), KPL_EINVAL, "nms: iou_threshold nan must be >= 0");
    /* the reduction */
    FAILS(kpl_box_giou_loss(a, a, (kpl_reduction)7) ? KPL_OK : kpl_last_status(), KPL_EINVAL,
          "box_giou_loss: unknown reduction 7");
    /* NULL: a failed op's NULL keeps its message; the caller's own NULL is named */
    kpl_clear_error();
    kpl_tensor *failed = kpl_box_iou(a, n3);
    assert_null(failed);
    assert_null(kpl_box_iou(failed, a));
    assert_null(kpl_generalized_box_iou(a, failed));
    assert_null(kpl_box_giou_loss(failed, a, KPL_REDUCE_MEAN));
    assert_int_equal(kpl_nms(failed, s, 0.5, &keep), KPL_ESHAPE);
    assert_null(keep);
    assert_non_null(strstr(kpl_last_error(), "'b' has shape (4,3)"));
    kpl_clear_error();
    FAILS(kpl_nms(a, NULL, 0.5, &keep), KPL_EINVAL, "nms: argument 'scores' is NULL");
    FAILS(kpl_batched_nms(a, s, NULL, 0.5, &keep), KPL_EINVAL,
          "batched_nms: argument 'idxs' is NULL");
    FAILS(kpl_nms(a, s, 0.5, NULL), KPL_EINVAL, "nms: argument 'keep' is NULL");
    /* the kernel front end itself */
    kpl_tensor *out = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 2, (int64_t[]){3, 2}, &out));
    FAILS(kpl_k_box_iou(out, a, a, KPL_BOX_IOU, true), KPL_ESHAPE,
          "box_iou: 'out' has shape (3,2), the result has shape (3,3)");
    FAILS(kpl_k_box_iou(out, a, boxes(KPL_F32, 2, v), KPL_BOX_GIOU, false), KPL_ESHAPE,
          "generalized_box_iou: matched pairs need as many boxes in 'b' (2,4) as in 'a' (3,4)");
    kpl_tensor_release(out);
    kpl_pool_pop(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_values),      cmocka_unit_test(test_paths_agree),
        cmocka_unit_test(test_gradcheck),   cmocka_unit_test(test_nms_reference),
        cmocka_unit_test(test_batched_nms), cmocka_unit_test(test_nms_rules),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests_name("vision", tests, NULL, NULL);
}
