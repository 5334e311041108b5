/*
 * tape.c — autorelease pools, grad mode, per-tensor graph data and the
 * recorded nodes.
 *
 * Ownership: a recorded result's meta holds a reference to the node that
 * produced it; a node holds references to the nodes of its inputs (its
 * edges), to its parameter inputs, and to aliases of the tensors its
 * gradient needs.  Nothing points back down, so there are no cycles: when
 * the last result of a step is released, its nodes go with it.  A saved
 * input is the input itself (upstream: no cycle).  A saved output is an
 * alias (a new header on the same storage) whose link to its node is weak:
 * the node owns the alias, so the alias cannot outlive it, and gradients
 * computed from it with create_graph still reach the node.
 */
#include "graph_impl.h"
#include "ir_impl.h"

#include <stdlib.h>
#include <string.h>

/* ---- per-thread state ----------------------------------------------------------- */

struct kpl_pool {
    kpl_tensor **items;
    size_t n, cap;
    kpl_pool *outer;
};

static _Thread_local kpl_pool *tl_pool;
static _Thread_local bool tl_grad_off; /* grad mode is on by default */
/* regeneration: 0 the process's default (KPL_REGENERATE), 1 on, 2 off */
static _Thread_local int tl_regen;

bool kpl_grad_enabled(void) { return !tl_grad_off; }

bool kpl_set_grad_enabled(bool on)
{
    bool prev = !tl_grad_off;
    tl_grad_off = !on;
    return prev;
}

kpl_pool *kpl_pool_push(void)
{
    kpl_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->outer = tl_pool;
    tl_pool = p;
    return p;
}

static void pool_drain_one(kpl_pool *p)
{
    /* Release newest first: results die before the inputs they depend on,
     * which keeps the allocator's LIFO order. */
    for (size_t i = p->n; i-- > 0;) kpl_tensor_release(p->items[i]);
    free(p->items);
    free(p);
}

void kpl_pool_pop(kpl_pool *pool)
{
    if (!pool) return;
    /* Close inner pools left open, then this one. */
    while (tl_pool && tl_pool != pool) {
        kpl_pool *inner = tl_pool;
        tl_pool = inner->outer;
        pool_drain_one(inner);
    }
    if (tl_pool == pool) tl_pool = pool->outer;
    pool_drain_one(pool);
}

size_t kpl_pool_count(const kpl_pool *pool) { return pool ? pool->n : 0; }

kpl_tensor *kpl_autorelease(kpl_tensor *t)
{
    if (!t) return NULL;
    kpl_pool *p = tl_pool;
    if (!p) {
        kpl_tensor_release(t);
        KPL_ERROR(KPL_ESTATE, "autorelease: no pool is open on this thread (open one with "
                              "kpl_pool_push around the ops)");
        return NULL;
    }
    if (p->n == p->cap) {
        size_t ncap = p->cap ? p->cap * 2 : 64;
        kpl_tensor **ni = realloc(p->items, ncap * sizeof *ni);
        if (!ni) {
            kpl_tensor_release(t);
            KPL_ERROR(KPL_ENOMEM, "autorelease: no host memory for the pool");
            return NULL;
        }
        p->items = ni;
        p->cap = ncap;
    }
    p->items[p->n++] = t;
    return t;
}

/* ---- tensor meta ------------------------------------------------------------------ */

static void meta_free(void *m)
{
    kpl__tmeta *tm = m;
    kpl_tensor_release(tm->grad);
    if (!tm->node_weak && tm->node && tm->node->live_meta == tm)
        tm->node->live_out = NULL, tm->node->live_meta = NULL; /* a regenerable output goes */
    if (!tm->node_weak) kpl_node_release(tm->node);
    free(tm->hooks);
    free(tm);
}

kpl__tmeta *kpl__graph_meta(kpl_tensor *t, bool create)
{
    kpl__tmeta *m = kpl_tensor_meta(t);
    if (m || !create) return m;
    m = calloc(1, sizeof *m);
    if (!m) return NULL;
    kpl_tensor_set_meta(t, m, meta_free);
    return m;
}

kpl_status kpl_set_requires_grad(kpl_tensor *t, bool on)
{
    KPL_CHECK(t != NULL, KPL_EINVAL, "set_requires_grad: NULL tensor");
    kpl__tmeta *m = kpl__graph_meta(t, on);
    if (!m) {
        KPL_CHECK(!on, KPL_ENOMEM, "set_requires_grad: no host memory");
        return KPL_OK;
    }
    KPL_CHECK(!m->node, KPL_EINVAL,
              "set_requires_grad: the tensor is the result of '%s', not a leaf; only leaves "
              "(parameters) can be marked",
              kpl_op_name(m->node->op));
    KPL_CHECK(!on || kpl_dtype_is_float(kpl_tensor_dtype(t)), KPL_EDTYPE,
              "set_requires_grad: dtype %s cannot have gradients (float dtypes only)",
              kpl_dtype_name(kpl_tensor_dtype(t)));
    m->requires_grad = on;
    return KPL_OK;
}

bool kpl_requires_grad(const kpl_tensor *t)
{
    const kpl__tmeta *m = t ? kpl_tensor_meta(t) : NULL;
    return m && m->requires_grad;
}

kpl_tensor *kpl_grad_get(const kpl_tensor *t)
{
    const kpl__tmeta *m = t ? kpl_tensor_meta(t) : NULL;
    return m ? m->grad : NULL;
}

void kpl_grad_set(kpl_tensor *t, kpl_tensor *g)
{
    kpl__tmeta *m = kpl__graph_meta(t, g != NULL);
    if (!m) return;
    kpl_tensor_retain(g);
    kpl_tensor_release(m->grad);
    m->grad = g;
    m->grad_buffer = false;
}

kpl_status kpl_grad_set_buffer(kpl_tensor *t, kpl_tensor *buf)
{
    KPL_CHECK(t && buf, KPL_EINVAL, "grad_set_buffer: NULL argument");
    char b1[96], b2[96];
    KPL_CHECK(kpl_tensor_numel(buf) == kpl_tensor_numel(t) &&
                  kpl_tensor_dtype(buf) == kpl_tensor_dtype(t) &&
                  kpl_tensor_device(buf) == kpl_tensor_device(t),
              KPL_ESHAPE, "grad_set_buffer: buffer %s %s on %s does not fit parameter %s %s on %s",
              kpl_shape_str(kpl_tensor_ndim(buf), kpl_tensor_shape(buf), b1, sizeof b1),
              kpl_dtype_name(kpl_tensor_dtype(buf)), kpl_device_name(kpl_tensor_device(buf)),
              kpl_shape_str(kpl_tensor_ndim(t), kpl_tensor_shape(t), b2, sizeof b2),
              kpl_dtype_name(kpl_tensor_dtype(t)), kpl_device_name(kpl_tensor_device(t)));
    kpl_grad_set(t, buf);
    kpl__tmeta *m = kpl__graph_meta(t, true);
    KPL_CHECK(m, KPL_ENOMEM, "grad_set_buffer: no host memory");
    m->grad_buffer = true;
    return KPL_OK;
}

bool kpl_grad_is_buffer(const kpl_tensor *t)
{
    const kpl__tmeta *m = t ? kpl_tensor_meta(t) : NULL;
    return m && m->grad && m->grad_buffer;
}

/* ---- hooks ------------------------------------------------------------------------ */

/* The hook set a tensor's hooks go to: its node's for a result, its own
 * for a parameter. */
static kpl_status hook_set(kpl_tensor *t, kpl_hooks **out)
{
    KPL_CHECK(t != NULL, KPL_EINVAL, "add_hook: NULL tensor");
    kpl__tmeta *m = kpl_tensor_meta(t);
    KPL_CHECK(m && m->requires_grad, KPL_EINVAL,
              "add_hook: the tensor does not require grad, no gradient will reach it");
    kpl_hooks **slot = m->node ? &m->node->hooks : &m->hooks;
    if (!*slot) *slot = calloc(1, sizeof **slot);
    KPL_CHECK(*slot != NULL, KPL_ENOMEM, "add_hook: no host memory");
    *out = *slot;
    return KPL_OK;
}

kpl_status kpl_add_grad_hook(kpl_tensor *t, kpl_grad_hook fn, void *user)
{
    kpl_hooks *h = NULL;
    KPL_TRY(hook_set(t, &h));
    KPL_CHECK(h->n_grad < 8, KPL_ERANGE, "add_grad_hook: at most 8 hooks per tensor");
    h->grad[h->n_grad] = fn;
    h->grad_user[h->n_grad++] = user;
    return KPL_OK;
}

kpl_status kpl_add_ready_hook(kpl_tensor *param, kpl_ready_hook fn, void *user)
{
    KPL_CHECK(param && !kpl_tensor_node(param, NULL), KPL_EINVAL,
              "add_ready_hook: ready hooks are for parameters (leaves)");
    kpl_hooks *h = NULL;
    KPL_TRY(hook_set(param, &h));
    KPL_CHECK(h->n_ready < 8, KPL_ERANGE, "add_ready_hook: at most 8 hooks per tensor");
    h->ready[h->n_ready] = fn;
    h->ready_user[h->n_ready++] = user;
    return KPL_OK;
}

void kpl_clear_hooks(kpl_tensor *t)
{
    kpl__tmeta *m = t ? kpl_tensor_meta(t) : NULL;
    if (!m) return;
    kpl_hooks **slot = m->node ? &m->node->hooks : &m->hooks;
    free(*slot);
    *slot = NULL;
}

const kpl_hooks *kpl_tensor_hooks(const kpl_tensor *t)
{
    const kpl__tmeta *m = t ? kpl_tensor_meta(t) : NULL;
    return m ? m->hooks : NULL;
}

const kpl_hooks *kpl_node_hooks(const kpl_node *n) { return n ? n->hooks : NULL; }

/* ---- nodes ------------------------------------------------------------------------ */

kpl_node *kpl_tensor_node(const kpl_tensor *t, int *out_index)
{
    const kpl__tmeta *m = t ? kpl_tensor_meta(t) : NULL;
    if (out_index) *out_index = m ? m->out_index : 0;
    return m ? m->node : NULL;
}

void kpl_node_retain(kpl_node *n)
{
    if (n) atomic_fetch_add_explicit(&n->refcount, 1, memory_order_relaxed);
}

/* ---- the memory profile's notes (kpl_memrec) ---------------------------------- */

/* "op @ context": the op and the module (or backward step) it ran in. */
static uint32_t op_label(const char *prefix, kpl_op op)
{
    char buf[320];
    const char *ctx = kpl_mem_label_text(kpl_mem_context());
    snprintf(buf, sizeof buf, "%s%s @ %s", prefix, kpl_op_name(op), *ctx ? ctx : "(no module)");
    return kpl_mem_label(buf);
}

void kpl__mem_note_op(kpl_op op, const kpl_tensor *out)
{
    if (kpl_memrec_active()) kpl_memrec_note_tensor(out, KPL_MEMNOTE_CREATOR, op_label("", op));
}

static uint32_t saved_label(const kpl_node *n)
{
    char buf[340];
    snprintf(buf, sizeof buf, "saved for backward by %s", kpl_mem_label_text(n->mem_label));
    return kpl_mem_label(buf);
}

/* The tensors a node keeps for the gradient: held (hold) or let go. */
static void note_saved(const kpl_node *n, bool hold)
{
    if (!kpl_memrec_active() || !n->mem_label) return;
    uint32_t l = saved_label(n);
    kpl_memnote k = hold ? KPL_MEMNOTE_HOLD : KPL_MEMNOTE_RELEASE;
    for (int i = 0; i < n->nin; i++) kpl_memrec_note_tensor(n->in[i].saved, k, l);
    kpl_memrec_note_tensor(n->saved_out, k, l);
}

void kpl__note_saved_tensor(const kpl_node *n, const kpl_tensor *t, bool hold)
{
    if (!kpl_memrec_active() || !n->mem_label || !t) return;
    kpl_memrec_note_tensor(t, hold ? KPL_MEMNOTE_HOLD : KPL_MEMNOTE_RELEASE, saved_label(n));
}

uint32_t kpl_node_backward_mem_label(const kpl_node *n)
{
    if (!kpl_memrec_active() || !n->mem_label) return 0;
    char buf[340];
    snprintf(buf, sizeof buf, "backward of %s", kpl_mem_label_text(n->mem_label));
    return kpl_mem_label(buf);
}

void kpl_node_free_saved(kpl_node *n)
{
    if (!n->freed) note_saved(n, false);
    for (int i = 0; i < n->nin; i++) {
        kpl_tensor_release(n->in[i].saved);
        n->in[i].saved = NULL;
    }
    kpl_tensor_release(n->saved_out);
    n->saved_out = NULL;
    n->freed = true;
}

void kpl_node_release(kpl_node *n)
{
    /* Iterative over the chain of single producers, so releasing a long
     * graph does not recurse once per node. */
    while (n) {
        if (atomic_fetch_sub_explicit(&n->refcount, 1, memory_order_acq_rel) != 1) return;
        kpl_node_free_saved(n);
        if (n->region) kpl__recompute_forget(n);
        free(n->hooks);
        kpl_node *next = NULL;
        for (int i = 0; i < n->nin; i++) {
            kpl_tensor_release(n->in[i].leaf);
            if (!next) next = n->in[i].node;
            else kpl_node_release(n->in[i].node);
        }
        free(n);
        n = next;
    }
}

kpl_op kpl_node_op(const kpl_node *n) { return n->op; }
const kpl_op_attrs *kpl_node_attrs(const kpl_node *n) { return &n->attrs; }
int kpl_node_num_inputs(const kpl_node *n) { return n->nin; }

kpl_node *kpl_node_input_node(const kpl_node *n, int i, int *out_index)
{
    if (out_index) *out_index = n->in[i].out_index;
    return n->in[i].node;
}

kpl_tensor *kpl_node_input_leaf(const kpl_node *n, int i) { return n->in[i].leaf; }
bool kpl_node_input_requires_grad(const kpl_node *n, int i) { return n->in[i].requires_grad; }

int kpl_node_input_shape(const kpl_node *n, int i, int64_t *shape)
{
    memcpy(shape, n->in[i].shape, sizeof n->in[i].shape);
    return n->in[i].ndim;
}

kpl_dtype kpl_node_input_dtype(const kpl_node *n, int i) { return n->in[i].dtype; }

int kpl_node_output_shape(const kpl_node *n, int64_t *shape)
{
    memcpy(shape, n->out_shape, sizeof n->out_shape);
    return n->out_ndim;
}

kpl_tensor *kpl_node_saved_input(const kpl_node *n, int i) { return n->in[i].saved; }
kpl_tensor *kpl_node_saved_output(const kpl_node *n) { return n->saved_out; }
bool kpl_node_saved_freed(const kpl_node *n) { return n->freed; }

/* An alias of t: same storage and shape, a header of its own without meta. */
static kpl_status alias(kpl_tensor *t, kpl_tensor **out)
{
    return kpl_tensor_reshape(t, kpl_tensor_ndim(t), kpl_tensor_shape(t), out);
}

kpl_status kpl__node_save_output(kpl_node *n, kpl_tensor *out)
{
    kpl_tensor *a = NULL;
    KPL_TRY(alias(out, &a));
    kpl__trace_alias(a, out); /* the same value in a trace */
    kpl__tmeta *am = kpl__graph_meta(a, true);
    if (!am) {
        kpl_tensor_release(a);
        return KPL_ERROR(KPL_ENOMEM, "%s: no host memory for the graph", kpl_op_name(n->op));
    }
    am->requires_grad = true;
    am->node = n;
    am->node_weak = true;
    am->out_index = 0;
    n->saved_out = a;
    return KPL_OK;
}

/* ---- outputs made again in the backward (kpl_set_regenerate) ------------------------- */

/* KPL_REGENERATE=0 turns it off for a process's threads that do not set it
 * themselves (benchmarks compare the two). */
static bool regen_default(void)
{
    static atomic_int d = -1;
    int v = atomic_load_explicit(&d, memory_order_relaxed);
    if (v < 0) {
        v = kpl_env_switch("KPL_REGENERATE", true);
        atomic_store_explicit(&d, v, memory_order_relaxed);
    }
    return v;
}

bool kpl_regenerate_enabled(void)
{
    return tl_regen ? tl_regen == 1 : regen_default();
}

bool kpl_set_regenerate(bool on)
{
    bool prev = kpl_regenerate_enabled();
    tl_regen = on ? 1 : 2;
    return prev;
}

static bool is_norm(kpl_op op)
{
    return op == KPL_OP_BATCH_NORM || op == KPL_OP_BATCH_NORM_RELU || op == KPL_OP_GROUP_NORM;
}

/* ReLU and leaky ReLU (a slope >= 0: the recorded op), on a norm's output */
static bool is_activation(kpl_op op)
{
    return op == KPL_OP_RELU || op == KPL_OP_LEAKY_RELU;
}

/* Whether the node being recorded (inputs ins) can make its output again
 * from what it keeps: a norm, from its input and parameters (kept whole);
 * a (leaky) ReLU, from a norm's output that is itself regenerable. */
static bool regenerable(const kpl_node *n, kpl_tensor *const *ins)
{
    if (is_norm(n->op)) {
        if (n->nin != 3 || n->in[0].regen) return false;
        for (int i = 0; i < 3; i++)
            if (!ins[i] || kpl_tensor_device(ins[i]) != kpl_tensor_device(ins[0])) return false;
        kpl_dtype dt = kpl_tensor_dtype(ins[0]);
        return dt == KPL_F32 || dt == KPL_F64 || dt == KPL_BF16 || dt == KPL_F16;
    }
    if (is_activation(n->op)) {
        const kpl__tmeta *m = kpl_tensor_meta(ins[0]);
        return m && m->node && !m->node_weak && m->out_index == 0 && m->node->regenerable &&
               m->node->op != KPL_OP_BATCH_NORM_RELU;
    }
    return false;
}

/* A new tensor holding what p's output was in the forward, made again from
 * what p keeps; p's region is recomputed first if it let go of them. */
static kpl_tensor *remake(kpl_node *p, bool keep_graph)
{
    if (kpl_node_restore_saved(p, keep_graph) < 0) return NULL;
    if (p->freed) {
        KPL_ERROR(KPL_ESTATE,
                  "backward: '%s' must make its output again, but its gradient has "
                  "already run and let go of its input",
                  kpl_op_name(p->op));
        return NULL;
    }
    kpl_tensor *x = is_activation(p->op) ? NULL : p->in[0].saved;
    kpl_tensor *y = NULL;
    kpl_status st = KPL_OK;
    if (is_activation(p->op)) {
        kpl_unary_op u = p->op == KPL_OP_RELU ? KPL_UN_RELU : KPL_UN_LEAKY_RELU;
        /* from the norm's output: kept there if another op asked for it,
         * or still alive, else made again */
        kpl_node *q = p->in[0].node;
        kpl_tensor *z = q->saved_out ? q->saved_out : q->live_out;
        if (z) {
            st = kpl_tensor_empty(kpl_tensor_device(z), kpl_tensor_dtype(z), p->out_ndim,
                                  p->out_shape, &y);
            if (st == KPL_OK) st = kpl_k_unary(y, u, z, p->attrs.alpha, p->attrs.beta);
        } else {
            if (!(y = remake(q, keep_graph))) return NULL;
            st = kpl_k_unary(y, u, y, p->attrs.alpha, p->attrs.beta);
        }
    } else {
        kpl_tensor *g = p->in[1].saved, *b = p->in[2].saved;
        if (!x || !g || !b) {
            KPL_ERROR(KPL_ESTATE, "backward: '%s' lost what it keeps to make its output again",
                      kpl_op_name(p->op));
            return NULL;
        }
        st = kpl_tensor_empty(kpl_tensor_device(x), kpl_tensor_dtype(x), p->out_ndim, p->out_shape,
                              &y);
        double eps = p->attrs.alpha;
        if (st == KPL_OK)
            st = p->op == KPL_OP_GROUP_NORM ? kpl_k_group_norm(y, x, g, b, p->attrs.start, eps)
                 : p->op == KPL_OP_BATCH_NORM_RELU
                     ? kpl_k_batch_norm_relu(y, NULL, NULL, x, g, b, eps)
                     : kpl_k_batch_norm(y, NULL, NULL, x, g, b, eps);
    }
    if (st < 0) {
        kpl_tensor_release(y);
        kpl_error_prefix(st, "backward: making the output of '%s' again: ", kpl_op_name(p->op));
        return NULL;
    }
    return y;
}

/* p's output, made again if it was not kept: kept as its saved output
 * until p's gradient has run. */
static kpl_tensor *remade_output(kpl_node *p, bool keep_graph)
{
    if (p->saved_out) return p->saved_out;
    kpl_tensor *y = p->live_out; /* alive anyway: taken as it is */
    if (y)
        kpl_tensor_retain(y);
    else if (!(y = remake(p, keep_graph)))
        return NULL;
    kpl_status st = kpl__node_save_output(p, y);
    kpl_tensor_release(y); /* the alias keeps the storage */
    if (st < 0) return NULL;
    kpl__note_saved_tensor(p, p->saved_out, true);
    return p->saved_out;
}

kpl_status kpl_node_regenerate_saved(kpl_node *n, bool keep_graph)
{
    for (int i = 0; i < n->nin; i++) {
        if (!n->in[i].regen || n->in[i].saved) continue;
        kpl_tensor *y = remade_output(n->in[i].node, keep_graph);
        if (!y) return kpl_last_status();
        kpl_tensor_retain(y);
        n->in[i].saved = y;
        kpl__note_saved_tensor(n, y, true);
    }
    if (n->out_regen && !remade_output(n, keep_graph)) return kpl_last_status();
    return KPL_OK;
}

kpl_status kpl__graph_record(kpl_op op, const kpl_op_attrs *attrs, int nin,
                             kpl_tensor *const *ins, kpl_tensor *out)
{
    if (tl_grad_off) return KPL_OK;
    bool any = false;
    for (int i = 0; i < nin; i++) any |= kpl_requires_grad(ins[i]);
    if (!any) return KPL_OK;
    KPL_ASSERT(nin <= KPL_NODE_MAX_IN, "too many node inputs");

    kpl_status st = KPL_OK;
    bool regen = kpl_regenerate_enabled() && !kpl_tracing();
    kpl_node *n = calloc(1, sizeof *n);
    KPL_CHECK(n != NULL, KPL_ENOMEM, "%s: no host memory for the graph node", kpl_op_name(op));
    atomic_init(&n->refcount, 1);
    n->op = op;
    if (attrs) n->attrs = *attrs;
    n->nin = nin;
    for (int i = 0; i < nin; i++) {
        kpl_tensor *t = ins[i];
        const kpl__tmeta *m = kpl_tensor_meta(t);
        n->in[i].ndim = kpl_tensor_ndim(t);
        memcpy(n->in[i].shape, kpl_tensor_shape(t), (size_t)n->in[i].ndim * sizeof(int64_t));
        n->in[i].dtype = kpl_tensor_dtype(t);
        n->in[i].requires_grad = m && m->requires_grad;
        if (m && m->node) {
            n->in[i].node = m->node;
            n->in[i].out_index = m->out_index;
            kpl_node_retain(m->node);
        } else if (m && m->requires_grad) {
            n->in[i].leaf = t;
            kpl_tensor_retain(t);
        }
        if (regen && m && m->node && !m->node_weak && m->out_index == 0 && m->node->regenerable &&
            (kpl_op_info_of(op)->saved_in & (1u << i)))
            n->in[i].regen = true; /* made again from its producer in the backward */
        else if (kpl_op_info_of(op)->saved_in & (1u << i) || (regen && is_norm(op))) {
            kpl_tensor_retain(t); /* a norm that regenerates keeps its beta too */
            n->in[i].saved = t;
        }
    }
    n->regenerable = regen && regenerable(n, ins);
    if (regen && is_norm(op) && !n->regenerable)
        for (int i = 0; i < nin; i++)
            if (!(kpl_op_info_of(op)->saved_in & (1u << i))) {
                kpl_tensor_release(n->in[i].saved);
                n->in[i].saved = NULL;
            }
    n->out_ndim = kpl_tensor_ndim(out);
    memcpy(n->out_shape, kpl_tensor_shape(out), (size_t)n->out_ndim * sizeof(int64_t));
    if (kpl_op_info_of(op)->saved_out & 1u) {
        if (n->regenerable)
            n->out_regen = true;
        else
            KPL_TRY_GOTO(kpl__node_save_output(n, out));
    }

    kpl__tmeta *om = kpl__graph_meta(out, true);
    if (!om) {
        st = KPL_ERROR(KPL_ENOMEM, "%s: no host memory for the graph", kpl_op_name(op));
        goto fail;
    }
    om->requires_grad = true;
    om->node = n; /* the result owns the node's first reference */
    om->out_index = 0;
    if (n->regenerable) n->live_out = out, n->live_meta = om;
    if (kpl_memrec_active()) {
        n->mem_label = op_label("", op);
        note_saved(n, true);
    }
    if (kpl__tl_region || kpl__tl_replay) kpl__recompute_recorded(n, out);
    return KPL_OK;
fail:
    kpl_node_release(n);
    return st;
}
