/*
 * convert_registry.c — one record per converter: its name, the inputs and
 * options it takes, how `kpl data convert` runs it on given paths, and how
 * a recipe's data.convert finds one split of its source.  The CLI and the
 * trainer read this table; neither keeps a list of sources of its own.
 */
#include "dataio_impl.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- running one dataset between the hooks ---- */

typedef kpl_status (*convert_fn)(const char *a, const char *b, const char *c, const char *out,
                                 const kpl_convert_options *o, kpl_convert_result *r);

/* fn(a, b, c) into out, between the caller's hooks. */
static kpl_status one(convert_fn fn, const char *src, const char *a, const char *b, const char *c,
                      const char *out, const kpl_convert_options *o, const kpl_convert_hooks *h)
{
    if (h && h->before) KPL_TRY(h->before(out, h->ctx));
    kpl_convert_options opt = *o;
    opt.label = out;
    kpl_convert_result r = {0};
    double t0 = kpl_seconds();
    KPL_TRY(fn(a, b, c, out, &opt, &r));
    if (h && h->after) h->after(src, out, &r, kpl_seconds() - t0, h->ctx);
    return KPL_OK;
}

/* ---- the converters' calls, in one shape ---- */

static kpl_status do_idx(const char *images, const char *labels, const char *unused,
                         const char *out, const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)unused;
    return kpl_convert_idx(images, labels, out, o, &r->examples);
}

static kpl_status do_cifar(const char *src, const char *split, const char *unused, const char *out,
                           const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)unused;
    return kpl_convert_cifar(src, split, out, o, &r->examples);
}

static kpl_status do_folder(const char *root, const char *unused1, const char *unused2,
                            const char *out, const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)unused1, (void)unused2;
    return kpl_convert_imagefolder(root, out, o, &r->examples, &r->skipped);
}

static kpl_status do_images(const char *root, const char *unused1, const char *unused2,
                            const char *out, const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)unused1, (void)unused2;
    return kpl_convert_images(root, out, o, &r->examples, &r->skipped);
}

static kpl_status do_lmdb(const char *path, const char *unused1, const char *unused2,
                          const char *out, const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)unused1, (void)unused2;
    return kpl_convert_lmdb(path, out, o, &r->examples);
}

static kpl_status do_coco(const char *json, const char *dir, const char *unused, const char *out,
                          const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)unused;
    KPL_TRY(kpl_convert_coco(json, dir, out, o, &r->det));
    r->examples = r->det.images;
    return KPL_OK;
}

static kpl_status do_voc(const char *root, const char *split, const char *unused, const char *out,
                         const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)unused;
    KPL_TRY(kpl_convert_voc(root, split, out, o, &r->det));
    r->examples = r->det.images;
    return KPL_OK;
}

static kpl_status do_voc_seg(const char *root, const char *split, const char *masks_dir,
                             const char *out, const kpl_convert_options *o, kpl_convert_result *r)
{
    return kpl_convert_voc_seg(root, split, masks_dir, out, o, &r->examples, &r->skipped);
}

static kpl_status do_masks(const char *images, const char *masks, const char *classes,
                           const char *out, const kpl_convert_options *o, kpl_convert_result *r)
{
    return kpl_convert_masks(images, masks, classes, out, o, &r->examples, &r->skipped);
}

/* ---- IDX ---- */

/* The labels file that goes with an images file: "images-idx3" -> "labels-idx1". */
static bool labels_for(const char *images, char *out, size_t n)
{
    const char *p = strstr(images, "images-idx3");
    if (!p || strlen(images) >= n) return false;
    size_t k = (size_t)(p - images);
    memcpy(out, images, k);
    snprintf(out + k, n - k, "labels-idx1%s", p + strlen("images-idx3"));
    return access(out, R_OK) == 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool is_dir(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* Every <prefix>-images-idx3-ubyte[.gz] of a directory, sorted (at most
 * 64; names[] malloc'd); *n 0 when none. */
static kpl_status idx_names(const char *src, char **names, int *n)
{
    DIR *d = opendir(src);
    KPL_CHECK(d, KPL_EIO, "%s: %s", src, strerror(errno));
    struct dirent *e;
    *n = 0;
    while ((e = readdir(d)) && *n < 64) {
        const char *p = strstr(e->d_name, "-images-idx3-ubyte");
        if (p && (!strcmp(p, "-images-idx3-ubyte") || !strcmp(p, "-images-idx3-ubyte.gz")))
            if ((names[*n] = strdup(e->d_name))) (*n)++;
    }
    closedir(d);
    qsort(names, (size_t)*n, sizeof *names, cmp_str);
    return KPL_OK;
}

/* An images file of a directory into its images and labels paths and its
 * split: train; t10k is test; else the file's prefix. */
static bool idx_pair(const char *src, const char *name, char *images, char *labels, size_t len,
                     char *split, size_t slen)
{
    snprintf(split, slen, "%.*s", (int)(strstr(name, "-images-idx3") - name), name);
    if (!strcmp(split, "t10k")) snprintf(split, slen, "test");
    snprintf(images, len, "%s/%s", src, name);
    return labels_for(images, labels, len);
}

/* An images file needs its labels (given, or found next to it); a
 * directory needs images files, each with its labels. */
static kpl_status check_idx(const kpl_convert_inputs *in)
{
    struct stat sb;
    KPL_CHECK(stat(in->in[0], &sb) == 0, errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "%s: %s",
              in->in[0], strerror(errno));
    char images[PATH_MAX], labels[PATH_MAX], split[256];
    if (!S_ISDIR(sb.st_mode)) {
        KPL_CHECK(in->labels || labels_for(in->in[0], labels, sizeof labels), KPL_EINVAL,
                  "no labels file next to %s (expected a name with 'labels-idx1' for "
                  "'images-idx3'); give one with --labels", in->in[0]);
        return KPL_OK;
    }
    KPL_CHECK(!in->labels, KPL_EINVAL, "--labels goes with an images file, not a directory");
    char *names[64];
    int n = 0;
    KPL_TRY(idx_names(in->in[0], names, &n));
    kpl_status st = n ? KPL_OK
                      : KPL_ERROR(KPL_EINVAL, "%s holds no *-images-idx3-ubyte[.gz] file",
                                  in->in[0]);
    for (int i = 0; i < n && st >= 0; i++)
        if (!idx_pair(in->in[0], names[i], images, labels, sizeof images, split, sizeof split))
            st = KPL_ERROR(KPL_EINVAL, "no labels file next to %s (expected a name with "
                           "'labels-idx1' for 'images-idx3')", images);
    for (int i = 0; i < n; i++) free(names[i]);
    return st;
}

/* A directory's images files, each into out/<split>. */
static kpl_status idx_dir(const char *src, const char *out, const kpl_convert_options *o,
                          const kpl_convert_hooks *h)
{
    char *names[64];
    int n = 0;
    KPL_TRY(idx_names(src, names, &n));
    kpl_status st = n ? KPL_OK
                      : KPL_ERROR(KPL_EINVAL, "%s holds no *-images-idx3-ubyte[.gz] file", src);
    for (int i = 0; i < n && st >= 0; i++) {
        char images[PATH_MAX], labels[PATH_MAX], split[256], dst[PATH_MAX];
        if (!idx_pair(src, names[i], images, labels, sizeof images, split, sizeof split)) {
            st = KPL_ERROR(KPL_EINVAL, "no labels file next to %s (expected a name with "
                           "'labels-idx1' for 'images-idx3')", images);
            break;
        }
        snprintf(dst, sizeof dst, "%s/%s", out, split);
        st = one(do_idx, images, images, labels, NULL, dst, o, h);
    }
    for (int i = 0; i < n; i++) free(names[i]);
    return st;
}

static kpl_status run_idx(const kpl_convert_inputs *in, const char *out,
                          const kpl_convert_options *o, const kpl_convert_hooks *h)
{
    KPL_TRY(check_idx(in));
    if (is_dir(in->in[0])) return idx_dir(in->in[0], out, o, h);
    char lab[PATH_MAX];
    const char *labels = in->labels;
    if (!labels) {
        labels_for(in->in[0], lab, sizeof lab); /* found: checked */
        labels = lab;
    }
    return one(do_idx, in->in[0], in->in[0], labels, NULL, out, o, h);
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

static kpl_status split_idx(const char *src, const char *path, const char *split, const char *out,
                            const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)path;
    char images[PATH_MAX], labels[PATH_MAX];
    KPL_CHECK(find_idx(src, split, images, labels, sizeof images), KPL_ENOTFOUND,
              "data.convert: no %s-images-idx3-ubyte[.gz] with its labels file in %s%s", split,
              src,
              access(src, F_OK) ? " (the directory does not exist; on Debian install "
                                  "dataset-fashion-mnist, or run scripts/setup.sh)"
                                : "");
    return do_idx(images, labels, NULL, out, o, r);
}

static bool idx_out_holds_splits(const kpl_convert_inputs *in) { return is_dir(in->in[0]); }

/* ---- CIFAR: OUT/train, then OUT/test ---- */

static kpl_status run_cifar(const kpl_convert_inputs *in, const char *out,
                            const kpl_convert_options *o, const kpl_convert_hooks *h)
{
    const char *splits[2] = {"train", "test"};
    for (int k = 0; k < 2; k++) {
        char dst[PATH_MAX];
        snprintf(dst, sizeof dst, "%s/%s", out, splits[k]);
        KPL_TRY(one(do_cifar, in->in[0], in->in[0], splits[k], NULL, dst, o, h));
    }
    return KPL_OK;
}

/* source: the folder of either layout; <split> train, test or val */
static kpl_status split_cifar(const char *src, const char *path, const char *split,
                              const char *out, const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)path;
    return do_cifar(src, split, NULL, out, o, r);
}

static bool always(const kpl_convert_inputs *in) { return (void)in, true; }

/* ---- one directory or file per split: imagefolder, images, lmdb ---- */

#define RUN_ONE_INPUT(name, fn)                                                               \
    static kpl_status run_##name(const kpl_convert_inputs *in, const char *out,                \
                                 const kpl_convert_options *o, const kpl_convert_hooks *h)     \
    {                                                                                          \
        return one(fn, in->in[0], in->in[0], NULL, NULL, out, o, h);                           \
    }                                                                                          \
    static kpl_status split_##name(const char *src, const char *path, const char *split,       \
                                   const char *out, const kpl_convert_options *o,              \
                                   kpl_convert_result *r)                                      \
    {                                                                                          \
        (void)split;                                                                           \
        char in[PATH_MAX];                                                                     \
        snprintf(in, sizeof in, "%s/%s", src, path);                                           \
        return fn(in, NULL, NULL, out, o, r);                                                  \
    }
RUN_ONE_INPUT(imagefolder, do_folder)
RUN_ONE_INPUT(images, do_images)
RUN_ONE_INPUT(lmdb, do_lmdb)

/* ---- detection: coco, voc ---- */

static kpl_status run_coco(const kpl_convert_inputs *in, const char *out,
                           const kpl_convert_options *o, const kpl_convert_hooks *h)
{
    return one(do_coco, in->in[0], in->in[0], in->in[1], NULL, out, o, h);
}

/* source/<split>.json with its images in source/<split>/ (what `kpl data
 * synth fmnist-det` writes) */
static kpl_status split_coco(const char *src, const char *path, const char *split,
                             const char *out, const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)path;
    char json[PATH_MAX], dir[PATH_MAX];
    snprintf(json, sizeof json, "%s/%s.json", src, split);
    snprintf(dir, sizeof dir, "%s/%s", src, split);
    return do_coco(json, dir, NULL, out, o, r);
}

static kpl_status run_voc(const kpl_convert_inputs *in, const char *out,
                          const kpl_convert_options *o, const kpl_convert_hooks *h)
{
    return one(do_voc, in->in[0], in->in[0], in->split, NULL, out, o, h);
}

/* source: the VOC root, <split> its ImageSets/Main list */
static kpl_status split_voc(const char *src, const char *path, const char *split, const char *out,
                            const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)path;
    return do_voc(src, split, NULL, out, o, r);
}

/* ---- segmentation: voc-seg, masks ---- */

static kpl_status run_voc_seg(const kpl_convert_inputs *in, const char *out,
                              const kpl_convert_options *o, const kpl_convert_hooks *h)
{
    return one(do_voc_seg, in->in[0], in->in[0], in->split, in->masks_dir, out, o, h);
}

/* source: the VOC root, <split> its ImageSets/Segmentation list */
static kpl_status split_voc_seg(const char *src, const char *path, const char *split,
                                const char *out, const kpl_convert_options *o,
                                kpl_convert_result *r)
{
    (void)path;
    return do_voc_seg(src, split, NULL, out, o, r);
}

static kpl_status run_masks(const kpl_convert_inputs *in, const char *out,
                            const kpl_convert_options *o, const kpl_convert_hooks *h)
{
    return one(do_masks, in->in[0], in->in[0], in->in[1], in->classes, out, o, h);
}

/* source/<split>/images with source/<split>/masks, and source/classes.txt
 * when there is one (what `kpl data synth fmnist-seg` writes) */
static kpl_status split_masks(const char *src, const char *path, const char *split,
                              const char *out, const kpl_convert_options *o, kpl_convert_result *r)
{
    (void)path;
    char im[PATH_MAX], mk[PATH_MAX], cl[PATH_MAX];
    snprintf(im, sizeof im, "%s/%s/images", src, split);
    snprintf(mk, sizeof mk, "%s/%s/masks", src, split);
    snprintf(cl, sizeof cl, "%s/classes.txt", src);
    return do_masks(im, mk, access(cl, R_OK) ? NULL : cl, out, o, r);
}

/* ---- the table ---- */

#define IMAGE_FILES (KPL_CONVERT_TAKES_SKIP_BAD | KPL_CONVERT_TAKES_MAX_SIDE | \
                     KPL_CONVERT_TAKES_KEEP_ORDER)

static const kpl_converter converters[] = {
    {KPL_CONVERT_IDX, "idx", "SRC", 1, KPL_CONVERT_TAKES_LABELS, check_idx, run_idx, split_idx,
     idx_out_holds_splits},
    {KPL_CONVERT_IMAGEFOLDER, "imagefolder", "SRC", 1, IMAGE_FILES | KPL_CONVERT_REPORTS_SKIPPED,
     NULL, run_imagefolder, split_imagefolder, NULL},
    {KPL_CONVERT_LMDB, "lmdb", "SRC", 1, 0, NULL, run_lmdb, split_lmdb, NULL},
    {KPL_CONVERT_COCO, "coco", "ANNOTATIONS.json, IMAGE_DIR", 2,
     KPL_CONVERT_TAKES_SKIP_BAD | KPL_CONVERT_TAKES_DROP_EMPTY | KPL_CONVERT_TAKES_SEMANTIC |
         KPL_CONVERT_REPORTS_OBJECTS,
     NULL, run_coco, split_coco, NULL},
    {KPL_CONVERT_VOC, "voc", "SRC", 1,
     KPL_CONVERT_TAKES_SPLIT | KPL_CONVERT_TAKES_SKIP_BAD | KPL_CONVERT_TAKES_DROP_EMPTY |
         KPL_CONVERT_REPORTS_OBJECTS,
     NULL, run_voc, split_voc, NULL},
    {KPL_CONVERT_VOC_SEG, "voc-seg", "SRC", 1,
     KPL_CONVERT_TAKES_SPLIT | KPL_CONVERT_TAKES_MASKS_DIR | KPL_CONVERT_TAKES_SKIP_BAD |
         KPL_CONVERT_REPORTS_SKIPPED,
     NULL, run_voc_seg, split_voc_seg, NULL},
    {KPL_CONVERT_MASKS, "masks", "IMAGE_DIR, MASK_DIR", 2,
     KPL_CONVERT_TAKES_CLASSES | KPL_CONVERT_TAKES_SKIP_BAD | KPL_CONVERT_REPORTS_SKIPPED, NULL,
     run_masks, split_masks, NULL},
    {KPL_CONVERT_CIFAR, "cifar", "SRC", 1, 0, NULL, run_cifar, split_cifar, always},
    {KPL_CONVERT_IMAGES, "images", "SRC", 1, IMAGE_FILES | KPL_CONVERT_REPORTS_SKIPPED, NULL,
     run_images, split_images, NULL},
};
/* every source but none has its record (tests/dataio/test_dataio.c) */
enum { NCONVERTERS = sizeof converters / sizeof converters[0] };

int kpl_converter_count(void) { return NCONVERTERS; }

const kpl_converter *kpl_converter_at(int i)
{
    return i >= 0 && i < NCONVERTERS ? &converters[i] : NULL;
}

const kpl_converter *kpl_converter_of(kpl_convert_source s)
{
    for (int i = 0; i < NCONVERTERS; i++)
        if (converters[i].source == s) return &converters[i];
    return NULL;
}

void kpl_converter_names(unsigned takes, char *buf, size_t len)
{
    int n = 0, k = 0;
    for (int i = 0; i < NCONVERTERS; i++) n += (converters[i].flags & takes) == takes;
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < NCONVERTERS && at < len; i++) {
        if ((converters[i].flags & takes) != takes) continue;
        k++;
        const char *sep = k == 1 ? "" : k == n ? " and " : ", ";
        at += (size_t)snprintf(buf + at, len - at, "%s%s", sep, converters[i].name);
    }
}
