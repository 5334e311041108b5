/*
 * nn_impl.h — the nn room's internals (trainer/nn/: modules, layers, the
 * zoo) that rooms above and the tests reach (not installed; not part of
 * the API).
 */
#ifndef KPL_NN_IMPL_H
#define KPL_NN_IMPL_H

#include "io_impl.h"

/* ---- modules (nn/module.c, nn/layers.c) ---- */

/* Parameter `from` of m (its own) becomes `to`, moved after m's other
 * parameters: torch's delattr + register_parameter, as
 * torch.nn.utils.spectral_norm turns "weight" into "weight_orig".  The
 * tensor stays the same.  KPL_ENOTFOUND when m has no such parameter,
 * KPL_EINVAL for a name taken or malformed.  Arrays from
 * kpl_module_params are stale afterwards. */
kpl_status kpl__module_rename_param(kpl_module *m, const char *from, const char *to);
/* m's children from..to-1 run as a sequential runs them (layers.c): a
 * batch norm or convolution and a ReLU after it fused, each intermediate
 * freed once the next child has run (unless the graph keeps it); the
 * outputs are put in the caller's pool. */
kpl_status kpl__forward_children(kpl_module *m, int from, int to, const kpl_tensor_list *in,
                                 kpl_tensor_list *out);
/* A run of children kpl_module_mark_recompute_span marked (module.c):
 * from..to-1 of m, recomputed when `on`. */
typedef struct {
    kpl_module *m;
    int from, to;
    bool on;
} kpl__recompute_span;
/* The span of m that starts at child `from` and is on, or NULL. */
const kpl__recompute_span *kpl__module_span(const kpl_module *m, int from);
/* Sets this thread's module nesting depth (module.c: the outermost
 * forward's outputs leave autocast in f32); returns the previous one. */
int kpl__module_depth_set(int depth);
/* The spectrally normalised weight w / sigma of kpl_nn_spectral_norm
 * (layers.h), as a function: w's dim `dim` (0, or 1 for a transposed
 * convolution's) against everything else is the matrix W (h, n);
 * u (h) and v (n) are the power iteration's vectors (w's dtype and
 * device).  With `update`, `iters` power iterations run first, unrecorded
 * (v = normalize(W^T u), u = normalize(W v), normalize(x) = x /
 * max(|x|, eps)), and their results are written into u and v.  sigma =
 * u^T W v is recorded (copies of u and v, which later updates do not
 * touch), so gradients of any order flow through w and sigma.  Returns a
 * pool-owned tensor of w's shape, or NULL with the error set. */
kpl_tensor *kpl__spectral_weight(kpl_tensor *w, kpl_tensor *u, kpl_tensor *v, int dim,
                                 int iters, double eps, bool update);

/* The zoo's FCOS (nn/fcos.c), DeepLabv3 and U-Net (nn/segnets.c). */
extern const kpl_zoo_model kpl__zoo_fcos;
extern const kpl_zoo_model kpl__zoo_deeplabv3;
extern const kpl_zoo_model kpl__zoo_unet;
/* The zoo's GAN pairs (nn/gannets.c): generator and discriminator. */
extern const kpl_zoo_model kpl__zoo_dcgan;
extern const kpl_zoo_model kpl__zoo_dcgan_d;
extern const kpl_zoo_model kpl__zoo_sngan;
extern const kpl_zoo_model kpl__zoo_sngan_d;
/* A ResNet backbone (cfg's depth, width, stem, norm; up to layer4) as
 * parent's sequential child `name`, its last stages dilated to give
 * features at output_stride 8, 16 or 32 of the input (torchvision's
 * replace_stride_with_dilation).  *out (may be NULL) borrowed. */
/* A normalisation layer of ch channels as the zoo's ResNets make it:
 * batch norm, or group norm of 32 groups (fewer when ch is not a
 * multiple). */
kpl_status kpl__zoo_add_norm(kpl_module *parent, const char *name, int64_t ch,
                            kpl_norm_kind norm, kpl_module **out);
kpl_status kpl__zoo_resnet_backbone(kpl_module *parent, const char *name,
                                    const kpl_model_config *cfg, int output_stride,
                                    kpl_module **out);

#endif /* KPL_NN_IMPL_H */
