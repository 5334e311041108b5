/*
 * backward.c — the engine: walk the recorded nodes from an output in
 * reverse topological order, run each node's gradient once all of its
 * consumers have contributed, and free as it goes (reverse-mode GC).
 *
 * Each node's gradient runs inside a pool of its own: the temporaries of
 * the gradient formula die when it returns; the input gradients it produced
 * are retained by the engine only until their last consumer has run.
 */
#include "autograd_impl.h"
#include "ir.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    kpl_node *node;    /* a recorded node, or NULL for a parameter slot */
    kpl_tensor *leaf;  /* the parameter of a parameter slot */
    const void *key;   /* node or leaf */
    int deps;          /* consumers whose gradient has not arrived yet */
    kpl_tensor *grad;  /* accumulated gradient of the node's output (owned) */
    int capture;       /* index into the requested inputs, or -1 */
} slot;

typedef struct {
    slot *s;
    size_t n, cap;      /* slots in use, capacity of s */
    size_t *map;        /* open addressing: node -> slot index + 1 */
    size_t map_cap;
} graph_walk;

static slot *find(graph_walk *w, const void *key)
{
    if (!w->map_cap) return NULL;
    for (size_t j = kpl__hash_ptr(key, w->map_cap);; j = (j + 1) & (w->map_cap - 1)) {
        if (!w->map[j]) return NULL;
        if (w->s[w->map[j] - 1].key == key) return &w->s[w->map[j] - 1];
    }
}

/* A slot for a node, or for a parameter when n is NULL. */
static kpl_status add_slot(graph_walk *w, kpl_node *n, kpl_tensor *leaf, slot **out)
{
    if (w->n == w->cap) {
        size_t ncap = w->cap ? w->cap * 2 : 64;
        slot *ns = realloc(w->s, ncap * sizeof *ns);
        KPL_CHECK(ns != NULL, KPL_ENOMEM, "backward: no host memory");
        w->s = ns;
        w->cap = ncap;
    }
    if ((w->n + 1) * 2 > w->map_cap) {
        size_t ncap = w->map_cap ? w->map_cap * 2 : 128;
        size_t *nm = calloc(ncap, sizeof *nm);
        KPL_CHECK(nm != NULL, KPL_ENOMEM, "backward: no host memory");
        for (size_t i = 0; i < w->n; i++) {
            size_t j = kpl__hash_ptr(w->s[i].key, ncap);
            while (nm[j]) j = (j + 1) & (ncap - 1);
            nm[j] = i + 1;
        }
        free(w->map);
        w->map = nm;
        w->map_cap = ncap;
    }
    slot *s = &w->s[w->n];
    memset(s, 0, sizeof *s);
    s->node = n;
    s->leaf = leaf;
    s->key = n ? (const void *)n : (const void *)leaf;
    s->capture = -1;
    size_t j = kpl__hash_ptr(s->key, w->map_cap);
    while (w->map[j]) j = (j + 1) & (w->map_cap - 1);
    w->map[j] = ++w->n;
    *out = s;
    return KPL_OK;
}

/* Finds every node and parameter the root depends on and counts each
 * one's consumers. */
static kpl_status collect(graph_walk *w, kpl_node *root)
{
    slot *s;
    KPL_TRY(add_slot(w, root, NULL, &s));
    for (size_t next = 0; next < w->n; next++) {
        kpl_node *n = w->s[next].node;
        if (!n) continue; /* parameters end the walk */
        for (int i = 0; i < kpl_node_num_inputs(n); i++) {
            if (!kpl_node_input_requires_grad(n, i)) continue;
            kpl_node *m = kpl_node_input_node(n, i, NULL);
            kpl_tensor *leaf = m ? NULL : kpl_node_input_leaf(n, i);
            slot *t = find(w, m ? (const void *)m : (const void *)leaf);
            if (!t) KPL_TRY(add_slot(w, m, leaf, &t)); /* may move w->s */
            t->deps++;
        }
    }
    return KPL_OK;
}

/* Runs gradient hooks on *g (owned), replacing it when a hook returns a
 * new tensor. */
static kpl_status run_grad_hooks(const kpl_hooks *h, kpl_tensor *t, kpl_tensor **g)
{
    for (int k = 0; h && k < h->n_grad; k++) {
        kpl_tensor *r = h->grad[k](t, *g, h->grad_user[k]);
        if (!r) continue;
        kpl_tensor_retain(r);
        kpl_tensor_release(*g);
        *g = r;
    }
    return KPL_OK;
}

/* acc = acc + g (both owned; g is consumed). */
static kpl_status accumulate(kpl_tensor **acc, kpl_tensor *g)
{
    if (!*acc) {
        *acc = g;
        return KPL_OK;
    }
    kpl_tensor *sum = kpl_add(*acc, g);
    kpl_tensor_release(g);
    if (!sum) return kpl_last_status();
    kpl_tensor_retain(sum);
    kpl_tensor_release(*acc);
    *acc = sum;
    return KPL_OK;
}

typedef struct {
    int ninputs;
    kpl_tensor *const *inputs;
    kpl_tensor **grads; /* owned while running */
} capture_set;

static int capture_leaf(const capture_set *c, const kpl_tensor *leaf)
{
    for (int i = 0; c && i < c->ninputs; i++)
        if (c->inputs[i] == leaf) return i;
    return -1;
}

/* The output and the gradient it starts from agree; a seedless output is
 * a scalar. */
static kpl_status check_output(kpl_tensor *output, kpl_tensor *seed)
{
    KPL_CHECK(output != NULL, KPL_EINVAL, "backward: NULL output");
    if (!kpl_tensor_node(output, NULL))
        KPL_CHECK(kpl_requires_grad(output), KPL_EINVAL,
                  "backward: the output does not require grad (no parameter reaches it, or "
                  "it was computed with grad mode off)");
    char b1[96], b2[96];
    if (seed)
        KPL_CHECK(kpl_tensor_numel(seed) == kpl_tensor_numel(output), KPL_ESHAPE,
                  "backward: grad_output %s does not match the output %s",
                  kpl_shape_str(kpl_tensor_ndim(seed), kpl_tensor_shape(seed), b1, sizeof b1),
                  kpl_shape_str(kpl_tensor_ndim(output), kpl_tensor_shape(output), b2, sizeof b2));
    else
        KPL_CHECK(kpl_tensor_numel(output) == 1, KPL_ESHAPE,
                  "backward: the output has shape %s; pass grad_output for a non-scalar output",
                  kpl_shape_str(kpl_tensor_ndim(output), kpl_tensor_shape(output), b1, sizeof b1));
    return KPL_OK;
}

/* param.grad += g (g owned, consumed); a gradient buffer is added to in
 * place (unrecorded: grad mode is off without create_graph). */
static kpl_status add_to_param_grad(kpl_tensor *param, kpl_tensor *g, bool create_graph)
{
    if (kpl_grad_is_buffer(param) && !create_graph) {
        kpl_tensor *buf = kpl_grad_get(param);
        if (kpl_trace_predates(buf))
            kpl_trace_refuse("backward: gradient buffers (kpl_grad_set_buffer) are zeroed "
                             "outside the step; the graph would add to them run after run");
        kpl_status st = kpl_write_binary(buf, KPL_BIN_ADD, buf, g);
        kpl_tensor_release(g);
        return st;
    }
    kpl_tensor *acc = kpl_grad_get(param);
    if (kpl_trace_predates(acc))
        kpl_trace_refuse("backward: a gradient from before the trace is added to (accumulation "
                         "over steps); the graph would add to its value at each run, not the "
                         "last step's");
    if (acc) kpl_tensor_retain(acc);
    kpl_status st = accumulate(&acc, g);
    if (st == KPL_OK) kpl_grad_set(param, acc);
    kpl_tensor_release(acc);
    return st;
}

/* One backward pass's state. */
typedef struct {
    graph_walk w;
    capture_set *cap; /* kpl_grad's inputs, or NULL: into the parameters' .grad */
    bool retain_graph, create_graph;
    size_t *ready, nready; /* slots whose consumers have all contributed */
} engine;

/* A parameter whose gradient is complete: its hooks, then into .grad (or
 * the captured result), then its ready hooks. */
static kpl_status finish_param(engine *e, slot *s)
{
    kpl_tensor *leaf = s->leaf, *g = s->grad;
    s->grad = NULL;
    kpl_pool *p = kpl_pool_push();
    kpl_status st = run_grad_hooks(kpl_tensor_hooks(leaf), leaf, &g);
    if (st == KPL_OK && s->capture >= 0) {
        st = accumulate(&e->cap->grads[s->capture], g);
        g = NULL;
    } else if (st == KPL_OK && !e->cap) {
        st = add_to_param_grad(leaf, g, e->create_graph);
        g = NULL;
        const kpl_hooks *h = kpl_tensor_hooks(leaf);
        for (int k = 0; st == KPL_OK && h && k < h->n_ready; k++)
            if ((st = h->ready[k](leaf, h->ready_user[k])) > 0) st = KPL_OK;
    }
    kpl_tensor_release(g);
    kpl_pool_pop(p);
    return st;
}

/* A node whose output gradient is complete: its gradient function, whose
 * results go to the slots of its inputs; then its output gradient and
 * saved tensors are let go (reverse-mode GC). */
static kpl_status run_node(engine *e, slot *s)
{
    kpl_node *n = s->node;
    kpl_pool *p = kpl_pool_push();
    KPL_CHECK(p, KPL_ENOMEM, "backward: no host memory");
    kpl_status st = run_grad_hooks(kpl_node_hooks(n), NULL, &s->grad);
    if (st == KPL_OK && s->capture >= 0) {
        kpl_tensor_retain(s->grad);
        e->cap->grads[s->capture] = s->grad;
    }
    if (st == KPL_OK && kpl_node_saved_freed(n))
        st = KPL_ERROR(KPL_ESTATE,
                       "backward: the graph through '%s' was already used by a backward that "
                       "freed it; pass retain_graph to the first one",
                       kpl_op_name(kpl_node_op(n)));
    /* a recomputed region's tensors come back first (graph.h) */
    if (st == KPL_OK && kpl_node_saved_dropped(n)) st = kpl_node_restore_saved(n, e->create_graph);
    kpl_tensor *gin[3] = {NULL, NULL, NULL};
    uint32_t mem_prev = kpl_memrec_active() ? kpl_mem_context_set(kpl_node_backward_mem_label(n)) : 0;
    kpl_node_hold_saved(n, true); /* a budget must not let them go under the gradient */
    /* outputs of norms made again rather than kept (kpl_set_regenerate) */
    if (st == KPL_OK) st = kpl_node_regenerate_saved(n, e->create_graph);
    if (st == KPL_OK) st = kpl__autograd_apply(n, s->grad, gin);
    kpl_node_hold_saved(n, false);
    if (kpl_memrec_active()) kpl_mem_context_set(mem_prev);
    for (int i = 0; st == KPL_OK && i < kpl_node_num_inputs(n); i++) {
        if (!gin[i] || !kpl_node_input_requires_grad(n, i)) continue;
        kpl_tensor_retain(gin[i]);
        kpl_node *m = kpl_node_input_node(n, i, NULL);
        slot *t = find(&e->w, m ? (const void *)m : (const void *)kpl_node_input_leaf(n, i));
        st = accumulate(&t->grad, gin[i]);
        if (st == KPL_OK && --t->deps == 0) e->ready[e->nready++] = (size_t)(t - e->w.s);
    }
    kpl_pool_pop(p);
    kpl_tensor_release(s->grad);
    s->grad = NULL;
    if (!e->retain_graph && !e->create_graph) kpl_node_free_saved(n);
    return st;
}

/* The output is a parameter itself: its gradient is the seed. */
static kpl_status output_is_param(kpl_tensor *output, kpl_tensor *seed, capture_set *cap)
{
    int c = capture_leaf(cap, output);
    if (c >= 0) return accumulate(&cap->grads[c], seed);
    if (cap) {
        kpl_tensor_release(seed);
        return KPL_OK;
    }
    kpl_tensor *g = kpl_grad_get(output);
    if (kpl_trace_predates(g))
        kpl_trace_refuse("backward: a gradient from before the trace is added to "
                         "(accumulation over steps)");
    if (g) kpl_tensor_retain(g);
    kpl_status st = accumulate(&g, seed);
    if (st == KPL_OK) kpl_grad_set(output, g);
    kpl_tensor_release(g);
    return st;
}

/* Walks the graph from root with seed (owned) as its output's gradient. */
static kpl_status walk(engine *e, kpl_node *root, kpl_tensor *seed)
{
    graph_walk *w = &e->w;
    kpl_status st = collect(w, root);
    if (st < 0) {
        kpl_tensor_release(seed);
        return st;
    }
    for (int i = 0; e->cap && i < e->cap->ninputs; i++) {
        kpl_node *in = kpl_tensor_node(e->cap->inputs[i], NULL);
        slot *s = find(w, in ? (const void *)in : (const void *)e->cap->inputs[i]);
        if (s) s->capture = i;
    }
    w->s[0].grad = seed;
    e->ready = malloc(w->n * sizeof *e->ready);
    KPL_CHECK(e->ready, KPL_ENOMEM, "backward: no host memory");
    e->ready[e->nready++] = 0;
    while (e->nready && st == KPL_OK) {
        slot *s = &w->s[e->ready[--e->nready]];
        st = s->node ? run_node(e, s) : finish_param(e, s);
    }
    return st;
}

static kpl_status run(kpl_tensor *output, kpl_tensor *grad_output, bool retain_graph,
                      bool create_graph, capture_set *cap)
{
    KPL_TRY(check_output(output, grad_output));
    kpl_recompute_flush(); /* the last region's tensors are needed first: they stay */
    bool prev_mode = kpl_set_grad_enabled(create_graph);
    /* Gradients flow through the dtypes the forward chose (its casts are
     * on the tape); autocast would cast them again. */
    kpl_dtype prev_cast = kpl_autocast_dtype();
    kpl_set_autocast(KPL_F32, NULL);
    engine e = {.cap = cap, .retain_graph = retain_graph, .create_graph = create_graph};
    kpl_status st = KPL_OK;
    kpl_pool *outer = kpl_pool_push();
    kpl_tensor *seed = grad_output;
    if (!outer) st = KPL_ERROR(KPL_ENOMEM, "backward: no host memory");
    else if (!seed)
        seed = kpl_full(kpl_tensor_device(output), kpl_tensor_dtype(output),
                        kpl_tensor_ndim(output), kpl_tensor_shape(output), 1.0);
    if (outer && !seed) st = kpl_last_status();
    if (st == KPL_OK) {
        kpl_tensor_retain(seed);
        kpl_node *root = kpl_tensor_node(output, NULL);
        st = root ? walk(&e, root, seed) : output_is_param(output, seed, cap);
    }
    free(e.ready);
    for (size_t i = 0; i < e.w.n; i++) kpl_tensor_release(e.w.s[i].grad);
    free(e.w.s);
    free(e.w.map);
    if (outer) kpl_pool_pop(outer);
    kpl_set_grad_enabled(prev_mode);
    kpl_set_autocast(prev_cast, NULL);
    return st;
}

kpl_status kpl_backward(kpl_tensor *loss, kpl_tensor *grad_output, bool retain_graph)
{
    return run(loss, grad_output, retain_graph, false, NULL);
}

kpl_status kpl_grad(kpl_tensor *output, kpl_tensor *grad_output, int ninputs,
                    kpl_tensor *const *inputs, bool create_graph, kpl_tensor **grads)
{
    KPL_CHECK(ninputs >= 0 && (ninputs == 0 || (inputs && grads)), KPL_EINVAL,
              "grad: NULL inputs or grads");
    capture_set cap = {ninputs, inputs, grads};
    for (int i = 0; i < ninputs; i++) grads[i] = NULL;
    kpl_status st = run(output, grad_output, true, create_graph, &cap);
    for (int i = 0; i < ninputs; i++) {
        if (st < 0) {
            kpl_tensor_release(grads[i]);
            grads[i] = NULL;
        } else if (grads[i]) {
            grads[i] = kpl_autorelease(grads[i]); /* into the caller's pool */
        }
    }
    return st;
}

void kpl_zero_grad(int n, kpl_tensor *const *params)
{
    for (int i = 0; i < n; i++) kpl_grad_set(params[i], NULL);
}
