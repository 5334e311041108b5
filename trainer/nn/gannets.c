/*
 * gannets.c — the zoo's GAN networks, each a generator and its
 * discriminator that read one key table (model.<name>.<key>, the gan task
 * building "<name>" and "<name>_d" from one kpl_model_config):
 *
 *   dcgan, dcgan_d   DCGAN (Radford et al. 2016), as pytorch/examples'
 *                    dcgan names and initialises it, for any square side
 *                    s0 x 2^k (s0 in 4..7, k >= 1);
 *   sngan, sngan_d   the CIFAR-10 ResNets of SN-GAN (Miyato et al. 2018,
 *                    Table 4), as w86763777/pytorch-gan-collections
 *                    (source/models/sngan.py) builds them; without
 *                    spectral norm, the WGAN-GP ResNet critic.
 *
 * A generator maps z (N, latent_dim) to images (N, C, H, W) in [-1, 1]
 * (tanh); a discriminator maps images to raw scores (N, 1).  C, H, W are
 * the config's in_channels, in_h, in_w; num_classes is not read.
 * docs/gan-nets.md has the layer tables and where kpl departs from the
 * references.
 */
#include "nn_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* torch.nn.utils.spectral_norm's defaults */
#define SN_ITERS 1
#define SN_EPS 1e-12

static kpl_status create_node(kpl_module *parent, const char *child, kpl_device *dev,
                              uint64_t seed, const kpl_module_kind *kind, void *state,
                              size_t size, kpl_module **out)
{
    void *s = NULL;
    if (size) {
        s = malloc(size);
        KPL_CHECK(s, KPL_ENOMEM, "model %s: out of memory", kind->name);
        memcpy(s, state, size);
    }
    if (parent) return kpl_module_create(parent, child, kind, s, out);
    return kpl_module_create_root(dev, seed, kind, s, out);
}

/* "0", "1", ...: the next child name of a sequential. */
static const char *next_name(kpl_module *seq, char buf[12])
{
    snprintf(buf, 12, "%d", kpl_module_num_children(seq));
    return buf;
}

/* Spectral norm on every conv2d, conv_transpose2d and linear module under m. */
static kpl_status spectral_all(kpl_module *m)
{
    const char *k = kpl_module_kind_of(m)->name;
    if (!strcmp(k, "conv2d") || !strcmp(k, "conv_transpose2d") || !strcmp(k, "linear"))
        return kpl_nn_spectral_norm(m, SN_ITERS, SN_EPS);
    for (int i = 0; i < kpl_module_num_children(m); i++)
        KPL_TRY(spectral_all(kpl_module_child(m, i)));
    return KPL_OK;
}

/* ---- DCGAN ------------------------------------------------------------------------------------ */

static const kpl_key dcgan_keys[] = {
    {"latent_dim", KPL_KEY_INT, "100", 1, 65536, NULL, "the generator's input z (N, latent_dim)"},
    {"g_norm", KPL_KEY_CHOICE, "batch", 0, 0, "batch|none",
     "the generator's norm after each transposed convolution but the last"},
    {"d_norm", KPL_KEY_CHOICE, "batch", 0, 0, "batch|instance|layer|none",
     "the discriminator's norm after each stride-2 convolution but the first (WGAN-GP critics: "
     "not batch)"},
    {"spectral_norm", KPL_KEY_BOOL, "false", 0, 0, NULL,
     "spectral normalisation of every discriminator layer"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};

typedef enum { NORM_NONE, NORM_BATCH, NORM_INSTANCE, NORM_LAYER } gan_norm;

/* What a forward checks its input against: z (N, latent) for a
 * generator, images (N, c, h, w) for a discriminator; SN-GAN's generator
 * also views its first map as (N, width, bottom, bottom). */
typedef struct {
    int64_t latent, width, bottom, c, h, w;
} gan_state;

/* in's one tensor when it is a (N, latent) batch, else NULL with the error */
static kpl_tensor *latent_input(const kpl_module *m, const kpl_tensor_list *in)
{
    const gan_state *s = kpl_module_state(m);
    kpl_tensor *z = in->t[0];
    if (in->n == 1 && kpl_tensor_ndim(z) == 2 && kpl_tensor_dim(z, 1) == s->latent) return z;
    KPL_ERROR(KPL_ESHAPE, "%s: wants one (N, %lld) latent batch", kpl_module_kind_of(m)->name,
              (long long)s->latent);
    return NULL;
}

/* in's one tensor when it is a (N, c, h, w) batch, else NULL with the error */
static kpl_tensor *image_input(const kpl_module *m, const kpl_tensor_list *in)
{
    const gan_state *s = kpl_module_state(m);
    kpl_tensor *x = in->t[0];
    if (in->n == 1 && kpl_tensor_ndim(x) == 4 && kpl_tensor_dim(x, 1) == s->c &&
        kpl_tensor_dim(x, 2) == s->h && kpl_tensor_dim(x, 3) == s->w)
        return x;
    KPL_ERROR(KPL_ESHAPE, "%s: wants one (N, %lld, %lld, %lld) image batch",
              kpl_module_kind_of(m)->name, (long long)s->c, (long long)s->h, (long long)s->w);
    return NULL;
}

static kpl_status one_output(kpl_tensor_list *out, kpl_tensor *y)
{
    out->n = 1;
    out->t[0] = y;
    return y ? KPL_OK : kpl_last_status();
}

/* side = s0 x 2^k with s0 in 4..7 and k >= 1: the first feature map's
 * side and the count of stride-2 layers. */
static kpl_status dcgan_side(const kpl_model_config *c, const char *who, int *s0, int *k)
{
    KPL_CHECK(c->in_h == c->in_w, KPL_EINVAL, "model %s: needs square images (got %lldx%lld)",
              who, (long long)c->in_h, (long long)c->in_w);
    KPL_CHECK(c->in_h <= 4096, KPL_EINVAL, "model %s: side %lld is larger than 4096", who,
              (long long)c->in_h);
    int64_t s = c->in_h;
    int n = 0;
    while (s > 7 && s % 2 == 0) s /= 2, n++;
    KPL_CHECK(n >= 1 && s >= 4 && s <= 7, KPL_EINVAL,
              "model %s: the side %lld is not s0 x 2^k with s0 in 4..7 and k >= 1 (28, 32, 48, "
              "64 are)", who, (long long)c->in_h);
    *s0 = (int)s, *k = n;
    return KPL_OK;
}

static kpl_status dcgan_norm(const kpl_model_config *c, const char *key, gan_norm *out)
{
    const char *v = NULL;
    KPL_TRY(kpl_key_string(&c->keys, key, &v));
    *out = !strcmp(v, "batch") ? NORM_BATCH : !strcmp(v, "instance") ? NORM_INSTANCE
           : !strcmp(v, "layer") ? NORM_LAYER : NORM_NONE;
    return KPL_OK;
}

/* A convolution (or transposed one) N(0, 0.02) with a zero bias unless a
 * norm follows it, then that norm: batch norm's scale N(1, 0.02) and shift
 * 0 (pytorch/examples' weights_init), instance norm affine, layer norm as
 * GroupNorm(1, C) (a per-channel scale and shift, as the WGAN-GP code's
 * layer norm over C, H, W). */
static kpl_status dcgan_conv(kpl_module *seq, bool transposed, int64_t in, int64_t out, int k,
                             int stride, int pad, gan_norm norm)
{
    char name[12];
    kpl_nn_conv c = {KPL_NN_CONV_INIT(in, out, k), .stride = {stride, stride},
                     .padding = {pad, pad}, .no_bias = norm != NORM_NONE};
    kpl_module *conv = NULL, *n = NULL;
    if (transposed) KPL_TRY(kpl_nn_conv_transpose2d(seq, next_name(seq, name), &c, &conv));
    else KPL_TRY(kpl_nn_conv2d(seq, next_name(seq, name), &c, &conv));
    kpl_rng *rng = kpl_module_rng(seq);
    KPL_TRY(kpl_k_normal(kpl_module_get_param(conv, "weight"), rng, 0, 0.02));
    if (norm == NORM_NONE) return kpl_k_fill(kpl_module_get_param(conv, "bias"), 0);
    next_name(seq, name);
    switch (norm) {
    case NORM_BATCH:
        KPL_TRY(kpl_nn_batch_norm(seq, name, out, 0.1, 1e-5, &n));
        return kpl_k_normal(kpl_module_get_param(n, "weight"), rng, 1, 0.02);
    case NORM_INSTANCE: return kpl_nn_instance_norm(seq, name, out, true, 1e-5, NULL);
    case NORM_LAYER: return kpl_nn_group_norm(seq, name, 1, out, 1e-5, NULL);
    case NORM_NONE: break;
    }
    return KPL_OK;
}

/* z (N, latent) -> main(z as (N, latent, 1, 1)) */
static kpl_status dcgan_g_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    kpl_tensor *z = latent_input(m, in);
    if (!z) return kpl_last_status();
    int64_t shape[4] = {kpl_tensor_dim(z, 0), kpl_tensor_dim(z, 1), 1, 1};
    return one_output(out, kpl_module_forward(kpl_module_find(m, "main"), kpl_reshape(z, 4, shape)));
}

/* x (N, C, H, W) -> main(x) (N, 1, 1, 1) as (N, 1) */
static kpl_status dcgan_d_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    kpl_tensor *x = image_input(m, in);
    if (!x) return kpl_last_status();
    int64_t shape[2] = {kpl_tensor_dim(x, 0), 1};
    return one_output(out, kpl_reshape(kpl_module_forward(kpl_module_find(m, "main"), x), 2, shape));
}

static const kpl_module_kind dcgan_g_kind = {"dcgan", dcgan_g_forward, free, KPL_MODULE_REPLAYABLE};
static const kpl_module_kind dcgan_d_kind = {"dcgan_d", dcgan_d_forward, free,
                                             KPL_MODULE_REPLAYABLE};

/* The base width (model.width, 64) and its widest stage, width << (k - 1). */
static kpl_status dcgan_width(const kpl_model_config *c, const char *who, int k, int64_t *w)
{
    *w = c->width ? c->width : 64;
    KPL_CHECK(*w >= 1 && (*w << (k - 1)) <= 65536, KPL_EINVAL,
              "model %s: width %lld x 2^%d channels out of range", who, (long long)*w, k - 1);
    return KPL_OK;
}

/* G: conv_transpose (latent -> w 2^(k-1), kernel s0) to s0 x s0, then k
 * conv_transpose 4x4/2 halving the channels, the last to C; norm + ReLU
 * between, tanh at the end. */
static kpl_status dcgan_create(kpl_module *parent, const char *child, const kpl_model_config *cfg,
                               kpl_device *dev, uint64_t seed, kpl_module **out)
{
    int s0 = 0, k = 0;
    int64_t latent, w;
    gan_norm norm;
    KPL_TRY(dcgan_side(cfg, "dcgan", &s0, &k));
    KPL_TRY(dcgan_width(cfg, "dcgan", k, &w));
    KPL_TRY(kpl_key_int(&cfg->keys, "latent_dim", &latent));
    KPL_TRY(dcgan_norm(cfg, "g_norm", &norm));
    gan_state st = {.latent = latent, .c = cfg->in_channels, .h = cfg->in_h, .w = cfg->in_w};
    kpl_module *m = NULL, *main = NULL;
    KPL_TRY(create_node(parent, child, dev, seed, &dcgan_g_kind, &st, sizeof st, &m));
    *out = m; /* a root is the caller's to destroy, also on failure */
    KPL_TRY(kpl_nn_sequential(m, "main", &main));
    char name[12];
    int64_t ch = w << (k - 1);
    KPL_TRY(dcgan_conv(main, true, latent, ch, s0, 1, 0, norm));
    KPL_TRY(kpl_nn_relu(main, next_name(main, name), NULL));
    for (int i = 1; i <= k; i++) {
        bool last = i == k;
        KPL_TRY(dcgan_conv(main, true, ch, last ? cfg->in_channels : ch / 2, 4, 2, 1,
                           last ? NORM_NONE : norm));
        if (last)
            KPL_TRY(kpl_nn_activation(main, next_name(main, name), KPL_NN_TANH, 0, NULL));
        else
            KPL_TRY(kpl_nn_relu(main, next_name(main, name), NULL));
        ch /= 2;
    }
    return KPL_OK;
}

/* D: k conv 4x4/2 from C to w, 2w, ... w 2^(k-1) with LeakyReLU 0.2 (no
 * norm on the first), then a conv of kernel s0 to one score. */
static kpl_status dcgan_d_create(kpl_module *parent, const char *child,
                                 const kpl_model_config *cfg, kpl_device *dev, uint64_t seed,
                                 kpl_module **out)
{
    int s0 = 0, k = 0;
    int64_t w;
    gan_norm norm;
    bool sn;
    KPL_TRY(dcgan_side(cfg, "dcgan_d", &s0, &k));
    KPL_TRY(dcgan_width(cfg, "dcgan_d", k, &w));
    KPL_TRY(dcgan_norm(cfg, "d_norm", &norm));
    KPL_TRY(kpl_key_bool(&cfg->keys, "spectral_norm", &sn));
    gan_state st = {.c = cfg->in_channels, .h = cfg->in_h, .w = cfg->in_w};
    kpl_module *m = NULL, *main = NULL;
    KPL_TRY(create_node(parent, child, dev, seed, &dcgan_d_kind, &st, sizeof st, &m));
    *out = m;
    KPL_TRY(kpl_nn_sequential(m, "main", &main));
    char name[12];
    int64_t in = cfg->in_channels;
    for (int i = 0; i < k; i++) {
        int64_t o = w << i;
        KPL_TRY(dcgan_conv(main, false, in, o, 4, 2, 1, i ? norm : NORM_NONE));
        KPL_TRY(kpl_nn_activation(main, next_name(main, name), KPL_NN_LEAKY_RELU, 0.2, NULL));
        in = o;
    }
    KPL_TRY(dcgan_conv(main, false, in, 1, s0, 1, 0, NORM_NONE));
    return sn ? spectral_all(main) : KPL_OK;
}

const kpl_zoo_model kpl__zoo_dcgan = {
    .name = "dcgan",
    .doc = "DCGAN's generator (Radford et al. 2016): z (N, latent_dim) -> (N, C, H, W) in [-1, 1] "
           "for H = W = s0 x 2^k, s0 in 4..7; width: the last hidden layer's channels (64)",
    .create = dcgan_create,
    .keys = dcgan_keys,
};

const kpl_zoo_model kpl__zoo_dcgan_d = {
    .name = "dcgan_d",
    .doc = "DCGAN's discriminator: (N, C, H, W) -> scores (N, 1); model.dcgan's keys",
    .create = dcgan_d_create,
    .keys = dcgan_keys,
};

/* ---- SN-GAN's ResNets ------------------------------------------------------------------------- */

static const kpl_key sngan_keys[] = {
    {"latent_dim", KPL_KEY_INT, "128", 1, 65536, NULL, "the generator's input z (N, latent_dim)"},
    {"g_width", KPL_KEY_INT, "256", 1, 4096, NULL, "the generator's channels"},
    {"d_width", KPL_KEY_INT, "128", 1, 4096, NULL, "the discriminator's channels"},
    {"spectral_norm", KPL_KEY_BOOL, "true", 0, 0, NULL,
     "spectral normalisation of every discriminator layer (false: the WGAN-GP ResNet critic)"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};

/* residual(x) + shortcut(x); an empty shortcut is the identity */
static kpl_status resblock_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    KPL_CHECK(in->n == 1, KPL_EINVAL, "gan_resblock takes one input, got %d", in->n);
    /* A pool per block, as the zoo's ResNets: what the gradients do not
     * keep dies at the block's end. */
    kpl_pool *p = kpl_pool_push();
    if (!p) return kpl_last_status();
    kpl_tensor *x = in->t[0];
    kpl_tensor *y = kpl_add(kpl_module_forward(kpl_module_find(m, "residual"), x),
                            kpl_module_forward(kpl_module_find(m, "shortcut"), x));
    if (y) kpl_tensor_retain(y);
    kpl_pool_pop(p);
    out->n = 1;
    out->t[0] = kpl_autorelease(y);
    return y ? KPL_OK : kpl_last_status();
}

static const kpl_module_kind resblock_kind = {"gan_resblock", resblock_forward, NULL,
                                              KPL_MODULE_REPLAYABLE};

/* xavier_uniform_(weight, gain) and a zero bias: U(-b, b), b = gain
 * sqrt(6 / (fan_in + fan_out)), fans as PyTorch counts them. */
static kpl_status xavier(kpl_module *layer, double gain)
{
    kpl_tensor *w = kpl_module_get_param(layer, "weight"), *b = kpl_module_get_param(layer, "bias");
    const int64_t *s = kpl_tensor_shape(w);
    int64_t field = kpl_tensor_numel(w) / (s[0] * s[1]);
    double bound = gain * sqrt(6.0 / (double)((s[0] + s[1]) * field));
    KPL_TRY(kpl_k_uniform(w, kpl_module_rng(layer), -bound, bound));
    return b ? kpl_k_fill(b, 0) : KPL_OK;
}

static kpl_status sn_conv(kpl_module *seq, int64_t in, int64_t out, int k, double gain)
{
    char name[12];
    kpl_nn_conv c = {KPL_NN_CONV_INIT(in, out, k), .padding = {k / 2, k / 2}};
    kpl_module *conv = NULL;
    KPL_TRY(kpl_nn_conv2d(seq, next_name(seq, name), &c, &conv));
    return xavier(conv, gain);
}

static kpl_status add_layer(kpl_module *seq, int what)
{
    char name[12];
    kpl_pool2d_params p2 = {.kernel = {2, 2}, .stride = {2, 2}};
    next_name(seq, name);
    switch (what) {
    case 'r': return kpl_nn_relu(seq, name, NULL);
    case 'u': return kpl_nn_upsample(seq, name, 2, false, NULL);
    case 'p': return kpl_nn_avg_pool2d(seq, name, &p2, NULL);
    }
    return KPL_OK;
}

/* A block: children residual and shortcut, sequentials. */
static kpl_status resblock(kpl_module *seq, kpl_module **res, kpl_module **sc)
{
    char name[12];
    kpl_module *b = NULL;
    KPL_TRY(kpl_module_create(seq, next_name(seq, name), &resblock_kind, NULL, &b));
    kpl_module_mark_recompute_unit(b); /* memory.recompute: blocks */
    KPL_TRY(kpl_nn_sequential(b, "residual", res));
    return kpl_nn_sequential(b, "shortcut", sc);
}

static const double SQRT2 = 1.4142135623730951;

/* the generator's up block: BN, ReLU, up, conv3x3, BN, ReLU, conv3x3;
 * shortcut up, conv1x1 */
static kpl_status g_block(kpl_module *seq, int64_t ch)
{
    kpl_module *r = NULL, *s = NULL;
    char name[12];
    KPL_TRY(resblock(seq, &r, &s));
    KPL_TRY(kpl_nn_batch_norm(r, next_name(r, name), ch, 0.1, 1e-5, NULL));
    KPL_TRY(add_layer(r, 'r'));
    KPL_TRY(add_layer(r, 'u'));
    KPL_TRY(sn_conv(r, ch, ch, 3, SQRT2));
    KPL_TRY(kpl_nn_batch_norm(r, next_name(r, name), ch, 0.1, 1e-5, NULL));
    KPL_TRY(add_layer(r, 'r'));
    KPL_TRY(sn_conv(r, ch, ch, 3, SQRT2));
    KPL_TRY(add_layer(s, 'u'));
    return sn_conv(s, ch, ch, 1, 1);
}

/* the discriminator's blocks: optimized (the first: conv3x3, ReLU,
 * conv3x3, pool; shortcut pool, conv1x1), down (ReLU, conv3x3, ReLU,
 * conv3x3, pool; shortcut conv1x1, pool), plain (no pools; the identity
 * as shortcut when in == out) */
typedef enum { D_OPTIMIZED, D_DOWN, D_PLAIN } d_block_kind;

static kpl_status d_block(kpl_module *seq, int64_t in, int64_t out, d_block_kind kind)
{
    kpl_module *r = NULL, *s = NULL;
    KPL_TRY(resblock(seq, &r, &s));
    if (kind != D_OPTIMIZED) KPL_TRY(add_layer(r, 'r'));
    KPL_TRY(sn_conv(r, in, out, 3, SQRT2));
    KPL_TRY(add_layer(r, 'r'));
    KPL_TRY(sn_conv(r, out, out, 3, SQRT2));
    if (kind != D_PLAIN) KPL_TRY(add_layer(r, 'p'));
    if (kind == D_OPTIMIZED) KPL_TRY(add_layer(s, 'p'));
    if (kind != D_PLAIN || in != out) KPL_TRY(sn_conv(s, in, out, 1, 1));
    return kind == D_DOWN ? add_layer(s, 'p') : KPL_OK;
}

static kpl_status sngan_g_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    const gan_state *s = kpl_module_state(m);
    kpl_tensor *z = latent_input(m, in);
    if (!z) return kpl_last_status();
    int64_t shape[4] = {kpl_tensor_dim(z, 0), s->width, s->bottom, s->bottom};
    kpl_tensor *h = kpl_reshape(kpl_module_forward(kpl_module_find(m, "linear"), z), 4, shape);
    h = kpl_module_forward(kpl_module_find(m, "blocks"), h);
    return one_output(out, kpl_module_forward(kpl_module_find(m, "output"), h));
}

/* blocks and ReLU, global sum pooling, linear */
static kpl_status sngan_d_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    kpl_tensor *x = image_input(m, in);
    if (!x) return kpl_last_status();
    kpl_tensor *h = kpl_sum(kpl_module_forward(kpl_module_find(m, "model"), x), (int[]){2, 3}, 2,
                            false);
    return one_output(out, kpl_module_forward(kpl_module_find(m, "linear"), h));
}

static const kpl_module_kind sngan_g_kind = {"sngan", sngan_g_forward, free, KPL_MODULE_REPLAYABLE};
static const kpl_module_kind sngan_d_kind = {"sngan_d", sngan_d_forward, free,
                                             KPL_MODULE_REPLAYABLE};

/* H = W = 8 b with b in 4..8: the paper's b is 4 (CIFAR-10, 32 x 32); a
 * larger b makes the same networks for 40 .. 64 (not the paper's STL-10
 * ones). */
static kpl_status sngan_sizes(const kpl_model_config *c, const char *who, gan_state *s)
{
    KPL_CHECK(c->in_h == c->in_w && c->in_h % 8 == 0 && c->in_h >= 32 && c->in_h <= 64,
              KPL_EINVAL, "model %s: needs square images of side 32, 40, 48, 56 or 64 (got "
              "%lldx%lld)", who, (long long)c->in_h, (long long)c->in_w);
    memset(s, 0, sizeof *s);
    s->bottom = c->in_h / 8, s->c = c->in_channels, s->h = c->in_h, s->w = c->in_w;
    return KPL_OK;
}

/* linear (latent -> b b g_width), 3 up blocks, BN, ReLU, conv3x3 to C, tanh */
static kpl_status sngan_create(kpl_module *parent, const char *child, const kpl_model_config *cfg,
                               kpl_device *dev, uint64_t seed, kpl_module **out)
{
    gan_state st;
    KPL_TRY(sngan_sizes(cfg, "sngan", &st));
    KPL_TRY(kpl_key_int(&cfg->keys, "latent_dim", &st.latent));
    KPL_TRY(kpl_key_int(&cfg->keys, "g_width", &st.width));
    kpl_module *m = NULL, *lin = NULL, *blocks = NULL, *o = NULL;
    KPL_TRY(create_node(parent, child, dev, seed, &sngan_g_kind, &st, sizeof st, &m));
    *out = m;
    int64_t ch = st.width;
    KPL_TRY(kpl_nn_linear(m, "linear", st.latent, st.bottom * st.bottom * ch, true, &lin));
    KPL_TRY(xavier(lin, 1));
    KPL_TRY(kpl_nn_sequential(m, "blocks", &blocks));
    for (int i = 0; i < 3; i++) KPL_TRY(g_block(blocks, ch));
    KPL_TRY(kpl_nn_sequential(m, "output", &o));
    KPL_TRY(kpl_nn_batch_norm(o, "0", ch, 0.1, 1e-5, NULL));
    KPL_TRY(kpl_nn_relu(o, "1", NULL));
    KPL_TRY(sn_conv(o, ch, cfg->in_channels, 3, 1));
    return kpl_nn_activation(o, "3", KPL_NN_TANH, 0, NULL);
}

/* optimized block, down block, 2 plain blocks, ReLU; global sum; linear
 * (no bias) to one score */
static kpl_status sngan_d_create(kpl_module *parent, const char *child,
                                 const kpl_model_config *cfg, kpl_device *dev, uint64_t seed,
                                 kpl_module **out)
{
    gan_state st;
    bool sn;
    KPL_TRY(sngan_sizes(cfg, "sngan_d", &st));
    KPL_TRY(kpl_key_int(&cfg->keys, "d_width", &st.width));
    KPL_TRY(kpl_key_bool(&cfg->keys, "spectral_norm", &sn));
    kpl_module *m = NULL, *model = NULL, *lin = NULL;
    KPL_TRY(create_node(parent, child, dev, seed, &sngan_d_kind, &st, sizeof st, &m));
    *out = m;
    int64_t ch = st.width;
    KPL_TRY(kpl_nn_sequential(m, "model", &model));
    KPL_TRY(d_block(model, cfg->in_channels, ch, D_OPTIMIZED));
    KPL_TRY(d_block(model, ch, ch, D_DOWN));
    KPL_TRY(d_block(model, ch, ch, D_PLAIN));
    KPL_TRY(d_block(model, ch, ch, D_PLAIN));
    KPL_TRY(add_layer(model, 'r'));
    KPL_TRY(kpl_nn_linear(m, "linear", ch, 1, false, &lin));
    KPL_TRY(xavier(lin, 1));
    return sn ? spectral_all(m) : KPL_OK;
}

const kpl_zoo_model kpl__zoo_sngan = {
    .name = "sngan",
    .doc = "SN-GAN's CIFAR-10 ResNet generator (Miyato et al. 2018): z (N, latent_dim) -> "
           "(N, C, H, W) in [-1, 1], H = W = 32 (40 .. 64 by a larger first map)",
    .create = sngan_create,
    .keys = sngan_keys,
};

const kpl_zoo_model kpl__zoo_sngan_d = {
    .name = "sngan_d",
    .doc = "SN-GAN's CIFAR-10 ResNet discriminator: (N, C, H, W) -> scores (N, 1); "
           "model.sngan's keys",
    .create = sngan_d_create,
    .keys = sngan_keys,
};
