/*
 * trainer_setup.c — where a run stands before its first step: its rank and
 * world from the launcher's environment, threads, device, communicator,
 * and the run directory with its logs, metrics.jsonl, TensorBoard files
 * and config.yaml.
 */
#define _GNU_SOURCE
#include "run_impl.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static bool latest(const kpl_recipe *r, int64_t *steps, int max, char *path, size_t len);

/* Ranks from the launcher's environment: kplrun's, Open MPI's, MPICH's or
 * SLURM's (srun), so that nothing needs MPI before the loaders fork. */
void kpl__trainer_ranks_from_env(kpl_trainer *R)
{
    static const char *const sets[][4] = {
        {"KPL_RANK", "KPL_WORLD_SIZE", "KPL_LOCAL_RANK", "KPL_LOCAL_SIZE"},
        {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE"},
        {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
        {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
    };
    R->rank = 0, R->world = 1, R->local_rank = 0, R->local_size = 1;
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++) {
        const char *rk = getenv(sets[i][0]), *ws = getenv(sets[i][1]);
        if (i == 3 && !getenv("SLURM_STEP_ID")) continue; /* an allocation, not srun */
        if (!rk || !ws) continue;
        R->rank = atoi(rk);
        R->world = atoi(ws) > 0 ? atoi(ws) : 1;
        const char *lr = getenv(sets[i][2]), *ls = getenv(sets[i][3]);
        R->local_rank = lr ? atoi(lr) : R->rank;
        R->local_size = ls && atoi(ls) > 0 ? atoi(ls) : R->world;
        return;
    }
}

/* Whether s is "cuda" or "cuda:N" (N decimal digits). */
static bool names_cuda(const char *s)
{
    if (!strcmp(s, "cuda")) return true;
    if (strncmp(s, "cuda:", 5) || !s[5]) return false;
    for (const char *p = s + 5; *p; p++)
        if (*p < '0' || *p > '9') return false;
    return strlen(s + 5) <= 4;
}

kpl_status kpl__trainer_device_choice(const char *device, const char *env, int gpus,
                                      const char *why, int32_t local_rank, char *name, size_t len)
{
    if (!why || !*why) why = "CUDA reports no device";
    bool have_env = env && *env;
    KPL_CHECK(!have_env || !strcmp(env, "cpu") || names_cuda(env), KPL_EINVAL,
              "KPL_DEVICE='%s' (from the launcher's environment) is not a device: expected "
              "cpu or cuda:N", env);
    bool env_cuda = have_env && names_cuda(env);
    if (!strcmp(device, "auto") && have_env) {
        /* kplrun's pick: cuda:N only when it saw NVIDIA GPUs on this node.
         * Training on the CPU instead would be a silent 10-100x slowdown
         * of a job that was given GPUs. */
        KPL_CHECK(!env_cuda || gpus > 0, KPL_EDEVICE,
                  "device auto: the launcher found NVIDIA GPUs on this node and gave this "
                  "rank KPL_DEVICE=%s, but CUDA cannot use any: %s (fix the driver, or start "
                  "the fabric manager on an NVSwitch node; device: cpu trains on the CPU "
                  "on purpose)", env, why);
        snprintf(name, len, "%s", env);
    } else if (!strcmp(device, "auto")) {
        if (gpus > 0) snprintf(name, len, "cuda:%d", (int)(local_rank % gpus));
        else snprintf(name, len, "cpu");
    } else if (!strcmp(device, "cuda")) {
        KPL_CHECK(gpus > 0, KPL_EDEVICE, "device: cuda asked for, but CUDA cannot use any "
                  "GPU: %s", why);
        /* The launcher's pick counts only the GPUs this rank sees
         * (CUDA_VISIBLE_DEVICES); without one, a GPU per node-local rank. */
        if (env_cuda) snprintf(name, len, "%s", env);
        else snprintf(name, len, "cuda:%d", (int)(local_rank % gpus));
    } else {
        snprintf(name, len, "%s", device); /* cpu or cuda:N: kpl_device_get checks it */
    }
    return KPL_OK;
}

kpl_status kpl__trainer_pick_device(kpl_trainer *R)
{
    char name[48];
    KPL_TRY(kpl__trainer_device_choice(R->r->device, getenv("KPL_DEVICE"),
                                       kpl_device_count(KPL_DEVICE_CUDA),
                                       kpl_device_unavailable_reason(KPL_DEVICE_CUDA),
                                       R->local_rank, name, sizeof name));
    return kpl_device_get(name, &R->dev);
}

void kpl__trainer_pick_threads(kpl_trainer *R)
{
    int n = (int)R->r->threads;
    if (n == 0 && getenv("OMP_NUM_THREADS")) return; /* the user's choice stands */
    if (n == 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        n = (int)(cores > 0 ? cores : 1) / (R->local_size > 0 ? R->local_size : 1);
        if (n < 1) n = 1;
    }
    kpl_set_num_threads(n);
}

/* The newest complete checkpoint for --resume without a file: in run_dir
 * when the recipe names one, else in the newest runs/<name>-<time> that
 * has one (the names sort by time). */
bool kpl__trainer_latest_checkpoint(const kpl_recipe *r, char *path, size_t len)
{
    enum { MAX = 65536 };
    int64_t *steps = malloc(MAX * sizeof *steps);
    bool found = steps && latest(r, steps, MAX, path, len);
    free(steps);
    return found;
}

static bool latest(const kpl_recipe *r, int64_t *steps, int max, char *path, size_t len)
{
    char dir[PATH_MAX] = "";
    if (r->run_dir[0]) {
        snprintf(dir, sizeof dir, "%s/checkpoints", r->run_dir);
    } else {
        char prefix[KPL_RECIPE_NAME + 2], newest[NAME_MAX + 1] = "";
        snprintf(prefix, sizeof prefix, "%s-", r->name);
        DIR *d = opendir("runs");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (strncmp(e->d_name, prefix, strlen(prefix)) || strcmp(e->d_name, newest) <= 0)
                continue;
            char cd[PATH_MAX];
            int n = 0;
            snprintf(cd, sizeof cd, "runs/%s/checkpoints", e->d_name);
            if (kpl__checkpoint_list(cd, steps, max, &n) >= 0 && n > 0)
                snprintf(newest, sizeof newest, "%s", e->d_name);
        }
        if (d) closedir(d);
        if (!newest[0]) return false;
        snprintf(dir, sizeof dir, "runs/%s/checkpoints", newest);
    }
    int n = 0;
    if (kpl__checkpoint_list(dir, steps, max, &n) < 0 || n == 0) return false;
    kpl__checkpoint_path(dir, steps[n - 1], path, len);
    return true;
}

/* The run directory of a checkpoint: <run> for <run>/checkpoints/FILE
 * ("." for checkpoints/FILE); false (dir "") for a file elsewhere. */
static bool run_of_checkpoint(const char *ckpt, char *dir, size_t len)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s", ckpt);
    char *s = strrchr(p, '/');
    if (s) *s = 0;
    s = strrchr(p, '/');
    bool in_run = s ? !strcmp(s + 1, "checkpoints") : !strcmp(p, "checkpoints");
    if (in_run && s) *s = 0;
    snprintf(dir, len, "%s", !in_run ? "" : s ? p : ".");
    return in_run;
}

void kpl__trainer_restart_checkpoint(kpl_trainer *R, const char **resume)
{
    if (R->resume.restart < 1) return;
    const kpl_recipe *r = R->r;
    char dir[PATH_MAX] = "";
    if (r->run_dir[0]) snprintf(dir, sizeof dir, "%s", r->run_dir);
    else if (*resume && (*resume)[0]) run_of_checkpoint(*resume, dir, sizeof dir);
    else if (!*resume && R->resume.job_id[0]) snprintf(dir, sizeof dir, "runs/%s-%s", r->name, R->resume.job_id);
    /* --resume alone: the newest checkpoint of the recipe's runs, which is
     * the one this job continued, or one that it wrote since */
    if (*resume && !(*resume)[0] && !dir[0]) {
        snprintf(R->resume.restart_note, sizeof R->resume.restart_note, "continuing from the newest checkpoint "
                 "of runs/%s-* (--resume)", r->name);
        return;
    }
    if (!dir[0]) {
        snprintf(R->resume.restart_note, sizeof R->resume.restart_note, "the run directory of the launch "
                 "before is not known (no run_dir, no job id): starting %s",
                 *resume ? "from the given checkpoint" : "a new run");
        return;
    }
    char cd[PATH_MAX + 16];
    snprintf(cd, sizeof cd, "%s/checkpoints", dir);
    enum { MAX = 65536 };
    int64_t *steps = malloc(MAX * sizeof *steps);
    int n = 0;
    if (steps && kpl__checkpoint_list(cd, steps, MAX, &n) >= 0 && n > 0) {
        kpl__checkpoint_path(cd, steps[n - 1], R->resume.path, sizeof R->resume.path);
        *resume = R->resume.path;
        R->resume.reset_optimizer = false; /* the state is this run's own */
        snprintf(R->resume.restart_note, sizeof R->resume.restart_note, "continuing from the newest complete "
                 "checkpoint of %s", dir);
    } else {
        snprintf(R->resume.restart_note, sizeof R->resume.restart_note, "no complete checkpoint in %s: %s", cd,
                 !*resume ? "starting fresh" : (*resume)[0] ? "starting from the given checkpoint"
                                                            : "resuming as --resume says");
    }
    free(steps);
}

kpl_status kpl__trainer_make_comm(kpl_trainer *R)
{
    if (R->world == 1) return KPL_OK;
    const kpl_recipe *r = R->r;
    kpl_comm_config cc = r->dist.comm;
    cc.device = kpl_device_name(R->dev);
    KPL_TRY(kpl_comm_create(&cc, &R->comm));
    KPL_CHECK(kpl_comm_rank(R->comm) == R->rank && kpl_comm_size(R->comm) == R->world, KPL_ESTATE,
              "the launcher's environment says rank %d of %d, MPI says rank %d of %d",
              (int)R->rank, (int)R->world, (int)kpl_comm_rank(R->comm),
              (int)kpl_comm_size(R->comm));
    return KPL_OK;
}

/* One run per directory: rank 0 holds RUN_DIR/.kpl-run.lock for the run's
 * life (the other ranks write only their logs there).  A second run is
 * refused before it touches anything (its start would remove the first
 * one's checkpoint in flight as unfinished); a dead run's lock is free. */
static kpl_status lock_run_dir(kpl_trainer *R)
{
    char path[PATH_MAX + 32], holder[512], prev[512];
    snprintf(path, sizeof path, "%s/.kpl-run.lock", R->run_dir);
    KPL_TRY(kpl__lockfile_try(path, &R->run_lock, holder, sizeof holder, prev, sizeof prev));
    KPL_CHECK(R->run_lock >= 0, KPL_ESTATE,
              "run directory %s is in use by another run (%s, holding %s): give this one its own "
              "run_dir, or wait for that one to end", R->run_dir, holder, path);
    if (prev[0])
        kpl__log_info(&R->log, "run directory %s: the run before this one (%s) ended without "
                      "releasing it; taken over", R->run_dir, prev);
    return KPL_OK;
}

/* Rank 0 names the run directory (the recipe's run_dir, the resumed
 * checkpoint's run, or runs/<name>-<time>) and tells the others. */
kpl_status kpl__trainer_make_run_dir(kpl_trainer *R)
{
    const kpl_recipe *r = R->r;
    kpl_status st = KPL_OK;
    if (R->rank == 0) {
        if (r->run_dir[0]) {
            snprintf(R->run_dir, sizeof R->run_dir, "%s", r->run_dir);
        } else if (R->resume.ckpt) {
            /* <run>/checkpoints/ckpt-N.kpl -> <run> */
            if (!run_of_checkpoint(R->resume.path, R->run_dir, sizeof R->run_dir))
                snprintf(R->run_dir, sizeof R->run_dir, "runs/%s-resumed-%lld", r->name,
                         (long long)time(NULL));
        } else if (R->resume.job_id[0]) {
            /* every launch of the job the same directory; the first one's
             * must be new (another job's would be resumed by a restart) */
            snprintf(R->run_dir, sizeof R->run_dir, "runs/%s-%s", r->name, R->resume.job_id);
            st = kpl__mkdirs("runs");
            if (st >= 0 && mkdir(R->run_dir, 0755) != 0) {
                if (errno != EEXIST)
                    st = KPL_ERROR(KPL_EIO, "cannot create %s: %s", R->run_dir, strerror(errno));
                else if (R->resume.restart < 1)
                    st = KPL_ERROR(KPL_ESTATE, "run directory %s exists already, but this is the "
                                   "first launch of job %s (KPL_JOB_ID): give another job id, a "
                                   "run_dir, or --resume to continue that run", R->run_dir,
                                   R->resume.job_id);
            }
        } else {
            time_t t = time(NULL);
            struct tm tm;
            char ts[32];
            localtime_r(&t, &tm);
            strftime(ts, sizeof ts, "%Y%m%d-%H%M%S", &tm);
            st = kpl__mkdirs("runs");
            for (int k = 1; st >= 0; k++) {
                if (k == 1) snprintf(R->run_dir, sizeof R->run_dir, "runs/%s-%s", r->name, ts);
                else snprintf(R->run_dir, sizeof R->run_dir, "runs/%s-%s-%d", r->name, ts, k);
                if (mkdir(R->run_dir, 0755) == 0) break;
                if (errno != EEXIST) {
                    st = KPL_ERROR(KPL_EIO, "cannot create %s: %s", R->run_dir, strerror(errno));
                    break;
                }
            }
        }
        if (st >= 0) st = kpl__mkdirs(R->run_dir);
        if (st >= 0) st = lock_run_dir(R);
        snprintf(R->ckpt_dir, sizeof R->ckpt_dir, "%s/checkpoints", R->run_dir);
        if (st >= 0) st = kpl__mkdirs(R->ckpt_dir);
        char logs[PATH_MAX + 8];
        snprintf(logs, sizeof logs, "%s/logs", R->run_dir);
        if (st >= 0) st = kpl__mkdirs(logs);
    }
    if (R->comm) {
        /* every rank learns the name, or that rank 0 failed */
        int64_t len = PATH_MAX;
        kpl_tensor *t = NULL;
        KPL_TRY(kpl_tensor_zeros(kpl_device_cpu(), KPL_U8, 1, &len, &t));
        char *p = kpl_tensor_host_mutable(t);
        if (R->rank == 0) snprintf(p, PATH_MAX, "%s", st >= 0 ? R->run_dir : "");
        kpl_status bs = kpl_comm_broadcast(R->comm, t, 0);
        if (bs >= 0 && R->rank != 0) {
            p = kpl_tensor_host_mutable(t);
            p[PATH_MAX - 1] = 0;
            snprintf(R->run_dir, sizeof R->run_dir, "%s", p);
            snprintf(R->ckpt_dir, sizeof R->ckpt_dir, "%s/checkpoints", R->run_dir);
            if (!R->run_dir[0])
                bs = KPL_ERROR(KPL_EIO, "rank 0 could not take the run directory (its log says "
                               "why)");
            else
                kpl__mkdirs(R->ckpt_dir); /* the run directory may be local to each node */
        }
        kpl_tensor_release(t);
        if (st >= 0) st = bs;
    }
    KPL_TRY(st);
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/logs", R->run_dir);
    kpl__mkdirs(path);
    snprintf(path, sizeof path, "%s/logs/rank-%05d.log", R->run_dir, (int)R->rank);
    R->log.log = fopen(path, "a");
    KPL_CHECK(R->log.log, KPL_EIO, "cannot open %s: %s", path, strerror(errno));
    if (R->rank != 0) return KPL_OK;
    snprintf(path, sizeof path, "%s/metrics.jsonl", R->run_dir);
    R->log.metrics = fopen(path, "a");
    KPL_CHECK(R->log.metrics, KPL_EIO, "cannot open %s: %s", path, strerror(errno));
    if (r->log.tensorboard) {
        snprintf(path, sizeof path, "%s/tb", R->run_dir);
        KPL_TRY(kpl_tb_writer_create(path, &R->log.tb));
    }
    /* the resolved recipe: config.yaml, or beside it when a resume differs */
    char *yaml = NULL;
    KPL_TRY(kpl_recipe_to_yaml(r, &yaml));
    snprintf(path, sizeof path, "%s/config.yaml", R->run_dir);
    FILE *old = fopen(path, "r");
    bool differs = true;
    if (old) {
        size_t n = strlen(yaml);
        char *buf = malloc(n + 2);
        if (buf) {
            size_t got = fread(buf, 1, n + 1, old);
            differs = got != n || memcmp(buf, yaml, n);
            free(buf);
        }
        fclose(old);
        if (differs)
            snprintf(path, sizeof path, "%s/config-resume-%lld.yaml", R->run_dir,
                     (long long)(R->resume.ckpt ? R->step : 0));
    }
    st = KPL_OK;
    if (differs) {
        FILE *f = fopen(path, "w");
        if (!f || fputs(yaml, f) < 0 || fclose(f) != 0)
            st = KPL_ERROR(KPL_EIO, "cannot write %s: %s", path, strerror(errno));
    }
    free(yaml);
    return st;
}

