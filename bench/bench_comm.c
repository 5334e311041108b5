/*
 * bench_comm.c — the comm group, run under mpirun (run.sh: -np 2, once on
 * Open MPI's shared-memory transport and once with `--mca btl tcp,self` and
 * UCX_TLS=tcp,self):
 *
 *   mpirun -np 2 bench_comm [--transport shm|tcp] [--cases busbw,r50,overlap]
 *
 * busbw    allreduce bus bandwidth (nccl-tests: 2 (n-1)/n x bytes / time,
 *          the slowest rank's time) of kpl_comm_allreduce, in place, for
 *          each host backend (mpi, ucx), 4 KB to 64 MB of f32, next to raw
 *          MPI_Allreduce(MPI_IN_PLACE) in the same job.  Targets: mpi 1.0;
 *          ucx 1.2 from 16 MB.
 * r50      ResNet-50's gradient set (the 161 parameter tensors of kpl's
 *          resnet50, 25.6 M floats) averaged over the ranks three ways:
 *          raw MPI per tensor (161 allreduces + the division); raw MPI on
 *          one fused buffer (pack, allreduce, divide, unpack: the Horovod
 *          way); kpl's bucketer (25 MB buckets, first 1 MB; the gradients
 *          are views of the buckets, so nothing is packed), each bucket
 *          started as its last gradient is marked (all marked in backward
 *          order here, no computation in between).  Targets: on shared
 *          memory the bucketer no slower than the better alternative (1.0);
 *          on TCP >= 2x faster than per tensor.
 * overlap  a 2-rank ResNet-18 (CIFAR stem, batch 32 per rank, one thread per
 *          rank) training step through kpl_ddp, next to the same step with
 *          communication skipped (kpl_ddp_begin(ddp, false)), and the
 *          bucketed allreduce of its gradients alone.  The fraction of the
 *          allreduce hidden behind backward = 1 - (step - step without
 *          communication) / allreduce alone; target 0.6.  Also printed: the
 *          bucketer's own account, 1 - time finish waited / backend time.
 *
 * Sides alternate over KPL_BENCH_ROUNDS rounds (default 5), medians; rank 0
 * prints one JSON line per case.
 */
#include "bench_common.h"
#include "bench_zoo.h"
#include "trainer.h"

#include <mpi.h>
#include <stdlib.h>
#include <string.h>

static int rank, nranks, rounds;
static const char *transport = "shm";

static void die(const char *what)
{
    fprintf(stderr, "bench_comm: rank %d: %s: %s\n", rank, what, kpl_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static kpl_comm *comm_for(kpl_comm_backend b)
{
    kpl_comm_config cfg = KPL_COMM_CONFIG_INIT;
    cfg.backend = b;
    kpl_comm *c = NULL;
    if (kpl_comm_create(&cfg, &c) < 0) die("comm_create");
    return c;
}

/* The slowest rank's seconds since t0. */
static double slowest(double t0)
{
    double el = MPI_Wtime() - t0, worst = 0;
    MPI_Allreduce(&el, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return worst;
}

/* ---- busbw ------------------------------------------------------------------------ */

static void busbw(kpl_comm *comm, const char *backend)
{
    for (size_t bytes = 4096; bytes <= ((size_t)64 << 20); bytes *= 4) {
        int64_t count = (int64_t)(bytes / 4);
        kpl_tensor *t = NULL;
        if (kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &count, &t) < 0) die("tensor");
        float *p = kpl_tensor_host_mutable(t);
        /* Enough repetitions for ~50 ms a block at ~2 GB/s, at least 3. */
        int reps = (int)(1e8 / (double)bytes);
        if (reps < 3) reps = 3;
        if (reps > 2000) reps = 2000;
        double tk[64], tr[64];
        for (int round = 0; round < rounds; round++) {
            for (int side = 0; side < 2; side++) {
                bool kpl_side = (side + round) % 2 == 0;
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                for (int i = 0; i < reps; i++) {
                    if (kpl_side) {
                        if (kpl_comm_allreduce(comm, t, t, KPL_COMM_SUM) < 0) die("allreduce");
                    } else {
                        MPI_Allreduce(MPI_IN_PLACE, p, (int)count, MPI_FLOAT, MPI_SUM,
                                      MPI_COMM_WORLD);
                    }
                }
                double busbw = 2.0 * (nranks - 1) / nranks * (double)bytes / (slowest(t0) / reps) / 1e9;
                (kpl_side ? tk : tr)[round] = busbw;
            }
        }
        if (rank == 0) {
            char cas[96], rk[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN];
            snprintf(cas, sizeof cas, "allreduce_f32/%s/%zuB/%s/np%d", backend, bytes, transport,
                     nranks);
            bool ucx = !strcmp(backend, "ucx");
            double target = ucx ? (bytes >= ((size_t)16 << 20) ? 1.2 : NAN) : 1.0;
            bench_emit("comm", cas, "GB/s busbw", 1, bench_median(tk, rounds),
                       bench_median(tr, rounds), "MPI_Allreduce", target,
                       ",\"backend\":\"%s\",\"transport\":\"%s\",\"reps\":%d,\"kpl_range\":%s,"
                       "\"ref_range\":%s", backend, transport, reps,
                       bench_jrange(rk, tk, rounds), bench_jrange(rr, tr, rounds));
        }
        kpl_tensor_release(t);
    }
}

/* ---- r50 -------------------------------------------------------------------------- */

static void scale(float *p, int64_t n, float s)
{
    for (int64_t j = 0; j < n; j++) p[j] *= s;
}

static void r50(kpl_comm *const *comms, const char *const *names, int ncomms)
{
    kpl_module *m = NULL;
    if (bench_zoo("resnet50", 1000, kpl_device_cpu(), 1, &m) < 0) die("resnet50");
    int n = kpl_module_num_params(m);
    kpl_tensor *const *params = kpl_module_params(m);
    int64_t total = kpl_module_param_count(m);
    /* The reference sides' gradients: separate tensors, and a fused buffer. */
    float **g = calloc((size_t)n, sizeof *g), *flat = malloc((size_t)total * 4);
    if (!g || !flat) die("memory");
    for (int i = 0; i < n; i++) {
        int64_t c = kpl_tensor_numel(params[i]);
        g[i] = malloc((size_t)c * 4);
        if (!g[i]) die("memory");
        for (int64_t j = 0; j < c; j++) g[i][j] = 1.0f;
    }
    kpl_bucketer *b[4] = {0};
    kpl_bucketer_config cfg = KPL_BUCKETER_CONFIG_INIT;
    cfg.check_params = false;
    for (int k = 0; k < ncomms; k++) {
        if (kpl_bucketer_create(comms[k], n, params, &cfg, &b[k]) < 0) die("bucketer");
        for (int i = 0; i < n; i++) kpl_k_fill(kpl_bucketer_grad(b[k], i), 1.0);
    }
    const float inv = 1.0f / (float)nranks;
    enum { SIDES = 6 };
    double t[SIDES][64];
    int nbuckets[4] = {0};
    for (int round = -1; round < rounds; round++) { /* round -1 warms up and rebuilds */
        for (int s0 = 0; s0 < 2 + 2 * ncomms; s0++) {
            int side = (s0 + (round < 0 ? 0 : round)) % (2 + 2 * ncomms);
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            if (side == 0) { /* raw per tensor, backward order */
                for (int i = n - 1; i >= 0; i--) {
                    int64_t c = kpl_tensor_numel(params[i]);
                    MPI_Allreduce(MPI_IN_PLACE, g[i], (int)c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                    scale(g[i], c, inv);
                }
            } else if (side == 1) { /* raw fused: pack, allreduce, divide, unpack */
                int64_t off = 0;
                for (int i = n - 1; i >= 0; i--) {
                    int64_t c = kpl_tensor_numel(params[i]);
                    memcpy(flat + off, g[i], (size_t)c * 4);
                    off += c;
                }
                MPI_Allreduce(MPI_IN_PLACE, flat, (int)total, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                scale(flat, total, inv);
                off = 0;
                for (int i = n - 1; i >= 0; i--) {
                    int64_t c = kpl_tensor_numel(params[i]);
                    memcpy(g[i], flat + off, (size_t)c * 4);
                    off += c;
                }
            } else if (side % 2 == 0) { /* kpl bucketed */
                kpl_bucketer *bk = b[side / 2 - 1];
                for (int i = n - 1; i >= 0; i--)
                    if (kpl_bucketer_mark_ready(bk, i) < 0) die("mark_ready");
                if (kpl_bucketer_finish(bk) < 0) die("bucketer_finish");
                nbuckets[side / 2 - 1] = kpl_bucketer_num_buckets(bk);
            } else { /* kpl per tensor */
                kpl_comm *c = comms[side / 2 - 1];
                for (int i = n - 1; i >= 0; i--) {
                    kpl_tensor *gt = kpl_bucketer_grad(b[side / 2 - 1], i);
                    if (kpl_comm_allreduce(c, gt, gt, KPL_COMM_AVG) < 0) die("allreduce");
                }
            }
            double el = slowest(t0);
            if (round >= 0) t[side][round] = el * 1e3;
        }
    }
    if (g[0][0] != 1.0f || ((const float *)kpl_tensor_host_data(kpl_bucketer_grad(b[0], 0)))[0] != 1.0f)
        die("the averages of ones are not one");
    if (rank == 0) {
        double per = bench_median(t[0], rounds), fused = bench_median(t[1], rounds);
        bool tcp = !strcmp(transport, "tcp");
        for (int k = 0; k < ncomms; k++) {
            double bk = bench_median(t[2 + 2 * k], rounds), pt = bench_median(t[3 + 2 * k], rounds);
            char cas[128], rk[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN], rf[BENCH_RANGE_LEN];
            const char *fmt = ",\"backend\":\"%s\",\"transport\":\"%s\",\"tensors\":%d,"
                              "\"floats\":%lld,\"buckets\":%d,\"kpl_range\":%s,\"ref_range\":%s";
            snprintf(cas, sizeof cas, "r50_grads/bucketed_%s_vs_per_tensor/%s/np%d", names[k],
                     transport, nranks);
            bench_emit("comm", cas, "ms", 0, bk, per, "MPI_Allreduce per tensor",
                       tcp ? 2.0 : NAN, fmt, names[k], transport, n, (long long)total,
                       nbuckets[k], bench_jrange(rk, t[2 + 2 * k], rounds),
                       bench_jrange(rr, t[0], rounds));
            snprintf(cas, sizeof cas, "r50_grads/bucketed_%s_vs_fused/%s/np%d", names[k],
                     transport, nranks);
            bench_emit("comm", cas, "ms", 0, bk, fused, "MPI_Allreduce packed fused buffer", NAN,
                       fmt, names[k], transport, n, (long long)total, nbuckets[k],
                       bench_jrange(rk, t[2 + 2 * k], rounds), bench_jrange(rf, t[1], rounds));
            snprintf(cas, sizeof cas, "r50_grads/bucketed_%s_vs_best/%s/np%d", names[k],
                     transport, nranks);
            bench_emit("comm", cas, "ms", 0, bk, per < fused ? per : fused,
                       per < fused ? "MPI_Allreduce per tensor" : "MPI_Allreduce packed fused buffer",
                       tcp ? NAN : 1.0, fmt, names[k], transport, n, (long long)total,
                       nbuckets[k], bench_jrange(rk, t[2 + 2 * k], rounds),
                       bench_jrange(rr, t[per < fused ? 0 : 1], rounds));
            snprintf(cas, sizeof cas, "r50_grads/per_tensor_%s/%s/np%d", names[k], transport,
                     nranks);
            bench_emit("comm", cas, "ms", 0, pt, per, "MPI_Allreduce per tensor", NAN, fmt,
                       names[k], transport, n, (long long)total, nbuckets[k],
                       bench_jrange(rk, t[3 + 2 * k], rounds), bench_jrange(rr, t[0], rounds));
        }
    }
    for (int k = 0; k < ncomms; k++) kpl_bucketer_destroy(b[k]);
    for (int i = 0; i < n; i++) free(g[i]);
    free(g);
    free(flat);
    kpl_module_destroy(m);
}

/* ---- overlap ----------------------------------------------------------------------- */

/* A random batch of `batch` images hw x hw (x) and labels below classes
 * (y), different on each rank. */
static void make_batch(int64_t batch, int64_t hw, int64_t classes, kpl_tensor **x, kpl_tensor **y)
{
    const int64_t xs[4] = {batch, 3, hw, hw};
    kpl_rng *r = kpl_rng_create(100 + (uint64_t)rank);
    if (!r || kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 4, xs, x) < 0 ||
        kpl_tensor_empty(kpl_device_cpu(), KPL_I64, 1, &batch, y) < 0)
        die("tensor");
    kpl_k_normal(*x, r, 0, 1);
    int64_t *py = kpl_tensor_host_mutable(*y);
    for (int64_t i = 0; i < batch; i++) py[i] = (i * 3 + rank) % classes;
    kpl_rng_destroy(r);
}

/* One DDP training step of m, the slowest rank's milliseconds; *bwd_ms
 * (may be NULL): the slowest rank's backward, from the loss to the end of
 * kpl_ddp_finish (without communication, the backward alone). */
static double train_step(kpl_module *m, kpl_ddp *ddp, kpl_optim *opt, kpl_tensor *x, kpl_tensor *y,
                         bool sync, double *bwd_ms)
{
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    if (kpl_ddp_begin(ddp, sync) < 0) die("ddp_begin");
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *loss = kpl_cross_entropy(kpl_module_forward(m, x), y, KPL_REDUCE_MEAN, 0,
                                         -100);
    if (!loss) die("forward");
    kpl_tensor_retain(loss);
    kpl_pool_pop(p);
    double tb = MPI_Wtime();
    if (kpl_backward(loss, NULL, false) < 0) die("backward");
    kpl_tensor_release(loss);
    if (kpl_ddp_finish(ddp) < 0) die("ddp_finish");
    double bwd = MPI_Wtime() - tb, worst = 0;
    if (kpl_optim_step(opt) < 0) die("sgd");
    double ms = slowest(t0) * 1e3;
    MPI_Allreduce(&bwd, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (bwd_ms) *bwd_ms = worst * 1e3;
    return ms;
}

static void overlap(kpl_comm *comm)
{
    const int64_t batch = 32;
    kpl_module *m = NULL;
    if (bench_zoo("resnet18_cifar", 10, kpl_device_cpu(), 7, &m) < 0) die("resnet18");
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    oc.lr = 0.01;
    oc.momentum = 0.9;
    kpl_optim *opt = NULL;
    if (kpl_optim_create(&oc, kpl_module_num_params(m), kpl_module_params(m), NULL, &opt) < 0)
        die("sgd");
    kpl_ddp *ddp = NULL;
    kpl_bucketer_config cfg = KPL_BUCKETER_CONFIG_INIT;
    cfg.check_params = false; /* the steps without communication let the ranks drift */
    if (kpl_ddp_create(comm, kpl_module_num_params(m), kpl_module_params(m),
                       kpl_module_num_buffers(m), kpl_module_buffers(m), &cfg, &ddp) < 0)
        die("ddp_create");
    kpl_tensor *x = NULL, *y = NULL;
    make_batch(batch, 32, 10, &x, &y);
    for (int w = 0; w < 2; w++) train_step(m, ddp, opt, x, y, true, NULL); /* warm up, rebuild */

    kpl_bucketer *b = kpl_ddp_bucketer(ddp);
    /* A step's round-to-round noise (tens of ms) exceeds the allreduce
     * (~15 ms): pair each step with one without communication next to it,
     * and take more rounds than the other cases. */
    int nr = rounds < 9 ? 9 : rounds;
    double with[64], without[64], diff[64], alone[64], hidden_wait[64];
    for (int round = 0; round < nr; round++) {
        for (int s = 0; s < 2; s++) {
            bool sync = (s + round) % 2 == 0;
            kpl_bucketer_reset_stats(b);
            double ms = train_step(m, ddp, opt, x, y, sync, NULL);
            if (sync) {
                kpl_bucketer_stats st = kpl_bucketer_get_stats(b);
                with[round] = ms;
                hidden_wait[round] = st.comm_seconds > 0 ? 1 - st.wait_seconds / st.comm_seconds : NAN;
            } else {
                without[round] = ms;
            }
        }
        /* The same buckets reduced with nothing to hide behind. */
        if (kpl_ddp_begin(ddp, true) < 0) die("ddp_begin");
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = kpl_module_num_params(m) - 1; i >= 0; i--)
            if (kpl_bucketer_mark_ready(b, i) < 0) die("mark_ready");
        if (kpl_bucketer_finish(b) < 0) die("bucketer_finish");
        alone[round] = slowest(t0) * 1e3;
        diff[round] = with[round] - without[round];
        kpl_zero_grad(kpl_module_num_params(m), kpl_module_params(m));
    }
    if (rank == 0) {
        double tw = bench_median(with, nr), tn = bench_median(without, nr);
        double ta = bench_median(alone, nr), hw = bench_median(hidden_wait, nr);
        double exposed = bench_median(diff, nr);
        double hidden = 1 - exposed / ta;
        char n1[BENCH_NUM_LEN], n2[BENCH_NUM_LEN], r1[BENCH_RANGE_LEN], r2[BENCH_RANGE_LEN],
            r3[BENCH_RANGE_LEN], r4[BENCH_RANGE_LEN];
        char cas[96];
        snprintf(cas, sizeof cas, "overlap/resnet18_cifar_b%lld/%s/np%d", (long long)batch,
                 transport, nranks);
        bench_emit("comm", cas, "fraction hidden", 1, hidden, NAN, NULL, 0.6,
                   ",\"step_ms\":%.1f,\"step_ms_no_comm\":%.1f,\"exposed_ms\":%.2f,"
                   "\"allreduce_ms_alone\":%.2f,\"hidden_by_wait\":%s,\"grad_mb\":%s,"
                   "\"rounds\":%d,\"step_range\":%s,\"no_comm_range\":%s,\"exposed_range\":%s,"
                   "\"alone_range\":%s",
                   tw, tn, exposed, ta, bench_jnum(n1, hw),
                   bench_jnum(n2, (double)kpl_module_param_count(m) * 4 / 1048576.0), nr,
                   bench_jrange(r1, with, nr), bench_jrange(r2, without, nr),
                   bench_jrange(r4, diff, nr), bench_jrange(r3, alone, nr));
    }
    kpl_tensor_release(x);
    kpl_tensor_release(y);
    kpl_ddp_destroy(ddp);
    kpl_optim_destroy(opt);
    kpl_module_destroy(m);
}

/* ---- scale: data parallelism over a (simulated) link ------------------------------- */

/* The ways the scale case reduces gradients. */
typedef struct {
    const char *name;
    double bucket_mb; /* 0: per tensor */
    bool after_backward;
    kpl_dtype grad_dtype;
} scale_config;

static const scale_config scale_configs[] = {
    {"bucketed", 25, false, KPL_F32},        /* kpl's defaults */
    {"after_backward", 25, true, KPL_F32},   /* no overlap */
    {"per_tensor", 0, false, KPL_F32},       /* one allreduce per gradient, overlapped */
    {"bf16", 25, false, KPL_BF16},           /* defaults, gradients summed in bf16 */
};
enum { NCONF = sizeof scale_configs / sizeof *scale_configs };

typedef struct {
    kpl_module *m;
    kpl_optim *opt;
    kpl_ddp *ddp;
} scale_model;

static void scale_model_make(scale_model *sm, kpl_comm *comm, const char *preset, int64_t classes,
                             const scale_config *c)
{
    if (bench_zoo(preset, classes, kpl_device_cpu(), 7, &sm->m) < 0) die(preset);
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    oc.lr = 0.01;
    oc.momentum = 0.9;
    if (kpl_optim_create(&oc, kpl_module_num_params(sm->m), kpl_module_params(sm->m), NULL,
                         &sm->opt) < 0)
        die("sgd");
    kpl_bucketer_config cfg = KPL_BUCKETER_CONFIG_INIT;
    cfg.check_params = false; /* steps without communication let the ranks drift */
    cfg.bucket_mb = cfg.first_bucket_mb = c->bucket_mb;
    if (c->bucket_mb > 0) cfg.first_bucket_mb = 1;
    cfg.after_backward = c->after_backward;
    cfg.grad_dtype = c->grad_dtype;
    if (kpl_ddp_create(comm, kpl_module_num_params(sm->m), kpl_module_params(sm->m),
                       kpl_module_num_buffers(sm->m), kpl_module_buffers(sm->m), &cfg,
                       &sm->ddp) < 0)
        die("ddp_create");
}

static void scale_model_free(scale_model *sm)
{
    kpl_ddp_destroy(sm->ddp);
    kpl_optim_destroy(sm->opt);
    kpl_module_destroy(sm->m);
}

static double scale_step(scale_model *sm, kpl_tensor *x, kpl_tensor *y, bool sync, double *bwd_ms)
{
    return train_step(sm->m, sm->ddp, sm->opt, x, y, sync, bwd_ms);
}

/* The model's gradients reduced as configured, with no computation: every
 * gradient marked ready in backward order at once, then finish. */
static double scale_allreduce_alone(scale_model *sm)
{
    if (kpl_ddp_begin(sm->ddp, true) < 0) die("ddp_begin");
    kpl_bucketer *b = kpl_ddp_bucketer(sm->ddp);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = kpl_module_num_params(sm->m) - 1; i >= 0; i--)
        if (kpl_bucketer_mark_ready(b, i) < 0) die("mark_ready");
    if (kpl_bucketer_finish(b) < 0) die("bucketer_finish");
    double ms = slowest(t0) * 1e3;
    kpl_zero_grad(kpl_module_num_params(sm->m), kpl_module_params(sm->m));
    return ms;
}

/* One model on the link: a step of each configuration, a step without
 * communication (one rank's work: the 1-rank figure of weak scaling), and
 * each configuration's allreduce alone, alternating over the rounds.  Per
 * configuration:
 *   efficiency = step without communication / step        (scaling factor)
 *   exposed    = step - step without communication
 *   ideal      = max(0, allreduce alone - backward)   (perfect overlap)
 *   hidden     = 1 - exposed / allreduce alone
 * The row's ratio is (step without communication + ideal) / step: 1 when
 * the step is as short as perfect overlap allows; target 1/1.1 (the step
 * at most 10% above that bound). */
static void scale_case(kpl_comm *comm, const char *preset, int64_t classes, int64_t batch,
                       int64_t hw, const char *link)
{
    scale_model sm[NCONF];
    for (int k = 0; k < NCONF; k++) scale_model_make(&sm[k], comm, preset, classes, &scale_configs[k]);
    kpl_tensor *x = NULL, *y = NULL;
    make_batch(batch, hw, classes, &x, &y);
    for (int k = 0; k < NCONF; k++) /* warm up; the first finish rebuilds the buckets */
        for (int w = 0; w < 2; w++) scale_step(&sm[k], x, y, true, NULL);
    int nr = rounds;
    double step[NCONF][64], alone[NCONF][64], exposed[NCONF][64], one[64], bwd[64];
    int nb[NCONF];
    for (int round = 0; round < nr; round++) {
        /* NCONF + 1 steps in an order that turns every round */
        for (int s0 = 0; s0 <= NCONF; s0++) {
            int s = (s0 + round) % (NCONF + 1);
            if (s == NCONF) one[round] = scale_step(&sm[0], x, y, false, &bwd[round]);
            else step[s][round] = scale_step(&sm[s], x, y, true, NULL);
        }
        for (int k = 0; k < NCONF; k++) {
            alone[k][round] = scale_allreduce_alone(&sm[k]);
            exposed[k][round] = step[k][round] - one[round];
        }
    }
    for (int k = 0; k < NCONF; k++) nb[k] = kpl_bucketer_num_buckets(kpl_ddp_bucketer(sm[k].ddp));
    if (rank == 0) {
        double t1 = bench_median(one, nr), tb = bench_median(bwd, nr);
        double grad_mb = (double)kpl_module_param_count(sm[0].m) * 4 / 1048576.0;
        double med_step[NCONF], med_alone[NCONF];
        for (int k = 0; k < NCONF; k++) {
            double ts = bench_median(step[k], nr), ta = bench_median(alone[k], nr);
            double ex = bench_median(exposed[k], nr);
            double ideal = ta - tb > 0 ? ta - tb : 0;
            med_step[k] = ts, med_alone[k] = ta;
            char cas[160], rs[BENCH_RANGE_LEN], ra[BENCH_RANGE_LEN], r1[BENCH_RANGE_LEN],
                rb[BENCH_RANGE_LEN], n1[BENCH_NUM_LEN];
            snprintf(cas, sizeof cas, "scale/%s_b%lld/%s/%s/%dx1", preset, (long long)batch,
                     scale_configs[k].name, link, nranks);
            /* kpl: the scaling factor; ref: the factor perfect overlap gives */
            bench_emit("comm", cas, "scaling efficiency", 1, t1 / ts, t1 / (t1 + ideal),
                       "perfect overlap: max(0, allreduce - backward) exposed", 1 / 1.1,
                       ",\"link\":\"%s\",\"step_ms\":%.1f,\"step_ms_1rank\":%.1f,"
                       "\"backward_ms\":%.1f,\"allreduce_ms_alone\":%.1f,\"exposed_ms\":%.1f,"
                       "\"ideal_exposed_ms\":%.1f,\"excess_ms\":%.1f,\"hidden\":%s,"
                       "\"grad_mb\":%.1f,\"grad_dtype\":\"%s\",\"buckets\":%d,\"rounds\":%d,"
                       "\"step_range\":%s,\"step_1rank_range\":%s,\"alone_range\":%s,"
                       "\"backward_range\":%s",
                       link, ts, t1, tb, ta, ex, ideal, ex - ideal,
                       bench_jnum(n1, ta > 0 ? 1 - ex / ta : NAN), grad_mb,
                       kpl_dtype_name(scale_configs[k].grad_dtype), nb[k], nr,
                       bench_jrange(rs, step[k], nr), bench_jrange(r1, one, nr),
                       bench_jrange(ra, alone[k], nr), bench_jrange(rb, bwd, nr));
        }
        /* bucketed against per tensor, in step time; the 1.5x target where
         * communication dominates (the per-tensor allreduce alone takes
         * longer than the backward it could hide behind) */
        char cas[160];
        snprintf(cas, sizeof cas, "scale/%s_b%lld/bucketed_vs_per_tensor/%s/%dx1", preset,
                 (long long)batch, link, nranks);
        bool dominates = med_alone[2] > tb;
        bench_emit("comm", cas, "ms/step", 0, med_step[0], med_step[2], "per-tensor allreduce",
                   dominates ? 1.5 : NAN,
                   ",\"link\":\"%s\",\"comm_dominates\":%s,\"allreduce_ms_bucketed\":%.1f,"
                   "\"allreduce_ms_per_tensor\":%.1f,\"backward_ms\":%.1f",
                   link, dominates ? "true" : "false", med_alone[0], med_alone[2], tb);
    }
    kpl_tensor_release(x);
    kpl_tensor_release(y);
    for (int k = 0; k < NCONF; k++) scale_model_free(&sm[k]);
}

/* ---- hier: the hierarchical allreduce against the flat one -------------------------- */

/* busbw of the mpi backend's allreduce with the hierarchy on and off, in
 * one job of several ranks per node; ratio hierarchical / flat, target
 * 1.3 from 16 MB (where the link between the nodes is the bottleneck). */
static void hier_case(const char *link)
{
    kpl_comm_config cf = KPL_COMM_CONFIG_INIT;
    cf.backend = KPL_COMM_BACKEND_MPI;
    cf.hierarchy = KPL_COMM_HIER_ON;
    kpl_comm *h = NULL, *flat = NULL;
    if (kpl_comm_create(&cf, &h) < 0) die("comm_create (hierarchical)");
    cf.hierarchy = KPL_COMM_HIER_OFF;
    if (kpl_comm_create(&cf, &flat) < 0) die("comm_create (flat)");
    int32_t nodes = kpl_comm_hierarchy_nodes(h);
    if (nodes < 2) {
        if (rank == 0)
            fprintf(stderr, "bench_comm hier: the job is on %d node(s) with %d rank(s) each: "
                    "run it on >= 2 nodes of >= 2 ranks (bench/cluster.sh)\n", (int)(nodes ? nodes : 1),
                    kpl_comm_local_size(h));
        die("no hierarchy");
    }
    for (size_t bytes = (size_t)1 << 20; bytes <= ((size_t)64 << 20); bytes *= 4) {
        int64_t count = (int64_t)(bytes / 4);
        kpl_tensor *t = NULL;
        if (kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &count, &t) < 0) die("tensor");
        int reps = bytes >= ((size_t)16 << 20) ? 2 : 4;
        double th[64], tf[64];
        for (int round = -1; round < rounds; round++) {
            for (int s0 = 0; s0 < 2; s0++) {
                int s = (s0 + (round < 0 ? 0 : round)) % 2;
                kpl_comm *c = s == 0 ? h : flat;
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                for (int i = 0; i < reps; i++)
                    if (kpl_comm_allreduce(c, t, t, KPL_COMM_SUM) < 0) die("allreduce");
                double el = slowest(t0) / reps;
                double bus = 2.0 * (nranks - 1) / nranks * (double)bytes / el / 1e9;
                if (round >= 0) (s == 0 ? th : tf)[round] = bus;
            }
        }
        if (rank == 0) {
            char cas[128], r1[BENCH_RANGE_LEN], r2[BENCH_RANGE_LEN];
            snprintf(cas, sizeof cas, "allreduce_f32/hierarchical_vs_flat/%zuB/%s/%dx%d", bytes,
                     link, (int)nodes, nranks / nodes);
            double hb = bench_median(th, rounds), fb = bench_median(tf, rounds);
            bench_emit("comm", cas, "GB/s busbw", 1, hb, fb, "flat mpi allreduce",
                       bytes >= ((size_t)16 << 20) ? 1.3 : NAN,
                       ",\"link\":\"%s\",\"nodes\":%d,\"ranks_per_node\":%d,\"reps\":%d,"
                       "\"kpl_range\":%s,\"ref_range\":%s",
                       link, (int)nodes, nranks / nodes, reps, bench_jrange(r1, th, rounds),
                       bench_jrange(r2, tf, rounds));
        }
        kpl_tensor_release(t);
    }
    kpl_comm_destroy(h);
    kpl_comm_destroy(flat);
}

int main(int argc, char **argv)
{
    int level;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &level);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    const char *cases = "busbw,r50";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--transport") && i + 1 < argc) transport = argv[++i];
        else if (!strcmp(argv[i], "--cases") && i + 1 < argc) cases = argv[++i];
        else {
            if (rank == 0)
                fprintf(stderr, "usage: bench_comm [--transport shm|tcp|LINK] "
                                "[--cases busbw,r50,overlap,scale18,scale50,hier]\n");
            MPI_Finalize();
            return 2;
        }
    }
    rounds = bench_env_int("KPL_BENCH_ROUNDS", 5, 1, 64);
    kpl_comm *comms[2] = {NULL, NULL};
    const char *names[2] = {"mpi", "ucx"};
    if (strstr(cases, "busbw") || strstr(cases, "r50")) comms[1] = comm_for(KPL_COMM_BACKEND_UCX);
    if (strstr(cases, "busbw") || strstr(cases, "r50") || strstr(cases, "overlap") ||
        strstr(cases, "scale"))
        comms[0] = comm_for(KPL_COMM_BACKEND_MPI);
    if (strstr(cases, "busbw"))
        for (int k = 0; k < 2; k++) busbw(comms[k], names[k]);
    if (strstr(cases, "r50")) r50(comms, names, 2);
    if (strstr(cases, "overlap")) overlap(comms[0]);
    /* transport names the link here: 1gbit, 10gbit, ... (bench/cluster.sh) */
    if (strstr(cases, "scale18")) scale_case(comms[0], "resnet18_cifar", 10, 32, 32, transport);
    if (strstr(cases, "scale50")) scale_case(comms[0], "resnet50", 1000, 8, 224, transport);
    if (strstr(cases, "hier")) hier_case(transport);
    for (int k = 0; k < 2; k++) kpl_comm_destroy(comms[k]);
    MPI_Finalize();
    return bench_exit_code();
}
