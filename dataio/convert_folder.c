/*
 * convert_folder.c — folders of images to KPLRecord: with classes
 * (ImageNet layout, root/<class>/<image>: kpl_convert_imagefolder) or
 * without (every image under root, in subfolders too: kpl_convert_images,
 * a GAN's data).
 *
 * Class index = position of the class folder in sorted (byte-wise) order,
 * as torchvision's ImageFolder numbers them; the names go to classes.txt.
 * Images are stored as their original bytes (no quality loss), after a
 * full decode with the loader's own decoder (kpl__load_image in
 * convert_common.c), so a truncated or corrupt file is caught here, naming
 * it, and not in the middle of an epoch.
 *
 * The example order is shuffled with a seeded permutation (unless
 * keep_order): a folder walk is class-sorted (or, without classes, sorted
 * by name, which often means by time or source), and chunk-wise shuffling
 * only mixes within a window of chunks, so a sorted dataset would give
 * sorted batches.  The relative path is kept as a feature.  Files are read
 * and checked by `threads` workers in batches, then appended in order, so
 * the result does not depend on the thread count.
 */
#include "convert_impl.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>
#include <sys/stat.h>

typedef struct {
    char *rel;     /* "class/file.jpg", or "a/b.png" without classes */
    int64_t label; /* -1 without classes */
} item;

/* The items found so far, and how many of each kind. */
typedef struct {
    item *v;
    int64_t n, cap;
    int64_t njpeg, npng;
} item_list;

static void item_list_free(item_list *l)
{
    for (int64_t i = 0; i < l->n; i++) free(l->v[i].rel);
    free(l->v);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool image_ext(const char *name)
{
    const char *dot = strrchr(name, '.');
    return dot && (!strcasecmp(dot, ".jpg") || !strcasecmp(dot, ".jpeg") ||
                   !strcasecmp(dot, ".png"));
}

kpl_status kpl__list_dir(const char *what, const char *dir, bool want_dirs, char ***out,
                         int64_t *n)
{
    *out = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    KPL_CHECK(d, errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "%s: %s: %s", what, dir,
              strerror(errno));
    int64_t cap = 0;
    char **v = NULL;
    kpl_status st = KPL_OK;
    struct dirent *e;
    char p[PATH_MAX];
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue; /* ., .. and hidden files */
        if (snprintf(p, sizeof p, "%s/%s", dir, e->d_name) >= (int)sizeof p) continue;
        struct stat sb;
        if (stat(p, &sb) != 0) continue; /* a dangling link */
        if (want_dirs ? !S_ISDIR(sb.st_mode) : !(S_ISREG(sb.st_mode) && image_ext(e->d_name)))
            continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 256;
            char **nv = realloc(v, sizeof *v * (size_t)cap);
            if (!nv) {
                st = KPL_ERROR(KPL_ENOMEM, "%s: no memory", what);
                break;
            }
            v = nv;
        }
        if (!(v[*n] = strdup(e->d_name))) {
            st = KPL_ERROR(KPL_ENOMEM, "%s: no memory", what);
            break;
        }
        (*n)++;
    }
    closedir(d);
    if (st < 0) {
        for (int64_t i = 0; i < *n; i++) free(v[i]);
        free(v);
        *n = 0;
        return st;
    }
    if (*n) qsort(v, (size_t)*n, sizeof *v, cmp_str);
    *out = v;
    return KPL_OK;
}

/* Appends the item dir/file ("" dir: file) with its label. */
static kpl_status add_item(item_list *l, const char *what, const char *dir, const char *file,
                           int64_t label)
{
    if (l->n == l->cap) {
        int64_t cap = l->cap ? 2 * l->cap : 1024;
        item *v = realloc(l->v, sizeof *v * (size_t)cap);
        KPL_CHECK(v, KPL_ENOMEM, "%s: no memory", what);
        l->v = v;
        l->cap = cap;
    }
    size_t len = strlen(dir) + strlen(file) + 2;
    char *rel = malloc(len);
    KPL_CHECK(rel, KPL_ENOMEM, "%s: no memory", what);
    snprintf(rel, len, "%s%s%s", dir, *dir ? "/" : "", file);
    bool png = !strcasecmp(strrchr(file, '.'), ".png");
    l->npng += png;
    l->njpeg += !png;
    l->v[l->n++] = (item){rel, label};
    return KPL_OK;
}

/* Every image of every class folder (root/<class>/<file>) as an item. */
static kpl_status scan_classes(const char *root, char **classes, int64_t ncls, item_list *l)
{
    kpl_status st = KPL_OK;
    char **files = NULL;
    int64_t nfiles = 0;
    for (int64_t c = 0; c < ncls && st >= 0; c++) {
        char cdir[PATH_MAX];
        snprintf(cdir, sizeof cdir, "%s/%s", root, classes[c]);
        KPL_TRY(kpl__list_dir("imagefolder", cdir, false, &files, &nfiles));
        for (int64_t i = 0; i < nfiles && st >= 0; i++)
            st = add_item(l, "imagefolder", classes[c], files[i], c);
        for (int64_t i = 0; i < nfiles; i++) free(files[i]);
        free(files);
    }
    return st;
}

/* Every image under root/rel (rel "" for root itself), subfolders
 * included, as an item without a label; names are sorted at the end.
 * Links to folders are not followed (no loops); depth is bounded. */
static kpl_status walk(const char *root, const char *rel, int depth, item_list *l)
{
    char dir[PATH_MAX];
    KPL_CHECK(snprintf(dir, sizeof dir, "%s%s%s", root, *rel ? "/" : "", rel) < (int)sizeof dir,
              KPL_EINVAL, "images: %s/%s: path too long", root, rel);
    KPL_CHECK(depth <= 64, KPL_EINVAL, "images: %s: folders nested more than 64 deep", dir);
    DIR *d = opendir(dir);
    KPL_CHECK(d, errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "images: %s: %s", dir,
              strerror(errno));
    kpl_status st = KPL_OK;
    struct dirent *e;
    while (st >= 0 && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue; /* ., .. and hidden files */
        char p[PATH_MAX], sub[PATH_MAX];
        struct stat sb;
        if (snprintf(p, sizeof p, "%s/%s", dir, e->d_name) >= (int)sizeof p ||
            lstat(p, &sb) != 0)
            continue;
        if (S_ISDIR(sb.st_mode)) {
            if (snprintf(sub, sizeof sub, "%s%s%s", rel, *rel ? "/" : "", e->d_name) <
                (int)sizeof sub)
                st = walk(root, sub, depth + 1, l);
            continue;
        }
        /* a link to a file counts as the file */
        if (S_ISLNK(sb.st_mode) && stat(p, &sb) != 0) continue;
        if (S_ISREG(sb.st_mode) && image_ext(e->d_name))
            st = add_item(l, "images", rel, e->d_name, -1);
    }
    closedir(d);
    return st;
}

static int cmp_item(const void *a, const void *b)
{
    return strcmp(((const item *)a)->rel, ((const item *)b)->rel);
}

typedef struct {
    const char *root;
    const item *items;
    const kpl_convert_options *o;
    kpl__loaded_image *batch;
} batch_job;

static void load_item(int64_t i, kpl__codec *c, void *ctx)
{
    batch_job *j = ctx;
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/%s", j->root, j->items[i].rel);
    kpl__load_image(p, j->o->max_side, j->o->quality, c, &j->batch[i]);
}

/* Decodes (and checks, and perhaps re-encodes) nb items in parallel, then
 * appends them in order: image, label (when labeled), path.  A bad one is
 * skipped (counted in *nskip) under skip_bad, else an error naming it. */
static kpl_status convert_batch(const char *src, const char *root, const item *items, int nb,
                                bool labeled, const kpl_convert_options *o,
                                kpl__loaded_image *batch, kpl_record_writer *w, int64_t *nskip)
{
    kpl_status st = KPL_OK;
    batch_job job = {root, items, o, batch};
    kpl__convert_parallel(nb, o->threads, load_item, &job);
    for (int i = 0; i < nb && st == KPL_OK; i++) {
        const item *it = &items[i];
        if (batch[i].why[0]) {
            st = kpl__convert_bad(o, batch[i].fatal, nskip, "%s: %s/%s: %s", src, root, it->rel,
                                  batch[i].why);
            continue;
        }
        kpl_feature_value v[3] = {{batch[i].bytes, (uint32_t)batch[i].len},
                                  {&it->label, 1},
                                  {it->rel, (uint32_t)strlen(it->rel)}};
        if (!labeled) v[1] = v[2];
        st = kpl_record_writer_add(w, v);
    }
    for (int i = 0; i < nb; i++) {
        free(batch[i].bytes);
        batch[i].bytes = NULL;
    }
    return st;
}

/* METADATA's attributes: the source and root, `extra`'s (taken), the order. */
static char *attributes(const char *src, const char *root, json_t *extra,
                        const kpl_convert_options *o)
{
    json_t *a = json_pack("{s:s, s:s}", "source", src, "root", root);
    if (a && extra) json_object_update(a, extra);
    json_decref(extra);
    if (a) {
        json_object_set_new(a, "shuffled", json_boolean(!o->keep_order));
        json_object_set_new(a, "seed", json_integer((json_int_t)o->seed));
        json_object_set_new(a, "max_side", json_integer(o->max_side));
    }
    char *s = a ? json_dumps(a, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(a);
    return s;
}

/* Writes the items of l (shuffled unless o->keep_order) as a dataset at
 * out_dir, METADATA's attributes with `extra`'s (taken); src
 * ("imagefolder", "images") names the source in messages. */
static kpl_status write_items(const char *src, const char *root, item_list *l, bool labeled,
                              json_t *extra, const kpl_convert_options *opt,
                              const char *out_dir, int64_t *count, int64_t *skipped)
{
    kpl_convert_options o = *opt;
    enum { BATCH = 256 };
    char *attrs = attributes(src, root, extra, &o);
    KPL_CHECK(attrs, KPL_ENOMEM, "%s: no memory (or the root path is not UTF-8)", src);
    if (!o.keep_order) { /* Fisher-Yates from the seed */
        kpl__rng r = {o.seed};
        for (int64_t i = l->n - 1; i > 0; i--) {
            int64_t j = (int64_t)kpl__rng_below(&r, (uint64_t)i + 1);
            item t = l->v[i];
            l->v[i] = l->v[j];
            l->v[j] = t;
        }
    }
    kpl_feature_spec schema[3] = {
        {.name = "image", .type = KPL_FEATURE_BYTES},
        {.name = "label", .type = KPL_FEATURE_INT64},
        {.name = "path", .type = KPL_FEATURE_STRING},
    };
    strcpy(schema[0].encoding, l->npng == 0 ? "jpeg" : l->njpeg == 0 ? "png" : "");
    if (!labeled) schema[1] = schema[2];
    o.writer.attributes_json = attrs;
    kpl__loaded_image *batch = calloc(BATCH, sizeof *batch);
    kpl_record_writer *w = NULL;
    int64_t nskip = 0;
    kpl_status st = KPL_OK;
    if (!batch) {
        st = KPL_ERROR(KPL_ENOMEM, "%s: no memory", src);
        goto fail;
    }
    KPL_TRY_GOTO(kpl_record_writer_create(out_dir, labeled ? 3 : 2, schema, &o.writer, &w));
    kpl__progress pr;
    kpl__progress_init(&pr, &o, out_dir);
    for (int64_t b0 = 0; b0 < l->n; b0 += BATCH) {
        int nb = (int)(l->n - b0 < BATCH ? l->n - b0 : BATCH);
        KPL_TRY_GOTO(convert_batch(src, root, l->v + b0, nb, labeled, &o, batch, w, &nskip));
        KPL_TRY_GOTO(kpl__progress_update(&pr, (uint64_t)(b0 + nb), (uint64_t)l->n, "images"));
    }
    int64_t written = kpl_record_writer_count(w);
    if (written == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "%s %s: every image was bad", src, root);
        goto fail;
    }
    kpl_record_writer *done = w;
    w = NULL;
    KPL_TRY_GOTO(kpl_record_writer_close(done));
    if (count) *count = written;
    if (skipped) *skipped = nskip;
fail:
    kpl_record_writer_destroy(w);
    free(batch);
    free(attrs);
    return st;
}

static kpl_status check_options(const char *src, const kpl_convert_options *o)
{
    KPL_CHECK(o->max_side >= 0 && o->max_side <= 65535, KPL_EINVAL,
              "%s: max_side %d must be in [0, 65535]", src, o->max_side);
    KPL_CHECK(o->quality >= 1 && o->quality <= 100, KPL_EINVAL,
              "%s: quality %d must be in [1, 100]", src, o->quality);
    return KPL_OK;
}

kpl_status kpl_convert_imagefolder(const char *root, const char *out_dir,
                                   const kpl_convert_options *opt, int64_t *count,
                                   int64_t *skipped)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    if (opt) o = *opt;
    KPL_TRY(check_options("imagefolder", &o));
    kpl_status st = KPL_OK;
    char **classes = NULL;
    int64_t ncls = 0;
    item_list l = {0};

    KPL_TRY(kpl__list_dir("imagefolder", root, true, &classes, &ncls));
    if (ncls == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "imagefolder %s: no class folders (want root/<class>/<image>; "
                       "for images without classes use the images source)", root);
        goto fail;
    }
    KPL_TRY_GOTO(scan_classes(root, classes, ncls, &l));
    if (l.n == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "imagefolder %s: %lld class folders but no .jpg/.jpeg/.png "
                       "files in them", root, (long long)ncls);
        goto fail;
    }
    json_t *extra = json_pack("{s:I, s:s}", "num_classes", (json_int_t)ncls, "classes_file",
                              "classes.txt");
    KPL_TRY_GOTO(write_items("imagefolder", root, &l, true, extra, &o, out_dir, count, skipped));
    KPL_TRY_GOTO(kpl__write_lines(out_dir, "classes.txt", classes, ncls));
fail:
    item_list_free(&l);
    for (int64_t i = 0; i < ncls; i++) free(classes[i]);
    free(classes);
    return st;
}

kpl_status kpl_convert_images(const char *root, const char *out_dir,
                              const kpl_convert_options *opt, int64_t *count, int64_t *skipped)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    if (opt) o = *opt;
    KPL_TRY(check_options("images", &o));
    item_list l = {0};
    kpl_status st = KPL_OK;
    KPL_TRY_GOTO(walk(root, "", 0, &l));
    if (l.n == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "images %s: no .jpg/.jpeg/.png files in it or its "
                       "subfolders", root);
        goto fail;
    }
    qsort(l.v, (size_t)l.n, sizeof *l.v, cmp_item);
    KPL_TRY_GOTO(write_items("images", root, &l, false, json_pack("{s:b}", "labels", false), &o,
                             out_dir, count, skipped));
fail:
    item_list_free(&l);
    return st;
}
