/* cpu_index.c — index_select (any dtype, moved by element size) and its
 * adjoint index_add (f32, f64) along one axis; gather (any dtype) and its
 * adjoint scatter_add (f32, f64), an index per element. */
#include "kernels_impl.h"

#include <omp.h>
#include <string.h>

/* ---- gather / scatter_add ----------------------------------------------------------- */

/* x's flat offset of idx position (o, 0, i); see kpl_index_attrs. */
static int64_t x_base(const kpl_index_attrs *a, int64_t o, int64_t i)
{
    if (a->simple) return o * a->dim * a->xinner + i;
    int64_t xo = 0, xi = 0, m = 1;
    for (int d = a->axis - 1; d >= 0; d--) {
        xo += o % a->ishape[d] * m;
        o /= a->ishape[d];
        m *= a->xshape[d];
    }
    m = 1;
    for (int d = a->ndim - 1; d > a->axis; d--) {
        xi += i % a->ishape[d] * m;
        i /= a->ishape[d];
        m *= a->xshape[d];
    }
    return xo * a->dim * a->xinner + xi;
}

typedef struct {
    const kpl_index_attrs *a;
    const int64_t *idx;
    const void *in; /* gather: x; scatter_add: src */
    void *out;      /* gather: idx's shape; scatter_add: x's, holding x */
    size_t es;      /* element size */
} gather_job;

/* The loops of one task: idx positions (o, j, i) for every j and i in
 * [i0, i1), BODY moving or adding element p of idx's shape and element q
 * of x's.  Returns from the enclosing function the flat position of the
 * first index out of range (positions only grow along the loops). */
#define GATHER_LOOP(T, BODY)                                                   \
    do {                                                                       \
        const T *in = g->in;                                                   \
        T *out = g->out;                                                       \
        for (int64_t j = 0; j < a->k; j++) {                                   \
            int64_t p0 = (o * a->k + j) * a->inner;                            \
            for (int64_t i = i0; i < i1; i++) {                                \
                int64_t p = p0 + i, v = g->idx[p];                             \
                if (v < 0 || v >= a->dim) return p;                            \
                int64_t q = x_base(a, o, i) + v * a->xinner;                   \
                BODY;                                                          \
            }                                                                  \
        }                                                                      \
    } while (0)

/* Tasks with different (o, i) write disjoint elements: a position's
 * coordinates off the axis are those of the element it reads or adds
 * into, so scatter_add's repeated indices meet only within one task.
 * Returns INT64_MAX when every index is in range. */
static int64_t gather_task(const gather_job *g, int64_t o, int64_t i0, int64_t i1)
{
    const kpl_index_attrs *a = g->a;
    if (a->kind == KPL_INDEX_SCATTER_ADD) {
        if (g->es == sizeof(double)) GATHER_LOOP(double, out[q] += in[p]);
        else GATHER_LOOP(float, out[q] += in[p]);
        return INT64_MAX;
    }
    /* Moved as bytes of a fixed size (one load and store each), so any
     * dtype goes through without being read as another type. */
    switch (g->es) {
    case 1: GATHER_LOOP(uint8_t, memcpy(out + p, in + q, 1)); break;
    case 2: GATHER_LOOP(uint16_t, memcpy(out + p, in + q, 2)); break;
    case 4: GATHER_LOOP(uint32_t, memcpy(out + p, in + q, 4)); break;
    default: GATHER_LOOP(uint64_t, memcpy(out + p, in + q, 8)); break;
    }
    return INT64_MAX;
}
#undef GATHER_LOOP

static kpl_status cpu_gather(const kpl_kernel_args *args)
{
    const kpl_index_attrs *a = args->attrs;
    gather_job g = {.a = a, .idx = kpl__cdata(args->in[1]), .in = kpl__cdata(args->in[0]),
                    .out = kpl__data(args->out), .es = kpl_dtype_size(args->out->dtype)};
    /* Tasks are o times a chunk of i: with few o (axis 0) the inner range
     * is cut so that every thread gets work. */
    int threads = omp_get_max_threads();
    bool par = threads > 1 && a->outer * a->k * a->inner > KPL_PAR_GRAIN;
    int64_t nchunk = 1;
    if (par && a->outer < 4 * (int64_t)threads) {
        nchunk = (4 * (int64_t)threads + a->outer - 1) / a->outer;
        if (nchunk > a->inner) nchunk = a->inner;
    }
    int64_t chunk = (a->inner + nchunk - 1) / nchunk;
    nchunk = (a->inner + chunk - 1) / chunk;
    int64_t ntask = a->outer * nchunk, bad = INT64_MAX;
    if (par && ntask > 1) {
#pragma omp parallel for schedule(static) reduction(min : bad)
        for (int64_t t = 0; t < ntask; t++) {
            int64_t c = t % nchunk, i1 = (c + 1) * chunk;
            int64_t b = gather_task(&g, t / nchunk, c * chunk, i1 < a->inner ? i1 : a->inner);
            if (b < bad) bad = b;
        }
    } else {
        for (int64_t t = 0; t < ntask && bad == INT64_MAX; t++) {
            int64_t c = t % nchunk, i1 = (c + 1) * chunk;
            bad = gather_task(&g, t / nchunk, c * chunk, i1 < a->inner ? i1 : a->inner);
        }
    }
    if (bad == INT64_MAX) return KPL_OK;
    if (a->bad) {
        a->bad[0] = bad;
        a->bad[1] = g.idx[bad];
    }
    return KPL_ERROR(KPL_ERANGE, "%s: index %lld at flat position %lld of idx is outside [0, %lld)",
                     a->kind == KPL_INDEX_GATHER ? "gather" : "scatter_add",
                     (long long)g.idx[bad], (long long)bad, (long long)a->dim);
}

/* ---- index_select / index_add, and the dispatch of the four ------------------------ */

static kpl_status cpu_index(const kpl_kernel_args *args)
{
    const kpl_index_attrs *a = args->attrs;
    if (a->kind == KPL_INDEX_GATHER || a->kind == KPL_INDEX_SCATTER_ADD) return cpu_gather(args);
    bool add = a->kind == KPL_INDEX_ADD;
    const int64_t *idx = kpl__cdata(args->in[1]);
    for (int64_t k = 0; k < a->k; k++)
        KPL_CHECK(idx[k] >= 0 && idx[k] < a->dim, KPL_ERANGE,
                  "%s: index %lld at position %lld is outside [0, %lld)",
                  add ? "index_add" : "index_select", (long long)idx[k], (long long)k,
                  (long long)a->dim);
    size_t es = kpl_dtype_size(args->out->dtype), row = (size_t)a->inner * es;
    const char *src = kpl__cdata(args->in[0]);
    char *dst = kpl__data(args->out);
    if (!add) {
        KPL_PARALLEL_FOR_IF(o, a->outer, a->outer * a->k * a->inner > KPL_PAR_GRAIN,
            for (int64_t k = 0; k < a->k; k++)
                memcpy(dst + ((size_t)(o * a->k + k)) * row,
                       src + ((size_t)(o * a->dim + idx[k])) * row, row);
        );
        return KPL_OK;
    }
    /* out (outer, dim, inner) += g (outer, k, inner) at idx: each o is
     * independent, so parallel over o has no write conflicts. */
    bool f64 = args->out->dtype == KPL_F64;
    KPL_PARALLEL_FOR_IF(o, a->outer, a->outer > 1 && a->outer * a->k * a->inner > KPL_PAR_GRAIN,
        memset(dst + (size_t)(o * a->dim) * row, 0, (size_t)a->dim * row);
        for (int64_t k = 0; k < a->k; k++) {
            int64_t d = (o * a->dim + idx[k]) * a->inner, s = (o * a->k + k) * a->inner;
            if (f64) {
                double *dp = (double *)(void *)dst;
                const double *sp = (const double *)(const void *)src;
                for (int64_t i = 0; i < a->inner; i++) dp[d + i] += sp[s + i];
            } else {
                float *dp = (float *)(void *)dst;
                const float *sp = (const float *)(const void *)src;
                for (int64_t i = 0; i < a->inner; i++) dp[d + i] += sp[s + i];
            }
        }
    );
    return KPL_OK;
}

void kpl__cpu_register_index(void)
{
    for (int dt = 0; dt < KPL_DTYPE_COUNT; dt++)
        kpl_kernel_register(KPL_KOP_INDEX, KPL_DEVICE_CPU, (kpl_dtype)dt, cpu_index);
}
