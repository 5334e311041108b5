/*
 * storage.c — UnifiedMemory: one buffer, a host copy and a device copy.
 *
 * On the CPU the two copies are the same memory and the state only records
 * whether anything was written.  On a GPU the device copy is allocated with
 * the storage, the host copy on first host access, and a read on the side
 * whose copy is stale copies lazily:
 *
 *   state    host_data   host_mutable   device_data   device_mutable
 *   EMPTY    -> EMPTY    -> HOST        -> EMPTY      -> DEVICE
 *   HOST     -> HOST     -> HOST        copy, SYNCED  copy, DEVICE
 *   DEVICE   copy,SYNCED copy, HOST     -> DEVICE     -> DEVICE
 *   SYNCED   -> SYNCED   -> HOST        -> SYNCED     -> DEVICE
 *
 * The host copy is ordinary (pageable) memory from the CPU's caching
 * allocator, given back as soon as a device write makes it stale (state
 * DEVICE): a parameter read once on the host, at a checkpoint, does not keep
 * a page-locked copy for the rest of the run.  The backend moves pageable
 * bytes through a bounded pinned staging buffer.
 *
 * A wrapped storage's memory (the loader's slots) may be page-locked, and
 * then a GPU upload from it runs after the call that queued it returned:
 * before such memory is written or handed back, kpl__host_fence waits for
 * the uploads still reading it.
 *
 * A CPU storage may hold a convolution's activation in one of oneDNN's
 * layouts, nChw16c or NHWC (`kept`; see kpl_set_blocked_layouts): the
 * kernels that understand it take the raw bytes through kpl__kept_data,
 * and every other access goes through the four accessors below, which
 * first turn the bytes back into plain NCHW, in place.
 */
#include "kernels_impl.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool is_cpu(const kpl_storage *s) { return s->dev->type == KPL_DEVICE_CPU; }

kpl_status kpl_storage_create(kpl_device *dev, size_t bytes, kpl_storage **out)
{
    KPL_CHECK(dev != NULL && out != NULL, KPL_EINVAL, "storage_create: NULL argument");
    kpl_storage *s = calloc(1, sizeof *s);
    KPL_CHECK(s != NULL, KPL_ENOMEM, "storage_create: no host memory");
    atomic_init(&s->refcount, 1);
    s->dev = dev;
    s->bytes = bytes;
    s->state = KPL_MEM_EMPTY;
    kpl_status st = kpl__allocator_alloc(dev->alloc, bytes, "tensor", &s->dev_ptr);
    if (st < 0) {
        free(s);
        return st;
    }
    if (is_cpu(s)) s->host = s->dev_ptr;
    *out = s;
    return KPL_OK;
}

kpl_status kpl_storage_sub(kpl_storage *parent, size_t offset, size_t bytes, kpl_storage **out)
{
    KPL_CHECK(parent != NULL && out != NULL, KPL_EINVAL, "storage_sub: NULL argument");
    KPL_CHECK(!parent->wrap_release && !parent->parent, KPL_EINVAL,
              "storage_sub: the parent must be a storage of its own (not wrapped, not a sub-storage)");
    KPL_CHECK(offset <= parent->bytes && bytes <= parent->bytes - offset, KPL_ERANGE,
              "storage_sub: bytes [%zu, %zu) do not fit a storage of %zu bytes", offset,
              offset + bytes, parent->bytes);
    kpl_storage *s = calloc(1, sizeof *s);
    KPL_CHECK(s != NULL, KPL_ENOMEM, "storage_sub: no host memory");
    atomic_init(&s->refcount, 1);
    s->dev = parent->dev;
    s->bytes = bytes;
    s->state = KPL_MEM_EMPTY;
    s->dev_ptr = (char *)parent->dev_ptr + offset;
    if (is_cpu(s)) s->host = s->dev_ptr;
    kpl_storage_retain(parent);
    s->parent = parent;
    *out = s;
    return KPL_OK;
}

kpl_status kpl_storage_wrap(void *host, size_t bytes, void (*release)(void *ctx), void *ctx,
                            kpl_storage **out)
{
    KPL_CHECK(host != NULL && release != NULL && out != NULL, KPL_EINVAL,
              "storage_wrap: NULL argument");
    kpl_storage *s = calloc(1, sizeof *s);
    KPL_CHECK(s != NULL, KPL_ENOMEM, "storage_wrap: no host memory");
    atomic_init(&s->refcount, 1);
    s->dev = kpl_device_cpu();
    s->bytes = bytes;
    s->host = s->dev_ptr = host;
    s->state = KPL_MEM_HOST;
    s->wrap_release = release;
    s->wrap_ctx = ctx;
    *out = s;
    return KPL_OK;
}

void kpl_storage_retain(kpl_storage *s)
{
    if (s) atomic_fetch_add_explicit(&s->refcount, 1, memory_order_relaxed);
}

void kpl__storage_drop_packed(kpl_storage *s)
{
    if (!s->packed) return;
    kpl_device_free(kpl_device_cpu(), s->packed);
    s->packed = NULL;
    s->packed_bytes = 0;
    s->packed_key = 0;
}

void *kpl__storage_packed(const kpl_storage *s, uint64_t key, size_t bytes)
{
    return s->packed && s->packed_key == key && s->packed_bytes == bytes ? s->packed : NULL;
}

void *kpl__storage_new_packed(kpl_storage *s, uint64_t key, size_t bytes)
{
    kpl__storage_drop_packed(s);
    void *p;
    if (kpl_device_alloc(kpl_device_cpu(), bytes, "derived copy", &p) < 0) return NULL;
    s->packed = p;
    s->packed_bytes = bytes;
    s->packed_key = key;
    return p;
}

void kpl_storage_release(kpl_storage *s)
{
    if (!s) return;
    if (atomic_fetch_sub_explicit(&s->refcount, 1, memory_order_acq_rel) != 1) return;
    kpl__storage_drop_packed(s);
    if (s->wrap_release) {
        /* An error here (a lost device) leaves no upload to wait for. */
        if (kpl__host_fence() < 0) kpl_clear_error();
        s->wrap_release(s->wrap_ctx);
        free(s);
        return;
    }
    if (!is_cpu(s) && s->host) kpl__allocator_free(kpl_device_cpu()->alloc, s->host);
    if (s->parent) kpl_storage_release(s->parent);
    else kpl__allocator_free(s->dev->alloc, s->dev_ptr);
    free(s);
}

size_t kpl_storage_bytes(const kpl_storage *s) { return s->bytes; }
kpl_device *kpl_storage_device(const kpl_storage *s) { return s->dev; }
kpl_mem_state kpl_storage_state(const kpl_storage *s) { return s->state; }

static kpl_status ensure_host(kpl_storage *s)
{
    if (s->host) return KPL_OK;
    return kpl__allocator_alloc(kpl_device_cpu()->alloc, s->bytes, "host copy", &s->host);
}

/* A device write makes the host copy stale: it goes back to the CPU's
 * allocator until the host asks again. */
static void drop_host(kpl_storage *s)
{
    if (!s->host) return;
    kpl__allocator_free(kpl_device_cpu()->alloc, s->host);
    s->host = NULL;
}

static kpl_status to_host(kpl_storage *s)
{
    KPL_TRY(ensure_host(s));
    if (s->state == KPL_MEM_DEVICE) {
        KPL_TRY(s->dev->backend->copy_d2h(s->dev, s->host, s->dev_ptr, s->bytes));
        s->state = KPL_MEM_SYNCED;
    }
    return KPL_OK;
}

/* ---- kept layouts ---- */

static atomic_bool blocked_layouts = true;

bool kpl_set_blocked_layouts(bool on) { return atomic_exchange(&blocked_layouts, on); }

/* kpl_set_kept_layout's setting; -1 until read from KPL_LAYOUT. */
static atomic_int kept_layout = -1;

/* kpl_set_thread_kept_layout's: -1 where the thread has none. */
static _Thread_local int thread_layout = -1;

int kpl_set_thread_kept_layout(int layout)
{
    int prev = thread_layout;
    thread_layout = layout >= KPL_LAYOUT_AUTO && layout <= KPL_LAYOUT_NHWC ? layout : -1;
    return prev;
}

kpl_layout kpl_get_kept_layout(void)
{
    if (thread_layout >= 0) return (kpl_layout)thread_layout;
    int l = atomic_load(&kept_layout);
    if (l >= 0) return (kpl_layout)l;
    const char *env = getenv("KPL_LAYOUT");
    l = KPL_LAYOUT_AUTO;
    if (env && !strcmp(env, "nchw16c")) l = KPL_LAYOUT_NCHW16C;
    else if (env && !strcmp(env, "nhwc")) l = KPL_LAYOUT_NHWC;
    else if (env && *env && strcmp(env, "auto"))
        fprintf(stderr, "kpl: KPL_LAYOUT=%s is not auto, nchw16c or nhwc; using auto\n", env);
    int unset = -1;
    atomic_compare_exchange_strong(&kept_layout, &unset, l);
    return (kpl_layout)atomic_load(&kept_layout);
}

kpl_layout kpl_set_kept_layout(kpl_layout layout)
{
    int own = kpl_set_thread_kept_layout(-1);
    kpl_layout prev = kpl_get_kept_layout(); /* the process's */
    kpl_set_thread_kept_layout(own);
    atomic_store(&kept_layout, (int)layout);
    return prev;
}

/* nChw16c -> NCHW of one block of 16 channels (hw values each), in place
 * through `tmp` of the block's size: a block's 16 * hw values fill the same
 * bytes in both layouts, so the blocks of every image are independent.
 * Reads run along the source, the 16 writes per step along 16 rows. */
#define UNBLOCK_BLOCK(T)                                                          \
    do {                                                                          \
        const T *src_ = (const T *)tmp;                                           \
        T *dst_ = (T *)blk;                                                       \
        for (int64_t i = 0; i < hw; i++)                                          \
            for (int j = 0; j < 16; j++) dst_[j * hw + i] = src_[i * 16 + j];     \
    } while (0)

static void unblock_block(char *blk, char *tmp, int64_t hw, int es)
{
    memcpy(tmp, blk, (size_t)(16 * hw * es));
    switch (es) {
    case 1: UNBLOCK_BLOCK(uint8_t); break;
    case 2: UNBLOCK_BLOCK(uint16_t); break;
    case 4: UNBLOCK_BLOCK(uint32_t); break;
    default: UNBLOCK_BLOCK(uint64_t); break;
    }
}

/* NHWC -> NCHW of channels [c0, c0 + 16) of one image whose NHWC bytes
 * were copied to `src`: 16 rows of hw values written along the rows. */
#define UNNHWC_BLOCK(T)                                                           \
    do {                                                                          \
        const T *src_ = (const T *)src;                                           \
        T *dst_ = (T *)img;                                                       \
        for (int64_t i = 0; i < hw; i++)                                          \
            for (int j = 0; j < 16; j++) dst_[(c0 + j) * hw + i] = src_[i * c + c0 + j]; \
    } while (0)

static void unnhwc_block(char *img, const char *src, int64_t c, int64_t c0, int64_t hw, int es)
{
    switch (es) {
    case 1: UNNHWC_BLOCK(uint8_t); break;
    case 2: UNNHWC_BLOCK(uint16_t); break;
    case 4: UNNHWC_BLOCK(uint32_t); break;
    default: UNNHWC_BLOCK(uint64_t); break;
    }
}

static void unkeep_failed(size_t bytes)
{
    /* the accessors cannot fail on the CPU, and these bytes are not the
     * plain tensor every caller expects */
    fprintf(stderr, "kpl: no memory (%zu bytes) to turn a kept-layout tensor plain\n", bytes);
    abort();
}

/* Makes a storage held nChw16c plain again, a block of 16 channels per
 * thread at a time (batch 1 too uses every thread). */
static void unblock(kpl_storage *s)
{
    int64_t n = s->blk_dims[0], c = s->blk_dims[1], hw = s->blk_dims[2] * s->blk_dims[3];
    int64_t units = n * (c / 16);
    size_t blk = (size_t)(16 * hw * s->blk_es);
    bool lost = false;
#pragma omp parallel if (units > 1 && blk * (size_t)units >= 65536)
    {
        char *tmp = malloc(blk);
        if (!tmp) {
#pragma omp atomic write
            lost = true;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++)
            if (tmp) unblock_block((char *)s->dev_ptr + u * blk, tmp, hw, s->blk_es);
        free(tmp);
    }
    if (lost) unkeep_failed(blk);
}

/* Makes a storage held NHWC plain again: an image at a time, copied aside
 * whole, then its blocks of 16 channels written back in parallel. */
static void unnhwc(kpl_storage *s)
{
    int64_t n = s->blk_dims[0], c = s->blk_dims[1], hw = s->blk_dims[2] * s->blk_dims[3];
    size_t img = (size_t)(c * hw * s->blk_es);
    char *tmp = malloc(img);
    if (!tmp) unkeep_failed(img);
    for (int64_t i = 0; i < n; i++) {
        char *p = (char *)s->dev_ptr + (size_t)i * img;
        memcpy(tmp, p, img);
        KPL_PARALLEL_FOR_IF(cb, c / 16, img >= 65536,
                            unnhwc_block(p, tmp, c, cb * 16, hw, s->blk_es););
    }
    free(tmp);
}

static void unkeep(kpl_storage *s)
{
    if (s->kept == KPL_KEPT_NC16) unblock(s);
    else unnhwc(s);
    s->kept = KPL_KEPT_PLAIN;
}

bool kpl__keepable(const kpl_tensor *t)
{
    const kpl_storage *s = t->storage;
    return atomic_load_explicit(&blocked_layouts, memory_order_relaxed) && is_cpu(s) &&
           !s->wrap_release && t->ndim == 4 && t->shape[1] % 16 == 0 && t->offset == 0 &&
           kpl_tensor_nbytes(t) == s->bytes && t->numel > 0;
}

kpl_kept kpl__kept(const kpl_tensor *t)
{
    const kpl_storage *s = t->storage;
    if (s->kept == KPL_KEPT_PLAIN || t->offset != 0 || t->ndim != 4 ||
        (int)kpl_dtype_size(t->dtype) != s->blk_es || kpl_tensor_nbytes(t) != s->bytes)
        return KPL_KEPT_PLAIN;
    for (int d = 0; d < 4; d++)
        if (t->shape[d] != s->blk_dims[d]) return KPL_KEPT_PLAIN;
    return (kpl_kept)s->kept;
}

void *kpl__kept_data(const kpl_tensor *t, kpl_kept tag)
{
    return tag != KPL_KEPT_PLAIN && kpl__kept(t) == tag ? t->storage->dev_ptr : NULL;
}

void *kpl__kept_out(const kpl_tensor *t)
{
    kpl__storage_drop_packed(t->storage);
    t->storage->kept = KPL_KEPT_PLAIN; /* whatever it held is overwritten */
    t->storage->state = KPL_MEM_HOST;
    return t->storage->dev_ptr;
}

void kpl__storage_set_kept(const kpl_tensor *t, kpl_kept tag)
{
    kpl_storage *s = t->storage;
    s->kept = tag;
    s->blk_es = (int)kpl_dtype_size(t->dtype);
    memcpy(s->blk_dims, t->shape, sizeof s->blk_dims);
}

const void *kpl_storage_host_data(kpl_storage *s)
{
    if (s->kept) unkeep(s);
    if (is_cpu(s)) return s->host;
    return to_host(s) < 0 ? NULL : s->host;
}

void *kpl_storage_host_mutable(kpl_storage *s)
{
    kpl__storage_drop_packed(s);
    if (s->kept) unkeep(s);
    if (s->wrap_release && kpl__host_fence() < 0) return NULL;
    if (!is_cpu(s) && to_host(s) < 0) return NULL;
    s->state = KPL_MEM_HOST;
    return s->host;
}

static kpl_status to_device(kpl_storage *s)
{
    if (s->state == KPL_MEM_HOST) {
        KPL_TRY(s->dev->backend->copy_h2d(s->dev, s->dev_ptr, s->host, s->bytes));
        s->state = KPL_MEM_SYNCED;
    }
    return KPL_OK;
}

const void *kpl_storage_device_data(kpl_storage *s)
{
    if (s->kept) unkeep(s);
    if (is_cpu(s)) return s->dev_ptr;
    return to_device(s) < 0 ? NULL : s->dev_ptr;
}

void *kpl_storage_device_mutable(kpl_storage *s)
{
    kpl__storage_drop_packed(s);
    if (s->kept) unkeep(s);
    if (is_cpu(s)) {
        if (s->wrap_release && kpl__host_fence() < 0) return NULL;
        s->state = KPL_MEM_HOST;
        return s->dev_ptr;
    }
    if (to_device(s) < 0) return NULL;
    s->state = KPL_MEM_DEVICE;
    drop_host(s);
    return s->dev_ptr;
}
