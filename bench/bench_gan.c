/*
 * bench_gan.c — `bench/run.sh gan`: GAN training iterations on the zoo's
 * DCGAN pair (trainer/nn/gannets.c) next to the same networks written in
 * PyTorch (bench/torch_gans.py).
 *
 *   bench_gan BENCH_DIR WORK_DIR [--cases dcgan,wgangp] [--batch 64] [--side 32]
 *   bench_gan --mem dcgan|wgangp [options]
 *
 * Both cases train dcgan (latent 100, width 64, batch norm) against
 * dcgan_d on 3 x 32 x 32 images, batch 64, Adam on both models, 2 threads
 * on both sides:
 *  - dcgan: the DCGAN recipe (Radford et al.: Adam 2e-4, betas 0.5,
 *    0.999; D with batch norm).  One iteration: fake = G(z); D step on
 *    BCE(D(real), 1) + BCE(D(fake detached), 0); G step (D's parameters
 *    not taking gradients) on the non-saturating BCE(D(fake), 1), through
 *    the same fake.
 *  - wgangp: WGAN-GP (Gulrajani et al.: Adam 1e-4, betas 0, 0.9, penalty
 *    weight 10) with the critic's norm `layer`.  One iteration: critic
 *    step on D(fake).mean() - D(real).mean() + 10 ((|grad_xhat D(xhat)| -
 *    1)^2).mean(), fake = G(z) without gradients, xhat = eps real + (1 -
 *    eps) fake, the input gradient taken with create_graph (double
 *    backward); then a G step on -D(G(z)).mean().
 * z ~ N(0, 1), real images U(-1, 1), eps ~ U(0, 1) per sample: fixed for
 * the run, the same on both sides.  The C side builds G and D from seeds
 * and writes every parameter and buffer and the batch to
 * WORK_DIR/gan_<case>.bin; the Python side builds the same module trees,
 * checks every name and shape, loads them, runs one iteration and prints
 * its losses, which must agree with kpl's first iteration to GAN_RTOL
 * (exit 1 otherwise).  Then, in rounds that alternate which side goes
 * first (KPL_BENCH_ROUNDS, default 5; medians reported), each side from the
 * initial weights and fresh optimizers:
 *  - gan/<case>_iter_b<N>_<S>/t2: ms of one iteration (D step + G step),
 *    median over GAN_STEPS after GAN_WARM warm-up ones.  Target 1.2.
 *  - gan/<case>_iter_b<N>_<S>/peak_rss: the growth of the peak resident
 *    set over GAN_MEM_STEPS iterations in a fresh process per side (kpl:
 *    this program with --mem; PyTorch: torch_gans.py mem), as bench_seg
 *    measures it.  Target kpl <= 0.8x (ratio: PyTorch's / kpl's, 1.25;
 *    issue 49).
 * The reference runs with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset
 * (../shared/DESIGN.md, "Benchmarks and figures").
 */
#include "bench_common.h"
#include "bench_file.h"
#include "bench_snapshot.h"
#include "trainer.h"


#define GAN_THREADS 2
#define GAN_SEED 2016
#define GAN_LATENT 100
#define GAN_WIDTH 64
#define GAN_CHANNELS 3
#define GAN_GP_WEIGHT 10.0
#define GAN_WARM 2
#define GAN_STEPS 8
#define GAN_MEM_STEPS 3
/* How far kpl's and PyTorch's losses of the first iteration may be apart
 * (relative). */
#define GAN_RTOL 1e-3

static void die(const char *what)
{
    fprintf(stderr, "bench_gan: %s: %s\n", what, kpl_last_error());
    exit(1);
}

/* One benchmarked recipe. */
typedef struct {
    const char *name; /* "dcgan", "wgangp" */
    bool wgan;
    const char *d_norm;
    double lr, beta1, beta2;
    int64_t batch, side;
} gan_case;

static void make_case(gan_case *c, const char *name, int64_t batch, int64_t side)
{
    bool wgan = !strcmp(name, "wgangp");
    *c = (gan_case){name, wgan, wgan ? "layer" : "batch", wgan ? 1e-4 : 2e-4, wgan ? 0.0 : 0.5,
                    wgan ? 0.9 : 0.999, batch, side};
}

/* ---- the models, the batch and one iteration ------------------------------------------------- */

typedef struct {
    const gan_case *c;
    kpl_module *g, *d;
    kpl_optim *og, *od;
    kpl_tensor *z, *real, *eps; /* (N, latent), (N, C, S, S), (N, 1, 1, 1) */
    kpl_tensor *ones, *zeros;   /* (N, 1) */
} gan_run;

static kpl_module *make_model(const gan_case *c, bool d)
{
    kpl_model_config mc;
    memset(&mc, 0, sizeof mc);
    snprintf(mc.name, sizeof mc.name, "%s", d ? "dcgan_d" : "dcgan");
    mc.in_channels = GAN_CHANNELS, mc.in_h = mc.in_w = c->side, mc.width = GAN_WIDTH;
    char v[16];
    snprintf(v, sizeof v, "%d", GAN_LATENT);
    if (kpl_keyvals_set(&mc.keys, "latent_dim", v) < 0 ||
        kpl_keyvals_set(&mc.keys, "d_norm", c->d_norm) < 0)
        die("model keys");
    kpl_module *m = NULL;
    if (kpl_zoo_create(&mc, kpl_device_cpu(), GAN_SEED + d, &m) < 0) die(mc.name);
    return m;
}

static kpl_optim *make_adam(const gan_case *c, kpl_module *m)
{
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    snprintf(oc.name, sizeof oc.name, "adam");
    oc.lr = c->lr, oc.beta1 = c->beta1, oc.beta2 = c->beta2;
    kpl_optim *opt = NULL;
    if (kpl_optim_create(&oc, kpl_module_num_params(m), kpl_module_params(m), NULL, &opt) < 0)
        die("adam");
    return opt;
}

static kpl_tensor *keep(kpl_tensor *t)
{
    if (!t) die("batch");
    kpl_tensor_retain(t);
    return t;
}

/* Models, optimizers and the fixed batch (owned by r; gan_free). */
static void gan_make(gan_run *r, const gan_case *c)
{
    memset(r, 0, sizeof *r);
    r->c = c;
    r->g = make_model(c, false), r->d = make_model(c, true);
    r->og = make_adam(c, r->g), r->od = make_adam(c, r->d);
    kpl_device *cpu = kpl_device_cpu();
    kpl_rng *rng = kpl_rng_create(GAN_SEED);
    if (!rng) die("rng");
    int64_t N = c->batch, S = c->side;
    r->z = keep(kpl_randn(cpu, KPL_F32, 2, (int64_t[]){N, GAN_LATENT}, rng, 0, 1));
    r->real = keep(kpl_rand(cpu, KPL_F32, 4, (int64_t[]){N, GAN_CHANNELS, S, S}, rng, -1, 1));
    r->eps = keep(kpl_rand(cpu, KPL_F32, 4, (int64_t[]){N, 1, 1, 1}, rng, 0, 1));
    r->ones = keep(kpl_full(cpu, KPL_F32, 2, (int64_t[]){N, 1}, 1));
    r->zeros = keep(kpl_full(cpu, KPL_F32, 2, (int64_t[]){N, 1}, 0));
    kpl_rng_destroy(rng);
}

static void gan_free(gan_run *r)
{
    kpl_optim_destroy(r->og);
    kpl_optim_destroy(r->od);
    kpl_module_destroy(r->g);
    kpl_module_destroy(r->d);
    kpl_tensor *t[5] = {r->z, r->real, r->eps, r->ones, r->zeros};
    for (int i = 0; i < 5; i++) kpl_tensor_release(t[i]);
}

/* Fresh optimizers (Adam's moments and step counts from zero). */
static void gan_reset_optim(gan_run *r)
{
    kpl_optim_destroy(r->og);
    kpl_optim_destroy(r->od);
    r->og = make_adam(r->c, r->g), r->od = make_adam(r->c, r->d);
}

static double value(kpl_tensor *t)
{
    double v = NAN;
    if (!t || kpl_tensor_get(t, 0, &v) < 0) die("loss");
    return v;
}

/* loss backward, then the optimizer's step; loss is released. */
static void step(kpl_tensor *loss, kpl_optim *opt)
{
    if (kpl_backward(loss, NULL, false) < 0) die("backward");
    kpl_tensor_release(loss);
    if (kpl_optim_step(opt) < 0) die("adam step");
}

/* The D step of either recipe; returns its loss (retained) and writes the
 * penalty's value into *gp (wgangp).  The forward pool closes before the
 * backward, so saved activations die as it goes. */
static kpl_tensor *d_loss(gan_run *r, kpl_tensor **fake, double *gp)
{
    kpl_pool *fw = kpl_pool_push();
    kpl_tensor *loss = NULL;
    if (!r->c->wgan) {
        *fake = keep(kpl_module_forward(r->g, r->z));
        kpl_tensor *lr = kpl_bce_with_logits(kpl_module_forward(r->d, r->real), r->ones,
                                             KPL_REDUCE_MEAN);
        kpl_tensor *lf = kpl_bce_with_logits(kpl_module_forward(r->d, kpl_detach(*fake)),
                                             r->zeros, KPL_REDUCE_MEAN);
        loss = kpl_add(lr, lf);
    } else {
        bool prev = kpl_set_grad_enabled(false);
        kpl_tensor *f = kpl_module_forward(r->g, r->z);
        kpl_set_grad_enabled(prev);
        /* xhat = eps real + (1 - eps) fake, a leaf the penalty differentiates by */
        kpl_tensor *xhat = kpl_add(kpl_mul(r->eps, r->real),
                                   kpl_mul(kpl_scalar_op(KPL_BIN_SUB, r->eps, 1, true), f));
        if (!xhat || kpl_set_requires_grad(xhat, true) < 0) die("xhat");
        kpl_tensor *gx = NULL;
        if (kpl_grad(kpl_sum(kpl_module_forward(r->d, xhat), NULL, 0, false), NULL, 1, &xhat,
                     true, &gx) < 0)
            die("gradient penalty");
        kpl_tensor *norm = kpl_sqrt(kpl_sum(kpl_square(gx), (int[]){1, 2, 3}, 3, false));
        kpl_tensor *pen = kpl_mean(kpl_square(kpl_scalar_op(KPL_BIN_SUB, norm, 1, false)), NULL,
                                   0, false);
        *gp = value(pen);
        /* fake, then real: torch_gans.py's order (a norm with state would see it) */
        kpl_tensor *df = kpl_mean(kpl_module_forward(r->d, f), NULL, 0, false);
        kpl_tensor *dr = kpl_mean(kpl_module_forward(r->d, r->real), NULL, 0, false);
        loss = kpl_add(kpl_sub(df, dr), kpl_scalar_op(KPL_BIN_MUL, pen, GAN_GP_WEIGHT, false));
    }
    if (!loss) die("D loss");
    kpl_tensor_retain(loss);
    kpl_pool_pop(fw);
    return loss;
}

/* One iteration; ph: ms of the D and the G step; losses: D's, G's, the
 * penalty (NAN for dcgan). */
static double iteration(gan_run *r, double ph[2], double losses[3])
{
    double t0 = bench_now();
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *fake = NULL;
    losses[2] = NAN;
    kpl_tensor *ld = d_loss(r, &fake, &losses[2]);
    losses[0] = value(ld);
    step(ld, r->od);
    double t1 = bench_now();
    if (kpl_module_set_requires_grad(r->d, false) < 0) die("freezing D");
    kpl_pool *fw = kpl_pool_push();
    kpl_tensor *lg = NULL;
    if (!r->c->wgan) {
        lg = kpl_bce_with_logits(kpl_module_forward(r->d, fake), r->ones, KPL_REDUCE_MEAN);
        kpl_tensor_release(fake); /* the graph keeps what the G step needs */
    } else {
        lg = kpl_neg(kpl_mean(kpl_module_forward(r->d, kpl_module_forward(r->g, r->z)), NULL, 0,
                              false));
    }
    losses[1] = value(lg);
    kpl_tensor_retain(lg);
    kpl_pool_pop(fw);
    step(lg, r->og);
    if (kpl_module_set_requires_grad(r->d, true) < 0) die("unfreezing D");
    kpl_pool_pop(p);
    double t2 = bench_now();
    for (int i = 0; i < 3; i++)
        if (!isfinite(losses[i]) && !(i == 2 && !r->c->wgan)) die("a loss is not finite");
    ph[0] = (t1 - t0) * 1e3, ph[1] = (t2 - t1) * 1e3;
    return (t2 - t0) * 1e3;
}

/* --mem: GAN_MEM_STEPS iterations in this fresh process, then the MEM
 * line torch_gans.py prints too. */
static int mem_main(const gan_case *c)
{
    kpl_pool *top = kpl_pool_push();
    gan_run r;
    gan_make(&r, c);
    bench_mem_run run = bench_mem_begin();
    for (int i = 0; i < GAN_MEM_STEPS; i++) {
        double ph[2], losses[3];
        iteration(&r, ph, losses);
    }
    bench_mem_end(&run);
    gan_free(&r);
    kpl_pool_pop(top);
    return 0;
}

/* ---- the reference's output ------------------------------------------------------------------- */

typedef struct {
    int names;
    double loss_d, loss_g, gp;
} ref_check;

static void check_line(const char *line, void *ctx)
{
    ref_check *r = ctx;
    if (strncmp(line, "CHECK ", 6)) return;
    sscanf(line, "CHECK names=%d", &r->names);
    const char *at;
    if ((at = strstr(line, "loss_d="))) r->loss_d = strtod(at + 7, NULL);
    if ((at = strstr(line, "loss_g="))) r->loss_g = strtod(at + 7, NULL);
    if ((at = strstr(line, " gp="))) r->gp = strtod(at + 4, NULL);
}

typedef struct {
    double ms, d, g, last;
} ref_times;

static void time_line(const char *line, void *ctx)
{
    ref_times *r = ctx;
    if (!strncmp(line, "ITER ", 5))
        sscanf(line, "ITER ms=%lf d=%lf g=%lf last=%lf", &r->ms, &r->d, &r->g, &r->last);
}

static double rel(double a, double b) { return fabs(a - b) / fmax(fabs(b), 1e-12); }

/* ---- one case -------------------------------------------------------------------------------- */

static int rounds;
static const char *refname = "torch-cpu-f32-nchw (same networks by hand)";

static int run_case(const gan_case *c, const char *bench_dir, const char *work, const char *self,
                    const char *argtail)
{
    kpl_pool *top = kpl_pool_push();
    gan_run r;
    gan_make(&r, c);
    int64_t N = c->batch, S = c->side;
    char tag[64];
    snprintf(tag, sizeof tag, "%s_iter_b%lld_%lld", c->name, (long long)N, (long long)S);
    fprintf(stderr, "bench_gan: %s: G %lld, D %lld parameters (d_norm %s)\n", tag,
            (long long)kpl_module_param_count(r.g), (long long)kpl_module_param_count(r.d),
            c->d_norm);

    /* the file: both models' weights and the batch */
    char path[512];
    snprintf(path, sizeof path, "%s/gan_%s.bin", work, c->name);
    static snapshot ginit, dinit;
    snapshot_take(&ginit, r.g);
    snapshot_take(&dinit, r.d);
    FILE *f = bench_file_open(path, "KPLGAN1");
    bench_put_module(f, "g:", "g:", r.g);
    bench_put_module(f, "d:", "d:", r.d);
    bench_put_tensor(f, "in:", "z", r.z);
    bench_put_tensor(f, "in:", "real", r.real);
    bench_put_tensor(f, "in:", "eps", r.eps);
    if (fclose(f) != 0) die("closing the file");

    /* the first iteration on both sides from the same weights and batch */
    double ph[2], kl[3];
    iteration(&r, ph, kl);
    snapshot_restore(&ginit);
    snapshot_restore(&dinit);
    char py[1024], args[2048], cmd[4096];
    snprintf(py, sizeof py,
             "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=%d /usr/bin/python3 "
             "%s/torch_gans.py",
             GAN_THREADS, bench_dir);
    snprintf(args, sizeof args,
             "%s threads=%d mode=%s latent=%d width=%d channels=%d side=%lld g_norm=batch "
             "d_norm=%s lr=%.17g beta1=%.17g beta2=%.17g gp_weight=%g",
             path, GAN_THREADS, c->wgan ? "wgangp" : "dcgan", GAN_LATENT, GAN_WIDTH, GAN_CHANNELS,
             (long long)S, c->d_norm, c->lr, c->beta1, c->beta2, GAN_GP_WEIGHT);
    ref_check rc = {0, NAN, NAN, NAN};
    snprintf(cmd, sizeof cmd, "%s check %s", py, args);
    if (bench_run_lines(cmd, check_line, &rc) == 0 && isnan(rc.loss_d)) {
        fprintf(stderr, "bench_gan: no CHECK line from: %s\n", cmd);
        bench_ref_failures++;
    }
    double worst = fmax(rel(kl[0], rc.loss_d), rel(kl[1], rc.loss_g));
    if (c->wgan) worst = fmax(worst, rel(kl[2], rc.gp));
    if (!isnan(rc.loss_d)) {
        fprintf(stderr, "bench_gan: %s: first iteration: D loss kpl %.7g torch %.7g, G loss kpl "
                "%.7g torch %.7g, penalty kpl %.7g torch %.7g; %d tensors\n", tag, kl[0],
                rc.loss_d, kl[1], rc.loss_g, kl[2], rc.gp, rc.names);
        if (!(worst <= GAN_RTOL)) {
            fprintf(stderr, "bench_gan: FAIL: kpl and PyTorch disagree by %.3g (> %g)\n", worst,
                    GAN_RTOL);
            return 1;
        }
    }

    /* memory, each side in a fresh process */
    bench_mem_line km, rm;
    char kcmd[4096];
    snprintf(kcmd, sizeof kcmd, "OMP_NUM_THREADS=%d %s --mem %s %s", GAN_THREADS, self, c->name,
             argtail);
    snprintf(cmd, sizeof cmd, "%s mem %s steps=%d", py, args, GAN_MEM_STEPS);
    if (bench_mem_pair("bench_gan", kcmd, cmd, &km, &rm)) return 1;
    fprintf(stderr, "bench_gan: %s: peak RSS growth over %d iterations kpl %.0f MB (allocator "
            "peak %.0f MB), torch %.0f MB\n", tag, GAN_MEM_STEPS, km.growth / 1e6,
            km.alloc_peak / 1e6, rm.growth / 1e6);

    /* the timed rounds */
    snprintf(cmd, sizeof cmd, "%s time %s iters=%d,%d", py, args, GAN_WARM, GAN_STEPS);
    double kt[64], kd[64], kg[64], rt[64], rd[64], rg[64], klast = NAN, rlast = NAN;
    for (int k = 0; k < rounds; k++) {
        for (int side = 0; side < 2; side++) {
            if ((side + k) % 2 == 0) {
                double t[GAN_STEPS], td[GAN_STEPS], tg[GAN_STEPS], l[3];
                snapshot_restore(&ginit);
                snapshot_restore(&dinit);
                gan_reset_optim(&r);
                for (int i = 0; i < GAN_WARM + GAN_STEPS; i++) {
                    double one[2], ms = iteration(&r, one, l);
                    if (i >= GAN_WARM)
                        t[i - GAN_WARM] = ms, td[i - GAN_WARM] = one[0], tg[i - GAN_WARM] = one[1];
                }
                kt[k] = bench_median(t, GAN_STEPS), kd[k] = bench_median(td, GAN_STEPS);
                kg[k] = bench_median(tg, GAN_STEPS), klast = l[0];
            } else {
                ref_times one = {NAN, NAN, NAN, NAN};
                if (bench_run_lines(cmd, time_line, &one) == 0 && isnan(one.ms)) {
                    fprintf(stderr, "bench_gan: no ITER line from: %s\n", cmd);
                    bench_ref_failures++;
                }
                rt[k] = one.ms, rd[k] = one.d, rg[k] = one.g, rlast = one.last;
            }
        }
        fprintf(stderr, "bench_gan: %s round %d: kpl %.1f ms (D %.1f, G %.1f), torch %.1f ms "
                "(D %.1f, G %.1f)\n", tag, k, kt[k], kd[k], kg[k], rt[k], rd[k], rg[k]);
    }

    char kr[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN], cas[128], n[9][BENCH_NUM_LEN];
    bench_jrange(kr, kt, rounds);
    bench_jrange(rr, rt, rounds);
    double kdm = bench_median(kd, rounds), kgm = bench_median(kg, rounds);
    double rdm = bench_median(rd, rounds), rgm = bench_median(rg, rounds);
    snprintf(cas, sizeof cas, "%s/t%d", tag, GAN_THREADS);
    bench_emit("gan", cas, "ms", 0, bench_median(kt, rounds), bench_median(rt, rounds), refname,
               1.2,
               ",\"threads\":%d,\"rounds\":%d,\"iters\":%d,\"kpl_range\":%s,\"ref_range\":%s,"
               "\"d_norm\":\"%s\",\"kpl_d_g_ms\":[%s,%s],\"ref_d_g_ms\":[%s,%s],"
               "\"first_loss_d_kpl\":%s,\"first_loss_d_ref\":%s,\"first_loss_max_rel_diff\":%s,"
               "\"last_loss_d_kpl\":%s,\"last_loss_d_ref\":%s,\"omp_wait_policy\":\"%s\"",
               GAN_THREADS, rounds, GAN_STEPS, kr, rr, c->d_norm, bench_jnum(n[0], kdm),
               bench_jnum(n[1], kgm), bench_jnum(n[2], rdm), bench_jnum(n[3], rgm),
               bench_jnum(n[4], kl[0]), bench_jnum(n[5], rc.loss_d), bench_jnum(n[6], worst),
               bench_jnum(n[7], klast), bench_jnum(n[8], rlast),
               getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "unset");
    snprintf(cas, sizeof cas, "%s/peak_rss", tag);
    bench_emit("gan", cas, "bytes", 0, km.growth, rm.growth, "torch-cpu-f32 peak RSS growth", 1.25,
               ",\"measure\":\"peak RSS over %d iterations less the RSS with models and batch "
               "loaded, a fresh process per side, each field the median of KPL_BENCH_MEM_ROUNDS "
               "alternating runs\",\"kpl_peak_rss\":%s,\"ref_peak_rss\":%s,"
               "\"kpl_allocator_peak\":%s",
               GAN_MEM_STEPS, bench_jnum(n[1], km.peak), bench_jnum(n[2], rm.peak),
               bench_jnum(n[3], km.alloc_peak));
    snapshot_free(&ginit);
    snapshot_free(&dinit);
    gan_free(&r);
    kpl_pool_pop(top);
    return 0;
}

int main(int argc, char **argv)
{
    const char *usage = "usage: bench_gan BENCH_DIR WORK_DIR [--cases dcgan,wgangp] [--batch N] "
                        "[--side S]\n       bench_gan --mem dcgan|wgangp [options]\n";
    int64_t batch = 64, side = 32;
    const char *cases = "dcgan,wgangp", *mem = NULL, *pos[2] = {NULL, NULL};
    int npos = 0;
    char tail[256] = "";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int64_t *dst = !strcmp(a, "--batch") ? &batch : !strcmp(a, "--side") ? &side : NULL;
        if (dst && i + 1 < argc) {
            *dst = atoll(argv[++i]);
            size_t l = strlen(tail);
            snprintf(tail + l, sizeof tail - l, " %s %s", a, argv[i]);
            if (*dst <= 1 || *dst > 4096) {
                fprintf(stderr, "bench_gan: %s %s out of range\n", a, argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--cases") && i + 1 < argc) {
            cases = argv[++i];
        } else if (!strcmp(a, "--mem") && i + 1 < argc) {
            mem = argv[++i];
        } else if (a[0] != '-' && npos < 2) {
            pos[npos++] = a;
        } else {
            fputs(usage, stderr);
            return 2;
        }
    }
    kpl_set_num_threads(GAN_THREADS);
    gan_case dc, wc;
    make_case(&dc, "dcgan", batch, side);
    make_case(&wc, "wgangp", batch, side);
    if (mem) {
        if (strcmp(mem, "dcgan") && strcmp(mem, "wgangp")) {
            fputs(usage, stderr);
            return 2;
        }
        return mem_main(!strcmp(mem, "dcgan") ? &dc : &wc);
    }
    if (npos != 2) {
        fputs(usage, stderr);
        return 2;
    }
    rounds = bench_env_int("KPL_BENCH_ROUNDS", 5, 1, 64);
    char self[1024];
    bench_self_path(self, sizeof self);
    if (strstr(cases, "dcgan") && run_case(&dc, pos[0], pos[1], self, tail)) return 1;
    if (strstr(cases, "wgangp") && run_case(&wc, pos[0], pos[1], self, tail)) return 1;
    return bench_exit_code();
}
