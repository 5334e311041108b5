/*
 * convert_voc.c — a Pascal VOC 2007/2012 split to KPLRecord detection
 * examples (docs/detection-data.md): the ids of ImageSets/Main/<split>.txt
 * in file order, each Annotations/<id>.xml read with libxml2 and
 * JPEGImages/<id>.jpg checked whole by the detection writer (convert_det.c).
 *
 * Boxes: VOC gives 1-based pixel indices, xmin..xmax inclusive.  kpl reads
 * them as mmdetection does (mmdet/datasets/xml_style.py): each coordinate
 * truncated to an integer, then 1 subtracted from all four, so the box of
 * a whole W-pixel-wide image is [0, W - 1].  (Detectron2 subtracts 1 from
 * xmin and ymin only, which makes every box one pixel wider and taller.)
 */
#include "convert_impl.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
#include <libxml/parser.h>
#include <libxml/tree.h>

/* The 20 classes in the standard order (label = position). */
static const char *const voc_classes[20] = {
    "aeroplane",   "bicycle", "bird",  "boat",      "bottle", "bus",         "car",
    "cat",         "chair",   "cow",   "diningtable", "dog",  "horse",       "motorbike",
    "person",      "pottedplant", "sheep", "sofa",  "train",  "tvmonitor",
};

/* The first child element of n called `name`, or NULL. */
static xmlNode *child(const xmlNode *n, const char *name)
{
    for (xmlNode *c = n ? n->children : NULL; c; c = c->next)
        if (c->type == XML_ELEMENT_NODE && !strcmp((const char *)c->name, name)) return c;
    return NULL;
}

/* The first of names (NULL-terminated) that n has more than one child
 * element of, or NULL: a duplicated field is an error, not the first. */
static const char *duplicated(const xmlNode *n, const char *const *names)
{
    for (; *names; names++) {
        int k = 0;
        for (xmlNode *c = n ? n->children : NULL; c; c = c->next)
            k += c->type == XML_ELEMENT_NODE && !strcmp((const char *)c->name, *names);
        if (k > 1) return *names;
    }
    return NULL;
}

/* Whether s is a decimal number as VOC writes them: [+-]digits[.digits]
 * with an optional exponent (no hex, inf or nan, which strtod takes). */
static bool decimal(const char *s)
{
    if (*s == '+' || *s == '-') s++;
    const char *d = s;
    while (isdigit((unsigned char)*s)) s++;
    bool whole = s > d;
    if (*s == '.') {
        const char *f = ++s;
        while (isdigit((unsigned char)*s)) s++;
        whole = whole || s > f;
    }
    if (!whole) return false;
    if (*s == 'e' || *s == 'E') {
        s++;
        if (*s == '+' || *s == '-') s++;
        if (!isdigit((unsigned char)*s)) return false;
        while (isdigit((unsigned char)*s)) s++;
    }
    return *s == 0;
}

/* The text of n's child `name`, trimmed, into out[len]; false if absent. */
static bool child_text(const xmlNode *n, const char *name, char *out, size_t len)
{
    xmlNode *c = child(n, name);
    if (!c) return false;
    xmlChar *t = xmlNodeGetContent(c);
    if (!t) return false;
    const char *s = (const char *)t;
    while (isspace((unsigned char)*s)) s++;
    size_t k = strlen(s);
    while (k && isspace((unsigned char)s[k - 1])) k--;
    snprintf(out, len, "%.*s", (int)k, s);
    xmlFree(t);
    return true;
}

/* n's child `name` as a finite number. */
static bool child_num(const xmlNode *n, const char *name, double *v)
{
    char t[64], *end;
    if (!child_text(n, name, t, sizeof t) || !decimal(t)) return false;
    *v = strtod(t, &end);
    return !*end && isfinite(*v);
}

/* One <object>: class, difficult flag and box (mmdetection's reading). */
static bool read_object(const xmlNode *obj, int64_t W, int64_t H, kpl__det_obj *ob,
                        kpl_detection_stats *sts, char *why, size_t n)
{
    char name[64];
    static const char *const fields[] = {"name", "difficult", "bndbox", NULL};
    static const char *const corners[] = {"xmin", "ymin", "xmax", "ymax", NULL};
    const char *dup = duplicated(obj, fields);
    const char *dupb = dup ? NULL : duplicated(child(obj, "bndbox"), corners);
    if (dup || dupb) {
        snprintf(why, n, "<%s> appears twice in %s", dup ? dup : dupb, dup ? "<object>" : "<bndbox>");
        return false;
    }
    if (!child_text(obj, "name", name, sizeof name)) {
        snprintf(why, n, "no <name>");
        return false;
    }
    ob->label = -1;
    for (int c = 0; c < 20; c++)
        if (!strcmp(name, voc_classes[c])) ob->label = c;
    if (ob->label < 0) {
        snprintf(why, n, "class '%s' is not one of VOC's 20", name);
        return false;
    }
    ob->category_id = ob->label;
    double d = 0;
    if (child(obj, "difficult") && (!child_num(obj, "difficult", &d) || (d != 0 && d != 1))) {
        snprintf(why, n, "<difficult> is not 0 or 1");
        return false;
    }
    ob->flag = (int64_t)d;
    const xmlNode *bb = child(obj, "bndbox");
    static const char *const keys[4] = {"xmin", "ymin", "xmax", "ymax"};
    double b[4];
    for (int k = 0; k < 4; k++)
        if (!child_num(bb, keys[k], &b[k]) || fabs(b[k]) > 1e9) {
            snprintf(why, n, "no <bndbox> with a number in <%s>", keys[k]);
            return false;
        }
    for (int k = 0; k < 4; k++) b[k] = trunc(b[k]) - 1;
    double tol = KPL_DET_BOX_TOLERANCE;
    if (b[2] <= b[0] || b[3] <= b[1]) {
        snprintf(why, n, "box (%g, %g)-(%g, %g) (0-based, mmdetection's reading) has zero or "
                 "negative %s", b[0], b[1], b[2], b[3], b[2] <= b[0] ? "width" : "height");
        return false;
    }
    if (b[0] < -tol || b[1] < -tol || b[2] > (double)W + tol || b[3] > (double)H + tol) {
        snprintf(why, n, "box (%g, %g)-(%g, %g) (0-based) reaches outside the %lld x %lld "
                 "image by more than %g pixel", b[0], b[1], b[2], b[3], (long long)W,
                 (long long)H, tol);
        return false;
    }
    bool clipped = b[0] < 0 || b[1] < 0 || b[2] > (double)W || b[3] > (double)H;
    b[0] = b[0] < 0 ? 0 : b[0];
    b[1] = b[1] < 0 ? 0 : b[1];
    b[2] = b[2] > (double)W ? (double)W : b[2];
    b[3] = b[3] > (double)H ? (double)H : b[3];
    for (int k = 0; k < 4; k++) ob->box[k] = (float)b[k];
    ob->area = (float)((b[2] - b[0]) * (b[3] - b[1]));
    sts->clipped_boxes += clipped;
    return true;
}

/* Grows *objs to hold `need`. */
static kpl_status reserve(kpl__det_obj **objs, int64_t *cap, int64_t need)
{
    if (need <= *cap) return KPL_OK;
    int64_t c = need > 2 * *cap ? need : 2 * *cap;
    kpl__det_obj *o = realloc(*objs, sizeof *o * (size_t)c);
    KPL_CHECK(o, KPL_ENOMEM, "voc: no memory for %lld objects", (long long)c);
    *objs = o;
    *cap = c;
    return KPL_OK;
}

/* Annotations/<id>.xml of image `d` (its id already set): size and
 * objects, appended to *objs.  A bad file or object is reported (error, or
 * skip with a warning). */
static kpl_status read_xml(const char *root, const char *name, kpl__det_image *d,
                           const kpl_convert_options *o, kpl__det_obj **objs, int64_t *nobjs,
                           int64_t *cap, kpl_detection_stats *sts)
{
    char p[PATH_MAX], rel[300], why[800] = "";
    snprintf(p, sizeof p, "%s/Annotations/%s.xml", root, name);
    snprintf(rel, sizeof rel, "Annotations/%.255s.xml", name);
    /* only a regular file is read: a FIFO would block the converter, and
     * a link loop is its own error, not a missing file */
    struct stat sb;
    int serr = stat(p, &sb) ? errno : S_ISREG(sb.st_mode) ? 0 : -1;
    xmlDoc *doc = serr ? NULL
                       : xmlReadFile(p, NULL, XML_PARSE_NONET | XML_PARSE_NOERROR |
                                                  XML_PARSE_NOWARNING);
    const xmlNode *ann = doc ? xmlDocGetRootElement(doc) : NULL, *size = child(ann, "size");
    static const char *const sizes[] = {"size", NULL}, *const dims[] = {"width", "height", NULL};
    const char *dup = ann ? duplicated(ann, sizes) : NULL;
    if (!dup && size) dup = duplicated(size, dims);
    double W = 0, H = 0;
    if (serr) {
        snprintf(why, sizeof why, "%s: %s", rel, serr > 0 ? strerror(serr) : "not a regular file");
    } else if (!doc) {
        const xmlError *e = xmlGetLastError();
        snprintf(why, sizeof why, "%s: %.400s", rel,
                 e && e->message ? e->message : "not readable XML");
        size_t k = strlen(why);
        while (k && why[k - 1] == '\n') why[--k] = 0;
    } else if (!ann || strcmp((const char *)ann->name, "annotation"))
        snprintf(why, sizeof why, "%s: the root element is not <annotation>", rel);
    else if (dup)
        snprintf(why, sizeof why, "%s: <%s> appears twice", rel, dup);
    else if (!child_num(size, "width", &W) || !child_num(size, "height", &H) || W < 1 ||
             H < 1 || W != floor(W) || H != floor(H) || W * H > (double)(1 << 28))
        snprintf(why, sizeof why, "%s: no <size> with a positive integer <width> and <height> "
                 "(at most 2^28 pixels)", rel);
    kpl_status st = KPL_OK;
    if (why[0]) {
        d->bad = true;
        st = kpl__convert_bad(o, false, &sts->skipped_images, "voc: image %lld (%s): %s",
                              (long long)d->id, name, why);
        goto done;
    }
    d->width = (int64_t)W;
    d->height = (int64_t)H;
    d->first = *nobjs;
    int64_t k = 0;
    for (const xmlNode *c = ann->children; c && st == KPL_OK; c = c->next) {
        if (c->type != XML_ELEMENT_NODE || strcmp((const char *)c->name, "object")) continue;
        if ((st = reserve(objs, cap, *nobjs + 1)) < 0) break;
        kpl__det_obj *ob = &(*objs)[*nobjs];
        memset(ob, 0, sizeof *ob);
        ob->annotation_id = k++;
        if (read_object(c, d->width, d->height, ob, sts, why, sizeof why)) {
            (*nobjs)++;
            d->count++;
        } else {
            st = kpl__convert_bad(o, false, &sts->skipped_objects, "voc: image %lld (%s): "
                                  "object %lld (%s): %s", (long long)d->id, name,
                                  (long long)ob->annotation_id, rel, why);
        }
    }
done:
    xmlFreeDoc(doc);
    return st;
}

kpl_status kpl_convert_voc(const char *voc_root, const char *split, const char *out_dir,
                           const kpl_convert_options *opt, kpl_detection_stats *stats)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    if (opt) o = *opt;
    kpl_detection_stats sts = {0};
    kpl_status st = KPL_OK;
    char p[PATH_MAX], *list = NULL, *attrs = NULL;
    kpl__det_image *im = NULL;
    kpl__det_obj *objs = NULL;
    int64_t nim = 0, nobjs = 0, cap = 0;
    KPL_CHECK(split && split[0] && !strchr(split, '/'), KPL_EINVAL,
              "voc: the split must be a plain name such as train, val, trainval or test");
    snprintf(p, sizeof p, "%s/ImageSets/Main/%s.txt", voc_root, split);
    KPL_TRY(kpl__read_file(p, &list, NULL));
    xmlInitParser();
    /* One id a line (the first word; class-specific lists add a flag). */
    int64_t lines = 1;
    for (const char *c = list; *c; c++) lines += *c == '\n';
    im = calloc((size_t)lines, sizeof *im);
    if (!im) {
        st = KPL_ERROR(KPL_ENOMEM, "voc: no memory for %lld images", (long long)lines);
        goto fail;
    }
    for (char *line = list, *next; line && st == KPL_OK; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char name[256];
        if (sscanf(line, "%255s", name) != 1) continue;
        kpl__det_image *d = &im[nim];
        d->id = nim++;
        char rel[300];
        snprintf(rel, sizeof rel, "JPEGImages/%s.jpg", name);
        if (!(d->file = strdup(rel))) {
            st = KPL_ERROR(KPL_ENOMEM, "voc: no memory");
            break;
        }
        st = read_xml(voc_root, name, d, &o, &objs, &nobjs, &cap, &sts);
    }
    if (st < 0) goto fail;
    if (nim == 0) {
        st = KPL_ERROR(KPL_EFORMAT, "voc: %s lists no image", p);
        goto fail;
    }
    json_t *a = json_pack("{s:s, s:s, s:s, s:i, s:s, s:s, s:s, s:f, s:s}", "source", "voc",
                          "root", voc_root, "split", split, "num_classes", 20, "classes_file",
                          "classes.txt", "box_format", "x0 y0 x1 y1 pixels",
                          "box_convention", "mmdetection: 1-based VOC coordinates truncated, "
                          "minus 1", "box_tolerance", KPL_DET_BOX_TOLERANCE, "order",
                          "split file");
    attrs = a ? json_dumps(a, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(a);
    if (!attrs) {
        st = KPL_ERROR(KPL_ENOMEM, "voc: no memory (or a path is not UTF-8)");
        goto fail;
    }
    kpl__det_set set = {KPL__DET_VOC, voc_root, im, nim, objs, nobjs, (char **)voc_classes, 20,
                        attrs, NULL};
    st = kpl__det_write(&set, out_dir, &o, &sts);
fail:
    if (stats) *stats = sts;
    for (int64_t i = 0; im && i < nim; i++) free(im[i].file);
    free(im);
    free(objs);
    free(list);
    free(attrs);
    return st;
}
