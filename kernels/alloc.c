/*
 * alloc.c — the caching allocator behind every device.
 *
 * Memory comes from a raw source (malloc-like for the CPU, cudaMalloc for a
 * GPU, cudaHostAlloc for pinned buffers) in segments and is never returned
 * to the source inside a training step: freed blocks go back to size-class
 * bins and are handed out again, split when a request is smaller, merged
 * with free neighbours of the same segment when freed.
 *
 * Two pools keep small tensors from fragmenting the big segments (the split
 * PyTorch's CUDA allocator also makes): requests up to 1 MiB are cut from
 * 2 MiB segments, larger ones from 20 MiB segments (or a segment of their
 * own, rounded to 2 MiB, past 10 MiB).  Sizes are rounded to 512 bytes so
 * every block stays 64-byte aligned.
 *
 * Bins follow TLSF: the bin of a size is its power of two and the next two
 * bits, so a bin's blocks differ by at most 25% and a search starts at the
 * right bin and takes the first block that fits.  A bitmap of non-empty bins
 * makes the search constant time.  Freed blocks are pushed at the head of
 * their bin, so a block freed just now is the first one reused (the LIFO
 * order the reverse-mode GC relies on to keep backward's footprint flat).
 *
 * On the CPU the cache can keep only so many bytes of free blocks resident
 * past its high-water mark (KPL_ALLOC_KEEP_MB; by default all): past them
 * the pages of the blocks freed longest ago go back to the OS while the
 * blocks stay cached (trim_cold).
 */
#include "kernels_impl.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Under AddressSanitizer, cached memory is poisoned: a kernel that runs past
 * its tensor into a neighbouring block (or reads a freed one) is reported
 * even though the bytes still belong to one of our segments. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#define ROUND_UNIT ((size_t)512)
#define SMALL_MAX ((size_t)1 << 20)
#define SMALL_SEGMENT ((size_t)2 << 20)
#define LARGE_SEGMENT ((size_t)20 << 20)
#define LARGE_ALONE ((size_t)10 << 20)
#define LARGE_MIN_SPLIT ((size_t)1 << 20)
#define N_BINS 256

typedef struct block {
    char *ptr;
    size_t size;
    bool allocated;
    bool small;                       /* pool */
    bool host_visible;                /* segment memory is host memory */
    const char *what;                 /* the requester's tag, while allocated */
    uint32_t ctx;                     /* the allocating thread's kpl_mem_context */
    struct block *prev, *next;        /* neighbours within the segment */
    struct block *bin_prev, *bin_next; /* free list of the bin */
    /* while free on a trimming source: bytes whose pages may be resident
     * (an upper bound), and the list of such blocks, latest freed first */
    size_t resident;
    struct block *lru_prev, *lru_next;
} block;

typedef struct {
    block *bins[N_BINS];
    uint64_t nonempty[N_BINS / 64];
} pool;

/* Open-addressing map from pointer to allocated block. */
typedef struct {
    block **slots;
    size_t cap, count;
} ptr_map;

struct kpl_allocator {
    pthread_mutex_t lock;
    kpl_raw_source src;
    pool pools[2]; /* [0] large, [1] small */
    ptr_map live;
    kpl_memory_stats st;
    /* every segment head, to release them at destroy/empty_cache */
    block **segments;
    size_t n_segments, cap_segments;
    kpl_memrec *rec; /* the memory recorder logging this allocator (memrec.c) */
    /* free blocks whose pages may be resident (trimming sources), and the
     * most bytes ever allocated at once (since keep_epoch) */
    block *lru_head, *lru_tail;
    size_t free_resident, high_water;
    unsigned keep_epoch;
};

/* ---- bins ------------------------------------------------------------------ */

static int bin_of(size_t bytes)
{
    uint64_t u = bytes / ROUND_UNIT;
    if (u < 4) return (int)u;
    int level = 63 - __builtin_clzll(u);
    return level * 4 + (int)((u >> (level - 2)) & 3);
}

static void bin_push(pool *p, block *b)
{
    int i = bin_of(b->size);
    b->bin_prev = NULL;
    b->bin_next = p->bins[i];
    if (b->bin_next) b->bin_next->bin_prev = b;
    p->bins[i] = b;
    p->nonempty[i / 64] |= (uint64_t)1 << (i % 64);
}

static void bin_remove(pool *p, block *b)
{
    int i = bin_of(b->size);
    if (b->bin_prev)
        b->bin_prev->bin_next = b->bin_next;
    else
        p->bins[i] = b->bin_next;
    if (b->bin_next) b->bin_next->bin_prev = b->bin_prev;
    if (!p->bins[i]) p->nonempty[i / 64] &= ~((uint64_t)1 << (i % 64));
    b->bin_prev = b->bin_next = NULL;
}

/* First free block of at least `size`: scan the starting bin (its blocks may
 * be smaller), then take the head of the next non-empty bin. */
static block *bin_find(pool *p, size_t size)
{
    int i = bin_of(size);
    for (block *b = p->bins[i]; b; b = b->bin_next)
        if (b->size >= size) return b;
    for (int w = (i + 1) / 64; w < N_BINS / 64; w++) {
        uint64_t bits = p->nonempty[w];
        if (w == (i + 1) / 64) bits &= ~(uint64_t)0 << ((i + 1) % 64);
        if (bits) return p->bins[w * 64 + __builtin_ctzll(bits)];
    }
    return NULL;
}

/* ---- pointer map ----------------------------------------------------------- */

static bool map_grow(ptr_map *m)
{
    size_t ncap = m->cap ? m->cap * 2 : 1024;
    block **ns = calloc(ncap, sizeof *ns);
    if (!ns) return false;
    for (size_t i = 0; i < m->cap; i++)
        if (m->slots[i]) {
            size_t j = kpl__hash_ptr(m->slots[i]->ptr, ncap);
            while (ns[j]) j = (j + 1) & (ncap - 1);
            ns[j] = m->slots[i];
        }
    free(m->slots);
    m->slots = ns;
    m->cap = ncap;
    return true;
}

static bool map_put(ptr_map *m, block *b)
{
    if ((m->count + 1) * 2 > m->cap && !map_grow(m)) return false;
    size_t j = kpl__hash_ptr(b->ptr, m->cap);
    while (m->slots[j]) j = (j + 1) & (m->cap - 1);
    m->slots[j] = b;
    m->count++;
    return true;
}

static block *map_take(ptr_map *m, const void *ptr)
{
    if (!m->cap) return NULL;
    size_t j = kpl__hash_ptr(ptr, m->cap);
    while (m->slots[j] && m->slots[j]->ptr != ptr) j = (j + 1) & (m->cap - 1);
    block *b = m->slots[j];
    if (!b) return NULL;
    /* Backward-shift deletion keeps probe chains intact. */
    m->slots[j] = NULL;
    m->count--;
    for (size_t k = (j + 1) & (m->cap - 1); m->slots[k]; k = (k + 1) & (m->cap - 1)) {
        block *e = m->slots[k];
        m->slots[k] = NULL;
        size_t h = kpl__hash_ptr(e->ptr, m->cap);
        while (m->slots[h]) h = (h + 1) & (m->cap - 1);
        m->slots[h] = e;
    }
    return b;
}

/* ---- resident bytes of the cache (trimming sources) ------------------------- */

/* How many bytes of free blocks a trimming source keeps resident past
 * its high-water mark of allocated bytes (KPL_ALLOC_KEEP_MB, read once):
 * SIZE_MAX, the default, keeps them all (trim_cold). */
static _Atomic size_t keep_setting;
static atomic_bool keep_read;
static atomic_uint keep_epoch = 1; /* bumped by set_keep: high-water marks restart */

bool kpl__parse_keep_mb(const char *v, size_t *bytes)
{
    if (!strcmp(v, "all")) {
        *bytes = SIZE_MAX;
        return true;
    }
    char *end;
    double mb = strtod(v, &end);
    if (end == v || *end || !(mb >= 0 && mb < 1e9)) return false;
    *bytes = (size_t)(mb * 1048576.0);
    return true;
}

static size_t keep_bytes(void)
{
    if (atomic_load_explicit(&keep_read, memory_order_acquire))
        return atomic_load_explicit(&keep_setting, memory_order_relaxed);
    size_t keep = SIZE_MAX;
    const char *v = getenv("KPL_ALLOC_KEEP_MB");
    if (v && *v && !kpl__parse_keep_mb(v, &keep)) {
        keep = SIZE_MAX;
        fprintf(stderr,
                "kpl: KPL_ALLOC_KEEP_MB=%s is neither a number of MiB from 0 nor 'all'; "
                "every free block stays resident\n",
                v);
    }
    atomic_store_explicit(&keep_setting, keep, memory_order_relaxed);
    atomic_store_explicit(&keep_read, true, memory_order_release);
    return keep;
}

size_t kpl__allocator_set_keep(size_t bytes)
{
    size_t prev = keep_bytes();
    atomic_store_explicit(&keep_setting, bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&keep_epoch, 1, memory_order_relaxed);
    return prev;
}

/* Takes free block b off the resident list; returns what it counted. */
static size_t lru_take(kpl_allocator *a, block *b)
{
    size_t r = b->resident;
    if (!r) return 0;
    if (b->lru_prev)
        b->lru_prev->lru_next = b->lru_next;
    else
        a->lru_head = b->lru_next;
    if (b->lru_next)
        b->lru_next->lru_prev = b->lru_prev;
    else
        a->lru_tail = b->lru_prev;
    b->lru_prev = b->lru_next = NULL;
    b->resident = 0;
    a->free_resident -= r;
    return r;
}

/* Puts free block b, with up to `resident` bytes of resident pages, at
 * the head of the list (freed last: trimmed last). */
static void lru_push(kpl_allocator *a, block *b, size_t resident)
{
    if (!resident || !a->src.trim) return;
    b->resident = resident < b->size ? resident : b->size;
    b->lru_prev = NULL;
    b->lru_next = a->lru_head;
    if (a->lru_head)
        a->lru_head->lru_prev = b;
    else
        a->lru_tail = b;
    a->lru_head = b;
    a->free_resident += b->resident;
}

/* Keeps the process's resident bytes in this allocator (allocated, and
 * free but resident) within its high-water mark of allocated bytes plus
 * keep_bytes(): past it, the pages of the free blocks freed longest ago go
 * back to the OS, while the blocks stay cached and a request one serves
 * later faults fresh zero pages in, as a large malloc does.  Without it
 * the process stays resident for every byte the cache holds, and past the
 * allocator's peak those are its fragmentation (FCOS's many pyramid
 * sizes: reserved 1.9x the peak).  Bounded by the high-water mark, not by
 * the free bytes alone, a step trims only near its peak, where resident
 * bytes set the process's peak; trimming whenever the free bytes passed a
 * bound made the GAN steps 1.4-1.9x slower, faulting their reuse in again
 * and again.  Even so the blocks trimmed at the peak are reused later in
 * the step: with 16 MiB kept FCOS's peak RSS growth fell 250 -> 209 MB
 * and ResNet-50's 1017 -> 880 MiB at 1.16x and 1.08x the step time (~3 us
 * a page fault on the 2-core VM; docs/memory.md), so the default keeps
 * every free block resident.  Pages a block shares with its neighbours
 * stay.  Caller holds the lock. */
static void trim_cold(kpl_allocator *a)
{
    static uintptr_t page;
    if (!page) page = (uintptr_t)sysconf(_SC_PAGESIZE);
    unsigned epoch = atomic_load_explicit(&keep_epoch, memory_order_relaxed);
    if (a->keep_epoch != epoch) a->keep_epoch = epoch, a->high_water = a->st.allocated;
    if (a->st.allocated > a->high_water) a->high_water = a->st.allocated;
    size_t keep = keep_bytes();
    if (keep == SIZE_MAX) return;
    size_t limit = a->high_water + keep < a->high_water ? SIZE_MAX : a->high_water + keep;
    while (a->st.allocated + a->free_resident > limit && a->lru_tail) {
        block *b = a->lru_tail;
        lru_take(a, b);
        uintptr_t lo = ((uintptr_t)b->ptr + page - 1) & ~(page - 1),
                  hi = ((uintptr_t)b->ptr + b->size) & ~(page - 1);
        if (hi > lo && !madvise((void *)lo, hi - lo, MADV_DONTNEED)) a->st.n_trim++;
    }
}

/* ---- segments -------------------------------------------------------------- */

static void stats_add_reserved(kpl_allocator *a, size_t bytes)
{
    a->st.reserved += bytes;
    if (a->st.reserved > a->st.peak_reserved) a->st.peak_reserved = a->st.reserved;
}

static void segment_release(kpl_allocator *a, size_t idx)
{
    block *b = a->segments[idx];
    if (b->host_visible) UNPOISON(b->ptr, b->size);
    a->src.free(a->src.ctx, b->ptr);
    a->st.reserved -= b->size;
    free(b);
    a->segments[idx] = a->segments[--a->n_segments];
}

/* Releases every segment that is one free block; caller holds the lock. */
static void release_free_segments(kpl_allocator *a)
{
    for (size_t i = a->n_segments; i-- > 0;) {
        block *b = a->segments[i];
        if (!b->allocated && !b->prev && !b->next) {
            bin_remove(&a->pools[b->small], b);
            lru_take(a, b);
            segment_release(a, i);
        }
    }
}

static kpl_status segment_new(kpl_allocator *a, size_t seg_size, bool small,
                              size_t want, const char *what, block **out)
{
    if (a->st.limit && a->st.reserved + seg_size > a->st.limit) {
        release_free_segments(a);
        if (a->st.reserved + seg_size > a->st.limit)
            return KPL_ERROR(KPL_ENOMEM,
                             "%s: out of memory on %s: %zu bytes requested, "
                             "%zu reserved, limit %zu",
                             what ? what : "alloc", a->src.name, want,
                             a->st.reserved, a->st.limit);
    }
    if (a->n_segments == a->cap_segments) {
        size_t ncap = a->cap_segments ? a->cap_segments * 2 : 64;
        block **ns = realloc(a->segments, ncap * sizeof *ns);
        if (!ns) return KPL_ERROR(KPL_ENOMEM, "allocator: no host memory for bookkeeping");
        a->segments = ns;
        a->cap_segments = ncap;
    }
    block *b = calloc(1, sizeof *b);
    if (!b) return KPL_ERROR(KPL_ENOMEM, "allocator: no host memory for bookkeeping");
    void *ptr = NULL;
    kpl_status st = a->src.alloc(a->src.ctx, seg_size, &ptr);
    if (st < 0) {
        /* Give back what the cache holds and try once more. */
        release_free_segments(a);
        st = a->src.alloc(a->src.ctx, seg_size, &ptr);
    }
    if (st < 0) {
        free(b);
        /* A failure other than lack of memory (a lost device, a driver
         * error) keeps the backend's own status and message. */
        if (st != KPL_ENOMEM) return st;
        return KPL_ERROR(KPL_ENOMEM,
                         "%s: out of memory on %s: %zu bytes requested "
                         "(segment of %zu), %zu reserved",
                         what ? what : "alloc", a->src.name, want, seg_size,
                         a->st.reserved);
    }
    b->ptr = ptr;
    b->size = seg_size;
    b->small = small;
    b->host_visible = a->src.host_visible;
    if (b->host_visible) POISON(ptr, seg_size);
    a->segments[a->n_segments++] = b;
    a->st.n_system++;
    stats_add_reserved(a, seg_size);
    *out = b;
    return KPL_OK;
}

/* ---- public (module-internal) API ----------------------------------------- */

kpl_allocator *kpl__allocator_create(kpl_raw_source src)
{
    kpl_allocator *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    pthread_mutex_init(&a->lock, NULL);
    a->src = src;
    return a;
}

void kpl__allocator_destroy(kpl_allocator *a)
{
    if (!a) return;
    /* Blocks still handed out belong to their owners' segments: free the
     * segments anyway (destroy only happens at process teardown). */
    for (size_t i = 0; i < a->n_segments; i++) {
        block *seg = a->segments[i];
        block *b = seg->next;
        while (b) {
            block *n = b->next;
            free(b);
            b = n;
        }
        if (seg->host_visible) UNPOISON(seg->ptr, seg->size);
        a->src.free(a->src.ctx, seg->ptr);
        free(seg);
    }
    free(a->segments);
    free(a->live.slots);
    pthread_mutex_destroy(&a->lock);
    free(a);
}

/* ---- this thread's budget (kpl_device_set_budget) ----------------------------- */

static _Thread_local struct {
    kpl_allocator *a;
    kpl_device *dev;
    size_t bytes;
    kpl_release_fn release;
    void *user;
    bool busy; /* in release: its allocations are not checked */
} tl_budget;

void kpl__allocator_set_budget(kpl_allocator *a, kpl_device *dev, size_t bytes,
                               kpl_release_fn release, void *user)
{
    tl_budget.a = bytes ? a : NULL;
    tl_budget.dev = dev;
    tl_budget.bytes = bytes;
    tl_budget.release = release;
    tl_budget.user = user;
}

size_t kpl__allocator_budget(const kpl_allocator *a)
{
    return tl_budget.a == a ? tl_budget.bytes : 0;
}

static size_t allocated_now(kpl_allocator *a)
{
    pthread_mutex_lock(&a->lock);
    size_t n = a->st.allocated;
    pthread_mutex_unlock(&a->lock);
    return n;
}

/* Frees memory through the release hook until size more bytes fit the
 * budget, or fails naming it. */
static kpl_status within_budget(kpl_allocator *a, size_t size, size_t extra, const char *what)
{
    tl_budget.busy = true;
    size_t cur = allocated_now(a), need = size + extra;
    while (cur + need > tl_budget.bytes && tl_budget.release &&
           tl_budget.release(tl_budget.dev, cur + need - tl_budget.bytes, tl_budget.user) > 0)
        cur = allocated_now(a);
    tl_budget.busy = false;
    if (cur + need <= tl_budget.bytes) return KPL_OK;
    const char *ctx = kpl_mem_label_text(kpl_mem_context());
    return KPL_ERROR(KPL_ENOMEM,
                     "%s: %.2f MiB asked for in %s%s%s with %.2f MiB allocated and nothing "
                     "left to recompute: over the memory budget of %.2f MiB on %s "
                     "(memory.budget_mb: raise it, or lower the batch)",
                     what ? what : "alloc", (double)size / 1048576.0, *ctx ? "'" : "",
                     *ctx ? ctx : "no module", *ctx ? "'" : "", (double)cur / 1048576.0,
                     (double)tl_budget.bytes / 1048576.0, a->src.name);
}

kpl_status kpl__allocator_alloc(kpl_allocator *a, size_t bytes,
                                const char *what, void **out)
{
    KPL_CHECK(bytes <= ((size_t)1 << 62), KPL_ENOMEM,
              "%s: allocation of %zu bytes on %s is impossibly large",
              what ? what : "alloc", bytes, a->src.name);
    size_t size = bytes ? (bytes + ROUND_UNIT - 1) / ROUND_UNIT * ROUND_UNIT
                        : ROUND_UNIT;
    bool small = size <= SMALL_MAX;
    pool *p = &a->pools[small];
    kpl_status st = KPL_OK;
    /* a large block from the cache may come with up to LARGE_MIN_SPLIT
     * more than asked (not split for less): counted so */
    if (tl_budget.a == a && !tl_budget.busy)
        KPL_TRY(within_budget(a, size, small ? 0 : LARGE_MIN_SPLIT - ROUND_UNIT, what));

    pthread_mutex_lock(&a->lock);
    a->st.n_alloc++;
    block *b = NULL;
    if (a->src.uncached) {
        st = segment_new(a, bytes ? bytes : 1, small, bytes, what, &b);
        if (st < 0) goto done;
        goto hand_out;
    }
    size_t resident = 0; /* of the block taken from the cache */
    b = bin_find(p, size);
    if (b) {
        bin_remove(p, b);
        resident = lru_take(a, b);
        a->st.n_cache_hit++;
    } else {
        size_t seg = small ? SMALL_SEGMENT
                           : (size <= LARGE_ALONE
                                  ? LARGE_SEGMENT
                                  : (size + SMALL_SEGMENT - 1) / SMALL_SEGMENT *
                                        SMALL_SEGMENT);
        st = segment_new(a, seg, small, bytes, what, &b);
        if (st < 0) goto done;
    }
    size_t rest = b->size - size;
    if (rest >= (small ? ROUND_UNIT : LARGE_MIN_SPLIT)) {
        block *r = calloc(1, sizeof *r);
        if (r) { /* without bookkeeping memory, hand out the whole block */
            r->ptr = b->ptr + size;
            r->size = rest;
            r->small = small;
            r->prev = b;
            r->next = b->next;
            if (b->next) b->next->prev = r;
            b->next = r;
            b->size = size;
            bin_push(p, r);
            lru_push(a, r, resident); /* which part was resident is not known */
        }
    }
hand_out:
    b->allocated = true;
    if (!map_put(&a->live, b)) {
        b->allocated = false;
        bin_push(p, b);
        st = KPL_ERROR(KPL_ENOMEM, "allocator: no host memory for bookkeeping");
        goto done;
    }
    b->what = what;
    b->ctx = kpl_mem_context();
    a->st.allocated += b->size;
    if (a->st.allocated > a->st.peak_allocated) a->st.peak_allocated = a->st.allocated;
    if (a->src.trim) trim_cold(a);
    if (a->rec) kpl__memrec_log(a->rec, 'A', b->ptr, b->size, what, 0, 0);
    if (a->src.host_visible) UNPOISON(b->ptr, bytes);
    *out = b->ptr;
done:
    pthread_mutex_unlock(&a->lock);
    return st;
}

void kpl__allocator_free(kpl_allocator *a, void *ptr)
{
    if (!ptr) return;
    pthread_mutex_lock(&a->lock);
    block *b = map_take(&a->live, ptr);
    KPL_ASSERT(b != NULL, "free of a pointer this allocator did not hand out");
    pool *p = &a->pools[b->small];
    if (a->rec) kpl__memrec_log(a->rec, 'F', b->ptr, b->size, b->what, 0, 0);
    b->allocated = false;
    a->st.allocated -= b->size;
    if (a->src.host_visible) POISON(b->ptr, b->size);
    if (a->src.uncached) { /* the block is its segment: back to the source */
        for (size_t i = 0; i < a->n_segments; i++)
            if (a->segments[i] == b) {
                segment_release(a, i);
                break;
            }
        pthread_mutex_unlock(&a->lock);
        return;
    }
    /* Merge with free neighbours so the segment can serve larger blocks. */
    size_t resident = b->size;
    block *n = b->next;
    if (n && !n->allocated) {
        bin_remove(p, n);
        resident += lru_take(a, n);
        b->size += n->size;
        b->next = n->next;
        if (n->next) n->next->prev = b;
        free(n);
    }
    block *pv = b->prev;
    if (pv && !pv->allocated) {
        bin_remove(p, pv);
        resident += lru_take(a, pv);
        pv->size += b->size;
        pv->next = b->next;
        if (b->next) b->next->prev = pv;
        free(b);
        b = pv;
    }
    bin_push(p, b);
    lru_push(a, b, resident);
    pthread_mutex_unlock(&a->lock);
}

kpl_memory_stats kpl__allocator_stats(kpl_allocator *a)
{
    pthread_mutex_lock(&a->lock);
    kpl_memory_stats s = a->st;
    pthread_mutex_unlock(&a->lock);
    return s;
}

kpl_status kpl__allocator_attach(kpl_allocator *a, kpl_memrec *r)
{
    kpl_status st = KPL_OK;
    pthread_mutex_lock(&a->lock);
    if (r && a->rec) {
        st = KPL_ERROR(KPL_ESTATE, "memory profile: a recorder already runs on %s", a->src.name);
    } else if (r) { /* the blocks live now open the log */
        for (size_t i = 0; i < a->live.cap; i++) {
            block *b = a->live.slots[i];
            if (b) kpl__memrec_log(r, 'B', b->ptr, b->size, b->what, 0, b->ctx);
        }
        a->rec = r;
    } else {
        a->rec = NULL;
    }
    pthread_mutex_unlock(&a->lock);
    return st;
}

void kpl__allocator_note(kpl_allocator *a, const void *ptr, uint8_t note, uint32_t label)
{
    pthread_mutex_lock(&a->lock);
    if (a->rec) kpl__memrec_log(a->rec, 'N', ptr, 0, NULL, note, label);
    pthread_mutex_unlock(&a->lock);
}

void kpl__allocator_reset_peak(kpl_allocator *a)
{
    pthread_mutex_lock(&a->lock);
    a->st.peak_allocated = a->st.allocated;
    a->st.peak_reserved = a->st.reserved;
    pthread_mutex_unlock(&a->lock);
}

void kpl__allocator_empty_cache(kpl_allocator *a)
{
    pthread_mutex_lock(&a->lock);
    release_free_segments(a);
    pthread_mutex_unlock(&a->lock);
}

void kpl__allocator_set_limit(kpl_allocator *a, size_t bytes)
{
    pthread_mutex_lock(&a->lock);
    a->st.limit = bytes;
    pthread_mutex_unlock(&a->lock);
}
