/*
 * module.h — kpl's nn room: modules in the spirit of torch.nn.  A module
 * owns named parameters, named buffers (state that is not trained, such as
 * batch norm's running statistics) and named child modules, has a training
 * or evaluation mode, and a forward function given by its kind (a small
 * vtable).  A tree of modules is a model; the dotted paths of its tensors
 * ("layer1.0.bn1.running_mean") form its state dict.
 *
 * Building a model: every constructor takes the parent and the child's
 * name, and creates the child's tensors on the root's device from the
 * root's generator (Philox, seeded at kpl_module_create_root), so a model
 * built twice from one seed is the same model.
 *
 *   kpl_module *net = NULL, *blk = NULL;
 *   kpl_nn_sequential_root(kpl_device_cpu(), 42, &net);
 *   kpl_nn_conv c = {KPL_NN_CONV_INIT(1, 8, 3), .padding = {1, 1}};
 *   kpl_nn_conv2d(net, "0", &c, NULL);
 *   kpl_nn_relu(net, "1", NULL);
 *   kpl_nn_flatten(net, "2", NULL);
 *   kpl_nn_linear(net, "3", 8 * 28 * 28, 10, true, NULL);
 *   kpl_pool *p = kpl_pool_push();
 *   kpl_tensor *logits = kpl_module_forward(net, x);      // NULL on error
 *   ...
 *   kpl_pool_pop(p);
 *   kpl_module_destroy(net);
 *
 * A new layer is a kind (name + forward) and a constructor that adds its
 * tensors; examples/ shows one.  A forward takes a list of tensors and
 * gives a list, so a module may return several feature maps (an FPN), or
 * boxes and scores, or take an image and a mask.
 *
 * Ownership: the caller owns a root (kpl_module_destroy); a parent owns
 * its children; a module owns its tensors.  Forward results are owned by
 * the current pool (graph.h).  Thread-safety: one thread at a time per
 * tree.
 */
#ifndef KPL_MODULE_H
#define KPL_MODULE_H

#include "autograd.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kpl_module kpl_module;

/* The inputs or outputs of a forward: n tensors (pool-owned). */
#define KPL_MODULE_MAX_IO 16
typedef struct {
    int n;
    kpl_tensor *t[KPL_MODULE_MAX_IO];
} kpl_tensor_list;

/* What a kind of module does.  forward reads in (n >= 1) and fills out
 * (pool-owned results); it returns the status of the first op that
 * failed (kpl_last_status) and leaves the message.  state_free (may be
 * NULL) frees the kind's state when the module is destroyed; the tensors
 * and children are the module's own business. */
typedef struct {
    const char *name;
    kpl_status (*forward)(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out);
    void (*state_free)(void *state);
} kpl_module_kind;

/* ---- the tree ------------------------------------------------------------------------ */

/* A root module of `kind` on dev (NULL: the CPU) whose tensors are
 * initialised from Philox(seed).  `state` (may be NULL) belongs to the
 * module from here on, also on failure.  *out owned by the caller. */
kpl_status kpl_module_create_root(kpl_device *dev, uint64_t seed, const kpl_module_kind *kind,
                                  void *state, kpl_module **out);
/* A child of parent called `name` (1 to 63 of [A-Za-z0-9_], unique among
 * the parent's tensors and children).  *out (may be NULL) is borrowed:
 * the parent owns it.  state as above. */
kpl_status kpl_module_create(kpl_module *parent, const char *name, const kpl_module_kind *kind,
                             void *state, kpl_module **out);
/* Destroys a root and everything under it; NULL is a no-op.  A child
 * goes with its root (asserted). */
void kpl_module_destroy(kpl_module *m);

/* Adds t as parameter `name` (it requires grad from here on) or buffer;
 * the module takes over the caller's reference, also on failure.  Names
 * as for children. */
kpl_status kpl_module_add_param(kpl_module *m, const char *name, kpl_tensor *t);
kpl_status kpl_module_add_buffer(kpl_module *m, const char *name, kpl_tensor *t);

const kpl_module_kind *kpl_module_kind_of(const kpl_module *m);
void *kpl_module_state(const kpl_module *m);
const char *kpl_module_name(const kpl_module *m); /* "" for a root */
kpl_module *kpl_module_parent(const kpl_module *m);
kpl_device *kpl_module_device(const kpl_module *m);
/* The root's generator: initialisation, then dropout masks (borrowed;
 * checkpoints save its position). */
kpl_rng *kpl_module_rng(const kpl_module *m);

/* Direct children, tensors of this module alone (borrowed; NULL when
 * there is none of that name). */
int kpl_module_num_children(const kpl_module *m);
kpl_module *kpl_module_child(const kpl_module *m, int i);
kpl_module *kpl_module_find(const kpl_module *m, const char *dotted); /* "layer1.0" */
kpl_tensor *kpl_module_get_param(const kpl_module *m, const char *name);
kpl_tensor *kpl_module_get_buffer(const kpl_module *m, const char *name);
/* The local name of parameter/buffer i of this module alone (borrowed). */
int kpl_module_num_own_params(const kpl_module *m);
kpl_tensor *kpl_module_own_param(const kpl_module *m, int i);
int kpl_module_num_own_buffers(const kpl_module *m);
kpl_tensor *kpl_module_own_buffer(const kpl_module *m, int i);

/* ---- every tensor under a module, with dotted names ------------------------------------ */
/* Depth first, a module's own tensors before its children's, in the order
 * they were added (torch.nn.Module.named_parameters' order).  Arrays and
 * names are borrowed and stay valid until something is added under m. */
int kpl_module_num_params(kpl_module *m);
kpl_tensor *const *kpl_module_params(kpl_module *m);
const char *kpl_module_param_name(kpl_module *m, int i);
int kpl_module_num_buffers(kpl_module *m);
kpl_tensor *const *kpl_module_buffers(kpl_module *m);
const char *kpl_module_buffer_name(kpl_module *m, int i);
/* The index of the parameter called `dotted`, or -1. */
int kpl_module_param_index(kpl_module *m, const char *dotted);
/* Element count of the parameters. */
int64_t kpl_module_param_count(kpl_module *m);

/* ---- modes ------------------------------------------------------------------------------ */
/* Training mode on or off for m and everything under it (batch norm's
 * batch statistics, dropout); a frozen module stays in evaluation mode.
 * A module starts in training mode. */
void kpl_module_set_training(kpl_module *m, bool on);
bool kpl_module_training(const kpl_module *m);
/* Freezes m and everything under it: no parameter requires grad any more
 * and batch norm uses its running statistics in training too (torchvision's
 * FrozenBatchNorm2d).  The trainer gives only the parameters that still
 * require grad to its optimizer. */
kpl_status kpl_module_freeze(kpl_module *m);
bool kpl_module_frozen(const kpl_module *m);
/* Whether the parameters under m take gradients, for a while (a GAN's
 * discriminator during the generator's step): unlike freezing, no mode
 * changes, and `on` gives the gradients back (except to frozen modules). */
kpl_status kpl_module_set_requires_grad(kpl_module *m, bool on);

/* ---- forward ---------------------------------------------------------------------------- */
/* Runs m's kind on in, filling out.  A failure deep in a tree names the
 * leaf module's path and kind before the op's message. */
kpl_status kpl_module_forward_list(kpl_module *m, const kpl_tensor_list *in,
                                   kpl_tensor_list *out);
/* One input, one output: the output (pool-owned), NULL on error (the
 * message in kpl_last_error).  NULL in gives NULL out, so calls chain. */
kpl_tensor *kpl_module_forward(kpl_module *m, kpl_tensor *x);

/* Multiply-adds x 2 per sample of the convolutions and linear layers
 * under m in the last forward; with train_flops, their backward products
 * too (2 for a layer whose input needed no gradient, else 3). */
double kpl_module_flops(kpl_module *m, bool train_flops);
/* For kinds that count: the flops per sample of this module's last
 * forward, and whether its input needed a gradient. */
void kpl_module_set_flops(kpl_module *m, double flops, bool input_grad);
/* kpl_module_flops of a probe forward of one sample of shape `chw` (in
 * evaluation mode, so nothing moves; the mode is restored). */
kpl_status kpl_module_count_flops(kpl_module *m, int ndim, const int64_t *sample_shape,
                                  bool train_flops, double *flops);

/* ---- layers ----------------------------------------------------------------------------- */
/*
 * Parameters start as PyTorch's layers start them: convolution and linear
 * weights and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (Kaiming uniform,
 * a = sqrt(5)), or with KPL_NN_INIT_KAIMING_OUT the weight N(0, 2/fan_out)
 * and the bias 0 (torchvision's ResNets and detection heads); norms scale 1,
 * shift 0.  *out (may be NULL) is borrowed from the parent.
 */
typedef enum { KPL_NN_INIT_DEFAULT, KPL_NN_INIT_KAIMING_OUT } kpl_nn_init;

/* Zero means the default for stride, dilation (1) and groups (1), so a
 * designated initializer names only what differs:
 *   kpl_nn_conv c = {KPL_NN_CONV_INIT(64, 128, 3), .stride = {2, 2}, .padding = {1, 1}}; */
typedef struct {
    int64_t in, out;
    int kernel[2], stride[2], padding[2], dilation[2];
    int groups;
    bool no_bias;
    kpl_nn_init init;
    int output_padding[2]; /* conv_transpose2d only */
} kpl_nn_conv;
#define KPL_NN_CONV_INIT(cin, cout, k) .in = (cin), .out = (cout), .kernel = {(k), (k)}

/* Conv2d: weight (out, in/groups, kh, kw), bias (out) unless no_bias.
 * Input (N, in, H, W). */
kpl_status kpl_nn_conv2d(kpl_module *parent, const char *name, const kpl_nn_conv *c,
                         kpl_module **out);
/* ConvTranspose2d: weight (in, out/groups, kh, kw) (PyTorch's layout),
 * bias (out); fan_in is out/groups x kh x kw as PyTorch counts it. */
kpl_status kpl_nn_conv_transpose2d(kpl_module *parent, const char *name, const kpl_nn_conv *c,
                                   kpl_module **out);
/* Linear: weight (out, in), bias (out).  Input (..., in). */
kpl_status kpl_nn_linear(kpl_module *parent, const char *name, int64_t in, int64_t out,
                         bool bias, kpl_module **out_module);
/* Embedding: weight (num, dim) N(0, 1); input ids (any shape, KPL_I64). */
kpl_status kpl_nn_embedding(kpl_module *parent, const char *name, int64_t num, int64_t dim,
                            kpl_module **out);

/* BatchNorm over (N, C, ...): weight, bias (C); buffers running_mean,
 * running_var (C).  PyTorch's defaults are momentum 0.1, eps 1e-5.
 * (torch's num_batches_tracked is not kept: it only matters for
 * momentum None, which kpl does not offer.) */
kpl_status kpl_nn_batch_norm(kpl_module *parent, const char *name, int64_t channels,
                             double momentum, double eps, kpl_module **out);
/* GroupNorm of (N, C, ...): weight, bias (C); C divisible by groups. */
kpl_status kpl_nn_group_norm(kpl_module *parent, const char *name, int groups, int64_t channels,
                             double eps, kpl_module **out);
/* LayerNorm over the last `ndim` dims `shape`: weight, bias of that shape. */
kpl_status kpl_nn_layer_norm(kpl_module *parent, const char *name, int ndim,
                             const int64_t *shape, double eps, kpl_module **out);

typedef enum {
    KPL_NN_RELU,
    KPL_NN_LEAKY_RELU, /* slope */
    KPL_NN_SIGMOID,
    KPL_NN_TANH,
    KPL_NN_GELU,
    KPL_NN_SILU        /* x sigmoid(x) */
} kpl_nn_act;
kpl_status kpl_nn_activation(kpl_module *parent, const char *name, kpl_nn_act act, double slope,
                             kpl_module **out);
kpl_status kpl_nn_relu(kpl_module *parent, const char *name, kpl_module **out);

/* Pooling (graph.h's kpl_pool2d_params); adaptive average to (oh, ow),
 * (1, 1) being global average pooling. */
kpl_status kpl_nn_max_pool2d(kpl_module *parent, const char *name, const kpl_pool2d_params *p,
                             kpl_module **out);
kpl_status kpl_nn_avg_pool2d(kpl_module *parent, const char *name, const kpl_pool2d_params *p,
                             kpl_module **out);
kpl_status kpl_nn_adaptive_avg_pool2d(kpl_module *parent, const char *name, int64_t oh,
                                      int64_t ow, kpl_module **out);
/* (N, ...) -> (N, everything else). */
kpl_status kpl_nn_flatten(kpl_module *parent, const char *name, kpl_module **out);
/* Inverted dropout with probability p in [0, 1), masks from the root's
 * generator; identity in evaluation mode. */
kpl_status kpl_nn_dropout(kpl_module *parent, const char *name, double p, kpl_module **out);
/* Resize by an integer factor: nearest, or bilinear (align_corners false). */
kpl_status kpl_nn_upsample(kpl_module *parent, const char *name, int factor, bool bilinear,
                           kpl_module **out);

/* Sequential: its children in the order added, each one's outputs the
 * next one's inputs. */
kpl_status kpl_nn_sequential(kpl_module *parent, const char *name, kpl_module **out);
kpl_status kpl_nn_sequential_root(kpl_device *dev, uint64_t seed, kpl_module **out);
/* Residual: relu(body(x) + shortcut(x)) when `relu`, else without it; the
 * children are added after creation and called "body" (required) and
 * "shortcut" (optional: identity when absent), each usually a sequential.
 * Tensors the gradient does not need die at the block's end (a pool per
 * block), which lowers the peak of deep networks. */
kpl_status kpl_nn_residual(kpl_module *parent, const char *name, bool relu, kpl_module **out);

/* ---- the model zoo ------------------------------------------------------------------------- */

/* KPL_MODEL_NONE: a recipe's model.name when the task builds its own model. */
typedef enum {
    KPL_MODEL_MLP,
    KPL_MODEL_LENET,
    KPL_MODEL_CNN,
    KPL_MODEL_RESNET,
    KPL_MODEL_NONE
} kpl_model_arch;

/* "mlp", "lenet", "cnn", "resnet", "none" (the table, NULL-terminated); parse: -1 for other
 * names. */
extern const char *const kpl_model_arch_names[];
const char *kpl_model_arch_name(kpl_model_arch a);
int kpl_model_arch_parse(const char *name);

/* A ResNet's stem: ImageNet's 7x7/2 convolution and 3x3/2 max-pool, or a
 * 3x3/1 convolution for 32x32 inputs ("imagenet", "cifar"). */
typedef enum { KPL_STEM_IMAGENET, KPL_STEM_CIFAR } kpl_resnet_stem;
extern const char *const kpl_resnet_stem_names[];

/* A classifier of the zoo.  Zero means "the architecture's default" for
 * width, depth and hidden.
 *   mlp     in -> hidden... -> classes, ReLU between (default hidden 512, 256)
 *   lenet   LeNet-5: conv 5x5 (6, padding 2) pool, conv 5x5 (16) pool,
 *           120, 84, classes (width scales the 6 and 16)
 *   cnn     depth stages (default 2) of conv 3x3 (width << stage, default
 *           32) + batch norm + ReLU + 2x2 max-pool, then hidden (default
 *           128) -> classes
 *   resnet  torchvision's ResNet-18/34/50/101/152 (depth), base width 64,
 *           ImageNet stem (7x7/2 + 3x3/2 max-pool) or CIFAR stem (3x3/1)
 * dropout applies before the last linear layer of mlp and cnn. */
typedef struct {
    kpl_model_arch arch;
    int64_t num_classes;        /* resnet: 0 builds the backbone alone (up to layer4) */
    int64_t in_channels, in_h, in_w;
    int64_t width, depth;
    kpl_resnet_stem stem;
    int64_t hidden[16];
    int nhidden;
    double dropout;
    bool zero_init_residual;
} kpl_model_config;

/* Fills the architecture's defaults into *c and checks it: KPL_EINVAL
 * naming the field when the input is too small for the architecture or a
 * value is out of range. */
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

#ifdef __cplusplus
}
#endif
#endif /* KPL_MODULE_H */
