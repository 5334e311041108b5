/*
 * norms.c — the normalisation layers as module kinds: batch norm (its
 * synchronised form over a communicator's ranks, and the fused ReLU),
 * group, layer and instance norm.
 */
#include "layers_impl.h"
#include "nn_impl.h"

#include "collective.h"

#include <stdlib.h>

/* ---- norms ------------------------------------------------------------------------------- */

typedef struct {
    double momentum, eps;
    int groups, ndim; /* group norm; layer norm */
    kpl_tensor *g, *b, *rmean, *rvar;
    kpl_comm *comm;   /* batch norm: synchronised over its ranks (kpl_nn_sync_batch_norm) */
    bool relu_out;    /* batch norm: this forward ends in a ReLU (kpl_nn_forward_relu) */
} norm_state;

static const kpl_custom_fn allreduce_fn;

/* The backward of an all-reduce (sum) is the all-reduce of the gradient:
 * every rank's input reached every rank's output.  Recorded as the same
 * op (under create_graph), so a penalty on input gradients (R1, WGAN-GP)
 * differentiates through it again. */
static kpl_tensor *allreduce_backward(kpl_tensor *gy, void *user)
{
    kpl_comm *comm = user;
    kpl_tensor *g = kpl_to_device(gy, kpl_tensor_device(gy)); /* a copy: reduced in place */
    if (!g) return NULL;
    kpl_status st = kpl_comm_allreduce(comm, g, g, KPL_COMM_SUM);
    return st < 0 ? NULL : kpl_custom(gy, g, &allreduce_fn, comm);
}
static const kpl_custom_fn allreduce_fn = {"sync_batch_norm.allreduce", allreduce_backward};

/* The sum of x over comm's ranks, recorded so that gradients flow back to
 * every rank's x.  A recomputation (memory.recompute) takes the sum the
 * forward kept instead of reducing again: the other ranks are not
 * recomputing, and the values must be the forward's. */
static kpl_tensor *allreduce_sum(kpl_tensor *x, kpl_comm *comm)
{
    if (!x) return NULL;
    kpl_tensor *y = NULL;
    if (kpl_recompute_replaying()) {
        y = kpl_recompute_replayed();
    } else {
        y = kpl_to_device(x, kpl_tensor_device(x)); /* unrecorded copy */
        if (!y || kpl_comm_allreduce(comm, y, y, KPL_COMM_SUM) < 0 || kpl_recompute_keep(y) < 0)
            return NULL;
    }
    return y ? kpl_custom(x, y, &allreduce_fn, comm) : NULL;
}

/* Batch norm in training with the statistics of every rank's batch
 * (torch.nn.SyncBatchNorm): one all-reduce of each channel's sum, sum of
 * squares and the value count in the forward; the ops after it (mean,
 * variance, normalisation) are recorded, so their gradient ends in one
 * all-reduce of the two per-channel gradient sums.  The variance is
 * E[x^2] - E[x]^2 in f32, accurate while |mean| is not far above the
 * standard deviation (activations after a convolution). */
static kpl_tensor *sync_batch_norm(const norm_state *n, kpl_tensor *x)
{
    int nd = kpl_tensor_ndim(x);
    if (nd < 2) {
        KPL_ERROR(KPL_ESHAPE, "sync_batch_norm: input must be (N, C, ...), got %d dims", nd);
        return NULL;
    }
    int axes[KPL_MAX_DIMS], na = 0;
    for (int d = 0; d < nd; d++)
        if (d != 1) axes[na++] = d;
    int64_t C = kpl_tensor_dim(x, 1), one = 1;
    double local = (double)(C ? kpl_tensor_numel(x) / C : 0);
    kpl_tensor *parts[3] = {kpl_sum(x, axes, na, false), kpl_sum(kpl_square(x), axes, na, false),
                            kpl_full(kpl_tensor_device(x), kpl_tensor_dtype(x), 1, &one, local)};
    kpl_tensor *g = allreduce_sum(kpl_concat(3, parts, 0), n->comm);
    kpl_tensor *gc = kpl_slice(g, 0, 2 * C, 1);
    const float *pc = gc ? kpl_tensor_host_data(gc) : NULL;
    if (!pc) return NULL;
    double count = pc[0];
    if (count <= 1) {
        KPL_ERROR(KPL_ESHAPE, "sync_batch_norm: expected more than 1 value per channel over the "
                  "ranks when training, got %g", count);
        return NULL;
    }
    kpl_tensor *mean = kpl_scalar_op(KPL_BIN_DIV, kpl_slice(g, 0, 0, C), count, false);
    kpl_tensor *ex2 = kpl_scalar_op(KPL_BIN_DIV, kpl_slice(g, 0, C, C), count, false);
    kpl_tensor *var = kpl_scalar_op(KPL_BIN_MAXIMUM, kpl_sub(ex2, kpl_square(mean)), 0, false);
    kpl_tensor *inv = kpl_rsqrt(kpl_scalar_op(KPL_BIN_ADD, var, n->eps, false));
    int64_t shape[KPL_MAX_DIMS];
    for (int d = 0; d < nd; d++) shape[d] = d == 1 ? C : 1;
    kpl_tensor *scale = kpl_reshape(n->g ? kpl_mul(inv, n->g) : inv, nd, shape);
    kpl_tensor *y = kpl_mul(kpl_sub(x, kpl_reshape(mean, nd, shape)), scale);
    if (n->b) y = kpl_add(y, kpl_reshape(n->b, nd, shape));
    if (!y) return NULL;
    if (kpl_recompute_replaying()) return y; /* the forward moved the running statistics */
    /* running = (1 - m) running + m batch (unbiased variance), unrecorded */
    bool prev = kpl_set_grad_enabled(false);
    /* copies: detach views the batch statistics, which the gradient still reads */
    kpl_tensor *bm = kpl_to_device(kpl_detach(mean), kpl_tensor_device(mean));
    kpl_tensor *bv = kpl_to_device(kpl_detach(var), kpl_tensor_device(var));
    kpl_status st = bm && bv ? KPL_OK : kpl_last_status();
    if (st >= 0) st = kpl_k_binary_scalar(n->rmean, KPL_BIN_MUL, n->rmean, 1 - n->momentum, false);
    if (st >= 0) st = kpl_k_binary_scalar(bm, KPL_BIN_MUL, bm, n->momentum, false);
    if (st >= 0) st = kpl_k_binary(n->rmean, KPL_BIN_ADD, n->rmean, bm);
    if (st >= 0) st = kpl_k_binary_scalar(n->rvar, KPL_BIN_MUL, n->rvar, 1 - n->momentum, false);
    if (st >= 0)
        st = kpl_k_binary_scalar(bv, KPL_BIN_MUL, bv, n->momentum * count / (count - 1), false);
    if (st >= 0) st = kpl_k_binary(n->rvar, KPL_BIN_ADD, n->rvar, bv);
    kpl_set_grad_enabled(prev);
    return st < 0 ? NULL : y;
}

static kpl_status batch_norm_forward(kpl_module *m, const kpl_tensor_list *in,
                                     kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const norm_state *n = kpl_module_state(m);
    bool training = kpl_module_training(m);
    if (n->comm && training) {
        kpl_tensor *y = sync_batch_norm(n, in->t[0]);
        ONE_OUT(out, n->relu_out ? kpl_relu(y) : y);
    }
    ONE_OUT(out, (n->relu_out ? kpl_batch_norm_relu : kpl_batch_norm)(
                     in->t[0], n->g, n->b, n->rmean, n->rvar, training, n->momentum, n->eps));
}

static const kpl_module_kind batch_norm_kind;

bool *kpl__batch_norm_relu_flag(kpl_module *m)
{
    return kpl_module_kind_of(m) == &batch_norm_kind ? &((norm_state *)kpl_module_state(m))->relu_out
                                                     : NULL;
}

static void sync_walk(kpl_module *m, kpl_comm *comm, int *count)
{
    if (kpl_module_kind_of(m) == &batch_norm_kind) {
        norm_state *n = kpl_module_state(m);
        n->comm = comm;
        (*count)++;
    }
    for (int i = 0; i < kpl_module_num_children(m); i++)
        sync_walk(kpl_module_child(m, i), comm, count);
}

kpl_status kpl_nn_sync_batch_norm(kpl_module *m, kpl_comm *comm, int *count)
{
    KPL_CHECK(m, KPL_EINVAL, "sync_batch_norm: no module");
    int n = 0;
    sync_walk(m, comm, &n);
    if (count) *count = n;
    return KPL_OK;
}

static kpl_status group_norm_forward(kpl_module *m, const kpl_tensor_list *in,
                                     kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const norm_state *n = kpl_module_state(m);
    ONE_OUT(out, kpl_group_norm(in->t[0], n->groups, n->g, n->b, n->eps));
}

static kpl_status layer_norm_forward(kpl_module *m, const kpl_tensor_list *in,
                                     kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const norm_state *n = kpl_module_state(m);
    ONE_OUT(out, kpl_layer_norm(in->t[0], n->ndim, n->g, n->b, n->eps));
}

/* Group norm with a group per channel, which is instance norm: each
 * (sample, channel) plane normalised over its H x W values. */
static kpl_status instance_norm_forward(kpl_module *m, const kpl_tensor_list *in,
                                        kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const norm_state *n = kpl_module_state(m);
    kpl_tensor *x = in->t[0];
    int nd = kpl_tensor_ndim(x);
    KPL_CHECK(nd >= 3 && kpl_tensor_dim(x, 1) == n->groups, KPL_ESHAPE,
              "instance_norm: expected (N, %d, ...) input, got %d dims with %lld channels",
              n->groups, nd, nd >= 2 ? (long long)kpl_tensor_dim(x, 1) : 0LL);
    int64_t spatial = kpl_tensor_numel(x) / (kpl_tensor_dim(x, 0) * n->groups);
    KPL_CHECK(kpl_tensor_dim(x, 0) == 0 || spatial > 1, KPL_ESHAPE,
              "instance_norm: expected more than 1 spatial element, got %lld (as PyTorch)",
              (long long)spatial);
    ONE_OUT(out, kpl_group_norm(x, n->groups, n->g, n->b, n->eps));
}

static const kpl_module_kind batch_norm_kind = {"batch_norm", batch_norm_forward, free,
                                                KPL_MODULE_REPLAYABLE};
static const kpl_module_kind group_norm_kind = {"group_norm", group_norm_forward, free,
                                                KPL_MODULE_REPLAYABLE};
static const kpl_module_kind layer_norm_kind = {"layer_norm", layer_norm_forward, free,
                                                KPL_MODULE_REPLAYABLE};
static const kpl_module_kind instance_norm_kind = {"instance_norm", instance_norm_forward, free,
                                                   KPL_MODULE_REPLAYABLE};

/* scale 1 and shift 0 of `shape` */
static kpl_status affine(kpl_module *m, int ndim, const int64_t *shape, norm_state *n)
{
    KPL_TRY(kpl__layer_new_param(m, "weight", ndim, shape, &n->g));
    KPL_TRY(kpl_k_fill(n->g, 1));
    KPL_TRY(kpl__layer_new_param(m, "bias", ndim, shape, &n->b));
    return kpl_k_fill(n->b, 0);
}

kpl_status kpl_nn_batch_norm(kpl_module *parent, const char *name, int64_t channels,
                             double momentum, double eps, kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(channels > 0 && momentum >= 0 && momentum <= 1 && eps > 0, KPL_EINVAL,
              "batch_norm %s: channels %lld > 0, momentum %g in [0, 1], eps %g > 0",
              name ? name : "", (long long)channels, momentum, eps);
    norm_state s = {.momentum = momentum, .eps = eps};
    kpl_module *m = NULL;
    KPL_TRY(kpl__layer_create_with(parent, name, &batch_norm_kind, &s, sizeof s, &m));
    norm_state *n = kpl_module_state(m);
    KPL_TRY(affine(m, 1, &channels, n));
    KPL_TRY(kpl__layer_new_buffer(m, "running_mean", channels, 0));
    KPL_TRY(kpl__layer_new_buffer(m, "running_var", channels, 1));
    n->rmean = kpl_module_get_buffer(m, "running_mean");
    n->rvar = kpl_module_get_buffer(m, "running_var");
    if (out) *out = m;
    return KPL_OK;
}

kpl_status kpl_nn_group_norm(kpl_module *parent, const char *name, int groups, int64_t channels,
                             double eps, kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(groups > 0 && channels > 0 && channels % groups == 0 && eps > 0, KPL_EINVAL,
              "group_norm %s: %lld channels in %d groups (a positive multiple), eps %g > 0",
              name ? name : "", (long long)channels, groups, eps);
    norm_state s = {.eps = eps, .groups = groups};
    kpl_module *m = NULL;
    KPL_TRY(kpl__layer_create_with(parent, name, &group_norm_kind, &s, sizeof s, &m));
    KPL_TRY(affine(m, 1, &channels, kpl_module_state(m)));
    if (out) *out = m;
    return KPL_OK;
}

kpl_status kpl_nn_layer_norm(kpl_module *parent, const char *name, int ndim,
                             const int64_t *shape, double eps, kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(ndim >= 1 && ndim < KPL_MAX_DIMS && shape && eps > 0, KPL_EINVAL,
              "layer_norm %s: 1 to %d normalised dims, eps %g > 0", name ? name : "",
              KPL_MAX_DIMS - 1, eps);
    for (int i = 0; i < ndim; i++)
        KPL_CHECK(shape[i] > 0, KPL_EINVAL, "layer_norm %s: dim %d is %lld", name ? name : "", i,
                  (long long)shape[i]);
    norm_state s = {.eps = eps, .ndim = ndim};
    kpl_module *m = NULL;
    KPL_TRY(kpl__layer_create_with(parent, name, &layer_norm_kind, &s, sizeof s, &m));
    KPL_TRY(affine(m, ndim, shape, kpl_module_state(m)));
    if (out) *out = m;
    return KPL_OK;
}

kpl_status kpl_nn_instance_norm(kpl_module *parent, const char *name, int64_t channels,
                                bool affine_params, double eps, kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(channels > 0 && channels <= INT32_MAX && eps > 0, KPL_EINVAL,
              "instance_norm %s: channels %lld > 0, eps %g > 0", name ? name : "",
              (long long)channels, eps);
    norm_state s = {.eps = eps, .groups = (int)channels};
    kpl_module *m = NULL;
    KPL_TRY(kpl__layer_create_with(parent, name, &instance_norm_kind, &s, sizeof s, &m));
    if (affine_params) KPL_TRY(affine(m, 1, &channels, kpl_module_state(m)));
    if (out) *out = m;
    return KPL_OK;
}
