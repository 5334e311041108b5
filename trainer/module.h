/*
 * module.h — kpl's nn room: modules in the spirit of torch.nn.  A module
 * owns named parameters, named buffers (state that is not trained, such as
 * batch norm's running statistics) and named child modules, has a training
 * or evaluation mode, and a forward function given by its kind (a small
 * vtable).  A tree of modules is a model; the dotted paths of its tensors
 * ("layer1.0.bn1.running_mean") form its state dict.
 *
 * Layers (layers.h) and the model zoo (zoo.h) build on it.
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
 * and children are the module's own business.  flags: KPL_MODULE_REPLAYABLE
 * when the forward, run again on the same inputs, computes the same values
 * and changes nothing but through kpl's ops (batch norm's running
 * statistics and random draws are replayed by the graph; graph.h,
 * "recomputation"): what recomputation (kpl_module_set_recompute) needs.
 * A forward that writes host memory, counts calls or talks to other
 * ranks by itself must not declare it. */
#define KPL_MODULE_REPLAYABLE 1u
typedef struct {
    const char *name;
    kpl_status (*forward)(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out);
    void (*state_free)(void *state);
    unsigned flags;
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
/* m run once on a zero f32 input of `shape` (on its device; eval mode, no
 * gradient, nothing kept, its mode restored): the shape of its first
 * output (out_shape holds KPL_MAX_DIMS), or the error of the forward.  How
 * a task checks at start-up that a model takes what it will be given. */
kpl_status kpl_module_probe(kpl_module *m, int ndim, const int64_t *shape, int *out_ndim,
                            int64_t *out_shape);
/* Runs m's kind on in, filling out.  A failure deep in a tree names the
 * leaf module's path and kind before the op's message. */
kpl_status kpl_module_forward_list(kpl_module *m, const kpl_tensor_list *in,
                                   kpl_tensor_list *out);
/* One input, one output: the output (pool-owned), NULL on error (the
 * message in kpl_last_error).  NULL in gives NULL out, so calls chain. */
kpl_tensor *kpl_module_forward(kpl_module *m, kpl_tensor *x);

/* ---- recomputation (memory.recompute) -------------------------------------------------- */
/* A recomputed module keeps none of the tensors its ops save for the
 * gradient (but its inputs and outputs): its backward runs its forward
 * again first (graph.h, "recomputation"; torch.utils.checkpoint).  The
 * same losses and gradients bit for bit, for about one more forward of it.
 * Refused (KPL_EINVAL, naming the module and the kind) when the kind of m
 * or of a module under it does not declare KPL_MODULE_REPLAYABLE.  A
 * recomputed module inside another is recomputed as part of the outer. */
kpl_status kpl_module_set_recompute(kpl_module *m, bool on);
bool kpl_module_recompute(const kpl_module *m);
/* The zoo's marks: the modules `memory.recompute: blocks` recomputes
 * (ResNet's residual blocks, U-Net's levels, ASPP, the FPN, a GAN's
 * blocks). */
void kpl_module_mark_recompute_unit(kpl_module *m);
bool kpl_module_recompute_unit(const kpl_module *m);
/* Children from..to-1 of m, which a sequential runs in order
 * (kpl__forward_children: a ResNet's stem), marked as one unit; at most 4
 * spans a module. */
kpl_status kpl_module_mark_recompute_span(kpl_module *m, int from, int to);
/* kpl_module_set_recompute(on) on every marked unit under m (m included),
 * and the marked spans on or off; *count (may be NULL) receives how many
 * units and spans there are. */
kpl_status kpl_module_recompute_units(kpl_module *m, bool on, int *count);

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

#ifdef __cplusplus
}
#endif
#endif /* KPL_MODULE_H */
