/*
 * layers.h — the usual layers as module kinds (module.h): convolutions,
 * linear, embedding, batch/group/layer/instance norm, activations,
 * pooling, flatten, dropout, upsampling, pixel shuffle; spectral
 * normalisation of a layer's weight; sequential and residual containers;
 * the feature pyramid of detectors.
 */
#ifndef KPL_LAYERS_H
#define KPL_LAYERS_H

#include "module.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Parameters start as PyTorch's layers start them: convolution and linear
 * weights and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (Kaiming uniform,
 * a = sqrt(5)), or with KPL_NN_INIT_KAIMING_OUT the weight N(0, 2/fan_out)
 * and the bias 0 (torchvision's ResNets and detection heads), or with
 * KPL_NN_INIT_KAIMING_UNIFORM_A1 the weight U(-sqrt(3/fan_in),
 * sqrt(3/fan_in)) (kaiming_uniform_(a=1)) and the bias 0 (torchvision's
 * FPN); norms scale 1, shift 0.  *out (may be NULL) is borrowed from the
 * parent.
 */
typedef enum {
    KPL_NN_INIT_DEFAULT,
    KPL_NN_INIT_KAIMING_OUT,
    KPL_NN_INIT_KAIMING_UNIFORM_A1
} kpl_nn_init;

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
/* Spectral normalisation (Miyato et al. 2018) of an existing conv2d,
 * conv_transpose2d or linear module's weight, as
 * torch.nn.utils.spectral_norm(layer, n_power_iterations, eps) leaves it:
 *  - the parameter "weight" becomes "weight_orig" (the same tensor, moved
 *    after "bias" as PyTorch's re-registration orders them), and buffers
 *    "weight_u" (h) and "weight_v" (n) join it, h x n being the weight as
 *    a matrix of its dim 0 (a transposed convolution's dim 1, out/groups)
 *    against the rest; u and v start N(0, 1) from the model's generator,
 *    normalised.  State dicts and checkpoints carry them, under PyTorch's
 *    names.
 *  - every forward in training mode first runs power_iterations steps of
 *    v = normalize(W^T u), u = normalize(W v) (normalize(x) = x /
 *    max(|x|, eps); unrecorded, no gradient through u and v) and stores u
 *    and v; in evaluation mode (and when frozen) the stored ones are used
 *    unchanged.  The layer then runs with W / sigma, sigma = u^T W v,
 *    recorded: gradients flow through sigma as PyTorch's do, and to any
 *    order (WGAN-GP and R1 penalties through a normalised critic).
 * PyTorch's defaults: power_iterations 1, eps 1e-12.  Apply it before an
 * optimizer takes the parameters (kpl_module_params' array changes).
 * Errors: KPL_EINVAL for another kind of module, a layer normalised
 * already, power_iterations outside [1, 1000] or eps <= 0. */
kpl_status kpl_nn_spectral_norm(kpl_module *layer, int power_iterations, double eps);
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
/* Synchronised batch norm, as torch.nn.SyncBatchNorm.convert_sync_batchnorm
 * leaves a model: every batch norm under m (m itself included) normalises
 * in training with the mean and variance of the whole global batch, every
 * rank's of comm (an all-reduce of each channel's sum, sum of squares and
 * count in the forward, one of the two gradient sums in the backward), so
 * N ranks of B samples train as one of N x B.  Evaluation, frozen norms
 * and the running statistics' update are as before (they stay equal on
 * every rank).  comm NULL undoes it.  comm is borrowed and must outlive
 * every forward and backward; every rank must run the same layers in the
 * same order (their all-reduces pair up).  *count (may be NULL) receives
 * the number of batch norms changed. */
typedef struct kpl_comm kpl_comm;
kpl_status kpl_nn_sync_batch_norm(kpl_module *m, kpl_comm *comm, int *count);
kpl_status kpl_nn_group_norm(kpl_module *parent, const char *name, int groups, int64_t channels,
                             double eps, kpl_module **out);
/* LayerNorm over the last `ndim` dims `shape`: weight, bias of that shape. */
kpl_status kpl_nn_layer_norm(kpl_module *parent, const char *name, int ndim,
                             const int64_t *shape, double eps, kpl_module **out);

/* InstanceNorm2d (PyTorch's defaults: no running statistics): every
 * (sample, channel) plane of x (N, channels, ...) normalised over its own
 * values (biased variance), which is group norm with a group per channel;
 * with `affine`, weight and bias (channels), 1 and 0 at first.  PyTorch's
 * eps is 1e-5.  Errors at forward: another channel count, or one value per
 * plane (KPL_ESHAPE, as PyTorch). */
kpl_status kpl_nn_instance_norm(kpl_module *parent, const char *name, int64_t channels,
                                bool affine, double eps, kpl_module **out);

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
/* kpl_relu(kpl_module_forward(m, x)); a batch norm m in training or a
 * conv2d m runs it as one fused op where the device has the kernel
 * (kpl_batch_norm_relu, kpl_conv2d_relu), as a sequential does by itself
 * for either followed by a ReLU. */
kpl_tensor *kpl_nn_forward_relu(kpl_module *m, kpl_tensor *x);

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

/* Pixel shuffle (Shi et al. 2016), F.pixel_shuffle: (N, C r^2, H, W) ->
 * (N, C, H r, W r) with PyTorch's channel order, in[n, c r^2 + i r + j,
 * h, w] = out[n, c, h r + i, w r + j]; a reshape, a permute and a
 * reshape, so differentiable to any order.  factor r in [1, 64]. */
kpl_status kpl_nn_pixel_shuffle(kpl_module *parent, const char *name, int factor,
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

/* Feature pyramid network (Lin et al. 2017), as torchvision's
 * FeaturePyramidNetwork with LastLevelP6P7 (FCOS, RetinaNet).  Its forward
 * takes n_in maps, finest first (C3, C4, C5: each (N, in_channels[i], H_i,
 * W_i)), and returns n_in + extra_levels maps of out_channels, finest
 * first (P3 .. P7):
 *   - lateral 1x1 convolutions inner_blocks.i bring every C_i to
 *     out_channels;
 *   - top-down, from the coarsest: the running map is upsampled (nearest)
 *     to the next finer lateral's size and added to it;
 *   - 3x3 convolutions layer_blocks.i (padding 1) smooth each sum into P_i;
 *   - extra_blocks.p6, p7, ...: 3x3 stride-2 convolutions (padding 1), the
 *     first on the last P (FCOS) or, with extra_from_input, on the last C
 *     (RetinaNet), each next one on the ReLU of the one before.
 * The names are torchvision's (its pre-0.13 layout, with no "0." for a
 * wrapping Conv2dNormActivation), and so is the initialisation: weights
 * kaiming_uniform_(a=1), biases 0.  n_in + extra_levels <= KPL_MODULE_MAX_IO;
 * group-norm heads on top are kpl_nn_conv2d + kpl_nn_group_norm +
 * kpl_nn_relu in a sequential.  Errors: KPL_EINVAL for bad sizes here;
 * at forward, a wrong count of maps or of channels names the map. */
kpl_status kpl_nn_fpn(kpl_module *parent, const char *name, const int64_t *in_channels, int n_in,
                      int64_t out_channels, int extra_levels, bool extra_from_input,
                      kpl_module **out);

/* ---- detection heads ---- */

/* FCOS's head (trainer/nn/fcos.c), shared by `levels` pyramid maps of
 * `channels` channels; stride[l] is level l's.  Its forward takes the
 * levels' maps and gives every level's class logits, then every level's
 * box distances l, t, r, b in input pixels (ReLU of the prediction times a
 * learnt per-level scale, times the stride), then every level's
 * centerness logit.  torchvision/mmdetection names: cls_tower, bbox_tower
 * (conv, GroupNorm, ReLU triples), cls_logits, bbox_pred, centerness,
 * scales. */
#define KPL_FCOS_MAX_LEVELS 5
typedef struct {
    int64_t channels, classes;
    int levels, stride[KPL_FCOS_MAX_LEVELS];
    int convs;         /* conv + GN + ReLU per tower (FCOS: 4) */
    int gn_groups;     /* 32 */
    double prior_prob; /* the class logits' initial probability (0.01) */
} kpl_fcos_head_config;
kpl_status kpl_nn_fcos_head(kpl_module *parent, const char *name, const kpl_fcos_head_config *c,
                            kpl_module **out);
/* The levels' strides of the zoo's model "fcos" (model.name fcos: a
 * ResNet, kpl_nn_fpn and this head) into strides; its level count, or 0
 * for a module that is not one. */
int kpl_fcos_strides(const kpl_module *fcos, int *strides);

#ifdef __cplusplus
}
#endif
#endif /* KPL_LAYERS_H */
