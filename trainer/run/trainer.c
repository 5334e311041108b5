/*
 * trainer.c — kpl_trainer: a recipe and a task become a run.  Start-up,
 * stopping, the models a task adds (each with its optimizer and DDP).
 * report.c keeps the figures and writes the reports, step.c is a step and
 * the evaluation loop,
 * trainer_setup.c places the run, trainer_ckpt.c writes and reads its
 * checkpoints, fit.c is the loop of epochs.
 *
 * Order of start-up, and why:
 *   1. ranks from the launcher's environment (no MPI yet), threads, device;
 *   2. data: missing splits converted (one process per node), the
 *      checkpoint to resume from read (its data position is needed next);
 *   3. the loaders, which fork their processes before any thread exists;
 *   4. the communicator (MPI, its threads), the run directory (rank 0
 *      names it, the others learn it), logs;
 *   5. the task's models and optimizers, restored state, DDP (rank 0's
 *      values to all).
 */
#define _GNU_SOURCE
#include "run_impl.h"

#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- stopping ------------------------------------------------------------------------- */

/* The request is a note: a signal handler may make it on any thread,
 * inside malloc, a lock or stdio, so it does nothing else (signal and
 * raise are async-signal-safe; errno is kept).  The run looks at the note
 * at its agreed points (kpl__trainer_agree_stop). */
static volatile sig_atomic_t stop_signal;

void kpl_request_stop(int sig)
{
    if (sig > 0 && stop_signal != SIGTERM) stop_signal = sig; /* SIGTERM, the scheduler's, wins */
}

int kpl_stop_requested(void) { return stop_signal; }
void kpl_clear_stop(void) { stop_signal = 0; }

static void on_signal(int sig)
{
    int saved = errno;
    if (stop_signal && sig == SIGINT) { /* Ctrl-C while a stop is under way: now */
        signal(SIGINT, SIG_DFL);
        raise(SIGINT);
    }
    kpl_request_stop(sig);
    errno = saved;
}

void kpl_catch_stop_signals(bool on)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on ? on_signal : SIG_DFL;
    sa.sa_flags = SA_RESTART; /* a stop is a note, not an error of the call it lands in */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

const char *kpl__signal_name(int sig)
{
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal";
}

/* ---- what tasks use --------------------------------------------------------------------------- */

const kpl_recipe *kpl_trainer_recipe(const kpl_trainer *t) { return t->r; }
const kpl_keyvals *kpl_trainer_task_keys(const kpl_trainer *t) { return &t->r->task_keys; }
kpl_device *kpl_trainer_device(const kpl_trainer *t) { return t->dev; }
int32_t kpl_trainer_rank(const kpl_trainer *t) { return t->rank; }
int32_t kpl_trainer_world(const kpl_trainer *t) { return t->world; }
const int64_t *kpl_trainer_input_shape(const kpl_trainer *t) { return t->chw; }
double kpl_trainer_lr_scale(const kpl_trainer *t) { return t->lr_scale; }
const char *kpl_trainer_run_dir(const kpl_trainer *t) { return t->run_dir; }
const char *kpl_trainer_data_path(const kpl_trainer *t, bool train)
{
    return train ? t->train_path : t->val_path;
}
int64_t kpl_trainer_data_examples(const kpl_trainer *t, bool train)
{
    kpl_loader *l = train ? t->train : t->val;
    return l ? kpl_loader_num_examples(l) : 0;
}
int kpl_trainer_num_models(const kpl_trainer *t) { return t->nmodels; }
int64_t kpl_trainer_steps(const kpl_trainer *t) { return t->step; }
int64_t kpl_trainer_epoch(const kpl_trainer *t) { return t->epoch; }

kpl_module *kpl_trainer_model(const kpl_trainer *t, int i)
{
    KPL_ASSERT(i >= 0 && i < t->nmodels, "kpl_trainer_model: index out of range");
    return t->models[i].m;
}

void kpl_trainer_info(kpl_trainer *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kpl__log_v(&t->log, KPL_LOG_INFO, fmt, ap);
    va_end(ap);
}

void kpl_trainer_warn(kpl_trainer *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kpl__log_v(&t->log, KPL_LOG_WARN, fmt, ap);
    va_end(ap);
}

/* v[0..n) reduced over the ranks in place (host values). */
/* One number per step and per evaluation batch, so that every rank stops
 * at the same point whichever ranks the signal reached (a scheduler's
 * SIGTERM reaches all of them, kplrun's too, a `kill` one). */
kpl_status kpl__trainer_agree_stop(kpl_trainer *t, int *sig)
{
    if (!t->stop.sig) {
        double v = stop_signal;
        kpl_status st = kpl__trainer_reduce_host(t, &v, 1, KPL_COMM_MAX);
        if (st < 0) {
            t->stop.failed = true;
            return st;
        }
        t->stop.sig = (int)v;
    }
    if (sig) *sig = t->stop.sig;
    return KPL_OK;
}

bool kpl_trainer_eval_counts(const kpl_trainer *t, const kpl_batch *b, int64_t i)
{
    int64_t n = kpl_loader_num_examples(t->val), m = kpl_loader_epoch_size(t->val);
    int64_t at = t->r->data.val.loader.interleave ? (b->position + i) * t->world + t->rank
                                           : t->rank * m + b->position + i;
    return at < n;
}

/* ---- models ---------------------------------------------------------------------------------- */

/* The optimizer of a model over its parameters that train, with the
 * recipe's groups when it uses the recipe's section. */
static kpl_status make_optim(kpl_trainer *t, kpl__model *md, const kpl_optim_config *given)
{
    const kpl_recipe *r = t->r;
    kpl_optim_config oc = given ? *given : r->optimizer.config;
    if (!given) oc.lr = t->sched.base_lr; /* scaled once, by make_schedule */
    /* with DDP, the gradients are views into its buckets: they stay, and
     * DDP zeroes them whole after the update */
    oc.keep_grad = t->comm != NULL;
    bool *nd = calloc((size_t)(md->np ? md->np : 1), sizeof *nd);
    KPL_CHECK(nd, KPL_ENOMEM, "out of memory");
    for (int i = 0; i < md->np; i++)
        nd[i] = r->optimizer.no_decay_bn_bias && kpl_tensor_ndim(md->params[i]) <= 1;
    uint32_t prev = kpl_mem_context_set(kpl_mem_label("optimizer")); /* (memory profile) */
    kpl_status st = kpl_optim_create(&oc, md->np, md->params, nd, &md->opt);
    kpl_mem_context_set(prev);
    free(nd);
    KPL_TRY(st);
    md->base_lr = oc.lr;
    kpl__scaler_init(&md->scaler, r);
    if (given || !r->optimizer.ngroups) return KPL_OK;
    /* a group of frozen parameters only changes nothing: said, and left
     * out (the optimizer never sees frozen parameters) */
    kpl_param_group groups[KPL_RECIPE_LIST];
    int ng = 0, counts[KPL_RECIPE_LIST];
    for (int g = 0; g < r->optimizer.ngroups; g++) {
        const char *pat = r->optimizer.groups[g].params;
        int trained = 0, frozen = 0;
        for (int i = 0; i < md->np; i++) trained += !fnmatch(pat, md->pnames[i], 0);
        for (int i = 0; i < md->nall && !trained; i++)
            frozen += !kpl_requires_grad(kpl_module_params(md->m)[i]) &&
                      !fnmatch(pat, kpl_module_param_name(md->m, i), 0);
        if (!trained && frozen) {
            if (t->rank == 0)
                kpl__log_warn(&t->log, "optimizer group %d ('%s') matches only frozen parameters "
                              "(%d): it changes nothing", g + 1, pat, frozen);
            continue;
        }
        groups[ng++] = r->optimizer.groups[g];
    }
    KPL_TRY(kpl_optim_set_groups(md->opt, (const char *const *)md->pnames, ng, groups, counts));
    for (int g = 0; g < ng && t->rank == 0; g++)
        kpl__log_info(&t->log, "optimizer group '%s': %d parameters, lr x %g, weight decay x %g",
                      groups[g].params, counts[g], groups[g].lr_mult,
                      groups[g].weight_decay_mult);
    return KPL_OK;
}

static void model_free(kpl__model *md)
{
    kpl_ddp_destroy(md->ddp);
    kpl_optim_destroy(md->opt);
    kpl_module_destroy(md->m);
    free(md->params);
    for (int i = 0; md->pnames && i < md->np; i++) free(md->pnames[i]);
    free(md->pnames);
    memset(md, 0, sizeof *md);
}

static kpl_status load_weights(kpl_trainer *t);

kpl_status kpl_trainer_add_model(kpl_trainer *t, const char *name, const char *label,
                                 kpl_module *m, const kpl_optim_config *oc, int *index)
{
    kpl_status st = KPL_OK;
    if (!t->building || t->nmodels == KPL__MAX_MODELS || !m || !name || !*name ||
        strlen(name) >= sizeof t->models[0].name || strchr(name, '.') || !strcmp(name, "optim")) {
        st = KPL_ERROR(KPL_EINVAL, "kpl_trainer_add_model('%s'): %s", name ? name : "",
                       !t->building ? "only while the task is created"
                       : !m ? "no module"
                       : t->nmodels == KPL__MAX_MODELS ? "too many models"
                       : !strcmp(name, "optim")
                           ? "the name 'optim' is taken (checkpoints keep optimizer state under it)"
                           : "a name of 1 to 63 bytes without dots");
        kpl_module_destroy(m);
        return st;
    }
    for (int k = 0; k < t->nmodels; k++)
        if (!strcmp(t->models[k].name, name)) {
            kpl_module_destroy(m);
            return KPL_ERROR(KPL_EINVAL, "kpl_trainer_add_model: a model '%s' exists", name);
        }
    int k = t->nmodels++;
    kpl__model *md = &t->models[k];
    memset(md, 0, sizeof *md);
    md->m = m;
    snprintf(md->name, sizeof md->name, "%s", name);
    snprintf(md->label, sizeof md->label, "%s", label && *label ? label : name);
    int n = kpl_module_num_params(m);
    md->nall = n;
    md->params = calloc((size_t)(n ? n : 1), sizeof *md->params);
    md->pnames = calloc((size_t)(n ? n : 1), sizeof *md->pnames);
    if (!md->params || !md->pnames) {
        st = KPL_ERROR(KPL_ENOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < n; i++)
        if (kpl_requires_grad(kpl_module_params(m)[i])) {
            if (!(md->pnames[md->np] = strdup(kpl_module_param_name(m, i)))) {
                st = KPL_ERROR(KPL_ENOMEM, "out of memory");
                goto fail;
            }
            md->params[md->np++] = kpl_module_params(m)[i];
        }
    /* Every rank initialises from the seed; DDP then broadcasts rank 0's
     * values anyway.  Dropout masks differ per rank: their generator is
     * offset by the rank (and the model). */
    kpl_rng_set_state(kpl_module_rng(m),
                      (uint64_t)t->r->seed * 1000003u + (uint64_t)t->rank + 1 +
                          (uint64_t)k * 7919u,
                      0);
    /* model.weights go in as model 0 is added: what the task makes from it
     * afterwards (a GAN's moving average) starts from them */
    if (k == 0 && t->train && !t->resume.ckpt && t->r->model.weights[0]) KPL_TRY_GOTO(load_weights(t));
    if (t->train) KPL_TRY_GOTO(make_optim(t, md, oc));
    if (index) *index = k;
    return KPL_OK;
fail:
    model_free(md);
    t->nmodels--;
    return st;
}

/* ---- start and end ----------------------------------------------------------------------------- */

static kpl_status make_loaders(kpl_trainer *t, const kpl__resume_meta *rm)
{
    const kpl_recipe *r = t->r;
    kpl_loader_config c;
    kpl__data_split_path(r, &r->data.train, t->train_path, sizeof t->train_path);
    kpl__data_loader_config(r, &r->data.train, t->train_path, true, t->rank, t->world, &c);
    c.device = t->dev;
    if (t->task->data) t->task->data(r, true, &c);
    if (rm) {
        c.start_epoch = rm->epoch;
        c.start_position = rm->position;
        if (rm->world_size != t->world || rm->batch_size != r->data.train.loader.batch_size) {
            /* Another split of the data: keep the epoch, and as much of it
             * as the other ranks had seen (the order within it changes). */
            int64_t seen = rm->position * rm->world_size;
            c.start_position = seen / t->world / c.batch_size * c.batch_size;
            kpl__log_warn(&t->log,
                          "resuming %lld ranks x batch %lld as %d x %lld: epoch %lld continues at "
                          "sample %lld of this rank, in a different order than the first run",
                          (long long)rm->world_size, (long long)rm->batch_size, (int)t->world,
                          (long long)c.batch_size, (long long)rm->epoch + 1,
                          (long long)c.start_position);
        }
    }
    KPL_TRY(kpl_loader_create(&c, &t->train));
    t->batches_per_epoch = kpl_loader_batches_per_epoch(t->train);
    int64_t k = r->optimizer.accumulate;
    t->steps_per_epoch = (t->batches_per_epoch + k - 1) / k;
    t->total_steps = t->steps_per_epoch * r->epochs;
    return KPL_OK;
}

static kpl_status make_val_loader(kpl_trainer *t)
{
    const kpl_recipe *r = t->r;
    if (!r->data.val.path[0]) return KPL_OK;
    kpl_loader_config c;
    kpl__data_split_path(r, &r->data.val, t->val_path, sizeof t->val_path);
    kpl__data_loader_config(r, &r->data.val, t->val_path, false, t->rank, t->world, &c);
    c.device = t->dev;
    if (t->task->data) t->task->data(r, false, &c);
    return kpl_loader_create(&c, &t->val);
}

static kpl_status make_schedule(kpl_trainer *t)
{
    const kpl_recipe *r = t->r;
    kpl_lr_schedule *s = &t->sched;
    *s = r->schedule.config;
    /* optimizer.lr_scaling: the one place the recipe's lr is scaled (the
     * optimizers of the recipe's section start from s->base_lr) */
    t->lr_scale = 1;
    if (r->optimizer.lr_scaling == KPL_LR_SCALING_LINEAR)
        t->lr_scale = (double)(r->data.train.loader.batch_size * t->world * r->optimizer.accumulate) /
                      (double)r->optimizer.base_batch;
    s->base_lr = r->optimizer.config.lr * t->lr_scale;
    s->epochs = (double)r->epochs;
    /* an iteration schedule: cosine and poly decay over max_steps (the VOC
     * recipe's 30k iterations), in epochs of this run's length */
    if (r->schedule.span == KPL_LR_SPAN_MAX_STEPS && t->steps_per_epoch > 0)
        s->epochs = (double)r->max_steps / (double)t->steps_per_epoch;
    s->min_lr *= t->lr_scale;
    return kpl_lr_schedule_check(s);
}

/* The task's models, built on the device; at least one. */
static kpl_status build_task(kpl_trainer *t)
{
    t->building = true;
    kpl_status st = t->task->create(t, &t->task_state);
    t->building = false;
    KPL_TRY(st);
    KPL_CHECK(t->nmodels > 0, KPL_EINVAL, "task %s added no model (kpl_trainer_add_model)",
              t->task->name);
    return KPL_OK;
}

/* memory.recompute: the models' marked blocks run again in the backward. */
static kpl_status make_recompute(kpl_trainer *t)
{
    /* memory.regenerate: norms' outputs made again in the backward (a
     * budget, below, turns it off while it holds: docs/memory.md) */
    kpl_set_regenerate(t->r->memory.regenerate);
    if (t->r->memory.recompute == KPL_RECOMPUTE_NONE) return KPL_OK;
    int total = 0;
    for (int k = 0; k < t->nmodels; k++) {
        int n = 0;
        kpl_status st = kpl_module_recompute_units(t->models[k].m, true, &n);
        if (st < 0) return kpl_error_prefix(st, "memory.recompute: ");
        if (n)
            kpl_trainer_info(t, "memory.recompute: %d blocks of %s run again in the backward", n,
                             t->models[k].name);
        total += n;
    }
    KPL_CHECK(total > 0, KPL_EINVAL,
              "memory.recompute: %s, but model %s marks no blocks to recompute (the zoo marks "
              "ResNet's stem and residual blocks, U-Net's levels, ASPP, the FPN and SN-GAN's "
              "blocks); "
              "set memory.recompute=none",
              kpl_recompute_mode_names[t->r->memory.recompute], t->r->model.name);
    if (t->r->memory.recompute == KPL_RECOMPUTE_AUTO) {
        KPL_TRY(kpl_recompute_set_budget(t->dev, (size_t)(t->r->memory.budget_mb * 1048576.0)));
        kpl_trainer_info(t, "memory.recompute: auto: blocks let go only to keep %s under %.0f MiB",
                         kpl_device_name(t->dev), t->r->memory.budget_mb);
    }
    return KPL_OK;
}

static kpl_status make_ddp(kpl_trainer *t)
{
    if (!t->comm) return KPL_OK;
    const kpl_recipe *r = t->r;
    for (int k = 0; k < t->nmodels; k++) {
        kpl__model *md = &t->models[k];
        if (md->np == 0) continue; /* a frozen model: nothing to reduce */
        kpl_bucketer_config bc = r->dist.buckets;
        bc.after_backward = !r->dist.overlap;
        KPL_TRY(kpl_ddp_create(t->comm, md->np, md->params, kpl_module_num_buffers(md->m),
                               kpl_module_buffers(md->m), &bc, &md->ddp));
        if (r->model.sync_bn && t->world > 1) {
            int n = 0;
            KPL_TRY(kpl_nn_sync_batch_norm(md->m, t->comm, &n));
            kpl_trainer_info(t, "model.sync_bn: %d batch norms of %s synchronised over %d ranks",
                             n, md->name, (int)t->world);
        }
    }
    return KPL_OK;
}

/* Evaluation only: the validation loader, the models and their weights;
 * the training split is never read (it need not exist). */
static kpl_status start_eval(kpl_trainer *t, const char *checkpoint)
{
    KPL_CHECK(t->r->data.val.path[0], KPL_EINVAL, "kpl eval: the recipe has no data.val.path "
              "(set it, e.g. data.val.path=test)");
    KPL_TRY(kpl__data_prepare_val(t->r, &t->log));
    KPL_TRY(kpl__data_val_input_shape(t->r, t->chw));
    KPL_TRY(kpl_checkpoint_load(checkpoint, &t->resume.ckpt));
    KPL_TRY(make_val_loader(t));
    KPL_TRY(kpl__trainer_make_comm(t));
    KPL_TRY(build_task(t));
    KPL_TRY(kpl__trainer_restore_models(t, t->resume.ckpt, checkpoint));
    if (t->task->restore) KPL_TRY(t->task->restore(t, t->task_state, t->resume.ckpt));
    kpl_checkpoint_destroy(t->resume.ckpt);
    t->resume.ckpt = NULL;
    return KPL_OK;
}

/* model.weights: a fresh run's first weights, into model 0 (or its
 * module model.weights_into), by name. */
static kpl_status load_weights(kpl_trainer *t)
{
    const kpl_model_config *mc = &t->r->model;
    kpl_module *m = t->models[0].m;
    if (mc->weights_into[0]) {
        m = kpl_module_find(m, mc->weights_into);
        KPL_CHECK(m, KPL_ENOTFOUND, "model.weights_into: model %s has no module '%s'",
                  t->models[0].name, mc->weights_into);
    }
    kpl_checkpoint *c = NULL;
    kpl_status st = kpl_checkpoint_load(mc->weights, &c);
    if (st == KPL_OK) st = kpl__weights_check(c, mc->weights);
    kpl_state_report rep;
    memset(&rep, 0, sizeof rep);
    if (st == KPL_OK) st = kpl_module_state_load(m, c, "model.", false, &rep);
    if (st == KPL_OK) {
        kpl_trainer_info(t, "model.weights: %d tensors from %s into %s%s%s", rep.nloaded,
                         mc->weights, t->models[0].name, mc->weights_into[0] ? "." : "",
                         mc->weights_into);
        if (rep.nmissing)
            kpl_trainer_info(t, "model.weights: %d tensors keep their initial values: %s",
                             rep.nmissing, rep.missing);
        if (rep.nunexpected)
            kpl_trainer_info(t, "model.weights: %d tensors of the file are not in the model: %s",
                             rep.nunexpected, rep.unexpected);
    }
    kpl_state_report_clear(&rep);
    kpl_checkpoint_destroy(c);
    return st < 0 ? kpl_error_prefix(st, "model.weights: ") : KPL_OK;
}

/* Every rank starts from the same step (-1: a fresh start).  Each rank
 * reads the checkpoint it resumes from itself, before MPI exists (the
 * loaders need its data position first), and a restart or --resume
 * without a file picks the newest one it sees: a run directory that the
 * nodes do not share, or see late (NFS caching a listing), would
 * otherwise start ranks from different checkpoints without a word.
 * Collective. */
static kpl_status same_start(kpl_trainer *t, int64_t step)
{
    if (!t->comm) return KPL_OK;
    double v[2] = {(double)step, -(double)step};
    KPL_TRY(kpl__trainer_reduce_host(t, v, 2, KPL_COMM_MAX));
    KPL_CHECK(v[0] == -v[1], KPL_ESTATE, "the ranks would start from different steps (%.0f to "
              "%.0f; -1: a fresh start); rank %d resumes from %s: every rank reads its checkpoint "
              "itself, so all need the same one, on a file system that every node sees alike",
              -v[1], v[0], (int)t->rank, t->resume.path[0] ? t->resume.path : "none");
    return KPL_OK;
}

static kpl_status start(kpl_trainer *t, const char *resume)
{
    const kpl_recipe *r = t->r;
    KPL_TRY(kpl__data_prepare(r, &t->log));
    KPL_TRY(kpl__data_input_shape(r, t->chw));
    kpl__resume_meta rm;
    memset(&rm, 0, sizeof rm);
    kpl__trainer_restart_checkpoint(t, &resume);
    if (resume) {
        if (resume[0] && resume != t->resume.path)
            snprintf(t->resume.path, sizeof t->resume.path, "%s", resume);
        else
            KPL_CHECK(kpl__trainer_latest_checkpoint(r, t->resume.path, sizeof t->resume.path),
                      KPL_ENOTFOUND, "--resume: no complete checkpoint in %s%s%s",
                      r->run_dir[0] ? r->run_dir : "runs/", r->run_dir[0] ? "/checkpoints" : r->name,
                      r->run_dir[0] ? "" : "-*/checkpoints");
        KPL_TRY(kpl_checkpoint_load(t->resume.path, &t->resume.ckpt));
        KPL_TRY(kpl__trainer_read_meta(t->resume.ckpt, t->resume.path, &rm));
    }
    kpl_status st = make_loaders(t, resume ? &rm : NULL);
    if (st >= 0) st = make_val_loader(t);
    if (st >= 0) st = kpl__trainer_make_comm(t);
    if (st >= 0) st = same_start(t, resume ? rm.step : -1);
    if (st >= 0) st = kpl__trainer_make_run_dir(t);
    if (st >= 0) st = kpl__trainer_clean_checkpoints(t);
    if (st >= 0) st = make_schedule(t);
    if (st >= 0) st = build_task(t);
    if (st >= 0) st = make_recompute(t);
    if (st >= 0 && t->resume.ckpt) st = kpl__trainer_restore_state(t, &rm);
    kpl__trainer_meta_free(&rm);
    KPL_TRY(st);
    kpl_checkpoint_destroy(t->resume.ckpt);
    t->resume.ckpt = NULL;
    /* the profiler's ready hooks go before DDP's: a gradient's time is
     * taken before its bucket's allreduce is handed over */
    KPL_TRY(kpl__prof_create(t));
    KPL_TRY(make_ddp(t));
    t->tm.step0 = t->step;
    int64_t ep = 0, pos = 0;
    kpl_loader_position(t->train, &ep, &pos);
    t->epoch = ep;
    if (ep > 0 && pos == 0 && t->step > 0) {
        /* resumed where an epoch ended: the last step was that epoch's, as
         * in a run that went on (the next step starts the next one) */
        t->epoch = ep - 1;
        t->epoch_step = t->steps_per_epoch;
        t->epoch_ended = true;
    }
    return KPL_OK;
}

static kpl_status check_args(const kpl_recipe *r, const kpl_task_kind *task)
{
    KPL_CHECK(task->name && task->best_metric && task->create && task->destroy &&
                  (task->train_step || task->train_batch) && task->eval_begin &&
                  task->eval_batch && task->eval_end,
              KPL_EINVAL, "task %s: a task needs a name, a best metric, train_step or "
              "train_batch, and every other function but eval_report, data and images",
              task->name ? task->name : "(unnamed)");
    int n = 0;
    while (task->eval_sums && task->eval_sums[n]) n++;
    KPL_CHECK(n <= 31, KPL_EINVAL, "task %s: %d eval_sums (at most 31)", task->name, n);
    KPL_CHECK(!strcmp(r->task, task->name), KPL_EINVAL,
              "%s: the recipe's task is '%s', the program's is '%s' (set task: %s)",
              *r->file ? r->file : "recipe", r->task, task->name, task->name);
    return KPL_OK;
}

/* The task's own keys: a program's task, unknown when the recipe was
 * read, gets its defaults (and its declaration checked) here. */
static kpl_status task_keys(kpl_trainer *t)
{
    char section[KPL_RECIPE_NAME + 8];
    snprintf(section, sizeof section, "task.%s", t->task->name);
    KPL_TRY(kpl__keys_declared_ok(t->task->keys, section));
    kpl_status st = kpl_keyvals_check(t->task->keys, section, &t->recipe.task_keys);
    if (st < 0) return kpl_error_prefix(st, "%s: ", *t->r->file ? t->r->file : "recipe");
    return KPL_OK;
}

kpl_status kpl_trainer_create(const kpl_recipe *r, const kpl_task_kind *task,
                              const kpl_trainer_options *o, kpl_trainer **out)
{
    KPL_CHECK(out, KPL_EINVAL, "kpl_trainer_create: NULL out");
    *out = NULL;
    KPL_CHECK(r && task, KPL_EINVAL, "kpl_trainer_create: no recipe or no task");
    kpl_trainer_options opts = KPL_TRAINER_OPTIONS_INIT;
    if (o) opts = *o;
    kpl_trainer *t = calloc(1, sizeof *t);
    KPL_CHECK(t, KPL_ENOMEM, "out of memory");
    t->recipe = *r;
    t->r = &t->recipe;
    t->task = task;
    t->run_lock = -1;
    t->resume.reset_optimizer = opts.reset_optimizer;
    t->resume.restart = opts.restart > 0 ? opts.restart : 0;
    t->resume.max_restarts = opts.max_restarts;
    snprintf(t->resume.restart_reason, sizeof t->resume.restart_reason, "%s",
             opts.restart_reason ? opts.restart_reason : "");
    const char *id = opts.job_id ? opts.job_id : "";
    bool id_ok = strlen(id) < sizeof t->resume.job_id && strspn(id, "abcdefghijklmnopqrstuvwxyz"
                                                          "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") ==
                                                      strlen(id);
    if (id_ok) snprintf(t->resume.job_id, sizeof t->resume.job_id, "%s", id);
    t->best = NAN;
    t->t_start = kpl_seconds();
    kpl__trainer_ranks_from_env(t);
    kpl__log_init(&t->log, t->rank, opts.log, opts.log_ctx, opts.progress && !opts.checkpoint);
    kpl__trainer_pick_threads(t);
    kpl_set_deterministic(r->deterministic);
    kpl_status st = check_args(r, task);
    if (st >= 0 && !id_ok)
        st = KPL_ERROR(KPL_EINVAL, "job id '%.80s' (KPL_JOB_ID) names a run directory: letters, "
                       "digits, '.', '_' and '-' only, at most %d", id, (int)sizeof t->resume.job_id - 1);
    if (st >= 0) st = task_keys(t);
    while (st >= 0 && task->eval_sums && task->eval_sums[t->neval_sums]) t->neval_sums++;
    if (st >= 0) st = kpl__trainer_pick_device(t);
    if (st >= 0) kpl_set_tf32(t->r->tf32);
    if (st >= 0) st = opts.checkpoint ? start_eval(t, opts.checkpoint) : start(t, opts.resume);
    if (st == KPL_ECANCELED) {
        kpl__log_info(&t->log, "stopped by %s during start-up, before the first step: %s",
                      kpl__signal_name(kpl_stop_requested()), kpl_last_error());
    } else if (st < 0) {
        kpl__log_error(&t->log, "%s", kpl_last_error());
    }
    if (st < 0) {
        /* the message stays the thread's for the caller (destroy may set others) */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", kpl_last_error());
        t->stop.failed = true;
        kpl_trainer_destroy(t);
        return KPL_ERROR(st, "%s", msg);
    }
    *out = t;
    return KPL_OK;
}

/* A failed run's communicator when the job has other ranks: ending it is
 * collective (they may be waiting in another collective for this rank),
 * so it stays for kpl_trainer_end_job. */
static kpl_comm *failed_comm;

void kpl_trainer_destroy(kpl_trainer *t)
{
    if (!t) return;
    if (kpl_device_budget(t->dev)) kpl_recompute_set_budget(t->dev, 0);
    if (t->task_state) t->task->destroy(t->task_state);
    for (int k = 0; k < t->rep.nwatch; k++) kpl_tensor_release(t->rep.watch[k].loss);
    free(t->rep.watch);
    for (int i = 0; i < t->rep.nfig; i++) kpl_tensor_release(t->rep.fig[i].dsum);
    kpl__prof_flush(t); /* a run that failed inside profile.steps: what it recorded */
    for (int k = 0; k < t->nmodels; k++) model_free(&t->models[k]);
    kpl__prof_destroy(t);
    kpl_checkpoint_destroy(t->resume.ckpt);
    kpl_loader_destroy(t->train);
    kpl_loader_destroy(t->val);
    kpl__log_close(&t->log);
    kpl__lockfile_release(t->run_lock); /* after the last write into the run directory */
    if (t->stop.failed && t->world > 1) failed_comm = t->comm;
    else kpl_comm_destroy(t->comm);
    free(t);
}

void kpl_trainer_end_job(kpl_trainer *t, int code)
{
    kpl_comm *c = t && t->comm ? t->comm : failed_comm;
    if (c) kpl_comm_abort(c, code);
}
