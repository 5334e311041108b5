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
 */
#include "kernels_impl.h"

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

void kpl_storage_release(kpl_storage *s)
{
    if (!s) return;
    if (atomic_fetch_sub_explicit(&s->refcount, 1, memory_order_acq_rel) != 1) return;
    if (s->wrap_release) {
        /* An error here (a lost device) leaves no upload to wait for. */
        if (kpl__host_fence() < 0) kpl_clear_error();
        s->wrap_release(s->wrap_ctx);
        free(s);
        return;
    }
    if (!is_cpu(s) && s->host) kpl__allocator_free(kpl_device_cpu()->alloc, s->host);
    kpl__allocator_free(s->dev->alloc, s->dev_ptr);
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

const void *kpl_storage_host_data(kpl_storage *s)
{
    if (is_cpu(s)) return s->host;
    return to_host(s) < 0 ? NULL : s->host;
}

void *kpl_storage_host_mutable(kpl_storage *s)
{
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
    if (is_cpu(s)) return s->dev_ptr;
    return to_device(s) < 0 ? NULL : s->dev_ptr;
}

void *kpl_storage_device_mutable(kpl_storage *s)
{
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
