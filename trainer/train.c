/*
 * train.c — `kpl train` and `kpl eval`: a recipe becomes a run.
 *
 * Order of start-up, and why:
 *   1. ranks from the launcher's environment (no MPI yet), threads, device;
 *   2. data: missing splits converted (one process per node), the
 *      checkpoint to resume from read (its data position is needed next);
 *   3. the loaders, which fork their processes before any thread exists;
 *   4. the communicator (MPI, its threads), the run directory (rank 0
 *      names it, the others learn it), logs;
 *   5. model, optimizer, restored state, DDP (rank 0's values to all).
 * Then the epochs: steps of `accumulate` micro-batches, the bucketed
 * allreduce overlapping backward, clipping, the schedule's lr, the
 * optimizer; evaluation, checkpoints and metrics at their intervals.
 * SIGINT / SIGTERM end the run at the next agreed point with a
 * checkpoint.
 */
#define _GNU_SOURCE
#include "trainer_impl.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- signals ------------------------------------------------------------------------- */

static volatile sig_atomic_t stop_signal;

static void on_signal(int sig)
{
    if (stop_signal == SIGINT && sig == SIGINT) { /* a second Ctrl-C: now */
        signal(SIGINT, SIG_DFL);
        raise(SIGINT);
    }
    stop_signal = sig;
}

bool kpl__stop_requested(void) { return stop_signal != 0; }

static void catch_signals(bool on)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on ? on_signal : SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if (on) stop_signal = 0;
}

/* ---- the run ----------------------------------------------------------------------------- */

typedef struct {
    double loss_sum, correct, count; /* train: since the last report */
    bool nonfinite;                  /* a micro-batch of the current step had a NaN/inf loss */
} train_acc;

typedef struct {
    double loss, top1, top5;
    int64_t examples;
    int64_t nonfinite;  /* examples whose outputs were NaN or inf (counted as wrong) */
    int64_t skipped;    /* corrupt examples the loader dropped (data.val.skip_corrupt) */
    int64_t *confusion; /* classes x classes (true row, predicted column) or NULL */
} eval_result;

typedef struct {
    const kpl_recipe *r;
    kpl__runlog log;
    int32_t rank, world, local_rank, local_size;
    kpl_device *dev;
    kpl_comm *comm;
    kpl_ddp *ddp;
    kpl_model *model;
    kpl_optim *opt;
    kpl_lr_schedule sched;
    kpl_loader *train, *val;
    char train_path[PATH_MAX], val_path[PATH_MAX];
    char run_dir[PATH_MAX], ckpt_dir[PATH_MAX + 16];
    int64_t batches_per_epoch, steps_per_epoch, total_steps;
    int64_t step, epoch, epoch_step; /* steps done; the epoch in progress; its steps done */
    double lr_scale;
    double best_top1;
    int64_t best_step;
    int64_t skipped_steps, skips_in_row; /* loss.nonfinite skip: updates left out */
    int64_t skipped_examples;            /* train: corrupt examples dropped, all ranks */
    int64_t train_skipped_seen;          /* this rank's loader count already reported */
    bool eval_pending; /* the checkpoint being written precedes its evaluation */
    kpl_checkpoint *resume; /* the checkpoint resumed from, until its state is restored */
    char resume_path[PATH_MAX];
    /* the latest figures, for the final report */
    double train_loss, train_acc, images_per_sec;
    bool have_val;
    eval_result val_res;
    double t_start;
} run;

/* Ranks from the launcher's environment: kplrun's, Open MPI's, MPICH's or
 * SLURM's (srun), so that nothing needs MPI before the loaders fork. */
static void ranks_from_env(run *R)
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

static int64_t now_seconds(void) { return (int64_t)time(NULL); }

/* ---- JSON helpers ------------------------------------------------------------------------ */

/* Numbers as JSON: non-finite ones become null (JSON has no NaN). */
static void jnum(char *buf, size_t len, double v)
{
    if (isfinite(v)) snprintf(buf, len, "%.9g", v);
    else snprintf(buf, len, "null");
}

/* ---- start-up pieces ---------------------------------------------------------------------- */

static kpl_status pick_device(run *R)
{
    const char *d = R->r->device;
    int gpus = kpl_device_count(KPL_DEVICE_CUDA);
    char name[32];
    const char *chosen = getenv("KPL_DEVICE"); /* kplrun's pick for this rank */
    if (!strcmp(d, "auto") && chosen && (!strcmp(chosen, "cpu") || gpus > 0)) {
        snprintf(name, sizeof name, "%s", chosen);
    } else if (!strcmp(d, "auto")) {
        if (gpus > 0) snprintf(name, sizeof name, "cuda:%d", R->local_rank % gpus);
        else snprintf(name, sizeof name, "cpu");
    } else if (!strcmp(d, "cuda")) {
        KPL_CHECK(gpus > 0, KPL_EDEVICE, "device: cuda asked for, but no CUDA GPU was found%s",
                  kpl_device_type_built(KPL_DEVICE_CUDA) ? "" : " (this kpl has no CUDA backend)");
        snprintf(name, sizeof name, "cuda:%d", R->local_rank % gpus);
    } else {
        snprintf(name, sizeof name, "%s", d);
    }
    return kpl_device_get(name, &R->dev);
}

static void pick_threads(run *R)
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
static bool latest_run_checkpoint(const kpl_recipe *r, char *path, size_t len)
{
    static int64_t steps[65536];
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
            if (kpl__checkpoint_list(cd, steps, 65536, &n) >= 0 && n > 0)
                snprintf(newest, sizeof newest, "%s", e->d_name);
        }
        if (d) closedir(d);
        if (!newest[0]) return false;
        snprintf(dir, sizeof dir, "runs/%s/checkpoints", newest);
    }
    int n = 0;
    if (kpl__checkpoint_list(dir, steps, 65536, &n) < 0 || n == 0) return false;
    kpl__checkpoint_path(dir, steps[n - 1], path, len);
    return true;
}

/* The state the checkpoint's metadata holds, read before the loaders
 * exist (they start where the checkpoint stopped). */
typedef struct {
    int64_t step, epoch, position, epoch_step, world_size, batch_size, accumulate;
    double best_top1;
    int64_t best_step, skipped_steps, skipped_examples;
    bool eval_pending; /* written before its epoch's evaluation, which is still to run */
    json_t *rng;       /* per-rank [seed, offset] of the model's generator */
} resume_meta;

static kpl_status read_resume_meta(const kpl_checkpoint *c, const char *path, resume_meta *m)
{
    memset(m, 0, sizeof *m);
    json_error_t err;
    json_t *j = json_loads(kpl_checkpoint_meta(c), 0, &err);
    KPL_CHECK(j, KPL_EFORMAT, "%s: metadata: %s", path, err.text);
    json_t *t = json_object_get(j, "train");
    int64_t *ints[] = {&m->step, &m->epoch, &m->position, &m->epoch_step, &m->world_size,
                       &m->batch_size, &m->accumulate, &m->best_step};
    const char *names[] = {"step", "epoch", "position", "epoch_step", "world_size",
                           "batch_size", "accumulate", "best_step"};
    kpl_status st = KPL_OK;
    for (size_t i = 0; i < sizeof ints / sizeof ints[0] && st >= 0; i++) {
        json_t *v = json_object_get(t, names[i]);
        if (!v)
            st = KPL_ERROR(KPL_EFORMAT, "%s: not a training checkpoint (metadata train.%s "
                           "missing): was it written by kpl train?", path, names[i]);
        else if (!json_is_integer(v) || json_integer_value(v) < 0)
            st = KPL_ERROR(KPL_EFORMAT, "%s: metadata train.%s is %s, expected an integer >= 0",
                           path, names[i], json_is_integer(v) ? "negative" : "not an integer");
        else *ints[i] = (int64_t)json_integer_value(v);
    }
    if (st >= 0 && (m->world_size < 1 || m->batch_size < 1 || m->accumulate < 1))
        st = KPL_ERROR(KPL_EFORMAT, "%s: metadata train.world_size, batch_size and accumulate "
                       "must be >= 1 (got %lld, %lld, %lld)", path, (long long)m->world_size,
                       (long long)m->batch_size, (long long)m->accumulate);
    json_t *b = json_object_get(t, "best_top1");
    m->best_top1 = json_is_number(b) ? json_number_value(b) : -1;
    json_t *sk = json_object_get(t, "skipped_steps");
    m->skipped_steps = json_is_integer(sk) && json_integer_value(sk) > 0 ? json_integer_value(sk) : 0;
    sk = json_object_get(t, "skipped_examples");
    m->skipped_examples = json_is_integer(sk) && json_integer_value(sk) > 0 ? json_integer_value(sk) : 0;
    m->eval_pending = json_is_true(json_object_get(t, "eval_pending"));
    m->rng = json_incref(json_object_get(t, "rng"));
    json_decref(j);
    return st;
}

static kpl_status make_loaders(run *R, const resume_meta *rm)
{
    const kpl_recipe *r = R->r;
    kpl_loader_config c;
    kpl__data_split_path(r, &r->data.train, R->train_path, sizeof R->train_path);
    kpl__data_loader_config(r, &r->data.train, R->train_path, true, R->rank, R->world, &c);
    c.device = R->dev;
    if (rm) {
        c.start_epoch = rm->epoch;
        c.start_position = rm->position;
        if (rm->world_size != R->world || rm->batch_size != r->data.train.batch_size) {
            /* Another split of the data: keep the epoch, and as much of it
             * as the other ranks had seen (the order within it changes). */
            int64_t seen = rm->position * rm->world_size;
            c.start_position = seen / R->world / c.batch_size * c.batch_size;
            kpl__log_warn(&R->log,
                          "resuming %lld ranks x batch %lld as %d x %lld: epoch %lld continues at "
                          "sample %lld of this rank, in a different order than the first run",
                          (long long)rm->world_size, (long long)rm->batch_size, (int)R->world,
                          (long long)c.batch_size, (long long)rm->epoch + 1,
                          (long long)c.start_position);
        }
    }
    KPL_TRY(kpl_loader_create(&c, &R->train));
    R->batches_per_epoch = kpl_loader_batches_per_epoch(R->train);
    int64_t k = r->optimizer.accumulate;
    R->steps_per_epoch = (R->batches_per_epoch + k - 1) / k;
    R->total_steps = R->steps_per_epoch * r->epochs;
    if (r->data.val.path[0]) {
        kpl__data_split_path(r, &r->data.val, R->val_path, sizeof R->val_path);
        kpl__data_loader_config(r, &r->data.val, R->val_path, false, R->rank, R->world, &c);
        c.device = R->dev;
        KPL_TRY(kpl_loader_create(&c, &R->val));
    }
    return KPL_OK;
}

static kpl_status make_comm(run *R)
{
    if (R->world == 1) return KPL_OK;
    const kpl_recipe *r = R->r;
    kpl_comm_config cc = KPL_COMM_CONFIG_INIT;
    cc.backend = (kpl_comm_backend)r->dist.backend;
    cc.timeout = r->dist.timeout;
    cc.stall_warning = r->dist.stall_warning;
    cc.device = kpl_device_name(R->dev);
    KPL_TRY(kpl_comm_create(&cc, &R->comm));
    KPL_CHECK(kpl_comm_rank(R->comm) == R->rank && kpl_comm_size(R->comm) == R->world, KPL_ESTATE,
              "the launcher's environment says rank %d of %d, MPI says rank %d of %d",
              (int)R->rank, (int)R->world, (int)kpl_comm_rank(R->comm),
              (int)kpl_comm_size(R->comm));
    return KPL_OK;
}

/* Rank 0 names the run directory (the recipe's run_dir, the resumed
 * checkpoint's run, or runs/<name>-<time>) and tells the others. */
static kpl_status make_run_dir(run *R)
{
    const kpl_recipe *r = R->r;
    kpl_status st = KPL_OK;
    if (R->rank == 0) {
        if (r->run_dir[0]) {
            snprintf(R->run_dir, sizeof R->run_dir, "%s", r->run_dir);
        } else if (R->resume) {
            /* <run>/checkpoints/ckpt-N.kpl -> <run> */
            char p[PATH_MAX];
            snprintf(p, sizeof p, "%s", R->resume_path);
            char *s = strrchr(p, '/');
            if (s) *s = 0;
            s = strrchr(p, '/');
            bool in_run = s ? !strcmp(s + 1, "checkpoints") : !strcmp(p, "checkpoints");
            if (in_run && s) *s = 0;
            else if (in_run) snprintf(p, sizeof p, ".");
            else snprintf(p, sizeof p, "runs/%s-resumed-%lld", r->name, (long long)now_seconds());
            snprintf(R->run_dir, sizeof R->run_dir, "%s", p);
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
                bs = KPL_ERROR(KPL_EIO, "rank 0 could not create the run directory");
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
                     (long long)(R->resume ? R->step : 0));
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

/* optimizer.groups: multipliers by name, each group reported once */
static kpl_status apply_groups(run *R)
{
    const kpl_recipe *r = R->r;
    int n = kpl_model_num_params(R->model), counts[KPL_RECIPE_LIST];
    if (!r->optimizer.ngroups) return KPL_OK;
    const char **names = malloc((size_t)n * sizeof *names);
    KPL_CHECK(names, KPL_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) names[i] = kpl_model_param_name(R->model, i);
    kpl_status st = kpl_optim_set_groups(R->opt, names, r->optimizer.ngroups,
                                         r->optimizer.groups, counts);
    free(names);
    KPL_TRY(st);
    for (int g = 0; g < r->optimizer.ngroups && R->rank == 0; g++)
        kpl__log_info(&R->log, "optimizer group '%s': %d parameters, lr x %g, weight decay x %g",
                      r->optimizer.groups[g].params, counts[g], r->optimizer.groups[g].lr_mult,
                      r->optimizer.groups[g].weight_decay_mult);
    return KPL_OK;
}

static kpl_status make_model(run *R, const int64_t *chw)
{
    const kpl_recipe *r = R->r;
    kpl_model_config mc;
    memset(&mc, 0, sizeof mc);
    mc.arch = (kpl_model_arch)r->model.arch;
    mc.num_classes = r->model.num_classes;
    mc.in_channels = chw[0], mc.in_h = chw[1], mc.in_w = chw[2];
    mc.width = r->model.width;
    mc.depth = r->model.depth;
    mc.cifar_stem = r->model.stem == 1;
    mc.nhidden = r->model.nhidden;
    memcpy(mc.hidden, r->model.hidden, sizeof r->model.hidden);
    mc.dropout = r->model.dropout;
    mc.zero_init_residual = r->model.zero_init_residual;
    /* Every rank initialises from the seed; DDP then broadcasts rank 0's
     * values anyway.  Dropout masks differ per rank: their generator is
     * offset by the rank below. */
    KPL_TRY(kpl_model_create_config(&mc, R->dev, (uint64_t)r->seed, &R->model));
    kpl_rng *rng = kpl_model_rng(R->model);
    kpl_rng_set_state(rng, (uint64_t)r->seed * 1000003u + (uint64_t)R->rank + 1, 0);

    int n = kpl_model_num_params(R->model);
    bool *nd = calloc((size_t)n, sizeof *nd);
    KPL_CHECK(nd, KPL_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++)
        nd[i] = r->optimizer.no_decay_bn_bias && kpl_model_param_is_bias_or_norm(R->model, i);
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    oc.kind = (kpl_optim_kind)r->optimizer.kind;
    R->lr_scale = 1;
    if (r->optimizer.lr_scaling == 1)
        R->lr_scale = (double)(r->data.train.batch_size * R->world * r->optimizer.accumulate) /
                      (double)r->optimizer.base_batch;
    oc.lr = r->optimizer.lr * R->lr_scale;
    oc.momentum = r->optimizer.momentum;
    oc.nesterov = r->optimizer.nesterov;
    oc.weight_decay = r->optimizer.weight_decay;
    oc.beta1 = r->optimizer.betas[0], oc.beta2 = r->optimizer.betas[1];
    oc.eps = r->optimizer.eps;
    oc.trust_coefficient = r->optimizer.trust_coefficient;
    kpl_status st = kpl_optim_create(&oc, n, kpl_model_params(R->model), nd, &R->opt);
    free(nd);
    KPL_TRY(st);
    KPL_TRY(apply_groups(R));

    kpl_lr_schedule *s = &R->sched;
    *s = (kpl_lr_schedule)KPL_LR_SCHEDULE_INIT;
    s->kind = (kpl_sched_kind)r->schedule.kind;
    s->base_lr = oc.lr;
    s->epochs = (double)r->epochs;
    s->warmup_epochs = r->schedule.warmup_epochs;
    s->warmup_factor = r->schedule.warmup_factor;
    s->step_size = r->schedule.step_size;
    s->gamma = r->schedule.gamma;
    s->num_milestones = r->schedule.nmilestones;
    memcpy(s->milestones, r->schedule.milestones, sizeof r->schedule.milestones);
    s->power = r->schedule.power;
    s->min_lr = r->schedule.min_lr * R->lr_scale;
    return kpl_lr_schedule_check(s);
}

/* Model, buffers, optimizer state and the dropout generator from the
 * checkpoint; names and shapes must match the recipe's model. */
static kpl_status restore_model(run *R, const kpl_checkpoint *c, const char *path)
{
    kpl_status st = kpl_module_state_load(kpl_model_module(R->model), c, "model.", true, NULL);
    /* a shape that differs names the file already; a name that does not */
    if (st == KPL_ENOTFOUND)
        return kpl__error_prefix(st, "%s: not a checkpoint of this recipe's model: ", path);
    KPL_TRY(st);
    return KPL_OK;
}

static kpl_status restore(run *R, const resume_meta *rm)
{
    kpl_checkpoint *c = R->resume;
    char name[320];
    KPL_TRY(restore_model(R, c, R->resume_path));
    const char *const *slots = NULL;
    int ns = kpl_optim_state_slots(R->opt, &slots);
    for (int i = 0; i < kpl_model_num_params(R->model); i++)
        for (int k = 0; k < ns; k++) {
            snprintf(name, sizeof name, "optim.%s.%s", kpl_model_param_name(R->model, i), slots[k]);
            kpl_tensor *t = kpl_checkpoint_find(c, name);
            if (t) KPL_TRY(kpl_optim_state_set(R->opt, i, k, t));
        }
    json_t *mine = json_array_get(rm->rng, (size_t)R->rank);
    if (!mine) mine = json_array_get(rm->rng, 0);
    if (json_is_array(mine) && json_array_size(mine) == 2)
        kpl_rng_set_state(kpl_model_rng(R->model),
                          (uint64_t)json_integer_value(json_array_get(mine, 0)),
                          (uint64_t)json_integer_value(json_array_get(mine, 1)));
    R->step = rm->step;
    R->epoch_step = rm->epoch_step;
    R->best_top1 = rm->best_top1;
    R->best_step = rm->best_step;
    R->skipped_steps = rm->skipped_steps;
    R->skipped_examples = rm->skipped_examples;
    /* every rank reads the marker, as it reads the checkpoint itself */
    R->eval_pending = rm->eval_pending && !kpl__checkpoint_evaluated(R->resume_path);
    if (rm->world_size != R->world || rm->batch_size != R->r->data.train.batch_size) {
        /* the epoch's steps are counted anew from the loader's position */
        int64_t ep = 0, pos = 0;
        kpl_loader_position(R->train, &ep, &pos);
        R->epoch_step = pos / R->r->data.train.batch_size / R->r->optimizer.accumulate;
    }
    return KPL_OK;
}

/* ---- collectives of the run -------------------------------------------------------------- */

/* v[0..n) summed over the ranks, in place (a no-op on one rank). */
static kpl_status reduce_sum(run *R, double *v, int n)
{
    if (!R->comm) return KPL_OK;
    int64_t len = n;
    kpl_tensor *t = NULL;
    KPL_TRY(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 1, &len, v, &t));
    kpl_status st = kpl_comm_allreduce(R->comm, t, t, KPL_COMM_SUM);
    if (st >= 0) st = kpl_tensor_to_host(t, v, (size_t)n * sizeof *v);
    kpl_tensor_release(t);
    return st;
}

/* ---- one step ------------------------------------------------------------------------------ */

/* The batch's images and labels where the model is (pool-owned copies on
 * a GPU; on the CPU the batch's own tensors, which view shared memory). */
static void batch_on_device(run *R, kpl_batch *b, kpl_tensor **x, kpl_tensor **y)
{
    *x = b->image, *y = b->label;
    if (kpl_device_type_of(R->dev) == KPL_DEVICE_CPU) return;
    *x = kpl_to_device(b->image, R->dev);
    *y = kpl_to_device(b->label, R->dev);
}

/* Forward and backward of one micro-batch, the loss scaled by `scale`;
 * adds the batch's loss and correct predictions to acc. */
static kpl_status micro_step(run *R, kpl_batch *b, double scale, train_acc *acc)
{
    kpl_pool *pool = kpl_pool_push();
    KPL_CHECK(pool, KPL_ENOMEM, "out of memory");
    kpl_status st = KPL_OK;
    kpl_tensor *x = NULL, *y = NULL, *scaled = NULL;
    batch_on_device(R, b, &x, &y);
    kpl_tensor *logits = kpl_model_forward(R->model, x, true);
    kpl_tensor *loss = kpl_cross_entropy(logits, y, KPL_REDUCE_MEAN, R->r->loss.label_smoothing,
                                         -100);
    kpl_tensor *pred = kpl_argmax(logits, 1, false);
    double lv = 0;
    if (!loss || !pred || (st = kpl_tensor_get(loss, 0, &lv)) < 0) {
        st = kpl_last_status() < 0 ? kpl_last_status() : KPL_ESTATE;
        goto out;
    }
    if (!isfinite(lv) && R->r->loss.nonfinite == 0) {
        st = KPL_ERROR(KPL_ERANGE, "the loss is %s at step %lld (epoch %lld, batch of samples "
                       "%lld..%lld): lower optimizer.lr, or set optimizer.clip_grad_norm (or "
                       "loss.nonfinite: skip to leave such steps out)",
                       isnan(lv) ? "NaN" : lv > 0 ? "inf" : "-inf", (long long)R->step + 1, (long long)R->epoch + 1,
                       (long long)b->position, (long long)(b->position + b->size - 1));
        goto out;
    }
    if (!isfinite(lv)) {
        /* loss.nonfinite skip: backward still runs (the other ranks wait
         * for this rank's gradients, which come out non-finite and make
         * every rank skip the step); the figures leave the batch out. */
        acc->nonfinite = true;
    } else {
        const int64_t *p = kpl_tensor_host_data(pred), *l = kpl_tensor_host_data(b->label);
        if (!p || !l) {
            st = kpl_last_status();
            goto out;
        }
        for (int64_t i = 0; i < b->size; i++) acc->correct += p[i] == l[i];
        acc->loss_sum += lv * (double)b->size;
        acc->count += (double)b->size;
    }
    scaled = scale != 1 ? kpl_scalar_op(KPL_BIN_MUL, loss, scale, false) : loss;
    if (!scaled) {
        st = kpl_last_status();
        goto out;
    }
    kpl_tensor_retain(scaled);
out:
    /* The forward pass's temporaries go before backward: what the
     * gradients need, the graph keeps (the reverse-mode GC frees it as
     * backward goes). */
    kpl_pool_pop(pool);
    if (st >= 0) st = kpl_backward(scaled, NULL, false);
    kpl_tensor_release(scaled);
    return st;
}

static double lr_now(const run *R)
{
    double t = (double)R->epoch;
    if (R->r->schedule.per == 0) t += (double)R->epoch_step / (double)R->steps_per_epoch;
    return kpl_lr_at(&R->sched, t);
}

/* The update of a step whose gradients are in .grad (averaged over the
 * ranks): clipping, then the optimizer, unless the gradients are not
 * finite.  The gradient norm is the same number on every rank, so every
 * rank takes the same decision without another collective. */
static kpl_status apply_step(run *R, const train_acc *acc)
{
    const kpl_recipe *r = R->r;
    int n = kpl_model_num_params(R->model);
    kpl_tensor *const *params = kpl_model_params(R->model);
    bool skip_mode = r->loss.nonfinite == 1;
    double norm = 0;
    if (skip_mode || r->optimizer.clip_grad_norm > 0)
        KPL_TRY(kpl_clip_grad_norm(n, params, r->optimizer.clip_grad_norm, &norm));
    bool bad = !isfinite(norm) || (R->world == 1 && acc->nonfinite);
    if (!bad) {
        R->skips_in_row = 0;
        kpl_optim_set_lr(R->opt, lr_now(R));
        return kpl_optim_step(R->opt);
    }
    if (!skip_mode)
        return KPL_ERROR(KPL_ERANGE, "the gradients are not finite at step %lld (epoch %lld; "
                         "their norm is %g): lower optimizer.lr, or set loss.nonfinite: skip to "
                         "leave such steps out", (long long)R->step + 1, (long long)R->epoch + 1,
                         fabs(norm));
    kpl_zero_grad(n, params);
    R->skipped_steps++;
    R->skips_in_row++;
    if (R->rank == 0)
        kpl__log_warn(&R->log, "step %lld (epoch %lld): %s not finite; its update is skipped "
                      "(%lld skipped, %lld in a row)", (long long)R->step + 1,
                      (long long)R->epoch + 1, acc->nonfinite ? "the loss is" : "the gradients are",
                      (long long)R->skipped_steps, (long long)R->skips_in_row);
    KPL_CHECK(r->loss.max_skips == 0 || R->skips_in_row < r->loss.max_skips, KPL_ERANGE,
              "%lld steps in a row up to step %lld had a NaN or inf loss or gradients "
              "(loss.max_skips %lld): the run has diverged; lower optimizer.lr, or set "
              "optimizer.clip_grad_norm", (long long)R->skips_in_row, (long long)R->step + 1,
              (long long)r->loss.max_skips);
    return KPL_OK;
}

/* One optimizer step of `accumulate` micro-batches (fewer at an epoch's
 * end); *epoch_done when it took the epoch's last batch. */
static kpl_status train_step(run *R, train_acc *acc, bool *epoch_done)
{
    const kpl_recipe *r = R->r;
    int64_t k = r->optimizer.accumulate, B = r->data.train.batch_size;
    *epoch_done = false;
    bool marker_seen = false;
    acc->nonfinite = false;
    for (int64_t i = 0; i < k; i++) {
        int64_t ep = 0, pos = 0;
        kpl_loader_position(R->train, &ep, &pos);
        bool last = pos / B + 1 >= R->batches_per_epoch;
        if (R->ddp) KPL_TRY(kpl_ddp_begin(R->ddp, i == k - 1 || last));
        kpl_batch b;
        memset(&b, 0, sizeof b);
        KPL_TRY(kpl_loader_next(R->train, &b));
        if (b.size == 0 && kpl_loader_skipped(R->train) > 0) {
            /* The epoch's last batch held only corrupt examples (skip_corrupt
             * dropped them): this rank adds nothing to the step. */
            if (R->ddp) KPL_TRY(kpl_ddp_finish(R->ddp));
            *epoch_done = marker_seen = true;
            break;
        }
        KPL_CHECK(b.size > 0, KPL_ESTATE, "train loader: epoch %lld ended after %lld batches, "
                  "expected %lld", (long long)ep + 1, (long long)(pos / B),
                  (long long)R->batches_per_epoch);
        kpl_status st = micro_step(R, &b, 1.0 / (double)k, acc);
        kpl_batch_release(&b);
        KPL_TRY(st);
        /* every begin has its finish; only the last one communicates */
        if (R->ddp) KPL_TRY(kpl_ddp_finish(R->ddp));
        if (last) {
            *epoch_done = true;
            break;
        }
    }
    KPL_TRY(apply_step(R, acc));
    R->step++;
    R->epoch_step++;
    if (*epoch_done && !marker_seen) { /* the loader's end-of-epoch marker */
        kpl_batch b;
        memset(&b, 0, sizeof b);
        KPL_TRY(kpl_loader_next(R->train, &b));
        bool marker = b.size == 0;
        kpl_batch_release(&b);
        KPL_CHECK(marker, KPL_ESTATE, "train loader: more batches than the %lld counted in "
                  "epoch %lld", (long long)R->batches_per_epoch, (long long)R->epoch + 1);
    }
    return KPL_OK;
}

/* ---- evaluation ------------------------------------------------------------------------- */

/* The validation loader sits idle between evaluations: a process of it
 * that died is reported at the next step, not when the epoch ends. */
static kpl_status check_val_loader(run *R)
{
    if (!R->val) return KPL_OK;
    kpl_status st = kpl_loader_check(R->val);
    if (st >= 0) return KPL_OK;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kpl_last_error());
    return KPL_ERROR(st, "validation loader of %s: %s", R->val_path, msg);
}

/* Top-1/top-5 and the mean loss over the whole validation split (each
 * example once: the repeats that even out the ranks' shares are left
 * out), and the confusion matrix.  Collective. */
static kpl_status evaluate(run *R, eval_result *res)
{
    const kpl_recipe *r = R->r;
    int64_t C = r->model.num_classes;
    free(res->confusion);
    memset(res, 0, sizeof *res);
    bool want_cm = C <= r->eval.confusion_max_classes;
    kpl_status st = KPL_OK;
    int64_t *cm = want_cm ? calloc((size_t)(C * C), sizeof *cm) : NULL;
    KPL_CHECK(!want_cm || cm, KPL_ENOMEM, "eval: out of memory");
    /* Batch-norm statistics are each rank's own during training; the
     * checkpoint keeps rank 0's, so evaluate with those on every rank. */
    for (int i = 0; R->comm && i < kpl_model_num_buffers(R->model); i++)
        if ((st = kpl_comm_broadcast(R->comm, kpl_model_buffers(R->model)[i], 0)) < 0) goto fail;
    bool prev = kpl_set_grad_enabled(false);
    int64_t n = kpl_loader_num_examples(R->val), m = kpl_loader_epoch_size(R->val);
    int64_t skipped0 = kpl_loader_skipped(R->val);
    double s[6] = {0}; /* loss, examples, top-1, top-5, non-finite, skipped */
    for (;;) {
        kpl_batch b;
        memset(&b, 0, sizeof b);
        if ((st = kpl_loader_next(R->val, &b)) < 0) break;
        if (b.size == 0) break;
        kpl_pool *pool = kpl_pool_push();
        kpl_tensor *x = NULL, *y = NULL;
        batch_on_device(R, &b, &x, &y);
        kpl_tensor *logits = kpl_model_forward(R->model, x, false);
        kpl_tensor *loss = kpl_cross_entropy(logits, y, KPL_REDUCE_NONE, 0, -100);
        const float *lg = logits ? kpl_tensor_host_data(logits) : NULL;
        const float *ls = loss ? kpl_tensor_host_data(loss) : NULL;
        const int64_t *lab = kpl_tensor_host_data(b.label);
        if (!lg || !ls || !lab) {
            st = kpl_last_status();
        } else {
            for (int64_t i = 0; i < b.size; i++) {
                int64_t at = r->data.val.interleave ? (b.position + i) * R->world + R->rank
                                                     : R->rank * m + b.position + i;
                if (at >= n) continue; /* a repeat */
                const float *row = lg + i * C;
                int64_t t = lab[i], above = 0, best = 0;
                bool finite = isfinite(ls[i]);
                for (int64_t c = 0; c < C; c++) {
                    /* ties go to the lower index, as argmax */
                    above += row[c] > row[t] || (row[c] == row[t] && c < t);
                    if (row[c] > row[best]) best = c;
                    finite &= isfinite(row[c]);
                }
                s[1] += 1;
                if (!finite) { /* NaN compares false: it would count as right */
                    s[4] += 1;
                    continue;
                }
                s[0] += ls[i];
                s[2] += above == 0;
                s[3] += above < 5;
                if (cm && t >= 0 && t < C) cm[t * C + best]++;
            }
        }
        kpl_pool_pop(pool);
        kpl_batch_release(&b);
        if (st < 0) break;
    }
    kpl_set_grad_enabled(prev);
    if (st < 0) goto fail;
    s[5] = (double)(kpl_loader_skipped(R->val) - skipped0);
    KPL_TRY_GOTO(reduce_sum(R, s, 6));
    if (cm && R->comm) {
        int64_t len = C * C;
        kpl_tensor *t = NULL;
        KPL_TRY_GOTO(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &len, cm, &t));
        st = kpl_comm_allreduce(R->comm, t, t, KPL_COMM_SUM);
        if (st >= 0) st = kpl_tensor_to_host(t, cm, (size_t)len * sizeof *cm);
        kpl_tensor_release(t);
        if (st < 0) goto fail;
    }
    res->examples = (int64_t)s[1];
    res->nonfinite = (int64_t)s[4];
    res->skipped = (int64_t)s[5];
    res->loss = s[1] > s[4] ? s[0] / (s[1] - s[4]) : NAN; /* of the finite ones */
    res->top1 = s[1] > 0 ? 100 * s[2] / s[1] : NAN;
    res->top5 = s[1] > 0 ? 100 * s[3] / s[1] : NAN;
    res->confusion = cm;
    return KPL_OK;
fail:
    free(cm);
    return st;
}

static void print_confusion(run *R, const eval_result *e)
{
    int64_t C = R->r->model.num_classes;
    if (!e->confusion || R->rank != 0) return;
    char line[8192];
    int at = snprintf(line, sizeof line, "confusion (rows: true class, columns: predicted)\n      ");
    for (int64_t c = 0; c < C && at < (int)sizeof line - 16; c++)
        at += snprintf(line + at, sizeof line - (size_t)at, "%6lld", (long long)c);
    kpl__log_info(&R->log, "%s", line);
    for (int64_t t = 0; t < C; t++) {
        at = snprintf(line, sizeof line, "%5lld ", (long long)t);
        for (int64_t c = 0; c < C && at < (int)sizeof line - 16; c++)
            at += snprintf(line + at, sizeof line - (size_t)at, "%6lld",
                           (long long)e->confusion[t * C + c]);
        kpl__log_info(&R->log, "%s", line);
    }
}

/* ---- checkpoints ----------------------------------------------------------------------------- */

/* Rank 0: what interrupted saves left (a checkpoint without its marker is
 * never resumed; a 150 MB temporary file helps nobody) goes, at start and
 * at each rotation. */
static kpl_status clean_checkpoints(run *R)
{
    if (R->rank != 0) return KPL_OK;
    int n = 0;
    double bytes = 0;
    KPL_TRY(kpl__checkpoint_clean(R->ckpt_dir, R->resume_path, &n, &bytes));
    if (n > 0)
        kpl__log_warn(&R->log, "removed %d unfinished checkpoint file%s (%.1f MB) left in %s by "
                      "an interrupted save", n, n > 1 ? "s" : "", bytes / 1e6, R->ckpt_dir);
    return KPL_OK;
}

/* Collective (the ranks' dropout generators are gathered); rank 0 writes.
 * *path receives the file. */
static kpl_status save_checkpoint(run *R, const char *why, char *path, size_t len)
{
    kpl_rng *rng = kpl_model_rng(R->model);
    int64_t mine[2] = {(int64_t)kpl_rng_seed(rng), (int64_t)kpl_rng_offset(rng)};
    int64_t *all = calloc((size_t)(2 * R->world), sizeof *all);
    KPL_CHECK(all, KPL_ENOMEM, "out of memory");
    kpl_status st = KPL_OK;
    if (R->comm) {
        int64_t two = 2, n2 = 2 * R->world;
        kpl_tensor *in = NULL, *out = NULL;
        st = kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &two, mine, &in);
        if (st >= 0) st = kpl_tensor_empty(kpl_device_cpu(), KPL_I64, 1, &n2, &out);
        if (st >= 0) st = kpl_comm_allgather(R->comm, in, out);
        if (st >= 0) st = kpl_tensor_to_host(out, all, (size_t)n2 * sizeof *all);
        kpl_tensor_release(in);
        kpl_tensor_release(out);
    } else {
        memcpy(all, mine, sizeof mine);
    }
    if (st < 0 || R->rank != 0) {
        free(all);
        return st;
    }
    double t0 = kpl_seconds();
    kpl_checkpoint *c = NULL;
    char *yaml = NULL, *meta = NULL;
    json_t *j = NULL;
    KPL_TRY_GOTO(kpl_checkpoint_create(&c));
    char name[320];
    KPL_TRY_GOTO(kpl_module_state_save(kpl_model_module(R->model), c, "model."));
    const char *const *slots = NULL;
    int ns = kpl_optim_state_slots(R->opt, &slots);
    for (int i = 0; i < kpl_model_num_params(R->model); i++)
        for (int k = 0; k < ns; k++) {
            kpl_tensor *t = kpl_optim_state_get(R->opt, i, k);
            if (!t) continue;
            snprintf(name, sizeof name, "optim.%s.%s", kpl_model_param_name(R->model, i), slots[k]);
            KPL_TRY_GOTO(kpl_checkpoint_add(c, name, t));
        }
    KPL_TRY_GOTO(kpl_recipe_to_yaml(R->r, &yaml));
    int64_t ep = 0, pos = 0;
    kpl_loader_position(R->train, &ep, &pos);
    json_t *rngs = json_array();
    for (int r = 0; r < R->world; r++)
        json_array_append_new(rngs, json_pack("[II]", (json_int_t)all[2 * r],
                                              (json_int_t)all[2 * r + 1]));
    j = json_pack("{s:s, s:s, s:I, s:s, s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:I, s:o, "
                  "s:f}, s:{s:s, s:I}}",
                  "kpl_version", kpl_version(), "why", why, "time", (json_int_t)now_seconds(),
                  "recipe", yaml, "train", "step", (json_int_t)R->step, "epoch", (json_int_t)ep,
                  "position", (json_int_t)pos, "epoch_step",
                  (json_int_t)(ep == R->epoch ? R->epoch_step : 0), "world_size",
                  (json_int_t)R->world, "batch_size", (json_int_t)R->r->data.train.batch_size,
                  "accumulate", (json_int_t)R->r->optimizer.accumulate, "best_top1",
                  R->best_top1, "best_step", (json_int_t)R->best_step, "rng", rngs, "lr",
                  kpl_optim_lr(R->opt), "model", "name", kpl_model_name(R->model), "params",
                  (json_int_t)kpl_model_param_count(R->model));
    if (!j) {
        st = KPL_ERROR(KPL_ENOMEM, "checkpoint: out of memory");
        goto fail;
    }
    json_t *jt = json_object_get(j, "train");
    json_object_set_new(jt, "eval_pending", json_boolean(R->eval_pending));
    json_object_set_new(jt, "skipped_steps", json_integer((json_int_t)R->skipped_steps));
    json_object_set_new(jt, "skipped_examples", json_integer((json_int_t)R->skipped_examples));
    if (R->have_val)
        json_object_set_new(j, "val", json_pack("{s:f, s:f, s:f, s:I}", "top1",
                                                isfinite(R->val_res.top1) ? R->val_res.top1 : -1,
                                                "top5", isfinite(R->val_res.top5) ? R->val_res.top5 : -1,
                                                "loss", isfinite(R->val_res.loss) ? R->val_res.loss : -1,
                                                "examples", (json_int_t)R->val_res.examples));
    meta = json_dumps(j, JSON_COMPACT);
    if (!meta) {
        st = KPL_ERROR(KPL_ENOMEM, "checkpoint: out of memory");
        goto fail;
    }
    KPL_TRY_GOTO(kpl_checkpoint_set_meta(c, meta));
    kpl__checkpoint_path(R->ckpt_dir, R->step, path, len);
    KPL_TRY_GOTO(kpl_checkpoint_save(c, path));
    double secs = kpl_seconds() - t0;
    struct stat sb;
    double mb = stat(path, &sb) == 0 ? (double)sb.st_size / 1e6 : 0;
    kpl__log_info(&R->log, "checkpoint %s (%s, %.1f MB, %.2f s)", path, why, mb, secs);
    char line[PATH_MAX + 256];
    snprintf(line, sizeof line,
             "{\"event\":\"checkpoint\",\"step\":%lld,\"why\":\"%s\",\"path\":\"%s\",\"mb\":%.3f,"
             "\"seconds\":%.3f,\"time\":%.3f}",
             (long long)R->step, why, path, mb, secs, kpl__wall());
    kpl__log_metrics(&R->log, line);
    /* keep_last: the oldest complete ones go, marker first */
    if (R->r->checkpoint.keep_last > 0) {
        static int64_t steps[65536];
        int n = 0;
        KPL_TRY_GOTO(kpl__checkpoint_list(R->ckpt_dir, steps, 65536, &n));
        for (int i = 0; i + R->r->checkpoint.keep_last < n; i++) {
            char old[PATH_MAX];
            kpl__checkpoint_path(R->ckpt_dir, steps[i], old, sizeof old);
            KPL_TRY_GOTO(kpl__checkpoint_remove(old));
        }
    }
    KPL_TRY_GOTO(clean_checkpoints(R));
fail:
    json_decref(j);
    free(meta);
    free(yaml);
    free(all);
    kpl_checkpoint_destroy(c);
    return st;
}

/* After an evaluation: a new best top-1 becomes best.kpl (keep_best). */
static kpl_status note_best(run *R, const char *ckpt)
{
    if (R->rank != 0 || !R->r->checkpoint.keep_best || !ckpt[0] || R->best_step != R->step)
        return KPL_OK;
    char best[PATH_MAX + 32];
    snprintf(best, sizeof best, "%s/best.kpl", R->ckpt_dir);
    KPL_TRY(kpl__checkpoint_link(ckpt, best));
    kpl__log_info(&R->log, "best top-1 %.2f%% so far: %s", R->best_top1, best);
    return KPL_OK;
}

/* ---- reports ------------------------------------------------------------------------------ */

typedef struct {
    train_acc win;       /* since the last report, this rank */
    double loss_sum, correct, count; /* the epoch so far, all ranks (from reports) */
    double t0;           /* the epoch's start (training time only) */
    double samples;      /* this rank's samples in the epoch */
    double bar_t, bar_samples; /* the progress bar's last redraw */
    double rate;         /* this rank's samples per second, smoothed for the bar */
} epoch_acc;

/* The ranks' window figures summed; a record in metrics.jsonl and
 * TensorBoard; a line on the console when there is no progress bar.
 * Returns whether any rank asked to stop (a signal). */
static kpl_status report(run *R, epoch_acc *E, bool *stop)
{
    int64_t skipped_now = kpl_loader_skipped(R->train);
    double v[5] = {E->win.loss_sum, E->win.correct, E->win.count, stop_signal ? 1 : 0,
                   (double)(skipped_now - R->train_skipped_seen)};
    KPL_TRY(reduce_sum(R, v, 5));
    R->train_skipped_seen = skipped_now;
    R->skipped_examples += (int64_t)v[4];
    memset(&E->win, 0, sizeof E->win);
    *stop = v[3] > 0;
    E->loss_sum += v[0], E->correct += v[1], E->count += v[2];
    if (v[2] <= 0) return KPL_OK;
    double loss = v[0] / v[2], acc = 100 * v[1] / v[2], lr = kpl_optim_lr(R->opt);
    double dt = kpl_seconds() - E->t0;
    double ips = dt > 0 ? E->samples * R->world / dt : 0;
    if (R->rank != 0) return KPL_OK;
    char sl[32], sa[32], sr[32], si[32];
    jnum(sl, sizeof sl, loss), jnum(sa, sizeof sa, acc), jnum(sr, sizeof sr, lr);
    jnum(si, sizeof si, ips);
    char line[512];
    snprintf(line, sizeof line,
             "{\"event\":\"train\",\"step\":%lld,\"epoch\":%.6f,\"loss\":%s,\"acc\":%s,\"lr\":%s,"
             "\"images_per_sec\":%s,\"samples\":%.0f,\"skipped_steps\":%lld,"
             "\"skipped_examples\":%lld,\"time\":%.3f}",
             (long long)R->step, (double)R->epoch + (double)R->epoch_step / (double)R->steps_per_epoch,
             sl, sa, sr, si, v[2], (long long)R->skipped_steps, (long long)R->skipped_examples,
             kpl__wall());
    kpl__log_metrics(&R->log, line);
    if (R->log.tb) {
        kpl_tb_add_scalar(R->log.tb, "train/loss", R->step, loss);
        kpl_tb_add_scalar(R->log.tb, "train/accuracy", R->step, acc);
        kpl_tb_add_scalar(R->log.tb, "train/lr", R->step, lr);
        kpl_tb_add_scalar(R->log.tb, "train/images_per_sec", R->step, ips);
        kpl_tb_flush(R->log.tb);
    }
    if (!R->log.bar)
        kpl__log_info(&R->log, "epoch %lld/%lld step %lld/%lld loss %.4f acc %.2f%% lr %.4g %.0f img/s",
                      (long long)R->epoch + 1, (long long)R->r->epochs, (long long)R->epoch_step,
                      (long long)R->steps_per_epoch, loss, acc, lr, ips);
    return KPL_OK;
}

static void draw_bar(run *R, epoch_acc *E, bool force)
{
    if (!R->log.bar) return;
    double now = kpl_seconds();
    if (!force && now - E->bar_t < 0.2) return;
    /* The rate of the last redraws (the first step's algorithm search
     * would otherwise weigh on the whole epoch's figure and ETA). */
    if (E->bar_t > 0 && now > E->bar_t) {
        double r = (E->samples - E->bar_samples) / (now - E->bar_t);
        E->rate = E->rate > 0 ? 0.7 * E->rate + 0.3 * r : r;
    }
    E->bar_t = now, E->bar_samples = E->samples;
    double per_step = E->rate > 0 && R->epoch_step > 0 ? E->samples / R->epoch_step / E->rate : 0;
    double loss = E->win.count > 0 ? E->win.loss_sum / E->win.count
                  : E->count > 0  ? E->loss_sum / E->count : NAN;
    kpl__log_bar(&R->log, R->epoch, R->r->epochs, R->epoch_step, R->steps_per_epoch, loss,
                 kpl_optim_lr(R->opt), E->rate * R->world,
                 per_step * (double)(R->steps_per_epoch - R->epoch_step));
}

/* What an evaluation with NaN or inf outputs means: the model diverged
 * (an error under loss.nonfinite stop, a warning under skip). */
static kpl_status check_eval_finite(run *R, const eval_result *e, bool fatal)
{
    if (e->nonfinite == 0) return KPL_OK;
    char msg[256];
    snprintf(msg, sizeof msg, "%lld of %lld validation examples gave NaN or inf outputs (counted "
             "as wrong): the model has diverged", (long long)e->nonfinite,
             (long long)e->examples);
    if (fatal) return KPL_ERROR(KPL_ERANGE, "%s", msg);
    if (R->rank == 0) kpl__log_warn(&R->log, "%s", msg);
    return KPL_OK;
}

static kpl_status run_eval(run *R)
{
    if (!R->val) return KPL_OK;
    double t0 = kpl_seconds();
    KPL_TRY(evaluate(R, &R->val_res));
    R->have_val = true;
    eval_result *e = &R->val_res;
    /* a model with NaN outputs is never the best one */
    if (e->nonfinite == 0 && e->top1 > R->best_top1) R->best_top1 = e->top1, R->best_step = R->step;
    if (R->rank == 0) {
        char sl[32], s1[32], s5[32];
        jnum(sl, sizeof sl, e->loss), jnum(s1, sizeof s1, e->top1), jnum(s5, sizeof s5, e->top5);
        char line[512];
        snprintf(line, sizeof line,
                 "{\"event\":\"eval\",\"step\":%lld,\"epoch\":%lld,\"val_loss\":%s,"
                 "\"val_top1\":%s,\"val_top5\":%s,\"examples\":%lld,\"nonfinite\":%lld,"
                 "\"skipped_examples\":%lld,\"seconds\":%.3f,\"time\":%.3f}",
                 (long long)R->step, (long long)R->epoch + (R->epoch_step ? 1 : 0), sl, s1, s5,
                 (long long)e->examples, (long long)e->nonfinite, (long long)e->skipped,
                 kpl_seconds() - t0, kpl__wall());
        kpl__log_metrics(&R->log, line);
    }
    KPL_TRY(check_eval_finite(R, e, R->r->loss.nonfinite == 0));
    if (R->rank != 0) return KPL_OK;
    if (R->log.tb) {
        kpl_tb_add_scalar(R->log.tb, "val/loss", R->step, e->loss);
        kpl_tb_add_scalar(R->log.tb, "val/top1", R->step, e->top1);
        kpl_tb_add_scalar(R->log.tb, "val/top5", R->step, e->top5);
        kpl_tb_flush(R->log.tb);
    }
    return KPL_OK;
}

/* ---- the run ----------------------------------------------------------------------------- */

static void run_free(run *R)
{
    kpl_ddp_destroy(R->ddp);
    kpl_optim_destroy(R->opt);
    kpl_model_destroy(R->model);
    kpl_checkpoint_destroy(R->resume);
    kpl_loader_destroy(R->train);
    kpl_loader_destroy(R->val);
    free(R->val_res.confusion);
    kpl__log_close(&R->log);
    kpl_comm_destroy(R->comm);
}

/* Everything up to the first step: the pieces in the order the file's
 * head comment gives.  resume: NULL, "" (the newest checkpoint) or a
 * file. */
static kpl_status start(run *R, const char *resume)
{
    const kpl_recipe *r = R->r;
    ranks_from_env(R);
    kpl__log_init(&R->log, R->rank, r->log.progress);
    pick_threads(R);
    kpl_set_deterministic(r->deterministic);
    KPL_TRY(pick_device(R));
    KPL_TRY(kpl__data_prepare(r, &R->log));
    int64_t chw[3];
    KPL_TRY(kpl__data_input_shape(r, chw));
    resume_meta rm;
    memset(&rm, 0, sizeof rm);
    if (resume) {
        if (resume[0]) snprintf(R->resume_path, sizeof R->resume_path, "%s", resume);
        else
            KPL_CHECK(latest_run_checkpoint(r, R->resume_path, sizeof R->resume_path),
                      KPL_ENOTFOUND, "--resume: no complete checkpoint in %s%s%s",
                      r->run_dir[0] ? r->run_dir : "runs/", r->run_dir[0] ? "/checkpoints" : r->name,
                      r->run_dir[0] ? "" : "-*/checkpoints");
        KPL_TRY(kpl_checkpoint_load(R->resume_path, &R->resume));
        KPL_TRY(read_resume_meta(R->resume, R->resume_path, &rm));
    }
    kpl_status st = make_loaders(R, resume ? &rm : NULL);
    if (st >= 0) st = make_comm(R);
    if (st >= 0) st = make_run_dir(R);
    if (st >= 0) st = clean_checkpoints(R);
    if (st >= 0) st = make_model(R, chw);
    if (st >= 0 && R->resume) st = restore(R, &rm);
    json_decref(rm.rng);
    KPL_TRY(st);
    kpl_checkpoint_destroy(R->resume);
    R->resume = NULL;
    if (R->comm) {
        kpl_bucketer_config bc = KPL_BUCKETER_CONFIG_INIT;
        bc.bucket_mb = r->dist.bucket_mb;
        bc.first_bucket_mb = r->dist.first_bucket_mb;
        bc.check_params = r->dist.check_params;
        KPL_TRY(kpl_ddp_create(R->comm, kpl_model_num_params(R->model), kpl_model_params(R->model),
                               kpl_model_num_buffers(R->model), kpl_model_buffers(R->model), &bc,
                               &R->ddp));
    }
    int64_t ep = 0;
    kpl_loader_position(R->train, &ep, NULL);
    R->epoch = ep;
    return KPL_OK;
}

static void say_start(run *R)
{
    const kpl_recipe *r = R->r;
    int64_t chw[3];
    kpl_model_input_shape(R->model, chw);
    kpl__log_info(&R->log,
                  "kpl train %s: %s (%.2fM parameters, input %lldx%lldx%lld) on %s, %d rank%s x "
                  "%d thread%s; batch %lld x %d%s; %lld steps/epoch; run dir %s",
                  r->name, kpl_model_name(R->model), (double)kpl_model_param_count(R->model) / 1e6,
                  (long long)chw[0], (long long)chw[1], (long long)chw[2],
                  kpl_device_name(R->dev), (int)R->world, R->world > 1 ? "s" : "",
                  kpl_get_num_threads(), kpl_get_num_threads() > 1 ? "s" : "",
                  (long long)r->data.train.batch_size, (int)R->world,
                  r->optimizer.accumulate > 1 ? " (with accumulation)" : "",
                  (long long)R->steps_per_epoch, R->run_dir);
    if (R->resume_path[0]) {
        kpl__log_info(&R->log, "resumed from %s at step %lld (epoch %lld)", R->resume_path,
                      (long long)R->step, (long long)R->epoch + 1);
        char line[PATH_MAX + 128];
        snprintf(line, sizeof line, "{\"event\":\"resume\",\"step\":%lld,\"from\":\"%s\",\"time\":%.3f}",
                 (long long)R->step, R->resume_path, kpl__wall());
        kpl__log_metrics(&R->log, line);
    }
}

/* The last words: a summary and the `done` (or `interrupted`) JSON line. */
static void say_done(run *R, const char *event, double train_seconds, double samples,
                     const char *ckpt)
{
    if (R->rank != 0) return;
    char sl[32], sa[32], s1[32], s5[32], sv[32], si[32], sb[32];
    jnum(sl, sizeof sl, R->train_loss), jnum(sa, sizeof sa, R->train_acc);
    jnum(s1, sizeof s1, R->have_val ? R->val_res.top1 : NAN);
    jnum(s5, sizeof s5, R->have_val ? R->val_res.top5 : NAN);
    jnum(sv, sizeof sv, R->have_val ? R->val_res.loss : NAN);
    jnum(si, sizeof si, train_seconds > 0 ? samples / train_seconds : NAN);
    jnum(sb, sizeof sb, R->best_top1 >= 0 ? R->best_top1 : NAN);
    char line[3 * PATH_MAX];
    snprintf(line, sizeof line,
             "{\"event\":\"%s\",\"epochs\":%.4f,\"steps\":%lld,\"train_loss\":%s,"
             "\"train_acc\":%s,\"val_top1\":%s,\"val_top5\":%s,\"val_loss\":%s,"
             "\"best_top1\":%s,\"images_per_sec\":%s,\"seconds\":%.2f,\"ranks\":%d,"
             "\"run_dir\":\"%s\",\"checkpoint\":\"%s\"}",
             event, (double)R->step / (double)R->steps_per_epoch, (long long)R->step, sl, sa, s1,
             s5, sv, sb, si, kpl_seconds() - R->t_start, (int)R->world, R->run_dir, ckpt);
    kpl__log_metrics(&R->log, line);
    kpl__log_bar_end(&R->log);
    fflush(stdout);
    printf("%s\n", line);
    fflush(stdout);
}

int kpl__train_run(const kpl_recipe *r, const char *resume)
{
    run R;
    memset(&R, 0, sizeof R);
    R.r = r;
    R.best_top1 = -1;
    R.train_loss = R.train_acc = NAN; /* none until a step ran */
    R.t_start = kpl_seconds();
    catch_signals(true);
    kpl_status st = start(&R, resume);
    int rc = 0;
    char ckpt[PATH_MAX] = "";
    double train_seconds = 0, train_samples = 0;
    const char *event = "done";
    if (st < 0) goto fail;
    say_start(&R);
    bool stop = false;
    int64_t max_steps = r->max_steps > 0 && r->max_steps < R.total_steps ? r->max_steps : R.total_steps;
    if (R.eval_pending && R.step < max_steps) {
        /* the checkpoint resumed from was written before its epoch's
         * evaluation, which did not finish: run it now */
        R.eval_pending = false;
        kpl__log_info(&R.log, "evaluating the resumed checkpoint first (its evaluation did not "
                      "finish)");
        KPL_TRY_GOTO(run_eval(&R));
        if (R.best_step == R.step && r->checkpoint.keep_best)
            KPL_TRY_GOTO(note_best(&R, R.resume_path));
    }
    if (R.step >= max_steps) { /* a resume of a finished run: report where it stands */
        kpl__log_info(&R.log, "nothing to train: step %lld of %lld is done", (long long)R.step,
                      (long long)max_steps);
        KPL_TRY_GOTO(run_eval(&R));
        if (R.eval_pending && R.best_step == R.step && r->checkpoint.keep_best)
            KPL_TRY_GOTO(note_best(&R, R.resume_path));
    }
    while (R.step < max_steps && !stop) {
        epoch_acc E;
        memset(&E, 0, sizeof E);
        E.t0 = kpl_seconds();
        bool epoch_done = false;
        bool saved = false;
        while (!epoch_done && !stop) {
            int64_t before = R.step;
            (void)before;
            double s0 = E.win.count;
            KPL_TRY_GOTO(train_step(&R, &E.win, &epoch_done));
            KPL_TRY_GOTO(check_val_loader(&R));
            E.samples += E.win.count - s0;
            saved = false;
            bool at_max = R.step >= max_steps;
            bool due = R.step % r->log.every_steps == 0 || epoch_done || at_max;
            if (R.world == 1 && stop_signal) due = true;
            if (due) KPL_TRY_GOTO(report(&R, &E, &stop));
            draw_bar(&R, &E, epoch_done);
            if (r->checkpoint.every_steps > 0 && R.step % r->checkpoint.every_steps == 0 &&
                !epoch_done && !at_max && !stop) {
                KPL_TRY_GOTO(save_checkpoint(&R, "steps", ckpt, sizeof ckpt));
                saved = true;
            }
            if (at_max) stop = true;
        }
        double secs = kpl_seconds() - E.t0;
        train_seconds += secs;
        train_samples += E.samples * R.world;
        if (E.count > 0) {
            R.train_loss = E.loss_sum / E.count;
            R.train_acc = 100 * E.correct / E.count;
        }
        R.images_per_sec = secs > 0 ? E.samples * R.world / secs : 0;
        kpl__log_bar_end(&R.log);
        bool last = R.step >= max_steps;
        int64_t finished = R.epoch + 1; /* epochs complete once this one is */
        bool do_eval = R.val && (last || stop ||
                                 (epoch_done && r->eval.every_epochs > 0 &&
                                  finished % r->eval.every_epochs == 0));
        if (R.rank == 0 && epoch_done) {
            char line[512];
            char sl[32], sa[32];
            jnum(sl, sizeof sl, R.train_loss), jnum(sa, sizeof sa, R.train_acc);
            snprintf(line, sizeof line,
                     "{\"event\":\"epoch\",\"epoch\":%lld,\"step\":%lld,\"train_loss\":%s,"
                     "\"train_acc\":%s,\"images_per_sec\":%.1f,\"seconds\":%.3f,\"time\":%.3f}",
                     (long long)finished, (long long)R.step, sl, sa, R.images_per_sec, secs,
                     kpl__wall());
            kpl__log_metrics(&R.log, line);
            if (R.log.tb)
                kpl_tb_add_scalar(R.log.tb, "epoch/images_per_sec", finished, R.images_per_sec);
        }
        /* The epoch's checkpoint comes before its evaluation, which can
         * fail (a dead loader process, a bad image) without losing the
         * epoch; the checkpoint says that its evaluation is still to come,
         * and a resume from it runs that first. */
        bool ckpt_due = last || stop ||
                        (epoch_done && r->checkpoint.every_epochs > 0 &&
                         finished % r->checkpoint.every_epochs == 0);
        bool pending = false;
        if (ckpt_due && !saved) {
            R.eval_pending = pending = do_eval;
            st = save_checkpoint(&R, stop && !last ? "signal" : last ? "end" : "epoch", ckpt,
                                 sizeof ckpt);
            R.eval_pending = false;
            KPL_TRY_GOTO(st);
            saved = true;
        }
        if (do_eval) KPL_TRY_GOTO(run_eval(&R));
        if (pending && R.rank == 0) KPL_TRY_GOTO(kpl__checkpoint_mark_evaluated(ckpt));
        if (R.rank == 0) {
            char vs[160] = "";
            if (do_eval)
                snprintf(vs, sizeof vs, " | val loss %.4f top-1 %.2f%% top-5 %.2f%%",
                         R.val_res.loss, R.val_res.top1, R.val_res.top5);
            kpl__log_info(&R.log, "epoch %lld/%lld%s: train loss %.4f acc %.2f%%%s | %.0f img/s, "
                          "%.1f s", (long long)finished, (long long)r->epochs,
                          epoch_done ? "" : " (stopped early)", R.train_loss, R.train_acc, vs,
                          R.images_per_sec, secs);
        }
        if (do_eval && R.rank == 0 && last) print_confusion(&R, &R.val_res);
        bool improved = do_eval && R.best_step == R.step && r->checkpoint.keep_best;
        if (improved && !saved) /* a best epoch between the scheduled checkpoints */
            KPL_TRY_GOTO(save_checkpoint(&R, "best", ckpt, sizeof ckpt));
        if (improved) KPL_TRY_GOTO(note_best(&R, ckpt));
        if (epoch_done) {
            R.epoch++;
            R.epoch_step = 0;
        }
    }
    if (stop_signal && R.step < max_steps) {
        event = "interrupted";
        rc = stop_signal == SIGINT ? 130 : 143;
    }
    say_done(&R, event, train_seconds, train_samples, ckpt);
fail:
    if (st < 0) {
        kpl__log_error(&R.log, "%s", kpl_last_error());
        rc = 1;
        /* the other ranks wait in a collective for this one: end the job */
        if (R.comm) kpl_comm_abort(R.comm, 1);
    }
    run_free(&R);
    catch_signals(false);
    return rc;
}

int kpl__eval_run(const kpl_recipe *r, const char *checkpoint)
{
    run R;
    memset(&R, 0, sizeof R);
    R.r = r;
    R.best_top1 = -1;
    R.t_start = kpl_seconds();
    kpl_status st = KPL_OK;
    int64_t chw[3];
    ranks_from_env(&R);
    kpl__log_init(&R.log, R.rank, 2);
    pick_threads(&R);
    KPL_TRY_GOTO(pick_device(&R));
    if (!r->data.val.path[0]) {
        st = KPL_ERROR(KPL_EINVAL, "kpl eval: the recipe has no data.val.path (set it, e.g. "
                       "data.val.path=test)");
        goto fail;
    }
    KPL_TRY_GOTO(kpl__data_prepare(r, &R.log));
    KPL_TRY_GOTO(kpl__data_input_shape(r, chw));
    KPL_TRY_GOTO(kpl_checkpoint_load(checkpoint, &R.resume));
    kpl_loader_config c;
    kpl__data_split_path(r, &r->data.val, R.val_path, sizeof R.val_path);
    kpl__data_loader_config(r, &r->data.val, R.val_path, false, R.rank, R.world, &c);
    c.device = R.dev;
    KPL_TRY_GOTO(kpl_loader_create(&c, &R.val));
    KPL_TRY_GOTO(make_comm(&R));
    KPL_TRY_GOTO(make_model(&R, chw));
    KPL_TRY_GOTO(restore_model(&R, R.resume, checkpoint));
    double t0 = kpl_seconds();
    KPL_TRY_GOTO(evaluate(&R, &R.val_res));
    double secs = kpl_seconds() - t0;
    if (R.rank == 0) {
        eval_result *e = &R.val_res;
        kpl__log_info(&R.log, "%s on %s: top-1 %.2f%% top-5 %.2f%% loss %.4f (%lld examples, "
                      "%.1f s)", checkpoint, R.val_path, e->top1, e->top5, e->loss,
                      (long long)e->examples, secs);
        print_confusion(&R, e);
        char s1[32], s5[32], sl[32];
        jnum(s1, sizeof s1, e->top1), jnum(s5, sizeof s5, e->top5), jnum(sl, sizeof sl, e->loss);
        json_t *cj = json_string(checkpoint), *dj = json_string(R.val_path);
        char *cs = cj ? json_dumps(cj, JSON_ENCODE_ANY) : NULL;
        char *ds = dj ? json_dumps(dj, JSON_ENCODE_ANY) : NULL;
        printf("{\"event\":\"eval\",\"checkpoint\":%s,\"data\":%s,\"examples\":%lld,"
               "\"val_top1\":%s,\"val_top5\":%s,\"val_loss\":%s,\"nonfinite\":%lld,"
               "\"skipped_examples\":%lld,\"seconds\":%.2f}\n",
               cs ? cs : "null", ds ? ds : "null", (long long)e->examples, s1, s5, sl,
               (long long)e->nonfinite, (long long)e->skipped, secs);
        fflush(stdout);
        free(cs), free(ds);
        json_decref(cj), json_decref(dj);
    }
    /* NaN outputs are an error of the checkpoint: the figures above are
     * printed, and the exit status says it */
    KPL_TRY_GOTO(check_eval_finite(&R, &R.val_res, true));
fail:
    if (st < 0) {
        kpl__log_error(&R.log, "%s", kpl_last_error());
        if (R.comm) kpl_comm_abort(R.comm, 1);
    }
    run_free(&R);
    return st < 0 ? 1 : 0;
}
