/*
 * ops_conv.c — the front end of the convolutions (kpl_k_conv2d, its fused
 * ReLU form and its two adjoints) and of pooling (max and average pooling,
 * their adjoints, and the plane gather/scatter of max pooling's indices),
 * with kpl_shape_conv2d and kpl_shape_pool2d, and of bilinear resizing,
 * which the pooling kernels run as one more plane-to-plane kind.  Half precision goes through
 * ops_matmul.c's chooser for the convolutions, through f32 for pooling
 * where a device has no half kernel.
 */
#include "ops_impl.h"

/* A 4-D operand: its dims in the message when it is not. */
#define NCHW .rank = 4, .shape_is = "expected (N, C, H, W)"
#define NOHW .rank = 4, .shape_is = "expected (N, O, OH, OW)"
#define OCKK .rank = 4, .shape_is = "expected (O, C / groups, KH, KW)"

/* ---- conv2d -------------------------------------------------------------------- */

kpl_status kpl_shape_conv2d(const int64_t *x, const int64_t *w, const kpl_conv2d_params *p,
                            int64_t *out)
{
    /* The shapes are worded only for a message: every conv call passes here. */
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(p != NULL, KPL_EINVAL, "conv2d: NULL params");
    KPL_CHECK(p->groups >= 1 && p->stride[0] >= 1 && p->stride[1] >= 1 && p->dilation[0] >= 1 &&
                  p->dilation[1] >= 1 && p->padding[0] >= 0 && p->padding[1] >= 0,
              KPL_EINVAL,
              "conv2d: stride (%d,%d) and dilation (%d,%d) must be >= 1, padding (%d,%d) >= 0, "
              "groups %d >= 1",
              p->stride[0], p->stride[1], p->dilation[0], p->dilation[1], p->padding[0],
              p->padding[1], p->groups);
    KPL_CHECK(x[1] % p->groups == 0 && w[0] % p->groups == 0, KPL_ESHAPE,
              "conv2d: %lld input channels and %lld filters must both divide into %d groups "
              "(input %s, weights %s)",
              (long long)x[1], (long long)w[0], p->groups, kpl_shape_str(4, x, b1, sizeof b1),
              kpl_shape_str(4, w, b2, sizeof b2));
    KPL_CHECK(w[1] * p->groups == x[1], KPL_ESHAPE,
              "conv2d: input %s has %lld channels but weights %s expect %lld (x %d groups)",
              kpl_shape_str(4, x, b1, sizeof b1), (long long)x[1],
              kpl_shape_str(4, w, b2, sizeof b2), (long long)(w[1] * p->groups), p->groups);
    int64_t ekh = (w[2] - 1) * p->dilation[0] + 1, ekw = (w[3] - 1) * p->dilation[1] + 1;
    int64_t ph = x[2] + 2 * p->padding[0], pw = x[3] + 2 * p->padding[1];
    KPL_CHECK(ekh <= ph && ekw <= pw && w[2] > 0 && w[3] > 0, KPL_ESHAPE,
              "conv2d: kernel %lldx%lld (dilated %lldx%lld) is larger than the padded input "
              "%lldx%lld (input %s, weights %s)",
              (long long)w[2], (long long)w[3], (long long)ekh, (long long)ekw, (long long)ph,
              (long long)pw, kpl_shape_str(4, x, b1, sizeof b1),
              kpl_shape_str(4, w, b2, sizeof b2));
    out[0] = x[0];
    out[1] = w[0];
    out[2] = (ph - ekh) / p->stride[0] + 1;
    out[3] = (pw - ekw) / p->stride[1] + 1;
    return KPL_OK;
}

/* kpl_k_conv2d(out, x, w, b) and kpl_k_conv2d_relu */
enum { CONV_X, CONV_W, CONV_OUT, CONV_B };
static const kpl_op_spec conv_fwd_spec = {{
    [CONV_X] = {"x", NCHW, .dtypes = KPL_DT_FLOAT},
    [CONV_W] = {"w", OCKK, .device = KPL_AS(CONV_X), .dtype = KPL_AS(CONV_X)},
    [CONV_OUT] = {"out", NOHW, .device = KPL_AS(CONV_X), .dtype = KPL_AS(CONV_X),
                  .disjoint = KPL_ARGSET(CONV_X)},
    [CONV_B] = {"b", .optional = true, .device = KPL_AS(CONV_X), .dtype = KPL_AS(CONV_X)},
}};
/* kpl_k_conv2d_bwd_data(gx, gy, w) */
enum { CBD_GY, CBD_W, CBD_GX };
static const kpl_op_spec conv_bwd_data_spec = {{
    [CBD_GY] = {"gy", NOHW, .dtypes = KPL_DT_FLOAT},
    [CBD_W] = {"w", OCKK, .device = KPL_AS(CBD_GY), .dtype = KPL_AS(CBD_GY)},
    [CBD_GX] = {"gx", NCHW, .device = KPL_AS(CBD_GY), .dtype = KPL_AS(CBD_GY),
                .disjoint = KPL_ARGSET(CBD_GY)},
}};
/* kpl_k_conv2d_bwd_weight(gw, gb, x, gy) */
enum { CBW_X, CBW_GY, CBW_GW, CBW_GB };
static const kpl_op_spec conv_bwd_weight_spec = {{
    [CBW_X] = {"x", NCHW, .dtypes = KPL_DT_FLOAT},
    [CBW_GY] = {"gy", NOHW, .device = KPL_AS(CBW_X), .dtype = KPL_AS(CBW_X)},
    [CBW_GW] = {"gw", OCKK, .device = KPL_AS(CBW_X), .dtype = KPL_AS(CBW_X)},
    [CBW_GB] = {"gb", .optional = true, .device = KPL_AS(CBW_X), .dtype = KPL_AS(CBW_X)},
}};

/* What code checks of a convolution once its operands passed their spec:
 * the input `in`, the weights `wt` and params give the output plane y
 * (kpl_shape_conv2d), which `res` must have; a bias (or its gradient, may
 * be NULL) has one value per filter. */
static kpl_status conv_check(const char *op, const kpl_tensor *in, const kpl_tensor *wt,
                             const kpl_tensor *res, const char *res_name,
                             const kpl_tensor *bias, const char *bias_name,
                             const kpl_conv2d_params *p, int64_t *y)
{
    KPL_TRY(kpl_shape_conv2d(in->shape, wt->shape, p, y));
    KPL_TRY(same_shape(op, res, res_name, 4, y));
    if (!bias) return KPL_OK;
    char bb[KPL_SHAPE_BUF];
    KPL_CHECK(bias->ndim == 1 && bias->shape[0] == wt->shape[0], KPL_ESHAPE,
              "%s: %s %s must have one value per filter (%lld)", op, bias_name,
              KPL_SHAPE(bias, bb), (long long)wt->shape[0]);
    return KPL_OK;
}

static void conv_fill(kpl_conv_attrs *a, kpl_conv_kind kind, const int64_t *x, const int64_t *w,
                      const int64_t *y, const kpl_conv2d_params *p)
{
    a->kind = kind;
    a->n = x[0], a->c = x[1], a->h = x[2], a->w = x[3];
    a->o = w[0], a->kh = w[2], a->kw = w[3];
    a->oh = y[2], a->ow = y[3];
    a->p = *p;
    a->relu = false;
    a->acc = false;
}

/* A convolution's kernel: half precision through the GEMM chooser. */
static kpl_status conv_run(kpl_dtype dt, kpl_tensor *out, const kpl_tensor *i0,
                           const kpl_tensor *i1, const kpl_tensor *i2, const kpl_conv_attrs *a)
{
    kpl_kop kop = a->acc ? KPL_KOP_CONV2D_ACC : a->relu ? KPL_KOP_CONV2D_RELU : KPL_KOP_CONV2D;
    if (!is_half(dt) || a->acc) return dispatch(kop, dt, out, i0, i1, i2, a);
    return kpl__ops_half_gemm(kop, a->relu ? "conv2d_relu" : "conv2d", dt, out, i0, i1, i2,
                              a->kind == KPL_CONV_BWD_WEIGHT, a);
}

static kpl_status conv_fwd(const char *op, bool relu, bool acc, kpl_tensor *out,
                           const kpl_tensor *x, const kpl_tensor *w, const kpl_tensor *b,
                           const kpl_conv2d_params *p)
{
    int64_t y[4];
    KPL_TRY(kpl__ops_check(op, &conv_fwd_spec, (const kpl_tensor *[]){x, w, out, b}));
    KPL_TRY(conv_check(op, x, w, out, "out", b, "bias", p, y));
    if (out->numel == 0) return KPL_OK;
    kpl_conv_attrs a;
    conv_fill(&a, KPL_CONV_FWD, x->shape, w->shape, y, p);
    a.relu = relu;
    a.acc = acc;
    return conv_run(x->dtype, out, x, w, b, &a);
}

kpl_status kpl_k_conv2d(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *w,
                        const kpl_tensor *b, const kpl_conv2d_params *p)
{
    return conv_fwd("conv2d", false, false, out, x, w, b, p);
}

kpl_status kpl_k_conv2d_relu(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *w,
                             const kpl_tensor *b, const kpl_conv2d_params *p)
{
    return conv_fwd("conv2d_relu", true, false, out, x, w, b, p);
}

kpl_status kpl_k_conv2d_acc(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *w,
                            const kpl_tensor *b, const kpl_conv2d_params *p, bool relu)
{
    return conv_fwd("conv2d_acc", relu, true, out, x, w, b, p);
}

kpl_status kpl_k_conv2d_bwd_data(kpl_tensor *gx, const kpl_tensor *gy, const kpl_tensor *w,
                                 const kpl_conv2d_params *p)
{
    const char *op = "conv2d_bwd_data";
    int64_t y[4];
    KPL_TRY(kpl__ops_check(op, &conv_bwd_data_spec, (const kpl_tensor *[]){gy, w, gx}));
    KPL_TRY(conv_check(op, gx, w, gy, "gy", NULL, NULL, p, y));
    if (gx->numel == 0) return KPL_OK;
    kpl_conv_attrs a;
    conv_fill(&a, KPL_CONV_BWD_DATA, gx->shape, w->shape, y, p);
    return conv_run(gx->dtype, gx, gy, w, NULL, &a);
}

kpl_status kpl_k_conv2d_bwd_weight(kpl_tensor *gw, kpl_tensor *gb, const kpl_tensor *x,
                                   const kpl_tensor *gy, const kpl_conv2d_params *p)
{
    const char *op = "conv2d_bwd_weight";
    int64_t y[4];
    KPL_TRY(kpl__ops_check(op, &conv_bwd_weight_spec, (const kpl_tensor *[]){x, gy, gw, gb}));
    KPL_TRY(conv_check(op, x, gw, gy, "gy", gb, "bias gradient", p, y));
    if (gw->numel == 0) return KPL_OK;
    kpl_conv_attrs a;
    conv_fill(&a, KPL_CONV_BWD_WEIGHT, x->shape, gw->shape, y, p);
    return conv_run(gw->dtype, gw, x, gy, gb, &a);
}

/* ---- pooling ------------------------------------------------------------------- */

kpl_status kpl_shape_pool2d(const int64_t *x, const kpl_pool2d_params *p, int64_t *out)
{
    char b[KPL_SHAPE_BUF]; /* worded only for a message */
    KPL_CHECK(p != NULL, KPL_EINVAL, "pool2d: NULL params");
    for (int d = 0; d < 2; d++) {
        KPL_CHECK(p->kernel[d] >= 1 && p->stride[d] >= 1 && p->padding[d] >= 0, KPL_EINVAL,
                  "pool2d: kernel (%d,%d) and stride (%d,%d) must be >= 1, padding (%d,%d) >= 0",
                  p->kernel[0], p->kernel[1], p->stride[0], p->stride[1], p->padding[0],
                  p->padding[1]);
        KPL_CHECK(2 * p->padding[d] <= p->kernel[d], KPL_EINVAL,
                  "pool2d: padding %d is more than half the window %d", p->padding[d],
                  p->kernel[d]);
        KPL_CHECK(p->kernel[d] <= x[2 + d] + 2 * p->padding[d], KPL_ESHAPE,
                  "pool2d: window %dx%d is larger than the padded input of %s", p->kernel[0],
                  p->kernel[1], kpl_shape_str(4, x, b, sizeof b));
        int64_t span = x[2 + d] + 2 * p->padding[d] - p->kernel[d];
        out[2 + d] = (p->ceil_mode ? (span + p->stride[d] - 1) : span) / p->stride[d] + 1;
        /* the last window must start inside the input or its left padding */
        if (p->ceil_mode && (out[2 + d] - 1) * p->stride[d] >= x[2 + d] + p->padding[d])
            out[2 + d]--;
    }
    out[0] = x[0];
    out[1] = x[1];
    return KPL_OK;
}

/* kpl_k_max_pool2d(out, idx, x) */
enum { MAXP_X, MAXP_OUT, MAXP_IDX };
static const kpl_op_spec max_pool_spec = {{
    [MAXP_X] = {"x", NCHW, .dtypes = KPL_DT_FLOAT},
    [MAXP_OUT] = {"out", .device = KPL_AS(MAXP_X), .dtype = KPL_AS(MAXP_X)},
    [MAXP_IDX] = {"idx", .optional = true, NCHW, .dtypes = KPL_DT(KPL_I64),
                  .device = KPL_AS(MAXP_X)},
}};
/* kpl_k_plane_gather(out, x, idx) */
enum { PG_X, PG_IDX, PG_OUT };
static const kpl_op_spec plane_gather_spec = {{
    [PG_X] = {"x", NCHW, .dtypes = KPL_DT_FLOAT},
    [PG_IDX] = {"idx", NCHW, .dtypes = KPL_DT(KPL_I64), .device = KPL_AS(PG_X)},
    [PG_OUT] = {"out", .device = KPL_AS(PG_X), .dtype = KPL_AS(PG_X)},
}};
/* kpl_k_plane_scatter(gx, gy, idx) */
enum { PS_GX, PS_GY, PS_IDX };
static const kpl_op_spec plane_scatter_spec = {{
    [PS_GX] = {"gx", NCHW, .dtypes = KPL_DT_FLOAT},
    [PS_GY] = {"gy", .device = KPL_AS(PS_GX), .dtype = KPL_AS(PS_GX)},
    [PS_IDX] = {"idx", NCHW, .dtypes = KPL_DT(KPL_I64), .device = KPL_AS(PS_GX)},
}};
/* kpl_k_avg_pool2d(out, x) and kpl_k_avg_pool2d_bwd(gx, gy): an input of
 * 4 dims, the other tensor on its device with its dtype. */
enum { AVGP_IN, AVGP_OTHER };
static const kpl_op_spec avg_pool_spec = {{
    [AVGP_IN] = {"x", NCHW, .dtypes = KPL_DT_FLOAT},
    [AVGP_OTHER] = {"out", .device = KPL_AS(AVGP_IN), .dtype = KPL_AS(AVGP_IN)},
}};
static const kpl_op_spec avg_pool_bwd_spec = {{
    [AVGP_IN] = {"gx", NCHW, .dtypes = KPL_DT_FLOAT},
    [AVGP_OTHER] = {"gy", .device = KPL_AS(AVGP_IN), .dtype = KPL_AS(AVGP_IN)},
}};

/* kpl_k_upsample_bilinear(out, x) and its adjoint (gx, gy): the same
 * specs, any sizes of the planes, the same (N, C). */
static const kpl_op_spec bilinear_spec = {{
    [AVGP_IN] = {"x", NCHW, .dtypes = KPL_DT_FLOAT},
    [AVGP_OTHER] = {"out", NCHW, .device = KPL_AS(AVGP_IN), .dtype = KPL_AS(AVGP_IN)},
}};
static const kpl_op_spec bilinear_bwd_spec = {{
    [AVGP_IN] = {"gx", NCHW, .dtypes = KPL_DT_FLOAT},
    [AVGP_OTHER] = {"gy", NCHW, .device = KPL_AS(AVGP_IN), .dtype = KPL_AS(AVGP_IN)},
}};

static kpl_status pool_run(kpl_pool_kind kind, kpl_tensor *out, const kpl_tensor *in0,
                           const kpl_tensor *in1, const int64_t *plane, const int64_t *oplane,
                           const kpl_pool2d_params *p, bool align)
{
    kpl_pool_attrs a = {.kind = kind, .n = plane[0], .c = plane[1], .h = plane[2], .w = plane[3],
                        .oh = oplane[2], .ow = oplane[3]};
    if (p) a.p = *p;
    a.align_corners = align;
    if (out->numel == 0) return KPL_OK;
    kpl_dtype dt = KPL_POOL_KIND_BWD(kind) ? out->dtype : in0->dtype;
    if (is_half(dt) && !native_half(KPL_KOP_POOL2D, out, dt))
        /* idx (i64) passes as it is */
        return kpl__ops_via_f32(KPL_KOP_POOL2D, out, false, in0, in1, NULL, &a);
    return dispatch(KPL_KOP_POOL2D, dt, out, in0, in1, NULL, &a);
}

kpl_status kpl_k_max_pool2d(kpl_tensor *out, kpl_tensor *idx, const kpl_tensor *x,
                            const kpl_pool2d_params *p)
{
    const char *op = "max_pool2d";
    KPL_TRY(kpl__ops_check(op, &max_pool_spec, (const kpl_tensor *[]){x, out, idx}));
    int64_t ys[4];
    KPL_TRY(kpl_shape_pool2d(x->shape, p, ys));
    KPL_TRY(same_shape(op, out, "out", 4, ys));
    /* Only the CPU has a values-only kernel: elsewhere the indices go to a temporary. */
    if (!idx && x->storage->dev->type != KPL_DEVICE_CPU) {
        kpl_tensor *tmp = NULL;
        KPL_TRY(kpl_tensor_empty(x->storage->dev, KPL_I64, 4, ys, &tmp));
        kpl_status st = kpl_k_max_pool2d(out, tmp, x, p);
        kpl_tensor_release(tmp);
        return st;
    }
    if (idx) KPL_TRY(same_shape(op, idx, "idx", 4, ys));
    return pool_run(KPL_POOL_MAX, out, x, idx, x->shape, ys, p, false);
}

/* idx (N, C, ...) indexes planes of t (N, C, H, W): the same N and C. */
static kpl_status planes_match(const char *op, const kpl_tensor *idx, const kpl_tensor *t,
                               const char *what)
{
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(idx->shape[0] == t->shape[0] && idx->shape[1] == t->shape[1], KPL_ESHAPE,
              "%s: indices %s and %s %s differ in (N, C)", op, KPL_SHAPE(idx, b1), what,
              KPL_SHAPE(t, b2));
    return KPL_OK;
}

kpl_status kpl_k_plane_gather(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *idx)
{
    const char *op = "plane_gather";
    KPL_TRY(kpl__ops_check(op, &plane_gather_spec, (const kpl_tensor *[]){x, idx, out}));
    KPL_TRY(same_shape(op, out, "out", 4, idx->shape));
    KPL_TRY(planes_match(op, idx, x, "input"));
    return pool_run(KPL_POOL_GATHER, out, x, idx, x->shape, idx->shape, NULL, false);
}

kpl_status kpl_k_plane_scatter(kpl_tensor *gx, const kpl_tensor *gy, const kpl_tensor *idx)
{
    const char *op = "plane_scatter";
    KPL_TRY(kpl__ops_check(op, &plane_scatter_spec, (const kpl_tensor *[]){gx, gy, idx}));
    KPL_TRY(same_shape(op, gy, "gy", 4, idx->shape));
    KPL_TRY(planes_match(op, idx, gx, "gradient"));
    return pool_run(KPL_POOL_SCATTER, gx, gy, idx, gx->shape, idx->shape, NULL, false);
}

kpl_status kpl_k_avg_pool2d(kpl_tensor *out, const kpl_tensor *x, const kpl_pool2d_params *p)
{
    const char *op = "avg_pool2d";
    KPL_TRY(kpl__ops_check(op, &avg_pool_spec, (const kpl_tensor *[]){x, out}));
    int64_t ys[4];
    KPL_TRY(kpl_shape_pool2d(x->shape, p, ys));
    KPL_TRY(same_shape(op, out, "out", 4, ys));
    return pool_run(KPL_POOL_AVG, out, x, NULL, x->shape, ys, p, false);
}

kpl_status kpl_k_avg_pool2d_bwd(kpl_tensor *gx, const kpl_tensor *gy, const kpl_pool2d_params *p)
{
    const char *op = "avg_pool2d_bwd";
    KPL_TRY(kpl__ops_check(op, &avg_pool_bwd_spec, (const kpl_tensor *[]){gx, gy}));
    int64_t ys[4];
    KPL_TRY(kpl_shape_pool2d(gx->shape, p, ys));
    KPL_TRY(same_shape(op, gy, "gy", 4, ys));
    return pool_run(KPL_POOL_AVG_BWD, gx, gy, NULL, gx->shape, ys, p, false);
}

/* The planes of `a` and `b` (the input and output sides) share (N, C). */
static kpl_status same_planes(const char *op, const kpl_tensor *a, const char *an,
                              const kpl_tensor *b, const char *bn)
{
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(a->shape[0] == b->shape[0] && a->shape[1] == b->shape[1], KPL_ESHAPE,
              "%s: %s %s and %s %s differ in (N, C)", op, an, KPL_SHAPE(a, b1), bn,
              KPL_SHAPE(b, b2));
    KPL_CHECK(b->numel == 0 || (a->shape[2] > 0 && a->shape[3] > 0), KPL_ESHAPE,
              "%s: %s %s has an empty plane to read from", op, an, KPL_SHAPE(a, b1));
    return KPL_OK;
}

kpl_status kpl_k_upsample_bilinear(kpl_tensor *out, const kpl_tensor *x, bool align_corners)
{
    const char *op = "upsample_bilinear";
    KPL_TRY(kpl__ops_check(op, &bilinear_spec, (const kpl_tensor *[]){x, out}));
    KPL_TRY(same_planes(op, x, "x", out, "out"));
    return pool_run(KPL_POOL_BILINEAR, out, x, NULL, x->shape, out->shape, NULL, align_corners);
}

kpl_status kpl_k_upsample_bilinear_bwd(kpl_tensor *gx, const kpl_tensor *gy, bool align_corners)
{
    const char *op = "upsample_bilinear_bwd";
    KPL_TRY(kpl__ops_check(op, &bilinear_bwd_spec, (const kpl_tensor *[]){gx, gy}));
    KPL_TRY(same_planes(op, gx, "gx", gy, "gy"));
    return pool_run(KPL_POOL_BILINEAR_BWD, gx, gy, NULL, gx->shape, gy->shape, NULL,
                    align_corners);
}
