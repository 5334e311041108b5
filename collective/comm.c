/*
 * comm.c — the backend-independent communicator: argument checks, the
 * queue of work, and the communication thread that runs it in issue order
 * (so every rank runs the same collectives in the same order, and the
 * caller's thread is free to compute meanwhile).
 */
#include "collective_impl.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct kpl_comm_work {
    kpl__coll_args a;
    kpl_comm_op op; /* as asked (AVG included) */
    kpl_tensor *keep[2];
    kpl_status st;
    char msg[768];
    bool done;
    double started; /* when the thread began it (0: still queued) */
    kpl_comm_work *next;
    kpl_comm *comm;
};

struct kpl_comm {
    const kpl__comm_backend *be;
    void *state;
    int32_t rank, size, local_rank, local_size;
    double timeout;
    pthread_t thread;
    bool thread_live;
    pthread_mutex_t mu;
    pthread_cond_t cv_queue, cv_done;
    kpl_comm_work *head, *tail;
    bool stop;
    bool stuck; /* an operation outlived the timeout: the thread may never return */
    char stuck_msg[800];
};

static const char *kind_name(kpl__coll_kind k)
{
    static const char *n[] = {"allreduce", "broadcast", "allgather", "reduce_scatter",
                              "send", "recv", "barrier"};
    return n[k];
}

const char *kpl_comm_op_name(kpl_comm_op op)
{
    static const char *n[] = {"sum", "avg", "max", "min"};
    return (unsigned)op < 4 ? n[op] : "?";
}

const char *kpl_comm_backend_name(kpl_comm_backend b)
{
    static const char *n[] = {"auto", "mpi", "ucx", "nccl"};
    return (unsigned)b < 4 ? n[b] : "?";
}

double kpl__comm_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* out[i] /= n for `count` elements of dtype: the AVG of a SUM. */
static void divide(void *out, size_t count, kpl_dtype dt, int32_t n)
{
    switch (dt) {
    case KPL_F32:
        for (size_t i = 0; i < count; i++) ((float *)out)[i] /= (float)n;
        break;
    case KPL_F64:
        for (size_t i = 0; i < count; i++) ((double *)out)[i] /= n;
        break;
    case KPL_F16:
        for (size_t i = 0; i < count; i++)
            ((uint16_t *)out)[i] = kpl_f32_to_f16(kpl_f16_to_f32(((uint16_t *)out)[i]) / n);
        break;
    case KPL_BF16:
        for (size_t i = 0; i < count; i++)
            ((uint16_t *)out)[i] = kpl_f32_to_bf16(kpl_bf16_to_f32(((uint16_t *)out)[i]) / n);
        break;
    case KPL_I32:
        for (size_t i = 0; i < count; i++) ((int32_t *)out)[i] /= n;
        break;
    case KPL_I64:
        for (size_t i = 0; i < count; i++) ((int64_t *)out)[i] /= n;
        break;
    default:
        break;
    }
}

static void *comm_thread(void *arg)
{
    kpl_comm *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        while (!c->head && !c->stop) pthread_cond_wait(&c->cv_queue, &c->mu);
        kpl_comm_work *w = c->head;
        if (!w) {
            pthread_mutex_unlock(&c->mu);
            return NULL;
        }
        c->head = w->next;
        if (!c->head) c->tail = NULL;
        w->started = kpl__comm_now();
        pthread_mutex_unlock(&c->mu);

        kpl_status st = c->be->run(c->state, &w->a, kpl__comm_now() + c->timeout);
        if (st < 0) {
            snprintf(w->msg, sizeof w->msg, "%s (%s, %zu elements) on backend %s, rank %d of "
                     "%d: %s", kind_name(w->a.kind), kpl_dtype_name(w->a.dtype), w->a.count,
                     c->be->name, (int)c->rank, (int)c->size, kpl_last_error());
        } else if (w->op == KPL_COMM_AVG) {
            divide(w->a.out, w->a.count, w->a.dtype, c->size);
        }
        pthread_mutex_lock(&c->mu);
        w->st = st;
        w->done = true;
        pthread_cond_broadcast(&c->cv_done);
        pthread_mutex_unlock(&c->mu);
    }
}

kpl_status kpl_comm_create(const kpl_comm_config *cfg, kpl_comm **out)
{
    KPL_CHECK(out, KPL_EINVAL, "comm_create: NULL argument");
    *out = NULL;
    kpl_comm_config cf = KPL_COMM_CONFIG_INIT;
    if (cfg) cf = *cfg;
    KPL_CHECK(cf.timeout > 0, KPL_EINVAL, "comm_create: timeout %g s must be > 0", cf.timeout);
    KPL_CHECK(cf.backend == KPL_COMM_BACKEND_AUTO || cf.backend == KPL_COMM_BACKEND_MPI,
              KPL_EBACKEND, "comm_create: backend '%s' is not available in this build",
              kpl_comm_backend_name(cf.backend));
    kpl_comm *c = calloc(1, sizeof *c);
    KPL_CHECK(c, KPL_ENOMEM, "comm_create: no memory");
    c->be = kpl__comm_mpi_backend();
    c->timeout = cf.timeout;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv_queue, NULL);
    pthread_cond_init(&c->cv_done, NULL);
    kpl_status st = c->be->init(&c->state, &c->rank, &c->size, &c->local_rank, &c->local_size);
    if (st < 0) goto fail;
    if (pthread_create(&c->thread, NULL, comm_thread, c) != 0) {
        st = KPL_ERROR(KPL_ENOMEM, "comm_create: cannot start the communication thread");
        goto fail;
    }
    c->thread_live = true;
    *out = c;
    return KPL_OK;
fail:
    kpl_comm_destroy(c);
    return st;
}

void kpl_comm_destroy(kpl_comm *c)
{
    if (!c) return;
    if (c->stuck) {
        /* Its thread is inside a call that may never return: leave it and
         * the backend alone (the job is ending: kpl_comm_abort). */
        return;
    }
    if (c->thread_live) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->cv_queue);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->thread, NULL);
    }
    if (c->state) c->be->fini(c->state);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv_queue);
    pthread_cond_destroy(&c->cv_done);
    free(c);
}

void kpl_comm_abort(kpl_comm *c, int code)
{
    c->be->abort(c->state, code);
}

int32_t kpl_comm_rank(const kpl_comm *c) { return c->rank; }
int32_t kpl_comm_size(const kpl_comm *c) { return c->size; }
int32_t kpl_comm_local_rank(const kpl_comm *c) { return c->local_rank; }
int32_t kpl_comm_local_size(const kpl_comm *c) { return c->local_size; }

/* ---- queueing ---------------------------------------------------------------------- */

static kpl_status check_tensor(const char *op, const char *what, kpl_tensor *t)
{
    KPL_CHECK(t, KPL_EINVAL, "%s: %s is NULL", op, what);
    KPL_CHECK(kpl_device_type_of(kpl_tensor_device(t)) == KPL_DEVICE_CPU, KPL_EDEVICE,
              "%s: %s is on %s; the mpi backend takes host tensors", op, what,
              kpl_device_name(kpl_tensor_device(t)));
    return KPL_OK;
}

static kpl_status check_reducible(const char *op, kpl_dtype dt)
{
    KPL_CHECK(dt == KPL_F32 || dt == KPL_F64 || dt == KPL_F16 || dt == KPL_BF16 ||
                  dt == KPL_I32 || dt == KPL_I64,
              KPL_EDTYPE, "%s: cannot reduce %s tensors", op, kpl_dtype_name(dt));
    return KPL_OK;
}

static kpl_status submit(kpl_comm *c, const kpl__coll_args *a, kpl_comm_op op, kpl_tensor *t0,
                         kpl_tensor *t1, kpl_comm_work **out)
{
    pthread_mutex_lock(&c->mu);
    bool stuck = c->stuck;
    pthread_mutex_unlock(&c->mu);
    KPL_CHECK(!stuck, KPL_ETIMEOUT, "%s", c->stuck_msg); /* written once, before stuck */
    kpl_comm_work *w = calloc(1, sizeof *w);
    KPL_CHECK(w, KPL_ENOMEM, "comm: no memory for a work handle");
    w->a = *a;
    if (w->a.op == KPL_COMM_AVG) w->a.op = KPL_COMM_SUM;
    w->op = op;
    w->comm = c;
    w->keep[0] = t0;
    w->keep[1] = t1;
    if (t0) kpl_tensor_retain(t0);
    if (t1) kpl_tensor_retain(t1);
    pthread_mutex_lock(&c->mu);
    if (c->tail)
        c->tail->next = w;
    else
        c->head = w;
    c->tail = w;
    pthread_cond_signal(&c->cv_queue);
    pthread_mutex_unlock(&c->mu);
    *out = w;
    return KPL_OK;
}

/* Waits for w with the communicator's deadline: an operation running for
 * longer than the timeout (a peer that never joins) is reported, and the
 * communicator is marked stuck (its thread may never come back). */
kpl_status kpl_comm_work_wait(kpl_comm_work *w)
{
    KPL_CHECK(w, KPL_EINVAL, "comm_work_wait: NULL work");
    kpl_comm *c = w->comm;
    pthread_mutex_lock(&c->mu);
    while (!w->done) {
        if (c->stuck) {
            char m[sizeof c->stuck_msg];
            snprintf(m, sizeof m, "%s", c->stuck_msg);
            pthread_mutex_unlock(&c->mu);
            return KPL_ERROR(KPL_ETIMEOUT, "%s", m);
        }
        double now = kpl__comm_now();
        if (w->started > 0 && now > w->started + c->timeout) {
            c->stuck = true;
            snprintf(c->stuck_msg, sizeof c->stuck_msg, "%s (%s, %zu elements) on backend %s, "
                     "rank %d of %d: timed out after %.0f s: a peer did not join (a rank died, "
                     "hangs, or issued other collectives); end the job (kpl_comm_abort)",
                     kind_name(w->a.kind), kpl_dtype_name(w->a.dtype), w->a.count, c->be->name,
                     (int)c->rank, (int)c->size, c->timeout);
            continue;
        }
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 100000000L; /* re-check the deadline every 0.1 s */
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->cv_done, &c->mu, &t);
    }
    pthread_mutex_unlock(&c->mu);
    return w->st < 0 ? KPL_ERROR(w->st, "%s", w->msg) : KPL_OK;
}

kpl_status kpl_comm_work_test(kpl_comm_work *w, bool *done)
{
    KPL_CHECK(w && done, KPL_EINVAL, "comm_work_test: NULL argument");
    pthread_mutex_lock(&w->comm->mu);
    *done = w->done;
    pthread_mutex_unlock(&w->comm->mu);
    return *done && w->st < 0 ? KPL_ERROR(w->st, "%s", w->msg) : KPL_OK;
}

void kpl_comm_work_destroy(kpl_comm_work *w)
{
    if (!w) return;
    if (kpl_comm_work_wait(w) == KPL_ETIMEOUT && !w->done) return; /* still in use */
    kpl_tensor_release(w->keep[0]);
    kpl_tensor_release(w->keep[1]);
    free(w);
}

/* Runs queued work to completion (the blocking forms; st is the submit's
 * status, read before w: argument evaluation order is unspecified). */
static kpl_status finish(kpl_status st, kpl_comm_work *w)
{
    if (st < 0) return st;
    st = kpl_comm_work_wait(w);
    kpl_comm_work_destroy(w);
    return st;
}

/* ---- the operations ----------------------------------------------------------------- */

kpl_status kpl_comm_allreduce_async(kpl_comm *c, kpl_tensor *in, kpl_tensor *out,
                                    kpl_comm_op op, kpl_comm_work **work)
{
    KPL_CHECK(c && work, KPL_EINVAL, "allreduce: NULL argument");
    KPL_TRY(check_tensor("allreduce", "in", in));
    KPL_TRY(check_tensor("allreduce", "out", out));
    KPL_CHECK((unsigned)op <= KPL_COMM_MIN, KPL_EINVAL, "allreduce: unknown op %d", (int)op);
    KPL_CHECK(kpl_tensor_dtype(in) == kpl_tensor_dtype(out) &&
                  kpl_tensor_numel(in) == kpl_tensor_numel(out),
              KPL_ESHAPE, "allreduce: in (%s, %lld) and out (%s, %lld) differ",
              kpl_dtype_name(kpl_tensor_dtype(in)), (long long)kpl_tensor_numel(in),
              kpl_dtype_name(kpl_tensor_dtype(out)), (long long)kpl_tensor_numel(out));
    KPL_TRY(check_reducible("allreduce", kpl_tensor_dtype(in)));
    kpl__coll_args a = {KPL__COLL_ALLREDUCE, kpl_tensor_host_data(in),
                        kpl_tensor_host_mutable(out), (size_t)kpl_tensor_numel(in),
                        kpl_tensor_dtype(in), op, 0, 0};
    return submit(c, &a, op, in, out, work);
}

kpl_status kpl_comm_broadcast_async(kpl_comm *c, kpl_tensor *t, int32_t root,
                                    kpl_comm_work **work)
{
    KPL_CHECK(c && work, KPL_EINVAL, "broadcast: NULL argument");
    KPL_TRY(check_tensor("broadcast", "t", t));
    KPL_CHECK(root >= 0 && root < c->size, KPL_EINVAL, "broadcast: root %d of %d ranks",
              (int)root, (int)c->size);
    void *p = kpl_tensor_host_mutable(t);
    kpl__coll_args a = {KPL__COLL_BROADCAST, p, p, (size_t)kpl_tensor_numel(t),
                        kpl_tensor_dtype(t), KPL_COMM_SUM, root, 0};
    return submit(c, &a, KPL_COMM_SUM, t, NULL, work);
}

kpl_status kpl_comm_allgather_async(kpl_comm *c, kpl_tensor *in, kpl_tensor *out,
                                    kpl_comm_work **work)
{
    KPL_CHECK(c && work, KPL_EINVAL, "allgather: NULL argument");
    KPL_TRY(check_tensor("allgather", "in", in));
    KPL_TRY(check_tensor("allgather", "out", out));
    KPL_CHECK(kpl_tensor_dtype(in) == kpl_tensor_dtype(out) &&
                  kpl_tensor_numel(out) == kpl_tensor_numel(in) * c->size,
              KPL_ESHAPE, "allgather: out has %lld elements, want %d x %lld",
              (long long)kpl_tensor_numel(out), (int)c->size, (long long)kpl_tensor_numel(in));
    kpl__coll_args a = {KPL__COLL_ALLGATHER, kpl_tensor_host_data(in),
                        kpl_tensor_host_mutable(out), (size_t)kpl_tensor_numel(in),
                        kpl_tensor_dtype(in), KPL_COMM_SUM, 0, 0};
    return submit(c, &a, KPL_COMM_SUM, in, out, work);
}

kpl_status kpl_comm_reduce_scatter_async(kpl_comm *c, kpl_tensor *in, kpl_tensor *out,
                                         kpl_comm_op op, kpl_comm_work **work)
{
    KPL_CHECK(c && work, KPL_EINVAL, "reduce_scatter: NULL argument");
    KPL_TRY(check_tensor("reduce_scatter", "in", in));
    KPL_TRY(check_tensor("reduce_scatter", "out", out));
    KPL_CHECK((unsigned)op <= KPL_COMM_MIN, KPL_EINVAL, "reduce_scatter: unknown op %d",
              (int)op);
    KPL_CHECK(kpl_tensor_dtype(in) == kpl_tensor_dtype(out) &&
                  kpl_tensor_numel(in) == kpl_tensor_numel(out) * c->size,
              KPL_ESHAPE, "reduce_scatter: in has %lld elements, want %d x %lld (out)",
              (long long)kpl_tensor_numel(in), (int)c->size, (long long)kpl_tensor_numel(out));
    KPL_TRY(check_reducible("reduce_scatter", kpl_tensor_dtype(in)));
    kpl__coll_args a = {KPL__COLL_REDUCE_SCATTER, kpl_tensor_host_data(in),
                        kpl_tensor_host_mutable(out), (size_t)kpl_tensor_numel(out),
                        kpl_tensor_dtype(in), op, 0, 0};
    return submit(c, &a, op, in, out, work);
}

kpl_status kpl_comm_allreduce(kpl_comm *c, kpl_tensor *in, kpl_tensor *out, kpl_comm_op op)
{
    kpl_comm_work *w = NULL;
    kpl_status st = kpl_comm_allreduce_async(c, in, out, op, &w);
    return finish(st, w);
}

kpl_status kpl_comm_broadcast(kpl_comm *c, kpl_tensor *t, int32_t root)
{
    kpl_comm_work *w = NULL;
    kpl_status st = kpl_comm_broadcast_async(c, t, root, &w);
    return finish(st, w);
}

kpl_status kpl_comm_allgather(kpl_comm *c, kpl_tensor *in, kpl_tensor *out)
{
    kpl_comm_work *w = NULL;
    kpl_status st = kpl_comm_allgather_async(c, in, out, &w);
    return finish(st, w);
}

kpl_status kpl_comm_reduce_scatter(kpl_comm *c, kpl_tensor *in, kpl_tensor *out, kpl_comm_op op)
{
    kpl_comm_work *w = NULL;
    kpl_status st = kpl_comm_reduce_scatter_async(c, in, out, op, &w);
    return finish(st, w);
}

static kpl_status p2p(kpl_comm *c, kpl__coll_kind kind, kpl_tensor *t, int32_t peer, int32_t tag)
{
    const char *op = kind_name(kind);
    KPL_CHECK(c, KPL_EINVAL, "%s: NULL comm", op);
    KPL_TRY(check_tensor(op, "t", t));
    KPL_CHECK(peer >= 0 && peer < c->size && peer != c->rank, KPL_EINVAL,
              "%s: peer %d (this is rank %d of %d)", op, (int)peer, (int)c->rank, (int)c->size);
    KPL_CHECK(tag >= 0, KPL_EINVAL, "%s: tag %d must be >= 0", op, (int)tag);
    void *p = kpl_tensor_host_mutable(t);
    kpl__coll_args a = {kind, p, p, (size_t)kpl_tensor_numel(t), kpl_tensor_dtype(t),
                        KPL_COMM_SUM, peer, tag};
    kpl_comm_work *w = NULL;
    kpl_status st = submit(c, &a, KPL_COMM_SUM, t, NULL, &w);
    return finish(st, w);
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
    kpl__coll_args a = {KPL__COLL_BARRIER, NULL, NULL, 0, KPL_U8, KPL_COMM_SUM, 0, 0};
    kpl_comm_work *w = NULL;
    kpl_status st = submit(c, &a, KPL_COMM_SUM, NULL, NULL, &w);
    return finish(st, w);
}
