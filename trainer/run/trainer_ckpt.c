/*
 * trainer_ckpt.c — a run's checkpoints: what a resume needs (every model,
 * its optimizer state and generator, the data position, the best metric)
 * written by rank 0, read back before the loaders start, rotated, and the
 * best one kept as best.kpl.  docs/checkpoint.md lists the metadata.
 */
#define _GNU_SOURCE
#include "run_impl.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define NAME_LEN 400

/* ---- reading -------------------------------------------------------------------------------- */

void kpl__trainer_meta_free(kpl__resume_meta *m);

kpl_status kpl__trainer_read_meta(const kpl_checkpoint *c, const char *path, kpl__resume_meta *m)
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
    /* "best" since the task interface; "best_top1" (-1: none) before it */
    json_t *b = json_object_get(t, "best");
    if (!b) b = json_object_get(t, "best_top1");
    m->best = json_is_number(b) ? json_number_value(b) : NAN;
    if (!json_object_get(t, "best") && m->best < 0) m->best = NAN;
    json_t *sk = json_object_get(t, "skipped_steps");
    m->skipped_steps = json_is_integer(sk) && json_integer_value(sk) > 0 ? json_integer_value(sk) : 0;
    sk = json_object_get(t, "skipped_examples");
    m->skipped_examples = json_is_integer(sk) && json_integer_value(sk) > 0 ? json_integer_value(sk) : 0;
    m->eval_pending = json_is_true(json_object_get(t, "eval_pending"));
    json_t *g = json_object_get(t, "rngs"); /* per model; "rng": the one model's */
    m->rng = json_incref(g ? g : json_object_get(t, "rng"));
    m->models = json_incref(json_object_get(j, "models"));
    m->scales = json_incref(json_object_get(t, "loss_scale"));
    json_decref(j);
    if (st < 0) kpl__trainer_meta_free(m);
    return st;
}

void kpl__trainer_meta_free(kpl__resume_meta *m)
{
    json_decref(m->rng);
    json_decref(m->models);
    json_decref(m->scales);
    m->rng = m->models = m->scales = NULL;
}

/* "optim.<model>.<param>.<slot>"; checkpoints from before the task
 * interface name the one model's state "optim.<param>.<slot>". */
static void optim_name(const kpl__model *md, int i, const char *slot, bool legacy, char *buf,
                       size_t len)
{
    const char *p = md->pnames[i];
    if (legacy) snprintf(buf, len, "optim.%s.%s", p, slot);
    else snprintf(buf, len, "optim.%s.%s.%s", md->name, p, slot);
}

kpl_status kpl__trainer_restore_models(kpl_trainer *t, const kpl_checkpoint *c, const char *path)
{
    for (int k = 0; k < t->nmodels; k++) {
        char prefix[80];
        snprintf(prefix, sizeof prefix, "%s.", t->models[k].name);
        kpl_status st = kpl_module_state_load(t->models[k].m, c, prefix, true, NULL);
        /* a shape that differs names the file already; a name that does not */
        if (st == KPL_ENOTFOUND)
            return kpl_error_prefix(st, "%s: not a checkpoint of this recipe's model: ", path);
        KPL_TRY(st);
    }
    return KPL_OK;
}

/* model k's generator: [seed, offset] of this rank (or rank 0's) */
static void restore_rng(kpl_trainer *t, int k, const json_t *all)
{
    const json_t *per = k == 0 ? all : NULL;
    if (json_is_object(all)) per = json_object_get(all, t->models[k].name);
    else if (k > 0) return;
    json_t *mine = json_array_get(per, (size_t)t->rank);
    if (!mine) mine = json_array_get(per, 0);
    if (json_is_array(mine) && json_array_size(mine) == 2)
        kpl_rng_set_state(kpl_module_rng(t->models[k].m),
                          (uint64_t)json_integer_value(json_array_get(mine, 0)),
                          (uint64_t)json_integer_value(json_array_get(mine, 1)));
}

/* An optimizer in words: "sgd (momentum 0.9, nesterov)", "adam". */
static void optim_words(const char *name, double momentum, bool nesterov, char *buf, size_t len)
{
    bool uses_momentum = !strcmp(name, "sgd") || !strcmp(name, "lars");
    if (!uses_momentum) snprintf(buf, len, "%s", name);
    else if (momentum > 0) snprintf(buf, len, "%s (momentum %g%s)", name, momentum, nesterov ? ", nesterov" : "");
    else snprintf(buf, len, "%s (no momentum)", name);
}

/* Model k's optimizer state in the checkpoint, by its slots' names: the
 * first tensor of a slot the run's optimizer does not keep, into
 * `foreign` ("" when there is none). */
static void foreign_state(const kpl_trainer *t, int k, const kpl_checkpoint *c, char *foreign,
                          size_t len)
{
    static const char *const all[] = {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"};
    const kpl__model *md = &t->models[k];
    const char *const *ours = NULL;
    int ns = kpl_optim_state_slots(md->opt, &ours);
    char name[NAME_LEN];
    foreign[0] = '\0';
    for (size_t s = 0; s < sizeof all / sizeof all[0] && !foreign[0]; s++) {
        bool mine = false;
        for (int q = 0; q < ns; q++) mine |= !strcmp(ours[q], all[s]);
        for (int i = 0; i < md->np && !mine; i++) {
            optim_name(md, i, all[s], false, name, sizeof name);
            bool there = kpl_checkpoint_find(c, name) != NULL;
            if (!there && k == 0) {
                optim_name(md, i, all[s], true, name, sizeof name);
                there = kpl_checkpoint_find(c, name) != NULL;
            }
            if (!there) continue;
            snprintf(foreign, len, "%s", name);
            break;
        }
    }
}

/* Whether model k's optimizer state in the checkpoint can carry over to
 * the run's optimizer: the same rule, momentum on or off alike (the
 * checkpoint's metadata says which; checkpoints from before it said are
 * judged by the state tensors they hold).  Other settings (lr, weight
 * decay, the momentum's value, betas) may change: fine-tuning does. */
static kpl_status check_optimizer(kpl_trainer *t, int k, const kpl__resume_meta *rm)
{
    const kpl__model *md = &t->models[k];
    const kpl_optim_config *oc = kpl_optim_get_config(md->opt);
    const char *now = oc->name;
    char want[128], had[NAME_LEN + 64] = "", foreign[NAME_LEN];
    optim_words(now, oc->momentum, oc->nesterov, want, sizeof want);
    foreign_state(t, k, t->resume.ckpt, foreign, sizeof foreign);
    const json_t *saved = NULL;
    for (size_t i = 0; i < json_array_size(rm->models); i++) {
        const json_t *e = json_array_get(rm->models, i);
        const char *n = json_string_value(json_object_get(e, "name"));
        if (n && !strcmp(n, md->name)) saved = json_object_get(e, "optimizer");
    }
    const char *was = json_string_value(json_object_get(saved, "name"));
    bool differs;
    if (was) {
        double mom = json_number_value(json_object_get(saved, "momentum"));
        optim_words(was, mom, json_is_true(json_object_get(saved, "nesterov")), had, sizeof had);
        bool uses = !strcmp(now, "sgd") || !strcmp(now, "lars");
        differs = strcmp(was, now) || (uses && (mom > 0) != (oc->momentum > 0));
    } else {
        /* an older checkpoint: its state tensors tell what they can */
        differs = foreign[0] != '\0';
        if (differs) snprintf(had, sizeof had, "one with other state (%s)", foreign);
    }
    if (!differs) return KPL_OK;
    return KPL_ERROR(KPL_EINVAL, "--resume %s: model '%s' was trained with %s, this run's optimizer "
                     "is %s: its state cannot carry over.  Resume with --reset-optimizer to start "
                     "the optimizer state fresh (the weights, data position and generators still "
                     "resume), or set the checkpoint's optimizer", t->resume.path, md->name, had,
                     want);
}

kpl_status kpl__trainer_restore_state(kpl_trainer *t, const kpl__resume_meta *rm)
{
    kpl_checkpoint *c = t->resume.ckpt;
    char name[NAME_LEN];
    KPL_TRY(kpl__trainer_restore_models(t, c, t->resume.path));
    if (!t->resume.reset_optimizer)
        for (int k = 0; k < t->nmodels; k++) KPL_TRY(check_optimizer(t, k, rm));
    else if (t->rank == 0)
        kpl__log_warn(&t->log, "--reset-optimizer: the optimizer state of %s starts fresh",
                      t->resume.path);
    for (int k = 0; k < t->nmodels; k++) {
        kpl__model *md = &t->models[k];
        const char *const *slots = NULL;
        int ns = t->resume.reset_optimizer ? 0 : kpl_optim_state_slots(md->opt, &slots);
        for (int i = 0; i < md->np; i++)
            for (int s = 0; s < ns; s++) {
                optim_name(md, i, slots[s], false, name, sizeof name);
                kpl_tensor *x = kpl_checkpoint_find(c, name);
                if (!x && k == 0) {
                    optim_name(md, i, slots[s], true, name, sizeof name);
                    x = kpl_checkpoint_find(c, name);
                }
                if (x) KPL_TRY(kpl_optim_state_set(md->opt, i, s, x));
            }
        restore_rng(t, k, rm->rng);
        kpl__scaler_restore(&md->scaler, json_object_get(rm->scales, md->name));
    }
    if (t->task->restore) KPL_TRY(t->task->restore(t, t->task_state, c));
    t->step = rm->step;
    t->epoch_step = rm->epoch_step;
    t->best = rm->best;
    t->best_step = rm->best_step;
    t->skipped_steps = rm->skipped_steps;
    t->skipped_examples = rm->skipped_examples;
    /* every rank reads the marker, as it reads the checkpoint itself */
    t->eval_pending = rm->eval_pending && !kpl__checkpoint_evaluated(t->resume.path);
    if (rm->world_size != t->world || rm->batch_size != t->r->data.train.loader.batch_size) {
        /* the epoch's steps are counted anew from the loader's position */
        int64_t ep = 0, pos = 0;
        kpl_loader_position(t->train, &ep, &pos);
        t->epoch_step = pos / t->r->data.train.loader.batch_size / t->r->optimizer.accumulate;
    }
    return KPL_OK;
}

kpl_status kpl_trainer_restore(kpl_trainer *t, const char *path)
{
    kpl_checkpoint *c = NULL;
    KPL_TRY(kpl_checkpoint_load(path, &c));
    kpl_status st = kpl__trainer_restore_models(t, c, path);
    if (st >= 0 && t->task->restore) st = t->task->restore(t, t->task_state, c);
    kpl_checkpoint_destroy(c);
    return st;
}

/* ---- writing -------------------------------------------------------------------------------- */

kpl_status kpl__trainer_clean_checkpoints(kpl_trainer *t)
{
    if (t->rank != 0) return KPL_OK;
    int n = 0;
    double bytes = 0;
    KPL_TRY(kpl__checkpoint_clean(t->ckpt_dir, t->resume.path, &n, &bytes));
    if (n > 0)
        kpl__log_warn(&t->log, "removed %d unfinished checkpoint file%s (%.1f MB) left in %s by "
                      "an interrupted save", n, n > 1 ? "s" : "", bytes / 1e6, t->ckpt_dir);
    return KPL_OK;
}

/* Every rank's [seed, offset] of every model's generator, gathered:
 * all[(k * world + r) * 2 + {0, 1}].  Collective. */
static kpl_status gather_rngs(kpl_trainer *t, int64_t *all)
{
    int64_t n = 2 * t->nmodels, mine[2 * KPL__MAX_MODELS];
    for (int k = 0; k < t->nmodels; k++) {
        kpl_rng *g = kpl_module_rng(t->models[k].m);
        mine[2 * k] = (int64_t)kpl_rng_seed(g), mine[2 * k + 1] = (int64_t)kpl_rng_offset(g);
    }
    if (!t->comm) {
        memcpy(all, mine, (size_t)n * sizeof *mine);
        return KPL_OK;
    }
    int64_t nall = n * t->world;
    kpl_tensor *in = NULL, *out = NULL;
    kpl_status st = kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &n, mine, &in);
    if (st >= 0) st = kpl_tensor_empty(kpl_device_cpu(), KPL_I64, 1, &nall, &out);
    if (st >= 0) st = kpl_comm_allgather(t->comm, in, out);
    if (st >= 0) {
        /* rank-major from allgather: [r][k][2] -> [k][r][2] */
        const int64_t *g = kpl_tensor_host_data(out);
        for (int r = 0; g && r < t->world; r++)
            for (int k = 0; k < t->nmodels; k++)
                for (int e = 0; e < 2; e++)
                    all[((int64_t)k * t->world + r) * 2 + e] = g[((int64_t)r * t->nmodels + k) * 2 + e];
        if (!g) st = kpl_last_status();
    }
    kpl_tensor_release(in);
    kpl_tensor_release(out);
    return st;
}

/* The metadata object of a checkpoint (docs/checkpoint.md). */
static json_t *meta_of(kpl_trainer *t, const char *why, const char *yaml, const int64_t *rngs)
{
    int64_t ep = 0, pos = 0;
    kpl_loader_position(t->train, &ep, &pos);
    json_t *train = json_object();
    json_object_set_new(train, "step", json_integer(t->step));
    json_object_set_new(train, "epoch", json_integer(ep));
    json_object_set_new(train, "position", json_integer(pos));
    json_object_set_new(train, "epoch_step", json_integer(ep == t->epoch ? t->epoch_step : 0));
    json_object_set_new(train, "world_size", json_integer(t->world));
    json_object_set_new(train, "batch_size", json_integer(t->r->data.train.loader.batch_size));
    json_object_set_new(train, "accumulate", json_integer(t->r->optimizer.accumulate));
    json_object_set_new(train, "best_metric", json_string(t->task->best_metric));
    json_object_set_new(train, "best", kpl__json_num(t->best));
    json_object_set_new(train, "best_step", json_integer(t->best_step));
    json_t *byname = json_object();
    for (int k = 0; k < t->nmodels; k++) {
        json_t *per = json_array();
        for (int r = 0; r < t->world; r++)
            json_array_append_new(per, json_pack("[II]", (json_int_t)rngs[((int64_t)k * t->world + r) * 2],
                                                 (json_int_t)rngs[((int64_t)k * t->world + r) * 2 + 1]));
        if (k == 0) json_object_set(train, "rng", per); /* as before the task interface */
        json_object_set_new(byname, t->models[k].name, per);
    }
    json_object_set_new(train, "rngs", byname);
    json_object_set_new(train, "lr", json_real(kpl_optim_lr(t->models[0].opt)));
    json_object_set_new(train, "eval_pending", json_boolean(t->eval_pending));
    json_object_set_new(train, "skipped_steps", json_integer(t->skipped_steps));
    if (t->r->precision == KPL_F16) {
        json_t *scales = json_object();
        for (int k = 0; k < t->nmodels; k++)
            json_object_set_new(scales, t->models[k].name,
                                kpl__scaler_state(&t->models[k].scaler));
        json_object_set_new(train, "loss_scale", scales);
    }
    json_object_set_new(train, "skipped_examples", json_integer(t->skipped_examples));
    json_t *models = json_array();
    for (int k = 0; k < t->nmodels; k++) {
        const kpl_optim_config *oc = kpl_optim_get_config(t->models[k].opt);
        json_array_append_new(models, json_pack("{s:s, s:s, s:I, s:{s:s, s:f, s:b}}", "name",
                                                t->models[k].name, "label", t->models[k].label,
                                                "params",
                                                (json_int_t)kpl_module_param_count(t->models[k].m),
                                                "optimizer", "name", oc->name,
                                                "momentum", oc->momentum, "nesterov",
                                                (int)oc->nesterov));
    }
    json_t *j = json_pack("{s:s, s:s, s:I, s:s, s:s, s:o, s:o}", "kpl_version", kpl_version(),
                          "why", why, "time", (json_int_t)time(NULL), "recipe", yaml, "task",
                          t->task->name, "train", train, "models", models);
    if (j) {
        json_object_set_new(j, "model", json_pack("{s:s, s:I}", "name", t->models[0].label,
                                                  "params",
                                                  (json_int_t)kpl_module_param_count(t->models[0].m)));
        if (t->have_val) {
            json_t *v = json_object();
            for (int i = 0; i < t->val_res.metrics.n; i++)
                json_object_set_new(v, t->val_res.metrics.name[i], kpl__json_num(t->val_res.metrics.value[i]));
            json_object_set_new(v, "examples", json_integer(t->val_res.examples));
            json_object_set_new(j, "val", v);
        }
    }
    return j;
}

/* keep_last: the oldest complete checkpoints go, marker first */
static kpl_status rotate(kpl_trainer *t)
{
    if (t->r->checkpoint.keep_last <= 0) return KPL_OK;
    enum { MAX = 65536 };
    int64_t *steps = malloc(MAX * sizeof *steps);
    KPL_CHECK(steps, KPL_ENOMEM, "checkpoint: out of memory");
    int n = 0;
    kpl_status st = kpl__checkpoint_list(t->ckpt_dir, steps, MAX, &n);
    for (int i = 0; st >= 0 && i + t->r->checkpoint.keep_last < n; i++) {
        char old[PATH_MAX];
        kpl__checkpoint_path(t->ckpt_dir, steps[i], old, sizeof old);
        st = kpl__checkpoint_remove(old);
    }
    free(steps);
    return st;
}

static kpl_status save(kpl_trainer *t, const char *why, char *path, size_t len);

kpl_status kpl_trainer_save(kpl_trainer *t, const char *why, char *path, size_t len)
{
    kpl__tmark m = kpl__timing_begin(t, -1);
    kpl_status st = save(t, why, path, len);
    kpl__timing_end(t, m, "checkpoint save", -1);
    if (st < 0) t->stop.failed = true;
    return st;
}

static kpl_status save(kpl_trainer *t, const char *why, char *path, size_t len)
{
    KPL_TRY(kpl__trainer_check_losses(t)); /* no checkpoint of a step whose loss was NaN */
    KPL_CHECK(t->train, KPL_ESTATE, "kpl_trainer_save: an evaluation-only trainer has no run");
    char file[sizeof t->ckpt_dir + 32];
    kpl__checkpoint_path(t->ckpt_dir, t->step, file, sizeof file);
    KPL_CHECK(!path || strlen(file) < len, KPL_EINVAL,
              "kpl_trainer_save: the path buffer (%zu bytes) cannot hold %s", len, file);
    if (path) path[0] = '\0'; /* the other ranks write nothing */
    int64_t *rngs = calloc((size_t)(2 * t->nmodels * t->world), sizeof *rngs);
    KPL_CHECK(rngs, KPL_ENOMEM, "out of memory");
    kpl_status st = gather_rngs(t, rngs);
    if (st < 0 || t->rank != 0) {
        free(rngs);
        return st;
    }
    double t0 = kpl_seconds();
    kpl_checkpoint *c = NULL;
    char *yaml = NULL, *meta = NULL, name[NAME_LEN];
    json_t *j = NULL;
    KPL_TRY_GOTO(kpl_checkpoint_create(&c));
    for (int k = 0; k < t->nmodels; k++) {
        kpl__model *md = &t->models[k];
        char prefix[80];
        snprintf(prefix, sizeof prefix, "%s.", md->name);
        KPL_TRY_GOTO(kpl_module_state_save(md->m, c, prefix));
        const char *const *slots = NULL;
        int ns = kpl_optim_state_slots(md->opt, &slots);
        for (int i = 0; i < md->np; i++)
            for (int s = 0; s < ns; s++) {
                kpl_tensor *x = kpl_optim_state_get(md->opt, i, s);
                if (!x) continue;
                optim_name(md, i, slots[s], false, name, sizeof name);
                KPL_TRY_GOTO(kpl_checkpoint_add(c, name, x));
            }
    }
    if (t->task->save) KPL_TRY_GOTO(t->task->save(t, t->task_state, c));
    KPL_TRY_GOTO(kpl_recipe_to_yaml(t->r, &yaml));
    j = meta_of(t, why, yaml, rngs);
    meta = j ? json_dumps(j, JSON_COMPACT) : NULL;
    if (!meta) {
        st = KPL_ERROR(KPL_ENOMEM, "checkpoint: out of memory");
        goto fail;
    }
    KPL_TRY_GOTO(kpl_checkpoint_set_meta(c, meta));
    KPL_TRY_GOTO(kpl_checkpoint_save(c, file));
    if (path) snprintf(path, len, "%s", file);
    double secs = kpl_seconds() - t0;
    struct stat sb;
    double mb = stat(file, &sb) == 0 ? (double)sb.st_size / 1e6 : 0;
    kpl__log_info(&t->log, "checkpoint %s (%s, %.1f MB, %.2f s)", file, why, mb, secs);
    kpl__trainer_emit(t, json_pack("{s:s, s:I, s:s, s:s, s:f, s:f}", "event", "checkpoint",
                                   "step", (json_int_t)t->step, "why", why, "path", file, "mb", mb,
                                   "seconds", secs));
    KPL_TRY_GOTO(rotate(t));
    KPL_TRY_GOTO(kpl__trainer_clean_checkpoints(t));
fail:
    json_decref(j);
    free(meta);
    free(yaml);
    free(rngs);
    kpl_checkpoint_destroy(c);
    return st;
}

kpl_status kpl__trainer_note_best(kpl_trainer *t, const char *ckpt)
{
    if (t->rank != 0 || !t->r->checkpoint.keep_best || !ckpt[0] || t->best_step != t->step)
        return KPL_OK;
    char best[PATH_MAX + 32];
    snprintf(best, sizeof best, "%s/best.kpl", t->ckpt_dir);
    KPL_TRY(kpl__checkpoint_link(ckpt, best));
    kpl__log_info(&t->log, "best %s %.4g so far: %s", t->task->best_metric, t->best, best);
    return KPL_OK;
}
