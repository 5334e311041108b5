/*
 * trace.c — recording a function's eager ops as GraphIR.
 *
 * The eager ops report what they computed (kpl__trace_op) while a trace is
 * open on the thread.  The tracer maps each tensor header it has seen to
 * its value without holding it: a header freed while the trace is open
 * (on any thread) is forgotten through the tensor free hook before its
 * memory goes, so a new header at the same address is not mistaken for
 * it, and the traced function's values die when it drops them, as in
 * eager mode (holding them kept a traced forward's every activation alive
 * to the end).  The map is shared with that hook: every access holds
 * tr_lock (recursive: a free inside a traced call reaches the hook on the
 * same thread).  A tensor first seen as an op's
 * input is a parameter when it is older than the trace (kpl_tensor_serial),
 * a constant when the op that made it said so (kpl__trace_const); anything
 * else was made outside the traced ops, which the graph cannot repeat, and
 * fails the trace.  A host read or write of a traced value fails it too:
 * whatever the function did with the bytes is not in the graph.
 */
#include "graph_impl.h"
#include "ir_impl.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    kpl_tensor *t;  /* not held; NULL: an empty slot, GONE: a freed header's */
    int v;          /* its value now (a write gives it a new one) */
    int param;      /* the parameter value a write into it updates, else -1 */
    bool host_read; /* read on the host while a parameter of the trace */
} slot;

typedef struct tracer {
    struct tracer *next; /* open tracers (tr_lock) */
    kpl_ir *ir;
    slot *map; /* open addressing on the header address */
    size_t cap, n; /* n: slots in use, freed headers' included */
    uint64_t serial0;
    kpl_status st;
    char msg[512];
    kpl_host_access_hook prev_hook;
    void *prev_user;
} tracer;

static _Thread_local tracer *tl_tr;
static pthread_mutex_t tr_lock; /* recursive, made once (lock_init) */
static pthread_once_t tr_lock_once = PTHREAD_ONCE_INIT;
static tracer *open_tracers;
static atomic_int n_open;
static char gone_;
#define GONE ((kpl_tensor *)&gone_)

bool kpl_tracing(void) { return tl_tr != NULL; }

static void lock_init(void)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&tr_lock, &a);
    pthread_mutexattr_destroy(&a);
}

static void lock(void)
{
    pthread_once(&tr_lock_once, lock_init);
    pthread_mutex_lock(&tr_lock);
}

static void unlock(void) { pthread_mutex_unlock(&tr_lock); }

static bool live(const slot *s) { return s->t && s->t != GONE; }

static slot *map_find(const tracer *tr, const kpl_tensor *t)
{
    if (!tr->cap) return NULL;
    for (size_t i = kpl__hash_ptr(t, tr->cap);; i = (i + 1) & (tr->cap - 1)) {
        if (!tr->map[i].t) return NULL;
        if (tr->map[i].t == t) return &tr->map[i];
    }
}

/* The tensor free hook: every open tracer forgets the header. */
static void forget_header(const kpl_tensor *t)
{
    if (!atomic_load_explicit(&n_open, memory_order_acquire)) return;
    lock();
    for (tracer *tr = open_tracers; tr; tr = tr->next) {
        slot *s = map_find(tr, t);
        if (s) s->t = GONE;
    }
    unlock();
}

static int map_get(const tracer *tr, const kpl_tensor *t)
{
    const slot *s = map_find(tr, t);
    return s ? s->v : -1;
}

static void fail(tracer *tr, kpl_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fail(tracer *tr, kpl_status st, const char *fmt, ...)
{
    if (tr->st < 0) return; /* keep the first */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tr->msg, sizeof tr->msg, fmt, ap);
    va_end(ap);
    tr->st = st;
}

static bool map_put(tracer *tr, kpl_tensor *t, int v)
{
    if ((tr->n + 1) * 2 > tr->cap) { /* rehashed without the freed headers' slots */
        size_t alive = 1, ncap = 256;
        for (size_t i = 0; i < tr->cap; i++) alive += live(&tr->map[i]);
        while (ncap < 4 * alive) ncap *= 2;
        slot *nm = calloc(ncap, sizeof *nm);
        if (!nm) {
            fail(tr, KPL_ENOMEM, "trace: no host memory");
            return false;
        }
        size_t kept = 0;
        for (size_t i = 0; i < tr->cap; i++) {
            if (!live(&tr->map[i])) continue; /* freed headers' slots go */
            size_t j = kpl__hash_ptr(tr->map[i].t, ncap);
            while (nm[j].t) j = (j + 1) & (ncap - 1);
            nm[j] = tr->map[i];
            kept++;
        }
        free(tr->map);
        tr->map = nm;
        tr->cap = ncap;
        tr->n = kept;
    }
    size_t i = kpl__hash_ptr(t, tr->cap);
    while (tr->map[i].t) i = (i + 1) & (tr->cap - 1);
    tr->map[i] = (slot){t, v, -1, false};
    tr->n++;
    return true;
}

/* A new value for tensor t, mapped to it. */
static int new_value(tracer *tr, kpl_tensor *t, kpl_irv_kind kind, const char *name)
{
    int v = kpl_ir_add_value(tr->ir, kind, kpl_tensor_dtype(t), kpl_tensor_ndim(t),
                             kpl_tensor_shape(t), name,
                             kind == KPL_IRV_PARAM || kind == KPL_IRV_CONST ? t : NULL);
    if (v < 0) {
        fail(tr, kpl_last_status(), "trace: %s", kpl_last_error());
        return -1;
    }
    if (!map_put(tr, t, v)) return -1;
    return v;
}

static void host_access_locked(const kpl_tensor *t, bool write, void *user)
{
    tracer *tr = user;
    int v = map_get(tr, t);
    if (v < 0) { /* a view made outside the ops (kpl_tensor_reshape) of a traced value? */
        for (size_t i = 0; i < tr->cap && v < 0; i++)
            if (live(&tr->map[i]) && kpl_tensor_shares_storage(tr->map[i].t, t) &&
                tr->ir->v[tr->map[i].v].kind != KPL_IRV_PARAM &&
                tr->ir->v[tr->map[i].v].kind != KPL_IRV_CONST)
                v = tr->map[i].v;
    }
    char b[96];
    if (v < 0) {
        /* a tensor from before the trace the graph has not read yet: a
         * write to it would not be repeated if the graph reads it later */
        if (write && kpl_tensor_serial(t) < tr->serial0)
            fail(tr, KPL_EINVAL,
                 "trace: the traced function wrote a tensor from before the trace %s on the "
                 "host; the graph would not repeat that write",
                 kpl_shape_str(kpl_tensor_ndim(t), kpl_tensor_shape(t), b, sizeof b));
        return;
    }
    const kpl_irv *val = &tr->ir->v[v];
    if (val->kind == KPL_IRV_PARAM || val->kind == KPL_IRV_CONST) {
        /* reading them is fine while they are what they were (a write of
         * the step refuses a parameter read so); a write is not in the
         * graph, which would repeat the trace without it */
        slot *sl = map_find(tr, t);
        if (sl && !write) sl->host_read = true;
        if (write)
            fail(tr, KPL_EINVAL,
                 "trace: the traced function wrote %s %%%d %s on the host; the graph would not "
                 "repeat that write (an optimizer keeping its state on the host?)",
                 val->kind == KPL_IRV_PARAM ? "parameter" : "constant", v,
                 kpl_shape_str(val->ndim, val->shape, b, sizeof b));
        return;
    }
    fail(tr, KPL_EINVAL,
         "trace: the traced function %s the values of %%%d %s (%s) on the host; a graph cannot "
         "hold what it did with them (a branch on data, a loss preparing its labels on the "
         "host, an op computed outside kpl's ops)",
         write ? "wrote" : "read", v, kpl_shape_str(val->ndim, val->shape, b, sizeof b),
         val->node >= 0 ? kpl_op_name(tr->ir->n[val->node].op) : "a placeholder");
}

/* The public entries: each takes tr_lock around its work on the map. */
static void host_access(const kpl_tensor *t, bool write, void *user)
{
    lock();
    host_access_locked(t, write, user);
    unlock();
}

kpl_status kpl_trace_begin(void)
{
    KPL_CHECK(!tl_tr, KPL_ESTATE, "trace_begin: a trace is already open on this thread");
    tracer *tr = calloc(1, sizeof *tr);
    KPL_CHECK(tr, KPL_ENOMEM, "trace_begin: no host memory");
    kpl_status st = kpl_ir_create(&tr->ir);
    if (st < 0) {
        free(tr);
        return st;
    }
    tr->serial0 = kpl_tensor_serial_next();
    tr->prev_hook = kpl_set_host_access_hook(host_access, tr, &tr->prev_user);
    kpl_set_tensor_free_hook(forget_header);
    lock();
    tr->next = open_tracers;
    open_tracers = tr;
    atomic_fetch_add(&n_open, 1);
    unlock();
    tl_tr = tr;
    return KPL_OK;
}

static void close_tracer(tracer *tr, bool keep_ir)
{
    kpl_set_host_access_hook(tr->prev_hook, tr->prev_user, NULL);
    tl_tr = NULL;
    lock();
    for (tracer **p = &open_tracers; *p; p = &(*p)->next)
        if (*p == tr) {
            *p = tr->next;
            break;
        }
    atomic_fetch_sub(&n_open, 1);
    unlock();
    free(tr->map);
    if (!keep_ir) kpl_ir_destroy(tr->ir);
    free(tr);
}

void kpl_trace_abort(void)
{
    if (tl_tr) close_tracer(tl_tr, false);
}

static kpl_tensor *trace_input_locked(kpl_tensor *x, const char *name)
{
    tracer *tr = tl_tr;
    if (!x) return NULL;
    if (!tr) {
        KPL_ERROR(KPL_ESTATE, "trace_input: no trace is open on this thread");
        return NULL;
    }
    if (map_get(tr, x) >= 0) {
        fail(tr, KPL_EINVAL, "trace_input: '%s' is already a value of the trace",
             name ? name : "input");
        KPL_ERROR(KPL_EINVAL, "%s", tr->msg);
        return NULL;
    }
    char def[32];
    if (!name) {
        snprintf(def, sizeof def, "input%d", tr->ir->ninputs);
        name = def;
    }
    int v = new_value(tr, x, KPL_IRV_INPUT, name);
    if (v < 0) {
        KPL_ERROR(tr->st, "%s", tr->msg);
        return NULL;
    }
    int *ni = realloc(tr->ir->inputs, (size_t)(tr->ir->ninputs + 1) * sizeof *ni);
    if (!ni) {
        fail(tr, KPL_ENOMEM, "trace: no host memory");
        KPL_ERROR(KPL_ENOMEM, "%s", tr->msg);
        return NULL;
    }
    tr->ir->inputs = ni;
    ni[tr->ir->ninputs++] = v;
    return x;
}

void kpl_trace_refuse(const char *fmt, ...)
{
    tracer *tr = tl_tr;
    if (!tr || tr->st < 0) return;
    char buf[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fail(tr, KPL_EINVAL, "trace: %s", buf);
}

bool kpl_trace_predates(const kpl_tensor *t)
{
    return tl_tr && t && kpl_tensor_serial(t) < tl_tr->serial0;
}

static void trace_alias_locked(kpl_tensor *alias, kpl_tensor *of)
{
    tracer *tr = tl_tr;
    if (!tr || tr->st < 0 || !alias || !of) return;
    int v = map_get(tr, of);
    if (v >= 0 && map_get(tr, alias) < 0) map_put(tr, alias, v);
}

static void trace_const_locked(kpl_tensor *t)
{
    tracer *tr = tl_tr;
    if (!tr || tr->st < 0 || !t) return;
    if (map_get(tr, t) < 0) new_value(tr, t, KPL_IRV_CONST, NULL);
}

/* The value of an op's input, adding parameters as they are first met. */
static int input_value(tracer *tr, kpl_op op, int i, kpl_tensor *t)
{
    int v = map_get(tr, t);
    if (v >= 0) return v;
    if (kpl_tensor_serial(t) < tr->serial0) return new_value(tr, t, KPL_IRV_PARAM, NULL);
    char b[96];
    fail(tr, KPL_EINVAL,
         "trace: input %d of '%s' (%s %s) was made outside the traced ops (by a kernel call, a "
         "host write, a view taken with kpl_tensor_*, or an op the tracer does not know), so "
         "the graph could not make it again",
         i, kpl_op_name(op), kpl_dtype_name(kpl_tensor_dtype(t)),
         kpl_shape_str(kpl_tensor_ndim(t), kpl_tensor_shape(t), b, sizeof b));
    return -1;
}

static void trace_op_locked(kpl_op op, const kpl_op_attrs *at, int nin, kpl_tensor *const *ins,
                            int nout, kpl_tensor *const *outs)
{
    tracer *tr = tl_tr;
    if (!tr || tr->st < 0) return;
    if (op == KPL_OP_CUSTOM) {
        fail(tr, KPL_EINVAL,
             "trace: custom op '%s' computes outside the graph and cannot be traced",
             at && at->custom && at->custom->name ? at->custom->name : "custom");
        return;
    }
    if (nin > KPL_IR_MAX_IN || nout > KPL_IR_MAX_OUT) {
        fail(tr, KPL_EINVAL, "trace: '%s' has %d inputs and %d outputs", kpl_op_name(op), nin,
             nout);
        return;
    }
    int in[KPL_IR_MAX_IN], out[KPL_IR_MAX_OUT];
    for (int i = 0; i < nin; i++) {
        in[i] = ins[i] ? input_value(tr, op, i, ins[i]) : -1;
        if (ins[i] && in[i] < 0) return;
    }
    for (int i = 0; i < nout; i++) {
        if (map_get(tr, outs[i]) >= 0) { /* an op handing back its input (dropout in eval) */
            fail(tr, KPL_EINVAL, "trace: '%s' returned a tensor the trace already holds",
                 kpl_op_name(op));
            return;
        }
        if ((out[i] = new_value(tr, outs[i], KPL_IRV_OP, NULL)) < 0) return;
    }
    kpl_op_attrs a = at ? *at : (kpl_op_attrs){0};
    a.custom = NULL;
    a.custom_user = NULL;
    if (kpl_ir_add_node(tr->ir, op, &a, nin, in, nout, out) < 0)
        fail(tr, kpl_last_status(), "trace: %s", kpl_last_error());
}

static void trace_write_locked(kpl_op op, const kpl_op_attrs *at, int nin,
                               kpl_tensor *const *ins, kpl_tensor *out)
{
    tracer *tr = tl_tr;
    if (!tr || tr->st < 0) return;
    int in[KPL_IR_MAX_IN];
    for (int i = 0; i < nin; i++) { /* the values before the write (out may be one) */
        in[i] = ins[i] ? input_value(tr, op, i, ins[i]) : -1;
        if (ins[i] && in[i] < 0) return;
    }
    slot *s = map_find(tr, out);
    int param = -1;
    /* the graph follows tensors, not bytes: a write through one of two
     * headers over the same bytes (a view of a parameter, a tensor with a
     * view taken) would leave the other's value stale */
    for (size_t i = 0; i < tr->cap; i++) {
        const slot *o = &tr->map[i];
        if (!live(o) || o->t == out || !kpl_tensor_shares_storage(o->t, out)) continue;
        if (s && o->v == s->v) continue; /* the tape's alias of the same value */
        char b[96];
        fail(tr, KPL_EINVAL,
             "trace: '%s' wrote %s %s, whose bytes %%%d shares (a view, or viewed); the graph "
             "cannot follow a write through one of two tensors",
             kpl_op_name(op), kpl_dtype_name(kpl_tensor_dtype(out)),
             kpl_shape_str(kpl_tensor_ndim(out), kpl_tensor_shape(out), b, sizeof b), o->v);
        return;
    }
    if (s) {
        const kpl_irv *old = &tr->ir->v[s->v];
        if (old->kind == KPL_IRV_CONST) {
            fail(tr, KPL_EINVAL,
                 "trace: '%s' wrote into constant %%%d, which the graph keeps as it was made",
                 kpl_op_name(op), s->v);
            return;
        }
        param = old->kind == KPL_IRV_PARAM ? s->v : s->param;
        if (s->host_read) {
            fail(tr, KPL_EINVAL,
                 "trace: '%s' updates parameter %%%d, which the traced function read on the "
                 "host before: the graph would keep using the value read then",
                 kpl_op_name(op), param);
            return;
        }
    } else if (kpl_tensor_serial(out) < tr->serial0) { /* written before it was read */
        if ((param = new_value(tr, out, KPL_IRV_PARAM, NULL)) < 0) return;
        s = map_find(tr, out);
    }
    int v = kpl_ir_add_value(tr->ir, KPL_IRV_OP, kpl_tensor_dtype(out), kpl_tensor_ndim(out),
                             kpl_tensor_shape(out), NULL, NULL);
    if (v < 0) {
        fail(tr, kpl_last_status(), "trace: %s", kpl_last_error());
        return;
    }
    if (s) s->v = v;
    else if (!map_put(tr, out, v)) return; /* a new tensor, written whole */
    else s = map_find(tr, out);
    s->param = param;
    kpl_op_attrs a = at ? *at : (kpl_op_attrs){0};
    a.custom = NULL;
    a.custom_user = NULL;
    if (kpl_ir_add_node(tr->ir, op, &a, nin, in, 1, &v) < 0 ||
        (param >= 0 && kpl_ir_add_update(tr->ir, param, v) < 0))
        fail(tr, kpl_last_status(), "trace: %s", kpl_last_error());
}

static kpl_status trace_end_locked(int nout, kpl_tensor *const *outs, const char *const *names,
                                   kpl_ir **out)
{
    tracer *tr = tl_tr;
    KPL_CHECK(tr, KPL_ESTATE, "trace_end: no trace is open on this thread");
    KPL_CHECK(out && nout >= 1 && outs, KPL_EINVAL, "trace_end: no outputs");
    *out = NULL;
    if (tr->st < 0) {
        kpl_status st = tr->st;
        KPL_ERROR(st, "%s", tr->msg);
        close_tracer(tr, false);
        return st;
    }
    int *ids = calloc((size_t)nout, sizeof *ids);
    kpl_status st = ids ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "trace_end: no host memory");
    for (int i = 0; i < nout && st == KPL_OK; i++) {
        int v = outs[i] ? map_get(tr, outs[i]) : -1;
        if (v < 0 || tr->ir->v[v].kind != KPL_IRV_OP)
            st = KPL_ERROR(KPL_EINVAL,
                           "trace_end: output %d is %s, not the result of a traced op", i,
                           !outs[i]  ? "NULL"
                           : v < 0   ? "a tensor the trace never saw"
                           : tr->ir->v[v].kind == KPL_IRV_INPUT ? "a placeholder"
                                                                : "a parameter or constant");
        else ids[i] = v;
    }
    if (st == KPL_OK) st = kpl_ir_set_io(tr->ir, 0, NULL, nout, ids, names);
    free(ids);
    kpl_ir *ir = tr->ir;
    close_tracer(tr, st == KPL_OK);
    if (st == KPL_OK && (st = kpl_ir_check(ir)) < 0) {
        kpl_ir_destroy(ir);
        return st;
    }
    if (st == KPL_OK) *out = ir;
    return st;
}

kpl_tensor *kpl_trace_input(kpl_tensor *x, const char *name)
{
    lock();
    kpl_tensor *r = trace_input_locked(x, name);
    unlock();
    return r;
}

void kpl__trace_alias(kpl_tensor *alias, kpl_tensor *of)
{
    if (!tl_tr) return;
    lock();
    trace_alias_locked(alias, of);
    unlock();
}

void kpl__trace_const(kpl_tensor *t)
{
    if (!tl_tr) return;
    lock();
    trace_const_locked(t);
    unlock();
}

void kpl__trace_op(kpl_op op, const kpl_op_attrs *at, int nin, kpl_tensor *const *ins, int nout,
                   kpl_tensor *const *outs)
{
    if (!tl_tr) return; /* the common case: no trace, no lock */
    lock();
    trace_op_locked(op, at, nin, ins, nout, outs);
    unlock();
}

void kpl__trace_write(kpl_op op, const kpl_op_attrs *at, int nin, kpl_tensor *const *ins,
                      kpl_tensor *out)
{
    if (!tl_tr) return;
    lock();
    trace_write_locked(op, at, nin, ins, out);
    unlock();
}

kpl_status kpl_trace_end(int nout, kpl_tensor *const *outs, const char *const *names,
                         kpl_ir **out)
{
    lock();
    kpl_status st = trace_end_locked(nout, outs, names, out);
    unlock();
    return st;
}
