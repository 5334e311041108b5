/* test_comm_devices.c — the ranks agree on their devices before any
 * backend starts.
 *
 * `test_comm_devices` (no mpirun): the verdict on a table of ranks'
 * devices, as kpl_comm_create reaches it on every rank: ranks that could
 * not open their device, a mix of CPU and GPU ranks, two ranks of a node
 * on one GPU under NCCL (refused), one GPU per rank under SLURM's
 * --gpus-per-task=1 (each rank sees its own GPU as cuda:0: accepted).
 *
 * `test_comm_devices np2` (under mpirun -np 2): rank 1 asks for cuda:0,
 * rank 0 for the CPU.  Without a GPU rank 1 cannot open it, with one the
 * kinds differ: either way both ranks fail, each with its message, and
 * neither is left waiting in a backend's collective set-up.  A
 * communicator made afterwards works. */
#include "kpl_test.h"
#include "collective_impl.h"

#include <mpi.h>
#include <stdlib.h>
#include <string.h>

static kpl__comm_rank_device cpu_rank(int32_t node)
{
    return (kpl__comm_rank_device){KPL_DEVICE_CPU, 0, node, 0, ""};
}

static kpl__comm_rank_device gpu_rank(int32_t node, int32_t index, int32_t gpus, const char *bus)
{
    kpl__comm_rank_device d = {KPL_DEVICE_CUDA, index, node, gpus, ""};
    snprintf(d.gpu_id, sizeof d.gpu_id, "%s", bus);
    return d;
}

static void test_all_cpu_and_failures(void **state)
{
    (void)state;
    kpl__comm_rank_device all[4] = {cpu_rank(0), cpu_rank(0), cpu_rank(2), cpu_rank(2)};
    OK(kpl__comm_check_devices(all, 4, KPL_COMM_BACKEND_AUTO));
    OK(kpl__comm_check_devices(all, 4, KPL_COMM_BACKEND_UCX));
    FAILS(kpl__comm_check_devices(all, 4, KPL_COMM_BACKEND_NCCL), KPL_EDEVICE,
          "backend nccl needs a CUDA device on every rank; the ranks run on cpu");
    all[1].kind = -1;
    all[3].kind = -1;
    FAILS(kpl__comm_check_devices(all, 4, KPL_COMM_BACKEND_AUTO), KPL_EDEVICE,
          "rank(s) 1, 3 could not open their device (each one's own error says why)");
}

/* CUDA failed to start on one node: its ranks run on the CPU. */
static void test_mixed_kinds(void **state)
{
    (void)state;
    kpl__comm_rank_device all[4] = {gpu_rank(0, 0, 2, "0000:3b:00.0"),
                                    gpu_rank(0, 1, 2, "0000:86:00.0"), cpu_rank(2), cpu_rank(2)};
    FAILS(kpl__comm_check_devices(all, 4, KPL_COMM_BACKEND_AUTO), KPL_EDEVICE,
          "rank(s) 0, 1 on cuda, rank(s) 2, 3 on cpu");
    /* even with a host backend: the trainer's tensors would live on two kinds */
    FAILS(kpl__comm_check_devices(all, 4, KPL_COMM_BACKEND_MPI), KPL_EDEVICE,
          "different kinds of device");
    all[2] = gpu_rank(2, 0, 2, "0000:3b:00.0");
    all[3] = gpu_rank(2, 1, 2, "0000:86:00.0");
    OK(kpl__comm_check_devices(all, 4, KPL_COMM_BACKEND_AUTO)); /* same ids, other node */
}

static void test_shared_gpu(void **state)
{
    (void)state;
    /* 3 ranks on a node with 2 GPUs: local_rank % 2 puts ranks 0 and 2 on cuda:0 */
    kpl__comm_rank_device all[3] = {gpu_rank(0, 0, 2, "0000:3b:00.0"),
                                    gpu_rank(0, 1, 2, "0000:86:00.0"),
                                    gpu_rank(0, 0, 2, "0000:3b:00.0")};
    FAILS(kpl__comm_check_devices(all, 3, KPL_COMM_BACKEND_AUTO), KPL_EDEVICE,
          "ranks 0 and 2 would share the GPU at PCI 0000:3b:00.0 (cuda:0 and cuda:0): their "
          "node runs 3 ranks on the 2 GPU(s) rank 0 sees");
    FAILS(kpl__comm_check_devices(all, 3, KPL_COMM_BACKEND_NCCL), KPL_EDEVICE,
          "NCCL does not support two ranks on one GPU");
    /* a host backend stages through the host: sharing a GPU is only slow */
    OK(kpl__comm_check_devices(all, 3, KPL_COMM_BACKEND_MPI));
    /* SLURM --gpus-per-task=1: every rank sees only its own GPU, as cuda:0 */
    kpl__comm_rank_device own[3] = {gpu_rank(0, 0, 1, "0000:3b:00.0"),
                                    gpu_rank(0, 0, 1, "0000:86:00.0"),
                                    gpu_rank(0, 0, 1, "0000:af:00.0")};
    OK(kpl__comm_check_devices(own, 3, KPL_COMM_BACKEND_AUTO));
    /* one GPU per node over two nodes */
    kpl__comm_rank_device nodes[2] = {gpu_rank(0, 0, 1, "0000:3b:00.0"),
                                      gpu_rank(1, 0, 1, "0000:3b:00.0")};
    OK(kpl__comm_check_devices(nodes, 2, KPL_COMM_BACKEND_NCCL));
}

/* Many failed ranks: the list is cut, not overflowed. */
static void test_long_rank_list(void **state)
{
    (void)state;
    enum { N = 200 };
    kpl__comm_rank_device *all = calloc(N, sizeof *all);
    assert_non_null(all);
    for (int r = 0; r < N; r++) all[r] = cpu_rank(r / 8), all[r].kind = -1;
    FAILS(kpl__comm_check_devices(all, N, KPL_COMM_BACKEND_AUTO), KPL_EDEVICE,
          "rank(s) 0, 1, 2, 3,");
    assert_non_null(strstr(kpl_last_error(), "... could not open"));
    assert_null(strstr(kpl_last_error(), "199"));
    free(all);
}

/* Under mpirun -np 2: rank 1 asks for a GPU, rank 0 for the CPU. */
static int run_np2(void)
{
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    kpl_comm_config cfg = KPL_COMM_CONFIG_INIT;
    cfg.timeout = 20;
    cfg.device = rank == 1 ? "cuda:0" : "cpu";
    kpl_comm *comm = NULL;
    kpl_status st = kpl_comm_create(&cfg, &comm);
    const char *msg = kpl_last_error();
    bool gpu = kpl_device_count(KPL_DEVICE_CUDA) > 0;
    const char *want = gpu ? "rank(s) 1 on cuda, rank(s) 0 on cpu"
                       : rank == 0 ? "rank(s) 1 could not open their device"
                       : kpl_device_type_built(KPL_DEVICE_CUDA) ? "no CUDA GPU was found"
                                                                : "no CUDA backend";
    int bad = 0;
    if (st != KPL_EDEVICE || comm || !strstr(msg, want)) {
        fprintf(stderr, "WRONG rank %d: status %s, message '%s', want '%s'\n", rank,
                kpl_status_str(st), msg, want);
        bad = 1;
    }
    /* Both came back: a communicator on the CPU works now. */
    cfg.device = "cpu";
    if (!bad && kpl_comm_create(&cfg, &comm) < 0) {
        fprintf(stderr, "WRONG rank %d: comm_create after the refusal: %s\n", rank,
                kpl_last_error());
        bad = 1;
    }
    if (comm) {
        int64_t n = 3;
        kpl_tensor *t = NULL;
        double sum = -1;
        if (kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &n, &t) < 0 ||
            kpl_k_fill(t, rank + 1) < 0 || kpl_comm_allreduce(comm, t, t, KPL_COMM_SUM) < 0 ||
            kpl_tensor_get(t, 2, &sum) < 0 || sum != 3) {
            fprintf(stderr, "WRONG rank %d: allreduce gave %g: %s\n", rank, sum,
                    kpl_last_error());
            bad = 1;
        }
        kpl_tensor_release(t);
        kpl_comm_destroy(comm);
    }
    int any = 0;
    MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!any) printf("DEVICES-OK rank %d: %s\n", rank, msg);
    return any;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "np2")) {
        int level;
        MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &level);
        int bad = run_np2();
        MPI_Finalize();
        return bad;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_all_cpu_and_failures),
        cmocka_unit_test(test_mixed_kinds),
        cmocka_unit_test(test_shared_gpu),
        cmocka_unit_test(test_long_rank_list),
    };
    return cmocka_run_group_tests_name("comm_devices", tests, NULL, NULL);
}
