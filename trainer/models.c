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


#define MAX_LAYERS 160 /* ResNet-152: 155 conv+bn, 1 fc */
#define MAX_BLOCKS 52
#define MAX_NAME 48

typedef struct {
    kpl_tensor *w, *b;         /* conv (O, C/g, K, K) / linear (O, I); bias or NULL */
    kpl_tensor *g, *beta;      /* batch norm (O) or NULL */
    kpl_tensor *rmean, *rvar;  /* running statistics (O) */
    kpl_conv2d_params p;
    double flops;              /* forward, per sample */
} layer;

typedef struct {
    int first, n;  /* layers [first, first + n): 2 (basic) or 3 (bottleneck) */
    int down;      /* projection shortcut layer or -1 */
} block;

struct kpl_model {
    char name[32];
    kpl_model_config cfg;
    kpl_device *dev;
    kpl_rng *rng;
    layer l[MAX_LAYERS];
    int nl;
    block b[MAX_BLOCKS];
    int nb;
    kpl_tensor *params[4 * MAX_LAYERS];
    char pname[4 * MAX_LAYERS][MAX_NAME];
    bool pnodecay[4 * MAX_LAYERS];
    int np;
    kpl_tensor *buffers[2 * MAX_LAYERS];
    char bname[2 * MAX_LAYERS][MAX_NAME];
    int nbuf;
};

/* ---- construction ------------------------------------------------------------------- */

static kpl_status new_tensor(kpl_model *m, int ndim, const int64_t *shape, kpl_tensor **out)
{
    return kpl_tensor_empty(m->dev, KPL_F32, ndim, shape, out);
}

static kpl_status add_param(kpl_model *m, kpl_tensor *t, const char *prefix, const char *what)
{
    KPL_ASSERT(m->np < 4 * MAX_LAYERS, "model: too many parameters");
    snprintf(m->pname[m->np], MAX_NAME, "%s.%s", prefix, what);
    m->pnodecay[m->np] = kpl_tensor_ndim(t) <= 1;
    m->params[m->np++] = t;
    return kpl_set_requires_grad(t, true);
}

/* U(-bound, bound): PyTorch's default for linear and conv weights and biases. */
static kpl_status uniform_param(kpl_model *m, int ndim, const int64_t *shape, double bound,
                                const char *prefix, const char *what, kpl_tensor **out)
{
    KPL_TRY(new_tensor(m, ndim, shape, out));
    KPL_TRY(add_param(m, *out, prefix, what));
    return kpl_k_uniform(*out, m->rng, -bound, bound);
}

static kpl_status const_tensor(kpl_model *m, int64_t n, double v, bool param, const char *prefix,
                               const char *what, kpl_tensor **out)
{
    KPL_TRY(new_tensor(m, 1, &n, out));
    if (param) {
        KPL_TRY(add_param(m, *out, prefix, what));
    } else {
        KPL_ASSERT(m->nbuf < 2 * MAX_LAYERS, "model: too many buffers");
        snprintf(m->bname[m->nbuf], MAX_NAME, "%s.%s", prefix, what);
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

static kpl_status add_linear(kpl_model *m, int64_t in, int64_t out, const char *name)
{
    layer *l = next_layer(m);
    int64_t ws[2] = {out, in};
    double bound = 1.0 / sqrt((double)in);
    KPL_TRY(uniform_param(m, 2, ws, bound, name, "weight", &l->w));
    KPL_TRY(uniform_param(m, 1, &out, bound, name, "bias", &l->b));
    l->flops = 2.0 * (double)(in * out);
    return KPL_OK;
}

/* A convolution named `cname`; with a batch-norm name `bname` the batch
 * norm follows it (and the conv has no bias).  oh x ow is the output
 * plane, for the FLOP count.  bn_scale: the batch norm's initial scale. */
static kpl_status add_conv(kpl_model *m, int64_t c, int64_t o, int k, int stride, int pad,
                           const char *cname, const char *bname, double bn_scale, int64_t oh,
                           int64_t ow)
{
    layer *l = next_layer(m);
    int64_t ws[4] = {o, c, k, k};
    l->p.stride[0] = l->p.stride[1] = stride;
    l->p.padding[0] = l->p.padding[1] = pad;
    l->flops = 2.0 * (double)(o * c * k * k) * (double)(oh * ow);
    if (!bname) {
        double bound = 1.0 / sqrt((double)(c * k * k));
        KPL_TRY(uniform_param(m, 4, ws, bound, cname, "weight", &l->w));
        return uniform_param(m, 1, &o, bound, cname, "bias", &l->b);
    }
    /* Kaiming normal, fan-out, ReLU gain (torchvision's ResNet init). */
    KPL_TRY(new_tensor(m, 4, ws, &l->w));
    KPL_TRY(add_param(m, l->w, cname, "weight"));
    KPL_TRY(kpl_k_normal(l->w, m->rng, 0, sqrt(2.0 / (double)(o * k * k))));
    KPL_TRY(const_tensor(m, o, bn_scale, true, bname, "weight", &l->g));
    KPL_TRY(const_tensor(m, o, 0, true, bname, "bias", &l->beta));
    KPL_TRY(const_tensor(m, o, 0, false, bname, "running_mean", &l->rmean));
    return const_tensor(m, o, 1, false, bname, "running_var", &l->rvar);
}

/* Output size of a k x k window with stride s and padding p. */
static int64_t out_size(int64_t in, int k, int s, int p) { return (in + 2 * p - k) / s + 1; }

static kpl_status build_resnet(kpl_model *m)
{
    const kpl_model_config *c = &m->cfg;
    static const int counts[5][4] = {
        {2, 2, 2, 2}, {3, 4, 6, 3}, {3, 4, 6, 3}, {3, 4, 23, 3}, {3, 8, 36, 3}};
    int v = c->depth == 18 ? 0 : c->depth == 34 ? 1 : c->depth == 50 ? 2 : c->depth == 101 ? 3 : 4;
    bool bottleneck = c->depth >= 50;
    int64_t base = c->width, h = c->in_h, w = c->in_w;
    if (c->cifar_stem) {
        KPL_TRY(add_conv(m, c->in_channels, base, 3, 1, 1, "conv1", "bn1", 1, h, w));
    } else {
        h = out_size(h, 7, 2, 3), w = out_size(w, 7, 2, 3);
        KPL_TRY(add_conv(m, c->in_channels, base, 7, 2, 3, "conv1", "bn1", 1, h, w));
        h = out_size(h, 3, 2, 1), w = out_size(w, 3, 2, 1);
    }
    int64_t in = base;
    double last_scale = c->zero_init_residual ? 0 : 1;
    for (int s = 0; s < 4; s++) {
        int64_t planes = base << s, out = bottleneck ? planes * 4 : planes;
        for (int k = 0; k < counts[v][s]; k++) {
            int stride = (s > 0 && k == 0) ? 2 : 1;
            int64_t oh = out_size(h, 3, stride, 1), ow = out_size(w, 3, stride, 1);
            KPL_ASSERT(m->nb < MAX_BLOCKS, "model: too many blocks");
            block *b = &m->b[m->nb++];
            b->first = m->nl;
            char cn[3][MAX_NAME], bn[3][MAX_NAME], dc[MAX_NAME], db[MAX_NAME];
            for (int j = 0; j < 3; j++) {
                snprintf(cn[j], MAX_NAME, "layer%d.%d.conv%d", s + 1, k, j + 1);
                snprintf(bn[j], MAX_NAME, "layer%d.%d.bn%d", s + 1, k, j + 1);
            }
            /* torchvision puts the stride on the 3x3 convolution (ResNet v1.5). */
            if (bottleneck) {
                KPL_TRY(add_conv(m, in, planes, 1, 1, 0, cn[0], bn[0], 1, h, w));
                KPL_TRY(add_conv(m, planes, planes, 3, stride, 1, cn[1], bn[1], 1, oh, ow));
                KPL_TRY(add_conv(m, planes, out, 1, 1, 0, cn[2], bn[2], last_scale, oh, ow));
                b->n = 3;
            } else {
                KPL_TRY(add_conv(m, in, planes, 3, stride, 1, cn[0], bn[0], 1, oh, ow));
                KPL_TRY(add_conv(m, planes, planes, 3, 1, 1, cn[1], bn[1], last_scale, oh, ow));
                b->n = 2;
            }
            b->down = -1;
            if (stride != 1 || in != out) {
                b->down = m->nl;
                snprintf(dc, MAX_NAME, "layer%d.%d.downsample.0", s + 1, k);
                snprintf(db, MAX_NAME, "layer%d.%d.downsample.1", s + 1, k);
                KPL_TRY(add_conv(m, in, out, 1, stride, 0, dc, db, 1, oh, ow));
            }
            in = out;
            h = oh, w = ow;
        }
    }
    return add_linear(m, in, c->num_classes, "fc");
}

static kpl_status build_cnn(kpl_model *m)
{
    const kpl_model_config *c = &m->cfg;
    int64_t ch = c->in_channels, h = c->in_h, w = c->in_w;
    for (int s = 0; s < c->depth; s++) {
        char cn[MAX_NAME], bn[MAX_NAME];
        snprintf(cn, MAX_NAME, "conv%d", s + 1);
        snprintf(bn, MAX_NAME, "bn%d", s + 1);
        KPL_TRY(add_conv(m, ch, c->width << s, 3, 1, 1, cn, bn, 1, h, w));
        ch = c->width << s;
        h /= 2, w /= 2;
    }
    int64_t in = ch * h * w;
    for (int i = 0; i < c->nhidden; i++) {
        char fn[MAX_NAME];
        snprintf(fn, MAX_NAME, "fc%d", i + 1);
        KPL_TRY(add_linear(m, in, c->hidden[i], fn));
        in = c->hidden[i];
    }
    char fn[MAX_NAME];
    snprintf(fn, MAX_NAME, "fc%d", c->nhidden + 1);
    return add_linear(m, in, c->num_classes, fn);
}

/* Fills the architecture's defaults and checks that the input survives
 * the downsampling. */
static kpl_status complete_config(kpl_model_config *c)
{
    static const char *const arch[] = {"mlp", "lenet", "cnn", "resnet"};
    KPL_CHECK((unsigned)c->arch <= KPL_MODEL_RESNET, KPL_EINVAL, "model: unknown architecture %d",
              (int)c->arch);
    const char *a = arch[c->arch];
    KPL_CHECK(c->num_classes > 0, KPL_EINVAL, "model: need num_classes > 0 (got %lld)",
              (long long)c->num_classes);
    KPL_CHECK(c->in_channels > 0 && c->in_h > 0 && c->in_w > 0, KPL_EINVAL,
              "model %s: input (%lld, %lld, %lld) must be positive", a,
              (long long)c->in_channels, (long long)c->in_h, (long long)c->in_w);
    KPL_CHECK(c->nhidden >= 0 && c->nhidden <= 16, KPL_EINVAL, "model %s: 0 to 16 hidden layers",
              a);
    KPL_CHECK(c->dropout >= 0 && c->dropout < 1, KPL_EINVAL, "model %s: dropout %g not in [0, 1)",
              a, c->dropout);
    switch (c->arch) {
    case KPL_MODEL_MLP:
        if (c->nhidden == 0) c->hidden[0] = 512, c->hidden[1] = 256, c->nhidden = 2;
        break;
    case KPL_MODEL_LENET:
        if (!c->width) c->width = 6;
        KPL_CHECK(c->in_h >= 16 && c->in_w >= 16, KPL_EINVAL,
                  "model lenet: input %lldx%lld is too small (at least 16x16)",
                  (long long)c->in_h, (long long)c->in_w);
        break;
    case KPL_MODEL_CNN:
        if (!c->width) c->width = 32;
        if (!c->depth) c->depth = 2;
        if (c->nhidden == 0) c->hidden[0] = 128, c->nhidden = 1;
        KPL_CHECK(c->depth <= 12 && (c->in_h >> c->depth) >= 1 && (c->in_w >> c->depth) >= 1,
                  KPL_EINVAL, "model cnn: %lld stages halve %lldx%lld to nothing",
                  (long long)c->depth, (long long)c->in_h, (long long)c->in_w);
        KPL_CHECK((c->width << (c->depth - 1)) <= 65536, KPL_EINVAL, "model cnn: too wide");
        break;
    case KPL_MODEL_RESNET:
        if (!c->width) c->width = 64;
        KPL_CHECK(c->depth == 18 || c->depth == 34 || c->depth == 50 || c->depth == 101 ||
                      c->depth == 152,
                  KPL_EINVAL, "model resnet: depth is 18, 34, 50, 101 or 152 (got %lld)",
                  (long long)c->depth);
        KPL_CHECK(c->in_h >= (c->cifar_stem ? 8 : 32) && c->in_w >= (c->cifar_stem ? 8 : 32),
                  KPL_EINVAL, "model resnet: input %lldx%lld is too small for the %s stem",
                  (long long)c->in_h, (long long)c->in_w, c->cifar_stem ? "cifar" : "imagenet");
        break;
    }
    KPL_CHECK(c->width >= 0 && c->width <= 4096, KPL_EINVAL, "model %s: width %lld out of range",
              a, (long long)c->width);
    return KPL_OK;
}

kpl_status kpl_model_create_config(const kpl_model_config *cfg, kpl_device *dev, uint64_t seed,
                                   kpl_model **out)
{
    KPL_CHECK(cfg && out, KPL_EINVAL, "model: bad arguments");
    *out = NULL;
    kpl_model_config c = *cfg;
    KPL_TRY(complete_config(&c));
    kpl_model *m = calloc(1, sizeof *m);
    KPL_CHECK(m, KPL_ENOMEM, "model: out of memory");
    kpl_status st = KPL_OK;
    m->cfg = c;
    m->dev = dev ? dev : kpl_device_cpu();
    if (!(m->rng = kpl_rng_create(seed))) {
        st = KPL_ERROR(KPL_ENOMEM, "model: out of memory");
        goto fail;
    }
    switch (c.arch) {
    case KPL_MODEL_MLP: {
        snprintf(m->name, sizeof m->name, "mlp");
        int64_t in = c.in_channels * c.in_h * c.in_w;
        for (int i = 0; i <= c.nhidden; i++) {
            char fn[MAX_NAME];
            snprintf(fn, MAX_NAME, "fc%d", i + 1);
            int64_t o = i < c.nhidden ? c.hidden[i] : c.num_classes;
            KPL_TRY_GOTO(add_linear(m, in, o, fn));
            in = o;
        }
        break;
    }
    case KPL_MODEL_LENET: {
        snprintf(m->name, sizeof m->name, "lenet");
        int64_t c1 = c.width, c2 = c.width * 16 / 6;
        int64_t h = c.in_h, w = c.in_w;
        KPL_TRY_GOTO(add_conv(m, c.in_channels, c1, 5, 1, 2, "conv1", NULL, 1, h, w));
        h /= 2, w /= 2;
        KPL_TRY_GOTO(add_conv(m, c1, c2, 5, 1, 0, "conv2", NULL, 1, h - 4, w - 4));
        h = (h - 4) / 2, w = (w - 4) / 2;
        KPL_TRY_GOTO(add_linear(m, c2 * h * w, 120, "fc1"));
        KPL_TRY_GOTO(add_linear(m, 120, 84, "fc2"));
        KPL_TRY_GOTO(add_linear(m, 84, c.num_classes, "fc3"));
        break;
    }
    case KPL_MODEL_CNN:
        snprintf(m->name, sizeof m->name, "cnn");
        KPL_TRY_GOTO(build_cnn(m));
        break;
    case KPL_MODEL_RESNET:
        snprintf(m->name, sizeof m->name, "resnet%lld%s", (long long)c.depth,
                 c.cifar_stem ? "_cifar" : "");
        KPL_TRY_GOTO(build_resnet(m));
        break;
    }
    *out = m;
    return KPL_OK;
fail:
    kpl_model_destroy(m);
    return st;
}

kpl_status kpl_model_create(const char *name, int64_t num_classes, kpl_device *dev,
                            uint64_t seed, kpl_model **out)
{
    *out = NULL;
    KPL_CHECK(name, KPL_EINVAL, "model: need a name");
    kpl_model_config c;
    memset(&c, 0, sizeof c);
    c.num_classes = num_classes;
    c.in_channels = 1, c.in_h = c.in_w = 28;
    if (!strcmp(name, "mlp")) {
        c.arch = KPL_MODEL_MLP;
    } else if (!strcmp(name, "lenet")) {
        c.arch = KPL_MODEL_LENET;
    } else if (!strcmp(name, "cnn")) {
        c.arch = KPL_MODEL_CNN;
    } else if (!strcmp(name, "resnet18_cifar") || !strcmp(name, "resnet18") ||
               !strcmp(name, "resnet34") || !strcmp(name, "resnet50")) {
        c.arch = KPL_MODEL_RESNET;
        c.cifar_stem = !strcmp(name, "resnet18_cifar");
        c.depth = atoi(name + 6);
        c.in_channels = 3;
        c.in_h = c.in_w = c.cifar_stem ? 32 : 224;
    } else {
        return KPL_ERROR(KPL_EINVAL,
                         "model: unknown model '%s' (known: mlp, lenet, cnn, resnet18_cifar, "
                         "resnet18, resnet34, resnet50)",
                         name);
    }
    KPL_TRY(kpl_model_create_config(&c, dev, seed, out));
    /* keep the name the caller used ("resnet18_cifar") */
    snprintf((*out)->name, sizeof (*out)->name, "%s", name);
    return KPL_OK;
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
    if (!m->cfg.cifar_stem) {
        kpl_pool2d_params mp = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
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

/* The linear layers from `first` on, ReLU between them and dropout
 * before the last. */
static kpl_tensor *head(kpl_model *m, kpl_tensor *h, int first, bool training)
{
    for (int i = first; i < m->nl; i++) {
        if (i + 1 == m->nl && m->cfg.dropout > 0)
            h = kpl_dropout(h, m->cfg.dropout, training, m->rng);
        h = kpl_linear(h, m->l[i].w, m->l[i].b);
        if (i + 1 < m->nl) h = kpl_relu(h);
    }
    return h;
}

kpl_tensor *kpl_model_forward(kpl_model *m, kpl_tensor *x, bool training)
{
    if (!x) return NULL;
    const int64_t *s = kpl_tensor_shape(x);
    if (kpl_tensor_ndim(x) != 4 || s[1] != m->cfg.in_channels ||
        (m->cfg.arch != KPL_MODEL_RESNET && (s[2] != m->cfg.in_h || s[3] != m->cfg.in_w))) {
        char got[96];
        kpl_shape_str(kpl_tensor_ndim(x), s, got, sizeof got);
        KPL_ERROR(KPL_ESHAPE, "model %s: input %s, expected (N, %lld, %lld, %lld)", m->name, got,
                  (long long)m->cfg.in_channels, (long long)m->cfg.in_h, (long long)m->cfg.in_w);
        return NULL;
    }
    kpl_pool2d_params pool2 = {.kernel = {2, 2}, .stride = {2, 2}};
    switch (m->cfg.arch) {
    case KPL_MODEL_MLP: return head(m, flatten(x), 0, training);
    /* ReLU then max-pool is max-pool then ReLU (ReLU is monotonic), and
     * the second order runs ReLU and its gradient on a quarter of the
     * elements.  The gradients agree too, but for windows whose maximum
     * ties, where both orders pass the gradient to one of the tied
     * elements. */
    case KPL_MODEL_LENET: {
        kpl_tensor *h = kpl_relu(kpl_max_pool2d(conv(&m->l[0], x, training, false), &pool2));
        h = flatten(kpl_relu(kpl_max_pool2d(conv(&m->l[1], h, training, false), &pool2)));
        return head(m, h, 2, training);
    }
    case KPL_MODEL_CNN: {
        kpl_tensor *h = x;
        int k = 0;
        for (; k < m->nl && m->l[k].g; k++)
            h = kpl_relu(kpl_max_pool2d(conv(&m->l[k], h, training, false), &pool2));
        return head(m, flatten(h), k, training);
    }
    case KPL_MODEL_RESNET: return resnet_forward(m, x, training);
    }
    return NULL;
}

const char *kpl_model_param_name(const kpl_model *m, int i) { return m->pname[i]; }
const char *kpl_model_buffer_name(const kpl_model *m, int i) { return m->bname[i]; }
bool kpl_model_param_is_bias_or_norm(const kpl_model *m, int i) { return m->pnodecay[i]; }
kpl_rng *kpl_model_rng(kpl_model *m) { return m->rng; }

void kpl_model_input_shape(const kpl_model *m, int64_t *chw)
{
    chw[0] = m->cfg.in_channels, chw[1] = m->cfg.in_h, chw[2] = m->cfg.in_w;
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
