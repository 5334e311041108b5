/*
 * ops_index.c — the front end of the index ops, in adjoint pairs:
 * kpl_k_index_select / kpl_k_index_add (rows of one axis by a 1-D index)
 * and kpl_k_gather / kpl_k_scatter_add (torch.gather and its adjoint).
 * The index values themselves are checked by the kernels, which report
 * the first bad one (cuda/cuda_impl.h: on CUDA at the next
 * synchronisation).
 */
#include "ops_impl.h"

/* ---- index_select / index_add ----------------------------------------------------- */

/* kpl_k_index_select(out, x, axis, idx) */
enum { SEL_X, SEL_IDX, SEL_OUT };
static const kpl_op_spec index_select_spec = {{
    [SEL_X] = {.name = "x"},
    [SEL_IDX] = {"idx", .rank = 1, .shape_is = "expected (K)", .dtypes = KPL_DT(KPL_I64),
                 .device = KPL_AS(SEL_X)},
    [SEL_OUT] = {"out", .device = KPL_AS(SEL_X), .dtype = KPL_AS(SEL_X),
                 .disjoint = KPL_ARGSET(SEL_X)},
}};
/* kpl_k_index_add(out, g, axis, idx) */
enum { ADD_OUT, ADD_G, ADD_IDX };
static const kpl_op_spec index_add_spec = {{
    [ADD_OUT] = {"out", .dtypes = KPL_DT_FLOAT, .disjoint = KPL_ARGSET(ADD_G)},
    [ADD_G] = {"g", .device = KPL_AS(ADD_OUT), .dtype = KPL_AS(ADD_OUT)},
    [ADD_IDX] = {"idx", .rank = 1, .shape_is = "expected (K)", .dtypes = KPL_DT(KPL_I64),
                 .device = KPL_AS(ADD_OUT)},
}};

/* What index_select and index_add share once their operands passed their
 * specs: `big` (x, or index_add's out) and `small` (out, or g) agree but
 * along axis, where small has idx's length; the (outer, dim, inner)
 * geometry. */
static inline kpl_status index_common(const char *op, const kpl_tensor *big,
                                      const kpl_tensor *small, int axis, const kpl_tensor *idx,
                                      kpl_index_attrs *a)
{
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    int ax = axis < 0 ? axis + big->ndim : axis;
    KPL_CHECK(ax >= 0 && ax < big->ndim, KPL_ESHAPE, "%s: axis %d out of range for %s", op, axis,
              KPL_SHAPE(big, b1));
    bool ok = small->ndim == big->ndim && small->shape[ax] == idx->shape[0];
    for (int d = 0; ok && d < big->ndim; d++) ok = d == ax || small->shape[d] == big->shape[d];
    KPL_CHECK(ok, KPL_ESHAPE, "%s: %s and %s must match except along axis %d, which must be %lld",
              op, KPL_SHAPE(big, b1), KPL_SHAPE(small, b2), axis, (long long)idx->shape[0]);
    a->outer = 1;
    a->inner = 1;
    for (int d = 0; d < ax; d++) a->outer *= big->shape[d];
    for (int d = ax + 1; d < big->ndim; d++) a->inner *= big->shape[d];
    a->dim = big->shape[ax];
    a->k = idx->shape[0];
    return KPL_OK;
}

kpl_status kpl_k_index_select(kpl_tensor *out, const kpl_tensor *x, int axis,
                              const kpl_tensor *idx)
{
    const char *op = "index_select";
    KPL_TRY(kpl__ops_check(op, &index_select_spec, (const kpl_tensor *[]){x, idx, out}));
    kpl_index_attrs a = {.kind = KPL_INDEX_SELECT};
    KPL_TRY(index_common(op, x, out, axis, idx, &a));
    if (out->numel == 0) return KPL_OK;
    return dispatch(KPL_KOP_INDEX, x->dtype, out, x, idx, NULL, &a);
}

kpl_status kpl_k_index_add(kpl_tensor *out, const kpl_tensor *g, int axis, const kpl_tensor *idx)
{
    const char *op = "index_add";
    KPL_TRY(kpl__ops_check(op, &index_add_spec, (const kpl_tensor *[]){out, g, idx}));
    kpl_index_attrs a = {.kind = KPL_INDEX_ADD};
    KPL_TRY(index_common(op, out, g, axis, idx, &a));
    if (out->numel == 0) return KPL_OK;
    if (is_half(out->dtype)) return kpl__ops_via_f32(KPL_KOP_INDEX, out, false, g, idx, NULL, &a);
    return dispatch(KPL_KOP_INDEX, out->dtype, out, g, idx, NULL, &a);
}

/* ---- gather / scatter_add --------------------------------------------------------- */

/* kpl_k_gather(out, x, axis, idx) */
enum { GA_X, GA_IDX, GA_OUT };
static const kpl_op_spec gather_spec = {{
    [GA_X] = {.name = "x"},
    [GA_IDX] = {"idx", .dtypes = KPL_DT(KPL_I64), .device = KPL_AS(GA_X)},
    [GA_OUT] = {"out", .device = KPL_AS(GA_X), .dtype = KPL_AS(GA_X),
                .disjoint = KPL_ARGSET(GA_X) | KPL_ARGSET(GA_IDX)},
}};
/* kpl_k_scatter_add(out, x, axis, idx, src) */
enum { SA_X, SA_IDX, SA_SRC, SA_OUT };
static const kpl_op_spec scatter_add_spec = {{
    [SA_X] = {"x", .dtypes = KPL_DT_F32_F64},
    [SA_IDX] = {"idx", .dtypes = KPL_DT(KPL_I64), .device = KPL_AS(SA_X)},
    [SA_SRC] = {"src", .device = KPL_AS(SA_X), .dtype = KPL_AS(SA_X), .shape = KPL_AS(SA_IDX)},
    [SA_OUT] = {"out", .device = KPL_AS(SA_X), .dtype = KPL_AS(SA_X),
                .disjoint = KPL_ARGSET(SA_X) | KPL_ARGSET(SA_IDX) | KPL_ARGSET(SA_SRC)},
}};

/* What gather and scatter_add share once their operands passed their
 * specs: idx against x along axis, and the merged geometry of
 * kpl_index_attrs. */
static kpl_status gather_common(const char *op, const kpl_tensor *x, int axis,
                                const kpl_tensor *idx, kpl_index_attrs *a)
{
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    int ax = axis < 0 ? axis + x->ndim : axis;
    KPL_CHECK(ax >= 0 && ax < x->ndim, KPL_ESHAPE, "%s: axis %d is out of range for x %s", op,
              axis, KPL_SHAPE(x, b1));
    KPL_CHECK(idx->ndim == x->ndim, KPL_ESHAPE,
              "%s: idx %s has %d dims and x %s has %d; they must have the same number", op,
              KPL_SHAPE(idx, b1), idx->ndim, KPL_SHAPE(x, b2), x->ndim);
    for (int d = 0; d < x->ndim; d++)
        KPL_CHECK(d == ax || idx->shape[d] <= x->shape[d], KPL_ESHAPE,
                  "%s: idx %s is larger than x %s in dim %d (%lld > %lld); only along axis "
                  "%d may it be larger",
                  op, KPL_SHAPE(idx, b1), KPL_SHAPE(x, b2), d, (long long)idx->shape[d],
                  (long long)x->shape[d], ax);
    /* Dim d joins the one before it (neither being the axis) when idx and
     * x agree in d: a position's flat index over the two is then the same
     * number in both, whatever the outer of the two holds. */
    a->ndim = 0;
    a->axis = -1;
    for (int d = 0; d < x->ndim; d++) {
        int last = a->ndim - 1;
        if (last >= 0 && d != ax && last != a->axis && idx->shape[d] == x->shape[d]) {
            a->ishape[last] *= idx->shape[d];
            a->xshape[last] *= x->shape[d];
            continue;
        }
        if (d == ax) a->axis = a->ndim;
        a->ishape[a->ndim] = idx->shape[d];
        a->xshape[a->ndim++] = x->shape[d];
    }
    a->outer = 1;
    a->inner = 1;
    a->xinner = 1;
    for (int d = 0; d < a->axis; d++) a->outer *= a->ishape[d];
    for (int d = a->axis + 1; d < a->ndim; d++) {
        a->inner *= a->ishape[d];
        a->xinner *= a->xshape[d];
    }
    a->k = a->ishape[a->axis];
    a->dim = a->xshape[a->axis];
    a->simple = a->axis <= 1 && a->ndim - a->axis <= 2;
    return KPL_OK;
}

/* The kernel's KPL_ERANGE in the caller's terms: the position in idx as
 * coordinates, the axis and the valid range. */
static kpl_status gather_range_error(const char *op, kpl_status st, const kpl_tensor *x,
                                     int axis, const kpl_tensor *idx, const int64_t *bad)
{
    if (st != KPL_ERANGE || bad[0] < 0) return st;
    int64_t pos[KPL_MAX_DIMS], f = bad[0];
    for (int d = idx->ndim - 1; d >= 0; d--) {
        pos[d] = f % idx->shape[d];
        f /= idx->shape[d];
    }
    int ax = axis < 0 ? axis + x->ndim : axis;
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    return KPL_ERROR(KPL_ERANGE,
                     "%s: index %lld at position %s of idx is outside [0, %lld) along axis %d "
                     "of x %s",
                     op, (long long)bad[1], kpl_shape_str(idx->ndim, pos, b1, sizeof b1),
                     (long long)x->shape[ax], ax, KPL_SHAPE(x, b2));
}

kpl_status kpl_k_gather(kpl_tensor *out, const kpl_tensor *x, int axis, const kpl_tensor *idx)
{
    const char *op = "gather";
    KPL_TRY(kpl__ops_check(op, &gather_spec, (const kpl_tensor *[]){x, idx, out}));
    int64_t bad[2] = {-1, 0};
    kpl_index_attrs a = {.kind = KPL_INDEX_GATHER, .bad = bad};
    KPL_TRY(gather_common(op, x, axis, idx, &a));
    KPL_TRY(same_shape(op, out, "out", idx->ndim, idx->shape));
    if (out->numel == 0) return KPL_OK;
    kpl_status st = dispatch(KPL_KOP_INDEX, x->dtype, out, x, idx, NULL, &a);
    return gather_range_error(op, st, x, axis, idx, bad);
}

kpl_status kpl_k_scatter_add(kpl_tensor *out, const kpl_tensor *x, int axis,
                             const kpl_tensor *idx, const kpl_tensor *src)
{
    const char *op = "scatter_add";
    KPL_TRY(kpl__ops_check(op, &scatter_add_spec, (const kpl_tensor *[]){x, idx, src, out}));
    int64_t bad[2] = {-1, 0};
    kpl_index_attrs a = {.kind = KPL_INDEX_SCATTER_ADD, .bad = bad};
    KPL_TRY(gather_common(op, x, axis, idx, &a));
    KPL_TRY(same_shape(op, out, "out", x->ndim, x->shape));
    KPL_TRY(kpl_k_copy(out, x));
    if (idx->numel == 0) return KPL_OK;
    kpl_status st = dispatch(KPL_KOP_INDEX, out->dtype, out, src, idx, NULL, &a);
    return gather_range_error(op, st, x, axis, idx, bad);
}
