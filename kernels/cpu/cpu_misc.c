/*
 * cpu_misc.c — fill, arange, random (Philox), cast and copy on the CPU, and
 * the loss-scale unscaling of kpl_k_amp_unscale.
 */
#include "../eltwise_math.h"
#include "kernels_impl.h"
#include "../convert_math.h"
#include "../amp_math.h"
#include "../philox.h"

#include <omp.h>
#include <string.h>

static int chunks_for(int64_t total)
{
    if (total < 2 * KPL_PAR_GRAIN) return 1;
    int nt = omp_get_max_threads();
    int64_t g = total / KPL_PAR_GRAIN;
    return (int)(g < nt ? g : nt);
}

/* ---- conversions -------------------------------------------------------------- */

/* Every source value is widened to double (floats, i32, u8, bool: exact) or
 * int64_t (i64: exact), then narrowed to the destination with the
 * conversions of convert_math.h. */
#define FROM_f32(p, i) ((double)((const float *)(p))[i])
#define FROM_f64(p, i) (((const double *)(p))[i])
#define FROM_f16(p, i) ((double)kpl_cvt_f16_to_f32(((const uint16_t *)(p))[i]))
#define FROM_bf16(p, i) ((double)kpl_cvt_bf16_to_f32(((const uint16_t *)(p))[i]))
#define FROM_i32(p, i) ((double)((const int32_t *)(p))[i])
#define FROM_i64(p, i) (((const int64_t *)(p))[i])
#define FROM_u8(p, i) ((double)((const uint8_t *)(p))[i])
#define FROM_b8(p, i) ((double)(((const uint8_t *)(p))[i] != 0))

#define TO_f32(p, i, v) (((float *)(p))[i] = (float)(v))
#define TO_f64(p, i, v) (((double *)(p))[i] = (double)(v))
#define TO_f16(p, i, v) (((uint16_t *)(p))[i] = kpl_cvt_f32_to_f16((float)(v)))
#define TO_bf16(p, i, v) (((uint16_t *)(p))[i] = kpl_cvt_f32_to_bf16((float)(v)))
#define TO_i32(p, i, v)                                                          \
    (((int32_t *)(p))[i] = _Generic((v), int64_t: (int32_t)(uint32_t)(uint64_t)(v), \
                                    default: kpl_sat_i32((double)(v))))
#define TO_i64(p, i, v) \
    (((int64_t *)(p))[i] = _Generic((v), int64_t: (v), default: kpl_sat_i64((double)(v))))
#define TO_u8(p, i, v) \
    (((uint8_t *)(p))[i] = _Generic((v), int64_t: (uint8_t)(v), default: kpl_sat_u8((double)(v))))
#define TO_b8(p, i, v) (((uint8_t *)(p))[i] = (uint8_t)((v) != 0))

/* Two copies of the dtype list: a macro cannot expand itself, and the
 * cast table needs one list nested in the other. */
#define DTYPES(X, A) X(A, f32) X(A, f16) X(A, bf16) X(A, i32) X(A, i64) X(A, u8) X(A, b8) X(A, f64)
#define DTYPES2(X, A) X(A, f32) X(A, f16) X(A, bf16) X(A, i32) X(A, i64) X(A, u8) X(A, b8) X(A, f64)

#define DEF_CAST(SRC, DST)                                                 \
    static void cast_##SRC##_##DST(void *o, const void *x, int64_t s, int64_t e) \
    {                                                                      \
        for (int64_t i = s; i < e; i++) TO_##DST(o, i, FROM_##SRC(x, i));  \
    }
#define DEF_CAST_ROW(_, SRC) DTYPES2(DEF_CAST, SRC)
DTYPES(DEF_CAST_ROW, _)

typedef void (*cast_fn)(void *, const void *, int64_t, int64_t);
#define CAST_ENTRY(SRC, DST) cast_##SRC##_##DST,
#define CAST_ROW(_, SRC) {DTYPES2(CAST_ENTRY, SRC)},
/* Indexed [src][dst]: DTYPES lists the dtypes in enum order (checked by
 * the static assertion below). */
static const cast_fn cast_table[KPL_DTYPE_COUNT][KPL_DTYPE_COUNT] = {DTYPES(CAST_ROW, _)};
_Static_assert(KPL_F32 == 0 && KPL_F16 == 1 && KPL_BF16 == 2 && KPL_I32 == 3 && KPL_I64 == 4 &&
                   KPL_U8 == 5 && KPL_BOOL == 6 && KPL_F64 == 7 && KPL_DTYPE_COUNT == 8,
               "DTYPES must follow kpl_dtype's order");

static kpl_status cpu_cast(const kpl_kernel_args *args)
{
    const kpl_tensor *x = args->in[0];
    cast_fn fn = cast_table[x->dtype][args->out->dtype];
    const void *px = kpl__cdata(x);
    void *po = kpl__data(args->out);
    int64_t total = x->numel;
    int nc = chunks_for(total);
    KPL_PARALLEL_FOR(c, nc, fn(po, px, total * c / nc, total * (c + 1) / nc);
    );
    return KPL_OK;
}

/* ---- fill / arange -------------------------------------------------------------- */

static kpl_status cpu_fill(const kpl_kernel_args *args)
{
    const kpl_fill_attrs *at = args->attrs;
    kpl_tensor *out = args->out;
    /* The value in out's dtype, as raw bytes. */
    uint64_t pattern = 0;
    double v = at->value;
    char tmp[8];
    switch (out->dtype) {
    case KPL_F32: TO_f32(tmp, 0, v); break;
    case KPL_F64: TO_f64(tmp, 0, v); break;
    case KPL_F16: TO_f16(tmp, 0, v); break;
    case KPL_BF16: TO_bf16(tmp, 0, v); break;
    case KPL_I32: TO_i32(tmp, 0, v); break;
    case KPL_I64: TO_i64(tmp, 0, v); break;
    case KPL_U8: TO_u8(tmp, 0, v); break;
    default: TO_b8(tmp, 0, v); break;
    }
    memcpy(&pattern, tmp, kpl_dtype_size(out->dtype));
    size_t es = kpl_dtype_size(out->dtype);
    char *po = kpl__data(out);
    int64_t total = out->numel;
    int nc = chunks_for(total);
    KPL_PARALLEL_FOR(c, nc,
        int64_t s = total * c / nc, e = total * (c + 1) / nc;
        switch (es) {
        case 1: memset(po + s, (int)(pattern & 0xff), (size_t)(e - s)); break;
        case 2: {
            uint16_t p;
            memcpy(&p, &pattern, 2);
            for (int64_t i = s; i < e; i++) ((uint16_t *)po)[i] = p;
            break;
        }
        case 4: {
            uint32_t p;
            memcpy(&p, &pattern, 4);
            for (int64_t i = s; i < e; i++) ((uint32_t *)po)[i] = p;
            break;
        }
        default:
            for (int64_t i = s; i < e; i++) ((uint64_t *)po)[i] = pattern;
        }
    );
    return KPL_OK;
}

static kpl_status cpu_arange(const kpl_kernel_args *args)
{
    const kpl_arange_attrs *at = args->attrs;
    kpl_tensor *out = args->out;
    void *po = kpl__data(out);
    int64_t total = out->numel;
    int nc = chunks_for(total);
    KPL_PARALLEL_FOR(c, nc,
        for (int64_t i = total * c / nc, e = total * (c + 1) / nc; i < e; i++) {
            double v = at->start + (double)i * at->step;
            switch (out->dtype) {
            case KPL_F32: TO_f32(po, i, v); break;
            case KPL_F64: TO_f64(po, i, v); break;
            case KPL_I32: TO_i32(po, i, v); break;
            default: TO_i64(po, i, v); break;
            }
        }
    );
    return KPL_OK;
}

/* ---- random ------------------------------------------------------------------- */

void kpl_philox4x32(uint64_t seed, uint64_t counter_hi, uint64_t counter_lo, uint32_t out[4])
{
    kpl_philox_block(seed, counter_hi, counter_lo, out);
}

static kpl_status cpu_random(const kpl_kernel_args *args)
{
    const kpl_random_attrs *at = args->attrs;
    kpl_tensor *out = args->out;
    void *po = kpl__data(out);
    kpl_dtype dt = out->dtype;
    int per = dt == KPL_F64 ? 2 : 4;
    int64_t n = out->numel, nblocks = (n + per - 1) / per;
    int nc = chunks_for(n);
    KPL_PARALLEL_FOR(c, nc,
        for (int64_t blk = nblocks * c / nc, e = nblocks * (c + 1) / nc; blk < e; blk++) {
            int64_t base = blk * per;
            if (dt == KPL_F64) {
                double v[2];
                kpl_random_block_f64(at->seed, at->offset + (uint64_t)blk, at->normal, at->p1,
                                     at->p2, v);
                for (int j = 0; j < 2 && base + j < n; j++) ((double *)po)[base + j] = v[j];
                continue;
            }
            float v[4];
            kpl_random_block_f32(at->seed, at->offset + (uint64_t)blk, at->normal, at->p1,
                                 at->p2, v);
            for (int j = 0; j < 4 && base + j < n; j++) {
                if (dt == KPL_F32) ((float *)po)[base + j] = v[j];
                else if (dt == KPL_F16) ((uint16_t *)po)[base + j] = kpl_cvt_f32_to_f16(v[j]);
                else ((uint16_t *)po)[base + j] = kpl_cvt_f32_to_bf16(v[j]);
            }
        }
    );
    return KPL_OK;
}

/* ---- copy ----------------------------------------------------------------------- */

/* Row by row of the last dim: the offset walk once a row, then a fill (an
 * expand along it: stride 0), a copy (stride 1) or a strided read; an
 * element at a time the walk cost ~1 ns an element (the expands in a
 * gradient penalty's double backward ran at 2 GB/s). */
#define GATHER(TYPE)                                                           \
    do {                                                                       \
        const TYPE *src = (const TYPE *)px;                                    \
        TYPE *dst = (TYPE *)po;                                                \
        int64_t W = at->plan.shape[at->plan.ndim - 1];                         \
        int64_t sw = at->plan.stride[0][at->plan.ndim - 1];                    \
        for (int64_t i = s; i < e;) {                                          \
            int64_t j0 = i % W, n = W - j0 < e - i ? W - j0 : e - i;           \
            const TYPE *r = src + kpl__plan_offset(&at->plan, 0, i);           \
            TYPE *d = dst + i;                                                 \
            if (sw == 0) {                                                     \
                TYPE v = r[0];                                                 \
                for (int64_t j = 0; j < n; j++) d[j] = v;                      \
            } else if (sw == 1) {                                              \
                memcpy(d, r, (size_t)n * sizeof(TYPE));                        \
            } else {                                                           \
                for (int64_t j = 0; j < n; j++) d[j] = r[j * sw];              \
            }                                                                  \
            i += n;                                                            \
        }                                                                      \
    } while (0)

static kpl_status cpu_copy(const kpl_kernel_args *args)
{
    const kpl_copy_attrs *at = args->attrs;
    const kpl_tensor *x = args->in[0];
    const char *px = kpl__cdata(x);
    char *po = kpl__data(args->out);
    size_t es = kpl_dtype_size(x->dtype);
    if (at && at->slab) { /* rows of bytes, a chunk of rows a task */
        int nr = chunks_for(at->rows * at->width / 4);
        KPL_PARALLEL_FOR(c, nr,
            for (int64_t r = at->rows * c / nr; r < at->rows * (c + 1) / nr; r++)
                memcpy(po + at->dst_off + r * at->dst_pitch, px + at->src_off + r * at->src_pitch,
                       (size_t)at->width);
        );
        return KPL_OK;
    }
    int64_t total = args->out->numel; /* an expand writes more than it reads */
    int nc = chunks_for(total);
    KPL_PARALLEL_FOR(c, nc,
        int64_t s = total * c / nc, e = total * (c + 1) / nc;
        if (!at) {
            memcpy(po + s * es, px + s * es, (size_t)(e - s) * es);
            continue;
        }
        switch (es) {
        case 1: GATHER(uint8_t); break;
        case 2: GATHER(uint16_t); break;
        case 4: GATHER(uint32_t); break;
        default: GATHER(uint64_t); break;
        }
    );
    return KPL_OK;
}

/* ---- loss scaling ------------------------------------------------------------------ */

/* Scales p[b, e) of dtype dt; 1 when a value there was not finite. */
static int amp_unscale_range(void *p, kpl_dtype dt, float s, double sd, int64_t b, int64_t e)
{
    int bad = 0;
    switch (dt) {
    case KPL_F32:
        for (int64_t i = b; i < e; i++) bad |= kpl_amp_f32((float *)p + i, s);
        break;
    case KPL_F64:
        for (int64_t i = b; i < e; i++) bad |= kpl_amp_f64((double *)p + i, sd);
        break;
    case KPL_F16:
        for (int64_t i = b; i < e; i++) bad |= kpl_amp_f16((uint16_t *)p + i, s);
        break;
    default: /* bf16 */
        for (int64_t i = b; i < e; i++) bad |= kpl_amp_bf16((uint16_t *)p + i, s);
        break;
    }
    return bad;
}

static kpl_status cpu_amp_unscale(const kpl_kernel_args *args)
{
    const kpl_amp_attrs *at = args->attrs;
    kpl_tensor *g = args->out;
    void *pg = kpl__data(g);
    kpl_dtype dt = g->dtype;
    float s = (float)at->inv_scale;
    double sd = at->inv_scale;
    int64_t total = g->numel;
    int nc = chunks_for(total), bad = 0;
    if (nc == 1) {
        bad = amp_unscale_range(pg, dt, s, sd, 0, total);
    } else {
#pragma omp parallel for schedule(static) reduction(| : bad)
        for (int c = 0; c < nc; c++)
            bad |= amp_unscale_range(pg, dt, s, sd, total * c / nc, total * (c + 1) / nc);
    }
    /* Only a find writes: the flag is never cleared here. */
    if (bad) *(float *)kpl__data(at->found_inf) = 1.0f;
    return KPL_OK;
}

/* ---- optimizer steps ----------------------------------------------------------------- */

/* kpl_k_sgd_update over [b, e): each operation rounded to T on its own,
 * as the element-wise kernels round them one op at a time (this file is
 * built without FMA contraction). */
#define SGD_RANGE(T)                                                                      \
    KPL_CLONES static void sgd_##T(T *restrict p, T *restrict v, const T *restrict g,      \
                                   const kpl_sgd_attrs *a, int64_t b, int64_t e)          \
    {                                                                                     \
        T lr = (T)a->lr, mu = (T)a->momentum, wd = (T)a->wd;                              \
        bool decay = a->wd > 0, first = a->first, nest = a->nesterov;                     \
        for (int64_t i = b; i < e; i++) {                                                 \
            T d = decay ? p[i] * wd + g[i] : g[i];                                        \
            if (v) {                                                                      \
                T m = first ? d : v[i] * mu + d;                                          \
                v[i] = m;                                                                 \
                d = nest ? m * mu + d : m;                                                \
            }                                                                             \
            p[i] = p[i] - d * lr;                                                         \
        }                                                                                 \
    }
SGD_RANGE(float)
SGD_RANGE(double)

static kpl_status cpu_sgd(const kpl_kernel_args *args)
{
    const kpl_sgd_attrs *a = args->attrs;
    kpl_tensor *p = args->out;
    int64_t total = p->numel;
    void *pp = kpl__data(p), *pv = a->v ? kpl__data(a->v) : NULL;
    const void *pg = kpl__cdata(args->in[0]);
    int nc = chunks_for(total);
#pragma omp parallel for schedule(static) if (nc > 1)
    for (int c = 0; c < nc; c++) {
        int64_t b = total * c / nc, e = total * (c + 1) / nc;
        if (p->dtype == KPL_F32)
            sgd_float(pp, pv, pg, a, b, e);
        else
            sgd_double(pp, pv, pg, a, b, e);
    }
    return KPL_OK;
}

void kpl__cpu_register_misc(void)
{
    for (int dt = 0; dt < KPL_DTYPE_COUNT; dt++) {
        kpl_kernel_register(KPL_KOP_FILL, KPL_DEVICE_CPU, (kpl_dtype)dt, cpu_fill);
        kpl_kernel_register(KPL_KOP_CAST, KPL_DEVICE_CPU, (kpl_dtype)dt, cpu_cast);
        kpl_kernel_register(KPL_KOP_COPY, KPL_DEVICE_CPU, (kpl_dtype)dt, cpu_copy);
    }
    static const kpl_dtype ar[] = {KPL_F32, KPL_F64, KPL_I32, KPL_I64};
    for (size_t i = 0; i < 4; i++)
        kpl_kernel_register(KPL_KOP_ARANGE, KPL_DEVICE_CPU, ar[i], cpu_arange);
    static const kpl_dtype rnd[] = {KPL_F32, KPL_F64, KPL_F16, KPL_BF16};
    for (size_t i = 0; i < 4; i++)
        kpl_kernel_register(KPL_KOP_RANDOM, KPL_DEVICE_CPU, rnd[i], cpu_random);
    for (size_t i = 0; i < 4; i++) /* the float dtypes, as for random */
        kpl_kernel_register(KPL_KOP_AMP_UNSCALE, KPL_DEVICE_CPU, rnd[i], cpu_amp_unscale);
    kpl_kernel_register(KPL_KOP_SGD, KPL_DEVICE_CPU, KPL_F32, cpu_sgd);
    kpl_kernel_register(KPL_KOP_SGD, KPL_DEVICE_CPU, KPL_F64, cpu_sgd);
}
