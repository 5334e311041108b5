/*
 * zoo.h — the model zoo: MLP, LeNet-5, a small CNN and torchvision's
 * ResNets as module trees (module.h) with torchvision's parameter names,
 * whole or as a backbone inside a bigger model.
 *
 *   kpl_model_config c = {.name = "resnet", .depth = 18, .stem = KPL_STEM_CIFAR,
 *                         .num_classes = 10, .in_channels = 3, .in_h = 32, .in_w = 32};
 *   kpl_module *net = NULL;
 *   kpl_zoo_create(&c, kpl_device_cpu(), 42, &net);
 */
#ifndef KPL_ZOO_H
#define KPL_ZOO_H

#include "keys.h"
#include "module.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A ResNet's stem: ImageNet's 7x7/2 convolution and 3x3/2 max-pool, or a
 * 3x3/1 convolution for 32x32 inputs ("imagenet", "cifar"). */
#define KPL_RESNET_STEMS(X) X(KPL_STEM_IMAGENET, "imagenet") X(KPL_STEM_CIFAR, "cifar")
typedef enum { KPL_RESNET_STEMS(KPL_ENUM_VALUE) } kpl_resnet_stem;
KPL_ENUM_DECLARE(kpl_resnet_stem);

/* A ResNet's normalisation layers: batch norm, or group norm (Wu & He
 * 2018; 32 groups, fewer where a layer's channels are not a multiple),
 * which does not depend on the batch: for detectors trained from scratch
 * on small per-rank batches, and so that N ranks x B images learn what
 * 1 x N B does. */
#define KPL_NORMS(X) X(KPL_NORM_BATCH, "batch") X(KPL_NORM_GROUP, "group")
typedef enum { KPL_NORMS(KPL_ENUM_VALUE) } kpl_norm_kind;
KPL_ENUM_DECLARE(kpl_norm_kind);

/* A model of the zoo, as a recipe's model section gives it.  Zero means
 * "the architecture's default" for
 * width, depth and hidden.
 *   mlp     in -> hidden... -> classes, ReLU between (default hidden 512, 256)
 *   lenet   LeNet-5: conv 5x5 (6, padding 2) pool, conv 5x5 (16) pool,
 *           120, 84, classes (width scales the 6 and 16)
 *   cnn     depth stages (default 2) of conv 3x3 (width << stage, default
 *           32) + batch norm + ReLU + 2x2 max-pool, then hidden (default
 *           128) -> classes
 *   resnet  torchvision's ResNet-18/34/50/101/152 (depth), base width 64,
 *           ImageNet stem (7x7/2 + 3x3/2 max-pool) or CIFAR stem (3x3/1)
 * dropout applies before the last linear layer of mlp and cnn.  The other
 * built-ins are registered models with keys of their own (kpl_zoo_model):
 * fcos, deeplabv3, unet, and the GAN pairs dcgan / dcgan_d and sngan /
 * sngan_d (a generator and its discriminator reading one key table:
 * docs/gan-nets.md). */
typedef struct {
    char name[32];              /* "mlp", "lenet", "cnn", "resnet", or a registered model;
                                   "none" (or ""): the task builds its own */
    int64_t num_classes;        /* resnet: 0 builds the backbone alone (up to layer4) */
    int64_t in_channels, in_h, in_w;
    int64_t width, depth;
    kpl_resnet_stem stem;
    kpl_norm_kind norm;         /* resnet: batch (default) or group norm */
    int64_t hidden[16];
    int nhidden;
    double dropout;
    bool zero_init_residual;
    /* model.<name>.<key>: the keys a registered model declares
     * (kpl_zoo_model.keys); kpl_model_config_complete fills their
     * defaults */
    kpl_keyvals keys;
    /* batch norms synchronised over the ranks in training (kpl_nn_sync_batch_norm;
     * the trainer applies it to its models when world > 1) */
    bool sync_bn;
    /* a fresh run's first weights (not a resume's): the "model." tensors of
     * a checkpoint (kpl import onnx's, or a kpl run's) loaded into the
     * module weights_into of model 0 ("" for all of it), by name; tensors
     * either side lacks are listed in the log, a shape that differs is an
     * error */
    char weights[1024];
    char weights_into[128];
} kpl_model_config;

/* ---- the registry: models found by name (model.name) ---- */
/*
 * A model kind a program or a plugin adds: `kpl train` builds it for a
 * recipe whose model.name names it, and kpl_zoo_add puts it inside a
 * bigger model (a backbone).  create makes the model as a root on dev from
 * seed when parent is NULL, else as parent's child `child` (the root's
 * device and generator); *out receives it (a root is the caller's to
 * destroy, also when create fails after making it).  cfg is complete
 * (kpl_model_config_complete's common checks done).
 */
typedef struct {
    const char *name; /* model.name; first member (registries) */
    const char *doc;  /* one line for `kpl train --keys` */
    kpl_status (*create)(kpl_module *parent, const char *child, const kpl_model_config *cfg,
                         kpl_device *dev, uint64_t seed, kpl_module **out);
    /* Optional: its own recipe keys, model.<name>.<key> (keys.h), which
     * create reads from cfg->keys; a NULL-named row ends them. */
    const kpl_key *keys;
} kpl_zoo_model;

/* Adds m (borrowed, static).  KPL_EINVAL for a name known already.  From
 * a plugin's constructor: see kpl_plugin_load (trainer.h). */
kpl_status kpl_zoo_register(const kpl_zoo_model *m);
/* The model called name, or NULL; every model known, built-ins first. */
const kpl_zoo_model *kpl_zoo_find(const char *name);
int kpl_zoo_count(void);
const kpl_zoo_model *kpl_zoo_at(int i);

/* A named preset, as torchvision.models names them: "mlp", "lenet", "cnn"
 * (1x28x28 inputs), "resnet18_cifar" (CIFAR stem, 3x32x32), "resnet18",
 * "resnet34", "resnet50", "resnet101", "resnet152" (3x224x224), with
 * num_classes outputs (resnets: 0 for the backbone alone).  *out is
 * complete (kpl_model_config_complete).  KPL_EINVAL for another name,
 * listing the known ones. */
kpl_status kpl_zoo_preset(const char *name, int64_t num_classes, kpl_model_config *out);
/* Fills the architecture's defaults into *c and checks it: KPL_EINVAL
 * naming the field when the input is too small for the architecture or a
 * value is out of range, or for a name no model has (listing the known).
 * A registered model gets the common checks (input, classes); its create
 * checks the rest. */
kpl_status kpl_model_config_complete(kpl_model_config *c);
/* Builds the zoo's model as a root module with torchvision's parameter
 * names (conv1.weight, layer1.0.bn1.running_mean, fc.bias).  The ResNet's
 * parts are reachable for other heads: "conv1", "bn1", "layer1".."layer4"
 * (sequentials of blocks), "fc".  *out owned by the caller. */
kpl_status kpl_zoo_create(const kpl_model_config *cfg, kpl_device *dev, uint64_t seed,
                          kpl_module **out);
/* The same as a child `name` of parent (a backbone inside a bigger
 * model); *out (may be NULL) borrowed. */
kpl_status kpl_zoo_add(kpl_module *parent, const char *name, const kpl_model_config *cfg,
                       kpl_module **out);

/* ---- parts of the zoo's segmentation networks (nn/segnets.c) ---- */

/* Atrous spatial pyramid pooling (DeepLabv3), torchvision's ASPP: branches
 * convs.0 (1x1), convs.1 .. convs.<nrates> (3x3 dilated by each rate),
 * convs.<nrates + 1> (global average pool, 1x1), each followed by a norm
 * and a ReLU, every branch `channels` wide; concatenated and projected
 * to `channels` (project: 1x1, norm, ReLU, dropout when > 0).  Forward:
 * (N, in, H, W) -> (N, channels, H, W).  *out (may be NULL) borrowed. */
kpl_status kpl_nn_aspp(kpl_module *parent, const char *name, int64_t in, int64_t channels,
                       const int *rates, int nrates, double dropout, kpl_norm_kind norm,
                       kpl_module **out);

#ifdef __cplusplus
}
#endif
#endif /* KPL_ZOO_H */
