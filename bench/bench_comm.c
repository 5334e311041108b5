/*
 * bench_comm.c — the comm group, run under mpirun (run.sh uses -np 2):
 * allreduce bus bandwidth of kpl's mpi backend next to raw MPI_Allreduce
 * in the same job.
 *
 *   mpirun -np 2 bench_comm
 *
 * For each size from 4 KB to 64 MB of f32, in place, alternating the two
 * sides for several rounds (a barrier before each timed block):
 *   ref: MPI_Allreduce(MPI_IN_PLACE, ..., MPI_SUM, MPI_COMM_WORLD)
 *   kpl: kpl_comm_allreduce(comm, t, t, KPL_COMM_SUM) (communication
 *        thread, non-blocking collective progressed to completion)
 * Bus bandwidth follows nccl-tests: 2 (n - 1) / n * bytes / time.  Rank 0
 * prints one JSON line per size, median of the rounds; target 1.0.
 */
#include "bench_common.h"
#include "collective.h"

#include <mpi.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    int level;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &level);
    kpl_comm *comm = NULL;
    if (kpl_comm_create(NULL, &comm) < 0) {
        fprintf(stderr, "bench_comm: %s\n", kpl_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int rank = kpl_comm_rank(comm), n = kpl_comm_size(comm);
    enum { ROUNDS = 5 };
    for (size_t bytes = 4096; bytes <= ((size_t)64 << 20); bytes *= 4) {
        int64_t count = (int64_t)(bytes / 4);
        kpl_tensor *t = NULL;
        if (kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &count, &t) < 0)
            MPI_Abort(MPI_COMM_WORLD, 1);
        float *p = kpl_tensor_host_mutable(t);
        /* Enough repetitions for ~50 ms a block at ~2 GB/s, at least 3. */
        int reps = (int)(1e8 / (double)bytes);
        if (reps < 3) reps = 3;
        if (reps > 2000) reps = 2000;
        double tk[ROUNDS], tr[ROUNDS];
        for (int round = 0; round < ROUNDS; round++) {
            for (int side = 0; side < 2; side++) {
                bool kpl_side = (side + round) % 2 == 0;
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                for (int i = 0; i < reps; i++) {
                    if (kpl_side) {
                        if (kpl_comm_allreduce(comm, t, t, KPL_COMM_SUM) < 0) {
                            fprintf(stderr, "bench_comm: %s\n", kpl_last_error());
                            MPI_Abort(MPI_COMM_WORLD, 1);
                        }
                    } else {
                        MPI_Allreduce(MPI_IN_PLACE, p, (int)count, MPI_FLOAT, MPI_SUM,
                                      MPI_COMM_WORLD);
                    }
                }
                double el = (MPI_Wtime() - t0) / reps, worst = 0;
                MPI_Allreduce(&el, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                double busbw = 2.0 * (n - 1) / n * (double)bytes / worst / 1e9;
                (kpl_side ? tk : tr)[round] = busbw;
            }
        }
        if (rank == 0) {
            char cas[64], rk[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN];
            snprintf(cas, sizeof cas, "allreduce_f32/%zuB/np%d", bytes, n);
            bench_emit("comm", cas, "GB/s busbw", 1, bench_median(tk, ROUNDS),
                       bench_median(tr, ROUNDS), "MPI_Allreduce", 1.0,
                       ",\"backend\":\"mpi\",\"reps\":%d,\"kpl_range\":%s,\"ref_range\":%s", reps,
                       bench_jrange(rk, tk, ROUNDS), bench_jrange(rr, tr, ROUNDS));
        }
        kpl_tensor_release(t);
    }
    kpl_comm_destroy(comm);
    MPI_Finalize();
    return 0;
}
