/*
 * exec_ops.c — each op in a graph: how it runs on tensors made for its
 * values (kpl__op_run_<f>, op_table.h's run column (EW, f) and (FN, f))
 * and what it makes from its inputs' shapes and dtypes
 * (kpl__op_infer_<infer>).  The generic kinds (unary, binary, scalar,
 * reduction) and the table lookups are exec.c's.  An op may keep its own
 * beside its eager function instead (roi_align's are in vision.c): the
 * prototypes come from the table (ir_impl.h).
 */
#include "graph_impl.h"
#include "ir_impl.h"

#include <string.h>

/* ---- running ---- */

#define RUN(f) kpl_status kpl__op_run_##f(const kpl_irn *n, kpl_tensor *const *in, \
                                           kpl_tensor *const *out)

RUN(binary) { return kpl_k_binary(out[0], (kpl_binary_op)n->at.sub, in[0], in[1]); }

RUN(batch_norm)
{
    return kpl_k_batch_norm(out[0], n->nout > 1 ? out[1] : NULL, n->nout > 2 ? out[2] : NULL,
                            in[0], in[1], in[2], n->at.alpha);
}

RUN(batch_norm_relu)
{
    return kpl_k_batch_norm_relu(out[0], n->nout > 1 ? out[1] : NULL, n->nout > 2 ? out[2] : NULL,
                                 in[0], in[1], in[2], n->at.alpha);
}

RUN(batch_norm_bwd) /* x, gy, gamma (, relu's output y) */
{
    if (n->at.sub)
        return kpl_k_batch_norm_relu_bwd(out[0], out[1], out[2], in[0], in[3], in[1], in[2],
                                         n->at.alpha);
    return kpl_k_batch_norm_bwd(out[0], out[1], out[2], in[0], in[1], in[2], n->at.alpha);
}

RUN(where) { (void)n; return kpl_k_where(out[0], in[0], in[1], in[2]); }
RUN(matmul) { return kpl_k_matmul(out[0], in[0], in[1], n->at.trans_a, n->at.trans_b); }
RUN(cast) { (void)n; return kpl_k_cast(out[0], in[0]); }
RUN(permute) { return kpl_k_permute(out[0], in[0], n->at.axes); }
RUN(expand) { (void)n; return kpl_k_expand(out[0], in[0]); }
RUN(pad_rows) { return kpl__pad_rows_into(out[0], in[0], n->at.start); }
RUN(conv2d) { return kpl_k_conv2d(out[0], in[0], in[1], in[2], &n->at.conv); }
RUN(conv2d_relu) { return kpl_k_conv2d_relu(out[0], in[0], in[1], in[2], &n->at.conv); }
/* conv2d_add(_relu): x, w, r (, b): conv + r (then ReLU), the inference
 * pass's residual fusion; r's bytes are the output's where the plan put
 * the output over them (O2), else r is copied there first. */
RUN(conv2d_add)
{
    kpl_tensor *y = out[0], *r = in[2];
    if (!kpl_tensor_shares_storage(y, r) || kpl_tensor_offset(y) != kpl_tensor_offset(r))
        KPL_TRY(kpl_k_copy(y, r));
    return kpl_k_conv2d_acc(y, in[0], in[1], n->nin > 3 ? in[3] : NULL, &n->at.conv,
                            n->op == KPL_OP_CONV2D_ADD_RELU);
}
RUN(conv2d_bwd_data) { return kpl_k_conv2d_bwd_data(out[0], in[0], in[1], &n->at.conv); }

RUN(conv2d_bwd_weight)
{
    return kpl_k_conv2d_bwd_weight(out[0], n->nout > 1 ? out[1] : NULL, in[0], in[1], &n->at.conv);
}

RUN(max_pool2d) { return kpl_k_max_pool2d(out[0], out[1], in[0], &n->at.pool); }
RUN(plane_gather) { (void)n; return kpl_k_plane_gather(out[0], in[0], in[1]); }
RUN(plane_scatter) { (void)n; return kpl_k_plane_scatter(out[0], in[0], in[1]); }
RUN(avg_pool2d) { return kpl_k_avg_pool2d(out[0], in[0], &n->at.pool); }
RUN(avg_pool2d_bwd) { return kpl_k_avg_pool2d_bwd(out[0], in[0], &n->at.pool); }
RUN(index_select) { return kpl_k_index_select(out[0], in[0], n->at.axes[0], in[1]); }
RUN(index_add) { return kpl_k_index_add(out[0], in[0], n->at.axes[0], in[1]); }
RUN(gather) { return kpl_k_gather(out[0], in[0], n->at.axes[0], in[1]); }
RUN(scatter_add) { return kpl_k_scatter_add(out[0], in[0], n->at.axes[0], in[1], in[2]); }

/* ---- shape inference ---- */

#define INFER(f) kpl_status kpl__op_infer_##f(kpl__infer_ctx *c)

static const char *shape_of(const kpl_irv *v, char *buf, size_t len)
{
    return kpl_shape_str(v->ndim, v->shape, buf, len);
}

INFER(none) { return KPL_ERROR(KPL_EINVAL, "op '%s' cannot run in a graph", c->name); }
INFER(same) { (void)c; return KPL_OK; }

INFER(broadcast)
{
    return kpl_shape_broadcast(c->name, c->x[0]->ndim, c->x[0]->shape, c->x[1]->ndim,
                               c->x[1]->shape, &c->nd[0], c->sh[0]);
}

INFER(compare)
{
    KPL_TRY(kpl__op_infer_broadcast(c));
    c->dt[0] = KPL_BOOL;
    return KPL_OK;
}

INFER(reduce)
{
    const kpl_op_attrs *a = &c->n->at;
    return kpl_shape_reduce(c->name, c->x[0]->ndim, c->x[0]->shape, a->naxes ? a->axes : NULL,
                            a->naxes, a->keepdim, &c->nd[0], c->sh[0]);
}

INFER(argreduce)
{
    KPL_TRY(kpl__op_infer_reduce(c));
    c->dt[0] = KPL_I64;
    return KPL_OK;
}

INFER(where)
{
    int64_t tmp[KPL_MAX_DIMS];
    int ntmp;
    const kpl_irv *const *x = c->x;
    KPL_TRY(kpl_shape_broadcast(c->name, x[0]->ndim, x[0]->shape, x[1]->ndim, x[1]->shape, &ntmp,
                                tmp));
    KPL_TRY(kpl_shape_broadcast(c->name, ntmp, tmp, x[2]->ndim, x[2]->shape, &c->nd[0], c->sh[0]));
    c->dt[0] = x[1]->dtype;
    return KPL_OK;
}

INFER(matmul)
{
    const kpl_op_attrs *a = &c->n->at;
    return kpl_shape_matmul(c->x[0]->ndim, c->x[0]->shape, a->trans_a, c->x[1]->ndim,
                            c->x[1]->shape, a->trans_b, &c->nd[0], c->sh[0]);
}

INFER(cast)
{
    c->dt[0] = c->o->dtype; /* the target is the value's dtype */
    return KPL_OK;
}

/* The recorded output's shape (what no attribute says). */
INFER(out_value)
{
    c->nd[0] = c->o->ndim;
    memcpy(c->sh[0], c->o->shape, sizeof c->sh[0]);
    return KPL_OK;
}

INFER(reshape)
{
    int64_t ne = 1, xe = 1;
    for (int i = 0; i < c->o->ndim; i++) ne *= c->o->shape[i];
    for (int i = 0; i < c->x[0]->ndim; i++) xe *= c->x[0]->shape[i];
    char b1[96], b2[96];
    KPL_CHECK(ne == xe, KPL_ESHAPE, "reshape: %s cannot become %s", shape_of(c->x[0], b1, sizeof b1),
              shape_of(c->o, b2, sizeof b2));
    return kpl__op_infer_out_value(c);
}

INFER(narrow)
{
    const kpl_op_attrs *a = &c->n->at;
    const kpl_irv *x = c->x[0];
    char b1[96];
    KPL_CHECK(x->ndim >= 1 && a->start >= 0 && a->length >= 0 && a->start <= x->shape[0] &&
                  a->length <= x->shape[0] - a->start,
              KPL_ESHAPE, "narrow: rows [%lld, %lld) of %s", (long long)a->start,
              (long long)(a->start + a->length), shape_of(x, b1, sizeof b1));
    c->sh[0][0] = a->length;
    return KPL_OK;
}

INFER(permute)
{
    const kpl_op_attrs *a = &c->n->at;
    const kpl_irv *x = c->x[0];
    KPL_CHECK(a->naxes == x->ndim, KPL_ESHAPE, "permute: %d axes for %d dims", a->naxes, x->ndim);
    for (int i = 0; i < a->naxes; i++) {
        KPL_CHECK(a->axes[i] >= 0 && a->axes[i] < x->ndim, KPL_ESHAPE, "permute: axis %d",
                  a->axes[i]);
        c->sh[0][i] = x->shape[a->axes[i]];
    }
    return KPL_OK;
}

INFER(expand)
{
    return kpl_shape_broadcast(c->name, c->x[0]->ndim, c->x[0]->shape, c->o->ndim, c->o->shape,
                               &c->nd[0], c->sh[0]);
}

INFER(pad_rows)
{
    c->sh[0][0] = c->n->at.length;
    return KPL_OK;
}

INFER(conv2d)
{
    KPL_CHECK(c->x[0]->ndim == 4 && c->x[1]->ndim == 4, KPL_ESHAPE, "%s: 4-D input and weights",
              c->name);
    return kpl_shape_conv2d(c->x[0]->shape, c->x[1]->shape, &c->n->at.conv, c->sh[0]);
}

INFER(conv2d_add) /* x, w, r (, b): r has the convolution's output shape and dtype */
{
    KPL_TRY(kpl__op_infer_conv2d(c));
    const kpl_irv *r = c->x[2];
    char b1[96];
    KPL_CHECK(r->ndim == 4 && !memcmp(r->shape, c->sh[0], sizeof(int64_t) * 4) &&
                  r->dtype == c->x[0]->dtype,
              KPL_ESHAPE, "%s: the addend %s %s does not match the convolution's output",
              c->name, kpl_dtype_name(r->dtype), shape_of(r, b1, sizeof b1));
    return KPL_OK;
}

/* batch_norm, batch_norm_relu: x, gamma, beta; batch_norm_bwd: x, gy,
 * gamma (, the ReLU's output y).  Outputs after the first are per channel,
 * in gamma's dtype. */
INFER(batch_norm)
{
    const kpl_irn *n = c->n;
    const kpl_irv *const *x = c->x;
    bool bwd = n->op == KPL_OP_BATCH_NORM_BWD;
    if (bwd)
        KPL_CHECK((n->nin == 4) == (n->at.sub != 0), KPL_EINVAL,
                  "batch_norm_bwd: the ReLU's output is an input exactly when relu is set");
    bool fit = x[0]->ndim >= 2 && x[2]->ndim == 1 && x[2]->shape[0] == x[0]->shape[1];
    if (bwd) /* gy and the ReLU's output have x's shape */
        for (int j = 1; j < n->nin; j += 2)
            fit = fit && x[j]->ndim == x[0]->ndim &&
                  !memcmp(x[j]->shape, x[0]->shape, (size_t)x[0]->ndim * sizeof(int64_t));
    else fit = fit && x[1]->ndim == 1 && x[1]->shape[0] == x[0]->shape[1];
    char b1[96];
    KPL_CHECK(fit, KPL_ESHAPE, "%s: x %s with inputs that do not fit it", c->name,
              shape_of(x[0], b1, sizeof b1));
    for (int j = 1; j < n->nout; j++) {
        c->nd[j] = 1;
        c->sh[j][0] = x[0]->shape[1];
        c->dt[j] = x[bwd ? 2 : 1]->dtype;
    }
    return KPL_OK;
}

/* The adjoints whose output shape is an attribute (shape4). */
INFER(shape4)
{
    c->nd[0] = 4;
    memcpy(c->sh[0], c->n->at.shape4, sizeof c->n->at.shape4);
    return KPL_OK;
}

INFER(conv2d_bwd_weight) /* (, the bias's gradient) */
{
    if (c->n->nout > 1) {
        c->nd[1] = 1;
        c->sh[1][0] = c->n->at.shape4[0];
        c->dt[1] = c->x[0]->dtype;
    }
    return kpl__op_infer_shape4(c);
}

INFER(pool2d)
{
    KPL_CHECK(c->x[0]->ndim == 4, KPL_ESHAPE, "%s: input must be 4-D", c->name);
    KPL_TRY(kpl_shape_pool2d(c->x[0]->shape, &c->n->at.pool, c->sh[0]));
    if (c->n->op == KPL_OP_MAX_POOL2D) { /* the indices */
        c->nd[1] = 4;
        memcpy(c->sh[1], c->sh[0], sizeof c->sh[0]);
        c->dt[1] = KPL_I64;
    }
    return KPL_OK;
}

/* Input 1's (the indices') shape. */
INFER(gather)
{
    c->nd[0] = c->x[1]->ndim;
    memcpy(c->sh[0], c->x[1]->shape, sizeof c->sh[0]);
    return KPL_OK;
}

INFER(index)
{
    const kpl_op_attrs *a = &c->n->at;
    char b1[96];
    KPL_CHECK(a->axes[0] >= 0 && a->axes[0] < c->x[0]->ndim && c->x[1]->ndim == 1, KPL_ESHAPE,
              "%s: axis %d of %s", c->name, a->axes[0], shape_of(c->x[0], b1, sizeof b1));
    c->sh[0][a->axes[0]] = c->n->op == KPL_OP_INDEX_SELECT ? c->x[1]->shape[0] : a->length;
    return KPL_OK;
}
