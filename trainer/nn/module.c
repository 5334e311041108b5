/*
 * module.c — the module tree: names, tensors, children, modes, the
 * flattened state-dict view and the forward wrapper.  The layers are in
 * layers.c, the model zoo in zoo.c.
 */
#include "module.h"
#include "nn_impl.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NAME_MAX_LEN 63

typedef struct {
    char name[NAME_MAX_LEN + 1];
    kpl_tensor *t;
} entry;

/* A growing array of tensors with their dotted names: the flattened view. */
typedef struct {
    kpl_tensor **t;
    char **name;
    int n, cap;
    bool valid;
} flat;

struct kpl_module {
    const kpl_module_kind *kind;
    void *state;
    kpl_module *parent;
    char name[NAME_MAX_LEN + 1];
    kpl_device *dev;
    kpl_rng *rng; /* the root's; children borrow it */
    entry *params, *buffers;
    int nparams, nbuffers, cap_params, cap_buffers;
    kpl_module **children;
    int nchildren, cap_children;
    bool training, frozen;
    bool recompute_unit, recompute; /* kpl_module_mark_recompute_unit, kpl_module_set_recompute */
    bool recompute_root;            /* its last recomputed forward was a root call (depth 0) */
    kpl__recompute_span *spans[4];  /* kpl_module_mark_recompute_span's (owned) */
    int nspans;
    double flops;
    bool flops_input_grad;
    flat fparams, fbuffers;
};

/* ---- the tree ------------------------------------------------------------------------ */

static kpl_status check_name(const kpl_module *m, const char *name)
{
    KPL_CHECK(name && *name, KPL_EINVAL, "module %s: a child or tensor needs a name",
              m->name[0] ? m->name : "(root)");
    size_t len = strlen(name);
    KPL_CHECK(len <= NAME_MAX_LEN, KPL_EINVAL, "module %s: name '%.80s' is longer than %d bytes",
              m->name[0] ? m->name : "(root)", name, NAME_MAX_LEN);
    for (size_t i = 0; i < len; i++)
        KPL_CHECK(isalnum((unsigned char)name[i]) || name[i] == '_', KPL_EINVAL,
                  "module %s: name '%s' has '%c' (names are [A-Za-z0-9_], dots join them)",
                  m->name[0] ? m->name : "(root)", name, name[i]);
    bool taken = kpl_module_get_param(m, name) || kpl_module_get_buffer(m, name);
    for (int i = 0; i < m->nchildren && !taken; i++) taken = !strcmp(m->children[i]->name, name);
    KPL_CHECK(!taken, KPL_EINVAL, "module %s: the name '%s' is taken",
              m->name[0] ? m->name : "(root)", name);
    return KPL_OK;
}

/* Something was added under m: the flattened views of m and its
 * ancestors are out of date. */
static void invalidate(kpl_module *m)
{
    for (; m; m = m->parent) m->fparams.valid = m->fbuffers.valid = false;
}

static kpl_module *alloc_module(const kpl_module_kind *kind, void *state)
{
    kpl_module *m = calloc(1, sizeof *m);
    if (!m) {
        if (kind && kind->state_free) kind->state_free(state);
        return NULL;
    }
    m->kind = kind;
    m->state = state;
    m->training = true;
    return m;
}

kpl_status kpl_module_create_root(kpl_device *dev, uint64_t seed, const kpl_module_kind *kind,
                                  void *state, kpl_module **out)
{
    *out = NULL;
    KPL_CHECK(kind && kind->name && kind->forward, KPL_EINVAL,
              "module: a kind needs a name and a forward function");
    kpl_module *m = alloc_module(kind, state);
    KPL_CHECK(m, KPL_ENOMEM, "module %s: out of memory", kind->name);
    m->dev = dev ? dev : kpl_device_cpu();
    if (!(m->rng = kpl_rng_create(seed))) {
        kpl_module_destroy(m);
        return KPL_ERROR(KPL_ENOMEM, "module %s: out of memory", kind->name);
    }
    *out = m;
    return KPL_OK;
}

static kpl_status grow(void **arr, int *cap, int n, size_t size)
{
    if (n < *cap) return KPL_OK;
    int nc = *cap ? 2 * *cap : 8;
    void *p = realloc(*arr, (size_t)nc * size);
    KPL_CHECK(p, KPL_ENOMEM, "module: out of memory");
    *arr = p;
    *cap = nc;
    return KPL_OK;
}

kpl_status kpl_module_create(kpl_module *parent, const char *name, const kpl_module_kind *kind,
                             void *state, kpl_module **out)
{
    if (out) *out = NULL;
    kpl_status st = KPL_OK;
    if (!parent || !kind || !kind->name || !kind->forward) {
        st = KPL_ERROR(KPL_EINVAL, "module: a child needs a parent and a kind with a name and a "
                                   "forward function");
        goto fail;
    }
    KPL_TRY_GOTO(check_name(parent, name));
    KPL_TRY_GOTO(grow((void **)&parent->children, &parent->cap_children, parent->nchildren,
                      sizeof *parent->children));
    kpl_module *m = alloc_module(kind, state);
    state = NULL;
    if (!m) {
        st = KPL_ERROR(KPL_ENOMEM, "module %s: out of memory", kind->name);
        goto fail;
    }
    snprintf(m->name, sizeof m->name, "%s", name);
    m->parent = parent;
    m->dev = parent->dev;
    m->training = parent->training;
    m->frozen = parent->frozen;
    if (m->frozen) m->training = false;
    parent->children[parent->nchildren++] = m;
    invalidate(parent);
    if (out) *out = m;
    return KPL_OK;
fail:
    if (state && kind && kind->state_free) kind->state_free(state);
    return st;
}

static void flat_free(flat *f)
{
    for (int i = 0; i < f->n; i++) free(f->name[i]);
    free(f->t);
    free(f->name);
    memset(f, 0, sizeof *f);
}

static void free_tree(kpl_module *m)
{
    for (int i = 0; i < m->nchildren; i++) free_tree(m->children[i]);
    for (int i = 0; i < m->nparams; i++) kpl_tensor_release(m->params[i].t);
    for (int i = 0; i < m->nbuffers; i++) kpl_tensor_release(m->buffers[i].t);
    if (m->kind && m->kind->state_free) m->kind->state_free(m->state);
    flat_free(&m->fparams);
    flat_free(&m->fbuffers);
    free(m->children);
    free(m->params);
    free(m->buffers);
    kpl_rng_destroy(m->rng);
    for (int i = 0; i < m->nspans; i++)
        free(m->spans[i]);
    free(m);
}

void kpl_module_destroy(kpl_module *m)
{
    if (!m) return;
    KPL_ASSERT(!m->parent, "kpl_module_destroy: a child goes with its root");
    free_tree(m);
}

static kpl_status add_tensor(kpl_module *m, const char *name, kpl_tensor *t, bool param)
{
    kpl_status st = KPL_OK;
    KPL_TRY_GOTO(t ? KPL_OK : kpl_last_status() < 0 ? kpl_last_status()
                                                     : KPL_ERROR(KPL_EINVAL, "module: NULL tensor"));
    KPL_TRY_GOTO(check_name(m, name));
    if (param) {
        KPL_TRY_GOTO(grow((void **)&m->params, &m->cap_params, m->nparams, sizeof *m->params));
        if (!m->frozen) KPL_TRY_GOTO(kpl_set_requires_grad(t, true));
        snprintf(m->params[m->nparams].name, NAME_MAX_LEN + 1, "%s", name);
        m->params[m->nparams++].t = t;
    } else {
        KPL_TRY_GOTO(grow((void **)&m->buffers, &m->cap_buffers, m->nbuffers, sizeof *m->buffers));
        snprintf(m->buffers[m->nbuffers].name, NAME_MAX_LEN + 1, "%s", name);
        m->buffers[m->nbuffers++].t = t;
    }
    invalidate(m);
    return KPL_OK;
fail:
    kpl_tensor_release(t);
    return st;
}

kpl_status kpl_module_add_param(kpl_module *m, const char *name, kpl_tensor *t)
{
    return add_tensor(m, name, t, true);
}

kpl_status kpl_module_add_buffer(kpl_module *m, const char *name, kpl_tensor *t)
{
    return add_tensor(m, name, t, false);
}

kpl_status kpl__module_rename_param(kpl_module *m, const char *from, const char *to)
{
    int i = 0;
    while (i < m->nparams && strcmp(m->params[i].name, from)) i++;
    KPL_CHECK(i < m->nparams, KPL_ENOTFOUND, "module %s: no parameter '%s'",
              m->name[0] ? m->name : "(root)", from);
    KPL_TRY(check_name(m, to));
    entry e = m->params[i];
    memmove(m->params + i, m->params + i + 1, (size_t)(m->nparams - i - 1) * sizeof *m->params);
    snprintf(e.name, sizeof e.name, "%s", to);
    m->params[m->nparams - 1] = e;
    invalidate(m);
    return KPL_OK;
}

const kpl_module_kind *kpl_module_kind_of(const kpl_module *m) { return m->kind; }
void *kpl_module_state(const kpl_module *m) { return m->state; }
const char *kpl_module_name(const kpl_module *m) { return m->name; }
kpl_module *kpl_module_parent(const kpl_module *m) { return m->parent; }
kpl_device *kpl_module_device(const kpl_module *m) { return m->dev; }

kpl_rng *kpl_module_rng(const kpl_module *m)
{
    while (m->parent) m = m->parent;
    return m->rng;
}

int kpl_module_num_children(const kpl_module *m) { return m->nchildren; }
kpl_module *kpl_module_child(const kpl_module *m, int i)
{
    KPL_ASSERT(i >= 0 && i < m->nchildren, "kpl_module_child: index out of range");
    return m->children[i];
}

kpl_module *kpl_module_find(const kpl_module *m, const char *dotted)
{
    while (m && dotted && *dotted) {
        const char *dot = strchr(dotted, '.');
        size_t len = dot ? (size_t)(dot - dotted) : strlen(dotted);
        const kpl_module *next = NULL;
        for (int i = 0; i < m->nchildren && !next; i++)
            if (strlen(m->children[i]->name) == len && !memcmp(m->children[i]->name, dotted, len))
                next = m->children[i];
        m = next;
        dotted = dot ? dot + 1 : NULL;
    }
    return (kpl_module *)m;
}

static kpl_tensor *find_entry(const entry *e, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(e[i].name, name)) return e[i].t;
    return NULL;
}

kpl_tensor *kpl_module_get_param(const kpl_module *m, const char *name)
{
    return find_entry(m->params, m->nparams, name);
}

kpl_tensor *kpl_module_get_buffer(const kpl_module *m, const char *name)
{
    return find_entry(m->buffers, m->nbuffers, name);
}

int kpl_module_num_own_params(const kpl_module *m) { return m->nparams; }
kpl_tensor *kpl_module_own_param(const kpl_module *m, int i) { return m->params[i].t; }
int kpl_module_num_own_buffers(const kpl_module *m) { return m->nbuffers; }
kpl_tensor *kpl_module_own_buffer(const kpl_module *m, int i) { return m->buffers[i].t; }

/* ---- the flattened view ------------------------------------------------------------------ */

static bool flat_push(flat *f, const char *prefix, const char *name, kpl_tensor *t)
{
    if (f->n == f->cap) {
        int nc = f->cap ? 2 * f->cap : 16;
        kpl_tensor **nt = realloc(f->t, (size_t)nc * sizeof *nt);
        if (!nt) return false;
        f->t = nt;
        char **nn = realloc(f->name, (size_t)nc * sizeof *nn);
        if (!nn) return false;
        f->name = nn;
        f->cap = nc;
    }
    size_t len = strlen(prefix) + strlen(name) + 1;
    char *s = malloc(len);
    if (!s) return false;
    snprintf(s, len, "%s%s", prefix, name);
    f->name[f->n] = s;
    f->t[f->n++] = t;
    return true;
}

/* Depth first, own tensors before the children's. */
static bool collect(const kpl_module *m, bool params, const char *prefix, flat *f)
{
    const entry *e = params ? m->params : m->buffers;
    int n = params ? m->nparams : m->nbuffers;
    for (int i = 0; i < n; i++)
        if (!flat_push(f, prefix, e[i].name, e[i].t)) return false;
    for (int i = 0; i < m->nchildren; i++) {
        size_t len = strlen(prefix) + strlen(m->children[i]->name) + 2;
        char *p = malloc(len);
        if (!p) return false;
        snprintf(p, len, "%s%s.", prefix, m->children[i]->name);
        bool ok = collect(m->children[i], params, p, f);
        free(p);
        if (!ok) return false;
    }
    return true;
}

/* The flattened view of m, rebuilt when something was added.  Out of
 * memory here is fatal: the accessors have no status to return. */
static flat *view(kpl_module *m, bool params)
{
    flat *f = params ? &m->fparams : &m->fbuffers;
    if (f->valid) return f;
    flat_free(f);
    KPL_ASSERT(collect(m, params, "", f), "module: out of memory listing its tensors");
    f->valid = true;
    return f;
}

int kpl_module_num_params(kpl_module *m) { return view(m, true)->n; }
kpl_tensor *const *kpl_module_params(kpl_module *m) { return view(m, true)->t; }
const char *kpl_module_param_name(kpl_module *m, int i)
{
    flat *f = view(m, true);
    KPL_ASSERT(i >= 0 && i < f->n, "kpl_module_param_name: index out of range");
    return f->name[i];
}
int kpl_module_num_buffers(kpl_module *m) { return view(m, false)->n; }
kpl_tensor *const *kpl_module_buffers(kpl_module *m) { return view(m, false)->t; }
const char *kpl_module_buffer_name(kpl_module *m, int i)
{
    flat *f = view(m, false);
    KPL_ASSERT(i >= 0 && i < f->n, "kpl_module_buffer_name: index out of range");
    return f->name[i];
}

int kpl_module_param_index(kpl_module *m, const char *dotted)
{
    flat *f = view(m, true);
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->name[i], dotted)) return i;
    return -1;
}

int64_t kpl_module_param_count(kpl_module *m)
{
    flat *f = view(m, true);
    int64_t n = 0;
    for (int i = 0; i < f->n; i++) n += kpl_tensor_numel(f->t[i]);
    return n;
}

/* ---- modes ------------------------------------------------------------------------------ */

void kpl_module_set_training(kpl_module *m, bool on)
{
    m->training = on && !m->frozen;
    for (int i = 0; i < m->nchildren; i++) kpl_module_set_training(m->children[i], on);
}

bool kpl_module_training(const kpl_module *m) { return m->training; }

kpl_status kpl_module_freeze(kpl_module *m)
{
    m->frozen = true;
    m->training = false;
    for (int i = 0; i < m->nparams; i++) KPL_TRY(kpl_set_requires_grad(m->params[i].t, false));
    for (int i = 0; i < m->nchildren; i++) KPL_TRY(kpl_module_freeze(m->children[i]));
    return KPL_OK;
}

bool kpl_module_frozen(const kpl_module *m) { return m->frozen; }

kpl_status kpl_module_set_requires_grad(kpl_module *m, bool on)
{
    for (int i = 0; i < m->nparams; i++)
        KPL_TRY(kpl_set_requires_grad(m->params[i].t, on && !m->frozen));
    for (int i = 0; i < m->nchildren; i++) KPL_TRY(kpl_module_set_requires_grad(m->children[i], on));
    return KPL_OK;
}

/* ---- forward ---------------------------------------------------------------------------- */

/* "layer1.0.conv1" into buf. */
static void path_of(const kpl_module *m, char *buf, size_t size)
{
    const kpl_module *chain[64];
    int n = 0;
    for (const kpl_module *p = m; p->parent && n < 64; p = p->parent) chain[n++] = p;
    size_t off = 0;
    buf[0] = 0;
    for (int i = n - 1; i >= 0 && off < size; i--)
        off += (size_t)snprintf(buf + off, size - off, "%s%s", i == n - 1 ? "" : ".",
                                chain[i]->name);
    if (!n) snprintf(buf, size, "(root)");
}

/* Modules inside modules: the outermost forward's results leave autocast
 * (graph.h) in f32, so a task reads a model's outputs as f32 whatever
 * precision ran inside; modules within pass low-precision tensors on. */
static _Thread_local int depth;

static kpl_status outputs_f32(kpl_tensor_list *out)
{
    if (kpl_autocast_dtype() == KPL_F32) return KPL_OK;
    for (int i = 0; i < out->n; i++) {
        kpl_dtype dt = kpl_tensor_dtype(out->t[i]);
        if (dt != KPL_BF16 && dt != KPL_F16) continue;
        out->t[i] = kpl_cast(out->t[i], KPL_F32);
        if (!out->t[i]) return kpl_last_status();
    }
    return KPL_OK;
}

/* A recomputed module's forward run again in the backward (graph.h). */
static kpl_status forward_again(void *user, int n, kpl_tensor *const *inputs)
{
    kpl_module *m = user;
    kpl_tensor_list in = {.n = n}, out;
    memcpy(in.t, inputs, (size_t)n * sizeof *inputs);
    int prev = depth;
    depth = m->recompute_root ? 0 : 1; /* the same casts at the end as the first time */
    kpl_status st = kpl_module_forward_list(m, &in, &out);
    depth = prev;
    return st;
}

kpl_status kpl_module_forward_list(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    out->n = 0;
    char path[256];
    KPL_CHECK(in && in->n >= 1 && in->n <= KPL_MODULE_MAX_IO, KPL_EINVAL,
              "module %s (%s): %d inputs (1 to %d)", (path_of(m, path, sizeof path), path),
              m->kind->name, in ? in->n : 0, KPL_MODULE_MAX_IO);
    for (int i = 0; i < in->n; i++)
        if (!in->t[i]) {
            /* an op before this module failed: keep its message */
            kpl_status st = kpl_last_status();
            if (st < 0) return st;
            path_of(m, path, sizeof path);
            return KPL_ERROR(KPL_EINVAL, "module %s (%s): input %d is NULL", path, m->kind->name,
                             i);
        }
    kpl_recompute *region = NULL;
    if (m->recompute) {
        KPL_TRY(kpl_recompute_begin((path_of(m, path, sizeof path), path), in->n, in->t,
                                    forward_again, m, &region));
        if (region) m->recompute_root = depth == 0;
    }
    /* the memory profile names the module its blocks were made in; so
     * does a budget's error (memory.budget_mb) */
    bool mem = kpl_memrec_active() || kpl_device_budget(m->dev) > 0;
    uint32_t mem_prev = mem ? kpl_mem_context_set(kpl_mem_label((path_of(m, path, sizeof path), path)))
                            : 0;
    /* The forward's temporaries (a linear's product before its bias, a
     * transposed convolution's output before its bias) go when it ends,
     * not with the caller's pool at the end of the whole forward: U-Net's
     * decoder kept 15 MB of them at its peak (docs/memory.md).  The
     * outputs move to the caller's pool. */
    kpl_pool *pool = kpl_pool_push();
    kpl_status st = pool ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "module: no host memory for a pool");
    if (pool) {
        depth++;
        st = m->kind->forward(m, in, out);
        depth--;
    }
    bool moved = pool && st >= 0 && out->n >= 0 && out->n <= KPL_MODULE_MAX_IO;
    for (int i = 0; moved && i < out->n; i++)
        if (out->t[i]) kpl_tensor_retain(out->t[i]);
    if (pool) kpl_pool_pop(pool);
    for (int i = 0; moved && i < out->n; i++)
        if (out->t[i]) kpl_autorelease(out->t[i]);
    if (mem) kpl_mem_context_set(mem_prev);
    if (st >= 0) {
        for (int i = 0; i < out->n; i++)
            if (!out->t[i]) st = kpl_last_status() < 0 ? kpl_last_status() : KPL_EINVAL;
        if (st >= 0 && out->n >= 1 && out->n <= KPL_MODULE_MAX_IO && depth == 0)
            st = outputs_f32(out);
    }
    if (region) {
        kpl_status est = kpl_recompute_end(region, st >= 0 ? out->n : 0, out->t);
        if (st >= 0) st = est;
    }
    if (st >= 0 && out->n >= 1 && out->n <= KPL_MODULE_MAX_IO) return KPL_OK;
    if (st >= 0) st = KPL_EINVAL;
    out->n = 0;
    /* The module whose own op failed says who it is (a leaf, or a parent
     * combining its children's outputs); its ancestors pass it on. */
    if (strncmp(kpl_last_error(), "module ", 7) != 0) {
        path_of(m, path, sizeof path);
        if (!kpl_last_error()[0]) return KPL_ERROR(st, "module %s (%s): its forward gave no output",
                                                   path, m->kind->name);
        return kpl_error_prefix(st, "module %s (%s): ", path, m->kind->name);
    }
    return st;
}

/* The first module at or under m whose kind is not replayable. */
static const kpl_module *not_replayable(const kpl_module *m)
{
    if (!(m->kind->flags & KPL_MODULE_REPLAYABLE)) return m;
    for (int i = 0; i < m->nchildren; i++) {
        const kpl_module *b = not_replayable(m->children[i]);
        if (b) return b;
    }
    return NULL;
}

/* KPL_EINVAL naming m and the first module under it that is not
 * replayable, or KPL_OK. */
static kpl_status check_replayable(const kpl_module *m)
{
    const kpl_module *b = not_replayable(m);
    if (!b) return KPL_OK;
    char path[256], bpath[256];
    path_of(m, path, sizeof path);
    path_of(b, bpath, sizeof bpath);
    return KPL_ERROR(KPL_EINVAL,
                     "module %s (%s): cannot be recomputed: module %s is of kind '%s', which "
                     "does not declare KPL_MODULE_REPLAYABLE (a forward run again must compute "
                     "the same values and change nothing outside kpl's ops, e.g. write no "
                     "host memory; a kind that does so declares it in its flags)",
                     path, m->kind->name, bpath, b->kind->name);
}

kpl_status kpl_module_set_recompute(kpl_module *m, bool on)
{
    KPL_CHECK(m != NULL, KPL_EINVAL, "module: set_recompute of NULL");
    if (on) KPL_TRY(check_replayable(m));
    m->recompute = on;
    return KPL_OK;
}

bool kpl_module_recompute(const kpl_module *m)
{
    return m && m->recompute;
}

void kpl_module_mark_recompute_unit(kpl_module *m)
{
    if (m) m->recompute_unit = true;
}

bool kpl_module_recompute_unit(const kpl_module *m)
{
    return m && m->recompute_unit;
}

kpl_status kpl_module_mark_recompute_span(kpl_module *m, int from, int to)
{
    KPL_CHECK(m && from >= 0 && from < to && to <= m->nchildren, KPL_EINVAL,
              "module: recompute span %d..%d is not a run of the module's %d children", from,
              to - 1, m ? m->nchildren : 0);
    KPL_CHECK(m->nspans < 4, KPL_ERANGE, "module: at most 4 recompute spans a module");
    kpl__recompute_span *s = calloc(1, sizeof *s);
    KPL_CHECK(s, KPL_ENOMEM, "module: out of memory");
    *s = (kpl__recompute_span){m, from, to, false};
    m->spans[m->nspans++] = s;
    return KPL_OK;
}

const kpl__recompute_span *kpl__module_span(const kpl_module *m, int from)
{
    for (int i = 0; i < m->nspans; i++)
        if (m->spans[i]->on && m->spans[i]->from == from) return m->spans[i];
    return NULL;
}

int kpl__module_depth_set(int d)
{
    int prev = depth;
    depth = d;
    return prev;
}

static kpl_status units(kpl_module *m, bool on, int *count)
{
    if (m->recompute_unit) {
        KPL_TRY(kpl_module_set_recompute(m, on));
        (*count)++;
    }
    for (int i = 0; i < m->nspans; i++) {
        kpl__recompute_span *s = m->spans[i];
        for (int k = s->from; on && k < s->to; k++)
            KPL_TRY(check_replayable(m->children[k]));
        s->on = on;
        (*count)++;
    }
    for (int i = 0; i < m->nchildren; i++)
        KPL_TRY(units(m->children[i], on, count));
    return KPL_OK;
}

kpl_status kpl_module_recompute_units(kpl_module *m, bool on, int *count)
{
    KPL_CHECK(m != NULL, KPL_EINVAL, "module: recompute_units of NULL");
    int n = 0;
    kpl_status st = units(m, on, &n);
    if (count) *count = n;
    return st;
}

kpl_tensor *kpl_module_forward(kpl_module *m, kpl_tensor *x)
{
    if (!x) return NULL;
    kpl_tensor_list in = {1, {x}}, out;
    if (kpl_module_forward_list(m, &in, &out) < 0) return NULL;
    if (out.n != 1) {
        char path[256];
        path_of(m, path, sizeof path);
        KPL_ERROR(KPL_EINVAL, "module %s (%s) gives %d outputs: use kpl_module_forward_list",
                  path, m->kind->name, out.n);
        return NULL;
    }
    return out.t[0];
}

void kpl_module_set_flops(kpl_module *m, double flops, bool input_grad)
{
    m->flops = flops;
    m->flops_input_grad = input_grad;
}

double kpl_module_flops(kpl_module *m, bool train_flops)
{
    double f = m->flops * (train_flops ? (m->flops_input_grad ? 3.0 : 2.0) : 1.0);
    for (int i = 0; i < m->nchildren; i++) f += kpl_module_flops(m->children[i], train_flops);
    return f;
}

static void save_modes(kpl_module *m, bool *modes, int *k, bool restore)
{
    if (restore) m->training = modes[*k];
    else modes[*k] = m->training;
    (*k)++;
    for (int i = 0; i < m->nchildren; i++) save_modes(m->children[i], modes, k, restore);
}

static int count_modules(const kpl_module *m)
{
    int n = 1;
    for (int i = 0; i < m->nchildren; i++) n += count_modules(m->children[i]);
    return n;
}

kpl_status kpl_module_count_flops(kpl_module *m, int ndim, const int64_t *sample_shape,
                                  bool train_flops, double *flops)
{
    KPL_CHECK(ndim >= 1 && ndim < KPL_MAX_DIMS, KPL_EINVAL, "module: a sample has 1 to %d dims",
              KPL_MAX_DIMS - 1);
    int64_t shape[KPL_MAX_DIMS];
    shape[0] = 1;
    memcpy(shape + 1, sample_shape, (size_t)ndim * sizeof *shape);
    int nm = count_modules(m), k = 0;
    bool *modes = malloc((size_t)nm * sizeof *modes);
    KPL_CHECK(modes, KPL_ENOMEM, "module: out of memory");
    save_modes(m, modes, &k, false);
    kpl_module_set_training(m, false);
    bool grad = kpl_set_grad_enabled(true);
    kpl_pool *p = kpl_pool_push();
    kpl_status st = KPL_OK;
    if (!p) {
        st = kpl_last_status();
    } else {
        kpl_tensor *x = kpl_full(m->dev, KPL_F32, ndim + 1, shape, 0);
        kpl_tensor_list in = {1, {x}}, out;
        st = x ? kpl_module_forward_list(m, &in, &out) : kpl_last_status();
        kpl_pool_pop(p);
    }
    kpl_set_grad_enabled(grad);
    k = 0;
    save_modes(m, modes, &k, true);
    free(modes);
    KPL_TRY(st);
    *flops = kpl_module_flops(m, train_flops);
    return KPL_OK;
}

kpl_status kpl_module_probe(kpl_module *m, int ndim, const int64_t *shape, int *out_ndim,
                             int64_t *out_shape)
{
    kpl_pool *p = kpl_pool_push();
    bool grad = kpl_set_grad_enabled(false), training = kpl_module_training(m);
    kpl_module_set_training(m, false);
    kpl_tensor *x = kpl_full(kpl_module_device(m), KPL_F32, ndim, shape, 0);
    kpl_tensor_list in = {1, {x}}, out;
    kpl_status st = x ? kpl_module_forward_list(m, &in, &out) : kpl_last_status();
    if (st >= 0) {
        *out_ndim = kpl_tensor_ndim(out.t[0]);
        memcpy(out_shape, kpl_tensor_shape(out.t[0]), sizeof *out_shape * (size_t)*out_ndim);
    }
    kpl_module_set_training(m, training);
    kpl_set_grad_enabled(grad);
    kpl_pool_pop(p);
    return st;
}
