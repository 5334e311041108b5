/*
 * ops_reduce.c — the front end of the reductions (kpl_k_reduce: sum, mean,
 * max, min, argmax, argmin, var, logsumexp), with kpl_shape_reduce.  The
 * kernels see x as (outer, red, inner): the reduced dims, once size-1 dims
 * are ignored, must be one contiguous group; other layouts are reduced in
 * two passes or through a permuted copy here.
 */
#include "ops_impl.h"

#include <string.h>

static const char *const reduce_names[KPL_REDUCE_COUNT] = {
    [KPL_RED_SUM] = "sum",       [KPL_RED_MEAN] = "mean",
    [KPL_RED_MAX] = "max",       [KPL_RED_MIN] = "min",
    [KPL_RED_ARGMAX] = "argmax", [KPL_RED_ARGMIN] = "argmin",
    [KPL_RED_VAR] = "var",       [KPL_RED_LOGSUMEXP] = "logsumexp",
    [KPL_RED_SUMEXP_SUB_MAX] = "sumexp_sub_max",
};

const char *kpl_reduce_name(kpl_reduce_op op)
{
    return (unsigned)op < KPL_REDUCE_COUNT ? reduce_names[op] : "invalid-reduce";
}

/* Sets mask bit i for every reduced axis. */
static kpl_status reduce_mask(const char *op, int ndim, const int64_t *shape,
                              const int *axes, int naxes, unsigned *mask)
{
    *mask = 0;
    if (!axes || naxes == 0) {
        *mask = (1u << ndim) - 1;
        return KPL_OK;
    }
    char b[KPL_SHAPE_BUF];
    for (int i = 0; i < naxes; i++) {
        int a = axes[i] < 0 ? axes[i] + ndim : axes[i];
        KPL_CHECK(a >= 0 && a < ndim, KPL_ESHAPE, "%s: axis %d out of range for shape %s",
                  op, axes[i], kpl_shape_str(ndim, shape, b, sizeof b));
        KPL_CHECK(!(*mask & (1u << a)), KPL_ESHAPE, "%s: axis %d given twice", op, axes[i]);
        *mask |= 1u << a;
    }
    return KPL_OK;
}

kpl_status kpl_shape_reduce(const char *op, int ndim, const int64_t *shape,
                            const int *axes, int naxes, bool keepdim, int *nout,
                            int64_t *out)
{
    unsigned mask;
    KPL_TRY(reduce_mask(op, ndim, shape, axes, naxes, &mask));
    int n = 0;
    for (int i = 0; i < ndim; i++) {
        if (mask & (1u << i)) {
            if (keepdim) out[n++] = 1;
        } else {
            out[n++] = shape[i];
        }
    }
    *nout = n;
    return KPL_OK;
}

enum { RED_X, RED_OUT };
static const kpl_op_spec reduce_spec = {{
    [RED_X] = {.name = "x"},
    [RED_OUT] = {"out", .device = KPL_AS(RED_X), .disjoint = KPL_ARGSET(RED_X)},
}};

static bool is_arg(kpl_reduce_op op) { return op == KPL_RED_ARGMAX || op == KPL_RED_ARGMIN; }

/* The checks only code makes: the dtypes each reduction is defined for,
 * the axes, the result's shape and dtype. */
static kpl_status reduce_check(const char *name, kpl_tensor *out, kpl_reduce_op op,
                               const kpl_tensor *x, const int *axes, int naxes, bool keepdim)
{
    KPL_CHECK(naxes >= 0 && naxes <= KPL_MAX_DIMS, KPL_EINVAL, "%s: %d axes", name, naxes);
    bool arg = is_arg(op);
    kpl_dtype dt = x->dtype;
    bool int_ok = op == KPL_RED_SUM || op == KPL_RED_MAX || op == KPL_RED_MIN || arg;
    KPL_CHECK(kpl_dtype_is_float(dt) || ((dt == KPL_I32 || dt == KPL_I64) && int_ok) ||
                  ((dt == KPL_U8 || dt == KPL_BOOL) && (arg || op == KPL_RED_MAX ||
                                                         op == KPL_RED_MIN)),
              KPL_EDTYPE, "%s: not defined for dtype %s", name, kpl_dtype_name(dt));
    KPL_CHECK(!arg || naxes <= 1, KPL_EINVAL,
              "%s: takes one axis (or none for a flat index), got %d", name, naxes);
    int n;
    int64_t shape[KPL_MAX_DIMS];
    KPL_TRY(kpl_shape_reduce(name, x->ndim, x->shape, axes, naxes, keepdim, &n, shape));
    KPL_TRY(same_shape(name, out, "out", n, shape));
    return want_dtype(name, out, "out", arg ? KPL_I64 : dt);
}

/* Decomposable reductions over scattered dims: the last contiguous group
 * of reduced dims first (keeping them as 1s), then all the axes again,
 * which are now one group — (N, C, H, W) over (0, 2, 3) becomes (2, 3)
 * then (0), streaming reads instead of a permuted copy. */
static kpl_status reduce_in_two(kpl_tensor *out, kpl_reduce_op op, const kpl_tensor *x,
                                unsigned mask, int last, const int *axes, int naxes,
                                bool keepdim, int correction)
{
    int group[KPL_MAX_DIMS], ng = 0;
    int64_t tshape[KPL_MAX_DIMS];
    memcpy(tshape, x->shape, sizeof tshape);
    for (int i = last; i >= 0; i--) {
        if (x->shape[i] == 1) continue;
        if (!(mask & (1u << i))) break;
        group[ng++] = i;
        tshape[i] = 1;
    }
    kpl_tensor *tmp = NULL;
    KPL_TRY(kpl_tensor_empty(x->storage->dev, x->dtype, x->ndim, tshape, &tmp));
    kpl_status st = kpl_k_reduce(tmp, op, x, group, ng, true, correction);
    if (st >= 0) st = kpl_k_reduce(out, op, tmp, axes, naxes, keepdim, correction);
    kpl_tensor_release(tmp);
    return st;
}

kpl_status kpl_k_reduce(kpl_tensor *out, kpl_reduce_op op, const kpl_tensor *x,
                        const int *axes, int naxes, bool keepdim, int correction)
{
    KPL_CHECK((unsigned)op < KPL_REDUCE_COUNT, KPL_EINVAL, "reduce: unknown op %d", (int)op);
    const char *name = reduce_names[op];
    KPL_TRY(kpl__ops_check(name, &reduce_spec, (const kpl_tensor *[]){x, out}));
    KPL_TRY(reduce_check(name, out, op, x, axes, naxes, keepdim));
    unsigned mask;
    KPL_TRY(reduce_mask(name, x->ndim, x->shape, axes, naxes, &mask));
    int64_t red = 1;
    for (int i = 0; i < x->ndim; i++)
        if (mask & (1u << i)) red *= x->shape[i];
    if (out->numel == 0) return KPL_OK;
    KPL_CHECK(red > 0 || op == KPL_RED_SUM || op == KPL_RED_MEAN, KPL_ESHAPE,
              "%s: reduction over an empty dim has no identity (shape %s)", name,
              KPL_SHAPE(x, (char[KPL_SHAPE_BUF]){0}));
    if (op == KPL_RED_VAR)
        KPL_CHECK(correction >= 0, KPL_EINVAL, "var: negative correction %d", correction);

    /* Find (outer, red, inner): the reduced dims must be one contiguous
     * group once size-1 dims are ignored; otherwise move them last with a
     * permuted copy. */
    int first = -1, last = -1;
    bool contiguous = true;
    for (int i = 0; i < x->ndim; i++) {
        if (x->shape[i] == 1 || !(mask & (1u << i))) continue;
        if (first < 0) first = i;
        else if (last != i - 1) {
            for (int j = last + 1; j < i; j++)
                if (x->shape[j] != 1) contiguous = false;
        }
        last = i;
    }
    kpl_tensor *perm = NULL;
    const kpl_tensor *src = x;
    kpl_reduce_attrs attrs = {.op = op, .correction = correction, .red = red};
    if (first < 0) { /* nothing of size > 1 reduced */
        attrs.outer = x->numel;
        attrs.inner = 1;
        attrs.red = red; /* 1, or 0 for an empty reduced dim */
        if (red == 0) attrs.outer = out->numel;
    } else if (contiguous) {
        int64_t outer = 1, inner = 1;
        for (int i = 0; i < first; i++) outer *= x->shape[i];
        for (int i = last + 1; i < x->ndim; i++) inner *= x->shape[i];
        attrs.outer = outer;
        attrs.inner = inner;
    } else if (op == KPL_RED_SUM || op == KPL_RED_MEAN || op == KPL_RED_MAX ||
               op == KPL_RED_MIN) {
        return reduce_in_two(out, op, x, mask, last, axes, naxes, keepdim, correction);
    } else {
        int p[KPL_MAX_DIMS], k = 0;
        for (int i = 0; i < x->ndim; i++)
            if (!(mask & (1u << i))) p[k++] = i;
        for (int i = 0; i < x->ndim; i++)
            if (mask & (1u << i)) p[k++] = i;
        KPL_TRY(kpl_tensor_permute((kpl_tensor *)x, p, &perm));
        src = perm;
        attrs.outer = x->numel / red;
        attrs.inner = 1;
    }
    kpl_dtype dt = x->dtype;
    kpl_status st = is_half(dt)
                        ? kpl__ops_via_f32(KPL_KOP_REDUCE, out, is_arg(op), src, NULL, NULL, &attrs)
                        : dispatch(KPL_KOP_REDUCE, dt, out, src, NULL, NULL, &attrs);
    kpl_tensor_release(perm);
    return st;
}

/* ---- softmax cross entropy ------------------------------------------------------- */

/* kpl_k_softmax_xent(out, x, labels) and its backward (gx, x, labels, gy):
 * the logits (N, C, d1, ..., dk), the labels and the losses or their
 * gradient (N, d1, ..., dk). */
enum { XENT_X, XENT_LABELS, XENT_PER, XENT_GX };
#define XENT_X_SPEC                                                                           \
    [XENT_X] = {"x", .min_rank = 2, .shape_is = "expected (N, C) or (N, C, d1, ...)",         \
                .dtypes = KPL_DT_FLOAT},                                                      \
    [XENT_LABELS] = {"labels", .dtypes = KPL_DT(KPL_I64), .device = KPL_AS(XENT_X)}
static const kpl_op_spec xent_spec = {{
    XENT_X_SPEC,
    [XENT_PER] = {"out", .device = KPL_AS(XENT_X), .dtype = KPL_AS(XENT_X),
                  .shape = KPL_AS(XENT_LABELS), .disjoint = KPL_ARGSET(XENT_X)},
}};
static const kpl_op_spec xent_bwd_spec = {{
    XENT_X_SPEC,
    [XENT_PER] = {"gy", .device = KPL_AS(XENT_X), .dtype = KPL_AS(XENT_X),
                  .shape = KPL_AS(XENT_LABELS)},
    [XENT_GX] = {"gx", .device = KPL_AS(XENT_X), .dtype = KPL_AS(XENT_X), .shape = KPL_AS(XENT_X),
                 .disjoint = KPL_ARGSET(XENT_X) | KPL_ARGSET(XENT_PER)},
}};

/* What both directions check beyond the specs: labels (N, d1, ..., dk)
 * for x (N, C, d1, ..., dk), eps in [0, 1); fills the kernel's view. */
static kpl_status xent_common(const char *op, const kpl_tensor *x, const kpl_tensor *labels,
                              double eps, kpl_xent_attrs *a)
{
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    bool fit = labels->ndim == x->ndim - 1 && labels->shape[0] == x->shape[0];
    for (int d = 2; fit && d < x->ndim; d++) fit = labels->shape[d - 1] == x->shape[d];
    KPL_CHECK(fit, KPL_ESHAPE, "%s: labels %s do not fit x %s: expected (N, d1, ...) for (N, C, "
              "d1, ...)", op, KPL_SHAPE(labels, b1), KPL_SHAPE(x, b2));
    KPL_CHECK(eps >= 0 && eps < 1, KPL_EINVAL, "%s: label smoothing %g is outside [0, 1)", op,
              eps);
    KPL_CHECK(x->shape[1] > 0 || labels->numel == 0, KPL_ESHAPE,
              "%s: x %s has no classes", op, KPL_SHAPE(x, b1));
    *a = (kpl_xent_attrs){.n = x->shape[0], .c = x->shape[1],
                          .inner = x->shape[1] ? x->numel / (x->shape[0] * x->shape[1]) : 0,
                          .eps = eps};
    if (x->shape[0] == 0) a->inner = 0;
    return KPL_OK;
}

/* Runs the kernel (f16/bf16 through f32) and words its KPL_ERANGE. */
static kpl_status xent_run(const char *op, kpl_tensor *out, const kpl_tensor *x,
                           const kpl_tensor *labels, const kpl_tensor *gy, kpl_xent_attrs *a)
{
    int64_t bad[2] = {-1, 0};
    a->bad = bad;
    kpl_status st = is_half(x->dtype) && !native_half(KPL_KOP_XENT, out, x->dtype)
                        ? kpl__ops_via_f32(KPL_KOP_XENT, out, false, x, labels, gy, a)
                        : dispatch(KPL_KOP_XENT, x->dtype, out, x, labels, gy, a);
    if (st != KPL_ERANGE || bad[0] < 0) return st;
    int64_t pos[KPL_MAX_DIMS], f = bad[0];
    for (int d = labels->ndim - 1; d >= 0; d--) {
        pos[d] = f % labels->shape[d];
        f /= labels->shape[d];
    }
    char b1[KPL_SHAPE_BUF];
    return KPL_ERROR(KPL_ERANGE,
                     "%s: label %lld at position %s is outside [0, %lld) and is not the "
                     "ignore_index %lld",
                     op, (long long)bad[1], kpl_shape_str(labels->ndim, pos, b1, sizeof b1),
                     (long long)a->c, (long long)a->ignore);
}

kpl_status kpl_k_softmax_xent(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *labels,
                              int64_t ignore_index, double eps)
{
    const char *op = "softmax_xent";
    KPL_TRY(kpl__ops_check(op, &xent_spec, (const kpl_tensor *[]){x, labels, out}));
    kpl_xent_attrs a;
    KPL_TRY(xent_common(op, x, labels, eps, &a));
    a.ignore = ignore_index;
    if (out->numel == 0) return KPL_OK;
    return xent_run(op, out, x, labels, NULL, &a);
}

kpl_status kpl_k_softmax_xent_bwd(kpl_tensor *gx, const kpl_tensor *x, const kpl_tensor *labels,
                                  const kpl_tensor *gy, int64_t ignore_index, double eps)
{
    const char *op = "softmax_xent_bwd";
    KPL_TRY(kpl__ops_check(op, &xent_bwd_spec, (const kpl_tensor *[]){x, labels, gy, gx}));
    kpl_xent_attrs a;
    KPL_TRY(xent_common(op, x, labels, eps, &a));
    a.ignore = ignore_index;
    a.bwd = true;
    if (gx->numel == 0) return KPL_OK;
    return xent_run(op, gx, x, labels, gy, &a);
}
