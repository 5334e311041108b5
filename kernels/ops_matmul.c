/*
 * ops_matmul.c — the front end of kpl_k_matmul (numpy's matmul: 1-D
 * operands, broadcast batch dims, optional transposes) with
 * kpl_shape_matmul, and the half-precision GEMM chooser that matmul and the
 * convolutions (ops_conv.c) share: the device's native f16/bf16 kernel or
 * f32 math rounded, whichever is the faster for a problem.
 */
#include "ops_impl.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* ---- f16 and bf16 GEMMs ------------------------------------------------------------ */

/* The emulated form of a half-precision convolution or matmul: f32 math,
 * rounded.  `c_written`: the third operand is written (backward weights'
 * bias gradient) and gets an f32 stand-in of its own. */
static kpl_status half_emulated(kpl_kop kop, kpl_tensor *out, const kpl_tensor *a,
                                const kpl_tensor *b, const kpl_tensor *c, bool c_written,
                                const void *attrs)
{
    if (!c || !c_written || !is_half(c->dtype))
        return kpl__ops_via_f32(kop, out, false, a, b, c, attrs);
    kpl_tensor *cf = NULL;
    kpl_status st = kpl_tensor_empty(c->storage->dev, KPL_F32, c->ndim, c->shape, &cf);
    if (st >= 0) st = kpl__ops_via_f32(kop, out, false, a, b, cf, attrs);
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

/* The device's own kernel when it has one (and it is the faster, above),
 * else f32 math rounded to the half dtype, said once per op and dtype
 * (never a silent slowdown). */
kpl_status kpl__ops_half_gemm(kpl_kop kop, const char *op, kpl_dtype dt, kpl_tensor *out,
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
    /* An operand held in a kept layout (kpl_set_blocked_layouts) comes from a native
     * neighbour, whose layout the native kernel reads as it is: the f32
     * detour would turn it plain, and its result, plain, would be reordered
     * again by the next layer, which the timing cannot see. */
    if (dev != KPL_DEVICE_CPU || kpl_get_deterministic() || kpl__kept(a) || kpl__kept(b))
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

/* The batch dims of the result: those of the operand with more. */
static int matmul_nbat(int na, int nb)
{
    int ba = na > 2 ? na - 2 : 0, bb = nb > 2 ? nb - 2 : 0;
    return ba > bb ? ba : bb;
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
    matmul_out_shape(&s, matmul_nbat(na, nb), nout, out);
    return KPL_OK;
}

/* ---- matmul ----------------------------------------------------------------- */

enum { MM_A, MM_B, MM_OUT };
static const kpl_op_spec matmul_spec = {{
    [MM_A] = {"a", .dtypes = KPL_DT_FLOAT},
    [MM_B] = {"b", .device = KPL_AS(MM_A), .dtype = KPL_AS(MM_A)},
    [MM_OUT] = {"out", .device = KPL_AS(MM_A), .dtype = KPL_AS(MM_A),
                .disjoint = KPL_ARGSET(MM_A) | KPL_ARGSET(MM_B)},
}};

kpl_status kpl_k_matmul(kpl_tensor *out, const kpl_tensor *a, const kpl_tensor *b,
                        bool trans_a, bool trans_b)
{
    const char *name = "matmul";
    KPL_TRY(kpl__ops_check(name, &matmul_spec, (const kpl_tensor *[]){a, b, out}));
    kpl_dtype dt = a->dtype;
    mm_shape s;
    KPL_TRY(matmul_infer(a->ndim, a->shape, trans_a, b->ndim, b->shape, trans_b, &s));
    int n;
    int64_t shape[KPL_MAX_DIMS];
    matmul_out_shape(&s, matmul_nbat(a->ndim, b->ndim), &n, shape);
    KPL_TRY(same_shape(name, out, "out", n, shape));
    if (out->numel == 0) return KPL_OK;
    kpl_matmul_attrs attrs = {.ndim = s.ndim,
                              .trans_a = a->ndim > 1 && trans_a,
                              .trans_b = b->ndim > 1 && trans_b};
    memcpy(attrs.a_dims, s.a, sizeof s.a);
    memcpy(attrs.b_dims, s.b, sizeof s.b);
    memcpy(attrs.out_dims, s.out, sizeof s.out);
    if (s.k == 0) return kpl_k_fill(out, 0.0);
    if (is_half(dt))
        return kpl__ops_half_gemm(KPL_KOP_MATMUL, name, dt, out, a, b, NULL, false, &attrs);
    return dispatch(KPL_KOP_MATMUL, dt, out, a, b, NULL, &attrs);
}
