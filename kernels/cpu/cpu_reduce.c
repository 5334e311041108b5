/*
 * cpu_reduce.c — reductions over x viewed as (outer, red, inner).
 *
 * Two loop shapes cover every case:
 *   inner == 1  each output reduces one contiguous run of `red` values; when
 *               there are fewer outputs than threads the run is cut into
 *               per-thread pieces whose partial results are combined in
 *               order (so ties and NaNs resolve as in a serial scan);
 *   inner > 1   each output row of `inner` values accumulates `red` rows of
 *               x, a stride-1 loop over inner for every r.
 * Floating sums accumulate in double, integer sums in int64.  Two-pass ops
 * (var: mean then squared deviations; logsumexp: max then exp-sums) run the
 * same machinery twice.
 */
#include "kernels_impl.h"

#include <math.h>
#include <omp.h>
#include <string.h>

/* Partial result of one piece of a run. */
typedef struct {
    double sum;     /* float sums, squared deviations, exp sums */
    int64_t isum;   /* integer sums */
    double best;    /* max/min (as double: exact for every kpl dtype but i64) */
    int64_t ibest;  /* max/min of i64 */
    int64_t arg;    /* index of best */
    bool nan;       /* a NaN was seen (max/min/arg propagate it) */
} partial;

typedef enum { P_SUM, P_MAX, P_MIN, P_SQDEV, P_EXPSUB } pass_kind;

/* Reads element i of a run as double / int64. */
#define LOADD(T, p, i) ((double)((const T *)(p))[i])

#define RUN_BODY(T, IS_INT)                                                      \
    switch (kind) {                                                              \
    case P_SUM:                                                                  \
        if (IS_INT) {                                                            \
            int64_t s = 0;                                                       \
            for (int64_t i = r0; i < r1; i++) s += (int64_t)x[i * stride];       \
            pt->isum = s;                                                        \
        } else {                                                                 \
            double s = 0;                                                        \
            _Pragma("omp simd reduction(+ : s)") for (int64_t i = r0; i < r1; i++) \
                s += (double)x[i * stride];                                      \
            pt->sum = s;                                                         \
        }                                                                        \
        break;                                                                   \
    case P_SQDEV: {                                                              \
        double s = 0;                                                            \
        _Pragma("omp simd reduction(+ : s)") for (int64_t i = r0; i < r1; i++)   \
        {                                                                        \
            double d = (double)x[i * stride] - c;                                \
            s += d * d;                                                          \
        }                                                                        \
        pt->sum = s;                                                             \
        break;                                                                   \
    }                                                                            \
    case P_EXPSUB: {                                                             \
        double s = 0;                                                            \
        for (int64_t i = r0; i < r1; i++) s += exp((double)x[i * stride] - c);   \
        pt->sum = s;                                                             \
        break;                                                                   \
    }                                                                            \
    case P_MAX:                                                                  \
    case P_MIN: {                                                                \
        bool mx = kind == P_MAX;                                                 \
        T best = x[r0 * stride];                                                 \
        int64_t arg = r0;                                                        \
        bool nan = best != best;                                                 \
        for (int64_t i = r0 + 1; i < r1 && !nan; i++) {                          \
            T v = x[i * stride];                                                 \
            if (v != v) {                                                        \
                nan = true;                                                      \
                best = v;                                                        \
                arg = i;                                                         \
            } else if (mx ? v > best : v < best) {                               \
                best = v;                                                        \
                arg = i;                                                         \
            }                                                                    \
        }                                                                        \
        pt->best = (double)best;                                                 \
        pt->ibest = (int64_t)best;                                               \
        pt->arg = arg;                                                           \
        pt->nan = nan;                                                           \
        break;                                                                   \
    }                                                                            \
    }

#define DEF_RUN(T, tn, IS_INT)                                                        \
    static void run_##tn(const void *xv, int64_t stride, int64_t r0, int64_t r1,      \
                         pass_kind kind, double c, partial *pt)                        \
    {                                                                                 \
        const T *x = xv;                                                              \
        (void)c;                                                                      \
        RUN_BODY(T, IS_INT)                                                           \
    }

DEF_RUN(float, f32, 0)
DEF_RUN(double, f64, 0)
DEF_RUN(int32_t, i32, 1)
DEF_RUN(int64_t, i64, 1)
DEF_RUN(uint8_t, u8, 1)

typedef void (*run_fn)(const void *, int64_t, int64_t, int64_t, pass_kind, double, partial *);

static run_fn run_for(kpl_dtype dt)
{
    switch (dt) {
    case KPL_F32: return run_f32;
    case KPL_F64: return run_f64;
    case KPL_I32: return run_i32;
    case KPL_I64: return run_i64;
    default: return run_u8;
    }
}

/* Folds piece q (later in the run) into p. */
static void combine(partial *p, const partial *q, pass_kind kind, bool is_i64)
{
    switch (kind) {
    case P_SUM:
    case P_SQDEV:
    case P_EXPSUB:
        p->sum += q->sum;
        p->isum += q->isum;
        break;
    case P_MAX:
    case P_MIN:
        if (p->nan) break;
        if (q->nan) {
            *p = *q;
            break;
        }
        bool better = is_i64 ? (kind == P_MAX ? q->ibest > p->ibest : q->ibest < p->ibest)
                             : (kind == P_MAX ? q->best > p->best : q->best < p->best);
        if (better) {
            p->best = q->best;
            p->ibest = q->ibest;
            p->arg = q->arg;
        }
        break;
    }
}

/* Runs shorter than two pieces are never split. */
#define RUN_PIECE 32768

/* One pass over the run of output `o` (inner == 1), split across threads
 * when `split`. */
static partial run_pass(run_fn fn, const char *x, size_t es, int64_t red, pass_kind kind,
                        double c, bool split, bool is_i64)
{
    partial res = {0};
    int nt = split ? omp_get_max_threads() : 1;
    if (nt > 16) nt = 16;
    /* The pieces are fixed by the thread count and RUN_PIECE alone, so the
     * rounding of the result does not depend on whether the team runs
     * them (KPL_PAR_GRAIN is measured per process). */
    if (nt <= 1 || red < 2 * RUN_PIECE) {
        fn(x, 1, 0, red, kind, c, &res);
        return res;
    }
    partial parts[16];
#pragma omp parallel for num_threads(nt) schedule(static) if (red >= 2 * KPL_PAR_GRAIN)
    for (int t = 0; t < nt; t++) {
        int64_t r0 = red * t / nt, r1 = red * (t + 1) / nt;
        memset(&parts[t], 0, sizeof parts[t]);
        fn(x, 1, r0, r1, kind, c, &parts[t]);
    }
    (void)es;
    res = parts[0];
    for (int t = 1; t < nt; t++) combine(&res, &parts[t], kind, is_i64);
    return res;
}

/* Writes the final value of output element `oi`. */
static void store(kpl_dtype odt, void *out, int64_t oi, double v, int64_t iv, bool use_int)
{
    switch (odt) {
    case KPL_F32: ((float *)out)[oi] = (float)v; break;
    case KPL_F64: ((double *)out)[oi] = v; break;
    case KPL_I32: ((int32_t *)out)[oi] = (int32_t)(use_int ? iv : (int64_t)v); break;
    case KPL_I64: ((int64_t *)out)[oi] = use_int ? iv : (int64_t)v; break;
    default: ((uint8_t *)out)[oi] = (uint8_t)(use_int ? iv : (int64_t)v); break;
    }
}

/* Reduces one output element whose values are x[r * stride], r < red. */
static void reduce_one(const kpl_reduce_attrs *at, kpl_dtype dt, run_fn fn, const char *x,
                       int64_t stride, bool split, void *out, kpl_dtype odt, int64_t oi)
{
    bool is_int = !kpl_dtype_is_float(dt), is_i64 = dt == KPL_I64;
    int64_t red = at->red;
    size_t es = kpl_dtype_size(dt);
    partial p;
#define PASS(kind, c)                                                             \
    (stride == 1 ? run_pass(fn, x, es, red, (kind), (c), split, is_i64) : ({      \
        partial q_ = {0};                                                         \
        fn(x, stride, 0, red, (kind), (c), &q_);                                  \
        q_;                                                                       \
    }))
    switch (at->op) {
    case KPL_RED_SUM:
        p = PASS(P_SUM, 0);
        store(odt, out, oi, p.sum, p.isum, is_int);
        break;
    case KPL_RED_MEAN:
        p = PASS(P_SUM, 0);
        store(odt, out, oi, red ? p.sum / (double)red : NAN, 0, false);
        break;
    case KPL_RED_MAX:
    case KPL_RED_MIN:
        p = PASS(at->op == KPL_RED_MAX ? P_MAX : P_MIN, 0);
        store(odt, out, oi, p.best, p.ibest, is_i64);
        break;
    case KPL_RED_ARGMAX:
    case KPL_RED_ARGMIN:
        p = PASS(at->op == KPL_RED_ARGMAX ? P_MAX : P_MIN, 0);
        ((int64_t *)out)[oi] = p.arg;
        break;
    case KPL_RED_VAR: {
        p = PASS(P_SUM, 0);
        double mean = p.sum / (double)red;
        p = PASS(P_SQDEV, mean);
        double den = (double)(red - at->correction);
        store(odt, out, oi, den > 0 ? p.sum / den : NAN, 0, false);
        break;
    }
    case KPL_RED_LOGSUMEXP:
    case KPL_RED_SUMEXP_SUB_MAX: {
        p = PASS(P_MAX, 0);
        double m = p.best;
        if (p.nan || isinf(m)) { /* all -inf, or +inf/NaN present */
            double v = at->op == KPL_RED_LOGSUMEXP ? m : (p.nan ? NAN : (m > 0 ? NAN : 0.0));
            store(odt, out, oi, v, 0, false);
            break;
        }
        p = PASS(P_EXPSUB, m);
        store(odt, out, oi, at->op == KPL_RED_LOGSUMEXP ? m + log(p.sum) : p.sum, 0, false);
        break;
    }
    default:
        KPL_ASSERT(0, "reduce op");
    }
#undef PASS
}

/* ---- inner > 1: columns ------------------------------------------------------ */

/* A block of COLS adjacent outputs reduced together: for every r the loop
 * over the block's columns is stride 1 and vectorises, where reducing one
 * output at a time would stride through memory by `inner`. */
#define COLS 256

#define DEF_COLS(T, tn)                                                                   \
    static void cols_##tn(const kpl_reduce_attrs *at, const char *xv, int64_t inner,     \
                          int64_t nc, double *acc, double *aux, int64_t *arg)            \
    {                                                                                     \
        const T *x = (const T *)xv;                                                       \
        int64_t red = at->red;                                                            \
        kpl_reduce_op op = at->op;                                                        \
        if (op == KPL_RED_MAX || op == KPL_RED_MIN || op == KPL_RED_ARGMAX ||             \
            op == KPL_RED_ARGMIN || op == KPL_RED_LOGSUMEXP ||                            \
            op == KPL_RED_SUMEXP_SUB_MAX) {                                               \
            bool mx = op != KPL_RED_MIN && op != KPL_RED_ARGMIN;                          \
            for (int64_t i = 0; i < nc; i++) {                                            \
                acc[i] = (double)x[i];                                                    \
                arg[i] = 0;                                                               \
            }                                                                             \
            for (int64_t r = 1; r < red; r++) {                                           \
                const T *row = x + r * inner;                                             \
                for (int64_t i = 0; i < nc; i++) {                                        \
                    double v = (double)row[i];                                            \
                    /* NaN sticks once seen (first NaN wins) */                           \
                    bool take = acc[i] == acc[i] && (v != v || (mx ? v > acc[i] : v < acc[i])); \
                    acc[i] = take ? v : acc[i];                                           \
                    arg[i] = take ? r : arg[i];                                           \
                }                                                                         \
            }                                                                             \
            if (op != KPL_RED_LOGSUMEXP && op != KPL_RED_SUMEXP_SUB_MAX) return;          \
            for (int64_t i = 0; i < nc; i++) aux[i] = 0;                                  \
            for (int64_t r = 0; r < red; r++) {                                           \
                const T *row = x + r * inner;                                             \
                for (int64_t i = 0; i < nc; i++) aux[i] += exp((double)row[i] - acc[i]);  \
            }                                                                             \
            return;                                                                       \
        }                                                                                 \
        /* SUM, MEAN, VAR */                                                              \
        for (int64_t i = 0; i < nc; i++) acc[i] = 0;                                      \
        for (int64_t r = 0; r < red; r++) {                                               \
            const T *row = x + r * inner;                                                 \
            _Pragma("omp simd") for (int64_t i = 0; i < nc; i++) acc[i] += (double)row[i]; \
        }                                                                                 \
        if (op != KPL_RED_VAR) return;                                                    \
        for (int64_t i = 0; i < nc; i++) {                                                \
            aux[i] = 0;                                                                   \
            acc[i] /= (double)red; /* the mean */                                         \
        }                                                                                 \
        for (int64_t r = 0; r < red; r++) {                                               \
            const T *row = x + r * inner;                                                 \
            _Pragma("omp simd") for (int64_t i = 0; i < nc; i++)                          \
            {                                                                             \
                double d = (double)row[i] - acc[i];                                       \
                aux[i] += d * d;                                                          \
            }                                                                             \
        }                                                                                 \
    }

DEF_COLS(float, f32)
DEF_COLS(double, f64)
DEF_COLS(int32_t, i32)
DEF_COLS(uint8_t, u8)

typedef void (*cols_fn)(const kpl_reduce_attrs *, const char *, int64_t, int64_t, double *,
                        double *, int64_t *);

static void cols_store(const kpl_reduce_attrs *at, kpl_dtype dt, kpl_dtype odt, void *out,
                       int64_t o0, int64_t nc, const double *acc, const double *aux,
                       const int64_t *arg)
{
    bool is_int = !kpl_dtype_is_float(dt);
    for (int64_t i = 0; i < nc; i++) {
        double v;
        switch (at->op) {
        case KPL_RED_ARGMAX:
        case KPL_RED_ARGMIN: ((int64_t *)out)[o0 + i] = arg[i]; continue;
        case KPL_RED_MEAN: v = acc[i] / (double)at->red; break;
        case KPL_RED_VAR: {
            double den = (double)(at->red - at->correction);
            v = den > 0 ? aux[i] / den : NAN;
            break;
        }
        case KPL_RED_LOGSUMEXP:
            v = (acc[i] != acc[i] || isinf(acc[i])) ? acc[i] : acc[i] + log(aux[i]);
            break;
        case KPL_RED_SUMEXP_SUB_MAX:
            v = acc[i] != acc[i] ? NAN : (isinf(acc[i]) ? (acc[i] > 0 ? NAN : 0.0) : aux[i]);
            break;
        default: v = acc[i]; break; /* SUM, MAX, MIN */
        }
        store(odt, out, o0 + i, v, (int64_t)v, is_int);
    }
}

static cols_fn cols_for(kpl_dtype dt)
{
    switch (dt) {
    case KPL_F32: return cols_f32;
    case KPL_F64: return cols_f64;
    case KPL_I32: return cols_i32;
    case KPL_U8:
    case KPL_BOOL: return cols_u8;
    default: return NULL; /* i64: values beyond 2^53 need the exact path */
    }
}

static kpl_status cpu_reduce(const kpl_kernel_args *args)
{
    const kpl_reduce_attrs *at = args->attrs;
    const kpl_tensor *xt = args->in[0];
    kpl_dtype dt = xt->dtype, odt = args->out->dtype;
    run_fn fn = run_for(dt);
    const char *x = kpl__cdata(xt);
    void *out = kpl__data(args->out);
    size_t es = kpl_dtype_size(dt);
    int64_t outer = at->outer, red = at->red, inner = at->inner;
    int64_t nout = outer * inner;

    if (red == 0) { /* sum = 0, mean = NaN (the front end allows only these) */
        for (int64_t i = 0; i < nout; i++)
            store(odt, out, i, at->op == KPL_RED_SUM ? 0.0 : NAN, 0, at->op == KPL_RED_SUM &&
                  !kpl_dtype_is_float(dt));
        return KPL_OK;
    }
    cols_fn cf = cols_for(dt);
    if (inner > 1 && cf) {
        int64_t nblk = (inner + COLS - 1) / COLS, ntask = outer * nblk;
        KPL_PARALLEL_FOR_IF(t, ntask, ntask > 1 && outer * red * inner > 2 * KPL_PAR_GRAIN,
            double acc[COLS], aux[COLS];
            int64_t arg[COLS];
            int64_t o = t / nblk, i0 = (t % nblk) * COLS;
            int64_t nc = inner - i0 < COLS ? inner - i0 : COLS;
            cf(at, x + (size_t)(o * red * inner + i0) * es, inner, nc, acc, aux, arg);
            cols_store(at, dt, odt, out, o * inner + i0, nc, acc, aux, arg);
        );
        return KPL_OK;
    }
    int nt = omp_get_max_threads();
    bool split = nout < nt;
    int64_t work = outer * red * inner;
    /* Outputs in parallel when there are enough of them; otherwise each
     * output's run is itself split (inner == 1 only). */
    KPL_PARALLEL_FOR_IF(oi, nout, !split && work > 2 * KPL_PAR_GRAIN,
        int64_t o = oi / inner, i = oi % inner;
        const char *base = x + (size_t)(o * red * inner + i) * es;
        reduce_one(at, dt, fn, base, inner, split && inner == 1, out, odt, oi);
    );
    return KPL_OK;
}

void kpl__cpu_register_reduce(void)
{
    static const kpl_dtype types[] = {KPL_F32, KPL_F64, KPL_I32, KPL_I64, KPL_U8, KPL_BOOL};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        kpl_kernel_register(KPL_KOP_REDUCE, KPL_DEVICE_CPU, types[i], cpu_reduce);
}
