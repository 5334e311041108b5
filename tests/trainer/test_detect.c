/* test_detect.c — detection's parts.  FCOS's head (nn/fcos.c): shapes,
 * its initial probabilities, distances that are ReLU x scale x stride,
 * gradients reaching every parameter.  FCOS's locations and targets
 * (tasks/fcos_loss.c):
 * hand-computed cases (inside, centre sampling, ranges, the smaller box
 * winning an overlap, centerness) and, on random boxes, agreement with a
 * second formulation written the way mmdetection's tensors compute it
 * (an areas matrix with infinities, then a first-minimum per location). */
#include "kpl_test.h"
#include "fcos_impl.h"
#include "trainer.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

static void test_points(void **state)
{
    (void)state;
    kpl__fcos_level lv[2] = {{8, 2, 3, -1, 64}, {16, 1, 2, 64, 1e8}};
    assert_int_equal(kpl__fcos_count(lv, 2), 8);
    float xy[16];
    kpl__fcos_points(lv, 2, xy);
    const float want[16] = {4, 4, 12, 4, 20, 4, 4, 12, 12, 12, 20, 12, 8, 8, 24, 8};
    for (int i = 0; i < 16; i++) assert_float_equal(xy[i], want[i], 0);
}

static void test_by_hand(void **state)
{
    (void)state;
    kpl__fcos_level lv[1] = {{8, 2, 2, -1, 64}};
    float xy[8], ltrb[16], ctr[4];
    int64_t cls[4];
    kpl__fcos_points(lv, 1, xy); /* (4,4) (12,4) (4,12) (12,12) */
    const float box[4] = {0, 0, 16, 16};
    const int64_t lab[1] = {3};
    assert_int_equal(kpl__fcos_assign(lv, 1, xy, box, lab, 1, 0, cls, ltrb, ctr), 4);
    for (int p = 0; p < 4; p++) assert_int_equal(cls[p], 3);
    assert_float_equal(ltrb[0], 4, 0), assert_float_equal(ltrb[1], 4, 0);
    assert_float_equal(ltrb[2], 12, 0), assert_float_equal(ltrb[3], 12, 0);
    assert_float_equal(ctr[0], 1.0f / 3, 1e-6); /* sqrt(4/12 * 4/12) */
    /* centre sampling: radius 1.5 x 8 = 12 around (8, 8) covers the box */
    assert_int_equal(kpl__fcos_assign(lv, 1, xy, box, lab, 1, 1.5, cls, ltrb, ctr), 4);
    /* radius 0.25: the region (6,6)-(10,10) holds no location */
    assert_int_equal(kpl__fcos_assign(lv, 1, xy, box, lab, 1, 0.25, cls, ltrb, ctr), 0);
    for (int p = 0; p < 4; p++) {
        assert_int_equal(cls[p], -1);
        assert_float_equal(ctr[p], 0, 0);
        assert_float_equal(ltrb[4 * p + 2], 0, 0);
    }
    /* two boxes over (4, 4): the smaller wins; (12, 12) only in the big one */
    const float two[8] = {0, 0, 16, 16, 2, 2, 8, 9};
    const int64_t lab2[2] = {1, 7};
    assert_int_equal(kpl__fcos_assign(lv, 1, xy, two, lab2, 2, 0, cls, ltrb, ctr), 4);
    assert_int_equal(cls[0], 7);
    assert_float_equal(ltrb[0], 2, 0), assert_float_equal(ltrb[3], 5, 0);
    assert_int_equal(cls[3], 1);
    /* the range: a box reaching 70 px from every location is too big here */
    const float big[4] = {-60, -60, 80, 80};
    assert_int_equal(kpl__fcos_assign(lv, 1, xy, big, lab, 1, 0, cls, ltrb, ctr), 0);
    kpl__fcos_level hi[1] = {{8, 2, 2, 64, 1e8}};
    assert_int_equal(kpl__fcos_assign(hi, 1, xy, big, lab, 1, 0, cls, ltrb, ctr), 4);
    /* an empty box and a NaN one are never assigned */
    const float bad[8] = {5, 5, 5, 9, 0, 0, NAN, 16};
    assert_int_equal(kpl__fcos_assign(lv, 1, xy, bad, lab2, 2, 0, cls, ltrb, ctr), 0);
}

/* mmdetection's way: areas[p][b] = INF unless inside and in range; the
 * first minimum per location. */
static void reference(const kpl__fcos_level *lv, int nl, const float *xy, const float *bx,
                      const int64_t *lab, int64_t nb, double radius, int64_t *cls, float *ltrb)
{
    int64_t P = kpl__fcos_count(lv, nl);
    float *areas = malloc((size_t)(P * nb) * sizeof *areas);
    int64_t p = 0;
    for (int l = 0; l < nl; l++)
        for (int64_t k = 0; k < lv[l].h * lv[l].w; k++, p++)
            for (int64_t b = 0; b < nb; b++) {
                const float *g = bx + 4 * b;
                float x = xy[2 * p], y = xy[2 * p + 1];
                float d[4] = {x - g[0], y - g[1], g[2] - x, g[3] - y};
                float c[4] = {d[0], d[1], d[2], d[3]};
                if (radius > 0) {
                    float s = (float)(lv[l].stride * radius), cx = (g[0] + g[2]) / 2,
                          cy = (g[1] + g[3]) / 2;
                    float x0 = cx - s > g[0] ? cx - s : g[0], y0 = cy - s > g[1] ? cy - s : g[1];
                    float x1 = cx + s > g[2] ? g[2] : cx + s, y1 = cy + s > g[3] ? g[3] : cy + s;
                    c[0] = x - x0, c[1] = y - y0, c[2] = x1 - x, c[3] = y1 - y;
                }
                float mn = c[0], mx = d[0];
                for (int i = 1; i < 4; i++) mn = c[i] < mn ? c[i] : mn, mx = d[i] > mx ? d[i] : mx;
                bool ok = mn > 0 && mx >= lv[l].lo && mx <= lv[l].hi;
                areas[p * nb + b] = ok ? (g[2] - g[0]) * (g[3] - g[1]) : INFINITY;
            }
    for (p = 0; p < P; p++) {
        int64_t arg = 0;
        for (int64_t b = 1; b < nb; b++)
            if (areas[p * nb + b] < areas[p * nb + arg]) arg = b;
        bool bg = nb == 0 || isinf(areas[p * nb + arg]);
        cls[p] = bg ? -1 : lab[arg];
        const float *g = bx + 4 * arg;
        for (int i = 0; i < 4 && !bg; i++)
            ltrb[4 * p + i] = i == 0 ? xy[2 * p] - g[0] : i == 1 ? xy[2 * p + 1] - g[1]
                            : i == 2 ? g[2] - xy[2 * p] : g[3] - xy[2 * p + 1];
    }
    free(areas);
}

static void test_random(void **state)
{
    (void)state;
    kpl__fcos_level lv[5] = {{8, 16, 16, -1, 64},    {16, 8, 8, 64, 128},
                             {32, 4, 4, 128, 256},   {64, 2, 2, 256, 512},
                             {128, 1, 1, 512, 1e8}};
    int64_t P = kpl__fcos_count(lv, 5);
    assert_int_equal(P, 341);
    float xy[2 * 341], ltrb[4 * 341], ctr[341], rl[4 * 341];
    int64_t cls[341], rc[341];
    kpl__fcos_points(lv, 5, xy);
    srand(7);
    int64_t total = 0;
    for (int trial = 0; trial < 200; trial++) {
        int64_t nb = trial % 9;
        float bx[4 * 8];
        int64_t lab[8];
        for (int64_t b = 0; b < nb; b++) {
            float w = 10 + (float)(rand() % 110), h = 10 + (float)(rand() % 110);
            float x = (float)(rand() % (int)(128 - w + 1)), y = (float)(rand() % (int)(128 - h + 1));
            if (trial % 5 == 0) w = h = 32; /* equal areas: the lower index wins */
            bx[4 * b] = x, bx[4 * b + 1] = y, bx[4 * b + 2] = x + w, bx[4 * b + 3] = y + h;
            lab[b] = rand() % 10;
        }
        double radius = trial % 2 ? 1.5 : 0;
        int64_t pos = kpl__fcos_assign(lv, 5, xy, bx, lab, nb, radius, cls, ltrb, ctr);
        reference(lv, 5, xy, bx, lab, nb, radius, rc, rl);
        int64_t want = 0;
        for (int64_t p = 0; p < P; p++) {
            assert_int_equal(cls[p], rc[p]);
            if (rc[p] < 0) continue;
            want++;
            for (int i = 0; i < 4; i++) assert_float_equal(ltrb[4 * p + i], rl[4 * p + i], 0);
            assert_true(ctr[p] > 0 && ctr[p] <= 1);
        }
        assert_int_equal(pos, want);
        total += pos;
    }
    assert_true(total > 1000); /* the cases did assign */
}

static void test_head(void **state)
{
    (void)state;
    kpl_module *root = NULL, *head = NULL;
    OK(kpl_nn_sequential_root(kpl_device_cpu(), 5, &root));
    kpl_fcos_head_config c = {.channels = 8, .classes = 3, .levels = 2, .stride = {8, 16},
                              .convs = 2, .gn_groups = 4, .prior_prob = 0.01};
    OK(kpl_nn_fcos_head(root, "head", &c, &head));
    assert_non_null(kpl_module_find(head, "cls_tower.3")); /* the second conv */
    assert_non_null(kpl_module_find(head, "bbox_tower.4")); /* its group norm */
    assert_float_equal(tget(kpl_module_get_param(kpl_module_find(head, "cls_logits"), "bias"), 0),
                       -log(99.0), 1e-6);
    kpl_pool *p = kpl_pool_push();
    int64_t s0[4] = {2, 8, 4, 4}, s1[4] = {2, 8, 2, 2};
    kpl_rng *rng = kpl_rng_create(3);
    kpl_tensor_list in = {2, {kpl_randn(kpl_device_cpu(), KPL_F32, 4, s0, rng, 0, 1),
                              kpl_randn(kpl_device_cpu(), KPL_F32, 4, s1, rng, 0, 1)}}, out;
    kpl_rng_destroy(rng);
    OK(kpl_module_forward_list(head, &in, &out));
    assert_int_equal(out.n, 6);
    const int64_t want_c[2] = {3, 4};
    for (int l = 0; l < 2; l++) {
        kpl_tensor *cls = out.t[l], *reg = out.t[2 + l], *ctr = out.t[4 + l];
        assert_int_equal(kpl_tensor_dim(cls, 1), want_c[0]);
        assert_int_equal(kpl_tensor_dim(reg, 1), want_c[1]);
        assert_int_equal(kpl_tensor_dim(ctr, 1), 1);
        assert_int_equal(kpl_tensor_dim(cls, 2), l ? 2 : 4);
        /* N(0, 0.01) weights: logits near the prior, distances >= 0 and small */
        for (int64_t i = 0; i < kpl_tensor_numel(cls); i++)
            assert_close(tget(cls, i), -log(99.0), 0, 0.5, "initial logit", i);
        for (int64_t i = 0; i < kpl_tensor_numel(reg); i++) {
            double v = tget(reg, i);
            assert_true(v >= 0 && v < 0.5 * c.stride[l]);
        }
    }
    /* distances are relu(conv(x) x scale) x stride: doubling the scale doubles them */
    double before = tget(out.t[2], 5);
    OK(kpl_k_fill(kpl_module_get_param(head, "scales"), 2));
    kpl_tensor_list again;
    OK(kpl_module_forward_list(head, &in, &again));
    assert_close(tget(again.t[2], 5), 2 * before, 1e-5, 1e-7, "scaled distance", 0);
    /* every parameter takes a gradient from a loss over all outputs */
    kpl_tensor *loss = NULL;
    for (int k = 0; k < 6; k++) {
        kpl_tensor *sk = kpl_sum(kpl_mul(again.t[k], again.t[k]), NULL, 0, false);
        loss = loss ? kpl_add(loss, sk) : sk;
    }
    OK(kpl_backward(loss, NULL, false));
    for (int i = 0; i < kpl_module_num_params(root); i++)
        if (!kpl_grad_get(kpl_module_params(root)[i]))
            fail_msg("no gradient for %s", kpl_module_param_name(root, i));
    kpl_pool_pop(p);
    kpl_module_destroy(root);
}

/* The zoo's FCOS: a ResNet-18 (width 16), the FPN and the head, its own
 * keys, five levels of the right sizes and strides. */
static void test_fcos_model(void **state)
{
    (void)state;
    kpl_model_config c = {.name = "fcos", .num_classes = 10, .in_channels = 3, .in_h = 128,
                          .in_w = 128, .depth = 18, .width = 16};
    OK(kpl_keyvals_set(&c.keys, "fpn_channels", "32"));
    OK(kpl_keyvals_set(&c.keys, "head_convs", "2"));
    OK(kpl_keyvals_set(&c.keys, "gn_groups", "8"));
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m));
    int strides[KPL_FCOS_MAX_LEVELS];
    assert_int_equal(kpl_fcos_strides(m, strides), 5);
    for (int l = 0; l < 5; l++) assert_int_equal(strides[l], 8 << l);
    assert_int_equal(kpl_fcos_strides(kpl_module_find(m, "backbone"), strides), 0);
    assert_non_null(kpl_module_find(m, "backbone.layer4"));
    assert_non_null(kpl_module_find(m, "fpn"));
    assert_non_null(kpl_module_find(m, "head.cls_tower.3"));
    kpl_pool *p = kpl_pool_push();
    int64_t shape[4] = {2, 3, 128, 128};
    kpl_rng *rng = kpl_rng_create(1);
    kpl_tensor_list in = {1, {kpl_randn(kpl_device_cpu(), KPL_F32, 4, shape, rng, 0, 1)}}, out;
    kpl_rng_destroy(rng);
    OK(kpl_module_forward_list(m, &in, &out));
    assert_int_equal(out.n, 15);
    for (int l = 0; l < 5; l++) {
        int64_t side = 128 / (8 << l);
        assert_int_equal(kpl_tensor_dim(out.t[l], 1), 10);
        assert_int_equal(kpl_tensor_dim(out.t[l], 2), side);
        assert_int_equal(kpl_tensor_dim(out.t[l], 3), side);
        assert_int_equal(kpl_tensor_dim(out.t[5 + l], 1), 4);
        assert_int_equal(kpl_tensor_dim(out.t[10 + l], 1), 1);
    }
    kpl_pool_pop(p);
    kpl_module_destroy(m);
    /* its keys are checked like a recipe's */
    OK(kpl_keyvals_set(&c.keys, "levels", "6"));
    FAILS(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m), KPL_ERANGE,
          "model.fcos.levels: 6 is out of range [3, 5]");
    kpl_module_destroy(m);
    m = NULL;
    OK(kpl_keyvals_set(&c.keys, "levels", "3"));
    OK(kpl_keyvals_set(&c.keys, "gn_groups", "5"));
    FAILS(kpl_zoo_create(&c, kpl_device_cpu(), 1, &m), KPL_EINVAL,
          "fpn_channels 32 is not a multiple of gn_groups 5");
    kpl_module_destroy(m);
}

/* ---- the losses (kpl__fcos_loss), by hand ---------------------------------------------- */

static double sig(double z) { return 1 / (1 + exp(-z)); }
static double focal(double z, double y, double a, double g)
{
    double p = sig(z), ce = -(y * log(p) + (1 - y) * log(1 - p));
    double pt = y * p + (1 - y) * (1 - p), at = a * y + (1 - a) * (1 - y);
    return at * pow(1 - pt, g) * ce;
}
static double bce(double z, double y) { return -(y * log(sig(z)) + (1 - y) * log(1 - sig(z))); }

static kpl_tensor *t4(int64_t a, int64_t b, int64_t c, int64_t d, const float *v)
{
    int64_t s[4] = {a, b, c, d};
    kpl_tensor *x = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 4, s, v, &x));
    return kpl_autorelease(x);
}

static float scalar(kpl_tensor *x)
{
    assert_non_null(x);
    assert_int_equal(kpl_tensor_numel(x), 1);
    return *(const float *)kpl_tensor_host_data(x);
}

/* One level of 2 x 2 locations (stride 8: (4, 4), (12, 4), (4, 12), (12,
 * 12)), two classes, images of which the first holds a box (0, 0, 10, 10)
 * of class 1 that only (4, 4) lies inside: l, t, r, b = 4, 4, 6, 6,
 * centerness 2/3.  The second image has no box. */
static void test_loss_by_hand(void **state)
{
    (void)state;
    kpl_pool *pool = kpl_pool_push();
    const float cls[2 * 2 * 4] = {-1, 0.5f, 2, -3, 0.25f, -2, 1, 0,  /* image 0: class 0, 1 */
                                  0, 1, -1, 2, -0.5f, 3, 0.75f, -4}; /* image 1 */
    float reg[2 * 4 * 4] = {0}, ctr[2 * 4] = {0.3f, -1, 2, 0, 1, 1, 1, 1};
    /* location 0 of image 0 predicts l, t, r, b = 3, 5, 6, 4: the box (1, -1, 10, 8) */
    reg[0] = 3, reg[4] = 5, reg[8] = 6, reg[12] = 4;
    for (int k = 1; k < 4; k++) reg[k] = reg[4 + k] = reg[8 + k] = reg[12 + k] = 2;
    for (int k = 16; k < 32; k++) reg[k] = 1;
    kpl_tensor_list o = {3, {t4(2, 2, 2, 2, cls), t4(2, 4, 2, 2, reg), t4(2, 1, 2, 2, ctr)}};
    kpl__fcos_loss_config c = {.levels = 1, .stride = {8}, .lo = {-1}, .hi = {1e8},
                               .radius = 0, .alpha = 0.25, .gamma = 2};
    const float boxes[2 * 2 * 4] = {0, 0, 10, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t labels[4] = {1, 0, 0, 0}, nboxes[2] = {1, 0};
    kpl_tensor *loss[3];
    int64_t npos = -1;
    OK(kpl__fcos_loss(&c, &o, 2, boxes, labels, nboxes, 2, NULL, loss, &npos));
    assert_int_equal(npos, 1);
    double want_cls = 0;
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 2; k++)
            for (int q = 0; q < 4; q++)
                want_cls += focal(cls[(i * 2 + k) * 4 + q], i == 0 && k == 1 && q == 0, 0.25, 2);
    /* GIoU of (1, -1, 10, 8) and (0, 0, 10, 10): intersection 9 x 8, union
     * 81 + 100 - 72, enclosing 10 x 11; weighted by 2/3 over 2/3 */
    double iou = 72.0 / 109, giou = iou - (110.0 - 109) / 110;
    assert_float_equal(scalar(loss[0]), want_cls, 1e-5 * want_cls);
    assert_float_equal(scalar(loss[1]), 1 - giou, 1e-6);
    assert_float_equal(scalar(loss[2]), bce(0.3, 2.0 / 3), 1e-6);

    /* center sampling with radius 0.1 x stride: (4, 4) is 1 px from the
     * centre (5, 5) on each axis, outside a 0.8 px square: no positive;
     * then the box terms are zeros that still reach every output */
    c.radius = 0.1;
    OK(kpl__fcos_loss(&c, &o, 2, boxes, labels, nboxes, 2, NULL, loss, &npos));
    assert_int_equal(npos, 0);
    double bg = 0;
    for (int k = 0; k < 16; k++) bg += focal(cls[k], 0, 0.25, 2);
    assert_float_equal(scalar(loss[0]), bg, 1e-5 * bg);
    assert_float_equal(scalar(loss[1]), 0, 0);
    assert_float_equal(scalar(loss[2]), 0, 0);

    /* errors: a label past the classes, counts past max boxes, outputs of
     * another level count */
    c.radius = 0;
    const int64_t bad[4] = {2, 0, 0, 0}, many[2] = {3, 0};
    FAILS(kpl__fcos_loss(&c, &o, 2, boxes, bad, nboxes, 2, NULL, loss, NULL), KPL_EINVAL,
          "image 0, box 0: label 2 is not in [0, 2)");
    FAILS(kpl__fcos_loss(&c, &o, 2, boxes, labels, many, 2, NULL, loss, NULL), KPL_EINVAL,
          "image 0 has 3 boxes (0 to 2)");
    c.levels = 2, c.stride[1] = 16, c.lo[1] = 64, c.hi[1] = 1e8;
    FAILS(kpl__fcos_loss(&c, &o, 2, boxes, labels, nboxes, 2, NULL, loss, NULL), KPL_EINVAL,
          "3 outputs for 2 levels (want 6)");
    kpl_pool_pop(pool);
}

/* The FCOS head through detector.h: its losses as kpl__fcos_loss gives
 * them, its normalisers averaged over the ranks by the sum it is given;
 * the registry: FCOS first, a second head found by name, a name taken
 * twice or a head with a member missing refused; a model that is not
 * FCOS's declined without a message. */
static kpl_status other_rank_has_three(void *ctx, double *v, int n)
{
    (void)ctx;
    assert_int_equal(n, 2);
    v[0] += 3;      /* positives */
    v[1] += 3 * 0.5; /* centerness targets */
    return KPL_OK;
}

static kpl_status toy_create(kpl_module *m, const kpl_keyvals *kv, const char *file, void **st)
{
    (void)m, (void)kv, (void)file, (void)st;
    return KPL_ENOTFOUND;
}

static kpl_status toy_loss(void *st, const kpl_tensor_list *o, const kpl_detector_targets *tg,
                           const kpl_detector_ranks *r, kpl_tensor **loss)
{
    return kpl_detector_fcos.loss(st, o, tg, r, loss);
}

static kpl_status toy_decode(void *st, const kpl_tensor_list *o, const kpl_detector_decode *d,
                             int64_t n, const double *hw, float *box, float *score, int64_t *label,
                             int64_t *count)
{
    return kpl_detector_fcos.decode(st, o, d, n, hw, box, score, label, count);
}

static void test_detector_head(void **state)
{
    (void)state;
    kpl_pool *pool = kpl_pool_push();
    const float cls[2 * 2 * 4] = {-1, 0.5f, 2, -3, 0.25f, -2, 1, 0, 0, 1, -1, 2, -0.5f, 3, 0.75f, -4};
    float reg[2 * 4 * 4], ctr[2 * 4] = {0.3f, -1, 2, 0, 1, 1, 1, 1};
    for (int k = 0; k < 32; k++) reg[k] = 2;
    kpl_tensor_list o = {3, {t4(2, 2, 2, 2, cls), t4(2, 4, 2, 2, reg), t4(2, 1, 2, 2, ctr)}};
    kpl__fcos_loss_config c = {.levels = 1, .stride = {8}, .lo = {-1}, .hi = {1e8},
                               .radius = 0, .alpha = 0.25, .gamma = 2};
    const float boxes[2 * 2 * 4] = {0, 0, 10, 10};
    const int64_t labels[4] = {1, 0, 0, 0}, nboxes[2] = {1, 0};
    kpl_tensor *one[3], *two[4] = {NULL};
    OK(kpl__fcos_loss(&c, &o, 2, boxes, labels, nboxes, 2, NULL, one, NULL));
    const kpl_detector_head *h = kpl_detector_head_find("fcos");
    assert_ptr_equal(h, &kpl_detector_fcos);
    assert_ptr_equal(kpl_detector_head_at(0), h);
    assert_int_equal(h->nlosses, 3);
    assert_string_equal(h->loss_names[0], "loss_cls");
    kpl_detector_targets tg = {2, 2, boxes, labels, nboxes};
    /* 2 ranks: 1 positive here, 3 there: N+ = 2 on each; centerness sum
     * (2/3 + 1.5) / 2 */
    kpl_detector_ranks ranks = {other_rank_has_three, NULL, 2};
    OK(h->loss(&c, &o, &tg, &ranks, two));
    assert_float_equal(scalar(two[0]), scalar(one[0]) / 2, 1e-6);
    double cn = (2.0 / 3 + 1.5) / 2;
    assert_float_equal(scalar(two[1]), scalar(one[1]) * (2.0 / 3) / cn, 1e-5);
    assert_float_equal(scalar(two[2]), scalar(one[2]) / 2, 1e-6);
    /* a model without an FCOS head: declined, no message needed */
    kpl_module *m = NULL;
    OK(kpl_nn_sequential_root(kpl_device_cpu(), 1, &m));
    void *hs = (void *)1;
    assert_int_equal(h->create(m, NULL, "r.yaml", &hs), KPL_ENOTFOUND);
    assert_null(hs);
    kpl_module_destroy(m);
    /* the registry */
    int n = kpl_detector_head_count();
    static const kpl_detector_head toy = {"toy", toy_create, free, 1, {"loss_toy"}, toy_loss,
                                          toy_decode};
    OK(kpl_detector_head_register(&toy));
    assert_int_equal(kpl_detector_head_count(), n + 1);
    assert_ptr_equal(kpl_detector_head_find("toy"), &toy);
    assert_int_equal(kpl_detector_head_register(&toy), KPL_EINVAL);
    static const kpl_detector_head half = {.name = "half", .create = toy_create, .destroy = free,
                                           .nlosses = 1, .loss_names = {"loss_half"}};
    assert_int_equal(kpl_detector_head_register(&half), KPL_EINVAL);
    assert_null(kpl_detector_head_find("half"));
    kpl_pool_pop(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_head), cmocka_unit_test(test_fcos_model),
                                       cmocka_unit_test(test_points), cmocka_unit_test(test_by_hand),
                                       cmocka_unit_test(test_random),
                                       cmocka_unit_test(test_loss_by_hand),
                                       cmocka_unit_test(test_detector_head)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
