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

kpl_autocast_class kpl_autocast_class_of(kpl_op op)
{
    const kpl_op_info *r = kpl_op_info_of(op);
    return r ? r->autocast : KPL_AUTOCAST_KEEP;
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
