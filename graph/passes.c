/*
 * passes.c — graph passes over GraphIR.
 *
 *   prune            (O1) nodes no output needs go, then values nothing uses;
 *   fuse_inference   constant folding (ops of parameters and constants only:
 *                    the eval batch norm's reshapes, eps and rsqrt), then
 *                    per-channel scale and shift after a convolution folded
 *                    into its weights and bias (batch norm into conv), then
 *                    a convolution followed by ReLU as conv2d_relu, then a
 *                    convolution whose output is added to another value
 *                    of its shape (a residual), with a ReLU after the add
 *                    or not, as conv2d_add(_relu).
 * In-place (O2) and buffer reuse (O3) are decisions of the memory plan,
 * made in kpl_exec_create (exec.c) from the level kept in the graph.
 */
#include "graph_impl.h"
#include "ir_impl.h"

#include <stdlib.h>
#include <string.h>

/* Rebuilds ir keeping the nodes with keep[i] and the values they, the
 * placeholders and the outputs use (in their order, renumbered). */
static kpl_status compact(kpl_ir *ir, const bool *keep)
{
    int nv = ir->nv ? ir->nv : 1;
    bool *used = calloc((size_t)nv, 1);
    int *map = malloc((size_t)nv * sizeof *map);
    kpl_irv *v2 = malloc((size_t)nv * sizeof *v2);
    kpl_irn *n2 = malloc((size_t)(ir->nn ? ir->nn : 1) * sizeof *n2);
    if (!used || !map || !v2 || !n2) {
        free(used);
        free(map);
        free(v2);
        free(n2);
        return KPL_ERROR(KPL_ENOMEM, "graph pass: no host memory");
    }
    for (int i = 0; i < ir->ninputs; i++) used[ir->inputs[i]] = true;
    for (int i = 0; i < ir->noutputs; i++) used[ir->outputs[i]] = true;
    for (int i = 0; i < ir->nupdates; i++) used[ir->upd_param[i]] = used[ir->upd_value[i]] = true;
    for (int i = 0; i < ir->nn; i++) {
        if (!keep[i]) continue;
        for (int j = 0; j < ir->n[i].nin; j++)
            if (ir->n[i].in[j] >= 0) used[ir->n[i].in[j]] = true;
        for (int j = 0; j < ir->n[i].nout; j++) used[ir->n[i].out[j]] = true;
    }
    int k = 0;
    for (int v = 0; v < ir->nv; v++) {
        if (!used[v]) {
            free(ir->v[v].name);
            kpl_tensor_release(ir->v[v].data);
            map[v] = -1;
            continue;
        }
        map[v] = k;
        v2[k++] = ir->v[v];
    }
    int m = 0;
    for (int i = 0; i < ir->nn; i++) {
        if (!keep[i]) continue;
        kpl_irn n = ir->n[i];
        for (int j = 0; j < n.nin; j++) n.in[j] = n.in[j] >= 0 ? map[n.in[j]] : -1;
        for (int j = 0; j < n.nout; j++) {
            n.out[j] = map[n.out[j]];
            v2[n.out[j]].node = m;
        }
        n2[m++] = n;
    }
    for (int v = 0; v < k; v++)
        if (v2[v].kind == KPL_IRV_OP && v2[v].node >= 0 && v2[v].node < m) {
            /* node indices were rewritten above for outputs of kept nodes */
        }
    for (int i = 0; i < ir->ninputs; i++) ir->inputs[i] = map[ir->inputs[i]];
    for (int i = 0; i < ir->noutputs; i++) ir->outputs[i] = map[ir->outputs[i]];
    for (int i = 0; i < ir->nupdates; i++) {
        ir->upd_param[i] = map[ir->upd_param[i]];
        ir->upd_value[i] = map[ir->upd_value[i]];
    }
    free(ir->v);
    free(ir->n);
    ir->v = v2;
    ir->nv = ir->cap_v = k;
    ir->n = n2;
    ir->nn = m;
    ir->cap_n = ir->nn ? ir->nn : 1;
    if (!ir->cap_v) ir->cap_v = 0;
    free(used);
    free(map);
    return KPL_OK;
}

kpl_status kpl_ir_prune(kpl_ir *ir, int *changed)
{
    KPL_CHECK(ir, KPL_EINVAL, "ir_prune: NULL");
    bool *need = calloc((size_t)(ir->nv ? ir->nv : 1), 1);
    bool *keep = calloc((size_t)(ir->nn ? ir->nn : 1), 1);
    if (!need || !keep) {
        free(need);
        free(keep);
        return KPL_ERROR(KPL_ENOMEM, "ir_prune: no host memory");
    }
    for (int i = 0; i < ir->noutputs; i++) need[ir->outputs[i]] = true;
    for (int i = 0; i < ir->nupdates; i++) need[ir->upd_value[i]] = true;
    int dropped = 0;
    for (int i = ir->nn - 1; i >= 0; i--) {
        const kpl_irn *n = &ir->n[i];
        for (int j = 0; j < n->nout && !keep[i]; j++) keep[i] = need[n->out[j]];
        if (!keep[i]) {
            dropped++;
            continue;
        }
        for (int j = 0; j < n->nin; j++)
            if (n->in[j] >= 0) need[n->in[j]] = true;
    }
    int nv0 = ir->nv;
    kpl_status st = compact(ir, keep);
    free(need);
    free(keep);
    if (changed) *changed = dropped + (nv0 - ir->nv);
    return st;
}

/* ---- inference fusions ---- */

static bool is_fixed(const kpl_ir *ir, int v)
{
    return v >= 0 && (ir->v[v].kind == KPL_IRV_PARAM || ir->v[v].kind == KPL_IRV_CONST);
}

/* Readers of each value (nodes that take it as an input), counted, plus
 * one for a graph output. */
static kpl_status count_readers(const kpl_ir *ir, const bool *dead, int **out)
{
    int *r = calloc((size_t)(ir->nv ? ir->nv : 1), sizeof *r);
    KPL_CHECK(r, KPL_ENOMEM, "graph pass: no host memory");
    for (int i = 0; i < ir->nn; i++) {
        if (dead && dead[i]) continue;
        for (int j = 0; j < ir->n[i].nin; j++)
            if (ir->n[i].in[j] >= 0) r[ir->n[i].in[j]]++;
    }
    for (int i = 0; i < ir->noutputs; i++) r[ir->outputs[i]]++;
    *out = r;
    return KPL_OK;
}

/* The node reading v (its only reader), or -1. */
static int only_reader(const kpl_ir *ir, const bool *dead, const int *readers, int v)
{
    if (readers[v] != 1) return -1;
    for (int i = 0; i < ir->nn; i++) {
        if (dead[i]) continue;
        for (int j = 0; j < ir->n[i].nin; j++)
            if (ir->n[i].in[j] == v) return i;
    }
    return -1; /* read by an output */
}

/* Turns op value v into a constant holding t (owned reference passed in). */
static void make_const(kpl_ir *ir, int v, kpl_tensor *t)
{
    kpl_irv *val = &ir->v[v];
    val->kind = KPL_IRV_CONST;
    val->node = -1;
    kpl_tensor_release(val->data);
    val->data = t;
}

/* Runs node i of parameters/constants now; its outputs become constants. */
static kpl_status fold_node(kpl_ir *ir, int i)
{
    kpl_irn *n = &ir->n[i];
    kpl_tensor *in[KPL_IR_MAX_IN] = {0}, *out[KPL_IR_MAX_OUT] = {0};
    for (int j = 0; j < n->nin; j++) in[j] = n->in[j] >= 0 ? ir->v[n->in[j]].data : NULL;
    kpl_status st = KPL_OK;
    for (int j = 0; j < n->nout && st == KPL_OK; j++) {
        const kpl_irv *o = &ir->v[n->out[j]];
        if (n->op == KPL_OP_RESHAPE) /* a view: keep the parameter's bytes, a copy */
            st = kpl_tensor_empty(kpl_tensor_device(in[0]), o->dtype, o->ndim, o->shape, &out[j]);
        else if (n->op == KPL_OP_NARROW)
            st = kpl_tensor_empty(kpl_tensor_device(in[0]), o->dtype, o->ndim, o->shape, &out[j]);
        else
            st = kpl_tensor_empty(kpl_tensor_device(in[0]), o->dtype, o->ndim, o->shape, &out[j]);
    }
    if (st == KPL_OK) {
        if (n->op == KPL_OP_RESHAPE || n->op == KPL_OP_NARROW) {
            kpl_tensor *view = NULL;
            st = n->op == KPL_OP_RESHAPE
                     ? kpl_tensor_reshape(in[0], ir->v[n->out[0]].ndim, ir->v[n->out[0]].shape, &view)
                     : kpl_tensor_narrow(in[0], n->at.start, n->at.length, &view);
            if (st == KPL_OK) st = kpl_k_copy(out[0], view);
            kpl_tensor_release(view);
        } else {
            st = kpl__ir_run_node(n, in, out);
        }
    }
    if (st < 0) {
        for (int j = 0; j < n->nout; j++) kpl_tensor_release(out[j]);
        return kpl_error_prefix(st, "constant folding of node %d (%s): ", i, kpl_op_name(n->op));
    }
    for (int j = 0; j < n->nout; j++) make_const(ir, n->out[j], out[j]);
    return KPL_OK;
}

/* Whether a constant c broadcasts against a conv output (N, O, H, W) as
 * one value per output channel or one value in all: returns the O values
 * as a (O) tensor in *per (owned), in the conv's dtype. */
static kpl_status per_channel_values(kpl_tensor *c, int64_t o, kpl_dtype dt, kpl_tensor **per)
{
    *per = NULL;
    int nd = kpl_tensor_ndim(c);
    const int64_t *s = kpl_tensor_shape(c);
    if (nd > 4) return KPL_OK;
    int64_t ch = 1;
    for (int d = 0; d < nd; d++) {
        int axis = 4 - nd + d; /* numpy alignment on the right */
        if (axis == 1) ch = s[d];
        else if (s[d] != 1) return KPL_OK;
    }
    if (ch != 1 && ch != o) return KPL_OK;
    kpl_tensor *flat = kpl_reshape(c, 1, &ch);
    kpl_tensor *full = flat ? kpl_expand(flat, 1, &o) : NULL;
    kpl_tensor *cast = full ? kpl_cast(full, dt) : NULL;
    if (!cast) return kpl_last_status();
    kpl_tensor_retain(cast);
    *per = cast;
    return KPL_OK;
}

/* Folds node e = (conv output) op const into conv node c: returns true when
 * done (the conv writes e's output with new weights and bias). */
static kpl_status fold_into_conv(kpl_ir *ir, int c, int e, bool *done)
{
    *done = false;
    kpl_irn *cn = &ir->n[c], *en = &ir->n[e];
    int y = cn->out[0];
    kpl_op op = en->op;
    int cst = -1;
    double s = 0;
    bool scalar = false;
    switch (op) {
    case KPL_OP_MUL: case KPL_OP_ADD:
        cst = en->in[0] == y ? en->in[1] : en->in[0];
        break;
    case KPL_OP_SUB: case KPL_OP_DIV:
        if (en->in[0] != y) return KPL_OK;
        cst = en->in[1];
        break;
    case KPL_OP_MUL_SCALAR: case KPL_OP_ADD_SCALAR:
        scalar = true;
        s = en->at.scalar;
        break;
    case KPL_OP_SUB_SCALAR: case KPL_OP_DIV_SCALAR:
        if (en->at.scalar_first) return KPL_OK;
        scalar = true;
        s = en->at.scalar;
        break;
    default: return KPL_OK;
    }
    if (!scalar && (!is_fixed(ir, cst) || cst == y)) return KPL_OK;
    const kpl_irv *yv = &ir->v[y], *ev = &ir->v[en->out[0]];
    if (yv->dtype != KPL_F32 && yv->dtype != KPL_F64) return KPL_OK;
    if (ev->dtype != yv->dtype || ev->ndim != 4 ||
        memcmp(ev->shape, yv->shape, sizeof(int64_t) * 4)) /* the op must not broadcast y */
        return KPL_OK;
    kpl_tensor *w = ir->v[cn->in[1]].data, *b = cn->in[2] >= 0 ? ir->v[cn->in[2]].data : NULL;
    int64_t o = yv->shape[1];
    kpl_tensor *per = NULL;
    if (scalar) {
        kpl_tensor *one = kpl_full(kpl_tensor_device(w), yv->dtype, 1, &o, s);
        if (!one) return kpl_last_status();
        kpl_tensor_retain(one);
        per = one;
    } else {
        KPL_TRY(per_channel_values(ir->v[cst].data, o, yv->dtype, &per));
        if (!per) return KPL_OK;
    }
    bool mul = op == KPL_OP_MUL || op == KPL_OP_MUL_SCALAR || op == KPL_OP_DIV ||
               op == KPL_OP_DIV_SCALAR;
    bool inv = op == KPL_OP_DIV || op == KPL_OP_DIV_SCALAR;
    kpl_tensor *nw = w, *nb = b;
    int64_t o1111[4] = {o, 1, 1, 1};
    if (mul) {
        kpl_tensor *f = inv ? kpl_reciprocal(per) : per;
        nw = kpl_mul(w, kpl_reshape(f, 4, o1111));
        nb = b ? kpl_mul(b, f) : NULL;
    } else {
        kpl_tensor *f = op == KPL_OP_SUB || op == KPL_OP_SUB_SCALAR ? kpl_neg(per) : per;
        nb = b ? kpl_add(b, f) : f;
    }
    kpl_tensor_release(per);
    if (!nw || (b && !nb) || (!mul && !nb)) return kpl_last_status();
    /* new constants for the weights and bias (the parameters stay as they are) */
    int wv = kpl_ir_add_value(ir, KPL_IRV_CONST, kpl_tensor_dtype(nw), 4, kpl_tensor_shape(nw),
                              NULL, nw);
    if (wv < 0) return kpl_last_status();
    int bv = -1;
    if (nb) {
        bv = kpl_ir_add_value(ir, KPL_IRV_CONST, kpl_tensor_dtype(nb), 1, &o, NULL, nb);
        if (bv < 0) return kpl_last_status();
    }
    cn = &ir->n[c]; /* the value array may have moved, the nodes not */
    en = &ir->n[e];
    cn->in[1] = wv;
    cn->in[2] = bv;
    cn->nin = bv >= 0 ? 3 : 2;
    /* the conv now writes e's output; y is orphaned */
    int eo = en->out[0];
    ir->v[y].node = -1;
    cn->out[0] = eo;
    ir->v[eo].node = c;
    *done = true;
    return KPL_OK;
}

/* Whether op value v of add node e is a convolution's that can take the
 * add's other operand r as its addend: the convolution's only reader is
 * the add, r is made before it (so the convolution can read it) and has
 * its shape and dtype, and the device has the kernel.  Returns the
 * convolution's node, or -1. */
static int residual_conv(const kpl_ir *ir, const bool *dead, const int *readers, int e, int v,
                         int r)
{
    int c = ir->v[v].kind == KPL_IRV_OP ? ir->v[v].node : -1;
    if (c < 0 || dead[c] || ir->n[c].op != KPL_OP_CONV2D || v == r ||
        only_reader(ir, dead, readers, v) != e)
        return -1;
    const kpl_irv *yv = &ir->v[v], *rv = &ir->v[r];
    if (rv->kind == KPL_IRV_OP && rv->node >= c) return -1;
    if (rv->dtype != yv->dtype || rv->ndim != 4 || yv->ndim != 4 ||
        memcmp(rv->shape, yv->shape, sizeof(int64_t) * 4) ||
        memcmp(ir->v[ir->n[e].out[0]].shape, yv->shape, sizeof(int64_t) * 4))
        return -1;
    const kpl_tensor *w = ir->v[ir->n[c].in[1]].data;
    kpl_device *dev = w ? kpl_tensor_device(w) : kpl_device_cpu();
    if (!kpl_kernel_registered(KPL_KOP_CONV2D_ACC, kpl_device_type_of(dev), yv->dtype)) return -1;
    return c;
}

/* 4. conv + add (+ ReLU) as conv2d_add(_relu): of the add's two operands,
 * the convolution made last takes the other as its addend (ResNet's
 * shortcut convolution runs after the main branch's, so it is the one
 * that can read the branch's output).  The add's output (or the ReLU's)
 * becomes the convolution's. */
static int fuse_residuals(kpl_ir *ir, bool *dead, const int *readers)
{
    int count = 0;
    for (int e = 0; e < ir->nn; e++) {
        kpl_irn *en = &ir->n[e];
        if (dead[e] || en->op != KPL_OP_ADD || en->nin != 2) continue;
        int c0 = residual_conv(ir, dead, readers, e, en->in[0], en->in[1]);
        int c1 = residual_conv(ir, dead, readers, e, en->in[1], en->in[0]);
        int side = c1 > c0 ? 1 : 0, c = side ? c1 : c0;
        if (c < 0) continue;
        int r = en->in[1 - side], out = en->out[0];
        int f = only_reader(ir, dead, readers, out);
        bool relu = f >= 0 && ir->n[f].op == KPL_OP_RELU;
        kpl_irn *cn = &ir->n[c];
        int b = cn->nin > 2 ? cn->in[2] : -1;
        ir->v[cn->out[0]].node = -1;
        cn->op = relu ? KPL_OP_CONV2D_ADD_RELU : KPL_OP_CONV2D_ADD;
        cn->in[2] = r;
        cn->in[3] = b;
        cn->nin = b >= 0 ? 4 : 3;
        if (relu) {
            dead[f] = true;
            out = ir->n[f].out[0];
        }
        cn->out[0] = out;
        ir->v[out].node = c;
        dead[e] = true;
        count += 1 + relu;
    }
    return count;
}

kpl_status kpl_ir_fuse_inference(kpl_ir *ir, int *changed)
{
    KPL_CHECK(ir, KPL_EINVAL, "ir_fuse_inference: NULL");
    KPL_CHECK(!ir->nupdates, KPL_EINVAL,
              "ir_fuse_inference: the graph updates %d parameters (a training step): folding "
              "parameters into constants would stop it training",
              ir->nupdates);
    int count = 0;
    bool *dead = calloc((size_t)(ir->nn ? ir->nn : 1), 1);
    KPL_CHECK(dead, KPL_ENOMEM, "ir_fuse_inference: no host memory");
    kpl_pool *pool = kpl_pool_push();
    bool prev = kpl_set_grad_enabled(false);
    kpl_status st = pool ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "ir_fuse_inference: no host memory");
    /* 1. constant folding, in order (a folded output may feed the next) */
    for (int i = 0; i < ir->nn && st == KPL_OK; i++) {
        kpl_irn *n = &ir->n[i];
        bool fixed = n->nin > 0;
        for (int j = 0; j < n->nin; j++) fixed &= n->in[j] < 0 || is_fixed(ir, n->in[j]);
        if (!fixed) continue;
        if ((st = fold_node(ir, i)) == KPL_OK) {
            dead[i] = true;
            count++;
        }
    }
    /* 2. per-channel scale and shift into the convolution before them */
    int *readers = NULL;
    for (bool again = true; again && st == KPL_OK;) {
        again = false;
        free(readers);
        readers = NULL;
        if ((st = count_readers(ir, dead, &readers)) < 0) break;
        for (int c = 0; c < ir->nn && st == KPL_OK; c++) {
            if (dead[c] || ir->n[c].op != KPL_OP_CONV2D || !is_fixed(ir, ir->n[c].in[1]) ||
                (ir->n[c].in[2] >= 0 && !is_fixed(ir, ir->n[c].in[2])))
                continue;
            int e = only_reader(ir, dead, readers, ir->n[c].out[0]);
            if (e < 0) continue;
            bool done = false;
            if ((st = fold_into_conv(ir, c, e, &done)) < 0 || !done) continue;
            dead[e] = true;
            count++;
            again = true;
            break; /* the readers changed */
        }
    }
    /* 3. conv (+ bias) + ReLU as one op where the device has the kernel */
    if (st == KPL_OK) {
        free(readers);
        readers = NULL;
        st = count_readers(ir, dead, &readers);
    }
    for (int c = 0; c < ir->nn && st == KPL_OK; c++) {
        kpl_irn *cn = &ir->n[c];
        if (dead[c] || cn->op != KPL_OP_CONV2D) continue;
        int e = only_reader(ir, dead, readers, cn->out[0]);
        if (e < 0 || ir->n[e].op != KPL_OP_RELU) continue;
        kpl_dtype dt = ir->v[cn->out[0]].dtype;
        kpl_device *dev = ir->v[cn->in[1]].data ? kpl_tensor_device(ir->v[cn->in[1]].data)
                                                : kpl_device_cpu();
        if (!kpl_kernel_registered(KPL_KOP_CONV2D_RELU, kpl_device_type_of(dev), dt)) continue;
        int y = cn->out[0], eo = ir->n[e].out[0];
        cn->op = KPL_OP_CONV2D_RELU;
        ir->v[y].node = -1;
        cn->out[0] = eo;
        ir->v[eo].node = c;
        dead[e] = true;
        count++;
    }
    if (st == KPL_OK) count += fuse_residuals(ir, dead, readers);
    free(readers);
    kpl_set_grad_enabled(prev);
    kpl_pool_pop(pool);
    if (st == KPL_OK) {
        bool *keep = malloc((size_t)(ir->nn ? ir->nn : 1));
        if (!keep) st = KPL_ERROR(KPL_ENOMEM, "ir_fuse_inference: no host memory");
        for (int i = 0; keep && i < ir->nn; i++) keep[i] = !dead[i];
        if (st == KPL_OK) st = compact(ir, keep);
        free(keep);
    }
    free(dead);
    if (changed) *changed = count;
    return st;
}

kpl_status kpl_ir_optimize(kpl_ir *ir, int level, bool inference)
{
    KPL_CHECK(ir, KPL_EINVAL, "ir_optimize: NULL");
    KPL_CHECK(level >= 0 && level <= 3, KPL_EINVAL, "ir_optimize: level O%d (0 to 3)", level);
    if (inference) KPL_TRY(kpl_ir_fuse_inference(ir, NULL));
    if (level >= 1) KPL_TRY(kpl_ir_prune(ir, NULL));
    ir->level = level;
    return kpl_ir_check(ir);
}
