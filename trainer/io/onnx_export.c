/*
 * onnx_export.c — GraphIR as an ONNX model (IR version 7, opset 13), with
 * protobuf-c and kpl's subset of ONNX's schema (io/onnx/kpl_onnx.proto).
 *
 * Each kpl op becomes the ONNX op of the same meaning, or a few of them
 * (rsqrt is Sqrt then Reciprocal, var is built from ReduceMean and
 * ReduceSum); parameters and constants become initializers under their
 * names; reshape and expand targets, slice bounds and scalars become int64
 * or typed constant initializers.  An op with no ONNX form (the pooling
 * adjoints, roi_align) is an error naming it.
 */
#include "infer.h"
#include "io_impl.h"

#include "onnx/onnx_dtypes.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ONNX_IR_VERSION 7
#define ONNX_OPSET 13

typedef struct {
    const kpl_ir *ir;
    void **mem; /* everything allocated for the message tree */
    size_t nmem, capmem;
    Onnx__NodeProto **node;
    size_t nnode, capnode;
    Onnx__TensorProto **init;
    size_t ninit, capinit;
    char **vname; /* per value */
    int ntmp;
    kpl_status st;
} writer;

static bool grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return true;
    size_t n = *cap ? *cap * 2 : 64;
    while (n < need) n *= 2;
    void *q = realloc(*p, n * elem);
    if (!q) return false;
    *p = q;
    *cap = n;
    return true;
}

static void *w_alloc(writer *w, size_t bytes)
{
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p || !grow((void **)&w->mem, &w->capmem, w->nmem + 1, sizeof *w->mem)) {
        free(p);
        if (w->st == KPL_OK) w->st = KPL_ERROR(KPL_ENOMEM, "onnx export: no host memory");
        return NULL;
    }
    w->mem[w->nmem++] = p;
    return p;
}

static char *w_str(writer *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static char *w_str(writer *w, const char *fmt, ...)
{
    char buf[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    char *s = w_alloc(w, strlen(buf) + 1);
    if (s) strcpy(s, buf);
    return s;
}

static const char *tmp_name(writer *w) { return w_str(w, "_t%d", w->ntmp++); }


/* An initializer `name` of dtype dt, shape, bytes copied (or borrowed when
 * `borrow`: a tensor that outlives the packing). */
static const char *initializer(writer *w, const char *name, kpl_dtype dt, int nd, const int64_t *shape,
                               const void *bytes, size_t n, bool borrow)
{
    Onnx__TensorProto *t = w_alloc(w, sizeof *t);
    int64_t *dims = w_alloc(w, sizeof(int64_t) * (size_t)(nd ? nd : 1));
    void *data = borrow ? (void *)bytes : w_alloc(w, n);
    if (!t || !dims || !data || !name ||
        !grow((void **)&w->init, &w->capinit, w->ninit + 1, sizeof *w->init)) {
        if (w->st == KPL_OK) w->st = KPL_ERROR(KPL_ENOMEM, "onnx export: no host memory");
        return NULL;
    }
    onnx__tensor_proto__init(t);
    if (!borrow && n) memcpy(data, bytes, n);
    if (nd) memcpy(dims, shape, sizeof(int64_t) * (size_t)nd);
    t->n_dims = (size_t)nd;
    t->dims = dims;
    t->has_data_type = 1;
    t->data_type = kpl_onnx_dtype(dt);
    t->name = (char *)name;
    t->has_raw_data = 1;
    t->raw_data.len = n;
    t->raw_data.data = data;
    w->init[w->ninit++] = t;
    return name;
}

static const char *const_i64(writer *w, const int64_t *v, int n)
{
    int64_t len = n;
    return initializer(w, w_str(w, "_c%d", w->ntmp++), KPL_I64, 1, &len, v, sizeof(int64_t) * (size_t)n,
                       false);
}

/* A 0-D constant s of dtype dt (floats; integers as themselves). */
static const char *const_scalar(writer *w, kpl_dtype dt, double s)
{
    union {
        float f;
        double d;
        int64_t i;
        int32_t i32;
        uint16_t h;
        uint8_t u;
    } v;
    size_t n = kpl_dtype_size(dt);
    switch (dt) {
    case KPL_F32: v.f = (float)s; break;
    case KPL_F64: v.d = s; break;
    case KPL_F16: v.h = kpl_f32_to_f16((float)s); break;
    case KPL_BF16: v.h = kpl_f32_to_bf16((float)s); break;
    case KPL_I64: v.i = (int64_t)s; break;
    case KPL_I32: v.i32 = (int32_t)s; break;
    default: v.u = (uint8_t)s; break;
    }
    return initializer(w, w_str(w, "_c%d", w->ntmp++), dt, 0, NULL, &v, n, false);
}

static Onnx__NodeProto *node(writer *w, const char *op, int nin, const char *const *in, int nout,
                             const char *const *out)
{
    Onnx__NodeProto *n = w_alloc(w, sizeof *n);
    char **i = w_alloc(w, sizeof(char *) * (size_t)(nin ? nin : 1));
    char **o = w_alloc(w, sizeof(char *) * (size_t)nout);
    if (!n || !i || !o || !grow((void **)&w->node, &w->capnode, w->nnode + 1, sizeof *w->node)) {
        if (w->st == KPL_OK) w->st = KPL_ERROR(KPL_ENOMEM, "onnx export: no host memory");
        return NULL;
    }
    onnx__node_proto__init(n);
    for (int k = 0; k < nin; k++) i[k] = (char *)(in[k] ? in[k] : "");
    for (int k = 0; k < nout; k++) o[k] = (char *)out[k];
    n->n_input = (size_t)nin;
    n->input = i;
    n->n_output = (size_t)nout;
    n->output = o;
    n->op_type = (char *)op;
    n->name = w_str(w, "n%zu", w->nnode);
    w->node[w->nnode++] = n;
    return n;
}

/* One-input, one-output node: returns the output's name (out, or a new
 * temporary when out is NULL). */
static const char *op1(writer *w, const char *op, const char *x, const char *out)
{
    const char *o = out ? out : tmp_name(w);
    node(w, op, 1, &x, 1, &o);
    return o;
}

static const char *op2(writer *w, const char *op, const char *a, const char *b, const char *out)
{
    const char *o = out ? out : tmp_name(w);
    node(w, op, 2, (const char *[]){a, b}, 1, &o);
    return o;
}

static Onnx__AttributeProto *attr(writer *w, Onnx__NodeProto *n, const char *name)
{
    if (!n) return NULL;
    Onnx__AttributeProto *a = w_alloc(w, sizeof *a);
    Onnx__AttributeProto **list = w_alloc(w, sizeof *list * (n->n_attribute + 1));
    if (!a || !list) return NULL;
    onnx__attribute_proto__init(a);
    a->name = (char *)name;
    if (n->n_attribute) memcpy(list, n->attribute, sizeof *list * n->n_attribute);
    list[n->n_attribute++] = a;
    n->attribute = list;
    a->has_type = 1;
    return a;
}

static void attr_i(writer *w, Onnx__NodeProto *n, const char *name, int64_t v)
{
    Onnx__AttributeProto *a = attr(w, n, name);
    if (!a) return;
    a->type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INT;
    a->has_i = 1;
    a->i = v;
}

static void attr_f(writer *w, Onnx__NodeProto *n, const char *name, float v)
{
    Onnx__AttributeProto *a = attr(w, n, name);
    if (!a) return;
    a->type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOAT;
    a->has_f = 1;
    a->f = v;
}

static void attr_s(writer *w, Onnx__NodeProto *n, const char *name, const char *v)
{
    Onnx__AttributeProto *a = attr(w, n, name);
    if (!a) return;
    a->type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__STRING;
    a->has_s = 1;
    a->s.len = strlen(v);
    a->s.data = (uint8_t *)v;
}

static void attr_ints(writer *w, Onnx__NodeProto *n, const char *name, const int64_t *v, int k)
{
    Onnx__AttributeProto *a = attr(w, n, name);
    int64_t *c = w_alloc(w, sizeof *c * (size_t)(k ? k : 1));
    if (!a || !c) return;
    memcpy(c, v, sizeof *c * (size_t)k);
    a->type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INTS;
    a->n_ints = (size_t)k;
    a->ints = c;
}

static Onnx__ValueInfoProto *value_info(writer *w, int v, const char *name)
{
    const kpl_ir *ir = w->ir;
    Onnx__ValueInfoProto *vi = w_alloc(w, sizeof *vi);
    Onnx__TypeProto *tp = w_alloc(w, sizeof *tp);
    Onnx__TypeProto__Tensor *tt = w_alloc(w, sizeof *tt);
    Onnx__TensorShapeProto *sh = w_alloc(w, sizeof *sh);
    int64_t shape[KPL_MAX_DIMS];
    int nd = kpl_ir_value_shape(ir, v, shape);
    Onnx__TensorShapeProto__Dimension **dims = w_alloc(w, sizeof *dims * (size_t)(nd ? nd : 1));
    if (!vi || !tp || !tt || !sh || !dims) return NULL;
    onnx__value_info_proto__init(vi);
    onnx__type_proto__init(tp);
    onnx__type_proto__tensor__init(tt);
    onnx__tensor_shape_proto__init(sh);
    for (int d = 0; d < nd; d++) {
        Onnx__TensorShapeProto__Dimension *dim = w_alloc(w, sizeof *dim);
        if (!dim) return NULL;
        onnx__tensor_shape_proto__dimension__init(dim);
        dim->value_case = ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_VALUE;
        dim->dim_value = shape[d];
        dims[d] = dim;
    }
    sh->n_dim = (size_t)nd;
    sh->dim = dims;
    tt->has_elem_type = 1;
    tt->elem_type = kpl_onnx_dtype(kpl_ir_value_dtype(ir, v));
    tt->shape = sh;
    tp->value_case = ONNX__TYPE_PROTO__VALUE_TENSOR_TYPE;
    tp->tensor_type = tt;
    vi->name = (char *)name;
    vi->type = tp;
    return vi;
}

/* ---- the ops ---- */

/* A reduction over a's axes (all when none) into out. */
static const char *reduce(writer *w, const char *op, const char *x, const kpl_op_attrs *a,
                          const char *out)
{
    int64_t ax[KPL_MAX_DIMS];
    for (int i = 0; i < a->naxes; i++) ax[i] = a->axes[i];
    const char *o = out ? out : tmp_name(w);
    Onnx__NodeProto *n;
    if (!strcmp(op, "ReduceSum")) { /* opset 13: axes is an input */
        n = node(w, op, a->naxes ? 2 : 1, (const char *[]){x, a->naxes ? const_i64(w, ax, a->naxes) : NULL},
                 1, &o);
    } else {
        n = node(w, op, 1, &x, 1, &o);
        if (a->naxes) attr_ints(w, n, "axes", ax, a->naxes);
    }
    attr_i(w, n, "keepdims", a->keepdim);
    return o;
}

/* One node of the graph as the exporter sees it. */
typedef struct {
    int i; /* the node's index, for messages */
    kpl_op op;
    const kpl_op_info *info;
    const kpl_op_attrs *a;
    int in[KPL_IR_MAX_INPUTS], out[KPL_IR_MAX_OUTPUTS];
    int nin, nout;
    const char *x[KPL_IR_MAX_INPUTS]; /* the inputs' ONNX names */
    const char *y;                    /* output 0's */
    kpl_dtype dt;                     /* input 0's */
    int64_t xs[KPL_MAX_DIMS], ys[KPL_MAX_DIMS];
    int xnd, ynd;
} onode;

typedef kpl_status (*emit_fn)(writer *w, const onode *o);

/* op_table.h's (DIRECT, "Type"): one node of that type, its form by how
 * the op runs. */
static kpl_status emit_direct(writer *w, const onode *o)
{
    const char *t = o->info->onnx_name;
    switch (o->info->run) {
    case KPL_OP_RUN_UN:
    case KPL_OP_RUN_UNA: op1(w, t, o->x[0], o->y); break;
    case KPL_OP_RUN_BIN: op2(w, t, o->x[0], o->x[1], o->y); break;
    case KPL_OP_RUN_BINS: {
        const char *s = const_scalar(w, o->dt, o->a->scalar);
        if (o->a->scalar_first) op2(w, t, s, o->x[0], o->y);
        else op2(w, t, o->x[0], s, o->y);
        break;
    }
    case KPL_OP_RUN_RED: reduce(w, t, o->x[0], o->a, o->y); break;
    default: node(w, t, o->nin, o->x, 1, &o->y); break;
    }
    return w->st;
}

#define EMIT(f) static kpl_status emit_##f(writer *w, const onode *o)

EMIT(rsqrt)
{
    op1(w, "Reciprocal", op1(w, "Sqrt", o->x[0], NULL), o->y);
    return w->st;
}

EMIT(square)
{
    op2(w, "Mul", o->x[0], o->x[0], o->y);
    return w->st;
}

EMIT(leaky_relu)
{
    attr_f(w, node(w, "LeakyRelu", 1, o->x, 1, &o->y), "alpha", (float)o->a->alpha);
    return w->st;
}

EMIT(clip)
{
    node(w, "Clip", 3,
         (const char *[]){o->x[0], const_scalar(w, o->dt, o->a->alpha),
                          const_scalar(w, o->dt, o->a->beta)},
         1, &o->y);
    return w->st;
}

EMIT(gelu) /* x / 2 (1 + erf(x / sqrt 2)) */
{
    const char *x = o->x[0];
    kpl_dtype dt = o->dt;
    const char *e = op1(w, "Erf", op2(w, "Div", x, const_scalar(w, dt, 1.4142135623730951), NULL),
                        NULL);
    op2(w, "Mul", op2(w, "Mul", x, const_scalar(w, dt, 0.5), NULL),
        op2(w, "Add", e, const_scalar(w, dt, 1), NULL), o->y);
    return w->st;
}

EMIT(compare)
{
    static const char *const cmp[] = {[KPL_BIN_EQ] = "Equal", [KPL_BIN_NE] = "Equal",
                                      [KPL_BIN_LT] = "Less", [KPL_BIN_LE] = "LessOrEqual",
                                      [KPL_BIN_GT] = "Greater", [KPL_BIN_GE] = "GreaterOrEqual"};
    int sub = o->a->sub;
    const char *c = (unsigned)sub < sizeof cmp / sizeof *cmp ? cmp[sub] : NULL;
    if (!c) return KPL_ERROR(KPL_EINVAL, "onnx export: node %d: comparison %d", o->i, sub);
    if (sub == KPL_BIN_NE) op1(w, "Not", op2(w, c, o->x[0], o->x[1], NULL), o->y);
    else op2(w, c, o->x[0], o->x[1], o->y);
    return w->st;
}

EMIT(var) /* sum((x - mean)^2) / (count - correction) */
{
    const kpl_op_attrs *a = o->a;
    kpl_op_attrs k = *a;
    k.keepdim = true;
    const char *m = reduce(w, "ReduceMean", o->x[0], &k, NULL);
    const char *d = op2(w, "Sub", o->x[0], m, NULL);
    k.keepdim = a->keepdim;
    const char *s = reduce(w, "ReduceSum", op2(w, "Mul", d, d, NULL), &k, NULL);
    int64_t cnt = 1;
    for (int d2 = 0; d2 < o->xnd; d2++) {
        bool red = a->naxes == 0;
        for (int j = 0; j < a->naxes; j++) red |= (a->axes[j] + o->xnd) % o->xnd == d2;
        if (red) cnt *= o->xs[d2];
    }
    op2(w, "Div", s, const_scalar(w, o->dt, (double)(cnt - a->correction)), o->y);
    return w->st;
}

EMIT(argreduce)
{
    if (o->a->naxes != 1)
        return KPL_ERROR(KPL_EINVAL, "onnx export: node %d: %s over all axes (a flat index) has "
                         "no ONNX form in kpl", o->i, o->info->name);
    Onnx__NodeProto *n = node(w, o->op == KPL_OP_ARGMAX ? "ArgMax" : "ArgMin", 1, o->x, 1, &o->y);
    attr_i(w, n, "axis", o->a->axes[0]);
    attr_i(w, n, "keepdims", o->a->keepdim);
    return w->st;
}

EMIT(matmul)
{
    int64_t bs[KPL_MAX_DIMS];
    int bnd = kpl_ir_value_shape(w->ir, o->in[1], bs);
    if (o->xnd == 2 && bnd == 2) {
        Onnx__NodeProto *n = node(w, "Gemm", 2, o->x, 1, &o->y);
        if (o->a->trans_a) attr_i(w, n, "transA", 1);
        if (o->a->trans_b) attr_i(w, n, "transB", 1);
        return w->st;
    }
    const char *m[2] = {o->x[0], o->x[1]};
    int nds[2] = {o->xnd, bnd};
    bool tr[2] = {o->a->trans_a, o->a->trans_b};
    for (int k = 0; k < 2; k++) {
        if (!tr[k] || nds[k] < 2) continue; /* a vector's transpose is itself */
        int64_t perm[KPL_MAX_DIMS];
        for (int d = 0; d < nds[k]; d++) perm[d] = d;
        perm[nds[k] - 1] = nds[k] - 2, perm[nds[k] - 2] = nds[k] - 1;
        const char *t = tmp_name(w);
        attr_ints(w, node(w, "Transpose", 1, &m[k], 1, &t), "perm", perm, nds[k]);
        m[k] = t;
    }
    op2(w, "MatMul", m[0], m[1], o->y);
    return w->st;
}

EMIT(cast)
{
    attr_i(w, node(w, "Cast", 1, o->x, 1, &o->y), "to",
           kpl_onnx_dtype(kpl_ir_value_dtype(w->ir, o->out[0])));
    return w->st;
}

EMIT(reshape)
{
    op2(w, "Reshape", o->x[0], const_i64(w, o->ys, o->ynd), o->y);
    return w->st;
}

EMIT(expand)
{
    op2(w, "Expand", o->x[0], const_i64(w, o->ys, o->ynd), o->y);
    return w->st;
}

EMIT(permute)
{
    int64_t perm[KPL_MAX_DIMS];
    for (int d = 0; d < o->a->naxes; d++) perm[d] = o->a->axes[d];
    attr_ints(w, node(w, "Transpose", 1, o->x, 1, &o->y), "perm", perm, o->a->naxes);
    return w->st;
}

EMIT(narrow)
{
    int64_t s = o->a->start, e = o->a->start + o->a->length, ax = 0;
    node(w, "Slice", 4,
         (const char *[]){o->x[0], const_i64(w, &s, 1), const_i64(w, &e, 1), const_i64(w, &ax, 1)},
         1, &o->y);
    return w->st;
}

EMIT(pad_rows)
{
    int64_t pads[2 * KPL_MAX_DIMS] = {0};
    pads[0] = o->a->start;
    pads[o->xnd] = o->a->length - o->a->start - o->xs[0];
    node(w, "Pad", 2, (const char *[]){o->x[0], const_i64(w, pads, 2 * o->xnd)}, 1, &o->y);
    return w->st;
}

/* conv2d; conv2d_relu: Conv then Relu; conv2d_add(_relu) (x, w, r, b):
 * Conv on x, w, b, then Add r (then Relu) */
EMIT(conv2d)
{
    int64_t ws[4];
    kpl_ir_value_shape(w->ir, o->in[1], ws);
    bool add = o->op == KPL_OP_CONV2D_ADD || o->op == KPL_OP_CONV2D_ADD_RELU;
    bool relu = o->op == KPL_OP_CONV2D_RELU || o->op == KPL_OP_CONV2D_ADD_RELU;
    const char *co = o->op == KPL_OP_CONV2D ? o->y : tmp_name(w);
    const char *cin[3] = {o->x[0], o->x[1], add && o->nin > 3 ? o->x[3] : o->x[2]};
    int ncin = add ? o->nin - 1 : o->nin;
    Onnx__NodeProto *n = node(w, "Conv", ncin, cin, 1, &co);
    const kpl_conv2d_params *c = &o->a->conv;
    attr_ints(w, n, "kernel_shape", (int64_t[]){ws[2], ws[3]}, 2);
    attr_ints(w, n, "strides", (int64_t[]){c->stride[0], c->stride[1]}, 2);
    attr_ints(w, n, "pads", (int64_t[]){c->padding[0], c->padding[1], c->padding[0], c->padding[1]},
              4);
    attr_ints(w, n, "dilations", (int64_t[]){c->dilation[0], c->dilation[1]}, 2);
    attr_i(w, n, "group", c->groups);
    if (add) {
        const char *so = relu ? tmp_name(w) : o->y;
        node(w, "Add", 2, (const char *[]){co, o->x[2]}, 1, &so);
        co = so;
    }
    if (relu) op1(w, "Relu", co, o->y);
    return w->st;
}

/* conv2d_bwd_data (x, w) -> y: the transposed convolution (a U-Net's
 * upsampling), ONNX's ConvTranspose on the same weights, (C_in, C_out /
 * groups, KH, KW); output_padding makes the output the graph's size. */
EMIT(conv2d_bwd_data)
{
    int64_t ws[4];
    kpl_ir_value_shape(w->ir, o->in[1], ws);
    const kpl_conv2d_params *c = &o->a->conv;
    int64_t op[2];
    for (int d = 0; d < 2; d++)
        op[d] = o->ys[2 + d] - ((o->xs[2 + d] - 1) * c->stride[d] + (ws[2 + d] - 1) * c->dilation[d] +
                                1 - 2 * c->padding[d]);
    Onnx__NodeProto *n = node(w, "ConvTranspose", 2, o->x, 1, &o->y);
    attr_ints(w, n, "kernel_shape", (int64_t[]){ws[2], ws[3]}, 2);
    attr_ints(w, n, "strides", (int64_t[]){c->stride[0], c->stride[1]}, 2);
    attr_ints(w, n, "pads", (int64_t[]){c->padding[0], c->padding[1], c->padding[0], c->padding[1]},
              4);
    attr_ints(w, n, "dilations", (int64_t[]){c->dilation[0], c->dilation[1]}, 2);
    attr_ints(w, n, "output_padding", op, 2);
    attr_i(w, n, "group", c->groups);
    return w->st;
}

EMIT(pool2d) /* max_pool2d, avg_pool2d */
{
    const kpl_pool2d_params *p = &o->a->pool;
    bool avg = o->op == KPL_OP_AVG_POOL2D;
    /* ceil_mode: kpl (as PyTorch) drops a last window that would start in
     * the end padding, which opset 13's formula keeps; so the rounding up
     * is written as explicit end padding that the floor formula turns into
     * kpl's output size */
    int64_t end[2] = {p->padding[0], p->padding[1]};
    for (int d = 0; p->ceil_mode && d < 2; d++) {
        end[d] = (o->ys[2 + d] - 1) * p->stride[d] + p->kernel[d] - o->xs[2 + d] - p->padding[d];
        if (end[d] < p->padding[d]) end[d] = p->padding[d];
        if (avg && p->count_include_pad && end[d] > p->padding[d])
            return KPL_ERROR(KPL_EINVAL, "onnx export: node %d: avg_pool2d with ceil_mode and "
                             "count_include_pad over a partial last window has no ONNX form in "
                             "kpl", o->i);
    }
    Onnx__NodeProto *n = node(w, avg ? "AveragePool" : "MaxPool", 1, o->x, 1, &o->y);
    attr_ints(w, n, "kernel_shape", (int64_t[]){p->kernel[0], p->kernel[1]}, 2);
    attr_ints(w, n, "strides", (int64_t[]){p->stride[0], p->stride[1]}, 2);
    attr_ints(w, n, "pads", (int64_t[]){p->padding[0], p->padding[1], end[0], end[1]}, 4);
    if (avg) attr_i(w, n, "count_include_pad", p->count_include_pad);
    return w->st;
}

EMIT(index_select)
{
    attr_i(w, node(w, "Gather", 2, o->x, 1, &o->y), "axis", o->a->axes[0]);
    return w->st;
}

EMIT(concat)
{
    attr_i(w, node(w, "Concat", o->nin, o->x, 1, &o->y), "axis", o->a->axes[0]);
    return w->st;
}

/* upsample_bilinear: Resize to the output's sizes, F.interpolate's
 * coordinates (align_corners, or half_pixel: (i + 1/2) in / out - 1/2,
 * which Resize's linear mode clamps to the plane as kpl does). */
EMIT(resize)
{
    Onnx__NodeProto *n = node(w, "Resize", 4,
                              (const char *[]){o->x[0], NULL, NULL, const_i64(w, o->ys, o->ynd)},
                              1, &o->y);
    attr_s(w, n, "mode", "linear");
    attr_s(w, n, "coordinate_transformation_mode",
           o->a->align_corners ? "align_corners" : "half_pixel");
    return w->st;
}

EMIT(gather)
{
    attr_i(w, node(w, "GatherElements", 2, o->x, 1, &o->y), "axis", o->a->axes[0]);
    return w->st;
}

/* op_table.h's onnx column: (DIRECT, t) emit_direct, (CODED, f) emit_f,
 * (NONE, -) no form. */
#define EMIT_DIRECT(t) emit_direct
#define EMIT_CODED(f) emit_##f
#define EMIT_NONE(x) NULL
static const emit_fn emitters[KPL_OP_COUNT] = {
#define KPL_X_(e, s, ar, at, ac, sv, run, inf, gr, ox) [KPL_OP_##e] = KPL_OP_PAIR(EMIT_, ox),
    KPL_OP_LIST(KPL_X_)
#undef KPL_X_
};

static kpl_status emit_node(writer *w, int i)
{
    const kpl_ir *ir = w->ir;
    onode o = {.i = i, .op = kpl_ir_node_op(ir, i), .a = kpl_ir_node_attrs(ir, i)};
    o.info = kpl_op_info_of(o.op);
    emit_fn emit = emitters[o.op];
    if (!emit)
        return KPL_ERROR(KPL_EINVAL, "onnx export: node %d: op '%s' has no ONNX form in kpl", i,
                         o.info->name);
    o.nin = kpl_ir_node_inputs(ir, i, o.in);
    o.nout = kpl_ir_node_outputs(ir, i, o.out);
    for (int k = 0; k < o.nin; k++) o.x[k] = o.in[k] >= 0 ? w->vname[o.in[k]] : NULL;
    o.y = w->vname[o.out[0]];
    o.dt = o.nin ? kpl_ir_value_dtype(ir, o.in[0]) : KPL_F32;
    o.xnd = o.nin && o.in[0] >= 0 ? kpl_ir_value_shape(ir, o.in[0], o.xs) : 0;
    o.ynd = kpl_ir_value_shape(ir, o.out[0], o.ys);
    return emit(w, &o);
}

/* Which values are read by some node or are outputs. */
static bool read_later(const kpl_ir *ir, int v)
{
    for (int i = 0; i < kpl_ir_num_outputs(ir); i++)
        if (kpl_ir_output(ir, i) == v) return true;
    for (int i = 0; i < kpl_ir_num_nodes(ir); i++) {
        int in[KPL_IR_MAX_INPUTS];
        int n = kpl_ir_node_inputs(ir, i, in);
        for (int k = 0; k < n; k++)
            if (in[k] == v) return true;
    }
    return false;
}

kpl_status kpl_onnx_export(const kpl_ir *ir, const char *path)
{
    KPL_CHECK(ir && path, KPL_EINVAL, "onnx export: NULL argument");
    KPL_CHECK(!kpl_ir_num_updates(ir), KPL_EINVAL,
              "%s: the graph updates %d parameters (a traced training step); only inference "
              "graphs are saved",
              "onnx export", kpl_ir_num_updates(ir));
    writer w = {.ir = ir};
    int nv = kpl_ir_num_values(ir);
    w.vname = calloc((size_t)(nv ? nv : 1), sizeof *w.vname);
    KPL_CHECK(w.vname, KPL_ENOMEM, "onnx export: no host memory");
    Onnx__GraphProto g = ONNX__GRAPH_PROTO__INIT;
    Onnx__ModelProto m = ONNX__MODEL_PROTO__INIT;
    Onnx__OperatorSetIdProto opset = ONNX__OPERATOR_SET_ID_PROTO__INIT;
    Onnx__OperatorSetIdProto *opsets[1] = {&opset};
    uint8_t *buf = NULL;
    kpl_status st = KPL_OK;
    /* names: placeholders and parameters keep theirs, outputs take theirs */
    for (int v = 0; v < nv; v++) {
        const char *name = kpl_ir_value_name(ir, v);
        kpl_irv_kind k = kpl_ir_value_kind(ir, v);
        w.vname[v] = name && (k == KPL_IRV_INPUT || k == KPL_IRV_PARAM) ? w_str(&w, "%s", name)
                                                                        : w_str(&w, "_v%d", v);
    }
    for (int i = 0; i < kpl_ir_num_outputs(ir); i++)
        w.vname[kpl_ir_output(ir, i)] = w_str(&w, "%s", kpl_ir_output_name(ir, i));
    for (int v = 0; v < nv && w.st == KPL_OK; v++) {
        kpl_irv_kind k = kpl_ir_value_kind(ir, v);
        if (k != KPL_IRV_PARAM && k != KPL_IRV_CONST) continue;
        kpl_tensor *t = kpl_ir_value_data(ir, v);
        if (kpl_device_type_of(kpl_tensor_device(t)) != KPL_DEVICE_CPU) {
            st = KPL_ERROR(KPL_EDEVICE, "onnx export: the parameters must be on the CPU");
            goto out;
        }
        const void *p = kpl_tensor_host_data(t);
        if (!p) {
            st = kpl_last_status();
            goto out;
        }
        initializer(&w, w.vname[v], kpl_tensor_dtype(t), kpl_tensor_ndim(t), kpl_tensor_shape(t), p,
                    kpl_tensor_nbytes(t), true);
    }
    /* max pooling's indices have no ONNX output here: nothing may read them */
    for (int i = 0; i < kpl_ir_num_nodes(ir) && w.st == KPL_OK; i++) {
        int out[KPL_IR_MAX_OUTPUTS];
        if (kpl_ir_node_op(ir, i) == KPL_OP_MAX_POOL2D && kpl_ir_node_outputs(ir, i, out) > 1 &&
            read_later(ir, out[1])) {
            st = KPL_ERROR(KPL_EINVAL, "onnx export: node %d: max_pool2d's indices are used", i);
            goto out;
        }
        if ((st = emit_node(&w, i)) < 0) goto out;
    }
    if ((st = w.st) < 0) goto out;
    int ni = kpl_ir_num_inputs(ir), no = kpl_ir_num_outputs(ir);
    Onnx__ValueInfoProto **gin = w_alloc(&w, sizeof *gin * (size_t)(ni ? ni : 1));
    Onnx__ValueInfoProto **gout = w_alloc(&w, sizeof *gout * (size_t)no);
    for (int i = 0; gin && i < ni; i++) gin[i] = value_info(&w, kpl_ir_input(ir, i), w.vname[kpl_ir_input(ir, i)]);
    for (int i = 0; gout && i < no; i++)
        gout[i] = value_info(&w, kpl_ir_output(ir, i), w.vname[kpl_ir_output(ir, i)]);
    if ((st = w.st) < 0) goto out;
    g.n_node = w.nnode;
    g.node = w.node;
    g.name = "kpl";
    g.n_initializer = w.ninit;
    g.initializer = w.init;
    g.n_input = (size_t)ni;
    g.input = gin;
    g.n_output = (size_t)no;
    g.output = gout;
    opset.domain = "";
    opset.has_version = 1;
    opset.version = ONNX_OPSET;
    m.has_ir_version = 1;
    m.ir_version = ONNX_IR_VERSION;
    m.producer_name = "kpl";
    m.producer_version = (char *)kpl_version();
    m.graph = &g;
    m.n_opset_import = 1;
    m.opset_import = opsets;
    size_t len = onnx__model_proto__get_packed_size(&m);
    buf = malloc(len ? len : 1);
    if (!buf) {
        st = KPL_ERROR(KPL_ENOMEM, "onnx export: no host memory for %zu bytes", len);
        goto out;
    }
    onnx__model_proto__pack(&m, buf);
    st = kpl__write_file_atomic(path, buf, len);
out:
    free(buf);
    for (size_t i = 0; i < w.nmem; i++) free(w.mem[i]);
    free(w.mem);
    free(w.node);
    free(w.init);
    free(w.vname);
    return st;
}
