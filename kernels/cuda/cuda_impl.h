/*
 * cuda_impl.h — private to kernels/cuda/: the per-device state of the CUDA
 * backend and what its kernel files share (error conversion, launch
 * geometry, broadcast-plan offsets on the device).
 *
 * Only CUDA C++ sources include this header.  They reach tensors through the
 * public accessors of kernels.h (struct kpl_tensor is C-only on purpose) and
 * their device through kpl_tensor_device(t)->impl.
 *
 * Streams: every kernel, memset, device-to-device copy and cuBLAS call of a
 * device runs on its compute stream, so they are ordered among themselves
 * and nothing here waits for the GPU.  Host transfers run on the copy
 * stream, ordered with the compute stream by events (cuda_device.cu).
 */
#ifndef KPL_CUDA_IMPL_H
#define KPL_CUDA_IMPL_H

#include "kernels_impl.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

/* ---- deferred index checks ------------------------------------------------------------ */

/* The index kernels (plane_gather/scatter, index_select/add, gather/
 * scatter_add) check their indices on the device and do not wait for the
 * answer: a bad index is written into the device's record, and the next
 * synchronisation that brings a value to the host anyway (a device-to-host
 * copy, kpl_device_synchronize) reads the record and fails with
 * KPL_ERANGE naming the call that met it.  So checking costs no wait on
 * the stream (a training step reads its loss once; before, every max-pool
 * and cross-entropy backward waited for the GPU). */
typedef struct {
    unsigned long long ticket; /* the first failing call in stream order (0: none) */
    unsigned long long count;  /* bad indices met, by every failing call since the reset */
    unsigned long long pos;    /* that call's smallest bad position in idx (~0: none) */
    long long value;           /* the index found there */
} kpl_cuda_check_rec;

/* What a report says about a call: kept on the host by ticket. */
typedef struct {
    unsigned long long ticket;
    const char *op;               /* static string */
    int64_t range;                /* valid indices are [0, range) */
    int ndim;                     /* idx's shape, to name the position */
    int64_t shape[KPL_MAX_DIMS];
    char where[64];               /* e.g. "along axis 2 of x (3,4,9,11)" */
} kpl_cuda_check_desc;

#define KPL_CUDA_CHECK_RING 64 /* calls remembered for reports */

/* Backend state of one CUDA device, owned by kpl_device.impl. */
typedef struct {
    cudaStream_t compute;    /* kernels, memsets, d2d copies, cuBLAS */
    cudaStream_t copy;       /* host <-> device transfers */
    cudaEvent_t compute_mark; /* recorded on compute, awaited by copy */
    cudaEvent_t upload_done;  /* recorded on copy after an upload, awaited by compute */
    cudaMemPool_t stage_pool; /* device staging of large uploads (NULL: not supported) */
    int uploads_pending;      /* an upload may still read host memory (atomic) */
    /* the bounded pinned staging of pageable transfers (cuda_device.cu) */
    pthread_mutex_t host_stage_lock;
    void *host_stage;         /* two halves of KPL_CUDA_STAGE bytes, pinned */
    cudaEvent_t host_stage_ev[2];
    cublasHandle_t blas;     /* bound to `compute` */
    cudnnHandle_t dnn;       /* bound to `compute`; created at first use */
    int sm_count;            /* multiprocessors, for grid sizes */
    int cc_major;            /* compute capability (8 = Ampere) */
    /* deferred index checks (cuda_device.cu) */
    kpl_cuda_check_rec *check;      /* device memory */
    kpl_cuda_check_rec *check_host; /* pinned mirror, written by the reads */
    pthread_mutex_t check_lock;     /* guards the fields below */
    unsigned long long check_issued; /* last ticket handed out */
    unsigned long long check_read;   /* every ticket up to this one has been read */
    kpl_cuda_check_desc check_ring[KPL_CUDA_CHECK_RING];
} kpl_cuda_state;

extern "C" {

/* Records a failed CUDA runtime / cuBLAS call (its text, the library's
 * message, file:line) as this thread's error and returns the status:
 * KPL_ENOMEM for allocation failures, KPL_EDEVICE when the device or driver
 * is unusable, KPL_EBACKEND otherwise. */
kpl_status kpl__cuda_fail(cudaError_t err, const char *call, const char *file,
                          int line);
kpl_status kpl__cublas_fail(cublasStatus_t err, const char *call,
                            const char *file, int line);

/* Makes dev current for this thread (cudaSetDevice) and returns its state;
 * every entry point calls this before touching the GPU. */
kpl_status kpl__cuda_enter(kpl_device *dev, kpl_cuda_state **out);

/* The state of the device a tensor lives on, made current. */
kpl_status kpl__cuda_enter_tensor(const kpl_tensor *t, kpl_cuda_state **out);

/* Makes the output's device current and fetches device pointers: `out`
 * (written) and in[0..nin-1] (read), with the UnifiedMemory state kept
 * right.  Every kernel entry point starts with it. */
kpl_status kpl__cuda_pointers(const kpl_kernel_args *args, int nin, kpl_cuda_state **cs,
                              void **out, const void **in);

/* Starts a deferred check of the indices of one call on dev: remembers
 * desc (its ticket field is set here) and gives the record and ticket the
 * kernel passes to kpl_cuda_check_fail.  kpl__cuda_check_end, after the
 * checking kernels, records the bad value of idx (the call's indices). */
kpl_status kpl__cuda_check_begin(kpl_cuda_state *cs, kpl_cuda_check_desc *desc,
                                 kpl_cuda_check_rec **rec, unsigned long long *ticket);
kpl_status kpl__cuda_check_end(kpl_cuda_state *cs, unsigned long long ticket,
                               const int64_t *idx);

/* Reports a failed kernel launch (cudaGetLastError) naming `what`. */
kpl_status kpl__cuda_check_launch(const char *what, const char *file, int line);

/* Blocks for a grid-stride loop over n items with `threads` per block:
 * enough to fill the device, never more than the items need, at least 1. */
unsigned kpl__cuda_blocks(const kpl_cuda_state *cs, int64_t n, int threads);

/* The device's cuDNN handle, bound to its compute stream, created at first
 * use (cuda_conv.cu).  Thread-safe. */
kpl_status kpl__cuda_dnn(kpl_cuda_state *cs, cudnnHandle_t *out);

/* plane_gather / plane_scatter, the index kinds of POOL2D (cuda_index.cu). */
kpl_status kpl__cuda_plane_index(const kpl_kernel_args *args);

/* Per-file kernel registration, called by the backend's register_kernels. */
void kpl__cuda_register_conv(void);
void kpl__cuda_register_index(void);
void kpl__cuda_register_eltwise(void);
void kpl__cuda_register_reduce(void);
void kpl__cuda_register_matmul(void);
void kpl__cuda_register_misc(void);
void kpl__cuda_register_nn(void);
void kpl__cuda_register_vision(void);
/* cuDNN convolution algorithm cache counters (cuda_conv.cu). */
kpl_algo_cache_stats kpl__cuda_conv_cache_stats(void);

} /* extern "C" */

#define KPL_CUDA_TRY(call)                                                \
    do {                                                                  \
        cudaError_t kpl_cu_err_ = (call);                                 \
        if (kpl_cu_err_ != cudaSuccess)                                   \
            return kpl__cuda_fail(kpl_cu_err_, #call, __FILE__, __LINE__); \
    } while (0)

#define KPL_CUBLAS_TRY(call)                                                \
    do {                                                                    \
        cublasStatus_t kpl_cb_err_ = (call);                                \
        if (kpl_cb_err_ != CUBLAS_STATUS_SUCCESS)                           \
            return kpl__cublas_fail(kpl_cb_err_, #call, __FILE__, __LINE__); \
    } while (0)

/* A cuDNN call inside a function with `kpl_status st` and a `fail:` label. */
#define KPL_CUDNN_TRY(call)                                                              \
    do {                                                                                 \
        cudnnStatus_t dn_ = (call);                                                      \
        if (dn_ != CUDNN_STATUS_SUCCESS) {                                               \
            st = KPL_ERROR(dn_ == CUDNN_STATUS_ALLOC_FAILED ? KPL_ENOMEM : KPL_EBACKEND, \
                           "%s failed: %s", #call, cudnnGetErrorString(dn_));            \
            goto fail;                                                                   \
        }                                                                                \
    } while (0)

#define KPL_CUDA_LAUNCHED(what) kpl__cuda_check_launch((what), __FILE__, __LINE__)

/* Threads per block of the element-wise kernels. */
#define KPL_CUDA_THREADS 256

/* Grid-stride loop over [0, n) with 64-bit indices. */
#define KPL_CUDA_FOR(i, n)                                                        \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);     \
         i += (int64_t)gridDim.x * blockDim.x)

/* In a kernel of call `ticket`: index position p is out of range. */
__device__ __forceinline__ void kpl_cuda_check_fail(kpl_cuda_check_rec *r,
                                                    unsigned long long ticket,
                                                    unsigned long long p)
{
    atomicAdd(&r->count, 1ull);
    unsigned long long prev = atomicCAS(&r->ticket, 0ull, ticket);
    if (prev == 0ull || prev == ticket) atomicMin(&r->pos, p);
}

/* Offsets of output element `flat` in the first K inputs of a plan (the
 * device twin of kpl__plan_offset, all inputs in one pass).  A plan of one
 * dim, the common case after collapsing, needs no division. */
template <int K>
__device__ __forceinline__ void kpl_cuda_plan_offsets(const kpl_ew_plan &p, int64_t flat,
                                                      int64_t off[K])
{
#pragma unroll
    for (int k = 0; k < K; k++) off[k] = 0;
    if (p.ndim == 1) {
#pragma unroll
        for (int k = 0; k < K; k++) off[k] = flat * p.stride[k][0];
        return;
    }
#pragma unroll
    for (int d = KPL_MAX_DIMS - 1; d >= 0; d--) {
        if (d >= p.ndim) continue;
        int64_t n = p.shape[d];
        int64_t q = flat / n;
        int64_t i = flat - q * n;
        flat = q;
#pragma unroll
        for (int k = 0; k < K; k++) off[k] += i * p.stride[k][d];
    }
}

#endif /* KPL_CUDA_IMPL_H */
