/*
 * recompute.c — regions of the forward whose saved tensors are let go and
 * computed again when the backward reaches them (graph.h,
 * "recomputation").
 *
 * A region keeps its nodes in recording order (weakly: a node that goes
 * clears its place) and its inputs (retained until the replay).  Each of
 * its nodes holds a reference to it.  Lifecycle:
 *
 *   RECORDING  between begin and end: kpl__graph_record appends nodes,
 *              random draws log their generator positions;
 *   ENDED      after end, its tensors still held (the thread's pending
 *              region: the last one before a backward stays so);
 *   STRIPPED   the next region began: every saved tensor but parameters
 *              and the region's inputs and outputs let go;
 *   FILLED     a backward needed one of them: fn ran again under the
 *              replay, handing its saved tensors to the nodes in order;
 *              the inputs and kept tensors are let go.
 *   FAILED     the replay failed or diverged: the nodes stay stripped and
 *              their gradients fail with the region's message.
 *
 * Under a budget (kpl_recompute_set_budget, memory.recompute: auto) an
 * ended region is not stripped when the next one begins: it waits in the
 * thread's list of evictable regions, and the allocator's release hook
 * strips regions from it, one at a time, while an allocation would pass
 * the budget, the region of least cost / (bytes x staleness) first (DTR's
 * heuristic, Kirisame et al. 2021, over regions instead of tensors): cost
 * is the time its forward took, bytes what stripping it lets go, staleness
 * the time since it ended.  A region whose node is running its gradient
 * is held (kpl_node_hold_saved) and never stripped under it.
 */
#include "graph_impl.h"
#include "ir.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { RECORDING, ENDED, STRIPPED, FILLED, FAILED };

typedef struct {
    kpl_rng *rng;
    uint64_t seed, offset;
} draw;

struct kpl_recompute {
    atomic_int refcount; /* the region's creator (until stripped or abandoned) + its nodes */
    char name[128];
    int state;
    kpl_recompute_fn fn;
    void *user;
    int nin;
    kpl_tensor **inputs; /* retained until the replay */
    kpl_storage **keep;  /* the storages of inputs and outputs: not let go */
    int nkeep;
    kpl_node **nodes; /* recording order; NULL where a node went */
    size_t nnodes, cap_nodes;
    draw *draws; /* generator positions of the forward's draws */
    size_t ndraws, cap_draws;
    kpl_tensor **kept; /* kpl_recompute_keep's */
    size_t nkept, cap_kept;
    kpl_dtype autocast;
    /* under a budget */
    double t_begin, cost, t_end; /* seconds */
    size_t bytes;                /* what stripping lets go (its saved tensors' storages) */
    int held;                    /* nodes running their gradient */
    bool listed;                 /* in its thread's evictable list */
    struct evictable *list;      /* that list */
    /* the replay */
    size_t at_node, at_draw, at_kept;
    bool keep_graph;
    char why[256]; /* the first divergence, or the failure */
};

_Thread_local kpl_recompute *kpl__tl_region, *kpl__tl_replay;
static _Thread_local kpl_recompute *tl_pending; /* ended, not yet stripped (owned) */
static _Thread_local uint64_t tl_count;

/* A thread's budget and its evictable regions (weak: a region leaves the
 * list when it goes). */
typedef struct evictable {
    kpl_device *dev; /* NULL: no budget */
    size_t budget;
    kpl_recompute **r;
    size_t n, cap;
    uint64_t evictions;
    bool regen; /* kpl_regenerate_enabled() before the budget */
} evictable;
static _Thread_local evictable tl_evict;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void unlist(kpl_recompute *r)
{
    evictable *l = r->list;
    for (size_t i = 0; l && i < l->n; i++)
        if (l->r[i] == r) {
            l->r[i] = l->r[--l->n];
            break;
        }
    r->listed = false;
}

static void region_release(kpl_recompute *r)
{
    if (!r || atomic_fetch_sub_explicit(&r->refcount, 1, memory_order_acq_rel) != 1) return;
    if (r->listed) unlist(r);
    for (int i = 0; i < r->nin; i++)
        kpl_tensor_release(r->inputs[i]);
    for (size_t i = 0; i < r->nkept; i++)
        kpl_tensor_release(r->kept[i]);
    free(r->inputs);
    free(r->keep);
    free(r->nodes);
    free(r->draws);
    free(r->kept);
    free(r);
}

/* Grows *arr (of *cap elements of `size` bytes) to hold n + 1. */
static bool grow(void **arr, size_t *cap, size_t n, size_t size)
{
    if (n < *cap) return true;
    size_t ncap = *cap ? *cap * 2 : 32;
    void *a = realloc(*arr, ncap * size);
    if (!a) return false;
    *arr = a;
    *cap = ncap;
    return true;
}

/* The first divergence of a replay (or a failure of the region's
 * bookkeeping) is kept for the message. */
static void diverge(kpl_recompute *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void diverge(kpl_recompute *r, const char *fmt, ...)
{
    if (r->why[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->why, sizeof r->why, fmt, ap);
    va_end(ap);
    if (!r->why[0]) snprintf(r->why, sizeof r->why, "it failed");
}

static void release_replay_state(kpl_recompute *r)
{
    for (int i = 0; i < r->nin; i++)
        kpl_tensor_release(r->inputs[i]);
    r->nin = 0;
    for (size_t i = 0; i < r->nkept; i++)
        kpl_tensor_release(r->kept[i]);
    r->nkept = 0;
    r->ndraws = 0;
}

/* ---- recording ---------------------------------------------------------------------------- */

static bool kept_storage(const kpl_recompute *r, const kpl_tensor *t)
{
    /* a parameter stays whatever happens; so do the region's inputs and
     * outputs, which are alive anyway */
    if (!kpl_tensor_node(t, NULL) && kpl_requires_grad(t)) return true;
    kpl_storage *s = kpl_tensor_storage(t);
    for (int i = 0; i < r->nkeep; i++)
        if (r->keep[i] == s) return true;
    return false;
}

/* Lets go of the saved tensors of the region's nodes (but the kept ones). */
static void strip(kpl_recompute *r)
{
    for (size_t k = 0; k < r->nnodes; k++) {
        kpl_node *n = r->nodes[k];
        if (!n || n->freed) continue;
        for (int i = 0; i < n->nin; i++) {
            kpl_tensor *t = n->in[i].saved;
            if (!t || kept_storage(r, t)) continue;
            kpl__note_saved_tensor(n, t, false);
            kpl_tensor_release(t);
            n->in[i].saved = NULL;
            n->dropped = true;
        }
        if (n->saved_out && !kept_storage(r, n->saved_out)) {
            kpl__note_saved_tensor(n, n->saved_out, false);
            kpl_tensor_release(n->saved_out);
            n->saved_out = NULL;
            n->dropped = true;
        }
    }
    r->state = STRIPPED;
}

/* The bytes stripping r would let go: its saved tensors' storages (each
 * once) but the kept ones. */
static size_t strippable_bytes(const kpl_recompute *r)
{
    size_t total = 0, n = 0, cap = 0;
    kpl_storage **seen = NULL;
    for (size_t k = 0; k < r->nnodes; k++) {
        kpl_node *nd = r->nodes[k];
        if (!nd || nd->freed) continue;
        kpl_tensor *ts[KPL_NODE_MAX_IN + 1];
        int nt = 0;
        for (int i = 0; i < nd->nin; i++)
            if (nd->in[i].saved) ts[nt++] = nd->in[i].saved;
        if (nd->saved_out) ts[nt++] = nd->saved_out;
        for (int i = 0; i < nt; i++) {
            if (kept_storage(r, ts[i])) continue;
            kpl_storage *s = kpl_tensor_storage(ts[i]);
            bool dup = false;
            for (size_t j = 0; j < n && !dup; j++)
                dup = seen[j] == s;
            if (dup || !grow((void **)&seen, &cap, n, sizeof *seen)) continue;
            seen[n++] = s;
            total += kpl_tensor_nbytes(ts[i]);
        }
    }
    free(seen);
    return total;
}

/* The region that ended last goes to the stripped state (a new region
 * begins: the backward will not need it first). */
static void strip_pending(void)
{
    kpl_recompute *r = tl_pending;
    tl_pending = NULL;
    if (!r) return;
    if (r->state == ENDED) strip(r);
    region_release(r);
}

void kpl_recompute_flush(void)
{
    kpl_recompute *r = tl_pending;
    tl_pending = NULL;
    if (r && r->state == ENDED) {
        /* its tensors stay: nothing to recompute */
        r->state = FILLED;
        release_replay_state(r);
    }
    region_release(r);
}

kpl_status kpl_recompute_begin(const char *name, int n, kpl_tensor *const *inputs,
                               kpl_recompute_fn fn, void *user, kpl_recompute **out)
{
    KPL_CHECK(out != NULL, KPL_EINVAL, "recompute_begin: NULL out");
    *out = NULL;
    KPL_CHECK(fn != NULL && n >= 1 && inputs, KPL_EINVAL,
              "recompute_begin: a region needs a function and 1 or more inputs");
    for (int i = 0; i < n; i++)
        KPL_CHECK(inputs[i] != NULL, KPL_EINVAL, "recompute_begin: input %d is NULL", i);
    if (kpl__tl_region || kpl__tl_replay || !kpl_grad_enabled()) return KPL_OK;
    if (kpl_tracing()) {
        kpl_trace_refuse("recompute: region '%s' (memory.recompute) in a trace: a static graph "
                         "plans its own memory",
                         name ? name : "");
        return KPL_OK;
    }
    if (!tl_evict.dev) strip_pending();
    kpl_recompute *r = calloc(1, sizeof *r);
    if (r) r->inputs = calloc((size_t)n, sizeof *r->inputs);
    if (r) r->keep = calloc((size_t)n, sizeof *r->keep);
    if (!r || !r->inputs || !r->keep) {
        if (r) free(r->inputs);
        free(r);
        return KPL_ERROR(KPL_ENOMEM, "recompute: no host memory for a region");
    }
    atomic_init(&r->refcount, 1);
    snprintf(r->name, sizeof r->name, "%s", name ? name : "region");
    r->fn = fn;
    r->user = user;
    r->nin = n;
    for (int i = 0; i < n; i++) {
        kpl_tensor_retain(inputs[i]);
        r->inputs[i] = inputs[i];
        r->keep[r->nkeep++] = kpl_tensor_storage(inputs[i]);
    }
    r->autocast = kpl_autocast_dtype();
    r->t_begin = tl_evict.dev ? now_s() : 0;
    r->state = RECORDING;
    kpl__tl_region = r;
    *out = r;
    return KPL_OK;
}

kpl_status kpl_recompute_end(kpl_recompute *r, int n, kpl_tensor *const *outputs)
{
    if (!r) return KPL_OK;
    KPL_CHECK(kpl__tl_region == r, KPL_ESTATE,
              "recompute_end: region '%s' is not the one this thread records", r->name);
    kpl__tl_region = NULL;
    if (n > 0 && !r->why[0]) {
        kpl_storage **keep = realloc(r->keep, (size_t)(r->nkeep + n) * sizeof *keep);
        if (keep) {
            r->keep = keep;
            for (int i = 0; i < n; i++)
                if (outputs[i]) r->keep[r->nkeep++] = kpl_tensor_storage(outputs[i]);
        } else {
            diverge(r, "no host memory");
        }
    }
    if (n <= 0 || r->why[0] || r->nnodes == 0) {
        /* abandoned (the forward failed, nothing was recorded, or the
         * region could not keep its books): nothing is let go */
        r->state = FILLED;
        release_replay_state(r);
        region_release(r);
        return KPL_OK;
    }
    r->state = ENDED;
    if (tl_evict.dev) {
        /* under a budget: evictable until the allocator needs the room */
        r->t_end = now_s();
        r->cost = r->t_end - r->t_begin;
        r->bytes = strippable_bytes(r);
        if (grow((void **)&tl_evict.r, &tl_evict.cap, tl_evict.n, sizeof *tl_evict.r)) {
            tl_evict.r[tl_evict.n++] = r;
            r->listed = true;
            r->list = &tl_evict;
        }
        region_release(r); /* its nodes hold it */
        return KPL_OK;
    }
    tl_pending = r; /* the creator's reference */
    return KPL_OK;
}

/* A node recorded while this thread records a region. */
static void add_node(kpl_recompute *r, kpl_node *n)
{
    if (r->why[0]) return;
    if (!grow((void **)&r->nodes, &r->cap_nodes, r->nnodes, sizeof *r->nodes)) {
        diverge(r, "no host memory");
        return;
    }
    n->region = r;
    n->region_index = r->nnodes;
    atomic_fetch_add_explicit(&r->refcount, 1, memory_order_relaxed);
    r->nodes[r->nnodes++] = n;
}

/* A node recorded by a replay: its saved tensors go to the region's node
 * of the same place. */
static void refill(kpl_recompute *r, kpl_node *n, kpl_tensor *out)
{
    size_t k = r->at_node++;
    if (k >= r->nnodes) {
        diverge(r, "its forward recorded %s as op %zu, the first run only %zu", kpl_op_name(n->op),
                k + 1, r->nnodes);
        return;
    }
    kpl_node *o = r->nodes[k];
    if (!o) return; /* that node went: nobody needs its tensors */
    if (o->op != n->op || o->nin != n->nin || o->out_ndim != n->out_ndim ||
        memcmp(o->out_shape, n->out_shape, (size_t)n->out_ndim * sizeof *n->out_shape) != 0) {
        char b1[96], b2[96];
        diverge(r, "op %zu is %s %s, the first run had %s %s", k + 1, kpl_op_name(n->op),
                kpl_shape_str(n->out_ndim, n->out_shape, b1, sizeof b1), kpl_op_name(o->op),
                kpl_shape_str(o->out_ndim, o->out_shape, b2, sizeof b2));
        return;
    }
    if (!o->dropped || o->freed) return;
    for (int i = 0; i < n->nin; i++) {
        kpl_tensor *t = n->in[i].saved;
        if (!t || o->in[i].saved) continue;
        if (r->keep_graph) {
            kpl_tensor_retain(t); /* with its graph: gradients of gradients go through it */
            o->in[i].saved = t;
        } else if (kpl_tensor_reshape(t, kpl_tensor_ndim(t), kpl_tensor_shape(t), &o->in[i].saved) <
                   0) {
            diverge(r, "%s", kpl_last_error());
            return;
        }
        kpl__note_saved_tensor(o, o->in[i].saved, true);
    }
    if (n->saved_out && !o->saved_out) {
        if (kpl__node_save_output(o, out) < 0) {
            diverge(r, "%s", kpl_last_error());
            return;
        }
        kpl__note_saved_tensor(o, o->saved_out, true);
    }
    o->dropped = false;
}

void kpl__recompute_recorded(kpl_node *n, kpl_tensor *out)
{
    if (kpl__tl_region)
        add_node(kpl__tl_region, n);
    else if (kpl__tl_replay)
        refill(kpl__tl_replay, n, out);
}

void kpl__recompute_forget(kpl_node *n)
{
    kpl_recompute *r = n->region;
    if (r->nodes[n->region_index] == n) r->nodes[n->region_index] = NULL;
    n->region = NULL;
    region_release(r);
}

/* ---- the budget (memory.recompute: auto) -------------------------------------------------- */

/* The allocator's release hook: strips the evictable region of least
 * cost / (bytes x staleness) that frees something; the bytes freed (0:
 * nothing left to strip). */
static size_t evict(kpl_device *dev, size_t excess, void *user)
{
    (void)excess, (void)user;
    evictable *l = &tl_evict;
    size_t before = kpl_device_memory_stats(dev).allocated;
    for (;;) {
        double t = now_s(), best = 0;
        kpl_recompute *pick = NULL;
        for (size_t i = 0; i < l->n; i++) {
            kpl_recompute *r = l->r[i];
            if (r->state != ENDED || r->held || !r->bytes) continue;
            double stale = t - r->t_end > 1e-6 ? t - r->t_end : 1e-6;
            double h = (r->cost > 1e-6 ? r->cost : 1e-6) / ((double)r->bytes * stale);
            if (!pick || h < best) pick = r, best = h;
        }
        if (!pick) return 0;
        strip(pick);
        unlist(pick);
        l->evictions++;
        size_t after = kpl_device_memory_stats(dev).allocated;
        if (after < before) return before - after;
        /* its tensors are held elsewhere too: try the next one */
    }
}

kpl_status kpl_recompute_set_budget(kpl_device *dev, size_t bytes)
{
    KPL_CHECK(!bytes || dev, KPL_EINVAL, "recompute_set_budget: NULL device");
    if (tl_evict.dev) kpl_device_set_budget(tl_evict.dev, 0, NULL, NULL);
    /* regeneration is off under a budget (kpl_set_regenerate): evictions
     * price regions by what they hold through the forward, not by what the
     * backward makes again */
    if (bytes && !tl_evict.budget)
        tl_evict.regen = kpl_set_regenerate(false);
    else if (!bytes && tl_evict.budget)
        kpl_set_regenerate(tl_evict.regen);
    tl_evict.dev = bytes ? dev : NULL;
    tl_evict.budget = bytes;
    if (bytes) {
        kpl_recompute_flush(); /* the lazy strip's region keeps its tensors */
        kpl_device_set_budget(dev, bytes, evict, NULL);
    } else {
        for (size_t i = 0; i < tl_evict.n; i++)
            tl_evict.r[i]->listed = false;
        free(tl_evict.r);
        tl_evict.r = NULL;
        tl_evict.n = tl_evict.cap = 0;
    }
    return KPL_OK;
}

uint64_t kpl_recompute_evictions(void)
{
    return tl_evict.evictions;
}

void kpl_node_hold_saved(kpl_node *n, bool hold)
{
    if (n && n->region) n->region->held += hold ? 1 : -1;
}

/* ---- random draws ------------------------------------------------------------------------- */

void kpl__recompute_rng_enter(kpl_rng *rng, kpl__rng_scope *s)
{
    s->restore = false;
    s->rng = rng;
    kpl_recompute *r = kpl__tl_region;
    if (r && rng && !r->why[0]) {
        if (!grow((void **)&r->draws, &r->cap_draws, r->ndraws, sizeof *r->draws))
            diverge(r, "no host memory");
        else
            r->draws[r->ndraws++] = (draw){rng, kpl_rng_seed(rng), kpl_rng_offset(rng)};
        return;
    }
    r = kpl__tl_replay;
    if (!r || !rng) return;
    size_t k = r->at_draw++;
    if (k >= r->ndraws || r->draws[k].rng != rng) {
        diverge(r, "random draw %zu comes from %s generator", k + 1,
                k >= r->ndraws ? "a draw the first run did not make, from a" : "another");
        return;
    }
    s->seed = kpl_rng_seed(rng);
    s->offset = kpl_rng_offset(rng);
    s->restore = true;
    kpl_rng_set_state(rng, r->draws[k].seed, r->draws[k].offset);
}

void kpl__recompute_rng_leave(kpl__rng_scope *s)
{
    if (s->restore) kpl_rng_set_state(s->rng, s->seed, s->offset);
}

/* ---- kept tensors ------------------------------------------------------------------------- */

bool kpl_recompute_replaying(void)
{
    return kpl__tl_replay != NULL;
}

kpl_status kpl_recompute_keep(kpl_tensor *t)
{
    kpl_recompute *r = kpl__tl_region;
    if (!r || !t) return KPL_OK;
    KPL_CHECK(grow((void **)&r->kept, &r->cap_kept, r->nkept, sizeof *r->kept), KPL_ENOMEM,
              "recompute: no host memory");
    kpl_tensor_retain(t);
    r->kept[r->nkept++] = t;
    return KPL_OK;
}

kpl_tensor *kpl_recompute_replayed(void)
{
    kpl_recompute *r = kpl__tl_replay;
    if (!r || r->at_kept >= r->nkept) {
        KPL_ERROR(KPL_ESTATE,
                  "recompute: the replay asks for kept tensor %zu, the forward kept %zu",
                  r ? r->at_kept + 1 : 0, r ? r->nkept : 0);
        if (r) diverge(r, "%s", kpl_last_error());
        return NULL;
    }
    kpl_tensor *t = r->kept[r->at_kept++];
    kpl_tensor_retain(t);
    return kpl_autorelease(t);
}

/* ---- the replay --------------------------------------------------------------------------- */

bool kpl_node_saved_dropped(const kpl_node *n)
{
    return n->dropped;
}

uint64_t kpl_recompute_count(void)
{
    return tl_count;
}

static kpl_status replay(kpl_recompute *r, bool keep_graph)
{
    r->at_node = r->at_draw = r->at_kept = 0;
    r->keep_graph = keep_graph;
    kpl_recompute *prev_region = kpl__tl_region, *prev_replay = kpl__tl_replay;
    kpl__tl_region = NULL;
    kpl__tl_replay = r;
    bool prev_grad = kpl_set_grad_enabled(true);
    kpl_dtype prev_cast = KPL_F32;
    kpl_set_autocast(r->autocast, &prev_cast);
    kpl_pool *p = kpl_pool_push();
    kpl_status st =
        p ? r->fn(r->user, r->nin, r->inputs) : KPL_ERROR(KPL_ENOMEM, "recompute: no host memory");
    if (st < 0) diverge(r, "%s", kpl_last_error());
    kpl_pool_pop(p); /* what the nodes took survives */
    kpl_set_autocast(prev_cast, NULL);
    kpl_set_grad_enabled(prev_grad);
    kpl__tl_replay = prev_replay;
    kpl__tl_region = prev_region;
    tl_count++;
    if (!r->why[0] && r->at_node != r->nnodes)
        diverge(r, "its forward recorded %zu ops, the first run %zu", r->at_node, r->nnodes);
    if (!r->why[0] && r->at_draw != r->ndraws)
        diverge(r, "its forward drew random numbers %zu times, the first run %zu", r->at_draw,
                r->ndraws);
    release_replay_state(r);
    if (st < 0) {
        /* the forward failed this time (out of memory under a budget,
         * say): its own message */
        r->state = FAILED;
        return kpl_error_prefix(st, "recompute of '%s': ", r->name);
    }
    if (r->why[0]) {
        r->state = FAILED;
        return KPL_ERROR(KPL_ESTATE,
                         "recompute of '%s': %s (a recomputed module must compute what it "
                         "computed in the forward)",
                         r->name, r->why);
    }
    r->state = FILLED;
    return KPL_OK;
}

kpl_status kpl_node_restore_saved(kpl_node *n, bool keep_graph)
{
    if (!n || !n->dropped) return KPL_OK;
    kpl_recompute *r = n->region;
    KPL_CHECK(r != NULL, KPL_ESTATE, "recompute: node '%s' lost its region", kpl_op_name(n->op));
    if (r->state == STRIPPED) KPL_TRY(replay(r, keep_graph));
    if (r->state == FAILED) return KPL_ERROR(KPL_ESTATE, "recompute of '%s': %s", r->name, r->why);
    KPL_CHECK(!n->dropped, KPL_ESTATE,
              "recompute of '%s': the replay gave nothing to '%s' (op %zu of the region)", r->name,
              kpl_op_name(n->op), n->region_index + 1);
    return KPL_OK;
}
