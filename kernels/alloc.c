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
 * On the CPU the segments are mapped here in 2 MiB chunks, and a
 * block handed out whose chunks hold no pages (a new segment's, or ones
 * trimmed or lent before) takes the pages of chunks lying in free blocks
 * instead of faulting fresh ones in (chunk_borrow; KPL_ALLOC_LEND), so
 * the cache's holes do not add to the process's pages.  The cache can
 * also keep only so many bytes of free blocks resident past its
 * high-water mark (KPL_ALLOC_KEEP_MB; by default all): past them the
 * pages of the blocks freed longest ago go back to the OS while the
 * blocks stay cached (trim_cold).
 */
#define _GNU_SOURCE /* MREMAP_*, syscall */
#include "kernels_impl.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4 /* Linux >= 5.7 */
#endif

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
    /* segments mapped in chunks (trimming sources): the segment's first
     * block, and there, which of its chunks may hold pages */
    struct block *head;
    uint8_t *present;
    size_t mapped; /* a segment head mapped by mmap: its bytes (else 0) */
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
    bool map_chunks;  /* segments mapped by alloc.c, in chunks (below) */
    bool lend_failed; /* a move failed: pages fault in from then on */
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

/* Unlinks free block b from the resident list (its count stays). */
static void lru_unlink(kpl_allocator *a, block *b)
{
    if (b->lru_prev)
        b->lru_prev->lru_next = b->lru_next;
    else
        a->lru_head = b->lru_next;
    if (b->lru_next)
        b->lru_next->lru_prev = b->lru_prev;
    else
        a->lru_tail = b->lru_prev;
    b->lru_prev = b->lru_next = NULL;
}

/* Takes free block b off the resident list; returns what it counted. */
static size_t lru_take(kpl_allocator *a, block *b)
{
    size_t r = b->resident;
    if (!r) return 0;
    lru_unlink(a, b);
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

/* ---- pages lent between the chunks of segments ------------------------------ */

/* A request that misses the cache makes a new segment, and a cached block
 * whose pages were trimmed faults fresh ones in: either way the process
 * grows while the cache holds free blocks with pages nobody uses, which
 * no request fitted (FCOS's five pyramid levels: 61 MB of such holes).
 * On the CPU the segments (the small pool's are one chunk each) are
 * mapped by alloc.c, aligned to CHUNK, and each chunk is known to hold
 * pages or none.  When a block is handed
 * out, each of its chunks that holds none takes the pages of a chunk that
 * lies wholly in a free block, the one freed longest ago first: mremap
 * moves the page tables (a whole page-table page where both sides are
 * 2 MiB-aligned), no page is faulted or copied, and the lender keeps its
 * address range, empty.  The process's pages then follow the allocated
 * bytes, not the segments.  Chunks of 2 MiB keep the kernel's mappings
 * to at most one per chunk (mremap splits them there). */
#define CHUNK ((size_t)2 << 20)

/* Whether chunks lend pages (KPL_ALLOC_LEND, read once; on by default). */
static atomic_int lend_setting = -1;

static bool lend_on(void)
{
    int v = atomic_load_explicit(&lend_setting, memory_order_relaxed);
    if (v < 0) {
        v = kpl_env_switch("KPL_ALLOC_LEND", true);
        atomic_store_explicit(&lend_setting, v, memory_order_relaxed);
    }
    return v;
}

bool kpl__allocator_set_lend(bool on)
{
    bool prev = lend_on();
    atomic_store_explicit(&lend_setting, on, memory_order_relaxed);
    return prev;
}

/* A segment of `size` (a multiple of CHUNK), CHUNK-aligned. */
static void *chunks_map(size_t size)
{
    size_t span = size + CHUNK;
    char *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    char *q = (char *)(((uintptr_t)p + CHUNK - 1) & ~(uintptr_t)(CHUNK - 1));
    if (q > p) munmap(p, (size_t)(q - p));
    if (p + span > q + size) munmap(q + size, (size_t)(p + span - (q + size)));
    return q;
}

/* Chunks wholly inside [lo, hi) of block b's segment hold no pages now. */
static void chunks_emptied(block *b, char *lo, char *hi)
{
    block *h = b->head;
    if (!h || hi <= lo) return;
    size_t c0 = ((size_t)(lo - h->ptr) + CHUNK - 1) / CHUNK, c1 = (size_t)(hi - h->ptr) / CHUNK;
    for (size_t c = c0; c < c1; c++)
        h->present[c] = 0;
}

/* Moves the pages of one chunk lying wholly in a free block (freed
 * longest ago first) to dst, a chunk holding none.  Returns whether one
 * moved.  Caller holds the lock. */
static bool chunk_borrow(kpl_allocator *a, char *dst)
{
    for (block *d = a->lru_tail; d; d = d->lru_prev) {
        block *h = d->head;
        if (!h) continue;
        size_t c0 = ((size_t)(d->ptr - h->ptr) + CHUNK - 1) / CHUNK,
               c1 = (size_t)(d->ptr + d->size - h->ptr) / CHUNK;
        for (size_t c = c0; c < c1; c++) {
            if (!h->present[c]) continue;
            /* the system call itself: UCX's memory hooks (the collective
             * layer loads them) replace mremap with a function of four
             * arguments, which loses dst */
            if (syscall(SYS_mremap, h->ptr + c * CHUNK, CHUNK, CHUNK,
                        MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, dst) != (long)dst) {
                /* an old kernel, or the process's mappings at their limit:
                 * pages fault in from now on.  A failed move may have
                 * unmapped dst already: map it again (it held no pages). */
                a->lend_failed = true;
                void *m = mmap(dst, CHUNK, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
                KPL_ASSERT(m == dst, "allocator: cannot map a segment's chunk again");
                return false;
            }
            /* and said through libc, where those hooks tell UCX's
             * registration cache that the lender's pages are gone */
            madvise(h->ptr + c * CHUNK, CHUNK, MADV_DONTNEED);
            h->present[c] = 0;
            size_t r = d->resident < CHUNK ? d->resident : CHUNK;
            d->resident -= r;
            a->free_resident -= r;
            if (!d->resident) lru_unlink(a, d); /* nothing left to lend or trim */
            a->st.n_lend++;
            return true;
        }
    }
    return false;
}

/* Before block b of a mapped segment is handed out: its chunks that hold
 * no pages borrow some (chunk_borrow); every chunk it touches then counts
 * as holding pages. */
static void chunks_fill(kpl_allocator *a, block *b)
{
    block *h = b->head;
    size_t c0 = (size_t)(b->ptr - h->ptr) / CHUNK,
           c1 = ((size_t)(b->ptr + b->size - h->ptr) + CHUNK - 1) / CHUNK;
    for (size_t c = c0; c < c1; c++)
        if (!h->present[c]) {
            if (!a->lend_failed && lend_on()) chunk_borrow(a, h->ptr + c * CHUNK);
            h->present[c] = 1;
        }
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
        if (hi > lo && !madvise((void *)lo, hi - lo, MADV_DONTNEED)) {
            a->st.n_trim++;
            chunks_emptied(b, (char *)lo, (char *)hi);
        }
    }
}

/* ---- segments -------------------------------------------------------------- */

static void stats_add_reserved(kpl_allocator *a, size_t bytes)
{
    a->st.reserved += bytes;
    if (a->st.reserved > a->st.peak_reserved) a->st.peak_reserved = a->st.reserved;
}

/* Returns segment head b's memory to where it came from. */
static void segment_unmap(kpl_allocator *a, block *b)
{
    if (b->mapped) { /* (a head's size is its first block's) */
        munmap(b->ptr, b->mapped);
        free(b->present);
    } else {
        a->src.free(a->src.ctx, b->ptr);
    }
}

static void segment_release(kpl_allocator *a, size_t idx)
{
    block *b = a->segments[idx];
    if (b->host_visible) UNPOISON(b->ptr, b->size);
    segment_unmap(a, b);
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

/* A segment's memory: mapped here (CHUNK-aligned), or from the source. */
static kpl_status segment_map(kpl_allocator *a, bool mapped, size_t size, void **ptr)
{
    if (!mapped) return a->src.alloc(a->src.ctx, size, ptr);
    *ptr = chunks_map(size);
    return *ptr ? KPL_OK : KPL_ENOMEM;
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
    bool mapped = a->map_chunks && !a->src.uncached;
    if (mapped && !(b->present = calloc(seg_size / CHUNK, 1))) {
        free(b);
        return KPL_ERROR(KPL_ENOMEM, "allocator: no host memory for bookkeeping");
    }
    kpl_status st = segment_map(a, mapped, seg_size, &ptr);
    if (st < 0) {
        /* Give back what the cache holds and try once more. */
        release_free_segments(a);
        st = segment_map(a, mapped, seg_size, &ptr);
    }
    if (st < 0) {
        free(b->present);
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
    b->mapped = mapped ? seg_size : 0;
    b->head = mapped ? b : NULL;
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
    a->map_chunks = src.trim && !src.uncached;
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
        segment_unmap(a, seg);
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
static kpl_status within_budget(kpl_allocator *a, size_t size, const char *what)
{
    tl_budget.busy = true;
    size_t cur = allocated_now(a);
    while (cur + size > tl_budget.bytes && tl_budget.release &&
           tl_budget.release(tl_budget.dev, cur + size - tl_budget.bytes, tl_budget.user) > 0)
        cur = allocated_now(a);
    tl_budget.busy = false;
    if (cur + size <= tl_budget.bytes) return KPL_OK;
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
     * more than asked (not split for less): counted so, except for a
     * convolution's buffers under a budget, cut to the bytes asked for
     * (an 8.4 MB scratchpad beside 0.6 MB of tensors fits 9.05 MiB) */
    bool exact = tl_budget.a == a && what && !strcmp(what, "conv2d");
    if (tl_budget.a == a && !tl_budget.busy)
        KPL_TRY(within_budget(a, size + (small || exact ? 0 : LARGE_MIN_SPLIT - ROUND_UNIT), what));

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
    if (rest >= (small || exact ? ROUND_UNIT : LARGE_MIN_SPLIT)) {
        block *r = calloc(1, sizeof *r);
        if (r) { /* without bookkeeping memory, hand out the whole block */
            r->ptr = b->ptr + size;
            r->size = rest;
            r->small = small;
            r->head = b->head;
            r->prev = b;
            r->next = b->next;
            if (b->next) b->next->prev = r;
            b->next = r;
            b->size = size;
            bin_push(p, r);
            lru_push(a, r, resident); /* which part was resident is not known */
        }
    }
    if (b->head) chunks_fill(a, b);
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
