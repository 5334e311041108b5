/*
 * classify.c — the classification task: a model of the zoo from the
 * recipe's model section, cross-entropy with label smoothing, and top-1,
 * top-k (task.classification.top_k, 5), the mean loss and a confusion
 * matrix over the validation split.
 */
#include "trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t classes, top_k;
    int64_t *confusion; /* classes x classes (true row, predicted column) or NULL */
    bool want_confusion;
} classify;

static kpl_status create(kpl_trainer *t, void **state)
{
    const kpl_recipe *r = kpl_trainer_recipe(t);
    const int64_t *chw = kpl_trainer_input_shape(t);
    kpl_model_config mc = r->model;
    mc.in_channels = chw[0], mc.in_h = chw[1], mc.in_w = chw[2];
    classify *c = calloc(1, sizeof *c);
    KPL_CHECK(c, KPL_ENOMEM, "out of memory");
    *state = c;
    const kpl_recipe_split *sp[2] = {&r->data.train, &r->data.val};
    for (int i = 0; i < 2; i++) {
        KPL_CHECK(sp[i]->loader.transform.crop != KPL_CROP_KEEP_RATIO, KPL_EINVAL,
                  "%s: data.%s.transform.crop: classification needs images of one size, and "
                  "keep_ratio gives each batch its own (use none, center or random_resized)",
                  *r->file ? r->file : "recipe", i ? "val" : "train");
        /* "" reads no labels, which tasks without them (a GAN's) want */
        KPL_CHECK(sp[i]->label_feature[0] || !sp[i]->path[0], KPL_EINVAL,
                  "%s: data.%s.label_feature is empty: classification needs a class per "
                  "example (an int64 feature such as the converters' 'label')",
                  *r->file ? r->file : "recipe", i ? "val" : "train");
    }
    c->classes = r->model.num_classes;
    KPL_CHECK(c->classes >= 1, KPL_EINVAL, "%s: model.num_classes: classification needs 1 or "
              "more classes, got %lld", *r->file ? r->file : "recipe", (long long)c->classes);
    KPL_TRY(kpl_key_int(kpl_trainer_task_keys(t), "top_k", &c->top_k));
    c->want_confusion = c->classes <= r->eval.confusion_max_classes;
    kpl_module *m = NULL;
    KPL_TRY(kpl_zoo_create(&mc, kpl_trainer_device(t), (uint64_t)r->seed, &m));
    char label[64];
    if (!strcmp(mc.name, "resnet"))
        snprintf(label, sizeof label, "resnet%lld%s", (long long)mc.depth,
                 mc.stem == KPL_STEM_CIFAR ? "_cifar" : "");
    else
        snprintf(label, sizeof label, "%s", mc.name);
    return kpl_trainer_add_model(t, "model", label, m, NULL, NULL);
}

static void destroy(void *state)
{
    classify *c = state;
    if (c) free(c->confusion);
    free(c);
}

/* The batch's images and labels where the model is (pool-owned copies on
 * a GPU; on the CPU the batch's own tensors, which view shared memory). */
static void on_device(kpl_trainer *t, const kpl_batch *b, kpl_tensor **x, kpl_tensor **y)
{
    kpl_device *dev = kpl_trainer_device(t);
    *x = b->image, *y = b->label;
    if (kpl_device_type_of(dev) == KPL_DEVICE_CPU) return;
    *x = kpl_to_device(b->image, dev);
    *y = kpl_to_device(b->label, dev);
}

/* The evaluation's sums (kpl_trainer_eval_add), summed over the ranks by
 * the trainer. */
enum { S_LOSS, S_EXAMPLES, S_TOP1, S_TOPK, S_NONFINITE, NSUMS };
static const char *const sums[] = {"loss", "examples", "top1", "topk", "nonfinite", NULL};

static kpl_status train_step(kpl_trainer *t, void *state, const kpl_batch *b,
                             kpl_step_result *out)
{
    (void)state;
    kpl_tensor *x, *y;
    on_device(t, b, &x, &y);
    kpl_tensor *logits = kpl_module_forward(kpl_trainer_model(t, 0), x);
    out->loss[0] = kpl_cross_entropy(logits, y, KPL_REDUCE_MEAN,
                                     kpl_trainer_recipe(t)->loss.label_smoothing, -100);
    kpl_tensor *right = kpl_compare(KPL_BIN_EQ, kpl_argmax(logits, 1, false), y);
    kpl_tensor *pct = kpl_scalar_op(KPL_BIN_MUL, kpl_sum(kpl_cast(right, KPL_F32), NULL, 0, false),
                                    100, false);
    return out->loss[0] ? kpl_step_figure(out, "acc", pct, (double)b->size) : kpl_last_status();
}

static kpl_status eval_begin(kpl_trainer *t, void *state)
{
    (void)t;
    classify *c = state;
    free(c->confusion);
    c->confusion = NULL;
    if (c->want_confusion) {
        c->confusion = calloc((size_t)(c->classes * c->classes), sizeof *c->confusion);
        KPL_CHECK(c->confusion, KPL_ENOMEM, "eval: out of memory");
    }
    return KPL_OK;
}

static kpl_status eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    classify *c = state;
    int64_t C = c->classes;
    kpl_tensor *x = NULL, *y = NULL;
    on_device(t, b, &x, &y);
    kpl_tensor *logits = kpl_module_forward(kpl_trainer_model(t, 0), x);
    kpl_tensor *loss = kpl_cross_entropy(logits, y, KPL_REDUCE_NONE, 0, -100);
    const float *lg = logits ? kpl_tensor_host_data(logits) : NULL;
    const float *ls = loss ? kpl_tensor_host_data(loss) : NULL;
    const int64_t *lab = kpl_tensor_host_data(b->label);
    if (!lg || !ls || !lab) return kpl_last_status();
    double s[NSUMS] = {0};
    for (int64_t i = 0; i < b->size; i++) {
        if (!kpl_trainer_eval_counts(t, b, i)) continue; /* a repeat */
        const float *row = lg + i * C;
        int64_t k = lab[i], above = 0, best = 0;
        bool finite = isfinite(ls[i]);
        for (int64_t j = 0; j < C; j++) {
            /* ties go to the lower index, as argmax */
            above += row[j] > row[k] || (row[j] == row[k] && j < k);
            if (row[j] > row[best]) best = j;
            finite &= isfinite(row[j]);
        }
        s[S_EXAMPLES] += 1;
        if (!finite) { /* NaN compares false: it would count as right */
            s[S_NONFINITE] += 1;
            continue;
        }
        s[S_LOSS] += ls[i];
        s[S_TOP1] += above == 0;
        s[S_TOPK] += above < c->top_k;
        if (c->confusion && k >= 0 && k < C) c->confusion[k * C + best]++;
    }
    for (int k = 0; k < NSUMS; k++) KPL_TRY(kpl_trainer_eval_add(t, sums[k], s[k]));
    return KPL_OK;
}

static kpl_status eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    classify *c = state;
    double s[NSUMS];
    for (int k = 0; k < NSUMS; k++) s[k] = kpl_trainer_eval_total(t, sums[k]);
    if (c->confusion) {
        /* counts below 2^53 add exactly as doubles */
        int64_t n = c->classes * c->classes;
        double *d = malloc((size_t)n * sizeof *d);
        KPL_CHECK(d, KPL_ENOMEM, "eval: out of memory");
        for (int64_t i = 0; i < n; i++) d[i] = (double)c->confusion[i];
        kpl_status st = n <= 1 << 30 ? kpl_trainer_sum(t, d, (int)n) : KPL_OK;
        for (int64_t i = 0; st >= 0 && i < n; i++) c->confusion[i] = (int64_t)d[i];
        free(d);
        KPL_TRY(st);
    }
    double n = s[S_EXAMPLES], finite = n - s[S_NONFINITE];
    res->examples = (int64_t)n;
    res->nonfinite = (int64_t)s[S_NONFINITE];
    KPL_TRY(kpl_figures_set(&res->metrics, "loss", finite > 0 ? s[S_LOSS] / finite : NAN));
    KPL_TRY(kpl_figures_set(&res->metrics, "top1", n > 0 ? 100 * s[S_TOP1] / n : NAN));
    char topk[32];
    snprintf(topk, sizeof topk, "top%lld", (long long)c->top_k);
    return kpl_figures_set(&res->metrics, topk, n > 0 ? 100 * s[S_TOPK] / n : NAN);
}

static void eval_report(kpl_trainer *t, void *state)
{
    classify *c = state;
    int64_t C = c->classes;
    if (!c->confusion) return;
    char line[8192];
    int at = snprintf(line, sizeof line, "confusion (rows: true class, columns: predicted)\n      ");
    for (int64_t k = 0; k < C && at < (int)sizeof line - 16; k++)
        at += snprintf(line + at, sizeof line - (size_t)at, "%6lld", (long long)k);
    kpl_trainer_info(t, "%s", line);
    for (int64_t k = 0; k < C; k++) {
        at = snprintf(line, sizeof line, "%5lld ", (long long)k);
        for (int64_t j = 0; j < C && at < (int)sizeof line - 16; j++)
            at += snprintf(line + at, sizeof line - (size_t)at, "%6lld",
                           (long long)c->confusion[k * C + j]);
        kpl_trainer_info(t, "%s", line);
    }
}

static const kpl_key keys[] = {
    {"top_k", KPL_KEY_INT, "5", 2, 1000, NULL,
     "the second accuracy reported: right when the label is among the k highest scores "
     "(figure top<k>)"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};
static const char *const needs[] = {"model.name", "model.num_classes", NULL};

const kpl_task_kind kpl_task_classification = {
    .name = "classification",
    .best_metric = "top1",
    .best_higher = true,
    .create = create,
    .destroy = destroy,
    .train_step = train_step,
    .eval_sums = sums,
    .eval_begin = eval_begin,
    .eval_batch = eval_batch,
    .eval_end = eval_end,
    .eval_report = eval_report,
    .keys = keys,
    .needs = needs,
    .export_output = "logits",
};
