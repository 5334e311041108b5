/*
 * segment.c — the semantic segmentation task: a model that gives class
 * logits per pixel at the input's size (the zoo's deeplabv3 and unet, or a
 * registered model doing the same), trained with per-pixel cross-entropy
 * (class weights, an ignored label), Dice, or both, plus an auxiliary
 * head's loss; evaluated with the confusion matrix of every rank's pixels
 * (docs/segmentation.md):
 *
 *   IoU_c  = TP_c / (TP_c + FP_c + FN_c)   (classes that never occur in
 *            the ground truth or the predictions are left out of the mean,
 *            as mmsegmentation's nanmean)
 *   miou   = mean IoU_c;  aacc = sum TP / pixels;  macc = mean TP_c / (TP_c + FN_c)
 *
 * Evaluation runs on the whole image as the validation loader gives it
 * (keep_ratio with a short side of 0 gives the stored size), or in sliding
 * windows (task.segmentation.eval_mode slide) whose logits are averaged
 * where they overlap (mmsegmentation's slide_inference).
 */
#include "trainer.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum { LOSS_CE, LOSS_DICE, LOSS_CE_DICE };

/* A validation image kept for TensorBoard: RGB, ground truth, prediction. */
typedef struct {
    int h, w;
    uint8_t *rgb, *gt, *pred;
} tb_image;

typedef struct {
    int64_t classes, ignore;
    int loss;
    double aux_weight, dice_weight, dice_smooth;
    float *class_weight; /* (classes) or NULL */
    bool slide;
    int64_t crop[2], stride[2];
    int64_t tb_images;
    const char *save;    /* predictions directory, "" for none */
    double *conf;        /* classes x classes: true row, predicted column */
    double sums[3];      /* loss, loss pixels, nonfinite images */
    char **names;        /* class names (classes.txt beside the validation split) or NULL */
    char **stems;        /* validation examples' file stems (when saving) or NULL */
    int64_t nstems;
    double *iou, *acc;   /* per class, after eval_end */
    bool have_iou;
    tb_image *tb;
    int ntb;
} segment;

static void free_strings(char **s, int64_t n)
{
    if (s)
        for (int64_t i = 0; i < n; i++) free(s[i]);
    free(s);
}

static void tb_free(segment *s)
{
    for (int i = 0; i < s->ntb; i++) free(s->tb[i].rgb), free(s->tb[i].gt), free(s->tb[i].pred);
    free(s->tb);
    s->tb = NULL, s->ntb = 0;
}

static void destroy(void *state)
{
    segment *s = state;
    if (!s) return;
    free(s->class_weight), free(s->conf), free(s->iou), free(s->acc);
    free_strings(s->names, s->classes);
    free_strings(s->stems, s->nstems);
    tb_free(s);
    free(s);
}

/* task.segmentation.<key> */
static const kpl_key keys[] = {
    {"ignore_index", KPL_KEY_INT, "255", 0, 255, NULL,
     "the mask value that is no class: left out of the loss and the metrics (also what padding "
     "gets)"},
    {"loss", KPL_KEY_CHOICE, "ce", 0, 0, "ce|dice|ce_dice",
     "per-pixel cross-entropy, soft Dice (mmsegmentation's), or their sum"},
    {"class_weights", KPL_KEY_FLOATS, "[]", 0, 1e6, NULL,
     "cross-entropy weight per class (num_classes values; []: all 1)"},
    {"dice_weight", KPL_KEY_FLOAT, "1.0", 0, 1e3, NULL, "ce_dice: the Dice term's weight"},
    {"dice_smooth", KPL_KEY_FLOAT, "1.0", 0, 1e6, NULL,
     "Dice: added to numerator and denominator"},
    {"aux_weight", KPL_KEY_FLOAT, "0.4", 0, 10, NULL,
     "the weight of an auxiliary head's cross-entropy (a model's second output in training)"},
    {"eval_mode", KPL_KEY_CHOICE, "whole", 0, 0, "whole|slide",
     "inference on the whole validation image, or in overlapping windows"},
    {"crop_size", KPL_KEY_INTS, "[512, 512]", 1, 65536, NULL,
     "slide: the windows' [height, width]"},
    {"stride", KPL_KEY_INTS, "[341, 341]", 1, 65536, NULL, "slide: the windows' [dy, dx]"},
    {"save_predictions", KPL_KEY_STRING, "\"\"", 0, 0, NULL,
     "a directory each evaluation writes the predicted masks into (8-bit PNG named by the "
     "example's path, else its number; \"\": none)"},
    {"tb_images", KPL_KEY_INT, "4", 0, 64, NULL,
     "validation images shown in TensorBoard with their ground truth and prediction"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};
static const char *const needs[] = {"model.name", "model.num_classes", NULL};

/* classes.txt in the validation split's directory (the converters' OUT),
 * one name per line; NULL when it is missing or does not match. */
static char **read_names(const char *dir, int64_t classes)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/classes.txt", dir);
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    char **names = calloc((size_t)classes, sizeof *names), line[256];
    int64_t n = 0;
    while (names && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (n < classes) names[n] = strdup(line);
        n++;
    }
    fclose(f);
    if (n != classes) {
        free_strings(names, classes);
        return NULL;
    }
    return names;
}

/* The rules joining the task's keys with each other and the model's, as
 * the recipe loads (task.h's check) and again at create for a recipe made
 * by hand. */
static kpl_status check(const kpl_recipe *r, const kpl_keyvals *kv, const char **key)
{
    int64_t classes = r->model.num_classes;
    *key = "model.num_classes";
    KPL_CHECK(classes >= 2 && classes <= 255, KPL_EINVAL, "segmentation needs 2 to 255 classes "
              "(masks are 8-bit), got %lld", (long long)classes);
    int64_t ignore = 0;
    KPL_TRY(kpl_key_int(kv, "ignore_index", &ignore));
    *key = "task.segmentation.ignore_index";
    KPL_CHECK(ignore >= classes, KPL_EINVAL, "%lld is a class (model.num_classes %lld): it must "
              "be %lld or more", (long long)ignore, (long long)classes, (long long)classes);
    double w[256], sum = 0;
    int nw = 0, n = 0;
    *key = "task.segmentation.class_weights";
    KPL_TRY(kpl_key_floats(kv, "class_weights", w, 256, &nw));
    KPL_CHECK(nw == 0 || nw == classes, KPL_EINVAL, "%d values for %lld classes "
              "(model.num_classes), or [] for all 1", nw, (long long)classes);
    for (int i = 0; i < nw; i++) sum += w[i];
    KPL_CHECK(nw == 0 || sum > 0, KPL_EINVAL, "every weight is 0: no pixel would count in the "
              "loss");
    int64_t crop[2], stride[2];
    const char *mode = NULL;
    KPL_TRY(kpl_key_string(kv, "eval_mode", &mode));
    *key = "task.segmentation.crop_size";
    KPL_TRY(kpl_key_ints(kv, "crop_size", crop, 2, &n));
    KPL_CHECK(n == 2, KPL_EINVAL, "want [height, width], got %d values", n);
    *key = "task.segmentation.stride";
    KPL_TRY(kpl_key_ints(kv, "stride", stride, 2, &n));
    KPL_CHECK(n == 2, KPL_EINVAL, "want [dy, dx], got %d values", n);
    if (!strcmp(mode, "slide"))
        for (int d = 0; d < 2; d++)
            KPL_CHECK(stride[d] <= crop[d], KPL_EINVAL, "[%lld, %lld] is larger than "
                      "task.segmentation.crop_size [%lld, %lld]: the windows would leave pixels "
                      "between them unpredicted (want stride <= crop_size)",
                      (long long)stride[0], (long long)stride[1], (long long)crop[0],
                      (long long)crop[1]);
    *key = NULL;
    return KPL_OK;
}

/* Slide evaluation's window through the model once: a window smaller
 * than the model can take (its total stride) fails at start-up naming the
 * key, not after an epoch. */
static kpl_status probe_window(kpl_trainer *t, segment *s, const char *file)
{
    const int64_t *chw = kpl_trainer_input_shape(t);
    int64_t shape[4] = {1, chw[0], s->crop[0], s->crop[1]}, out[KPL_MAX_DIMS];
    int nd = 0;
    kpl_status st = kpl_module_probe(kpl_trainer_model(t, 0), 4, shape, &nd, out);
    if (st >= 0 && (nd != 4 || out[2] != s->crop[0] || out[3] != s->crop[1]))
        st = KPL_ERROR(KPL_ESHAPE, "the model gives no (N, classes, %lld, %lld) logits for it",
                       (long long)s->crop[0], (long long)s->crop[1]);
    if (st < 0)
        return kpl_error_prefix(st, "%s: task.segmentation.crop_size: the model cannot evaluate "
                                 "a %lld x %lld window (smaller than its total stride?): ", file,
                                 (long long)s->crop[0], (long long)s->crop[1]);
    return KPL_OK;
}

static kpl_status create(kpl_trainer *t, void **state)
{
    const kpl_recipe *r = kpl_trainer_recipe(t);
    const kpl_keyvals *kv = kpl_trainer_task_keys(t);
    const char *file = *r->file ? r->file : "recipe";
    const int64_t *chw = kpl_trainer_input_shape(t);
    segment *s = calloc(1, sizeof *s);
    KPL_CHECK(s, KPL_ENOMEM, "out of memory");
    *state = s;
    s->classes = r->model.num_classes;
    const char *bad = NULL;
    kpl_status cst = check(r, kv, &bad);
    if (cst < 0) return bad ? kpl_error_prefix(cst, "%s: %s: ", file, bad) : cst;
    KPL_TRY(kpl_key_int(kv, "ignore_index", &s->ignore));
    const char *loss = NULL, *mode = NULL;
    KPL_TRY(kpl_key_string(kv, "loss", &loss));
    s->loss = !strcmp(loss, "ce") ? LOSS_CE : !strcmp(loss, "dice") ? LOSS_DICE : LOSS_CE_DICE;
    double w[256];
    int nw = 0;
    KPL_TRY(kpl_key_floats(kv, "class_weights", w, 256, &nw));
    if (nw) {
        s->class_weight = malloc((size_t)nw * sizeof *s->class_weight);
        KPL_CHECK(s->class_weight, KPL_ENOMEM, "out of memory");
        for (int i = 0; i < nw; i++) s->class_weight[i] = (float)w[i];
    }
    KPL_TRY(kpl_key_float(kv, "dice_weight", &s->dice_weight));
    KPL_TRY(kpl_key_float(kv, "dice_smooth", &s->dice_smooth));
    KPL_TRY(kpl_key_float(kv, "aux_weight", &s->aux_weight));
    KPL_TRY(kpl_key_string(kv, "eval_mode", &mode));
    s->slide = !strcmp(mode, "slide");
    int n = 0;
    KPL_TRY(kpl_key_ints(kv, "crop_size", s->crop, 2, &n));
    KPL_TRY(kpl_key_ints(kv, "stride", s->stride, 2, &n));
    KPL_TRY(kpl_key_int(kv, "tb_images", &s->tb_images));
    KPL_TRY(kpl_key_string(kv, "save_predictions", &s->save));
    s->conf = calloc((size_t)(s->classes * s->classes), sizeof *s->conf);
    s->iou = calloc((size_t)s->classes, sizeof *s->iou);
    s->acc = calloc((size_t)s->classes, sizeof *s->acc);
    KPL_CHECK(s->conf && s->iou && s->acc, KPL_ENOMEM, "out of memory");
    const char *val = kpl_trainer_data_path(t, false);
    if (val[0]) s->names = read_names(val, s->classes);

    kpl_model_config mc = r->model;
    mc.in_channels = chw[0], mc.in_h = chw[1], mc.in_w = chw[2];
    kpl_module *m = NULL;
    KPL_TRY(kpl_zoo_create(&mc, kpl_trainer_device(t), (uint64_t)r->seed, &m));
    char label[64];
    if (!strcmp(mc.name, "deeplabv3"))
        snprintf(label, sizeof label, "deeplabv3_r%lld", (long long)(mc.depth ? mc.depth : 50));
    else
        snprintf(label, sizeof label, "%s", mc.name);
    KPL_TRY(kpl_trainer_add_model(t, "model", label, m, NULL, NULL));
    return s->slide ? probe_window(t, s, file) : KPL_OK;
}

/* The mask feature a split's batches carry (the converters' "mask"),
 * padded with the ignored value; no image label. */
static void data(const kpl_recipe *r, bool train, kpl_loader_config *c)
{
    (void)train;
    kpl_transform_config *x = &c->transform;
    x->label_feature = NULL;
    if (!x->mask_feature) x->mask_feature = "mask";
    int64_t ignore = 255; /* the default, when the recipe's value is not there yet */
    if (kpl_key_int(&r->task_keys, "ignore_index", &ignore) < 0 || ignore < 0 || ignore > 255)
        ignore = 255;
    x->mask_pad = (int)ignore;
}

/* ---- training ---------------------------------------------------------------------------------- */

static kpl_status forward(kpl_trainer *t, kpl_tensor *x, kpl_tensor_list *o)
{
    kpl_device *dev = kpl_trainer_device(t);
    if (kpl_device_type_of(dev) != KPL_DEVICE_CPU) x = kpl_to_device(x, dev);
    kpl_tensor_list in = {1, {x}};
    return x ? kpl_module_forward_list(kpl_trainer_model(t, 0), &in, o) : kpl_last_status();
}

/* Checks that every mask value of b is a class or the ignored value, and
 * counts the pixels that count.  A bad value is the data's fault: the
 * message names the example and the pixel. */
static kpl_status check_mask(const segment *s, const kpl_batch *b, int64_t *valid)
{
    const uint8_t *m = kpl_tensor_host_data(b->mask);
    const int64_t *ex = kpl_tensor_host_data(b->example);
    if (!m) return kpl_last_status();
    int64_t H = kpl_tensor_dim(b->mask, 1), W = kpl_tensor_dim(b->mask, 2), n = 0;
    for (int64_t i = 0; i < b->size; i++)
        for (int64_t p = 0; p < H * W; p++) {
            int64_t v = m[i * H * W + p];
            if (v == s->ignore) continue;
            KPL_CHECK(v < s->classes, KPL_EINVAL, "segmentation: example %lld, pixel (%lld, %lld): "
                      "mask value %lld is neither a class (model.num_classes %lld) nor "
                      "task.segmentation.ignore_index %lld", ex ? (long long)ex[i] : (long long)i,
                      (long long)(p / W), (long long)(p % W), (long long)v,
                      (long long)s->classes, (long long)s->ignore);
            n++;
        }
    *valid = n;
    return KPL_OK;
}

/* The class weights where the logits are (pool-owned), or NULL. */
static kpl_tensor *weights_on(const segment *s, kpl_tensor *like)
{
    if (!s->class_weight) return NULL;
    kpl_tensor *w = NULL;
    if (kpl_tensor_from_data(kpl_tensor_device(like), KPL_F32, 1, &s->classes, s->class_weight,
                             &w) < 0)
        return NULL;
    return kpl_autorelease(w);
}

/* The main loss of logits (N, C, H, W) against labels (N, H, W). */
static kpl_tensor *seg_loss(const segment *s, kpl_tensor *logits, kpl_tensor *labels)
{
    kpl_tensor *ce = NULL, *dice = NULL;
    if (s->loss != LOSS_DICE)
        ce = kpl_cross_entropy_weighted(logits, labels, weights_on(s, logits), KPL_REDUCE_MEAN,
                                        0, s->ignore);
    if (s->loss != LOSS_CE)
        dice = kpl_dice_loss(logits, labels, s->ignore, s->dice_smooth, 2, KPL_REDUCE_MEAN);
    if (s->loss == LOSS_CE) return ce;
    if (s->loss == LOSS_DICE) return dice;
    return kpl_add(ce, kpl_scalar_op(KPL_BIN_MUL, dice, s->dice_weight, false));
}

static kpl_status train_step(kpl_trainer *t, void *state, const kpl_batch *b,
                             kpl_step_result *out)
{
    segment *s = state;
    int64_t valid = 0;
    KPL_TRY(check_mask(s, b, &valid));
    kpl_tensor_list o;
    KPL_TRY(forward(t, b->image, &o));
    kpl_tensor *logits = o.t[0];
    KPL_CHECK(kpl_tensor_ndim(logits) == 4 && kpl_tensor_dim(logits, 1) == s->classes &&
                  kpl_tensor_dim(logits, 2) == kpl_tensor_dim(b->mask, 1) &&
                  kpl_tensor_dim(logits, 3) == kpl_tensor_dim(b->mask, 2),
              KPL_ESHAPE, "model.name: the segmentation task wants per-pixel logits (N, "
              "num_classes %lld, H, W) at the input's size, and model '%s' gives (%lld, %lld, "
              "%lld, %lld) for a (%lld, %lld, %lld) mask (use deeplabv3 or unet)",
              (long long)s->classes, kpl_trainer_recipe(t)->model.name,
              (long long)kpl_tensor_dim(logits, 0), (long long)kpl_tensor_dim(logits, 1),
              (long long)kpl_tensor_dim(logits, 2), (long long)kpl_tensor_dim(logits, 3),
              (long long)kpl_tensor_dim(b->mask, 0), (long long)kpl_tensor_dim(b->mask, 1),
              (long long)kpl_tensor_dim(b->mask, 2));
    kpl_tensor *labels = kpl_cast(kpl_to_device(b->mask, kpl_tensor_device(logits)), KPL_I64);
    kpl_tensor *loss = seg_loss(s, logits, labels);
    if (o.n > 1 && s->aux_weight > 0) {
        kpl_tensor *aux = kpl_cross_entropy_weighted(o.t[1], labels, weights_on(s, logits),
                                                     KPL_REDUCE_MEAN, 0, s->ignore);
        KPL_TRY(kpl_step_figure(out, "loss_aux",
                                kpl_scalar_op(KPL_BIN_MUL, kpl_detach(aux), (double)b->size,
                                              false),
                                (double)b->size));
        loss = kpl_add(loss, kpl_scalar_op(KPL_BIN_MUL, aux, s->aux_weight, false));
    }
    out->loss[0] = loss;
    if (!loss) return kpl_last_status();
    /* pixel accuracy over the pixels that count (an ignored label never
     * equals a class) */
    kpl_tensor *right = kpl_compare(KPL_BIN_EQ, kpl_argmax(kpl_detach(logits), 1, false), labels);
    kpl_tensor *pct = kpl_scalar_op(KPL_BIN_MUL, kpl_sum(kpl_cast(right, KPL_F32), NULL, 0, false),
                                    100, false);
    return valid > 0 ? kpl_step_figure(out, "acc", pct, (double)valid) : KPL_OK;
}

/* ---- evaluation ------------------------------------------------------------------------------- */

/* The validation examples' file stems, for naming saved predictions. */
static kpl_status load_stems(kpl_trainer *t, segment *s)
{
    if (s->stems) return KPL_OK;
    const char *path = kpl_trainer_data_path(t, false);
    int64_t n = kpl_trainer_data_examples(t, false);
    kpl_dataset *ds = NULL;
    KPL_TRY(kpl_dataset_open(path, &ds));
    int fp = kpl_dataset_find_feature(ds, "path");
    kpl_chunk *chunk = kpl_chunk_create();
    kpl_feature_value *v = calloc((size_t)kpl_dataset_num_features(ds), sizeof *v);
    s->stems = calloc((size_t)n + 1, sizeof *s->stems);
    s->nstems = n;
    kpl_status st = chunk && v && s->stems ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "eval: out of memory");
    for (int64_t e = 0; st >= 0 && e < n; e++) {
        char name[256];
        snprintf(name, sizeof name, "%08lld", (long long)e);
        if (fp >= 0 && (st = kpl_dataset_read_example(ds, e, chunk, v)) >= 0 && v[fp].count) {
            /* the last path component without its extension */
            const char *p = v[fp].data;
            size_t len = v[fp].count, start = len;
            while (start > 0 && p[start - 1] != '/') start--;
            size_t end = len;
            for (size_t k = len; k > start; k--)
                if (p[k - 1] == '.') {
                    end = k - 1;
                    break;
                }
            if (end > start && end - start < sizeof name)
                snprintf(name, sizeof name, "%.*s", (int)(end - start), p + start);
        }
        if (st >= 0 && !(s->stems[e] = strdup(name)))
            st = KPL_ERROR(KPL_ENOMEM, "eval: out of memory");
    }
    free(v);
    kpl_chunk_destroy(chunk);
    kpl_dataset_close(ds);
    return st;
}

static kpl_status eval_begin(kpl_trainer *t, void *state)
{
    segment *s = state;
    memset(s->conf, 0, (size_t)(s->classes * s->classes) * sizeof *s->conf);
    memset(s->sums, 0, sizeof s->sums);
    tb_free(s);
    if (s->save[0]) {
        if (mkdir(s->save, 0777) != 0 && errno != EEXIST)
            return KPL_ERROR(KPL_EIO, "task.segmentation.save_predictions: cannot make %s: %s",
                             s->save, strerror(errno));
        KPL_TRY(load_stems(t, s));
    }
    return KPL_OK;
}

/* Logits of the whole batch image x (N, C, H, W), averaged over sliding
 * windows (a window never passes the image: the last of a row or column
 * is moved back inside, as mmsegmentation's slide_inference). */
static kpl_status slide_logits(kpl_trainer *t, segment *s, kpl_tensor *x, kpl_tensor **out)
{
    int64_t N = kpl_tensor_dim(x, 0), H = kpl_tensor_dim(x, 2), W = kpl_tensor_dim(x, 3);
    int64_t C = s->classes, ch = s->crop[0] < H ? s->crop[0] : H, cw = s->crop[1] < W ? s->crop[1] : W;
    int64_t gh = (H > ch ? (H - ch + s->stride[0] - 1) / s->stride[0] : 0) + 1;
    int64_t gw = (W > cw ? (W - cw + s->stride[1] - 1) / s->stride[1] : 0) + 1;
    size_t plane = (size_t)H * W;
    float *acc = calloc((size_t)N * C * plane, sizeof *acc), *cnt = calloc(plane, sizeof *cnt);
    kpl_status st = acc && cnt ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "eval: out of memory");
    for (int64_t gy = 0; st >= 0 && gy < gh; gy++)
        for (int64_t gx = 0; st >= 0 && gx < gw; gx++) {
            int64_t y1 = gy * s->stride[0], x1 = gx * s->stride[1];
            int64_t y2 = y1 + ch < H ? y1 + ch : H, x2 = x1 + cw < W ? x1 + cw : W;
            y1 = y2 - ch > 0 ? y2 - ch : 0, x1 = x2 - cw > 0 ? x2 - cw : 0;
            kpl_pool *p = kpl_pool_push();
            kpl_tensor_list o;
            st = forward(t, kpl_slice(kpl_slice(x, 2, y1, y2 - y1), 3, x1, x2 - x1), &o);
            const float *l = st >= 0 ? kpl_tensor_host_data(o.t[0]) : NULL;
            if (st >= 0 && !l) st = kpl_last_status();
            for (int64_t n = 0; st >= 0 && n < N; n++)
                for (int64_t c = 0; c < C; c++)
                    for (int64_t yy = y1; yy < y2; yy++) {
                        const float *src = l + ((n * C + c) * (y2 - y1) + (yy - y1)) * (x2 - x1);
                        float *dst = acc + (n * C + c) * plane + (size_t)yy * W;
                        for (int64_t xx = x1; xx < x2; xx++) dst[xx] += src[xx - x1];
                    }
            for (int64_t yy = y1; st >= 0 && yy < y2; yy++)
                for (int64_t xx = x1; xx < x2; xx++) cnt[yy * W + xx] += 1;
            kpl_pool_pop(p);
        }
    for (int64_t i = 0; st >= 0 && i < N * C; i++)
        for (size_t q = 0; q < plane; q++) acc[(size_t)i * plane + q] /= cnt[q];
    int64_t shape[4] = {N, C, H, W};
    kpl_tensor *y = NULL;
    if (st >= 0) st = kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 4, shape, acc, &y);
    free(acc), free(cnt);
    KPL_TRY(st);
    *out = kpl_autorelease(y);
    return KPL_OK;
}

/* The standard VOC palette: class k's colour from its bits, spread over
 * the high bits of r, g and b; the ignored value a light grey. */
static void class_color(int64_t k, int64_t ignore, uint8_t *rgb)
{
    rgb[0] = rgb[1] = rgb[2] = 0;
    if (k == ignore) {
        rgb[0] = 224, rgb[1] = 224, rgb[2] = 192;
        return;
    }
    for (int j = 7; j >= 0 && k; j--, k >>= 3) {
        rgb[0] |= (uint8_t)(((k >> 0) & 1) << j);
        rgb[1] |= (uint8_t)(((k >> 1) & 1) << j);
        rgb[2] |= (uint8_t)(((k >> 2) & 1) << j);
    }
}

/* Sample i of b (valid h x w) for TensorBoard. */
static kpl_status keep_tb_image(kpl_trainer *t, segment *s, const kpl_batch *b, int64_t i, int h,
                                int w, const int64_t *pred)
{
    const kpl_transform_config *x = &kpl_trainer_recipe(t)->data.val.loader.transform;
    const float *img = kpl_tensor_host_data(b->image);
    const uint8_t *m = kpl_tensor_host_data(b->mask);
    if (!img || !m || kpl_tensor_dtype(b->image) != KPL_F32) return KPL_OK; /* u8: none */
    int64_t C = kpl_tensor_dim(b->image, 1), H = kpl_tensor_dim(b->image, 2);
    int64_t W = kpl_tensor_dim(b->image, 3);
    tb_image *p = realloc(s->tb, (size_t)(s->ntb + 1) * sizeof *p);
    KPL_CHECK(p, KPL_ENOMEM, "eval: out of memory");
    s->tb = p;
    tb_image *ti = &s->tb[s->ntb++];
    ti->h = h, ti->w = w;
    ti->rgb = malloc((size_t)h * w * 3);
    ti->gt = malloc((size_t)h * w);
    ti->pred = malloc((size_t)h * w);
    KPL_CHECK(ti->rgb && ti->gt && ti->pred, KPL_ENOMEM, "eval: out of memory");
    kpl_tb_rgb8(img, C, H, W, i, h, w, x->std, x->mean, ti->rgb, w);
    for (int y = 0; y < h; y++)
        for (int xx = 0; xx < w; xx++) {
            ti->gt[(size_t)y * w + xx] = m[(i * H + y) * W + xx];
            ti->pred[(size_t)y * w + xx] = (uint8_t)pred[(i * H + y) * W + xx];
        }
    return KPL_OK;
}

/* Writes pred's h x w valid part of sample i as an 8-bit PNG. */
static kpl_status save_prediction(segment *s, int64_t e, const int64_t *pred, int64_t i,
                                  int64_t H, int64_t W, int h, int w)
{
    uint8_t *px = malloc((size_t)h * w);
    KPL_CHECK(px, KPL_ENOMEM, "eval: out of memory");
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) px[(size_t)y * w + x] = (uint8_t)pred[(i * H + y) * W + x];
    char path[4400];
    const char *stem = s->stems && e < s->nstems && s->stems[e] ? s->stems[e] : "";
    if (stem[0]) snprintf(path, sizeof path, "%s/%s.png", s->save, stem);
    else snprintf(path, sizeof path, "%s/%08lld.png", s->save, (long long)e);
    kpl_status st = kpl_tb_png_write(path, h, w, 1, px, "task.segmentation.save_predictions");
    free(px);
    return st;
}

static kpl_status eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    segment *s = state;
    int64_t C = s->classes, valid = 0;
    KPL_TRY(check_mask(s, b, &valid));
    kpl_tensor *logits = NULL;
    if (s->slide) {
        KPL_TRY(slide_logits(t, s, b->image, &logits));
    } else {
        kpl_tensor_list o;
        KPL_TRY(forward(t, b->image, &o));
        logits = o.t[0];
    }
    int64_t H = kpl_tensor_dim(b->mask, 1), W = kpl_tensor_dim(b->mask, 2);
    KPL_CHECK(kpl_tensor_ndim(logits) == 4 && kpl_tensor_dim(logits, 1) == C &&
                  kpl_tensor_dim(logits, 2) == H && kpl_tensor_dim(logits, 3) == W,
              KPL_ESHAPE, "segmentation: the model gives logits of (%lld, %lld, %lld, %lld) for "
              "a (%lld, %lld) mask", (long long)kpl_tensor_dim(logits, 0),
              (long long)kpl_tensor_dim(logits, 1), (long long)kpl_tensor_dim(logits, 2),
              (long long)kpl_tensor_dim(logits, 3), (long long)H, (long long)W);
    kpl_tensor *labels = kpl_cast(kpl_to_device(b->mask, kpl_tensor_device(logits)), KPL_I64);
    kpl_tensor *loss = kpl_cross_entropy_weighted(logits, labels, weights_on(s, logits),
                                                  KPL_REDUCE_NONE, 0, s->ignore);
    const float *lp = kpl_tensor_host_data(loss);
    const int64_t *pred = kpl_tensor_host_data(kpl_argmax(logits, 1, false));
    const uint8_t *m = kpl_tensor_host_data(b->mask);
    const int64_t *ex = kpl_tensor_host_data(b->example);
    const int64_t *isz = kpl_tensor_host_data(kpl_batch_get(b, "image_size"));
    if (!lp || !pred || !m || !ex) return kpl_last_status();
    bool tb = kpl_trainer_rank(t) == 0;
    for (int64_t i = 0; i < b->size; i++) {
        if (!kpl_trainer_eval_counts(t, b, i)) continue; /* a repeat */
        int h = isz ? (int)isz[2 * i] : (int)H, w = isz ? (int)isz[2 * i + 1] : (int)W;
        double lsum = 0, lcount = 0;
        for (int y = 0; y < h; y++)
            for (int x = 0; x < w; x++) {
                int64_t q = (i * H + y) * W + x, g = m[q];
                if (g == s->ignore) continue;
                s->conf[g * C + pred[q]] += 1;
                lsum += lp[q], lcount += 1;
            }
        if (isfinite(lsum)) s->sums[0] += lsum, s->sums[1] += lcount;
        else s->sums[2] += 1;
        if (s->save[0]) KPL_TRY(save_prediction(s, ex[i], pred, i, H, W, h, w));
        if (tb && s->ntb < s->tb_images) KPL_TRY(keep_tb_image(t, s, b, i, h, w, pred));
    }
    return KPL_OK;
}

static kpl_status eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    segment *s = state;
    int64_t C = s->classes;
    /* pixel counts below 2^53 add exactly as doubles */
    KPL_TRY(kpl_trainer_sum(t, s->conf, (int)(C * C)));
    KPL_TRY(kpl_trainer_sum(t, s->sums, 3));
    double tp = 0, total = 0, iou = 0, acc = 0;
    int64_t niou = 0, nacc = 0;
    for (int64_t c = 0; c < C; c++) {
        double row = 0, col = 0, d = s->conf[c * C + c];
        for (int64_t k = 0; k < C; k++) row += s->conf[c * C + k], col += s->conf[k * C + c];
        tp += d, total += row;
        double u = row + col - d;
        s->iou[c] = u > 0 ? d / u : NAN;
        s->acc[c] = row > 0 ? d / row : NAN;
        if (u > 0) iou += s->iou[c], niou++;
        if (row > 0) acc += s->acc[c], nacc++;
    }
    s->have_iou = true;
    res->examples = kpl_trainer_data_examples(t, false);
    res->nonfinite = (int64_t)s->sums[2];
    KPL_TRY(kpl_figures_set(&res->metrics, "loss", s->sums[1] > 0 ? s->sums[0] / s->sums[1] : NAN));
    KPL_TRY(kpl_figures_set(&res->metrics, "miou", niou ? iou / (double)niou : NAN));
    KPL_TRY(kpl_figures_set(&res->metrics, "aacc", total > 0 ? tp / total : NAN));
    return kpl_figures_set(&res->metrics, "macc", nacc ? acc / (double)nacc : NAN);
}

/* Per-class IoU and accuracy, as mmsegmentation prints them. */
static void eval_report(kpl_trainer *t, void *state)
{
    segment *s = state;
    if (!s->have_iou) return;
    kpl_trainer_info(t, "per class (IoU and accuracy, %%; nan: the class occurs nowhere)");
    kpl_trainer_info(t, "%-20s %8s %8s", "class", "IoU", "Acc");
    for (int64_t c = 0; c < s->classes; c++) {
        char name[32];
        if (s->names && s->names[c]) snprintf(name, sizeof name, "%.20s", s->names[c]);
        else snprintf(name, sizeof name, "%lld", (long long)c);
        kpl_trainer_info(t, "%-20s %8.2f %8.2f", name, 100 * s->iou[c], 100 * s->acc[c]);
    }
}

/* ---- TensorBoard ------------------------------------------------------------------------------- */

/* image | ground truth | prediction, side by side */
static kpl_status images(kpl_trainer *t, void *state, kpl_tb_writer *tb, int64_t step)
{
    (void)t;
    segment *s = state;
    for (int i = 0; i < s->ntb; i++) {
        tb_image *ti = &s->tb[i];
        int h = ti->h, w = ti->w;
        uint8_t *rgb = malloc((size_t)h * w * 9);
        KPL_CHECK(rgb, KPL_ENOMEM, "tensorboard: out of memory");
        for (int y = 0; y < h; y++)
            for (int x = 0; x < w; x++) {
                uint8_t *row = rgb + (size_t)y * w * 9;
                memcpy(row + 3 * x, ti->rgb + ((size_t)y * w + x) * 3, 3);
                class_color(ti->gt[(size_t)y * w + x], s->ignore, row + 3 * (w + x));
                class_color(ti->pred[(size_t)y * w + x], s->ignore, row + 3 * (2 * w + x));
            }
        char tag[64];
        snprintf(tag, sizeof tag, "val/segmentation_%d", i);
        kpl_status st = kpl_tb_add_image(tb, tag, step, h, 3 * w, 3, rgb);
        free(rgb);
        KPL_TRY(st);
    }
    return KPL_OK;
}

const kpl_task_kind kpl_task_segmentation = {
    .name = "segmentation",
    .best_metric = "miou",
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
    .check = check,
    .export_output = "logits",
};
