/*
 * fit.c — the loop of a run (kpl_trainer_fit): epochs of steps, reports,
 * the epoch's checkpoint before its evaluation, the best model, the last
 * words; and `kpl eval`'s evaluation.  It knows nothing of labels or
 * accuracy: those are the task's.
 */
#define _GNU_SOURCE
#include "run_impl.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What an evaluation with NaN or inf outputs means: the model diverged
 * (an error under loss.nonfinite stop, a warning under skip). */
static kpl_status check_finite(kpl_trainer *t, const kpl_eval_result *e, bool fatal)
{
    if (e->nonfinite == 0) return KPL_OK;
    char msg[256];
    snprintf(msg, sizeof msg, "%lld of %lld validation examples gave NaN or inf outputs (counted "
             "as wrong): the model has diverged", (long long)e->nonfinite,
             (long long)e->examples);
    if (fatal) return KPL_ERROR(KPL_ERANGE, "%s", msg);
    if (t->rank == 0) kpl__log_warn(&t->log, "%s", msg);
    return KPL_OK;
}

/* The eval record: step, epoch, val_<metric>..., counts. */
static json_t *eval_record(kpl_trainer *t, const kpl_eval_result *e)
{
    json_t *j = json_pack("{s:s, s:I, s:I}", "event", "eval", "step", (json_int_t)t->step,
                          "epoch", (json_int_t)(t->epoch + (t->epoch_step ? 1 : 0)));
    for (int i = 0; j && i < e->metrics.n; i++) {
        char key[48];
        snprintf(key, sizeof key, "val_%s", e->metrics.name[i]);
        json_object_set_new(j, key, kpl__json_num(e->metrics.value[i]));
    }
    json_object_set_new(j, "examples", json_integer(e->examples));
    json_object_set_new(j, "nonfinite", json_integer(e->nonfinite));
    json_object_set_new(j, "skipped_examples", json_integer(e->skipped));
    return j;
}

/* The records of metrics.jsonl that a resume at step `step` trains again:
 * those with a larger step, not superseded by an earlier resume record
 * already.  A reader summing records drops, at each resume record, the
 * records before it whose step is larger than its step (docs/recipes.md);
 * the count goes into the record.  A line cut short by a kill is not a
 * record. */
static int64_t superseded(const char *run_dir, int64_t step)
{
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run_dir);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int64_t *live = NULL, gone = 0;
    size_t n = 0, cap = 0, len = 0;
    char *line = NULL;
    while (getline(&line, &len, f) > 0) {
        json_t *j = json_loads(line, 0, NULL), *st = json_object_get(j, "step");
        const char *ev = json_string_value(json_object_get(j, "event"));
        if (json_is_integer(st)) {
            int64_t v = json_integer_value(st);
            if (ev && !strcmp(ev, "resume")) {
                size_t k = 0;
                for (size_t i = 0; i < n; i++)
                    if (live[i] <= v) live[k++] = live[i];
                n = k;
            } else {
                int64_t *more = n < cap ? live : realloc(live, (2 * cap + 64) * sizeof *live);
                if (more && n == cap) live = more, cap = 2 * cap + 64;
                if (more) live[n++] = v; /* out of memory: the count is what was seen */
            }
        }
        json_decref(j);
    }
    for (size_t i = 0; i < n; i++) gone += live[i] > step;
    free(line);
    free(live);
    fclose(f);
    return gone;
}

/* An evaluation during training: recorded, the best so far noted (never
 * one with NaN outputs). */
static kpl_status run_eval(kpl_trainer *t)
{
    if (!t->val) return KPL_OK;
    double t0 = kpl_seconds();
    kpl__tmark m = kpl__timing_begin(t, -1);
    /* memory.budget_mb bounds the training steps, not the evaluation
     * (nothing there to recompute) */
    size_t budget = kpl_device_budget(kpl_trainer_device(t));
    if (budget) kpl_recompute_set_budget(kpl_trainer_device(t), 0);
    kpl_status st = kpl_trainer_evaluate(t, &t->val_res);
    if (budget) kpl_recompute_set_budget(kpl_trainer_device(t), budget);
    kpl__timing_end(t, m, "evaluation", -1);
    KPL_TRY(st);
    t->have_val = true;
    const kpl_eval_result *e = &t->val_res;
    double v = kpl__trainer_best_of(t, e);
    bool better = isnan(t->best) || (t->task->best_higher ? v > t->best : v < t->best);
    if (e->nonfinite == 0 && isfinite(v) && better) t->best = v, t->best_step = t->step;
    json_t *j = eval_record(t, e);
    json_object_set_new(j, "seconds", json_real(kpl_seconds() - t0));
    kpl__trainer_emit(t, j);
    KPL_TRY(check_finite(t, e, t->r->loss.nonfinite == KPL_NONFINITE_STOP));
    if (t->rank != 0 || !t->log.tb) return KPL_OK;
    for (int i = 0; i < e->metrics.n; i++) {
        char tag[64];
        snprintf(tag, sizeof tag, "val/%s", e->metrics.name[i]);
        kpl_tb_add_scalar(t->log.tb, tag, t->step, e->metrics.value[i]);
    }
    if (t->task->images) KPL_TRY(t->task->images(t, t->task_state, t->log.tb, t->step));
    kpl_tb_flush(t->log.tb);
    return KPL_OK;
}

static void say_start(kpl_trainer *t)
{
    const kpl_recipe *r = t->r;
    char models[512] = "";
    for (int k = 0, at = 0; k < t->nmodels && at < (int)sizeof models - 128; k++)
        at += snprintf(models + at, sizeof models - (size_t)at, "%s%s (%.2fM parameters, input "
                       "%lldx%lldx%lld)", k ? ", " : "", t->models[k].label,
                       (double)kpl_module_param_count(t->models[k].m) / 1e6,
                       (long long)t->chw[0], (long long)t->chw[1], (long long)t->chw[2]);
    kpl__log_info(&t->log, "kpl train %s: %s on %s, %d rank%s x %d thread%s; batch %lld x %d%s; "
                  "%lld steps/epoch; run dir %s", r->name, models, kpl_device_name(t->dev),
                  (int)t->world, t->world > 1 ? "s" : "", kpl_get_num_threads(),
                  kpl_get_num_threads() > 1 ? "s" : "", (long long)r->data.train.loader.batch_size,
                  (int)t->world, r->optimizer.accumulate > 1 ? " (with accumulation)" : "",
                  (long long)t->steps_per_epoch, t->run_dir);
    if (r->precision != KPL_F32) {
        kpl_dtype dt = r->precision;
        const char *pname = dt == KPL_F16 ? "fp16" : kpl_dtype_name(dt); /* the recipe's word */
        bool native = kpl_precision_native(kpl_device_type_of(t->dev), dt);
        if (native)
            kpl__log_info(&t->log, "precision %s: convolutions and matmuls in %s (batch norm and "
                          "element-wise ops keep %s activations), statistics, reductions and "
                          "losses in f32%s",
                          pname, kpl_dtype_name(dt), kpl_dtype_name(dt),
                          r->precision == KPL_F16 ? " (dynamic loss scale)" : "");
        else
            kpl__log_warn(&t->log, "precision %s: %s has no native %s convolution or matmul "
                          "(%s); they compute in f32 and round, slower than precision f32",
                          pname, kpl_device_name(t->dev),
                          kpl_dtype_name(dt), kpl_device_type_of(t->dev) == KPL_DEVICE_CPU
                                                  ? kpl_cpu_math_info() : "cuda");
    }
    if (kpl_plugin_count()) { /* their code runs in this process: say which */
        char list[4096];
        kpl__plugin_list(list, sizeof list);
        kpl__log_info(&t->log, "plugins: %s", list);
    }
    if (t->resume.path[0]) {
        kpl__log_info(&t->log, "resumed from %s at step %lld (epoch %lld)", t->resume.path,
                      (long long)t->step, (long long)t->epoch + 1 + (t->epoch_ended ? 1 : 0));
        int64_t gone = t->rank == 0 ? superseded(t->run_dir, t->step) : 0;
        kpl__trainer_emit(t, json_pack("{s:s, s:I, s:s, s:I}", "event", "resume", "step",
                                       (json_int_t)t->step, "from", t->resume.path,
                                       "superseded", (json_int_t)gone));
    }
    if (t->resume.restart < 1) return;
    /* a launcher's restart after a failure: which, why, and from where */
    kpl__log_info(&t->log, "restart %d/%d after a failure (%s): %s (step %lld)", t->resume.restart,
                  t->resume.max_restarts, t->resume.restart_reason[0] ? t->resume.restart_reason : "reason not given",
                  t->resume.restart_note, (long long)t->step);
    json_t *j = json_pack("{s:s, s:i, s:i, s:I}", "event", "restart", "restart", t->resume.restart,
                          "max_restarts", t->resume.max_restarts, "step", (json_int_t)t->step);
    if (j) {
        json_object_set_new(j, "from", t->resume.path[0] ? json_string(t->resume.path) : json_null());
        json_object_set_new(j, "reason", t->resume.restart_reason[0] ? json_string(t->resume.restart_reason)
                                                              : json_null());
    }
    kpl__trainer_emit(t, j);
}

/* The epoch's figures: train_<figure> means over the epoch (null for an
 * epoch whose every step was skipped), and its skipped steps. */
static void put_train_figures(kpl_trainer *t, json_t *j)
{
    for (int i = 0; i < t->rep.nfig; i++) {
        char key[48];
        snprintf(key, sizeof key, "train_%s", t->rep.fig[i].name);
        json_object_set_new(j, key, kpl__json_num(t->rep.fig[i].last));
    }
}

/* The last words: the `done` (or `interrupted`) record, also for the console. */
static void say_done(kpl_trainer *t, const char *event, double train_seconds, double samples,
                     const char *ckpt)
{
    if (t->rank != 0) return;
    json_t *j = json_pack("{s:s, s:f, s:I}", "event", event, "epochs",
                          (double)t->step / (double)t->steps_per_epoch, "steps", (json_int_t)t->step);
    put_train_figures(t, j);
    /* the last evaluation's metrics, or the best metric's place */
    for (int i = 0; i < (t->have_val ? t->val_res.metrics.n : 1); i++) {
        char key[48];
        snprintf(key, sizeof key, "val_%s", t->have_val ? t->val_res.metrics.name[i]
                                                        : t->task->best_metric);
        json_object_set_new(j, key, kpl__json_num(t->have_val ? t->val_res.metrics.value[i] : NAN));
    }
    char key[48];
    snprintf(key, sizeof key, "best_%s", t->task->best_metric);
    json_object_set_new(j, key, kpl__json_num(t->best));
    json_object_set_new(j, "skipped_steps", json_integer(t->skipped_steps));
    json_object_set_new(j, "skipped_examples", json_integer(t->skipped_examples));
    json_object_set_new(j, "images_per_sec",
                        kpl__json_num(train_seconds > 0 ? samples / train_seconds : NAN));
    json_object_set_new(j, "seconds", json_real(kpl_seconds() - t->t_start));
    json_object_set_new(j, "ranks", json_integer(t->world));
    json_object_set_new(j, "run_dir", json_string(t->run_dir));
    json_object_set_new(j, "checkpoint", json_string(ckpt));
    char *s = kpl__json_line(j);
    if (s) kpl__log_metrics(&t->log, s);
    if (s) kpl__log_result(&t->log, s);
    free(s);
    json_decref(j);
}

/* An evaluation that a stop may end: KPL_ECANCELED is the stop (every
 * rank agreed on it, t->stop.sig), not an error. */
static kpl_status run_eval_or_stop(kpl_trainer *t, bool *stopped)
{
    kpl_status st = run_eval(t);
    *stopped = st == KPL_ECANCELED;
    if (*stopped) kpl__log_info(&t->log, "%s", kpl_last_error());
    return *stopped ? KPL_OK : st;
}

/* A checkpoint resumed from that was written before its epoch's
 * evaluation, which did not finish: that evaluation first; a resume of a
 * finished run: where it stands.  A stop meanwhile leaves the checkpoint
 * as it was (its evaluation still to come). */
static kpl_status resume_pending(kpl_trainer *t, int64_t max_steps)
{
    bool pending = t->eval_pending, finished = t->step >= max_steps, stopped = false;
    if (pending && !finished) {
        t->eval_pending = false;
        kpl__log_info(&t->log, "evaluating the resumed checkpoint first (its evaluation did not "
                      "finish)");
        KPL_TRY(run_eval_or_stop(t, &stopped));
    }
    if (finished) {
        kpl__log_info(&t->log, "nothing to train: step %lld of %lld is done", (long long)t->step,
                      (long long)max_steps);
        KPL_TRY(run_eval_or_stop(t, &stopped));
    }
    if (stopped) return KPL_OK;
    if (pending && t->best_step == t->step) KPL_TRY(kpl__trainer_note_best(t, t->resume.path));
    return KPL_OK;
}

/* The end of an epoch (or of the run, or a stop): its record, its
 * checkpoint before its evaluation (which can fail without losing the
 * epoch: the checkpoint says its evaluation is to come, and a resume runs
 * that first), the evaluation, the best model.  A stop (t->stop.sig)
 * starts no evaluation, and one that lands during the evaluation ends it:
 * either way the checkpoint says that the evaluation is to come. */
static kpl_status end_epoch(kpl_trainer *t, bool epoch_done, bool last, double secs, char *ckpt,
                            size_t len)
{
    const kpl_recipe *r = t->r;
    bool stop = t->stop.sig != 0;
    /* the epoch's means; none (NaN, null in JSON) when nothing was counted
     * in it: an epoch of skipped steps does not repeat the last one's */
    for (int i = 0; i < t->rep.nfig; i++)
        t->rep.fig[i].last = t->rep.fig[i].epoch_count > 0 ? t->rep.fig[i].epoch_sum / t->rep.fig[i].epoch_count
                                                   : NAN;
    int64_t skipped = t->skipped_steps - t->epoch_skipped0;
    t->rep.images_per_sec = secs > 0 ? t->rep.epoch_samples * t->world / secs : 0;
    int64_t finished = t->epoch + 1; /* epochs complete once this one is */
    bool eval_due = t->val && (last || (epoch_done && r->eval.every_epochs > 0 &&
                                        finished % r->eval.every_epochs == 0));
    if (epoch_done) {
        json_t *j = json_pack("{s:s, s:I, s:I}", "event", "epoch", "epoch", (json_int_t)finished,
                              "step", (json_int_t)t->step);
        put_train_figures(t, j);
        json_object_set_new(j, "skipped_steps", json_integer(skipped));
        json_object_set_new(j, "images_per_sec", json_real(t->rep.images_per_sec));
        json_object_set_new(j, "seconds", json_real(secs));
        kpl__trainer_emit(t, j);
        if (t->rank == 0 && t->log.tb)
            kpl_tb_add_scalar(t->log.tb, "epoch/images_per_sec", finished, t->rep.images_per_sec);
    }
    bool ckpt_due = last || stop || (epoch_done && r->checkpoint.every_epochs > 0 &&
                                     finished % r->checkpoint.every_epochs == 0);
    bool saved = false, evaluated = false;
    if (ckpt_due) {
        t->eval_pending = eval_due;
        kpl_status st = kpl_trainer_save(t, stop && !last ? "signal" : last ? "end" : "epoch",
                                         ckpt, len);
        t->eval_pending = false;
        KPL_TRY(st);
        saved = true;
    }
    if (eval_due && !stop) {
        bool stopped = false;
        KPL_TRY(run_eval_or_stop(t, &stopped));
        evaluated = !stopped;
        if (stopped && !saved) { /* no checkpoint of this step yet: one whose evaluation is to come */
            t->eval_pending = true;
            kpl_status st = kpl_trainer_save(t, "signal", ckpt, len);
            t->eval_pending = false;
            KPL_TRY(st);
            saved = true;
        }
    }
    if (saved && evaluated && t->rank == 0) KPL_TRY(kpl__checkpoint_mark_evaluated(ckpt));
    if (t->rank == 0) {
        char line[1024];
        int at = snprintf(line, sizeof line, "epoch %lld/%lld%s: train", (long long)finished,
                          (long long)r->epochs, epoch_done ? "" : " (stopped early)");
        for (int i = 0; i < t->rep.nfig && at < (int)sizeof line - 64; i++)
            at += snprintf(line + at, sizeof line - (size_t)at, " %s %.4f", t->rep.fig[i].name,
                           t->rep.fig[i].last);
        for (int i = 0; evaluated && i < t->val_res.metrics.n && at < (int)sizeof line - 64; i++)
            at += snprintf(line + at, sizeof line - (size_t)at, "%s %s %.4f", i ? "" : " | val",
                           t->val_res.metrics.name[i], t->val_res.metrics.value[i]);
        if (skipped > 0 && at < (int)sizeof line - 96)
            at += snprintf(line + at, sizeof line - (size_t)at, " (%lld of its %lld steps skipped: "
                           "NaN or inf)", (long long)skipped,
                           (long long)(t->epoch_step < skipped ? skipped : t->epoch_step));
        kpl__log_info(&t->log, "%s | %.0f img/s, %.1f s", line, t->rep.images_per_sec, secs);
        if (evaluated && last && t->task->eval_report) t->task->eval_report(t, t->task_state);
    }
    bool improved = evaluated && t->best_step == t->step && r->checkpoint.keep_best;
    if (improved && !saved) /* a best epoch between the scheduled checkpoints */
        KPL_TRY(kpl_trainer_save(t, "best", ckpt, len));
    if (improved) KPL_TRY(kpl__trainer_note_best(t, ckpt));
    return KPL_OK;
}

/* A stop agreed before the first step (SIGINT / SIGTERM during start-up,
 * or during the resumed checkpoint's pending evaluation): a new run keeps
 * its start as a checkpoint of step 0; a resumed one has its checkpoint. */
static kpl_status stop_at_start(kpl_trainer *t, char *ckpt, size_t len)
{
    if (t->resume.path[0]) {
        snprintf(ckpt, len, "%s", t->resume.path);
        return KPL_OK;
    }
    return kpl_trainer_save(t, "signal", ckpt, len);
}

static kpl_status fit(kpl_trainer *t, const char **event, char *ckpt, size_t len)
{
    const kpl_recipe *r = t->r;
    say_start(t);
    int64_t max_steps = r->max_steps > 0 && r->max_steps < t->total_steps ? r->max_steps
                                                                          : t->total_steps;
    KPL_TRY(kpl__trainer_agree_stop(t, NULL));
    if (!t->stop.sig) KPL_TRY(resume_pending(t, max_steps));
    if (t->stop.sig) KPL_TRY(stop_at_start(t, ckpt, len));
    if (r->eval.at_start && t->step == 0 && t->val && !t->stop.sig) {
        /* the untrained model's figures, the baseline of the run's */
        bool stopped = false;
        KPL_TRY(run_eval_or_stop(t, &stopped));
        if (!stopped && t->rank == 0) {
            char line[1024];
            int at = snprintf(line, sizeof line, "before training: val");
            for (int i = 0; i < t->val_res.metrics.n && at < (int)sizeof line - 64; i++)
                at += snprintf(line + at, sizeof line - (size_t)at, " %s %.4f",
                               t->val_res.metrics.name[i], t->val_res.metrics.value[i]);
            kpl__log_info(&t->log, "%s", line);
        }
    }
    double train_seconds = 0, train_samples = 0;
    while (t->step < max_steps && !t->stop.sig) {
        kpl__trainer_epoch_begin(t);
        bool epoch_done = false, at_max = false;
        while (!epoch_done && !at_max && !t->stop.sig) {
            KPL_TRY(kpl_trainer_step(t, &epoch_done));
            KPL_TRY(kpl__trainer_check_val(t));
            KPL_TRY(kpl__trainer_agree_stop(t, NULL));
            at_max = t->step >= max_steps;
            bool due = t->step % r->log.every_steps == 0 || epoch_done || at_max || t->stop.sig;
            if (due) KPL_TRY(kpl__trainer_report(t));
            kpl__trainer_draw_bar(t, epoch_done);
            if (r->checkpoint.every_steps > 0 && t->step % r->checkpoint.every_steps == 0 &&
                !epoch_done && !at_max && !t->stop.sig)
                KPL_TRY(kpl_trainer_save(t, "steps", ckpt, len));
        }
        double secs = kpl_seconds() - t->rep.epoch_t0;
        train_seconds += secs;
        train_samples += t->rep.epoch_samples * t->world;
        kpl__timing_pause(t); /* an epoch's end is not a step's time */
        KPL_TRY(end_epoch(t, epoch_done, t->step >= max_steps, secs, ckpt, len));
    }
    kpl__prof_flush(t); /* a run that ends or stops inside profile.steps */
    if (!t->stop.sig) kpl__prof_ended(t);
    if (t->stop.sig) {
        *event = "interrupted";
        if (t->rank == 0)
            kpl__log_info(&t->log, "stopped by %s at step %lld: --resume continues from %s",
                          kpl__signal_name(t->stop.sig), (long long)t->step, ckpt);
        else
            kpl__log_info(&t->log, "stopped by %s at step %lld", kpl__signal_name(t->stop.sig),
                          (long long)t->step);
    }
    say_done(t, *event, train_seconds, train_samples, ckpt);
    return KPL_OK;
}

kpl_status kpl_trainer_fit(kpl_trainer *t)
{
    KPL_CHECK(t && t->train, KPL_ESTATE, "kpl_trainer_fit: an evaluation-only trainer has no run");
    char ckpt[PATH_MAX] = "";
    const char *event = "done";
    t->stop.armed = true;
    kpl_status st = fit(t, &event, ckpt, sizeof ckpt);
    t->stop.armed = false;
    if (st < 0) {
        kpl__log_error(&t->log, "%s", kpl_last_error());
        t->stop.failed = true;
        return st;
    }
    if (strcmp(event, "interrupted")) return KPL_OK;
    return KPL_ERROR(KPL_ECANCELED, "stopped by %s at step %lld", kpl__signal_name(t->stop.sig),
                     (long long)t->step);
}

int kpl_trainer_stop_signal(const kpl_trainer *t) { return t ? t->stop.sig : 0; }

/* ---- kpl eval ---------------------------------------------------------------------------------- */

kpl_status kpl_trainer_eval_checkpoint(kpl_trainer *t, const char *checkpoint)
{
    KPL_CHECK(t && checkpoint, KPL_EINVAL, "kpl_trainer_eval_checkpoint: NULL argument");
    double t0 = kpl_seconds();
    kpl_eval_result e;
    kpl_status st = kpl_trainer_evaluate(t, &e);
    double secs = kpl_seconds() - t0;
    if (st >= 0 && t->rank == 0) {
        char line[1024];
        int at = snprintf(line, sizeof line, "%s on %s:", checkpoint, t->val_path);
        for (int i = 0; i < e.metrics.n && at < (int)sizeof line - 64; i++)
            at += snprintf(line + at, sizeof line - (size_t)at, " %s %.4f", e.metrics.name[i],
                           e.metrics.value[i]);
        kpl__log_info(&t->log, "%s (%lld examples, %.1f s)", line, (long long)e.examples, secs);
        t->val_res = e;
        if (t->task->eval_report) t->task->eval_report(t, t->task_state);
        json_t *j = eval_record(t, &e);
        json_object_del(j, "step");
        json_object_del(j, "epoch");
        json_t *rest = json_pack("{s:s, s:s}", "checkpoint", checkpoint, "data", t->val_path);
        json_object_update(rest, j); /* checkpoint and data first, as before */
        json_object_set_new(rest, "event", json_string("eval"));
        json_object_set_new(rest, "seconds", json_real(secs));
        char *s = kpl__json_line(rest);
        if (s) kpl__log_result(&t->log, s);
        free(s);
        json_decref(rest);
        json_decref(j);
    }
    /* NaN outputs are an error of the checkpoint: the figures above are
     * said, and the status says it */
    if (st >= 0) st = check_finite(t, &e, true);
    if (st < 0) {
        kpl__log_error(&t->log, "%s", kpl_last_error());
        t->stop.failed = true;
    }
    return st;
}
