/*
 * exec.c — running GraphIR: one node on given tensors, shape inference,
 * and the executor, whose memory plan and tensors are made once.
 *
 * The plan (kpl_exec_create) by the graph's level:
 *   O0, O1  every op value gets a storage of its own;
 *   O2      an element-wise op whose input dies with it writes over it
 *           (same storage: kernels see in-place work they support);
 *   O3      every value that needs memory gets a slot of one arena,
 *           placed first-fit by liveness, largest first (kpl_storage_sub),
 *           so buffers of values that are never alive together share
 *           bytes; on the zoo's graphs the arena is the most bytes alive
 *           at once (live_bytes), the bound.
 * A training step's updates: parameters written in the step take the
 * last value at the end of the run, computed in their own bytes where the
 * chain of element-wise ops from the old value allows it (O2), else copied.
 * Reshapes and narrows are views of their input's bytes at every level.
 * Each slot is a storage of its own, so the CPU's blocked layouts work
 * as in eager mode.
 */
#include "graph_impl.h"
#include "ir_impl.h"

#include <stdlib.h>
#include <string.h>

/* ---- one node ---- */

static int unary_of(kpl_op op)
{
    switch (op) {
#define U(E) case KPL_OP_##E: return KPL_UN_##E;
    U(NEG) U(ABS) U(EXP) U(LOG) U(SQRT) U(RSQRT) U(SQUARE) U(RECIPROCAL) U(SIN) U(COS) U(TANH)
    U(SIGMOID) U(RELU) U(LEAKY_RELU) U(GELU) U(CLIP) U(SIGN) U(GELU_TANH) U(ERF) U(SOFTPLUS)
#undef U
    default: return -1;
    }
}

static int binary_of(kpl_op op)
{
    switch (op) {
    case KPL_OP_ADD: case KPL_OP_ADD_SCALAR: return KPL_BIN_ADD;
    case KPL_OP_SUB: case KPL_OP_SUB_SCALAR: return KPL_BIN_SUB;
    case KPL_OP_MUL: case KPL_OP_MUL_SCALAR: return KPL_BIN_MUL;
    case KPL_OP_DIV: case KPL_OP_DIV_SCALAR: return KPL_BIN_DIV;
    case KPL_OP_POW: case KPL_OP_POW_SCALAR: return KPL_BIN_POW;
    case KPL_OP_MAXIMUM: case KPL_OP_MAXIMUM_SCALAR: return KPL_BIN_MAXIMUM;
    case KPL_OP_MINIMUM: case KPL_OP_MINIMUM_SCALAR: return KPL_BIN_MINIMUM;
    default: return -1;
    }
}

static bool is_scalar_op(kpl_op op) { return op >= KPL_OP_ADD_SCALAR && op <= KPL_OP_MINIMUM_SCALAR; }

static int reduce_of(kpl_op op)
{
    switch (op) {
    case KPL_OP_SUM: return KPL_RED_SUM;
    case KPL_OP_MEAN: return KPL_RED_MEAN;
    case KPL_OP_MAX: return KPL_RED_MAX;
    case KPL_OP_MIN: return KPL_RED_MIN;
    case KPL_OP_VAR: return KPL_RED_VAR;
    case KPL_OP_LOGSUMEXP: return KPL_RED_LOGSUMEXP;
    case KPL_OP_ARGMAX: return KPL_RED_ARGMAX;
    case KPL_OP_ARGMIN: return KPL_RED_ARGMIN;
    default: return -1;
    }
}

/* Whether the executor runs op (views count: the plan makes them). */
static bool runnable(kpl_op op)
{
    if (unary_of(op) >= 0 || binary_of(op) >= 0 || reduce_of(op) >= 0) return true;
    switch (op) {
    case KPL_OP_WHERE: case KPL_OP_MATMUL: case KPL_OP_CAST: case KPL_OP_RESHAPE:
    case KPL_OP_PERMUTE: case KPL_OP_NARROW: case KPL_OP_EXPAND: case KPL_OP_PAD_ROWS:
    case KPL_OP_CONV2D: case KPL_OP_CONV2D_RELU: case KPL_OP_CONV2D_BWD_DATA:
    case KPL_OP_CONV2D_BWD_WEIGHT: case KPL_OP_PLANE_GATHER: case KPL_OP_PLANE_SCATTER:
    case KPL_OP_AVG_POOL2D: case KPL_OP_AVG_POOL2D_BWD: case KPL_OP_INDEX_SELECT:
    case KPL_OP_INDEX_ADD: case KPL_OP_GATHER: case KPL_OP_SCATTER_ADD: case KPL_OP_ROI_ALIGN:
    case KPL_OP_ROI_ALIGN_BWD: case KPL_OP_COMPARE: case KPL_OP_MAX_POOL2D: case KPL_OP_BINARY:
    case KPL_OP_BATCH_NORM: case KPL_OP_BATCH_NORM_RELU: case KPL_OP_BATCH_NORM_BWD:
        return true;
    default:
        return false;
    }
}

kpl_status kpl__ir_run_node(const kpl_irn *n, kpl_tensor *const *in, kpl_tensor *const *out)
{
    const kpl_op_attrs *a = &n->at;
    int u = unary_of(n->op), b = binary_of(n->op), r = reduce_of(n->op);
    if (u >= 0) return kpl_k_unary(out[0], (kpl_unary_op)u, in[0], a->alpha, a->beta);
    if (b >= 0 && is_scalar_op(n->op))
        return kpl_k_binary_scalar(out[0], (kpl_binary_op)b, in[0], a->scalar, a->scalar_first);
    if (b >= 0) return kpl_k_binary(out[0], (kpl_binary_op)b, in[0], in[1]);
    if (r >= 0)
        return kpl_k_reduce(out[0], (kpl_reduce_op)r, in[0], a->naxes ? a->axes : NULL, a->naxes,
                            a->keepdim, a->correction);
    switch (n->op) {
    case KPL_OP_COMPARE:
    case KPL_OP_BINARY: return kpl_k_binary(out[0], (kpl_binary_op)a->sub, in[0], in[1]);
    case KPL_OP_BATCH_NORM:
        return kpl_k_batch_norm(out[0], n->nout > 1 ? out[1] : NULL, n->nout > 2 ? out[2] : NULL,
                                in[0], in[1], in[2], a->alpha);
    case KPL_OP_BATCH_NORM_RELU:
        return kpl_k_batch_norm_relu(out[0], n->nout > 1 ? out[1] : NULL,
                                     n->nout > 2 ? out[2] : NULL, in[0], in[1], in[2], a->alpha);
    case KPL_OP_BATCH_NORM_BWD: /* x, gy, gamma (, relu's output y) */
        if (a->sub)
            return kpl_k_batch_norm_relu_bwd(out[0], out[1], out[2], in[0], in[3], in[1], in[2],
                                             a->alpha);
        return kpl_k_batch_norm_bwd(out[0], out[1], out[2], in[0], in[1], in[2], a->alpha);
    case KPL_OP_WHERE: return kpl_k_where(out[0], in[0], in[1], in[2]);
    case KPL_OP_MATMUL: return kpl_k_matmul(out[0], in[0], in[1], a->trans_a, a->trans_b);
    case KPL_OP_CAST: return kpl_k_cast(out[0], in[0]);
    case KPL_OP_RESHAPE:
    case KPL_OP_NARROW: return KPL_OK; /* views, made by the plan */
    case KPL_OP_PERMUTE: return kpl_k_permute(out[0], in[0], a->axes);
    case KPL_OP_EXPAND: return kpl_k_expand(out[0], in[0]);
    case KPL_OP_PAD_ROWS: return kpl__pad_rows_into(out[0], in[0], a->start);
    case KPL_OP_CONV2D: return kpl_k_conv2d(out[0], in[0], in[1], in[2], &a->conv);
    case KPL_OP_CONV2D_RELU: return kpl_k_conv2d_relu(out[0], in[0], in[1], in[2], &a->conv);
    case KPL_OP_CONV2D_BWD_DATA: return kpl_k_conv2d_bwd_data(out[0], in[0], in[1], &a->conv);
    case KPL_OP_CONV2D_BWD_WEIGHT:
        return kpl_k_conv2d_bwd_weight(out[0], n->nout > 1 ? out[1] : NULL, in[0], in[1], &a->conv);
    case KPL_OP_MAX_POOL2D: return kpl_k_max_pool2d(out[0], out[1], in[0], &a->pool);
    case KPL_OP_PLANE_GATHER: return kpl_k_plane_gather(out[0], in[0], in[1]);
    case KPL_OP_PLANE_SCATTER: return kpl_k_plane_scatter(out[0], in[0], in[1]);
    case KPL_OP_AVG_POOL2D: return kpl_k_avg_pool2d(out[0], in[0], &a->pool);
    case KPL_OP_AVG_POOL2D_BWD: return kpl_k_avg_pool2d_bwd(out[0], in[0], &a->pool);
    case KPL_OP_INDEX_SELECT: return kpl_k_index_select(out[0], in[0], a->axes[0], in[1]);
    case KPL_OP_INDEX_ADD: return kpl_k_index_add(out[0], in[0], a->axes[0], in[1]);
    case KPL_OP_GATHER: return kpl_k_gather(out[0], in[0], a->axes[0], in[1]);
    case KPL_OP_SCATTER_ADD: return kpl_k_scatter_add(out[0], in[0], a->axes[0], in[1], in[2]);
    case KPL_OP_ROI_ALIGN: return kpl_k_roi_align(out[0], in[0], in[1], &a->roi);
    case KPL_OP_ROI_ALIGN_BWD: return kpl_k_roi_align_bwd(out[0], in[0], in[1], &a->roi);
    default:
        return KPL_ERROR(KPL_EINVAL, "graph: op '%s' cannot run in a graph", kpl_op_name(n->op));
    }
}

/* ---- shape inference ---- */

/* The inputs (lo required, up to hi; the rest optional) and outputs
 * (olo required, up to ohi) of op. */
static void arity(kpl_op op, int *lo, int *hi, int *olo, int *ohi)
{
    *olo = *ohi = op == KPL_OP_MAX_POOL2D ? 2 : 1;
    if (unary_of(op) >= 0 || is_scalar_op(op) || reduce_of(op) >= 0) {
        *lo = *hi = 1;
        return;
    }
    if (binary_of(op) >= 0) {
        *lo = *hi = 2;
        return;
    }
    switch (op) {
    case KPL_OP_WHERE: case KPL_OP_SCATTER_ADD: *lo = *hi = 3; return;
    case KPL_OP_CONV2D: case KPL_OP_CONV2D_RELU: *lo = 2, *hi = 3; return;
    case KPL_OP_CAST: case KPL_OP_RESHAPE: case KPL_OP_PERMUTE: case KPL_OP_NARROW:
    case KPL_OP_EXPAND: case KPL_OP_PAD_ROWS: case KPL_OP_AVG_POOL2D:
    case KPL_OP_AVG_POOL2D_BWD: case KPL_OP_MAX_POOL2D:
        *lo = *hi = 1;
        return;
    case KPL_OP_BATCH_NORM: case KPL_OP_BATCH_NORM_RELU: /* y (, batch mean, batch var) */
        *lo = *hi = 3;
        *ohi = 3;
        return;
    case KPL_OP_BATCH_NORM_BWD: *lo = 3, *hi = 4, *olo = *ohi = 3; return;
    case KPL_OP_CONV2D_BWD_WEIGHT: *lo = *hi = 2, *ohi = 2; return; /* (, the bias's) */
    default: *lo = *hi = 2; return; /* matmul, compare, binary, the other adjoints, gathers */
    }
}

kpl_status kpl__ir_infer(const kpl_ir *ir, const kpl_irn *n, int *nd,
                         int64_t (*sh)[KPL_MAX_DIMS], kpl_dtype *dt)
{
    const char *name = kpl_op_name(n->op);
    KPL_CHECK(runnable(n->op), KPL_EINVAL, "op '%s' cannot run in a graph", name);
    const kpl_irv *x[KPL_IR_MAX_IN] = {0};
    for (int i = 0; i < n->nin; i++) x[i] = n->in[i] >= 0 ? &ir->v[n->in[i]] : NULL;
    int lo, hi, olo, ohi;
    arity(n->op, &lo, &hi, &olo, &ohi);
    KPL_CHECK(n->nin >= lo && n->nin <= hi && n->nout >= olo && n->nout <= ohi, KPL_EINVAL,
              "'%s' has %d inputs and %d outputs (it takes %d to %d and makes %d to %d)", name,
              n->nin, n->nout, lo, hi, olo, ohi);
    if (n->op == KPL_OP_BATCH_NORM_BWD)
        KPL_CHECK((n->nin == 4) == (n->at.sub != 0), KPL_EINVAL,
                  "batch_norm_bwd: the ReLU's output is an input exactly when relu is set");
    for (int i = 0; i < lo; i++)
        KPL_CHECK(x[i], KPL_EINVAL, "'%s': input %d is absent", name, i);
    const kpl_irv *o = &ir->v[n->out[0]]; /* for what the attributes do not say */
    const kpl_op_attrs *a = &n->at;
    char b1[96];
    nd[0] = x[0]->ndim;
    memcpy(sh[0], x[0]->shape, sizeof sh[0]);
    dt[0] = x[0]->dtype;
    int64_t tmp[KPL_MAX_DIMS];
    int ntmp;
    if (unary_of(n->op) >= 0 || is_scalar_op(n->op)) return KPL_OK;
    if (binary_of(n->op) >= 0 || n->op == KPL_OP_COMPARE || n->op == KPL_OP_BINARY)
        return kpl_shape_broadcast(name, x[0]->ndim, x[0]->shape, x[1]->ndim, x[1]->shape, &nd[0],
                                   sh[0]) < 0
                   ? kpl_last_status()
                   : (dt[0] = n->op == KPL_OP_COMPARE ? KPL_BOOL : x[0]->dtype, KPL_OK);
    int r = reduce_of(n->op);
    if (r >= 0) {
        KPL_TRY(kpl_shape_reduce(name, x[0]->ndim, x[0]->shape, a->naxes ? a->axes : NULL,
                                 a->naxes, a->keepdim, &nd[0], sh[0]));
        if (r == KPL_RED_ARGMAX || r == KPL_RED_ARGMIN) dt[0] = KPL_I64;
        return KPL_OK;
    }
    switch (n->op) {
    case KPL_OP_WHERE:
        KPL_TRY(kpl_shape_broadcast(name, x[0]->ndim, x[0]->shape, x[1]->ndim, x[1]->shape, &ntmp,
                                    tmp));
        KPL_TRY(kpl_shape_broadcast(name, ntmp, tmp, x[2]->ndim, x[2]->shape, &nd[0], sh[0]));
        dt[0] = x[1]->dtype;
        return KPL_OK;
    case KPL_OP_MATMUL:
        return kpl_shape_matmul(x[0]->ndim, x[0]->shape, a->trans_a, x[1]->ndim, x[1]->shape,
                                a->trans_b, &nd[0], sh[0]);
    case KPL_OP_CAST: dt[0] = o->dtype; return KPL_OK; /* the target is the value's dtype */
    case KPL_OP_RESHAPE: {
        int64_t ne = 1;
        for (int i = 0; i < o->ndim; i++) ne *= o->shape[i];
        int64_t xe = 1;
        for (int i = 0; i < x[0]->ndim; i++) xe *= x[0]->shape[i];
        KPL_CHECK(ne == xe, KPL_ESHAPE, "reshape: %s cannot become %s",
                  kpl_shape_str(x[0]->ndim, x[0]->shape, b1, sizeof b1),
                  kpl_shape_str(o->ndim, o->shape, (char[96]){0}, 96));
        nd[0] = o->ndim;
        memcpy(sh[0], o->shape, sizeof sh[0]);
        return KPL_OK;
    }
    case KPL_OP_NARROW:
        KPL_CHECK(x[0]->ndim >= 1 && a->start >= 0 && a->length >= 0 &&
                      a->start <= x[0]->shape[0] && a->length <= x[0]->shape[0] - a->start,
                  KPL_ESHAPE, "narrow: rows [%lld, %lld) of %s", (long long)a->start,
                  (long long)(a->start + a->length),
                  kpl_shape_str(x[0]->ndim, x[0]->shape, b1, sizeof b1));
        sh[0][0] = a->length;
        return KPL_OK;
    case KPL_OP_PERMUTE:
        KPL_CHECK(a->naxes == x[0]->ndim, KPL_ESHAPE, "permute: %d axes for %d dims", a->naxes,
                  x[0]->ndim);
        for (int i = 0; i < a->naxes; i++) {
            KPL_CHECK(a->axes[i] >= 0 && a->axes[i] < x[0]->ndim, KPL_ESHAPE,
                      "permute: axis %d", a->axes[i]);
            sh[0][i] = x[0]->shape[a->axes[i]];
        }
        return KPL_OK;
    case KPL_OP_EXPAND:
        KPL_TRY(kpl_shape_broadcast(name, x[0]->ndim, x[0]->shape, o->ndim, o->shape, &nd[0], sh[0]));
        return KPL_OK;
    case KPL_OP_PAD_ROWS: sh[0][0] = a->length; return KPL_OK;
    case KPL_OP_CONV2D:
    case KPL_OP_CONV2D_RELU:
        KPL_CHECK(x[0]->ndim == 4 && x[1]->ndim == 4, KPL_ESHAPE, "%s: 4-D input and weights", name);
        return kpl_shape_conv2d(x[0]->shape, x[1]->shape, &a->conv, sh[0]);
    case KPL_OP_BATCH_NORM:
    case KPL_OP_BATCH_NORM_RELU:
    case KPL_OP_BATCH_NORM_BWD:
    {
        bool bwd = n->op == KPL_OP_BATCH_NORM_BWD; /* x, gy, gamma (, y) */
        bool fit = x[0]->ndim >= 2 && x[2]->ndim == 1 && x[2]->shape[0] == x[0]->shape[1];
        if (bwd) /* gy and the ReLU's output have x's shape */
            for (int j = 1; j < n->nin; j += 2)
                fit = fit && x[j]->ndim == x[0]->ndim &&
                      !memcmp(x[j]->shape, x[0]->shape, (size_t)x[0]->ndim * sizeof(int64_t));
        else fit = fit && x[1]->ndim == 1 && x[1]->shape[0] == x[0]->shape[1];
        KPL_CHECK(fit, KPL_ESHAPE, "%s: x %s with inputs that do not fit it", name,
                  kpl_shape_str(x[0]->ndim, x[0]->shape, b1, sizeof b1));
    }
        for (int j = 1; j < n->nout; j++) { /* per channel, in gamma's dtype */
            nd[j] = 1;
            sh[j][0] = x[0]->shape[1];
            dt[j] = x[n->op == KPL_OP_BATCH_NORM_BWD ? 2 : 1]->dtype;
        }
        return KPL_OK;
    case KPL_OP_CONV2D_BWD_WEIGHT:
        if (n->nout > 1) {
            nd[1] = 1;
            sh[1][0] = a->shape4[0];
            dt[1] = x[0]->dtype;
        }
        /* fall through */
    case KPL_OP_CONV2D_BWD_DATA:
    case KPL_OP_PLANE_SCATTER:
    case KPL_OP_AVG_POOL2D_BWD:
        nd[0] = 4;
        memcpy(sh[0], a->shape4, sizeof a->shape4);
        return KPL_OK;
    case KPL_OP_MAX_POOL2D:
    case KPL_OP_AVG_POOL2D:
        KPL_CHECK(x[0]->ndim == 4, KPL_ESHAPE, "%s: input must be 4-D", name);
        KPL_TRY(kpl_shape_pool2d(x[0]->shape, &a->pool, sh[0]));
        if (n->op == KPL_OP_MAX_POOL2D) {
            nd[1] = 4;
            memcpy(sh[1], sh[0], sizeof sh[0]);
            dt[1] = KPL_I64;
        }
        return KPL_OK;
    case KPL_OP_PLANE_GATHER:
    case KPL_OP_GATHER:
        nd[0] = x[1]->ndim;
        memcpy(sh[0], x[1]->shape, sizeof sh[0]);
        return KPL_OK;
    case KPL_OP_INDEX_SELECT:
    case KPL_OP_INDEX_ADD:
        KPL_CHECK(a->axes[0] >= 0 && a->axes[0] < x[0]->ndim && x[1]->ndim == 1, KPL_ESHAPE,
                  "%s: axis %d of %s", name, a->axes[0],
                  kpl_shape_str(x[0]->ndim, x[0]->shape, b1, sizeof b1));
        sh[0][a->axes[0]] = n->op == KPL_OP_INDEX_SELECT ? x[1]->shape[0] : a->length;
        return KPL_OK;
    case KPL_OP_SCATTER_ADD: return KPL_OK;
    case KPL_OP_ROI_ALIGN:
        KPL_CHECK(x[0]->ndim == 4 && x[1]->ndim == 2, KPL_ESHAPE, "roi_align: x and rois");
        nd[0] = 4;
        sh[0][0] = x[1]->shape[0];
        sh[0][1] = x[0]->shape[1];
        sh[0][2] = a->roi.out_h;
        sh[0][3] = a->roi.out_w;
        return KPL_OK;
    case KPL_OP_ROI_ALIGN_BWD: /* x's shape is not an attribute */
        nd[0] = o->ndim;
        memcpy(sh[0], o->shape, sizeof sh[0]);
        return KPL_OK;
    default: return KPL_ERROR(KPL_EINVAL, "op '%s' cannot run in a graph", name);
    }
}

/* ---- the executor ---- */

struct kpl_exec {
    const kpl_ir *ir;
    kpl_device *dev;
    kpl_tensor **t;        /* per value: its tensor (owned), NULL for unused values */
    kpl_storage *arena;    /* O3 */
    bool *upd_copy;        /* per update: copied at the end (not computed in place) */
    kpl_exec_stats stats;
};

kpl_exec_stats kpl_exec_get_stats(const kpl_exec *ex) { return ex->stats; }

void kpl_exec_destroy(kpl_exec *ex)
{
    if (!ex) return;
    for (int v = 0; ex->t && v < ex->ir->nv; v++) kpl_tensor_release(ex->t[v]);
    free(ex->t);
    free(ex->upd_copy);
    kpl_storage_release(ex->arena);
    free(ex);
}

static size_t value_bytes(const kpl_irv *v)
{
    int64_t n = 1;
    for (int i = 0; i < v->ndim; i++) n *= v->shape[i];
    return (size_t)n * kpl_dtype_size(v->dtype);
}

static size_t align_up(size_t n) { return (n + 63) & ~(size_t)63; }

/* Whether node n may write its output over input 0 (O2): element-wise with
 * the output's shape and dtype, the input an op value (or placeholder's
 * copy) that no later node reads and no output is.  A parameter's bytes
 * are written only along the chain that ends in its own update
 * (chain[o] names the parameter whose new value o leads to). */
static bool inplace_ok(const kpl_ir *ir, const kpl_irn *n, const int *last_use, const int *root,
                       const bool *is_out, const int *chain, int i)
{
    if (!(unary_of(n->op) >= 0 || is_scalar_op(n->op) || n->op == KPL_OP_BINARY ||
          (binary_of(n->op) >= 0 && !is_scalar_op(n->op))))
        return false;
    if (n->in[0] < 0) return false;
    int v = root[n->in[0]]; /* whose bytes input 0 is */
    const kpl_irv *x = &ir->v[n->in[0]], *o = &ir->v[n->out[0]];
    bool mine = ir->v[v].kind == KPL_IRV_OP || (ir->v[v].kind == KPL_IRV_PARAM && chain[n->out[0]] == v);
    if (!mine || is_out[v] || last_use[v] != i) return false;
    if (x->dtype != o->dtype || x->ndim != o->ndim ||
        memcmp(x->shape, o->shape, (size_t)x->ndim * sizeof(int64_t)))
        return false;
    /* the other operand of a binary op must not be the same bytes */
    if (n->nin > 1 && n->in[1] >= 0 && root[n->in[1]] == v) return false;
    return true;
}

typedef struct {
    size_t bytes;
    int v;
} sized;

static int larger_first(const void *a, const void *b)
{
    const sized *x = a, *y = b;
    if (x->bytes != y->bytes) return x->bytes < y->bytes ? 1 : -1;
    return (x->v > y->v) - (x->v < y->v);
}

kpl_status kpl_exec_create(const kpl_ir *ir, kpl_exec **out)
{
    KPL_CHECK(ir && out, KPL_EINVAL, "exec_create: NULL argument");
    *out = NULL;
    KPL_TRY(kpl_ir_check(ir));
    kpl_exec *ex = calloc(1, sizeof *ex);
    KPL_CHECK(ex, KPL_ENOMEM, "exec_create: no host memory");
    ex->ir = ir;
    ex->dev = kpl_device_cpu();
    for (int v = 0; v < ir->nv; v++)
        if (ir->v[v].data) {
            ex->dev = kpl_tensor_device(ir->v[v].data);
            break;
        }
    int nv = ir->nv ? ir->nv : 1;
    ex->t = calloc((size_t)nv, sizeof *ex->t);
    int *last_use = malloc((size_t)nv * sizeof *last_use), *root = malloc((size_t)nv * sizeof *root);
    int *first = malloc((size_t)nv * sizeof *first);
    size_t *offset = calloc((size_t)nv, sizeof *offset);
    bool *is_out = calloc((size_t)nv, sizeof *is_out);
    int *chain = malloc((size_t)nv * sizeof *chain);
    int *upd_of = malloc((size_t)nv * sizeof *upd_of); /* the parameter a value updates, or -1 */
    ex->upd_copy = calloc((size_t)(ir->nupdates ? ir->nupdates : 1), sizeof *ex->upd_copy);
    kpl_status st = KPL_OK;
    if (!ex->t || !last_use || !root || !first || !offset || !is_out || !chain || !upd_of || !ex->upd_copy) {
        st = KPL_ERROR(KPL_ENOMEM, "exec_create: no host memory");
        goto out;
    }
    /* liveness: each value's first definition and last use (node index);
     * a view's bytes are its root's, so uses of a view extend the root */
    for (int v = 0; v < ir->nv; v++) {
        root[v] = v;
        first[v] = ir->v[v].kind == KPL_IRV_OP ? ir->v[v].node : -1;
        last_use[v] = first[v];
    }
    for (int i = 0; i < ir->noutputs; i++) is_out[ir->outputs[i]] = true;
    /* a parameter's new value is read at the end of the run, like an
     * output; the element-wise ops leading to it from the parameter's own
     * value may write over the parameter (O2) */
    for (int v = 0; v < ir->nv; v++) chain[v] = upd_of[v] = -1;
    for (int k = 0; k < ir->nupdates; k++) upd_of[ir->upd_value[k]] = ir->upd_param[k];
    for (int k = 0; k < ir->nupdates; k++) {
        int p = ir->upd_param[k], v = ir->upd_value[k];
        is_out[v] = true;
        int path[64], np = 0;
        while (v >= 0 && v != p && np < 64 && ir->v[v].kind == KPL_IRV_OP) {
            const kpl_irn *n = &ir->n[ir->v[v].node];
            if (!(unary_of(n->op) >= 0 || binary_of(n->op) >= 0 || n->op == KPL_OP_BINARY)) break;
            /* another parameter's new value is not computed in p's bytes */
            if (upd_of[v] >= 0 && upd_of[v] != p) break;
            path[np++] = v;
            v = n->in[0];
        }
        if (v == p)
            for (int j = 0; j < np; j++) chain[path[j]] = p;
    }
    int level = ir->level;
    for (int i = 0; i < ir->nn; i++) {
        const kpl_irn *n = &ir->n[i];
        if (kpl__ir_is_view(n->op)) root[n->out[0]] = root[n->in[0]];
    }
    for (int i = 0; i < ir->nn; i++) {
        const kpl_irn *n = &ir->n[i];
        for (int j = 0; j < n->nin; j++)
            if (n->in[j] >= 0) last_use[root[n->in[j]]] = i;
    }
    for (int v = 0; v < ir->nv; v++)
        if (is_out[v]) {
            last_use[root[v]] = ir->nn;
            is_out[root[v]] = true;
        }
    /* O2: in place — the output takes its input's bytes (a view of them) */
    if (level >= 2)
        for (int i = 0; i < ir->nn; i++) {
            const kpl_irn *n = &ir->n[i];
            if (!inplace_ok(ir, n, last_use, root, is_out, chain, i)) continue;
            int x = root[n->in[0]], o = n->out[0];
            root[o] = x;
            /* every later view of o follows it to x */
            for (int k = i + 1; k < ir->nn; k++)
                if (kpl__ir_is_view(ir->n[k].op) && root[ir->n[k].in[0]] == x)
                    root[ir->n[k].out[0]] = x;
            last_use[x] = last_use[o];
            is_out[x] = is_out[o];
            ex->stats.n_inplace++;
        }
    /* the bytes each root needs */
    size_t *need = calloc((size_t)nv, sizeof *need);
    if (!need) {
        st = KPL_ERROR(KPL_ENOMEM, "exec_create: no host memory");
        goto out;
    }
    /* max pooling's indices that nothing reads are not computed (the CPU
     * kernel then skips them) */
    for (int i = 0; i < ir->nn; i++)
        if (ir->n[i].op == KPL_OP_MAX_POOL2D && ir->n[i].nout > 1 &&
            last_use[ir->n[i].out[1]] == i && !is_out[ir->n[i].out[1]])
            root[ir->n[i].out[1]] = -1;
    for (int v = 0; v < ir->nv; v++) {
        const kpl_irv *val = &ir->v[v];
        if (val->kind == KPL_IRV_OP) ex->stats.value_bytes += value_bytes(val);
        if (val->kind == KPL_IRV_INPUT || (val->kind == KPL_IRV_OP && val->node >= 0 && root[v] == v))
            need[v] = value_bytes(val) ? align_up(value_bytes(val)) : 64; /* empty ones too */
    }
    /* O3: first-fit offsets in one arena */
    if (level >= 3) {
        int *order = malloc((size_t)nv * sizeof *order), nord = 0;
        if (!order) {
            free(need);
            st = KPL_ERROR(KPL_ENOMEM, "exec_create: no host memory");
            goto out;
        }
        for (int v = 0; v < ir->nv; v++)
            if (need[v] && ir->v[v].kind == KPL_IRV_OP) order[nord++] = v;
        /* largest first (then in order of definition): the big buffers
         * settle low and the small ones fill the gaps between them, which
         * leaves less unused than placing in order of definition */
        sized *by = malloc((size_t)(nord ? nord : 1) * sizeof *by);
        if (!by) {
            free(order);
            free(need);
            st = KPL_ERROR(KPL_ENOMEM, "exec_create: no host memory");
            goto out;
        }
        for (int k = 0; k < nord; k++) by[k] = (sized){need[order[k]], order[k]};
        qsort(by, (size_t)nord, sizeof *by, larger_first);
        for (int k = 0; k < nord; k++) order[k] = by[k].v;
        free(by);
        /* placeholders are written before the run: alive from the start */
        for (int k = 0; k < ir->ninputs; k++) {
            int v = ir->inputs[k];
            first[v] = -1;
            if (last_use[v] < 0) last_use[v] = -1;
        }
        size_t top = 0;
        for (int k = 0; k < ir->ninputs; k++) {
            offset[ir->inputs[k]] = top;
            top += need[ir->inputs[k]];
        }
        size_t total = top;
        for (int k = 0; k < nord; k++) {
            int v = order[k];
            size_t off = top, sz = need[v];
            /* the lowest gap among the placed values alive at the same time */
            for (bool moved = true; moved;) {
                moved = false;
                for (int j = 0; j < k; j++) {
                    int u = order[j];
                    if (last_use[u] < first[v] || first[u] > last_use[v]) continue;
                    if (offset[u] < off + sz && off < offset[u] + need[u]) {
                        off = offset[u] + need[u];
                        moved = true;
                    }
                }
            }
            offset[v] = off;
            if (off + sz > total) total = off + sz;
        }
        /* the lower bound: the most bytes alive at one node */
        for (int i = -1; i <= ir->nn; i++) {
            size_t live = 0;
            for (int k = 0; k < nord; k++)
                if (first[order[k]] <= i && last_use[order[k]] >= i) live += need[order[k]];
            for (int k = 0; k < ir->ninputs; k++) live += need[ir->inputs[k]];
            if (live > ex->stats.live_bytes) ex->stats.live_bytes = live;
        }
        free(order);
        st = kpl_storage_create(ex->dev, total ? total : 64, &ex->arena);
        ex->stats.arena_bytes = total;
    } else {
        for (int v = 0; v < ir->nv; v++) ex->stats.arena_bytes += need[v];
    }
    /* the tensors, once: roots get memory, views and in-place outputs are
     * headers on their root's storage */
    for (int v = 0; v < ir->nv && st == KPL_OK; v++) {
        const kpl_irv *val = &ir->v[v];
        if (val->kind == KPL_IRV_PARAM || val->kind == KPL_IRV_CONST) {
            kpl_tensor_retain(val->data);
            ex->t[v] = val->data;
            /* the graph's own constants never change: kernels may keep
             * derived copies (a convolution's reordered weights) */
            if (val->kind == KPL_IRV_CONST) kpl_tensor_set_constant(val->data, true);
            continue;
        }
        if (root[v] != v || !need[v]) continue;
        if (ex->arena) {
            kpl_storage *s = NULL;
            st = kpl_storage_sub(ex->arena, offset[v], value_bytes(val), &s);
            if (st == KPL_OK)
                st = kpl_tensor_from_storage(s, 0, val->dtype, val->ndim, val->shape, &ex->t[v]);
            kpl_storage_release(s);
        } else {
            st = kpl_tensor_empty(ex->dev, val->dtype, val->ndim, val->shape, &ex->t[v]);
        }
    }
    for (int i = 0; i < ir->nn && st == KPL_OK; i++) {
        const kpl_irn *n = &ir->n[i];
        int o = n->out[0];
        if (root[o] == o) continue;
        const kpl_irv *val = &ir->v[o];
        kpl_tensor *src = ex->t[n->in[0]];
        if (!src) {
            st = KPL_ERROR(KPL_EINVAL, "exec_create: node %d (%s) reads a value with no tensor", i,
                           kpl_op_name(n->op));
            break;
        }
        if (n->op == KPL_OP_NARROW) {
            st = kpl_tensor_narrow(src, n->at.start, n->at.length, &ex->t[o]);
            ex->stats.n_views++;
        } else if (n->op == KPL_OP_RESHAPE) {
            st = kpl_tensor_reshape(src, val->ndim, val->shape, &ex->t[o]);
            ex->stats.n_views++;
        } else { /* in place: the same storage and offset as the input */
            st = kpl_tensor_from_storage(kpl_tensor_storage(src), kpl_tensor_offset(src),
                                         val->dtype, val->ndim, val->shape, &ex->t[o]);
        }
    }
    for (int k = 0; k < ir->nupdates; k++)
        ex->upd_copy[k] = root[ir->upd_value[k]] != ir->upd_param[k];
    free(need);
out:
    free(chain);
    free(upd_of);
    free(last_use);
    free(root);
    free(first);
    free(offset);
    free(is_out);
    if (st < 0) {
        kpl_exec_destroy(ex);
        return st;
    }
    *out = ex;
    return KPL_OK;
}

kpl_status kpl_exec_set_input(kpl_exec *ex, int i, kpl_tensor *x)
{
    KPL_CHECK(ex && x, KPL_EINVAL, "exec_set_input: NULL argument");
    const kpl_ir *ir = ex->ir;
    KPL_CHECK(i >= 0 && i < ir->ninputs, KPL_ERANGE, "exec_set_input: input %d of %d", i,
              ir->ninputs);
    int v = ir->inputs[i];
    const kpl_irv *val = &ir->v[v];
    kpl_tensor *dst = ex->t[v];
    char b1[96], b2[96];
    KPL_CHECK(kpl_tensor_dtype(x) == val->dtype && kpl_tensor_ndim(x) == val->ndim &&
                  !memcmp(kpl_tensor_shape(x), val->shape, (size_t)val->ndim * sizeof(int64_t)),
              KPL_ESHAPE, "exec_set_input: input '%s' is %s %s, got %s %s",
              val->name ? val->name : "?", kpl_dtype_name(val->dtype),
              kpl_shape_str(val->ndim, val->shape, b1, sizeof b1),
              kpl_dtype_name(kpl_tensor_dtype(x)),
              kpl_shape_str(kpl_tensor_ndim(x), kpl_tensor_shape(x), b2, sizeof b2));
    if (!dst) return KPL_OK; /* the graph does not read it */
    return kpl_k_copy(dst, x);
}

kpl_status kpl_exec_run(kpl_exec *ex)
{
    KPL_CHECK(ex, KPL_EINVAL, "exec_run: NULL");
    const kpl_ir *ir = ex->ir;
    for (int i = 0; i < ir->nn; i++) {
        const kpl_irn *n = &ir->n[i];
        if (kpl__ir_is_view(n->op)) continue;
        kpl_tensor *in[KPL_IR_MAX_IN] = {0}, *out[KPL_IR_MAX_OUT] = {0};
        for (int j = 0; j < n->nin; j++) in[j] = n->in[j] >= 0 ? ex->t[n->in[j]] : NULL;
        for (int j = 0; j < n->nout; j++) out[j] = ex->t[n->out[j]];
        kpl_status st = kpl__ir_run_node(n, in, out);
        if (st < 0) return kpl__error_prefix(st, "graph node %d (%s): ", i, kpl_op_name(n->op));
    }
    for (int k = 0; k < ir->nupdates; k++) {
        if (!ex->upd_copy[k]) continue; /* computed in the parameter's bytes */
        kpl_status st = kpl_k_copy(ex->t[ir->upd_param[k]], ex->t[ir->upd_value[k]]);
        if (st < 0) return kpl__error_prefix(st, "graph update %d: ", k);
    }
    return KPL_OK;
}

kpl_tensor *kpl_exec_output(kpl_exec *ex, int i)
{
    if (!ex || i < 0 || i >= ex->ir->noutputs) {
        KPL_ERROR(KPL_ERANGE, "exec_output: output %d", i);
        return NULL;
    }
    return ex->t[ex->ir->outputs[i]];
}
