/*
 * launcher.h — kplrun, the job launcher: which hosts a job runs on (given,
 * or found in a SLURM or PBS allocation), the mpirun command that starts
 * its ranks, and whom a rank that timed out was waiting for.  The kplrun
 * program (kplrun.c) adds the rank agent (agent.c),
 * the merged console, the per-rank logs and the failure handling; this
 * header is the part its tests and other tools share.
 *
 *   kpl_hostlist h = {0};
 *   kpl_hosts_from_slurm("node[01-03],gpu7", "8(x3),4", &h);  // 4 hosts, 28 slots
 *   kpl_launch_config c = KPL_LAUNCH_CONFIG_INIT;
 *   c.np = 28; c.hosts = &h; c.agent = "/opt/kpl/bin/kplrun"; ...
 *   char **argv = NULL;
 *   kpl_launch_mpirun_argv(&c, command_argc, command_argv, &argv);
 *   ... execvp(argv[0], argv) ...
 *   kpl_launch_free_argv(argv);
 *   kpl_hosts_free(&h);
 */
#ifndef KPL_LAUNCHER_H
#define KPL_LAUNCHER_H

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KPL_HOST_NAME_MAX 256

typedef struct {
    char name[KPL_HOST_NAME_MAX];
    int slots; /* ranks it may take (>= 1) */
} kpl_host;

/* A plain value with one owned array; kpl_hosts_free releases it. */
typedef struct {
    kpl_host *host;
    int n;
} kpl_hostlist;

/* "h1:8,h2:8" or "h1,h2" (1 slot each); a host named twice adds up.
 * KPL_EINVAL naming the entry at fault. */
kpl_status kpl_hosts_parse(const char *spec, kpl_hostlist *out);
/* A hostfile: Open MPI's ("host slots=8 max_slots=16", "# comments") or
 * a list of names, one per line, each line one slot (PBS_NODEFILE's form:
 * a name repeated N times has N slots).  KPL_EIO / KPL_EINVAL naming the
 * file and line. */
kpl_status kpl_hosts_read_file(const char *path, kpl_hostlist *out);
/* SLURM's compressed node list ("node[01-04,07],gpu3") with the tasks per
 * node ("8", "8(x4),2", NULL for 1 each) as SLURM_NTASKS_PER_NODE or
 * SLURM_TASKS_PER_NODE give them. */
kpl_status kpl_hosts_from_slurm(const char *nodelist, const char *tasks_per_node,
                                kpl_hostlist *out);
void kpl_hosts_free(kpl_hostlist *l);
int kpl_hosts_slots(const kpl_hostlist *l);

/* What kplrun decided; kpl_launch_mpirun_argv turns it into a command. */
typedef struct {
    const char *mpirun;         /* "mpirun" */
    int np;                     /* ranks */
    const kpl_hostlist *hosts;  /* NULL: this machine only */
    const char *hostfile;       /* passed as --hostfile (instead of hosts) */
    int cores_per_node;         /* of this machine (taken for every node) */
    int gpus_per_node;          /* 0: CPU ranks bound to cores */
    bool as_root;               /* add --allow-run-as-root */
    bool ucx;                   /* point-to-point over UCX (pml ucx) */
    const char *agent;          /* the kplrun binary that wraps each rank */
    const char *log_dir;        /* per-rank logs */
    const char *channel;        /* "ADDR,...:PORT:TOKEN" kplrun listens on for the agents' lines (NULL: none) */
    bool bar;                   /* rank 0 draws a progress bar for kplrun's console */
    int columns;                /* the console's width, for that bar */
    int nextra;                 /* more mpirun arguments (user's --mca, -x), before the command */
    const char *const *extra;
    const char *job_id;         /* the job's name for its ranks (KPL_JOB_ID; NULL: none) */
    int restart;                /* this launch of the job: 0 the first, k the k-th restart */
    int max_restarts;           /* how many kplrun may make (--max-restarts) */
    const char *restart_reason; /* restart >= 1: what failed the launch before (NULL: none) */
} kpl_launch_config;
#define KPL_LAUNCH_CONFIG_INIT                                                               \
    {"mpirun", 1, NULL, NULL, 1, 0, false, false, "kplrun", "kplrun-logs", NULL, false, 80, 0, NULL, \
     NULL, 0, 0, NULL}

/* The mpirun command line (NULL-terminated, malloc'd: kpl_launch_free_argv):
 *   mpirun -np N [--allow-run-as-root] [--oversubscribe] [--host ... | --hostfile F]
 *          GPUs: --map-by ppr:G:node --bind-to none (the agent binds to the GPU's NUMA node)
 *          CPUs: --map-by slot:PE=k --bind-to core -x OMP_NUM_THREADS=k, k = cores per rank
 *                (more ranks than cores: --bind-to none, OMP_NUM_THREADS=1)
 *          [--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any]
 *          --mca mpi_yield_when_idle 1
 *          [several hosts: --mca oob_tcp_keepalive_time 10 (_intvl 2, _probes 3)]
 *          EXTRA... AGENT --agent --log-dir D [--channel SPEC] [--bar --columns C]
 *          [--job-id ID] [--restart K --max-restarts N [--restart-reason TEXT]] -- COMMAND...
 * (the restart options when max_restarts > 0: the agent puts them in the
 * rank's environment, so that every node gets them, not only this one).
 * *ranks_per_node and *threads (may be NULL) receive the layout chosen. */
kpl_status kpl_launch_mpirun_argv(const kpl_launch_config *c, int argc, char *const *argv,
                                  char ***out, int *ranks_per_node, int *threads);
void kpl_launch_free_argv(char **argv);
/* argv as one shell-quoted line (malloc'd), for --dry-run and messages. */
char *kpl_launch_argv_string(char *const *argv);

/* Whom a rank that timed out in a collective was waiting for, from its
 * communicator's report (collective.h):
 *   "kpl[0] comm: allreduce #7 (f32, 10 elements) on backend mpi, rank 0 of 4:
 *    timed out after 300 s; not joined: rank 3: no answer for 302.0 s
 *    (stopped or hung?); joined: ranks 0-2; the ranks are out of step: ..."
 * gives op "allreduce #7", ranks "3", first 3, detail "rank 3: no answer
 * for 302.0 s (stopped or hung?)".  A plain value. */
typedef struct {
    char op[64];      /* the collective: "allreduce #7" */
    char ranks[128];  /* the ranks it waited for: "3", "1-2, 5" */
    int first;        /* the first of them */
    bool plural;      /* more than one */
    bool device;      /* a device collective they have not issued (else: not joined) */
    char detail[512]; /* what the report says of them */
} kpl_launch_stall;

/* Reads one line of a rank's output: true, with *out filled, when it is
 * such a report naming at least one rank; false for any other line
 * (including "not joined: none").  Never reads past the line's end. */
bool kpl_launch_parse_timeout(const char *line, kpl_launch_stall *out);

/* ---- the verdict ------------------------------------------------------------------ */

/* One rank's end, as its agent reported it. */
typedef struct {
    bool seen;        /* the agent said how the rank ended */
    char host[256];
    int pid, status, sig;
    double seconds;   /* the rank's run time */
    double at;        /* when it ended, by its agent's wall clock (the report of a rank
                         that died first may arrive last): the first failure wins */
} kpl_launch_end;

typedef enum {
    KPL_VERDICT_OK,            /* every rank ended well */
    KPL_VERDICT_TIMEOUT,       /* --timeout stopped the job */
    KPL_VERDICT_RANK,          /* a rank failed (or was interrupted): `rank` */
    KPL_VERDICT_MPIRUN,        /* mpirun failed with no rank to blame */
    KPL_VERDICT_SILENT,        /* ranks ended without a word from their agents */
    KPL_VERDICT_STOPPED,       /* every rank stopped on a signal, all with status 130 or
                                  all with 143 (`status`): a stop, not a failure */
    KPL_VERDICT_KILLED         /* kplrun asked the ranks to stop (`sig`), and they ended
                                  without saying how: kplrun killed them (`hard`: a second
                                  signal, --stop-timeout), or the signal reached mpirun and
                                  the agents too (a scheduler's stop of every process) */
} kpl_verdict_kind;

typedef struct {
    kpl_verdict_kind kind;
    int rank;           /* KPL_VERDICT_RANK: the rank to blame */
    bool from_mpirun;   /* ... named by mpirun's notice (its agent could not speak) */
    bool interrupted;   /* ... its end is the stop the user asked for */
    bool hard;          /* KPL_VERDICT_KILLED: kplrun killed the ranks */
    int status, sig;    /* ... how it ended */
    int missing;        /* ranks whose agents said nothing */
    int exit_code;      /* kplrun's exit status */
} kpl_launch_verdict;

/* How the job ended, from the ranks' ends (np of them), what mpirun's own
 * notice named (mp_rank -1: none; its status or signal), mpirun's exit
 * (wait status), whether --timeout stopped it and whether the user
 * interrupted.  Every rank exiting 130, or every rank 143, is a stop
 * (kpl train's, on SIGINT / SIGTERM, with its checkpoint), whoever sent
 * the signal.  Otherwise the rank to blame is the first (by `at`) that
 * ended badly; one that ended by SIGTERM was most likely torn down after
 * another failed and is blamed only when no other is.  Exit status: 124
 * after a timeout, else the stop's or the blamed rank's (128 + signal
 * when killed), else mpirun's.  stop_sig: the signal (SIGINT or SIGTERM)
 * with which kplrun asked the ranks to stop, 0 if it did not; killed:
 * kplrun then stopped them hard.  After a stop was asked, ranks that said
 * nothing or ended by the stop's signals ended by the stop
 * (KPL_VERDICT_KILLED, 128 + stop_sig), not by a failure of mpirun's. */
void kpl_launch_judge(const kpl_launch_end *ends, int np, int mp_rank, int mp_status,
                      int mp_sig, int mpirun_wstatus, bool timed_out, int interrupts,
                      int stop_sig, bool killed, kpl_launch_verdict *v);

#ifdef __cplusplus
}
#endif
#endif /* KPL_LAUNCHER_H */
