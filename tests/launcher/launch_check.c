/* launch_check.c — a small kpl program for kplrun's tests.  Run as a rank
 * under kplrun it checks the KPL_* environment against what MPI says,
 * then sums a vector over all ranks through the kpl communicator (backend
 * argv[1]: mpi or ucx) and prints one line per rank:
 *
 *   CHECK rank R/W local L/LS device D host H net A,B  omp T
 *
 * and on rank 0, after an allgather of every rank's host and addresses:
 *
 *   PLACES r0=H0@A0 r1=H1@A1 ...
 *   SUM-OK (or WRONG ...)
 *
 * Exit status 0 only when everything agreed.
 *
 * `launch_check BACKEND stop [...]`: rank 1 stops itself (SIGSTOP) after
 * the allreduce (#0), before the allgather (#1), with a 3 s timeout and a
 * 1 s stall warning, so that the others time out waiting for it (further
 * arguments are ignored: a test marks its processes with them).
 *
 * `launch_check BACKEND loop`: after the checks, allreduces on and on
 * (printing "LOOPING rank R" once both ranks are well into it) with a 30 s
 * timeout and a 1 s stall warning, until one fails: then "LINK-LOST rank R: <the error>" and the
 * job ends with status 124, as kpl train's does (cluster_fault.sh cuts a
 * node's link under it).  After 10 minutes: WRONG. */
#define _GNU_SOURCE
#include "collective.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PLACE 128 /* bytes of "host@addresses" each rank contributes */

/* This network namespace's IPv4 addresses other than loopback. */
static void addresses(char *buf, size_t len)
{
    struct ifaddrs *ifa = NULL;
    buf[0] = 0;
    if (getifaddrs(&ifa) != 0) return;
    size_t at = 0;
    for (struct ifaddrs *i = ifa; i; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
        char a[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, a, sizeof a);
        if (!strncmp(a, "127.", 4)) continue;
        at += (size_t)snprintf(buf + at, at < len ? len - at : 0, "%s%s", at ? "," : "", a);
        if (at >= len) break;
    }
    freeifaddrs(ifa);
    if (!buf[0]) snprintf(buf, len, "none");
}

static int env_int(const char *name)
{
    const char *v = getenv(name);
    return v ? atoi(v) : -1;
}

int main(int argc, char **argv)
{
    const char *backend = argc > 1 ? argv[1] : "mpi";
    kpl_comm_config cfg = KPL_COMM_CONFIG_INIT;
    cfg.backend = !strcmp(backend, "ucx") ? KPL_COMM_BACKEND_UCX : KPL_COMM_BACKEND_MPI;
    bool stop = argc > 2 && !strcmp(argv[2], "stop");
    bool loop = argc > 2 && !strcmp(argv[2], "loop");
    cfg.timeout = stop ? 3 : loop ? 30 : 60;
    if (stop || loop) cfg.stall_warning = 1;
    kpl_comm *comm = NULL;
    if (kpl_comm_create(&cfg, &comm) < 0) {
        fprintf(stderr, "WRONG: kpl_comm_create: %s\n", kpl_last_error());
        return 1;
    }
    int rank = kpl_comm_rank(comm), world = kpl_comm_size(comm);
    int bad = 0;
    /* kplrun's environment says what MPI says */
    if (env_int("KPL_RANK") != rank || env_int("KPL_WORLD_SIZE") != world ||
        env_int("KPL_LOCAL_RANK") != kpl_comm_local_rank(comm) ||
        env_int("KPL_LOCAL_SIZE") != kpl_comm_local_size(comm)) {
        fprintf(stderr,
                "WRONG environment: KPL_RANK=%s KPL_WORLD_SIZE=%s KPL_LOCAL_RANK=%s "
                "KPL_LOCAL_SIZE=%s, MPI: rank %d of %d, local %d of %d\n",
                getenv("KPL_RANK"), getenv("KPL_WORLD_SIZE"), getenv("KPL_LOCAL_RANK"),
                getenv("KPL_LOCAL_SIZE"), rank, world, kpl_comm_local_rank(comm),
                kpl_comm_local_size(comm));
        bad = 1;
    }
    char host[64] = "?", net[PLACE - 64];
    gethostname(host, sizeof host);
    addresses(net, sizeof net);
    const char *dev = getenv("KPL_DEVICE"), *omp = getenv("OMP_NUM_THREADS");
    printf("CHECK rank %d/%d local %d/%d device %s host %s net %s omp %s\n", rank, world,
           kpl_comm_local_rank(comm), kpl_comm_local_size(comm), dev ? dev : "(unset)", host, net,
           omp ? omp : "(unset)");
    fflush(stdout);

    /* every rank adds (rank + 1) * (i + 1): element i of the sum is
     * (i + 1) * W (W + 1) / 2 */
    int64_t n = 100003; /* several messages' worth, odd-sized */
    kpl_tensor *x = NULL, *y = NULL, *mine = NULL, *all = NULL;
    int64_t pn = PLACE, an = (int64_t)PLACE * world;
    if (kpl_tensor_zeros(kpl_device_cpu(), KPL_F64, 1, &n, &x) < 0 ||
        kpl_tensor_zeros(kpl_device_cpu(), KPL_F64, 1, &n, &y) < 0 ||
        kpl_tensor_zeros(kpl_device_cpu(), KPL_U8, 1, &pn, &mine) < 0 ||
        kpl_tensor_zeros(kpl_device_cpu(), KPL_U8, 1, &an, &all) < 0) {
        fprintf(stderr, "WRONG: %s\n", kpl_last_error());
        kpl_comm_abort(comm, 1);
    }
    double *px = kpl_tensor_host_mutable(x);
    for (int64_t i = 0; i < n; i++) px[i] = (double)(rank + 1) * (double)(i + 1);
    snprintf(kpl_tensor_host_mutable(mine), PLACE, "%s@%s", host, net);
    if (kpl_comm_allreduce(comm, x, y, KPL_COMM_SUM) < 0) {
        fprintf(stderr, "WRONG: %s\n", kpl_last_error());
        kpl_comm_abort(comm, 1);
    }
    if (stop && rank == 1) {
        printf("stopping before the allgather\n");
        fflush(stdout);
        raise(SIGSTOP);
    }
    if (kpl_comm_allgather(comm, mine, all) < 0) {
        fprintf(stderr, "WRONG: %s\n", kpl_last_error());
        kpl_comm_abort(comm, 1);
    }
    const double *py = kpl_tensor_host_data(y);
    double tri = (double)world * (world + 1) / 2;
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) wrong += py[i] != (double)(i + 1) * tri;
    if (wrong) {
        fprintf(stderr, "WRONG sum on rank %d: %lld of %lld elements (y[0] = %g, want %g)\n", rank,
                (long long)wrong, (long long)n, py[0], tri);
        bad = 1;
    }
    if (rank == 0) {
        const char *p = kpl_tensor_host_data(all);
        printf("PLACES");
        for (int r = 0; r < world; r++) printf(" r%d=%.*s", r, PLACE, p + (size_t)r * PLACE);
        printf("\n%s over %s\n", wrong ? "WRONG" : "SUM-OK", backend);
    }
    double t0 = kpl_seconds();
    for (int64_t i = 0; loop && !bad; i++) {
        if (kpl_comm_allreduce(comm, x, y, KPL_COMM_SUM) < 0) {
            fprintf(stderr, "LINK-LOST rank %d: %s\n", rank, kpl_last_error());
            kpl_comm_abort(comm, KPL_COMM_TIMEOUT_EXIT);
        }
        if (i == 50) {
            printf("LOOPING rank %d\n", rank);
            fflush(stdout);
        }
        if (kpl_seconds() - t0 > 600) {
            fprintf(stderr, "WRONG: 10 minutes of allreduces and no failure\n");
            kpl_comm_abort(comm, 1);
        }
    }
    kpl_tensor_release(x);
    kpl_tensor_release(y);
    kpl_tensor_release(mine);
    kpl_tensor_release(all);
    kpl_comm_destroy(comm);
    return bad;
}
