/*
 * cuda_device.cu — the CUDA device backend: device discovery, per-device
 * streams and cuBLAS handle, raw and pinned memory, transfers, and the
 * error conversion shared by the kernel files.
 *
 * Synchronisation policy (DESIGN.md: never synchronise the stream except
 * where a value goes to the host): kernels and device-to-device copies are
 * queued on the compute stream and return at once.  A host transfer is the
 * one place that waits: the copy stream first waits (through an event, on
 * the GPU) for everything already queued on the compute stream, since those
 * kernels may still write the source or read the destination, then the host
 * waits for the copy stream alone.
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
    if (cs->compute_mark) cudaEventDestroy(cs->compute_mark);
    if (cs->copy) cudaStreamDestroy(cs->copy);
    if (cs->compute) cudaStreamDestroy(cs->compute);
    (void)cudaGetLastError();
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

static kpl_status cuda_init(kpl_device *dev)
{
    kpl_status st = KPL_OK;
    kpl_cuda_state *cs = (kpl_cuda_state *)calloc(1, sizeof *cs);
    KPL_CHECK(cs != NULL, KPL_ENOMEM, "%s: no host memory for the device state", dev->name);
    INIT_CUDA(cudaSetDevice(dev->index));
    /* Non-blocking streams: no implicit ordering with the legacy default
     * stream, which kpl never uses. */
    INIT_CUDA(cudaStreamCreateWithFlags(&cs->compute, cudaStreamNonBlocking));
    INIT_CUDA(cudaStreamCreateWithFlags(&cs->copy, cudaStreamNonBlocking));
    INIT_CUDA(cudaEventCreateWithFlags(&cs->compute_mark, cudaEventDisableTiming));
    INIT_CUDA(cudaDeviceGetAttribute(&cs->sm_count, cudaDevAttrMultiProcessorCount,
                                     dev->index));
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

/* Queues `n` bytes on the copy stream behind everything on the compute
 * stream and waits for the copy. */
static kpl_status copy_host(kpl_device *dev, void *dst, const void *src, size_t n,
                            cudaMemcpyKind kind)
{
    if (n == 0) return KPL_OK;
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    KPL_CUDA_TRY(cudaEventRecord(cs->compute_mark, cs->compute));
    KPL_CUDA_TRY(cudaStreamWaitEvent(cs->copy, cs->compute_mark, 0));
    KPL_CUDA_TRY(cudaMemcpyAsync(dst, src, n, kind, cs->copy));
    KPL_CUDA_TRY(cudaStreamSynchronize(cs->copy));
    return KPL_OK;
}

static kpl_status cuda_copy_h2d(kpl_device *dev, void *dst, const void *src, size_t n)
{
    return copy_host(dev, dst, src, n, cudaMemcpyHostToDevice);
}

static kpl_status cuda_copy_d2h(kpl_device *dev, void *dst, const void *src, size_t n)
{
    return copy_host(dev, dst, src, n, cudaMemcpyDeviceToHost);
}

static kpl_status cuda_copy_d2d(kpl_device *dev, void *dst, const void *src, size_t n)
{
    if (n == 0) return KPL_OK;
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    KPL_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, cs->compute));
    return KPL_OK;
}

static kpl_status cuda_synchronize(kpl_device *dev)
{
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter(dev, &cs));
    KPL_CUDA_TRY(cudaStreamSynchronize(cs->compute));
    KPL_CUDA_TRY(cudaStreamSynchronize(cs->copy));
    return KPL_OK;
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
