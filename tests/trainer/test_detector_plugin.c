/* test_detector_plugin.c — a second detector head from a plugin
 * (examples/centernet_head.c), in one process linked to libkpl.so as the
 * kpl command is: both heads registered, FCOS first; each head declines
 * the other's model and takes on its own; CenterNet's model gives its
 * three maps at stride 4, and its losses and decoding on hand-made
 * outputs are the numbers worked out below. */
#include "kpl_test.h"
#include "trainer.h"

#ifndef CENTERNET_PLUGIN
#error "CENTERNET_PLUGIN: the path of libkpl_centernet.so"
#endif

static kpl_tensor *t4(int64_t a, int64_t b, int64_t c, int64_t d, const float *v)
{
    int64_t s[4] = {a, b, c, d};
    kpl_tensor *x = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 4, s, v, &x));
    return kpl_autorelease(x);
}

static double scalar(kpl_tensor *x)
{
    assert_non_null(x);
    assert_int_equal(kpl_tensor_numel(x), 1);
    return tget(x, 0);
}

/* A small model of the zoo: FCOS (3 levels) or CenterNet, 3 classes, on
 * 64 x 64 inputs. */
static kpl_module *small_model(const char *name)
{
    kpl_model_config c = {.num_classes = 3, .in_channels = 3, .in_h = 64, .in_w = 64,
                          .depth = 18, .width = 8};
    snprintf(c.name, sizeof c.name, "%s", name);
    if (!strcmp(name, "fcos")) {
        OK(kpl_keyvals_set(&c.keys, "fpn_channels", "16"));
        OK(kpl_keyvals_set(&c.keys, "levels", "3"));
        OK(kpl_keyvals_set(&c.keys, "head_convs", "1"));
        OK(kpl_keyvals_set(&c.keys, "gn_groups", "8"));
    } else {
        OK(kpl_keyvals_set(&c.keys, "neck_channels", "16"));
        OK(kpl_keyvals_set(&c.keys, "head_channels", "16"));
    }
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m));
    return m;
}

/* task.detection's keys with their defaults, as the task hands them on. */
static kpl_keyvals task_keys(void)
{
    kpl_keyvals kv = {0};
    OK(kpl_keyvals_check(kpl_task_detection.keys, "task.detection", &kv));
    return kv;
}

static void test_registered_and_declined(void **state)
{
    (void)state;
    int before = kpl_detector_head_count();
    OK(kpl_plugin_load(CENTERNET_PLUGIN));
    assert_int_equal(kpl_detector_head_count(), before + 1);
    assert_ptr_equal(kpl_detector_head_at(0), &kpl_detector_fcos);
    const kpl_detector_head *fcos = kpl_detector_head_find("fcos");
    const kpl_detector_head *cn = kpl_detector_head_find("centernet");
    assert_ptr_equal(fcos, &kpl_detector_fcos);
    assert_non_null(cn);
    assert_ptr_equal(kpl_detector_head_at(before), cn);
    assert_int_equal(cn->nlosses, 3);
    assert_string_equal(cn->loss_names[0], "loss_hm");
    assert_string_equal(cn->loss_names[1], "loss_wh");
    assert_string_equal(cn->loss_names[2], "loss_off");
    assert_non_null(kpl_zoo_find("centernet"));
    kpl_keyvals kv = task_keys();
    kpl_module *fm = small_model("fcos"), *cm = small_model("centernet");
    /* each declines the other's model without a message, and leaves no state */
    void *s = (void *)1;
    kpl_clear_error();
    assert_int_equal(fcos->create(cm, &kv, "r.yaml", &s), KPL_ENOTFOUND);
    assert_null(s);
    s = (void *)1;
    assert_int_equal(cn->create(fm, &kv, "r.yaml", &s), KPL_ENOTFOUND);
    assert_null(s);
    assert_string_equal(kpl_last_error(), "");
    /* and takes on its own */
    OK(fcos->create(fm, &kv, "r.yaml", &s));
    assert_non_null(s);
    fcos->destroy(s);
    OK(cn->create(cm, &kv, "r.yaml", &s));
    assert_non_null(s);
    cn->destroy(s);
    /* a ResNet of the zoo is neither's */
    kpl_module *rm = NULL;
    kpl_model_config rc = {.name = "resnet", .num_classes = 3, .in_channels = 3, .in_h = 64,
                           .in_w = 64, .depth = 18, .width = 8};
    OK(kpl_zoo_create(&rc, kpl_device_cpu(), 1, &rm));
    assert_int_equal(fcos->create(rm, &kv, "r.yaml", &s), KPL_ENOTFOUND);
    assert_int_equal(cn->create(rm, &kv, "r.yaml", &s), KPL_ENOTFOUND);
    /* CenterNet's maps: stride 4, heatmap (N, 3), sizes and offsets (N, 2) */
    kpl_pool *p = kpl_pool_push();
    int64_t shape[4] = {2, 3, 64, 64};
    kpl_rng *rng = kpl_rng_create(1);
    kpl_tensor_list in = {1, {kpl_randn(kpl_device_cpu(), KPL_F32, 4, shape, rng, 0, 1)}}, out;
    kpl_rng_destroy(rng);
    OK(kpl_module_forward_list(cm, &in, &out));
    assert_int_equal(out.n, 3);
    for (int k = 0; k < 3; k++) {
        assert_int_equal(kpl_tensor_dim(out.t[k], 0), 2);
        assert_int_equal(kpl_tensor_dim(out.t[k], 1), k == 0 ? 3 : 2);
        assert_int_equal(kpl_tensor_dim(out.t[k], 2), 16);
        assert_int_equal(kpl_tensor_dim(out.t[k], 3), 16);
    }
    /* the heatmap starts at the prior, 0.1: bias -log(9) */
    kpl_tensor *bias = kpl_module_get_param(kpl_module_find(cm, "hm.2"), "bias");
    assert_float_equal(tget(bias, 2), -log(9.0), 1e-6);
    kpl_pool_pop(p);
    kpl_module_destroy(rm);
    kpl_module_destroy(fm);
    kpl_module_destroy(cm);
}

/* The head's state for hand-made outputs: its create on its own model
 * (stride 4, wh_weight 0.1, offset_weight 1, overlap 0.7). */
static const kpl_detector_head *centernet(void **head_state)
{
    OK(kpl_plugin_load(CENTERNET_PLUGIN)); /* once: a path loaded before is OK */
    const kpl_detector_head *cn = kpl_detector_head_find("centernet");
    assert_non_null(cn);
    kpl_module *m = small_model("centernet");
    kpl_keyvals kv = task_keys();
    OK(cn->create(m, &kv, "r.yaml", head_state));
    kpl_module_destroy(m); /* the state is the head's own copy */
    return cn;
}

static kpl_status other_rank(void *ctx, double *v, int n)
{
    (void)ctx;
    assert_int_equal(n, 2);
    v[0] += 4; /* centres */
    v[1] += 6; /* objects */
    return KPL_OK;
}

/* Two 32 x 32 images at stride 4 (8 x 8 maps), 2 classes, every output 0:
 *   image 0: box (4, 8, 8, 12), label 1: centre (1.5, 2.5) in output
 *     pixels, pixel (1, 2), offset (0.5, 0.5), size 1 x 1, radius 0;
 *   image 1: box (8, 8, 24, 24), label 0: centre (4, 4), offset 0, size
 *     4 x 4, CornerNet's radius 1.81 -> 1, sigma 0.5: Y = e^-2 beside the
 *     centre, e^-4 at its corners.
 * With p = 0.5 everywhere each pixel's focal term is 0.25 ln 2 times its
 * weight, 1 at the 2 centres and (1 - Y)^4 elsewhere, over 2 centres;
 * loss_wh = 0.1 (1 + 1 + 4 + 4) / 4, loss_off = (0.5 + 0.5) / 4. */
static void test_loss_by_hand(void **state)
{
    (void)state;
    void *hs = NULL;
    const kpl_detector_head *cn = centernet(&hs);
    kpl_pool *pool = kpl_pool_push();
    float zeros[2 * 2 * 8 * 8] = {0};
    kpl_tensor *hm = t4(2, 2, 8, 8, zeros);
    OK(kpl_set_requires_grad(hm, true));
    kpl_tensor_list o = {3, {hm, t4(2, 2, 8, 8, zeros), t4(2, 2, 8, 8, zeros)}};
    const float boxes[2 * 2 * 4] = {4, 8, 8, 12, 0, 0, 0, 0, 8, 8, 24, 24, 0, 0, 0, 0};
    const int64_t labels[4] = {1, 0, 0, 0}, nboxes[2] = {1, 1};
    kpl_detector_targets tg = {2, 2, boxes, labels, nboxes};
    kpl_tensor *loss[4] = {NULL};
    OK(cn->loss(hs, &o, &tg, NULL, loss));
    double e2 = pow(1 - exp(-2.0), 4), e4 = pow(1 - exp(-4.0), 4);
    double want = 0.25 * log(2.0) * (2 + (256 - 2 - 8) + 4 * e2 + 4 * e4) / 2;
    assert_float_equal(scalar(loss[0]), want, 1e-5 * want);
    assert_float_equal(scalar(loss[1]), 0.1 * 10 / 4, 1e-6);
    assert_float_equal(scalar(loss[2]), 1.0 / 4, 1e-6);
    /* the gradient reaches the heatmap: up at the centres, down elsewhere */
    OK(kpl_backward(loss[0], NULL, false));
    kpl_tensor *g = kpl_grad_get(hm);
    assert_non_null(g);
    assert_true(tget(g, 64 + 2 * 8 + 1) < 0);       /* image 0, class 1, (1, 2) */
    assert_true(tget(g, 2 * 64 + 4 * 8 + 4) < 0);   /* image 1, class 0, (4, 4) */
    assert_true(tget(g, 2 * 64 + 4 * 8 + 5) > 0);   /* beside it */
    assert_true(tget(g, 0) > 0);
    /* 2 ranks: 4 centres and 6 objects there; each normaliser the mean */
    kpl_detector_ranks ranks = {other_rank, NULL, 2};
    kpl_tensor *two[4] = {NULL};
    OK(cn->loss(hs, &o, &tg, &ranks, two));
    assert_float_equal(scalar(two[0]), want * 2 / 3, 1e-5 * want);
    assert_float_equal(scalar(two[1]), 0.1 * 10 / 8, 1e-6);
    assert_float_equal(scalar(two[2]), 1.0 / 8, 1e-6);
    /* a label outside the classes is the recipe's error */
    const int64_t bad[4] = {2, 0, 0, 0};
    kpl_detector_targets tb = {2, 2, boxes, bad, nboxes};
    FAILS(cn->loss(hs, &o, &tb, NULL, loss), KPL_EINVAL, "label 2 is not in [0, 2)");
    kpl_pool_pop(pool);
    cn->destroy(hs);
}

/* An 8 x 8 map at stride 4, 2 classes, every logit -10 but:
 *   class 1 at (x 3, y 2): 2, with (4, 2) at 1 beside it (not a peak);
 *     sizes (4, 2), offsets (0.5, 0.25) there: centre (14, 9), box
 *     (6, 5, 22, 13), score sigmoid(2);
 *   class 0 at (6, 6): 0, sizes (2, 2): box (20, 20, 28, 28) clipped to
 *     the image's 26 columns, score 0.5;
 *   class 0 at (7, 2): 3, but in the batch's padding (x 28 >= 26). */
static void test_decode_by_hand(void **state)
{
    (void)state;
    void *hs = NULL;
    const kpl_detector_head *cn = centernet(&hs);
    kpl_pool *pool = kpl_pool_push();
    float hm[2 * 64], wh[2 * 64] = {0}, off[2 * 64] = {0};
    for (int k = 0; k < 128; k++) hm[k] = -10;
    hm[64 + 2 * 8 + 3] = 2, hm[64 + 2 * 8 + 4] = 1;
    hm[6 * 8 + 6] = 0, hm[2 * 8 + 7] = 3;
    wh[2 * 8 + 3] = 4, wh[64 + 2 * 8 + 3] = 2, off[2 * 8 + 3] = 0.5f, off[64 + 2 * 8 + 3] = 0.25f;
    wh[6 * 8 + 6] = 2, wh[64 + 6 * 8 + 6] = 2;
    kpl_tensor_list o = {3, {t4(1, 2, 8, 8, hm), t4(1, 2, 8, 8, wh), t4(1, 2, 8, 8, off)}};
    kpl_detector_decode d = {.classes = 2, .topk = 1000, .max_dets = 100, .score_thresh = 0.3,
                             .nms_iou = 0.6};
    double img_hw[2] = {32, 26};
    float box[100 * 4], score[100];
    int64_t label[100], count = -1;
    OK(cn->decode(hs, &o, &d, 1, img_hw, box, score, label, &count));
    assert_int_equal(count, 2);
    const float want[8] = {6, 5, 22, 13, 20, 20, 26, 28};
    for (int k = 0; k < 8; k++) assert_float_equal(box[k], want[k], 1e-5);
    assert_float_equal(score[0], 1 / (1 + exp(-2.0)), 1e-6);
    assert_float_equal(score[1], 0.5, 1e-6);
    assert_int_equal(label[0], 1);
    assert_int_equal(label[1], 0);
    /* max_dets keeps the best; a threshold above 0.5 the first alone */
    d.max_dets = 1;
    OK(cn->decode(hs, &o, &d, 1, img_hw, box, score, label, &count));
    assert_int_equal(count, 1);
    assert_int_equal(label[0], 1);
    d.max_dets = 100, d.score_thresh = 0.6;
    OK(cn->decode(hs, &o, &d, 1, img_hw, box, score, label, &count));
    assert_int_equal(count, 1);
    d.classes = 3;
    FAILS(cn->decode(hs, &o, &d, 1, img_hw, box, score, label, &count), KPL_EINVAL,
          "model.num_classes is 3");
    kpl_pool_pop(pool);
    cn->destroy(hs);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_registered_and_declined),
                                       cmocka_unit_test(test_loss_by_hand),
                                       cmocka_unit_test(test_decode_by_hand)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
