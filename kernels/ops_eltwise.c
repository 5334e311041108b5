/*
 * ops_eltwise.c — the front end of the element-wise calls: kpl_k_unary,
 * kpl_k_binary (numpy broadcasting), kpl_k_binary_scalar, kpl_k_where,
 * kpl_k_amp_unscale, with the formula names and kpl_shape_broadcast.
 * The formulas themselves are eltwise_math.h's, instantiated by
 * cpu/cpu_eltwise.c and cuda/cuda_eltwise.cu.
 */
#include "ops_impl.h"

#include <math.h>
#include <string.h>

/* ---- names ------------------------------------------------------------------ */

static const char *const unary_names[] = {
#define KPL_X_(e, s) [KPL_UN_##e] = s,
    KPL_UNARY_LIST(KPL_X_)
#undef KPL_X_
};
static const char *const binary_names[] = {
#define KPL_X_(e, s) [KPL_BIN_##e] = s,
    KPL_BINARY_LIST(KPL_X_)
#undef KPL_X_
};

const char *kpl_unary_name(kpl_unary_op op)
{
    return (unsigned)op < KPL_UNARY_COUNT ? unary_names[op] : "invalid-unary";
}
const char *kpl_binary_name(kpl_binary_op op)
{
    return (unsigned)op < KPL_BINARY_COUNT ? binary_names[op] : "invalid-binary";
}
bool kpl_binary_is_compare(kpl_binary_op op) { return op >= KPL_BIN_EQ && op <= KPL_BIN_GE; }

/* ---- shapes ----------------------------------------------------------------- */

kpl_status kpl_shape_broadcast(const char *op, int na, const int64_t *a, int nb,
                               const int64_t *b, int *nout, int64_t *out)
{
    int n = na > nb ? na : nb;
    int64_t res[KPL_MAX_DIMS];
    KPL_CHECK(n <= KPL_MAX_DIMS, KPL_ESHAPE, "%s: more than %d dims", op, KPL_MAX_DIMS);
    for (int i = 0; i < n; i++) {
        int64_t da = i < n - na ? 1 : a[i - (n - na)];
        int64_t db = i < n - nb ? 1 : b[i - (n - nb)];
        if (da != db && da != 1 && db != 1) {
            char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
            return KPL_ERROR(KPL_ESHAPE, "%s: shapes %s and %s cannot be broadcast (dim %d: "
                             "%lld vs %lld)",
                             op, kpl_shape_str(na, a, b1, sizeof b1),
                             kpl_shape_str(nb, b, b2, sizeof b2), i, (long long)da,
                             (long long)db);
        }
        res[i] = da == 1 ? db : da;
    }
    *nout = n;
    memcpy(out, res, (size_t)n * sizeof *out);
    return KPL_OK;
}

/* ---- unary ------------------------------------------------------------------ */

enum { UN_X, UN_OUT };
static const kpl_op_spec unary_spec = {{
    [UN_X] = {.name = "x"},
    [UN_OUT] = {"out", .device = KPL_AS(UN_X), .dtype = KPL_AS(UN_X), .shape = KPL_AS(UN_X),
                .in_place = KPL_ARGSET(UN_X)},
}};

static bool unary_int_ok(kpl_unary_op op)
{
    return op == KPL_UN_NEG || op == KPL_UN_ABS || op == KPL_UN_SQUARE ||
           op == KPL_UN_RELU || op == KPL_UN_SIGN;
}

kpl_status kpl_k_unary(kpl_tensor *out, kpl_unary_op op, const kpl_tensor *x,
                       double alpha, double beta)
{
    KPL_CHECK((unsigned)op < KPL_UNARY_COUNT, KPL_EINVAL, "unary: unknown op %d", (int)op);
    const char *name = unary_names[op];
    KPL_TRY(kpl__ops_check(name, &unary_spec, (const kpl_tensor *[]){x, out}));
    kpl_dtype dt = x->dtype;
    KPL_CHECK(kpl_dtype_is_float(dt) || ((dt == KPL_I32 || dt == KPL_I64) && unary_int_ok(op)),
              KPL_EDTYPE, "%s: not defined for dtype %s", name, kpl_dtype_name(dt));
    if (op == KPL_UN_CLIP)
        KPL_CHECK(alpha <= beta, KPL_EINVAL, "clip: lo %g is greater than hi %g", alpha, beta);
    if (x->numel == 0) return KPL_OK;
    kpl_unary_attrs attrs = {op, alpha, beta};
    if (is_half(dt) && !native_half(KPL_KOP_UNARY, out, dt))
        return kpl__ops_via_f32(KPL_KOP_UNARY, out, false, x, NULL, NULL, &attrs);
    return dispatch(KPL_KOP_UNARY, dt, out, x, NULL, NULL, &attrs);
}

/* ---- binary ----------------------------------------------------------------- */

enum { BIN_A, BIN_B, BIN_OUT };
static const kpl_op_spec binary_spec = {{
    [BIN_A] = {"a", .device = KPL_AS(BIN_B)},
    [BIN_B] = {"b", .dtype = KPL_AS(BIN_A)},
    [BIN_OUT] = {"out", .device = KPL_AS(BIN_A), .in_place = KPL_ARGSET(BIN_A) | KPL_ARGSET(BIN_B)},
}};
/* kpl_k_binary_scalar(out, a, s): b is a number. */
enum { BINS_A, BINS_OUT };
static const kpl_op_spec binary_scalar_spec = {{
    [BINS_A] = {.name = "a"},
    [BINS_OUT] = {"out", .device = KPL_AS(BINS_A), .in_place = KPL_ARGSET(BINS_A)},
}};

static kpl_status binary_dtype_ok(const char *name, kpl_binary_op op, kpl_dtype dt)
{
    bool ok;
    switch (dt) {
    case KPL_F32: case KPL_F64: case KPL_F16: case KPL_BF16:
    case KPL_I32: case KPL_I64: case KPL_U8:
        ok = true;
        break;
    case KPL_BOOL: /* logical: ==, !=, max = or, min = and */
        ok = op == KPL_BIN_EQ || op == KPL_BIN_NE || op == KPL_BIN_MAXIMUM ||
             op == KPL_BIN_MINIMUM;
        break;
    default:
        ok = false;
    }
    KPL_CHECK(ok, KPL_EDTYPE, "%s: not defined for dtype %s", name, kpl_dtype_name(dt));
    return KPL_OK;
}

/* What kpl_k_binary and kpl_k_binary_scalar share once their operands
 * passed their specs: the result's shape and dtype, the plan, the kernel. */
static kpl_status binary_run(kpl_tensor *out, kpl_binary_attrs *attrs,
                             const kpl_tensor *a, const kpl_tensor *b)
{
    const char *name = binary_names[attrs->op];
    kpl_dtype dt = a->dtype;
    int n;
    int64_t shape[KPL_MAX_DIMS];
    if (b) {
        KPL_TRY(kpl_shape_broadcast(name, a->ndim, a->shape, b->ndim, b->shape, &n, shape));
    } else {
        n = a->ndim;
        memcpy(shape, a->shape, sizeof shape);
    }
    KPL_TRY(same_shape(name, out, "out", n, shape));
    KPL_TRY(want_dtype(name, out, "out", kpl_binary_is_compare(attrs->op) ? KPL_BOOL : dt));
    KPL_TRY(binary_dtype_ok(name, attrs->op, dt));
    /* An input that shares out's storage must be read at out's own index. */
    if (b && out->storage == b->storage && b->numel != out->numel)
        return KPL_ERROR(KPL_EINVAL, "%s: in-place 'out' is 'b' but 'b' is broadcast", name);
    if (out->storage == a->storage && a->numel != out->numel)
        return KPL_ERROR(KPL_EINVAL, "%s: in-place 'out' is 'a' but 'a' is broadcast", name);
    if (out->numel == 0) return KPL_OK;
    const kpl_tensor *ins[2] = {a, b};
    kpl__ops_plan_build(&attrs->plan, n, shape, b ? 2 : 1, ins);

    if (is_half(dt) && !native_half(KPL_KOP_BINARY, out, dt))
        return kpl__ops_via_f32(KPL_KOP_BINARY, out, kpl_binary_is_compare(attrs->op), a, b,
                                NULL, attrs);
    return dispatch(KPL_KOP_BINARY, dt, out, a, b, NULL, attrs);
}

kpl_status kpl_k_binary(kpl_tensor *out, kpl_binary_op op, const kpl_tensor *a,
                        const kpl_tensor *b)
{
    KPL_CHECK((unsigned)op < KPL_BINARY_COUNT, KPL_EINVAL, "binary: unknown op %d", (int)op);
    KPL_TRY(kpl__ops_check(binary_names[op], &binary_spec, (const kpl_tensor *[]){a, b, out}));
    kpl_binary_attrs attrs = {.op = op};
    return binary_run(out, &attrs, a, b);
}

kpl_status kpl_k_binary_scalar(kpl_tensor *out, kpl_binary_op op, const kpl_tensor *a,
                               double s, bool scalar_first)
{
    KPL_CHECK((unsigned)op < KPL_BINARY_COUNT, KPL_EINVAL, "binary: unknown op %d", (int)op);
    KPL_TRY(kpl__ops_check(binary_names[op], &binary_scalar_spec, (const kpl_tensor *[]){a, out}));
    kpl_binary_attrs attrs = {
        .op = op, .has_scalar = true, .scalar_first = scalar_first, .scalar = s};
    return binary_run(out, &attrs, a, NULL);
}

/* ---- where ------------------------------------------------------------------ */

enum { WHERE_COND, WHERE_A, WHERE_B, WHERE_OUT };
static const kpl_op_spec where_spec = {{
    [WHERE_COND] = {"cond", .dtypes = KPL_DT(KPL_BOOL)},
    [WHERE_A] = {"a", .device = KPL_AS(WHERE_COND)},
    [WHERE_B] = {"b", .device = KPL_AS(WHERE_COND), .dtype = KPL_AS(WHERE_A)},
    [WHERE_OUT] = {"out", .device = KPL_AS(WHERE_COND), .dtype = KPL_AS(WHERE_A),
                   .in_place = KPL_ARGSET(WHERE_COND) | KPL_ARGSET(WHERE_A) |
                               KPL_ARGSET(WHERE_B)},
}};

kpl_status kpl_k_where(kpl_tensor *out, const kpl_tensor *cond, const kpl_tensor *a,
                       const kpl_tensor *b)
{
    const char *name = "where";
    const kpl_tensor *ins[3] = {cond, a, b};
    KPL_TRY(kpl__ops_check(name, &where_spec, (const kpl_tensor *[]){cond, a, b, out}));
    int n1, n;
    int64_t s1[KPL_MAX_DIMS], shape[KPL_MAX_DIMS];
    KPL_TRY(kpl_shape_broadcast(name, cond->ndim, cond->shape, a->ndim, a->shape, &n1, s1));
    KPL_TRY(kpl_shape_broadcast(name, n1, s1, b->ndim, b->shape, &n, shape));
    KPL_TRY(same_shape(name, out, "out", n, shape));
    for (int i = 0; i < 3; i++)
        if (out->storage == ins[i]->storage && ins[i]->numel != out->numel)
            return KPL_ERROR(KPL_EINVAL, "where: in-place 'out' is a broadcast input");
    if (out->numel == 0) return KPL_OK;
    kpl_where_attrs attrs;
    kpl__ops_plan_build(&attrs.plan, n, shape, 3, ins);
    /* where only moves values: a half is two bytes like an i16, so the
     * bf16/f16 kernels are registered as byte movers directly. */
    return dispatch(KPL_KOP_WHERE, a->dtype, out, cond, a, b, &attrs);
}

/* ---- optimizer steps ---------------------------------------------------------------- */

enum { SGD_P, SGD_V, SGD_G };
static const kpl_op_spec sgd_spec = {{
    [SGD_P] = {"p", .dtypes = KPL_DT(KPL_F32) | KPL_DT(KPL_F64), .dtypes_are = "f32 or f64"},
    [SGD_V] = {"v", .optional = true, .device = KPL_AS(SGD_P), .dtype = KPL_AS(SGD_P),
               .shape = KPL_AS(SGD_P), .disjoint = KPL_ARGSET(SGD_P)},
    [SGD_G] = {"g", .device = KPL_AS(SGD_P), .dtype = KPL_AS(SGD_P), .shape = KPL_AS(SGD_P),
               .disjoint = KPL_ARGSET(SGD_P) | KPL_ARGSET(SGD_V)},
}};

kpl_status kpl_k_sgd_update(kpl_tensor *p, kpl_tensor *v, const kpl_tensor *g, double lr,
                            double momentum, double wd, bool nesterov, bool first)
{
    const char *op = "sgd_update";
    KPL_TRY(kpl__ops_check(op, &sgd_spec, (const kpl_tensor *[]){p, v, g}));
    KPL_CHECK(isfinite(lr) && isfinite(momentum) && isfinite(wd) && momentum >= 0 && wd >= 0,
              KPL_EINVAL, "%s: lr %g, momentum %g, weight decay %g: each must be finite, "
              "momentum and weight decay not negative", op, lr, momentum, wd);
    KPL_CHECK((momentum > 0) == (v != NULL), KPL_EINVAL,
              "%s: a momentum buffer 'v' goes with momentum > 0 (momentum %g, v %s)", op,
              momentum, v ? "given" : "NULL");
    KPL_CHECK(!nesterov || momentum > 0, KPL_EINVAL, "%s: nesterov needs momentum > 0", op);
    if (p->numel == 0) return KPL_OK;
    kpl_sgd_attrs a = {.v = v, .lr = lr, .momentum = momentum, .wd = wd, .nesterov = nesterov,
                       .first = first};
    return dispatch(KPL_KOP_SGD, p->dtype, p, g, NULL, NULL, &a);
}

/* ---- loss scaling ----------------------------------------------------------------- */

enum { AMP_G, AMP_FOUND };
static const kpl_op_spec amp_spec = {{
    [AMP_G] = {"g", .dtypes = KPL_DT_FLOAT},
    [AMP_FOUND] = {"found_inf", .dtypes = KPL_DT(KPL_F32), .device = KPL_AS(AMP_G)},
}};

kpl_status kpl_k_amp_unscale(kpl_tensor *g, double inv_scale, kpl_tensor *found_inf)
{
    const char *op = "amp_unscale";
    KPL_TRY(kpl__ops_check(op, &amp_spec, (const kpl_tensor *[]){g, found_inf}));
    char b[KPL_SHAPE_BUF];
    KPL_CHECK(found_inf->numel == 1, KPL_ESHAPE,
              "%s: 'found_inf' has shape %s (%lld elements); it must hold exactly one", op,
              KPL_SHAPE(found_inf, b), (long long)found_inf->numel);
    /* Its one element may sit anywhere outside g, in g's own storage too. */
    if (found_inf->storage == g->storage) {
        size_t f0 = found_inf->offset, g0 = g->offset, g1 = g0 + kpl_tensor_nbytes(g);
        KPL_CHECK(f0 + sizeof(float) <= g0 || f0 >= g1, KPL_EINVAL,
                  "%s: 'found_inf' overlaps 'g'", op);
    }
    KPL_CHECK(isfinite(inv_scale), KPL_EINVAL, "%s: inv_scale %g is not finite", op, inv_scale);
    if (g->numel == 0) return KPL_OK;
    kpl_amp_attrs a = {.inv_scale = inv_scale, .found_inf = found_inf};
    return dispatch(KPL_KOP_AMP_UNSCALE, g->dtype, g, NULL, NULL, NULL, &a);
}
