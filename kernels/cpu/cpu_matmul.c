/*
 * cpu_matmul.c — matmul on the CPU: oneDNN's matmul primitive for f32 and
 * bf16 (bf16 where the CPU has AVX512-BF16 or AMX, as in cpu_conv.c), a
 * plain loop for f64 (used by gradient checks, not by training).
 *
 * oneDNN primitives are expensive to create (JIT code generation) and cheap
 * to run, so they are cached by the full problem description: dims, strides
 * and dtype.  That cache is kpl's Algo Chooser on the CPU: the first call of
 * a shape pays, every later call of the same shape only executes.
 * Transposes are not copies: a transposed operand is described to oneDNN by
 * its strides.
 *
 * The chooser also picks the thread count.  Waking the OpenMP team costs
 * 20-60 us when idle threads sleep (OMP_WAIT_POLICY=PASSIVE on a VM),
 * more than a 128x120x84 product takes on one core (~27 us), so at the
 * first call of a shape the primitive is built for one thread and for the
 * whole team, both are timed on the call's operands, and the faster is
 * kept.  In deterministic mode the team is used untimed, as before.
 */
#include "kernels_impl.h"

#include <dnnl.h>
#include <dnnl_debug.h>
#include <omp.h>
#include <math.h>
#include <string.h>
#include <time.h>

#define CACHE_CAP 512

typedef struct {
    int ndim;
    int threads; /* the team size asked for (kpl_set_num_threads) */
    bool deterministic; /* the team is used untimed (kpl_set_deterministic) */
    dnnl_data_type_t dt;
    dnnl_dims_t a_dims, a_strides; /* dnnl_dims_t: DNNL_MAX_NDIMS entries */
    dnnl_dims_t b_dims, b_strides;
    dnnl_dims_t c_dims;
} mm_key;

typedef struct {
    mm_key key;
    dnnl_primitive_t prim;
    int nthreads; /* what prim was made for and runs with (1 or key.threads) */
    dnnl_memory_desc_t a_md, b_md, c_md;
    uint64_t last_use;
} mm_entry;

/* Process-wide backend state: one engine and stream for the CPU, and the
 * primitive cache.  Created on first use, guarded by `lock`. */
static struct {
    pthread_mutex_t lock;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    mm_entry entries[CACHE_CAP];
    int n;
    uint64_t tick, hits, misses;
} mm = {.lock = PTHREAD_MUTEX_INITIALIZER};

#define DNNL_TRY(call, what)                                                        \
    do {                                                                            \
        dnnl_status_t ds_ = (call);                                                 \
        if (ds_ != dnnl_success) {                                                  \
            st = KPL_ERROR(KPL_EBACKEND, "matmul: oneDNN %s failed: %s", what,      \
                           dnnl_status2str(ds_));                                   \
            goto fail;                                                              \
        }                                                                           \
    } while (0)

/* Logical (rows, cols) dims and strides of an operand stored row-major with
 * `dims`, read transposed when `trans`. */
static void describe(int ndim, const int64_t *stored, bool trans, int64_t *dims,
                     int64_t *strides)
{
    int64_t s = 1;
    int64_t st[KPL_MAX_DIMS];
    for (int d = ndim - 1; d >= 0; d--) {
        st[d] = s;
        s *= stored[d];
    }
    for (int d = 0; d < ndim; d++) {
        dims[d] = stored[d]; /* a batch dim of 1 broadcasts in oneDNN */
        strides[d] = st[d];
    }
    if (trans) {
        dims[ndim - 2] = stored[ndim - 1];
        dims[ndim - 1] = stored[ndim - 2];
        strides[ndim - 2] = st[ndim - 1];
        strides[ndim - 1] = st[ndim - 2];
    }
}

/* A primitive for e's descriptors made for `nthreads` OpenMP threads
 * (oneDNN fixes its work split at creation from the count it sees). */
static kpl_status make_primitive(const mm_entry *e, int nthreads, dnnl_primitive_t *out)
{
    kpl_status st = KPL_OK;
    dnnl_primitive_desc_t pd = NULL;
    int team = omp_get_max_threads();
    omp_set_num_threads(nthreads);
    dnnl_matmul_desc_t md;
    DNNL_TRY(dnnl_matmul_desc_init(&md, &e->a_md, &e->b_md, NULL, &e->c_md), "matmul desc");
    DNNL_TRY(dnnl_primitive_desc_create(&pd, &md, NULL, mm.engine, NULL), "primitive desc");
    DNNL_TRY(dnnl_primitive_create(out, pd), "primitive");
fail:
    omp_set_num_threads(team);
    if (pd) dnnl_primitive_desc_destroy(pd);
    return st;
}

/* Runs prim with `nthreads` OpenMP threads: c = a b as e describes them. */
static kpl_status run_primitive(const mm_entry *e, dnnl_primitive_t prim, int nthreads,
                                const void *a, const void *b, void *c)
{
    kpl_status st = KPL_OK;
    dnnl_memory_t ma = NULL, mb = NULL, mc = NULL;
    int team = omp_get_max_threads();
    if (nthreads != team) omp_set_num_threads(nthreads);
    DNNL_TRY(dnnl_memory_create(&ma, &e->a_md, mm.engine, (void *)a), "memory");
    DNNL_TRY(dnnl_memory_create(&mb, &e->b_md, mm.engine, (void *)b), "memory");
    DNNL_TRY(dnnl_memory_create(&mc, &e->c_md, mm.engine, c), "memory");
    dnnl_exec_arg_t args[3] = {
        {DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
    DNNL_TRY(dnnl_primitive_execute(prim, mm.stream, 3, args), "execute");
    DNNL_TRY(dnnl_stream_wait(mm.stream), "stream wait");
fail:
    if (nthreads != team) omp_set_num_threads(team);
    if (mc) dnnl_memory_destroy(mc);
    if (mb) dnnl_memory_destroy(mb);
    if (ma) dnnl_memory_destroy(ma);
    return st;
}

/* Best of three timed runs (after one untimed), each after ~50 us of busy
 * waiting: inside a training step a kernel follows other work, by which
 * time idle OpenMP threads have gone to sleep, and timing back-to-back
 * calls would hide what waking them costs. */
static double time_primitive(const mm_entry *e, dnnl_primitive_t prim, int nthreads,
                             const void *a, const void *b, void *c)
{
    double best = INFINITY;
    for (int r = 0; r < 4; r++) {
        double g = kpl_seconds();
        while (kpl_seconds() - g < 50e-6) {
        }
        double t0 = kpl_seconds();
        if (run_primitive(e, prim, nthreads, a, b, c) < 0) {
            kpl_clear_error();
            return INFINITY;
        }
        double t = kpl_seconds() - t0;
        if (r > 0 && t < best) best = t;
    }
    return best;
}

/* The cached primitive of k, made (and its thread count chosen, see the
 * top of the file) at the first call of the shape.  a, b, c are the
 * call's operands, used for the timing; c is rewritten by the caller. */
static kpl_status get_primitive(const mm_key *k, const void *a, const void *b, void *c,
                                mm_entry **out)
{
    kpl_status st = KPL_OK;
    mm_entry *e = NULL;
    for (int i = 0; i < mm.n; i++)
        if (!memcmp(&mm.entries[i].key, k, sizeof *k)) {
            mm.entries[i].last_use = ++mm.tick;
            mm.hits++;
            *out = &mm.entries[i];
            return KPL_OK;
        }
    mm.misses++;
    if (!mm.engine) DNNL_TRY(dnnl_engine_create(&mm.engine, dnnl_cpu, 0), "engine_create");
    if (!mm.stream)
        DNNL_TRY(dnnl_stream_create(&mm.stream, mm.engine, dnnl_stream_default_flags), "stream");
    if (mm.n < CACHE_CAP) {
        e = &mm.entries[mm.n++];
    } else { /* evict the least recently used */
        e = &mm.entries[0];
        for (int i = 1; i < mm.n; i++)
            if (mm.entries[i].last_use < e->last_use) e = &mm.entries[i];
        dnnl_primitive_destroy(e->prim);
    }
    memset(e, 0, sizeof *e);
    dnnl_dims_t c_strides;
    int64_t s = 1;
    for (int d = k->ndim - 1; d >= 0; d--) {
        c_strides[d] = s;
        s *= k->c_dims[d];
    }
    DNNL_TRY(dnnl_memory_desc_init_by_strides(&e->a_md, k->ndim, k->a_dims, k->dt,
                                              k->a_strides), "src desc");
    DNNL_TRY(dnnl_memory_desc_init_by_strides(&e->b_md, k->ndim, k->b_dims, k->dt,
                                              k->b_strides), "weights desc");
    DNNL_TRY(dnnl_memory_desc_init_by_strides(&e->c_md, k->ndim, k->c_dims, k->dt, c_strides),
             "dst desc");
    KPL_TRY_GOTO(make_primitive(e, k->threads, &e->prim));
    e->nthreads = k->threads;
    if (k->threads > 1 && !k->deterministic) {
        dnnl_primitive_t one = NULL;
        if (make_primitive(e, 1, &one) < 0) {
            kpl_clear_error(); /* keep the team's primitive */
        } else if (time_primitive(e, one, 1, a, b, c) <
                   time_primitive(e, e->prim, k->threads, a, b, c)) {
            dnnl_primitive_destroy(e->prim);
            e->prim = one;
            e->nthreads = 1;
        } else {
            dnnl_primitive_destroy(one);
        }
    }
    e->key = *k;
    e->last_use = ++mm.tick;
    *out = e;
    return KPL_OK;
fail:
    if (e && e->prim) dnnl_primitive_destroy(e->prim);
    /* Drop the half-built entry. */
    if (e && e == &mm.entries[mm.n - 1]) mm.n--;
    else if (e) memset(e, 0, sizeof *e);
    return st;
}

static kpl_status matmul_dnnl(const kpl_matmul_attrs *at, const void *a, const void *b, void *c,
                              dnnl_data_type_t dt)
{
    mm_key k;
    memset(&k, 0, sizeof k);
    k.ndim = at->ndim;
    k.threads = omp_get_max_threads();
    k.deterministic = kpl_get_deterministic();
    k.dt = dt;
    describe(at->ndim, at->a_dims, at->trans_a, k.a_dims, k.a_strides);
    describe(at->ndim, at->b_dims, at->trans_b, k.b_dims, k.b_strides);
    for (int d = 0; d < at->ndim; d++) k.c_dims[d] = at->out_dims[d];

    /* Execution stays under the lock so that no other thread evicts the
     * primitive mid-run; kpl has one compute thread per rank, so the lock
     * is uncontended in practice. */
    pthread_mutex_lock(&mm.lock);
    mm_entry *e = NULL;
    kpl_status st = get_primitive(&k, a, b, c, &e);
    if (st >= 0) st = run_primitive(e, e->prim, e->nthreads, a, b, c);
    pthread_mutex_unlock(&mm.lock);
    return st;
}

/* f64: C[b] = op(A[b]) op(B[b]) with broadcast batch dims, row-parallel. */
static void matmul_f64(const kpl_matmul_attrs *at, const double *a, const double *b,
                       double *c)
{
    int nd = at->ndim;
    int64_t M = at->out_dims[nd - 2], N = at->out_dims[nd - 1];
    int64_t ar = at->a_dims[nd - 2], ac = at->a_dims[nd - 1];
    int64_t br = at->b_dims[nd - 2], bc = at->b_dims[nd - 1];
    int64_t K = at->trans_a ? ar : ac;
    int64_t nbatch = 1;
    for (int d = 0; d < nd - 2; d++) nbatch *= at->out_dims[d];
    /* element (i, k) of op(A) is a[i*sa_i + k*sa_k] */
    int64_t sa_i = at->trans_a ? 1 : ac, sa_k = at->trans_a ? ac : 1;
    int64_t sb_k = at->trans_b ? 1 : bc, sb_j = at->trans_b ? bc : 1;
    KPL_PARALLEL_FOR_IF(row, nbatch * M, nbatch * M > 1 && nbatch * M * N * K > 100000,
        int64_t bi = row / M, i = row % M;
        /* batch offsets with broadcasting */
        int64_t rem = bi, offa = 0, offb = 0, stra = ar * ac, strb = br * bc;
        for (int d = nd - 3; d >= 0; d--) {
            int64_t idx = rem % at->out_dims[d];
            rem /= at->out_dims[d];
            if (at->a_dims[d] != 1) offa += idx * stra;
            if (at->b_dims[d] != 1) offb += idx * strb;
            stra *= at->a_dims[d];
            strb *= at->b_dims[d];
        }
        double *crow = c + row * N;
        for (int64_t j = 0; j < N; j++) crow[j] = 0;
        for (int64_t k = 0; k < K; k++) {
            double av = a[offa + i * sa_i + k * sa_k];
            const double *bp = b + offb + k * sb_k;
            for (int64_t j = 0; j < N; j++) crow[j] += av * bp[j * sb_j];
        }
    );
}

static kpl_status cpu_matmul(const kpl_kernel_args *args)
{
    const kpl_matmul_attrs *at = args->attrs;
    const void *a = kpl__cdata(args->in[0]), *b = kpl__cdata(args->in[1]);
    void *c = kpl__data(args->out);
    if (args->in[0]->dtype == KPL_F64) {
        matmul_f64(at, a, b, c);
        return KPL_OK;
    }
    return matmul_dnnl(at, a, b, c, args->in[0]->dtype == KPL_BF16 ? dnnl_bf16 : dnnl_f32);
}

kpl_algo_cache_stats kpl__cpu_algo_cache_stats(void)
{
    pthread_mutex_lock(&mm.lock);
    kpl_algo_cache_stats st = {mm.hits, mm.misses, (uint64_t)mm.n};
    pthread_mutex_unlock(&mm.lock);
    return st;
}

void kpl__cpu_register_matmul(void)
{
    kpl_kernel_register(KPL_KOP_MATMUL, KPL_DEVICE_CPU, KPL_F32, cpu_matmul);
    kpl_kernel_register(KPL_KOP_MATMUL, KPL_DEVICE_CPU, KPL_F64, cpu_matmul);
    if (kpl__cpu_bf16_native())
        kpl_kernel_register(KPL_KOP_MATMUL, KPL_DEVICE_CPU, KPL_BF16, cpu_matmul);
}
