/*
 * ir.c — GraphIR: building, reading, checking and printing a graph.
 */
#include "graph_impl.h"
#include "ir_impl.h"

#include <stdlib.h>
#include <string.h>

kpl_status kpl_ir_create(kpl_ir **out)
{
    KPL_CHECK(out, KPL_EINVAL, "ir_create: NULL");
    *out = calloc(1, sizeof **out);
    KPL_CHECK(*out, KPL_ENOMEM, "ir_create: no host memory");
    return KPL_OK;
}

void kpl_ir_destroy(kpl_ir *ir)
{
    if (!ir) return;
    for (int i = 0; i < ir->nv; i++) {
        free(ir->v[i].name);
        kpl_tensor_release(ir->v[i].data);
    }
    for (int i = 0; i < ir->noutputs; i++) free(ir->out_names[i]);
    free(ir->v);
    free(ir->n);
    free(ir->inputs);
    free(ir->outputs);
    free(ir->out_names);
    free(ir->upd_param);
    free(ir->upd_value);
    free(ir);
}

int kpl_ir_num_updates(const kpl_ir *ir) { return ir->nupdates; }

void kpl_ir_update(const kpl_ir *ir, int i, int *param, int *value)
{
    if (param) *param = ir->upd_param[i];
    if (value) *value = ir->upd_value[i];
}

kpl_status kpl_ir_add_update(kpl_ir *ir, int param, int value)
{
    KPL_CHECK(param >= 0 && param < ir->nv && value >= 0 && value < ir->nv, KPL_EINVAL,
              "ir: update of %%%d by %%%d (of %d values)", param, value, ir->nv);
    for (int i = 0; i < ir->nupdates; i++)
        if (ir->upd_param[i] == param) {
            ir->upd_value[i] = value;
            return KPL_OK;
        }
    int *np = realloc(ir->upd_param, (size_t)(ir->nupdates + 1) * sizeof *np);
    if (np) ir->upd_param = np;
    int *nv = np ? realloc(ir->upd_value, (size_t)(ir->nupdates + 1) * sizeof *nv) : NULL;
    KPL_CHECK(np && nv, KPL_ENOMEM, "ir: no host memory");
    ir->upd_value = nv;
    ir->upd_param[ir->nupdates] = param;
    ir->upd_value[ir->nupdates++] = value;
    return KPL_OK;
}

int kpl_ir_add_value(kpl_ir *ir, kpl_irv_kind kind, kpl_dtype dt, int ndim, const int64_t *shape,
                     const char *name, kpl_tensor *data)
{
    if (ndim < 0 || ndim > KPL_MAX_DIMS) {
        KPL_ERROR(KPL_EINVAL, "ir: a value of %d dims", ndim);
        return -1;
    }
    if (ir->nv == ir->cap_v) {
        int ncap = ir->cap_v ? ir->cap_v * 2 : 64;
        kpl_irv *nv = realloc(ir->v, (size_t)ncap * sizeof *nv);
        if (!nv) {
            KPL_ERROR(KPL_ENOMEM, "ir: no host memory");
            return -1;
        }
        ir->v = nv;
        ir->cap_v = ncap;
    }
    kpl_irv *v = &ir->v[ir->nv];
    memset(v, 0, sizeof *v);
    v->kind = kind;
    v->dtype = dt;
    v->ndim = ndim;
    if (ndim) memcpy(v->shape, shape, (size_t)ndim * sizeof *shape);
    v->node = -1;
    if (name && !(v->name = strdup(name))) {
        KPL_ERROR(KPL_ENOMEM, "ir: no host memory");
        return -1;
    }
    kpl_tensor_retain(data);
    v->data = data;
    return ir->nv++;
}

int kpl_ir_add_node(kpl_ir *ir, kpl_op op, const kpl_op_attrs *at, int nin, const int *in,
                    int nout, const int *out)
{
    if ((unsigned)op >= KPL_OP_COUNT || nin < 0 || nin > KPL_IR_MAX_IN || nout < 1 ||
        nout > KPL_IR_MAX_OUT) {
        KPL_ERROR(KPL_EINVAL, "ir: node %d: op %d with %d inputs and %d outputs", ir->nn, (int)op,
                  nin, nout);
        return -1;
    }
    for (int i = 0; i < nin; i++)
        if (in[i] < -1 || in[i] >= ir->nv) {
            KPL_ERROR(KPL_EINVAL, "ir: node %d (%s): input %d is value %d of %d", ir->nn,
                      kpl_op_name(op), i, in[i], ir->nv);
            return -1;
        }
    for (int i = 0; i < nout; i++)
        if (out[i] < 0 || out[i] >= ir->nv || ir->v[out[i]].kind != KPL_IRV_OP ||
            ir->v[out[i]].node >= 0) {
            KPL_ERROR(KPL_EINVAL,
                      "ir: node %d (%s): output %d (value %d) is not an op value written once",
                      ir->nn, kpl_op_name(op), i, out[i]);
            return -1;
        }
    if (ir->nn == ir->cap_n) {
        int ncap = ir->cap_n ? ir->cap_n * 2 : 64;
        kpl_irn *nn = realloc(ir->n, (size_t)ncap * sizeof *nn);
        if (!nn) {
            KPL_ERROR(KPL_ENOMEM, "ir: no host memory");
            return -1;
        }
        ir->n = nn;
        ir->cap_n = ncap;
    }
    kpl_irn *n = &ir->n[ir->nn];
    memset(n, 0, sizeof *n);
    n->op = op;
    if (at) n->at = *at;
    n->at.custom = NULL;
    n->at.custom_user = NULL;
    n->nin = nin;
    n->nout = nout;
    for (int i = 0; i < KPL_IR_MAX_IN; i++) n->in[i] = i < nin ? in[i] : -1;
    for (int i = 0; i < nout; i++) {
        n->out[i] = out[i];
        ir->v[out[i]].node = ir->nn;
    }
    return ir->nn++;
}

kpl_status kpl_ir_set_io(kpl_ir *ir, int nin, const int *inputs, int nout, const int *outputs,
                         const char *const *out_names)
{
    if (inputs) {
        int *ni = malloc((size_t)(nin ? nin : 1) * sizeof *ni);
        KPL_CHECK(ni, KPL_ENOMEM, "ir: no host memory");
        for (int i = 0; i < nin; i++) {
            if (inputs[i] < 0 || inputs[i] >= ir->nv || ir->v[inputs[i]].kind != KPL_IRV_INPUT) {
                free(ni);
                return KPL_ERROR(KPL_EINVAL, "ir: input %d (value %d) is not a placeholder", i,
                                 inputs[i]);
            }
            ni[i] = inputs[i];
        }
        free(ir->inputs);
        ir->inputs = ni;
        ir->ninputs = nin;
    }
    KPL_CHECK(nout >= 1 && nout <= 4096, KPL_EINVAL, "ir: %d outputs", nout);
    for (int i = 0; i < nout; i++)
        KPL_CHECK(outputs[i] >= 0 && outputs[i] < ir->nv, KPL_EINVAL,
                  "ir: output %d is value %d of %d", i, outputs[i], ir->nv);
    int *no = malloc((size_t)nout * sizeof *no);
    char **nn = calloc((size_t)nout, sizeof *nn);
    if (!no || !nn) {
        free(no);
        free(nn);
        return KPL_ERROR(KPL_ENOMEM, "ir: no host memory");
    }
    kpl_status st = KPL_OK;
    for (int i = 0; i < nout; i++) {
        no[i] = outputs[i];
        char def[32];
        snprintf(def, sizeof def, "output%d", i);
        const char *name = out_names && out_names[i] ? out_names[i] : def;
        if (!(nn[i] = strdup(name))) st = KPL_ERROR(KPL_ENOMEM, "ir: no host memory");
    }
    if (st < 0) {
        for (int i = 0; i < nout; i++) free(nn[i]);
        free(no);
        free(nn);
        return st;
    }
    for (int i = 0; i < ir->noutputs; i++) free(ir->out_names[i]);
    free(ir->outputs);
    free(ir->out_names);
    ir->outputs = no;
    ir->out_names = nn;
    ir->noutputs = nout;
    return KPL_OK;
}

int kpl_ir_num_values(const kpl_ir *ir) { return ir->nv; }
int kpl_ir_num_nodes(const kpl_ir *ir) { return ir->nn; }
int kpl_ir_num_inputs(const kpl_ir *ir) { return ir->ninputs; }
int kpl_ir_num_outputs(const kpl_ir *ir) { return ir->noutputs; }
int kpl_ir_input(const kpl_ir *ir, int i) { return ir->inputs[i]; }
int kpl_ir_output(const kpl_ir *ir, int i) { return ir->outputs[i]; }
const char *kpl_ir_output_name(const kpl_ir *ir, int i) { return ir->out_names[i]; }
kpl_irv_kind kpl_ir_value_kind(const kpl_ir *ir, int v) { return ir->v[v].kind; }
const char *kpl_ir_value_name(const kpl_ir *ir, int v) { return ir->v[v].name; }
kpl_dtype kpl_ir_value_dtype(const kpl_ir *ir, int v) { return ir->v[v].dtype; }
kpl_tensor *kpl_ir_value_data(const kpl_ir *ir, int v) { return ir->v[v].data; }
int kpl_ir_level(const kpl_ir *ir) { return ir->level; }
void kpl_ir_set_level(kpl_ir *ir, int level) { ir->level = level; }

int kpl_ir_value_shape(const kpl_ir *ir, int v, int64_t *shape)
{
    if (shape) memcpy(shape, ir->v[v].shape, (size_t)ir->v[v].ndim * sizeof *shape);
    return ir->v[v].ndim;
}

kpl_op kpl_ir_node_op(const kpl_ir *ir, int n) { return ir->n[n].op; }
const kpl_op_attrs *kpl_ir_node_attrs(const kpl_ir *ir, int n) { return &ir->n[n].at; }

int kpl_ir_node_inputs(const kpl_ir *ir, int n, int *ids)
{
    if (ids) memcpy(ids, ir->n[n].in, (size_t)ir->n[n].nin * sizeof *ids);
    return ir->n[n].nin;
}

int kpl_ir_node_outputs(const kpl_ir *ir, int n, int *ids)
{
    if (ids) memcpy(ids, ir->n[n].out, (size_t)ir->n[n].nout * sizeof *ids);
    return ir->n[n].nout;
}

static bool same_bytes(kpl_tensor *a, kpl_tensor *b)
{
    if (a == b) return true;
    if (!kpl_tensor_shares_storage(a, b) || kpl_tensor_offset(a) != kpl_tensor_offset(b) ||
        kpl_tensor_ndim(a) != kpl_tensor_ndim(b) || kpl_tensor_dtype(a) != kpl_tensor_dtype(b))
        return false;
    return !memcmp(kpl_tensor_shape(a), kpl_tensor_shape(b),
                   (size_t)kpl_tensor_ndim(a) * sizeof(int64_t));
}

int kpl_ir_name_params(kpl_ir *ir, int n, const char *const *names, kpl_tensor *const *tensors)
{
    int named = 0;
    for (int v = 0; v < ir->nv; v++) {
        kpl_irv *val = &ir->v[v];
        if (val->kind != KPL_IRV_PARAM) continue;
        for (int i = 0; i < n; i++) {
            if (!tensors[i] || !names[i] || !same_bytes(val->data, tensors[i])) continue;
            char *s = strdup(names[i]);
            if (!s) break;
            free(val->name);
            val->name = s;
            named++;
            break;
        }
    }
    return named;
}

/* ---- checking ---- */

kpl_status kpl_ir_check(const kpl_ir *ir)
{
    /* every value defined once, before its first use */
    char *defined = calloc((size_t)(ir->nv ? ir->nv : 1), 1);
    KPL_CHECK(defined, KPL_ENOMEM, "ir_check: no host memory");
    kpl_status st = KPL_OK;
    char b1[96], b2[96];
    for (int i = 0; i < ir->ninputs; i++) /* each placeholder listed once */
        defined[ir->inputs[i]]++;
    for (int v = 0; v < ir->nv; v++) {
        const kpl_irv *val = &ir->v[v];
        if ((val->kind == KPL_IRV_INPUT) != (defined[v] == 1)) {
            st = KPL_ERROR(KPL_EINVAL, "ir_check: %%%d is %s", v,
                           val->kind == KPL_IRV_INPUT
                               ? (defined[v] ? "listed as an input twice" : "a placeholder not listed as an input")
                               : "listed as an input but is no placeholder");
            goto out;
        }
        defined[v] = val->kind != KPL_IRV_OP;
        if ((val->kind == KPL_IRV_PARAM || val->kind == KPL_IRV_CONST) && !val->data) {
            st = KPL_ERROR(KPL_EINVAL, "ir_check: %s %%%d has no data",
                           val->kind == KPL_IRV_PARAM ? "parameter" : "constant", v);
            goto out;
        }
    }
    for (int i = 0; i < ir->nn && st == KPL_OK; i++) {
        const kpl_irn *n = &ir->n[i];
        for (int j = 0; j < n->nin; j++)
            if (n->in[j] >= 0 && !defined[n->in[j]]) {
                st = KPL_ERROR(KPL_EINVAL, "ir_check: node %d (%s) reads %%%d before it is written",
                               i, kpl_op_name(n->op), n->in[j]);
                goto out;
            }
        int nd[KPL_IR_MAX_OUT];
        int64_t sh[KPL_IR_MAX_OUT][KPL_MAX_DIMS];
        kpl_dtype dt[KPL_IR_MAX_OUT];
        if ((st = kpl__ir_infer(ir, n, nd, sh, dt)) < 0) {
            kpl_error_prefix(st, "ir_check: node %d: ", i);
            goto out;
        }
        for (int j = 0; j < n->nout; j++) {
            const kpl_irv *o = &ir->v[n->out[j]];
            if (defined[n->out[j]]) {
                st = KPL_ERROR(KPL_EINVAL, "ir_check: %%%d is written twice (node %d, %s)",
                               n->out[j], i, kpl_op_name(n->op));
                goto out;
            }
            defined[n->out[j]] = 1;
            bool same = nd[j] == o->ndim && dt[j] == o->dtype &&
                        !memcmp(sh[j], o->shape, (size_t)o->ndim * sizeof(int64_t));
            if (!same) {
                st = KPL_ERROR(KPL_ESHAPE,
                               "ir_check: node %d (%s) makes %s %s for output %d, the graph says "
                               "%%%d is %s %s",
                               i, kpl_op_name(n->op), kpl_dtype_name(dt[j]),
                               kpl_shape_str(nd[j], sh[j], b1, sizeof b1), j, n->out[j],
                               kpl_dtype_name(o->dtype), kpl_shape_str(o->ndim, o->shape, b2, sizeof b2));
                goto out;
            }
        }
    }
    for (int i = 0; i < ir->noutputs && st == KPL_OK; i++)
        if (!defined[ir->outputs[i]])
            st = KPL_ERROR(KPL_EINVAL, "ir_check: output %d (%%%d) is never written", i,
                           ir->outputs[i]);
    for (int i = 0; i < ir->nupdates && st == KPL_OK; i++) {
        int p = ir->upd_param[i], v = ir->upd_value[i];
        const kpl_irv *pv = &ir->v[p], *vv = &ir->v[v];
        bool twice = false;
        for (int j = 0; j < i; j++) twice |= ir->upd_param[j] == p;
        if (pv->kind != KPL_IRV_PARAM || vv->kind != KPL_IRV_OP || !defined[v] || twice ||
            pv->dtype != vv->dtype || pv->ndim != vv->ndim ||
            memcmp(pv->shape, vv->shape, (size_t)pv->ndim * sizeof(int64_t)))
            st = KPL_ERROR(KPL_EINVAL,
                           "ir_check: update %d writes %%%d (%s %s) into %%%d (%s %s): it must "
                           "be an op's result written into a parameter of its shape and dtype, "
                           "once",
                           i, v, kpl_dtype_name(vv->dtype),
                           kpl_shape_str(vv->ndim, vv->shape, b1, sizeof b1), p,
                           kpl_dtype_name(pv->dtype),
                           kpl_shape_str(pv->ndim, pv->shape, b2, sizeof b2));
    }
out:
    free(defined);
    return st;
}

/* ---- printing ---- */

static void attrs_str(const kpl_irn *n, char *buf, size_t len)
{
    const kpl_op_attrs *a = &n->at;
    buf[0] = 0;
    switch (kpl_op_info_of(n->op)->attrs) {
    case KPL_ATTRS_CONV:
        snprintf(buf, len, " stride=%d,%d pad=%d,%d dil=%d,%d groups=%d", a->conv.stride[0],
                 a->conv.stride[1], a->conv.padding[0], a->conv.padding[1], a->conv.dilation[0],
                 a->conv.dilation[1], a->conv.groups);
        break;
    case KPL_ATTRS_POOL:
        snprintf(buf, len, " kernel=%d,%d stride=%d,%d pad=%d,%d%s%s", a->pool.kernel[0],
                 a->pool.kernel[1], a->pool.stride[0], a->pool.stride[1], a->pool.padding[0],
                 a->pool.padding[1], a->pool.ceil_mode ? " ceil" : "",
                 a->pool.count_include_pad ? " count_pad" : "");
        break;
    case KPL_ATTRS_REDUCE:
    case KPL_ATTRS_PERM: {
        size_t k = (size_t)snprintf(buf, len, " axes=");
        for (int i = 0; i < a->naxes && k < len; i++)
            k += (size_t)snprintf(buf + k, len - k, "%s%d", i ? "," : "", a->axes[i]);
        if (a->keepdim && k < len) snprintf(buf + k, len - k, " keepdim");
        break;
    }
    case KPL_ATTRS_MATMUL:
        snprintf(buf, len, "%s%s", a->trans_a ? " trans_a" : "", a->trans_b ? " trans_b" : "");
        break;
    case KPL_ATTRS_SLOPE: snprintf(buf, len, " slope=%g", a->alpha); break;
    case KPL_ATTRS_BOUNDS: snprintf(buf, len, " lo=%g hi=%g", a->alpha, a->beta); break;
    case KPL_ATTRS_ROWS:
        if (n->op == KPL_OP_NARROW)
            snprintf(buf, len, " start=%lld length=%lld", (long long)a->start, (long long)a->length);
        break;
    case KPL_ATTRS_SUB: snprintf(buf, len, " %s", kpl_binary_name((kpl_binary_op)a->sub)); break;
    case KPL_ATTRS_RESIZE:
        snprintf(buf, len, " size=%lld,%lld%s", (long long)a->shape4[2], (long long)a->shape4[3],
                 a->align_corners ? " align_corners" : "");
        break;
    case KPL_ATTRS_GROUPS:
        snprintf(buf, len, " groups=%lld eps=%g", (long long)a->start, a->alpha);
        break;
    case KPL_ATTRS_FOCAL: snprintf(buf, len, " alpha=%g gamma=%g", a->alpha, a->beta); break;
    case KPL_ATTRS_XENT:
        snprintf(buf, len, " ignore_index=%lld smoothing=%g", (long long)a->start, a->alpha);
        break;
    case KPL_ATTRS_EPS:
        snprintf(buf, len, " eps=%g%s", a->alpha, n->op == KPL_OP_BATCH_NORM_BWD && a->sub ? " relu" : "");
        break;
    case KPL_ATTRS_SCALAR: snprintf(buf, len, " s=%g%s", a->scalar, a->scalar_first ? " first" : ""); break;
    default: break;
    }
}

static void value_str(const kpl_ir *ir, int v, char *buf, size_t len)
{
    if (v < 0) {
        snprintf(buf, len, "-");
        return;
    }
    const kpl_irv *val = &ir->v[v];
    if (val->name) snprintf(buf, len, "%%%d:%s", v, val->name);
    else snprintf(buf, len, "%%%d", v);
}

kpl_status kpl_ir_dump(const kpl_ir *ir, FILE *f, bool dot)
{
    char b[96], a[160], s1[160];
    static const char *const kinds[] = {"input", "param", "const", "op"};
    if (dot) {
        fprintf(f, "digraph kpl {\n  rankdir=TB;\n  node [fontname=\"monospace\", fontsize=10];\n");
        for (int v = 0; v < ir->nv; v++) {
            const kpl_irv *val = &ir->v[v];
            if (val->kind == KPL_IRV_OP) continue;
            value_str(ir, v, s1, sizeof s1);
            fprintf(f, "  v%d [shape=%s, label=\"%s\\n%s %s\"];\n", v,
                    val->kind == KPL_IRV_INPUT ? "invhouse" : "note", s1,
                    kpl_dtype_name(val->dtype), kpl_shape_str(val->ndim, val->shape, b, sizeof b));
        }
        for (int i = 0; i < ir->nn; i++) {
            const kpl_irn *n = &ir->n[i];
            attrs_str(n, a, sizeof a);
            const kpl_irv *o = &ir->v[n->out[0]];
            fprintf(f, "  n%d [shape=box, label=\"%s%s\\n%s %s\"];\n", i, kpl_op_name(n->op), a,
                    kpl_dtype_name(o->dtype), kpl_shape_str(o->ndim, o->shape, b, sizeof b));
            for (int j = 0; j < n->nin; j++) {
                int v = n->in[j];
                if (v < 0) continue;
                if (ir->v[v].kind == KPL_IRV_OP) fprintf(f, "  n%d -> n%d;\n", ir->v[v].node, i);
                else fprintf(f, "  v%d -> n%d;\n", v, i);
            }
        }
        for (int i = 0; i < ir->noutputs; i++) {
            fprintf(f, "  out%d [shape=house, label=\"%s\"];\n", i, ir->out_names[i]);
            fprintf(f, "  n%d -> out%d;\n", ir->v[ir->outputs[i]].node, i);
        }
        for (int i = 0; i < ir->nupdates; i++)
            fprintf(f, "  n%d -> v%d [style=dashed, label=\"update\"];\n",
                    ir->v[ir->upd_value[i]].node, ir->upd_param[i]);
        fprintf(f, "}\n");
        return ferror(f) ? KPL_ERROR(KPL_EIO, "ir_dump: write error") : KPL_OK;
    }
    fprintf(f, "graph: %d values, %d nodes, %d updates, level O%d\n", ir->nv, ir->nn,
            ir->nupdates, ir->level);
    for (int v = 0; v < ir->nv; v++) {
        const kpl_irv *val = &ir->v[v];
        if (val->kind == KPL_IRV_OP) continue;
        value_str(ir, v, s1, sizeof s1);
        fprintf(f, "  %-6s %s %s %s\n", kinds[val->kind], s1, kpl_dtype_name(val->dtype),
                kpl_shape_str(val->ndim, val->shape, b, sizeof b));
    }
    for (int i = 0; i < ir->nn; i++) {
        const kpl_irn *n = &ir->n[i];
        fprintf(f, "  ");
        for (int j = 0; j < n->nout; j++) {
            value_str(ir, n->out[j], s1, sizeof s1);
            fprintf(f, "%s%s", j ? ", " : "", s1);
        }
        attrs_str(n, a, sizeof a);
        fprintf(f, " = %s(", kpl_op_name(n->op));
        for (int j = 0; j < n->nin; j++) {
            value_str(ir, n->in[j], s1, sizeof s1);
            fprintf(f, "%s%s", j ? ", " : "", s1);
        }
        const kpl_irv *o = &ir->v[n->out[0]];
        fprintf(f, ")%s  # %s %s\n", a, kpl_dtype_name(o->dtype),
                kpl_shape_str(o->ndim, o->shape, b, sizeof b));
    }
    for (int i = 0; i < ir->noutputs; i++) {
        value_str(ir, ir->outputs[i], s1, sizeof s1);
        fprintf(f, "  output %s = %s\n", ir->out_names[i], s1);
    }
    for (int i = 0; i < ir->nupdates; i++) {
        value_str(ir, ir->upd_param[i], s1, sizeof s1);
        value_str(ir, ir->upd_value[i], a, sizeof a);
        fprintf(f, "  update %s <- %s\n", s1, a);
    }
    return ferror(f) ? KPL_ERROR(KPL_EIO, "ir_dump: write error") : KPL_OK;
}
