/* test_gan.c — a task with two models and two optimizers stepping in
 * turn, through kpl_trainer: a tiny GAN on Fashion-MNIST.  Its losses must
 * move as a GAN's do (from 2 ln 2 and ln 2, the discriminator pulling
 * ahead first, neither collapsing), the discriminator's parameters must
 * take no gradient from the generator's step, and a checkpoint must hold
 * both models and both optimizers.  The task keeps state of its own, an
 * exponential moving average of G's last layer and a count of its steps,
 * in checkpoints (save/restore): a run stopped and resumed ends with the
 * same average, to the bit, as one that was not. */
#include "kpl_test.h"
#include "trainer.h"

#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#define FM "/usr/share/datasets/fashion-mnist"
#define Z 16
#define STEPS 150

#define EMA 0.9

typedef struct {
    kpl_tensor *ema;   /* EMA of G's fc2.weight (no gradient) */
    kpl_tensor *steps; /* (1) i64: G's steps */
    double loss_d[STEPS], loss_g[STEPS];
    int n;
    double real_sum, fake_sum, count; /* evaluation: D's probabilities */
} gan;

static kpl_status build(kpl_trainer *t, const char *name, bool generator)
{
    kpl_module *m = NULL;
    kpl_status st = kpl_nn_sequential_root(kpl_trainer_device(t), generator ? 2 : 3, &m);
    if (st < 0) return st;
    if (generator) {
        if ((st = kpl_nn_linear(m, "fc1", Z, 128, true, NULL)) < 0 ||
            (st = kpl_nn_relu(m, "relu", NULL)) < 0 ||
            (st = kpl_nn_linear(m, "fc2", 128, 784, true, NULL)) < 0 ||
            (st = kpl_nn_activation(m, "tanh", KPL_NN_TANH, 0, NULL)) < 0) {
            kpl_module_destroy(m);
            return st;
        }
    } else if ((st = kpl_nn_flatten(m, "flatten", NULL)) < 0 ||
               (st = kpl_nn_linear(m, "fc1", 784, 128, true, NULL)) < 0 ||
               (st = kpl_nn_activation(m, "lrelu", KPL_NN_LEAKY_RELU, 0.2, NULL)) < 0 ||
               (st = kpl_nn_linear(m, "fc2", 128, 1, true, NULL)) < 0) {
        kpl_module_destroy(m);
        return st;
    }
    /* each model its own optimizer: Adam(2e-4, betas 0.5, 0.999), DCGAN's */
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    snprintf(oc.name, sizeof oc.name, "adam");
    oc.lr = 2e-4;
    oc.beta1 = 0.5;
    return kpl_trainer_add_model(t, name, generator ? "generator" : "discriminator", m, &oc, NULL);
}

static gan *seen; /* the test reads the task's losses here */

static kpl_status gan_create(kpl_trainer *t, void **state)
{
    *state = seen = calloc(1, sizeof(gan));
    if (!*state) return kpl_set_error(KPL_ENOMEM, "gan: out of memory");
    gan *s = seen;
    kpl_status st = build(t, "d", false); /* model 0: reduced first */
    if (st >= 0) st = build(t, "g", true);
    if (st < 0) return st;
    kpl_tensor *w = kpl_module_get_param(kpl_module_find(kpl_trainer_model(t, 1), "fc2"), "weight");
    int64_t one = 1;
    st = kpl_tensor_zeros(kpl_device_cpu(), KPL_I64, 1, &one, &s->steps);
    if (st >= 0) st = kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, kpl_tensor_ndim(w),
                                       kpl_tensor_shape(w), &s->ema);
    return st < 0 ? st : kpl_k_copy(s->ema, w);
}

static void gan_destroy(void *state)
{
    gan *s = state;
    kpl_tensor_release(s->ema);
    kpl_tensor_release(s->steps);
    free(state);
}

/* ema = EMA ema + (1 - EMA) w after each of G's steps */
static kpl_status ema_update(kpl_trainer *t, gan *s)
{
    kpl_tensor *w = kpl_module_get_param(kpl_module_find(kpl_trainer_model(t, 1), "fc2"), "weight");
    const float *pw = kpl_tensor_host_data(w);
    float *pe = kpl_tensor_host_mutable(s->ema);
    int64_t *n = kpl_tensor_host_mutable(s->steps);
    if (!pw || !pe || !n) return kpl_last_status();
    for (int64_t i = 0; i < kpl_tensor_numel(w); i++)
        pe[i] = (float)(EMA * pe[i] + (1 - EMA) * pw[i]);
    n[0]++;
    return KPL_OK;
}

/* The task's own state in checkpoints, as "task.*" tensors. */
static kpl_status gan_save(kpl_trainer *t, void *state, kpl_checkpoint *c)
{
    (void)t;
    gan *s = state;
    kpl_status st = kpl_checkpoint_add(c, "task.ema.fc2.weight", s->ema);
    return st < 0 ? st : kpl_checkpoint_add(c, "task.steps", s->steps);
}

static kpl_status gan_restore(kpl_trainer *t, void *state, const kpl_checkpoint *c)
{
    (void)t;
    gan *s = state;
    kpl_tensor *e = kpl_checkpoint_find(c, "task.ema.fc2.weight");
    kpl_tensor *n = kpl_checkpoint_find(c, "task.steps");
    if (!e || !n) return KPL_OK; /* a checkpoint from before: the average starts afresh */
    kpl_status st = kpl_k_copy(s->ema, e);
    return st < 0 ? st : kpl_k_copy(s->steps, n);
}

/* G(z) for a batch of n, z from the generator's generator */
static kpl_tensor *fake(kpl_trainer *t, int64_t n)
{
    kpl_module *g = kpl_trainer_model(t, 1);
    int64_t zs[2] = {n, Z}, img[4] = {n, 1, 28, 28};
    kpl_tensor *z = kpl_randn(kpl_trainer_device(t), KPL_F32, 2, zs, kpl_module_rng(g), 0, 1);
    return kpl_reshape(kpl_module_forward(g, z), 4, img);
}

static kpl_tensor *ones_like(kpl_tensor *x, double v)
{
    return kpl_full(kpl_tensor_device(x), KPL_F32, kpl_tensor_ndim(x), kpl_tensor_shape(x), v);
}

static kpl_status gan_train_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    gan *s = state;
    kpl_module *d = kpl_trainer_model(t, 0);
    kpl_status st = KPL_OK;
    double ld = 0, lg = 0;
    /* the discriminator: real images 1, generated ones 0 (G's output
     * detached: D's loss sends nothing into G) */
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *f = kpl_detach(fake(t, b->size));
    kpl_tensor *dr = kpl_module_forward(d, b->image), *df = kpl_module_forward(d, f);
    kpl_tensor *loss = kpl_add(kpl_bce_with_logits(dr, ones_like(dr, 1), KPL_REDUCE_MEAN),
                               kpl_bce_with_logits(df, ones_like(df, 0), KPL_REDUCE_MEAN));
    if (loss) kpl_tensor_retain(loss);
    kpl_pool_pop(p);
    st = kpl_trainer_backward(t, 0, loss, &ld);
    kpl_tensor_release(loss);
    if (st >= 0) st = kpl_trainer_update(t, 0);
    /* the generator: fool the discriminator, whose parameters take no
     * gradient meanwhile */
    if (st >= 0) st = kpl_module_set_requires_grad(d, false);
    p = kpl_pool_push();
    kpl_tensor *dg = kpl_module_forward(d, fake(t, b->size));
    loss = kpl_bce_with_logits(dg, ones_like(dg, 1), KPL_REDUCE_MEAN);
    if (loss) kpl_tensor_retain(loss);
    kpl_pool_pop(p);
    if (st >= 0) st = kpl_trainer_backward(t, 1, loss, &lg);
    kpl_tensor_release(loss);
    kpl_status rs = kpl_module_set_requires_grad(d, true);
    if (st < 0) return st;
    if (rs < 0) return rs;
    if (s->n < STEPS) s->loss_d[s->n] = ld, s->loss_g[s->n++] = lg;
    if ((st = ema_update(t, s)) < 0) return st;
    double n = (double)b->size;
    kpl_status r1 = kpl_trainer_record(t, "loss_d", ld * n, n);
    return r1 < 0 ? r1 : kpl_trainer_record(t, "loss_g", lg * n, n);
}

static kpl_status gan_eval_begin(kpl_trainer *t, void *state)
{
    (void)t;
    gan *s = state;
    s->real_sum = s->fake_sum = s->count = 0;
    return KPL_OK;
}

/* mean sigmoid(D(x)) of real and of generated images */
static kpl_status gan_eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    gan *s = state;
    kpl_module *d = kpl_trainer_model(t, 0);
    kpl_tensor *pr = kpl_sigmoid(kpl_module_forward(d, b->image));
    kpl_tensor *pf = kpl_sigmoid(kpl_module_forward(d, fake(t, b->size)));
    const float *r = pr ? kpl_tensor_host_data(pr) : NULL, *f = pf ? kpl_tensor_host_data(pf) : NULL;
    if (!r || !f) return kpl_last_status();
    for (int64_t i = 0; i < b->size; i++) {
        if (!kpl_trainer_eval_counts(t, b, i)) continue;
        s->real_sum += r[i], s->fake_sum += f[i], s->count += 1;
    }
    return KPL_OK;
}

static kpl_status gan_eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    gan *s = state;
    double v[3] = {s->real_sum, s->fake_sum, s->count};
    kpl_status st = kpl_trainer_sum(t, v, 3);
    if (st < 0) return st;
    res->examples = (int64_t)v[2];
    if ((st = kpl_figures_set(&res->metrics, "d_real", v[0] / v[2])) < 0) return st;
    return kpl_figures_set(&res->metrics, "d_fake", v[1] / v[2]);
}

static const kpl_task_kind gan_task = {
    .name = "toygan", .best_metric = "d_fake", .best_higher = true,
    .create = gan_create, .destroy = gan_destroy, .train_batch = gan_train_batch,
    .eval_begin = gan_eval_begin, .eval_batch = gan_eval_batch, .eval_end = gan_eval_end,
    .save = gan_save, .restore = gan_restore,
};

static double mean(const double *v, int a, int b)
{
    double s = 0;
    for (int i = a; i < b; i++) s += v[i];
    return s / (b - a);
}

static void test_gan_two_models(void **state)
{
    (void)state;
    if (access(FM "/train-images-idx3-ubyte.gz", R_OK) != 0)
        KPL_SKIP(KPL_TEST_SKIP_REF, "Fashion-MNIST (dataset-fashion-mnist)");
    char dir[] = "/tmp/kpl-gan-XXXXXX", yaml[2048];
    assert_non_null(mkdtemp(dir));
    snprintf(yaml, sizeof yaml,
             "name: gan\ntask: toygan\nseed: 1\nepochs: 1\nthreads: 2\ndeterministic: true\n"
             "run_dir: %s/run\n"
             "data:\n  root: %s\n  convert: {from: idx, source: " FM "}\n"
             "  train: {path: train, batch_size: 64, shuffle: example, limit: %d,\n"
             "          transform: {channels: 1, mean: [0.5], std: [0.5]}}\n"
             "  val: {path: test, batch_size: 500, limit: 1000,\n"
             "        transform: {channels: 1, mean: [0.5], std: [0.5]}}\n"
             "optimizer: {lr: 2.0e-4}\n"
             "log: {every_steps: 50, progress: never, tensorboard: false}\n",
             dir, dir, 64 * STEPS);
    kpl_recipe *r = malloc(sizeof *r);
    OK(kpl_recipe_load_string(yaml, "gan", 0, NULL, r));
    kpl_trainer *t = NULL;
    OK(kpl_trainer_create(r, &gan_task, NULL, &t));
    assert_int_equal(kpl_trainer_num_models(t), 2);
    bool done = false;
    for (int i = 0; i < STEPS && !done; i++) {
        OK(kpl_trainer_step(t, &done));
        /* the generator's step left the discriminator no gradient */
        kpl_module *d = kpl_trainer_model(t, 0);
        for (int k = 0; k < kpl_module_num_params(d); k++) {
            kpl_tensor *gr = kpl_grad_get(kpl_module_params(d)[k]);
            if (gr) assert_close(tget(NN(kpl_max(NN(kpl_abs(gr)), NULL, 0, false)), 0), 0, 0, 0,
                                 "D's gradient after G's step", k);
        }
    }
    assert_true(done);
    /* The losses of a GAN: from 2 ln 2 and ln 2 (D's logits start near 0);
     * D pulls ahead first, then G fights back and D's loss rises again;
     * neither wins.  (With G's updates left out, measured: D's loss falls
     * steadily to 0.03 and G's rises to 3.9.) */
    gan *s = seen;
    assert_int_equal(s->n, STEPS);
    assert_close(s->loss_d[0], 2 * log(2), 0.15, 0, "first D loss", 0);
    assert_close(s->loss_g[0], log(2), 0.2, 0, "first G loss", 0);
    int lo = 0;
    double w[STEPS / 10];
    for (int i = 0; i < STEPS / 10; i++) {
        w[i] = mean(s->loss_d, 10 * i, 10 * i + 10);
        if (w[i] < w[lo]) lo = i;
        print_message("steps %3d-%3d: loss_d %.3f loss_g %.3f\n", 10 * i + 1, 10 * i + 10, w[i],
                      mean(s->loss_g, 10 * i, 10 * i + 10));
    }
    double back = w[lo];
    for (int i = lo; i < STEPS / 10; i++) back = w[i] > back ? w[i] : back;
    assert_true(w[lo] < 1.0);        /* D learned */
    assert_true(back > w[lo] + 0.1); /* G fought back */
    assert_true(mean(s->loss_d, STEPS - 30, STEPS) > 0.3);
    assert_true(mean(s->loss_g, STEPS - 30, STEPS) < 2.0);
    kpl_eval_result e;
    OK(kpl_trainer_evaluate(t, &e));
    char path[512];
    OK(kpl_trainer_save(t, "test", path, sizeof path));
    kpl_checkpoint *c = NULL;
    OK(kpl_checkpoint_load(path, &c));
    assert_non_null(kpl_checkpoint_find(c, "d.fc1.weight"));
    assert_non_null(kpl_checkpoint_find(c, "g.fc2.bias"));
    assert_non_null(kpl_checkpoint_find(c, "optim.d.fc1.weight.exp_avg"));
    assert_non_null(kpl_checkpoint_find(c, "optim.g.fc1.weight.exp_avg_sq"));
    kpl_checkpoint_destroy(c);
    double dr = kpl_figures_get(&e.metrics, "d_real"), df = kpl_figures_get(&e.metrics, "d_fake");
    print_message("D(real) %.3f D(fake) %.3f on %lld validation images\n", dr, df,
                  (long long)e.examples);
    assert_int_equal(e.examples, 1000);
    assert_true(dr > df);
    kpl_trainer_destroy(t);
    free(r);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* A copy of the task's average after a run of `steps` (resumed from its
 * own checkpoint when resume). */
static void run(const char *dir, const char *name, int max_steps, bool resume, float *ema,
                int64_t *steps)
{
    char yaml[2048];
    snprintf(yaml, sizeof yaml,
             "name: gan\ntask: toygan\nseed: 3\nepochs: 1\nthreads: 2\ndeterministic: true\n"
             "run_dir: %s/%s\nmax_steps: %d\n"
             "data:\n  root: %s\n  convert: {from: idx, source: " FM "}\n"
             "  train: {path: train, batch_size: 32, shuffle: example, limit: 384,\n"
             "          transform: {channels: 1, mean: [0.5], std: [0.5]}}\n"
             "optimizer: {lr: 2.0e-4}\n"
             "log: {every_steps: 50, progress: never, tensorboard: false}\n",
             dir, name, max_steps, dir);
    kpl_recipe *r = malloc(sizeof *r);
    OK(kpl_recipe_load_string(yaml, "gan", 0, NULL, r));
    kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
    o.resume = resume ? "" : NULL;
    kpl_trainer *t = NULL;
    OK(kpl_trainer_create(r, &gan_task, &o, &t));
    OK(kpl_trainer_fit(t));
    gan *s = seen;
    OK(kpl_tensor_to_host(s->ema, ema, (size_t)kpl_tensor_numel(s->ema) * sizeof *ema));
    OK(kpl_tensor_to_host(s->steps, steps, sizeof *steps));
    kpl_trainer_destroy(t);
    free(r);
}

static void test_gan_task_state_resumes(void **state)
{
    (void)state;
    if (access(FM "/train-images-idx3-ubyte.gz", R_OK) != 0)
        KPL_SKIP(KPL_TEST_SKIP_REF, "Fashion-MNIST (dataset-fashion-mnist)");
    char dir[] = "/tmp/kpl-gan-XXXXXX";
    assert_non_null(mkdtemp(dir));
    enum { N = 784 * 128 };
    float *a = malloc(N * sizeof *a), *b = malloc(N * sizeof *b), *c = malloc(N * sizeof *c);
    int64_t na = 0, nb = 0, nc = 0;
    run(dir, "whole", 12, false, a, &na);
    run(dir, "cut", 5, false, c, &nc);
    run(dir, "cut", 12, true, b, &nb);
    assert_int_equal(na, 12);
    assert_int_equal(nc, 5);
    assert_int_equal(nb, 12); /* 5 before the checkpoint, counted on from there */
    assert_memory_equal(a, b, N * sizeof *a);
    double moved = 0;
    for (int i = 0; i < N; i++) moved += fabs((double)a[i] - c[i]);
    assert_true(moved > 0); /* the average did move between steps 5 and 12 */
    free(a), free(b), free(c);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_gan_two_models),
                                       cmocka_unit_test(test_gan_task_state_resumes)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
