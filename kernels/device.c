/*
 * device.c — the backend registry, devices, the CPU backend and the kernel
 * registry.
 *
 * Process-wide state here is limited to what STYLE.md allows: the table of
 * backends and their devices (created on first use, never destroyed) and
 * the kernel table (filled once at start, read-only afterwards).
 */
#include "kernels_impl.h"

#include <string.h>
#include <time.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#define MAX_CUDA_DEVICES 16

/* ---- the CPU backend ------------------------------------------------------- */

static kpl_status cpu_raw_alloc(void *ctx, size_t bytes, void **out)
{
    (void)ctx;
    /* 64-byte alignment: a cache line, and what AVX-512 loads prefer. */
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) return KPL_ENOMEM;
    *out = p;
    return KPL_OK;
}

static void cpu_raw_free(void *ctx, void *ptr)
{
    (void)ctx;
    free(ptr);
}

static kpl_status cpu_copy(kpl_device *dev, void *dst, const void *src, size_t n)
{
    (void)dev;
    if (n) memcpy(dst, src, n);
    return KPL_OK;
}

static int cpu_count(const char **why)
{
    (void)why;
    return 1;
}

static kpl_status cpu_init(kpl_device *dev)
{
    (void)dev;
    return KPL_OK;
}

static kpl_status cpu_sync(kpl_device *dev)
{
    (void)dev;
    return KPL_OK;
}

static void cpu_register_kernels(void)
{
    kpl__cpu_register_eltwise();
    kpl__cpu_register_reduce();
    kpl__cpu_register_matmul();
    kpl__cpu_register_misc();
    kpl__cpu_register_conv();
    kpl__cpu_register_pool();
    kpl__cpu_register_norm();
    kpl__cpu_register_index();
    kpl__cpu_register_vision();
    kpl__cpu_register_loss();
}

/* Matmul and convolution keep one cache each. */
static kpl_algo_cache_stats cpu_algo_cache_stats(void)
{
    kpl_algo_cache_stats a = kpl__cpu_algo_cache_stats(), b = kpl__cpu_conv_cache_stats();
    return (kpl_algo_cache_stats){a.hits + b.hits, a.misses + b.misses, a.entries + b.entries};
}

static const kpl_device_backend cpu_backend = {
    .name = "cpu",
    .type = KPL_DEVICE_CPU,
    .count = cpu_count,
    .init = cpu_init,
    .raw_alloc = cpu_raw_alloc,
    .raw_free = cpu_raw_free,
    .pinned_alloc = NULL,
    .pinned_free = NULL,
    .host_register = NULL,
    .host_unregister = NULL,
    .copy_h2d = cpu_copy,
    .copy_d2h = cpu_copy,
    .copy_d2d = cpu_copy,
    .synchronize = cpu_sync,
    .register_kernels = cpu_register_kernels,
    .algo_cache_stats = cpu_algo_cache_stats,
};

const kpl_device_backend *kpl__cpu_backend(void) { return &cpu_backend; }

/* ---- registry of backends and devices -------------------------------------- */

static const kpl_device_backend *backend_of(kpl_device_type t)
{
    switch (t) {
    case KPL_DEVICE_CPU:
        return kpl__cpu_backend();
    case KPL_DEVICE_CUDA:
#if KPL_HAVE_CUDA
        return kpl__cuda_backend();
#else
        return NULL;
#endif
    default:
        return NULL;
    }
}

static pthread_mutex_t devices_lock = PTHREAD_MUTEX_INITIALIZER;
static kpl_device cpu_device;
static kpl_device *cuda_devices[MAX_CUDA_DEVICES];
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* kernels.h: an on/off environment variable, bad values named. */
bool kpl_env_switch(const char *name, bool dflt)
{
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    if (!strcmp(v, "0") || !strcmp(v, "1")) return v[0] == '1';
    fprintf(stderr, "kpl: %s=%s is neither 0 nor 1; it stays %s\n", name, v, dflt ? "on" : "off");
    return dflt;
}

/* glibc's malloc puts a block below its mmap threshold in its heap, and
 * raises the threshold to the largest block freed (up to 32 MiB).  oneDNN
 * takes each primitive's scratchpad from malloc at every execution (up to
 * 63 MB a U-Net step) and kpl's direct convolution loops their per-thread
 * accumulators: once the threshold has risen, those land in the heap,
 * where a freed one leaves a hole the process keeps.  A fixed threshold
 * sends blocks from 4 MiB up to mmap, returned whole when freed: U-Net's
 * peak RSS (bench_seg --mem unet) 363-391 -> 330-338 MB, DeepLabv3's 705
 * -> 680, ResNet-50 b8's 1122-1124 -> 1095-1097 MiB, for ~11k more page
 * faults a U-Net step and no change in its time that the run's noise
 * shows (docs/memory.md).  KPL_MALLOC_MMAP_THRESHOLD=BYTES sets another
 * (0: glibc's own rule); glibc's own settings (MALLOC_MMAP_THRESHOLD_,
 * GLIBC_TUNABLES) are left to rule. */
static void set_malloc_threshold(void)
{
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
    const char *tun = getenv("GLIBC_TUNABLES");
    if (getenv("MALLOC_MMAP_THRESHOLD_") || (tun && strstr(tun, "mmap_threshold"))) return;
    const char *env = getenv("KPL_MALLOC_MMAP_THRESHOLD");
    long long bytes = (long long)4 << 20;
    if (env) {
        char *end;
        bytes = strtoll(env, &end, 10);
        if (end == env || *end || bytes < 0 || bytes > (long long)32 << 20) {
            fprintf(stderr,
                    "kpl: KPL_MALLOC_MMAP_THRESHOLD=%s is not a byte count from 0 to "
                    "33554432 (32 MiB); glibc's own rule stays\n",
                    env);
            return;
        }
    }
    if (bytes > 0) mallopt(M_MMAP_THRESHOLD, (int)bytes);
#endif
}

static void init_all(void)
{
    set_malloc_threshold();
    cpu_device.backend = kpl__cpu_backend();
    cpu_device.type = KPL_DEVICE_CPU;
    cpu_device.index = 0;
    strcpy(cpu_device.name, "cpu");
    cpu_device.alloc = kpl__allocator_create((kpl_raw_source){.alloc = cpu_raw_alloc,
                                                              .free = cpu_raw_free,
                                                              .ctx = NULL,
                                                              .name = "cpu",
                                                              .host_visible = true,
                                                              .trim = true});
    KPL_ASSERT(cpu_device.alloc != NULL, "cannot create the CPU allocator");
    for (int t = 0; t < KPL_DEVICE_TYPE_COUNT; t++) {
        const kpl_device_backend *b = backend_of((kpl_device_type)t);
        if (b && b->register_kernels) b->register_kernels();
    }
}

void kpl__init_once(void) { pthread_once(&init_once, init_all); }

kpl_device *kpl_device_cpu(void)
{
    kpl__init_once();
    return &cpu_device;
}

bool kpl_device_type_built(kpl_device_type type) { return backend_of(type) != NULL; }

int kpl_device_count(kpl_device_type type)
{
    const kpl_device_backend *b = backend_of(type);
    if (!b) return 0;
    int n = b->count(NULL);
    return n > MAX_CUDA_DEVICES && type == KPL_DEVICE_CUDA ? MAX_CUDA_DEVICES : n;
}

const char *kpl_device_unavailable_reason(kpl_device_type type)
{
    const kpl_device_backend *b = backend_of(type);
    if (!b)
        return type == KPL_DEVICE_CUDA ? "this build of kpl has no CUDA backend (configure with "
                                         "-DKPL_CUDA=ON on a machine with the CUDA toolkit)"
                                       : "no such device type";
    const char *why = NULL;
    if (b->count(&why) > 0) return NULL;
    return why ? why : "the driver reports no device";
}

static kpl_status gpu_raw_alloc(void *ctx, size_t bytes, void **out)
{
    kpl_device *d = ctx;
    return d->backend->raw_alloc(d, bytes, out);
}

static void gpu_raw_free(void *ctx, void *ptr)
{
    kpl_device *d = ctx;
    d->backend->raw_free(d, ptr);
}

static kpl_status gpu_pinned_alloc(void *ctx, size_t bytes, void **out)
{
    kpl_device *d = ctx;
    return d->backend->pinned_alloc(d, bytes, out);
}

static void gpu_pinned_free(void *ctx, void *ptr)
{
    kpl_device *d = ctx;
    d->backend->pinned_free(d, ptr);
}

static kpl_status cuda_device_open(int index, kpl_device **out)
{
    const kpl_device_backend *b = backend_of(KPL_DEVICE_CUDA);
    KPL_CHECK(b != NULL, KPL_EDEVICE,
              "device 'cuda:%d' requested, but this build of kpl has no CUDA "
              "backend (configure with -DKPL_CUDA=ON on a machine with the "
              "CUDA toolkit)",
              index);
    const char *why = NULL;
    int n = b->count(&why);
    KPL_CHECK(n > 0, KPL_EDEVICE,
              "device 'cuda:%d' requested, but no CUDA GPU was found%s%s",
              index, why ? ": " : "", why ? why : "");
    KPL_CHECK(index >= 0 && index < n && index < MAX_CUDA_DEVICES, KPL_EDEVICE,
              "device 'cuda:%d' requested, but only %d CUDA GPU%s found",
              index, n, n == 1 ? " was" : "s were");

    pthread_mutex_lock(&devices_lock);
    kpl_status st = KPL_OK;
    kpl_device *d = cuda_devices[index];
    if (!d) {
        d = calloc(1, sizeof *d);
        if (!d) {
            st = KPL_ERROR(KPL_ENOMEM, "cuda:%d: no host memory", index);
            goto done;
        }
        d->backend = b;
        d->type = KPL_DEVICE_CUDA;
        d->index = index;
        snprintf(d->name, sizeof d->name, "cuda:%d", index);
        st = b->init(d);
        if (st < 0) {
            free(d);
            d = NULL;
            goto done;
        }
        /* KPL_CUDA_ALLOC_UNCACHED=1: no caching (kpl_raw_source.uncached),
         * for compute-sanitizer runs, as PyTorch's
         * PYTORCH_NO_CUDA_MEMORY_CACHING */
        const char *uncached = getenv("KPL_CUDA_ALLOC_UNCACHED");
        d->alloc = kpl__allocator_create((kpl_raw_source){
            .alloc = gpu_raw_alloc, .free = gpu_raw_free, .ctx = d, .name = d->name,
            .uncached = uncached && !strcmp(uncached, "1")});
        d->pinned = kpl__allocator_create((kpl_raw_source){
            .alloc = gpu_pinned_alloc, .free = gpu_pinned_free, .ctx = d,
            .name = "pinned host", .host_visible = true});
        KPL_ASSERT(d->alloc && d->pinned, "cannot create CUDA allocators");
        /* Published whole: kpl__host_fence reads the table without the lock. */
        __atomic_store_n(&cuda_devices[index], d, __ATOMIC_RELEASE);
    }
done:
    pthread_mutex_unlock(&devices_lock);
    if (st == KPL_OK) *out = d;
    return st;
}

kpl_status kpl_device_get(const char *name, kpl_device **out)
{
    KPL_CHECK(name != NULL && out != NULL, KPL_EINVAL,
              "device_get: NULL argument");
    kpl__init_once();
    if (!strcmp(name, "cpu") || !strcmp(name, "cpu:0")) {
        *out = &cpu_device;
        return KPL_OK;
    }
    if (!strcmp(name, "cuda") || !strcmp(name, "gpu")) return cuda_device_open(0, out);
    if (!strncmp(name, "cuda:", 5)) {
        char *end = NULL;
        long idx = strtol(name + 5, &end, 10);
        KPL_CHECK(end != name + 5 && *end == '\0' && idx >= 0 && idx < 1024,
                  KPL_EINVAL, "device_get: malformed device name '%s' (expected "
                  "'cpu' or 'cuda:N')", name);
        return cuda_device_open((int)idx, out);
    }
    return KPL_ERROR(KPL_EINVAL,
                     "device_get: unknown device '%s' (expected 'cpu' or 'cuda:N')",
                     name);
}

kpl_device_type kpl_device_type_of(const kpl_device *dev) { return dev->type; }
int kpl_device_index(const kpl_device *dev) { return dev->index; }
const char *kpl_device_name(const kpl_device *dev) { return dev->name; }

kpl_status kpl_device_pin_host(kpl_device *dev, void *ptr, size_t bytes)
{
    KPL_CHECK(dev != NULL && ptr != NULL, KPL_EINVAL, "device_pin_host: NULL argument");
    return dev->backend->host_register ? dev->backend->host_register(dev, ptr, bytes) : KPL_OK;
}

void kpl_device_unpin_host(kpl_device *dev, void *ptr)
{
    if (dev && ptr && dev->backend->host_unregister) dev->backend->host_unregister(dev, ptr);
}

kpl_status kpl__host_fence(void)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        kpl_device *d = __atomic_load_n(&cuda_devices[i], __ATOMIC_ACQUIRE);
        if (d && d->backend->host_fence) KPL_TRY(d->backend->host_fence(d));
    }
    return KPL_OK;
}

kpl_status kpl_device_synchronize(kpl_device *dev)
{
    KPL_CHECK(dev != NULL, KPL_EINVAL, "device_synchronize: NULL device");
    return dev->backend->synchronize(dev);
}

kpl_status kpl_device_native_stream(kpl_device *dev, void **stream)
{
    KPL_CHECK(dev != NULL && stream != NULL, KPL_EINVAL, "device_native_stream: NULL argument");
    *stream = NULL;
    return dev->backend->native_stream ? dev->backend->native_stream(dev, stream) : KPL_OK;
}

kpl_memory_stats kpl_device_memory_stats(kpl_device *dev)
{
    return kpl__allocator_stats(dev->alloc);
}

void kpl_device_reset_peak(kpl_device *dev) { kpl__allocator_reset_peak(dev->alloc); }
void kpl_device_empty_cache(kpl_device *dev) { kpl__allocator_empty_cache(dev->alloc); }
void kpl_device_set_memory_limit(kpl_device *dev, size_t bytes)
{
    kpl__allocator_set_limit(dev->alloc, bytes);
}

kpl_status kpl_device_alloc(kpl_device *dev, size_t bytes, const char *what,
                            void **out)
{
    KPL_CHECK(dev != NULL && out != NULL, KPL_EINVAL, "device_alloc: NULL argument");
    return kpl__allocator_alloc(dev->alloc, bytes, what, out);
}

void kpl_device_set_budget(kpl_device *dev, size_t bytes, kpl_release_fn release, void *user)
{
    if (dev) kpl__allocator_set_budget(dev->alloc, dev, bytes, release, user);
}

size_t kpl_device_budget(const kpl_device *dev)
{
    return dev ? kpl__allocator_budget(dev->alloc) : 0;
}

void kpl_device_free(kpl_device *dev, void *ptr)
{
    if (dev && ptr) kpl__allocator_free(dev->alloc, ptr);
}

/* ---- algorithm caches --------------------------------------------------------- */

kpl_algo_cache_stats kpl_algo_cache_stats_get(kpl_device_type type)
{
    const kpl_device_backend *b = backend_of(type);
    if (!b || !b->algo_cache_stats) return (kpl_algo_cache_stats){0, 0, 0};
    return b->algo_cache_stats();
}

/* ---- events ------------------------------------------------------------------ */

struct kpl_event {
    kpl_device *dev;
    void *handle;     /* backend event, or NULL on a synchronous device */
    bool recorded;
    double host_time; /* seconds, for synchronous devices */
};

kpl_status kpl_event_create(kpl_device *dev, kpl_event **out)
{
    KPL_CHECK(dev != NULL && out != NULL, KPL_EINVAL, "event_create: NULL argument");
    kpl_event *ev = calloc(1, sizeof *ev);
    KPL_CHECK(ev != NULL, KPL_ENOMEM, "event_create: no host memory");
    ev->dev = dev;
    if (dev->backend->event_create) {
        kpl_status st = dev->backend->event_create(dev, &ev->handle);
        if (st < 0) {
            free(ev);
            return st;
        }
    }
    *out = ev;
    return KPL_OK;
}

void kpl_event_destroy(kpl_event *ev)
{
    if (!ev) return;
    if (ev->handle) ev->dev->backend->event_destroy(ev->dev, ev->handle);
    free(ev);
}

kpl_status kpl_event_record(kpl_event *ev)
{
    KPL_CHECK(ev != NULL, KPL_EINVAL, "event_record: NULL event");
    if (ev->handle) KPL_TRY(ev->dev->backend->event_record(ev->dev, ev->handle));
    ev->host_time = kpl_seconds();
    ev->recorded = true;
    return KPL_OK;
}

kpl_status kpl_event_synchronize(kpl_event *ev)
{
    KPL_CHECK(ev != NULL, KPL_EINVAL, "event_synchronize: NULL event");
    KPL_CHECK(ev->recorded, KPL_ESTATE, "event_synchronize: the event on %s was never recorded",
              ev->dev->name);
    return ev->handle ? ev->dev->backend->event_sync(ev->dev, ev->handle) : KPL_OK;
}

kpl_status kpl_event_query(kpl_event *ev, bool *done)
{
    KPL_CHECK(ev != NULL && done != NULL, KPL_EINVAL, "event_query: NULL argument");
    KPL_CHECK(ev->recorded, KPL_ESTATE, "event_query: the event on %s was never recorded",
              ev->dev->name);
    if (!ev->handle) {
        *done = true;
        return KPL_OK;
    }
    return ev->dev->backend->event_query(ev->dev, ev->handle, done);
}

kpl_status kpl_event_elapsed_ms(kpl_event *start, kpl_event *end, double *ms)
{
    KPL_CHECK(start != NULL && end != NULL && ms != NULL, KPL_EINVAL,
              "event_elapsed_ms: NULL argument");
    KPL_CHECK(start->dev == end->dev, KPL_EDEVICE,
              "event_elapsed_ms: events of different devices (%s, %s)", start->dev->name,
              end->dev->name);
    KPL_CHECK(start->recorded && end->recorded, KPL_ESTATE,
              "event_elapsed_ms: both events must be recorded first");
    if (!start->handle) {
        *ms = (end->host_time - start->host_time) * 1e3;
        return KPL_OK;
    }
    return start->dev->backend->event_elapsed(start->dev, start->handle, end->handle, ms);
}

/* ---- kernel registry -------------------------------------------------------- */

static kpl_kernel_fn kernel_table[KPL_KOP_COUNT][KPL_DEVICE_TYPE_COUNT][KPL_DTYPE_COUNT];
static pthread_mutex_t kernel_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *const kop_names[KPL_KOP_COUNT] = {
#define KPL_X_(e, s) [KPL_KOP_##e] = s,
    KPL_KOP_LIST(KPL_X_)
#undef KPL_X_
};

const char *kpl_kop_name(kpl_kop op)
{
    return (unsigned)op < KPL_KOP_COUNT ? kop_names[op] : "invalid-op";
}

static const char *device_type_name(kpl_device_type t)
{
    return t == KPL_DEVICE_CPU ? "cpu" : t == KPL_DEVICE_CUDA ? "cuda" : "invalid-device";
}

kpl_status kpl_kernel_register(kpl_kop op, kpl_device_type dev, kpl_dtype dt,
                               kpl_kernel_fn fn)
{
    KPL_CHECK((unsigned)op < KPL_KOP_COUNT && (unsigned)dev < KPL_DEVICE_TYPE_COUNT &&
                  (unsigned)dt < KPL_DTYPE_COUNT,
              KPL_EINVAL, "kernel_register: op %d, device %d, dtype %d out of range",
              (int)op, (int)dev, (int)dt);
    pthread_mutex_lock(&kernel_lock);
    kernel_table[op][dev][dt] = fn;
    pthread_mutex_unlock(&kernel_lock);
    return KPL_OK;
}

bool kpl_kernel_registered(kpl_kop op, kpl_device_type dev, kpl_dtype dt)
{
    kpl__init_once();
    return (unsigned)op < KPL_KOP_COUNT && (unsigned)dev < KPL_DEVICE_TYPE_COUNT &&
           (unsigned)dt < KPL_DTYPE_COUNT && kernel_table[op][dev][dt] != NULL;
}

bool kpl_precision_native(kpl_device_type type, kpl_dtype dt)
{
    if (dt == KPL_F32 || dt == KPL_F64) return true;
    return kpl_kernel_registered(KPL_KOP_CONV2D, type, dt) &&
           kpl_kernel_registered(KPL_KOP_MATMUL, type, dt);
}

kpl_status kpl_kernel_lookup(kpl_kop op, kpl_device_type dev, kpl_dtype dt,
                             kpl_kernel_fn *out)
{
    kpl__init_once();
    KPL_CHECK((unsigned)op < KPL_KOP_COUNT && (unsigned)dev < KPL_DEVICE_TYPE_COUNT &&
                  (unsigned)dt < KPL_DTYPE_COUNT,
              KPL_EINVAL, "kernel_lookup: op %d, device %d, dtype %d out of range",
              (int)op, (int)dev, (int)dt);
    /* Registration happens once at start; after it the table is read-only,
     * so lookups need no lock. */
    kpl_kernel_fn fn = kernel_table[op][dev][dt];
    KPL_CHECK(fn != NULL, KPL_ENOKERNEL, "no '%s' kernel for device %s and dtype %s",
              kop_names[op], device_type_name(dev), kpl_dtype_name(dt));
    *out = fn;
    return KPL_OK;
}
