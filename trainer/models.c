/*
 * models.c — the model zoo: MLP, LeNet-5 and the ResNets, written with the
 * graph/ nn functions.  A model is a flat list of parameters and buffers
 * plus a small description of its layers; forward walks that description.
 */
#include "trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


#define MAX_LAYERS 80 /* ResNet-50: 53 conv+bn, 1 fc */
#define MAX_BLOCKS 16

typedef struct {
    kpl_tensor *w, *b;         /* conv (O, C/g, K, K) / linear (O, I); bias or NULL */
    kpl_tensor *g, *beta;      /* batch norm (O) or NULL */
    kpl_tensor *rmean, *rvar;  /* running statistics (O) */
    kpl_conv2d_params p;
    double flops;              /* forward, per sample */
} layer;

typedef enum { ARCH_MLP, ARCH_LENET, ARCH_RESNET } arch;

typedef struct {
    int first, n;  /* layers [first, first + n): 2 (basic) or 3 (bottleneck) */
    int down;      /* projection shortcut layer or -1 */
} block;

struct kpl_model {
    char name[32];
    arch kind;
    bool cifar;     /* ResNet stem */
    int64_t classes;
    kpl_device *dev;
    kpl_rng *rng;
    layer l[MAX_LAYERS];
    int nl;
    block b[MAX_BLOCKS];
    int nb;
    kpl_tensor *params[4 * MAX_LAYERS];
    int np;
    kpl_tensor *buffers[2 * MAX_LAYERS];
    int nbuf;
};

/* ---- construction ------------------------------------------------------------------- */

static kpl_status new_tensor(kpl_model *m, int ndim, const int64_t *shape, kpl_tensor **out)
{
    return kpl_tensor_empty(m->dev, KPL_F32, ndim, shape, out);
}

static kpl_status add_param(kpl_model *m, kpl_tensor *t)
{
    KPL_ASSERT(m->np < 4 * MAX_LAYERS, "model: too many parameters");
    m->params[m->np++] = t;
    return kpl_set_requires_grad(t, true);
}

/* U(-bound, bound): PyTorch's default for linear and conv weights and biases. */
static kpl_status uniform_param(kpl_model *m, int ndim, const int64_t *shape, double bound,
                                kpl_tensor **out)
{
    KPL_TRY(new_tensor(m, ndim, shape, out));
    KPL_TRY(add_param(m, *out));
    return kpl_k_uniform(*out, m->rng, -bound, bound);
}

static kpl_status const_tensor(kpl_model *m, int64_t n, double v, bool param, kpl_tensor **out)
{
    KPL_TRY(new_tensor(m, 1, &n, out));
    if (param) {
        KPL_TRY(add_param(m, *out));
    } else {
        KPL_ASSERT(m->nbuf < 2 * MAX_LAYERS, "model: too many buffers");
        m->buffers[m->nbuf++] = *out;
    }
    return kpl_k_fill(*out, v);
}

static layer *next_layer(kpl_model *m)
{
    KPL_ASSERT(m->nl < MAX_LAYERS, "model: too many layers");
    layer *l = &m->l[m->nl++];
    memset(l, 0, sizeof *l);
    l->p = (kpl_conv2d_params)KPL_CONV2D_PARAMS_INIT;
    return l;
}

static kpl_status add_linear(kpl_model *m, int64_t in, int64_t out)
{
    layer *l = next_layer(m);
    int64_t ws[2] = {out, in};
    double bound = 1.0 / sqrt((double)in);
    KPL_TRY(uniform_param(m, 2, ws, bound, &l->w));
    KPL_TRY(uniform_param(m, 1, &out, bound, &l->b));
    l->flops = 2.0 * (double)(in * out);
    return KPL_OK;
}

/* A convolution; `bn` adds batch norm after it (and drops the conv bias).
 * `hw` is the output plane size, for the FLOP count. */
static kpl_status add_conv(kpl_model *m, int64_t c, int64_t o, int k, int stride, int pad,
                           bool bn, int64_t out_hw)
{
    layer *l = next_layer(m);
    int64_t ws[4] = {o, c, k, k};
    l->p.stride[0] = l->p.stride[1] = stride;
    l->p.padding[0] = l->p.padding[1] = pad;
    l->flops = 2.0 * (double)(o * c * k * k) * (double)(out_hw * out_hw);
    if (!bn) {
        double bound = 1.0 / sqrt((double)(c * k * k));
        KPL_TRY(uniform_param(m, 4, ws, bound, &l->w));
        return uniform_param(m, 1, &o, bound, &l->b);
    }
    /* Kaiming normal, fan-out, ReLU gain (torchvision's ResNet init). */
    KPL_TRY(new_tensor(m, 4, ws, &l->w));
    KPL_TRY(add_param(m, l->w));
    KPL_TRY(kpl_k_normal(l->w, m->rng, 0, sqrt(2.0 / (double)(o * k * k))));
    KPL_TRY(const_tensor(m, o, 1, true, &l->g));
    KPL_TRY(const_tensor(m, o, 0, true, &l->beta));
    KPL_TRY(const_tensor(m, o, 0, false, &l->rmean));
    return const_tensor(m, o, 1, false, &l->rvar);
}

static kpl_status build_resnet(kpl_model *m, int depth)
{
    static const int counts18[4] = {2, 2, 2, 2}, counts34[4] = {3, 4, 6, 3};
    const int *counts = depth == 18 ? counts18 : counts34; /* 50 uses 34's */
    bool bottleneck = depth == 50;
    int64_t hw = m->cifar ? 32 : 112;
    if (m->cifar) KPL_TRY(add_conv(m, 3, 64, 3, 1, 1, true, hw));
    else KPL_TRY(add_conv(m, 3, 64, 7, 2, 3, true, hw));
    if (!m->cifar) hw = 56;
    int64_t in = 64;
    for (int s = 0; s < 4; s++) {
        int64_t planes = 64 << s, out = bottleneck ? planes * 4 : planes;
        for (int k = 0; k < counts[s]; k++) {
            int stride = (s > 0 && k == 0) ? 2 : 1;
            int64_t ohw = hw / stride;
            KPL_ASSERT(m->nb < MAX_BLOCKS, "model: too many blocks");
            block *b = &m->b[m->nb++];
            b->first = m->nl;
            if (bottleneck) {
                KPL_TRY(add_conv(m, in, planes, 1, 1, 0, true, hw));
                KPL_TRY(add_conv(m, planes, planes, 3, stride, 1, true, ohw));
                KPL_TRY(add_conv(m, planes, out, 1, 1, 0, true, ohw));
                b->n = 3;
            } else {
                KPL_TRY(add_conv(m, in, planes, 3, stride, 1, true, ohw));
                KPL_TRY(add_conv(m, planes, planes, 3, 1, 1, true, ohw));
                b->n = 2;
            }
            b->down = -1;
            if (stride != 1 || in != out) {
                b->down = m->nl;
                KPL_TRY(add_conv(m, in, out, 1, stride, 0, true, ohw));
            }
            in = out;
            hw = ohw;
        }
    }
    return add_linear(m, in, m->classes);
}

kpl_status kpl_model_create(const char *name, int64_t num_classes, kpl_device *dev,
                            uint64_t seed, kpl_model **out)
{
    *out = NULL;
    KPL_CHECK(name && num_classes > 0, KPL_EINVAL, "model: need a name and num_classes > 0 (got %lld)",
              (long long)num_classes);
    kpl_model *m = calloc(1, sizeof *m);
    KPL_CHECK(m, KPL_ENOMEM, "model: out of memory");
    kpl_status st = KPL_OK;
    snprintf(m->name, sizeof m->name, "%s", name);
    m->classes = num_classes;
    m->dev = dev ? dev : kpl_device_cpu();
    if (!(m->rng = kpl_rng_create(seed))) {
        st = KPL_ERROR(KPL_ENOMEM, "model: out of memory");
        goto fail;
    }
    if (!strcmp(name, "mlp")) {
        m->kind = ARCH_MLP;
        KPL_TRY_GOTO(add_linear(m, 784, 512));
        KPL_TRY_GOTO(add_linear(m, 512, 256));
        KPL_TRY_GOTO(add_linear(m, 256, num_classes));
    } else if (!strcmp(name, "lenet")) {
        m->kind = ARCH_LENET;
        KPL_TRY_GOTO(add_conv(m, 1, 6, 5, 1, 2, false, 28));
        KPL_TRY_GOTO(add_conv(m, 6, 16, 5, 1, 0, false, 10));
        KPL_TRY_GOTO(add_linear(m, 400, 120));
        KPL_TRY_GOTO(add_linear(m, 120, 84));
        KPL_TRY_GOTO(add_linear(m, 84, num_classes));
    } else if (!strcmp(name, "resnet18_cifar") || !strcmp(name, "resnet18") ||
               !strcmp(name, "resnet34") || !strcmp(name, "resnet50")) {
        m->kind = ARCH_RESNET;
        m->cifar = !strcmp(name, "resnet18_cifar");
        int depth = atoi(name + 6);
        KPL_TRY_GOTO(build_resnet(m, depth));
    } else {
        st = KPL_ERROR(KPL_EINVAL,
                       "model: unknown model '%s' (known: mlp, lenet, resnet18_cifar, resnet18, "
                       "resnet34, resnet50)",
                       name);
        goto fail;
    }
    *out = m;
    return KPL_OK;
fail:
    kpl_model_destroy(m);
    return st;
}

void kpl_model_destroy(kpl_model *m)
{
    if (!m) return;
    for (int i = 0; i < m->np; i++) kpl_tensor_release(m->params[i]);
    for (int i = 0; i < m->nbuf; i++) kpl_tensor_release(m->buffers[i]);
    kpl_rng_destroy(m->rng);
    free(m);
}

/* ---- forward ------------------------------------------------------------------------ */

static kpl_tensor *conv(const layer *l, kpl_tensor *x, bool training, bool relu)
{
    kpl_tensor *y = kpl_conv2d(x, l->w, l->b, &l->p);
    if (l->g) y = kpl_batch_norm(y, l->g, l->beta, l->rmean, l->rvar, training, 0.1, 1e-5);
    return relu ? kpl_relu(y) : y;
}

static kpl_tensor *flatten(kpl_tensor *x)
{
    if (!x) return NULL;
    int64_t s[2] = {kpl_tensor_shape(x)[0], kpl_tensor_numel(x) / kpl_tensor_shape(x)[0]};
    return kpl_reshape(x, 2, s);
}

static kpl_tensor *resnet_forward(kpl_model *m, kpl_tensor *x, bool training)
{
    kpl_tensor *h = conv(&m->l[0], x, training, true);
    if (!m->cifar) {
        kpl_pool2d_params mp = {{3, 3}, {2, 2}, {1, 1}, false};
        h = kpl_max_pool2d(h, &mp);
    }
    for (int i = 0; i < m->nb && h; i++) {
        /* A pool per block: what the gradients do not keep (batch-norm
         * outputs, the sum before the last ReLU) is freed at the block's
         * end instead of at the end of the forward pass, the peak of a
         * training step. */
        kpl_pool *bp = kpl_pool_push();
        if (!bp) return NULL;
        const block *b = &m->b[i];
        kpl_tensor *y = h;
        for (int k = 0; k < b->n; k++) y = conv(&m->l[b->first + k], y, training, k + 1 < b->n);
        kpl_tensor *sc = b->down >= 0 ? conv(&m->l[b->down], h, training, false) : h;
        kpl_tensor *out = kpl_relu(kpl_add(y, sc));
        if (out) kpl_tensor_retain(out);
        kpl_pool_pop(bp);
        h = kpl_autorelease(out);
    }
    const layer *fc = &m->l[m->nl - 1];
    return kpl_linear(flatten(kpl_global_avg_pool2d(h)), fc->w, fc->b);
}

kpl_tensor *kpl_model_forward(kpl_model *m, kpl_tensor *x, bool training)
{
    if (!x) return NULL;
    kpl_pool2d_params pool2 = {{2, 2}, {2, 2}, {0, 0}, false};
    switch (m->kind) {
    case ARCH_MLP: {
        kpl_tensor *h = flatten(x);
        for (int i = 0; i < m->nl; i++) {
            h = kpl_linear(h, m->l[i].w, m->l[i].b);
            if (i + 1 < m->nl) h = kpl_relu(h);
        }
        return h;
    }
    case ARCH_LENET: {
        kpl_tensor *h = kpl_max_pool2d(conv(&m->l[0], x, training, true), &pool2);
        h = flatten(kpl_max_pool2d(conv(&m->l[1], h, training, true), &pool2));
        for (int i = 2; i < m->nl; i++) {
            h = kpl_linear(h, m->l[i].w, m->l[i].b);
            if (i + 1 < m->nl) h = kpl_relu(h);
        }
        return h;
    }
    case ARCH_RESNET: return resnet_forward(m, x, training);
    }
    return NULL;
}

int kpl_model_num_params(const kpl_model *m) { return m->np; }
kpl_tensor *const *kpl_model_params(const kpl_model *m) { return m->params; }
const char *kpl_model_name(const kpl_model *m) { return m->name; }

int kpl_model_num_buffers(const kpl_model *m) { return m->nbuf; }
kpl_tensor *const *kpl_model_buffers(const kpl_model *m) { return m->buffers; }

int64_t kpl_model_param_count(const kpl_model *m)
{
    int64_t n = 0;
    for (int i = 0; i < m->np; i++) n += kpl_tensor_numel(m->params[i]);
    return n;
}

double kpl_model_flops(const kpl_model *m, bool train_flops)
{
    double f = 0;
    for (int i = 0; i < m->nl; i++)
        f += m->l[i].flops * (train_flops ? (i == 0 ? 2.0 : 3.0) : 1.0);
    return f;
}
