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
 */
#include "trainer_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

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

static const kpl_module_kind head_kind = {"fcos_head", head_forward, free};

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
