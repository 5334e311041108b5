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
#include "ir_text.h"
#include "kernels.h"

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

/* ---- the fused softmax cross entropy ------------------------------------------------- */

/* Deterministic values: logits spread over +-6, labels in [0, C) with
 * every fifth position 255 (ignored), gy in [-1, 1]. */
static double *xent_values(int64_t n, double scale, double phase)
{
    double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    assert_non_null(v);
    for (int64_t i = 0; i < n; i++) v[i] = scale * sin(0.37 * (double)i + phase);
    return v;
}

static int64_t *xent_labels(int64_t m, int64_t c)
{
    int64_t *v = malloc((size_t)(m ? m : 1) * sizeof *v);
    assert_non_null(v);
    for (int64_t i = 0; i < m; i++) v[i] = i % 5 == 3 ? 255 : (i * 7 + i / 3) % c;
    return v;
}

/* The loss and its gradient at every position, in f64 from the values
 * the tensors hold (x and gy as rounded to dt). */
static void xent_reference(kpl_tensor *x, const int64_t *y, kpl_tensor *gy, double eps,
                           double *loss, double *gx)
{
    const int64_t *xs = kpl_tensor_shape(x);
    int64_t n = xs[0], c = xs[1], in = kpl_tensor_numel(x) / (n * c);
    for (int64_t s = 0; s < n; s++)
        for (int64_t j = 0; j < in; j++) {
            int64_t p = s * in + j, v = y[p];
            double m = -INFINITY, sum = 0, sx = 0;
            for (int64_t k = 0; k < c; k++) m = fmax(m, tget(x, (s * c + k) * in + j));
            for (int64_t k = 0; k < c; k++) {
                double z = tget(x, (s * c + k) * in + j);
                sum += exp(z - m);
                sx += z;
            }
            double lse = m + log(sum), g = v == 255 ? 0 : tget(gy, p);
            loss[p] = v == 255 ? 0
                               : (1 - eps) * (lse - tget(x, (s * c + v) * in + j)) +
                                     eps * (lse - sx / (double)c);
            for (int64_t k = 0; k < c; k++)
                gx[(s * c + k) * in + j] = g * (exp(tget(x, (s * c + k) * in + j) - lse) -
                                                eps / (double)c - (k == v ? 1 - eps : 0));
        }
}

/* Against the definition in f64, both directions, both loop shapes (rows
 * when there is one position per sample; column blocks of 64 with a tail
 * otherwise), with and without smoothing. */
static void test_xent_reference(void **state)
{
    (void)state;
    static const int64_t shapes[][4] = {{3, 7, 1, 1}, {2, 5, 9, 17}, {1, 1, 4, 1}, {4, 1000, 1, 1},
                                        {2, 21, 3, 1}};
    static const int nds[] = {2, 4, 3, 2, 3};
    for (size_t k = 0; k < sizeof nds / sizeof nds[0]; k++)
        for (int f = 0; f < 2; f++)
            for (int e = 0; e < 2; e++) {
                kpl_pool *pool = NN(kpl_pool_push());
                int nd = nds[k];
                const int64_t *xs = shapes[k];
                int64_t ls[3] = {xs[0], xs[2], xs[3]}, n = 1, m = xs[0];
                for (int d = 0; d < nd; d++) n *= xs[d];
                for (int d = 2; d < nd; d++) m *= xs[d];
                double eps = e ? 0.3 : 0, *xv = xent_values(n, 6, 0.1), *gv = xent_values(m, 1, 2);
                int64_t *yv = xent_labels(m, xs[1]);
                kpl_tensor *x = tensor(dtypes[f], nd, xs, xv), *y = labels_of(nd - 1, ls, yv);
                kpl_tensor *gy = tensor(dtypes[f], nd - 1, ls, gv);
                double *rl = malloc((size_t)m * sizeof *rl), *rg = malloc((size_t)n * sizeof *rg);
                assert_true(rl && rg);
                xent_reference(x, yv, gy, eps, rl, rg);
                kpl_tensor *l = kpl_softmax_xent(x, y, 255, eps);
                kpl_tensor *g = kpl_softmax_xent_bwd(x, y, gy, 255, eps);
                char what[64];
                snprintf(what, sizeof what, "shape %zu %s eps %g loss", k,
                         kpl_dtype_name(dtypes[f]), eps);
                expect(l, rl, m, dtypes[f], what);
                snprintf(what, sizeof what, "shape %zu %s eps %g gx", k,
                         kpl_dtype_name(dtypes[f]), eps);
                expect(g, rg, n, dtypes[f], what);
                assert_int_equal(kpl_tensor_ndim(l), nd - 1);
                free(xv), free(gv), free(yv), free(rl), free(rg);
                kpl_pool_pop(pool);
            }
}

/* f16/bf16 are the f32 kernel's results rounded once; the mean through
 * kpl_cross_entropy equals the sum of the fused losses over the count. */
static void test_xent_halves(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    int64_t xs[4] = {2, 6, 5, 13}, ls[3] = {2, 5, 13}, n = 2 * 6 * 65, m = 2 * 65;
    double *xv = xent_values(n, 4, 0.5), *gv = xent_values(m, 1, 1);
    int64_t *yv = xent_labels(m, 6);
    kpl_tensor *y = labels_of(3, ls, yv);
    for (int h = 0; h < 2; h++) {
        kpl_dtype hd = h ? KPL_BF16 : KPL_F16;
        kpl_tensor *xh = tensor(hd, 4, xs, xv), *gh = tensor(hd, 3, ls, gv);
        kpl_tensor *l = NN(kpl_softmax_xent(xh, y, 255, 0.1));
        kpl_tensor *lw = NN(kpl_cast(NN(kpl_softmax_xent(NN(kpl_cast(xh, KPL_F32)), y, 255, 0.1)), hd));
        assert_int_equal(kpl_tensor_dtype(l), hd);
        for (int64_t i = 0; i < m; i++) assert_true(tget(l, i) == tget(lw, i));
        kpl_tensor *g = NN(kpl_softmax_xent_bwd(xh, y, gh, 255, 0.1));
        kpl_tensor *gw = NN(kpl_cast(NN(kpl_softmax_xent_bwd(NN(kpl_cast(xh, KPL_F32)), y,
                                                             NN(kpl_cast(gh, KPL_F32)), 255, 0.1)), hd));
        for (int64_t i = 0; i < n; i++) assert_true(tget(g, i) == tget(gw, i));
    }
    kpl_tensor *x = tensor(KPL_F64, 4, xs, xv);
    kpl_tensor *mean = NN(kpl_cross_entropy(x, y, KPL_REDUCE_MEAN, 0.1, 255));
    kpl_tensor *per = NN(kpl_softmax_xent(x, y, 255, 0.1));
    double sum = 0;
    int64_t count = 0;
    for (int64_t i = 0; i < m; i++) sum += tget(per, i), count += yv[i] != 255;
    assert_close(tget(mean, 0), sum / (double)count, 1e-14, 0, "mean", 0);
    free(xv), free(gv), free(yv);
    kpl_pool_pop(pool);
}

typedef struct {
    double eps;
    int64_t ignore;
} xent_args;

static kpl_tensor *g_xent_bwd(kpl_tensor *const *in, void *user)
{
    const xent_args *a = user;
    int64_t v[CE_N * CE_H * CE_W];
    memcpy(v, CE_LABELS, sizeof v);
    return kpl_softmax_xent_bwd(in[0], labels_of(3, CE_LS, v), in[1], a->ignore, a->eps);
}

/* The backward op to the second order in both its inputs (the logits and
 * gy), so gradient penalties through a cross entropy differentiate. */
static void test_xent_gradcheck(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    double gv[CE_N * CE_H * CE_W];
    for (int64_t i = 0; i < LEN(gv); i++) gv[i] = cos(0.9 * (double)i);
    kpl_tensor *x = leaf(KPL_F64, 4, CE_XS, CE_LOGITS), *gy = leaf(KPL_F64, 3, CE_LS, gv);
    const xent_args cases[] = {{0, 255}, {0.2, 255}, {0.6, 255}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int order = 1; order <= 2; order++)
            if (kpl_gradcheck(g_xent_bwd, (void *)&cases[i], 2, (kpl_tensor *[]){x, gy}, order,
                              1e-6, 1e-7, 1e-5) < 0)
                fail_msg("case %zu order %d: %s", i, order, kpl_last_error());
    kpl_tensor_release(x);
    kpl_tensor_release(gy);
    kpl_pool_pop(pool);
}

/* Traced cross entropy and its gradient run by the executor: eager's
 * bits, and the dump names the fused pair and its attributes. */
static void test_xent_graph(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = leaf(KPL_F32, 4, CE_XS, CE_LOGITS), *y = labels_of(3, CE_LS, CE_LABELS);
    kpl_tensor *loss = NN(kpl_cross_entropy(x, y, KPL_REDUCE_MEAN, 0.1, 255)), *gx = NULL;
    OK(kpl_grad(loss, NULL, 1, &x, false, &gx));
    OK(kpl_trace_begin());
    kpl_tensor *tx = NN(kpl_trace_input(x, "x")), *ty = NN(kpl_trace_input(y, "y"));
    OK(kpl_set_requires_grad(tx, true));
    kpl_tensor *tl = NN(kpl_cross_entropy(tx, ty, KPL_REDUCE_MEAN, 0.1, 255)), *tg = NULL;
    OK(kpl_grad(tl, NULL, 1, &tx, false, &tg));
    kpl_ir *ir = NULL;
    OK(kpl_trace_end(2, (kpl_tensor *[]){tl, tg}, (const char *[]){"loss", "gx"}, &ir));
    OK(kpl_ir_check(ir));
    char *dump = ir_dump_text(ir);
    if (!strstr(dump, "= softmax_xent(") || !strstr(dump, "= softmax_xent_bwd(") ||
        !strstr(dump, ") ignore_index=255 smoothing=0.1"))
        fail_msg("graph dump lacks the fused pair:\n%s", dump);
    free(dump);
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    OK(kpl_exec_set_input(ex, 0, x));
    OK(kpl_exec_set_input(ex, 1, y));
    OK(kpl_exec_run(ex));
    kpl_tensor *el = kpl_exec_output(ex, 0), *eg = kpl_exec_output(ex, 1);
    assert_true(tget(el, 0) == tget(loss, 0));
    for (int64_t i = 0; i < kpl_tensor_numel(gx); i++) assert_true(tget(eg, i) == tget(gx, i));
    /* a bad label in the graph's input is the kernel's error, by position */
    int64_t v[CE_N * CE_H * CE_W];
    memcpy(v, CE_LABELS, sizeof v);
    v[1 * CE_H * CE_W + 2 * CE_W + 3] = 9;
    OK(kpl_exec_set_input(ex, 1, labels_of(3, CE_LS, v)));
    assert_int_equal(kpl_exec_run(ex), KPL_ERANGE);
    assert_non_null(strstr(kpl_last_error(), "label 9 at position (1,2,3) is outside [0, 4) and "
                                             "is not the ignore_index 255"));
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    kpl_tensor_release(x);
    kpl_pool_pop(pool);
}

static void test_xent_errors(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = tensor(KPL_F32, 4, CE_XS, CE_LOGITS);
    int64_t v[CE_N * CE_H * CE_W];
    memcpy(v, CE_LABELS, sizeof v);
    v[7] = -3; /* (0, 1, 2) */
    assert_null(kpl_softmax_xent(x, labels_of(3, CE_LS, v), 255, 0));
    assert_int_equal(kpl_last_status(), KPL_ERANGE);
    assert_non_null(strstr(kpl_last_error(), "softmax_xent: label -3 at position (0,1,2) is "
                                             "outside [0, 4) and is not the ignore_index 255"));
    kpl_tensor *y = labels_of(3, CE_LS, CE_LABELS);
    assert_null(kpl_softmax_xent_bwd(x, labels_of(3, CE_LS, v), tensor(KPL_F32, 3, CE_LS, CE_LOGITS),
                                     255, 0));
    assert_non_null(strstr(kpl_last_error(), "softmax_xent_bwd: label -3 at position (0,1,2)"));
    assert_null(kpl_softmax_xent(x, y, 255, 1));
    assert_non_null(strstr(kpl_last_error(), "label smoothing 1 is outside [0, 1)"));
    assert_null(kpl_softmax_xent(x, labels_of(2, CE_LS, CE_LABELS), 255, 0));
    assert_int_equal(kpl_last_status(), KPL_ESHAPE);
    assert_non_null(strstr(kpl_last_error(), "labels (2,3) do not fit x (2,4,3,5)"));
    assert_null(kpl_softmax_xent(x, NN(kpl_cast(y, KPL_F32)), 255, 0));
    assert_int_equal(kpl_last_status(), KPL_EDTYPE);
    assert_non_null(strstr(kpl_last_error(), "softmax_xent: 'labels' has dtype f32"));
    assert_null(kpl_softmax_xent(NN(kpl_reshape(x, 1, (int64_t[]){120})),
                                 labels_of(1, (int64_t[]){1}, CE_LABELS), 255, 0));
    assert_non_null(strstr(kpl_last_error(), "expected (N, C) or (N, C, d1, ...)"));
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

static void resize_case(kpl_dtype dt, int64_t h, int64_t w, int64_t oh, int64_t ow, bool ac,
                        const double *want_y, const double *want_gx, const char *what)
{
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = NULL;
    OK(kpl_tensor_to_device(resize_values(dt, h, w, false), kpl_device_cpu(), &x));
    OK(kpl_set_requires_grad(x, true));
    kpl_tensor *y = kpl_upsample_bilinear(x, oh, ow, ac);
    char b[64];
    snprintf(b, sizeof b, "%s y %s", what, kpl_dtype_name(dt));
    expect(y, want_y, oh * ow, dt, b);
    assert_int_equal(kpl_tensor_shape(y)[2], oh);
    assert_int_equal(kpl_tensor_shape(y)[3], ow);
    kpl_tensor *gy = resize_values(dt, oh, ow, true), *gx = NULL;
    OK(kpl_grad(y, gy, 1, &x, false, &gx));
    snprintf(b, sizeof b, "%s gx %s", what, kpl_dtype_name(dt));
    expect(gx, want_gx, h * w, dt, b);
    kpl_tensor_release(x);
    kpl_pool_pop(pool);
}

/* F.interpolate(mode="bilinear") both ways, up, down, to one row, from one
 * cell, one side kept: values and gradients. */
static void test_resize_reference(void **state)
{
    (void)state;
    for (int f = 0; f < 2; f++) {
#define X(name, h, w, oh, ow, ac) \
        resize_case(dtypes[f], h, w, oh, ow, ac, RESIZE_##name##_Y, RESIZE_##name##_GX, #name);
        RESIZE_CASES(X)
#undef X
    }
}

/* Planes are independent: each of (2, 3) planes resized alone gives the
 * same bits as in the batch; and f16/bf16 are f32's arithmetic rounded once. */
static void test_resize_planes_and_halves(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    int64_t xs[4] = {2, 3, 6, 7}, n = 2 * 3 * 6 * 7;
    double *v = malloc((size_t)n * sizeof *v);
    assert_non_null(v);
    for (int64_t i = 0; i < n; i++) v[i] = sin(0.71 * (double)i) * (1 + (double)(i % 5));
    for (int ac = 0; ac < 2; ac++) {
        kpl_tensor *x = tensor(KPL_F32, 4, xs, v);
        kpl_tensor *y = NN(kpl_upsample_bilinear(x, 11, 4, ac));
        for (int64_t pl = 0; pl < 6; pl++) {
            kpl_tensor *one = NN(kpl_slice(NN(kpl_reshape(x, 3, (int64_t[]){6, 6, 7})), 0, pl, 1));
            kpl_tensor *y1 = NN(kpl_upsample_bilinear(NN(kpl_reshape(one, 4, (int64_t[]){1, 1, 6, 7})),
                                                      11, 4, ac));
            for (int64_t i = 0; i < 44; i++) assert_true(tget(y1, i) == tget(y, pl * 44 + i));
        }
        for (int h = 0; h < 2; h++) {
            kpl_dtype hd = h ? KPL_BF16 : KPL_F16;
            kpl_tensor *xh = NN(kpl_cast(x, hd));
            kpl_tensor *yh = NN(kpl_upsample_bilinear(xh, 11, 4, ac));
            assert_int_equal(kpl_tensor_dtype(yh), hd);
            kpl_tensor *want = NN(kpl_cast(NN(kpl_upsample_bilinear(NN(kpl_cast(xh, KPL_F32)), 11, 4,
                                                                    ac)), hd));
            for (int64_t i = 0; i < kpl_tensor_numel(yh); i++)
                assert_true(tget(yh, i) == tget(want, i));
            kpl_tensor *gh = NN(kpl_upsample_bilinear_bwd(yh, xs, ac));
            kpl_tensor *gw = NN(kpl_cast(NN(kpl_upsample_bilinear_bwd(NN(kpl_cast(yh, KPL_F32)), xs,
                                                                      ac)), hd));
            for (int64_t i = 0; i < n; i++) assert_true(tget(gh, i) == tget(gw, i));
        }
    }
    free(v);
    kpl_pool_pop(pool);
}

typedef struct {
    int64_t oh, ow;
    bool ac;
} resize_args;

static kpl_tensor *g_resize(kpl_tensor *const *in, void *user)
{
    const resize_args *a = user;
    return kpl_upsample_bilinear(in[0], a->oh, a->ow, a->ac);
}

/* Finite differences, to the second order (the pair is each other's
 * gradient), over the CE logits (2, 4, 3, 5). */
static void test_resize_gradcheck(void **state)
{
    (void)state;
    resize_args cases[] = {{7, 9, false}, {7, 9, true}, {2, 3, false}, {1, 1, true}, {3, 5, false}};
    gradcheck_cases(g_resize, cases, sizeof cases[0], sizeof cases / sizeof cases[0]);
}

/* Traced forward and backward run by the executor give eager's bits; the
 * graph names the op and its attributes. */
static void test_resize_graph(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *x = leaf(KPL_F32, 4, CE_XS, CE_LOGITS);
    kpl_tensor *seed = resize_values(KPL_F32, 2 * 4 * 8, 9, true);
    seed = NN(kpl_reshape(seed, 4, (int64_t[]){2, 4, 8, 9}));
    kpl_tensor *y = NN(kpl_upsample_bilinear(x, 8, 9, true)), *gx = NULL;
    OK(kpl_grad(y, seed, 1, &x, false, &gx));
    OK(kpl_trace_begin());
    kpl_tensor *tx = NN(kpl_trace_input(x, "x"));
    OK(kpl_set_requires_grad(tx, true));
    kpl_tensor *ty = NN(kpl_upsample_bilinear(tx, 8, 9, true)), *tg = NULL;
    OK(kpl_grad(ty, seed, 1, &tx, false, &tg));
    kpl_ir *ir = NULL;
    OK(kpl_trace_end(2, (kpl_tensor *[]){ty, tg}, (const char *[]){"y", "gx"}, &ir));
    OK(kpl_ir_check(ir));
    char *dump = ir_dump_text(ir);
    if (!strstr(dump, "= upsample_bilinear(") || !strstr(dump, ") size=8,9 align_corners") ||
        !strstr(dump, "= upsample_bilinear_bwd(") || !strstr(dump, ") size=3,5 align_corners"))
        fail_msg("graph dump lacks the resize pair:\n%s", dump);
    free(dump);
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    OK(kpl_exec_set_input(ex, 0, x));
    OK(kpl_exec_run(ex));
    kpl_tensor *ey = kpl_exec_output(ex, 0), *eg = kpl_exec_output(ex, 1);
    for (int64_t i = 0; i < kpl_tensor_numel(y); i++) assert_true(tget(ey, i) == tget(y, i));
    for (int64_t i = 0; i < kpl_tensor_numel(gx); i++) assert_true(tget(eg, i) == tget(gx, i));
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    kpl_tensor_release(x);
    kpl_pool_pop(pool);
}

static void test_resize_errors(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    int64_t s3[3] = {2, 3, 4}, s4[4] = {1, 2, 3, 4};
    kpl_tensor *x3 = tensor(KPL_F32, 3, s3, CE_LOGITS), *x4 = tensor(KPL_F32, 4, s4, CE_LOGITS);
    assert_null(kpl_upsample_bilinear(x3, 4, 4, false));
    assert_non_null(strstr(kpl_last_error(), "upsample_bilinear: needs NCHW input"));
    assert_null(kpl_upsample_bilinear(x4, 0, 4, false));
    assert_non_null(strstr(kpl_last_error(), "to 0x4"));
    assert_null(kpl_upsample_bilinear_bwd(x4, NULL, false));
    assert_non_null(strstr(kpl_last_error(), "'x_shape' is NULL"));
    assert_null(kpl_upsample_bilinear_bwd(x4, (int64_t[]){1, 2, 0, 3}, false));
    assert_non_null(strstr(kpl_last_error(), "x_shape[2] is 0"));
    /* the kernel's own checks: planes that differ, a plane with no cells */
    kpl_tensor *out = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){1, 3, 5, 5}, &out));
    assert_int_equal(kpl_k_upsample_bilinear(out, x4, false), KPL_ESHAPE);
    assert_non_null(strstr(kpl_last_error(), "differ in (N, C)"));
    kpl_tensor_release(out);
    kpl_tensor *e = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){1, 2, 0, 4}, &e));
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){1, 2, 3, 3}, &out));
    assert_int_equal(kpl_k_upsample_bilinear(out, e, false), KPL_ESHAPE);
    assert_non_null(strstr(kpl_last_error(), "empty plane"));
    kpl_tensor_release(out);
    kpl_tensor_release(e);
    kpl_tensor *i4 = NN(kpl_cast(x4, KPL_I64));
    assert_null(kpl_upsample_bilinear(i4, 4, 4, false));
    assert_non_null(strstr(kpl_last_error(), "upsample_bilinear"));
    kpl_pool_pop(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ce_reference),   cmocka_unit_test(test_ce_gradcheck),
        cmocka_unit_test(test_ce_all_ignored), cmocka_unit_test(test_ce_errors),
        cmocka_unit_test(test_xent_reference), cmocka_unit_test(test_xent_halves),
        cmocka_unit_test(test_xent_gradcheck), cmocka_unit_test(test_xent_graph),
        cmocka_unit_test(test_xent_errors),
        cmocka_unit_test(test_dice_reference), cmocka_unit_test(test_dice_gradcheck),
        cmocka_unit_test(test_dice_errors),    cmocka_unit_test(test_resize_reference),
        cmocka_unit_test(test_resize_planes_and_halves), cmocka_unit_test(test_resize_gradcheck),
        cmocka_unit_test(test_resize_graph),   cmocka_unit_test(test_resize_errors),
    };
    return cmocka_run_group_tests_name("segops", tests, NULL, NULL);
}
