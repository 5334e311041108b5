/*
 * launcher_impl.h — kplrun's internals shared by its files (not installed).
 */
#ifndef KPL_LAUNCHER_IMPL_H
#define KPL_LAUNCHER_IMPL_H

#include "launcher.h"

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>
#include <time.h>

/* `kplrun --agent ...` (agent.c): argv after "--agent". */
int kpl__agent_main(int argc, char **argv);
/* The processes of process group `id` (or, with session, of session
 * `id`) but this one, zombies left out, from /proc (agent.c).  With sig
 * 0: 1 when there is one, else 0; else each gets sig, and the count is
 * returned.  (kplrun's teardown before a restart: mpirun's session holds
 * everything a launch ran on this node, ranks' children included.) */
int kpl__launcher_procs(bool session, pid_t id, int sig);
/* NVIDIA GPUs this process may use (CUDA_VISIBLE_DEVICES honoured), from
 * the driver's files (no CUDA needed). */
int kpl__launcher_gpu_count(void);

/* One GPU as CUDA numbers it: cuda:k is the k-th of a list. */
#define KPL__GPU_PCI 32
typedef struct {
    char pci[KPL__GPU_PCI]; /* its PCI address ("0000:3b:00.0"), the name of its
                               directory in sysfs; "" when it cannot be known */
} kpl__gpu;

/* The GPUs a process with CUDA_VISIBLE_DEVICES = `visible` (NULL: unset)
 * sees, in CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID, into out
 * (up to max); returns how many.  `sysfs` is the driver's PCI directory
 * (/sys/bus/pci/drivers/nvidia), `proc` its per-GPU information
 * directory (/proc/driver/nvidia/gpus: UUIDs), either unreadable or NULL
 * when absent.  Indices, GPU UUIDs (or unique prefixes of them) and MIG
 * UUIDs are understood as CUDA does (gpus.c); an entry that names no GPU
 * ends the list, as in CUDA.  note (may be NULL) receives one line when
 * the list was cut or a GPU's PCI address is unknown, else "".  Pure but
 * for reading those directories; thread-safe. */
int kpl__launcher_visible_gpus(const char *sysfs, const char *proc, const char *visible,
                               kpl__gpu *out, int max, char *note, size_t note_len);

/* The wall clock (CLOCK_REALTIME, seconds): comparable across the hosts of
 * a job as far as their clocks agree (NTP: milliseconds); how kplrun
 * orders the ranks' ends, which its agents stamp. */
static inline double kpl__wall_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif /* KPL_LAUNCHER_IMPL_H */
