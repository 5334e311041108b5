/*
 * comm.c — the backend-independent communicator: MPI bootstrap (ranks,
 * the node-local split, the device), argument checks, and the three ways
 * an operation runs:
 *  - a blocking host operation on an idle queue runs on the caller's
 *    thread (no hand-over: a thread switch costs more than a small
 *    allreduce);
 *  - other host operations queue for the executor thread, in issue order;
 *  - CUDA operations are enqueued on the stream backend at once.
 * The watchdog (watchdog.c) follows all three for timeouts and stalls.
 */
#include "collective_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const char *kpl__coll_kind_name(kpl__coll_kind k)
{
    static const char *n[] = {"allreduce", "broadcast", "allgather", "reduce_scatter",
                              "send", "recv", "barrier"};
    return (unsigned)k < KPL__COLL_KIND_COUNT ? n[k] : "?";
}

bool kpl__coll_is_collective(kpl__coll_kind k)
{
    return k != KPL__COLL_SEND && k != KPL__COLL_RECV;
}

const char *kpl_comm_op_name(kpl_comm_op op)
{
    static const char *n[] = {"sum", "avg", "max", "min"};
    return (unsigned)op < 4 ? n[op] : "?";
}

KPL_ENUM_DEFINE(kpl_comm_backend, KPL_COMM_BACKENDS)
KPL_ENUM_DEFINE(kpl_comm_hierarchy, KPL_COMM_HIERARCHIES)

void kpl__comm_describe(const kpl_comm *c, const kpl__coll_args *a, const char *backend,
                        char *buf, size_t len)
{
    const char *k = kpl__coll_kind_name(a->kind);
    if (a->kind == KPL__COLL_BARRIER)
        snprintf(buf, len, "barrier #%llu on backend %s, rank %d of %d",
                 (unsigned long long)a->seq, backend, (int)c->rank, (int)c->size);
    else if (kpl__coll_is_collective(a->kind))
        snprintf(buf, len, "%s #%llu (%s, %zu elements) on backend %s, rank %d of %d", k,
                 (unsigned long long)a->seq, kpl_dtype_name(a->dtype), a->count, backend,
                 (int)c->rank, (int)c->size);
    else
        snprintf(buf, len, "%s %s rank %d (tag %d, %s, %zu elements) on backend %s, rank %d of %d",
                 k, a->kind == KPL__COLL_SEND ? "to" : "from", (int)a->peer, (int)a->tag,
                 kpl_dtype_name(a->dtype), a->count, backend, (int)c->rank, (int)c->size);
}

void kpl__comm_report(const kpl_comm *c, const char *line)
{
    if (c->report) {
        c->report(line, c->report_user);
        return;
    }
    fprintf(stderr, "kpl[%d] comm: %s\n", (int)c->rank, line);
    fflush(stderr);
}

void kpl__comm_mark_stuck(kpl_comm *c, const char *msg)
{
    if (!c->stuck) {
        snprintf(c->stuck_msg, sizeof c->stuck_msg, "%s", msg);
        c->stuck = true;
    }
    pthread_cond_broadcast(&c->cv_done);
}

/* Status of a failed operation with its description in front of the
 * backend's message; a timeout also breaks the communicator. */
static kpl_status op_failed(kpl_comm *c, const kpl__coll_args *a, const char *backend,
                            kpl_status st, char *msg, size_t len)
{
    char what[256];
    kpl__comm_describe(c, a, backend, what, sizeof what);
    snprintf(msg, len, "%s: %s", what, kpl_last_error());
    if (st == KPL_ETIMEOUT) {
        /* The watchdog's report (who has not joined) says more than the
         * backend's (which peer this rank waited for): lead with it. */
        pthread_mutex_lock(&c->mu);
        if (c->stuck) {
            char own[1024];
            snprintf(own, sizeof own, "%s", kpl_last_error());
            /* Cut at len when long: the watchdog's part comes first. */
            if (snprintf(msg, len, "%s (%s: %s)", c->stuck_msg, backend, own) >= (int)len)
                msg[len - 1] = '\0';
        }
        kpl__comm_mark_stuck(c, msg);
        pthread_mutex_unlock(&c->mu);
    }
    return st;
}

/* ---- the executor --------------------------------------------------------------------- */

static void *executor_main(void *arg)
{
    kpl_comm *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        /* A direct call on the caller's thread goes first: it was issued
         * while nothing was queued. */
        while (c->run.started > 0 || (!c->head && !c->stop))
            pthread_cond_wait(&c->cv_queue, &c->mu);
        kpl_comm_work *w = c->head;
        if (!w) break; /* stopping with nothing queued */
        c->head = w->next;
        if (!c->head) c->tail = NULL;
        double now = kpl_seconds();
        c->run = (kpl__comm_running){w->a, now, false};
        pthread_mutex_unlock(&c->mu);

        kpl_status st = c->host.be->run(c->host.state, &w->a, now + c->timeout + KPL__COMM_BACKEND_SLACK);
        if (st < 0) st = op_failed(c, &w->a, c->host.be->name, st, w->msg, sizeof w->msg);
        double ran = kpl_seconds() - now;

        pthread_mutex_lock(&c->mu);
        w->started = now;
        w->ran = ran;
        c->run.started = 0;
        if (kpl__coll_is_collective(w->a.kind)) {
            c->host_done++;
            c->host_done_at = kpl_seconds();
        }
        w->st = st;
        w->done = true;
        pthread_cond_broadcast(&c->cv_done);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- create / destroy ----------------------------------------------------------------- */

kpl_status kpl__comm_mpi_error(int err, const char *fmt, ...)
{
    char what[512], text[MPI_MAX_ERROR_STRING];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    int n = 0;
    if (MPI_Error_string(err, text, &n) != MPI_SUCCESS) snprintf(text, sizeof text, "error %d", err);
    return KPL_ERROR(KPL_ECOMM, "%s: %s", what, text);
}

static kpl_status mpi_failed(int err, const char *what)
{
    return kpl__comm_mpi_error(err, "comm_create: %s", what);
}

static kpl_status slot_init(kpl_comm *c, kpl__comm_slot *s, const kpl__comm_backend *be,
                            MPI_Comm world)
{
    int err = MPI_Comm_dup(world, &s->mpi);
    if (err != MPI_SUCCESS) return mpi_failed(err, "MPI_Comm_dup");
    MPI_Comm_set_errhandler(s->mpi, MPI_ERRORS_RETURN);
    s->be = be;
    kpl__comm_boot boot = {s->mpi,     c->rank,    c->size,      c->local_rank, c->local_size,
                           c->device,  c->timeout, c->hierarchy, c->node_ranks};
    return be->init(&boot, &s->state);
}

static void slot_fini(kpl__comm_slot *s)
{
    if (s->be) s->be->fini(s->state);
    if (s->mpi != MPI_COMM_NULL) MPI_Comm_free(&s->mpi);
    s->be = NULL;
    s->state = NULL;
}

/* The device a rank uses: cfg.device, or one GPU per node-local rank. */
static kpl_status pick_device(kpl_comm *c, const char *name)
{
    if (name) return kpl_device_get(name, &c->device);
    int gpus = kpl_device_count(KPL_DEVICE_CUDA);
    if (gpus <= 0) {
        c->device = kpl_device_cpu();
        return KPL_OK;
    }
    char n[32];
    snprintf(n, sizeof n, "cuda:%d", (int)(c->local_rank % gpus));
    return kpl_device_get(n, &c->device);
}

/* Appends rank r to buf's ", "-separated list, ending it with "..." once
 * the buffer is nearly full. */
static void list_rank(char *buf, size_t len, int32_t r)
{
    size_t at = strlen(buf);
    if (at + 16 >= len) {
        if (at + 4 < len && strcmp(buf + at - 3, "...")) snprintf(buf + at, len - at, "...");
        return;
    }
    snprintf(buf + at, len - at, "%s%d", at ? ", " : "", (int)r);
}

/* Ranks on the node of all[a]. */
static int node_ranks(const kpl__comm_rank_device *all, int32_t size, int32_t a)
{
    int n = 0;
    for (int32_t r = 0; r < size; r++) n += all[r].node == all[a].node;
    return n;
}

kpl_status kpl__comm_check_devices(const kpl__comm_rank_device *all, int32_t size,
                                   kpl_comm_backend backend)
{
    char failed[192] = "", on_cpu[192] = "", on_gpu[192] = "";
    for (int32_t r = 0; r < size; r++) {
        if (all[r].kind < 0) list_rank(failed, sizeof failed, r);
        else if (all[r].kind == KPL_DEVICE_CUDA) list_rank(on_gpu, sizeof on_gpu, r);
        else list_rank(on_cpu, sizeof on_cpu, r);
    }
    KPL_CHECK(!failed[0], KPL_EDEVICE, "comm_create: rank(s) %s could not open their device "
              "(each one's own error says why), so every rank gives up", failed);
    KPL_CHECK(!on_gpu[0] || !on_cpu[0], KPL_EDEVICE,
              "comm_create: the ranks would run on different kinds of device: rank(s) %s on "
              "cuda, rank(s) %s on cpu; every rank must use the same kind (a rank on the CPU "
              "where GPUs were meant: CUDA failed to start on its node, and `kpl info` there "
              "says why; or the ranks were given different devices)", on_gpu, on_cpu);
    KPL_CHECK(backend != KPL_COMM_BACKEND_NCCL || on_gpu[0], KPL_EDEVICE,
              "comm_create: backend nccl needs a CUDA device on every rank; the ranks run on "
              "cpu");
    if (!on_gpu[0] || (backend != KPL_COMM_BACKEND_AUTO && backend != KPL_COMM_BACKEND_NCCL))
        return KPL_OK;
    for (int32_t a = 0; a < size; a++)
        for (int32_t b = a + 1; b < size; b++) {
            if (all[a].node != all[b].node || !all[a].gpu_id[0] ||
                strncmp(all[a].gpu_id, all[b].gpu_id, sizeof all[a].gpu_id))
                continue;
            return KPL_ERROR(KPL_EDEVICE, "comm_create: NCCL needs a GPU of its own for every "
                             "rank, but ranks %d and %d would share the GPU at PCI %.32s "
                             "(cuda:%d and cuda:%d): their node runs %d ranks on the %d GPU(s) "
                             "rank %d sees.  NCCL does not support two ranks on one GPU (it may "
                             "hang): start at most one rank per GPU on each node, or make "
                             "more GPUs visible (CUDA_VISIBLE_DEVICES)", (int)a, (int)b,
                             all[a].gpu_id, (int)all[a].index, (int)all[b].index,
                             node_ranks(all, size, a), (int)all[a].gpus, (int)a);
        }
    return KPL_OK;
}

/* This rank's part of the agreement: its device (or its failure to open
 * one, `mine`) and, when NCCL is to drive its GPU, which GPU that is. */
static kpl_status describe_device(kpl_comm *c, kpl_comm_backend backend, kpl_status mine,
                                  int32_t node, kpl__comm_rank_device *me)
{
    memset(me, 0, sizeof *me);
    me->node = node;
    me->gpus = kpl_device_count(KPL_DEVICE_CUDA);
    me->kind = mine < 0 ? -1 : (int32_t)kpl_device_type_of(c->device);
    if (me->kind != KPL_DEVICE_CUDA) return mine;
    me->index = kpl_device_index(c->device);
    if (backend != KPL_COMM_BACKEND_AUTO && backend != KPL_COMM_BACKEND_NCCL) return KPL_OK;
    const kpl__comm_backend *nccl = kpl__comm_nccl_backend();
    if (!nccl || !nccl->device_id) return KPL_OK; /* set-up fails alike on every rank */
    kpl_status st = nccl->device_id(c->device, me->gpu_id, sizeof me->gpu_id);
    if (st < 0) me->kind = -1;
    return st;
}

/* Every rank learns every rank's device before any backend starts: a
 * rank whose device failed (a CUDA start-up error), a rank on the CPU
 * among GPU ranks, or two ranks on one GPU under NCCL fail the create on
 * every rank, instead of leaving some in a backend's collective set-up
 * waiting for peers that never come.  `mine` is this rank's own result of
 * opening its device; a rank that failed keeps its own message. */
static kpl_status agree_devices(kpl_comm *c, kpl_comm_backend backend, kpl_status mine,
                                int32_t node)
{
    char own[1024] = "";
    kpl__comm_rank_device me;
    mine = describe_device(c, backend, mine, node, &me);
    if (mine < 0) snprintf(own, sizeof own, "%s", kpl_last_error());
    kpl__comm_rank_device *all = calloc((size_t)c->size, sizeof *all);
    int ok = all != NULL, all_ok = 0;
    /* Even without memory for the table every rank takes both calls. */
    int err = MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, c->insp);
    if (err == MPI_SUCCESS && all_ok)
        err = MPI_Allgather(&me, (int)sizeof me, MPI_BYTE, all, (int)sizeof me, MPI_BYTE,
                            c->insp);
    kpl_status st = err != MPI_SUCCESS ? mpi_failed(err, "the device agreement (MPI_Allgather)")
                    : !all_ok ? KPL_ERROR(KPL_ENOMEM, "comm_create: no memory for the device "
                                          "table of %d ranks (on this rank or another)",
                                          (int)c->size)
                              : kpl__comm_check_devices(all, c->size, backend);
    free(all);
    if (mine < 0) return kpl_set_error(mine, "%s", own); /* as it was, location included */
    return st;
}

kpl_status kpl_comm_create(const kpl_comm_config *cfg, kpl_comm **out)
{
    KPL_CHECK(out, KPL_EINVAL, "comm_create: NULL argument");
    *out = NULL;
    kpl_comm_config cf = KPL_COMM_CONFIG_INIT;
    if (cfg) cf = *cfg;
    KPL_CHECK(cf.timeout > 0, KPL_EINVAL, "comm_create: timeout %g s must be > 0", cf.timeout);
    KPL_CHECK(cf.stall_warning >= 0, KPL_EINVAL,
              "comm_create: stall_warning %g s must be >= 0 (0: off)", cf.stall_warning);
    KPL_CHECK((unsigned)cf.backend <= KPL_COMM_BACKEND_NCCL, KPL_EINVAL,
              "comm_create: unknown backend %d", (int)cf.backend);
    KPL_CHECK((unsigned)cf.hierarchy <= KPL_COMM_HIER_ON, KPL_EINVAL,
              "comm_create: unknown hierarchy %d", (int)cf.hierarchy);
    KPL_CHECK(cf.node_ranks >= 0, KPL_EINVAL, "comm_create: node_ranks %d must be >= 0 (0: the "
              "ranks sharing memory)", (int)cf.node_ranks);

    int inited = 0, level = 0;
    bool finalize = false;
    MPI_Initialized(&inited);
    if (!inited) {
        int err = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &level);
        if (err != MPI_SUCCESS) return mpi_failed(err, "MPI_Init_thread");
        finalize = true;
    } else {
        MPI_Query_thread(&level);
    }
    /* Blocking calls run on the caller's thread, queued ones on the
     * executor: never at once, but from two threads. */
    KPL_CHECK(level >= MPI_THREAD_SERIALIZED, KPL_EBACKEND,
              "comm_create: MPI runs at thread level %d; kpl calls MPI from its "
              "communication thread and needs MPI_THREAD_SERIALIZED or, for the stall "
              "inspector, MPI_THREAD_MULTIPLE (MPI_Init_thread)", level);

    kpl_comm *c = calloc(1, sizeof *c);
    KPL_CHECK(c, KPL_ENOMEM, "comm_create: no memory");
    c->finalize_mpi = finalize;
    c->inspect = level >= MPI_THREAD_MULTIPLE;
    c->timeout = cf.timeout;
    c->hierarchy = cf.hierarchy;
    c->node_ranks = cf.node_ranks;
    c->stall_warning = cf.stall_warning;
    c->report = cf.report;
    c->report_user = cf.report_user;
    c->insp = c->host.mpi = c->dev.mpi = MPI_COMM_NULL;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv_queue, NULL);
    pthread_cond_init(&c->cv_done, NULL);
    pthread_cond_init(&c->cv_watch, NULL);
    c->host_done_at = kpl_seconds();

    kpl_status st = KPL_OK;
    int err = MPI_Comm_dup(MPI_COMM_WORLD, &c->insp);
    if (err != MPI_SUCCESS) {
        st = mpi_failed(err, "MPI_Comm_dup");
        goto fail;
    }
    MPI_Comm_set_errhandler(c->insp, MPI_ERRORS_RETURN);
    int r, s, lr, ls;
    MPI_Comm_rank(c->insp, &r);
    MPI_Comm_size(c->insp, &s);
    MPI_Comm local;
    err = MPI_Comm_split_type(c->insp, MPI_COMM_TYPE_SHARED, r, MPI_INFO_NULL, &local);
    if (err != MPI_SUCCESS) {
        st = mpi_failed(err, "MPI_Comm_split_type");
        goto fail;
    }
    MPI_Comm_rank(local, &lr);
    MPI_Comm_size(local, &ls);
    int node = r;
    err = MPI_Allreduce(&r, &node, 1, MPI_INT, MPI_MIN, local);
    MPI_Comm_free(&local);
    if (err != MPI_SUCCESS) {
        st = mpi_failed(err, "MPI_Allreduce over the node's ranks");
        goto fail;
    }
    c->rank = r;
    c->size = s;
    c->local_rank = lr;
    c->local_size = ls;
    /* Every rank's host name, so that a report of a rank that does not
     * answer says where it is (a node whose link went down). */
    c->hosts = calloc((size_t)s, sizeof *c->hosts);
    if (!c->hosts) {
        st = KPL_ERROR(KPL_ENOMEM, "comm_create: no memory for %d host names", s);
        goto fail;
    }
    char me[KPL__COMM_HOST_LEN] = "";
    if (gethostname(me, sizeof me - 1) != 0) snprintf(me, sizeof me, "?");
    err = MPI_Allgather(me, KPL__COMM_HOST_LEN, MPI_CHAR, c->hosts, KPL__COMM_HOST_LEN, MPI_CHAR,
                        c->insp);
    if (err != MPI_SUCCESS) {
        st = mpi_failed(err, "MPI_Allgather of the host names");
        goto fail;
    }
    for (int i = 0; i < s; i++) c->hosts[i][KPL__COMM_HOST_LEN - 1] = '\0';
    KPL_TRY_GOTO(agree_devices(c, cf.backend, pick_device(c, cf.device), node));
    bool on_gpu = kpl_device_type_of(c->device) == KPL_DEVICE_CUDA;

    /* Every rank takes the same path through the collective inits: they
     * agree on the kind of device (agree_devices). */
    const kpl__comm_backend *host =
        cf.backend == KPL_COMM_BACKEND_UCX ? kpl__comm_ucx_backend() : kpl__comm_mpi_backend();
    KPL_TRY_GOTO(slot_init(c, &c->host, host, MPI_COMM_WORLD));
    if (on_gpu && (cf.backend == KPL_COMM_BACKEND_AUTO || cf.backend == KPL_COMM_BACKEND_NCCL)) {
        const kpl__comm_backend *nccl = kpl__comm_nccl_backend();
        if (!nccl) {
            st = kpl_last_status();
            goto fail;
        }
        KPL_TRY_GOTO(slot_init(c, &c->dev, nccl, MPI_COMM_WORLD));
    }

    if (pthread_create(&c->executor, NULL, executor_main, c) != 0) {
        st = KPL_ERROR(KPL_ENOMEM, "comm_create: cannot start the communication thread");
        goto fail;
    }
    c->executor_live = true;
    KPL_TRY_GOTO(kpl__comm_watchdog_start(c));
    *out = c;
    return KPL_OK;
fail:
    kpl_comm_destroy(c);
    return st;
}

void kpl_comm_destroy(kpl_comm *c)
{
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    bool stuck = c->stuck;
    pthread_mutex_unlock(&c->mu);
    if (stuck) {
        /* A thread may be inside a library call that never returns, and
         * the peers are out of step: leave everything (the job is ending,
         * kpl_comm_abort). */
        return;
    }
    if (c->executor_live) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->cv_queue);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->executor, NULL);
    }
    /* Stream work still in flight belongs to work handles the caller has
     * not destroyed; the stream backend's fini waits for its stream. */
    kpl__comm_watchdog_stop(c);
    slot_fini(&c->dev);
    slot_fini(&c->host);
    if (c->insp != MPI_COMM_NULL) MPI_Comm_free(&c->insp);
    if (c->finalize_mpi) MPI_Finalize();
    free(c->hosts);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv_queue);
    pthread_cond_destroy(&c->cv_done);
    pthread_cond_destroy(&c->cv_watch);
    free(c);
}

void kpl_comm_abort(kpl_comm *c, int code)
{
    if (c && c->dev.be && c->dev.be->cancel) c->dev.be->cancel(c->dev.state);
    if (c && c->host.be && c->host.be->cancel) c->host.be->cancel(c->host.state);
    MPI_Abort(MPI_COMM_WORLD, code);
    abort(); /* MPI_Abort does not return; if it did, still end */
}

int32_t kpl_comm_rank(const kpl_comm *c) { return c->rank; }
int32_t kpl_comm_size(const kpl_comm *c) { return c->size; }
int32_t kpl_comm_local_rank(const kpl_comm *c) { return c->local_rank; }
int32_t kpl_comm_local_size(const kpl_comm *c) { return c->local_size; }

int32_t kpl_comm_hierarchy_nodes(const kpl_comm *c)
{
    const kpl__comm_slot *s = &c->host;
    return s->be && s->be->hierarchy_nodes ? s->be->hierarchy_nodes(s->state) : 0;
}
kpl_device *kpl_comm_device(const kpl_comm *c) { return c->device; }

const char *kpl_comm_backend_for(const kpl_comm *c, kpl_device_type type)
{
    const kpl__comm_slot *s = type == KPL_DEVICE_CPU ? &c->host : &c->dev;
    return s->be ? s->be->name : NULL;
}

/* ---- checks ------------------------------------------------------------------------- */

/* The slot that takes tensor t (and u, when given, on the same device). */
static kpl_status slot_for(kpl_comm *c, const char *op, kpl_tensor *t, kpl_tensor *u,
                           const kpl__comm_slot **out)
{
    KPL_CHECK(t, KPL_EINVAL, "%s: NULL tensor", op);
    kpl_device *d = kpl_tensor_device(t);
    if (u) {
        KPL_CHECK(kpl_tensor_device(u) == d, KPL_EDEVICE, "%s: in is on %s, out on %s", op,
                  kpl_device_name(d), kpl_device_name(kpl_tensor_device(u)));
    }
    if (kpl_device_type_of(d) == KPL_DEVICE_CPU) {
        *out = &c->host;
        return KPL_OK;
    }
    KPL_CHECK(c->dev.be, KPL_EDEVICE,
              "%s: the tensor is on %s, and backend %s takes host tensors only", op,
              kpl_device_name(d), c->host.be->name);
    KPL_CHECK(d == c->device, KPL_EDEVICE, "%s: the tensor is on %s; this rank's "
              "communicator works on %s", op, kpl_device_name(d), kpl_device_name(c->device));
    *out = &c->dev;
    return KPL_OK;
}

static kpl_status check_reducible(const char *op, kpl_dtype dt)
{
    KPL_CHECK(dt == KPL_F32 || dt == KPL_F64 || dt == KPL_F16 || dt == KPL_BF16 ||
                  dt == KPL_I32 || dt == KPL_I64,
              KPL_EDTYPE, "%s: cannot reduce %s tensors", op, kpl_dtype_name(dt));
    return KPL_OK;
}

/* Device (or host, for host tensors) pointers of the operation. */
static const void *data_of(const kpl__comm_slot *s, kpl_tensor *t)
{
    return s->be->run ? kpl_tensor_host_data(t) : kpl_tensor_data(t);
}

static void *mutable_of(const kpl__comm_slot *s, kpl_tensor *t)
{
    return s->be->run ? kpl_tensor_host_mutable(t) : kpl_tensor_mutable(t);
}

/* ---- running operations --------------------------------------------------------------- */

static kpl_status stuck_error(kpl_comm *c)
{
    char m[sizeof c->stuck_msg];
    snprintf(m, sizeof m, "%s", c->stuck_msg);
    return KPL_ERROR(KPL_ETIMEOUT, "%s", m);
}

static kpl_comm_work *new_work(kpl_comm *c, const kpl__comm_slot *s, const kpl__coll_args *a,
                               kpl_tensor *t0, kpl_tensor *t1)
{
    kpl_comm_work *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->a = *a;
    w->slot = s;
    w->comm = c;
    w->keep[0] = t0;
    w->keep[1] = t1;
    if (t0) kpl_tensor_retain(t0);
    if (t1) kpl_tensor_retain(t1);
    w->issued = kpl_seconds();
    return w;
}

/* Frees work that never reached a backend. */
static void free_work(kpl_comm_work *w)
{
    kpl_tensor_release(w->keep[0]);
    kpl_tensor_release(w->keep[1]);
    free(w);
}

/* Stream work whose end cannot be known (the backend failed after
 * accepting it, or the compute stream cannot be made to wait for it): its
 * kernels may still write the tensors, and released tensors go back to
 * the device's caching allocator, which would hand the memory to the next
 * kernel on the compute stream.  So the work's references are kept for
 * the rest of the process (the job is ending: the communicator is broken),
 * and a report line says so. */
static void keep_tensors_forever(kpl_comm *c, kpl_comm_work *w, const char *why)
{
    char what[256], line[768];
    kpl__comm_describe(c, &w->a, w->slot->be->name, what, sizeof what);
    size_t bytes = 0;
    for (int k = 0; k < 2; k++)
        if (w->keep[k]) bytes += kpl_tensor_nbytes(w->keep[k]);
    snprintf(line, sizeof line, "%s: %s, so its tensors (%zu bytes) are kept, never reused",
             what, why, bytes);
    kpl__comm_report(c, line);
    w->keep[0] = w->keep[1] = NULL; /* the references stay taken */
}

/* Whether stream work w has finished on the device, waiting on the host
 * (polling its marker) up to the communicator's timeout: for when the
 * compute stream cannot be ordered after it.  False when that cannot be
 * known: the backend reports a failure (after which a completed marker
 * would not mean completed kernels) or the time ran out. */
static bool stream_work_finished(kpl_comm_work *w)
{
    kpl_comm *c = w->comm;
    double deadline = kpl_seconds() + c->timeout;
    for (unsigned spin = 0;; spin++) {
        pthread_mutex_lock(&c->mu);
        kpl_status st = kpl__comm_stream_poll(w);
        bool done = w->done;
        pthread_mutex_unlock(&c->mu);
        if (st < 0) return false;
        if (done) return true;
        if (kpl_seconds() >= deadline) return false;
        struct timespec ts = {0, spin < 100 ? 100000L : 2000000L}; /* 0.1, later 2 ms */
        nanosleep(&ts, NULL);
    }
}

/* Queues host work for the executor, or enqueues stream work. */
static kpl_status submit(kpl_comm *c, const kpl__comm_slot *s, const kpl__coll_args *a,
                         kpl_tensor *t0, kpl_tensor *t1, kpl_comm_work **out)
{
    kpl_comm_work *w = new_work(c, s, a, t0, t1);
    KPL_CHECK(w, KPL_ENOMEM, "comm: no memory for a work handle");
    bool collective = kpl__coll_is_collective(a->kind);
    pthread_mutex_lock(&c->mu);
    if (c->stuck) {
        kpl_status st = stuck_error(c);
        pthread_mutex_unlock(&c->mu);
        free_work(w);
        return st;
    }
    if (s->be->run) {
        if (collective) w->a.seq = c->host_issued++;
        if (c->tail) c->tail->next = w;
        else c->head = w;
        c->tail = w;
        pthread_cond_signal(&c->cv_queue);
        pthread_mutex_unlock(&c->mu);
        *out = w;
        return KPL_OK;
    }
    if (collective) w->a.seq = c->dev_issued++;
    pthread_mutex_unlock(&c->mu);
    /* The communicator is used by one thread at a time, so enqueues stay
     * in issue order without holding the lock across the library call. */
    bool busy = false;
    kpl_status st = s->be->enqueue(s->state, &w->a, &w->event, &busy);
    if (st < 0) {
        char msg[sizeof w->msg];
        op_failed(c, &w->a, s->be->name, st, msg, sizeof msg);
        if (busy)
            keep_tensors_forever(c, w, "the backend failed after taking the operation and "
                                       "cannot tell whether its kernels still run");
        free_work(w);
        return KPL_ERROR(st, "%s", msg);
    }
    pthread_mutex_lock(&c->mu);
    w->snext = c->streams;
    c->streams = w;
    pthread_mutex_unlock(&c->mu);
    *out = w;
    return KPL_OK;
}

/* A blocking operation: on the caller's thread when the host queue is
 * idle, else queued behind the work in flight. */
static kpl_status run_blocking(kpl_comm *c, const kpl__comm_slot *s, kpl__coll_args *a,
                               kpl_tensor *t0, kpl_tensor *t1)
{
    if (s->be->run) {
        pthread_mutex_lock(&c->mu);
        if (c->stuck) {
            kpl_status st = stuck_error(c);
            pthread_mutex_unlock(&c->mu);
            return st;
        }
        if (!c->head && c->run.started == 0) {
            bool collective = kpl__coll_is_collective(a->kind);
            if (collective) a->seq = c->host_issued++;
            double now = kpl_seconds();
            c->run = (kpl__comm_running){*a, now, true};
            pthread_mutex_unlock(&c->mu);

            kpl_status st = s->be->run(s->state, a, now + c->timeout + KPL__COMM_BACKEND_SLACK);
            char msg[1024];
            if (st < 0) st = op_failed(c, a, s->be->name, st, msg, sizeof msg);

            pthread_mutex_lock(&c->mu);
            c->run.started = 0;
            if (collective) {
                c->host_done++;
                c->host_done_at = kpl_seconds();
            }
            if (c->head) pthread_cond_signal(&c->cv_queue);
            pthread_mutex_unlock(&c->mu);
            return st < 0 ? KPL_ERROR(st, "%s", msg) : KPL_OK;
        }
        pthread_mutex_unlock(&c->mu);
    }
    kpl_comm_work *w = NULL;
    KPL_TRY(submit(c, s, a, t0, t1, &w));
    kpl_status st = kpl_comm_work_wait(w);
    kpl_comm_work_destroy(w);
    return st;
}

kpl_status kpl__comm_stream_poll(kpl_comm_work *w)
{
    if (w->done) return w->st;
    bool done = false;
    kpl_status st = w->slot->be->query(w->slot->state, w->event, &done);
    if (st < 0) { /* a peer failed: the ranks are out of step for good */
        char what[256];
        kpl__comm_describe(w->comm, &w->a, w->slot->be->name, what, sizeof what);
        snprintf(w->msg, sizeof w->msg, "%s: %s", what, kpl_last_error());
        kpl__comm_mark_stuck(w->comm, w->msg);
        w->st = st;
        w->done = true;
    } else if (done) {
        w->done = true;
        w->comm->dev_done++;
    }
    return w->st;
}

kpl_status kpl_comm_work_wait(kpl_comm_work *w)
{
    KPL_CHECK(w, KPL_EINVAL, "comm_work_wait: NULL work");
    kpl_comm *c = w->comm;
    pthread_mutex_lock(&c->mu);
    if (w->event) { /* stream work: order the compute stream, do not wait */
        kpl_status st = w->done ? w->st : KPL_OK;
        bool stuck = c->stuck && !w->done;
        pthread_mutex_unlock(&c->mu);
        if (stuck) return stuck_error(c);
        if (st < 0) return KPL_ERROR(st, "%s", w->msg);
        if (!w->ordered) {
            KPL_TRY(w->slot->be->order(w->slot->state, w->event));
            w->ordered = true;
        }
        return KPL_OK;
    }
    while (!w->done && !c->stuck) pthread_cond_wait(&c->cv_done, &c->mu);
    if (!w->done) {
        kpl_status st = stuck_error(c);
        pthread_mutex_unlock(&c->mu);
        return st;
    }
    pthread_mutex_unlock(&c->mu);
    return w->st < 0 ? KPL_ERROR(w->st, "%s", w->msg) : KPL_OK;
}

kpl_status kpl_comm_work_test(kpl_comm_work *w, bool *done)
{
    KPL_CHECK(w && done, KPL_EINVAL, "comm_work_test: NULL argument");
    kpl_comm *c = w->comm;
    pthread_mutex_lock(&c->mu);
    if (w->event) kpl__comm_stream_poll(w);
    *done = w->done;
    kpl_status st = w->done ? w->st : KPL_OK;
    bool stuck = c->stuck && !w->done;
    pthread_mutex_unlock(&c->mu);
    if (stuck) return stuck_error(c);
    return st < 0 ? KPL_ERROR(st, "%s", w->msg) : KPL_OK;
}

kpl_status kpl_comm_work_times(kpl_comm_work *w, double *issued, double *started, double *ended)
{
    KPL_CHECK(w && issued && started && ended, KPL_EINVAL, "comm_work_times: NULL argument");
    KPL_CHECK(!w->event, KPL_ESTATE, "comm_work_times: CUDA work has no host times");
    pthread_mutex_lock(&w->comm->mu);
    bool done = w->done;
    *issued = w->issued, *started = w->started, *ended = w->started + w->ran;
    pthread_mutex_unlock(&w->comm->mu);
    KPL_CHECK(done, KPL_ESTATE, "comm_work_times: the work has not finished");
    return KPL_OK;
}

double kpl_comm_work_seconds(kpl_comm_work *w)
{
    if (!w || w->event) return -1;
    pthread_mutex_lock(&w->comm->mu);
    double s = w->done ? w->ran : -1;
    pthread_mutex_unlock(&w->comm->mu);
    return s;
}

void kpl_comm_work_destroy(kpl_comm_work *w)
{
    if (!w) return;
    kpl_comm *c = w->comm;
    if (w->event) {
        /* Later users of the memory run on the compute stream: once it
         * waits for the collective, the tensors may go.  If it cannot be
         * made to wait, the host waits for the collective instead; if
         * even that cannot be known, the tensors stay. */
        if (!w->ordered && w->slot->be->order(w->slot->state, w->event) == KPL_OK)
            w->ordered = true;
        if (!w->ordered && !stream_work_finished(w))
            keep_tensors_forever(c, w, "the compute stream could not be ordered after it, nor "
                                       "its end seen on the host");
        pthread_mutex_lock(&c->mu);
        for (kpl_comm_work **p = &c->streams; *p; p = &(*p)->snext)
            if (*p == w) {
                *p = w->snext;
                break;
            }
        pthread_mutex_unlock(&c->mu);
        w->slot->be->event_free(w->slot->state, w->event);
    } else if (w->slot && w->slot->be->run) {
        /* Queued host work reads and writes the tensors until it is done. */
        pthread_mutex_lock(&c->mu);
        while (!w->done && !c->stuck) pthread_cond_wait(&c->cv_done, &c->mu);
        bool done = w->done;
        pthread_mutex_unlock(&c->mu);
        if (!done) return; /* still in the executor's hands: leak it */
    }
    free_work(w);
}

/* ---- the operations ----------------------------------------------------------------- */

static kpl_status allreduce_args(kpl_comm *c, kpl_tensor *in, kpl_tensor *out, kpl_comm_op op,
                                 const kpl__comm_slot **s, kpl__coll_args *a)
{
    KPL_CHECK(c, KPL_EINVAL, "allreduce: NULL comm");
    KPL_TRY(slot_for(c, "allreduce", in, out, s));
    KPL_CHECK((unsigned)op <= KPL_COMM_MIN, KPL_EINVAL, "allreduce: unknown op %d", (int)op);
    KPL_CHECK(kpl_tensor_dtype(in) == kpl_tensor_dtype(out) &&
                  kpl_tensor_numel(in) == kpl_tensor_numel(out),
              KPL_ESHAPE, "allreduce: in (%s, %lld) and out (%s, %lld) differ",
              kpl_dtype_name(kpl_tensor_dtype(in)), (long long)kpl_tensor_numel(in),
              kpl_dtype_name(kpl_tensor_dtype(out)), (long long)kpl_tensor_numel(out));
    KPL_TRY(check_reducible("allreduce", kpl_tensor_dtype(in)));
    *a = (kpl__coll_args){KPL__COLL_ALLREDUCE, data_of(*s, in), mutable_of(*s, out),
                          (size_t)kpl_tensor_numel(in), kpl_tensor_dtype(in), op, 0, 0, 0};
    if (in == out) a->in = a->out;
    return KPL_OK;
}

static kpl_status broadcast_args(kpl_comm *c, kpl_tensor *t, int32_t root,
                                 const kpl__comm_slot **s, kpl__coll_args *a)
{
    KPL_CHECK(c, KPL_EINVAL, "broadcast: NULL comm");
    KPL_TRY(slot_for(c, "broadcast", t, NULL, s));
    KPL_CHECK(root >= 0 && root < c->size, KPL_EINVAL, "broadcast: root %d of %d ranks",
              (int)root, (int)c->size);
    void *p = mutable_of(*s, t);
    *a = (kpl__coll_args){KPL__COLL_BROADCAST, p, p, (size_t)kpl_tensor_numel(t),
                          kpl_tensor_dtype(t), KPL_COMM_SUM, root, 0, 0};
    return KPL_OK;
}

static kpl_status allgather_args(kpl_comm *c, kpl_tensor *in, kpl_tensor *out,
                                 const kpl__comm_slot **s, kpl__coll_args *a)
{
    KPL_CHECK(c, KPL_EINVAL, "allgather: NULL comm");
    KPL_TRY(slot_for(c, "allgather", in, out, s));
    KPL_CHECK(kpl_tensor_dtype(in) == kpl_tensor_dtype(out) &&
                  kpl_tensor_numel(out) == kpl_tensor_numel(in) * c->size,
              KPL_ESHAPE, "allgather: out has %lld elements, want %d x %lld",
              (long long)kpl_tensor_numel(out), (int)c->size, (long long)kpl_tensor_numel(in));
    *a = (kpl__coll_args){KPL__COLL_ALLGATHER, data_of(*s, in), mutable_of(*s, out),
                          (size_t)kpl_tensor_numel(in), kpl_tensor_dtype(in), KPL_COMM_SUM,
                          0, 0, 0};
    return KPL_OK;
}

static kpl_status reduce_scatter_args(kpl_comm *c, kpl_tensor *in, kpl_tensor *out,
                                      kpl_comm_op op, const kpl__comm_slot **s,
                                      kpl__coll_args *a)
{
    KPL_CHECK(c, KPL_EINVAL, "reduce_scatter: NULL comm");
    KPL_TRY(slot_for(c, "reduce_scatter", in, out, s));
    KPL_CHECK((unsigned)op <= KPL_COMM_MIN, KPL_EINVAL, "reduce_scatter: unknown op %d",
              (int)op);
    KPL_CHECK(kpl_tensor_dtype(in) == kpl_tensor_dtype(out) &&
                  kpl_tensor_numel(in) == kpl_tensor_numel(out) * c->size,
              KPL_ESHAPE, "reduce_scatter: in has %lld elements, want %d x %lld (out)",
              (long long)kpl_tensor_numel(in), (int)c->size, (long long)kpl_tensor_numel(out));
    KPL_CHECK(in != out, KPL_EINVAL, "reduce_scatter: in and out must differ");
    KPL_TRY(check_reducible("reduce_scatter", kpl_tensor_dtype(in)));
    *a = (kpl__coll_args){KPL__COLL_REDUCE_SCATTER, data_of(*s, in), mutable_of(*s, out),
                          (size_t)kpl_tensor_numel(out), kpl_tensor_dtype(in), op, 0, 0, 0};
    return KPL_OK;
}

kpl_status kpl_comm_allreduce_async(kpl_comm *c, kpl_tensor *in, kpl_tensor *out,
                                    kpl_comm_op op, kpl_comm_work **work)
{
    KPL_CHECK(work, KPL_EINVAL, "allreduce: NULL work");
    const kpl__comm_slot *s = NULL;
    kpl__coll_args a;
    KPL_TRY(allreduce_args(c, in, out, op, &s, &a));
    return submit(c, s, &a, in, out, work);
}

kpl_status kpl_comm_broadcast_async(kpl_comm *c, kpl_tensor *t, int32_t root,
                                    kpl_comm_work **work)
{
    KPL_CHECK(work, KPL_EINVAL, "broadcast: NULL work");
    const kpl__comm_slot *s = NULL;
    kpl__coll_args a;
    KPL_TRY(broadcast_args(c, t, root, &s, &a));
    return submit(c, s, &a, t, NULL, work);
}

kpl_status kpl_comm_allgather_async(kpl_comm *c, kpl_tensor *in, kpl_tensor *out,
                                    kpl_comm_work **work)
{
    KPL_CHECK(work, KPL_EINVAL, "allgather: NULL work");
    const kpl__comm_slot *s = NULL;
    kpl__coll_args a;
    KPL_TRY(allgather_args(c, in, out, &s, &a));
    return submit(c, s, &a, in, out, work);
}

kpl_status kpl_comm_reduce_scatter_async(kpl_comm *c, kpl_tensor *in, kpl_tensor *out,
                                         kpl_comm_op op, kpl_comm_work **work)
{
    KPL_CHECK(work, KPL_EINVAL, "reduce_scatter: NULL work");
    const kpl__comm_slot *s = NULL;
    kpl__coll_args a;
    KPL_TRY(reduce_scatter_args(c, in, out, op, &s, &a));
    return submit(c, s, &a, in, out, work);
}

kpl_status kpl_comm_allreduce(kpl_comm *c, kpl_tensor *in, kpl_tensor *out, kpl_comm_op op)
{
    const kpl__comm_slot *s = NULL;
    kpl__coll_args a;
    KPL_TRY(allreduce_args(c, in, out, op, &s, &a));
    return run_blocking(c, s, &a, in, out);
}

kpl_status kpl_comm_broadcast(kpl_comm *c, kpl_tensor *t, int32_t root)
{
    const kpl__comm_slot *s = NULL;
    kpl__coll_args a;
    KPL_TRY(broadcast_args(c, t, root, &s, &a));
    return run_blocking(c, s, &a, t, NULL);
}

kpl_status kpl_comm_allgather(kpl_comm *c, kpl_tensor *in, kpl_tensor *out)
{
    const kpl__comm_slot *s = NULL;
    kpl__coll_args a;
    KPL_TRY(allgather_args(c, in, out, &s, &a));
    return run_blocking(c, s, &a, in, out);
}

kpl_status kpl_comm_reduce_scatter(kpl_comm *c, kpl_tensor *in, kpl_tensor *out, kpl_comm_op op)
{
    const kpl__comm_slot *s = NULL;
    kpl__coll_args a;
    KPL_TRY(reduce_scatter_args(c, in, out, op, &s, &a));
    return run_blocking(c, s, &a, in, out);
}

static kpl_status p2p(kpl_comm *c, kpl__coll_kind kind, kpl_tensor *t, int32_t peer, int32_t tag)
{
    const char *op = kpl__coll_kind_name(kind);
    KPL_CHECK(c, KPL_EINVAL, "%s: NULL comm", op);
    const kpl__comm_slot *s = NULL;
    KPL_TRY(slot_for(c, op, t, NULL, &s));
    KPL_CHECK(peer >= 0 && peer < c->size && peer != c->rank, KPL_EINVAL,
              "%s: peer %d (this is rank %d of %d)", op, (int)peer, (int)c->rank, (int)c->size);
    KPL_CHECK(tag >= 0, KPL_EINVAL, "%s: tag %d must be >= 0", op, (int)tag);
    void *p = mutable_of(s, t);
    kpl__coll_args a = {kind, p, p, (size_t)kpl_tensor_numel(t), kpl_tensor_dtype(t),
                        KPL_COMM_SUM, peer, tag, 0};
    return run_blocking(c, s, &a, t, NULL);
}

kpl_status kpl_comm_send(kpl_comm *c, kpl_tensor *t, int32_t peer, int32_t tag)
{
    return p2p(c, KPL__COLL_SEND, t, peer, tag);
}

kpl_status kpl_comm_recv(kpl_comm *c, kpl_tensor *t, int32_t peer, int32_t tag)
{
    return p2p(c, KPL__COLL_RECV, t, peer, tag);
}

kpl_status kpl_comm_barrier(kpl_comm *c)
{
    KPL_CHECK(c, KPL_EINVAL, "barrier: NULL comm");
    kpl__coll_args a = {KPL__COLL_BARRIER, NULL, NULL, 0, KPL_U8, KPL_COMM_SUM, 0, 0, 0};
    return run_blocking(c, &c->host, &a, NULL, NULL);
}
