/* test_comm_timeout.c — under mpirun: rank 0 skips a collective.  Every
 * other rank must get KPL_ETIMEOUT within the timeout, with a message that
 * names the operation, the backend and the rank, and then end the job
 * (kpl_comm_abort) instead of hanging.  CTest looks for the line each such
 * rank prints; the job's exit status is the abort's. */
#include "collective.h"

#include <mpi.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    int level;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &level);
    kpl_comm_config cfg = KPL_COMM_CONFIG_INIT;
    cfg.timeout = 2.0;
    kpl_comm *comm = NULL;
    if (kpl_comm_create(&cfg, &comm) < 0) {
        fprintf(stderr, "comm_create: %s\n", kpl_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int rank = kpl_comm_rank(comm);
    if (rank == 0) {
        sleep(60); /* never joins; the others' abort ends it */
        return 1;
    }
    int64_t n = 1000;
    kpl_tensor *t = NULL;
    kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &n, &t);
    double t0 = MPI_Wtime();
    kpl_status st = kpl_comm_allreduce(comm, t, t, KPL_COMM_SUM);
    double el = MPI_Wtime() - t0;
    const char *msg = kpl_last_error();
    char want[64];
    snprintf(want, sizeof want, "rank %d of", rank);
    bool ok = st == KPL_ETIMEOUT && el >= 1.9 && el < 4.0 && strstr(msg, "allreduce (f32") &&
              strstr(msg, "backend mpi") && strstr(msg, want) && strstr(msg, "timed out");
    printf("%s rank %d after %.1f s: %s\n", ok ? "TIMEOUT-OK" : "TIMEOUT-WRONG", rank, el, msg);
    fflush(stdout);
    kpl_comm_abort(comm, 3);
}
