/* test_segops.c — the ops semantic segmentation needs (graph/nn.c):
 * per-pixel cross entropy with class weights, the soft Dice loss and
 * bilinear resizing, against PyTorch's numbers (segops_ref.h, made by
 * segops_ref.py), against finite differences (kpl_gradcheck, to the
 * second order), in corner cases and through their error messages.
 *
 * Tolerances against the references (computed in f64 from the same
 * f32-representable inputs): f64 1e-10 relative, f32 1e-5 relative, both
 * with an absolute floor of 1e-12 (f64) or 1e-6 (f32) times the largest
 * reference value, for elements that are sums cancelling to near 0. */
#include "kpl_test.h"
#include "autograd.h"
#include "segops_ref.h"

#include <stdlib.h>

#define RTOL(dt) ((dt) == KPL_F64 ? 1e-10 : 1e-5)
#define ATOL(dt) ((dt) == KPL_F64 ? 1e-12 : 1e-6)
#define LEN(a) ((int64_t)(sizeof(a) / sizeof((a)[0])))

static const kpl_dtype dtypes[2] = {KPL_F64, KPL_F32};

/* A tensor of dtype dt from doubles (pool-owned). */
static kpl_tensor *tensor(kpl_dtype dt, int ndim, const int64_t *shape, const double *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, ndim, shape, v, &t));
    kpl_autorelease(t);
    return dt == KPL_F64 ? t : NN(kpl_cast(t, dt));
}

static kpl_tensor *labels_of(int ndim, const int64_t *shape, const int64_t *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, ndim, shape, v, &t));
    return kpl_autorelease(t);
}

/* A leaf that requires grad (caller-owned). */
static kpl_tensor *leaf(kpl_dtype dt, int ndim, const int64_t *shape, const double *v)
{
    kpl_tensor *p = NULL;
    OK(kpl_tensor_to_device(tensor(dt, ndim, shape, v), kpl_device_cpu(), &p));
    OK(kpl_set_requires_grad(p, true));
    return p;
}

/* Every element within rtol |ref| + atol max|ref|. */
static void expect(kpl_tensor *t, const double *ref, int64_t n, kpl_dtype dt, const char *what)
{
    if (!t) fail_msg("%s: %s", what, kpl_last_error());
    assert_int_equal(kpl_tensor_numel(t), n);
    double scale = 0;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(ref[i]));
    for (int64_t i = 0; i < n; i++) assert_close(tget(t, i), ref[i], RTOL(dt), ATOL(dt) * scale, what, i);
}

/* d(sum(y * seed))/dx, seed NULL for ones. */
static kpl_tensor *grad_of(kpl_tensor *y, const double *seed, kpl_tensor *x)
{
    kpl_tensor *gy = seed ? tensor(kpl_tensor_dtype(y), kpl_tensor_ndim(y), kpl_tensor_shape(y), seed)
                          : NULL;
    kpl_tensor *g = NULL;
    if (kpl_grad(y, gy, 1, &x, false, &g) < 0) fail_msg("grad: %s", kpl_last_error());
    return g;
}

static const int64_t CE_XS[4] = {CE_N, CE_C, CE_H, CE_W}, CE_LS[3] = {CE_N, CE_H, CE_W};

/* kpl_gradcheck of fn over the CE logits in f64, first and second order,
 * for each of n argument structs of `size` bytes. */
static void gradcheck_cases(kpl_gradcheck_fn fn, const void *cases, size_t size, size_t n)
{
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = leaf(KPL_F64, 4, CE_XS, CE_LOGITS);
    for (size_t i = 0; i < n; i++)
        for (int order = 1; order <= 2; order++)
            if (kpl_gradcheck(fn, (void *)((const char *)cases + i * size), 1, &x, order, 1e-6,
                              1e-7, 1e-5) < 0)
                fail_msg("case %zu order %d: %s", i, order, kpl_last_error());
    kpl_tensor_release(x);
    kpl_pool_pop(pool);
}

/* ---- cross entropy ---------------------------------------------------------------------- */

static void test_ce_reference(void **state)
{
    (void)state;
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = dtypes[f];
#define X(name, weighted, eps, red)                                                               \
    do {                                                                                          \
        kpl_pool *pool = NN(kpl_pool_push());                                                     \
        kpl_tensor *x = leaf(dt, 4, CE_XS, CE_LOGITS);                                            \
        int64_t c = CE_C;                                                                         \
        kpl_tensor *w = (weighted) ? tensor(dt, 1, &c, CE_WEIGHT) : NULL;                         \
        kpl_tensor *loss = kpl_cross_entropy_weighted(x, labels_of(3, CE_LS, CE_LABELS), w, red,  \
                                                      eps, 255);                                  \
        expect(loss, name##_LOSS, LEN(name##_LOSS), dt, #name " loss");                           \
        if ((red) == KPL_REDUCE_NONE) assert_int_equal(kpl_tensor_ndim(loss), 3);                 \
        expect(grad_of(loss, (red) == KPL_REDUCE_NONE ? CE_SEED_NONE : NULL, x), name##_GRAD,     \
               LEN(name##_GRAD), dt, #name " grad");                                              \
        kpl_tensor_release(x);                                                                    \
        kpl_pool_pop(pool);                                                                       \
    } while (0);
        CE_CASES(X)
#undef X
        /* (N, C) rows: weights, smoothing, an ignored row */
        kpl_pool *pool = NN(kpl_pool_push());
        int64_t xs[2] = {5, 3}, n = 5, c = 3;
        kpl_tensor *x = leaf(dt, 2, xs, CE2_LOGITS);
        kpl_tensor *loss = kpl_cross_entropy_weighted(x, labels_of(1, &n, CE2_LABELS),
                                                      tensor(dt, 1, &c, CE2_WEIGHT),
                                                      KPL_REDUCE_MEAN, 0.2, 255);
        expect(loss, CE2_LOSS, 1, dt, "CE2 loss");
        expect(grad_of(loss, NULL, x), CE2_GRAD, LEN(CE2_GRAD), dt, "CE2 grad");
        kpl_tensor_release(x);
        kpl_pool_pop(pool);
    }
}

typedef struct {
    bool weighted;
    kpl_reduction red;
    double eps;
} ce_args;

static kpl_tensor *g_ce(kpl_tensor *const *x, void *u)
{
    const ce_args *a = u;
    int64_t c = CE_C;
    return kpl_cross_entropy_weighted(x[0], labels_of(3, CE_LS, CE_LABELS),
                                      a->weighted ? tensor(KPL_F64, 1, &c, CE_WEIGHT) : NULL,
                                      a->red, a->eps, 255);
}

static void test_ce_gradcheck(void **state)
{
    (void)state;
    const ce_args cases[] = {{true, KPL_REDUCE_MEAN, 0.1}, {true, KPL_REDUCE_NONE, 0.1},
                             {false, KPL_REDUCE_SUM, 0}, {true, KPL_REDUCE_MEAN, 0}};
    gradcheck_cases(g_ce, cases, sizeof cases[0], sizeof cases / sizeof cases[0]);
}

/* A batch whose every pixel is ignored: 0 with gradient 0 (PyTorch: NaN). */
static void test_ce_all_ignored(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    int64_t v[CE_N * CE_H * CE_W], c = CE_C;
    for (int64_t i = 0; i < LEN(v); i++) v[i] = 255;
    kpl_tensor *x = leaf(KPL_F64, 4, CE_XS, CE_LOGITS), *lab = labels_of(3, CE_LS, v);
    kpl_tensor *w = tensor(KPL_F64, 1, &c, CE_WEIGHT);
    for (int r = 0; r < 3; r++) {
        kpl_reduction red = (kpl_reduction)r;
        kpl_tensor *loss = NN(kpl_cross_entropy_weighted(x, lab, r == 1 ? NULL : w, red, 0.1, 255));
        for (int64_t i = 0; i < kpl_tensor_numel(loss); i++) assert_true(tget(loss, i) == 0);
        kpl_tensor *g = grad_of(loss, red == KPL_REDUCE_NONE ? CE_SEED_NONE : NULL, x);
        for (int64_t i = 0; i < kpl_tensor_numel(g); i++) assert_true(tget(g, i) == 0);
    }
    kpl_tensor_release(x);
    kpl_pool_pop(pool);
}

static void test_ce_errors(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    int64_t v[CE_N * CE_H * CE_W], c3 = 3;
    memcpy(v, CE_LABELS, sizeof v);
    v[1 * CE_H * CE_W + 2 * CE_W + 3] = 7; /* (1, 2, 3) */
    kpl_tensor *x = tensor(KPL_F32, 4, CE_XS, CE_LOGITS);
    assert_null(kpl_cross_entropy(x, labels_of(3, CE_LS, v), KPL_REDUCE_MEAN, 0, 255));
    assert_int_equal(kpl_last_status(), KPL_ERANGE);
    assert_non_null(strstr(kpl_last_error(), "cross_entropy: label 7 in position (1, 2, 3) is "
                                             "outside [0, 4) (input (2,4,3,5))"));
    v[1 * CE_H * CE_W + 2 * CE_W + 3] = -1;
    assert_null(kpl_cross_entropy(x, labels_of(3, CE_LS, v), KPL_REDUCE_MEAN, 0, 255));
    assert_non_null(strstr(kpl_last_error(), "label -1 in position (1, 2, 3)"));
    /* ignore_index may lie outside [0, C); labels equal to it are fine */
    memcpy(v, DICE_LABELS0, sizeof v);
    v[4] = -1;
    assert_non_null(kpl_cross_entropy(x, labels_of(3, CE_LS, v), KPL_REDUCE_MEAN, 0, -1));
    int64_t ls[3] = {CE_N, CE_H, CE_W - 1};
    assert_null(kpl_cross_entropy(x, labels_of(3, ls, CE_LABELS), KPL_REDUCE_MEAN, 0, 255));
    assert_int_equal(kpl_last_status(), KPL_ESHAPE);
    assert_non_null(strstr(kpl_last_error(), "input (2,4,3,5) and labels (2,3,4) must be"));
    kpl_tensor *w3 = tensor(KPL_F32, 1, &c3, CE_WEIGHT);
    assert_null(kpl_cross_entropy_weighted(x, labels_of(3, CE_LS, CE_LABELS), w3,
                                           KPL_REDUCE_MEAN, 0, 255));
    assert_non_null(strstr(kpl_last_error(), "cross_entropy: weight (3) f32 must be (4) f32"));
    kpl_pool_pop(pool);
}

/* ---- Dice ----------------------------------------------------------------------------- */

static void test_dice_reference(void **state)
{
    (void)state;
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = dtypes[f];
#define X(name, labels, ignore, smooth, exponent, red)                                            \
    do {                                                                                          \
        kpl_pool *pool = NN(kpl_pool_push());                                                     \
        kpl_tensor *x = leaf(dt, 4, CE_XS, CE_LOGITS);                                            \
        kpl_tensor *loss = kpl_dice_loss(x, labels_of(3, CE_LS, labels), ignore, smooth,          \
                                         exponent, red);                                          \
        expect(loss, name##_LOSS, LEN(name##_LOSS), dt, #name " loss");                           \
        expect(grad_of(loss, (red) == KPL_REDUCE_NONE ? DICE_SEED_NONE : NULL, x), name##_GRAD,   \
               LEN(name##_GRAD), dt, #name " grad");                                              \
        kpl_tensor_release(x);                                                                    \
        kpl_pool_pop(pool);                                                                       \
    } while (0);
        DICE_CASES(X)
#undef X
    }
}

typedef struct {
    const int64_t *labels;
    int64_t ignore;
    double smooth, exponent;
    kpl_reduction red;
} dice_args;

static kpl_tensor *g_dice(kpl_tensor *const *x, void *u)
{
    const dice_args *a = u;
    return kpl_dice_loss(x[0], labels_of(3, CE_LS, a->labels), a->ignore, a->smooth,
                         a->exponent, a->red);
}

static void test_dice_gradcheck(void **state)
{
    (void)state;
    const dice_args cases[] = {{CE_LABELS, 255, 1, 2, KPL_REDUCE_MEAN},
                               {CE_LABELS, 255, 0.5, 1.5, KPL_REDUCE_NONE},
                               {DICE_LABELS0, 0, 1, 1, KPL_REDUCE_SUM}};
    gradcheck_cases(g_dice, cases, sizeof cases[0], sizeof cases / sizeof cases[0]);
}

static void test_dice_errors(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = tensor(KPL_F32, 4, CE_XS, CE_LOGITS), *lab = labels_of(3, CE_LS, CE_LABELS);
    assert_null(kpl_dice_loss(x, lab, 3, 1, 2, KPL_REDUCE_MEAN)); /* 255 is a label now */
    assert_int_equal(kpl_last_status(), KPL_ERANGE);
    assert_non_null(strstr(kpl_last_error(), "dice_loss: label 255 in position (0, 0, 1)"));
    assert_null(kpl_dice_loss(x, lab, 255, -1, 2, KPL_REDUCE_MEAN));
    assert_non_null(strstr(kpl_last_error(), "dice_loss: smooth -1 must be >= 0 and exponent 2"));
    assert_null(kpl_dice_loss(x, lab, 255, 1, 0, KPL_REDUCE_MEAN));
    assert_int_equal(kpl_last_status(), KPL_EINVAL);
    /* every pixel ignored: each dice is smooth / smooth, the loss 0 */
    int64_t v[CE_N * CE_H * CE_W];
    for (int64_t i = 0; i < LEN(v); i++) v[i] = 255;
    kpl_tensor *loss = NN(kpl_dice_loss(x, labels_of(3, CE_LS, v), 255, 1, 2, KPL_REDUCE_MEAN));
    assert_float_equal(tget(loss, 0), 0, 0);
    kpl_pool_pop(pool);
}

/* ---- bilinear resizing ------------------------------------------------------------------- */

/* The formulas of segops_ref.py's resize_input / resize_seed. */
static kpl_tensor *resize_values(kpl_dtype dt, int64_t h, int64_t w, bool seed)
{
    double *v = malloc((size_t)(h * w) * sizeof *v);
    assert_non_null(v);
    for (int64_t i = 0; i < h * w; i++)
        v[i] = (double)(float)(seed ? cos(0.23 * (double)i) : sin(0.37 * (double)i) + 0.01 * (double)i);
    int64_t shape[4] = {1, 1, h, w};
    kpl_tensor *t = tensor(dt, 4, shape, v);
    free(v);
    return t;
}

static void resize_case(kpl_dtype dt, int64_t h, int64_t w, int64_t oh, int64_t ow,
                        const double *want_y, const double *want_gx, const char *what)
{
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = NULL;
    OK(kpl_tensor_to_device(resize_values(dt, h, w, false), kpl_device_cpu(), &x));
    OK(kpl_set_requires_grad(x, true));
    kpl_tensor *y = kpl_upsample_bilinear(x, oh, ow, false);
    char b[64];
    snprintf(b, sizeof b, "%s y %s", what, kpl_dtype_name(dt));
    expect(y, want_y, oh * ow, dt, b);
    kpl_tensor *gy = resize_values(dt, oh, ow, true), *gx = NULL;
    OK(kpl_grad(y, gy, 1, &x, false, &gx));
    snprintf(b, sizeof b, "%s gx %s", what, kpl_dtype_name(dt));
    expect(gx, want_gx, h * w, dt, b);
    kpl_tensor_release(x);
    kpl_pool_pop(pool);
}

static void test_resize_reference(void **state)
{
    (void)state;
    for (int f = 0; f < 2; f++) {
        resize_case(dtypes[f], 7, 5, 29, 13, RESIZE_UP_Y, RESIZE_UP_GX, "up");
        resize_case(dtypes[f], 29, 13, 7, 5, RESIZE_DOWN_Y, RESIZE_DOWN_GX, "down");
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ce_reference),   cmocka_unit_test(test_ce_gradcheck),
        cmocka_unit_test(test_ce_all_ignored), cmocka_unit_test(test_ce_errors),
        cmocka_unit_test(test_dice_reference), cmocka_unit_test(test_dice_gradcheck),
        cmocka_unit_test(test_dice_errors),    cmocka_unit_test(test_resize_reference),
    };
    return cmocka_run_group_tests_name("segops", tests, NULL, NULL);
}
