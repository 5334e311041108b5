/* test_boxes_masks.c — outputs that are not logits reach a task's loss
 * through kpl_trainer: a module with two heads, a box (x0, y0, x1, y1) and
 * a mask, trained on boxes and masks the loader delivers (the task asks for
 * them in the recipe: data.<split>.boxes_feature, mask_feature, max_boxes;
 * kpl_batch_get names a member the loader was not asked for).  The data:
 * one bright rectangle per 32x32
 * image at a seeded place; its box and its mask are the targets.  Trained,
 * the predicted boxes and masks must overlap the true ones far better than
 * the untrained model's, and the loss must fall. */
#define _XOPEN_SOURCE 700
#include "kpl_test.h"
#include "trainer.h"

#include <ftw.h>
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#define S 32       /* image side */
#define NTRAIN 768
#define NVAL 128
#define EPOCHS 12

/* ---- the data ---- */

typedef struct {
    int x0, y0, x1, y1; /* the rectangle, pixels [x0, x1) x [y0, y1) */
} rect;

static rect rect_of(uint64_t seed, int64_t e)
{
    /* a small LCG per example: deterministic, independent of the loader */
    uint64_t s = seed * 6364136223846793005ull + (uint64_t)e * 1442695040888963407ull + 1;
    int v[4];
    for (int k = 0; k < 4; k++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v[k] = (int)((s >> 33) % 1000);
    }
    rect r;
    int w = 8 + v[0] % 13, h = 8 + v[1] % 13; /* 8..20 */
    r.x0 = v[2] % (S - w + 1), r.y0 = v[3] % (S - h + 1);
    r.x1 = r.x0 + w, r.y1 = r.y0 + h;
    return r;
}

static void write_split(const char *dir, uint64_t seed, int64_t n)
{
    kpl_feature_spec schema[3] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {S, S, 1}},
        {.name = "boxes", .type = KPL_FEATURE_FLOAT},
        {.name = "mask", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 2,
         .shape = {S, S}},
    };
    kpl_record_writer_config wc = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(dir, 3, schema, &wc, &w));
    for (int64_t e = 0; e < n; e++) {
        rect r = rect_of(seed, e);
        uint8_t img[S * S], mask[S * S];
        for (int y = 0; y < S; y++)
            for (int x = 0; x < S; x++) {
                bool in = x >= r.x0 && x < r.x1 && y >= r.y0 && y < r.y1;
                mask[y * S + x] = in;
                img[y * S + x] = (uint8_t)(in ? 200 + (x * 7 + y * 3) % 40 : (x * 5 + y * 11) % 50);
            }
        float box[4] = {(float)r.x0, (float)r.y0, (float)r.x1, (float)r.y1};
        kpl_feature_value v[3] = {{img, S * S}, {box, 4}, {mask, S * S}};
        OK(kpl_record_writer_add(w, v));
    }
    OK(kpl_record_writer_close(w));
}

/* ---- the model: a shared trunk, a box head and a mask head ---- */

/* forward: (N, 1, S, S) -> [boxes (N, 4) in [0, 1], mask logits (N, 1, S, S)] */
static kpl_status two_heads_forward(kpl_module *m, const kpl_tensor_list *in,
                                    kpl_tensor_list *out)
{
    kpl_tensor *f = kpl_module_forward(kpl_module_find(m, "trunk"), in->t[0]);
    kpl_tensor *box = kpl_module_forward(kpl_module_find(m, "box"), f);
    kpl_tensor *mask = kpl_module_forward(kpl_module_find(m, "mask"), f);
    if (!box || !mask) return kpl_last_status();
    out->n = 2;
    out->t[0] = box;
    out->t[1] = mask;
    return KPL_OK;
}

static const kpl_module_kind two_heads = {"two_heads", two_heads_forward, NULL,
                                          KPL_MODULE_REPLAYABLE};

static kpl_status build(kpl_device *dev, uint64_t seed, kpl_module **out)
{
    kpl_module *m = NULL, *trunk = NULL, *box = NULL, *mask = NULL;
    kpl_status st = kpl_module_create_root(dev, seed, &two_heads, NULL, &m);
    if (st < 0) return st;
    *out = m; /* destroyed by the caller on failure too */
    kpl_nn_conv c1 = {KPL_NN_CONV_INIT(1, 16, 3), .padding = {1, 1}};
    kpl_nn_conv c2 = {KPL_NN_CONV_INIT(16, 16, 3), .stride = {2, 2}, .padding = {1, 1}};
    kpl_nn_conv m1 = {KPL_NN_CONV_INIT(16, 1, 3), .padding = {1, 1}};
    if ((st = kpl_nn_sequential(m, "trunk", &trunk)) < 0 ||
        (st = kpl_nn_conv2d(trunk, "conv1", &c1, NULL)) < 0 ||
        (st = kpl_nn_relu(trunk, "relu1", NULL)) < 0 ||
        (st = kpl_nn_conv2d(trunk, "conv2", &c2, NULL)) < 0 ||
        (st = kpl_nn_relu(trunk, "relu2", NULL)) < 0 ||
        (st = kpl_nn_sequential(m, "box", &box)) < 0 ||
        (st = kpl_nn_flatten(box, "flatten", NULL)) < 0 ||
        (st = kpl_nn_linear(box, "fc", 16 * (S / 2) * (S / 2), 4, true, NULL)) < 0 ||
        (st = kpl_nn_activation(box, "sigmoid", KPL_NN_SIGMOID, 0, NULL)) < 0 ||
        (st = kpl_nn_sequential(m, "mask", &mask)) < 0 ||
        (st = kpl_nn_upsample(mask, "up", 2, false, NULL)) < 0 ||
        (st = kpl_nn_conv2d(mask, "conv", &m1, NULL)) < 0)
        return st;
    return KPL_OK;
}

/* ---- the task ---- */

typedef struct {
    double box_iou, inter, uni, count; /* evaluation sums */
    double first_loss[4], last_loss[4];
    int nsteps;
} dense;

static dense *seen;

static kpl_status dense_create(kpl_trainer *t, void **state)
{
    *state = seen = calloc(1, sizeof(dense));
    if (!*state) return kpl_set_error(KPL_ENOMEM, "out of memory");
    kpl_module *m = NULL;
    kpl_status st = build(kpl_trainer_device(t), (uint64_t)kpl_trainer_recipe(t)->seed, &m);
    if (st < 0) {
        kpl_module_destroy(m);
        return st;
    }
    return kpl_trainer_add_model(t, "model", "two_heads", m, NULL, NULL);
}

static void dense_destroy(void *state) { free(state); }

/* The heads' outputs and the batch's targets: boxes / S (N, 4), mask (N, 1, S, S) f32. */
static kpl_status forward(kpl_trainer *t, const kpl_batch *b, kpl_tensor **box, kpl_tensor **mask,
                          kpl_tensor **box_t, kpl_tensor **mask_t)
{
    int64_t n = b->size, bs[2] = {n, 4}, ms[4] = {n, 1, S, S};
    /* the batch is on the CPU; the model on the trainer's device (a GPU
     * where there is one: device auto) */
    kpl_device *dev = kpl_trainer_device(t);
    kpl_tensor_list in = {1, {kpl_to_device(b->image, dev)}}, out;
    if (!in.t[0]) return kpl_last_status();
    kpl_status st = kpl_module_forward_list(kpl_trainer_model(t, 0), &in, &out);
    if (st < 0) return st;
    *box = out.t[0], *mask = out.t[1];
    kpl_tensor *boxes = kpl_batch_get(b, "boxes"), *m = kpl_batch_get(b, "mask");
    if (!boxes || !m) return kpl_last_status();
    boxes = kpl_to_device(boxes, dev), m = kpl_to_device(m, dev);
    *box_t = kpl_scalar_op(KPL_BIN_MUL, kpl_reshape(boxes, 2, bs), 1.0 / S, false);
    *mask_t = kpl_reshape(kpl_cast(m, KPL_F32), 4, ms);
    return *box_t && *mask_t ? KPL_OK : kpl_last_status();
}

static kpl_status dense_train_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    dense *s = state;
    kpl_pool *pool = kpl_pool_push();
    kpl_tensor *box, *mask, *box_t, *mask_t;
    kpl_status st = forward(t, b, &box, &mask, &box_t, &mask_t);
    kpl_tensor *lb = st >= 0 ? kpl_smooth_l1_loss(box, box_t, KPL_REDUCE_MEAN, 0.1) : NULL;
    kpl_tensor *lm = st >= 0 ? kpl_bce_with_logits(mask, mask_t, KPL_REDUCE_MEAN) : NULL;
    /* the box loss is small in [0, 1] units: weigh it up */
    kpl_tensor *loss = lb && lm ? kpl_add(kpl_scalar_op(KPL_BIN_MUL, lb, 20, false), lm) : NULL;
    double v[3] = {0, 0, 0};
    if (loss) kpl_tensor_retain(loss);
    if (!loss || kpl_tensor_get(lb, 0, &v[1]) < 0 || kpl_tensor_get(lm, 0, &v[2]) < 0)
        st = kpl_last_status() < 0 ? kpl_last_status() : KPL_ESTATE;
    kpl_pool_pop(pool);
    if (st >= 0) st = kpl_trainer_backward(t, 0, loss, &v[0]);
    kpl_tensor_release(loss);
    if (st < 0) return st;
    for (int k = 0; k < 3; k++) {
        if (s->nsteps < 5) s->first_loss[k] += v[k] / 5;
        s->last_loss[k] = s->nsteps < 20 ? v[k] : 0.9 * s->last_loss[k] + 0.1 * v[k];
    }
    s->nsteps++;
    double n = (double)b->size;
    if ((st = kpl_trainer_record(t, "box_loss", v[1] * n, n)) < 0) return st;
    return kpl_trainer_record(t, "mask_loss", v[2] * n, n);
}

static kpl_status dense_eval_begin(kpl_trainer *t, void *state)
{
    (void)t;
    dense *s = state;
    s->box_iou = s->inter = s->uni = s->count = 0;
    return KPL_OK;
}

static double iou(const float *a, const float *b)
{
    double w = fmin(a[2], b[2]) - fmax(a[0], b[0]), h = fmin(a[3], b[3]) - fmax(a[1], b[1]);
    double inter = w > 0 && h > 0 ? w * h : 0;
    double ua = (a[2] - a[0]) * (a[3] - a[1]), ub = (b[2] - b[0]) * (b[3] - b[1]);
    return inter / (fabs(ua) + fabs(ub) - inter + 1e-12);
}

static kpl_status dense_eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    dense *s = state;
    kpl_tensor *box, *mask, *box_t, *mask_t;
    kpl_status st = forward(t, b, &box, &mask, &box_t, &mask_t);
    if (st < 0) return st;
    const float *pb = kpl_tensor_host_data(box), *tb = kpl_tensor_host_data(box_t);
    const float *pm = kpl_tensor_host_data(mask), *tm = kpl_tensor_host_data(mask_t);
    const int64_t *nb = kpl_tensor_host_data(b->num_boxes);
    for (int64_t i = 0; i < b->size; i++) {
        if (!kpl_trainer_eval_counts(t, b, i)) continue;
        assert_int_equal(nb[i], 1); /* one rectangle per image */
        s->box_iou += iou(pb + 4 * i, tb + 4 * i);
        for (int64_t p = i * S * S; p < (i + 1) * S * S; p++) {
            bool on = pm[p] > 0, want = tm[p] > 0.5f;
            s->inter += on && want;
            s->uni += on || want;
        }
        s->count += 1;
    }
    return KPL_OK;
}

static kpl_status dense_eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    dense *s = state;
    double v[4] = {s->box_iou, s->inter, s->uni, s->count};
    kpl_status st = kpl_trainer_sum(t, v, 4);
    if (st < 0) return st;
    res->examples = (int64_t)v[3];
    if ((st = kpl_figures_set(&res->metrics, "box_iou", v[0] / v[3])) < 0) return st;
    return kpl_figures_set(&res->metrics, "mask_iou", v[2] > 0 ? v[1] / v[2] : 0);
}

static const kpl_task_kind dense_task = {
    .name = "boxes_masks", .best_metric = "mask_iou", .best_higher = true,
    .create = dense_create, .destroy = dense_destroy, .train_batch = dense_train_batch,
    .eval_begin = dense_eval_begin, .eval_batch = dense_eval_batch,
    .eval_end = dense_eval_end,
};

/* ---- the test ---- */

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

/* A member the loader was not asked for is named, never a NULL to crash on. */
static void test_batch_get(void **state)
{
    (void)state;
    kpl_batch b;
    memset(&b, 0, sizeof b);
    int64_t n = 2;
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_I64, 1, &n, &b.label));
    assert_ptr_equal(kpl_batch_get(&b, "label"), b.label);
    kpl_clear_error();
    assert_null(kpl_batch_get(&b, "boxes"));
    assert_int_equal(kpl_last_status(), KPL_ENOTFOUND);
    assert_non_null(strstr(kpl_last_error(), "the batch has no boxes: the loader was not asked "
                                             "for them (transform.boxes_feature; in a recipe "
                                             "data.<split>.boxes_feature)"));
    assert_null(kpl_batch_get(&b, "mask"));
    assert_non_null(strstr(kpl_last_error(), "mask_feature"));
    assert_null(kpl_batch_get(&b, "bboxes"));
    assert_non_null(strstr(kpl_last_error(), "the batch has no member 'bboxes'"));
    /* and an op given the NULL fails with the error, not a crash */
    kpl_pool *p = kpl_pool_push();
    assert_null(kpl_reshape(kpl_batch_get(&b, "boxes"), 1, &n));
    kpl_pool_pop(p);
    kpl_tensor_release(b.label);
}

static void test_boxes_and_masks(void **state)
{
    (void)state;
    char dir[] = "/tmp/kpl-dense-XXXXXX", path[256], yaml[2048];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/train", dir);
    write_split(path, 1, NTRAIN);
    snprintf(path, sizeof path, "%s/val", dir);
    write_split(path, 2, NVAL);
    snprintf(yaml, sizeof yaml,
             "name: dense\ntask: boxes_masks\nseed: 3\nepochs: %d\nthreads: 2\n"
             "deterministic: true\nrun_dir: %s/run\n"
             "data:\n  root: %s\n"
             "  train: {path: train, batch_size: 32, shuffle: example, label_feature: \"\",\n"
             "          boxes_feature: boxes, mask_feature: mask, max_boxes: 1,\n"
             "          transform: {channels: 1}}\n"
             "  val: {path: val, batch_size: 64, label_feature: \"\", boxes_feature: boxes,\n"
             "        mask_feature: mask, max_boxes: 1, transform: {channels: 1}}\n"
             "optimizer: {name: adam, lr: 2.0e-3}\n"
             "log: {every_steps: 100, progress: never, tensorboard: false}\n",
             EPOCHS, dir, dir);
    kpl_recipe *r = malloc(sizeof *r);
    OK(kpl_recipe_load_string(yaml, "dense", 0, NULL, r));
    kpl_trainer *t = NULL;
    OK(kpl_trainer_create(r, &dense_task, NULL, &t));
    kpl_eval_result before, after;
    OK(kpl_trainer_evaluate(t, &before));
    assert_int_equal(before.examples, NVAL);
    int epochs = 0;
    for (bool done = false; epochs < EPOCHS; epochs += done) { /* the loader goes on */
        OK(kpl_trainer_step(t, &done));
        assert_int_equal(kpl_trainer_epoch(t), epochs); /* the handle counts them too */
    }
    assert_int_equal(kpl_trainer_steps(t), EPOCHS * (NTRAIN / 32));
    OK(kpl_trainer_evaluate(t, &after));
    double b0 = kpl_figures_get(&before.metrics, "box_iou"), b1 = kpl_figures_get(&after.metrics, "box_iou");
    double m0 = kpl_figures_get(&before.metrics, "mask_iou"), m1 = kpl_figures_get(&after.metrics, "mask_iou");
    print_message("box IoU %.3f -> %.3f, mask IoU %.3f -> %.3f; loss %.4f -> %.4f "
                  "(box %.5f -> %.5f, mask %.4f -> %.4f) in %d steps\n",
                  b0, b1, m0, m1, seen->first_loss[0], seen->last_loss[0], seen->first_loss[1],
                  seen->last_loss[1], seen->first_loss[2], seen->last_loss[2], seen->nsteps);
    assert_true(b1 > 0.6 && b1 > b0 + 0.3);
    assert_true(m1 > 0.85 && m1 > m0 + 0.3);
    for (int k = 0; k < 3; k++) assert_true(seen->last_loss[k] < seen->first_loss[k] / 4);
    kpl_trainer_destroy(t);
    free(r);
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_batch_get),
        cmocka_unit_test(test_boxes_and_masks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
