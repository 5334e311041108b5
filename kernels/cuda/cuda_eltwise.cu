/*
 * cuda_eltwise.cu — CUDA kernels for the unary, binary and where families.
 *
 * The formulas come from eltwise_math.h, the same text the CPU loops
 * compile: each X-macro entry becomes a functor templated on the element
 * type, and one grid-stride kernel per family is instantiated for every
 * (functor, dtype) pair.  Broadcasting follows the front end's collapsed
 * plan (kpl_ew_plan); offsets are computed per element with 64-bit indices.
 */
#include "../eltwise_math.h"
#include "cuda_impl.h"

/* ---- functors generated from the formula lists ------------------------------ */

/* Unary formulas: `x`, `T`, `alpha`, `beta` in scope.  unf_* are the float
 * formulas (f32, f64), uni_* the integer-safe ones (i32, i64). */
#define DEF_UNARY(PREFIX, NAME, FORMULA)                                             \
    struct PREFIX##NAME {                                                            \
        template <typename T>                                                        \
        __device__ __forceinline__ T operator()(T x, double alpha, double beta) const \
        {                                                                            \
            (void)alpha;                                                             \
            (void)beta;                                                              \
            return (T)(FORMULA);                                                     \
        }                                                                            \
    };
#define DEF_UNARY_F(NAME, FORMULA) DEF_UNARY(unf_, NAME, FORMULA)
#define DEF_UNARY_I(NAME, FORMULA) DEF_UNARY(uni_, NAME, FORMULA)
KPL_UNARY_FORMULAS(DEF_UNARY_F)
KPL_UNARY_INT_FORMULAS(DEF_UNARY_I)
#undef DEF_UNARY_F
#undef DEF_UNARY_I
#undef DEF_UNARY

/* Binary arithmetic: `a`, `b`, `T` in scope; the result has type T. */
#define DEF_ARITH(NAME, FORMULA)                                   \
    struct bin_##NAME {                                            \
        template <typename T>                                      \
        __device__ __forceinline__ T operator()(T a, T b) const    \
        {                                                          \
            return (T)(FORMULA);                                   \
        }                                                          \
    };
KPL_BINARY_ARITH_FORMULAS(DEF_ARITH)
#undef DEF_ARITH

/* Comparisons: a bool stored as uint8_t. */
#define DEF_CMP(NAME, FORMULA)                                           \
    struct cmp_##NAME {                                                  \
        template <typename T>                                            \
        __device__ __forceinline__ uint8_t operator()(T a, T b) const    \
        {                                                                \
            return (uint8_t)(FORMULA);                                   \
        }                                                                \
    };
KPL_BINARY_CMP_FORMULAS(DEF_CMP)
#undef DEF_CMP

/* ---- kernels ------------------------------------------------------------------ */

/* out and x are contiguous with n elements; out may be x (in place). */
template <typename T, typename F>
__global__ void unary_kernel(T *out, const T *x, int64_t n, double alpha, double beta, F f)
{
    KPL_CUDA_FOR(i, n) out[i] = f(x[i], alpha, beta);
}

/* How a binary kernel gets its operands. */
enum { BIN_TENSORS = 0, BIN_SCALAR_SECOND = 1, BIN_SCALAR_FIRST = 2 };

/* out[i] = f(a, b) with a, b read through the plan: both from tensors
 * (BIN_TENSORS: inputs 0 and 1 of the plan), or one from tensor `a` (plan
 * input 0) and the other the scalar `s`, second or first. */
template <typename T, typename O, typename F>
__global__ void binary_kernel(O *out, const T *a, const T *b, T s, int mode, kpl_ew_plan p,
                              F f)
{
    KPL_CUDA_FOR(i, p.numel)
    {
        int64_t off[2];
        kpl_cuda_plan_offsets<2>(p, i, off);
        if (mode == BIN_TENSORS) out[i] = f(a[off[0]], b[off[1]]);
        else if (mode == BIN_SCALAR_SECOND) out[i] = f(a[off[0]], s);
        else out[i] = f(s, a[off[0]]);
    }
}

/* where() only moves values: V is an unsigned type of the element size. */
template <typename V>
__global__ void where_kernel(V *out, const uint8_t *c, const V *a, const V *b, kpl_ew_plan p)
{
    KPL_CUDA_FOR(i, p.numel)
    {
        int64_t off[3];
        kpl_cuda_plan_offsets<3>(p, i, off);
        out[i] = c[off[0]] ? a[off[1]] : b[off[2]];
    }
}

/* ---- unary -------------------------------------------------------------------- */

template <typename T, typename F>
static kpl_status launch_unary(kpl_cuda_state *cs, T *out, const T *x, int64_t n,
                               const kpl_unary_attrs *at, F f)
{
    unsigned blocks = kpl__cuda_blocks(cs, n, KPL_CUDA_THREADS);
    unary_kernel<T, F><<<blocks, KPL_CUDA_THREADS, 0, cs->compute>>>(out, x, n, at->alpha,
                                                                      at->beta, f);
    return KPL_CUDA_LAUNCHED(kpl_unary_name(at->op));
}

template <typename T>
static kpl_status unary_float(kpl_cuda_state *cs, T *out, const T *x, int64_t n,
                              const kpl_unary_attrs *at)
{
    switch (at->op) {
#define CASE(NAME, FORMULA) \
    case KPL_UN_##NAME: return launch_unary(cs, out, x, n, at, unf_##NAME());
        KPL_UNARY_FORMULAS(CASE)
#undef CASE
    default:
        return KPL_ERROR(KPL_EINVAL, "unary: unknown op %d", (int)at->op);
    }
}

template <typename T>
static kpl_status unary_int(kpl_cuda_state *cs, T *out, const T *x, int64_t n,
                            const kpl_unary_attrs *at)
{
    switch (at->op) {
#define CASE(NAME, FORMULA) \
    case KPL_UN_##NAME: return launch_unary(cs, out, x, n, at, uni_##NAME());
        KPL_UNARY_INT_FORMULAS(CASE)
#undef CASE
    default:
        return KPL_ERROR(KPL_EDTYPE, "%s: not defined for integer dtypes on cuda",
                         kpl_unary_name(at->op));
    }
}

static kpl_status cuda_unary(const kpl_kernel_args *args)
{
    const kpl_unary_attrs *at = (const kpl_unary_attrs *)args->attrs;
    const kpl_tensor *xt = args->in[0];
    kpl_cuda_state *cs;
    void *out;
    const void *x;
    KPL_TRY(kpl__cuda_pointers(args, 1, &cs, &out, &x));
    int64_t n = kpl_tensor_numel(xt);
    switch (kpl_tensor_dtype(xt)) {
    case KPL_F32: return unary_float(cs, (float *)out, (const float *)x, n, at);
    case KPL_F64: return unary_float(cs, (double *)out, (const double *)x, n, at);
    case KPL_I32: return unary_int(cs, (int32_t *)out, (const int32_t *)x, n, at);
    case KPL_I64: return unary_int(cs, (int64_t *)out, (const int64_t *)x, n, at);
    default:
        return KPL_ERROR(KPL_EDTYPE, "%s: no cuda kernel for dtype %s", kpl_unary_name(at->op),
                         kpl_dtype_name(kpl_tensor_dtype(xt)));
    }
}

/* ---- binary ------------------------------------------------------------------- */

template <typename T, typename O, typename F>
static kpl_status launch_binary(kpl_cuda_state *cs, void *out, const T *a, const T *b, T s,
                                int mode, const kpl_binary_attrs *at, F f)
{
    unsigned blocks = kpl__cuda_blocks(cs, at->plan.numel, KPL_CUDA_THREADS);
    binary_kernel<T, O, F><<<blocks, KPL_CUDA_THREADS, 0, cs->compute>>>(
        (O *)out, a, b, s, mode, at->plan, f);
    return KPL_CUDA_LAUNCHED(kpl_binary_name(at->op));
}

template <typename T>
static kpl_status binary_typed(kpl_cuda_state *cs, void *out, const T *a, const T *b,
                               const kpl_binary_attrs *at)
{
    int mode = !at->has_scalar ? BIN_TENSORS
               : at->scalar_first ? BIN_SCALAR_FIRST
                                  : BIN_SCALAR_SECOND;
    /* The scalar in the element type, converted on the host exactly as the
     * CPU kernel converts it. */
    T s = at->has_scalar ? (T)at->scalar : (T)0;
    switch (at->op) {
#define CASE(NAME, FORMULA) \
    case KPL_BIN_##NAME: return launch_binary<T, T>(cs, out, a, b, s, mode, at, bin_##NAME());
        KPL_BINARY_ARITH_FORMULAS(CASE)
#undef CASE
#define CASE(NAME, FORMULA)                                                                  \
    case KPL_BIN_##NAME:                                                                     \
        return launch_binary<T, uint8_t>(cs, out, a, b, s, mode, at, cmp_##NAME());
        KPL_BINARY_CMP_FORMULAS(CASE)
#undef CASE
    default:
        return KPL_ERROR(KPL_EINVAL, "binary: unknown op %d", (int)at->op);
    }
}

static kpl_status cuda_binary(const kpl_kernel_args *args)
{
    const kpl_binary_attrs *at = (const kpl_binary_attrs *)args->attrs;
    const kpl_tensor *ta = args->in[0];
    kpl_cuda_state *cs;
    void *out;
    const void *in[2] = {NULL, NULL};
    KPL_TRY(kpl__cuda_pointers(args, at->has_scalar ? 1 : 2, &cs, &out, in));
    const void *a = in[0], *b = in[1];
    switch (kpl_tensor_dtype(ta)) {
    case KPL_F32: return binary_typed(cs, out, (const float *)a, (const float *)b, at);
    case KPL_F64: return binary_typed(cs, out, (const double *)a, (const double *)b, at);
    case KPL_I32: return binary_typed(cs, out, (const int32_t *)a, (const int32_t *)b, at);
    case KPL_I64: return binary_typed(cs, out, (const int64_t *)a, (const int64_t *)b, at);
    case KPL_U8:
    case KPL_BOOL: /* bools are 0/1 bytes: max = or, min = and, ==, != */
        return binary_typed(cs, out, (const uint8_t *)a, (const uint8_t *)b, at);
    default:
        return KPL_ERROR(KPL_EDTYPE, "%s: no cuda kernel for dtype %s",
                         kpl_binary_name(at->op), kpl_dtype_name(kpl_tensor_dtype(ta)));
    }
}

/* ---- where -------------------------------------------------------------------- */

template <typename V>
static kpl_status launch_where(kpl_cuda_state *cs, void *out, const void *c, const void *a,
                               const void *b, const kpl_where_attrs *at)
{
    unsigned blocks = kpl__cuda_blocks(cs, at->plan.numel, KPL_CUDA_THREADS);
    where_kernel<V><<<blocks, KPL_CUDA_THREADS, 0, cs->compute>>>(
        (V *)out, (const uint8_t *)c, (const V *)a, (const V *)b, at->plan);
    return KPL_CUDA_LAUNCHED("where");
}

static kpl_status cuda_where(const kpl_kernel_args *args)
{
    const kpl_where_attrs *at = (const kpl_where_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    const void *in[3];
    KPL_TRY(kpl__cuda_pointers(args, 3, &cs, &out, in));
    const void *c = in[0], *a = in[1], *b = in[2];
    switch (kpl_dtype_size(kpl_tensor_dtype(args->in[1]))) {
    case 1: return launch_where<uint8_t>(cs, out, c, a, b, at);
    case 2: return launch_where<uint16_t>(cs, out, c, a, b, at);
    case 4: return launch_where<uint32_t>(cs, out, c, a, b, at);
    case 8: return launch_where<uint64_t>(cs, out, c, a, b, at);
    default:
        return KPL_ERROR(KPL_EDTYPE, "where: no cuda kernel for dtype %s",
                         kpl_dtype_name(kpl_tensor_dtype(args->in[1])));
    }
}

/* ---- registration ------------------------------------------------------------- */

extern "C" void kpl__cuda_register_eltwise(void)
{
    static const kpl_dtype un_types[] = {KPL_F32, KPL_F64, KPL_I32, KPL_I64};
    for (size_t i = 0; i < sizeof un_types / sizeof un_types[0]; i++)
        kpl_kernel_register(KPL_KOP_UNARY, KPL_DEVICE_CUDA, un_types[i], cuda_unary);
    static const kpl_dtype bin_types[] = {KPL_F32, KPL_F64, KPL_I32, KPL_I64, KPL_U8, KPL_BOOL};
    for (size_t i = 0; i < sizeof bin_types / sizeof bin_types[0]; i++)
        kpl_kernel_register(KPL_KOP_BINARY, KPL_DEVICE_CUDA, bin_types[i], cuda_binary);
    /* Every dtype, f16/bf16 included: the front end dispatches where() on
     * half tensors directly, as 2-byte moves. */
    for (int dt = 0; dt < KPL_DTYPE_COUNT; dt++)
        kpl_kernel_register(KPL_KOP_WHERE, KPL_DEVICE_CUDA, (kpl_dtype)dt, cuda_where);
}
