/*
 * cocoeval_json.c — COCO's JSON for the evaluation (cocoeval.h): ground
 * truth (instances_*.json) and detection results read, results written.
 * Ground truth goes through the same checks as kpl_coco_gt_create
 * (kpl__coco_gt_build), with the file's name in every message.
 */
#include "cocoeval_impl.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- JSON ------------------------------------------------------------------------------------ */

/* The whole of a file, NUL-terminated (malloc'd). */
static kpl_status read_text(const char *path, char **text, size_t *len)
{
    *text = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return KPL_ERROR(errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "%s: %s", path,
                         strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        char *nb = realloc(buf, cap *= 2);
        if (!nb) free(buf);
        buf = nb;
    }
    int bad = ferror(f);
    fclose(f);
    if (!buf) return KPL_ERROR(KPL_ENOMEM, "%s: out of memory reading the file", path);
    if (bad) {
        free(buf);
        return KPL_ERROR(KPL_EIO, "%s: read error", path);
    }
    buf[n] = 0; /* n < cap: the loop ends on a short read */
    *text = buf;
    *len = n;
    return KPL_OK;
}

static kpl_status parse_json(const char *text, size_t len, const char *name, json_t **out)
{
    json_error_t err;
    *out = json_loadb(text, len, 0, &err);
    KPL_CHECK(*out, KPL_EFORMAT, "%s: line %d, column %d: %s", name, err.line, err.column,
              err.text);
    return KPL_OK;
}

/* An integer field (an integral real is taken too, as Python compares
 * 3.0 == 3): 0, or 1 when missing, 2 when not an integer. */
static int get_int(const json_t *o, const char *key, int64_t *v)
{
    const json_t *x = json_object_get(o, key);
    if (!x) return 1;
    if (json_is_integer(x)) {
        *v = (int64_t)json_integer_value(x);
        return 0;
    }
    double d = json_is_real(x) ? json_real_value(x) : NAN;
    if (!(d == floor(d) && fabs(d) <= 9007199254740992.0)) return 2;
    *v = (int64_t)d;
    return 0;
}

/* "bbox": 4 numbers. */
static bool get_box(const json_t *o, double b[4])
{
    const json_t *x = json_object_get(o, "bbox");
    if (!json_is_array(x) || json_array_size(x) != 4) return false;
    for (size_t i = 0; i < 4; i++) {
        const json_t *e = json_array_get(x, i);
        if (!json_is_number(e)) return false;
        b[i] = json_number_value(e);
    }
    return true;
}

static const char *const int_problem[] = {"", "has no", "has a non-integer"};

/* The "id"s of an array of objects (images or categories). */
static kpl_status get_ids(const json_t *root, const char *key, const char *name, int64_t **ids,
                          int64_t *n)
{
    const json_t *arr = json_object_get(root, key);
    KPL_CHECK(arr, KPL_EFORMAT, "%s: no \"%s\" (a COCO instances file has \"images\", "
              "\"categories\" and \"annotations\")", name, key);
    KPL_CHECK(json_is_array(arr), KPL_EFORMAT, "%s: \"%s\" is not an array", name, key);
    *n = (int64_t)json_array_size(arr);
    *ids = malloc(sizeof **ids * (size_t)(*n ? *n : 1));
    KPL_CHECK(*ids, KPL_ENOMEM, "%s: out of memory", name);
    for (int64_t i = 0; i < *n; i++) {
        const json_t *e = json_array_get(arr, (size_t)i);
        int r = json_is_object(e) ? get_int(e, "id", &(*ids)[i]) : 3;
        if (r) {
            free(*ids);
            *ids = NULL;
            return KPL_ERROR(KPL_EFORMAT, "%s: %s[%lld] %s", name, key, (long long)i,
                             r == 3 ? "is not an object" : r == 1 ? "has no \"id\""
                                                                  : "has a non-integer \"id\"");
        }
    }
    return KPL_OK;
}

static kpl_status get_annotation(const json_t *e, int64_t i, const char *name,
                                 kpl_coco_annotation *a)
{
    KPL_CHECK(json_is_object(e), KPL_EFORMAT, "%s: annotations[%lld] is not an object", name,
              (long long)i);
    int r = get_int(e, "id", &a->id);
    KPL_CHECK(!r, KPL_EFORMAT, "%s: annotations[%lld] %s \"id\"", name, (long long)i,
              int_problem[r]);
    static const char *const keys[] = {"image_id", "category_id"};
    int64_t *dst[] = {&a->image_id, &a->category_id};
    for (int k = 0; k < 2; k++) {
        r = get_int(e, keys[k], dst[k]);
        KPL_CHECK(!r, KPL_EFORMAT, "%s: annotations[%lld] (id %lld) %s \"%s\"", name,
                  (long long)i, (long long)a->id, int_problem[r], keys[k]);
    }
    KPL_CHECK(get_box(e, a->bbox), KPL_EFORMAT,
              "%s: annotations[%lld] (id %lld): \"bbox\" is not an array of 4 numbers", name,
              (long long)i, (long long)a->id);
    const json_t *area = json_object_get(e, "area");
    KPL_CHECK(!area || json_is_number(area), KPL_EFORMAT,
              "%s: annotations[%lld] (id %lld): \"area\" is not a number", name, (long long)i,
              (long long)a->id);
    a->area = area ? json_number_value(area) : a->bbox[2] * a->bbox[3];
    const json_t *crowd = json_object_get(e, "iscrowd");
    json_int_t c = json_is_boolean(crowd) ? json_is_true(crowd)
                   : json_is_integer(crowd) ? json_integer_value(crowd) : crowd ? -1 : 0;
    KPL_CHECK(c == 0 || c == 1, KPL_EFORMAT,
              "%s: annotations[%lld] (id %lld): \"iscrowd\" is not 0, 1, false or true", name,
              (long long)i, (long long)a->id);
    a->iscrowd = (int32_t)c;
    return KPL_OK;
}

static kpl_status gt_from_json(const json_t *root, const char *name, kpl_coco_gt **out)
{
    KPL_CHECK(json_is_object(root), KPL_EFORMAT,
              "%s: not a COCO instances file (want a JSON object with \"images\", "
              "\"categories\" and \"annotations\")", name);
    kpl_status st;
    int64_t *imgs = NULL, *cats = NULL, nimg = 0, ncat = 0, nann = 0;
    kpl_coco_annotation *anns = NULL;
    KPL_TRY_GOTO(get_ids(root, "images", name, &imgs, &nimg));
    KPL_TRY_GOTO(get_ids(root, "categories", name, &cats, &ncat));
    const json_t *arr = json_object_get(root, "annotations");
    if (arr && !json_is_array(arr)) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: \"annotations\" is not an array", name);
        goto fail;
    }
    nann = arr ? (int64_t)json_array_size(arr) : 0;
    anns = malloc(sizeof *anns * (size_t)(nann ? nann : 1));
    if (!anns) {
        st = KPL_ERROR(KPL_ENOMEM, "%s: out of memory for %lld annotations", name,
                       (long long)nann);
        goto fail;
    }
    for (int64_t i = 0; i < nann; i++)
        KPL_TRY_GOTO(get_annotation(json_array_get(arr, (size_t)i), i, name, &anns[i]));
    st = kpl__coco_gt_build(imgs, nimg, cats, ncat, anns, nann, name, KPL_EFORMAT, out);
fail:
    free(anns);
    free(cats);
    free(imgs);
    return st;
}

kpl_status kpl_coco_gt_parse(const char *text, size_t len, const char *name, kpl_coco_gt **out)
{
    KPL_CHECK(out && (text || !len), KPL_EINVAL, "kpl_coco_gt_parse: NULL argument");
    *out = NULL;
    if (!name) name = "ground truth";
    json_t *root;
    KPL_TRY(parse_json(text ? text : "", len, name, &root));
    kpl_status st = gt_from_json(root, name, out);
    json_decref(root);
    return st;
}

kpl_status kpl_coco_gt_load(const char *path, kpl_coco_gt **out)
{
    KPL_CHECK(path && out, KPL_EINVAL, "kpl_coco_gt_load: NULL argument");
    *out = NULL;
    char *text;
    size_t len;
    KPL_TRY(read_text(path, &text, &len));
    kpl_status st = kpl_coco_gt_parse(text, len, path, out);
    free(text);
    return st;
}

kpl_status kpl_coco_dets_parse(const char *text, size_t len, const char *name,
                               kpl_coco_detection **dets, int64_t *n)
{
    KPL_CHECK(dets && n && (text || !len), KPL_EINVAL, "kpl_coco_dets_parse: NULL argument");
    *dets = NULL;
    *n = 0;
    if (!name) name = "detections";
    json_t *root;
    KPL_TRY(parse_json(text ? text : "", len, name, &root));
    kpl_status st = KPL_OK;
    kpl_coco_detection *d = NULL;
    if (!json_is_array(root)) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: not a COCO results file (want a JSON array of "
                                    "{image_id, category_id, bbox, score})", name);
        goto fail;
    }
    int64_t m = (int64_t)json_array_size(root);
    d = malloc(sizeof *d * (size_t)(m ? m : 1));
    if (!d) {
        st = KPL_ERROR(KPL_ENOMEM, "%s: out of memory for %lld detections", name, (long long)m);
        goto fail;
    }
    for (int64_t i = 0; i < m; i++) {
        const json_t *e = json_array_get(root, (size_t)i);
        if (!json_is_object(e)) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: [%lld] is not an object", name, (long long)i);
            goto fail;
        }
        int r = get_int(e, "image_id", &d[i].image_id);
        const char *key = "image_id";
        if (!r) r = get_int(e, key = "category_id", &d[i].category_id);
        if (r) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: [%lld] %s \"%s\"", name, (long long)i,
                           int_problem[r], key);
            goto fail;
        }
        const json_t *score = json_object_get(e, "score");
        if (!get_box(e, d[i].bbox) || !json_is_number(score)) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: [%lld] (image_id %lld): %s", name, (long long)i,
                           (long long)d[i].image_id,
                           !json_is_number(score) ? "\"score\" is missing or not a number"
                                                  : "\"bbox\" is not an array of 4 numbers");
            goto fail;
        }
        d[i].score = json_number_value(score);
    }
    json_decref(root);
    if (m == 0) {
        free(d);
        d = NULL;
    }
    *dets = d;
    *n = m;
    return KPL_OK;
fail:
    free(d);
    json_decref(root);
    return st;
}

kpl_status kpl_coco_dets_load(const char *path, kpl_coco_detection **dets, int64_t *n)
{
    KPL_CHECK(path && dets && n, KPL_EINVAL, "kpl_coco_dets_load: NULL argument");
    *dets = NULL;
    *n = 0;
    char *text;
    size_t len;
    KPL_TRY(read_text(path, &text, &len));
    kpl_status st = kpl_coco_dets_parse(text, len, path, dets, n);
    free(text);
    return st;
}

kpl_status kpl_coco_dets_save(const char *path, const kpl_coco_detection *dets, int64_t n)
{
    KPL_CHECK(path && n >= 0 && (dets || !n), KPL_EINVAL, "kpl_coco_dets_save: bad argument");
    for (int64_t i = 0; i < n; i++)
        KPL_CHECK(kpl__coco_finite4(dets[i].bbox) && isfinite(dets[i].score), KPL_EINVAL,
                  "kpl_coco_dets_save: detection %lld: bbox or score is not a finite number",
                  (long long)i);
    kpl__afile a;
    KPL_TRY(kpl__afile_open(&a, path));
    FILE *f = a.f;
    fputc('[', f);
    for (int64_t i = 0; i < n; i++) {
        const kpl_coco_detection *d = &dets[i];
        char v[5][40];
        for (int j = 0; j < 4; j++) kpl__coco_fmt_num(v[j], sizeof v[j], d->bbox[j]);
        kpl__coco_fmt_num(v[4], sizeof v[4], d->score);
        fprintf(f, "%s\n{\"image_id\":%lld,\"category_id\":%lld,\"bbox\":[%s,%s,%s,%s],"
                   "\"score\":%s}", i ? "," : "", (long long)d->image_id,
                (long long)d->category_id, v[0], v[1], v[2], v[3], v[4]);
    }
    fputs("\n]\n", f);
    return kpl__afile_commit(&a);
}
