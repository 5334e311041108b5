/*
 * report.c — the figures a run records (kpl_trainer_record, the tasks'
 * losses and metrics: summed on the device, folded now and then) and the
 * reports made of them: the metrics.jsonl line, TensorBoard scalars, the
 * console's progress bar.
 */
#include "run_impl.h"

#include <ctype.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- figures and reports ------------------------------------------------------------------ */

kpl_status kpl_figures_set(kpl_figures *f, const char *name, double v)
{
    size_t len = name ? strlen(name) : 0;
    KPL_CHECK(len >= 1 && len < sizeof f->name[0], KPL_EINVAL,
              "figure name '%s': 1 to %zu bytes", name ? name : "", sizeof f->name[0] - 1);
    for (size_t i = 0; i < len; i++)
        KPL_CHECK(islower((unsigned char)name[i]) || isdigit((unsigned char)name[i]) ||
                      name[i] == '_',
                  KPL_EINVAL, "figure name '%s': only a-z, 0-9 and _", name);
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->name[i], name)) {
            f->value[i] = v;
            return KPL_OK;
        }
    KPL_CHECK(f->n < KPL_FIGURES_MAX, KPL_EINVAL, "figures: more than %d", KPL_FIGURES_MAX);
    memcpy(f->name[f->n], name, len + 1);
    f->value[f->n++] = v;
    return KPL_OK;
}

double kpl_figures_get(const kpl_figures *f, const char *name)
{
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->name[i], name)) return f->value[i];
    return NAN;
}

void *kpl__json_num(double v) { return isfinite(v) ? json_real(v) : json_null(); }

char *kpl__json_line(void *obj)
{
    return obj ? json_dumps(obj, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9))
               : NULL;
}

/* Figures keep 9 digits; the wall time needs milliseconds of a 10-digit
 * number of seconds, so it is put last by hand (a number: nothing to
 * escape). */
void kpl__trainer_emit(kpl_trainer *t, void *obj)
{
    json_t *j = obj;
    if (!j) return;
    char *s = t->rank == 0 ? kpl__json_line(j) : NULL;
    size_t n = s ? strlen(s) : 0;
    if (n >= 2 && s[n - 1] == '}') {
        char *line = malloc(n + 40);
        if (line) {
            snprintf(line, n + 40, "%.*s,\"time\":%.3f}", (int)(n - 1), s, kpl__wall());
            kpl__log_metrics(&t->log, line);
        }
        free(line);
    }
    free(s);
    json_decref(j);
}

double kpl__trainer_best_of(const kpl_trainer *t, const kpl_eval_result *e)
{
    return kpl_figures_get(&e->metrics, t->task->best_metric);
}

static kpl__figure *figure(kpl_trainer *t, const char *name)
{
    for (int i = 0; i < t->rep.nfig; i++)
        if (!strcmp(t->rep.fig[i].name, name)) return &t->rep.fig[i];
    return NULL;
}

void kpl__trainer_epoch_begin(kpl_trainer *t)
{
    for (int i = 0; i < t->rep.nfig; i++) t->rep.fig[i].epoch_sum = t->rep.fig[i].epoch_count = 0;
    t->epoch_skipped0 = t->skipped_steps;
    t->rep.last_report_step = t->step;
    t->rep.epoch_t0 = kpl_seconds();
    t->rep.epoch_samples = t->rep.bar_t = t->rep.bar_samples = t->rep.rate = 0;
}

static double lr_of_report(const kpl_trainer *t)
{
    return t->nmodels ? kpl_optim_lr(t->models[0].opt) : NAN;
}

/* A figure's device sum onto the host (a read: waits for the device). */
static kpl_status fold(kpl__figure *f)
{
    if (!f->dsum) return KPL_OK;
    double v = 0;
    kpl_status st = kpl_tensor_get(f->dsum, 0, &v);
    kpl_tensor_release(f->dsum);
    f->dsum = NULL, f->pending = 0;
    KPL_TRY(st);
    f->sum += v;
    return KPL_OK;
}

kpl_status kpl__trainer_report(kpl_trainer *t)
{
    KPL_TRY(kpl__trainer_check_losses(t));
    for (int i = 0; i < t->rep.nfig; i++) KPL_TRY(fold(&t->rep.fig[i]));
    int64_t skipped_now = kpl_loader_skipped(t->train);
    int nf = t->rep.nfig, n = 2 * nf + 2;
    double v[2 * KPL_FIGURES_MAX + 2];
    for (int i = 0; i < nf; i++) v[2 * i] = t->rep.fig[i].sum, v[2 * i + 1] = t->rep.fig[i].count;
    v[2 * nf] = (double)(skipped_now - t->train_skipped_seen);
    v[2 * nf + 1] = t->rep.win_samples;
    KPL_TRY(kpl_trainer_sum(t, v, n));
    t->train_skipped_seen = skipped_now;
    t->skipped_examples += (int64_t)v[2 * nf];
    double samples = v[2 * nf + 1];
    t->rep.win_samples = 0;
    for (int i = 0; i < nf; i++) {
        kpl__figure *f = &t->rep.fig[i];
        f->sum = f->count = 0;
        f->epoch_sum += v[2 * i], f->epoch_count += v[2 * i + 1];
    }
    /* A record for every report with steps behind it, also when every one
     * of them was skipped (its figures are then null): the skips show. */
    bool any_steps = t->step > t->rep.last_report_step;
    t->rep.last_report_step = t->step;
    if (!any_steps) return KPL_OK;
    /* every rank reports at the same step (the conditions of fit's `due`
     * are agreed), so the timing record's gather meets on every rank */
    if (t->rank != 0) return kpl__timing_report(t);
    double lr = lr_of_report(t), dt = kpl_seconds() - t->rep.epoch_t0;
    double ips = dt > 0 ? t->rep.epoch_samples * t->world / dt : 0;
    json_t *j = json_pack("{s:s, s:I, s:f}", "event", "train", "step", (json_int_t)t->step,
                          "epoch", (double)t->epoch + (double)t->epoch_step / (double)t->steps_per_epoch);
    char line[1024];
    int at = snprintf(line, sizeof line, "epoch %lld/%lld step %lld/%lld", (long long)t->epoch + 1,
                      (long long)t->r->epochs, (long long)t->epoch_step,
                      (long long)t->steps_per_epoch);
    for (int i = 0; i < nf; i++) {
        double m = v[2 * i + 1] > 0 ? v[2 * i] / v[2 * i + 1] : NAN;
        json_object_set_new(j, t->rep.fig[i].name, kpl__json_num(m));
        if (at < (int)sizeof line - 64)
            at += snprintf(line + at, sizeof line - (size_t)at, " %s %.4f", t->rep.fig[i].name, m);
        if (t->log.tb) {
            char tag[64];
            snprintf(tag, sizeof tag, "train/%s", t->rep.fig[i].name);
            kpl_tb_add_scalar(t->log.tb, tag, t->step, m);
        }
    }
    json_object_set_new(j, "lr", kpl__json_num(lr));
    json_object_set_new(j, "images_per_sec", kpl__json_num(ips));
    json_object_set_new(j, "samples", json_integer((json_int_t)samples));
    json_object_set_new(j, "skipped_steps", json_integer(t->skipped_steps));
    json_object_set_new(j, "skipped_examples", json_integer(t->skipped_examples));
    if (t->r->precision == KPL_F16) {
        int64_t skips = 0;
        for (int k = 0; k < t->nmodels; k++) skips += t->models[k].scaler.skips;
        json_object_set_new(j, "loss_scale", json_real(t->models[0].scaler.scale));
        json_object_set_new(j, "overflow_skips", json_integer(skips));
    }
    kpl__trainer_emit(t, j);
    if (t->log.tb) {
        kpl_tb_add_scalar(t->log.tb, "train/lr", t->step, lr);
        kpl_tb_add_scalar(t->log.tb, "train/images_per_sec", t->step, ips);
        kpl_tb_flush(t->log.tb);
    }
    kpl__log_report(&t->log, "%s lr %.4g %.0f img/s", line, lr, ips);
    return kpl__timing_report(t);
}

void kpl__trainer_draw_bar(kpl_trainer *t, bool force)
{
    if (!t->log.progress) return;
    double now = kpl_seconds();
    if (!force && now - t->rep.bar_t < 0.2) return;
    /* The rate of the last redraws (the first step's algorithm search
     * would otherwise weigh on the whole epoch's figure and ETA). */
    if (t->rep.bar_t > 0 && now > t->rep.bar_t) {
        double r = (t->rep.epoch_samples - t->rep.bar_samples) / (now - t->rep.bar_t);
        t->rep.rate = t->rep.rate > 0 ? 0.7 * t->rep.rate + 0.3 * r : r;
    }
    t->rep.bar_t = now, t->rep.bar_samples = t->rep.epoch_samples;
    double per_step = t->rep.rate > 0 && t->epoch_step > 0 ? t->rep.epoch_samples / t->epoch_step / t->rep.rate : 0;
    kpl__figure *f = figure(t, "loss");
    if (!f && t->rep.nfig) f = &t->rep.fig[0];
    if (f && fold(f) < 0) return; /* a read at most every 0.2 s; an error shows at the report */
    double loss = !f ? NAN : f->count > 0 ? f->sum / f->count
                  : f->epoch_count > 0 ? f->epoch_sum / f->epoch_count : NAN;
    kpl__log_progress(&t->log, t->epoch, t->r->epochs, t->epoch_step, t->steps_per_epoch, loss,
                 lr_of_report(t), t->rep.rate * t->world,
                 per_step * (double)(t->steps_per_epoch - t->epoch_step));
}

/* ---- what tasks record ---------------------------------------------------------------------- */

static kpl_status figure_add(kpl_trainer *t, const char *name, kpl__figure **out)
{
    kpl__figure *f = figure(t, name);
    if (!f) {
        kpl_figures probe = {0};
        KPL_TRY(kpl_figures_set(&probe, name, 0)); /* the same naming rule */
        KPL_CHECK(t->rep.nfig < KPL_FIGURES_MAX, KPL_EINVAL, "training figures: more than %d",
                  KPL_FIGURES_MAX);
        f = &t->rep.fig[t->rep.nfig++];
        memset(f, 0, sizeof *f);
        f->last = NAN;
        snprintf(f->name, sizeof f->name, "%s", name);
    }
    *out = f;
    return KPL_OK;
}

kpl_status kpl_trainer_record(kpl_trainer *t, const char *name, double sum, double count)
{
    kpl__figure *f = NULL;
    KPL_TRY(figure_add(t, name, &f));
    f->sum += sum;
    f->count += count;
    return KPL_OK;
}

kpl_status kpl_trainer_record_tensor(kpl_trainer *t, const char *name, kpl_tensor *sum,
                                     double count)
{
    if (!sum) return kpl_last_status() < 0 ? kpl_last_status() : KPL_EINVAL;
    KPL_CHECK(kpl_tensor_numel(sum) == 1, KPL_ESHAPE, "kpl_trainer_record_tensor '%s': %lld "
              "elements, expected one", name, (long long)kpl_tensor_numel(sum));
    if (t->step_nonfinite) return KPL_OK; /* a step left out leaves its figures out */
    kpl__figure *f = NULL;
    KPL_TRY(figure_add(t, name, &f));
    bool grad = kpl_set_grad_enabled(false);
    kpl_pool *pool = kpl_pool_push();
    kpl_tensor *v = pool ? kpl_cast(sum, KPL_F32) : NULL;
    kpl_tensor *acc = v && f->dsum ? kpl_add(f->dsum, v) : v;
    kpl_status st = acc ? KPL_OK : kpl_last_status() < 0 ? kpl_last_status() : KPL_ENOMEM;
    if (acc) {
        kpl_tensor_retain(acc);
        kpl_tensor_release(f->dsum);
        f->dsum = acc;
        f->count += count;
    }
    if (pool) kpl_pool_pop(pool);
    kpl_set_grad_enabled(grad);
    KPL_TRY(st);
    /* f32 adds integers exactly below 2^24: fold now and then */
    return ++f->pending >= 1024 ? fold(f) : KPL_OK;
}
