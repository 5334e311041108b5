/*
 * layers.h — the usual layers as module kinds (module.h): convolutions,
 * linear, embedding, batch/group/layer norm, activations, pooling,
 * flatten, dropout, upsampling; sequential and residual containers.
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

#ifdef __cplusplus
}
#endif
#endif /* KPL_LAYERS_H */
