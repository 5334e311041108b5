/*
 * convert_folder.c — an image folder (ImageNet layout, root/<class>/<image>)
 * to KPLRecord.
 *
 * Class index = position of the class folder in sorted (byte-wise) order,
 * as torchvision's ImageFolder numbers them; the names go to classes.txt.
 * Images are stored as their original bytes (no quality loss), after a
 * full decode with the loader's own decoder (kpl__load_image in
 * convert_common.c), so a truncated or corrupt file is caught here, naming
 * it, and not in the middle of an epoch.
 *
 * The example order is shuffled with a seeded permutation (unless
 * keep_order): a folder walk is class-sorted, and chunk-wise shuffling
 * only mixes within a window of chunks, so a class-sorted dataset would
 * give class-sorted batches.  The relative path is kept as a feature.
 * Files are read and checked by `threads` workers in batches, then appended
 * in order, so the result does not depend on the thread count.
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
    char *rel; /* "class/file.jpg" */
    int64_t label;
} item;


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

/* Every image of every class folder (root/<class>/<file>) as an item;
 * *njpeg and *npng count the kinds.  items is the caller's to free (with
 * each rel) also on failure; *nitems says how many are set. */
static kpl_status scan_items(const char *root, char **classes, int64_t ncls, item **items,
                             int64_t *nitems, int64_t *njpeg, int64_t *npng)
{
    kpl_status st = KPL_OK;
    char **files = NULL;
    int64_t nfiles = 0, cap = 0;
    for (int64_t c = 0; c < ncls; c++) {
        char cdir[PATH_MAX];
        snprintf(cdir, sizeof cdir, "%s/%s", root, classes[c]);
        KPL_TRY_GOTO(kpl__list_dir("imagefolder", cdir, false, &files, &nfiles));
        if (*nitems + nfiles > cap) {
            cap = 2 * (*nitems + nfiles) + 1024;
            item *ni = realloc(*items, sizeof **items * (size_t)cap);
            if (!ni) {
                st = KPL_ERROR(KPL_ENOMEM, "imagefolder: no memory");
                goto fail;
            }
            *items = ni;
        }
        for (int64_t i = 0; i < nfiles; i++) {
            size_t len = strlen(classes[c]) + strlen(files[i]) + 2;
            char *rel = malloc(len);
            if (!rel) {
                st = KPL_ERROR(KPL_ENOMEM, "imagefolder: no memory");
                goto fail;
            }
            snprintf(rel, len, "%s/%s", classes[c], files[i]);
            const char *dot = strrchr(files[i], '.');
            *npng += !strcasecmp(dot, ".png");
            *njpeg += strcasecmp(dot, ".png") != 0;
            (*items)[(*nitems)++] = (item){rel, c};
        }
        for (int64_t i = 0; i < nfiles; i++) free(files[i]);
        free(files);
        files = NULL;
        nfiles = 0;
    }
fail:
    for (int64_t i = 0; files && i < nfiles; i++) free(files[i]);
    free(files);
    return st;
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
 * appends them in order; a bad one is skipped (counted in *nskip) under
 * skip_bad, else an error naming it. */
static kpl_status convert_batch(const char *root, const item *items, int nb,
                                const kpl_convert_options *o, int threads,
                                kpl__loaded_image *batch, kpl_record_writer *w, int64_t *nskip)
{
    kpl_status st = KPL_OK;
    batch_job job = {root, items, o, batch};
    kpl__convert_parallel(nb, threads, load_item, &job);
    for (int i = 0; i < nb && st == KPL_OK; i++) {
        const item *it = &items[i];
        if (batch[i].why[0]) {
            st = kpl__convert_bad(o, batch[i].fatal, nskip, "imagefolder: %s/%s: %s", root,
                                  it->rel, batch[i].why);
            continue;
        }
        kpl_feature_value v[3] = {{batch[i].bytes, (uint32_t)batch[i].len},
                                  {&it->label, 1},
                                  {it->rel, (uint32_t)strlen(it->rel)}};
        st = kpl_record_writer_add(w, v);
    }
    for (int i = 0; i < nb; i++) {
        free(batch[i].bytes);
        batch[i].bytes = NULL;
    }
    return st;
}

kpl_status kpl_convert_imagefolder(const char *root, const char *out_dir,
                                   const kpl_convert_options *opt, int64_t *count,
                                   int64_t *skipped)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    if (opt) o = *opt;
    KPL_CHECK(o.max_side >= 0 && o.max_side <= 65535, KPL_EINVAL,
              "imagefolder: max_side %d must be in [0, 65535]", o.max_side);
    KPL_CHECK(o.quality >= 1 && o.quality <= 100, KPL_EINVAL,
              "imagefolder: quality %d must be in [1, 100]", o.quality);
    kpl_status st = KPL_OK;
    char **classes = NULL;
    int64_t ncls = 0, nitems = 0, nskip = 0, njpeg = 0, npng = 0;
    item *items = NULL;
    kpl__loaded_image *batch = NULL;
    kpl_record_writer *w = NULL;
    char *attrs = NULL;
    enum { BATCH = 256 };

    KPL_TRY(kpl__list_dir("imagefolder", root, true, &classes, &ncls));
    if (ncls == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "imagefolder %s: no class folders (want root/<class>/<image>)",
                       root);
        goto fail;
    }
    KPL_TRY_GOTO(scan_items(root, classes, ncls, &items, &nitems, &njpeg, &npng));
    if (nitems == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "imagefolder %s: %lld class folders but no .jpg/.jpeg/.png "
                       "files in them", root, (long long)ncls);
        goto fail;
    }
    if (!o.keep_order) { /* Fisher-Yates from the seed */
        kpl__rng r = {o.seed};
        for (int64_t i = nitems - 1; i > 0; i--) {
            int64_t j = (int64_t)kpl__rng_below(&r, (uint64_t)i + 1);
            item t = items[i];
            items[i] = items[j];
            items[j] = t;
        }
    }
    json_t *aj = json_pack("{s:s, s:s, s:I, s:s, s:b, s:I, s:i}", "source", "imagefolder",
                           "root", root, "num_classes", (json_int_t)ncls, "classes_file",
                           "classes.txt", "shuffled", !o.keep_order, "seed", (json_int_t)o.seed,
                           "max_side", o.max_side);
    attrs = aj ? json_dumps(aj, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(aj);
    batch = calloc(BATCH, sizeof *batch);
    if (!attrs || !batch) {
        st = KPL_ERROR(KPL_ENOMEM, "imagefolder: no memory (or the root path is not UTF-8)");
        goto fail;
    }
    kpl_feature_spec schema[3] = {
        {.name = "image", .type = KPL_FEATURE_BYTES},
        {.name = "label", .type = KPL_FEATURE_INT64},
        {.name = "path", .type = KPL_FEATURE_STRING},
    };
    strcpy(schema[0].encoding, npng == 0 ? "jpeg" : njpeg == 0 ? "png" : "");
    o.writer.attributes_json = attrs;
    KPL_TRY_GOTO(kpl_record_writer_create(out_dir, 3, schema, &o.writer, &w));
    kpl__progress pr;
    kpl__progress_init(&pr, &o, out_dir);
    for (int64_t b0 = 0; b0 < nitems; b0 += BATCH) {
        int nb = (int)(nitems - b0 < BATCH ? nitems - b0 : BATCH);
        KPL_TRY_GOTO(convert_batch(root, items + b0, nb, &o, o.threads, batch, w, &nskip));
        KPL_TRY_GOTO(kpl__progress_update(&pr, (uint64_t)(b0 + nb), (uint64_t)nitems, "images"));
    }
    if (kpl_record_writer_count(w) == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "imagefolder %s: every image was bad", root);
        goto fail;
    }
    int64_t written = kpl_record_writer_count(w);
    kpl_record_writer *done = w;
    w = NULL;
    KPL_TRY_GOTO(kpl_record_writer_close(done));
    KPL_TRY_GOTO(kpl__write_lines(out_dir, "classes.txt", classes, ncls));
    if (count) *count = written;
    if (skipped) *skipped = nskip;
fail:
    kpl_record_writer_destroy(w);
    for (int64_t i = 0; i < nitems; i++) free(items[i].rel);
    free(items);
    for (int64_t i = 0; i < ncls; i++) free(classes[i]);
    free(classes);
    free(batch);
    free(attrs);
    return st;
}
