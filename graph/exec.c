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
#include <math.h>
#include <string.h>

/* ---- one node: op_table.h's run and infer columns ---- */

typedef kpl_status (*run_fn)(const kpl_irn *n, kpl_tensor *const *in, kpl_tensor *const *out);
typedef kpl_status (*infer_fn)(kpl__infer_ctx *c);

#define RUN_FN(f) kpl__op_run_##f
#define RUN_EW(f) kpl__op_run_##f
#define RUN_UN(k) NULL
#define RUN_UNA(k) NULL
#define RUN_BIN(k) NULL
#define RUN_BINS(k) NULL
#define RUN_RED(k) NULL
#define RUN_VIEW(k) NULL
#define RUN_NONE(k) NULL

static const run_fn run_fns[KPL_OP_COUNT] = {
#define KPL_X_(e, s, ar, at, ac, sv, run, ...) [KPL_OP_##e] = KPL_OP_PAIR(RUN_, run),
    KPL_OP_LIST(KPL_X_)
#undef KPL_X_
};

static const infer_fn infer_fns[KPL_OP_COUNT] = {
#define KPL_X_(e, s, ar, at, ac, sv, run, inf, ...) [KPL_OP_##e] = kpl__op_infer_##inf,
    KPL_OP_LIST(KPL_X_)
#undef KPL_X_
};

kpl_status kpl__ir_run_node(const kpl_irn *n, kpl_tensor *const *in, kpl_tensor *const *out)
{
    const kpl_op_attrs *a = &n->at;
    const kpl_op_info *r = kpl_op_info_of(n->op);
    switch (r->run) {
    case KPL_OP_RUN_UN:
    case KPL_OP_RUN_UNA: return kpl_k_unary(out[0], (kpl_unary_op)r->kernel, in[0], a->alpha, a->beta);
    case KPL_OP_RUN_BIN: return kpl_k_binary(out[0], (kpl_binary_op)r->kernel, in[0], in[1]);
    case KPL_OP_RUN_BINS:
        return kpl_k_binary_scalar(out[0], (kpl_binary_op)r->kernel, in[0], a->scalar,
                                   a->scalar_first);
    case KPL_OP_RUN_RED:
        return kpl_k_reduce(out[0], (kpl_reduce_op)r->kernel, in[0], a->naxes ? a->axes : NULL,
                            a->naxes, a->keepdim, a->correction);
    case KPL_OP_RUN_EW:
    case KPL_OP_RUN_FN: return run_fns[n->op](n, in, out);
    case KPL_OP_RUN_VIEW: return KPL_OK; /* made by the plan */
    case KPL_OP_RUN_NONE: break;
    }
    return KPL_ERROR(KPL_EINVAL, "graph: op '%s' cannot run in a graph", r->name);
}

kpl_status kpl__ir_infer(const kpl_ir *ir, const kpl_irn *n, int *nd,
                         int64_t (*sh)[KPL_MAX_DIMS], kpl_dtype *dt)
{
    const kpl_op_info *r = kpl_op_info_of(n->op);
    KPL_CHECK(r->run != KPL_OP_RUN_NONE, KPL_EINVAL, "op '%s' cannot run in a graph", r->name);
    KPL_CHECK(n->nin >= r->in_min && n->nin <= r->in_max && n->nout >= r->out_min &&
                  n->nout <= r->out_max,
              KPL_EINVAL, "'%s' has %d inputs and %d outputs (it takes %d to %d and makes %d to %d)",
              r->name, n->nin, n->nout, r->in_min, r->in_max, r->out_min, r->out_max);
    kpl__infer_ctx c = {.ir = ir, .n = n, .name = r->name, .o = &ir->v[n->out[0]],
                        .nd = nd, .sh = sh, .dt = dt};
    for (int i = 0; i < n->nin; i++) c.x[i] = n->in[i] >= 0 ? &ir->v[n->in[i]] : NULL;
    for (int i = 0; i < r->in_min; i++)
        KPL_CHECK(c.x[i], KPL_EINVAL, "'%s': input %d is absent", r->name, i);
    nd[0] = c.x[0]->ndim;
    memcpy(sh[0], c.x[0]->shape, sizeof sh[0]);
    dt[0] = c.x[0]->dtype;
    return infer_fns[n->op](&c);
}

/* ---- the executor ---- */

/* The layouts an inference executor times its graph with (kpl_exec_run):
 * each convolution's own choice, every convolution NHWC, every one
 * nChw16c. */
#define TRIALS 3
static const kpl_layout trial_layout[TRIALS] = {KPL_LAYOUT_AUTO, KPL_LAYOUT_NHWC,
                                                KPL_LAYOUT_NCHW16C};

struct kpl_exec {
    const kpl_ir *ir;
    kpl_device *dev;
    kpl_tensor **t;        /* per value: its tensor (owned), NULL for unused values */
    kpl_storage *arena;    /* O3 */
    bool *upd_copy;        /* per update: copied at the end (not computed in place) */
    kpl_exec_stats stats;
    /* kept-layout tuning (kpl_exec_run): runs so far, each candidate's
     * best timed run, and the layout settled on (-1: not tuned) */
    int runs;
    double trial_s[TRIALS], trial_total;
    bool tune;
    /* parameters this executor marked constant (frozen_params), unmarked
     * when it goes */
    int *frozen;
    int nfrozen;
};

kpl_exec_stats kpl_exec_get_stats(const kpl_exec *ex) { return ex->stats; }

void kpl_exec_destroy(kpl_exec *ex)
{
    if (!ex) return;
    for (int i = 0; i < ex->nfrozen; i++) kpl_tensor_set_constant(ex->t[ex->frozen[i]], false);
    free(ex->frozen);
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

/* The input node n may write its output over: input 0 of an element-wise
 * op, the addend (input 2) of the residual convolution; else -1. */
static int overwritable_input(const kpl_irn *n)
{
    if (kpl__ir_is_elementwise(n->op)) return 0;
    if (n->op == KPL_OP_CONV2D_ADD || n->op == KPL_OP_CONV2D_ADD_RELU) return 2;
    return -1;
}

/* Whether node n may write its output over that input (O2): with the
 * output's shape and dtype, an op value (or placeholder's copy) that no
 * later node reads and no output is.  A parameter's bytes are written only
 * along the chain that ends in its own update (chain[o] names the
 * parameter whose new value o leads to). */
static bool inplace_ok(const kpl_ir *ir, const kpl_irn *n, const int *last_use, const int *root,
                       const bool *is_out, const int *chain, int i)
{
    int k = overwritable_input(n);
    if (k < 0 || n->in[k] < 0) return false;
    int v = root[n->in[k]]; /* whose bytes that input is */
    const kpl_irv *x = &ir->v[n->in[k]], *o = &ir->v[n->out[0]];
    bool mine = ir->v[v].kind == KPL_IRV_OP || (ir->v[v].kind == KPL_IRV_PARAM && chain[n->out[0]] == v);
    if (!mine || is_out[v] || last_use[v] != i) return false;
    if (x->dtype != o->dtype || x->ndim != o->ndim ||
        memcmp(x->shape, o->shape, (size_t)x->ndim * sizeof(int64_t)))
        return false;
    /* no other input may be the same bytes */
    for (int j = 0; j < n->nin; j++)
        if (j != k && n->in[j] >= 0 && root[n->in[j]] == v) return false;
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

/* The memory plan's working state, per value (nv entries each). */
typedef struct {
    int nv;
    int *first, *last_use; /* node defining it (-1: before the run), last node reading it */
    int *root;             /* whose bytes it is (itself, the input of a view or in-place op) */
    bool *is_out;          /* read after the run: an output or a parameter's new value */
    int *chain;            /* the parameter whose new value it leads to in place, or -1 */
    int *upd_of;           /* the parameter it is the new value of, or -1 */
    size_t *need, *offset; /* bytes of a root; its offset in the arena (O3) */
} plan;

static void plan_free(plan *p)
{
    free(p->first);
    free(p->last_use);
    free(p->root);
    free(p->is_out);
    free(p->chain);
    free(p->upd_of);
    free(p->need);
    free(p->offset);
}

static kpl_status plan_alloc(const kpl_ir *ir, plan *p)
{
    size_t nv = (size_t)(ir->nv ? ir->nv : 1);
    *p = (plan){.nv = ir->nv};
    p->first = malloc(nv * sizeof *p->first);
    p->last_use = malloc(nv * sizeof *p->last_use);
    p->root = malloc(nv * sizeof *p->root);
    p->is_out = calloc(nv, sizeof *p->is_out);
    p->chain = malloc(nv * sizeof *p->chain);
    p->upd_of = malloc(nv * sizeof *p->upd_of);
    p->need = calloc(nv, sizeof *p->need);
    p->offset = calloc(nv, sizeof *p->offset);
    if (p->first && p->last_use && p->root && p->is_out && p->chain && p->upd_of && p->need &&
        p->offset)
        return KPL_OK;
    plan_free(p);
    *p = (plan){0};
    return KPL_ERROR(KPL_ENOMEM, "exec_create: no host memory");
}

/* A parameter's new value is read at the end of the run, like an output;
 * the element-wise ops leading to it from the parameter's own value may
 * write over the parameter (O2): chain marks them. */
static void plan_update_chains(const kpl_ir *ir, plan *p)
{
    for (int v = 0; v < ir->nv; v++) p->chain[v] = p->upd_of[v] = -1;
    for (int k = 0; k < ir->nupdates; k++) p->upd_of[ir->upd_value[k]] = ir->upd_param[k];
    for (int k = 0; k < ir->nupdates; k++) {
        int prm = ir->upd_param[k], v = ir->upd_value[k];
        p->is_out[v] = true;
        int path[64], np = 0;
        while (v >= 0 && v != prm && np < 64 && ir->v[v].kind == KPL_IRV_OP) {
            const kpl_irn *n = &ir->n[ir->v[v].node];
            if (!kpl__ir_is_elementwise(n->op)) break;
            /* another parameter's new value is not computed in prm's bytes */
            if (p->upd_of[v] >= 0 && p->upd_of[v] != prm) break;
            path[np++] = v;
            v = n->in[0];
        }
        if (v == prm)
            for (int j = 0; j < np; j++) p->chain[path[j]] = prm;
    }
}

/* Liveness: each value's first definition and last use (node index); a
 * view's bytes are its root's, so uses of a view extend the root. */
static void plan_liveness(const kpl_ir *ir, plan *p)
{
    for (int v = 0; v < ir->nv; v++) {
        p->root[v] = v;
        p->first[v] = ir->v[v].kind == KPL_IRV_OP ? ir->v[v].node : -1;
        p->last_use[v] = p->first[v];
    }
    for (int i = 0; i < ir->noutputs; i++) p->is_out[ir->outputs[i]] = true;
    plan_update_chains(ir, p);
    for (int i = 0; i < ir->nn; i++) {
        const kpl_irn *n = &ir->n[i];
        if (kpl__ir_is_view(n->op)) p->root[n->out[0]] = p->root[n->in[0]];
    }
    for (int i = 0; i < ir->nn; i++) {
        const kpl_irn *n = &ir->n[i];
        for (int j = 0; j < n->nin; j++)
            if (n->in[j] >= 0) p->last_use[p->root[n->in[j]]] = i;
    }
    for (int v = 0; v < ir->nv; v++)
        if (p->is_out[v]) {
            p->last_use[p->root[v]] = ir->nn;
            p->is_out[p->root[v]] = true;
        }
}

/* O2: in place — the output takes its input's bytes (a view of them). */
static void plan_inplace(const kpl_ir *ir, plan *p, kpl_exec_stats *stats)
{
    for (int i = 0; i < ir->nn; i++) {
        const kpl_irn *n = &ir->n[i];
        if (!inplace_ok(ir, n, p->last_use, p->root, p->is_out, p->chain, i)) continue;
        int x = p->root[n->in[overwritable_input(n)]], o = n->out[0];
        p->root[o] = x;
        /* every later view of o follows it to x */
        for (int k = i + 1; k < ir->nn; k++)
            if (kpl__ir_is_view(ir->n[k].op) && p->root[ir->n[k].in[0]] == x)
                p->root[ir->n[k].out[0]] = x;
        p->last_use[x] = p->last_use[o];
        p->is_out[x] = p->is_out[o];
        stats->n_inplace++;
    }
}

/* The bytes each root needs. */
static void plan_need(const kpl_ir *ir, plan *p, kpl_exec_stats *stats)
{
    /* max pooling's indices that nothing reads are not computed (the CPU
     * kernel then skips them) */
    for (int i = 0; i < ir->nn; i++)
        if (ir->n[i].op == KPL_OP_MAX_POOL2D && ir->n[i].nout > 1 &&
            p->last_use[ir->n[i].out[1]] == i && !p->is_out[ir->n[i].out[1]])
            p->root[ir->n[i].out[1]] = -1;
    for (int v = 0; v < ir->nv; v++) {
        const kpl_irv *val = &ir->v[v];
        if (val->kind == KPL_IRV_OP) stats->value_bytes += value_bytes(val);
        if (val->kind == KPL_IRV_INPUT ||
            (val->kind == KPL_IRV_OP && val->node >= 0 && p->root[v] == v))
            p->need[v] = value_bytes(val) ? align_up(value_bytes(val)) : 64; /* empty ones too */
    }
}

/* The op values that need bytes, largest first (then in order of
 * definition): the big buffers settle low and the small ones fill the gaps
 * between them, which leaves less unused than placing in order of
 * definition.  Returns the count, -1 when out of memory. */
static int plan_order(const kpl_ir *ir, const plan *p, int *order)
{
    int nord = 0;
    for (int v = 0; v < ir->nv; v++)
        if (p->need[v] && ir->v[v].kind == KPL_IRV_OP) order[nord++] = v;
    sized *by = malloc((size_t)(nord ? nord : 1) * sizeof *by);
    if (!by) return -1;
    for (int k = 0; k < nord; k++) by[k] = (sized){p->need[order[k]], order[k]};
    qsort(by, (size_t)nord, sizeof *by, larger_first);
    for (int k = 0; k < nord; k++) order[k] = by[k].v;
    free(by);
    return nord;
}

/* O3: first-fit offsets in one arena; returns its size. */
static size_t plan_first_fit(const kpl_ir *ir, plan *p, const int *order, int nord,
                             kpl_exec_stats *stats)
{
    /* placeholders are written before the run: alive from the start */
    size_t top = 0;
    for (int k = 0; k < ir->ninputs; k++) {
        int v = ir->inputs[k];
        p->first[v] = -1;
        if (p->last_use[v] < 0) p->last_use[v] = -1;
        p->offset[v] = top;
        top += p->need[v];
    }
    size_t total = top;
    for (int k = 0; k < nord; k++) {
        int v = order[k];
        size_t off = top, sz = p->need[v];
        /* the lowest gap among the placed values alive at the same time */
        for (bool moved = true; moved;) {
            moved = false;
            for (int j = 0; j < k; j++) {
                int u = order[j];
                if (p->last_use[u] < p->first[v] || p->first[u] > p->last_use[v]) continue;
                if (p->offset[u] < off + sz && off < p->offset[u] + p->need[u]) {
                    off = p->offset[u] + p->need[u];
                    moved = true;
                }
            }
        }
        p->offset[v] = off;
        if (off + sz > total) total = off + sz;
    }
    /* the lower bound: the most bytes alive at one node */
    for (int i = -1; i <= ir->nn; i++) {
        size_t live = 0;
        for (int k = 0; k < nord; k++)
            if (p->first[order[k]] <= i && p->last_use[order[k]] >= i) live += p->need[order[k]];
        for (int k = 0; k < ir->ninputs; k++) live += p->need[ir->inputs[k]];
        if (live > stats->live_bytes) stats->live_bytes = live;
    }
    return total;
}

/* The arena (O3) or the sum of the separate storages. */
static kpl_status plan_memory(kpl_exec *ex, plan *p)
{
    const kpl_ir *ir = ex->ir;
    if (ir->level < 3) {
        for (int v = 0; v < ir->nv; v++) ex->stats.arena_bytes += p->need[v];
        return KPL_OK;
    }
    int *order = malloc((size_t)(ir->nv ? ir->nv : 1) * sizeof *order);
    int nord = order ? plan_order(ir, p, order) : -1;
    if (nord < 0) {
        free(order);
        return KPL_ERROR(KPL_ENOMEM, "exec_create: no host memory");
    }
    size_t total = plan_first_fit(ir, p, order, nord, &ex->stats);
    free(order);
    ex->stats.arena_bytes = total;
    return kpl_storage_create(ex->dev, total ? total : 64, &ex->arena);
}

/* The tensors, once: roots get memory, views and in-place outputs are
 * headers on their root's storage. */
static kpl_status plan_tensors(kpl_exec *ex, const plan *p)
{
    const kpl_ir *ir = ex->ir;
    kpl_status st = KPL_OK;
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
        if (p->root[v] != v || !p->need[v]) continue;
        if (ex->arena) {
            kpl_storage *s = NULL;
            st = kpl_storage_sub(ex->arena, p->offset[v], value_bytes(val), &s);
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
        if (p->root[o] == o) continue;
        const kpl_irv *val = &ir->v[o];
        /* a view's input, or the input an in-place op writes over */
        kpl_tensor *src = ex->t[n->in[kpl__ir_is_view(n->op) ? 0 : overwritable_input(n)]];
        KPL_CHECK(src, KPL_EINVAL, "exec_create: node %d (%s) reads a value with no tensor", i,
                  kpl_op_name(n->op));
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
    for (int k = 0; k < ir->nupdates && st == KPL_OK; k++)
        ex->upd_copy[k] = p->root[ir->upd_value[k]] != ir->upd_param[k];
    return st;
}

static kpl_status frozen_params(kpl_exec *ex);

kpl_status kpl_exec_create(const kpl_ir *ir, kpl_exec **out)
{
    KPL_CHECK(ir && out, KPL_EINVAL, "exec_create: NULL argument");
    *out = NULL;
    KPL_TRY(kpl_ir_check(ir));
    kpl_exec *ex = calloc(1, sizeof *ex);
    KPL_CHECK(ex, KPL_ENOMEM, "exec_create: no host memory");
    ex->ir = ir;
    ex->stats.kept_layout = -1;
    for (int i = 0; i < TRIALS; i++) ex->trial_s[i] = HUGE_VAL;
    ex->dev = kpl_device_cpu();
    for (int v = 0; v < ir->nv; v++)
        if (ir->v[v].data) {
            ex->dev = kpl_tensor_device(ir->v[v].data);
            break;
        }
    ex->t = calloc((size_t)(ir->nv ? ir->nv : 1), sizeof *ex->t);
    ex->upd_copy = calloc((size_t)(ir->nupdates ? ir->nupdates : 1), sizeof *ex->upd_copy);
    plan p = {0};
    kpl_status st = ex->t && ex->upd_copy ? plan_alloc(ir, &p)
                                          : KPL_ERROR(KPL_ENOMEM, "exec_create: no host memory");
    if (st == KPL_OK) {
        plan_liveness(ir, &p);
        if (ir->level >= 2) plan_inplace(ir, &p, &ex->stats);
        plan_need(ir, &p, &ex->stats);
        st = plan_memory(ex, &p);
    }
    if (st == KPL_OK) st = plan_tensors(ex, &p);
    if (st == KPL_OK) st = frozen_params(ex);
    plan_free(&p);
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

/* Kept-layout tuning.  Which layout the CPU convolutions keep is timed
 * per convolution (kpl_set_kept_layout's KPL_LAYOUT_AUTO), link by link;
 * the whole graph can run faster with every convolution in NHWC (ResNet-18
 * at batch 1, U-Net) or in nChw16c (ResNet-50 at batch 32, where
 * Winograd's 3x3 kernels compute in nChw16c and the links around them
 * chose NHWC: 474-479 ms against 511-538: docs/static-graph.md), which no
 * single convolution sees.  So an inference executor on the CPU
 * (no weight gradients, no updates: a training graph stays bit-identical
 * to eager mode; a transposed convolution's conv2d_bwd_data is inference),
 * with the process's setting AUTO and not deterministic, runs its graph
 * each way (trial_layout):
 * in blocks of three runs, AUTO, NHWC, then nChw16c, the first run of a
 * block untimed (it pays the algorithms' choice, and the weights' reorder
 * into the layout's kernels, which each constant weight keeps one of), a
 * round of blocks at least, more while the timed runs have taken under
 * TUNE_SECONDS (a small graph's runs are noisy), TUNE_RUNS in all at most;
 * from then on the layout with the fastest run holds
 * (kpl_exec_stats.kept_layout). */
#define TUNE_RUNS 27
#define TUNE_SECONDS 0.2

/* No updates and no weight gradients: a graph that only reads its
 * parameters. */
static bool inference(const kpl_ir *ir)
{
    for (int i = 0; i < ir->nn; i++)
        if (ir->n[i].op == KPL_OP_CONV2D_BWD_WEIGHT) return false; /* a gradient graph */
    return ir->nupdates == 0;
}

static bool tunable(const kpl_exec *ex)
{
    if (kpl_device_type_of(ex->dev) != KPL_DEVICE_CPU || kpl_get_deterministic() ||
        kpl_get_kept_layout() != KPL_LAYOUT_AUTO || !inference(ex->ir))
        return false;
    bool conv = false;
    for (int i = 0; i < ex->ir->nn; i++) {
        kpl_op op = ex->ir->n[i].op;
        conv |= op == KPL_OP_CONV2D || op == KPL_OP_CONV2D_RELU || op == KPL_OP_CONV2D_ADD ||
                op == KPL_OP_CONV2D_ADD_RELU || op == KPL_OP_CONV2D_BWD_DATA;
    }
    return conv;
}

/* An inference graph's parameters are marked constant while its executor
 * lives, as its own constants are (plan_tensors): the CPU convolutions then
 * keep their weights reordered into their kernels' layout instead of
 * reordering them at every run (the weights no batch norm was folded into:
 * U-Net's transposed convolutions and its logits, 5% of a batch-1 pass).
 * A write through any accessor drops the reordered copy (kernels_impl.h),
 * so an update made between runs (an optimizer's step, a checkpoint load)
 * still shows; a parameter already constant is left as it is. */
static kpl_status frozen_params(kpl_exec *ex)
{
    const kpl_ir *ir = ex->ir;
    if (!inference(ir)) return KPL_OK;
    ex->frozen = malloc((size_t)(ir->nv ? ir->nv : 1) * sizeof *ex->frozen);
    KPL_CHECK(ex->frozen, KPL_ENOMEM, "exec_create: no host memory");
    for (int v = 0; v < ir->nv; v++) {
        kpl_tensor *t = ex->t[v];
        if (ir->v[v].kind != KPL_IRV_PARAM || !t || kpl_tensor_constant(t)) continue;
        kpl_tensor_set_constant(t, true);
        ex->frozen[ex->nfrozen++] = v;
    }
    return KPL_OK;
}

static kpl_status run_nodes(kpl_exec *ex);

kpl_status kpl_exec_run(kpl_exec *ex)
{
    KPL_CHECK(ex, KPL_EINVAL, "exec_run: NULL");
    if (ex->runs == 0) ex->tune = tunable(ex);
    if (!ex->tune) return run_nodes(ex);
    bool tuning = ex->stats.kept_layout < 0;
    int r = ex->runs, trial = r / 3 % TRIALS;
    kpl_layout use = tuning ? trial_layout[trial] : (kpl_layout)ex->stats.kept_layout;
    int prev = kpl_set_thread_kept_layout(use);
    double t0 = kpl_seconds();
    kpl_status st = run_nodes(ex);
    double dt = kpl_seconds() - t0;
    kpl_set_thread_kept_layout(prev);
    if (st < 0 || !tuning) return st;
    ex->runs++;
    if (r % 3 == 0) return KPL_OK; /* a block's warm-up */
    if (dt < ex->trial_s[trial]) ex->trial_s[trial] = dt;
    ex->trial_total += dt;
    if (ex->runs % (3 * TRIALS) == 0 &&
        (ex->trial_total >= TUNE_SECONDS || ex->runs >= TUNE_RUNS)) {
        int best = 0;
        for (int i = 1; i < TRIALS; i++)
            if (ex->trial_s[i] < ex->trial_s[best]) best = i;
        ex->stats.kept_layout = trial_layout[best];
    }
    return KPL_OK;
}

static kpl_status run_nodes(kpl_exec *ex)
{
    const kpl_ir *ir = ex->ir;
    for (int i = 0; i < ir->nn; i++) {
        const kpl_irn *n = &ir->n[i];
        if (kpl__ir_is_view(n->op)) continue;
        kpl_tensor *in[KPL_IR_MAX_IN] = {0}, *out[KPL_IR_MAX_OUT] = {0};
        for (int j = 0; j < n->nin; j++) in[j] = n->in[j] >= 0 ? ex->t[n->in[j]] : NULL;
        for (int j = 0; j < n->nout; j++) out[j] = ex->t[n->out[j]];
        kpl_status st = kpl__ir_run_node(n, in, out);
        if (st < 0) return kpl_error_prefix(st, "graph node %d (%s): ", i, kpl_op_name(n->op));
    }
    for (int k = 0; k < ir->nupdates; k++) {
        if (!ex->upd_copy[k]) continue; /* computed in the parameter's bytes */
        kpl_status st = kpl_k_copy(ex->t[ir->upd_param[k]], ex->t[ir->upd_value[k]]);
        if (st < 0) return kpl_error_prefix(st, "graph update %d: ", k);
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
