/*
 * memrec.c — the memory recorder behind the memory profile: while it runs
 * on a device, that device's allocator (alloc.c) logs every block it hands
 * out or takes back, with the allocating thread's memory context (a label
 * the layers above set: the module and op running), and the notes those
 * layers add about a block (the op that made it, a holder that keeps it:
 * "saved for backward by conv2d", "optimizer state").  The log is replayed
 * afterwards, out of the hot path: the peak of allocated bytes and every
 * block live at that moment, with its size (the allocator's rounded block
 * size, so the blocks add up to the allocator's own count exactly), its
 * creator and why it is held; and the live bytes over time (the trace's
 * counter track).
 *
 * Labels are interned strings, numbered from 1 (0: none), kept for the
 * life of the process: a profile names a few hundred ops and modules.
 */
#include "kernels_impl.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- labels and the thread's context ---------------------------------------- */

#define LABELS_MAX 65536

static struct {
    pthread_mutex_t lock;
    char **text;
    uint32_t n, cap;
} labels = {.lock = PTHREAD_MUTEX_INITIALIZER};

uint32_t kpl_mem_label(const char *text)
{
    if (!text || !*text) return 0;
    uint32_t id = 0;
    pthread_mutex_lock(&labels.lock);
    for (uint32_t i = labels.n; i > 0 && !id; i--) /* recent labels recur */
        if (!strcmp(labels.text[i - 1], text)) id = i;
    if (!id && labels.n < LABELS_MAX) {
        if (labels.n == labels.cap) {
            uint32_t cap = labels.cap ? 2 * labels.cap : 256;
            char **t = realloc(labels.text, cap * sizeof *t);
            if (t) labels.text = t, labels.cap = cap;
        }
        char *copy = labels.n < labels.cap ? strdup(text) : NULL;
        if (copy) {
            labels.text[labels.n++] = copy;
            id = labels.n;
        }
    }
    pthread_mutex_unlock(&labels.lock);
    return id; /* 0 when out of memory or labels: "unlabelled" */
}

const char *kpl_mem_label_text(uint32_t id)
{
    pthread_mutex_lock(&labels.lock);
    const char *t = id && id <= labels.n ? labels.text[id - 1] : "";
    pthread_mutex_unlock(&labels.lock);
    return t;
}

static _Thread_local uint32_t tl_context;

uint32_t kpl_mem_context_set(uint32_t label)
{
    uint32_t old = tl_context;
    tl_context = label;
    return old;
}

uint32_t kpl_mem_context(void) { return tl_context; }

/* ---- the log ------------------------------------------------------------------ */

typedef struct {
    char type;        /* 'B' live at the start, 'A' alloc, 'F' free, 'N' note */
    uint8_t note;     /* kpl_memnote, for 'N' */
    uint32_t label;   /* context at alloc, the note's label */
    const void *ptr;
    size_t size;      /* the block's size ('B', 'A') */
    const char *what; /* the allocator's tag ('B', 'A') */
    double t;
} rec_event;

struct kpl_memrec {
    kpl_device *dev;
    rec_event *ev;
    size_t n, cap;
    bool lost;        /* an event could not be logged (no host memory) */
    bool running;
    double t0;
};

static atomic_int recording;

bool kpl_memrec_active(void) { return atomic_load_explicit(&recording, memory_order_relaxed) > 0; }

/* Appends one event; called by the allocator under its lock. */
void kpl__memrec_log(kpl_memrec *r, char type, const void *ptr, size_t size, const char *what,
                     uint8_t note, uint32_t label)
{
    if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 4096;
        rec_event *e = realloc(r->ev, cap * sizeof *e);
        if (!e) {
            r->lost = true;
            return;
        }
        r->ev = e, r->cap = cap;
    }
    r->ev[r->n++] = (rec_event){type, note, type == 'A' ? tl_context : label, ptr, size, what,
                                kpl_seconds()};
}

kpl_status kpl_memrec_start(kpl_device *dev, kpl_memrec **out)
{
    KPL_CHECK(dev != NULL && out != NULL, KPL_EINVAL, "memrec_start: NULL argument");
    kpl_memrec *r = calloc(1, sizeof *r);
    KPL_CHECK(r != NULL, KPL_ENOMEM, "memrec_start: no host memory");
    r->dev = dev;
    r->t0 = kpl_seconds();
    kpl_status st = kpl__allocator_attach(dev->alloc, r);
    if (st < 0) {
        free(r->ev);
        free(r);
        return st;
    }
    r->running = true;
    atomic_fetch_add(&recording, 1);
    *out = r;
    return KPL_OK;
}

void kpl_memrec_stop(kpl_memrec *r)
{
    if (!r || !r->running) return;
    kpl__allocator_attach(r->dev->alloc, NULL);
    r->running = false;
    atomic_fetch_sub(&recording, 1);
}

void kpl_memrec_destroy(kpl_memrec *r)
{
    if (!r) return;
    kpl_memrec_stop(r);
    free(r->ev);
    free(r);
}

void kpl_memrec_note(kpl_device *dev, const void *ptr, kpl_memnote kind, uint32_t label)
{
    if (dev && ptr && kpl_memrec_active()) kpl__allocator_note(dev->alloc, ptr, (uint8_t)kind, label);
}

const void *kpl_tensor_block(const kpl_tensor *t)
{
    const kpl_storage *s = t ? t->storage : NULL;
    while (s && s->parent) s = s->parent; /* a view's bytes are its root's block */
    return s && !s->wrap_release ? s->dev_ptr : NULL;
}

void kpl_memrec_note_tensor(const kpl_tensor *t, kpl_memnote kind, uint32_t label)
{
    const void *b = kpl_memrec_active() ? kpl_tensor_block(t) : NULL;
    if (b) kpl_memrec_note(t->storage->dev, b, kind, label);
}

/* ---- replay ---------------------------------------------------------------------- */

/* Event indices ordered by block pointer, then time: each pointer's events
 * then read B/A, notes, F, A, notes, F ... */
static const rec_event *sort_base;

static int by_ptr(const void *pa, const void *pb)
{
    size_t a = *(const size_t *)pa, b = *(const size_t *)pb;
    uintptr_t x = (uintptr_t)sort_base[a].ptr, y = (uintptr_t)sort_base[b].ptr;
    if (x != y) return x < y ? -1 : 1;
    return a < b ? -1 : a > b;
}

/* The running total of allocated bytes after each event; returns the
 * index of the event that first reached the maximum (SIZE_MAX: before
 * any event, the blocks live at the start). */
static size_t find_peak(const kpl_memrec *r, size_t *peak)
{
    size_t bytes = 0, best = 0, at = SIZE_MAX;
    for (size_t i = 0; i < r->n; i++) {
        const rec_event *e = &r->ev[i];
        if (e->type == 'B' || e->type == 'A') bytes += e->size;
        if (e->type == 'F') bytes -= e->size;
        if (e->type == 'B') best = bytes;
        else if (bytes > best) best = bytes, at = i;
    }
    *peak = best;
    return at;
}

kpl_status kpl_memrec_peak(const kpl_memrec *r, kpl_memrec_block **out, size_t *n_out,
                           size_t *peak_bytes, double *t_peak)
{
    KPL_CHECK(r && out && n_out && peak_bytes, KPL_EINVAL, "memrec_peak: NULL argument");
    KPL_CHECK(!r->lost, KPL_ENOMEM,
              "memory profile: events were lost (no host memory for the log); the peak's "
              "blocks cannot be told");
    *out = NULL;
    *n_out = 0;
    size_t peak = 0, at = find_peak(r, &peak);
    size_t *idx = malloc((r->n ? r->n : 1) * sizeof *idx);
    kpl_memrec_block *blocks = malloc((r->n ? r->n : 1) * sizeof *blocks);
    if (!idx || !blocks) {
        free(idx);
        free(blocks);
        return KPL_ERROR(KPL_ENOMEM, "memory profile: no host memory for the replay");
    }
    size_t nbase = 0;
    while (nbase < r->n && r->ev[nbase].type == 'B') nbase++;
    size_t m = at == SIZE_MAX ? nbase : at + 1; /* the events up to the peak */
    for (size_t i = 0; i < m; i++) idx[i] = i;
    sort_base = r->ev;
    qsort(idx, m, sizeof *idx, by_ptr);
    size_t nb = 0;
    for (size_t i = 0; i < m;) {
        const void *p = r->ev[idx[i]].ptr;
        kpl_memrec_block cur;
        bool live = false;
        int holds = 0;
        for (; i < m && r->ev[idx[i]].ptr == p; i++) {
            const rec_event *e = &r->ev[idx[i]];
            if (e->type == 'B' || e->type == 'A') {
                cur = (kpl_memrec_block){e->ptr, e->size, e->what, e->label, 0, e->type == 'B'};
                live = true;
                holds = 0;
            } else if (e->type == 'F') {
                live = false;
            } else if (live && e->note == KPL_MEMNOTE_CREATOR) {
                cur.creator = e->label;
            } else if (live && e->note == KPL_MEMNOTE_HOLD) {
                holds++;
                cur.reason = e->label;
            } else if (live && e->note == KPL_MEMNOTE_RELEASE && holds > 0 && --holds == 0) {
                cur.reason = 0;
            }
        }
        if (live) blocks[nb++] = cur;
    }
    free(idx);
    *out = blocks;
    *n_out = nb;
    *peak_bytes = peak;
    if (t_peak) *t_peak = at == SIZE_MAX || !r->n ? 0 : r->ev[at].t - r->t0;
    return KPL_OK;
}

void kpl_memrec_timeline(const kpl_memrec *r, void (*fn)(void *ctx, double t, size_t bytes),
                         void *ctx)
{
    if (!r) return;
    size_t bytes = 0, i = 0;
    for (; i < r->n && r->ev[i].type == 'B'; i++) bytes += r->ev[i].size;
    fn(ctx, 0, bytes); /* the blocks live at the start */
    for (; i < r->n; i++) {
        const rec_event *e = &r->ev[i];
        if (e->type == 'N') continue;
        if (e->type == 'F')
            bytes -= e->size;
        else
            bytes += e->size;
        fn(ctx, e->t - r->t0, bytes);
    }
}
