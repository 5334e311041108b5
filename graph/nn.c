/*
 * nn.c — neural-network functions composed from the recorded ops: linear,
 * softmax, the losses.  Composition keeps them differentiable to any order
 * for free; fused kernels (oneDNN inner product, a single-pass softmax
 * cross entropy) replace the compositions where a benchmark shows the gain.
 */
#include "graph_impl.h"
#include "ir_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SCALE(x, s) kpl_scalar_op(KPL_BIN_MUL, (x), (s), false)

kpl_tensor *kpl_linear(kpl_tensor *x, kpl_tensor *w, kpl_tensor *b)
{
    kpl_tensor *y = kpl_matmul(x, w, false, true);
    /* under autocast the bias joins the low-precision result */
    return b ? kpl_add(y, kpl__autocast(KPL_OP_MATMUL, b)) : y;
}

kpl_tensor *kpl_log_softmax(kpl_tensor *x, int axis)
{
    if (!x) return NULL;
    return kpl_sub(x, kpl_logsumexp(x, &axis, 1, true));
}

kpl_tensor *kpl_softmax(kpl_tensor *x, int axis) { return kpl_exp(kpl_log_softmax(x, axis)); }

kpl_tensor *kpl__reduce_loss(kpl_tensor *per, kpl_reduction red)
{
    switch (red) {
    case KPL_REDUCE_MEAN: return kpl_mean(per, NULL, 0, false);
    case KPL_REDUCE_SUM: return kpl_sum(per, NULL, 0, false);
    case KPL_REDUCE_NONE: return per;
    }
    KPL_ERROR(KPL_EINVAL, "loss: unknown reduction %d", (int)red);
    return NULL;
}

/* Where element i of labels (N, d1, ..., dk) sits, for messages: "row i"
 * for (N) labels, "position (n, d1, ..., dk)" otherwise. */
static const char *label_pos(kpl_tensor *labels, int64_t i, char *buf, size_t len)
{
    int nd = kpl_tensor_ndim(labels);
    if (nd == 1) {
        snprintf(buf, len, "row %lld", (long long)i);
        return buf;
    }
    int64_t coord[KPL_MAX_DIMS];
    for (int d = nd - 1; d >= 0; d--) {
        int64_t s = kpl_tensor_shape(labels)[d];
        coord[d] = s ? i % s : 0;
        i = s ? i / s : 0;
    }
    size_t at = (size_t)snprintf(buf, len, "position (");
    for (int d = 0; d < nd && at < len; d++)
        at += (size_t)snprintf(buf + at, len - at, "%s%lld", d ? ", " : "", (long long)coord[d]);
    if (at < len) snprintf(buf + at, len - at, ")");
    return buf;
}

/* The targets of a class-index loss over logp (N, C, d1, ..., dk) and
 * labels (N, d1, ..., dk): every label is checked; *idx (N, 1, d1, ..., dk)
 * holds the labels with ignored ones replaced by class 0 (a valid index
 * for gather, masked out afterwards) and *keep (N, d1, ..., dk) is 1 where
 * the label counts, 0 where it is ignore_index, in logp's dtype. */
static kpl_status class_targets(const char *op, kpl_tensor *logp, kpl_tensor *labels,
                                int64_t ignore_index, kpl_tensor **idx, kpl_tensor **keep,
                                int64_t *nkeep)
{
    char b1[96], b2[96], b3[96];
    int nd = kpl_tensor_ndim(logp);
    const int64_t *xs = kpl_tensor_shape(logp), *ls = kpl_tensor_shape(labels);
    kpl_shape_str(nd, xs, b1, sizeof b1);
    bool fit = nd >= 2 && kpl_tensor_ndim(labels) == nd - 1 && ls[0] == xs[0];
    for (int d = 2; fit && d < nd; d++) fit = ls[d - 1] == xs[d];
    KPL_CHECK(fit, KPL_ESHAPE,
              "%s: input %s and labels %s must be (N, C) and (N), or (N, C, d1, ...) and "
              "(N, d1, ...)",
              op, b1, kpl_shape_str(kpl_tensor_ndim(labels), ls, b2, sizeof b2));
    KPL_CHECK(kpl_tensor_dtype(labels) == KPL_I64, KPL_EDTYPE,
              "%s: labels have dtype %s, expected i64 class indices", op,
              kpl_dtype_name(kpl_tensor_dtype(labels)));
    int64_t n = kpl_tensor_numel(labels), c = xs[1];
    int64_t ishape[KPL_MAX_DIMS];
    ishape[0] = xs[0];
    ishape[1] = 1;
    for (int d = 2; d < nd; d++) ishape[d] = xs[d];
    if (kpl_tracing()) {
        /* The same targets in ops, so a trace holds them: labels are not
         * read on the host, and a label out of range is the gather's error
         * when the graph runs.  *nkeep = -1: the count is sum(keep). */
        kpl_device *dev = kpl_tensor_device(logp);
        kpl_tensor *counts = kpl_compare(KPL_BIN_NE, labels, kpl_full(dev, KPL_I64, 0, NULL,
                                                                      (double)ignore_index));
        kpl_tensor *safe = kpl_where(counts, labels, kpl_full(dev, KPL_I64, 0, NULL, 0));
        *idx = kpl_reshape(safe, nd, ishape);
        *keep = kpl_cast(counts, kpl_tensor_dtype(logp));
        *nkeep = -1;
        return *idx && *keep ? KPL_OK : kpl_last_status();
    }
    const int64_t *lv = kpl_tensor_host_data(labels);
    if (!lv && n) return kpl_last_status();
    kpl_device *dev = kpl_tensor_device(logp);
    kpl_tensor *safe = NULL, *mask = NULL;
    KPL_TRY(kpl_tensor_empty(dev, KPL_I64, kpl_tensor_ndim(labels), ls, &safe));
    kpl_status st = kpl_tensor_empty(dev, KPL_U8, kpl_tensor_ndim(labels), ls, &mask);
    if (st < 0) goto fail;
    int64_t *sv = kpl_tensor_host_mutable(safe), kept = 0;
    uint8_t *mv = kpl_tensor_host_mutable(mask);
    if ((!sv || !mv) && n) {
        st = kpl_last_status();
        goto fail;
    }
    for (int64_t i = 0; i < n; i++) {
        bool counts = lv[i] != ignore_index;
        if (counts && (lv[i] < 0 || lv[i] >= c)) {
            st = KPL_ERROR(KPL_ERANGE, "%s: label %lld in %s is outside [0, %lld) (input %s)", op,
                           (long long)lv[i], label_pos(labels, i, b3, sizeof b3), (long long)c,
                           b1);
            goto fail;
        }
        sv[i] = counts ? lv[i] : 0;
        mv[i] = counts;
        kept += counts;
    }
    *idx = kpl_reshape(kpl_autorelease(safe), nd, ishape);
    *keep = kpl_cast(kpl_autorelease(mask), kpl_tensor_dtype(logp));
    *nkeep = kept;
    return *idx && *keep ? KPL_OK : kpl_last_status();
fail:
    kpl_tensor_release(mask);
    kpl_tensor_release(safe);
    return st;
}

/* The mean of a traced class-index loss, as the host form computes it:
 * total / count (count = the labels that count, summed in f32 or f64 as
 * the host's int64 becomes the scalar: exact to 2^24), 0 when none
 * counts; weighted, total / sum(w[y_i]) (0 when none counts).  f16/bf16
 * divide in f32 and round once, as their scalar op does. */
static kpl_tensor *traced_mean(kpl_tensor *total, kpl_tensor *keep, kpl_tensor *wy)
{
    if (!total || !keep) return NULL;
    kpl_dtype dt = kpl_tensor_dtype(total), wide = dt == KPL_F64 ? KPL_F64 : KPL_F32;
    kpl_tensor *count = kpl_sum(kpl_cast(keep, wide), NULL, 0, false);
    if (wy) {
        /* none counts: divide by 1 (total is 0) */
        kpl_tensor *none = kpl_compare(KPL_BIN_EQ, count, kpl_full(kpl_tensor_device(keep), wide, 0, NULL, 0));
        kpl_tensor *den = kpl_sum(wy, NULL, 0, false);
        return kpl_div(total, kpl_where(none, kpl_full(kpl_tensor_device(keep), dt, 0, NULL, 1), den));
    }
    kpl_tensor *den = kpl_scalar_op(KPL_BIN_MAXIMUM, count, 1, false);
    if (dt == wide) return kpl_div(total, den);
    return kpl_cast(kpl_div(kpl_cast(total, wide), den), dt);
}

/* Per-element losses of log-probabilities logp (N, C, d1, ..., dk), as
 * PyTorch's nll_loss / cross_entropy:
 *   loss_i = (1 - eps) w[y_i] (-logp[y_i]) + eps / C sum_c w[c] (-logp[c]),
 * w = 1 without a weight, zero where y_i is ignore_index; reduced.  The
 * picked log-probability is a gather along the class axis, so nothing the
 * size of logp is made beyond what the smoothing term reads. */
static kpl_tensor *nll(const char *op, kpl_tensor *logp, kpl_tensor *labels, kpl_tensor *weight,
                       kpl_reduction red, double eps, int64_t ignore_index)
{
    if (!logp || !labels) return NULL;
    if (!(eps >= 0 && eps < 1)) {
        KPL_ERROR(KPL_EINVAL, "%s: label_smoothing %g is outside [0, 1)", op, eps);
        return NULL;
    }
    kpl_tensor *idx = NULL, *keep = NULL;
    int64_t kept = 0;
    if (class_targets(op, logp, labels, ignore_index, &idx, &keep, &kept) < 0) return NULL;
    int nd = kpl_tensor_ndim(logp), ax = 1;
    int64_t c = kpl_tensor_shape(logp)[1];
    if (weight) {
        char b[96];
        if (kpl_tensor_ndim(weight) != 1 || kpl_tensor_shape(weight)[0] != c ||
            kpl_tensor_dtype(weight) != kpl_tensor_dtype(logp)) {
            KPL_ERROR(KPL_ESHAPE, "%s: weight %s %s must be (%lld) %s, one per class", op,
                      kpl_shape_str(kpl_tensor_ndim(weight), kpl_tensor_shape(weight), b, sizeof b),
                      kpl_dtype_name(kpl_tensor_dtype(weight)), (long long)c,
                      kpl_dtype_name(kpl_tensor_dtype(logp)));
            return NULL;
        }
    }
    /* w[y_i] where y_i counts, else 0: (N, d1, ..., dk) */
    kpl_tensor *wy = keep;
    if (weight) {
        int64_t m = kpl_tensor_numel(idx);
        wy = kpl_mul(kpl_reshape(kpl_index_select(weight, 0, kpl_reshape(idx, 1, &m)),
                                 kpl_tensor_ndim(keep), kpl_tensor_shape(keep)),
                     keep);
    }
    kpl_tensor *picked = kpl_reshape(kpl_gather(logp, 1, idx), kpl_tensor_ndim(keep),
                                     kpl_tensor_shape(keep));
    kpl_tensor *per = kpl_neg(kpl_mul(picked, wy));
    if (eps > 0) {
        kpl_tensor *wl = logp;
        if (weight) {
            int64_t bshape[KPL_MAX_DIMS];
            for (int d = 0; d < nd; d++) bshape[d] = d == 1 ? c : 1;
            wl = kpl_mul(logp, kpl_reshape(weight, nd, bshape));
        }
        kpl_tensor *smooth = kpl_mul(kpl_sum(wl, &ax, 1, false), keep);
        per = kpl_add(SCALE(per, 1 - eps), SCALE(smooth, -eps / (double)c));
    }
    if (red != KPL_REDUCE_MEAN) return kpl__reduce_loss(per, red);
    /* The mean over the elements that count, weighted as PyTorch:
     * sum(loss_i) / sum(w[y_i]).  With none it is 0 (a sum of zeros),
     * where PyTorch's 0 / 0 is NaN: a batch without labelled pixels adds
     * nothing rather than stopping the run (docs/nn.md). */
    kpl_tensor *total = kpl_sum(per, NULL, 0, false);
    if (kept < 0) return traced_mean(total, keep, weight ? wy : NULL);
    if (!kept) return total;
    return weight ? kpl_div(total, kpl_sum(wy, NULL, 0, false))
                  : kpl_scalar_op(KPL_BIN_DIV, total, (double)kept, false);
}

kpl_tensor *kpl_nll_loss(kpl_tensor *logp, kpl_tensor *labels, kpl_reduction red,
                         int64_t ignore_index)
{
    return nll("nll_loss", logp, labels, NULL, red, 0, ignore_index);
}

kpl_tensor *kpl_cross_entropy_weighted(kpl_tensor *logits, kpl_tensor *labels,
                                       kpl_tensor *weight, kpl_reduction red,
                                       double label_smoothing, int64_t ignore_index)
{
    if (!logits) return NULL;
    if (kpl_tensor_ndim(logits) < 2) {
        char b[96];
        KPL_ERROR(KPL_ESHAPE, "cross_entropy: logits %s must be (N, C) or (N, C, d1, ...)",
                  kpl_shape_str(kpl_tensor_ndim(logits), kpl_tensor_shape(logits), b, sizeof b));
        return NULL;
    }
    return nll("cross_entropy", kpl_log_softmax(logits, 1), labels, weight, red,
               label_smoothing, ignore_index);
}

kpl_tensor *kpl_cross_entropy(kpl_tensor *logits, kpl_tensor *labels, kpl_reduction red,
                              double label_smoothing, int64_t ignore_index)
{
    return kpl_cross_entropy_weighted(logits, labels, NULL, red, label_smoothing, ignore_index);
}

/* Soft Dice as mmsegmentation 0.x's DiceLoss, with the ignored pixels
 * out of every sum (docs/nn.md says where it departs from mmseg).  No
 * one-hot tensor is made: the intersection sum(p t) per (sample, class)
 * is the probability of each pixel's own class (a gather) added into its
 * class's slot (a scatter_add), and sum(t^e) = sum(t) counts the pixels of
 * each class the same way. */
kpl_tensor *kpl_dice_loss(kpl_tensor *logits, kpl_tensor *labels, int64_t ignore_index,
                          double smooth, double exponent, kpl_reduction red)
{
    static const char op[] = "dice_loss";
    if (!logits || !labels) return NULL;
    if (!(smooth >= 0 && smooth < INFINITY) || !(exponent > 0 && exponent < INFINITY)) {
        KPL_ERROR(KPL_EINVAL, "%s: smooth %g must be >= 0 and exponent %g > 0 (both finite)", op,
                  smooth, exponent);
        return NULL;
    }
    if (red != KPL_REDUCE_MEAN && red != KPL_REDUCE_SUM && red != KPL_REDUCE_NONE) {
        KPL_ERROR(KPL_EINVAL, "%s: unknown reduction %d", op, (int)red);
        return NULL;
    }
    kpl_tensor *idx = NULL, *keep = NULL;
    int64_t kept = 0;
    if (class_targets(op, logits, labels, ignore_index, &idx, &keep, &kept) < 0) return NULL;
    int nd = kpl_tensor_ndim(logits);
    const int64_t *xs = kpl_tensor_shape(logits);
    int64_t n = xs[0], c = xs[1], m = n ? kpl_tensor_numel(labels) / n : 0;
    int64_t nm[2] = {n, m}, nc[2] = {n, c}, ncm[3] = {n, c, m}, bshape[KPL_MAX_DIMS];
    for (int d = 0; d < nd; d++) bshape[d] = d == 1 ? 1 : xs[d];
    kpl_device *dev = kpl_tensor_device(logits);
    kpl_dtype dt = kpl_tensor_dtype(logits);
    kpl_tensor *p = kpl_softmax(logits, 1);
    kpl_tensor *cls = kpl_reshape(idx, 2, nm), *kmask = kpl_reshape(keep, 2, nm);
    kpl_tensor *zeros = kpl_full(dev, dt, 2, nc, 0);
    kpl_tensor *own = kpl_mul(kpl_reshape(kpl_gather(p, 1, idx), 2, nm), kmask);
    kpl_tensor *inter = kpl_scatter_add(zeros, 1, cls, own);     /* sum(p t) */
    kpl_tensor *tsum = kpl_scatter_add(zeros, 1, cls, kmask);    /* sum(t^e) */
    kpl_tensor *pe = exponent == 1 ? p
                   : exponent == 2 ? kpl_square(p)
                                   : kpl_scalar_op(KPL_BIN_POW, p, exponent, false);
    int ax = 2;
    kpl_tensor *psum = kpl_sum(kpl_reshape(kpl_mul(pe, kpl_reshape(keep, nd, bshape)), 3, ncm),
                               &ax, 1, false);                  /* sum(p^e) */
    kpl_tensor *dice = kpl_div(kpl_scalar_op(KPL_BIN_ADD, SCALE(inter, 2), smooth, false),
                               kpl_scalar_op(KPL_BIN_ADD, kpl_add(psum, tsum), smooth, false));
    kpl_tensor *per = kpl_scalar_op(KPL_BIN_SUB, dice, 1, true); /* (N, C) */
    if (ignore_index >= 0 && ignore_index < c) {
        /* mmseg leaves the class ignore_index out, still dividing by C */
        kpl_tensor *cm = kpl_cast(kpl_compare(KPL_BIN_NE, kpl_arange(dev, KPL_I64, c, 0, 1),
                                              kpl_full(dev, KPL_I64, 0, NULL,
                                                       (double)ignore_index)),
                                  dt);
        per = kpl_mul(per, cm);
    }
    ax = 1;
    return kpl__reduce_loss(SCALE(kpl_sum(per, &ax, 1, false), 1.0 / (double)c), red);
}

/* A loss's target has its input's shape: broadcasting a (N, 1) output
 * against a (N) target would silently give an (N, N) loss. */
static bool same_shape(const char *op, const char *what, kpl_tensor *x, kpl_tensor *y)
{
    if (!x || !y) return false;
    int nd = kpl_tensor_ndim(x);
    bool same = kpl_tensor_ndim(y) == nd;
    for (int d = 0; same && d < nd; d++) same = kpl_tensor_shape(y)[d] == kpl_tensor_shape(x)[d];
    if (!same) {
        char b1[96], b2[96];
        KPL_ERROR(KPL_ESHAPE, "%s: target %s must have the shape of %s %s", op,
                  kpl_shape_str(kpl_tensor_ndim(y), kpl_tensor_shape(y), b1, sizeof b1), what,
                  kpl_shape_str(nd, kpl_tensor_shape(x), b2, sizeof b2));
    }
    return same;
}

kpl_tensor *kpl_mse_loss(kpl_tensor *x, kpl_tensor *y, kpl_reduction red)
{
    if (!same_shape("mse_loss", "the input", x, y)) return NULL;
    return kpl__reduce_loss(kpl_square(kpl_sub(x, y)), red);
}

kpl_tensor *kpl_l1_loss(kpl_tensor *x, kpl_tensor *y, kpl_reduction red)
{
    if (!same_shape("l1_loss", "the input", x, y)) return NULL;
    return kpl__reduce_loss(kpl_abs(kpl_sub(x, y)), red);
}

kpl_tensor *kpl_smooth_l1_loss(kpl_tensor *x, kpl_tensor *y, kpl_reduction red, double beta)
{
    if (!same_shape("smooth_l1_loss", "the input", x, y)) return NULL;
    if (!(beta >= 0)) {
        KPL_ERROR(KPL_EINVAL, "smooth_l1_loss: beta %g must be >= 0", beta);
        return NULL;
    }
    if (beta == 0) return kpl_l1_loss(x, y, red); /* the limit; the quadratic piece is empty */
    kpl_tensor *d = kpl_abs(kpl_sub(x, y));
    kpl_tensor *quad = kpl_scalar_op(KPL_BIN_MUL, kpl_square(d), 0.5 / beta, false);
    kpl_tensor *lin = kpl_scalar_op(KPL_BIN_SUB, d, 0.5 * beta, false);
    kpl_tensor *small = kpl_compare(KPL_BIN_LT, d, kpl_full(kpl_tensor_device(x),
                                                             kpl_tensor_dtype(x), 0, NULL, beta));
    return kpl__reduce_loss(kpl_where(small, quad, lin), red);
}

/* Whether `t` broadcasts to `shape` without enlarging it; sets the error. */
static bool fits(const char *op, const char *what, kpl_tensor *t, int nd, const int64_t *shape)
{
    int n;
    int64_t bs[KPL_MAX_DIMS];
    bool ok = kpl_shape_broadcast(op, kpl_tensor_ndim(t), kpl_tensor_shape(t), nd, shape, &n,
                                  bs) == KPL_OK &&
              n == nd;
    for (int d = 0; ok && d < nd; d++) ok = bs[d] == shape[d];
    if (!ok) {
        char b1[96], b2[96];
        KPL_ERROR(KPL_ESHAPE, "%s: %s %s does not broadcast to the logits' shape %s", op, what,
                  kpl_shape_str(kpl_tensor_ndim(t), kpl_tensor_shape(t), b1, sizeof b1),
                  kpl_shape_str(nd, shape, b2, sizeof b2));
    }
    return ok;
}

kpl_tensor *kpl_bce_with_logits_weighted(kpl_tensor *z, kpl_tensor *y, kpl_tensor *weight,
                                         kpl_tensor *pos_weight, kpl_reduction red)
{
    static const char op[] = "bce_with_logits";
    if (!same_shape(op, "the logits", z, y)) return NULL;
    int nd = kpl_tensor_ndim(z);
    const int64_t *zs = kpl_tensor_shape(z);
    if ((weight && !fits(op, "weight", weight, nd, zs)) ||
        (pos_weight && !fits(op, "pos_weight", pos_weight, nd, zs)))
        return NULL;
    /* -y log s(z) = y softplus(-z) and -(1 - y) log(1 - s(z)) = (1 - y)
     * softplus(z): both terms are >= 0, so neither large z nor tiny losses
     * lose digits, and the gradient -y s(-z) + (1 - y) s(z) is s(z) - y
     * everywhere, 0.5 - y at z = 0 (a max(z, 0) form gets 1 - y there). */
    kpl_tensor *pos = kpl_mul(y, kpl_softplus(kpl_neg(z)));
    if (pos_weight) pos = kpl_mul(pos, pos_weight);
    kpl_tensor *neg = kpl_mul(kpl_scalar_op(KPL_BIN_SUB, y, 1, true), kpl_softplus(z));
    kpl_tensor *per = kpl_add(pos, neg);
    if (weight) per = kpl_mul(per, weight);
    return kpl__reduce_loss(per, red);
}

kpl_tensor *kpl_bce_with_logits(kpl_tensor *z, kpl_tensor *y, kpl_reduction red)
{
    return kpl_bce_with_logits_weighted(z, y, NULL, NULL, red);
}

/* (C) -> (1, C, 1, ...) so it broadcasts over x (N, C, ...). */
static kpl_tensor *per_channel(kpl_tensor *v, int ndim)
{
    if (!v) return NULL;
    int64_t shape[KPL_MAX_DIMS];
    for (int i = 0; i < ndim; i++) shape[i] = 1;
    shape[1] = kpl_tensor_shape(v)[0];
    return kpl_reshape(v, ndim, shape);
}

static kpl_tensor *affine(kpl_tensor *y, kpl_tensor *gamma, kpl_tensor *beta)
{
    if (gamma) y = kpl_mul(y, gamma);
    if (beta) y = kpl_add(y, beta);
    return y;
}

/* kpl_batch_norm, followed by a ReLU when relu: fused into the training
 * op where the device has that kernel, else the relu op after it. */
static kpl_tensor *batch_norm(kpl_tensor *x, kpl_tensor *gamma, kpl_tensor *beta,
                              kpl_tensor *running_mean, kpl_tensor *running_var, bool training,
                              double momentum, double eps, bool relu)
{
    if (!x) return NULL;
    /* f16/bf16 activations stay so (statistics and parameters in f32)
     * where the device has that kernel; otherwise, and in eval mode, whose
     * composed form meets f32 running statistics, they become f32. */
    kpl_dtype xdt = kpl_tensor_dtype(x);
    bool half = xdt == KPL_F16 || xdt == KPL_BF16;
    if (half && (!training || !kpl_kernel_registered(KPL_KOP_BATCH_NORM,
                                                     kpl_device_type_of(kpl_tensor_device(x)),
                                                     xdt))) {
        x = kpl_cast(x, KPL_F32);
        half = false;
    }
    if (!x) return NULL;
    kpl_tensor **affine_in[2] = {&gamma, &beta};
    for (int i = 0; half && i < 2; i++)
        if (*affine_in[i] && kpl_tensor_dtype(*affine_in[i]) != KPL_F32 &&
            !(*affine_in[i] = kpl_cast(*affine_in[i], KPL_F32)))
            return NULL;
    int nd = kpl_tensor_ndim(x);
    if (nd < 2) {
        KPL_ERROR(KPL_ESHAPE, "batch_norm: input must be (N, C, ...), got %d dims", nd);
        return NULL;
    }
    int64_t c = kpl_tensor_shape(x)[1];
    kpl_tensor *vs[4] = {gamma, beta, running_mean, running_var};
    const char *names[4] = {"gamma", "beta", "running_mean", "running_var"};
    for (int i = 0; i < 4; i++)
        if (vs[i] && (kpl_tensor_ndim(vs[i]) != 1 || kpl_tensor_shape(vs[i])[0] != c)) {
            KPL_ERROR(KPL_ESHAPE, "batch_norm: %s must have shape (%lld), one value per channel",
                      names[i], (long long)c);
            return NULL;
        }
    if (!training && (!running_mean || !running_var)) {
        KPL_ERROR(KPL_EINVAL, "batch_norm: eval mode needs the running statistics");
        return NULL;
    }
    int64_t cnt = c ? kpl_tensor_numel(x) / c : 0; /* values per channel */
    if (training && cnt == 1) {
        /* the batch variance is 0 and every output would be beta */
        char b[96];
        KPL_ERROR(KPL_ESHAPE, "batch_norm: expected more than 1 value per channel when training, "
                              "got input size %s",
                  kpl_shape_str(nd, kpl_tensor_shape(x), b, sizeof b));
        return NULL;
    }
    if (!training) {
        kpl_tensor *y = kpl_mul(kpl_sub(x, per_channel(running_mean, nd)),
                                kpl_rsqrt(kpl_scalar_op(KPL_BIN_ADD, per_channel(running_var, nd),
                                                        eps, false)));
        y = affine(y, per_channel(gamma, nd), per_channel(beta, nd));
        return relu ? kpl_relu(y) : y;
    }
    /* Training: one fused op; absent gamma/beta become constants. */
    kpl_device *dev = kpl_tensor_device(x);
    kpl_dtype dt = half ? KPL_F32 : kpl_tensor_dtype(x); /* of the per-channel vectors */
    if (!gamma) gamma = kpl_full(dev, dt, 1, &c, 1);
    if (!beta) beta = kpl_full(dev, dt, 1, &c, 0);
    kpl_tensor *mean = NULL, *var = NULL;
    if (running_mean && running_var) {
        mean = kpl_empty(dev, dt, 1, &c);
        var = kpl_empty(dev, dt, 1, &c);
        if (!mean || !var) return NULL;
    }
    bool fused = relu && kpl_kernel_registered(KPL_KOP_BATCH_NORM_RELU,
                                               kpl_device_type_of(dev), kpl_tensor_dtype(x));
    kpl_tensor *y = kpl__batch_norm_train(x, gamma, beta, eps, mean, var, fused);
    if (y && mean) {
        /* running = (1 - m) running + m batch (unbiased variance), unrecorded */
        bool prev = kpl_set_grad_enabled(false);
        double unbias = cnt > 1 ? (double)cnt / (double)(cnt - 1) : 1.0;
        kpl_status st = kpl_write_scalar(running_mean, KPL_BIN_MUL, running_mean, 1 - momentum, false);
        if (st >= 0) st = kpl_write_scalar(mean, KPL_BIN_MUL, mean, momentum, false);
        if (st >= 0) st = kpl_write_binary(running_mean, KPL_BIN_ADD, running_mean, mean);
        if (st >= 0) st = kpl_write_scalar(running_var, KPL_BIN_MUL, running_var, 1 - momentum, false);
        if (st >= 0) st = kpl_write_scalar(var, KPL_BIN_MUL, var, momentum * unbias, false);
        if (st >= 0) st = kpl_write_binary(running_var, KPL_BIN_ADD, running_var, var);
        kpl_set_grad_enabled(prev);
        if (st < 0) return NULL;
    }
    return relu && !fused ? kpl_relu(y) : y;
}

kpl_tensor *kpl_batch_norm(kpl_tensor *x, kpl_tensor *gamma, kpl_tensor *beta,
                           kpl_tensor *running_mean, kpl_tensor *running_var, bool training,
                           double momentum, double eps)
{
    return batch_norm(x, gamma, beta, running_mean, running_var, training, momentum, eps, false);
}

kpl_tensor *kpl_batch_norm_relu(kpl_tensor *x, kpl_tensor *gamma, kpl_tensor *beta,
                                kpl_tensor *running_mean, kpl_tensor *running_var,
                                bool training, double momentum, double eps)
{
    return batch_norm(x, gamma, beta, running_mean, running_var, training, momentum, eps, true);
}

kpl_tensor *kpl_layer_norm(kpl_tensor *x, int ndims, kpl_tensor *gamma, kpl_tensor *beta,
                           double eps)
{
    if (!x) return NULL;
    int nd = kpl_tensor_ndim(x);
    if (ndims < 1 || ndims > nd) {
        KPL_ERROR(KPL_EINVAL, "layer_norm: cannot normalise the last %d of %d dims", ndims, nd);
        return NULL;
    }
    int axes[KPL_MAX_DIMS];
    for (int i = 0; i < ndims; i++) axes[i] = nd - ndims + i;
    kpl_tensor *mean = kpl_mean(x, axes, ndims, true), *var = kpl_var(x, axes, ndims, true, 0);
    kpl_tensor *y = kpl_mul(kpl_sub(x, mean), kpl_rsqrt(kpl_scalar_op(KPL_BIN_ADD, var, eps, false)));
    return affine(y, gamma, beta);
}

kpl_tensor *kpl_group_norm(kpl_tensor *x, int groups, kpl_tensor *gamma, kpl_tensor *beta,
                           double eps)
{
    if (!x) return NULL;
    int nd = kpl_tensor_ndim(x);
    const int64_t *s = kpl_tensor_shape(x);
    if (nd < 2 || groups < 1 || s[1] % groups) {
        KPL_ERROR(KPL_ESHAPE, "group_norm: %lld channels do not divide into %d groups",
                  nd >= 2 ? (long long)s[1] : 0LL, groups);
        return NULL;
    }
    int64_t shape[KPL_MAX_DIMS], g3[3] = {s[0], groups, kpl_tensor_numel(x) / (s[0] * groups)};
    memcpy(shape, s, (size_t)nd * sizeof *s);
    kpl_tensor *y = kpl_reshape(kpl_layer_norm(kpl_reshape(x, 3, g3), 1, NULL, NULL, eps), nd, shape);
    return affine(y, per_channel(gamma, nd), per_channel(beta, nd));
}

kpl_tensor *kpl_dropout(kpl_tensor *x, double p, bool training, kpl_rng *rng)
{
    if (!x) return NULL;
    if (!(p >= 0 && p < 1)) {
        KPL_ERROR(KPL_EINVAL, "dropout: probability %g is outside [0, 1)", p);
        return NULL;
    }
    if (!training || p == 0) return x;
    kpl_tensor *u = kpl_rand(kpl_tensor_device(x), kpl_tensor_dtype(x), kpl_tensor_ndim(x),
                             kpl_tensor_shape(x), rng, 0, 1);
    kpl_tensor *keep = kpl_cast(kpl_compare(KPL_BIN_GE, u, kpl_full(kpl_tensor_device(x),
                                                                     kpl_tensor_dtype(x), 0, NULL, p)),
                                kpl_tensor_dtype(x));
    return kpl_mul(x, kpl_scalar_op(KPL_BIN_DIV, keep, 1 - p, false));
}

/* ---- shape ops ------------------------------------------------------------------- */

kpl_tensor *kpl__index_tensor(kpl_device *dev, int64_t k, const int64_t *v)
{
    kpl_tensor *t = NULL;
    if (kpl_tensor_from_data(dev, KPL_I64, 1, &k, v, &t) < 0) return NULL;
    kpl__trace_const(t);
    return kpl_autorelease(t);
}

kpl_tensor *kpl_embedding(kpl_tensor *weight, kpl_tensor *ids)
{
    if (!weight || !ids) return NULL;
    if (kpl_tensor_ndim(weight) != 2 || kpl_tensor_ndim(ids) >= KPL_MAX_DIMS) {
        KPL_ERROR(KPL_ESHAPE, "embedding: weight must be (V, D) and ids at most %d-D",
                  KPL_MAX_DIMS - 1);
        return NULL;
    }
    int64_t n = kpl_tensor_numel(ids), shape[KPL_MAX_DIMS];
    int nd = kpl_tensor_ndim(ids);
    memcpy(shape, kpl_tensor_shape(ids), (size_t)nd * sizeof *shape);
    shape[nd] = kpl_tensor_shape(weight)[1];
    return kpl_reshape(kpl_index_select(weight, 0, kpl_reshape(ids, 1, &n)), nd + 1, shape);
}

kpl_tensor *kpl_slice(kpl_tensor *x, int axis, int64_t start, int64_t length)
{
    if (!x) return NULL;
    int nd = kpl_tensor_ndim(x), ax = axis < 0 ? axis + nd : axis;
    if (ax < 0 || ax >= nd || start < 0 || length < 0 || start + length > kpl_tensor_shape(x)[ax]) {
        char b[96];
        KPL_ERROR(KPL_ERANGE, "slice: [%lld, %lld) along axis %d is out of range for %s",
                  (long long)start, (long long)(start + length), axis,
                  kpl_shape_str(nd, kpl_tensor_shape(x), b, sizeof b));
        return NULL;
    }
    return kpl_index_select(x, ax, kpl_arange(kpl_tensor_device(x), KPL_I64, length,
                                              (double)start, 1));
}

kpl_tensor *kpl_concat(int n, kpl_tensor *const *xs, int axis)
{
    if (n < 1 || !xs) {
        KPL_ERROR(KPL_EINVAL, "concat: needs at least one tensor");
        return NULL;
    }
    for (int i = 0; i < n; i++)
        if (!xs[i]) return NULL;
    int nd = kpl_tensor_ndim(xs[0]), ax = axis < 0 ? axis + nd : axis;
    if (ax < 0 || ax >= nd) {
        KPL_ERROR(KPL_ESHAPE, "concat: axis %d out of range for %d dims", axis, nd);
        return NULL;
    }
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        bool ok = kpl_tensor_ndim(xs[i]) == nd;
        for (int d = 0; ok && d < nd; d++)
            ok = d == ax || kpl_tensor_shape(xs[i])[d] == kpl_tensor_shape(xs[0])[d];
        if (!ok) {
            char b1[96], b2[96];
            KPL_ERROR(KPL_ESHAPE, "concat: %s and %s differ outside axis %d",
                      kpl_shape_str(nd, kpl_tensor_shape(xs[0]), b1, sizeof b1),
                      kpl_shape_str(kpl_tensor_ndim(xs[i]), kpl_tensor_shape(xs[i]), b2, sizeof b2),
                      axis);
            return NULL;
        }
        total += kpl_tensor_shape(xs[i])[ax];
    }
    /* Each piece lands in its own rows of the result. */
    kpl_tensor *out = NULL;
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        int64_t len = kpl_tensor_shape(xs[i])[ax];
        kpl_tensor *rows = kpl_arange(kpl_tensor_device(xs[i]), KPL_I64, len, (double)off, 1);
        kpl_tensor *part = kpl_index_add(xs[i], ax, rows, total);
        out = out ? kpl_add(out, part) : part;
        off += len;
    }
    return out;
}

kpl_tensor *kpl_transpose(kpl_tensor *x, int a, int b)
{
    if (!x) return NULL;
    int nd = kpl_tensor_ndim(x), perm[KPL_MAX_DIMS];
    a = a < 0 ? a + nd : a;
    b = b < 0 ? b + nd : b;
    if (a < 0 || a >= nd || b < 0 || b >= nd) {
        KPL_ERROR(KPL_ESHAPE, "transpose: dims %d, %d out of range for %d dims", a, b, nd);
        return NULL;
    }
    for (int i = 0; i < nd; i++) perm[i] = i;
    perm[a] = b;
    perm[b] = a;
    return kpl_permute(x, perm);
}

kpl_tensor *kpl_pad(kpl_tensor *x, int npairs, const int64_t *pads, kpl_pad_mode mode,
                    double value)
{
    if (!x) return NULL;
    int nd = kpl_tensor_ndim(x);
    if (npairs < 0 || npairs > nd || (npairs && !pads)) {
        KPL_ERROR(KPL_EINVAL, "pad: %d pad pairs for %d dims", npairs, nd);
        return NULL;
    }
    kpl_tensor *y = x;
    for (int i = 0; i < npairs && y; i++) {
        int ax = nd - 1 - i;
        int64_t before = pads[2 * i], after = pads[2 * i + 1], len = kpl_tensor_shape(y)[ax];
        if (before < 0 || after < 0 || (mode == KPL_PAD_REFLECT && (before >= len || after >= len))) {
            KPL_ERROR(KPL_EINVAL, "pad: (%lld, %lld) on a dim of %lld (reflect needs less than "
                      "the dim)", (long long)before, (long long)after, (long long)len);
            return NULL;
        }
        int64_t total = before + len + after;
        int64_t *v = malloc((size_t)(total ? total : 1) * sizeof *v);
        if (!v) {
            KPL_ERROR(KPL_ENOMEM, "pad: no host memory");
            return NULL;
        }
        kpl_device *dev = kpl_tensor_device(y);
        if (mode == KPL_PAD_REFLECT) {
            for (int64_t j = 0; j < total; j++) {
                int64_t s = j - before;
                if (s < 0) s = -s;
                if (s >= len) s = 2 * (len - 1) - s;
                v[j] = s;
            }
            y = kpl_index_select(y, ax, kpl__index_tensor(dev, total, v));
        } else {
            for (int64_t j = 0; j < len; j++) v[j] = before + j;
            kpl_tensor *rows = kpl__index_tensor(dev, len, v);
            kpl_tensor *placed = kpl_index_add(y, ax, rows, total);
            if (value != 0 && placed) {
                /* value where nothing was placed: value * (1 - placed-mask) */
                int64_t shape1[KPL_MAX_DIMS];
                for (int d = 0; d < nd; d++) shape1[d] = d == ax ? len : 1;
                kpl_tensor *ones = kpl_full(dev, kpl_tensor_dtype(y), nd, shape1, 1);
                kpl_tensor *mask = kpl_index_add(ones, ax, rows, total);
                placed = kpl_add(placed, kpl_scalar_op(KPL_BIN_MUL,
                                                       kpl_scalar_op(KPL_BIN_SUB, mask, 1, true),
                                                       value, false));
            }
            y = placed;
        }
        free(v);
    }
    return y;
}

kpl_tensor *kpl_upsample_nearest(kpl_tensor *x, int64_t oh, int64_t ow)
{
    if (!x) return NULL;
    if (kpl_tensor_ndim(x) != 4 || oh < 1 || ow < 1) {
        KPL_ERROR(KPL_ESHAPE, "upsample_nearest: needs NCHW input and a positive size");
        return NULL;
    }
    int64_t h = kpl_tensor_shape(x)[2], w = kpl_tensor_shape(x)[3];
    int64_t *v = malloc((size_t)(oh > ow ? oh : ow) * sizeof *v);
    if (!v) return NULL;
    kpl_device *dev = kpl_tensor_device(x);
    for (int64_t i = 0; i < oh; i++) v[i] = i * h / oh;
    kpl_tensor *y = kpl_index_select(x, 2, kpl__index_tensor(dev, oh, v));
    for (int64_t i = 0; i < ow; i++) v[i] = i * w / ow;
    y = kpl_index_select(y, 3, kpl__index_tensor(dev, ow, v));
    free(v);
    return y;
}

/* Linear interpolation along one axis of an NCHW tensor. */
static kpl_tensor *lerp_axis(kpl_tensor *x, int ax, int64_t out, bool align)
{
    if (!x) return NULL;
    int64_t in = kpl_tensor_shape(x)[ax];
    int64_t *i0 = malloc((size_t)out * sizeof *i0), *i1 = malloc((size_t)out * sizeof *i1);
    double *wt = malloc((size_t)out * sizeof *wt);
    if (!i0 || !i1 || !wt) {
        free(i0);
        free(i1);
        free(wt);
        KPL_ERROR(KPL_ENOMEM, "upsample_bilinear: no host memory");
        return NULL;
    }
    for (int64_t i = 0; i < out; i++) {
        double s = align ? (out > 1 ? (double)i * (double)(in - 1) / (double)(out - 1) : 0)
                         : ((double)i + 0.5) * (double)in / (double)out - 0.5;
        if (s < 0) s = 0;
        int64_t a = (int64_t)s;
        if (a > in - 1) a = in - 1;
        i0[i] = a;
        i1[i] = a + 1 < in ? a + 1 : in - 1;
        wt[i] = s - (double)a;
    }
    kpl_device *dev = kpl_tensor_device(x);
    int64_t wshape[4] = {1, 1, 1, 1};
    wshape[ax] = out;
    kpl_tensor *w1 = NULL;
    if (kpl_tensor_empty(dev, KPL_F64, 4, wshape, &w1) == KPL_OK) {
        memcpy(kpl_tensor_host_mutable(w1), wt, (size_t)out * sizeof *wt);
        kpl_autorelease(w1);
        w1 = kpl_cast(w1, kpl_tensor_dtype(x));
    }
    kpl_tensor *a = kpl_index_select(x, ax, kpl__index_tensor(dev, out, i0));
    kpl_tensor *b = kpl_index_select(x, ax, kpl__index_tensor(dev, out, i1));
    free(i0);
    free(i1);
    free(wt);
    /* a + (b - a) * w */
    return kpl_add(a, kpl_mul(kpl_sub(b, a), w1));
}

kpl_tensor *kpl_upsample_bilinear(kpl_tensor *x, int64_t oh, int64_t ow, bool align_corners)
{
    if (!x) return NULL;
    if (kpl_tensor_ndim(x) != 4 || oh < 1 || ow < 1) {
        KPL_ERROR(KPL_ESHAPE, "upsample_bilinear: needs NCHW input and a positive size");
        return NULL;
    }
    return lerp_axis(lerp_axis(x, 2, oh, align_corners), 3, ow, align_corners);
}

kpl_status kpl_split(kpl_tensor *x, int axis, int n, const int64_t *sizes, kpl_tensor **out)
{
    KPL_CHECK(x != NULL && out != NULL && sizes != NULL && n >= 1, KPL_EINVAL,
              "split: NULL argument or no pieces");
    int nd = kpl_tensor_ndim(x), ax = axis < 0 ? axis + nd : axis;
    KPL_CHECK(ax >= 0 && ax < nd, KPL_ESHAPE, "split: axis %d out of range for %d dims", axis, nd);
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += sizes[i];
    KPL_CHECK(total == kpl_tensor_shape(x)[ax], KPL_ESHAPE,
              "split: sizes sum to %lld but axis %d has %lld", (long long)total, axis,
              (long long)kpl_tensor_shape(x)[ax]);
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        out[i] = kpl_slice(x, ax, off, sizes[i]);
        if (!out[i]) return kpl_last_status();
        off += sizes[i];
    }
    return KPL_OK;
}

typedef struct {
    double v;
    int64_t i;
} ranked;

static int rank_desc(const void *a, const void *b)
{
    const ranked *p = a, *q = b;
    bool pn = p->v != p->v, qn = q->v != q->v;
    if (pn != qn) return pn ? -1 : 1; /* NaN first */
    if (!pn && p->v != q->v) return p->v > q->v ? -1 : 1;
    return p->i < q->i ? -1 : (p->i > q->i);
}

static int rank_asc(const void *a, const void *b)
{
    const ranked *p = a, *q = b;
    bool pn = p->v != p->v, qn = q->v != q->v;
    if (pn != qn) return pn ? 1 : -1; /* NaN last */
    if (!pn && p->v != q->v) return p->v < q->v ? -1 : 1;
    return p->i < q->i ? -1 : (p->i > q->i);
}

kpl_status kpl_topk(kpl_tensor *x, int64_t k, bool largest, kpl_tensor **values,
                    kpl_tensor **indices)
{
    KPL_CHECK(x != NULL && values != NULL && indices != NULL, KPL_EINVAL, "topk: NULL argument");
    int nd = kpl_tensor_ndim(x);
    KPL_CHECK(nd >= 1, KPL_ESHAPE, "topk: needs at least one dim");
    int64_t cols = kpl_tensor_shape(x)[nd - 1], rows = cols ? kpl_tensor_numel(x) / cols : 0;
    KPL_CHECK(k >= 0 && k <= cols, KPL_ERANGE, "topk: k = %lld but the last dim has %lld",
              (long long)k, (long long)cols);
    KPL_CHECK(kpl_dtype_is_float(kpl_tensor_dtype(x)), KPL_EDTYPE, "topk: dtype %s",
              kpl_dtype_name(kpl_tensor_dtype(x)));
    ranked *r = malloc((size_t)(cols ? cols : 1) * sizeof *r);
    size_t nsel = (size_t)(rows * k > 0 ? rows * k : 1);
    int64_t *flat = malloc(nsel * sizeof *flat), *idx = malloc(nsel * sizeof *idx);
    kpl_status st = KPL_OK;
    if (!r || !flat || !idx) {
        st = KPL_ERROR(KPL_ENOMEM, "topk: no host memory");
        goto out;
    }
    for (int64_t row = 0; row < rows && st == KPL_OK; row++) {
        for (int64_t c = 0; c < cols; c++) {
            double v;
            if ((st = kpl_tensor_get(x, row * cols + c, &v)) < 0) break;
            r[c] = (ranked){v, c};
        }
        qsort(r, (size_t)cols, sizeof *r, largest ? rank_desc : rank_asc);
        for (int64_t j = 0; j < k; j++) {
            idx[row * k + j] = r[j].i;
            flat[row * k + j] = row * cols + r[j].i;
        }
    }
    if (st < 0) goto out;
    int64_t shape[KPL_MAX_DIMS], n = kpl_tensor_numel(x), nk = rows * k;
    memcpy(shape, kpl_tensor_shape(x), (size_t)nd * sizeof *shape);
    shape[nd - 1] = k;
    kpl_device *dev = kpl_tensor_device(x);
    /* values = the chosen entries of the flattened x: index_select records
     * them, so gradients reach exactly those entries */
    *values = kpl_reshape(kpl_index_select(kpl_reshape(x, 1, &n), 0,
                                           kpl__index_tensor(dev, nk, flat)), nd,
                          shape);
    kpl_tensor *it = NULL;
    if ((st = kpl_tensor_from_data(dev, KPL_I64, nd, shape, idx, &it)) == KPL_OK)
        *indices = kpl_autorelease(it);
    if (st == KPL_OK && (!*values || !*indices)) st = kpl_last_status();
out:
    free(r);
    free(flat);
    free(idx);
    return st;
}

/* The (out, in) matrix whose row i averages input cells
 * [floor(i in / out), ceil((i + 1) in / out)). */
static kpl_tensor *adaptive_matrix(kpl_device *dev, kpl_dtype dt, int64_t out, int64_t in)
{
    int64_t shape[2] = {out, in};
    kpl_tensor *m = NULL;
    if (kpl_tensor_zeros(dev, KPL_F64, 2, shape, &m) < 0) return NULL;
    double *v = kpl_tensor_host_mutable(m);
    for (int64_t i = 0; i < out; i++) {
        int64_t a = i * in / out, b = ((i + 1) * in + out - 1) / out;
        for (int64_t j = a; j < b; j++) v[i * in + j] = 1.0 / (double)(b - a);
    }
    return kpl_cast(kpl_autorelease(m), dt);
}

kpl_tensor *kpl_adaptive_avg_pool2d(kpl_tensor *x, int64_t oh, int64_t ow)
{
    if (!x) return NULL;
    if (kpl_tensor_ndim(x) != 4 || oh < 1 || ow < 1) {
        KPL_ERROR(KPL_ESHAPE, "adaptive_avg_pool2d: needs NCHW input and a positive size");
        return NULL;
    }
    kpl_device *dev = kpl_tensor_device(x);
    kpl_dtype dt = kpl_tensor_dtype(x);
    /* y = A_h x A_w^T: two (batched, broadcast) matmuls */
    kpl_tensor *ah = adaptive_matrix(dev, dt, oh, kpl_tensor_shape(x)[2]);
    kpl_tensor *aw = adaptive_matrix(dev, dt, ow, kpl_tensor_shape(x)[3]);
    return kpl_matmul(kpl_matmul(ah, x, false, false), aw, false, true);
}
