/*
 * cpu_eltwise.c — CPU loops for the unary, binary and where kernels.
 *
 * The formulas come from eltwise_math.h (shared with CUDA).  Each (formula,
 * dtype) pair becomes one inner-loop function over a contiguous run, built
 * three times by target_clones (baseline x86-64, AVX2+FMA, AVX-512) and
 * picked at load time for the CPU at hand.  The outer driver splits the
 * flat output range across OpenMP threads and walks the broadcast plan one
 * run (row) at a time, so the inner loops only ever see stride 1 or 0.
 * f16 and bf16 run the f32 loops over blocks widened on the stack and
 * round the results back (half_row): one pass over memory and f32 math
 * rounded once, as kpl_k_cast would round an f32 result.
 */
#include "../eltwise_math.h"
#include "kernels_impl.h"
#include "../convert_math.h"

#include <omp.h>
#include <string.h>

/* Inner loops: mode 0 = both inputs advance, 1 = b is fixed, 2 = a is fixed. */
typedef void (*bin_fn)(void *o, const void *a, const void *b, int64_t n, int mode);
typedef void (*un_fn)(void *o, const void *x, int64_t n, double alpha, double beta);

/* ---- generated inner loops -------------------------------------------------- */

#define BIN_LOOP(TYPE, OTYPE, FORMULA)                                  \
    typedef TYPE T;                                                     \
    OTYPE *po = o_;                                                     \
    const T *pa = a_, *pb = b_;                                         \
    if (mode == 0) {                                                    \
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++)             \
        {                                                               \
            T a = pa[i], b = pb[i];                                     \
            po[i] = (OTYPE)(FORMULA);                                   \
        }                                                               \
    } else if (mode == 1) {                                             \
        const T b = pb[0];                                              \
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++)             \
        {                                                               \
            T a = pa[i];                                                \
            po[i] = (OTYPE)(FORMULA);                                   \
        }                                                               \
    } else {                                                            \
        const T a = pa[0];                                              \
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++)             \
        {                                                               \
            T b = pb[i];                                                \
            po[i] = (OTYPE)(FORMULA);                                   \
        }                                                               \
    }

#define DEF_ARITH(NAME, FORMULA, TYPE, tn)                                          \
    KPL_CLONES static void bin_##NAME##_##tn(void *o_, const void *a_, const void *b_, \
                                             int64_t n, int mode)                   \
    {                                                                               \
        BIN_LOOP(TYPE, TYPE, FORMULA)                                               \
    }
#define DEF_CMP(NAME, FORMULA, TYPE, tn)                                            \
    KPL_CLONES static void bin_##NAME##_##tn(void *o_, const void *a_, const void *b_, \
                                             int64_t n, int mode)                   \
    {                                                                               \
        BIN_LOOP(TYPE, uint8_t, FORMULA)                                            \
    }

#define DEF_ARITH_f32(N, F) DEF_ARITH(N, F, float, f32)
#define DEF_ARITH_f64(N, F) DEF_ARITH(N, F, double, f64)
#define DEF_ARITH_i32(N, F) DEF_ARITH(N, F, int32_t, i32)
#define DEF_ARITH_i64(N, F) DEF_ARITH(N, F, int64_t, i64)
#define DEF_ARITH_u8(N, F) DEF_ARITH(N, F, uint8_t, u8)
#define DEF_CMP_f32(N, F) DEF_CMP(N, F, float, f32)
#define DEF_CMP_f64(N, F) DEF_CMP(N, F, double, f64)
#define DEF_CMP_i32(N, F) DEF_CMP(N, F, int32_t, i32)
#define DEF_CMP_i64(N, F) DEF_CMP(N, F, int64_t, i64)
#define DEF_CMP_u8(N, F) DEF_CMP(N, F, uint8_t, u8)

KPL_BINARY_ARITH_FORMULAS(DEF_ARITH_f32)
KPL_BINARY_ARITH_FORMULAS(DEF_ARITH_f64)
KPL_BINARY_ARITH_FORMULAS(DEF_ARITH_i32)
KPL_BINARY_ARITH_FORMULAS(DEF_ARITH_i64)
KPL_BINARY_ARITH_FORMULAS(DEF_ARITH_u8)
KPL_BINARY_CMP_FORMULAS(DEF_CMP_f32)
KPL_BINARY_CMP_FORMULAS(DEF_CMP_f64)
KPL_BINARY_CMP_FORMULAS(DEF_CMP_i32)
KPL_BINARY_CMP_FORMULAS(DEF_CMP_i64)
KPL_BINARY_CMP_FORMULAS(DEF_CMP_u8)

#define DEF_UNARY(NAME, FORMULA, TYPE, tn)                                       \
    KPL_CLONES static void un_##NAME##_##tn(void *o_, const void *x_, int64_t n, \
                                            double alpha, double beta)          \
    {                                                                            \
        typedef TYPE T;                                                          \
        T *po = o_;                                                              \
        const T *px = x_;                                                        \
        (void)alpha;                                                             \
        (void)beta;                                                              \
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++)                      \
        {                                                                        \
            T x = px[i];                                                         \
            po[i] = (T)(FORMULA);                                                \
        }                                                                        \
    }
#define DEF_UNARY_f32(N, F) DEF_UNARY(N, F, float, f32)
#define DEF_UNARY_f64(N, F) DEF_UNARY(N, F, double, f64)
#define DEF_UNARY_i32(N, F) DEF_UNARY(N, F, int32_t, i32)
#define DEF_UNARY_i64(N, F) DEF_UNARY(N, F, int64_t, i64)

KPL_UNARY_FORMULAS(DEF_UNARY_f32)
KPL_UNARY_FORMULAS(DEF_UNARY_f64)
KPL_UNARY_INT_FORMULAS(DEF_UNARY_i32)
KPL_UNARY_INT_FORMULAS(DEF_UNARY_i64)

/* ---- streaming variants --------------------------------------------------------- */

/* f32 add/sub/mul whose output is far larger than the caches (optimizer
 * updates, gradient sums) are stream-bound: writing them with non-temporal
 * stores skips the read-for-ownership of each destination line and takes
 * a 64M-element add from ~22 to ~30 GB/s on one core.  The formula is the
 * same X-macro expression, instantiated with T = a vector of 8 floats. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define KPL_HAVE_STREAM 1
#define STREAM_MIN_BYTES ((int64_t)16 << 20)
typedef float kpl_v8f __attribute__((vector_size(32)));

#define DEF_STREAM(NAME, FORMULA)                                                         \
    __attribute__((target("avx2"))) static void stream_##NAME(void *o_, const void *a_,   \
                                                             const void *b_, int64_t n,   \
                                                             int mode)                    \
    {                                                                                     \
        float *po = o_;                                                                   \
        const float *pa = a_, *pb = b_;                                                   \
        int64_t head = (int64_t)((32 - ((uintptr_t)po & 31)) & 31) / 4;                   \
        if (head > n) head = n;                                                           \
        bin_##NAME##_f32(po, pa, pb, head, mode);                                         \
        int64_t i = head;                                                                 \
        for (; i + 8 <= n; i += 8) {                                                      \
            typedef kpl_v8f T;                                                            \
            T a, b;                                                                       \
            memcpy(&a, pa + i, sizeof a);                                                 \
            memcpy(&b, pb + i, sizeof b);                                                 \
            _mm256_stream_ps(po + i, (__m256)(FORMULA));                                  \
        }                                                                                 \
        bin_##NAME##_f32(po + i, pa + i, pb + i, n - i, mode);                            \
    }
/* The formulas of ADD, SUB and MUL are plain arithmetic, valid on vectors. */
#define STREAMABLE(X)                                                                     \
    X(ADD, (T)(a + b))                                                                    \
    X(SUB, (T)(a - b))                                                                    \
    X(MUL, (T)(a * b))
STREAMABLE(DEF_STREAM)

static bin_fn stream_variant(kpl_binary_op op)
{
    if (!__builtin_cpu_supports("avx2")) return NULL;
    switch (op) {
    case KPL_BIN_ADD: return stream_ADD;
    case KPL_BIN_SUB: return stream_SUB;
    case KPL_BIN_MUL: return stream_MUL;
    default: return NULL;
    }
}
#endif

/* ---- tables: [op] -> loop, per dtype ------------------------------------------ */

#define ENTRY(NAME, F, tn) [KPL_BIN_##NAME] = bin_##NAME##_##tn,
#define ENTRY_f32(N, F) ENTRY(N, F, f32)
#define ENTRY_f64(N, F) ENTRY(N, F, f64)
#define ENTRY_i32(N, F) ENTRY(N, F, i32)
#define ENTRY_i64(N, F) ENTRY(N, F, i64)
#define ENTRY_u8(N, F) ENTRY(N, F, u8)

static const bin_fn bin_f32[KPL_BINARY_COUNT] = {
    KPL_BINARY_ARITH_FORMULAS(ENTRY_f32) KPL_BINARY_CMP_FORMULAS(ENTRY_f32)};
static const bin_fn bin_f64[KPL_BINARY_COUNT] = {
    KPL_BINARY_ARITH_FORMULAS(ENTRY_f64) KPL_BINARY_CMP_FORMULAS(ENTRY_f64)};
static const bin_fn bin_i32[KPL_BINARY_COUNT] = {
    KPL_BINARY_ARITH_FORMULAS(ENTRY_i32) KPL_BINARY_CMP_FORMULAS(ENTRY_i32)};
static const bin_fn bin_i64[KPL_BINARY_COUNT] = {
    KPL_BINARY_ARITH_FORMULAS(ENTRY_i64) KPL_BINARY_CMP_FORMULAS(ENTRY_i64)};
static const bin_fn bin_u8[KPL_BINARY_COUNT] = {
    KPL_BINARY_ARITH_FORMULAS(ENTRY_u8) KPL_BINARY_CMP_FORMULAS(ENTRY_u8)};

#define UENTRY(NAME, F, tn) [KPL_UN_##NAME] = un_##NAME##_##tn,
#define UENTRY_f32(N, F) UENTRY(N, F, f32)
#define UENTRY_f64(N, F) UENTRY(N, F, f64)
#define UENTRY_i32(N, F) UENTRY(N, F, i32)
#define UENTRY_i64(N, F) UENTRY(N, F, i64)

static const un_fn un_f32[KPL_UNARY_COUNT] = {KPL_UNARY_FORMULAS(UENTRY_f32)};
static const un_fn un_f64[KPL_UNARY_COUNT] = {KPL_UNARY_FORMULAS(UENTRY_f64)};
static const un_fn un_i32[KPL_UNARY_COUNT] = {KPL_UNARY_INT_FORMULAS(UENTRY_i32)};
static const un_fn un_i64[KPL_UNARY_COUNT] = {KPL_UNARY_INT_FORMULAS(UENTRY_i64)};

static const bin_fn *bin_table(kpl_dtype dt)
{
    switch (dt) {
    case KPL_F32: return bin_f32;
    case KPL_F64: return bin_f64;
    case KPL_I32: return bin_i32;
    case KPL_I64: return bin_i64;
    case KPL_U8:
    case KPL_BOOL: return bin_u8;
    default: return NULL;
    }
}

static const un_fn *un_table(kpl_dtype dt)
{
    switch (dt) {
    case KPL_F32: return un_f32;
    case KPL_F64: return un_f64;
    case KPL_I32: return un_i32;
    case KPL_I64: return un_i64;
    default: return NULL;
    }
}

/* ---- f16 / bf16 ------------------------------------------------------------- */

/* Values per stack block: three blocks of f32 stay in L1. */
#define HALF_BLOCK 512

KPL_CLONES static void widen_bf16(float *d, const uint16_t *s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) d[i] = kpl_cvt_bf16_to_f32(s[i]);
}
KPL_CLONES static void narrow_bf16(uint16_t *d, const float *s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) d[i] = kpl_cvt_f32_to_bf16(s[i]);
}
static void widen_f16(float *d, const uint16_t *s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) d[i] = kpl_cvt_f16_to_f32(s[i]);
}
static void narrow_f16(uint16_t *d, const float *s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) d[i] = kpl_cvt_f32_to_f16(s[i]);
}

void kpl__cpu_widen_half(kpl_dtype dt, float *d, const void *s, int64_t n)
{
    (dt == KPL_BF16 ? widen_bf16 : widen_f16)(d, s, n);
}
void kpl__cpu_narrow_half(kpl_dtype dt, void *d, const float *s, int64_t n)
{
    (dt == KPL_BF16 ? narrow_bf16 : narrow_f16)(d, s, n);
}
#define widen kpl__cpu_widen_half
#define narrow kpl__cpu_narrow_half

/* One binary row: the loop `fn` (f32) and how to read and write it.
 * For f16/bf16 (`half`), an operand marked f32 is the scalar of a
 * scalar op, kept in f32 as the f32 kernel would see it; compare
 * results (`cmp`) are bools, written as they are. */
typedef struct {
    bin_fn fn;
    kpl_dtype dt;
    bool half, cmp, a_f32, b_f32;
} bin_job;

static void half_operand(const bin_job *j, float *d, const char *p, bool f32, bool fixed,
                         int64_t at, int64_t m)
{
    if (f32) d[0] = *(const float *)p;
    else if (fixed) widen(j->dt, d, p, 1);
    else widen(j->dt, d, p + 2 * at, m);
}

static void run_row(const bin_job *j, char *po, const char *pa, const char *pb, int64_t n,
                    int mode)
{
    if (!j->half) {
        j->fn(po, pa, pb, n, mode);
        return;
    }
    float fa[HALF_BLOCK], fb[HALF_BLOCK], fo[HALF_BLOCK];
    for (int64_t i = 0; i < n; i += HALF_BLOCK) {
        int64_t m = n - i < HALF_BLOCK ? n - i : HALF_BLOCK;
        half_operand(j, fa, pa, j->a_f32, mode == 2, i, m);
        half_operand(j, fb, pb, j->b_f32, mode == 1, i, m);
        if (j->cmp) {
            j->fn(po + i, fa, fb, m, mode);
        } else {
            j->fn(fo, fa, fb, m, mode);
            narrow(j->dt, po + 2 * i, fo, m);
        }
    }
}

/* ---- drivers ---------------------------------------------------------------- */

/* Splits [0, total) into one contiguous range per thread (memory-bound work
 * gains nothing from finer chunks and loses locality). */
static int chunk_count(int64_t total)
{
    if (total < 2 * KPL_PAR_GRAIN) return 1;
    int nt = omp_get_max_threads();
    int64_t by_grain = total / KPL_PAR_GRAIN;
    return (int)(by_grain < nt ? by_grain : nt);
}

/* Output elements [s, e) of a binary plan, one row segment at a time;
 * es, eo: element sizes of a, b and of the output. */
static void binary_range(const kpl_ew_plan *p, const bin_job *j, char *po, const char *pa,
                         const char *pb, size_t es, size_t eo, int mode, int64_t s, int64_t e)
{
    int64_t inner = p->shape[p->ndim - 1];
    int64_t sa = p->stride[0][p->ndim - 1], sb = p->stride[1][p->ndim - 1];
    while (s < e) {
        int64_t row = s / inner, col = s % inner;
        int64_t len = inner - col < e - s ? inner - col : e - s;
        int64_t oa = kpl__plan_offset(p, 0, row * inner) + col * sa;
        int64_t ob = kpl__plan_offset(p, 1, row * inner) + col * sb;
        run_row(j, po + s * eo, pa + oa * es, pb + ob * es, len, mode);
        s += len;
    }
}

/* Kept layouts (kpl_set_blocked_layouts): when every tensor operand is
 * held in one kept layout with out's own shape and out may be kept too,
 * the flat loops run on the kept bytes as they are (the same values in
 * the same places), and out is left in that layout.  Returns the layout,
 * KPL_KEPT_PLAIN (nothing taken) when it does not apply. */
static kpl_kept eltwise_kept(const kpl_tensor *out, const kpl_tensor *a, const kpl_tensor *b,
                             const char **pa, const char **pb, char **po)
{
    if (!kpl__keepable(out)) return KPL_KEPT_PLAIN;
    kpl_kept tag = kpl__kept(a);
    const kpl_tensor *in[2] = {a, b};
    const void *raw[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        if (!in[i]) continue;
        if (!(raw[i] = kpl__kept_data(in[i], tag))) return KPL_KEPT_PLAIN;
        for (int d = 0; d < 4; d++)
            if (in[i]->shape[d] != out->shape[d]) return KPL_KEPT_PLAIN;
    }
    *pa = raw[0];
    if (b) *pb = raw[1];
    *po = kpl__kept_out(out);
    return tag;
}

/* A kept a with a per-channel b: b's shape ends in (C, 1, 1), every other
 * dim 1 (a bias, a scale, after a transposed convolution or a user's
 * layer).  nChw16c: each channel block's 16 values are tiled over TILE
 * pixels, and the row loops run on a's bytes against the tile; NHWC: each
 * pixel's C values are one row against b as it is.  The same values in
 * the same places as the plain broadcast, out left in a's layout.  False
 * (nothing done) when it does not apply. */
#define TILE 64
static bool binary_kept_channel(const kpl_kernel_args *args, const bin_job *j, size_t es)
{
    const kpl_binary_attrs *at = args->attrs;
    const kpl_tensor *a = args->in[0], *b = args->in[1], *out = args->out;
    if (at->has_scalar || j->cmp || !b || b->storage == out->storage || !kpl__keepable(out) ||
        b->ndim < 3 || b->ndim > 4 || b->numel != out->shape[1] || (b->ndim == 4 && b->shape[0] != 1))
        return false;
    if (b->shape[b->ndim - 3] != out->shape[1]) return false;
    kpl_kept tag = kpl__kept(a);
    const char *pa = kpl__kept_data(a, tag);
    if (!pa) return false;
    for (int d = 0; d < 4; d++)
        if (a->shape[d] != out->shape[d]) return false;
    const char *pb = kpl__cdata(b);
    char *po = kpl__kept_out(out);
    int64_t c = out->shape[1], cb = c / 16, hw = out->shape[2] * out->shape[3];
    int64_t chunks = (hw + TILE - 1) / TILE, tasks = out->shape[0] * chunks;
    if (tag == KPL_KEPT_NHWC) {
        KPL_PARALLEL_FOR_IF(t, tasks, tasks > 1 && out->numel > 2 * KPL_PAR_GRAIN,
            int64_t p0 = t % chunks * TILE, np = hw - p0 < TILE ? hw - p0 : TILE;
            size_t off = (size_t)((t / chunks) * hw + p0) * (size_t)c * es;
            for (int64_t k = 0; k < np; k++, off += (size_t)c * es)
                run_row(j, po + off, pa + off, pb, c, 0);
        );
    } else {
        tasks *= cb;
        KPL_PARALLEL_FOR_IF(t, tasks, tasks > 1 && out->numel > 2 * KPL_PAR_GRAIN,
            int64_t blk = t / chunks, p0 = t % chunks * TILE; /* blk = n * cb + channel block */
            int64_t np = hw - p0 < TILE ? hw - p0 : TILE;
            _Alignas(64) char tile[TILE * 16 * 8];
            for (int64_t k = 0; k < np; k++)
                memcpy(tile + (size_t)k * 16 * es, pb + (size_t)(blk % cb) * 16 * es, 16 * es);
            size_t off = (size_t)(blk * hw + p0) * 16 * es;
            run_row(j, po + off, pa + off, tile, np * 16, 0);
        );
    }
    kpl__storage_set_kept(out, tag);
    return true;
}

static kpl_status cpu_binary(const kpl_kernel_args *args)
{
    const kpl_binary_attrs *at = args->attrs;
    const kpl_tensor *a = args->in[0], *b = args->in[1];
    kpl_dtype dt = a->dtype;
    bool half = dt == KPL_F16 || dt == KPL_BF16;
    bin_job j = {.dt = dt, .half = half, .cmp = kpl_binary_is_compare(at->op)};
    j.fn = bin_table(half ? KPL_F32 : dt)[at->op];
    KPL_ASSERT(j.fn != NULL, "binary loop missing");
    size_t es = kpl_dtype_size(dt);
    size_t eo = j.cmp ? 1 : es;

    if (binary_kept_channel(args, &j, es)) return KPL_OK;
    kpl_ew_plan p = at->plan;
    const char *pa = NULL, *pb = NULL;
    char *po = NULL;
    kpl_kept kept = eltwise_kept(args->out, a, at->has_scalar ? NULL : b, &pa, &pb, &po);
    if (!kept) pa = kpl__cdata(a);
    union { float f; double d; int32_t i; int64_t l; uint8_t u; } sc;
    if (at->has_scalar) {
        switch (dt) {
        case KPL_F32: case KPL_F16: case KPL_BF16: sc.f = (float)at->scalar; break;
        case KPL_F64: sc.d = at->scalar; break;
        case KPL_I32: sc.i = (int32_t)at->scalar; break;
        case KPL_I64: sc.l = (int64_t)at->scalar; break;
        default: sc.u = (uint8_t)at->scalar; break;
        }
        pb = (const char *)&sc;
        j.b_f32 = half;
        if (at->scalar_first) { /* s op a: the scalar is the first operand */
            for (int d = 0; d < p.ndim; d++) {
                p.stride[1][d] = p.stride[0][d];
                p.stride[0][d] = 0;
            }
            pb = pa;
            pa = (const char *)&sc;
            j.a_f32 = half;
            j.b_f32 = false;
        }
    } else if (!kept) {
        pb = kpl__cdata(b);
    }
    if (!kept) po = kpl__data(args->out);
    int64_t sa = p.stride[0][p.ndim - 1], sb = p.stride[1][p.ndim - 1];
    int mode = (sa && sb) ? 0 : (sa ? 1 : (sb ? 2 : 0));
    int64_t total = p.numel;
#ifdef KPL_HAVE_STREAM
    if (dt == KPL_F32 && mode == 0 && total * 4 >= STREAM_MIN_BYTES) {
        bin_fn sf = stream_variant(at->op);
        if (sf) j.fn = sf;
    }
#endif
    int nchunks = chunk_count(total);
    KPL_PARALLEL_FOR(c, nchunks,
        binary_range(&p, &j, po, pa, pb, es, eo, mode, total * c / nchunks,
                     total * (c + 1) / nchunks);
    );
    if (kept) kpl__storage_set_kept(args->out, kept);
    return KPL_OK;
}

static kpl_status cpu_unary(const kpl_kernel_args *args)
{
    const kpl_unary_attrs *at = args->attrs;
    const kpl_tensor *x = args->in[0];
    kpl_dtype dt = x->dtype;
    bool half = dt == KPL_F16 || dt == KPL_BF16;
    un_fn fn = un_table(half ? KPL_F32 : dt)[at->op];
    KPL_ASSERT(fn != NULL, "unary loop missing");
    size_t es = kpl_dtype_size(dt);
    const char *px = NULL;
    char *po = NULL;
    kpl_kept kept = eltwise_kept(args->out, x, NULL, &px, NULL, &po);
    if (!kept) {
        px = kpl__cdata(x);
        po = kpl__data(args->out);
    }
    int64_t total = x->numel;
    int nchunks = chunk_count(total);
    KPL_PARALLEL_FOR(c, nchunks,
        int64_t s = total * c / nchunks, e = total * (c + 1) / nchunks;
        if (!half) {
            fn(po + s * es, px + s * es, e - s, at->alpha, at->beta);
            continue;
        }
        float fx[HALF_BLOCK], fo[HALF_BLOCK];
        for (int64_t i = s; i < e; i += HALF_BLOCK) {
            int64_t m = e - i < HALF_BLOCK ? e - i : HALF_BLOCK;
            widen(dt, fx, px + 2 * i, m);
            fn(fo, fx, m, at->alpha, at->beta);
            narrow(dt, po + 2 * i, fo, m);
        }
    );
    if (kept) kpl__storage_set_kept(args->out, kept);
    return KPL_OK;
}

/* A plan collapsed to one dim has inner strides 0 or 1 (plan_build):
 * then the offsets are i times them, without the general index walk (the
 * common case: a mask and two tensors of one shape, or a scalar). */
/* One contiguous stretch: both values read, one picked (vectorised per
 * ISA: a branch per element mispredicts on a random mask). */
#define DEF_WHERE_DENSE(TYPE)                                                  \
    KPL_CLONES static void where_dense_##TYPE(TYPE *o, const uint8_t *c,      \
                                              const TYPE *a, const TYPE *b,   \
                                              int64_t n, bool a1, bool b1)    \
    {                                                                          \
        if (a1 && b1) {                                                        \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) {              \
                TYPE a_ = a[i], b_ = b[i];                                     \
                o[i] = c[i] ? a_ : b_;                                         \
            }                                                                  \
        } else if (a1) { /* b a scalar (where's gradient: 0 on one side) */    \
            TYPE b_ = b[0];                                                    \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) {              \
                TYPE a_ = a[i];                                                \
                o[i] = c[i] ? a_ : b_;                                         \
            }                                                                  \
        } else {                                                               \
            TYPE a_ = a[0];                                                    \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) {              \
                TYPE b_ = b1 ? b[i] : b[0];                                    \
                o[i] = c[i] ? a_ : b_;                                         \
            }                                                                  \
        }                                                                      \
    }
DEF_WHERE_DENSE(uint8_t)
DEF_WHERE_DENSE(uint16_t)
DEF_WHERE_DENSE(uint32_t)
DEF_WHERE_DENSE(uint64_t)

#define WHERE_LOOP(TYPE)                                                       \
    do {                                                                       \
        TYPE *o = (TYPE *)po;                                                  \
        const TYPE *va = (const TYPE *)pa, *vb = (const TYPE *)pb;             \
        if (flat) { /* both values read, then one picked: no branch */     \
            int64_t sc = at->plan.stride[0][0], sa = at->plan.stride[1][0];    \
            int64_t sb = at->plan.stride[2][0];                                \
            if (sc == 1 && (sa == 1 || sa == 0) && (sb == 1 || sb == 0)) {    \
                where_dense_##TYPE(o + s, pc + s, va + s * sa, vb + s * sb,    \
                                   e - s, sa == 1, sb == 1);                   \
                break;                                                         \
            }                                                                  \
            for (int64_t i = s; i < e; i++) {                                  \
                TYPE a_ = va[i * sa], b_ = vb[i * sb];                         \
                o[i] = pc[i * sc] ? a_ : b_;                                   \
            }                                                                  \
            break;                                                             \
        }                                                                      \
        for (int64_t i = s; i < e; i++) {                                      \
            int64_t oc = kpl__plan_offset(&at->plan, 0, i);                    \
            int64_t oa = kpl__plan_offset(&at->plan, 1, i);                    \
            int64_t ob = kpl__plan_offset(&at->plan, 2, i);                    \
            o[i] = pc[oc] ? va[oa] : vb[ob];                                   \
        }                                                                      \
    } while (0)

/* where() only moves values, so it is written per element size. */
static kpl_status cpu_where(const kpl_kernel_args *args)
{
    const kpl_where_attrs *at = args->attrs;
    const uint8_t *pc = kpl__cdata(args->in[0]);
    const char *pa = kpl__cdata(args->in[1]), *pb = kpl__cdata(args->in[2]);
    char *po = kpl__data(args->out);
    size_t es = kpl_dtype_size(args->in[1]->dtype);
    int64_t total = at->plan.numel;
    bool flat = at->plan.ndim == 1;
    int nchunks = chunk_count(total);
    KPL_PARALLEL_FOR(c, nchunks,
        int64_t s = total * c / nchunks, e = total * (c + 1) / nchunks;
        switch (es) {
        case 1: WHERE_LOOP(uint8_t); break;
        case 2: WHERE_LOOP(uint16_t); break;
        case 4: WHERE_LOOP(uint32_t); break;
        default: WHERE_LOOP(uint64_t); break;
        }
    );
    return KPL_OK;
}

void kpl__cpu_register_eltwise(void)
{
    static const kpl_dtype bin_types[] = {KPL_F32, KPL_F64, KPL_I32, KPL_I64, KPL_U8, KPL_BOOL,
                                          KPL_F16, KPL_BF16};
    for (size_t i = 0; i < sizeof bin_types / sizeof bin_types[0]; i++)
        kpl_kernel_register(KPL_KOP_BINARY, KPL_DEVICE_CPU, bin_types[i], cpu_binary);
    static const kpl_dtype un_types[] = {KPL_F32, KPL_F64, KPL_I32, KPL_I64, KPL_F16, KPL_BF16};
    for (size_t i = 0; i < sizeof un_types / sizeof un_types[0]; i++)
        kpl_kernel_register(KPL_KOP_UNARY, KPL_DEVICE_CPU, un_types[i], cpu_unary);
    for (int dt = 0; dt < KPL_DTYPE_COUNT; dt++)
        kpl_kernel_register(KPL_KOP_WHERE, KPL_DEVICE_CPU, (kpl_dtype)dt, cpu_where);
}
