/*
 * eager_nn.c — the eager ops of neural networks: convolutions, pooling,
 * bilinear resizing, indexing, the fused training batch norm and the fused
 * gradients that backward runs without create_graph.  As eager.c: infer the shape,
 * allocate, compute through kernels/, record, hand to the pool.
 */
#include "eager_impl.h"

#include <string.h>

/* conv2d, or with relu conv2d_relu where the device has its kernel (for
 * f16/bf16, natively or through f32), else the relu op after conv2d. */
static kpl_tensor *conv2d(kpl_tensor *x, kpl_tensor *w, kpl_tensor *b, const kpl_conv2d_params *p,
                          bool relu)
{
    if (!x || !w || !p) return NULL;
    x = kpl__autocast(KPL_OP_CONV2D, x);
    w = kpl__autocast(KPL_OP_CONV2D, w);
    if (b) b = kpl__autocast(KPL_OP_CONV2D, b);
    if (!x || !w) return NULL;
    if (relu) {
        kpl_device_type dt = kpl_device_type_of(kpl_tensor_device(x));
        kpl_dtype xt = kpl_tensor_dtype(x);
        bool half = xt == KPL_F16 || xt == KPL_BF16;
        if (!kpl_kernel_registered(KPL_KOP_CONV2D_RELU, dt, xt) &&
            !(half && kpl_kernel_registered(KPL_KOP_CONV2D_RELU, dt, KPL_F32)))
            return kpl_relu(conv2d(x, w, b, p, false));
    }
    if (kpl_tensor_ndim(x) != 4 || kpl_tensor_ndim(w) != 4) {
        char b1[96], b2[96];
        KPL_ERROR(KPL_ESHAPE, "conv2d: input %s and weights %s must be 4-D",
                  kpl_shape_str(kpl_tensor_ndim(x), kpl_tensor_shape(x), b1, sizeof b1),
                  kpl_shape_str(kpl_tensor_ndim(w), kpl_tensor_shape(w), b2, sizeof b2));
        return NULL;
    }
    int64_t ys[4];
    if (kpl_shape_conv2d(kpl_tensor_shape(x), kpl_tensor_shape(w), p, ys) < 0) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), 4, ys);
    if (!out) return NULL;
    kpl_op_attrs at = {.conv = *p};
    kpl_tensor *ins[3] = {x, w, b};
    if (relu)
        return record_finish(kpl_k_conv2d_relu(out, x, w, b, p), KPL_OP_CONV2D_RELU, &at,
                             b ? 3 : 2, ins, out);
    return record_finish(kpl_k_conv2d(out, x, w, b, p), KPL_OP_CONV2D, &at, b ? 3 : 2, ins, out);
}

kpl_tensor *kpl_conv2d(kpl_tensor *x, kpl_tensor *w, kpl_tensor *b, const kpl_conv2d_params *p)
{
    return conv2d(x, w, b, p, false);
}

kpl_tensor *kpl_conv2d_relu(kpl_tensor *x, kpl_tensor *w, kpl_tensor *b,
                            const kpl_conv2d_params *p)
{
    return conv2d(x, w, b, p, true);
}

kpl_tensor *kpl_conv2d_bwd_data(kpl_tensor *gy, kpl_tensor *w, const int64_t *x_shape,
                                const kpl_conv2d_params *p)
{
    kpl__autocast_pair(KPL_OP_CONV2D_BWD_DATA, &gy, &w);
    if (!gy || !w || !x_shape || !p) return NULL;
    kpl_tensor *out = new_like(gy, kpl_tensor_dtype(gy), 4, x_shape);
    if (!out) return NULL;
    kpl_op_attrs at = {.conv = *p};
    memcpy(at.shape4, x_shape, sizeof at.shape4);
    kpl_tensor *ins[2] = {gy, w};
    return record_finish(kpl_k_conv2d_bwd_data(out, gy, w, p), KPL_OP_CONV2D_BWD_DATA, &at, 2,
                         ins, out);
}

kpl_tensor *kpl_conv2d_bwd_weight(kpl_tensor *x, kpl_tensor *gy, const int64_t *w_shape,
                                  const kpl_conv2d_params *p)
{
    kpl__autocast_pair(KPL_OP_CONV2D_BWD_WEIGHT, &x, &gy);
    if (!x || !gy || !w_shape || !p) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), 4, w_shape);
    if (!out) return NULL;
    kpl_op_attrs at = {.conv = *p};
    memcpy(at.shape4, w_shape, sizeof at.shape4);
    kpl_tensor *ins[2] = {x, gy};
    return record_finish(kpl_k_conv2d_bwd_weight(out, NULL, x, gy, p), KPL_OP_CONV2D_BWD_WEIGHT,
                         &at, 2, ins, out);
}

kpl_tensor *kpl_conv_transpose2d(kpl_tensor *x, kpl_tensor *w, kpl_tensor *b,
                                 const kpl_conv2d_params *p, const int *output_padding)
{
    if (!x || !w || !p) return NULL;
    if (kpl_tensor_ndim(x) != 4 || kpl_tensor_ndim(w) != 4) {
        KPL_ERROR(KPL_ESHAPE, "conv_transpose2d: input and weights must be 4-D");
        return NULL;
    }
    const int64_t *xs = kpl_tensor_shape(x), *ws = kpl_tensor_shape(w);
    int64_t cout = ws[1] * (p->groups > 0 ? p->groups : 1);
    if (ws[0] != xs[1] || p->groups < 1 || xs[1] % p->groups ||
        (b && (kpl_tensor_ndim(b) != 1 || kpl_tensor_shape(b)[0] != cout))) {
        char b1[96], b2[96], b3[96];
        KPL_ERROR(KPL_ESHAPE, "conv_transpose2d: input %s, weights %s (Cin, Cout/groups, KH, KW), "
                              "groups %d and bias %s do not fit (expected Cin = %lld, bias (%lld))",
                  kpl_shape_str(4, xs, b1, sizeof b1), kpl_shape_str(4, ws, b2, sizeof b2),
                  p->groups,
                  b ? kpl_shape_str(kpl_tensor_ndim(b), kpl_tensor_shape(b), b3, sizeof b3) : "none",
                  (long long)xs[1], (long long)cout);
        return NULL;
    }
    int op0 = output_padding ? output_padding[0] : 0, op1 = output_padding ? output_padding[1] : 0;
    if (op0 < 0 || op1 < 0 || op0 >= (p->stride[0] > p->dilation[0] ? p->stride[0] : p->dilation[0]) ||
        op1 >= (p->stride[1] > p->dilation[1] ? p->stride[1] : p->dilation[1])) {
        KPL_ERROR(KPL_EINVAL, "conv_transpose2d: output_padding (%d,%d) must be smaller than the "
                              "stride or the dilation", op0, op1);
        return NULL;
    }
    int64_t os[4] = {xs[0], ws[1] * p->groups,
                     (xs[2] - 1) * p->stride[0] - 2 * p->padding[0] + p->dilation[0] * (ws[2] - 1) +
                         op0 + 1,
                     (xs[3] - 1) * p->stride[1] - 2 * p->padding[1] + p->dilation[1] * (ws[3] - 1) +
                         op1 + 1};
    if (os[2] < 1 || os[3] < 1) {
        char b1[96], b2[96];
        KPL_ERROR(KPL_ESHAPE, "conv_transpose2d: input %s with weights %s, padding (%d,%d) gives "
                              "an empty output (%lldx%lld)",
                  kpl_shape_str(4, xs, b1, sizeof b1), kpl_shape_str(4, ws, b2, sizeof b2),
                  p->padding[0], p->padding[1], (long long)os[2], (long long)os[3]);
        return NULL;
    }
    /* conv2d's input gradient makes an input of a given size only if that
     * size convolves back to x's, i.e. only for output_padding < stride.
     * PyTorch also allows output_padding < dilation: in such a dim take the
     * gradient unpadded, over the full extent (H - 1) stride + dilation
     * (KH - 1) + 1, then drop `padding` rows at the start and fill the end
     * up to the output size with zeros (rows no kernel tap reaches). */
    kpl_conv2d_params q = *p;
    int64_t full[4] = {os[0], os[1], os[2], os[3]};
    const int opad[2] = {op0, op1};
    bool crop[2];
    for (int d = 0; d < 2; d++) {
        crop[d] = opad[d] >= p->stride[d];
        if (!crop[d]) continue;
        q.padding[d] = 0;
        full[2 + d] = (xs[2 + d] - 1) * p->stride[d] + p->dilation[d] * (ws[2 + d] - 1) + 1;
    }
    kpl_tensor *y = kpl_conv2d_bwd_data(x, w, full, &q);
    for (int d = 0; d < 2 && y; d++) {
        if (!crop[d]) continue;
        int64_t keep = full[2 + d] - p->padding[d];
        if (keep > os[2 + d]) keep = os[2 + d];
        if (keep < 0) keep = 0;
        int64_t pads[4] = {0, 0, 0, 0}; /* (W before, W after, H before, H after) */
        pads[d == 0 ? 3 : 1] = os[2 + d] - keep;
        y = kpl_slice(y, 2 + d, p->padding[d], keep);
        if (pads[1] || pads[3]) y = kpl_pad(y, 2, pads, KPL_PAD_CONSTANT, 0);
    }
    if (!b) return y;
    b = kpl__autocast(KPL_OP_CONV2D, b); /* the result stays in the low dtype */
    int64_t bs[4] = {1, os[1], 1, 1};
    return kpl_add(y, kpl_reshape(b, 4, bs));
}

kpl_tensor *kpl_max_pool2d(kpl_tensor *x, const kpl_pool2d_params *p)
{
    x = kpl__autocast(KPL_OP_PLANE_GATHER, x);
    if (!x || !p) return NULL;
    int64_t ys[4];
    if (kpl_tensor_ndim(x) != 4) {
        KPL_ERROR(KPL_ESHAPE, "max_pool2d: input must be 4-D (N, C, H, W)");
        return NULL;
    }
    if (kpl_shape_pool2d(kpl_tensor_shape(x), p, ys) < 0) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), 4, ys);
    /* the indices only where the gradient or a trace reads them (the
     * kernel's values-only loops are faster) */
    bool want_idx = kpl_tracing() || (kpl_grad_enabled() && kpl_requires_grad(x));
    kpl_tensor *idx = want_idx ? new_like(x, KPL_I64, 4, ys) : NULL;
    if (!out || (want_idx && !idx)) {
        kpl_tensor_release(out);
        kpl_tensor_release(idx);
        return NULL;
    }
    kpl_status st = kpl_k_max_pool2d(out, idx, x, p);
    kpl_op_attrs at = {.pool = *p};
    if (st == KPL_OK) kpl__trace_op(KPL_OP_MAX_POOL2D, &at, 1, &x, 2, (kpl_tensor *[]){out, idx});
    /* out equals plane_gather(x, idx): record it on the tape as that. */
    kpl_tensor *ins[2] = {x, idx};
    kpl_tensor *r = record_finish_as(st, KPL_OP_PLANE_GATHER, &at, 2, ins, out, false);
    kpl_tensor_release(idx); /* the node keeps it if it needs it */
    return r;
}

kpl_tensor *kpl_plane_gather(kpl_tensor *x, kpl_tensor *idx)
{
    x = kpl__autocast(KPL_OP_PLANE_GATHER, x);
    if (!x || !idx) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), kpl_tensor_ndim(idx), kpl_tensor_shape(idx));
    if (!out) return NULL;
    kpl_tensor *ins[2] = {x, idx};
    return record_finish(kpl_k_plane_gather(out, x, idx), KPL_OP_PLANE_GATHER, NULL, 2, ins, out);
}

kpl_tensor *kpl_plane_scatter(kpl_tensor *gy, kpl_tensor *idx, const int64_t *x_shape)
{
    gy = kpl__autocast(KPL_OP_PLANE_SCATTER, gy);
    if (!gy || !idx || !x_shape) return NULL;
    kpl_tensor *out = new_like(gy, kpl_tensor_dtype(gy), 4, x_shape);
    if (!out) return NULL;
    kpl_op_attrs at = {0};
    memcpy(at.shape4, x_shape, sizeof at.shape4);
    kpl_tensor *ins[2] = {gy, idx};
    return record_finish(kpl_k_plane_scatter(out, gy, idx), KPL_OP_PLANE_SCATTER, &at, 2, ins,
                         out);
}

kpl_tensor *kpl_avg_pool2d(kpl_tensor *x, const kpl_pool2d_params *p)
{
    x = kpl__autocast(KPL_OP_AVG_POOL2D, x);
    if (!x || !p) return NULL;
    int64_t ys[4];
    if (kpl_tensor_ndim(x) != 4) {
        KPL_ERROR(KPL_ESHAPE, "avg_pool2d: input must be 4-D (N, C, H, W)");
        return NULL;
    }
    if (kpl_shape_pool2d(kpl_tensor_shape(x), p, ys) < 0) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), 4, ys);
    if (!out) return NULL;
    kpl_op_attrs at = {.pool = *p};
    return record_finish(kpl_k_avg_pool2d(out, x, p), KPL_OP_AVG_POOL2D, &at, 1, &x, out);
}

kpl_tensor *kpl_avg_pool2d_bwd(kpl_tensor *gy, const int64_t *x_shape, const kpl_pool2d_params *p)
{
    gy = kpl__autocast(KPL_OP_AVG_POOL2D_BWD, gy);
    if (!gy || !x_shape || !p) return NULL;
    kpl_tensor *out = new_like(gy, kpl_tensor_dtype(gy), 4, x_shape);
    if (!out) return NULL;
    kpl_op_attrs at = {.pool = *p};
    memcpy(at.shape4, x_shape, sizeof at.shape4);
    return record_finish(kpl_k_avg_pool2d_bwd(out, gy, p), KPL_OP_AVG_POOL2D_BWD, &at, 1, &gy,
                         out);
}

/* Bilinear resizing (op UPSAMPLE_BILINEAR) or its adjoint (UPSAMPLE_BILINEAR_BWD)
 * of `in` into a new tensor of `shape`. */
static kpl_tensor *resize_op(kpl_op op, kpl_tensor *in, const int64_t *shape, bool align)
{
    in = kpl__autocast(op, in);
    if (!in) return NULL;
    kpl_tensor *out = new_like(in, kpl_tensor_dtype(in), 4, shape);
    if (!out) return NULL;
    kpl_op_attrs at = {.align_corners = align};
    memcpy(at.shape4, shape, sizeof at.shape4);
    kpl_status st = op == KPL_OP_UPSAMPLE_BILINEAR ? kpl_k_upsample_bilinear(out, in, align)
                                                   : kpl_k_upsample_bilinear_bwd(out, in, align);
    return record_finish(st, op, &at, 1, &in, out);
}

kpl_tensor *kpl_upsample_bilinear(kpl_tensor *x, int64_t oh, int64_t ow, bool align_corners)
{
    if (!x) return NULL;
    if (kpl_tensor_ndim(x) != 4 || oh < 1 || ow < 1) {
        char b[96];
        KPL_ERROR(KPL_ESHAPE, "upsample_bilinear: needs NCHW input and a positive size; got %s "
                  "to %lldx%lld", kpl_shape_str(kpl_tensor_ndim(x), kpl_tensor_shape(x), b, sizeof b),
                  (long long)oh, (long long)ow);
        return NULL;
    }
    const int64_t *xs = kpl_tensor_shape(x);
    int64_t shape[4] = {xs[0], xs[1], oh, ow};
    return resize_op(KPL_OP_UPSAMPLE_BILINEAR, x, shape, align_corners);
}

kpl_tensor *kpl_upsample_bilinear_bwd(kpl_tensor *gy, const int64_t *x_shape, bool align_corners)
{
    if (!gy) return NULL;
    if (!x_shape) {
        KPL_ERROR(KPL_EINVAL, "upsample_bilinear_bwd: argument 'x_shape' is NULL");
        return NULL;
    }
    for (int d = 0; d < 4; d++)
        if (x_shape[d] < (d < 2 ? 0 : 1)) {
            KPL_ERROR(KPL_ESHAPE, "upsample_bilinear_bwd: x_shape[%d] is %lld", d,
                      (long long)x_shape[d]);
            return NULL;
        }
    return resize_op(KPL_OP_UPSAMPLE_BILINEAR_BWD, gy, x_shape, align_corners);
}

/* In a graph (op_table.h's run and infer columns). */
kpl_status kpl__op_run_upsample_bilinear(const kpl_irn *n, kpl_tensor *const *in,
                                         kpl_tensor *const *out)
{
    return kpl_k_upsample_bilinear(out[0], in[0], n->at.align_corners);
}

kpl_status kpl__op_run_upsample_bilinear_bwd(const kpl_irn *n, kpl_tensor *const *in,
                                             kpl_tensor *const *out)
{
    return kpl_k_upsample_bilinear_bwd(out[0], in[0], n->at.align_corners);
}

/* upsample_bilinear: x's (N, C) at the attribute's (OH, OW). */
kpl_status kpl__op_infer_resize(kpl__infer_ctx *c)
{
    KPL_CHECK(c->x[0]->ndim == 4, KPL_ESHAPE, "%s: input must be 4-D", c->name);
    c->nd[0] = 4;
    memcpy(c->sh[0], c->x[0]->shape, 2 * sizeof c->sh[0][0]);
    c->sh[0][2] = c->n->at.shape4[2];
    c->sh[0][3] = c->n->at.shape4[3];
    return KPL_OK;
}

/* Softmax cross entropy per position (op SOFTMAX_XENT) or its gradient in
 * the logits (SOFTMAX_XENT_BWD, given gy). */
static kpl_tensor *xent_op(kpl_op op, kpl_tensor *logits, kpl_tensor *labels, kpl_tensor *gy,
                           int64_t ignore_index, double eps)
{
    logits = kpl__autocast(op, logits);
    if (gy) gy = kpl__autocast(op, gy);
    if (!logits || !labels || (op == KPL_OP_SOFTMAX_XENT_BWD && !gy)) return NULL;
    bool fwd = op == KPL_OP_SOFTMAX_XENT;
    kpl_tensor *shape_of = fwd ? labels : logits;
    kpl_tensor *out = new_like(logits, kpl_tensor_dtype(logits), kpl_tensor_ndim(shape_of),
                               kpl_tensor_shape(shape_of));
    if (!out) return NULL;
    kpl_op_attrs at = {.start = ignore_index, .alpha = eps};
    kpl_tensor *ins[3] = {logits, labels, gy};
    kpl_status st = fwd ? kpl_k_softmax_xent(out, logits, labels, ignore_index, eps)
                        : kpl_k_softmax_xent_bwd(out, logits, labels, gy, ignore_index, eps);
    return record_finish(st, op, &at, fwd ? 2 : 3, ins, out);
}

kpl_tensor *kpl_softmax_xent(kpl_tensor *logits, kpl_tensor *labels, int64_t ignore_index,
                             double label_smoothing)
{
    return xent_op(KPL_OP_SOFTMAX_XENT, logits, labels, NULL, ignore_index, label_smoothing);
}

kpl_tensor *kpl_softmax_xent_bwd(kpl_tensor *logits, kpl_tensor *labels, kpl_tensor *gy,
                                 int64_t ignore_index, double label_smoothing)
{
    return xent_op(KPL_OP_SOFTMAX_XENT_BWD, logits, labels, gy, ignore_index, label_smoothing);
}

kpl_status kpl__op_run_softmax_xent(const kpl_irn *n, kpl_tensor *const *in,
                                    kpl_tensor *const *out)
{
    return kpl_k_softmax_xent(out[0], in[0], in[1], n->at.start, n->at.alpha);
}

kpl_status kpl__op_run_softmax_xent_bwd(const kpl_irn *n, kpl_tensor *const *in,
                                        kpl_tensor *const *out)
{
    return kpl_k_softmax_xent_bwd(out[0], in[0], in[1], in[2], n->at.start, n->at.alpha);
}

/* softmax_xent: the labels' shape in the logits' dtype. */
kpl_status kpl__op_infer_xent(kpl__infer_ctx *c)
{
    KPL_CHECK(c->x[0]->ndim >= 2 && c->x[1]->ndim == c->x[0]->ndim - 1, KPL_ESHAPE,
              "%s: logits must be (N, C, ...) and labels (N, ...)", c->name);
    c->nd[0] = c->x[1]->ndim;
    memcpy(c->sh[0], c->x[1]->shape, (size_t)c->x[1]->ndim * sizeof c->sh[0][0]);
    return KPL_OK;
}

kpl_tensor *kpl_global_avg_pool2d(kpl_tensor *x)
{
    return kpl_mean(x, (int[]){2, 3}, 2, true);
}

kpl_tensor *kpl_index_select(kpl_tensor *x, int axis, kpl_tensor *idx)
{
    if (!x || !idx) return NULL;
    int nd = kpl_tensor_ndim(x), ax = axis < 0 ? axis + nd : axis;
    if (ax < 0 || ax >= nd || kpl_tensor_ndim(idx) != 1) {
        KPL_ERROR(KPL_ESHAPE, "index_select: axis %d of a %d-D tensor with %d-D indices", axis,
                  nd, kpl_tensor_ndim(idx));
        return NULL;
    }
    int64_t shape[KPL_MAX_DIMS];
    memcpy(shape, kpl_tensor_shape(x), (size_t)nd * sizeof *shape);
    shape[ax] = kpl_tensor_shape(idx)[0];
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), nd, shape);
    if (!out) return NULL;
    kpl_op_attrs at = {.axes = {ax}, .naxes = 1, .length = kpl_tensor_shape(x)[ax]};
    kpl_tensor *ins[2] = {x, idx};
    return record_finish(kpl_k_index_select(out, x, ax, idx), KPL_OP_INDEX_SELECT, &at, 2, ins,
                         out);
}

kpl_tensor *kpl_index_add(kpl_tensor *g, int axis, kpl_tensor *idx, int64_t dim)
{
    if (!g || !idx) return NULL;
    int nd = kpl_tensor_ndim(g), ax = axis < 0 ? axis + nd : axis;
    if (ax < 0 || ax >= nd || dim < 0) {
        KPL_ERROR(KPL_ESHAPE, "index_add: axis %d of a %d-D tensor, size %lld", axis, nd,
                  (long long)dim);
        return NULL;
    }
    int64_t shape[KPL_MAX_DIMS];
    memcpy(shape, kpl_tensor_shape(g), (size_t)nd * sizeof *shape);
    shape[ax] = dim;
    kpl_tensor *out = new_like(g, kpl_tensor_dtype(g), nd, shape);
    if (!out) return NULL;
    kpl_op_attrs at = {.axes = {ax}, .naxes = 1, .length = dim};
    kpl_tensor *ins[2] = {g, idx};
    return record_finish(kpl_k_index_add(out, g, ax, idx), KPL_OP_INDEX_ADD, &at, 2, ins, out);
}

/* The axis of gather / scatter_add, counted from 0; ESHAPE when x has no such axis. */
static int gather_axis(const char *op, kpl_tensor *x, int axis)
{
    int nd = kpl_tensor_ndim(x), ax = axis < 0 ? axis + nd : axis;
    if (ax < 0 || ax >= nd) {
        char b[96];
        KPL_ERROR(KPL_ESHAPE, "%s: axis %d is out of range for x %s", op, axis,
                  kpl_shape_str(nd, kpl_tensor_shape(x), b, sizeof b));
        return -1;
    }
    return ax;
}

kpl_tensor *kpl_gather(kpl_tensor *x, int axis, kpl_tensor *idx)
{
    if (!x || !idx) return NULL;
    int ax = gather_axis("gather", x, axis);
    if (ax < 0) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), kpl_tensor_ndim(idx), kpl_tensor_shape(idx));
    if (!out) return NULL;
    kpl_op_attrs at = {.axes = {ax}, .naxes = 1};
    kpl_tensor *ins[2] = {x, idx};
    return record_finish(kpl_k_gather(out, x, ax, idx), KPL_OP_GATHER, &at, 2, ins, out);
}

kpl_tensor *kpl_scatter_add(kpl_tensor *x, int axis, kpl_tensor *idx, kpl_tensor *src)
{
    kpl__autocast_pair(KPL_OP_SCATTER_ADD, &x, &src);
    if (!x || !idx || !src) return NULL;
    int ax = gather_axis("scatter_add", x, axis);
    if (ax < 0) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), kpl_tensor_ndim(x), kpl_tensor_shape(x));
    if (!out) return NULL;
    kpl_op_attrs at = {.axes = {ax}, .naxes = 1};
    kpl_tensor *ins[3] = {x, idx, src};
    return record_finish(kpl_k_scatter_add(out, x, ax, idx, src), KPL_OP_SCATTER_ADD, &at, 3, ins,
                         out);
}

/* ---- batch norm (the fused training form; graph/nn.c wraps it) ------------------ */

kpl_tensor *kpl__batch_norm_train(kpl_tensor *x, kpl_tensor *gamma, kpl_tensor *beta,
                                  double eps, kpl_tensor *mean, kpl_tensor *var, bool relu)
{
    if (!x || !gamma || !beta) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), kpl_tensor_ndim(x), kpl_tensor_shape(x));
    if (!out) return NULL;
    kpl_op_attrs at = {.alpha = eps};
    kpl_tensor *ins[3] = {x, gamma, beta};
    kpl_op op = relu ? KPL_OP_BATCH_NORM_RELU : KPL_OP_BATCH_NORM;
    kpl_status st = relu ? kpl_k_batch_norm_relu(out, mean, var, x, gamma, beta, eps)
                         : kpl_k_batch_norm(out, mean, var, x, gamma, beta, eps);
    /* traced with the batch statistics as outputs (the running ones are
     * updated from them by writes) */
    if (st == KPL_OK && kpl_tracing())
        kpl__trace_op(op, &at, 3, ins, mean && var ? 3 : 1, (kpl_tensor *[]){out, mean, var});
    return record_finish_as(st, op, &at, 3, ins, out, false);
}

kpl_tensor *kpl__group_norm_fused(kpl_tensor *x, int groups, kpl_tensor *gamma, kpl_tensor *beta,
                                  double eps)
{
    if (!x || !gamma || !beta) return NULL;
    kpl_tensor *out = new_like(x, kpl_tensor_dtype(x), kpl_tensor_ndim(x), kpl_tensor_shape(x));
    if (!out) return NULL;
    kpl_op_attrs at = {.start = groups, .alpha = eps};
    kpl_tensor *ins[3] = {x, gamma, beta};
    return record_finish_as(kpl_k_group_norm(out, x, gamma, beta, groups, eps),
                            KPL_OP_GROUP_NORM, &at, 3, ins, out, false);
}

/* ---- fused gradients ------------------------------------------------------------- */

kpl_status kpl_group_norm_bwd(kpl_tensor *x, kpl_tensor *gy, kpl_tensor *gamma, int groups,
                               double eps, kpl_tensor **gx, kpl_tensor **ggamma,
                               kpl_tensor **gbeta)
{
    KPL_CHECK(x && gy && gamma, KPL_EINVAL, "group_norm_bwd: NULL");
    int64_t c = kpl_tensor_shape(gamma)[0];
    kpl_dtype dt = kpl_tensor_dtype(x);
    kpl_tensor *o[3] = {new_like(x, dt, kpl_tensor_ndim(x), kpl_tensor_shape(x)),
                        ggamma ? new_like(x, dt, 1, &c) : NULL,
                        gbeta ? new_like(x, dt, 1, &c) : NULL};
    kpl_status st = KPL_OK;
    if (!o[0] || (ggamma && !o[1]) || (gbeta && !o[2])) st = kpl_last_status();
    if (st == KPL_OK) st = kpl_k_group_norm_bwd(o[0], o[1], o[2], x, gy, gamma, groups, eps);
    kpl_tensor **dst[3] = {gx, ggamma, gbeta};
    for (int i = 0; i < 3; i++) {
        kpl_tensor *r = finish(st, o[i]);
        if (dst[i]) *dst[i] = r;
    }
    return st;
}

kpl_tensor *kpl_relu_bwd(kpl_tensor *gy, kpl_tensor *y)
{
    if (!gy || !y) return NULL;
    kpl_tensor *out = new_like(gy, kpl_tensor_dtype(gy), kpl_tensor_ndim(y), kpl_tensor_shape(y));
    if (!out) return NULL;
    kpl_op_attrs at = {.sub = KPL_BIN_RELU_BWD};
    return trace_finish(kpl_k_binary(out, KPL_BIN_RELU_BWD, gy, y), KPL_OP_BINARY, &at, 2,
                        (kpl_tensor *[]){gy, y}, out);
}

kpl_status kpl_conv2d_bwd_weight_bias(kpl_tensor *x, kpl_tensor *gy, const int64_t *w_shape,
                                      const kpl_conv2d_params *p, kpl_tensor **gw,
                                      kpl_tensor **gb)
{
    KPL_CHECK(x && gy && w_shape && p && gw && gb, KPL_EINVAL, "conv2d_bwd_weight_bias: NULL");
    *gw = *gb = NULL;
    kpl_tensor *w = new_like(x, kpl_tensor_dtype(x), 4, w_shape);
    kpl_tensor *b = new_like(x, kpl_tensor_dtype(x), 1, w_shape);
    kpl_status st = w && b ? kpl_k_conv2d_bwd_weight(w, b, x, gy, p) : kpl_last_status();
    if (st == KPL_OK) {
        kpl_op_attrs at = {.conv = *p};
        memcpy(at.shape4, w_shape, sizeof at.shape4);
        kpl__trace_op(KPL_OP_CONV2D_BWD_WEIGHT, &at, 2, (kpl_tensor *[]){x, gy}, 2,
                      (kpl_tensor *[]){w, b});
    }
    *gw = finish(st, w);
    *gb = finish(st, b);
    return st;
}

kpl_status kpl_batch_norm_bwd(kpl_tensor *x, kpl_tensor *relu_y, kpl_tensor *gy,
                              kpl_tensor *gamma, double eps, kpl_tensor **gx,
                              kpl_tensor **ggamma, kpl_tensor **gbeta)
{
    KPL_CHECK(x && gy && gamma && (gx || ggamma || gbeta), KPL_EINVAL, "batch_norm_bwd: NULL");
    /* a trace makes all three (the graph's node has three outputs) */
    bool all = kpl_tracing();
    int64_t c = kpl_tensor_shape(gamma)[0];
    kpl_dtype pdt = kpl_tensor_dtype(gamma); /* f32 under f16/bf16 activations */
    kpl_tensor *o[3] = {
        gx || all ? new_like(x, kpl_tensor_dtype(x), kpl_tensor_ndim(x), kpl_tensor_shape(x)) : NULL,
        ggamma || all ? new_like(x, pdt, 1, &c) : NULL,
        gbeta || all ? new_like(x, pdt, 1, &c) : NULL};
    kpl_status st = KPL_OK;
    for (int i = 0; i < 3; i++)
        if (!o[i] && (all || (i == 0 ? gx : i == 1 ? ggamma : gbeta))) st = kpl_last_status();
    if (st == KPL_OK)
        st = relu_y ? kpl_k_batch_norm_relu_bwd(o[0], o[1], o[2], x, relu_y, gy, gamma, eps)
                    : kpl_k_batch_norm_bwd(o[0], o[1], o[2], x, gy, gamma, eps);
    if (st == KPL_OK) {
        kpl_op_attrs at = {.alpha = eps, .sub = relu_y != NULL};
        kpl__trace_op(KPL_OP_BATCH_NORM_BWD, &at, relu_y ? 4 : 3,
                      (kpl_tensor *[]){x, gy, gamma, relu_y}, 3, o);
    }
    kpl_tensor **dst[3] = {gx, ggamma, gbeta};
    for (int i = 0; i < 3; i++) {
        kpl_tensor *r = finish(st, o[i]);
        if (dst[i]) *dst[i] = r;
    }
    return st;
}
