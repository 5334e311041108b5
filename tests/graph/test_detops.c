/* test_detops.c — the detection ops of graph/vision.h beyond the box
 * metrics: ROI Align, the sigmoid focal loss and the box coders, each
 * against PyTorch implementations of the papers' / torchvision's
 * definitions (numbers kept in data/, made by detops_ref.py), against
 * cases computed by hand, against finite differences (kpl_gradcheck, to
 * the second or third order), and through their error messages.
 *
 * Tolerances against the references (computed in f64 from the same
 * f32-representable inputs): f64 1e-10 relative, f32 1e-5 relative; both
 * with an absolute floor of 1e-12 (f64) or 1e-6 (f32) times the largest
 * reference value, for elements that are sums cancelling to near 0. */
#include "kpl_refdata.h"
#include "autograd.h"
#include "vision.h"
#include "ir.h"

#include <float.h>
#include <stdlib.h>

#define RTOL(dt) ((dt) == KPL_F64 ? 1e-10 : 1e-5)
#define ATOL(dt) ((dt) == KPL_F64 ? 1e-12 : 1e-6)

static const kpl_dtype dtypes[2] = {KPL_F64, KPL_F32};

/* A tensor of dtype dt from doubles, pool-owned. */
static kpl_tensor *tensor(kpl_dtype dt, int ndim, const int64_t *shape, const double *v)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    kpl_tensor *t = NULL;
    if (n == 0)
        OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F64, ndim, shape, &t));
    else
        OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, ndim, shape, v, &t));
    kpl_autorelease(t);
    return dt == KPL_F64 ? t : NN(kpl_cast(t, dt));
}

/* A leaf that requires grad, owned by the caller. */
static kpl_tensor *param(kpl_dtype dt, int ndim, const int64_t *shape, const double *v)
{
    kpl_tensor *p = NULL;
    OK(kpl_tensor_to_device(tensor(dt, ndim, shape, v), kpl_device_cpu(), &p));
    OK(kpl_set_requires_grad(p, true));
    return p;
}

static void expect_values(kpl_tensor *t, const double *want, int64_t n, double tol,
                          const char *what)
{
    if (!t) fail_msg("%s: %s", what, kpl_last_error());
    assert_int_equal(kpl_tensor_numel(t), n);
    for (int64_t i = 0; i < n; i++) assert_close(tget(t, i), want[i], 0, tol, what, i);
}

/* The gradient of sum(y * gy) with respect to x. */
static kpl_tensor *grad_of(kpl_tensor *y, kpl_tensor *gy, kpl_tensor *x)
{
    kpl_tensor *g = NULL;
    OK(kpl_grad(y, gy, 1, &x, false, &g));
    return g;
}

/* ---- ROI Align --------------------------------------------------------------------------- */

static const char *const roi_cases[] = {"a", "b", "c", "d"};

static void test_roi_align_reference(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(DETOPS_DATA_DIR, "roi_align.bin");
    for (size_t c = 0; c < sizeof roi_cases / sizeof roi_cases[0]; c++)
        for (int f = 0; f < 2; f++) {
            kpl_dtype dt = dtypes[f];
            kpl_pool *pool = NN(kpl_pool_push());
            const char *cs = roi_cases[c];
            const kpl_ref_tensor *pr = KPL_REF(rf, "roi_align.%s.params", cs);
            int64_t oh = (int64_t)pr->v[0], ow = (int64_t)pr->v[1];
            double scale = pr->v[2];
            int sr = (int)pr->v[3];
            bool aligned = pr->v[4] != 0;
            const kpl_ref_tensor *rx = KPL_REF(rf, "roi_align.%s.x", cs);
            kpl_tensor *x = kpl_ref_param(rx, dt);
            kpl_tensor *rois = kpl_ref_tensor_of(KPL_REF(rf, "roi_align.%s.rois", cs), dt);
            kpl_tensor *gy = kpl_ref_tensor_of(KPL_REF(rf, "roi_align.%s.gy", cs), dt);
            char what[64];
            snprintf(what, sizeof what, "roi_align %s %s", cs, kpl_dtype_name(dt));
            kpl_tensor *y = NN(kpl_roi_align(x, rois, oh, ow, scale, sr, aligned));
            assert_true(kpl_requires_grad(y));
            kpl_ref_expect(y, KPL_REF(rf, "roi_align.%s.out", cs), RTOL(dt), ATOL(dt), what);
            kpl_tensor *gx = grad_of(y, gy, x);
            snprintf(what, sizeof what, "roi_align %s %s gradient", cs, kpl_dtype_name(dt));
            kpl_ref_expect(gx, KPL_REF(rf, "roi_align.%s.gx", cs), RTOL(dt), ATOL(dt), what);
            /* the adjoint called directly, and without recording */
            kpl_roi_align_params p = {oh, ow, scale, sr, aligned};
            bool prev = kpl_set_grad_enabled(false);
            kpl_tensor *y2 = NN(kpl_roi_align(x, rois, oh, ow, scale, sr, aligned));
            assert_false(kpl_requires_grad(y2));
            kpl_tensor *gx2 = NN(kpl_roi_align_bwd(gy, rois, kpl_tensor_shape(x), &p));
            kpl_set_grad_enabled(prev);
            for (int64_t i = 0; i < kpl_tensor_numel(y); i++)
                assert_close(tget(y2, i), tget(y, i), 0, 0, "recorded vs not", i);
            for (int64_t i = 0; i < kpl_tensor_numel(gx); i++)
                assert_close(tget(gx2, i), tget(gx, i), 0, 0, "roi_align_bwd vs backward", i);
            kpl_pool_pop(pool);
            kpl_tensor_release(x);
        }
    kpl_ref_free(rf);
}

/* Cases small enough to follow by hand. */
static void test_roi_align_by_hand(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = dtypes[f];
        double tol = dt == KPL_F64 ? 1e-15 : 1e-6;
        /* x = [[1, 2], [3, 4]] */
        kpl_tensor *x = tensor(dt, 4, (int64_t[]){1, 1, 2, 2}, (double[]){1, 2, 3, 4});
        struct {
            const char *what;
            double roi[5];
            bool aligned;
            double want;
        } cases[] = {
            /* one sample at the roi's centre (0.5, 0.5): the mean of the four */
            {"centre", {0, 0, 0, 1, 1}, false, 2.5},
            /* aligned shifts by -0.5: the sample lands on cell (0, 0) */
            {"aligned", {0, 0, 0, 1, 1}, true, 1},
            /* x = -0.5 is within [-1, 0): read at column 0, y = 0.5 */
            {"left of the map", {0, -1, 0, 0, 1}, false, 2},
            /* y = 1.5 is past the last row: read at row 1, x = 0.5 */
            {"below the last row", {0, 0, 1, 1, 2}, false, 3.5},
            /* x = 2.5 > W = 2: the sample counts as 0 */
            {"outside", {0, 2, 0, 3, 1}, false, 0},
            /* x = 2.0 = W exactly: still inside, read at the last column */
            {"on the border", {0, 1.5, 1, 2.5, 2}, false, 4},
            /* y = -1 exactly: inside, read at row 0; y = -1.0001 outside */
            {"at -1", {0, 1.5, -1.5, 2.5, -0.5}, false, 2},
            {"past -1", {0, 1.5, -1.5001, 2.5, -0.5001}, false, 0},
            /* a 0.25 x 0.25 roi is 1 x 1 without `aligned`: centre (0.5, 0.5) */
            {"small roi made 1 x 1", {0, 0, 0, 0.25, 0.25}, false, 2.5},
            /* aligned keeps it small: centre (0.125 - 0.5 -> 0, ...) */
            {"small roi aligned", {0, 0.5, 0.5, 0.75, 0.75}, true, 1 + 0.125 * 1 + 0.125 * 2},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            kpl_tensor *r = tensor(dt, 2, (int64_t[]){1, 5}, cases[i].roi);
            kpl_tensor *y = NN(kpl_roi_align(x, r, 1, 1, 1.0, 1, cases[i].aligned));
            expect_values(y, &cases[i].want, 1, tol, cases[i].what);
        }
        /* an empty roi, aligned and adaptive: no samples, 0 */
        kpl_tensor *r = tensor(dt, 2, (int64_t[]){1, 5}, (double[]){0, 0.5, 0.5, 0.5, 0.5});
        expect_values(NN(kpl_roi_align(x, r, 2, 2, 1.0, 0, true)), (double[]){0, 0, 0, 0}, 4, 0,
                      "no samples");
        /* spatial_scale: image coordinates 4x the map's */
        r = tensor(dt, 2, (int64_t[]){1, 5}, (double[]){0, 0, 0, 4, 4});
        expect_values(NN(kpl_roi_align(x, r, 1, 1, 0.25, 1, false)), (double[]){2.5}, 1, tol,
                      "spatial_scale");
        /* no rois: (0, C, oh, ow) */
        kpl_tensor *none = NN(kpl_roi_align(x, tensor(dt, 2, (int64_t[]){0, 5}, NULL), 3, 2, 1, 2,
                                            true));
        assert_int_equal(kpl_tensor_ndim(none), 4);
        assert_int_equal(kpl_tensor_shape(none)[0], 0);
        assert_int_equal(kpl_tensor_shape(none)[2], 3);
    }
    /* The adaptive grid and the gradient: x (1, 1, 3, 5) holds its column
     * index, so interpolation is exact and a bin's value is the mean x of
     * its samples.  roi (0.5, 0, 4.5, 2), one bin: gh = ceil(2) = 2, gw =
     * ceil(4) = 4, samples at x = 1, 2, 3, 4 (the last on the last
     * column) and y = 0.5, 1.5: the value is 2.5.  Its gradient puts 1/8
     * per sample, split over rows 0-1 (y = 0.5) and 1-2 (y = 1.5): 1/16,
     * 1/8, 1/16 down columns 1 to 4, nothing in column 0. */
    double ramp[15], want[15];
    for (int i = 0; i < 15; i++) {
        int row = i / 5, col = i % 5;
        ramp[i] = col;
        want[i] = col == 0 ? 0 : row == 1 ? 0.125 : 0.0625;
    }
    kpl_tensor *x = param(KPL_F64, 4, (int64_t[]){1, 1, 3, 5}, ramp);
    kpl_tensor *r = tensor(KPL_F64, 2, (int64_t[]){1, 5}, (double[]){0, 0.5, 0, 4.5, 2});
    kpl_tensor *y = NN(kpl_roi_align(x, r, 1, 1, 1.0, 0, false));
    expect_values(y, (double[]){2.5}, 1, 1e-15, "adaptive grid");
    expect_values(grad_of(y, NULL, x), want, 15, 1e-16, "adaptive grid, gradient");
    /* two rois on one image add their gradients; the other image gets none */
    kpl_tensor *x2 = param(KPL_F64, 4, (int64_t[]){2, 1, 2, 2}, (double[]){1, 2, 3, 4, 5, 6, 7, 8});
    kpl_tensor *r2 = tensor(KPL_F64, 2, (int64_t[]){3, 5},
                            (double[]){1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1});
    kpl_tensor *y2 = NN(kpl_roi_align(x2, r2, 1, 1, 1.0, 1, false));
    expect_values(y2, (double[]){6.5, 6.5, 6.5}, 3, 1e-15, "three rois on image 1");
    expect_values(grad_of(kpl_sum(y2, NULL, 0, false), NULL, x2),
                  (double[]){0, 0, 0, 0, 0.75, 0.75, 0.75, 0.75}, 8, 1e-16,
                  "three rois, gradient");
    kpl_pool_pop(pool);
    kpl_tensor_release(x);
    kpl_tensor_release(x2);
}

typedef struct {
    kpl_tensor *rois;
    kpl_roi_align_params p;
} roi_user;

static kpl_tensor *f_roi_align(kpl_tensor *const *in, void *u)
{
    const roi_user *r = u;
    return kpl_roi_align(in[0], r->rois, r->p.out_h, r->p.out_w, r->p.spatial_scale,
                         r->p.sampling_ratio, r->p.aligned);
}

static kpl_tensor *f_roi_align_bwd(kpl_tensor *const *in, void *u)
{
    const roi_user *r = u;
    return kpl_roi_align_bwd(in[0], r->rois, (const int64_t[]){2, 3, 6, 7}, &r->p);
}

static void test_roi_align_gradcheck(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    double xv[2 * 3 * 6 * 7], gv[4 * 3 * 3 * 2];
    for (int i = 0; i < 2 * 3 * 6 * 7; i++) xv[i] = sin(0.7 * i) + 0.1 * (i % 5);
    for (int i = 0; i < 4 * 3 * 3 * 2; i++) gv[i] = cos(1.3 * i);
    kpl_tensor *x = param(KPL_F64, 4, (int64_t[]){2, 3, 6, 7}, xv);
    kpl_tensor *g = param(KPL_F64, 4, (int64_t[]){4, 3, 3, 2}, gv);
    roi_user u = {tensor(KPL_F64, 2, (int64_t[]){4, 5},
                         (double[]){0, 1, 2, 9, 11, 1, -3, -2, 5, 4, 1, 6.5, 0.5, 14.25, 13,
                                    0, 3, 3, 3.5, 3.25}),
                  {3, 2, 0.5, 0, true}};
    for (int order = 1; order <= 3; order++) {
        if (kpl_gradcheck(f_roi_align, &u, 1, &x, order, 1e-6, 1e-7, 1e-6) != KPL_OK)
            fail_msg("roi_align, order %d: %s", order, kpl_last_error());
        if (kpl_gradcheck(f_roi_align_bwd, &u, 1, &g, order, 1e-6, 1e-7, 1e-6) != KPL_OK)
            fail_msg("roi_align_bwd, order %d: %s", order, kpl_last_error());
    }
    /* The rois take no gradient, even as parameters: the output depends on
     * x alone, and on nothing when x asks for none. */
    kpl_tensor *pr = param(KPL_F64, 2, (int64_t[]){1, 5}, (double[]){0, 1, 1, 4, 4});
    kpl_tensor *y = NN(kpl_roi_align(x, pr, 2, 2, 1, 2, true)), *gr = NULL;
    OK(kpl_grad(kpl_sum(y, NULL, 0, false), NULL, 1, &pr, false, &gr));
    assert_null(gr);
    kpl_tensor *xc = tensor(KPL_F64, 4, (int64_t[]){2, 3, 6, 7}, xv);
    assert_false(kpl_requires_grad(NN(kpl_roi_align(xc, pr, 2, 2, 1, 2, true))));
    kpl_pool_pop(pool);
    kpl_tensor_release(x);
    kpl_tensor_release(g);
    kpl_tensor_release(pr);
}

static kpl_status roi_st(kpl_tensor *x, kpl_tensor *rois, int64_t oh, int64_t ow, double scale,
                         int sr)
{
    return kpl_roi_align(x, rois, oh, ow, scale, sr, true) ? KPL_OK : kpl_last_status();
}

static void test_roi_align_errors(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    double xv[2 * 2 * 4 * 4] = {0};
    kpl_tensor *x = tensor(KPL_F32, 4, (int64_t[]){2, 2, 4, 4}, xv);
    kpl_tensor *r = tensor(KPL_F32, 2, (int64_t[]){2, 5}, (double[]){0, 0, 0, 2, 2, 1, 1, 1, 3, 3});
    OK(roi_st(x, r, 2, 2, 1, 2));
    /* shapes */
    FAILS(roi_st(tensor(KPL_F32, 3, (int64_t[]){2, 4, 4}, xv), r, 2, 2, 1, 2), KPL_ESHAPE,
          "roi_align: 'x' has shape (2,4,4); expected (N, C, H, W)");
    FAILS(roi_st(x, tensor(KPL_F32, 2, (int64_t[]){2, 4}, xv), 2, 2, 1, 2), KPL_ESHAPE,
          "roi_align: 'rois' has shape (2,4); rois are (K, 5) rows (batch index, x0, y0, x1, y1)");
    FAILS(roi_st(tensor(KPL_F32, 4, (int64_t[]){2, 2, 0, 4}, xv), r, 2, 2, 1, 2), KPL_ESHAPE,
          "roi_align: 'x' has shape (2,2,0,4): no feature map to sample the rois from");
    /* dtypes */
    FAILS(roi_st(x, tensor(KPL_F64, 2, (int64_t[]){2, 5}, xv), 2, 2, 1, 2), KPL_EDTYPE,
          "roi_align: 'rois' has dtype f64, expected f32");
    FAILS(roi_st(tensor(KPL_I64, 4, (int64_t[]){2, 2, 4, 4}, xv), r, 2, 2, 1, 2), KPL_EDTYPE,
          "roi_align: 'x' has dtype i64; f32 and f64 are supported");
    /* parameters */
    FAILS(roi_st(x, r, 0, 2, 1, 2), KPL_EINVAL,
          "roi_align: the output size 0 x 2 must be at least 1 x 1");
    FAILS(roi_st(x, r, 2, 2, 0, 2), KPL_EINVAL, "roi_align: spatial_scale 0 must be finite");
    FAILS(roi_st(x, r, 2, 2, NAN, 2), KPL_EINVAL, "roi_align: spatial_scale nan must be finite");
    FAILS(roi_st(x, r, 2, 2, 1, 100000), KPL_EINVAL,
          "roi_align: sampling_ratio 100000 is more than 65536 samples per bin side");
    /* roi values */
    struct {
        double roi[5];
        const char *msg;
    } bad[] = {
        {{2, 0, 0, 1, 1}, "roi_align: 'rois' row 1 (2, 0, 0, 1, 1) is not a roi (batch index, x0, "
                          "y0, x1, y1): batch index 2 is not one of the 2 images of 'x' (a whole "
                          "number in [0, 2))"},
        {{-1, 0, 0, 1, 1}, "batch index -1 is not one of the 2 images"},
        {{0.5, 0, 0, 1, 1}, "batch index 0.5 is not one of the 2 images"},
        {{0, NAN, 0, 1, 1}, "'rois' row 1 (0, nan, 0, 1, 1) is not a roi (batch index, x0, y0, "
                            "x1, y1): a value is NaN or infinite"},
        {{INFINITY, 0, 0, 1, 1}, "a value is NaN or infinite"},
        {{0, 3, 0, 1, 1}, "'rois' row 1 (0, 3, 0, 1, 1) is not a roi (batch index, x0, y0, x1, "
                          "y1): x1 < x0"},
        {{0, 0, 2, 1, 1}, "y1 < y0"},
        {{1, 0, 0, 1e9, 1}, "'rois' row 1 (1, 0, 0, 1e+09, 1) is not a roi (batch index, x0, y0, "
                            "x1, y1): 1 x 5e+08 samples per bin, more than 65536 per side"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        double rv[10] = {0, 0, 0, 2, 2};
        memcpy(rv + 5, bad[i].roi, sizeof bad[i].roi);
        kpl_tensor *rb = tensor(KPL_F64, 2, (int64_t[]){2, 5}, rv);
        FAILS(roi_st(tensor(KPL_F64, 4, (int64_t[]){2, 2, 4, 4}, xv), rb, 2, 2, 1, 0), KPL_EINVAL,
              bad[i].msg);
    }
    /* the same checks guard the adjoint */
    kpl_roi_align_params p = {2, 2, 1, 2, true};
    kpl_tensor *gy = tensor(KPL_F32, 4, (int64_t[]){2, 2, 2, 2}, xv);
    kpl_tensor *rb = tensor(KPL_F32, 2, (int64_t[]){2, 5},
                            (double[]){0, 0, 0, 2, 2, 5, 1, 1, 3, 3});
    FAILS(kpl_roi_align_bwd(gy, rb, (int64_t[]){2, 2, 4, 4}, &p) ? KPL_OK : kpl_last_status(),
          KPL_EINVAL, "roi_align_bwd: 'rois' row 1 (5, 1, 1, 3, 3) is not a roi");
    FAILS(kpl_roi_align_bwd(gy, r, (int64_t[]){2, 3, 4, 4}, &p) ? KPL_OK : kpl_last_status(),
          KPL_ESHAPE, "roi_align_bwd: 'gy' has shape (2,2,2,2); expected (2,3,2,2)");
    /* NULLs: a failed op's NULL passes on, the caller's own is named */
    kpl_clear_error();
    kpl_tensor *failed = kpl_roi_align(x, r, 0, 1, 1, 1, true);
    assert_null(failed);
    assert_null(kpl_roi_align(failed, r, 2, 2, 1, 1, true));
    assert_non_null(strstr(kpl_last_error(), "the output size 0 x 1"));
    kpl_tensor *out = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){2, 2, 2, 2}, &out));
    FAILS(kpl_k_roi_align(out, x, NULL, &p), KPL_EINVAL, "roi_align: argument 'rois' is NULL");
    FAILS(kpl_k_roi_align(out, x, r, NULL), KPL_EINVAL, "roi_align: argument 'p' is NULL");
    FAILS(kpl_k_roi_align(out, x, r, &(kpl_roi_align_params){3, 2, 1, 2, true}), KPL_ESHAPE,
          "roi_align: 'out' has shape (2,2,2,2); expected (2,2,3,2)");
    kpl_tensor_release(out);
    kpl_pool_pop(pool);
}

/* ---- the focal loss ----------------------------------------------------------------------- */

static const char *const focal_cases[] = {"a", "b", "c", "d", "e"};

static void test_focal_reference(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(DETOPS_DATA_DIR, "focal_loss.bin");
    for (size_t c = 0; c < sizeof focal_cases / sizeof focal_cases[0]; c++)
        for (int f = 0; f < 2; f++) {
            kpl_dtype dt = dtypes[f];
            kpl_pool *pool = NN(kpl_pool_push());
            const char *cs = focal_cases[c];
            const kpl_ref_tensor *pr = KPL_REF(rf, "focal.%s.params", cs);
            double alpha = pr->v[0], gamma = pr->v[1];
            kpl_tensor *z = kpl_ref_param(KPL_REF(rf, "focal.%s.logits", cs), dt);
            kpl_tensor *y = kpl_ref_tensor_of(KPL_REF(rf, "focal.%s.targets", cs), dt);
            kpl_tensor *gy = kpl_ref_tensor_of(KPL_REF(rf, "focal.%s.gy", cs), dt);
            char what[64];
            snprintf(what, sizeof what, "focal %s %s", cs, kpl_dtype_name(dt));
            kpl_tensor *l = NN(kpl_sigmoid_focal_loss(z, y, alpha, gamma, KPL_REDUCE_NONE));
            kpl_ref_expect(l, KPL_REF(rf, "focal.%s.loss", cs), RTOL(dt), ATOL(dt), what);
            kpl_tensor *g = grad_of(l, gy, z);
            for (int64_t i = 0; i < kpl_tensor_numel(g); i++)
                if (!isfinite(tget(g, i))) fail_msg("%s: gradient %lld is not finite", what,
                                                    (long long)i);
            kpl_ref_expect(g, KPL_REF(rf, "focal.%s.grad", cs), RTOL(dt), ATOL(dt), what);
            kpl_tensor *m = NN(kpl_sigmoid_focal_loss(z, y, alpha, gamma, KPL_REDUCE_MEAN));
            kpl_ref_expect(m, KPL_REF(rf, "focal.%s.mean", cs), RTOL(dt), ATOL(dt), what);
            kpl_ref_expect(grad_of(m, NULL, z), KPL_REF(rf, "focal.%s.grad_mean", cs), RTOL(dt),
                           ATOL(dt), what);
            kpl_ref_expect(NN(kpl_sigmoid_focal_loss(z, y, alpha, gamma, KPL_REDUCE_SUM)),
                           KPL_REF(rf, "focal.%s.sum", cs), RTOL(dt), ATOL(dt), what);
            kpl_pool_pop(pool);
            kpl_tensor_release(z);
        }
    kpl_ref_free(rf);
}

static void test_focal_by_hand(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = dtypes[f];
        double tol = dt == KPL_F64 ? 1e-15 : 1e-6;
        int64_t n = 6;
        /* logit 0: p = 1/2, CE = log 2, 1 - p_t = 1/2 for either target */
        kpl_tensor *z0 = tensor(dt, 1, &n, (double[]){0, 0, 0, 0, 0, 0});
        kpl_tensor *y0 = tensor(dt, 1, &n, (double[]){1, 0, 1, 0, 1, 0});
        double l2 = log(2.0);
        expect_values(NN(kpl_sigmoid_focal_loss(z0, y0, 0.25, 2, KPL_REDUCE_NONE)),
                      (double[]){0.25 * 0.25 * l2, 0.75 * 0.25 * l2, 0.25 * 0.25 * l2,
                                 0.75 * 0.25 * l2, 0.25 * 0.25 * l2, 0.75 * 0.25 * l2},
                      n, tol, "logit 0");
        /* gamma 0, no alpha: the binary cross entropy itself */
        kpl_tensor *z = tensor(dt, 1, &n, (double[]){-3, -1, 0.5, 2, 4, 1});
        kpl_tensor *a = NN(kpl_sigmoid_focal_loss(z, y0, -1, 0, KPL_REDUCE_NONE));
        kpl_tensor *b = NN(kpl_bce_with_logits(z, y0, KPL_REDUCE_NONE));
        /* (the fused kernel's vector exp and log1p may round differently
         * from the element-wise ops' in the last bit) */
        for (int64_t i = 0; i < n; i++)
            assert_close(tget(a, i), tget(b, i), dt == KPL_F64 ? 5e-16 : 2.5e-7, 0, "gamma 0", i);
        /* Large logits: right ones cost 0 with gradient 0, wrong ones cost
         * |z| (weighted) with gradient -+1 (weighted); all finite, for
         * gamma 2 and 0.5 alike. */
        kpl_tensor *zl = NULL;
        double zv[6] = {1000, -1000, 1000, -1000, 200, -200};
        OK(kpl_tensor_to_device(tensor(dt, 1, &n, zv), kpl_device_cpu(), &zl));
        OK(kpl_set_requires_grad(zl, true));
        kpl_tensor *yl = tensor(dt, 1, &n, (double[]){1, 0, 0, 1, 1, 1});
        for (int gi = 0; gi < 2; gi++) {
            double gamma = gi ? 0.5 : 2;
            kpl_tensor *l = NN(kpl_sigmoid_focal_loss(zl, yl, 0.25, gamma, KPL_REDUCE_NONE));
            expect_values(l, (double[]){0, 0, 0.75 * 1000, 0.25 * 1000, 0, 0.25 * 200}, n,
                          1e-12 * 1000, "large logits");
            expect_values(grad_of(kpl_sum(l, NULL, 0, false), NULL, zl),
                          (double[]){0, 0, 0.75, -0.25, 0, -0.25}, n,
                          1e-12, "large logits, gradient");
        }
        kpl_tensor_release(zl);
    }
    /* the mean of nothing is 0 */
    int64_t zero = 0;
    kpl_tensor *e = tensor(KPL_F32, 1, &zero, NULL);
    expect_values(NN(kpl_sigmoid_focal_loss(e, e, 0.25, 2, KPL_REDUCE_MEAN)), (double[]){0}, 1, 0,
                  "empty mean");
    kpl_pool_pop(pool);
}

typedef struct {
    double alpha, gamma;
    kpl_reduction red;
} focal_user;

static kpl_tensor *f_focal(kpl_tensor *const *in, void *u)
{
    const focal_user *f = u;
    return kpl_sigmoid_focal_loss(in[0], in[1], f->alpha, f->gamma, f->red);
}

static void test_focal_gradcheck(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    double zv[12] = {-4, -2.5, -1, -0.3, 0.2, 0.9, 1.7, 3, 5, -6, 0.05, 2.2};
    double yv[12] = {1, 0, 1, 0, 0.3, 1, 0, 0.8, 1, 0, 1, 0};
    kpl_tensor *z = param(KPL_F64, 2, (int64_t[]){3, 4}, zv);
    kpl_tensor *y = param(KPL_F64, 2, (int64_t[]){3, 4}, yv);
    kpl_tensor *in[2] = {z, y};
    focal_user cases[] = {{0.25, 2, KPL_REDUCE_MEAN}, {-1, 1.5, KPL_REDUCE_NONE},
                          {0.6, 0.5, KPL_REDUCE_SUM}, {0.25, 1, KPL_REDUCE_SUM},
                          {0.25, 0, KPL_REDUCE_NONE}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int order = 1; order <= 3; order++)
            if (kpl_gradcheck(f_focal, &cases[i], 2, in, order, 1e-6, 1e-6, 1e-5) != KPL_OK)
                fail_msg("focal alpha %g gamma %g, order %d: %s", cases[i].alpha, cases[i].gamma,
                         order, kpl_last_error());
    kpl_pool_pop(pool);
    kpl_tensor_release(z);
    kpl_tensor_release(y);
}

/* The same cases with constant targets run the fused op pair (its
 * backward's gradient composed): to the third order in the logits, and
 * the backward op to the second order in gy as well. */
typedef struct {
    focal_user f;
    kpl_tensor *y;
} focal_const;

static kpl_tensor *f_focal_const(kpl_tensor *const *in, void *u)
{
    const focal_const *c = u;
    return kpl_sigmoid_focal_loss(in[0], c->y, c->f.alpha, c->f.gamma, c->f.red);
}

static kpl_tensor *f_focal_bwd(kpl_tensor *const *in, void *u)
{
    const focal_const *c = u;
    return kpl_sigmoid_focal_bwd(in[0], c->y, in[1], c->f.alpha, c->f.gamma);
}

static void test_focal_fused_gradcheck(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    double zv[12] = {-4, -2.5, -1, -0.3, 0.2, 0.9, 1.7, 3, 5, -6, 0.05, 2.2};
    double yv[12] = {1, 0, 1, 0, 0.3, 1, 0, 0.8, 1, 0, 1, 0};
    double gv[12] = {0.5, -1, 2, 0.1, -0.7, 1, 1.5, -0.2, 0.3, 0.9, -1.1, 0.4};
    int64_t s34[2] = {3, 4};
    kpl_tensor *z = param(KPL_F64, 2, s34, zv), *gy = param(KPL_F64, 2, s34, gv);
    focal_const cases[] = {{{0.25, 2, KPL_REDUCE_MEAN}, NULL}, {{-1, 1.5, KPL_REDUCE_NONE}, NULL},
                           {{0.6, 0.5, KPL_REDUCE_SUM}, NULL}, {{0.25, 1, KPL_REDUCE_SUM}, NULL},
                           {{0.25, 0, KPL_REDUCE_NONE}, NULL}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cases[i].y = tensor(KPL_F64, 2, s34, yv);
        for (int order = 1; order <= 3; order++)
            if (kpl_gradcheck(f_focal_const, &cases[i], 1, &z, order, 1e-6, 1e-6, 1e-5) != KPL_OK)
                fail_msg("fused focal alpha %g gamma %g, order %d: %s", cases[i].f.alpha,
                         cases[i].f.gamma, order, kpl_last_error());
        for (int order = 1; order <= 2; order++)
            if (kpl_gradcheck(f_focal_bwd, &cases[i], 2, (kpl_tensor *[]){z, gy}, order, 1e-6,
                              1e-6, 1e-5) != KPL_OK)
                fail_msg("focal bwd alpha %g gamma %g, order %d: %s", cases[i].f.alpha,
                         cases[i].f.gamma, order, kpl_last_error());
    }
    kpl_pool_pop(pool);
    kpl_tensor_release(z);
    kpl_tensor_release(gy);
}

/* The fused op (constant targets) against the recorded composition
 * (targets that require grad), values and logit gradients, over logits
 * from -30 to 30 and hard and soft targets; f16/bf16 are the f32 kernel
 * rounded once; a traced loss and gradient run by the executor give
 * eager's bits. */
static void test_focal_fused_vs_composed(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    int64_t n = 601;
    double *zv = malloc((size_t)n * sizeof *zv), *yv = malloc((size_t)n * sizeof *yv);
    assert_true(zv && yv);
    for (int64_t i = 0; i < n; i++) {
        zv[i] = -30 + 0.1 * (double)i;
        yv[i] = i % 3 == 0 ? 1 : i % 3 == 1 ? 0 : 0.25;
    }
    const double params[3][2] = {{0.25, 2}, {-1, 0.5}, {0.7, 0}};
    for (int f = 0; f < 2; f++)
        for (int k = 0; k < 3; k++) {
            kpl_dtype dt = dtypes[f];
            kpl_tensor *z = param(dt, 1, &n, zv), *yc = tensor(dt, 1, &n, yv);
            kpl_tensor *yg = param(dt, 1, &n, yv);
            double a = params[k][0], g = params[k][1];
            kpl_tensor *lf = NN(kpl_sigmoid_focal_loss(z, yc, a, g, KPL_REDUCE_NONE));
            kpl_tensor *lc = NN(kpl_sigmoid_focal_loss(z, yg, a, g, KPL_REDUCE_NONE));
            kpl_tensor *gf = grad_of(NN(kpl_sum(lf, NULL, 0, false)), NULL, z);
            kpl_tensor *gc = grad_of(NN(kpl_sum(lc, NULL, 0, false)), NULL, z);
            double tol = dt == KPL_F64 ? 1e-13 : 2e-6;
            for (int64_t i = 0; i < n; i++) {
                assert_close(tget(lf, i), tget(lc, i), tol, tol, "fused loss", i);
                assert_close(tget(gf, i), tget(gc, i), tol, tol, "fused gradient", i);
            }
            kpl_tensor_release(z);
            kpl_tensor_release(yg);
        }
    kpl_tensor *z = tensor(KPL_F32, 1, &n, zv), *y = tensor(KPL_F32, 1, &n, yv);
    for (int h = 0; h < 2; h++) {
        kpl_dtype hd = h ? KPL_BF16 : KPL_F16;
        kpl_tensor *zh = NN(kpl_cast(z, hd)), *yh = NN(kpl_cast(y, hd));
        kpl_tensor *l = NN(kpl_sigmoid_focal(zh, yh, 0.25, 2));
        kpl_tensor *w = NN(kpl_cast(NN(kpl_sigmoid_focal(NN(kpl_cast(zh, KPL_F32)),
                                                         NN(kpl_cast(yh, KPL_F32)), 0.25, 2)), hd));
        assert_int_equal(kpl_tensor_dtype(l), hd);
        for (int64_t i = 0; i < n; i++) assert_true(tget(l, i) == tget(w, i));
    }
    kpl_tensor *zp = param(KPL_F32, 1, &n, zv);
    kpl_tensor *loss = NN(kpl_sigmoid_focal_loss(zp, y, 0.25, 2, KPL_REDUCE_SUM)), *gz = NULL;
    OK(kpl_grad(loss, NULL, 1, &zp, false, &gz));
    OK(kpl_trace_begin());
    kpl_tensor *tz = NN(kpl_trace_input(zp, "z")), *ty = NN(kpl_trace_input(y, "y"));
    OK(kpl_set_requires_grad(tz, true));
    kpl_tensor *tl = NN(kpl_sigmoid_focal_loss(tz, ty, 0.25, 2, KPL_REDUCE_SUM)), *tg = NULL;
    OK(kpl_grad(tl, NULL, 1, &tz, false, &tg));
    kpl_ir *ir = NULL;
    OK(kpl_trace_end(2, (kpl_tensor *[]){tl, tg}, (const char *[]){"loss", "gz"}, &ir));
    char *dump = NULL;
    size_t len = 0;
    FILE *fd = open_memstream(&dump, &len);
    assert_non_null(fd);
    OK(kpl_ir_dump(ir, fd, false));
    fclose(fd);
    if (!strstr(dump, "= sigmoid_focal(") || !strstr(dump, "= sigmoid_focal_bwd(") ||
        !strstr(dump, ") alpha=0.25 gamma=2"))
        fail_msg("graph dump lacks the fused pair:\n%s", dump);
    free(dump);
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    OK(kpl_exec_set_input(ex, 0, zp));
    OK(kpl_exec_set_input(ex, 1, y));
    OK(kpl_exec_run(ex));
    assert_true(tget(kpl_exec_output(ex, 0), 0) == tget(loss, 0));
    for (int64_t i = 0; i < n; i++) assert_true(tget(kpl_exec_output(ex, 1), i) == tget(gz, i));
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    kpl_tensor_release(zp);
    free(zv);
    free(yv);
    kpl_pool_pop(pool);
}

static kpl_status focal_st(kpl_tensor *z, kpl_tensor *y, double alpha, double gamma,
                           kpl_reduction red)
{
    return kpl_sigmoid_focal_loss(z, y, alpha, gamma, red) ? KPL_OK : kpl_last_status();
}

static void test_focal_errors(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    double v[6] = {0};
    kpl_tensor *z = tensor(KPL_F32, 2, (int64_t[]){2, 3}, v);
    OK(focal_st(z, z, 0.25, 2, KPL_REDUCE_SUM));
    FAILS(focal_st(z, tensor(KPL_F32, 1, (int64_t[]){6}, v), 0.25, 2, KPL_REDUCE_SUM), KPL_ESHAPE,
          "sigmoid_focal_loss: 'logits' (2,3) and 'targets' (6) must have one shape");
    FAILS(focal_st(z, tensor(KPL_F64, 2, (int64_t[]){2, 3}, v), 0.25, 2, KPL_REDUCE_SUM),
          KPL_EDTYPE, "sigmoid_focal_loss: 'logits' has dtype f32 and 'targets' f64");
    kpl_tensor *zi = tensor(KPL_I64, 2, (int64_t[]){2, 3}, v);
    FAILS(focal_st(zi, zi, 0.25, 2, KPL_REDUCE_SUM), KPL_EDTYPE, "both f32 or both f64");
    FAILS(focal_st(z, z, 0.25, -1, KPL_REDUCE_SUM), KPL_EINVAL,
          "sigmoid_focal_loss: gamma -1 must be finite and >= 0");
    FAILS(focal_st(z, z, 0.25, INFINITY, KPL_REDUCE_SUM), KPL_EINVAL, "gamma inf must be");
    FAILS(focal_st(z, z, 1.5, 2, KPL_REDUCE_SUM), KPL_EINVAL, "alpha 1.5 in [0, 1]");
    FAILS(focal_st(z, z, NAN, 2, KPL_REDUCE_SUM), KPL_EINVAL, "alpha nan in [0, 1]");
    FAILS(focal_st(z, z, 0.25, 2, (kpl_reduction)9), KPL_EINVAL,
          "sigmoid_focal_loss: unknown reduction 9");
    kpl_pool_pop(pool);
}

/* ---- box coders ------------------------------------------------------------------------------ */

static void test_coder_reference(void **state)
{
    (void)state;
    kpl_ref_file *rf = kpl_ref_load(DETOPS_DATA_DIR, "box_coder.bin");
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = dtypes[f];
        kpl_pool *pool = NN(kpl_pool_push());
        double rt = RTOL(dt), at = ATOL(dt);
        kpl_tensor *pts = kpl_ref_param(KPL_REF(rf, "ltrb.points"), dt);
        kpl_tensor *d = kpl_ref_param(KPL_REF(rf, "ltrb.ltrb"), dt);
        kpl_tensor *boxes = kpl_ref_tensor_of(KPL_REF(rf, "ltrb.boxes"), dt);
        kpl_ref_expect(NN(kpl_box_encode_ltrb(pts, boxes)), KPL_REF(rf, "ltrb.encoded"), rt, at,
                       "ltrb encode");
        kpl_tensor *dec = NN(kpl_box_decode_ltrb(pts, d));
        kpl_ref_expect(dec, KPL_REF(rf, "ltrb.decoded"), rt, at, "ltrb decode");
        kpl_tensor *gy = kpl_ref_tensor_of(KPL_REF(rf, "ltrb.gy"), dt), *g[2] = {NULL, NULL};
        OK(kpl_grad(dec, gy, 2, (kpl_tensor *[]){pts, d}, false, g));
        kpl_ref_expect(g[0], KPL_REF(rf, "ltrb.grad_points"), rt, at, "ltrb d/dpoints");
        kpl_ref_expect(g[1], KPL_REF(rf, "ltrb.grad_ltrb"), rt, at, "ltrb d/dltrb");
        kpl_tensor_release(pts);
        kpl_tensor_release(d);
        for (int c = 0; c < 2; c++) {
            const char *cs = c ? "b" : "a";
            const kpl_ref_tensor *pr = KPL_REF(rf, "delta.%s.params", cs);
            kpl_box_coder coder = {{pr->v[0], pr->v[1], pr->v[2], pr->v[3]}, pr->v[4]};
            kpl_tensor *an = kpl_ref_param(KPL_REF(rf, "delta.%s.anchors", cs), dt);
            kpl_tensor *dl = kpl_ref_param(KPL_REF(rf, "delta.%s.deltas", cs), dt);
            kpl_tensor *gt = kpl_ref_tensor_of(KPL_REF(rf, "delta.%s.gt", cs), dt);
            char what[64];
            snprintf(what, sizeof what, "delta %s %s", cs, kpl_dtype_name(dt));
            kpl_ref_expect(NN(kpl_box_encode_delta(gt, an, &coder)),
                           KPL_REF(rf, "delta.%s.encoded", cs), rt, at, what);
            kpl_tensor *db = NN(kpl_box_decode_delta(dl, an, &coder));
            kpl_ref_expect(db, KPL_REF(rf, "delta.%s.decoded", cs), rt, at, what);
            kpl_tensor *gb = kpl_ref_tensor_of(KPL_REF(rf, "delta.%s.gy", cs), dt);
            OK(kpl_grad(db, gb, 2, (kpl_tensor *[]){an, dl}, false, g));
            kpl_ref_expect(g[0], KPL_REF(rf, "delta.%s.grad_anchors", cs), rt, at, what);
            kpl_ref_expect(g[1], KPL_REF(rf, "delta.%s.grad_deltas", cs), rt, at, what);
            /* a clamped dw gets no gradient (row 1 of both cases) */
            assert_close(tget(g[1], 4 + 2), 0, 0, 0, "clamped dw", 1);
            kpl_tensor_release(an);
            kpl_tensor_release(dl);
        }
        kpl_pool_pop(pool);
    }
    kpl_ref_free(rf);
}

static void test_coder_by_hand(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = dtypes[f];
        /* point (5, 5) in box (2, 3, 10, 8): 3 left, 2 up, 5 right, 3 down;
         * point (12, 1) above box (2, 3, 14, 8): 10, -2, 2, 7 */
        kpl_tensor *pts = tensor(dt, 2, (int64_t[]){2, 2}, (double[]){5, 5, 12, 1});
        kpl_tensor *bx = tensor(dt, 2, (int64_t[]){2, 4}, (double[]){2, 3, 10, 8, 2, 3, 14, 8});
        kpl_tensor *e = NN(kpl_box_encode_ltrb(pts, bx));
        expect_values(e, (double[]){3, 2, 5, 3, 10, -2, 2, 7}, 8, 0, "ltrb encode");
        expect_values(NN(kpl_box_decode_ltrb(pts, e)), (double[]){2, 3, 10, 8, 2, 3, 14, 8}, 8, 0,
                      "ltrb round trip");
        /* deltas: the anchor itself codes as 0; a box shifted by half the
         * anchor and twice as wide as (0.5 wx, 0, ww log 2, 0) */
        kpl_box_coder c = {{10, 10, 5, 5}, 4.135166556742356};
        kpl_tensor *an = tensor(dt, 2, (int64_t[]){2, 4}, (double[]){0, 0, 10, 10, 0, 0, 10, 10});
        kpl_tensor *gt = tensor(dt, 2, (int64_t[]){2, 4}, (double[]){0, 0, 10, 10, 0, -0, 20, 10});
        double tol = dt == KPL_F64 ? 1e-15 : 1e-6;
        kpl_tensor *d = NN(kpl_box_encode_delta(gt, an, &c));
        expect_values(d, (double[]){0, 0, 0, 0, 5, 0, 5 * log(2.0), 0}, 8, tol, "delta encode");
        expect_values(NN(kpl_box_decode_delta(d, an, &c)), (double[]){0, 0, 10, 10, 0, 0, 20, 10},
                      8, 10 * tol, "delta round trip");
        /* the default coder (weights 1); a huge dw is clamped at log(1000 / 16): width 625 */
        kpl_tensor *big = tensor(dt, 2, (int64_t[]){1, 4}, (double[]){0, 0, 50, 0});
        expect_values(NN(kpl_box_decode_delta(big, tensor(dt, 2, (int64_t[]){1, 4},
                                                          (double[]){0, 0, 10, 10}), NULL)),
                      (double[]){5 - 312.5, 0, 5 + 312.5, 10}, 4, 1e4 * tol, "clamped dw");
    }
    kpl_pool_pop(pool);
}

static kpl_tensor *f_ltrb_decode(kpl_tensor *const *in, void *u)
{
    (void)u;
    return kpl_box_decode_ltrb(in[0], in[1]);
}
static kpl_tensor *f_ltrb_encode(kpl_tensor *const *in, void *u)
{
    (void)u;
    return kpl_box_encode_ltrb(in[0], in[1]);
}
static kpl_tensor *f_delta_decode(kpl_tensor *const *in, void *u)
{
    return kpl_box_decode_delta(in[0], in[1], u);
}
static kpl_tensor *f_delta_encode(kpl_tensor *const *in, void *u)
{
    return kpl_box_encode_delta(in[0], in[1], u);
}

static void test_coder_gradcheck(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    kpl_tensor *pts = param(KPL_F64, 2, (int64_t[]){3, 2}, (double[]){1, 2, 7.5, 3, -2, 9});
    kpl_tensor *b = param(KPL_F64, 2, (int64_t[]){3, 4},
                          (double[]){0, 0, 4, 5, 2, 2.5, 9, 6, 1, 1, 3, 12});
    kpl_tensor *a = param(KPL_F64, 2, (int64_t[]){3, 4},
                          (double[]){0.5, 0, 5, 4, 3, 2, 8, 7.5, -1, 3, 2, 10});
    kpl_tensor *d = param(KPL_F64, 2, (int64_t[]){3, 4},
                          (double[]){0.3, -0.2, 0.1, 0.4, -1, 2, -0.5, 0.2, 0.05, 0.5, 1, -1});
    kpl_box_coder c = {{10, 10, 5, 5}, 4.135166556742356};
    struct {
        const char *what;
        kpl_gradcheck_fn fn;
        void *user;
        kpl_tensor *in[2];
    } fs[] = {
        {"ltrb decode", f_ltrb_decode, NULL, {pts, b}},
        {"ltrb encode", f_ltrb_encode, NULL, {pts, b}},
        {"delta decode", f_delta_decode, &c, {d, a}},
        {"delta encode", f_delta_encode, &c, {b, a}},
    };
    for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++)
        for (int order = 1; order <= 2; order++)
            if (kpl_gradcheck(fs[i].fn, fs[i].user, 2, fs[i].in, order, 1e-6, 1e-6, 1e-5) !=
                KPL_OK)
                fail_msg("%s, order %d: %s", fs[i].what, order, kpl_last_error());
    kpl_pool_pop(pool);
    kpl_tensor_release(pts);
    kpl_tensor_release(b);
    kpl_tensor_release(a);
    kpl_tensor_release(d);
}

static kpl_status st_of(kpl_tensor *t) { return t ? KPL_OK : kpl_last_status(); }

static void test_coder_errors(void **state)
{
    (void)state;
    kpl_pool *pool = NN(kpl_pool_push());
    double v[12] = {0, 0, 2, 2, 1, 1, 3, 4, 2, 2, 5, 5};
    kpl_tensor *b = tensor(KPL_F32, 2, (int64_t[]){3, 4}, v), *p = tensor(KPL_F32, 2,
                                                                          (int64_t[]){3, 2}, v);
    FAILS(st_of(kpl_box_encode_ltrb(tensor(KPL_F32, 2, (int64_t[]){2, 2}, v), b)), KPL_ESHAPE,
          "box_encode_ltrb: 'points' has shape (2,2); expected (3, 2), a row per row of 'boxes' "
          "(3,4)");
    FAILS(st_of(kpl_box_decode_ltrb(p, tensor(KPL_F32, 2, (int64_t[]){4, 3}, v))), KPL_ESHAPE,
          "box_decode_ltrb: 'ltrb' has shape (4,3); expected (N, 4)");
    FAILS(st_of(kpl_box_encode_ltrb(tensor(KPL_F64, 2, (int64_t[]){3, 2}, v), b)), KPL_EDTYPE,
          "box_encode_ltrb: 'points' has dtype f64 and 'boxes' f32; both f32 or both f64");
    double inv[12];
    memcpy(inv, v, sizeof inv);
    inv[6] = 0; /* row 1: x1 = 0 < x0 = 1 */
    FAILS(st_of(kpl_box_encode_ltrb(p, tensor(KPL_F32, 2, (int64_t[]){3, 4}, inv))), KPL_EINVAL,
          "box_encode_ltrb: 'boxes' row 1 (1, 1, 0, 4) is not a box (x0, y0, x1, y1): x1 < x0");
    inv[6] = 1; /* now a box without width: fine for IoU, not for the delta coder */
    kpl_tensor *flat = tensor(KPL_F32, 2, (int64_t[]){3, 4}, inv);
    FAILS(st_of(kpl_box_encode_delta(b, flat, NULL)), KPL_EINVAL,
          "box_encode_delta: 'anchors' row 1 (1, 1, 1, 4) has no width");
    FAILS(st_of(kpl_box_encode_delta(flat, b, NULL)), KPL_EINVAL,
          "box_encode_delta: 'boxes' row 1 (1, 1, 1, 4) has no width");
    inv[5] = NAN;
    FAILS(st_of(kpl_box_decode_delta(b, tensor(KPL_F32, 2, (int64_t[]){3, 4}, inv), NULL)),
          KPL_EINVAL, "box_decode_delta: 'anchors' row 1 (1, nan, 1, 4) is not a box");
    kpl_box_coder c = KPL_BOX_CODER_INIT;
    c.weights[2] = 0;
    FAILS(st_of(kpl_box_decode_delta(b, b, &c)), KPL_EINVAL,
          "box_decode_delta: coder weight 2 is 0; weights are finite and positive");
    c.weights[2] = 1, c.clip = NAN;
    FAILS(st_of(kpl_box_encode_delta(b, b, &c)), KPL_EINVAL,
          "box_encode_delta: the coder's clip is NaN");
    FAILS(st_of(kpl_box_decode_delta(b, tensor(KPL_F32, 2, (int64_t[]){2, 4}, v), NULL)),
          KPL_ESHAPE, "box_decode_delta: 'deltas' has shape (3,4); expected (2, 4)");
    kpl_pool_pop(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roi_align_reference), cmocka_unit_test(test_roi_align_by_hand),
        cmocka_unit_test(test_roi_align_gradcheck), cmocka_unit_test(test_roi_align_errors),
        cmocka_unit_test(test_focal_reference),     cmocka_unit_test(test_focal_by_hand),
        cmocka_unit_test(test_focal_gradcheck),     cmocka_unit_test(test_focal_errors),
        cmocka_unit_test(test_focal_fused_gradcheck), cmocka_unit_test(test_focal_fused_vs_composed),
        cmocka_unit_test(test_coder_reference),     cmocka_unit_test(test_coder_by_hand),
        cmocka_unit_test(test_coder_gradcheck),     cmocka_unit_test(test_coder_errors),
    };
    return cmocka_run_group_tests_name("detops", tests, NULL, NULL);
}
