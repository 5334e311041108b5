/* test_recompute.c — recomputed regions (graph.h, "recomputation"): three
 * residual blocks (convolution, training batch norm with ReLU, dropout,
 * convolution, a host-side scale kept for the replay) run with and
 * without regions must give the same loss, gradients, running statistics
 * and generator positions bit for bit, while the forward holds less; the
 * last region is not recomputed; gradients of gradients through regions;
 * bf16 autocast; a replay that computes something else fails naming the
 * region; nested regions belong to the outer one. */
#include "ag_test.h"

#include <string.h>

int run_recompute_tests(void);

enum { N = 4, C = 8, H = 16, W = 16, NBLK = 3 };

typedef struct {
    kpl_tensor *w1, *w2, *g, *b, *rm, *rv;
    kpl_rng *rng;
    int calls;      /* forwards run by block_again */
    int host_count; /* a side effect of the host: the scale of the output */
    bool diverge;   /* the replay adds an op */
    bool smooth;    /* tanh instead of batch norm + ReLU + dropout (second order) */
} blk;

static kpl_tensor *f32_from(kpl_rng *r, int nd, const int64_t *shape, double scale)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, nd, shape, &t));
    OK(kpl_k_normal(t, r, 0, scale));
    return t;
}

static void blk_init(blk *s, uint64_t seed)
{
    memset(s, 0, sizeof *s);
    kpl_rng *r = kpl_rng_create(seed);
    int64_t ws[4] = {C, C, 3, 3}, cs = C;
    s->w1 = f32_from(r, 4, ws, 0.15);
    s->w2 = f32_from(r, 4, ws, 0.15);
    s->g = f32_from(r, 1, &cs, 0.1);
    OK(kpl_k_binary_scalar(s->g, KPL_BIN_ADD, s->g, 1, false));
    s->b = f32_from(r, 1, &cs, 0.1);
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &cs, &s->rm));
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 1, &cs, &s->rv));
    OK(kpl_k_fill(s->rv, 1));
    kpl_tensor *ps[4] = {s->w1, s->w2, s->g, s->b};
    for (int i = 0; i < 4; i++)
        OK(kpl_set_requires_grad(ps[i], true));
    kpl_rng_destroy(r);
    s->rng = kpl_rng_create(seed + 100);
}

static void blk_free(blk *s)
{
    kpl_tensor *ts[6] = {s->w1, s->w2, s->g, s->b, s->rm, s->rv};
    for (int i = 0; i < 6; i++)
        kpl_tensor_release(ts[i]);
    kpl_rng_destroy(s->rng);
}

static kpl_tensor *block(blk *s, kpl_tensor *x)
{
    kpl_conv2d_params p = KPL_CONV2D_PARAMS_INIT;
    p.padding[0] = p.padding[1] = 1;
    kpl_tensor *h = kpl_conv2d(x, s->w1, NULL, &p);
    if (s->smooth) {
        h = kpl_tanh(h);
    } else {
        h = kpl_batch_norm_relu(h, s->g, s->b, s->rm, s->rv, true, 0.1, 1e-5);
        h = kpl_dropout(h, 0.25, true, s->rng);
    }
    h = kpl_conv2d(h, s->w2, NULL, &p);
    /* a value from the host that changes at every call: kept for the replay */
    kpl_tensor *scale = NULL;
    if (kpl_recompute_replaying()) {
        scale = kpl_recompute_replayed();
    } else {
        scale = kpl_full(kpl_device_cpu(), KPL_F32, 0, NULL, 1 + 0.125 * s->host_count++);
        OK(kpl_recompute_keep(scale));
    }
    h = kpl_mul(h, scale);
    if (s->diverge && kpl_recompute_replaying()) h = kpl_neg(kpl_neg(h));
    return s->smooth ? kpl_tanh(kpl_add(h, x)) : kpl_relu(kpl_add(h, x));
}

static kpl_status block_again(void *user, int n, kpl_tensor *const *in)
{
    (void)n;
    blk *s = user;
    s->calls++;
    return block(s, in[0]) ? KPL_OK : kpl_last_status();
}

static kpl_tensor *run_block(blk *s, kpl_tensor *x, bool recompute)
{
    kpl_recompute *r = NULL;
    if (recompute) {
        OK(kpl_recompute_begin("blocks.1", 1, &x, block_again, s, &r));
        assert_non_null(r);
    }
    /* the block's temporaries go with its pool (as a module's do) */
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *y = block(s, x);
    if (y) kpl_tensor_retain(y);
    kpl_pool_pop(p);
    if (y) kpl_autorelease(y);
    if (recompute) OK(kpl_recompute_end(r, y ? 1 : 0, &y));
    return y;
}

/* What one run leaves: the loss, every gradient, the running statistics,
 * the generators' offsets, the bytes held after the forward. */
typedef struct {
    float loss;
    float *grads[NBLK][4], *xgrad, *stats[NBLK][2];
    uint64_t rng_offset[NBLK];
    int calls[NBLK];
    size_t held, base, peak; /* allocated after the forward, before it; the step's peak */
    uint64_t replays, evictions;
    kpl_status st;
} outcome;

static float *host_copy(kpl_tensor *t)
{
    assert_non_null(t);
    assert_int_equal(kpl_tensor_dtype(t), KPL_F32);
    float *v = malloc(kpl_tensor_nbytes(t));
    assert_non_null(v);
    OK(kpl_tensor_to_host(t, v, kpl_tensor_nbytes(t)));
    return v;
}

/* The three blocks with or without regions; budget: the allocator's
 * bound (kpl_recompute_set_budget), 0 for none. */
static void run_net_budget(bool recompute, kpl_dtype autocast, bool diverge, size_t budget,
                           outcome *o)
{
    memset(o, 0, sizeof *o);
    blk s[NBLK];
    for (int k = 0; k < NBLK; k++)
        blk_init(&s[k], 11 + (uint64_t)k);
    s[0].diverge = diverge;
    kpl_rng *r = kpl_rng_create(5);
    int64_t xs[4] = {N, C, H, W};
    kpl_tensor *x = f32_from(r, 4, xs, 1);
    kpl_rng_destroy(r);
    OK(kpl_set_requires_grad(x, true));
    kpl_dtype prev = KPL_F32;
    uint64_t replays0 = kpl_recompute_count(), ev0 = kpl_recompute_evictions();
    kpl_device *cpu = kpl_device_cpu();
    kpl_pool *p = kpl_pool_push();
    o->base = kpl_device_memory_stats(cpu).allocated;
    kpl_device_reset_peak(cpu);
    bool regen = kpl_regenerate_enabled();
    if (budget) OK(kpl_recompute_set_budget(cpu, o->base + budget));
    /* a budget turns regeneration off while it holds (graph.h) */
    if (budget) assert_false(kpl_regenerate_enabled());
    OK(kpl_set_autocast(autocast, &prev));
    kpl_tensor *y = x;
    for (int k = 0; k < NBLK && y; k++)
        y = run_block(&s[k], y, recompute);
    OK(kpl_set_autocast(prev, NULL));
    kpl_tensor *loss = y ? kpl_mean(kpl_square(kpl_cast(y, KPL_F32)), NULL, 0, false) : NULL;
    o->held = kpl_device_memory_stats(cpu).allocated;
    kpl_status st = loss ? kpl_backward(loss, NULL, false) : kpl_last_status();
    o->peak = kpl_device_memory_stats(cpu).peak_allocated;
    o->st = st;
    o->evictions = kpl_recompute_evictions() - ev0;
    if (budget) OK(kpl_recompute_set_budget(cpu, 0));
    assert_int_equal(kpl_regenerate_enabled(), regen);
    if (budget && st < 0) {
        print_message("over the budget: %s\n", kpl_last_error());
    } else if (diverge) {
        assert_int_equal(st, KPL_ESTATE);
        print_message("diverged: %s\n", kpl_last_error());
        assert_non_null(strstr(kpl_last_error(), "recompute of 'blocks.1'"));
        assert_non_null(strstr(kpl_last_error(), "neg"));
    } else {
        OK(st);
        o->loss = tget(loss, 0);
        o->xgrad = host_copy(kpl_grad_get(x));
        for (int k = 0; k < NBLK; k++) {
            kpl_tensor *ps[4] = {s[k].w1, s[k].w2, s[k].g, s[k].b};
            for (int i = 0; i < 4; i++)
                o->grads[k][i] = host_copy(kpl_grad_get(ps[i]));
            o->stats[k][0] = host_copy(s[k].rm);
            o->stats[k][1] = host_copy(s[k].rv);
        }
    }
    kpl_pool_pop(p);
    o->replays = kpl_recompute_count() - replays0;
    for (int k = 0; k < NBLK; k++) {
        o->rng_offset[k] = kpl_rng_offset(s[k].rng);
        o->calls[k] = s[k].calls;
        blk_free(&s[k]);
    }
    kpl_tensor_release(x);
}

static void run_net(bool recompute, kpl_dtype autocast, bool diverge, outcome *o)
{
    run_net_budget(recompute, autocast, diverge, 0, o);
}

static void outcome_free(outcome *o)
{
    free(o->xgrad);
    for (int k = 0; k < NBLK; k++) {
        for (int i = 0; i < 4; i++)
            free(o->grads[k][i]);
        free(o->stats[k][0]);
        free(o->stats[k][1]);
    }
}

static void assert_same(const outcome *a, const outcome *b)
{
    size_t xb = (size_t)N * C * H * W * sizeof(float), wb = (size_t)C * C * 9 * sizeof(float);
    size_t cb = C * sizeof(float);
    assert_memory_equal(&a->loss, &b->loss, sizeof a->loss);
    assert_memory_equal(a->xgrad, b->xgrad, xb);
    for (int k = 0; k < NBLK; k++) {
        size_t sz[4] = {wb, wb, cb, cb};
        for (int i = 0; i < 4; i++)
            assert_memory_equal(a->grads[k][i], b->grads[k][i], sz[i]);
        assert_memory_equal(a->stats[k][0], b->stats[k][0], cb);
        assert_memory_equal(a->stats[k][1], b->stats[k][1], cb);
        assert_int_equal(a->rng_offset[k], b->rng_offset[k]);
    }
}

static void test_regions_exact(void **state)
{
    (void)state;
    kpl_dtype dts[2] = {KPL_F32, KPL_BF16};
    for (int d = 0; d < 2; d++) {
        outcome plain, rec;
        run_net(false, dts[d], false, &plain);
        run_net(true, dts[d], false, &rec);
        print_message("%s: forward holds %zu bytes, %zu with regions; %llu replays\n",
                      kpl_dtype_name(dts[d]), plain.held, rec.held,
                      (unsigned long long)rec.replays);
        assert_same(&plain, &rec);
        /* the first two regions ran again once each; the last one, whose
         * tensors the backward needs first, kept them */
        assert_int_equal(rec.calls[0], 1);
        assert_int_equal(rec.calls[1], 1);
        assert_int_equal(rec.calls[2], 0);
        assert_int_equal(rec.replays, 2);
        assert_int_equal(plain.replays, 0);
        /* each stripped block lets go of at least its convolution's and
         * batch norm's outputs and the dropout mask: 3 activations */
        size_t act = (size_t)N * C * H * W * kpl_dtype_size(dts[d]);
        assert_true(rec.held + 2 * 3 * act <= plain.held);
        outcome_free(&plain);
        outcome_free(&rec);
    }
}

/* Under a budget between the peak with every region let go and the peak
 * without any: the step stays under it, lets some regions go, and gives
 * the same bits; a budget below what the step needs with every region
 * let go fails, naming it. */
static void test_budget(void **state)
{
    (void)state;
    outcome plain, all, mid, tiny;
    run_net(false, KPL_F32, false, &plain);
    run_net(true, KPL_F32, false, &all);
    size_t p_plain = plain.peak - plain.base, p_all = all.peak - all.base;
    size_t budget = (p_plain + p_all) / 2;
    run_net_budget(true, KPL_F32, false, budget, &mid);
    print_message("step peak: %zu bytes without regions, %zu with all let go, %zu under a "
                  "budget of %zu (%llu evictions, %llu replays)\n",
                  p_plain, p_all, mid.peak - mid.base, budget, (unsigned long long)mid.evictions,
                  (unsigned long long)mid.replays);
    assert_true(p_all < p_plain);
    OK(mid.st);
    assert_true(mid.peak - mid.base <= budget);
    assert_true(mid.evictions >= 1);
    assert_true(mid.replays >= 1 && mid.replays <= 2);
    assert_same(&plain, &mid);
    /* a budget the blocks' inputs alone do not fit */
    run_net_budget(true, KPL_F32, false, (size_t)N * C * H * W * 4, &tiny);
    assert_int_equal(tiny.st, KPL_ENOMEM);
    assert_non_null(strstr(kpl_last_error(), "over the memory budget of"));
    outcome_free(&plain);
    outcome_free(&all);
    outcome_free(&mid);
    outcome_free(&tiny);
}

static void test_replay_diverges(void **state)
{
    (void)state;
    outcome o;
    run_net(true, KPL_F32, true, &o);
    outcome_free(&o);
}

/* Gradients of gradients: a penalty on the input gradient (WGAN-GP's)
 * through regions, recomputed with their graph. */
static void second_order(bool recompute, float **gw, uint64_t *replays)
{
    blk s[2];
    for (int k = 0; k < 2; k++) {
        blk_init(&s[k], 31 + (uint64_t)k);
        s[k].smooth = true;
    }
    kpl_rng *r = kpl_rng_create(8);
    int64_t xs[4] = {2, C, 6, 6};
    kpl_tensor *x = f32_from(r, 4, xs, 1);
    kpl_rng_destroy(r);
    OK(kpl_set_requires_grad(x, true));
    uint64_t r0 = kpl_recompute_count();
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *y = x;
    for (int k = 0; k < 2; k++)
        y = run_block(&s[k], y, recompute);
    kpl_tensor *out = kpl_sum(kpl_square(y), NULL, 0, false), *gx = NULL;
    OK(kpl_grad(out, NULL, 1, &x, true, &gx));
    kpl_tensor *pen = kpl_sum(kpl_square(gx), NULL, 0, false);
    OK(kpl_backward(pen, NULL, false));
    for (int k = 0; k < 2; k++) {
        gw[2 * k] = host_copy(kpl_grad_get(s[k].w1));
        gw[2 * k + 1] = host_copy(kpl_grad_get(s[k].w2));
    }
    kpl_pool_pop(p);
    *replays = kpl_recompute_count() - r0;
    for (int k = 0; k < 2; k++)
        blk_free(&s[k]);
    kpl_tensor_release(x);
}

static void test_second_order(void **state)
{
    (void)state;
    float *a[4], *b[4];
    uint64_t ra = 0, rb = 0;
    second_order(false, a, &ra);
    second_order(true, b, &rb);
    assert_int_equal(ra, 0);
    assert_int_equal(rb, 1);
    for (int i = 0; i < 4; i++) {
        assert_memory_equal(a[i], b[i], (size_t)C * C * 9 * sizeof(float));
        free(a[i]);
        free(b[i]);
    }
}

static kpl_status nothing_again(void *user, int n, kpl_tensor *const *in)
{
    (void)user, (void)n, (void)in;
    return KPL_OK;
}

static void test_nesting_and_modes(void **state)
{
    (void)state;
    int64_t s4 = 4;
    kpl_tensor *w = param(1, &s4, 3, -1, 1);
    kpl_pool *p = kpl_pool_push();
    kpl_recompute *outer = NULL, *inner = NULL;
    OK(kpl_recompute_begin("outer", 1, &w, nothing_again, NULL, &outer));
    assert_non_null(outer);
    OK(kpl_recompute_begin("inner", 1, &w, nothing_again, NULL, &inner));
    assert_null(inner); /* the outer region holds its ops */
    OK(kpl_recompute_end(inner, 1, &w));
    kpl_tensor *y = kpl_exp(w);
    OK(kpl_recompute_end(outer, 1, &y));
    /* grad mode off: no region */
    bool prev = kpl_set_grad_enabled(false);
    OK(kpl_recompute_begin("off", 1, &w, nothing_again, NULL, &inner));
    assert_null(inner);
    kpl_set_grad_enabled(prev);
    /* bad arguments */
    assert_int_equal(kpl_recompute_begin("x", 0, &w, nothing_again, NULL, &inner), KPL_EINVAL);
    assert_int_equal(kpl_recompute_begin("x", 1, &w, NULL, NULL, &inner), KPL_EINVAL);
    /* keep and replayed outside regions */
    OK(kpl_recompute_keep(w));
    assert_null(kpl_recompute_replayed());
    assert_int_equal(kpl_last_status(), KPL_ESTATE);
    OK(kpl_backward(kpl_sum(y, NULL, 0, false), NULL, false));
    kpl_pool_pop(p);
    kpl_tensor_release(w);
}

int run_recompute_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_regions_exact),
        cmocka_unit_test(test_replay_diverges),
        cmocka_unit_test(test_budget),
        cmocka_unit_test(test_second_order),
        cmocka_unit_test(test_nesting_and_modes),
    };
    return cmocka_run_group_tests_name("recompute", tests, NULL, NULL);
}
