/*
 * nn.c — neural-network functions composed from the recorded ops: linear,
 * softmax, the losses.  Composition keeps them differentiable to any order
 * for free; fused kernels (oneDNN inner product, a single-pass softmax
 * cross entropy) replace the compositions where a benchmark shows the gain.
 */
#include "graph_impl.h"

#include <stdlib.h>
#include <string.h>

kpl_tensor *kpl_linear(kpl_tensor *x, kpl_tensor *w, kpl_tensor *b)
{
    kpl_tensor *y = kpl_matmul(x, w, false, true);
    return b ? kpl_add(y, b) : y;
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

/* One-hot rows (N, C) of `labels` in logp's dtype, and a (N) mask of the
 * rows that count; checks every label. */
static kpl_status one_hot(const char *op, kpl_tensor *logp, kpl_tensor *labels,
                          int64_t ignore_index, kpl_tensor **onehot, kpl_tensor **keep,
                          int64_t *nkeep)
{
    char b1[96], b2[96];
    kpl_shape_str(kpl_tensor_ndim(logp), kpl_tensor_shape(logp), b1, sizeof b1);
    kpl_shape_str(kpl_tensor_ndim(labels), kpl_tensor_shape(labels), b2, sizeof b2);
    KPL_CHECK(kpl_tensor_ndim(logp) == 2 && kpl_tensor_ndim(labels) == 1 &&
                  kpl_tensor_shape(labels)[0] == kpl_tensor_shape(logp)[0],
              KPL_ESHAPE, "%s: input %s and labels %s must be (N, C) and (N)", op, b1, b2);
    KPL_CHECK(kpl_tensor_dtype(labels) == KPL_I64, KPL_EDTYPE,
              "%s: labels have dtype %s, expected i64 class indices", op,
              kpl_dtype_name(kpl_tensor_dtype(labels)));
    int64_t n = kpl_tensor_shape(logp)[0], c = kpl_tensor_shape(logp)[1];
    const int64_t *lv = kpl_tensor_host_data(labels);
    if (!lv) return kpl_last_status();
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++) {
        if (lv[i] == ignore_index) continue;
        KPL_CHECK(lv[i] >= 0 && lv[i] < c, KPL_ERANGE,
                  "%s: label %lld in row %lld is outside [0, %lld) (input %s)", op,
                  (long long)lv[i], (long long)i, (long long)c, b1);
        kept++;
    }
    kpl_device *dev = kpl_tensor_device(logp);
    kpl_dtype dt = kpl_tensor_dtype(logp);
    int64_t col[2] = {n, 1};
    kpl_tensor *cls = kpl_arange(dev, KPL_I64, c, 0, 1);
    *onehot = kpl_cast(kpl_compare(KPL_BIN_EQ, kpl_reshape(labels, 2, col), cls), dt);
    *keep = kpl_cast(kpl_compare(KPL_BIN_NE, labels, kpl_full(dev, KPL_I64, 0, NULL,
                                                                  (double)ignore_index)),
                     dt);
    *nkeep = kept;
    return *onehot && *keep ? KPL_OK : kpl_last_status();
}

/* Per-row losses of log-probabilities: -(1-eps) logp[label] - eps mean(logp),
 * zero for ignored rows; reduced (mean over the rows that count). */
static kpl_tensor *nll(const char *op, kpl_tensor *logp, kpl_tensor *labels, kpl_reduction red,
                       double eps, int64_t ignore_index)
{
    if (!logp || !labels) return NULL;
    if (!(eps >= 0 && eps < 1)) {
        KPL_ERROR(KPL_EINVAL, "%s: label_smoothing %g is outside [0, 1)", op, eps);
        return NULL;
    }
    kpl_tensor *onehot = NULL, *keep = NULL;
    int64_t kept = 0;
    if (one_hot(op, logp, labels, ignore_index, &onehot, &keep, &kept) < 0) return NULL;
    int ax = 1;
    kpl_tensor *per = kpl_neg(kpl_sum(kpl_mul(logp, onehot), &ax, 1, false));
    if (eps > 0)
        per = kpl_add(kpl_scalar_op(KPL_BIN_MUL, per, 1 - eps, false),
                      kpl_scalar_op(KPL_BIN_MUL, kpl_mean(logp, &ax, 1, false), -eps, false));
    per = kpl_mul(per, keep);
    /* The mean over the rows that count, as PyTorch; with none, 0 (a sum
     * of zeros), where PyTorch's 0 / 0 is NaN: a batch without labelled
     * rows adds nothing rather than stopping the run (docs/nn.md). */
    if (red == KPL_REDUCE_MEAN)
        return kpl_scalar_op(KPL_BIN_DIV, kpl_sum(per, NULL, 0, false),
                             (double)(kept ? kept : 1), false);
    return kpl__reduce_loss(per, red);
}

kpl_tensor *kpl_nll_loss(kpl_tensor *logp, kpl_tensor *labels, kpl_reduction red,
                         int64_t ignore_index)
{
    return nll("nll_loss", logp, labels, red, 0, ignore_index);
}

kpl_tensor *kpl_cross_entropy(kpl_tensor *logits, kpl_tensor *labels, kpl_reduction red,
                              double label_smoothing, int64_t ignore_index)
{
    if (!logits) return NULL;
    if (kpl_tensor_ndim(logits) != 2) {
        char b[96];
        KPL_ERROR(KPL_ESHAPE, "cross_entropy: logits %s must be (N, C)",
                  kpl_shape_str(kpl_tensor_ndim(logits), kpl_tensor_shape(logits), b, sizeof b));
        return NULL;
    }
    return nll("cross_entropy", kpl_log_softmax(logits, 1), labels, red, label_smoothing,
               ignore_index);
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

kpl_tensor *kpl_batch_norm(kpl_tensor *x, kpl_tensor *gamma, kpl_tensor *beta,
                           kpl_tensor *running_mean, kpl_tensor *running_var, bool training,
                           double momentum, double eps)
{
    if (!x) return NULL;
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
        return affine(y, per_channel(gamma, nd), per_channel(beta, nd));
    }
    /* Training: one fused op; absent gamma/beta become constants. */
    kpl_device *dev = kpl_tensor_device(x);
    kpl_dtype dt = kpl_tensor_dtype(x);
    if (!gamma) gamma = kpl_full(dev, dt, 1, &c, 1);
    if (!beta) beta = kpl_full(dev, dt, 1, &c, 0);
    kpl_tensor *mean = NULL, *var = NULL;
    if (running_mean && running_var) {
        mean = kpl_empty(dev, dt, 1, &c);
        var = kpl_empty(dev, dt, 1, &c);
        if (!mean || !var) return NULL;
    }
    kpl_tensor *y = kpl__batch_norm_train(x, gamma, beta, eps, mean, var);
    if (y && mean) {
        /* running = (1 - m) running + m batch (unbiased variance), unrecorded */
        bool prev = kpl_set_grad_enabled(false);
        double unbias = cnt > 1 ? (double)cnt / (double)(cnt - 1) : 1.0;
        kpl_status st = kpl_k_binary_scalar(running_mean, KPL_BIN_MUL, running_mean, 1 - momentum, false);
        if (st >= 0) st = kpl_k_binary_scalar(mean, KPL_BIN_MUL, mean, momentum, false);
        if (st >= 0) st = kpl_k_binary(running_mean, KPL_BIN_ADD, running_mean, mean);
        if (st >= 0) st = kpl_k_binary_scalar(running_var, KPL_BIN_MUL, running_var, 1 - momentum, false);
        if (st >= 0) st = kpl_k_binary_scalar(var, KPL_BIN_MUL, var, momentum * unbias, false);
        if (st >= 0) st = kpl_k_binary(running_var, KPL_BIN_ADD, running_var, var);
        kpl_set_grad_enabled(prev);
        if (st < 0) return NULL;
    }
    return y;
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
