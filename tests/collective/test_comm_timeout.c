/* test_comm_timeout.c — under mpirun -np 3, the failure paths of the
 * communicator: rank 0 is late to (or never joins) an allreduce.
 *
 *   test_comm_timeout blocking   rank 0 never joins; ranks 1-2 are in a
 *       blocking allreduce, which cannot return from inside MPI: their
 *       watchdog must report "timed out" naming rank 0 as not joined, then
 *       end the job (exit status 124).
 *   test_comm_timeout async      rank 0 never joins; ranks 1-2 wait on an
 *       async allreduce and must get KPL_ETIMEOUT with that message within
 *       the timeout, and every later call must fail at once.
 *   test_comm_timeout ucx        rank 0 never joins a blocking allreduce
 *       of the ucx backend, which keeps a deadline itself: the call must
 *       return KPL_ETIMEOUT with the watchdog's report naming rank 0 and
 *       the backend's own detail (no job-ending needed).
 *   test_comm_timeout stall      rank 0 joins 2 s late; the stall inspector
 *       of ranks 1-2 must report (after 0.5 s) that rank 0 has not joined
 *       and is idle, and the allreduce must then complete with the right sum.
 *   test_comm_timeout stopped    (2 or 3 ranks) every rank but 0 stops
 *       itself (SIGSTOP) before allreduce #1, so neither it nor its watchdog
 *       can answer: rank 0's stall report and its KPL_ETIMEOUT message must
 *       name them ("rank 1", "ranks 1-2") as not joined and not answering;
 *       then rank 0 ends the job, and mpirun's teardown (SIGCONT, SIGTERM,
 *       SIGKILL) ends the stopped ranks.
 *
 * CTest looks for the lines each rank prints (…-OK / …-WRONG). */
#include "collective.h"

#include <mpi.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* The watchdog thread reports while the main thread may be reading. */
static pthread_mutex_t reports_mu = PTHREAD_MUTEX_INITIALIZER;
static char reports[4][2048];
static int nreports;

static void capture(const char *line, void *user)
{
    (void)user;
    pthread_mutex_lock(&reports_mu);
    if (nreports < 4) snprintf(reports[nreports++], sizeof reports[0], "%s", line);
    fprintf(stderr, "report: %s\n", line);
    pthread_mutex_unlock(&reports_mu);
}

/* The first report (the stall report) and how many there were. */
static int first_report(char *buf, size_t len)
{
    pthread_mutex_lock(&reports_mu);
    int n = nreports;
    snprintf(buf, len, "%s", n ? reports[0] : "");
    pthread_mutex_unlock(&reports_mu);
    return n;
}

static kpl_tensor *ones(int64_t n)
{
    kpl_tensor *t = NULL;
    if (kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &n, &t) < 0) MPI_Abort(MPI_COMM_WORLD, 1);
    float *p = kpl_tensor_host_mutable(t);
    for (int64_t i = 0; i < n; i++) p[i] = 1;
    return t;
}

int main(int argc, char **argv)
{
    int level;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &level);
    const char *mode = argc > 1 ? argv[1] : "";
    bool stall = !strcmp(mode, "stall"), async = !strcmp(mode, "async");
    bool ucx = !strcmp(mode, "ucx"), stopped = !strcmp(mode, "stopped");
    if (!stall && !async && !ucx && !stopped && strcmp(mode, "blocking")) {
        fprintf(stderr, "usage: test_comm_timeout blocking|async|ucx|stall|stopped\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    kpl_comm_config cfg = KPL_COMM_CONFIG_INIT;
    cfg.timeout = stall ? 30.0 : stopped ? 3.0 : 2.0;
    cfg.stall_warning = stall || stopped ? 0.5 : 0;
    if (stall || async || ucx || stopped) cfg.report = capture;
    if (ucx) cfg.backend = KPL_COMM_BACKEND_UCX; /* blocking: the default sink */
    kpl_comm *comm = NULL;
    if (kpl_comm_create(&cfg, &comm) < 0) {
        fprintf(stderr, "comm_create: %s\n", kpl_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int rank = kpl_comm_rank(comm), size = kpl_comm_size(comm);
    /* The ranks that wait meet here before one of them ends the job, so
     * that every one of them has printed its line. */
    MPI_Comm waiters;
    MPI_Comm_split(MPI_COMM_WORLD, rank == 0, rank, &waiters);
    kpl_tensor *t = ones(1000);
    /* One collective everybody joins first, so "after finishing #0". */
    if (kpl_comm_allreduce(comm, t, t, KPL_COMM_SUM) < 0) MPI_Abort(MPI_COMM_WORLD, 1);

    if (stall) {
        if (rank == 0) sleep(2);
        double t0 = MPI_Wtime();
        kpl_status st = kpl_comm_allreduce(comm, t, t, KPL_COMM_SUM);
        double el = MPI_Wtime() - t0;
        float want = (float)(size * size);
        bool ok = st == KPL_OK && ((float *)kpl_tensor_host_data(t))[999] == want;
        char rep[2048];
        int n = first_report(rep, sizeof rep);
        if (rank != 0) {
            ok = ok && n == 1 && strstr(rep, "stall: allreduce #1 (f32, 1000 "
                                             "elements) on backend mpi") &&
                 strstr(rep, "not joined: rank 0 is idle, ") && strstr(rep, "after finishing #0") &&
                 strstr(rep, "joined: ranks 1-2") && el > 1.5;
        }
        printf("%s rank %d after %.1f s (%d reports)\n", ok ? "STALL-OK" : "STALL-WRONG", rank,
               el, n);
        fflush(stdout);
        kpl_tensor_release(t);
        kpl_comm_destroy(comm);
        MPI_Finalize();
        return ok ? 0 : 1;
    }

    if (stopped) {
        if (rank != 0) {
            raise(SIGSTOP); /* until mpirun's teardown: SIGCONT, then SIGTERM */
            sleep(60);
            return 1;
        }
        double t0 = MPI_Wtime();
        kpl_comm_work *w = NULL;
        kpl_status st = kpl_comm_allreduce_async(comm, t, t, KPL_COMM_SUM, &w);
        if (st == KPL_OK) st = kpl_comm_work_wait(w);
        double el = MPI_Wtime() - t0;
        char msg[2048];
        snprintf(msg, sizeof msg, "%s", kpl_last_error());
        /* The stall report (after 0.5 s) and the timeout (after 3 s) both
         * say that the others have not joined and do not answer; rank 0
         * itself has joined.  (The timeout's own report may come after the
         * waiter wakes: the message is the same.) */
        char stall_report[2048];
        int n = first_report(stall_report, sizeof stall_report);
        char what[128], missing[160], host[64] = "";
        snprintf(what, sizeof what, "allreduce #1 (f32, 1000 elements) on backend mpi, rank 0 of %d",
                 size);
        gethostname(host, sizeof host - 1); /* one machine: every rank's host */
        snprintf(missing, sizeof missing, "; not joined: %s on host %s: no answer for ",
                 size == 2 ? "rank 1" : size == 3 ? "ranks 1-2" : "?", host);
        bool ok = st == KPL_ETIMEOUT && el >= 2.9 && el < 8.0 && n >= 1 &&
                  !strncmp(stall_report, "stall: ", 7) && strstr(stall_report, what) &&
                  strstr(stall_report, " has waited ") && strstr(stall_report, missing) &&
                  strstr(stall_report, " s (stopped, hung, or unreachable?); joined: rank 0") &&
                  !strncmp(msg, what, strlen(what)) && strstr(msg, ": timed out after 3 s") &&
                  strstr(msg, missing) && strstr(msg, " s (stopped, hung, or unreachable?); joined: rank 0") &&
                  !strstr(msg, "none");
        printf("%s rank 0 after %.1f s: %s\n", ok ? "STOPPED-OK" : "STOPPED-WRONG", el, msg);
        fflush(stdout);
        kpl_comm_abort(comm, 3);
    }
    if (rank == 0) {
        sleep(60); /* never joins; the others end the job */
        return 1;
    }
    char want[64];
    snprintf(want, sizeof want, "rank %d of", rank);
    double t0 = MPI_Wtime();
    if (ucx) {
        kpl_status st = kpl_comm_allreduce(comm, t, t, KPL_COMM_SUM);
        double el = MPI_Wtime() - t0;
        char msg[2048];
        snprintf(msg, sizeof msg, "%s", kpl_last_error());
        /* The watchdog's diagnosis first (rank 0 never came), then the
         * backend's own words (the ring predecessor it waited for). */
        bool ok = st == KPL_ETIMEOUT && el >= 1.9 && el < 8.0 &&
                  strstr(msg, "allreduce #1 (f32, 1000 elements) on backend ucx") &&
                  strstr(msg, want) && strstr(msg, "timed out after 2 s") &&
                  strstr(msg, "not joined: rank 0 is idle") &&
                  strstr(msg, "(ucx: ") && strstr(msg, "at the deadline");
        ok = ok && kpl_comm_barrier(comm) == KPL_ETIMEOUT; /* broken for good */
        printf("%s rank %d after %.1f s: %s\n", ok ? "TIMEOUT-OK" : "TIMEOUT-WRONG", rank, el,
               msg);
        fflush(stdout);
        MPI_Barrier(waiters);
        kpl_comm_abort(comm, 3);
    }
    if (!async) {
        kpl_comm_allreduce(comm, t, t, KPL_COMM_SUM); /* never returns */
        printf("TIMEOUT-WRONG rank %d: the blocking call returned\n", rank);
        fflush(stdout);
        return 1;
    }
    kpl_comm_work *w = NULL;
    kpl_status st = kpl_comm_allreduce_async(comm, t, t, KPL_COMM_SUM, &w);
    if (st == KPL_OK) st = kpl_comm_work_wait(w);
    double el = MPI_Wtime() - t0;
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", kpl_last_error());
    bool ok = st == KPL_ETIMEOUT && el >= 1.9 && el < 6.0 &&
              strstr(msg, "allreduce #1 (f32, 1000 elements) on backend mpi") &&
              strstr(msg, want) && strstr(msg, "timed out after 2 s") &&
              strstr(msg, "not joined: rank 0 is idle") && strstr(msg, "joined: ranks 1-2");
    /* Broken for good: the next call fails at once. */
    double t1 = MPI_Wtime();
    kpl_status again = kpl_comm_barrier(comm);
    ok = ok && again == KPL_ETIMEOUT && MPI_Wtime() - t1 < 0.5;
    printf("%s rank %d after %.1f s: %s\n", ok ? "TIMEOUT-OK" : "TIMEOUT-WRONG", rank, el, msg);
    fflush(stdout);
    MPI_Barrier(waiters);
    kpl_comm_abort(comm, 3);
}
