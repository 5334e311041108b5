/*
 * grad_fns.c — the gradient of every recorded op, written with graph/'s
 * eager ops (so create_graph records them again).  What each one reads
 * from the forward pass is its op's saved column in graph/op_table.h.
 *
 * A gradient function gets the node and the gradient of its output (gy)
 * and writes the gradient of each input that requires one into gin[i]
 * (pool-owned).  Broadcast inputs get their gradient summed back to their
 * own shape (sum_to).
 */
#include "autograd_impl.h"
#include "vision.h"

#include <float.h>
#include <math.h>
#include <string.h>

#define IN(i) kpl_node_saved_input(n, (i))
#define OUT kpl_node_saved_output(n)
#define WANT(i) kpl_node_input_requires_grad(n, (i))
#define SCAL(op, x, s) kpl_scalar_op((op), (x), (s), false)

static kpl_tensor *scalar_like(kpl_tensor *like, double v)
{
    return kpl_full(kpl_tensor_device(like), kpl_tensor_dtype(like), 0, NULL, v);
}

/* A 0/1 float mask of `cmp(x, y)`. */
static kpl_tensor *mask(kpl_binary_op cmp, kpl_tensor *x, kpl_tensor *y)
{
    if (!x) return NULL;
    return kpl_cast(kpl_compare(cmp, x, y), kpl_tensor_dtype(x));
}

/* Sums g over the dims that broadcasting added or stretched, back to the
 * input's recorded shape. */
static kpl_tensor *sum_to(kpl_tensor *g, const kpl_node *n, int i)
{
    if (!g) return NULL;
    int64_t shape[KPL_MAX_DIMS];
    int nd = kpl_node_input_shape(n, i, shape);
    int gn = kpl_tensor_ndim(g);
    const int64_t *gs = kpl_tensor_shape(g);
    int axes[KPL_MAX_DIMS], na = 0, lead = gn - nd;
    for (int d = 0; d < gn; d++)
        if (d < lead || (shape[d - lead] == 1 && gs[d] != 1)) axes[na++] = d;
    if (na == 0 && gn == nd) return g;
    kpl_tensor *s = na ? kpl_sum(g, axes, na, true) : g;
    return kpl_reshape(s, nd, shape);
}

/* Output gradient of a reduction with the reduced dims put back as 1s
 * (keepdim's shape): it broadcasts against the input. */
static kpl_tensor *keepdims(kpl_tensor *gy, const kpl_node *n)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    int64_t in_shape[KPL_MAX_DIMS], kshape[KPL_MAX_DIMS];
    int nd = kpl_node_input_shape(n, 0, in_shape);
    int nk;
    if (kpl_shape_reduce("backward", nd, in_shape, at->naxes ? at->axes : NULL, at->naxes, true,
                         &nk, kshape) < 0)
        return NULL;
    return kpl_reshape(gy, nk, kshape);
}

/* Output gradient of a reduction brought back to the input's shape (a
 * copy: use keepdims where a broadcasting op follows anyway). */
static kpl_tensor *unreduce(kpl_tensor *gy, const kpl_node *n)
{
    int64_t in_shape[KPL_MAX_DIMS];
    int nd = kpl_node_input_shape(n, 0, in_shape);
    return kpl_expand(keepdims(gy, n), nd, in_shape);
}

static int64_t reduced_count(const kpl_node *n)
{
    int64_t in_shape[KPL_MAX_DIMS], out_shape[KPL_MAX_DIMS];
    int nd = kpl_node_input_shape(n, 0, in_shape), no = kpl_node_output_shape(n, out_shape);
    int64_t a = 1, b = 1;
    for (int d = 0; d < nd; d++) a *= in_shape[d];
    for (int d = 0; d < no; d++) b *= out_shape[d];
    return b ? a / b : 0;
}

/* ---- the functions ---------------------------------------------------------------- */

typedef kpl_status (*grad_fn)(kpl_node *n, kpl_tensor *gy, kpl_tensor **gin);

#define G(name) \
    static kpl_status g_##name(kpl_node *n __attribute__((unused)), kpl_tensor *gy, kpl_tensor **gin)
#define RET0(expr) \
    do { gin[0] = (expr); return gin[0] ? KPL_OK : kpl_last_status(); } while (0)

G(NEG) { RET0(kpl_neg(gy)); }
G(ABS) { RET0(kpl_mul(gy, kpl_sign(IN(0)))); }
G(EXP) { RET0(kpl_mul(gy, OUT)); }
G(LOG) { RET0(kpl_div(gy, IN(0))); }
G(SQRT) { RET0(kpl_div(gy, SCAL(KPL_BIN_MUL, OUT, 2))); }
G(RSQRT) { RET0(kpl_mul(gy, SCAL(KPL_BIN_MUL, kpl_mul(OUT, kpl_square(OUT)), -0.5))); }
G(SQUARE) { RET0(kpl_mul(gy, SCAL(KPL_BIN_MUL, IN(0), 2))); }
G(RECIPROCAL) { RET0(kpl_neg(kpl_mul(gy, kpl_square(OUT)))); }
G(SIN) { RET0(kpl_mul(gy, kpl_cos(IN(0)))); }
G(COS) { RET0(kpl_neg(kpl_mul(gy, kpl_sin(IN(0))))); }
G(TANH) { RET0(kpl_mul(gy, kpl_scalar_op(KPL_BIN_SUB, kpl_square(OUT), 1, true))); }
G(SIGMOID) { RET0(kpl_mul(gy, kpl_mul(OUT, kpl_scalar_op(KPL_BIN_SUB, OUT, 1, true)))); }
/* From the output (y > 0 exactly where x > 0): the input, often a batch
 * norm's result nothing else keeps, can then die in the forward pass.
 * Without create_graph the product with the mask is one pass (relu_bwd)
 * instead of a comparison, a cast and a product; with it, the recorded
 * ops, so it can be differentiated again.  relu_grad: gy where relu's
 * output y > 0, else 0 (pool-owned); the fused ops' gradients share it. */
static kpl_tensor *relu_grad(kpl_tensor *gy, kpl_tensor *y)
{
    if (!gy || !y) return NULL;
    if (!kpl_grad_enabled()) return kpl_relu_bwd(gy, y);
    return kpl_mul(gy, mask(KPL_BIN_GT, y, scalar_like(gy, 0)));
}
G(RELU) { RET0(relu_grad(gy, OUT)); }
G(LEAKY_RELU)
{
    /* gy where x > 0, else slope gy: three passes (the mask as a factor
     * took five).  From the output, as relu's: the op has slope >= 0
     * (kpl_leaky_relu composes negative ones), so y > 0 exactly where
     * x > 0, x = -0 and NaN included */
    kpl_tensor *pos = kpl_compare(KPL_BIN_GT, OUT, scalar_like(gy, 0));
    RET0(kpl_where(pos, gy, SCAL(KPL_BIN_MUL, gy, kpl_node_attrs(n)->alpha)));
}
G(CLIP)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    kpl_tensor *x = IN(0);
    RET0(kpl_mul(gy, kpl_mul(mask(KPL_BIN_GE, x, scalar_like(gy, at->alpha)),
                             mask(KPL_BIN_LE, x, scalar_like(gy, at->beta)))));
}
G(SIGN) { RET0(SCAL(KPL_BIN_MUL, gy, 0)); }
G(SOFTPLUS) { RET0(kpl_mul(gy, kpl_sigmoid(IN(0)))); }
G(ERF) /* 2/sqrt(pi) exp(-x^2) */
{
    RET0(kpl_mul(gy, SCAL(KPL_BIN_MUL, kpl_exp(kpl_neg(kpl_square(IN(0)))), 1.1283791670955126)));
}
G(GELU) /* Phi(x) + x phi(x) */
{
    kpl_tensor *x = IN(0);
    kpl_tensor *cdf = SCAL(KPL_BIN_MUL, SCAL(KPL_BIN_ADD, kpl_erf(SCAL(KPL_BIN_MUL, x, 0.7071067811865476)), 1), 0.5);
    kpl_tensor *pdf = SCAL(KPL_BIN_MUL, kpl_exp(SCAL(KPL_BIN_MUL, kpl_square(x), -0.5)), 0.3989422804014327);
    RET0(kpl_mul(gy, kpl_add(cdf, kpl_mul(x, pdf))));
}
G(GELU_TANH) /* t = tanh(k (x + c x^3)): 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2) */
{
    const double k = 0.7978845608028654, c = 0.044715;
    kpl_tensor *x = IN(0), *x2 = kpl_square(x);
    kpl_tensor *t = kpl_tanh(SCAL(KPL_BIN_MUL, kpl_add(x, SCAL(KPL_BIN_MUL, kpl_mul(x2, x), c)), k));
    kpl_tensor *a = SCAL(KPL_BIN_MUL, SCAL(KPL_BIN_ADD, t, 1), 0.5);
    kpl_tensor *b = kpl_mul(SCAL(KPL_BIN_MUL, x, 0.5 * k),
                            kpl_mul(kpl_scalar_op(KPL_BIN_SUB, kpl_square(t), 1, true),
                                    SCAL(KPL_BIN_ADD, SCAL(KPL_BIN_MUL, x2, 3 * c), 1)));
    RET0(kpl_mul(gy, kpl_add(a, b)));
}

G(ADD)
{
    if (WANT(0)) gin[0] = sum_to(gy, n, 0);
    if (WANT(1)) gin[1] = sum_to(gy, n, 1);
    return KPL_OK;
}
G(SUB)
{
    if (WANT(0)) gin[0] = sum_to(gy, n, 0);
    if (WANT(1)) gin[1] = sum_to(kpl_neg(gy), n, 1);
    return KPL_OK;
}
G(MUL)
{
    if (WANT(0)) gin[0] = sum_to(kpl_mul(gy, IN(1)), n, 0);
    if (WANT(1)) gin[1] = sum_to(kpl_mul(gy, IN(0)), n, 1);
    return KPL_OK;
}
G(DIV)
{
    kpl_tensor *a = IN(0), *b = IN(1);
    if (WANT(0)) gin[0] = sum_to(kpl_div(gy, b), n, 0);
    if (WANT(1)) gin[1] = sum_to(kpl_neg(kpl_div(kpl_mul(gy, a), kpl_square(b))), n, 1);
    return KPL_OK;
}
G(POW)
{
    kpl_tensor *a = IN(0), *b = IN(1), *y = OUT;
    if (WANT(0))
        gin[0] = sum_to(kpl_mul(gy, kpl_mul(b, kpl_pow(a, SCAL(KPL_BIN_SUB, b, 1)))), n, 0);
    if (WANT(1)) gin[1] = sum_to(kpl_mul(gy, kpl_mul(y, kpl_log(a))), n, 1);
    return KPL_OK;
}
/* PyTorch's rule for maximum/minimum: an input gets the whole gradient
 * where it wins, none where it loses, and half at a tie (a == b); where
 * either is NaN no comparison holds, so both get the whole.  a_loses is
 * LT for maximum, GT for minimum.  The masks are constants, so a second
 * order is the mask times the second order of gy. */
static kpl_status g_extreme(kpl_node *n, kpl_tensor *gy, kpl_tensor **gin, kpl_binary_op a_loses)
{
    kpl_tensor *a = IN(0), *b = IN(1);
    kpl_tensor *half = SCAL(KPL_BIN_MUL, mask(KPL_BIN_EQ, a, b), 0.5);
    kpl_binary_op b_loses = a_loses == KPL_BIN_LT ? KPL_BIN_GT : KPL_BIN_LT;
    /* 1 - [loses] - [tie] / 2 */
    if (WANT(0))
        gin[0] = sum_to(kpl_mul(gy, kpl_scalar_op(KPL_BIN_SUB, kpl_add(mask(a_loses, a, b), half),
                                                  1, true)), n, 0);
    if (WANT(1))
        gin[1] = sum_to(kpl_mul(gy, kpl_scalar_op(KPL_BIN_SUB, kpl_add(mask(b_loses, a, b), half),
                                                  1, true)), n, 1);
    return KPL_OK;
}
G(MAXIMUM) { return g_extreme(n, gy, gin, KPL_BIN_LT); }
G(MINIMUM) { return g_extreme(n, gy, gin, KPL_BIN_GT); }

G(ADD_SCALAR) { RET0(gy); }
G(SUB_SCALAR) { RET0(kpl_node_attrs(n)->scalar_first ? kpl_neg(gy) : gy); }
G(MUL_SCALAR) { RET0(SCAL(KPL_BIN_MUL, gy, kpl_node_attrs(n)->scalar)); }
G(DIV_SCALAR)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    if (!at->scalar_first) RET0(SCAL(KPL_BIN_DIV, gy, at->scalar)); /* x / s */
    /* s / x: -s / x^2 */
    RET0(kpl_mul(gy, SCAL(KPL_BIN_MUL, kpl_reciprocal(kpl_square(IN(0))), -at->scalar)));
}
G(POW_SCALAR)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    if (!at->scalar_first) /* x^s: s x^(s-1) */
        RET0(kpl_mul(gy, SCAL(KPL_BIN_MUL, SCAL(KPL_BIN_POW, IN(0), at->scalar - 1), at->scalar)));
    RET0(kpl_mul(gy, SCAL(KPL_BIN_MUL, OUT, log(at->scalar)))); /* s^x: s^x ln s */
}
/* maximum/minimum with a constant are PyTorch's clamp_min/clamp_max (the
 * ops that take a number): x keeps the whole gradient at a tie. */
static kpl_status g_extreme_scalar(kpl_node *n, kpl_tensor *gy, kpl_tensor **gin,
                                   kpl_binary_op keep_x)
{
    RET0(kpl_mul(gy, mask(keep_x, IN(0), scalar_like(gy, kpl_node_attrs(n)->scalar))));
}
G(MAXIMUM_SCALAR) { return g_extreme_scalar(n, gy, gin, KPL_BIN_GE); }
G(MINIMUM_SCALAR) { return g_extreme_scalar(n, gy, gin, KPL_BIN_LE); }

G(WHERE)
{
    kpl_tensor *c = IN(0), *zero = scalar_like(gy, 0);
    if (WANT(1)) gin[1] = sum_to(kpl_where(c, gy, zero), n, 1);
    if (WANT(2)) gin[2] = sum_to(kpl_where(c, zero, gy), n, 2);
    return KPL_OK;
}

G(SUM) { RET0(unreduce(gy, n)); }
/* the division on the reduced gradient, before it is spread out */
G(MEAN) { RET0(unreduce(SCAL(KPL_BIN_DIV, gy, (double)reduced_count(n)), n)); }
static kpl_status g_max_min(kpl_node *n, kpl_tensor *gy, kpl_tensor **gin)
{
    /* The gradient is shared evenly among the elements equal to the extreme. */
    kpl_tensor *x = IN(0);
    kpl_tensor *m = mask(KPL_BIN_EQ, x, unreduce(OUT, n));
    const kpl_op_attrs *at = kpl_node_attrs(n);
    kpl_tensor *cnt = kpl_sum(m, at->naxes ? at->axes : NULL, at->naxes, true);
    RET0(kpl_div(kpl_mul(unreduce(gy, n), m), cnt));
}
G(MAX) { return g_max_min(n, gy, gin); }
G(MIN) { return g_max_min(n, gy, gin); }
G(VAR)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    kpl_tensor *x = IN(0);
    double den = (double)(reduced_count(n) - at->correction);
    kpl_tensor *mean = kpl_mean(x, at->naxes ? at->axes : NULL, at->naxes, true);
    /* 2 / den scales the reduced gradient; the product broadcasts it */
    RET0(kpl_mul(keepdims(SCAL(KPL_BIN_MUL, gy, 2.0 / den), n), kpl_sub(x, mean)));
}
G(LOGSUMEXP) { RET0(kpl_mul(unreduce(gy, n), kpl_exp(kpl_sub(IN(0), unreduce(OUT, n))))); }

G(MATMUL)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    kpl_tensor *a = IN(0), *b = IN(1);
    int64_t as[KPL_MAX_DIMS], bs[KPL_MAX_DIMS], gs[KPL_MAX_DIMS];
    int na = kpl_node_input_shape(n, 0, as), nb = kpl_node_input_shape(n, 1, bs);
    int ng = kpl_node_output_shape(n, gs);
    /* 1-D operands as numpy: (K) is (1, K) on the left, (K, 1) on the
     * right; the output lost those dims, so put them back in gy. */
    if (na == 1) {
        a = kpl_reshape(a, 2, (int64_t[]){1, as[0]});
        if (nb == 1) {
            gs[ng++] = 1;
        } else {
            gs[ng] = gs[ng - 1];
            gs[ng - 1] = 1;
            ng++;
        }
    }
    if (nb == 1) {
        b = kpl_reshape(b, 2, (int64_t[]){bs[0], 1});
        gs[ng++] = 1;
    }
    if (na == 1 || nb == 1) gy = kpl_reshape(gy, ng, gs);
    bool ta = na > 1 && at->trans_a, tb = nb > 1 && at->trans_b;
    if (WANT(0))
        gin[0] = sum_to(ta ? kpl_matmul(b, gy, tb, true) : kpl_matmul(gy, b, false, !tb), n, 0);
    if (WANT(1)) {
        kpl_tensor *g = tb ? kpl_matmul(gy, a, true, ta) : kpl_matmul(a, gy, !ta, false);
        if (nb == 1 && g) /* (..., K, 1) -> (..., K) before summing the batch away */
            g = kpl_reshape(g, kpl_tensor_ndim(g) - 1, kpl_tensor_shape(g));
        gin[1] = sum_to(g, n, 1);
    }
    return KPL_OK;
}
/* conv2d and its two gradient halves are closed under differentiation:
 *   <gy, conv(x, w)>   = <bwd_data(gy, w), x> = <bwd_weight(x, gy), w> */
static kpl_status conv_grad(kpl_node *n, kpl_tensor *gy, kpl_tensor **gin)
{
    const kpl_conv2d_params *p = &kpl_node_attrs(n)->conv;
    int64_t xs[KPL_MAX_DIMS], ws[KPL_MAX_DIMS];
    kpl_node_input_shape(n, 0, xs);
    kpl_node_input_shape(n, 1, ws);
    if (WANT(0)) gin[0] = kpl_conv2d_bwd_data(gy, IN(1), xs, p);
    bool want_b = kpl_node_num_inputs(n) > 2 && WANT(2);
    if (WANT(1) && want_b && !kpl_grad_enabled()) {
        /* Without create_graph the bias gradient comes out of the weight
         * gradient's pass over gy (oneDNN's diff_bias) instead of a
         * reduction of its own. */
        return kpl_conv2d_bwd_weight_bias(IN(0), gy, ws, p, &gin[1], &gin[2]);
    }
    if (WANT(1)) gin[1] = kpl_conv2d_bwd_weight(IN(0), gy, ws, p);
    if (want_b) gin[2] = kpl_sum(gy, (int[]){0, 2, 3}, 3, false);
    return KPL_OK;
}
G(CONV2D) { return conv_grad(n, gy, gin); }
/* relu(conv2d): gy masked by the saved output y > 0, then conv2d's. */
G(CONV2D_RELU)
{
    gy = relu_grad(gy, OUT);
    return gy ? conv_grad(n, gy, gin) : kpl_last_status();
}
G(CONV2D_BWD_DATA) /* out = bwd_data(g, w) */
{
    const kpl_conv2d_params *p = &kpl_node_attrs(n)->conv;
    int64_t ws[KPL_MAX_DIMS];
    kpl_node_input_shape(n, 1, ws);
    if (WANT(0)) gin[0] = kpl_conv2d(gy, IN(1), NULL, p);
    if (WANT(1)) gin[1] = kpl_conv2d_bwd_weight(gy, IN(0), ws, p);
    return KPL_OK;
}
G(CONV2D_BWD_WEIGHT) /* out = bwd_weight(x, g) */
{
    const kpl_conv2d_params *p = &kpl_node_attrs(n)->conv;
    int64_t xs[KPL_MAX_DIMS];
    kpl_node_input_shape(n, 0, xs);
    if (WANT(0)) gin[0] = kpl_conv2d_bwd_data(IN(1), gy, xs, p);
    if (WANT(1)) gin[1] = kpl_conv2d(IN(0), gy, NULL, p);
    return KPL_OK;
}
/* The pooling pairs are adjoint: gather <-> scatter, avg <-> avg_bwd. */
G(PLANE_GATHER)
{
    int64_t xs[KPL_MAX_DIMS];
    kpl_node_input_shape(n, 0, xs);
    RET0(kpl_plane_scatter(gy, IN(1), xs));
}
G(PLANE_SCATTER) { RET0(kpl_plane_gather(gy, IN(1))); }
G(AVG_POOL2D)
{
    int64_t xs[KPL_MAX_DIMS];
    kpl_node_input_shape(n, 0, xs);
    RET0(kpl_avg_pool2d_bwd(gy, xs, &kpl_node_attrs(n)->pool));
}
G(AVG_POOL2D_BWD) { RET0(kpl_avg_pool2d(gy, &kpl_node_attrs(n)->pool)); }
G(CONCAT) /* each input its slab of gy */
{
    int ax = kpl_node_attrs(n)->axes[0];
    int64_t off = 0, s[KPL_MAX_DIMS];
    for (int i = 0; i < kpl_node_num_inputs(n); i++) {
        kpl_node_input_shape(n, i, s);
        if (WANT(i)) {
            gin[i] = kpl_slice(gy, ax, off, s[ax]);
            if (!gin[i]) return kpl_last_status();
        }
        off += s[ax];
    }
    return KPL_OK;
}
G(UPSAMPLE_BILINEAR) /* adjoint pair with its bwd */
{
    int64_t xs[KPL_MAX_DIMS];
    kpl_node_input_shape(n, 0, xs);
    RET0(kpl_upsample_bilinear_bwd(gy, xs, kpl_node_attrs(n)->align_corners));
}
G(UPSAMPLE_BILINEAR_BWD)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    int64_t ys[KPL_MAX_DIMS];
    kpl_node_input_shape(n, 0, ys);
    RET0(kpl_upsample_bilinear(gy, ys[2], ys[3], at->align_corners));
}
G(SOFTMAX_XENT) /* the labels get none */
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    if (!WANT(0)) return KPL_OK;
    RET0(kpl_softmax_xent_bwd(IN(0), IN(1), gy, at->start, at->alpha));
}
/* gx = gy keep (p - (1 - eps) onehot(y) - eps / C), p = softmax(x) over
 * axis 1, keep = [y != ignore_index]; with G the gradient of gx:
 *   d gy = sum_c G gx(gy = 1)          (the op itself with unit gy),
 *   d x  = gy keep p (G - sum_c G p). */
G(SOFTMAX_XENT_BWD)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    kpl_tensor *x = IN(0), *y = IN(1), *g = IN(2);
    int ax = 1;
    if (WANT(2)) {
        kpl_tensor *one = kpl_full(kpl_tensor_device(g), kpl_tensor_dtype(g), kpl_tensor_ndim(g),
                                   kpl_tensor_shape(g), 1);
        gin[2] = kpl_sum(kpl_mul(gy, kpl_softmax_xent_bwd(x, y, one, at->start, at->alpha)), &ax,
                         1, false);
        if (!gin[2]) return kpl_last_status();
    }
    if (WANT(0)) {
        int nd = kpl_tensor_ndim(x);
        int64_t ks[KPL_MAX_DIMS];
        memcpy(ks, kpl_tensor_shape(x), (size_t)nd * sizeof ks[0]);
        ks[1] = 1;
        kpl_tensor *keep = mask(KPL_BIN_NE, y, kpl_full(kpl_tensor_device(y), KPL_I64, 0, NULL,
                                                         (double)at->start));
        kpl_tensor *gk = kpl_reshape(kpl_mul(g, kpl_cast(keep, kpl_tensor_dtype(g))), nd, ks);
        kpl_tensor *p = kpl_softmax(x, 1);
        kpl_tensor *gp = kpl_sum(kpl_mul(gy, p), &ax, 1, true);
        gin[0] = kpl_mul(kpl_mul(gk, p), kpl_sub(gy, gp));
        if (!gin[0]) return kpl_last_status();
    }
    return KPL_OK;
}
G(SIGMOID_FOCAL) /* the targets are cut from the tape */
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    RET0(kpl_sigmoid_focal_bwd(IN(0), IN(1), gy, at->alpha, at->beta));
}
/* gz = gy L'(z), L the focal loss; with G the gradient of gz: d gy = G L'
 * (the op itself with G for gy); d z = G gy L'', composed here (so it is
 * differentiable again) in the terms of vision_math.h's derivative: with
 * s = sigmoid(z), c = sigmoid(-z), q = max(1 - p_t, tiny), w = q^g,
 * r1 = q'/q and r2 = q''/q (0 where q is clamped), q' = s c (1 - 2y),
 * q'' = q' (1 - 2s):
 *   L'' = a_t w (s c + 2g (s - y) r1 + g (g - 1) CE r1^2 + g CE r2). */
G(SIGMOID_FOCAL_BWD)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    kpl_tensor *z = IN(0), *y = IN(1), *g = IN(2);
    double a = at->alpha, gm = at->beta;
    if (WANT(2) && !(gin[2] = kpl_sigmoid_focal_bwd(z, y, gy, a, gm))) return kpl_last_status();
    if (!WANT(0)) return KPL_OK;
    kpl_tensor *s = kpl_sigmoid(z), *c = kpl_sigmoid(kpl_neg(z)), *sc = kpl_mul(s, c);
    kpl_tensor *ce = kpl_bce_with_logits(z, y, KPL_REDUCE_NONE);
    kpl_tensor *u = kpl_scalar_op(KPL_BIN_ADD, SCAL(KPL_BIN_MUL, y, -2), 1, false); /* 1 - 2y */
    kpl_tensor *qr = kpl_add(kpl_mul(y, c), kpl_mul(kpl_scalar_op(KPL_BIN_SUB, y, 1, true), s));
    double tiny = kpl_tensor_dtype(z) == KPL_F64 ? DBL_MIN : FLT_MIN;
    kpl_tensor *in = mask(KPL_BIN_GT, qr, scalar_like(qr, tiny));
    kpl_tensor *q = SCAL(KPL_BIN_MAXIMUM, qr, tiny);
    kpl_tensor *r1 = kpl_div(kpl_mul(kpl_mul(sc, u), in), q);
    kpl_tensor *r2 = kpl_mul(r1, kpl_scalar_op(KPL_BIN_ADD, SCAL(KPL_BIN_MUL, s, -2), 1, false));
    kpl_tensor *h = sc; /* the bracket */
    if (gm != 0) {
        h = kpl_add(h, SCAL(KPL_BIN_MUL, kpl_mul(kpl_sub(s, y), r1), 2 * gm));
        if (gm != 1) h = kpl_add(h, SCAL(KPL_BIN_MUL, kpl_mul(ce, kpl_square(r1)), gm * (gm - 1)));
        h = kpl_add(h, SCAL(KPL_BIN_MUL, kpl_mul(ce, r2), gm));
        h = kpl_mul(h, gm == 1 ? q : SCAL(KPL_BIN_POW, q, gm));
    }
    if (a >= 0)
        h = kpl_mul(h, kpl_scalar_op(KPL_BIN_ADD, SCAL(KPL_BIN_MUL, y, 2 * a - 1), 1 - a, false));
    RET0(kpl_mul(kpl_mul(gy, g), h));
}
G(INDEX_SELECT) /* adjoint pair with index_add */
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    RET0(kpl_index_add(gy, at->axes[0], IN(1), at->length));
}
G(INDEX_ADD) { RET0(kpl_index_select(gy, kpl_node_attrs(n)->axes[0], IN(1))); }
/* gather and scatter_add are adjoint too: gather's gradient is a
 * scatter_add into zeros (the zeros are a constant, so its second order
 * is the gather of the second-order gradient), scatter_add's the identity
 * for x and a gather for src. */
G(GATHER)
{
    int64_t xs[KPL_MAX_DIMS];
    int nd = kpl_node_input_shape(n, 0, xs);
    kpl_tensor *zeros = kpl_full(kpl_tensor_device(gy), kpl_tensor_dtype(gy), nd, xs, 0);
    RET0(kpl_scatter_add(zeros, kpl_node_attrs(n)->axes[0], IN(1), gy));
}
G(SCATTER_ADD)
{
    if (WANT(0)) gin[0] = gy;
    if (WANT(2)) gin[2] = kpl_gather(gy, kpl_node_attrs(n)->axes[0], IN(1));
    return KPL_OK;
}
/* ROI Align and its adjoint are linear in the features and each other's
 * gradient (the rois, recorded cut from the graph, are constants). */
G(ROI_ALIGN)
{
    int64_t xs[KPL_MAX_DIMS];
    kpl_node_input_shape(n, 0, xs);
    RET0(kpl_roi_align_bwd(gy, IN(1), xs, &kpl_node_attrs(n)->roi));
}
G(ROI_ALIGN_BWD)
{
    const kpl_roi_align_params *p = &kpl_node_attrs(n)->roi;
    RET0(kpl_roi_align(gy, IN(1), p->out_h, p->out_w, p->spatial_scale, p->sampling_ratio,
                       p->aligned));
}
/* The caller's backward, its result checked against the input it is the
 * gradient of (a wrong shape would otherwise surface as a puzzling
 * broadcast further down). */
G(CUSTOM)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    const char *name = at->custom->name ? at->custom->name : "custom";
    kpl_tensor *gx = at->custom->backward(gy, at->custom_user);
    if (!gx) {
        kpl_status st = kpl_last_status();
        if (st >= 0)
            return KPL_ERROR(KPL_EINVAL, "backward of custom op '%s' returned NULL without an "
                                         "error", name);
        return kpl_error_prefix(st, "backward of custom op '%s': ", name);
    }
    int64_t xs[KPL_MAX_DIMS];
    int nd = kpl_node_input_shape(n, 0, xs);
    bool same = kpl_tensor_ndim(gx) == nd && kpl_tensor_dtype(gx) == kpl_node_input_dtype(n, 0);
    for (int d = 0; same && d < nd; d++) same = kpl_tensor_shape(gx)[d] == xs[d];
    if (!same) {
        char b1[96], b2[96];
        return KPL_ERROR(KPL_ESHAPE, "backward of custom op '%s' returned %s %s for an input %s %s",
                         name, kpl_shape_str(kpl_tensor_ndim(gx), kpl_tensor_shape(gx), b1, sizeof b1),
                         kpl_dtype_name(kpl_tensor_dtype(gx)), kpl_shape_str(nd, xs, b2, sizeof b2),
                         kpl_dtype_name(kpl_node_input_dtype(n, 0)));
    }
    RET0(gx);
}
G(CAST) { RET0(kpl_cast(gy, kpl_node_attrs(n)->dtype)); }
G(RESHAPE)
{
    int64_t s[KPL_MAX_DIMS];
    int nd = kpl_node_input_shape(n, 0, s);
    RET0(kpl_reshape(gy, nd, s));
}
G(PERMUTE)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    int inv[KPL_MAX_DIMS];
    for (int i = 0; i < at->naxes; i++) inv[at->axes[i]] = i;
    RET0(kpl_permute(gy, inv));
}
G(EXPAND) { RET0(sum_to(gy, n, 0)); }
G(NARROW)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    int64_t s[KPL_MAX_DIMS];
    kpl_node_input_shape(n, 0, s);
    RET0(kpl_pad_rows(gy, at->start, s[0] - at->start - at->length));
}
G(PAD_ROWS)
{
    int64_t s[KPL_MAX_DIMS];
    kpl_node_input_shape(n, 0, s);
    RET0(kpl_narrow(gy, kpl_node_attrs(n)->start, s[0]));
}

/* Batch norm (training statistics).  Without create_graph one fused
 * kernel; with it, the same formula in recorded ops, so it can be
 * differentiated again:
 *   gx = gamma inv (gy - mean(gy) - xhat mean(gy xhat)),
 *   ggamma = sum(gy xhat), gbeta = sum(gy), xhat = (x - mean) inv.
 * The two terms of gx nearly cancel when gy is nearly parallel to xhat
 * (always so with two values per channel), so f32 (and f16/bf16, whose
 * gamma is f32) runs the recorded formula in f64, as the kernel does
 * (kernels/cpu/cpu_norm.c). */
static kpl_status bn_grad(kpl_node *n, kpl_tensor *gy, kpl_tensor **gin, kpl_tensor *relu_y)
{
    kpl_tensor *x = IN(0), *gamma = IN(1);
    double eps = kpl_node_attrs(n)->alpha;
    int nd = kpl_tensor_ndim(x), axes[KPL_MAX_DIMS], na = 0;
    for (int d = 0; d < nd; d++)
        if (d != 1) axes[na++] = d;
    int64_t c = kpl_tensor_shape(x)[1];
    if (!kpl_grad_enabled())
        return kpl_batch_norm_bwd(x, relu_y, gy, gamma, eps, WANT(0) ? &gin[0] : NULL,
                                  WANT(1) ? &gin[1] : NULL, WANT(2) ? &gin[2] : NULL);
    if (relu_y) gy = relu_grad(gy, relu_y);
    int64_t bshape[KPL_MAX_DIMS];
    for (int d = 0; d < nd; d++) bshape[d] = d == 1 ? c : 1;
    kpl_dtype dt = kpl_tensor_dtype(x), pdt = kpl_tensor_dtype(gamma);
    if (dt != KPL_F64) { /* f16/bf16 activations come with f32 gamma */
        x = kpl_cast(x, KPL_F64);
        gamma = kpl_cast(gamma, KPL_F64);
        gy = kpl_cast(gy, KPL_F64);
    }
    kpl_tensor *xc = kpl_sub(x, kpl_mean(x, axes, na, true));
    kpl_tensor *inv = kpl_rsqrt(SCAL(KPL_BIN_ADD, kpl_mean(kpl_square(xc), axes, na, true), eps));
    kpl_tensor *xhat = kpl_mul(xc, inv);
    kpl_tensor *gyx = kpl_mul(gy, xhat);
    if (WANT(0)) {
        kpl_tensor *inner = kpl_sub(kpl_sub(gy, kpl_mean(gy, axes, na, true)),
                                    kpl_mul(xhat, kpl_mean(gyx, axes, na, true)));
        gin[0] = kpl_mul(kpl_mul(kpl_reshape(gamma, nd, bshape), inv), inner);
    }
    if (WANT(1)) gin[1] = kpl_sum(gyx, axes, na, false);
    if (WANT(2)) gin[2] = kpl_sum(gy, axes, na, false);
    for (int i = 0; i < 3 && dt != KPL_F64; i++)
        if (gin[i]) gin[i] = kpl_cast(gin[i], i ? pdt : dt);
    return KPL_OK;
}
G(BATCH_NORM) { return bn_grad(n, gy, gin, NULL); }
/* group norm: the fused kernel without create_graph; with it, the same
 * formula in recorded ops over the (N, G, L) view:
 *   gx = rstd (g - mean_L(g) - xhat mean_L(g xhat)), g = gy gamma,
 *   ggamma = sum over (N, ...) of gy xhat, gbeta = sum of gy. */
G(GROUP_NORM)
{
    const kpl_op_attrs *at = kpl_node_attrs(n);
    kpl_tensor *x = IN(0), *gamma = IN(1);
    int groups = (int)at->start;
    if (!kpl_grad_enabled())
        return kpl_group_norm_bwd(x, gy, gamma, groups, at->alpha, WANT(0) ? &gin[0] : NULL,
                                   WANT(1) ? &gin[1] : NULL, WANT(2) ? &gin[2] : NULL);
    int nd = kpl_tensor_ndim(x), axes[KPL_MAX_DIMS], na = 0, two = 2;
    const int64_t *xs = kpl_tensor_shape(x);
    int64_t c = xs[1], v3[3] = {xs[0], groups, kpl_tensor_numel(x) / (xs[0] * groups)};
    int64_t bshape[KPL_MAX_DIMS];
    for (int d = 0; d < nd; d++) {
        bshape[d] = d == 1 ? c : 1;
        if (d != 1) axes[na++] = d;
    }
    kpl_tensor *xg = kpl_reshape(x, 3, v3);
    kpl_tensor *xc = kpl_sub(xg, kpl_mean(xg, &two, 1, true));
    kpl_tensor *inv = kpl_rsqrt(SCAL(KPL_BIN_ADD, kpl_mean(kpl_square(xc), &two, 1, true),
                                     at->alpha));
    kpl_tensor *xhat = kpl_mul(xc, inv);
    if (WANT(0)) {
        kpl_tensor *g = kpl_reshape(kpl_mul(gy, kpl_reshape(gamma, nd, bshape)), 3, v3);
        kpl_tensor *inner = kpl_sub(kpl_sub(g, kpl_mean(g, &two, 1, true)),
                                    kpl_mul(xhat, kpl_mean(kpl_mul(g, xhat), &two, 1, true)));
        gin[0] = kpl_reshape(kpl_mul(inv, inner), nd, xs);
    }
    if (WANT(1)) gin[1] = kpl_sum(kpl_mul(gy, kpl_reshape(xhat, nd, xs)), axes, na, false);
    if (WANT(2)) gin[2] = kpl_sum(gy, axes, na, false);
    return KPL_OK;
}

/* relu(batch_norm(x)): gy masked by the saved output y > 0, as RELU's. */
G(BATCH_NORM_RELU)
{
    kpl_tensor *y = OUT;
    if (!y) return kpl_last_status() < 0 ? kpl_last_status() : KPL_EINVAL;
    return bn_grad(n, gy, gin, y);
}

/* op_table.h's grad column: 1 names g_<ENUM> above (a missing one does not
 * compile, one left over is an unused function), 0 none. */
#define GRAD_1(e) g_##e
#define GRAD_0(e) NULL
static const grad_fn table[KPL_OP_COUNT] = {
#define KPL_X_(e, s, ar, at, ac, sv, run, inf, gr, ox) [KPL_OP_##e] = GRAD_##gr(e),
    KPL_OP_LIST(KPL_X_)
#undef KPL_X_
};

bool kpl_op_has_grad(kpl_op op) { return (unsigned)op < KPL_OP_COUNT && table[op]; }

kpl_status kpl__autograd_apply(kpl_node *n, kpl_tensor *gy, kpl_tensor **gin)
{
    kpl_op op = kpl_node_op(n);
    grad_fn fn = (unsigned)op < KPL_OP_COUNT ? table[op] : NULL;
    KPL_CHECK(fn != NULL, KPL_ENOKERNEL, "backward: no gradient is defined for '%s'",
              kpl_op_name(op));
    kpl_clear_error();
    kpl_status st = fn(n, gy, gin);
    if (st < 0) return st;
    for (int i = 0; i < kpl_node_num_inputs(n); i++)
        if (kpl_node_input_requires_grad(n, i) && !gin[i] && kpl_op_has_grad(op)) {
            /* an eager op inside the gradient failed */
            kpl_status last = kpl_last_status();
            return last < 0 ? last
                            : KPL_ERROR(KPL_EINVAL, "backward of '%s' produced no gradient",
                                        kpl_op_name(op));
        }
    return KPL_OK;
}
