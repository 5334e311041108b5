/*
 * gan.c — the GAN task: a generator (model.name, a zoo model whose forward
 * maps latents (N, latent_dim) to images in [-1, 1]) and a discriminator
 * (task.gan.discriminator, by default "<model.name>_d", scores (N, 1)),
 * each with its own optimizer, learning rate (the recipe's schedule scales
 * both) and DDP, trained in turn (docs/gan.md):
 *
 *   every training batch:   one discriminator step on real images and a
 *                           batch of generated ones (detached)
 *   every n_critic batches: one generator step on a fresh batch of latents
 *
 * Losses: non-saturating (DCGAN's BCE), hinge (SNGAN) or Wasserstein, plus
 * a gradient penalty on interpolates (WGAN-GP, through a double backward)
 * and an R1 penalty on real images.  An exponential moving average of the
 * generator's weights makes the evaluation's samples.  Latents and the
 * penalty's mixing weights come from a Philox generator every rank draws
 * the whole global batch from (each taking its own rows), so a run is the
 * same for any number of ranks and resumes exactly.  Evaluation: FID and
 * Inception Score with a feature network (fid.h), a sample grid of fixed
 * latents as PNG and in TensorBoard.
 */
#include "trainer.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum { LOSS_NS, LOSS_HINGE, LOSS_WGAN };
enum { G, D }; /* the models' numbers in the trainer */

typedef struct {
    int loss;
    int64_t n_critic, latent, batch; /* batch: the loader's per-rank batch size */
    double gp_weight, r1_weight, ema_decay;
    kpl_rng *zrng;          /* latents and mixing weights, the same on every rank */
    int64_t counts[2];      /* discriminator steps, generator steps */
    kpl_tensor *state;      /* (4) i64 for checkpoints: zrng's seed, offset; counts */
    kpl_module *ema;        /* the generator's average (no optimizer), or NULL */
    /* evaluation */
    kpl_feature_net *fnet;  /* NULL: no FID */
    kpl_fid_stats *real, *fake;
    bool real_done;         /* the real statistics are the same every evaluation */
    int64_t fid_samples, is_splits;
    int64_t grid[2];        /* rows, columns */
    kpl_tensor *grid_z;     /* (rows x columns, latent) */
    uint8_t *grid_px;       /* the last grid, RGB */
    int grid_h, grid_w;
    double sums[3];         /* D(real) sum, D(real) count, nonfinite */
} gan;

static void destroy(void *state)
{
    gan *s = state;
    if (!s) return;
    kpl_rng_destroy(s->zrng);
    kpl_tensor_release(s->state);
    kpl_tensor_release(s->grid_z);
    kpl_module_destroy(s->ema);
    kpl_feature_net_destroy(s->fnet);
    kpl_fid_stats_destroy(s->real);
    kpl_fid_stats_destroy(s->fake);
    free(s->grid_px);
    free(s);
}

/* task.gan.<key> */
static const kpl_key keys[] = {
    {"loss", KPL_KEY_CHOICE, "ns", 0, 0, "ns|hinge|wgan",
     "non-saturating (DCGAN's BCE), hinge (SNGAN) or Wasserstein (with gp_weight: WGAN-GP)"},
    {"n_critic", KPL_KEY_INT, "1", 1, 100, NULL,
     "discriminator steps (training batches) per generator step"},
    {"gp_weight", KPL_KEY_FLOAT, "0", 0, 1e6, NULL,
     "gradient penalty (|grad D(x_hat)| - 1)^2 on interpolates of real and generated images "
     "(WGAN-GP: 10; 0: none)"},
    {"r1_weight", KPL_KEY_FLOAT, "0", 0, 1e6, NULL,
     "R1 penalty gamma/2 |grad D(x)|^2 on real images (0: none)"},
    {"discriminator", KPL_KEY_STRING, "\"\"", 0, 0, NULL,
     "the discriminator's zoo model (\"\": <model.name>_d), built from the same model section"},
    {"d_lr", KPL_KEY_FLOAT, "0", 0, 100, NULL,
     "the discriminator's learning rate (0: optimizer.lr); the schedule scales it as the "
     "generator's"},
    {"d_betas", KPL_KEY_FLOATS, "[]", 0, 0.9999999, NULL,
     "the discriminator's Adam betas ([]: optimizer.betas)"},
    {"ema", KPL_KEY_FLOAT, "0.999", 0, 0.9999999, NULL,
     "decay of the generator's moving average used for evaluation and samples, warmed up as "
     "min(ema, (1 + n) / (10 + n)) after n generator steps (0: the generator itself)"},
    {"fid_network", KPL_KEY_STRING, "\"data/fid/fmnist_cnn.kpl\"", 0, 0, NULL,
     "the feature network's checkpoint for FID and Inception Score, made beforehand by kpl "
     "data fid-net (a missing file ends the run at its start, naming the command; \"\": no "
     "FID)"},
    {"fid_recipe", KPL_KEY_STRING, "\"recipes/fashion_mnist/cnn.yaml\"", 0, 0, NULL,
     "the recipe of the feature network (its model and validation transform)"},
    {"fid_samples", KPL_KEY_INT, "10000", 2, 1000000, NULL,
     "generated images per evaluation for FID and IS (the real ones: the validation split)"},
    {"is_splits", KPL_KEY_INT, "10", 1, 1000, NULL, "Inception Score: mean and std over splits"},
    {"grid", KPL_KEY_INTS, "[8, 8]", 1, 64, NULL,
     "the sample grid's [rows, columns] (fixed latents; PNG in the run directory and "
     "TensorBoard)"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};
static const char *const needs[] = {"model.name", NULL};

/* ---- set-up ------------------------------------------------------------------------------------ */

/* The rules joining the task's keys with each other and the model's, as
 * the recipe loads (task.h's check) and again at create for a recipe made
 * by hand. */
static kpl_status check(const kpl_recipe *r, const kpl_keyvals *kv, const char **key)
{
    int64_t grid[4], samples = 0, splits = 0;
    double betas[4];
    int n = 0;
    const kpl_zoo_model *g = kpl_zoo_find(r->model.name);
    bool latent = false;
    for (const kpl_key *k = g ? g->keys : NULL; k && k->name; k++)
        latent |= !strcmp(k->name, "latent_dim");
    *key = "model.name";
    KPL_CHECK(latent, KPL_EINVAL, "the gan task's generator '%s' declares no latent_dim key "
              "(model.%s.latent_dim: the size of its input); use dcgan or sngan, or declare it",
              r->model.name, r->model.name);
    *key = "task.gan.grid";
    KPL_TRY(kpl_key_ints(kv, "grid", grid, 4, &n));
    KPL_CHECK(n == 2, KPL_EINVAL, "want [rows, columns], got %d values", n);
    *key = "task.gan.d_betas";
    KPL_TRY(kpl_key_floats(kv, "d_betas", betas, 4, &n));
    KPL_CHECK(n == 0 || n == 2, KPL_EINVAL, "want [] or [beta1, beta2], got %d values", n);
    const char *net = NULL, *dname = NULL;
    KPL_TRY(kpl_key_string(kv, "fid_network", &net));
    KPL_TRY(kpl_key_int(kv, "fid_samples", &samples));
    KPL_TRY(kpl_key_int(kv, "is_splits", &splits));
    *key = "task.gan.fid_samples";
    KPL_CHECK(!net[0] || samples >= splits, KPL_EINVAL, "%lld is fewer than task.gan.is_splits "
              "%lld (the Inception Score needs a sample per split at least)", (long long)samples,
              (long long)splits);
    *key = "task.gan.discriminator";
    KPL_TRY(kpl_key_string(kv, "discriminator", &dname));
    char d[64];
    if (dname[0]) snprintf(d, sizeof d, "%s", dname);
    else snprintf(d, sizeof d, "%.29s_d", r->model.name);
    KPL_CHECK(kpl_zoo_find(d), KPL_EINVAL, "no zoo model '%s' (the discriminator of model.name "
              "%s)", d, r->model.name);
    KPL_CHECK(strcmp(d, r->model.name), KPL_EINVAL, "'%s' is model.name, the generator: the "
              "discriminator is another model (%.29s_d, the default)", d, r->model.name);
    *key = NULL;
    return KPL_OK;
}

/* The discriminator run once on a batch of one zero image (eval mode, no
 * gradient): a model that does not map (1, C, H, W) images to one score
 * (a generator named as the discriminator) is refused at start-up, saying
 * so, instead of failing at the first step about latents. */
static kpl_status probe_discriminator(kpl_module *dm, const char *name, const int64_t *chw)
{
    int64_t shape[4] = {1, chw[0], chw[1], chw[2]}, out[KPL_MAX_DIMS], numel = 1;
    int nd = 0;
    kpl_status st = kpl_module_probe(dm, 4, shape, &nd, out);
    for (int i = 0; st >= 0 && i < nd; i++) numel *= out[i];
    if (st >= 0 && numel != 1)
        st = KPL_ERROR(KPL_ESHAPE, "gives %lld values for one image, not a score",
                       (long long)numel);
    if (st < 0)
        return kpl_error_prefix(st, "task.gan.discriminator: '%s' does not map a (1, %lld, %lld, "
                                 "%lld) image to a score (is it a generator?): ", name,
                                 (long long)chw[0], (long long)chw[1], (long long)chw[2]);
    return KPL_OK;
}

static kpl_status add_model(kpl_trainer *t, const kpl_model_config *mc, const char *name,
                            const kpl_optim_config *oc, kpl_module **out)
{
    kpl_module *m = NULL;
    KPL_TRY(kpl_zoo_create(mc, kpl_trainer_device(t), (uint64_t)kpl_trainer_recipe(t)->seed, &m));
    if (out) *out = m;
    return kpl_trainer_add_model(t, name, mc->name, m, oc, NULL);
}

/* The feature network's file is made by `kpl data fid-net`, never here: a
 * missing one ends the run at its start, before the models are built,
 * saying the command that makes it. */
static kpl_status fid_network_exists(const kpl_keyvals *kv)
{
    const char *net = NULL, *recipe = NULL;
    KPL_TRY(kpl_key_string(kv, "fid_network", &net));
    KPL_TRY(kpl_key_string(kv, "fid_recipe", &recipe));
    struct stat sb;
    KPL_CHECK(!net[0] || stat(net, &sb) == 0 || (errno != ENOENT && errno != ENOTDIR),
              KPL_ENOTFOUND,
              "task.gan.fid_network: %s does not exist: make it with 'kpl data fid-net "
              "--recipe %s -o %s' (or set task.gan.fid_network= to train without FID)", net,
              recipe, net);
    return KPL_OK;
}

static kpl_status setup_fid(kpl_trainer *t, gan *s, const kpl_keyvals *kv)
{
    const char *net = NULL, *recipe = NULL;
    KPL_TRY(kpl_key_string(kv, "fid_network", &net));
    KPL_TRY(kpl_key_string(kv, "fid_recipe", &recipe));
    KPL_TRY(kpl_key_int(kv, "fid_samples", &s->fid_samples));
    KPL_TRY(kpl_key_int(kv, "is_splits", &s->is_splits));
    if (!net[0]) return KPL_OK;
    kpl_status st = kpl_feature_net_create(recipe, net, kpl_trainer_device(t), &s->fnet);
    if (st < 0) return kpl_error_prefix(st, "task.gan.fid_network: ");
    int64_t dim = kpl_feature_net_dim(s->fnet);
    KPL_TRY(kpl_fid_stats_create(dim, &s->real));
    return kpl_fid_stats_create(dim, &s->fake);
}

/* The moving average set to the generator's tensors. */
static kpl_status ema_from(gan *s, kpl_module *g)
{
    for (int i = 0; i < kpl_module_num_params(g); i++)
        KPL_TRY(kpl_k_copy(kpl_module_params(s->ema)[i], kpl_module_params(g)[i]));
    for (int i = 0; i < kpl_module_num_buffers(g); i++)
        KPL_TRY(kpl_k_copy(kpl_module_buffers(s->ema)[i], kpl_module_buffers(g)[i]));
    return KPL_OK;
}

static kpl_status create(kpl_trainer *t, void **state)
{
    const kpl_recipe *r = kpl_trainer_recipe(t);
    const kpl_keyvals *kv = kpl_trainer_task_keys(t);
    const int64_t *chw = kpl_trainer_input_shape(t);
    gan *s = calloc(1, sizeof *s);
    KPL_CHECK(s, KPL_ENOMEM, "out of memory");
    *state = s;
    const char *loss = NULL, *dname = NULL;
    KPL_TRY(kpl_key_string(kv, "loss", &loss));
    s->loss = !strcmp(loss, "ns") ? LOSS_NS : !strcmp(loss, "hinge") ? LOSS_HINGE : LOSS_WGAN;
    KPL_TRY(kpl_key_int(kv, "n_critic", &s->n_critic));
    KPL_TRY(kpl_key_float(kv, "gp_weight", &s->gp_weight));
    KPL_TRY(kpl_key_float(kv, "r1_weight", &s->r1_weight));
    KPL_TRY(kpl_key_float(kv, "ema", &s->ema_decay));
    KPL_TRY(kpl_key_string(kv, "discriminator", &dname));
    const char *bad = NULL;
    kpl_status cst = check(r, kv, &bad);
    if (cst < 0) return bad ? kpl_error_prefix(cst, "%s: ", bad) : cst;
    KPL_TRY(fid_network_exists(kv));
    int n = 0;
    KPL_TRY(kpl_key_ints(kv, "grid", s->grid, 2, &n));
    KPL_CHECK(r->optimizer.accumulate == 1, KPL_EINVAL, "optimizer.accumulate %lld: the gan task's "
              "models step in turn, every batch (use a larger data.train.batch_size)",
              (long long)r->optimizer.accumulate);
    s->batch = r->data.train.loader.batch_size;

    /* the generator (model 0), then the discriminator from the same section */
    kpl_model_config mc = r->model;
    mc.in_channels = chw[0], mc.in_h = chw[1], mc.in_w = chw[2];
    KPL_CHECK(kpl_key_int(&mc.keys, "latent_dim", &s->latent) >= 0 && s->latent > 0,
              KPL_EINVAL, "model.name: the gan task's generator '%s' declares no latent_dim key "
              "(model.%s.latent_dim: the size of its input); use dcgan or sngan, or declare it",
              mc.name, mc.name);
    kpl_module *g = NULL;
    KPL_TRY(add_model(t, &mc, "generator", NULL, &g));
    kpl_model_config dc = mc;
    if (dname[0]) snprintf(dc.name, sizeof dc.name, "%s", dname);
    else snprintf(dc.name, sizeof dc.name, "%.29s_d", mc.name);
    kpl_optim_config oc = r->optimizer.config;
    double d_lr = 0, betas[4];
    KPL_TRY(kpl_key_float(kv, "d_lr", &d_lr));
    KPL_TRY(kpl_key_floats(kv, "d_betas", betas, 4, &n));
    /* scaled as the generator's (optimizer.lr_scaling) */
    oc.lr = (d_lr > 0 ? d_lr : r->optimizer.config.lr) * kpl_trainer_lr_scale(t);
    if (n == 2) oc.beta1 = betas[0], oc.beta2 = betas[1];
    kpl_module *dm = NULL;
    KPL_TRY(add_model(t, &dc, "discriminator", &oc, &dm));
    KPL_TRY(probe_discriminator(dm, dc.name, chw));

    /* the moving average: a second generator, equal at the start (a copy:
     * the generator may have started from model.weights) */
    if (s->ema_decay > 0) {
        KPL_TRY(kpl_zoo_create(&mc, kpl_trainer_device(t), (uint64_t)r->seed, &s->ema));
        kpl_module_set_training(s->ema, false);
        KPL_TRY(kpl_module_set_requires_grad(s->ema, false));
        KPL_TRY(ema_from(s, g));
    }
    /* latents: one stream for every rank (the seed's own, apart from the
     * models'), and the grid's fixed latents from another */
    uint64_t seed = (uint64_t)r->seed * 0x9E3779B97F4A7C15ull + 0x6a09e667f3bcc908ull;
    s->zrng = kpl_rng_create(seed);
    kpl_rng *grng = kpl_rng_create(seed ^ 0xbb67ae8584caa73bull);
    int64_t four = 4, gz[2] = {s->grid[0] * s->grid[1], s->latent};
    kpl_status st = s->zrng && grng ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "out of memory");
    if (st >= 0) st = kpl_tensor_zeros(kpl_device_cpu(), KPL_I64, 1, &four, &s->state);
    if (st >= 0) st = kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 2, gz, &s->grid_z);
    if (st >= 0) st = kpl_k_normal(s->grid_z, grng, 0, 1);
    kpl_rng_destroy(grng);
    KPL_TRY(st);
    return setup_fid(t, s, kv);
}

/* Images only: a label, when the records have one, is not read. */
static void data(const kpl_recipe *r, bool train, kpl_loader_config *c)
{
    (void)r, (void)train;
    c->transform.label_feature = NULL;
}

/* ---- training ---------------------------------------------------------------------------------- */

/* This rank's rows of a global batch drawn from the shared stream: every
 * rank draws all `batch x world` rows (each a `width`-wide N(0, 1) or
 * U(0, 1) vector) and keeps rows j x world + rank, j < n: the sample each
 * rank's interleaved loader holds at j.  The stream moves the same on
 * every rank, whatever their batches' sizes.  Pool-owned, on the device. */
static kpl_tensor *draw(kpl_trainer *t, gan *s, int64_t n, int64_t width, bool uniform)
{
    int64_t world = kpl_trainer_world(t), rank = kpl_trainer_rank(t);
    int64_t all[2] = {s->batch * world, width}, mine[2] = {n, width};
    kpl_tensor *a = uniform ? kpl_rand(kpl_device_cpu(), KPL_F32, 2, all, s->zrng, 0, 1)
                            : kpl_randn(kpl_device_cpu(), KPL_F32, 2, all, s->zrng, 0, 1);
    if (!a) return NULL;
    if (world == 1 && n == s->batch) return kpl_to_device(a, kpl_trainer_device(t));
    kpl_tensor *out = kpl_empty(kpl_device_cpu(), KPL_F32, 2, mine);
    const float *src = kpl_tensor_host_data(a);
    float *dst = out ? kpl_tensor_host_mutable(out) : NULL;
    if (!src || !dst) return NULL;
    for (int64_t j = 0; j < n; j++)
        memcpy(dst + j * width, src + (j * world + rank) * width, (size_t)width * sizeof *dst);
    return kpl_to_device(out, kpl_trainer_device(t));
}

/* G(z) for n latents of this rank's rows. */
static kpl_tensor *generate(kpl_trainer *t, gan *s, int64_t n)
{
    return kpl_module_forward(kpl_trainer_model(t, G), draw(t, s, n, s->latent, false));
}

static kpl_tensor *mean_of(kpl_tensor *x) { return kpl_mean(x, NULL, 0, false); }

/* The per-sample norm of a gradient (N, ...), as (N). */
static kpl_tensor *grad_norm2(kpl_tensor *g)
{
    int64_t n = kpl_tensor_dim(g, 0), flat[2] = {n, -1};
    int ax = 1;
    return kpl_sum(kpl_square(kpl_reshape(g, 2, flat)), &ax, 1, false);
}

/* The gradient of D's summed scores w.r.t. its input x (x requires grad),
 * recorded for a backward through it. */
static kpl_tensor *input_grad(kpl_tensor *score, kpl_tensor *x)
{
    kpl_tensor *g = NULL;
    if (!score || kpl_grad(kpl_sum(score, NULL, 0, false), NULL, 1, &x, true, &g) < 0) return NULL;
    return g;
}

/* A copy of x that takes a gradient (pool-owned). */
static kpl_tensor *leaf(kpl_tensor *x)
{
    kpl_tensor *y = kpl_scalar_op(KPL_BIN_ADD, kpl_detach(x), 0, false);
    return y && kpl_set_requires_grad(y, true) >= 0 ? y : NULL;
}

static kpl_status record(kpl_trainer *t, const char *name, kpl_tensor *mean, double n)
{
    return kpl_trainer_record_tensor(t, name, kpl_scalar_op(KPL_BIN_MUL, kpl_detach(mean), n, false),
                                     n);
}

/* One discriminator step on the batch's real images. */
static kpl_status d_step(kpl_trainer *t, gan *s, const kpl_batch *b)
{
    kpl_module *d = kpl_trainer_model(t, D);
    int64_t n = b->size;
    kpl_status st = KPL_OK;
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *real = kpl_to_device(b->image, kpl_trainer_device(t));
    if (s->r1_weight > 0) real = leaf(real);
    kpl_tensor *fake = kpl_detach(generate(t, s, n));
    kpl_tensor *dr = kpl_module_forward(d, real), *df = kpl_module_forward(d, fake);
    kpl_tensor *loss = NULL;
    if (s->loss == LOSS_NS)
        loss = kpl_add(mean_of(kpl_softplus(kpl_neg(dr))), mean_of(kpl_softplus(df)));
    else if (s->loss == LOSS_HINGE)
        loss = kpl_add(mean_of(kpl_relu(kpl_scalar_op(KPL_BIN_SUB, dr, 1, true))),
                       mean_of(kpl_relu(kpl_scalar_op(KPL_BIN_ADD, df, 1, false))));
    else
        loss = kpl_sub(mean_of(df), mean_of(dr));
    if (loss) st = record(t, "d_real", mean_of(dr), (double)n);
    if (st >= 0 && loss) st = record(t, "d_fake", mean_of(df), (double)n);
    if (st >= 0 && loss && s->gp_weight > 0) {
        /* x_hat = e x + (1 - e) G(z), e ~ U(0, 1) per sample */
        int64_t es[4] = {n, 1, 1, 1};
        kpl_tensor *e = kpl_reshape(draw(t, s, n, 1, true), 4, es);
        kpl_tensor *xh = leaf(kpl_add(kpl_mul(e, kpl_detach(real)),
                                      kpl_mul(kpl_scalar_op(KPL_BIN_SUB, e, 1, true), fake)));
        kpl_tensor *norm = kpl_sqrt(grad_norm2(input_grad(kpl_module_forward(d, xh), xh)));
        kpl_tensor *gp = mean_of(kpl_square(kpl_scalar_op(KPL_BIN_SUB, norm, 1, false)));
        st = gp ? record(t, "gp", gp, (double)n) : kpl_last_status();
        loss = kpl_add(loss, kpl_scalar_op(KPL_BIN_MUL, gp, s->gp_weight, false));
    }
    if (st >= 0 && loss && s->r1_weight > 0) {
        kpl_tensor *r1 = mean_of(grad_norm2(input_grad(dr, real)));
        st = r1 ? record(t, "r1", r1, (double)n) : kpl_last_status();
        loss = kpl_add(loss, kpl_scalar_op(KPL_BIN_MUL, r1, s->r1_weight / 2, false));
    }
    if (st >= 0 && loss) st = record(t, "loss_d", loss, (double)n);
    if (st >= 0 && !loss) st = kpl_last_status() < 0 ? kpl_last_status() : KPL_ERROR(KPL_EINVAL,
                                                                                      "gan: no loss");
    if (loss) kpl_tensor_retain(loss);
    kpl_pool_pop(p);
    if (st >= 0) st = kpl_trainer_backward(t, D, loss, NULL);
    kpl_tensor_release(loss);
    return st >= 0 ? kpl_trainer_update(t, D) : st;
}

/* ema += (1 - decay) (w - ema) for every parameter; buffers (running
 * statistics) copied. */
static kpl_status ema_update(kpl_trainer *t, gan *s)
{
    kpl_module *g = kpl_trainer_model(t, G);
    double n = (double)s->counts[1];
    double decay = fmin(s->ema_decay, (1 + n) / (10 + n));
    bool grad = kpl_set_grad_enabled(false);
    kpl_status st = KPL_OK;
    kpl_tensor *const *w = kpl_module_params(g), *const *e = kpl_module_params(s->ema);
    for (int i = 0; st >= 0 && i < kpl_module_num_params(g); i++) {
        kpl_pool *p = kpl_pool_push();
        kpl_tensor *step = kpl_scalar_op(KPL_BIN_MUL, kpl_sub(w[i], e[i]), 1 - decay, false);
        st = step ? kpl_k_binary(e[i], KPL_BIN_ADD, e[i], step) : kpl_last_status();
        kpl_pool_pop(p);
    }
    kpl_tensor *const *bw = kpl_module_buffers(g), *const *be = kpl_module_buffers(s->ema);
    for (int i = 0; st >= 0 && i < kpl_module_num_buffers(g); i++) st = kpl_k_copy(be[i], bw[i]);
    kpl_set_grad_enabled(grad);
    return st;
}

/* One generator step: D's parameters lend no gradient meanwhile. */
static kpl_status g_step(kpl_trainer *t, gan *s, int64_t n)
{
    kpl_module *d = kpl_trainer_model(t, D);
    KPL_TRY(kpl_module_set_requires_grad(d, false));
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *dg = kpl_module_forward(d, generate(t, s, n));
    kpl_tensor *loss = s->loss == LOSS_NS ? mean_of(kpl_softplus(kpl_neg(dg)))
                                          : kpl_neg(mean_of(dg));
    kpl_status st = loss ? record(t, "loss_g", loss, (double)n) : kpl_last_status();
    if (loss) kpl_tensor_retain(loss);
    kpl_pool_pop(p);
    if (st >= 0) st = kpl_trainer_backward(t, G, loss, NULL);
    kpl_tensor_release(loss);
    kpl_status rs = kpl_module_set_requires_grad(d, true);
    KPL_TRY(st);
    KPL_TRY(rs);
    KPL_TRY(kpl_trainer_update(t, G));
    s->counts[1]++;
    return s->ema ? ema_update(t, s) : KPL_OK;
}

static kpl_status train_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    gan *s = state;
    if (b->size == 0) return KPL_OK;
    KPL_CHECK(kpl_tensor_ndim(b->image) == 4 && kpl_tensor_dtype(b->image) == KPL_F32, KPL_EINVAL,
              "gan: want f32 (N, C, H, W) images (a transform with mean and std)");
    KPL_TRY(d_step(t, s, b));
    s->counts[0]++;
    return s->counts[0] % s->n_critic == 0 ? g_step(t, s, b->size) : KPL_OK;
}

/* ---- checkpoints ------------------------------------------------------------------------------- */

static kpl_status save(kpl_trainer *t, void *state, kpl_checkpoint *c)
{
    (void)t;
    gan *s = state;
    int64_t *v = kpl_tensor_host_mutable(s->state);
    if (!v) return kpl_last_status();
    v[0] = (int64_t)kpl_rng_seed(s->zrng), v[1] = (int64_t)kpl_rng_offset(s->zrng);
    v[2] = s->counts[0], v[3] = s->counts[1];
    KPL_TRY(kpl_checkpoint_add(c, "task.gan.state", s->state));
    if (!s->ema) return KPL_OK;
    char name[512];
    for (int i = 0; i < kpl_module_num_params(s->ema); i++) {
        snprintf(name, sizeof name, "task.ema.%s", kpl_module_param_name(s->ema, i));
        KPL_TRY(kpl_checkpoint_add(c, name, kpl_module_params(s->ema)[i]));
    }
    for (int i = 0; i < kpl_module_num_buffers(s->ema); i++) {
        snprintf(name, sizeof name, "task.ema.%s", kpl_module_buffer_name(s->ema, i));
        KPL_TRY(kpl_checkpoint_add(c, name, kpl_module_buffers(s->ema)[i]));
    }
    return KPL_OK;
}

/* Copies c's tensor `name` into dst (shape checked). */
static kpl_status restore_one(const kpl_checkpoint *c, const char *name, kpl_tensor *dst)
{
    kpl_tensor *src = kpl_checkpoint_find(c, name);
    KPL_CHECK(src, KPL_EFORMAT, "checkpoint: no %s (the generator's moving average; a checkpoint "
              "with task.gan.state has all of it)", name);
    KPL_TRY(kpl_checkpoint_check(c, name, dst));
    return kpl_k_copy(dst, src);
}

static kpl_status restore(kpl_trainer *t, void *state, const kpl_checkpoint *c)
{
    gan *s = state;
    kpl_tensor *st = kpl_checkpoint_find(c, "task.gan.state");
    kpl_module *g = kpl_trainer_model(t, G);
    if (!st) /* weights alone (a warm start): the average starts at them */
        return s->ema ? ema_from(s, g) : KPL_OK;
    KPL_TRY(kpl_checkpoint_check(c, "task.gan.state", s->state));
    KPL_TRY(kpl_k_copy(s->state, st));
    const int64_t *v = kpl_tensor_host_data(s->state);
    if (!v) return kpl_last_status();
    kpl_rng_set_state(s->zrng, (uint64_t)v[0], (uint64_t)v[1]);
    s->counts[0] = v[2], s->counts[1] = v[3];
    if (!s->ema) return KPL_OK;
    char name[512];
    for (int i = 0; i < kpl_module_num_params(s->ema); i++) {
        snprintf(name, sizeof name, "task.ema.%s", kpl_module_param_name(s->ema, i));
        KPL_TRY(restore_one(c, name, kpl_module_params(s->ema)[i]));
    }
    for (int i = 0; i < kpl_module_num_buffers(s->ema); i++) {
        snprintf(name, sizeof name, "task.ema.%s", kpl_module_buffer_name(s->ema, i));
        KPL_TRY(restore_one(c, name, kpl_module_buffers(s->ema)[i]));
    }
    return KPL_OK;
}

/* ---- evaluation -------------------------------------------------------------------------------- */

static const char *const eval_sums[] = {"d_real", "d_count", NULL};

/* The generator samples come from: the average, or G itself. */
static kpl_module *sampler(kpl_trainer *t, gan *s)
{
    return s->ema ? s->ema : kpl_trainer_model(t, G);
}

/* images in [-1, 1] (the generator's range) as [0, 1] for the feature
 * network; real images are first un-normalised with the split's mean and
 * std. */
static kpl_tensor *to_unit(kpl_tensor *x, const kpl_transform_config *tr)
{
    if (tr) {
        int64_t C = kpl_tensor_dim(x, 1), cs[4] = {1, C, 1, 1};
        float mean[3] = {0, 0, 0}, std[3] = {1, 1, 1};
        for (int64_t c = 0; c < C && c < 3; c++) {
            mean[c] = (float)tr->mean[c];
            std[c] = (float)tr->std[c];
        }
        kpl_tensor *m = NULL, *sd = NULL;
        if (kpl_tensor_from_data(kpl_tensor_device(x), KPL_F32, 4, cs, mean, &m) < 0 ||
            kpl_tensor_from_data(kpl_tensor_device(x), KPL_F32, 4, cs, std, &sd) < 0) {
            kpl_tensor_release(m);
            return NULL;
        }
        return kpl_add(kpl_mul(x, kpl_autorelease(sd)), kpl_autorelease(m));
    }
    return kpl_clip(kpl_scalar_op(KPL_BIN_MUL, kpl_scalar_op(KPL_BIN_ADD, x, 1, false), 0.5, false),
                    0, 1);
}

static kpl_status eval_begin(kpl_trainer *t, void *state)
{
    (void)t;
    gan *s = state;
    if (s->fake) kpl_fid_stats_reset(s->fake);
    if (s->real && !s->real_done) kpl_fid_stats_reset(s->real);
    return KPL_OK;
}

/* Real images: D's mean score, and their features once. */
static kpl_status eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    gan *s = state;
    kpl_tensor *x = kpl_to_device(b->image, kpl_trainer_device(t));
    const float *dr = kpl_tensor_host_data(kpl_module_forward(kpl_trainer_model(t, D), x));
    if (!dr) return kpl_last_status();
    double sum = 0, count = 0;
    for (int64_t i = 0; i < b->size; i++)
        if (kpl_trainer_eval_counts(t, b, i)) sum += dr[i], count += 1;
    KPL_TRY(kpl_trainer_eval_add(t, "d_real", sum));
    KPL_TRY(kpl_trainer_eval_add(t, "d_count", count));
    if (!s->fnet || s->real_done) return KPL_OK;
    kpl_tensor *f = NULL;
    KPL_TRY(kpl_feature_net_run(
        s->fnet, to_unit(x, &kpl_trainer_recipe(t)->data.val.loader.transform), &f, NULL));
    const float *fp = kpl_tensor_host_data(f);
    if (!fp) return kpl_last_status();
    int64_t dim = kpl_fid_stats_dim(s->real);
    for (int64_t i = 0; i < b->size; i++)
        if (kpl_trainer_eval_counts(t, b, i)) KPL_TRY(kpl_fid_stats_add(s->real, fp + i * dim, 1));
    return KPL_OK;
}

/* The sample grid (rank 0): G's images of the fixed latents, 2 pixels
 * apart, as RGB. */
static kpl_status make_grid(kpl_trainer *t, gan *s)
{
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *img = kpl_module_forward(sampler(t, s),
                                         kpl_to_device(s->grid_z, kpl_trainer_device(t)));
    const float *px = img ? kpl_tensor_host_data(kpl_to_device(img, kpl_device_cpu())) : NULL;
    kpl_status st = px ? KPL_OK : kpl_last_status();
    int64_t C = st >= 0 ? kpl_tensor_dim(img, 1) : 0, H = st >= 0 ? kpl_tensor_dim(img, 2) : 0;
    int64_t W = st >= 0 ? kpl_tensor_dim(img, 3) : 0, rows = s->grid[0], cols = s->grid[1];
    int gh = (int)(rows * (H + 2) + 2), gw = (int)(cols * (W + 2) + 2);
    uint8_t *g = st >= 0 ? calloc((size_t)gh * gw * 3, 1) : NULL;
    if (st >= 0 && !g) st = KPL_ERROR(KPL_ENOMEM, "gan: out of memory");
    static const float half[3] = {0.5f, 0.5f, 0.5f}; /* tanh's [-1, 1] to [0, 1] */
    for (int64_t k = 0; st >= 0 && k < rows * cols; k++) {
        int64_t y0 = 2 + (k / cols) * (H + 2), x0 = 2 + (k % cols) * (W + 2);
        kpl_tb_rgb8(px, C, H, W, k, (int)H, (int)W, half, half,
                    g + ((size_t)y0 * (size_t)gw + (size_t)x0) * 3, gw);
    }
    kpl_pool_pop(p);
    if (st < 0) {
        free(g);
        return st;
    }
    free(s->grid_px);
    s->grid_px = g, s->grid_h = gh, s->grid_w = gw;
    const char *dir = kpl_trainer_run_dir(t);
    if (!dir[0]) return KPL_OK;
    char sub[4200], path[4300];
    snprintf(sub, sizeof sub, "%s/samples", dir);
    KPL_CHECK(mkdir(sub, 0777) == 0 || errno == EEXIST, KPL_EIO, "gan: cannot make %s: %s", sub,
              strerror(errno));
    snprintf(path, sizeof path, "%s/step_%08lld.png", sub, (long long)kpl_trainer_steps(t));
    return kpl_tb_png_write(path, gh, gw, 3, g, "gan samples");
}

/* Fake features: fid_samples images in chunks, chunk c on rank c mod
 * world with latents from a stream of its own, so the set is the same for
 * any number of ranks. */
#define CHUNK 250
static kpl_status fake_features(kpl_trainer *t, gan *s, float **probs, size_t *nprobs)
{
    int64_t world = kpl_trainer_world(t), rank = kpl_trainer_rank(t);
    int64_t chunks = (s->fid_samples + CHUNK - 1) / CHUNK, K = kpl_feature_net_classes(s->fnet);
    int64_t mine = 0;
    for (int64_t c = rank; c < chunks; c += world)
        mine += c == chunks - 1 ? s->fid_samples - c * CHUNK : CHUNK;
    *probs = malloc((size_t)(mine * K > 0 ? mine * K : 1) * sizeof **probs);
    *nprobs = (size_t)(mine * K);
    KPL_CHECK(*probs, KPL_ENOMEM, "gan: out of memory");
    kpl_rng *rng = kpl_rng_create(0);
    KPL_CHECK(rng, KPL_ENOMEM, "gan: out of memory");
    uint64_t base = (uint64_t)kpl_trainer_recipe(t)->seed * 0x9E3779B97F4A7C15ull + 0x3c6ef372fe94f82bull;
    kpl_status st = KPL_OK;
    int64_t at = 0;
    for (int64_t c = rank; st >= 0 && c < chunks; c += world) {
        int64_t n = c == chunks - 1 ? s->fid_samples - c * CHUNK : CHUNK, zs[2] = {n, s->latent};
        kpl_rng_set_state(rng, base + (uint64_t)c, 0);
        kpl_pool *p = kpl_pool_push();
        kpl_tensor *z = kpl_randn(kpl_device_cpu(), KPL_F32, 2, zs, rng, 0, 1);
        kpl_tensor *img = kpl_module_forward(sampler(t, s), kpl_to_device(z, kpl_trainer_device(t)));
        kpl_tensor *f = NULL, *pr = NULL;
        st = img ? kpl_feature_net_run(s->fnet, to_unit(img, NULL), &f, &pr) : kpl_last_status();
        const float *fp = st >= 0 ? kpl_tensor_host_data(f) : NULL;
        const float *pp = st >= 0 ? kpl_tensor_host_data(pr) : NULL;
        if (st >= 0 && (!fp || !pp)) st = kpl_last_status();
        if (st >= 0) st = kpl_fid_stats_add(s->fake, fp, n);
        if (st >= 0) memcpy(*probs + at * K, pp, (size_t)(n * K) * sizeof **probs);
        at += n;
        kpl_pool_pop(p);
    }
    kpl_rng_destroy(rng);
    return st;
}

/* Every rank's probabilities in chunk order (rank r holds chunks r, r +
 * world, ...), for the Inception Score on rank 0's copy. */
static kpl_status inception_score(kpl_trainer *t, gan *s, const float *probs, size_t nprobs,
                                  double *is, double *is_std)
{
    int64_t world = kpl_trainer_world(t), K = kpl_feature_net_classes(s->fnet);
    int64_t chunks = (s->fid_samples + CHUNK - 1) / CHUNK;
    void *all = NULL;
    size_t *lens = calloc((size_t)world, sizeof *lens);
    KPL_CHECK(lens, KPL_ENOMEM, "gan: out of memory");
    kpl_status st = kpl_trainer_all_gather(t, probs, nprobs * sizeof *probs, &all, lens);
    float *ordered = st >= 0 ? malloc((size_t)(s->fid_samples * K) * sizeof *ordered) : NULL;
    if (st >= 0 && !ordered) st = KPL_ERROR(KPL_ENOMEM, "gan: out of memory");
    if (st >= 0) {
        size_t *at = calloc((size_t)world, sizeof *at), off = 0;
        size_t *start = calloc((size_t)world, sizeof *start);
        if (!at || !start) st = KPL_ERROR(KPL_ENOMEM, "gan: out of memory");
        for (int64_t r = 0; st >= 0 && r < world; r++) start[r] = off, off += lens[r];
        for (int64_t c = 0; st >= 0 && c < chunks; c++) {
            int64_t r = c % world, n = c == chunks - 1 ? s->fid_samples - c * CHUNK : CHUNK;
            size_t bytes = (size_t)(n * K) * sizeof(float);
            if (at[r] + bytes > lens[r]) {
                st = KPL_ERROR(KPL_EINVAL, "gan: rank %lld sent %zu bytes of probabilities, "
                               "fewer than its chunks", (long long)r, lens[r]);
                break;
            }
            memcpy(ordered + c * CHUNK * K, (const char *)all + start[r] + at[r], bytes);
            at[r] += bytes;
        }
        if (st >= 0)
            st = kpl_inception_score(ordered, s->fid_samples, K, (int)s->is_splits, is, is_std);
        free(at), free(start);
    }
    free(ordered), free(all), free(lens);
    return st;
}

static kpl_status eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    gan *s = state;
    double count = kpl_trainer_eval_total(t, "d_count");
    res->examples = (int64_t)count;
    KPL_TRY(kpl_figures_set(&res->metrics, "d_real",
                            count > 0 ? kpl_trainer_eval_total(t, "d_real") / count : NAN));
    kpl_status st = kpl_trainer_rank(t) == 0 ? make_grid(t, s) : KPL_OK;
    if (st < 0) return st;
    if (!s->fnet) return KPL_OK;
    if (!s->real_done) {
        KPL_TRY(kpl_trainer_sum(t, kpl_fid_stats_sums(s->real), (int)kpl_fid_stats_len(s->real)));
        s->real_done = true;
    }
    float *probs = NULL;
    size_t nprobs = 0;
    st = fake_features(t, s, &probs, &nprobs);
    if (st >= 0) st = kpl_trainer_sum(t, kpl_fid_stats_sums(s->fake), (int)kpl_fid_stats_len(s->fake));
    double fid = NAN, is = NAN, is_std = NAN;
    if (st >= 0) st = kpl_fid(s->real, s->fake, &fid);
    if (st >= 0) st = inception_score(t, s, probs, nprobs, &is, &is_std);
    free(probs);
    KPL_TRY(st);
    KPL_TRY(kpl_figures_set(&res->metrics, "fid", fid));
    KPL_TRY(kpl_figures_set(&res->metrics, "is", is));
    return kpl_figures_set(&res->metrics, "is_std", is_std);
}

static kpl_status images(kpl_trainer *t, void *state, kpl_tb_writer *tb, int64_t step)
{
    (void)t;
    gan *s = state;
    if (!s->grid_px) return KPL_OK;
    return kpl_tb_add_image(tb, "val/samples", step, s->grid_h, s->grid_w, 3, s->grid_px);
}

const kpl_task_kind kpl_task_gan = {
    .name = "gan",
    .best_metric = "fid",
    .best_higher = false,
    .create = create,
    .destroy = destroy,
    .train_batch = train_batch,
    .eval_sums = eval_sums,
    .eval_begin = eval_begin,
    .eval_batch = eval_batch,
    .eval_end = eval_end,
    .data = data,
    .images = images,
    .save = save,
    .restore = restore,
    .keys = keys,
    .needs = needs,
    .check = check,
};
