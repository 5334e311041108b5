/*
 * segnets.c — semantic segmentation networks of the zoo: ASPP, DeepLabv3
 * (Chen et al. 2017) on a dilated ResNet, as torchvision's
 * deeplabv3_resnet50 names and builds it, and U-Net (Ronneberger et al.
 * 2015) with padded convolutions and batch norm, as most reference
 * implementations build it today.  Both give per-pixel class logits at the
 * input's size (docs/segmentation.md).
 */
#include "nn_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A conv (no bias, Kaiming fan-out), a norm and a ReLU as the sequential's
 * children "<first>", "<first+1>", "<first+2>" (torchvision's numbering in
 * its Sequential heads). */
static kpl_status conv_norm_relu(kpl_module *seq, int first, int64_t in, int64_t out, int k,
                                 int dil, kpl_norm_kind norm)
{
    char n[3][8];
    for (int i = 0; i < 3; i++) snprintf(n[i], sizeof n[i], "%d", first + i);
    kpl_nn_conv c = {KPL_NN_CONV_INIT(in, out, k), .padding = {dil * (k / 2), dil * (k / 2)},
                     .dilation = {dil, dil}, .no_bias = true, .init = KPL_NN_INIT_KAIMING_OUT};
    KPL_TRY(kpl_nn_conv2d(seq, n[0], &c, NULL));
    KPL_TRY(kpl__zoo_add_norm(seq, n[1], out, norm, NULL));
    return kpl_nn_relu(seq, n[2], NULL);
}

/* ---- ASPP ---------------------------------------------------------------------------------- */

/* convs.0: 1x1; convs.1..: 3x3 at each rate; convs.<last>: image pooling
 * (global average, 1x1, norm, ReLU, spread back over the map); the
 * branches concatenated and projected (1x1, norm, ReLU, dropout). */
static kpl_status aspp_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_CHECK(in->n == 1 && kpl_tensor_ndim(in->t[0]) == 4, KPL_ESHAPE,
              "aspp: wants one (N, C, H, W) input");
    kpl_tensor *x = in->t[0];
    kpl_module *convs = kpl_module_find(m, "convs");
    int nb = kpl_module_num_children(convs);
    kpl_tensor *br[KPL_MODULE_MAX_IO];
    for (int i = 0; i < nb; i++) br[i] = kpl_module_forward(kpl_module_child(convs, i), x);
    /* the pooled branch is (N, C, 1, 1): bilinear upsampling of one pixel
     * is that pixel everywhere, which expand gives without a resample */
    const int64_t *xs = kpl_tensor_shape(x);
    kpl_tensor *p = br[nb - 1];
    if (!p) return kpl_last_status();
    int64_t shape[4] = {xs[0], kpl_tensor_dim(p, 1), xs[2], xs[3]};
    br[nb - 1] = kpl_expand(p, 4, shape);
    kpl_tensor *y = kpl_module_forward(kpl_module_find(m, "project"), kpl_concat(nb, br, 1));
    out->n = 1;
    out->t[0] = y;
    return y ? KPL_OK : kpl_last_status();
}

static const kpl_module_kind aspp_kind = {"aspp", aspp_forward, NULL, KPL_MODULE_REPLAYABLE};

kpl_status kpl_nn_aspp(kpl_module *parent, const char *name, int64_t in, int64_t channels,
                       const int *rates, int nrates, double dropout, kpl_norm_kind norm,
                       kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(in > 0 && channels > 0 && nrates >= 1 && nrates <= KPL_MODULE_MAX_IO - 2,
              KPL_EINVAL, "aspp %s: in %lld, channels %lld > 0 and 1 to %d rates", name,
              (long long)in, (long long)channels, KPL_MODULE_MAX_IO - 2);
    for (int i = 0; i < nrates; i++)
        KPL_CHECK(rates[i] >= 1 && rates[i] <= 256, KPL_EINVAL, "aspp %s: rate %d not in [1, 256]",
                  name, rates[i]);
    kpl_module *m = NULL, *convs = NULL, *b = NULL, *proj = NULL;
    KPL_TRY(kpl_module_create(parent, name, &aspp_kind, NULL, &m));
    kpl_module_mark_recompute_unit(m); /* memory.recompute: blocks */
    KPL_TRY(kpl_nn_sequential(m, "convs", &convs));
    KPL_TRY(kpl_nn_sequential(convs, "0", &b));
    KPL_TRY(conv_norm_relu(b, 0, in, channels, 1, 1, norm));
    for (int i = 0; i < nrates; i++) {
        char n[8];
        snprintf(n, sizeof n, "%d", i + 1);
        KPL_TRY(kpl_nn_sequential(convs, n, &b));
        KPL_TRY(conv_norm_relu(b, 0, in, channels, 3, rates[i], norm));
    }
    char n[8];
    snprintf(n, sizeof n, "%d", nrates + 1);
    KPL_TRY(kpl_nn_sequential(convs, n, &b));
    KPL_TRY(kpl_nn_adaptive_avg_pool2d(b, "0", 1, 1, NULL));
    KPL_TRY(conv_norm_relu(b, 1, in, channels, 1, 1, norm));
    KPL_TRY(kpl_nn_sequential(m, "project", &proj));
    KPL_TRY(conv_norm_relu(proj, 0, (nrates + 2) * channels, channels, 1, 1, norm));
    if (dropout > 0) KPL_TRY(kpl_nn_dropout(proj, "3", dropout, NULL));
    if (out) *out = m;
    return KPL_OK;
}

/* ---- DeepLabv3 ------------------------------------------------------------------------------ */

/* model.deeplabv3.<key> */
static const kpl_key deeplab_keys[] = {
    {"output_stride", KPL_KEY_INT, "8", 8, 16, NULL,
     "the backbone's output stride: 8 (layer3 and layer4 dilated) or 16 (layer4)"},
    {"aspp_rates", KPL_KEY_INTS, "[12, 24, 36]", 1, 256, NULL,
     "the ASPP's atrous rates (the paper's: 6, 12, 18 at output stride 16; twice those at 8)"},
    {"aspp_channels", KPL_KEY_INT, "256", 8, 4096, NULL, "channels of the ASPP and the head"},
    {"aux", KPL_KEY_BOOL, "true", 0, 0, NULL,
     "an auxiliary FCN head on layer3 (training only; task.segmentation.aux_weight weighs it)"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};

typedef struct {
    bool aux;
} deeplab_state;

/* image (N, C, H, W) -> logits (N, classes, H, W) [, auxiliary logits in
 * training] */
static kpl_status deeplab_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    const deeplab_state *s = kpl_module_state(m);
    KPL_CHECK(in->n == 1 && kpl_tensor_ndim(in->t[0]) == 4, KPL_ESHAPE,
              "deeplabv3: wants one (N, C, H, W) image batch");
    kpl_tensor *x = in->t[0], *c4 = NULL;
    int64_t H = kpl_tensor_dim(x, 2), W = kpl_tensor_dim(x, 3);
    kpl_module *bb = kpl_module_find(m, "backbone");
    bool aux = s->aux && kpl_module_training(m);
    /* the backbone as a sequential (its stem's ReLU fused, each output
     * freed once the next child has run), in two runs: layer3's output
     * feeds the auxiliary head */
    int nb = kpl_module_num_children(bb), l3 = nb;
    for (int i = 0; i < nb; i++)
        if (!strcmp(kpl_module_name(kpl_module_child(bb, i)), "layer3")) l3 = i + 1;
    kpl_tensor_list cur = {1, {x}}, mid, top;
    KPL_TRY(kpl__forward_children(bb, 0, l3, &cur, &mid));
    KPL_TRY(kpl__forward_children(bb, l3, nb, &mid, &top));
    x = top.t[0];
    if (l3 < nb) c4 = mid.t[0];
    kpl_tensor *y = kpl_module_forward(kpl_module_find(m, "classifier"), x);
    out->n = 1;
    out->t[0] = kpl_upsample_bilinear(y, H, W, false);
    if (aux) {
        out->n = 2;
        out->t[1] = kpl_upsample_bilinear(
            kpl_module_forward(kpl_module_find(m, "aux_classifier"), c4), H, W, false);
    }
    for (int i = 0; i < out->n; i++)
        if (!out->t[i]) return kpl_last_status();
    return KPL_OK;
}

static const kpl_module_kind deeplab_kind = {"deeplabv3", deeplab_forward, free,
                                             KPL_MODULE_REPLAYABLE};

/* torchvision's FCNHead: 3x3 to in/4, norm, ReLU, dropout 0.1, 1x1 to the
 * classes. */
static kpl_status fcn_head(kpl_module *m, const char *name, int64_t in, int64_t classes,
                           kpl_norm_kind norm)
{
    kpl_module *h = NULL;
    KPL_TRY(kpl_nn_sequential(m, name, &h));
    KPL_TRY(conv_norm_relu(h, 0, in, in / 4, 3, 1, norm));
    KPL_TRY(kpl_nn_dropout(h, "3", 0.1, NULL));
    kpl_nn_conv c = {KPL_NN_CONV_INIT(in / 4, classes, 1)};
    return kpl_nn_conv2d(h, "4", &c, NULL);
}

static kpl_status deeplab_create(kpl_module *parent, const char *child, const kpl_model_config *cfg,
                                 kpl_device *dev, uint64_t seed, kpl_module **out)
{
    KPL_CHECK(cfg->num_classes >= 2, KPL_EINVAL, "model deeplabv3: needs num_classes >= 2 "
              "(got %lld)", (long long)cfg->num_classes);
    int64_t os, ch, r[16];
    int nr = 0;
    bool aux;
    KPL_TRY(kpl_key_int(&cfg->keys, "output_stride", &os));
    KPL_CHECK(os == 8 || os == 16, KPL_EINVAL, "model.deeplabv3.output_stride: 8 or 16 (got %lld)",
              (long long)os);
    KPL_TRY(kpl_key_ints(&cfg->keys, "aspp_rates", r, 16, &nr));
    KPL_TRY(kpl_key_int(&cfg->keys, "aspp_channels", &ch));
    KPL_TRY(kpl_key_bool(&cfg->keys, "aux", &aux));
    deeplab_state *s = calloc(1, sizeof *s);
    KPL_CHECK(s, KPL_ENOMEM, "model deeplabv3: out of memory");
    s->aux = aux;
    kpl_module *m = NULL;
    if (parent) KPL_TRY(kpl_module_create(parent, child, &deeplab_kind, s, &m));
    else KPL_TRY(kpl_module_create_root(dev, seed, &deeplab_kind, s, &m));
    *out = m; /* a root is the caller's to destroy, also on failure */
    kpl_model_config bc = *cfg;
    if (!bc.depth) bc.depth = 50;
    KPL_TRY(kpl__zoo_resnet_backbone(m, "backbone", &bc, (int)os, NULL));
    int64_t w = bc.width ? bc.width : 64, e = bc.depth >= 50 ? 4 : 1;
    int rates[16];
    for (int i = 0; i < nr; i++) rates[i] = (int)r[i];
    kpl_module *head = NULL;
    KPL_TRY(kpl_nn_sequential(m, "classifier", &head));
    KPL_TRY(kpl_nn_aspp(head, "0", 8 * w * e, ch, rates, nr, 0.5, cfg->norm, NULL));
    KPL_TRY(conv_norm_relu(head, 1, ch, ch, 3, 1, cfg->norm));
    kpl_nn_conv c = {KPL_NN_CONV_INIT(ch, cfg->num_classes, 1)};
    KPL_TRY(kpl_nn_conv2d(head, "4", &c, NULL));
    return aux ? fcn_head(m, "aux_classifier", 4 * w * e, cfg->num_classes, cfg->norm) : KPL_OK;
}

const kpl_zoo_model kpl__zoo_deeplabv3 = {
    .name = "deeplabv3",
    .doc = "DeepLabv3 (Chen et al. 2017): a dilated ResNet (depth, width, stem, norm), ASPP, "
           "logits at the input's size",
    .create = deeplab_create,
    .keys = deeplab_keys,
};

/* ---- U-Net ---------------------------------------------------------------------------------- */

/* model.unet.<key> (model.width: the first level's channels, 64; model.depth:
 * the down-sampling steps, 4) */
static const kpl_key unet_keys[] = {
    {"upsample", KPL_KEY_CHOICE, "transpose", 0, 0, "transpose|bilinear",
     "the decoder's upsampling: 2x2 stride-2 transposed convolutions, or bilinear resizes"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};

/* children: inc, down1..downD (max-pool + double conv), up1..upD (up, conv),
 * outc; up1 is the deepest */
static kpl_status unet_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_CHECK(in->n == 1 && kpl_tensor_ndim(in->t[0]) == 4, KPL_ESHAPE,
              "unet: wants one (N, C, H, W) image batch");
    const int *depth = kpl_module_state(m);
    kpl_tensor *skip[17];
    char name[32];
    kpl_tensor *x = kpl_module_forward(kpl_module_find(m, "inc"), in->t[0]);
    for (int i = 1; i <= *depth; i++) {
        skip[i - 1] = x;
        snprintf(name, sizeof name, "down%d", i);
        x = kpl_module_forward(kpl_module_find(m, name), x);
    }
    for (int i = 1; i <= *depth; i++) {
        kpl_tensor *s = skip[*depth - i];
        snprintf(name, sizeof name, "up%d.up", i);
        x = kpl_module_forward(kpl_module_find(m, name), x);
        if (!x || !s) return kpl_last_status();
        /* an odd size halves down and doubles up short: pad to the skip's */
        int64_t dh = kpl_tensor_dim(s, 2) - kpl_tensor_dim(x, 2);
        int64_t dw = kpl_tensor_dim(s, 3) - kpl_tensor_dim(x, 3);
        if (dh || dw) {
            int64_t pads[4] = {dw / 2, dw - dw / 2, dh / 2, dh - dh / 2};
            x = kpl_pad(x, 2, pads, KPL_PAD_CONSTANT, 0);
        }
        kpl_tensor *cat[2] = {s, x};
        snprintf(name, sizeof name, "up%d.conv", i);
        x = kpl_module_forward(kpl_module_find(m, name), kpl_concat(2, cat, 1));
    }
    out->n = 1;
    out->t[0] = kpl_module_forward(kpl_module_find(m, "outc"), x);
    return out->t[0] ? KPL_OK : kpl_last_status();
}

static const kpl_module_kind unet_kind = {"unet", unet_forward, free, KPL_MODULE_REPLAYABLE};

/* (conv 3x3, norm, ReLU) twice as children double_conv.0 .. .5 */
static kpl_status double_conv(kpl_module *parent, const char *name, int64_t in, int64_t out,
                              kpl_norm_kind norm)
{
    kpl_module *s = NULL, *d = NULL;
    KPL_TRY(kpl_nn_sequential(parent, name, &s));
    KPL_TRY(kpl_nn_sequential(s, "double_conv", &d));
    KPL_TRY(conv_norm_relu(d, 0, in, out, 3, 1, norm));
    return conv_norm_relu(d, 3, out, out, 3, 1, norm);
}

static kpl_status unet_create(kpl_module *parent, const char *child, const kpl_model_config *cfg,
                              kpl_device *dev, uint64_t seed, kpl_module **out)
{
    int64_t w = cfg->width ? cfg->width : 64, depth = cfg->depth ? cfg->depth : 4;
    KPL_CHECK(cfg->num_classes >= 2, KPL_EINVAL, "model unet: needs num_classes >= 2 (got %lld)",
              (long long)cfg->num_classes);
    KPL_CHECK(depth >= 1 && depth <= 8 && (w << depth) <= 65536, KPL_EINVAL,
              "model unet: depth %lld not in [1, 8], or width %lld << depth too wide",
              (long long)depth, (long long)w);
    KPL_CHECK((cfg->in_h >> depth) >= 1 && (cfg->in_w >> depth) >= 1, KPL_EINVAL,
              "model unet: %lld halvings leave nothing of a %lldx%lld input", (long long)depth,
              (long long)cfg->in_h, (long long)cfg->in_w);
    const char *up = NULL;
    KPL_TRY(kpl_key_string(&cfg->keys, "upsample", &up));
    bool bilinear = !strcmp(up, "bilinear");
    int *st = malloc(sizeof *st);
    KPL_CHECK(st, KPL_ENOMEM, "model unet: out of memory");
    *st = (int)depth;
    kpl_module *m = NULL;
    if (parent) KPL_TRY(kpl_module_create(parent, child, &unet_kind, st, &m));
    else KPL_TRY(kpl_module_create_root(dev, seed, &unet_kind, st, &m));
    *out = m; /* a root is the caller's to destroy, also on failure */
    KPL_TRY(double_conv(m, "inc", cfg->in_channels, w, cfg->norm));
    kpl_module_mark_recompute_unit(kpl_module_find(m, "inc")); /* memory.recompute: blocks */
    char name[16];
    for (int i = 1; i <= depth; i++) {
        kpl_module *d = NULL;
        snprintf(name, sizeof name, "down%d", i);
        KPL_TRY(kpl_nn_sequential(m, name, &d));
        kpl_module_mark_recompute_unit(d);
        kpl_module *mp = NULL;
        KPL_TRY(kpl_nn_sequential(d, "maxpool_conv", &mp));
        kpl_pool2d_params p2 = {.kernel = {2, 2}, .stride = {2, 2}};
        KPL_TRY(kpl_nn_max_pool2d(mp, "0", &p2, NULL));
        KPL_TRY(double_conv(mp, "1", w << (i - 1), w << i, cfg->norm));
    }
    for (int i = 1; i <= depth; i++) {
        int64_t cin = w << (depth - i + 1), cout = w << (depth - i);
        kpl_module *u = NULL;
        snprintf(name, sizeof name, "up%d", i);
        KPL_TRY(kpl_nn_sequential(m, name, &u)); /* a container: unet_forward runs its parts */
        if (bilinear) {
            KPL_TRY(kpl_nn_upsample(u, "up", 2, true, NULL));
            KPL_TRY(double_conv(u, "conv", cin + cout, cout, cfg->norm));
        } else {
            kpl_nn_conv t = {KPL_NN_CONV_INIT(cin, cout, 2), .stride = {2, 2}};
            KPL_TRY(kpl_nn_conv_transpose2d(u, "up", &t, NULL));
            KPL_TRY(double_conv(u, "conv", 2 * cout, cout, cfg->norm));
        }
        kpl_module_mark_recompute_unit(kpl_module_find(u, "conv"));
    }
    kpl_nn_conv c = {KPL_NN_CONV_INIT(w, cfg->num_classes, 1)};
    return kpl_nn_conv2d(m, "outc", &c, NULL);
}

const kpl_zoo_model kpl__zoo_unet = {
    .name = "unet",
    .doc = "U-Net (Ronneberger et al. 2015) with padded convolutions and norms: width channels "
           "at the first level, depth halvings",
    .create = unet_create,
    .keys = unet_keys,
};
