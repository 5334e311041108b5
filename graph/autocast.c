/*
 * autocast.c — the precision policy of mixed-precision training (as
 * torch.autocast): while a thread's autocast dtype is bf16 or f16, the
 * eager ops cast their floating inputs by the op's class before they
 * compute:
 *
 *   LOW      convolutions and matmuls run in the low dtype (the inputs are
 *            cast; parameters keep their f32 master copies, and the cast's
 *            gradient brings each low-precision gradient back to f32);
 *   F32      reductions, exp/log and the other range-sensitive math, norms'
 *            statistics, pooling, losses (composed of these) run in f32;
 *   PROMOTE  binary ops on mixed dtypes run in the wider one (a bf16
 *            activation plus an f32 bias is f32);
 *   KEEP     everything else runs in its input's dtype (data movement,
 *            ReLU and the other sign/clip-like maps, whose result is exact
 *            in the low dtype).
 *
 * The casts are ordinary recorded ops, so backward needs no policy of its
 * own: kpl_backward turns autocast off while it runs, and every gradient
 * flows back through the dtypes its forward used.  docs/precision.md has
 * the table.
 */
#include "graph_impl.h"

static _Thread_local kpl_dtype tl_autocast = KPL_F32;

kpl_dtype kpl_autocast_dtype(void) { return tl_autocast; }

kpl_status kpl_set_autocast(kpl_dtype dt, kpl_dtype *prev)
{
    KPL_CHECK(dt == KPL_F32 || dt == KPL_BF16 || dt == KPL_F16, KPL_EDTYPE,
              "autocast: dtype %s is not a precision (f32, bf16 or f16)", kpl_dtype_name(dt));
    if (prev) *prev = tl_autocast;
    tl_autocast = dt;
    return KPL_OK;
}

static const kpl_autocast_class classes[KPL_OP_COUNT] = {
    [KPL_OP_MATMUL] = KPL_AUTOCAST_LOW,
    [KPL_OP_CONV2D] = KPL_AUTOCAST_LOW, [KPL_OP_CONV2D_RELU] = KPL_AUTOCAST_LOW,
    [KPL_OP_CONV2D_BWD_DATA] = KPL_AUTOCAST_LOW, /* conv_transpose2d */
    [KPL_OP_CONV2D_BWD_WEIGHT] = KPL_AUTOCAST_LOW,

    [KPL_OP_EXP] = KPL_AUTOCAST_F32, [KPL_OP_LOG] = KPL_AUTOCAST_F32,
    [KPL_OP_SQRT] = KPL_AUTOCAST_F32, [KPL_OP_RSQRT] = KPL_AUTOCAST_F32,
    [KPL_OP_SQUARE] = KPL_AUTOCAST_F32, [KPL_OP_RECIPROCAL] = KPL_AUTOCAST_F32,
    [KPL_OP_SIN] = KPL_AUTOCAST_F32, [KPL_OP_COS] = KPL_AUTOCAST_F32,
    [KPL_OP_GELU] = KPL_AUTOCAST_F32, [KPL_OP_GELU_TANH] = KPL_AUTOCAST_F32,
    [KPL_OP_ERF] = KPL_AUTOCAST_F32, [KPL_OP_SOFTPLUS] = KPL_AUTOCAST_F32,
    [KPL_OP_POW] = KPL_AUTOCAST_F32, [KPL_OP_POW_SCALAR] = KPL_AUTOCAST_F32,
    [KPL_OP_SUM] = KPL_AUTOCAST_F32, [KPL_OP_MEAN] = KPL_AUTOCAST_F32,
    [KPL_OP_VAR] = KPL_AUTOCAST_F32, [KPL_OP_LOGSUMEXP] = KPL_AUTOCAST_F32,
    [KPL_OP_BATCH_NORM] = KPL_AUTOCAST_MIXED, [KPL_OP_BATCH_NORM_RELU] = KPL_AUTOCAST_MIXED,
    [KPL_OP_ROI_ALIGN] = KPL_AUTOCAST_F32, [KPL_OP_ROI_ALIGN_BWD] = KPL_AUTOCAST_F32,

    [KPL_OP_ADD] = KPL_AUTOCAST_PROMOTE, [KPL_OP_SUB] = KPL_AUTOCAST_PROMOTE,
    [KPL_OP_MUL] = KPL_AUTOCAST_PROMOTE, [KPL_OP_DIV] = KPL_AUTOCAST_PROMOTE,
    [KPL_OP_MAXIMUM] = KPL_AUTOCAST_PROMOTE, [KPL_OP_MINIMUM] = KPL_AUTOCAST_PROMOTE,
    [KPL_OP_WHERE] = KPL_AUTOCAST_PROMOTE, [KPL_OP_SCATTER_ADD] = KPL_AUTOCAST_PROMOTE,
    /* the rest: KPL_AUTOCAST_KEEP (0) */
};

kpl_autocast_class kpl_autocast_class_of(kpl_op op)
{
    return (unsigned)op < KPL_OP_COUNT ? classes[op] : KPL_AUTOCAST_KEEP;
}

static bool is_low(kpl_dtype dt) { return dt == KPL_BF16 || dt == KPL_F16; }

/* Width rank for promotion: bf16 and f16 meet in f32. */
static kpl_dtype wider(kpl_dtype a, kpl_dtype b)
{
    if (a == b) return a;
    if (a == KPL_F64 || b == KPL_F64) return KPL_F64;
    return KPL_F32;
}

kpl_tensor *kpl__autocast(kpl_op op, kpl_tensor *x)
{
    if (!x || tl_autocast == KPL_F32) return x;
    kpl_dtype dt = kpl_tensor_dtype(x);
    switch (kpl_autocast_class_of(op)) {
    case KPL_AUTOCAST_LOW:
        /* f64 stays f64: it is asked for on purpose (gradient checks) */
        return dt == KPL_F32 || (is_low(dt) && dt != tl_autocast) ? kpl_cast(x, tl_autocast) : x;
    case KPL_AUTOCAST_F32: return is_low(dt) ? kpl_cast(x, KPL_F32) : x;
    default: return x;
    }
}

void kpl__autocast_pair(kpl_op op, kpl_tensor **a, kpl_tensor **b)
{
    if (tl_autocast == KPL_F32 || !*a || !*b) return;
    kpl_autocast_class c = kpl_autocast_class_of(op);
    if (c == KPL_AUTOCAST_LOW || c == KPL_AUTOCAST_F32) {
        *a = kpl__autocast(op, *a);
        *b = kpl__autocast(op, *b);
        return;
    }
    if (c != KPL_AUTOCAST_PROMOTE) return;
    kpl_dtype da = kpl_tensor_dtype(*a), db = kpl_tensor_dtype(*b);
    if (da == db || !kpl_dtype_is_float(da) || !kpl_dtype_is_float(db)) return;
    kpl_dtype w = wider(da, db);
    if (da != w) *a = kpl_cast(*a, w);
    if (db != w) *b = kpl_cast(*b, w);
}
