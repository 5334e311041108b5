/*
 * fcos.c — FCOS's head (Tian et al. 2019, with the improvements
 * mmdetection's FCOS uses: centerness on the regression branch, box
 * distances normalised by the level's stride, group norm in the towers):
 * one head shared by every pyramid level.
 *
 *   cls_tower, bbox_tower  convs x (conv 3x3 + GroupNorm + ReLU)
 *   cls_logits             conv 3x3 -> classes (bias -log((1 - p) / p))
 *   bbox_pred              conv 3x3 -> 4, times the level's learnt scale,
 *                          ReLU, times the level's stride: l, t, r, b in
 *                          input pixels
 *   centerness             conv 3x3 -> 1, on the regression tower
 * Convolutions start N(0, 0.01) with zero bias, as the paper's heads.
 *
 * And the zoo's model "fcos": a ResNet of the zoo (model.depth, .width,
 * .stem) whose layer2..layer4 feed an FPN (kpl_nn_fpn: P3..P5 and extra
 * levels from P5) and the head.  Its own keys are model.fcos.*.
 */
#include "nn_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int levels;
    int stride[KPL_FCOS_MAX_LEVELS];
} head_state;

/* in: the levels' maps (N, C, H_l, W_l); out: every level's class logits
 * (N, classes, H_l, W_l), then every level's l, t, r, b (N, 4, H_l, W_l),
 * then every level's centerness logit (N, 1, H_l, W_l). */
static kpl_status head_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    const head_state *s = kpl_module_state(m);
    KPL_CHECK(in->n == s->levels, KPL_EINVAL, "fcos_head: %d maps for %d levels", in->n,
              s->levels);
    kpl_module *ct = kpl_module_find(m, "cls_tower"), *bt = kpl_module_find(m, "bbox_tower");
    kpl_module *cl = kpl_module_find(m, "cls_logits"), *bp = kpl_module_find(m, "bbox_pred");
    kpl_module *cn = kpl_module_find(m, "centerness");
    kpl_tensor *scales = kpl_module_get_param(m, "scales");
    for (int l = 0; l < s->levels; l++) {
        kpl_tensor *c = kpl_module_forward(ct, in->t[l]), *b = kpl_module_forward(bt, in->t[l]);
        kpl_tensor *scale = kpl_slice(scales, 0, l, 1);
        kpl_tensor *reg = kpl_relu(kpl_mul(kpl_module_forward(bp, b), scale));
        out->t[l] = kpl_module_forward(cl, c);
        out->t[s->levels + l] = kpl_scalar_op(KPL_BIN_MUL, reg, s->stride[l], false);
        out->t[2 * s->levels + l] = kpl_module_forward(cn, b);
        for (int k = 0; k < 3; k++)
            if (!out->t[k * s->levels + l]) return kpl_last_status();
    }
    out->n = 3 * s->levels;
    return KPL_OK;
}

static const kpl_module_kind head_kind = {"fcos_head", head_forward, free, KPL_MODULE_REPLAYABLE};

/* A conv 3x3 of the head, N(0, 0.01) with bias `bias`. */
static kpl_status head_conv(kpl_module *parent, const char *name, int64_t in, int64_t out,
                            double bias)
{
    kpl_nn_conv c = {KPL_NN_CONV_INIT(in, out, 3), .padding = {1, 1}};
    kpl_module *m = NULL;
    KPL_TRY(kpl_nn_conv2d(parent, name, &c, &m));
    KPL_TRY(kpl_k_normal(kpl_module_get_param(m, "weight"), kpl_module_rng(m), 0, 0.01));
    return kpl_k_fill(kpl_module_get_param(m, "bias"), bias);
}

static kpl_status tower(kpl_module *parent, const char *name, const kpl_fcos_head_config *c)
{
    kpl_module *t = NULL;
    KPL_TRY(kpl_nn_sequential(parent, name, &t));
    for (int i = 0; i < c->convs; i++) {
        char n[16];
        snprintf(n, sizeof n, "%d", 3 * i);
        KPL_TRY(head_conv(t, n, c->channels, c->channels, 0));
        snprintf(n, sizeof n, "%d", 3 * i + 1);
        KPL_TRY(kpl_nn_group_norm(t, n, c->gn_groups, c->channels, 1e-5, NULL));
        snprintf(n, sizeof n, "%d", 3 * i + 2);
        KPL_TRY(kpl_nn_relu(t, n, NULL));
    }
    return KPL_OK;
}

kpl_status kpl_nn_fcos_head(kpl_module *parent, const char *name, const kpl_fcos_head_config *c,
                            kpl_module **out)
{
    KPL_CHECK(parent && name && c, KPL_EINVAL, "fcos_head: NULL argument");
    KPL_CHECK(c->levels >= 1 && c->levels <= KPL_FCOS_MAX_LEVELS, KPL_EINVAL,
              "fcos_head: %d levels (1 to %d)", c->levels, KPL_FCOS_MAX_LEVELS);
    KPL_CHECK(c->classes >= 1 && c->channels >= 1 && c->convs >= 0 && c->gn_groups >= 1 &&
                  c->channels % c->gn_groups == 0,
              KPL_EINVAL, "fcos_head: classes %lld, channels %lld, convs %d, gn_groups %d "
              "(channels a multiple of the groups)", (long long)c->classes,
              (long long)c->channels, c->convs, c->gn_groups);
    KPL_CHECK(c->prior_prob > 0 && c->prior_prob < 1, KPL_EINVAL,
              "fcos_head: prior_prob %g is not in (0, 1)", c->prior_prob);
    head_state *s = calloc(1, sizeof *s);
    KPL_CHECK(s, KPL_ENOMEM, "fcos_head: out of memory");
    s->levels = c->levels;
    for (int l = 0; l < c->levels; l++) {
        KPL_CHECK(c->stride[l] >= 1, KPL_EINVAL, "fcos_head: level %d has stride %d", l,
                  c->stride[l]);
        s->stride[l] = c->stride[l];
    }
    kpl_module *m = NULL;
    KPL_TRY(kpl_module_create(parent, name, &head_kind, s, &m));
    KPL_TRY(tower(m, "cls_tower", c));
    KPL_TRY(tower(m, "bbox_tower", c));
    KPL_TRY(head_conv(m, "cls_logits", c->channels, c->classes,
                      -log((1 - c->prior_prob) / c->prior_prob)));
    KPL_TRY(head_conv(m, "bbox_pred", c->channels, 4, 0));
    KPL_TRY(head_conv(m, "centerness", c->channels, 1, 0));
    int64_t nl = c->levels;
    kpl_tensor *scales = NULL;
    KPL_TRY(kpl_tensor_empty(kpl_module_device(m), KPL_F32, 1, &nl, &scales));
    KPL_TRY(kpl_module_add_param(m, "scales", scales));
    KPL_TRY(kpl_k_fill(scales, 1));
    if (out) *out = m;
    return KPL_OK;
}

/* ---- the model ---------------------------------------------------------------------------- */

/* model.fcos.<key> */
static const kpl_key fcos_keys[] = {
    {"fpn_channels", KPL_KEY_INT, "256", 8, 4096, NULL, "channels of the FPN and the head"},
    {"levels", KPL_KEY_INT, "5", 3, 5, NULL,
     "pyramid levels from P3 (3: P3-P5; 5: P3-P7, the paper's)"},
    {"head_convs", KPL_KEY_INT, "4", 0, 8, NULL, "conv + group norm + ReLU per head tower"},
    {"gn_groups", KPL_KEY_INT, "32", 1, 512, NULL, "group norm groups in the head"},
    {"prior_prob", KPL_KEY_FLOAT, "0.01", 1e-6, 0.5, NULL,
     "initial foreground probability of the class logits"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};

/* forward: image (N, 3, H, W) -> the head's outputs (class logits,
 * distances, centerness of every level) */
static kpl_status fcos_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    kpl_module *bb = kpl_module_find(m, "backbone");
    kpl_tensor_list c = {3, {NULL}}, p;
    kpl_tensor *x = in->t[0];
    /* the backbone's children in order; layer2..layer4 are C3..C5 */
    for (int i = 0; i < kpl_module_num_children(bb); i++) {
        kpl_module *child = kpl_module_child(bb, i);
        x = kpl_module_forward(child, x);
        const char *n = kpl_module_name(child);
        if (!strncmp(n, "layer", 5) && n[5] >= '2' && n[5] <= '4') c.t[n[5] - '2'] = x;
    }
    if (!x) return kpl_last_status();
    KPL_TRY(kpl_module_forward_list(kpl_module_find(m, "fpn"), &c, &p));
    return kpl_module_forward_list(kpl_module_find(m, "head"), &p, out);
}

static const kpl_module_kind fcos_kind = {"fcos", fcos_forward, NULL, KPL_MODULE_REPLAYABLE};

int kpl_fcos_strides(const kpl_module *fcos, int *strides)
{
    const kpl_module *head = fcos ? kpl_module_find(fcos, "head") : NULL;
    const head_state *s = head && kpl_module_kind_of(head) == &head_kind ? kpl_module_state(head)
                                                                          : NULL;
    if (!s) return 0;
    memcpy(strides, s->stride, (size_t)s->levels * sizeof *strides);
    return s->levels;
}

static kpl_status fcos_create(kpl_module *parent, const char *child, const kpl_model_config *cfg,
                              kpl_device *dev, uint64_t seed, kpl_module **out)
{
    KPL_CHECK(cfg->num_classes >= 1, KPL_EINVAL, "model fcos: needs num_classes >= 1 (got %lld)",
              (long long)cfg->num_classes);
    int64_t fpn, levels, convs, groups;
    double prior;
    KPL_TRY(kpl_key_int(&cfg->keys, "fpn_channels", &fpn));
    KPL_TRY(kpl_key_int(&cfg->keys, "levels", &levels));
    KPL_TRY(kpl_key_int(&cfg->keys, "head_convs", &convs));
    KPL_TRY(kpl_key_int(&cfg->keys, "gn_groups", &groups));
    KPL_TRY(kpl_key_float(&cfg->keys, "prior_prob", &prior));
    KPL_CHECK(fpn % groups == 0, KPL_EINVAL, "model fcos: fpn_channels %lld is not a multiple "
              "of gn_groups %lld", (long long)fpn, (long long)groups);
    kpl_module *m = NULL;
    if (parent) KPL_TRY(kpl_module_create(parent, child, &fcos_kind, NULL, &m));
    else KPL_TRY(kpl_module_create_root(dev, seed, &fcos_kind, NULL, &m));
    *out = m; /* a root is the caller's to destroy, also on failure */
    kpl_model_config bc = *cfg;
    snprintf(bc.name, sizeof bc.name, "resnet");
    if (!bc.depth) bc.depth = 50;
    bc.num_classes = 0; /* the backbone alone, up to layer4 */
    memset(&bc.keys, 0, sizeof bc.keys);
    KPL_TRY(kpl_model_config_complete(&bc));
    KPL_TRY(kpl_zoo_add(m, "backbone", &bc, NULL));
    int64_t w = bc.width, e = bc.depth >= 50 ? 4 : 1;
    int64_t ch[3] = {2 * w * e, 4 * w * e, 8 * w * e};
    KPL_TRY(kpl_nn_fpn(m, "fpn", ch, 3, fpn, (int)levels - 3, false, NULL));
    kpl_fcos_head_config hc = {.channels = fpn, .classes = cfg->num_classes,
                               .levels = (int)levels, .convs = (int)convs,
                               .gn_groups = (int)groups, .prior_prob = prior};
    int s3 = bc.stem == KPL_STEM_CIFAR ? 2 : 8; /* C3's stride: layer2 after the stem */
    for (int l = 0; l < levels; l++) hc.stride[l] = s3 << l;
    return kpl_nn_fcos_head(m, "head", &hc, NULL);
}

const kpl_zoo_model kpl__zoo_fcos = {
    .name = "fcos",
    .doc = "FCOS (Tian et al. 2019): a ResNet, an FPN P3-P7 and a shared head",
    .create = fcos_create,
    .keys = fcos_keys,
};
