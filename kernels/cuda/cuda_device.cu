/*
 * cuda_device.cu — the CUDA device backend: device discovery, per-device
 * streams and cuBLAS handle, raw and pinned memory, transfers, the deferred
 * index checks, and the error conversion shared by the kernel files.
 *
 * Synchronisation policy (DESIGN.md: never synchronise the stream except
 * where a value goes to the host): kernels and device-to-device copies are
 * queued on the compute stream and return at once.  Host transfers run on
 * the copy stream, ordered with the compute stream by events:
 *
 *   upload (copy_h2d)  The copy stream first waits, on the GPU, for the work
 *       queued on the compute stream so far: the caching allocator knows no
 *       streams, so the destination block may have been freed by a kernel
 *       still queued.  From page-locked memory (the loader's slots) the
 *       host does not wait: a large upload goes to a staging block of the
 *       copy stream's own pool (stream-ordered, so it needs no wait for the
 *       compute stream and overlaps the kernels already queued), the compute
 *       stream waits for it through an event and moves it into place with a
 *       device-to-device copy; a small one goes straight to its destination
 *       behind the compute stream's work.  Either way later kernels wait for
 *       the copy on the GPU, and host_fence (called before pinned memory that
 *       was uploaded is written or handed back, storage.c) waits for the host
 *       side.  From pageable memory the upload is synchronous, in chunks
 *       through a bounded pinned staging buffer.
 *   download (copy_d2h)  Waits for the compute stream's work on the GPU, then
 *       the host waits for the copy (it needs the bytes); pageable
 *       destinations go through the same staging buffer.  The deferred
 *       index checks are read in the same wait.
 *   kpl_device_synchronize  cudaDeviceSynchronize: every stream of the device,
 *       NCCL's included, and the deferred index checks.
 */
#include "cuda_impl.h"

#include <string.h>

/* ---- errors ------------------------------------------------------------------ */

/* Errors after which the device (or the driver) is unusable, as opposed to
 * a bad call or a library problem. */
static bool is_device_error(cudaError_t err)
{
    switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorStubLibrary:
    case cudaErrorDevicesUnavailable:
    case cudaErrorDeviceNotLicensed:
    case cudaErrorDeviceUninitialized:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
        return true;
    default:
        return false;
    }
}

extern "C" kpl_status kpl__cuda_fail(cudaError_t err, const char *call, const char *file,
                                     int line)
{
    /* Reset the runtime's last-error slot: a non-sticky error would
     * otherwise be reported again by the next launch check.  (Sticky
     * errors, which poison the context, stay and keep being reported.) */
    (void)cudaGetLastError();
    kpl_status st = err == cudaErrorMemoryAllocation ? KPL_ENOMEM
                    : is_device_error(err)          ? KPL_EDEVICE
                                                    : KPL_EBACKEND;
    return kpl_error_at(st, file, line, "%s failed: %s (%s)", call, cudaGetErrorString(err),
                      cudaGetErrorName(err));
}

extern "C" kpl_status kpl__cublas_fail(cublasStatus_t err, const char *call,
                                       const char *file, int line)
{
    kpl_status st = err == CUBLAS_STATUS_ALLOC_FAILED ? KPL_ENOMEM : KPL_EBACKEND;
    return kpl_error_at(st, file, line, "%s failed: %s (cuBLAS status %d)", call,
                      cublasGetStatusString(err), (int)err);
}

extern "C" kpl_status kpl__cuda_check_launch(const char *what, const char *file, int line)
{
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) return KPL_OK;
    kpl_status st = err == cudaErrorMemoryAllocation ? KPL_ENOMEM
                    : is_device_error(err)          ? KPL_EDEVICE
                                                    : KPL_EBACKEND;
    return kpl_error_at(st, file, line, "%s: kernel launch failed: %s (%s)", what,
                      cudaGetErrorString(err), cudaGetErrorName(err));
}

/* ---- helpers for the kernel files -------------------------------------------- */

extern "C" kpl_status kpl__cuda_enter(kpl_device *dev, kpl_cuda_state **out)
{
    KPL_CHECK(dev != NULL && dev->type == KPL_DEVICE_CUDA && dev->impl != NULL,
              KPL_EDEVICE, "cuda: %s is not an initialised CUDA device",
              dev ? dev->name : "(null)");
    KPL_CUDA_TRY(cudaSetDevice(dev->index));
    *out = (kpl_cuda_state *)dev->impl;
    return KPL_OK;
}

extern "C" kpl_status kpl__cuda_enter_tensor(const kpl_tensor *t, kpl_cuda_state **out)
{
    return kpl__cuda_enter(kpl_tensor_device(t), out);
}

extern "C" kpl_status kpl__cuda_pointers(const kpl_kernel_args *args, int nin,
                                         kpl_cuda_state **cs, void **out, const void **in)
{
    KPL_TRY(kpl__cuda_enter_tensor(args->out, cs));
    for (int k = 0; k < nin; k++) {
        in[k] = kpl_tensor_data((kpl_tensor *)args->in[k]);
        if (!in[k]) return kpl_last_status();
    }
    *out = kpl_tensor_mutable(args->out);
    return *out ? KPL_OK : kpl_last_status();
}

extern "C" unsigned kpl__cuda_blocks(const kpl_cuda_state *cs, int64_t n, int threads)
{
    /* A few resident blocks per multiprocessor hide latency; beyond that
     * the grid-stride loop does the rest with fewer block launches. */
    int64_t cap = (int64_t)(cs->sm_count > 0 ? cs->sm_count : 1) * 32;
    int64_t need = (n + threads - 1) / threads;
    if (need < 1) need = 1;
    return (unsigned)(need < cap ? need : cap);
}

/* ---- the backend vtable ------------------------------------------------------ */

static int cuda_count(const char **why)
{
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        if (why) *why = cudaGetErrorString(err); /* static storage */
        return 0;
    }
    if (n <= 0 && why) *why = "the CUDA driver reports no device";
    return n > 0 ? n : 0;
}

static void state_destroy(kpl_cuda_state *cs)
{
    if (!cs) return;
    /* Teardown of a half-built state: errors here cannot be acted on. */
    if (cs->dnn) cudnnDestroy(cs->dnn);
    if (cs->blas) cublasDestroy(cs->blas);
    if (cs->check) cudaFree(cs->check);
    if (cs->check_host) cudaFreeHost(cs->check_host);
    if (cs->host_stage) cudaFreeHost(cs->host_stage);
    for (int i = 0; i < 2; i++)
        if (cs->host_stage_ev[i]) cudaEventDestroy(cs->host_stage_ev[i]);
    if (cs->stage_pool) cudaMemPoolDestroy(cs->stage_pool);
    if (cs->upload_done) cudaEventDestroy(cs->upload_done);
    if (cs->compute_mark) cudaEventDestroy(cs->compute_mark);
    if (cs->copy) cudaStreamDestroy(cs->copy);
    if (cs->compute) cudaStreamDestroy(cs->compute);
    (void)cudaGetLastError();
    pthread_mutex_destroy(&cs->check_lock);
    pthread_mutex_destroy(&cs->host_stage_lock);
    free(cs);
}

/* Creates one CUDA call's worth of state inside cuda_init, jumping to its
 * `fail:` label on error. */
#define INIT_CUDA(call)                                                     \
    do {                                                                    \
        cudaError_t e_ = (call);                                            \
        if (e_ != cudaSuccess) {                                            \
            st = kpl__cuda_fail(e_, #call, __FILE__, __LINE__);             \
            goto fail;                                                      \
        }                                                                   \
    } while (0)
#define INIT_CUBLAS(call)                                                   \
    do {                                                                    \
        cublasStatus_t e_ = (call);                                         \
        if (e_ != CUBLAS_STATUS_SUCCESS) {                                  \
            st = kpl__cublas_fail(e_, #call, __FILE__, __LINE__);           \
            goto fail;                                                      \
        }                                                                   \
    } while (0)

/* The pool of the staging blocks of large uploads, where the driver has
 * stream-ordered allocation; without it uploads go straight to their
 * destination (no overlap with queued kernels, still no host wait). */
static void stage_pool_create(kpl_device *dev, kpl_cuda_state *cs)
{
    int ok = 0;
    if (cudaDeviceGetAttribute(&ok, cudaDevAttrMemoryPoolsSupported, dev->index) != cudaSuccess ||
        !ok) {
        (void)cudaGetLastError();
        return;
    }
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev->index;
    cudaMemPool_t pool = NULL;
    if (cudaMemPoolCreate(&pool, &props) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    /* Keep freed staging blocks for the next batch rather than giving them
     * back to the driver at every synchronisation; and never let the pool
     * reuse a block still waiting for its free on the compute stream by
     * making the copy stream wait for that stream (which would undo the
     * overlap): it takes fresh memory instead, at most a batch or two. */
    uint64_t keep = ~(uint64_t)0; /* cuuint64_t */
    int no = 0;
    if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess ||
        cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &no) !=
            cudaSuccess) {
        (void)cudaGetLastError();
        cudaMemPoolDestroy(pool);
        return;
    }
    cs->stage_pool = pool;
}

static kpl_status cuda_init(kpl_device *dev)
{
    kpl_status st = KPL_OK;
    kpl_cuda_state *cs = (kpl_cuda_state *)calloc(1, sizeof *cs);
    KPL_CHECK(cs != NULL, KPL_ENOMEM, "%s: no host memory for the device state", dev->name);
    pthread_mutex_init(&cs->check_lock, NULL);
    pthread_mutex_init(&cs->host_stage_lock, NULL);
    INIT_CUDA(cudaSetDevice(dev->index));
    /* Non-blocking streams: no implicit ordering with the legacy default
     * stream, which kpl never uses. */
    INIT_CUDA(cudaStreamCreateWithFlags(&cs->compute, cudaStreamNonBlocking));
    INIT_CUDA(cudaStreamCreateWithFlags(&cs->copy, cudaStreamNonBlocking));
    INIT_CUDA(cudaEventCreateWithFlags(&cs->compute_mark, cudaEventDisableTiming));
    INIT_CUDA(cudaEventCreateWithFlags(&cs->upload_done, cudaEventDisableTiming));
    INIT_CUDA(cudaDeviceGetAttribute(&cs->sm_count, cudaDevAttrMultiProcessorCount,
                                     dev->index));
    /* The record of the deferred index checks, reset: no ticket, no position. */
    INIT_CUDA(cudaMalloc((void **)&cs->check, sizeof *cs->check));
    INIT_CUDA(cudaHostAlloc((void **)&cs->check_host, sizeof *cs->check_host,
                            cudaHostAllocDefault));
    INIT_CUDA(cudaMemsetAsync(cs->check, 0, sizeof *cs->check, cs->compute));
    INIT_CUDA(cudaMemsetAsync(&cs->check->pos, 0xff, sizeof cs->check->pos, cs->compute));
    stage_pool_create(dev, cs);
    INIT_CUDA(cudaDeviceGetAttribute(&cs->cc_major, cudaDevAttrComputeCapabilityMajor,
                                     dev->index));
    INIT_CUBLAS(cublasCreate(&cs->blas));
    INIT_CUBLAS(cublasSetStream(cs->blas, cs->compute));
    /* The default math never rounds f32 inputs to TF32 (the GEMMs ask for
     * it per call, kpl_set_tf32); half GEMMs accumulate in f32 throughout,
     * split-K partial sums included. */
    INIT_CUBLAS(cublasSetMathMode(cs->blas, (cublasMath_t)(CUBLAS_DEFAULT_MATH |
                                           CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    dev->impl = cs;
    return KPL_OK;
fail:
    state_destroy(cs);
    return st;
}

static kpl_status cuda_raw_alloc(void *ctx, size_t bytes, void **out)
{
    kpl_device *dev = (kpl_device *)ctx;
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    void *p = NULL;
    KPL_CUDA_TRY(cudaMalloc(&p, bytes ? bytes : 256));
    *out = p;
    return KPL_OK;
}

static void cuda_raw_free(void *ctx, void *ptr)
{
    kpl_device *dev = (kpl_device *)ctx;
    if (!ptr) return;
    /* cudaFree waits for the work still using the block.  A failure (a
     * context already lost) leaves nothing to release. */
    if (cudaSetDevice(dev->index) == cudaSuccess) cudaFree(ptr);
    (void)cudaGetLastError();
}

static kpl_status cuda_pinned_alloc(void *ctx, size_t bytes, void **out)
{
    kpl_device *dev = (kpl_device *)ctx;
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    void *p = NULL;
    /* Portable: a pinned host copy may meet the streams of other devices
     * (GPU to GPU copies go through it). */
    KPL_CUDA_TRY(cudaHostAlloc(&p, bytes ? bytes : 256, cudaHostAllocPortable));
    *out = p;
    return KPL_OK;
}

static void cuda_pinned_free(void *ctx, void *ptr)
{
    kpl_device *dev = (kpl_device *)ctx;
    if (!ptr) return;
    if (cudaSetDevice(dev->index) == cudaSuccess) cudaFreeHost(ptr);
    (void)cudaGetLastError();
}

static kpl_status cuda_host_register(kpl_device *dev, void *ptr, size_t bytes)
{
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    KPL_CUDA_TRY(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable));
    return KPL_OK;
}

static void cuda_host_unregister(kpl_device *dev, void *ptr)
{
    if (cudaSetDevice(dev->index) == cudaSuccess) cudaHostUnregister(ptr);
    (void)cudaGetLastError();
}

/* ---- deferred index checks ---------------------------------------------------------- */

extern "C" kpl_status kpl__cuda_check_begin(kpl_cuda_state *cs, kpl_cuda_check_desc *desc,
                                            kpl_cuda_check_rec **rec, unsigned long long *ticket)
{
    pthread_mutex_lock(&cs->check_lock);
    desc->ticket = ++cs->check_issued;
    cs->check_ring[desc->ticket % KPL_CUDA_CHECK_RING] = *desc;
    pthread_mutex_unlock(&cs->check_lock);
    *rec = cs->check;
    *ticket = desc->ticket;
    return KPL_OK;
}

/* One thread: the index at the failing call's smallest bad position,
 * while the call's indices are still alive (stream order). */
__global__ void check_value_kernel(kpl_cuda_check_rec *r, unsigned long long ticket,
                                   const int64_t *idx)
{
    if (r->ticket == ticket && r->pos != ~0ull) r->value = idx[r->pos];
}

extern "C" kpl_status kpl__cuda_check_end(kpl_cuda_state *cs, unsigned long long ticket,
                                          const int64_t *idx)
{
    check_value_kernel<<<1, 1, 0, cs->compute>>>(cs->check, ticket, idx);
    return KPL_CUDA_LAUNCHED("index check");
}

/* The last ticket a read queued now covers, or 0 when no check is unread. */
static unsigned long long check_pending(kpl_cuda_state *cs)
{
    pthread_mutex_lock(&cs->check_lock);
    unsigned long long upto = cs->check_issued > cs->check_read ? cs->check_issued : 0;
    pthread_mutex_unlock(&cs->check_lock);
    return upto;
}

/* "(2,0,5)": the coordinates of flat position p in shape. */
static void position_str(const kpl_cuda_check_desc *d, unsigned long long p, char *buf,
                         size_t len)
{
    int64_t pos[KPL_MAX_DIMS], f = (int64_t)p;
    for (int k = d->ndim - 1; k >= 0; k--) {
        pos[k] = d->shape[k] > 0 ? f % d->shape[k] : 0;
        f = d->shape[k] > 0 ? f / d->shape[k] : 0;
    }
    kpl_shape_str(d->ndim, pos, buf, len);
}

/* After a read of the record (cs->check_host) that covered every check up
 * to ticket `upto`: KPL_ERANGE naming the first failing call, and the
 * record reset for the next ones. */
static kpl_status check_examine(kpl_device *dev, kpl_cuda_state *cs, unsigned long long upto)
{
    kpl_cuda_check_rec r = *cs->check_host;
    kpl_cuda_check_desc d;
    memset(&d, 0, sizeof d);
    bool known = false;
    pthread_mutex_lock(&cs->check_lock);
    if (upto > cs->check_read) cs->check_read = upto;
    if (r.ticket) {
        d = cs->check_ring[r.ticket % KPL_CUDA_CHECK_RING];
        known = d.ticket == r.ticket;
    }
    pthread_mutex_unlock(&cs->check_lock);
    if (!r.ticket) return KPL_OK;
    /* Reset in stream order: the checks queued from now on start clean
     * (any queued before now that failed too are counted in r.count). */
    cudaError_t e = cudaMemsetAsync(cs->check, 0, sizeof *cs->check, cs->compute);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(&cs->check->pos, 0xff, sizeof cs->check->pos, cs->compute);
    if (e != cudaSuccess) return kpl__cuda_fail(e, "resetting the index check", __FILE__, __LINE__);
    const char *later = "(CUDA index errors are found on the device and reported at the next "
                        "copy to the host or kpl_device_synchronize)";
    if (!known)
        return KPL_ERROR(KPL_ERANGE, "%s: %llu indices out of range in an index operation %s",
                         dev->name, r.count, later);
    char pos[96];
    position_str(&d, r.pos, pos, sizeof pos);
    return KPL_ERROR(KPL_ERANGE,
                     "%s: index %lld at position %s of idx is outside [0, %lld)%s%s (%llu "
                     "bad indices in all) %s",
                     d.op, r.value, pos, (long long)d.range, d.where[0] ? " " : "", d.where,
                     r.count, later);
}

/* ---- transfers -------------------------------------------------------------------- */

#define KPL_CUDA_STAGE ((size_t)8 << 20)      /* bytes per half of the pinned staging buffer */
#define KPL_CUDA_STAGE_MIN ((size_t)1 << 20)  /* smaller uploads skip the device staging */

static bool is_pinned(const void *p)
{
    cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return at.type == cudaMemoryTypeHost;
}

/* The copy stream waits (on the GPU) for the work queued on compute. */
static kpl_status copy_after_compute(kpl_cuda_state *cs)
{
    KPL_CUDA_TRY(cudaEventRecord(cs->compute_mark, cs->compute));
    KPL_CUDA_TRY(cudaStreamWaitEvent(cs->copy, cs->compute_mark, 0));
    return KPL_OK;
}

/* A pageable transfer of n bytes through the two pinned halves of the
 * staging buffer: while the GPU moves one half the host fills or empties
 * the other.  Synchronous.  The caller holds host_stage_lock and has
 * ordered the copy stream after the compute stream. */
static kpl_status staged_copy(kpl_cuda_state *cs, void *dst, const void *src, size_t n,
                              bool up)
{
    if (!cs->host_stage)
        KPL_CUDA_TRY(cudaHostAlloc(&cs->host_stage, 2 * KPL_CUDA_STAGE, cudaHostAllocDefault));
    for (int i = 0; i < 2; i++)
        if (!cs->host_stage_ev[i])
            KPL_CUDA_TRY(cudaEventCreateWithFlags(&cs->host_stage_ev[i], cudaEventDisableTiming));
    char *stage[2] = {(char *)cs->host_stage, (char *)cs->host_stage + KPL_CUDA_STAGE};
    size_t off[2] = {0, 0}, len[2] = {0, 0};
    bool busy[2] = {false, false};
    size_t nchunks = (n + KPL_CUDA_STAGE - 1) / KPL_CUDA_STAGE;
    for (size_t c = 0; c <= nchunks; c++) {
        int h = (int)(c % 2), prev = 1 - h;
        if (c < nchunks) {
            if (busy[h]) KPL_CUDA_TRY(cudaEventSynchronize(cs->host_stage_ev[h]));
            off[h] = c * KPL_CUDA_STAGE;
            len[h] = n - off[h] < KPL_CUDA_STAGE ? n - off[h] : KPL_CUDA_STAGE;
            if (up) {
                memcpy(stage[h], (const char *)src + off[h], len[h]);
                KPL_CUDA_TRY(cudaMemcpyAsync((char *)dst + off[h], stage[h], len[h],
                                             cudaMemcpyHostToDevice, cs->copy));
            } else {
                KPL_CUDA_TRY(cudaMemcpyAsync(stage[h], (const char *)src + off[h], len[h],
                                             cudaMemcpyDeviceToHost, cs->copy));
            }
            KPL_CUDA_TRY(cudaEventRecord(cs->host_stage_ev[h], cs->copy));
            busy[h] = true;
        }
        /* the previous chunk of a download is emptied while this one moves */
        if (!up && c > 0 && busy[prev]) {
            KPL_CUDA_TRY(cudaEventSynchronize(cs->host_stage_ev[prev]));
            memcpy((char *)dst + off[prev], stage[prev], len[prev]);
            busy[prev] = false;
        }
    }
    KPL_CUDA_TRY(cudaStreamSynchronize(cs->copy));
    return KPL_OK;
}

static kpl_status cuda_copy_h2d(kpl_device *dev, void *dst, const void *src, size_t n)
{
    if (n == 0) return KPL_OK;
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    if (!is_pinned(src)) {
        /* Pageable: the host waits (the caller may reuse src at once). */
        KPL_TRY(copy_after_compute(cs));
        if (n < KPL_CUDA_STAGE_MIN) {
            KPL_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, cs->copy));
            KPL_CUDA_TRY(cudaStreamSynchronize(cs->copy));
            return KPL_OK;
        }
        pthread_mutex_lock(&cs->host_stage_lock);
        kpl_status st = staged_copy(cs, dst, src, n, true);
        pthread_mutex_unlock(&cs->host_stage_lock);
        return st;
    }
    void *stage = NULL;
    if (cs->stage_pool && n >= KPL_CUDA_STAGE_MIN &&
        cudaMallocFromPoolAsync(&stage, n, cs->stage_pool, cs->copy) != cudaSuccess) {
        (void)cudaGetLastError(); /* no room for a staging block: go direct */
        stage = NULL;
    }
    if (stage) {
        /* Overlaps the kernels already queued: the staging block belongs
         * to the copy stream, which therefore waits for nothing. */
        KPL_CUDA_TRY(cudaMemcpyAsync(stage, src, n, cudaMemcpyHostToDevice, cs->copy));
        KPL_CUDA_TRY(cudaEventRecord(cs->upload_done, cs->copy));
        KPL_CUDA_TRY(cudaStreamWaitEvent(cs->compute, cs->upload_done, 0));
        KPL_CUDA_TRY(cudaMemcpyAsync(dst, stage, n, cudaMemcpyDeviceToDevice, cs->compute));
        KPL_CUDA_TRY(cudaFreeAsync(stage, cs->compute));
    } else {
        KPL_TRY(copy_after_compute(cs));
        KPL_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, cs->copy));
        KPL_CUDA_TRY(cudaEventRecord(cs->upload_done, cs->copy));
        KPL_CUDA_TRY(cudaStreamWaitEvent(cs->compute, cs->upload_done, 0));
    }
    __atomic_store_n(&cs->uploads_pending, 1, __ATOMIC_RELEASE);
    return KPL_OK;
}

static kpl_status cuda_host_fence(kpl_device *dev)
{
    kpl_cuda_state *cs = (kpl_cuda_state *)dev->impl;
    if (!cs || !__atomic_load_n(&cs->uploads_pending, __ATOMIC_ACQUIRE)) return KPL_OK;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    /* Cleared before the wait: an upload queued meanwhile sets it again. */
    __atomic_store_n(&cs->uploads_pending, 0, __ATOMIC_RELEASE);
    cudaError_t e = cudaEventSynchronize(cs->upload_done);
    if (e != cudaSuccess) {
        __atomic_store_n(&cs->uploads_pending, 1, __ATOMIC_RELEASE);
        return kpl__cuda_fail(e, "cudaEventSynchronize (uploads)", __FILE__, __LINE__);
    }
    return KPL_OK;
}

static kpl_status cuda_copy_d2h(kpl_device *dev, void *dst, const void *src, size_t n)
{
    if (n == 0) return KPL_OK;
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    unsigned long long upto = check_pending(cs);
    KPL_TRY(copy_after_compute(cs));
    if (upto)
        KPL_CUDA_TRY(cudaMemcpyAsync(cs->check_host, cs->check, sizeof *cs->check_host,
                                     cudaMemcpyDeviceToHost, cs->copy));
    if (n < KPL_CUDA_STAGE_MIN || is_pinned(dst)) {
        KPL_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, cs->copy));
        KPL_CUDA_TRY(cudaStreamSynchronize(cs->copy));
    } else {
        pthread_mutex_lock(&cs->host_stage_lock);
        kpl_status st = staged_copy(cs, dst, src, n, false);
        pthread_mutex_unlock(&cs->host_stage_lock);
        KPL_TRY(st);
    }
    return upto ? check_examine(dev, cs, upto) : KPL_OK;
}

static kpl_status cuda_copy_d2d(kpl_device *dev, void *dst, const void *src, size_t n)
{
    if (n == 0) return KPL_OK;
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    KPL_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, cs->compute));
    return KPL_OK;
}

/* Every stream of the device: kpl's two, the upload pool's frees, and
 * those of libraries that queue work of their own (NCCL's stream). */
static kpl_status cuda_synchronize(kpl_device *dev)
{
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    unsigned long long upto = check_pending(cs);
    KPL_CUDA_TRY(cudaDeviceSynchronize());
    if (!upto) return KPL_OK;
    KPL_CUDA_TRY(cudaMemcpyAsync(cs->check_host, cs->check, sizeof *cs->check_host,
                                 cudaMemcpyDeviceToHost, cs->copy));
    KPL_CUDA_TRY(cudaStreamSynchronize(cs->copy));
    return check_examine(dev, cs, upto);
}

/* ---- events: on the compute stream, with timing -------------------------------- */

static kpl_status cuda_event_create(kpl_device *dev, void **handle)
{
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    cudaEvent_t ev;
    KPL_CUDA_TRY(cudaEventCreate(&ev));
    *handle = (void *)ev;
    return KPL_OK;
}

static void cuda_event_destroy(kpl_device *dev, void *handle)
{
    if (cudaSetDevice(dev->index) == cudaSuccess) cudaEventDestroy((cudaEvent_t)handle);
    (void)cudaGetLastError();
}

static kpl_status cuda_event_record(kpl_device *dev, void *handle)
{
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    KPL_CUDA_TRY(cudaEventRecord((cudaEvent_t)handle, cs->compute));
    return KPL_OK;
}

static kpl_status cuda_event_sync(kpl_device *dev, void *handle)
{
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    KPL_CUDA_TRY(cudaEventSynchronize((cudaEvent_t)handle));
    return KPL_OK;
}

static kpl_status cuda_event_query(kpl_device *dev, void *handle, bool *done)
{
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    cudaError_t err = cudaEventQuery((cudaEvent_t)handle);
    if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        *done = false;
        return KPL_OK;
    }
    KPL_CUDA_TRY(err);
    *done = true;
    return KPL_OK;
}

static kpl_status cuda_event_elapsed(kpl_device *dev, void *start, void *end, double *ms)
{
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    float f = 0;
    KPL_CUDA_TRY(cudaEventElapsedTime(&f, (cudaEvent_t)start, (cudaEvent_t)end));
    *ms = f;
    return KPL_OK;
}

static kpl_status cuda_native_stream(kpl_device *dev, void **stream)
{
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    *stream = (void *)cs->compute;
    return KPL_OK;
}

/* Registration touches only the kernel table, never the driver: it runs at
 * start-up in every process, with or without a GPU. */
static void cuda_register_kernels(void)
{
    kpl__cuda_register_eltwise();
    kpl__cuda_register_reduce();
    kpl__cuda_register_matmul();
    kpl__cuda_register_conv();
    kpl__cuda_register_nn();
    kpl__cuda_register_index();
    kpl__cuda_register_misc();
    kpl__cuda_register_vision();
}

static const kpl_device_backend cuda_backend = {
    /* .name = */ "cuda",
    /* .type = */ KPL_DEVICE_CUDA,
    /* .count = */ cuda_count,
    /* .init = */ cuda_init,
    /* .raw_alloc = */ cuda_raw_alloc,
    /* .raw_free = */ cuda_raw_free,
    /* .pinned_alloc = */ cuda_pinned_alloc,
    /* .pinned_free = */ cuda_pinned_free,
    /* .host_register = */ cuda_host_register,
    /* .host_unregister = */ cuda_host_unregister,
    /* .copy_h2d = */ cuda_copy_h2d,
    /* .copy_d2h = */ cuda_copy_d2h,
    /* .copy_d2d = */ cuda_copy_d2d,
    /* .host_fence = */ cuda_host_fence,
    /* .synchronize = */ cuda_synchronize,
    /* .event_create = */ cuda_event_create,
    /* .event_destroy = */ cuda_event_destroy,
    /* .event_record = */ cuda_event_record,
    /* .event_sync = */ cuda_event_sync,
    /* .event_query = */ cuda_event_query,
    /* .event_elapsed = */ cuda_event_elapsed,
    /* .register_kernels = */ cuda_register_kernels,
    /* .algo_cache_stats = */ kpl__cuda_conv_cache_stats,
    /* .native_stream = */ cuda_native_stream,
};

extern "C" const kpl_device_backend *kpl__cuda_backend(void) { return &cuda_backend; }
