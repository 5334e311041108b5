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
 * size of logp is made beyond what the smoothing term reads.  With
 * `logits`, logp holds the logits: the unweighted loss is the fused
 * softmax_xent (one kernel each way, nothing the size of the logits made;
 * a weight multiplies it, w[y_i] being all the weighted form needs
 * without smoothing); weights with smoothing take log_softmax and the
 * chain below. */
static kpl_tensor *nll(const char *op, kpl_tensor *logp, bool logits, kpl_tensor *labels,
                       kpl_tensor *weight, kpl_reduction red, double eps, int64_t ignore_index)
{
    if (!logp || !labels) return NULL;
    if (logits && weight && eps > 0) {
        logp = kpl_log_softmax(logp, 1);
        logits = false;
    }
    if (logits) logp = kpl__autocast(KPL_OP_SOFTMAX_XENT, logp); /* keep in the loss's dtype */
    if (!logp) return NULL;
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
    kpl_tensor *per = NULL;
    if (logits) {
        per = kpl_softmax_xent(logp, labels, ignore_index, eps);
        if (weight) per = kpl_mul(per, wy);
    } else {
        kpl_tensor *picked = kpl_reshape(kpl_gather(logp, 1, idx), kpl_tensor_ndim(keep),
                                         kpl_tensor_shape(keep));
        per = kpl_neg(kpl_mul(picked, wy));
    }
    if (eps > 0 && !logits) {
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
    return nll("nll_loss", logp, false, labels, NULL, red, 0, ignore_index);
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
    return nll("cross_entropy", logits, true, labels, weight, red, label_smoothing, ignore_index);
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
        /* y = x a + b with a = gamma / sqrt(var + eps), b = beta - mean a,
         * (C) vectors first (PyTorch's CPU inference formula): two passes
         * over x instead of four */
        kpl_tensor *a = kpl_rsqrt(kpl_scalar_op(KPL_BIN_ADD, running_var, eps, false));
        if (gamma) a = kpl_mul(a, gamma);
        kpl_tensor *b = kpl_neg(kpl_mul(running_mean, a));
        if (beta) b = kpl_add(b, beta);
        kpl_tensor *y = kpl_add(kpl_mul(x, per_channel(a, nd)), per_channel(b, nd));
        return relu ? kpl_relu(y) : y;
    }
    /* Training: one fused op; absent gamma/beta become constants. */
    kpl_device *dev = kpl_tensor_device(x);
    kpl_dtype dt = half ? KPL_F32 : kpl_tensor_dtype(x); /* of the per-channel vectors */
    if (!gamma) gamma = kpl_full(dev, dt, 1, &c, 1);
    if (!beta) beta = kpl_full(dev, dt, 1, &c, 0);
    kpl_tensor *mean = NULL, *var = NULL;
    /* a recomputation (graph.h) does not move the running statistics again */
    if (running_mean && running_var && !kpl_recompute_replaying()) {
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
    int64_t per = s[0] * groups > 0 ? kpl_tensor_numel(x) / (s[0] * groups) : 0;
    int64_t shape[KPL_MAX_DIMS], g3[3] = {s[0], groups, per};
    memcpy(shape, s, (size_t)nd * sizeof *s);
    kpl_tensor *y;
    kpl_tensor *xa = kpl_tracing() ? NULL : kpl__autocast(KPL_OP_GROUP_NORM, x);
    kpl_dtype adt = xa ? kpl_tensor_dtype(xa) : KPL_F32;
    if (xa && kpl_kernel_registered(KPL_KOP_GROUP_NORM,
                                    kpl_device_type_of(kpl_tensor_device(xa)), adt)) {
        /* one op each way (the CPU's kernels), the affine inside */
        kpl_device *dev = kpl_tensor_device(xa);
        kpl_tensor *v[2] = {gamma, beta};
        for (int i = 0; i < 2; i++)
            v[i] = !v[i] ? kpl_full(dev, adt, 1, &s[1], i ? 0 : 1)
                   : kpl_tensor_dtype(v[i]) == adt ? v[i] : kpl_cast(v[i], adt);
        return kpl__group_norm_fused(xa, groups, v[0], v[1], eps);
    }
    if (per > 1 && !kpl_tracing()) {
        /* Each (sample, group) is a channel of the view (1, N G, per):
         * training batch norm's fused op there computes exactly these
         * statistics (biased variance, f64 sums) in two passes, and its
         * gradient in one kernel, where the chain below keeps x - mean and
         * the normalised x alive for backward.  A trace keeps the chain:
         * graphs leave as model files and ONNX, where the training batch
         * norm op has no form. */
        int64_t v3[3] = {1, s[0] * groups, per};
        y = kpl_batch_norm(kpl_reshape(x, 3, v3), NULL, NULL, NULL, NULL, true, 0, eps);
        y = kpl_reshape(y, nd, shape);
    } else {
        /* one value per group (or none): the chain, which gives 0 there */
        y = kpl_reshape(kpl_layer_norm(kpl_reshape(x, 3, g3), 1, NULL, NULL, eps), nd, shape);
    }
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
