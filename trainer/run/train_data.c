/*
 * train_data.c — a recipe's data: building the KPLRecord splits on first
 * use (data.convert), the loader configuration of each split, and the
 * input shape the model is built for.
 */
#include "run_impl.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void kpl__data_split_path(const kpl_recipe *r, const kpl_recipe_split *s, char *buf, size_t len)
{
    if (s->path[0] == '/' || !r->data.root[0]) snprintf(buf, len, "%s", s->path);
    else snprintf(buf, len, "%s/%s", r->data.root, s->path);
}

static bool empty_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return false;
    struct dirent *e;
    bool empty = true;
    while (empty && (e = readdir(d))) empty = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
    closedir(d);
    return empty;
}

/* Waits until `out` is not being written by another process (a `kpl data
 * convert` started by hand, say): *done when it then holds a complete
 * dataset; else it is gone or cleared of what a dead writer left. */
static kpl_status settle_split(const char *out, kpl__runlog *log, bool *done)
{
    double t0 = kpl_seconds(), said = -1;
    bool retried = false;
    *done = false;
    for (;;) {
        kpl_dataset *ds = NULL;
        if (kpl_dataset_open(out, &ds) == KPL_OK) {
            kpl_dataset_close(ds);
            *done = true;
            return KPL_OK;
        }
        char why[1024];
        snprintf(why, sizeof why, "%s", kpl_last_error());
        kpl_status why_st = kpl_last_status();
        if (access(out, F_OK) != 0) return KPL_OK;
        kpl_writer_state ws;
        char who[300];
        KPL_TRY(kpl_dataset_writer_state(out, &ws, who, sizeof who));
        if (ws == KPL_WRITER_ALIVE) {
            double waited = kpl_seconds() - t0;
            if (said < 0 || waited - said >= 60) {
                kpl__log_info(log, "data: %s is being written by another process (%s); waiting "
                              "for it to finish (%.0f s so far)", out, who, waited);
                said = waited;
            }
            KPL_CHECK(!(kpl_stop_requested() != 0), KPL_ECANCELED,
                      "data: stopped while waiting for %s, which %s is writing", out, who);
            usleep(200 * 1000);
            continue;
        }
        if (ws == KPL_WRITER_DEAD) {
            kpl_status st = kpl_dataset_remove_unfinished(out);
            if (st < 0)
                return KPL_ERROR(st, "data.convert: %s was left unfinished (%s) and is not "
                                 "removed: %s", out, who, kpl_last_error());
            kpl__log_warn(log, "data: removed %s, left unfinished by an interrupted conversion "
                          "(%s)", out, who);
            return KPL_OK;
        }
        /* No writer: a finished dataset (its writer closed it just now:
         * look again once), an empty directory (a writer died before its
         * marker; a new writer takes it as it is), or no dataset. */
        if (empty_dir(out)) return KPL_OK;
        if (!retried) {
            retried = true;
            continue;
        }
        return KPL_ERROR(why_st < 0 ? why_st : KPL_EFORMAT,
                         "data.convert: %s exists but is not a usable dataset (%s); remove it to "
                         "convert again", out, why);
    }
}

static bool stop_asked(void *ctx)
{
    (void)ctx;
    return (kpl_stop_requested() != 0);
}

static kpl_status convert_split(const kpl_recipe *r, const kpl_recipe_split *s, kpl__runlog *log)
{
    char out[PATH_MAX];
    kpl__data_split_path(r, s, out, sizeof out);
    bool done = false;
    KPL_TRY(settle_split(out, log, &done));
    if (done) return KPL_OK;
    kpl_convert_options o = r->data.convert.options;
    o.progress = isatty(2);
    o.cancel = stop_asked; /* SIGINT / SIGTERM: the partial split goes, the run ends */
    o.label = out;
    o.seed = (uint64_t)r->seed;
    /* images without objects leave training only: an evaluation counts
     * every image (COCO's and mmdetection's test mode) */
    o.drop_empty = o.drop_empty && s == &r->data.train;
    const char *src = r->data.convert.source;
    double t0 = kpl_seconds();
    const kpl_converter *c = kpl_converter_of(r->data.convert.from);
    KPL_CHECK(c, KPL_EINVAL, "data.convert: no converter for source %d", (int)r->data.convert.from);
    /* the sources that hold several splits find one by the last part of
     * the split's path */
    const char *split = strrchr(s->path, '/') ? strrchr(s->path, '/') + 1 : s->path;
    kpl__log_info(log, "data: converting %s from %s (%s), once", out, src, c->name);
    kpl_convert_result res = {0};
    KPL_TRY(c->split(src, s->path, split, out, &o, &res));
    const kpl_detection_stats *ds = &res.det;
    if (ds->skipped_images || ds->skipped_objects)
        kpl__log_warn(log, "data: %s: %lld bad images and %lld bad objects left out "
                      "(data.convert.skip_bad; each named above)", out,
                      (long long)ds->skipped_images, (long long)ds->skipped_objects);
    if (ds->dropped_empty)
        kpl__log_info(log, "data: %s: %lld images without objects left out "
                      "(data.convert.drop_empty)", out, (long long)ds->dropped_empty);
    if (res.skipped)
        kpl__log_warn(log, "data: %s: %lld bad images left out (data.convert.skip_bad; each named "
                      "above)", out, (long long)res.skipped);
    kpl__log_info(log, "data: %s: %lld examples in %.1f s", out, (long long)res.examples,
                  kpl_seconds() - t0);
    return KPL_OK;
}

/* While another conversion holds the lock: say so once a minute; give up
 * on SIGINT / SIGTERM. */
typedef struct {
    kpl__runlog *log;
    double said;
} waiting;

static bool keep_waiting(const char *lock, double waited, void *ctx)
{
    waiting *w = ctx;
    if (w->said < 0 || waited - w->said >= 60) {
        kpl__log_info(w->log, "data: waiting for another conversion to finish (it holds %s; "
                      "%.0f s so far)", lock, waited);
        w->said = waited;
    }
    return !(kpl_stop_requested() != 0);
}

/* The splits of sp[0..n) with a path. */
static kpl_status prepare(const kpl_recipe *r, const kpl_recipe_split *const *sp, int n,
                          kpl__runlog *log)
{
    if (r->data.convert.from == KPL_CONVERT_NONE) return KPL_OK;
    /* The ranks of a node, and `kpl data convert` runs, convert one at a
     * time (the lock in the directory holding the split); after the
     * first, the others find the split built. */
    for (int i = 0; i < n; i++) {
        if (!sp[i]->path[0]) continue;
        char out[PATH_MAX];
        kpl__data_split_path(r, sp[i], out, sizeof out);
        char *slash = strrchr(out, '/');
        if (slash == out) slash[1] = 0;
        else if (slash) *slash = 0;
        else snprintf(out, sizeof out, ".");
        waiting w = {log, -1};
        int fd = -1;
        KPL_TRY(kpl_convert_lock(out, keep_waiting, &w, &fd));
        kpl_status st = convert_split(r, sp[i], log);
        kpl_convert_unlock(fd);
        KPL_TRY(st);
    }
    return KPL_OK;
}

kpl_status kpl__data_prepare(const kpl_recipe *r, kpl__runlog *log)
{
    const kpl_recipe_split *sp[2] = {&r->data.train, &r->data.val};
    return prepare(r, sp, 2, log);
}

kpl_status kpl__data_prepare_val(const kpl_recipe *r, kpl__runlog *log)
{
    const kpl_recipe_split *sp[1] = {&r->data.val};
    return prepare(r, sp, 1, log);
}

void kpl__data_loader_config(const kpl_recipe *r, const kpl_recipe_split *s, const char *path,
                             bool train, int32_t rank, int32_t world, kpl_loader_config *c)
{
    *c = s->loader;
    c->path = path;
    if (c->batch_size == 0) c->batch_size = r->data.train.loader.batch_size;
    c->workers = (int)r->data.workers;
    c->prefetch = (int)r->data.prefetch;
    c->seed = (uint64_t)r->seed;
    c->rank = rank;
    c->world_size = world;
    /* Training ranks see equal shares (floor: the epoch's last N mod world
     * examples wait for another epoch's order); validation pads so that
     * every example is seen, and the trainer drops the repeats. */
    c->pad = !train && world > 1;
    c->transform.image_feature = s->image_feature;
    c->transform.label_feature = s->label_feature;
    c->transform.boxes_feature = s->boxes_feature[0] ? s->boxes_feature : NULL;
    c->transform.box_labels_feature = s->box_labels_feature[0] ? s->box_labels_feature : NULL;
    c->transform.mask_feature = s->mask_feature[0] ? s->mask_feature : NULL;
    c->transform.box_ignore_feature = s->box_ignore_feature[0] ? s->box_ignore_feature : NULL;
}

/* The input (C, H, W) of the model fed by split `s` ("train" or "val"):
 * for keep_ratio crops the largest a batch can be (the canvas). */
static kpl_status input_shape(const kpl_recipe *r, const kpl_recipe_split *s, const char *sn,
                              int64_t *chw)
{
    const kpl_transform_config *t = &s->loader.transform;
    /* the data's size: the transform's, else the stored one */
    int64_t h = t->out_h, w = t->out_w;
    char size_key[64], path[PATH_MAX] = "";
    snprintf(size_key, sizeof size_key, "data.%s.transform.size", sn);
    const char *from = size_key;
    if (t->crop == KPL_CROP_KEEP_RATIO) {
        /* Each batch has its own size; the canvas bounds them all. */
        int side = kpl_transform_canvas_side(t);
        KPL_CHECK(!r->model.in_h, KPL_EINVAL, "model.input_size: not with data.%s.transform.crop "
                  "keep_ratio, whose batches each have their own size (at most %dx%d): leave "
                  "model.input_size out", sn, side, side);
        h = w = side;
    }
    if (!h) {
        kpl__data_split_path(r, s, path, sizeof path);
        kpl_dataset *ds = NULL;
        KPL_TRY(kpl_dataset_open(path, &ds));
        int f = kpl_dataset_find_feature(ds, s->image_feature);
        const kpl_feature_spec *spec = f >= 0 ? kpl_dataset_feature(ds, f) : NULL;
        if (spec && spec->ndim == 3) h = spec->shape[0], w = spec->shape[1];
        kpl_dataset_close(ds);
        from = path;
    }
    KPL_CHECK(h || r->model.in_h, KPL_EINVAL,
              "%s: images of feature '%s' have no fixed size; set %s (or model.input_size)",
              path, s->image_feature, size_key);
    /* model.input_size and in_channels say what the model expects: the
     * data must agree where it has a size of its own */
    KPL_CHECK(!r->model.in_h || !h || (r->model.in_h == h && r->model.in_w == w), KPL_EINVAL,
              "model.input_size is [%d, %d] but the %s images are %lldx%lld (%s): leave "
              "model.input_size out, or resize the data to it with %s", (int)r->model.in_h,
              (int)r->model.in_w, !strcmp(sn, "train") ? "training" : "validation",
              (long long)h, (long long)w, from, size_key);
    KPL_CHECK(!r->model.in_channels || r->model.in_channels == t->channels, KPL_EINVAL,
              "model.in_channels is %d but data.%s.transform.channels is %d: leave "
              "model.in_channels out, or make them agree", (int)r->model.in_channels, sn,
              (int)t->channels);
    chw[0] = t->channels;
    chw[1] = h ? h : r->model.in_h;
    chw[2] = h ? w : r->model.in_w;
    return KPL_OK;
}

kpl_status kpl__data_input_shape(const kpl_recipe *r, int64_t *chw)
{
    return input_shape(r, &r->data.train, "train", chw);
}

kpl_status kpl__data_val_input_shape(const kpl_recipe *r, int64_t *chw)
{
    return input_shape(r, &r->data.val, "val", chw);
}
