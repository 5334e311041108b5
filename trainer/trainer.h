/*
 * trainer.h — kpl's trainer: every public header of trainer/ (module.h,
 * layers.h, zoo.h, optim.h, checkpoint.h, ddp.h, tboard.h, recipe.h,
 * task.h, cocoeval.h, detector.h, fid.h) and the runner.
 *
 * kpl_trainer runs a recipe: data loaders, the communicator and DDP, one
 * optimizer per model, the schedule, checkpoints, metrics.jsonl and
 * TensorBoard.  What is particular to a kind of training lives in a task
 * (a vtable): it builds its models from the recipe, takes one training
 * micro-batch (forward, losses, kpl_trainer_backward), and evaluates.
 * `kpl train` is kpl_trainer_fit over the recipe's task; a program brings
 * its own task and modules (examples/autoencoder.c):
 *
 *   kpl_trainer *t = NULL;
 *   kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
 *   o.log = my_log;                         // what is for a console (below)
 *   kpl_status st = kpl_trainer_create(&recipe, &my_task, &o, &t);
 *   if (st >= 0) st = kpl_trainer_fit(t);   // epochs, evaluation, checkpoints
 *   if (st < 0 && st != KPL_ECANCELED) kpl_trainer_end_job(t, 1);  // every rank
 *   kpl_trainer_destroy(t);
 *
 * or step by step: kpl_trainer_step, kpl_trainer_evaluate, kpl_trainer_save.
 * One thread per trainer; every call that communicates is collective.
 */
#ifndef KPL_TRAINER_H
#define KPL_TRAINER_H

#include "checkpoint.h"
#include "cocoeval.h"
#include "ddp.h"
#include "detector.h"
#include "fid.h"
#include "infer.h"
#include "layers.h"
#include "module.h"
#include "optim.h"
#include "recipe.h"
#include "task.h"
#include "tboard.h"
#include "zoo.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- what a run says ------------------------------------------------------------------ */
/*
 * The trainer writes its files itself (each rank's log in the run
 * directory, rank 0's metrics.jsonl and TensorBoard) and prints nothing:
 * what is for a console goes to the log function of kpl_trainer_options,
 * on every rank.  `kpl train` installs one that prints rank 0's lines and
 * every rank's warnings and errors and draws the progress bar; a program
 * passes its own, or none for a quiet run:
 *
 *   static void say(void *ctx, const kpl_log_event *e)
 *   {
 *       if (e->kind == KPL_LOG_WARN || e->kind == KPL_LOG_ERROR)
 *           fprintf(stderr, "rank %d: %s
", (int)e->rank, e->text);
 *       else if (e->rank == 0 && e->kind != KPL_LOG_PROGRESS)
 *           printf("%s
", e->text);
 *   }
 */
typedef enum {
    KPL_LOG_INFO,     /* start, resume, checkpoints, evaluations, a stop */
    KPL_LOG_REPORT,   /* a report's line (step, figures, lr, img/s): a console with
                         a progress bar may leave it out */
    KPL_LOG_WARN,
    KPL_LOG_ERROR,    /* what ended the run or its start */
    KPL_LOG_PROGRESS, /* the epoch's progress (the fields below; text NULL), at most
                         5 times a second, on rank 0, only with
                         kpl_trainer_options.progress */
    KPL_LOG_RESULT    /* the last record of a run or an evaluation: one JSON line */
} kpl_log_kind;

typedef struct {
    kpl_log_kind kind;
    int32_t rank;
    const char *text; /* one line without its newline (borrowed for the call) */
    /* KPL_LOG_PROGRESS: epoch (from 0) of epochs, step of steps in it, the
     * mean loss since the last report, lr, images/s over all ranks, the
     * epoch's seconds to go */
    int64_t epoch, epochs, step, steps;
    double loss, lr, images_per_sec, eta;
} kpl_log_event;

/* Called on the trainer's thread; it must not call back into the trainer. */
typedef void (*kpl_log_fn)(void *ctx, const kpl_log_event *e);

/* ---- stopping ------------------------------------------------------------------------ */
/*
 * A stop is asked for process-wide (a signal cannot know the trainer):
 * kpl_trainer_fit looks at the request after every step and before every
 * evaluation batch, the ranks agree (any rank's request stops them all
 * after the same step), and the run ends with a checkpoint; start-up
 * gives up its long waits (a conversion, another's lock).
 */
/* Asks for a stop, naming the signal that asked (SIGTERM, SIGINT; the
 * log says it).  A SIGTERM request replaces a SIGINT one, never the
 * reverse.  Async-signal-safe. */
void kpl_request_stop(int sig);
/* The signal of the request, 0 when none. */
int kpl_stop_requested(void);
/* Forgets the request (before another run in the same process). */
void kpl_clear_stop(void);
/* Installs (on) or removes (restoring the default) handlers of SIGINT and
 * SIGTERM that call kpl_request_stop; a Ctrl-C after a stop was asked
 * ends the process at once.  Only when the program asks: the library
 * installs no handler itself. */
void kpl_catch_stop_signals(bool on);

/* ---- plugins ------------------------------------------------------------------------- */
/*
 * Tasks (task.h), zoo models (zoo.h) and optimizer rules (optim.h) are
 * found by name in registries that a program, or a plugin, adds to.  A
 * plugin is a shared library built against kpl's headers whose
 * constructors register its items; `kpl train --plugin lib.so` (or a
 * recipe's `plugins:` list) loads it, so the stock `kpl train` and kplrun
 * run its task with no rebuild of kpl.  Loading a plugin runs its code.
 *
 *   // mytask.c, built with: cc -shared -fPIC mytask.c $(pkg-config --cflags --libs kpl)
 *   #include <trainer.h>
 *   KPL_PLUGIN_ABI;
 *   static const kpl_task_kind my_task = {.name = "mytask", ...};
 *   __attribute__((constructor)) static void add(void) { kpl_task_register(&my_task); }
 */
/* The layout of every struct a plugin shares with kpl; a plugin built
 * against another is refused at load, naming both. */
#define KPL_ABI_VERSION 6
/* In one source file of a plugin: the ABI it was built against. */
#define KPL_PLUGIN_ABI \
    __attribute__((visibility("default"))) const int kpl_plugin_abi_version = KPL_ABI_VERSION

/* dlopen()s the plugin at path (once: a path loaded before is OK) and adds
 * what its constructors registered, after checking its ABI.  Errors name
 * the path: dlerror()'s text for a library that does not load,
 * KPL_EFORMAT for a missing or different ABI version, KPL_EINVAL for a
 * name registered twice (nothing of the plugin is kept then).  Not
 * thread-safe: load plugins before training starts. */
kpl_status kpl_plugin_load(const char *path);
/* The plugins loaded (their resolved paths), in order. */
int kpl_plugin_count(void);
const char *kpl_plugin_path(int i);

/* ---- the runner ---------------------------------------------------------------------- */

typedef struct {
    const char *resume;     /* NULL: a new run; "": the newest checkpoint; else a file */
    const char *checkpoint; /* evaluation only: the models' weights; no training data,
                               optimizer or run directory */
    bool reset_optimizer;   /* with resume: every optimizer's state starts fresh (the
                               weights, data position and generators still resume).
                               Without it, a checkpoint whose optimizer differs from
                               the run's (another rule, momentum on or off) is
                               refused, naming both */
    kpl_log_fn log;         /* NULL: nothing for a console (the files are written) */
    void *log_ctx;
    bool progress;          /* send KPL_LOG_PROGRESS events (a bar is drawn) */
    /* A job that a launcher starts again after a failure (kplrun
     * --max-restarts; `kpl train` takes these from KPL_JOB_ID,
     * KPL_RESTART_COUNT, KPL_MAX_RESTARTS and KPL_RESTART_REASON): */
    const char *job_id;     /* the job's name, the same in each of its launches: a run
                               without run_dir goes to runs/<name>-<job_id> (else
                               runs/<name>-<time>), which a first launch must create
                               anew.  Letters, digits, '.', '_', '-'; at most 64.
                               NULL or "": none */
    int restart;            /* which launch this is: 0 the first, k >= 1 the k-th
                               restart.  A restart continues from the newest complete
                               checkpoint of the run's own directory (run_dir; that of
                               the `resume` file; runs/<name>-<job_id>) when it has one,
                               with the optimizer state it saved (reset_optimizer then
                               does not apply); when it has none, it starts as
                               `resume` says, fresh by default.  It says so and records
                               {"event":"restart"} in metrics.jsonl */
    int max_restarts;       /* for that record: how many restarts the launcher makes */
    const char *restart_reason; /* for that record: what failed (NULL: not known) */
} kpl_trainer_options;
#define KPL_TRAINER_OPTIONS_INIT {NULL, NULL, false, NULL, NULL, false, NULL, 0, 0, NULL}

/* Everything up to the first step, in the order the data needs: ranks,
 * threads, device; data (converted when missing) and the checkpoint to
 * resume; loaders (they fork before any thread exists); communicator and
 * run directory; the task's models, optimizers, restored state, DDP.
 * *out owned by the caller.  Collective.  A failure is also said as a
 * run says it (KPL_LOG_ERROR, this rank's log file); *out is then NULL,
 * and the other ranks may be waiting for this one in a collective: end
 * the job (kpl_trainer_end_job).  KPL_ECANCELED when a stop was asked
 * during start-up.  KPL_EINVAL when the recipe's `task` is not the
 * task's name.  The trainer keeps its own copy of *r and *o. */
kpl_status kpl_trainer_create(const kpl_recipe *r, const kpl_task_kind *task,
                              const kpl_trainer_options *o, kpl_trainer **out);
/* Frees; NULL is a no-op.  Collective only in that the communicator's
 * end is (after a failure, end the job first). */
void kpl_trainer_destroy(kpl_trainer *t);
/* After a failure on this rank, when the job has other ranks: ends them
 * all (they may wait in a collective for this one; MPI_Abort with code)
 * and does not return.  On one rank, or before MPI started, it returns
 * and the caller exits as it likes.  t may be NULL (a failed create). */
void kpl_trainer_end_job(kpl_trainer *t, int code);
/* One optimizer step of `accumulate` micro-batches; *epoch_done when it
 * took the epoch's last batch.  Collective. */
kpl_status kpl_trainer_step(kpl_trainer *t, bool *epoch_done);
/* The task's evaluation on the validation split.  Collective. */
kpl_status kpl_trainer_evaluate(kpl_trainer *t, kpl_eval_result *res);
/* A checkpoint of everything a resume needs; path (len bytes; may be
 * NULL) receives the file on rank 0, "" on the others.  A buffer too
 * small for the name is an error before anything is written.
 * Collective; rank 0 writes. */
kpl_status kpl_trainer_save(kpl_trainer *t, const char *why, char *path, size_t len);
/* The models' weights from a checkpoint (every tensor must match). */
kpl_status kpl_trainer_restore(kpl_trainer *t, const char *path);
/* The whole run: epochs of steps, reports, evaluation, checkpoints, best,
 * the final record (KPL_LOG_RESULT).  A stop (kpl_request_stop on any
 * rank) ends every rank after the same step with a checkpoint; a stop
 * starts no evaluation and ends one under way, leaving it to --resume.
 * KPL_OK when the run is done, KPL_ECANCELED after a stop
 * (kpl_trainer_stop_signal says which), else the error (said as
 * KPL_LOG_ERROR; end the job: kpl_trainer_end_job).  Collective. */
kpl_status kpl_trainer_fit(kpl_trainer *t);
/* What `kpl eval` does: kpl_trainer_evaluate on the validation split of a
 * trainer created with options.checkpoint, then on rank 0 the figures in
 * the log, the task's eval_report and an "eval" result record naming
 * checkpoint (a label: the weights are those the trainer loaded).  NaN or
 * inf outputs are an error after the figures are said.  Collective. */
kpl_status kpl_trainer_eval_checkpoint(kpl_trainer *t, const char *checkpoint);
/* What `kpl export` does: model 0's inference graph for an input batch of
 * `batch` (1 to 65536), traced in eval mode from the trainer's input
 * shape, its output (the forward's first) named by the task's
 * export_output, optimised at
 * `level` (0 to 3; with the inference fusions when fuse), written to path
 * (NULL: not written) as a model file (infer.h) with what inference
 * needs; *ir (may be NULL) receives the graph, the caller's to destroy.
 * KPL_EINVAL when the task has no inference graph or the validation
 * transform gives each image its own size. */
kpl_status kpl_trainer_export(kpl_trainer *t, int64_t batch, int level, bool fuse,
                              const char *path, kpl_ir **ir);
/* The signal whose stop every rank agreed on, 0 when none. */
int kpl_trainer_stop_signal(const kpl_trainer *t);
/* Steps done, and the epoch of the last step (from 0; the step after the
 * one that reported *epoch_done starts the next). */
int64_t kpl_trainer_steps(const kpl_trainer *t);
int64_t kpl_trainer_epoch(const kpl_trainer *t);

#ifdef __cplusplus
}
#endif
#endif /* KPL_TRAINER_H */
