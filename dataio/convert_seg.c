/*
 * convert_seg.c — semantic segmentation sets to KPLRecord
 * (docs/segmentation-data.md): Pascal VOC's SegmentationClass (and the
 * SBD "aug" layout), and any folder of images with a folder of masks
 * matched by file stem.  One example per image: the image's bytes, its
 * mask as a PNG, the path, height and width.
 *
 * Every image is checked whole with the loader's decoder and every mask
 * with the loader's mask decoder, in parallel, in batches appended in
 * order, so the result does not depend on the thread count; a bad pair is
 * an error naming its files or, under skip_bad, a warning and a count.
 * Masks are stored as they are (8-bit or lower gray, palette: the loader
 * reads the indices), except 16-bit gray masks, re-encoded as 8-bit gray
 * (every value must fit: a mask is u8 in a batch).
 */
#include "convert_impl.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>
#include <unistd.h>

/* ---- the writer ---------------------------------------------------------------- */

typedef struct {
    kpl__loaded_image img;
    kpl__loaded_mask mask;
} seg_done;

typedef struct {
    const kpl__seg_set *s;
    const kpl__seg_item *items; /* the batch's */
    seg_done *done;
} seg_job;

static void check_pair(int64_t i, kpl__codec *c, void *ctx)
{
    seg_job *j = ctx;
    const kpl__seg_item *it = &j->items[i];
    seg_done *d = &j->done[i];
    memset(&d->mask, 0, sizeof d->mask);
    kpl__load_image(it->image, 0, 0, c, &d->img);
    if (d->img.why[0]) return;
    if (d->img.info.orientation != 1) {
        snprintf(d->img.why, sizeof d->img.why, "its EXIF orientation %d turns it upright, but "
                 "its mask is of the stored pixels: strip the orientation (e.g. exiftool "
                 "-Orientation=) or rotate the mask with it", d->img.info.orientation);
        return;
    }
    kpl__load_mask(it->mask, it->image, d->img.info.width, d->img.info.height,
                   j->s->num_classes, c, &d->mask);
}

/* "jpeg" when every image file's name says JPEG, "png" when every one
 * says PNG, else "" (the loader sniffs). */
static const char *image_encoding(const kpl__seg_set *s)
{
    int64_t njpeg = 0, npng = 0;
    for (int64_t i = 0; i < s->n; i++) {
        const char *dot = strrchr(s->items[i].image, '.');
        njpeg += dot && (!strcasecmp(dot, ".jpg") || !strcasecmp(dot, ".jpeg"));
        npng += dot && !strcasecmp(dot, ".png");
    }
    return njpeg == s->n ? "jpeg" : npng == s->n ? "png" : "";
}

kpl_status kpl__seg_write(const kpl__seg_set *s, const char *out_dir,
                          const kpl_convert_options *o, int64_t *count, int64_t *skipped)
{
    enum { BATCH = 256 };
    KPL_CHECK(o->max_side == 0, KPL_EINVAL, "%s: max_side %d would re-encode images at a size "
              "other than their masks': segmentation sets keep their images as they are",
              s->src, o->max_side);
    KPL_CHECK(s->n > 0, KPL_EFORMAT, "%s: no image to write", s->src);
    kpl_status st = KPL_OK;
    int64_t nskip = 0;
    seg_done *done = calloc(BATCH, sizeof *done);
    kpl_record_writer *w = NULL;
    KPL_CHECK(done, KPL_ENOMEM, "%s: no memory", s->src);
    kpl_feature_spec schema[5] = {
        {.name = "image", .type = KPL_FEATURE_BYTES},
        {.name = "mask", .type = KPL_FEATURE_BYTES, .encoding = "png"},
        {.name = "path", .type = KPL_FEATURE_STRING},
        {.name = "height", .type = KPL_FEATURE_INT64, .ndim = 1, .shape = {1}},
        {.name = "width", .type = KPL_FEATURE_INT64, .ndim = 1, .shape = {1}},
    };
    strcpy(schema[0].encoding, image_encoding(s));
    kpl_record_writer_config wc = o->writer;
    wc.attributes_json = s->attributes;
    KPL_TRY_GOTO(kpl_record_writer_create(out_dir, 5, schema, &wc, &w));
    kpl__progress pr;
    kpl__progress_init(&pr, o, out_dir);
    for (int64_t b0 = 0; b0 < s->n; b0 += BATCH) {
        int64_t nb = s->n - b0 < BATCH ? s->n - b0 : BATCH;
        seg_job job = {s, s->items + b0, done};
        kpl__convert_parallel(nb, o->threads, check_pair, &job);
        for (int64_t i = 0; i < nb && st == KPL_OK; i++) {
            const kpl__seg_item *it = &s->items[b0 + i];
            const seg_done *d = &done[i];
            if (d->img.why[0] || d->mask.why[0]) {
                bool img = d->img.why[0] != 0;
                st = kpl__convert_bad(o, img ? d->img.fatal : d->mask.fatal, &nskip,
                                      "%s: %s: %s%s%s%s", s->src, it->path, img ? "image " : "",
                                      img ? it->image : "", img ? ": " : "",
                                      img ? d->img.why : d->mask.why);
                continue;
            }
            int64_t h = d->img.info.height, wd = d->img.info.width;
            kpl_feature_value v[5] = {
                {d->img.bytes, (uint32_t)d->img.len},
                {d->mask.bytes, (uint32_t)d->mask.len},
                {it->path, (uint32_t)strlen(it->path)},
                {&h, 1},
                {&wd, 1},
            };
            st = kpl_record_writer_add(w, v);
        }
        for (int64_t i = 0; i < nb; i++) {
            free(done[i].img.bytes);
            free(done[i].mask.bytes);
            memset(&done[i], 0, sizeof done[i]);
        }
        if (st < 0) goto fail;
        KPL_TRY_GOTO(kpl__progress_update(&pr, (uint64_t)(b0 + nb), (uint64_t)s->n, "images"));
    }
    int64_t written = kpl_record_writer_count(w);
    if (written == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: every image was bad", s->src);
        goto fail;
    }
    kpl_record_writer *fin = w;
    w = NULL;
    KPL_TRY_GOTO(kpl_record_writer_close(fin));
    if (s->classes)
        KPL_TRY_GOTO(kpl__write_lines(out_dir, "classes.txt", s->classes, s->num_classes));
    if (count) *count = written;
    if (skipped) *skipped = nskip;
fail:
    kpl_record_writer_destroy(w);
    free(done);
    return st;
}

static void free_items(kpl__seg_item *items, int64_t n)
{
    for (int64_t i = 0; items && i < n; i++) {
        free(items[i].image);
        free(items[i].mask);
        free(items[i].path);
    }
    free(items);
}

/* "a/b" into a new string; NULL on OOM. */
static char *join(const char *a, const char *b)
{
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", a, b);
    return p;
}

/* ---- Pascal VOC ------------------------------------------------------------------ */

static const char *const voc_seg_classes[21] = {
    "background", "aeroplane", "bicycle", "bird",  "boat",        "bottle", "bus",
    "car",        "cat",       "chair",   "cow",   "diningtable", "dog",    "horse",
    "motorbike",  "person",    "pottedplant", "sheep", "sofa",    "train",  "tvmonitor",
};

/* How many of the ids have root/dir/<id>.png. */
static int64_t masks_present(const char *root, const char *dir, char *const *ids, int64_t n)
{
    int64_t k = 0;
    char p[PATH_MAX];
    for (int64_t i = 0; i < n; i++) {
        snprintf(p, sizeof p, "%s/%s/%s.png", root, dir, ids[i]);
        k += access(p, R_OK) == 0;
    }
    return k;
}

kpl_status kpl_convert_voc_seg(const char *voc_root, const char *split, const char *masks_dir,
                               const char *out_dir, const kpl_convert_options *opt,
                               int64_t *count, int64_t *skipped)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    if (opt) o = *opt;
    KPL_CHECK(split && split[0] && !strchr(split, '/'), KPL_EINVAL,
              "voc-seg: the split must be a plain name such as train, val, trainval or "
              "train_aug");
    KPL_CHECK(!masks_dir || (masks_dir[0] && !strchr(masks_dir, '/')), KPL_EINVAL,
              "voc-seg: the masks directory must be a plain name under the VOC root, such as "
              "SegmentationClass or SegmentationClassAug");
    char p[PATH_MAX], *list = NULL, *attrs = NULL, **ids = NULL;
    kpl__seg_item *items = NULL;
    int64_t nids = 0;
    kpl_status st = KPL_OK;
    snprintf(p, sizeof p, "%s/ImageSets/Segmentation/%s.txt", voc_root, split);
    KPL_TRY(kpl__read_file(p, &list, NULL));
    int64_t lines = 1;
    for (const char *c = list; *c; c++) lines += *c == '\n';
    ids = calloc((size_t)lines, sizeof *ids);
    items = calloc((size_t)lines, sizeof *items);
    if (!ids || !items) {
        st = KPL_ERROR(KPL_ENOMEM, "voc-seg: no memory for %lld images", (long long)lines);
        goto fail;
    }
    /* One id a line (its first word). */
    for (char *line = list, *next; line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *e = line + strspn(line, " \t\r");
        e[strcspn(e, " \t\r")] = 0;
        if (*e) ids[nids++] = e;
    }
    if (nids == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "voc-seg: %s lists no image", p);
        goto fail;
    }
    /* The masks: the directory given, else the first of VOC's own and
     * SBD's "aug" set that holds every listed id's mask, else the first
     * that exists (the missing masks then each a bad item). */
    const char *dir = masks_dir;
    if (!dir) {
        static const char *const cands[2] = {"SegmentationClass", "SegmentationClassAug"};
        int64_t have[2];
        for (int k = 0; k < 2 && !dir; k++)
            if ((have[k] = masks_present(voc_root, cands[k], ids, nids)) == nids) dir = cands[k];
        for (int k = 0; k < 2 && !dir; k++) {
            snprintf(p, sizeof p, "%s/%s", voc_root, cands[k]);
            if (access(p, F_OK) == 0) dir = cands[k];
        }
        if (!dir) {
            st = KPL_ERROR(KPL_ENOTFOUND, "voc-seg: %s holds neither SegmentationClass/ nor "
                           "SegmentationClassAug/ (name the masks' directory with --masks-dir)",
                           voc_root);
            goto fail;
        }
    }
    for (int64_t i = 0; i < nids; i++) {
        char rel[PATH_MAX];
        kpl__seg_item *it = &items[i];
        snprintf(rel, sizeof rel, "JPEGImages/%s.jpg", ids[i]);
        it->image = join(voc_root, rel);
        it->path = strdup(rel);
        snprintf(rel, sizeof rel, "%s/%s.png", dir, ids[i]);
        it->mask = join(voc_root, rel);
        if (!it->image || !it->path || !it->mask) {
            st = KPL_ERROR(KPL_ENOMEM, "voc-seg: no memory");
            goto fail;
        }
    }
    json_t *a = json_pack("{s:s, s:s, s:s, s:s, s:i, s:s, s:i, s:s}", "source", "voc-seg", "root",
                          voc_root, "split", split, "masks_dir", dir, "num_classes", 21,
                          "classes_file", "classes.txt", "ignore_index", 255, "order",
                          "split file");
    attrs = a ? json_dumps(a, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(a);
    if (!attrs) {
        st = KPL_ERROR(KPL_ENOMEM, "voc-seg: no memory (or a path is not UTF-8)");
        goto fail;
    }
    kpl__seg_set set = {"voc-seg", items, nids, (char *const *)voc_seg_classes, 21, attrs};
    st = kpl__seg_write(&set, out_dir, &o, count, skipped);
fail:
    free_items(items, nids);
    free(ids);
    free(list);
    free(attrs);
    return st;
}

/* ---- a folder of images and a folder of masks ---------------------------------------- */

/* The length of name's stem (up to its last dot). */
static size_t stem_len(const char *name)
{
    const char *dot = strrchr(name, '.');
    return dot ? (size_t)(dot - name) : strlen(name);
}

static int cmp_stem(const char *a, const char *b)
{
    size_t la = stem_len(a), lb = stem_len(b);
    int c = memcmp(a, b, la < lb ? la : lb);
    return c ? c : la < lb ? -1 : la > lb;
}

static int cmp_name(const void *a, const void *b)
{
    const char *x = *(char *const *)a, *y = *(char *const *)b;
    int c = cmp_stem(x, y);
    return c ? c : strcmp(x, y);
}

/* Reads a class list: one name a line, blank lines ignored. */
static kpl_status read_classes(const char *path, char **text, char ***names, int64_t *n)
{
    size_t len = 0;
    KPL_TRY(kpl__read_file(path, text, &len));
    int64_t lines = 1;
    for (const char *c = *text; *c; c++) lines += *c == '\n';
    *names = calloc((size_t)lines, sizeof **names);
    KPL_CHECK(*names, KPL_ENOMEM, "masks: no memory for %s", path);
    *n = 0;
    for (char *line = *text, *next; line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        size_t k = strlen(line);
        while (k && (line[k - 1] == '\r' || line[k - 1] == ' ' || line[k - 1] == '\t')) line[--k] = 0;
        if (k) (*names)[(*n)++] = line;
    }
    KPL_CHECK(*n >= 1 && *n <= 255, KPL_EFORMAT, "masks: %s holds %lld class names: want 1 to "
              "255 (255 is the ignore value)", path, (long long)*n);
    return KPL_OK;
}

kpl_status kpl_convert_masks(const char *image_dir, const char *mask_dir,
                             const char *classes_file, const char *out_dir,
                             const kpl_convert_options *opt, int64_t *count, int64_t *skipped)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    if (opt) o = *opt;
    kpl_status st = KPL_OK;
    char **imgs = NULL, **masks = NULL, **classes = NULL, *ctext = NULL, *attrs = NULL;
    int64_t ni = 0, nm = 0, ncls = 0, nitems = 0, nskip = 0;
    kpl__seg_item *items = NULL;
    if (classes_file) KPL_TRY_GOTO(read_classes(classes_file, &ctext, &classes, &ncls));
    KPL_TRY_GOTO(kpl__list_dir("masks", image_dir, false, &imgs, &ni));
    KPL_TRY_GOTO(kpl__list_dir("masks", mask_dir, false, &masks, &nm));
    /* masks are PNGs: the other image files of the mask folder are not masks */
    int64_t k = 0;
    for (int64_t i = 0; i < nm; i++) {
        const char *dot = strrchr(masks[i], '.');
        if (dot && !strcasecmp(dot, ".png")) masks[k++] = masks[i];
        else free(masks[i]);
    }
    nm = k;
    if (ni == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "masks: %s holds no .jpg/.jpeg/.png image", image_dir);
        goto fail;
    }
    qsort(imgs, (size_t)ni, sizeof *imgs, cmp_name);
    qsort(masks, (size_t)nm, sizeof *masks, cmp_name);
    for (int64_t i = 1; i < ni; i++)
        if (!cmp_stem(imgs[i - 1], imgs[i])) {
            st = KPL_ERROR(KPL_EFORMAT, "masks: %s/%s and %s/%s have the same stem: which one "
                           "goes with its mask?", image_dir, imgs[i - 1], image_dir, imgs[i]);
            goto fail;
        }
    items = calloc((size_t)(ni ? ni : 1), sizeof *items);
    if (!items) {
        st = KPL_ERROR(KPL_ENOMEM, "masks: no memory for %lld images", (long long)ni);
        goto fail;
    }
    /* A merge of the two sorted lists: a name on one side only is bad. */
    for (int64_t i = 0, j = 0; (i < ni || j < nm) && st == KPL_OK;) {
        int c = i == ni ? 1 : j == nm ? -1 : cmp_stem(imgs[i], masks[j]);
        if (c < 0) {
            st = kpl__convert_bad(&o, false, &nskip, "masks: image %s/%s has no mask %s/%.*s.png",
                                  image_dir, imgs[i], mask_dir, (int)stem_len(imgs[i]), imgs[i]);
            i++;
        } else if (c > 0) {
            st = kpl__convert_bad(&o, false, &nskip, "masks: mask %s/%s has no image in %s "
                                  "(.jpg, .jpeg or .png)", mask_dir, masks[j], image_dir);
            j++;
        } else {
            kpl__seg_item *it = &items[nitems++];
            it->image = join(image_dir, imgs[i]);
            it->mask = join(mask_dir, masks[j]);
            it->path = strdup(imgs[i]);
            if (!it->image || !it->mask || !it->path)
                st = KPL_ERROR(KPL_ENOMEM, "masks: no memory");
            i++, j++;
        }
    }
    if (st < 0) goto fail;
    if (nitems == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "masks: no image of %s has its mask in %s", image_dir,
                       mask_dir);
        goto fail;
    }
    json_t *a = json_pack("{s:s, s:s, s:s, s:s}", "source", "masks", "images", image_dir,
                          "masks", mask_dir, "order", "file stem");
    if (a && classes) {
        json_object_set_new(a, "num_classes", json_integer(ncls));
        json_object_set_new(a, "classes_file", json_string("classes.txt"));
        json_object_set_new(a, "ignore_index", json_integer(255));
    }
    attrs = a ? json_dumps(a, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(a);
    if (!attrs) {
        st = KPL_ERROR(KPL_ENOMEM, "masks: no memory (or a path is not UTF-8)");
        goto fail;
    }
    kpl__seg_set set = {"masks", items, nitems, classes, ncls, attrs};
    int64_t later = 0;
    st = kpl__seg_write(&set, out_dir, &o, count, &later);
    if (st == KPL_OK && skipped) *skipped = nskip + later;
fail:
    free_items(items, nitems);
    for (int64_t i = 0; i < ni; i++) free(imgs[i]);
    for (int64_t i = 0; i < nm; i++) free(masks[i]);
    free(imgs);
    free(masks);
    free(classes);
    free(ctext);
    free(attrs);
    return st;
}
