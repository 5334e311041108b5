/*
 * train_data.c — a recipe's data: building the KPLRecord splits on first
 * use (data.convert), the loader configuration of each split, and the
 * input shape the model is built for.
 */
#include "trainer_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

void kpl__data_split_path(const kpl_recipe *r, const kpl_recipe_split *s, char *buf, size_t len)
{
    if (s->path[0] == '/' || !r->data.root[0]) snprintf(buf, len, "%s", s->path);
    else snprintf(buf, len, "%s/%s", r->data.root, s->path);
}

kpl_status kpl__mkdirs(const char *dir)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s", dir);
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s) continue;
        char c = *s;
        *s = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST)
            return KPL_ERROR(KPL_EIO, "cannot create directory %s: %s", p, strerror(errno));
        *s = c;
        if (!c) break;
    }
    return KPL_OK;
}

/* The IDX files of a split: "test" is also found as t10k (the MNIST names). */
static bool find_idx(const char *src, const char *split, char *images, char *labels, size_t len)
{
    const char *prefixes[2] = {split, !strcmp(split, "test") ? "t10k" : NULL};
    const char *ext[2] = {".gz", ""};
    for (int p = 0; p < 2 && prefixes[p]; p++)
        for (int e = 0; e < 2; e++) {
            snprintf(images, len, "%s/%s-images-idx3-ubyte%s", src, prefixes[p], ext[e]);
            snprintf(labels, len, "%s/%s-labels-idx1-ubyte%s", src, prefixes[p], ext[e]);
            if (access(images, R_OK) == 0 && access(labels, R_OK) == 0) return true;
        }
    return false;
}

/* A split directory left by a conversion that died (its WRITING marker is
 * there): with the lock held nobody else is writing it, so its files go. */
static bool remove_unfinished(const char *dir)
{
    char w[PATH_MAX + 16];
    snprintf(w, sizeof w, "%s/WRITING", dir);
    if (access(w, F_OK) != 0) return false;
    DIR *d = opendir(dir);
    if (!d) return false;
    struct dirent *e;
    bool ok = true;
    while ((e = readdir(d))) {
        const char *n = e->d_name, *dot = strrchr(n, '.');
        if (!strcmp(n, ".") || !strcmp(n, "..")) continue;
        bool ours = !strcmp(n, "WRITING") || !strcmp(n, "METADATA") ||
                    !strcmp(n, "classes.txt") || !strncmp(n, "METADATA.", 9) ||
                    (dot && (!strcmp(dot, ".data") || !strcmp(dot, ".index")));
        char f[PATH_MAX + 260];
        snprintf(f, sizeof f, "%s/%s", dir, n);
        if (!ours || unlink(f) != 0) ok = false;
    }
    closedir(d);
    return ok && rmdir(dir) == 0;
}

static kpl_status convert_split(const kpl_recipe *r, const kpl_recipe_split *s, kpl__runlog *log)
{
    char out[PATH_MAX];
    kpl__data_split_path(r, s, out, sizeof out);
    kpl_dataset *ds = NULL;
    if (kpl_dataset_open(out, &ds) == KPL_OK) {
        kpl_dataset_close(ds);
        return KPL_OK;
    }
    if (access(out, F_OK) == 0) {
        if (!remove_unfinished(out)) {
            /* a directory that is no dataset, or not one we may remove */
            kpl_status st = kpl_last_status();
            return KPL_ERROR(st < 0 ? st : KPL_EFORMAT,
                             "data.convert: %s exists but is not a usable dataset (%s); remove "
                             "it to convert again", out, kpl_last_error());
        }
        kpl__log_warn(log, "data: removed %s, left unfinished by an interrupted conversion", out);
    }
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.writer.shards = (int)r->data.convert.shards;
    o.progress = isatty(2);
    o.label = out;
    o.max_side = (int)r->data.convert.max_side;
    o.quality = (int)r->data.convert.quality;
    o.seed = (uint64_t)r->seed;
    const char *src = r->data.convert.source;
    int64_t n = 0, skipped = 0;
    double t0 = kpl_seconds();
    kpl__log_info(log, "data: converting %s from %s (%s), once", out, src,
                  r->data.convert.from == 1 ? "IDX" : r->data.convert.from == 2 ? "image folder"
                                                                                 : "LMDB");
    if (r->data.convert.from == 1) {
        char images[PATH_MAX], labels[PATH_MAX];
        const char *split = strrchr(s->path, '/') ? strrchr(s->path, '/') + 1 : s->path;
        KPL_CHECK(find_idx(src, split, images, labels, sizeof images), KPL_ENOTFOUND,
                  "data.convert: no %s-images-idx3-ubyte[.gz] with its labels file in %s%s",
                  split, src,
                  access(src, F_OK) ? " (the directory does not exist; on Debian install "
                                      "dataset-fashion-mnist, or run scripts/setup.sh)"
                                    : "");
        KPL_TRY(kpl_convert_idx(images, labels, out, &o, &n));
    } else {
        char in[PATH_MAX];
        snprintf(in, sizeof in, "%s/%s", src, s->path);
        if (r->data.convert.from == 2) KPL_TRY(kpl_convert_imagefolder(in, out, &o, &n, &skipped));
        else KPL_TRY(kpl_convert_lmdb(in, out, &o, &n));
    }
    kpl__log_info(log, "data: %s: %lld examples in %.1f s", out, (long long)n, kpl_seconds() - t0);
    return KPL_OK;
}

kpl_status kpl__data_prepare(const kpl_recipe *r, kpl__runlog *log)
{
    if (r->data.convert.from == 0) return KPL_OK;
    const char *root = r->data.root[0] ? r->data.root : ".";
    KPL_TRY(kpl__mkdirs(root));
    char lock[PATH_MAX];
    snprintf(lock, sizeof lock, "%s/.kpl-convert.lock", root);
    int fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    KPL_CHECK(fd >= 0, KPL_EIO, "data: cannot create the lock %s: %s", lock, strerror(errno));
    /* The ranks of a node convert one at a time; after the first, the
     * others find the splits built. */
    while (flock(fd, LOCK_EX) != 0) {
        if (errno == EINTR) continue;
        close(fd);
        return KPL_ERROR(KPL_EIO, "data: cannot lock %s: %s", lock, strerror(errno));
    }
    kpl_status st = KPL_OK;
    const kpl_recipe_split *sp[2] = {&r->data.train, &r->data.val};
    for (int i = 0; i < 2 && st >= 0; i++)
        if (sp[i]->path[0]) st = convert_split(r, sp[i], log);
    flock(fd, LOCK_UN);
    close(fd);
    return st;
}

void kpl__data_loader_config(const kpl_recipe *r, const kpl_recipe_split *s, const char *path,
                             bool train, int32_t rank, int32_t world, kpl_loader_config *c)
{
    *c = (kpl_loader_config)KPL_LOADER_CONFIG_INIT;
    c->path = path;
    c->batch_size = s->batch_size > 0 ? s->batch_size : r->data.train.batch_size;
    c->workers = (int)r->data.workers;
    c->prefetch = (int)r->data.prefetch;
    c->seed = (uint64_t)r->seed;
    c->rank = rank;
    c->world_size = world;
    c->shuffle = (kpl_shuffle_mode)s->shuffle;
    c->shuffle_window = (int)s->shuffle_window;
    c->initial_fill = s->initial_fill;
    /* Training ranks see equal shares (floor: the epoch's last N mod world
     * examples wait for another epoch's order); validation pads so that
     * every example is seen, and the trainer drops the repeats. */
    c->pad = !train && world > 1;
    c->drop_last = s->drop_last;
    c->limit = s->limit;
    c->interleave = s->interleave;
    kpl_transform_config *t = &c->transform;
    t->image_feature = s->image_feature;
    t->label_feature = s->label_feature;
    t->channels = (int)s->channels;
    t->crop = (kpl_crop_mode)s->crop;
    if (s->nsize == 2) t->out_h = (int)s->size[0], t->out_w = (int)s->size[1];
    t->scale[0] = (float)s->scale[0], t->scale[1] = (float)s->scale[1];
    t->ratio[0] = (float)s->ratio[0], t->ratio[1] = (float)s->ratio[1];
    t->resize_shorter = (int)s->resize_shorter;
    t->flip_prob = (float)s->flip;
    t->brightness = (float)s->brightness;
    t->contrast = (float)s->contrast;
    t->saturation = (float)s->saturation;
    t->out_dtype = KPL_F32;
    for (int k = 0; k < 3; k++) {
        t->mean[k] = (float)s->mean[s->nmean == 1 ? 0 : k < s->nmean ? k : 0];
        t->std[k] = (float)s->std[s->nstd == 1 ? 0 : k < s->nstd ? k : 0];
    }
}

kpl_status kpl__data_input_shape(const kpl_recipe *r, int64_t *chw)
{
    const kpl_recipe_split *s = &r->data.train;
    chw[0] = r->model.in_channels ? r->model.in_channels : s->channels;
    if (r->model.ninput_size == 2) {
        chw[1] = r->model.input_size[0], chw[2] = r->model.input_size[1];
        return KPL_OK;
    }
    if (s->nsize == 2) {
        chw[1] = s->size[0], chw[2] = s->size[1];
        return KPL_OK;
    }
    char path[PATH_MAX];
    kpl__data_split_path(r, s, path, sizeof path);
    kpl_dataset *ds = NULL;
    KPL_TRY(kpl_dataset_open(path, &ds));
    int f = kpl_dataset_find_feature(ds, s->image_feature);
    const kpl_feature_spec *spec = f >= 0 ? kpl_dataset_feature(ds, f) : NULL;
    bool fixed = spec && spec->ndim == 3;
    if (fixed) chw[1] = spec->shape[0], chw[2] = spec->shape[1];
    kpl_dataset_close(ds);
    KPL_CHECK(fixed, KPL_EINVAL,
              "%s: images of feature '%s' have no fixed size; set "
              "data.train.transform.size (or model.input_size)",
              path, s->image_feature);
    return KPL_OK;
}
