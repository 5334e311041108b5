/*
 * convert_det.c — the writer of detection sets, which the COCO and VOC
 * converters fill (convert_impl.h): each image read and checked whole with
 * the loader's decoder, its size compared with the annotations', the COCO
 * masks built (polygons rasterised as pycocotools does, RLEs re-encoded in
 * the compressed form), then one example per image in the set's order.
 *
 * Images are checked in batches by several threads and appended in order,
 * so the result does not depend on the thread count.  The schema and the
 * encodings are docs/kplrecord.md's "Detection examples".
 */
#include "convert_impl.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>

/* ---- COCO segmentations -------------------------------------------------------- */

/* A JSON number's value (integers too). */
static bool num_of(const json_t *j, double *v)
{
    if (json_is_integer(j)) *v = (double)json_integer_value(j);
    else if (json_is_real(j)) *v = json_real_value(j);
    else return false;
    return isfinite(*v);
}

/* A polygon part kpl keeps: at least 3 points, an even number of
 * coordinates (Detectron2's rule; pycocotools would read a part of 4
 * coordinates as a box). */
static bool usable_part(const json_t *part)
{
    size_t n = json_array_size(part);
    return n >= 6 && n % 2 == 0;
}

/* An uncompressed RLE's counts (a JSON list) into r, for an h x w mask. */
static bool counts_of_list(const json_t *list, int64_t h, int64_t w, kpl_rle *r, char *why,
                           size_t n)
{
    size_t m = json_array_size(list);
    memset(r, 0, sizeof *r);
    uint32_t *c = malloc(sizeof *c * (m ? m : 1));
    if (!c) {
        snprintf(why, n, "no memory for %zu RLE counts", m);
        return false;
    }
    int64_t total = 0;
    for (size_t i = 0; i < m; i++) {
        const json_t *e = json_array_get(list, i);
        json_int_t v = json_is_integer(e) ? json_integer_value(e) : -1;
        if (!json_is_integer(e) || v < 0 || v > h * w - total) {
            snprintf(why, n, "RLE count %zu is %s", i,
                     !json_is_integer(e) ? "not an integer"
                     : v < 0            ? "negative"
                                        : "past the mask's end");
            free(c);
            return false;
        }
        c[i] = (uint32_t)v;
        total += v;
    }
    if (total != h * w) {
        snprintf(why, n, "RLE counts cover %lld pixels of the %lld x %lld image",
                 (long long)total, (long long)h, (long long)w);
        free(c);
        return false;
    }
    *r = (kpl_rle){h, w, (int64_t)m, c};
    return true;
}

/* The RLE of a COCO RLE object (checked to be one), in r. */
static bool rle_of_object(const json_t *seg, int64_t h, int64_t w, kpl_rle *r, char *why,
                          size_t n)
{
    const json_t *counts = json_object_get(seg, "counts");
    if (json_is_array(counts)) return counts_of_list(counts, h, w, r, why, n);
    if (kpl_rle_from_string(json_string_value(counts), json_string_length(counts), h, w, r) < 0) {
        snprintf(why, n, "%s", kpl_last_error());
        return false;
    }
    return true;
}

bool kpl__coco_seg_check(const json_t *seg, int64_t h, int64_t w, double tol, int64_t *parts,
                         int64_t *dropped, char *why, size_t n)
{
    *parts = 0;
    if (!seg || json_is_null(seg)) return true;
    if (json_is_array(seg)) {
        for (size_t i = 0; i < json_array_size(seg); i++) {
            const json_t *part = json_array_get(seg, i);
            if (!json_is_array(part)) {
                snprintf(why, n, "segmentation polygon %zu is not a list of numbers", i);
                return false;
            }
            for (size_t k = 0; k < json_array_size(part); k++) {
                double v;
                if (!num_of(json_array_get(part, k), &v)) {
                    snprintf(why, n, "segmentation polygon %zu: coordinate %zu is not a finite "
                             "number", i, k);
                    return false;
                }
                double lim = k % 2 ? (double)h : (double)w;
                if (v < -tol || v > lim + tol) {
                    snprintf(why, n, "segmentation polygon %zu: %s = %g lies outside the %lld x "
                             "%lld image by more than %g pixel", i, k % 2 ? "y" : "x", v,
                             (long long)w, (long long)h, tol);
                    return false;
                }
            }
            if (usable_part(part)) (*parts)++;
            else (*dropped)++;
        }
        return true;
    }
    if (json_is_object(seg)) {
        const json_t *size = json_object_get(seg, "size"), *counts = json_object_get(seg, "counts");
        const json_t *sh_j = json_array_get(size, 0), *sw_j = json_array_get(size, 1);
        if (!json_is_array(size) || json_array_size(size) != 2 || !json_is_integer(sh_j) ||
            !json_is_integer(sw_j)) {
            snprintf(why, n, "RLE segmentation without a \"size\" of two integers [h, w]");
            return false;
        }
        json_int_t sh = json_integer_value(sh_j), sw = json_integer_value(sw_j);
        if (sh != h || sw != w) {
            snprintf(why, n, "RLE size [%lld, %lld] is not the image's [%lld, %lld] (h, w)",
                     (long long)sh, (long long)sw, (long long)h, (long long)w);
            return false;
        }
        if (!json_is_array(counts) && !json_is_string(counts)) {
            snprintf(why, n, "RLE segmentation whose \"counts\" is neither a list nor a string");
            return false;
        }
        kpl_rle r;
        if (!rle_of_object(seg, h, w, &r, why, n)) return false;
        kpl_rle_free(&r);
        *parts = 1;
        return true;
    }
    snprintf(why, n, "segmentation is neither a list of polygons nor an RLE object");
    return false;
}

/* Sets the pixels of mask (h x w, zeroed first) inside seg's usable
 * polygon parts, as pycocotools rasterises them. */
static bool fill_polygons(const json_t *seg, int64_t h, int64_t w, uint8_t *mask, char *why,
                          size_t n)
{
    memset(mask, 0, (size_t)(h * w));
    for (size_t i = 0; i < json_array_size(seg); i++) {
        const json_t *part = json_array_get(seg, i);
        if (!usable_part(part)) continue;
        size_t k = json_array_size(part);
        double *xy = malloc(sizeof *xy * k);
        if (!xy) {
            snprintf(why, n, "no memory for a polygon of %zu coordinates", k);
            return false;
        }
        for (size_t j = 0; j < k; j++) num_of(json_array_get(part, j), &xy[j]);
        kpl_status st = kpl_mask_fill_polygon(xy, (int64_t)(k / 2), h, w, mask);
        free(xy);
        if (st < 0) {
            snprintf(why, n, "%s", kpl_last_error());
            return false;
        }
    }
    return true;
}

/* The binary mask (h x w) of one checked segmentation. */
static bool seg_binary(const json_t *seg, int64_t h, int64_t w, uint8_t *mask, char *why,
                       size_t n)
{
    if (json_is_array(seg)) return fill_polygons(seg, h, w, mask, why, n);
    kpl_rle r = {0};
    if (!rle_of_object(seg, h, w, &r, why, n)) return false;
    kpl_status st = kpl_rle_decode(&r, mask);
    kpl_rle_free(&r);
    if (st < 0) snprintf(why, n, "%s", kpl_last_error());
    return st == KPL_OK;
}

/* The compressed RLE string of one checked segmentation, appended to *buf
 * (grown as needed); *area receives its pixel count.  mask: an h x w buffer
 * to rasterise polygons in. */
static bool seg_string(const json_t *seg, int64_t h, int64_t w, uint8_t *mask, char **buf,
                       size_t *len, size_t *cap, int64_t *area, char *why, size_t n)
{
    kpl_rle r = {0};
    if (json_is_array(seg)) {
        if (!fill_polygons(seg, h, w, mask, why, n)) return false;
        if (kpl_rle_encode(mask, h, w, &r) < 0) {
            snprintf(why, n, "%s", kpl_last_error());
            return false;
        }
    } else if (!rle_of_object(seg, h, w, &r, why, n)) {
        return false;
    }
    char *s = NULL;
    size_t sl = 0;
    if (kpl_rle_to_string(&r, &s, &sl) < 0) {
        snprintf(why, n, "%s", kpl_last_error());
        kpl_rle_free(&r);
        return false;
    }
    *area = kpl_rle_area(&r);
    kpl_rle_free(&r);
    if (*len + sl + 1 > *cap) {
        size_t nc = 2 * (*len + sl + 1);
        char *nb = realloc(*buf, nc);
        if (!nb) {
            free(s);
            snprintf(why, n, "no memory for the masks");
            return false;
        }
        *buf = nb;
        *cap = nc;
    }
    memcpy(*buf + *len, s, sl);
    *len += sl;
    free(s);
    return true;
}

/* ---- the writer ------------------------------------------------------------------ */

/* One image of a batch, checked. */
typedef struct {
    kpl__loaded_image img;
    char *masks; /* COCO: the objects' RLE strings, '\n' between */
    size_t masks_len, masks_cap;
    float *areas; /* per object */
    uint8_t *semantic; /* semantic: the class-per-pixel mask as a PNG */
    size_t semantic_len;
} det_done;

typedef struct {
    const kpl__det_set *s;
    const kpl__det_image *images; /* the batch's */
    det_done *done;
    const char *encoding; /* the schema's image encoding */
    bool semantic;
} det_job;

/* The semantic mask of an image (h x w): 0 background, label + 1 where an
 * object is, 255 where objects of different classes overlap (torchvision's
 * segmentation reference sets every overlap to 255; an overlap of one
 * class keeps it here) and in crowd regions, which win over everything.
 * Objects without a segmentation add nothing.  buf: h x w scratch. */
static bool semantic_mask(const kpl__det_set *s, const kpl__det_image *im, uint8_t *buf,
                          uint8_t *cls, char *why, size_t n)
{
    const int64_t hw = im->height * im->width;
    memset(cls, 0, (size_t)hw);
    for (int pass = 0; pass < 2; pass++) /* objects, then crowd regions */
        for (int64_t k = 0; k < im->count; k++) {
            const kpl__det_obj *ob = &s->objs[im->first + k];
            if (!ob->seg || (ob->flag != 0) != (pass == 1)) continue;
            if (!seg_binary(ob->seg, im->height, im->width, buf, why, n)) return false;
            const uint8_t c = (uint8_t)(ob->label + 1);
            for (int64_t p = 0; p < hw; p++) {
                if (!buf[p]) continue;
                cls[p] = pass == 1 || (cls[p] && cls[p] != c) ? 255 : c;
            }
        }
    return true;
}

static void check_image(int64_t i, kpl__codec *c, void *ctx)
{
    det_job *j = ctx;
    const kpl__det_set *s = j->s;
    const kpl__det_image *im = &j->images[i];
    det_done *d = &j->done[i];
    kpl__loaded_image *l = &d->img;
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s/%s", s->image_dir, im->file) >= (int)sizeof p) {
        memset(l, 0, sizeof *l);
        snprintf(l->why, sizeof l->why, "path too long");
        return;
    }
    kpl__load_image(p, 0, 0, c, l);
    if (l->why[0]) return;
    int fw = l->info.width, fh = l->info.height;
    const char *kind = l->info.kind == KPL__IMG_PNG ? "png" : "jpeg";
    if (j->encoding[0] && strcmp(j->encoding, kind)) {
        snprintf(l->why, sizeof l->why, "its bytes are a %s, but the other images' names say %s",
                 kind, j->encoding);
    } else if (fw != im->width || fh != im->height) {
        int n = snprintf(l->why, sizeof l->why, "the file is %d x %d, the annotations say "
                         "%lld x %lld (width x height)", fw, fh, (long long)im->width,
                         (long long)im->height);
        if (l->info.orientation >= 5 && fw == im->height && fh == im->width)
            snprintf(l->why + n, sizeof l->why - (size_t)n, "; its EXIF orientation %d turns "
                     "it, and the annotations match the stored, unturned pixels",
                     l->info.orientation);
    }
    if (l->why[0]) return;
    uint8_t *mask = NULL;
    if (j->semantic) {
        uint8_t *cls = malloc((size_t)(im->width * im->height));
        mask = malloc((size_t)(im->width * im->height));
        if (!cls || !mask) {
            free(cls);
            goto nomem;
        }
        char why[300];
        bool ok = semantic_mask(s, im, mask, cls, why, sizeof why);
        if (ok && kpl__png_encode_gray(cls, (int)im->width, (int)im->height, &d->semantic,
                                       &d->semantic_len) < 0) {
            ok = false;
            snprintf(why, sizeof why, "%s", kpl_last_error());
        }
        free(cls);
        if (!ok) {
            snprintf(l->why, sizeof l->why, "its semantic mask: %s", why);
            l->fatal = strstr(why, "no memory") != NULL;
            free(mask);
            return;
        }
    }
    if (!im->count) {
        free(mask);
        return;
    }
    d->areas = malloc(sizeof *d->areas * (size_t)im->count);
    if (!d->areas) goto nomem;
    for (int64_t k = 0; k < im->count; k++) {
        const kpl__det_obj *ob = &s->objs[im->first + k];
        int64_t area = -1;
        if (ob->seg) {
            if (!mask && !(mask = malloc((size_t)(im->width * im->height)))) goto nomem;
            char why[300];
            if (!seg_string(ob->seg, im->height, im->width, mask, &d->masks, &d->masks_len,
                            &d->masks_cap, &area, why, sizeof why)) {
                snprintf(l->why, sizeof l->why, "annotation %lld: %s",
                         (long long)ob->annotation_id, why);
                l->fatal = strstr(why, "no memory") != NULL;
                break;
            }
        }
        if (s->kind == KPL__DET_COCO && k + 1 < im->count) {
            if (d->masks_len + 1 >= d->masks_cap) {
                size_t nc = 2 * d->masks_cap + 64;
                char *nb = realloc(d->masks, nc);
                if (!nb) goto nomem;
                d->masks = nb;
                d->masks_cap = nc;
            }
            d->masks[d->masks_len++] = '\n';
        }
        d->areas[k] = ob->area >= 0 ? ob->area
                      : area >= 0   ? (float)area
                                    : (ob->box[2] - ob->box[0]) * (ob->box[3] - ob->box[1]);
    }
    free(mask);
    return;
nomem:
    free(mask);
    snprintf(l->why, sizeof l->why, "no memory for its masks");
    l->fatal = true;
}

/* "jpeg" when every file name says JPEG, "png" when every one says PNG,
 * else "" (the loader sniffs). */
static const char *encoding_of(const kpl__det_set *s)
{
    int64_t njpeg = 0, npng = 0;
    for (int64_t i = 0; i < s->nimages; i++) {
        const char *dot = strrchr(s->images[i].file, '.');
        njpeg += dot && (!strcasecmp(dot, ".jpg") || !strcasecmp(dot, ".jpeg"));
        npng += dot && !strcasecmp(dot, ".png");
    }
    return njpeg == s->nimages ? "jpeg" : npng == s->nimages ? "png" : "";
}

/* Whether an image has an object that counts against drop_empty. */
static bool has_objects(const kpl__det_set *s, const kpl__det_image *im)
{
    for (int64_t k = 0; k < im->count; k++)
        if (!s->objs[im->first + k].flag) return true;
    return false;
}

/* Scratch for one example's values. */
typedef struct {
    float *boxes, *area;
    int64_t *labels, *cats, *flags, *ids;
    int64_t cap;
} det_values;

static kpl_status values_reserve(det_values *v, int64_t n)
{
    if (n <= v->cap) return KPL_OK;
    int64_t cap = n > 2 * v->cap ? n : 2 * v->cap;
    float *b = realloc(v->boxes, sizeof *b * 4 * (size_t)cap);
    if (b) v->boxes = b;
    float *a = realloc(v->area, sizeof *a * (size_t)cap);
    if (a) v->area = a;
    int64_t **f[4] = {&v->labels, &v->cats, &v->flags, &v->ids};
    bool ok = b && a;
    for (int k = 0; k < 4; k++) {
        int64_t *q = realloc(*f[k], sizeof *q * (size_t)cap);
        if (q) *f[k] = q;
        ok &= q != NULL;
    }
    KPL_CHECK(ok, KPL_ENOMEM, "detection set: no memory for %lld objects", (long long)n);
    v->cap = cap;
    return KPL_OK;
}

static kpl_status write_example(const kpl__det_set *s, const kpl__det_image *im,
                                const det_done *d, bool semantic, det_values *v,
                                kpl_record_writer *w)
{
    KPL_TRY(values_reserve(v, im->count ? im->count : 1));
    for (int64_t k = 0; k < im->count; k++) {
        const kpl__det_obj *ob = &s->objs[im->first + k];
        memcpy(v->boxes + 4 * k, ob->box, sizeof ob->box);
        v->labels[k] = ob->label;
        v->cats[k] = ob->category_id;
        v->flags[k] = ob->flag;
        v->ids[k] = ob->annotation_id;
        v->area[k] = d->areas[k];
    }
    uint32_t n = (uint32_t)im->count;
    int64_t hw[3] = {im->id, im->height, im->width};
    kpl_feature_value val[13] = {
        {d->img.bytes, (uint32_t)d->img.len},
        {im->file, (uint32_t)strlen(im->file)},
        {&hw[0], 1},
        {&hw[1], 1},
        {&hw[2], 1},
        {v->boxes, 4 * n},
        {v->labels, n},
    };
    if (s->kind == KPL__DET_COCO) {
        val[7] = (kpl_feature_value){v->cats, n};
        val[8] = (kpl_feature_value){v->flags, n};
        val[9] = (kpl_feature_value){v->area, n};
        val[10] = (kpl_feature_value){v->ids, n};
        val[11] = (kpl_feature_value){d->masks ? d->masks : "", (uint32_t)d->masks_len};
        if (semantic) val[12] = (kpl_feature_value){d->semantic, (uint32_t)d->semantic_len};
    } else {
        val[7] = (kpl_feature_value){v->flags, n};
    }
    return kpl_record_writer_add(w, val);
}

kpl_status kpl__det_write(const kpl__det_set *s, const char *out_dir,
                          const kpl_convert_options *o, kpl_detection_stats *stats)
{
    enum { BATCH = 256 };
    kpl_status st = KPL_OK;
    kpl_detection_stats z = {0};
    kpl_detection_stats *sts = stats ? stats : &z;
    kpl__det_image *todo = malloc(sizeof *todo * (size_t)(s->nimages ? s->nimages : 1));
    det_done *done = calloc(BATCH, sizeof *done);
    det_values vals = {0};
    kpl_record_writer *w = NULL;
    const char *src = s->kind == KPL__DET_COCO ? "coco" : "voc";
    if (!todo || !done) {
        st = KPL_ERROR(KPL_ENOMEM, "%s: no memory for %lld images", src, (long long)s->nimages);
        goto fail;
    }
    int64_t ntodo = 0;
    for (int64_t i = 0; i < s->nimages; i++) {
        const kpl__det_image *im = &s->images[i];
        if (im->bad) continue;
        if (o->drop_empty && !has_objects(s, im)) sts->dropped_empty++;
        else todo[ntodo++] = *im;
    }
    if (ntodo == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: no image to write (%lld in the annotations, %lld "
                       "bad, %lld without objects)", src, (long long)s->nimages,
                       (long long)sts->skipped_images, (long long)sts->dropped_empty);
        goto fail;
    }
    static const kpl_feature_spec common[7] = {
        {.name = "image", .type = KPL_FEATURE_BYTES},
        {.name = "path", .type = KPL_FEATURE_STRING},
        {.name = "image_id", .type = KPL_FEATURE_INT64, .ndim = 1, .shape = {1}},
        {.name = "height", .type = KPL_FEATURE_INT64, .ndim = 1, .shape = {1}},
        {.name = "width", .type = KPL_FEATURE_INT64, .ndim = 1, .shape = {1}},
        {.name = "boxes", .type = KPL_FEATURE_FLOAT},
        {.name = "labels", .type = KPL_FEATURE_INT64},
    };
    static const kpl_feature_spec coco[5] = {
        {.name = "category_ids", .type = KPL_FEATURE_INT64},
        {.name = "iscrowd", .type = KPL_FEATURE_INT64},
        {.name = "area", .type = KPL_FEATURE_FLOAT},
        {.name = "annotation_ids", .type = KPL_FEATURE_INT64},
        {.name = "masks", .type = KPL_FEATURE_STRING, .encoding = "coco_rle"},
    };
    static const kpl_feature_spec voc[1] = {{.name = "difficult", .type = KPL_FEATURE_INT64}};
    kpl_feature_spec schema[13];
    memcpy(schema, common, sizeof common);
    int nf = 7;
    const bool semantic = o->semantic;
    if (semantic && s->kind != KPL__DET_COCO) {
        st = KPL_ERROR(KPL_EINVAL, "%s: semantic masks are made from COCO segmentations only "
                       "(VOC's are --from voc-seg)", src);
        goto fail;
    }
    if (s->kind == KPL__DET_COCO) {
        memcpy(schema + nf, coco, sizeof coco);
        nf += 5;
        if (semantic)
            schema[nf++] = (kpl_feature_spec){.name = "mask", .type = KPL_FEATURE_BYTES,
                                              .encoding = "png"};
    } else {
        memcpy(schema + nf, voc, sizeof voc);
        nf += 1;
    }
    kpl__det_set sub = *s;
    sub.images = todo;
    sub.nimages = ntodo;
    const char *enc = encoding_of(&sub);
    strcpy(schema[0].encoding, enc);
    kpl_record_writer_config wc = o->writer;
    wc.attributes_json = s->attributes;
    KPL_TRY_GOTO(kpl_record_writer_create(out_dir, nf, schema, &wc, &w));
    kpl__progress pr;
    kpl__progress_init(&pr, o, out_dir);
    for (int64_t b0 = 0; b0 < ntodo; b0 += BATCH) {
        int64_t nb = ntodo - b0 < BATCH ? ntodo - b0 : BATCH;
        det_job job = {s, todo + b0, done, enc, semantic};
        kpl__convert_parallel(nb, o->threads, check_image, &job);
        for (int64_t i = 0; i < nb && st == KPL_OK; i++) {
            const kpl__det_image *im = &todo[b0 + i];
            if (done[i].img.why[0]) {
                st = kpl__convert_bad(o, done[i].img.fatal, &sts->skipped_images,
                                      "%s: image %lld (%s/%s): %s", src, (long long)im->id,
                                      s->image_dir, im->file, done[i].img.why);
                sts->skipped_objects += im->count;
                continue;
            }
            st = write_example(s, im, &done[i], semantic, &vals, w);
            sts->objects += im->count;
        }
        for (int64_t i = 0; i < nb; i++) {
            free(done[i].img.bytes);
            free(done[i].masks);
            free(done[i].areas);
            free(done[i].semantic);
            memset(&done[i], 0, sizeof done[i]);
        }
        if (st < 0) goto fail;
        KPL_TRY_GOTO(kpl__progress_update(&pr, (uint64_t)(b0 + nb), (uint64_t)ntodo, "images"));
    }
    sts->images = kpl_record_writer_count(w);
    if (sts->images == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: every image was bad", src);
        goto fail;
    }
    kpl_record_writer *fin = w;
    w = NULL;
    KPL_TRY_GOTO(kpl_record_writer_close(fin));
    if (semantic) { /* line k names mask value k */
        char **lines = malloc(sizeof *lines * (size_t)(s->num_classes + 1));
        if (!lines) {
            st = KPL_ERROR(KPL_ENOMEM, "%s: no memory", src);
            goto fail;
        }
        lines[0] = "background";
        memcpy(lines + 1, s->classes, sizeof *lines * (size_t)s->num_classes);
        st = kpl__write_lines(out_dir, "classes.txt", lines, s->num_classes + 1);
        free(lines);
        if (st < 0) goto fail;
    } else {
        KPL_TRY_GOTO(kpl__write_lines(out_dir, "classes.txt", s->classes, s->num_classes));
    }
    if (s->categories_json)
        KPL_TRY_GOTO(kpl__write_text(out_dir, "categories.json", s->categories_json,
                                     strlen(s->categories_json)));
fail:
    kpl_record_writer_destroy(w);
    free(todo);
    free(done);
    free(vals.boxes);
    free(vals.area);
    free(vals.labels);
    free(vals.cats);
    free(vals.flags);
    free(vals.ids);
    return st;
}
