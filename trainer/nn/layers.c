/*
 * layers.c — the usual layers as module kinds: convolutions, linear,
 * embedding, norms, activations, pooling, flatten, dropout, upsample,
 * pixel shuffle, and the containers (sequential, residual); spectral
 * normalisation of a convolution's or linear layer's weight.  Each forward
 * is the graph/ nn function it names; the module adds its tensors, its
 * mode and its name.
 */
#include "layers.h"
#include "layers_impl.h"
#include "nn_impl.h"

#include "collective.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

kpl_status kpl__layer_one_input(const kpl_module *m, const kpl_tensor_list *in)
{
    KPL_CHECK(in->n == 1, KPL_EINVAL, "%s takes one input, got %d",
              kpl_module_kind_of(m)->name, in->n);
    return KPL_OK;
}

/* A new module whose state is a malloc'd copy of `size` bytes at `init`. */
kpl_status kpl__layer_create_with(kpl_module *parent, const char *name, const kpl_module_kind *kind,
                              const void *init, size_t size, kpl_module **out)
{
    void *s = NULL;
    if (size) {
        s = malloc(size);
        KPL_CHECK(s, KPL_ENOMEM, "module %s: out of memory", name ? name : "");
        memcpy(s, init, size);
    }
    return kpl_module_create(parent, name, kind, s, out);
}

kpl_status kpl__layer_new_param(kpl_module *m, const char *name, int ndim, const int64_t *shape,
                            kpl_tensor **out)
{
    kpl_tensor *t = NULL;
    KPL_TRY(kpl_tensor_empty(kpl_module_device(m), KPL_F32, ndim, shape, &t));
    KPL_TRY(kpl_module_add_param(m, name, t));
    *out = t;
    return KPL_OK;
}

kpl_status kpl__layer_new_buffer(kpl_module *m, const char *name, int64_t n, double v)
{
    kpl_tensor *t = NULL;
    KPL_TRY(kpl_tensor_empty(kpl_module_device(m), KPL_F32, 1, &n, &t));
    KPL_TRY(kpl_module_add_buffer(m, name, t));
    return kpl_k_fill(t, v);
}

/* weight, and bias unless !bias, initialised as PyTorch does. */
static kpl_status weight_and_bias(kpl_module *m, int ndim, const int64_t *wshape, int64_t nbias,
                                  int64_t fan_in, int64_t fan_out, bool bias, kpl_nn_init init,
                                  kpl_tensor **w, kpl_tensor **b)
{
    kpl_rng *rng = kpl_module_rng(m);
    KPL_TRY(kpl__layer_new_param(m, "weight", ndim, wshape, w));
    *b = NULL;
    if (bias) KPL_TRY(kpl__layer_new_param(m, "bias", 1, &nbias, b));
    if (init == KPL_NN_INIT_KAIMING_OUT) {
        /* Kaiming normal, fan-out, ReLU gain (torchvision's ResNet init). */
        KPL_TRY(kpl_k_normal(*w, rng, 0, sqrt(2.0 / (double)fan_out)));
        return *b ? kpl_k_fill(*b, 0) : KPL_OK;
    }
    if (init == KPL_NN_INIT_KAIMING_UNIFORM_A1) {
        /* gain sqrt(2 / (1 + a^2)) = 1: U(-sqrt(3 / fan_in), +) (torchvision's FPN). */
        double bound = sqrt(3.0 / (double)fan_in);
        KPL_TRY(kpl_k_uniform(*w, rng, -bound, bound));
        return *b ? kpl_k_fill(*b, 0) : KPL_OK;
    }
    double bound = 1.0 / sqrt((double)fan_in);
    KPL_TRY(kpl_k_uniform(*w, rng, -bound, bound));
    return *b ? kpl_k_uniform(*b, rng, -bound, bound) : KPL_OK;
}

/* Spectral normalisation of a layer's weight (kpl_nn_spectral_norm);
 * iters 0: none. */
typedef struct {
    int iters, dim;
    double eps;
    kpl_tensor *u, *v; /* the buffers weight_u, weight_v (borrowed from the module) */
} spectral;

/* The weight a forward uses: w itself, or w / sigma (moving u and v in
 * training). */
static kpl_tensor *layer_weight(const kpl_module *m, kpl_tensor *w, const spectral *sn)
{
    if (!sn->iters) return w;
    return kpl__spectral_weight(w, sn->u, sn->v, sn->dim, sn->iters, sn->eps,
                                kpl_module_training(m));
}

/* ---- convolutions ------------------------------------------------------------------------ */

typedef struct {
    kpl_conv2d_params p;
    int output_padding[2];
    bool transposed;
    bool relu_out;     /* this forward ends in a ReLU (kpl_nn_forward_relu) */
    kpl_tensor *w, *b; /* borrowed from the module */
    spectral sn;
} conv_state;

static kpl_status conv_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const conv_state *c = kpl_module_state(m);
    kpl_tensor *x = in->t[0], *w = layer_weight(m, c->w, &c->sn);
    kpl_tensor *y = c->transposed ? kpl_conv_transpose2d(x, w, c->b, &c->p, c->output_padding)
                    : c->relu_out ? kpl_conv2d_relu(x, w, c->b, &c->p)
                                  : kpl_conv2d(x, w, c->b, &c->p);
    if (y) {
        /* conv: each output element takes in/groups x kh x kw products;
         * transposed: each input element gives out/groups x kh x kw */
        const int64_t *ws = kpl_tensor_shape(c->w);
        const int64_t *ps = kpl_tensor_shape(c->transposed ? x : y);
        double per = (double)(ws[1] * ws[2] * ws[3]);
        kpl_module_set_flops(m, 2.0 * per * (double)(ps[1] * ps[2] * ps[3]),
                             kpl_requires_grad(x));
    }
    ONE_OUT(out, y);
}

static const kpl_module_kind conv2d_kind = {"conv2d", conv_forward, free, KPL_MODULE_REPLAYABLE};
static const kpl_module_kind conv_transpose2d_kind = {"conv_transpose2d", conv_forward, free,
                                                      KPL_MODULE_REPLAYABLE};

static kpl_status make_conv(kpl_module *parent, const char *name, const kpl_nn_conv *c,
                            bool transposed, kpl_module **out)
{
    if (out) *out = NULL;
    const char *what = transposed ? "conv_transpose2d" : "conv2d";
    KPL_CHECK(c, KPL_EINVAL, "%s %s: no parameters", what, name ? name : "");
    int groups = c->groups ? c->groups : 1;
    KPL_CHECK(c->in > 0 && c->out > 0 && groups > 0 && c->in % groups == 0 &&
                  c->out % groups == 0,
              KPL_EINVAL, "%s %s: in %lld and out %lld channels must be positive multiples of "
                          "groups %d", what, name ? name : "", (long long)c->in,
              (long long)c->out, groups);
    conv_state s;
    memset(&s, 0, sizeof s);
    s.transposed = transposed;
    s.p.groups = groups;
    for (int i = 0; i < 2; i++) {
        s.p.stride[i] = c->stride[i] ? c->stride[i] : 1;
        s.p.padding[i] = c->padding[i];
        s.p.dilation[i] = c->dilation[i] ? c->dilation[i] : 1;
        s.output_padding[i] = c->output_padding[i];
        KPL_CHECK(c->kernel[i] > 0 && s.p.stride[i] > 0 && c->padding[i] >= 0 &&
                      s.p.dilation[i] > 0 && c->output_padding[i] >= 0,
                  KPL_EINVAL, "%s %s: kernel and stride > 0, padding >= 0, dilation > 0", what,
                  name ? name : "");
        KPL_CHECK(transposed || c->output_padding[i] == 0, KPL_EINVAL,
                  "conv2d %s: output_padding is for conv_transpose2d", name ? name : "");
    }
    kpl_module *m = NULL;
    KPL_TRY(kpl__layer_create_with(parent, name, transposed ? &conv_transpose2d_kind : &conv2d_kind, &s,
                        sizeof s, &m));
    conv_state *st = kpl_module_state(m);
    int64_t kk = (int64_t)c->kernel[0] * c->kernel[1];
    int64_t ws[4] = {c->out, c->in / groups, c->kernel[0], c->kernel[1]};
    if (transposed) ws[0] = c->in, ws[1] = c->out / groups;
    /* PyTorch's fan-in is weight.size(1) x kh x kw for both kinds. */
    int64_t fan_in = ws[1] * kk, fan_out = ws[0] * kk;
    if (transposed) fan_out = c->out / groups * kk;
    KPL_TRY(weight_and_bias(m, 4, ws, c->out, fan_in, fan_out, !c->no_bias, c->init, &st->w,
                            &st->b));
    if (out) *out = m;
    return KPL_OK;
}

kpl_status kpl_nn_conv2d(kpl_module *parent, const char *name, const kpl_nn_conv *c,
                         kpl_module **out)
{
    return make_conv(parent, name, c, false, out);
}

kpl_status kpl_nn_conv_transpose2d(kpl_module *parent, const char *name, const kpl_nn_conv *c,
                                   kpl_module **out)
{
    return make_conv(parent, name, c, true, out);
}

/* ---- linear and embedding ------------------------------------------------------------------ */

typedef struct {
    kpl_tensor *w, *b;
    spectral sn;
} linear_state;

static kpl_status linear_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const linear_state *l = kpl_module_state(m);
    kpl_tensor *x = in->t[0], *y = kpl_linear(x, layer_weight(m, l->w, &l->sn), l->b);
    if (y) {
        const int64_t *ws = kpl_tensor_shape(l->w);
        double rows = (double)kpl_tensor_numel(x) / (double)ws[1];
        double n = kpl_tensor_ndim(x) > 1 ? (double)kpl_tensor_shape(x)[0] : 1.0;
        kpl_module_set_flops(m, 2.0 * (double)(ws[0] * ws[1]) * rows / (n > 0 ? n : 1),
                             kpl_requires_grad(x));
    }
    ONE_OUT(out, y);
}

static const kpl_module_kind linear_kind = {"linear", linear_forward, free, KPL_MODULE_REPLAYABLE};

kpl_status kpl_nn_linear(kpl_module *parent, const char *name, int64_t in, int64_t out,
                         bool bias, kpl_module **out_module)
{
    if (out_module) *out_module = NULL;
    KPL_CHECK(in > 0 && out > 0, KPL_EINVAL, "linear %s: in %lld and out %lld must be positive",
              name ? name : "", (long long)in, (long long)out);
    linear_state s;
    memset(&s, 0, sizeof s);
    kpl_module *m = NULL;
    KPL_TRY(kpl__layer_create_with(parent, name, &linear_kind, &s, sizeof s, &m));
    linear_state *l = kpl_module_state(m);
    int64_t ws[2] = {out, in};
    KPL_TRY(weight_and_bias(m, 2, ws, out, in, out, bias, KPL_NN_INIT_DEFAULT, &l->w, &l->b));
    if (out_module) *out_module = m;
    return KPL_OK;
}

/* ---- spectral normalisation ------------------------------------------------------------- */

/* x / max(|x|, eps), unrecorded (the power iteration's). */
static kpl_tensor *normalize(kpl_tensor *x, double eps)
{
    kpl_tensor *norm = kpl_sqrt(kpl_sum(kpl_square(x), NULL, 0, false));
    return kpl_div(x, kpl_scalar_op(KPL_BIN_MAXIMUM, norm, eps, false));
}

/* w as the matrix (h, n) of its dim `dim` against the others. */
static kpl_tensor *weight_matrix(kpl_tensor *w, int dim, int64_t h, int64_t n)
{
    if (dim != 0 && w) {
        int perm[KPL_MAX_DIMS], nd = kpl_tensor_ndim(w), k = 0;
        perm[k++] = dim;
        for (int d = 0; d < nd; d++)
            if (d != dim) perm[k++] = d;
        w = kpl_permute(w, perm);
    }
    return kpl_reshape(w, 2, (int64_t[]){h, n});
}

kpl_tensor *kpl__spectral_weight(kpl_tensor *w, kpl_tensor *u, kpl_tensor *v, int dim,
                                 int iters, double eps, bool update)
{
    if (!w || !u || !v) return NULL;
    int nd = kpl_tensor_ndim(w);
    if (nd < 2 || dim < 0 || dim >= nd) {
        KPL_ERROR(KPL_ESHAPE, "spectral_norm: weight of %d dims has no dim %d", nd, dim);
        return NULL;
    }
    int64_t h = kpl_tensor_dim(w, dim), n = h ? kpl_tensor_numel(w) / h : 0;
    if (kpl_tensor_numel(u) != h || kpl_tensor_numel(v) != n) {
        KPL_ERROR(KPL_ESHAPE, "spectral_norm: u has %lld and v %lld elements for a %lld x %lld "
                  "weight matrix", (long long)kpl_tensor_numel(u),
                  (long long)kpl_tensor_numel(v), (long long)h, (long long)n);
        return NULL;
    }
    int64_t hs[2] = {h, 1}, ns[2] = {n, 1};
    kpl_tensor *uc = NULL, *vc = NULL;
    bool prev = kpl_set_grad_enabled(false);
    if (kpl_recompute_replaying()) {
        /* recomputed (memory.recompute): the forward's u and v, which its
         * power iteration has moved on from */
        uc = kpl_recompute_replayed();
        vc = kpl_recompute_replayed();
    } else if (update && iters > 0) {
        kpl_tensor *wm = weight_matrix(kpl_detach(w), dim, h, n);
        uc = kpl_reshape(u, 2, hs);
        for (int i = 0; i < iters; i++) {
            vc = normalize(kpl_matmul(wm, uc, true, false), eps);
            uc = normalize(kpl_matmul(wm, vc, false, false), eps);
        }
        kpl_status st = uc && vc ? KPL_OK : kpl_last_status();
        if (st >= 0) st = kpl_k_copy(u, uc);
        if (st >= 0) st = kpl_k_copy(v, vc);
        if (st < 0) uc = NULL;
    } else {
        /* copies: a later training forward moves u and v in place, and
         * this graph's gradient must still read today's */
        uc = kpl_reshape(kpl_to_device(u, kpl_tensor_device(u)), 2, hs);
        vc = kpl_reshape(kpl_to_device(v, kpl_tensor_device(v)), 2, ns);
    }
    if (!kpl_recompute_replaying() && uc && vc &&
        (kpl_recompute_keep(uc) < 0 || kpl_recompute_keep(vc) < 0))
        uc = NULL;
    kpl_set_grad_enabled(prev);
    if (!uc || !vc) return NULL;
    /* sigma = u^T W v, recorded: PyTorch's gradient flows through it */
    kpl_tensor *sigma = kpl_sum(kpl_mul(uc, kpl_matmul(weight_matrix(w, dim, h, n), vc, false,
                                                       false)), NULL, 0, false);
    return kpl_div(w, sigma);
}

kpl_status kpl_nn_spectral_norm(kpl_module *layer, int power_iterations, double eps)
{
    KPL_CHECK(layer, KPL_EINVAL, "spectral_norm: no layer");
    const kpl_module_kind *k = kpl_module_kind_of(layer);
    const char *name = kpl_module_name(layer)[0] ? kpl_module_name(layer) : "(root)";
    spectral *sn = NULL;
    kpl_tensor *w = NULL;
    if (k == &conv2d_kind || k == &conv_transpose2d_kind) {
        conv_state *c = kpl_module_state(layer);
        sn = &c->sn, w = c->w;
    } else if (k == &linear_kind) {
        linear_state *l = kpl_module_state(layer);
        sn = &l->sn, w = l->w;
    }
    KPL_CHECK(sn, KPL_EINVAL, "spectral_norm %s: a %s layer has no weight to normalise "
              "(conv2d, conv_transpose2d or linear)", name, k->name);
    KPL_CHECK(!sn->iters, KPL_EINVAL, "spectral_norm %s: the weight is normalised already",
              name);
    KPL_CHECK(power_iterations >= 1 && power_iterations <= 1000 && eps > 0, KPL_EINVAL,
              "spectral_norm %s: power_iterations %d not in [1, 1000], or eps %g not > 0", name,
              power_iterations, eps);
    int dim = k == &conv_transpose2d_kind ? 1 : 0;
    int64_t h = kpl_tensor_dim(w, dim), n = kpl_tensor_numel(w) / h;
    KPL_TRY(kpl__module_rename_param(layer, "weight", "weight_orig"));
    /* u and v N(0, 1) from the model's generator, normalised (u first, as
     * PyTorch draws them) */
    kpl_tensor *uv[2] = {NULL, NULL};
    int64_t len[2] = {h, n};
    static const char *const names[2] = {"weight_u", "weight_v"};
    for (int i = 0; i < 2; i++) {
        KPL_TRY(kpl_tensor_empty(kpl_module_device(layer), kpl_tensor_dtype(w), 1, &len[i],
                                 &uv[i]));
        KPL_TRY(kpl_module_add_buffer(layer, names[i], uv[i]));
        KPL_TRY(kpl_k_normal(uv[i], kpl_module_rng(layer), 0, 1));
        kpl_pool *p = kpl_pool_push();
        KPL_CHECK(p, kpl_last_status(), "spectral_norm %s: out of memory", name);
        bool prev = kpl_set_grad_enabled(false);
        kpl_tensor *nu = normalize(uv[i], eps);
        kpl_status st = nu ? kpl_k_copy(uv[i], nu) : kpl_last_status();
        kpl_set_grad_enabled(prev);
        kpl_pool_pop(p);
        KPL_TRY(st);
    }
    *sn = (spectral){.iters = power_iterations, .dim = dim, .eps = eps, .u = uv[0], .v = uv[1]};
    return KPL_OK;
}

static kpl_status embedding_forward(kpl_module *m, const kpl_tensor_list *in,
                                    kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    ONE_OUT(out, kpl_embedding(kpl_module_get_param(m, "weight"), in->t[0]));
}

static const kpl_module_kind embedding_kind = {"embedding", embedding_forward, NULL,
                                               KPL_MODULE_REPLAYABLE};

kpl_status kpl_nn_embedding(kpl_module *parent, const char *name, int64_t num, int64_t dim,
                            kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(num > 0 && dim > 0, KPL_EINVAL, "embedding %s: %lld x %lld must be positive",
              name ? name : "", (long long)num, (long long)dim);
    kpl_module *m = NULL;
    KPL_TRY(kpl_module_create(parent, name, &embedding_kind, NULL, &m));
    int64_t ws[2] = {num, dim};
    kpl_tensor *w = NULL;
    KPL_TRY(kpl__layer_new_param(m, "weight", 2, ws, &w));
    KPL_TRY(kpl_k_normal(w, kpl_module_rng(m), 0, 1));
    if (out) *out = m;
    return KPL_OK;
}

/* ---- activations, pooling, reshaping ---------------------------------------------------------- */

typedef struct {
    kpl_nn_act act;
    double slope;
} act_state;

static kpl_status activation_forward(kpl_module *m, const kpl_tensor_list *in,
                                     kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const act_state *a = kpl_module_state(m);
    kpl_tensor *x = in->t[0], *y = NULL;
    switch (a->act) {
    case KPL_NN_RELU: y = kpl_relu(x); break;
    case KPL_NN_LEAKY_RELU: y = kpl_leaky_relu(x, a->slope); break;
    case KPL_NN_SIGMOID: y = kpl_sigmoid(x); break;
    case KPL_NN_TANH: y = kpl_tanh(x); break;
    case KPL_NN_GELU: y = kpl_gelu(x); break;
    case KPL_NN_SILU: y = kpl_mul(x, kpl_sigmoid(x)); break;
    }
    ONE_OUT(out, y);
}

static const kpl_module_kind activation_kind = {"activation", activation_forward, free,
                                                KPL_MODULE_REPLAYABLE};

kpl_status kpl_nn_activation(kpl_module *parent, const char *name, kpl_nn_act act, double slope,
                             kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK((unsigned)act <= KPL_NN_SILU, KPL_EINVAL, "activation %s: unknown kind %d",
              name ? name : "", (int)act);
    act_state s = {act, slope};
    return kpl__layer_create_with(parent, name, &activation_kind, &s, sizeof s, out);
}

kpl_status kpl_nn_relu(kpl_module *parent, const char *name, kpl_module **out)
{
    return kpl_nn_activation(parent, name, KPL_NN_RELU, 0, out);
}

typedef struct {
    kpl_pool2d_params p;
    int64_t oh, ow; /* adaptive */
} pool_state;

static kpl_status max_pool_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    ONE_OUT(out, kpl_max_pool2d(in->t[0], &((const pool_state *)kpl_module_state(m))->p));
}

static kpl_status avg_pool_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    ONE_OUT(out, kpl_avg_pool2d(in->t[0], &((const pool_state *)kpl_module_state(m))->p));
}

static kpl_status adaptive_pool_forward(kpl_module *m, const kpl_tensor_list *in,
                                        kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const pool_state *p = kpl_module_state(m);
    ONE_OUT(out, p->oh == 1 && p->ow == 1 ? kpl_global_avg_pool2d(in->t[0])
                                          : kpl_adaptive_avg_pool2d(in->t[0], p->oh, p->ow));
}

static const kpl_module_kind max_pool_kind = {"max_pool2d", max_pool_forward, free,
                                              KPL_MODULE_REPLAYABLE};
static const kpl_module_kind avg_pool_kind = {"avg_pool2d", avg_pool_forward, free,
                                              KPL_MODULE_REPLAYABLE};
static const kpl_module_kind adaptive_pool_kind = {"adaptive_avg_pool2d", adaptive_pool_forward,
                                                   free, KPL_MODULE_REPLAYABLE};

static kpl_status make_pool(kpl_module *parent, const char *name, const kpl_module_kind *kind,
                            const kpl_pool2d_params *p, kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(p, KPL_EINVAL, "%s %s: no parameters", kind->name, name ? name : "");
    for (int i = 0; i < 2; i++)
        KPL_CHECK(p->kernel[i] > 0 && p->stride[i] > 0 && p->padding[i] >= 0 &&
                      2 * p->padding[i] <= p->kernel[i],
                  KPL_EINVAL, "%s %s: kernel and stride > 0, padding at most half the kernel",
                  kind->name, name ? name : "");
    pool_state s = {.p = *p};
    return kpl__layer_create_with(parent, name, kind, &s, sizeof s, out);
}

kpl_status kpl_nn_max_pool2d(kpl_module *parent, const char *name, const kpl_pool2d_params *p,
                             kpl_module **out)
{
    return make_pool(parent, name, &max_pool_kind, p, out);
}

kpl_status kpl_nn_avg_pool2d(kpl_module *parent, const char *name, const kpl_pool2d_params *p,
                             kpl_module **out)
{
    return make_pool(parent, name, &avg_pool_kind, p, out);
}

kpl_status kpl_nn_adaptive_avg_pool2d(kpl_module *parent, const char *name, int64_t oh,
                                      int64_t ow, kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(oh > 0 && ow > 0, KPL_EINVAL, "adaptive_avg_pool2d %s: output %lldx%lld",
              name ? name : "", (long long)oh, (long long)ow);
    pool_state s = {.oh = oh, .ow = ow};
    return kpl__layer_create_with(parent, name, &adaptive_pool_kind, &s, sizeof s, out);
}

static kpl_status flatten_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    kpl_tensor *x = in->t[0];
    int64_t n = kpl_tensor_ndim(x) ? kpl_tensor_shape(x)[0] : 1;
    int64_t s[2] = {n, n ? kpl_tensor_numel(x) / n : 0};
    ONE_OUT(out, kpl_reshape(x, 2, s));
}

static const kpl_module_kind flatten_kind = {"flatten", flatten_forward, NULL,
                                             KPL_MODULE_REPLAYABLE};

kpl_status kpl_nn_flatten(kpl_module *parent, const char *name, kpl_module **out)
{
    return kpl_module_create(parent, name, &flatten_kind, NULL, out);
}

typedef struct {
    double p;
    int factor;
    bool bilinear;
} misc_state;

static kpl_status dropout_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const misc_state *d = kpl_module_state(m);
    if (!kpl_module_training(m) || d->p == 0) ONE_OUT(out, in->t[0]);
    ONE_OUT(out, kpl_dropout(in->t[0], d->p, true, kpl_module_rng(m)));
}

static const kpl_module_kind dropout_kind = {"dropout", dropout_forward, free,
                                             KPL_MODULE_REPLAYABLE};

kpl_status kpl_nn_dropout(kpl_module *parent, const char *name, double p, kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(p >= 0 && p < 1, KPL_EINVAL, "dropout %s: p %g not in [0, 1)", name ? name : "", p);
    misc_state s = {.p = p};
    return kpl__layer_create_with(parent, name, &dropout_kind, &s, sizeof s, out);
}

static kpl_status upsample_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const misc_state *u = kpl_module_state(m);
    kpl_tensor *x = in->t[0];
    KPL_CHECK(kpl_tensor_ndim(x) == 4, KPL_ESHAPE, "upsample: input has %d dims, expected 4",
              kpl_tensor_ndim(x));
    int64_t oh = kpl_tensor_shape(x)[2] * u->factor, ow = kpl_tensor_shape(x)[3] * u->factor;
    ONE_OUT(out, u->bilinear ? kpl_upsample_bilinear(x, oh, ow, false)
                             : kpl_upsample_nearest(x, oh, ow));
}

static const kpl_module_kind upsample_kind = {"upsample", upsample_forward, free,
                                              KPL_MODULE_REPLAYABLE};

kpl_status kpl_nn_upsample(kpl_module *parent, const char *name, int factor, bool bilinear,
                           kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(factor >= 1 && factor <= 64, KPL_EINVAL, "upsample %s: factor %d not in [1, 64]",
              name ? name : "", factor);
    misc_state s = {.factor = factor, .bilinear = bilinear};
    return kpl__layer_create_with(parent, name, &upsample_kind, &s, sizeof s, out);
}

static kpl_status pixel_shuffle_forward(kpl_module *m, const kpl_tensor_list *in,
                                        kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    int64_t r = ((const misc_state *)kpl_module_state(m))->factor;
    kpl_tensor *x = in->t[0];
    const int64_t *s = kpl_tensor_shape(x);
    KPL_CHECK(kpl_tensor_ndim(x) == 4 && s[1] % (r * r) == 0, KPL_ESHAPE,
              "pixel_shuffle: expected (N, C x %lld, H, W) input, got %d dims with %lld channels",
              (long long)(r * r), kpl_tensor_ndim(x),
              kpl_tensor_ndim(x) >= 2 ? (long long)s[1] : 0LL);
    int64_t c = s[1] / (r * r);
    /* (N, C, r, r, H, W) -> (N, C, H, r, W, r): in[n, c r^2 + i r + j, h, w] lands at
     * out[n, c, h r + i, w r + j] */
    kpl_tensor *y = kpl_reshape(x, 6, (int64_t[]){s[0], c, r, r, s[2], s[3]});
    y = kpl_permute(y, (int[]){0, 1, 4, 2, 5, 3});
    ONE_OUT(out, kpl_reshape(y, 4, (int64_t[]){s[0], c, s[2] * r, s[3] * r}));
}

static const kpl_module_kind pixel_shuffle_kind = {"pixel_shuffle", pixel_shuffle_forward, free,
                                                   KPL_MODULE_REPLAYABLE};

kpl_status kpl_nn_pixel_shuffle(kpl_module *parent, const char *name, int factor,
                                kpl_module **out)
{
    if (out) *out = NULL;
    KPL_CHECK(factor >= 1 && factor <= 64, KPL_EINVAL,
              "pixel_shuffle %s: factor %d not in [1, 64]", name ? name : "", factor);
    misc_state s = {.factor = factor};
    return kpl__layer_create_with(parent, name, &pixel_shuffle_kind, &s, sizeof s, out);
}

/* ---- fused ReLU ---------------------------------------------------------------------------- */

kpl_tensor *kpl_nn_forward_relu(kpl_module *m, kpl_tensor *x)
{
    if (!m) {
        KPL_ERROR(KPL_EINVAL, "forward_relu: no module");
        return NULL;
    }
    bool *flag = kpl_module_kind_of(m) == &conv2d_kind
                     ? &((conv_state *)kpl_module_state(m))->relu_out
                     : kpl__batch_norm_relu_flag(m);
    if (!flag) return kpl_relu(kpl_module_forward(m, x));
    *flag = true;
    kpl_tensor *y = kpl_module_forward(m, x);
    *flag = false;
    return y;
}

/* ---- containers -------------------------------------------------------------------------- */

/* A batch norm or convolution followed by a ReLU: fused. */
static bool fuses_relu(const kpl_module *m, const kpl_module *act)
{
    const kpl_module_kind *k = kpl_module_kind_of(m);
    return (k == &conv2d_kind || kpl__batch_norm_relu_flag((kpl_module *)m)) &&
           kpl_module_kind_of(act) == &activation_kind &&
           ((const act_state *)kpl_module_state(act))->act == KPL_NN_RELU;
}

static void release_list(kpl_tensor_list *l)
{
    for (int j = 0; j < l->n; j++) kpl_tensor_release(l->t[j]);
    l->n = 0;
}

/* A sequential's forward over children from..to-1 (kpl__forward_children,
 * nn_impl.h).  Each child runs in a pool of its own, and one reference to
 * the latest outputs only is held: an intermediate is freed as soon
 * as the next child has run, unless the graph keeps it for the gradient.
 * With the caller's pool holding them all until the end of the forward,
 * a leaky ReLU's input stayed alive beside its output in a GAN step (its
 * gradient reads the output; docs/memory.md). */
static kpl_status forward_children(kpl_module *m, int from, int to, const kpl_tensor_list *in,
                                   kpl_tensor_list *out, bool spans);

/* A recomputed span's children run again in the backward (graph.h), at
 * the depth of a parent's forward. */
static kpl_status span_again(void *user, int n, kpl_tensor *const *inputs)
{
    const kpl__recompute_span *sp = user;
    kpl_tensor_list in = {.n = n}, out;
    memcpy(in.t, inputs, (size_t)n * sizeof *inputs);
    int prev = kpl__module_depth_set(1);
    kpl_status st = forward_children(sp->m, sp->from, sp->to, &in, &out, false);
    kpl__module_depth_set(prev);
    return st;
}

/* One child (or a batch norm and the ReLU after it, fused; or a
 * recomputed span of children) from i on cur into *next (pool-owned);
 * the index of the last child it ran in *last. */
static kpl_status forward_one(kpl_module *m, int i, int nc, const kpl_tensor_list *cur,
                              kpl_tensor_list *next, bool spans, int *last)
{
    kpl_module *c = kpl_module_child(m, i);
    const kpl__recompute_span *sp = spans ? kpl__module_span(m, i) : NULL;
    *last = i;
    if (sp && sp->to <= nc) {
        char name[160];
        snprintf(name, sizeof name, "%s..%s", kpl_module_name(c),
                 kpl_module_name(kpl_module_child(m, sp->to - 1)));
        kpl_recompute *r = NULL;
        KPL_TRY(kpl_recompute_begin(name, cur->n, cur->t, span_again, (void *)sp, &r));
        kpl_status st = forward_children(m, i, sp->to, cur, next, false);
        kpl_status est = kpl_recompute_end(r, st >= 0 ? next->n : 0, next->t);
        *last = sp->to - 1;
        return st < 0 ? st : est;
    }
    if (i + 1 < nc && cur->n == 1 && fuses_relu(c, kpl_module_child(m, i + 1))) {
        /* batch norm or convolution then ReLU: one fused op (kpl_nn_forward_relu) */
        next->n = 1;
        next->t[0] = kpl_nn_forward_relu(c, cur->t[0]);
        *last = i + 1;
        return next->t[0] ? KPL_OK : kpl_last_status();
    }
    return kpl_module_forward_list(c, cur, next);
}

static kpl_status forward_children(kpl_module *m, int from, int to, const kpl_tensor_list *in,
                                   kpl_tensor_list *out, bool spans)
{
    kpl_tensor_list cur = *in, next;
    bool own = false; /* cur holds references of ours (not the input's) */
    kpl_status st = KPL_OK;
    int nc = to < kpl_module_num_children(m) ? to : kpl_module_num_children(m);
    for (int i = from; i < nc && st >= 0; i++) {
        kpl_pool *p = kpl_pool_push();
        if (!p) {
            st = kpl_last_status() < 0 ? kpl_last_status() : KPL_ENOMEM;
            break;
        }
        st = forward_one(m, i, nc, &cur, &next, spans, &i);
        if (st >= 0)
            for (int j = 0; j < next.n; j++) kpl_tensor_retain(next.t[j]);
        kpl_pool_pop(p);
        if (own) release_list(&cur);
        if (st < 0) break;
        cur = next;
        own = true;
    }
    if (st < 0) {
        if (own) release_list(&cur);
        return st;
    }
    *out = cur;
    for (int j = 0; own && j < out->n; j++) kpl_autorelease(out->t[j]);
    return KPL_OK;
}

kpl_status kpl__forward_children(kpl_module *m, int from, int to, const kpl_tensor_list *in,
                                 kpl_tensor_list *out)
{
    return forward_children(m, from, to, in, out, true);
}

static kpl_status sequential_forward(kpl_module *m, const kpl_tensor_list *in,
                                     kpl_tensor_list *out)
{
    return kpl__forward_children(m, 0, kpl_module_num_children(m), in, out);
}

static const kpl_module_kind sequential_kind = {"sequential", sequential_forward, NULL,
                                                KPL_MODULE_REPLAYABLE};

kpl_status kpl_nn_sequential(kpl_module *parent, const char *name, kpl_module **out)
{
    return kpl_module_create(parent, name, &sequential_kind, NULL, out);
}

kpl_status kpl_nn_sequential_root(kpl_device *dev, uint64_t seed, kpl_module **out)
{
    return kpl_module_create_root(dev, seed, &sequential_kind, NULL, out);
}

typedef struct {
    bool relu;
} residual_state;

static kpl_status residual_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_TRY(kpl__layer_one_input(m, in));
    const residual_state *r = kpl_module_state(m);
    kpl_module *body = kpl_module_find(m, "body"), *sc = kpl_module_find(m, "shortcut");
    KPL_CHECK(body, KPL_EINVAL, "residual %s: no child called 'body'", kpl_module_name(m));
    /* A pool per block: what the gradients do not keep (the sum before
     * the ReLU, batch-norm outputs) is freed at the block's end instead
     * of at the end of the forward pass, the peak of a training step. */
    kpl_pool *p = kpl_pool_push();
    if (!p) return kpl_last_status();
    kpl_tensor *x = in->t[0];
    kpl_tensor *y = kpl_add(kpl_module_forward(body, x), sc ? kpl_module_forward(sc, x) : x);
    if (y && r->relu) y = kpl_relu(y);
    if (y) kpl_tensor_retain(y);
    kpl_pool_pop(p);
    ONE_OUT(out, kpl_autorelease(y));
}

static const kpl_module_kind residual_kind = {"residual", residual_forward, free,
                                              KPL_MODULE_REPLAYABLE};

kpl_status kpl_nn_residual(kpl_module *parent, const char *name, bool relu, kpl_module **out)
{
    residual_state s = {relu};
    return kpl__layer_create_with(parent, name, &residual_kind, &s, sizeof s, out);
}
