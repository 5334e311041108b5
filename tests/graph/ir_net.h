/* ir_net.h — the small network test_ir.c and test_ir_train.c trace and
 * run (the same executable): its parameters, forward, trace, an input. */
#ifndef KPL_TEST_IR_NET_H
#define KPL_TEST_IR_NET_H
#include "kpl_test.h"
#include "autograd.h"
#include "ir.h"

static inline kpl_tensor *owned_randn(int ndim, const int64_t *shape, uint64_t seed, double std)
{
    kpl_rng *rng = kpl_rng_create(seed);
    kpl_tensor *t = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, ndim, shape, &t));
    OK(kpl_k_normal(t, rng, 0, std));
    kpl_rng_destroy(rng);
    return t;
}

/* A small network's parameters (outside any pool, released by the test). */
typedef struct {
    kpl_tensor *w1, *b1, *g1, *be1, *m1, *v1; /* conv 3->16 3x3 + bias, bn */
    kpl_tensor *w2, *g2, *be2, *m2, *v2;      /* conv 16->16 3x3 no bias, bn + relu */
    kpl_tensor *fw, *fb;                      /* linear 16 -> 5 */
} net;

static inline void net_init(net *n)
{
    n->w1 = owned_randn(4, (int64_t[]){16, 3, 3, 3}, 1, 0.3);
    n->b1 = owned_randn(1, (int64_t[]){16}, 2, 0.1);
    n->g1 = owned_randn(1, (int64_t[]){16}, 3, 0.2);
    n->be1 = owned_randn(1, (int64_t[]){16}, 4, 0.2);
    n->m1 = owned_randn(1, (int64_t[]){16}, 5, 0.2);
    n->v1 = owned_randn(1, (int64_t[]){16}, 6, 0.3);
    n->w2 = owned_randn(4, (int64_t[]){16, 16, 3, 3}, 7, 0.1);
    n->g2 = owned_randn(1, (int64_t[]){16}, 8, 0.2);
    n->be2 = owned_randn(1, (int64_t[]){16}, 9, 0.2);
    n->m2 = owned_randn(1, (int64_t[]){16}, 10, 0.2);
    n->v2 = owned_randn(1, (int64_t[]){16}, 11, 0.3);
    n->fw = owned_randn(2, (int64_t[]){5, 16}, 12, 0.3);
    n->fb = owned_randn(1, (int64_t[]){5}, 13, 0.1);
    /* variances positive */
    kpl_pool *p = kpl_pool_push();
    OK(kpl_k_unary(n->v1, KPL_UN_ABS, n->v1, 0, 0));
    OK(kpl_k_binary_scalar(n->v1, KPL_BIN_ADD, n->v1, 0.5, false));
    OK(kpl_k_unary(n->v2, KPL_UN_ABS, n->v2, 0, 0));
    OK(kpl_k_binary_scalar(n->v2, KPL_BIN_ADD, n->v2, 0.5, false));
    for (kpl_tensor **t = &n->w1; t <= &n->fb; t++) OK(kpl_set_requires_grad(*t, true));
    kpl_pool_pop(p);
}

static inline void net_free(net *n)
{
    for (kpl_tensor **t = &n->w1; t <= &n->fb; t++) kpl_tensor_release(*t);
}

static inline kpl_tensor *net_forward_mode(const net *n, kpl_tensor *x, bool training)
{
    kpl_conv2d_params cp = KPL_CONV2D_PARAMS_INIT;
    cp.padding[0] = cp.padding[1] = 1;
    kpl_tensor *h = kpl_conv2d(x, n->w1, n->b1, &cp);
    h = kpl_relu(kpl_batch_norm(h, n->g1, n->be1, n->m1, n->v1, training, 0.1, 1e-5));
    kpl_pool2d_params pp = {{2, 2}, {2, 2}, {0, 0}, false, false};
    h = kpl_max_pool2d(h, &pp);
    h = kpl_batch_norm_relu(kpl_conv2d(h, n->w2, NULL, &cp), n->g2, n->be2, n->m2, n->v2,
                            training, 0.1, 1e-5);
    h = kpl_global_avg_pool2d(h);
    h = kpl_reshape(h, 2, (int64_t[]){kpl_tensor_shape(x)[0], 16});
    return kpl_log_softmax(kpl_linear(h, n->fw, n->fb), 1);
}

static inline kpl_tensor *net_forward(const net *n, kpl_tensor *x) { return net_forward_mode(n, x, false); }

static inline kpl_ir *trace_net(const net *n, kpl_tensor *x)
{
    OK(kpl_trace_begin());
    kpl_tensor *in = NN(kpl_trace_input(x, "image"));
    kpl_tensor *y = NN(net_forward(n, in));
    kpl_ir *ir = NULL;
    OK(kpl_trace_end(1, &y, (const char *[]){"logp"}, &ir));
    return ir;
}

static inline double max_abs_diff(kpl_tensor *a, kpl_tensor *b)
{
    assert_int_equal(kpl_tensor_numel(a), kpl_tensor_numel(b));
    double m = 0;
    for (int64_t i = 0; i < kpl_tensor_numel(a); i++) {
        double d = fabs(tget(a, i) - tget(b, i));
        if (!(d <= m)) m = d; /* NaN sticks */
    }
    return m;
}

/* A (2, 3, 10, 10) input of the test network, autoreleased. */
static inline kpl_tensor *net_image(int seed)
{
    return kpl_autorelease(owned_randn(4, (int64_t[]){2, 3, 10, 10}, seed, 1));
}
#endif /* KPL_TEST_IR_NET_H */
