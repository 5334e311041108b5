/* test_detops.c — the detection ops of graph/vision.h beyond the box
 * metrics: ROI Align and the box coders (the sigmoid focal loss in
 * test_focal.c, the same executable), each
 * against PyTorch implementations of the papers' / torchvision's
 * definitions (numbers kept in data/, made by detops_ref.py), against
 * cases computed by hand, against finite differences (kpl_gradcheck, to
 * the second or third order), and through their error messages.
 *
 * Tolerances against the references (computed in f64 from the same
 * f32-representable inputs): f64 1e-10 relative, f32 1e-5 relative; both
 * with an absolute floor of 1e-12 (f64) or 1e-6 (f32) times the largest
 * reference value, for elements that are sums cancelling to near 0. */
#include "detops_test.h"

int run_focal_tests(void);

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
        cmocka_unit_test(test_coder_reference),     cmocka_unit_test(test_coder_by_hand),
        cmocka_unit_test(test_coder_gradcheck),     cmocka_unit_test(test_coder_errors),
    };
    int failed = cmocka_run_group_tests_name("detops", tests, NULL, NULL);
    failed += run_focal_tests();
    return failed ? 1 : 0;
}
