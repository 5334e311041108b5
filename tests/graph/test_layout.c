/*
 * test_layout.c — kept layouts (kpl_set_blocked_layouts): a residual
 * block (convolutions, batch norm, the fused batch norm + ReLU, ReLU, the
 * shortcut's add) trained one step with the activations kept in oneDNN's
 * layouts must give bit-identical losses and gradients to the same step
 * with plain tensors, in f32 and under bf16 autocast; the kept path must
 * be taken exactly where the kernel oneDNN chose keeps its output in a
 * kept layout (nChw16c or NHWC: which depends on the ISA: AVX-512 direct
 * kernels write nChw16c, AMX's brgemm kernels NHWC, AVX2's nChw8c ones
 * neither; ctest also runs this file with oneDNN capped to AVX2,
 * AVX512_CORE and AVX512_CORE_BF16, so every machine runs the paths of the
 * smaller ones), and any other reader of a kept tensor (a reshape, a host
 * read, a narrow) sees it plain.  Every test runs three times: with
 * oneDNN's choice (KPL_LAYOUT_AUTO) and with every convolution asked for
 * nChw16c and for NHWC (kpl_set_kept_layout), so each tag's paths run on
 * every CPU.
 */
#include "kpl_test.h"

#include "autograd.h"
#include "kernels_impl.h"

static kpl_device *cpu;

static const kpl_layout layouts[3] = {KPL_LAYOUT_AUTO, KPL_LAYOUT_NCHW16C, KPL_LAYOUT_NHWC};
static const char *const layout_names[3] = {"auto", "nChw16c", "NHWC"};

/* Each test runs under its layout setting (its prestate), set by the
 * setup and put back by the teardown, which cmocka runs after a failure
 * too. */
static kpl_layout saved_layout;

static int layout_setup(void **state)
{
    kpl_layout l = *(const kpl_layout *)*state;
    print_message("kept layout: %s\n", layout_names[l]);
    saved_layout = kpl_set_kept_layout(l);
    return 0;
}

static int layout_teardown(void **state)
{
    (void)state;
    kpl_set_kept_layout(saved_layout);
    return 0;
}

/* The kept layout a convolution's output must be held in: NHWC where
 * asked (every ISA's oneDNN has NHWC kernels), else what the chosen kernel
 * writes (nChw16c where asked and the ISA has 16-channel kernels; under
 * AVX2, whose direct kernels block by 8, the request falls back to
 * oneDNN's own choice). */
static kpl_kept want_kept(kpl_conv_choice ch)
{
    return kpl_get_kept_layout() == KPL_LAYOUT_NHWC ? KPL_KEPT_NHWC : (kpl_kept)ch.out_kept;
}

static const char *kept_name(kpl_kept k)
{
    return k == KPL_KEPT_NHWC ? "NHWC" : k == KPL_KEPT_NC16 ? "nChw16c" : "plain";
}

typedef struct {
    kpl_tensor *w1, *w2, *ws, *g[3], *b[3], *lw;
} block_params;

static kpl_tensor *param(kpl_rng *rng, int nd, const int64_t *shape, double lo, double hi)
{
    kpl_tensor *t = NN(kpl_rand(cpu, KPL_F32, nd, shape, rng, lo, hi));
    OK(kpl_set_requires_grad(t, true));
    return t;
}

static block_params make_params(void)
{
    kpl_rng *rng = kpl_rng_create(7);
    block_params p;
    p.w1 = param(rng, 4, (int64_t[]){32, 16, 3, 3}, -0.1, 0.1);
    p.w2 = param(rng, 4, (int64_t[]){32, 32, 3, 3}, -0.1, 0.1);
    p.ws = param(rng, 4, (int64_t[]){32, 16, 1, 1}, -0.3, 0.3);
    for (int i = 0; i < 3; i++) {
        p.g[i] = param(rng, 1, (int64_t[]){32}, 0.5, 1.5);
        p.b[i] = param(rng, 1, (int64_t[]){32}, -0.5, 0.5);
    }
    p.lw = param(rng, 2, (int64_t[]){10, 32}, -0.2, 0.2);
    kpl_rng_destroy(rng);
    return p;
}

#define NPARAM 10

/* One step of the block; the loss and the parameters' gradients. */
static double step(const block_params *p, kpl_tensor *x, kpl_tensor *labels, kpl_dtype prec,
                   kpl_tensor **grads, kpl_kept *saw, kpl_conv_choice *first)
{
    OK(kpl_set_autocast(prec, NULL));
    kpl_conv2d_params c3 = {.stride = {2, 2}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    kpl_conv2d_params c3s1 = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    kpl_conv2d_params c1 = {.stride = {2, 2}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1};
    kpl_tensor *h = NN(kpl_conv2d(x, p->w1, NULL, &c3));
    *saw = kpl__kept(h);
    *first = kpl__cpu_conv_last();
    h = NN(kpl_batch_norm_relu(h, p->g[0], p->b[0], NULL, NULL, true, 0.1, 1e-5));
    h = NN(kpl_batch_norm(NN(kpl_conv2d(h, p->w2, NULL, &c3s1)), p->g[1], p->b[1], NULL, NULL,
                          true, 0.1, 1e-5));
    kpl_tensor *s = NN(kpl_batch_norm(NN(kpl_conv2d(x, p->ws, NULL, &c1)), p->g[2], p->b[2],
                                      NULL, NULL, true, 0.1, 1e-5));
    h = NN(kpl_relu(NN(kpl_add(h, s))));
    kpl_tensor *pooled = NN(kpl_mean(h, (int[]){2, 3}, 2, false));
    kpl_tensor *logits = NN(kpl_linear(pooled, p->lw, NULL));
    kpl_tensor *loss = NN(kpl_cross_entropy(logits, labels, KPL_REDUCE_MEAN, 0, -100));
    OK(kpl_set_autocast(KPL_F32, NULL));
    kpl_tensor *ps[NPARAM] = {p->w1, p->w2, p->ws, p->g[0], p->g[1], p->g[2],
                              p->b[0], p->b[1], p->b[2], p->lw};
    OK(kpl_grad(loss, NULL, NPARAM, ps, false, grads));
    return tget(loss, 0);
}

static void same_step(kpl_dtype prec)
{
    kpl_pool *pool = kpl_pool_push();
    kpl_rng *rng = kpl_rng_create(11);
    block_params p = make_params();
    kpl_tensor *x = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){4, 16, 8, 8}, rng, 0, 1));
    int64_t lab[4] = {1, 7, 3, 9};
    kpl_tensor *labels = NULL;
    OK(kpl_tensor_from_data(cpu, KPL_I64, 1, (int64_t[]){4}, lab, &labels));
    kpl_autorelease(labels);
    kpl_tensor *gp[NPARAM], *gb[NPARAM];
    kpl_kept saw_plain, saw_kept;
    kpl_conv_choice cp, cb;
    bool prev = kpl_set_blocked_layouts(false);
    double lp = step(&p, x, labels, prec, gp, &saw_plain, &cp);
    kpl_set_blocked_layouts(true);
    double lb = step(&p, x, labels, prec, gb, &saw_kept, &cb);
    kpl_set_blocked_layouts(prev);
    print_message("%s under %s: convolution kernel %s in %s, output %s\n", kpl_dtype_name(prec),
                  kpl_cpu_math_info(), cb.impl, kpl_dtype_name(cb.dtype), kept_name((kpl_kept)cb.out_kept));
    assert_int_equal(saw_plain, KPL_KEPT_PLAIN);
    assert_string_equal(cp.impl, cb.impl); /* deterministic: the same kernel both times */
    assert_int_equal(cb.kind, KPL_CONV_FWD);
    /* emulated bf16 runs the f32 kernel on a copy and casts its result */
    kpl_kept want = cb.dtype == prec ? want_kept(cb) : KPL_KEPT_PLAIN;
    if (saw_kept != want || (cb.dtype == prec && (kpl_kept)cb.out_kept != want))
        fail_msg("%s: kernel %s in %s writes %s, the output is held %s, want %s",
                 kpl_dtype_name(prec), cb.impl, kpl_dtype_name(cb.dtype), kept_name((kpl_kept)cb.out_kept),
                 kept_name(saw_kept), kept_name(want));
    if (lp != lb) fail_msg("%s loss: plain %.17g, kept %.17g", kpl_dtype_name(prec), lp, lb);
    for (int i = 0; i < NPARAM; i++) {
        assert_int_equal(kpl_tensor_numel(gp[i]), kpl_tensor_numel(gb[i]));
        for (int64_t j = 0; j < kpl_tensor_numel(gp[i]); j++)
            if (tget(gp[i], j) != tget(gb[i], j))
                fail_msg("%s gradient %d[%lld]: plain %.9g, kept %.9g", kpl_dtype_name(prec), i,
                         (long long)j, tget(gp[i], j), tget(gb[i], j));
    }
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
}

static void test_step_f32(void **state)
{
    (void)state;
    same_step(KPL_F32);
}

static void test_step_bf16(void **state)
{
    (void)state;
    same_step(KPL_BF16);
}

/* Result k of the kept run equals the plain run's, value for value (NaN
 * where the plain one has NaN). */
static void expect_same(kpl_tensor *got, kpl_tensor *want, int k)
{
    assert_int_equal(kpl_tensor_numel(got), kpl_tensor_numel(want));
    for (int64_t i = 0; i < kpl_tensor_numel(want); i++) {
        double g = tget(got, i), e = tget(want, i);
        if (!(g == e || (isnan(g) && isnan(e))))
            fail_msg("result %d [%lld]: kept %.9g, plain %.9g", k, (long long)i, g, e);
    }
}

/* Plain readers of a kept tensor: a view of another shape, the host
 * accessors, a narrow and an op with broadcasting all see NCHW values. */
static void test_plain_readers(void **state)
{
    (void)state;
    kpl_pool *pool = kpl_pool_push();
    kpl_rng *rng = kpl_rng_create(3);
    kpl_tensor *x = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){2, 16, 5, 5}, rng, 0, 1));
    kpl_tensor *w = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){32, 16, 3, 3}, rng, 0, 1));
    kpl_conv2d_params c = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    bool prev = kpl_set_blocked_layouts(false);
    kpl_tensor *ref = NN(kpl_conv2d(x, w, NULL, &c));
    kpl_set_blocked_layouts(true);
    for (int reader = 0; reader < 4; reader++) {
        kpl_tensor *y = NN(kpl_conv2d(x, w, NULL, &c));
        assert_int_equal(kpl__kept(y), want_kept(kpl__cpu_conv_last()));
        kpl_tensor *seen = NULL;
        switch (reader) {
        case 0: seen = NN(kpl_reshape(y, 2, (int64_t[]){2, 800})); break;
        case 1: seen = y; break; /* tget: the host accessor */
        case 2: seen = NN(kpl_narrow(y, 1, 1)); break;
        default: seen = NN(kpl_add(y, NN(kpl_full(cpu, KPL_F32, 1, (int64_t[]){5}, 0)))); break;
        }
        kpl_tensor *want = reader == 2 ? NN(kpl_narrow(ref, 1, 1)) : ref;
        for (int64_t i = 0; i < kpl_tensor_numel(want); i++)
            if (tget(seen, i) != tget(want, i))
                fail_msg("reader %d [%lld]: %.9g, plain conv %.9g", reader, (long long)i,
                         tget(seen, i), tget(want, i));
    }
    kpl_set_blocked_layouts(prev);
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
}

/* bf16 and bool (1-byte) results of ops on kept tensors (ReLU, a
 * comparison, an add, max pooling and its indices) stay kept and read back
 * as the plain ops' results. */
static void test_blocked_dtypes(void **state)
{
    (void)state;
    if (!kpl_precision_native(KPL_DEVICE_CPU, KPL_BF16))
        KPL_SKIP(KPL_TEST_SKIP_ENV, "bf16 is emulated under this ISA (no kept bf16 kernel)");
    kpl_pool *pool = kpl_pool_push();
    kpl_rng *rng = kpl_rng_create(5);
    kpl_tensor *x = NN(kpl_cast(NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){3, 32, 6, 5}, rng, 0, 1)),
                                KPL_BF16));
    kpl_tensor *w = NN(kpl_cast(NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){32, 32, 3, 3}, rng, 0, 0.2)),
                                KPL_BF16));
    kpl_conv2d_params c = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    kpl_tensor *got[6], *want[6];
    for (int on = 0; on < 2; on++) {
        bool prev = kpl_set_blocked_layouts(on);
        kpl_tensor *y = NN(kpl_conv2d(x, w, NULL, &c));
        /* held kept exactly where the chosen kernel writes a kept layout */
        kpl_conv_choice ch = kpl__cpu_conv_last();
        if (on) print_message("bf16 kernel %s under %s\n", ch.impl, kpl_cpu_math_info());
        kpl_kept tag = on ? want_kept(ch) : KPL_KEPT_PLAIN;
        bool blocked = tag != KPL_KEPT_PLAIN;
        assert_int_equal(kpl__kept(y), tag);
        kpl_tensor *z = NN(kpl_conv2d(y, w, NULL, &c));
        kpl_tensor *r = NN(kpl_relu(y)), *gt = NN(kpl_compare(KPL_BIN_GT, y, z));
        kpl_tensor *sum = NN(kpl_add(r, z));
        /* bf16 max pooling on the kept bytes, with indices and without */
        kpl_pool2d_params mp = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
        int64_t os[4];
        OK(kpl_shape_pool2d(kpl_tensor_shape(z), &mp, os));
        kpl_tensor *pm = NULL, *pi = NULL, *pv = NULL;
        OK(kpl_tensor_empty(cpu, KPL_BF16, 4, os, &pm));
        OK(kpl_tensor_empty(cpu, KPL_I64, 4, os, &pi));
        OK(kpl_tensor_empty(cpu, KPL_BF16, 4, os, &pv));
        kpl_autorelease(pm);
        kpl_autorelease(pi);
        kpl_autorelease(pv);
        OK(kpl_k_max_pool2d(pm, pi, z, &mp));
        OK(kpl_k_max_pool2d(pv, NULL, z, &mp));
        if (blocked) {
            assert_non_null(kpl__kept_data(gt, tag)); /* 1-byte elements, kept */
            assert_non_null(kpl__kept_data(sum, tag));
            assert_non_null(kpl__kept_data(pm, tag));
            assert_non_null(kpl__kept_data(pv, tag));
        }
        kpl_tensor **out = on ? got : want;
        out[0] = r, out[1] = gt, out[2] = sum, out[3] = pm, out[4] = pi, out[5] = pv;
        kpl_set_blocked_layouts(prev);
    }
    for (int k = 0; k < 6; k++) expect_same(got[k], want[k], k);
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
}

/* Max pooling of a kept convolution output runs on the kept bytes and
 * leaves its output in that layout: values (NaN wins) and indices equal the
 * plain kernel's on the plain convolution, with and without indices, for
 * the windows the zoo uses (3x3 stride 2 padding 1, 2x2 stride 2), a
 * stride-1 window and a ceil_mode window hanging past the edge. */
static void test_blocked_max_pool(void **state)
{
    (void)state;
    kpl_pool *pool = kpl_pool_push();
    kpl_rng *rng = kpl_rng_create(9);
    /* 75 columns: the values-only kernel's runs of 32 outputs and a rest */
    enum { H = 9, W = 75 };
    kpl_tensor *x = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){2, 16, H, W}, rng, 0, 1));
    kpl_tensor *w = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){32, 16, 3, 3}, rng, 0, 0.3));
    ((float *)kpl_tensor_host_mutable(x))[(1 * 16 + 3) * H * W + 4 * W + 7] = NAN; /* one pixel */
    kpl_conv2d_params c = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    const kpl_pool2d_params ps[4] = {
        {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}},
        {.kernel = {2, 2}, .stride = {2, 2}},
        {.kernel = {3, 2}, .stride = {1, 1}, .padding = {1, 0}},
        {.kernel = {3, 3}, .stride = {2, 2}, .ceil_mode = true},
    };
    for (int k = 0; k < 4; k++)
        for (int with_idx = 0; with_idx < 2; with_idx++) {
            kpl_tensor *got[2], *want[2];
            for (int on = 0; on < 2; on++) {
                bool prev = kpl_set_blocked_layouts(on);
                kpl_tensor *y = NN(kpl_conv2d(x, w, NULL, &c));
                kpl_kept tag = kpl__kept(y);
                assert_int_equal(tag, on ? want_kept(kpl__cpu_conv_last()) : KPL_KEPT_PLAIN);
                if (on && !k && !with_idx) print_message("convolution output %s\n", kept_name(tag));
                int64_t os[4];
                OK(kpl_shape_pool2d(kpl_tensor_shape(y), &ps[k], os));
                kpl_tensor *o = NULL, *ix = NULL;
                OK(kpl_tensor_empty(cpu, KPL_F32, 4, os, &o));
                if (with_idx) OK(kpl_tensor_empty(cpu, KPL_I64, 4, os, &ix));
                OK(kpl_k_max_pool2d(o, ix, y, &ps[k]));
                assert_int_equal(kpl__kept(o), tag);
                (on ? got : want)[0] = o, (on ? got : want)[1] = ix;
                kpl_set_blocked_layouts(prev);
            }
            expect_same(got[0], want[0], 2 * k); /* values: result 2k, indices 2k + 1 */
            if (with_idx) expect_same(got[1], want[1], 2 * k + 1);
            int nan = 0;
            for (int64_t i = 0; i < kpl_tensor_numel(want[0]); i++) nan += isnan(tget(want[0], i));
            assert_true(nan > 0); /* the NaN pixel reached the pooled output */
            for (int j = 0; j < 2; j++) {
                kpl_tensor_release(got[j]);
                kpl_tensor_release(want[j]);
            }
        }
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
}

/* Per-channel binary ops ((C, 1, 1) or (1, C, 1, 1): a bias, a scale) and
 * concatenation along the channels run on blocked convolution outputs as
 * they are and leave the result blocked; a vector broadcast along W (of
 * W == C values), concatenation along H and a plain piece take the plain
 * paths.  Every result equals the plain one. */
static void test_blocked_channel_ops(void **state)
{
    (void)state;
    kpl_pool *pool = kpl_pool_push();
    kpl_rng *rng = kpl_rng_create(11);
    kpl_tensor *x = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){2, 16, 5, 32}, rng, 0, 1));
    kpl_tensor *w1 = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){32, 16, 3, 3}, rng, 0, 0.2));
    kpl_tensor *w2 = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){16, 16, 3, 3}, rng, 0, 0.2));
    kpl_tensor *bc = NN(kpl_randn(cpu, KPL_F32, 3, (int64_t[]){32, 1, 1}, rng, 0, 1));
    kpl_tensor *b4 = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){1, 32, 1, 1}, rng, 1, 0.5));
    kpl_tensor *bw = NN(kpl_randn(cpu, KPL_F32, 1, (int64_t[]){32}, rng, 0, 1));
    kpl_conv2d_params c = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    enum { ADD_C, MUL_C4, SUB_C, ADD_W, CAT2, CAT3, CAT_PLAIN, CAT_H, NRES };
    bool want_blocked[NRES] = {true, true, true, false, true, true, false, false};
    kpl_tensor *res[2][NRES];
    kpl_kept seen = KPL_KEPT_PLAIN;
    for (int on = 0; on < 2; on++) {
        bool prev = kpl_set_blocked_layouts(on);
        kpl_tensor *y = NN(kpl_conv2d(x, w1, NULL, &c)), *z = NN(kpl_conv2d(x, w2, NULL, &c));
        kpl_kept tag = kpl__kept(y);
        assert_int_equal(tag, on ? want_kept(kpl__cpu_conv_last()) : KPL_KEPT_PLAIN);
        bool blocked = tag != KPL_KEPT_PLAIN && kpl__kept(z) == tag;
        if (on) seen = blocked ? tag : KPL_KEPT_PLAIN;
        kpl_tensor **r = res[on];
        r[ADD_C] = NN(kpl_add(y, bc));
        r[MUL_C4] = NN(kpl_mul(y, b4));
        r[SUB_C] = NN(kpl_sub(y, bc));
        r[CAT2] = NN(kpl_concat(2, (kpl_tensor *[]){z, y}, 1));
        r[CAT3] = NN(kpl_concat(3, (kpl_tensor *[]){y, z, y}, 1));
        /* the plain paths last: their reads turn y and z plain */
        r[ADD_W] = NN(kpl_add(y, bw));
        r[CAT_PLAIN] = NN(kpl_concat(2, (kpl_tensor *[]){z, x}, 1)); /* x is plain */
        r[CAT_H] = NN(kpl_concat(2, (kpl_tensor *[]){y, y}, 2));
        for (int k = 0; k < NRES; k++)
            if (kpl__kept(r[k]) != KPL_KEPT_PLAIN && !(blocked && want_blocked[k]))
                fail_msg("result %d kept", k);
            else if (blocked && want_blocked[k] && kpl__kept(r[k]) != tag)
                fail_msg("result %d %s: the %s path was not taken", k, kept_name(kpl__kept(r[k])),
                         kept_name(tag));
        kpl_set_blocked_layouts(prev);
    }
    print_message("convolution outputs %s\n", kept_name(seen));
    for (int k = 0; k < NRES; k++) expect_same(res[1][k], res[0][k], k);
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
}

/* The gradients of max pooling (plane_scatter) and of a concatenation
 * along the channels (each piece's slab of gy) of kept tensors are kept
 * too, and equal the plain run's to the bit (a U-Net's skip path: a
 * plain gradient there turned every batch norm's kept input plain in
 * backward).  Gradients by kpl_grad, not create_graph: the slab copy is
 * what backward runs. */
static void test_blocked_pool_concat_grads(void **state)
{
    (void)state;
    kpl_pool *pool = kpl_pool_push();
    kpl_rng *rng = kpl_rng_create(17);
    kpl_tensor *x = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){2, 16, 10, 9}, rng, 0, 1));
    kpl_tensor *w1 = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){32, 16, 3, 3}, rng, 0, 0.2));
    kpl_tensor *w2 = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){16, 16, 3, 3}, rng, 0, 0.2));
    kpl_tensor *w3 = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){16, 48, 1, 1}, rng, 0, 0.2));
    kpl_tensor *gy = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){2, 16, 5, 5}, rng, 0, 1));
    OK(kpl_set_requires_grad(x, true));
    kpl_conv2d_params c = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    kpl_conv2d_params c1 = {.stride = {1, 1}, .dilation = {1, 1}, .groups = 1};
    kpl_pool2d_params mp = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
    kpl_tensor *got[2], *want[2];
    for (int on = 0; on < 2; on++) {
        bool prev = kpl_set_blocked_layouts(on);
        kpl_tensor *a = NN(kpl_conv2d(x, w1, NULL, &c));            /* (2, 32, 10, 9) */
        kpl_tensor *p = NN(kpl_max_pool2d(a, &mp));                  /* (2, 32, 5, 5) */
        kpl_tensor *b = NN(kpl_conv2d(NN(kpl_max_pool2d(x, &mp)), w2, NULL, &c));
        kpl_tensor *cat = NN(kpl_concat(2, (kpl_tensor *[]){p, b}, 1)); /* 48 channels */
        kpl_tensor *y = NN(kpl_conv2d(cat, w3, NULL, &c1));
        kpl_tensor *g[2] = {NULL, NULL};
        OK(kpl_grad(y, gy, 2, (kpl_tensor *[]){cat, a}, false, g));
        if (on && kpl__kept(g[0])) {
            /* the slabs and the pooling gradient stay in the layout the
             * gradient came in (the 1x1 convolution's choice; a's own may
             * differ when each convolution picks its fastest kernel) */
            assert_int_equal(kpl__kept(g[1]), kpl__kept(g[0]));
            print_message("pooling gradient kept %s\n", kept_name(kpl__kept(g[1])));
        }
        (on ? got : want)[0] = g[0], (on ? got : want)[1] = g[1];
        kpl_set_blocked_layouts(prev);
    }
    for (int k = 0; k < 2; k++) expect_same(got[k], want[k], k);
    /* an index outside the plane, on the kept path too: named, not written */
    kpl_tensor *a = NN(kpl_conv2d(x, w1, NULL, &c)), *gx = NULL, *ix = NULL;
    int64_t os[4];
    OK(kpl_shape_pool2d(kpl_tensor_shape(a), &mp, os));
    kpl_tensor *g = NN(kpl_full(cpu, KPL_F32, 4, os, 1));
    g = NN(kpl_conv2d(g, NN(kpl_full(cpu, KPL_F32, 4, (int64_t[]){32, 32, 1, 1}, 0.5)), NULL,
                      &c1)); /* kept where the convolution keeps */
    if (kpl_get_kept_layout() == KPL_LAYOUT_NHWC) assert_int_equal(kpl__kept(g), KPL_KEPT_NHWC);
    OK(kpl_tensor_empty(cpu, KPL_I64, 4, os, &ix));
    OK(kpl_k_fill(ix, 3));
    ((int64_t *)kpl_tensor_host_mutable(ix))[17] = 90; /* the plane has 10 x 9 cells */
    OK(kpl_tensor_empty(cpu, KPL_F32, 4, kpl_tensor_shape(a), &gx));
    FAILS(kpl_k_plane_scatter(gx, g, ix), KPL_ERANGE, "1 indices outside the 10x9 plane");
    kpl_tensor_release(ix);
    kpl_tensor_release(gx);
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
}

/* A layout asked for holds along the chain: where the output's channels
 * can be kept, the timed choice (not deterministic) does not take kpl's
 * own loops, which write plain, however fast they are alone (LeNet's
 * first layer, where they win when nothing is asked). */
static void test_asked_layout_keeps_chain(void **state)
{
    (void)state;
    kpl_pool *pool = kpl_pool_push();
    kpl_rng *rng = kpl_rng_create(13);
    kpl_tensor *x = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){1, 1, 8, 8}, rng, 0, 1));
    kpl_tensor *w = NN(kpl_randn(cpu, KPL_F32, 4, (int64_t[]){16, 1, 3, 3}, rng, 0, 0.2));
    kpl_conv2d_params c = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    kpl_set_deterministic(false);
    kpl_tensor *want = NN(kpl_conv2d(x, w, NULL, &c)); /* AUTO, as timed */
    print_message("auto: %s\n", kpl__cpu_conv_last().impl);
    kpl_layout prev = kpl_set_kept_layout(KPL_LAYOUT_NHWC);
    kpl_tensor *y = NN(kpl_conv2d(x, w, NULL, &c));
    kpl_conv_choice ch = kpl__cpu_conv_last();
    kpl_set_kept_layout(prev);
    kpl_set_deterministic(true);
    print_message("NHWC asked: %s\n", ch.impl);
    assert_string_not_equal(ch.impl, "kpl_direct");
    assert_int_equal(kpl__kept(y), KPL_KEPT_NHWC);
    for (int64_t i = 0; i < kpl_tensor_numel(want); i++)
        assert_close(tget(y, i), tget(want, i), 1e-5, 1e-5, "NHWC convolution", i);
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
}

int main(void)
{
    cpu = kpl_device_cpu();
    kpl_set_deterministic(true); /* the same convolution both times */
#define PER_LAYOUT(f)                                                                   \
    cmocka_unit_test_prestate_setup_teardown(f, layout_setup, layout_teardown,          \
                                             (void *)&layouts[0]),                      \
        cmocka_unit_test_prestate_setup_teardown(f, layout_setup, layout_teardown,      \
                                                 (void *)&layouts[1]),                  \
        cmocka_unit_test_prestate_setup_teardown(f, layout_setup, layout_teardown,      \
                                                 (void *)&layouts[2])
    const struct CMUnitTest tests[] = {
        PER_LAYOUT(test_step_f32),        PER_LAYOUT(test_step_bf16),
        PER_LAYOUT(test_plain_readers),   PER_LAYOUT(test_blocked_dtypes),
        PER_LAYOUT(test_blocked_max_pool), PER_LAYOUT(test_blocked_channel_ops),
        PER_LAYOUT(test_blocked_pool_concat_grads),
        cmocka_unit_test(test_asked_layout_keeps_chain),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
