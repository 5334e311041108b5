/*
 * step.c — one step of a run (kpl_trainer_step): `accumulate`
 * micro-batches through the task (train_step, or its own train_batch),
 * each model's backward with DDP, the non-finite checks, the updates
 * (clipping, the schedule's lr, the optimizer); and the evaluation loop
 * (kpl_trainer_evaluate) with its sums over the ranks.
 */
#define _GNU_SOURCE
#include "run_impl.h"
#include <ctype.h>
#include <errno.h>
#include <fnmatch.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a step ---------------------------------------------------------------------------------- */

static kpl_status check_loss(const kpl__watched *w, double lv)
{
    if (isfinite(lv)) return KPL_OK;
    return KPL_ERROR(KPL_ERANGE, "the loss is %s at step %lld (epoch %lld, batch of samples "
                     "%lld..%lld): lower optimizer.lr, or set optimizer.clip_grad_norm (or "
                     "loss.nonfinite: skip to leave such steps out)",
                     isnan(lv) ? "NaN" : lv > 0 ? "inf" : "-inf", (long long)w->step,
                     (long long)w->epoch, (long long)w->first, (long long)w->last);
}

static kpl_status watch_loss(kpl_trainer *t, const kpl__watched *w)
{
    if (t->rep.nwatch == t->rep.capwatch) {
        int cap = t->rep.capwatch ? 2 * t->rep.capwatch : 16;
        kpl__watched *n = realloc(t->rep.watch, (size_t)cap * sizeof *n);
        KPL_CHECK(n, KPL_ENOMEM, "out of memory");
        t->rep.watch = n, t->rep.capwatch = cap;
    }
    kpl_tensor_retain(w->loss);
    t->rep.watch[t->rep.nwatch++] = *w;
    return KPL_OK;
}

/* The watched losses of steps before `before` (all with INT64_MAX), in
 * order: the first that is not finite is the error. */
static kpl_status check_watched(kpl_trainer *t, int64_t before)
{
    kpl_status st = KPL_OK;
    int k = 0, kept = 0;
    for (; k < t->rep.nwatch && t->rep.watch[k].step < before; k++) {
        double lv = 0;
        if (st >= 0) st = kpl_tensor_get(t->rep.watch[k].loss, 0, &lv);
        if (st >= 0) st = check_loss(&t->rep.watch[k], lv);
        kpl_tensor_release(t->rep.watch[k].loss);
    }
    for (; k < t->rep.nwatch; k++) t->rep.watch[kept++] = t->rep.watch[k];
    t->rep.nwatch = kept;
    return st;
}

kpl_status kpl__trainer_check_losses(kpl_trainer *t) { return check_watched(t, INT64_MAX); }

kpl_status kpl_trainer_backward(kpl_trainer *t, int model, kpl_tensor *loss, double *value)
{
    KPL_CHECK(model >= 0 && model < t->nmodels, KPL_EINVAL, "kpl_trainer_backward: model %d of %d",
              model, t->nmodels);
    KPL_CHECK(t->batch, KPL_ESTATE, "kpl_trainer_backward: only inside a task's train_batch");
    if (!loss) return kpl_last_status() < 0 ? kpl_last_status() : KPL_EINVAL;
    kpl__model *md = &t->models[model];
    /* the optimizer and DDP hold the parameters there were when the model
     * was added: a later one would never train (nor be reduced) */
    KPL_CHECK(kpl_module_num_params(md->m) == md->nall, KPL_ESTATE,
              "model '%s' has %d parameters, %d when it was added to the trainer: create every "
              "parameter before kpl_trainer_add_model (buffers may come later)", md->name,
              kpl_module_num_params(md->m), md->nall);
    KPL_CHECK(kpl_requires_grad(loss), KPL_EINVAL,
              "kpl_trainer_backward: model '%s': its loss does not require grad (its parameters "
              "are frozen or lent out with kpl_module_set_requires_grad, or the loss does not "
              "depend on them)", md->name);
    const kpl_batch *b = t->batch;
    kpl__watched w = {loss, t->step + 1, t->epoch + 1, b->position, b->position + b->size - 1};
    if (value || t->r->loss.nonfinite == KPL_NONFINITE_SKIP) {
        /* read now: the caller asks, or the step's update depends on it */
        double lv = 0;
        KPL_TRY(kpl_tensor_get(loss, 0, &lv));
        if (value) *value = lv;
        if (t->r->loss.nonfinite == KPL_NONFINITE_STOP) KPL_TRY(check_loss(&w, lv));
        /* loss.nonfinite skip: backward still runs (the other ranks wait
         * for this rank's gradients, which come out non-finite and make
         * every rank skip the step). */
        if (!isfinite(lv)) t->step_nonfinite = true;
    } else {
        KPL_TRY(watch_loss(t, &w));
    }
    if (md->ddp) KPL_TRY(kpl_ddp_begin(md->ddp, t->sync));
    kpl__prof_backward_begin(t, model);
    kpl__tmark bm = kpl__timing_begin(t, KPL__T_COMPUTE);
    kpl_pool *pool = kpl_pool_push(); /* the scaled loss's */
    /* the mean over micro-batches, and fp16's loss scale (undone before
     * the update, kpl_trainer_update) */
    double f = md->scaler.scale / (double)t->micros;
    kpl_tensor *scaled = !pool ? NULL : f != 1 ? kpl_scalar_op(KPL_BIN_MUL, loss, f, false) : loss;
    kpl_status st = scaled ? kpl_backward(scaled, NULL, false) : kpl_last_status();
    if (pool) kpl_pool_pop(pool);
    kpl__timing_end(t, bm, "backward", model);
    kpl__prof_backward_end(t, model, bm.t0);
    /* every begin has its finish; only the step's last one communicates */
    if (md->ddp) {
        kpl__tmark wm = kpl__timing_begin(t, KPL__T_COMM);
        kpl_status fs = kpl_ddp_finish(md->ddp);
        kpl__timing_end(t, wm, "allreduce wait", model);
        if (fs >= 0 && t->sync) kpl__prof_buckets(t, model);
        if (st >= 0) st = fs;
    }
    KPL_TRY(st);
    md->has_grad = true;
    return KPL_OK;
}

static int eval_slot(const kpl_trainer *t, const char *name)
{
    for (int i = 0; name && i < t->neval_sums; i++)
        if (!strcmp(t->task->eval_sums[i], name)) return i;
    return -1;
}

kpl_status kpl_trainer_eval_add(kpl_trainer *t, const char *name, double v)
{
    KPL_CHECK(t && t->in_eval, KPL_ESTATE, "kpl_trainer_eval_add: only during an evaluation");
    int i = eval_slot(t, name);
    KPL_CHECK(i >= 0, KPL_EINVAL, "kpl_trainer_eval_add: task %s lists no eval sum '%s'",
              t->task->name, name ? name : "(null)");
    t->eval_sum[i] += v;
    return KPL_OK;
}

double kpl_trainer_eval_total(const kpl_trainer *t, const char *name)
{
    int i = t ? eval_slot(t, name) : -1;
    return i < 0 ? NAN : t->eval_sum[i];
}

kpl_status kpl_step_figure(kpl_step_result *r, const char *name, kpl_tensor *sum, double count)
{
    KPL_CHECK(r && name, KPL_EINVAL, "kpl_step_figure: NULL argument");
    if (!sum) return kpl_last_status() < 0 ? kpl_last_status() : KPL_EINVAL;
    KPL_CHECK(r->nfigures < KPL_STEP_FIGURES, KPL_ERANGE, "kpl_step_figure '%s': at most %d figures",
              name, KPL_STEP_FIGURES);
    r->figure[r->nfigures].name = name;
    r->figure[r->nfigures].sum = sum;
    r->figure[r->nfigures++].count = count;
    return KPL_OK;
}

/* A task's train_step: its forward in a pool of its own, whose
 * temporaries go before backward (what the gradients need, the graph
 * keeps, and the reverse-mode GC frees as backward goes); then each
 * model's backward; then the figures, with grad mode off, where they are
 * (nothing waits for the device). */
/* A task's call under the recipe's precision (autocast, graph.h): its
 * forward runs mixed, its backward (autocast off inside) follows. */
static kpl_status task_call(kpl_trainer *t, kpl_status (*fn)(kpl_trainer *, void *,
                                                               const kpl_batch *),
                            const kpl_batch *b)
{
    kpl_dtype prev = KPL_F32;
    KPL_TRY(kpl_set_autocast(t->r->precision, &prev));
    kpl_status st = fn(t, t->task_state, b);
    kpl_set_autocast(prev, NULL);
    return st;
}

static kpl_status train_step_call(kpl_trainer *t, void *state, const kpl_batch *b)
{
    return t->task->train_step(t, state, b, t->step_out);
}

static kpl_status run_train_step(kpl_trainer *t, const kpl_batch *b)
{
    kpl_step_result out;
    memset(&out, 0, sizeof out);
    kpl_pool *pool = kpl_pool_push();
    KPL_CHECK(pool, KPL_ENOMEM, "out of memory");
    t->step_out = &out;
    kpl__tmark fm = kpl__timing_begin(t, KPL__T_COMPUTE);
    kpl_status st = task_call(t, train_step_call, b);
    kpl__timing_end(t, fm, "forward", -1);
    t->step_out = NULL;
    bool any = false;
    for (int i = 0; i < KPL_STEP_MODELS; i++) {
        if (out.loss[i] && (i >= t->nmodels))
            st = st < 0 ? st : KPL_ERROR(KPL_EINVAL, "task %s: a loss for model %d of %d",
                                         t->task->name, i, t->nmodels);
        if (out.loss[i]) kpl_tensor_retain(out.loss[i]), any = true;
    }
    for (int f = 0; f < out.nfigures; f++) kpl_tensor_retain(out.figure[f].sum);
    kpl_pool_pop(pool);
    if (st >= 0 && !any)
        st = KPL_ERROR(KPL_EINVAL, "task %s: train_step gave no loss", t->task->name);
    for (int i = 0; st >= 0 && i < t->nmodels && i < KPL_STEP_MODELS; i++)
        if (out.loss[i]) st = kpl_trainer_backward(t, i, out.loss[i], NULL);
    bool grad = kpl_set_grad_enabled(false);
    pool = st >= 0 ? kpl_pool_push() : NULL;
    double n = (double)b->size;
    for (int i = 0; pool && st >= 0 && i < t->nmodels && i < KPL_STEP_MODELS; i++) {
        if (!out.loss[i]) continue;
        char name[80];
        if (i) snprintf(name, sizeof name, "loss_%s", t->models[i].name);
        st = kpl_trainer_record_tensor(t, i ? name : "loss",
                                       kpl_scalar_op(KPL_BIN_MUL, out.loss[i], n, false), n);
    }
    for (int f = 0; pool && st >= 0 && f < out.nfigures; f++)
        st = kpl_trainer_record_tensor(t, out.figure[f].name, out.figure[f].sum,
                                       out.figure[f].count);
    if (pool) kpl_pool_pop(pool);
    kpl_set_grad_enabled(grad);
    for (int i = 0; i < KPL_STEP_MODELS; i++) kpl_tensor_release(out.loss[i]);
    for (int f = 0; f < out.nfigures; f++) kpl_tensor_release(out.figure[f].sum);
    return st;
}

static double lr_now(const kpl_trainer *t)
{
    double e = (double)t->epoch;
    if (t->r->schedule.per == KPL_LR_PER_STEP) e += (double)t->epoch_step / (double)t->steps_per_epoch;
    return kpl_lr_at(&t->sched, e);
}

static kpl_status update(kpl_trainer *t, int model);

kpl_status kpl_trainer_update(kpl_trainer *t, int model)
{
    static _Atomic uint32_t label; /* what the memory profile calls its state's blocks */
    if (!label) label = kpl_mem_label("optimizer step");
    uint32_t prev = kpl_mem_context_set(label);
    kpl__tmark m = kpl__timing_begin(t, KPL__T_OPT);
    kpl_status st = update(t, model);
    kpl__timing_end(t, m, "optimizer", model);
    kpl_mem_context_set(prev);
    return st;
}

/* The update of a model whose gradients are in .grad (averaged over the
 * ranks): clipping, then the optimizer, unless the gradients are not
 * finite.  The gradient norm is the same number on every rank, so every
 * rank takes the same decision without another collective. */
static kpl_status update(kpl_trainer *t, int model)
{
    KPL_CHECK(model >= 0 && model < t->nmodels, KPL_EINVAL, "kpl_trainer_update: model %d of %d",
              model, t->nmodels);
    KPL_CHECK(t->sync || !t->batch, KPL_ESTATE, "kpl_trainer_update inside a step of several "
              "micro-batches: a task whose models step in turn needs optimizer.accumulate 1");
    const kpl_recipe *r = t->r;
    kpl__model *md = &t->models[model];
    md->has_grad = false;
    bool skip_mode = r->loss.nonfinite == KPL_NONFINITE_SKIP;
    double norm = 0;
    bool overflow = false;
    KPL_TRY(kpl__scaler_unscale(&md->scaler, t->dev, md->np, md->params, &overflow));
    if (overflow) /* the scale has shrunk, the update is left out */
        return md->ddp ? kpl_ddp_zero_grad(md->ddp) : (kpl_zero_grad(md->np, md->params), KPL_OK);
    if (md->scaler.on) {
        if (r->optimizer.clip_grad_norm > 0)
            KPL_TRY(kpl_clip_grad_norm(md->np, md->params, r->optimizer.clip_grad_norm, &norm));
    } else if (skip_mode || r->optimizer.clip_grad_norm > 0) {
        KPL_TRY(kpl_clip_grad_norm(md->np, md->params, r->optimizer.clip_grad_norm, &norm));
    }
    bool bad = !isfinite(norm) || (t->world == 1 && t->step_nonfinite);
    if (!bad) {
        double lr = lr_now(t);
        if (md->base_lr != t->sched.base_lr)
            lr = t->sched.base_lr > 0 ? md->base_lr * (lr / t->sched.base_lr) : 0;
        kpl_optim_set_lr(md->opt, lr);
        KPL_TRY(kpl_optim_step(md->opt));
        return md->ddp ? kpl_ddp_zero_grad(md->ddp) : KPL_OK;
    }
    if (!skip_mode)
        return KPL_ERROR(KPL_ERANGE, "the gradients are not finite at step %lld (epoch %lld; "
                         "their norm is %g): lower optimizer.lr, or set loss.nonfinite: skip to "
                         "leave such steps out", (long long)t->step + 1, (long long)t->epoch + 1,
                         fabs(norm));
    if (md->ddp) KPL_TRY(kpl_ddp_zero_grad(md->ddp));
    else kpl_zero_grad(md->np, md->params);
    t->step_skipped = true;
    return KPL_OK;
}

/* A step whose update was left out: counted, warned, and given up on
 * after loss.max_skips in a row. */
static kpl_status note_skip(kpl_trainer *t)
{
    const kpl_recipe *r = t->r;
    if (!t->step_skipped) {
        t->skips_in_row = 0;
        return KPL_OK;
    }
    t->skipped_steps++;
    t->skips_in_row++;
    if (t->rank == 0)
        kpl__log_warn(&t->log, "step %lld (epoch %lld): %s not finite; its update is skipped "
                      "(%lld skipped, %lld in a row)", (long long)t->step + 1,
                      (long long)t->epoch + 1,
                      t->step_nonfinite ? "the loss is" : "the gradients are",
                      (long long)t->skipped_steps, (long long)t->skips_in_row);
    KPL_CHECK(r->loss.max_skips == 0 || t->skips_in_row < r->loss.max_skips, KPL_ERANGE,
              "%lld steps in a row up to step %lld had a NaN or inf loss or gradients "
              "(loss.max_skips %lld): the run has diverged; lower optimizer.lr, or set "
              "optimizer.clip_grad_norm", (long long)t->skips_in_row, (long long)t->step + 1,
              (long long)r->loss.max_skips);
    return KPL_OK;
}

/* A rank whose micro-batch held only corrupt examples still joins every
 * model's reduction, with zero gradients. */
static kpl_status empty_micro(kpl_trainer *t)
{
    for (int k = 0; k < t->nmodels; k++) {
        kpl__model *md = &t->models[k];
        if (!md->ddp) continue;
        KPL_TRY(kpl_ddp_begin(md->ddp, t->sync));
        kpl__tmark m = kpl__timing_begin(t, KPL__T_COMM);
        kpl_status st = kpl_ddp_finish(md->ddp);
        kpl__timing_end(t, m, "allreduce wait", k);
        KPL_TRY(st);
        if (t->sync) kpl__prof_buckets(t, k);
        md->has_grad = true;
    }
    return KPL_OK;
}

static kpl_status step(kpl_trainer *t, bool *epoch_done);

kpl_status kpl_trainer_step(kpl_trainer *t, bool *epoch_done)
{
    kpl_status st = step(t, epoch_done);
    if (st < 0) t->stop.failed = true;
    return st;
}

static kpl_status step(kpl_trainer *t, bool *epoch_done)
{
    const kpl_recipe *r = t->r;
    KPL_CHECK(t->train, KPL_ESTATE, "kpl_trainer_step: an evaluation-only trainer");
    int64_t k = r->optimizer.accumulate, B = r->data.train.loader.batch_size;
    *epoch_done = false;
    if (t->epoch_ended) /* the previous step took the last batch of its epoch */
        t->epoch++, t->epoch_step = 0, t->epoch_ended = false;
    t->step_nonfinite = t->step_skipped = false;
    t->micros = k;
    kpl__timing_step(t);
    for (int64_t i = 0; i < k && !*epoch_done; i++) {
        kpl_batch b;
        memset(&b, 0, sizeof b);
        kpl__tmark dm = kpl__timing_begin(t, KPL__T_DATA);
        kpl_status ls = kpl_loader_next(t->train, &b);
        kpl__timing_end(t, dm, "data wait", -1);
        KPL_TRY(ls);
        /* the loader says which batch ends the epoch: the step ends there
         * too, and reduces over the ranks */
        *epoch_done = b.last;
        t->sync = i == k - 1 || b.last;
        t->micro = i;
        kpl_status st = KPL_OK;
        if (b.last && b.position / B + 1 != t->batches_per_epoch)
            st = KPL_ERROR(KPL_ESTATE, "train loader: epoch %lld ended at batch %lld, expected "
                           "%lld", (long long)b.epoch + 1, (long long)(b.position / B + 1),
                           (long long)t->batches_per_epoch);
        else if (b.size == 0) /* an epoch's last batch held only corrupt examples (skip_corrupt):
                                 this rank adds nothing to the step but joins its reductions */
            st = empty_micro(t);
        else {
            /* train_step's forward and backward are spans of their own; a
             * train_batch task interleaves them (and its updates) itself */
            t->batch = &b;
            kpl__tmark cm = kpl__timing_begin(t, KPL__T_COMPUTE);
            st = t->task->train_step ? run_train_step(t, &b)
                                     : task_call(t, t->task->train_batch, &b);
            kpl__timing_end(t, cm, t->task->train_step ? NULL : "train_batch", -1);
            t->batch = NULL;
        }
        t->rep.win_samples += (double)b.size;
        t->rep.epoch_samples += (double)b.size;
        kpl_batch_release(&b);
        KPL_TRY(st);
    }
    t->sync = true;
    for (int m = 0; m < t->nmodels; m++)
        if (t->models[m].has_grad) KPL_TRY(kpl_trainer_update(t, m));
    /* the previous step's losses: done by now on any device */
    KPL_TRY(check_watched(t, t->step + 1));
    KPL_TRY(note_skip(t));
    t->step++;
    t->epoch_step++;
    t->epoch_ended = *epoch_done;
    kpl__timing_step_end(t);
    return KPL_OK;
}

/* ---- evaluation -------------------------------------------------------------------------------- */

static kpl_status evaluate(kpl_trainer *t, kpl_eval_result *res);

kpl_status kpl_trainer_evaluate(kpl_trainer *t, kpl_eval_result *res)
{
    kpl_status st = evaluate(t, res);
    if (st < 0 && st != KPL_ECANCELED) t->stop.failed = true;
    return st;
}

static kpl_status evaluate(kpl_trainer *t, kpl_eval_result *res)
{
    memset(res, 0, sizeof *res);
    KPL_TRY(kpl__trainer_check_losses(t));
    KPL_CHECK(t->val, KPL_ESTATE, "evaluate: the recipe has no data.val.path");
    /* Batch-norm statistics are each rank's own during training; the
     * checkpoint keeps rank 0's, so evaluate with those on every rank. */
    for (int k = 0; t->comm && k < t->nmodels; k++)
        for (int i = 0; i < kpl_module_num_buffers(t->models[k].m); i++)
            KPL_TRY(kpl_comm_broadcast(t->comm, kpl_module_buffers(t->models[k].m)[i], 0));
    for (int k = 0; k < t->nmodels; k++) kpl_module_set_training(t->models[k].m, false);
    bool prev = kpl_set_grad_enabled(false);
    int64_t skipped0 = kpl_loader_skipped(t->val);
    memset(t->eval_sum, 0, sizeof t->eval_sum);
    t->in_eval = true;
    kpl_status st = t->task->eval_begin(t, t->task_state);
    int64_t batches = 0;
    for (bool last = false; st >= 0 && !last; batches++) {
        /* inside kpl_trainer_fit, a stop ends the evaluation at the next
         * batch (every rank at the same one); the epoch's checkpoint says
         * that its evaluation is still to come */
        int sig = 0;
        if (t->stop.armed && (st = kpl__trainer_agree_stop(t, &sig)) < 0) break;
        if (sig) {
            st = KPL_ERROR(KPL_ECANCELED, "evaluation stopped by %s after %lld batches",
                           kpl__signal_name(sig), (long long)batches);
            break;
        }
        kpl_batch b;
        memset(&b, 0, sizeof b);
        if ((st = kpl_loader_next(t->val, &b)) < 0) break;
        last = b.last;
        kpl_pool *pool = b.size ? kpl_pool_push() : NULL;
        if (b.size) st = pool ? task_call(t, t->task->eval_batch, &b) : kpl_last_status();
        if (pool) kpl_pool_pop(pool);
        kpl_batch_release(&b);
    }
    kpl_set_grad_enabled(prev);
    for (int k = 0; k < t->nmodels; k++) kpl_module_set_training(t->models[k].m, true);
    /* the skipped count rides with the task's sums: one allreduce */
    t->eval_sum[t->neval_sums] = (double)(kpl_loader_skipped(t->val) - skipped0);
    if (st >= 0) st = kpl_trainer_sum(t, t->eval_sum, t->neval_sums + 1);
    double skipped = t->eval_sum[t->neval_sums];
    if (st >= 0) st = t->task->eval_end(t, t->task_state, res);
    t->in_eval = false;
    KPL_TRY(st);
    res->skipped = (int64_t)skipped;
    return KPL_OK;
}

/* The validation loader sits idle between evaluations: a process of it
 * that died is reported at the next step, not when the epoch ends. */
static kpl_status check_val_loader(kpl_trainer *t)
{
    if (!t->val) return KPL_OK;
    kpl_status st = kpl_loader_check(t->val);
    if (st >= 0) return KPL_OK;
    return kpl_error_prefix(st, "validation loader of %s: ", t->val_path);
}

kpl_status kpl__trainer_check_val(kpl_trainer *t) { return check_val_loader(t); }
