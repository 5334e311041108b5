/*
 * centernet_head.c — a second detector head for kpl's detection task, from
 * outside kpl: CenterNet ("Objects as Points", Zhou et al. 2019) as a
 * plugin of the stock `kpl` command, built on public headers alone.
 *
 *   kpl data synth fmnist-det data/fmnist-det
 *   kpl train --plugin build/lib/libkpl_centernet.so examples/centernet_fmnistdet.yaml
 *   kpl eval --plugin build/lib/libkpl_centernet.so examples/centernet_fmnistdet.yaml \
 *       --checkpoint runs/.../checkpoints/best.kpl
 *
 * What the plugin brings (docs/detection.md, "A second head"):
 *   1. a model of the zoo, model.name "centernet": a ResNet of the zoo
 *      (model.depth, width, norm, stem; kpl_zoo_add) whose four stages
 *      are merged top-down into one stride-4 map (1x1 laterals, nearest
 *      upsampling, a 3x3 conv + norm + ReLU), and three heads on it, each a
 *      3x3 conv + ReLU + 1x1 conv: "hm" (a heatmap logit per class), "wh"
 *      (a box's width and height) and "reg" (the centre's sub-pixel
 *      offset).  Its forward gives [heatmap (N, C, H/4, W/4), wh (N, 2,
 *      H/4, W/4), offset (N, 2, H/4, W/4)], sizes and offsets in output
 *      pixels.  Its keys are model.centernet.*.
 *   2. a detector head (detector.h), "centernet", which takes on only
 *      that model (its create declines any other with KPL_ENOTFOUND, and
 *      FCOS's declines this one):
 *        targets  per image on the host: each box's centre in output
 *                 pixels; a Gaussian of CornerNet's radius (the IoU
 *                 `gaussian_overlap`) splatted into its class's heatmap
 *                 (the maximum where two overlap), 1 at the centre pixel;
 *                 the size and the centre's offset from its pixel there;
 *        losses   loss_hm: the penalty-reduced focal loss over every
 *                 pixel and class, -(1 - p)^2 log p at centres and
 *                 -(1 - Y)^4 p^2 log(1 - p) elsewhere (Y the splatted
 *                 target), over the centres; loss_wh and loss_off: L1 at
 *                 the centre pixels, the mean over the objects' two
 *                 values, times wh_weight and offset_weight.  Both
 *                 normalisers are averaged over the ranks.  The ops are
 *                 graph.h's and vision.h's, so gradients flow to the model;
 *        decoding 3x3 max-pool peaks of the heatmap (a pixel no
 *                 neighbour beats) inside the image, scoring above
 *                 task.detection.score_thresh, the best min(max_dets,
 *                 pre_nms_topk) of every class together; boxes centre +
 *                 offset +- size / 2, scaled by the stride and clipped to
 *                 the image.  No NMS (the peaks are the paper's), so
 *                 task.detection.nms_iou is not read.
 *   3. registration in a constructor (kpl_zoo_register,
 *      kpl_detector_head_register) and KPL_PLUGIN_ABI.
 * The detection task does the rest: data, evaluation (COCO's figures),
 * detections.json, TensorBoard, checkpoints, `kpl eval`.
 */
#include "trainer.h"
#include "vision.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the model ------------------------------------------------------------------------------- */

/* What the head reads from its model (the model's state, from
 * model.centernet.*): the output's stride in input pixels and the
 * training settings. */
typedef struct {
    int stride;
    double overlap, wh_weight, offset_weight;
} centernet_config;

/* The neck's forward: C2..C5 (finest first) -> one map at C2's size.
 * Top-down, every finer stage's 1x1 lateral plus the coarser map
 * upsampled (nearest), then the 3x3 smoothing. */
static kpl_status neck_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_CHECK(in->n == 4, KPL_EINVAL, "centernet neck: %d maps (want C2..C5)", in->n);
    kpl_tensor *p = kpl_module_forward(kpl_module_find(m, "lateral4"), in->t[3]);
    for (int l = 3; l >= 1 && p; l--) {
        char name[16];
        snprintf(name, sizeof name, "lateral%d", l);
        kpl_tensor *lat = kpl_module_forward(kpl_module_find(m, name), in->t[l - 1]);
        if (!lat) return kpl_last_status();
        p = kpl_add(lat, kpl_upsample_nearest(p, kpl_tensor_dim(lat, 2), kpl_tensor_dim(lat, 3)));
    }
    out->n = 1;
    out->t[0] = kpl_module_forward(kpl_module_find(m, "smooth"), p);
    return out->t[0] ? KPL_OK : kpl_last_status();
}

static const kpl_module_kind neck_kind = {"centernet_neck", neck_forward, NULL,
                                          KPL_MODULE_REPLAYABLE};

/* forward: image (N, 3, H, W) -> [heatmap logits (N, C, H/s, W/s),
 * sizes (N, 2, H/s, W/s), offsets (N, 2, H/s, W/s)] */
static kpl_status centernet_forward(kpl_module *m, const kpl_tensor_list *in,
                                    kpl_tensor_list *out)
{
    kpl_module *bb = kpl_module_find(m, "backbone");
    kpl_tensor_list c = {4, {NULL}}, p;
    kpl_tensor *x = in->t[0];
    /* the backbone's children in order; layer1..layer4 are C2..C5 */
    for (int i = 0; i < kpl_module_num_children(bb); i++) {
        kpl_module *child = kpl_module_child(bb, i);
        x = kpl_module_forward(child, x);
        const char *n = kpl_module_name(child);
        if (!strncmp(n, "layer", 5) && n[5] >= '1' && n[5] <= '4') c.t[n[5] - '1'] = x;
    }
    if (!x) return kpl_last_status();
    KPL_TRY(kpl_module_forward_list(kpl_module_find(m, "neck"), &c, &p));
    static const char *const heads[3] = {"hm", "wh", "reg"};
    out->n = 3;
    for (int k = 0; k < 3; k++) out->t[k] = kpl_module_forward(kpl_module_find(m, heads[k]), p.t[0]);
    return out->t[0] && out->t[1] && out->t[2] ? KPL_OK : kpl_last_status();
}

static const kpl_module_kind centernet_kind = {"centernet", centernet_forward, free,
                                               KPL_MODULE_REPLAYABLE};

/* model.centernet.<key> */
static const kpl_key centernet_keys[] = {
    {"neck_channels", KPL_KEY_INT, "64", 8, 1024, NULL,
     "channels of the top-down merge of the backbone's stages"},
    {"head_channels", KPL_KEY_INT, "64", 8, 1024, NULL, "channels of each head's 3x3 conv"},
    {"prior_prob", KPL_KEY_FLOAT, "0.1", 1e-6, 0.5, NULL,
     "initial probability of the heatmap (the paper's bias -2.19)"},
    {"gaussian_overlap", KPL_KEY_FLOAT, "0.7", 0.05, 0.99, NULL,
     "training: a centre's Gaussian has CornerNet's radius for boxes of this IoU"},
    {"wh_weight", KPL_KEY_FLOAT, "0.1", 0, 100, NULL, "training: the weight of loss_wh"},
    {"offset_weight", KPL_KEY_FLOAT, "1", 0, 100, NULL, "training: the weight of loss_off"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};

/* A 3x3 conv + ReLU + 1x1 conv to `out` channels whose bias starts at
 * `bias`, as a sequential `name` of m. */
static kpl_status add_head(kpl_module *m, const char *name, int64_t in, int64_t mid, int64_t out,
                           double bias)
{
    kpl_module *h = NULL, *last = NULL;
    kpl_nn_conv c1 = {KPL_NN_CONV_INIT(in, mid, 3), .padding = {1, 1}};
    kpl_nn_conv c2 = {KPL_NN_CONV_INIT(mid, out, 1)};
    KPL_TRY(kpl_nn_sequential(m, name, &h));
    KPL_TRY(kpl_nn_conv2d(h, "0", &c1, NULL));
    KPL_TRY(kpl_nn_relu(h, "1", NULL));
    KPL_TRY(kpl_nn_conv2d(h, "2", &c2, &last));
    return kpl_k_fill(kpl_module_get_param(last, "bias"), bias);
}

/* The neck: laterals 1x1 from each stage's channels to `ch`, and the
 * smoothing 3x3 conv + the backbone's kind of norm + ReLU. */
static kpl_status add_neck(kpl_module *m, const kpl_model_config *bc, int64_t ch)
{
    kpl_module *neck = NULL, *smooth = NULL;
    KPL_TRY(kpl_module_create(m, "neck", &neck_kind, NULL, &neck));
    int64_t e = bc->depth >= 50 ? 4 : 1;
    for (int l = 1; l <= 4; l++) {
        char name[16];
        snprintf(name, sizeof name, "lateral%d", l);
        kpl_nn_conv c = {KPL_NN_CONV_INIT((bc->width << (l - 1)) * e, ch, 1)};
        KPL_TRY(kpl_nn_conv2d(neck, name, &c, NULL));
    }
    KPL_TRY(kpl_nn_sequential(neck, "smooth", &smooth));
    kpl_nn_conv c = {KPL_NN_CONV_INIT(ch, ch, 3), .padding = {1, 1}, .no_bias = true,
                     .init = KPL_NN_INIT_KAIMING_OUT};
    KPL_TRY(kpl_nn_conv2d(smooth, "0", &c, NULL));
    if (bc->norm == KPL_NORM_GROUP) KPL_TRY(kpl_nn_group_norm(smooth, "1", 8, ch, 1e-5, NULL));
    else KPL_TRY(kpl_nn_batch_norm(smooth, "1", ch, 0.1, 1e-5, NULL));
    return kpl_nn_relu(smooth, "2", NULL);
}

/* The zoo's create (zoo.h): a root on dev, or a child of parent. */
static kpl_status centernet_create(kpl_module *parent, const char *child,
                                   const kpl_model_config *cfg, kpl_device *dev, uint64_t seed,
                                   kpl_module **out)
{
    KPL_CHECK(cfg->num_classes >= 1, KPL_EINVAL,
              "model centernet: needs num_classes >= 1 (got %lld)", (long long)cfg->num_classes);
    int64_t neck_ch, head_ch;
    double prior;
    centernet_config c = {.stride = cfg->stem == KPL_STEM_CIFAR ? 1 : 4};
    KPL_TRY(kpl_key_int(&cfg->keys, "neck_channels", &neck_ch));
    KPL_TRY(kpl_key_int(&cfg->keys, "head_channels", &head_ch));
    KPL_TRY(kpl_key_float(&cfg->keys, "prior_prob", &prior));
    KPL_TRY(kpl_key_float(&cfg->keys, "gaussian_overlap", &c.overlap));
    KPL_TRY(kpl_key_float(&cfg->keys, "wh_weight", &c.wh_weight));
    KPL_TRY(kpl_key_float(&cfg->keys, "offset_weight", &c.offset_weight));
    KPL_CHECK(cfg->norm != KPL_NORM_GROUP || neck_ch % 8 == 0, KPL_EINVAL,
              "model centernet: neck_channels %lld is not a multiple of 8 (group norm's groups)",
              (long long)neck_ch);
    centernet_config *s = malloc(sizeof *s);
    KPL_CHECK(s, KPL_ENOMEM, "model centernet: out of memory");
    *s = c;
    kpl_module *m = NULL;
    if (parent) KPL_TRY(kpl_module_create(parent, child, &centernet_kind, s, &m));
    else KPL_TRY(kpl_module_create_root(dev, seed, &centernet_kind, s, &m));
    *out = m; /* a root is the caller's to destroy, also on failure */
    kpl_model_config bc = *cfg;
    snprintf(bc.name, sizeof bc.name, "resnet");
    if (!bc.depth) bc.depth = 18;
    bc.num_classes = 0; /* the backbone alone, up to layer4 */
    memset(&bc.keys, 0, sizeof bc.keys);
    KPL_TRY(kpl_model_config_complete(&bc));
    KPL_TRY(kpl_zoo_add(m, "backbone", &bc, NULL));
    KPL_TRY(add_neck(m, &bc, neck_ch));
    KPL_TRY(add_head(m, "hm", neck_ch, head_ch, cfg->num_classes, -log((1 - prior) / prior)));
    KPL_TRY(add_head(m, "wh", neck_ch, head_ch, 2, 0));
    return add_head(m, "reg", neck_ch, head_ch, 2, 0);
}

/* ---- target assignment (on the host) ------------------------------------------------------- */

/* CornerNet's radius for a box of h x w output pixels: the least of the
 * three corner shifts that keep the IoU at `overlap`, as CenterNet's
 * gaussian_radius computes it (its formula, kept as the paper trained). */
static double gaussian_radius(double h, double w, double overlap)
{
    double b1 = h + w, c1 = w * h * (1 - overlap) / (1 + overlap);
    double r1 = (b1 + sqrt(b1 * b1 - 4 * c1)) / 2;
    double b2 = 2 * (h + w), c2 = (1 - overlap) * w * h;
    double r2 = (b2 + sqrt(b2 * b2 - 16 * c2)) / 2;
    double a3 = 4 * overlap, b3 = -2 * overlap * (h + w), c3 = (overlap - 1) * w * h;
    double r3 = (b3 + sqrt(b3 * b3 - 4 * a3 * c3)) / 2;
    return fmin(r1, fmin(r2, r3));
}

/* The Gaussian of radius r (sigma (2r + 1) / 6) around (cx, cy) into the
 * plane hm (H, W), keeping the larger value; 1 at the centre itself. */
static void splat(float *hm, int64_t H, int64_t W, int64_t cx, int64_t cy, int64_t r)
{
    double sigma = (2.0 * r + 1) / 6;
    for (int64_t dy = -r; dy <= r; dy++)
        for (int64_t dx = -r; dx <= r; dx++) {
            int64_t x = cx + dx, y = cy + dy;
            if (x < 0 || y < 0 || x >= W || y >= H) continue;
            float g = (float)exp(-(double)(dx * dx + dy * dy) / (2 * sigma * sigma));
            if (g > hm[y * W + x]) hm[y * W + x] = g;
        }
}

/* The targets of a batch: heatmaps (n, C, H, W), and per object its
 * centre pixel's row in the (n H W) pixels, its size and offset (K, 2). */
typedef struct {
    float *hm;
    int64_t nobj, *idx;
    float *wh, *off;
} targets;

static void targets_free(targets *t) { free(t->hm), free(t->idx), free(t->wh), free(t->off); }

static kpl_status assign(const centernet_config *c, const kpl_detector_targets *tg, int64_t C,
                         int64_t H, int64_t W, targets *t)
{
    int64_t nmax = tg->n * tg->maxb + 1;
    memset(t, 0, sizeof *t);
    t->hm = calloc((size_t)(tg->n * C * H * W), sizeof *t->hm);
    t->idx = malloc((size_t)nmax * sizeof *t->idx);
    t->wh = malloc((size_t)nmax * 2 * sizeof *t->wh);
    t->off = malloc((size_t)nmax * 2 * sizeof *t->off);
    KPL_CHECK(t->hm && t->idx && t->wh && t->off, KPL_ENOMEM, "centernet: out of memory");
    float s = (float)c->stride;
    for (int64_t i = 0; i < tg->n; i++) {
        KPL_CHECK(tg->nboxes[i] >= 0 && tg->nboxes[i] <= tg->maxb, KPL_EINVAL,
                  "centernet loss: image %lld has %lld boxes (0 to %lld)", (long long)i,
                  (long long)tg->nboxes[i], (long long)tg->maxb);
        for (int64_t b = 0; b < tg->nboxes[i]; b++) {
            const float *g = tg->boxes + 4 * (i * tg->maxb + b);
            int64_t y = tg->labels[i * tg->maxb + b];
            KPL_CHECK(y >= 0 && y < C, KPL_EINVAL, "centernet loss: image %lld, box %lld: label "
                      "%lld is not in [0, %lld) (model.num_classes)", (long long)i, (long long)b,
                      (long long)y, (long long)C);
            if (!(g[2] > g[0] && g[3] > g[1])) continue; /* empty (or NaN) */
            float w = (g[2] - g[0]) / s, h = (g[3] - g[1]) / s;
            float cx = (g[0] + g[2]) / 2 / s, cy = (g[1] + g[3]) / 2 / s;
            int64_t ix = (int64_t)floorf(cx), iy = (int64_t)floorf(cy);
            if (ix < 0 || iy < 0 || ix >= W || iy >= H) continue; /* outside the map */
            double r = gaussian_radius(ceil(h), ceil(w), c->overlap);
            splat(t->hm + (i * C + y) * H * W, H, W, ix, iy, r > 0 ? (int64_t)r : 0);
            int64_t k = t->nobj++;
            t->idx[k] = (i * H + iy) * W + ix;
            t->wh[2 * k] = w, t->wh[2 * k + 1] = h;
            t->off[2 * k] = cx - (float)ix, t->off[2 * k + 1] = cy - (float)iy;
        }
    }
    return KPL_OK;
}

/* ---- the losses ------------------------------------------------------------------------------ */

/* A pool-owned tensor of a copy of host data on dev (NULL on failure). */
static kpl_tensor *host_tensor(kpl_device *dev, kpl_dtype dt, int ndim, const int64_t *shape,
                               const void *data)
{
    kpl_tensor *x = NULL;
    if (kpl_tensor_from_data(dev, dt, ndim, shape, data, &x) < 0) return NULL;
    return kpl_autorelease(x);
}

/* The rows idx of x (N, 2, H, W) taken as (N H W, 2): (K, 2). */
static kpl_tensor *at_pixels(kpl_tensor *x, kpl_tensor *idx)
{
    static const int nhwc[4] = {0, 2, 3, 1};
    int64_t flat[2] = {kpl_tensor_numel(x) / 2, 2};
    return kpl_index_select(kpl_reshape(kpl_permute(x, nhwc), 2, flat), 0, idx);
}

static kpl_status check_outputs(const kpl_tensor_list *o, int64_t n)
{
    KPL_CHECK(o->n == 3, KPL_EINVAL, "centernet: the model gave %d outputs (want 3: heatmap, "
              "sizes, offsets)", o->n);
    for (int k = 0; k < 3; k++)
        KPL_CHECK(kpl_tensor_ndim(o->t[k]) == 4 && kpl_tensor_dim(o->t[k], 0) == n &&
                      (k == 0 || kpl_tensor_dim(o->t[k], 1) == 2) &&
                      kpl_tensor_dim(o->t[k], 2) == kpl_tensor_dim(o->t[0], 2) &&
                      kpl_tensor_dim(o->t[k], 3) == kpl_tensor_dim(o->t[0], 3),
                  KPL_EINVAL, "centernet: output %d is not (%lld, %s, H, W) as the heatmap's", k,
                  (long long)n, k == 0 ? "C" : "2");
    return KPL_OK;
}

static kpl_status head_loss(void *state, const kpl_tensor_list *o, const kpl_detector_targets *tg,
                            const kpl_detector_ranks *ranks, kpl_tensor **loss)
{
    const centernet_config *c = state;
    KPL_TRY(check_outputs(o, tg->n));
    int64_t C = kpl_tensor_dim(o->t[0], 1), H = kpl_tensor_dim(o->t[0], 2);
    int64_t W = kpl_tensor_dim(o->t[0], 3), NP = tg->n * C * H * W;
    targets t;
    float *centre = NULL;
    kpl_status st = assign(c, tg, C, H, W, &t);
    if (st >= 0 && !(centre = malloc((size_t)NP * sizeof *centre)))
        st = KPL_ERROR(KPL_ENOMEM, "centernet: out of memory");
    if (st < 0) goto done;
    /* the focal loss's targets (1 at the centres) and each pixel's weight:
     * 1 at a centre, (1 - Y)^4 elsewhere */
    double norm[2] = {0, (double)t.nobj};
    for (int64_t q = 0; q < NP; q++) {
        float y = t.hm[q];
        centre[q] = y == 1;
        norm[0] += y == 1;
        float u = 1 - y;
        t.hm[q] = y == 1 ? 1 : u * u * u * u;
    }
    int32_t world = ranks && ranks->sum ? ranks->world : 1;
    if (world > 1 && (st = ranks->sum(ranks->ctx, norm, 2)) < 0) goto done;
    double centres = fmax(norm[0] / world, 1), values = fmax(2 * norm[1] / world, 1);
    kpl_device *dev = kpl_tensor_device(o->t[0]);
    int64_t shape[4] = {tg->n, C, H, W};
    kpl_tensor *fl = kpl_sigmoid_focal_loss(o->t[0], host_tensor(dev, KPL_F32, 4, shape, centre),
                                            -1, 2, KPL_REDUCE_NONE);
    kpl_tensor *wt = host_tensor(dev, KPL_F32, 4, shape, t.hm);
    loss[0] = kpl_scalar_op(KPL_BIN_DIV, kpl_sum(kpl_mul(fl, wt), NULL, 0, false), centres, false);
    if (t.nobj == 0) { /* every parameter still takes part (DDP waits for each) */
        loss[1] = kpl_scalar_op(KPL_BIN_MUL, kpl_sum(o->t[1], NULL, 0, false), 0, false);
        loss[2] = kpl_scalar_op(KPL_BIN_MUL, kpl_sum(o->t[2], NULL, 0, false), 0, false);
    } else {
        int64_t sk[1] = {t.nobj}, sk2[2] = {t.nobj, 2};
        kpl_tensor *idx = host_tensor(dev, KPL_I64, 1, sk, t.idx);
        kpl_tensor *wh = kpl_l1_loss(at_pixels(o->t[1], idx),
                                     host_tensor(dev, KPL_F32, 2, sk2, t.wh), KPL_REDUCE_SUM);
        kpl_tensor *off = kpl_l1_loss(at_pixels(o->t[2], idx),
                                      host_tensor(dev, KPL_F32, 2, sk2, t.off), KPL_REDUCE_SUM);
        loss[1] = kpl_scalar_op(KPL_BIN_MUL, wh, c->wh_weight / values, false);
        loss[2] = kpl_scalar_op(KPL_BIN_MUL, off, c->offset_weight / values, false);
    }
    st = loss[0] && loss[1] && loss[2] ? KPL_OK : kpl_last_status();
done:
    targets_free(&t);
    free(centre);
    return st;
}

/* ---- decoding -------------------------------------------------------------------------------- */

typedef struct {
    float score;
    int64_t cls, loc;
} candidate;

static int by_score(const void *a, const void *b)
{
    const candidate *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    if (x->cls != y->cls) return x->cls < y->cls ? -1 : 1; /* ties: a stable order */
    return x->loc < y->loc ? -1 : x->loc > y->loc;
}

/* Whether pixel (i, j) of the plane z (H, W) is a peak: no neighbour of
 * its 3x3 window is larger (max_pool2d(z, 3, 1, 1) == z). */
static bool is_peak(const float *z, int64_t H, int64_t W, int64_t i, int64_t j)
{
    float v = z[i * W + j];
    for (int64_t y = i > 0 ? i - 1 : 0; y <= i + 1 && y < H; y++)
        for (int64_t x = j > 0 ? j - 1 : 0; x <= j + 1 && x < W; x++)
            if (z[y * W + x] > v) return false;
    return true;
}

/* Image i's detections: the peaks of every class inside img_h x img_w
 * above the threshold, the best `keep`, decoded into `box` (keep, 4). */
static int64_t detect_image(const centernet_config *c, const float *hm, const float *wh,
                            const float *off, int64_t C, int64_t H, int64_t W, double thresh,
                            int64_t keep, double img_h, double img_w, candidate *cand, float *box,
                            float *score, int64_t *label)
{
    int64_t n = 0, HW = H * W, s = c->stride;
    double logit = log(thresh / (1 - thresh)); /* sigmoid(z) > thresh */
    for (int64_t k = 0; k < C; k++) {
        const float *z = hm + k * HW;
        for (int64_t q = 0; q < HW; q++) {
            int64_t y = q / W, x = q % W;
            if (!(z[q] > logit) || (double)(x * s) >= img_w || (double)(y * s) >= img_h) continue;
            if (!is_peak(z, H, W, y, x)) continue;
            cand[n++] = (candidate){(float)(1 / (1 + exp(-(double)z[q]))), k, q};
        }
    }
    qsort(cand, (size_t)n, sizeof *cand, by_score);
    if (n > keep) n = keep;
    for (int64_t k = 0; k < n; k++) {
        int64_t q = cand[k].loc;
        float cx = (float)(q % W) + off[q], cy = (float)(q / W) + off[HW + q];
        float hw = fmaxf(wh[q], 0) / 2, hh = fmaxf(wh[HW + q], 0) / 2;
        float b[4] = {(cx - hw) * s, (cy - hh) * s, (cx + hw) * s, (cy + hh) * s};
        for (int j = 0; j < 4; j++) {
            float hi = (float)(j % 2 ? img_h : img_w);
            b[j] = isfinite(b[j]) ? fminf(fmaxf(b[j], 0), hi) : 0;
        }
        memcpy(box + 4 * k, b, sizeof b);
        score[k] = cand[k].score, label[k] = cand[k].cls;
    }
    return n;
}

static kpl_status head_decode(void *state, const kpl_tensor_list *o, const kpl_detector_decode *d,
                              int64_t n, const double *img_hw, float *box, float *score,
                              int64_t *label, int64_t *count)
{
    KPL_TRY(check_outputs(o, n));
    int64_t C = kpl_tensor_dim(o->t[0], 1), H = kpl_tensor_dim(o->t[0], 2);
    int64_t W = kpl_tensor_dim(o->t[0], 3);
    KPL_CHECK(C == d->classes, KPL_EINVAL, "centernet: the heatmap has %lld classes, "
              "model.num_classes is %lld", (long long)C, (long long)d->classes);
    const float *hm = kpl_tensor_host_data(o->t[0]), *wh = kpl_tensor_host_data(o->t[1]);
    const float *off = kpl_tensor_host_data(o->t[2]);
    if (!hm || !wh || !off) return kpl_last_status();
    candidate *cand = malloc((size_t)(C * H * W + 1) * sizeof *cand);
    KPL_CHECK(cand, KPL_ENOMEM, "centernet: out of memory");
    int64_t keep = d->topk < d->max_dets ? d->topk : d->max_dets;
    for (int64_t i = 0; i < n; i++)
        count[i] = detect_image(state, hm + i * C * H * W, wh + i * 2 * H * W, off + i * 2 * H * W,
                                C, H, W, d->score_thresh, keep, img_hw[2 * i], img_hw[2 * i + 1],
                                cand, box + 4 * i * d->max_dets, score + i * d->max_dets,
                                label + i * d->max_dets);
    free(cand);
    return KPL_OK;
}

/* ---- the head -------------------------------------------------------------------------------- */

/* Only the model this file registers; its settings are the model's. */
static kpl_status head_create(kpl_module *model, const kpl_keyvals *kv, const char *file,
                              void **state)
{
    (void)kv, (void)file;
    *state = NULL;
    if (kpl_module_kind_of(model) != &centernet_kind) return KPL_ENOTFOUND;
    centernet_config *s = malloc(sizeof *s);
    KPL_CHECK(s, KPL_ENOMEM, "centernet: out of memory");
    *s = *(const centernet_config *)kpl_module_state(model);
    *state = s;
    return KPL_OK;
}

static const kpl_detector_head centernet_head = {
    .name = "centernet",
    .create = head_create,
    .destroy = free,
    .nlosses = 3,
    .loss_names = {"loss_hm", "loss_wh", "loss_off"},
    .loss = head_loss,
    .decode = head_decode,
};

static const kpl_zoo_model centernet_model = {
    .name = "centernet",
    .doc = "CenterNet (Zhou et al. 2019): a ResNet merged to stride 4, heatmap + size + offset "
           "heads (examples/centernet_head.c)",
    .create = centernet_create,
    .keys = centernet_keys,
};

/* Built against these headers (checked when kpl train --plugin loads it). */
KPL_PLUGIN_ABI;

__attribute__((constructor)) static void register_centernet(void)
{
    kpl_zoo_register(&centernet_model);
    kpl_detector_head_register(&centernet_head);
}
