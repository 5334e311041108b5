/*
 * detect.c — the detection task: a model of the zoo whose detector head
 * (detector.h; FCOS, Tian et al. 2019, is kpl's: nn/fcos_head.c) gives its
 * losses and its detections, evaluated with COCO's figures (cocoeval.h)
 * over every rank's detections, gathered to each.
 *
 *   training    the head's losses from the batch's boxes (FCOS: targets
 *               assigned on the host per image, the losses on the device)
 *   evaluation  the head's detections of each image (FCOS: per level,
 *               score sqrt(sigmoid(class) x sigmoid(centerness)) above
 *               score_thresh, the pre_nms_topk best, boxes decoded and
 *               clipped to the image, class-wise NMS, the max_dets best);
 *               mapped back to the stored image's pixels and scored
 *               against the validation split's own records (image_id,
 *               boxes, category_ids, iscrowd, area), so a split converted
 *               from COCO is scored as pycocotools scores the JSON it came
 *               from.  The detections are written as a COCO results file.
 */
#include "cocoeval.h"
#include "detector.h"
#include "trainer.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the task's state ------------------------------------------------------------------------ */

/* A validation image kept for TensorBoard: its pixels (h, w, 3) and the
 * boxes drawn on it (in its pixels): ground truth, then detections. */
typedef struct {
    int h, w;
    uint8_t *rgb;
    int ngt, ndet;
    float *box; /* (ngt + ndet) x 4 */
    int64_t *label;
} tb_image;

typedef struct {
    const kpl_detector_head *head;
    void *head_state;
    int64_t classes, topk, max_dets, tb_images;
    double score_thresh, nms_iou;
    const char *save;
    /* The ground truth of the examples this rank evaluates (its shard of
     * the validation split), read at the first evaluation and again when
     * the shard changes; the figures come from every rank's matching
     * (kpl_coco_match, kpl_coco_finish). */
    kpl_coco_gt *gt;
    int64_t examples;  /* the split's examples evaluated (all ranks) */
    int64_t *image_id; /* per example: its image id, -1 where not read */
    int64_t *category; /* per label: the category id of detections (one map for every rank) */
    int64_t *gt_ex, ngt_ex; /* the examples gt holds, ascending */
    /* this rank's detections in the evaluation under way (image_id: the
     * example, category_id: the label, until eval_end) and its examples */
    kpl_coco_detection *dets;
    int64_t ndets, capdets;
    int64_t *mine, nmine, capmine;
    kpl_coco_stats stats;
    bool have_stats;
    tb_image *tb;
    int ntb;
} detect;

static void tb_free(detect *d)
{
    for (int i = 0; i < d->ntb; i++) free(d->tb[i].rgb), free(d->tb[i].box), free(d->tb[i].label);
    free(d->tb);
    d->tb = NULL, d->ntb = 0;
}

static void destroy(void *state)
{
    detect *d = state;
    if (!d) return;
    kpl_coco_gt_destroy(d->gt);
    if (d->head) d->head->destroy(d->head_state);
    free(d->image_id), free(d->category), free(d->dets), free(d->gt_ex), free(d->mine);
    tb_free(d);
    free(d);
}

/* task.detection.<key> */
static const kpl_key keys[] = {
    {"center_radius", KPL_KEY_FLOAT, "1.5", 0, 100, NULL,
     "center sampling: a location is positive only within radius x its stride of a box's "
     "centre (0: anywhere inside the box, the paper's first version)"},
    {"regress_ranges", KPL_KEY_FLOATS, "[64, 128, 256, 512]", 1, 1e8, NULL,
     "the boundaries of the levels' box-size ranges (levels - 1 increasing values; level l "
     "regresses boxes whose largest distance lies between its two)"},
    {"focal_alpha", KPL_KEY_FLOAT, "0.25", -1, 1, NULL,
     "the focal loss's weight of positives (below 0: none)"},
    {"focal_gamma", KPL_KEY_FLOAT, "2.0", 0, 10, NULL, "the focal loss's focusing exponent"},
    {"score_thresh", KPL_KEY_FLOAT, "0.05", 0, 1, NULL,
     "inference: the least score sqrt(class probability x centerness) kept"},
    {"pre_nms_topk", KPL_KEY_INT, "1000", 1, 100000, NULL,
     "inference: candidates kept per level before NMS"},
    {"nms_iou", KPL_KEY_FLOAT, "0.6", 0, 1, NULL,
     "inference: class-wise NMS suppresses a box overlapping a better one by more than this IoU"},
    {"max_dets", KPL_KEY_INT, "100", 1, 10000, NULL,
     "inference: detections kept per image (COCO's figures read at most 100)"},
    {"save_detections", KPL_KEY_STRING, "\"\"", 0, 0, NULL,
     "the COCO results file each evaluation writes (\"\": detections.json in the run "
     "directory; kpl eval writes one only when given)"},
    {"tb_images", KPL_KEY_INT, "4", 0, 64, NULL,
     "validation images with their boxes drawn in TensorBoard after each evaluation"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};
static const char *const needs[] = {"model.name", "model.num_classes", NULL};

static kpl_status create(kpl_trainer *t, void **state)
{
    const kpl_recipe *r = kpl_trainer_recipe(t);
    const kpl_keyvals *kv = kpl_trainer_task_keys(t);
    const char *file = *r->file ? r->file : "recipe";
    const int64_t *chw = kpl_trainer_input_shape(t);
    detect *d = calloc(1, sizeof *d);
    KPL_CHECK(d, KPL_ENOMEM, "out of memory");
    *state = d;
    kpl_model_config mc = r->model;
    mc.in_channels = chw[0], mc.in_h = chw[1], mc.in_w = chw[2];
    d->classes = r->model.num_classes;
    kpl_module *m = NULL;
    KPL_TRY(kpl_zoo_create(&mc, kpl_trainer_device(t), (uint64_t)r->seed, &m));
    /* the first head that takes the model on */
    kpl_status st = KPL_ENOTFOUND;
    for (int i = 0; st == KPL_ENOTFOUND && i < kpl_detector_head_count(); i++) {
        d->head = kpl_detector_head_at(i);
        st = d->head->create(m, kv, file, &d->head_state);
    }
    if (st < 0) {
        d->head = NULL;
        kpl_module_destroy(m);
        if (st != KPL_ENOTFOUND) return st;
        char heads[200] = "";
        for (int i = 0; i < kpl_detector_head_count(); i++)
            snprintf(heads + strlen(heads), sizeof heads - strlen(heads), "%s%s", i ? ", " : "",
                     kpl_detector_head_at(i)->name);
        return KPL_ERROR(KPL_EINVAL, "%s: model.name: model '%s' has no detector head the "
                         "detection task knows (%s; detector.h)", file, mc.name, heads);
    }
    char label[64];
    snprintf(label, sizeof label, "%s_r%lld", d->head->name, (long long)(mc.depth ? mc.depth : 50));
    KPL_TRY(kpl_trainer_add_model(t, "model", label, m, NULL, NULL));
    KPL_TRY(kpl_key_float(kv, "score_thresh", &d->score_thresh));
    KPL_TRY(kpl_key_float(kv, "nms_iou", &d->nms_iou));
    KPL_TRY(kpl_key_int(kv, "pre_nms_topk", &d->topk));
    KPL_TRY(kpl_key_int(kv, "max_dets", &d->max_dets));
    KPL_TRY(kpl_key_int(kv, "tb_images", &d->tb_images));
    return kpl_key_string(kv, "save_detections", &d->save);
}

/* The detection features a split's batches carry, unless the recipe
 * names its own: the converters' "boxes" and "labels", 100 per image; no
 * image label (detection examples have none). */
static void data(const kpl_recipe *r, bool train, kpl_loader_config *c)
{
    (void)r;
    kpl_transform_config *x = &c->transform;
    x->label_feature = NULL;
    if (!x->boxes_feature) x->boxes_feature = "boxes";
    /* training leaves crowd regions and VOC's difficult objects out (as
     * mmdetection's gt_bboxes_ignore, which FCOS does not train on);
     * evaluation reads them from the records itself */
    kpl_dataset *ds = NULL;
    if (train && !x->box_ignore_feature && kpl_dataset_open(c->path, &ds) >= 0) {
        if (kpl_dataset_find_feature(ds, "difficult") >= 0) x->box_ignore_feature = "difficult";
        else if (kpl_dataset_find_feature(ds, "iscrowd") >= 0) x->box_ignore_feature = "iscrowd";
        kpl_dataset_close(ds);
    }
    if (!x->box_labels_feature) x->box_labels_feature = "labels";
    if (x->max_boxes <= 0) x->max_boxes = 100;
}

/* ---- training ---------------------------------------------------------------------------------- */

/* The batch's boxes, labels and counts on the host. */
static kpl_status batch_targets(const kpl_batch *b, const float **boxes, const int64_t **labels,
                                const int64_t **nboxes, int64_t *maxb)
{
    kpl_tensor *bx = kpl_batch_get(b, "boxes"), *lb = kpl_batch_get(b, "box_labels");
    kpl_tensor *nb = kpl_batch_get(b, "num_boxes");
    *boxes = kpl_tensor_host_data(bx);
    *labels = kpl_tensor_host_data(lb);
    *nboxes = kpl_tensor_host_data(nb);
    *maxb = kpl_tensor_dim(bx, 1);
    return *boxes && *labels && *nboxes ? KPL_OK : kpl_last_status();
}

static kpl_status forward(kpl_trainer *t, const kpl_batch *b, kpl_tensor_list *o)
{
    kpl_device *dev = kpl_trainer_device(t);
    kpl_tensor *x = b->image;
    if (kpl_device_type_of(dev) != KPL_DEVICE_CPU) x = kpl_to_device(b->image, dev);
    kpl_tensor_list in = {1, {x}};
    return x ? kpl_module_forward_list(kpl_trainer_model(t, 0), &in, o) : kpl_last_status();
}

/* The head's sums over the ranks (kpl_detector_ranks). */
static kpl_status rank_sum(void *ctx, double *v, int n) { return kpl_trainer_sum(ctx, v, n); }

static kpl_status train_step(kpl_trainer *t, void *state, const kpl_batch *b,
                             kpl_step_result *out)
{
    detect *d = state;
    const float *boxes;
    const int64_t *labels, *nboxes;
    int64_t maxb;
    KPL_TRY(batch_targets(b, &boxes, &labels, &nboxes, &maxb));
    kpl_tensor_list o;
    KPL_TRY(forward(t, b, &o));
    kpl_tensor *loss[4] = {NULL};
    kpl_detector_targets tg = {b->size, maxb, boxes, labels, nboxes};
    kpl_detector_ranks ranks = {rank_sum, t, kpl_trainer_world(t)};
    const kpl_detector_head *h = d->head;
    KPL_TRY(h->loss(d->head_state, &o, &tg, &ranks, loss));
    out->loss[0] = loss[0];
    for (int k = 1; k < h->nlosses; k++) out->loss[0] = kpl_add(out->loss[0], loss[k]);
    double n = (double)b->size;
    for (int k = 0; k < h->nlosses; k++)
        KPL_TRY(kpl_step_figure(out, h->loss_names[k],
                                kpl_scalar_op(KPL_BIN_MUL, kpl_detach(loss[k]), n, false), n));
    return out->loss[0] ? KPL_OK : kpl_last_status();
}

/* ---- ground truth --------------------------------------------------------------------------- */

static int find_feature(const kpl_dataset *ds, const char *name, kpl_feature_type type)
{
    int i = kpl_dataset_find_feature(ds, name);
    return i >= 0 && kpl_dataset_feature(ds, i)->type == type ? i : -1;
}

/* Element k of an int64 or float feature value (records may be unaligned). */
static int64_t i64_at(const kpl_feature_value *v, int64_t k)
{
    int64_t x;
    memcpy(&x, (const char *)v->data + 8 * k, 8);
    return x;
}
static float f32_at(const kpl_feature_value *v, int64_t k)
{
    float x;
    memcpy(&x, (const char *)v->data + 4 * k, 4);
    return x;
}

/* The category id of each label from METADATA's attributes.category_ids
 * (what --from coco writes; *given true), else label + 1 for now (load_gt
 * then takes the records' category_ids paired with their labels). */
static kpl_status label_categories(detect *d, const kpl_dataset *ds, const char *where,
                                   bool *given)
{
    for (int64_t k = 0; k < d->classes; k++) d->category[k] = k + 1;
    json_t *a = json_loads(kpl_dataset_attributes(ds), 0, NULL);
    json_t *ids = json_object_get(a, "category_ids");
    size_t n = json_array_size(ids);
    kpl_status st = KPL_OK;
    if (n > 0 && (int64_t)n != d->classes)
        st = KPL_ERROR(KPL_EINVAL, "%s: the dataset has %zu categories (attributes.category_ids) "
                       "and model.num_classes is %lld", where, n, (long long)d->classes);
    for (size_t k = 0; st >= 0 && k < n; k++) d->category[k] = json_integer_value(json_array_get(ids, k));
    *given = n > 0;
    json_decref(a);
    return st;
}

/* One label's category as a rank saw it in its records' category_ids: the
 * id, or NONE where none of its records named the label. */
#define NONE INT64_MIN

/* Every rank's category of each label merged into d->category: a label
 * two ranks (or two records) give different ids is an error naming both;
 * labels no record names take ids no label has, in label order. */
static kpl_status merge_categories(kpl_trainer *t, detect *d, const int64_t *seen, bool given,
                                   const char *path)
{
    size_t bytes = (size_t)d->classes * sizeof *seen;
    void *all = NULL;
    int32_t world = kpl_trainer_world(t);
    size_t *lens = calloc((size_t)world, sizeof *lens);
    KPL_CHECK(lens, KPL_ENOMEM, "eval: out of memory");
    kpl_status st = kpl_trainer_all_gather(t, seen, bytes, &all, lens);
    for (int32_t r = 0; st >= 0 && r < world; r++)
        if (lens[r] != bytes)
            st = KPL_ERROR(KPL_ESTATE, "eval: rank %d sent %zu bytes of categories, not %zu",
                           (int)r, lens[r], bytes);
    free(lens);
    const int64_t *cat = world > 1 ? all : seen;
    for (int64_t k = 0; st >= 0 && k < d->classes; k++) {
        int64_t c = NONE;
        for (int32_t r = 0; r < world; r++) {
            int64_t x = cat[r * d->classes + k];
            if (x == NONE) continue;
            if ((c != NONE && x != c) || (given && x != d->category[k])) {
                st = KPL_ERROR(KPL_EFORMAT, "%s: label %lld is category %lld in some records "
                               "and %lld %s", path, (long long)k, (long long)x,
                               (long long)(given ? d->category[k] : c),
                               given ? "in attributes.category_ids" : "in others");
                break;
            }
            c = x;
        }
        if (c != NONE) d->category[k] = c;
        else if (!given) d->category[k] = NONE;
    }
    free(all);
    KPL_TRY(st);
    /* labels the records never name take ids no label has */
    int64_t next = 1;
    for (int64_t k = 0; k < d->classes; k++)
        if (d->category[k] != NONE) next = d->category[k] >= next ? d->category[k] + 1 : next;
    for (int64_t k = 0; k < d->classes; k++)
        if (d->category[k] == NONE) d->category[k] = next++;
    for (int64_t k = 0; k < d->classes; k++)
        for (int64_t j = 0; j < k; j++)
            KPL_CHECK(d->category[j] != d->category[k], KPL_EFORMAT,
                      "%s: labels %lld and %lld are both category %lld", path, (long long)j,
                      (long long)k, (long long)d->category[k]);
    return KPL_OK;
}

/* The ground truth of examples ex[0..n) (ascending) of the validation
 * split: this rank's shard.  The first time (first: every rank at once)
 * the label -> category map is made too, merged over the ranks. */
static kpl_status load_gt(kpl_trainer *t, detect *d, const int64_t *ex, int64_t n, bool first)
{
    const kpl_recipe *r = kpl_trainer_recipe(t);
    const char *path = kpl_trainer_data_path(t, false);
    const char *fb = r->data.val.boxes_feature[0] ? r->data.val.boxes_feature : "boxes";
    const char *fl = r->data.val.box_labels_feature[0] ? r->data.val.box_labels_feature : "labels";
    if (!d->category) {
        d->category = malloc((size_t)d->classes * sizeof *d->category);
        KPL_CHECK(d->category, KPL_ENOMEM, "eval: out of memory");
        for (int64_t k = 0; k < d->classes; k++) d->category[k] = k + 1;
    }
    if (!d->image_id) {
        d->image_id = malloc((size_t)(d->examples + 1) * sizeof *d->image_id);
        KPL_CHECK(d->image_id, KPL_ENOMEM, "eval: out of memory");
        for (int64_t e = 0; e < d->examples; e++) d->image_id[e] = -1;
    }
    kpl_dataset *ds = NULL;
    kpl_status st = kpl_dataset_open(path, &ds);
    int fi = -1, fbx = -1, flb = -1, fcat = -1, fcrowd = -1, fdiff = -1, farea = -1;
    if (st >= 0) {
        fi = find_feature(ds, "image_id", KPL_FEATURE_INT64);
        fbx = find_feature(ds, fb, KPL_FEATURE_FLOAT), flb = find_feature(ds, fl, KPL_FEATURE_INT64);
        fcat = find_feature(ds, "category_ids", KPL_FEATURE_INT64);
        fcrowd = find_feature(ds, "iscrowd", KPL_FEATURE_INT64);
        fdiff = find_feature(ds, "difficult", KPL_FEATURE_INT64);
        farea = find_feature(ds, "area", KPL_FEATURE_FLOAT);
    }
    kpl_chunk *chunk = kpl_chunk_create();
    int nf = ds ? kpl_dataset_num_features(ds) : 0;
    kpl_feature_value *v = calloc((size_t)(nf ? nf : 1), sizeof *v);
    kpl_coco_annotation *ann = NULL;
    int64_t nann = 0, cap = 0, *ids = malloc((size_t)(n + 1) * sizeof *ids);
    int64_t *seen = malloc((size_t)d->classes * sizeof *seen);
    bool given = false;
    if (st >= 0 && (!chunk || !v || !ids || !seen)) st = KPL_ERROR(KPL_ENOMEM, "eval: out of memory");
    if (st >= 0 && (fbx < 0 || flb < 0))
        st = KPL_ERROR(KPL_EINVAL, "%s: detection's evaluation needs the float feature '%s' and "
                       "the int64 feature '%s' (data.val.boxes_feature, box_labels_feature)", path,
                       fb, fl);
    if (st >= 0 && first) st = label_categories(d, ds, path, &given);
    for (int64_t k = 0; seen && k < d->classes; k++) seen[k] = NONE;
    for (int64_t q = 0; st >= 0 && q < n; q++) {
        int64_t e = ex[q];
        if ((st = kpl_dataset_read_example(ds, e, chunk, v)) < 0) break;
        ids[q] = d->image_id[e] = fi >= 0 && v[fi].count == 1 ? i64_at(&v[fi], 0) : e;
        int64_t nb = v[flb].count;
        if (v[fbx].count != 4 * nb) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: example %lld: %u box values for %lld labels", path,
                           (long long)e, v[fbx].count, (long long)nb);
            break;
        }
        for (int64_t k = 0; st >= 0 && k < nb; k++) {
            int64_t y = i64_at(&v[flb], k);
            if (y < 0 || y >= d->classes) {
                st = KPL_ERROR(KPL_EFORMAT, "%s: example %lld, box %lld: label %lld is not in "
                               "[0, %lld) (model.num_classes)", path, (long long)e, (long long)k,
                               (long long)y, (long long)d->classes);
                break;
            }
            if (nann == cap) {
                cap = cap ? 2 * cap : 1024;
                kpl_coco_annotation *p = realloc(ann, (size_t)cap * sizeof *ann);
                if (!p) {
                    st = KPL_ERROR(KPL_ENOMEM, "eval: out of memory");
                    break;
                }
                ann = p;
            }
            kpl_coco_annotation *a = &ann[nann];
            float x0 = f32_at(&v[fbx], 4 * k), y0 = f32_at(&v[fbx], 4 * k + 1);
            float x1 = f32_at(&v[fbx], 4 * k + 2), y1 = f32_at(&v[fbx], 4 * k + 3);
            a->id = nann + 1;
            a->image_id = ids[q];
            /* one category per label, the same in every record */
            if (fcat >= 0 && v[fcat].count == (uint32_t)nb) {
                int64_t c = i64_at(&v[fcat], k);
                if (seen[y] != NONE && c != seen[y]) {
                    st = KPL_ERROR(KPL_EFORMAT, "%s: example %lld, box %lld: category id %lld, "
                                   "but label %lld is category %lld in an earlier example", path,
                                   (long long)e, (long long)k, (long long)c, (long long)y,
                                   (long long)seen[y]);
                    break;
                }
                seen[y] = c;
            }
            a->category_id = y; /* the label: its category once the map is made */
            a->bbox[0] = x0, a->bbox[1] = y0, a->bbox[2] = x1 - x0, a->bbox[3] = y1 - y0;
            a->area = farea >= 0 && v[farea].count == (uint32_t)nb
                          ? f32_at(&v[farea], k)
                          : a->bbox[2] * a->bbox[3];
            /* VOC's difficult objects are ignored as COCO ignores crowds */
            a->iscrowd = (fcrowd >= 0 && v[fcrowd].count == (uint32_t)nb && i64_at(&v[fcrowd], k)) ||
                         (fdiff >= 0 && v[fdiff].count == (uint32_t)nb && i64_at(&v[fdiff], k));
            nann++;
        }
    }
    /* the map is made by every rank together, even by one that failed */
    if (first && seen) {
        kpl_status ms = merge_categories(t, d, seen, given, path);
        if (st >= 0) st = ms;
    }
    for (int64_t i = 0; st >= 0 && i < nann; i++) {
        int64_t y = ann[i].category_id;
        if (seen[y] != NONE && seen[y] != d->category[y]) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: label %lld is category %lld in these records, %lld "
                           "in the first evaluation's", path, (long long)y, (long long)seen[y],
                           (long long)d->category[y]);
            break;
        }
        ann[i].category_id = d->category[y];
    }
    kpl_coco_gt_destroy(d->gt);
    d->gt = NULL;
    if (st >= 0)
        st = kpl_coco_gt_create(ids, n, d->category, d->classes, ann, nann, &d->gt);
    if (st >= 0) {
        free(d->gt_ex);
        d->gt_ex = malloc((size_t)(n + 1) * sizeof *d->gt_ex);
        if (!d->gt_ex) st = KPL_ERROR(KPL_ENOMEM, "eval: out of memory");
        else memcpy(d->gt_ex, ex, (size_t)n * sizeof *ex), d->ngt_ex = n;
    }
    if (st < 0) kpl_coco_gt_destroy(d->gt), d->gt = NULL;
    free(seen), free(ids), free(ann), free(v);
    kpl_chunk_destroy(chunk);
    kpl_dataset_close(ds);
    return st;
}

/* ---- evaluation ------------------------------------------------------------------------------ */

static kpl_status eval_begin(kpl_trainer *t, void *state)
{
    detect *d = state;
    int64_t n = kpl_trainer_data_examples(t, false);
    if (n != d->examples) { /* another split length: what was read is of no use */
        free(d->image_id), d->image_id = NULL;
        kpl_coco_gt_destroy(d->gt), d->gt = NULL;
        d->ngt_ex = 0;
        d->examples = n;
    }
    d->ndets = 0;
    d->nmine = 0;
    d->have_stats = false;
    tb_free(d);
    return KPL_OK;
}

/* Notes example e as one this rank evaluates. */
static kpl_status add_mine(detect *d, int64_t e)
{
    if (d->nmine == d->capmine) {
        int64_t cap = d->capmine ? 2 * d->capmine : 256;
        int64_t *p = realloc(d->mine, (size_t)cap * sizeof *p);
        KPL_CHECK(p, KPL_ENOMEM, "eval: out of memory");
        d->mine = p, d->capmine = cap;
    }
    d->mine[d->nmine++] = e;
    return KPL_OK;
}

static kpl_status add_det(detect *d, const kpl_coco_detection *x)
{
    if (d->ndets == d->capdets) {
        int64_t cap = d->capdets ? 2 * d->capdets : 4096;
        kpl_coco_detection *p = realloc(d->dets, (size_t)cap * sizeof *p);
        KPL_CHECK(p, KPL_ENOMEM, "eval: out of memory for %lld detections", (long long)cap);
        d->dets = p, d->capdets = cap;
    }
    d->dets[d->ndets++] = *x;
    return KPL_OK;
}

/* Image i of b as 8-bit RGB for TensorBoard (the normalisation undone). */
static kpl_status keep_tb_image(kpl_trainer *t, detect *d, const kpl_batch *b, int64_t i, int h,
                                int w, int64_t nb, const float *gtb, const int64_t *gtl, int64_t nd,
                                const float *db, const int64_t *dl, const float *ds)
{
    const kpl_transform_config *x = &kpl_trainer_recipe(t)->data.val.loader.transform;
    const float *img = kpl_tensor_host_data(b->image);
    if (!img || kpl_tensor_dtype(b->image) != KPL_F32) return KPL_OK; /* u8 batches: none */
    int64_t C = kpl_tensor_dim(b->image, 1), H = kpl_tensor_dim(b->image, 2), W = kpl_tensor_dim(b->image, 3);
    tb_image *p = realloc(d->tb, (size_t)(d->ntb + 1) * sizeof *p);
    KPL_CHECK(p, KPL_ENOMEM, "eval: out of memory");
    d->tb = p;
    tb_image *ti = &d->tb[d->ntb];
    memset(ti, 0, sizeof *ti);
    int ndraw = 0;
    while (ndraw < nd && ds[ndraw] >= 0.3f && ndraw < 32) ndraw++;
    ti->h = h, ti->w = w, ti->ngt = (int)nb, ti->ndet = ndraw;
    ti->rgb = malloc((size_t)h * w * 3);
    ti->box = malloc((size_t)(nb + ndraw + 1) * 4 * sizeof *ti->box);
    ti->label = malloc((size_t)(nb + ndraw + 1) * sizeof *ti->label);
    d->ntb++;
    KPL_CHECK(ti->rgb && ti->box && ti->label, KPL_ENOMEM, "eval: out of memory");
    kpl_tb_rgb8(img, C, H, W, i, h, w, x->std, x->mean, ti->rgb, w);
    memcpy(ti->box, gtb, (size_t)nb * 4 * sizeof *gtb);
    memcpy(ti->label, gtl, (size_t)nb * sizeof *gtl);
    memcpy(ti->box + 4 * nb, db, (size_t)ndraw * 4 * sizeof *db);
    memcpy(ti->label + nb, dl, (size_t)ndraw * sizeof *dl);
    return KPL_OK;
}

static kpl_status eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    detect *d = state;
    kpl_tensor_list o;
    KPL_TRY(forward(t, b, &o));
    const int64_t *ex = kpl_tensor_host_data(b->example);
    const int64_t *isz = kpl_tensor_host_data(kpl_batch_get(b, "image_size"));
    const int64_t *osz = kpl_tensor_host_data(kpl_batch_get(b, "orig_size"));
    const float *gtb = NULL;
    const int64_t *gtl = NULL, *gtn = NULL;
    int64_t maxb = 0;
    KPL_TRY(batch_targets(b, &gtb, &gtl, &gtn, &maxb));
    int64_t Hb = kpl_tensor_dim(b->image, 2), Wb = kpl_tensor_dim(b->image, 3);
    size_t nd = (size_t)(b->size * d->max_dets);
    float *boxes = malloc(nd * 4 * sizeof *boxes), *scores = malloc(nd * sizeof *scores);
    int64_t *labs = malloc(nd * sizeof *labs), *count = malloc((size_t)b->size * sizeof *count);
    double *img_hw = malloc((size_t)b->size * 2 * sizeof *img_hw);
    kpl_status st = boxes && scores && labs && count && img_hw && ex
                        ? KPL_OK
                        : KPL_ERROR(KPL_ENOMEM, "eval: out of memory");
    /* each image's own size (keep_ratio), else the batch's */
    for (int64_t i = 0; st >= 0 && i < b->size; i++) {
        img_hw[2 * i] = isz ? (double)isz[2 * i] : (double)Hb;
        img_hw[2 * i + 1] = isz ? (double)isz[2 * i + 1] : (double)Wb;
    }
    kpl_detector_decode dc = {d->classes, d->topk, d->max_dets, d->score_thresh, d->nms_iou};
    if (st >= 0)
        st = d->head->decode(d->head_state, &o, &dc, b->size, img_hw, boxes, scores, labs, count);
    bool tb = kpl_trainer_rank(t) == 0;
    for (int64_t i = 0; st >= 0 && i < b->size; i++) {
        if (!kpl_trainer_eval_counts(t, b, i)) continue; /* a repeat */
        int64_t e = ex[i];
        if (e < 0 || e >= d->examples) {
            st = KPL_ERROR(KPL_ESTATE, "detection: example %lld is not among the %lld of the "
                           "ground truth", (long long)e, (long long)d->examples);
            break;
        }
        if ((st = add_mine(d, e)) < 0) break;
        double ih = img_hw[2 * i], iw = img_hw[2 * i + 1];
        double oh = osz ? (double)osz[2 * i] : ih, ow = osz ? (double)osz[2 * i + 1] : iw;
        int64_t k = count[i];
        const float *box = boxes + 4 * i * d->max_dets, *score = scores + i * d->max_dets;
        const int64_t *lab = labs + i * d->max_dets;
        double sx = ow / iw, sy = oh / ih;
        for (int64_t j = 0; st >= 0 && j < k; j++) {
            const float *p = box + 4 * j;
            kpl_coco_detection x = {e, lab[j], /* the image id and category at eval_end */
                                    {p[0] * sx, p[1] * sy, (p[2] - p[0]) * sx, (p[3] - p[1]) * sy},
                                    score[j]};
            st = add_det(d, &x);
        }
        if (st >= 0 && tb && d->ntb < d->tb_images)
            st = keep_tb_image(t, d, b, i, (int)ih, (int)iw, gtn[i], gtb + i * maxb * 4,
                               gtl + i * maxb, k, box, lab, score);
    }
    free(boxes), free(scores), free(labs), free(count), free(img_hw);
    return st;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Every rank's detections to every rank (for detections.json), the
 * matching of its own shard's (the parts) to every rank, and the figures
 * from the parts: each rank reads and matches only the ground truth of
 * the images it evaluated. */
static kpl_status eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    detect *d = state;
    int32_t world = kpl_trainer_world(t);
    /* this rank's examples, ascending; the shard's ground truth read when
     * they are not the ones read before (the first evaluation: every rank
     * at once, as the label -> category map is made together) */
    qsort(d->mine, (size_t)d->nmine, sizeof *d->mine, cmp_i64);
    bool first = !d->category || !d->image_id, same = !first && d->gt && d->ngt_ex == d->nmine;
    for (int64_t i = 0; same && i < d->nmine; i++) same = d->gt_ex[i] == d->mine[i];
    if (!same) KPL_TRY(load_gt(t, d, d->mine, d->nmine, first));
    for (int64_t i = 0; i < d->ndets; i++) {
        kpl_coco_detection *x = &d->dets[i];
        x->image_id = d->image_id[x->image_id], x->category_id = d->category[x->category_id];
    }
    void *part = NULL, *parts = NULL, *all = NULL;
    size_t bytes = 0;
    size_t *lens = calloc((size_t)world, sizeof *lens);
    KPL_CHECK(lens, KPL_ENOMEM, "eval: out of memory");
    kpl_status st = kpl_coco_match(d->gt, d->dets, d->ndets, &part, &bytes);
    /* every rank gathers, also one whose matching failed (it sends nothing) */
    kpl_status gs = kpl_trainer_all_gather(t, part, st >= 0 ? bytes : 0, &parts, lens);
    size_t total = 0;
    for (int32_t r = 0; r < world; r++) total += lens[r];
    if (st >= 0) st = gs;
    if (st >= 0) st = kpl_coco_finish(world > 1 ? parts : part, total, &d->stats);
    free(part), free(parts);
    /* the detections of every rank, for the file */
    gs = kpl_trainer_all_gather(t, d->dets, (size_t)d->ndets * sizeof *d->dets, &all, lens);
    if (st >= 0) st = gs;
    total = 0;
    for (int32_t r = 0; r < world; r++) total += lens[r];
    free(lens);
    kpl_coco_detection *dets = world > 1 ? all : d->dets;
    int64_t n = (int64_t)(total / sizeof *dets);
    const char *dir = kpl_trainer_run_dir(t);
    if (st >= 0 && kpl_trainer_rank(t) == 0 && (d->save[0] || dir[0])) {
        char path[4096];
        if (d->save[0]) snprintf(path, sizeof path, "%s", d->save);
        else snprintf(path, sizeof path, "%s/detections.json", dir);
        st = kpl_coco_dets_save(path, dets, n); /* whole or not at all */
    }
    free(all);
    KPL_TRY(st);
    d->have_stats = true;
    res->examples = d->stats.images;
    for (int k = 0; k < KPL_COCO_NSTATS; k++) {
        char name[16];
        snprintf(name, sizeof name, "%s", kpl_coco_stat_name((kpl_coco_stat)k));
        for (char *p = name; *p; p++) *p = (char)(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
        KPL_TRY(kpl_figures_set(&res->metrics, name, d->stats.stats[k]));
    }
    return KPL_OK;
}

/* pycocotools' summary, as COCOeval.summarize() prints it. */
static void eval_report(kpl_trainer *t, void *state)
{
    detect *d = state;
    if (!d->have_stats) return;
    static const struct {
        bool ap;
        const char *iou, *area;
        int dets;
    } row[KPL_COCO_NSTATS] = {
        {true, "0.50:0.95", "all", 100},   {true, "0.50", "all", 100},
        {true, "0.75", "all", 100},        {true, "0.50:0.95", "small", 100},
        {true, "0.50:0.95", "medium", 100}, {true, "0.50:0.95", "large", 100},
        {false, "0.50:0.95", "all", 1},    {false, "0.50:0.95", "all", 10},
        {false, "0.50:0.95", "all", 100},  {false, "0.50:0.95", "small", 100},
        {false, "0.50:0.95", "medium", 100}, {false, "0.50:0.95", "large", 100},
    };
    kpl_trainer_info(t, "COCO bbox: %lld images, %lld ground-truth boxes, %lld detections",
                     (long long)d->stats.images, (long long)d->stats.gt_boxes,
                     (long long)d->stats.detections);
    for (int k = 0; k < KPL_COCO_NSTATS; k++)
        kpl_trainer_info(t, " %-18s %s @[ IoU=%-9s | area=%6s | maxDets=%3d ] = %.3f",
                         row[k].ap ? "Average Precision" : "Average Recall",
                         row[k].ap ? "(AP)" : "(AR)",
                         row[k].iou, row[k].area, row[k].dets, d->stats.stats[k]);
}

/* ---- TensorBoard ------------------------------------------------------------------------------- */

static void draw_rect(uint8_t *rgb, int h, int w, const float *b, const uint8_t *color)
{
    int x0 = (int)fminf(fmaxf(b[0], 0), (float)w - 1), y0 = (int)fminf(fmaxf(b[1], 0), (float)h - 1);
    int x1 = (int)fminf(fmaxf(b[2], 0), (float)w - 1), y1 = (int)fminf(fmaxf(b[3], 0), (float)h - 1);
    for (int x = x0; x <= x1; x++)
        for (int k = 0; k < 3; k++) rgb[((size_t)y0 * w + x) * 3 + k] = rgb[((size_t)y1 * w + x) * 3 + k] = color[k];
    for (int y = y0; y <= y1; y++)
        for (int k = 0; k < 3; k++) rgb[((size_t)y * w + x0) * 3 + k] = rgb[((size_t)y * w + x1) * 3 + k] = color[k];
}

static kpl_status images(kpl_trainer *t, void *state, kpl_tb_writer *tb, int64_t step)
{
    (void)t;
    detect *d = state;
    static const uint8_t gt_color[3] = {0, 220, 0}, det_color[3] = {255, 40, 40};
    for (int i = 0; i < d->ntb; i++) {
        tb_image *ti = &d->tb[i];
        if (!ti->rgb || ti->h <= 0 || ti->w <= 0) continue;
        for (int k = 0; k < ti->ngt + ti->ndet; k++)
            draw_rect(ti->rgb, ti->h, ti->w, ti->box + 4 * k, k < ti->ngt ? gt_color : det_color);
        char tag[64];
        snprintf(tag, sizeof tag, "val/detections_%d", i);
        KPL_TRY(kpl_tb_add_image(tb, tag, step, ti->h, ti->w, 3, ti->rgb));
    }
    return KPL_OK;
}

const kpl_task_kind kpl_task_detection = {
    .name = "detection",
    .best_metric = "ap",
    .best_higher = true,
    .create = create,
    .destroy = destroy,
    .train_step = train_step,
    .eval_begin = eval_begin,
    .eval_batch = eval_batch,
    .eval_end = eval_end,
    .eval_report = eval_report,
    .data = data,
    .images = images,
    .keys = keys,
    .needs = needs,
};
