/*
 * ops.c — the front end of the compute calls (kpl_k_*).
 *
 * Each call validates its arguments (NULLs, devices, dtypes, shapes) and
 * reports a failure with the op name and the shapes involved, then turns the
 * call into a device-independent kernel description (an element-wise plan,
 * an (outer, red, inner) reduction, padded matmul dims) and dispatches to the
 * kernel registered for (op, device type, dtype).  The kernels themselves
 * (cpu/, cuda/) trust what they get.
 *
 * f16 and bf16 compute natively where a device registers a kernel for them
 * (convolution and matmul: oneDNN on AVX512-BF16 / AMX CPUs, cuDNN and
 * cuBLAS on GPUs); everything else runs in f32 through temporary casts,
 * here, once, for every device.
 */
#include "ops_impl.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
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
static const char *const reduce_names[KPL_REDUCE_COUNT] = {
    [KPL_RED_SUM] = "sum",       [KPL_RED_MEAN] = "mean",
    [KPL_RED_MAX] = "max",       [KPL_RED_MIN] = "min",
    [KPL_RED_ARGMAX] = "argmax", [KPL_RED_ARGMIN] = "argmin",
    [KPL_RED_VAR] = "var",       [KPL_RED_LOGSUMEXP] = "logsumexp",
    [KPL_RED_SUMEXP_SUB_MAX] = "sumexp_sub_max",
};

const char *kpl_unary_name(kpl_unary_op op)
{
    return (unsigned)op < KPL_UNARY_COUNT ? unary_names[op] : "invalid-unary";
}
const char *kpl_binary_name(kpl_binary_op op)
{
    return (unsigned)op < KPL_BINARY_COUNT ? binary_names[op] : "invalid-binary";
}
const char *kpl_reduce_name(kpl_reduce_op op)
{
    return (unsigned)op < KPL_REDUCE_COUNT ? reduce_names[op] : "invalid-reduce";
}
bool kpl_binary_is_compare(kpl_binary_op op) { return op >= KPL_BIN_EQ && op <= KPL_BIN_GE; }

/* ---- f16 and bf16 through f32 -------------------------------------------------- */

/* A temporary f32 copy of a half tensor (caller releases). */
static kpl_status half_to_f32(const kpl_tensor *t, kpl_tensor **out)
{
    KPL_TRY(kpl_tensor_empty(t->storage->dev, KPL_F32, t->ndim, t->shape, out));
    kpl_status st = kpl_k_cast(*out, t);
    if (st < 0) {
        kpl_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

/* An f32 stand-in for a half output (released after the result is cast). */
static kpl_status f32_like(const kpl_tensor *t, kpl_tensor **out)
{
    return kpl_tensor_empty(t->storage->dev, KPL_F32, t->ndim, t->shape, out);
}

/* Runs a kernel for f16/bf16 operands in f32: the half inputs are cast to
 * f32 temporaries (others, e.g. indices, pass as they are), the kernel
 * writes an f32 stand-in for `out` (or `out` itself when `direct`, for
 * bool/i64 results), which is cast back. */
static kpl_status via_f32_3(kpl_kop kop, kpl_tensor *out, bool direct, const kpl_tensor *a,
                            const kpl_tensor *b, const kpl_tensor *c, const void *attrs)
{
    const kpl_tensor *in[3] = {a, b, c};
    kpl_tensor *f[3] = {NULL, NULL, NULL}, *of = NULL;
    kpl_status st = KPL_OK;
    for (int i = 0; i < 3; i++)
        if (in[i] && is_half(in[i]->dtype)) {
            KPL_TRY_GOTO(half_to_f32(in[i], &f[i]));
            in[i] = f[i];
        }
    if (!direct) KPL_TRY_GOTO(f32_like(out, &of));
    KPL_TRY_GOTO(dispatch(kop, KPL_F32, direct ? out : of, in[0], in[1], in[2], attrs));
    st = direct ? KPL_OK : kpl_k_cast(out, of);
fail:
    kpl_tensor_release(of);
    for (int i = 0; i < 3; i++) kpl_tensor_release(f[i]);
    return st;
}

/* Whether out's device runs `kop` on f16/bf16 itself (the CPU's
 * element-wise loops do, in f32 over stack blocks); else via_f32. */
static bool native_half(kpl_kop kop, const kpl_tensor *out, kpl_dtype dt)
{
    return kpl_kernel_registered(kop, out->storage->dev->type, dt);
}

static kpl_status via_f32(kpl_kop kop, kpl_tensor *out, bool direct, const kpl_tensor *a,
                          const kpl_tensor *b, const void *attrs)
{
    return via_f32_3(kop, out, direct, a, b, NULL, attrs);
}

/* The emulated form of a half-precision convolution or matmul: f32 math,
 * rounded.  `c_written`: the third operand is written (backward weights'
 * bias gradient) and gets an f32 stand-in of its own. */
static kpl_status half_emulated(kpl_kop kop, kpl_tensor *out, const kpl_tensor *a,
                                const kpl_tensor *b, const kpl_tensor *c, bool c_written,
                                const void *attrs)
{
    if (!c || !c_written || !is_half(c->dtype))
        return via_f32_3(kop, out, false, a, b, c, attrs);
    kpl_tensor *cf = NULL;
    kpl_status st = f32_like(c, &cf);
    if (st >= 0) st = via_f32_3(kop, out, false, a, b, cf, attrs);
    if (st >= 0) st = kpl_k_cast((kpl_tensor *)c, cf);
    kpl_tensor_release(cf);
    return st;
}

/* Native or emulated, per problem: on the CPU a native bf16 kernel is not
 * always the faster (oneDNN's bf16 convolutions want blocked layouts, and
 * the reorders to and from kpl's plain tensors cost more than the math on
 * narrow layers, where kpl's own f32 loops win), so the first call of a
 * shape times both (after a warm-up run each) and keeps the faster, as the
 * algorithm choosers do.  Deterministic mode and GPUs take the native
 * kernel untimed, and so do blocked operands (below). */
typedef struct {
    kpl_kop kop;
    kpl_dtype dt;
    int threads;
    kpl_conv_attrs conv; /* normalised (kpl_conv_attrs_key), or zeros */
    int ndim;
    int64_t a[KPL_MAX_DIMS], b[KPL_MAX_DIMS];
    int trans;
} half_key;

#define HALF_CAP 512
static struct {
    pthread_mutex_t lock;
    half_key k[HALF_CAP];
    bool native[HALF_CAP];
    int n, next; /* entries, and the one a full cache replaces next */
} hc = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void half_key_of(kpl_kop kop, kpl_dtype dt, const void *attrs, half_key *k)
{
    memset(k, 0, sizeof *k);
    k->kop = kop, k->dt = dt, k->threads = kpl_get_num_threads();
    if (kop == KPL_KOP_CONV2D || kop == KPL_KOP_CONV2D_RELU) {
        kpl_conv_attrs_key(&k->conv, attrs);
        return;
    }
    const kpl_matmul_attrs *m = attrs;
    k->ndim = m->ndim;
    for (int d = 0; d < m->ndim; d++) k->a[d] = m->a_dims[d], k->b[d] = m->b_dims[d];
    k->trans = (int)m->trans_a * 2 + (int)m->trans_b;
}

static int half_find(const half_key *k)
{
    for (int i = 0; i < hc.n; i++)
        if (!memcmp(&hc.k[i], k, sizeof *k)) return i;
    return -1;
}

/* Seconds of the second of two runs (the first builds and warms). */
static double half_time(kpl_kop kop, bool native, kpl_tensor *out, const kpl_tensor *a,
                        const kpl_tensor *b, const kpl_tensor *c, bool c_written,
                        const void *attrs, kpl_status *st)
{
    double t = 0;
    for (int r = 0; r < 2 && *st >= 0; r++) {
        double t0 = kpl_seconds();
        *st = native ? dispatch(kop, out->dtype, out, a, b, c, attrs)
                     : half_emulated(kop, out, a, b, c, c_written, attrs);
        t = kpl_seconds() - t0;
    }
    return t;
}

/* A half-precision convolution or matmul: the device's own kernel when it
 * has one (and it is the faster, above), else f32 math rounded to the half
 * dtype, said once per op and dtype (never a silent slowdown). */
static kpl_status half_gemm(kpl_kop kop, const char *op, kpl_dtype dt, kpl_tensor *out,
                            const kpl_tensor *a, const kpl_tensor *b, const kpl_tensor *c,
                            bool c_written, const void *attrs)
{
    kpl_device_type dev = out->storage->dev->type;
    if (!kpl_kernel_registered(kop, dev, dt)) {
        static atomic_int said[2][2];
        if (!atomic_exchange(&said[kop == KPL_KOP_MATMUL][dt == KPL_F16], 1))
            fprintf(stderr,
                    "kpl: %s has no native %s kernel on %s%s; computing it in f32 and rounding "
                    "(correct, slower than f32)\n",
                    op, kpl_dtype_name(dt), dev == KPL_DEVICE_CPU ? "this CPU" : "cuda",
                    dev == KPL_DEVICE_CPU && dt == KPL_BF16 ? " (no AVX512-BF16 or AMX in use)"
                                                             : "");
        return half_emulated(kop, out, a, b, c, c_written, attrs);
    }
    /* An operand held blocked (kpl_set_blocked_layouts) comes from a native
     * neighbour, whose layout the native kernel reads as it is: the f32
     * detour would turn it plain, and its result, plain, would be reordered
     * again by the next layer, which the timing cannot see. */
    if (dev != KPL_DEVICE_CPU || kpl_get_deterministic() || kpl__blocked_data(a) ||
        kpl__blocked_data(b))
        return dispatch(kop, dt, out, a, b, c, attrs);
    half_key k;
    half_key_of(kop, dt, attrs, &k);
    pthread_mutex_lock(&hc.lock);
    int i = half_find(&k);
    int native = i >= 0 ? hc.native[i] : -1;
    pthread_mutex_unlock(&hc.lock);
    if (native >= 0)
        return native ? dispatch(kop, dt, out, a, b, c, attrs)
                      : half_emulated(kop, out, a, b, c, c_written, attrs);
    kpl_status st = KPL_OK;
    double tn = half_time(kop, true, out, a, b, c, c_written, attrs, &st);
    double te = half_time(kop, false, out, a, b, c, c_written, attrs, &st);
    if (st < 0) return st;
    pthread_mutex_lock(&hc.lock);
    if (half_find(&k) < 0) {
        int at = hc.n < HALF_CAP ? hc.n++ : (hc.next++ % HALF_CAP);
        hc.k[at] = k;
        hc.native[at] = tn <= te;
    }
    pthread_mutex_unlock(&hc.lock);
    return KPL_OK; /* out holds the (emulated) result of the last timed run */
}

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

/* Matmul operands normalised to >= 2 dims; `drop_row/col` remember which
 * dims numpy removes again for 1-D operands. */
typedef struct {
    int ndim; /* of the padded problem, >= 3 */
    int64_t a[KPL_MAX_DIMS], b[KPL_MAX_DIMS], out[KPL_MAX_DIMS];
    int64_t m, n, k;
    bool drop_row, drop_col;
} mm_shape;

static kpl_status matmul_infer(int na, const int64_t *a, bool ta, int nb,
                               const int64_t *b, bool tb, mm_shape *s)
{
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(na >= 1 && nb >= 1, KPL_ESHAPE,
              "matmul: operands need at least 1 dim, got %s and %s",
              kpl_shape_str(na, a, b1, sizeof b1), kpl_shape_str(nb, b, b2, sizeof b2));
    int64_t A[KPL_MAX_DIMS], B[KPL_MAX_DIMS];
    int ra = na, rb = nb;
    memset(s, 0, sizeof *s);
    if (na == 1) { /* (K) -> (1, K) */
        A[0] = 1;
        A[1] = a[0];
        ra = 2;
        ta = false;
        s->drop_row = true;
    } else {
        memcpy(A, a, (size_t)na * sizeof *a);
    }
    if (nb == 1) { /* (K) -> (K, 1) */
        B[0] = b[0];
        B[1] = 1;
        rb = 2;
        tb = false;
        s->drop_col = true;
    } else {
        memcpy(B, b, (size_t)nb * sizeof *b);
    }
    int64_t m = ta ? A[ra - 1] : A[ra - 2], ka = ta ? A[ra - 2] : A[ra - 1];
    int64_t kb = tb ? B[rb - 1] : B[rb - 2], n = tb ? B[rb - 2] : B[rb - 1];
    KPL_CHECK(ka == kb, KPL_ESHAPE,
              "matmul: inner dims differ: %s%s @ %s%s (%lld vs %lld)",
              kpl_shape_str(na, a, b1, sizeof b1), ta ? "^T" : "",
              kpl_shape_str(nb, b, b2, sizeof b2), tb ? "^T" : "", (long long)ka,
              (long long)kb);
    int nbat_a = ra - 2, nbat_b = rb - 2;
    int nbat = nbat_a > nbat_b ? nbat_a : nbat_b;
    int64_t bat[KPL_MAX_DIMS];
    int nb_out;
    if (nbat > 0) {
        KPL_TRY(kpl_shape_broadcast("matmul (batch dims)", nbat_a, A, nbat_b, B, &nb_out,
                                    bat));
    } else {
        nb_out = 0;
    }
    KPL_CHECK(nbat + 2 <= KPL_MAX_DIMS, KPL_ESHAPE, "matmul: too many dims");
    /* Pad to at least one batch dim so kernels see >= 3 dims. */
    int pad = nbat == 0 ? 1 : nbat;
    s->ndim = pad + 2;
    for (int i = 0; i < pad; i++) {
        int ia = i - (pad - nbat_a), ib = i - (pad - nbat_b);
        s->a[i] = ia >= 0 ? A[ia] : 1;
        s->b[i] = ib >= 0 ? B[ib] : 1;
        s->out[i] = nbat == 0 ? 1 : bat[i];
    }
    s->a[pad] = A[ra - 2];
    s->a[pad + 1] = A[ra - 1];
    s->b[pad] = B[rb - 2];
    s->b[pad + 1] = B[rb - 1];
    s->out[pad] = m;
    s->out[pad + 1] = n;
    s->m = m;
    s->n = n;
    s->k = ka;
    (void)nb_out;
    return KPL_OK;
}

static void matmul_out_shape(const mm_shape *s, int nbat, int *nout, int64_t *out)
{
    int n = 0;
    int pad = s->ndim - 2;
    for (int i = pad - nbat; i < pad; i++) out[n++] = s->out[i];
    if (!s->drop_row) out[n++] = s->m;
    if (!s->drop_col) out[n++] = s->n;
    *nout = n;
}

kpl_status kpl_shape_matmul(int na, const int64_t *a, bool trans_a, int nb,
                            const int64_t *b, bool trans_b, int *nout, int64_t *out)
{
    mm_shape s;
    KPL_TRY(matmul_infer(na, a, trans_a, nb, b, trans_b, &s));
    int nbat = (na > 2 ? na - 2 : 0) > (nb > 2 ? nb - 2 : 0) ? na - 2 : (nb > 2 ? nb - 2 : 0);
    matmul_out_shape(&s, nbat, nout, out);
    return KPL_OK;
}

/* ---- element-wise plans ------------------------------------------------------- */

/* Builds the plan of an output of shape (ndim, shape) reading `nin` inputs,
 * then drops size-1 dims and merges neighbours that every input walks
 * contiguously, so most calls end with one or two dims. */
static void plan_build(kpl_ew_plan *p, int ndim, const int64_t *shape, int nin,
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

/* ---- unary ------------------------------------------------------------------ */

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
    CHECK_ARG(name, out, "out");
    CHECK_ARG(name, x, "x");
    KPL_TRY(same_device(name, out, "out", x, "x"));
    KPL_TRY(same_shape(name, out, x->ndim, x->shape));
    KPL_TRY(want_dtype(name, out, "out", x->dtype));
    KPL_TRY(no_partial_overlap(name, out, x, "x"));
    kpl_dtype dt = x->dtype;
    KPL_CHECK(kpl_dtype_is_float(dt) || ((dt == KPL_I32 || dt == KPL_I64) && unary_int_ok(op)),
              KPL_EDTYPE, "%s: not defined for dtype %s", name, kpl_dtype_name(dt));
    if (op == KPL_UN_CLIP)
        KPL_CHECK(alpha <= beta, KPL_EINVAL, "clip: lo %g is greater than hi %g", alpha, beta);
    if (x->numel == 0) return KPL_OK;
    kpl_unary_attrs attrs = {op, alpha, beta};
    if (is_half(dt) && !native_half(KPL_KOP_UNARY, out, dt))
        return via_f32(KPL_KOP_UNARY, out, false, x, NULL, &attrs);
    return dispatch(KPL_KOP_UNARY, dt, out, x, NULL, NULL, &attrs);
}

/* ---- binary ----------------------------------------------------------------- */

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
    KPL_TRY(same_shape(name, out, n, shape));
    KPL_TRY(want_dtype(name, out, "out", kpl_binary_is_compare(attrs->op) ? KPL_BOOL : dt));
    KPL_TRY(no_partial_overlap(name, out, a, "a"));
    KPL_TRY(no_partial_overlap(name, out, b, "b"));
    KPL_TRY(binary_dtype_ok(name, attrs->op, dt));
    /* An input that shares out's storage must be read at out's own index. */
    if (b && out->storage == b->storage && b->numel != out->numel)
        return KPL_ERROR(KPL_EINVAL, "%s: in-place 'out' is 'b' but 'b' is broadcast", name);
    if (out->storage == a->storage && a->numel != out->numel)
        return KPL_ERROR(KPL_EINVAL, "%s: in-place 'out' is 'a' but 'a' is broadcast", name);
    if (out->numel == 0) return KPL_OK;
    const kpl_tensor *ins[2] = {a, b};
    plan_build(&attrs->plan, n, shape, b ? 2 : 1, ins);

    if (is_half(dt) && !native_half(KPL_KOP_BINARY, out, dt))
        return via_f32(KPL_KOP_BINARY, out, kpl_binary_is_compare(attrs->op), a, b, attrs);
    return dispatch(KPL_KOP_BINARY, dt, out, a, b, NULL, attrs);
}

kpl_status kpl_k_binary(kpl_tensor *out, kpl_binary_op op, const kpl_tensor *a,
                        const kpl_tensor *b)
{
    KPL_CHECK((unsigned)op < KPL_BINARY_COUNT, KPL_EINVAL, "binary: unknown op %d", (int)op);
    const char *name = binary_names[op];
    CHECK_ARG(name, out, "out");
    CHECK_ARG(name, a, "a");
    CHECK_ARG(name, b, "b");
    KPL_TRY(same_device(name, a, "a", b, "b"));
    KPL_TRY(same_device(name, out, "out", a, "a"));
    KPL_CHECK(a->dtype == b->dtype, KPL_EDTYPE,
              "%s: dtypes %s and %s differ (cast one of them explicitly)", name,
              kpl_dtype_name(a->dtype), kpl_dtype_name(b->dtype));
    kpl_binary_attrs attrs = {.op = op};
    return binary_run(out, &attrs, a, b);
}

kpl_status kpl_k_binary_scalar(kpl_tensor *out, kpl_binary_op op, const kpl_tensor *a,
                               double s, bool scalar_first)
{
    KPL_CHECK((unsigned)op < KPL_BINARY_COUNT, KPL_EINVAL, "binary: unknown op %d", (int)op);
    const char *name = binary_names[op];
    CHECK_ARG(name, out, "out");
    CHECK_ARG(name, a, "a");
    KPL_TRY(same_device(name, out, "out", a, "a"));
    kpl_binary_attrs attrs = {
        .op = op, .has_scalar = true, .scalar_first = scalar_first, .scalar = s};
    return binary_run(out, &attrs, a, NULL);
}

/* ---- where ------------------------------------------------------------------ */

kpl_status kpl_k_where(kpl_tensor *out, const kpl_tensor *cond, const kpl_tensor *a,
                       const kpl_tensor *b)
{
    const char *name = "where";
    CHECK_ARG(name, out, "out");
    CHECK_ARG(name, cond, "cond");
    CHECK_ARG(name, a, "a");
    CHECK_ARG(name, b, "b");
    KPL_TRY(same_device(name, out, "out", cond, "cond"));
    KPL_TRY(same_device(name, out, "out", a, "a"));
    KPL_TRY(same_device(name, out, "out", b, "b"));
    KPL_TRY(want_dtype(name, cond, "cond", KPL_BOOL));
    KPL_CHECK(a->dtype == b->dtype, KPL_EDTYPE, "where: dtypes %s and %s differ",
              kpl_dtype_name(a->dtype), kpl_dtype_name(b->dtype));
    KPL_TRY(want_dtype(name, out, "out", a->dtype));
    int n1, n;
    int64_t s1[KPL_MAX_DIMS], shape[KPL_MAX_DIMS];
    KPL_TRY(kpl_shape_broadcast(name, cond->ndim, cond->shape, a->ndim, a->shape, &n1, s1));
    KPL_TRY(kpl_shape_broadcast(name, n1, s1, b->ndim, b->shape, &n, shape));
    KPL_TRY(same_shape(name, out, n, shape));
    const kpl_tensor *ins[3] = {cond, a, b};
    for (int i = 0; i < 3; i++) {
        KPL_TRY(no_partial_overlap(name, out, ins[i], i == 0 ? "cond" : i == 1 ? "a" : "b"));
        if (out->storage == ins[i]->storage && ins[i]->numel != out->numel)
            return KPL_ERROR(KPL_EINVAL, "where: in-place 'out' is a broadcast input");
    }
    if (out->numel == 0) return KPL_OK;
    kpl_where_attrs attrs;
    plan_build(&attrs.plan, n, shape, 3, ins);
    /* where only moves values: a half is two bytes like an i16, so the
     * bf16/f16 kernels are registered as byte movers directly. */
    return dispatch(KPL_KOP_WHERE, a->dtype, out, cond, a, b, &attrs);
}

/* ---- reductions --------------------------------------------------------------- */

kpl_status kpl_k_reduce(kpl_tensor *out, kpl_reduce_op op, const kpl_tensor *x,
                        const int *axes, int naxes, bool keepdim, int correction)
{
    KPL_CHECK((unsigned)op < KPL_REDUCE_COUNT, KPL_EINVAL, "reduce: unknown op %d", (int)op);
    const char *name = reduce_names[op];
    CHECK_ARG(name, out, "out");
    CHECK_ARG(name, x, "x");
    KPL_TRY(same_device(name, out, "out", x, "x"));
    KPL_CHECK(naxes >= 0 && naxes <= KPL_MAX_DIMS, KPL_EINVAL, "%s: %d axes", name, naxes);
    bool arg = op == KPL_RED_ARGMAX || op == KPL_RED_ARGMIN;
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
    KPL_TRY(same_shape(name, out, n, shape));
    KPL_TRY(want_dtype(name, out, "out", arg ? KPL_I64 : dt));
    KPL_CHECK(out->storage != x->storage, KPL_EINVAL, "%s: 'out' may not alias 'x'", name);

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
        /* Decomposable: reduce the last contiguous group of reduced dims
         * first (keeping them as 1s), then all the axes again, which are
         * now one group — (N, C, H, W) over (0, 2, 3) becomes (2, 3) then
         * (0), streaming reads instead of a permuted copy. */
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
        KPL_TRY(kpl_tensor_empty(x->storage->dev, dt, x->ndim, tshape, &tmp));
        kpl_status st = kpl_k_reduce(tmp, op, x, group, ng, true, correction);
        if (st >= 0) st = kpl_k_reduce(out, op, tmp, axes, naxes, keepdim, correction);
        kpl_tensor_release(tmp);
        return st;
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
    kpl_status st = is_half(dt) ? via_f32(KPL_KOP_REDUCE, out, arg, src, NULL, &attrs)
                                : dispatch(KPL_KOP_REDUCE, dt, out, src, NULL, NULL, &attrs);
    kpl_tensor_release(perm);
    return st;
}

/* ---- matmul ----------------------------------------------------------------- */

kpl_status kpl_k_matmul(kpl_tensor *out, const kpl_tensor *a, const kpl_tensor *b,
                        bool trans_a, bool trans_b)
{
    const char *name = "matmul";
    CHECK_ARG(name, out, "out");
    CHECK_ARG(name, a, "a");
    CHECK_ARG(name, b, "b");
    KPL_TRY(same_device(name, a, "a", b, "b"));
    KPL_TRY(same_device(name, out, "out", a, "a"));
    KPL_CHECK(a->dtype == b->dtype, KPL_EDTYPE, "matmul: dtypes %s and %s differ",
              kpl_dtype_name(a->dtype), kpl_dtype_name(b->dtype));
    kpl_dtype dt = a->dtype;
    KPL_CHECK(kpl_dtype_is_float(dt), KPL_EDTYPE, "matmul: not defined for dtype %s",
              kpl_dtype_name(dt));
    mm_shape s;
    KPL_TRY(matmul_infer(a->ndim, a->shape, trans_a, b->ndim, b->shape, trans_b, &s));
    int nbat = (a->ndim > 2 ? a->ndim - 2 : 0) > (b->ndim > 2 ? b->ndim - 2 : 0)
                   ? a->ndim - 2
                   : (b->ndim > 2 ? b->ndim - 2 : 0);
    int n;
    int64_t shape[KPL_MAX_DIMS];
    matmul_out_shape(&s, nbat, &n, shape);
    KPL_TRY(same_shape(name, out, n, shape));
    KPL_TRY(want_dtype(name, out, "out", dt));
    KPL_CHECK(out->storage != a->storage && out->storage != b->storage, KPL_EINVAL,
              "matmul: 'out' may not alias an input");
    if (out->numel == 0) return KPL_OK;
    kpl_matmul_attrs attrs = {.ndim = s.ndim,
                              .trans_a = a->ndim > 1 && trans_a,
                              .trans_b = b->ndim > 1 && trans_b};
    memcpy(attrs.a_dims, s.a, sizeof s.a);
    memcpy(attrs.b_dims, s.b, sizeof s.b);
    memcpy(attrs.out_dims, s.out, sizeof s.out);
    if (s.k == 0) return kpl_k_fill(out, 0.0);
    if (is_half(dt)) return half_gemm(KPL_KOP_MATMUL, "matmul", dt, out, a, b, NULL, false, &attrs);
    return dispatch(KPL_KOP_MATMUL, dt, out, a, b, NULL, &attrs);
}

/* ---- fills, random, casts, copies --------------------------------------------- */

kpl_status kpl_k_fill(kpl_tensor *out, double value)
{
    CHECK_ARG("fill", out, "out");
    if (out->numel == 0) return KPL_OK;
    kpl_fill_attrs attrs = {value};
    return dispatch(KPL_KOP_FILL, out->dtype, out, NULL, NULL, NULL, &attrs);
}

kpl_status kpl_k_arange(kpl_tensor *out, double start, double step)
{
    CHECK_ARG("arange", out, "out");
    KPL_CHECK(out->dtype != KPL_BOOL && out->dtype != KPL_U8 && !is_half(out->dtype),
              KPL_EDTYPE, "arange: not defined for dtype %s", kpl_dtype_name(out->dtype));
    if (out->numel == 0) return KPL_OK;
    kpl_arange_attrs attrs = {start, step};
    return dispatch(KPL_KOP_ARANGE, out->dtype, out, NULL, NULL, NULL, &attrs);
}

static kpl_status random_fill(const char *name, kpl_tensor *out, kpl_rng *rng, int normal,
                              double p1, double p2);

kpl_status kpl_k_uniform(kpl_tensor *out, kpl_rng *rng, double lo, double hi)
{
    KPL_CHECK(lo <= hi, KPL_EINVAL, "uniform: lo %g is greater than hi %g", lo, hi);
    return random_fill("uniform", out, rng, 0, lo, hi);
}

kpl_status kpl_k_normal(kpl_tensor *out, kpl_rng *rng, double mean, double std)
{
    KPL_CHECK(std >= 0, KPL_EINVAL, "normal: negative std %g", std);
    return random_fill("normal", out, rng, 1, mean, std);
}

kpl_status kpl_k_cast(kpl_tensor *out, const kpl_tensor *x)
{
    CHECK_ARG("cast", out, "out");
    CHECK_ARG("cast", x, "x");
    KPL_TRY(same_device("cast", out, "out", x, "x"));
    KPL_TRY(same_shape("cast", out, x->ndim, x->shape));
    KPL_TRY(no_partial_overlap("cast", out, x, "x"));
    KPL_CHECK(out->dtype == x->dtype || out->storage != x->storage, KPL_EINVAL,
              "cast: 'out' may not alias 'x' across dtypes");
    if (x->numel == 0 || (out == x)) return KPL_OK;
    return dispatch(KPL_KOP_CAST, x->dtype, out, x, NULL, NULL, NULL);
}

kpl_status kpl_k_copy(kpl_tensor *out, const kpl_tensor *x)
{
    CHECK_ARG("copy", out, "out");
    CHECK_ARG("copy", x, "x");
    KPL_CHECK(out->dtype == x->dtype, KPL_EDTYPE,
              "copy: dtypes %s and %s differ (use kpl_k_cast)", kpl_dtype_name(out->dtype),
              kpl_dtype_name(x->dtype));
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(out->numel == x->numel, KPL_ESHAPE,
              "copy: 'out' %s and 'x' %s differ in element count", KPL_SHAPE(out, b1),
              KPL_SHAPE(x, b2));
    if (x->numel == 0) return KPL_OK;
    kpl_device *od = out->storage->dev, *xd = x->storage->dev;
    size_t bytes = kpl_tensor_nbytes(x);
    if (od == xd) {
        if (out->storage == x->storage && out->offset == x->offset) return KPL_OK;
        KPL_TRY(no_partial_overlap("copy", out, x, "x"));
        return dispatch(KPL_KOP_COPY, x->dtype, out, x, NULL, NULL, NULL);
    }
    /* Across devices: the one explicit transfer path. */
    kpl_tensor *xm = (kpl_tensor *)x;
    if (od->type != KPL_DEVICE_CPU && xd->type == KPL_DEVICE_CPU) {
        void *dst = kpl_tensor_mutable(out);
        const void *src = kpl__host_cdata(xm);
        if (!dst || !src) return kpl_last_status();
        return od->backend->copy_h2d(od, dst, src, bytes);
    }
    if (od->type == KPL_DEVICE_CPU && xd->type != KPL_DEVICE_CPU) {
        const void *src = kpl__cdata(xm);
        char *dst = kpl_storage_host_mutable(out->storage);
        if (!dst || !src) return kpl_last_status();
        dst += out->offset;
        return xd->backend->copy_d2h(xd, dst, src, bytes);
    }
    /* GPU to another GPU: through the source's host copy. */
    const void *src = kpl__host_cdata(xm);
    void *dst = kpl_tensor_mutable(out);
    if (!dst || !src) return kpl_last_status();
    return od->backend->copy_h2d(od, dst, src, bytes);
}

kpl_status kpl_k_expand(kpl_tensor *out, const kpl_tensor *x)
{
    CHECK_ARG("expand", out, "out");
    CHECK_ARG("expand", x, "x");
    KPL_TRY(same_device("expand", out, "out", x, "x"));
    KPL_TRY(want_dtype("expand", out, "out", x->dtype));
    int n;
    int64_t shape[KPL_MAX_DIMS];
    KPL_TRY(kpl_shape_broadcast("expand", x->ndim, x->shape, out->ndim, out->shape, &n, shape));
    KPL_TRY(same_shape("expand", out, n, shape));
    KPL_CHECK(out->storage != x->storage, KPL_EINVAL, "expand: 'out' may not alias 'x'");
    if (out->numel == 0) return KPL_OK;
    /* A strided gather whose broadcast dims have stride 0. */
    kpl_copy_attrs attrs;
    plan_build(&attrs.plan, out->ndim, out->shape, 1, &x);
    return dispatch(KPL_KOP_COPY, x->dtype, out, x, NULL, NULL, &attrs);
}

/* ---- loss scaling ----------------------------------------------------------------- */

kpl_status kpl_k_amp_unscale(kpl_tensor *g, double inv_scale, kpl_tensor *found_inf)
{
    const char *op = "amp_unscale";
    CHECK_ARG(op, g, "g");
    CHECK_ARG(op, found_inf, "found_inf");
    KPL_CHECK(kpl_dtype_is_float(g->dtype), KPL_EDTYPE,
              "%s: 'g' has dtype %s; f32, f16, bf16 and f64 are supported", op,
              kpl_dtype_name(g->dtype));
    KPL_CHECK(found_inf->dtype == KPL_F32, KPL_EDTYPE,
              "%s: 'found_inf' has dtype %s, expected f32", op,
              kpl_dtype_name(found_inf->dtype));
    KPL_CHECK(found_inf->storage->dev == g->storage->dev, KPL_EDEVICE,
              "%s: 'found_inf' is on %s but 'g' is on %s (it must live on g's device)", op,
              found_inf->storage->dev->name, g->storage->dev->name);
    char b[KPL_SHAPE_BUF];
    KPL_CHECK(found_inf->numel == 1, KPL_ESHAPE,
              "%s: 'found_inf' has shape %s (%lld elements); it must hold exactly one", op,
              KPL_SHAPE(found_inf, b), (long long)found_inf->numel);
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

/* ---- conv2d -------------------------------------------------------------------- */

kpl_status kpl_shape_conv2d(const int64_t *x, const int64_t *w, const kpl_conv2d_params *p,
                            int64_t *out)
{
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    kpl_shape_str(4, x, b1, sizeof b1);
    kpl_shape_str(4, w, b2, sizeof b2);
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
              (long long)x[1], (long long)w[0], p->groups, b1, b2);
    KPL_CHECK(w[1] * p->groups == x[1], KPL_ESHAPE,
              "conv2d: input %s has %lld channels but weights %s expect %lld (x %d groups)", b1,
              (long long)x[1], b2, (long long)(w[1] * p->groups), p->groups);
    int64_t ekh = (w[2] - 1) * p->dilation[0] + 1, ekw = (w[3] - 1) * p->dilation[1] + 1;
    int64_t ph = x[2] + 2 * p->padding[0], pw = x[3] + 2 * p->padding[1];
    KPL_CHECK(ekh <= ph && ekw <= pw && w[2] > 0 && w[3] > 0, KPL_ESHAPE,
              "conv2d: kernel %lldx%lld (dilated %lldx%lld) is larger than the padded input "
              "%lldx%lld (input %s, weights %s)",
              (long long)w[2], (long long)w[3], (long long)ekh, (long long)ekw, (long long)ph,
              (long long)pw, b1, b2);
    out[0] = x[0];
    out[1] = w[0];
    out[2] = (ph - ekh) / p->stride[0] + 1;
    out[3] = (pw - ekw) / p->stride[1] + 1;
    return KPL_OK;
}

static kpl_status conv_check4(const char *op, const kpl_tensor *t, const char *name)
{
    char b[KPL_SHAPE_BUF];
    KPL_CHECK(t->ndim == 4, KPL_ESHAPE, "%s: '%s' must be 4-D (N, C, H, W / O, C, KH, KW), got %s",
              op, name, KPL_SHAPE(t, b));
    KPL_CHECK(kpl_dtype_is_float(t->dtype), KPL_EDTYPE,
              "%s: '%s' has dtype %s; f32, f64, f16 and bf16 are supported", op, name,
              kpl_dtype_name(t->dtype));
    return KPL_OK;
}

/* The one argument check of the three convolution calls.  t[0..3) are
 * the call's tensors by role (forward: out, x, w; backward data: gx, gy,
 * w; backward weight: gw, x, gy), every one given, 4-D, f32 or f64, on
 * t[0]'s device with t[0]'s dtype; the input `in`, the weights `wt` and
 * params give the output plane y (kpl_shape_conv2d), which `res` must
 * have; a bias (may be NULL) has one value per filter. */
typedef struct {
    const kpl_tensor *t;
    const char *name;
} conv_arg;

static kpl_status conv_check(const char *op, const conv_arg *t, const kpl_tensor *in,
                             const kpl_tensor *wt, const kpl_tensor *res, conv_arg bias,
                             const kpl_conv2d_params *p, int64_t *y)
{
    for (int i = 0; i < 3; i++) CHECK_ARG(op, t[i].t, t[i].name);
    for (int i = 0; i < 3; i++) KPL_TRY(conv_check4(op, t[i].t, t[i].name));
    for (int i = 1; i < 3; i++) KPL_TRY(same_device(op, t[0].t, t[0].name, t[i].t, t[i].name));
    for (int i = 1; i < 3; i++) KPL_TRY(want_dtype(op, t[i].t, t[i].name, t[0].t->dtype));
    KPL_TRY(kpl_shape_conv2d(in->shape, wt->shape, p, y));
    KPL_TRY(same_shape(op, res, 4, y));
    if (!bias.t) return KPL_OK;
    char bb[KPL_SHAPE_BUF];
    KPL_TRY(same_device(op, bias.t, bias.name, t[0].t, t[0].name));
    KPL_TRY(want_dtype(op, bias.t, bias.name, t[0].t->dtype));
    KPL_CHECK(bias.t->ndim == 1 && bias.t->shape[0] == wt->shape[0], KPL_ESHAPE,
              "%s: %s %s must have one value per filter (%lld)", op,
              strcmp(bias.name, "b") ? "bias gradient" : "bias", KPL_SHAPE(bias.t, bb),
              (long long)wt->shape[0]);
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
}

/* A convolution's kernel: half precision through half_gemm. */
static kpl_status conv_run(kpl_dtype dt, kpl_tensor *out, const kpl_tensor *i0,
                           const kpl_tensor *i1, const kpl_tensor *i2, const kpl_conv_attrs *a)
{
    kpl_kop kop = a->relu ? KPL_KOP_CONV2D_RELU : KPL_KOP_CONV2D;
    if (!is_half(dt)) return dispatch(kop, dt, out, i0, i1, i2, a);
    return half_gemm(kop, a->relu ? "conv2d_relu" : "conv2d", dt, out, i0, i1, i2,
                     a->kind == KPL_CONV_BWD_WEIGHT, a);
}

static kpl_status conv_fwd(const char *op, bool relu, kpl_tensor *out, const kpl_tensor *x,
                           const kpl_tensor *w, const kpl_tensor *b, const kpl_conv2d_params *p)
{
    int64_t y[4];
    conv_arg t[3] = {{x, "x"}, {w, "w"}, {out, "out"}};
    KPL_TRY(conv_check(op, t, x, w, out, (conv_arg){b, "b"}, p, y));
    KPL_CHECK(out->storage != x->storage, KPL_EINVAL, "%s: 'out' may not alias 'x'", op);
    if (out->numel == 0) return KPL_OK;
    kpl_conv_attrs a;
    conv_fill(&a, KPL_CONV_FWD, x->shape, w->shape, y, p);
    a.relu = relu;
    return conv_run(x->dtype, out, x, w, b, &a);
}

kpl_status kpl_k_conv2d(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *w,
                        const kpl_tensor *b, const kpl_conv2d_params *p)
{
    return conv_fwd("conv2d", false, out, x, w, b, p);
}

kpl_status kpl_k_conv2d_relu(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *w,
                             const kpl_tensor *b, const kpl_conv2d_params *p)
{
    return conv_fwd("conv2d_relu", true, out, x, w, b, p);
}

kpl_status kpl_k_conv2d_bwd_data(kpl_tensor *gx, const kpl_tensor *gy, const kpl_tensor *w,
                                 const kpl_conv2d_params *p)
{
    const char *op = "conv2d_bwd_data";
    int64_t y[4];
    conv_arg t[3] = {{gx, "gx"}, {gy, "gy"}, {w, "w"}};
    KPL_TRY(conv_check(op, t, gx, w, gy, (conv_arg){NULL, NULL}, p, y));
    KPL_CHECK(gx->storage != gy->storage, KPL_EINVAL, "%s: 'gx' may not alias 'gy'", op);
    if (gx->numel == 0) return KPL_OK;
    kpl_conv_attrs a;
    conv_fill(&a, KPL_CONV_BWD_DATA, gx->shape, w->shape, y, p);
    return conv_run(gx->dtype, gx, gy, w, NULL, &a);
}

kpl_status kpl_k_conv2d_bwd_weight(kpl_tensor *gw, kpl_tensor *gb, const kpl_tensor *x,
                                   const kpl_tensor *gy, const kpl_conv2d_params *p)
{
    int64_t y[4];
    conv_arg t[3] = {{gw, "gw"}, {x, "x"}, {gy, "gy"}};
    KPL_TRY(conv_check("conv2d_bwd_weight", t, x, gw, gy, (conv_arg){gb, "gb"}, p, y));
    if (gw->numel == 0) return KPL_OK;
    kpl_conv_attrs a;
    conv_fill(&a, KPL_CONV_BWD_WEIGHT, x->shape, gw->shape, y, p);
    return conv_run(gw->dtype, gw, x, gy, gb, &a);
}

/* ---- pooling ------------------------------------------------------------------- */

kpl_status kpl_shape_pool2d(const int64_t *x, const kpl_pool2d_params *p, int64_t *out)
{
    char b[KPL_SHAPE_BUF];
    kpl_shape_str(4, x, b, sizeof b);
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
                  p->kernel[1], b);
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

static kpl_status pool_check(const char *op, const kpl_tensor *t, const char *name, bool idx)
{
    char b[KPL_SHAPE_BUF];
    KPL_CHECK(t->ndim == 4, KPL_ESHAPE, "%s: '%s' must be 4-D (N, C, H, W), got %s", op, name,
              KPL_SHAPE(t, b));
    if (idx) return want_dtype(op, t, name, KPL_I64);
    KPL_CHECK(kpl_dtype_is_float(t->dtype), KPL_EDTYPE,
              "%s: '%s' has dtype %s; f32, f64, f16 and bf16 are supported", op, name,
              kpl_dtype_name(t->dtype));
    return KPL_OK;
}

static kpl_status pool_run(kpl_pool_kind kind, kpl_tensor *out, const kpl_tensor *in0,
                           const kpl_tensor *in1, const int64_t *plane, const int64_t *oplane,
                           const kpl_pool2d_params *p)
{
    kpl_pool_attrs a = {.kind = kind, .n = plane[0], .c = plane[1], .h = plane[2], .w = plane[3],
                        .oh = oplane[2], .ow = oplane[3]};
    if (p) a.p = *p;
    if (out->numel == 0) return KPL_OK;
    kpl_dtype dt = kind == KPL_POOL_MAX || kind == KPL_POOL_AVG || kind == KPL_POOL_GATHER
                       ? in0->dtype
                       : out->dtype;
    if (is_half(dt) && !native_half(KPL_KOP_POOL2D, out, dt))
        return via_f32(KPL_KOP_POOL2D, out, false, in0, in1, &a); /* idx (i64) passes as it is */
    return dispatch(KPL_KOP_POOL2D, dt, out, in0, in1, NULL, &a);
}

kpl_status kpl_k_max_pool2d(kpl_tensor *out, kpl_tensor *idx, const kpl_tensor *x,
                            const kpl_pool2d_params *p)
{
    const char *op = "max_pool2d";
    CHECK_ARG(op, out, "out");
    CHECK_ARG(op, x, "x");
    KPL_TRY(pool_check(op, x, "x", false));
    KPL_TRY(same_device(op, out, "out", x, "x"));
    KPL_TRY(want_dtype(op, out, "out", x->dtype));
    int64_t ys[4];
    KPL_TRY(kpl_shape_pool2d(x->shape, p, ys));
    KPL_TRY(same_shape(op, out, 4, ys));
    if (!idx && x->storage->dev->type != KPL_DEVICE_CPU) { /* only the CPU has a values-only kernel */
        kpl_tensor *tmp = NULL;
        KPL_TRY(kpl_tensor_empty(x->storage->dev, KPL_I64, 4, ys, &tmp));
        kpl_status st = kpl_k_max_pool2d(out, tmp, x, p);
        kpl_tensor_release(tmp);
        return st;
    }
    if (idx) {
        KPL_TRY(pool_check(op, idx, "idx", true));
        KPL_TRY(same_device(op, idx, "idx", x, "x"));
        KPL_TRY(same_shape(op, idx, 4, ys));
    }
    return pool_run(KPL_POOL_MAX, out, x, idx, x->shape, ys, p);
}

kpl_status kpl_k_plane_gather(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *idx)
{
    const char *op = "plane_gather";
    CHECK_ARG(op, out, "out");
    CHECK_ARG(op, x, "x");
    CHECK_ARG(op, idx, "idx");
    KPL_TRY(pool_check(op, x, "x", false));
    KPL_TRY(pool_check(op, idx, "idx", true));
    KPL_TRY(same_device(op, out, "out", x, "x"));
    KPL_TRY(same_device(op, idx, "idx", x, "x"));
    KPL_TRY(want_dtype(op, out, "out", x->dtype));
    KPL_TRY(same_shape(op, out, 4, idx->shape));
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(idx->shape[0] == x->shape[0] && idx->shape[1] == x->shape[1], KPL_ESHAPE,
              "%s: indices %s and input %s differ in (N, C)", op, KPL_SHAPE(idx, b1),
              KPL_SHAPE(x, b2));
    return pool_run(KPL_POOL_GATHER, out, x, idx, x->shape, idx->shape, NULL);
}

kpl_status kpl_k_plane_scatter(kpl_tensor *gx, const kpl_tensor *gy, const kpl_tensor *idx)
{
    const char *op = "plane_scatter";
    CHECK_ARG(op, gx, "gx");
    CHECK_ARG(op, gy, "gy");
    CHECK_ARG(op, idx, "idx");
    KPL_TRY(pool_check(op, gx, "gx", false));
    KPL_TRY(pool_check(op, idx, "idx", true));
    KPL_TRY(same_device(op, gx, "gx", gy, "gy"));
    KPL_TRY(same_device(op, idx, "idx", gy, "gy"));
    KPL_TRY(want_dtype(op, gy, "gy", gx->dtype));
    KPL_TRY(same_shape(op, (kpl_tensor *)gy, 4, idx->shape));
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(idx->shape[0] == gx->shape[0] && idx->shape[1] == gx->shape[1], KPL_ESHAPE,
              "%s: indices %s and gradient %s differ in (N, C)", op, KPL_SHAPE(idx, b1),
              KPL_SHAPE(gx, b2));
    return pool_run(KPL_POOL_SCATTER, gx, gy, idx, gx->shape, idx->shape, NULL);
}

kpl_status kpl_k_avg_pool2d(kpl_tensor *out, const kpl_tensor *x, const kpl_pool2d_params *p)
{
    const char *op = "avg_pool2d";
    CHECK_ARG(op, out, "out");
    CHECK_ARG(op, x, "x");
    KPL_TRY(pool_check(op, x, "x", false));
    KPL_TRY(same_device(op, out, "out", x, "x"));
    KPL_TRY(want_dtype(op, out, "out", x->dtype));
    int64_t ys[4];
    KPL_TRY(kpl_shape_pool2d(x->shape, p, ys));
    KPL_TRY(same_shape(op, out, 4, ys));
    return pool_run(KPL_POOL_AVG, out, x, NULL, x->shape, ys, p);
}

kpl_status kpl_k_avg_pool2d_bwd(kpl_tensor *gx, const kpl_tensor *gy, const kpl_pool2d_params *p)
{
    const char *op = "avg_pool2d_bwd";
    CHECK_ARG(op, gx, "gx");
    CHECK_ARG(op, gy, "gy");
    KPL_TRY(pool_check(op, gx, "gx", false));
    KPL_TRY(same_device(op, gx, "gx", gy, "gy"));
    KPL_TRY(want_dtype(op, gy, "gy", gx->dtype));
    int64_t ys[4];
    KPL_TRY(kpl_shape_pool2d(gx->shape, p, ys));
    KPL_TRY(same_shape(op, (kpl_tensor *)gy, 4, ys));
    return pool_run(KPL_POOL_AVG_BWD, gx, gy, NULL, gx->shape, ys, p);
}

/* ---- index_select / index_add, gather / scatter_add ------------------------------- */

static kpl_status index_common(const char *op, const kpl_tensor *big, const kpl_tensor *small,
                               int axis, const kpl_tensor *idx, kpl_index_attrs *a)
{
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(idx->ndim == 1, KPL_ESHAPE, "%s: indices %s must be 1-D", op, KPL_SHAPE(idx, b1));
    KPL_TRY(want_dtype(op, idx, "idx", KPL_I64));
    KPL_TRY(same_device(op, big, "x", idx, "idx"));
    KPL_TRY(same_device(op, big, "x", small, "out"));
    KPL_CHECK(big->dtype == small->dtype, KPL_EDTYPE, "%s: dtypes %s and %s differ", op,
              kpl_dtype_name(big->dtype), kpl_dtype_name(small->dtype));
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
    CHECK_ARG("index_select", out, "out");
    CHECK_ARG("index_select", x, "x");
    CHECK_ARG("index_select", idx, "idx");
    kpl_index_attrs a = {.kind = KPL_INDEX_SELECT};
    KPL_TRY(index_common("index_select", x, out, axis, idx, &a));
    KPL_CHECK(out->storage != x->storage, KPL_EINVAL, "index_select: 'out' may not alias 'x'");
    if (out->numel == 0) return KPL_OK;
    return dispatch(KPL_KOP_INDEX, x->dtype, out, x, idx, NULL, &a);
}

kpl_status kpl_k_index_add(kpl_tensor *out, const kpl_tensor *g, int axis, const kpl_tensor *idx)
{
    CHECK_ARG("index_add", out, "out");
    CHECK_ARG("index_add", g, "g");
    CHECK_ARG("index_add", idx, "idx");
    kpl_index_attrs a = {.kind = KPL_INDEX_ADD};
    KPL_TRY(index_common("index_add", out, g, axis, idx, &a));
    KPL_CHECK(kpl_dtype_is_float(out->dtype), KPL_EDTYPE,
              "index_add: dtype %s; float dtypes are supported", kpl_dtype_name(out->dtype));
    KPL_CHECK(out->storage != g->storage, KPL_EINVAL, "index_add: 'out' may not alias 'g'");
    if (out->numel == 0) return KPL_OK;
    if (is_half(out->dtype)) return via_f32(KPL_KOP_INDEX, out, false, g, idx, &a);
    return dispatch(KPL_KOP_INDEX, out->dtype, out, g, idx, NULL, &a);
}

/* What gather and scatter_add share: idx against x along axis, and the
 * merged geometry of kpl_index_attrs. */
static kpl_status gather_common(const char *op, const kpl_tensor *x, int axis,
                                const kpl_tensor *idx, kpl_index_attrs *a)
{
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_TRY(want_dtype(op, idx, "idx", KPL_I64));
    KPL_TRY(same_device(op, x, "x", idx, "idx"));
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
    CHECK_ARG(op, out, "out");
    CHECK_ARG(op, x, "x");
    CHECK_ARG(op, idx, "idx");
    int64_t bad[2] = {-1, 0};
    kpl_index_attrs a = {.kind = KPL_INDEX_GATHER, .bad = bad};
    KPL_TRY(gather_common(op, x, axis, idx, &a));
    KPL_TRY(same_device(op, out, "out", x, "x"));
    KPL_TRY(want_dtype(op, out, "out", x->dtype));
    KPL_TRY(same_shape(op, out, idx->ndim, idx->shape));
    KPL_CHECK(out->storage != x->storage && out->storage != idx->storage, KPL_EINVAL,
              "%s: 'out' may not alias 'x' or 'idx'", op);
    if (out->numel == 0) return KPL_OK;
    kpl_status st = dispatch(KPL_KOP_INDEX, x->dtype, out, x, idx, NULL, &a);
    return gather_range_error(op, st, x, axis, idx, bad);
}

kpl_status kpl_k_scatter_add(kpl_tensor *out, const kpl_tensor *x, int axis,
                             const kpl_tensor *idx, const kpl_tensor *src)
{
    const char *op = "scatter_add";
    CHECK_ARG(op, out, "out");
    CHECK_ARG(op, x, "x");
    CHECK_ARG(op, idx, "idx");
    CHECK_ARG(op, src, "src");
    int64_t bad[2] = {-1, 0};
    kpl_index_attrs a = {.kind = KPL_INDEX_SCATTER_ADD, .bad = bad};
    KPL_TRY(gather_common(op, x, axis, idx, &a));
    KPL_CHECK(kpl_dtype_is_float(x->dtype) && !is_half(x->dtype), KPL_EDTYPE,
              "%s: dtype %s; f32 and f64 are supported", op, kpl_dtype_name(x->dtype));
    KPL_TRY(same_device(op, src, "src", x, "x"));
    KPL_TRY(same_device(op, out, "out", x, "x"));
    KPL_TRY(want_dtype(op, src, "src", x->dtype));
    KPL_TRY(want_dtype(op, out, "out", x->dtype));
    bool same = src->ndim == idx->ndim;
    for (int d = 0; same && d < idx->ndim; d++) same = src->shape[d] == idx->shape[d];
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(same, KPL_ESHAPE, "%s: src %s must have the shape of idx %s", op,
              KPL_SHAPE(src, b1), KPL_SHAPE(idx, b2));
    KPL_TRY(same_shape(op, out, x->ndim, x->shape));
    KPL_CHECK(out->storage != x->storage && out->storage != idx->storage &&
                  out->storage != src->storage,
              KPL_EINVAL, "%s: 'out' may not alias 'x', 'idx' or 'src'", op);
    KPL_TRY(kpl_k_copy(out, x));
    if (idx->numel == 0) return KPL_OK;
    kpl_status st = dispatch(KPL_KOP_INDEX, out->dtype, out, src, idx, NULL, &a);
    return gather_range_error(op, st, x, axis, idx, bad);
}


/* ---- rng -------------------------------------------------------------------- */

struct kpl_rng {
    uint64_t seed, offset;
};

kpl_rng *kpl_rng_create(uint64_t seed)
{
    kpl_rng *r = calloc(1, sizeof *r);
    if (r) r->seed = seed;
    return r;
}
void kpl_rng_destroy(kpl_rng *rng) { free(rng); }
uint64_t kpl_rng_seed(const kpl_rng *rng) { return rng->seed; }
uint64_t kpl_rng_offset(const kpl_rng *rng) { return rng->offset; }
void kpl_rng_set_state(kpl_rng *rng, uint64_t seed, uint64_t offset)
{
    rng->seed = seed;
    rng->offset = offset;
}

static kpl_status random_fill(const char *name, kpl_tensor *out, kpl_rng *rng, int normal,
                              double p1, double p2)
{
    CHECK_ARG(name, out, "out");
    KPL_CHECK(rng != NULL, KPL_EINVAL, "%s: argument 'rng' is NULL", name);
    KPL_CHECK(kpl_dtype_is_float(out->dtype), KPL_EDTYPE, "%s: not defined for dtype %s",
              name, kpl_dtype_name(out->dtype));
    if (out->numel == 0) return KPL_OK;
    kpl_random_attrs attrs = {normal, rng->seed, rng->offset, p1, p2};
    KPL_TRY(dispatch(KPL_KOP_RANDOM, out->dtype, out, NULL, NULL, NULL, &attrs));
    int64_t per = out->dtype == KPL_F64 ? 2 : 4;
    rng->offset += (uint64_t)((out->numel + per - 1) / per);
    return KPL_OK;
}

/* ---- batch norm ------------------------------------------------------------------ */

/* The dtype of batch norm's per-channel vectors: x's, or f32 for f16/bf16
 * activations (the statistics of the mixed-precision form). */
static kpl_dtype bn_vec_dtype(const kpl_tensor *x)
{
    return is_half(x->dtype) ? KPL_F32 : x->dtype;
}

/* Checks `t` is (C) when given, of bn_vec_dtype and on x's device. */
static kpl_status bn_vec(const char *op, const kpl_tensor *t, const char *name,
                         const kpl_tensor *x)
{
    if (!t) return KPL_OK;
    KPL_TRY(same_device(op, t, name, x, "x"));
    KPL_TRY(want_dtype(op, t, name, bn_vec_dtype(x)));
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(t->ndim == 1 && t->shape[0] == x->shape[1], KPL_ESHAPE,
              "%s: '%s' has shape %s, expected (%lld) for input %s", op, name, KPL_SHAPE(t, b1),
              (long long)x->shape[1], KPL_SHAPE(x, b2));
    return KPL_OK;
}

static kpl_status bn_common(const char *op, const kpl_tensor *x, kpl_bn_attrs *a, double eps)
{
    char b1[KPL_SHAPE_BUF];
    KPL_CHECK(x->ndim >= 2, KPL_ESHAPE, "%s: input %s must be (N, C, ...)", op, KPL_SHAPE(x, b1));
    KPL_CHECK(kpl_dtype_is_float(x->dtype), KPL_EDTYPE,
              "%s: dtype %s (f32, f64, or f16/bf16 with f32 statistics)", op,
              kpl_dtype_name(x->dtype));
    KPL_CHECK(eps >= 0, KPL_EINVAL, "%s: eps %g must not be negative", op, eps);
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
    CHECK_ARG(op, y, "y");
    CHECK_ARG(op, x, "x");
    CHECK_ARG(op, gamma, "gamma");
    CHECK_ARG(op, beta, "beta");
    kpl_bn_attrs a = {.bwd = false, .relu = kop == KPL_KOP_BATCH_NORM_RELU, .mean = mean,
                      .var = var};
    KPL_TRY(bn_common(op, x, &a, eps));
    KPL_TRY(same_device(op, y, "y", x, "x"));
    KPL_TRY(want_dtype(op, y, "y", x->dtype));
    KPL_TRY(same_shape(op, y, x->ndim, x->shape));
    KPL_TRY(no_partial_overlap(op, y, x, "x"));
    KPL_TRY(bn_vec(op, gamma, "gamma", x));
    KPL_TRY(bn_vec(op, beta, "beta", x));
    KPL_TRY(bn_vec(op, mean, "mean", x));
    KPL_TRY(bn_vec(op, var, "var", x));
    KPL_CHECK(x->numel > 0 || x->shape[1] == 0, KPL_ESHAPE,
              "%s: an empty batch has no statistics", op);
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
    CHECK_ARG(op, x, "x");
    CHECK_ARG(op, gy, "gy");
    CHECK_ARG(op, gamma, "gamma");
    KPL_CHECK(gx || ggamma || gbeta, KPL_EINVAL, "%s: no gradient asked for", op);
    bool relu = kop == KPL_KOP_BATCH_NORM_RELU;
    if (relu) CHECK_ARG(op, relu_y, "y");
    kpl_bn_attrs a = {.bwd = true, .relu = relu, .relu_y = relu_y, .gx = gx, .ggamma = ggamma,
                      .gbeta = gbeta};
    KPL_TRY(bn_common(op, x, &a, eps));
    const kpl_tensor *same[2] = {gy, relu_y};
    const char *same_name[2] = {"gy", "y"};
    for (int i = 0; i < 2; i++) {
        const kpl_tensor *t = same[i];
        if (!t) continue;
        KPL_TRY(same_device(op, t, same_name[i], x, "x"));
        KPL_TRY(want_dtype(op, t, same_name[i], x->dtype));
        char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
        bool eq = t->ndim == x->ndim;
        for (int d = 0; eq && d < x->ndim; d++) eq = t->shape[d] == x->shape[d];
        KPL_CHECK(eq, KPL_ESHAPE, "%s: %s %s and input %s differ", op,
                  i ? "output" : "gradient", KPL_SHAPE(t, b1), KPL_SHAPE(x, b2));
    }
    if (gx) {
        KPL_TRY(same_device(op, gx, "gx", x, "x"));
        KPL_TRY(want_dtype(op, gx, "gx", x->dtype));
        KPL_TRY(same_shape(op, gx, x->ndim, x->shape));
        KPL_TRY(no_partial_overlap(op, gx, gy, "gy"));
        KPL_CHECK(gx->storage != x->storage, KPL_EINVAL, "%s: gx must not overwrite x", op);
        if (relu) KPL_TRY(no_partial_overlap(op, gx, relu_y, "y"));
    }
    KPL_TRY(bn_vec(op, gamma, "gamma", x));
    KPL_TRY(bn_vec(op, ggamma, "ggamma", x));
    KPL_TRY(bn_vec(op, gbeta, "gbeta", x));
    KPL_CHECK(x->numel > 0 || x->shape[1] == 0, KPL_ESHAPE,
              "%s: an empty batch has no statistics", op);
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
