/*
 * cuda_reduce.cu — reductions over x viewed as (outer, red, inner).
 *
 * One kernel shape covers every case.  A block of RED_THREADS threads is a
 * (bx columns) x (by rows) grid: each column produces one output element,
 * its `by` threads stride over the `red` values of that output and then
 * combine their partial results with a shared-memory tree over the rows.
 *
 *   inner == 1  the values of an output are contiguous: the threads of a
 *               warp walk one output's run (rows vary fastest), and a block
 *               holds several outputs when runs are short;
 *   inner > 1   the values of an output are `inner` apart: the threads of a
 *               warp take neighbouring outputs (columns vary fastest), so
 *               every row of the block reads contiguous memory.
 *
 * Blocks loop over tiles of bx outputs (grid-stride).  Semantics follow the
 * CPU kernel: f32 sums accumulate in f64 and integer sums in 64 bits;
 * max/min return the first NaN when there is one; arg* return the first
 * index of the extreme (or of the first NaN); var is two-pass (mean, then
 * squared deviations) with divisor red - correction; logsumexp and
 * sumexp_sub_max subtract the max and sum exp in double.  The summation
 * order is fixed by the shapes, so results are reproducible run to run.
 */
#include "cuda_impl.h"

#include <math.h>

#define RED_THREADS 256

/* What a thread does with each of its values in a summing pass. */
enum { SUM_PLAIN = 0, SUM_SQDEV = 1, SUM_EXPSUB = 2 };

/* Flags of a max/min partial. */
enum { MM_EMPTY = 0, MM_VALUE = 1, MM_NAN = 2 };

template <typename T> struct red_is_int { static const bool value = false; };
template <> struct red_is_int<int32_t> { static const bool value = true; };
template <> struct red_is_int<int64_t> { static const bool value = true; };
template <> struct red_is_int<uint8_t> { static const bool value = true; };

template <typename T> __device__ __forceinline__ bool red_isnan(T v) { return v != v; }

/* Shared memory of one block; `row` indexes by * bx partials as
 * ty * bx + tx. */
template <typename T> struct red_smem {
    double d[RED_THREADS];
    unsigned long long u[RED_THREADS];
    T v[RED_THREADS];
    long long arg[RED_THREADS];
    int flag[RED_THREADS];
};

/* Where one thread sits in its block and which output it serves. */
struct red_pos {
    int tx, ty, bx, by;
    int me;        /* ty * bx + tx: this thread's slot in shared memory */
    bool valid;    /* the column maps to an output of this tile */
    int64_t oi;    /* output index */
    int64_t step;  /* distance between consecutive reduced values */
};

/* Combines the rows of shared array `a` into row 0 (a tree over ty: `by` is
 * a power of two); `op(dst, src)` folds slot src into slot dst. */
template <typename Op>
__device__ __forceinline__ void red_tree(const red_pos &p, Op op)
{
    for (int s = p.by / 2; s > 0; s >>= 1) {
        if (p.ty < s) op(p.me, p.me + s * p.bx);
        __syncthreads();
    }
}

/* Sum over the column of f(x) where f is chosen by `kind`; c is the
 * per-column centre for SQDEV/EXPSUB.  Returns the column total to every
 * thread of the column. */
template <typename T>
__device__ double red_sum_d(const T *base, int64_t red, const red_pos &p, int kind, double c,
                            red_smem<T> &sm)
{
    double s = 0.0;
    if (p.valid) {
        for (int64_t r = p.ty; r < red; r += p.by) {
            double v = (double)base[r * p.step];
            if (kind == SUM_PLAIN) s += v;
            else if (kind == SUM_SQDEV) s += (v - c) * (v - c);
            else s += exp(v - c);
        }
    }
    sm.d[p.me] = s;
    __syncthreads();
    red_tree(p, [&](int dst, int src) { sm.d[dst] += sm.d[src]; });
    double total = sm.d[p.tx];
    __syncthreads(); /* before the slots are reused */
    return total;
}

/* Integer sum, wrapping in 64 bits as the CPU's int64 accumulator does. */
template <typename T>
__device__ unsigned long long red_sum_u(const T *base, int64_t red, const red_pos &p,
                                        red_smem<T> &sm)
{
    unsigned long long s = 0;
    if (p.valid)
        for (int64_t r = p.ty; r < red; r += p.by)
            s += (unsigned long long)(long long)base[r * p.step];
    sm.u[p.me] = s;
    __syncthreads();
    red_tree(p, [&](int dst, int src) { sm.u[dst] += sm.u[src]; });
    unsigned long long total = sm.u[p.tx];
    __syncthreads();
    return total;
}

/* Max or min of the column with its first index; NaN wins, the earliest
 * NaN first.  Each thread scans its indices in increasing order; partials
 * from different threads interleave, so ties go to the smaller index. */
template <typename T>
__device__ void red_extreme(const T *base, int64_t red, const red_pos &p, bool is_max,
                            red_smem<T> &sm, T *best_out, long long *arg_out, int *flag_out)
{
    T best = T(0);
    long long arg = 0;
    int flag = MM_EMPTY;
    if (p.valid) {
        for (int64_t r = p.ty; r < red; r += p.by) {
            T v = base[r * p.step];
            if (red_isnan(v)) {
                best = v;
                arg = r;
                flag = MM_NAN;
                break;
            }
            if (flag == MM_EMPTY || (is_max ? v > best : v < best)) {
                best = v;
                arg = r;
                flag = MM_VALUE;
            }
        }
    }
    sm.v[p.me] = best;
    sm.arg[p.me] = arg;
    sm.flag[p.me] = flag;
    __syncthreads();
    red_tree(p, [&](int dst, int src) {
        int fd = sm.flag[dst], fs = sm.flag[src];
        bool take;
        if (fs == MM_EMPTY) take = false;
        else if (fd == MM_EMPTY) take = true;
        else if (fd == MM_NAN) take = fs == MM_NAN && sm.arg[src] < sm.arg[dst];
        else if (fs == MM_NAN) take = true;
        else {
            T vd = sm.v[dst], vs = sm.v[src];
            take = (is_max ? vs > vd : vs < vd) || (vs == vd && sm.arg[src] < sm.arg[dst]);
        }
        if (take) {
            sm.v[dst] = sm.v[src];
            sm.arg[dst] = sm.arg[src];
            sm.flag[dst] = fs;
        }
    });
    *best_out = sm.v[p.tx];
    *arg_out = sm.arg[p.tx];
    *flag_out = sm.flag[p.tx];
    __syncthreads();
}

/* `bx_log2` sets the block's columns (bx = 1 << bx_log2, by = threads / bx);
 * `rows_fast` says whether consecutive threads differ in row (inner == 1)
 * or in column (inner > 1). */
template <typename T>
__global__ void __launch_bounds__(RED_THREADS)
    reduce_kernel(const T *x, void *out, int64_t outer, int64_t red, int64_t inner, int op,
                  int correction, int bx_log2, int rows_fast)
{
    __shared__ red_smem<T> sm;
    red_pos p;
    p.bx = 1 << bx_log2;
    p.by = RED_THREADS >> bx_log2;
    if (rows_fast) {
        p.ty = (int)threadIdx.x % p.by;
        p.tx = (int)threadIdx.x / p.by;
    } else {
        p.tx = (int)threadIdx.x % p.bx;
        p.ty = (int)threadIdx.x / p.bx;
    }
    p.me = p.ty * p.bx + p.tx;
    p.step = inner;
    /* inner == 1: a tile is bx consecutive outputs; inner > 1: a tile is bx
     * consecutive columns of one outer index. */
    int64_t tiles_per_outer = inner == 1 ? 1 : (inner + p.bx - 1) / p.bx;
    int64_t ntiles = inner == 1 ? (outer + p.bx - 1) / p.bx : outer * tiles_per_outer;

    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const T *base;
        if (inner == 1) {
            p.oi = tile * p.bx + p.tx;
            p.valid = p.oi < outer;
            base = x + p.oi * red;
        } else {
            int64_t o = tile / tiles_per_outer;
            int64_t i = (tile % tiles_per_outer) * p.bx + p.tx;
            p.valid = i < inner;
            p.oi = o * inner + i;
            base = x + o * red * inner + i;
        }
        /* The op is the same for every thread, so every thread takes the
         * same branch and meets the same __syncthreads. */
        bool write = p.valid && p.ty == 0;
        switch (op) {
        case KPL_RED_SUM:
        case KPL_RED_MEAN:
            if (red_is_int<T>::value) {
                unsigned long long s = red_sum_u(base, red, p, sm);
                if (write) ((T *)out)[p.oi] = (T)(long long)s;
            } else {
                double s = red_sum_d(base, red, p, SUM_PLAIN, 0.0, sm);
                if (write)
                    ((T *)out)[p.oi] = (T)(op == KPL_RED_SUM ? s : s / (double)red);
            }
            break;
        case KPL_RED_MAX:
        case KPL_RED_MIN:
        case KPL_RED_ARGMAX:
        case KPL_RED_ARGMIN: {
            T best;
            long long arg;
            int flag;
            red_extreme(base, red, p, op == KPL_RED_MAX || op == KPL_RED_ARGMAX, sm, &best,
                        &arg, &flag);
            if (!write) break;
            if (op == KPL_RED_MAX || op == KPL_RED_MIN) ((T *)out)[p.oi] = best;
            else ((int64_t *)out)[p.oi] = arg;
            break;
        }
        case KPL_RED_VAR: {
            double mean = red_sum_d(base, red, p, SUM_PLAIN, 0.0, sm) / (double)red;
            double sq = red_sum_d(base, red, p, SUM_SQDEV, mean, sm);
            double den = (double)(red - correction);
            if (write) ((T *)out)[p.oi] = (T)(den > 0 ? sq / den : (double)NAN);
            break;
        }
        case KPL_RED_LOGSUMEXP:
        case KPL_RED_SUMEXP_SUB_MAX: {
            T best;
            long long arg;
            int flag;
            red_extreme(base, red, p, true, sm, &best, &arg, &flag);
            double m = (double)best;
            bool special = flag == MM_NAN || isinf(m);
            /* Every column runs the second pass (it synchronises the block);
             * special columns ignore its result. */
            double s = red_sum_d(base, red, p, SUM_EXPSUB, special ? 0.0 : m, sm);
            if (!write) break;
            double v;
            if (op == KPL_RED_LOGSUMEXP) v = special ? m : m + log(s);
            else v = special ? (flag == MM_NAN || m > 0 ? (double)NAN : 0.0) : s;
            ((T *)out)[p.oi] = (T)v;
            break;
        }
        default:
            break;
        }
    }
}

static int ilog2_floor(int64_t v)
{
    int l = 0;
    while (((int64_t)1 << (l + 1)) <= v) l++;
    return l;
}

template <typename T>
static kpl_status launch_reduce(kpl_cuda_state *cs, const void *x, void *out,
                                const kpl_reduce_attrs *at)
{
    int64_t outer = at->outer, red = at->red, inner = at->inner;
    int bx_log2, rows_fast;
    if (inner == 1) {
        /* Rows per output: the run length rounded up to a power of two,
         * between one warp and the whole block. */
        int by_log2 = red <= 32 ? 5 : (red >= RED_THREADS ? 8 : ilog2_floor(red - 1) + 1);
        bx_log2 = 8 - by_log2;
        rows_fast = 1;
    } else {
        bx_log2 = inner >= 32 ? 5 : ilog2_floor(inner - 1) + 1;
        rows_fast = 0;
    }
    int64_t bx = (int64_t)1 << bx_log2;
    int64_t ntiles = inner == 1 ? (outer + bx - 1) / bx : outer * ((inner + bx - 1) / bx);
    int64_t cap = (int64_t)(cs->sm_count > 0 ? cs->sm_count : 1) * 16;
    unsigned blocks = (unsigned)(ntiles < cap ? (ntiles > 0 ? ntiles : 1) : cap);
    reduce_kernel<T><<<blocks, RED_THREADS, 0, cs->compute>>>(
        (const T *)x, out, outer, red, inner, (int)at->op, at->correction, bx_log2, rows_fast);
    return KPL_CUDA_LAUNCHED(kpl_reduce_name(at->op));
}

static bool op_ok_for_int(kpl_reduce_op op)
{
    return op == KPL_RED_SUM || op == KPL_RED_MAX || op == KPL_RED_MIN ||
           op == KPL_RED_ARGMAX || op == KPL_RED_ARGMIN;
}

static kpl_status cuda_reduce(const kpl_kernel_args *args)
{
    const kpl_reduce_attrs *at = (const kpl_reduce_attrs *)args->attrs;
    const kpl_tensor *xt = args->in[0];
    kpl_dtype dt = kpl_tensor_dtype(xt);
    const char *name = kpl_reduce_name(at->op);
    KPL_CHECK((unsigned)at->op < KPL_REDUCE_COUNT, KPL_EINVAL, "reduce: unknown op %d",
              (int)at->op);
    bool bytes = dt == KPL_U8 || dt == KPL_BOOL;
    KPL_CHECK(kpl_dtype_is_float(dt) || (!bytes && op_ok_for_int(at->op)) ||
                  (bytes && at->op != KPL_RED_SUM && op_ok_for_int(at->op)),
              KPL_EDTYPE, "%s: no cuda kernel for dtype %s", name, kpl_dtype_name(dt));
    if (at->red == 0) /* the front end allows only sum (0) and mean (NaN) */
        return kpl_k_fill(args->out, at->op == KPL_RED_SUM ? 0.0 : (double)NAN);

    kpl_cuda_state *cs;
    void *out;
    const void *x;
    KPL_TRY(kpl__cuda_pointers(args, 1, &cs, &out, &x));
    switch (dt) {
    case KPL_F32: return launch_reduce<float>(cs, x, out, at);
    case KPL_F64: return launch_reduce<double>(cs, x, out, at);
    case KPL_I32: return launch_reduce<int32_t>(cs, x, out, at);
    case KPL_I64: return launch_reduce<int64_t>(cs, x, out, at);
    case KPL_U8:
    case KPL_BOOL: return launch_reduce<uint8_t>(cs, x, out, at);
    default:
        return KPL_ERROR(KPL_EDTYPE, "%s: no cuda kernel for dtype %s", name,
                         kpl_dtype_name(dt));
    }
}

extern "C" void kpl__cuda_register_reduce(void)
{
    /* u8 and bool for max/min/argmax/argmin, which the front end allows. */
    static const kpl_dtype types[] = {KPL_F32, KPL_F64, KPL_I32, KPL_I64, KPL_U8, KPL_BOOL};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        kpl_kernel_register(KPL_KOP_REDUCE, KPL_DEVICE_CUDA, types[i], cuda_reduce);
}
