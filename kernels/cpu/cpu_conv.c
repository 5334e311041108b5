/*
 * cpu_conv.c — 2-D convolution on the CPU: forward, backward-data and
 * backward-weights.  f32 and bf16 run on oneDNN's convolution primitives,
 * cached per problem like matmul's (bf16 only where the CPU has AVX512-BF16
 * or AMX: elsewhere oneDNN would emulate it slower than f32 runs, and
 * kernels/ops_matmul.c computes bf16 in f32 instead); f64 runs on the plain
 * reference loops (cpu_conv_ref.c), which are also what the tests check
 * oneDNN against.  Which kernel serves a problem is timed on its first call
 * (choose): oneDNN's direct kernels, its Winograd ones for 3x3 f32
 * problems, kpl's own loops (cpu_conv_direct.c).
 *
 * Activations a primitive computes in nChw16c or NHWC stay so between the
 * ops that read them (kpl__kept_data, storage.c); weights stay OIHW, a
 * constant's reordered copy kept beside it.
 */
#include "kernels_impl.h"

#include <dnnl.h>
#include <dnnl_debug.h>
#include <omp.h>
#include <math.h>
#include <string.h>
#include <time.h>

/* ---- oneDNN (f32, bf16) ------------------------------------------------------------------ */

#define CACHE_CAP 256

typedef struct {
    kpl_conv_attrs a;
    int threads;
    bool bias;
    bool deterministic; /* chosen without timing (kpl_set_deterministic) */
    dnnl_data_type_t dt; /* every operand's: f32 or bf16 */
    kpl_layout layout;   /* kpl_set_kept_layout's setting when chosen */
    char only[24];       /* kpl__cpu_conv_only's prefix when chosen ("" = any) */
    bool frozen;         /* constant weights (inference): Winograd's memory unbounded */
} conv_key;

/* A cached convolution: the primitive runs on the layouts oneDNN chose
 * (blocked, e.g. nChw8c / OIhw8i8o on AVX2, where its direct JIT kernels
 * live; NHWC for AMX's); an activation whose layout is a kept one
 * (nChw16c, NHWC) is read and written so as it is, and every other
 * operand goes through a reorder when the layouts differ.  Slots:
 * 0 and 1 are read, 2 is written — fwd: src, weights, dst; bwd_data:
 * diff_dst, weights, diff_src; bwd_weight: src, diff_dst, diff_weights. */
typedef struct {
    conv_key key;
    dnnl_primitive_t prim;       /* NULL for kpl's own loops */
    int direct_threads;          /* kpl's own loops (cpu_conv_direct.c) with this many */
    dnnl_memory_desc_t user[3], inner[3], bias;
    dnnl_primitive_t reorder[3]; /* NULL when user == inner */
    dnnl_primitive_t acc_in;     /* KPL_KOP_CONV2D_ACC: the addend, plain to inner (or NULL) */
    kpl_kept kept[3];            /* an activation slot's inner layout, when a kept one */
    /* read activation slots held in another kept layout than inner:
     * that layout's desc and the reorder from it (NULL where none) */
    dnnl_memory_desc_t from_md[2][KPL_KEPT_COUNT];
    dnnl_primitive_t from_kept[2][KPL_KEPT_COUNT];
    int arg[3];
    char impl[64];               /* oneDNN's implementation name, or "kpl_direct" */
    uint64_t last_use;
} conv_entry;

static struct {
    pthread_mutex_t lock;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    conv_entry e[CACHE_CAP];
    int n;
    uint64_t tick, hits, misses;
} cc = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local kpl_conv_choice last_choice;

kpl_conv_choice kpl__cpu_conv_last(void)
{
    return last_choice;
}

void kpl__cpu_conv_impls(char *buf, size_t len)
{
    const char *name[CACHE_CAP];
    int count[CACHE_CAP], n = 0;
    pthread_mutex_lock(&cc.lock);
    for (int i = 0; i < cc.n; i++) {
        int j = 0;
        while (j < n && strcmp(name[j], cc.e[i].impl)) j++;
        if (j == n) name[n] = cc.e[i].impl, count[n++] = 0;
        count[j]++;
    }
    size_t at = 0;
    if (len) buf[0] = 0;
    for (int k = 0; k < n && at < len; k++) { /* the most used first */
        int best = 0;
        for (int j = 1; j < n; j++)
            if (count[j] > count[best]) best = j;
        int w = snprintf(buf + at, len - at, "%s%s*%d", at ? "," : "", name[best], count[best]);
        at += w > 0 ? (size_t)w : 0;
        count[best] = -1;
    }
    pthread_mutex_unlock(&cc.lock);
}

kpl_algo_cache_stats kpl__cpu_conv_cache_stats(void)
{
    pthread_mutex_lock(&cc.lock);
    kpl_algo_cache_stats s = {cc.hits, cc.misses, (uint64_t)cc.n};
    pthread_mutex_unlock(&cc.lock);
    return s;
}

#define DNNL_TRY(call, what)                                                        \
    do {                                                                            \
        dnnl_status_t ds_ = (call);                                                 \
        if (ds_ != dnnl_success) {                                                  \
            st = KPL_ERROR(KPL_EBACKEND, "conv2d: oneDNN %s failed: %s", what,      \
                           dnnl_status2str(ds_));                                   \
            goto fail;                                                              \
        }                                                                           \
    } while (0)

static void entry_destroy(conv_entry *e)
{
    if (e->prim) dnnl_primitive_destroy(e->prim);
    for (int i = 0; i < 3; i++)
        if (e->reorder[i]) dnnl_primitive_destroy(e->reorder[i]);
    for (int i = 0; i < 2; i++)
        for (int t = 0; t < KPL_KEPT_COUNT; t++)
            if (e->from_kept[i][t]) dnnl_primitive_destroy(e->from_kept[i][t]);
    if (e->acc_in) dnnl_primitive_destroy(e->acc_in);
    memset(e, 0, sizeof *e);
}

/* oneDNN's tags of the kept layouts (kpl_kept). */
static const dnnl_format_tag_t kept_tag[KPL_KEPT_COUNT] = {dnnl_abcd, dnnl_aBcd16b, dnnl_acdb};

/* The reorder between slot i's plain layout and the primitive's own, in
 * the direction the data flows. */
static kpl_status make_reorder(conv_entry *e, int i)
{
    kpl_status st = KPL_OK;
    dnnl_primitive_desc_t rpd = NULL;
    if (dnnl_memory_desc_equal(&e->user[i], &e->inner[i])) return KPL_OK;
    const dnnl_memory_desc_t *from = i < 2 ? &e->user[i] : &e->inner[i];
    const dnnl_memory_desc_t *to = i < 2 ? &e->inner[i] : &e->user[i];
    DNNL_TRY(dnnl_reorder_primitive_desc_create(&rpd, from, cc.engine, to, cc.engine, NULL),
             "reorder pd");
    DNNL_TRY(dnnl_primitive_create(&e->reorder[i], rpd), "reorder");
fail:
    if (rpd) dnnl_primitive_desc_destroy(rpd);
    return st;
}

/* Fills e from one implementation's primitive descriptor: the layouts it
 * chose, the reorders to and from plain, the primitive. */
static kpl_status entry_from_pd(conv_entry *e, const_dnnl_primitive_desc_t pd,
                                const dnnl_query_t q[3])
{
    kpl_status st = KPL_OK;
    for (int i = 0; i < 3; i++) {
        e->inner[i] = *dnnl_primitive_desc_query_md(pd, q[i], 0);
        if ((st = make_reorder(e, i)) < 0) goto fail;
        /* activations (not weights) with channels in blocks of 16 can
         * stay in the kept layout oneDNN chose */
        bool act = e->arg[i] == DNNL_ARG_SRC || e->arg[i] == DNNL_ARG_DST ||
                   e->arg[i] == DNNL_ARG_DIFF_SRC || e->arg[i] == DNNL_ARG_DIFF_DST;
        if (!act || e->user[i].ndims != 4 || e->user[i].dims[1] % 16) continue;
        dnnl_memory_desc_t md[KPL_KEPT_COUNT];
        bool has[KPL_KEPT_COUNT] = {false};
        for (int t = KPL_KEPT_NC16; t < KPL_KEPT_COUNT; t++) {
            has[t] = dnnl_memory_desc_init_by_tag(&md[t], 4, e->user[i].dims,
                                                  e->user[i].data_type, kept_tag[t]) == dnnl_success;
            if (has[t] && dnnl_memory_desc_equal(&md[t], &e->inner[i])) e->kept[i] = t;
        }
        /* an input kept in another layout than inner goes there directly,
         * without being turned plain first */
        for (int t = KPL_KEPT_NC16; i < 2 && t < KPL_KEPT_COUNT; t++) {
            dnnl_primitive_desc_t rpd = NULL;
            if (!has[t] || (int)e->kept[i] == t ||
                dnnl_reorder_primitive_desc_create(&rpd, &md[t], cc.engine, &e->inner[i],
                                                   cc.engine, NULL) != dnnl_success)
                continue;
            e->from_md[i][t] = md[t];
            if (dnnl_primitive_create(&e->from_kept[i][t], rpd) != dnnl_success)
                e->from_kept[i][t] = NULL; /* then the input is turned plain first */
            dnnl_primitive_desc_destroy(rpd);
        }
    }
    if (e->key.a.acc && e->reorder[2]) { /* the addend in a plain out goes in first */
        dnnl_primitive_desc_t rpd = NULL;
        DNNL_TRY(dnnl_reorder_primitive_desc_create(&rpd, &e->user[2], cc.engine, &e->inner[2],
                                                    cc.engine, NULL),
                 "reorder pd");
        dnnl_status_t ds = dnnl_primitive_create(&e->acc_in, rpd);
        dnnl_primitive_desc_destroy(rpd);
        DNNL_TRY(ds, "reorder");
    }
    DNNL_TRY(dnnl_primitive_create(&e->prim, pd), "primitive");
fail:
    if (st < 0) entry_destroy(e);
    return st;
}

/* The ReLU of KPL_KOP_CONV2D_RELU where it is not a oneDNN post-op
 * (kpl's own loops, the f64 reference), with relu's formula. */
static void relu_in_place(kpl_tensor *out)
{
    int64_t n = out->numel;
    if (out->dtype == KPL_F64) {
        double *y = kpl__data(out);
        KPL_PARALLEL_FOR_IF(i, n, n > 65536, y[i] = y[i] < 0 ? 0 : y[i];);
    } else {
        float *y = kpl__data(out);
        KPL_PARALLEL_FOR_IF(i, n, n > 65536, y[i] = y[i] < 0 ? 0 : y[i];);
    }
}

/* Runs a cached convolution on the call's tensors: reorders in, the
 * primitive, reorder out.  Called with cc.lock held. */
static kpl_status run_entry(const conv_entry *e, const kpl_conv_attrs *a,
                            const kpl_kernel_args *args)
{
    if (e->direct_threads) {
        kpl_status dst = kpl__conv_direct_run(a, args, e->direct_threads);
        if (dst >= 0 && a->relu) relu_in_place(args->out);
        return dst;
    }
    kpl_status st = KPL_OK;
    dnnl_memory_t um[3] = {NULL, NULL, NULL}, im[3] = {NULL, NULL, NULL}, bm = NULL;
    void *buf[3] = {NULL, NULL, NULL};
    kpl_device *cpu = kpl_device_cpu();
    /* Operands already in (or allowed to be written in) the primitive's
     * kept layout skip their reorder.  Taken before any plain pointer,
     * as a plain access turns a kept storage plain; never when two
     * operands share a storage. */
    const kpl_tensor *opd[3] = {args->in[0], args->in[1], args->out};
    void *direct[3] = {NULL, NULL, NULL};
    bool shared = opd[0]->storage == opd[1]->storage || opd[0]->storage == opd[2]->storage ||
                  opd[1]->storage == opd[2]->storage;
    void *via_kept[2] = {NULL, NULL}; /* inputs reordered from another kept layout */
    kpl_kept via_tag[2] = {KPL_KEPT_PLAIN, KPL_KEPT_PLAIN};
    /* constant weights (forward, and backward-data: a transposed
     * convolution's forward): reordered once, the copy kept with them */
    kpl_storage *ws = opd[1]->storage;
    bool pack = a->kind != KPL_CONV_BWD_WEIGHT && ws->constant && e->reorder[1] && !shared;
    uint64_t pkey = 0;
    bool packed_hit = false;
    if (pack) {
        pkey = 1469598103934665603ULL ^ (uint64_t)opd[1]->offset;
        const unsigned char *d[2] = {(const void *)&e->inner[1], (const void *)&e->user[1]};
        for (int k = 0; k < 2; k++)
            for (size_t j = 0; j < sizeof(dnnl_memory_desc_t); j++)
                pkey = (pkey ^ d[k][j]) * 1099511628211ULL;
        packed_hit = ws->packed && ws->packed_key == pkey &&
                     ws->packed_bytes == dnnl_memory_desc_get_size(&e->inner[1]);
    }
    for (int i = 0; i < 3 && !shared; i++) {
        if (e->kept[i])
            direct[i] = i < 2 || a->acc ? kpl__kept_data(opd[i], e->kept[i]) /* (the addend's) */
                        : kpl__keepable(opd[2]) ? kpl__kept_out(opd[2]) : NULL;
        if (i < 2 && !direct[i] && (via_tag[i] = kpl__kept(opd[i])) && e->from_kept[i][via_tag[i]])
            via_kept[i] = kpl__kept_data(opd[i], via_tag[i]);
    }
    for (int i = 0; i < 3; i++) {
        if (direct[i]) {
            DNNL_TRY(dnnl_memory_create(&im[i], &e->inner[i], cc.engine, direct[i]), "memory");
            continue;
        }
        if (i == 1 && packed_hit) {
            DNNL_TRY(dnnl_memory_create(&im[i], &e->inner[i], cc.engine, ws->packed), "memory");
            continue;
        }
        if (i < 2 && via_kept[i]) {
            DNNL_TRY(dnnl_memory_create(&um[i], &e->from_md[i][via_tag[i]], cc.engine, via_kept[i]),
                     "memory");
            if ((st = kpl_device_alloc(cpu, dnnl_memory_desc_get_size(&e->inner[i]), "conv2d",
                                       &buf[i])) < 0)
                goto fail;
            DNNL_TRY(dnnl_memory_create(&im[i], &e->inner[i], cc.engine, buf[i]), "memory");
            continue;
        }
        void *user_ptr = i < 2 ? (void *)kpl__cdata(opd[i]) : kpl__data(args->out);
        DNNL_TRY(dnnl_memory_create(&um[i], &e->user[i], cc.engine, user_ptr), "memory");
        if (!e->reorder[i]) continue;
        if ((st = kpl_device_alloc(cpu, dnnl_memory_desc_get_size(&e->inner[i]), "conv2d",
                                   &buf[i])) < 0)
            goto fail;
        DNNL_TRY(dnnl_memory_create(&im[i], &e->inner[i], cc.engine, buf[i]), "memory");
    }
    if (e->acc_in && !direct[2]) {
        dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, um[2]}, {DNNL_ARG_TO, im[2]}};
        DNNL_TRY(dnnl_primitive_execute(e->acc_in, cc.stream, 2, r), "reorder");
    }
    for (int i = 0; i < 2; i++)
        if ((e->reorder[i] || via_kept[i]) && !direct[i] && !(i == 1 && packed_hit)) {
            dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, um[i]}, {DNNL_ARG_TO, im[i]}};
            DNNL_TRY(dnnl_primitive_execute(via_kept[i] ? e->from_kept[i][via_tag[i]] : e->reorder[i],
                                            cc.stream, 2, r),
                     "reorder");
        }
    if (pack && !packed_hit && buf[1] && !via_kept[1]) { /* keep the reordered weights */
        DNNL_TRY(dnnl_stream_wait(cc.stream), "stream wait");
        kpl__storage_drop_packed(ws);
        ws->packed = buf[1];
        ws->packed_bytes = dnnl_memory_desc_get_size(&e->inner[1]);
        ws->packed_key = pkey;
        buf[1] = NULL;
    }
    dnnl_exec_arg_t ex[4];
    int na = 0;
    for (int i = 0; i < 3; i++) ex[na++] = (dnnl_exec_arg_t){e->arg[i], im[i] ? im[i] : um[i]};
    if (args->in[2]) { /* bias (fwd, read) or its gradient (bwd_weight, written) */
        void *pb = a->kind == KPL_CONV_FWD ? (void *)kpl__cdata(args->in[2])
                                           : kpl__data((kpl_tensor *)args->in[2]);
        DNNL_TRY(dnnl_memory_create(&bm, &e->bias, cc.engine, pb), "memory");
        ex[na++] = (dnnl_exec_arg_t){a->kind == KPL_CONV_FWD ? DNNL_ARG_BIAS : DNNL_ARG_DIFF_BIAS,
                                     bm};
    }
    DNNL_TRY(dnnl_primitive_execute(e->prim, cc.stream, na, ex), "execute");
    if (e->reorder[2] && !direct[2]) {
        dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, im[2]}, {DNNL_ARG_TO, um[2]}};
        DNNL_TRY(dnnl_primitive_execute(e->reorder[2], cc.stream, 2, r), "reorder");
    }
    DNNL_TRY(dnnl_stream_wait(cc.stream), "stream wait");
    if (direct[2]) kpl__storage_set_kept(args->out, e->kept[2]);
fail:
    for (int i = 0; i < 3; i++) {
        if (um[i]) dnnl_memory_destroy(um[i]);
        if (im[i]) dnnl_memory_destroy(im[i]);
        if (buf[i]) kpl_device_free(cpu, buf[i]);
    }
    if (bm) dnnl_memory_destroy(bm);
    return st;
}

/* The algorithm choice (MegEngine's Fastrun): every implementation oneDNN
 * offers for the problem (reference loops excepted), each with the
 * reorders its layouts cost, and kpl's own loops on plain tensors (where
 * they apply; with the whole OpenMP team and with one thread) are run on
 * the call's own tensors and the fastest is kept.  Blocked direct kernels
 * win on wide layers (ResNet); kpl's loops on LeNet's narrow ones.  The
 * output is rewritten by the caller's run afterwards.  In deterministic
 * mode the first usable implementation (oneDNN's own preference) is taken
 * untimed, so every process makes the same choice. */
#define MAX_CANDIDATES 6

/* Busy-waits s seconds: a timed run follows some work, as inside a
 * training step, by which time idle OpenMP threads have gone to sleep
 * (OMP_WAIT_POLICY=PASSIVE); back-to-back runs would hide what waking
 * them costs (20-60 us per parallel region on a VM). */
static void busy_wait(double s)
{
    double t0 = kpl_seconds();
    while (kpl_seconds() - t0 < s) {
    }
}

/* Best of the runs after the first (which pays for first touches); the
 * best of two stands for a candidate, as CPU steal on shared machines is
 * bursty.  A candidate whose first run already took CUTOFF times the best
 * time so far cannot win and is not run again: its first run is returned.
 * Without this the first step of ResNet-18 (CIFAR, batch 64) spent 80% of
 * its 100 s timing kpl's plain-layout loops on wide layers three times
 * over. */
#define CUTOFF 4.0

static double time_entry(const conv_entry *e, const kpl_conv_attrs *a,
                         const kpl_kernel_args *args, double best, kpl_status *st)
{
    double t = INFINITY;
    for (int r = 0; r < 3 && *st >= 0; r++) {
        busy_wait(50e-6);
        double t0 = kpl_seconds();
        *st = run_entry(e, a, args);
        double dt = kpl_seconds() - t0;
        if (r == 0 && dt > CUTOFF * best) return dt;
        if (r > 0 && *st >= 0 && dt < t) t = dt;
    }
    return t;
}

/* kpl's loops on the first images of the batch only (two per thread),
 * scaled to the whole batch: on wide layers one run of the whole batch
 * costs seconds, and a loop that far behind the best so far is judged by
 * this estimate alone.  Returns 0 (no estimate) when the batch is too small
 * for a probe to save anything. */
static double probe_direct(const kpl_conv_attrs *a, const kpl_kernel_args *args, int threads,
                           double best, kpl_status *st)
{
    int64_t m = 2 * (int64_t)threads;
    if (best == INFINITY || a->n < 2 * m) return 0;
    kpl_conv_attrs part = *a;
    part.n = m;
    busy_wait(50e-6);
    double t0 = kpl_seconds();
    *st = kpl__conv_direct_run(&part, args, threads);
    return (kpl_seconds() - t0) * (double)a->n / (double)m;
}

/* Seconds one reorder from `from` to `to` takes (best of the runs after
 * the first, as time_entry), on scratch buffers; 0 where it cannot be
 * built.  What kpl's loops, which write plain, cost the consumers of an
 * output the fastest oneDNN kernel would have written in a kept layout:
 * without it a ResNet's stem ran in kpl's loops (50 us faster on its
 * own) and its plain output kept the whole first stage plain, 8 reorders
 * of 65 us per pass (ResNet-18 CIFAR, batch 1, NHWC). */
static double time_reorder(const dnnl_memory_desc_t *from, const dnnl_memory_desc_t *to)
{
    dnnl_primitive_desc_t rpd = NULL;
    dnnl_primitive_t r = NULL;
    dnnl_memory_t m[2] = {NULL, NULL};
    void *buf[2] = {NULL, NULL};
    kpl_device *cpu = kpl_device_cpu();
    double t = INFINITY;
    if (dnnl_reorder_primitive_desc_create(&rpd, from, cc.engine, to, cc.engine, NULL) !=
            dnnl_success ||
        dnnl_primitive_create(&r, rpd) != dnnl_success)
        goto done;
    const dnnl_memory_desc_t *md[2] = {from, to};
    for (int i = 0; i < 2; i++) {
        size_t bytes = dnnl_memory_desc_get_size(md[i]);
        if (kpl_device_alloc(cpu, bytes, "conv2d", &buf[i]) < 0 ||
            dnnl_memory_create(&m[i], md[i], cc.engine, buf[i]) != dnnl_success)
            goto done;
        memset(buf[i], 0, bytes);
    }
    dnnl_exec_arg_t ex[2] = {{DNNL_ARG_FROM, m[0]}, {DNNL_ARG_TO, m[1]}};
    for (int run = 0; run < 3; run++) {
        busy_wait(50e-6);
        double t0 = kpl_seconds();
        if (dnnl_primitive_execute(r, cc.stream, 2, ex) != dnnl_success ||
            dnnl_stream_wait(cc.stream) != dnnl_success)
            break;
        double dt = kpl_seconds() - t0;
        if (run > 0 && dt < t) t = dt;
    }
done:
    kpl_clear_error(); /* a failed scratch allocation only leaves the charge out */
    for (int i = 0; i < 2; i++) {
        if (m[i]) dnnl_memory_destroy(m[i]);
        if (buf[i]) kpl_device_free(cpu, buf[i]);
    }
    if (r) dnnl_primitive_destroy(r);
    if (rpd) dnnl_primitive_desc_destroy(rpd);
    return t == INFINITY ? 0 : t;
}

/* kpl's loops as candidates after oneDNN's (choose): with the team, then
 * with one thread.  One thread does the team's work alone and wins only
 * where forking costs more than the work; if the team's run was cut off,
 * the work is many times the fork and one thread is not tried.  Not where
 * a layout is asked for and the output can be kept in it (the chain is to
 * stay in that layout); a forward output the best kernel keeps in a kept
 * layout costs the loops, which write plain, its reorder (time_reorder).
 * *out and *best as choose keeps them; a candidate that cannot run (out of
 * memory) is skipped. */
static void choose_direct(const conv_key *k, const kpl_kernel_args *args, kpl_layout layout,
                          const conv_entry *base, conv_entry *out, double *best)
{
    const kpl_conv_attrs *a = &k->a;
    if (layout != KPL_LAYOUT_AUTO && a->o % 16 == 0) return;
    double charge = *best < INFINITY && a->kind == KPL_CONV_FWD && out->kept[2]
                        ? time_reorder(&out->user[2], &out->inner[2])
                        : 0;
    for (int nt = k->threads; nt >= 1; nt = nt > 1 ? 1 : 0) {
        kpl_status st = KPL_OK;
        conv_entry cand = *base;
        cand.direct_threads = nt;
        snprintf(cand.impl, sizeof cand.impl, "kpl_direct");
        double t = probe_direct(a, args, nt, *best - charge, &st);
        if (st >= 0 && t <= CUTOFF * *best) t = time_entry(&cand, a, args, *best - charge, &st);
        t += charge;
        if (st < 0) {
            kpl_clear_error();
        } else if (t < *best) {
            if (*best < INFINITY) entry_destroy(out);
            *out = cand;
            *best = t;
        } else if (t > CUTOFF * *best) {
            return;
        }
    }
}

/* The problem's memory descriptors and geometry, as oneDNN takes them. */
typedef struct {
    dnnl_memory_desc_t usrc, udst, uwei, asrc, adst, awei;
    const dnnl_memory_desc_t *bias; /* NULL without one */
    dnnl_dims_t strides, dil, pad, pad_r;
} conv_mds;

/* The operation descriptor of k's direction with algorithm alg; backward
 * ones also get *hint, the forward's primitive descriptor (freed by the
 * caller).  Winograd's forward is an inference one: it computes the same
 * values, and oneDNN offers jit_fp32_wino_2x3 only there.  The direct
 * forward stays a training one: as an inference one oneDNN lists brgconv
 * first, which deterministic mode (the first kernel, untimed) would then
 * take instead of jit, and which ran the DeepLab recipe's test 1.6x
 * slower on two cores shared with other work. */
static kpl_status op_desc(const conv_key *k, const conv_mds *m, dnnl_alg_kind_t alg,
                          dnnl_convolution_desc_t *d, dnnl_primitive_desc_t *hint)
{
    kpl_status st = KPL_OK;
    dnnl_convolution_desc_t fd;
    bool fwd = k->a.kind == KPL_CONV_FWD;
    DNNL_TRY(dnnl_dilated_convolution_forward_desc_init(
                 fwd ? d : &fd,
                 fwd && alg == dnnl_convolution_winograd ? dnnl_forward_inference
                                                         : dnnl_forward_training,
                 alg,
                 &m->asrc, &m->awei, fwd ? m->bias : NULL, &m->adst, m->strides, m->dil, m->pad,
                 m->pad_r),
             "forward desc");
    if (fwd) return KPL_OK;
    DNNL_TRY(dnnl_primitive_desc_create(hint, &fd, NULL, cc.engine, NULL), "forward pd");
    if (k->a.kind == KPL_CONV_BWD_DATA)
        DNNL_TRY(dnnl_dilated_convolution_backward_data_desc_init(d, alg, &m->asrc, &m->awei,
                                                                  &m->adst, m->strides, m->dil,
                                                                  m->pad, m->pad_r),
                 "backward data desc");
    else
        DNNL_TRY(dnnl_dilated_convolution_backward_weights_desc_init(
                     d, alg, &m->asrc, &m->awei, m->bias, &m->adst, m->strides, m->dil, m->pad,
                     m->pad_r),
                 "backward weights desc");
fail:
    return st;
}

/* The test hook's restriction (kpl__cpu_conv_only): the candidates whose
 * name starts with it, all where empty. */
static char only_impl[sizeof(((conv_key *)0)->only)];

static bool allowed(const conv_key *k, const char *impl)
{
    return !k->only[0] || strncmp(impl, k->only, strlen(k->only)) == 0;
}

/* In training (weights not constant), Winograd's working memory
 * (oneDNN's scratchpad: the transformed tiles, ~4.5x the activation they
 * come from, and per-thread copies of the transformed weights in the
 * weight gradient) may be at most SCRATCH_MAX times the problem's larger
 * activation, or SCRATCH_FLOOR (its kernels take ~6 MB whatever the size,
 * and a ResNet-50 step's direct kernels already need 77 MB of scratchpad).
 * oneDNN keeps one scratchpad for every primitive, as large
 * as the largest any has run with, for the life of the process: a
 * ResNet-50 (b8) step's timing of a Winograd weight gradient at 512
 * channels, 7 x 7, which needs 126 MB (160x its activation) and never
 * wins, raised that step's peak RSS by ~100 MB, and the step's peak is
 * what decides the batch that fits.  An inference graph's convolutions
 * (constant weights, transformed once) are not bounded: ResNet-50 at
 * batch 32 ran 474-479 ms so against 551 bounded, its peak RSS 1958 MB
 * against 1913 without Winograd. */
#define SCRATCH_MAX 8
#define SCRATCH_FLOOR ((int64_t)32 << 20)

static bool scratch_ok(const conv_key *k, const_dnnl_primitive_desc_t pd)
{
    const kpl_conv_attrs *a = &k->a;
    if (k->frozen) return true;
    int64_t bytes = 0;
    if (dnnl_primitive_desc_query(pd, dnnl_query_memory_consumption_s64, 0, &bytes) !=
        dnnl_success)
        return false;
    int64_t act = a->n * (a->c * a->h * a->w > a->o * a->oh * a->ow ? a->c * a->h * a->w
                                                                      : a->o * a->oh * a->ow);
    act *= (int64_t)sizeof(float);
    return bytes <= (SCRATCH_MAX * act > SCRATCH_FLOOR ? SCRATCH_MAX * act : SCRATCH_FLOOR);
}

/* Every implementation oneDNN offers for algorithm alg (reference loops
 * excepted) as a candidate: timed, and kept in *out where fastest (*best
 * its time); in deterministic mode the first usable one, untimed.  An
 * algorithm oneDNN has no kernel for on this CPU or problem (Winograd
 * without AVX-512, say) adds none. */
static kpl_status try_algorithm(const conv_key *k, const kpl_kernel_args *args,
                                const conv_mds *m, dnnl_alg_kind_t alg,
                                const_dnnl_primitive_attr_t attr, const dnnl_query_t q[3],
                                const conv_entry *e, conv_entry *out, double *best)
{
    kpl_status st = KPL_OK;
    dnnl_primitive_desc_t hint = NULL;
    dnnl_primitive_desc_iterator_t it = NULL;
    dnnl_convolution_desc_t d;
    if (op_desc(k, m, alg, &d, &hint) < 0 ||
        dnnl_primitive_desc_iterator_create(&it, &d, attr, cc.engine, hint) != dnnl_success) {
        kpl_clear_error();
        goto fail;
    }
    int tried = 0;
    do {
        dnnl_primitive_desc_t pd = dnnl_primitive_desc_iterator_fetch(it);
        if (!pd) continue;
        const char *impl = NULL;
        dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
        conv_entry cand = *e;
        snprintf(cand.impl, sizeof cand.impl, "%s", impl ? impl : "oneDNN");
        bool usable = strncmp(cand.impl, "ref", 3) != 0 && allowed(k, cand.impl) &&
                      (alg != dnnl_convolution_winograd || scratch_ok(k, pd));
        if (usable && (st = entry_from_pd(&cand, pd, q)) >= 0) {
            double t = k->deterministic ? 0 : time_entry(&cand, &k->a, args, *best, &st);
            if (t < *best) {
                if (*best < INFINITY) entry_destroy(out);
                *out = cand;
                *best = t;
            } else {
                entry_destroy(&cand);
            }
            tried = k->deterministic ? MAX_CANDIDATES : tried + 1;
        }
        dnnl_primitive_desc_destroy(pd);
        if (st < 0) { /* a candidate that fails to build or run is skipped */
            kpl_clear_error();
            st = KPL_OK;
        }
    } while (tried < MAX_CANDIDATES && dnnl_primitive_desc_iterator_next(it) == dnnl_success);
fail:
    if (it) dnnl_primitive_desc_iterator_destroy(it);
    if (hint) dnnl_primitive_desc_destroy(hint);
    return st;
}

/* Winograd (oneDNN's jit_wino_4x3 and jit_fp32_wino_2x3, f32 on AVX-512)
 * is a candidate beside the direct kernels for 3x3 stride-1 undilated
 * convolutions: on ResNet-50's 3x3 layers it ran 1.7-2.1x faster (batch
 * 32, Zen 5), its error against f64 sums measured within 2.3x of the
 * direct kernels' (docs/precision.md).  Timed like the others, so it runs
 * only where it wins; never in deterministic mode (oneDNN's first direct
 * implementation, as before). */
static bool winograd_candidate(const conv_key *k)
{
    const kpl_conv_attrs *a = &k->a;
    return !k->deterministic && k->dt == dnnl_f32 && a->p.groups == 1 && a->kh == 3 &&
           a->kw == 3 && a->p.stride[0] == 1 && a->p.stride[1] == 1 && a->p.dilation[0] == 1 &&
           a->p.dilation[1] == 1;
}

static kpl_status choose(const conv_key *k, const kpl_kernel_args *args, kpl_layout layout,
                         conv_entry *out)
{
    kpl_status st = KPL_OK;
    const kpl_conv_attrs *a = &k->a;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    int g = a->p.groups;
    dnnl_dims_t src = {a->n, a->c, a->h, a->w}, dst = {a->n, a->o, a->oh, a->ow};
    dnnl_dims_t wei1 = {a->o, a->c, a->kh, a->kw};
    dnnl_dims_t weig = {g, a->o / g, a->c / g, a->kh, a->kw};
    dnnl_dims_t bias = {a->o};
    conv_mds m = {
        .strides = {a->p.stride[0], a->p.stride[1]},
        .dil = {a->p.dilation[0] - 1, a->p.dilation[1] - 1},
        .pad = {a->p.padding[0], a->p.padding[1]},
        /* oneDNN's right padding makes the output size come out exactly. */
        .pad_r = {(a->oh - 1) * a->p.stride[0] + (a->kh - 1) * a->p.dilation[0] + 1 - a->h -
                      a->p.padding[0],
                  (a->ow - 1) * a->p.stride[1] + (a->kw - 1) * a->p.dilation[1] + 1 - a->w -
                      a->p.padding[1]}};
    conv_entry e;
    memset(&e, 0, sizeof e);
    e.key = *k;
    DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.usrc, 4, src, k->dt, dnnl_nchw), "src desc");
    DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.udst, 4, dst, k->dt, dnnl_nchw), "dst desc");
    /* the activations' layout: oneDNN's choice per implementation, or the
     * one kpl_set_kept_layout asks for (where the channels allow it) */
    dnnl_format_tag_t ls = dnnl_format_tag_any, ld = dnnl_format_tag_any;
    if (layout == KPL_LAYOUT_NHWC) ls = ld = dnnl_acdb;
    if (layout == KPL_LAYOUT_NCHW16C) {
        ls = a->c % 16 ? dnnl_format_tag_any : dnnl_aBcd16b;
        ld = a->o % 16 ? dnnl_format_tag_any : dnnl_aBcd16b;
    }
    DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.asrc, 4, src, k->dt, ls), "src desc");
    DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.adst, 4, dst, k->dt, ld), "dst desc");
    if (g == 1) {
        DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.uwei, 4, wei1, k->dt, dnnl_oihw), "weights desc");
        DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.awei, 4, wei1, k->dt, dnnl_format_tag_any),
                 "weights desc");
    } else {
        DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.uwei, 5, weig, k->dt, dnnl_goihw), "weights desc");
        DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.awei, 5, weig, k->dt, dnnl_format_tag_any),
                 "weights desc");
    }
    DNNL_TRY(dnnl_memory_desc_init_by_tag(&e.bias, 1, bias, k->dt, dnnl_x), "bias desc");
    m.bias = k->bias && a->kind != KPL_CONV_BWD_DATA ? &e.bias : NULL;
    dnnl_query_t q[3];
    if (a->kind == KPL_CONV_FWD) {
        e.user[0] = m.usrc, e.user[1] = m.uwei, e.user[2] = m.udst;
        q[0] = dnnl_query_src_md, q[1] = dnnl_query_weights_md, q[2] = dnnl_query_dst_md;
        e.arg[0] = DNNL_ARG_SRC, e.arg[1] = DNNL_ARG_WEIGHTS, e.arg[2] = DNNL_ARG_DST;
    } else if (a->kind == KPL_CONV_BWD_DATA) {
        e.user[0] = m.udst, e.user[1] = m.uwei, e.user[2] = m.usrc;
        q[0] = dnnl_query_diff_dst_md, q[1] = dnnl_query_weights_md, q[2] = dnnl_query_diff_src_md;
        e.arg[0] = DNNL_ARG_DIFF_DST, e.arg[1] = DNNL_ARG_WEIGHTS, e.arg[2] = DNNL_ARG_DIFF_SRC;
    } else {
        e.user[0] = m.usrc, e.user[1] = m.udst, e.user[2] = m.uwei;
        q[0] = dnnl_query_src_md, q[1] = dnnl_query_diff_dst_md, q[2] = dnnl_query_diff_weights_md;
        e.arg[0] = DNNL_ARG_SRC, e.arg[1] = DNNL_ARG_DIFF_DST, e.arg[2] = DNNL_ARG_DIFF_WEIGHTS;
    }
    if (a->relu || a->acc) { /* y = relu(conv [+ y]) applied as the sums are stored */
        DNNL_TRY(dnnl_post_ops_create(&po), "post-ops");
        if (a->acc) DNNL_TRY(dnnl_post_ops_append_sum(po, 1.0f), "sum post-op");
        if (a->relu)
            DNNL_TRY(dnnl_post_ops_append_eltwise(po, 1.0f, dnnl_eltwise_relu, 0.0f, 0.0f),
                     "relu post-op");
        DNNL_TRY(dnnl_primitive_attr_create(&attr), "attributes");
        DNNL_TRY(dnnl_primitive_attr_set_post_ops(attr, po), "post-ops attribute");
    }
    double best = INFINITY;
    if ((st = try_algorithm(k, args, &m, dnnl_convolution_direct, attr, q, &e, out, &best)) < 0)
        goto fail;
    if (winograd_candidate(k) &&
        (st = try_algorithm(k, args, &m, dnnl_convolution_winograd, attr, q, &e, out, &best)) < 0)
        goto fail;
    if (!k->deterministic && k->dt == dnnl_f32 && !a->acc && kpl__conv_direct_supports(a) &&
        allowed(k, "kpl_direct"))
        choose_direct(k, args, layout, &e, out, &best);
    if (best == INFINITY)
        st = KPL_ERROR(KPL_EBACKEND, "conv2d: oneDNN offers no usable implementation");
fail:
    if (attr) dnnl_primitive_attr_destroy(attr);
    if (po) dnnl_post_ops_destroy(po);
    return st;
}

void kpl__cpu_conv_only(const char *prefix)
{
    pthread_mutex_lock(&cc.lock);
    snprintf(only_impl, sizeof only_impl, "%s", prefix ? prefix : "");
    pthread_mutex_unlock(&cc.lock);
}

static kpl_status conv_dnnl(const kpl_conv_attrs *a, const kpl_kernel_args *args,
                           dnnl_data_type_t dt)
{
    conv_key k;
    memset(&k, 0, sizeof k);
    k.dt = dt;
    kpl_conv_attrs_key(&k.a, a);
    k.threads = omp_get_max_threads();
    k.bias = args->in[2] != NULL;
    k.deterministic = kpl_get_deterministic();
    k.layout = kpl_get_kept_layout();
    /* only where it decides something (Winograd's memory bound): other
     * problems share one entry whether their weights are constant or not,
     * so a model file's executor runs eager mode's kernels, bit for bit */
    k.frozen = winograd_candidate(&k) && a->kind != KPL_CONV_BWD_WEIGHT &&
               args->in[1]->storage->constant;
    /* bf16: oneDNN 2.6's candidates on plain or nChw16c inputs (gemm) win
     * the per-call timing link by link while the chain as a whole loses
     * to every convolution in NHWC: a ResNet-50 b8 step ran 1.16x faster
     * so on two AMX cores (docs/gpu.md, "The AMX CPU against PyTorch"),
     * 1.07x faster with 16% less peak memory on Zen 5's AVX512-BF16
     * (ResNet-18 CIFAR b64 level), so NHWC is the choice for bf16; f32
     * keeps oneDNN's own per implementation. */
    if (k.layout == KPL_LAYOUT_AUTO && dt == dnnl_bf16) k.layout = KPL_LAYOUT_NHWC;
    kpl_status st = KPL_OK;
    pthread_mutex_lock(&cc.lock);
    memcpy(k.only, only_impl, sizeof k.only);
    conv_entry *e = NULL;
    for (int i = 0; i < cc.n; i++)
        if (!memcmp(&cc.e[i].key, &k, sizeof k)) {
            e = &cc.e[i];
            cc.hits++;
            break;
        }
    if (!e) {
        cc.misses++;
        if (!cc.engine) DNNL_TRY(dnnl_engine_create(&cc.engine, dnnl_cpu, 0), "engine");
        if (!cc.stream)
            DNNL_TRY(dnnl_stream_create(&cc.stream, cc.engine, dnnl_stream_default_flags), "stream");
        conv_entry fresh;
        memset(&fresh, 0, sizeof fresh);
        /* the candidates' timed runs would add into the addend: with
         * KPL_KOP_CONV2D_ACC they run on a scratch output */
        kpl_kernel_args timed = *args;
        if (a->acc && (st = kpl_tensor_empty(kpl_device_cpu(), args->out->dtype, 4,
                                             args->out->shape, &timed.out)) < 0)
            goto fail;
        st = choose(&k, &timed, k.layout, &fresh);
        if (st < 0 && k.layout != KPL_LAYOUT_AUTO) {
            /* no implementation for the asked layout (this ISA, dtype or
             * problem): oneDNN's own choice */
            kpl_clear_error();
            st = choose(&k, &timed, KPL_LAYOUT_AUTO, &fresh);
        }
        if (a->acc) kpl_tensor_release(timed.out);
        if (st < 0) goto fail;
        if (cc.n < CACHE_CAP) {
            e = &cc.e[cc.n++];
        } else { /* evict the least recently used */
            e = &cc.e[0];
            for (int i = 1; i < cc.n; i++)
                if (cc.e[i].last_use < e->last_use) e = &cc.e[i];
            entry_destroy(e);
        }
        *e = fresh;
    }
    e->last_use = ++cc.tick;
    snprintf(last_choice.impl, sizeof last_choice.impl, "%s", e->impl);
    last_choice.kind = a->kind;
    last_choice.dtype = args->out->dtype;
    last_choice.out_kept = e->kept[2];
    /* Execution stays under the lock (see cpu_matmul.c). */
    st = run_entry(e, a, args);
fail:
    pthread_mutex_unlock(&cc.lock);
    return st;
}

static kpl_status cpu_conv(const kpl_kernel_args *args)
{
    const kpl_conv_attrs *a = args->attrs;
    if (args->out->dtype == KPL_F32) return conv_dnnl(a, args, dnnl_f32);
    if (args->out->dtype == KPL_BF16) return conv_dnnl(a, args, dnnl_bf16);
    kpl__conv_ref_run(a, args);
    if (a->kind == KPL_CONV_FWD && a->relu) relu_in_place(args->out);
    return KPL_OK;
}

void kpl__cpu_register_conv(void)
{
    const kpl_kop kops[3] = {KPL_KOP_CONV2D, KPL_KOP_CONV2D_RELU, KPL_KOP_CONV2D_ACC};
    for (int i = 0; i < 3; i++) {
        kpl_kernel_register(kops[i], KPL_DEVICE_CPU, KPL_F32, cpu_conv);
        kpl_kernel_register(kops[i], KPL_DEVICE_CPU, KPL_F64, cpu_conv);
        if (kpl__cpu_bf16_native()) kpl_kernel_register(kops[i], KPL_DEVICE_CPU, KPL_BF16, cpu_conv);
    }
}
