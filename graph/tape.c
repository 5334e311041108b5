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

kpl_status kpl__graph_record(kpl_op op, const kpl_op_attrs *attrs, int nin,
                             kpl_tensor *const *ins, kpl_tensor *out)
{
    if (tl_grad_off) return KPL_OK;
    bool any = false;
    for (int i = 0; i < nin; i++) any |= kpl_requires_grad(ins[i]);
    if (!any) return KPL_OK;
    KPL_ASSERT(nin <= KPL_NODE_MAX_IN, "too many node inputs");

    kpl_status st = KPL_OK;
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
        if (kpl_op_info_of(op)->saved_in & (1u << i)) {
            kpl_tensor_retain(t);
            n->in[i].saved = t;
        }
    }
    n->out_ndim = kpl_tensor_ndim(out);
    memcpy(n->out_shape, kpl_tensor_shape(out), (size_t)n->out_ndim * sizeof(int64_t));
    if (kpl_op_info_of(op)->saved_out & 1u) KPL_TRY_GOTO(kpl__node_save_output(n, out));

    kpl__tmeta *om = kpl__graph_meta(out, true);
    if (!om) {
        st = KPL_ERROR(KPL_ENOMEM, "%s: no host memory for the graph", kpl_op_name(op));
        goto fail;
    }
    om->requires_grad = true;
    om->node = n; /* the result owns the node's first reference */
    om->out_index = 0;
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
