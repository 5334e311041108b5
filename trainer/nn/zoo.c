/*
 * zoo.c — the model zoo built from modules: MLP, LeNet-5, a small CNN and
 * torchvision's ResNets, with torchvision's parameter names (zoo.h).
 */
#include "nn_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The built-in architectures, by model.name. */
typedef enum { ARCH_MLP, ARCH_LENET, ARCH_CNN, ARCH_RESNET } arch;
static const char *const arch_names[] = {"mlp", "lenet", "cnn", "resnet", NULL};
static int arch_of(const kpl_model_config *c) { return kpl__name_index(arch_names, c->name); }

/* ---- ResNet blocks ------------------------------------------------------------------------ */

/* torchvision's BasicBlock (2 convs) and Bottleneck (3): children conv1,
 * bn1, conv2, bn2[, conv3, bn3][, downsample], so the names match. */
typedef struct {
    kpl_module *conv[3], *bn[3], *down;
    int n;
} block_state;

static kpl_status block_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    const block_state *b = kpl_module_state(m);
    kpl_tensor *x = in->t[0];
    /* A pool per block: what the gradients do not keep (batch-norm
     * outputs, the sum before the last ReLU) is freed at the block's end
     * instead of at the end of the forward pass, the peak of a training
     * step. */
    kpl_pool *p = kpl_pool_push();
    if (!p) return kpl_last_status();
    kpl_tensor *y = x;
    for (int k = 0; k < b->n; k++) {
        y = kpl_module_forward(b->conv[k], y);
        y = k + 1 < b->n ? kpl_nn_forward_relu(b->bn[k], y) : kpl_module_forward(b->bn[k], y);
    }
    kpl_tensor *o = kpl_relu(kpl_add(y, b->down ? kpl_module_forward(b->down, x) : x));
    if (o) kpl_tensor_retain(o);
    kpl_pool_pop(p);
    out->n = 1;
    out->t[0] = kpl_autorelease(o);
    return o ? KPL_OK : kpl_last_status();
}

static const kpl_module_kind block_kind = {"resnet_block", block_forward, free,
                                           KPL_MODULE_REPLAYABLE};

/* A normalisation layer of ch channels: batch norm, or group norm with 32
 * groups (the largest power of two dividing ch, when 32 does not). */
kpl_status kpl__zoo_add_norm(kpl_module *parent, const char *name, int64_t ch,
                            kpl_norm_kind norm, kpl_module **out)
{
    if (norm == KPL_NORM_BATCH) return kpl_nn_batch_norm(parent, name, ch, 0.1, 1e-5, out);
    int g = 32;
    while (ch % g) g /= 2;
    return kpl_nn_group_norm(parent, name, g, ch, 1e-5, out);
}

/* conv (no bias, Kaiming fan-out; dilated by `dil`, padded to keep the
 * size) + norm with initial scale `scale` */
static kpl_status conv_bn(kpl_module *parent, const char *cname, const char *bname, int64_t in,
                          int64_t out, int k, int stride, int dil, double scale,
                          kpl_norm_kind norm, kpl_module **conv, kpl_module **bn)
{
    kpl_nn_conv c = {KPL_NN_CONV_INIT(in, out, k), .stride = {stride, stride},
                     .padding = {dil * (k / 2), dil * (k / 2)}, .dilation = {dil, dil},
                     .no_bias = true, .init = KPL_NN_INIT_KAIMING_OUT};
    KPL_TRY(kpl_nn_conv2d(parent, cname, &c, conv));
    KPL_TRY(kpl__zoo_add_norm(parent, bname, out, norm, bn));
    return scale == 1 ? KPL_OK : kpl_k_fill(kpl_module_get_param(*bn, "weight"), scale);
}

/* dil: the dilation of the block's 3x3 convolutions (a basic block's
 * first alone, as mmsegmentation's; a bottleneck's one) */
static kpl_status add_block(kpl_module *layer, int idx, int64_t in, int64_t planes, int stride,
                            int dil, bool bottleneck, double last_scale, kpl_norm_kind norm,
                            int64_t *out_ch)
{
    char name[16];
    snprintf(name, sizeof name, "%d", idx);
    block_state *b = calloc(1, sizeof *b);
    KPL_CHECK(b, KPL_ENOMEM, "resnet: out of memory");
    kpl_module *m = NULL;
    KPL_TRY(kpl_module_create(layer, name, &block_kind, b, &m));
    kpl_module_mark_recompute_unit(m); /* memory.recompute: blocks */
    int64_t out = bottleneck ? planes * 4 : planes;
    b->n = bottleneck ? 3 : 2;
    /* torchvision puts the stride on the 3x3 convolution (ResNet v1.5) */
    int64_t cin[3] = {in, planes, planes}, cout[3] = {planes, bottleneck ? planes : out, out};
    int ks[3] = {bottleneck ? 1 : 3, 3, 1}, ss[3] = {bottleneck ? 1 : stride, bottleneck ? stride : 1, 1};
    int ds[3] = {bottleneck ? 1 : dil, bottleneck ? dil : 1, 1};
    for (int k = 0; k < b->n; k++) {
        char cn[16], bn[16];
        snprintf(cn, sizeof cn, "conv%d", k + 1);
        snprintf(bn, sizeof bn, "bn%d", k + 1);
        KPL_TRY(conv_bn(m, cn, bn, cin[k], cout[k], ks[k], ss[k], ds[k],
                        k + 1 == b->n ? last_scale : 1, norm, &b->conv[k], &b->bn[k]));
    }
    if (stride != 1 || in != out) {
        KPL_TRY(kpl_nn_sequential(m, "downsample", &b->down));
        kpl_module *c = NULL, *n = NULL;
        KPL_TRY(conv_bn(b->down, "0", "1", in, out, 1, stride, 1, 1, norm, &c, &n));
    }
    *out_ch = out;
    return KPL_OK;
}

/* output_stride 32: torchvision's ResNet; 16 or 8: layer4 (and layer3)
 * keep their input's size, their strides replaced by dilation as
 * torchvision's replace_stride_with_dilation does (a stage's first block
 * at the dilation before it, the rest at the new one). */
static kpl_status build_resnet(kpl_module *root, const kpl_model_config *c, int output_stride)
{
    static const int counts[5][4] = {
        {2, 2, 2, 2}, {3, 4, 6, 3}, {3, 4, 6, 3}, {3, 4, 23, 3}, {3, 8, 36, 3}};
    int v = c->depth == 18 ? 0 : c->depth == 34 ? 1 : c->depth == 50 ? 2 : c->depth == 101 ? 3 : 4;
    bool bottleneck = c->depth >= 50;
    kpl_module *conv = NULL, *bn = NULL;
    if (c->stem == KPL_STEM_CIFAR) {
        KPL_TRY(conv_bn(root, "conv1", "bn1", c->in_channels, c->width, 3, 1, 1, 1, c->norm,
                        &conv, &bn));
        KPL_TRY(kpl_nn_relu(root, "relu", NULL));
    } else {
        kpl_nn_conv s = {KPL_NN_CONV_INIT(c->in_channels, c->width, 7), .stride = {2, 2},
                         .padding = {3, 3}, .no_bias = true, .init = KPL_NN_INIT_KAIMING_OUT};
        KPL_TRY(kpl_nn_conv2d(root, "conv1", &s, NULL));
        KPL_TRY(kpl__zoo_add_norm(root, "bn1", c->width, c->norm, NULL));
        KPL_TRY(kpl_nn_relu(root, "relu", NULL));
        kpl_pool2d_params mp = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
        KPL_TRY(kpl_nn_max_pool2d(root, "maxpool", &mp, NULL));
    }
    /* the stem is a unit of memory.recompute: blocks (its activations at
     * full resolution are a ResNet's largest) */
    KPL_TRY(kpl_module_mark_recompute_span(root, 0, kpl_module_num_children(root)));
    int64_t in = c->width;
    double last_scale = c->zero_init_residual ? 0 : 1;
    int dil = 1;
    for (int s = 0; s < 4; s++) {
        char name[16];
        snprintf(name, sizeof name, "layer%d", s + 1);
        kpl_module *layer = NULL;
        KPL_TRY(kpl_nn_sequential(root, name, &layer));
        int stride = s > 0 ? 2 : 1, before = dil;
        bool dilate = (s == 3 && output_stride <= 16) || (s == 2 && output_stride <= 8);
        if (dilate) dil *= stride, stride = 1;
        for (int k = 0; k < counts[v][s]; k++)
            KPL_TRY(add_block(layer, k, in, c->width << s, k == 0 ? stride : 1,
                              k == 0 ? before : dil, bottleneck, last_scale, c->norm, &in));
    }
    if (c->num_classes == 0) return KPL_OK; /* a backbone: layer4's features */
    KPL_TRY(kpl_nn_adaptive_avg_pool2d(root, "avgpool", 1, 1, NULL));
    KPL_TRY(kpl_nn_flatten(root, "flatten", NULL));
    return kpl_nn_linear(root, "fc", in, c->num_classes, true, NULL);
}

/* ---- the small ones ------------------------------------------------------------------------- */

/* linear layers fc<first>... from `in` through hidden to classes, ReLU
 * between, dropout before the last */
static kpl_status build_head(kpl_module *root, const kpl_model_config *c, int64_t in, int first,
                             int nhidden, const int64_t *hidden)
{
    char name[32];
    for (int i = 0; i <= nhidden; i++) {
        int64_t o = i < nhidden ? hidden[i] : c->num_classes;
        if (i == nhidden && c->dropout > 0) KPL_TRY(kpl_nn_dropout(root, "dropout", c->dropout, NULL));
        snprintf(name, sizeof name, "fc%d", first + i);
        KPL_TRY(kpl_nn_linear(root, name, in, o, true, NULL));
        if (i < nhidden) {
            snprintf(name, sizeof name, "relu_fc%d", first + i);
            KPL_TRY(kpl_nn_relu(root, name, NULL));
        }
        in = o;
    }
    return KPL_OK;
}

/* conv<i> [bn<i>] then 2x2 max-pool then ReLU.  ReLU then max-pool is
 * max-pool then ReLU (ReLU is monotonic), and the second order runs ReLU
 * and its gradient on a quarter of the elements.  The gradients agree
 * too, but for windows whose maximum ties, where both orders pass the
 * gradient to one of the tied elements. */
static kpl_status conv_stage(kpl_module *root, int i, int64_t in, int64_t out, int k, int pad,
                             bool bn)
{
    char cn[24], bn_name[24], pn[24], rn[24];
    snprintf(cn, sizeof cn, "conv%d", i);
    snprintf(bn_name, sizeof bn_name, "bn%d", i);
    snprintf(pn, sizeof pn, "pool%d", i);
    snprintf(rn, sizeof rn, "relu%d", i);
    kpl_nn_conv c = {KPL_NN_CONV_INIT(in, out, k), .padding = {pad, pad}, .no_bias = bn,
                     .init = bn ? KPL_NN_INIT_KAIMING_OUT : KPL_NN_INIT_DEFAULT};
    KPL_TRY(kpl_nn_conv2d(root, cn, &c, NULL));
    if (bn) KPL_TRY(kpl_nn_batch_norm(root, bn_name, out, 0.1, 1e-5, NULL));
    kpl_pool2d_params p2 = {.kernel = {2, 2}, .stride = {2, 2}};
    KPL_TRY(kpl_nn_max_pool2d(root, pn, &p2, NULL));
    return kpl_nn_relu(root, rn, NULL);
}

kpl_status kpl_model_config_complete(kpl_model_config *c)
{
    KPL_CHECK(c, KPL_EINVAL, "model: no config");
    int ar = arch_of(c);
    if (!kpl_zoo_find(c->name)) {
        char known[512];
        kpl__zoo_names(known, sizeof known);
        if (!c->name[0] || !strcmp(c->name, "none"))
            return KPL_ERROR(KPL_EINVAL, "model: no model named (known: %s)", known);
        return KPL_ERROR(KPL_EINVAL, "model: unknown model '%.32s' (known: %s)", c->name, known);
    }
    const char *a = c->name;
    char section[64];
    snprintf(section, sizeof section, "model.%.32s", a);
    KPL_TRY(kpl_keyvals_check(kpl_zoo_find(a)->keys, section, &c->keys));
    KPL_CHECK(c->num_classes >= 0, KPL_EINVAL, "model %s: num_classes %lld", a,
              (long long)c->num_classes);
    KPL_CHECK(c->in_channels > 0 && c->in_h > 0 && c->in_w > 0, KPL_EINVAL,
              "model %s: input (%lld, %lld, %lld) must be positive", a,
              (long long)c->in_channels, (long long)c->in_h, (long long)c->in_w);
    if (ar < 0) return KPL_OK; /* a registered model checks the rest itself */
    KPL_CHECK(c->num_classes > 0 || (c->num_classes == 0 && ar == ARCH_RESNET),
              KPL_EINVAL, "model: need num_classes > 0 (got %lld; 0, a backbone, is for resnet)",
              (long long)c->num_classes);
    KPL_CHECK(c->nhidden >= 0 && c->nhidden <= 16, KPL_EINVAL, "model %s: 0 to 16 hidden layers",
              a);
    KPL_CHECK(c->dropout >= 0 && c->dropout < 1, KPL_EINVAL, "model %s: dropout %g not in [0, 1)",
              a, c->dropout);
    switch ((arch)ar) {
    case ARCH_MLP:
        if (c->nhidden == 0) c->hidden[0] = 512, c->hidden[1] = 256, c->nhidden = 2;
        break;
    case ARCH_LENET:
        if (!c->width) c->width = 6;
        KPL_CHECK(c->in_h >= 16 && c->in_w >= 16, KPL_EINVAL,
                  "model lenet: input %lldx%lld is too small (at least 16x16)",
                  (long long)c->in_h, (long long)c->in_w);
        break;
    case ARCH_CNN:
        if (!c->width) c->width = 32;
        if (!c->depth) c->depth = 2;
        if (c->nhidden == 0) c->hidden[0] = 128, c->nhidden = 1;
        KPL_CHECK(c->depth <= 12 && (c->in_h >> c->depth) >= 1 && (c->in_w >> c->depth) >= 1,
                  KPL_EINVAL, "model cnn: %lld stages halve %lldx%lld to nothing",
                  (long long)c->depth, (long long)c->in_h, (long long)c->in_w);
        KPL_CHECK((c->width << (c->depth - 1)) <= 65536, KPL_EINVAL, "model cnn: too wide");
        break;
    case ARCH_RESNET:
        if (!c->width) c->width = 64;
        KPL_CHECK(c->depth == 18 || c->depth == 34 || c->depth == 50 || c->depth == 101 ||
                      c->depth == 152,
                  KPL_EINVAL, "model resnet: depth is 18, 34, 50, 101 or 152 (got %lld)",
                  (long long)c->depth);
        KPL_CHECK(c->in_h >= (c->stem == KPL_STEM_CIFAR ? 8 : 32) && c->in_w >= (c->stem == KPL_STEM_CIFAR ? 8 : 32),
                  KPL_EINVAL, "model resnet: input %lldx%lld is too small for the %s stem",
                  (long long)c->in_h, (long long)c->in_w, kpl_resnet_stem_name(c->stem));
        break;
    }
    KPL_CHECK(c->width >= 0 && c->width <= 4096, KPL_EINVAL, "model %s: width %lld out of range",
              a, (long long)c->width);
    return KPL_OK;
}

/* The zoo's layers into `root` (a sequential). */
static kpl_status build(kpl_module *root, const kpl_model_config *cfg)
{
    kpl_model_config c = *cfg;
    KPL_TRY(kpl_model_config_complete(&c));
    switch ((arch)arch_of(&c)) {
    case ARCH_MLP:
        KPL_TRY(kpl_nn_flatten(root, "flatten", NULL));
        return build_head(root, &c, c.in_channels * c.in_h * c.in_w, 1, c.nhidden, c.hidden);
    case ARCH_LENET: {
        int64_t c1 = c.width, c2 = c.width * 16 / 6;
        int64_t h = (c.in_h / 2 - 4) / 2, w = (c.in_w / 2 - 4) / 2;
        static const int64_t hidden[2] = {120, 84};
        KPL_TRY(conv_stage(root, 1, c.in_channels, c1, 5, 2, false));
        KPL_TRY(conv_stage(root, 2, c1, c2, 5, 0, false));
        KPL_TRY(kpl_nn_flatten(root, "flatten", NULL));
        return build_head(root, &c, c2 * h * w, 1, 2, hidden);
    }
    case ARCH_CNN: {
        int64_t ch = c.in_channels, h = c.in_h, w = c.in_w;
        for (int s = 0; s < c.depth; s++) {
            KPL_TRY(conv_stage(root, s + 1, ch, c.width << s, 3, 1, true));
            ch = c.width << s;
            h /= 2, w /= 2;
        }
        KPL_TRY(kpl_nn_flatten(root, "flatten", NULL));
        return build_head(root, &c, ch * h * w, 1, c.nhidden, c.hidden);
    }
    case ARCH_RESNET: return build_resnet(root, &c, 32);
    }
    return KPL_OK;
}

/* The built-ins' create: a sequential root or child holding the layers. */
static kpl_status builtin_create(kpl_module *parent, const char *child, const kpl_model_config *cfg,
                                 kpl_device *dev, uint64_t seed, kpl_module **out)
{
    kpl_module *m = NULL;
    if (parent) KPL_TRY(kpl_nn_sequential(parent, child, &m));
    else KPL_TRY(kpl_nn_sequential_root(dev, seed, &m));
    *out = m; /* a root is the caller's to destroy, also on failure */
    return build(m, cfg);
}

static const kpl_zoo_model mlp = {"mlp", "in -> hidden... -> classes, ReLU between",
                                  builtin_create, NULL};
static const kpl_zoo_model lenet = {"lenet", "LeNet-5", builtin_create, NULL};
static const kpl_zoo_model cnn = {"cnn", "conv 3x3 + batch norm + ReLU + max-pool stages, then "
                                  "hidden -> classes", builtin_create, NULL};
static const kpl_zoo_model resnet = {"resnet", "torchvision's ResNet-18/34/50/101/152 (depth)",
                                     builtin_create, NULL};
static const void *const builtin[] = {&mlp,           &lenet, &cnn, &resnet, &kpl__zoo_fcos,
                                     &kpl__zoo_deeplabv3, &kpl__zoo_unet, &kpl__zoo_dcgan,
                                     &kpl__zoo_dcgan_d, &kpl__zoo_sngan, &kpl__zoo_sngan_d,
                                     NULL};
/* Registered into the owners' registry at the bottom (io/plugin.c) when
 * kpl loads, before any recipe is read. */
__attribute__((constructor)) static void register_builtin(void)
{
    kpl__owners_builtin(KPL__OWN_MODEL, builtin);
}

static kpl__registry *const models = &kpl__owners[KPL__OWN_MODEL];

kpl_status kpl_zoo_register(const kpl_zoo_model *m) { return kpl__registry_add(models, m); }
const kpl_zoo_model *kpl_zoo_find(const char *name) { return kpl__registry_find(models, name); }
int kpl_zoo_count(void) { return kpl__registry_count(models); }
const kpl_zoo_model *kpl_zoo_at(int i) { return kpl__registry_at(models, i); }

kpl_status kpl_zoo_create(const kpl_model_config *cfg, kpl_device *dev, uint64_t seed,
                          kpl_module **out)
{
    KPL_CHECK(cfg && out, KPL_EINVAL, "model: bad arguments");
    *out = NULL;
    kpl_model_config c = *cfg;
    KPL_TRY(kpl_model_config_complete(&c));
    kpl_module *root = NULL;
    kpl_status st = kpl_zoo_find(c.name)->create(NULL, NULL, &c, dev, seed, &root);
    if (st < 0) {
        kpl_module_destroy(root);
        return st;
    }
    *out = root;
    return KPL_OK;
}

kpl_status kpl_zoo_add(kpl_module *parent, const char *name, const kpl_model_config *cfg,
                       kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(cfg && parent, KPL_EINVAL, "model: bad arguments");
    kpl_model_config c = *cfg;
    KPL_TRY(kpl_model_config_complete(&c));
    kpl_module *m = NULL;
    KPL_TRY(kpl_zoo_find(c.name)->create(parent, name, &c, NULL, 0, &m));
    if (out) *out = m;
    return KPL_OK;
}

kpl_status kpl__zoo_resnet_backbone(kpl_module *parent, const char *name,
                                    const kpl_model_config *cfg, int output_stride,
                                    kpl_module **out)
{
    KPL_CHECK(output_stride == 8 || output_stride == 16 || output_stride == 32, KPL_EINVAL,
              "model: output_stride is 8, 16 or 32 (got %d)", output_stride);
    kpl_model_config c = *cfg;
    snprintf(c.name, sizeof c.name, "resnet");
    c.num_classes = 0;
    memset(&c.keys, 0, sizeof c.keys);
    KPL_TRY(kpl_model_config_complete(&c));
    kpl_module *m = NULL;
    KPL_TRY(kpl_nn_sequential(parent, name, &m));
    if (out) *out = m;
    return build_resnet(m, &c, output_stride);
}

kpl_status kpl_zoo_preset(const char *name, int64_t num_classes, kpl_model_config *out)
{
    KPL_CHECK(name && out, KPL_EINVAL, "kpl_zoo_preset: need a name and a config");
    static const struct {
        const char *name, *arch;
        int depth, channels, side;
        kpl_resnet_stem stem;
    } presets[] = {
        {"mlp", "mlp", 0, 1, 28, KPL_STEM_IMAGENET},
        {"lenet", "lenet", 0, 1, 28, KPL_STEM_IMAGENET},
        {"cnn", "cnn", 0, 1, 28, KPL_STEM_IMAGENET},
        {"resnet18_cifar", "resnet", 18, 3, 32, KPL_STEM_CIFAR},
        {"resnet18", "resnet", 18, 3, 224, KPL_STEM_IMAGENET},
        {"resnet34", "resnet", 34, 3, 224, KPL_STEM_IMAGENET},
        {"resnet50", "resnet", 50, 3, 224, KPL_STEM_IMAGENET},
        {"resnet101", "resnet", 101, 3, 224, KPL_STEM_IMAGENET},
        {"resnet152", "resnet", 152, 3, 224, KPL_STEM_IMAGENET},
    };
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(name, presets[i].name)) continue;
        memset(out, 0, sizeof *out);
        snprintf(out->name, sizeof out->name, "%s", presets[i].arch);
        out->depth = presets[i].depth, out->stem = presets[i].stem;
        out->in_channels = presets[i].channels, out->in_h = out->in_w = presets[i].side;
        out->num_classes = num_classes;
        return kpl_model_config_complete(out);
    }
    return KPL_ERROR(KPL_EINVAL,
                     "model: unknown preset '%s' (known: mlp, lenet, cnn, resnet18_cifar, "
                     "resnet18, resnet34, resnet50, resnet101, resnet152)",
                     name);
}
