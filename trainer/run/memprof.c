/*
 * memprof.c — the memory profile (profile.memory): over the profile.steps
 * window a memory recorder (kernels/memrec.c) logs every block the
 * training device's allocator hands out or takes back; when the window
 * ends, the peak of allocated bytes is found and every block live at it
 * is written to RUN_DIR/profile/memory-rank-NNNNN.json with its size, the
 * op and module that made it and why it is alive, grouped by reason in a
 * short table in the log; the trace gains the allocated bytes over time as
 * a counter track.  docs/memory.md describes the file.
 *
 * Why a block is alive, first match wins: the run's parameters and buffers
 * (found by pointer when the window ends: they live through it; a weight
 * is also saved by the ops that read it), a holder the graph noted (saved
 * for backward by an op), the run's gradients and optimizer state, the allocator's tag (a convolution's reorder
 * buffer, a derived copy: batch norm's statistics or a constant's packed
 * weights), live before the window began, and otherwise "in flight" (the
 * step's current activations, gradients and temporaries).
 */
#define _GNU_SOURCE
#include "run_impl.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

/* The reasons, in the order the table lists them. */
enum {
    R_SAVED, R_PARAM, R_BUFFER, R_GRAD, R_STATE, R_CONV, R_DERIVED, R_BEFORE, R_FLIGHT, R_COUNT
};
static const char *const reason_name[R_COUNT] = {
    "saved for backward", "parameter", "buffer", "gradient", "optimizer state",
    "convolution buffer", "derived copy", "live before the window", "in flight"};

/* A run-owned tensor's block and what it is. */
typedef struct {
    const void *ptr;
    int reason;
    char name[96];
} owned;

typedef struct {
    owned *o;
    size_t n, cap;
} owned_set;

static void add_owned(owned_set *s, const kpl_tensor *t, int reason, const char *fmt,
                      const char *name)
{
    const void *p = kpl_tensor_block(t);
    if (!p) return;
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 256;
        owned *o = realloc(s->o, cap * sizeof *o);
        if (!o) return; /* then the block reads as in flight */
        s->o = o, s->cap = cap;
    }
    owned *e = &s->o[s->n++];
    e->ptr = p;
    e->reason = reason;
    snprintf(e->name, sizeof e->name, fmt, name);
}

static int by_ptr(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)((const owned *)a)->ptr, y = (uintptr_t)((const owned *)b)->ptr;
    return x < y ? -1 : x > y;
}

/* Every parameter, buffer, gradient and optimizer state of the run's
 * models, by block (a DDP gradient bucket holds many gradients: the first
 * found names it). */
static void collect_owned(kpl_trainer *t, owned_set *s)
{
    for (int k = 0; k < t->nmodels; k++) {
        kpl__model *md = &t->models[k];
        int np = kpl_module_num_params(md->m), nb = kpl_module_num_buffers(md->m);
        kpl_tensor *const *ps = kpl_module_params(md->m), *const *bs = kpl_module_buffers(md->m);
        for (int i = 0; i < np; i++)
            add_owned(s, ps[i], R_PARAM, "%s", kpl_module_param_name(md->m, i));
        for (int i = 0; i < nb; i++)
            add_owned(s, bs[i], R_BUFFER, "%s", kpl_module_buffer_name(md->m, i));
        const char *const *slots = NULL;
        int ns = md->opt ? kpl_optim_state_slots(md->opt, &slots) : 0;
        for (int i = 0; i < md->np; i++) {
            add_owned(s, kpl_grad_get(md->params[i]), R_GRAD, "grad of %s", md->pnames[i]);
            for (int j = 0; j < ns; j++) {
                char what[96];
                snprintf(what, sizeof what, "%s of %%s", slots && slots[j] ? slots[j] : "state");
                add_owned(s, kpl_optim_state_get(md->opt, i, j), R_STATE, what, md->pnames[i]);
            }
        }
    }
    qsort(s->o, s->n, sizeof *s->o, by_ptr);
}

static const owned *find_owned(const owned_set *s, const void *p)
{
    size_t lo = 0, hi = s->n;
    while (lo < hi) { /* the first entry at p: parameters come before their gradients */
        size_t mid = (lo + hi) / 2;
        if ((uintptr_t)s->o[mid].ptr < (uintptr_t)p) lo = mid + 1;
        else hi = mid;
    }
    return lo < s->n && s->o[lo].ptr == p ? &s->o[lo] : NULL;
}

/* The context the trainer creates optimizers in (trainer.c). */
static uint32_t optimizer_label;

static int reason_of(const kpl_memrec_block *b, const owned *o)
{
    if (o && (o->reason == R_PARAM || o->reason == R_BUFFER)) return o->reason; /* (a weight
                                                   is also saved by the ops that read it) */
    if (b->reason) return R_SAVED;
    if (o) return o->reason;
    if (b->what && !strcmp(b->what, "conv2d")) return R_CONV;
    if (b->what && !strcmp(b->what, "derived copy")) return R_DERIVED;
    if (b->creator && b->creator == optimizer_label) return R_STATE; /* its workspace, lr */
    return b->before ? R_BEFORE : R_FLIGHT;
}

static int by_bytes(const void *a, const void *b)
{
    size_t x = ((const kpl_memrec_block *)a)->bytes, y = ((const kpl_memrec_block *)b)->bytes;
    return x > y ? -1 : x < y;
}

/* The trace's counter track, one point per allocation and free. */
static void on_point(void *ctx, double t, size_t bytes)
{
    kpl_trainer *tr = ctx;
    kpl__prof_counter(tr, "allocated MB", tr->memprof.t0 + t, (double)bytes / 1048576.0);
}

kpl_status kpl__memprof_begin(kpl_trainer *t)
{
    if (!t->r->profile.memory || t->memprof.rec) return KPL_OK;
    t->memprof.t0 = kpl_seconds();
    t->memprof.step = t->step + 1;
    kpl_status st = kpl_memrec_start(t->dev, &t->memprof.rec);
    if (st < 0) { /* the profile watches the run, it does not stop it */
        kpl__log_warn(&t->log, "profile.memory: %s; no memory profile", kpl_last_error());
        kpl_clear_error();
    }
    return KPL_OK;
}

static json_t *block_json(const kpl_memrec_block *b, const owned *o, int r)
{
    json_t *j = json_object();
    json_object_set_new(j, "bytes", json_integer((json_int_t)b->bytes));
    json_object_set_new(j, "reason", json_string(reason_name[r]));
    const char *why = r == R_SAVED ? kpl_mem_label_text(b->reason) : o ? o->name : "";
    if (*why) json_object_set_new(j, "holder", json_string(why));
    const char *made = kpl_mem_label_text(b->creator);
    json_object_set_new(j, "creator", json_string(*made ? made : b->before ? "(before the window)"
                                                                            : "(outside any op)"));
    json_object_set_new(j, "tag", json_string(b->what ? b->what : ""));
    return j;
}

/* Writes the profile of the window that just ended (called before the
 * trace closes, so the counter track goes into it). */
void kpl__memprof_end(kpl_trainer *t)
{
    kpl_memrec *rec = t->memprof.rec;
    if (!rec) return;
    kpl_memrec_stop(rec);
    t->memprof.rec = NULL;
    kpl_memrec_block *blk = NULL;
    size_t n = 0, peak = 0;
    double tp = 0;
    owned_set own = {0};
    json_t *root = NULL;
    if (kpl_memrec_peak(rec, &blk, &n, &peak, &tp) < 0) {
        kpl__log_warn(&t->log, "profile.memory: %s", kpl_last_error());
        kpl_clear_error();
        goto done;
    }
    kpl_memrec_timeline(rec, on_point, t);
    collect_owned(t, &own);
    optimizer_label = kpl_mem_label("optimizer");
    qsort(blk, n, sizeof *blk, by_bytes);
    size_t sum[R_COUNT] = {0}, count[R_COUNT] = {0};
    root = json_object();
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++) {
        const owned *o = find_owned(&own, blk[i].ptr);
        int r = reason_of(&blk[i], o);
        sum[r] += blk[i].bytes, count[r]++;
        json_array_append_new(arr, block_json(&blk[i], o, r));
    }
    json_t *by = json_array();
    for (int r = 0; r < R_COUNT; r++) {
        if (!count[r]) continue;
        json_t *e = json_object();
        json_object_set_new(e, "reason", json_string(reason_name[r]));
        json_object_set_new(e, "bytes", json_integer((json_int_t)sum[r]));
        json_object_set_new(e, "blocks", json_integer((json_int_t)count[r]));
        json_array_append_new(by, e);
    }
    kpl_memory_stats ms = kpl_device_memory_stats(t->dev);
    json_object_set_new(root, "rank", json_integer(t->rank));
    json_object_set_new(root, "device", json_string(kpl_device_name(t->dev)));
    json_object_set_new(root, "steps", json_pack("[II]", (json_int_t)t->memprof.step,
                                                 (json_int_t)t->step));
    json_object_set_new(root, "peak_bytes", json_integer((json_int_t)peak));
    json_object_set_new(root, "peak_at_s", json_real(tp));
    json_object_set_new(root, "reserved_bytes", json_integer((json_int_t)ms.reserved));
    json_object_set_new(root, "by_reason", by);
    json_object_set_new(root, "blocks", arr);
    char dir[PATH_MAX + 16], path[PATH_MAX + 64];
    snprintf(dir, sizeof dir, "%s/profile", t->run_dir);
    snprintf(path, sizeof path, "%s/memory-rank-%05d.json", dir, (int)t->rank);
    char *text = json_dumps(root, JSON_INDENT(1) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(6));
    kpl_status st = text ? kpl__mkdirs(dir) : KPL_ERROR(KPL_ENOMEM, "no host memory");
    if (st >= 0) st = kpl__write_file_atomic(path, text, strlen(text));
    free(text);
    if (st < 0) {
        kpl__log_warn(&t->log, "profile.memory: %s", kpl_last_error());
        kpl_clear_error();
        goto done;
    }
    kpl__log_info(&t->log, "profile.memory: steps %lld-%lld peaked at %.1f MB allocated (%zu "
                  "blocks), written to %s", (long long)t->memprof.step, (long long)t->step,
                  (double)peak / 1048576.0, n, path);
    for (int r = 0; r < R_COUNT; r++)
        if (count[r])
            kpl__log_info(&t->log, "  %-24s %9.1f MB %6zu blocks", reason_name[r],
                          (double)sum[r] / 1048576.0, count[r]);
done:
    json_decref(root);
    free(own.o);
    free(blk);
    kpl_memrec_destroy(rec);
}
