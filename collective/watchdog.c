/*
 * watchdog.c — one thread per communicator that keeps the deadlines and
 * runs the stall inspector (as Horovod's).
 *
 * Every 0.1 s it looks at the host operation in progress (on the executor
 * or on a caller's thread) and at the stream work in flight:
 *  - past cfg.stall_warning it asks every other rank what it is doing and
 *    reports, once per operation, which ranks have not joined: those that
 *    answered with another state, and those that did not answer at all (a
 *    stopped or hung process cannot say anything, so its silence is what
 *    names it);
 *  - past cfg.timeout it asks again, marks the communicator stuck with a
 *    message naming the operation, backend and ranks (waiters return
 *    KPL_ETIMEOUT), reports it, and, when the caller's own thread is the
 *    one inside the library, ends the job: that call cannot return.
 *
 * The questions and answers travel on a communicator of their own
 * (c->insp), so they never mix with the operations they ask about.  The
 * watchdog answers other ranks' questions on every tick, even while this
 * rank is blocked in a collective, which is what makes the report possible:
 * the executor may be stuck, the watchdog is not.  It needs
 * MPI_THREAD_MULTIPLE; below that the reports say the ranks were not asked.
 */
#include "collective_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { TAG_QUESTION = 1, TAG_ANSWER = 2 };

#define TICK_SECONDS 0.1
#define ANSWER_WAIT_SECONDS KPL__COMM_ANSWER_WAIT /* for the other ranks' answers */
/* For a backend that keeps the deadline itself to return the blocked call. */
#define DIRECT_GRACE_SECONDS (KPL__COMM_BACKEND_SLACK + 1.0)

/* What a rank tells the inspector (the wire format: int64 fields). */
typedef struct {
    int64_t query;       /* the question answered */
    int64_t host_issued; /* host collectives issued */
    int64_t host_done;   /* and finished */
    int64_t running;     /* 1: a host operation is in progress */
    int64_t kind, seq, dtype, count, peer, tag;
    int64_t run_ms;      /* how long it has been running */
    int64_t idle_ms;     /* since the last host collective finished */
    int64_t dev_issued, dev_done;
} answer;

typedef struct {
    int64_t query;
} question;

struct kpl__watchdog {
    MPI_Request qreq; /* the posted receive for questions */
    question qbuf;
    bool posted;
    int64_t next_query;
    double warned_host;  /* start time of the host operation already reported */
    const void *warned_stream;
    answer *ans;
    bool *got;
    /* Per rank: when the first question it has left unanswered was asked
     * (0: it answered the last one). */
    double *silent_since;
    bool *mark[3]; /* scratch rank sets of the report */
    MPI_Request *sreq;
};

/* ---- answering ----------------------------------------------------------------------- */

static answer my_answer(kpl_comm *c, int64_t query)
{
    answer a = {0};
    double now = kpl_seconds();
    pthread_mutex_lock(&c->mu);
    a.query = query;
    a.host_issued = (int64_t)c->host_issued;
    a.host_done = (int64_t)c->host_done;
    a.running = c->run.started > 0;
    if (a.running) {
        a.kind = c->run.a.kind;
        a.seq = (int64_t)c->run.a.seq;
        a.dtype = c->run.a.dtype;
        a.count = (int64_t)c->run.a.count;
        a.peer = c->run.a.peer;
        a.tag = c->run.a.tag;
        a.run_ms = (int64_t)((now - c->run.started) * 1e3);
    }
    a.idle_ms = (int64_t)((now - c->host_done_at) * 1e3);
    a.dev_issued = (int64_t)c->dev_issued;
    a.dev_done = (int64_t)c->dev_done;
    pthread_mutex_unlock(&c->mu);
    return a;
}

/* Answers every question that has arrived. */
static void serve(kpl_comm *c)
{
    struct kpl__watchdog *d = c->wd;
    if (!c->inspect) return;
    for (;;) {
        if (!d->posted) {
            if (MPI_Irecv(&d->qbuf, sizeof d->qbuf, MPI_BYTE, MPI_ANY_SOURCE, TAG_QUESTION,
                          c->insp, &d->qreq) != MPI_SUCCESS)
                return;
            d->posted = true;
        }
        int flag = 0;
        MPI_Status st;
        if (MPI_Test(&d->qreq, &flag, &st) != MPI_SUCCESS || !flag) return;
        d->posted = false;
        answer a = my_answer(c, d->qbuf.query);
        /* Small: sent eagerly, so this does not wait for the asker. */
        MPI_Send(&a, sizeof a, MPI_BYTE, st.MPI_SOURCE, TAG_ANSWER, c->insp);
    }
}

/* ---- asking -------------------------------------------------------------------------- */

/* Asks every other rank; d->ans / d->got hold what came back within
 * ANSWER_WAIT_SECONDS (got[rank] for this rank too).  False when the
 * ranks cannot be asked. */
static bool ask_all(kpl_comm *c)
{
    struct kpl__watchdog *d = c->wd;
    if (!c->inspect) return false;
    int64_t q = ++d->next_query;
    int n = (int)c->size, me = (int)c->rank, missing = n - 1;
    for (int r = 0; r < n; r++) {
        d->got[r] = r == me;
        d->sreq[r] = MPI_REQUEST_NULL;
    }
    d->ans[me] = my_answer(c, q);
    /* A fresh buffer each time: a question still unsent to a dead rank
     * keeps the old one (released with its request). */
    question *qs = malloc(sizeof *qs);
    if (!qs) return false;
    qs->query = q;
    double asked = kpl_seconds();
    for (int r = 0; r < n; r++)
        if (r != me) MPI_Isend(qs, sizeof *qs, MPI_BYTE, r, TAG_QUESTION, c->insp, &d->sreq[r]);
    double until = kpl_seconds() + ANSWER_WAIT_SECONDS;
    while (missing > 0 && kpl_seconds() < until) {
        int flag = 0;
        MPI_Status st;
        MPI_Iprobe(MPI_ANY_SOURCE, TAG_ANSWER, c->insp, &flag, &st);
        if (!flag) {
            serve(c); /* another rank may be asking us at the same moment */
            usleep(2000);
            continue;
        }
        answer a;
        MPI_Recv(&a, sizeof a, MPI_BYTE, st.MPI_SOURCE, TAG_ANSWER, c->insp, MPI_STATUS_IGNORE);
        int r = st.MPI_SOURCE;
        if (a.query == q && r >= 0 && r < n && !d->got[r]) { /* else a late answer */
            d->ans[r] = a;
            d->got[r] = true;
            missing--;
        }
    }
    for (int r = 0; r < n; r++) {
        if (d->got[r]) d->silent_since[r] = 0;
        else if (d->silent_since[r] == 0) d->silent_since[r] = asked;
    }
    int all = 0;
    MPI_Testall(n, d->sreq, &all, MPI_STATUSES_IGNORE);
    if (all) {
        free(qs);
    } else {
        for (int r = 0; r < n; r++)
            if (d->sreq[r] != MPI_REQUEST_NULL) MPI_Request_free(&d->sreq[r]);
        /* qs stays allocated: a send still owns it (a rank that never
         * answers, rare and at most once per report). */
    }
    return true;
}

/* ---- the report ---------------------------------------------------------------------- */

typedef struct {
    char *p;
    size_t len, used;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...)
{
    if (t->used >= t->len) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->p + t->used, t->len - t->used, fmt, ap);
    va_end(ap);
    if (n > 0) t->used += (size_t)n < t->len - t->used ? (size_t)n : t->len - t->used - 1;
}

/* "rank 3" or "ranks 0-2, 5" for the ranks r with mark[r]. */
static void put_ranks(text *t, const bool *mark, int n)
{
    int count = 0;
    for (int r = 0; r < n; r++) count += mark[r];
    put(t, count == 1 ? "rank " : "ranks ");
    bool first = true;
    for (int r = 0; r < n; r++) {
        if (!mark[r]) continue;
        int e = r;
        while (e + 1 < n && mark[e + 1]) e++;
        put(t, "%s%d", first ? "" : ", ", r);
        if (e > r) put(t, "-%d", e);
        first = false;
        r = e;
    }
}

/* "rank 1: no answer for 4.0 s (stopped or hung?)" for the ranks r with
 * mark[r] (all silent since the same question). */
static void put_silent(kpl_comm *c, text *t, const bool *mark, int r)
{
    put_ranks(t, mark, (int)c->size);
    /* where they are: their hosts, each once (a node cut off shows as all
     * of its ranks silent on one host) */
    int said = 0;
    for (int q = 0; q < (int)c->size && said < 4; q++) {
        if (!mark[q]) continue;
        bool seen = false;
        for (int p = 0; p < q && !seen; p++) seen = mark[p] && !strcmp(c->hosts[p], c->hosts[q]);
        if (seen) continue;
        put(t, "%s%s", said ? ", " : " on host ", c->hosts[q]);
        said++;
    }
    put(t, ": no answer for %.1f s (stopped, hung, or unreachable?)",
        kpl_seconds() - c->wd->silent_since[r]);
}

/* What rank r is doing, as a phrase. */
static void put_state(text *t, const answer *a, int r)
{
    if (a->running) {
        kpl__coll_kind k = (kpl__coll_kind)a->kind;
        if (kpl__coll_is_collective(k))
            put(t, "rank %d is in %s #%lld for %.1f s", r, kpl__coll_kind_name(k),
                (long long)a->seq, (double)a->run_ms / 1e3);
        else
            put(t, "rank %d is in %s %s rank %lld (tag %lld) for %.1f s", r,
                kpl__coll_kind_name(k), k == KPL__COLL_SEND ? "to" : "from", (long long)a->peer,
                (long long)a->tag, (double)a->run_ms / 1e3);
    } else if (a->host_done > 0) {
        put(t, "rank %d is idle, %.1f s after finishing #%lld", r, (double)a->idle_ms / 1e3,
            (long long)(a->host_done - 1));
    } else {
        put(t, "rank %d is idle and has run no collective", r);
    }
}

/* The silent ranks (clears silent[]), those that went silent at the same
 * question together: "; rank 1: no answer for ..." */
static void put_silent_groups(kpl_comm *c, text *t, bool *silent, bool *any_out)
{
    struct kpl__watchdog *d = c->wd;
    int n = (int)c->size;
    bool *group = d->mark[2];
    for (int r = 0; r < n; r++) {
        if (!silent[r]) continue;
        for (int s = 0; s < n; s++) {
            group[s] = silent[s] && d->silent_since[s] == d->silent_since[r];
            if (group[s]) silent[s] = false;
        }
        put(t, "%s ", *any_out ? ";" : "");
        put_silent(c, t, group, r);
        *any_out = true;
    }
}

/* Who has and has not joined host collective `op` of this rank. */
static void put_host_findings(kpl_comm *c, text *t, const kpl__coll_args *op)
{
    struct kpl__watchdog *d = c->wd;
    int n = (int)c->size;
    if (!kpl__coll_is_collective(op->kind)) { /* point to point: the peer's side */
        int p = (int)op->peer;
        put(t, "; ");
        if (d->got[p]) {
            put_state(t, &d->ans[p], p);
        } else {
            bool *one = d->mark[2];
            for (int r = 0; r < n; r++) one[r] = r == p;
            put_silent(c, t, one, p);
        }
        return;
    }
    bool *joined = d->mark[0], *silent = d->mark[1];
    int64_t k = (int64_t)op->seq;
    int nj = 0;
    bool any_out = false;
    put(t, "; not joined:");
    for (int r = 0; r < n; r++) {
        const answer *a = &d->ans[r];
        joined[r] = silent[r] = false;
        if (!d->got[r]) { /* named after those that answered */
            silent[r] = true;
            continue;
        }
        bool in_it = a->running && a->seq == k && a->kind == (int64_t)op->kind;
        if (r == (int)c->rank || in_it || a->host_done > k) {
            joined[r] = true;
            nj++;
            continue;
        }
        put(t, "%s ", any_out ? ";" : "");
        put_state(t, a, r);
        if (a->running && a->seq == k && kpl__coll_is_collective((kpl__coll_kind)a->kind))
            put(t, " (a different collective at the same place: the ranks issued different "
                   "sequences)");
        any_out = true;
    }
    put_silent_groups(c, t, silent, &any_out);
    if (!any_out) put(t, " none");
    if (nj) {
        put(t, "; joined: ");
        put_ranks(t, joined, n);
    }
}

/* Which ranks have not enqueued device collective `seq`. */
static void put_stream_findings(kpl_comm *c, text *t, uint64_t seq)
{
    struct kpl__watchdog *d = c->wd;
    int n = (int)c->size;
    bool *behind = d->mark[0], *silent = d->mark[1];
    int nb = 0, ns = 0;
    for (int r = 0; r < n; r++) {
        behind[r] = silent[r] = false;
        if (!d->got[r]) silent[r] = true, ns++;
        else if (d->ans[r].dev_issued <= (int64_t)seq) behind[r] = true, nb++;
    }
    if (nb) {
        put(t, "; not issued yet by ");
        put_ranks(t, behind, n);
    } else if (!ns) {
        put(t, "; every rank has issued it (a device or network fault?)");
    }
    if (ns) {
        bool any = false;
        put(t, "; not answering:");
        put_silent_groups(c, t, silent, &any);
    }
}

/* Asks every rank and writes what the host or stream operation `op` is
 * waiting for. */
static void put_findings(kpl_comm *c, text *t, const kpl__coll_args *op, bool stream)
{
    if (!ask_all(c)) {
        put(t, "; the other ranks were not asked (the stall inspector needs "
               "MPI_THREAD_MULTIPLE)");
        return;
    }
    if (stream) put_stream_findings(c, t, op->seq);
    else put_host_findings(c, t, op);
}

/* ---- the checks ------------------------------------------------------------------------ */

static void check_host(kpl_comm *c, const kpl__comm_running *run)
{
    struct kpl__watchdog *d = c->wd;
    double age = kpl_seconds() - run->started;
    const char *be = c->host.be->name;
    char what[256], buf[3072];
    text t = {buf, sizeof buf, 0};
    if (c->stall_warning > 0 && age >= c->stall_warning && age < c->timeout &&
        d->warned_host != run->started) {
        d->warned_host = run->started;
        kpl__comm_describe(c, &run->a, be, what, sizeof what);
        put(&t, "stall: %s has waited %.1f s", what, age);
        put_findings(c, &t, &run->a, false);
        kpl__comm_report(c, buf);
        return;
    }
    if (age < c->timeout) return;
    kpl__comm_describe(c, &run->a, be, what, sizeof what);
    put(&t, "%s: timed out after %.0f s", what, c->timeout);
    put_findings(c, &t, &run->a, false);
    put(&t, "; the ranks are out of step: end the job (kpl_comm_abort)");

    pthread_mutex_lock(&c->mu);
    bool same = c->run.started == run->started;
    if (same) kpl__comm_mark_stuck(c, buf);
    pthread_mutex_unlock(&c->mu);
    if (!same) return; /* it finished meanwhile */
    kpl__comm_report(c, buf);
    if (!run->direct) return; /* its waiter gets KPL_ETIMEOUT */

    /* The caller's thread is inside the library.  A backend that keeps
     * the deadline itself returns within the grace period; otherwise
     * nothing will ever return to the caller, so end the job here. */
    double until = kpl_seconds() + DIRECT_GRACE_SECONDS;
    while (kpl_seconds() < until) {
        usleep(20000);
        pthread_mutex_lock(&c->mu);
        same = c->run.started == run->started;
        pthread_mutex_unlock(&c->mu);
        if (!same) return;
    }
    kpl__comm_report(c, "a blocking call cannot return from inside the library: ending the "
                        "job (exit status 124)");
    kpl_comm_abort(c, KPL_COMM_TIMEOUT_EXIT);
}

static void check_stream(kpl_comm *c, const kpl__coll_args *op, double issued, const void *w)
{
    struct kpl__watchdog *d = c->wd;
    double age = kpl_seconds() - issued;
    const char *be = c->dev.be->name;
    char what[256], buf[3072];
    text t = {buf, sizeof buf, 0};
    if (c->stall_warning > 0 && age >= c->stall_warning && age < c->timeout &&
        d->warned_stream != w) {
        d->warned_stream = w;
        kpl__comm_describe(c, op, be, what, sizeof what);
        put(&t, "stall: %s has not completed on the device after %.1f s", what, age);
        put_findings(c, &t, op, true);
        kpl__comm_report(c, buf);
        return;
    }
    if (age < c->timeout) return;
    kpl__comm_describe(c, op, be, what, sizeof what);
    put(&t, "%s: timed out after %.0f s on the device", what, c->timeout);
    put_findings(c, &t, op, true);
    put(&t, "; the ranks are out of step: end the job (kpl_comm_abort)");
    pthread_mutex_lock(&c->mu);
    kpl__comm_mark_stuck(c, buf);
    pthread_mutex_unlock(&c->mu);
    kpl__comm_report(c, buf);
    /* The device would spin in the collective's kernel forever. */
    if (c->dev.be->cancel) c->dev.be->cancel(c->dev.state);
}

static void *watchdog_main(void *arg)
{
    kpl_comm *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->watch_stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += (long)(TICK_SECONDS * 1e9);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->cv_watch, &c->mu, &ts);
        if (c->watch_stop) break;
        kpl__comm_running run = c->run;
        /* The oldest stream work still running (the list is newest first). */
        kpl_comm_work *oldest = NULL;
        for (kpl_comm_work *w = c->streams; w; w = w->snext)
            if (!w->done && kpl__comm_stream_poll(w) == KPL_OK && !w->done) oldest = w;
        kpl__coll_args sop = oldest ? oldest->a : (kpl__coll_args){0};
        double sissued = oldest ? oldest->issued : 0;
        bool stuck = c->stuck;
        pthread_mutex_unlock(&c->mu);

        serve(c);
        if (!stuck && run.started > 0) check_host(c, &run);
        if (!stuck && oldest) check_stream(c, &sop, sissued, oldest);
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

kpl_status kpl__comm_watchdog_start(kpl_comm *c)
{
    struct kpl__watchdog *d = calloc(1, sizeof *d);
    KPL_CHECK(d, KPL_ENOMEM, "comm_create: no memory");
    c->wd = d;
    size_t n = (size_t)c->size;
    d->ans = calloc(n, sizeof *d->ans);
    d->got = calloc(n, sizeof *d->got);
    d->silent_since = calloc(n, sizeof *d->silent_since);
    d->sreq = calloc(n, sizeof *d->sreq);
    for (int i = 0; i < 3; i++) d->mark[i] = calloc(n, sizeof *d->mark[i]);
    KPL_CHECK(d->ans && d->got && d->silent_since && d->sreq && d->mark[0] && d->mark[1] &&
                  d->mark[2],
              KPL_ENOMEM, "comm_create: no memory");
    KPL_CHECK(pthread_create(&c->watchdog, NULL, watchdog_main, c) == 0, KPL_ENOMEM,
              "comm_create: cannot start the watchdog thread");
    c->watchdog_live = true;
    return KPL_OK;
}

void kpl__comm_watchdog_stop(kpl_comm *c)
{
    struct kpl__watchdog *d = c->wd;
    if (c->watchdog_live) {
        pthread_mutex_lock(&c->mu);
        c->watch_stop = true;
        pthread_cond_broadcast(&c->cv_watch);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->watchdog, NULL);
        c->watchdog_live = false;
    }
    if (!d) return;
    if (d->posted) {
        MPI_Cancel(&d->qreq);
        MPI_Wait(&d->qreq, MPI_STATUS_IGNORE);
    }
    free(d->ans);
    free(d->got);
    free(d->silent_since);
    free(d->sreq);
    for (int i = 0; i < 3; i++) free(d->mark[i]);
    free(d);
    c->wd = NULL;
}
