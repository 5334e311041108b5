/*
 * cuda_misc.cu — FILL, ARANGE, RANDOM, CAST, COPY and AMP_UNSCALE on CUDA.
 *
 * The conversions (f16/bf16 rounding, saturating float -> int) and the
 * random blocks are the ones the CPU runs, from convert_math.h and
 * philox.h, so a cast or a uniform fill gives the same bits on every
 * device.
 */
#include "../eltwise_math.h"
#include "../convert_math.h"
#include "../amp_math.h"
#include "../philox.h"
#include "cuda_impl.h"

/* ---- loads and stores of any dtype ------------------------------------------- */

/* A value widened without loss: i64 as an integer, everything else as a
 * double (exact for f32, f16, bf16, i32, u8, bool). */
typedef struct {
    double d;
    int64_t i;
    bool is_int;
} wide;

__device__ __forceinline__ wide load_wide(const void *p, kpl_dtype dt, int64_t i)
{
    wide w = {0.0, 0, false};
    switch (dt) {
    case KPL_F32: w.d = ((const float *)p)[i]; break;
    case KPL_F64: w.d = ((const double *)p)[i]; break;
    case KPL_F16: w.d = kpl_cvt_f16_to_f32(((const uint16_t *)p)[i]); break;
    case KPL_BF16: w.d = kpl_cvt_bf16_to_f32(((const uint16_t *)p)[i]); break;
    case KPL_I32: w.d = ((const int32_t *)p)[i]; break;
    case KPL_I64:
        w.i = ((const int64_t *)p)[i];
        w.is_int = true;
        break;
    case KPL_U8: w.d = ((const uint8_t *)p)[i]; break;
    default: w.d = ((const uint8_t *)p)[i] != 0; break; /* bool */
    }
    return w;
}

/* Narrows as the CPU's TO_* macros do (cpu/cpu_misc.c). */
__device__ __forceinline__ void store_wide(void *p, kpl_dtype dt, int64_t i, wide w)
{
    switch (dt) {
    case KPL_F32: ((float *)p)[i] = w.is_int ? (float)w.i : (float)w.d; break;
    case KPL_F64: ((double *)p)[i] = w.is_int ? (double)w.i : w.d; break;
    case KPL_F16:
        ((uint16_t *)p)[i] = kpl_cvt_f32_to_f16(w.is_int ? (float)w.i : (float)w.d);
        break;
    case KPL_BF16:
        ((uint16_t *)p)[i] = kpl_cvt_f32_to_bf16(w.is_int ? (float)w.i : (float)w.d);
        break;
    case KPL_I32:
        ((int32_t *)p)[i] = w.is_int ? (int32_t)(uint32_t)(uint64_t)w.i : kpl_sat_i32(w.d);
        break;
    case KPL_I64: ((int64_t *)p)[i] = w.is_int ? w.i : kpl_sat_i64(w.d); break;
    case KPL_U8: ((uint8_t *)p)[i] = w.is_int ? (uint8_t)w.i : kpl_sat_u8(w.d); break;
    default: ((uint8_t *)p)[i] = w.is_int ? (w.i != 0) : (w.d != 0); break; /* bool */
    }
}

/* ---- kernels ------------------------------------------------------------------ */

__global__ void cast_kernel(void *out, kpl_dtype odt, const void *x, kpl_dtype xdt, int64_t n)
{
    KPL_CUDA_FOR(i, n) store_wide(out, odt, i, load_wide(x, xdt, i));
}

template <typename V>
__global__ void fill_kernel(V *out, V v, int64_t n)
{
    KPL_CUDA_FOR(i, n) out[i] = v;
}

__global__ void arange_kernel(void *out, kpl_dtype dt, double start, double step, int64_t n)
{
    KPL_CUDA_FOR(i, n)
    {
        wide w = {start + (double)i * step, 0, false};
        store_wide(out, dt, i, w);
    }
}

/* One thread per Philox block. */
__global__ void random_kernel(void *out, kpl_dtype dt, kpl_random_attrs at, int64_t n)
{
    int per = dt == KPL_F64 ? 2 : 4;
    int64_t nblocks = (n + per - 1) / per;
    KPL_CUDA_FOR(blk, nblocks)
    {
        int64_t base = blk * per;
        if (dt == KPL_F64) {
            double v[2];
            kpl_random_block_f64(at.seed, at.offset + (uint64_t)blk, at.normal, at.p1, at.p2, v);
            for (int j = 0; j < 2 && base + j < n; j++) ((double *)out)[base + j] = v[j];
            continue;
        }
        float v[4];
        kpl_random_block_f32(at.seed, at.offset + (uint64_t)blk, at.normal, at.p1, at.p2, v);
        for (int j = 0; j < 4 && base + j < n; j++) {
            if (dt == KPL_F32)
                ((float *)out)[base + j] = v[j];
            else if (dt == KPL_F16)
                ((uint16_t *)out)[base + j] = kpl_cvt_f32_to_f16(v[j]);
            else
                ((uint16_t *)out)[base + j] = kpl_cvt_f32_to_bf16(v[j]);
        }
    }
}

template <typename V>
__global__ void gather_kernel(V *out, const V *x, kpl_ew_plan plan)
{
    KPL_CUDA_FOR(i, plan.numel)
    {
        int64_t off[1];
        kpl_cuda_plan_offsets<1>(plan, i, off);
        out[i] = x[off[0]];
    }
}

/* Scales g in place (amp_math.h, the CPU's step) and raises *found when a
 * value was not finite.  Each block ORs its threads' finds and one thread
 * stores 1.0f: every writer stores the same value, so the flag needs no
 * atomics and nothing here waits for the host. */
__global__ void amp_unscale_kernel(void *g, kpl_dtype dt, int64_t n, float s, double sd,
                                   float *found)
{
    int bad = 0;
    KPL_CUDA_FOR(i, n)
    {
        switch (dt) {
        case KPL_F32: bad |= kpl_amp_f32((float *)g + i, s); break;
        case KPL_F64: bad |= kpl_amp_f64((double *)g + i, sd); break;
        case KPL_F16: bad |= kpl_amp_f16((uint16_t *)g + i, s); break;
        default: bad |= kpl_amp_bf16((uint16_t *)g + i, s); break;
        }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1.0f;
}

/* ---- entry points --------------------------------------------------------------- */

static kpl_status cuda_cast(const kpl_kernel_args *args)
{
    kpl_cuda_state *cs;
    void *out;
    const void *x;
    KPL_TRY(kpl__cuda_pointers(args, 1, &cs, &out, &x));
    int64_t n = kpl_tensor_numel(args->out);
    cast_kernel<<<kpl__cuda_blocks(cs, n, KPL_CUDA_THREADS), KPL_CUDA_THREADS, 0, cs->compute>>>(
        out, kpl_tensor_dtype(args->out), x, kpl_tensor_dtype(args->in[0]), n);
    return KPL_CUDA_LAUNCHED("cast");
}

static kpl_status cuda_fill(const kpl_kernel_args *args)
{
    const kpl_fill_attrs *at = (const kpl_fill_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    KPL_TRY(kpl__cuda_pointers(args, 0, &cs, &out, NULL));
    kpl_dtype dt = kpl_tensor_dtype(args->out);
    int64_t n = kpl_tensor_numel(args->out);
    /* The value in out's dtype, converted on the host as the CPU does. */
    union {
        float f;
        double d;
        uint16_t h;
        int32_t i;
        int64_t l;
        uint8_t u;
    } v;
    double x = at->value;
    switch (dt) {
    case KPL_F32: v.f = (float)x; break;
    case KPL_F64: v.d = x; break;
    case KPL_F16: v.h = kpl_cvt_f32_to_f16((float)x); break;
    case KPL_BF16: v.h = kpl_cvt_f32_to_bf16((float)x); break;
    case KPL_I32: v.i = kpl_sat_i32(x); break;
    case KPL_I64: v.l = kpl_sat_i64(x); break;
    case KPL_U8: v.u = kpl_sat_u8(x); break;
    default: v.u = x != 0; break;
    }
    unsigned blocks = kpl__cuda_blocks(cs, n, KPL_CUDA_THREADS);
    switch (kpl_dtype_size(dt)) {
    case 1:
        KPL_CUDA_TRY(cudaMemsetAsync(out, v.u, (size_t)n, cs->compute));
        return KPL_OK;
    case 2:
        fill_kernel<<<blocks, KPL_CUDA_THREADS, 0, cs->compute>>>((uint16_t *)out, v.h, n);
        break;
    case 4: {
        uint32_t bits;
        memcpy(&bits, &v, 4);
        fill_kernel<<<blocks, KPL_CUDA_THREADS, 0, cs->compute>>>((uint32_t *)out, bits, n);
        break;
    }
    default: {
        uint64_t bits;
        memcpy(&bits, &v, 8);
        fill_kernel<<<blocks, KPL_CUDA_THREADS, 0, cs->compute>>>((uint64_t *)out, bits, n);
        break;
    }
    }
    return KPL_CUDA_LAUNCHED("fill");
}

static kpl_status cuda_arange(const kpl_kernel_args *args)
{
    const kpl_arange_attrs *at = (const kpl_arange_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    KPL_TRY(kpl__cuda_pointers(args, 0, &cs, &out, NULL));
    int64_t n = kpl_tensor_numel(args->out);
    arange_kernel<<<kpl__cuda_blocks(cs, n, KPL_CUDA_THREADS), KPL_CUDA_THREADS, 0,
                    cs->compute>>>(out, kpl_tensor_dtype(args->out), at->start, at->step, n);
    return KPL_CUDA_LAUNCHED("arange");
}

static kpl_status cuda_random(const kpl_kernel_args *args)
{
    const kpl_random_attrs *at = (const kpl_random_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    KPL_TRY(kpl__cuda_pointers(args, 0, &cs, &out, NULL));
    kpl_dtype dt = kpl_tensor_dtype(args->out);
    int64_t n = kpl_tensor_numel(args->out);
    int64_t nblocks = (n + (dt == KPL_F64 ? 1 : 3)) / (dt == KPL_F64 ? 2 : 4);
    random_kernel<<<kpl__cuda_blocks(cs, nblocks, KPL_CUDA_THREADS), KPL_CUDA_THREADS, 0,
                    cs->compute>>>(out, dt, *at, n);
    return KPL_CUDA_LAUNCHED("random");
}

static kpl_status cuda_copy(const kpl_kernel_args *args)
{
    const kpl_copy_attrs *at = (const kpl_copy_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    const void *x;
    KPL_TRY(kpl__cuda_pointers(args, 1, &cs, &out, &x));
    size_t es = kpl_dtype_size(kpl_tensor_dtype(args->in[0]));
    int64_t n = kpl_tensor_numel(args->out); /* an expand writes more than it reads */
    if (!at) {
        KPL_CUDA_TRY(cudaMemcpyAsync(out, x, (size_t)n * es, cudaMemcpyDeviceToDevice,
                                     cs->compute));
        return KPL_OK;
    }
    if (at->slab) {
        KPL_CUDA_TRY(cudaMemcpy2DAsync((char *)out + at->dst_off, (size_t)at->dst_pitch,
                                       (const char *)x + at->src_off, (size_t)at->src_pitch,
                                       (size_t)at->width, (size_t)at->rows,
                                       cudaMemcpyDeviceToDevice, cs->compute));
        return KPL_OK;
    }
    unsigned blocks = kpl__cuda_blocks(cs, n, KPL_CUDA_THREADS);
    switch (es) {
    case 1:
        gather_kernel<<<blocks, KPL_CUDA_THREADS, 0, cs->compute>>>(
            (uint8_t *)out, (const uint8_t *)x, at->plan);
        break;
    case 2:
        gather_kernel<<<blocks, KPL_CUDA_THREADS, 0, cs->compute>>>(
            (uint16_t *)out, (const uint16_t *)x, at->plan);
        break;
    case 4:
        gather_kernel<<<blocks, KPL_CUDA_THREADS, 0, cs->compute>>>(
            (uint32_t *)out, (const uint32_t *)x, at->plan);
        break;
    default:
        gather_kernel<<<blocks, KPL_CUDA_THREADS, 0, cs->compute>>>(
            (uint64_t *)out, (const uint64_t *)x, at->plan);
        break;
    }
    return KPL_CUDA_LAUNCHED("copy");
}

static kpl_status cuda_amp_unscale(const kpl_kernel_args *args)
{
    const kpl_amp_attrs *at = (const kpl_amp_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *g;
    KPL_TRY(kpl__cuda_pointers(args, 0, &cs, &g, NULL));
    float *found = (float *)kpl_tensor_mutable(at->found_inf);
    if (!found) return kpl_last_status();
    int64_t n = kpl_tensor_numel(args->out);
    amp_unscale_kernel<<<kpl__cuda_blocks(cs, n, KPL_CUDA_THREADS), KPL_CUDA_THREADS, 0,
                         cs->compute>>>(g, kpl_tensor_dtype(args->out), n,
                                        (float)at->inv_scale, at->inv_scale, found);
    return KPL_CUDA_LAUNCHED("amp_unscale");
}

extern "C" void kpl__cuda_register_misc(void)
{
    for (int dt = 0; dt < KPL_DTYPE_COUNT; dt++) {
        kpl_kernel_register(KPL_KOP_FILL, KPL_DEVICE_CUDA, (kpl_dtype)dt, cuda_fill);
        kpl_kernel_register(KPL_KOP_CAST, KPL_DEVICE_CUDA, (kpl_dtype)dt, cuda_cast);
        kpl_kernel_register(KPL_KOP_COPY, KPL_DEVICE_CUDA, (kpl_dtype)dt, cuda_copy);
    }
    static const kpl_dtype ar[] = {KPL_F32, KPL_F64, KPL_I32, KPL_I64};
    for (size_t i = 0; i < sizeof ar / sizeof ar[0]; i++)
        kpl_kernel_register(KPL_KOP_ARANGE, KPL_DEVICE_CUDA, ar[i], cuda_arange);
    static const kpl_dtype rnd[] = {KPL_F32, KPL_F64, KPL_F16, KPL_BF16};
    for (size_t i = 0; i < sizeof rnd / sizeof rnd[0]; i++)
        kpl_kernel_register(KPL_KOP_RANDOM, KPL_DEVICE_CUDA, rnd[i], cuda_random);
    for (size_t i = 0; i < sizeof rnd / sizeof rnd[0]; i++) /* the float dtypes */
        kpl_kernel_register(KPL_KOP_AMP_UNSCALE, KPL_DEVICE_CUDA, rnd[i], cuda_amp_unscale);
}
