/*
 * ops_norm.c — the front end of batch normalisation with the batch
 * statistics: kpl_k_batch_norm and its gradient, and their fused ReLU
 * forms (the CPU's; graph/ composes the two ops where a device has none).
 * x is viewed as (N, C, H*W...); f16/bf16 activations keep f32 statistics.
 */
#include "ops_impl.h"

/* x (N, C, ...), whose dtype the others follow. */
#define BN_INPUT .min_rank = 2, .shape_is = "expected (N, C, ...)", .dtypes = KPL_DT_FLOAT, \
            .dtypes_are = "f32 and f64 are supported, or f16 and bf16 with f32 statistics"

/* kpl_k_batch_norm(y, mean, var, x, gamma, beta) and its ReLU form */
enum { BN_X, BN_Y, BN_GAMMA, BN_BETA, BN_MEAN, BN_VAR };
static const kpl_op_spec bn_fwd_spec = {{
    [BN_X] = {"x", BN_INPUT},
    [BN_Y] = {"y", .device = KPL_AS(BN_X), .dtype = KPL_AS(BN_X), .shape = KPL_AS(BN_X),
              .in_place = KPL_ARGSET(BN_X)},
    [BN_GAMMA] = {"gamma", .device = KPL_AS(BN_X)},
    [BN_BETA] = {"beta", .device = KPL_AS(BN_X)},
    [BN_MEAN] = {"mean", .optional = true, .device = KPL_AS(BN_X)},
    [BN_VAR] = {"var", .optional = true, .device = KPL_AS(BN_X)},
}};
/* kpl_k_batch_norm_bwd(gx, ggamma, gbeta, x, gy, gamma) and its ReLU form,
 * which also reads the forward's output y */
enum { BNB_X, BNB_GY, BNB_Y, BNB_GAMMA, BNB_GX, BNB_GGAMMA, BNB_GBETA };
static const kpl_op_spec bn_bwd_spec = {{
    [BNB_X] = {"x", BN_INPUT},
    [BNB_GY] = {"gy", .device = KPL_AS(BNB_X), .dtype = KPL_AS(BNB_X), .shape = KPL_AS(BNB_X)},
    [BNB_Y] = {"y", .optional = true, .device = KPL_AS(BNB_X), .dtype = KPL_AS(BNB_X),
               .shape = KPL_AS(BNB_X)},
    [BNB_GAMMA] = {"gamma", .device = KPL_AS(BNB_X)},
    [BNB_GX] = {"gx", .optional = true, .device = KPL_AS(BNB_X), .dtype = KPL_AS(BNB_X),
                .shape = KPL_AS(BNB_X), .disjoint = KPL_ARGSET(BNB_X),
                .in_place = KPL_ARGSET(BNB_GY) | KPL_ARGSET(BNB_Y)},
    [BNB_GGAMMA] = {"ggamma", .optional = true, .device = KPL_AS(BNB_X)},
    [BNB_GBETA] = {"gbeta", .optional = true, .device = KPL_AS(BNB_X)},
}};

/* A per-channel vector (C), when given, of x's dtype, or f32 for f16/bf16
 * activations (the statistics of the mixed-precision form). */
static kpl_status bn_vec(const char *op, const kpl_tensor *t, const char *name,
                         const kpl_tensor *x)
{
    if (!t) return KPL_OK;
    KPL_TRY(want_dtype(op, t, name, is_half(x->dtype) ? KPL_F32 : x->dtype));
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(t->ndim == 1 && t->shape[0] == x->shape[1], KPL_ESHAPE,
              "%s: '%s' has shape %s, expected (%lld) for input %s", op, name, KPL_SHAPE(t, b1),
              (long long)x->shape[1], KPL_SHAPE(x, b2));
    return KPL_OK;
}

/* The geometry and eps, and that a batch has statistics. */
static kpl_status bn_common(const char *op, const kpl_tensor *x, kpl_bn_attrs *a, double eps)
{
    KPL_CHECK(eps >= 0, KPL_EINVAL, "%s: eps %g must not be negative", op, eps);
    KPL_CHECK(x->numel > 0 || x->shape[1] == 0, KPL_ESHAPE,
              "%s: an empty batch has no statistics", op);
    a->n = x->shape[0];
    a->c = x->shape[1];
    a->hw = 1;
    for (int d = 2; d < x->ndim; d++) a->hw *= x->shape[d];
    a->eps = eps;
    return KPL_OK;
}

static kpl_status bn_fwd(kpl_kop kop, const char *op, kpl_tensor *y, kpl_tensor *mean,
                         kpl_tensor *var, const kpl_tensor *x, const kpl_tensor *gamma,
                         const kpl_tensor *beta, double eps)
{
    KPL_TRY(kpl__ops_check(op, &bn_fwd_spec,
                           (const kpl_tensor *[]){x, y, gamma, beta, mean, var}));
    kpl_bn_attrs a = {.bwd = false, .relu = kop == KPL_KOP_BATCH_NORM_RELU, .mean = mean,
                      .var = var};
    KPL_TRY(bn_vec(op, gamma, "gamma", x));
    KPL_TRY(bn_vec(op, beta, "beta", x));
    KPL_TRY(bn_vec(op, mean, "mean", x));
    KPL_TRY(bn_vec(op, var, "var", x));
    KPL_TRY(bn_common(op, x, &a, eps));
    if (x->shape[1] == 0) return KPL_OK;
    return dispatch(kop, x->dtype, y, x, gamma, beta, &a);
}

kpl_status kpl_k_batch_norm(kpl_tensor *y, kpl_tensor *mean, kpl_tensor *var,
                            const kpl_tensor *x, const kpl_tensor *gamma,
                            const kpl_tensor *beta, double eps)
{
    return bn_fwd(KPL_KOP_BATCH_NORM, "batch_norm", y, mean, var, x, gamma, beta, eps);
}

kpl_status kpl_k_batch_norm_relu(kpl_tensor *y, kpl_tensor *mean, kpl_tensor *var,
                                 const kpl_tensor *x, const kpl_tensor *gamma,
                                 const kpl_tensor *beta, double eps)
{
    return bn_fwd(KPL_KOP_BATCH_NORM_RELU, "batch_norm_relu", y, mean, var, x, gamma, beta, eps);
}

static kpl_status bn_bwd(kpl_kop kop, const char *op, kpl_tensor *gx, kpl_tensor *ggamma,
                         kpl_tensor *gbeta, const kpl_tensor *x, const kpl_tensor *relu_y,
                         const kpl_tensor *gy, const kpl_tensor *gamma, double eps)
{
    bool relu = kop == KPL_KOP_BATCH_NORM_RELU;
    KPL_TRY(kpl__ops_check(op, &bn_bwd_spec,
                           (const kpl_tensor *[]){x, gy, relu_y, gamma, gx, ggamma, gbeta}));
    KPL_CHECK(gx || ggamma || gbeta, KPL_EINVAL, "%s: no gradient asked for", op);
    if (relu) CHECK_ARG(op, relu_y, "y");
    kpl_bn_attrs a = {.bwd = true, .relu = relu, .relu_y = relu_y, .gx = gx,
                      .ggamma = ggamma, .gbeta = gbeta};
    KPL_TRY(bn_vec(op, gamma, "gamma", x));
    KPL_TRY(bn_vec(op, ggamma, "ggamma", x));
    KPL_TRY(bn_vec(op, gbeta, "gbeta", x));
    KPL_TRY(bn_common(op, x, &a, eps));
    if (x->shape[1] == 0) return KPL_OK;
    /* The outputs travel in the attributes; `out` only selects the device. */
    kpl_tensor *dev_of = gx ? gx : ggamma ? ggamma : gbeta;
    return dispatch(kop, x->dtype, dev_of, x, gy, gamma, &a);
}

kpl_status kpl_k_batch_norm_bwd(kpl_tensor *gx, kpl_tensor *ggamma, kpl_tensor *gbeta,
                                const kpl_tensor *x, const kpl_tensor *gy,
                                const kpl_tensor *gamma, double eps)
{
    return bn_bwd(KPL_KOP_BATCH_NORM, "batch_norm_bwd", gx, ggamma, gbeta, x, NULL, gy, gamma,
                  eps);
}

kpl_status kpl_k_batch_norm_relu_bwd(kpl_tensor *gx, kpl_tensor *ggamma, kpl_tensor *gbeta,
                                     const kpl_tensor *x, const kpl_tensor *y,
                                     const kpl_tensor *gy, const kpl_tensor *gamma, double eps)
{
    return bn_bwd(KPL_KOP_BATCH_NORM_RELU, "batch_norm_relu_bwd", gx, ggamma, gbeta, x, y, gy,
                  gamma, eps);
}

/* ---- group norm ------------------------------------------------------------------ */

/* kpl_k_group_norm(y, x, gamma, beta) and kpl_k_group_norm_bwd(gx, ggamma,
 * gbeta, x, gy, gamma): x (N, C, ...) and its per-channel vectors (C). */
enum { GN_X, GN_Y, GN_GAMMA, GN_BETA };
#define GN_INPUT .min_rank = 2, .shape_is = "expected (N, C, ...)", .dtypes = KPL_DT_F32_F64
static const kpl_op_spec gn_fwd_spec = {{
    [GN_X] = {"x", GN_INPUT},
    [GN_Y] = {"y", .device = KPL_AS(GN_X), .dtype = KPL_AS(GN_X), .shape = KPL_AS(GN_X),
              .disjoint = KPL_ARGSET(GN_X)},
    [GN_GAMMA] = {"gamma", .rank = 1, .shape_is = "expected (C)", .device = KPL_AS(GN_X),
                  .dtype = KPL_AS(GN_X)},
    [GN_BETA] = {"beta", .rank = 1, .shape_is = "expected (C)", .device = KPL_AS(GN_X),
                 .dtype = KPL_AS(GN_X)},
}};
enum { GNB_X, GNB_GY, GNB_GAMMA, GNB_GX, GNB_GGAMMA, GNB_GBETA };
static const kpl_op_spec gn_bwd_spec = {{
    [GNB_X] = {"x", GN_INPUT},
    [GNB_GY] = {"gy", .device = KPL_AS(GNB_X), .dtype = KPL_AS(GNB_X), .shape = KPL_AS(GNB_X)},
    [GNB_GAMMA] = {"gamma", .rank = 1, .shape_is = "expected (C)", .device = KPL_AS(GNB_X),
                   .dtype = KPL_AS(GNB_X)},
    [GNB_GX] = {"gx", .device = KPL_AS(GNB_X), .dtype = KPL_AS(GNB_X), .shape = KPL_AS(GNB_X),
                .disjoint = KPL_ARGSET(GNB_X) | KPL_ARGSET(GNB_GY)},
    [GNB_GGAMMA] = {"ggamma", .optional = true, .device = KPL_AS(GNB_X), .dtype = KPL_AS(GNB_X),
                    .shape = KPL_AS(GNB_GAMMA)},
    [GNB_GBETA] = {"gbeta", .optional = true, .device = KPL_AS(GNB_X), .dtype = KPL_AS(GNB_X),
                   .shape = KPL_AS(GNB_GAMMA)},
}};

/* The channels split into the groups, the vectors one per channel, eps. */
static kpl_status gn_common(const char *op, const kpl_tensor *x, const kpl_tensor *gamma,
                            int groups, double eps, kpl_gn_attrs *a)
{
    char b1[KPL_SHAPE_BUF];
    KPL_CHECK(groups >= 1 && x->shape[1] % groups == 0, KPL_ESHAPE,
              "%s: %lld channels of x %s do not divide into %d groups", op,
              (long long)x->shape[1], KPL_SHAPE(x, b1), groups);
    KPL_CHECK(gamma->shape[0] == x->shape[1], KPL_ESHAPE,
              "%s: 'gamma' has %lld values for %lld channels", op, (long long)gamma->shape[0],
              (long long)x->shape[1]);
    KPL_CHECK(eps >= 0, KPL_EINVAL, "%s: eps %g must not be negative", op, eps);
    *a = (kpl_gn_attrs){.n = x->shape[0], .c = x->shape[1], .hw = 1, .groups = groups,
                        .eps = eps};
    for (int d = 2; d < x->ndim; d++) a->hw *= x->shape[d];
    return KPL_OK;
}

kpl_status kpl_k_group_norm(kpl_tensor *y, const kpl_tensor *x, const kpl_tensor *gamma,
                            const kpl_tensor *beta, int groups, double eps)
{
    const char *op = "group_norm";
    KPL_TRY(kpl__ops_check(op, &gn_fwd_spec, (const kpl_tensor *[]){x, y, gamma, beta}));
    kpl_gn_attrs a;
    KPL_TRY(gn_common(op, x, gamma, groups, eps, &a));
    KPL_CHECK(beta->shape[0] == x->shape[1], KPL_ESHAPE,
              "%s: 'beta' has %lld values for %lld channels", op, (long long)beta->shape[0],
              (long long)x->shape[1]);
    if (x->numel == 0) return KPL_OK;
    return dispatch(KPL_KOP_GROUP_NORM, x->dtype, y, x, gamma, beta, &a);
}

kpl_status kpl_k_group_norm_bwd(kpl_tensor *gx, kpl_tensor *ggamma, kpl_tensor *gbeta,
                                const kpl_tensor *x, const kpl_tensor *gy,
                                const kpl_tensor *gamma, int groups, double eps)
{
    const char *op = "group_norm_bwd";
    KPL_TRY(kpl__ops_check(op, &gn_bwd_spec,
                           (const kpl_tensor *[]){x, gy, gamma, gx, ggamma, gbeta}));
    kpl_gn_attrs a;
    KPL_TRY(gn_common(op, x, gamma, groups, eps, &a));
    a.bwd = true, a.ggamma = ggamma, a.gbeta = gbeta;
    if (x->numel == 0) {
        if (ggamma) KPL_TRY(kpl_k_fill(ggamma, 0));
        return gbeta ? kpl_k_fill(gbeta, 0) : KPL_OK;
    }
    return dispatch(KPL_KOP_GROUP_NORM, x->dtype, gx, x, gy, gamma, &a);
}
