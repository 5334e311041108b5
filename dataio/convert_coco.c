/*
 * convert_coco.c — a COCO instances JSON and its images to KPLRecord
 * detection examples (docs/detection-data.md; the schema is
 * docs/kplrecord.md's "Detection examples").
 *
 * The JSON is read whole with jansson and checked in two layers.  Its
 * structure — an object with lists "images", "categories" and (optionally)
 * "annotations", every entry an object with an integer "id", no id twice —
 * is an error whatever the options, naming the place: a file that breaks it
 * is not a COCO file.  Within that structure each annotation and each image
 * is checked on its own, and a bad one is an error naming its id or, with
 * skip_bad, left out with a warning.  Annotations are checked here in JSON
 * order; images (file present, decoding whole, of the size the JSON says)
 * by the detection writer (convert_det.c), in image id order, which is the
 * example order.
 */
#include "convert_impl.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct {
    int64_t id;
    const char *name; /* borrowed from the JSON */
    const json_t *entry;
} coco_cat;

typedef struct {
    int64_t id;
    size_t index; /* position in "images" */
} id_ref;

static int cmp_cat(const void *a, const void *b)
{
    int64_t x = ((const coco_cat *)a)->id, y = ((const coco_cat *)b)->id;
    return (x > y) - (x < y);
}

static int cmp_ref(const void *a, const void *b)
{
    int64_t x = ((const id_ref *)a)->id, y = ((const id_ref *)b)->id;
    return (x > y) - (x < y);
}

static int cmp_image(const void *a, const void *b)
{
    int64_t x = ((const kpl__det_image *)a)->id, y = ((const kpl__det_image *)b)->id;
    return (x > y) - (x < y);
}

/* An integer member of an object, or false. */
static bool int_member(const json_t *o, const char *key, int64_t *v)
{
    const json_t *j = json_object_get(o, key);
    if (!json_is_integer(j)) return false;
    *v = json_integer_value(j);
    return true;
}

static bool finite_num(const json_t *j, double *v)
{
    if (json_is_integer(j)) *v = (double)json_integer_value(j);
    else if (json_is_real(j)) *v = json_real_value(j);
    else return false;
    return isfinite(*v);
}

/* The JSON type of j, for messages. */
static const char *type_name(const json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "a list";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

/* root's member `key`: a list (NULL when absent and optional). */
static kpl_status list_member(const char *path, const json_t *root, const char *key,
                              bool optional, const json_t **out)
{
    const json_t *j = json_object_get(root, key);
    *out = j;
    if (!j && optional) return KPL_OK;
    KPL_CHECK(j, KPL_EFORMAT, "coco: %s: no \"%s\" list: not a COCO instances file", path, key);
    KPL_CHECK(json_is_array(j), KPL_EFORMAT, "coco: %s: \"%s\" is %s, not a list", path, key,
              type_name(j));
    return KPL_OK;
}

/* Every entry of list `key` must be an object with an integer "id", and no
 * id may appear twice: *refs (malloc'd) receives them sorted. */
static kpl_status sorted_ids(const char *path, const json_t *list, const char *key,
                             id_ref **refs)
{
    size_t n = json_array_size(list);
    id_ref *r = malloc(sizeof *r * (n ? n : 1));
    KPL_CHECK(r, KPL_ENOMEM, "coco: no memory for %zu %s", n, key);
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_array_get(list, i);
        int64_t id;
        if (!json_is_object(e) || !int_member(e, "id", &id)) {
            free(r);
            return KPL_ERROR(KPL_EFORMAT, "coco: %s: %s[%zu] is %s%s", path, key, i,
                             type_name(e), json_is_object(e) ? " without an integer \"id\"" : "");
        }
        r[i] = (id_ref){id, i};
    }
    qsort(r, n, sizeof *r, cmp_ref);
    for (size_t i = 1; i < n; i++)
        if (r[i].id == r[i - 1].id) {
            int64_t id = r[i].id;
            size_t a = r[i - 1].index < r[i].index ? r[i - 1].index : r[i].index;
            size_t b = r[i - 1].index < r[i].index ? r[i].index : r[i - 1].index;
            free(r);
            return KPL_ERROR(KPL_EFORMAT, "coco: %s: %s[%zu] and %s[%zu] have the same id %lld",
                             path, key, a, key, b, (long long)id);
        }
    *refs = r;
    return KPL_OK;
}

/* The categories, sorted by id (label = position). */
static kpl_status read_categories(const char *path, const json_t *list, coco_cat **out,
                                  int64_t *n)
{
    id_ref *refs = NULL;
    KPL_TRY(sorted_ids(path, list, "categories", &refs));
    size_t m = json_array_size(list);
    free(refs);
    KPL_CHECK(m > 0, KPL_EFORMAT, "coco: %s: \"categories\" is empty", path);
    coco_cat *c = malloc(sizeof *c * m);
    KPL_CHECK(c, KPL_ENOMEM, "coco: no memory for %zu categories", m);
    for (size_t i = 0; i < m; i++) {
        const json_t *e = json_array_get(list, i);
        const json_t *name = json_object_get(e, "name");
        if (!json_is_string(name) || strchr(json_string_value(name), '\n')) {
            free(c);
            return KPL_ERROR(KPL_EFORMAT, "coco: %s: categories[%zu] (id %lld) has no \"name\" "
                             "string of one line", path, i,
                             (long long)json_integer_value(json_object_get(e, "id")));
        }
        c[i] = (coco_cat){json_integer_value(json_object_get(e, "id")), json_string_value(name), e};
    }
    qsort(c, m, sizeof *c, cmp_cat);
    *out = c;
    *n = (int64_t)m;
    return KPL_OK;
}

static int64_t find_cat(const coco_cat *c, int64_t n, int64_t id)
{
    coco_cat key = {id, NULL, NULL};
    const coco_cat *f = bsearch(&key, c, (size_t)n, sizeof *c, cmp_cat);
    return f ? f - c : -1;
}

static int64_t find_image(const kpl__det_image *im, int64_t n, int64_t id)
{
    kpl__det_image key = {.id = id};
    const kpl__det_image *f = bsearch(&key, im, (size_t)n, sizeof *im, cmp_image);
    return f ? f - im : -1;
}

/* The images, sorted by id; a bad entry is reported (error, or skip with
 * a warning) and marked bad. */
static kpl_status read_images(const char *path, const json_t *list, const kpl_convert_options *o,
                              kpl__det_image **out, int64_t *n, kpl_detection_stats *sts)
{
    id_ref *refs = NULL;
    KPL_TRY(sorted_ids(path, list, "images", &refs));
    size_t m = json_array_size(list);
    kpl__det_image *im = calloc(m ? m : 1, sizeof *im);
    if (!im) {
        free(refs);
        return KPL_ERROR(KPL_ENOMEM, "coco: no memory for %zu images", m);
    }
    kpl_status st = KPL_OK;
    *out = im;
    *n = (int64_t)m;
    for (size_t i = 0; i < m && st == KPL_OK; i++) {
        const json_t *e = json_array_get(list, refs[i].index);
        kpl__det_image *d = &im[i];
        d->id = refs[i].id;
        const json_t *file = json_object_get(e, "file_name");
        char why[200] = "";
        if (!json_is_string(file) || !json_string_length(file))
            snprintf(why, sizeof why, "no \"file_name\" string");
        else if (!int_member(e, "width", &d->width) || !int_member(e, "height", &d->height) ||
                 d->width < 1 || d->height < 1)
            snprintf(why, sizeof why, "no positive integer \"width\" and \"height\"");
        else if (d->width > (1 << 28) / d->height)
            snprintf(why, sizeof why, "%lld x %lld is more than the loader's 2^28 pixels",
                     (long long)d->width, (long long)d->height);
        else if (!(d->file = strdup(json_string_value(file))))
            st = KPL_ERROR(KPL_ENOMEM, "coco: no memory");
        if (why[0]) {
            d->bad = true;
            st = kpl__convert_bad(o, false, &sts->skipped_images, "coco: %s: image %lld "
                                  "(images[%zu]): %s", path, (long long)d->id,
                                  refs[i].index, why);
        }
    }
    free(refs);
    return st;
}

/* Checks one annotation against its image; fills ob or says why not. */
static bool read_annotation(const json_t *e, const kpl__det_image *img, double tol,
                            kpl__det_obj *ob, kpl_detection_stats *sts, char *why, size_t n)
{
    const json_t *bbox = json_object_get(e, "bbox");
    double b[4];
    bool ok = json_is_array(bbox) && json_array_size(bbox) == 4;
    for (size_t k = 0; k < 4 && ok; k++) ok = finite_num(json_array_get(bbox, k), &b[k]);
    if (!ok) {
        snprintf(why, n, "no \"bbox\" of four finite numbers [x, y, width, height]");
        return false;
    }
    if (b[2] <= 0 || b[3] <= 0) {
        snprintf(why, n, "bbox [%g, %g, %g, %g] has zero or negative %s", b[0], b[1], b[2], b[3],
                 b[2] <= 0 ? "width" : "height");
        return false;
    }
    double W = (double)img->width, H = (double)img->height;
    double x0 = b[0], y0 = b[1], x1 = b[0] + b[2], y1 = b[1] + b[3];
    if (x0 < -tol || y0 < -tol || x1 > W + tol || y1 > H + tol) {
        snprintf(why, n, "bbox [%g, %g, %g, %g] reaches outside the %lld x %lld image by more "
                 "than %g pixel", b[0], b[1], b[2], b[3], (long long)img->width,
                 (long long)img->height, tol);
        return false;
    }
    bool clipped = x0 < 0 || y0 < 0 || x1 > W || y1 > H;
    x0 = x0 < 0 ? 0 : x0;
    y0 = y0 < 0 ? 0 : y0;
    x1 = x1 > W ? W : x1;
    y1 = y1 > H ? H : y1;
    if (x1 <= x0 || y1 <= y0) {
        snprintf(why, n, "bbox [%g, %g, %g, %g] has no area inside the %lld x %lld image", b[0],
                 b[1], b[2], b[3], (long long)img->width, (long long)img->height);
        return false;
    }
    ob->box[0] = (float)x0;
    ob->box[1] = (float)y0;
    ob->box[2] = (float)x1;
    ob->box[3] = (float)y1;
    const json_t *crowd = json_object_get(e, "iscrowd");
    if (!crowd) ob->flag = 0;
    else if (json_is_boolean(crowd)) ob->flag = json_is_true(crowd);
    else if (json_is_integer(crowd) && (json_integer_value(crowd) == 0 ||
                                        json_integer_value(crowd) == 1))
        ob->flag = json_integer_value(crowd);
    else {
        snprintf(why, n, "\"iscrowd\" is not 0 or 1");
        return false;
    }
    const json_t *area = json_object_get(e, "area");
    double a = -1;
    if (area && (!finite_num(area, &a) || a <= 0)) {
        snprintf(why, n, "\"area\" %s", finite_num(area, &a) ? "is not positive"
                                                           : "is not a finite number");
        return false;
    }
    ob->area = (float)a;
    const json_t *seg = json_object_get(e, "segmentation");
    int64_t parts = 0, dropped = 0;
    if (!kpl__coco_seg_check(seg, img->height, img->width, tol, &parts, &dropped, why, n))
        return false;
    ob->seg = parts ? seg : NULL;
    sts->dropped_polygons += dropped;
    sts->clipped_boxes += clipped;
    return true;
}

/* The annotations, checked, grouped by image (JSON order within an image):
 * *objs (malloc'd), and each image's first/count. */
static kpl_status read_annotations(const char *path, const json_t *list, const coco_cat *cats,
                                   int64_t ncat, kpl__det_image *im, int64_t nim,
                                   const kpl_convert_options *o, kpl__det_obj **objs,
                                   int64_t *nobjs, kpl_detection_stats *sts)
{
    size_t m = json_array_size(list);
    *objs = NULL;
    *nobjs = 0;
    if (m == 0) return KPL_OK; /* the ids were checked before (sorted_ids) */
    kpl__det_obj *all = malloc(sizeof *all * m), *grouped = NULL;
    int64_t *img_of = malloc(sizeof *img_of * m);
    kpl_status st = KPL_OK;
    if (!all || !img_of) {
        st = KPL_ERROR(KPL_ENOMEM, "coco: no memory for %zu annotations", m);
        goto fail;
    }
    int64_t k = 0;
    for (size_t i = 0; i < m && st == KPL_OK; i++) {
        const json_t *e = json_array_get(list, i);
        int64_t id = json_integer_value(json_object_get(e, "id")), iid = -1, cid = -1, ii = -1;
        char why[400] = "";
        kpl__det_obj ob = {.annotation_id = id};
        bool has_img = int_member(e, "image_id", &iid);
        if (!has_img) snprintf(why, sizeof why, "no integer \"image_id\"");
        else if ((ii = find_image(im, nim, iid)) < 0)
            snprintf(why, sizeof why, "image id %lld is not in \"images\"", (long long)iid);
        else if (im[ii].bad) { /* its image was left out, and said so */
            sts->skipped_objects++;
            continue;
        } else if (!int_member(e, "category_id", &cid))
            snprintf(why, sizeof why, "no integer \"category_id\"");
        else if ((ob.label = find_cat(cats, ncat, cid)) < 0)
            snprintf(why, sizeof why, "category id %lld is not in \"categories\"", (long long)cid);
        else if (read_annotation(e, &im[ii], KPL_DET_BOX_TOLERANCE, &ob, sts, why, sizeof why)) {
            ob.category_id = cid;
            img_of[k] = ii;
            all[k++] = ob;
            continue;
        }
        char img_part[48] = "";
        if (has_img) snprintf(img_part, sizeof img_part, ", image %lld", (long long)iid);
        st = kpl__convert_bad(o, false, &sts->skipped_objects, "coco: %s: annotation %lld "
                              "(annotations[%zu]%s): %s", path, (long long)id, i, img_part, why);
        if (ii >= 0) im[ii].skipped_objs++;
    }
    if (st < 0) goto fail;
    /* Group by image, keeping the JSON order within each. */
    grouped = malloc(sizeof *grouped * (size_t)(k ? k : 1));
    if (!grouped) {
        st = KPL_ERROR(KPL_ENOMEM, "coco: no memory for %lld annotations", (long long)k);
        goto fail;
    }
    for (int64_t i = 0; i < k; i++) im[img_of[i]].count++;
    int64_t at = 0;
    for (int64_t i = 0; i < nim; i++) {
        im[i].first = at;
        at += im[i].count;
        im[i].count = 0;
    }
    for (int64_t i = 0; i < k; i++) {
        kpl__det_image *d = &im[img_of[i]];
        grouped[d->first + d->count++] = all[i];
    }
    *objs = grouped;
    *nobjs = k;
    grouped = NULL;
fail:
    free(grouped);
    free(all);
    free(img_of);
    return st;
}

/* METADATA's attributes and categories.json's text. */
static kpl_status describe(const char *path, const char *image_dir, const coco_cat *cats,
                           int64_t ncat, bool semantic, char **attrs, char **catjson)
{
    json_t *ids = json_array(), *list = json_array();
    for (int64_t i = 0; ids && list && i < ncat; i++) {
        json_array_append_new(ids, json_integer(cats[i].id));
        json_t *c = json_pack("{s:I, s:I, s:s}", "label", (json_int_t)i, "id",
                              (json_int_t)cats[i].id, "name", cats[i].name);
        const json_t *sup = json_object_get(cats[i].entry, "supercategory");
        if (c && json_is_string(sup)) json_object_set(c, "supercategory", (json_t *)sup);
        json_array_append_new(list, c);
    }
    json_t *a = json_pack("{s:s, s:s, s:s, s:I, s:s, s:s, s:O, s:s, s:s, s:f, s:s}", "source",
                          "coco", "annotations", path, "images", image_dir, "num_classes",
                          (json_int_t)ncat, "classes_file", "classes.txt", "categories_file",
                          "categories.json", "category_ids", ids, "box_format",
                          "x0 y0 x1 y1 pixels", "mask_encoding", "coco_rle", "box_tolerance",
                          KPL_DET_BOX_TOLERANCE, "order", "image_id");
    if (a && semantic) {
        json_object_set_new(a, "semantic_mask", json_string("mask: 0 background, label + 1, 255 "
                                                            "crowd and overlaps of classes"));
        json_object_set_new(a, "ignore_index", json_integer(255));
    }
    *attrs = a ? json_dumps(a, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    *catjson = list ? json_dumps(list, JSON_INDENT(1) | JSON_PRESERVE_ORDER) : NULL;
    json_decref(a);
    json_decref(ids);
    json_decref(list);
    KPL_CHECK(*attrs && *catjson, KPL_ENOMEM, "coco: no memory (or a path is not UTF-8)");
    return KPL_OK;
}

kpl_status kpl_convert_coco(const char *annotations_json, const char *image_dir,
                            const char *out_dir, const kpl_convert_options *opt,
                            kpl_detection_stats *stats)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    if (opt) o = *opt;
    kpl_detection_stats sts = {0};
    const char *path = annotations_json;
    kpl_status st = KPL_OK;
    coco_cat *cats = NULL;
    kpl__det_image *im = NULL;
    kpl__det_obj *objs = NULL;
    char **classes = NULL, *attrs = NULL, *catjson = NULL;
    int64_t ncat = 0, nim = 0, nobjs = 0;
    json_error_t err;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &err);
    if (!root) {
        if (json_error_code(&err) == json_error_cannot_open_file)
            return KPL_ERROR(access(path, F_OK) ? KPL_ENOTFOUND : KPL_EIO, "coco: %s", err.text);
        return KPL_ERROR(KPL_EFORMAT, "coco: %s:%d:%d: %s", path, err.line, err.column, err.text);
    }
    if (!json_is_object(root)) {
        st = KPL_ERROR(KPL_EFORMAT, "coco: %s: the file is %s, not a COCO object", path,
                       type_name(root));
        goto fail;
    }
    const json_t *jimages, *jcats, *janns;
    KPL_TRY_GOTO(list_member(path, root, "images", false, &jimages));
    KPL_TRY_GOTO(list_member(path, root, "categories", false, &jcats));
    KPL_TRY_GOTO(list_member(path, root, "annotations", true, &janns));
    KPL_TRY_GOTO(read_categories(path, jcats, &cats, &ncat));
    if (janns) { /* its structure first: a malformed file is refused before any report */
        id_ref *refs = NULL;
        KPL_TRY_GOTO(sorted_ids(path, janns, "annotations", &refs));
        free(refs);
    }
    KPL_TRY_GOTO(read_images(path, jimages, &o, &im, &nim, &sts));
    KPL_TRY_GOTO(read_annotations(path, janns, cats, ncat, im, nim, &o, &objs, &nobjs, &sts));
    classes = malloc(sizeof *classes * (size_t)ncat);
    if (!classes) {
        st = KPL_ERROR(KPL_ENOMEM, "coco: no memory");
        goto fail;
    }
    for (int64_t i = 0; i < ncat; i++) classes[i] = (char *)cats[i].name;
    if (o.semantic && ncat > 254) {
        st = KPL_ERROR(KPL_EINVAL, "coco: %s: %lld categories: a semantic mask holds at most "
                       "254 (label + 1; 0 is background, 255 ignore)", path, (long long)ncat);
        goto fail;
    }
    KPL_TRY_GOTO(describe(path, image_dir, cats, ncat, o.semantic, &attrs, &catjson));
    kpl__det_set set = {KPL__DET_COCO, image_dir, im, nim, objs, nobjs, classes, ncat, attrs,
                        catjson};
    st = kpl__det_write(&set, out_dir, &o, &sts);
fail:
    if (stats) *stats = sts;
    for (int64_t i = 0; i < nim; i++) free(im[i].file);
    free(im);
    free(objs);
    free(cats);
    free(classes);
    free(attrs);
    free(catjson);
    json_decref(root);
    return st;
}
