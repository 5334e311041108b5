/*
 * run_impl.h — the run room's internals (trainer/run/: kpl_trainer, its
 * step, log, data, checkpoints and profile) that the metrics, tasks and
 * cli rooms above it and the tests reach (not installed; not part of the
 * API).
 */
#ifndef KPL_RUN_IMPL_H
#define KPL_RUN_IMPL_H

#include "io_impl.h"
#include "nn_impl.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>

/* ---- what a run says (train_log.c) ---- */

typedef struct {
    int rank;
    FILE *log;         /* this rank's log file in the run directory */
    FILE *metrics;     /* rank 0: metrics.jsonl */
    kpl_tb_writer *tb; /* rank 0, when TensorBoard is on */
    kpl_log_fn fn;     /* kpl_trainer_options.log, or NULL */
    void *ctx;
    bool progress;     /* KPL_LOG_PROGRESS events wanted */
} kpl__runlog;

double kpl__wall(void); /* Unix time */
void kpl__log_init(kpl__runlog *l, int rank, kpl_log_fn fn, void *ctx, bool progress);
void kpl__log_close(kpl__runlog *l);
/* A line for the user (KPL_LOG_INFO), a report's line (KPL_LOG_REPORT), a
 * warning, an error: this rank's log file and the log function. */
void kpl__log_info(kpl__runlog *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kpl__log_report(kpl__runlog *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kpl__log_warn(kpl__runlog *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kpl__log_error(kpl__runlog *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The same for a va_list (the one formatter underneath). */
void kpl__log_v(kpl__runlog *l, kpl_log_kind kind, const char *fmt, va_list ap);
/* One line of metrics.jsonl (rank 0). */
void kpl__log_metrics(kpl__runlog *l, const char *json);
/* The last record of a run or an evaluation, for the console. */
void kpl__log_result(kpl__runlog *l, const char *json);
/* The epoch's progress (with l->progress). */
void kpl__log_progress(kpl__runlog *l, int64_t epoch, int64_t epochs, int64_t step,
                       int64_t steps, double loss, double lr, double img_s, double eta);

/* ---- the data of a run (train_data.c) ---- */

/* Builds the recipe's missing splits from data.convert.source, one process
 * per node at a time (a lock file in data.root); the others wait and then
 * find them built. */
kpl_status kpl__data_prepare(const kpl_recipe *r, kpl__runlog *log);
/* The same for the validation split alone: an evaluation reads nothing
 * else. */
kpl_status kpl__data_prepare_val(const kpl_recipe *r, kpl__runlog *log);
/* root + split path into buf. */
void kpl__data_split_path(const kpl_recipe *r, const kpl_recipe_split *s, char *buf, size_t len);
/* The loader configuration of a split (pointers into r and path). */
void kpl__data_loader_config(const kpl_recipe *r, const kpl_recipe_split *s, const char *path,
                             bool train, int32_t rank, int32_t world, kpl_loader_config *c);
/* The model's input (C, H, W): model.input_size and in_channels when set,
 * else the train transform's size and channels, else the stored size of
 * the image feature. */
kpl_status kpl__data_input_shape(const kpl_recipe *r, int64_t *chw);
/* The same from the validation split (its transform, else its stored
 * size), for an evaluation, which has no training split to ask. */
kpl_status kpl__data_val_input_shape(const kpl_recipe *r, int64_t *chw);

/* ---- runs (trainer.c, trainer_setup.c, trainer_ckpt.c, fit.c) ---- */

#define KPL__MAX_MODELS 4

/* fp16's dynamic loss scale of one model (torch.cuda.amp.GradScaler's
 * rule, the recipe's loss_scale), all of its state (loss_scale.c).  The
 * model's backward runs on its loss times `scale`; the update first
 * divides the gradients by it and checks them (kpl__scaler_unscale).  An
 * inf or NaN among them multiplies the scale by backoff and the update is
 * left out (`skips`): that is how the scale finds its level, not an
 * error.  After `interval` finite updates in a row it grows by growth.
 * The gradients are the same on every rank (reduced), so every rank takes
 * the same decisions. */
typedef struct {
    bool on;                /* precision fp16; off: scale 1 and nothing moves */
    double scale;           /* the loss multiplier of the model's backward */
    int64_t good;           /* finite updates since the scale last moved */
    int64_t skips;          /* updates left out for an overflow (this run) */
    double growth, backoff; /* loss_scale.growth and .backoff */
    int64_t interval;       /* loss_scale.interval */
} kpl__loss_scaler;

void kpl__scaler_init(kpl__loss_scaler *s, const kpl_recipe *r);
/* Divides the np gradients of params (those that have one) by the scale
 * in one pass and reads one flag: *overflow when any was not finite (the
 * scale has backed off; the gradients are garbage), else the finite
 * update is counted (and the scale may grow).  Off: nothing, no
 * overflow. */
kpl_status kpl__scaler_unscale(kpl__loss_scaler *s, kpl_device *dev, int np,
                               kpl_tensor **params, bool *overflow);
/* The checkpoint's record [scale, good] (json_t; NULL when off), and its
 * restore: a record missing or malformed (another precision, or an older
 * checkpoint) leaves the recipe's start. */
void *kpl__scaler_state(const kpl__loss_scaler *s);
void kpl__scaler_restore(kpl__loss_scaler *s, const void *state);

/* A model the trainer trains: the task's module, its optimizer and DDP. */
typedef struct {
    char name[64], label[64];
    kpl_module *m;
    int np;                 /* the parameters that train (require grad) */
    int nall;               /* all of m's parameters when it was added */
    kpl_tensor **params;    /* np, borrowed from m */
    char **pnames;          /* their dotted names (copies: m's list is rebuilt
                               when a tensor is added under it) */
    kpl_optim *opt;
    kpl_ddp *ddp;
    double base_lr;  /* the optimizer's lr before the schedule */
    bool has_grad;   /* got gradients in this step and was not updated yet */
    kpl__loss_scaler scaler; /* fp16's loss scale (off otherwise: 1) */
} kpl__model;

/* A training figure's sums since the last report (this rank), and over
 * the epoch (all ranks, from the reports).  Sums a task records as
 * tensors add up where they are (dsum, on the device) and reach the host
 * at the report. */
typedef struct {
    char name[32];
    double sum, count, epoch_sum, epoch_count, last; /* last: the epoch's mean */
    kpl_tensor *dsum;                                /* f32, one element, or NULL */
    int pending;                                     /* additions into dsum */
} kpl__figure;

/* A micro-batch's loss under loss.nonfinite stop, checked for NaN and inf
 * a step later (the read then waits for nothing) or at the next report,
 * checkpoint or evaluation. */
typedef struct {
    kpl_tensor *loss;
    int64_t step, epoch, first, last; /* step from 1; the batch's samples */
} kpl__watched;

/* ---- where a step's time goes (profile.c) ---- */

/* The parts of a run's time that the `timing` records of metrics.jsonl
 * break a step into.  The clock runs for exactly one part at a time (the
 * regions below switch it), so the parts add up to the wall time of the
 * steps; PAUSED (the end of an epoch: its checkpoint and evaluation, and
 * everything before the first step) counts for none. */
typedef enum {
    KPL__T_PAUSED,  /* 0: a new trainer starts paused */
    KPL__T_OTHER,   /* the rest: reports, checks, checkpoints every_steps */
    KPL__T_DATA,    /* waiting for the train loader's batch */
    KPL__T_COMPUTE, /* the task's forward, backward and figures */
    KPL__T_COMM,    /* kpl_ddp_finish: waiting for the gradient allreduces */
    KPL__T_OPT,     /* kpl_trainer_update: clipping, unscaling, the optimizer */
    KPL__T_SYNC,    /* the run's small host collectives (the stop agreement, report sums) */
    KPL__T_PARTS
} kpl__tpart;

typedef struct {
    int part;                  /* the part the clock runs for */
    double since;              /* since when (kpl_seconds) */
    double sum[KPL__T_PARTS];  /* seconds per part since the last timing record */
    int64_t step0;             /* t->step at the last timing record */
    kpl_bucketer_stats b0[KPL__MAX_MODELS]; /* each model's bucketer counters then */
    uint64_t recomputed0;                   /* kpl_recompute_count() then (memory.recompute) */
} kpl__timing;

/* A region being timed: the part it interrupted and its start. */
typedef struct {
    int prev;
    double t0;
} kpl__tmark;

typedef struct kpl__prof kpl__prof; /* the step profiler (profile.steps) */

/* What the run reports (report.c, fit.c): the training figures, the
 * losses still to check, the sample counts behind images/s and the
 * progress bar. */
typedef struct {
    kpl__figure fig[KPL_FIGURES_MAX];
    int nfig;
    kpl__watched *watch;              /* losses not checked yet */
    int nwatch, capwatch;
    double win_samples;               /* this rank's samples since the last report */
    double epoch_t0, epoch_samples;   /* the epoch's start; this rank's samples in it */
    double bar_t, bar_samples, rate;  /* the progress bar's last redraw; samples/s */
    int64_t last_report_step;         /* the step of the last report */
    double images_per_sec;            /* the last epoch's, for the final report */
} kpl__reporter;

/* Where the run continues from (trainer_setup.c, trainer_ckpt.c):
 * kpl_trainer_options' resume, job and restart. */
typedef struct {
    kpl_checkpoint *ckpt;   /* the checkpoint resumed from, until its state is restored */
    bool reset_optimizer;   /* kpl_trainer_options.reset_optimizer */
    char path[PATH_MAX];    /* the checkpoint resumed from ("": a fresh start) */
    char job_id[65];
    int restart, max_restarts;
    /* restart_note: what the restart found to continue from, for say_start */
    char restart_reason[1024], restart_note[2 * PATH_MAX];
} kpl__resume;

/* How the run stops (fit.c, trainer.c). */
typedef struct {
    bool armed;  /* inside kpl_trainer_fit: SIGINT / SIGTERM stop the run */
    int sig;     /* the stop every rank agreed on (a signal number), 0: none yet */
    bool failed; /* a collective call failed here: destroy ends the job */
} kpl__stop;

struct kpl_trainer {
    const kpl_recipe *r; /* &recipe */
    kpl_recipe recipe;   /* the caller's, copied: theirs may go */
    const kpl_task_kind *task;
    void *task_state;
    kpl__runlog log;
    int32_t rank, world, local_rank, local_size;
    kpl_device *dev;
    kpl_comm *comm;
    int64_t chw[3];
    kpl__model models[KPL__MAX_MODELS];
    int nmodels;
    bool building; /* inside the task's create: add_model allowed */
    kpl_lr_schedule sched; /* base_lr and min_lr scaled by lr_scale (make_schedule, the
                              one place the recipe's lr is scaled) */
    double lr_scale;       /* optimizer.lr_scaling's factor */
    kpl_loader *train, *val;
    char train_path[PATH_MAX], val_path[PATH_MAX];
    char run_dir[PATH_MAX], ckpt_dir[PATH_MAX + 16];
    int run_lock; /* rank 0: the run directory's lock (a descriptor), else -1 */
    int64_t batches_per_epoch, steps_per_epoch, total_steps;
    int64_t step, epoch, epoch_step; /* steps done; the epoch in progress; its steps done */
    /* the step under way */
    int64_t micro, micros;            /* micro-batch i of k */
    bool sync;                        /* its backward reduces over the ranks */
    const kpl_batch *batch;
    bool epoch_ended;                 /* the last step ended t->epoch: the next starts the next */
    bool step_nonfinite;              /* a micro-batch of the step had a NaN/inf loss */
    kpl_step_result *step_out; /* run_train_step's result, for its task_call */
    bool step_skipped;                /* an update of the step was left out */
    /* best model */
    double best;                      /* the best metric so far, NAN: none */
    int64_t best_step;
    int64_t skipped_steps, skips_in_row; /* loss.nonfinite skip: updates left out (note_skip
                                            counts them, the one place) */
    int64_t epoch_skipped0;              /* skipped_steps when this epoch (or resume) began */
    int64_t skipped_examples;            /* train: corrupt examples dropped, all ranks */
    int64_t train_skipped_seen;          /* this rank's loader count already reported */
    bool eval_pending; /* the checkpoint being written precedes its evaluation */
    /* the evaluation's sums (the task kind's eval_sums): this rank's, then
     * the totals over the ranks for eval_end */
    double eval_sum[32];
    int neval_sums;
    bool in_eval;
    bool have_val; /* the latest evaluation, for the final report */
    kpl_eval_result val_res;
    double t_start;
    kpl__reporter rep;
    kpl__resume resume;
    kpl__stop stop;
    kpl__timing tm; /* where the steps' time went since the last timing record */
    kpl__prof *prof; /* profile.steps: the step profiler; NULL: off */
    struct {         /* profile.memory (memprof.c) */
        kpl_memrec *rec; /* recording the window; NULL: not now */
        double t0;       /* when it started (kpl_seconds) */
        int64_t step;    /* the window's first step */
    } memprof;
};

/* profile.c: the timing parts and the step profiler.  A region:
 *     kpl__tmark m = kpl__timing_begin(t, KPL__T_DATA);   // part < 0: the part stays
 *     ... kpl__timing_end(t, m, "data wait", -1);         // span name (NULL: none), model
 * switches the clock to `part` and back, and when the step profiler
 * records, traces the region as a span of the step lane named `span`
 * (with model k's name appended when the trainer has several). */
kpl__tmark kpl__timing_begin(kpl_trainer *t, int part);
double kpl__timing_end(kpl_trainer *t, kpl__tmark m, const char *span, int model);
/* The end of an epoch (or the run) starts: the clock stops until the next
 * step begins (kpl__timing_step). */
void kpl__timing_pause(kpl_trainer *t);
/* A step begins: the clock runs again if it was paused; the step profiler
 * starts recording at profile.steps' first step. */
void kpl__timing_step(kpl_trainer *t);
/* A step ended (t->step counts it): its span; at profile.steps' last step
 * the trace is written and said. */
void kpl__timing_step_end(kpl_trainer *t);
/* The `timing` record of the steps since the last one and its console
 * line (rank 0); collective (the slowest rank), every rank at the same
 * step: kpl__trainer_report calls it. */
kpl_status kpl__timing_report(kpl_trainer *t);
/* The step profiler of profile.steps, with a ready hook on every trained
 * parameter of every model (before DDP's, which kpl_ddp_destroy clears
 * with it).  Nothing when the recipe has no profile.steps. */
/* A point of a counter track in the trace (ph "C"), at t (kpl_seconds). */
void kpl__prof_counter(kpl_trainer *t, const char *name, double t_abs, double value);
/* memprof.c: the memory profile of the profile.steps window
 * (profile.memory); begun when the trace opens, written as it closes. */
kpl_status kpl__memprof_begin(kpl_trainer *t);
void kpl__memprof_end(kpl_trainer *t);
kpl_status kpl__prof_create(kpl_trainer *t);
/* The run ends (or stops) inside the window: what was recorded is written
 * and said.  Nothing otherwise. */
void kpl__prof_flush(kpl_trainer *t);
/* At a run's end: a warning when profile.steps named no step it trained. */
void kpl__prof_ended(kpl_trainer *t);
/* Frees the profiler, after the models (their parameters' hooks point
 * into it). */
void kpl__prof_destroy(kpl_trainer *t);
/* Around a model's backward inside a step (t0: its start): the ready
 * hooks take the gradients' times between begin and end, and end traces a
 * span per module group; after a synchronised kpl_ddp_finish, the
 * buckets' allreduces. */
void kpl__prof_backward_begin(kpl_trainer *t, int model);
void kpl__prof_backward_end(kpl_trainer *t, int model, double t0);
void kpl__prof_buckets(kpl_trainer *t, int model);

/* A process of the validation loader that died, named (every step). */
kpl_status kpl__trainer_check_val(kpl_trainer *t);

/* trainer_setup.c: ranks, threads, device, run directory */
void kpl__trainer_ranks_from_env(kpl_trainer *t);
void kpl__trainer_pick_threads(kpl_trainer *t);
kpl_status kpl__trainer_pick_device(kpl_trainer *t);
/* The name of the device a rank trains on, from the recipe's `device`,
 * the launcher's KPL_DEVICE (NULL or "" when unset), the CUDA GPUs this
 * process sees and why there are none (kpl_device_unavailable_reason), and
 * its node-local rank; into name.  A CUDA device asked for (device: cuda,
 * or KPL_DEVICE=cuda:N under device: auto) with no GPU usable is
 * KPL_EDEVICE carrying CUDA's reason, never a quiet fall back to the CPU;
 * a malformed KPL_DEVICE is KPL_EINVAL.  Pure: kpl__trainer_pick_device
 * feeds it the process's values. */
kpl_status kpl__trainer_device_choice(const char *device, const char *env, int gpus,
                                      const char *why, int32_t local_rank, char *name,
                                      size_t len);
/* The newest complete checkpoint of the recipe's runs (--resume alone). */
bool kpl__trainer_latest_checkpoint(const kpl_recipe *r, char *path, size_t len);
/* A restarted launch (t->resume.restart >= 1): the newest complete checkpoint of
 * the run's own directory into t->resume.path, and *resume pointing at
 * it, when there is one; else *resume stays (NULL: a fresh start).  Says
 * what it found in t->resume.restart_note. */
void kpl__trainer_restart_checkpoint(kpl_trainer *t, const char **resume);
kpl_status kpl__trainer_make_comm(kpl_trainer *t);
/* Rank 0 names and makes the run directory, the others learn it; logs,
 * metrics.jsonl, TensorBoard, config.yaml. */
kpl_status kpl__trainer_make_run_dir(kpl_trainer *t);

/* trainer_ckpt.c: checkpoints of a run */
typedef struct {
    int64_t step, epoch, position, epoch_step, world_size, batch_size, accumulate;
    double best;
    int64_t best_step, skipped_steps, skipped_examples;
    bool eval_pending;
    void *rng;    /* json_t: per model, per rank [seed, offset] */
    void *models; /* json_t: the "models" array (name, optimizer), or NULL */
    void *scales; /* json_t: fp16 loss scales by model {name: [scale, good]}, or NULL */
} kpl__resume_meta;
kpl_status kpl__trainer_read_meta(const kpl_checkpoint *c, const char *path,
                                  kpl__resume_meta *m);
void kpl__trainer_meta_free(kpl__resume_meta *m);
/* Models, optimizer state and generators from t->resume.ckpt. */
kpl_status kpl__trainer_restore_state(kpl_trainer *t, const kpl__resume_meta *m);
kpl_status kpl__trainer_restore_models(kpl_trainer *t, const kpl_checkpoint *c,
                                       const char *path);
kpl_status kpl__trainer_clean_checkpoints(kpl_trainer *t);
/* A new best (rank 0, keep_best): ckpt becomes best.kpl. */
kpl_status kpl__trainer_note_best(kpl_trainer *t, const char *ckpt);

/* trainer.c: reports */
/* The figures since the last report summed over the ranks: a record in
 * metrics.jsonl and TensorBoard, a console line when there is no progress
 * bar.  Collective. */
kpl_status kpl__trainer_report(kpl_trainer *t);
/* Whether the run stops here: the largest signal number any rank caught
 * (SIGTERM 15 over SIGINT 2) once one has, else 0; once agreed it stays
 * (t->stop.sig).  Collective while nothing is agreed and world > 1. */
kpl_status kpl__trainer_agree_stop(kpl_trainer *t, int *sig);
/* op over the ranks of v[0..n) (collect.c; nothing on one rank). */
kpl_status kpl__trainer_reduce_host(kpl_trainer *t, double *v, int n, kpl_comm_op op);
/* Checks every watched loss (before a report, checkpoint or evaluation). */
kpl_status kpl__trainer_check_losses(kpl_trainer *t);
void kpl__trainer_draw_bar(kpl_trainer *t, bool force);
/* The epoch's figures are this epoch's from here on. */
void kpl__trainer_epoch_begin(kpl_trainer *t);
/* A json_t as one compact line with 9-digit figures (malloc'd; NULL for
 * NULL). */
char *kpl__json_line(void *obj);
/* A metrics.jsonl record (rank 0) with the wall time last: obj (json_t)
 * is consumed. */
void kpl__trainer_emit(kpl_trainer *t, void *obj);
/* A JSON number, or null for NaN and inf (JSON has neither). */
void *kpl__json_num(double v);
double kpl__trainer_best_of(const kpl_trainer *t, const kpl_eval_result *e);

const char *kpl__signal_name(int sig); /* "SIGINT", "SIGTERM" */



#endif /* KPL_RUN_IMPL_H */
