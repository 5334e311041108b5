/*
 * ops_impl.h — private to kernels/: what the front ends of the compute
 * calls (kernels/ops_*.c, one file per op family) share: the declarative
 * argument checks, the dispatch, the f32 detour of f16/bf16 operands and
 * the element-wise plan.  They run on the host before any kernel and
 * report with the op's name.
 *
 * An op family's file holds, per call, its operand spec (below), the
 * checks only code can make (a result shape computed from the arguments,
 * channel arithmetic, values), the kernel's attributes and the dispatch.
 */
#ifndef KPL_OPS_IMPL_H
#define KPL_OPS_IMPL_H

#include "kernels_impl.h"

/* ---- declarative argument checks ------------------------------------------------- */

/* Each call declares its tensor operands once, in a static const kpl_op_spec,
 * e.g. kpl_k_conv2d(out, x, w, b):
 *
 *   enum { CONV_X, CONV_W, CONV_OUT, CONV_B };
 *   static const kpl_op_spec conv_fwd_spec = {{
 *       [CONV_X] = {"x", .rank = 4, .shape_is = "expected (N, C, H, W)",
 *                   .dtypes = KPL_DT_FLOAT},
 *       [CONV_W] = {"w", .rank = 4, .shape_is = "expected (O, C / groups, KH, KW)",
 *                   .device = KPL_AS(CONV_X), .dtype = KPL_AS(CONV_X)},
 *       [CONV_OUT] = {"out", .rank = 4, .shape_is = "expected (N, O, OH, OW)",
 *                     .device = KPL_AS(CONV_X), .dtype = KPL_AS(CONV_X),
 *                     .disjoint = KPL_ARGSET(CONV_X)},
 *       [CONV_B] = {"b", .optional = true, .device = KPL_AS(CONV_X),
 *                   .dtype = KPL_AS(CONV_X)},
 *   }};
 *   KPL_TRY(kpl__ops_check("conv2d", &conv_fwd_spec,
 *                          (const kpl_tensor *[]){x, w, out, b}));
 *
 * kpl__ops_check reports the first rule broken, in this order: every
 * operand is given (or optional); then operand by operand in the spec's
 * order its rank, its dtype, and its device, dtype and shape against
 * another operand's; then the memory rules.  Its messages name the op and
 * the operand:
 *
 *   conv2d: argument 'w' is NULL
 *   conv2d: 'w' has shape (3,3,3); expected (O, C / groups, KH, KW)
 *   conv2d: 'x' has dtype i32; f32, f64, f16 and bf16 are supported
 *   where: 'cond' has dtype f32, expected bool
 *   conv2d: 'w' is on cuda:0 but 'x' is on cpu (copy explicitly with ...)
 *   conv2d: 'w' has dtype f64, expected f32 like 'x'
 *   scatter_add: 'src' has shape (1,3), expected (2,2) like 'idx'
 *   conv2d: 'out' may not alias 'x'
 *   add: 'out' partially overlaps 'a' (only exact in-place is allowed)
 *
 * The check is inline and the spec a constant it sees, so the compiler
 * folds the spec away and keeps the comparisons a hand-written check
 * makes (a kpl_k_unary or kpl_k_binary call runs as many instructions as
 * with the hand-written checks this replaced); it allocates nothing, and
 * the messages are worded out of line, on failure only. */

#define KPL_OPS_ARGS 8 /* operands of a spec at most */

/* A dtype set: bit d for kpl_dtype d. */
#define KPL_DT(d) (1u << (d))
#define KPL_DT_FLOAT (KPL_DT(KPL_F32) | KPL_DT(KPL_F64) | KPL_DT(KPL_F16) | KPL_DT(KPL_BF16))
#define KPL_DT_F32_F64 (KPL_DT(KPL_F32) | KPL_DT(KPL_F64))

/* Operand i of the same spec in a relation field (0 there: no relation). */
#define KPL_AS(i) ((uint8_t)((i) + 1))
/* Operands i, j, ... of the same spec in a memory rule: KPL_ARGSET(i) | .. */
#define KPL_ARGSET(i) ((uint8_t)(1u << (i)))

typedef struct {
    const char *name;       /* as the messages name it: "x", "out" */
    bool optional;          /* may be NULL, and then nothing of it is checked */
    int8_t rank;            /* dims required (0: any) */
    int8_t min_rank;        /* dims at least (0: any) */
    int64_t cols;           /* size required of the last dim (0: any) */
    const char *shape_is;   /* what a message says of a wrong rank or last dim:
                             * "expected (N, C, H, W)" */
    uint32_t dtypes;        /* KPL_DT set allowed (0: any) */
    const char *dtypes_are; /* what a message says of another dtype (NULL: the set,
                             * "f32 and f64 are supported", or "expected i64") */
    uint8_t device;         /* KPL_AS(i): on operand i's device */
    uint8_t dtype;          /* KPL_AS(i): of operand i's dtype */
    uint8_t shape;          /* KPL_AS(i): of operand i's shape */
    uint8_t disjoint;       /* KPL_ARGSET: operands whose storage it may not share */
    uint8_t in_place;       /* KPL_ARGSET: operands it may be exactly (in place) but
                             * not overlap partially */
} kpl_arg_spec;

typedef struct {
    kpl_arg_spec arg[KPL_OPS_ARGS]; /* up to the first without a name */
} kpl_op_spec;

/* The rules, one predicate each, read alike by the inline check below and
 * by the messages (ops_common.c). */
static inline bool kpl__arg_shape_ok(const kpl_arg_spec *a, const kpl_tensor *x)
{
    return (a->rank == 0 || x->ndim == a->rank) && (a->min_rank == 0 || x->ndim >= a->min_rank) &&
           (a->cols == 0 || (x->ndim > 0 && x->shape[x->ndim - 1] == a->cols));
}
static inline bool kpl__arg_dtype_ok(const kpl_arg_spec *a, const kpl_tensor *x)
{
    return a->dtypes == 0 || ((a->dtypes >> x->dtype) & 1u);
}
static inline bool kpl__same_dims(const kpl_tensor *x, const kpl_tensor *r)
{
    bool eq = x->ndim == r->ndim;
    for (int d = 0; eq && d < x->ndim; d++) eq = x->shape[d] == r->shape[d];
    return eq;
}
/* x against y (may be NULL) under a memory rule: `disjoint`, no storage in
 * common; else (in place) exactly y's bytes or none of them. */
static inline bool kpl__memory_ok(bool disjoint, const kpl_tensor *x, const kpl_tensor *y)
{
    if (!y || x->storage != y->storage) return true;
    if (disjoint) return false;
    size_t x0 = x->offset, x1 = x0 + kpl_tensor_nbytes(x);
    size_t y0 = y->offset, y1 = y0 + kpl_tensor_nbytes(y);
    return x1 <= y0 || y1 <= x0 || (x0 == y0 && x1 == y1);
}

/* Whether t[i] passes every rule of spec->arg[i]. */
static inline __attribute__((always_inline)) bool
kpl__ops_arg_ok(const kpl_op_spec *spec, const kpl_tensor *const *t, int i)
{
    const kpl_arg_spec *a = &spec->arg[i];
    const kpl_tensor *x = t[i], *r;
    if (!x) return a->optional;
    if (!kpl__arg_shape_ok(a, x) || !kpl__arg_dtype_ok(a, x)) return false;
    if (a->device && (r = t[a->device - 1]) && x->storage->dev != r->storage->dev) return false;
    if (a->dtype && (r = t[a->dtype - 1]) && x->dtype != r->dtype) return false;
    if (a->shape && (r = t[a->shape - 1]) && !kpl__same_dims(x, r)) return false;
    for (int j = 0; j < KPL_OPS_ARGS; j++)
        if ((((a->disjoint | a->in_place) >> j) & 1u) &&
            !kpl__memory_ok((a->disjoint >> j) & 1u, x, t[j]))
            return false;
    return true;
}

/* The messages (ops_common.c): the first rule t breaks, in the order
 * above, reported. */
kpl_status kpl__ops_check_failed(const char *op, const kpl_op_spec *spec,
                                 const kpl_tensor *const *t) __attribute__((cold, noinline));

/* Checks t[i] against spec->arg[i] (the tensors in the spec's order) as
 * above; KPL_EINVAL, KPL_ESHAPE, KPL_EDTYPE or KPL_EDEVICE naming op and
 * the operand otherwise.  Inline, on a spec the compiler sees: it folds
 * the spec's constants away and leaves the comparisons a hand-written
 * check would make. */
static inline __attribute__((always_inline)) kpl_status
kpl__ops_check(const char *op, const kpl_op_spec *spec, const kpl_tensor *const *t)
{
#pragma GCC unroll 8
    for (int i = 0; i < KPL_OPS_ARGS; i++) {
        if (!spec->arg[i].name) break;
        if (!kpl__ops_arg_ok(spec, t, i)) return kpl__ops_check_failed(op, spec, t);
    }
    return KPL_OK;
}
/* The checks of one operand on its own (rank, dtype), t given, under the
 * caller's name for it (kpl_k_box_check names its argument). */
kpl_status kpl__ops_check_arg(const char *op, const kpl_arg_spec *a, const char *name,
                              const kpl_tensor *t);

/* An argument that is not a tensor (params, an rng, an out-count). */
#define CHECK_ARG(op, t, name) \
    KPL_CHECK((t) != NULL, KPL_EINVAL, "%s: argument '%s' is NULL", (op), (name))

/* ---- what only code can check -------------------------------------------------------- */

/* `t` (an output, or an input whose shape the others fix) has the shape
 * the arguments give, (ndim, shape). */
static inline kpl_status same_shape(const char *op, const kpl_tensor *t, const char *name,
                                    int ndim, const int64_t *shape)
{
    bool eq = t->ndim == ndim;
    for (int i = 0; eq && i < ndim; i++) eq = t->shape[i] == shape[i];
    if (!eq) {
        char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
        return KPL_ERROR(KPL_ESHAPE, "%s: '%s' has shape %s, the result has shape %s", op,
                         name, KPL_SHAPE(t, b1), kpl_shape_str(ndim, shape, b2, sizeof b2));
    }
    return KPL_OK;
}

/* `t` has dtype dt, which the arguments give (a compare's bool result). */
static inline kpl_status want_dtype(const char *op, const kpl_tensor *t, const char *name,
                                    kpl_dtype dt)
{
    KPL_CHECK(t->dtype == dt, KPL_EDTYPE, "%s: '%s' has dtype %s, expected %s", op, name,
              kpl_dtype_name(t->dtype), kpl_dtype_name(dt));
    return KPL_OK;
}

static inline bool is_half(kpl_dtype dt) { return dt == KPL_F16 || dt == KPL_BF16; }

/* ---- dispatch ---------------------------------------------------------------------- */

static inline kpl_status dispatch(kpl_kop kop, kpl_dtype dt, kpl_tensor *out,
                                  const kpl_tensor *a, const kpl_tensor *b,
                                  const kpl_tensor *c, const void *attrs)
{
    kpl_kernel_fn fn;
    KPL_TRY(kpl_kernel_lookup(kop, out->storage->dev->type, dt, &fn));
    kpl_kernel_args args = {.out = out, .in = {a, b, c}, .attrs = attrs};
    return fn(&args);
}

/* Whether out's device runs `kop` on f16/bf16 itself (the CPU's
 * element-wise loops do, in f32 over stack blocks); else kpl__ops_via_f32. */
static inline bool native_half(kpl_kop kop, const kpl_tensor *out, kpl_dtype dt)
{
    return kpl_kernel_registered(kop, out->storage->dev->type, dt);
}

/* Runs a kernel for f16/bf16 operands in f32 (ops_common.c): the half
 * inputs a, b, c (may be NULL) are cast to f32 temporaries (others, e.g.
 * indices, pass as they are), the kernel writes an f32 stand-in for `out`
 * (or `out` itself when `direct`, for bool/i64 results), which is cast
 * back. */
kpl_status kpl__ops_via_f32(kpl_kop kop, kpl_tensor *out, bool direct, const kpl_tensor *a,
                            const kpl_tensor *b, const kpl_tensor *c, const void *attrs);

/* A half-precision convolution or matmul (ops_matmul.c): the device's own
 * kernel when it has one and it is the faster, else f32 math rounded to
 * the half dtype, said once per op and dtype.  `c_written`: the third
 * operand is written (backward weights' bias gradient). */
kpl_status kpl__ops_half_gemm(kpl_kop kop, const char *op, kpl_dtype dt, kpl_tensor *out,
                              const kpl_tensor *a, const kpl_tensor *b, const kpl_tensor *c,
                              bool c_written, const void *attrs);

/* Builds the element-wise plan of an output of shape (ndim, shape) reading
 * `nin` inputs broadcast to it, then drops size-1 dims and merges
 * neighbours that every input walks contiguously, so most calls end with
 * one or two dims.  Inline: the per-call cost of small element-wise ops is
 * mostly this, and the callers' constant `nin` shortens it. */
static inline void kpl__ops_plan_build(kpl_ew_plan *p, int ndim, const int64_t *shape, int nin,
                                       const kpl_tensor *const *in)
{
    int64_t st[3][KPL_MAX_DIMS];
    for (int k = 0; k < nin; k++) {
        const kpl_tensor *t = in[k];
        int64_t s = 1;
        for (int d = ndim - 1; d >= 0; d--) {
            int td = d - (ndim - t->ndim);
            int64_t sz = td >= 0 ? t->shape[td] : 1;
            st[k][d] = (sz == 1) ? 0 : s;
            s *= sz;
        }
    }
    int n = 0;
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        numel *= shape[d];
        if (shape[d] == 1) continue;
        bool merge = n > 0;
        for (int k = 0; merge && k < nin; k++)
            merge = st[k][d] * shape[d] == p->stride[k][n - 1];
        if (merge) {
            p->shape[n - 1] *= shape[d];
            for (int k = 0; k < nin; k++) p->stride[k][n - 1] = st[k][d];
        } else {
            p->shape[n] = shape[d];
            for (int k = 0; k < nin; k++) p->stride[k][n] = st[k][d];
            n++;
        }
    }
    if (n == 0) { /* a single element */
        p->shape[0] = 1;
        for (int k = 0; k < 3; k++) p->stride[k][0] = 0;
        n = 1;
    }
    for (int k = nin; k < 3; k++)
        for (int d = 0; d < n; d++) p->stride[k][d] = 0;
    p->ndim = n;
    p->numel = numel;
}

#endif /* KPL_OPS_IMPL_H */
