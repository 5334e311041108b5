/*
 * eager.c — the eager ops: infer the shape, allocate, compute through
 * kernels/, record on the tape, hand the result to the current pool.
 */
#include "graph_impl.h"
#include "ir_impl.h"
#include "eager_impl.h"

#include <string.h>

/* ---- unary ----------------------------------------------------------------------- */

static kpl_tensor *unary(kpl_op op, kpl_unary_op u, kpl_tensor *x, double alpha, double beta)
{
    x = kpl__autocast(op, x);
    if (!x) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), kpl_tensor_ndim(x), kpl_tensor_shape(x));
    if (!out) return NULL;
    kpl_op_attrs at = {.alpha = alpha, .beta = beta};
    return record_finish(kpl_k_unary(out, u, x, alpha, beta), op, &at, 1, &x, out);
}

/* kpl_<name>(x) for every op run as (UN, k) in op_table.h. */
#define DEF_UNARY_UN(E, s, k) \
    kpl_tensor *kpl_##s(kpl_tensor *x) { return unary(KPL_OP_##E, KPL_UN_##k, x, 0, 0); }
#define DEF_UNARY_UNA(E, s, k)
#define DEF_UNARY_BIN(E, s, k)
#define DEF_UNARY_BINS(E, s, k)
#define DEF_UNARY_RED(E, s, k)
#define DEF_UNARY_EW(E, s, k)
#define DEF_UNARY_FN(E, s, k)
#define DEF_UNARY_VIEW(E, s, k)
#define DEF_UNARY_NONE(E, s, k)
#define DEF_UNARY_(E, s, kind, k) DEF_UNARY_##kind(E, s, k)
#define DEF_UNARY(E, s, kind, k) DEF_UNARY_(E, s, kind, k) /* expands kind first */
#define KPL_X_(e, s, ar, at, ac, sv, run, ...) DEF_UNARY(e, s, KPL_OP_FIRST run, KPL_OP_SECOND run)
KPL_OP_LIST(KPL_X_)
#undef KPL_X_
#undef DEF_UNARY

/* The op saves its output for the gradient (y > 0 exactly where x > 0),
 * which the next op usually keeps anyway, instead of its input: a GAN
 * step's leaky ReLUs kept both, 6-9 MB of its peak (docs/memory.md).  A
 * negative slope makes y > 0 on both sides, so it is composed of recorded
 * ops instead, as PyTorch computes it (x > 0 ? x : x slope; the gradient
 * slope gy at 0). */
kpl_tensor *kpl_leaky_relu(kpl_tensor *x, double slope)
{
    if (!(slope < 0)) return unary(KPL_OP_LEAKY_RELU, KPL_UN_LEAKY_RELU, x, slope, 0);
    if (!x) return NULL;
    kpl_tensor *zero = kpl_full(kpl_tensor_device(x), kpl_tensor_dtype(x), 0, NULL, 0);
    return kpl_where(kpl_compare(KPL_BIN_GT, x, zero), x,
                     kpl_scalar_op(KPL_BIN_MUL, x, slope, false));
}

kpl_tensor *kpl_clip(kpl_tensor *x, double lo, double hi)
{
    return unary(KPL_OP_CLIP, KPL_UN_CLIP, x, lo, hi);
}

/* ---- binary ------------------------------------------------------------------------ */

static kpl_tensor *binary(kpl_op op, kpl_binary_op b, kpl_tensor *x, kpl_tensor *y)
{
    bool cmp = kpl_binary_is_compare(b);
    kpl__autocast_pair(cmp ? KPL_OP_SUB : op, &x, &y); /* comparisons promote as sub does */
    if (!x || !y) return NULL;
    int n;
    int64_t shape[KPL_MAX_DIMS];
    if (kpl_shape_broadcast(kpl_binary_name(b), kpl_tensor_ndim(x), kpl_tensor_shape(x),
                            kpl_tensor_ndim(y), kpl_tensor_shape(y), &n, shape) < 0)
        return NULL;
    kpl_tensor *out = new_like(x, cmp ? KPL_BOOL : kpl_tensor_dtype(x), n, shape);
    if (!out) return NULL;
    kpl_tensor *ins[2] = {x, y};
    kpl_status st = kpl_k_binary(out, b, x, y);
    if (cmp) { /* no gradient through comparisons */
        kpl_op_attrs at = {.sub = (int)b};
        return trace_finish(st, KPL_OP_COMPARE, &at, 2, ins, out);
    }
    return record_finish(st, op, NULL, 2, ins, out);
}

kpl_tensor *kpl_add(kpl_tensor *a, kpl_tensor *b) { return binary(KPL_OP_ADD, KPL_BIN_ADD, a, b); }
kpl_tensor *kpl_sub(kpl_tensor *a, kpl_tensor *b) { return binary(KPL_OP_SUB, KPL_BIN_SUB, a, b); }
kpl_tensor *kpl_mul(kpl_tensor *a, kpl_tensor *b) { return binary(KPL_OP_MUL, KPL_BIN_MUL, a, b); }
kpl_tensor *kpl_div(kpl_tensor *a, kpl_tensor *b) { return binary(KPL_OP_DIV, KPL_BIN_DIV, a, b); }
kpl_tensor *kpl_pow(kpl_tensor *a, kpl_tensor *b) { return binary(KPL_OP_POW, KPL_BIN_POW, a, b); }
kpl_tensor *kpl_maximum(kpl_tensor *a, kpl_tensor *b)
{
    return binary(KPL_OP_MAXIMUM, KPL_BIN_MAXIMUM, a, b);
}
kpl_tensor *kpl_minimum(kpl_tensor *a, kpl_tensor *b)
{
    return binary(KPL_OP_MINIMUM, KPL_BIN_MINIMUM, a, b);
}

kpl_tensor *kpl_compare(kpl_binary_op cmp, kpl_tensor *a, kpl_tensor *b)
{
    if (!kpl_binary_is_compare(cmp)) {
        KPL_ERROR(KPL_EINVAL, "compare: '%s' is not a comparison", kpl_binary_name(cmp));
        return NULL;
    }
    return binary(KPL_OP_COUNT, cmp, a, b);
}

kpl_tensor *kpl_scalar_op(kpl_binary_op op, kpl_tensor *x, double s, bool scalar_first)
{
    static const kpl_op map[KPL_BINARY_COUNT] = {
        [KPL_BIN_ADD] = KPL_OP_ADD_SCALAR, [KPL_BIN_SUB] = KPL_OP_SUB_SCALAR,
        [KPL_BIN_MUL] = KPL_OP_MUL_SCALAR, [KPL_BIN_DIV] = KPL_OP_DIV_SCALAR,
        [KPL_BIN_POW] = KPL_OP_POW_SCALAR, [KPL_BIN_MAXIMUM] = KPL_OP_MAXIMUM_SCALAR,
        [KPL_BIN_MINIMUM] = KPL_OP_MINIMUM_SCALAR,
    };
    if (!x) return NULL;
    if ((unsigned)op > KPL_BIN_MINIMUM) { /* comparisons and relu_bwd */
        KPL_ERROR(KPL_EINVAL, "scalar_op: '%s' has no differentiable scalar form",
                  kpl_binary_name(op));
        return NULL;
    }
    x = kpl__autocast(map[op], x);
    if (!x) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), kpl_tensor_ndim(x), kpl_tensor_shape(x));
    if (!out) return NULL;
    kpl_op_attrs at = {.scalar = s, .scalar_first = scalar_first};
    return record_finish(kpl_k_binary_scalar(out, op, x, s, scalar_first), map[op], &at, 1, &x,
                         out);
}

kpl_tensor *kpl_where(kpl_tensor *cond, kpl_tensor *a, kpl_tensor *b)
{
    kpl__autocast_pair(KPL_OP_WHERE, &a, &b);
    if (!cond || !a || !b) return NULL;
    int n1, n;
    int64_t s1[KPL_MAX_DIMS], shape[KPL_MAX_DIMS];
    if (kpl_shape_broadcast("where", kpl_tensor_ndim(cond), kpl_tensor_shape(cond),
                            kpl_tensor_ndim(a), kpl_tensor_shape(a), &n1, s1) < 0 ||
        kpl_shape_broadcast("where", n1, s1, kpl_tensor_ndim(b), kpl_tensor_shape(b), &n,
                            shape) < 0)
        return NULL;
    kpl_tensor *out = new_like(a, kpl_tensor_dtype(a), n, shape);
    if (!out) return NULL;
    kpl_tensor *ins[3] = {cond, a, b};
    return record_finish(kpl_k_where(out, cond, a, b), KPL_OP_WHERE, NULL, 3, ins, out);
}

/* ---- reductions --------------------------------------------------------------------- */

static kpl_tensor *reduce(kpl_op op, kpl_reduce_op r, kpl_tensor *x, const int *axes,
                          int naxes, bool keepdim, int correction)
{
    x = kpl__autocast(op, x);
    if (!x) return NULL;
    if (naxes < 0 || naxes > KPL_MAX_DIMS) {
        KPL_ERROR(KPL_EINVAL, "%s: %d axes", kpl_reduce_name(r), naxes);
        return NULL;
    }
    int n;
    int64_t shape[KPL_MAX_DIMS];
    if (kpl_shape_reduce(kpl_reduce_name(r), kpl_tensor_ndim(x), kpl_tensor_shape(x), axes,
                         naxes, keepdim, &n, shape) < 0)
        return NULL;
    bool arg = r == KPL_RED_ARGMAX || r == KPL_RED_ARGMIN;
    kpl_tensor *out = new_like(x, arg ? KPL_I64 : kpl_tensor_dtype(x), n, shape);
    if (!out) return NULL;
    kpl_status st = kpl_k_reduce(out, r, x, axes, naxes, keepdim, correction);
    kpl_op_attrs at = {.naxes = axes ? naxes : 0, .keepdim = keepdim, .correction = correction};
    if (axes) memcpy(at.axes, axes, (size_t)naxes * sizeof *axes);
    if (arg) return trace_finish(st, r == KPL_RED_ARGMAX ? KPL_OP_ARGMAX : KPL_OP_ARGMIN, &at, 1, &x, out);
    return record_finish(st, op, &at, 1, &x, out);
}

kpl_tensor *kpl_sum(kpl_tensor *x, const int *axes, int naxes, bool keepdim)
{
    return reduce(KPL_OP_SUM, KPL_RED_SUM, x, axes, naxes, keepdim, 0);
}
kpl_tensor *kpl_mean(kpl_tensor *x, const int *axes, int naxes, bool keepdim)
{
    return reduce(KPL_OP_MEAN, KPL_RED_MEAN, x, axes, naxes, keepdim, 0);
}
kpl_tensor *kpl_max(kpl_tensor *x, const int *axes, int naxes, bool keepdim)
{
    return reduce(KPL_OP_MAX, KPL_RED_MAX, x, axes, naxes, keepdim, 0);
}
kpl_tensor *kpl_min(kpl_tensor *x, const int *axes, int naxes, bool keepdim)
{
    return reduce(KPL_OP_MIN, KPL_RED_MIN, x, axes, naxes, keepdim, 0);
}
kpl_tensor *kpl_var(kpl_tensor *x, const int *axes, int naxes, bool keepdim, int correction)
{
    return reduce(KPL_OP_VAR, KPL_RED_VAR, x, axes, naxes, keepdim, correction);
}
kpl_tensor *kpl_logsumexp(kpl_tensor *x, const int *axes, int naxes, bool keepdim)
{
    return reduce(KPL_OP_LOGSUMEXP, KPL_RED_LOGSUMEXP, x, axes, naxes, keepdim, 0);
}
kpl_tensor *kpl_argmax(kpl_tensor *x, int axis, bool keepdim)
{
    return reduce(KPL_OP_COUNT, KPL_RED_ARGMAX, x, &axis, 1, keepdim, 0);
}
kpl_tensor *kpl_argmin(kpl_tensor *x, int axis, bool keepdim)
{
    return reduce(KPL_OP_COUNT, KPL_RED_ARGMIN, x, &axis, 1, keepdim, 0);
}

/* ---- matmul, cast, shapes -------------------------------------------------------------- */

kpl_tensor *kpl_matmul(kpl_tensor *a, kpl_tensor *b, bool trans_a, bool trans_b)
{
    kpl__autocast_pair(KPL_OP_MATMUL, &a, &b);
    if (!a || !b) return NULL;
    int n;
    int64_t shape[KPL_MAX_DIMS];
    if (kpl_shape_matmul(kpl_tensor_ndim(a), kpl_tensor_shape(a), trans_a, kpl_tensor_ndim(b),
                         kpl_tensor_shape(b), trans_b, &n, shape) < 0)
        return NULL;
    kpl_tensor *out = new_like(a, kpl_tensor_dtype(a), n, shape);
    if (!out) return NULL;
    kpl_op_attrs at = {.trans_a = trans_a, .trans_b = trans_b};
    kpl_tensor *ins[2] = {a, b};
    return record_finish(kpl_k_matmul(out, a, b, trans_a, trans_b), KPL_OP_MATMUL, &at, 2, ins,
                         out);
}

kpl_tensor *kpl_cast(kpl_tensor *x, kpl_dtype dt)
{
    if (!x) return NULL;
    kpl_tensor *out = new_like(x, dt, kpl_tensor_ndim(x), kpl_tensor_shape(x));
    if (!out) return NULL;
    kpl_op_attrs at = {.dtype = kpl_tensor_dtype(x)};
    kpl_status st = kpl_k_cast(out, x);
    if (!kpl_dtype_is_float(dt)) /* no gradient into integers */
        return trace_finish(st, KPL_OP_CAST, &at, 1, &x, out);
    return record_finish(st, KPL_OP_CAST, &at, 1, &x, out);
}

kpl_tensor *kpl_reshape(kpl_tensor *x, int ndim, const int64_t *shape)
{
    if (!x) return NULL;
    kpl_tensor *out = NULL;
    kpl_status st = kpl_tensor_reshape(x, ndim, shape, &out);
    if (st < 0) return NULL;
    return record_finish(st, KPL_OP_RESHAPE, NULL, 1, &x, out);
}

kpl_tensor *kpl_permute(kpl_tensor *x, const int *perm)
{
    if (!x) return NULL;
    kpl_tensor *out = NULL;
    if (kpl_tensor_permute(x, perm, &out) < 0) return NULL;
    kpl_op_attrs at = {.naxes = kpl_tensor_ndim(x)};
    memcpy(at.axes, perm, (size_t)at.naxes * sizeof *perm);
    return record_finish(KPL_OK, KPL_OP_PERMUTE, &at, 1, &x, out);
}

kpl_tensor *kpl_narrow(kpl_tensor *x, int64_t start, int64_t length)
{
    if (!x) return NULL;
    kpl_tensor *out = NULL;
    if (kpl_tensor_narrow(x, start, length, &out) < 0) return NULL;
    kpl_op_attrs at = {.start = start, .length = length};
    return record_finish(KPL_OK, KPL_OP_NARROW, &at, 1, &x, out);
}

kpl_tensor *kpl_expand(kpl_tensor *x, int ndim, const int64_t *shape)
{
    if (!x) return NULL;
    int n;
    int64_t bs[KPL_MAX_DIMS];
    if (kpl_shape_broadcast("expand", kpl_tensor_ndim(x), kpl_tensor_shape(x), ndim, shape, &n,
                            bs) < 0)
        return NULL;
    bool same = n == ndim;
    for (int i = 0; same && i < n; i++) same = bs[i] == shape[i];
    if (!same) {
        char b1[96], b2[96];
        KPL_ERROR(KPL_ESHAPE, "expand: %s cannot be broadcast to %s",
                  kpl_shape_str(kpl_tensor_ndim(x), kpl_tensor_shape(x), b1, sizeof b1),
                  kpl_shape_str(ndim, shape, b2, sizeof b2));
        return NULL;
    }
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), ndim, shape);
    if (!out) return NULL;
    return record_finish(kpl_k_expand(out, x), KPL_OP_EXPAND, NULL, 1, &x, out);
}

kpl_tensor *kpl_pad_rows(kpl_tensor *x, int64_t before, int64_t after)
{
    if (!x) return NULL;
    if (kpl_tensor_ndim(x) < 1 || before < 0 || after < 0) {
        KPL_ERROR(KPL_EINVAL, "pad_rows: needs a tensor with dims and non-negative padding "
                              "(got %d dims, %lld before, %lld after)",
                  kpl_tensor_ndim(x), (long long)before, (long long)after);
        return NULL;
    }
    int64_t shape[KPL_MAX_DIMS];
    memcpy(shape, kpl_tensor_shape(x), sizeof shape);
    int64_t rows = shape[0];
    shape[0] = before + rows + after;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), kpl_tensor_ndim(x), shape);
    if (!out) return NULL;
    kpl_op_attrs at = {.start = before, .length = shape[0]};
    return record_finish(kpl__pad_rows_into(out, x, before), KPL_OP_PAD_ROWS, &at, 1, &x, out);
}

kpl_status kpl__pad_rows_into(kpl_tensor *out, kpl_tensor *x, int64_t before)
{
    kpl_tensor *mid = NULL;
    kpl_status st = kpl_k_fill(out, 0);
    if (st == KPL_OK) st = kpl_tensor_narrow(out, before, kpl_tensor_shape(x)[0], &mid);
    if (st == KPL_OK) st = kpl_k_copy(mid, x);
    kpl_tensor_release(mid);
    return st;
}

/* ---- creation ---------------------------------------------------------------------------- */

kpl_tensor *kpl_empty(kpl_device *dev, kpl_dtype dt, int ndim, const int64_t *shape)
{
    kpl_tensor *t = NULL;
    if (kpl_tensor_empty(dev, dt, ndim, shape, &t) < 0) return NULL;
    return kpl_autorelease(t);
}

kpl_tensor *kpl_full(kpl_device *dev, kpl_dtype dt, int ndim, const int64_t *shape, double value)
{
    kpl_tensor *t = NULL;
    if (kpl_tensor_empty(dev, dt, ndim, shape, &t) < 0) return NULL;
    kpl_status st = kpl_k_fill(t, value);
    if (st == KPL_OK) kpl__trace_const(t);
    return finish(st, t);
}

kpl_tensor *kpl_rand(kpl_device *dev, kpl_dtype dt, int ndim, const int64_t *shape,
                     kpl_rng *rng, double lo, double hi)
{
    kpl_tensor *t = NULL;
    if (kpl_tensor_empty(dev, dt, ndim, shape, &t) < 0) return NULL;
    kpl_trace_refuse("rand: random numbers cannot be traced yet");
    kpl__rng_scope s;
    kpl__recompute_rng_enter(rng, &s); /* a recomputed region draws as the forward did */
    kpl_status st = kpl_k_uniform(t, rng, lo, hi);
    kpl__recompute_rng_leave(&s);
    return finish(st, t);
}

kpl_tensor *kpl_randn(kpl_device *dev, kpl_dtype dt, int ndim, const int64_t *shape,
                      kpl_rng *rng, double mean, double std)
{
    kpl_tensor *t = NULL;
    if (kpl_tensor_empty(dev, dt, ndim, shape, &t) < 0) return NULL;
    kpl_trace_refuse("randn: random numbers cannot be traced yet");
    kpl__rng_scope s;
    kpl__recompute_rng_enter(rng, &s);
    kpl_status st = kpl_k_normal(t, rng, mean, std);
    kpl__recompute_rng_leave(&s);
    return finish(st, t);
}

kpl_tensor *kpl_arange(kpl_device *dev, kpl_dtype dt, int64_t n, double start, double step)
{
    kpl_tensor *t = NULL;
    if (kpl_tensor_empty(dev, dt, 1, &n, &t) < 0) return NULL;
    kpl_status st = kpl_k_arange(t, start, step);
    if (st == KPL_OK) kpl__trace_const(t);
    return finish(st, t);
}

kpl_tensor *kpl_to_device(kpl_tensor *x, kpl_device *dev)
{
    if (!x) return NULL;
    kpl_tensor *t = NULL;
    if (kpl_tensor_to_device(x, dev, &t) < 0) return NULL;
    return kpl_autorelease(t);
}

kpl_tensor *kpl_detach(kpl_tensor *x)
{
    if (!x) return NULL;
    /* A header of its own without graph data: nothing links it to x's
     * node or marks it a parameter. */
    kpl_tensor *t = NULL;
    if (kpl_tensor_reshape(x, kpl_tensor_ndim(x), kpl_tensor_shape(x), &t) < 0) return NULL;
    kpl__trace_op(KPL_OP_RESHAPE, NULL, 1, &x, 1, &t); /* the same values */
    return kpl_autorelease(t);
}

/* ---- custom ops ------------------------------------------------------------------------- */

kpl_tensor *kpl_custom(kpl_tensor *x, kpl_tensor *y, const kpl_custom_fn *fn, void *user)
{
    if (!x || !y) return NULL;
    if (!fn || !fn->backward) {
        KPL_ERROR(KPL_EINVAL, "custom: %s is NULL", fn ? "fn->backward" : "fn");
        return NULL;
    }
    if (kpl_tensor_device(x) != kpl_tensor_device(y)) {
        KPL_ERROR(KPL_EDEVICE, "custom '%s': x is on %s and y on %s", fn->name ? fn->name : "custom",
                  kpl_device_name(kpl_tensor_device(x)), kpl_device_name(kpl_tensor_device(y)));
        return NULL;
    }
    /* A header of y's own to carry the node: y may be a leaf or another
     * op's result, whose graph data must not change. */
    kpl_tensor *out = NULL;
    kpl_status st = kpl_tensor_reshape(y, kpl_tensor_ndim(y), kpl_tensor_shape(y), &out);
    kpl_op_attrs at = {.custom = fn, .custom_user = user};
    return record_finish(st, KPL_OP_CUSTOM, &at, 1, &x, out);
}

/* ---- writes ---------------------------------------------------------------------- */

kpl_status kpl_write_binary(kpl_tensor *out, kpl_binary_op op, kpl_tensor *a, kpl_tensor *b)
{
    KPL_TRY(kpl_k_binary(out, op, a, b));
    static const kpl_op named[] = {
        [KPL_BIN_ADD] = KPL_OP_ADD, [KPL_BIN_SUB] = KPL_OP_SUB, [KPL_BIN_MUL] = KPL_OP_MUL,
        [KPL_BIN_DIV] = KPL_OP_DIV, [KPL_BIN_POW] = KPL_OP_POW,
        [KPL_BIN_MAXIMUM] = KPL_OP_MAXIMUM, [KPL_BIN_MINIMUM] = KPL_OP_MINIMUM};
    kpl_op o = (unsigned)op < sizeof named / sizeof *named && named[op] ? named[op]
               : kpl_binary_is_compare(op)                               ? KPL_OP_COMPARE
                                                                         : KPL_OP_BINARY;
    kpl_op_attrs at = {.sub = op};
    kpl__trace_write(o, &at, 2, (kpl_tensor *[]){a, b}, out);
    return KPL_OK;
}

kpl_status kpl_write_scalar(kpl_tensor *out, kpl_binary_op op, kpl_tensor *a, double s,
                            bool scalar_first)
{
    KPL_TRY(kpl_k_binary_scalar(out, op, a, s, scalar_first));
    static const kpl_op named[] = {
        [KPL_BIN_ADD] = KPL_OP_ADD_SCALAR, [KPL_BIN_SUB] = KPL_OP_SUB_SCALAR,
        [KPL_BIN_MUL] = KPL_OP_MUL_SCALAR, [KPL_BIN_DIV] = KPL_OP_DIV_SCALAR,
        [KPL_BIN_POW] = KPL_OP_POW_SCALAR, [KPL_BIN_MAXIMUM] = KPL_OP_MAXIMUM_SCALAR,
        [KPL_BIN_MINIMUM] = KPL_OP_MINIMUM_SCALAR};
    if (kpl_tracing()) {
        if ((unsigned)op >= sizeof named / sizeof *named || !named[op]) {
            kpl_trace_refuse("write_scalar: '%s' with a scalar has no graph op",
                            kpl_binary_name(op));
            return KPL_OK;
        }
        kpl_op_attrs at = {.scalar = s, .scalar_first = scalar_first};
        kpl__trace_write(named[op], &at, 1, &a, out);
    }
    return KPL_OK;
}

kpl_status kpl_write_copy(kpl_tensor *out, kpl_tensor *x)
{
    KPL_TRY(kpl_k_copy(out, x));
    kpl_op_attrs at = {.dtype = kpl_tensor_dtype(x)};
    kpl__trace_write(KPL_OP_CAST, &at, 1, &x, out);
    return KPL_OK;
}
