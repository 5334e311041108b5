/*
 * nn_shape.c — the shape functions of neural networks composed from the
 * recorded ops (embedding, slice, concat, transpose, pad, upsampling,
 * split, top-k, adaptive pooling): differentiable to any order through
 * the ops they are made of.
 */
#include "eager_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    if (!kpl_tracing() && !(kpl_grad_enabled() && kpl_requires_grad(x))) {
        /* nothing to record (a gradient's slab in backward, inference): a
         * slab copy, which keeps a kept layout where the channels allow
         * (concatenation's gradient) */
        int64_t shape[KPL_MAX_DIMS];
        memcpy(shape, kpl_tensor_shape(x), (size_t)nd * sizeof *shape);
        shape[ax] = length;
        kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), nd, shape);
        return out ? finish(kpl_k_copy_slab(out, x, ax, start, false), out) : NULL;
    }
    return kpl_index_select(x, ax, kpl_arange(kpl_tensor_device(x), KPL_I64, length,
                                              (double)start, 1));
}

/* One CONCAT op of k <= 3 pieces of one dtype along ax (checked). */
static kpl_tensor *concat_op(int k, kpl_tensor *const *p, int ax)
{
    int nd = kpl_tensor_ndim(p[0]);
    int64_t shape[KPL_MAX_DIMS];
    memcpy(shape, kpl_tensor_shape(p[0]), (size_t)nd * sizeof *shape);
    for (int i = 1; i < k; i++) shape[ax] += kpl_tensor_shape(p[i])[ax];
    kpl_tensor *out = new_like(p[0], kpl_tensor_dtype(p[0]), nd, shape);
    if (!out) return NULL;
    kpl_status st = kpl_k_concat(out, k, (const kpl_tensor *const *)p, ax);
    kpl_op_attrs at = {.axes = {ax}, .naxes = 1};
    return record_finish(st, KPL_OP_CONCAT, &at, k, p, out);
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
    }
    if (n == 1) return xs[0];
    /* under autocast, mixed float dtypes meet in the widest: after one pass
     * piece 0 is the widest, the second brings every other piece to it */
    kpl_tensor **c = malloc((size_t)n * sizeof *c);
    if (!c) {
        KPL_ERROR(KPL_ENOMEM, "concat: no host memory");
        return NULL;
    }
    memcpy(c, xs, (size_t)n * sizeof *c);
    for (int pass = 0; pass < 2; pass++)
        for (int i = 1; i < n && c[0]; i++) kpl__autocast_pair(KPL_OP_CONCAT, &c[0], &c[i]);
    kpl_tensor *out = NULL;
    bool ok = true;
    for (int i = 0; i < n && ok; i++) ok = c[i] != NULL; /* a failed cast said why */
    for (int i = 1; i < n && ok; i++)
        if (kpl_tensor_dtype(c[i]) != kpl_tensor_dtype(c[0])) {
            KPL_ERROR(KPL_EDTYPE, "concat: piece %d is %s but piece 0 is %s (cast them, or "
                      "concatenate under autocast, which promotes float pieces)", i,
                      kpl_dtype_name(kpl_tensor_dtype(c[i])), kpl_dtype_name(kpl_tensor_dtype(c[0])));
            ok = false;
        }
    /* three pieces an op, the result so far the first piece of the next */
    if (ok) out = c[0];
    for (int i = 1; i < n && out;) {
        kpl_tensor *p[3] = {out};
        int k = 1;
        while (k < 3 && i < n) p[k++] = c[i++];
        out = concat_op(k, p, ax);
    }
    free(c);
    return out;
}

/* In a graph (op_table.h's run and infer columns). */
kpl_status kpl__op_run_concat(const kpl_irn *n, kpl_tensor *const *in, kpl_tensor *const *out)
{
    return kpl_k_concat(out[0], n->nin, (const kpl_tensor *const *)in, n->at.axes[0]);
}

/* The inputs' sizes along the axis summed; equal elsewhere. */
kpl_status kpl__op_infer_concat(kpl__infer_ctx *c)
{
    int ax = c->n->at.axes[0], nd = c->x[0]->ndim;
    KPL_CHECK(ax >= 0 && ax < nd, KPL_ESHAPE, "%s: axis %d of %d dims", c->name, ax, nd);
    c->nd[0] = nd;
    memcpy(c->sh[0], c->x[0]->shape, (size_t)nd * sizeof c->sh[0][0]);
    for (int i = 1; i < c->n->nin; i++) {
        bool ok = c->x[i]->ndim == nd && c->x[i]->dtype == c->x[0]->dtype;
        for (int d = 0; ok && d < nd; d++) ok = d == ax || c->x[i]->shape[d] == c->sh[0][d];
        KPL_CHECK(ok, KPL_ESHAPE, "%s: input %d differs from input 0 outside axis %d (or in dtype)",
                  c->name, i, ax);
        c->sh[0][ax] += c->x[i]->shape[ax];
    }
    return KPL_OK;
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
