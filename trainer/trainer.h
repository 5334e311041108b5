/*
 * trainer.h — kpl's trainer: every public header of trainer/ (module.h,
 * layers.h, zoo.h, optim.h, checkpoint.h, ddp.h, tboard.h, recipe.h,
 * task.h) and the runner.
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
 *   if (kpl_trainer_create(&recipe, &my_task, &o, &t) < 0) ...
 *   int rc = kpl_trainer_fit(t);            // epochs, evaluation, checkpoints
 *   kpl_trainer_destroy(t);
 *
 * or step by step: kpl_trainer_step, kpl_trainer_evaluate, kpl_trainer_save.
 * One thread per trainer; every call that communicates is collective.
 */
#ifndef KPL_TRAINER_H
#define KPL_TRAINER_H

#include "checkpoint.h"
#include "ddp.h"
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

typedef struct {
    const char *resume;     /* NULL: a new run; "": the newest checkpoint; else a file */
    const char *checkpoint; /* evaluation only: the models' weights; no training data,
                               optimizer or run directory */
    bool reset_optimizer;   /* with resume: every optimizer's state starts fresh (the
                               weights, data position and generators still resume).
                               Without it, a checkpoint whose optimizer differs from
                               the run's (another rule, momentum on or off) is
                               refused, naming both */
} kpl_trainer_options;
#define KPL_TRAINER_OPTIONS_INIT {NULL, NULL, false}

/* Everything up to the first step, in the order the data needs: ranks,
 * threads, device; data (converted when missing) and the checkpoint to
 * resume; loaders (they fork before any thread exists); communicator and
 * run directory; the task's models, optimizers, restored state, DDP.
 * *out owned by the caller.  Collective.  A failure is also reported as a
 * run reports it (stderr and this rank's log) and ends the job on every
 * rank; *out is then NULL.  KPL_EINVAL when the recipe's `task` is not
 * the task's name.  The trainer keeps its own copy of *r. */
kpl_status kpl_trainer_create(const kpl_recipe *r, const kpl_task_kind *task,
                              const kpl_trainer_options *o, kpl_trainer **out);
/* Ends the job on every rank when one fails (the others wait in a
 * collective for it), then frees; NULL is a no-op. */
void kpl_trainer_destroy(kpl_trainer *t);
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
 * the final report.  It installs SIGINT / SIGTERM handlers for its
 * duration (restoring the defaults after): a signal to any rank stops
 * every rank after the same step (they agree after each step, and before
 * each evaluation batch), with a checkpoint; a stop starts no evaluation
 * and ends one under way, leaving it to --resume.  Returns the exit
 * status: 0, 1 after an error (printed), 130 / 143 after SIGINT /
 * SIGTERM.  Collective. */
int kpl_trainer_fit(kpl_trainer *t);
/* Steps done, and the epoch of the last step (from 0; the step after the
 * one that reported *epoch_done starts the next). */
int64_t kpl_trainer_steps(const kpl_trainer *t);
int64_t kpl_trainer_epoch(const kpl_trainer *t);

#ifdef __cplusplus
}
#endif
#endif /* KPL_TRAINER_H */
